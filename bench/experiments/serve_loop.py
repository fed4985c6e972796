"""Where the serving loop's time goes at concurrency 1: a timeline of its decode rounds.

    python3 bench/experiments/serve_loop.py --out $OUT/serve_loop.json                # the GPU run
    python3 bench/experiments/serve_loop.py --smoke --out /tmp/serve_loop.json        # CPU, debug preset

First, whether a call blocks the thread that dispatches it: a jitted loop of `--probe-iters` matmuls
with its trip count an argument (a `while` whose predicate the host reads each iteration on XLA GPU)
and with it fixed at trace time; the time until the call returns against the time until its result
is ready.

Then an `Engine` (Ling-3.0-tiny shape, random bf16 weights, one slot, `--decode-steps` per call)
serves `--requests` requests of `--context` random prompt tokens and `--output` new tokens one after
another (after one that compiles), read as `bench/serve.py` reads them (asyncio) or, `--reader
thread`, by a blocking iterator. Its methods are wrapped to time each decode round: the dispatch of
`device.decode_steps` (until the call returns), the wait for the previous call's tokens, their
delivery, and the rest of each loop iteration. Reported per request: time per output token; per
round (medians): the period between dispatches, each part, and steps per call. `--prefix-cache`: the
engine with its prefix cache, whose decode calls take an output snapshot at each page boundary.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from bench.common import machine, random_params, write_json
from ling_jax.config import LingConfig
from ling_jax.engine import Engine, SamplingParams, device
from ling_jax.params import init_params


def dispatch_probe(n: int, iters: int) -> dict[str, float]:
    """ms until a call returns and until its result is ready, for a loop of `iters` [n, n] matmuls with
    a dynamic trip count and a static one (medians of 5 after a compiling call)."""
    x = jnp.ones((n, n), jnp.bfloat16) / n

    @jax.jit
    def dynamic(x: jax.Array, k: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, k, lambda i, y: (y @ x).astype(x.dtype), x)

    @jax.jit
    def static(x: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, iters, lambda i, y: (y @ x).astype(x.dtype), x)

    out: dict[str, float] = {}
    for name, call in (("dynamic", lambda: dynamic(x, jnp.int32(iters))), ("static", lambda: static(x))):
        jax.block_until_ready(call())
        back, ready = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            r = call()
            t1 = time.perf_counter()
            jax.block_until_ready(r)
            back.append(t1 - t0)
            ready.append(time.perf_counter() - t0)
        out[f"{name}_returns_ms"] = 1e3 * statistics.median(back)
        out[f"{name}_ready_ms"] = 1e3 * statistics.median(ready)
    return out


class Timeline:
    """Wraps `device.decode_steps`, `Engine._deliver` and `Engine._iterate` to record their times."""

    def __init__(self) -> None:
        self.dispatch: list[tuple[float, float, int]] = []  # (start, end, steps)
        self.deliver: list[tuple[float, float, float]] = []  # (start, tokens ready, end)
        self.iterate: list[tuple[float, float]] = []
        self.recording = False
        decode_steps, deliver, iterate = device.decode_steps, Engine._deliver, Engine._iterate

        def timed_decode_steps(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            r = decode_steps(*a, **k)
            if self.recording:
                self.dispatch.append((t0, time.perf_counter(), a[2]))
            return r

        def timed_deliver(engine: Engine, out: Any, *rest: Any) -> None:
            t0 = time.perf_counter()
            jax.block_until_ready(out)
            t1 = time.perf_counter()
            deliver(engine, out, *rest)
            if self.recording:
                self.deliver.append((t0, t1, time.perf_counter()))

        def timed_iterate(engine: Engine) -> bool:
            t0 = time.perf_counter()
            r = iterate(engine)
            if self.recording:
                self.iterate.append((t0, time.perf_counter()))
            return r

        device.decode_steps = timed_decode_steps
        Engine._deliver = timed_deliver  # type: ignore[method-assign]
        Engine._iterate = timed_iterate  # type: ignore[method-assign]

    def rounds(self, t0: float, t1: float) -> dict[str, Any]:
        """Medians (ms) over the decode rounds that start within [t0, t1]."""
        d = [r for r in self.dispatch if t0 <= r[0] <= t1]
        v = [r for r in self.deliver if t0 <= r[0] <= t1]
        it = [r for r in self.iterate if t0 <= r[0] <= t1]
        med = lambda xs: 1e3 * statistics.median(xs) if xs else None  # noqa: E731
        return {"calls": len(d), "steps_per_call": statistics.median([s for *_, s in d]) if d else None,
                "period_ms": med([b[0] - a[0] for a, b in itertools.pairwise(d)]),
                "dispatch_ms": med([b - a for a, b, _ in d]),
                "wait_for_tokens_ms": med([b - a for a, b, _ in v]),
                "deliver_ms": med([c - b for _, b, c in v]),
                "iteration_ms": med([b - a for a, b in it])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--reader", choices=("asyncio", "thread"), default="asyncio")
    ap.add_argument("--probe-size", type=int, default=4096)
    ap.add_argument("--probe-iters", type=int, default=64)
    ap.add_argument("--prefix-cache", action="store_true",
                    help="the engine with its prefix cache and output snapshots (one per page of output)")
    ap.add_argument("--smoke", action="store_true", help="debug preset, small shapes (CPU check)")
    args = ap.parse_args()
    preset = "debug" if args.smoke else "ling-3.0-tiny"
    cfg = LingConfig.preset(preset)
    if args.smoke:
        args.context, args.output, args.prefill_chunk, args.probe_size, args.probe_iters = 32, 24, 16, 64, 4
        params = init_params(cfg, seed=0, dtype="float32")
    else:
        params = random_params(cfg, jnp.bfloat16)
    result: dict[str, Any] = {**machine(), "preset": preset, "context": args.context, "output": args.output,
                              "decode_steps": args.decode_steps, "reader": args.reader,
                              "prefix_cache": args.prefix_cache,
                              "dispatch_probe": dispatch_probe(args.probe_size, args.probe_iters)}
    print("dispatch probe (ms):", result["dispatch_probe"], flush=True)

    timeline = Timeline()
    max_len = -(-(args.context + args.output + args.decode_steps) // 64) * 64
    engine = Engine(cfg, params, max_batch=1, max_len=max_len, prefill_chunk=args.prefill_chunk,
                    decode_steps=args.decode_steps, prefix_cache=args.prefix_cache, prefix_cache_gb=1.0)
    engine.start()
    rng = np.random.default_rng(0)
    sampling = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)

    async def read(handle: Any) -> None:
        async for _ in handle:
            pass

    def one() -> Any:
        handle = engine.submit(rng.integers(0, cfg.vocab_size, args.context).tolist(), sampling)
        if args.reader == "asyncio":
            asyncio.run(read(handle))
        else:
            for _ in handle:
                pass
        return handle

    try:
        t = time.perf_counter()
        one()  # compiles
        print(f"first request (compiles): {time.perf_counter() - t:.1f} s", flush=True)
        timeline.recording = True
        runs = []
        for _ in range(args.requests):
            h = one()
            tpot = (h.finished_at - h.first_token_at) / (args.output - 1)
            runs.append({"tpot_ms": 1e3 * tpot, "ttft_s": h.first_token_at - h.submitted,
                         **timeline.rounds(h.submitted, h.finished_at)})  # its first call precedes its first token
            print(runs[-1], flush=True)
        result["stats"] = engine.stats()
    finally:
        engine.shutdown(0.0)
    result["requests"] = runs
    write_json(args.out, result)


if __name__ == "__main__":
    main()

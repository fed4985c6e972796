"""Which engine call compiles again after it was compiled once, and under what: the order of calls,
the thread that makes them.

    python3 bench/experiments/compile_probe.py --out $OUT/compile_probe.json               # the GPU run
    python3 bench/experiments/compile_probe.py --smoke --out /tmp/compile_probe.json       # CPU, debug preset

An `Engine` (Ling-3.0-tiny shape cut to `--layers` layers, random bf16 weights, 16 slots, decode
buckets 1 and 16), not warmed up: its compiled functions are called directly, in this order, each
call's XLA compilations (JAX's `jax_log_compiles` lines) recorded:

    prefill (1 x --chunk) twice; a 1-step decode call over 16 slots; the prefill again; 1-step and
    `--decode-steps`-step calls over 1 slot; the prefill again   -- all in the main thread
    the same prefill and decode calls, each in a new thread
    the request's sampling key; one request of --chunk prompt tokens through the started engine (its
    own serving thread)

A call that compiles where the same call compiled before names what the compilation cache is keyed
on beyond the arguments (`bench/serve.py` records that a prefill call compiles during a GPU run
although its arguments and its `jax_log_compiles` line equal a warm-up call's: the Pallas TPU module,
first imported while the first prefill was traced, had added a trace-context state; `ops/platform.py` now
imports it before any trace). Also reported: JAX's
trace context in the main thread and in a new one, and JAX's explanation of each cache miss
(`jax_explain_cache_misses`) per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import machine, random_params, write_json
from ling_jax.config import LingConfig
from ling_jax.engine import Engine, SamplingParams, device
from ling_jax.engine.engine import _key_data
from ling_jax.params import init_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=512, help="the prefill chunk (and the request's prompt)")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="debug preset, small shapes (CPU check)")
    args = ap.parse_args()
    if args.smoke:
        cfg, args.chunk = LingConfig.preset("debug"), 32
        params = init_params(cfg, seed=0, dtype="bfloat16")
    else:
        cfg = dataclasses.replace(LingConfig.preset("ling-3.0-tiny"), num_hidden_layers=args.layers)
        params = random_params(cfg, jnp.bfloat16)

    lines: list[str] = []
    misses: list[str] = []

    class Compiles(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("Compiling"):
                lines.append(message.split(" with global")[0].removeprefix("Compiling "))
            elif "CACHE MISS" in message:
                misses.append(message[:2000])

    logging.getLogger("jax").addHandler(Compiles())
    jax.config.update("jax_log_compiles", True)
    jax.config.update("jax_explain_cache_misses", True)
    e = Engine(cfg, params, max_batch=16, max_len=4 * args.chunk, page_size=64, prefill_chunk=args.chunk,
               decode_steps=args.decode_steps, decode_buckets=[1])
    table, follow = np.zeros((16, e.max_pages), np.int32), np.zeros(16, bool)

    def prefill() -> None:
        e.cache, e.staging, e.drafting, out = device.prefill_chunk(
            cfg, e.k_prefill, False, e.unroll_prefill, e.params, e.cache, e.staging, e.drafting,
            *e._prefill_args(1, args.chunk, []))
        jax.block_until_ready(out)

    def decode(rows: int, steps: int) -> Callable[[], None]:
        def run() -> None:
            e.cache, out = e._decode(steps, False, table[:rows], follow[:rows], [], False)
            jax.block_until_ready(out)
        return run

    def in_thread(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            t = threading.Thread(target=fn)
            t.start()
            t.join()
        return run

    steps: list[dict[str, Any]] = []

    def step(name: str, fn: Callable[[], None]) -> None:
        n, m, t0 = len(lines), len(misses), time.perf_counter()
        fn()
        steps.append({"call": name, "s": time.perf_counter() - t0, "compiled": lines[n:], "cache_misses": misses[m:]})
        print(f"{name}: {steps[-1]['s']:.2f} s, compiled {steps[-1]['compiled']}", flush=True)

    from jax._src import config as jax_config  # the trace context the caches are keyed on

    other: list[Any] = []
    t = threading.Thread(target=lambda: other.append(jax_config.trace_context()))
    t.start()
    t.join()
    context = {"main": str(jax_config.trace_context()), "new_thread": str(other[0]),
               "equal": other[0] == jax_config.trace_context()}
    print("trace context equal across threads:", context["equal"], flush=True)
    s = args.decode_steps
    step("prefill", prefill)
    step("prefill again", prefill)
    step("decode 16 slots x 1", decode(16, 1))
    step("prefill after a 16-slot decode", prefill)
    step("decode 1 slot x 1", decode(1, 1))
    step(f"decode 1 slot x {s}", decode(1, s))
    step("prefill after a 1-slot decode", prefill)
    step("prefill, new thread", in_thread(prefill))
    step("decode 16 slots x 1, new thread", in_thread(decode(16, 1)))
    step(f"decode 1 slot x {s}, new thread", in_thread(decode(1, s)))
    step("prefill after a 1-slot decode, new thread", in_thread(prefill))
    prompt = [i % cfg.vocab_size for i in range(1, args.chunk + 1)]
    step("the request's sampling key", lambda: _key_data(0, np.asarray(prompt, np.int32)))
    e.start()
    try:
        step("one request through the engine's thread",
             lambda: e.submit(prompt, SamplingParams(max_tokens=2 * s + 2, ignore_eos=True)).result())
    finally:
        e.shutdown(0.0)
    write_json(args.out, {**machine(), "layers": cfg.num_hidden_layers, "chunk": args.chunk, "trace_context": context,
                          "steps": steps})


if __name__ == "__main__":
    main()

"""Serving benchmark: a load generator against ling-serve or an in-process engine, and the same
requests through static `ling_jax.generate` batches for comparison.

    python -m bench.serve --preset ling-3.0-tiny --random-weights --concurrency 16 --num-requests 128 \\
        --prompt-len 128:1024 --output-len 64:512 --static --out bench/results/serve_tiny_h100.json
    python -m bench.serve --url http://127.0.0.1:8000 --vocab-size 157184 --rate 4 --num-requests 200 --out ...
    python -m bench.serve --preset debug --random-weights --num-requests 8 --concurrency 4 --prompt-len 4:12 \\
        --output-len 2:8 --static --dtype float32 --out /tmp/serve_smoke.json          # CPU, seconds

Requests: `--num-requests` prompts of random token ids (lengths uniform in `--prompt-len LO:HI`),
each generating exactly its own number of tokens (uniform in `--output-len`; greedy, `ignore_eos`),
all drawn from `--seed`. Arrivals: `--concurrency C` keeps C requests in flight (a closed loop: the
next starts when one ends), or `--rate R` submits at Poisson times of R requests/s whatever is in
flight (an open loop). The target: `--url` (a running ling-serve; streamed /v1/completions with
token-id prompts and `return_token_ids`), or an engine built in this process from `--preset NAME
--random-weights` (random weights from the param table: generated on the device,
`bench.common.random_params`, or on the host where the device is the CPU, `init_params`) or
`--checkpoint DIR`, compiled and warmed up before the clock starts.

Reported, for the run: request throughput, output tokens/s, total (prompt + output) tokens/s over
the whole run (first submission to last finish), and per request TTFT (submission to first new
token), time per output token (first to last token, per token after the first) and end-to-end
latency, each as p50 / p99 (seconds). `--static` (in-process targets) then runs the same requests
through `ling_jax.generate` in batches of the concurrency (in order; each batch generates as many
tokens as its longest request, and only each request's own count is counted as output), after an
untimed pass that compiles every batch shape (`--scan-layers`: the decode step with layer scans,
as ling-generate's flag); a static request's tokens arrive with its batch's
end, so its TTFT is its batch's time and it has no time per output token. The JSON result holds
the machine (device, versions, date, command, commit), the arguments, both runs and the ratio of
their output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` and `serve` run as a script


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclasses.dataclass
class Result:
    """One request's measurements (seconds, perf_counter clock); ttft None when no token came."""

    start: float
    end: float
    ttft: float | None
    n_prompt: int
    n_out: int

    @property
    def tpot(self) -> float | None:
        return None if self.ttft is None or self.n_out < 2 else (self.end - self.start - self.ttft) / (self.n_out - 1)


def parse_range(text: str) -> tuple[int, int]:
    """'LO:HI' (or 'N') -> (LO, HI) with 1 <= LO <= HI; ValueError otherwise."""
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{text!r} is not LO:HI (integers)") from None
    if not 1 <= a <= b:
        raise ValueError(f"{text!r}: need 1 <= LO <= HI")
    return a, b


def make_requests(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int) -> list[Request]:
    """`n` requests of random token ids in [0, vocab); lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(0, vocab, int(rng.integers(prompt_len[0], prompt_len[1] + 1))).tolist(),
                    int(rng.integers(output_len[0], output_len[1] + 1))) for _ in range(n)]


def percentiles(xs: Sequence[float | None]) -> dict[str, float | None]:
    vals = sorted(x for x in xs if x is not None)
    if not vals:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(vals, 50)), "p99": float(np.percentile(vals, 99))}


def summarize(results: Sequence[Result]) -> dict[str, Any]:
    """Throughputs over the whole run and per-request latency percentiles."""
    t0, t1 = min(r.start for r in results), max(r.end for r in results)
    dur = t1 - t0
    n_out, n_prompt = sum(r.n_out for r in results), sum(r.n_prompt for r in results)
    return {"requests": len(results), "duration_s": dur, "request_throughput": len(results) / dur,
            "output_tokens": n_out, "prompt_tokens": n_prompt, "output_tokens_per_s": n_out / dur,
            "total_tokens_per_s": (n_out + n_prompt) / dur, "ttft_s": percentiles([r.ttft for r in results]),
            "tpot_s": percentiles([r.tpot for r in results]),
            "e2e_s": percentiles([r.end - r.start for r in results]),
            "mean_e2e_s": statistics.fmean(r.end - r.start for r in results)}


async def drive(requests: Sequence[Request], one: Callable[[Request], Awaitable[Result]], *,
                concurrency: int | None = None, rate: float | None = None, seed: int = 0) -> list[Result]:
    """Runs `one` over the requests: `concurrency` at a time (closed loop), or submitted at Poisson
    arrival times of `rate` per second (open loop). Results in request order."""
    results: list[Result | None] = [None] * len(requests)
    if rate is not None:
        gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, len(requests))
        t0 = time.perf_counter()
        tasks = []
        for req, at in zip(requests, np.cumsum(gaps), strict=True):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(req)))
        for i, task in enumerate(tasks):
            results[i] = await task
        return results  # type: ignore[return-value]
    queue = list(enumerate(requests))[::-1]

    async def worker() -> None:
        while queue:
            i, req = queue.pop()
            results[i] = await one(req)

    await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
    return results  # type: ignore[return-value]


def engine_runner(engine: Any) -> Callable[[Request], Awaitable[Result]]:
    """One request through an in-process engine (the handle's own times)."""
    from ling_jax.engine import SamplingParams

    async def one(req: Request) -> Result:
        handle = engine.submit(req.prompt, SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True))
        n = 0
        async for _ in handle:
            n += 1
        if handle.finish_reason != "length":
            raise RuntimeError(f"request {handle.id} ended with {handle.finish_reason}: {handle.error}")
        ttft = None if handle.first_token_at is None else handle.first_token_at - handle.submitted
        return Result(handle.submitted, handle.finished_at, ttft, len(req.prompt), n)

    return one


def http_runner(client: Any, url: str, model: str | None) -> Callable[[Request], Awaitable[Result]]:
    """One request through a server's streamed /v1/completions (token ids counted from return_token_ids)."""

    async def one(req: Request) -> Result:
        body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        if model:
            body["model"] = model
        start, first, n = time.perf_counter(), None, 0
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"the server failed a request: {event['error']['message']}")
                got = sum(len(c.get("token_ids", ())) for c in event["choices"])
                if got and first is None:
                    first = time.perf_counter() - start
                n += got
        return Result(start, time.perf_counter(), first, len(req.prompt), n)

    return one


def run_static(cfg: Any, params: Any, requests: Sequence[Request], batch: int,
               unroll_layers: bool = True) -> dict[str, Any]:
    """The requests through `ling_jax.generate` in batches of `batch` (see the module doc)."""
    import ling_jax

    batches = [requests[i: i + batch] for i in range(0, len(requests), batch)]

    def call(b: Sequence[Request]) -> list[list[int]]:
        return ling_jax.generate(cfg, params, [r.prompt for r in b], max_new_tokens=max(r.max_tokens for r in b),
                                 stop_tokens=(), unroll_layers=unroll_layers)

    for b in batches:  # compiles every shape
        call(b)
    results = []
    for b in batches:
        t0 = time.perf_counter()
        outs = call(b)
        t1 = time.perf_counter()
        results += [Result(t0, t1, t1 - t0, len(r.prompt), min(r.max_tokens, len(o))) for r, o in zip(b, outs,
                                                                                                       strict=True)]
    out = summarize(results)
    out["tpot_s"] = {"p50": None, "p99": None}
    out["generated_tokens"] = sum(len(b) * max(r.max_tokens for r in b) for b in batches)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench/serve.py", description=__doc__.split("\n\n")[0])
    target = ap.add_argument_group("target (one of)")
    target.add_argument("--url", help="a running ling-serve, e.g. http://127.0.0.1:8000")
    target.add_argument("--preset", help="config preset of an in-process engine (with --random-weights), or the "
                        "vocabulary of --url's model")
    target.add_argument("--random-weights", action="store_true", help="random weights (on the device) for --preset")
    target.add_argument("--checkpoint", help="HF or Orbax checkpoint of an in-process engine")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="the served model name (--url)")
    ap.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn below this (--url "
                    "without --preset)")
    ap.add_argument("--num-requests", type=int, default=64)
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="requests in flight (closed loop; default 8)")
    load.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (open loop)")
    ap.add_argument("--prompt-len", default="128:512", help="LO:HI prompt tokens")
    ap.add_argument("--output-len", default="64:256", help="LO:HI new tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--static", action="store_true", help="also run the requests through static generate batches")
    ap.add_argument("--scan-layers", action="store_true", help="--static: the decode step with layer scans")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-batch", type=int, default=None, help="engine slots (default: the concurrency, or 8)")
    ap.add_argument("--max-len", type=int, default=None, help="engine max_len (default: the longest request)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--speculative-tokens", type=int, default=0)
    ap.add_argument("--prefix-cache", action="store_true")
    ap.add_argument("--out", default="bench/results/serve.json")
    return ap


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp

    from bench.common import random_params
    from ling_jax.config import LingConfig
    from ling_jax.params import init_params
    from serve.generate import load_any

    if args.checkpoint:
        return load_any(Path(args.checkpoint), args.dtype)
    cfg = LingConfig.preset(args.preset)
    if jax.default_backend() == "cpu":  # no device to generate on: numpy, without a compile per leaf shape
        return cfg, init_params(cfg, seed=0, dtype=jnp.dtype(args.dtype))
    return cfg, random_params(cfg, jnp.dtype(args.dtype))


def main(argv: list[str] | None = None, *, engine_cls: Callable[..., Any] | None = None) -> int:
    """The script; `engine_cls` (default `ling_jax.engine.Engine`) builds an in-process engine."""
    ap = _parser()
    args = ap.parse_args(argv)
    in_process = bool(args.checkpoint or args.random_weights)
    if bool(args.url) == in_process:
        ap.error("give --url, or --preset NAME --random-weights, or --checkpoint DIR")
    if args.random_weights and not args.preset:
        ap.error("--random-weights needs --preset")
    if args.static and not in_process:
        ap.error("--static needs an in-process model (--preset --random-weights or --checkpoint)")
    if args.url and not (args.preset or args.vocab_size):
        ap.error("--url needs --vocab-size (or --preset) to draw token ids")
    try:
        prompt_len, output_len = parse_range(args.prompt_len), parse_range(args.output_len)
    except ValueError as e:
        ap.error(str(e))
    if args.num_requests < 1 or (args.concurrency is not None and args.concurrency < 1) or \
            (args.rate is not None and not args.rate > 0):
        ap.error("--num-requests and --concurrency must be >= 1, --rate > 0")
    concurrency = args.concurrency or (None if args.rate else 8)

    from bench.common import machine, write_json
    from ling_jax.config import LingConfig

    result: dict[str, Any] = {**machine(), "args": vars(args)}
    if in_process:
        cfg, params = _load(args)
        vocab = cfg.vocab_size
    else:
        vocab = args.vocab_size or LingConfig.preset(args.preset).vocab_size
    requests = make_requests(args.num_requests, prompt_len, output_len, vocab, args.seed)
    mode = {"concurrency": concurrency} if args.rate is None else {"rate": args.rate}
    result["load"] = {**mode, "prompt_len": prompt_len, "output_len": output_len}

    if args.url:
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

        async def over_http() -> list[Result]:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits) as client:
                return await drive(requests, http_runner(client, args.url.rstrip("/"), args.model),
                                   concurrency=concurrency, rate=args.rate, seed=args.seed)

        result["server"] = summarize(asyncio.run(over_http()))
    else:
        max_batch = args.max_batch or concurrency or 8
        max_len = args.max_len or -(-(prompt_len[1] + output_len[1]) // args.page_size) * args.page_size
        if engine_cls is None:
            from ling_jax.engine import Engine

            engine_cls = Engine
        t0 = time.perf_counter()
        engine = engine_cls(cfg, params, max_batch=max_batch, max_len=max_len, page_size=args.page_size,
                            speculative_tokens=args.speculative_tokens, prefix_cache=args.prefix_cache)
        if hasattr(engine, "warmup"):  # compiles every serving shape these requests use (no log-probabilities)
            engine.warmup(logprobs=False)
        engine.start()
        result["engine_start_s"] = time.perf_counter() - t0  # construction and compilation
        print(f"engine: {max_batch} slots, max_len {max_len}, ready in {result['engine_start_s']:.1f} s", flush=True)
        try:
            results = asyncio.run(drive(requests, engine_runner(engine), concurrency=concurrency, rate=args.rate,
                                        seed=args.seed))
            result["engine"] = {**summarize(results), "max_batch": max_batch, "max_len": max_len,
                                "stats": engine.stats()}
        finally:
            engine.shutdown(0.0)
        del engine
        write_json(args.out, result)
        print(f"engine: {len(requests)} requests in {result['engine']['duration_s']:.1f} s", flush=True)
        if args.static:
            result["static"] = run_static(cfg, params, requests, concurrency or max_batch,
                                          unroll_layers=not args.scan_layers)
            result["output_tokens_per_s_vs_static"] = (result["engine"]["output_tokens_per_s"]
                                                       / result["static"]["output_tokens_per_s"])
    for name in ("server", "engine", "static"):
        if name in result:
            r = result[name]
            print(f"{name:>6}: {r['requests']} requests in {r['duration_s']:.2f} s: {r['request_throughput']:.2f} "
                  f"req/s, {r['output_tokens_per_s']:.1f} output tokens/s, {r['total_tokens_per_s']:.1f} total "
                  f"tokens/s; TTFT p50 {r['ttft_s']['p50']}, TPOT p50 {r['tpot_s']['p50']}")
    with contextlib.suppress(KeyError):
        print(f"engine / static output tokens/s: {result['output_tokens_per_s_vs_static']:.2f}x")
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

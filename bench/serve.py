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

Prefix-cache workloads: `--shared-prefix N` starts every request's prompt with the same N random
tokens (then its own, from `--prompt-len`); `--multi-turn T` makes each of the `--num-requests` a
conversation of T turns, a turn's prompt being the previous turn's prompt + its output + new tokens
from `--prompt-len` (a conversation's turns in order, conversations concurrently: `--concurrency` /
`--rate` count conversations). Each run reports the prefix cache's part where the target tells it
(the engine's `cached_tokens`, the server's `usage.prompt_tokens_details`): cached prompt tokens,
requests with a hit and the hit rate (cached prompt tokens / prompt tokens), and an in-process
engine's `stats()`. `--compare-prefix-cache` (in-process) runs the workload with the cache on
("engine") and then off ("engine_no_prefix_cache"), with the on / off ratios of TTFT p50 / p99 and
tokens/s.

`--also-concurrency C:N ...` (in-process) runs the first N of the requests again at concurrency C for
each pair, with the same engine options ("engine_concurrency_C"); `--decode-buckets` gives the
engine its decode buckets (`Engine(decode_buckets=...)`), so one engine of `--max-batch` slots serves
low concurrencies at a small batch's step.

`--profile DIR` (in-process) traces each engine run's workload with `jax.profiler` into DIR/<run> and
reports where its device time went (`device_timeline`: span, busy and idle seconds, busy seconds per
compiled program, idle gaps by length; `bench.device_profile.timeline`). On an H100 a trace of the
whole concurrency-64 workload (128 requests, ~20 s) ended in CUDA_ERROR_LAUNCH_FAILED, while the
same run untraced completes: trace fewer requests, or a stretch of the run (`--profile-window
START:SECONDS`, seconds from the workload's start; `profiled_s` says when the trace ran).

`--snapshot-timing --preset NAME` (no workload, no weights) times the prefix cache's snapshot save
and restore calls on caches of the preset's shapes (`snapshot_timing`).

`--step-timing` (in-process, no workload) times the decode step with every slot busy: the engine's
(`step_timing`: with its serving loop, pipelined calls of `--decode-steps`) against
`ling_jax.decode.decode_loop`'s at the same batch (`--max-batch`) and context (the top of
`--prompt-len`), over the top of `--output-len` steps, in the same process (the goal: within 10%).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
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
    """One request's measurements (seconds, perf_counter clock); ttft None when no token came; `tokens`
    the new token ids (where the target returns them); `cached` the prompt tokens the target's prefix
    cache served (None where the target does not say)."""

    start: float
    end: float
    ttft: float | None
    n_prompt: int
    n_out: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    cached: int | None = None

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
    return [c[0] for c in make_conversations(n, prompt_len, output_len, vocab, seed)]


def make_conversations(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int,
                       *, shared_prefix: int = 0, turns: int = 1) -> list[list[Request]]:
    """`n` conversations of `turns` turns. Each turn is a `Request` of its own new tokens (random ids in
    [0, vocab), their number uniform in `prompt_len`) and its max_tokens (uniform in `output_len`);
    with `shared_prefix` N every conversation's first turn starts with the same N random tokens (drawn
    first). The prompt a turn is sent with is the previous turn's prompt, that turn's output and the
    turn's own tokens (`run_conversation`). One turn without a shared prefix: `make_requests`'s draws."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, shared_prefix).tolist() if shared_prefix else []
    convs = []
    for _ in range(n):
        conv = [Request(rng.integers(0, vocab, int(rng.integers(prompt_len[0], prompt_len[1] + 1))).tolist(),
                        int(rng.integers(output_len[0], output_len[1] + 1))) for _ in range(turns)]
        convs.append([Request(prefix + conv[0].prompt, conv[0].max_tokens), *conv[1:]])
    return convs


def longest_request(shared_prefix: int, turns: int, prompt_len: tuple[int, int], output_len: tuple[int, int]) -> int:
    """The most tokens (prompt + output) one request of `make_conversations`'s workload can hold."""
    return shared_prefix + turns * (prompt_len[1] + output_len[1])


async def run_conversation(turns: Sequence[Request], one: Callable[[Request], Awaitable[Result]]) -> list[Result]:
    """The turns in order, each sent with the previous turn's prompt and output before its own tokens."""
    history: list[int] = []
    results = []
    for turn in turns:
        prompt = history + turn.prompt
        r = await one(Request(prompt, turn.max_tokens))
        if len(r.tokens) != r.n_out:
            raise RuntimeError("a conversation's next turn needs the token ids of the last one's output")
        history = prompt + r.tokens
        results.append(r)
    return results


def percentiles(xs: Sequence[float | None]) -> dict[str, float | None]:
    vals = sorted(x for x in xs if x is not None)
    if not vals:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(vals, 50)), "p99": float(np.percentile(vals, 99))}


SLOWEST = 5  # requests of longest TTFT `summarize` lists


def summarize(results: Sequence[Result]) -> dict[str, Any]:
    """Throughputs over the whole run and per-request latency percentiles; where the target says how
    many prompt tokens its prefix cache served, "prefix": those tokens, the requests that had any, and
    the hit rate (cached prompt tokens / prompt tokens); "slowest_ttft": the `SLOWEST` requests of
    longest TTFT (start after the run's first, TTFT, prompt and output tokens), where a tail comes from."""
    t0, t1 = min(r.start for r in results), max(r.end for r in results)
    dur = t1 - t0
    n_out, n_prompt = sum(r.n_out for r in results), sum(r.n_prompt for r in results)
    out = {"requests": len(results), "duration_s": dur, "request_throughput": len(results) / dur,
           "output_tokens": n_out, "prompt_tokens": n_prompt, "output_tokens_per_s": n_out / dur,
           "total_tokens_per_s": (n_out + n_prompt) / dur, "ttft_s": percentiles([r.ttft for r in results]),
           "tpot_s": percentiles([r.tpot for r in results]),
           "e2e_s": percentiles([r.end - r.start for r in results]),
           "mean_e2e_s": statistics.fmean(r.end - r.start for r in results),
           "slowest_ttft": [{"start_s": r.start - t0, "ttft_s": r.ttft, "prompt_tokens": r.n_prompt,
                             "output_tokens": r.n_out}
                            for r in sorted(results, key=lambda r: -(r.ttft or 0.0))[:SLOWEST]]}
    if all(r.cached is not None for r in results):
        cached = sum(r.cached or 0 for r in results)
        out["prefix"] = {"cached_prompt_tokens": cached, "requests_with_hit": sum(bool(r.cached) for r in results),
                         "hit_rate": cached / n_prompt}
    return out


async def drive(conversations: Sequence[Sequence[Request]], one: Callable[[Request], Awaitable[Result]], *,
                concurrency: int | None = None, rate: float | None = None, seed: int = 0) -> list[Result]:
    """Runs the conversations (`run_conversation`: a conversation's turns in order) through `one`:
    `concurrency` conversations at a time (closed loop), or each started at Poisson arrival times of
    `rate` per second (open loop). Results in conversation order, each conversation's in turn order."""
    results: list[list[Result] | None] = [None] * len(conversations)
    if rate is not None:
        gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, len(conversations))
        t0 = time.perf_counter()
        tasks = []
        for conv, at in zip(conversations, np.cumsum(gaps), strict=True):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(run_conversation(conv, one)))
        for i, task in enumerate(tasks):
            results[i] = await task
    else:
        queue = list(enumerate(conversations))[::-1]

        async def worker() -> None:
            while queue:
                i, conv = queue.pop()
                results[i] = await run_conversation(conv, one)

        await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
    return [r for conv in results for r in conv or ()]


def engine_runner(engine: Any) -> Callable[[Request], Awaitable[Result]]:
    """One request through an in-process engine (the handle's own times)."""
    from ling_jax.engine import SamplingParams

    async def one(req: Request) -> Result:
        handle = engine.submit(req.prompt, SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True))
        tokens = [out.token_id async for out in handle]
        if handle.finish_reason != "length":
            raise RuntimeError(f"request {handle.id} ended with {handle.finish_reason}: {handle.error}")
        ttft = None if handle.first_token_at is None else handle.first_token_at - handle.submitted
        return Result(handle.submitted, handle.finished_at, ttft, len(req.prompt), len(tokens), tokens,
                      handle.cached_tokens)

    return one


def http_runner(client: Any, url: str, model: str | None) -> Callable[[Request], Awaitable[Result]]:
    """One request through a server's streamed /v1/completions (token ids from return_token_ids, the
    cached prompt tokens from the usage chunk's prompt_tokens_details)."""

    async def one(req: Request) -> Result:
        body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
        if model:
            body["model"] = model
        start, first, tokens, cached = time.perf_counter(), None, [], None
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"the server failed a request: {event['error']['message']}")
                got = [t for c in event["choices"] for t in c.get("token_ids", ())]
                if got and first is None:
                    first = time.perf_counter() - start
                tokens += got
                if event.get("usage"):
                    cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        return Result(start, time.perf_counter(), first, len(req.prompt), len(tokens), tokens, cached)

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


@contextlib.contextmanager
def traced(logdir: str | None, window: tuple[float, float] | None = None) -> Iterator[list[float]]:
    """Traces the block with `jax.profiler` into `logdir` (None: not traced): the whole block or, with
    `window` (start, seconds), only that stretch of it (from the block's start; the trace ends with the
    block if that comes first). Yields a list that holds, after the block, the trace's start and end in
    seconds from the block's start (empty where it never started)."""
    import jax

    held: list[float] = []
    if logdir is None:
        yield held
        return
    t0, lock, ended = time.perf_counter(), threading.Lock(), [False]

    def start() -> None:
        with lock:
            if not ended[0]:
                jax.profiler.start_trace(logdir)
                held.append(time.perf_counter() - t0)

    def stop() -> None:
        with lock:
            ended[0] = True
            if len(held) == 1:
                held.append(time.perf_counter() - t0)  # (writing the trace out takes a while more)
                jax.profiler.stop_trace()

    timers = []
    if window is None:
        start()
    else:
        timers = [threading.Timer(window[0], start), threading.Timer(window[0] + window[1], stop)]
        for timer in timers:
            timer.start()
    try:
        yield held
    finally:
        for timer in timers:
            timer.cancel()
        stop()


def run_engine(engine_cls: Callable[..., Any], cfg: Any, params: Any, conversations: Sequence[Sequence[Request]],
               *, concurrency: int | None, rate: float | None, seed: int, label: str, compile_threads: int = 1,
               profile_dir: str | None = None, profile_window: tuple[float, float] | None = None,
               **options: Any) -> dict[str, Any]:
    """The workload through an in-process engine built from `options` (compiled and warmed up first):
    `summarize` of its requests, its size, its `stats()`, the occupancy of its decode steps (rows
    decoding per slot computed, `stats()`'s row steps / slot steps), its start-up time and the XLA compilations
    that ran during the workload (none is the engine's promise): seconds each, and what each compiled
    (`compiled_during_run`: JAX's `jax_log_compiles` line, where it first differs from the closest
    line of the same function's compilations in the warm-up; `cache_misses_during_run`: JAX's explanation
    of each cache miss then, `jax_explain_cache_misses`). With `profile_dir` the workload, or the stretch
    `profile_window` (start, seconds) of it, is traced into `profile_dir` (`traced`; `profiled_s`: when, in
    seconds from the workload's start) and `device_timeline` says where its device time went
    (`bench.device_profile.timeline`: busy per program, idle gaps; empty without an accelerator, None where
    the workload ended before the window)."""
    import logging

    import jax

    messages: list[tuple[bool, str]] = []  # (during the run, "Compiling ..." line)
    misses: list[str] = []  # JAX's explanations of the cache misses during the run
    running = [False]

    class Compiled(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("Compiling"):
                messages.append((running[0], message))
            elif running[0] and "CACHE MISS" in message:
                misses.append(message[:3000])

    handler, log_compiles, explain = Compiled(), jax.config.jax_log_compiles, jax.config.jax_explain_cache_misses
    logging.getLogger("jax").addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    compiles: list[float] = []
    try:
        t0 = time.perf_counter()
        engine = engine_cls(cfg, params, **options)
        engine.warmup(logprobs=False, sampling=False,  # every shape these requests use (greedy, no log-probabilities)
                      progress=lambda done, total, name, s: print(f"{label}: {name} ({done}/{total}) {s:.1f} s",
                                                                  flush=True), compile_threads=compile_threads)
        engine.start()
        start_s = time.perf_counter() - t0  # construction and compilation
        print(f"{label}: {options['max_batch']} slots, max_len {options['max_len']}, prefix cache "
              f"{'on' if options.get('prefix_cache') else 'off'}, ready in {start_s:.1f} s", flush=True)
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, duration, **_: compiles.append(duration) if "backend_compile" in event else None)
        running[0] = True
        jax.config.update("jax_explain_cache_misses", True)
        try:
            with traced(profile_dir, profile_window) as profiled:
                results = asyncio.run(drive(conversations, engine_runner(engine), concurrency=concurrency, rate=rate,
                                            seed=seed))
            stats = engine.stats()
        finally:
            engine.shutdown(0.0)
    finally:
        jax.config.update("jax_log_compiles", log_compiles)
        jax.config.update("jax_explain_cache_misses", explain)
        logging.getLogger("jax").removeHandler(handler)
        jax.monitoring.clear_event_listeners()
    warm = [m for run, m in messages if not run]
    occupancy = stats["decode_row_steps_total"] / max(1, stats["decode_slot_steps_total"])
    out = {**summarize(results), "max_batch": options["max_batch"], "max_len": options["max_len"], "stats": stats,
           "decode_occupancy": occupancy, "engine_start_s": start_s, "compiles_during_run_s": compiles,
           "compiled_during_run": [against_warmup(m, warm) for run, m in messages if run],
           "cache_misses_during_run": misses}
    if profile_dir:
        from bench.device_profile import trace_timeline

        out["profiled_s"] = profiled
        out["device_timeline"] = t = trace_timeline(profile_dir) if profiled else None
        if t is not None:
            print(f"{label}: device span {t['span_s']:.2f} s, busy {t['busy_s']:.2f} s, idle {t['idle_s']:.2f} s; "
                  + ", ".join(f"{p['program']} {p['busy_s']:.2f} s" for p in t["by_program"][:6]), flush=True)
    return out


def against_warmup(message: str, warm: Sequence[str], context: int = 300) -> dict[str, Any]:
    """A compilation's `jax_log_compiles` line against the warm-up's: its function, its head, and where it
    first differs from the warm-up line of the same function that shares the longest prefix with it
    (`context` characters of both from there; None where the warm-up never compiled the function)."""
    name = message.split(" with global")[0].removeprefix("Compiling ")
    same = [w for w in warm if w.split(" with global")[0].removeprefix("Compiling ") == name]

    def common(w: str) -> int:
        return next((i for i, (a, b) in enumerate(zip(w, message, strict=False)) if a != b), min(len(w), len(message)))

    out: dict[str, Any] = {"function": name, "head": message[:300], "differs_from_warmup": None}
    if same:
        closest = max(same, key=common)
        i = common(closest)
        out["differs_from_warmup"] = {"at": i, "warmup": closest[max(0, i - 40):i + context],
                                      "run": message[max(0, i - 40):i + context]}
    return out


def step_timing(engine_cls: Callable[..., Any], cfg: Any, params: Any, *, batch: int, context: int, steps: int,
                page_size: int, decode_steps: int, prefill_chunk: int, reps: int, seed: int) -> dict[str, Any]:
    """ms per decode step of an in-process engine with all `batch` slots busy at `context` tokens,
    against `ling_jax.decode.decode_loop`'s at the same batch and context, in this process.

    Engine: `batch` requests of `context` random prompt tokens are submitted together; the last one
    (prefilled last) generates m tokens, the others m + `batch` + 2 * `decode_steps` (so they are still
    decoding when it ends). Its time from first to last token, at m = `steps` and m = 2 * `steps`
    (fastest of `reps` each), differs by `steps` decode steps: the difference / `steps` is the step,
    with the host's part of the serving loop and without the edges (prefill, the last call).
    decode_loop: a cache of `batch` rows at `context` tokens (random latents and states), `steps` and
    2 * `steps` greedy tokens per call (fastest of `reps` calls each), the difference / `steps`."""
    import jax
    import jax.numpy as jnp

    from bench.decode import random_cache
    from ling_jax.decode import decode_loop
    from ling_jax.engine import SamplingParams

    steps = -(-steps // decode_steps) * decode_steps
    lead = batch + 2 * decode_steps
    max_len = -(-(context + 2 * steps + lead) // page_size) * page_size
    engine = engine_cls(cfg, params, max_batch=batch, max_len=max_len, page_size=page_size, decode_steps=decode_steps,
                        prefill_chunk=prefill_chunk)
    engine.warmup(logprobs=False, sampling=False)
    engine.start()
    rng = np.random.default_rng(seed)

    def engine_window(m: int) -> float:
        handles = [engine.submit(rng.integers(0, cfg.vocab_size, context).tolist(),
                                 SamplingParams(max_tokens=m + (lead if i < batch - 1 else 0), temperature=0.0,
                                                ignore_eos=True))
                   for i in range(batch)]
        for h in handles:
            h.result()
        last = handles[-1]
        return last.finished_at - last.first_token_at

    try:
        windows = {m: min(engine_window(m) for _ in range(reps)) for m in (steps, 2 * steps)}
    finally:
        engine.shutdown(0.0)
    logits = jax.random.normal(jax.random.key(seed), (batch, cfg.vocab_size), jnp.float32)
    keys = jax.random.split(jax.random.key(seed), batch)
    stop = jnp.asarray([-1], jnp.int32)

    def loop_call(n: int) -> float:
        cache = jax.block_until_ready(random_cache(cfg, batch, context + 2 * steps, context, params["embed"].dtype))
        t0 = time.perf_counter()
        jax.block_until_ready(decode_loop(cfg, params, cache, logits, 2 * steps, keys, jnp.float32(0.0),
                                          jnp.int32(0), jnp.float32(1.0), stop, jnp.int32(n)))
        return time.perf_counter() - t0

    loop_call(steps)  # compiles
    calls = {n: min(loop_call(n) for _ in range(reps)) for n in (steps, 2 * steps)}
    engine_ms = 1e3 * (windows[2 * steps] - windows[steps]) / steps
    loop_ms = 1e3 * (calls[2 * steps] - calls[steps]) / steps
    return {"batch": batch, "context": context, "steps": [steps, 2 * steps], "decode_steps": decode_steps,
            "reps": reps, "engine_window_s": {str(m): t for m, t in windows.items()},
            "decode_loop_call_s": {str(n): t for n, t in calls.items()}, "engine_ms_per_step": engine_ms,
            "decode_loop_ms_per_step": loop_ms, "engine_vs_decode_loop": engine_ms / loop_ms,
            "within_10_percent": engine_ms <= 1.1 * loop_ms}


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
    ap.add_argument("--prefill-chunk", type=int, default=512, help="the engine's largest prompt chunk per call")
    ap.add_argument("--prefill-rows", type=int, default=1, help="the most prompts one engine prefill call runs")
    ap.add_argument("--compare-prefill-rows", type=int, default=None, metavar="R",
                    help="in-process: the workload again with R prompts per prefill call, in this run (the weights "
                         "and the compiled decode call shared; both in the JSON, with the ratios)")
    ap.add_argument("--decode-steps", type=int, default=8, help="engine decode steps per call while nothing waits")
    ap.add_argument("--compile-threads", type=int, default=1,
                    help="in-process: the engine's warm-up compiles its shapes in this many threads at once")
    ap.add_argument("--unroll-prefill", action="store_true", help="the engine's prefill calls with layers unrolled")
    ap.add_argument("--decode-buckets", type=int, nargs="+", default=None, metavar="N",
                    help="the engine's decode buckets (slot counts of its decode calls; --max-batch always one)")
    ap.add_argument("--also-concurrency", nargs="+", default=[], metavar="C:N",
                    help="in-process: the first N requests again at concurrency C, per pair, same engine options")
    ap.add_argument("--prefix-cache", action="store_true", help="the in-process engine with its prefix cache")
    work = ap.add_argument_group("prefix-cache workloads")
    work.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                      help="every request's (first turn's) prompt starts with the same N random tokens, then its "
                           "own drawn from --prompt-len")
    work.add_argument("--multi-turn", type=int, default=1, metavar="T",
                      help="--num-requests conversations of T turns: a turn's prompt is the last turn's prompt + "
                           "its output + new tokens drawn from --prompt-len; a conversation's turns in order, "
                           "conversations concurrently (--concurrency / --rate count conversations)")
    work.add_argument("--compare-prefix-cache", action="store_true",
                      help="in-process: the workload with the prefix cache on, then off, in this run (both in the "
                           "JSON, with on/off ratios)")
    ap.add_argument("--step-timing", action="store_true",
                    help="in-process, instead of a workload: ms per decode step of the engine with all --max-batch "
                         "slots busy at the top of --prompt-len tokens, against decode_loop's at the same batch "
                         "and context (--output-len's top: steps timed)")
    ap.add_argument("--step-reps", type=int, default=3, help="--step-timing: timed runs per measurement")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="trace each in-process engine run into DIR/<run> and report its device timeline")
    ap.add_argument("--profile-window", default=None, metavar="START:SECONDS",
                    help="--profile: trace only SECONDS of each run, from START seconds into its workload")
    ap.add_argument("--snapshot-timing", action="store_true",
                    help="with --preset, instead of a workload: ms per prefix-cache snapshot save and restore")
    ap.add_argument("--out", default="bench/results/serve.json")
    return ap


def snapshot_timing(cfg: Any, dtype: str, page_size: int, reps: int) -> dict[str, Any]:
    """The prefix cache's snapshot cost: ms of one `engine.device.save_snapshot` (a staging row's KDA
    states and conv windows into a store row) and one `restore_snapshot` (back), each the mean of
    `reps` calls dispatched back to back after a compiled first call, on caches of the config's shapes
    (16 store rows); with the bytes one snapshot holds and the copy rate they reach."""
    import jax
    import numpy as np

    from ling_jax.cache import nbytes, paged_cache_shapes
    from ling_jax.engine import device

    staging = device.empty(paged_cache_shapes(cfg, 1, 1, page_size, dtype))
    store = device.empty(paged_cache_shapes(cfg, 16, 1, page_size, dtype), store=True)
    row_bytes = nbytes([leaf for path, leaf in jax.tree_util.tree_leaves_with_path(staging["segments"])
                        if path[-1].key != "pages"])
    out: dict[str, Any] = {"snapshot_bytes": row_bytes, "reps": reps}
    for name in ("save", "restore"):
        for i in range(-1, reps):  # call -1 compiles
            if i == 0:
                jax.block_until_ready((staging, store))
                t0 = time.perf_counter()
            if name == "save":
                store = device.save_snapshot(store, staging, np.int32(0), np.int32(i % 16))
            else:
                staging = device.restore_snapshot(staging, store, np.int32(i % 16), np.int32(0))
        jax.block_until_ready((staging, store))
        ms = 1e3 * (time.perf_counter() - t0) / reps
        out[f"{name}_ms"], out[f"{name}_GBps"] = ms, 2 * row_bytes / ms / 1e6  # read + write
    return out


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
    if args.snapshot_timing:
        if not args.preset or args.url or args.checkpoint:
            ap.error("--snapshot-timing takes --preset (no weights needed)")
        from bench.common import machine, write_json
        from ling_jax.config import LingConfig

        t = snapshot_timing(LingConfig.preset(args.preset), args.dtype, args.page_size, 50)
        print(f"snapshot of {t['snapshot_bytes'] / 1e6:.1f} MB: save {t['save_ms']:.3f} ms "
              f"({t['save_GBps']:.0f} GB/s), restore {t['restore_ms']:.3f} ms ({t['restore_GBps']:.0f} GB/s)")
        print(f"wrote {write_json(args.out, {**machine(), 'args': vars(args), 'snapshot_timing': t})}")
        return 0
    in_process = bool(args.checkpoint or args.random_weights)
    if bool(args.url) == in_process:
        ap.error("give --url, or --preset NAME --random-weights, or --checkpoint DIR")
    if args.random_weights and not args.preset:
        ap.error("--random-weights needs --preset")
    if args.static and not in_process:
        ap.error("--static needs an in-process model (--preset --random-weights or --checkpoint)")
    if args.url and not (args.preset or args.vocab_size):
        ap.error("--url needs --vocab-size (or --preset) to draw token ids")
    compare_rows = args.compare_prefill_rows is not None
    try:
        also = [tuple(int(v) for v in pair.split(":")) for pair in args.also_concurrency]
    except ValueError:
        ap.error(f"--also-concurrency takes C:N pairs of integers, not {args.also_concurrency}")
    if any(len(pair) != 2 or not 1 <= pair[1] <= args.num_requests or pair[0] < 1 for pair in also):
        ap.error(f"--also-concurrency C:N needs C >= 1 and 1 <= N <= --num-requests ({args.num_requests})")
    if also and (not in_process or args.step_timing):
        ap.error("--also-concurrency runs a workload through an in-process engine")
    if (args.compare_prefix_cache or compare_rows or args.step_timing or args.profile) and not in_process:
        ap.error("--compare-prefix-cache, --compare-prefill-rows, --step-timing and --profile need an in-process "
                 "engine")
    window = None
    if args.profile_window is not None:
        try:
            window = tuple(float(v) for v in args.profile_window.split(":"))
        except ValueError:
            ap.error(f"--profile-window takes START:SECONDS, not {args.profile_window}")
        if len(window) != 2 or window[0] < 0 or window[1] <= 0 or not args.profile:
            ap.error("--profile-window START:SECONDS needs START >= 0, SECONDS > 0 and --profile")
    if compare_rows and (args.compare_prefix_cache or args.compare_prefill_rows < 1):
        ap.error("--compare-prefill-rows must be >= 1, and compares without --compare-prefix-cache")
    if args.static and args.multi_turn > 1:
        ap.error("--static runs single-turn requests (its prompts are known in advance)")
    if args.step_timing and (args.static or args.compare_prefix_cache or compare_rows or args.multi_turn > 1
                             or args.shared_prefix):
        ap.error("--step-timing runs no workload: without --static, --compare-prefix-cache, --compare-prefill-rows, "
                 "--multi-turn, --shared-prefix")
    if args.shared_prefix < 0 or min(args.multi_turn, args.decode_steps, args.prefill_chunk, args.prefill_rows,
                                     args.step_reps) < 1:
        ap.error("--shared-prefix must be >= 0, --multi-turn, --decode-steps, --prefill-chunk, --prefill-rows and "
                 "--step-reps >= 1")
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
    if engine_cls is None and in_process:
        from ling_jax.engine import Engine

        engine_cls = Engine
    if args.step_timing:
        result["step_timing"] = t = step_timing(
            engine_cls, cfg, params, batch=args.max_batch or concurrency or 8, context=prompt_len[1],
            steps=output_len[1], page_size=args.page_size, decode_steps=args.decode_steps,
            prefill_chunk=args.prefill_chunk, reps=args.step_reps, seed=args.seed)
        print(f"decode step at batch {t['batch']}, context {t['context']}: engine {t['engine_ms_per_step']:.3f} ms, "
              f"decode_loop {t['decode_loop_ms_per_step']:.3f} ms ({t['engine_vs_decode_loop']:.2f}x)")
        print(f"wrote {write_json(args.out, result)}")
        return 0
    convs = make_conversations(args.num_requests, prompt_len, output_len, vocab, args.seed,
                               shared_prefix=args.shared_prefix, turns=args.multi_turn)
    requests = [r for conv in convs for r in conv]  # single-turn: the requests as sent
    mode = {"concurrency": concurrency} if args.rate is None else {"rate": args.rate}
    result["load"] = {**mode, "prompt_len": prompt_len, "output_len": output_len}
    if args.shared_prefix or args.multi_turn > 1:
        result["load"].update(shared_prefix=args.shared_prefix, turns=args.multi_turn)

    if args.url:
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

        async def over_http() -> list[Result]:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits) as client:
                return await drive(convs, http_runner(client, args.url.rstrip("/"), args.model),
                                   concurrency=concurrency, rate=args.rate, seed=args.seed)

        result["server"] = summarize(asyncio.run(over_http()))
    else:
        longest = longest_request(args.shared_prefix, args.multi_turn, prompt_len, output_len)
        options = dict(max_batch=args.max_batch or concurrency or 8, page_size=args.page_size,
                       max_len=args.max_len or -(-longest // args.page_size) * args.page_size,
                       speculative_tokens=args.speculative_tokens, decode_steps=args.decode_steps,
                       prefill_chunk=args.prefill_chunk, prefill_rows=args.prefill_rows,
                       decode_buckets=args.decode_buckets, unroll_prefill=args.unroll_prefill)
        load = dict(concurrency=concurrency, rate=args.rate, seed=args.seed)
        rows_name = f"engine_prefill_rows_{args.compare_prefill_rows}"
        # (name, prefix cache, prompts per prefill call, conversations, load)
        runs = [("engine", args.prefix_cache or args.compare_prefix_cache, args.prefill_rows, convs, load)]
        if args.compare_prefix_cache:
            runs.append(("engine_no_prefix_cache", False, args.prefill_rows, convs, load))
        if compare_rows:
            runs.append((rows_name, args.prefix_cache, args.compare_prefill_rows, convs, load))
        runs += [(f"engine_concurrency_{c}", args.prefix_cache, args.prefill_rows, convs[:n],
                  dict(concurrency=c, rate=None, seed=args.seed)) for c, n in also]
        for name, prefix, rows, run_convs, run_load in runs:
            result[name] = run_engine(engine_cls, cfg, params, run_convs, label=name, prefix_cache=prefix, **run_load,
                                      compile_threads=args.compile_threads, **(options | {"prefill_rows": rows}),
                                      profile_dir=args.profile and str(Path(args.profile) / name),
                                      profile_window=window)
            write_json(args.out, result)
            print(f"{name}: {result[name]['requests']} requests in {result[name]['duration_s']:.1f} s", flush=True)
        if args.compare_prefix_cache:
            on, off = result["engine"], result["engine_no_prefix_cache"]
            result["prefix_cache_vs_off"] = {
                "ttft_p50": on["ttft_s"]["p50"] / off["ttft_s"]["p50"],
                "ttft_p99": on["ttft_s"]["p99"] / off["ttft_s"]["p99"],
                "output_tokens_per_s": on["output_tokens_per_s"] / off["output_tokens_per_s"],
                "total_tokens_per_s": on["total_tokens_per_s"] / off["total_tokens_per_s"]}
        if compare_rows:
            a, b = result["engine"], result[rows_name]
            result[f"prefill_rows_{args.prefill_rows}_vs_{args.compare_prefill_rows}"] = {
                "ttft_p50": a["ttft_s"]["p50"] / b["ttft_s"]["p50"],
                "output_tokens_per_s": a["output_tokens_per_s"] / b["output_tokens_per_s"],
                "total_tokens_per_s": a["total_tokens_per_s"] / b["total_tokens_per_s"]}
        if args.static:
            result["static"] = run_static(cfg, params, requests, concurrency or options["max_batch"],
                                          unroll_layers=not args.scan_layers)
            result["output_tokens_per_s_vs_static"] = (result["engine"]["output_tokens_per_s"]
                                                       / result["static"]["output_tokens_per_s"])
    for name in ("server", "engine", "engine_no_prefix_cache", f"engine_prefill_rows_{args.compare_prefill_rows}",
                 *(f"engine_concurrency_{c}" for c, _ in also), "static"):
        if name in result:
            r = result[name]
            hits = f"; prefix hit rate {r['prefix']['hit_rate']:.3f}" if "prefix" in r else ""
            hits += f"; decode occupancy {r['decode_occupancy']:.3f}" if "decode_occupancy" in r else ""
            print(f"{name:>6}: {r['requests']} requests in {r['duration_s']:.2f} s: {r['request_throughput']:.2f} "
                  f"req/s, {r['output_tokens_per_s']:.1f} output tokens/s, {r['total_tokens_per_s']:.1f} total "
                  f"tokens/s; TTFT p50 {r['ttft_s']['p50']} p99 {r['ttft_s']['p99']}, TPOT p50 {r['tpot_s']['p50']}"
                  f"{hits}")
    with contextlib.suppress(KeyError):
        print(f"engine / static output tokens/s: {result['output_tokens_per_s_vs_static']:.2f}x")
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

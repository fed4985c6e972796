"""What one engine call costs: a prefill chunk per bucket, decode calls, against the batch prefill.

    python3 bench/experiments/engine_calls.py --out $OUT/engine_calls.json          # the GPU run
    python3 bench/experiments/engine_calls.py --smoke --out /tmp/engine_calls.json  # CPU, debug preset

An `Engine` (Ling-3.0-tiny shape, random bf16 weights, `--batch` slots, `--max-len`), not started:
its compiled functions called directly on its own cache. Timed (median of `--reps` synchronised
calls after one that compiles):
- `device.prefill_chunk` in each shape an engine of `--prefill-chunk` and `--prefill-rows` compiles
  (`Engine.prefill_shapes`: prompts x chunk), the prompts' first chunks (slots 0, 1, ...), its layers
  scanned or, `--unroll-prefill`, unrolled;
- `device.decode_steps` of 1 and `--decode-steps` steps over every slot, each slot at `--context`
  tokens, and `decode.decode_loop` (what static `generate` runs) of `--decode-steps` greedy tokens
  over a cache of `--batch` rows at the same context: ms per step of both; with `--output-snapshots`,
  also the decode call of an engine with the prefix cache (its output snapshots on), taking no
  snapshot and one per call (slot 0's state after the call's first step): what the snapshots' per-step
  conditionals and a copy cost;
- `decode.prefill` (what static `generate` runs) of `--batch` rows of each `--batch-chunks` length, and
  of one row: tokens/s of the batch form against the engine's prefill calls.
With `--profile`, where the largest prefill call, the one-step decode call, and the decode call and
`decode_loop` call of `--decode-steps` steps spend their device time (`bench.device_profile`: the
top kernels; per op path where XLA_FLAGS dumps the optimised HLO, `--xla_dump_to=DIR
--xla_dump_hlo_as_text`), with the two steps' op paths side by side ("step_by_op_path": ms per step,
largest difference first).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from bench.common import machine, median_time, random_params, write_json
from bench.decode import random_cache
from bench.device_profile import device_profile, print_profile
from ling_jax.config import LingConfig
from ling_jax.decode import decode_loop
from ling_jax.decode.step import prefill
from ling_jax.engine import Engine, device
from ling_jax.kernels import select
from ling_jax.params import init_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=2560)
    ap.add_argument("--prefill-chunk", type=int, default=512, help="the engine's largest prefill chunk")
    ap.add_argument("--batch-chunks", type=int, nargs="+", default=[512], help="`decode.prefill` lengths timed")
    ap.add_argument("--prefill-rows", type=int, default=8, help="prompts per engine prefill call (and 1)")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024, help="tokens every slot holds when the decode calls start")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only-largest", action="store_true",
                    help="only the largest prefill call of 1 and of --prefill-rows prompts; no decode calls")
    ap.add_argument("--decode-only", action="store_true", help="only the decode calls and decode_loop (no prefill)")
    ap.add_argument("--output-snapshots", action="store_true",
                    help="also the decode call with the prefix cache's output snapshots on (a second engine)")
    ap.add_argument("--unroll-prefill", action="store_true", help="the engine's prefill calls with layers unrolled")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="debug preset, small shapes (CPU check)")
    args = ap.parse_args()
    preset = "debug" if args.smoke else "ling-3.0-tiny"
    cfg = LingConfig.preset(preset)
    if args.smoke:
        args.batch, args.max_len, args.prefill_chunk, args.batch_chunks, args.reps, args.prefill_rows, args.context = \
            4, 128, 32, [32], 2, 2, 16
        params = init_params(cfg, seed=0, dtype="float32")
    else:
        params = random_params(cfg, jnp.bfloat16)
    engine = Engine(cfg, params, max_batch=args.batch, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                    prefill_rows=min(args.prefill_rows, args.batch), decode_steps=args.decode_steps,
                    unroll_prefill=args.unroll_prefill)
    tables = 1 + np.arange(args.batch * engine.max_pages, dtype=np.int32).reshape(args.batch, -1)  # slot b's pages
    room = args.max_len - args.context - (1 + args.reps) * args.decode_steps * (3 if args.profile else 1)
    if room < 0:
        raise SystemExit(f"--max-len {args.max_len} leaves no room for the decode calls after --context {args.context}")
    result: dict[str, Any] = {**machine(), "preset": preset, "unroll_prefill": args.unroll_prefill,
                              "batch": args.batch, "max_len": args.max_len,
                              "context": args.context, "reps": args.reps, "prefill_call": {}, "decode_call": {},
                              "batch_prefill": {}}

    def chunk(rows: int, c: int) -> Any:
        """A prefill call of the first chunk (c tokens) of `rows` prompts, in slots 0 .. rows - 1."""
        r = np.arange(rows, dtype=np.int32)
        engine.cache, engine.staging, engine.drafting, out = device.prefill_chunk(
            cfg, engine.k_prefill, False, engine.unroll_prefill, engine.params, engine.cache, engine.staging,
            engine.drafting,
            tables[:rows], r, r, np.ones((rows, c), np.int32), np.zeros(rows, np.int32), np.full(rows, c, np.int32),
            np.zeros((rows, c), np.int32), np.zeros((rows, *engine._key_shape), np.uint32),
            np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32))
        return out

    if args.decode_only and args.only_largest:
        raise SystemExit("--decode-only and --only-largest exclude each other")
    shapes = [(1, args.prefill_chunk), engine.prefill_shapes[-1]] if args.only_largest else engine.prefill_shapes
    shapes = [] if args.decode_only else shapes
    for rows, c in shapes:
        s = median_time(lambda rows=rows, c=c: chunk(rows, c), reps=args.reps)
        result["prefill_call"][f"{rows}x{c}"] = {"ms": 1e3 * s, "tokens_per_s": rows * c / s}
        print(f"prefill call {rows:3d} x {c:5d}: {1e3 * s:8.2f} ms, {rows * c / s:10.0f} tokens/s", flush=True)

    def decode(steps: int) -> Any:
        engine.cache, out = engine._decode(steps, False, tables, np.zeros(args.batch, bool), [])
        return out

    dtype = params["embed"].dtype
    loop_cache = [random_cache(cfg, args.batch, args.max_len, args.context, dtype)]
    logits = jnp.zeros((args.batch, cfg.vocab_size), jnp.float32)
    keys = jax.random.split(jax.random.key(0), args.batch)

    def loop() -> Any:
        """decode_loop's call of --decode-steps greedy tokens, on the cache the last call returned."""
        out, _, loop_cache[0] = decode_loop(cfg, params, loop_cache[0], logits, args.decode_steps, keys,
                                            jnp.float32(0.0), jnp.int32(0), jnp.float32(1.0),
                                            jnp.asarray([-1], jnp.int32))
        return out

    if not args.only_largest:
        engine.cache = {**engine.cache, "lengths": jnp.full_like(engine.cache["lengths"], args.context)}
        for steps in sorted({1, args.decode_steps}):
            s = median_time(lambda steps=steps: decode(steps), reps=args.reps)
            result["decode_call"][str(steps)] = {"ms": 1e3 * s, "ms_per_step": 1e3 * s / steps}
            print(f"decode call of {steps} steps at batch {args.batch}: {1e3 * s:8.2f} ms "
                  f"({1e3 * s / steps:.3f} ms/step)", flush=True)
        if args.output_snapshots:
            snap = Engine(cfg, params, max_batch=args.batch, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                          prefill_rows=min(args.prefill_rows, args.batch), decode_steps=args.decode_steps,
                          prefix_cache=True, prefix_cache_gb=0.2)
            snap.cache = {**snap.cache, "lengths": jnp.full_like(snap.cache["lengths"], args.context)}
            n = args.decode_steps
            for label, snaps in (("none", []), ("one", [(0, 0, 0, 0)])):  # (slot, boundary, step, store row)
                def call(snaps: list = snaps) -> Any:
                    snap.cache, out = snap._decode(n, False, tables, np.zeros(args.batch, bool), snaps)
                    return out

                s = median_time(call, reps=args.reps)
                result.setdefault("decode_call_output_snapshots", {})[label] = {
                    "steps": n, "ms": 1e3 * s, "ms_per_step": 1e3 * s / n}
                print(f"decode call of {n} steps, output snapshots on, {label} taken: {1e3 * s:8.2f} ms "
                      f"({1e3 * s / n:.3f} ms/step)", flush=True)
            del snap
        s = median_time(loop, reps=args.reps, warmup=2)  # the second call compiles for its own output cache
        result["decode_loop"] = {"steps": args.decode_steps, "ms": 1e3 * s, "ms_per_step": 1e3 * s / args.decode_steps}
        print(f"decode_loop of {args.decode_steps} steps at batch {args.batch}: {1e3 * s:8.2f} ms "
              f"({1e3 * s / args.decode_steps:.3f} ms/step)", flush=True)

    kernels = select(cfg, dtype=params["embed"].dtype, inference=True)
    for c in [] if args.decode_only else args.batch_chunks:
        for rows in (1, args.batch):
            ids = jnp.ones((rows, c), jnp.int32)
            lengths = jnp.full((rows,), c, jnp.int32)
            try:
                s = median_time(lambda ids=ids, lengths=lengths, c=c: prefill(cfg, kernels, params, ids, lengths, c),
                                reps=args.reps)
            except Exception as e:  # e.g. out of memory at the largest batch
                print(f"batch prefill {rows} x {c}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            result["batch_prefill"][f"{rows}x{c}"] = {"ms": 1e3 * s, "tokens_per_s": rows * c / s}
            print(f"batch prefill {rows:3d} x {c:5d}: {1e3 * s:8.2f} ms, {rows * c / s:10.0f} tokens/s", flush=True)

    if args.profile:
        with tempfile.TemporaryDirectory() as d:
            if not args.decode_only:
                rows, c = engine.prefill_shapes[-1]
                print(f"profile: prefill call {rows} x {c}", flush=True)
                result["profile_chunk"] = p = device_profile(lambda: chunk(rows, c), d + "/chunk", calls=3)
                print_profile(p)
            print("profile: decode call of 1 step", flush=True)
            result["profile_decode"] = p = device_profile(lambda: decode(1), d + "/decode", calls=3)
            print_profile(p)
            if not args.only_largest:
                n = args.decode_steps
                print(f"profile: decode call of {n} steps", flush=True)
                result["profile_decode_steps"] = p = device_profile(lambda: decode(n), d + "/steps", calls=3,
                                                                    top=500)
                print(f"profile: decode_loop of {n} steps", flush=True)
                result["profile_decode_loop"] = q = device_profile(loop, d + "/loop", calls=3, top=500)
                for name, r in (("engine decode call", p), ("decode_loop", q)):
                    print(f"  {name}: wall {1e3 * r['wall_s_per_call'] / n:.3f} ms/step, device span "
                          f"{1e3 * r['span_s_per_call'] / n:.3f}, busy {1e3 * r['device_busy_s_per_call'] / n:.3f}, "
                          f"{r['kernels_per_call'] / n:.0f} kernels/step", flush=True)
                result["step_by_op_path"] = rows = step_by_op_path(p, q, n)
                print("  ms per step by op path: engine decode call, decode_loop", flush=True)
                for r in rows[:20]:
                    print(f"    {r['engine_ms']:8.4f} {r['decode_loop_ms']:8.4f}  {r['op_path']}", flush=True)
    write_json(args.out, result)


def step_by_op_path(engine: dict[str, Any], loop: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """ms per decode step of each op path in two `device_profile` summaries of `steps`-step calls (the
    engine's decode call, decode_loop's), the largest difference first; "(all kernels)" first of all."""
    rows = {"(all kernels)": [1e3 * engine["kernel_time_s_per_call"] / steps,
                              1e3 * loop["kernel_time_s_per_call"] / steps]}
    for j, summary in enumerate((engine, loop)):
        for r in summary["by_op_path"]:
            rows.setdefault(r["name"], [0.0, 0.0])[j] += r["total_ms_per_call"] / steps
    order = sorted(rows.items(), key=lambda kv: (kv[0] != "(all kernels)", -abs(kv[1][0] - kv[1][1])))
    return [{"op_path": name, "engine_ms": e, "decode_loop_ms": d} for name, (e, d) in order]


if __name__ == "__main__":
    main()

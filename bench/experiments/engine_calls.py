"""What one engine call costs: a prefill chunk per bucket, decode calls, against the batch prefill.

    python3 bench/experiments/engine_calls.py --out $OUT/engine_calls.json          # the GPU run
    python3 bench/experiments/engine_calls.py --smoke --out /tmp/engine_calls.json  # CPU, debug preset

An `Engine` (Ling-3.0-tiny shape, random bf16 weights, `--batch` slots, `--max-len`), not started:
its compiled functions called directly on its own cache. Timed (median of `--reps` synchronised
calls after one that compiles):
- `device.prefill_chunk` in each shape an engine of `--prefill-chunk` and `--prefill-rows` compiles
  (`Engine.prefill_shapes`: prompts x chunk), the prompts' first chunks (slots 0, 1, ...);
- `device.decode_steps` of 1 and `--decode-steps` steps over every slot;
- `decode.prefill` (what static `generate` runs) of `--batch` rows of each `--batch-chunks` length, and
  of one row: tokens/s of the batch form against the engine's prefill calls.
With `--profile`, where the largest prefill call and the one-step decode call spend their device time
(`bench.device_profile`, the top kernels).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from bench.common import machine, median_time, random_params, write_json
from bench.device_profile import device_profile, print_profile
from ling_jax.config import LingConfig
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
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only-largest", action="store_true",
                    help="only the largest prefill call of 1 and of --prefill-rows prompts; no decode calls")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="debug preset, small shapes (CPU check)")
    args = ap.parse_args()
    preset = "debug" if args.smoke else "ling-3.0-tiny"
    cfg = LingConfig.preset(preset)
    if args.smoke:
        args.batch, args.max_len, args.prefill_chunk, args.batch_chunks, args.reps, args.prefill_rows = \
            4, 128, 32, [32], 2, 2
        params = init_params(cfg, seed=0, dtype="float32")
    else:
        params = random_params(cfg, jnp.bfloat16)
    engine = Engine(cfg, params, max_batch=args.batch, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                    prefill_rows=args.prefill_rows, decode_steps=args.decode_steps)
    tables = 1 + np.arange(args.batch * engine.max_pages, dtype=np.int32).reshape(args.batch, -1)  # slot b's pages
    result: dict[str, Any] = {**machine(), "preset": preset, "batch": args.batch, "max_len": args.max_len,
                              "reps": args.reps, "prefill_call": {}, "decode_call": {}, "batch_prefill": {}}

    def chunk(rows: int, c: int) -> Any:
        """A prefill call of the first chunk (c tokens) of `rows` prompts, in slots 0 .. rows - 1."""
        r = np.arange(rows, dtype=np.int32)
        engine.cache, engine.staging, engine.drafting, out = device.prefill_chunk(
            cfg, engine.k_prefill, False, engine.params, engine.cache, engine.staging, engine.drafting,
            tables[:rows], r, r, np.ones((rows, c), np.int32), np.zeros(rows, np.int32), np.full(rows, c, np.int32),
            np.zeros((rows, c), np.int32), np.zeros((rows, *engine._key_shape), np.uint32),
            np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32))
        return out

    shapes = [(1, args.prefill_chunk), engine.prefill_shapes[-1]] if args.only_largest else engine.prefill_shapes
    for rows, c in shapes:
        s = median_time(lambda rows=rows, c=c: chunk(rows, c), reps=args.reps)
        result["prefill_call"][f"{rows}x{c}"] = {"ms": 1e3 * s, "tokens_per_s": rows * c / s}
        print(f"prefill call {rows:3d} x {c:5d}: {1e3 * s:8.2f} ms, {rows * c / s:10.0f} tokens/s", flush=True)

    def decode(steps: int) -> Any:
        engine.cache, out = engine._decode(steps, False, tables, np.zeros(args.batch, bool))
        return out

    for steps in sorted({1, args.decode_steps}) if not args.only_largest else ():
        s = median_time(lambda steps=steps: decode(steps), reps=args.reps)
        result["decode_call"][str(steps)] = {"ms": 1e3 * s, "ms_per_step": 1e3 * s / steps}
        print(f"decode call of {steps} steps at batch {args.batch}: {1e3 * s:8.2f} ms ({1e3 * s / steps:.2f} ms/step)",
              flush=True)

    kernels = select(cfg, dtype=params["embed"].dtype, inference=True)
    for c in args.batch_chunks:
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
            rows, c = engine.prefill_shapes[-1]
            print(f"profile: prefill call {rows} x {c}", flush=True)
            result["profile_chunk"] = p = device_profile(lambda: chunk(rows, c), d + "/chunk", calls=3)
            print_profile(p)
            print("profile: decode call of 1 step", flush=True)
            result["profile_decode"] = p = device_profile(lambda: decode(1), d + "/decode", calls=3)
            print_profile(p)
    write_json(args.out, result)


if __name__ == "__main__":
    main()

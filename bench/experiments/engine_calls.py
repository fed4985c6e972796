"""What one engine call costs: a prefill chunk per bucket, decode calls, against the batch prefill.

    python3 bench/experiments/engine_calls.py --out $OUT/engine_calls.json          # the GPU run
    python3 bench/experiments/engine_calls.py --smoke --out /tmp/engine_calls.json  # CPU, debug preset

An `Engine` (Ling-3.0-tiny shape, random bf16 weights, `--batch` slots, `--max-len`), not started:
its compiled functions called directly on its own cache. Timed (median of `--reps` synchronised
calls after one that compiles):
- `device.prefill_chunk` of one fresh prompt chunk of each `--chunks` length into slot 0;
- `device.decode_steps` of 1 and `--decode-steps` steps over every slot;
- `decode.prefill` (what static `generate` runs) of `--batch` rows of each `--chunks` length, and
  of one row: tokens/s of the batch form against the engine's one-row chunk.
With `--profile`, where the 512-token chunk and the one-step decode call spend their device time
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
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="debug preset, small shapes (CPU check)")
    args = ap.parse_args()
    preset = "debug" if args.smoke else "ling-3.0-tiny"
    cfg = LingConfig.preset(preset)
    if args.smoke:
        args.batch, args.max_len, args.chunks, args.reps = 4, 128, [16, 32], 2
        params = init_params(cfg, seed=0, dtype="float32")
    else:
        params = random_params(cfg, jnp.bfloat16)
    engine = Engine(cfg, params, max_batch=args.batch, max_len=args.max_len, prefill_chunk=max(args.chunks),
                    decode_steps=args.decode_steps)
    table = np.arange(1, engine.max_pages + 1, dtype=np.int32)  # slot 0 holds the first pages
    result: dict[str, Any] = {**machine(), "preset": preset, "batch": args.batch, "max_len": args.max_len,
                              "reps": args.reps, "prefill_chunk": {}, "decode_call": {}, "batch_prefill": {}}

    def chunk(c: int) -> Any:
        engine.cache, engine.staging, engine.drafting, out = device.prefill_chunk(
            cfg, engine.k_prefill, False, engine.params, engine.cache, engine.staging, engine.drafting, table,
            np.int32(0), np.ones(c, np.int32), np.int32(0), np.int32(c), np.zeros(c, np.int32),
            np.zeros(2, np.uint32), np.float32(0), np.int32(0), np.float32(1))
        return out

    for c in args.chunks:
        s = median_time(lambda c=c: chunk(c), reps=args.reps)
        result["prefill_chunk"][str(c)] = {"ms": 1e3 * s, "tokens_per_s": c / s}
        print(f"prefill chunk {c:5d}: {1e3 * s:8.2f} ms, {c / s:10.0f} tokens/s", flush=True)

    tables = np.tile(table, (args.batch, 1))
    def decode(steps: int) -> Any:
        engine.cache, out = engine._decode(steps, False, tables, np.zeros(args.batch, bool))
        return out

    for steps in sorted({1, args.decode_steps}):
        s = median_time(lambda steps=steps: decode(steps), reps=args.reps)
        result["decode_call"][str(steps)] = {"ms": 1e3 * s, "ms_per_step": 1e3 * s / steps}
        print(f"decode call of {steps} steps at batch {args.batch}: {1e3 * s:8.2f} ms ({1e3 * s / steps:.2f} ms/step)",
              flush=True)

    kernels = select(cfg, dtype=params["embed"].dtype, inference=True)
    for c in args.chunks:
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
            c = 512 if 512 in args.chunks else args.chunks[0]
            print(f"profile: prefill chunk {c}", flush=True)
            result["profile_chunk"] = p = device_profile(lambda: chunk(c), d + "/chunk", calls=3)
            print_profile(p)
            print("profile: decode call of 1 step", flush=True)
            result["profile_decode"] = p = device_profile(lambda: decode(1), d + "/decode", calls=3)
            print_profile(p)
    write_json(args.out, result)


if __name__ == "__main__":
    main()

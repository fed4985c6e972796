"""Row log-sum-exp benchmark: the one-pass Triton kernel against XLA's `jax.nn.logsumexp` (two passes).

    python3 bench/logsumexp.py --out bench/results/logsumexp_h200.json

One chunk of the train step's loss: logits [4096, 157184] (Ling-3 vocabulary), bf16 and float32.
Median of warmed-up calls; GB/s counts one read of the logits against the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import copy_bandwidth, machine, median_time, write_json
from ling_jax.ops.logsumexp import row_logsumexp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=157184)
    args = ap.parse_args()
    result = {**machine(), "rows": args.rows, "vocab": args.vocab,
              "copy_bandwidth_GBps": copy_bandwidth() / 1e9, "runs": []}
    for dtype in (jnp.bfloat16, jnp.float32):
        x = (4 * jax.random.normal(jax.random.key(0), (args.rows, args.vocab))).astype(dtype)
        want = None
        for impl in ("xla", "pallas"):
            f = jax.jit(lambda a, impl=impl: row_logsumexp(a, impl=impl))
            s = median_time(lambda f=f, x=x: f(x), reps=20, warmup=3)
            got = f(x)
            want = got if want is None else want
            run = {"dtype": jnp.dtype(dtype).name, "impl": impl, "ms": s * 1e3, "read_GBps": x.nbytes / s / 1e9,
                   "max_abs_diff_vs_xla": float(jnp.max(jnp.abs(got - want)))}
            result["runs"].append(run)
            print(run, flush=True)
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

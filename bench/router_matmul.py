"""The MoE router's float32 matmul: exact float32 (CUDA-core FFMA) against bf16 multi-pass algorithms.

    python3 bench/router_matmul.py --out bench/results/router_matmul_h200.json

Ling's router computes its logits in float32 ([tokens, D] x [D, E]). `Precision.HIGHEST` runs it on
CUDA cores; `DotAlgorithmPreset.BF16_BF16_F32_X6` splits each operand into three bf16 parts and sums
six tensor-core products (near-float32 accuracy), `_X3` three (about 16 mantissa bits). For each:
forward and forward+backward (dx, dW) times, median of warmed-up calls, and the relative error of
the logits against a float64 product on the host.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, median_time, write_json

ALGORITHMS = {
    "highest": jax.lax.Precision.HIGHEST,
    "bf16_x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
    "bf16_x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--experts", type=int, default=128)
    args = ap.parse_args()
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (args.tokens, args.hidden), jnp.float32)
    w = 0.02 * jax.random.normal(kw, (args.hidden, args.experts), jnp.float32)
    g = jax.random.normal(kg, (args.tokens, args.experts), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    result = {**machine(), "tokens": args.tokens, "hidden": args.hidden,
              "experts": args.experts, "runs": []}
    for name, prec in ALGORITHMS.items():
        def fwd(x, w, prec=prec):
            return jnp.matmul(x, w, precision=prec)

        def fwd_bwd(x, w, g, fwd=fwd):
            y, vjp = jax.vjp(fwd, x, w)
            return y, *vjp(g)

        try:
            f, fb = jax.jit(fwd), jax.jit(fwd_bwd)
            got = np.asarray(f(x, w), np.float64)
            run = {"algorithm": name, "fwd_ms": 1e3 * median_time(lambda f=f: f(x, w), reps=20, warmup=3),
                   "fwd_bwd_ms": 1e3 * median_time(lambda fb=fb: fb(x, w, g), reps=20, warmup=3),
                   "rel_err_max": float(np.max(np.abs(got - want)) / np.max(np.abs(want))),
                   "rel_l2": float(np.linalg.norm(got - want) / np.linalg.norm(want))}
        except Exception as e:  # an algorithm this backend does not support
            run = {"algorithm": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        result["runs"].append(run)
        print(run, flush=True)
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()

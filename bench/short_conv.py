"""KDA short-conv benchmark: the Triton kernels against XLA's conv (forward, forward + backward).

    python3 bench/short_conv.py --out bench/results/short_conv_h200.json
    python3 bench/short_conv.py --smoke --out /tmp/short_conv.json      # CPU, tiny, interpret mode

The shapes of a Ling-3.0-tiny KDA layer in the train step: x [B, T, 3 * 2048] bf16 (the q/k/v
projections side by side), packed segments, the three parts returned separately. Median of warmed-up
calls; achieved HBM GB/s counts the bytes the kernels must move (forward: read x, write the parts;
backward: read x and the parts' cotangents, write dx), against the measured copy bandwidth.
`--blocks` times the kernels' tiles (rows, channels, row blocks per backward program); results
are written after each variant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import copy_bandwidth, machine, median_time, write_json
from ling_jax.ops import short_conv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--width", type=int, default=2048, help="channels per part (H * K)")
    ap.add_argument("--blocks", nargs="*", default=["8x64x32", "16x32x16", "16x64x16", "32x64x8", "32x64x1"],
                    help="kernel tiles: rows x channels x row blocks per backward program")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.seq_len, args.width, args.blocks = 1, 100, 64, ["32x64x2"]
    b, t, p = args.batch, args.seq_len, args.width
    rng = np.random.default_rng(0)
    x = jax.device_put(jnp.asarray(rng.normal(size=(b, t, 3 * p)), jnp.bfloat16))
    w = jax.device_put(jnp.asarray(0.5 * rng.normal(size=(3 * p, 4)), jnp.float32))
    seg = jax.device_put(jnp.asarray(np.cumsum(rng.random((b, t)) < 2 / t, axis=1), jnp.int32))
    cts = [jax.device_put(jnp.asarray(rng.normal(size=(b, t, p)), jnp.bfloat16)) for _ in range(3)]
    bw = copy_bandwidth(0.25 if args.smoke else 2.0)
    moved = {"fwd": 2 * x.nbytes, "fwd_bwd": 2 * x.nbytes + x.nbytes + 2 * x.nbytes}  # + bwd: x, dys, dx
    result = {**machine(), "shape": {"batch": b, "seq_len": t, "width": p},
              "copy_bandwidth_GBps": bw / 1e9, "runs": []}

    def fns(impl, blocks):
        fwd = jax.jit(lambda x: short_conv.conv_silu_parts(x, w, seg, 3, impl=impl, blocks=blocks))

        def loss(x, w):
            ys = short_conv.conv_silu_parts(x, w, seg, 3, impl=impl, blocks=blocks)
            return sum(jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32)) for y, c in zip(ys, cts, strict=True))

        return fwd, jax.jit(jax.grad(loss, argnums=(0, 1)))

    variants = [("xla", None)] + [("pallas", blk) for blk in args.blocks]
    ref = None
    for impl, blk in variants:
        blocks = tuple(int(v) for v in blk.split("x")) if blk else (short_conv.BLOCK_T, short_conv.BLOCK_P,
                                                                    short_conv.INNER)
        fwd, grad = fns(impl, blocks)
        run = {"impl": impl, "block": blk}
        for name, fn in (("fwd", lambda f=fwd: f(x)), ("fwd_bwd", lambda g=grad: g(x, w))):
            s = median_time(fn, reps=20, warmup=3)
            run[f"{name}_ms"] = s * 1e3
            run[f"{name}_GBps"] = moved[name] / s / 1e9
        dx, dw = grad(x, w)
        if ref is None:
            ref = (dx, dw)
        else:
            err = [float(jnp.linalg.norm((a - r).astype(jnp.float32)) / jnp.linalg.norm(r.astype(jnp.float32)))
                   for a, r in zip((dx, dw), ref, strict=True)]
            run["rel_l2_vs_xla"] = {"dx": err[0], "dw": err[1]}
        result["runs"].append(run)
        write_json(args.out, result)
        print(run, flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

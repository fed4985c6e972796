"""MLA prefill/training attention on one GPU: the fused kernels vs the materialised XLA softmax vs cuDNN.

    python3 bench/mla_attention.py --out bench/results/mla_attention_h200.json     # on the GPU
    python3 bench/mla_attention.py --smoke --out /tmp/mla_attention.json         # CPU, tiny, interpret mode

At the training shape of `bench/train.py` (Ling-3.0-tiny heads: 16 x (nope 128 + rope 64), value 128;
batch 8 x 4096 tokens, three packed documents per row, bf16), times the forward and forward+backward
(gradients of q, k, v) of:
  * `xla`: `ops.attention.attention` with the [B, T, T] document mask (what `attention_impl="xla"` runs);
  * `pallas`: `ops.attention_pallas.mla_attention_pallas` (the default tiles, then each `--tiles` set);
  * `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)` on the concatenated
    192-wide q/k and v zero-padded to 192 (JAX's cuDNN path takes one head dim), **without** the
    document mask (so it does the whole causal triangle and wider values: more work than the other
    two), as a speed reference.
Median of warmed-up calls with block_until_ready. TFLOP/s count the visible (query, key) pairs
only: 2 x pairs x H x (192 + 128) forward, 3.5x that forward+backward (FA2 counts the backward as 2.5x).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, median_time, write_json
from ling_jax.ops.attention import attention, attention_mask
from ling_jax.ops.attention_pallas import DEFAULT_BLOCKS, Blocks, documents, mla_attention_pallas


def inputs(b: int, t: int, h: int, dn: int, dr: int, dv: int, docs: int, seed: int = 0) -> dict[str, Any]:
    ks = jax.random.split(jax.random.key(seed), 5)
    bf = jnp.bfloat16
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        for cut in sorted(rng.integers(1, t, docs - 1)):
            seg[r, cut:] += 1
    doc_q, doc_k = documents(None, jnp.asarray(seg), b, t)
    pairs = sum(int(np.sum(np.bincount(row) * (np.bincount(row) + 1) // 2)) for row in seg)
    return {"qn": jax.random.normal(ks[0], (b, t, h, dn), bf), "qr": jax.random.normal(ks[1], (b, t, h, dr), bf),
            "kn": jax.random.normal(ks[2], (b, t, h, dn), bf), "kr": jax.random.normal(ks[3], (b, t, dr), bf),
            "v": jax.random.normal(ks[4], (b, t, h, dv), bf), "doc_q": doc_q, "doc_k": doc_k, "pairs": pairs}


def impls(x: dict[str, Any], scale: float, tiles: list[Blocks]) -> dict[str, Any]:
    """name -> fn(qn, qr, kn, kr, v) -> o [B, T, H, dv]."""
    b, t, h, _ = x["qn"].shape

    def full_qk(qn, qr, kn, kr):
        k = jnp.concatenate([kn, jnp.broadcast_to(kr[:, :, None], (*kn.shape[:3], kr.shape[-1]))], -1)
        return jnp.concatenate([qn, qr], -1), k

    def xla(qn, qr, kn, kr, v):
        q, k = full_qk(qn, qr, kn, kr)
        idx = jnp.broadcast_to(jnp.arange(t), (b, t))
        return attention(q, k, v, attention_mask(idx, idx, None, x["doc_q"], x["doc_q"]), scale=scale)

    def cudnn(qn, qr, kn, kr, v):  # JAX's cuDNN path wants one head dim: v zero-padded to q's
        q, k = full_qk(qn, qr, kn, kr)
        vp = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - v.shape[-1])])
        return jax.nn.dot_product_attention(q, k, vp, scale=scale, is_causal=True,
                                            implementation="cudnn")[..., : v.shape[-1]]

    out: dict[str, Any] = {"xla": xla}
    for blocks in tiles:
        out[f"pallas {tile_name(blocks)}"] = functools.partial(
            lambda qn, qr, kn, kr, v, blocks: mla_attention_pallas(qn, qr, kn, kr, v, x["doc_q"], x["doc_k"],
                                                                   scale=scale, blocks=blocks), blocks=blocks)
    if jax.default_backend() == "gpu":
        out["cudnn (whole causal triangle)"] = cudnn
    return out


def tile_name(b: Blocks) -> str:
    return (f"fwd {b.bq}x{b.bk}/{b.warps_fwd}w dkv {b.bk_dkv}x{b.bq_dkv}/{b.warps_dkv}w "
            f"dq {b.bq_dq}x{b.bk_dq}/{b.warps_dq}w s{b.stages}")


def parse_tiles(spec: str) -> Blocks:
    """"field=value,..." of `Blocks` over the defaults, e.g. "bk_dkv=128,bq_dkv=32,warps_dkv=8"."""
    try:
        fields = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
        return dataclasses.replace(DEFAULT_BLOCKS, **fields)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--tiles {spec!r}: {e}") from e


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--docs", type=int, default=3, help="documents per row")
    ap.add_argument("--tiles", nargs="*", default=[],
                    help="extra tile sets, each field=value,... of ops.attention_pallas.Blocks")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpret mode)")
    args = ap.parse_args()
    dn, dr, dv = 128, 64, 128
    b, t, h = args.batch, args.seq_len, args.heads
    tiles = [DEFAULT_BLOCKS, *map(parse_tiles, args.tiles)]
    if args.smoke:
        b, t, h, dn, dr, dv = 1, 64, 2, 16, 16, 16
        tiles = [dataclasses.replace(DEFAULT_BLOCKS, bq=16, bk=16, bq_dkv=16, bk_dkv=16, bq_dq=16, bk_dq=16)]
    x = inputs(b, t, h, dn, dr, dv, args.docs)
    scale = (dn + dr) ** -0.5
    flops_fwd = 2 * x["pairs"] * h * (dn + dr + dv)
    result: dict[str, Any] = {**machine(), "shape": {"B": b, "T": t, "H": h, "nope": dn, "rope": dr, "v": dv,
                                                     "docs_per_row": args.docs, "visible_pairs": x["pairs"]},
                              "flops_fwd": flops_fwd, "runs": {}}
    ops = (x["qn"], x["qr"], x["kn"], x["kr"], x["v"])
    reference = grads_ref = None
    for name, fn in impls(x, scale, tiles).items():
        run: dict[str, Any] = {}
        try:
            fwd = jax.jit(fn)
            o = fwd(*ops)
            if name == "xla":
                reference = o.astype(jnp.float32)
            elif reference is not None and not name.startswith("cudnn"):
                run["rel_l2_vs_xla"] = float(jnp.linalg.norm(o.astype(jnp.float32) - reference)
                                             / jnp.linalg.norm(reference))
            run["fwd_ms"] = median_time(lambda f=fwd: f(*ops), reps=args.reps, warmup=2) * 1e3
            grad = jax.jit(jax.grad(lambda *a, f=fn: jnp.sum(f(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4)))
            g = grad(*ops)
            if name == "xla":
                grads_ref = g
            elif grads_ref is not None and not name.startswith("cudnn"):
                run["grad_rel_l2_vs_xla"] = max(
                    float(jnp.linalg.norm((a - r).astype(jnp.float32)) / jnp.linalg.norm(r.astype(jnp.float32)))
                    for a, r in zip(g, grads_ref, strict=True))
            run["fwd_bwd_ms"] = median_time(lambda g=grad: g(*ops), reps=args.reps, warmup=2) * 1e3
            run["fwd_tflops"] = flops_fwd / run["fwd_ms"] / 1e9
            run["fwd_bwd_tflops"] = 3.5 * flops_fwd / run["fwd_bwd_ms"] / 1e9
        except Exception as err:  # one failing variant must not lose the others' numbers
            run["error"] = f"{type(err).__name__}: {str(err)[:400]}"
            traceback.print_exc()
        result["runs"][name] = run
        print(f"{name:60s} " + " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in run.items()), flush=True)
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

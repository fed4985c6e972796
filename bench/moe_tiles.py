"""Tile sweep of the Mosaic-GPU grouped matmuls behind `ops.moe`, one matmul at a time.

    python3 bench/moe_tiles.py --out bench/results/moe_tiles_h200.json      # on an sm90 GPU
    python3 bench/moe_tiles.py --kernel aligned --out ...                  # ops.aligned_gmm

`--kernel mgpu` (impl "mgpu": JAX's `ragged_dot_mgpu`) or `aligned` (impl "aligned": our persistent
kernel over rows laid out in whole tiles per expert; its dW is `transposed_ragged_dot` on that
layout; tile sets there are m,n,k,steps,band of `aligned_gmm.Tiles`, the rows laid out anew for each
m, and each entry also records the kernel's device time from a profiler trace, `device_s`: at
decode sizes, `--tokens 16`, the kernel is shorter than a call's dispatch).

For one MoE layer's shapes (Ling-3.0-tiny, Ling-3.1-flash) at N tokens (default 16k, k copies each,
rows sorted by expert with the real router's uneven loads), times each of the six grouped matmuls
of a training step - forward gate/up ([M, D] x [E, D, I]) and down ([M, I] x [E, I, D]), their dX
(the same kernel with the weights transposed) and their dW (`transposed_ragged_dot`) - for every
tile set of the grid below: (block_m, block_n, block_k, max_concurrent_steps, grid_block_n).
Tile sets that do not fit shared memory are recorded as such. Prints the best per matmul; the
JSON keeps every time (median of warmed-up calls with block_until_ready) and TFLOP/s of the
routed work, next to a dense [M, K] x [K, N] matmul of the same FLOPs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, median_time, write_json
from bench.device_profile import kernel_profile
from bench.moe import MODELS
from ling_jax.config import LingConfig
from ling_jax.layers.moe import route
from ling_jax.ops import aligned_gmm
from ling_jax.ops import moe as moe_ops

GRID = {"block_m": (64, 128), "block_n": (64, 128, 256), "block_k": (64,), "steps": (2, 4, 6),
        "grid_block_n": (1,)}


def tile_sets(quick: bool, gbn: list[int] | None = None) -> list[tuple[int, ...]]:
    """(bm, bn, bk, steps, gbn) candidates; a 128 x 256 fp32 accumulator does not fit one warpgroup."""
    grid = dict(GRID, steps=(4,)) if quick else dict(GRID)
    if gbn:
        grid["grid_block_n"] = tuple(gbn)
    sets = itertools.product(*grid.values())
    return [s for s in sets if s[0] * s[1] <= 64 * 256]


def matmuls(cfg: LingConfig, n: int, seed: int, kernel: str = "mgpu", tm: int = aligned_gmm.TILES.m
            ) -> tuple[dict[str, Any], jax.Array, jax.Array | None]:
    """The six matmuls' operands at this shape, rows sorted by the real router's expert choice
    (`aligned`: each expert's rows start on a tile of tm rows, the rest of that tile zero), the
    router's copies per expert, and (`aligned`) each row tile's expert."""
    d, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    keys = jax.random.split(jax.random.key(seed), 6)
    x_ND = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
    router_DE = jax.random.normal(keys[1], (d, e), jnp.float32) * d**-0.5
    idx_NK, _, _ = jax.jit(functools.partial(route, cfg=cfg))(x_ND, router_DE, jnp.zeros((e,), jnp.float32))
    loads_E = gs_E = jnp.bincount(idx_NK.reshape(-1), length=e).astype(jnp.int32)
    m = idx_NK.size
    rows, tile_group_T = m, None
    if kernel == "aligned":
        tiles_T = aligned_gmm.num_tiles(m, e, tm)
        rows = tiles_T * tm
        _, tile_group_T = aligned_gmm.tile_layout(gs_E, tiles_T, tm)
        gs_E = (gs_E + tm - 1) // tm * tm
    xs_MD = jax.random.normal(keys[2], (rows, d), jnp.bfloat16)
    h_MI = jax.random.normal(keys[3], (rows, i), jnp.bfloat16)
    w_EDI = jax.random.normal(keys[4], (e, d, i), jnp.bfloat16) * d**-0.5
    w_EID = jax.random.normal(keys[5], (e, i, d), jnp.bfloat16) * i**-0.5
    if kernel == "aligned":
        mm = lambda x, w, transpose_rhs: aligned_gmm.aligned_matmul(  # noqa: E731
            x, w, tile_group_T, transpose_rhs=transpose_rhs, tiles=ALIGNED[0])
    else:
        mm = functools.partial(moe_ops._mgpu_matmul, gs_G=gs_E)
    dw = functools.partial(moe_ops._mgpu_dw, gs_G=gs_E)
    return {  # name: (fn, args, (M, K, N) of the routed work)
        "fwd_gate_up": (lambda x, w: mm(x, w, transpose_rhs=False), (xs_MD, w_EDI), (m, d, i)),
        "fwd_down": (lambda x, w: mm(x, w, transpose_rhs=False), (h_MI, w_EID), (m, i, d)),
        "dx_gate_up": (lambda dy, w: mm(dy, w, transpose_rhs=True), (h_MI, w_EDI), (m, i, d)),
        "dx_down": (lambda dy, w: mm(dy, w, transpose_rhs=True), (xs_MD, w_EID), (m, d, i)),
        "dw_gate_up": (lambda x, dy: dw(x, dy), (xs_MD, h_MI), (m, d, i)),
        "dw_down": (lambda x, dy: dw(x, dy), (h_MI, xs_MD), (m, i, d)),
        # dX with the weights transposed by XLA first (the transpose is timed too)
        "dx_gate_up_xt": (lambda dy, w: mm(dy, jnp.swapaxes(w, 1, 2), transpose_rhs=False), (h_MI, w_EDI), (m, i, d)),
        "dx_down_xt": (lambda dy, w: mm(dy, jnp.swapaxes(w, 1, 2), transpose_rhs=False), (xs_MD, w_EID), (m, d, i)),
    }, loads_E, tile_group_T


@functools.lru_cache(maxsize=1)  # one layout's operands on the device at a time
def layout(model: str, tokens: int, kernel: str, tm: int) -> tuple[dict[str, Any], jax.Array, jax.Array | None]:
    """`matmuls` of a model at `tokens` tokens, aligned rows in tiles of tm."""
    return matmuls(LingConfig.preset(MODELS[model]), tokens, seed=0, kernel=kernel, tm=tm)


ALIGNED = [aligned_gmm.TILES]  # the aligned kernel's tiles while timing


def set_tiles(t: tuple[int, ...], kernel: str = "mgpu") -> None:
    if kernel == "aligned":
        m, n, k, steps, band = t
        ALIGNED[0] = aligned_gmm.Tiles(m=m, n=n, k=k, steps=steps, epi_m=min(m, 64), epi_n=min(n, 64), band=band)
        return
    (moe_ops.MGPU_BLOCK_M, moe_ops.MGPU_BLOCK_N, moe_ops.MGPU_BLOCK_K, moe_ops.MGPU_STEPS,
     moe_ops.MGPU_GRID_BLOCK_N) = t


def check(name: str, got: jax.Array, operands: tuple[jax.Array, jax.Array], tile_group_T: jax.Array) -> float:
    """Relative L2 error of one aligned-layout matmul against float32 XLA einsums per row tile
    (tiles past the last group's must be zero in forward/dX results, and are skipped by dW)."""
    a, b = (o.astype(jnp.float32) for o in operands)
    t, tm = tile_group_T.shape[0], a.shape[0] // tile_group_T.shape[0]
    a_T = a.reshape(t, tm, -1)
    used_T = tile_group_T >= 0
    g_T = jnp.maximum(tile_group_T, 0)
    if name.startswith("dw"):
        prods = jnp.einsum("tmk,tmn->tkn", a_T, b.reshape(t, tm, -1)) * used_T[:, None, None]
        want = jax.ops.segment_sum(prods, g_T, num_segments=got.shape[0])
    else:
        w = jnp.swapaxes(b, 1, 2) if name.startswith("dx") else b
        want = (jnp.einsum("tmk,tkn->tmn", a_T, w[g_T]) * used_T[:, None, None]).reshape(a.shape[0], -1)
    got = got.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--only", nargs="+", default=None,
                    help="matmul names to time (default: the six; dx_gate_up_xt, dx_down_xt: dX with XLA's transpose)")
    ap.add_argument("--quick", action="store_true", help="block sizes only (steps 4, grid_block_n 1)")
    ap.add_argument("--grid-block-n", type=int, nargs="+", default=None, help="also sweep these grid_block_n")
    ap.add_argument("--tiles", nargs="+", default=None, help="explicit tile sets bm,bn,bk,steps,gbn (no grid)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--kernel", choices=("mgpu", "aligned"), default="mgpu")
    ap.add_argument("--check", action="store_true", help="aligned: also compare each result with XLA einsums")
    args = ap.parse_args()
    t0 = aligned_gmm.TILES
    default = ((t0.m, t0.n, t0.k, t0.steps, t0.band) if args.kernel == "aligned" else
               (moe_ops.MGPU_BLOCK_M, moe_ops.MGPU_BLOCK_N, moe_ops.MGPU_BLOCK_K, moe_ops.MGPU_STEPS,
                moe_ops.MGPU_GRID_BLOCK_N))
    result: dict[str, Any] = {**machine(), "command": " ".join(["python3", *sys.argv]), "tokens": args.tokens,
                              "kernel": args.kernel, "default_tiles": default, "rows": []}
    dense = jax.jit(jnp.matmul)
    for model in args.models:
        cfg = LingConfig.preset(MODELS[model])
        ops, loads_E, _ = layout(model, args.tokens, args.kernel, ALIGNED[0].m)
        loads = np.asarray(loads_E)
        for name, (_, _, (m, k, n)) in ops.items():
            if (name not in args.only) if args.only else name.endswith("_xt"):
                continue
            flops = 2 * m * k * n
            a = jnp.ones((m, k), jnp.bfloat16)
            b = jnp.ones((k, n), jnp.bfloat16)
            dense_s = median_time(lambda a=a, b=b: dense(a, b), reps=args.reps, warmup=2)
            del a, b
            row = {"model": model, "matmul": name, "M": m, "K": k, "N": n, "E": cfg.num_experts,
                   "load_max_over_mean": float(loads.max() / loads.mean()),
                   "dense_s": dense_s, "dense_tflops": flops / dense_s / 1e12, "tiles": []}
            sets = ([tuple(int(v) for v in ts.split(",")) for ts in args.tiles] if args.tiles
                    else [default] if args.kernel == "aligned" else tile_sets(args.quick, args.grid_block_n))
            for t in sets:
                print(f"  {name} {t}", file=sys.stderr, flush=True)  # a compiler crash names its tile set
                set_tiles(t, args.kernel)
                tiled_ops, _, tile_group_T = layout(model, args.tokens, args.kernel, ALIGNED[0].m)
                fn, operands = tiled_ops[name][:2]
                entry: dict[str, Any] = {"tiles": t}
                try:
                    f = jax.jit(fn)
                    entry["s"] = median_time(lambda f=f, ops=operands: f(*ops), reps=args.reps, warmup=2)
                    if args.kernel == "aligned":
                        prof = kernel_profile(lambda f=f, ops=operands: f(*ops), calls=args.reps)
                        entry["device_s"] = prof["device_busy_s_per_call"] if prof else None
                    if args.check and tile_group_T is not None and not name.endswith("_xt"):
                        entry["rel_err"] = check(name, f(*operands), operands, tile_group_T)
                    entry["tflops"] = flops / entry["s"] / 1e12
                    entry["ratio_to_dense"] = dense_s / entry["s"]
                except Exception as err:  # e.g. "exceeds available shared memory": recorded, next
                    entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                    if "shared memory" not in str(err):
                        traceback.print_exc()
                row["tiles"].append(entry)
                print(f"    {t}: {1e6 * entry.get('s', float('nan')):.1f} us per call, device "
                      f"{1e6 * (entry.get('device_s') or float('nan')):.1f} us", file=sys.stderr, flush=True)
                jax.clear_caches()
            set_tiles(default, args.kernel)
            ok = [e for e in row["tiles"] if "s" in e]
            if ok:
                best = min(ok, key=lambda e: e.get("device_s") or e["s"])
                dflt = next((e for e in ok if tuple(e["tiles"]) == default), None)
                row["best"] = best
                print(f"{model:15s} {name:12s} dense {row['dense_tflops']:6.1f} TFLOP/s | best {best['tiles']} "
                      f"{best['tflops']:6.1f} ({best['ratio_to_dense']:.2f}x dense) | default "
                      f"{dflt['tflops'] if dflt else float('nan'):6.1f}", flush=True)
            result["rows"].append(row)
            write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

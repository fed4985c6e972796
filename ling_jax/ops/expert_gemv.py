"""Decode-sized routed-expert products as a Pallas kernel: each token copy's expert weights read by rows.

At decode a MoE layer sees a few token copies (N tokens x k choices), so its expert products are
weight-vector products whose whole cost is reading the chosen experts' weights. XLA lowers them to
a reduction whose fused gather walks every [C, O] weight column by column (0.36 TB/s on an H200,
BENCHMARKS.md). Here every program reads one [BC, BO] tile of one copy's expert as contiguous
rows, multiplies it by that copy's BC inputs and sums over BC in float32. The grid is (copy,
output tile, input tile): the reduction is split across programs so that even one copy keeps
every SM streaming, and the [S, M, O] partial sums (S = C / BC, a few hundred KB) are added by XLA.

Triton lowering on GPU; interpret mode elsewhere (tests). Tiles are powers of two (Triton's rule)
dividing C and O; `supported` says whether a shape has them. `ops.moe` runs it as `impl="gemv"`.
The weights must be dense arrays: with FP8-resident weights the layer would first dequantize every
expert (XLA fuses that into its own gather, so `gather` reads only the chosen FP8 experts). On an
H200, a Ling-3.0-tiny MoE layer at batch 1 takes 28 us here against 115 us for `gather`
(`bench/decode_kernels.py`, BENCHMARKS.md) — when the weights come whole (`ops.moe.ExpertStack`):
XLA copies a sliced weight stack before any custom call, 201 MB per weight per step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ling_jax.ops.pallas_gpu import call_options, whole

MAX_BC = 64  # input rows per tile: a [64, 128] float32 tile is 64 values per thread at 4 warps
MAX_BO = 128
MIN_TILE = 16
NUM_WARPS = 4


def _tile(n: int, cap: int) -> int | None:
    """The largest power of two in [MIN_TILE, cap] that divides n, or None."""
    t = cap
    while t >= MIN_TILE:
        if n % t == 0:
            return t
        t //= 2
    return None


def supported(c: int, o: int) -> bool:
    """Whether [C, O] expert weights can be tiled by this kernel."""
    return _tile(c, MAX_BC) is not None and _tile(o, MAX_BO) is not None


def _kernel(idx_ref, x_ref, *refs, n_w: int, bc: int, bo: int, copies: int):
    m, o, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = idx_ref[m]
    x_C = x_ref[m // copies, pl.ds(s * bc, bc)].astype(jnp.float32)
    for w_ref, out_ref in zip(refs[:n_w], refs[n_w:], strict=True):
        w_CO = w_ref[e, pl.ds(s * bc, bc), pl.ds(o * bo, bo)].astype(jnp.float32)
        out_ref[...] = jnp.sum(x_C[:, None] * w_CO, axis=0)


def gathered_products(x_MC: jax.Array, idx_M: jax.Array, weights: tuple[jax.Array, ...], *,
                      copies: int = 1, interpret: bool | None = None) -> tuple[jax.Array, ...]:
    """For every weight stack w [E, C, O]: x[m // copies] @ w[idx[m]] for each copy m -> [M, O] float32.

    x: [M / copies, C] (one row per token, each token used by `copies` consecutive copies: no
    repeated copy of x), idx: [M] int32 expert of each copy (must be in [0, E)). All weights share
    E, C and O. `interpret` defaults to True off GPU.
    """
    m, c = idx_M.shape[0], x_MC.shape[1]
    if x_MC.shape[0] * copies != m:
        raise ValueError(f"gathered_products: {x_MC.shape[0]} rows x {copies} copies != {m} expert ids")
    o = weights[0].shape[-1]
    if not supported(c, o):
        raise ValueError(f"gathered_products: no power-of-two tile >= {MIN_TILE} divides C={c} and O={o}")
    if any(w.shape != weights[0].shape for w in weights):
        raise ValueError(f"gathered_products: weight shapes differ: {[w.shape for w in weights]}")
    bc, bo = _tile(c, MAX_BC), _tile(o, MAX_BO)
    s = c // bc
    partials = pl.pallas_call(
        functools.partial(_kernel, n_w=len(weights), bc=bc, bo=bo, copies=copies),
        out_shape=[jax.ShapeDtypeStruct((s, m, o), jnp.float32) for _ in weights],
        grid=(m, o // bo, s),
        in_specs=[whole(a) for a in (idx_M, x_MC, *weights)],
        out_specs=[pl.BlockSpec((None, None, bo), lambda mi, oi, si: (si, mi, oi)) for _ in weights],
        name="expert_gemv",
        **call_options(interpret, num_warps=NUM_WARPS, num_stages=1),
    )(idx_M.astype(jnp.int32), x_MC, *weights)
    return tuple(p.sum(0) for p in partials)

"""One-row projections from a transposed weight stack: every program sums whole rows of w_t [O, C].

The gemv kernel (`ops.expert_gemv`) reads a [C, O] weight in [BC, BO] tiles, each row of a tile
2 * BO contiguous bytes, and leaves the [C / BC, O] partial sums to a second launch. Stored
transposed, [O, C] (the checkpoint's own layout), each output is one contiguous row: a program
here reads BO whole rows in BCH-wide steps of a pipelined loop, sums them itself and writes its BO
outputs in the activation dtype, so no partial sums and no launch to add them. Where a program's
rows are small enough (`MAX_UNROLLED`) the loop is unrolled and every weight load issued at once,
before the norm's reduction over the row. On an H200 the
Ling-3.0-tiny KDA input projection ([1536, 10240], 31.5 MB) took 9.6 us per call this way against
11.4 us for the tiled kernel and 9.8 us for XLA's read-only sum of the same bytes
(`bench/gemv_layout.py`, BENCHMARKS.md).

The weight stays in its segment's [L, O, C] stack and the kernel indexes the layer (XLA copies a
sliced operand of a custom call whole). x as `expert_gemv.NormedRows`: each program normalises the
row itself (its sum of squares over C, then the model's RMSNorm casts). Triton lowering on GPU,
interpret mode elsewhere; C is read in power-of-two steps that divide it, O in BO-row blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling_jax.ops import expert_gemv
from ling_jax.ops.expert_gemv import NormedRows
from ling_jax.ops.pallas_gpu import call_options, index_operand, whole

BO = 16  # output rows per program
MAX_BCH = 256  # columns of C per loop step
MIN_BCH = 16
NUM_WARPS = 4
NUM_STAGES = 3
MAX_UNROLLED = 32768  # BO x C up to this: every weight load issued first (unrolled), else a pipelined loop


def _step(c: int) -> int | None:
    """The largest power of two in [MIN_BCH, MAX_BCH] that divides C, or None."""
    t = MAX_BCH
    while t >= MIN_BCH:
        if c % t == 0:
            return t
        t //= 2
    return None


def supported(c: int, o: int) -> bool:
    """Whether a transposed [O, C] weight can be read by this kernel."""
    return _step(c) is not None and o % BO == 0


def _kernel(idx_ref, x_ref, *refs, bch: int, eps: float | None):
    r, i = pl.program_id(0), pl.program_id(1)
    norm_ref, (w_ref, out_ref) = (refs[0], refs[1:]) if eps is not None else (None, refs)
    c, dt = x_ref.shape[-1], x_ref.dtype
    rows = pl.ds(i * BO, BO)

    def weight(j: int | jax.Array) -> jax.Array:  # [BO, BCH]
        return pltriton.load(w_ref.at[idx_ref[0], rows, pl.ds(j * bch, bch)],
                             eviction_policy=expert_gemv.WEIGHT_EVICTION).astype(jnp.float32)

    unrolled = BO * c <= MAX_UNROLLED
    ws = [weight(j) for j in range(c // bch if unrolled else 1)]  # issued before the norm, to cover its latency
    inv = None
    if eps is not None:
        squares = [jnp.sum(jnp.square(x_ref[r, pl.ds(j * bch, bch)].astype(jnp.float32))) for j in range(c // bch)]
        inv = jax.lax.rsqrt(functools.reduce(jnp.add, squares) / c + eps)

    def x_part(j: int | jax.Array) -> jax.Array:  # [BCH] float32, normed as `layers.norms.rms_norm` casts
        x = x_ref[r, pl.ds(j * bch, bch)].astype(jnp.float32)
        if inv is None:
            return x
        return ((x * inv).astype(dt) * norm_ref[idx_ref[1], pl.ds(j * bch, bch)].astype(dt)).astype(jnp.float32)

    def step(j: jax.Array, acc: jax.Array) -> jax.Array:
        return acc + jnp.sum(weight(j) * x_part(j)[None, :], axis=1)

    parts = [jnp.sum(w * x_part(j)[None, :], axis=1) for j, w in enumerate(ws)]
    acc = functools.reduce(jnp.add, parts)
    if not unrolled:
        acc = jax.lax.fori_loop(1, c // bch, step, acc)
    out_ref[...] = acc.astype(out_ref.dtype)


def transposed_products(x_RC: jax.Array | NormedRows, stack_LOC: jax.Array, layer: int | jax.Array, *,
                        out_dtype: jnp.dtype | None = None, interpret: bool | None = None) -> jax.Array:
    """x [R, C] @ stack[layer].T -> [R, O] in `out_dtype` (default x's; float32 accumulation).

    stack: [L, O, C], one layer's projection transposed per entry; `layer` an int32 scalar (a
    constant in the unrolled decode step: no launch builds the index operand). `interpret`
    defaults to True off GPU."""
    norm, eps, norm_layer = (), None, 0
    if isinstance(x_RC, NormedRows):
        if x_RC.weight.shape[-1] != x_RC.shape[-1]:
            raise ValueError(f"transposed_products: norm weights {x_RC.weight.shape} do not match rows {x_RC.shape}")
        norm, eps, norm_layer, x_RC = (x_RC.weight,), x_RC.eps, x_RC.layer, x_RC.x
    (r, c), (_, o, c_w) = x_RC.shape, stack_LOC.shape
    if c_w != c:
        raise ValueError(f"transposed_products: rows [{r}, {c}] do not match a transposed [{o}, {c_w}] weight")
    if not supported(c, o):
        raise ValueError(f"transposed_products: C={c} needs a power-of-two step >= {MIN_BCH} dividing it and "
                         f"O={o} a multiple of {BO}")
    idx = index_operand([layer, norm_layer])
    out_dtype = x_RC.dtype if out_dtype is None else out_dtype
    return pl.pallas_call(
        functools.partial(_kernel, bch=_step(c), eps=eps),
        out_shape=jax.ShapeDtypeStruct((r, o), out_dtype),
        grid=(r, o // BO),
        in_specs=[whole(a) for a in (idx, x_RC, *norm, stack_LOC)],
        out_specs=pl.BlockSpec((None, BO), lambda ri, oi: (ri, oi)),
        name="row_gemv",
        **call_options(interpret, num_warps=NUM_WARPS, num_stages=NUM_STAGES),
    )(idx, x_RC, *norm, stack_LOC)

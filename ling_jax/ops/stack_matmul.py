"""A few rows times one layer's weight, read from its segment's stack in place (decode at batch > 1).

In the unrolled decode step every dense projection multiplies a few rows (the batch) by one layer's
[C, O] weight, sliced from its segment's [L, C, O] stack. XLA copies such a slice before its
product, every step (docs/decode-performance.md, "What XLA does that the step must avoid"). Here
the weight stays in its stack (`layer_gemv.WeightStack`): the grid is (output tile, split of C),
each program walks its split of C in [BK, BO] weight tiles with Triton's dot on all rows at once
([BR, BK] x [BK, BO], rows zero-padded to a power of two >= 16) and writes float32 partial sums,
added by their consumer's fusion (`expert_gemv.add_partials`). The split is as wide as fills the
GPU (`Launch.stack_programs`) while the partial sums stay a fraction of the weight's bytes.

Triton on a GPU, interpret mode elsewhere (`Launch.interpret`). `layer_gemv.linear` runs it for 2
to `MAX_ROWS` rows on the stack views the decode step makes where the `Kernels` record's
`decode_proj` says so; one row goes to the gemv kernel (`ops.expert_gemv`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ling_jax.ops.pallas_gpu import DEFAULT_LAUNCH, Launch, index_operand, next_pow2, pad_axis, triton_call, whole

# rows per call: beyond, the split that fills the GPU writes partial sums as large as the weight
# (batch 128: XLA's copy and product)
MAX_ROWS = 64
BK, BO = 64, 64  # weight tile [BK, BO] per loop step
PARTIALS_SHARE = 4  # the partial sums (S x R x O float32) at most 1/PARTIALS_SHARE of the weight's bytes
NUM_WARPS, NUM_STAGES = 4, 3


def supported(rows: int, c: int, o: int) -> bool:
    """Whether the kernel multiplies `rows` rows by a [C, O] weight: its tiles divide C and O."""
    return 1 <= rows <= MAX_ROWS and c % BK == 0 and o % BO == 0


def splits(rows: int, c: int, o: int, itemsize: int, programs: int = DEFAULT_LAUNCH.stack_programs) -> int:
    """How many pieces C is split into: a power of two dividing C / BK, up to `programs` programs,
    partial sums at most 1/PARTIALS_SHARE of the weight."""
    steps = c // BK
    s = 1
    while (steps % (2 * s) == 0 and (o // BO) * s < programs
           and 2 * s * next_pow2(rows) * 4 * PARTIALS_SHARE <= c * itemsize):
        s *= 2
    return s


def _kernel(layer_ref, x_ref, w_ref, out_ref, *, steps: int):
    o, s = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    bo = out_ref.shape[-1]

    def step(j, acc_RO):
        k = (s * steps + j) * BK
        w_KO = w_ref[layer, pl.ds(k, BK), pl.ds(o * bo, bo)]
        x_RK = x_ref[:, pl.ds(k, BK)]
        precision = jax.lax.Precision.HIGHEST if x_RK.dtype == jnp.float32 else None  # float32: not TF32
        return acc_RO + jax.lax.dot(x_RK, w_KO.astype(x_RK.dtype), precision=precision,
                                    preferred_element_type=jnp.float32)

    out_ref[...] = jax.lax.fori_loop(0, steps, step, jnp.zeros(out_ref.shape, jnp.float32))


def partial_products(x_RC: jax.Array, stack_LCO: jax.Array, layer: int | jax.Array, *,
                     interpret: bool | None = None, launch: Launch = DEFAULT_LAUNCH) -> jax.Array:
    """x [R, C] @ stack[layer] [C, O] as float32 partial sums [S, R, O] over S pieces of C (their sum
    is the product; `launch.stack_programs` sizes the split). `layer` an int32 scalar; x and the stack
    in one floating dtype."""
    r, c = x_RC.shape
    _, c_w, o = stack_LCO.shape
    if c_w != c:
        raise ValueError(f"stack_matmul: x [{r}, {c}] does not match a [{c_w}, {o}] weight")
    if not supported(r, c, o):
        raise ValueError(f"stack_matmul: {r} rows of a [{c}, {o}] weight: needs 1..{MAX_ROWS} rows, "
                         f"C a multiple of {BK} and O of {BO}")
    br = max(16, next_pow2(r))  # Triton's smallest dot
    s = splits(r, c, o, jnp.dtype(stack_LCO.dtype).itemsize, launch.stack_programs)
    x = pad_axis(x_RC, 0, br)
    layer_1 = index_operand([layer])
    parts = triton_call(
        functools.partial(_kernel, steps=c // BK // s),
        out_shape=jax.ShapeDtypeStruct((s, br, o), jnp.float32),
        grid=(o // BO, s),
        in_specs=[whole(layer_1), whole(x), whole(stack_LCO)],
        out_specs=pl.BlockSpec((None, br, BO), lambda oi, si: (si, 0, oi)),
        name="stack_matmul",
        interpret=launch.interpret if interpret is None else interpret, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )(layer_1, x, stack_LCO)
    return parts[:, :r]

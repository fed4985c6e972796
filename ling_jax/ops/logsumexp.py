"""Row log-sum-exp of a wide matrix in one read: the loss's softmax over a [tokens, vocab] logits chunk.

XLA computes `logsumexp` as two passes over the logits (the row max, then the sum of exponentials):
two reads of each logits chunk. The Triton kernel reads each row once, keeping a running max and a
rescaled running sum (the online softmax); the same value up to float32 rounding. The `Kernels`
record picks it (`Kernels.logsumexp`) on one GPU; elsewhere the loss takes XLA's
`jax.nn.logsumexp`, and tests run the kernel in interpret mode. Figures: BENCHMARKS.md, "Log-sum-exp
of the loss's logits"; docs/kernels.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling_jax.ops.pallas_gpu import pad_axis, triton_call, whole

F32 = jnp.float32
ROWS, COLS = 8, 1024  # rows per program, columns per step of its loop
WARPS = 4


def row_logsumexp(x_RV: jax.Array, *, impl: str = "xla", interpret: bool | None = None) -> jax.Array:
    """log(sum(exp(x), axis=-1)) [R] in float32 of x [R, V] (any float dtype).

    impl: "xla" or "pallas" (the kernel: not partitioned by GSPMD, so for one device;
    `ling_jax.kernels` picks it on one GPU), else ValueError. `interpret`: None chooses where the
    program is lowered (Triton for a GPU, interpret mode elsewhere). Not differentiable (the loss
    makes its own gradient)."""
    if impl == "xla":
        return jax.nn.logsumexp(x_RV.astype(F32), axis=-1)
    if impl != "pallas":
        raise ValueError(f"impl={impl!r}: must be 'xla' or 'pallas'")
    r, v = x_RV.shape
    xp = pad_axis(x_RV, 0, ROWS)
    out = triton_call(
        functools.partial(_kernel, v=v),
        grid=(xp.shape[0] // ROWS,),
        in_specs=[whole(xp)],
        out_specs=pl.BlockSpec((ROWS,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0],), F32),
        name="row_logsumexp",
        interpret=interpret, num_warps=WARPS, num_stages=2,
    )(xp)
    return out[:r]


def _kernel(x_ref, out_ref, *, v: int):
    rows = pl.program_id(0) * ROWS + jnp.arange(ROWS)

    def step(i, carry):
        m_R, s_R = carry
        cols = i * COLS + jnp.arange(COLS)
        ok = cols < v
        x_RC = pltriton.load(x_ref.at[rows[:, None], jnp.where(ok, cols, 0)[None, :]], mask=ok[None, :],
                             other=-jnp.inf).astype(F32)
        m_new = jnp.maximum(m_R, jnp.max(x_RC, axis=1))
        s_new = s_R * jnp.exp(m_R - m_new) + jnp.sum(jnp.exp(x_RC - m_new[:, None]), axis=1)
        return m_new, s_new

    init = (jnp.full((ROWS,), -jnp.inf, F32), jnp.zeros((ROWS,), F32))
    m_R, s_R = jax.lax.fori_loop(0, pl.cdiv(v, COLS), step, init)
    out_ref[...] = m_R + jnp.log(s_R)

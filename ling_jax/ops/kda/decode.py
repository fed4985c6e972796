"""One KDA token against a cached state: the decode-loop path of `kimi_delta_attention`.

At one token per step the recurrence is a rank-1 update of the [K, V] state; reading and writing
that state once is the whole cost. `kda_decode_step` is the XLA form, which walks the state with K
fastest in each of its two state products. `kda_decode_step_pallas` does the step in one kernel,
one pass over the state: programs over (row, head, block of V columns), each holding its [K, BV]
slice, written back in place. Triton on a GPU, interpret mode elsewhere (`Launch.interpret`).

The decode step runs it where the `Kernels` record's `decode_kda` says so and the KDA layer kernel
(`ops.kda.decode_layer`: the conv, gate and this step in one launch, `kernels.kda_layer_kernel`)
does not apply: the scanned step, and per shard under a multi-device mesh
(`ling_jax.decode.layers.kda`). Its tiles are not tuned per batch size; how it compares with the
XLA step by batch: BENCHMARKS.md, "Decode kernels alone".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ling_jax.ops.pallas_gpu import DEFAULT_LAUNCH, Launch, is_pow2, triton_call

BV = 32  # state columns per program (16 when rows x heads are too few to fill the GPU)
NUM_WARPS = 4


def kda_decode_step(
    q_BHK: jax.Array, k_BHK: jax.Array, v_BHV: jax.Array, g_BHK: jax.Array, beta_BH: jax.Array,
    state_BHKV: jax.Array, *, scale: float,
) -> tuple[jax.Array, jax.Array]:
    """(o [B, H, V] in v's dtype, new state [B, H, K, V] float32); q, k already L2-normalised."""
    f32 = jnp.float32
    s = state_BHKV.astype(f32) * jnp.exp(g_BHK.astype(f32))[..., None]
    k = k_BHK.astype(f32)
    u_BHV = beta_BH.astype(f32)[..., None] * (v_BHV.astype(f32) - jnp.einsum("bhk,bhkv->bhv", k, s))
    s = s + k[..., :, None] * u_BHV[..., None, :]
    o_BHV = jnp.einsum("bhk,bhkv->bhv", q_BHK.astype(f32) * scale, s)
    return o_BHV.astype(v_BHV.dtype), s


def pallas_supported(dk: int, dv: int) -> bool:
    """Whether the kernel handles [K, V] states: both powers of two, at least 16."""
    return is_pow2(dk) and is_pow2(dv) and dk >= 16 and dv >= 16


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, scale: float):
    f32 = jnp.float32
    k_K = k_ref[...].astype(f32)
    s_KV = s_ref[...] * jnp.exp(g_ref[...].astype(f32))[:, None]
    u_V = beta_ref[...].astype(f32) * (v_ref[...].astype(f32) - jnp.sum(k_K[:, None] * s_KV, axis=0))
    s_KV = s_KV + k_K[:, None] * u_V[None, :]
    o_ref[...] = jnp.sum((q_ref[...].astype(f32) * scale)[:, None] * s_KV, axis=0).astype(o_ref.dtype)
    s_out_ref[...] = s_KV


def kda_decode_step_pallas(
    q_BHK: jax.Array, k_BHK: jax.Array, v_BHV: jax.Array, g_BHK: jax.Array, beta_BH: jax.Array,
    state_BHKV: jax.Array, *, scale: float, interpret: bool | None = None, launch: Launch = DEFAULT_LAUNCH,
) -> tuple[jax.Array, jax.Array]:
    """`kda_decode_step` as one Pallas kernel (same arguments and results); the state is updated in place.
    Narrower blocks of V where fewer than `launch.kda_programs` programs would run. ValueError unless K
    and V are powers of two >= 16 (`pallas_supported`)."""
    b, h, dk = q_BHK.shape
    dv = v_BHV.shape[-1]
    if not pallas_supported(dk, dv):
        raise ValueError(f"kda_decode_step_pallas: K={dk} and V={dv} must be powers of two >= 16")
    bv = min(BV, dv) if b * h * dv // min(BV, dv) >= launch.kda_programs else min(16, dv)
    vec_k = pl.BlockSpec((None, None, dk), lambda bi, hi, vi: (bi, hi, 0))
    vec_v = pl.BlockSpec((None, None, bv), lambda bi, hi, vi: (bi, hi, vi))
    state = pl.BlockSpec((None, None, dk, bv), lambda bi, hi, vi: (bi, hi, 0, vi))
    o_BHV, s_BHKV = triton_call(
        functools.partial(_step_kernel, scale=scale),
        out_shape=[jax.ShapeDtypeStruct((b, h, dv), v_BHV.dtype), jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)],
        grid=(b, h, dv // bv),
        in_specs=[vec_k, vec_k, vec_v, vec_k, pl.BlockSpec((None, None, 1), lambda bi, hi, vi: (bi, hi, 0)), state],
        out_specs=[vec_v, state],
        input_output_aliases={5: 1},
        name="kda_decode_step",
        interpret=launch.interpret if interpret is None else interpret, num_warps=NUM_WARPS, num_stages=1,
    )(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH[..., None], state_BHKV.astype(jnp.float32))
    return o_BHV, s_BHKV

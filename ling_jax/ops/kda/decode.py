"""One KDA token against a cached state: the decode-loop path of `kimi_delta_attention`.

At one token per step the recurrence is a rank-1 update of the [K, V] state; reading and writing
that state once is the whole cost. `kda_decode_step` is the XLA form; on an H200, inside the
decode step of an earlier profile, XLA spent 19 us on each of its two state products for a 1 MB
state (it walks the state with K fastest). `kda_decode_step_pallas` does the step in one kernel,
one pass over the state: programs over (row, head, block of V columns), each holding its [K, BV]
slice, written back in place.
Triton lowering on GPU, interpret mode elsewhere. The config's `pallas_decode("kda")` selects it
("pallas", or "auto" on a GPU). Timed alone on an H200 (`bench/decode_kernels.py`), it is as fast
as the XLA step at batch 1 (13 vs 14 us: both launch-bound at 1 MB of state), slower at batch 8
(23 vs 15 us) and faster at batch 16 (27 vs 35 us); in the unrolled step it takes 2.9 us per layer
at batch 1 (BENCHMARKS.md). Its tiles are not yet tuned per batch size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ling_jax.ops.pallas_gpu import call_options, is_pow2, whole

BV = 32  # state columns per program (16 when rows x heads are too few to fill the GPU)
MIN_PROGRAMS = 132
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
    state_BHKV: jax.Array, *, scale: float, interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`kda_decode_step` as one Pallas kernel (same arguments and results); the state is updated in place."""
    b, h, dk = q_BHK.shape
    dv = v_BHV.shape[-1]
    if not pallas_supported(dk, dv):
        raise ValueError(f"kda_decode_step_pallas: K={dk} and V={dv} must be powers of two >= 16")
    bv = min(BV, dv) if b * h * dv // min(BV, dv) >= MIN_PROGRAMS else min(16, dv)
    vec_k = pl.BlockSpec((None, None, dk), lambda bi, hi, vi: (bi, hi, 0))
    vec_v = pl.BlockSpec((None, None, bv), lambda bi, hi, vi: (bi, hi, vi))
    state = pl.BlockSpec((None, None, dk, bv), lambda bi, hi, vi: (bi, hi, 0, vi))
    o_BHV, s_BHKV = pl.pallas_call(
        functools.partial(_step_kernel, scale=scale),
        out_shape=[jax.ShapeDtypeStruct((b, h, dv), v_BHV.dtype), jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)],
        grid=(b, h, dv // bv),
        in_specs=[vec_k, vec_k, vec_v, vec_k, pl.BlockSpec((None, None, 1), lambda bi, hi, vi: (bi, hi, 0)), state],
        out_specs=[vec_v, state],
        input_output_aliases={5: 1},
        name="kda_decode_step",
        **call_options(interpret, num_warps=NUM_WARPS, num_stages=1),
    )(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH[..., None], state_BHKV.astype(jnp.float32))
    return o_BHV, s_BHKV


def _fused_kernel(x_ref, win_ref, wq_ref, wk_ref, wv_ref, f_ref, b_ref, a_ref, dtb_ref, s_ref, o_ref, s_out_ref,
                  win_out_ref, *, scale: float, lower_bound: float, heads: int, dk: int, dv: int, bv: int, width: int):
    f32 = jnp.float32
    b, h, vi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dt = x_ref.dtype

    def conv_silu(w_ref, part_start, start, n):
        """Columns start.. of one part (its weights w_ref, its first column part_start in x): the causal
        conv's tap j is window row j (j < W-1), then this token, summed in that order as ops.short_conv."""
        x = x_ref[b, pl.ds(part_start + start, n)]
        acc = jnp.zeros((n,), f32)
        for j in range(width - 1):
            tap = win_ref[b, j, pl.ds(part_start + start, n)].astype(f32)
            acc = acc + tap * w_ref[pl.ds(start, n), j].astype(f32)
        acc = acc + x.astype(f32) * w_ref[pl.ds(start, n), width - 1].astype(f32)
        return jax.nn.silu(acc).astype(dt), x

    def shift_window(start, n, x):  # the new window: rows 1.. of the old one, then this token
        for j in range(width - 2):
            win_out_ref[b, j, pl.ds(start, n)] = win_ref[b, j + 1, pl.ds(start, n)]
        win_out_ref[b, width - 2, pl.ds(start, n)] = x

    def l2_normalize(a):
        a = a.astype(f32)
        return a * jax.lax.rsqrt(jnp.sum(a * a) + 1e-6)

    p = heads * dk
    q_K, xq = conv_silu(wq_ref, 0, h * dk, dk)
    k_K, xk = conv_silu(wk_ref, p, h * dk, dk)
    v_V, xv = conv_silu(wv_ref, 2 * p, h * dv + vi * bv, bv)
    q_K, k_K = l2_normalize(q_K), l2_normalize(k_K)
    g_K = lower_bound * jax.nn.sigmoid(jnp.exp(a_ref[h].astype(f32)) * (f_ref[b, h, :].astype(f32)
                                                                       + dtb_ref[h, :].astype(f32)))
    beta = jax.nn.sigmoid(b_ref[b, h].astype(f32))
    s_KV = s_ref[...] * jnp.exp(g_K)[:, None]
    u_V = beta * (v_V.astype(f32) - jnp.sum(k_K[:, None] * s_KV, axis=0))
    s_KV = s_KV + k_K[:, None] * u_V[None, :]
    o_ref[...] = jnp.sum((q_K * scale)[:, None] * s_KV, axis=0).astype(o_ref.dtype)
    s_out_ref[...] = s_KV
    shift_window(2 * p + h * dv + vi * bv, bv, xv)

    @pl.when(vi == 0)
    def _():  # one program per head moves its q and k columns
        shift_window(h * dk, dk, xq)
        shift_window(p + h * dk, dk, xk)


def kda_decode_fused_pallas(
    x_B3P: jax.Array, window_BW3P: jax.Array, conv_w: tuple[jax.Array, jax.Array, jax.Array], f_BHK: jax.Array,
    b_BH: jax.Array,
    a_log_H: jax.Array, dt_bias_HK: jax.Array, state_BHKV: jax.Array, *, lower_bound: float, scale: float,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A KDA layer's whole decode step after its input projection, in one kernel: the short conv
    + SiLU of q|k|v from the cached window, the L2 norms of q and k, the safe gate
    (`kda_gate` with `lower_bound`), beta = sigmoid(b), and the recurrent step of `kda_decode_step`.

    x: [B, 3P] this token's q|k|v projections (P = H x K, head-major), window: [B, W-1, 3P] the
    conv inputs before it, conv_w: the q, k and v conv weights [P, W] each, f: [B, H, K] gate input,
    b: [B, H] beta logits, a_log: [H], dt_bias: [H x K], state: [B, H, K, V] float32 (updated in place).
    Returns (o [B, H, V] in x's dtype, new state, new window [B, W-1, 3P]). In the XLA form these
    are ~10 launches per layer (conv, window, norms, gate, sigmoid, step); a batch-1 Ling-3.0-tiny
    step spent ~0.3 ms of its 2.5 ms in them (BENCHMARKS.md).
    """
    b, three_p = x_B3P.shape
    h, dk = f_BHK.shape[1:]
    dv = state_BHKV.shape[-1]
    width = conv_w[0].shape[1]
    if not pallas_supported(dk, dv) or three_p != h * (2 * dk + dv) or width < 2:
        raise ValueError(f"kda_decode_fused_pallas: K={dk}, V={dv} must be powers of two >= 16, q|k|v width "
                         f"{three_p} must be H x (2K + V) = {h * (2 * dk + dv)}, conv width {width} >= 2")
    bv = min(BV, dv) if b * h * dv // min(BV, dv) >= MIN_PROGRAMS else min(16, dv)
    state = pl.BlockSpec((None, None, dk, bv), lambda bi, hi, vi: (bi, hi, 0, vi))
    operands = (x_B3P, window_BW3P.astype(x_B3P.dtype), *conv_w, f_BHK, b_BH, a_log_H, dt_bias_HK.reshape(h, dk))
    o_BHV, s_BHKV, win = pl.pallas_call(
        functools.partial(_fused_kernel, scale=scale, lower_bound=lower_bound, heads=h, dk=dk, dv=dv, bv=bv,
                          width=width),
        out_shape=[jax.ShapeDtypeStruct((b, h, dv), x_B3P.dtype), jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32),
                   jax.ShapeDtypeStruct(window_BW3P.shape, x_B3P.dtype)],
        grid=(b, h, dv // bv),
        in_specs=[*(whole(a) for a in operands), state],
        out_specs=[pl.BlockSpec((None, None, bv), lambda bi, hi, vi: (bi, hi, vi)), state, whole(window_BW3P)],
        input_output_aliases={len(operands): 1},
        name="kda_decode_fused",
        **call_options(interpret, num_warps=NUM_WARPS, num_stages=1),
    )(*operands, state_BHKV.astype(jnp.float32))
    return o_BHV, s_BHKV, win

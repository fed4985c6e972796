"""Token-by-token KDA recurrence: the definition every faster path is tested against.

ARCHITECTURE.md §2.4 step 9, per (sequence, head), state S [K, V] in float32:
    S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T (scale q_t)
With `segment_ids`, S is reset to zero before the first token of every segment but the first
(packed documents never see each other's state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T] int -> [B, T] bool, True where a new segment begins (never at t = 0)."""
    prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
    return segment_ids != prev


def kda_reference(
    q: jax.Array,  # [B, T, H, K] (already L2-normalised by the caller)
    k: jax.Array,  # [B, T, H, K]
    v: jax.Array,  # [B, T, H, V]
    g: jax.Array,  # [B, T, H, K] log decay <= 0
    beta: jax.Array,  # [B, T, H]
    *,
    scale: float,
    initial_state: jax.Array | None = None,  # [B, H, K, V] float32
    segment_ids: jax.Array | None = None,  # [B, T] int
    chunk_size: int = 64,
    return_chunk_states: bool = False,
) -> tuple[jax.Array, ...]:
    """Returns (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32).

    With `return_chunk_states`, also the states entering each chunk of `chunk_size` tokens,
    [B, ceil(T / chunk_size), H, K, V] float32 (index 0 is the initial state).
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    s0 = jnp.zeros((b, h, dk, dv), f32) if initial_state is None else initial_state.astype(f32)
    reset_BT = (
        jnp.zeros((b, t), bool) if segment_ids is None else segment_starts(segment_ids)
    )

    def step(s_BHKV, xs):
        q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, reset_B = xs
        s_in = s_BHKV
        s_BHKV = jnp.where(reset_B[:, None, None, None], 0.0, s_BHKV)
        s_BHKV = s_BHKV * jnp.exp(g_BHK)[..., None]
        pred_BHV = jnp.einsum("bhk,bhkv->bhv", k_BHK, s_BHKV)
        u_BHV = beta_BH[..., None] * (v_BHV - pred_BHV)
        s_BHKV = s_BHKV + k_BHK[..., :, None] * u_BHV[..., None, :]
        o_BHV = jnp.einsum("bhk,bhkv->bhv", q_BHK * scale, s_BHKV)
        return s_BHKV, (o_BHV, s_in)

    xs = tuple(jnp.moveaxis(x.astype(f32), 1, 0) for x in (q, k, v, g, beta))
    xs = (*xs, jnp.moveaxis(reset_BT, 1, 0))
    s_final, (o_TBHV, s_in_TBHKV) = jax.lax.scan(step, s0, xs)
    o = jnp.moveaxis(o_TBHV, 0, 1).astype(v.dtype)
    if not return_chunk_states:
        return o, s_final
    return o, s_final, jnp.moveaxis(s_in_TBHKV[::chunk_size], 0, 1)

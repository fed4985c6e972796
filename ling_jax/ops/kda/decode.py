"""One KDA token against a cached state: the decode-loop path of `kimi_delta_attention`.

At one token per step the recurrence is a rank-1 update of the [K, V] state; reading and writing
that state once is the whole cost, which plain XLA fuses into one pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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

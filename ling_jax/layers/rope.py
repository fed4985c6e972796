"""Interleaved (GPT-J style) rotary embedding on the MLA rope slice (ARCHITECTURE.md §2.5.1).

The pair of frequency i sits at dims (2i, 2i+1); all `qk_rope_head_dim` dims rotate
(`partial_rotary_factor` is ignored, as in the reference). We keep the interleaved order in the
output (the reference de-interleaves; scores are identical since q and k share the order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int -> (cos, sin) [B, T, dim // 2] float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angle_BTF = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angle_BTF), jnp.sin(angle_BTF)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates pairs (2i, 2i+1) of x [B, T, ..., dim] by cos/sin [B, T, dim // 2].

    cos/sin are cast to x's dtype before multiplying, as the reference does.
    """
    extra = x.ndim - cos.ndim
    shape = cos.shape[:2] + (1,) * extra + cos.shape[2:]
    c, s = cos.reshape(shape).astype(x.dtype), sin.reshape(shape).astype(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return jnp.stack([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1).reshape(x.shape)

"""RMSNorms with the reference's exact cast orders (ARCHITECTURE.md §2.2, §6 items 8-9)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Model RMSNorm: normalise in float32, cast back to x's dtype, then multiply by the weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * w.astype(x.dtype)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """KDA output norm: RMS over the last axis, times w, times sigmoid(z), all float32; x's dtype out."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = y * w.astype(jnp.float32) * jax.nn.sigmoid(z.astype(jnp.float32))
    return y.astype(x.dtype)

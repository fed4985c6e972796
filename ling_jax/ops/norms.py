"""RMSNorms with the reference's exact cast orders (ARCHITECTURE.md §2.2, §6 items 8-9)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sum_squares(x: jax.Array) -> jax.Array:
    """The float32 sum of squares of x's rows, [..., 1]: what `rms_norm` reduces."""
    x32 = x.astype(jnp.float32)
    return jnp.sum(x32 * x32, axis=-1, keepdims=True)


def inv_rms(ss: jax.Array, width: int, eps: float) -> jax.Array:
    """1 / RMS of rows of `width` values from their `sum_squares`: `rms_norm`'s scale."""
    return jax.lax.rsqrt(ss / width + eps)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, ss: jax.Array | None = None) -> jax.Array:
    """Model RMSNorm: normalise in float32, cast back to x's dtype, then multiply by the weight.
    `ss`: `sum_squares(x)` where the caller has it already."""
    inv = inv_rms(sum_squares(x) if ss is None else ss, x.shape[-1], eps)
    return (x.astype(jnp.float32) * inv).astype(x.dtype) * w.astype(x.dtype)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """KDA output norm: RMS over the last axis, times w, times sigmoid(z), all float32; x's dtype out."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = y * w.astype(jnp.float32) * jax.nn.sigmoid(z.astype(jnp.float32))
    return y.astype(x.dtype)

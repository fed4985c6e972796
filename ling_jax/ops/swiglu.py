"""SwiGLU activation with the optional per-layer clamp (ARCHITECTURE.md §2.6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu_act(gate: jax.Array, up: jax.Array, limit: jax.Array | float) -> jax.Array:
    """silu(gate) * up; with limit > 0: min(silu(gate), limit) * clip(up, -limit, limit)."""
    act = jax.nn.silu(gate)
    limit = jnp.asarray(limit, jnp.float32)
    clamped = jnp.minimum(act, limit.astype(act.dtype)) * jnp.clip(up, -limit, limit).astype(up.dtype)
    return jnp.where(limit > 0, clamped, act * up)

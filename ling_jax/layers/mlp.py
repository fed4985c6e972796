"""SwiGLU MLP (dense layers and the shared expert), with the optional per-layer clamp (§2.6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu_act(gate: jax.Array, up: jax.Array, limit: jax.Array | float) -> jax.Array:
    """silu(gate) * up; with limit > 0: min(silu(gate), limit) * clip(up, -limit, limit)."""
    act = jax.nn.silu(gate)
    limit = jnp.asarray(limit, jnp.float32)
    clamped = jnp.minimum(act, limit.astype(act.dtype)) * jnp.clip(up, -limit, limit).astype(up.dtype)
    return jnp.where(limit > 0, clamped, act * up)


def mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
        limit: jax.Array | float = 0.0) -> jax.Array:
    """x [..., D] -> [..., D]; weights [D, I], [D, I], [I, D] cast to x's dtype."""
    dt = x.dtype
    h = swiglu_act(x @ w_gate.astype(dt), x @ w_up.astype(dt), limit)
    return h @ w_down.astype(dt)

"""SwiGLU MLP (dense layers and the shared expert), with the optional per-layer clamp (§2.6)."""

from __future__ import annotations

import jax

from ling_jax.ops.swiglu import swiglu_act


def mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
        limit: jax.Array | float = 0.0) -> jax.Array:
    """x [..., D] -> [..., D]; weights [D, I], [D, I], [I, D] cast to x's dtype; `limit` > 0 clamps."""
    dt = x.dtype
    return swiglu_act(x @ w_gate.astype(dt), x @ w_up.astype(dt), limit) @ w_down.astype(dt)

"""SwiGLU MLP (dense layers and the shared expert), with the optional per-layer clamp (§2.6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ling_jax.checkpoint.fp8 import is_block_fp8
from ling_jax.ops.layer_gemv import linear


def swiglu_act(gate: jax.Array, up: jax.Array, limit: jax.Array | float) -> jax.Array:
    """silu(gate) * up; with limit > 0: min(silu(gate), limit) * clip(up, -limit, limit)."""
    act = jax.nn.silu(gate)
    limit = jnp.asarray(limit, jnp.float32)
    clamped = jnp.minimum(act, limit.astype(act.dtype)) * jnp.clip(up, -limit, limit).astype(up.dtype)
    return jnp.where(limit > 0, clamped, act * up)


def mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
        limit: jax.Array | float = 0.0, w_gate_up: jax.Array | None = None) -> jax.Array:
    """x [..., D] -> [..., D]; weights [D, I], [D, I], [I, D] cast to x's dtype. `w_gate_up` [D, 2I]
    (`fuse_gate_up`, the decode loop's params), when given, replaces the first two: one product."""
    if w_gate_up is None:
        gate, up = linear(x, w_gate), linear(x, w_up)
    else:
        gate, up = jnp.split(linear(x, w_gate_up), 2, axis=-1)
    return linear(swiglu_act(gate, up, limit), w_down)


def fuse_gate_up(p: dict, prefix: str = "") -> dict:
    """An MLP's params (one layer's or stacked) plus `{prefix}gate_up_proj`, its gate and up
    projections side by side along the last axis (what `mlp` takes as `w_gate_up`); unchanged where
    they are FP8-resident (the concatenation would dequantize them)."""
    pair = [p[f"{prefix}gate_proj"], p[f"{prefix}up_proj"]]
    if any(is_block_fp8(w) for w in pair):
        return p
    return {**p, f"{prefix}gate_up_proj": jnp.concatenate(pair, axis=-1)}

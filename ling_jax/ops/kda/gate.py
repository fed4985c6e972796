"""The pieces of KDA that surround the recurrence: the decay gate and the q/k L2 norm.

Kernels may fuse them (the `A_log`/`use_qk_l2norm` options of `kimi_delta_attention`); these are
their plain-JAX definitions (ARCHITECTURE.md §2.4 steps 6-7), all in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kda_gate(
    f: jax.Array,  # [B, T, H, K] gate pre-activation (f_proj output)
    a_log: jax.Array,  # [H]
    dt_bias: jax.Array,  # [H * K], head-major
    lower_bound: float | None,
) -> jax.Array:
    """Log decay g [B, T, H, K] float32, in (lower_bound, 0) for the safe gate."""
    h, dk = f.shape[-2:]
    x = f.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(h, dk)
    return log_decay(x, jnp.exp(a_log.astype(jnp.float32))[:, None], lower_bound)


def log_decay(x: jax.Array, a: jax.Array, lower_bound: float | None) -> jax.Array:
    """The gate from x = f + dt_bias and a = exp(A_log), float32 (also inside the decode kernel)."""
    if lower_bound is None:  # the Kimi gate, not used by Ling-3 checkpoints
        return -a * jax.nn.softplus(x)
    return lower_bound * jax.nn.sigmoid(a * x)


def inv_l2_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """1 / sqrt(sum(x^2) + eps) over the last axis, [..., 1] float32."""
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.sum(x32 * x32, -1, keepdims=True) + eps)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, computed and returned in float32."""
    return x.astype(jnp.float32) * inv_l2_norm(x, eps)

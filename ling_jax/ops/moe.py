"""Routed-expert compute: every (token, expert) pair of a top-k routing, dropless.

`routed_experts` is the one function the MoE layer calls; `impl` picks how the grouped matmul is
done. `ragged` sorts the token copies by expert and runs `jax.lax.ragged_dot` (one grouped
matmul per projection, no padding, no capacity); `dense` evaluates every expert on every token and
gathers — the reference the fast paths are tested against (only for tiny shapes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ling_jax.layers.mlp import swiglu_act

IMPLS = ("ragged", "dense")


def combine(y_NKD: jax.Array, w_NK: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Weighted sum of the k expert outputs in float32, cast to the activation dtype (§6 item 14)."""
    return jnp.einsum("nk,nkd->nd", w_NK, y_NKD.astype(jnp.float32)).astype(dtype)


def expert_ffn_sorted(x_MD: jax.Array, group_sizes_E: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                      w_down: jax.Array, limit: jax.Array | float) -> jax.Array:
    """SwiGLU of rows already sorted by expert: [M, D] -> [M, D]; group_sizes [E] sum to <= M."""
    dt = x_MD.dtype
    g_MI = jax.lax.ragged_dot(x_MD, w_gate.astype(dt), group_sizes_E)
    u_MI = jax.lax.ragged_dot(x_MD, w_up.astype(dt), group_sizes_E)
    return jax.lax.ragged_dot(swiglu_act(g_MI, u_MI, limit), w_down.astype(dt), group_sizes_E)


def routed_experts(
    x_ND: jax.Array,
    idx_NK: jax.Array,
    w_NK: jax.Array,
    w_gate_EDI: jax.Array,
    w_up_EDI: jax.Array,
    w_down_EID: jax.Array,
    *,
    limit: jax.Array | float = 0.0,
    impl: str = "ragged",
) -> jax.Array:
    """sum_j w[n, j] * Expert_{idx[n, j]}(x[n]) for every token n: [N, D] in x's dtype."""
    n, k = idx_NK.shape
    e = w_gate_EDI.shape[0]
    if impl == "dense":
        dt = x_ND.dtype
        g = jnp.einsum("nd,edi->nei", x_ND, w_gate_EDI.astype(dt))
        u = jnp.einsum("nd,edi->nei", x_ND, w_up_EDI.astype(dt))
        y_NED = jnp.einsum("nei,eid->ned", swiglu_act(g, u, limit), w_down_EID.astype(dt))
        return combine(jnp.take_along_axis(y_NED, idx_NK[..., None], axis=1), w_NK, dt)
    if impl != "ragged":
        raise ValueError(f"moe impl={impl!r}: must be one of {IMPLS}")
    flat_M = idx_NK.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)
    group_sizes_E = jnp.bincount(flat_M, length=e).astype(jnp.int32)
    y_sorted_MD = expert_ffn_sorted(x_ND[order_M // k], group_sizes_E, w_gate_EDI, w_up_EDI,
                                    w_down_EID, limit)
    y_MD = jnp.zeros_like(y_sorted_MD).at[order_M].set(y_sorted_MD)
    return combine(y_MD.reshape(n, k, -1), w_NK, x_ND.dtype)

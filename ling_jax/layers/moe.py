"""MoE block: fp32 sigmoid router with selection-only bias, group-limited top-k, shared expert (§2.7)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ling_jax.config import LingConfig
from ling_jax.layers.mlp import mlp
from ling_jax.ops.moe import routed_experts


def route(x_ND: jax.Array, w_router_DE: jax.Array, bias_E: jax.Array,
          cfg: LingConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(expert indices [N, k] int32, combine weights [N, k] f32, router logits [N, E] f32).

    Selection ranks `sigmoid(logits) + bias`: groups by the sum of their top-2, the best
    `topk_group` groups kept, then the top-k experts inside them. Weights are the *unbiased*
    scores of the chosen experts, renormalised (k > 1) and scaled by `routed_scaling_factor`.
    """
    n, e = x_ND.shape[0], w_router_DE.shape[1]
    logits_NE = jnp.matmul(x_ND.astype(jnp.float32), w_router_DE.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
    scores_NE = jax.nn.sigmoid(logits_NE)
    sel_NE = scores_NE + bias_E.astype(jnp.float32)
    sel_NGX = sel_NE.reshape(n, cfg.n_group, e // cfg.n_group)
    group_score_NG = jax.lax.top_k(sel_NGX, 2)[0].sum(-1)
    _, top_groups = jax.lax.top_k(group_score_NG, cfg.topk_group)
    keep_NG = jax.nn.one_hot(top_groups, cfg.n_group, dtype=jnp.bool_).any(axis=1)
    masked_NE = jnp.where(keep_NG[..., None], sel_NGX, -jnp.inf).reshape(n, e)
    _, idx_NK = jax.lax.top_k(masked_NE, cfg.num_experts_per_tok)
    w_NK = jnp.take_along_axis(scores_NE, idx_NK, axis=1)
    if cfg.num_experts_per_tok > 1:
        w_NK = w_NK / (w_NK.sum(-1, keepdims=True) + 1e-20)
    return idx_NK.astype(jnp.int32), w_NK * cfg.routed_scaling_factor, logits_NE


def moe(p: dict[str, Any], x: jax.Array, *, cfg: LingConfig, limit: jax.Array | float = 0.0,
        shared_limit: jax.Array | float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [..., D] -> ([..., D], router aux {"topk_idx", "topk_weight", "logits"} flattened to [N, ...])."""
    x_ND = x.reshape(-1, x.shape[-1])
    idx_NK, w_NK, logits_NE = route(x_ND, p["router"], p["expert_bias"], cfg)
    y_ND = routed_experts(x_ND, idx_NK, w_NK, p["gate_proj"], p["up_proj"], p["down_proj"],
                          limit=limit, impl=cfg.moe_impl)
    if "shared_gate_proj" in p:
        y_ND = y_ND + mlp(x_ND, p["shared_gate_proj"], p["shared_up_proj"], p["shared_down_proj"],
                          shared_limit)
    aux = {"topk_idx": idx_NK, "topk_weight": w_NK, "logits": logits_NE}
    return y_ND.reshape(x.shape), aux

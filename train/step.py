"""The train step: loss (next-token CE + weighted MTP CE), gradient accumulation, AdamW, expert-bias
balancing and a non-finite guard — one jitted function on a donated state.

Params are float32 masters; the forward/backward runs on a copy cast to the compute dtype
(float32 kept for `A_log`, `dt_bias`, `expert_bias`). The cross-entropy is `train/loss.py`'s:
chunked, its gradient made in the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ling_jax.config import LingConfig
from ling_jax.model import forward_hidden
from ling_jax.params import Params, build_tree, get_path
from train.config import TrainConfig
from train.data import IGNORE
from train.loss import cross_entropy_sum
from train.optim import learning_rate


def cast_for_compute(cfg: LingConfig, params: Params, dtype: Any) -> Params:
    keep = build_tree(cfg, lambda s: s.leaf.fp32)
    return jax.tree.map(lambda p, k: p if k else p.astype(dtype), params, keep)


def mtp_labels(labels_BT: jax.Array) -> jax.Array:
    """Targets two tokens ahead (MTP position t predicts token t+2), masked across documents."""
    nxt = jnp.concatenate([labels_BT[:, 1:], jnp.full_like(labels_BT[:, :1], IGNORE)], axis=1)
    return jnp.where(labels_BT == IGNORE, IGNORE, nxt)


def mtp_weight(cfg: LingConfig, tcfg: TrainConfig) -> float:
    w = cfg.mtp_loss_scaling_factor if tcfg.mtp_loss_weight is None else tcfg.mtp_loss_weight
    return float(w) if cfg.num_nextn_predict_layers > 0 else 0.0


def loss_terms(cfg: LingConfig, tcfg: TrainConfig, params: Params, batch: dict[str, jax.Array]
               ) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
    """(main CE sum, MTP CE sum, expert counts) of one micro-batch."""
    p = cast_for_compute(cfg, params, jnp.dtype(tcfg.compute_dtype))
    use_mtp = mtp_weight(cfg, tcfg) > 0
    out = forward_hidden(cfg, p, batch["inputs"], segment_ids=batch["segment_ids"], mtp=use_mtp,
                         expert_counts=True, remat=tcfg.remat, unroll=tcfg.unroll_layers)
    head = p["embed"].T if cfg.tie_word_embeddings else p["lm_head"]
    d = cfg.hidden_size
    ce = cross_entropy_sum(out["final"].reshape(-1, d), head, batch["labels"].reshape(-1), tcfg.logits_dtype)
    mtp_ce = jnp.float32(0.0)
    if use_mtp:
        mtp_ce = cross_entropy_sum(out["mtp"][0].reshape(-1, d), head, mtp_labels(batch["labels"]).reshape(-1),
                                   tcfg.logits_dtype)
    counts = {"segments": out["expert_counts"], "mtp": out.get("mtp_expert_counts", [])}
    return ce, mtp_ce, counts


def zero_counts(cfg: LingConfig, tcfg: TrainConfig) -> dict[str, Any]:
    """Zero per-expert counts shaped like `loss_terms`'s (the accumulator of a gradient-accumulation scan)."""
    e = cfg.num_experts or 0

    def zeros(*lead: int) -> jax.Array:
        return jnp.zeros((*lead, e), jnp.int32)

    segs: list[Any] = []
    for seg in cfg.segments:
        if seg.kind == "run":
            segs.append(zeros(seg.length) if seg.ffn == "moe" else None)
        else:
            segs.append({"kda": zeros(seg.length, seg.kda_per_group) if seg.kda_per_group else None,
                         "mla": zeros(seg.length)})
    mtp = [zeros() if cfg.ffn_of(cfg.num_hidden_layers + j) == "moe" else None
           for j in range(cfg.num_nextn_predict_layers)] if mtp_weight(cfg, tcfg) > 0 else []
    return {"segments": segs, "mtp": mtp}


def apply_bias_update(params: Params, counts: dict[str, Any], rate: float) -> Params:
    """Aux-loss-free balancing (DeepSeek-V3): bias += rate * sign(mean load - load), per MoE layer.

    `counts` are global token counts per expert (the jitted step sees the global batch), stacked
    like the params; no gradient, outside the optimizer.
    """
    def upd(bias: jax.Array, c: jax.Array) -> jax.Array:
        load = c.astype(jnp.float32)
        return bias + rate * jnp.sign(load.mean(-1, keepdims=True) - load)

    new = jax.tree.map(lambda x: x, params)
    for s, c in enumerate(counts["segments"]):
        for key, sub in ({"": c} if not isinstance(c, dict) else c).items():
            if sub is None:
                continue
            path = ("segments", s, *((key,) if key else ()), "mlp")
            mlp = get_path(new, path)
            mlp["expert_bias"] = upd(mlp["expert_bias"], sub)
    for j, c in enumerate(counts["mtp"]):
        if c is not None:
            new["mtp"][j]["mlp"]["expert_bias"] = upd(new["mtp"][j]["mlp"]["expert_bias"], c)
    return new


def load_stats(counts: dict[str, Any]) -> jax.Array:
    """max load / mean load of every MoE layer (1.0 = perfectly balanced), as one flat vector."""
    leaves = [c.reshape(-1, c.shape[-1]).astype(jnp.float32) for c in jax.tree.leaves(counts)]
    if not leaves:
        return jnp.zeros((0,), jnp.float32)
    c = jnp.concatenate(leaves, axis=0)
    return c.max(-1) / jnp.maximum(c.mean(-1), 1e-9)


def make_train_step(cfg: LingConfig, tcfg: TrainConfig, optimizer: optax.GradientTransformation
                    ) -> Callable[[dict[str, Any], dict[str, jax.Array]], tuple[dict[str, Any], dict[str, Any]]]:
    """state {"params", "opt_state", "step", "bad_steps"}, batch [B, T] arrays -> (state, metrics)."""
    w_mtp = mtp_weight(cfg, tcfg)
    lr = learning_rate(tcfg)

    def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, Any]]:
        params = state["params"]
        n_tok = jnp.maximum(jnp.sum(batch["labels"] != IGNORE), 1).astype(jnp.float32)
        n_mtp = jnp.maximum(jnp.sum(mtp_labels(batch["labels"]) != IGNORE), 1).astype(jnp.float32)
        micro = jax.tree.map(lambda x: x.reshape(tcfg.grad_accum, -1, *x.shape[1:]), batch)

        def micro_loss(p, mb):
            ce, mtp_ce, counts = loss_terms(cfg, tcfg, p, mb)
            return ce / n_tok + w_mtp * mtp_ce / n_mtp, (ce, mtp_ce, counts)

        def accumulate(carry, mb):
            grads, ce, mtp_ce, counts = carry
            (_, (c1, m1, k1)), g = jax.value_and_grad(micro_loss, has_aux=True)(params, mb)
            return (jax.tree.map(jnp.add, grads, g), ce + c1, mtp_ce + m1, jax.tree.map(jnp.add, counts, k1)), None

        init = (jax.tree.map(jnp.zeros_like, params), jnp.float32(0.0), jnp.float32(0.0), zero_counts(cfg, tcfg))
        (grads, ce, mtp_ce, counts), _ = jax.lax.scan(accumulate, init, micro)
        grad_norm = optax.tree.norm(grads)
        loss = ce / n_tok
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss) & jnp.isfinite(mtp_ce)

        def update(params: Params, opt_state: Any) -> tuple[Params, Any]:
            updates, opt_state = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            if tcfg.bias_update_rate > 0:
                new_params = apply_bias_update(new_params, counts, tcfg.bias_update_rate)
            return new_params, opt_state

        # a non-finite step changes nothing; a branch, not a select per leaf, so that a finite step
        # updates the donated buffers in place in one pass
        new_params, opt_state = jax.lax.cond(finite, update, lambda p, o: (p, o), params, state["opt_state"])
        new_state = {
            "params": new_params,
            "opt_state": opt_state,
            "step": state["step"] + finite.astype(jnp.int32),
            "bad_steps": jnp.where(finite, 0, state["bad_steps"] + 1),
        }
        metrics = {"loss": loss, "mtp_loss": mtp_ce / n_mtp, "grad_norm": grad_norm, "lr": lr(state["step"]),
                   "finite": finite, "tokens": n_tok, "max_load": load_stats(counts)}
        return new_state, metrics

    return step

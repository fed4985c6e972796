"""The train step: loss (next-token CE + weighted MTP CE), gradient accumulation, AdamW, expert-bias
balancing and a non-finite guard — one jitted function on a donated state.

Params are float32 masters; the forward/backward runs on a copy in the compute dtype (float32 kept
for `A_log`, `dt_bias`, `expert_bias`). That copy is part of the state (`"compute"`), written by the
update that writes the masters, so a step never re-reads the masters to cast them; the gradients
come out in the compute dtype and are read once for their norm and once by the update, which
also clips (no second norm pass). The cross-entropy is `train/loss.py`'s: chunked, its gradient
made in the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ling_jax.config import LingConfig
from ling_jax.kernels import select
from ling_jax.model import forward_hidden
from ling_jax.params import Params, build_tree, get_path
from train.config import TrainConfig, mtp_weight
from train.data import IGNORE
from train.loss import cross_entropy_sum
from train.optim import learning_rate


def cast_for_compute(cfg: LingConfig, params: Params, dtype: Any) -> Params:
    keep = build_tree(cfg, lambda s: s.leaf.fp32)
    return jax.tree.map(lambda p, k: p if k else p.astype(dtype), params, keep)


def compute_copy(cfg: LingConfig, tcfg: TrainConfig, params: Params) -> Params | None:
    """The state's copy of the masters in the compute dtype: None at the float32-kept leaves (the
    step reads the masters there), and None altogether when the compute dtype is float32."""
    dtype = jnp.dtype(tcfg.compute_dtype)
    if dtype == jnp.float32:
        return None
    keep = build_tree(cfg, lambda s: s.leaf.fp32)
    return jax.tree.map(lambda p, k: None if k else p.astype(dtype), params, keep)


def init_state(cfg: LingConfig, tcfg: TrainConfig, optimizer: optax.GradientTransformation, params: Params
               ) -> dict[str, Any]:
    """A run's first train state from float32 masters."""
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0), "bad_steps": jnp.int32(0)}
    return with_compute_copy(cfg, tcfg, state)


def with_compute_copy(cfg: LingConfig, tcfg: TrainConfig, state: dict[str, Any]) -> dict[str, Any]:
    """`state` plus its compute-dtype copy of the params (after a restore: checkpoints leave it out)."""
    copy = compute_copy(cfg, tcfg, state["params"])
    return {**state, "compute": copy} if copy is not None else dict(state)


def checkpointed(state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint stores of a train state: all but the compute copy, which `with_compute_copy` remakes."""
    return {k: v for k, v in state.items() if k != "compute"}


def _compute_params(state: dict[str, Any], cfg: LingConfig, tcfg: TrainConfig) -> Params:
    """The params the forward reads: the compute copy, the masters where it has none."""
    if jnp.dtype(tcfg.compute_dtype) == jnp.float32:
        return state["params"]
    if "compute" not in state:
        raise ValueError("the train state has no compute-dtype copy of the params: build the state with "
                         "train.step.init_state (after a restore: with_compute_copy)")
    return jax.tree.map(lambda p, c: p if c is None else c, state["params"], state["compute"])


def clip_by_norm(grads: Params, norm: jax.Array, max_norm: float) -> Params:
    """Float32 grads scaled to global norm `max_norm` when `norm` (theirs) exceeds it (optax's rule);
    `max_norm` 0: unclipped."""
    def clip(g: jax.Array) -> jax.Array:
        g = g.astype(jnp.float32)
        return g if max_norm == 0 else jnp.where(norm < max_norm, g, g / norm * max_norm)
    return jax.tree.map(clip, grads)


def mtp_labels(labels_BT: jax.Array) -> jax.Array:
    """Targets two tokens ahead (MTP position t predicts token t+2), masked across documents."""
    nxt = jnp.concatenate([labels_BT[:, 1:], jnp.full_like(labels_BT[:, :1], IGNORE)], axis=1)
    return jnp.where(labels_BT == IGNORE, IGNORE, nxt)


def loss_terms(cfg: LingConfig, tcfg: TrainConfig, params: Params, batch: dict[str, jax.Array]
               ) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
    """(main CE sum, MTP CE sum, expert counts) of one micro-batch."""
    p = cast_for_compute(cfg, params, jnp.dtype(tcfg.compute_dtype))  # no copy where already cast
    kernels = select(cfg, dtype=tcfg.compute_dtype)  # under the step's mesh (this runs at trace time)
    use_mtp = mtp_weight(cfg, tcfg) > 0
    out = forward_hidden(cfg, p, batch["inputs"], segment_ids=batch["segment_ids"], mtp=use_mtp,
                         expert_counts=True, remat=tcfg.remat, unroll=tcfg.unroll_layers, kernels=kernels)
    head = p["embed"].T if cfg.tie_word_embeddings else p["lm_head"]
    d = cfg.hidden_size
    ce = cross_entropy_sum(out["final"].reshape(-1, d), head, batch["labels"].reshape(-1), tcfg.logits_dtype,
                           kernels.logsumexp)
    mtp_ce = jnp.float32(0.0)
    if use_mtp:
        mtp_ce = cross_entropy_sum(out["mtp"][0].reshape(-1, d), head, mtp_labels(batch["labels"]).reshape(-1),
                                   tcfg.logits_dtype, kernels.logsumexp)
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
    """state (`init_state`) {"params", "opt_state", "step", "bad_steps"[, "compute"]}, batch [B, T]
    arrays -> (state, metrics)."""
    w_mtp = mtp_weight(cfg, tcfg)
    lr = learning_rate(tcfg)

    def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, Any]]:
        p_compute = _compute_params(state, cfg, tcfg)
        n_tok = jnp.maximum(jnp.sum(batch["labels"] != IGNORE), 1).astype(jnp.float32)
        n_mtp = jnp.maximum(jnp.sum(mtp_labels(batch["labels"]) != IGNORE), 1).astype(jnp.float32)
        micro = jax.tree.map(lambda x: x.reshape(tcfg.grad_accum, -1, *x.shape[1:]), batch)

        def micro_loss(p, mb):
            ce, mtp_ce, counts = loss_terms(cfg, tcfg, p, mb)
            return ce / n_tok + w_mtp * mtp_ce / n_mtp, (ce, mtp_ce, counts)

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
        if tcfg.grad_accum == 1:  # grads stay in the compute dtype: the update reads them once
            (_, (ce, mtp_ce, counts)), grads = grad_fn(p_compute, jax.tree.map(lambda x: x[0], micro))
        else:
            def accumulate(carry, mb):
                grads, ce, mtp_ce, counts = carry
                (_, (c1, m1, k1)), g = grad_fn(p_compute, mb)
                grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
                return (grads, ce + c1, mtp_ce + m1, jax.tree.map(jnp.add, counts, k1)), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), p_compute)
            init = (zeros, jnp.float32(0.0), jnp.float32(0.0), zero_counts(cfg, tcfg))
            (grads, ce, mtp_ce, counts), _ = jax.lax.scan(accumulate, init, micro)
        grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        loss = ce / n_tok
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss) & jnp.isfinite(mtp_ce)

        def update(params: Params, opt_state: Any) -> tuple[Params, Any, Params | None]:
            updates, opt_state = optimizer.update(clip_by_norm(grads, grad_norm, tcfg.clip_norm), opt_state, params)
            new_params = optax.apply_updates(params, updates)
            if tcfg.bias_update_rate > 0:
                new_params = apply_bias_update(new_params, counts, tcfg.bias_update_rate)
            return new_params, opt_state, compute_copy(cfg, tcfg, new_params)

        def skip(params: Params, opt_state: Any) -> tuple[Params, Any, Params | None]:
            return params, opt_state, state.get("compute")  # None when the compute dtype is float32

        # a non-finite step changes nothing; a branch, not a select per leaf, so that a finite step
        # updates the donated buffers in place in one pass (masters, moments and compute copy)
        new_params, opt_state, compute = jax.lax.cond(finite, update, skip, state["params"], state["opt_state"])
        new_state = {
            "params": new_params,
            "opt_state": opt_state,
            "step": state["step"] + finite.astype(jnp.int32),
            "bad_steps": jnp.where(finite, 0, state["bad_steps"] + 1),
        }
        if compute is not None:
            new_state["compute"] = compute
        metrics = {"loss": loss, "mtp_loss": mtp_ce / n_mtp, "grad_norm": grad_norm, "lr": lr(state["step"]),
                   "finite": finite, "tokens": n_tok, "max_load": load_stats(counts)}
        return new_state, metrics

    return step

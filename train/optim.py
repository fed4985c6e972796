"""AdamW with warmup then constant or cosine decay, masked weight decay.

Global-norm clipping is not in this chain: the train step clips (`train/step.clip_by_norm`) with the
norm it computes anyway for its metrics, so the update does not read the gradients a second time.

Weight decay applies to matmul weights and the embedding only: never to norms, conv taps,
`A_log`, `dt_bias` or `expert_bias` (the latter is not trained by the optimizer at all — it
moves by the aux-loss-free balancing rule in `train/step.py`). The MTP layer stays as loaded when
its loss has weight 0.
"""

from __future__ import annotations

import optax

from ling_jax.config import LingConfig
from ling_jax.params import Params, build_tree
from train.config import TrainConfig, mtp_weight


def learning_rate(tcfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then constant, or cosine decay to `min_lr_ratio * lr` at
    `schedule_steps` (the horizon is a config value, never the run's `--steps`)."""
    warm = optax.linear_schedule(0.0, tcfg.lr, max(tcfg.warmup_steps, 1))
    if tcfg.schedule == "constant":
        after = optax.constant_schedule(tcfg.lr)
    else:
        after = optax.cosine_decay_schedule(tcfg.lr, tcfg.schedule_steps - tcfg.warmup_steps, tcfg.min_lr_ratio)
    return optax.join_schedules([warm, after], [tcfg.warmup_steps])


def decay_mask(cfg: LingConfig) -> Params:
    """True where weight decay applies (matmul weights and the embedding)."""
    return build_tree(cfg, lambda s: s.leaf.transform == "T" or s.path == ("embed",))


def frozen_mask(cfg: LingConfig, tcfg: TrainConfig) -> Params:
    """True for leaves the optimizer must not move: `expert_bias`, and the MTP layer when its loss
    has weight 0 (no gradient reaches it; weight decay alone would shrink it)."""
    frozen_mtp = mtp_weight(cfg, tcfg) == 0
    return build_tree(cfg, lambda s: s.path[-1] == "expert_bias" or (frozen_mtp and s.path[0] == "mtp"))


def make_optimizer(cfg: LingConfig, tcfg: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.adamw(learning_rate(tcfg), b1=tcfg.beta1, b2=tcfg.beta2, eps=tcfg.eps,
                    weight_decay=tcfg.weight_decay, mask=decay_mask(cfg)),
        optax.masked(optax.set_to_zero(), frozen_mask(cfg, tcfg)),
    )

"""`TrainConfig`: everything a training run needs beyond the model config, from a JSON/YAML file.

Command-line flags of `ling-train` override the file. The learning-rate schedule's horizon is a
config value (`schedule_steps`), never `--steps`, so stopping and resuming with a larger
`--steps` continues the same schedule.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ling_jax.config import LingConfig, is_int, kind_error
from ling_jax.model import REMAT_POLICIES
from ling_jax.sharding import AXES
from train.loss import LOGITS_DTYPES

COMPUTE_DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation, batching, parallelism and checkpointing options of a run."""

    steps: int = 100
    batch_size: int = 8  # sequences per optimizer step (global), split into `grad_accum` micro-batches
    seq_len: int = 512
    grad_accum: int = 1
    lr: float = 3e-4
    warmup_steps: int = 0
    schedule: str = "constant"  # "constant" after warmup, or "cosine" decay to `min_lr_ratio * lr`
    schedule_steps: int = 0  # horizon of the cosine decay (required for "cosine")
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # global gradient norm; 0 = no clipping
    compute_dtype: str = "bfloat16"  # params are fp32 masters; forward/backward run in this dtype
    remat: str = "full"  # "none" or a policy of ling_jax.model.REMAT_POLICIES ("full", "dots", "dots_kernels", ...)
    unroll_layers: bool = False  # layers as straight-line code, not scans: faster steps, longer compiles
    logits_dtype: str = "float32"  # the lm_head matmul's output for the loss; "bfloat16" is faster (train/loss.py)
    bias_update_rate: float = 1e-3  # aux-loss-free expert-bias balancing (0 disables)
    mtp_loss_weight: float | None = None  # None: the model config's mtp_loss_scaling_factor
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)  # e.g. {"data": 2, "expert": 4}
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    max_bad_steps: int = 3  # stop after this many consecutive non-finite steps
    seed: int = 0
    shuffle: bool = True
    log_every: int = 1
    peak_tflops: float | None = None  # per device; default from the device kind (see train/flops.py)

    @classmethod
    def load(cls, path: str | Path | None, **overrides: Any) -> TrainConfig:
        """Reads a JSON or YAML file (None: defaults), then applies non-None `overrides`."""
        d: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise FileNotFoundError(f"--config {p}: no such file")
            text, yaml_file = p.read_text(), p.suffix in (".yaml", ".yml")
            if yaml_file:
                import yaml

                errors: tuple[type[Exception], ...] = (yaml.YAMLError,)
            else:
                errors = (json.JSONDecodeError,)
            try:
                d = (yaml.safe_load(text) or {}) if yaml_file else json.loads(text)
            except errors as e:
                why = " ".join(str(e).split())  # YAML's messages span lines
                raise ValueError(f"--config {p}: not valid {'YAML' if yaml_file else 'JSON'} ({why})") from None
            if not isinstance(d, dict):
                raise ValueError(f"--config {p}: expected a mapping of options, got {type(d).__name__}")
            unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"--config {p}: unknown option(s) {sorted(unknown)}")
        d.update({k: v for k, v in overrides.items() if v is not None})
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            why = kind_error(f.name, str(f.type), getattr(self, f.name))
            if why:
                raise ValueError(why)
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "checkpoint_every", "keep_checkpoints",
                     "max_bad_steps", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("warmup_steps", "schedule_steps", "weight_decay", "clip_norm", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0" + (" (0: no clipping)" if name ==
                                                                                   "clip_norm" else ""))
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if self.mtp_loss_weight is not None and self.mtp_loss_weight < 0:
            raise ValueError(f"mtp_loss_weight={self.mtp_loss_weight} must be >= 0 (or null: the model config's)")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"peak_tflops={self.peak_tflops} must be positive (or null: from the device kind)")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r} must be one of {COMPUTE_DTYPES}")
        mesh = self.mesh
        if not isinstance(mesh, dict) or any(a not in AXES or not is_int(n) or n < 1 for a, n in mesh.items()):
            raise ValueError(f"mesh={self.mesh!r} must map axes of {AXES} to sizes >= 1")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} must be divisible by grad_accum={self.grad_accum}")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule={self.schedule!r} must be 'constant' or 'cosine'")
        if self.schedule == "cosine" and self.schedule_steps <= self.warmup_steps:
            raise ValueError("schedule='cosine' needs schedule_steps > warmup_steps")
        if self.logits_dtype not in LOGITS_DTYPES:
            raise ValueError(f"logits_dtype={self.logits_dtype!r} must be one of {LOGITS_DTYPES}")
        if self.remat != "none" and self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r} must be 'none' or one of {sorted(REMAT_POLICIES)}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def mtp_weight(cfg: LingConfig, tcfg: TrainConfig) -> float:
    """The MTP loss's weight in the objective (0: the MTP layer is neither run nor trained)."""
    w = cfg.mtp_loss_scaling_factor if tcfg.mtp_loss_weight is None else tcfg.mtp_loss_weight
    return float(w) if cfg.num_nextn_predict_layers > 0 else 0.0

"""`load_hf_checkpoint`: an HF Ling-3 directory (BF16/FP32 or block-FP8) -> (config, params).

The whole checkpoint is validated from the safetensors headers first (every expected tensor
present with its shape and a float or FP8 dtype, FP8 scales of the right grid, no unexpected
tensors), so a bad checkpoint fails before any data is read. Then every leaf of the param pytree
is built with `jax.make_array_from_callback`: each device asks only for its own shard, which is
assembled from memory-mapped source tensors (dequantized and transposed one tensor at a time),
so no array is ever materialised whole on one device or in host memory when a mesh shards it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from ling_jax.checkpoint import fp8
from ling_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsDir
from ling_jax.config import LingConfig
from ling_jax.params import Leaf, Params, ParamSlot, default_sharding, materialize, param_slots

FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
ALIASES = {"mlp.gate.expert_bias": "mlp.gate.e_score_correction_bias"}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_hf_dir(path: str | Path) -> bool:
    """Whether `path` looks like an HF checkpoint directory (a `config.json` and safetensors files)
    rather than an Orbax one; `load_hf_checkpoint` validates the rest."""
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def scale_name(name: str) -> str:
    return f"{name}_scale_inv"


class HFSource:
    """Resolves, validates and reads the HF tensors behind our param slots."""

    def __init__(self, path: str | Path, cfg: LingConfig):
        self.cfg = cfg
        self.st = SafetensorsDir(path)
        self.block = cfg.quantization.block_size if cfg.quantization else None

    def resolve(self, name: str) -> str:
        """The name under which `name` is stored (known aliases tried)."""
        if name in self.st:
            return name
        for ours, alias in ALIASES.items():
            if name.endswith(ours) and name.replace(ours, alias) in self.st:
                return name.replace(ours, alias)
        return name

    def is_fp8(self, name: str) -> bool:
        return scale_name(name) in self.st

    def validate(self, slots: list[ParamSlot]) -> None:
        """Raises CheckpointError naming the first missing, misshapen or unexpected tensor."""
        expected: set[str] = set()
        for slot in slots:
            want = slot.leaf.hf_shape(self.cfg)
            for _, name in slot.hf_names():
                name = self.resolve(name)
                if name not in self.st:
                    raise CheckpointError(f"{self.st.path}: missing tensor {name} (expected shape {list(want)})")
                expected.add(name)
                self._check(name, slot.leaf, want)
        if self.cfg.tie_word_embeddings and "lm_head.weight" in self.st:  # a copy of the embeddings
            v, d = self.cfg.vocab_size, self.cfg.hidden_size
            if self.st.shape("lm_head.weight") != (v, d):
                raise CheckpointError(f"tensor lm_head.weight has shape {list(self.st.shape('lm_head.weight'))}, "
                                      f"expected {[v, d]} (tied to the embeddings)")
            expected.add("lm_head.weight")  # unused: the head is the embeddings, as in transformers
        extra = [n for n in self.st
                 if n not in expected and not n.endswith(IGNORED_SUFFIXES)
                 and not (n.endswith("_scale_inv") and n[: -len("_scale_inv")] in expected)]
        if extra:
            more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
            raise CheckpointError(
                f"{self.st.path}: unexpected tensor(s) {', '.join(sorted(extra)[:3])}{more} — "
                "not part of a Ling-3 model with this config.json"
            )

    def _check(self, name: str, leaf: Leaf, want: tuple[int, ...]) -> None:
        shape, dt = self.st.shape(name), self.st.dtype_name(name)
        ok_shapes = [want] + ([(want[0], want[2])] if leaf.transform == "conv" else [])
        if shape not in ok_shapes:
            raise CheckpointError(f"tensor {name} has shape {list(shape)}, expected {list(want)}")
        if self.is_fp8(name):
            if dt != "F8_E4M3":
                raise CheckpointError(f"tensor {name} has a block scale but dtype {dt}, not F8_E4M3")
            if self.block is None:
                raise CheckpointError(
                    f"tensor {name} is FP8 but config.json has no quantization_config.weight_block_size"
                )
            s_name = scale_name(name)
            s_want = fp8.scale_shape(shape, self.block)
            if self.st.shape(s_name) != s_want:
                raise CheckpointError(
                    f"scale {s_name} has shape {list(self.st.shape(s_name))}, expected {list(s_want)} "
                    f"for a {list(shape)} weight in {self.block[0]}x{self.block[1]} blocks"
                )
        elif dt not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {dt} and no {scale_name(name)}")

    def read(self, name: str, leaf: Leaf) -> np.ndarray:
        """One HF tensor in our layout: dequantized (float32) if FP8, transposed as the table says."""
        name = self.resolve(name)
        arr = self.st.get(name)
        if self.is_fp8(name):
            arr = fp8.dequantize(arr, self.st.get(scale_name(name)), self.block)
        if leaf.transform == "T":
            return arr.T
        if leaf.transform == "conv":
            return arr.reshape(arr.shape[0], arr.shape[-1])
        return arr


def load_hf_checkpoint(
    path: str | Path, *, dtype: Any = "float32", mesh: jax.sharding.Mesh | None = None,
    show_progress: bool = False, **config_options: Any,
) -> tuple[LingConfig, Params]:
    """Reads an HF Ling-3 checkpoint directory into (config, params).

    `dtype`: dtype of the params (FP8 weights are dequantized in float32, then cast); `A_log`,
    `dt_bias` and `expert_bias` stay float32. With `mesh`, every array is created directly with
    its sharding from `ling_jax.sharding`. `config_options` set runtime fields of `LingConfig`
    (e.g. `kda_impl="chunked"`).
    """
    path = Path(path)
    cfg = LingConfig.from_hf(path, **config_options)
    src = HFSource(path, cfg)
    slots = param_slots(cfg)
    src.validate(slots)
    total = sum(int(np.prod(s.shape)) * np.dtype(s.dtype(dtype)).itemsize for s in slots)
    with tqdm(total=total, desc="loading", unit="B", unit_scale=True, disable=not show_progress) as bar:
        params = materialize(cfg, lambda slot, idx: src.read(slot.hf_name(idx), slot.leaf), dtype,
                             default_sharding(cfg, mesh), on_leaf=bar.update)
    return cfg, params

"""Our params -> an HF Ling-3 directory (config.json, sharded safetensors, index), BF16 or block-FP8.

The inverse of `load_hf_checkpoint`, walking the same table (`params.param_slots`). With a
`QuantConfig`, every linear weight not matched by its exclusions is re-quantized to e4m3 with
block scales (`weight_scale_inv`), the layout of Ling's `-fp8` repositories.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ling_jax.checkpoint import fp8
from ling_jax.checkpoint.safetensors_io import write_safetensors
from ling_jax.config import LingConfig, QuantConfig
from ling_jax.params import Leaf, Params, ParamSlot, get_path, param_slots


def to_hf_layout(arr: np.ndarray, leaf: Leaf) -> np.ndarray:
    """One tensor from our layout to the checkpoint's."""
    if leaf.transform == "T":
        return np.ascontiguousarray(arr.T)
    if leaf.transform == "conv":
        return arr.reshape(arr.shape[0], 1, arr.shape[1])
    return np.ascontiguousarray(arr)


def is_quantizable(name: str, leaf: Leaf, quant: QuantConfig | None) -> bool:
    """Linear weights are FP8 unless their module is listed in the exclusions (suffix match)."""
    return quant is not None and leaf.transform == "T" and not quant.excludes(name.removesuffix(".weight"))


def hf_tensors(cfg: LingConfig, params: Params, slot: ParamSlot, *, dtype: Any,
               quant: QuantConfig | None) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) pairs in HF layout for one param slot (+ scales for FP8 weights)."""
    arr: jax.Array = get_path(params, slot.path)
    out_dtype = np.dtype(np.float32) if slot.leaf.fp32 else jnp.dtype(dtype)
    for idx, name in slot.hf_names():
        t = to_hf_layout(np.asarray(arr[idx]), slot.leaf)
        if is_quantizable(name, slot.leaf, quant):
            wq, scale = fp8.quantize(t.astype(np.float32), quant.block_size)
            yield name, wq
            yield f"{name}_scale_inv", scale
        else:
            yield name, t.astype(out_dtype)


def _nbytes(cfg: LingConfig, slot: ParamSlot, dtype: Any, quant: QuantConfig | None) -> list[tuple[str, int]]:
    """Sizes of the tensors `hf_tensors` would yield for `slot`, without computing them."""
    out, hf_shape = [], slot.leaf.hf_shape(cfg)
    size = int(np.prod(hf_shape))
    itemsize = 4 if slot.leaf.fp32 else jnp.dtype(dtype).itemsize
    for _, name in slot.hf_names():
        if is_quantizable(name, slot.leaf, quant):
            out += [(name, size), (f"{name}_scale_inv", 4 * int(np.prod(fp8.scale_shape(hf_shape, quant.block_size))))]
        else:
            out.append((name, size * itemsize))
    return out


def save_hf_checkpoint(
    cfg: LingConfig, params: Params, out_dir: str | Path, *, dtype: Any = "bfloat16",
    quantization: QuantConfig | None = None, max_shard_bytes: int = 4 << 30, show_progress: bool = False,
) -> Path:
    """Writes `out_dir` (created, must not exist or be empty) as an HF checkpoint directory.

    `dtype`: dtype of non-FP8 tensors (A_log, dt_bias, expert_bias stay float32);
    `quantization`: block-FP8 format and exclusions for linear weights (None: no FP8).
    Shards are filled slot by slot up to `max_shard_bytes`; the index maps every tensor.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    slots = param_slots(cfg)
    shards: list[list[ParamSlot]] = [[]]
    filled = 0
    for slot in slots:
        size = sum(n for _, n in _nbytes(cfg, slot, dtype, quantization))
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(slot)
        filled += size
    total = sum(n for s in slots for _, n in _nbytes(cfg, s, dtype, quantization))
    weight_map: dict[str, str] = {}
    bar = tqdm(total=total, desc="exporting", unit="B", unit_scale=True, disable=not show_progress)
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = [t for slot in shard for t in hf_tensors(cfg, params, slot, dtype=dtype, quant=quantization)]
        write_safetensors(tmp / fname, tensors)
        for name, arr in tensors:
            weight_map[name] = fname
            bar.update(arr.nbytes)
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_cfg = cfg.to_hf() if quantization is None else {**cfg.to_hf(), "quantization_config": quantization.to_hf()}
    if quantization is None:
        hf_cfg.pop("quantization_config", None)
    hf_cfg["torch_dtype"] = jnp.dtype(dtype).name
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out

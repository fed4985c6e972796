"""Random HF Ling-3 checkpoints of any size, written with numpy shard by shard (tests, benchmarks).

The tensors have the names, shapes and dtypes of a real checkpoint for the given config (block-FP8
with `weight_scale_inv` for the linear weights a `QuantConfig` does not exclude, bf16 otherwise,
float32 for A_log / dt_bias / expert_bias). Values are cheap random bits, not a trained model:
FP8 weights are uniform random e4m3 codes (NaN codes replaced by zero). Memory: one tensor.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from ling_jax.checkpoint import fp8
from ling_jax.checkpoint.export import is_quantizable
from ling_jax.checkpoint.safetensors_io import write_safetensors_stream
from ling_jax.config import LingConfig, QuantConfig
from ling_jax.params import Leaf, param_slots

BF16 = np.dtype(ml_dtypes.bfloat16)
LING_FP8_EXCLUSIONS = ("lm_head", "word_embeddings", "gate", "b_proj")


def scaled_config(num_layers: int, *, hidden: int = 1024, vocab: int = 32768, experts: int = 32,
                  expert_width: int = 1024) -> LingConfig:
    """The `debug` preset grown to benchmark sizes: model size grows with `num_layers` while the
    largest tensor (the [vocab, hidden] embedding / head) stays the same."""
    return dataclasses.replace(
        LingConfig.preset("debug"), hidden_size=hidden, vocab_size=vocab, num_hidden_layers=num_layers,
        layer_group_size=4, num_attention_heads=8, num_key_value_heads=8, head_dim=hidden // 8, q_lora_rank=256,
        kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=4 * hidden,
        num_experts=experts, n_group=4, topk_group=2, num_experts_per_tok=4, moe_intermediate_size=expert_width,
        moe_shared_expert_intermediate_size=expert_width)


def hf_tensor_specs(cfg: LingConfig, quant: QuantConfig | None) -> list[tuple[str, np.dtype, tuple[int, ...], Leaf]]:
    """(name, dtype, shape, leaf) of every tensor of an HF checkpoint of `cfg`, scales included, in HF order."""
    out = []
    for slot in param_slots(cfg):
        shape = slot.leaf.hf_shape(cfg)
        for _, name in slot.hf_names():
            if is_quantizable(name, slot.leaf, quant):
                assert quant is not None
                out.append((name, np.dtype(fp8.FP8), shape, slot.leaf))
                out.append((f"{name}_scale_inv", np.dtype(np.float32), fp8.scale_shape(shape, quant.block_size),
                            slot.leaf))
            else:
                out.append((name, np.dtype(np.float32) if slot.leaf.fp32 else BF16, shape, slot.leaf))

    def order(spec: tuple[str, np.dtype, tuple[int, ...], Leaf]) -> tuple[int, int]:
        parts = spec[0].split(".")
        if parts[:2] == ["model", "layers"]:
            return (1, int(parts[2]))
        return (0 if "word_embeddings" in spec[0] else 2, 0)

    return sorted(out, key=order)


def _random(rng: np.random.Generator, name: str, dtype: np.dtype, shape: tuple[int, ...], leaf: Leaf) -> np.ndarray:
    if dtype == fp8.FP8:
        codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # 0x7F / 0xFF are NaN in e4m3fn
        return codes.view(fp8.FP8)
    if name.endswith("_scale_inv"):
        return rng.uniform(1e-4, 1e-3, size=shape).astype(np.float32)
    if leaf.init == "ones":
        return np.ones(shape, dtype)
    if leaf.init == "a_log":
        return np.log(rng.uniform(1.0, 16.0, size=shape)).astype(dtype)
    return (0.02 * rng.standard_normal(shape, np.float32)).astype(dtype)


def write_random_hf_checkpoint(cfg: LingConfig, out_dir: str | Path, *, quantization: QuantConfig | None = None,
                               seed: int = 0, max_shard_bytes: int = 1 << 30) -> Path:
    """Writes config.json, `model-*-of-*.safetensors` shards and the index of a random checkpoint."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)
    specs = hf_tensor_specs(cfg, quantization)
    shards: list[list[tuple[str, np.dtype, tuple[int, ...], Leaf]]] = [[]]
    filled = 0
    for spec in specs:
        nbytes = spec[1].itemsize * int(np.prod(spec[2]))
        if shards[-1] and filled + nbytes > max_shard_bytes and not spec[0].endswith("_scale_inv"):
            shards.append([])
            filled = 0
        shards[-1].append(spec)
        filled += nbytes
    rng = np.random.default_rng(seed)
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"

        def arrays(shard: list[tuple[str, np.dtype, tuple[int, ...], Leaf]] = shard) -> Iterator[np.ndarray]:
            for name, dtype, shape, leaf in shard:
                yield _random(rng, name, dtype, shape, leaf)

        write_safetensors_stream(out / fname, [(n, d, s) for n, d, s, _ in shard], arrays())
        weight_map.update((n, fname) for n, _, _, _ in shard)
    total = sum(d.itemsize * int(np.prod(s)) for _, d, s, _ in specs)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    hf = cfg.to_hf()
    if quantization is not None:
        hf["quantization_config"] = quantization.to_hf()
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out

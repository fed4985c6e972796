"""HF checkpoint I/O: FP8 dequantization, sharded directories, export, and clear errors."""

from __future__ import annotations

import json
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import GOLDEN

import ling_jax
from ling_jax.checkpoint import fp8
from ling_jax.checkpoint.export import save_hf_checkpoint
from ling_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsDir, SafetensorsFile, write_safetensors
from ling_jax.config import ConfigError, LingConfig, QuantConfig
from ling_jax.params import init_params


def test_dequantize_partial_edge_blocks():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((80, 45)).astype(np.float32)  # 3 x 2 blocks of 32, the last ones partial
    wq, s = fp8.quantize(w, (32, 32))
    assert wq.dtype == ml_dtypes.float8_e4m3fn and s.shape == (3, 2)
    back = fp8.dequantize(wq, s, (32, 32))
    assert np.abs(back - w).max() <= np.abs(w).max() / 16  # e4m3 keeps 3 mantissa bits
    # the exact formula: element times the scale of its own block
    assert back[79, 44] == np.float32(wq[79, 44].astype(np.float32) * s[2, 1])


def test_fp8_golden_dequantizes_exactly(golden_fp8):
    """Every FP8 weight equals float32(Wq) * S[i // 32, j // 32], transposed into our layout."""
    cfg, params, _ = golden_fp8
    st = SafetensorsDir(GOLDEN / "ling3_tiny_a_fp8")
    name = "model.layers.3.attention.kv_a_proj_with_mqa.weight"  # [80, 128]: a partial edge block row
    wq, s = st.get(name), st.get(name + "_scale_inv")
    want = wq.astype(np.float32) * np.repeat(np.repeat(s, 32, 0), 32, 1)[:80, :128]
    got = np.asarray(params["segments"][2]["attn"]["kv_a_proj"][0])
    np.testing.assert_array_equal(got, want.T)
    assert st.dtype_name("model.layers.1.mlp.gate.weight") == "BF16"  # excluded router stays bf16


def test_bf16_and_fp32_dtype_policy():
    cfg, params = ling_jax.load_hf_checkpoint(GOLDEN / "ling3_tiny_a", dtype="bfloat16")
    kda = params["segments"][0]["attn"]
    assert kda["q_proj"].dtype == jnp.bfloat16
    assert kda["A_log"].dtype == kda["dt_bias"].dtype == jnp.float32
    assert params["segments"][1]["mlp"]["expert_bias"].dtype == jnp.float32


def test_sharded_export_roundtrip(tmp_path):
    """Random params -> sharded HF dir (index + several files) -> loader: identical arrays."""
    cfg = LingConfig.preset("debug")
    params = init_params(cfg, seed=0)
    out = save_hf_checkpoint(cfg, params, tmp_path / "ck", dtype="float32", max_shard_bytes=300_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    cfg2, params2 = ling_jax.load_hf_checkpoint(out)
    assert cfg2 == cfg
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), params, params2))


def test_fp8_export_reproduces_source_bits(tmp_path):
    """bf16 golden -> re-quantized export with the FP8 config's exclusions == the FP8 golden, bit for bit."""
    cfg, params = ling_jax.load_hf_checkpoint(GOLDEN / "ling3_tiny_a", dtype="bfloat16")
    quant = LingConfig.from_hf(GOLDEN / "ling3_tiny_a_fp8").quantization
    out = save_hf_checkpoint(cfg, params, tmp_path / "fp8", quantization=quant)
    mine, src = SafetensorsDir(out), SafetensorsDir(GOLDEN / "ling3_tiny_a_fp8")
    assert sorted(mine.keys()) == sorted(src.keys())
    assert sum(k.endswith("_scale_inv") for k in mine) == 850
    for k in src:
        a, b = mine.get(k), src.get(k)
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), k


def test_fp8_export_never_quantizes_router_or_head(tmp_path):
    """Without exclusions the linear weights go FP8 but the router and lm_head stay floats (§4);
    ue8m0 scales are powers of two, and the export loads back within FP8 rounding."""
    cfg = LingConfig.preset("debug")
    params = init_params(cfg, seed=1)
    out = save_hf_checkpoint(cfg, params, tmp_path / "ck", quantization=QuantConfig((32, 32), scale_fmt="ue8m0"))
    st = SafetensorsDir(out)
    assert st.dtype_name("model.layers.0.attention.q_proj.weight") == "F8_E4M3"
    for name in ("model.layers.1.mlp.gate.weight", "lm_head.weight"):
        assert st.dtype_name(name) == "BF16" and name + "_scale_inv" not in st, name
    scales = np.concatenate([st.get(k).ravel() for k in st if k.endswith("_scale_inv")])
    assert np.array_equal(scales, np.exp2(np.round(np.log2(scales))))
    _, back = ling_jax.load_hf_checkpoint(out)
    w = np.asarray(params["segments"][0]["attn"]["q_proj"], np.float32)
    assert np.abs(np.asarray(back["segments"][0]["attn"]["q_proj"]) - w).max() <= np.abs(w).max() / 8


def test_tied_checkpoint_may_store_the_head(tmp_path):
    """tie_word_embeddings with a stored lm_head.weight (as some exporters write) loads; the head is
    the embeddings."""
    cfg = LingConfig.preset("debug", tie_word_embeddings=True)
    params = init_params(cfg, seed=2)
    out = save_hf_checkpoint(cfg, params, tmp_path / "ck", dtype="float32")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = out / index["weight_map"]["model.word_embeddings.weight"]
    f = SafetensorsFile(shard)
    tensors = {k: np.array(f.get(k)) for k in f}
    write_safetensors(shard, {**tensors, "lm_head.weight": tensors["model.word_embeddings.weight"]})
    index["weight_map"]["lm_head.weight"] = shard.name
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    _, back = ling_jax.load_hf_checkpoint(out)
    assert "lm_head" not in back
    np.testing.assert_array_equal(back["embed"], params["embed"])


def _raw_safetensors(path, header, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("header, message", [
    ([1, 2], "corrupt safetensors header \\(a JSON list"),
    ({"a": {"dtype": "F32", "shape": [2]}}, "tensor a has data_offsets None"),
    ({"a": [1]}, "tensor a's entry is not an object"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "tensor a has shape \\[-2\\]"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "tensors a and b overlap"),
])
def test_corrupt_header(tmp_path, header, message):
    _raw_safetensors(tmp_path / "x.safetensors", header, bytes(16))
    with pytest.raises(CheckpointError, match=message):
        SafetensorsFile(tmp_path / "x.safetensors")


# ---------------------------------------------------------------- bad input: one clear error each
def _rewrite(src_dir, dst_dir, edit) -> None:
    """Copies a single-file checkpoint, passing its tensors through `edit(dict) -> dict`."""
    shutil.copytree(src_dir, dst_dir)
    (dst_dir / "model.safetensors").unlink()
    f = SafetensorsFile(src_dir / "model.safetensors")
    tensors = edit({k: np.array(f.get(k)) for k in f})
    write_safetensors(dst_dir / "model.safetensors", tensors)


def test_missing_tensor(tmp_path):
    name = "model.layers.5.attention.dt_bias"
    _rewrite(GOLDEN / "ling3_tiny_a", tmp_path / "c", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=f"missing tensor {name}"):
        ling_jax.load_hf_checkpoint(tmp_path / "c")


def test_unexpected_tensor(tmp_path):
    _rewrite(GOLDEN / "ling3_tiny_a", tmp_path / "c",
             lambda t: {**t, "model.layers.2.attention.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensor.*layers.2.attention.extra"):
        ling_jax.load_hf_checkpoint(tmp_path / "c")


def test_wrong_shape(tmp_path):
    name = "model.layers.3.attention.kv_b_proj.weight"
    _rewrite(GOLDEN / "ling3_tiny_a", tmp_path / "c", lambda t: {**t, name: t[name][:, :32]})
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[256, 32\], expected \[256, 64\]"):
        ling_jax.load_hf_checkpoint(tmp_path / "c")


def test_wrong_scale_shape(tmp_path):
    name = "model.layers.0.attention.q_proj.weight_scale_inv"
    _rewrite(GOLDEN / "ling3_tiny_a_fp8", tmp_path / "c", lambda t: {**t, name: t[name][:, :2]})
    with pytest.raises(CheckpointError, match=f"scale {name} has shape"):
        ling_jax.load_hf_checkpoint(tmp_path / "c")


def test_truncated_file(tmp_path):
    shutil.copytree(GOLDEN / "ling3_tiny_a", tmp_path / "c")
    path = tmp_path / "c" / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointError, match="model.safetensors: truncated: tensor"):
        ling_jax.load_hf_checkpoint(tmp_path / "c")
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(CheckpointError, match="truncated"):
        ling_jax.load_hf_checkpoint(tmp_path / "c")


def test_index_names_missing_file(tmp_path):
    cfg = LingConfig.preset("debug")
    out = save_hf_checkpoint(cfg, init_params(cfg, seed=0), tmp_path / "ck", max_shard_bytes=200_000)
    victim = sorted(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (out / victim).unlink()
    with pytest.raises(CheckpointError, match=f"names {victim}, which is not in"):
        ling_jax.load_hf_checkpoint(out)


def test_wrong_architecture(tmp_path):
    shutil.copytree(GOLDEN / "ling3_tiny_a", tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["architectures"] = ["BailingMoeV2_5ForCausalLM"]  # Ling-2.6 shares model_type bailing_hybrid
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="architectures.*BailingMoeV3ForCausalLM"):
        ling_jax.load_hf_checkpoint(tmp_path / "c")

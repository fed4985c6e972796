"""LingConfig: HF parsing, presets, the layer schedule rule, stacking plan and validation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import GOLDEN

from ling_jax.config import ConfigError, LingConfig, QuantConfig
from ling_jax.params import param_slots


def n_params(cfg: LingConfig) -> int:
    return sum(int(np.prod(s.shape)) for s in param_slots(cfg))


def test_golden_config_parses():
    cfg = LingConfig.from_hf(GOLDEN / "ling3_tiny_a")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.layer_group_size) == (128, 8, 4)
    assert [i for i, k in enumerate(cfg.layer_kinds) if k[0] == "mla"] == [3, 7]
    assert cfg.eos_token_id == (510,) and cfg.quantization is None
    fp8 = LingConfig.from_hf(GOLDEN / "ling3_tiny_a_fp8" / "config.json")
    assert fp8.quantization.block_size == (32, 32)
    assert fp8.quantization.excludes("model.layers.3.mlp.gate")
    assert not fp8.quantization.excludes("model.layers.3.mlp.experts.0.gate_proj")


@pytest.mark.parametrize(
    "name, mla, dense, total",
    [
        # totals: ARCHITECTURE.md §1.1 (Tiny-Base 8,209,997,600 incl. expert_bias; 3.0-flash 127.49 B)
        ("ling-3.0-tiny", [3, 7, 11, 15, 19, 23], [0], 8_209_997_600),
        ("ling-3.0-flash", [5, 11, 17, 23, 29, 35, 41], [0, 1], 127_486_405_600),
        ("ling-3.1-flash", [7, 15, 23, 31, 39, 47, 55, 63, 71], [0, 1, 2, 3], None),
    ],
)
def test_presets_schedule_and_size(name, mla, dense, total):
    cfg = LingConfig.preset(name)
    assert [i for i, k in enumerate(cfg.layer_kinds) if k[0] == "mla"] == mla
    assert [i for i, k in enumerate(cfg.layer_kinds) if k[1] == "dense"] == dense
    assert sum(s.num_layers for s in cfg.segments) == cfg.num_hidden_layers
    assert cfg.segments[-1].kind == "groups"  # the repeating part is one scan
    if total is not None:
        assert n_params(cfg) == total


def test_ling31_flash_preset_values():
    cfg = LingConfig.preset("ling-3.1-flash")
    assert cfg.q_lora_rank == 1536 and cfg.num_experts == 512 and cfg.num_attention_heads == 64
    assert cfg.swiglu_limits(64) == (0.0, 10.0) and cfg.swiglu_limits(65) == (10.0, 10.0)
    assert cfg.swiglu_limits(63) == (0.0, 0.0) and cfg.swiglu_limits(72) == (0.0, 0.0)  # MTP: none
    off = LingConfig.preset("ling-3.1-flash", swiglu_clamp=False)
    assert off.swiglu_limits(70) == (0.0, 0.0)
    # 63 KDA + 9 MLA, 8 regular groups scanned after an irregular first group
    assert [(s.kind, s.length) for s in cfg.segments] == [("run", 4), ("run", 3), ("run", 1), ("groups", 8)]


def test_schedule_tail_rule():
    # L not a multiple of G: every layer of the incomplete trailing group is MLA (§1.2)
    cfg = LingConfig.preset("debug", num_hidden_layers=8, layer_group_size=3)
    assert [k[0] for k in cfg.layer_kinds] == ["kda", "kda", "mla", "kda", "kda", "mla", "mla", "mla"]
    assert [(s.kind, s.first_layer, s.length) for s in cfg.segments] == [
        ("run", 0, 1), ("run", 1, 1), ("run", 2, 1), ("groups", 3, 1), ("run", 6, 2)]


def test_roundtrip_to_hf():
    cfg = LingConfig.from_hf(GOLDEN / "ling3_tiny_a_fp8")
    assert LingConfig.from_hf(cfg.to_hf()) == cfg


def _golden_dict() -> dict:
    return json.loads((GOLDEN / "ling3_tiny_a" / "config.json").read_text())


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["BailingMoeV2ForCausalLM"]}, "architectures"),
        ({"num_experts": 30}, "n_group"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"topk_group": 9}, "topk_group"),
        ({"num_experts_per_tok": 17}, "num_experts_per_tok"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"qk_head_dim": 64}, "qk_head_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
        ({"quantization_config": "fp8"}, "quantization_config"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
        ({"num_nextn_predict_layers": None}, "num_nextn_predict_layers"),
        ({"first_k_dense_replace": None}, "first_k_dense_replace"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
        ({"num_experts_per_tok": "4"}, "num_experts_per_tok"),
        ({"rms_norm_eps": None}, "rms_norm_eps"),
        ({"rope_scaling": "none"}, "rope_scaling"),
        ({"eos_token_id": "</s>"}, "eos_token_id"),
    ],
)
def test_bad_config_names_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        LingConfig.from_hf({**_golden_dict(), **change})


def test_null_fields_the_config_does_not_read(tmp_path):
    """Nulls where the model never reads the field load; an int eos_token_id is one stop token."""
    base = _golden_dict()
    cfg = LingConfig.from_hf({**base, "num_shared_experts": 0, "moe_shared_expert_intermediate_size": None,
                              "qk_head_dim": None})
    assert cfg.shared_intermediate_size == 0 and cfg.qk_head_dim == base["qk_nope_head_dim"] + base["qk_rope_head_dim"]
    dense = LingConfig.from_hf({**base, "num_experts": None, "moe_intermediate_size": None, "n_group": None})
    assert not dense.uses_moe
    (tmp_path / "config.json").write_text(json.dumps([base]))
    with pytest.raises(ConfigError, match="config.json holds a JSON list"):
        LingConfig.from_hf(tmp_path)
    assert LingConfig.preset("debug", eos_token_id=2).eos_token_id == (2,)
    assert "eos_token_id" not in LingConfig.from_hf({**base, "eos_token_id": None}).to_hf()


def test_rope_parameters_of_transformers_v5():
    """v5 configs keep the RoPE base in rope_parameters (or rope_scaling); it is read, not defaulted."""
    base = {k: v for k, v in _golden_dict().items() if k != "rope_theta"}
    for key in ("rope_parameters", "rope_scaling"):
        assert LingConfig.from_hf({**base, key: {"rope_type": "default", "rope_theta": 1e4}}).rope_theta == 1e4
    with pytest.raises(ConfigError, match="rope_parameters.rope_theta=10000.0 != rope_theta=5"):
        LingConfig.from_hf({**base, "rope_theta": 5, "rope_parameters": {"rope_theta": 1e4}})
    with pytest.raises(ConfigError, match="rope_parameters"):
        LingConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    moved = LingConfig.from_hf({**base, "rope_parameters": {"rope_theta": 1e4}}, rope_theta=5e4)
    assert LingConfig.from_hf(moved.to_hf()) == moved  # the written file agrees with itself


def test_integral_floats_and_mtp_moe_fields():
    """32768.0 is an int field's 32768; the MTP layer (MoE whenever num_experts is set) reads the
    MoE fields even when every main layer is dense."""
    base = _golden_dict()
    assert LingConfig.from_hf({**base, "max_position_embeddings": 32768.0}).max_position_embeddings == 32768
    dense_main = {**base, "first_k_dense_replace": base["num_hidden_layers"]}
    with pytest.raises(ConfigError, match="moe_intermediate_size=None"):
        LingConfig.from_hf({**dense_main, "moe_intermediate_size": None})
    with pytest.raises(ConfigError, match="topk_group"):
        LingConfig.from_hf({**dense_main, "topk_group": 99})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        LingConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="unknown preset"):
        LingConfig.preset("ling-9")


def test_quant_exclusions_are_segment_suffixes():
    q = QuantConfig(exclusions=("gate", "5.attention.g_proj"))
    assert q.excludes("model.layers.1.mlp.gate")
    assert not q.excludes("model.layers.1.mlp.gate_proj")
    assert q.excludes("model.layers.5.attention.g_proj")
    assert not q.excludes("model.layers.4.attention.g_proj")
    assert not q.excludes("model.layers.15.attention.g_proj")


def test_runtime_option_lists_match_the_implementations():
    from ling_jax.config import KDA_IMPLS, MOE_IMPLS
    from ling_jax.ops.kda.api import IMPLS as KDA
    from ling_jax.ops.moe import IMPLS as MOE

    assert set(KDA_IMPLS) == set(KDA) and set(MOE_IMPLS) == set(MOE)
    with pytest.raises(ConfigError, match="decode_impl"):
        LingConfig.preset("debug", decode_impl="triton")
    with pytest.raises(ConfigError, match="head_dim"):  # the Pallas decode kernels' tiles
        LingConfig.preset("debug", decode_impl="pallas", head_dim=24)

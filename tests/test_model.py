"""The whole model against the PyTorch reference's golden outputs (tests/golden/README.md)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, rel_l2

import ling_jax
from ling_jax.config import LingConfig
from ling_jax.model import apply_layer, forward_hidden, lm_head, make_context
from ling_jax.params import param_shapes


@functools.partial(jax.jit, static_argnums=0)
def _run(cfg, params, ids):
    out = forward_hidden(cfg, params, ids, mtp=True, collect=True)
    return {"logits": lm_head(cfg, params, out["final"]), "final": out["final"],
            "mtp": lm_head(cfg, params, out["mtp"][0]), "layers": out["layers"]}


def _check_routers(cfg, layers, g, prefix):
    """Chosen experts equal the reference's as sets, except tokens whose routing margin < 1e-4."""
    moe = [i for i, (_, f) in enumerate(cfg.layer_kinds) if f == "moe"]
    checked = 0
    for j, i in enumerate(moe):
        ours = np.sort(np.asarray(layers[i]["router"]["topk_idx"]), -1)
        ref = np.sort(g[f"{prefix}_router_topk_idx"][j].reshape(ours.shape), -1)
        sure = g[f"{prefix}_router_margin"][j].reshape(-1) >= 1e-4
        np.testing.assert_array_equal(ours[sure], ref[sure], err_msg=f"layer {i}")
        checked += int(sure.sum())
    assert checked > 0.99 * len(moe) * ours.shape[0]


@pytest.mark.parametrize("prefix, tol", [("prefill", 1e-5), ("long", 1e-4)])
def test_golden_a_fp32(golden_a, prefix, tol):
    cfg, params, g = golden_a
    out = _run(cfg, params, jnp.asarray(g[f"{prefix}_input_ids"]))
    assert rel_l2(out["logits"], g[f"{prefix}_logits"]) < tol
    assert rel_l2(out["final"], g[f"{prefix}_final_norm"]) < tol
    for i, layer in enumerate(out["layers"]):
        assert rel_l2(layer["hidden"], g[f"{prefix}_layer_outputs"][i]) < tol, f"layer {i}"
    _check_routers(cfg, out["layers"], g, prefix)
    if prefix == "prefill":
        assert rel_l2(out["mtp"], g["prefill_mtp_logits"]) < tol
        logits_NE = out["layers"][1]["router"]["logits"]
        assert rel_l2(logits_NE, g["prefill_router_logits"][0].reshape(logits_NE.shape)) < tol
        w = np.asarray(out["layers"][1]["router"]["topk_weight"])
        np.testing.assert_allclose(w.sum(-1), 2.5, rtol=1e-6)


@pytest.mark.parametrize("prefix, tol", [("prefill", 1e-5), ("long", 1e-4)])
def test_golden_a_fused_attention(golden_a, prefix, tol):
    """Golden set A with MLA through the fused attention kernels (interpret mode on CPU)."""
    cfg, params, g = golden_a
    out = _run(dataclasses.replace(cfg, attention_impl="pallas"), params, jnp.asarray(g[f"{prefix}_input_ids"]))
    assert rel_l2(out["logits"], g[f"{prefix}_logits"]) < tol
    for i, layer in enumerate(out["layers"]):
        assert rel_l2(layer["hidden"], g[f"{prefix}_layer_outputs"][i]) < tol, f"layer {i}"


@pytest.mark.parametrize("prefix, tol", [("prefill", 1e-5), ("long", 1e-4)])
def test_golden_fp8(golden_fp8, prefix, tol):
    cfg, params, g = golden_fp8
    out = _run(cfg, params, jnp.asarray(g[f"{prefix}_input_ids"]))
    assert rel_l2(out["logits"], g[f"{prefix}_logits"]) < tol
    _check_routers(cfg, out["layers"], g, prefix)
    if prefix == "prefill":
        assert rel_l2(out["mtp"], g["prefill_mtp_logits"]) < tol


def test_golden_fp8_bf16_weights():
    """FP8 dequantized then rounded to bf16 (what a bf16 conversion holds), run in float32."""
    cfg, params = ling_jax.load_hf_checkpoint(GOLDEN / "ling3_tiny_a_fp8", dtype="bfloat16")
    params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    g = np.load(GOLDEN / "ling3_tiny_a_fp8" / "golden_bf16w.npz")
    for prefix in ("prefill", "long"):
        logits = _run(cfg, params, jnp.asarray(g[f"{prefix}_input_ids"]))["logits"]
        assert rel_l2(logits, g[f"{prefix}_logits"]) < 1e-4


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 5e-2)])
def test_layer_by_layer(golden_a, dtype, tol):
    """Each layer fed the golden float32 input (cast to dtype) reproduces the golden output.

    bf16: relative L2 <= 5e-2 (1e-2 for the dense layer 0), as tests/golden/README.md prescribes.
    """
    cfg, _, g = golden_a
    _, params = ling_jax.load_hf_checkpoint(GOLDEN / "ling3_tiny_a", dtype=dtype)
    ids = jnp.asarray(g["prefill_input_ids"])
    ctx = make_context(cfg, ids)
    inputs = [g["prefill_embeddings"], *g["prefill_layer_outputs"][:-1]]
    for i in range(cfg.num_hidden_layers):
        y, _ = apply_layer(cfg, params, i, jnp.asarray(inputs[i], dtype), ctx)
        bound = 1e-2 if (dtype == "bfloat16" and i == 0) else tol
        assert rel_l2(y.astype(jnp.float32), g["prefill_layer_outputs"][i]) < bound, f"layer {i}"


def _count_eqns(jaxpr) -> int:
    """Equations of a jaxpr, those of nested jaxprs (scan/cond/jit bodies) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for v in eqn.params.values():
            for sub in v if isinstance(v, tuple | list) else (v,):
                if hasattr(sub, "eqns"):
                    n += _count_eqns(sub)
                elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    n += _count_eqns(sub.jaxpr)
    return n


def test_stack_traces_once_per_kind():
    """72 layers trace to the same program size as 16: the repeating groups are one scan."""
    sizes = []
    for layers in (16, 72):
        cfg = LingConfig.preset(
            "ling-3.1-flash", num_hidden_layers=layers, hidden_size=64, intermediate_size=64,
            num_attention_heads=2, num_key_value_heads=2, head_dim=16, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_experts=16,
            moe_intermediate_size=8, moe_shared_expert_intermediate_size=8, vocab_size=64)
        params = param_shapes(cfg, jnp.float32)
        jaxpr = jax.make_jaxpr(lambda p, i, cfg=cfg: ling_jax.forward(cfg, p, i))(
            params, jax.ShapeDtypeStruct((1, 8), jnp.int32))
        sizes.append(_count_eqns(jaxpr.jaxpr))
    assert sizes[0] == sizes[1]

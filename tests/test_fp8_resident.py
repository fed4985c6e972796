"""FP8-resident inference: layer weights kept block-FP8 on device, dequantized one layer at a time.

Ground truth is the reference run on the FP8 golden checkpoint (`ling3_tiny_a_fp8/golden.npz`,
computed on the dequantized weights): the FP8-resident model must reproduce its logits, MTP
logits, greedy tokens and per-step decode logits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, decode_one, prefill_cache, rel_l2

import ling_jax
from ling_jax.checkpoint.convert import convert_hf_to_orbax
from ling_jax.checkpoint.fp8 import FP8, BlockFP8, is_block_fp8

FP8_SRC = GOLDEN / "ling3_tiny_a_fp8"


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    return convert_hf_to_orbax(FP8_SRC, tmp_path_factory.mktemp("fp8") / "ck", dtype="float8")


@pytest.fixture(scope="module")
def resident_f32(ck):
    return ling_jax.load_checkpoint(ck, dtype="float32", keep_fp8=True)


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_layer_weights_stay_fp8(ck, resident_f32):
    cfg, params = resident_f32
    q_proj = params["segments"][0]["attn"]["q_proj"]
    experts = params["segments"][1]["mlp"]["gate_proj"]
    assert isinstance(q_proj, BlockFP8) and q_proj.value.dtype == FP8 and q_proj.scale.dtype == jnp.float32
    assert isinstance(experts, BlockFP8) and experts.value.ndim == 4 and experts.value.shape[1] == cfg.num_experts
    assert params["embed"].dtype == params["lm_head"].dtype == jnp.float32  # excluded in the source: dense
    assert not is_block_fp8(params["segments"][1]["mlp"]["router"])
    layers = {k: params[k] for k in ("segments", "mtp")}
    n_fp8 = sum(x.value.size for x in jax.tree.leaves(layers, is_leaf=is_block_fp8) if is_block_fp8(x))
    assert n_fp8 > 0.9 * sum(x.size for x in jax.tree.leaves(layers))  # the bulk of the layer weights
    _, dense = ling_jax.load_checkpoint(ck, dtype="bfloat16")
    _, resident = ling_jax.load_checkpoint(ck, dtype="bfloat16", keep_fp8=True)
    layer_bytes = {k: _nbytes({n: p[n] for n in ("segments", "mtp")}) for k, p in
                   (("dense", dense), ("resident", resident))}
    assert layer_bytes["resident"] < 0.6 * layer_bytes["dense"], layer_bytes


def test_fp8_resident_forward_matches_golden(resident_f32):
    cfg, params = resident_f32
    g = np.load(FP8_SRC / "golden.npz")
    logits, mtp_logits = ling_jax.forward_with_mtp(cfg, params, jnp.asarray(g["prefill_input_ids"]))
    assert rel_l2(logits, g["prefill_logits"]) <= 1e-5
    assert rel_l2(mtp_logits[0], g["prefill_mtp_logits"]) <= 1e-5
    assert rel_l2(ling_jax.forward(cfg, params, jnp.asarray(g["long_input_ids"])), g["long_logits"]) <= 1e-4


@pytest.mark.heavy  # 20-70 s on 2 cores (default suite kept well under 20 min)
def test_fp8_resident_greedy_decode_matches_golden(resident_f32):
    cfg, params = resident_f32
    g = np.load(FP8_SRC / "golden.npz")
    prompts = g["decode_prompt_ids"].tolist()
    assert ling_jax.generate(cfg, params, prompts, max_new_tokens=16, stop_tokens=()) == \
        g["decode_generated_ids"].tolist()
    cache, logits = prefill_cache(cfg, params, jnp.asarray(g["decode_prompt_ids"]), jnp.full((2,), 12, jnp.int32), 28)
    for s in range(16):
        assert rel_l2(logits, g["decode_step_logits"][:, s]) < 1e-5, f"step {s}"
        if s < 15:
            cache, logits = decode_one(cfg, params, cache, jnp.asarray(g["decode_generated_ids"][:, s]))


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_fp8_resident_bf16_equals_dequantized_at_load(ck):
    """bf16 serving: FP8-resident weights give the logits of weights dequantized to bf16 at load
    (the same float32 product and rounding, done per layer instead of once)."""
    cfg, resident = ling_jax.load_checkpoint(ck, dtype="bfloat16", keep_fp8=True)
    _, dense = ling_jax.load_checkpoint(ck, dtype="bfloat16")
    ids = jnp.asarray(np.load(FP8_SRC / "golden.npz")["prefill_input_ids"])
    a, b = ling_jax.forward(cfg, resident, ids), ling_jax.forward(cfg, dense, ids)
    assert rel_l2(a, b) < 1e-6


@pytest.mark.heavy  # 20-70 s on 2 cores (default suite kept well under 20 min)
def test_cli_fp8_weights(ck, capsys):
    from serve.generate import main

    g = np.load(FP8_SRC / "golden.npz")
    prompt = ",".join(map(str, g["decode_prompt_ids"][0]))
    assert main(["--checkpoint", str(ck), "--fp8-weights", "--prompt-ids", prompt, "--max-new-tokens", "16",
                 "--stop-tokens", "", "--dtype", "float32"]) == 0
    assert f"-> 16 new: {g['decode_generated_ids'][0].tolist()}" in capsys.readouterr().out
    # the same on a data x expert mesh of the 8 simulated devices
    assert main(["--checkpoint", str(ck), "--fp8-weights", "--mesh", "data=2,expert=4", "--prompt-ids", prompt,
                 "--max-new-tokens", "16", "--stop-tokens", "", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert f"-> 16 new: {g['decode_generated_ids'][0].tolist()}" in out and "x 8 (data=2,expert=4)" in out
    assert main(["--checkpoint", str(FP8_SRC), "--fp8-weights", "--prompt-ids", "1"]) == 2
    assert "ling-convert --dtype float8" in capsys.readouterr().err


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_fp8_resident_on_expert_mesh(ck):
    """Restored straight into a data x expert mesh (FP8 values and their scales split along the
    experts): the golden logits, as on one device."""
    mesh = ling_jax.make_mesh(data=2, expert=4)
    cfg, params = ling_jax.load_checkpoint(ck, dtype="float32", keep_fp8=True, mesh=mesh)
    experts = params["segments"][1]["mlp"]["gate_proj"]
    assert is_block_fp8(experts) and len(experts.value.sharding.device_set) == 8
    g = np.load(FP8_SRC / "golden.npz")
    with jax.set_mesh(mesh):
        logits = ling_jax.forward(cfg, params, jnp.asarray(g["prefill_input_ids"]))
    assert rel_l2(logits, g["prefill_logits"]) <= 1e-5

"""The one kernel-selection point (`ling_jax.kernels`) and the backends chosen at lowering (`ops.platform`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ling_jax
from ling_jax import kernels as kern
from ling_jax.config import PALLAS_WIDTHS, ConfigError, LingConfig
from ling_jax.kernels import select, tuned
from ling_jax.model import forward_hidden, lm_head
from ling_jax.ops import attention_pallas, latent_attention_pallas
from ling_jax.ops.kda import decode_layer
from ling_jax.params import init_params
from ling_jax.sharding import make_mesh


@pytest.fixture(scope="module")
def cfg():
    return LingConfig.preset("debug")


def test_auto_on_cpu_runs_the_xla_forms(cfg):
    k = select(cfg, dtype=jnp.bfloat16, decode=True, unroll=True)
    assert (k.kda, k.conv, k.attention, k.moe_small, k.moe_large) == ("chunked", "xla", "xla", "gather", "ragged")
    assert not (k.route or k.decode_kda or k.decode_mla or k.decode_proj or k.expert_stacks or k.sharded)
    assert k.router_precision == "highest" and k.logsumexp == "xla" and k.inference


def test_auto_on_a_gpu_runs_the_kernels(cfg):
    """For a GPU (sm90), "auto" picks every kernel where the config's widths and dtype allow."""
    wide = dataclasses.replace(cfg, qk_rope_head_dim=16)
    k = select(wide, dtype=jnp.bfloat16, decode=True, unroll=True, platform="gpu")
    assert (k.kda, k.conv, k.attention, k.moe_small, k.moe_large) == ("pallas", "pallas", "pallas", "gemv", "aligned")
    assert k.route and k.decode_kda and k.decode_mla and k.decode_proj and k.expert_stacks
    assert k.router_precision == "bf16_x6" and k.logsumexp == "pallas"
    # float32 activations: not the fused attention nor the aligned grouped matmul (16-bit kernels)
    f32 = select(wide, dtype=jnp.float32, platform="gpu")
    assert (f32.attention, f32.moe_large) == ("xla", "ragged")
    assert select(cfg, dtype=jnp.bfloat16, platform="gpu").attention == "xla"  # debug's rope width 8
    assert select(cfg, dtype=jnp.bfloat16, platform="tpu").moe_large == "gmm"
    # the layer kernels only in an unrolled decode step; not the decode kernels outside decode
    assert not select(cfg, dtype=jnp.bfloat16, decode=True, platform="gpu").decode_proj
    assert not select(cfg, dtype=jnp.bfloat16, platform="gpu").decode_kda
    assert not select(dataclasses.replace(cfg, head_dim=24), dtype=jnp.bfloat16, decode=True,
                      platform="gpu").decode_kda  # not a power of two
    assert not select(dataclasses.replace(cfg, decode_impl="xla"), dtype=jnp.bfloat16, decode=True,
                      platform="gpu").decode_mla


def test_named_implementations_win(cfg):
    named = dataclasses.replace(cfg, kda_impl="pallas", moe_impl="gemv", decode_impl="pallas")
    k = select(named, dtype=jnp.float32, decode=True, unroll=True)
    assert (k.kda, k.conv, k.moe_small) == ("pallas", "pallas", "gemv") and k.decode_kda and k.decode_proj
    assert k.moe_for(k.tuning.gather_max_copies) == "gemv"
    assert k.moe_for(k.tuning.gather_max_copies + 1) == select(cfg, dtype=jnp.float32).moe_for(65)  # a decode kernel
    assert k.route_for(1) and not k.route_for(0) and not k.route_for(k.tuning.route_max_tokens + 1)
    assert select(dataclasses.replace(cfg, kda_lower_bound=None), dtype=jnp.bfloat16, platform="gpu").kda == "chunked"
    with pytest.raises(ConfigError, match="attention_impl"):
        dataclasses.replace(cfg, attention_impl="pallas")  # rope width 8: the kernels cannot tile it


def test_a_multi_device_mesh_runs_the_kernels_per_shard(cfg):
    with jax.set_mesh(make_mesh(expert=2)):
        k = select(cfg, dtype=jnp.bfloat16, decode=True, unroll=True, platform="gpu")
    assert k.sharded and k.decode_kda and k.decode_mla  # per shard
    assert not (k.decode_proj or k.expert_stacks) and k.moe_small == "gather" and k.conv == "xla"


def test_widths_agree_with_the_kernels():
    """The config's table of Pallas widths says what each kernel's own `supported` says."""
    for d in (8, 16, 24, 32, 64, 128):
        c = LingConfig.preset("debug", head_dim=d, qk_nope_head_dim=d, qk_rope_head_dim=d, v_head_dim=d,
                              kv_lora_rank=d)
        assert c.pallas_widths("attention") == attention_pallas.supported(d, d, d)
        assert c.pallas_widths("kda") == decode_layer.supported(d, d, 4)
        assert c.pallas_widths("mla") == latent_attention_pallas.supported(d, d, 1024)
    assert set(PALLAS_WIDTHS) == {"mla", "kda", "attention"}


def test_tuned_overrides_reach_the_record(cfg):
    base = select(cfg, dtype=jnp.float32)
    with tuned(gemv_programs=132, prefetch_shared=False):
        k = select(cfg, dtype=jnp.float32)
    assert k.tuning.launch.gemv_programs == 132 and not k.tuning.prefetch_shared
    assert k != base and hash(k) != hash(base)  # a static jit argument: another program
    assert select(cfg, dtype=jnp.float32) == base
    with pytest.raises(ValueError, match="unknown fields"), tuned(gemv_program=1):
        pass
    assert kern.tuning_for("NVIDIA H200") == kern.TUNED["H200"]


@pytest.mark.heavy  # (default suite kept well under 20 min on 2 cores)
def test_tuning_changes_the_compiled_decode(cfg, monkeypatch):
    """A `tuned` value reaches the kernel's launch: the gemv kernel's grid follows `gemv_programs`."""
    from ling_jax.ops import expert_gemv

    seen = []
    real = expert_gemv.output_tile
    monkeypatch.setattr(expert_gemv, "output_tile", lambda m, s, o, p: seen.append(p) or real(m, s, o, p))
    params = init_params(cfg, seed=0)
    pallas = dataclasses.replace(cfg, decode_impl="pallas")
    for programs in (7, 264):
        with tuned(gemv_programs=programs):
            ling_jax.generate(pallas, params, [[1, 2, 3]], max_new_tokens=2)
        assert seen and set(seen) == {programs}
        seen.clear()


def _forward_and_grad(cfg, params, ids):
    """(logits, d loss / d params) of the forward with kda_impl from `cfg` — what `jax.export` lowers."""
    kernels = select(cfg, dtype=jnp.float32)

    def loss(p):
        h = forward_hidden(cfg, p, ids, kernels=kernels)["final"]
        return jnp.sum(lm_head(cfg, p, h) ** 2)

    return jax.value_and_grad(loss)


@pytest.mark.heavy  # suite time
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_export_carries_the_platforms_kernels(platform, h200_lowering):
    """`forward` and its gradient with kda_impl="pallas", traced on this CPU host and exported for a
    TPU or a CUDA GPU, carry that platform's kernels (Mosaic / Triton custom calls), chosen at
    lowering; run here, the same function runs the interpreted kernels."""
    cfg = LingConfig.preset("debug", kda_impl="pallas", head_dim=16)
    params = init_params(cfg, seed=1)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 16)))
    fn = _forward_and_grad(cfg, params, ids)
    if platform == "tpu":  # the Mosaic lowering asks which TPU: a v5p, named by an abstract mesh
        from jax._src.mesh import AbstractDevice

        tpu = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("TPU v5p", 1, "tpu"))
        with jax.sharding.use_abstract_mesh(tpu):
            text = jax.export.export(jax.jit(fn), platforms=["tpu"])(params).mlir_module()
        assert "tpu_custom_call" in text and "xla.gpu.triton" not in text
    else:
        text = h200_lowering(fn, params)
        assert "xla.gpu.triton" in text and "tpu_custom_call" not in text
    value, grads = jax.jit(fn)(params)  # interpreted here: finite, and the same as the chunked path
    want, _ = jax.jit(_forward_and_grad(dataclasses.replace(cfg, kda_impl="chunked"), params, ids))(params)
    assert np.isfinite(float(value)) and abs(float(value) - float(want)) < 1e-3 * abs(float(want))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


_TRACE_CONTEXT = """
import jax, jax.numpy as jnp
from jax._src import config
from ling_jax.cache import init_cache
from ling_jax.config import LingConfig
from ling_jax.decode.step import decode_step
from ling_jax.kernels import select
from ling_jax.model import forward_hidden
from ling_jax.params import init_params

cfg = LingConfig.preset("debug", head_dim=16)
params = init_params(cfg, seed=0, dtype=jnp.bfloat16)
ids = jnp.zeros((1, 16), jnp.int32)
prefill = select(cfg, dtype=jnp.bfloat16, inference=True, platform="gpu")
step = select(cfg, dtype=jnp.bfloat16, decode=True, unroll=True, platform="gpu")
assert prefill.kda == "pallas" and step.decode_kda, (prefill, step)
before = len(config.trace_context())
jax.jit(lambda p, i: forward_hidden(cfg, p, i, kernels=prefill)["final"]).trace(params, ids)
jax.jit(lambda p, c, t: decode_step(cfg, step, p, c, t)).trace(
    params, init_cache(cfg, 1, 32, jnp.bfloat16), jnp.zeros((1,), jnp.int32))
print(len(config.trace_context()) - before)
"""


def test_tracing_the_kernels_registers_no_trace_context_state():
    """In a fresh process, tracing a prefill and a decode step with a GPU's kernels (every platform's
    branch, the TPU's included) adds no state to JAX's trace context. A module imported first while
    tracing that registers one (the Pallas TPU module does) leaves the call's cache key stale: its next
    call compiles again, which a serving loop must never do after its warm-up."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _TRACE_CONTEXT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "0", out.stdout

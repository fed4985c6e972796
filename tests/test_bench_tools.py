"""The benchmark helpers whose output BENCHMARKS.md relies on: FP8-resident random params and the
profile's kernel -> op-path attribution."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from conftest import rel_l2

import ling_jax
from bench.common import random_fp8_params
from bench.profile import hlo_op_paths
from ling_jax.checkpoint.fp8 import BlockFP8, dense_weights, is_block_fp8
from ling_jax.config import LingConfig


def test_random_fp8_params_follow_the_checkpoint_layout():
    """Layer linear weights become BlockFP8 (router, b_proj, embeddings stay dense) and the model
    runs on them exactly as on the same weights dequantized up front."""
    cfg = LingConfig.preset("debug")
    params = random_fp8_params(cfg, jnp.float32)
    fp8 = [x for x in jax.tree.leaves(params, is_leaf=is_block_fp8) if isinstance(x, BlockFP8)]
    assert fp8 and all(x.value.dtype == jnp.float8_e4m3fn for x in fp8)
    seg = params["segments"][-1]
    moe = seg.get("mla", seg)["mlp"]
    assert isinstance(moe["gate_proj"], BlockFP8) and not isinstance(moe["router"], BlockFP8)
    assert not isinstance(params["embed"], BlockFP8) and not isinstance(params["lm_head"], BlockFP8)
    ids = jax.random.randint(jax.random.key(0), (1, 9), 0, cfg.vocab_size)
    dense = dense_weights(params, jnp.float32)
    assert rel_l2(ling_jax.forward(cfg, params, ids), ling_jax.forward(cfg, dense, ids)) < 1e-6


def test_hlo_op_paths_name_the_named_scopes(tmp_path):
    """Compiled instructions map back to the `jax.named_scope` path they came from (a fresh process:
    XLA reads its dump flags once, at start)."""
    code = ("import jax, jax.numpy as jnp\n"
            "def f(x):\n"
            "    with jax.named_scope('outer'), jax.named_scope('inner'):\n"
            "        return jnp.sin(x) * 3.0\n"
            "jax.block_until_ready(jax.jit(f)(jnp.arange(17.0)))\n")
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text",
           "JAX_ENABLE_COMPILATION_CACHE": "false", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    paths = hlo_op_paths(str(tmp_path))
    assert any(p.startswith("outer/inner/") for p in paths.values()), paths

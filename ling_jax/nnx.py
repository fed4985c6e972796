"""`LingForCausalLM`: a Flax NNX module over the functional core.

The module holds the functional param pytree of `ling_jax.params` (nested dicts; `segments` and
`mtp` are lists) in its `params` attribute, with every array leaf wrapped in an `nnx.Param`: the
same arrays, not copies. `functional_params()` gives that pytree back with each Param's current
value, and `__call__` / `generate` / `save_pretrained` hand it to `ling_jax.forward`,
`ling_jax.generate` and `save_hf_checkpoint`, so the module computes exactly what the functional
API computes. `nnx.split` / `nnx.merge`, `nnx.jit`, `nnx.value_and_grad` and
`nnx.Optimizer(model, tx, wrt=nnx.Param)` work on it as on any NNX module; the state's paths are
the pytree's (`("params", "segments", 0, "kda", "attn", "q_proj")`).

Sharding metadata: each Param's `out_sharding` is the sharding table's PartitionSpec of its leaf
on the model's mesh (`ling_jax.sharding.param_spec`; an empty or all-None spec without a mesh),
stored as a tuple of mesh axes per dimension as `nnx.with_partitioning` stores it, so
`nnx.get_partition_spec(nnx.state(model))` returns the specs the arrays are laid out with and
`nnx.get_named_sharding(state, mesh)` their shardings. The arrays are placed when created (the
loaders and `init_params` create each one in its sharding), so the Params are built with
`eager_sharding=False` and Flax never moves them.

Run a sharded model under `with jax.set_mesh(model.mesh)`, as the functional API requires.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.checkpoint.export import save_hf_checkpoint
from ling_jax.checkpoint.fp8 import is_block_fp8
from ling_jax.checkpoint.hf import is_hf_dir, load_hf_checkpoint
from ling_jax.checkpoint.orbax_io import load_checkpoint
from ling_jax.config import LingConfig
from ling_jax.generate import generate
from ling_jax.model import forward
from ling_jax.params import Params, build_tree, get_path, init_params, param_shapes
from ling_jax.sharding import check_mesh, param_sharding, param_spec


def _seed(rngs: nnx.Rngs) -> int:
    """A 64-bit host seed for `init_params` drawn from the `params` stream of `rngs`."""
    key = rngs.params()
    if isinstance(key, jax.core.Tracer):
        raise TypeError("LingForCausalLM: random init draws its values on the host (numpy) and cannot run under "
                        "a trace (nnx.jit, nnx.eval_shape); build the model outside transforms (mesh= creates "
                        "each array in its sharding)")
    hi, lo = (int(x) for x in jax.random.key_data(key).reshape(-1)[-2:])
    return hi << 32 | lo


def _placed(cfg: LingConfig, params: Params, mesh: jax.sharding.Mesh | None) -> Params:
    """`params` checked against the table of `cfg`, each leaf in the table's sharding on `mesh`:
    a leaf already there is kept as is (no copy), another is moved there with `jax.device_put`.
    Without a mesh, leaves must each be on one device."""
    if mesh is not None:
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh (ling_jax.make_mesh builds one), "
                            f"got {type(mesh).__name__}")
        check_mesh(mesh)
    if any(map(is_block_fp8, jax.tree.leaves(params, is_leaf=is_block_fp8))):
        raise ValueError("params hold FP8-resident weights (fp8.BlockFP8), which are not trainable Params: "
                         "load them with a float dtype (load_checkpoint(..., dtype='bfloat16'))")
    want = jax.tree.structure(param_shapes(cfg))
    got = jax.tree.structure(params)
    if got != want:
        raise ValueError(f"params do not have the pytree structure of this config's param table "
                         f"(ling_jax.params.param_shapes): {got.num_leaves} leaves, expected {want.num_leaves}")

    def place(slot: Any) -> jax.Array:
        leaf = get_path(params, slot.path)
        if tuple(leaf.shape) != slot.shape:
            raise ValueError(f"params: {'.'.join(map(str, slot.path))} has shape {tuple(leaf.shape)}, "
                             f"expected {slot.shape}")
        if mesh is None:
            if len(leaf.sharding.device_set) > 1:
                raise ValueError(f"params: {'.'.join(map(str, slot.path))} is spread over "
                                 f"{len(leaf.sharding.device_set)} devices; pass the mesh it was placed on (mesh=)")
            return leaf
        target = param_sharding(cfg, slot, mesh)
        return leaf if leaf.sharding.is_equivalent_to(target, leaf.ndim) else jax.device_put(leaf, target)

    return build_tree(cfg, place)


class LingForCausalLM(nnx.Module):
    """A Ling-3 causal LM as an NNX module (see the module docstring).

    `LingForCausalLM(config, rngs=nnx.Rngs(0))` initialises random params (`ling_jax.params.init_params`,
    seeded from the `params` stream of `rngs`; host numpy, so not under `nnx.jit` / `nnx.eval_shape`)
    in `dtype` (default float32; A_log, dt_bias and expert_bias stay float32), each array created in
    its sharding on `mesh` when one is given. `LingForCausalLM(config, params=params)` wraps an
    existing param pytree of `config` instead (arrays in the table's sharding on `mesh` are kept,
    others moved there); exactly one of `rngs` and `params` is given, and `dtype` only with `rngs`.
    `from_pretrained` loads a checkpoint.
    """

    def __init__(self, config: LingConfig, *, rngs: nnx.Rngs | None = None, params: Params | None = None,
                 dtype: Any = None, mesh: jax.sharding.Mesh | None = None):
        if not isinstance(config, LingConfig):
            raise TypeError(f"config must be a LingConfig, got {type(config).__name__}")
        if (rngs is None) == (params is None):
            raise ValueError("LingForCausalLM: give exactly one of rngs= (random init) and params= (wrap a pytree)")
        if params is None:
            if not isinstance(rngs, nnx.Rngs):
                raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
            params = init_params(config, _seed(rngs), jnp.float32 if dtype is None else dtype, mesh)
        elif dtype is not None:
            raise ValueError("LingForCausalLM: dtype= applies to random init only; cast the params before wrapping")
        else:
            params = _placed(config, params, mesh)
        self.config = config
        self.mesh = mesh
        self.params = nnx.data(build_tree(config, lambda slot: nnx.Param(
            get_path(params, slot.path), eager_sharding=False, out_sharding=tuple(param_spec(config, slot, mesh)))))

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: Any = "float32", mesh: jax.sharding.Mesh | None = None,
                        **config_options: Any) -> LingForCausalLM:
        """Loads an HF checkpoint directory (`config.json` + safetensors, BF16/FP32 or block-FP8:
        `load_hf_checkpoint`) or one of our Orbax checkpoints (`ling-convert`, `ling-train`:
        `load_checkpoint`) with every leaf in `dtype` (FP8 dequantized; A_log, dt_bias and
        expert_bias stay float32), each array created in its sharding on `mesh`. `config_options`
        set runtime fields of `LingConfig` (e.g. `kda_impl="chunked"`). The loaders' errors
        (`CheckpointError`, `ConfigError`) name what is wrong with the directory."""
        if dtype is None or not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            raise ValueError(f"from_pretrained: dtype={dtype!r} must be a float dtype (e.g. 'bfloat16', 'float32')")
        if is_hf_dir(path):
            cfg, params = load_hf_checkpoint(path, dtype=dtype, mesh=mesh, **config_options)
        else:
            cfg, params = load_checkpoint(path, dtype=dtype, mesh=mesh, **config_options)
        return cls(cfg, params=params, mesh=mesh)

    def functional_params(self) -> Params:
        """The functional param pytree (`ling_jax.params` layout) of the Params' current values; the
        arrays themselves, not copies (tracers inside `nnx.jit` / `nnx.grad`)."""
        return jax.tree.map(lambda v: v.get_value(), self.params, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Logits [B, T, V] float32 of `input_ids` [B, T] int: `ling_jax.forward` on `functional_params()`.
        `attention_mask` [B, T] (1 = token, 0 = padding, either side)."""
        return forward(self.config, self.functional_params(), input_ids, attention_mask=attention_mask)

    def generate(self, prompts: Any, **kwargs: Any) -> list[list[int]]:
        """New tokens for each prompt: `ling_jax.generate(config, functional_params(), prompts, **kwargs)`
        (`max_new_tokens`, `temperature`, `top_k`, `top_p`, `seed`, `stop_tokens`, `unroll_layers`)."""
        return generate(self.config, self.functional_params(), prompts, **kwargs)

    def save_pretrained(self, out_dir: str | Path, **kwargs: Any) -> Path:
        """Writes the current params as an HF checkpoint directory (`save_hf_checkpoint`: `dtype`
        default bfloat16, `quantization` for block-FP8, `max_shard_bytes`); returns its path."""
        return save_hf_checkpoint(self.config, self.functional_params(), out_dir, **kwargs)


__all__ = ["LingForCausalLM"]

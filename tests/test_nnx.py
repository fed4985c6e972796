"""`ling_jax.nnx.LingForCausalLM`: the NNX module over the functional core.

Golden logits through `from_pretrained` (HF BF16/FP8 and Orbax), the module holding the very
arrays of the functional pytree, `nnx.split` / `nnx.merge`, `nnx.Optimizer` steps under `nnx.jit`,
and the sharding table's specs as Param metadata on a mesh of the 8 simulated CPU devices.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import GOLDEN, rel_l2
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ling_jax
from ling_jax.checkpoint.fp8 import BlockFP8
from ling_jax.checkpoint.orbax_io import save_checkpoint
from ling_jax.checkpoint.safetensors_io import CheckpointError
from ling_jax.config import LingConfig
from ling_jax.nnx import LingForCausalLM
from ling_jax.params import get_path, init_params, param_slots, set_path
from ling_jax.sharding import param_sharding, param_spec

# KDA, MLA, a dense MLP and MoE layers, no MTP layer (`params["mtp"]` stays an empty list)
SMALL = dict(num_hidden_layers=3, num_nextn_predict_layers=0)


def _leaves(tree):
    return jax.tree.leaves(tree)


def _ids(cfg: LingConfig, shape: tuple[int, int], seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, shape), jnp.int32)


@pytest.fixture(scope="module")
def golden_model():
    return LingForCausalLM.from_pretrained(GOLDEN / "ling3_tiny_a")


@pytest.mark.parametrize("prefix, tol", [("prefill", 1e-5), ("long", 1e-4)])
def test_golden_logits_equal_the_functional_forward(golden_model, golden_a, prefix, tol):
    cfg, params, g = golden_a
    ids = jnp.asarray(g[f"{prefix}_input_ids"])
    logits = golden_model(ids)
    assert rel_l2(logits, g[f"{prefix}_logits"]) < tol
    np.testing.assert_array_equal(logits, ling_jax.forward(cfg, params, ids))
    assert golden_model.config == cfg


def test_golden_fp8_and_masked(golden_fp8):
    """A block-FP8 HF directory (dequantized on load), and `attention_mask` passed through."""
    cfg, params, g = golden_fp8
    model = LingForCausalLM.from_pretrained(GOLDEN / "ling3_tiny_a_fp8")
    ids = jnp.asarray(g["prefill_input_ids"])
    assert rel_l2(model(ids), g["prefill_logits"]) < 1e-5
    mask = jnp.ones_like(ids).at[:, :2].set(0)
    np.testing.assert_array_equal(model(ids, mask), ling_jax.forward(cfg, params, ids, attention_mask=mask))


def test_from_pretrained_orbax_and_bad_input(golden_a, tmp_path):
    """Our Orbax checkpoint loads to the same arrays as the HF directory it was saved from; a bad
    dtype or a directory that is no checkpoint is refused with the loaders' messages."""
    cfg, params, _ = golden_a
    save_checkpoint(tmp_path / "ckpt", cfg, params)
    model = LingForCausalLM.from_pretrained(tmp_path / "ckpt", kda_impl="chunked")
    assert model.config.kda_impl == "chunked"
    for a, b in zip(_leaves(model.functional_params()), _leaves(params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="float dtype"):
        LingForCausalLM.from_pretrained(tmp_path / "ckpt", dtype="int32")
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        LingForCausalLM.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty directory"):
        LingForCausalLM.from_pretrained(tmp_path / "empty")


def test_params_are_the_functional_arrays():
    """Wrapping a pytree keeps its arrays (no copy); the state's paths are the pytree's; random
    init is `init_params` seeded from the Rngs, in the requested dtype."""
    cfg = LingConfig.preset("debug")
    params = init_params(cfg, seed=3)
    model = LingForCausalLM(cfg, params=params)
    got = model.functional_params()
    assert jax.tree.structure(got) == jax.tree.structure(params)
    assert all(a is b for a, b in zip(_leaves(got), _leaves(params), strict=True))
    paths = {path for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Param)}
    assert paths == {("params", *slot.path) for slot in param_slots(cfg)}

    a, b, c = (_leaves(LingForCausalLM(cfg, rngs=nnx.Rngs(s)).functional_params()) for s in (0, 0, 1))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
        assert x.dtype == jnp.float32
    assert any(not np.array_equal(x, z) for x, z in zip(a, c, strict=True))
    bf16 = LingForCausalLM(cfg, rngs=nnx.Rngs(0), dtype="bfloat16").functional_params()
    for slot in param_slots(cfg):
        assert get_path(bf16, slot.path).dtype == (jnp.float32 if slot.leaf.fp32 else jnp.bfloat16), slot.path


def test_bad_construction_is_refused():
    cfg = LingConfig.preset("debug")
    params = init_params(cfg)
    for kw, exc, match in [
        ({}, ValueError, "exactly one of"),
        (dict(rngs=nnx.Rngs(0), params=params), ValueError, "exactly one of"),
        (dict(params=params, dtype="bfloat16"), ValueError, "random init only"),
        (dict(rngs=0), TypeError, "nnx.Rngs"),
        (dict(params=params, mesh={"expert": 8}), TypeError, "jax.sharding.Mesh"),
        (dict(params={**params, "mtp": []}), ValueError, "pytree structure"),
    ]:
        with pytest.raises(exc, match=match):
            LingForCausalLM(cfg, **kw)
    with pytest.raises(TypeError, match="LingConfig"):
        LingForCausalLM(cfg.to_hf(), params=params)
    bad = jax.tree.map(lambda a: a, params)
    set_path(bad, ("embed",), jnp.zeros((3, cfg.hidden_size)))
    with pytest.raises(ValueError, match=r"embed has shape \(3, 64\)"):
        LingForCausalLM(cfg, params=bad)
    fp8 = jax.tree.map(lambda a: a, params)
    w = get_path(params, ("segments", 0, "attn", "q_proj"))
    set_path(fp8, ("segments", 0, "attn", "q_proj"),
             BlockFP8(w.astype(jnp.float8_e4m3fn), jnp.ones((1, 1, 1)), (128, 128)))
    with pytest.raises(ValueError, match="FP8-resident"):
        LingForCausalLM(cfg, params=fp8)
    with pytest.raises(ValueError, match="spread over 8 devices"):
        LingForCausalLM(cfg, params=init_params(cfg, mesh=ling_jax.make_mesh(expert=8)))
    with pytest.raises(TypeError, match="under a trace"):
        nnx.eval_shape(lambda: LingForCausalLM(cfg, rngs=nnx.Rngs(0)))


def test_split_merge_round_trip():
    """`nnx.split` / `nnx.merge` give back a model of the same arrays and logits, and state
    written with `nnx.update` is what the functional pytree then holds."""
    cfg = LingConfig.preset("debug", **SMALL)
    model = LingForCausalLM(cfg, rngs=nnx.Rngs(0))
    ids = _ids(cfg, (2, 8))
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, state)
    assert merged.config == cfg and merged.mesh is None
    assert all(a is b for a, b in zip(_leaves(merged.functional_params()), _leaves(model.functional_params()),
                                      strict=True))
    logits = merged(ids)
    np.testing.assert_array_equal(logits, model(ids))
    before = jax.tree.map(np.asarray, model.functional_params())
    nnx.update(merged, jax.tree.map(lambda x: 2 * x, state))
    for a, b in zip(_leaves(merged.functional_params()), _leaves(before), strict=True):
        np.testing.assert_array_equal(a, 2 * b)
    assert not np.allclose(merged(ids), logits)


def _train_step(model: LingForCausalLM, optimizer: nnx.Optimizer, ids: jax.Array) -> jax.Array:
    def loss_fn(m: LingForCausalLM) -> jax.Array:
        logits = m(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _committed(optimizer: nnx.Optimizer, where: jax.sharding.Sharding) -> None:
    """Commits the optimizer's fresh scalars (step, Adam count) to `where`, as its updated state will
    be: otherwise the second call of a jitted step compiles again for the new placement."""
    state = nnx.state(optimizer)
    nnx.update(optimizer, jax.tree.map(lambda x: x if x.committed else jax.device_put(x, where), state))


def test_optimizer_steps_lower_the_loss():
    cfg = LingConfig.preset("debug", **SMALL)
    model = LingForCausalLM(cfg, rngs=nnx.Rngs(0))
    before = jax.tree.map(np.asarray, model.functional_params())
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    _committed(optimizer, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    step = nnx.jit(_train_step)
    ids = _ids(cfg, (2, 16))
    losses = [float(step(model, optimizer, ids)) for _ in range(4)]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    after = model.functional_params()
    assert jax.tree.structure(after) == jax.tree.structure(before)
    for slot in param_slots(cfg):  # expert_bias moves by the balancing rule of ling-train, not by gradients
        changed = not np.array_equal(get_path(after, slot.path), get_path(before, slot.path))
        assert changed == (slot.path[-1] != "expert_bias"), slot.path
    assert int(optimizer.step.get_value()) == 4


def test_mesh_shardings_are_the_tables():
    """On a data=2 x expert=2 x tensor=2 mesh every Param holds its array in the table's sharding,
    `nnx.get_partition_spec` returns the table's specs, and the logits are the single-device ones."""
    cfg = LingConfig.preset("debug", **SMALL)
    mesh = ling_jax.make_mesh(data=2, expert=2, tensor=2)
    model = LingForCausalLM(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    assert model.mesh is mesh
    state = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(state)
    shardings = nnx.get_named_sharding(state, mesh)
    params = model.functional_params()
    split = 0
    for slot in param_slots(cfg):
        path = ("params", *slot.path)
        want = param_spec(cfg, slot, mesh)
        assert get_path(specs, path).get_value() == want, slot.path
        assert get_path(shardings, path).get_value() == NamedSharding(mesh, want), slot.path
        assert get_path(params, slot.path).sharding == param_sharding(cfg, slot, mesh), slot.path
        split += any(want)
    assert split > len(param_slots(cfg)) // 2
    single = LingForCausalLM(cfg, rngs=nnx.Rngs(0))
    for a, b in zip(_leaves(params), _leaves(single.functional_params()), strict=True):
        np.testing.assert_array_equal(a, b)
    ids = _ids(cfg, (4, 8))
    with jax.set_mesh(mesh):
        logits = model(ids)
    assert rel_l2(logits, single(ids)) < 1e-5
    # the same pytree wrapped on that mesh: arrays in place are kept, others placed
    moved = LingForCausalLM(cfg, params=single.functional_params(), mesh=mesh).functional_params()
    for slot in param_slots(cfg):
        assert get_path(moved, slot.path).sharding == param_sharding(cfg, slot, mesh)
    again = LingForCausalLM(cfg, params=params, mesh=mesh).functional_params()
    assert all(a is b for a, b in zip(_leaves(again), _leaves(params), strict=True))


@pytest.mark.heavy
def test_optimizer_step_under_a_mesh_keeps_the_shardings():
    cfg = LingConfig.preset("debug", **SMALL)
    mesh = ling_jax.make_mesh(data=2, expert=2, tensor=2)
    model = LingForCausalLM(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    _committed(optimizer, NamedSharding(mesh, P()))
    ids = jax.device_put(_ids(cfg, (4, 16)), ling_jax.sharding.batch_sharding(mesh, (4, 16)))
    step = nnx.jit(_train_step)
    with jax.set_mesh(mesh):
        losses = [float(step(model, optimizer, ids)) for _ in range(3)]
    assert losses[2] < losses[1] < losses[0]
    params = model.functional_params()
    for slot in param_slots(cfg):
        leaf = get_path(params, slot.path)
        assert leaf.sharding.is_equivalent_to(param_sharding(cfg, slot, mesh), leaf.ndim), (slot.path, leaf.sharding)


def test_generate_and_save_pretrained(tmp_path):
    """`generate` is `ling_jax.generate` on the module's params; `save_pretrained` writes an HF
    directory that `from_pretrained` reads back to the same arrays."""
    cfg = LingConfig.preset("debug", **SMALL)
    cfg = dataclasses.replace(cfg, kda_impl="chunked")
    model = LingForCausalLM(cfg, rngs=nnx.Rngs(0))
    prompts = [[5, 6, 7], [9, 10]]
    out = model.generate(prompts, max_new_tokens=3, stop_tokens=())
    assert out == ling_jax.generate(cfg, model.functional_params(), prompts, max_new_tokens=3, stop_tokens=())
    assert [len(o) for o in out] == [3, 3]
    path = model.save_pretrained(tmp_path / "hf", dtype="float32")
    back = LingForCausalLM.from_pretrained(path)
    for a, b in zip(_leaves(back.functional_params()), _leaves(model.functional_params()), strict=True):
        np.testing.assert_array_equal(a, b)

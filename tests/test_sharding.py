"""Scale-out: the sharding table, sharded loading, expert-parallel MoE, multi-host (8 simulated CPU devices).

Everything sharded is compared with the single-device path: golden SET A logits and gradients
through several meshes, one MoE layer under skewed and degenerate routing against the dense
reference, the Pallas grouped-matmul kernels (interpret mode) against `jax.lax.ragged_dot`, and a
two-process job against one process.
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, decode_one, prefill_cache, rel_l2
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ling_jax
from ling_jax import distributed, sharding
from ling_jax.cache import cache_bytes
from ling_jax.config import LingConfig
from ling_jax.layers.moe import moe
from ling_jax.ops import moe as moe_ops
from ling_jax.params import layer_params, param_slots

MESHES = {"1x8": dict(expert=8), "2x4": dict(data=2, expert=4), "2x2x2": dict(data=2, expert=2, tensor=2)}
HERE = Path(__file__).resolve().parent


@functools.cache
def sharded_golden(name: str):
    mesh = ling_jax.make_mesh(**MESHES[name])
    cfg, params = ling_jax.load_hf_checkpoint(GOLDEN / "ling3_tiny_a", dtype="float32", mesh=mesh)
    return mesh, cfg, params


# ----------------------------------------------------------------------------- mesh and table


def test_make_mesh():
    mesh = ling_jax.make_mesh()
    assert mesh.axis_names == sharding.AXES and dict(mesh.shape) == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    mesh = ling_jax.make_mesh(data=2, expert=2, tensor=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 2, "tensor": 2} and mesh.size == 8
    assert ling_jax.make_mesh(expert=4).size == 4  # one process: the first 4 devices
    assert ling_jax.make_mesh(devices=jax.devices()[:2]).shape["data"] == 2
    with pytest.raises(ValueError, match="16"):
        ling_jax.make_mesh(data=2, expert=8)
    with pytest.raises(ValueError, match="were given"):
        ling_jax.make_mesh(expert=4, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="tensor"):
        ling_jax.make_mesh(tensor=0)


def test_make_mesh_edge_cases():
    """A size given as 1 means one device (not all of them on data); numpy ints are sizes, bools are
    not; devices may come as an array (flattened), never empty or twice."""
    assert ling_jax.make_mesh(data=1).size == 1 and ling_jax.make_mesh(expert=np.int64(2)).shape["expert"] == 2
    grid = np.asarray(jax.devices()[:4], dtype=object).reshape(2, 2)
    assert ling_jax.make_mesh(data=4, devices=grid).size == 4
    assert ling_jax.make_mesh(devices=(d for d in jax.devices()[:4])).shape["data"] == 4  # any iterable
    for kw, match in [(dict(data=True), "data=True"), (dict(devices=[]), "empty"),
                      (dict(data=2, devices=[jax.devices()[0]] * 2), "more than once")]:
        with pytest.raises(ValueError, match=match):
            ling_jax.make_mesh(**kw)


def test_meshes_the_table_cannot_serve_are_refused():
    """A mesh that is not a Mesh, has an axis of ours misspelt, or has Explicit axes (jax.make_mesh's
    default: the model crashed in the MoE's shard_map after a load that succeeded) is refused with a
    message, at load and under `jax.set_mesh` alike."""
    cfg = LingConfig.preset("debug")
    explicit = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
    typo = jax.make_mesh((8,), ("experts",), axis_types=(AxisType.Auto,))
    for mesh, exc, match in [({"expert": 8}, TypeError, "must be a jax.sharding.Mesh"),
                             (explicit, ValueError, "Explicit"), (typo, ValueError, "'experts': 8")]:
        with pytest.raises(exc, match=match):
            ling_jax.params.init_params(cfg, mesh=mesh)
    params = ling_jax.params.init_params(cfg)
    with jax.set_mesh(explicit), pytest.raises(ValueError, match="Explicit"):
        ling_jax.forward(cfg, params, jnp.ones((2, 4), jnp.int32))
    # what stays allowed: an Explicit axis of size 1, and a caller's shard_map over axes of its own
    with jax.set_mesh(jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])):
        assert sharding.context_mesh() is not None
    own = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("replica",))
    seen = []
    jax.shard_map(lambda x: seen.append(sharding.context_mesh()) or x, mesh=own, in_specs=P("replica"),
                  out_specs=P("replica"))(jnp.ones(2))
    assert seen and seen[0].axis_names == ("replica",)


def test_a_split_through_heads_is_not_made_and_fallbacks_are_reported():
    """tensor=8 over the debug model's 2 heads: the attention leaves stay whole over `tensor` (a split
    inside a head made GSPMD regather the projections), the MLPs still split, and the load warns
    which leaves an axis does not split."""
    cfg = LingConfig.preset("debug")
    mesh = ling_jax.make_mesh(tensor=8)
    assert cfg.num_attention_heads % 8
    with pytest.warns(UserWarning, match=r"tensor=8 does not divide the dims of \d+ param leaves"):
        params = ling_jax.params.init_params(cfg, mesh=mesh)
    seg = params["segments"][0]
    assert all(s is None for s in seg["attn"]["q_proj"].sharding.spec)
    assert "tensor" in seg["mlp"]["gate_proj"].sharding.spec
    assert sharding.dropped_axes(cfg, ling_jax.make_mesh(data=8)) == {}


def test_sharded_params_without_a_mesh_warn():
    """Params loaded onto a mesh, run without `jax.set_mesh`: right results, but the MoE would not
    dispatch experts over `expert`; the call says so (and not under the mesh)."""
    mesh, cfg, params = sharded_golden("2x4")
    ids = jnp.ones((2, 3), jnp.int32)
    with pytest.warns(UserWarning, match="no mesh is set"):
        ling_jax.forward(cfg, params, ids)
    with warnings.catch_warnings(), jax.set_mesh(mesh):
        warnings.simplefilter("error", UserWarning)
        ling_jax.forward(cfg, params, ids)


def test_fit_spec_falls_back_to_replicated():
    sizes = {"data": 2, "fsdp": 4, "expert": 4, "tensor": 5}
    assert sharding.fit_spec((8, 10), ("fsdp", "tensor"), sizes) == P("fsdp", "tensor")
    assert sharding.fit_spec((6, 10), ("fsdp", "tensor"), sizes) == P(None, "tensor")
    assert sharding.fit_spec((3, 8, 7), ("expert", "fsdp", "tensor"), sizes) == P(None, "fsdp", None)
    assert sharding.fit_spec((3, 8, 16, 7), ("expert", "fsdp", "tensor"), sizes) == P(None, "expert", "fsdp", None)
    # tuple entries drop their last axes first until the product divides
    assert sharding.fit_spec((4, 3), (("data", "expert"), None), sizes) == P("data", None)
    assert sharding.fit_spec((16, 3), (("data", "expert"), None), sizes) == P(("data", "expert"), None)
    assert sharding.fit_spec((16,), ("tensor",), {"tensor": 1}) == P(None)  # size-1 axes are not named
    with pytest.raises(ValueError):
        sharding.fit_spec((4,), ("fsdp", "tensor"), sizes)


@pytest.mark.parametrize("preset", ["debug", "ling-3.0-tiny", "ling-3.0-flash", "ling-3.1-flash"])
def test_table_covers_every_param(preset):
    cfg = LingConfig.preset(preset)
    sizes = {"data": 2, "fsdp": 2, "expert": 8, "tensor": 4}
    seen = set()
    for slot in param_slots(cfg):
        spec = sharding.param_spec(cfg, slot, sizes)
        assert len(spec) in (0, len(slot.shape))
        n_stack = len(slot.shape) - len(slot.leaf.shape(cfg))
        assert all(s is None for s in tuple(spec)[:n_stack]), f"{slot.path}: stacked layer axis sharded"
        for dim, ax in zip(slot.shape, spec, strict=False):  # every named axis divides its dim
            names = (ax,) if isinstance(ax, str) else (ax or ())
            assert dim % int(np.prod([sizes[a] for a in names])) == 0
        seen.add((sharding.role_of(slot.path, slot.leaf.experts), tuple(spec)[n_stack:]))
    if preset == "ling-3.1-flash":  # the roles on the real shapes
        assert ("expert_in", ("expert", "fsdp", "tensor")) in seen
        assert ("expert_out", ("expert", "tensor", "fsdp")) in seen
        assert ("in_proj", ("fsdp", "tensor")) in seen and ("out_proj", ("tensor", "fsdp")) in seen
        assert ("lm_head", ("fsdp", "tensor")) in seen and ("embed", ("fsdp", None)) in seen
        assert ("replicated", ()) in seen
    with pytest.raises(KeyError, match="NAME_ROLES"):
        sharding.role_of(("attn", "new_proj"))


def test_load_hf_checkpoint_creates_sharded_arrays(golden_a):
    mesh, cfg, params = sharded_golden("2x2x2")
    _, ref, _ = golden_a
    n_split = 0
    for slot in param_slots(cfg):
        arr = params
        for k in slot.path:
            arr = arr[k]
        want = NamedSharding(mesh, sharding.param_spec(cfg, slot, mesh))
        assert arr.sharding == want, slot.path
        assert arr.sharding.is_equivalent_to(want, arr.ndim)
        if any(s is not None for s in want.spec):
            n_split += 1
            for shard in arr.addressable_shards:
                assert shard.data.shape != arr.shape, f"{slot.path}: a device holds the whole leaf"
                assert shard.data.size * 2 <= arr.size
        want_vals = ref
        for k in slot.path:
            want_vals = want_vals[k]
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(want_vals))
    assert n_split > 50


# ----------------------------------------------------------------------------- model through meshes


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n == "1x8" else n for n in MESHES])
def test_golden_logits_through_mesh(golden_a, name):
    cfg, params, g = golden_a
    ids = jnp.asarray(g["prefill_input_ids"])
    single = ling_jax.forward(cfg, params, ids)
    mesh, _, sparams = sharded_golden(name)
    with jax.set_mesh(mesh):
        logits = ling_jax.forward(cfg, sparams, ids)
    assert len(logits.sharding.device_set) == 8
    assert rel_l2(logits, single) <= 1e-5
    assert rel_l2(logits, g["prefill_logits"]) <= 1e-5


@functools.cache
def single_step():
    from sharding_worker import step

    cfg, params = ling_jax.load_hf_checkpoint(GOLDEN / "ling3_tiny_a", dtype="float32")
    ids = jnp.asarray(np.load(GOLDEN / "ling3_tiny_a" / "golden.npz")["prefill_input_ids"])
    return jax.device_get(step(cfg, params, ids))


def assert_grads_match(grads, ref, tol=1e-5):
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref))
    for path, gr in jax.tree_util.tree_leaves_with_path(grads):
        want = np.asarray(flat_ref[path], np.float64)
        if np.linalg.norm(want) == 0:  # expert_bias: selection only, no gradient
            assert np.abs(np.asarray(gr)).max() == 0, jax.tree_util.keystr(path)
        else:
            assert rel_l2(gr, want) <= tol, jax.tree_util.keystr(path)


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(MESHES))
def test_golden_grads_through_mesh(name):
    from sharding_worker import step

    ref = single_step()
    mesh, cfg, sparams = sharded_golden(name)
    ids = jnp.asarray(np.load(GOLDEN / "ling3_tiny_a" / "golden.npz")["prefill_input_ids"])
    with jax.set_mesh(mesh):
        out = step(cfg, sparams, ids)
    assert abs(float(out["loss"]) - float(ref["loss"])) <= 1e-5 * abs(float(ref["loss"]))
    assert rel_l2(out["logits"], ref["logits"]) <= 1e-5
    assert_grads_match(out["grads"], ref["grads"])
    assert abs(float(out["loss_after"]) - float(ref["loss_after"])) <= 1e-5 * abs(float(ref["loss_after"]))


@pytest.mark.heavy
def test_generate_through_mesh(golden_a):
    """Prefill + decode loop under a data x expert mesh: the golden greedy tokens (decode pads B=2 tokens to 8)."""
    _, _, g = golden_a
    mesh, cfg, sparams = sharded_golden("2x4")
    prompts = [list(map(int, r)) for r in g["decode_prompt_ids"]]
    with jax.set_mesh(mesh):
        out = ling_jax.generate(cfg, sparams, prompts, max_new_tokens=g["decode_generated_ids"].shape[1])
    assert out == g["decode_generated_ids"].tolist()


def _golden_steps_under_mesh(g, **overrides):
    """Prefill + 3 teacher-forced golden decode steps under the 2x2x2 mesh, each step's logits checked
    against the reference's: (mesh, cfg, sharded params, the cache after the steps)."""
    mesh, cfg, sparams = sharded_golden("2x2x2")
    cfg = dataclasses.replace(cfg, **overrides)
    prompt = jnp.asarray(g["decode_prompt_ids"])
    with jax.set_mesh(mesh):
        cache, logits = prefill_cache(cfg, sparams, prompt, jnp.full((2,), prompt.shape[1], jnp.int32), 28)
        for s in range(3):
            assert rel_l2(logits, g["decode_step_logits"][:, s]) < 1e-5, s
            cache, logits = decode_one(cfg, sparams, cache, jnp.asarray(g["decode_generated_ids"][:, s]))
        assert rel_l2(logits, g["decode_step_logits"][:, 3]) < 1e-5
    return mesh, cfg, sparams, cache


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_decode_caches_follow_the_table(golden_a):
    """Prefill and decode steps under a data x expert x tensor mesh lay every cache leaf out by its
    role (rows over the token axes, KDA heads over tensor); the teacher-forced step logits stay golden."""
    from ling_jax.cache import ROLES, init_cache

    _, _, g = golden_a
    mesh, cfg, sparams, cache = _golden_steps_under_mesh(g)
    forced = g["decode_generated_ids"]
    with jax.set_mesh(mesh):
        # a cache given replicated (here: empty) comes out of a step laid out by the table too
        fresh, _ = decode_one(cfg, sparams, jax.device_put(init_cache(cfg, 2, 28, jnp.float32),
                                                           NamedSharding(mesh, P())), jnp.asarray(forced[:, 0]))
    for c in (cache, fresh):
        leaves = jax.tree_util.tree_leaves_with_path(c["segments"])
        assert {p[-1].key for p, _ in leaves} == {"state", "conv", "latent"}  # a contiguous cache: no page pool
        for path, x in leaves:
            want = NamedSharding(mesh, sharding.spec(ROLES[path[-1].key], x.shape, mesh))
            assert x.sharding.is_equivalent_to(want, x.ndim), (path, x.sharding.spec, want.spec)
    state = next(x for p, x in leaves if p[-1].key == "state")
    spec = tuple(state.sharding.spec) + (None,) * (state.ndim - len(state.sharding.spec))
    assert spec[-4:] == ("data", "tensor", None, None)  # B=2 over data, the 4 heads over tensor


# ----------------------------------------------------------------------------- one MoE layer


def place_moe_params(p: dict, mesh) -> dict:
    """One MoE layer's params placed by the table (as load_hf_checkpoint would)."""
    out = {}
    for name, a in p.items():
        role = sharding.role_of(("mlp", name), experts=name in sharding.EXPERT_ROLES and a.ndim == 3)
        out[name] = jax.device_put(a, NamedSharding(mesh, sharding.spec(role, a.shape, mesh)))
    return out


@functools.partial(jax.jit, static_argnames=("cfg",))
def moe_out_and_grads(p, x, r, *, cfg):
    """(y, aux, d<y, r>/d(p, x)) of one MoE layer with routed clamp 0.7."""
    def f(p, x):
        y, aux = moe(p, x, cfg=cfg, limit=0.7)
        return jnp.sum(y * r), (y, aux)

    (_, (y, aux)), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(p, x)
    return y, aux, grads


LAYER_MESHES = {"1x8": dict(expert=8), "fsdp2x2x2": dict(fsdp=2, expert=2, tensor=2), "2x4": dict(data=2, expert=4)}


@pytest.mark.parametrize("case", ["plain", "skewed", "all_same"])
@pytest.mark.parametrize("name", ["1x8", pytest.param("fsdp2x2x2", marks=pytest.mark.heavy),
                                  pytest.param("2x4", marks=pytest.mark.heavy)])
def test_moe_layer_expert_parallel_equals_dense(golden_a, name, case):
    cfg, params, _ = golden_a
    p = dict(layer_params(cfg, params, 1)["mlp"])
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    bias = np.zeros(e, np.float32)
    if case == "skewed":  # most copies go to 5 experts, 4 of them on one device of the 1x8 mesh
        bias[[4, 5, 6, 7, 9]] = 0.35
    elif case == "all_same":  # every token picks experts 0..3 (group 0): one device gets every copy
        bias[:k] = 100.0
    p["expert_bias"] = jnp.asarray(bias)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 13, cfg.hidden_size)), jnp.float32)  # 39 tokens: padded to 40
    r = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    dense_cfg = LingConfig.from_hf(GOLDEN / "ling3_tiny_a", moe_impl="dense")
    y_ref, aux_ref, (gp_ref, gx_ref) = moe_out_and_grads(p, x, r, cfg=dense_cfg)
    counts = np.asarray(aux_ref["expert_counts"])
    assert counts.sum() == 39 * k
    if case == "all_same":
        np.testing.assert_array_equal(counts, [39] * k + [0] * (e - k))
    elif case == "skewed":
        assert counts[[4, 5, 6, 7, 9]].sum() >= 0.6 * 39 * k

    mesh = ling_jax.make_mesh(**LAYER_MESHES[name])
    with jax.set_mesh(mesh):
        y, aux, (gp, gx) = moe_out_and_grads(place_moe_params(p, mesh), x, r, cfg=cfg)
    assert rel_l2(y, y_ref) <= 1e-5
    np.testing.assert_array_equal(aux["topk_idx"], aux_ref["topk_idx"])
    np.testing.assert_array_equal(aux["expert_counts"], counts)
    assert rel_l2(gx, gx_ref) <= 1e-5
    for n in gp_ref:
        if n != "expert_bias":
            assert rel_l2(gp[n], gp_ref[n]) <= 1e-5, n
    # no token dropped: every token's routed part (the output minus the shared expert) is there
    routed = moe_ops.routed_experts(x.reshape(-1, x.shape[-1]), aux_ref["topk_idx"], aux_ref["topk_weight"],
                                    p["gate_proj"], p["up_proj"], p["down_proj"], limit=0.7, impl="dense")
    shared = np.asarray(y_ref).reshape(39, -1) - np.asarray(routed)
    assert np.all(np.abs(np.asarray(y).reshape(39, -1) - shared).max(-1) > 1e-3)


def test_moe_layer_indivisible_experts_and_bf16():
    """12 experts on expert=8 (experts replicated: no exchange) and width 20 on tensor=2, in bf16."""
    cfg = LingConfig.preset("debug", num_experts=12, n_group=4, topk_group=2, num_experts_per_tok=3,
                            moe_intermediate_size=20, hidden_size=64)
    rng = np.random.default_rng(3)
    e, d, i = 12, 64, 20
    p = {"router": rng.standard_normal((d, e)) * 0.3, "expert_bias": np.zeros(e),
         "gate_proj": rng.standard_normal((e, d, i)) * 0.1, "up_proj": rng.standard_normal((e, d, i)) * 0.1,
         "down_proj": rng.standard_normal((e, i, d)) * 0.1, "shared_gate_proj": rng.standard_normal((d, 32)) * 0.1,
         "shared_up_proj": rng.standard_normal((d, 32)) * 0.1, "shared_down_proj": rng.standard_normal((32, d)) * 0.1}
    p = {n: jnp.asarray(a, jnp.float32) for n, a in p.items()}
    x = jnp.asarray(rng.standard_normal((2, 9, d)), jnp.float32)
    fwd = jax.jit(lambda p, x: moe(p, x, cfg=cfg)[0])
    y_ref = fwd(p, x)
    for sizes in (dict(expert=8), dict(expert=2, tensor=2, data=2)):
        mesh = ling_jax.make_mesh(**sizes)
        assert sharding.spec("expert_in", p["gate_proj"].shape, mesh)[0] in (None, "expert")
        with jax.set_mesh(mesh):
            y = fwd(place_moe_params(p, mesh), x)
            yb = fwd(place_moe_params(jax.tree.map(lambda a: a.astype(jnp.bfloat16), p), mesh), x.astype(jnp.bfloat16))
        assert rel_l2(y, y_ref) <= 1e-5
        assert yb.dtype == jnp.bfloat16 and rel_l2(yb, y_ref) <= 2e-2


def test_moe_gemv_impl_under_a_mesh():
    """moe_impl="gemv" at decode size (the one-device Pallas kernel) under a mesh: the expert-parallel
    shards run the gather path instead, and the layer equals the one-device gemv result."""
    cfg = LingConfig.preset("debug", moe_impl="gemv")
    rng = np.random.default_rng(4)
    e, d, i, sh = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    shapes = {"router": (d, e), "gate_proj": (e, d, i), "up_proj": (e, d, i), "down_proj": (e, i, d),
              "shared_gate_proj": (d, sh), "shared_up_proj": (d, sh), "shared_down_proj": (sh, d)}
    p = {n: jnp.asarray(rng.standard_normal(s) * 0.2, jnp.float32) for n, s in shapes.items()}
    p["expert_bias"] = jnp.zeros(e)
    x = jnp.asarray(rng.standard_normal((2, 3, d)), jnp.float32)  # 6 tokens x k copies: decode-sized
    fwd = jax.jit(lambda p, x: moe(p, x, cfg=cfg)[0])
    y_ref = fwd(p, x)
    mesh = ling_jax.make_mesh(data=2, expert=4)
    with jax.set_mesh(mesh):
        y = fwd(place_moe_params(p, mesh), x)
    assert rel_l2(y, y_ref) <= 1e-5


# ----------------------------------------------------------------------------- grouped-matmul kernels


@pytest.mark.parametrize("kernel", ["mgpu", "gmm"])
def test_kernel_ragged_dot_matches_ragged_dot(kernel, mgpu_dw_on_cpu):
    """Forward, dX and dW of the Pallas grouped matmul (interpret mode) = jax.lax.ragged_dot's, including an
    empty group and rows past sum(group_sizes)."""
    dt = jnp.bfloat16 if kernel == "mgpu" else jnp.float32  # wgmma takes 16-bit inputs
    rng = np.random.default_rng(5)
    m, kd, n = 150, 96, 40
    x = jnp.asarray(rng.standard_normal((m, kd)), dt)
    w = jnp.asarray(rng.standard_normal((4, kd, n)) * 0.1, dt)
    gs = jnp.array([37, 0, 70, 23], jnp.int32)  # 130 < 150 rows
    r = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

    def loss(fn, x, w):
        y = fn(x, w)
        return jnp.sum(y.astype(jnp.float32) * r), y

    ref_fn = lambda x, w: jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), gs)  # noqa: E731
    ker_fn = lambda x, w: moe_ops.grouped_matmul(x, w, gs, impl=kernel)  # noqa: E731
    (_, y_ref), (dx_ref, dw_ref) = jax.value_and_grad(functools.partial(loss, ref_fn), (0, 1), has_aux=True)(x, w)
    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(functools.partial(loss, ker_fn), (0, 1), has_aux=True))(x, w)
    tol = 1e-2 if dt == jnp.bfloat16 else 1e-5
    assert y.dtype == dt and dx.dtype == dt and dw.dtype == dt
    assert rel_l2(y, y_ref) <= tol and rel_l2(dx, dx_ref) <= tol and rel_l2(dw, dw_ref) <= tol
    assert np.all(np.asarray(y[130:]) == 0) and np.all(np.asarray(dx[130:]) == 0)
    assert np.all(np.asarray(dw[1]) == 0)


@pytest.mark.heavy
@pytest.mark.parametrize("kernel", ["mgpu", "gmm"])
def test_routed_experts_kernels_equal_dense(kernel, mgpu_dw_on_cpu):
    rng = np.random.default_rng(6)
    n, d, e, i, k = 24, 64, 4, 64, 2
    dt = jnp.float32 if kernel == "gmm" else jnp.bfloat16  # wgmma takes 16-bit inputs
    x = jnp.asarray(rng.standard_normal((n, d)), dt)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.2, dt) for s in ((e, d, i), (e, d, i), (e, i, d))]
    idx = jnp.asarray(np.tile([1, 3], (n, 1)), jnp.int32)  # skew: experts 0 and 2 get nothing
    w = jnp.asarray(rng.random((n, k)), jnp.float32)

    def f(impl, x, *ws):
        return jnp.sum(moe_ops.routed_experts(x, idx, w, *ws, impl=impl, limit=0.5).astype(jnp.float32) ** 2)

    def g(impl, x, *ws):  # one device's share (experts 2, 3): half the copies are not computed
        local = [a[2:] for a in ws]
        return jnp.sum(moe_ops.routed_partial(x, idx, w, 2, *local, impl=impl, limit=0.5) ** 2)

    tol = 3e-2 if dt == jnp.bfloat16 else 1e-5
    for fn in (f, g):
        ref = jax.value_and_grad(functools.partial(fn, "dense"), argnums=(0, 1, 2, 3))(x, *ws)
        got = jax.jit(jax.value_and_grad(functools.partial(fn, kernel), argnums=(0, 1, 2, 3)))(x, *ws)
        assert abs(float(got[0]) - float(ref[0])) <= tol * abs(float(ref[0]))
        for a, b in zip(got[1], ref[1], strict=True):
            assert rel_l2(a.astype(jnp.float32), b.astype(jnp.float32)) <= tol


# ----------------------------------------------------------------------------- multi-host


def test_distributed_single_process(monkeypatch):
    for var in (distributed.ENV_ADDRESS, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(var, raising=False)
    assert distributed.initialize(auto_detect=False) is False
    assert distributed.initialize("localhost:1", 1, 0) is False  # one process: nothing to join
    with pytest.raises(ValueError, match="coordinator"):
        distributed.initialize(num_processes=2, process_id=0, auto_detect=False)
    with pytest.raises(ValueError, match="num_processes"):
        distributed.initialize("localhost:1", auto_detect=False)
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="integer"):
        distributed.initialize(auto_detect=False)

    mesh = ling_jax.make_mesh(data=2, expert=4)
    batch = {"ids": np.arange(8 * 5).reshape(8, 5), "mask": np.ones((8, 5), np.int32)}
    arrays = distributed.global_batch(batch, mesh)
    assert arrays["ids"].sharding.spec == P(("data", "expert"), None)
    np.testing.assert_array_equal(np.asarray(arrays["ids"]), batch["ids"])
    assert distributed.local_rows(arrays["ids"].sharding, (8, 5)) == slice(0, 8)
    odd = distributed.global_batch(np.arange(6), mesh)  # 6 rows: only `data` divides
    assert odd.sharding.spec == P("data")
    with pytest.raises(ValueError, match="rows"):
        distributed.global_batch(np.arange(6), mesh, global_batch_size=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.heavy
def test_two_processes_match_one(tmp_path):
    """2 processes x 4 CPU devices (gloo): sharded forward, grads and an SGD step = one process."""
    out, port = tmp_path / "two.npz", _free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "sharding_worker.py"), str(i), str(port), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    got = dict(np.load(out))
    ref = single_step()
    np.testing.assert_array_equal(got["rows"], [0, 1])  # process 0 fed batch row 0 only
    assert rel_l2(got["logits"], ref["logits"]) <= 1e-5
    assert abs(float(got["loss"]) - float(ref["loss"])) <= 1e-5 * abs(float(ref["loss"]))
    assert abs(float(got["loss_after"]) - float(ref["loss_after"])) <= 1e-5 * abs(float(ref["loss_after"]))
    from sharding_worker import flat_grads

    ref_grads = flat_grads(ref["grads"])
    assert set(ref_grads) <= set(got)
    for name, want in ref_grads.items():
        if np.linalg.norm(want) == 0:
            assert np.abs(got[name]).max() == 0, name
        else:
            assert rel_l2(got[name], want) <= 1e-5, name


# ----------------------------------------------------------------------------- memory plan


def test_memory_plan_divides_params_by_the_table():
    from ling_jax import memory

    cfg = LingConfig.preset("ling-3.1-flash")
    n = memory.param_count(cfg)
    assert memory.param_bytes(cfg, {}, lambda s: 4.0) == 4.0 * n  # one device holds everything
    # experts: [.., E, D, I] split 8 ways over `expert`; FP8 = 1 byte + a fp32 scale per 128x128 block
    e_params = sum(int(np.prod(s.shape)) for s in param_slots(cfg) if s.leaf.experts)
    got = memory.param_bytes(cfg, {"expert": 8}, memory.fp8_bytes(cfg), lambda s: s.leaf.experts)
    assert got == pytest.approx(e_params / 8 * (1 + 4 / 128**2), rel=1e-12)
    # tensor=8 splits the KDA projections too; the MLA latent cache is not split by heads
    ep = memory.plan_inference(cfg, {"expert": 8}, batch=64, context=1024, hbm_gb=141)
    tp = memory.plan_inference(cfg, {"tensor": 8}, batch=64, context=1024, hbm_gb=141)
    rows_ep, rows_tp = ({r[0]: r[1] for r in p.rows} for p in (ep, tp))
    assert rows_tp["other weights"] < rows_ep["other weights"] / 3
    assert rows_tp["MLA latent cache"] == pytest.approx(8 * rows_ep["MLA latent cache"])
    # the caches are those decoding allocates (main layers, not the MTP layer): one device holds them all
    one = {r[0]: r[1] for r in memory.plan_inference(cfg, {}, batch=64, context=1024, hbm_gb=141).rows}
    sizes_B = cache_bytes(cfg, batch=64, max_len=1024)
    assert one["MLA latent cache"] == sizes_B["mla_latent"]
    assert one["KDA state cache"] == sizes_B["kda_state"] + sizes_B["kda_conv"]
    assert ep.total == pytest.approx(sum(rows_ep.values()))
    # the fused MLA attention (H200 plans) holds no [H, T, T] scores: linear, not quadratic, in T
    sizes = {a: 1 for a in memory.AXES}
    fused = [memory.mla_buffers(cfg, sizes, 1, t, fused=True) for t in (4096, 8192)]
    assert fused[1] == pytest.approx(2 * fused[0]) and fused[1] < memory.mla_buffers(cfg, sizes, 1, 8192) / 20
    ep_fused = memory.plan_inference(cfg, {"expert": 8}, batch=64, context=1024, hbm_gb=141, fused_attention=True)
    assert ep_fused.total < ep.total
    train = memory.plan_training(LingConfig.preset("ling-3.0-tiny"), {"fsdp": 8}, batch=16, seq_len=4096, hbm_gb=141)
    master = dict((r[0], r[1]) for r in train.rows)["fp32 master params"]
    assert master == pytest.approx(4 * memory.param_count(LingConfig.preset("ling-3.0-tiny")) / 8, rel=0.01)
    assert "fits" in train.markdown()


@pytest.mark.heavy
def test_pallas_decode_kernels_under_a_mesh(golden_a):
    """decode_impl="pallas" (latent attention, KDA step; interpret mode here) runs per shard under a
    data x expert x tensor mesh (`sharding.per_shard`): the teacher-forced step logits stay golden and
    the caches keep the table's layout."""
    from ling_jax.cache import ROLES

    _, _, g = golden_a
    mesh, cfg, sparams, cache = _golden_steps_under_mesh(g, decode_impl="pallas")
    for path, x in jax.tree_util.tree_leaves_with_path(cache["segments"]):
        want = NamedSharding(mesh, sharding.spec(ROLES[path[-1].key], x.shape, mesh))
        assert x.sharding.is_equivalent_to(want, x.ndim), (path, x.sharding.spec, want.spec)
    # rows of different lengths (each shard must see its own rows' lengths): equal to the XLA step
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)))
    lengths, nxt = jnp.asarray([9, 4], jnp.int32), jnp.asarray(rng.integers(0, cfg.vocab_size, (2,)))
    out = {}
    with jax.set_mesh(mesh):
        for impl in ("xla", "pallas"):
            c = dataclasses.replace(cfg, decode_impl=impl)
            cache, _ = prefill_cache(c, sparams, ids, lengths, 28)
            out[impl] = decode_one(c, sparams, cache, nxt)[1]
    assert rel_l2(out["pallas"], out["xla"]) < 1e-5


@pytest.mark.heavy
def test_pallas_kernels_under_a_mesh(golden_a):
    """The Pallas KDA and fused MLA attention kernels (interpret mode here) run per shard under a data x
    expert x tensor mesh (each wrapped in a shard_map: batch rows over the token axes, heads over tensor)."""
    cfg, _, g = golden_a
    cfg = dataclasses.replace(cfg, kda_impl="pallas", attention_impl="pallas")
    ids = jnp.asarray(g["prefill_input_ids"])
    mesh, _, sparams = sharded_golden("2x2x2")
    with jax.set_mesh(mesh):
        logits = ling_jax.forward(cfg, sparams, ids)
    assert rel_l2(logits, g["prefill_logits"]) <= 1e-5

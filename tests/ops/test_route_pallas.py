"""The fused expert-selection kernel (`ops.route_pallas`, interpret mode) against `layers.moe.route`'s XLA form:
the same experts in the same order (ties included), the same weights and the same gradient."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.config import LingConfig
from ling_jax.decode.layers import route as decode_route
from ling_jax.kernels import select
from ling_jax.layers.moe import route
from ling_jax.ops.l2_prefetch import Prefetch
from ling_jax.ops.layer_gemv import WeightStack
from ling_jax.ops.route_pallas import select_experts

CASES = [  # (tokens, experts, groups, groups kept, k): Ling-3.0-tiny's, flash's, and awkward ones
    (1, 128, 8, 4, 8),
    (37, 128, 8, 4, 8),
    (3, 512, 8, 4, 8),
    (21, 64, 4, 2, 6),  # k not a power of two
    (5, 48, 4, 3, 5),  # experts not a power of two: padded in the kernel
    (9, 16, 8, 8, 1),  # groups of two, every group kept, one expert: no renormalisation
    (4, 96, 6, 4, 7),  # groups not a power of two: padded to 8 empty rows in the kernel
]


def _configs(e, g, tg, k):
    cfg = dataclasses.replace(LingConfig.preset("debug"), num_experts=e, n_group=g, topk_group=tg,
                              num_experts_per_tok=k, routed_scaling_factor=2.5)
    return dataclasses.replace(cfg, decode_impl="xla"), dataclasses.replace(cfg, decode_impl="pallas")


def _route(cfg, n):
    """Whether `route` runs the selection kernel on n tokens (CPU: interpret mode)."""
    return select(cfg, dtype=jnp.float32).route_for(n)


def _inputs(rng, n, e, ties):
    x = rng.standard_normal((n, 32))
    w = rng.standard_normal((32, e)) * 0.3
    if ties:  # logits on a coarse grid: many exact ties between experts and between groups
        w = np.eye(32, e) if e <= 32 else np.concatenate([np.eye(32)] * (e // 32) + [np.eye(32, e % 32)], 1)
        x = np.round(rng.standard_normal((n, 32)) * 2) / 2
    bias = rng.standard_normal(e) * 0.1 if not ties else np.round(rng.standard_normal(e)) * 0.25
    return (jnp.asarray(a, jnp.float32) for a in (x, w, bias))


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("n,e,g,tg,k", CASES)
def test_kernel_selects_what_the_xla_form_selects(n, e, g, tg, k, ties):
    xla, pallas = _configs(e, g, tg, k)
    x, w, bias = _inputs(np.random.default_rng(n * e + ties), n, e, ties)
    assert _route(pallas, n) and not _route(xla, n)
    idx_x, w_x, logits_x = route(x, w, bias, xla)
    idx_p, w_p, logits_p = route(x, w, bias, pallas)
    np.testing.assert_array_equal(logits_p, logits_x)
    assert idx_p.dtype == jnp.int32 and idx_p.shape == (n, k)
    np.testing.assert_array_equal(idx_p, idx_x)  # same experts in the same (descending, lowest-index) order
    np.testing.assert_allclose(w_p, w_x, rtol=1e-6, atol=1e-7)
    assert len(np.unique(np.asarray(idx_p), axis=1)[0]) == k  # k distinct experts


@pytest.mark.parametrize("layer", [np.int32(1), jnp.int32(2)], ids=["constant_layer", "traced_layer"])
@pytest.mark.parametrize("n,e,g,tg,k", [CASES[0], CASES[2], CASES[4]])
def test_decode_form_reads_router_and_bias_from_their_stacks(n, e, g, tg, k, layer):
    """The batch-1 decode step's form: the router matmul in the gemv kernel (its partial sums added
    by the selection kernel) and the bias read in place from its [L, E] stack (padded E: sliced)."""
    xla, pallas = _configs(e, g, tg, k)
    assert pallas.routed_scaling_factor == 2.5
    rng = np.random.default_rng(e + k)
    x = jnp.asarray(rng.standard_normal((n, 32)), jnp.float32)
    w_LDE = jnp.asarray(rng.standard_normal((3, 32, e)) * 0.3, jnp.float32)
    bias_LE = jnp.asarray(rng.standard_normal((3, e)) * 0.1, jnp.float32)
    run = jax.jit(lambda x, w, b: decode_route(x, WeightStack(w, layer), WeightStack(b, layer), pallas,
                                              select(pallas, dtype=jnp.float32, decode=True)))
    idx_p, w_p, logits_p = run(x, w_LDE, bias_LE)
    logits64 = np.asarray(x, np.float64) @ np.asarray(w_LDE[int(layer)], np.float64)
    np.testing.assert_allclose(logits_p, logits64, rtol=1e-5, atol=1e-6)  # float32 products, float32 sums
    # the selection from the same logits as one array and the bias as a plain [E] vector
    idx_x, w_x = select_experts(logits_p, bias_LE[int(layer)], n_group=g, topk_group=tg, k=k, scale=2.5)
    np.testing.assert_array_equal(idx_p, idx_x)
    np.testing.assert_allclose(w_p, w_x, rtol=1e-6, atol=1e-7)
    idx_s, w_s, _ = decode_route(x, w_LDE[int(layer)], WeightStack(bias_LE, layer), xla,
                                 select(xla, dtype=jnp.float32, decode=True))  # the XLA form slices it
    idx_r, w_r, _ = route(x, w_LDE[int(layer)], bias_LE[int(layer)], xla)
    np.testing.assert_array_equal(idx_s, idx_r)
    np.testing.assert_array_equal(w_s, w_r)


def test_decode_form_with_prefetch_selects_the_same():
    """The decode form's launch with prefetch programs (the stacked shared expert's slabs, as the MoE
    passes them) selects what it selects without them; the tensor-shaped form refuses them."""
    n, e, g, tg, k = CASES[0]
    rng = np.random.default_rng(7)
    parts = jnp.asarray(rng.standard_normal((4, n, e)), jnp.float32)
    bias = WeightStack(jnp.asarray(rng.standard_normal((3, e)) * 0.1, jnp.float32), np.int32(1))
    gate_up = jnp.asarray(rng.standard_normal((3, 1, 64, 128)), jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((3, 1, 64, 64)), jnp.bfloat16)
    kw = dict(n_group=g, topk_group=tg, k=k, scale=2.5)
    want = select_experts(parts, bias, **kw)
    got = jax.jit(lambda parts, gu, d, layer: select_experts(
        parts, bias, prefetch=(Prefetch(gu, (layer, 0)), Prefetch(d, (layer, 0))), **kw))(parts, gate_up, down, 2)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="prefetch is for a decode step"):
        select_experts(parts[0], bias.value(), prefetch=(Prefetch(gate_up, (0, 0)),), **kw)


def test_nan_scores_still_choose_real_experts():
    """A NaN router logit (a broken model) must not send the gemv kernel past the expert stack:
    NaN scores rank last, so every index stays in [0, E) (E padded to a power of two here)."""
    _, pallas = _configs(48, 4, 3, 5)
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((4, 48)), jnp.float32)
    logits = logits.at[0, 3].set(jnp.nan).at[1].set(jnp.nan)  # one NaN, and a row of NaNs
    idx, _ = select_experts(logits, jnp.zeros(48), n_group=4, topk_group=3, k=5, scale=1.0)
    assert int(idx.min()) >= 0 and int(idx.max()) < 48
    row = np.asarray(idx[0]).tolist()  # one NaN: the row still routes to 5 distinct finite experts
    assert len(set(row)) == 5 and 3 not in row


def test_kernel_gradient_equals_the_xla_forms():
    n, e, g, tg, k = 6, 64, 4, 2, 6
    xla, pallas = _configs(e, g, tg, k)
    x, w, bias = _inputs(np.random.default_rng(3), n, e, False)
    ct = jnp.asarray(np.random.default_rng(4).standard_normal((n, k)), jnp.float32)

    def loss(cfg):
        return jax.grad(lambda x, w: jnp.sum(route(x, w, bias, cfg)[1] * ct), argnums=(0, 1))(x, w)

    for got, want in zip(loss(pallas), loss(xla), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_route_kernel_scope_and_bad_grouping():
    xla, pallas = _configs(128, 8, 4, 8)
    auto = dataclasses.replace(pallas, decode_impl="auto")
    assert not _route(auto, 1) and select(auto, dtype=jnp.float32, platform="gpu").route_for(1)  # a GPU only
    max_tokens = select(pallas, dtype=jnp.float32).tuning.route_max_tokens
    assert _route(pallas, max_tokens) and not _route(pallas, max_tokens + 1)  # long prompts, training batches
    assert not _route(pallas, 0)  # no tokens: the XLA form's empty result
    x, w, bias = _inputs(np.random.default_rng(0), 0, 128, False)
    idx, wts, _ = route(x, w, bias, pallas)
    assert idx.shape == (0, 8) and wts.shape == (0, 8)
    logits = jnp.ones((2, 12))
    with pytest.raises(ValueError, match="divisible by n_group"):
        select_experts(logits, jnp.zeros(12), n_group=5, topk_group=2, k=2, scale=1.0)
    with pytest.raises(ValueError, match="topk_group"):
        select_experts(logits, jnp.zeros(12), n_group=4, topk_group=1, k=4, scale=1.0)


def test_triton_lowering(h200_lowering):
    """The kernel lowers to Triton for an H200 at Ling-3.0-tiny's and 3.1-flash's expert counts."""
    sd = jax.ShapeDtypeStruct

    for n, e in ((1, 128), (128, 128), (1, 512), (96, 512)):
        def fn(logits, bias):
            return select_experts(logits, bias, n_group=8, topk_group=4, k=8, scale=2.5, interpret=False)

        assert "triton" in h200_lowering(fn, sd((n, e), jnp.float32), sd((e,), jnp.float32))

    def decode_form(parts, bias_stack):  # [S, 1, E] partial sums, the bias in its [L, E] stack
        return select_experts(parts, WeightStack(bias_stack, np.int32(3)), n_group=8, topk_group=4, k=8, scale=2.5,
                              interpret=False)

    assert "triton" in h200_lowering(decode_form, sd((24, 1, 128), jnp.float32), sd((23, 128), jnp.float32))

    def with_prefetch(parts, bias_stack, gate_up, down):  # the shared expert's slabs, as the MoE passes them
        return select_experts(parts, WeightStack(bias_stack, np.int32(3)), n_group=8, topk_group=4, k=8, scale=2.5,
                              interpret=False, prefetch=(Prefetch(gate_up, (np.int32(3), 0)),
                                                         Prefetch(down, (np.int32(3), 0))))

    assert "triton" in h200_lowering(with_prefetch, sd((24, 1, 128), jnp.float32), sd((23, 128), jnp.float32),
                                     sd((23, 1, 1536, 1024), jnp.bfloat16), sd((23, 1, 512, 1536), jnp.bfloat16))

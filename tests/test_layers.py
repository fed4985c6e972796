"""Unit tests of the blocks around the hot paths: clamp, RoPE, router, expert dispatch, short conv."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.config import LingConfig
from ling_jax.layers.kda import short_conv
from ling_jax.layers.moe import route
from ling_jax.layers.rope import apply_rope, rope_cos_sin
from ling_jax.ops import moe as moe_ops
from ling_jax.ops.moe import routed_experts
from ling_jax.ops.norms import rms_norm
from ling_jax.ops.swiglu import swiglu_act


def test_swiglu_clamp():
    gate = jnp.array([-20.0, 0.5, 30.0])
    up = jnp.array([-20.0, 0.5, 30.0])
    np.testing.assert_allclose(swiglu_act(gate, up, 0.0), jax.nn.silu(gate) * up)
    want = jnp.minimum(jax.nn.silu(gate), 10.0) * jnp.clip(up, -10.0, 10.0)
    np.testing.assert_allclose(swiglu_act(gate, up, 10.0), want)
    assert float(swiglu_act(gate, up, 10.0)[2]) == 100.0  # gate clamped above, up clipped


def test_rope_matches_reference_deinterleaved_form():
    """Ours keeps pairs (2i, 2i+1) in place; the reference de-interleaves then rotates halves."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, 3, 16)).astype(np.float32)
    pos = jnp.arange(5)[None] + 7
    cos, sin = rope_cos_sin(pos, 16, 10000.0)
    ours = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    xd = np.concatenate([x[..., 0::2], x[..., 1::2]], -1)  # de-interleave
    c = np.concatenate([np.asarray(cos)] * 2, -1)[:, :, None]
    s = np.concatenate([np.asarray(sin)] * 2, -1)[:, :, None]
    rot = np.concatenate([-xd[..., 8:], xd[..., :8]], -1)
    ref = xd * c + rot * s  # de-interleaved order
    np.testing.assert_allclose(np.concatenate([ours[..., 0::2], ours[..., 1::2]], -1), ref, atol=1e-6)


def test_rms_norm_casts_before_weight():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 64)), jnp.bfloat16)
    w = jnp.full((64,), 1.7, jnp.bfloat16)
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(rms_norm(x, w, 1e-6), normed * w)


def test_router_group_limited_selection_and_weights():
    cfg = LingConfig.preset("debug")  # 8 experts, 4 groups of 2, keep 2 groups, top-2
    w = jnp.eye(8, dtype=jnp.float32)[:, :8]  # logits = x
    x = jnp.array([[3.0, -3.0, 2.0, 2.0, 0.0, 0.0, 2.5, -9.0]])
    bias = jnp.zeros(8)
    idx, wts, logits = route(x, w, bias, cfg)
    s = jax.nn.sigmoid(x[0])
    group = np.asarray(s).reshape(4, 2).sum(1)  # group score: sum of top-2 (= both) per group
    keep = np.argsort(-group)[:2]
    allowed = np.concatenate([[2 * g, 2 * g + 1] for g in keep])
    best = allowed[np.argsort(-np.asarray(s)[allowed])[:2]]
    assert sorted(np.asarray(idx[0]).tolist()) == sorted(best.tolist())
    np.testing.assert_allclose(np.asarray(wts[0]), 2.5 * np.asarray(s)[np.asarray(idx[0])] /
                               np.asarray(s)[np.asarray(idx[0])].sum(), rtol=1e-6)
    # the bias changes the selection but not the weights' source (unbiased scores)
    bias = jnp.zeros(8).at[7].set(5.0).at[6].set(5.0)
    idx_b, wts_b, _ = route(x, w, bias, cfg)
    assert sorted(np.asarray(idx_b[0]).tolist()) == [6, 7]
    np.testing.assert_allclose(np.asarray(wts_b[0]).sum(), 2.5, rtol=1e-6)
    w7 = float(wts_b[0][np.asarray(idx_b[0]) == 7][0])
    np.testing.assert_allclose(w7, 2.5 * float(s[7]) / float(s[6] + s[7]), rtol=1e-5)  # unbiased score
    assert w7 < 0.01


def test_ragged_experts_equal_dense_including_skew():
    """Every impl against the dense reference, spread and all-on-three-experts routing; `gemv` at a
    decode size (60 copies; above `Tuning.gather_max_copies` it runs what `auto` picks) and tileable widths."""
    rng = np.random.default_rng(2)
    e, k = 8, 3
    for n, d, i, impls in ((40, 16, 12, ("ragged", "gather")), (20, 32, 16, ("ragged", "gather", "gemv"))):
        x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
        wg, wu = (jnp.asarray(rng.standard_normal((e, d, i)) * 0.2, jnp.float32) for _ in range(2))
        wd = jnp.asarray(rng.standard_normal((e, i, d)) * 0.2, jnp.float32)
        w = jnp.asarray(rng.random((n, k)), jnp.float32)
        for idx in (rng.permuted(np.tile(np.arange(e), (n, 1)), axis=1)[:, :k],  # spread
                    np.tile(np.array([5, 6, 7]), (n, 1))):  # every token on the same 3 experts
            idx = jnp.asarray(idx, jnp.int32)
            b = routed_experts(x, idx, w, wg, wu, wd, impl="dense", limit=0.5)
            for impl in impls:
                assert rel_l2(routed_experts(x, idx, w, wg, wu, wd, impl=impl, limit=0.5), b) < 1e-6, impl


def test_gemv_tiles_and_the_shared_expert_in_the_launches():
    """The gemv kernel reads `ExpertStack`s in place only in their own dtype and where it tiles them; the
    shared expert rides in its launches only at the routed width, and only on that path."""
    w_in, w_out = (moe_ops.ExpertStack(jnp.zeros((2, 8, *s)), jnp.int32(1)) for s in ((64, 16), (16, 64)))
    assert moe_ops.gemv_tiles((w_in, w_in, w_out), jnp.float32)
    assert not moe_ops.gemv_tiles((w_in, w_in, w_out), jnp.bfloat16)  # would convert the whole stacks
    assert not moe_ops.gemv_tiles((w_in, jnp.zeros((8, 64, 16)), w_out), jnp.float32)
    assert not moe_ops.gemv_tiles((moe_ops.ExpertStack(jnp.zeros((2, 8, 64, 12)), jnp.int32(1)),) * 3, jnp.float32)
    assert moe_ops.shared_fits(64, 16, 16) and not moe_ops.shared_fits(64, 16, 32)
    one = moe_ops.ExpertStack(jnp.zeros((2, 1, 64, 32)), jnp.int32(0))
    shared = moe_ops.SharedStacks(one, moe_ops.ExpertStack(jnp.zeros((2, 1, 16, 64)), jnp.int32(0)), jnp.float32(0))
    with pytest.raises(ValueError, match="gemv kernel on expert stacks"):
        moe_ops.routed_experts(jnp.zeros((1, 64)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), w_in, w_in, w_out,
                               impl="gather", shared=shared)
    with pytest.raises(ValueError, match="resolved by ling_jax.kernels"):
        moe_ops.routed_experts(jnp.zeros((1, 64)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), w_in, w_in, w_out,
                               impl="auto")


def test_short_conv_state_continues_sequence():
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((2, 10, 6)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)
    full, state_full = short_conv(a, w, None)
    first, state = short_conv(a[:, :7], w, None)
    second, state2 = short_conv(a[:, 7:], w, state)
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), full, rtol=1e-6)
    np.testing.assert_array_equal(state2, state_full)
    # explicit formula at t = 5: taps j = 0..3 multiply a[t - 3 + j]
    want = jax.nn.silu(sum(w[:, j] * a[:, 5 - 3 + j] for j in range(4)))
    np.testing.assert_allclose(full[:, 5], want, rtol=1e-6)
    # a segment starting at t = 5 sees zeros before it
    seg = jnp.asarray(np.repeat([[0] * 5 + [1] * 5], 2, 0))
    segd, _ = short_conv(a, w, None, seg)
    np.testing.assert_allclose(segd[:, 5], jax.nn.silu(w[:, 3] * a[:, 5]), rtol=1e-6)


def test_swiglu_clamp_lists_reach_the_model():
    """Config limit lists are on by default and switchable: they change exactly the listed layers."""
    import ling_jax
    from ling_jax.params import init_params

    cfg = LingConfig.preset("debug", expert_swiglu_limit_list=[0, 0, 0, 0, 0, 1e-3],
                            share_expert_swiglu_limit_list=[0, 0, 0, 0, 0, 1e-3])
    params = init_params(cfg, seed=1)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (1, 8)))
    on = ling_jax.forward(cfg, params, ids)
    off = ling_jax.forward(LingConfig.preset("debug", swiglu_clamp=False, expert_swiglu_limit_list=[0] * 5 + [1e-3],
                                             share_expert_swiglu_limit_list=[0] * 5 + [1e-3]), params, ids)
    plain = ling_jax.forward(LingConfig.preset("debug"), params, ids)
    assert rel_l2(off, plain) < 1e-6
    assert rel_l2(on, plain) > 1e-4


def test_ragged_experts_gradients_equal_dense():
    rng = np.random.default_rng(5)
    n, d, e, i, k = 24, 8, 6, 10, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32) for s in ((e, d, i), (e, d, i), (e, i, d))]
    idx = jnp.asarray(rng.permuted(np.tile(np.arange(e), (n, 1)), axis=1)[:, :k], jnp.int32)
    w = jnp.asarray(rng.random((n, k)), jnp.float32)

    def loss(impl, x, w, *ws):
        return jnp.sum(jnp.sin(routed_experts(x, idx, w, *ws, impl=impl)))

    ga = jax.grad(lambda *a: loss("ragged", *a), argnums=(0, 1, 2, 3, 4))(x, w, *ws)
    gb = jax.grad(lambda *a: loss("dense", *a), argnums=(0, 1, 2, 3, 4))(x, w, *ws)
    for a, b in zip(ga, gb, strict=True):
        assert rel_l2(a, b) < 1e-5


def test_routed_partial_non_local_experts_values_gradients_and_counts():
    """One device's share of the experts (3..4 of 8, fewer than top-k: copies past the capacity are
    never computed) with padding rows routed to the sentinel E: the sorted dispatch's gathers (and
    their transposes) equal the dense path, and the counts skip the sentinel."""
    rng = np.random.default_rng(11)
    n, d, e, i, k, first, n_local = 20, 8, 8, 6, 3, 3, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
          for s in ((n_local, d, i), (n_local, d, i), (n_local, i, d))]
    idx = rng.permuted(np.tile(np.arange(e), (n, 1)), axis=1)[:, :k]
    idx[-2:] = e  # padding rows
    idx = jnp.asarray(idx, jnp.int32)
    w = jnp.asarray(rng.random((n, k)), jnp.float32)

    def loss(impl, x, w, *ws):
        return jnp.sum(jnp.sin(moe_ops.routed_partial(x, idx, w, first, *ws, impl=impl)))

    va, ga = jax.value_and_grad(lambda *a: loss("ragged", *a), argnums=(0, 1, 2, 3, 4))(x, w, *ws)
    vb, gb = jax.value_and_grad(lambda *a: loss("dense", *a), argnums=(0, 1, 2, 3, 4))(x, w, *ws)
    np.testing.assert_allclose(va, vb, rtol=1e-5)
    for a, b in zip(ga, gb, strict=True):
        assert rel_l2(a, b) < 1e-5
    assert float(jnp.abs(ga[0][-2:]).max()) == 0.0  # padding rows: no expert, no gradient
    want = np.bincount(np.asarray(idx).reshape(-1), minlength=e + 1)[:e]
    np.testing.assert_array_equal(moe_ops.expert_counts(idx, e), want)
# selection scores sigmoid(logit) + bias of 16 experts in 4 groups of 4, made so that each wrong
# rule picks other experts: ranking groups by the sum of their top 2 keeps groups 1 and 2 (1.15, 1.13);
# by the top 1 it would keep 0 and 1, by the sum of all 4 groups 3 and 1, without the bias (experts 8
# and 9 score 0.08 and 0.05 unbiased) groups 1 and 0; topk_group + 1 = 3 groups adds group 0
GROUPED_SEL = np.array([0.90, 0.10, 0.10, 0.10,   0.60, 0.55, 0.05, 0.05,
                        0.58, 0.55, 0.02, 0.01,   0.50, 0.45, 0.40, 0.40])
GROUPED_BIAS = np.where(np.isin(np.arange(16), (8, 9)), 0.5, 0.0)


@pytest.mark.parametrize("decode_impl", ["xla", "pallas"])  # pallas: the selection kernel (interpret mode on CPU)
def test_router_keeps_the_topk_group_groups_of_best_top2_sum(decode_impl):
    """Exact experts and weights for scores where topk_group + 1 groups, a group score of the top 1
    or of all its experts, or a score without the bias would each select other experts."""
    cfg = LingConfig.preset("debug", num_experts=16, n_group=4, topk_group=2, num_experts_per_tok=2,
                            decode_impl=decode_impl)
    unbiased = GROUPED_SEL - GROUPED_BIAS
    x = jnp.asarray(np.log(unbiased / (1 - unbiased))[None], jnp.float32)  # logits whose sigmoid is `unbiased`
    idx, wts, _ = route(x, jnp.eye(16, dtype=jnp.float32), jnp.asarray(GROUPED_BIAS, jnp.float32), cfg)
    assert np.asarray(idx[0]).tolist() == [4, 8]  # best of groups 1 and 2: 0.60, 0.58
    want = 2.5 * unbiased[[4, 8]] / unbiased[[4, 8]].sum()  # the unbiased scores, renormalised and scaled
    np.testing.assert_allclose(np.asarray(wts[0]), want, rtol=1e-5)
    # the same scores with 3 groups kept: group 0's 0.90 wins
    idx3, _, _ = route(x, jnp.eye(16, dtype=jnp.float32), jnp.asarray(GROUPED_BIAS, jnp.float32),
                       dataclasses.replace(cfg, topk_group=3))
    assert np.asarray(idx3[0]).tolist() == [0, 4]

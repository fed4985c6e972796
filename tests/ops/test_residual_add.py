"""The residual-add kernel (`ops.residual_add`) against XLA's sum of the same partial sums, and the
sum of squares it hands to the next RMSNorm (`expert_gemv.NormedRows`). On a GPU these run the
Triton kernel, whose last program per row adds the tiles' sums after an atomic count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.layers.norms import rms_norm, sum_squares
from ling_jax.ops import residual_add
from ling_jax.ops.expert_gemv import NormedRows, gathered_products
from ling_jax.ops.layer_gemv import WeightStack, normed
from ling_jax.ops.residual_add import PendingSum, Residual, pending_sum


def _stream(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape) * np.linspace(0.5, 3.0, shape[-1]), dtype)


@pytest.mark.parametrize("s,d", [(32, 1536), (3, 96), (72, 64)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_projection_sums_are_added_with_their_sums_of_squares(s, d, dtype):
    """A projection's partial sums (no weights): the kernel's stream equals XLA's `PendingSum.value()`
    added to x, its sum of squares the new stream's, and its counters are zero again, call after
    call on new values. Split counts that are odd, and beyond `expert_gemv.MAX_ADDED_PARTIALS`
    (where XLA reduces instead)."""
    rng = np.random.default_rng(s + d)
    step = jax.jit(residual_add.add)
    count = jnp.zeros((1,), jnp.int32)
    for _ in range(3):
        x = _stream(rng, (1, 1, d), dtype)
        y = pending_sum(jnp.asarray(rng.standard_normal((s, 1, d)), jnp.float32), (1, 1, d), dtype)
        got = step(Residual.of(x, count), y)
        count = got.count
        assert isinstance(got, Residual) and got.x.dtype == dtype and got.x.shape == x.shape
        assert rel_l2(got.x, x + y.value()) < (1e-6 if dtype == jnp.float32 else 4e-3)
        assert got.ss.shape == (1, 1, 1)
        np.testing.assert_allclose(got.ss, sum_squares(got.x), rtol=1e-5)
        np.testing.assert_array_equal(count, [0])


@pytest.mark.parametrize("r,k", [(1, 8), (3, 2)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_moe_copies_are_weighed_and_added_to_the_shared_expert(r, k, dtype):
    """A MoE's copies (R x K routed, then R shared): the kernel weighs each row's routed outputs,
    adds its shared expert's and the stream, as `PendingSum.value()` does in XLA."""
    rng = np.random.default_rng(r * 10 + k)
    d, s = 256, 8
    x = _stream(rng, (r, d), dtype)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (r, k)), jnp.float32)
    y = pending_sum(jnp.asarray(rng.standard_normal((s, r * k + r, d)), jnp.float32), (r, d), dtype, w)
    got = jax.jit(residual_add.add)(Residual.of(x), y)
    assert rel_l2(got.x, x + y.value()) < (1e-6 if dtype == jnp.float32 else 4e-3)
    np.testing.assert_allclose(got.ss, sum_squares(got.x), rtol=1e-5)
    np.testing.assert_array_equal(got.count, np.zeros(r))
    np.testing.assert_allclose(jax.jit(residual_add.add)(x, y), x + y.value(), rtol=1e-5, atol=1e-5)  # XLA adds


def test_the_next_norm_reads_the_sums_of_squares():
    """A `Residual` normed by a stacked weight is `NormedRows` carrying its sum of squares: the gemv
    kernel's products equal those of the stream normed in XLA, and `value()` equals `rms_norm`."""
    rng = np.random.default_rng(3)
    d, o = 512, 64
    x = _stream(rng, (1, 1, d), jnp.float32)
    y = pending_sum(jnp.asarray(rng.standard_normal((4, 1, d)), jnp.float32), (1, 1, d), jnp.float32)
    res = residual_add.add(Residual.of(x), y)
    norm_LD = jnp.asarray(1.0 + 0.3 * rng.standard_normal((3, d)), jnp.float32)
    rows = normed(res, WeightStack(norm_LD, jnp.int32(2)), 1e-6)
    assert isinstance(rows, NormedRows) and rows.ss.shape == res.ss.shape
    want = rms_norm(res.x, norm_LD[2], 1e-6)
    np.testing.assert_allclose(rows.value(), want, rtol=1e-6)
    np.testing.assert_allclose(normed(res, norm_LD[2], 1e-6), want, rtol=1e-6)
    w = jnp.asarray(rng.standard_normal((2, d, o)) * 0.1, jnp.float32)
    idx = jnp.zeros((1,), jnp.int32)
    (got,), (ref,) = gathered_products(rows.reshape(1, d), idx, (w,)), gathered_products(want.reshape(1, d), idx, (w,))
    assert rel_l2(got, ref) < 1e-6


def test_pending_sums_reshape_and_fall_back():
    """Views keep D and the row count; a stream the kernel cannot tile is added by XLA."""
    parts = jnp.ones((2, 1, 24), jnp.float32)
    y = pending_sum(parts, (1, 24), jnp.float32)
    assert y.reshape(1, 1, -1).shape == (1, 1, 24) and y.reshape((1, 1, 24)).value().shape == (1, 1, 24)
    with pytest.raises(ValueError, match="cannot view"):
        y.reshape(2, 12)
    x = Residual.of(jnp.ones((1, 24), jnp.float32))  # 24 has no power-of-two tile >= 16
    got = residual_add.add(x, y)
    np.testing.assert_array_equal(got.x, jnp.full((1, 24), 3.0))
    np.testing.assert_array_equal(got.ss, jnp.full((1, 1), 9.0 * 24))
    assert got.count is x.count
    assert isinstance(y, PendingSum) and jax.tree.leaves(y) == [parts]


def test_triton_lowering(h200_lowering):
    """The kernel lowers to Triton for an H200 at Ling-3.0-tiny's hidden size: after o_proj (32 partial
    sums) and after a MoE layer (8 routed and 1 shared copies of 8 partial sums each)."""
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16

    def attn(x, ss, count, parts):
        return residual_add._fused_add(Residual(x, ss, count), PendingSum(parts, None, (1, 1536), jnp.dtype(bf)),
                                       interpret=False)

    def moe(x, ss, count, parts, w):
        return residual_add._fused_add(Residual(x, ss, count), PendingSum(parts, w, (1, 1536), jnp.dtype(bf)),
                                       interpret=False)

    f32, i32, call = jnp.float32, jnp.int32, "__gpu$xla.gpu.triton"
    assert call in h200_lowering(attn, sd((1, 1536), bf), sd((1, 1), f32), sd((1,), i32), sd((32, 1, 1536), f32))
    assert call in h200_lowering(moe, sd((1, 1536), bf), sd((1, 1), f32), sd((1,), i32), sd((8, 9, 1536), f32),
                                 sd((1, 8), f32))

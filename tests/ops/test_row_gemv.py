"""The transposed-weight projection kernel (`ops.row_gemv`) against XLA products of the same layer
(its use in the batch-1 decode step: test_generate.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.layers.norms import rms_norm
from ling_jax.ops import row_gemv
from ling_jax.ops.expert_gemv import NormedRows
from ling_jax.ops.layer_gemv import RowStack, linear, linear_transposed
from ling_jax.ops.row_gemv import supported, transposed_products


def _stack(rng, n, o, c, dtype):
    return jnp.asarray(rng.standard_normal((n, o, c)) * 0.1, dtype)


@pytest.mark.parametrize("r,c,o", [(1, 64, 16), (3, 96, 48), (2, 1536, 80)])  # C in 1, 3 (32-wide), 6 steps
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-6)])
@pytest.mark.parametrize("traced", [False, True], ids=["constant_layer", "traced_layer"])
@pytest.mark.parametrize("unrolled", [True, False], ids=["loads_first", "pipelined_loop"])
def test_products_equal_the_layers_product(r, c, o, dtype, tol, traced, unrolled, monkeypatch):
    """Rows of x times one layer of a [L, O, C] stack, transposed, in float32, at a constant layer index
    (a numpy operand, as in the unrolled step) and a traced one; awkward C (steps of 32) and R; C read
    unrolled (every load first) and in the pipelined loop."""
    monkeypatch.setattr(row_gemv, "MAX_UNROLLED", row_gemv.MAX_UNROLLED if unrolled else 0)
    rng = np.random.default_rng(c + o)
    x = jnp.asarray(rng.standard_normal((r, c)), dtype)
    w = _stack(rng, 3, o, c, dtype)
    fn = jax.jit(lambda x, w, layer: transposed_products(x, w, layer, out_dtype=jnp.float32))
    got = fn(x, w, jnp.int32(2)) if traced else transposed_products(x, w, 2, out_dtype=jnp.float32)
    want = jnp.einsum("rc,oc->ro", x.astype(jnp.float32), w[2].astype(jnp.float32), precision="highest")
    assert got.dtype == jnp.float32 and got.shape == (r, o) and rel_l2(got, want) < tol


@pytest.mark.parametrize("c", [96, 2048, 4096])  # 4096: over MAX_UNROLLED, the loop
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_normed_rows_are_normalised_in_the_kernel(c, dtype, tol):
    """x as `NormedRows`: every program RMS-norms the row itself (the norm weight read from its stack
    at a traced layer); the output, in x's dtype, equals the product of the rows normed in XLA
    (bf16: to an output rounding)."""
    assert (row_gemv.BO * c <= row_gemv.MAX_UNROLLED) == (c < 4096)
    rng = np.random.default_rng(c)
    x = jnp.asarray(rng.standard_normal((2, c)) * 3.0 + 0.5, dtype)
    norm_LC = jnp.asarray(1.0 + 0.3 * rng.standard_normal((4, c)), dtype)
    w = _stack(rng, 2, 32, c, dtype)
    got = jax.jit(lambda layer: transposed_products(NormedRows(x, norm_LC, layer, 1e-6), w, 1))(jnp.int32(3))
    want = rms_norm(x, norm_LC[3], 1e-6).astype(jnp.float32) @ w[1].astype(jnp.float32).T
    assert got.dtype == dtype and rel_l2(got, want) < tol


def test_linear_takes_a_row_stack():
    """`layer_gemv.linear` on a `RowStack` (leading axes of x kept) and `linear_transposed` on the same
    layer as an array (XLA) agree with `linear` on the untransposed weight."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 1, 128)), jnp.float32)
    w_LCO = jnp.asarray(rng.standard_normal((2, 128, 64)) * 0.1, jnp.float32)
    w_LOC = jnp.swapaxes(w_LCO, -1, -2)
    want = linear(x, w_LCO[1])
    got = linear(x, RowStack(w_LOC, jnp.int32(1)))
    assert got.shape == (1, 1, 64) and rel_l2(got, want) < 1e-6
    assert rel_l2(linear_transposed(x, w_LOC[1]), want) < 1e-6
    assert rel_l2(linear_transposed(x, RowStack(w_LOC, jnp.int32(1))), want) < 1e-6
    with pytest.raises(ValueError, match="does not match"):
        linear(x[..., :64], RowStack(w_LOC, jnp.int32(0)))


def test_unsupported_shapes_raise():
    assert supported(1536, 10256) and not supported(1536, 10250) and not supported(24, 64)
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(ValueError, match="multiple of"):
        transposed_products(x, jnp.ones((1, 20, 64), jnp.float32), 0)
    with pytest.raises(ValueError, match="do not match"):
        transposed_products(x, jnp.ones((1, 32, 96), jnp.float32), 0)


def test_triton_lowering(h200_lowering):
    """The kernel lowers to Triton for an H200 at the Ling-3.0-tiny and 3.1-flash KDA input projections,
    with and without the RMSNorm prologue."""
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16

    def plain(x, w):
        return transposed_products(x, w, 3, interpret=False)

    def normed(x, nw, w):
        return transposed_products(NormedRows(x, nw, jnp.int32(1), 1e-6), w, 3, interpret=False)

    for c, o in ((1536, 10256), (4096, 41024)):  # 5 x H x 128 + H
        assert "triton" in h200_lowering(plain, sd((1, c), bf), sd((18, o, c), bf))
        assert "triton" in h200_lowering(normed, sd((1, c), bf), sd((18, c), bf), sd((18, o, c), bf))

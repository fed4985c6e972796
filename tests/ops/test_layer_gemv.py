"""`ops.layer_gemv.linear`: a layer's projection read from its stack by the gemv kernel (interpret mode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.decode.views import stackable
from ling_jax.ops.layer_gemv import WeightStack, linear


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_stack_layer_equals_the_product(dtype, tol):
    """Each layer of a [L, C, O] stack, one row and a few rows with leading dims, against x @ w."""
    ks = jax.random.split(jax.random.key(0), 2)
    stack = jax.random.normal(ks[0], (3, 96, 48)).astype(dtype)
    x = jax.random.normal(ks[1], (2, 1, 96)).astype(dtype)
    for layer in range(3):
        got = linear(x, WeightStack(stack, jnp.int32(layer)))
        want = (x.astype(jnp.float32) @ stack[layer].astype(jnp.float32))
        assert got.dtype == dtype and got.shape == (2, 1, 48)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)


def test_plain_weights_and_bad_shapes():
    x = jnp.ones((1, 1, 32), jnp.bfloat16)
    w = jnp.full((32, 16), 0.5, jnp.float32)
    assert linear(x, w).dtype == jnp.bfloat16 and float(linear(x, w)[0, 0, 0]) == 16.0
    with pytest.raises(ValueError, match="does not match"):
        linear(jnp.ones((1, 1, 16)), WeightStack(jnp.ones((2, 32, 16)), jnp.int32(0)))


def test_stackable():
    bf = jnp.bfloat16
    assert stackable(jnp.ones((4, 32, 48), bf), 1, bf)
    assert stackable(jnp.ones((2, 3, 32, 48), bf), 2, bf)
    assert not stackable(jnp.ones((4, 32, 48), jnp.float32), 1, bf)  # converted per layer instead
    assert not stackable(jnp.ones((4, 8, 32, 48), bf), 1, bf)  # an expert stack, not one matrix per layer
    assert not stackable(jnp.ones((4, 24, 48), bf), 1, bf)  # no power-of-two tile >= 16 divides 24
    assert not stackable(None, 1, bf)

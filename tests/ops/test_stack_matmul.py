"""`ops.stack_matmul`: a few rows times one layer's weight read from its stack (interpret mode), and
`layer_gemv.linear` taking it for more than one row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.decode.views import stackable
from ling_jax.ops import stack_matmul
from ling_jax.ops.layer_gemv import WeightStack, linear


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows, c, o", [(2, 192, 64), (5, 512, 192), (33, 512, 128), (64, 256, 64)])
def test_stack_matmul_equals_the_product(dtype, tol, rows, c, o):
    """Every layer of a [L, C, O] stack; rows padded to Triton's dot (and past 32); C split in 1-4
    pieces (their partial sums add up to the product)."""
    ks = jax.random.split(jax.random.key(rows), 2)
    stack = jax.random.normal(ks[0], (3, c, o)).astype(dtype)
    x = jax.random.normal(ks[1], (rows, c)).astype(dtype)
    for layer in range(3):
        parts = stack_matmul.partial_products(x, stack, jnp.int32(layer))
        s = stack_matmul.splits(rows, c, o, jnp.dtype(dtype).itemsize)
        assert parts.shape == (s, rows, o) and parts.dtype == jnp.float32
        want = x.astype(jnp.float32) @ stack[layer].astype(jnp.float32)
        np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(want), rtol=tol, atol=tol * np.sqrt(c))


def test_splits_fill_the_gpu_within_the_partials_budget():
    # Ling-3.0-tiny's fused KDA input projection at batch 16: 162 output tiles x 2 pieces of C
    assert stack_matmul.splits(16, 1536, 10368, 2) == 2
    assert stack_matmul.splits(16, 2048, 1536, 2) == 16  # o_proj: 24 tiles; partial sums 1/4 of the weight
    assert stack_matmul.splits(64, 2048, 1536, 2) == 4  # 4x the rows: a quarter of the split, same budget
    assert stack_matmul.splits(2, 192, 64, 2) == 1  # 3 steps of C: no power-of-two split


def test_linear_takes_the_stack_matmul_for_several_rows(monkeypatch):
    """Leading dims kept, the dtype of x; one row, and weights the matmul does not tile, stay on the
    gemv kernel."""
    ks = jax.random.split(jax.random.key(3), 2)
    stack = jax.random.normal(ks[0], (2, 128, 64)).astype(jnp.bfloat16)
    x = jax.random.normal(ks[1], (3, 1, 128)).astype(jnp.bfloat16)
    calls = []
    real = stack_matmul.partial_products
    monkeypatch.setattr(stack_matmul, "partial_products", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    got = linear(x, WeightStack(stack, jnp.int32(1)))
    want = x.astype(jnp.float32) @ stack[1].astype(jnp.float32)
    assert got.shape == (3, 1, 64) and got.dtype == jnp.bfloat16 and calls == [(3, 128)]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)
    linear(x[:1], WeightStack(stack, jnp.int32(1)))
    linear(jnp.ones((3, 1, 96), jnp.bfloat16), WeightStack(jnp.ones((2, 96, 64), jnp.bfloat16), jnp.int32(0)))
    assert calls == [(3, 128)]
    with pytest.raises(ValueError, match="needs 1..64 rows"):
        stack_matmul.partial_products(jnp.ones((65, 128)), jnp.ones((1, 128, 64)), 0)


def test_stackable_for_several_rows():
    bf = jnp.bfloat16
    assert stackable(jnp.ones((4, 128, 192), bf), 1, bf, rows=16)
    assert not stackable(jnp.ones((4, 96, 192), bf), 1, bf, rows=16)  # C not a multiple of BK
    assert not stackable(jnp.ones((4, 128, 192), bf), 1, bf, rows=stack_matmul.MAX_ROWS + 1)

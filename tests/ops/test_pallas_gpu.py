"""`ops.pallas_gpu`: the kernels' shared plumbing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.ops.pallas_gpu import INDEX_SENTINEL, index_operand


@pytest.mark.parametrize("values", [[3, 3, 3, 3], list(range(9)), [0] * 9, [7], [2, 0, 5]],
                         ids=["equal", "iota", "zeros", "one", "mixed"])
def test_static_indices_stay_one_literal(values):
    """A static index operand reaches the compiled program as the literal it is: XLA would rewrite
    equal values into a broadcast and 0..n-1 into an iota, each a launch per step before a kernel."""
    op = index_operand(values)
    assert isinstance(op, np.ndarray) and op.dtype == np.int32
    np.testing.assert_array_equal(op[:len(values)], values)
    assert op[len(values):].tolist() == [INDEX_SENTINEL]
    hlo = jax.jit(lambda x: jax.lax.optimization_barrier((x, jnp.asarray(op)))).lower(
        jnp.ones(2)).compile().as_text()
    assert " iota(" not in hlo and "broadcast(" not in hlo, hlo


def test_traced_indices_are_stacked():
    op = jax.jit(lambda i: index_operand([i, 4]))(jnp.int32(3))
    np.testing.assert_array_equal(op, [3, 4])

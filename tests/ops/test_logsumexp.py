"""The one-pass row log-sum-exp kernel (interpret mode on CPU) against `jax.nn.logsumexp`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.ops.logsumexp import COLS, ROWS, row_logsumexp


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1, 7), (ROWS + 3, 2 * COLS + 5), (2 * ROWS, COLS)])
def test_kernel_matches_xla(dtype, shape):
    """Rows and columns off the tiles, random logits of large spread (offsets of +-3e3 per row: the
    running max must rescale), bf16 and float32 inputs."""
    rng = np.random.default_rng(shape[0] * shape[1])
    x = rng.normal(size=shape) * 8 + rng.uniform(-3e3, 3e3, size=(shape[0], 1))
    x = jnp.asarray(x, dtype)
    got = row_logsumexp(x, impl="pallas", interpret=True)
    want = jax.nn.logsumexp(x.astype(jnp.float32), axis=-1)
    assert got.dtype == jnp.float32 and got.shape == (shape[0],)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(row_logsumexp(x), want, rtol=1e-6)  # the default: XLA


def test_bad_impl():
    with pytest.raises(ValueError, match="impl="):
        row_logsumexp(jnp.ones((2, 3)), impl="triton")


def test_triton_lowering(h200_lowering):
    x = jax.ShapeDtypeStruct((4096, 157184), jnp.bfloat16)
    assert "row_logsumexp" in h200_lowering(lambda a: row_logsumexp(a, impl="pallas", interpret=False), x)

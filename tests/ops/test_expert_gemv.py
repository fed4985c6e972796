"""The decode-sized routed-expert kernel (`ops.expert_gemv`) against plain einsums of gathered weights
(its use as `routed_experts(impl="gemv")` is tested with the other impls in test_layers.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.ops.expert_gemv import gathered_products, supported


def _case(rng, m, e, c, o, dtype):
    x = jnp.asarray(rng.standard_normal((m, c)), dtype)
    ws = tuple(jnp.asarray(rng.standard_normal((e, c, o)) * 0.1, dtype) for _ in range(2))
    idx = jnp.asarray(rng.integers(0, e, m), jnp.int32)
    return x, idx, ws


@pytest.mark.parametrize("m,c,o", [(1, 64, 16), (5, 96, 48), (64, 160, 128)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-6)])
def test_products_equal_gathered_einsum(m, c, o, dtype, tol):
    """Awkward copy counts and widths whose tiles are not the largest ones (96 -> 32, 48 -> 16, 160 -> 32)."""
    x, idx, ws = _case(np.random.default_rng(m), m, 7, c, o, dtype)
    got = gathered_products(x, idx, ws)
    for g, w in zip(got, ws, strict=True):
        want = jnp.einsum("mc,mco->mo", x.astype(jnp.float32), w[idx].astype(jnp.float32), precision="highest")
        assert g.dtype == jnp.float32 and rel_l2(g, want) < tol


def test_each_token_row_serves_its_copies():
    """copies=k: copy m reads token row m // k (the MoE's k choices per token, no repeated x)."""
    rng = np.random.default_rng(7)
    x, _, ws = _case(rng, 3, 5, 64, 32, jnp.float32)
    idx = jnp.asarray(rng.integers(0, 5, 12), jnp.int32)
    got = gathered_products(x, idx, ws, copies=4)
    for g, want in zip(got, gathered_products(jnp.repeat(x, 4, axis=0), idx, ws), strict=True):
        np.testing.assert_array_equal(g, want)
    with pytest.raises(ValueError, match="copies"):
        gathered_products(x, idx, ws, copies=3)


def test_unsupported_shapes_raise():
    assert not supported(64, 12) and not supported(24, 64) and supported(1536, 1280)
    x, idx, ws = _case(np.random.default_rng(0), 2, 3, 64, 12, jnp.float32)
    with pytest.raises(ValueError, match="no power-of-two tile"):
        gathered_products(x, idx, ws)


def test_triton_lowering(h200_lowering):
    """The kernel lowers to Triton for an H200 at the Ling-3.0-tiny and 3.1-flash expert shapes."""
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    def fn(x, i, a, b):
        return gathered_products(x, i, (a, b), interpret=False)

    for e, c, o in ((128, 1536, 512), (512, 4096, 1280), (512, 1280, 4096)):
        mlir = h200_lowering(fn, sd((8, c), bf), sd((8,), jnp.int32), sd((e, c, o), bf), sd((e, c, o), bf))
        assert "triton" in mlir

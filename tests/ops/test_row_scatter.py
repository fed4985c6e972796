"""`ops.row_scatter` (interpret mode here; Triton on a GPU) and the MoE dispatch that uses it: only the
copies' rows are written, the aligned MoE is unchanged without and under differentiation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.ops import aligned_gmm, row_scatter
from ling_jax.ops import moe as moe_ops


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("d", [48, 1536])
def test_scatter_rows_writes_each_copy_row_at_its_slot(dtype, d):
    rng = np.random.default_rng(0)
    n, k, rows = 5, 3, 70
    x = jnp.asarray(rng.standard_normal((n, d)), dtype)
    slot = rng.permutation(rows)[: n * k]
    slot[[2, 9]] = rows  # two copies not computed
    out = np.asarray(row_scatter.scatter_rows(x, jnp.asarray(slot, jnp.int32), rows), np.float32)
    assert out.shape == (rows, d)
    for m, s in enumerate(slot):
        if s < rows:
            np.testing.assert_array_equal(out[s], np.asarray(x[m // k], np.float32))


def test_scatter_rows_rejects_bad_shapes():
    x = jnp.ones((4, 24), jnp.bfloat16)  # no power of two >= 16 divides 24
    with pytest.raises(ValueError, match="D=24"):
        row_scatter.scatter_rows(x, jnp.zeros((8,), jnp.int32), 16)
    with pytest.raises(ValueError, match="whole number"):
        row_scatter.scatter_rows(jnp.ones((3, 32), jnp.bfloat16), jnp.zeros((8,), jnp.int32), 16)


def _rows(n: int, k: int, e: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    key = np.stack([rng.permutation(e)[:k] for _ in range(n)]).reshape(-1)
    return moe_ops.sorted_rows(jnp.asarray(key, jnp.int32), e, n * k, aligned=True)


def test_dispatch_rows_only_keeps_copies_and_zero_rows_under_differentiation():
    """Without differentiation the copies' rows equal the zero-padded gather's (the rest is not
    defined: NaN in interpret mode); under jax.vjp the rows are the zero-padded gather's and so is
    the gradient."""
    n, k, e, d = 6, 2, 8, 64
    x = jnp.asarray(np.random.default_rng(2).standard_normal((n, d)), jnp.bfloat16)
    rows = _rows(n, k, e)
    ref = moe_ops.dispatch(x, rows.copy_S, rows.slot_M, False)
    got = moe_ops.dispatch(x, rows.copy_S, rows.slot_M, True)
    held = np.asarray(rows.copy_S) < n * k
    np.testing.assert_array_equal(np.asarray(got)[held], np.asarray(ref)[held])
    if jax.default_backend() != "gpu":
        assert np.isnan(np.asarray(got, np.float32)[~held]).all()  # interpret mode's unwritten rows
    out, vjp = jax.vjp(lambda x: moe_ops.dispatch(x, rows.copy_S, rows.slot_M, True), x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    dy = jnp.asarray(np.random.default_rng(3).standard_normal(ref.shape), jnp.bfloat16)
    ref_vjp = jax.vjp(lambda x: moe_ops.dispatch(x, rows.copy_S, rows.slot_M, False), x)[1]
    np.testing.assert_array_equal(np.asarray(vjp(dy)[0]), np.asarray(ref_vjp(dy)[0]))


def test_routed_experts_aligned_forward_ignores_unwritten_rows():
    """The aligned MoE with `rows_only` (the dispatch writes only the copies' rows: every other row is
    NaN in interpret mode) equals, bit for bit, the same kernels on the zero-padded rows, and the
    dense path within bf16 rounding: no unwritten row reaches the output. Decode tiles; expert 2
    unused."""
    rng = np.random.default_rng(4)
    n, d, e, i = 6, 64, 4, 64
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.2, jnp.bfloat16) for s in ((e, d, i), (e, d, i), (e, i, d))]
    idx = jnp.asarray(np.tile([1, 3], (n, 1)), jnp.int32).at[:2, 0].set(0)
    w = jnp.asarray(rng.random((n, 2)), jnp.float32)
    assert aligned_gmm.tiles_for(n * 2) == aligned_gmm.DECODE_TILES

    def run(impl: str, rows_only: bool = False) -> jax.Array:
        return moe_ops.routed_partial(x, idx, w, 0, *ws, impl=impl, limit=0.5, all_local=True, rows_only=rows_only)

    got = run("aligned", rows_only=True)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(run("aligned")))
    ref = run("dense")
    assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) <= 3e-2


def test_rows_only_only_when_asked(monkeypatch):
    """Without `rows_only` the aligned MoE dispatches zero-padded rows even when nothing differentiates
    it: a gradient of the expert weights alone (frozen input) must not meet unwritten rows. The
    scatter kernel is made to fail so that a call to it shows."""

    def fail(*_args, **_kw):
        raise AssertionError("scatter_rows called without rows_only")

    monkeypatch.setattr(row_scatter, "scatter_rows", fail)
    rng = np.random.default_rng(5)
    n, d, e, i = 4, 64, 4, 64
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.2, jnp.bfloat16) for s in ((e, d, i), (e, d, i), (e, i, d))]
    idx = jnp.asarray(np.tile([0, 2], (n, 1)), jnp.int32)
    w = jnp.asarray(rng.random((n, 2)), jnp.float32)

    def loss(*ws, rows_only=False):
        return jnp.sum(moe_ops.routed_experts(x, idx, w, *ws, impl="aligned", limit=0.5, rows_only=rows_only)
                       .astype(jnp.float32) ** 2)

    assert np.isfinite(float(loss(*ws)))  # the forward a weights-only gradient would take
    with pytest.raises(AssertionError, match="without rows_only"):
        loss(*ws, rows_only=True)

"""`ops.l2_prefetch` (interpret mode): the programs a kernel adds read every tile of every slab, once,
from the slab the indices name (the tile maxima they store are checked against numpy's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from ling_jax.ops import l2_prefetch
from ling_jax.ops.l2_prefetch import Prefetch


def _launch(x: jax.Array, prefetch: tuple[Prefetch, ...]) -> tuple[jax.Array, jax.Array]:
    """A 2-program kernel (each doubles its row of x) with the prefetch programs after it: (y, the
    readers' tile maxima)."""
    n = x.shape[0]
    slabs, kept = l2_prefetch.plan(prefetch)
    extra = l2_prefetch.operands(kept)

    def kernel(x_ref, *refs):
        pre, (y_ref, seen_ref) = refs[:-2], refs[-2:]
        pid = pl.program_id(0)

        @pl.when(pid < n)
        def _():
            y_ref[...] = x_ref[...] * 2.0

        @pl.when(pid >= n)
        def _():
            l2_prefetch.read(pid - n, list(pre), seen_ref, slabs)

    row = pl.BlockSpec((1, x.shape[1]), lambda i: (jnp.minimum(i, n - 1), 0))
    scratch, scratch_spec = l2_prefetch.scratch(slabs)
    y, seen = pl.pallas_call(
        kernel, grid=(n + l2_prefetch.programs(slabs),),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), scratch],
        in_specs=[row, *l2_prefetch.in_specs(extra)], out_specs=[row, scratch_spec],
        interpret=True)(x, *extra)
    return y, seen


def _tile_maxima(slab: np.ndarray, rows: int, cols: int) -> np.ndarray:
    c, o = slab.shape
    return slab.reshape(c // rows, rows, o // cols, cols).max(axis=(1, 3)).reshape(-1)


@pytest.mark.parametrize("traced", [False, True])
def test_every_tile_of_every_slab_is_read_once(traced):
    rng = np.random.default_rng(0)
    stack3 = jnp.asarray(rng.standard_normal((3, 128, 256)), jnp.bfloat16)  # [L, C, O]: 2 x 2 tiles of 64 x 128
    stack4 = jnp.asarray(rng.standard_normal((2, 4, 48, 32)), jnp.float32)  # [L, E, C, O]: tiles of 16 x 32
    odd = jnp.ones((2, 20, 40), jnp.float32)  # no power-of-two tile of >= 8 x 16 divides it: left out
    x = jnp.asarray(rng.standard_normal((2, 16)), jnp.float32)

    def run(x, s3, s4, odd, layer):
        return _launch(x, (Prefetch(s3, (layer,)), Prefetch(odd, (0,)), Prefetch(s4, (1, layer + 1))))

    layer = 2
    if traced:
        y, seen = jax.jit(run)(x, stack3, stack4, odd, jnp.int32(layer))
    else:
        y, seen = run(x, stack3, stack4, odd, layer)
    slabs, _ = l2_prefetch.plan((Prefetch(stack3, (layer,)), Prefetch(odd, (0,)), Prefetch(stack4, (1, 3))))
    assert [(s.lo, s.hi, s.rows, s.cols) for s in slabs] == [(0, 4, 64, 128), (4, 7, 16, 32)]
    np.testing.assert_array_equal(y, 2 * x)  # the kernel's own programs are untouched
    want = np.concatenate([_tile_maxima(np.asarray(stack3[layer], np.float32), 64, 128),
                           _tile_maxima(np.asarray(stack4[1, layer + 1]), 16, 32)])
    np.testing.assert_array_equal(seen, want)


def test_index_count_must_match_the_stack():
    with pytest.raises(ValueError, match="2 indices for a stack of shape"):
        l2_prefetch.plan((Prefetch(jnp.zeros((2, 64, 128)), (0, 1)),))
    assert l2_prefetch.plan(()) == ((), ()) and l2_prefetch.programs(()) == 0


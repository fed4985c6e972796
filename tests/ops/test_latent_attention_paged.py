"""Decode attention over a paged latent cache (a pool of pages read through a page table): the XLA walk
against the contiguous `latent_attention` on the cache gathered through the table, and the Pallas
kernel against the XLA walk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.ops.latent_attention_pallas import latent_attention_paged_pallas
from ling_jax.ops.mla_decode import latent_attention, latent_attention_paged
from ling_jax.ops.pallas_gpu import Launch

UNUSED = (0, -1, 10**6)  # what a table holds past a row's used pages: anything, out-of-range indices included


def _case(seed: int, lengths: list[int], *, h: int, r: int, dr: int, page_size: int, max_pages: int, n_pool: int,
          dtype, share: bool = False):
    """(q, pool [P, K, W], page_table [B, N], lengths, new): each row's pages drawn from a shuffled pool (not
    contiguous, not in order); with `share`, every row after the first starts with the first row's pages
    (a shared prefix) and its last used page is the first row's first page (the first row with a page)."""
    rng = np.random.default_rng(seed)
    b, w = len(lengths), r + dr
    free = list(rng.permutation(n_pool))
    table = rng.choice(UNUSED, size=(b, max_pages)).astype(np.int32)
    donor: list[int] = []
    for i, n in enumerate(lengths):
        used = -(-n // page_size)
        assert used <= max_pages
        own = [free.pop() for _ in range(used)]
        if share and donor and used:
            shared = min(used, len(donor))
            own[:shared] = donor[:shared]
            own[-1] = donor[0]
        donor = donor or own
        table[i, :used] = own
    q = jnp.asarray(rng.standard_normal((b, h, w)), dtype)
    pool = jnp.asarray(rng.standard_normal((n_pool, page_size, w)), dtype)
    new = jnp.asarray(rng.standard_normal((b, w)), dtype)
    return q, pool, jnp.asarray(table), jnp.asarray(lengths, jnp.int32), new


def _gathered(pool: jax.Array, table: jax.Array) -> jax.Array:
    """The contiguous cache [B, N·K, W] the table describes (entries out of the pool's range clipped)."""
    b, n = table.shape
    return jnp.take(pool, table, axis=0, mode="clip").reshape(b, n * pool.shape[1], pool.shape[2])


def _f32(*xs):
    return [x.astype(jnp.float32) for x in xs]


CASES = [  # (h, r, dr, page_size, max_pages, lengths)
    (16, 64, 16, 64, 16, [1000]),  # one row over many pages, split over many programs
    (2, 32, 8, 64, 8, [0, 1, 63, 64, 65, 128, 300]),  # 2 heads padded to 16; empty, one slot, on and off page edges
    (20, 32, 16, 128, 6, [5, 700, 127]),  # a second head block of 4 real heads; two kernel blocks per page
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("h,r,dr,page_size,max_pages,lengths", [*CASES, (3, 16, 8, 16, 12, [0, 16, 17, 190])])
@pytest.mark.parametrize("share", [False, True])
def test_xla_paged_equals_contiguous_on_the_gathered_cache(dtype, h, r, dr, page_size, max_pages, lengths, share):
    q, pool, table, ln, new = _case(len(lengths), lengths, h=h, r=r, dr=dr, page_size=page_size,
                                    max_pages=max_pages, n_pool=48, dtype=dtype, share=share)
    got = latent_attention_paged(q, pool, table, ln, new, rank=r, scale=0.1)
    want = latent_attention(q, _gathered(pool, table), ln, new, rank=r, scale=0.1, block=page_size)
    assert got.shape == (len(lengths), h, r) and got.dtype == jnp.float32
    assert rel_l2(got, want) < 1e-6


def test_xla_paged_equals_a_plain_softmax():
    """Each row: softmax over its cached positions (through its table) and the new row, times c."""
    q, pool, table, ln, new = _case(3, [0, 20, 33], h=2, r=8, dr=4, page_size=8, max_pages=6, n_pool=16,
                                    dtype=jnp.float32, share=True)
    got = latent_attention_paged(q, pool, table, ln, new, rank=8, scale=0.3)
    for i, n in enumerate([0, 20, 33]):
        cached = [np.asarray(pool[int(table[i, t // 8]), t % 8]) for t in range(n)]
        rows = np.stack([*cached, np.asarray(new[i])])
        p = jax.nn.softmax(0.3 * np.asarray(q[i]) @ rows.T, axis=-1)
        np.testing.assert_allclose(got[i], p @ rows[:, :8], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("h,r,dr,page_size,max_pages,lengths", CASES)
@pytest.mark.parametrize("share", [False, True])
def test_pallas_paged_equals_xla_paged(dtype, tol, h, r, dr, page_size, max_pages, lengths, share):
    q, pool, table, ln, new = _case(len(lengths), lengths, h=h, r=r, dr=dr, page_size=page_size,
                                    max_pages=max_pages, n_pool=48, dtype=dtype, share=share)
    got = latent_attention_paged_pallas(q, pool, table, ln, new, rank=r, scale=0.1)
    want = latent_attention_paged(*_f32(q, pool), table, ln, new.astype(jnp.float32), rank=r, scale=0.1)
    assert got.shape == want.shape and got.dtype == jnp.float32 and rel_l2(got, want) < tol


@pytest.mark.parametrize("impl", [latent_attention_paged, latent_attention_paged_pallas])
def test_hidden_rows_and_unused_entries_do_not_count(impl):
    """Pool rows no row can see (here NaN: free pages, the rest of a row's last page) and the table's
    entries past a row's used pages (out of the pool's range) do not reach the output."""
    q, pool, table, ln, new = _case(5, [100, 0, 64, 250], h=16, r=32, dr=8, page_size=64, max_pages=8, n_pool=24,
                                    dtype=jnp.float32)
    seen = np.zeros(pool.shape[:2], bool)
    for i, n in enumerate(np.asarray(ln)):
        for t in range(n):
            seen[int(table[i, t // 64]), t % 64] = True
    assert (~seen).sum() > 64 * 10  # free pages and partly used ones
    poisoned = jnp.where(jnp.asarray(seen)[..., None], pool, jnp.nan)
    got = impl(q, poisoned, table, ln, new, rank=32, scale=0.1)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert rel_l2(got, latent_attention_paged(q, pool, table, ln, new, rank=32, scale=0.1)) < 1e-6


@pytest.mark.parametrize("impl", [latent_attention_paged, latent_attention_paged_pallas])
def test_layer_of_a_pool_stack(impl):
    """`layer` (traced, under jit) reads that layer of a [L, P, K, W] stack: each equals the call on its slice."""
    q, pool, table, ln, new = _case(9, [700, 37], h=16, r=32, dr=8, page_size=64, max_pages=12, n_pool=16,
                                    dtype=jnp.float32)
    stack = jnp.stack([pool, -pool[::-1], 2 * pool])
    f = jax.jit(lambda i: impl(q, stack, table, ln, new, rank=32, scale=0.2, layer=i))
    for i in range(3):
        want = latent_attention_paged(q, stack[i], table, ln, new, rank=32, scale=0.2)
        assert rel_l2(f(jnp.int32(i)), want) < 1e-6


@pytest.mark.parametrize("programs", [1, 3])
def test_pallas_many_blocks_per_program(programs):
    """Few splits, so each program's loop crosses many pages (the online-softmax rescaling across blocks
    read from different pages; at 3 splits the last one is shorter)."""
    q, pool, table, ln, new = _case(7, [1000, 130], h=16, r=32, dr=8, page_size=128, max_pages=8, n_pool=16,
                                    dtype=jnp.float32)
    got = latent_attention_paged_pallas(q, pool, table, ln, new, rank=32, scale=0.3,
                                        launch=Launch(latent_programs=programs))
    assert rel_l2(got, latent_attention_paged(q, pool, table, ln, new, rank=32, scale=0.3)) < 1e-6


def test_bad_input_raises():
    q, pool, table, ln, new = _case(0, [3], h=2, r=32, dr=8, page_size=32, max_pages=2, n_pool=4,
                                    dtype=jnp.float32)
    with pytest.raises(ValueError, match="page_size 32 must be a multiple of the kernel's block of 64"):
        latent_attention_paged_pallas(q, pool, table, ln, new, rank=32, scale=0.1)
    wide = jnp.zeros((4, 64, 40))
    with pytest.raises(ValueError, match="powers of two"):
        latent_attention_paged_pallas(q, wide, table, ln, new, rank=24, scale=0.1)
    for impl in (latent_attention_paged, latent_attention_paged_pallas):
        with pytest.raises(ValueError, match=r"page_table must be \[B=1, max_pages\]"):
            impl(q, wide, table[0], ln, new, rank=32, scale=0.1)
        with pytest.raises(ValueError, match=r"pool must be \[L, P, K, W\] with `layer`"):
            impl(q, wide, table, ln, new, rank=32, scale=0.1, layer=0)


def test_triton_lowering(h200_lowering):
    """Lowers to Triton for an H200 at Ling-3.0-tiny widths (16 heads, r = 512, d_r = 64) over a pool of 4096
    64-slot pages: one row at a 32k context, 64 rows at 4k, and one layer of a pool stack over 4 GiB
    (64-bit offsets), the layer traced."""
    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32

    def fn(q, pool, table, n, x):
        return latent_attention_paged_pallas(q, pool, table, n, x, rank=512, scale=0.07, interpret=False)

    for b, pages in ((1, 512), (64, 64)):
        mlir = h200_lowering(fn, sd((b, 16, 576), bf), sd((4096, 64, 576), bf), sd((b, pages), i32), sd((b,), i32),
                             sd((b, 576), bf))
        assert "triton" in mlir and "latent_attention_paged" in mlir

    def stacked(q, pool, table, n, x, i):
        return latent_attention_paged_pallas(q, pool, table, n, x, rank=512, scale=0.07, layer=i, interpret=False)

    mlir = h200_lowering(stacked, sd((16, 16, 576), bf), sd((16, 4096, 64, 576), bf), sd((16, 512), i32),
                         sd((16,), i32), sd((16, 576), bf), sd((), i32))
    assert "triton" in mlir

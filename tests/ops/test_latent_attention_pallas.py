"""The one-kernel latent decode attention against the XLA blocked loop (`ops.mla_decode`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.cache import LATENT_BLOCK
from ling_jax.ops.latent_attention_pallas import latent_attention_pallas, supported
from ling_jax.ops.mla_decode import latent_attention


def _case(seed, b, h, r, dr, s, dtype):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, h, r + dr)), dtype)
    cache = jnp.asarray(rng.standard_normal((b, s, r + dr)), dtype)
    new = jnp.asarray(rng.standard_normal((b, r + dr)), dtype)
    return q, cache, new


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,h,r,dr,lengths", [
    (1, 16, 64, 16, [1023]),  # one row: the cache is split over many programs
    (4, 2, 32, 8, [0, 1, 33, 1000]),  # 2 heads padded to 16; empty, one-slot, partial-block rows
    (3, 20, 32, 16, [31, 32, 64]),  # a second head block of 4 real heads; lengths on block edges
])
def test_equals_xla_loop(dtype, tol, b, h, r, dr, lengths):
    q, cache, new = _case(len(lengths), b, h, r, dr, 1024, dtype)
    ln = jnp.asarray(lengths, jnp.int32)
    got = latent_attention_pallas(q, cache, ln, new, rank=r, scale=0.1)
    want = latent_attention(q.astype(jnp.float32), cache.astype(jnp.float32), ln, new.astype(jnp.float32),
                            rank=r, scale=0.1, block=LATENT_BLOCK)
    assert got.shape == want.shape and rel_l2(got, want) < tol


def test_slots_past_the_length_do_not_count():
    """Slots at or past a row's length (here NaN: stale or never written) do not reach the output."""
    q, cache, new = _case(0, 2, 16, 32, 8, 1024, jnp.float32)
    ln = jnp.asarray([100, 700], jnp.int32)
    poisoned = jnp.where(jnp.arange(1024)[None, :, None] >= ln[:, None, None], jnp.nan, cache)
    got = latent_attention_pallas(q, poisoned, ln, new, rank=32, scale=0.1)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert rel_l2(got, latent_attention(q, cache, ln, new, rank=32, scale=0.1, block=LATENT_BLOCK)) < 1e-6


def test_layer_of_a_stack():
    """`layer` (traced, under jit) reads that layer of a [L, B, S, W] stack: each equals the call on
    its own slice."""
    rng = np.random.default_rng(9)
    stack = jnp.asarray(rng.standard_normal((3, 2, 1024, 40)), jnp.float32)
    q, new = jnp.asarray(rng.standard_normal((2, 16, 40)), jnp.float32), jnp.asarray(rng.standard_normal((2, 40)))
    ln = jnp.asarray([700, 37], jnp.int32)
    f = jax.jit(lambda i: latent_attention_pallas(q, stack, ln, new, rank=32, scale=0.2, layer=i))
    for i in range(3):
        want = latent_attention(q, stack[i], ln, new, rank=32, scale=0.2, block=LATENT_BLOCK)
        assert rel_l2(f(jnp.int32(i)), want) < 1e-6


@pytest.mark.parametrize("programs", [1, 3])
def test_many_blocks_per_program(programs):
    """Few splits, so each program's loop runs over many 32-slot blocks (the online-softmax rescaling
    across blocks; at 3 splits the last one is shorter)."""
    from ling_jax.ops.pallas_gpu import Launch

    q, cache, new = _case(7, 1, 16, 32, 8, 1024, jnp.float32)
    ln = jnp.asarray([1000], jnp.int32)
    got = latent_attention_pallas(q, cache, ln, new, rank=32, scale=0.3, launch=Launch(latent_programs=programs))
    assert rel_l2(got, latent_attention(q, cache, ln, new, rank=32, scale=0.3, block=LATENT_BLOCK)) < 1e-6


def test_unsupported_shapes_raise():
    assert supported(512, 64, 33792) and not supported(96, 64, 1024) and not supported(512, 64, 1000)
    q, cache, new = _case(0, 1, 2, 24, 8, 64, jnp.float32)
    with pytest.raises(ValueError, match="powers of two"):
        latent_attention_pallas(q, cache, jnp.asarray([3], jnp.int32), new, rank=24, scale=0.1)


def test_triton_lowering(h200_lowering):
    """Lowers to Triton for an H200 at Ling-3.0-tiny (16 heads, 32k cache) and 3.1-flash (64 heads, batch 128),
    and reading one layer of a stacked cache."""
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    def fn(q, c, n, x):
        return latent_attention_pallas(q, c, n, x, rank=512, scale=0.07, interpret=False)

    for b, h, s in ((1, 16, 33792), (128, 64, 4096)):
        mlir = h200_lowering(fn, sd((b, h, 576), bf), sd((b, s, 576), bf), sd((b,), jnp.int32), sd((b, 576), bf))
        assert "triton" in mlir

    def stacked(q, c, n, x, i):  # one layer of a [L, B, S, W] stack, the layer traced
        return latent_attention_pallas(q, c, n, x, rank=512, scale=0.07, layer=i, interpret=False)

    mlir = h200_lowering(stacked, sd((16, 16, 576), bf), sd((6, 16, 33792, 576), bf), sd((16,), jnp.int32),
                         sd((16, 576), bf), sd((), jnp.int32))
    assert "triton" in mlir

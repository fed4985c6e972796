"""Absorbed-MLA decode attention over the latent cache as one Pallas kernel per layer (split-K).

`ops.mla_decode.latent_attention` walks the cache in a `while` loop of XLA ops: on an H200 each
1,024-slot block costs ~14 small kernels and a device-to-host read of the loop predicate (~27 us),
which adds ~5 ms per step at a 32k context (BENCHMARKS.md). Here one kernel does the whole walk:
the grid is (row, block of 16 heads, split), each program runs an online softmax over its split of
the used cache (splits are sized at run time from the longest row, so a short context in a long
allocation still spreads over every program; each loop stops at its row's length, so slots past
it are read only up to the end of their 32-slot block, and masked), and XLA merges the splits'
(max, sum, weighted latent) with the current token's row. The number of splits fills the GPU at
batch 1 and drops to one per row at large batch.

Triton lowering on GPU; interpret mode elsewhere (tests). Needs the latent rank and rope width to
be powers of two (Ling: 512 and 64), see `supported`. Used by `mla_decode` when the config's
`pallas_decode("mla")` says so ("pallas", or "auto" on a GPU). On an H200 (Ling-3.0-tiny widths,
timed alone by `bench/decode_kernels.py`): 47 us at batch 1 / 32k against 990 us for the XLA loop
(31 us per layer inside the decode step), 1.9-2.4 TB/s at batch 16-128 (tiles from a sweep,
BENCHMARKS.md). GSPMD cannot split the kernel: under a multi-device mesh
`layers.mla` runs it per shard (`sharding.per_shard`: rows over the token axes, as the cache is
laid out, heads over tensor).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ling_jax.ops.pallas_gpu import DEFAULT_LAUNCH, Launch, is_pow2, triton_call, whole

BK = 64  # cache slots per loop step
BH = 16  # heads per program (the smallest dot Triton issues)
NUM_WARPS, NUM_STAGES = 4, 2  # with BK and `Launch.latent_programs`: the fastest of the tile sweep
NEG = -1e30  # finite "minus infinity" for running maxima (exp(NEG - m) = 0, never NaN)


def supported(rank: int, rope: int, slots: int) -> bool:
    """Whether the kernel handles a latent of `rank` + `rope` and a cache of `slots` rows."""
    return is_pow2(rank) and is_pow2(rope) and slots % BK == 0


def _splits(batch: int, head_blocks: int, blocks: int, programs: int) -> int:
    """Cache splits per (row, head block): `programs` programs in all, at most one split per block."""
    return max(1, min(blocks, math.ceil(programs / (batch * head_blocks))))


def _precision(x: jax.Array) -> jax.lax.Precision:
    """float32 caches: IEEE float32 dots (not TF32); bf16: the plain bf16 MMA."""
    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _scores(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, D] . b [N, D]^T -> [M, N] float32 (a dot where Triton can issue one, else a sum)."""
    if min(a.shape[0], a.shape[1], b.shape[0]) >= 16:
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a),
                                   preferred_element_type=jnp.float32)
    return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None, :, :], axis=-1)


def _kernel(len_ref, span_ref, layer_ref, q_ref, cache_ref, m_ref, l_ref, acc_ref, *, rank: int, rope: int,
            scale: float):
    b, hb, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lay = layer_ref[0]  # the layer's index in the cache stack [L, B, S, W]
    span = span_ref[0]
    start = sp * span
    stop = jnp.minimum(start + span, len_ref[b])
    n_blocks = jnp.maximum(stop - start + BK - 1, 0) // BK
    heads = pl.ds(hb * BH, BH)
    q_lat = q_ref[b, heads, pl.ds(0, rank)]  # [BH, r]
    q_rot = q_ref[b, heads, pl.ds(rank, rope)]  # [BH, d_r]

    def body(i, carry):
        m, l, acc = carry
        pos = start + i * BK
        rows = pos + jax.lax.broadcasted_iota(jnp.int32, (BK, 1), 0)  # [BK, 1]
        c_lat = jnp.where(rows < stop, cache_ref[lay, b, pl.ds(pos, BK), pl.ds(0, rank)], 0)  # [BK, r]; rows past
        c_rot = cache_ref[lay, b, pl.ds(pos, BK), pl.ds(rank, rope)]  # the length zeroed: stale slots never count
        s = (_scores(q_lat, c_lat) + _scores(q_rot, c_rot)) * scale  # [BH, BK]
        s = jnp.where((pos + jax.lax.broadcasted_iota(jnp.int32, (1, BK), 1)) < stop, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        pv = jax.lax.dot_general(p.astype(c_lat.dtype), c_lat, (((1,), (0,)), ((), ())),
                                 precision=_precision(c_lat), preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (jnp.full((BH,), NEG, jnp.float32), jnp.zeros((BH,), jnp.float32), jnp.zeros((BH, rank), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = acc


def latent_attention_pallas(q_BHW: jax.Array, cache_BSW: jax.Array, lengths_B: jax.Array, new_BW: jax.Array, *,
                            rank: int, scale: float, layer: jax.Array | int | None = None,
                            interpret: bool | None = None, launch: Launch = DEFAULT_LAUNCH) -> jax.Array:
    """`ops.mla_decode.latent_attention` (same arguments and result, [B, H, r] float32) in one kernel,
    the cache split so that about `launch.latent_programs` programs run.

    With `layer`, `cache_BSW` is a stack [L, B, S, W] of layers' caches and the kernel reads layer
    `layer` (a traced int32 scalar) from it, so XLA passes the stack as it is (`mla_decode.LatentStack`)."""
    if layer is None:
        cache_LBSW, layer = cache_BSW[None], 0
    else:
        cache_LBSW = cache_BSW
    layer_1 = jnp.asarray(layer, jnp.int32).reshape(1)
    b, h, w = q_BHW.shape
    s = cache_LBSW.shape[2]
    rope = w - rank
    if not supported(rank, rope, s):
        raise ValueError(f"latent_attention_pallas: rank={rank}, rope={rope} must be powers of two and "
                         f"the cache's {s} slots a multiple of {BK}")
    hp = -(-h // BH) * BH
    q = jnp.pad(q_BHW, ((0, 0), (0, hp - h), (0, 0))).astype(cache_LBSW.dtype)  # zero heads: sliced off below
    n_hb = hp // BH
    n_sp = _splits(b, n_hb, s // BK, launch.latent_programs)
    used_blocks = (jnp.max(lengths_B) + BK - 1) // BK
    span = (((used_blocks + n_sp - 1) // n_sp) * BK).astype(jnp.int32).reshape(1)  # slots per split, run time
    lengths_B = lengths_B.astype(jnp.int32)
    part = pl.BlockSpec((None, None, None, BH), lambda bi, hi, si: (bi, si, hi, 0))
    m_bsh, l_bsh, acc = triton_call(
        functools.partial(_kernel, rank=rank, rope=rope, scale=scale),
        out_shape=[jax.ShapeDtypeStruct((b, n_sp, n_hb, BH), jnp.float32)] * 2
        + [jax.ShapeDtypeStruct((b, n_sp, n_hb, BH, rank), jnp.float32)],
        grid=(b, n_hb, n_sp),
        in_specs=[whole(a) for a in (lengths_B, span, layer_1, q, cache_LBSW)],
        out_specs=[part, part, pl.BlockSpec((None, None, None, BH, rank), lambda bi, hi, si: (bi, si, hi, 0, 0))],
        name="latent_attention",
        interpret=interpret, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )(lengths_B, span, layer_1, q, cache_LBSW)
    m_BSH = m_bsh.reshape(b, n_sp, hp)[..., :h]
    l_BSH = l_bsh.reshape(b, n_sp, hp)[..., :h]
    acc_BSHR = acc.reshape(b, n_sp, hp, rank)[:, :, :h]
    # merge the splits with the current token's row (always visible, so the maximum is finite)
    s_new_BH = jnp.einsum("bhw,bw->bh", q_BHW, new_BW, preferred_element_type=jnp.float32) * scale
    m_BH = jnp.maximum(s_new_BH, m_BSH.max(axis=1))
    w_BSH = jnp.exp(m_BSH - m_BH[:, None])
    w_new_BH = jnp.exp(s_new_BH - m_BH)
    l_BH = w_new_BH + jnp.sum(l_BSH * w_BSH, axis=1)
    acc_BHR = w_new_BH[..., None] * new_BW[:, None, :rank].astype(jnp.float32) + jnp.einsum(
        "bsh,bshr->bhr", w_BSH, acc_BSHR)
    return acc_BHR / l_BH[..., None]

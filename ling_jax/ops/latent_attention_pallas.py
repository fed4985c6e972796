"""Absorbed-MLA decode attention over the latent cache as one Pallas kernel per layer (split-K).

`ops.mla_decode.latent_attention` walks the cache in a `while` loop of XLA ops: each block of the
cache costs several small kernels and a device-to-host read of the loop predicate, so its cost grows
with the context (figures: BENCHMARKS.md, "Decode kernels alone"; docs/decode-performance.md). Here
one kernel does the whole walk: the grid is (row, block of BH heads, split), each program runs an
online softmax over its split of the used cache (splits are sized at run time from the longest row,
so a short context in a long allocation still spreads over every program; each loop stops at its
row's length, so slots past it are read only up to the end of their BK-slot block, and masked), and
XLA merges the splits' (max, sum, weighted latent) with the current token's row. The number of splits
(`Launch.latent_programs` programs in all) fills the GPU at batch 1 and drops to one per row at large
batch. With a float32 cache the result is the XLA loop's up to float32 rounding (the splits change
the summation order); a bf16 cache's scores are bf16 products accumulated in float32.

Triton on a GPU, interpret mode elsewhere (`Launch.interpret`, or the `interpret` argument). Needs
the latent rank and rope width to be powers of two (Ling: 512 and 64), see `supported`. The decode
step runs it where the `Kernels` record's `decode_mla` says so (`ling_jax.decode.layers.mla`).
GSPMD cannot split the kernel: under a multi-device mesh the decode step runs it per shard
(`sharding.per_shard`: rows over the token axes, as the cache is laid out, heads over tensor).

`latent_attention_paged_pallas` is the same kernel over a paged cache (the serving engine's pool of
fixed-size pages shared by all sequences, `ops.mla_decode.latent_attention_paged`): each block is
read from the page the row's page table names, the pool passed whole.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ling_jax.ops.pallas_gpu import DEFAULT_LAUNCH, Launch, is_pow2, triton_call, whole

BK = 64  # cache slots per loop step
BH = 16  # heads per program (the smallest dot Triton issues)
NUM_WARPS, NUM_STAGES = 4, 2  # with BK and `Launch.latent_programs`: the sweep's best (BENCHMARKS.md)
NEG = -1e30  # finite "minus infinity" for running maxima (exp(NEG - m) = 0, never NaN)


def supported(rank: int, rope: int, slots: int) -> bool:
    """Whether the kernel handles a latent of `rank` + `rope` and a cache of `slots` rows per sequence
    (or, for `latent_attention_paged_pallas`, a pool of `slots`-row pages)."""
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


def _kernel(*refs: Any, rank: int, rope: int, scale: float, page_size: int | None):
    """One (row, head block, split) program. Contiguous (`page_size` None): refs are (lengths, span,
    layer, q, cache [L, B, S, W], m, l, acc). Paged: (lengths, span, layer, page_table [B, N], q,
    pool [L, P, K, W], m, l, acc), the block of slots [pos, pos + BK) of row b read from page
    page_table[b, pos // K] at offset pos % K (K a multiple of BK and pos of BK, so a block never
    straddles two pages, and only the row's used pages are looked up)."""
    if page_size is None:
        len_ref, span_ref, layer_ref, q_ref, cache_ref, m_ref, l_ref, acc_ref = refs
    else:
        len_ref, span_ref, layer_ref, table_ref, q_ref, cache_ref, m_ref, l_ref, acc_ref = refs
    b, hb, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lay = layer_ref[0]  # the layer's index in the stack [L, B, S, W] or [L, P, K, W]
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
        if page_size is None:
            seq, slots = b, pl.ds(pos, BK)
        else:
            seq, slots = table_ref[b, jax.lax.div(pos, page_size)], pl.ds(jax.lax.rem(pos, page_size), BK)
        rows = pos + jax.lax.broadcasted_iota(jnp.int32, (BK, 1), 0)  # [BK, 1]
        c_lat = jnp.where(rows < stop, cache_ref[lay, seq, slots, pl.ds(0, rank)], 0)  # [BK, r]; rows past
        c_rot = cache_ref[lay, seq, slots, pl.ds(rank, rope)]  # the length zeroed: stale slots never count
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


def _split_k(q_BHW: jax.Array, store_L_W: jax.Array, table_BN: jax.Array | None, lengths_B: jax.Array,
             new_BW: jax.Array, *, layer: jax.Array | int, slots: int, rank: int, scale: float,
             interpret: bool | None, launch: Launch) -> jax.Array:
    """Launches `_kernel` over a cache stack [L, B, S, W] (`table_BN` None, `slots` = S) or a pool stack
    [L, P, K, W] read through `table_BN` [B, N] (`slots` = N·K), then merges the splits with the new
    row: [B, H, r] float32."""
    layer_1 = jnp.asarray(layer, jnp.int32).reshape(1)
    b, h, _ = q_BHW.shape
    rope = store_L_W.shape[-1] - rank
    hp = -(-h // BH) * BH
    q = jnp.pad(q_BHW, ((0, 0), (0, hp - h), (0, 0))).astype(store_L_W.dtype)  # zero heads: sliced off below
    n_hb = hp // BH
    n_sp = _splits(b, n_hb, slots // BK, launch.latent_programs)
    used_blocks = (jnp.max(lengths_B) + BK - 1) // BK
    span = (((used_blocks + n_sp - 1) // n_sp) * BK).astype(jnp.int32).reshape(1)  # slots per split, run time
    lengths_B = lengths_B.astype(jnp.int32)
    table = () if table_BN is None else (table_BN.astype(jnp.int32),)
    operands = (lengths_B, span, layer_1, *table, q, store_L_W)
    part = pl.BlockSpec((None, None, None, BH), lambda bi, hi, si: (bi, si, hi, 0))
    m_bsh, l_bsh, acc = triton_call(
        functools.partial(_kernel, rank=rank, rope=rope, scale=scale,
                          page_size=None if table_BN is None else store_L_W.shape[2]),
        out_shape=[jax.ShapeDtypeStruct((b, n_sp, n_hb, BH), jnp.float32)] * 2
        + [jax.ShapeDtypeStruct((b, n_sp, n_hb, BH, rank), jnp.float32)],
        grid=(b, n_hb, n_sp),
        in_specs=[whole(a) for a in operands],
        out_specs=[part, part, pl.BlockSpec((None, None, None, BH, rank), lambda bi, hi, si: (bi, si, hi, 0, 0))],
        name="latent_attention" if table_BN is None else "latent_attention_paged",
        interpret=launch.interpret if interpret is None else interpret, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )(*operands)
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


def latent_attention_pallas(q_BHW: jax.Array, cache_BSW: jax.Array, lengths_B: jax.Array, new_BW: jax.Array, *,
                            rank: int, scale: float, layer: jax.Array | int | None = None,
                            interpret: bool | None = None, launch: Launch = DEFAULT_LAUNCH) -> jax.Array:
    """`ops.mla_decode.latent_attention` (same arguments and result, [B, H, r] float32) in one kernel,
    the cache split so that about `launch.latent_programs` programs run.

    With `layer`, `cache_BSW` is a stack [L, B, S, W] of layers' caches and the kernel reads layer
    `layer` (a traced int32 scalar) from it, so XLA passes the stack as it is
    (`ling_jax.decode.views.LatentStack`)."""
    cache_LBSW = cache_BSW[None] if layer is None else cache_BSW
    s = cache_LBSW.shape[2]
    rope = q_BHW.shape[-1] - rank
    if not supported(rank, rope, s):
        raise ValueError(f"latent_attention_pallas: rank={rank}, rope={rope} must be powers of two and "
                         f"the cache's {s} slots a multiple of {BK}")
    return _split_k(q_BHW, cache_LBSW, None, lengths_B, new_BW, layer=0 if layer is None else layer, slots=s,
                    rank=rank, scale=scale, interpret=interpret, launch=launch)


def latent_attention_paged_pallas(q_BHW: jax.Array, pool_PKW: jax.Array, page_table_BN: jax.Array,
                                  lengths_B: jax.Array, new_BW: jax.Array, *, rank: int, scale: float,
                                  layer: jax.Array | int | None = None, interpret: bool | None = None,
                                  launch: Launch = DEFAULT_LAUNCH) -> jax.Array:
    """`ops.mla_decode.latent_attention_paged` (same arguments and result, [B, H, r] float32) in one
    kernel: the split-K walk of `latent_attention_pallas`, each block of BK slots read from the page
    the table names (a scalar load from the table per block), the pool passed whole, never copied.

    pool: [P, K, r + d_r], or with `layer` (an int or traced int32 scalar) a stack [L, P, K, r + d_r]
    read in place at that layer; K a multiple of BK, rank and rope powers of two (`supported(rank,
    rope, K)`), else ValueError. page_table: [B, N] integer page indices, lengths[b] <= N·K. Each row's
    program reads only its first ceil(lengths[b] / K) table entries and pages (the rest of the table
    may hold anything, out-of-range indices included); rows of its last page at or past lengths[b]
    may hold anything too (their latents are zeroed, their scores masked). Rows may share pages. The
    cache is split as if each row held N·K slots, so about `launch.latent_programs` programs run."""
    pool_LPKW = pool_PKW[None] if layer is None else pool_PKW
    name = "latent_attention_paged_pallas"
    if pool_LPKW.ndim != 4:
        want = "[L, P, K, W] with `layer`" if layer is not None else "[P, K, W]"
        raise ValueError(f"{name}: pool must be {want}, got shape {pool_PKW.shape}")
    b = q_BHW.shape[0]
    if page_table_BN.ndim != 2 or page_table_BN.shape[0] != b:
        raise ValueError(f"{name}: page_table must be [B={b}, max_pages], got shape {page_table_BN.shape}")
    page_size = pool_LPKW.shape[2]
    rope = q_BHW.shape[-1] - rank
    if not (is_pow2(rank) and is_pow2(rope)):
        raise ValueError(f"{name}: rank={rank}, rope={rope} must be powers of two")
    if not supported(rank, rope, page_size):
        raise ValueError(f"{name}: page_size {page_size} must be a multiple of the kernel's block of {BK} slots "
                         "(so that no block straddles two pages)")
    return _split_k(q_BHW, pool_LPKW, page_table_BN, lengths_B, new_BW, layer=0 if layer is None else layer,
                    slots=page_table_BN.shape[1] * page_size, rank=rank, scale=scale, interpret=interpret,
                    launch=launch)

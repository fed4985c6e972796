"""Decode attention over the absorbed-MLA latent cache (ARCHITECTURE.md §5.1).

Every head's query has been folded into the latent space (q_lat = W_UK^T q_nope, [r]) and
concatenated with its rotated rope part ([d_r]), so one dot with a cached row [c ‖ k_rot] gives
the score; the weighted sum of latents m = Σ p_j c_j is up-projected by W_UV afterwards. The
cache is walked in blocks up to the longest row's length only (never the whole allocation, which
may be 262144 slots), with an online softmax in float32, so each used cache row is read once per
step and no [B, H, S] score tensor is ever materialised.

Two layouts: `latent_attention` reads a contiguous cache [B, S, r + d_r] (one row of slots per
sequence); `latent_attention_paged` reads a pool of fixed-size pages shared by all sequences
through a page table (the serving engine's layout), one page per block.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _online_softmax(q_BHW: jax.Array, lengths_B: jax.Array, new_BW: jax.Array, fetch: Callable[[jax.Array], jax.Array],
                    *, block: int, rank: int, scale: float, zero_hidden: bool) -> jax.Array:
    """The blocked online softmax of both layouts: block i is `fetch(i)` [B, block, r + d_r], its rows
    i·block + k of row b visible while < lengths[b]; blocks run up to the longest row. With
    `zero_hidden`, hidden rows are zeroed before use, so whatever they hold (NaN included) never
    reaches the result; without it, their scores are masked but their latents are multiplied by 0."""
    b, h, _ = q_BHW.shape
    f32 = jnp.float32
    s_new_BH = jnp.einsum("bhw,bw->bh", q_BHW, new_BW, preferred_element_type=f32) * scale
    m_BH = s_new_BH
    l_BH = jnp.ones((b, h), f32)
    acc_BHR = new_BW[:, None, :rank].astype(f32) * jnp.ones((1, h, 1), f32)
    n_blocks = (jnp.max(lengths_B) + block - 1) // block

    def body(i, carry):
        m_BH, l_BH, acc_BHR = carry
        blk_BKW = fetch(i)
        visible = (i * block + jnp.arange(block))[None, :] < lengths_B[:, None]
        if zero_hidden:
            blk_BKW = jnp.where(visible[:, :, None], blk_BKW, jnp.zeros((), blk_BKW.dtype))
        s_BHK = jnp.einsum("bhw,bkw->bhk", q_BHW, blk_BKW, preferred_element_type=f32) * scale
        s_BHK = jnp.where(visible[:, None, :], s_BHK, -jnp.inf)
        m_new = jnp.maximum(m_BH, s_BHK.max(-1))
        p_BHK = jnp.exp(s_BHK - m_new[..., None])
        alpha = jnp.exp(m_BH - m_new)
        acc_BHR = acc_BHR * alpha[..., None] + jnp.einsum(
            "bhk,bkr->bhr", p_BHK.astype(blk_BKW.dtype), blk_BKW[..., :rank], preferred_element_type=f32)
        return m_new, l_BH * alpha + p_BHK.sum(-1), acc_BHR

    m_BH, l_BH, acc_BHR = jax.lax.fori_loop(0, n_blocks, body, (m_BH, l_BH, acc_BHR))
    return acc_BHR / l_BH[..., None]


def latent_attention(q_BHW: jax.Array, cache_BSW: jax.Array, lengths_B: jax.Array, new_BW: jax.Array, *,
                     rank: int, scale: float, block: int) -> jax.Array:
    """softmax over [cached rows j < lengths[b]] ∪ [the new row] of scale·(q·row), times c: [B, H, r] f32.

    q: [B, H, r + d_r]; cache: [B, S, r + d_r] with S a multiple of `block` (the cache's allocation
    granule, `ling_jax.cache.LATENT_BLOCK`); new: [B, r + d_r], the current token's row (not yet in
    the cache).
    """

    def fetch(i: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(cache_BSW, i * block, block, axis=1)

    return _online_softmax(q_BHW, lengths_B, new_BW, fetch, block=block, rank=rank, scale=scale, zero_hidden=False)


def latent_attention_paged(q_BHW: jax.Array, pool_PKW: jax.Array, page_table_BN: jax.Array, lengths_B: jax.Array,
                           new_BW: jax.Array, *, rank: int, scale: float,
                           layer: jax.Array | int | None = None) -> jax.Array:
    """`latent_attention` over a paged latent cache: [B, H, r] float32.

    pool: [P, K, r + d_r], P pages of K token rows each, shared by all sequences; with `layer` (an int
    or a traced int32 scalar), a stack [L, P, K, r + d_r] of layers' pools, of which layer `layer` is
    read in place (gathered page by page, never sliced whole). page_table: [B, N] integer page
    indices; cached position t < lengths[b] of row b is pool[page_table[b, t // K], t % K], so
    lengths[b] <= N·K. Only row b's first ceil(lengths[b] / K) entries matter: the rest, and the rows
    of its last page at or past lengths[b], may hold anything (an out-of-range index, a page of
    another sequence, NaN): they are zeroed before use and never reach the result. Rows may share
    pages. q: [B, H, r + d_r]; new: [B, r + d_r], the current token's row (not in the pool).

    The pages are walked one per block up to the longest row's length (each step gathers one page per
    row): op for op what `latent_attention` computes on the contiguous cache gathered through the table
    with `block` = K, the hidden rows zeroed first.
    """
    pool_LPKW = pool_PKW[None] if layer is None else pool_PKW
    if pool_LPKW.ndim != 4:
        want = "[L, P, K, W] with `layer`" if layer is not None else "[P, K, W]"
        raise ValueError(f"latent_attention_paged: pool must be {want}, got shape {pool_PKW.shape}")
    if page_table_BN.ndim != 2 or page_table_BN.shape[0] != q_BHW.shape[0]:
        raise ValueError(f"latent_attention_paged: page_table must be [B={q_BHW.shape[0]}, max_pages], "
                         f"got shape {page_table_BN.shape}")
    layer_ = jnp.asarray(0 if layer is None else layer, jnp.int32)
    page_size = pool_LPKW.shape[2]
    table_BN = page_table_BN.astype(jnp.int32)

    def fetch(i: jax.Array) -> jax.Array:
        pages_B = jax.lax.dynamic_index_in_dim(table_BN, i, axis=1, keepdims=False)
        return pool_LPKW.at[layer_, pages_B].get(mode="clip")  # [B, K, W]; one gather, clipped indices

    return _online_softmax(q_BHW, lengths_B, new_BW, fetch, block=page_size, rank=rank, scale=scale,
                           zero_hidden=True)

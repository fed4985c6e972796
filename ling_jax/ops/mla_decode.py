"""Decode attention over the absorbed-MLA latent cache (ARCHITECTURE.md §5.1).

Every head's query has been folded into the latent space (q_lat = W_UK^T q_nope, [r]) and
concatenated with its rotated rope part ([d_r]), so one dot with a cached row [c ‖ k_rot] gives
the score; the weighted sum of latents m = Σ p_j c_j is up-projected by W_UV afterwards. The
cache is walked in blocks up to the longest row's length only (never the whole allocation, which
may be 262144 slots), with an online softmax in float32, so each used cache row is read once per
step and no [B, H, S] score tensor is ever materialised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def latent_attention(q_BHW: jax.Array, cache_BSW: jax.Array, lengths_B: jax.Array, new_BW: jax.Array, *,
                     rank: int, scale: float, block: int) -> jax.Array:
    """softmax over [cached rows j < lengths[b]] ∪ [the new row] of scale·(q·row), times c: [B, H, r] f32.

    q: [B, H, r + d_r]; cache: [B, S, r + d_r] with S a multiple of `block` (the cache's allocation
    granule, `ling_jax.cache.LATENT_BLOCK`); new: [B, r + d_r], the current token's row (not yet in
    the cache).
    """
    b, h, _ = q_BHW.shape
    f32 = jnp.float32
    s_new_BH = jnp.einsum("bhw,bw->bh", q_BHW, new_BW, preferred_element_type=f32) * scale
    m_BH = s_new_BH
    l_BH = jnp.ones((b, h), f32)
    acc_BHR = new_BW[:, None, :rank].astype(f32) * jnp.ones((1, h, 1), f32)
    n_blocks = (jnp.max(lengths_B) + block - 1) // block

    def body(i, carry):
        m_BH, l_BH, acc_BHR = carry
        blk_BKW = jax.lax.dynamic_slice_in_dim(cache_BSW, i * block, block, axis=1)
        s_BHK = jnp.einsum("bhw,bkw->bhk", q_BHW, blk_BKW, preferred_element_type=f32) * scale
        visible = (i * block + jnp.arange(block))[None, :] < lengths_B[:, None]
        s_BHK = jnp.where(visible[:, None, :], s_BHK, -jnp.inf)
        m_new = jnp.maximum(m_BH, s_BHK.max(-1))
        p_BHK = jnp.exp(s_BHK - m_new[..., None])
        alpha = jnp.exp(m_BH - m_new)
        acc_BHR = acc_BHR * alpha[..., None] + jnp.einsum(
            "bhk,bkr->bhr", p_BHK.astype(cache_BSW.dtype), blk_BKW[..., :rank], preferred_element_type=f32)
        return m_new, l_BH * alpha + p_BHK.sum(-1), acc_BHR

    m_BH, l_BH, acc_BHR = jax.lax.fori_loop(0, n_blocks, body, (m_BH, l_BH, acc_BHR))
    return acc_BHR / l_BH[..., None]

"""Softmax attention for the MLA prefill / training path (expanded per-head K and V).

`attention` is the stable entry point; it takes a boolean mask built by `attention_mask` (causal,
key padding, and same-document for packed sequences) and computes the softmax in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite: a fully masked row (a padding query) yields garbage, never NaN


def attention_mask(q_pos_BT: jax.Array, k_pos_BS: jax.Array, k_valid_BS: jax.Array | None = None,
                   q_seg_BT: jax.Array | None = None, k_seg_BS: jax.Array | None = None) -> jax.Array:
    """[B, T, S] bool: key s visible to query t (causal by position, valid, same segment)."""
    m = k_pos_BS[:, None, :] <= q_pos_BT[:, :, None]
    if k_valid_BS is not None:
        m = m & k_valid_BS[:, None, :]
    if q_seg_BT is not None and k_seg_BS is not None:
        m = m & (q_seg_BT[:, :, None] == k_seg_BS[:, None, :])
    return m


def attention(q_BTHD: jax.Array, k_BSHD: jax.Array, v_BSHV: jax.Array, mask_BTS: jax.Array,
              *, scale: float) -> jax.Array:
    """softmax(q k^T * scale, masked) v per head: [B, T, H, V] in v's dtype; fp32 softmax."""
    s_BHTS = jnp.einsum("bthd,bshd->bhts", q_BTHD, k_BSHD,
                        preferred_element_type=jnp.float32) * scale
    s_BHTS = jnp.where(mask_BTS[:, None], s_BHTS, NEG_INF)
    p_BHTS = jax.nn.softmax(s_BHTS, axis=-1).astype(v_BSHV.dtype)
    return jnp.einsum("bhts,bshv->bthv", p_BHTS, v_BSHV)

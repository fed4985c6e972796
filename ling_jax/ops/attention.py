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
    return jnp.einsum("bhts,bshv->bthv", masked_softmax(s_BHTS, mask_BTS, v_BSHV.dtype), v_BSHV)


def masked_softmax(s_BHTS: jax.Array, mask_BTS: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Softmax over keys of float32 scores with invisible keys masked out, cast to `dtype`."""
    return jax.nn.softmax(jnp.where(mask_BTS[:, None], s_BHTS, NEG_INF), axis=-1).astype(dtype)

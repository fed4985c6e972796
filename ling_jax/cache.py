"""Decode caches: plain pytrees stacked like the params (`LingConfig.segments`).

Per KDA layer: the float32 recurrent state [B, H, K, V] and the short-conv window of the last
W-1 q/k/v projection inputs [B, W-1, 3P] (activation dtype). Per MLA layer: the absorbed latent
cache [B, S, r + d_r] — the normed latent c (r = kv_lora_rank) and the rotated shared rope key
(d_r) of every cached token, nothing per head (ARCHITECTURE.md §5). One `lengths` [B] vector
gives each row's number of cached tokens (= the position of its next token).

    {"segments": [run: {"state", "conv"} or {"latent"} with a leading [n] axis;
                  groups: {"kda": {"state", "conv"} [n, G-1, ...], "mla": {"latent"} [n, ...]}],
     "lengths": [B] int32}

The serving engine's cache is paged (`paged_cache_shapes`): each MLA leaf is {"pages": [n, P, K, W]},
a pool of P pages of K rows shared by all rows, and a page table [B, N] maps row b's position t to
page table[b, t // K], row t % K, so memory follows the tokens held, not B x max_len.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import LingConfig, Mixer
from ling_jax.sharding import constrain

Cache = dict[str, Any]
ROLES = {"state": "kda_state", "conv": "kda_conv", "latent": "mla_latent", "pages": "mla_pages"}  # leaf -> role
STORE_ROLES = {**ROLES, "state": "kda_state_store", "conv": "kda_conv_store"}  # `place(.., store=True)`
LATENT_BLOCK = 1024  # the latent cache length is allocated in multiples of this (decode attention block)


def cache_length(max_len: int) -> int:
    """Slots allocated for `max_len` tokens: rounded up to whole decode-attention blocks."""
    return -(-max_len // LATENT_BLOCK) * LATENT_BLOCK


def _mixer_cache(cfg: LingConfig, mixer: Mixer, lead: tuple[int, ...], batch: int,
                 latent: tuple[str, tuple[int, ...]], dtype: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """One stack's cache leaves; `latent`: the MLA leaf's name and shape after the stack axes
    ("latent", [B, S]: contiguous rows; "pages", [P, K]: a pool of pages)."""
    if mixer == "kda":
        h, dh = cfg.num_attention_heads, cfg.head_dim
        return {"state": jax.ShapeDtypeStruct((*lead, batch, h, dh, dh), jnp.float32),
                "conv": jax.ShapeDtypeStruct((*lead, batch, cfg.short_conv_kernel_size - 1, 3 * cfg.kda_dim), dtype)}
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    name, shape = latent
    return {name: jax.ShapeDtypeStruct((*lead, *shape, width), dtype)}


def _segment_caches(cfg: LingConfig, batch: int, latent: tuple[str, tuple[int, ...]], dtype: Any) -> list[Any]:
    segs: list[Any] = []
    for seg in cfg.segments:
        if seg.kind == "run":
            segs.append(_mixer_cache(cfg, seg.mixer, (seg.length,), batch, latent, dtype))
        else:
            segs.append({"kda": _mixer_cache(cfg, "kda", (seg.length, seg.kda_per_group), batch, latent, dtype),
                         "mla": _mixer_cache(cfg, "mla", (seg.length,), batch, latent, dtype)})
    return segs


def cache_shapes(cfg: LingConfig, batch: int, max_len: int, dtype: Any = jnp.bfloat16) -> Cache:
    """The cache pytree as ShapeDtypeStructs, for `batch` rows of up to `max_len` tokens."""
    segs = _segment_caches(cfg, batch, ("latent", (batch, cache_length(max_len))), jnp.dtype(dtype))
    return {"segments": segs, "lengths": jax.ShapeDtypeStruct((batch,), jnp.int32)}


def paged_cache_shapes(cfg: LingConfig, batch: int, num_pages: int, page_size: int,
                       dtype: Any = jnp.bfloat16) -> Cache:
    """A paged cache as ShapeDtypeStructs: per KDA layer the state and conv window of `batch` rows,
    per MLA layer a pool of `num_pages` pages of `page_size` latent rows ({"pages": [*lead, P, K, W]})
    shared by all rows, which a page table [B, N] (given with each call, `decode_step`) maps each
    row's positions into: position t of row b is page table[b, t // K], row t % K."""
    segs = _segment_caches(cfg, batch, ("pages", (num_pages, page_size)), jnp.dtype(dtype))
    return {"segments": segs, "lengths": jax.ShapeDtypeStruct((batch,), jnp.int32)}


def place(cache: Cache, *, store: bool = False) -> Cache:
    """The cache laid out by the sharding table's cache roles on the context mesh (identity without
    one): rows (and `lengths`) over the token axes, KDA heads over `tensor`, the latent whole per row,
    a page pool whole (stack axes unsplit), instead of whatever layout GSPMD would pick for the loop
    carry. `store`: a store of KDA snapshots read and written one row at a traced index (the engine's
    prefix cache): its rows whole, `lengths` replicated."""
    roles = STORE_ROLES if store else ROLES
    segs = jax.tree_util.tree_map_with_path(lambda path, x: constrain(x, roles[path[-1].key]), cache["segments"])
    return {"segments": segs, "lengths": constrain(cache["lengths"], "replicated" if store else "cache_rows")}


def init_cache(cfg: LingConfig, batch: int, max_len: int, dtype: Any = jnp.bfloat16) -> Cache:
    """An empty cache (zeros, lengths 0)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, batch, max_len, dtype))


def cache_bytes(cfg: LingConfig, batch: int, max_len: int, dtype: Any = jnp.bfloat16) -> dict[str, int]:
    """Bytes of the decode cache: MLA latent (grows with length), KDA state + conv (constant), total.

    Counts exactly `max_len` tokens (not the block-rounded allocation), per ARCHITECTURE.md §5.2:
    MLA = n_mla * (r + d_r) * itemsize per token per row.
    """
    itemsize = jnp.dtype(dtype).itemsize
    n_mla = sum(m == "mla" for m, _ in cfg.layer_kinds)
    n_kda = cfg.num_hidden_layers - n_mla
    h, dh = cfg.num_attention_heads, cfg.head_dim
    mla = batch * max_len * n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize
    state = batch * n_kda * h * dh * dh * 4
    conv = batch * n_kda * (cfg.short_conv_kernel_size - 1) * 3 * cfg.kda_dim * itemsize
    return {"mla_latent": mla, "kda_state": state, "kda_conv": conv, "total": mla + state + conv,
            "per_token_mla": n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize}


def nbytes(tree: Any) -> int:
    """Total bytes of the arrays (or ShapeDtypeStructs) of a pytree."""
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))

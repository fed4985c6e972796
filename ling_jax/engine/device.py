"""The engine's compiled functions over its paged cache: a prefill chunk into one slot, and decode steps
over every slot. Their shapes are fixed by the engine's configuration (chunk buckets, slots, pages),
so a serving loop compiles each once.

The cache is `cache.paged_cache_shapes(cfg, max_batch, num_pages, page_size)`: per slot the KDA
states and conv windows, per MLA layer one pool of pages. Page tables live on the host and come with
each call: [N] for the slot a chunk fills, [B, N] for a decode step; position t of a row is
page table[t // K], row t % K. Page 0 is never handed out: a free slot's table points there, and
its decode writes land there harmlessly. The engine's cache adds "tokens" [B] int32: each row's last
token sampled by a decode call, the next call's input (`decode_steps`).

A prompt's chunks carry its KDA state and windows from chunk to chunk in a one-row staging cache
(`paged_cache_shapes(cfg, 1, 1, page_size)`), not in its slot: decode steps run every slot, and would
advance the state of a slot still in its prompt. The last chunk writes the prompt's state into the
slot (JetStream's prefill, then insert); the chunks' latents go straight to the slot's pages.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ling_jax.cache import Cache, place
from ling_jax.config import LingConfig
from ling_jax.decode.sampling import logprobs, sample
from ling_jax.decode.step import decode_step
from ling_jax.kernels import Kernels
from ling_jax.layers.kda import kda_mixer
from ling_jax.layers.mla import mla_mixer
from ling_jax.model import decoder_layer, embed, lm_head, make_context, run_stack
from ling_jax.ops.norms import rms_norm
from ling_jax.params import Params

TOP_LOGPROBS = 5  # alternatives computed per token where log-probabilities are asked for


def _batch_axis(name: str, leaf: jax.Array) -> int:
    """The axis of a cache leaf that indexes rows (slots), after its stack axes."""
    return leaf.ndim - {"state": 4, "conv": 3}[name]


def _chunk_caches(cache: Cache, staging: Cache, page_table_N: jax.Array, fresh: jax.Array) -> list[Any]:
    """The per-layer caches a prefill chunk continues from: the staging row's KDA states and windows
    [.., 1, ..] (zeros where `fresh`: a prompt's first chunk) and, per MLA layer, the latent rows of the
    slot's pages [.., 1, N * K, W] (gathered, in position order)."""

    def take(path: Any, leaf: jax.Array, staged: jax.Array) -> jax.Array:
        if path[-1].key == "pages":  # [*lead, P, K, W] -> [*lead, 1, N * K, W]
            rows = jnp.take(leaf, page_table_N, axis=leaf.ndim - 3, mode="clip")
            return rows.reshape(*leaf.shape[:-3], 1, -1, leaf.shape[-1])
        return jnp.where(fresh, jnp.zeros_like(staged), staged)

    segs = jax.tree_util.tree_map_with_path(take, cache["segments"], staging["segments"])
    return jax.tree.map(lambda c: {"latent": c["pages"]} if "pages" in c else c, segs,
                        is_leaf=lambda c: isinstance(c, dict) and ("pages" in c or "state" in c))


def _write_back(cache: Cache, new: list[Any], slot: jax.Array, page_table_N: jax.Array | None = None,
                start: jax.Array | None = None, n_valid: jax.Array | None = None) -> list[Any]:
    """The cache's segments with the chunk's new KDA states and windows in `slot`, and (given the page
    table) its latent rows (positions start .. start + n_valid - 1) written into the slot's pages."""

    def put(path: Any, leaf: jax.Array, upd: jax.Array) -> jax.Array:
        name = path[-1].key
        if name == "pages" and page_table_N is None:
            return leaf
        if name == "pages":  # upd: the chunk's rows [*lead, 1, C, W]
            page_size, c = leaf.shape[-2], upd.shape[-2]
            pos = start + jnp.arange(c)
            in_table = jnp.minimum(pos // page_size, page_table_N.shape[0] - 1)
            page = jnp.where(jnp.arange(c) < n_valid, page_table_N[in_table], leaf.shape[-3])  # pads: dropped
            lead = (slice(None),) * (leaf.ndim - 3)
            return leaf.at[(*lead, page, pos % page_size)].set(upd.reshape(*upd.shape[:-3], c, -1), mode="drop")
        return jax.lax.dynamic_update_slice_in_dim(leaf, upd.astype(leaf.dtype), slot, axis=_batch_axis(name, leaf))

    new = jax.tree.map(lambda c: {"pages": c["latent"]} if "latent" in c else c, new,
                       is_leaf=lambda c: isinstance(c, dict) and ("latent" in c or "state" in c))
    return jax.tree_util.tree_map_with_path(put, cache["segments"], new)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4, 5))
def prefill_chunk(cfg: LingConfig, kernels: Kernels, prompt_logprobs: bool, params: Params, cache: Cache,
                  staging: Cache, page_table_N: jax.Array, slot: jax.Array, ids_C: jax.Array, start: jax.Array,
                  n_valid: jax.Array, targets_C: jax.Array, key: jax.Array, temperature: jax.Array,
                  top_k: jax.Array, top_p: jax.Array) -> tuple[Cache, Cache, dict[str, jax.Array]]:
    """Runs ids_C[:n_valid] at positions start .. start + n_valid - 1 of the prompt in `slot`,
    continuing its earlier chunks (KDA state and windows in `staging`, from zero where start == 0;
    MLA latents in the slot's pages: page_table_N must name pages for every position up to
    start + n_valid): (cache with the chunk's latents in the slot's pages, its KDA state and windows in
    the slot and its length start + n_valid; the staging cache with the state and windows; outputs).

    Outputs: "token" the next token sampled from the last valid position's logits (as `sample`, with
    `key` (key data) and token index 0: the request's first new token when this is its prompt's last
    chunk), "logprob" / "top_ids" / "top_logprobs" of that token ([], [n], [n]) and, with
    `prompt_logprobs`, per position i < n_valid the log-probability of targets_C[i] (the prompt's next
    token) and the top tokens ("prompt_logprob" [C], "prompt_top_ids" / "prompt_top_logprobs" [C, n]).
    The MLA layers attend over the slot's cached rows and the chunk in the absorbed form.
    """
    c = ids_C.shape[0]
    valid_1C = (jnp.arange(c) < n_valid)[None]
    positions_1C = (start + jnp.arange(c))[None]
    ctx = make_context(cfg, ids_C[None], attention_mask=valid_1C, positions=positions_1C)
    caches = _chunk_caches(cache, staging, page_table_N, start == 0)
    past = page_table_N.shape[0] * cache_page_size(cache)
    # MLA: every cached position before `start`, then the chunk as the sequence forms mask it
    mask_1CS = jnp.concatenate([jnp.broadcast_to(jnp.arange(past) < start, (1, c, past)), ctx.mask_BTS], axis=-1)

    def layer(p, x, lim, cache_l, mixer, ffn):
        def mix(pa, h):
            if mixer == "kda":
                return kda_mixer(pa, h, cfg=cfg, kernels=kernels, valid_BT=valid_1C, cache=cache_l)
            return mla_mixer(pa, h, cfg=cfg, kernels=kernels, cos=ctx.cos, sin=ctx.sin, mask_BTS=mask_1CS,
                             absorbed=True, past_BSW=cache_l["latent"])

        x, new, _ = decoder_layer(p, x, lim, cfg=cfg, kernels=kernels, ffn=ffn, mix=mix)
        return x, new

    x, new = run_stack(cfg, params, embed(params, ids_C[None]), layer, caches=caches)
    segs = _write_back(cache, new, slot, page_table_N, start, n_valid)
    staged = _write_back(staging, new, jnp.int32(0))
    lengths = cache["lengths"].at[slot].set(start + n_valid)
    h_CD = rms_norm(x[0], params["final_norm"], cfg.rms_norm_eps)
    last_1V = lm_head(cfg, params, jnp.take(h_CD, n_valid - 1, axis=0)[None])
    keys = jax.random.wrap_key_data(key[None])
    token = sample(last_1V, keys, jnp.int32(0), temperature, top_k, top_p)
    lp, top_ids, top_lp = logprobs(last_1V, token, TOP_LOGPROBS)
    out = {"token": token[0], "logprob": lp[0], "top_ids": top_ids[0], "top_logprobs": top_lp[0]}
    if prompt_logprobs:
        lp_C, ids_Cn, lps_Cn = logprobs(lm_head(cfg, params, h_CD), targets_C, TOP_LOGPROBS)
        out.update(prompt_logprob=lp_C, prompt_top_ids=ids_Cn, prompt_top_logprobs=lps_Cn)
    return {**cache, **place({"segments": segs, "lengths": lengths})}, {**staging, "segments": staged}, out


def cache_page_size(cache: Cache) -> int:
    """K, the rows per page of a paged cache."""
    return next(leaf.shape[-2] for path, leaf in jax.tree_util.tree_leaves_with_path(cache["segments"])
                if path[-1].key == "pages")


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))
def decode_steps(cfg: LingConfig, kernels: Kernels, steps: int, with_logprobs: bool, params: Params, cache: Cache,
                 page_table_BN: jax.Array, tokens_B: jax.Array, follow_B: jax.Array, keys_B: jax.Array,
                 index_B: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
                 top_p_B: jax.Array) -> tuple[Cache, dict[str, Any]]:
    """`steps` decode steps of every slot: row b consumes its input token at position lengths[b] and
    samples its next token with key data keys_B[b] at token index index_B[b] + i (its own temperature,
    top-k, top-p), step after step. The input token is the last one the previous decode call sampled
    for the row (cache["tokens"][b]) where follow_B[b], else tokens_B[b] (a row's first token, from its
    prefill): so a call can be dispatched before the host has read the previous one's tokens.
    page_table_BN must name pages for every position a row reaches (lengths[b] + steps - 1). Returns
    (cache with "tokens" the last step's samples, {"tokens": [steps, B]} and with `with_logprobs` the
    sampled tokens' log-probabilities [steps, B] and top tokens [steps, B, n]). `params`: with the fused
    decode weights (`decode.fuse_for_decode`)."""
    tokens_B = jnp.where(follow_B, cache["tokens"], tokens_B)
    cache = {"segments": cache["segments"], "lengths": cache["lengths"]}
    keys = jax.random.wrap_key_data(keys_B)
    b = tokens_B.shape[0]
    n = TOP_LOGPROBS

    def body(i, carry):
        cache, tok, out = carry
        cache, logits = decode_step(cfg, kernels, params, cache, tok, page_table=page_table_BN)
        nxt = sample(logits, keys, index_B + i, temperature_B, top_k_B, top_p_B)
        out = {**out, "tokens": out["tokens"].at[i].set(nxt)}
        if with_logprobs:
            lp, ids, lps = logprobs(logits, nxt, n)
            out = {**out, "logprob": out["logprob"].at[i].set(lp), "top_ids": out["top_ids"].at[i].set(ids),
                   "top_logprobs": out["top_logprobs"].at[i].set(lps)}
        return cache, nxt, out

    out: dict[str, Any] = {"tokens": jnp.zeros((steps, b), jnp.int32)}
    if with_logprobs:
        out.update(logprob=jnp.zeros((steps, b), jnp.float32), top_ids=jnp.zeros((steps, b, n), jnp.int32),
                   top_logprobs=jnp.zeros((steps, b, n), jnp.float32))
    cache, last, out = jax.lax.fori_loop(0, steps, body, (cache, tokens_B, out))
    return {**cache, "tokens": last}, out


@functools.partial(jax.jit, donate_argnums=(0,))
def save_snapshot(store: Cache, source: Cache, row: jax.Array, dst: jax.Array) -> Cache:
    """`store` with its row `dst` set to the KDA states and conv windows of `source`'s row `row` (the
    prefix cache's snapshot after a prefix: `source` is the staging cache of a prompt being prefilled)."""

    def put(path: Any, to: jax.Array, frm: jax.Array) -> jax.Array:
        name = path[-1].key
        if name == "pages":
            return to
        axis = _batch_axis(name, to)
        return jax.lax.dynamic_update_slice_in_dim(to, jax.lax.dynamic_slice_in_dim(frm, row, 1, axis), dst, axis)

    return {**store, "segments": jax.tree_util.tree_map_with_path(put, store["segments"], source["segments"])}


@functools.partial(jax.jit, donate_argnums=(0,))
def restore_snapshot(staging: Cache, store: Cache, row: jax.Array) -> Cache:
    """The staging cache holding snapshot `row`'s KDA states and conv windows (a prompt continuing a
    cached prefix)."""
    return save_snapshot(staging, store, row, jnp.int32(0))

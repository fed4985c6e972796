"""The engine's compiled functions over its paged cache: a prefill chunk into one slot, and decode steps
over every slot. Their shapes are fixed by the engine's configuration (chunk buckets, slots, pages),
so a serving loop compiles each once.

The cache is `cache.paged_cache_shapes(cfg, max_batch, num_pages, page_size)`: per slot the KDA
states and conv windows, per MLA layer one pool of pages. Page tables live on the host and come with
each call: [N] for the slot a chunk fills, [B, N] for a decode step; position t of a row is
page table[t // K], row t % K. Page 0 is never handed out: a free slot's table points there, and
its decode writes land there harmlessly. The engine's cache adds "tokens" [B] int32: each row's last
token sampled by a prefill or decode call, the next decode call's input (`decode_steps`).

A prefill call runs a chunk of each of R prompts ([R, C] tokens). A prompt's chunks carry its KDA
state and windows from chunk to chunk in a row of its own in a staging cache
(`paged_cache_shapes(cfg, rows, 1, page_size)`), not in its slot: decode steps run every slot, and
would advance the state of a slot still in its prompt. The last chunk writes the prompt's state into
the slot (JetStream's prefill, then insert); the chunks' latents go straight to the slot's pages.

Speculative decoding (`speculative_step`, the engine's `speculative_tokens=k`) adds a drafting state
(`Drafting`): the MTP layer's latent pool {"pages": [P, K, W]} and per slot the main model's
final-normed hidden states of the positions its last step accepted {"hidden": [B, k + 1, D]}; the
staging cache and the prefix cache's snapshots then carry the hidden state of their last position
too ("hidden" [rows, D]). The MTP pool is a pool of its own, read through the main pages' table: page
p of the main pools and page p of the MTP pool belong to the same request, so pages are taken,
shared and freed once for both, and the main leaves keep their layout (the plain decode step reads
them in place). The MTP row of position t (inputs: the token at t + 1 and the main hidden state at t)
is kept one page slot later, at t + 1: a page's MTP rows then depend on the tokens of its own prefix
only (its slots s hold positions s - 1, made from tokens up to s), so a prompt page the prefix cache
shares holds the right MTP rows for every prompt that starts with it, as its main rows do. A prompt's
MTP rows equal `verify.prefill_speculative`'s (to rounding): a chunk writes those whose next token it
holds, from the main hidden state the staging cache carries over the chunk boundary, and the first
speculative step writes the prompt's last position's, with the first new token.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ling_jax.cache import Cache, place
from ling_jax.config import LingConfig
from ling_jax.decode.sampling import logprobs, sample
from ling_jax.decode.speculative import TOKEN, accept, mtp_drafts
from ling_jax.decode.step import decode_step
from ling_jax.decode.verify import advance_kda, mtp_rows, verify_rows, verify_step
from ling_jax.kernels import Kernels
from ling_jax.layers.kda import kda_mixer
from ling_jax.layers.mla import mla_mixer
from ling_jax.model import decoder_layer, embed, lm_head, make_context, run_stack
from ling_jax.ops.norms import rms_norm
from ling_jax.params import Params
from ling_jax.sharding import constrain

TOP_LOGPROBS = 5  # alternatives computed per token where log-probabilities are asked for
Drafting = dict[str, jax.Array]  # speculative decoding's state: {"pages": the MTP pool, "hidden"} (module doc)


def _batch_axis(name: str, leaf: jax.Array) -> int:
    """The axis of a cache leaf that indexes rows (slots), after its stack axes."""
    return leaf.ndim - {"state": 4, "conv": 3}[name]


def _chunk_caches(cache: Cache, staging: Cache, page_table_RN: jax.Array, srow_R: jax.Array,
                  fresh_R: jax.Array) -> list[Any]:
    """The per-layer caches a prefill call's rows continue from: row r's KDA states and windows from
    staging row srow_R[r] [.., R, ..] (zeros where fresh_R[r]: a prompt's first chunk) and, per MLA
    layer, the latent rows of its slot's pages [.., R, N * K, W] (gathered, in position order)."""

    def take(path: Any, leaf: jax.Array, staged: jax.Array) -> jax.Array:
        if path[-1].key == "pages":
            return gather_pages(leaf, page_table_RN)
        axis = _batch_axis(path[-1].key, staged)
        rows = jnp.take(staged, srow_R, axis=axis, mode="clip")
        fresh = fresh_R.reshape((1,) * axis + (-1,) + (1,) * (staged.ndim - axis - 1))
        return jnp.where(fresh, jnp.zeros_like(rows), rows)

    return _as_latent(jax.tree_util.tree_map_with_path(take, cache["segments"], staging["segments"]))


def _as_latent(segs: list[Any]) -> list[Any]:
    """Segments with each MLA cache's gathered "pages" named "latent" (what the layers' sequence forms read)."""
    return jax.tree.map(lambda c: {"latent": c["pages"]} if "pages" in c else c, segs,
                        is_leaf=lambda c: isinstance(c, dict) and ("pages" in c or "state" in c))


def gather_pages(pool: jax.Array, page_table_BN: jax.Array) -> jax.Array:
    """The rows of each table's pages in position order: pool [*lead, P, K, W] -> [*lead, B, N * K, W]."""
    rows = jnp.take(pool, page_table_BN, axis=pool.ndim - 3, mode="clip")
    return rows.reshape(*pool.shape[:-3], page_table_BN.shape[0], -1, pool.shape[-1])


def write_pages(pool: jax.Array, rows_BTW: jax.Array, page_table_BN: jax.Array, pos_BT: jax.Array,
                valid_BT: jax.Array) -> jax.Array:
    """pool [*lead, P, K, W] with rows [*lead, B, T, W] written at positions pos [B, T] of each row's
    pages (table [B, N]); rows not `valid` are dropped."""
    page_size = pool.shape[-2]
    in_table = jnp.minimum(pos_BT // page_size, page_table_BN.shape[1] - 1)
    page = jnp.where(valid_BT, jnp.take_along_axis(page_table_BN, in_table, axis=1), pool.shape[-3])
    lead = (slice(None),) * (pool.ndim - 3)
    return pool.at[(*lead, page, pos_BT % page_size)].set(rows_BTW.astype(pool.dtype), mode="drop")


def _write_back(cache: Cache, new: list[Any], rows_R: jax.Array, page_table_RN: jax.Array | None = None,
                start_R: jax.Array | None = None, n_valid_R: jax.Array | None = None) -> list[Any]:
    """The cache's segments with row r of a call's new KDA states and windows in its row rows_R[r] (rows
    out of range are dropped) and, given the page tables, its latent rows (positions start_R[r] ..
    start_R[r] + n_valid_R[r] - 1) written into its pages."""

    def put(path: Any, leaf: jax.Array, upd: jax.Array) -> jax.Array:
        name = path[-1].key
        if name == "pages" and page_table_RN is None:
            return leaf
        if name == "pages":  # upd: the call's rows [*lead, R, C, W]; pads dropped
            i_RC = start_R[:, None] + jnp.arange(upd.shape[-2])[None]
            return write_pages(leaf, upd, page_table_RN, i_RC, i_RC < (start_R + n_valid_R)[:, None])
        index = (slice(None),) * _batch_axis(name, leaf) + (rows_R,)
        return leaf.at[index].set(upd.astype(leaf.dtype), mode="drop")

    new = jax.tree.map(lambda c: {"pages": c["latent"]} if "latent" in c else c, new,
                       is_leaf=lambda c: isinstance(c, dict) and ("latent" in c or "state" in c))
    return jax.tree_util.tree_map_with_path(put, cache["segments"], new)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5, 6, 7))
def prefill_chunk(cfg: LingConfig, kernels: Kernels, prompt_logprobs: bool, unroll: bool, params: Params, cache: Cache,
                  staging: Cache, drafting: Drafting | None, page_table_RN: jax.Array, slot_R: jax.Array,
                  srow_R: jax.Array, ids_RC: jax.Array, start_R: jax.Array, n_valid_R: jax.Array,
                  targets_RC: jax.Array, key_R: jax.Array, temperature_R: jax.Array, top_k_R: jax.Array,
                  top_p_R: jax.Array) -> tuple[Cache, Cache, Drafting | None, dict[str, jax.Array]]:
    """A prefill chunk of R prompts at once. Row r runs ids_RC[r, :n_valid_R[r]] at positions
    start_R[r] .. start_R[r] + n_valid_R[r] - 1 of the prompt in slot slot_R[r], continuing its earlier
    chunks (KDA state and windows in staging row srow_R[r], from zero where start == 0; MLA latents in
    the slot's pages: page_table_RN[r] must name pages for every position up to start + n_valid). A row
    with n_valid 0 is padding: it writes nothing. Returns (cache with the chunks' latents in the slots'
    pages, their KDA states and windows in the slots, their lengths start + n_valid and their "tokens"
    the "token" output (where the engine keeps it: a prompt's last chunk gives its first new token,
    the next decode call's input without a host round trip); the staging
    cache with the states and windows in the rows' staging rows; the drafting state; outputs).

    With `drafting` (speculative decoding, module doc; None: without) a row also writes the MTP
    layer's rows of positions start - 1 .. start + n_valid - 2 (each needs the next token, so a chunk's
    last position waits for the next chunk, the prompt's last for the first new token), from the main
    hidden state at start - 1 that its staging row's "hidden" carries; that and the slot's drafting
    hidden row 0 take the last valid position's.

    Outputs per row: "token" [R] the next token sampled from the last valid position's logits (as
    `sample`, with key data key_R[r] and token index 0; with `drafting`, `speculative_loop`'s first
    token: key fold_in(key, 0), purpose TOKEN) — the request's first new token when this is its
    prompt's last chunk; "logprob" / "top_ids" / "top_logprobs" of that token ([R], [R, n], [R, n]) and,
    with `prompt_logprobs`, per position i < n_valid the log-probability of targets_RC[r, i] (the
    prompt's next token) and the top tokens ("prompt_logprob" [R, C], "prompt_top_ids" /
    "prompt_top_logprobs" [R, C, n]). The MLA layers attend over each slot's cached rows and its chunk
    in the absorbed form. `unroll`: the layers as one straight-line program instead of scans over the
    layer stacks (longer compiles).
    """
    r, c = ids_RC.shape
    valid_RC = jnp.arange(c)[None] < n_valid_R[:, None]
    positions_RC = start_R[:, None] + jnp.arange(c)[None]
    ctx = make_context(cfg, ids_RC, attention_mask=valid_RC, positions=positions_RC)
    caches = _chunk_caches(cache, staging, page_table_RN, srow_R, start_R == 0)
    past = page_table_RN.shape[1] * cache_page_size(cache)
    # MLA: every cached position before `start`, then the chunk as the sequence forms mask it
    cached_RCS = jnp.broadcast_to((jnp.arange(past)[None] < start_R[:, None])[:, None], (r, c, past))
    mask_RCS = jnp.concatenate([cached_RCS, ctx.mask_BTS], axis=-1)

    def layer(p, x, lim, cache_l, mixer, ffn):
        def mix(pa, h):
            if mixer == "kda":
                return kda_mixer(pa, h, cfg=cfg, kernels=kernels, valid_BT=valid_RC, cache=cache_l)
            return mla_mixer(pa, h, cfg=cfg, kernels=kernels, cos=ctx.cos, sin=ctx.sin, mask_BTS=mask_RCS,
                             absorbed=True, past_BSW=cache_l["latent"])

        x, new, _ = decoder_layer(p, x, lim, cfg=cfg, kernels=kernels, ffn=ffn, mix=mix)
        return x, new

    x, new = run_stack(cfg, params, embed(params, ids_RC), layer, caches=caches, unroll=unroll)
    # the writes below wait for the last layer: else XLA may write a segment's new latents into its pool
    # before that segment's attention has read the pool, and copies every pool to keep the old rows
    x, new = jax.lax.optimization_barrier((x, new))
    real_R = n_valid_R > 0
    slot_R = jnp.where(real_R, slot_R, cache["lengths"].shape[0])  # padding rows: out of range, dropped
    srow_R = jnp.where(real_R, srow_R, staging["lengths"].shape[0])
    segs = _write_back(cache, new, slot_R, page_table_RN, start_R, n_valid_R)
    staged = {**staging, "segments": _write_back(staging, new, srow_R)}
    lengths = cache["lengths"].at[slot_R].set(start_R + n_valid_R, mode="drop")
    h_RCD = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    last_R = jnp.maximum(n_valid_R - 1, 0)
    h_RD = jnp.take_along_axis(h_RCD, last_R[:, None, None], axis=1)[:, 0]
    last_RV = lm_head(cfg, params, h_RD)
    keys, step = jax.random.wrap_key_data(key_R), jnp.int32(0)
    if drafting is not None:
        drafting, staged = _draft_rows(cfg, params, drafting, staged, h_RCD, h_RD, ids_RC, page_table_RN, slot_R,
                                       srow_R, start_R, n_valid_R)
        keys, step = jax.vmap(jax.random.fold_in)(keys, jnp.zeros((r,), jnp.uint32)), jnp.int32(TOKEN)
    token = sample(last_RV, keys, step, temperature_R, top_k_R, top_p_R)
    lp, top_ids, top_lp = logprobs(last_RV, token, TOP_LOGPROBS)
    out = {"token": token, "logprob": lp, "top_ids": top_ids, "top_logprobs": top_lp}
    if prompt_logprobs:
        lp_n, ids_nk, lps_nk = logprobs(lm_head(cfg, params, h_RCD.reshape(r * c, -1)), targets_RC.reshape(-1),
                                        TOP_LOGPROBS)
        out.update(prompt_logprob=lp_n.reshape(r, c), prompt_top_ids=ids_nk.reshape(r, c, -1),
                   prompt_top_logprobs=lps_nk.reshape(r, c, -1))
    new_cache = place({"segments": segs, "lengths": lengths})
    if "tokens" in cache:
        new_cache["tokens"] = constrain(cache["tokens"].at[slot_R].set(token, mode="drop"), "cache_rows")
    return ({**cache, **new_cache}, _placed(staged),
            place_drafting(drafting) if drafting is not None else None, out)


def _draft_rows(cfg: LingConfig, params: Params, drafting: Drafting, staging: Cache, h_RCD: jax.Array,
                h_RD: jax.Array, ids_RC: jax.Array, page_table_RN: jax.Array, slot_R: jax.Array, srow_R: jax.Array,
                start_R: jax.Array, n_valid_R: jax.Array) -> tuple[Drafting, Cache]:
    """A prefill call's MTP rows (`prefill_chunk`): row r's MTP position start - 1 + i (inputs: its
    token i and the main hidden state one position before it) into page slot start + i, i < n_valid
    (slot 0, position -1, has none); its last valid hidden state h_RD[r] into its staging row and its
    slot's drafting row 0 (`slot_R` / `srow_R` out of range for padding rows: dropped)."""
    c = ids_RC.shape[1]
    slots_RC = start_R[:, None] + jnp.arange(c)[None]
    before_RD = jnp.take(staging["hidden"], srow_R, axis=0, mode="clip")
    rows = mtp_rows(cfg, params, ids_RC, jnp.concatenate([before_RD[:, None], h_RCD[:, :-1]], axis=1), slots_RC - 1)
    pages = write_pages(drafting["pages"], rows, page_table_RN, slots_RC,
                        (jnp.arange(c)[None] < n_valid_R[:, None]) & (slots_RC > 0))
    return ({"pages": pages, "hidden": drafting["hidden"].at[slot_R, 0].set(h_RD, mode="drop")},
            {**staging, "hidden": staging["hidden"].at[srow_R].set(h_RD, mode="drop")})


def place_drafting(drafting: Drafting) -> Drafting:
    """The drafting state laid out on the context mesh (identity without one): the MTP pool whole, as
    the main pools; the hidden states [B, k + 1, D] with the rows."""
    return {"pages": constrain(drafting["pages"], "mla_pages"), "hidden": constrain(drafting["hidden"], "act_btd")}


def _placed(cache: Cache, store: bool = False) -> Cache:
    """`cache.place` of a staging cache or snapshot store, its "hidden" rows (where it has them) whole."""
    out = {**cache, **place(cache, store=store)}
    if "hidden" in cache:
        out["hidden"] = constrain(cache["hidden"], "replicated")
    return out


def empty(shapes: Cache, extra: dict[str, jax.Array] | None = None, *, tokens: bool = False,
          store: bool = False) -> Cache:
    """Zeros of the paged cache `shapes` (`cache.paged_cache_shapes`) laid out by the sharding table on
    the context mesh (`cache.place`; `store`: as a snapshot store), with the arrays of `extra` and with
    `tokens` the engine's "tokens" [B] int32 (with the rows), committed to their devices: the layout
    every function here returns its caches in, so that no function compiles a second time for its own
    outputs."""

    def build() -> Cache:
        zeros = _placed({**jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), **(extra or {})}, store)
        if tokens:
            zeros["tokens"] = constrain(jnp.zeros(shapes["lengths"].shape, jnp.int32), "cache_rows")
        return zeros

    return jax.tree.map(lambda a: jax.device_put(a, a.sharding), jax.jit(build)())


def cache_page_size(cache: Cache) -> int:
    """K, the rows per page of a paged cache."""
    return next(leaf.shape[-2] for path, leaf in jax.tree_util.tree_leaves_with_path(cache["segments"])
                if path[-1].key == "pages")


SNAPSHOTS_PER_STEP = 4  # output snapshots one decode step may take (`decode_steps`' snap_rows_SM)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6, 15))
def decode_steps(cfg: LingConfig, kernels: Kernels, steps: int, with_logprobs: bool, sampling: bool, params: Params,
                 cache: Cache, page_table_BN: jax.Array, tokens_B: jax.Array, follow_B: jax.Array,
                 keys_B: jax.Array, index_B: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
                 top_p_B: jax.Array, store: Cache | None = None, snap_rows_SM: jax.Array | None = None,
                 snap_dst_SM: jax.Array | None = None) -> tuple[Cache, Cache | None, dict[str, Any]]:
    """`steps` decode steps of slots 0 .. R - 1, R = the length of the per-row inputs (R <= B, the cache's
    slots; the engine's decode buckets): the slots from R on are left as they are. Row b consumes its
    input token at position lengths[b] and samples its next token with key data keys_B[b] at token
    index index_B[b] + i (its own temperature, top-k, top-p), step after step; `sampling` False: every
    row's argmax (no row samples), True: `sample`'s sampled form. The trip count and the sampling form
    are static and the loop holds no conditional, so that XLA on a GPU runs the call without reading
    anything back to the host: the call returns once it is enqueued, and the host's work overlaps the
    device's (output snapshots included: `_snapshot_rows`). The input token is the last
    one the previous decode call sampled for the row (cache["tokens"][b]) where follow_B[b], else
    tokens_B[b] (a row's first token, from its prefill): so a call can be dispatched before the host
    has read the previous one's tokens. page_table_BN must name pages for every position a row reaches
    (lengths[b] + steps - 1). Returns (cache with "tokens" the last step's samples, {"tokens":
    [steps, B]} and with `with_logprobs` the sampled tokens' log-probabilities [steps, B] and top
    tokens [steps, B, n]). `params`: with the fused decode weights (`decode.fuse_for_decode`).

    With a prefix-cache `store` (output snapshots): after step i, for each m, row snap_rows_SM[i, m]
    (< R; R or more: none) has its KDA states and conv windows copied into store row snap_dst_SM[i, m]
    ([steps, SNAPSHOTS_PER_STEP] int32): the state after the positions up to lengths[b] + i, a page
    boundary the engine chose. Returns (cache, store or None, outputs)."""
    b = tokens_B.shape[0]
    whole = cache
    cache = _first_rows(cache, b)
    tokens_B = jnp.where(follow_B, cache["tokens"], tokens_B)
    cache = {"segments": cache["segments"], "lengths": cache["lengths"]}
    keys = jax.random.wrap_key_data(keys_B)
    n = TOP_LOGPROBS

    def body(i, carry):
        cache, store, tok, out = carry
        cache, logits = decode_step(cfg, kernels, params, cache, tok, page_table=page_table_BN)
        if store is not None:
            store = _snapshot_rows(store, cache, snap_rows_SM[i], snap_dst_SM[i], b)
        nxt = sample(logits, keys, index_B + i, temperature_B, top_k_B, top_p_B, sampling=sampling)
        out = {**out, "tokens": out["tokens"].at[i].set(nxt)}
        if with_logprobs:
            lp, ids, lps = logprobs(logits, nxt, n)
            out = {**out, "logprob": out["logprob"].at[i].set(lp), "top_ids": out["top_ids"].at[i].set(ids),
                   "top_logprobs": out["top_logprobs"].at[i].set(lps)}
        return cache, store, nxt, out

    out: dict[str, Any] = {"tokens": jnp.zeros((steps, b), jnp.int32)}
    if with_logprobs:
        out.update(logprob=jnp.zeros((steps, b), jnp.float32), top_ids=jnp.zeros((steps, b, n), jnp.int32),
                   top_logprobs=jnp.zeros((steps, b, n), jnp.float32))
    cache, store, last, out = jax.lax.fori_loop(0, steps, body, (cache, store, tokens_B, out))
    return (_put_first_rows(whole, {**cache, "tokens": last}), _placed(store, store=True) if store is not None
            else None, out)


def _first_rows(cache: Cache, r: int) -> Cache:
    """The engine cache's slots 0 .. r - 1 (KDA states and windows, "lengths", "tokens"; the page pools
    whole): the cache itself where r is all of them."""
    if r == cache["lengths"].shape[0]:
        return cache

    def take(path: Any, leaf: jax.Array) -> jax.Array:
        name = path[-1].key
        return leaf if name == "pages" else jax.lax.slice_in_dim(leaf, 0, r, axis=_batch_axis(name, leaf))

    return {"segments": jax.tree_util.tree_map_with_path(take, cache["segments"]),
            "lengths": cache["lengths"][:r], "tokens": cache["tokens"][:r]}


def _put_first_rows(cache: Cache, rows: Cache) -> Cache:
    """`cache` with its first slots replaced by `rows` (`_first_rows`' layout) and its page pools by
    theirs, laid out as `empty` lays them out."""
    if rows["lengths"].shape[0] == cache["lengths"].shape[0]:
        return {**rows, "tokens": constrain(rows["tokens"], "cache_rows")}

    def put(path: Any, leaf: jax.Array, new: jax.Array) -> jax.Array:
        name = path[-1].key
        return new if name == "pages" else jax.lax.dynamic_update_slice_in_dim(leaf, new, 0, _batch_axis(name, leaf))

    return {"segments": jax.tree_util.tree_map_with_path(put, cache["segments"], rows["segments"]),
            "lengths": constrain(cache["lengths"].at[:rows["lengths"].shape[0]].set(rows["lengths"]), "cache_rows"),
            "tokens": constrain(cache["tokens"].at[:rows["tokens"].shape[0]].set(rows["tokens"]), "cache_rows")}


def _snapshot_rows(store: Cache, cache: Cache, rows_M: jax.Array, dst_M: jax.Array, b: int) -> Cache:
    """`store` with row dst_M[m] set to the KDA states and conv windows of `cache`'s row rows_M[m], for
    each m with rows_M[m] < b (the others write nothing): one scatter per leaf, without a conditional,
    so that a decode call that takes output snapshots reads nothing back to the host."""
    dst_M = jnp.where(rows_M < b, dst_M, store["lengths"].shape[0])  # out of range: dropped
    rows_M = jnp.minimum(rows_M, b - 1)

    def put(path: Any, leaf: jax.Array, frm: jax.Array) -> jax.Array:
        name = path[-1].key
        if name == "pages":
            return leaf
        axis = _batch_axis(name, leaf)
        index = (slice(None),) * axis + (dst_M,)
        return leaf.at[index].set(jnp.take(frm, rows_M, axis=axis).astype(leaf.dtype), mode="drop")

    return {**store, "segments": jax.tree_util.tree_map_with_path(put, store["segments"], cache["segments"])}


def _copy_row(to: Cache, source: Cache, row: jax.Array, dst: jax.Array) -> Cache:
    """`to` with its row `dst` set to the KDA states and conv windows (and, where both have one, the
    "hidden" row) of `source`'s row `row`."""

    def put(path: Any, leaf: jax.Array, frm: jax.Array) -> jax.Array:
        name = path[-1].key
        if name == "pages":
            return leaf
        axis = _batch_axis(name, leaf)
        return jax.lax.dynamic_update_slice_in_dim(leaf, jax.lax.dynamic_slice_in_dim(frm, row, 1, axis), dst, axis)

    out = {**to, "segments": jax.tree_util.tree_map_with_path(put, to["segments"], source["segments"])}
    if "hidden" in to:  # speculative decoding: the main hidden state of the prefix's last token
        out["hidden"] = jax.lax.dynamic_update_slice_in_dim(
            to["hidden"], jax.lax.dynamic_slice_in_dim(source["hidden"], row, 1, 0), dst, 0)
    return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnums=(7, 8))
def speculative_step(cfg: LingConfig, kernels: Kernels, k: int, with_logprobs: bool, verify: Kernels | None,
                     sampled: bool, params: Params,
                     cache: Cache, drafting: Drafting, page_table_BN: jax.Array, active_B: jax.Array,
                     tokens_BT: jax.Array, m_B: jax.Array, keys_B: jax.Array, index_B: jax.Array,
                     temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array,
                     forced_BK: jax.Array | None = None) -> tuple[Cache, Drafting, dict[str, Any]]:
    """One speculative step of every `active` row (`ling_jax.decode.speculative`, module doc 1-3): the MTP layer drafts
    k tokens, the main model verifies the k + 1 positions lengths[b] .. lengths[b] + k, and each row commits its
    accepted drafts and the main model's next token.

    Row b's last step accepted the m[b] tokens tokens_BT[b, :m[b]] (after its prefill: m = 1, its first new token),
    the tokens after positions lengths[b] - m[b] .. lengths[b] - 1, whose main hidden states are
    drafting["hidden"][b, :m[b]]; the last of them is the one not yet run. Its draws use key data keys_B[b] at
    output index index_B[b] (its tokens so far) as `speculative_loop`'s do, with its own temperature, top-k and
    top-p; `sampled` False: every row greedy (no row samples), True: the drafts' and the acceptance's sampled forms
    (greedy rows still exact) -- static, so that the call holds no conditional for XLA on a GPU to read back (as
    `decode_steps`'s `sampling`). page_table_BN must name pages for positions up to lengths[b] + k (the verify's
    latent rows; the MTP rows of positions up to lengths[b] + k - 1 are kept one page slot later, module doc).
    Returns (cache: the main latent rows written, each active row's KDA state and windows after its a[b] = accepted
    + 1 tokens, lengths + a; drafting: the MTP rows of the drafted positions, the verified positions' hidden states;
    outputs: "tokens" [B, k + 1] (the a[b] first are the row's new tokens), "accepted" [B] (a[b] - 1), and with
    `with_logprobs` the tokens' log-probabilities under the main model [B, k + 1] and top tokens [B, k + 1, n]).
    Rows not active change nothing: no page writes, their KDA state, length and drafting row as they were.

    `verify` (a decode record of unrolled layers, `kernels.select(..., decode=True, unroll=True)`): the
    verify runs in the decode step's row form (`verify.verify_rows`: the k + 1 positions as rows of the
    decode kernels, the latent rows written into the pages as it runs, the pool read in place by the
    paged kernel), and the MTP layer drafts in that form too over its gathered pages; None: both run
    their sequence forms (`kernels`, a record for them; layers unrolled), over each row's pages
    gathered into [B, N * K, W] rows. `forced_BK` (a test hook, as `speculative_loop`'s): the drafts to
    verify, with q = 1 on them, instead of the MTP layer's (whose rows are then not written).
    """
    b, t = tokens_BT.shape
    lengths = cache["lengths"]
    keys = jax.random.wrap_key_data(keys_B)
    sampling = (temperature_B, top_k_B, top_p_B)
    pages = drafting["pages"]
    if forced_BK is None:
        slots_BSW = gather_pages(pages, page_table_BN)  # slot s: MTP position s - 1
        latent = jnp.concatenate([slots_BSW[:, 1:], jnp.zeros_like(slots_BSW[:, :1])], axis=1)
        # rows not active draft from position 0 (what they draft is dropped; no read past their pages)
        drafts, logq, latent = mtp_drafts(cfg, kernels, params, latent, tokens_BT, drafting["hidden"], m_B,
                                          jnp.where(active_B, lengths, m_B), keys, index_B, sampling, k, verify,
                                          sampled)
        # the rows drafting wrote: positions lengths - m .. lengths + k - 1 (some as they were)
        pos_BJ = (lengths - m_B)[:, None] + jnp.arange(2 * k + 1)[None]
        rows = jnp.take_along_axis(latent, pos_BJ[..., None], axis=1, mode="clip")
        written = active_B[:, None] & (pos_BJ < (lengths + k)[:, None]) & (pos_BJ + 1 < latent.shape[1])
        pages = write_pages(pages, rows, page_table_BN, pos_BJ + 1, written)
    else:
        drafts = forced_BK
        logq = jnp.where(jnp.arange(cfg.vocab_size) == drafts[..., None], 0.0, -jnp.inf)
    pending = jnp.take_along_axis(tokens_BT, (m_B - 1)[:, None], axis=1)
    verified_BT = jnp.concatenate([pending, drafts], axis=1)
    if verify is not None:  # rows not active read nothing (length 0) and write nothing
        logits_BTV, h_BTD, new = verify_rows(cfg, verify, params, {**cache, "lengths": jnp.where(active_B, lengths, 0)},
                                             verified_BT, page_table_BN, active_B)
    else:
        view = jax.tree_util.tree_map_with_path(
            lambda path, leaf: gather_pages(leaf, page_table_BN) if path[-1].key == "pages" else leaf,
            cache["segments"])
        logits_BTV, h_BTD, new = verify_step(cfg, kernels, params, {"segments": _as_latent(view), "lengths": lengths},
                                             verified_BT, True)
    # the page writes below wait for the last layer (as `prefill_chunk`'s): no pool copied
    logits_BTV, h_BTD, new = jax.lax.optimization_barrier((logits_BTV, h_BTD, new))
    n, final = accept(logits_BTV, drafts, logq, keys, index_B, *sampling, sampling=sampled)
    advance = jnp.where(active_B, n + 1, 0)
    pos_BT = lengths[:, None] + jnp.arange(t)[None]
    valid_BT = jnp.broadcast_to(active_B[:, None], (b, t))

    def merge(c: dict, y: Any) -> dict:
        if "pages" in c:  # (the row form wrote them)
            return y if isinstance(y, dict) else {"pages": write_pages(c["pages"], y, page_table_BN, pos_BT, valid_BT)}
        return advance_kda(c, y, advance)

    segs = [merge(c, y) if "kda" not in c else {name: merge(c[name], y[name]) for name in c}
            for c, y in zip(cache["segments"], new, strict=True)]
    slot_T = jnp.arange(t)[None]
    tokens = jnp.where(slot_T < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), final[:, None])
    out: dict[str, Any] = {"tokens": tokens, "accepted": n}
    if with_logprobs:
        lp, ids, lps = logprobs(logits_BTV.reshape(b * t, -1), tokens.reshape(-1), TOP_LOGPROBS)
        out.update(logprob=lp.reshape(b, t), top_ids=ids.reshape(b, t, -1), top_logprobs=lps.reshape(b, t, -1))
    hidden = jnp.where(active_B[:, None, None], h_BTD.astype(drafting["hidden"].dtype), drafting["hidden"])
    return ({**cache, **place({"segments": segs, "lengths": lengths + advance})},
            place_drafting({"pages": pages, "hidden": hidden}), out)


@functools.partial(jax.jit, donate_argnums=(0,))
def save_snapshot(store: Cache, source: Cache, row: jax.Array, dst: jax.Array) -> Cache:
    """`store` with its row `dst` set to the KDA states and conv windows (and, where both have one, the
    "hidden" row) of `source`'s row `row` (the prefix cache's snapshot after a prefix: `source` is the
    staging cache of a prompt being prefilled), laid out as a store (`cache.place(.., store=True)`:
    rows whole, so a row moves alone)."""
    out = _copy_row(store, source, row, dst)
    return _placed(out, store=True)


@functools.partial(jax.jit, donate_argnums=(0,))
def restore_snapshot(staging: Cache, store: Cache, row: jax.Array, dst: jax.Array) -> Cache:
    """The staging cache with its row `dst` holding snapshot `row`'s KDA states and conv windows (and
    hidden state) (a prompt continuing a cached prefix), laid out as a cache (`cache.place`)."""
    out = _copy_row(staging, store, row, dst)
    return _placed(out)

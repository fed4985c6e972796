"""The model side of speculative decoding: the MTP layer's cached forms, the main model's verify step
over k + 1 positions per row, and the commit of each row's accepted positions.

Caches. The main cache is `ling_jax.cache`'s (contiguous latent rows). The MTP layer (layer 0 of
`params["mtp"]`, ARCHITECTURE.md §2.8: always MLA + the FFN of index L) keeps its own latent cache
[B, S, r + d_r]: row t holds MTP position t, whose inputs are the token at t + 1 and the main
model's final-normed hidden state at t; it predicts the token at t + 2.

Verify. `verify_step` runs T tokens per row at positions lengths[b] + i through every main layer
in one call (every weight read once, as by a one-token step): MLA layers attend over the cached
rows j < lengths[b] and the T new rows causally (the absorbed form, `layers.mla.mla_mixer` with
`past_BSW`); KDA layers run their short conv from the cached window and the token recurrence from
the cached state. It changes no cache: it returns what `commit` needs to advance each row by its
own count of accepted positions a[b] in [0, T], after which the cache is exactly the one of a[b]
one-token steps (to float32 rounding): lengths + a, the KDA state after a tokens, the conv window
ending at the a-th token; the T new latent rows are written at lengths..lengths + T - 1, and the
rows past lengths + a (rejected positions) are hidden by `lengths` until overwritten.

Kernels. Two forms compute the same. The sequence forms (`verify_step`, `mtp_step`; a record of
`kernels.select(..., inference=True)`): matmuls over the B x T rows, the absorbed attention in XLA
over the whole latent allocation (masked past each row's length), the KDA token scan. The row forms
(`verify_rows`, `mtp_step_rows`; the decode record of unrolled layers): the B x T positions as the
rows of one decode step, so every projection and the routed experts are the decode kernels' products
on the layer stacks in place, the MLA layers write the T latent rows first and attend as decode rows
of lengths lengths[b] + i through the paged decode kernel, and KDA layers run the projections over
all rows and the conv and token recurrence per sequence. `ling_jax.generate` and the engine verify
in the row form where the layers are unrolled (the default), in the sequence forms under layer scans.

The KDA state after a row's accepted tokens: the verify keeps each KDA layer's recurrence inputs
(L2-normed k, v, log-decay g, beta of the T tokens) and `commit` re-runs the token recurrence from the
cached state with g = 0 and beta = 0 past each row's count — identity steps, so the state is bit for
bit the one after the accepted tokens — for all layers of a segment at once. The alternative, the
verify's recurrence returning the state after every position for `commit` to pick from, holds T + 1
states ([T + 1, H, K, V] per row and layer instead of [T, H, 2K + V + 1]) and on a CPU was the slower
of the two at every batch size above 1 and no faster at 1 (writing T + 1 states costs about what the
second recurrence does); on a GPU the held states would be T + 1 times the KDA state memory at large
batches.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.cache import LATENT_BLOCK, Cache, place
from ling_jax.checkpoint.fp8 import dense_weights
from ling_jax.config import LingConfig
from ling_jax.decode import layers as decode_layers
from ling_jax.decode.step import latent_slots, prefill_stack, stack_plan
from ling_jax.decode.views import PagedLatent
from ling_jax.kernels import Kernels
from ling_jax.layers.mla import mla_latent, mla_mixer
from ling_jax.layers.rope import apply_rope, rope_cos_sin
from ling_jax.model import decoder_layer, embed, limits, lm_head, make_context, run_stack, sequence_mixer
from ling_jax.ops.kda import kimi_delta_attention
from ling_jax.ops.norms import rms_norm
from ling_jax.params import Params
from ling_jax.sharding import constrain

Mix = Any  # (attn params, normed x [B, T, D]) -> (out [B, T, D], latent rows [B, T, W] or {"latent": ...})


def has_mtp(cfg: LingConfig, params: Params) -> bool:
    """Whether the config and params hold an MTP layer to draft with."""
    return cfg.num_nextn_predict_layers > 0 and bool(params.get("mtp"))


# ----------------------------------------------------------------------------- attention over the cache


def positions(start_B: jax.Array, t: int) -> jax.Array:
    """Positions start[b] + i of T new tokens per row: [B, T] int32."""
    return start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def attend_cached(p: Params, x_BTD: jax.Array, latent_BSW: jax.Array, start_B: jax.Array, *, cfg: LingConfig,
                  kernels: Kernels) -> tuple[jax.Array, jax.Array]:
    """An MLA mixer on T new tokens per row at positions start[b] + i over the cached rows j < start[b]
    and the new rows causally (absorbed form): (out [B, T, D], the new latent rows [B, T, r + d_r]).

    Reads every one of the cache's S rows (masked past start[b]): its cost follows the allocation."""
    b, t, _ = x_BTD.shape
    s = latent_BSW.shape[1]
    cos, sin = rope_cos_sin(positions(start_B, t), cfg.qk_rope_head_dim, cfg.rope_theta)
    past_BTS = jnp.broadcast_to(jnp.arange(s)[None, None, :] < start_B[:, None, None], (b, t, s))
    new_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    out, c = mla_mixer(p, x_BTD, cfg=cfg, kernels=kernels, cos=cos, sin=sin,
                       mask_BTS=jnp.concatenate([past_BTS, new_BTT], axis=-1), absorbed=True, past_BSW=latent_BSW)
    return out, c["latent"]


def write_rows(latent_BSW: jax.Array, rows_BTW: jax.Array, start_B: jax.Array) -> jax.Array:
    """The cache [..., B, S, W] with rows [..., B, T, W] written at start[b] + i (rows past S dropped)."""
    b, t = rows_BTW.shape[-3:-1]
    lead = latent_BSW.shape[:-3]
    flat = latent_BSW.reshape(-1, *latent_BSW.shape[-3:])
    new = flat.at[:, jnp.arange(b)[:, None], positions(start_B, t)].set(
        rows_BTW.reshape(-1, *rows_BTW.shape[-3:]).astype(flat.dtype), mode="drop")
    return new.reshape(*lead, *new.shape[1:])


# ----------------------------------------------------------------------------- the MTP layer


def _mtp_input(cfg: LingConfig, params: Params, ids_BT: jax.Array, h_BTD: jax.Array) -> tuple[Params, jax.Array]:
    """MTP layer 0's params (dense) and its decoder layer's input [B, T, D]: eh_proj of the normed
    embedding of `ids` beside the normed hidden `h`."""
    eps = cfg.rms_norm_eps
    p = dense_weights(params["mtp"][0], h_BTD.dtype)
    e = rms_norm(embed(params, ids_BT), p["enorm"], eps)
    z = jnp.concatenate([e, rms_norm(h_BTD, p["hnorm"], eps)], axis=-1)
    return p, z @ p["eh_proj"].astype(z.dtype)


def mtp_layer(cfg: LingConfig, kernels: Kernels, params: Params, ids_BT: jax.Array, h_BTD: jax.Array,
              mix: Mix) -> tuple[jax.Array, Any]:
    """MTP layer 0 (§2.8) on T positions: embedding of `ids` (the tokens one ahead) and the previous
    stage's hidden `h` -> (its final-normed hidden [B, T, D], what `mix` returned besides its output)."""
    i = cfg.num_hidden_layers
    p, z = _mtp_input(cfg, params, ids_BT, h_BTD)
    z, mixed, _ = decoder_layer(p, z, limits(cfg, np.array(i)), cfg=cfg, kernels=kernels, ffn=cfg.ffn_of(i), mix=mix)
    return rms_norm(z, p["final_norm"], cfg.rms_norm_eps), mixed


def mtp_rows(cfg: LingConfig, params: Params, ids_BT: jax.Array, h_BTD: jax.Array,
             positions_BT: jax.Array) -> jax.Array:
    """The MTP layer's latent rows alone (what its cache holds; its attention and FFN not run) of T
    positions: inputs the tokens one ahead `ids` and the main hidden states `h` at `positions`
    (the rope key's rotation): [B, T, r + d_r], the rows `mtp_layer` gives its mixer's cache."""
    p, z = _mtp_input(cfg, params, ids_BT, h_BTD)
    a = p["attn"]
    x = rms_norm(z, p["input_norm"], cfg.rms_norm_eps)
    c, k_rot = mla_latent(a, x @ a["kv_a_proj"].astype(x.dtype), cfg)
    cos, sin = rope_cos_sin(positions_BT, cfg.qk_rope_head_dim, cfg.rope_theta)
    return jnp.concatenate([c, apply_rope(k_rot, cos, sin)], axis=-1)


def mtp_step(cfg: LingConfig, kernels: Kernels, params: Params, latent_BSW: jax.Array, ids_BT: jax.Array,
             h_BTD: jax.Array, start_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MTP layer on T positions per row at start[b] + i against its latent cache (rows < start[b]):
    (final-normed hidden [B, T, D], the cache with the T new rows written at start[b] + i).

    Drafting runs it on the positions whose main hidden states the last verify produced (the tokens
    accepted there: their rows replace the draft rows written before) and then one position per
    draft, on its own previous output."""
    mix = lambda pa, x: attend_cached(pa, x, latent_BSW, start_B, cfg=cfg, kernels=kernels)  # noqa: E731
    g_BTD, rows = mtp_layer(cfg, kernels, params, ids_BT, h_BTD, mix)
    return g_BTD, constrain(write_rows(latent_BSW, rows, start_B), "mla_latent")


def mtp_step_rows(cfg: LingConfig, kernels: Kernels, params: Params, latent_BSW: jax.Array, ids_BT: jax.Array,
                  h_BTD: jax.Array, start_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`mtp_step` in the decode step's row form (as `verify_rows`): the T positions as rows of the decode
    layer (`layers.mla_rows` on the cache's rows read as pages, the decode FFN), `kernels` a decode
    record. The cache's S must be a whole number of `LATENT_BLOCK`s or one page of its own."""
    b, t = ids_BT.shape
    r, s, w = b * t, latent_BSW.shape[1], latent_BSW.shape[2]
    i = cfg.num_hidden_layers
    p, z_BTD = _mtp_input(cfg, params, ids_BT, h_BTD)
    pos_R = positions(start_B, t).reshape(r)
    table_BN = _contiguous_page_table(b, s)
    pages = PagedLatent(_as_pages(latent_BSW, b, s)[None], jnp.repeat(table_BN, t, axis=0), jnp.int32(0))
    cos, sin = rope_cos_sin(pos_R[:, None], cfg.qk_rope_head_dim, cfg.rope_theta)
    held = {}

    def mix(pa, h_R1D):
        out_RD, held["pool"] = decode_layers.mla_rows(pa, h_R1D[:, 0], pages, pos_R, jnp.ones((r,), bool), cfg=cfg,
                                                      kernels=kernels, cos=cos, sin=sin)
        return out_RD[:, None], None

    z_R1D, _ = decode_layers.decoder_layer(p, z_BTD.reshape(r, 1, -1), limits(cfg, np.array(i)), cfg=cfg,
                                           kernels=kernels, ffn=cfg.ffn_of(i), mix=mix)
    g_BTD = rms_norm(z_R1D.reshape(b, t, -1), p["final_norm"], cfg.rms_norm_eps)
    return g_BTD, constrain(held["pool"].reshape(b, s, w), "mla_latent")


# ----------------------------------------------------------------------------- prefill


@functools.partial(jax.jit, static_argnums=(0, 1, 5))
def prefill_speculative(cfg: LingConfig, kernels: Kernels, params: Params, ids_BT: jax.Array, lengths_B: jax.Array,
                        max_len: int) -> tuple[Cache, jax.Array, jax.Array, jax.Array]:
    """`ling_jax.decode.prefill` plus what drafting starts from: (main cache, last logits [B, V], the
    final-normed hidden state of each row's last token [B, D], the MTP latent cache [B, S, W]).

    The MTP layer runs its sequence form over the prompt with the ids shifted left by one (as
    `model.mtp_hidden`), which fills its rows of positions < lengths[b] - 1; the row at
    lengths[b] - 1 (whose next token is not known yet) is written by the first draft."""
    t = ids_BT.shape[1]
    caches, x = prefill_stack(cfg, kernels, params, ids_BT, lengths_B, max_len)
    h_BTD = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    valid = jnp.arange(t)[None, :] < lengths_B[:, None]
    mix = sequence_mixer(cfg, kernels, make_context(cfg, ids_BT, attention_mask=valid))
    shifted = jnp.concatenate([ids_BT[:, 1:], jnp.zeros_like(ids_BT[:, :1])], axis=1)
    _, rows = mtp_layer(cfg, kernels, params, shifted, h_BTD, lambda pa, h: mix(pa, h, "mla", None))
    h_last = jnp.take_along_axis(h_BTD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    cache = place({"segments": caches, "lengths": lengths_B.astype(jnp.int32)})
    return (cache, lm_head(cfg, params, h_last), h_last,
            constrain(latent_slots(rows["latent"], max_len), "mla_latent"))


# ----------------------------------------------------------------------------- verify and commit


def _project(x: jax.Array, p: Params, name: str) -> jax.Array:
    """x times `{name}_proj`, or its low-rank pair `{name}_a_proj`, `{name}_b_proj`."""
    if f"{name}_proj" in p:
        return x @ p[f"{name}_proj"].astype(x.dtype)
    return (x @ p[f"{name}_a_proj"].astype(x.dtype)) @ p[f"{name}_b_proj"].astype(x.dtype)


def kda_verify(p: Params, x_BTD: jax.Array, cache: dict[str, jax.Array], *,
               cfg: LingConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A KDA mixer on T tokens per row continuing the cached state and conv window, §2.4: (out
    [B, T, D], what `commit` advances the state and window with: the recurrence inputs "k" (L2-normed)
    [B, T, H, K], "v" [B, T, H, V], "g" (log decay) [B, T, H, K] f32, "beta" [B, T, H] f32, and the conv
    inputs "inputs" [B, T, 3P]). The recurrence is the token scan (`ops.kda.reference`)."""
    b, t, _ = x_BTD.shape
    dt = x_BTD.dtype
    qkv_BT3P = x_BTD @ jnp.concatenate([p[f"{n}_proj"].astype(dt) for n in "qkv"], axis=1)
    o, record = decode_layers.kda_tokens(p, qkv_BT3P, _project(x_BTD, p, "f"), _project(x_BTD, p, "g"),
                                         x_BTD @ p["b_proj"].astype(dt), cache, cfg=cfg)
    return o @ p["o_proj"].astype(dt), record


def advance_kda(c: dict[str, jax.Array], y: dict[str, jax.Array], advance_B: jax.Array) -> dict[str, jax.Array]:
    """A KDA stack's cache ({"state" [*lead, B, H, K, V], "conv" [*lead, B, W-1, 3P]}) after each row's
    first advance[b] of the T verified tokens (`kda_verify`'s record `y`, stacked alike)."""
    state = c["state"]
    lead, b = state.shape[:-4], state.shape[-4]
    t = y["k"].shape[-3]
    keep = jnp.arange(t)[None, :] < advance_B[:, None]  # [B, T]
    flat = lambda a: a.reshape(-1, *a.shape[len(lead) + 1:])  # noqa: E731  [*lead, B, ...] -> [n * B, ...]
    keep_NT = jnp.broadcast_to(keep, (*lead, b, t)).reshape(-1, t)
    k = flat(y["k"])
    _, new = kimi_delta_attention(k, k, flat(y["v"]), jnp.where(keep_NT[..., None, None], flat(y["g"]), 0.0),
                                  jnp.where(keep_NT[..., None], flat(y["beta"]), 0.0), scale=1.0,
                                  initial_state=flat(state), impl="reference")
    ext = jnp.concatenate([c["conv"], y["inputs"].astype(c["conv"].dtype)], axis=-2)  # [*lead, B, W-1+T, 3P]
    width = c["conv"].shape[-2]
    idx = advance_B[:, None] + jnp.arange(width)[None, :]  # the W-1 inputs before token advance[b]
    window = jnp.take_along_axis(ext, jnp.broadcast_to(idx[..., None], (*ext.shape[:-2], width, 1)), axis=-2)
    return {"state": new.reshape(state.shape), "conv": window}


def verify_step(cfg: LingConfig, kernels: Kernels, params: Params, cache: Cache, tokens_BT: jax.Array,
                unroll: bool = True) -> tuple[jax.Array, jax.Array, list[Any]]:
    """T tokens per row at positions lengths[b] + i through the main model from the cache, in one call
    (module doc): (logits [B, T, V] float32, final-normed hidden states [B, T, D], what `commit`
    takes). The cache is not changed. `kernels`: a record for sequence forms
    (`kernels.select(cfg, dtype=..., inference=True)`); `unroll`: the layers as one straight-line
    program instead of scans."""
    lengths = cache["lengths"]

    def mix(p, h, mixer, c):
        if mixer == "kda":
            return kda_verify(p, h, c, cfg=cfg)
        return attend_cached(p, h, c["latent"], lengths, cfg=cfg, kernels=kernels)

    def layer(p, x, lim, c, mixer, ffn):
        x, new, _ = decoder_layer(p, x, lim, cfg=cfg, kernels=kernels, ffn=ffn, mix=lambda pa, h: mix(pa, h, mixer, c))
        return x, new

    x, new = run_stack(cfg, params, embed(params, tokens_BT), layer, caches=cache["segments"], unroll=unroll)
    h_BTD = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return lm_head(cfg, params, h_BTD), h_BTD, new


def verify_rows(cfg: LingConfig, kernels: Kernels, params: Params, cache: Cache, tokens_BT: jax.Array,
                page_table_BN: jax.Array | None = None,
                valid_B: jax.Array | None = None) -> tuple[jax.Array, jax.Array, list[Any]]:
    """`verify_step` in the decode step's row form: the B x T positions as R = B * T rows of one
    unrolled decode step (`decode.step.stack_plan`), so every projection, the router and the routed
    experts are the decode kernels' products over R rows on the layer stacks in place (views while
    R <= `ops.stack_matmul.MAX_ROWS`); the KDA layers run `layers.kda_rows` (projections over the rows,
    conv and token recurrence per sequence), the MLA layers `layers.mla_rows`: each position's latent
    row is written into the pool first, then every position attends as a decode row of length
    lengths[b] + i through its sequence's pages (the paged decode kernel on a GPU).

    `kernels`: a decode record of unrolled layers (`kernels.select(cfg, dtype=..., decode=True,
    unroll=True)`); params with `fuse_for_decode`'s fused weights. A paged cache comes with its
    `page_table_BN` (pages for positions up to lengths[b] + T - 1) and `valid_B` (rows whose latent
    rows are written; default all); a contiguous cache's rows are read as pages of `LATENT_BLOCK`
    slots. Returns `verify_step`'s (logits [B, T, V] float32, final-normed hidden [B, T, D], what
    `commit` takes), where each MLA segment's entry is its whole latent cache, the T rows already
    written (`commit` keeps it)."""
    b, t = tokens_BT.shape
    r = b * t
    lengths = cache["lengths"]
    pos_R = positions(lengths, t).reshape(r)
    valid_R = jnp.ones((r,), bool) if valid_B is None else jnp.repeat(valid_B, t)
    segs = cache["segments"]
    slots = None
    if page_table_BN is None:  # contiguous rows [n, B, S, W]: row b's S slots as pages of its own
        slots = next(a.shape[-2] for path, a in jax.tree_util.tree_leaves_with_path(segs) if path[-1].key == "latent")
        segs = _rename(jax.tree_util.tree_map_with_path(
            lambda path, a: _as_pages(a, b, slots) if path[-1].key == "latent" else a, segs), "latent", "pages")
        page_table_BN = _contiguous_page_table(b, slots)
    table_RN = jnp.repeat(page_table_BN, t, axis=0)
    cos, sin = rope_cos_sin(pos_R[:, None], cfg.qk_rope_head_dim, cfg.rope_theta)

    def mix(p, h_R1D, mixer, c):
        if mixer == "kda":
            return decode_layers.kda_rows(p, h_R1D, c, t, cfg=cfg, kernels=kernels)
        out_RD, pool = decode_layers.mla_rows(p, h_R1D[:, 0], c["pages"], pos_R, valid_R, cfg=cfg, kernels=kernels,
                                              cos=cos, sin=sin)
        return out_RD[:, None], pool

    def layer(p, x, lim, c, mixer, ffn):
        return decode_layers.decoder_layer(p, x, lim, cfg=cfg, kernels=kernels, ffn=ffn,
                                           mix=lambda pa, h: mix(pa, h, mixer, c))

    x = embed(params, tokens_BT.reshape(r, 1))
    x, new = run_stack(cfg, params, x, layer, caches=segs, unroll=True,
                       plan=stack_plan(cfg, kernels, x, layer, True, table_RN, threaded_pool=True))
    if slots is not None:  # back to contiguous rows
        new = _rename(jax.tree_util.tree_map_with_path(
            lambda path, a: a.reshape(*a.shape[:-3], b, slots, a.shape[-1]) if path[-1].key == "pages" else a,
            new), "pages", "latent")
    h_RD = rms_norm(x[:, 0], params["final_norm"], cfg.rms_norm_eps)
    return lm_head(cfg, params, h_RD).reshape(b, t, -1), h_RD.reshape(b, t, -1), new


def _contiguous_page_table(b: int, slots: int) -> jax.Array:
    """The page table [B, N] that reads B contiguous rows of `slots` latent slots as pages (`_as_pages`):
    row b owns pages b * N .. b * N + N - 1."""
    n = slots // _contiguous_page(slots)
    return jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)


def _as_pages(latent: jax.Array, b: int, slots: int) -> jax.Array:
    """Contiguous latent rows [*lead, B, S, W] as a page pool [*lead, B * N, page, W] (a reshape, no
    copy): pages of `LATENT_BLOCK` slots where S is a multiple of it, else one page of S per row."""
    page = _contiguous_page(slots)
    return latent.reshape(*latent.shape[:-3], b * (slots // page), page, latent.shape[-1])


def _contiguous_page(slots: int) -> int:
    return LATENT_BLOCK if slots % LATENT_BLOCK == 0 else slots


def _rename(tree: Any, old: str, new: str) -> Any:
    """Nested dicts with every key `old` renamed `new`."""
    if isinstance(tree, dict):
        return {(new if k == old else k): _rename(v, old, new) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_rename(v, old, new) for v in tree]
    return tree


def commit(cache: Cache, new: list[Any], advance_B: jax.Array) -> Cache:
    """The cache after each row's first advance[b] (in [0, T]) of the verified positions: lengths +
    advance, each KDA layer's state after that many tokens and the conv window ending there, every
    MLA layer's T new rows written at lengths[b] + i (those past the new length are hidden by it;
    `verify_rows` wrote them already: its whole latent caches are taken as they are)."""
    lengths = cache["lengths"]

    def merge(c: dict, y: Any) -> dict:
        if "latent" in c:
            return y if isinstance(y, dict) else {"latent": write_rows(c["latent"], y, lengths)}
        return advance_kda(c, y, advance_B)

    segs = [merge(c, y) if "kda" not in c else {k: merge(c[k], y[k]) for k in c}
            for c, y in zip(cache["segments"], new, strict=True)]
    return place({"segments": segs, "lengths": lengths + advance_B})

"""Speculative decoding with the MTP layer (NEXTN): the MTP layer drafts k tokens, the main model
verifies the k + 1 positions in one call, and each row keeps the longest accepted prefix plus one
token of the main model's — 1 to k + 1 tokens per row per step, exactly the tokens (greedy) or the
distribution (sampling) of one-token decoding.

One step of `speculative_loop`, per row, with the main cache holding positions < L and the token
x_L emitted but not yet run (the model side: `ling_jax.decode.verify`):

1. Draft. The MTP layer runs on the positions whose main hidden states the previous verify (or the
   prefill) produced — inputs (token at t + 1, main hidden at t), rows replacing the draft rows of
   those positions — and its output at L - 1 gives draft d_1 (the token at L + 1). Each further
   draft d_j runs the MTP layer on one position: the embedding of d_{j-1} and the MTP layer's own
   previous output hidden state. Greedy rows take the argmax; sampled rows draw d_j from the draft
   distribution q_j (temperature, top-k and top-p applied as for the main model's tokens).
2. Verify. [x_L, d_1 .. d_k] through the main model at positions L .. L + k in one call: logits
   p_0 .. p_k (p_i predicts the token after position L + i).
3. Accept. Greedy: the longest prefix of drafts equal to the main model's argmax, then the argmax at
   the first mismatch (or after the last draft). Sampling: d_i is kept with probability
   min(1, p_{i-1}(d_i) / q_i(d_i)) while all before it were; at the first rejection the token is drawn
   from normalize(max(0, p - q)), after k acceptances from p_k — so every token has the model's
   (filtered) distribution. The row advances by its own count: the cache commits the accepted
   positions only (`verify.commit`), the output buffer takes the tokens at the row's own index.
4. Stop. A row stops after a stop token or its token budget, as in `decode_loop`; a stopped row's
   cache no longer advances.

Keys: every draw of row b is keyed by `fold_in(fold_in(keys_B[b], j), purpose)` with j the output
index of the token it decides and purpose one of TOKEN (the token drawn at j: the first token, a
residual or bonus draw), DRAFT (the draft for j) or ACCEPT (the uniform that accepts the draft at j).
An output index is decided in exactly one step, so no key is used twice for a decision, and a row's
draws depend on nothing in its batch: seeded sampling is reproducible and batch-invariant. Its tokens
are not the ones `decode_loop` draws with the same seed (the draws differ), only their distribution
is the same.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ling_jax.cache import Cache
from ling_jax.config import LingConfig
from ling_jax.decode.sampling import filtered, sample
from ling_jax.decode.step import fuse_for_decode
from ling_jax.decode.verify import commit, mtp_step, mtp_step_rows, verify_rows, verify_step
from ling_jax.kernels import Kernels, select
from ling_jax.model import lm_head
from ling_jax.params import Params

TOKEN, DRAFT, ACCEPT = 0, 1, 2  # what a key decides (module doc)


def index_keys(keys_B: jax.Array, index: jax.Array, purpose: int) -> jax.Array:
    """Row b's key for output index index[b, ...] and `purpose`: keys of index's shape ([B] or [B, N])."""
    flat = index.reshape(index.shape[0], -1).astype(jnp.uint32)
    per_index = jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))(keys_B, flat)
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(per_index.reshape(-1), purpose).reshape(index.shape)


def draft_token(logits_BV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
                top_p_B: jax.Array, *, sampling: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """A draft per row from the MTP logits: (token [B] int32, log q [B, V]: the log-probabilities of the
    filtered draft distribution it was drawn from; zeros when no row samples). Greedy rows
    (temperature 0) take the argmax. `sampling`: the form, as `sampling.sample`'s (None: a `lax.cond`
    on whether any row samples; True: the sampled form; False: every row greedy, known to the caller)."""
    greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def sampled() -> tuple[jax.Array, jax.Array]:
        masked = filtered(logits_BV, temperature_B, top_k_B, top_p_B)
        drawn = jax.vmap(jax.random.categorical)(keys_B, masked).astype(jnp.int32)
        return jnp.where(temperature_B > 0, drawn, greedy), jax.nn.log_softmax(masked, axis=-1)

    if sampling is None:
        return jax.lax.cond(jnp.any(temperature_B > 0), sampled, lambda: (greedy, jnp.zeros_like(logits_BV)))
    return sampled() if sampling else (greedy, jnp.zeros_like(logits_BV))


def _leading(ok_BK: jax.Array) -> jax.Array:
    """Per row, how many leading entries are True: [B] int32."""
    return jnp.sum(jnp.cumprod(ok_BK.astype(jnp.int32), axis=1), axis=1)


def accept(logits_BTV: jax.Array, drafts_BK: jax.Array, logq_BKV: jax.Array, keys_B: jax.Array,
           index_B: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
           top_p_B: jax.Array, *, sampling: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Acceptance of k drafts against the verify logits (T = k + 1): (accepted count n [B] in [0, k],
    the token after them [B] int32). `sampling`: the form, as `draft_token`'s.

    drafts: [B, k], draft i for output index index[b] + i; logq: their draft distributions (log q,
    `draft_token`). Greedy rows: exact match with the argmax of logits[:, i]. Sampled rows: draft i
    kept while uniform < p(d) / q(d) under the filtered p of logits[:, i]; the token after is drawn
    from normalize(max(0, p_n - q_n)) at a rejection (p_n where that is zero everywhere, which only
    rounding can make so), from p_k after k acceptances."""
    b, t, v = logits_BTV.shape
    k = t - 1
    greedy_BT = jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
    match_BK = drafts_BK == greedy_BT[:, :k]

    def greedy() -> tuple[jax.Array, jax.Array]:
        n = _leading(match_BK)
        return n, jnp.take_along_axis(greedy_BT, n[:, None], axis=1)[:, 0]

    def sampled() -> tuple[jax.Array, jax.Array]:
        per_slot = [jnp.repeat(a, t) for a in (temperature_B, top_k_B, top_p_B)]
        logp_BTV = jax.nn.log_softmax(filtered(logits_BTV.reshape(b * t, v), *per_slot), axis=-1).reshape(b, t, v)
        lp_BK = jnp.take_along_axis(logp_BTV[:, :k], drafts_BK[..., None], axis=-1)[..., 0]
        lq_BK = jnp.take_along_axis(logq_BKV, drafts_BK[..., None], axis=-1)[..., 0]
        u_BK = jax.vmap(jax.random.uniform)(
            index_keys(keys_B, index_B[:, None] + jnp.arange(k), ACCEPT).reshape(-1)).reshape(b, k)
        sampling = temperature_B > 0
        n = _leading(jnp.where(sampling[:, None], jnp.log(u_BK) < lp_BK - lq_BK, match_BK))
        p_BV = jnp.exp(jnp.take_along_axis(logp_BTV, n[:, None, None], axis=1)[:, 0])
        q_BV = jnp.exp(jnp.take_along_axis(logq_BKV, jnp.minimum(n, k - 1)[:, None, None], axis=1)[:, 0])
        residual = jnp.maximum(p_BV - jnp.where((n < k)[:, None], q_BV, 0.0), 0.0)
        log_r = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, jnp.log(residual), jnp.log(p_BV))
        drawn = jax.vmap(jax.random.categorical)(index_keys(keys_B, index_B + n, TOKEN), log_r).astype(jnp.int32)
        return n, jnp.where(sampling, drawn, jnp.take_along_axis(greedy_BT, n[:, None], axis=1)[:, 0])

    if sampling is None:
        return jax.lax.cond(jnp.any(temperature_B > 0), sampled, greedy)
    return sampled() if sampling else greedy()


def speculative_loop(cfg: LingConfig, params: Params, cache: Cache, mtp_latent: jax.Array, logits_BV: jax.Array,
                     hidden_BD: jax.Array, max_new: int, keys_B: jax.Array, temperature: jax.Array,
                     top_k: jax.Array, top_p: jax.Array, stop_S: jax.Array, n_new: jax.Array | None = None, *,
                     k: int, unroll_layers: bool = True, kernels: Kernels | None = None,
                     forced_drafts: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array, Cache, jax.Array, dict[str, jax.Array]]:
    """Generates up to `n_new` (default `max_new`) tokens per row with k drafts per step (module doc):
    (tokens [B, max_new] (-1 past each row's end), count per row [B], the final main cache and MTP latent
    cache, statistics).

    Starts from `verify.prefill_speculative`'s results: the main cache (slots for every row's
    length + n_new + k tokens), the MTP latent cache, the last logits and final-normed hidden state
    [B, D]. The caches are donated (and returned). `max_new` sizes the output buffer (static), as in `decode_loop`;
    temperature, top_k and top_p are scalars or [B]. Statistics (int32 scalars): "steps" (verify
    calls), "row_steps" (verify steps summed over the rows not yet stopped), "accepted" (drafts
    accepted, summed likewise). `kernels`: a record for sequence forms (default
    `kernels.select(cfg, dtype=..., inference=True)`), which the MTP layer runs, and the verify step
    where the layers are scans; unrolled, the verify runs in the decode step's row form
    (`verify.verify_rows`, the decode record of unrolled layers, on the fused decode weights).
    `forced_drafts` [B, N] int32 (a test hook): the draft for output index j is
    forced_drafts[b, min(j, N - 1)] with q = 1 on it, instead of the MTP layer's.
    """
    if k < 1:
        raise ValueError(f"speculative_loop: k={k} drafts per step must be >= 1")
    dtype = params["embed"].dtype
    kernels = kernels or select(cfg, dtype=dtype, inference=True)
    rows = select(cfg, dtype=dtype, decode=True, unroll=True) if unroll_layers else None
    return _speculative_loop(cfg, kernels, rows, params, cache, mtp_latent, logits_BV, hidden_BD, max_new, keys_B,
                             temperature, top_k, top_p, stop_S, n_new, forced_drafts, k=k, unroll_layers=unroll_layers)


def mtp_drafts(cfg: LingConfig, kernels: Kernels, params: Params, latent: jax.Array, tok_BT: jax.Array,
            h_BTD: jax.Array, m_B: jax.Array, lengths_B: jax.Array, keys_B: jax.Array, index_B: jax.Array,
            sampling: tuple[jax.Array, ...], k: int, rows: Kernels | None = None,
            sampled: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """k drafts per row from the MTP layer (module doc, 1): (drafts [B, k], log q [B, k, V], MTP cache).
    tok/h: the tokens and main hidden states of the m[b] positions lengths[b] - m[b] .. lengths[b] - 1
    (first m[b] of T slots). The MTP layer runs its sequence forms (`kernels`), or with `rows` (a decode
    record) the decode step's row form (`verify.mtp_step_rows`). `sampled`: the drafts' sampling form
    (`draft_token`'s `sampling`)."""
    step = functools.partial(mtp_step, cfg, kernels) if rows is None else functools.partial(mtp_step_rows, cfg, rows)
    g_BTD, latent = step(params, latent, tok_BT, h_BTD, lengths_B - m_B)
    g_BD = jnp.take_along_axis(g_BTD, (m_B - 1)[:, None, None], axis=1)[:, 0]
    drafts, logqs = [], []
    for j in range(k):
        if j:
            g_B1D, latent = step(params, latent, drafts[-1][:, None], g_BD[:, None], lengths_B + j - 1)
            g_BD = g_B1D[:, 0]
        tok, logq = draft_token(lm_head(cfg, params, g_BD), index_keys(keys_B, index_B + j, DRAFT), *sampling,
                                sampling=sampled)
        drafts.append(tok)
        logqs.append(logq)
    return jnp.stack(drafts, axis=1), jnp.stack(logqs, axis=1), latent


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 8), static_argnames=("k", "unroll_layers"),
                   donate_argnums=(4, 5))
def _speculative_loop(cfg: LingConfig, kernels: Kernels, rows: Kernels | None, params: Params, cache: Cache,
                      latent: jax.Array, logits_BV: jax.Array, hidden_BD: jax.Array, max_new: int, keys_B: jax.Array,
                      temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, stop_S: jax.Array,
                      n_new: jax.Array | None, forced: jax.Array | None, *, k: int,
                      unroll_layers: bool) -> tuple[jax.Array, jax.Array, Cache, jax.Array, dict[str, jax.Array]]:
    b, v = logits_BV.shape
    t = k + 1
    limit = jnp.int32(max_new) if n_new is None else jnp.minimum(n_new, max_new)
    sampling = tuple(jnp.broadcast_to(jnp.asarray(a), (b,)) for a in (temperature, top_k, top_p))
    first = sample(logits_BV, jax.vmap(jax.random.fold_in)(keys_B, jnp.zeros((b,), jnp.uint32)), TOKEN, *sampling)
    slot_T = jnp.arange(t)[None, :]
    zero = jnp.int32(0)
    fused = None if rows is None else fuse_for_decode(cfg, rows, params)

    def body(state: dict[str, Any]) -> dict[str, Any]:
        cache, counts, active = state["cache"], state["counts"], ~state["done"]
        lengths, m = cache["lengths"], state["m"]
        pending = jnp.take_along_axis(state["tok"], (m - 1)[:, None], axis=1)
        if forced is None:
            drafts, logq, latent = mtp_drafts(cfg, kernels, params, state["latent"], state["tok"], state["h"], m,
                                              lengths, keys_B, counts, sampling, k, rows)
        else:
            drafts = jnp.take_along_axis(forced, jnp.minimum(counts[:, None] + jnp.arange(k), forced.shape[1] - 1),
                                         axis=1)
            logq, latent = jnp.where(jnp.arange(v) == drafts[..., None], 0.0, -jnp.inf), state["latent"]
        verified = jnp.concatenate([pending, drafts], axis=1)
        if rows is None:
            logits_BTV, h_BTD, new = verify_step(cfg, kernels, params, cache, verified, unroll_layers)
        else:
            logits_BTV, h_BTD, new = verify_rows(cfg, rows, fused, cache, verified)
        n, final = accept(logits_BTV, drafts, logq, keys_B, counts, *sampling)
        n_B1 = n[:, None]
        emitted = jnp.where(slot_T < n_B1, jnp.pad(drafts, ((0, 0), (0, 1))),
                            jnp.where(slot_T == n_B1, final[:, None], 0))
        step_slot = slot_T <= n_B1
        stop_hit = jnp.isin(emitted, stop_S) & step_slot
        index = counts[:, None] + slot_T
        keep = active[:, None] & step_slot & (jnp.cumsum(stop_hit, axis=1) - stop_hit == 0) & (index < limit)
        out = state["out"].at[jnp.arange(b)[:, None], jnp.where(keep, index, max_new)].set(emitted, mode="drop")
        counts = counts + jnp.sum(keep, axis=1)
        return {"cache": commit(cache, new, jnp.where(active, n + 1, 0)), "latent": latent,
                "h": jnp.where(active[:, None, None], h_BTD, state["h"]),
                "tok": jnp.where(active[:, None], emitted, state["tok"]), "m": jnp.where(active, n + 1, m),
                "out": out, "counts": counts,
                "done": state["done"] | jnp.any(stop_hit & keep, axis=1) | (counts >= limit),
                "steps": state["steps"] + 1, "row_steps": state["row_steps"] + jnp.sum(active),
                "accepted": state["accepted"] + jnp.sum(jnp.where(active, n, 0))}

    init = {"cache": cache, "latent": latent,
            "h": jnp.zeros((b, t, hidden_BD.shape[-1]), hidden_BD.dtype).at[:, 0].set(hidden_BD),
            "tok": jnp.zeros((b, t), jnp.int32).at[:, 0].set(first), "m": jnp.ones((b,), jnp.int32),
            "out": jnp.full((b, max_new), -1, jnp.int32).at[:, 0].set(first), "counts": jnp.ones((b,), jnp.int32),
            "done": jnp.isin(first, stop_S) | (limit <= 1), "steps": zero, "row_steps": zero, "accepted": zero}
    final = jax.lax.while_loop(lambda s: ~jnp.all(s["done"]), body, init)
    stats = {name: final[name] for name in ("steps", "row_steps", "accepted")}
    return final["out"], final["counts"], final["cache"], final["latent"], stats

"""Next-token sampling: greedy, or temperature with top-k and top-p filters, each row from its own key."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def sample(logits_BV: jax.Array, keys_B: jax.Array, step: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, *, sampling: bool | None = None) -> jax.Array:
    """Next token per row [B] int32.

    Row b is greedy where temperature[b] == 0, else drawn from the softmax of logits / temperature[b]
    restricted to the top_k[b] most likely tokens (0: all) and, within those, to the smallest set whose
    probability reaches top_p[b], with the key `fold_in(keys_B[b], step[b])` (its own key and its own
    token index: its draws do not depend on its batch). `step`, `temperature`, `top_k` and `top_p` are
    scalars shared by the batch or [B] arrays, one per row.

    `sampling`: None decides on the device whether any row samples (a `lax.cond`: the sort the filters
    need runs only then, but XLA on a GPU reads the branch back to the host, so the call that holds it
    waits there for the device); True runs the sampled form (rows at temperature 0 still take their
    argmax); False takes every row's argmax (the caller knows that no row samples). Both static forms
    leave nothing for the host to wait on."""
    b = logits_BV.shape[0]
    step, temperature, top_k, top_p = (jnp.broadcast_to(jnp.asarray(a), (b,))
                                       for a in (step, temperature, top_k, top_p))
    greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def sampled() -> jax.Array:
        masked = filtered(logits_BV, temperature, top_k, top_p)
        keys = jax.vmap(jax.random.fold_in)(keys_B, step)
        drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    if sampling is None:
        return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)
    return sampled() if sampling else greedy


def filtered(logits_BV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """The logits `sample` draws row b from: logits / temperature[b], -inf outside the top_k[b] most
    likely tokens (0: all) and, within those, outside the smallest set whose probability reaches
    top_p[b]. [B, V] float32; the per-row arguments are [B]."""
    logits = logits_BV / jnp.maximum(temperature_B, 1e-6)[:, None]
    srt = jnp.sort(logits, axis=-1)[:, ::-1]
    kth = jnp.where(top_k_B > 0, jnp.take_along_axis(srt, jnp.clip(top_k_B - 1, 0, srt.shape[-1] - 1)[:, None],
                                                      axis=-1)[:, 0], -jnp.inf)
    probs = jax.nn.softmax(jnp.where(srt >= kth[:, None], srt, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    keep = (before < top_p_B[:, None]) & (srt >= kth[:, None])
    cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1)
    return jnp.where(logits >= cutoff[:, None], logits, -jnp.inf)


def logprobs(logits_BV: jax.Array, tokens_B: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log-probability of each row's token [B], the n most likely tokens [B, n] int32 and their
    log-probabilities [B, n]) under the softmax of the raw float32 logits (no temperature or filter)."""
    lp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp_BV, n)
    return jnp.take_along_axis(lp_BV, tokens_B[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp


def row_keys(seeds: Sequence[int], prompts: Sequence[np.ndarray]) -> jax.Array:
    """One PRNG key per row [B] from its 64-bit seed and a hash (CRC-32) of its prompt's ids, so a
    row's draws depend on nothing else in its batch (the same seed and prompt draw alike in `generate`
    and in the serving engine)."""
    words = np.array([(int(s) & 0xFFFFFFFF, (int(s) >> 32) & 0xFFFFFFFF,
                       zlib.crc32(np.asarray(r).astype("<i4").tobytes())) for s, r in zip(seeds, prompts, strict=True)],
                     np.uint32)

    def key(w_3: jax.Array) -> jax.Array:
        k = jax.random.key(0)
        for j in range(3):
            k = jax.random.fold_in(k, w_3[j])
        return k

    return jax.vmap(key)(jnp.asarray(words))

"""Next-token sampling: greedy, or temperature with top-k and top-p filters, each row from its own key."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits_BV: jax.Array, keys_B: jax.Array, step: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
    """Next token per row [B] int32: greedy when temperature == 0, else sampled from the softmax of
    logits / temperature restricted to the top_k most likely tokens (0: all) and, within those, to the
    smallest set whose probability reaches top_p; row b draws with `fold_in(keys_B[b], step)` (its
    own key: its draws do not depend on its batch). temperature, top_k and top_p are scalars shared
    by the batch."""
    greedy = jnp.argmax(logits_BV, axis=-1)

    def sampled() -> jax.Array:
        logits = logits_BV / jnp.maximum(temperature, 1e-6)
        srt = jnp.sort(logits, axis=-1)[:, ::-1]
        kth = jnp.where(top_k > 0, jnp.take(srt, jnp.clip(top_k - 1, 0, srt.shape[-1] - 1), axis=-1), -jnp.inf)
        probs = jax.nn.softmax(jnp.where(srt >= kth[:, None], srt, -jnp.inf), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
        keep = (before < top_p) & (srt >= kth[:, None])
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1)
        masked = jnp.where(logits >= cutoff[:, None], logits, -jnp.inf)
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, step)
        return jax.vmap(jax.random.categorical)(keys, masked)

    return jax.lax.cond(temperature > 0, sampled, lambda: greedy).astype(jnp.int32)

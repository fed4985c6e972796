"""The sampler's filters, drawn many times over a small vocabulary with a known distribution: top-k
and top-p (nucleus) sampling draw exactly the kept tokens, with the kept tokens' renormalised
probabilities (top-p taken over the top-k renormalised distribution, after the temperature)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ling_jax.decode.sampling import sample

N = 40_000  # rows of one call, each with its own key: N independent draws
# not sorted, so a filter has to rank the tokens; by probability: 1, 4, 3, 5, 6, 0, 2
P = np.array([0.05, 0.30, 0.02, 0.18, 0.25, 0.12, 0.08])


def draws(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """N tokens sampled from logits whose softmax at `temperature` is P."""
    logits = jnp.log(jnp.asarray(P, jnp.float32)) * temperature
    keys = jax.random.split(jax.random.key(0), N)
    out = sample(jnp.broadcast_to(logits, (N, P.size)), keys, jnp.int32(3), jnp.float32(temperature),
                 jnp.int32(top_k), jnp.float32(top_p))
    return np.asarray(out)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "kept"), [
    (1.0, 0, 1.0, {0, 1, 2, 3, 4, 5, 6}),  # no filter
    (1.0, 3, 1.0, {1, 4, 3}),
    (1.0, 1, 1.0, {1}),
    (1.0, 0, 0.8, {1, 4, 3, 5}),  # mass before each: 0, .30, .55, .73 < .8; .85 is not
    (0.5, 0, 0.5, {1, 4}),  # the temperature first: 0, .30 < .5; .55 is not
    (1.0, 4, 0.6, {1, 4}),  # over the top 4 renormalised: 0, .353 < .6; .647 is not (over all of P .55 would be)
], ids=["off", "top_k=3", "top_k=1", "top_p=0.8", "T=0.5,top_p=0.5", "top_k=4,top_p=0.6"])
def test_filters_keep_exactly_their_tokens_with_renormalised_probabilities(temperature, top_k, top_p, kept):
    tokens = draws(temperature, top_k, top_p)
    assert set(np.unique(tokens).tolist()) == kept  # every kept token drawn, every other one never
    ids = np.array(sorted(kept))
    observed = np.bincount(tokens, minlength=P.size)[ids]
    expected = N * P[ids] / P[ids].sum()
    if ids.size > 1:  # Pearson's chi-square against the renormalised probabilities, at a 1e-6 false-alarm rate
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < stats.chi2.ppf(1 - 1e-6, ids.size - 1), (observed, expected.round())

"""Padding on either side never changes the logits of real tokens (the reference leaks it; we don't)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

import ling_jax

T = 16
LENGTHS = (16, 11, 5)


@pytest.mark.parametrize("attention", ["auto", pytest.param("pallas", marks=pytest.mark.heavy)])
def test_left_and_right_padding_batch_of_mixed_lengths(golden_a, attention):
    """Also with MLA through the fused attention kernels (interpret mode on CPU; "auto": XLA here),
    where the padding keys must stay invisible to the real queries."""
    cfg, params, _ = golden_a
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in LENGTHS]
    junk = rng.integers(0, cfg.vocab_size, (len(LENGTHS), T))  # pad positions hold random ids

    # reference: each prompt at the start of its row, no mask; a causal model's first n logits
    # depend only on the first n tokens, whatever follows
    ref_ids = junk.copy()
    for r, p in enumerate(prompts):
        ref_ids[r, : len(p)] = p
    ref = np.asarray(ling_jax.forward(cfg, params, jnp.asarray(ref_ids)))
    cfg = dataclasses.replace(cfg, attention_impl=attention)

    left, right = junk.copy(), junk.copy()
    left_mask, right_mask = np.zeros((len(LENGTHS), T), np.int32), np.zeros((len(LENGTHS), T), np.int32)
    for r, p in enumerate(prompts):
        left[r, T - len(p):], left_mask[r, T - len(p):] = p, 1
        right[r, : len(p)], right_mask[r, : len(p)] = p, 1
    out_left = np.asarray(ling_jax.forward(cfg, params, jnp.asarray(left), attention_mask=jnp.asarray(left_mask)))
    out_right = np.asarray(ling_jax.forward(cfg, params, jnp.asarray(right), attention_mask=jnp.asarray(right_mask)))
    for r, p in enumerate(prompts):
        n = len(p)
        assert rel_l2(out_left[r, T - n:], ref[r, :n]) < 1e-5, f"left, row {r}"
        assert rel_l2(out_right[r, :n], ref[r, :n]) < 1e-5, f"right, row {r}"
        assert np.isfinite(out_left[r]).all()
    # and padding does matter when unmasked (the test can fail): the reference's leak
    unmasked = np.asarray(ling_jax.forward(cfg, params, jnp.asarray(left)))
    assert rel_l2(unmasked[2, T - 5:], ref[2, :5]) > 1e-2

"""The token-by-token KDA definition: golden op vectors, segment resets, chunk-boundary states."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import GOLDEN, rel_l2

from ling_jax.ops import kimi_delta_attention
from ling_jax.ops.kda.gate import l2_normalize


def _golden():
    return dict(np.load(GOLDEN / "kda_op_a.npz"))


def test_golden_op_vectors_reference():
    """Raw q/k and gate pre-activation through the fused options (in-op gate and L2 norm)."""
    d = _golden()
    o, s = kimi_delta_attention(
        *(jnp.asarray(d[n]) for n in ("q", "k", "v", "g_raw", "beta")), scale=float(d["scale"]),
        initial_state=jnp.asarray(d["initial_state"]), impl="reference", use_qk_l2norm=True,
        a_log=jnp.asarray(d["A_log"]), dt_bias=jnp.asarray(d["dt_bias"]), lower_bound=float(d["lower_bound"]))
    assert rel_l2(o, d["o"]) < 1e-6 and rel_l2(s, d["final_state"]) < 1e-6
    # the precomputed gate and pre-normalised q, k give the same function
    o2, s2 = kimi_delta_attention(
        l2_normalize(jnp.asarray(d["q"])), l2_normalize(jnp.asarray(d["k"])), jnp.asarray(d["v"]),
        jnp.asarray(d["g"]), jnp.asarray(d["beta"]), scale=float(d["scale"]),
        initial_state=jnp.asarray(d["initial_state"]), impl="reference")
    assert rel_l2(o2, d["o"]) < 1e-6 and rel_l2(s2, d["final_state"]) < 1e-6


def _random(b=1, t=37, h=2, dk=8, dv=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = l2_normalize(jax.random.normal(ks[0], (b, t, h, dk)))
    k = l2_normalize(jax.random.normal(ks[1], (b, t, h, dk)))
    v = jax.random.normal(ks[2], (b, t, h, dv))
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (b, t, h, dk)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
    s0 = jax.random.normal(ks[5], (b, h, dk, dv))
    return q, k, v, g, beta, s0


def test_segments_equal_separate_sequences():
    """Packed segments == running each document alone (the first continues the initial state)."""
    q, k, v, g, beta, s0 = _random()
    cuts = [0, 1, 15, 16, 36, 37]
    seg = np.zeros((1, 37), np.int32)
    for n, (a, b) in enumerate(itertools.pairwise(cuts)):
        seg[:, a:b] = n
    o, s = kimi_delta_attention(q, k, v, g, beta, initial_state=s0, segment_ids=jnp.asarray(seg), impl="reference")
    for n, (a, b) in enumerate(itertools.pairwise(cuts)):
        part = [x[:, a:b] for x in (q, k, v, g, beta)]
        o_n, s_n = kimi_delta_attention(*part, initial_state=s0 if n == 0 else None, impl="reference")
        assert rel_l2(o[:, a:b], o_n) < 1e-6, f"segment {n}"
    assert rel_l2(s, s_n) < 1e-6


def test_chunk_states_are_prefix_states():
    q, k, v, g, beta, s0 = _random()
    _, _, states = kimi_delta_attention(q, k, v, g, beta, initial_state=s0, chunk_size=16,
                                        return_chunk_states=True, impl="reference")
    assert states.shape == (1, 3, 2, 8, 8)
    np.testing.assert_allclose(states[:, 0], s0)
    for c in (1, 2):
        _, s_c = kimi_delta_attention(*(x[:, : 16 * c] for x in (q, k, v, g, beta)), initial_state=s0,
                                      impl="reference")
        assert rel_l2(states[:, c], s_c) < 1e-6

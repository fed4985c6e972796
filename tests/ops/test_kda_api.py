"""`ops.kimi_delta_attention`'s argument checks and edge cases, the same for every implementation:
a malformed argument is refused with its name (no implementation broadcasts, truncates or ignores
it), T = 0 passes the state through, g = -inf is a decay to zero, float16 inputs keep their precision
through the Pallas kernels (interpret mode here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.ops import kimi_delta_attention

jax.config.update("jax_default_matmul_precision", "highest")

B, T, H, K = 2, 20, 2, 16
IMPLS = ("reference", "chunked", "pallas")


def _inputs(seed: int = 0, t: int = T, dtype=jnp.float32) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    arrays = {
        "q": unit(rng.standard_normal((B, t, H, K))), "k": unit(rng.standard_normal((B, t, H, K))),
        "v": rng.standard_normal((B, t, H, K)), "g": rng.uniform(-2.0, -0.01, (B, t, H, K)),
        "beta": rng.uniform(0.1, 0.9, (B, t, H)),
    }
    out = {n: jnp.asarray(a, dtype if n in "qkv" else jnp.float32) for n, a in arrays.items()}
    out["initial_state"] = jnp.asarray(rng.standard_normal((B, H, K, K)), jnp.float32)
    return out


def _run(x: dict, impl: str, **kw):
    return kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], impl=impl, chunk_size=16, **kw)


BAD = {
    "segment_ids": ({"segment_ids": jnp.zeros((B, T - 8), jnp.int32)}, "segment_ids must be an int"),
    "segment_ids_float": ({"segment_ids": jnp.zeros((B, T), jnp.float32)}, "segment_ids must be an int"),
    "initial_state": ({"initial_state": jnp.zeros((1, H, K, K), jnp.float32)}, "initial_state must be"),
    "initial_state_int": ({"initial_state": jnp.zeros((B, H, K, K), jnp.int32)}, "initial_state must be"),
    "dt_bias_alone": ({"dt_bias": jnp.zeros((H * K,))}, "got only dt_bias"),
    "a_log_alone": ({"a_log": jnp.zeros((H,))}, "got only a_log"),
    "a_log_size": ({"a_log": jnp.zeros((1,)), "dt_bias": jnp.zeros((H * K,))}, "a_log must hold H = 2"),
    "chunk_float": ({"chunk_size": 16.0}, "chunk_size=16.0 must be a positive int"),
    "scale_str": ({"scale": "x"}, "scale must be a static number"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_argument_is_named(case, impl):
    """Before, the Pallas path took a short `segment_ids` or a [1, H, K, V] state silently (edge
    padding, broadcasting), and every path ignored `dt_bias` without `a_log`."""
    kw, match = BAD[case]
    x = _inputs()
    call = {**{"chunk_size": 16}, **kw}
    with pytest.raises(ValueError, match=match):
        kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], impl=impl, **call)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["scale", "lower_bound"])
def test_a_traced_kernel_constant_is_refused_alike(impl, name):
    """`scale` and `lower_bound` are constants of the kernels: traced, every implementation says so
    (the chunked path used to take a traced scale that the kernels, picked on a GPU, refused)."""
    x = _inputs()
    extra = {"a_log": jnp.zeros((H,)), "dt_bias": jnp.zeros((H * K,))} if name == "lower_bound" else {}
    with pytest.raises(ValueError, match=f"{name} must be a static number .* traced"):
        jax.jit(lambda c: _run(x, impl, **extra, **{name: c}))(jnp.float32(-0.5))


def test_bool_segment_ids_are_ids():
    """Two-valued segment ids may come as bool: the same segments as the int ids."""
    x = _inputs(4)
    ids = np.zeros((B, T), np.int32)
    ids[:, 9:] = 1
    got = _run(x, "chunked", segment_ids=jnp.asarray(ids, bool))
    want = _run(x, "chunked", segment_ids=jnp.asarray(ids))
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens_pass_the_state_through(impl):
    x = _inputs(t=0)
    o, state, chunks = _run(x, impl, initial_state=x["initial_state"], return_chunk_states=True)
    assert o.shape == (B, 0, H, K) and chunks.shape == (B, 0, H, K, K)
    np.testing.assert_array_equal(state, x["initial_state"])
    _, zeros = _run(x, impl)
    np.testing.assert_array_equal(zeros, np.zeros((B, H, K, K)))


def test_minus_infinity_is_a_decay_to_zero():
    """g = -inf (a channel forgotten at once) in the chunked path equals the reference, value and
    gradient, and both equal g = -1e4; it used to turn the chunked path's whole sequence NaN."""
    x = _inputs(1)
    g = x["g"].at[0, 5, 1, 3].set(-jnp.inf).at[1, 17, 0, :].set(-jnp.inf)

    def loss(impl, g):
        o, s = kimi_delta_attention(x["q"], x["k"], x["v"], g, x["beta"], impl=impl, chunk_size=16,
                                    initial_state=x["initial_state"])
        return jnp.sum(o * o) + jnp.sum(s * s), (o, s)

    (_, (o, s)), dq = jax.value_and_grad(lambda q: loss("chunked", g), has_aux=True)(x["q"])
    (_, (o_ref, s_ref)) = loss("reference", g)
    (_, (o_fin, _)) = loss("chunked", jnp.maximum(g, -1e4))
    assert np.isfinite(o).all() and np.isfinite(s).all() and np.isfinite(dq).all()
    assert rel_l2(o, o_ref) < 1e-5 and rel_l2(s, s_ref) < 1e-5
    np.testing.assert_array_equal(o, o_fin)
    dg = jax.grad(lambda g: loss("chunked", g)[0])(g)
    assert np.isfinite(dg).all()


def test_float16_inputs_keep_their_precision_in_the_kernels():
    """float16 q/k/v run the Pallas kernels' dots in float32 (they ran in bfloat16: 5.6x the error):
    the kernels then match the reference on the same float16 inputs to the output's rounding."""
    x = _inputs(2, dtype=jnp.float16)
    o, s = _run(x, "pallas", initial_state=x["initial_state"])
    o_ref, s_ref = _run(x, "reference", initial_state=x["initial_state"])
    assert o.dtype == jnp.float16 and s.dtype == jnp.float32
    assert rel_l2(o, o_ref) < 1e-3 and rel_l2(s, s_ref) < 1e-5


def test_an_out_of_range_decay_spoils_only_its_sequence_and_head():
    """A precomputed g outside the kernels' exact range (one step of +1e-6, not a decay) makes the
    Pallas outputs NaN for that (sequence, head) alone (they were NaN for the whole batch); the rest
    equal the reference, chunk states included."""
    x = _inputs(3)
    g = x["g"].at[1, 7, 0, 2].set(1e-6)
    o, s, cs = kimi_delta_attention(x["q"], x["k"], x["v"], g, x["beta"], impl="pallas", chunk_size=16,
                                    initial_state=x["initial_state"], return_chunk_states=True)
    o_ref, s_ref, cs_ref = kimi_delta_attention(x["q"], x["k"], x["v"], g, x["beta"], impl="reference", chunk_size=16,
                                                initial_state=x["initial_state"], return_chunk_states=True)
    bad_o, bad_s, bad_cs = (np.zeros(a.shape, bool) for a in (o, s, cs))
    bad_o[1, :, 0], bad_s[1, 0], bad_cs[1, :, 0] = True, True, True
    for got, want, bad in ((o, o_ref, bad_o), (s, s_ref, bad_s), (cs, cs_ref, bad_cs)):
        assert np.isnan(got[bad]).all()
        np.testing.assert_allclose(got[~bad], want[~bad], rtol=1e-4, atol=1e-5)

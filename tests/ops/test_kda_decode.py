"""The one-token KDA steps (XLA and Pallas) chained over a sequence equal the reference recurrence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.ops.kda.decode import kda_decode_step, kda_decode_step_pallas, pallas_supported
from ling_jax.ops.kda.gate import l2_normalize
from ling_jax.ops.kda.reference import kda_reference


def _inputs(seed, b, t, h, dk, dv, dtype):
    rng = np.random.default_rng(seed)
    q = l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32)).astype(dtype)
    k = l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32)).astype(dtype)
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), dtype)
    g = jnp.asarray(-rng.uniform(0.01, 1.0, (b, t, h, dk)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (b, t, h)), dtype)
    s0 = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("step", [kda_decode_step, kda_decode_step_pallas], ids=["xla", "pallas"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("dk,dv", [(32, 32), (16, 64)])
def test_steps_equal_reference(step, dtype, tol, dk, dv):
    """7 chained steps from a random (non-zero) state: every output and the final state."""
    q, k, v, g, beta, s0 = _inputs(dk + dv, 2, 7, 3, dk, dv, dtype)
    o_want, s_want = kda_reference(q, k, v, g, beta, scale=dk**-0.5, initial_state=s0)
    s, outs = s0, []
    for i in range(q.shape[1]):
        o, s = step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s, scale=dk**-0.5)
        assert o.dtype == v.dtype and s.dtype == jnp.float32
        outs.append(o)
    assert rel_l2(jnp.stack(outs, 1), o_want) < tol and rel_l2(s, s_want) < 1e-5


def test_pallas_unsupported_dims_raise():
    assert pallas_supported(128, 128) and not pallas_supported(96, 128) and not pallas_supported(128, 8)
    q, k, v, g, beta, s0 = _inputs(0, 1, 1, 1, 24, 32, jnp.float32)
    with pytest.raises(ValueError, match="powers of two"):
        kda_decode_step_pallas(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0, scale=0.2)


def test_pallas_triton_lowering(h200_lowering):
    """Lowers to Triton for an H200 at Ling's head size (K = V = 128), batch 1 and 128."""
    sd = jax.ShapeDtypeStruct
    def fn(*a):
        return kda_decode_step_pallas(*a, scale=128**-0.5, interpret=False)

    for b, h, dt in ((1, 16, jnp.bfloat16), (128, 64, jnp.float32)):
        vec = sd((b, h, 128), dt)
        mlir = h200_lowering(fn, vec, vec, vec, sd((b, h, 128), jnp.float32), sd((b, h), dt),
                             sd((b, h, 128, 128), jnp.float32))
        assert "triton" in mlir


def _xla_layer_step(x, window, conv_w, f, b, a_log, dt_bias, state, lower_bound, scale):
    """The XLA decode path of `layers.kda.kda_mixer` from the q|k|v projections on."""
    from ling_jax.layers.kda import short_conv
    from ling_jax.ops.kda.gate import kda_gate

    bsz, h, dk = f.shape
    y, new_window = short_conv(x[:, None], conv_w, window)
    q, k, v = (a.reshape(bsz, h, -1) for a in jnp.split(y[:, 0], [h * dk, 2 * h * dk], axis=-1))
    g = kda_gate(f[:, None], a_log, dt_bias, lower_bound)[:, 0]
    o, s = kda_decode_step(l2_normalize(q), l2_normalize(k), v, g, jax.nn.sigmoid(b.astype(jnp.float32)), state,
                           scale=scale)
    return o, s, new_window


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("b,h,dk,dv,width", [(2, 3, 32, 32, 4), (1, 2, 16, 64, 2), (3, 5, 16, 16, 3)])
def test_fused_layer_step_equals_the_xla_ops(dtype, tol, b, h, dk, dv, width):
    """conv + SiLU from the window, norms, gate, beta and the step in one kernel = the XLA ops, over 3
    chained steps (the window and state each kernel returns feed the next); new window exact."""
    from ling_jax.ops.kda.decode import kda_decode_fused_pallas

    rng = np.random.default_rng(b * 100 + dv + width)
    p3 = h * (2 * dk + dv)
    conv_w = jnp.asarray(rng.standard_normal((p3, width)) * 0.5, dtype)
    a_log = jnp.asarray(rng.uniform(-1, 1, h), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(h * dk), jnp.float32)
    window = jnp.asarray(rng.standard_normal((b, width - 1, p3)), dtype)
    state = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)
    got, want = (window, state), (window, state)
    for step in range(3):
        x = jnp.asarray(rng.standard_normal((b, p3)), dtype)
        f = jnp.asarray(rng.standard_normal((b, h, dk)), dtype)
        beta_logits = jnp.asarray(rng.standard_normal((b, h)), dtype)
        o_w, s_w, win_w = _xla_layer_step(x, want[0], conv_w, f, beta_logits, a_log, dt_bias, want[1], -5.0,
                                          dk**-0.5)
        parts = (conv_w[:h * dk], conv_w[h * dk:2 * h * dk], conv_w[2 * h * dk:])
        o_g, s_g, win_g = kda_decode_fused_pallas(x, got[0], parts, f, beta_logits, a_log, dt_bias, got[1],
                                                  lower_bound=-5.0, scale=dk**-0.5)
        assert o_g.dtype == dtype and s_g.dtype == jnp.float32 and win_g.shape == window.shape
        np.testing.assert_array_equal(win_g, win_w)
        assert rel_l2(o_g, o_w) < tol and rel_l2(s_g, s_w) < (1e-6 if dtype == jnp.float32 else 1e-3), step
        got, want = (win_g, s_g), (win_w, s_w)


def test_fused_layer_step_triton_lowering(h200_lowering):
    """Lowers to Triton for an H200 at Ling-3.0-tiny's KDA layer (H = 16, K = V = 128, conv width 4)."""
    from ling_jax.ops.kda.decode import kda_decode_fused_pallas

    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16

    def fn(x, win, wq, wk, wv, *a):
        return kda_decode_fused_pallas(x, win, (wq, wk, wv), *a, lower_bound=-5.0, scale=128**-0.5, interpret=False)

    for b in (1, 128):
        w = sd((2048, 4), bf)
        mlir = h200_lowering(fn, sd((b, 6144), bf), sd((b, 3, 6144), bf), w, w, w, sd((b, 16, 128), bf),
                             sd((b, 16), bf), sd((16,), jnp.float32), sd((2048,), jnp.float32),
                             sd((b, 16, 128, 128), jnp.float32))
        assert "triton" in mlir

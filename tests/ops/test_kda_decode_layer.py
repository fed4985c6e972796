"""The KDA decode layer kernel equals the XLA form (conv + SiLU, L2 norms, gate, beta, the recurrent
step), updates only its layer's state in the stack and returns the layer's new conv window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.layers.kda import short_conv
from ling_jax.ops.kda.decode import kda_decode_step
from ling_jax.ops.kda.decode_layer import Inputs, KdaCacheStack, kda_decode_layer, supported
from ling_jax.ops.kda.gate import kda_gate, l2_normalize
from ling_jax.ops.layer_gemv import WeightStack

L, LAYER, W = 3, 1, 4


def _case(seed, b, h, d, dtype):
    rng = np.random.default_rng(seed)
    p = h * d

    def arr(shape, dt=dtype, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), dt)

    return dict(
        y=arr((b, 4 * p + h + 7)),  # q|k|v, f, beta logits side by side, then 7 columns of noise
        state=arr((L, b, h, d, d), jnp.float32), conv=arr((L, b, W - 1, 3 * p)),
        conv_w=arr((L, 3 * p, W), scale=0.5), a_log=arr((L, h), jnp.float32, 0.5),
        dt_bias=arr((L, p), jnp.float32, 0.5),
    )


def _xla(c, lower_bound, h, d):
    """The XLA form of layer LAYER (`decode.layers.kda`'s step without the layer kernel)."""
    b, p = c["y"].shape[0], h * d
    y = c["y"]
    qkv, window = short_conv(y[:, None, : 3 * p], c["conv_w"][LAYER], c["conv"][LAYER])
    q, k, v = (a.reshape(b, h, d) for a in jnp.split(qkv[:, 0], 3, axis=-1))
    g = kda_gate(y[:, None, 3 * p : 4 * p].reshape(b, 1, h, d), c["a_log"][LAYER], c["dt_bias"][LAYER],
                 lower_bound)[:, 0]
    beta = jax.nn.sigmoid(y[:, 4 * p : 4 * p + h].astype(jnp.float32))
    o, state = kda_decode_step(l2_normalize(q), l2_normalize(k), v, g, beta, c["state"][LAYER], scale=d**-0.5)
    return o, state, window


@pytest.mark.parametrize("dtype,tol,b,h,d,lower_bound,views", [
    (jnp.float32, 1e-5, 1, 2, 64, -5.0, True),  # four programs per head (V blocks of 16), Ling's safe gate
    (jnp.bfloat16, 1e-2, 1, 2, 64, -5.0, True),
    (jnp.float32, 1e-5, 3, 3, 16, None, False),  # odd rows and heads, the Kimi gate, inputs apart
    (jnp.bfloat16, 1e-2, 3, 3, 16, -5.0, False),
])
def test_equals_the_xla_form(dtype, tol, b, h, d, lower_bound, views):
    """Random (non-zero) inputs, state and window; the inputs in one fused array at their offsets or
    (views=False) f and z from arrays of their own; the weights as stack views or the layer's own."""
    c = _case(d + h, b, h, d, dtype)
    p = h * d
    o_want, s_want, w_want = _xla(c, lower_bound, h, d)
    cache = KdaCacheStack(c["state"], c["conv"], jnp.int32(LAYER))
    names = ("conv_w", "a_log", "dt_bias")

    @jax.jit
    def run(y, cache, stacks):
        if views:  # one fused array at its offsets, the weights as views of their stacks
            inputs = Inputs(qkv=(y, 0), f=(y, 3 * p), b=(y, 4 * p))
            weights = [WeightStack(a, np.int32(LAYER)) for a in stacks]
        else:
            inputs = Inputs(qkv=(y[:, : 3 * p], 0), f=(y[:, 3 * p : 4 * p], 0), b=(y, 4 * p))
            weights = [a[LAYER] for a in stacks]
        return kda_decode_layer(inputs, cache, *weights, lower_bound=lower_bound)

    o, ss, new = run(c["y"], cache, [c[n] for n in names])
    assert o.dtype == dtype and o.shape == (b, h, d)
    assert rel_l2(o, o_want) < tol
    j = ss.shape[-1]  # each program's sum of squares of its block of o (the gated norm's, in o_proj's gemv)
    assert ss.shape == (b, h, j) and d % j == 0
    want_ss = np.square(np.asarray(o, np.float64)).reshape(b, h, j, d // j).sum(-1)
    np.testing.assert_allclose(np.asarray(ss), want_ss, rtol=1e-5)
    assert rel_l2(new.state[LAYER], s_want) < 1e-5
    np.testing.assert_array_equal(np.asarray(new.window, np.float32), np.asarray(w_want, np.float32))
    others = np.array([i for i in range(L) if i != LAYER])  # the other layers' states are left as they were
    np.testing.assert_array_equal(np.asarray(new.state[others]), np.asarray(c["state"][others]))
    np.testing.assert_array_equal(np.asarray(new.conv, np.float32), np.asarray(c["conv"], np.float32))


def test_bad_shapes_raise():
    c = _case(0, 1, 2, 16, jnp.float32)
    y = c["y"]
    ok = Inputs(qkv=(y, 0), f=(y, 96), b=(y, 128))
    ws = [c[n][0] for n in ("conv_w", "a_log", "dt_bias")]
    with pytest.raises(ValueError, match="must give 1 rows"):
        kda_decode_layer(Inputs(qkv=(y, 0), f=(y, 96), b=(y, y.shape[1] - 1)),
                         KdaCacheStack(c["state"], c["conv"], jnp.int32(0)), *ws, lower_bound=-5.0)
    with pytest.raises(ValueError, match="float32"):
        kda_decode_layer(ok, KdaCacheStack(c["state"].astype(jnp.bfloat16), c["conv"], jnp.int32(0)), *ws,
                         lower_bound=-5.0)
    assert supported(128, 128, 4) and not supported(96, 96, 4) and not supported(128, 128, 1)


def test_triton_lowering(h200_lowering):
    """Lowers to Triton for an H200 at Ling-3.0-tiny's layer (16 heads of 128, conv width 4), bf16."""
    sd = jax.ShapeDtypeStruct
    h, d, p = 16, 128, 2048

    def fn(y, state, conv, conv_w, a_log, dt_bias):
        inputs = Inputs(qkv=(y, 0), f=(y, 3 * p), b=(y, 5 * p))
        views = [WeightStack(a, np.int32(2)) for a in (conv_w, a_log, dt_bias)]
        return kda_decode_layer(inputs, KdaCacheStack(state, conv, np.int32(2)), *views, lower_bound=-5.0,
                                interpret=False)

    bf = jnp.bfloat16
    mlir = h200_lowering(fn, sd((1, 5 * p + 128), bf), sd((18, 1, h, d, d), jnp.float32), sd((18, 1, 3, 3 * p), bf),
                         sd((18, 3 * p, 4), bf), sd((18, h), jnp.float32), sd((18, p), jnp.float32))
    assert "triton" in mlir

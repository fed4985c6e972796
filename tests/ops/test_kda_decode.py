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

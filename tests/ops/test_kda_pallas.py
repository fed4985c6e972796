"""The Pallas KDA kernels (interpret mode on CPU) against the token-by-token reference.

Covers both lowerings' kernel code (the GPU/Triton variant, the default off-accelerator, and the
TPU/Mosaic variant forced with backend="tpu"), forward and custom_vjp gradients, fp32 and bf16,
lengths that are not chunk multiples, initial states, packed segments, chunk states, the fused
gate + L2 norm, and the golden op vectors. Two tests also lower the kernels for CUDA (Triton) and
TPU (Mosaic) without a device, which catches primitives that the interpreter accepts but a real
backend cannot lower.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN

from ling_jax.ops.kda import kimi_delta_attention
from ling_jax.ops.kda.gate import kda_gate, l2_normalize
from ling_jax.ops.kda.pallas import kda_pallas
from ling_jax.ops.kda.reference import kda_reference

jax.config.update("jax_default_matmul_precision", "highest")


def rel_l2(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def make_inputs(seed: int, b: int, t: int, h: int, dk: int, dv: int, dtype=jnp.float32):
    """Fresh random inputs (raw q/k, gate pre-activation, a_log, dt_bias), never zeros."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = jax.random.normal(ks[0], (b, t, h, dk)).astype(dtype)
    k = jax.random.normal(ks[1], (b, t, h, dk)).astype(dtype)
    v = jax.random.normal(ks[2], (b, t, h, dv)).astype(dtype)
    f = (2.0 * jax.random.normal(ks[3], (b, t, h, dk))).astype(dtype)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))).astype(dtype)
    a_log = 0.5 * jax.random.normal(ks[5], (h,))
    dt_bias = jax.random.normal(ks[6], (h * dk,))
    h0 = 0.3 * jax.random.normal(ks[7], (b, h, dk, dv))
    return q, k, v, f, beta, a_log, dt_bias, h0


def reference(q, k, v, f, beta, a_log, dt_bias, h0, segment_ids=None, chunk_size=64, states=False):
    """Reference path on the same raw inputs (gate and L2 norm in plain JAX, fp32 recurrence)."""
    g = kda_gate(f, a_log, dt_bias, -5.0)
    return kda_reference(l2_normalize(q), l2_normalize(k), v, g, beta, scale=q.shape[-1] ** -0.5,
                         initial_state=h0, segment_ids=segment_ids, chunk_size=chunk_size,
                         return_chunk_states=states)


def pallas(q, k, v, f, beta, a_log, dt_bias, h0, segment_ids=None, chunk_size=64, states=False,
           backend=None, **kw):
    return kda_pallas(q, k, v, f, beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
                      segment_ids=segment_ids, chunk_size=chunk_size, return_chunk_states=states,
                      use_qk_l2norm=True, a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
                      backend=backend, **kw)


def awkward_segments(b: int, t: int) -> jnp.ndarray:
    """Segment ids with boundaries inside chunks, on chunk edges and one token long."""
    ids = np.zeros((b, t), np.int32)
    for bi in range(b):
        cuts = sorted({c for c in (1, 5 + bi, 17, 64, 65, 100, 127, 128, 300, 511, 700) if c < t})
        for c in cuts:
            ids[bi, c:] += 1
    return jnp.asarray(ids)


# ------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, pytest.param(63, marks=pytest.mark.heavy),
                               pytest.param(64, marks=pytest.mark.heavy), 65])
def test_forward_lengths_fp32(t):
    x = make_inputs(t, 2, t, 2, 32, 32)
    segs = awkward_segments(2, t) if t > 1 else None
    for h0 in (x[-1], None):
        o, ht = pallas(*x[:-1], h0, segment_ids=segs)
        ro, rht = reference(*x[:-1], h0, segment_ids=segs)
        assert o.dtype == jnp.float32 and ht.dtype == jnp.float32
        assert rel_l2(o, ro) < 2e-5, (t, h0 is None)
        assert rel_l2(ht, rht) < 2e-5, (t, h0 is None)


def test_forward_long_bf16_segments_chunk_states():
    """T = 1000 (15 full chunks + 40 rows), bf16 inputs, packed documents, chunk states."""
    x = make_inputs(11, 2, 1000, 2, 32, 32, jnp.bfloat16)
    segs = awkward_segments(2, 1000)
    o, ht, cs = pallas(*x, segment_ids=segs, states=True)
    ro, rht, rcs = reference(*x, segment_ids=segs, states=True)
    assert o.dtype == jnp.bfloat16 and ht.dtype == jnp.float32 and cs.dtype == jnp.float32
    assert cs.shape == (2, 16, 2, 32, 32)
    assert rel_l2(o, ro) < 2e-2
    assert rel_l2(ht, rht) < 2e-2
    assert rel_l2(cs, rcs) < 2e-2


def test_forward_unfused_gate_through_api_chunk32():
    """impl="pallas" through the public API with a precomputed log decay and chunk_size 32."""
    q, k, v, f, beta, a_log, dt_bias, h0 = make_inputs(3, 1, 80, 2, 32, 32)
    g = kda_gate(f, a_log, dt_bias, -5.0)
    qn, kn = l2_normalize(q), l2_normalize(k)
    o, ht, cs = kimi_delta_attention(qn, kn, v, g, beta, initial_state=h0, impl="pallas", chunk_size=32,
                                     return_chunk_states=True)
    ro, rht, rcs = kimi_delta_attention(qn, kn, v, g, beta, initial_state=h0, impl="reference",
                                        chunk_size=32, return_chunk_states=True)
    assert rel_l2(o, ro) < 2e-5 and rel_l2(ht, rht) < 2e-5 and rel_l2(cs, rcs) < 2e-5


@pytest.mark.heavy  # (default suite kept well under 20 min on 2 cores)
def test_gpu_runs_the_kernels_at_their_chunk(monkeypatch):
    """Lowered for a GPU, impl="pallas" runs the kernels at `api.GPU_KERNEL_CHUNK` where it divides the
    chunk asked for: same outputs, and the chunk states of the chunk asked for (every second kernel
    chunk at 64, every fourth at 128; fused gate + L2 norm, T=100 not a chunk multiple, segments);
    a chunk it does not divide (16) and the other platforms' forms run as asked. (The GPU form runs
    here in interpret mode, as `api._run` with the GPU's chunk.)"""
    from ling_jax.ops.kda import api
    from ling_jax.ops.kda import pallas as kda_pallas_module

    run_at: list[int] = []

    def spy(*a, chunk_size, **kw):
        run_at.append(chunk_size)
        return kda_pallas(*a, chunk_size=chunk_size, **kw)

    spy.fuses_gate_and_norm = True
    monkeypatch.setattr(kda_pallas_module, "kda_pallas", spy)
    q, k, v, f, beta, a_log, dt_bias, h0 = make_inputs(11, 2, 100, 2, 32, 32)
    segs = awkward_segments(2, 100)
    kw = dict(scale=32 ** -0.5, initial_state=h0, segment_ids=segs, return_chunk_states=True, use_qk_l2norm=True,
              a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0)
    for chunk, want in ((64, api.GPU_KERNEL_CHUNK), (128, api.GPU_KERNEL_CHUNK), (16, 16)):
        assert api.kernel_chunk(chunk, True) == want and api.kernel_chunk(chunk, False) == chunk
        ro, rht, rcs = reference(q, k, v, f, beta, a_log, dt_bias, h0, segment_ids=segs, chunk_size=chunk,
                                 states=True)
        run_at.clear()  # under jit every platform's form is traced; this CPU runs its own (the chunk asked for)
        o, ht, cs = jax.jit(lambda *a, c=chunk: kimi_delta_attention(*a, impl="pallas", chunk_size=c, **kw))(
            q, k, v, f, beta)
        assert set(run_at) == {chunk, want}, (chunk, run_at)
        assert cs.shape == rcs.shape == (2, -(-100 // chunk), 2, 32, 32)
        assert rel_l2(o, ro) < 2e-5 and rel_l2(ht, rht) < 2e-5 and rel_l2(cs, rcs) < 2e-5, chunk
        o, ht, cs = api._run("pallas", want, q, k, v, f, beta, chunk_size=chunk, backend="triton", interpret=True,
                             **{n: x for n, x in kw.items() if n != "return_chunk_states"}, return_chunk_states=True)
        assert cs.shape == rcs.shape
        assert rel_l2(o, ro) < 2e-5 and rel_l2(ht, rht) < 2e-5 and rel_l2(cs, rcs) < 2e-5, ("gpu form", chunk)


@pytest.mark.heavy  # ~30 s in interpret mode (default suite kept well under 20 min)
@pytest.mark.parametrize("backend", [None, "tpu"])
def test_key_blocks_equal_one_block(backend):
    """The chunk-parallel kernels' loops over blocks of key columns (block_k < K: the At/Aqk sums,
    the L2 norms applied after them, the per-block W/Qg/Kg/gamma) give what one block does, forward
    (o, final and chunk states) and backward (every gradient), with segments, an initial state and
    a partial last chunk."""
    x = make_inputs(31, 2, 100, 2, 32, 32)
    segs = awkward_segments(2, 100)
    one = pallas(*x, segment_ids=segs, states=True, backend=backend, block_k=32, block_k_kv=32)
    four = pallas(*x, segment_ids=segs, states=True, backend=backend, block_k=8, block_k_kv=16)
    for a, b in zip(four, one, strict=True):  # float32, other summation orders: ~3e-6 on O(0.1) values
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert rel_l2(four[0], reference(*x, segment_ids=segs)[0]) < 2e-5
    g_one = _grads(functools.partial(pallas, backend=backend, block_k=32, block_k_kv=32), x, segs, False, seed=5)
    g_four = _grads(functools.partial(pallas, backend=backend, block_k=8, block_k_kv=16), x, segs, False, seed=5)
    for name, a, b in zip(NAMES, g_four, g_one, strict=True):  # the gate parameters sum every token's term
        assert rel_l2(a, b) < (5e-5 if name in ("a_log", "dt_bias") else 1e-5), name


@pytest.mark.heavy  # 20-70 s on 2 cores (default suite kept well under 20 min)
def test_key_blocks_without_fused_gate_and_norm():
    """Several key blocks when the kernels take a precomputed log decay and normalised q/k (no
    per-block gate derivatives, no norm backward): forward and every gradient equal one block."""
    q, k, v, f, beta, a_log, dt_bias, h0 = make_inputs(32, 1, 100, 2, 32, 32)
    x = (l2_normalize(q), l2_normalize(k), v, kda_gate(f, a_log, dt_bias, -5.0), beta, h0)

    def run(bk, bkv, *a):
        return kda_pallas(*a[:5], scale=32 ** -0.5, initial_state=a[5], block_k=bk, block_k_kv=bkv)

    outs = jax.eval_shape(functools.partial(run, 32, 32), *x)
    ws = [jax.random.normal(jax.random.PRNGKey(i), s.shape) for i, s in enumerate(outs)]

    def loss(bk, bkv, *a):
        return sum(jnp.sum(r * w) for r, w in zip(run(bk, bkv, *a), ws, strict=True))

    for a, b in zip(run(8, 16, *x), run(32, 32, *x), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    g_four = jax.grad(functools.partial(loss, 8, 16), argnums=tuple(range(6)))(*x)
    g_one = jax.grad(functools.partial(loss, 32, 32), argnums=tuple(range(6)))(*x)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), g_four, g_one, strict=True):
        assert rel_l2(a, b) < 1e-5, name


@pytest.mark.parametrize("chunk, dk", [(16, 32), *(pytest.param(c, d, marks=pytest.mark.heavy)
                                                   for c, d in ((32, 128), (128, 32)))])
def test_chunk_sizes_forward_and_gradients(chunk, dk):
    """Chunk 16 (one sub-chunk: the inverse is the block-diagonal product alone), 32 at K = V = 128
    (the tiles of chunks <= 32: two 64-wide key blocks, four 32-wide value blocks) and 128 (eight
    sub-chunks: three factors of the block-lower inverse), segments and a partial last chunk."""
    x = make_inputs(40 + chunk, 1, 150, 2, dk, dk)
    segs = awkward_segments(1, 150)
    o, ht = pallas(*x, segment_ids=segs, chunk_size=chunk)
    ro, rht = reference(*x, segment_ids=segs, chunk_size=chunk)
    assert rel_l2(o, ro) < 2e-5 and rel_l2(ht, rht) < 2e-5
    gp = _grads(functools.partial(pallas, chunk_size=chunk), x, segs, False, seed=2)
    gr = _grads(reference, x, segs, False, seed=2)
    for name, a, b in zip(NAMES, gp, gr, strict=True):
        assert rel_l2(a, b) < 5e-5, (name, rel_l2(a, b))


@pytest.mark.heavy  # 20-70 s on 2 cores (default suite kept well under 20 min)
def test_decay_outside_the_kernels_range_is_never_silent():
    """The sub-chunk factorisation is exact while each step's log decay and the decay over each
    sub-chunk's last 15 rows stay >= -75 (always for per-step log decays in [SAFE_LOG_DECAY, 0] =
    [-5, 0]): for a gate not bounded by construction (a precomputed g, the softplus gate, another
    lower bound) the kernels give NaN outputs beyond it, not wrong numbers, and impl="auto" on a GPU
    checks the data and takes the chunked path there (and for shapes the kernels do not take)."""
    from ling_jax.ops.kda import api
    from ling_jax.ops.kda.pallas_chunk import SAFE_LOG_DECAY

    q, k, v, f, beta, a_log, dt_bias, h0 = make_inputs(50, 1, 70, 2, 32, 32)
    qn, kn = l2_normalize(q), l2_normalize(k)
    u = jax.random.uniform(jax.random.PRNGKey(1), f.shape)
    for low, finite in ((-5.0, True), (-8.0, False)):
        g = low * u
        o, ht = kda_pallas(qn, kn, v, g, beta, scale=32 ** -0.5, initial_state=h0)
        ro, rht = kda_reference(qn, kn, v, g, beta, scale=32 ** -0.5, initial_state=h0)
        assert bool(np.isfinite(np.asarray(o)).all()) is finite and bool(np.isfinite(np.asarray(ht)).all()) is finite
        if finite:
            assert rel_l2(o, ro) < 2e-5 and rel_l2(ht, rht) < 2e-5
    # the condition is the decay over a sub-chunk's last 15 rows, not each step: one -20 per 16 rows fits
    g = jnp.where(jnp.arange(70)[None, :, None, None] % 16 == 3, -20.0, -1.0) * jnp.ones_like(f)
    o, _ = kda_pallas(qn, kn, v, g, beta, scale=32 ** -0.5, initial_state=h0)
    ro, _ = kda_reference(qn, kn, v, g, beta, scale=32 ** -0.5, initial_state=h0)
    assert rel_l2(o, ro) < 2e-5
    from ling_jax.ops.kda.pallas_chunk import decay_in_range

    assert bool(decay_in_range(-5.0 * u)) and not bool(decay_in_range(-8.0 * u))
    first = jnp.where(jnp.arange(70)[None, :, None, None] % 16 == 0, -70.0, -4.0) * jnp.ones_like(f)
    assert bool(decay_in_range(first))  # a sub-chunk's first row is not in its 15-row sum
    assert not bool(decay_in_range(first.at[0, 16, 0, 0].set(-76.0)))  # but every step is bounded
    assert not bool(decay_in_range(first.at[0, 5, 0, 0].set(1.0)))  # not a decay
    # at the edge of the range (15 rows summing to -74.85, then a -70 step): forward and every
    # gradient still match (the backward's column forms take their reference at a sub-chunk's last row)
    t = jnp.arange(70)[None, :, None, None]
    edge = jnp.where((t >= 1) & (t <= 15), -4.99, jnp.where(t == 16, -70.0, -0.01)) * jnp.ones_like(f)
    assert bool(decay_in_range(edge))
    ge = _grads(lambda *a, **kw: kda_pallas(*a[:5], scale=32 ** -0.5, initial_state=a[7])[:2], (qn, kn, v, edge, beta,
                a_log, dt_bias, h0), None, False, seed=4)
    gr = _grads(lambda *a, **kw: kda_reference(*a[:5], scale=32 ** -0.5, initial_state=a[7])[:2], (qn, kn, v, edge,
                beta, a_log, dt_bias, h0), None, False, seed=4)
    for name, a, b in zip(NAMES, ge, gr, strict=True):
        if name not in ("a_log", "dt_bias"):
            assert rel_l2(a, b) < 2e-5, (name, rel_l2(a, b))
            if name in ("q", "k", "v"):  # and row by row (a lost term shows in one row: 4e-2 for k before)
                err = np.abs(np.asarray(a) - np.asarray(b)).max(axis=(0, 2, 3))
                assert np.max(err / np.abs(np.asarray(b)).max(axis=(0, 2, 3))) < 1e-4, name
    # the softplus gate (lower_bound=None): fine while the data keeps it in range, NaN beyond
    for shift, finite in ((-4.0, True), (4.0, False)):
        x = f * 0.1 + shift
        o, _ = kda_pallas(q, k, v, x, beta, scale=32 ** -0.5, use_qk_l2norm=True, a_log=a_log,
                          dt_bias=dt_bias, lower_bound=None)
        assert bool(np.isfinite(np.asarray(o)).all()) is finite, shift
        if finite:
            ro, _ = kda_reference(qn, kn, v, kda_gate(x, a_log, dt_bias, None), beta, scale=32 ** -0.5)
            assert rel_l2(o, ro) < 2e-5
    # a safe gate whose bound is below the range: checked on the data like the others
    for shift, finite in ((-6.0, True), (6.0, False)):
        o, _ = kda_pallas(q, k, v, f * 0.1 + shift, beta, scale=32 ** -0.5, use_qk_l2norm=True, a_log=a_log,
                          dt_bias=dt_bias, lower_bound=-8.0)
        assert bool(np.isfinite(np.asarray(o)).all()) is finite, shift
    # what "auto" lowers to on a GPU or TPU: the kernels for the bounded safe gate, the data check else
    opts = dict(scale=32 ** -0.5, initial_state=None, chunk_size=64, segment_ids=None, return_chunk_states=False,
                use_qk_l2norm=False, a_log=None, dt_bias=None, lower_bound=None)
    assert api._accelerator_form(q, v, 64, True, -5.0, opts).keywords["impl"] == "pallas"
    assert api.pallas_safe_gate(True, SAFE_LOG_DECAY) and SAFE_LOG_DECAY == -5.0
    for fused, bound in ((True, None), (True, SAFE_LOG_DECAY - 0.01), (True, 0.5), (False, -5.0)):
        assert not api.pallas_safe_gate(fused, bound), (fused, bound)
        assert api._accelerator_form(q, v, 64, fused, bound, opts).__name__ == "checked", (fused, bound)
    assert api._accelerator_form(q, v, 48, True, -5.0, opts).keywords["impl"] == "chunked"  # not a kernel chunk
    # shapes the kernels do not take (chunk 48, K = 24): "auto" runs the chunked path, no error
    for chunk, dk in ((48, 32), (64, 24)):
        xq, xk, xv, xf, xb, _, _, _ = make_inputs(7, 1, 40, 2, dk, dk)
        xg = -0.5 * jax.random.uniform(jax.random.PRNGKey(3), xf.shape)
        o, _ = kimi_delta_attention(l2_normalize(xq), l2_normalize(xk), xv, xg, xb, impl="auto", chunk_size=chunk)
        ro, _ = kda_reference(l2_normalize(xq), l2_normalize(xk), xv, xg, xb, scale=dk ** -0.5)
        assert rel_l2(o, ro) < 2e-5, (chunk, dk)
    # ... and the accelerators' "auto" with a gate not bounded by construction takes the kernels where
    # the data allows (here: interpret mode) and the chunked path elsewhere: right either way
    def accel_auto(q, k, v, g, beta, initial_state=None):
        run = api._accelerator_form(q, v, 64, False, None, {**opts, "initial_state": initial_state})
        return run(q, k, v, g, beta)

    jaxpr = str(jax.make_jaxpr(lambda g: accel_auto(qn, kn, v, g, beta))(-5.0 * u))
    assert "cond[" in jaxpr and "pallas_call" in jaxpr
    for low in (-5.0, -8.0):
        g = low * u
        o, ht = accel_auto(qn, kn, v, g, beta, initial_state=h0)
        ro, rht = kda_reference(qn, kn, v, g, beta, scale=32 ** -0.5, initial_state=h0)
        assert rel_l2(o, ro) < 2e-5 and rel_l2(ht, rht) < 2e-5, low
        x = (qn, kn, v, g, beta, a_log, dt_bias, h0)
        ga = _grads(lambda *a, **kw: accel_auto(*a[:5], initial_state=a[7]), x, None, False, seed=6)
        gr = _grads(lambda *a, **kw: kda_reference(*a[:5], scale=32 ** -0.5, initial_state=a[7]), x, None, False,
                    seed=6)
        for name, a, b in zip(NAMES, ga, gr, strict=True):
            if name not in ("a_log", "dt_bias"):
                assert rel_l2(a, b) < 2e-5, (low, name)


@pytest.mark.heavy
def test_forward_head_dim_128():
    """K = V = 128 (the model's head size) in interpret mode; the lowering tests below use 128 too."""
    x = make_inputs(5, 1, 70, 1, 128, 128)
    o, ht = pallas(*x)
    ro, rht = reference(*x)
    assert rel_l2(o, ro) < 2e-5 and rel_l2(ht, rht) < 2e-5


def test_golden_op_vectors():
    path = GOLDEN / "kda_op_a.npz"
    d = np.load(path)
    o, ht = kimi_delta_attention(
        jnp.asarray(d["q"]), jnp.asarray(d["k"]), jnp.asarray(d["v"]), jnp.asarray(d["g_raw"]),
        jnp.asarray(d["beta"]), scale=float(d["scale"]), initial_state=jnp.asarray(d["initial_state"]),
        impl="pallas", use_qk_l2norm=True, a_log=jnp.asarray(d["A_log"]),
        dt_bias=jnp.asarray(d["dt_bias"]), lower_bound=float(d["lower_bound"]))
    assert rel_l2(o, d["o"]) <= 5e-5
    assert rel_l2(ht, d["final_state"]) <= 5e-5


# ------------------------------------------------------------------------------------------------
# gradients
# ------------------------------------------------------------------------------------------------

NAMES = ("q", "k", "v", "g", "beta", "a_log", "dt_bias", "h0")


def _grads(fn, x, segs, states: bool, seed: int):
    """Gradients of a random linear functional of (o, final state[, chunk states])."""
    outs = jax.eval_shape(lambda *a: fn(*a, segment_ids=segs, states=states), *x)
    ws = [jax.random.normal(jax.random.PRNGKey(seed + i), s.shape) for i, s in enumerate(outs)]

    def loss(*a):
        res = fn(*a, segment_ids=segs, states=states)
        return sum(jnp.sum(r.astype(jnp.float32) * w) for r, w in zip(res, ws, strict=True))

    return jax.grad(loss, argnums=tuple(range(len(x))))(*x)


@pytest.mark.parametrize(
    ("t", "dtype", "tol", "states", "backend"),
    [
        (65, jnp.float32, 3e-5, True, None),
        pytest.param(63, jnp.bfloat16, 3e-2, False, None, marks=pytest.mark.heavy),
        pytest.param(65, jnp.float32, 3e-5, True, "tpu", marks=pytest.mark.heavy),
    ],
)
def test_gradients_match_reference(t, dtype, tol, states, backend):
    x = make_inputs(100 + t, 2, t, 2, 32, 32, dtype)
    segs = awkward_segments(2, t)
    gp = _grads(functools.partial(pallas, backend=backend), x, segs, states, seed=7)
    gr = _grads(reference, x, segs, states, seed=7)
    for name, a, b in zip(NAMES, gp, gr, strict=True):
        assert a.dtype == b.dtype, name
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        assert rel_l2(a, b) < tol, (name, rel_l2(a, b))


@pytest.mark.heavy
def test_gradients_long_sequence():
    x = make_inputs(9, 1, 1000, 2, 32, 32)
    segs = awkward_segments(1, 1000)
    gp = _grads(pallas, x, segs, False, seed=3)
    gr = _grads(reference, x, segs, False, seed=3)
    for name, a, b in zip(NAMES, gp, gr, strict=True):
        assert rel_l2(a, b) < 5e-5, name


def test_tpu_variant_forward():
    x = make_inputs(21, 1, 100, 2, 32, 32)
    segs = awkward_segments(1, 100)
    o, ht, cs = pallas(*x, segment_ids=segs, states=True, backend="tpu")
    ro, rht, rcs = reference(*x, segment_ids=segs, states=True)
    assert rel_l2(o, ro) < 2e-5 and rel_l2(ht, rht) < 2e-5 and rel_l2(cs, rcs) < 2e-5


# ------------------------------------------------------------------------------------------------
# lowering for the real backends (no device needed)
# ------------------------------------------------------------------------------------------------


def _export_fwd_and_grad(backend: str, platform: str, dk: int = 128, **kw):
    b, t, h = 1, 128, 2
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = (sd((b, t, h, dk), bf), sd((b, t, h, dk), bf), sd((b, t, h, dk), bf), sd((b, t, h, dk), bf),
            sd((b, t, h), bf), sd((h,), jnp.float32), sd((h * dk,), jnp.float32),
            sd((b, h, dk, dk), jnp.float32))

    def fwd(*a):
        return kda_pallas(*a[:5], scale=dk ** -0.5, initial_state=a[7], use_qk_l2norm=True, a_log=a[5],
                          dt_bias=a[6], backend=backend, interpret=False, **kw)

    def loss(*a):
        o, ht = fwd(*a)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for fn in (fwd, jax.grad(loss, argnums=tuple(range(8)))):
        exp = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)
        assert exp.mlir_module()


def test_bad_tile_settings_are_refused():
    x = make_inputs(3, 1, 16, 1, 32, 32)
    with pytest.raises(ValueError, match="num_warps keys"):
        pallas(*x, num_warps={"bwd_main": 8})
    with pytest.raises(ValueError, match="bk_kv=24 must divide K=32"):
        pallas(*x, block_k_kv=24)
    with pytest.raises(ValueError, match="on TPU K=32 or a multiple of 128"):
        pallas(*x, block_k=16, backend="tpu", interpret=False)


@pytest.mark.parametrize("kw", [{}, {"block_k": 128}, {"chunk_size": 32}], ids=["default", "one_key_block", "chunk32"])
def test_triton_lowering(h200_lowering, kw):
    """Default key blocks (32 of K = 128: the `scf.for` loops), one block, and chunks of 32 (their own
    tiles, `pallas.default_tiles`: 2-warp [C, C] kernels, 64-wide key blocks, 32-wide value blocks)."""
    _export_fwd_and_grad("triton", "cuda", **kw)


@pytest.mark.parametrize("blocks", [{}, pytest.param({"dk": 256, "block_k": 128, "block_k_kv": 128},
                                                     marks=pytest.mark.heavy)])
def test_tpu_lowering(monkeypatch, blocks):
    """One key block (the TPU default), and two: the backward's key-block grid with lane-dim blocks."""
    tpu_info = pytest.importorskip("jax._src.tpu_info")
    if not hasattr(tpu_info, "registry"):
        pytest.skip("this jax has no TPU-info registry to describe a TPU with")
    monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind,
                        lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5P, 1))
    _export_fwd_and_grad("tpu", "tpu", **blocks)

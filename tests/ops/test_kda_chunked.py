"""`impl="chunked"` KDA (ling_jax/ops/kda/chunked.py) against the golden vectors and the reference.

Small shapes. Compilation dominates the run time: inputs are made in numpy, jitted functions are
cached, and the reference is compiled independently of the chunk size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN

from ling_jax.ops import kimi_delta_attention
from ling_jax.ops.kda.chunked import kda_chunked
from ling_jax.ops.kda.reference import kda_reference

jax.config.update("jax_default_matmul_precision", "highest")

B, H, K, V = 2, 2, 16, 8
SCALE = K**-0.5


def assert_close(x: jax.Array, y: jax.Array, tol: float, what: str = "") -> None:
    """Relative L2 ‖x − y‖ / ‖y‖ over the whole array, in float64, at most `tol` (printed for -s)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    err = float(np.linalg.norm(x - y) / np.linalg.norm(y))
    print(f"rel-L2 {what}: {err:.2e}")
    assert err <= tol, f"{what}: relative L2 {err:.3e} > {tol:.0e}"


def random_inputs(seed: int, t: int, g_range: tuple[float, float] = (-5.0, 0.0)) -> dict[str, np.ndarray]:
    """Fresh non-zero inputs: q, k L2-normalised, g uniform in `g_range`, β in (0, 1), a random state.

    numpy, so that no per-shape JAX compilation is spent on making inputs.
    """
    rng = np.random.default_rng(seed)
    f32 = np.float32

    def unit(shape: tuple[int, ...]) -> np.ndarray:
        x = rng.standard_normal(shape)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(f32)

    return dict(
        q=unit((B, t, H, K)),
        k=unit((B, t, H, K)),
        v=rng.standard_normal((B, t, H, V)).astype(f32),
        g=rng.uniform(*g_range, size=(B, t, H, K)).astype(f32),
        beta=(1 / (1 + np.exp(-rng.standard_normal((B, t, H))))).astype(f32),
        s0=rng.standard_normal((B, H, K, V)).astype(f32),
    )


@functools.cache
def kda_fn(impl: str, chunk_size: int, with_state: bool, with_segments: bool):
    """jit: (q, k, v, g, beta, s0, segment_ids) -> (o, final_state, states entering chunks).

    s0 / segment_ids are ignored unless `with_state` / `with_segments`. The reference runs with
    chunk_size=1 (every token's incoming state), which the tests slice, so its compilations do not
    depend on the chunk size.
    """
    fn = kda_chunked if impl == "chunked" else kda_reference
    chunk_size = chunk_size if impl == "chunked" else 1

    def run(q, k, v, g, beta, s0, segment_ids):
        return fn(q, k, v, g, beta, scale=SCALE, initial_state=s0 if with_state else None,
                  segment_ids=segment_ids if with_segments else None, chunk_size=chunk_size,
                  return_chunk_states=True)

    return jax.jit(run)


def check_against_reference(
    x: dict[str, np.ndarray],
    chunk_size: int,
    with_state: bool = True,
    segment_ids: np.ndarray | None = None,
    o_tol: float = 1e-5,
    x_ref: dict[str, np.ndarray] | None = None,
) -> None:
    """Chunked on `x` against the reference on `x_ref` (default `x`): o, final state, chunk states."""
    x_ref = x if x_ref is None else x_ref
    seg = np.zeros(x["beta"].shape[:2], np.int32) if segment_ids is None else segment_ids
    flags = (with_state, segment_ids is not None)
    keys = ("q", "k", "v", "g", "beta", "s0")
    o_ref, s_ref, s_in_ref = kda_fn("reference", 1, *flags)(*(x_ref[n] for n in keys), seg)
    o, s, cs = kda_fn("chunked", chunk_size, *flags)(*(x[n] for n in keys), seg)
    t = x["q"].shape[1]
    assert o.shape == o_ref.shape and o.dtype == x["v"].dtype and s.dtype == jnp.float32
    assert cs.shape == (B, -(-t // chunk_size), H, K, V)
    assert bool(jnp.isfinite(o).all()) and bool(jnp.isfinite(s).all())
    assert_close(o, o_ref, o_tol, "o")
    assert_close(s, s_ref, 1e-5, "final_state")
    if with_state or t > chunk_size:  # (without a state and one chunk, both are all zero)
        assert_close(cs, s_in_ref[:, ::chunk_size], 1e-5, "chunk_states")


# ---------------------------------------------------------------- 1. golden op vectors


def test_golden_kda_op_a():
    path = GOLDEN / "kda_op_a.npz"
    gd = np.load(path)
    assert gd["q"].shape[1] % 64 != 0  # T = 100 exercises the padded tail
    o, s = jax.jit(
        lambda q, k, v, g_raw, beta, s0, a_log, dt_bias: kimi_delta_attention(
            q, k, v, g_raw, beta, scale=float(gd["scale"]), initial_state=s0, impl="chunked",
            use_qk_l2norm=True, a_log=a_log, dt_bias=dt_bias, lower_bound=float(gd["lower_bound"]),
        )
    )(gd["q"], gd["k"], gd["v"], gd["g_raw"], gd["beta"], gd["initial_state"], gd["A_log"], gd["dt_bias"])
    assert_close(o, gd["o"], 5e-5, "o")
    assert_close(s, gd["final_state"], 5e-5, "final_state")


# ---------------------------------------------------------------- 2. chunked == reference

LENGTHS = (1, 63, 64, 65, 200)
CASES = [(t, c, True) for t in LENGTHS for c in (16, 64)] + [(t, c, False) for t in (1, 65) for c in (16, 64)]


@pytest.mark.parametrize(("t", "chunk_size", "with_state"), CASES)
def test_matches_reference_fp32(t: int, chunk_size: int, with_state: bool):
    check_against_reference(random_inputs(t, t), chunk_size, with_state)


def test_matches_reference_bf16_inputs():
    """bf16 q, k, v, g, β: internal math is float32, so only the bf16 rounding of o differs."""
    x = random_inputs(1000, 200)
    x16 = {n: a if n == "s0" else jnp.asarray(a, jnp.bfloat16) for n, a in x.items()}
    x32 = {n: np.asarray(a, np.float32) for n, a in x16.items()}  # the same values, for the reference
    check_against_reference(x16, 64, o_tol=5e-3, x_ref=x32)  # bf16 rounding of o: ~2e-3


# ---------------------------------------------------------------- 3. strong decays


def test_strong_decay_near_lower_bound():
    """g in [-5, -4.5] over 4 whole 64-token chunks: Γ reaches -320 within a chunk."""
    x = random_inputs(7, 256, g_range=(-5.0, -4.5))
    check_against_reference(x, 64)
    # the naive factorisation e^Γ_i · e^-Γ_j would overflow here
    assert float(np.cumsum(x["g"][:, :64], axis=1).min()) < -88.7


# ---------------------------------------------------------------- 4. segments and chunk states

T_SEG = 80


def segment_ids_awkward() -> np.ndarray:
    """[B, 80] ids with boundaries at awkward positions for chunk sizes 16 and 64."""
    starts = [
        [1, 5, 16, 20, 23, 27, 48, 64, 79],  # t = 1, inside chunks, at chunk starts, several in one, T − 1
        [3, 4, 5, 32, 63, 66],  # one-token segments, a boundary just before a 64-chunk start
    ]
    ids = np.zeros((B, T_SEG), np.int32)
    for b, row in enumerate(starts):
        for s in row:
            ids[b, s:] += 1
    ids[1, 40:50] = 0  # a return to an earlier id is a new segment too (as in the reference)
    return ids


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_segments_and_chunk_states(chunk_size: int):
    check_against_reference(random_inputs(11, T_SEG), chunk_size, segment_ids=segment_ids_awkward())


# ---------------------------------------------------------------- 5. gradients


def test_gradients_match_reference():
    """d(loss)/d(q, k, v, g, β, initial_state), with segments and a padded tail (T = 50, C = 16)."""
    t = 50
    x = random_inputs(23, t)
    seg = jnp.asarray([[0] * 20 + [1] * 30, [0] * 45 + [1] * 5], jnp.int32)
    rng = np.random.default_rng(5)
    w_o = rng.standard_normal((B, t, H, V)).astype(np.float32)
    w_s = rng.standard_normal((B, H, K, V)).astype(np.float32)

    def loss(fn, q, k, v, g, beta, s0):
        o, s = fn(q, k, v, g, beta, scale=SCALE, initial_state=s0, segment_ids=seg, chunk_size=16)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    keys = ("q", "k", "v", "g", "beta", "s0")
    argnums = tuple(range(len(keys)))
    g_ref = jax.jit(jax.grad(functools.partial(loss, kda_reference), argnums))(*(x[n] for n in keys))
    g_chk = jax.jit(jax.grad(functools.partial(loss, kda_chunked), argnums))(*(x[n] for n in keys))
    for name, a, b in zip(keys, g_chk, g_ref, strict=True):
        assert bool(jnp.isfinite(a).all()), name
        assert_close(a, b, 1e-4, f"d/d{name}")

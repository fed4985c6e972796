"""The short-conv kernels (interpret mode on CPU) against the XLA form `conv_silu`, forward and gradients.

Random inputs and weights, lengths around the row block (1, 31, 33, 65), packed segments with
boundaries at random places, one and three parts, float32 and bf16 (the bf16 kernels against the
float32 XLA form), the kernels' lowering for CUDA, and the model's KDA layer on the kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.config import LingConfig
from ling_jax.kernels import select
from ling_jax.layers.kda import kda_mixer
from ling_jax.ops.short_conv import BLOCK_P, BLOCK_T, INNER, conv_silu, conv_silu_parts
from ling_jax.params import init_params, layer_params


def _inputs(seed: int, b: int, t: int, q: int, segments: bool):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(b, t, q)), jnp.float32)
    w = jnp.asarray(0.5 * rng.normal(size=(q, 4)), jnp.float32)
    seg = jnp.asarray(np.cumsum(rng.random((b, t)) < 0.15, axis=1), jnp.int32) if segments else None
    return x, w, seg


def _loss_and_grads(impl: str, x, w, seg, parts: int, cts, blocks=(BLOCK_T, BLOCK_P, INNER)):
    def loss(x, w):
        ys = conv_silu_parts(x, w, seg, parts, impl=impl, interpret=True, blocks=blocks)
        return sum(jnp.sum(y.astype(jnp.float32) * c) for y, c in zip(ys, cts, strict=True)), ys

    (_, ys), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return ys, grads


@pytest.mark.parametrize("t, parts", [(1, 1), (31, 1), (33, 1), (65, 1), (65, 3),
                                      *(pytest.param(t, 3, marks=pytest.mark.heavy) for t in (1, 31, 33))])
@pytest.mark.parametrize("segments", [False, True])
def test_kernels_match_xla_float32(t, segments, parts):
    """Default tiles (one backward program for these lengths) and small ones (several programs of
    several row blocks each, two channel blocks per part)."""
    b, p = 2, 2 * BLOCK_P
    x, w, seg = _inputs(t + 7 * parts, b, t, parts * p, segments)
    cts = [jnp.asarray(np.random.default_rng(i).normal(size=(b, t, p)), jnp.float32) for i in range(parts)]
    ys_ref, (dx_ref, dw_ref) = _loss_and_grads("xla", x, w, seg, parts, cts)
    for blocks in ((BLOCK_T, BLOCK_P, INNER), (16, BLOCK_P, 2)):
        ys, (dx, dw) = _loss_and_grads("pallas", x, w, seg, parts, cts, blocks)
        for y, y_ref in zip(ys, ys_ref, strict=True):
            np.testing.assert_allclose(y, y_ref, atol=2e-6, rtol=2e-6)
        np.testing.assert_allclose(dx, dx_ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(dw, dw_ref, atol=1e-4, rtol=1e-5)


def test_kernels_bf16_against_float32():
    """bf16 activations, float32 weights: the kernels' results round once from float32 sums."""
    b, t, parts, p = 2, 45, 3, 2 * BLOCK_P
    x, w, seg = _inputs(5, b, t, parts * p, True)
    x16 = x.astype(jnp.bfloat16)
    cts = [jnp.asarray(np.random.default_rng(i).normal(size=(b, t, p)), jnp.float32) for i in range(parts)]
    ys_ref, (dx_ref, dw_ref) = _loss_and_grads("xla", x16.astype(jnp.float32), w, seg, parts, cts)
    ys, (dx, dw) = _loss_and_grads("pallas", x16, w, seg, parts, cts)
    assert all(y.dtype == jnp.bfloat16 for y in ys) and dx.dtype == jnp.bfloat16
    for y, y_ref in zip(ys, ys_ref, strict=True):
        assert rel_l2(y.astype(jnp.float32), y_ref) < 4e-3
    assert rel_l2(dx.astype(jnp.float32), dx_ref) < 4e-3
    assert rel_l2(dw, dw_ref) < 4e-3  # dw sums float32 products of bf16-rounded cotangents


def test_segments_restart_the_taps():
    """A row right after a boundary sees none of the previous document (the kernels and XLA agree on it
    above; this pins the XLA form itself to the definition)."""
    x, w, _ = _inputs(1, 1, 8, BLOCK_P, False)
    seg = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1]], jnp.int32)
    y = conv_silu_parts(x, w, seg, 1, impl="pallas", interpret=True)[0]
    alone = conv_silu(x[:, 3:], w)
    np.testing.assert_allclose(y[:, 3:], alone, atol=2e-6)


def test_bad_arguments():
    x, w, _ = _inputs(0, 1, 8, 3 * 48, False)
    with pytest.raises(ValueError, match="power-of-two width"):
        conv_silu_parts(x, w, None, 3, impl="pallas")
    with pytest.raises(ValueError, match="do not split"):
        conv_silu_parts(x, w, None, 5, impl="xla")
    with pytest.raises(ValueError, match="impl="):
        conv_silu_parts(x, w, None, 3, impl="triton")


def test_triton_lowering(h200_lowering):
    sd = jax.ShapeDtypeStruct
    x, w, seg = sd((2, 100, 3 * 128), jnp.bfloat16), sd((3 * 128, 4), jnp.float32), sd((2, 100), jnp.int32)

    def loss(x, w, seg):
        ys = conv_silu_parts(x, w, seg, 3, impl="pallas", interpret=False)
        return sum(jnp.sum(y.astype(jnp.float32)) for y in ys)

    assert "short_conv_fwd" in h200_lowering(lambda *a: conv_silu_parts(*a, 3, impl="pallas", interpret=False),
                                             x, w, seg)
    assert "short_conv_bwd" in h200_lowering(jax.grad(loss, argnums=(0, 1)), x, w, seg)


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_kda_layer_on_the_kernels_matches_xla():
    """The model's KDA mixer with kda_impl "pallas" (conv kernels, interpreted) equals the chunked
    path (XLA conv), output and gradients, on a packed batch."""
    cfg = LingConfig.preset("debug")
    p = layer_params(cfg, init_params(cfg, seed=2), 0)["attn"]  # layer 0: KDA
    x, _, seg = _inputs(3, 2, 40, cfg.hidden_size, True)

    def run(impl):
        c = dataclasses.replace(cfg, kda_impl=impl)

        def f(p, x):
            out, _ = kda_mixer(p, x, cfg=c, kernels=select(c, dtype=x.dtype), segment_ids=seg)
            return jnp.sum(out * jnp.cos(out)), out

        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(p, x)

    (_, out_ref), g_ref = run("chunked")
    (_, out), g = run("pallas")
    assert rel_l2(out, out_ref) < 1e-4
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        assert rel_l2(a, b) < 1e-3

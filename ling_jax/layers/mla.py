"""Gated multi-head latent attention, expanded K/V form (§2.5) — the prefill and training path.

q from a low-rank (q_a -> norm -> q_b) or direct projection; one latent c and one shared rope key
per token (kv_a), the normed latent up-projected per head to k_nope and v (kv_b), interleaved
RoPE on the rope slices, softmax attention at scale 1/sqrt(qk_head_dim), a per-head (or
per-element) sigmoid output gate, then `dense`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ling_jax.config import LingConfig
from ling_jax.kernels import Kernels
from ling_jax.layers.rope import apply_rope
from ling_jax.ops.attention import attention, masked_softmax
from ling_jax.ops.attention_pallas import mla_attention_pallas
from ling_jax.ops.norms import rms_norm
from ling_jax.sharding import per_shard

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the constructor default (§2.2)
Linear = Callable[[jax.Array, Any], jax.Array]  # x [..., C], a [C, O] weight -> [..., O]


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., C] @ w [C, O] in x's dtype: the projections of the sequence forms."""
    return x @ w.astype(x.dtype)


def input_projections(p: dict[str, Any]) -> list[str]:
    """The weights that multiply the layer's normed input: the query's (or its low-rank first
    factor), kv_a and the output gate, in that order."""
    return ["q_proj" if "q_proj" in p else "q_a_proj", "kv_a_proj", "g_proj"]


def _projected_inputs(p: dict[str, Any], x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x times each of `input_projections`: (query's first product, kv_a's, the gate logits)."""
    return tuple(x_BTD @ p[n].astype(x_BTD.dtype) for n in input_projections(p))


def mla_query(p: dict[str, Any], q_in: jax.Array, cfg: LingConfig, linear: Linear = matmul) -> jax.Array:
    """[B, T, H, qk_head_dim] query (nope dims first, rope dims last), before RoPE, from the input's
    product with q_proj (or with q_a_proj, then normed and up-projected by q_b_proj here, through
    `linear`)."""
    q = q_in if "q_proj" in p else linear(rms_norm(q_in, p["q_a_norm"], LATENT_NORM_EPS), p["q_b_proj"])
    return q.reshape(*q.shape[:2], cfg.num_attention_heads, cfg.qk_head_dim)


def mla_latent(p: dict[str, Any], ckv_BTW: jax.Array, cfg: LingConfig) -> tuple[jax.Array, jax.Array]:
    """(normed latent c [B, T, r], un-rotated shared rope key [B, T, d_r]) from the input's product
    with kv_a_proj."""
    c, k_rot = jnp.split(ckv_BTW, [cfg.kv_lora_rank], axis=-1)
    return rms_norm(c, p["kv_a_norm"], LATENT_NORM_EPS), k_rot


def mla_output(p: dict[str, Any], o_BTHV: jax.Array, gate_BTX: jax.Array, linear: Linear = matmul) -> jax.Array:
    """Sigmoid output gate (fp32, cast back; gate_BTX: the input's product with g_proj) on each
    head's output, then `dense` (through `linear`): [B, T, D]."""
    b, t, h, dv = o_BTHV.shape
    gate = jax.nn.sigmoid(gate_BTX.astype(jnp.float32)).astype(gate_BTX.dtype)
    o_BTHV = o_BTHV * gate.reshape(b, t, h, -1)  # [.., H, 1] head-wise or [.., H, dv] element-wise
    return linear(o_BTHV.reshape(b, t, h * dv), p["dense"])


def mla_mixer(
    p: dict[str, Any], x_BTD: jax.Array, *, cfg: LingConfig, kernels: Kernels, cos: jax.Array, sin: jax.Array,
    mask_BTS: jax.Array, absorbed: bool = False, docs: tuple[jax.Array, jax.Array] | None = None,
    past_BSW: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [B, T, D] (input-normed) -> (out [B, T, D], {"latent": [B, T, r + d_r]} to cache).

    cos/sin: [B, T, d_r / 2] for the tokens' positions; mask_BTS: visibility (see ops.attention);
    `docs`: the same visibility as document numbers (`ops.attention_pallas.documents`), with which
    the expanded form runs the fused kernels where `kernels.attention` is "pallas" (it requires them).
    `absorbed`: attend over the latent rows as the decode step does (§5.1: W_UK folded into the
    query, W_UV after the weighted sum) instead of expanding per-head K/V. The same function; the
    expanded form is the faster one over sequences (BENCHMARKS.md, "Prefill attention: expanded vs
    absorbed vs fused MLA"), so prefill and training run it. `past_BSW` (absorbed only, else
    ValueError): the cached latent rows [B, S, r + d_r] of the tokens before x (a prefill chunk
    continuing a sequence); the keys are then [past ‖ x] and `mask_BTS` is [B, T, S + T].
    """
    if past_BSW is not None and not absorbed:
        raise ValueError("mla_mixer: past latent rows are attended in the absorbed form (absorbed=True)")
    b, t, _ = x_BTD.shape
    h, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    q_in, ckv_BTW, gate_BTX = _projected_inputs(p, x_BTD)
    q_BTHD = mla_query(p, q_in, cfg)
    q_nope, q_rot = jnp.split(q_BTHD, [dn], axis=-1)
    q_rot = apply_rope(q_rot, cos, sin)
    c_BTR, k_rot_BTd = mla_latent(p, ckv_BTW, cfg)
    k_rot_BTd = apply_rope(k_rot_BTd, cos, sin)
    latent_BTW = jnp.concatenate([c_BTR, k_rot_BTd], axis=-1)
    if absorbed:
        dt = x_BTD.dtype
        w_uk_RHN, w_uv_RHV = absorbed_weights(p, cfg)
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk_RHN.astype(dt), preferred_element_type=jnp.float32)
        q_BTHW = jnp.concatenate([q_lat.astype(dt), q_rot], axis=-1)
        keys_BSW = latent_BTW if past_BSW is None else jnp.concatenate([past_BSW.astype(dt), latent_BTW], axis=1)
        s_BHTS = jnp.einsum("bthw,bsw->bhts", q_BTHW, keys_BSW, preferred_element_type=jnp.float32)
        p_BHTS = masked_softmax(s_BHTS * cfg.qk_head_dim**-0.5, mask_BTS, dt)
        o_BTHR = jnp.einsum("bhts,bsr->bthr", p_BHTS, keys_BSW[..., :cfg.kv_lora_rank])
        o_BTHV = jnp.einsum("bthr,rhv->bthv", o_BTHR, w_uv_RHV.astype(dt))
        return mla_output(p, o_BTHV, gate_BTX), {"latent": latent_BTW}
    kv_BTHX = (c_BTR @ p["kv_b_proj"].astype(x_BTD.dtype)).reshape(b, t, h, dn + dv)
    k_nope, v_BTHV = jnp.split(kv_BTHX, [dn], axis=-1)
    if kernels.attention == "pallas":
        if docs is None:
            raise ValueError("mla_mixer: the fused attention kernels need `docs` (ops.attention_pallas.documents), "
                             "not only a mask")
        o_BTHV = _fused_attention(q_nope, q_rot, k_nope, k_rot_BTd, v_BTHV, docs, cfg)
        return mla_output(p, o_BTHV, gate_BTX), {"latent": latent_BTW}
    q_BTHD = jnp.concatenate([q_nope, q_rot], axis=-1)
    k_BTHD = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot_BTd[:, :, None], (b, t, h, cfg.qk_rope_head_dim))], -1)
    o_BTHV = attention(q_BTHD, k_BTHD, v_BTHV, mask_BTS, scale=cfg.qk_head_dim**-0.5)
    return mla_output(p, o_BTHV, gate_BTX), {"latent": latent_BTW}


def _fused_attention(q_nope: jax.Array, q_rot: jax.Array, k_nope: jax.Array, k_rot_BTd: jax.Array,
                     v_BTHV: jax.Array, docs: tuple[jax.Array, jax.Array], cfg: LingConfig) -> jax.Array:
    """The expanded attention through the fused kernels, per shard under a multi-device context mesh
    (rows over the token axes, heads over tensor): [B, T, H, d_v]."""
    args = dict(q_nope_BTHN=q_nope, q_rope_BTHR=q_rot, k_nope_BTHN=k_nope, k_rope_BTR=k_rot_BTd, v_BTHV=v_BTHV,
                doc_q_BT=docs[0], doc_k_BT=docs[1])
    dims = {"q_nope_BTHN": "b.h.", "q_rope_BTHR": "b.h.", "k_nope_BTHN": "b.h.", "k_rope_BTR": "b..",
            "v_BTHV": "b.h.", "doc_q_BT": "b.", "doc_k_BT": "b."}
    fn = functools.partial(mla_attention_pallas, scale=cfg.qk_head_dim**-0.5)
    return per_shard(fn, args, dims, "b.h.", batch=q_nope.shape[0], heads=q_nope.shape[2])


def absorbed_weights(p: dict[str, Any], cfg: LingConfig) -> tuple[jax.Array, jax.Array]:
    """kv_b_proj [r, H * (d_n + d_v)] split per head into W_UK [r, H, d_n] and W_UV [r, H, d_v]."""
    w = p["kv_b_proj"].reshape(cfg.kv_lora_rank, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
    return w[..., : cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim :]

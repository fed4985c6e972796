"""Gated multi-head latent attention, expanded K/V form (§2.5) — the prefill and training path.

q from a low-rank (q_a -> norm -> q_b) or direct projection; one latent c and one shared rope key
per token (kv_a), the normed latent up-projected per head to k_nope and v (kv_b), interleaved
RoPE on the rope slices, softmax attention at scale 1/sqrt(qk_head_dim), a per-head (or
per-element) sigmoid output gate, then `dense`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ling_jax.checkpoint.fp8 import is_block_fp8
from ling_jax.config import LingConfig
from ling_jax.layers.norms import rms_norm
from ling_jax.layers.rope import apply_rope
from ling_jax.ops.attention import attention, masked_softmax
from ling_jax.ops.attention_pallas import mla_attention_pallas
from ling_jax.ops.latent_attention_pallas import latent_attention_pallas
from ling_jax.ops.layer_gemv import FUSED_INPUT, column_starts, linear, pad_columns
from ling_jax.ops.mla_decode import LatentStack, latent_attention
from ling_jax.sharding import per_shard

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the constructor default (§2.2)


def _input_projections(p: dict[str, Any]) -> list[str]:
    """The weights that multiply the layer's normed input: the query's (or its low-rank first
    factor), kv_a and the output gate, in that order."""
    return ["q_proj" if "q_proj" in p else "q_a_proj", "kv_a_proj", "g_proj"]


def fuse_input_projections(p: dict[str, Any]) -> dict[str, Any]:
    """An MLA layer's params (one layer's or stacked) plus `FUSED_INPUT`: the `_input_projections`
    side by side (zero columns up to the gemv kernel's tiles, `ops.layer_gemv.pad_columns`), so that a
    decode step reads them in one matrix-vector product instead of three. Made once per decode call
    (a second copy of those weights meanwhile); unchanged where they are FP8-resident."""
    ws = [p[n] for n in _input_projections(p)]
    if any(is_block_fp8(w) for w in ws):
        return p
    return {**p, FUSED_INPUT: pad_columns(jnp.concatenate(ws, axis=-1))}


def _projected_inputs(p: dict[str, Any], x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x times each of `_input_projections`: (query's first product, kv_a's, the gate logits), from
    the fused projection in one product where the params have it."""
    names = _input_projections(p)
    if FUSED_INPUT not in p:
        return tuple(linear(x_BTD, p[n]) for n in names)
    y = linear(x_BTD, p[FUSED_INPUT])
    s = column_starts([p[n] for n in names])
    return tuple(y[..., s[i] : s[i + 1]] for i in range(len(names)))


def mla_query(p: dict[str, Any], q_in: jax.Array, cfg: LingConfig) -> jax.Array:
    """[B, T, H, qk_head_dim] query (nope dims first, rope dims last), before RoPE, from the input's
    product with q_proj (or with q_a_proj, then normed and up-projected by q_b_proj here)."""
    q = q_in if "q_proj" in p else linear(rms_norm(q_in, p["q_a_norm"], LATENT_NORM_EPS), p["q_b_proj"])
    return q.reshape(*q.shape[:2], cfg.num_attention_heads, cfg.qk_head_dim)


def mla_latent(p: dict[str, Any], ckv_BTW: jax.Array, cfg: LingConfig) -> tuple[jax.Array, jax.Array]:
    """(normed latent c [B, T, r], un-rotated shared rope key [B, T, d_r]) from the input's product
    with kv_a_proj."""
    c, k_rot = jnp.split(ckv_BTW, [cfg.kv_lora_rank], axis=-1)
    return rms_norm(c, p["kv_a_norm"], LATENT_NORM_EPS), k_rot


def mla_output(p: dict[str, Any], o_BTHV: jax.Array, gate_BTX: jax.Array) -> jax.Array:
    """Sigmoid output gate (fp32, cast back; gate_BTX: the input's product with g_proj) on each
    head's output, then `dense`: [B, T, D]."""
    b, t, h, dv = o_BTHV.shape
    gate = jax.nn.sigmoid(gate_BTX.astype(jnp.float32)).astype(gate_BTX.dtype)
    o_BTHV = o_BTHV * gate.reshape(b, t, h, -1)  # [.., H, 1] head-wise or [.., H, dv] element-wise
    return linear(o_BTHV.reshape(b, t, h * dv), p["dense"])


def mla_mixer(
    p: dict[str, Any], x_BTD: jax.Array, *, cfg: LingConfig, cos: jax.Array, sin: jax.Array,
    mask_BTS: jax.Array, absorbed: bool = False, docs: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [B, T, D] (input-normed) -> (out [B, T, D], {"latent": [B, T, r + d_r]} to cache).

    cos/sin: [B, T, d_r / 2] for the tokens' positions; mask_BTS: visibility (see ops.attention);
    `docs`: the same visibility as document numbers (`ops.attention_pallas.documents`), with which
    the expanded form runs the fused kernels where `cfg.pallas_attention` (attention_impl "pallas"
    requires them; "auto" without them keeps the XLA softmax).
    `absorbed`: attend over the latent rows as the decode step does (§5.1: W_UK folded into the
    query, W_UV after the weighted sum) instead of expanding per-head K/V. The same function; on
    an H200 the expanded form is faster at 2k-16k tokens (1.4-1.6x through the XLA softmax, 2.5-8x
    through the fused kernels; `bench/prefill_mla.py`, BENCHMARKS.md), so prefill and training run it.
    """
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
        s_BHTS = jnp.einsum("bthw,bsw->bhts", q_BTHW, latent_BTW, preferred_element_type=jnp.float32)
        p_BHTS = masked_softmax(s_BHTS * cfg.qk_head_dim**-0.5, mask_BTS, dt)
        o_BTHR = jnp.einsum("bhts,bsr->bthr", p_BHTS, c_BTR)
        o_BTHV = jnp.einsum("bthr,rhv->bthv", o_BTHR, w_uv_RHV.astype(dt))
        return mla_output(p, o_BTHV, gate_BTX), {"latent": latent_BTW}
    kv_BTHX = (c_BTR @ p["kv_b_proj"].astype(x_BTD.dtype)).reshape(b, t, h, dn + dv)
    k_nope, v_BTHV = jnp.split(kv_BTHX, [dn], axis=-1)
    if docs is None and cfg.attention_impl == "pallas":
        raise ValueError("mla_mixer: attention_impl='pallas' needs `docs` (ops.attention_pallas.documents), "
                         "not only a mask")
    if docs is not None and cfg.pallas_attention(x_BTD.dtype):
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


def _attend(q_BHW: jax.Array, latent_BSW: jax.Array | LatentStack, lengths_B: jax.Array, new_BW: jax.Array, *,
            cfg: LingConfig) -> jax.Array:
    """The decode attention over the latent cache [B, H, r]: the Pallas kernel when
    `cfg.pallas_decode("mla")` (per shard under a multi-device context mesh: rows over the token
    axes, as the cache is laid out, heads over tensor), else the XLA loop."""
    kw = dict(rank=cfg.kv_lora_rank, scale=cfg.qk_head_dim**-0.5)
    if isinstance(latent_BSW, LatentStack):  # `run_stack` makes these only where the kernel runs, on one device
        return latent_attention_pallas(q_BHW, latent_BSW.stack, lengths_B, new_BW, layer=latent_BSW.layer, **kw)
    if not cfg.pallas_decode("mla"):
        return latent_attention(q_BHW, latent_BSW, lengths_B, new_BW, **kw)
    args = dict(q_BHW=q_BHW, cache_BSW=latent_BSW, lengths_B=lengths_B, new_BW=new_BW)
    dims = {"q_BHW": "bh.", "cache_BSW": "b..", "lengths_B": "b", "new_BW": "b."}
    return per_shard(functools.partial(latent_attention_pallas, **kw), args, dims, "bh.",
                     batch=q_BHW.shape[0], heads=q_BHW.shape[1])


def mla_decode(
    p: dict[str, Any], x_BD: jax.Array, latent_BSW: jax.Array | LatentStack, lengths_B: jax.Array, *,
    cfg: LingConfig, cos: jax.Array, sin: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token per row against the latent cache, absorbed form (§5.1): (out [B, D], new row [B, r + d_r]).

    The query's nope part is folded through W_UK into the latent space, the attention runs over
    cached [c ‖ k_rot] rows plus the new one at scale 1/sqrt(qk_head_dim), and W_UV up-projects
    the weighted latent afterwards. cos/sin: [B, 1, d_r / 2] for each row's position.
    """
    x_B1D = x_BD[:, None]
    dt = x_BD.dtype
    dn = cfg.qk_nope_head_dim
    q_in, ckv_B1W, gate_B1X = _projected_inputs(p, x_B1D)
    q_BHD = mla_query(p, q_in, cfg)[:, 0]
    q_nope_BHN, q_rot_BHd = q_BHD[..., :dn], apply_rope(q_BHD[:, None, :, dn:], cos, sin)[:, 0]
    c_B1R, k_rot_B1d = mla_latent(p, ckv_B1W, cfg)
    new_BW = jnp.concatenate([c_B1R, apply_rope(k_rot_B1d, cos, sin)], axis=-1)[:, 0]
    w_uk_RHN, w_uv_RHV = absorbed_weights(p, cfg)
    q_lat_BHR = jnp.einsum("bhn,rhn->bhr", q_nope_BHN, w_uk_RHN.astype(dt), preferred_element_type=jnp.float32)
    q_BHW = jnp.concatenate([q_lat_BHR.astype(dt), q_rot_BHd], axis=-1)
    with jax.named_scope("latent_attention"):
        m_BHR = _attend(q_BHW, latent_BSW, lengths_B, new_BW, cfg=cfg)
    o_BHV = jnp.einsum("bhr,rhv->bhv", m_BHR.astype(dt), w_uv_RHV.astype(dt))
    return mla_output(p, o_BHV[:, None], gate_B1X)[:, 0], new_BW

"""The layers' one-token forms: what a decode step runs per layer, against explicit caches.

Each mirrors its sequence form in `ling_jax.layers` (the same function of the same params, to
float32 rounding), reusing its math, and adds what makes a decode step fast: fused input
projections (`fuse_for_decode`), weights read from their layer stacks in place by the decode
kernels (`ling_jax.decode.views`: the gemv kernel through `ops.layer_gemv.linear`, norms applied
by the kernels that read the normed rows), the KDA layer kernel on the cache stacks, the latent
attention kernel, and the expert selection and routed experts as kernels. Which of them run is
the `Kernels` record's choice; the views exist only where `ling_jax.decode.step` made them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ling_jax.cache import LATENT_BLOCK
from ling_jax.checkpoint.fp8 import dense_weights, is_block_fp8
from ling_jax.config import Ffn, LingConfig
from ling_jax.decode.views import FUSED_CONV, FUSED_INPUT, LatentStack, PagedLatent
from ling_jax.kernels import Kernels
from ling_jax.layers import kda as kda_layers
from ling_jax.layers import mla as mla_layers
from ling_jax.layers.moe import expert_parallel, router_logits, select
from ling_jax.layers.rope import apply_rope
from ling_jax.ops.expert_gemv import GatedRows, NormedRows, dense
from ling_jax.ops.kda import kimi_delta_attention
from ling_jax.ops.kda.decode import kda_decode_step, kda_decode_step_pallas
from ling_jax.ops.kda.decode_layer import Inputs, KdaCacheStack, kda_decode_layer
from ling_jax.ops.kda.gate import kda_gate, l2_normalize
from ling_jax.ops.l2_prefetch import Prefetch
from ling_jax.ops.latent_attention_pallas import latent_attention_paged_pallas, latent_attention_pallas
from ling_jax.ops.latent_attention_pallas import supported as paged_supported
from ling_jax.ops.layer_gemv import WeightStack, column_starts, linear, normed, pad_columns, partial_products
from ling_jax.ops.mla_decode import latent_attention, latent_attention_paged
from ling_jax.ops.moe import EXPERT_LEAVES, ExpertStack, SharedStacks, materialize, routed_experts
from ling_jax.ops.norms import gated_rms_norm
from ling_jax.ops.route_pallas import select_experts
from ling_jax.ops.short_conv import conv_silu
from ling_jax.ops.swiglu import swiglu_act
from ling_jax.params import Params
from ling_jax.sharding import context_mesh, per_shard

Rows = jax.Array | NormedRows  # a layer's normed input: rows, or rows whose norm the reading kernel applies


# ----------------------------------------------------------------------------- fused decode params


def _kda_inputs(p: dict[str, Any]) -> list[str]:
    """A KDA layer's weights that multiply its normed input: q, k, v, the gate (or its low-rank first
    factor), the output gate (same) and beta, in that order."""
    return ["q_proj", "k_proj", "v_proj", "f_proj" if "f_proj" in p else "f_a_proj",
            "g_proj" if "g_proj" in p else "g_a_proj", "b_proj"]


def _fused(p: dict[str, Any], names: list[str]) -> jax.Array | None:
    """The weights `names` side by side (zero columns up to the gemv kernel's tiles,
    `ops.layer_gemv.pad_columns`), or None where one is FP8-resident (the concatenation would
    dequantize it)."""
    ws = [p[n] for n in names]
    return None if any(is_block_fp8(w) for w in ws) else pad_columns(jnp.concatenate(ws, axis=-1))


def fuse_kda(p: dict[str, Any]) -> dict[str, Any]:
    """A KDA layer's params (one layer's or stacked) plus `FUSED_INPUT`, every input projection side
    by side (one matrix-vector product instead of six), and `FUSED_CONV`, the q, k and v conv weights
    as one [.., 3P, W] array (what the KDA decode layer kernel reads)."""
    w = _fused(p, _kda_inputs(p))
    if w is None:
        return p
    return {**p, FUSED_INPUT: w, FUSED_CONV: jnp.concatenate([p[f"{n}_conv"] for n in "qkv"], axis=-2)}


def fuse_mla(p: dict[str, Any]) -> dict[str, Any]:
    """An MLA layer's params plus `FUSED_INPUT`: its three input projections side by side."""
    w = _fused(p, mla_layers.input_projections(p))
    return p if w is None else {**p, FUSED_INPUT: w}


def fuse_gate_up(p: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """An MLP's params (or the MoE's, `prefix` "shared_") plus `{prefix}gate_up_proj`, its gate and up
    projections side by side; unchanged where they are FP8-resident."""
    pair = [p[f"{prefix}gate_proj"], p[f"{prefix}up_proj"]]
    if any(is_block_fp8(w) for w in pair):
        return p
    return {**p, f"{prefix}gate_up_proj": jnp.concatenate(pair, axis=-1)}


def _column_slices(p: dict[str, Any], names: list[str], y: jax.Array) -> list[jax.Array]:
    """The product with each of `names` out of the fused projection's output `y`."""
    s = column_starts([p[n] for n in names])
    return [y[..., s[i]:s[i + 1]] for i in range(len(names))]


# ----------------------------------------------------------------------------- the layer


def decoder_layer(p: Params, x_B1D: jax.Array, limits: jax.Array, *, cfg: LingConfig, kernels: Kernels, ffn: Ffn,
                  mix: Callable[[Params, Rows], tuple[jax.Array, Any]]) -> tuple[jax.Array, Any]:
    """One pre-norm decoder layer for one token per row: (x [B, 1, D], the mixer's new cache).

    Norm weights given as `WeightStack`s leave the norms to the gemv kernels that read the normed
    rows (`ops.layer_gemv.normed`). limits: [2] float32 (routed, shared) SwiGLU clamps."""
    p = dense_weights(p, x_B1D.dtype)  # FP8-resident weights: this layer's, dequantized here
    with jax.named_scope("mixer"):
        a, new = mix(p["attn"], normed(x_B1D, p["input_norm"], cfg.rms_norm_eps))
    x_B1D = x_B1D + a
    h = normed(x_B1D, p["post_attn_norm"], cfg.rms_norm_eps)
    with jax.named_scope("ffn"):
        m = p["mlp"]
        if ffn == "dense":
            f = mlp(h, m["gate_proj"], m["up_proj"], m["down_proj"], 0.0, m.get("gate_up_proj"), kernels)
        else:
            f = moe(m, h, cfg=cfg, kernels=kernels, limit=limits[0], shared_limit=limits[1])
    return x_B1D + f, new


def mlp(x: Rows, w_gate: Any, w_up: Any, w_down: Any, limit: jax.Array | float, w_gate_up: Any,
        kernels: Kernels) -> jax.Array:
    """`layers.mlp.mlp` with its weights as arrays or `WeightStack`s; `w_gate_up` (the fused gate|up,
    `fuse_gate_up`), where given, replaces the first two."""
    lin = functools.partial(linear, launch=kernels.tuning.launch)
    if w_gate_up is None:
        gate, up = lin(x, w_gate), lin(x, w_up)
    else:
        gate, up = jnp.split(lin(x, w_gate_up), 2, axis=-1)
    return lin(swiglu_act(gate, up, limit), w_down)


# ----------------------------------------------------------------------------- MoE


def route(x_ND: Rows, w_router: jax.Array | WeightStack, bias: jax.Array | WeightStack, cfg: LingConfig,
          kernels: Kernels, prefetch: tuple[Prefetch, ...] = ()) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`layers.moe.route`'s (indices [N, k], weights [N, k], logits [N, E]). With the router as a
    `WeightStack` (the batch-1 step) its matmul is the gemv kernel's, in float32, and the selection
    kernel adds its partial sums, reads the bias in place and its launch reads the `prefetch` slabs
    into L2."""
    n = x_ND.shape[0]
    if isinstance(w_router, WeightStack):
        logits_SNE = partial_products(x_ND, w_router, kernels.tuning.launch)
        logits_NE = logits_SNE.sum(0)
    else:
        logits_SNE = logits_NE = router_logits(dense(x_ND), w_router, kernels)
    if kernels.route_for(n):
        if prefetch and logits_SNE.ndim == 2:  # the selection's decode-step form
            logits_SNE = logits_SNE[None]
        idx_NK, w_NK = select_experts(logits_SNE, bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                      k=cfg.num_experts_per_tok, scale=cfg.routed_scaling_factor, prefetch=prefetch,
                                      interpret=kernels.tuning.launch.interpret)
    else:
        idx_NK, w_NK = select(logits_NE, bias.value() if isinstance(bias, WeightStack) else bias, cfg)
    return idx_NK, w_NK, logits_NE


def moe(p: dict[str, Any], x: Rows, *, cfg: LingConfig, kernels: Kernels, limit: jax.Array | float,
        shared_limit: jax.Array | float) -> jax.Array:
    """`layers.moe.moe`'s output for a decode step (no aux). Expert weights as `ExpertStack`s run the
    gemv kernel on their stacks, with the stacked shared expert (where `decode.views.split_stacks`
    made one) as one more copy per token in the same launches."""
    x_ND = x.reshape(-1, x.shape[-1])
    shared, prefetch = None, ()
    if isinstance(p.get("shared_gate_up_proj"), ExpertStack):
        shared = SharedStacks(p["shared_gate_up_proj"], p["shared_down_proj"], jnp.asarray(shared_limit, jnp.float32))
        if kernels.tuning.prefetch_shared:
            prefetch = tuple(Prefetch(w.stack, (w.layer, 0)) for w in (shared.gate_up, shared.down))
    with jax.named_scope("router"):
        idx_NK, w_NK, _ = route(x_ND, p["router"], p["expert_bias"], cfg, kernels, prefetch)
    with jax.named_scope("routed"):
        if not kernels.sharded:
            y_ND = routed_experts(x_ND, idx_NK, w_NK, p["gate_proj"], p["up_proj"], p["down_proj"], limit=limit,
                                  impl=kernels.moe_for(idx_NK.size), rows_only=True, shared=shared,
                                  launch=kernels.tuning.launch)
        else:
            y_ND, _ = expert_parallel(dense(x_ND), idx_NK, w_NK, *(materialize(p[n]) for n in EXPERT_LEAVES),
                                      limit=limit, kernels=kernels, mesh=context_mesh())
    if "shared_gate_proj" in p and shared is None:
        with jax.named_scope("shared"):
            y_ND = y_ND + mlp(x_ND, p["shared_gate_proj"], p["shared_up_proj"], p["shared_down_proj"], shared_limit,
                              p.get("shared_gate_up_proj"), kernels)
    return y_ND.reshape(x.shape)


# ----------------------------------------------------------------------------- KDA


def kda(p: dict[str, Any], x_B1D: Rows, cache: dict[str, jax.Array] | KdaCacheStack, *, cfg: LingConfig,
        kernels: Kernels) -> tuple[jax.Array, dict[str, jax.Array] | KdaCacheStack]:
    """`layers.kda.kda_mixer` for one token per row on the cached state and conv window: (out [B, 1, D],
    the new cache). A `KdaCacheStack` cache (the unrolled step's stacks) runs the layer kernel."""
    if isinstance(cache, KdaCacheStack):
        return _kda_layer_kernel(p, x_B1D, cache, cfg=cfg, kernels=kernels)
    lin = functools.partial(linear, launch=kernels.tuning.launch)
    x = dense(x_B1D)
    b, h, dh = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    with jax.named_scope("qkv"):
        qkv, f, z, bl = _kda_projections(p, x, lin)
        # keep the projections out of the fusion that stacks every layer's new conv window (one
        # fused loop there is slower than the step without it)
        qkv = jax.lax.optimization_barrier(qkv)
    w_3PW = jnp.concatenate([p["q_conv"], p["k_conv"], p["v_conv"]], axis=0)
    qkv, conv_state = kda_layers.short_conv(qkv, w_3PW, cache["conv"])
    q_BHK, k_BHK, v_BHV = (a.reshape(b, h, dh) for a in jnp.split(qkv[:, 0], 3, axis=-1))
    g_BHK = kda_gate(f.reshape(b, 1, h, dh), p["A_log"], p["dt_bias"], cfg.kda_lower_bound)[:, 0]
    beta_BH = jax.nn.sigmoid(bl[:, 0].astype(jnp.float32))
    with jax.named_scope("recurrence"):
        o_BHV, state = _kda_step(l2_normalize(q_BHK), l2_normalize(k_BHK), v_BHV, g_BHK, beta_BH, cache["state"],
                                 cfg=cfg, kernels=kernels)
    o = gated_rms_norm(o_BHV[:, None], z.reshape(b, 1, h, dh), p["o_norm"], cfg.rms_norm_eps)
    return lin(o.reshape(b, 1, h * dh), p["o_proj"]), {"state": state, "conv": conv_state}


def kda_rows(p: dict[str, Any], x_R1D: Rows, cache: dict[str, jax.Array], t: int, *, cfg: LingConfig,
             kernels: Kernels) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`kda` for T consecutive tokens per sequence given as rows r = b * T + i (the verify step's row
    form): the projections over all R = B * T rows (one product per weight), then `kda_tokens` per
    sequence. Returns (out [R, 1, D], `kda_tokens`' record); the cache is unchanged."""
    lin = functools.partial(linear, launch=kernels.tuning.launch)
    x = dense(x_R1D)
    r, h, dh = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    b = r // t
    qkv, f, z, bl = _kda_projections(p, x, lin)
    o, record = kda_tokens(p, qkv.reshape(b, t, -1), f.reshape(b, t, -1), z.reshape(b, t, -1), bl.reshape(b, t, h),
                           cache, cfg=cfg)
    return lin(o.reshape(r, 1, h * dh), p["o_proj"]), record


def kda_tokens(p: dict[str, Any], qkv_BT3P: jax.Array, f_BTX: jax.Array, z_BTX: jax.Array, bl_BTH: jax.Array,
               cache: dict[str, jax.Array], *, cfg: LingConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A KDA layer between its input projections and `o_proj` for T tokens per sequence continuing the
    cached window and state: the short conv, L2 norms, gate, beta, the token recurrence
    (`ops.kda.reference`) and the gated output norm. Takes the projections (q|k|v [B, T, 3P], the
    gate's f and the output gate's z [B, T, H * K], the beta logits [B, T, H]) and cache {"state"
    [B, H, K, V], "conv" [B, W-1, 3P]}; returns (o [B, T, H * V] before `o_proj`, the record
    `verify.commit` advances the cache with: "k" (L2-normed) [B, T, H, K], "v" [B, T, H, V], "g" (log
    decay) [B, T, H, K] f32, "beta" [B, T, H] f32, "inputs" (the conv's) [B, T, 3P])."""
    b, t = qkv_BT3P.shape[:2]
    h, dh = cfg.num_attention_heads, cfg.head_dim
    w_3PW = jnp.concatenate([p["q_conv"], p["k_conv"], p["v_conv"]], axis=0)
    q_, k_, v_ = (a.reshape(b, t, h, dh) for a in jnp.split(conv_silu(qkv_BT3P, w_3PW, None, cache["conv"]), 3, -1))
    q_, k_ = l2_normalize(q_), l2_normalize(k_)
    g_BTHK = kda_gate(f_BTX.reshape(b, t, h, dh), p["A_log"], p["dt_bias"], cfg.kda_lower_bound)
    beta_BTH = jax.nn.sigmoid(bl_BTH.astype(jnp.float32))
    with jax.named_scope("recurrence"):
        o_BTHV, _ = kimi_delta_attention(q_, k_, v_, g_BTHK, beta_BTH, scale=dh**-0.5, initial_state=cache["state"],
                                         impl="reference")
    o = gated_rms_norm(o_BTHV, z_BTX.reshape(b, t, h, dh), p["o_norm"], cfg.rms_norm_eps)
    return o.reshape(b, t, h * dh), {"k": k_, "v": v_, "g": g_BTHK, "beta": beta_BTH, "inputs": qkv_BT3P}


def _kda_projections(p: dict[str, Any], x: jax.Array, lin: Callable[..., jax.Array]) -> tuple[jax.Array, ...]:
    """A KDA layer's products of its normed input: (q|k|v, the gate's f, the output gate's z, the beta
    logits), from the fused projection where the params have it (one product), else one by one."""
    if FUSED_INPUT in p:  # every input projection in one product
        q, k, v, f, z, bl = _column_slices(p, _kda_inputs(p), lin(x, p[FUSED_INPUT]))
        f = f if "f_proj" in p else lin(f, p["f_b_proj"])
        z = z if "g_proj" in p else lin(z, p["g_b_proj"])
        return jnp.concatenate([q, k, v], axis=-1), f, z, bl
    qkv = jnp.concatenate([lin(x, p[f"{n}_proj"]) for n in "qkv"], axis=-1)
    return qkv, _proj(x, p, "f", lin), _proj(x, p, "g", lin), lin(x, p["b_proj"])


def _proj(x: jax.Array, p: dict[str, Any], name: str, lin: Callable[..., jax.Array]) -> jax.Array:
    if f"{name}_proj" in p:
        return lin(x, p[f"{name}_proj"])
    return lin(lin(x, p[f"{name}_a_proj"]), p[f"{name}_b_proj"])


def _kda_step(q_BHK: jax.Array, k_BHK: jax.Array, v_BHV: jax.Array, g_BHK: jax.Array, beta_BH: jax.Array,
              state_BHKV: jax.Array, *, cfg: LingConfig, kernels: Kernels) -> tuple[jax.Array, jax.Array]:
    """One KDA token per row on the cached state: the Pallas kernel where `kernels.decode_kda` (per
    shard under a multi-device context mesh: rows over the token axes, heads over tensor), else XLA."""
    scale = cfg.head_dim**-0.5
    if not kernels.decode_kda:
        return kda_decode_step(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV, scale=scale)
    args = dict(q_BHK=q_BHK, k_BHK=k_BHK, v_BHV=v_BHV, g_BHK=g_BHK, beta_BH=beta_BH, state_BHKV=state_BHKV)
    dims = {"q_BHK": "bh.", "k_BHK": "bh.", "v_BHV": "bh.", "g_BHK": "bh.", "beta_BH": "bh", "state_BHKV": "bh.."}
    step = functools.partial(kda_decode_step_pallas, scale=scale, launch=kernels.tuning.launch)
    return per_shard(step, args, dims, ("bh.", "bh.."), batch=q_BHK.shape[0], heads=q_BHK.shape[1])


def _kda_layer_kernel(p: dict[str, Any], x_B1D: Rows, cache: KdaCacheStack, *, cfg: LingConfig,
                      kernels: Kernels) -> tuple[jax.Array, KdaCacheStack]:
    """`kda` with the conv, gate and recurrence in one kernel (`ops.kda.decode_layer`) on the segment's
    cache stacks: (out [B, 1, D], the cache with the state stack updated in place and the layer's new
    window). Takes the fused decode params: q|k|v, f and the beta logits are read by column from the
    fused projection's output, f through its second low-rank factor where the gates are low-rank.
    With the output norm's weight and o_proj as stack views, o_proj's kernel applies the gated
    output norm as it reads o (`expert_gemv.GatedRows`); else XLA does."""
    lin = functools.partial(linear, launch=kernels.tuning.launch)
    b, h, dh = x_B1D.shape[0], cfg.num_attention_heads, cfg.head_dim
    s = column_starts([p[n] for n in _kda_inputs(p)])
    with jax.named_scope("qkv"):
        y_BO = lin(x_B1D[:, 0], p[FUSED_INPUT])
        f = (y_BO, s[3]) if "f_proj" in p else (lin(y_BO[:, s[3]:s[4]], p["f_b_proj"]), 0)
        z = (y_BO, s[4]) if "g_proj" in p else (lin(y_BO[:, s[4]:s[5]], p["g_b_proj"]), 0)  # (holder, column)
    with jax.named_scope("recurrence"):
        o_BHV, ss_BHJ, new = kda_decode_layer(Inputs(qkv=(y_BO, 0), f=f, b=(y_BO, s[5])), cache, p[FUSED_CONV],
                                              p["A_log"], p["dt_bias"], lower_bound=cfg.kda_lower_bound,
                                              launch=kernels.tuning.launch)
    norm_w, o_BX = p["o_norm"], o_BHV.reshape(b, h * dh)
    if isinstance(norm_w, WeightStack) and isinstance(p["o_proj"], WeightStack):  # the norm in o_proj's kernel
        rows = GatedRows(o_BX, ss_BHJ, z[0], norm_w.stack, norm_w.layer, z[1], cfg.rms_norm_eps)
        return lin(rows, p["o_proj"])[:, None], new
    norm_w = norm_w.value() if isinstance(norm_w, WeightStack) else norm_w
    z_BHV = z[0][:, z[1]:z[1] + h * dh].reshape(b, h, dh)
    o_BX = gated_rms_norm(o_BHV, z_BHV, norm_w, cfg.rms_norm_eps).reshape(b, h * dh)
    return lin(o_BX, p["o_proj"])[:, None], new


# ----------------------------------------------------------------------------- MLA


def mla(p: dict[str, Any], x_BD: Rows, latent: jax.Array | LatentStack | PagedLatent, lengths_B: jax.Array, *,
        cfg: LingConfig, kernels: Kernels, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row against the latent cache [B, S, r + d_r] (or its `LatentStack`, or its pages:
    `PagedLatent`), absorbed form (§5.1): (out [B, D], the token's new latent row [B, r + d_r]).

    The query's nope part is folded through W_UK into the latent space, the attention runs over the
    cached [c ‖ k_rot] rows j < lengths[b] plus the new one at scale 1/sqrt(qk_head_dim), and W_UV
    up-projects the weighted latent afterwards. cos/sin: [B, 1, d_r / 2] for each row's position.
    """
    q_BHW, new_BW, gate_B1X = _mla_query(p, x_BD, cfg=cfg, kernels=kernels, cos=cos, sin=sin)
    with jax.named_scope("latent_attention"):
        m_BHR = _attend(q_BHW, latent, lengths_B, new_BW, cfg=cfg, kernels=kernels)
    return _mla_output(p, m_BHR, gate_B1X, cfg=cfg, kernels=kernels), new_BW


def mla_rows(p: dict[str, Any], x_RD: Rows, pages: PagedLatent, positions_R: jax.Array, write_R: jax.Array, *,
             cfg: LingConfig, kernels: Kernels, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`mla` for rows that continue each other (the verify step's positions of one sequence as rows
    sharing its pages): each row's new latent row is first written into the paged pool at its
    position (`write_R`: [R] bool; a row not written drops its write), then every row attends over
    the pool's positions j < positions[r] and its own row, so a row sees the rows of the earlier
    positions written beside it. pages: a `PagedLatent` with a stacked pool and each row's page
    table. Returns (out [R, D], the pool stack with the rows written)."""
    q_RHW, new_RW, gate_R1X = _mla_query(p, x_RD, cfg=cfg, kernels=kernels, cos=cos, sin=sin)
    page_size = pages.pool.shape[-2]
    table_RN = pages.page_table
    n_pages, capacity = pages.pool.shape[-3], table_RN.shape[1] * page_size
    slot_R = jnp.minimum(positions_R // page_size, table_RN.shape[1] - 1)
    page_R = jnp.take_along_axis(table_RN, slot_R[:, None], axis=1)[:, 0]
    page_R = jnp.where(write_R & (positions_R < capacity), page_R, n_pages)  # out of range: dropped
    pool = pages.pool.at[pages.layer, page_R, positions_R % page_size].set(new_RW.astype(pages.pool.dtype),
                                                                            mode="drop")
    with jax.named_scope("latent_attention"):
        m_RHR = _attend(q_RHW, PagedLatent(pool, table_RN, pages.layer), positions_R, new_RW, cfg=cfg,
                        kernels=kernels)
    return _mla_output(p, m_RHR, gate_R1X, cfg=cfg, kernels=kernels), pool


def _mla_query(p: dict[str, Any], x_BD: Rows, *, cfg: LingConfig, kernels: Kernels, cos: jax.Array,
               sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`mla`'s absorbed query [B, H, r + d_r], the token's new latent row [B, r + d_r] and its output
    gate's input [B, 1, X]."""
    lin = functools.partial(linear, launch=kernels.tuning.launch)
    x_B1D = x_BD[:, None]
    dt = x_BD.dtype
    dn = cfg.qk_nope_head_dim
    names = mla_layers.input_projections(p)
    if FUSED_INPUT in p:
        q_in, ckv_B1W, gate_B1X = _column_slices(p, names, lin(x_B1D, p[FUSED_INPUT]))
    else:
        q_in, ckv_B1W, gate_B1X = (lin(x_B1D, p[n]) for n in names)
    q_BHD = mla_layers.mla_query(p, q_in, cfg, linear=lin)[:, 0]
    q_nope_BHN, q_rot_BHd = q_BHD[..., :dn], apply_rope(q_BHD[:, None, :, dn:], cos, sin)[:, 0]
    c_B1R, k_rot_B1d = mla_layers.mla_latent(p, ckv_B1W, cfg)
    new_BW = jnp.concatenate([c_B1R, apply_rope(k_rot_B1d, cos, sin)], axis=-1)[:, 0]
    w_uk_RHN, _ = mla_layers.absorbed_weights(p, cfg)
    q_lat_BHR = jnp.einsum("bhn,rhn->bhr", q_nope_BHN, w_uk_RHN.astype(dt), preferred_element_type=jnp.float32)
    return jnp.concatenate([q_lat_BHR.astype(dt), q_rot_BHd], axis=-1), new_BW, gate_B1X


def _mla_output(p: dict[str, Any], m_BHR: jax.Array, gate_B1X: jax.Array, *, cfg: LingConfig,
                kernels: Kernels) -> jax.Array:
    """`mla`'s output [B, D] from the attention's weighted latent [B, H, r]: W_UV, the gate, o_proj."""
    lin = functools.partial(linear, launch=kernels.tuning.launch)
    _, w_uv_RHV = mla_layers.absorbed_weights(p, cfg)
    dt = gate_B1X.dtype
    o_BHV = jnp.einsum("bhr,rhv->bhv", m_BHR.astype(dt), w_uv_RHV.astype(dt))
    return mla_layers.mla_output(p, o_BHV[:, None], gate_B1X, linear=lin)[:, 0]


def _attend(q_BHW: jax.Array, latent_BSW: jax.Array | LatentStack | PagedLatent, lengths_B: jax.Array,
            new_BW: jax.Array, *, cfg: LingConfig, kernels: Kernels) -> jax.Array:
    """The decode attention over the latent cache [B, H, r]: the Pallas kernel where `kernels.decode_mla`
    (on a `LatentStack` in place; per shard under a multi-device context mesh: rows over the token
    axes, as the cache is laid out, heads over tensor), else the XLA loop. Paged (`PagedLatent`): the
    paged kernel on one device where it tiles the pages, the paged XLA loop elsewhere."""
    kw = dict(rank=cfg.kv_lora_rank, scale=cfg.qk_head_dim**-0.5)
    if isinstance(latent_BSW, PagedLatent):
        paged = latent_attention_paged
        rope = q_BHW.shape[-1] - cfg.kv_lora_rank
        if kernels.decode_mla and not kernels.sharded and paged_supported(cfg.kv_lora_rank, rope,
                                                                          latent_BSW.pool.shape[-2]):
            paged = functools.partial(latent_attention_paged_pallas, launch=kernels.tuning.launch)
        return paged(q_BHW, latent_BSW.pool, latent_BSW.page_table, lengths_B, new_BW, layer=latent_BSW.layer, **kw)
    if isinstance(latent_BSW, LatentStack):
        return latent_attention_pallas(q_BHW, latent_BSW.stack, lengths_B, new_BW, layer=latent_BSW.layer,
                                       launch=kernels.tuning.launch, **kw)
    if not kernels.decode_mla:
        return latent_attention(q_BHW, latent_BSW, lengths_B, new_BW, block=LATENT_BLOCK, **kw)
    args = dict(q_BHW=q_BHW, cache_BSW=latent_BSW, lengths_B=lengths_B, new_BW=new_BW)
    dims = {"q_BHW": "bh.", "cache_BSW": "b..", "lengths_B": "b", "new_BW": "b."}
    attend = functools.partial(latent_attention_pallas, launch=kernels.tuning.launch, **kw)
    return per_shard(attend, args, dims, "bh.", batch=q_BHW.shape[0], heads=q_BHW.shape[1])

"""KDA mixer: projections, causal short conv + SiLU, gate, beta, delta rule, gated norm (§2.4).

The recurrence itself is `ops.kimi_delta_attention` (impl from the config); this file owns what
surrounds it. Padding (`valid` false) and document boundaries (`segment_ids`) never reach the
recurrent state or the conv window: pad positions get a zero conv input, beta = 0 and g = 0, and
the conv taps and the recurrence restart at a segment boundary.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ling_jax.checkpoint.fp8 import is_block_fp8
from ling_jax.config import LingConfig
from ling_jax.layers.norms import gated_rms_norm
from ling_jax.ops.expert_gemv import GatedRows, NormedRows, dense
from ling_jax.ops.kda import kimi_delta_attention
from ling_jax.ops.kda.api import DEFAULT_CHUNK, resolve_impl
from ling_jax.ops.kda.decode import kda_decode_step, kda_decode_step_pallas
from ling_jax.ops.kda.decode_layer import Inputs, KdaCacheStack, kda_decode_layer
from ling_jax.ops.kda.gate import kda_gate, l2_normalize
from ling_jax.ops.kda.pallas_chunk import bounded_gate, supports
from ling_jax.ops.l2_prefetch import Prefetch
from ling_jax.ops.layer_gemv import FUSED_INPUT, WeightStack, column_starts, linear, pad_columns
from ling_jax.ops.short_conv import conv_silu, conv_silu_parts
from ling_jax.ops.short_conv import supports as conv_supports
from ling_jax.sharding import context_mesh, multi_device, per_shard


def short_conv(a_BTP: jax.Array, w_PW: jax.Array, state_BWP: jax.Array | None,
               seg_BT: jax.Array | None = None, end_B: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv + SiLU: (silu(conv) [B, T, P] in a's dtype, new window [B, W-1, P]).

    `state` holds the W-1 inputs before this chunk (zeros at sequence start); tap W-1 multiplies
    the current token. With `seg_BT`, taps that reach into an earlier segment read zero. The new
    window holds the W-1 inputs before position `end_B` of each row (default T: the last ones),
    so a right-padded row keeps the window of its last real token.
    """
    return conv_silu(a_BTP, w_PW, seg_BT, state_BWP), conv_window(a_BTP, w_PW.shape[1], state_BWP, end_B)


def conv_window(a_BTP: jax.Array, width: int, state_BWP: jax.Array | None, end_B: jax.Array | None) -> jax.Array:
    """The W-1 conv inputs before position `end_B` of each row (None: T), the window a decode continues from."""
    b, t, p = a_BTP.shape
    if state_BWP is None:
        state_BWP = jnp.zeros((b, width - 1, p), a_BTP.dtype)
    ext_BXP = jnp.concatenate([state_BWP.astype(a_BTP.dtype), a_BTP], axis=1)
    if end_B is None:
        return ext_BXP[:, t:]
    return jax.vmap(lambda e, n: jax.lax.dynamic_slice_in_dim(e, n, width - 1, axis=0))(ext_BXP, end_B)


def _conv_impl(impl: str, p: int) -> str:
    """The short conv's form beside a KDA `impl`: its kernels where the KDA kernels run on a GPU (or
    interpreted off GPU/TPU, as in tests), on one device (GSPMD cannot partition a kernel), for q/k/v
    of width `p` the kernels take; else XLA."""
    use = (impl == "pallas" and jax.default_backend() != "tpu" and not multi_device(context_mesh())
           and conv_supports(p, 3))
    return "pallas" if use else "xla"


# dims of each kimi_delta_attention argument: "b" batch, "h" heads, None unsharded
_KDA_DIMS = {"q": "b.h.", "k": "b.h.", "v": "b.h.", "g": "b.h.", "beta": "b.h", "initial_state": "bh..",
             "segment_ids": "b.", "a_log": "h", "dt_bias": "h."}


def _kda_impl(cfg: LingConfig) -> str:
    """The KDA implementation `cfg.kda_impl` resolves to for the config's gate (fused, or precomputed
    by `kda_gate` with the same bound) and head width."""
    return resolve_impl(cfg.kda_impl, bounded_gate(cfg.kda_lower_bound),
                        supports(DEFAULT_CHUNK, cfg.head_dim, cfg.head_dim))


def _sharded_kda(args: dict[str, Any], *, cfg: LingConfig, scale: float) -> tuple[jax.Array, jax.Array]:
    """`kimi_delta_attention` on `args`; under a multi-device context mesh with the Pallas kernels
    (which GSPMD cannot partition), one `shard_map` runs them per shard: batch rows over the token
    axes, heads over `tensor` (the layouts the sharding table gives these activations)."""
    args = {k: v for k, v in args.items() if v is not None}
    lower_bound = args.pop("lower_bound", cfg.kda_lower_bound)

    impl = _kda_impl(cfg)

    def op(**a: jax.Array) -> tuple[jax.Array, jax.Array]:
        if "dt_bias" in a:  # a shard's [H_local, K] back to the op's head-major [H_local * K]
            a["dt_bias"] = a["dt_bias"].reshape(-1)
        return kimi_delta_attention(scale=scale, impl=impl, use_qk_l2norm=True,
                                    lower_bound=lower_bound,
                                    **{k: a[k] for k in ("q", "k", "v", "g", "beta")},
                                    **{k: v for k, v in a.items() if k not in ("q", "k", "v", "g", "beta")})

    if not multi_device(context_mesh()) or impl != "pallas":
        return op(**args)
    if "dt_bias" in args:  # [H * K] head-major -> [H, K] so heads can be split
        args["dt_bias"] = args["dt_bias"].reshape(cfg.num_attention_heads, -1)
    return per_shard(op, args, _KDA_DIMS, ("b.h.", "bh.."), batch=args["q"].shape[0], heads=args["q"].shape[2])


def _decode_step(q_BHK: jax.Array, k_BHK: jax.Array, v_BHV: jax.Array, g_BHK: jax.Array, beta_BH: jax.Array,
                 state_BHKV: jax.Array, *, cfg: LingConfig) -> tuple[jax.Array, jax.Array]:
    """One KDA token per row on the cached state: the Pallas kernel when `cfg.pallas_decode("kda")`
    (per shard under a multi-device context mesh: rows over the token axes, heads over tensor), else XLA."""
    scale = cfg.head_dim**-0.5
    if not cfg.pallas_decode("kda"):
        return kda_decode_step(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV, scale=scale)
    args = dict(q_BHK=q_BHK, k_BHK=k_BHK, v_BHV=v_BHV, g_BHK=g_BHK, beta_BH=beta_BH, state_BHKV=state_BHKV)
    dims = {"q_BHK": "bh.", "k_BHK": "bh.", "v_BHV": "bh.", "g_BHK": "bh.", "beta_BH": "bh", "state_BHKV": "bh.."}
    return per_shard(functools.partial(kda_decode_step_pallas, scale=scale), args, dims, ("bh.", "bh.."),
                     batch=q_BHK.shape[0], heads=q_BHK.shape[1])


def _proj(x: jax.Array, p: dict[str, Any], name: str) -> jax.Array:
    if f"{name}_proj" in p:
        return linear(x, p[f"{name}_proj"])
    return linear(linear(x, p[f"{name}_a_proj"]), p[f"{name}_b_proj"])


FUSED_CONV = "qkv_conv"  # the decode params' q|k|v conv weights stacked [3P, W] (`fuse_input_projections`)
PREFETCH_O_PROJ = True  # the decode step's recurrence kernel reads o_proj into L2 (`ops.l2_prefetch`)


def _input_projections(p: dict[str, Any]) -> list[str]:
    """The weights that multiply the layer's normed input: q, k, v, the gate (or its low-rank first
    factor), the output gate (same) and beta, in that order."""
    return ["q_proj", "k_proj", "v_proj", "f_proj" if "f_proj" in p else "f_a_proj",
            "g_proj" if "g_proj" in p else "g_a_proj", "b_proj"]


def fuse_input_projections(p: dict[str, Any]) -> dict[str, Any]:
    """A KDA layer's params (one layer's or stacked: concatenated along the last axis) plus
    `FUSED_INPUT`, every input projection side by side, so that a decode step reads them in one
    matrix-vector product instead of six launches of 1-12 MB each. For the decode loop, made once per
    call; it holds a second copy of those weights meanwhile. Unchanged where they are FP8-resident
    (the concatenation would dequantize them). Zero columns pad the width to the gemv kernel's tiles
    (`ops.layer_gemv.pad_columns`); `_decode_inputs` reads the projections by their own widths.
    Also `FUSED_CONV`, the q, k and v conv weights as one [.., 3P, W] array (what the KDA decode
    layer kernel reads, `ops.kda.decode_layer`)."""
    ws = [p[n] for n in _input_projections(p)]
    if any(is_block_fp8(w) for w in ws):
        return p
    return {**p, FUSED_INPUT: pad_columns(jnp.concatenate(ws, axis=-1)),
            FUSED_CONV: jnp.concatenate([p[f"{n}_conv"] for n in "qkv"], axis=-2)}


def _decode_inputs(p: dict[str, Any], x_BTD: jax.Array) -> tuple[jax.Array, ...]:
    """(qkv [B, T, 3P], gate input f [B, T, HK], output gate z [B, T, HV], beta logits [B, T, H])
    from the fused input projection (`fuse_input_projections`)."""
    s = _input_starts(p)
    y = linear(x_BTD, p[FUSED_INPUT])
    q, k, v, f, z, b = (y[..., s[i]:s[i + 1]] for i in range(6))
    if "f_proj" not in p:
        f = linear(f, p["f_b_proj"])
    if "g_proj" not in p:
        z = linear(z, p["g_b_proj"])
    return jnp.concatenate([q, k, v], axis=-1), f, z, b


def _input_starts(p: dict[str, Any]) -> list[int]:
    """First column of each of `_input_projections` in the fused input projection, then its width."""
    return column_starts([p[n] for n in _input_projections(p)])


def kda_decode_mixer(p: dict[str, Any], x_B1D: jax.Array | NormedRows, cache: KdaCacheStack, *,
                     cfg: LingConfig) -> tuple[jax.Array, KdaCacheStack]:
    """`kda_mixer`'s decode step (one token per row) with the conv, gate and recurrence in one kernel
    (`ops.kda.decode_layer`) on the segment's cache stacks: (out [B, 1, D], the cache with the state
    stack updated in place and the layer's new window). Takes the decode params
    (`fuse_input_projections`): q|k|v, f and the beta logits are read by column from the fused
    projection's output, f through its second low-rank factor where the gates are low-rank. With the
    output norm's weight and o_proj as stack views (the unrolled decode step), o_proj's kernel applies
    the gated output norm as it reads o (`expert_gemv.GatedRows`); else XLA does. With o_proj as a
    stack view, the recurrence's launch reads it into L2 for that kernel (`ops.l2_prefetch`)."""
    b, h, dh = x_B1D.shape[0], cfg.num_attention_heads, cfg.head_dim
    s = _input_starts(p)
    with jax.named_scope("qkv"):
        y_BO = linear(x_B1D[:, 0], p[FUSED_INPUT])
        f = (y_BO, s[3]) if "f_proj" in p else (linear(y_BO[:, s[3]:s[4]], p["f_b_proj"]), 0)
        z = (y_BO, s[4]) if "g_proj" in p else (linear(y_BO[:, s[4]:s[5]], p["g_b_proj"]), 0)  # (holder, column)
    with jax.named_scope("recurrence"):
        w_o = p["o_proj"]
        prefetch = (Prefetch(w_o.stack, (w_o.layer,)),) if PREFETCH_O_PROJ and isinstance(w_o, WeightStack) else ()
        o_BHV, ss_BHJ, new = kda_decode_layer(Inputs(qkv=(y_BO, 0), f=f, b=(y_BO, s[5])), cache, p[FUSED_CONV],
                                              p["A_log"], p["dt_bias"], lower_bound=cfg.kda_lower_bound,
                                              prefetch=prefetch)
    norm_w, o_BX = p["o_norm"], o_BHV.reshape(b, h * dh)
    if isinstance(norm_w, WeightStack) and isinstance(p["o_proj"], WeightStack):  # the norm in o_proj's kernel
        rows = GatedRows(o_BX, ss_BHJ, z[0], norm_w.stack, norm_w.layer, z[1], cfg.rms_norm_eps)
        return linear(rows, p["o_proj"])[:, None], new
    norm_w = norm_w.value() if isinstance(norm_w, WeightStack) else norm_w
    z_BHV = z[0][:, z[1]:z[1] + h * dh].reshape(b, h, dh)
    o_BX = gated_rms_norm(o_BHV, z_BHV, norm_w, cfg.rms_norm_eps).reshape(b, h * dh)
    return linear(o_BX, p["o_proj"])[:, None], new


def kda_mixer(
    p: dict[str, Any], x_BTD: jax.Array | NormedRows, *, cfg: LingConfig, valid_BT: jax.Array | None = None,
    segment_ids: jax.Array | None = None, cache: dict[str, jax.Array] | KdaCacheStack | None = None,
) -> tuple[jax.Array, dict[str, jax.Array] | KdaCacheStack]:
    """x [B, T, D] (input-normed) -> (out [B, T, D], new cache {"state", "conv"}).

    cache: {"state": [B, H, K, V] f32, "conv": [B, W-1, 3P]} or None (fresh sequence); a
    `KdaCacheStack` (the unrolled decode step's stacks, `model.run_stack`) runs `kda_decode_mixer`.
    """
    if isinstance(cache, KdaCacheStack):
        return kda_decode_mixer(p, x_BTD, cache, cfg=cfg)
    x_BTD = dense(x_BTD)
    b, t, _ = x_BTD.shape
    h, dh, pw = cfg.num_attention_heads, cfg.head_dim, cfg.kda_dim
    dt = x_BTD.dtype
    fused = FUSED_INPUT in p and t == 1
    with jax.named_scope("qkv"):
        if fused:  # decode params: every input projection in one product
            qkv_BT3P, f_BTX, z_BTX, b_BTH = _decode_inputs(p, x_BTD)
        elif t > 1:  # one matmul on the weights side by side: its gradient is one matmul, not a split + 3
            qkv_BT3P = x_BTD @ jnp.concatenate([p[f"{n}_proj"].astype(dt) for n in "qkv"], axis=1)
        else:  # decode: no per-step copy of the weights
            qkv_BT3P = jnp.concatenate([linear(x_BTD, p[f"{n}_proj"]) for n in "qkv"], axis=-1)
        if t == 1 and cache is not None:
            # decode: keep the projections out of the fusion that stacks every layer's new conv window
            # (fused in, one ran as a 215 us loop on an H200: 3.64 -> 3.50 ms per batch-1 step without it)
            qkv_BT3P = jax.lax.optimization_barrier(qkv_BT3P)
    if not fused:
        f_BTX, z_BTX, b_BTH = _proj(x_BTD, p, "f"), _proj(x_BTD, p, "g"), linear(x_BTD, p["b_proj"])
    if valid_BT is not None:
        qkv_BT3P = jnp.where(valid_BT[..., None], qkv_BT3P, 0)
    w_3PW = jnp.concatenate([p["q_conv"], p["k_conv"], p["v_conv"]], axis=0)
    end_B = None if valid_BT is None else t - jnp.argmax(valid_BT[:, ::-1], axis=1)  # after the last real token
    if cache is None and t > 1:  # a whole sequence: the parts come out of the conv separately
        conv_state = conv_window(qkv_BT3P, w_3PW.shape[1], None, end_B)
        qkv = conv_silu_parts(qkv_BT3P, w_3PW, segment_ids, 3, impl=_conv_impl(_kda_impl(cfg), pw))
    else:
        qkv_BT3P, conv_state = short_conv(qkv_BT3P, w_3PW, None if cache is None else cache["conv"],
                                          segment_ids, end_B)
        qkv = jnp.split(qkv_BT3P, 3, axis=-1)
    q_BTHK, k_BTHK, v_BTHV = (a.reshape(b, t, h, dh) for a in qkv)
    f_BTHK = f_BTX.reshape(b, t, h, dh)
    beta_BTH = jax.nn.sigmoid(b_BTH.astype(jnp.float32))
    gate_kw: dict[str, Any] = dict(a_log=p["A_log"], dt_bias=p["dt_bias"], lower_bound=cfg.kda_lower_bound)
    if valid_BT is not None:  # pads must neither write (beta = 0) nor decay (g = 0) the state
        beta_BTH = jnp.where(valid_BT[..., None], beta_BTH, 0.0)
        f_BTHK = jnp.where(valid_BT[..., None, None],
                           kda_gate(f_BTHK, p["A_log"], p["dt_bias"], cfg.kda_lower_bound), 0.0)
        gate_kw = {}
    with jax.named_scope("recurrence"):
        if t == 1 and cache is not None:  # decode: one recurrent step on the cached state
            g_BHK = kda_gate(f_BTHK, p["A_log"], p["dt_bias"], cfg.kda_lower_bound)[:, 0] if gate_kw else f_BTHK[:, 0]
            o_BHV, state = _decode_step(l2_normalize(q_BTHK[:, 0]), l2_normalize(k_BTHK[:, 0]), v_BTHV[:, 0],
                                        g_BHK, beta_BTH[:, 0], cache["state"], cfg=cfg)
            o_BTHV = o_BHV[:, None]
        else:
            o_BTHV, state = _sharded_kda(
                dict(q=q_BTHK, k=k_BTHK, v=v_BTHV, g=f_BTHK, beta=beta_BTH,
                     initial_state=None if cache is None else cache["state"], segment_ids=segment_ids, **gate_kw),
                cfg=cfg, scale=dh**-0.5)
    z_BTHV = z_BTX.reshape(b, t, h, dh)
    o_BTHV = gated_rms_norm(o_BTHV, z_BTHV, p["o_norm"], cfg.rms_norm_eps)
    out_BTD = linear(o_BTHV.reshape(b, t, pw), p["o_proj"])
    return out_BTD, {"state": state, "conv": conv_state}

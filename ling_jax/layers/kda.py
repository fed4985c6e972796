"""KDA mixer: projections, causal short conv + SiLU, gate, beta, delta rule, gated norm (§2.4).

The recurrence itself is `ops.kimi_delta_attention` (the implementation `kernels.kda` names); this file owns what
surrounds it. Padding (`valid` false) and document boundaries (`segment_ids`) never reach the
recurrent state or the conv window: pad positions get a zero conv input, beta = 0 and g = 0, and
the conv taps and the recurrence restart at a segment boundary.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ling_jax.config import LingConfig
from ling_jax.kernels import Kernels
from ling_jax.ops.kda import kimi_delta_attention
from ling_jax.ops.kda.gate import kda_gate
from ling_jax.ops.norms import gated_rms_norm
from ling_jax.ops.short_conv import conv_silu, conv_silu_parts
from ling_jax.sharding import per_shard


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


# dims of each kimi_delta_attention argument: "b" batch, "h" heads, None unsharded
_KDA_DIMS = {"q": "b.h.", "k": "b.h.", "v": "b.h.", "g": "b.h.", "beta": "b.h", "initial_state": "bh..",
             "segment_ids": "b.", "a_log": "h", "dt_bias": "h."}


def _sharded_kda(args: dict[str, Any], *, cfg: LingConfig, impl: str, sharded: bool,
                 scale: float) -> tuple[jax.Array, jax.Array]:
    """`kimi_delta_attention(impl=impl)` on `args`; under a multi-device context mesh (`sharded`) with the
    Pallas kernels (which GSPMD cannot partition), one `shard_map` runs them per shard: batch rows over
    the token axes, heads over `tensor` (the layouts the sharding table gives these activations)."""
    args = {k: v for k, v in args.items() if v is not None}
    lower_bound = args.pop("lower_bound", cfg.kda_lower_bound)

    def op(**a: jax.Array) -> tuple[jax.Array, jax.Array]:
        if "dt_bias" in a:  # a shard's [H_local, K] back to the op's head-major [H_local * K]
            a["dt_bias"] = a["dt_bias"].reshape(-1)
        return kimi_delta_attention(scale=scale, impl=impl, use_qk_l2norm=True,
                                    lower_bound=lower_bound,
                                    **{k: a[k] for k in ("q", "k", "v", "g", "beta")},
                                    **{k: v for k, v in a.items() if k not in ("q", "k", "v", "g", "beta")})

    if not sharded or impl != "pallas":
        return op(**args)
    if "dt_bias" in args:  # [H * K] head-major -> [H, K] so heads can be split
        args["dt_bias"] = args["dt_bias"].reshape(cfg.num_attention_heads, -1)
    return per_shard(op, args, _KDA_DIMS, ("b.h.", "bh.."), batch=args["q"].shape[0], heads=args["q"].shape[2])


def _proj(x: jax.Array, p: dict[str, Any], name: str) -> jax.Array:
    """x times the projection `name` (`{name}_proj`, or its low-rank pair `{name}_a_proj`, `{name}_b_proj`)."""
    if f"{name}_proj" in p:
        return x @ p[f"{name}_proj"].astype(x.dtype)
    return (x @ p[f"{name}_a_proj"].astype(x.dtype)) @ p[f"{name}_b_proj"].astype(x.dtype)


def kda_mixer(
    p: dict[str, Any], x_BTD: jax.Array, *, cfg: LingConfig, kernels: Kernels, valid_BT: jax.Array | None = None,
    segment_ids: jax.Array | None = None, cache: dict[str, jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [B, T, D] (input-normed) -> (out [B, T, D], new cache {"state", "conv"}): training, prefill, and
    a prefill chunk that continues a cached sequence.

    cache: {"state": [B, H, K, V] f32, "conv": [B, W-1, 3P]} or None (fresh sequence). The recurrence
    runs `kernels.kda`, a whole sequence's short conv `kernels.conv`. The decode step's one-token
    forms are `ling_jax.decode.layers`.
    """
    b, t, _ = x_BTD.shape
    h, dh, pw = cfg.num_attention_heads, cfg.head_dim, cfg.kda_dim
    dt = x_BTD.dtype
    with jax.named_scope("qkv"):
        # one matmul on the weights side by side: its gradient is one matmul, not a split + 3
        qkv_BT3P = x_BTD @ jnp.concatenate([p[f"{n}_proj"].astype(dt) for n in "qkv"], axis=1)
        f_BTX, z_BTX, b_BTH = _proj(x_BTD, p, "f"), _proj(x_BTD, p, "g"), x_BTD @ p["b_proj"].astype(dt)
    if valid_BT is not None:
        qkv_BT3P = jnp.where(valid_BT[..., None], qkv_BT3P, 0)
    w_3PW = jnp.concatenate([p["q_conv"], p["k_conv"], p["v_conv"]], axis=0)
    end_B = None if valid_BT is None else t - jnp.argmax(valid_BT[:, ::-1], axis=1)  # after the last real token
    if cache is None and t > 1:  # a whole sequence: the parts come out of the conv separately
        conv_state = conv_window(qkv_BT3P, w_3PW.shape[1], None, end_B)
        qkv = conv_silu_parts(qkv_BT3P, w_3PW, segment_ids, 3, impl=kernels.conv)
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
        o_BTHV, state = _sharded_kda(
            dict(q=q_BTHK, k=k_BTHK, v=v_BTHV, g=f_BTHK, beta=beta_BTH,
                 initial_state=None if cache is None else cache["state"], segment_ids=segment_ids, **gate_kw),
            cfg=cfg, impl=kernels.kda, sharded=kernels.sharded, scale=dh**-0.5)
    z_BTHV = z_BTX.reshape(b, t, h, dh)
    o_BTHV = gated_rms_norm(o_BTHV, z_BTHV, p["o_norm"], cfg.rms_norm_eps)
    out_BTD = o_BTHV.reshape(b, t, pw) @ p["o_proj"].astype(dt)
    return out_BTD, {"state": state, "conv": conv_state}

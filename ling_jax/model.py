"""The Ling-3 forward pass: embed -> layer stack -> final norm -> lm_head (+ MTP).

The stack follows `LingConfig.segments`: a `run` is one `lax.scan` over layers of one kind, a
`groups` segment one `lax.scan` over groups whose body scans the group's KDA layers and applies
its MLA layer. So the stack compiles once per distinct layer kind, whatever the depth.

Per-layer SwiGLU clamp limits (§2.6) are not params: they come from the config as constants and
ride along the scans as `xs`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import Ffn, LingConfig, Mixer
from ling_jax.layers.kda import kda_mixer
from ling_jax.layers.mla import mla_mixer
from ling_jax.layers.mlp import mlp
from ling_jax.layers.moe import moe
from ling_jax.layers.norms import rms_norm
from ling_jax.layers.rope import rope_cos_sin
from ling_jax.ops.attention import attention_mask as visibility
from ling_jax.params import Params, layer_params


@dataclasses.dataclass(frozen=True)
class Context:
    """Per-call arrays every layer may need (a pytree, so it can be closed over in scans)."""

    cos: jax.Array  # [B, T, d_r / 2] f32
    sin: jax.Array
    mask_BTS: jax.Array  # MLA visibility
    valid_BT: jax.Array | None  # False at padding
    segment_ids: jax.Array | None  # [B, T] packed documents


jax.tree_util.register_dataclass(
    Context, data_fields=["cos", "sin", "mask_BTS", "valid_BT", "segment_ids"], meta_fields=[]
)


def make_context(cfg: LingConfig, input_ids: jax.Array, *, attention_mask: jax.Array | None = None,
                 positions: jax.Array | None = None, segment_ids: jax.Array | None = None) -> Context:
    """Positions default to the index among the row's real tokens (left padding gives the first
    real token position 0, as without padding) and restart at each segment."""
    b, t = input_ids.shape
    valid = None if attention_mask is None else attention_mask.astype(bool)
    if positions is None:
        if segment_ids is not None:
            start = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
            idx = jnp.broadcast_to(jnp.arange(t), (b, t))
            positions = idx - jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
        elif valid is not None:
            positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
        else:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cos, sin = rope_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
    idx = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = visibility(idx, idx, valid, segment_ids, segment_ids)
    return Context(cos, sin, mask, valid, segment_ids)


def decoder_layer(
    p: Params, x_BTD: jax.Array, limits: jax.Array, *, cfg: LingConfig, mixer: Mixer, ffn: Ffn,
    ctx: Context,
) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
    """One pre-norm decoder layer: x -> (x, mixer cache, router aux).

    limits: [2] float32, the (routed, shared) SwiGLU clamp of this layer (0 = none).
    """
    h = rms_norm(x_BTD, p["input_norm"], cfg.rms_norm_eps)
    if mixer == "kda":
        a, cache = kda_mixer(p["attn"], h, cfg=cfg, valid_BT=ctx.valid_BT, segment_ids=ctx.segment_ids)
    else:
        a, cache = mla_mixer(p["attn"], h, cfg=cfg, cos=ctx.cos, sin=ctx.sin, mask_BTS=ctx.mask_BTS)
    x_BTD = x_BTD + a
    h = rms_norm(x_BTD, p["post_attn_norm"], cfg.rms_norm_eps)
    if ffn == "dense":
        f, aux = mlp(h, p["mlp"]["gate_proj"], p["mlp"]["up_proj"], p["mlp"]["down_proj"]), {}
    else:
        f, aux = moe(p["mlp"], h, cfg=cfg, limit=limits[0], shared_limit=limits[1])
    return x_BTD + f, cache, aux


def _limits(cfg: LingConfig, layers: np.ndarray) -> jnp.ndarray:
    return jnp.asarray(np.array([cfg.swiglu_limits(int(i)) for i in layers.reshape(-1)],
                                np.float32).reshape(*layers.shape, 2))


def run_stack(cfg: LingConfig, params: Params, x_BTD: jax.Array, ctx: Context, *,
              collect: bool = False) -> tuple[jax.Array, list[dict[str, Any]]]:
    """All main layers. With `collect`, also per layer (in layer order) {"hidden", "router"}."""
    collected: list[dict[str, Any]] = []

    def body(mixer: Mixer, ffn: Ffn):
        def f(x, xs):
            p, lim = xs
            x, _, aux = decoder_layer(p, x, lim, cfg=cfg, mixer=mixer, ffn=ffn, ctx=ctx)
            return x, ((x, aux) if collect else None)
        return f

    for seg, sp in zip(cfg.segments, params["segments"], strict=True):
        first = seg.first_layer
        if seg.kind == "run":
            x_BTD, ys = jax.lax.scan(body(seg.mixer, seg.ffn), x_BTD,
                                     (sp, _limits(cfg, np.arange(first, first + seg.length))))
            if collect:
                collected += [jax.tree.map(lambda a, i=i: a[i], {"hidden": ys[0], "router": ys[1]})
                              for i in range(seg.length)]
            continue
        g = seg.kda_per_group + 1
        base = first + g * np.arange(seg.length)
        lim_kda = _limits(cfg, base[:, None] + np.arange(seg.kda_per_group)[None])
        lim_mla = _limits(cfg, base + g - 1)

        def group(x, xs, g=g):
            pk, pm, lk, lm = xs
            ys_k = None
            if g > 1:
                x, ys_k = jax.lax.scan(body("kda", "moe"), x, (pk, lk))
            x, y_m = body("mla", "moe")(x, (pm, lm))
            return x, (ys_k, y_m)

        x_BTD, (ys_k, y_m) = jax.lax.scan(group, x_BTD, (sp.get("kda"), sp["mla"], lim_kda, lim_mla))
        if collect:
            for n in range(seg.length):
                for j in range(g - 1):
                    collected.append(jax.tree.map(lambda a, n=n, j=j: a[n, j],
                                                  {"hidden": ys_k[0], "router": ys_k[1]}))
                collected.append(jax.tree.map(lambda a, n=n: a[n], {"hidden": y_m[0], "router": y_m[1]}))
    return x_BTD, collected


def apply_layer(cfg: LingConfig, params: Params, i: int, x_BTD: jax.Array,
                ctx: Context) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Runs main or MTP layer `i` alone on x (per-layer tests and debugging): (x, router aux)."""
    p = layer_params(cfg, params, i)
    x_BTD, _, aux = _layer_jit(p, x_BTD, _limits(cfg, np.array(i)), cfg=cfg, mixer=cfg.mixer_of(i),
                               ffn=cfg.ffn_of(i), ctx=ctx)
    return x_BTD, aux


_layer_jit = jax.jit(decoder_layer, static_argnames=("cfg", "mixer", "ffn"))


def embed(params: Params, ids_BT: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], ids_BT, axis=0)


def lm_head(cfg: LingConfig, params: Params, h_BTD: jax.Array) -> jax.Array:
    """Untied (or tied) output projection; logits in float32."""
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (h_BTD @ w.astype(h_BTD.dtype)).astype(jnp.float32)


def mtp_hidden(cfg: LingConfig, params: Params, input_ids: jax.Array, h_final_BTD: jax.Array,
               ctx: Context) -> list[jax.Array]:
    """Hidden states of the MTP layers (after their final_layernorm), §2.8.

    MTP layer j sees the ids shifted left by j+1 (vacated positions get id 0) and the previous
    stage's hidden state (the final-normed main output for j = 0).
    """
    outs, h, ids = [], h_final_BTD, input_ids
    for j, p in enumerate(params["mtp"]):
        i = cfg.num_hidden_layers + j
        ids = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
        e = rms_norm(embed(params, ids), p["enorm"], cfg.rms_norm_eps)
        z = jnp.concatenate([e, rms_norm(h, p["hnorm"], cfg.rms_norm_eps)], axis=-1)
        z = z @ p["eh_proj"].astype(z.dtype)
        z, _, _ = decoder_layer(p, z, _limits(cfg, np.array(i)), cfg=cfg, mixer="mla",
                                ffn=cfg.ffn_of(i), ctx=ctx)
        h = rms_norm(z, p["final_norm"], cfg.rms_norm_eps)
        outs.append(h)
    return outs


def forward_hidden(cfg: LingConfig, params: Params, input_ids: jax.Array, *,
                   attention_mask: jax.Array | None = None, positions: jax.Array | None = None,
                   segment_ids: jax.Array | None = None, mtp: bool = False,
                   collect: bool = False) -> dict[str, Any]:
    """The model up to (not including) the lm_head.

    Returns {"final": final-normed hidden [B, T, D], "mtp": [MTP hiddens] if mtp,
    "layers": per-layer {"hidden", "router"} if collect}.
    """
    ctx = make_context(cfg, input_ids, attention_mask=attention_mask, positions=positions,
                       segment_ids=segment_ids)
    x = embed(params, input_ids)
    x, layers = run_stack(cfg, params, x, ctx, collect=collect)
    out: dict[str, Any] = {"final": rms_norm(x, params["final_norm"], cfg.rms_norm_eps)}
    if mtp:
        out["mtp"] = mtp_hidden(cfg, params, input_ids, out["final"], ctx)
    if collect:
        out["layers"] = layers
    return out


@functools.partial(jax.jit, static_argnums=0)
def forward(config: LingConfig, params: Params, input_ids: jax.Array, *,
            attention_mask: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] float32. `attention_mask` [B, T] (1 = token, 0 = padding, either side):
    padding never changes the logits of real tokens."""
    h = forward_hidden(config, params, input_ids, attention_mask=attention_mask)["final"]
    return lm_head(config, params, h)


@functools.partial(jax.jit, static_argnums=0)
def forward_with_mtp(config: LingConfig, params: Params, input_ids: jax.Array, *,
                     attention_mask: jax.Array | None = None) -> tuple[jax.Array, list[jax.Array]]:
    """(main logits [B, T, V], [logits of each MTP layer]) in float32."""
    out = forward_hidden(config, params, input_ids, attention_mask=attention_mask, mtp=True)
    return lm_head(config, params, out["final"]), [lm_head(config, params, h) for h in out["mtp"]]

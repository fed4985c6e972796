"""The Ling-3 forward pass over sequences (training, prefill): embed -> layer stack -> final norm ->
lm_head (+ MTP). The one-token decode step is `ling_jax.decode`.

The stack follows `LingConfig.segments`: a `run` is one `lax.scan` over layers of one kind, a
`groups` segment one `lax.scan` over groups whose body scans the group's KDA layers and applies
its MLA layer. So the stack compiles once per distinct layer kind, whatever the depth.

Per-layer SwiGLU clamp limits (§2.6) are not params: they come from the config as constants and
ride along the scans as `xs`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.checkpoint.fp8 import dense_weights
from ling_jax.config import Ffn, LingConfig, Mixer, Segment
from ling_jax.kernels import Kernels, select
from ling_jax.layers.kda import kda_mixer
from ling_jax.layers.mla import mla_mixer
from ling_jax.layers.mlp import mlp
from ling_jax.layers.moe import moe
from ling_jax.layers.rope import rope_cos_sin
from ling_jax.ops import moe as moe_ops
from ling_jax.ops.attention import attention_mask as visibility
from ling_jax.ops.attention_pallas import documents
from ling_jax.ops.norms import rms_norm
from ling_jax.ops.saved import KERNEL_RESIDUAL
from ling_jax.params import Params, layer_params
from ling_jax.sharding import warn_without_mesh


@dataclasses.dataclass(frozen=True)
class Context:
    """Per-call arrays every layer may need (a pytree, so it can be closed over in scans)."""

    cos: jax.Array  # [B, T, d_r / 2] f32
    sin: jax.Array
    mask_BTS: jax.Array  # MLA visibility (the XLA attention)
    valid_BT: jax.Array | None  # False at padding
    segment_ids: jax.Array | None  # [B, T] packed documents
    docs: tuple[jax.Array, jax.Array]  # MLA visibility as document numbers (the fused kernels)


jax.tree_util.register_dataclass(
    Context, data_fields=["cos", "sin", "mask_BTS", "valid_BT", "segment_ids", "docs"], meta_fields=[]
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
    doc_q, doc_k = documents(valid, segment_ids, b, t)  # a document ends wherever the segment id changes
    mask = visibility(idx, idx, valid, doc_q, doc_q)
    return Context(cos, sin, mask, valid, segment_ids, (doc_q, doc_k))


MixerFn = Callable[[Params, jax.Array, Mixer, Any], tuple[jax.Array, Any]]


def decoder_layer(
    p: Params, x_BTD: jax.Array, limits: jax.Array, *, cfg: LingConfig, kernels: Kernels, ffn: Ffn,
    mix: Callable[[Params, jax.Array], tuple[jax.Array, Any]],
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """One pre-norm decoder layer over T tokens: x -> (x, what the mixer returned besides its output,
    router aux).

    `mix(attn_params, normed_x)` is the layer's KDA or MLA mixer (`sequence_mixer`).
    limits: [2] float32, the (routed, shared) SwiGLU clamp of this layer (0 = none).
    """
    p = dense_weights(p, x_BTD.dtype)  # FP8-resident weights: this layer's, dequantized here
    with jax.named_scope("mixer"):  # named scopes label the compiled ops (profiles: bench/device_profile.py)
        a, mixer_out = mix(p["attn"], rms_norm(x_BTD, p["input_norm"], cfg.rms_norm_eps))
    x_BTD = x_BTD + a
    h = rms_norm(x_BTD, p["post_attn_norm"], cfg.rms_norm_eps)
    with jax.named_scope("ffn"):
        if ffn == "dense":
            m = p["mlp"]
            f, aux = mlp(h, m["gate_proj"], m["up_proj"], m["down_proj"]), {}
        else:
            f, aux = moe(p["mlp"], h, cfg=cfg, kernels=kernels, limit=limits[0], shared_limit=limits[1])
    return x_BTD + f, mixer_out, aux


def sequence_mixer(cfg: LingConfig, kernels: Kernels, ctx: Context) -> MixerFn:
    """The T-token mixers (training, forward, prefill): (attn params, x, kind, cache in) -> (out, cache out)."""

    def mix(p: Params, h: jax.Array, mixer: Mixer, cache: Any) -> tuple[jax.Array, Any]:
        if mixer == "kda":
            return kda_mixer(p, h, cfg=cfg, kernels=kernels, valid_BT=ctx.valid_BT, segment_ids=ctx.segment_ids,
                             cache=cache)
        return mla_mixer(p, h, cfg=cfg, kernels=kernels, cos=ctx.cos, sin=ctx.sin, mask_BTS=ctx.mask_BTS,
                         docs=ctx.docs)

    return mix


LayerFn = Callable[[Params, jax.Array, jax.Array, Any, Mixer, Ffn], tuple[jax.Array, Any]]


def limits(cfg: LingConfig, layers: np.ndarray) -> jnp.ndarray:
    """The (routed, shared) SwiGLU clamps of main layers `layers` (any shape): [..., 2] float32."""
    return jnp.asarray(np.array([cfg.swiglu_limits(int(i)) for i in layers.reshape(-1)],
                                np.float32).reshape(*layers.shape, 2))


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """How `run_stack` runs one segment: its params and caches as the layer loop takes them (leading
    stack axes), the layer function, whether the loop is a Python loop (else a scan), and what to
    apply to the segment's stacked per-layer outputs afterwards."""

    params: Any
    caches: Any
    layer: LayerFn
    loop: bool
    finish: Callable[[Any], Any] = lambda ys: ys


Planner = Callable[[Segment, Params, Any], SegmentPlan]


def run_stack(cfg: LingConfig, params: Params, x: jax.Array, layer_fn: LayerFn, caches: list[Any] | None = None,
              unroll: bool = False, plan: Planner | None = None) -> tuple[jax.Array, list[Any]]:
    """Runs every main layer through `layer_fn(p, x, limits, layer cache, mixer, ffn) -> (x, y)`.

    `caches` (optional) are stacked like the params and fed to the layers as scan inputs; the
    per-layer outputs `y` come back stacked the same way: one entry per segment, `run` entries
    with a leading [n] axis, `groups` entries as {"kda": [n, G-1, ...], "mla": [n, ...]}.
    `unroll` unrolls the scans into a straight-line program (no loop overhead between layers, at
    the cost of compiling every layer separately); without caches (training) the layers are then a
    Python loop, so the backward's residuals stay per layer instead of being stacked into [n, ...]
    buffers and sliced back. `plan(segment, its params, its caches)` (the decode step's, which
    hands kernels views of the stacks) may replace, per segment, the params, caches and layer
    function the loop runs and the form of the loop (`SegmentPlan`).
    """
    ys_all: list[Any] = []
    for s, (seg, sp) in enumerate(zip(cfg.segments, params["segments"], strict=True)):
        cs = None if caches is None else caches[s]
        sp_plan = plan(seg, sp, cs) if plan else SegmentPlan(sp, cs, layer_fn, loop=unroll and caches is None)
        sp, cs, fn, loop = sp_plan.params, sp_plan.caches, sp_plan.layer, sp_plan.loop
        first = seg.first_layer
        if seg.kind == "run":
            def run_body(x, xs, mixer=seg.mixer, ffn=seg.ffn, fn=fn):
                p, lim, c = xs
                return fn(p, x, lim, c, mixer, ffn)

            x, ys = _layers(run_body, x, (sp, limits(cfg, np.arange(first, first + seg.length)), cs), unroll, loop)
            ys_all.append(sp_plan.finish(ys))
            continue
        g = seg.kda_per_group + 1
        base = first + g * np.arange(seg.length)

        def kda_body(x, xs, fn=fn):
            p, lim, c = xs
            return fn(p, x, lim, c, "kda", "moe")

        def group(x, xs, g=g, fn=fn, loop=loop):
            pk, pm, lk, lm, ck, cm = xs
            ys_k = None
            if g > 1:
                x, ys_k = _layers(kda_body, x, (pk, lk, ck), unroll, loop)
            x, y_m = fn(pm, x, lm, cm, "mla", "moe")
            return x, {"kda": ys_k, "mla": y_m}

        xs = (sp.get("kda"), sp["mla"], limits(cfg, base[:, None] + np.arange(g - 1)[None]), limits(cfg, base + g - 1),
              None if cs is None else cs.get("kda"), None if cs is None else cs["mla"])
        x, ys = _layers(group, x, xs, unroll, loop)
        ys_all.append(sp_plan.finish(ys))
    return x, ys_all


def _layers(body: Callable, x: jax.Array, xs: Any, unroll: bool, loop: bool) -> tuple[jax.Array, Any]:
    """`lax.scan(body, x, xs, unroll=unroll)`, or (`loop`) the same as a Python loop over xs's leading
    axis: the per-layer outputs are stacked, what the backward keeps of each layer is not."""
    if not loop:
        return jax.lax.scan(body, x, xs, unroll=unroll)
    ys = []
    for i in range(jax.tree.leaves(xs)[0].shape[0]):
        x, y = body(x, jax.tree.map(lambda a, i=i: a[i], xs))
        ys.append(y)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *ys)


def per_layer(cfg: LingConfig, ys: list[Any]) -> list[Any]:
    """Unstacks `run_stack` outputs into a list in layer order (tests, debugging)."""
    out: list[Any] = []
    for seg, y in zip(cfg.segments, ys, strict=True):
        if seg.kind == "run":
            out += [jax.tree.map(lambda a, i=i: a[i], y) for i in range(seg.length)]
            continue
        for n in range(seg.length):
            out += [jax.tree.map(lambda a, n=n, j=j: a[n, j], y["kda"]) for j in range(seg.kda_per_group)]
            out.append(jax.tree.map(lambda a, n=n: a[n], y["mla"]))
    return out


def apply_layer(cfg: LingConfig, params: Params, i: int, x_BTD: jax.Array,
                ctx: Context) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Runs main or MTP layer `i` alone on x (per-layer tests and debugging): (x, router aux)."""
    kernels = select(cfg, dtype=x_BTD.dtype)
    return _layer_jit(cfg, kernels, layer_params(cfg, params, i), x_BTD, limits(cfg, np.array(i)), ctx,
                      mixer=cfg.mixer_of(i), ffn=cfg.ffn_of(i))


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("mixer", "ffn"))
def _layer_jit(cfg: LingConfig, kernels: Kernels, p: Params, x: jax.Array, lim: jax.Array, ctx: Context, *,
               mixer: Mixer, ffn: Ffn) -> tuple[jax.Array, dict[str, jax.Array]]:
    mix = sequence_mixer(cfg, kernels, ctx)
    x, _, aux = decoder_layer(p, x, lim, cfg=cfg, kernels=kernels, ffn=ffn, mix=lambda pa, h: mix(pa, h, mixer, None))
    return x, aux


def embed(params: Params, ids_BT: jax.Array, pad_id: int | None = None) -> jax.Array:
    """Embedding rows of `ids_BT`; the `pad_id` row gets no gradient through the lookup (the
    reference's `padding_idx`, ARCHITECTURE.md §2.9)."""
    x_BTD = jnp.take(params["embed"], ids_BT, axis=0)
    if pad_id is None:
        return x_BTD
    return jnp.where((ids_BT == pad_id)[..., None], jax.lax.stop_gradient(x_BTD), x_BTD)


def lm_head(cfg: LingConfig, params: Params, h_BTD: jax.Array) -> jax.Array:
    """Untied (or tied) output projection; logits in float32."""
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (h_BTD @ w.astype(h_BTD.dtype)).astype(jnp.float32)


REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "full": None,  # save only each layer's input; recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight matmul outputs
    # ... and what the kernels tag (ops/saved.py): no kernel of the forward runs again
    "dots_kernels": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(KERNEL_RESIDUAL)),
    "dots_all": jax.checkpoint_policies.checkpoint_dots,  # keep every matmul output
}


def _rematted(fn: Callable, remat: str) -> Callable:
    """`fn` under the named rematerialisation policy ("none": as is)."""
    if remat == "none":
        return fn
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}: must be 'none' or one of {sorted(REMAT_POLICIES)}")
    return jax.checkpoint(fn, policy=REMAT_POLICIES[remat], prevent_cse=False)


def _expert_counts(cfg: LingConfig, aux: dict[str, jax.Array]) -> jax.Array:
    """Tokens routed to each expert [E] (int32, global over the batch) from a MoE layer's router aux."""
    if "expert_counts" in aux:
        return aux["expert_counts"]
    return moe_ops.expert_counts(aux["topk_idx"], cfg.num_experts)


def mtp_hidden(cfg: LingConfig, kernels: Kernels, params: Params, input_ids: jax.Array, h_final_BTD: jax.Array,
               ctx: Context, remat: str = "none") -> tuple[list[jax.Array], list[dict[str, jax.Array]]]:
    """Hidden states of the MTP layers (after their final_layernorm) and their router aux, §2.8.

    MTP layer j sees the ids shifted left by j+1 (vacated positions get id 0) and the previous
    stage's hidden state (the final-normed main output for j = 0).
    """
    outs, auxs, h, ids = [], [], h_final_BTD, input_ids
    mix = sequence_mixer(cfg, kernels, ctx)
    for j, p in enumerate(params["mtp"]):
        i = cfg.num_hidden_layers + j
        ids = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)

        def layer(p, h, ids, i=i):
            p = dense_weights(p, h.dtype)
            e = rms_norm(embed(params, ids, cfg.pad_token_id), p["enorm"], cfg.rms_norm_eps)
            z = jnp.concatenate([e, rms_norm(h, p["hnorm"], cfg.rms_norm_eps)], axis=-1)
            z = z @ p["eh_proj"].astype(z.dtype)
            z, _, aux = decoder_layer(p, z, limits(cfg, np.array(i)), cfg=cfg, kernels=kernels, ffn=cfg.ffn_of(i),
                                      mix=lambda pa, x: mix(pa, x, "mla", None))
            return rms_norm(z, p["final_norm"], cfg.rms_norm_eps), aux

        h, aux = _rematted(layer, remat)(p, h, ids)
        outs.append(h)
        auxs.append(aux)
    return outs, auxs


def forward_hidden(cfg: LingConfig, params: Params, input_ids: jax.Array, *,
                   attention_mask: jax.Array | None = None, positions: jax.Array | None = None,
                   segment_ids: jax.Array | None = None, mtp: bool = False, collect: bool = False,
                   expert_counts: bool = False, remat: str = "none", unroll: bool = False,
                   kernels: Kernels | None = None) -> dict[str, Any]:
    """The model up to (not including) the lm_head.

    Returns {"final": final-normed hidden [B, T, D]}, plus
      "mtp": [MTP hiddens] if `mtp`;
      "layers": per layer {"hidden": output, "router": aux} if `collect`;
      "expert_counts": tokens per expert of every MoE layer, stacked like params["segments"]
      ([n, E] for a run, {"kda": [n, G-1, E], "mla": [n, E]} for groups, None for dense runs),
      and "mtp_expert_counts" ([E] per MoE MTP layer) if `expert_counts`.
    `remat` ("none" or a key of REMAT_POLICIES) rematerialises each layer in the backward pass.
    `unroll`: the layers as straight-line code instead of scans (`run_stack`): no stacking of what
    the backward pass keeps per layer, at the cost of compiling every layer. `kernels`: the call's
    implementations (default: `kernels.select` for the params' dtype).
    """
    kernels = kernels or select(cfg, dtype=params["embed"].dtype)
    ctx = make_context(cfg, input_ids, attention_mask=attention_mask, positions=positions,
                       segment_ids=segment_ids)
    mix = sequence_mixer(cfg, kernels, ctx)

    def layer(p, x, lim, cache, mixer, ffn):
        def inner(p, x, lim):
            x, _, aux = decoder_layer(p, x, lim, cfg=cfg, kernels=kernels, ffn=ffn,
                                      mix=lambda pa, h: mix(pa, h, mixer, None))
            return x, aux

        x, aux = _rematted(inner, remat)(p, x, lim)
        y: dict[str, Any] = {}
        if collect:
            y.update(hidden=x, router=aux)
        if expert_counts and ffn == "moe":
            y["counts"] = _expert_counts(cfg, aux)
        return x, y

    x, ys = run_stack(cfg, params, embed(params, input_ids, cfg.pad_token_id), layer, unroll=unroll)
    out: dict[str, Any] = {"final": rms_norm(x, params["final_norm"], cfg.rms_norm_eps)}
    if mtp:
        out["mtp"], mtp_aux = mtp_hidden(cfg, kernels, params, input_ids, out["final"], ctx, remat)
        if expert_counts:
            out["mtp_expert_counts"] = [_expert_counts(cfg, a) if a else None for a in mtp_aux]
    if collect:
        out["layers"] = per_layer(cfg, ys)
    if expert_counts:
        out["expert_counts"] = [_counts_only(y) for y in ys]
    return out


def _counts_only(y: Any) -> Any:
    """The "counts" entries of one segment's stacked layer outputs (None where there are none)."""
    if isinstance(y, dict) and ("kda" in y or "mla" in y):
        return {k: _counts_only(v) for k, v in y.items()}
    return y.get("counts") if isinstance(y, dict) else None


def forward(config: LingConfig, params: Params, input_ids: jax.Array, *,
            attention_mask: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] float32 (jitted). `attention_mask` [B, T] (1 = token, 0 = padding, either
    side): padding never changes the logits of real tokens."""
    warn_without_mesh(params)
    kernels = select(config, dtype=params["embed"].dtype)
    return _forward(config, kernels, params, input_ids, attention_mask=attention_mask)


def forward_with_mtp(config: LingConfig, params: Params, input_ids: jax.Array, *,
                     attention_mask: jax.Array | None = None) -> tuple[jax.Array, list[jax.Array]]:
    """(main logits [B, T, V], [logits of each MTP layer]) in float32 (jitted)."""
    warn_without_mesh(params)
    kernels = select(config, dtype=params["embed"].dtype)
    return _forward_with_mtp(config, kernels, params, input_ids, attention_mask=attention_mask)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(config: LingConfig, kernels: Kernels, params: Params, input_ids: jax.Array, *,
             attention_mask: jax.Array | None = None) -> jax.Array:
    h = forward_hidden(config, params, input_ids, attention_mask=attention_mask, kernels=kernels)["final"]
    return lm_head(config, params, h)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward_with_mtp(config: LingConfig, kernels: Kernels, params: Params, input_ids: jax.Array, *,
                      attention_mask: jax.Array | None = None) -> tuple[jax.Array, list[jax.Array]]:
    out = forward_hidden(config, params, input_ids, attention_mask=attention_mask, mtp=True, kernels=kernels)
    return lm_head(config, params, out["final"]), [lm_head(config, params, h) for h in out["mtp"]]

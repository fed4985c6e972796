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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.checkpoint.fp8 import dense_weights
from ling_jax.config import Ffn, LingConfig, Mixer
from ling_jax.layers.kda import FUSED_CONV, kda_mixer
from ling_jax.layers.mla import mla_mixer
from ling_jax.layers.mlp import mlp
from ling_jax.layers.moe import moe
from ling_jax.layers.norms import rms_norm
from ling_jax.layers.rope import rope_cos_sin
from ling_jax.ops import layer_gemv, stack_matmul
from ling_jax.ops import moe as moe_ops
from ling_jax.ops.attention import attention_mask as visibility
from ling_jax.ops.attention_pallas import documents
from ling_jax.ops.kda import decode_layer
from ling_jax.ops.kda.decode_layer import KdaCacheStack
from ling_jax.ops.layer_gemv import FUSED_INPUT, WeightStack, normed
from ling_jax.ops.mla_decode import LatentStack
from ling_jax.ops.moe import ExpertStack
from ling_jax.ops.saved import KERNEL_RESIDUAL
from ling_jax.params import Params, layer_params
from ling_jax.sharding import context_mesh, multi_device, warn_without_mesh


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
    p: Params, x_BTD: jax.Array, limits: jax.Array, *, cfg: LingConfig, ffn: Ffn,
    mix: Callable[[Params, jax.Array], tuple[jax.Array, Any]],
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """One pre-norm decoder layer: x -> (x, what the mixer returned besides its output, router aux).

    `mix(attn_params, normed_x)` is the layer's KDA or MLA mixer in the mode of the caller
    (training/prefill over T tokens, or one decode step against a cache). Norm weights given as
    `WeightStack`s (the batch-1 decode step) leave the norms to the gemv kernels that read the
    normed rows (`layer_gemv.normed`).
    limits: [2] float32, the (routed, shared) SwiGLU clamp of this layer (0 = none).
    """
    p = dense_weights(p, x_BTD.dtype)  # FP8-resident weights: this layer's, dequantized here
    with jax.named_scope("mixer"):  # named scopes label the compiled ops (profiles: bench/device_profile.py)
        a, mixer_out = mix(p["attn"], normed(x_BTD, p["input_norm"], cfg.rms_norm_eps))
    x_BTD = x_BTD + a
    h = normed(x_BTD, p["post_attn_norm"], cfg.rms_norm_eps)
    with jax.named_scope("ffn"):
        if ffn == "dense":
            m = p["mlp"]
            f, aux = mlp(h, m["gate_proj"], m["up_proj"], m["down_proj"], w_gate_up=m.get("gate_up_proj")), {}
        else:
            f, aux = moe(p["mlp"], h, cfg=cfg, limit=limits[0], shared_limit=limits[1])
    return x_BTD + f, mixer_out, aux


def sequence_mixer(cfg: LingConfig, ctx: Context) -> MixerFn:
    """The T-token mixers (training, forward, prefill): (attn params, x, kind, cache in) -> (out, cache out)."""

    def mix(p: Params, h: jax.Array, mixer: Mixer, cache: Any) -> tuple[jax.Array, Any]:
        if mixer == "kda":
            return kda_mixer(p, h, cfg=cfg, valid_BT=ctx.valid_BT, segment_ids=ctx.segment_ids, cache=cache)
        return mla_mixer(p, h, cfg=cfg, cos=ctx.cos, sin=ctx.sin, mask_BTS=ctx.mask_BTS, docs=ctx.docs)

    return mix


def _limits(cfg: LingConfig, layers: np.ndarray) -> jnp.ndarray:
    return jnp.asarray(np.array([cfg.swiglu_limits(int(i)) for i in layers.reshape(-1)],
                                np.float32).reshape(*layers.shape, 2))


SHARED_LEAVES = ("shared_gate_up_proj", "shared_down_proj")  # the shared expert as `ops.moe.SharedStacks`
LayerFn = Callable[[Params, jax.Array, jax.Array, Any, Mixer, Ffn], tuple[jax.Array, Any]]


Stacks = dict[tuple[str, str], tuple[type, jax.Array]]  # (subtree, leaf) -> (view class, flat stack)
LINEAR_LEAVES = {  # per-layer [C, O] projections that `layer_gemv.linear` takes as `WeightStack`s
    "attn": (FUSED_INPUT, "f_b_proj", "g_b_proj", "o_proj", "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj",
             "g_proj", "dense"),
    "mlp": ("gate_up_proj", "down_proj"),
}
# small per-layer weights the KDA decode layer kernel reads, and the output norm's (read by o_proj's gemv)
KDA_LEAVES = (FUSED_CONV, "A_log", "dt_bias", "o_norm")
NORM_LEAVES = ("input_norm", "post_attn_norm")  # RMSNorms the gemv kernels apply (`layer_gemv.normed`)


def _split_stacks(t: Params | None, lead: int, dtype: Any, experts: bool, linears: int,
                  kda: bool = False) -> tuple[Params | None, Stacks]:
    """Takes weight stacks out of layer-stacked params `t` (`lead` stack axes), for kernels that read a
    layer in place (XLA copies a sliced stack passed to a custom call).

    Each taken leaf becomes its layers' flat indices (an int32 array of the stack's leading shape,
    sliced by the scan like any param); its stack, flattened to one layer axis, is returned aside, to
    be rejoined per layer as a view (`_join_stacks`). Only dense stacks already in the compute
    `dtype` (FP8-resident or other-dtype stacks are sliced and converted per layer, as before).
    `experts`: the routed-expert stacks as `ExpertStack`s, and the fused shared expert
    (`SHARED_LEAVES`) as a one-expert stack where `ops.moe.shared_fits` (the MoE then runs it inside
    the routed experts' gemv launches, `ops.moe.SharedStacks`), and the expert bias as a
    `layer_gemv.WeightStack` (the selection kernel reads it, `ops.route_pallas`). `linears` (the
    rows the projections multiply, 0: none): the `LINEAR_LEAVES` projections as
    `layer_gemv.WeightStack`s where a kernel takes that many rows, past one row the fused shared
    expert too (where `experts` did not take it), and at one row the router (float32) and the
    `NORM_LEAVES` (any dtype). `kda`: the `KDA_LEAVES` (any dtype) as `WeightStack`s too (the KDA
    decode layer kernel, `ops.kda.decode_layer`, and its output norm, `expert_gemv.GatedRows`).
    """
    if t is None or not (experts or linears or kda):
        return t, {}
    subs = {k: dict(v) for k, v in t.items() if k in ("attn", "mlp")}
    subs[""] = {}  # taken leaves of the layer's top level
    stacks: Stacks = {}

    def take(sub: str, name: str, cls: type, one_expert: bool) -> None:
        w = (subs[sub] if sub else t)[name]
        flat = w.reshape(-1, *((1,) if one_expert else ()), *w.shape[lead:])
        stacks[sub, name] = (cls, flat)
        subs[sub][name] = np.arange(flat.shape[0], dtype=np.int32).reshape(w.shape[:lead])  # constants, not launches

    if experts and "router" in subs["mlp"]:
        mlp_p = subs["mlp"]
        routed = [n for n in moe_ops.EXPERT_LEAVES if isinstance(mlp_p[n], jax.Array) and mlp_p[n].dtype == dtype]
        for name in routed:  # [L, E, C, O]
            take("mlp", name, ExpertStack, False)
        shared = [mlp_p.get(n) for n in SHARED_LEAVES]  # present in the fused decode params (`fuse_gate_up`)
        if (len(routed) == len(moe_ops.EXPERT_LEAVES)
                and all(isinstance(w, jax.Array) and w.dtype == dtype for w in shared)
                and moe_ops.shared_fits(*stacks["mlp", "gate_proj"][1].shape[-2:], shared[1].shape[-2])):
            for name in SHARED_LEAVES:  # one expert per layer: [L, 1, C, O]
                take("mlp", name, ExpertStack, True)
        if isinstance(mlp_p["expert_bias"], jax.Array):
            take("mlp", "expert_bias", WeightStack, False)
    if linears:
        for sub, names in LINEAR_LEAVES.items():
            for name in names + (SHARED_LEAVES if sub == "mlp" and linears > 1 else ()):
                if sub in subs and layer_gemv.stackable(subs[sub].get(name), lead, dtype, linears):
                    take(sub, name, WeightStack, False)
    if linears == 1:
        router = subs.get("mlp", {}).get("router")  # float32: stackable in its own dtype
        if layer_gemv.stackable(router, lead, getattr(router, "dtype", None)):
            take("mlp", "router", WeightStack, False)
        for name in NORM_LEAVES:
            if isinstance(t.get(name), jax.Array) and t[name].ndim == lead + 1:
                take("", name, WeightStack, False)
    if kda:
        for name in KDA_LEAVES:
            take("attn", name, WeightStack, False)
    top = subs.pop("")
    return {**t, **subs, **top}, stacks


class _KdaCaches:
    """A segment's KDA decode caches threaded through its layers, one after another (a Python loop):
    each layer's kernel updates its state in the whole state stack in place (`ops.kda.decode_layer`;
    a layer's slice handed to a custom call would be copied first, and a scan would stack copies)
    and returns its new conv window, all of which replace the window stack after the last layer."""

    def __init__(self, c: dict[str, jax.Array]):  # {"state": [*lead, B, H, K, V], "conv": [*lead, B, W-1, 3P]}
        self.lead = c["state"].shape[:-4]
        self.state = c["state"].reshape(-1, *c["state"].shape[-4:])
        self.conv = c["conv"].reshape(-1, *c["conv"].shape[-3:])
        self.index = np.arange(self.state.shape[0], dtype=np.int32).reshape(self.lead)  # rides the loop as xs
        self.windows: dict[int, jax.Array] = {}

    def view(self, layer: np.ndarray) -> KdaCacheStack:
        return KdaCacheStack(self.state, self.conv, layer)

    def keep(self, new: KdaCacheStack) -> np.ndarray:
        """Takes a layer's updated state stack and new window; returns what the loop stacks for it."""
        self.state = new.state
        self.windows[int(new.layer)] = new.window
        return new.layer

    def result(self) -> dict[str, jax.Array]:
        conv = jnp.stack([self.windows[i] for i in range(self.conv.shape[0])])  # every layer ran this step
        return {"state": self.state.reshape(*self.lead, *self.state.shape[1:]),
                "conv": conv.reshape(*self.lead, *conv.shape[1:])}


def _kda_views(cfg: LingConfig, t: Params | None, unroll: bool, caches: Any) -> bool:
    """Whether the unrolled decode step runs the KDA decode layer kernel on these KDA layer params:
    the Pallas decode kernels on one device, decode params (`FUSED_CONV`), heads the kernel takes."""
    return (t is not None and unroll and caches is not None and cfg.pallas_decode("kda")
            and not multi_device(context_mesh()) and FUSED_CONV in t["attn"]
            and decode_layer.supported(cfg.head_dim, cfg.head_dim, cfg.short_conv_kernel_size))


def _join_stacks(p: Params, stacks: Stacks) -> Params:
    """One layer's params with its index leaves turned back into views of their stacks."""
    if not stacks:
        return p
    subs = {sub: dict(p[sub]) if sub else {} for sub in {sub for sub, _ in stacks}}  # "": top level
    for (sub, name), (cls, stack) in stacks.items():
        subs[sub][name] = cls(stack, (p[sub] if sub else p)[name])
    top = subs.pop("", {})
    return {**p, **subs, **top}


def run_stack(cfg: LingConfig, params: Params, x: jax.Array, layer_fn: LayerFn,
              caches: list[Any] | None = None, unroll: bool = False) -> tuple[jax.Array, list[Any]]:
    """Runs every main layer through `layer_fn(p, x, limits, layer cache, mixer, ffn) -> (x, y)`.

    `caches` (optional) are stacked like the params and fed to the layers as scan inputs; the
    per-layer outputs `y` come back stacked the same way: one entry per segment, `run` entries
    with a leading [n] axis, `groups` entries as {"kda": [n, G-1, ...], "mla": [n, ...]}.
    `unroll` unrolls the scans into a straight-line program (one decode step: no loop overhead
    between layers, at the cost of compiling every layer separately); without caches (training)
    the layers are then a Python loop (`_layers`), so the backward's residuals stay per layer
    instead of being stacked into [n, ...] buffers and sliced back. Unrolled, where the MoE
    will run the gemv kernel (`ops.moe.wants_stacks`), the routed-expert weights reach it as
    `ExpertStack`s (the kernel reads them from the stacks; a sliced operand would be copied
    whole every step, and the XLA impls are faster on the plain slices). Unrolled with caches at
    up to `ops.stack_matmul.MAX_ROWS` rows (the decode step) and `cfg.pallas_decode("proj")`, the
    dense projections reach `layer_gemv.linear` as `WeightStack`s the same way (at one row the
    router and the norms too). Unrolled with caches, decode params and `cfg.pallas_decode("kda")`
    on one device, the KDA layers run as Python loops that thread their
    segment's cache stacks from layer to layer (`_KdaCaches`) through the KDA decode layer kernel.
    """
    views = unroll and cfg.uses_moe and moe_ops.wants_stacks(
        cfg.moe_impl, x.dtype, x.shape[0] * x.shape[1] * cfg.num_experts_per_tok, cfg.hidden_size,
        cfg.moe_intermediate_size)
    loop = unroll and caches is None
    latent_views = unroll and caches is not None and cfg.pallas_decode("mla") and not multi_device(context_mesh())
    rows = x.shape[0] * x.shape[1]
    linear_views = (rows if unroll and caches is not None and rows <= stack_matmul.MAX_ROWS
                    and cfg.pallas_decode("proj") and not multi_device(context_mesh()) else 0)
    ys_all: list[Any] = []
    for s, (seg, sp) in enumerate(zip(cfg.segments, params["segments"], strict=True)):
        cs = None if caches is None else caches[s]
        first = seg.first_layer
        if seg.kind == "run":
            kda = seg.mixer == "kda" and _kda_views(cfg, sp, unroll, cs)
            sp, stacks = _split_stacks(sp, 1, x.dtype, views, linear_views, kda)
            cs, latent = _split_latent(cs) if latent_views and seg.mixer == "mla" else (cs, None)
            threaded = _KdaCaches(cs) if kda else None

            def run_body(x, xs, mixer=seg.mixer, ffn=seg.ffn, stacks=stacks, latent=latent, threaded=threaded):
                p, lim, c = xs
                c = threaded.view(c) if threaded else _join_latent(c, latent)
                x, y = layer_fn(_join_stacks(p, stacks), x, lim, c, mixer, ffn)
                return x, threaded.keep(y) if threaded else y

            x, ys = _layers(run_body, x, (sp, _limits(cfg, np.arange(first, first + seg.length)),
                                          threaded.index if threaded else cs), unroll, loop or kda)
            ys_all.append(threaded.result() if threaded else ys)
            continue
        g = seg.kda_per_group + 1
        base = first + g * np.arange(seg.length)
        kda = _kda_views(cfg, sp.get("kda"), unroll, cs)
        sp_kda, stacks_kda = _split_stacks(sp.get("kda"), 2, x.dtype, views, linear_views, kda)
        sp_mla, stacks_mla = _split_stacks(sp["mla"], 1, x.dtype, views, linear_views)
        threaded = _KdaCaches(cs["kda"]) if kda else None

        def kda_body(x, xs, stacks=stacks_kda, threaded=threaded):
            p, lim, c = xs
            x, y = layer_fn(_join_stacks(p, stacks), x, lim, threaded.view(c) if threaded else c, "kda", "moe")
            return x, threaded.keep(y) if threaded else y

        cs_mla, latent = None if cs is None else cs["mla"], None
        if latent_views:
            cs_mla, latent = _split_latent(cs_mla)

        def group(x, xs, g=g, stacks=stacks_mla, latent=latent, kda=kda):
            pk, pm, lk, lm, ck, cm = xs
            ys_k = None
            if g > 1:
                x, ys_k = _layers(kda_body, x, (pk, lk, ck), unroll, loop or kda)
            x, y_m = layer_fn(_join_stacks(pm, stacks), x, lm, _join_latent(cm, latent), "mla", "moe")
            return x, {"kda": ys_k, "mla": y_m}

        ck = threaded.index if threaded else (None if cs is None else cs.get("kda"))
        xs = (sp_kda, sp_mla, _limits(cfg, base[:, None] + np.arange(g - 1)[None]),
              _limits(cfg, base + g - 1), ck, cs_mla)
        x, ys = _layers(group, x, xs, unroll, loop or kda)
        ys_all.append({**ys, "kda": threaded.result()} if threaded else ys)
    return x, ys_all


def _split_latent(c: dict[str, Any]) -> tuple[dict[str, Any], jax.Array]:
    """A segment's MLA cache with its latent stack [n, B, S, W] replaced by the layers' indices
    (sliced by the layer loop like any cache leaf), and the stack aside, rejoined per layer as an
    `ops.mla_decode.LatentStack` (`_join_latent`) so the decode kernel reads it in place."""
    stack = c["latent"]
    return {**c, "latent": jnp.arange(stack.shape[0], dtype=jnp.int32)}, stack


def _join_latent(c: Any, stack: jax.Array | None) -> Any:
    return c if stack is None else {**c, "latent": LatentStack(stack, c["latent"])}


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
    return _layer_jit(cfg, layer_params(cfg, params, i), x_BTD, _limits(cfg, np.array(i)), ctx,
                      mixer=cfg.mixer_of(i), ffn=cfg.ffn_of(i))


@functools.partial(jax.jit, static_argnums=0, static_argnames=("mixer", "ffn"))
def _layer_jit(cfg: LingConfig, p: Params, x: jax.Array, limits: jax.Array, ctx: Context, *, mixer: Mixer,
               ffn: Ffn) -> tuple[jax.Array, dict[str, jax.Array]]:
    mix = sequence_mixer(cfg, ctx)
    x, _, aux = decoder_layer(p, x, limits, cfg=cfg, ffn=ffn, mix=lambda pa, h: mix(pa, h, mixer, None))
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


def mtp_hidden(cfg: LingConfig, params: Params, input_ids: jax.Array, h_final_BTD: jax.Array,
               ctx: Context, remat: str = "none") -> tuple[list[jax.Array], list[dict[str, jax.Array]]]:
    """Hidden states of the MTP layers (after their final_layernorm) and their router aux, §2.8.

    MTP layer j sees the ids shifted left by j+1 (vacated positions get id 0) and the previous
    stage's hidden state (the final-normed main output for j = 0).
    """
    outs, auxs, h, ids = [], [], h_final_BTD, input_ids
    mix = sequence_mixer(cfg, ctx)
    for j, p in enumerate(params["mtp"]):
        i = cfg.num_hidden_layers + j
        ids = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)

        def layer(p, h, ids, i=i):
            p = dense_weights(p, h.dtype)
            e = rms_norm(embed(params, ids, cfg.pad_token_id), p["enorm"], cfg.rms_norm_eps)
            z = jnp.concatenate([e, rms_norm(h, p["hnorm"], cfg.rms_norm_eps)], axis=-1)
            z = z @ p["eh_proj"].astype(z.dtype)
            z, _, aux = decoder_layer(p, z, _limits(cfg, np.array(i)), cfg=cfg, ffn=cfg.ffn_of(i),
                                      mix=lambda pa, x: mix(pa, x, "mla", None))
            return rms_norm(z, p["final_norm"], cfg.rms_norm_eps), aux

        h, aux = _rematted(layer, remat)(p, h, ids)
        outs.append(h)
        auxs.append(aux)
    return outs, auxs


def forward_hidden(cfg: LingConfig, params: Params, input_ids: jax.Array, *,
                   attention_mask: jax.Array | None = None, positions: jax.Array | None = None,
                   segment_ids: jax.Array | None = None, mtp: bool = False, collect: bool = False,
                   expert_counts: bool = False, remat: str = "none", unroll: bool = False) -> dict[str, Any]:
    """The model up to (not including) the lm_head.

    Returns {"final": final-normed hidden [B, T, D]}, plus
      "mtp": [MTP hiddens] if `mtp`;
      "layers": per layer {"hidden": output, "router": aux} if `collect`;
      "expert_counts": tokens per expert of every MoE layer, stacked like params["segments"]
      ([n, E] for a run, {"kda": [n, G-1, E], "mla": [n, E]} for groups, None for dense runs),
      and "mtp_expert_counts" ([E] per MoE MTP layer) if `expert_counts`.
    `remat` ("none" or a key of REMAT_POLICIES) rematerialises each layer in the backward pass.
    `unroll`: the layers as straight-line code instead of scans (`run_stack`): no stacking of what
    the backward pass keeps per layer, at the cost of compiling every layer.
    """
    ctx = make_context(cfg, input_ids, attention_mask=attention_mask, positions=positions,
                       segment_ids=segment_ids)
    mix = sequence_mixer(cfg, ctx)

    def layer(p, x, lim, cache, mixer, ffn):
        def inner(p, x, lim):
            x, _, aux = decoder_layer(p, x, lim, cfg=cfg, ffn=ffn, mix=lambda pa, h: mix(pa, h, mixer, None))
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
        out["mtp"], mtp_aux = mtp_hidden(cfg, params, input_ids, out["final"], ctx, remat)
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
    return _forward(config, params, input_ids, attention_mask=attention_mask)


def forward_with_mtp(config: LingConfig, params: Params, input_ids: jax.Array, *,
                     attention_mask: jax.Array | None = None) -> tuple[jax.Array, list[jax.Array]]:
    """(main logits [B, T, V], [logits of each MTP layer]) in float32 (jitted)."""
    warn_without_mesh(params)
    return _forward_with_mtp(config, params, input_ids, attention_mask=attention_mask)


@functools.partial(jax.jit, static_argnums=0)
def _forward(config: LingConfig, params: Params, input_ids: jax.Array, *,
             attention_mask: jax.Array | None = None) -> jax.Array:
    h = forward_hidden(config, params, input_ids, attention_mask=attention_mask)["final"]
    return lm_head(config, params, h)


@functools.partial(jax.jit, static_argnums=0)
def _forward_with_mtp(config: LingConfig, params: Params, input_ids: jax.Array, *,
                      attention_mask: jax.Array | None = None) -> tuple[jax.Array, list[jax.Array]]:
    out = forward_hidden(config, params, input_ids, attention_mask=attention_mask, mtp=True)
    return lm_head(config, params, out["final"]), [lm_head(config, params, h) for h in out["mtp"]]

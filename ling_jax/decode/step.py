"""One decode step over explicit caches, and the prefill that makes them.

`decode_step(cfg, kernels, params, cache, tokens)` runs one token per row through every layer
(KDA: one recurrent step on the cached state; MLA: absorbed attention over the latent cache) and
returns the updated cache and the next-token logits. It is what the batch `generate` loop and
the serving engine both call. Unrolled (the default), the layers are one straight-line program,
and where the `Kernels` record says so the decode kernels read the weights and caches from their
layer stacks in place (`ling_jax.decode.views`, `stack_plan`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ling_jax.cache import Cache, cache_length, place
from ling_jax.checkpoint.fp8 import is_block_fp8
from ling_jax.config import LingConfig, Segment
from ling_jax.decode import layers
from ling_jax.decode.views import (
    FUSED_CONV,
    KdaCaches,
    LatentPool,
    join_latent,
    join_stacks,
    split_latent,
    split_stacks,
)
from ling_jax.kernels import Kernels, kda_layer_kernel
from ling_jax.layers.rope import rope_cos_sin
from ling_jax.model import LayerFn, SegmentPlan, decoder_layer, embed, lm_head, make_context, run_stack, sequence_mixer
from ling_jax.ops import stack_matmul
from ling_jax.ops.norms import rms_norm
from ling_jax.params import Params, get_path, layer_stacks, set_path


def fuse_for_decode(cfg: LingConfig, kernels: Kernels, params: Params) -> Params:
    """`params` with the weights that multiply the same input also side by side in one matrix: each
    KDA layer's six input projections and its q|k|v conv weights (`layers.fuse_kda`), each MLA layer's
    three (`layers.fuse_mla`) and each MLP's or shared expert's gate and up projections
    (`layers.fuse_gate_up`), so a decode step launches one product where it launched several. Made
    inside the decode loop's jit, once per call (a second copy of those weights meanwhile).
    Unchanged under a multi-device mesh (the concatenation would regather sharded columns);
    FP8-resident weights are left separate (it would dequantize them)."""
    if kernels.sharded:
        return params
    new = jax.tree.map(lambda x: x, params, is_leaf=is_block_fp8)  # fresh containers: set_path below mutates

    def fuse(path: tuple, fn: Callable[[dict], dict]) -> None:
        set_path(new, path, fn(get_path(new, path)))

    for stack in layer_stacks(cfg):
        if stack.mtp:
            continue
        fuse((*stack.path, "attn"), layers.fuse_kda if stack.mixer == "kda" else layers.fuse_mla)
        if stack.ffn == "dense":
            fuse((*stack.path, "mlp"), layers.fuse_gate_up)
        elif "shared_gate_proj" in get_path(new, (*stack.path, "mlp")):
            fuse((*stack.path, "mlp"), functools.partial(layers.fuse_gate_up, prefix="shared_"))
    return new


def stack_plan(cfg: LingConfig, kernels: Kernels, x: jax.Array, layer_fn: LayerFn, unroll: bool,
               page_table: jax.Array | None = None,
               threaded_pool: bool = False) -> Callable[[Segment, Params, Any], SegmentPlan]:
    """The decode step's `model.run_stack` plan: per segment, the weight and cache leaves the decode
    kernels read in place are split out of the stacks and rejoined per layer as views, and a
    segment whose KDA layers run the layer kernel threads its cache stacks from layer to layer
    (`views.KdaCaches`, a Python loop). Views exist only for an unrolled step on one device; a paged
    latent pool (`page_table` given) is read in place by the paged kernel the same way.

    `threaded_pool` (the verify step's row form; needs `unroll` and `page_table`): the MLA layers
    write their rows into the pool before attending, so the pool stack is threaded from layer to
    layer instead (`views.LatentPool`; the segment's result is {"pages": the pool}), and KDA layers
    get their caches per layer, not the layer kernel."""
    rows = x.shape[0] * x.shape[1]
    dtype = x.dtype
    experts = (unroll and cfg.uses_moe and kernels.expert_stacks
               and kernels.moe_for(rows * cfg.num_experts_per_tok) == "gemv")
    # a paged pool is always read in place (its layer's slice would be a copy of the whole pool)
    latent_views = page_table is not None or (unroll and kernels.decode_mla and not kernels.sharded)
    linears = rows if unroll and rows <= stack_matmul.MAX_ROWS and kernels.decode_proj else 0
    kda_kernel = unroll and kda_layer_kernel(cfg, kernels) and not threaded_pool
    if threaded_pool and not (unroll and page_table is not None):
        raise ValueError("stack_plan: a threaded latent pool needs unrolled layers and a page table")

    def threads(kda_params: Params | None) -> bool:
        return kda_kernel and kda_params is not None and FUSED_CONV in kda_params["attn"]

    def plan(seg: Segment, sp: Params, cs: Any) -> SegmentPlan:
        if seg.kind == "run":
            kda = seg.mixer == "kda" and threads(sp)
            sp, stacks = split_stacks(sp, 1, dtype, experts, linears, kda)
            cs, latent = split_latent(cs) if latent_views and seg.mixer == "mla" else (cs, None)
            threaded = KdaCaches(cs) if kda else None
            pool = LatentPool(latent, page_table) if threaded_pool and latent is not None else None

            def run_layer(p, x, lim, c, mixer, ffn):
                if pool:
                    x, y = layer_fn(join_stacks(p, stacks), x, lim, pool.view(c), mixer, ffn)
                    return x, pool.keep(y)
                c = threaded.view(c) if threaded else join_latent(c, latent, page_table)
                x, y = layer_fn(join_stacks(p, stacks), x, lim, c, mixer, ffn)
                return x, threaded.keep(y) if threaded else y

            held = threaded or pool
            return SegmentPlan(sp, threaded.index if threaded else cs, run_layer, loop=kda or threaded_pool,
                               finish=(lambda ys: held.result()) if held else lambda ys: ys)
        kda = threads(sp.get("kda"))
        sp_kda, stacks_kda = split_stacks(sp.get("kda"), 2, dtype, experts, linears, kda)
        sp_mla, stacks_mla = split_stacks(sp["mla"], 1, dtype, experts, linears)
        threaded = KdaCaches(cs["kda"]) if kda else None
        cs_mla, latent = split_latent(cs["mla"]) if latent_views else (cs["mla"], None)
        pool = LatentPool(latent, page_table) if threaded_pool else None

        def group_layer(p, x, lim, c, mixer, ffn):
            if mixer == "mla" and pool:
                x, y = layer_fn(join_stacks(p, stacks_mla), x, lim, pool.view(c), mixer, ffn)
                return x, pool.keep(y)
            if mixer == "mla":
                return layer_fn(join_stacks(p, stacks_mla), x, lim, join_latent(c, latent, page_table), mixer, ffn)
            x, y = layer_fn(join_stacks(p, stacks_kda), x, lim, threaded.view(c) if threaded else c, mixer, ffn)
            return x, threaded.keep(y) if threaded else y

        def finish(ys: Any) -> Any:
            held = {"kda": threaded.result()} if threaded else {}
            return {**ys, **held, **({"mla": pool.result()} if pool else {})}

        caches = {"kda": threaded.index if threaded else cs.get("kda"), "mla": cs_mla}
        return SegmentPlan({**sp, "kda": sp_kda, "mla": sp_mla}, caches, group_layer, loop=kda or threaded_pool,
                           finish=finish)

    return plan


def decode_step(cfg: LingConfig, kernels: Kernels, params: Params, cache: Cache, tokens_B: jax.Array,
                unroll: bool = True, page_table: jax.Array | None = None) -> tuple[Cache, jax.Array]:
    """One token per row at position cache["lengths"]: (updated cache, logits [B, V] float32).

    `kernels`: `kernels.select(cfg, dtype=..., decode=True, unroll=unroll)`. `params`: as loaded, or
    with `fuse_for_decode`'s fused weights (faster). `unroll`: the layers as one straight-line
    program (faster steps, longer compiles) instead of scans. A paged cache
    (`cache.paged_cache_shapes`) comes with its `page_table` [B, N]: the new latent rows go to the
    pages it names (every row needs a page for position lengths[b]; the pool drops a write to an
    out-of-range page index)."""
    lengths = cache["lengths"]
    cos, sin = rope_cos_sin(lengths[:, None], cfg.qk_rope_head_dim, cfg.rope_theta)

    def mix(p, h_B1D, mixer, c):
        if mixer == "kda":
            return layers.kda(p, h_B1D, c, cfg=cfg, kernels=kernels)
        latent = c["latent"] if "latent" in c else c["pages"]
        out_BD, row_BW = layers.mla(p, h_B1D[:, 0], latent, lengths, cfg=cfg, kernels=kernels, cos=cos, sin=sin)
        return out_BD[:, None], row_BW

    def layer(p, x, lim, c, mixer, ffn):
        return layers.decoder_layer(p, x, lim, cfg=cfg, kernels=kernels, ffn=ffn,
                                    mix=lambda pa, h: mix(pa, h, mixer, c))

    x = embed(params, tokens_B[:, None])
    x, new = run_stack(cfg, params, x, layer, caches=cache["segments"], unroll=unroll,
                       plan=stack_plan(cfg, kernels, x, layer, unroll, page_table))
    # the cache writes below wait for the last layer: else XLA may schedule a segment's latent write
    # before that segment's attention has read the cache, and then copies the whole cache to keep the
    # old rows
    x, new = jax.lax.optimization_barrier((x, new))
    rows = jnp.arange(tokens_B.shape[0])

    def merge(seg_cache: dict, seg_new: Any) -> dict:
        if "latent" in seg_cache:  # scatter the new latent row of every layer into slot `lengths`
            return {"latent": seg_cache["latent"].at[:, rows, lengths].set(seg_new)}
        if "pages" in seg_cache:  # ... or into its page
            page_size = seg_cache["pages"].shape[-2]
            page_B = jnp.take_along_axis(page_table, (lengths // page_size)[:, None], axis=1, mode="clip")[:, 0]
            return {"pages": seg_cache["pages"].at[:, page_B, lengths % page_size].set(seg_new, mode="drop")}
        return seg_new

    with jax.named_scope("cache_write"):
        segs = []
        for seg, c, y in zip(cfg.segments, cache["segments"], new, strict=True):
            segs.append(merge(c, y) if seg.kind == "run" else {k: merge(c[k], y[k]) for k in c})
    with jax.named_scope("lm_head"):
        logits = lm_head(cfg, params, rms_norm(x[:, 0], params["final_norm"], cfg.rms_norm_eps))
    return place({"segments": segs, "lengths": lengths + 1}), logits


@functools.partial(jax.jit, static_argnums=(0, 1, 5))
def prefill(cfg: LingConfig, kernels: Kernels, params: Params, ids_BT: jax.Array, lengths_B: jax.Array,
            max_len: int) -> tuple[Cache, jax.Array]:
    """Runs right-padded prompts, returns (cache for `max_len` tokens, logits of each row's last token).

    ids: [B, T]; row b's prompt is ids[b, :lengths[b]]. KDA layers keep their final state and the
    conv window of the last real token; MLA layers write their latent rows into slots [0, T).
    `kernels`: `kernels.select(cfg, dtype=..., inference=True)`.
    """
    caches, x = prefill_stack(cfg, kernels, params, ids_BT, lengths_B, max_len)
    last = jnp.take_along_axis(x, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    h = rms_norm(last, params["final_norm"], cfg.rms_norm_eps)
    return place({"segments": caches, "lengths": lengths_B.astype(jnp.int32)}), lm_head(cfg, params, h)


def prefill_stack(cfg: LingConfig, kernels: Kernels, params: Params, ids_BT: jax.Array, lengths_B: jax.Array,
                  max_len: int) -> tuple[list[Any], jax.Array]:
    """`prefill`'s layer stack: (the segments' caches for `max_len` tokens, the last layer's output
    [B, T, D] before the final norm)."""
    b, t = ids_BT.shape
    valid = jnp.arange(t)[None, :] < lengths_B[:, None]
    mix = sequence_mixer(cfg, kernels, make_context(cfg, ids_BT, attention_mask=valid))

    def layer(p, x, lim, _, mixer, ffn):
        x, c, _ = decoder_layer(p, x, lim, cfg=cfg, kernels=kernels, ffn=ffn, mix=lambda pa, h: mix(pa, h, mixer, None))
        if mixer == "mla":
            c = {"latent": latent_slots(c["latent"], max_len)}
        return x, c

    x, caches = run_stack(cfg, params, embed(params, ids_BT), layer)
    return caches, x


def latent_slots(rows_BTW: jax.Array, max_len: int) -> jax.Array:
    """Latent rows [B, T, W] of positions [0, T) in a cache of `cache_length(max_len)` slots (zeros
    after them): [B, S, W]. The prompt bucket may outgrow the cache; rows past every length are
    padding and are dropped."""
    b, t, w = rows_BTW.shape
    slots = cache_length(max_len)
    n = min(t, slots)
    return jnp.zeros((b, slots, w), rows_BTW.dtype).at[:, :n].set(rows_BTW[:, :n])

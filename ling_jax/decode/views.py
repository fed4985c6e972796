"""Views of layer stacks: how the unrolled decode step hands weights and caches to kernels in place.

A decode kernel (a Pallas custom call) given one layer's slice of a segment's stack makes XLA copy
the slice first, every step (a whole weight, or a whole cache layer however short the context).
So before the layer loop, `split_stacks` takes such leaves out of the segment's params (each
replaced by its layers' flat indices, which the loop slices like any param) and the loop rejoins
them per layer as views of the whole stack (`join_stacks`): `ops.layer_gemv.WeightStack`,
`ops.moe.ExpertStack`, `LatentStack`. The KDA layer kernel updates a layer's state inside the
segment's state stack; `KdaCaches` threads those stacks from layer to layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.ops import expert_gemv, stack_matmul
from ling_jax.ops.kda.decode_layer import KdaCacheStack
from ling_jax.ops.layer_gemv import WeightStack
from ling_jax.ops.moe import EXPERT_LEAVES, ExpertStack, shared_fits
from ling_jax.params import Params

FUSED_INPUT = "x_proj"  # decode params: a layer's projections of its normed input side by side, one product
FUSED_CONV = "qkv_conv"  # decode params: a KDA layer's q|k|v conv weights stacked [3P, W]
SHARED_LEAVES = ("shared_gate_up_proj", "shared_down_proj")  # the fused shared expert (`ops.moe.SharedStacks`)
LINEAR_LEAVES = {  # per-layer [C, O] projections that `layer_gemv.linear` takes as `WeightStack`s
    "attn": (FUSED_INPUT, "f_b_proj", "g_b_proj", "o_proj", "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj",
             "g_proj", "dense"),
    "mlp": ("gate_up_proj", "down_proj"),
}
# small per-layer weights the KDA decode layer kernel reads, and the output norm's (read by o_proj's gemv)
KDA_LEAVES = (FUSED_CONV, "A_log", "dt_bias", "o_norm")
NORM_LEAVES = ("input_norm", "post_attn_norm")  # RMSNorms the gemv kernels apply (`layer_gemv.normed`)

Stacks = dict[tuple[str, str], tuple[type, jax.Array]]  # (subtree, leaf) -> (view class, flat stack)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentStack:
    """One MLA layer's latent cache [B, S, W], left inside its segment's stack [L, B, S, W], for the
    latent-attention kernel to read in place."""

    stack: jax.Array  # [L, B, S, W]
    layer: jax.Array  # int32 scalar, this layer's index in the stack


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLatent:
    """One MLA layer's latent cache as pages of a pool: the pool [P, K, W] (or its segment's stack
    [L, P, K, W] read in place at `layer`) and the rows' page table [B, N] (`cache.paged_cache_shapes`)."""

    pool: jax.Array  # [P, K, W] or [L, P, K, W]
    page_table: jax.Array  # [B, N] int32
    layer: jax.Array | None = None  # int32 scalar with a stacked pool


def stackable(w: object, lead: int, dtype: jnp.dtype, rows: int = 1) -> bool:
    """Whether a leaf of layer-stacked params (`lead` stack axes) can go to `layer_gemv.linear` as a
    `WeightStack` for products of `rows` rows: a dense array of [C, O] matrices in the compute
    `dtype` that the kernel for that many rows tiles."""
    if not (isinstance(w, jax.Array) and w.ndim == lead + 2 and w.dtype == dtype):
        return False
    return expert_gemv.supported(*w.shape[-2:]) if rows == 1 else stack_matmul.supported(rows, *w.shape[-2:])


def split_stacks(t: Params | None, lead: int, dtype: Any, experts: bool, linears: int,
                 kda: bool = False) -> tuple[Params | None, Stacks]:
    """Takes weight stacks out of layer-stacked params `t` (`lead` stack axes).

    Each taken leaf becomes its layers' flat indices (an int32 array of the stack's leading shape,
    sliced by the layer loop like any param); its stack, flattened to one layer axis, is returned
    aside, to be rejoined per layer as a view (`join_stacks`). Only dense stacks already in the
    compute `dtype` (FP8-resident or other-dtype stacks are sliced and converted per layer).
    `experts`: the routed-expert stacks as `ExpertStack`s, and the fused shared expert
    (`SHARED_LEAVES`) as a one-expert stack where `ops.moe.shared_fits` (the MoE then runs it inside
    the routed experts' gemv launches), and the expert bias as a `WeightStack` (the selection kernel
    reads it). `linears` (the rows the projections multiply, 0: none): the `LINEAR_LEAVES`
    projections as `WeightStack`s where a kernel takes that many rows, past one row the fused
    shared expert too (where `experts` did not take it), and at one row the router (float32) and the
    `NORM_LEAVES` (any dtype). `kda`: the `KDA_LEAVES` (any dtype) as `WeightStack`s too (the KDA
    decode layer kernel and its output norm, `expert_gemv.GatedRows`).
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
        routed = [n for n in EXPERT_LEAVES if isinstance(mlp_p[n], jax.Array) and mlp_p[n].dtype == dtype]
        for name in routed:  # [L, E, C, O]
            take("mlp", name, ExpertStack, False)
        shared = [mlp_p.get(n) for n in SHARED_LEAVES]  # present in the fused decode params
        if (len(routed) == len(EXPERT_LEAVES)
                and all(isinstance(w, jax.Array) and w.dtype == dtype for w in shared)
                and shared_fits(*stacks["mlp", "gate_proj"][1].shape[-2:], shared[1].shape[-2])):
            for name in SHARED_LEAVES:  # one expert per layer: [L, 1, C, O]
                take("mlp", name, ExpertStack, True)
        if isinstance(mlp_p["expert_bias"], jax.Array):
            take("mlp", "expert_bias", WeightStack, False)
    if linears:
        for sub, names in LINEAR_LEAVES.items():
            for name in names + (SHARED_LEAVES if sub == "mlp" and linears > 1 else ()):
                if sub in subs and stackable(subs[sub].get(name), lead, dtype, linears):
                    take(sub, name, WeightStack, False)
    if linears == 1:
        router = subs.get("mlp", {}).get("router")  # float32: stackable in its own dtype
        if stackable(router, lead, getattr(router, "dtype", None)):
            take("mlp", "router", WeightStack, False)
        for name in NORM_LEAVES:
            if isinstance(t.get(name), jax.Array) and t[name].ndim == lead + 1:
                take("", name, WeightStack, False)
    if kda:
        for name in KDA_LEAVES:
            take("attn", name, WeightStack, False)
    top = subs.pop("")
    return {**t, **subs, **top}, stacks


def join_stacks(p: Params, stacks: Stacks) -> Params:
    """One layer's params with its index leaves turned back into views of their stacks."""
    if not stacks:
        return p
    subs = {sub: dict(p[sub]) if sub else {} for sub in {sub for sub, _ in stacks}}  # "": top level
    for (sub, name), (cls, stack) in stacks.items():
        subs[sub][name] = cls(stack, (p[sub] if sub else p)[name])
    top = subs.pop("", {})
    return {**p, **subs, **top}


class KdaCaches:
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


class LatentPool:
    """A segment's paged latent pool stack threaded through its MLA layers, one after another (a Python
    loop; the verify step's row form, `layers.mla_rows`): each layer writes its new rows into the
    whole stack, which the next layer then reads."""

    def __init__(self, stack: jax.Array, page_table: jax.Array):  # [n, P, K, W], [R, N]
        self.stack, self.page_table = stack, page_table

    def view(self, c: dict[str, Any]) -> dict[str, Any]:
        """A layer's MLA cache (its "pages" the layer's index) as a `PagedLatent` of the stack now."""
        return {**c, "pages": PagedLatent(self.stack, self.page_table, c["pages"])}

    def keep(self, stack: jax.Array) -> jax.Array:
        """Takes a layer's updated stack; returns what the loop stacks for it (nothing of use)."""
        self.stack = stack
        return jnp.zeros((), jnp.int32)

    def result(self) -> dict[str, jax.Array]:
        return {"pages": self.stack}


def split_latent(c: dict[str, Any]) -> tuple[dict[str, Any], jax.Array]:
    """A segment's MLA cache with its latent stack ([n, B, S, W], or a paged pool [n, P, K, W])
    replaced by the layers' indices (sliced by the layer loop like any cache leaf), and the stack
    aside, rejoined per layer as a view (`join_latent`) so the decode kernel reads it in place."""
    name = "latent" if "latent" in c else "pages"
    stack = c[name]
    return {**c, name: jnp.arange(stack.shape[0], dtype=jnp.int32)}, stack


def join_latent(c: Any, stack: jax.Array | None, page_table: jax.Array | None = None) -> Any:
    """One layer's MLA cache with its index turned back into a view of `stack` (a `LatentStack`, or
    with a page table a `PagedLatent` of the pool stack)."""
    if stack is None:
        return c
    if "pages" in c:
        return {**c, "pages": PagedLatent(stack, page_table, c["pages"])}
    return {**c, "latent": LatentStack(stack, c["latent"])}

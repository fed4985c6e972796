"""The one table mapping Hugging Face tensor names to our param pytree, and random init.

Params are a plain nested dict of arrays:

    {"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (absent when tied),
     "segments": [one entry per `LingConfig.segments` item],
     "mtp": [one layer dict per MTP layer]}

A `run` segment entry is one layer dict whose leaves carry a leading `[length]` axis; a `groups`
entry is `{"kda": layer dict [n_groups, G-1, ...], "mla": layer dict [n_groups, ...]}`. Linear
weights are stored in JAX layout `[in, out]` (the checkpoint's `[out, in]` transposed once at
load), per-expert weights stacked `[E, in, out]`, conv weights `[P, W]`.

`LEAVES` below is the table: for every leaf of a layer, the HF suffix, the transform between the
two layouts, its shape as a function of the config, whether it is kept in float32 and how it is
initialised. Loading, export and conversion all walk this table; nothing else knows HF names.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import Ffn, LingConfig, Mixer

Transform = Literal["none", "T", "conv"]
Init = Literal["normal", "ones", "zeros", "a_log", "conv", "router"]
Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One tensor role of a layer: our path, the HF suffix and how the two layouts relate."""

    path: tuple[str, ...]  # inside the layer dict, e.g. ("attn", "q_proj")
    hf: str  # suffix after "model.layers.{i}.", "{e}" standing for the expert index
    shape: Callable[[LingConfig], tuple[int, ...]]  # our layout, per layer (experts included)
    transform: Transform = "T"
    init: Init = "normal"
    fp32: bool = False  # kept in float32 whatever the requested dtype (A_log, dt_bias, expert_bias)
    experts: bool = False  # leading axis = expert index, one HF tensor per expert
    quantizable: bool = True  # a linear ("T") weight that block-FP8 checkpoints may store in FP8 (§4)

    def hf_shape(self, cfg: LingConfig) -> tuple[int, ...]:
        """Shape of one HF tensor (one expert's, for expert leaves)."""
        s = self.shape(cfg)[1:] if self.experts else self.shape(cfg)
        if self.transform == "T":
            return (s[1], s[0])
        if self.transform == "conv":
            return (s[0], 1, s[1])
        return s


def _kda_leaves(cfg: LingConfig) -> list[Leaf]:
    d, p, h, dh = cfg.hidden_size, cfg.kda_dim, cfg.num_attention_heads, cfg.head_dim
    w = cfg.short_conv_kernel_size
    leaves = [Leaf(("attn", f"{n}_proj"), f"attention.{n}_proj.weight", lambda c: (d, p))
              for n in ("q", "k", "v")]
    leaves += [Leaf(("attn", f"{n}_conv"), f"attention.{n}_conv1d.weight", lambda c: (p, w),
                    transform="conv", init="conv") for n in ("q", "k", "v")]
    for n in ("f", "g"):
        if cfg.no_kda_lora:
            leaves.append(Leaf(("attn", f"{n}_proj"), f"attention.{n}_proj.weight", lambda c: (d, p)))
        else:
            leaves.append(Leaf(("attn", f"{n}_a_proj"), f"attention.{n}_a_proj.weight", lambda c: (d, dh)))
            leaves.append(Leaf(("attn", f"{n}_b_proj"), f"attention.{n}_b_proj.weight", lambda c: (dh, p)))
    leaves += [
        Leaf(("attn", "b_proj"), "attention.b_proj.weight", lambda c: (d, h)),
        Leaf(("attn", "A_log"), "attention.A_log", lambda c: (h,), "none", "a_log", fp32=True),
        Leaf(("attn", "dt_bias"), "attention.dt_bias", lambda c: (p,), "none", "zeros", fp32=True),
        Leaf(("attn", "o_norm"), "attention.o_norm.weight", lambda c: (dh,), "none", "ones"),
        Leaf(("attn", "o_proj"), "attention.o_proj.weight", lambda c: (p, d)),
    ]
    return leaves


def _mla_leaves(cfg: LingConfig) -> list[Leaf]:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    r, dr, dqk = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_head_dim
    kvb = h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    gate = h if cfg.gated_attention_proj_granularity_type == "head_wise" else h * cfg.v_head_dim
    if cfg.q_lora_rank is None:
        leaves = [Leaf(("attn", "q_proj"), "attention.q_proj.weight", lambda c: (d, h * dqk))]
    else:
        rq = cfg.q_lora_rank
        leaves = [
            Leaf(("attn", "q_a_proj"), "attention.q_a_proj.weight", lambda c: (d, rq)),
            Leaf(("attn", "q_a_norm"), "attention.q_a_layernorm.weight", lambda c: (rq,), "none", "ones"),
            Leaf(("attn", "q_b_proj"), "attention.q_b_proj.weight", lambda c: (rq, h * dqk)),
        ]
    return [
        *leaves,
        Leaf(("attn", "kv_a_proj"), "attention.kv_a_proj_with_mqa.weight", lambda c: (d, r + dr)),
        Leaf(("attn", "kv_a_norm"), "attention.kv_a_layernorm.weight", lambda c: (r,), "none", "ones"),
        Leaf(("attn", "kv_b_proj"), "attention.kv_b_proj.weight", lambda c: (r, kvb)),
        Leaf(("attn", "g_proj"), "attention.g_proj.weight", lambda c: (d, gate)),
        Leaf(("attn", "dense"), "attention.dense.weight", lambda c: (h * cfg.v_head_dim, d)),
    ]


def _dense_leaves(cfg: LingConfig) -> list[Leaf]:
    d, i = cfg.hidden_size, cfg.intermediate_size
    return [
        Leaf(("mlp", "gate_proj"), "mlp.gate_proj.weight", lambda c: (d, i)),
        Leaf(("mlp", "up_proj"), "mlp.up_proj.weight", lambda c: (d, i)),
        Leaf(("mlp", "down_proj"), "mlp.down_proj.weight", lambda c: (i, d)),
    ]


def _moe_leaves(cfg: LingConfig) -> list[Leaf]:
    d, e, im, is_ = cfg.hidden_size, cfg.num_experts or 0, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    leaves = [
        Leaf(("mlp", "router"), "mlp.gate.weight", lambda c: (d, e), init="router", quantizable=False),
        Leaf(("mlp", "expert_bias"), "mlp.gate.expert_bias", lambda c: (e,), "none", "zeros", fp32=True),
        Leaf(("mlp", "gate_proj"), "mlp.experts.{e}.gate_proj.weight", lambda c: (e, d, im), experts=True),
        Leaf(("mlp", "up_proj"), "mlp.experts.{e}.up_proj.weight", lambda c: (e, d, im), experts=True),
        Leaf(("mlp", "down_proj"), "mlp.experts.{e}.down_proj.weight", lambda c: (e, im, d), experts=True),
    ]
    if is_ > 0:
        leaves += [
            Leaf(("mlp", "shared_gate_proj"), "mlp.shared_experts.gate_proj.weight", lambda c: (d, is_)),
            Leaf(("mlp", "shared_up_proj"), "mlp.shared_experts.up_proj.weight", lambda c: (d, is_)),
            Leaf(("mlp", "shared_down_proj"), "mlp.shared_experts.down_proj.weight", lambda c: (is_, d)),
        ]
    return leaves


def layer_leaves(cfg: LingConfig, mixer: Mixer, ffn: Ffn, *, mtp: bool = False) -> list[Leaf]:
    """Every leaf of one decoder layer (or MTP layer) of the given kind."""
    d = cfg.hidden_size
    leaves = [
        Leaf(("input_norm",), "input_layernorm.weight", lambda c: (d,), "none", "ones"),
        Leaf(("post_attn_norm",), "post_attention_layernorm.weight", lambda c: (d,), "none", "ones"),
    ]
    leaves += _kda_leaves(cfg) if mixer == "kda" else _mla_leaves(cfg)
    leaves += _dense_leaves(cfg) if ffn == "dense" else _moe_leaves(cfg)
    if mtp:
        leaves += [
            Leaf(("enorm",), "enorm.weight", lambda c: (d,), "none", "ones"),
            Leaf(("hnorm",), "hnorm.weight", lambda c: (d,), "none", "ones"),
            Leaf(("eh_proj",), "eh_proj.weight", lambda c: (2 * d, d)),
            Leaf(("final_norm",), "final_layernorm.weight", lambda c: (d,), "none", "ones"),
        ]
    return leaves


def global_leaves(cfg: LingConfig) -> list[Leaf]:
    """Leaves outside the layers (`hf` is the full HF name here)."""
    v, d = cfg.vocab_size, cfg.hidden_size
    leaves = [
        Leaf(("embed",), "model.word_embeddings.weight", lambda c: (v, d), "none"),
        Leaf(("final_norm",), "model.norm.weight", lambda c: (d,), "none", "ones"),
    ]
    if not cfg.tie_word_embeddings:
        leaves.append(Leaf(("lm_head",), "lm_head.weight", lambda c: (d, v), quantizable=False))
    return leaves


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """Layers whose params are stacked into one layer dict at `path` of the param pytree."""

    path: tuple[Any, ...]  # e.g. ("segments", 0) or ("segments", 2, "kda") or ("mtp", 0)
    mixer: Mixer
    ffn: Ffn
    layers: np.ndarray  # int array of layer indices, shape = the stack's leading axes
    mtp: bool = False

    def leaves(self, cfg: LingConfig) -> list[Leaf]:
        return layer_leaves(cfg, self.mixer, self.ffn, mtp=self.mtp)


def layer_stacks(cfg: LingConfig) -> list[LayerStack]:
    """Where every layer's params live: one entry per stacked layer dict."""
    stacks: list[LayerStack] = []
    for s, seg in enumerate(cfg.segments):
        if seg.kind == "run":
            idx = np.arange(seg.first_layer, seg.first_layer + seg.length)
            stacks.append(LayerStack(("segments", s), seg.mixer, seg.ffn, idx))
        else:
            g = seg.kda_per_group + 1
            base = seg.first_layer + g * np.arange(seg.length)
            if seg.kda_per_group:
                kda = base[:, None] + np.arange(seg.kda_per_group)[None, :]
                stacks.append(LayerStack(("segments", s, "kda"), "kda", "moe", kda))
            stacks.append(LayerStack(("segments", s, "mla"), "mla", "moe", base + g - 1))
    for j in range(cfg.num_nextn_predict_layers):
        i = cfg.num_hidden_layers + j
        stacks.append(LayerStack(("mtp", j), "mla", cfg.ffn_of(i), np.array(i), mtp=True))
    return stacks


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One leaf of the full pytree: where it lives, its full shape and which HF tensors fill it."""

    path: tuple[Any, ...]  # full path in the param pytree
    leaf: Leaf
    shape: tuple[int, ...]  # full shape: stack axes + leaf shape
    stack_shape: tuple[int, ...]  # leading axes that index HF tensors (layer axes, then experts)
    layers: np.ndarray | None  # layer index per stack position (None for global leaves)

    def hf_name(self, idx: tuple[int, ...]) -> str:
        """HF tensor name of the element at stack index `idx` (len(idx) == len(stack_shape))."""
        if self.layers is None:
            return self.leaf.hf
        n_layer_axes = self.layers.ndim
        layer = int(self.layers[idx[:n_layer_axes]])
        name = f"model.layers.{layer}.{self.leaf.hf}"
        return name.format(e=idx[n_layer_axes]) if self.leaf.experts else name

    def hf_names(self) -> Iterator[tuple[tuple[int, ...], str]]:
        for idx in np.ndindex(*self.stack_shape):
            yield idx, self.hf_name(idx)

    def dtype(self, dtype: Any) -> Any:
        return jnp.float32 if self.leaf.fp32 else jnp.dtype(dtype)


def param_slots(cfg: LingConfig) -> list[ParamSlot]:
    """Every leaf of the param pytree with its HF provenance (the table, expanded)."""
    slots = [ParamSlot(lf.path, lf, lf.shape(cfg), (), None) for lf in global_leaves(cfg)]
    for st in layer_stacks(cfg):
        for lf in st.leaves(cfg):
            shape = lf.shape(cfg)
            stack = st.layers.shape + ((shape[0],) if lf.experts else ())
            slots.append(ParamSlot(st.path + lf.path, lf, st.layers.shape + shape, stack, st.layers))
    return slots


def set_path(tree: Params, path: tuple[Any, ...], value: Any) -> None:
    """Sets tree[path] creating dicts/lists on the way (lists for integer keys)."""
    node: Any = tree
    for key, nxt in itertools.pairwise(path):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def get_path(tree: Params, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def build_tree(cfg: LingConfig, make: Callable[[ParamSlot], Any]) -> Params:
    """The param pytree with `make(slot)` at every leaf."""
    tree: Params = {"segments": [], "mtp": []}
    for slot in param_slots(cfg):
        set_path(tree, slot.path, make(slot))
    return tree


def param_shapes(cfg: LingConfig, dtype: Any = jnp.bfloat16) -> Params:
    """The param pytree as `jax.ShapeDtypeStruct`s."""
    return build_tree(cfg, lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype(dtype)))


def materialize(cfg: LingConfig, element: Callable[[ParamSlot, tuple[int, ...]], np.ndarray], dtype: Any,
                sharding: Callable[[ParamSlot], jax.sharding.Sharding], on_leaf: Callable[[int], None] | None = None
                ) -> Params:
    """Builds the param pytree leaf by leaf with `jax.make_array_from_callback`.

    `element(slot, idx)` returns one stacked element (one layer's tensor, or one expert's) in our
    layout; each device's callback assembles only the elements and slices of its own shard, so no
    leaf is ever whole in host memory or on one device when `sharding` splits it.
    """

    def make(slot: ParamSlot) -> jax.Array:
        dt = np.dtype(slot.dtype(dtype))
        ns = len(slot.stack_shape)

        def callback(index: tuple[slice, ...]) -> np.ndarray:
            index = tuple(index) + (slice(None),) * (len(slot.shape) - len(index))
            ranges = [range(*sl.indices(n)) for sl, n in zip(index[:ns], slot.stack_shape, strict=True)]
            out = None
            for pos in itertools.product(*(enumerate(r) for r in ranges)):
                piece = element(slot, tuple(p[1] for p in pos))[index[ns:]].astype(dt)
                if out is None:
                    out = np.empty([len(r) for r in ranges] + list(piece.shape), dt)
                out[tuple(p[0] for p in pos)] = piece
            return out

        arr = jax.make_array_from_callback(slot.shape, sharding(slot), callback)
        if on_leaf is not None:
            on_leaf(arr.nbytes)
        return arr

    return build_tree(cfg, make)


def default_sharding(cfg: LingConfig, mesh: jax.sharding.Mesh | None) -> Callable[[ParamSlot], jax.sharding.Sharding]:
    """Our sharding table on `mesh`, or everything on the first device. The mesh is checked
    (`sharding.check_mesh`), and a warning names the axes that some leaves cannot be split over
    (their dims are not divisible: those leaves are whole on every device of the axis)."""
    if mesh is None:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return lambda slot: single
    from ling_jax.sharding import check_mesh, dropped_axes, param_sharding

    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (ling_jax.make_mesh builds one), got {type(mesh).__name__}")
    check_mesh(mesh)
    for axis, names in dropped_axes(cfg, mesh).items():
        warnings.warn(f"mesh {axis}={mesh.shape[axis]} does not divide the dims of {len(names)} param leaves, which "
                      f"stay whole over it (e.g. {', '.join(names[:3])})", stacklevel=3)
    return lambda slot: param_sharding(cfg, slot, mesh)


def random_element(cfg: LingConfig, seed: int) -> Callable[[ParamSlot, tuple[int, ...]], np.ndarray]:
    """One element of a freshly initialised leaf, reproducible from (seed, leaf, element index).

    The reference's initialisation (ARCHITECTURE.md §2.9): linear weights N(0, initializer_range),
    norms 1, A_log = log U(1, 16), dt_bias and expert_bias 0, conv and router weights
    kaiming-uniform (bound 1/sqrt(fan_in)). Host numpy, so it costs no compilation.
    """
    slot_ids = {slot.path: i for i, slot in enumerate(param_slots(cfg))}

    def element(slot: ParamSlot, idx: tuple[int, ...]) -> np.ndarray:
        shape = slot.shape[len(slot.stack_shape):]
        kind = slot.leaf.init
        if kind in ("ones", "zeros"):
            return (np.ones if kind == "ones" else np.zeros)(shape, np.float32)
        rng = np.random.default_rng([seed, slot_ids[slot.path], *idx])
        if kind == "a_log":
            return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        if kind in ("conv", "router"):
            bound = 1.0 / math.sqrt(shape[-1] if kind == "conv" else shape[-2])
            return rng.uniform(-bound, bound, shape).astype(np.float32)
        return (cfg.initializer_range * rng.standard_normal(shape, np.float32)).astype(np.float32)

    return element


def init_params(cfg: LingConfig, seed: int = 0, dtype: Any = jnp.float32,
                mesh: jax.sharding.Mesh | None = None) -> Params:
    """Random params (see `random_element`) for tests, demos and training from scratch.

    With `mesh`, every array is created directly in its sharding (each device generates only its
    shard's elements), so models larger than one device can be initialised.
    """
    return materialize(cfg, random_element(cfg, seed), dtype, default_sharding(cfg, mesh))


def layer_params(cfg: LingConfig, params: Params, i: int) -> Params:
    """The (unstacked) params of main or MTP layer `i`."""
    for st in layer_stacks(cfg):
        hits = np.argwhere(st.layers == i)
        if len(hits):
            idx = tuple(int(x) for x in hits[0])
            return jax.tree.map(lambda a, idx=idx: a[idx], get_path(params, st.path))
    raise IndexError(f"layer {i} is not in this model")

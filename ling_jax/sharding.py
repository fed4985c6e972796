"""Mesh construction and the one table of PartitionSpecs (DESIGN.md "Sharding: one table, logical roles").

The mesh has four named axes, always in this order:

    data    pure data parallelism: shards tokens, replicates every param
    fsdp    shards tokens *and* the "model" dim of every large param (ZeRO-3 style: GSPMD gathers
            a weight where it is used)
    expert  shards the experts of every MoE layer; outside the MoE dispatch it shards tokens like
            `data` (so attention is not computed redundantly on the expert axis)
    tensor  Megatron-style tensor parallelism: heads of attention, the intermediate width of MLPs
            and experts, the vocabulary of the lm_head

Every param leaf gets a *role* from its path in the param pytree (`role_of`), every role a
per-dimension tuple of mesh axes (`ROLES`). Stacked layer axes (the leading `[n_layers]` /
`[n_groups, G-1]` axes of a stack) are never sharded. A dimension whose size is not divisible by
its axes' size falls back to replicated on those axes (one by one from the last), so odd tiny
shapes still run on any mesh. Activations have roles too (`act_btd`, `tokens_bt`, ...); layer code
refers to roles (`constrain`), never to axis names, except the MoE `shard_map` in layers/moe.py and
`per_shard` (the Pallas kernels once per shard).

Specs depend only on the mesh's axis *sizes*, so the same table serves a real `Mesh`, an
`AbstractMesh` inside jit, and the memory plan (ling_jax/memory.py) of machines we do not have.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ling_jax.config import LingConfig

AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the axes that shard tokens (batch rows, or flattened tokens)

AxisSpec = str | tuple[str, ...] | None

# role -> one entry per dimension of the leaf (stack axes excluded) or of the activation.
ROLES: dict[str, tuple[AxisSpec, ...]] = {
    # ---- params
    "replicated": (),  # norms, expert_bias, o_norm: small, needed whole by every token
    "embed": ("fsdp", None),  # [V, D]: vocabulary rows over fsdp (GSPMD: masked local gather + all-reduce)
    "lm_head": ("fsdp", "tensor"),  # [D, V]: vocabulary-parallel logits
    "in_proj": ("fsdp", "tensor"),  # [D, X] column-parallel: KDA q/k/v/f/g/b, MLA q/g, MLP gate/up
    "out_proj": ("tensor", "fsdp"),  # [X, D] row-parallel: KDA o_proj, MLA dense, MLP down
    "lora_a": ("fsdp", None),  # [D, r] into a small rank: MLA q_a/kv_a, KDA f_a/g_a, MTP eh_proj
    "lora_b": ("fsdp", "tensor"),  # [r, X] out of a small rank: MLA q_b/kv_b, KDA f_b/g_b
    "router": ("fsdp", None),  # [D, E] fp32: FSDP-style, GSPMD gathers it for the logits matmul
    "head_vec": ("tensor",),  # per-head/per-channel vectors of KDA: A_log [H], dt_bias [P]
    "conv": ("tensor", None),  # KDA depthwise conv [P, W]
    "expert_in": ("expert", "fsdp", "tensor"),  # routed gate/up [E, D, I]
    "expert_out": ("expert", "tensor", "fsdp"),  # routed down [E, I, D]
    # ---- activations
    "tokens_bt": (BATCH_AXES, None),  # ids, masks, labels [B, T]
    "act_btd": (BATCH_AXES, None, None),  # residual stream [B, T, D]
    "act_btv": (BATCH_AXES, None, "tensor"),  # logits [B, T, V]
    "act_nd": (BATCH_AXES, None),  # flattened tokens [N, D] (MoE dispatch)
    "act_nk": (BATCH_AXES, None),  # router choices/weights [N, k], logits [N, E]
    # ---- decode caches (cache.py layouts)
    "kda_state": (BATCH_AXES, "tensor", None, None),  # [B, H, K, V] f32: heads follow the KDA projections
    "kda_conv": (BATCH_AXES, None, "tensor"),  # [B, W-1, 3P]
    "mla_latent": (BATCH_AXES, None, None),  # [B, S, r + d_r]: one latent shared by all heads, not split
    "mla_pages": (None, None, None),  # [P, K, r + d_r]: a page pool every row reads through its table: whole
    "cache_rows": (BATCH_AXES,),  # [B] per-row vectors of a cache (lengths, the engine's last tokens): with the rows
    # a store of KDA states read and written one row at a time at a traced index (the serving engine's
    # prefix snapshots): rows whole (a slice of a split axis at a traced index gathers the axis), heads over tensor
    "kda_state_store": (None, "tensor", None, None),  # [R, H, K, V] f32
    "kda_conv_store": (None, None, "tensor"),  # [R, W-1, 3P]
}

# leaf name (last element of a ParamSlot.path) -> role; expert leaves are told apart by `Leaf.experts`.
NAME_ROLES: dict[str, str] = {
    "embed": "embed", "lm_head": "lm_head",
    "input_norm": "replicated", "post_attn_norm": "replicated", "final_norm": "replicated",
    "enorm": "replicated", "hnorm": "replicated", "o_norm": "replicated", "q_a_norm": "replicated",
    "kv_a_norm": "replicated", "router": "router", "expert_bias": "replicated",
    "q_proj": "in_proj", "k_proj": "in_proj", "v_proj": "in_proj", "f_proj": "in_proj", "g_proj": "in_proj",
    "b_proj": "in_proj", "gate_proj": "in_proj", "up_proj": "in_proj",
    "shared_gate_proj": "in_proj", "shared_up_proj": "in_proj",
    "o_proj": "out_proj", "dense": "out_proj", "down_proj": "out_proj", "shared_down_proj": "out_proj",
    "q_a_proj": "lora_a", "kv_a_proj": "lora_a", "f_a_proj": "lora_a", "g_a_proj": "lora_a", "eh_proj": "lora_a",
    "q_b_proj": "lora_b", "kv_b_proj": "lora_b", "f_b_proj": "lora_b", "g_b_proj": "lora_b",
    "A_log": "head_vec", "dt_bias": "head_vec",
    "q_conv": "conv", "k_conv": "conv", "v_conv": "conv",
}
EXPERT_ROLES = {"gate_proj": "expert_in", "up_proj": "expert_in", "down_proj": "expert_out"}


def make_mesh(*, data: int | None = None, fsdp: int | None = None, expert: int | None = None,
              tensor: int | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A `Mesh` over ("data", "fsdp", "expert", "tensor") with Auto axis types.

    The product of the sizes given (1 for those not given) is the number of devices used. With no
    size given, all devices go on `data`. `devices` (a sequence or an array of devices) defaults to
    `jax.devices()` (all processes' devices); in a single process a smaller product takes the first
    devices, in several it must match exactly.
    """
    given = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
    sizes = {}
    for name, n in given.items():
        if n is None:
            sizes[name] = 1
            continue
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"make_mesh: {name}={n!r} must be a positive integer")
        sizes[name] = int(n)
    explicit = devices is not None
    devs = jax.devices() if devices is None else devices
    devs = list(np.asarray(devs if isinstance(devs, np.ndarray) else list(devs), dtype=object).reshape(-1))
    if not devs:
        raise ValueError("make_mesh: devices= is empty")
    if len({id(d) for d in devs}) != len(devs):
        raise ValueError("make_mesh: devices= names a device more than once")
    n_used = math.prod(sizes.values())
    if all(n is None for n in given.values()):
        sizes["data"] = n_used = len(devs)
    if n_used > len(devs) or (n_used < len(devs) and (explicit or jax.process_count() > 1)):
        raise ValueError(f"make_mesh: data*fsdp*expert*tensor = {n_used} but {len(devs)} devices "
                         f"{'were given' if explicit else 'are available'}")
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devs[:n_used])


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,expert=4' -> {"data": 2, "expert": 4}; ValueError naming the bad part."""
    sizes: dict[str, int] = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        name, eq, n = part.partition("=")
        if not eq or name not in AXES or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--mesh: {part!r} is not axis=size with an axis of {', '.join(AXES)}")
        sizes[name] = int(n)
    return sizes


def check_mesh(mesh: Mesh | jax.sharding.AbstractMesh) -> None:
    """Refuses a mesh on which the sharding table would not do what its user meant: an axis of size > 1
    outside AXES (a typo would leave everything whole on every device; a shard_map's Manual axes
    pass), or Explicit axes of size > 1 (`jax.make_mesh`'s default, whose sharding-in-types our
    shard_maps and constraints do not follow)."""
    axes = list(zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True))
    # Manual axes are those of a shard_map the call runs inside (its own names are the caller's business)
    unknown = {a: int(n) for a, n, t in axes if a not in AXES and n > 1 and t != AxisType.Manual}
    if unknown:
        raise ValueError(f"mesh axes {unknown} are not among {AXES}: nothing would be split over them")
    explicit = [a for a, n, t in axes if t == AxisType.Explicit and n > 1]
    if explicit:
        raise ValueError(f"mesh axes {explicit} are Explicit (jax.make_mesh's default); ling-jax places arrays by "
                         "its sharding table on Auto axes: build the mesh with ling_jax.make_mesh, or pass "
                         "axis_types=(jax.sharding.AxisType.Auto,) * n to jax.make_mesh")


def dropped_axes(cfg: LingConfig, mesh: Mesh) -> dict[str, list[str]]:
    """{axis: names of the param leaves it does not split} for each axis of size > 1 that the table
    asks to split a leaf over but that does not divide the leaf's dim (`fit_spec`'s fallback: the
    leaf is whole on every device of that axis)."""
    from ling_jax.params import param_slots

    sizes = axis_sizes(mesh)
    out: dict[str, list[str]] = {}
    for slot in param_slots(cfg):
        dims = ROLES[role_of(slot.path, slot.leaf.experts)]
        wanted = {a for d in dims for a in ((d,) if isinstance(d, str) else (d or ())) if sizes[a] > 1}
        got = param_spec(cfg, slot, mesh)
        used = {a for d in got for a in ((d,) if isinstance(d, str) else (d or ()))}
        for a in sorted(wanted - used):
            out.setdefault(a, []).append(".".join(str(p) for p in slot.path))
    return out


def axis_sizes(mesh: Mesh | jax.sharding.AbstractMesh | Mapping[str, int] | None) -> dict[str, int]:
    """{axis: size} for our four axes (absent axes, or no mesh: 1)."""
    if mesh is None:
        return dict.fromkeys(AXES, 1)
    shape = dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)
    return {a: int(shape.get(a, 1)) for a in AXES}


def fit_spec(shape: Sequence[int], dims: Sequence[AxisSpec], sizes: Mapping[str, int]) -> PartitionSpec:
    """PartitionSpec for `shape` from per-dim axes, dropping (last first) axes that do not divide the dim.

    `dims` may be shorter than `shape`: it applies to the trailing dims (leading stack axes stay None).
    Axes of size 1 are dropped too, so specs only name axes that actually split something.
    """
    lead = len(shape) - len(dims)
    if lead < 0:
        raise ValueError(f"spec {tuple(dims)} has more entries than shape {tuple(shape)}")
    out: list[AxisSpec] = [None] * lead
    for n, ax in zip(shape[lead:], dims, strict=True):
        names = [a for a in ((ax,) if isinstance(ax, str) else (ax or ())) if sizes.get(a, 1) > 1]
        while names and n % math.prod(sizes[a] for a in names):
            names.pop()
        out.append(None if not names else names[0] if len(names) == 1 else tuple(names))
    return PartitionSpec(*out)


def role_of(path: Sequence[Any], experts: bool = False) -> str:
    """The sharding role of a param leaf at `path` (a `ParamSlot.path` or a layer-dict path)."""
    name = next((k for k in reversed(path) if isinstance(k, str)), None)
    if experts:
        if name not in EXPERT_ROLES:
            raise KeyError(f"no sharding role for expert leaf {path!r}: add it to EXPERT_ROLES")
        return EXPERT_ROLES[name]
    if name not in NAME_ROLES:
        raise KeyError(f"no sharding role for param {path!r}: add its name to ling_jax.sharding.NAME_ROLES")
    return NAME_ROLES[name]


def spec(role: str, shape: Sequence[int], mesh: Mesh | jax.sharding.AbstractMesh | Mapping[str, int] | None
         ) -> PartitionSpec:
    """The table's PartitionSpec of `role` for an array of `shape` on `mesh` (divisibility fallback applied)."""
    if role not in ROLES:
        raise KeyError(f"unknown sharding role {role!r}; known: {sorted(ROLES)}")
    dims = ROLES[role]
    if not dims:
        return PartitionSpec()
    return fit_spec(shape, dims, axis_sizes(mesh))


def param_spec(cfg: LingConfig, slot: Any, mesh: Mesh | jax.sharding.AbstractMesh | Mapping[str, int] | None
               ) -> PartitionSpec:
    """PartitionSpec of one `ParamSlot` (stack axes unsharded). An attention mixer's leaves split over
    `tensor` only where it divides the head count: a split through a head would make GSPMD regather
    the projection's whole output before every per-head reshape."""
    sizes = axis_sizes(mesh)
    if "attn" in slot.path and cfg.num_attention_heads % sizes["tensor"]:
        sizes["tensor"] = 1
    return spec(role_of(slot.path, slot.leaf.experts), slot.shape, sizes)


def param_sharding(cfg: LingConfig, slot: Any, mesh: Mesh) -> NamedSharding:
    """`NamedSharding` of one `ParamSlot` on `mesh` (what `params.materialize` creates arrays with)."""
    return NamedSharding(mesh, param_spec(cfg, slot, mesh))


def param_shardings(cfg: LingConfig, mesh: Mesh) -> Any:
    """The param pytree of `NamedSharding`s (e.g. `jit` out_shardings, Orbax restore targets)."""
    from ling_jax.params import build_tree

    return build_tree(cfg, lambda slot: param_sharding(cfg, slot, mesh))


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Sharding of a batch array [B, ...]: rows over the token axes (data, fsdp, expert) that divide B."""
    return NamedSharding(mesh, fit_spec(shape, (BATCH_AXES,) + (None,) * (len(shape) - 1), axis_sizes(mesh)))


def context_mesh() -> jax.sharding.AbstractMesh | None:
    """The mesh set by `jax.set_mesh` (inside jit: its abstract mesh), or None when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    check_mesh(mesh)
    return mesh


def warn_without_mesh(params: Any) -> None:
    """Warns when `params` (outside jit) are sharded over several devices but no mesh is set: the
    results are right, but the MoE then runs without expert parallelism (`jax.set_mesh` sets one)."""
    leaf = next(iter(jax.tree.leaves(params)), None)
    if context_mesh() is not None or leaf is None or isinstance(leaf, jax.core.Tracer):
        return
    sh = getattr(leaf, "sharding", None)
    if isinstance(sh, NamedSharding) and sh.mesh.size > 1:
        warnings.warn(f"params are sharded over {sh.mesh.size} devices but no mesh is set: activations are not "
                      "placed by the sharding table and the MoE runs without expert parallelism; call under "
                      "`with jax.set_mesh(mesh)`", stacklevel=3)


def multi_device(mesh: jax.sharding.AbstractMesh | None) -> bool:
    """Whether `mesh` (e.g. `context_mesh()`) spreads work over more than one device."""
    return mesh is not None and mesh.size > 1


def per_shard(fn: Callable[..., Any], args: Mapping[str, jax.Array], dims: Mapping[str, str], out_dims: Any, *,
              batch: int, heads: int = 1) -> Any:
    """`fn(**args)` run once per shard of the context mesh in a `shard_map` — how a Pallas kernel
    (which GSPMD cannot partition) runs on sharded activations; plainly without a multi-device mesh.

    `dims[name]` and the strings of the `out_dims` pytree give each dim of an argument / result: "b"
    batch rows over the token axes, "h" heads over `tensor`, "." whole (`fit_spec` drops axes that do
    not divide `batch` / `heads`). These are the layouts the table gives decode caches and
    per-head activations, so nothing moves but what a dim's "." gathers.
    """
    mesh = context_mesh()
    if not multi_device(mesh):
        return fn(**args)
    sizes = axis_sizes(mesh)
    axes = {"b": fit_spec((batch,), (BATCH_AXES,), sizes)[0], "h": fit_spec((heads,), ("tensor",), sizes)[0]}

    def to_spec(d: str) -> PartitionSpec:
        return PartitionSpec(*(axes.get(c) for c in d))

    specs = {k: to_spec(dims[k]) for k in args}
    return jax.shard_map(lambda a: fn(**a), mesh=mesh, in_specs=(specs,), out_specs=jax.tree.map(to_spec, out_dims),
                         check_vma=False)(dict(args))


def constrain(x: jax.Array, role: str) -> jax.Array:
    """`with_sharding_constraint` of `x` to its role's spec on the context mesh; identity without one."""
    mesh = context_mesh()
    if not multi_device(mesh):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(role, x.shape, mesh)))

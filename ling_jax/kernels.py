"""The one place that picks implementations: which kernel each hot path runs, and its tuned constants.

`select(config, ...)` resolves the config's implementation strings (`kda_impl`, `moe_impl`,
`attention_impl`, `decode_impl`; "auto" included) against the platform, the context mesh and the
call's shapes into a `Kernels` record, once per call, outside jit; the jitted model functions take
the record as a static argument and the layers read their choices from it. Nothing below this
module probes the platform or the mesh to choose a path.

What is chosen here and what at lowering time:
- "auto" resolves here, for the platform the call runs on (`jax.default_backend()`, or the
  `platform` argument): the fastest path there that is exact for the config.
- A kernel of the sequence forms (training, forward, prefill) that is named ("pallas") keeps its
  name, and its backend is chosen when the program is lowered (`jax.lax.platform_dependent`, in
  `ops.platform`): Triton on CUDA, Mosaic on TPU where the kernel has a TPU form, the interpreter
  on CPU. So a model exported with `jax.export` for a platform other than the host's
  (`kda_impl="pallas"`) carries that platform's kernels.
- The decode step's kernels are GPU kernels (Triton): compiled where the record is for a GPU (the
  host's platform, or `platform="gpu"`), interpreted elsewhere (`Launch.interpret`), with no
  per-platform branch around each of the step's launches.

Tuned constants (program counts sized for a GPU's SMs, the decode step's L2 prefetch, the size
limits of the decode-sized paths) live in one table keyed by device kind, `TUNED`; `tuned(...)`
overrides them for a block of code (the benchmarks' variants), and since the record is a static
argument, a different value compiles a different program.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp

from ling_jax.config import LingConfig
from ling_jax.ops import expert_gemv, short_conv
from ling_jax.ops.kda import decode_layer
from ling_jax.ops.kda.api import DEFAULT_CHUNK
from ling_jax.ops.kda.pallas_chunk import bounded_gate
from ling_jax.ops.kda.pallas_chunk import supports as kda_supports
from ling_jax.ops.pallas_gpu import DEFAULT_LAUNCH, Launch
from ling_jax.sharding import context_mesh, multi_device

Platform = Literal["cpu", "gpu", "tpu"]


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Constants tuned per device kind (`TUNED`).

    launch: the decode kernels' launch shapes (`ops.pallas_gpu.Launch`: program counts sized to keep
        every SM busy, the gemv's L2 eviction policy).
    prefetch_shared: the batch-1 step's expert selection reads the stacked shared expert into L2
        for the gemvs after it (`ops.l2_prefetch`).
    gather_max_copies: token copies (N x k) up to which a MoE call takes the decode-sized paths.
    route_max_tokens: tokens up to which the expert selection may run its kernel.
    """

    launch: Launch = DEFAULT_LAUNCH
    prefetch_shared: bool = True
    gather_max_copies: int = 64
    route_max_tokens: int = 512


# device kind (a substring of `jax.Device.device_kind`) -> its tuning; the first match wins. The
# H100 and H200 have 132 SMs each: one table entry serves both.
TUNED: dict[str, Tuning] = {"H200": Tuning(), "H100": Tuning()}
DEFAULT_TUNING = Tuning()
_LAUNCH_FIELDS = {f.name for f in dataclasses.fields(Launch)}
_TUNING_FIELDS = {f.name for f in dataclasses.fields(Tuning)} - {"launch"}

_overrides: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = contextvars.ContextVar("tuning_overrides",
                                                                                        default=())


@contextlib.contextmanager
def tuned(**overrides: Any) -> Iterator[None]:
    """Within the block, `select` returns records whose tuning has these fields replaced (fields of
    `Tuning` or of its `Launch`, by name)."""
    unknown = set(overrides) - _TUNING_FIELDS - _LAUNCH_FIELDS
    if unknown:
        raise ValueError(f"tuned(): unknown fields {sorted(unknown)}; known: {sorted(_TUNING_FIELDS | _LAUNCH_FIELDS)}")
    token = _overrides.set(tuple({**dict(_overrides.get()), **overrides}.items()))
    try:
        yield
    finally:
        _overrides.reset(token)


def tuning_for(device_kind: str) -> Tuning:
    """The table's tuning for a device kind (with the overrides of an enclosing `tuned` block)."""
    base = next((t for kind, t in TUNED.items() if kind in device_kind), DEFAULT_TUNING)
    over = dict(_overrides.get())
    launch = dataclasses.replace(base.launch, **{k: v for k, v in over.items() if k in _LAUNCH_FIELDS})
    return dataclasses.replace(base, launch=launch, **{k: v for k, v in over.items() if k in _TUNING_FIELDS})


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which implementation each hot path runs in one call (hashable: a static jit argument).

    kda: the KDA recurrence over sequences ("reference" | "chunked" | "pallas").
    conv: KDA's short conv over sequences ("xla" | "pallas": its kernels beside the Pallas KDA).
    attention: MLA attention over sequences ("xla" | "pallas": the fused flash kernels).
    moe_small / moe_large: the routed experts' implementation (`ops.moe.IMPLS`, resolved) for calls of
        up to / more than `tuning.gather_max_copies` token copies (`moe_for`).
    route: the expert selection runs its kernel (`ops.route_pallas`) on calls of up to
        `tuning.route_max_tokens` tokens (`route_for`).
    router_precision: "bf16_x6" (six bf16 tensor-core passes: GPU) or "highest" (float32 elsewhere).
    logsumexp: the loss's row log-sum-exp ("xla" | "pallas").
    decode_kda / decode_mla: the decode step's KDA and latent-attention kernels.
    decode_proj: the decode step's projections read from their layer stacks (batch-1 gemv kernel,
        few-row matmul), with the norms, router and KDA layer kernel that ride on them.
    expert_stacks: the decode step hands the routed experts to the gemv kernel as stacks.
    inference: nothing differentiates the call (prefill, decode): the aligned MoE's dispatch then
        writes only the copies' rows.
    sharded: the context mesh has several devices.
    tuning: the tuned constants of the device (`TUNED`).
    """

    kda: str = "chunked"
    conv: str = "xla"
    attention: str = "xla"
    moe_small: str = "gather"
    moe_large: str = "ragged"
    route: bool = False
    router_precision: str = "highest"
    logsumexp: str = "xla"
    decode_kda: bool = False
    decode_mla: bool = False
    decode_proj: bool = False
    expert_stacks: bool = False
    inference: bool = False
    sharded: bool = False
    tuning: Tuning = DEFAULT_TUNING

    def route_for(self, tokens: int) -> bool:
        """Whether the expert selection of a call on `tokens` tokens runs its kernel."""
        return self.route and 0 < tokens <= self.tuning.route_max_tokens

    def moe_for(self, copies: int) -> str:
        """The routed experts' implementation for a call of `copies` token copies (N x k)."""
        return self.moe_small if copies <= self.tuning.gather_max_copies else self.moe_large

    @property
    def precision(self) -> jax.lax.Precision | jax.lax.DotAlgorithmPreset:
        """The router matmul's precision argument."""
        return (jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6 if self.router_precision == "bf16_x6"
                else jax.lax.Precision.HIGHEST)


def _device() -> tuple[Platform, float, str]:
    """(platform, CUDA compute capability or 0, device kind) of the default device."""
    dev = jax.devices()[0]
    cc = 0.0
    if dev.platform == "gpu":
        try:
            cc = float(getattr(dev, "compute_capability", "0"))
        except ValueError:  # ROCm's gfx names
            cc = 0.0
    return dev.platform, cc, getattr(dev, "device_kind", "")


def moe_impls(cfg: LingConfig, *, platform: Platform, cc: float, dtype: Any, stacks: bool) -> tuple[str, str]:
    """The routed experts' implementations (for decode-sized calls, for larger ones): the config's
    impl, or for "auto" the gemv kernel where the decode step hands over expert stacks, else XLA's
    gather, and beyond the decode sizes the aligned Mosaic-GPU grouped matmul on sm90 for 16-bit
    activations, megablox on TPU, `ragged_dot` elsewhere. "gemv" is a decode kernel: larger calls
    run what "auto" picks for them."""
    impl = cfg.moe_impl
    if platform == "tpu":
        large = "gmm"
    elif platform == "gpu" and 9.0 <= cc < 10.0 and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        large = "aligned"
    else:
        large = "ragged"
    if impl == "auto":
        return ("gemv" if stacks else "gather"), large
    return impl, (large if impl == "gemv" else impl)


def select(cfg: LingConfig, *, dtype: Any, inference: bool = False, decode: bool = False, unroll: bool = False,
           mesh: Any = None, platform: Platform | None = None) -> Kernels:
    """The `Kernels` record of a call with activations of `dtype`.

    `inference`: nothing differentiates the call (a prefill; implied by `decode`). `decode`: the call is
    a decode step (one token per row, against caches); `unroll`: its layers
    are unrolled (the views of layer stacks that the decode kernels read in place exist only then,
    and only on one device). `mesh`: the mesh the call runs under (default: the context mesh set by
    `jax.set_mesh`). `platform`: what "auto" resolves for (default: the default backend's).
    """
    plat, cc, kind = _device()
    if platform is not None:
        plat, cc = platform, (9.0 if platform == "gpu" else 0.0)
    gpu = plat == "gpu" and cc >= 8.0  # Triton's bf16 dots; other GPUs keep the XLA forms
    sharded = multi_device(context_mesh() if mesh is None else mesh)
    tuning = tuning_for(kind)
    if tuning.launch.interpret is None:  # the decode kernels: compiled for a GPU, interpreted elsewhere
        tuning = dataclasses.replace(tuning, launch=dataclasses.replace(tuning.launch, interpret=plat != "gpu"))
    auto_kda = bounded_gate(cfg.kda_lower_bound) and kda_supports(DEFAULT_CHUNK, cfg.head_dim, cfg.head_dim)
    kda = cfg.kda_impl if cfg.kda_impl != "auto" else ("pallas" if auto_kda and plat in ("gpu", "tpu") else "chunked")
    conv = "pallas" if kda == "pallas" and not sharded and short_conv.supports(cfg.kda_dim, 3) else "xla"
    attention = cfg.attention_impl if cfg.attention_impl != "auto" else (
        "pallas" if gpu and jnp.dtype(dtype).itemsize == 2 and cfg.pallas_widths("attention") else "xla")

    def decode_kernel(mixer: Literal["kda", "mla"]) -> bool:  # a config naming "pallas" has the widths
        return decode and (cfg.decode_impl == "pallas" or (cfg.decode_impl == "auto" and gpu
                                                           and cfg.pallas_widths(mixer)))

    decode_kda, decode_mla = decode_kernel("kda"), decode_kernel("mla")
    views = decode and unroll and not sharded  # layer stacks read in place by the decode kernels
    decode_proj = views and (cfg.decode_impl == "pallas" or (cfg.decode_impl == "auto" and gpu))
    tiles = (expert_gemv.supported(cfg.hidden_size, cfg.moe_intermediate_size)
             and expert_gemv.supported(cfg.moe_intermediate_size, cfg.hidden_size))
    # the gemv kernel is fast only on the stacks in place, and only a GPU runs it compiled
    stacks = views and tiles and (cfg.moe_impl == "gemv" or (cfg.moe_impl == "auto" and gpu))
    moe_small, moe_large = moe_impls(cfg, platform=plat, cc=cc, dtype=dtype, stacks=stacks)
    route = cfg.decode_impl != "xla" and not sharded and (cfg.decode_impl == "pallas" or gpu)
    return Kernels(
        kda=kda, conv=conv, attention=attention, moe_small=moe_small, moe_large=moe_large, route=route,
        router_precision="bf16_x6" if gpu else "highest",
        logsumexp="pallas" if gpu and not sharded else "xla",
        decode_kda=decode_kda, decode_mla=decode_mla, decode_proj=decode_proj,
        expert_stacks=stacks and moe_small == "gemv", inference=inference or decode, sharded=sharded, tuning=tuning)


def kda_layer_kernel(cfg: LingConfig, kernels: Kernels) -> bool:
    """Whether the decode step runs a KDA layer's conv, gate and recurrence as one kernel on the
    cache stacks (`ops.kda.decode_layer`): the decode kernels on layer-stack views."""
    return (kernels.decode_kda and kernels.decode_proj
            and decode_layer.supported(cfg.head_dim, cfg.head_dim, cfg.short_conv_kernel_size))

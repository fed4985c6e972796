"""Plumbing shared by the Pallas kernels (Triton lowering on GPU, interpret mode elsewhere; operand padding)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl


def on_gpu() -> bool:
    """Whether "auto" picks the decode-step kernels: on an NVIDIA GPU of compute capability 8.0 or
    newer (Triton's bf16 dots; timed on an H200), under a multi-device mesh per shard
    (`sharding.per_shard`). Other GPUs (older, or ROCm's gfx names) keep the XLA forms."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return False
    try:
        return float(getattr(dev, "compute_capability", "0")) >= 8.0
    except ValueError:
        return False


def one_gpu() -> bool:
    """`on_gpu` without a multi-device context mesh: where "auto" picks the routed-expert gemv kernel
    (under a mesh the experts run in the MoE's own shard_map, on the XLA paths)."""
    from ling_jax.sharding import context_mesh, multi_device

    return on_gpu() and not multi_device(context_mesh())


def is_pow2(n: int) -> bool:
    """Triton's rule for every loaded or computed block dimension."""
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    """The smallest power of two >= n: a Triton block that holds n values (the rest padding)."""
    return 1 << max(0, n - 1).bit_length()


def pow2_tile(n: int, cap: int, least: int) -> int | None:
    """The largest power of two in [least, cap] dividing n (a Triton block over n), or None."""
    t = cap
    while t >= least:
        if n % t == 0:
            return t
        t //= 2
    return None


def pad_axis(a: jax.Array, axis: int, multiple: int) -> jax.Array:
    """`a` zero-padded at the end of `axis` to a multiple of `multiple` (a kernel's tile)."""
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


INDEX_SENTINEL = -1  # ends every static index operand; no kernel reads it (`index_operand`)


def index_operand(values: list | np.ndarray) -> np.ndarray | jax.Array:
    """Indices (ints, numpy or traced int32 scalars) as one int32 kernel operand, [n] or more: a
    numpy constant where every value is one (the unrolled decode step's layer indices, a gemv's
    static rows), else stacked in XLA. A constant ends with `INDEX_SENTINEL`, which no kernel reads:
    XLA rewrites a constant whose values are all equal into a broadcast, and 0, 1, ..., n-1 into an
    iota, and a custom call's operand must be materialised, so either would be a launch of its own
    in every step (0.8-1.0 us each; a KDA layer's four equal layer indices were one per layer)."""
    if all(isinstance(v, (int, np.integer, np.ndarray)) for v in values):
        return np.append(np.asarray(values, np.int32).reshape(len(values)), np.int32(INDEX_SENTINEL))
    return jnp.stack([jnp.asarray(v, jnp.int32).reshape(()) for v in values])


def whole(a: jax.Array | jax.ShapeDtypeStruct) -> pl.BlockSpec:
    """One block holding all of `a` (a pointer the kernel indexes itself, e.g. by a loaded expert id)."""
    return pl.BlockSpec(a.shape, lambda *_, n=a.ndim: (0,) * n)


def call_options(interpret: bool | None, *, num_warps: int, num_stages: int) -> dict[str, Any]:
    """`pl.pallas_call` keywords: interpret mode off GPU (or as asked), else Triton's compiler params."""
    if jax.default_backend() != "gpu" if interpret is None else interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as pltriton

    return {"interpret": False, "compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}

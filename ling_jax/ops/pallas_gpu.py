"""Plumbing shared by the GPU-only Pallas kernels: `triton_call` (Triton on a GPU, interpret mode
elsewhere, chosen at lowering), index operands, tiles and operand padding."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling_jax.ops.platform import GPU_PLATFORMS, on_platform


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


@dataclasses.dataclass(frozen=True)
class Launch:
    """Tuned launch shapes of the decode kernels (`ling_jax.kernels.TUNED` holds one per device kind).

    gemv_programs: least programs of a gemv launch (`ops.expert_gemv`: narrower output tiles below).
    gemv_eviction: Triton's L2 eviction policy for the gemv's weight tiles (None: the default).
    kda_programs: least programs of the KDA decode kernels (`ops.kda.decode*`: narrower V blocks below).
    latent_programs: programs the latent-attention kernel aims at (how finely it splits the cache).
    stack_programs: programs the few-row stack matmul aims at (`ops.stack_matmul`).
    interpret: the kernels compiled (False), interpreted (True), or chosen where the program is lowered
        (None, `triton_call`); a kernel's own `interpret` argument, where given, wins.
    """

    gemv_programs: int = 264
    gemv_eviction: str | None = "evict_first"
    kda_programs: int = 132
    latent_programs: int = 264
    stack_programs: int = 264
    interpret: bool | None = None


DEFAULT_LAUNCH = Launch()
INDEX_SENTINEL = -1  # ends every static index operand; no kernel reads it (`index_operand`)


def index_operand(values: list | np.ndarray) -> np.ndarray | jax.Array:
    """Indices (ints, numpy or traced int32 scalars) as one int32 kernel operand, [n] or more: a
    numpy constant where every value is one (the unrolled decode step's layer indices, a gemv's
    static rows), else stacked in XLA. A constant ends with `INDEX_SENTINEL`, which no kernel reads:
    XLA rewrites a constant whose values are all equal into a broadcast, and 0, 1, ..., n-1 into an
    iota, and a custom call's operand must be materialised, so either would be a launch of its own
    in every step (a KDA layer's four equal layer indices among them; docs/decode-performance.md)."""
    if all(isinstance(v, (int, np.integer, np.ndarray)) for v in values):
        return np.append(np.asarray(values, np.int32).reshape(len(values)), np.int32(INDEX_SENTINEL))
    return jnp.stack([jnp.asarray(v, jnp.int32).reshape(()) for v in values])


def whole(a: jax.Array | jax.ShapeDtypeStruct) -> pl.BlockSpec:
    """One block holding all of `a` (a pointer the kernel indexes itself, e.g. by a loaded expert id)."""
    return pl.BlockSpec(a.shape, lambda *_, n=a.ndim: (0,) * n)


def triton_call(kernel: Callable[..., None], *, interpret: bool | None, num_warps: int, num_stages: int,
                **kwargs: Any) -> Callable[..., Any]:
    """`pl.pallas_call(kernel, **kwargs)` with Triton's compiler params where the program is lowered
    for a GPU and interpret mode elsewhere (`ops.platform`), or in interpret mode as `interpret` says."""
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)

    def call(interp: bool) -> Callable[..., Any]:
        if interp:
            return pl.pallas_call(kernel, interpret=True, **kwargs)
        return pl.pallas_call(kernel, interpret=False, compiler_params=params, **kwargs)

    if interpret is not None:
        return call(interpret)
    compiled, interpreted = call(False), call(True)
    return lambda *args: on_platform(lambda p: compiled if p in GPU_PLATFORMS else interpreted, *args)

"""Plumbing shared by the GPU-only Pallas kernels (Triton lowering on GPU, interpret mode elsewhere)."""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import pallas as pl


def auto_picks_kernels() -> bool:
    """Whether "auto" picks these kernels: on a GPU (where they were timed) without a multi-device
    context mesh (GSPMD cannot split a kernel: it would gather the sharded operands to run it)."""
    from ling_jax.sharding import context_mesh

    mesh = context_mesh()
    return jax.default_backend() == "gpu" and (mesh is None or mesh.size == 1)


def is_pow2(n: int) -> bool:
    """Triton's rule for every loaded or computed block dimension."""
    return n > 0 and n & (n - 1) == 0


def whole(a: jax.Array) -> pl.BlockSpec:
    """One block holding all of `a` (a pointer the kernel indexes itself, e.g. by a loaded expert id)."""
    return pl.BlockSpec(a.shape, lambda *_, n=a.ndim: (0,) * n)


def call_options(interpret: bool | None, *, num_warps: int, num_stages: int) -> dict[str, Any]:
    """`pl.pallas_call` keywords: interpret mode off GPU (or as asked), else Triton's compiler params."""
    if jax.default_backend() != "gpu" if interpret is None else interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as pltriton

    return {"interpret": False, "compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}

"""Kernel backends chosen when a program is lowered, not when it is traced.

`on_platform(make, *args)` is `make(platform)(*args)` for the platform the program is lowered for
(`jax.lax.platform_dependent`): "cuda" and "rocm" (the Triton / Mosaic-GPU kernels compiled),
"tpu" (Mosaic TPU, or the XLA form of a GPU-only kernel) and "cpu" (the kernels in interpret mode).
So a function traced on one host and exported with `jax.export` for another platform carries that
platform's kernels; a jitted call lowers only its own platform's branch, which XLA inlines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

# Every branch is traced, the TPU's on a GPU too, and the first import of the Pallas TPU module registers
# a trace-context config state: a jitted call whose tracing imported it keyed its cache before the state
# existed, so its next call would trace and compile again. Imported here, before anything is traced.
import jax.experimental.pallas.tpu

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
GPU_PLATFORMS = ("cuda", "rocm")


def _running() -> tuple[str, ...]:
    """The PLATFORMS names of the default backend."""
    backend = jax.default_backend()
    return GPU_PLATFORMS if backend == "gpu" else (backend,)


def on_platform(make: Callable[[str], Callable[..., Any]], *args: Any) -> Any:
    """`make(p)(*args)` for the lowering platform p in PLATFORMS (any other lowers the "cpu" form).
    Forms that are the same object share one branch.

    Every branch is traced. A form whose arguments its platform refuses (a ValueError while tracing:
    e.g. kernel tiles the TPU cannot take) raises if that is the default backend's platform; on any
    other platform it lowers the "cpu" form (the kernels interpreted) instead, so arguments valid where
    the program runs never fail for a platform it is not run on."""
    running = _running()

    def guarded(p: str, form: Callable[..., Any]) -> Callable[..., Any]:
        if p in running or p == "cpu":
            return form

        def branch(*a: Any) -> Any:
            try:
                return form(*a)
            except ValueError:
                return forms["cpu"](*a)

        return branch

    forms: dict[str, Callable[..., Any]] = {}
    made: list[tuple[Callable[..., Any], Callable[..., Any]]] = []  # (form, the first branch made of it)
    for p in PLATFORMS:
        form = make(p)
        same = next((branch for f, branch in made if f is form), None)
        if same is None:
            same = guarded(p, form)
            made.append((form, same))
        forms[p] = same
    return jax.lax.platform_dependent(*args, default=forms["cpu"], **forms)

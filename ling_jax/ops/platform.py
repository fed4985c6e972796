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

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
GPU_PLATFORMS = ("cuda", "rocm")


def on_platform(make: Callable[[str], Callable[..., Any]], *args: Any) -> Any:
    """`make(p)(*args)` for the lowering platform p in PLATFORMS (any other lowers the "cpu" form).
    Forms that are the same object share one branch."""
    forms: dict[str, Callable[..., Any]] = {}
    made: list[tuple[Callable[..., Any], Callable[..., Any]]] = []  # (form, the first branch made of it)
    for p in PLATFORMS:
        form = make(p)
        same = next((branch for f, branch in made if f is form), None)
        if same is None:
            made.append((form, form))
            same = form
        forms[p] = same
    return jax.lax.platform_dependent(*args, default=forms["cpu"], **forms)

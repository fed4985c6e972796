"""The checkpoint name under which kernels mark what a rematerialisation policy may keep.

A Pallas kernel's output is not a `dot`, so under `dots_with_no_batch_dims_saveable` the backward
pass reruns every kernel whose outputs or residuals it reads (the grouped matmuls, the KDA forward,
the fused attention). The `dots_kernels` policy of `model.REMAT_POLICIES` keeps the values tagged
here as well: the grouped matmuls' outputs and rows, the KDA forward's residuals and the fused
attention's output and log-sum-exp.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

KERNEL_RESIDUAL = "kernel_residual"


def keep(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """`xs`, tagged as saveable kernel outputs (a no-op outside `jax.checkpoint`)."""
    return tuple(checkpoint_name(x, KERNEL_RESIDUAL) for x in xs)

"""One-row projections read straight from their layer stacks (the batch-1 decode step).

At batch 1 every projection of a decode step is a vector-matrix product whose whole cost is reading
the weight. XLA runs each as a split reduction well under the copy rate, and a custom kernel on a
layer's weight sliced from its segment's stack would first copy the slice
(docs/decode-performance.md). So the unrolled decode step (`ling_jax.decode`) hands such weights
over as `WeightStack`s where the `Kernels` record's `decode_proj` says so, and `linear` runs them
through the routed experts' gemv kernel (`ops.expert_gemv.gathered_products`) with the layer as the
expert: one launch that reads the layer's [C, O] rows from the stack in place, plus XLA's sum of the
kernel's partial sums. A layer's RMSNorm before such projections (`normed`) is left to the kernel
too (`expert_gemv.NormedRows`): every program normalises the tile of the row it reads, and the
norm's two XLA launches go. At a few rows (decode at batch > 1) `linear` runs `ops.stack_matmul` on
the stack the same way.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.ops import expert_gemv, stack_matmul
from ling_jax.ops.expert_gemv import GatedRows, NormedRows, dense, normed_rows
from ling_jax.ops.norms import rms_norm
from ling_jax.ops.pallas_gpu import DEFAULT_LAUNCH, Launch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WeightStack:
    """One layer's projection [C, O], left inside its segment's stack [L, C, O]."""

    stack: jax.Array  # [L, C, O]
    layer: jax.Array  # int32 scalar, this layer's index in the stack

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    def value(self) -> jax.Array:
        """The layer's weight as an array (a slice of the stack: XLA copies it for a custom call)."""
        return self.stack[self.layer]


def pad_columns(w: jax.Array) -> jax.Array:
    """w [..., C, O] with zero columns appended up to a multiple of the kernel's widest output tile
    (`expert_gemv.MAX_BO`), for a weight built once per call that the caller slices by its own
    widths. The kernel tiles O by the largest power of two dividing it: a KDA layer's fused input
    projection of Ling-3.0-tiny is 5 x 2048 + 16 columns, which it would read 16 columns (32 bytes
    per row) at a time."""
    pad = -w.shape[-1] % expert_gemv.MAX_BO
    return w if pad == 0 else jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)])


def column_starts(ws: list) -> list[int]:
    """Where each of the weights `ws` (arrays or `WeightStack`s [.., C, O_i]) starts when placed side by
    side in one fused projection, then the total width: [0, O_0, O_0 + O_1, ..., sum O_i]."""
    return [0, *np.cumsum([w.shape[-1] for w in ws]).tolist()]


def normed(x: jax.Array, w: jax.Array | WeightStack, eps: float) -> jax.Array | NormedRows:
    """`rms_norm(x, w, eps)`; with the weight as a `WeightStack` (the batch-1 decode step), the rows
    with the norm left to the gemv kernels that read them (`NormedRows`; `linear` and the MoE take
    them, other consumers call `expert_gemv.dense`)."""
    if isinstance(w, WeightStack):
        return normed_rows(x, w.stack, w.layer, eps)
    return rms_norm(x, w, eps)


def linear(x: jax.Array | NormedRows | GatedRows, w: jax.Array | WeightStack,
           launch: Launch = DEFAULT_LAUNCH) -> jax.Array:
    """x [..., C] @ w [C, O] in x's dtype (float32 accumulation). A `WeightStack` (the decode step's
    views, `ling_jax.decode`) runs the gemv kernel on one row (or on each row, where the few-row
    matmul does not tile the weight), the few-row matmul (`ops.stack_matmul`) on more, both shaped
    by `launch`; an array runs XLA's product."""
    if not isinstance(w, WeightStack):
        x = dense(x)
        return x @ w.astype(x.dtype)
    c, o = w.shape
    rows = math.prod(x.shape[:-1])
    if rows == 1 or not stack_matmul.supported(rows, c, o):  # the gemv kernel, once per row
        return expert_gemv.add_partials(partial_products(x, w, launch)).astype(x.dtype)
    x = dense(x)
    parts_SRO = stack_matmul.partial_products(x.reshape(-1, c), w.stack, w.layer, launch=launch)
    return expert_gemv.add_partials(parts_SRO).astype(x.dtype).reshape(*x.shape[:-1], o)


def partial_products(x: jax.Array | NormedRows | GatedRows, w: WeightStack,
                     launch: Launch = DEFAULT_LAUNCH) -> jax.Array:
    """x [..., C] @ w [C, O] through the gemv kernel before the sum of its split of C: [S, ..., O]
    float32 partial sums (`expert_gemv.gathered_partials`), for a consumer that adds them itself."""
    c, o = w.shape
    if x.shape[-1] != c:
        raise ValueError(f"layer_gemv: x [..., {x.shape[-1]}] does not match a [{c}, {o}] weight")
    rows_RC = x.reshape(-1, c)
    idx_R = jnp.broadcast_to(jnp.asarray(w.layer, jnp.int32), (rows_RC.shape[0],))
    (parts_SRO,) = expert_gemv.gathered_partials(rows_RC, idx_R, (w.stack,), launch=launch)
    return parts_SRO.reshape(parts_SRO.shape[0], *x.shape[:-1], o)

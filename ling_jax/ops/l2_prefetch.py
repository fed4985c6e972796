"""Weights read into the L2 cache by spare programs of a latency-bound decode kernel.

A batch-1 decode step spends a large share of its device time in kernels that move few bytes (the
expert selection, the KDA recurrence, the glue between projections; BENCHMARKS.md, "Where a batch-1
step goes"), while the HBM idles; the weights that the next gemv reads could stream into L2
meanwhile. A kernel that takes `Prefetch`es launches extra programs after its own, each of which
loads one tile of one of those weights with Triton's `evict_last` policy and stores the tile's
maximum to a scratch output (so that the load stays). What is read this way stays in L2 while the
gemvs stream other weights through it with `evict_first`.

A reader pays only while the kernel's own latency hides it: reading more than that window grows the
kernel by more than the next gemv saves. So only the expert selection (`ops.route_pallas`) takes
readers, for the stacked shared expert that the next gemvs read (`kernels.Tuning.prefetch_shared`,
per device kind in `kernels.TUNED`); the KDA layer kernel reading its layer's o_proj is a loss, so
no KDA kernel takes them. The measurements: docs/decode-performance.md ("L2 readers in a
latency-bound kernel"), `bench/experiments/l2_window.py`.

How a kernel takes them: `slabs, kept = plan(prefetch)`; a grid with `programs(slabs)` more
programs than its own (a 1-D grid: n + programs; a larger one: rounded up to whole rows); operands
`operands(kept)` after its own (`in_specs`); one more output, `scratch(slabs)`; its body runs its own
work in its own programs and `read(j, refs, scratch_ref, slabs)` in the others, j numbering them
from 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling_jax.ops.pallas_gpu import index_operand, pow2_tile, whole

TILE = (64, 128)  # the widest [rows, columns] tile one program reads: 16 KB of bf16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefetch:
    """One weight slab to read into L2: stack[index] [C, O], read in place from its stack."""

    stack: jax.Array  # [..., C, O]
    index: tuple  # the slab's leading indices into stack (ints or int32 scalars), len = stack.ndim - 2


@dataclasses.dataclass(frozen=True)
class Slab:
    """The static facts of one `Prefetch` a kernel body needs: its programs [lo, hi), its tile, and
    the number of column tiles."""

    lo: int
    hi: int
    rows: int
    cols: int
    col_tiles: int
    leading: int


def plan(prefetch: tuple[Prefetch, ...]) -> tuple[tuple[Slab, ...], tuple[Prefetch, ...]]:
    """(the static plan: the programs of each slab, one per tile; the prefetches it keeps). Slabs that
    no power-of-two tile >= 8 x 16 divides are left out: prefetching is only ever a speed-up."""
    slabs, kept, lo = [], [], 0
    for p in prefetch:
        c, o = p.stack.shape[-2:]
        if len(p.index) != p.stack.ndim - 2:
            raise ValueError(f"Prefetch: {len(p.index)} indices for a stack of shape {p.stack.shape}")
        br, bo = pow2_tile(c, TILE[0], 8), pow2_tile(o, TILE[1], 16)
        if br is None or bo is None:
            continue
        n = (c // br) * (o // bo)
        slabs.append(Slab(lo, lo + n, br, bo, o // bo, len(p.index)))
        kept.append(p)
        lo += n
    return tuple(slabs), tuple(kept)


def programs(slabs: tuple[Slab, ...]) -> int:
    """How many programs the plan adds to a launch."""
    return slabs[-1].hi if slabs else 0


def operands(kept: tuple[Prefetch, ...]) -> list[Any]:
    """The kernel's extra operands: per kept prefetch its indices (int32 [leading]) and its stack."""
    return [a for p in kept for a in (index_operand(list(p.index)), p.stack)]


def in_specs(ops: list[Any]) -> list[pl.BlockSpec]:
    """Every extra operand whole (the programs index the slab themselves)."""
    return [whole(a) for a in ops]


def scratch(slabs: tuple[Slab, ...]) -> tuple[jax.ShapeDtypeStruct, pl.BlockSpec]:
    """The scratch output and its block: a float32 per reader (its tile's maximum; never used),
    the whole array in every program, so that any grid can host the readers."""
    a = jax.ShapeDtypeStruct((max(programs(slabs), 1),), jnp.float32)
    return a, whole(a)


def read(j: jax.Array, refs: list[Any], scratch_ref: Any, slabs: tuple[Slab, ...]) -> None:
    """Reader j: load its tile of its slab into L2 (`evict_last`) and store the tile's maximum. A j
    past the plan's programs (a grid rounded up) reads nothing."""
    for s, (index_ref, stack_ref) in zip(slabs, zip(refs[::2], refs[1::2], strict=True), strict=True):
        @pl.when((j >= s.lo) & (j < s.hi))
        def _(s=s, index_ref=index_ref, stack_ref=stack_ref):
            t = j - s.lo
            r, c = t // s.col_tiles, t % s.col_tiles
            lead = tuple(index_ref[i] for i in range(s.leading))
            tile_ref = stack_ref.at[(*lead, pl.ds(r * s.rows, s.rows), pl.ds(c * s.cols, s.cols))]
            tile = pltriton.load(tile_ref, eviction_policy="evict_last")
            scratch_ref[pl.ds(j, 1)] = jnp.full((1,), jnp.max(tile.astype(jnp.float32)))

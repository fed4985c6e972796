"""The MoE's aligned dispatch without its padding: each token copy's row written to its slot, and
nothing else.

`ops.moe.dispatch` builds the grouped matmul's [S, D] rows as a gather over all S rows, zero where
a row holds no copy. In the aligned layout (`sorted_rows(aligned=True)`) most rows hold none: at
decode each expert's one or two copies start a 64-row tile, and S covers the worst case
(`aligned_gmm.num_tiles`: 129 tiles, 8,256 rows, 25 MB for 16 tokens x top-8 of Ling-3.0-tiny, where
128 rows hold copies). The grouped matmul never mixes rows, its tiles past the last expert are not
read, and the MoE reads back only the rows of copies: rows without a copy may hold anything when
nothing differentiates the MoE. This kernel writes only the M copies' rows of an uninitialised
[S, D] output (one program per copy and column block), for the dispatch in prefill and decode
(`Kernels.inference`, `ops.moe.dispatch(rows_only=True)`); everywhere else the dispatch keeps
its zero rows (a weight gradient sums over whole tiles).

Triton where the program is lowered for a GPU; interpret mode elsewhere (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ling_jax.ops.pallas_gpu import pow2_tile, triton_call, whole

MAX_BLOCK = 1024  # columns one program copies (a power of two dividing D; Triton's rule)
MIN_BLOCK = 16


def block(d: int) -> int | None:
    """The widest power of two in [MIN_BLOCK, MAX_BLOCK] dividing d, or None (then `supported` is False)."""
    return pow2_tile(d, MAX_BLOCK, MIN_BLOCK)


def supported(d: int) -> bool:
    """Whether rows of width d can be copied by this kernel."""
    return block(d) is not None


def _kernel(slot_ref, x_ref, out_ref, *, copies_per_row: int, bd: int):
    m, j = pl.program_id(0), pl.program_id(1)
    slot = slot_ref[m]
    cols = pl.ds(j * bd, bd)

    @pl.when(slot < out_ref.shape[0])
    def _():
        out_ref[slot, cols] = x_ref[m // copies_per_row, cols]


def scatter_rows(x_ND: jax.Array, slot_M: jax.Array, rows: int, *, interpret: bool | None = None) -> jax.Array:
    """[rows, D] with row slot[m] = x[m // k] for every copy m (k = M / N copies per token row); slots
    >= rows are skipped; every other row is left unwritten (arbitrary values). Slots must be distinct
    where < rows. `interpret`: None chooses where the program is lowered (Triton for a GPU, interpret
    mode elsewhere)."""
    n, d = x_ND.shape
    m = slot_M.shape[0]
    if m % n:
        raise ValueError(f"scatter_rows: {m} copies are not a whole number per each of {n} rows")
    bd = block(d)
    if bd is None:
        raise ValueError(f"scatter_rows: no power-of-two block >= {MIN_BLOCK} divides D={d}")
    out = jax.ShapeDtypeStruct((rows, d), x_ND.dtype)
    return triton_call(
        functools.partial(_kernel, copies_per_row=m // n, bd=bd),
        out_shape=out,
        grid=(m, d // bd),
        in_specs=[whole(slot_M), whole(x_ND)],
        out_specs=whole(out),
        name="scatter_rows",
        interpret=interpret, num_warps=4, num_stages=1,
    )(slot_M.astype(jnp.int32), x_ND)

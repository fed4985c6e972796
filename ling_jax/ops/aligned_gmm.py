"""Grouped matmul over rows laid out in whole tiles per group: a persistent, warp-specialised Mosaic
GPU kernel for Hopper (sm90).

The MoE dispatch (ops/moe.py, impl "aligned": what `kernels.moe_impls` resolves "auto" to beyond the
decode sizes on an sm90 GPU with 16-bit activations) places each expert's token copies at a multiple
of `Tiles.m` rows, the rest of its last tile zero. Every row tile then belongs to exactly one
expert, named by a table `tile_group_T` (-1: a tile past the last expert's, written as zeros), so
the kernel needs no per-tile search over the groups and no partial stores — unlike JAX's
`ragged_dot_mgpu`, whose tiles straddle groups (an unrolled loop over all G groups per tile, a
ladder of TMA stores per tile, the pipeline restarted per tile), which keeps that kernel far below a
dense matmul's rate where the contraction is short (docs/kernels.md, "MoE aligned grouped matmul";
figures: BENCHMARKS.md, "MoE: routed experts, one layer").

Structure (after JAX's `hopper_matmul_mgpu`): one program per SM loops over the output tiles; a
memory warpgroup streams [m, k] tiles of x and [k, 2n] tiles of w[group] through
`max_concurrent_steps` shared-memory slots with TMA, two compute warpgroups each accumulate an
[m, n] half with wgmma, and the epilogue stores through a double-buffered [epi_m, epi_n] window
while the memory warpgroup already loads the next tile.

Off GPU it runs in the Mosaic GPU interpreter (tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ling_jax.ops.pallas_gpu import pad_axis
from ling_jax.ops.platform import on_platform


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes: rows per tile (the dispatch's alignment), columns per compute warpgroup, the
    contraction step, pipeline depth, the epilogue's store window, and the order of the persistent
    loop: output-column tiles are visited in bands of `band` (0: all of them) for each row tile
    in turn, so one row tile's column tiles run side by side and read its rows from L2."""

    m: int = 128
    n: int = 128
    k: int = 64
    steps: int = 4
    epi_m: int = 64
    epi_n: int = 64
    band: int = 0


TILES = Tiles()  # many copies per expert (training, prefill)
# A few copies per expert (decode): half-height row tiles halve the zero rows the dispatch writes and
# the kernel reads, and narrower column tiles spread one expert's weights over more SMs (BENCHMARKS.md,
# "MoE: routed experts, one layer", decode-sized calls).
DECODE_TILES = Tiles(m=64, n=64)
# token copies per call up to which `tiles_for` picks DECODE_TILES: the largest count at which they
# beat TILES (docs/decode-performance.md, "Batches 16 and 128")
DECODE_MAX_ROWS = 4096
INTERPRET_PROGRAMS = 4  # programs (SMs) simulated off GPU


def tiles_for(rows: int) -> Tiles:
    """The tile set for a grouped matmul over at most `rows` token copies (the MoE's worst case)."""
    return DECODE_TILES if rows <= DECODE_MAX_ROWS else TILES


def gpu_cores() -> int:
    """The SM count of the GPU a program is traced for (the abstract mesh's device, else the default
    device), 0 where none is known (a CPU host without an abstract GPU device)."""
    mesh_device = jax.sharding.get_abstract_mesh().abstract_device
    return int((mesh_device.num_cores if mesh_device else getattr(jax.devices()[0], "core_count", 0)) or 0)


def _num_programs(interpret: bool) -> int:
    """One program per SM of the GPU (the persistent loop's width); INTERPRET_PROGRAMS interpreted."""
    if interpret:
        return INTERPRET_PROGRAMS
    cores = gpu_cores()
    if not cores:
        raise ValueError("aligned_matmul: the device reports no SM count to size the persistent grid by")
    return cores


def _kernel(tile_group_gmem, x_gmem, w_gmem, out_gmem, *, tiles: Tiles, transpose_rhs: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    dtype, out_dtype = x_gmem.dtype, out_gmem.dtype
    rows, depth = x_gmem.shape  # [S, K]
    cols = out_gmem.shape[1]
    cta_n = 2 * tiles.n
    m_tiles, n_tiles, k_steps = rows // tiles.m, cols // cta_n, depth // tiles.k
    swizzle = plgpu.find_swizzle(tiles.k * jnp.dtype(dtype).itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(tiles.epi_n * jnp.dtype(out_dtype).itemsize * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
                      plgpu.SwizzleTransform(out_swizzle))
    epi = [(i, j) for i in range(tiles.m // tiles.epi_m) for j in range(tiles.n // tiles.epi_n)]
    slots = min(2, len(epi))

    def pipeline(body, context):
        w_block, w_map = ((cta_n, tiles.k), lambda s: (0, s)) if transpose_rhs else ((tiles.k, cta_n), lambda s: (s, 0))
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=tiles.steps, compute_context=context,
            in_specs=[plgpu.BlockSpec((tiles.m, tiles.k), lambda s: (0, s), transforms=transforms,
                                      memory_space=plgpu.SMEM),
                      plgpu.BlockSpec(w_block, w_map, transforms=transforms, memory_space=plgpu.SMEM)])

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem.at[0]),
        out_smem=plgpu.SMEM((2, slots, tiles.epi_m, tiles.epi_n), out_dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tile(info):
            m_idx, n_idx = plgpu.planar_snake(info.index[0], (m_tiles, n_tiles), 1, tiles.band or n_tiles)
            group = tile_group_gmem[m_idx]
            m_rows = pl.ds(m_idx * tiles.m, tiles.m)
            out_tile = out_gmem.at[m_rows, pl.ds(n_idx * cta_n, cta_n)].at[:, pl.ds(wg * tiles.n, tiles.n)]

            def store(acc_MN):  # [m, n] of this warpgroup, through the double-buffered window
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for e, (i, j) in enumerate(epi):
                    win = (slice(i * tiles.epi_m, (i + 1) * tiles.epi_m), slice(j * tiles.epi_n, (j + 1) * tiles.epi_n))
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    out_smem[wg, e % slots] = acc_MN[win]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, e % slots], out_tile.at[win])

            def context(run):
                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tiles.m, tiles.n), jnp.float32))
                def _acc(acc):
                    run(acc)
                    store(acc[...].astype(out_dtype))

            def mma(_, x_smem, w_smem, acc):
                cols_wg = pl.ds(wg * tiles.n, tiles.n)
                w_kn = w_smem.at[cols_wg, :].transpose((1, 0)) if transpose_rhs else w_smem.at[:, cols_wg]
                plgpu.wgmma(acc, x_smem, w_kn)
                plgpu.wgmma_wait(0)
                return acc

            @pl.when(group >= 0)
            def _compute():
                w_g, cols_cta = w_gmem.at[group], pl.ds(n_idx * cta_n, cta_n)
                w_cols = w_g.at[cols_cta, :] if transpose_rhs else w_g.at[:, cols_cta]
                pipeline(mma, context)(x_gmem.at[m_rows, :], w_cols, allocations=allocs)

            @pl.when((group < 0) & (wg < 2))
            def _zeros():  # a tile past the last group's: zeros (the memory warpgroup has nothing to do)
                store(jnp.zeros((tiles.m, tiles.n), out_dtype))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def aligned_matmul(x_SK: jax.Array, w_GKN: jax.Array, tile_group_T: jax.Array, *, transpose_rhs: bool = False,
                   tiles: Tiles = TILES, interpret: bool | None = None, interpret_params: Any = None) -> jax.Array:
    """Row tile t of x times w[tile_group[t]]: [S, K] x [G, K, N] (or [G, N, K] used transposed) -> [S, N].

    S = T * tiles.m; tile_group [T] int32 in [-1, G), -1 giving a zero tile, the tiles in any order
    (the MoE's gradient wants them in ascending group order, -1 last: `ops.moe.aligned_ragged_dot`).
    x and w in one 16-bit dtype (wgmma); K and N are padded here to the tiles. `interpret`: the
    Mosaic-GPU interpreter (default: chosen at lowering, `ops.platform`: compiled for CUDA where the
    GPU's SM count is known, interpreted elsewhere), with `interpret_params` (a
    `plgpu.InterpretGPUParams`, e.g. with race detection) if given.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    s, k = x_SK.shape
    n = w_GKN.shape[1] if transpose_rhs else w_GKN.shape[2]
    if s != tile_group_T.shape[0] * tiles.m:
        raise ValueError(f"aligned_matmul: {s} rows is not {tile_group_T.shape[0]} tiles of {tiles.m}")
    if x_SK.dtype != w_GKN.dtype or jnp.dtype(x_SK.dtype).itemsize != 2:
        raise ValueError(f"aligned_matmul takes one 16-bit dtype, got {x_SK.dtype} and {w_GKN.dtype}")
    if tiles.m % tiles.epi_m or tiles.n % tiles.epi_n:
        raise ValueError(f"aligned_matmul: the store window {tiles.epi_m}x{tiles.epi_n} must divide the tile "
                         f"{tiles.m}x{tiles.n}")
    if interpret is None:
        forms = {False: functools.partial(aligned_matmul, transpose_rhs=transpose_rhs, tiles=tiles, interpret=False),
                 True: functools.partial(aligned_matmul, transpose_rhs=transpose_rhs, tiles=tiles, interpret=True,
                                         interpret_params=interpret_params)}
        compiled = forms[not gpu_cores()]
        return on_platform(lambda p: compiled if p == "cuda" else forms[True], x_SK, w_GKN, tile_group_T)
    cta_n = 2 * tiles.n
    x = pad_axis(x_SK, 1, tiles.k)
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    w = pad_axis(pad_axis(w_GKN, k_axis, tiles.k), n_axis, cta_n)
    cols = w.shape[1] if transpose_rhs else w.shape[2]
    call = plgpu.kernel(
        functools.partial(_kernel, tiles=tiles, transpose_rhs=transpose_rhs),
        out_type=jax.ShapeDtypeStruct((s, cols), x_SK.dtype),
        grid=(_num_programs(interpret),), grid_names=("sm",), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    mode = (plgpu.force_gpu_interpret_mode(interpret_params or plgpu.InterpretGPUParams()) if interpret
            else contextlib.nullcontext())
    with mode:
        return call(tile_group_T.astype(jnp.int32), x, w)[:, :n]


def tile_layout(group_sizes_G: jax.Array, num_tiles: int, tile_m: int = TILES.m) -> tuple[jax.Array, jax.Array]:
    """For groups of `group_sizes` rows each starting on a tile: (the first tile of each group [G],
    the group of each of `num_tiles` tiles [T], -1 past the last group's tiles)."""
    tiles_G = (group_sizes_G + tile_m - 1) // tile_m
    end_G = jnp.cumsum(tiles_G)
    t_T = jnp.arange(num_tiles, dtype=end_G.dtype)
    # every tile against every group end at once: the default ("scan") is a while loop of log2(G)
    # steps, each waiting on the host on a GPU (docs/decode-performance.md)
    group_T = jnp.searchsorted(end_G, t_T, side="right", method="compare_all").astype(jnp.int32)
    return (end_G - tiles_G).astype(jnp.int32), jnp.where(t_T < end_G[-1], group_T, -1)


def num_tiles(rows: int, groups: int, tile_m: int = TILES.m) -> int:
    """Tiles enough for any split of `rows` rows into `groups` groups, each starting on a tile.

    A group of s >= 1 rows takes (s - 1) // m + 1 tiles, so q non-empty groups take at most
    (rows - q) // m + q <= ceil(rows / m) - 1 + q, and q <= min(groups, rows) (decode: 128 copies
    over 512 experts need at most 128 tiles, not 513).
    """
    return max(1, -(-rows // tile_m) + min(groups, rows) - 1)

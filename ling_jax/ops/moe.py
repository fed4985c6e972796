"""Routed-expert compute: every (token, expert) pair of a top-k routing, dropless.

`routed_experts` is what the MoE layer calls on one device; `routed_partial` is the same sum
restricted to a contiguous range of experts, returned in float32 — the per-device piece of the
expert-parallel dispatch in layers/moe.py (there `first_expert` is the device's first expert and
the weights are its local experts; on one device it is all of them).

Both sort the token copies by expert and run one grouped matmul per projection on the sorted rows.
`impl` picks the grouped matmul (`ling_jax.kernels` resolves "auto" and the decode-sized choice
before these functions see it: `Kernels.moe_for`):

  ragged  `jax.lax.ragged_dot` (XLA; every backend; slow on GPU: docs/kernels.md)
  aligned each expert's copies start on a row tile (the rest of its last tile zero), and our
          persistent warp-specialised Mosaic-GPU kernel (`ops.aligned_gmm`) runs the forward and
          dX, JAX's `transposed_ragged_dot_mgpu` dW, behind a custom VJP. Hopper (sm90) only;
          elsewhere it runs in the Mosaic-GPU interpreter (tests). Far closer to a dense matmul's
          rate than mgpu at the MoE shapes (BENCHMARKS.md, "MoE: routed experts, one layer").
  mgpu    JAX's Pallas Mosaic-GPU kernels (`ragged_dot_mgpu` for the forward and dX with
          transposed weights, `transposed_ragged_dot_mgpu` for dW) behind a custom VJP on rows
          packed without gaps. Hopper (sm90) only; elsewhere the Mosaic-GPU interpreter.
  gmm     the TPU megablox kernels (`gmm`, `tgmm`) behind the same custom VJP; interpret mode
          off-TPU (tests).
  dense   every expert on every token, then a gather: the reference the others are tested
          against (tiny shapes only).
  gather  each token copy multiplies its own expert's gathered weights: reads only the chosen
          experts, no sort, no grouped-matmul launch — for decode-sized batches.
  gemv    the same products through the Pallas kernel of `ops.expert_gemv` (reads each chosen
          expert's weights by rows; interpret mode off GPU), for decode-sized calls (up to
          `Tuning.gather_max_copies` token copies; larger calls run what "auto" picks for them).
          Forward only. Fast only when the weights come as `ExpertStack`s (the unrolled decode
          step): a sliced weight stack passed to the kernel is first copied whole.
  auto    (resolved by `kernels.moe_impls`, never passed here) decode-sized calls: gemv on one GPU
          when the weights are `ExpertStack`s the kernel can tile (`Kernels.expert_stacks`), else
          gather; beyond (prefill, training): aligned on an sm90 GPU with bf16/f16 activations,
          gmm on TPU, ragged otherwise.

The packed grouped matmuls (ragged, mgpu, gmm) have `jax.lax.ragged_dot`'s semantics, including
rows past `sum(group_sizes)`, which come out zero (the kernels leave them unwritten, so they are
masked); "aligned" computes whole tiles per expert, its padding rows zero because the dispatch
writes them zero. The row maps (`SortedRows`) send only the computed copies back either way.
The kernels run compiled or interpreted as the `Kernels` record's `Launch.interpret` says (None:
chosen where the program is lowered: compiled for the platform each is written for, interpreted
elsewhere).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.ops import aligned_gmm, expert_gemv, row_scatter
from ling_jax.ops.pallas_gpu import DEFAULT_LAUNCH, Launch, pad_axis
from ling_jax.ops.platform import on_platform
from ling_jax.ops.saved import keep
from ling_jax.ops.swiglu import swiglu_act

IMPLS = ("auto", "ragged", "dense", "gather", "gemv", "aligned", "mgpu", "gmm")
EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")  # a MoE layer's routed-expert weights
KERNELS = ("mgpu", "gmm")

# Mosaic-GPU tiles of impl "mgpu" (JAX's `ragged_dot_mgpu`; its rate with them: docs/kernels.md); megablox tiles.
MGPU_BLOCK_M, MGPU_BLOCK_N, MGPU_BLOCK_K, MGPU_STEPS, MGPU_GRID_BLOCK_N = 128, 128, 64, 4, 1
GMM_TILE = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertStack:
    """One layer's routed-expert weights [E, C, O], left inside its segment's stack [L, E, C, O].

    The unrolled decode step (`ling_jax.decode`) hands these to the MoE where the gemv kernel runs:
    the kernel then reads the layer straight from the stack (expert ids offset by layer x E). A
    sliced stack passed to a custom call is first copied whole by XLA, every step. Any other impl
    takes `materialize(w)`, a dynamic slice of the stack (for the grouped matmuls as costly), which
    is why stacks are made only for gemv.
    """

    stack: jax.Array  # [L, E, C, O]
    layer: jax.Array  # int32 scalar, this layer's index in the stack

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])


def materialize(w: jax.Array | ExpertStack) -> jax.Array:
    """The [E, C, O] weights of `w` (an `ExpertStack`'s layer slice, or `w` itself)."""
    return w.stack[w.layer] if isinstance(w, ExpertStack) else w


def gemv_tiles(ws: tuple[jax.Array | ExpertStack, ...], dtype: jnp.dtype) -> bool:
    """Whether the (gate, up, down) weights are all `ExpertStack`s in `dtype` whose [C, O] the gemv
    kernel can tile (so it reads them from their stacks, unconverted)."""
    return all(isinstance(w, ExpertStack) and w.stack.dtype == dtype and expert_gemv.supported(*w.shape[1:])
               for w in ws)


# ----------------------------------------------------------------------------- kernels


def _row_mask(y_MN: jax.Array, group_sizes_G: jax.Array, full: bool = False) -> jax.Array:
    """Zeroes the rows past sum(group_sizes) (kernels leave them unwritten); `full`: there are none."""
    if full:
        return y_MN
    valid_M = jnp.arange(y_MN.shape[0]) < jnp.sum(group_sizes_G)
    return jnp.where(valid_M[:, None], y_MN, jnp.zeros((), y_MN.dtype))


def _mosaic_gpu(call: Callable[..., jax.Array], interpret: bool | None, *args: jax.Array) -> jax.Array:
    """`call(*args)` of a Mosaic-GPU kernel: compiled or in the Mosaic-GPU interpreter as `interpret`
    says, or (None) compiled where the program is lowered for CUDA (and the GPU's SM count is known:
    JAX's kernels size their grids by it), interpreted elsewhere."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def interpreted(*a: jax.Array) -> jax.Array:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            return call(*a)

    if interpret is not None:
        return (interpreted if interpret else call)(*args)
    compiled = call if aligned_gmm.gpu_cores() else interpreted
    return on_platform(lambda p: compiled if p == "cuda" else interpreted, *args)


def _mgpu_matmul(x_MK: jax.Array, w_GKN: jax.Array, gs_G: jax.Array, transpose_rhs: bool,
                 interpret: bool | None) -> jax.Array:
    """ragged_dot_mgpu, shapes padded to the tiles: [M, K] x [G, K, N] (or [G, N, K]^T) -> [M, N]."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    m, k = x_MK.shape
    n = w_GKN.shape[1] if transpose_rhs else w_GKN.shape[2]
    align = math.lcm(MGPU_BLOCK_N, MGPU_BLOCK_K)
    x = pad_axis(pad_axis(x_MK, 0, MGPU_BLOCK_M), 1, align)
    w = pad_axis(pad_axis(w_GKN, 1, align), 2, align)
    call = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=gs_G.astype(jnp.int32),
                             block_m=MGPU_BLOCK_M, block_n=MGPU_BLOCK_N, block_k=MGPU_BLOCK_K,
                             max_concurrent_steps=MGPU_STEPS, grid_block_n=MGPU_GRID_BLOCK_N,
                             transpose_rhs=transpose_rhs)
    return _mosaic_gpu(call, interpret, x, w)[:m, :n]


def _mgpu_dw(x_MK: jax.Array, dy_MN: jax.Array, gs_G: jax.Array, interpret: bool | None) -> jax.Array:
    """transposed_ragged_dot_mgpu: per group g, x[rows of g]^T @ dy[rows of g] -> [G, K, N]."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    k, n = x_MK.shape[1], dy_MN.shape[1]
    align = math.lcm(MGPU_BLOCK_M, MGPU_BLOCK_K)
    x = pad_axis(pad_axis(x_MK, 0, align), 1, MGPU_BLOCK_M)
    dy = pad_axis(pad_axis(dy_MN, 0, align), 1, MGPU_BLOCK_N)
    call = functools.partial(transposed_ragged_dot_mgpu.transposed_ragged_dot, group_sizes=gs_G.astype(jnp.int32),
                             block_m=MGPU_BLOCK_M, block_n=MGPU_BLOCK_N, block_k=MGPU_BLOCK_K,
                             max_concurrent_steps=MGPU_STEPS, grid_block_n=MGPU_GRID_BLOCK_N)
    return _mosaic_gpu(call, interpret, x, dy)[:, :k, :n]


def _megablox():
    """The megablox kernel module (the package re-exports a function under the module's name)."""
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _megablox_call(call: Callable[..., jax.Array], interpret: bool | None, *args: jax.Array) -> jax.Array:
    """A megablox kernel compiled or interpreted as `interpret` says, or (None) compiled where the program
    is lowered for TPU, in interpret mode elsewhere."""
    if interpret is not None:
        return call(*args, interpret=interpret)
    compiled, interpreted = (functools.partial(call, interpret=i) for i in (False, True))
    return on_platform(lambda p: compiled if p == "tpu" else interpreted, *args)


def _gmm_matmul(x_MK: jax.Array, w_GKN: jax.Array, gs_G: jax.Array, transpose_rhs: bool,
                interpret: bool | None) -> jax.Array:
    megablox = _megablox()
    m, k = x_MK.shape
    n = w_GKN.shape[1] if transpose_rhs else w_GKN.shape[2]
    x = pad_axis(pad_axis(x_MK, 0, GMM_TILE), 1, GMM_TILE)
    w = pad_axis(pad_axis(w_GKN, 1, GMM_TILE), 2, GMM_TILE)
    y = _megablox_call(functools.partial(megablox.gmm, preferred_element_type=x.dtype, tiling=(GMM_TILE,) * 3,
                                         transpose_rhs=transpose_rhs), interpret, x, w, gs_G.astype(jnp.int32))
    return y[:m, :n]


def _gmm_dw(x_MK: jax.Array, dy_MN: jax.Array, gs_G: jax.Array, interpret: bool | None) -> jax.Array:
    megablox = _megablox()
    k, n = x_MK.shape[1], dy_MN.shape[1]
    x = pad_axis(pad_axis(x_MK, 0, GMM_TILE), 1, GMM_TILE)
    dy = pad_axis(pad_axis(dy_MN, 0, GMM_TILE), 1, GMM_TILE)
    dw = _megablox_call(functools.partial(megablox.tgmm, preferred_element_type=x.dtype, tiling=(GMM_TILE,) * 3),
                        interpret, x.swapaxes(0, 1), dy, gs_G.astype(jnp.int32))
    return dw[:, :k, :n]


_MATMUL = {"mgpu": _mgpu_matmul, "gmm": _gmm_matmul}
_DW = {"mgpu": _mgpu_dw, "gmm": _gmm_dw}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def kernel_ragged_dot(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array, kernel: str,
                      full: bool = False, interpret: bool | None = None) -> jax.Array:
    """`jax.lax.ragged_dot(x, w, group_sizes)` through a Pallas kernel ("mgpu" or "gmm"), differentiable.

    Backward: dX = the same kernel on dY with the weights transposed in the kernel, dW = the
    kernel's transposed grouped matmul (per group, X_g^T dY_g). Rows past sum(group_sizes) are
    zero in Y and in dX. `full`: the caller guarantees sum(group_sizes) = M (no masking passes).
    `interpret`: the kernels compiled or interpreted (None: chosen where the program is lowered).
    """
    return _row_mask(_MATMUL[kernel](x_MK, w_GKN, group_sizes_G, False, interpret), group_sizes_G, full)


def _krd_fwd(x_MK, w_GKN, group_sizes_G, kernel, full, interpret):
    y_MN, = keep(kernel_ragged_dot(x_MK, w_GKN, group_sizes_G, kernel, full, interpret))
    return y_MN, (x_MK, w_GKN, group_sizes_G)


def _krd_bwd(kernel, full, interpret, res, dy_MN):
    x_MK, w_GKN, gs_G = res
    dy_MN = _row_mask(dy_MN.astype(x_MK.dtype), gs_G, full)
    dx_MK = _row_mask(_MATMUL[kernel](dy_MN, w_GKN, gs_G, True, interpret), gs_G, full)
    dw_GKN = _DW[kernel](x_MK, dy_MN, gs_G, interpret).astype(w_GKN.dtype)
    return dx_MK, dw_GKN, None


kernel_ragged_dot.defvjp(_krd_fwd, _krd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def aligned_ragged_dot(x_SK: jax.Array, w_GKN: jax.Array, tile_group_T: jax.Array, tiles: aligned_gmm.Tiles,
                       interpret: bool | None = None) -> jax.Array:
    """Row tile t of x times w[tile_group[t]] through `aligned_gmm` with `tiles` ([S, K] x [G, K, N]
    -> [S, N]), differentiable. The tiles must come in ascending group order, those of group -1
    (zero) last, as `sorted_rows(aligned=True)` lays them out: dW is `transposed_ragged_dot_mgpu`
    over the groups' whole tiles, taken to be contiguous. dX: the same kernel with the weights
    transposed. `interpret`: compiled or interpreted (None: chosen where the program is lowered)."""
    return aligned_gmm.aligned_matmul(x_SK, w_GKN, tile_group_T, tiles=tiles, interpret=interpret)


def _ard_fwd(x_SK, w_GKN, tile_group_T, tiles, interpret):
    y_SN, = keep(aligned_ragged_dot(x_SK, w_GKN, tile_group_T, tiles, interpret))
    return y_SN, (x_SK, w_GKN, tile_group_T)


def _ard_bwd(tiles, interpret, res, dy_SN):
    x_SK, w_GKN, tile_group_T = res
    dy_SN = dy_SN.astype(x_SK.dtype)
    dx_SK = aligned_gmm.aligned_matmul(dy_SN, w_GKN, tile_group_T, transpose_rhs=True, tiles=tiles,
                                       interpret=interpret)
    rows_G = counts(tile_group_T, w_GKN.shape[0]) * tiles.m
    return dx_SK, _mgpu_dw(x_SK, dy_SN, rows_G, interpret).astype(w_GKN.dtype), None


aligned_ragged_dot.defvjp(_ard_fwd, _ard_bwd)


def grouped_matmul(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array, *, impl: str,
                   full: bool = False, tile_group_T: jax.Array | None = None,
                   tiles: aligned_gmm.Tiles = aligned_gmm.TILES, interpret: bool | None = None) -> jax.Array:
    """Rows sorted by group: row block g of x times w[g]; [M, K] x [G, K, N] -> [M, N] in x's dtype.

    Rows past sum(group_sizes) are zero. `impl`: "ragged", "aligned", "mgpu" or "gmm" (see the
    module doc); `full`: the caller guarantees sum(group_sizes) = M. "aligned" takes the rows in
    whole tiles of `tiles.m` per group (`sorted_rows(aligned=True)`, which also picks `tiles`):
    `tile_group_T` names each tile's group (group_sizes are not used; every row of a group's tiles
    is computed). `interpret`: the kernels compiled or interpreted (None: chosen where the program is
    lowered).
    """
    w_GKN = w_GKN.astype(x_MK.dtype)
    if impl == "aligned":
        if tile_group_T is None:
            raise ValueError("grouped_matmul impl='aligned' needs tile_group_T (rows laid out by sorted_rows)")
        return aligned_ragged_dot(x_MK, w_GKN, tile_group_T, tiles, interpret)
    if impl == "ragged":
        return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)
    if impl in KERNELS:
        return kernel_ragged_dot(x_MK, w_GKN, group_sizes_G, impl, full, interpret)
    raise ValueError(f"grouped_matmul impl={impl!r}: must be 'ragged', 'aligned' or one of {KERNELS}")


# ----------------------------------------------------------------------------- experts


def combine(y_NKD: jax.Array, w_NK: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Weighted sum of the k expert outputs in float32, cast to `dtype` (§6 item 14)."""
    return jnp.einsum("nk,nkd->nd", w_NK, y_NKD.astype(jnp.float32)).astype(dtype)


def expert_ffn_sorted(x_MD: jax.Array, group_sizes_E: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                      w_down: jax.Array, limit: jax.Array | float, impl: str = "ragged",
                      full: bool = False, tile_group_T: jax.Array | None = None,
                      tiles: aligned_gmm.Tiles = aligned_gmm.TILES, interpret: bool | None = None) -> jax.Array:
    """SwiGLU of rows already sorted by expert: [M, D] -> [M, D]; group_sizes [E] sum to <= M.

    Rows past sum(group_sizes) come out zero; `full`: the caller guarantees they sum to M.
    "aligned": the rows in whole tiles per expert, `tile_group_T`, `tiles` and group sizes from
    `sorted_rows(aligned=True)` (padding rows must be zero: they then stay zero through the SwiGLU).
    """
    mm = functools.partial(grouped_matmul, group_sizes_G=group_sizes_E, impl=impl, full=full,
                           tile_group_T=tile_group_T, tiles=tiles, interpret=interpret)
    return mm(swiglu_act(mm(x_MD, w_gate), mm(x_MD, w_up), limit), w_down)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedStacks:
    """One layer's shared expert inside its segment's stacks, for the gemv kernel to run it as one
    more copy per token in the routed experts' launches (`routed_experts(shared=...)`): the fused
    gate|up [L, 1, D, 2I] and down [L, 1, I, D] as `ExpertStack`s (expert 0 of their layer), and
    its SwiGLU clamp. Made by the unrolled decode step (`ling_jax.decode`) where `shared_fits`."""

    gate_up: ExpertStack
    down: ExpertStack
    limit: jax.Array


def shared_fits(hidden: int, intermediate: int, shared_intermediate: int) -> bool:
    """Whether the shared expert can ride in the gemv launches: its width equals the routed experts'
    (the kernel's outputs share one [M, O] shape) and the kernel tiles both."""
    return shared_intermediate == intermediate and expert_gemv.supported(hidden, intermediate) \
        and expert_gemv.supported(intermediate, hidden)


def _gemv_experts(x_ND: jax.Array | expert_gemv.NormedRows, w_NK: jax.Array, sel_NK: jax.Array,
                  stacks: tuple[jax.Array | ExpertStack, ...], stacked: bool, limit: jax.Array | float,
                  shared: SharedStacks | None = None, launch: Launch = DEFAULT_LAUNCH
                  ) -> tuple[jax.Array, jax.Array | None]:
    """The gemv path: (weighted routed sum [N, D] float32, shared expert [N, D] in x's dtype or None).

    sel: each choice's expert in the given weights (0 for choices that do not count, whose weight
    w is 0). With `shared`, the shared expert is N more copies in the same two launches.
    """
    n, k = sel_NK.shape
    dt = x_ND.dtype
    sel_M = sel_NK.reshape(-1)
    offset = 0  # the layer's first expert in the flattened stacks (the kernel adds it)
    if stacked:  # the kernel reads the layer from the stacks: no copy
        offset = stacks[0].layer * stacks[0].shape[0]
        wg, wu, wd = (w.stack.reshape(-1, *w.shape[1:]) for w in stacks)
    else:
        wg, wu, wd = (materialize(w).astype(dt) for w in stacks)
    limit_M = jnp.asarray(limit, jnp.float32)
    rows_M = np.arange(n * k) // k  # each token's k copies read its row
    extra_gu = extra_d = ()
    shared_idx = None
    if shared is not None:  # then one more copy per token, of the shared expert (the kernel's `extra_idx`)
        i = wg.shape[-1]
        gu, d = (w.stack.reshape(-1, *w.shape[1:]) for w in (shared.gate_up, shared.down))
        shared_idx = shared.gate_up.layer
        # per-copy clamp from a constant mask: fused into the SwiGLU (a concatenation is a launch)
        limit_M = jnp.where(np.arange(n * k + n)[:, None] >= n * k, shared.limit, limit_M)
        rows_M = np.concatenate([rows_M, np.arange(n)])
        extra_gu, extra_d = ((gu, 0), (gu, i)), ((d, 0),)
    index = dict(n_main=n * k, offset=offset, extra_idx=shared_idx, launch=launch)
    g_MI, u_MI = expert_gemv.gathered_products(x_ND, sel_M, (wg, wu), rows=rows_M, extra=extra_gu, **index)
    h_MI = swiglu_act(g_MI.astype(dt), u_MI.astype(dt), limit_M)
    (y_MD,) = expert_gemv.gathered_products(h_MI, sel_M, (wd,), rows=np.arange(len(rows_M)), extra=extra_d, **index)
    y_MD = y_MD.astype(dt)
    # the weighted sum as a multiply-and-reduce: XLA fuses it with the cast (an einsum is a dot launch)
    routed_ND = jnp.sum(w_NK[..., None] * y_MD[:n * k].astype(jnp.float32).reshape(n, k, -1), axis=1)
    return routed_ND, None if shared is None else y_MD[n * k:]


def routed_partial(
    x_ND: jax.Array | expert_gemv.NormedRows,
    idx_NK: jax.Array,
    w_NK: jax.Array,
    first_expert: jax.Array | int,
    w_gate_LDI: jax.Array | ExpertStack,
    w_up_LDI: jax.Array | ExpertStack,
    w_down_LID: jax.Array | ExpertStack,
    *,
    limit: jax.Array | float = 0.0,
    impl: str = "ragged",
    all_local: bool = False,
    rows_only: bool = False,
    launch: Launch = DEFAULT_LAUNCH,
) -> jax.Array:
    """sum_j w[n, j] * Expert_{idx[n, j]}(x[n]) over the choices j with idx in [first, first + L): [N, D] f32.

    The weights hold experts first .. first+L-1. Choices outside that range (other devices'
    experts, or the padding sentinel idx = E) contribute nothing and cost nothing in the grouped
    matmul: the copies are sorted with the local ones first (by expert) and only the worst-case
    number of local copies, N * min(k, L), is fed to it — dropless under any routing skew.
    Expert outputs are in x's dtype, the weighted sum is float32. `all_local`: the caller guarantees
    every choice is in range (every sorted copy is computed: the grouped matmuls skip their masks).
    `rows_only`: nothing differentiates the call (prefill, decode) and it does not run inside a
    `shard_map` (a `pallas_call` there has no manual-axis output types): the aligned dispatch then
    writes only the copies' rows (`dispatch(rows_only=True)`). `launch`: the gemv kernel's tuning, and
    whether every kernel runs compiled or interpreted (`Launch.interpret`; None: chosen at lowering).
    """
    n, k = idx_NK.shape
    n_local = w_gate_LDI.shape[0]
    stacks = (w_gate_LDI, w_up_LDI, w_down_LID)
    if impl not in IMPLS or impl == "auto":
        raise ValueError(f"routed_partial: impl={impl!r} must be one of {IMPLS[1:]} (resolved by ling_jax.kernels)")
    stacked = gemv_tiles(stacks, x_ND.dtype)
    local_NK = idx_NK - first_expert
    is_local_NK = (local_NK >= 0) & (local_NK < n_local)
    if impl == "gemv":
        return _gemv_experts(x_ND, jnp.where(is_local_NK, w_NK, 0.0), jnp.where(is_local_NK, local_NK, 0), stacks,
                             stacked, limit, launch=launch)[0]
    w_gate_LDI, w_up_LDI, w_down_LID = (materialize(w) for w in (w_gate_LDI, w_up_LDI, w_down_LID))
    x_ND = expert_gemv.dense(x_ND)
    if impl == "gather":
        dt = x_ND.dtype
        sel_NK = jnp.where(is_local_NK, local_NK, 0)
        g_NKI = jnp.einsum("nd,nkdi->nki", x_ND, w_gate_LDI[sel_NK].astype(dt))
        u_NKI = jnp.einsum("nd,nkdi->nki", x_ND, w_up_LDI[sel_NK].astype(dt))
        y_NKD = jnp.einsum("nki,nkid->nkd", swiglu_act(g_NKI, u_NKI, limit), w_down_LID[sel_NK].astype(dt))
        return combine(y_NKD, jnp.where(is_local_NK, w_NK, 0.0), jnp.float32)
    if impl == "dense":
        dt = x_ND.dtype
        g = jnp.einsum("nd,edi->nei", x_ND, w_gate_LDI.astype(dt))
        u = jnp.einsum("nd,edi->nei", x_ND, w_up_LDI.astype(dt))
        y_NLD = jnp.einsum("nei,eid->ned", swiglu_act(g, u, limit), w_down_LID.astype(dt))
        y_NKD = jnp.take_along_axis(y_NLD, jnp.where(is_local_NK, local_NK, 0)[..., None], axis=1)
        return combine(y_NKD, jnp.where(is_local_NK, w_NK, 0.0), jnp.float32)
    key_M = jnp.where(is_local_NK, local_NK, n_local).reshape(-1)  # non-local copies sort last
    cap = n * min(k, n_local)  # a token picks k distinct experts: at most min(k, L) of them here
    rows = sorted_rows(key_M, n_local, cap, aligned=impl == "aligned")
    # its matmuls never mix rows nor read the tail tiles; nothing downstream is differentiated
    x_SD = dispatch(x_ND, rows.copy_S, rows.slot_M, rows_only and impl == "aligned", launch.interpret)
    y_SD = expert_ffn_sorted(x_SD, rows.group_sizes_L, w_gate_LDI, w_up_LDI, w_down_LID, limit, impl,
                             full=all_local and cap == n * k,
                             tile_group_T=rows.tile_group_T, tiles=rows.tiles, interpret=launch.interpret)
    return combine(undispatch(y_SD, rows.copy_S, rows.slot_M).reshape(n, k, -1), w_NK, jnp.float32)


def routed_experts(
    x_ND: jax.Array | expert_gemv.NormedRows,
    idx_NK: jax.Array,
    w_NK: jax.Array,
    w_gate_EDI: jax.Array | ExpertStack,
    w_up_EDI: jax.Array | ExpertStack,
    w_down_EID: jax.Array | ExpertStack,
    *,
    limit: jax.Array | float = 0.0,
    impl: str = "ragged",
    rows_only: bool = False,
    shared: SharedStacks | None = None,
    launch: Launch = DEFAULT_LAUNCH,
) -> jax.Array:
    """sum_j w[n, j] * Expert_{idx[n, j]}(x[n]) for every token n: [N, D] in x's dtype (all experts local).

    `impl`: one of IMPLS but "auto" (`ling_jax.kernels` resolves it); `rows_only`: see `routed_partial`.
    `shared` (the unrolled decode step's, made only where the gemv kernel runs on stacks): plus the
    shared expert's output, computed in the same gemv launches.
    """
    stacks = (w_gate_EDI, w_up_EDI, w_down_EID)
    if shared is None:
        return routed_partial(x_ND, idx_NK, w_NK, 0, *stacks, limit=limit, impl=impl, all_local=True,
                              rows_only=rows_only, launch=launch).astype(x_ND.dtype)
    if not gemv_tiles(stacks, x_ND.dtype) or impl != "gemv":
        raise ValueError(f"routed_experts: a shared expert in the launches needs the gemv kernel on expert stacks "
                         f"(impl={impl!r}, {idx_NK.size} copies)")
    routed_ND, shared_ND = _gemv_experts(x_ND, w_NK, idx_NK, stacks, True, limit, shared, launch)
    return routed_ND.astype(x_ND.dtype) + shared_ND


def counts(idx: jax.Array, n: int) -> jax.Array:
    """How many entries of idx equal each of 0 .. n-1: [n] int32 (others are not counted).

    A compare-and-sum, not `bincount`: XLA's scatter-add of ~10^5 ones into ~10^2 bins serialises on
    its atomics (docs/kernels.md, "MoE aligned grouped matmul").
    """
    return jnp.sum(idx.reshape(-1, 1) == jnp.arange(n, dtype=idx.dtype), axis=0, dtype=jnp.int32)


def expert_counts(idx_NK: jax.Array, num_experts: int) -> jax.Array:
    """Copies routed to each expert [E] int32; indices outside [0, E) (padding) are not counted."""
    return counts(idx_NK, num_experts)


# ----------------------------------------------------------------------------- dispatch
# Rows of the grouped matmuls: the token copies sorted by expert, packed (row r = sorted copy r) or
# aligned (each expert's copies from a tile boundary on, zero rows between). Both directions of the
# dispatch are gathers and the transpose of each is the other one's gather: no scatter in the
# forward or the backward (XLA's scatter-add of [N * k, D] rows broadcasts a u32 index per element,
# 1.6 GB at 32k tokens x top-8).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SortedRows:
    """Where the token copies sit in the grouped matmul's S rows: `copy_S` [S] the copy each row
    holds (M = N * k: none, a zero row), `slot_M` [M] the row of each copy (S: not computed), the
    rows per expert `group_sizes_L` as the grouped matmul takes them, and (aligned) each row tile's
    expert `tile_group_T` (-1: past the last) and the grouped matmul's tile set (`tiles.m` rows
    per row tile)."""

    copy_S: jax.Array
    slot_M: jax.Array
    group_sizes_L: jax.Array
    tile_group_T: jax.Array | None
    tiles: aligned_gmm.Tiles = dataclasses.field(default=aligned_gmm.TILES, metadata={"static": True})


def sorted_rows(key_M: jax.Array, n_local: int, cap: int, aligned: bool) -> SortedRows:
    """The rows for copies whose expert is `key_M` (n_local: not computed here), at most `cap` of
    them local: packed into `cap` rows, or (`aligned`) each expert's from a tile of `tiles.m`
    rows on (`tiles = aligned_gmm.tiles_for(cap)`), in `aligned_gmm.num_tiles(cap, n_local, tiles.m)`
    tiles."""
    m = key_M.shape[0]
    order_M = jnp.argsort(key_M, stable=True)  # copies in sorted order
    pos_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(m, dtype=order_M.dtype), unique_indices=True)
    gs_L = counts(key_M, n_local)
    n_valid = jnp.sum(gs_L)  # the local copies: sorted positions [0, n_valid)
    if not aligned:
        copy_S = jnp.where(jnp.arange(cap) < n_valid, order_M[:cap], m)
        return SortedRows(copy_S, jnp.where(pos_M < n_valid, pos_M, cap), gs_L, None)
    tiles = aligned_gmm.tiles_for(cap)
    tm = tiles.m
    n_tiles = aligned_gmm.num_tiles(cap, n_local, tm)
    first_L, tile_group_T = aligned_gmm.tile_layout(gs_L, n_tiles, tm)
    shift_L = first_L * tm - (jnp.cumsum(gs_L) - gs_L)  # sorted position -> row, per expert
    e_M = jnp.minimum(key_M, n_local - 1)
    slot_M = jnp.where(key_M < n_local, pos_M + shift_L[e_M], n_tiles * tm)
    row_S = jnp.arange(n_tiles * tm, dtype=pos_M.dtype)
    group_S = tile_group_T[row_S // tm]
    g_S = jnp.maximum(group_S, 0)
    sorted_S = row_S - shift_L[g_S]
    held_S = (group_S >= 0) & (row_S - first_L[g_S] * tm < gs_L[g_S])
    copy_S = jnp.where(held_S, order_M[jnp.clip(sorted_S, 0, m - 1)], m)
    # computed once: fused into the [S, D] row gathers, XLA would redo these index gathers per
    # element, which costs more than the matmuls (docs/kernels.md, "MoE aligned grouped matmul")
    copy_S, slot_M = jax.lax.optimization_barrier((copy_S, slot_M))
    return SortedRows(copy_S, slot_M, (gs_L + tm - 1) // tm * tm, tile_group_T, tiles)


def _copies_of(y_SD: jax.Array, slot_M: jax.Array) -> jax.Array:
    """Rows of y [S, D] for every token copy [M, D], in token order; copies at slot S (not
    computed: other devices' experts, padding) are zero."""
    got = y_SD[jnp.minimum(slot_M, y_SD.shape[0] - 1)]
    return jnp.where((slot_M < y_SD.shape[0])[:, None], got, jnp.zeros((), y_SD.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def dispatch(x_ND: jax.Array, copy_S: jax.Array, slot_M: jax.Array, rows_only: bool = False,
             interpret: bool | None = None) -> jax.Array:
    """The grouped matmul's rows [S, D]: row s holds token copy copy_S[s] (a token has k = M / N
    copies), zero where it holds none.

    `rows_only` (for a consumer that never mixes rows and reads back only the copies' rows, and
    that nothing differentiates: the aligned grouped matmuls of a prefill or decode step): the rows
    holding no copy are left unwritten (`ops.row_scatter`, one kernel writing M rows instead of a
    gather writing S; `interpret` as the other kernels). Under differentiation of x they stay zero;
    a gradient of the consumer's weights alone would meet the unwritten rows, hence the flag."""
    if rows_only and row_scatter.supported(x_ND.shape[1]):
        return row_scatter.scatter_rows(x_ND, slot_M, copy_S.shape[0], interpret=interpret)
    return _zero_padded(x_ND, copy_S, slot_M)


def _zero_padded(x_ND: jax.Array, copy_S: jax.Array, slot_M: jax.Array) -> jax.Array:
    """`dispatch` as a gather over all S rows, the rows of no copy zero."""
    m = slot_M.shape[0]
    got = x_ND[jnp.minimum(copy_S, m - 1) // (m // x_ND.shape[0])]
    return jnp.where((copy_S < m)[:, None], got, jnp.zeros((), x_ND.dtype))


def _dispatch_fwd(x_ND, copy_S, slot_M, rows_only, interpret):
    x_SD, = keep(_zero_padded(x_ND, copy_S, slot_M))
    return x_SD, (x_ND.shape[0], slot_M)


def _dispatch_bwd(rows_only, interpret, res, dy_SD):
    n, slot_M = res
    dx_ND = _copies_of(dy_SD, slot_M).reshape(n, -1, dy_SD.shape[-1]).sum(axis=1, dtype=jnp.float32)
    return dx_ND.astype(dy_SD.dtype), None, None


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def undispatch(y_SD: jax.Array, copy_S: jax.Array, slot_M: jax.Array) -> jax.Array:
    """The expert outputs back in token-copy order [M, D] (copies not computed: zero)."""
    return _copies_of(y_SD, slot_M)


def _undispatch_fwd(y_SD, copy_S, slot_M):
    return undispatch(y_SD, copy_S, slot_M), copy_S


def _undispatch_bwd(copy_S, dy_MD):
    m = dy_MD.shape[0]
    dy_SD = jnp.where((copy_S < m)[:, None], dy_MD[jnp.minimum(copy_S, m - 1)], jnp.zeros((), dy_MD.dtype))
    return dy_SD, None, None


undispatch.defvjp(_undispatch_fwd, _undispatch_bwd)

"""Decode-sized routed-expert products as a Pallas kernel: each token copy's expert weights read by rows.

At decode a MoE layer sees a few token copies (N tokens x k choices), so its expert products are
weight-vector products whose whole cost is reading the chosen experts' weights. XLA lowers them to a
reduction whose fused gather walks every [C, O] weight column by column, far below the HBM rate.
Here every program reads one [BC, BO] tile of one copy's expert as contiguous rows, multiplies it by
that copy's BC inputs and sums over BC in float32. The grid is (copy, output tile, input tile): the
reduction is split across programs so that even one copy keeps every SM streaming, and the [S, M, O]
partial sums (S = C / BC, a few hundred KB) are added by XLA (or by their consumer,
`gathered_partials`). One tile per program: programs that loop over several tiles of C (fewer,
larger programs, Triton's pipelined loads) are slower in the batch-1 decode step
(docs/decode-performance.md, "The batch-1 step: what the kernels buy").

Triton on a GPU, interpret mode elsewhere (`Launch.interpret`, or the `interpret` argument). Tiles
are powers of two (Triton's rule) dividing C and O; `supported` says whether a shape has them.
`ops.moe` runs it as `impl="gemv"`, which the `Kernels` record picks for decode-sized calls where
the decode step hands the routed experts over as stacks (`Kernels.expert_stacks`); the decode step's
projections run it through `ops.layer_gemv`. The weights must be dense arrays: with FP8-resident
weights the layer would first dequantize every expert (XLA fuses that into its own gather, so
`gather` reads only the chosen FP8 experts). It pays only when the weights come whole
(`ops.moe.ExpertStack`): XLA copies a sliced weight stack whole before any custom call. Figures:
BENCHMARKS.md, "Decode kernels alone" and "Where a batch-1 step goes".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling_jax.ops.norms import gated_rms_norm, inv_rms, rms_norm, sum_squares
from ling_jax.ops.pallas_gpu import DEFAULT_LAUNCH, Launch, index_operand, pow2_tile, triton_call, whole

MAX_BC = 64  # input rows per tile: a [64, 128] float32 tile is 64 values per thread at 4 warps
MAX_BO = 128
MIN_TILE = 16
NUM_WARPS = 4
MAX_ADDED_PARTIALS = 64  # `add_partials` adds up to this many partial sums elementwise (more: one reduce)


class _PendingNorm:
    """What `NormedRows` and `GatedRows` share: rows `x` whose norm the kernel that reads them applies
    (other consumers take their `value()`); their shape and dtype are x's."""

    x: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape)

    @property
    def dtype(self) -> jnp.dtype:
        return self.x.dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NormedRows(_PendingNorm):
    """`rms_norm(x, weight[layer], eps)` not yet applied: rows for the kernel to normalise as it reads
    them (`gathered_partials`), so that a decode step's RMSNorm costs no launch of its own. Each
    row's sum of squares comes with them (`normed_rows` reduces it in XLA), since every program summing
    its row's squares itself is slower (docs/decode-performance.md, "Norms in the gemv prologue"). The norm
    weight stays in its segment's [L, C] stack (a sliced operand of a custom call is copied). Other
    consumers take `value()`. Indexing and reshapes apply to x and keep its last axis."""

    x: jax.Array  # [..., C] the rows before the norm
    weight: jax.Array  # [L, C] the norm weights of a segment's layers
    layer: jax.Array  # int32 scalar, the index of this layer's weight in `weight`
    ss: jax.Array  # [..., 1] float32, `ops.norms.sum_squares(x)`
    eps: float = dataclasses.field(metadata={"static": True})

    def value(self) -> jax.Array:
        """The normed rows as an array (the model's `rms_norm`, in XLA)."""
        return rms_norm(self.x, self.weight[self.layer], self.eps, self.ss)

    def reshape(self, *shape: int) -> NormedRows:
        return self._rows(self.x.reshape(*shape), self.ss.reshape(*shape[:-1], 1))

    def __getitem__(self, index: object) -> NormedRows:
        return self._rows(self.x[index], self.ss[index])

    def _rows(self, x: jax.Array, ss: jax.Array) -> NormedRows:
        if x.shape[-1] != self.x.shape[-1]:
            raise ValueError(f"NormedRows: the normed axis ({self.x.shape[-1]}) must stay last, got {x.shape}")
        return dataclasses.replace(self, x=x, ss=ss)


def normed_rows(x: jax.Array, weight: jax.Array, layer: jax.Array, eps: float) -> NormedRows:
    """x [..., C] to be RMS-normed with weight[layer] ([L, C] stack) by the kernels that read it."""
    return NormedRows(x, weight, layer, sum_squares(x), eps)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GatedRows(_PendingNorm):
    """A KDA layer's output with its gated output norm not yet applied (`ops.norms.gated_rms_norm`
    per head of V values: RMS-normed, times the norm weight, times sigmoid of the gate z): rows for
    the output projection's kernel to normalise as it reads them, so that the norm costs no launch
    of its own. Each head's sum of squares comes in J parts (`ops.kda.decode_layer` returns them);
    z is read by column from the array that holds it (the fused input projection's output), the
    norm weight from its segment's [L, V] stack. Rows stay [R, H * V]; other consumers take
    `value()`."""

    x: jax.Array  # [R, H * V] the heads' outputs, activation dtype
    ss: jax.Array  # [R, H, J] float32: x's sums of squares over each head's J blocks of V / J values
    z: jax.Array  # [R, Z] holds the gate: H * V values from column z_col
    weight: jax.Array  # [L, V] the norm weights of a segment's layers
    layer: jax.Array  # int32 scalar, this layer's index in `weight`
    z_col: int = dataclasses.field(metadata={"static": True})
    eps: float = dataclasses.field(metadata={"static": True})

    def value(self) -> jax.Array:
        """The normed rows as an array (the model's `gated_rms_norm`, in XLA)."""
        r, (h, v) = self.x.shape[0], (self.ss.shape[1], self.weight.shape[-1])
        z_RHV = self.z[:, self.z_col:self.z_col + h * v].reshape(r, h, v)
        return gated_rms_norm(self.x.reshape(r, h, v), z_RHV, self.weight[self.layer], self.eps).reshape(r, h * v)

    def reshape(self, *shape: int) -> GatedRows:
        if self.x.reshape(*shape).shape != self.x.shape:
            raise ValueError(f"GatedRows: the rows stay {self.x.shape}, not {shape}")
        return self


def dense(x: jax.Array | NormedRows | GatedRows) -> jax.Array:
    """x as an array (`NormedRows` and `GatedRows` normalised in XLA)."""
    return x.value() if isinstance(x, _PendingNorm) else x


def add_partials(parts_S: jax.Array) -> jax.Array:
    """parts [S, ...] summed over S, as a tree of elementwise adds of its slices where S <= MAX_ADDED_PARTIALS.

    The sum of the kernel's partial sums is a launch of its own as an XLA reduce, which XLA does not
    fuse with the sum's elementwise consumers (a cast and a residual add, a SwiGLU); as adds of
    slices it is a loop fusion that takes them in."""
    if parts_S.shape[0] > MAX_ADDED_PARTIALS:
        return parts_S.sum(0)
    parts = [parts_S[i] for i in range(parts_S.shape[0])]
    while len(parts) > 1:
        parts = [a + b for a, b in zip(parts[::2], parts[1::2], strict=False)] + parts[len(parts) // 2 * 2:]
    return parts[0]


def _tile(n: int, cap: int) -> int | None:
    """The largest power of two in [MIN_TILE, cap] that divides n, or None."""
    return pow2_tile(n, cap, MIN_TILE)


def output_tile(m: int, s: int, o: int, min_programs: int = DEFAULT_LAUNCH.gemv_programs) -> int:
    """The output tile BO of a launch of m copies and s input tiles: the widest power of two up to
    MAX_BO dividing O, narrowed (down to MIN_TILE) until the grid has `min_programs` programs. A small
    weight in wide tiles is a few programs that each wait out the whole of their tile's latency (the
    batch-1 router: 24 programs for its [1536, 128] weight)."""
    bo = _tile(o, MAX_BO)
    while m * s * (o // bo) < min_programs and bo // 2 >= MIN_TILE and o % (bo // 2) == 0:
        bo //= 2
    return bo


def supported(c: int, o: int) -> bool:
    """Whether [C, O] expert weights can be tiled by this kernel."""
    return _tile(c, MAX_BC) is not None and _tile(o, MAX_BO) is not None


def _normed(x_C: jax.Array, row: jax.Array, refs: tuple, s: jax.Array, bc: int, c: int, eps: float,
            dt: jnp.dtype) -> jax.Array:
    """The prologue of `NormedRows`: the tile x_C [BC] of row `row` RMS-normed from the row's sum of
    squares, with the model's cast order (`ops.norms.rms_norm`: normalise in float32, cast,
    times the weight)."""
    w_ref, layer_ref, ss_ref = refs
    r = inv_rms(ss_ref[row], c, eps)
    return ((x_C * r).astype(dt) * w_ref[layer_ref[0], pl.ds(s * bc, bc)].astype(dt)).astype(jnp.float32)


def _gated(x_C: jax.Array, row: jax.Array, refs: tuple, s: jax.Array, bc: int, v: int, z_col: int, eps: float,
           dt: jnp.dtype) -> jax.Array:
    """The prologue of `GatedRows`: the tile x_C [BC] (inside one head of V values) of row `row`
    normed as `ops.norms.gated_rms_norm` does, all in float32, then cast to the activation dtype."""
    ss_ref, z_ref, w_ref, layer_ref = refs
    r = inv_rms(jnp.sum(ss_ref[row, (s * bc) // v, :]), v, eps)
    z_C = z_ref[row, pl.ds(z_col + s * bc, bc)].astype(jnp.float32)
    w_C = w_ref[layer_ref[0], pl.ds((s * bc) % v, bc)].astype(jnp.float32)
    return (x_C * r * w_C * jax.nn.sigmoid(z_C)).astype(dt).astype(jnp.float32)


def _load_weight(ref, eviction: str | None) -> jax.Array:
    """A weight tile, loaded with L2 eviction policy `eviction` ("evict_first": each is read once per
    step, so it goes first out of L2 and leaves it to what is reused: partial sums, activations, the
    KDA state)."""
    return pltriton.load(ref, eviction_policy=eviction)


def _kernel(idx_ref, base_ref, row_ref, x_ref, *refs, n_w: int, n_extra: int, n_main: int, extra_cols: tuple,
            extra_fixed: bool, bc: int, bo: int, prologue: tuple, n_pro: int, eviction: str | None):
    m, o, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = row_ref[m]
    pro_refs, refs = refs[:n_pro], refs[n_pro:]  # the prologue's operands (`gathered_partials`)
    weights, extras, outs = refs[:n_w], refs[n_w:n_w + n_extra], refs[n_w + n_extra:]

    def products(tiles: list, e: jax.Array) -> list:
        """x's tile times each (weight, first column) tile of expert e, summed over BC. The weight loads
        come first, so that their latency covers the prologue's loads (sums of squares, norm weights,
        the gate)."""
        w_COs = [_load_weight(w_ref.at[e, pl.ds(s * bc, bc), pl.ds(col + o * bo, bo)], eviction)
                 for w_ref, col in tiles]
        x_C = x_ref[row, pl.ds(s * bc, bc)].astype(jnp.float32)
        if prologue[0] == "rms":
            x_C = _normed(x_C, row, pro_refs, s, bc, x_ref.shape[-1], *prologue[1:], x_ref.dtype)
        elif prologue[0] == "gated":
            x_C = _gated(x_C, row, pro_refs, s, bc, *prologue[1:], x_ref.dtype)
        return [jnp.sum(x_C[:, None] * w_CO.astype(jnp.float32), axis=0) for w_CO in w_COs]

    @pl.when(m < n_main)
    def _():
        for out_ref, y_O in zip(outs, products([(w_ref, 0) for w_ref in weights], idx_ref[m] + base_ref[0]),
                                strict=True):
            out_ref[...] = y_O

    if extra_cols:
        @pl.when(m >= n_main)
        def _():
            e = base_ref[1] if extra_fixed else idx_ref[m]
            for out_ref, y_O in zip(outs, products([(extras[j], col) for j, col in extra_cols], e), strict=True):
                out_ref[...] = y_O


def gathered_products(x_RC: jax.Array | NormedRows | GatedRows, idx_M: jax.Array, weights: tuple[jax.Array, ...], *,
                      rows: np.ndarray | None = None, extra: tuple[tuple[jax.Array, int], ...] = (),
                      n_main: int | None = None, offset: int | jax.Array = 0, extra_idx: int | jax.Array | None = None,
                      interpret: bool | None = None, launch: Launch = DEFAULT_LAUNCH) -> tuple[jax.Array, ...]:
    """For every weight stack w [E, C, O]: x[rows[m]] @ w[idx[m]] for each copy m -> [M, O] float32.

    x: [R, C] rows; idx: [M] int32, each copy's expert (must be in [0, E)); rows: [M] static ints,
    the row each copy reads (default m: one row per copy; the MoE's k choices of a token all read
    its row, so x is never repeated). All weights share E, C and O.

    `extra` (one (stack [E', C, O'], first column) per output; one array may serve several): the
    copies from `n_main` on read their output j from x[rows[m]] @ stack_j[idx[m], :, col_j : col_j
    + O] instead — a second kind of expert in the same launch (the MoE's shared expert, its gate
    and up read from one fused matrix at columns 0 and I). x as `NormedRows`: every program
    normalises its tile of the row itself (from the row's sum of squares, the model's RMSNorm); x as
    `GatedRows` likewise with the KDA output's gated norm.
    `interpret`: None takes `launch.interpret` (None there: chosen where the program is lowered,
    `pallas_gpu.triton_call`); `launch`: the tuned program count and eviction policy.

    `offset` (an int32 scalar) is added to the first n_main copies' indices, and with `extra_idx`
    idx holds only those n_main: every copy from n_main on takes expert `extra_idx`. The kernel
    reads both from one two-value operand (a constant in the unrolled decode step), so that the
    MoE's copies need no XLA launch to build their [M] indices (the layer's offset in the flattened
    stacks, the shared expert's index).
    """
    return tuple(add_partials(p) for p in gathered_partials(x_RC, idx_M, weights, rows=rows, extra=extra, n_main=n_main,
                                                            offset=offset, extra_idx=extra_idx, interpret=interpret,
                                                            launch=launch))


def gathered_partials(x_RC: jax.Array | NormedRows | GatedRows, idx_M: jax.Array, weights: tuple[jax.Array, ...], *,
                      rows: np.ndarray | None = None, extra: tuple[tuple[jax.Array, int], ...] = (),
                      n_main: int | None = None, offset: int | jax.Array = 0, extra_idx: int | jax.Array | None = None,
                      interpret: bool | None = None, launch: Launch = DEFAULT_LAUNCH) -> tuple[jax.Array, ...]:
    """`gathered_products` before the sum of its split: per weight its [S, M, O] float32 partial sums
    over the S = C / BC tiles of C, for a consumer that adds them itself
    (`ops.route_pallas` sums the router's in its kernel, sparing the sum's launch)."""
    pro, prologue, bc = (), (None,), _tile(x_RC.shape[-1], MAX_BC)
    if isinstance(x_RC, NormedRows):
        if x_RC.weight.shape[-1] != x_RC.shape[-1]:
            raise ValueError(f"gathered_products: norm weights {x_RC.weight.shape} do not match rows {x_RC.shape}")
        pro = (x_RC.weight, jnp.reshape(x_RC.layer, (1,)).astype(jnp.int32), x_RC.ss.reshape(-1).astype(jnp.float32))
        prologue, x_RC = ("rms", x_RC.eps), x_RC.x
    elif isinstance(x_RC, GatedRows):
        (r, c), (_, h, j), v = x_RC.shape, x_RC.ss.shape, x_RC.weight.shape[-1]
        bc = _tile(v, MAX_BC)  # a tile of C inside one head
        if (c != h * v or x_RC.ss.shape[0] != r or x_RC.z.shape[0] != r or x_RC.z_col + c > x_RC.z.shape[1]
                or x_RC.weight.ndim != 2 or bc is None or j & (j - 1)):
            raise ValueError(f"gathered_products: GatedRows x {x_RC.shape}, sums of squares {x_RC.ss.shape}, gate "
                             f"{x_RC.z.shape} from column {x_RC.z_col}, norm weights {x_RC.weight.shape}: need "
                             f"C = H * V, [L, V] norm weights, V a multiple of {MIN_TILE} and a power of two J")
        pro = (x_RC.ss.astype(jnp.float32), x_RC.z, x_RC.weight, jnp.reshape(x_RC.layer, (1,)).astype(jnp.int32))
        prologue, x_RC = ("gated", v, x_RC.z_col, x_RC.eps), x_RC.x
    r, c = x_RC.shape
    if extra_idx is not None and (rows is None or n_main != idx_M.shape[0]):
        raise ValueError(f"gathered_products: with extra_idx, idx [{idx_M.shape[0]}] holds the n_main={n_main} "
                         "main copies' experts, and rows gives every copy's row")
    m = idx_M.shape[0] if extra_idx is None else len(rows)
    o = weights[0].shape[-1]
    rows_M = np.arange(m, dtype=np.int32) if rows is None else np.asarray(rows, np.int32)
    n_main = m if n_main is None else n_main
    if rows_M.shape != (m,) or rows_M.min(initial=0) < 0 or rows_M.max(initial=0) >= r:
        raise ValueError(f"gathered_products: rows must be {m} indices into the {r} rows of x")
    if not supported(c, o):
        raise ValueError(f"gathered_products: no power-of-two tile >= {MIN_TILE} divides C={c} and O={o}")
    if any(w.shape != weights[0].shape for w in weights):
        raise ValueError(f"gathered_products: weight shapes differ: {[w.shape for w in weights]}")
    if (n_main < m) != bool(extra) or (extra and (len(extra) != len(weights) or any(
            w.shape[1] != c or col + o > w.shape[2] for w, col in extra))):
        raise ValueError(f"gathered_products: extra {[(w.shape, col) for w, col in extra]} must give each of the "
                         f"{len(weights)} outputs C={c} rows and O={o} columns, for the copies from n_main on")
    extra_arrays = list({id(w): w for w, _ in extra}.values())  # distinct extra arrays, each passed once
    slot = {id(w): j for j, w in enumerate(extra_arrays)}
    s = c // bc
    bo = output_tile(m, s, o, launch.gemv_programs)
    base = index_operand([offset, 0 if extra_idx is None else extra_idx])
    rows_op = index_operand(rows_M)
    partials = triton_call(
        functools.partial(_kernel, n_w=len(weights), n_extra=len(extra_arrays), n_main=n_main,
                          extra_cols=tuple((slot[id(w)], col) for w, col in extra),
                          extra_fixed=extra_idx is not None, bc=bc, bo=bo, prologue=prologue, n_pro=len(pro),
                          eviction=launch.gemv_eviction),
        out_shape=[jax.ShapeDtypeStruct((s, m, o), jnp.float32) for _ in weights],
        grid=(m, o // bo, s),
        in_specs=[whole(a) for a in (idx_M, base, rows_op, x_RC, *pro, *weights, *extra_arrays)],
        out_specs=[pl.BlockSpec((None, None, bo), lambda mi, oi, si: (si, mi, oi)) for _ in weights],
        name="expert_gemv",
        interpret=launch.interpret if interpret is None else interpret, num_warps=NUM_WARPS, num_stages=1,
    )(idx_M.astype(jnp.int32), base, rows_op, x_RC, *pro, *weights, *extra_arrays)
    return tuple(partials)

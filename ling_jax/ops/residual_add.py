"""The batch-1 decode step's residual adds as one Pallas kernel each, with the next RMSNorm's sums.

At one row, a layer's two residual adds (after its mixer's output projection, after its FFN) each
cost XLA two launches: a loop fusion that adds the gemv kernel's partial sums (and, after a MoE,
weighs its experts' outputs) into the stream, then a reduce of the new stream's squares for the
RMSNorm that follows (which the next gemv applies as it reads its input, `expert_gemv.NormedRows`).
XLA does not fuse that reduce into the loop that writes its operand. Here one launch does both: the
projection's output reaches the add as its partial sums (`PendingSum`); every program of the
kernel adds its tile of columns and writes the tile's sum of squares, and the row's last program to
finish (an atomic counter says which) adds those in tile order, so the result does not depend on
which program finishes last. The stream then travels between layers with its sum (`Residual`), for
the next norm (`layer_gemv.normed`). Handing the next gemv the tiles' sums instead cost every one of
its programs their loads: +1.5 us on a 30 MB weight for 48 tiles (H200, BENCHMARKS.md).

Triton lowering on GPU; interpret mode elsewhere (tests). `model.run_stack` carries a `Residual`
where the step's projections run through the gemv kernel at one row.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling_jax.layers.norms import sum_squares
from ling_jax.ops.expert_gemv import add_partials
from ling_jax.ops.pallas_gpu import call_options, pow2_tile, whole

MIN_PROGRAMS = 32  # column tiles narrowed until the add runs as at least this many programs
MAX_TILE, MIN_TILE = 128, 16
NUM_WARPS = 1  # a [<= 128] float32 tile is at most 4 values per thread


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingSum:
    """A projection's output still as the gemv kernel's [S, M, D] float32 partial sums (its split of
    C): for the residual add to sum them as it adds them (`add`); other consumers take `value()`.

    Without `weights` the M = R copies are the rows' outputs, cast to `dtype` after their sum (what
    `layer_gemv.linear` returns). With `weights` [R, K] they are a MoE's copies: R * K routed
    experts' outputs, then R shared experts' (`ops.moe.routed_experts(shared=...)`): the routed
    outputs, each cast to `dtype`, are weighed in float32 and summed over K, cast, and added to the
    shared expert's. `shape` is the view's ([..., D] with R rows)."""

    parts: jax.Array  # [S, M, D] float32
    weights: jax.Array | None  # [R, K] float32 or None
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    dtype: jnp.dtype = dataclasses.field(metadata={"static": True})

    @property
    def rows(self) -> int:
        return self.parts.shape[1] if self.weights is None else self.weights.shape[0]

    def value(self) -> jax.Array:
        """The output as an array (XLA adds the partial sums)."""
        y_MD = add_partials(self.parts)
        if self.weights is None:
            return y_MD.astype(self.dtype).reshape(self.shape)
        (r, k), d = self.weights.shape, y_MD.shape[-1]
        y_MD = y_MD.astype(self.dtype)
        # the weighted sum as a multiply-and-reduce: XLA fuses it with the cast (an einsum is a dot launch)
        routed_RD = jnp.sum(self.weights[..., None] * y_MD[:r * k].astype(jnp.float32).reshape(r, k, d), axis=1)
        return (routed_RD.astype(self.dtype) + y_MD[r * k:]).reshape(self.shape)

    def reshape(self, *shape: int | tuple[int, ...]) -> PendingSum:
        """The same sums viewed as `shape` (its last axis D, R rows in all; as ints or one tuple)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        size = math.prod(self.shape)
        if shape.count(-1) == 1:
            shape = tuple(size // -math.prod(shape) if n == -1 else n for n in shape)
        if shape[-1] != self.shape[-1] or math.prod(shape) != size:
            raise ValueError(f"PendingSum: cannot view {self.shape} as {shape}")
        return dataclasses.replace(self, shape=tuple(shape))


def pending_sum(parts_SMD: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype,
                weights_RK: jax.Array | None = None) -> PendingSum:
    """A `PendingSum` of the gemv kernel's partial sums, viewed as `shape`."""
    return PendingSum(parts_SMD, None if weights_RK is None else weights_RK.astype(jnp.float32), tuple(shape),
                      jnp.dtype(dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Residual:
    """The residual stream x [..., D] with its rows' sums of squares ss [..., 1] float32 (what its next
    RMSNorm reduces), and the kernel's per-row arrival counters [R] int32, zero between its launches
    (each launch takes them and gives them back; `of` makes them once per decode step)."""

    x: jax.Array
    ss: jax.Array
    count: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape)

    @property
    def dtype(self) -> jnp.dtype:
        return self.x.dtype

    @classmethod
    def of(cls, x: jax.Array, count: jax.Array | None = None) -> Residual:
        """x with its sums of squares reduced by XLA (and new zero counters unless given)."""
        rows = math.prod(x.shape[:-1])
        return cls(x, sum_squares(x), jnp.zeros((rows,), jnp.int32) if count is None else count)


def stream(x: jax.Array | Residual) -> jax.Array:
    """The residual stream as an array."""
    return x.x if isinstance(x, Residual) else x


def add(x: jax.Array | Residual, y: jax.Array | PendingSum) -> jax.Array | Residual:
    """x + y in x's dtype. A `Residual` stays one: with y a `PendingSum` through the kernel, which
    writes the new stream's sums of squares as it goes; else XLA adds and reduces them."""
    if not isinstance(x, Residual):
        return x + (y.value() if isinstance(y, PendingSum) else y)
    if isinstance(y, PendingSum) and y.shape == x.shape and _tile(x.shape[-1], y.rows) is not None:
        return _fused_add(x, y)
    new = x.x + (y.value() if isinstance(y, PendingSum) else y)
    return Residual.of(new, x.count)


def _tile(d: int, rows: int) -> int | None:
    """The column tile: the widest power of two in [MIN_TILE, MAX_TILE] dividing D, narrowed until
    rows x D / tile reaches MIN_PROGRAMS (a few programs each waiting on their loads' latency)."""
    t = pow2_tile(d, MAX_TILE, MIN_TILE)
    while t is not None and rows * (d // t) < MIN_PROGRAMS and t // 2 >= MIN_TILE and d % (t // 2) == 0:
        t //= 2
    return t


def _tree(terms: list) -> jax.Array:
    """The terms summed pairwise in `expert_gemv.add_partials`' order."""
    while len(terms) > 1:
        terms = [a + b for a, b in zip(terms[::2], terms[1::2], strict=False)] + terms[len(terms) // 2 * 2:]
    return terms[0]


def _kernel(x_ref, parts_ref, *refs, s: int, k: int, rows: int, bd: int, dt: jnp.dtype):
    *w_ref, _, out_ref, ss_ref, tile_ss_ref, count_ref = refs  # count_ref is the counters' input, aliased
    r, t = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(t * bd, bd)
    f32 = jnp.float32

    def summed(m: jax.Array | int) -> jax.Array:  # copy m's output tile, cast as `PendingSum.value` does
        return _tree([parts_ref[i, m, cols] for i in range(s)]).astype(dt).astype(f32)

    if not w_ref:
        y = summed(r)
    else:
        routed = functools.reduce(lambda a, j: a + w_ref[0][r, j] * summed(r * k + j), range(1, k),
                                  w_ref[0][r, 0] * summed(r * k))
        y = (routed.astype(dt).astype(f32) + summed(rows * k + r)).astype(dt).astype(f32)
    new = (x_ref[r, cols].astype(f32) + y).astype(dt)
    out_ref[r, cols] = new
    new32 = new.astype(f32)
    tile_ss_ref[r, t] = jnp.sum(new32 * new32)
    # acquire-release at GPU scope: the tile's sum is visible before the count says so
    arrived = pltriton.atomic_add(count_ref, (r,), jnp.int32(1))
    n = tile_ss_ref.shape[1]

    @pl.when(arrived == n - 1)
    def _():  # the row's last program adds the tiles' sums in tile order (volatile: not from L1), rearms the counter
        tiles = [pltriton.load(tile_ss_ref.at[r, pl.ds(i, 1)], volatile=True) for i in range(n)]
        ss_ref[r, :] = functools.reduce(lambda a, b: a + b, tiles)
        count_ref[r] = jnp.int32(0)


def _fused_add(x: Residual, y: PendingSum, interpret: bool | None = None) -> Residual:
    d = x.shape[-1]
    x_RD = x.x.reshape(-1, d)
    r = x_RD.shape[0]
    if y.rows != r or y.parts.shape[-1] != d or x.count.shape != (r,):
        raise ValueError(f"residual_add: {r} rows of {d} ({x.count.shape} counters) against partial sums "
                         f"{y.parts.shape}")
    bd = _tile(d, r)
    p = d // bd
    s, k = y.parts.shape[0], 0 if y.weights is None else y.weights.shape[1]
    ins = (x_RD, y.parts, *(() if y.weights is None else (y.weights,)), x.count)
    outs = [jax.ShapeDtypeStruct((r, d), x.dtype), jax.ShapeDtypeStruct((r, 1), jnp.float32),
            jax.ShapeDtypeStruct((r, p), jnp.float32), jax.ShapeDtypeStruct((r,), jnp.int32)]
    new_RD, ss_R1, _, count = pl.pallas_call(
        functools.partial(_kernel, s=s, k=k, rows=r, bd=bd, dt=x.dtype),
        out_shape=outs,
        grid=(r, p),
        in_specs=[whole(a) for a in ins],
        out_specs=[whole(o) for o in outs],
        input_output_aliases={len(ins) - 1: 3},
        name="residual_add",
        **call_options(interpret, num_warps=NUM_WARPS, num_stages=1),
    )(*ins)
    return Residual(new_RD.reshape(x.shape), ss_R1.reshape(*x.shape[:-1], 1), count)

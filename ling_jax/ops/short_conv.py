"""KDA's causal depthwise short convolution + SiLU (ARCHITECTURE.md §2.4), as XLA and as Pallas kernels.

`conv_silu` is the XLA form (float32 taps, a carried window, segment restarts); it serves decode,
chunked prefill and every backend without the kernels. `conv_silu_parts` is the training/prefill
form on a whole sequence: the q/k/v projections side by side in `x` [B, T, n*P], the n convolved
parts returned separately. With `impl="pallas"` it is a custom VJP of two Triton kernels (CPU:
interpret mode):
  - forward: one pass reads x and writes the n parts (no split copies);
  - backward: one pass reads x and the parts' cotangents, recomputes the pre-activation at the
    W shifted rows each output row feeds, and writes dx plus each program's partial sums of dw
    (one part's channel block per program, accumulated elementwise over its row blocks).
XLA's own gradient of `conv_silu` recomputes the convolution inside several multi-output reduction
fusions and materialises the split and concat around it (docs/training-performance.md; the kernels
against XLA: BENCHMARKS.md, "KDA short conv"). The `Kernels` record runs the kernels
(`Kernels.conv`) where it runs the Pallas KDA kernels, on one device, at widths `supports` takes.

Each tap reads its shifted rows straight from memory (the rows another program also reads come from
cache), so programs need no halo exchange: the layout of FLA's causal-conv kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling_jax.ops.pallas_gpu import is_pow2, triton_call, whole
from ling_jax.ops.platform import on_platform
from ling_jax.ops.saved import keep

F32 = jnp.float32
# rows x channels per block (Triton: powers of two), row blocks per backward program (its dw partial
# sums are reduced once per program): the fastest forward + backward of the `bench/short_conv.py` sweep
# at Ling-3.0-tiny's [8, 4096, 3 x 2048] (docs/kernels.md, "Short conv and log-sum-exp")
BLOCK_T, BLOCK_P, INNER = 8, 64, 32
WARPS = 4


def conv_silu(x_BTP: jax.Array, w_PW: jax.Array, seg_BT: jax.Array | None = None,
              state_BWP: jax.Array | None = None) -> jax.Array:
    """silu(causal depthwise conv) [B, T, P] in x's dtype, float32 inside (the XLA form).

    `state_BWP` holds the W-1 inputs before x (None: zeros, a sequence start); tap W-1 multiplies the
    current row. With `seg_BT`, taps that reach into an earlier segment read zero.
    """
    b, t, p = x_BTP.shape
    w = w_PW.shape[1]
    if state_BWP is None:
        state_BWP = jnp.zeros((b, w - 1, p), x_BTP.dtype)
    ext_BXP = jnp.concatenate([state_BWP.astype(x_BTP.dtype), x_BTP], axis=1)
    out_BTP = jnp.zeros((b, t, p), F32)
    for j in range(w):
        shift = w - 1 - j
        tap_BTP = ext_BXP[:, j : j + t].astype(F32)
        if seg_BT is not None and shift:
            prev = jnp.concatenate([jnp.full((b, shift), -1, seg_BT.dtype), seg_BT], 1)[:, :t]
            tap_BTP = jnp.where((prev == seg_BT)[..., None], tap_BTP, 0.0)
        out_BTP = out_BTP + tap_BTP * w_PW[:, j].astype(F32)
    return jax.nn.silu(out_BTP).astype(x_BTP.dtype)


def supports(p: int, parts: int, block_p: int = BLOCK_P) -> bool:
    """Whether the kernels take parts of width `p`: a power of two of at least `block_p` channels."""
    return parts >= 1 and is_pow2(p) and p >= block_p


def conv_silu_parts(x_BTQ: jax.Array, w_QW: jax.Array, seg_BT: jax.Array | None, parts: int, *,
                    impl: str = "xla", interpret: bool | None = None,
                    blocks: tuple[int, int, int] = (BLOCK_T, BLOCK_P, INNER)) -> tuple[jax.Array, ...]:
    """`conv_silu` of a whole sequence (no carried window) of Q = parts * P channels, split into the
    `parts` results [B, T, P]. impl "pallas": the kernels (`supports(P, parts)` required) with tiles of
    `blocks` (rows, channels: powers of two; row blocks per backward program), Triton where the program
    is lowered for a GPU, interpret mode on CPU (or as `interpret` says), the XLA form where for a TPU;
    "xla": the XLA form. Under `jax.checkpoint` the kernels' parts are kept (`saved.keep`)."""
    b, t, q = x_BTQ.shape
    if q % parts:
        raise ValueError(f"{q} channels do not split into {parts} parts")
    if impl == "xla":
        return tuple(jnp.split(conv_silu(x_BTQ, w_QW, seg_BT), parts, axis=-1))
    if impl != "pallas":
        raise ValueError(f"impl={impl!r}: must be 'xla' or 'pallas'")
    if not (is_pow2(blocks[0]) and blocks[2] >= 1 and supports(q // parts, parts, blocks[1])):
        raise ValueError(f"the short-conv kernels need parts of a power-of-two width >= {blocks[1]} and "
                         f"power-of-two blocks, got width {q // parts}, blocks {blocks}")
    seg = jnp.zeros((b, t), jnp.int32) if seg_BT is None else seg_BT.astype(jnp.int32)

    def kernels(x, w, seg):
        return keep(*_conv_parts(_Static(parts, seg_BT is not None, interpret, *blocks), x, w.astype(F32).T, seg))

    def xla(x, w, seg):
        return tuple(jnp.split(conv_silu(x, w, None if seg_BT is None else seg), parts, axis=-1))

    if interpret is not None:
        return kernels(x_BTQ, w_QW, seg)
    return on_platform(lambda p: xla if p == "tpu" else kernels, x_BTQ, w_QW, seg)


# ---------------------------------------------------------------------------------------------
# kernels: forward grid (B, T / rows, P / channels), a program writes its block of every part;
# backward grid (B, T / (rows * inner), parts * P / channels)
# ---------------------------------------------------------------------------------------------


def _load_rows(ref, bi, rows, cols, ok):
    """ref[bi, rows, cols] as float32 where `ok` (per row), zero elsewhere."""
    safe = jnp.where(ok, rows, 0)
    return pltriton.load(ref.at[bi, safe[:, None], cols[None, :]], mask=ok[:, None], other=0).astype(F32)


def _same_segment(seg_ref, bi, rows, ok, seg_here):
    """Whether each row in `rows` (valid where `ok`) is in the segment `seg_here` of its output row."""
    return ok & (pltriton.load(seg_ref.at[bi, jnp.where(ok, rows, 0)], mask=ok, other=-1) == seg_here)


@dataclasses.dataclass(frozen=True)
class _Static:
    """The kernels' static settings (a hashable custom-VJP argument)."""

    parts: int
    segments: bool
    interpret: bool | None
    bt: int  # rows per block
    bp: int  # channels per program (and part, forward)
    inner: int  # row blocks per backward program


def _fwd_kernel(x_ref, wt_ref, seg_ref, *out_refs, t: int, kw: _Static):
    width = wt_ref.shape[0]
    p = out_refs[0].shape[2]
    bi, ti, pj = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = ti * kw.bt + jnp.arange(kw.bt)
    cols = pj * kw.bp + jnp.arange(kw.bp)
    live = rows < t
    seg_here = pltriton.load(seg_ref.at[bi, jnp.where(live, rows, 0)], mask=live, other=-1)
    oks = []
    for j in range(width):
        shift = width - 1 - j
        ok = live & (rows >= shift)
        oks.append(_same_segment(seg_ref, bi, rows - shift, ok, seg_here) if kw.segments and shift else ok)
    for part, out_ref in enumerate(out_refs):
        pcols = part * p + cols
        acc = jnp.zeros((kw.bt, kw.bp), F32)
        for j in range(width):
            w_row = pltriton.load(wt_ref.at[j, pcols])
            acc += _load_rows(x_ref, bi, rows - (width - 1 - j), pcols, oks[j]) * w_row[None, :]
        y = acc * jax.nn.sigmoid(acc)  # rows past t: zero, in the padding `_run_fwd` slices off
        pltriton.store(out_ref.at[bi, rows[:, None], cols[None, :]], y.astype(out_ref.dtype))


def _bwd_kernel(x_ref, wt_ref, seg_ref, *refs, t: int, kw: _Static):
    """dx[r] = sum_s dpre[r + s] w[W-1-s] (same segment), dpre[u] = dy[u] silu'(pre[u]), pre recomputed
    from x[u - s'] at every shifted row u = r + s; dw[j] partial = sum over the program's rows r of
    dpre[r] x[r - (W-1-j)], accumulated elementwise over its `inner` row blocks and reduced once.
    One part's column block per program (the part's cotangent picked by `pl.when`)."""
    dys, (dx_ref, dw_ref) = refs[:kw.parts], refs[kw.parts:]
    width = wt_ref.shape[0]
    p = dys[0].shape[2]
    blocks_per_part = p // kw.bp
    bi, ci, pj = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    part = pj // blocks_per_part
    cols = (pj % blocks_per_part) * kw.bp + jnp.arange(kw.bp)
    pcols = part * p + cols
    w_rows = [pltriton.load(wt_ref.at[j, pcols])[None, :] for j in range(width)]
    offsets = range(-(width - 1), width)

    def row_block(dy_ref, k, dw):
        rows = (ci * kw.inner + k) * kw.bt + jnp.arange(kw.bt)
        # rows r + d for d in (-(W-1), ..., W-1): in range, and (with segments) their segment ids
        inr = {d: (rows + d >= 0) & (rows + d < t) for d in offsets}
        segs = {d: pltriton.load(seg_ref.at[bi, jnp.where(inr[d], rows + d, 0)], mask=inr[d], other=-1)
                for d in offsets} if kw.segments else {}
        xs = {d: _load_rows(x_ref, bi, rows + d, pcols, inr[d]) for d in offsets}

        def x_at(u: int, d: int):
            """x[r + d] where it feeds output row r + u (u >= d) through tap shift u - d, else 0 (rows
            r + u past the end need no mask: their dy, so their dpre, is 0)."""
            if kw.segments and u != d:
                return jnp.where((segs[d] == segs[u])[:, None], xs[d], 0.0)
            return xs[d]

        dx = jnp.zeros((kw.bt, kw.bp), F32)
        for s in range(width):  # output rows r + s, which read x[r] through tap W-1-s
            pre = jnp.zeros((kw.bt, kw.bp), F32)
            for j in range(width):
                pre += x_at(s, s - (width - 1 - j)) * w_rows[j]
            sig = jax.nn.sigmoid(pre)
            dpre = _load_rows(dy_ref, bi, rows + s, cols, inr[s]) * sig * (1.0 + pre * (1.0 - sig))
            if s and kw.segments:  # row r + s reads x[r] only in r's segment
                dpre = jnp.where((segs[0] == segs[s])[:, None], dpre, 0.0)
            if not s:  # the block's own rows: their dw terms
                dw = tuple(acc + x_at(0, -(width - 1 - j)) * dpre for j, acc in enumerate(dw))
            dx += dpre * w_rows[width - 1 - s]
        pltriton.store(dx_ref.at[bi, rows[:, None], pcols[None, :]], dx.astype(dx_ref.dtype))
        return dw

    for i, dy_ref in enumerate(dys):
        @pl.when(part == i)
        def _(dy_ref=dy_ref):
            zero = tuple(jnp.zeros((kw.bt, kw.bp), F32) for _ in range(width))
            dw = jax.lax.fori_loop(0, kw.inner, functools.partial(row_block, dy_ref), zero)
            for j in range(width):
                pltriton.store(dw_ref.at[bi, ci, j, pcols], jnp.sum(dw[j], axis=0))


def _padded(t: int, rows: int) -> int:
    """Rows of the kernels' outputs: whole blocks of `rows` per program, so no store is masked (the
    interpreter's scatter would let a masked row's index collide with a live one)."""
    return pl.cdiv(t, rows) * rows


def _run_fwd(kw: _Static, x, wt, seg):
    b, t, q = x.shape
    shape = (b, _padded(t, kw.bt), q // kw.parts)
    ys = triton_call(
        functools.partial(_fwd_kernel, t=t, kw=kw),
        grid=(b, pl.cdiv(t, kw.bt), shape[2] // kw.bp),
        in_specs=[whole(x), whole(wt), whole(seg)],
        out_specs=[pl.BlockSpec(shape, lambda *_: (0, 0, 0))] * kw.parts,
        out_shape=[jax.ShapeDtypeStruct(shape, x.dtype)] * kw.parts,
        name="short_conv_fwd",
        interpret=kw.interpret, num_warps=WARPS, num_stages=1,
    )(x, wt, seg)
    return [y[:, :t] for y in ys]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv_parts(kw: _Static, x, wt, seg):
    return tuple(_run_fwd(kw, x, wt, seg))


def _conv_parts_fwd(kw: _Static, x, wt, seg):
    return _conv_parts(kw, x, wt, seg), (x, wt, seg)


def _conv_parts_bwd(kw: _Static, res, dys):
    x, wt, seg = res
    b, t, q = x.shape
    grid = (b, pl.cdiv(t, kw.bt * kw.inner), q // kw.bp)
    dx_shape, dw_shape = (b, _padded(t, kw.bt * kw.inner), q), (b, grid[1], wt.shape[0], q)
    dx, dw_part = triton_call(
        functools.partial(_bwd_kernel, t=t, kw=kw),
        grid=grid,
        in_specs=[whole(x), whole(wt), whole(seg)] + [whole(dy) for dy in dys],
        out_specs=[pl.BlockSpec(dx_shape, lambda *_: (0, 0, 0)), pl.BlockSpec(dw_shape, lambda *_: (0, 0, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct(dx_shape, x.dtype), jax.ShapeDtypeStruct(dw_shape, F32)],
        name="short_conv_bwd",
        interpret=kw.interpret, num_warps=WARPS, num_stages=1,
    )(x, wt, seg, *(dy.astype(x.dtype) for dy in dys))
    return dx[:, :t], jnp.sum(dw_part, axis=(0, 1)).astype(wt.dtype), None


_conv_parts.defvjp(_conv_parts_fwd, _conv_parts_bwd)

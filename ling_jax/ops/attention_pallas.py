"""Fused causal softmax attention of MLA prefill and training (flash attention, forward and backward).

`ops.attention.attention` materialises the [B, H, T, T] scores, their mask and their softmax in HBM
(BENCHMARKS.md, "MLA attention: fused kernels"). These kernels keep them on chip: the forward
streams key blocks past a block of queries with an online softmax and stores only the output and
each row's log-sum-exp; the backward recomputes the probabilities block by block
(FlashAttention-2: one launch for dK/dV over key blocks, one for dQ over query blocks).

MLA specifics: the query/key head dim is nope + rope (128 + 64 in Ling), so the nope and rope parts
are separate operands (Triton tiles are powers of two), and the rope key is one per token shared by
all heads ([B, T, d_r], read once per head rather than broadcast in HBM; its gradient is summed over
heads in XLA). The value head dim may differ from the query's.

Visibility (what `ops.attention.attention_mask` builds as a [B, T, T] mask): key s is visible to
query t iff s <= t and doc_k[s] == doc_q[t], where doc_q numbers each row's documents in order
(non-decreasing along T) and doc_k is doc_q at valid keys and -1 at padding (`documents`). Key
blocks before the first query's document start (and query blocks past a key block's document end)
are skipped, so packed documents cost only their own causal triangles. A query that sees no key
(padding at the front of a row) gets a meaningless output and passes no gradient to any input (the
XLA path's uniform softmax would pass its cotangent on to every value): only rows that see a key
agree between the two, which is all a masked loss reads.

`layers.mla.mla_mixer` runs them where the `Kernels` record's `attention` is "pallas". Triton where
the program is lowered for a GPU (powers-of-two head dims, `supported`); interpret mode elsewhere
(tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ling_jax.ops.pallas_gpu import is_pow2, triton_call
from ling_jax.ops.saved import keep

F32 = jnp.float32
LOG2E = math.log2(math.e)
MASKED = -1e30  # finite: a row with no visible key in a block never produces NaN


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tiles and warps: forward (bq x bk), dK/dV (key block bk_dkv, query steps bq_dkv), dQ (bq_dq, bk_dq)."""

    bq: int = 128
    bk: int = 64
    # the backward's tiles and the stages: the fastest forward + backward at the Ling-3.0-tiny training
    # shape (docs/kernels.md, "MLA fused attention")
    bq_dkv: int = 32
    bk_dkv: int = 64
    bq_dq: int = 64
    bk_dq: int = 32
    warps_fwd: int = 8
    warps_dkv: int = 4
    warps_dq: int = 4
    stages: int = 3

    def __post_init__(self) -> None:
        if not all(is_pow2(b) and b >= 16 for b in self.tiles):
            raise ValueError(f"Blocks: every tile must be a power of two >= 16 (Triton dots), got {self.tiles}")

    @property
    def tiles(self) -> tuple[int, ...]:
        return self.bq, self.bk, self.bq_dkv, self.bk_dkv, self.bq_dq, self.bk_dq

    @property
    def pad_to(self) -> int:
        """T is padded to this: a multiple of every tile (all powers of two)."""
        return max(self.tiles)


DEFAULT_BLOCKS = Blocks()


def supported(nope: int, rope: int, v: int) -> bool:
    """Whether the kernels take these head dims (powers of two >= 16: Triton dots)."""
    return all(is_pow2(d) and d >= 16 for d in (nope, rope, v))


def documents(valid_BT: jax.Array | None, segment_ids_BT: jax.Array | None, b: int, t: int
              ) -> tuple[jax.Array, jax.Array]:
    """(doc_q, doc_k) int32 [B, T]: each row's documents numbered in order (a new one wherever the
    segment id changes, as KDA and the positions restart), doc_k -1 at padding keys."""
    if segment_ids_BT is None:
        doc = jnp.zeros((b, t), jnp.int32)
    else:
        new = jnp.concatenate([jnp.zeros((b, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], 1)
        doc = jnp.cumsum(new, axis=1, dtype=jnp.int32)
    return doc, doc if valid_BT is None else jnp.where(valid_BT, doc, -1)


def _dot(a: jax.Array, b: jax.Array, dims: tuple[int, int]) -> jax.Array:
    """a, b contracted over a's dim dims[0] and b's dims[1], float32 accumulation (exact for f32)."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == F32 else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a, b, (((dims[0],), (dims[1],)), ((), ())), precision=prec,
                               preferred_element_type=F32)


def _iota(shape: tuple[int, int], dim: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _scores(qn, qr, kn, kr, scale2: float):
    """[bq, bk] scores in the log2 domain: (q_nope k_nope^T + q_rope k_rope^T) * scale * log2(e); with the
    key operands first, the transposed scores [bk, bq]."""
    return (_dot(qn, kn, (1, 1)) + _dot(qr, kr, (1, 1))) * scale2


def _visible(q0, k0, doc_q, doc_k, bq: int, bk: int) -> jax.Array:
    """[bq, bk] visibility of keys k0.. to queries q0.. (causal, same document)."""
    causal = (k0 + _iota((bq, bk), 1)) <= (q0 + _iota((bq, bk), 0))
    return causal & (doc_q[:, None] == doc_k[None, :])


# ----------------------------------------------------------------------------------- kernels


def _fwd_kernel(qn_ref, qr_ref, kn_ref, kr_ref, v_ref, dq_ref, dk_ref, start_ref, o_ref, lse_ref, *,
                scale2: float, bq: int, bk: int):
    i = pl.num_programs(0) - 1 - pl.program_id(0)  # longest rows first
    q0 = i * bq
    qn, qr, doc_q = qn_ref[...], qr_ref[...], dq_ref[...]

    def body(j, carry):
        acc, m, l = carry
        keys = pl.ds(j * bk, bk)
        s = _scores(qn, qr, kn_ref[keys, :], kr_ref[keys, :], scale2)
        s = jnp.where(_visible(q0, j * bk, doc_q, dk_ref[keys], bq, bk), s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])
        alpha = jnp.exp2(m - m_new)
        v = v_ref[keys, :]
        return acc * alpha[:, None] + _dot(p.astype(v.dtype), v, (1, 0)), m_new, l * alpha + jnp.sum(p, axis=1)

    lo = jnp.min(start_ref[...]) // bk
    hi = (q0 + bq + bk - 1) // bk
    init = (jnp.zeros((bq, v_ref.shape[-1]), F32), jnp.full((bq,), MASKED, F32), jnp.zeros((bq,), F32))
    acc, m, l = jax.lax.fori_loop(lo, hi, body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _dkv_kernel(qn_ref, qr_ref, kn_ref, kr_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, end_ref,
                dkn_ref, dkr_ref, dv_ref, *, scale2: float, scale: float, bq: int, bk: int):
    """Key-major: every product is [keys, queries] (s^T, p^T, ds^T), so dV = p^T dO and dK = ds^T Q
    need no transpose of a register tile (only of loaded Q / dO tiles, which Triton reads transposed)."""
    j = pl.program_id(0)
    k0 = j * bk
    kn, kr, v, doc_k = kn_ref[...], kr_ref[...], v_ref[...], dk_ref[...]

    def body(i, carry):
        dkn, dkr, dv = carry
        rows = pl.ds(i * bq, bq)
        qn, qr, do = qn_ref[rows, :], qr_ref[rows, :], do_ref[rows, :]
        st = _scores(kn, kr, qn, qr, scale2)  # [bk, bq]
        vis = ((k0 + _iota((bk, bq), 0)) <= (i * bq + _iota((bk, bq), 1))) & (doc_k[:, None] == dq_ref[rows][None, :])
        pt = jnp.where(vis, jnp.exp2(st - lse_ref[rows][None, :]), 0.0)
        dv = dv + _dot(pt.astype(do.dtype), do, (1, 0))
        dpt = _dot(v, do, (1, 1))
        dst = (pt * (dpt - delta_ref[rows][None, :])).astype(qn.dtype)
        return dkn + _dot(dst, qn, (1, 0)), dkr + _dot(dst, qr, (1, 0)), dv

    lo = k0 // bq
    hi = (jnp.max(end_ref[...]) + bq - 1) // bq
    init = (jnp.zeros(kn.shape, F32), jnp.zeros(kr.shape, F32), jnp.zeros(v.shape, F32))
    dkn, dkr, dv = jax.lax.fori_loop(lo, hi, body, init)
    dkn_ref[...] = (dkn * scale).astype(dkn_ref.dtype)
    dkr_ref[...] = dkr * scale
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(qn_ref, qr_ref, kn_ref, kr_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, start_ref,
               dqn_ref, dqr_ref, *, scale2: float, scale: float, bq: int, bk: int):
    i = pl.num_programs(0) - 1 - pl.program_id(0)
    q0 = i * bq
    qn, qr, do, doc_q = qn_ref[...], qr_ref[...], do_ref[...], dq_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(j, carry):
        dqn, dqr = carry
        keys = pl.ds(j * bk, bk)
        kn, kr = kn_ref[keys, :], kr_ref[keys, :]
        s = _scores(qn, qr, kn, kr, scale2)
        p = jnp.where(_visible(q0, j * bk, doc_q, dk_ref[keys], bq, bk), jnp.exp2(s - lse[:, None]), 0.0)
        dp = _dot(do, v_ref[keys, :], (1, 1))
        ds = (p * (dp - delta[:, None])).astype(qn.dtype)
        return dqn + _dot(ds, kn, (1, 0)), dqr + _dot(ds, kr, (1, 0))

    lo = jnp.min(start_ref[...]) // bk
    hi = (q0 + bq + bk - 1) // bk
    dqn, dqr = jax.lax.fori_loop(lo, hi, body, (jnp.zeros(qn.shape, F32), jnp.zeros(qr.shape, F32)))
    dqn_ref[...] = (dqn * scale).astype(dqn_ref.dtype)
    dqr_ref[...] = (dqr * scale).astype(dqr_ref.dtype)


# ----------------------------------------------------------------------------------- specs


def _rows(block: int, d: int | None, per_head: bool = True) -> pl.BlockSpec:
    """A block of `block` rows of a [B, T, H, d] (per_head) / [B, T, d] / [B, T] array; grid (n, b, h).
    The row-block axis counts from the end (longest rows first, as the kernels' row index)."""
    def index(n, b, h):
        last = pl.num_programs(0) - 1 - n
        return (b, last, h, 0) if per_head else ((b, last, 0) if d else (b, last))
    if per_head:
        return pl.BlockSpec((None, block, None, d), index)
    return pl.BlockSpec((None, block, d) if d else (None, block), index)


def _cols(block: int, d: int | None, per_head: bool = True) -> pl.BlockSpec:
    """Block `n` (the first grid axis, in order) of `block` rows; grid (n, b, h)."""
    if per_head:
        return pl.BlockSpec((None, block, None, d), lambda n, b, h: (b, n, h, 0))
    if d:
        return pl.BlockSpec((None, block, d), lambda n, b, h: (b, n, 0))
    return pl.BlockSpec((None, block), lambda n, b, h: (b, n))


def _whole(t: int, d: int | None, per_head: bool = True) -> pl.BlockSpec:
    """All T rows of the program's (row, head)."""
    if per_head:
        return pl.BlockSpec((None, t, None, d), lambda n, b, h: (b, 0, h, 0))
    if d:
        return pl.BlockSpec((None, t, d), lambda n, b, h: (b, 0, 0))
    return pl.BlockSpec((None, t), lambda n, b, h: (b, 0))


def _row_stat(block: int, reverse: bool) -> pl.BlockSpec:
    """[B, H, T] per-row statistics (lse, delta), one block (reverse: counted from the end)."""
    if reverse:
        return pl.BlockSpec((None, None, block), lambda n, b, h: (b, h, pl.num_programs(0) - 1 - n))
    return pl.BlockSpec((None, None, block), lambda n, b, h: (b, h, n))


def _whole_stat(t: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, None, t), lambda n, b, h: (b, h, 0))


# ----------------------------------------------------------------------------------- calls


def _visibility(doc_q: jax.Array, doc_k: jax.Array) -> tuple[jax.Array, ...]:
    """(doc_q, doc_k, start, end) int32 [B, T]: with each token's first index of its document and one
    past its last (doc_q sorted), which bound the kernels' block loops. The binary search unrolled:
    `searchsorted`'s default is a while loop, and on a GPU each of its log2(T) steps waits on the host."""
    start = jax.vmap(lambda d: jnp.searchsorted(d, d, side="left", method="scan_unrolled"))(doc_q).astype(jnp.int32)
    end = jax.vmap(lambda d: jnp.searchsorted(d, d, side="right", method="scan_unrolled"))(doc_q).astype(jnp.int32)
    return doc_q, doc_k, start, end


def _forward(qn, qr, kn, kr, v, vis, scale: float, blocks: Blocks, interpret: bool | None):
    b, t, h, dn = qn.shape
    dr, dv = qr.shape[-1], v.shape[-1]
    doc_q, doc_k, start, _ = vis
    bq, bk = blocks.bq, blocks.bk
    o, lse = triton_call(
        functools.partial(_fwd_kernel, scale2=scale * LOG2E, bq=bq, bk=bk),
        grid=(t // bq, b, h),
        in_specs=[_rows(bq, dn), _rows(bq, dr), _whole(t, dn), _whole(t, dr, False), _whole(t, dv),
                  _rows(bq, None, False), _whole(t, None, False), _rows(bq, None, False)],
        out_specs=[_rows(bq, dv), _row_stat(bq, reverse=True)],
        out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), v.dtype), jax.ShapeDtypeStruct((b, h, t), F32)],
        name="mla_attention_fwd",
        interpret=interpret, num_warps=blocks.warps_fwd, num_stages=blocks.stages,
    )(qn, qr, kn, kr, v, doc_q, doc_k, start)
    return o, lse


def _backward(qn, qr, kn, kr, v, vis, o, lse, do, scale: float, blocks: Blocks, interpret: bool | None):
    b, t, h, dn = qn.shape
    dr, dv = qr.shape[-1], v.shape[-1]
    doc_q, doc_k, start, end = vis
    delta = jnp.einsum("bthv,bthv->bht", o.astype(F32), do.astype(F32))  # [B, H, T]
    do = do.astype(v.dtype)
    scales = dict(scale2=scale * LOG2E, scale=scale)
    bq, bk = blocks.bq_dkv, blocks.bk_dkv
    dkn, dkr_BTHR, dvv = triton_call(
        functools.partial(_dkv_kernel, bq=bq, bk=bk, **scales),
        grid=(t // bk, b, h),
        in_specs=[_whole(t, dn), _whole(t, dr), _cols(bk, dn), _cols(bk, dr, False), _cols(bk, dv), _whole(t, dv),
                  _whole_stat(t), _whole_stat(t), _whole(t, None, False), _cols(bk, None, False),
                  _cols(bk, None, False)],
        out_specs=[_cols(bk, dn), _cols(bk, dr), _cols(bk, dv)],
        out_shape=[jax.ShapeDtypeStruct((b, t, h, dn), kn.dtype), jax.ShapeDtypeStruct((b, t, h, dr), F32),
                   jax.ShapeDtypeStruct((b, t, h, dv), v.dtype)],
        name="mla_attention_dkv",
        interpret=interpret, num_warps=blocks.warps_dkv, num_stages=blocks.stages,
    )(qn, qr, kn, kr, v, do, lse, delta, doc_q, doc_k, end)
    bq, bk = blocks.bq_dq, blocks.bk_dq
    dqn, dqr = triton_call(
        functools.partial(_dq_kernel, bq=bq, bk=bk, **scales),
        grid=(t // bq, b, h),
        in_specs=[_rows(bq, dn), _rows(bq, dr), _whole(t, dn), _whole(t, dr, False), _whole(t, dv), _rows(bq, dv),
                  _row_stat(bq, reverse=True), _row_stat(bq, reverse=True), _rows(bq, None, False),
                  _whole(t, None, False), _rows(bq, None, False)],
        out_specs=[_rows(bq, dn), _rows(bq, dr)],
        out_shape=[jax.ShapeDtypeStruct(qn.shape, qn.dtype), jax.ShapeDtypeStruct(qr.shape, qr.dtype)],
        name="mla_attention_dq",
        interpret=interpret, num_warps=blocks.warps_dq, num_stages=blocks.stages,
    )(qn, qr, kn, kr, v, do, lse, delta, doc_q, doc_k, start)
    return dqn, dqr, dkn, jnp.sum(dkr_BTHR, axis=2).astype(kr.dtype), dvv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _attention(qn, qr, kn, kr, v, vis, scale, blocks, interpret):
    return _forward(qn, qr, kn, kr, v, vis, scale, blocks, interpret)[0]


def _attention_fwd(qn, qr, kn, kr, v, vis, scale, blocks, interpret):
    o, lse = keep(*_forward(qn, qr, kn, kr, v, vis, scale, blocks, interpret))
    return o, (qn, qr, kn, kr, v, vis, o, lse)


def _attention_bwd(scale, blocks, interpret, res, do):
    qn, qr, kn, kr, v, vis, o, lse = res
    grads = _backward(qn, qr, kn, kr, v, vis, o, lse, do, scale, blocks, interpret)
    return (*grads, (None,) * len(vis))


_attention.defvjp(_attention_fwd, _attention_bwd)


def mla_attention_pallas(q_nope_BTHN: jax.Array, q_rope_BTHR: jax.Array, k_nope_BTHN: jax.Array,
                         k_rope_BTR: jax.Array, v_BTHV: jax.Array, doc_q_BT: jax.Array, doc_k_BT: jax.Array, *,
                         scale: float, blocks: Blocks = DEFAULT_BLOCKS, interpret: bool | None = None) -> jax.Array:
    """softmax(q k^T * scale, visible) v per head -> [B, T, H, V] in v's dtype, differentiable.

    q = [q_nope ‖ q_rope] per head, k = [k_nope ‖ k_rope] with one rope key per token for all heads;
    doc_q / doc_k from `documents`. Any T (padded to the tiles inside).
    """
    b, t, h, dn = q_nope_BTHN.shape
    dr, dv = q_rope_BTHR.shape[-1], v_BTHV.shape[-1]
    if not supported(dn, dr, dv):
        raise ValueError(f"mla_attention_pallas: head dims nope={dn}, rope={dr}, v={dv} must be powers of two >= 16")
    tp = -(-t // blocks.pad_to) * blocks.pad_to
    if tp != t:  # padded tokens: a document of their own after the last one, invisible as keys
        def pad(x: jax.Array, value: int | float = 0) -> jax.Array:
            return jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
        doc_q_BT = jnp.concatenate([doc_q_BT, jnp.broadcast_to(doc_q_BT[:, -1:] + 1, (b, tp - t))], axis=1)
        doc_k_BT = pad(doc_k_BT, -1)
        q_nope_BTHN, q_rope_BTHR, k_nope_BTHN, k_rope_BTR, v_BTHV = map(
            pad, (q_nope_BTHN, q_rope_BTHR, k_nope_BTHN, k_rope_BTR, v_BTHV))
    dt = v_BTHV.dtype
    o = _attention(q_nope_BTHN.astype(dt), q_rope_BTHR.astype(dt), k_nope_BTHN.astype(dt), k_rope_BTR.astype(dt),
                   v_BTHV, _visibility(doc_q_BT.astype(jnp.int32), doc_k_BT.astype(jnp.int32)), scale, blocks,
                   interpret)
    return o[:, :t]

"""Kernel bodies of the Pallas KDA path: the per-chunk math, shared by the GPU and TPU lowerings.

Everything here runs *inside* a Pallas kernel on blocks already loaded on chip (registers / shared
memory on GPU, VMEM on TPU). Notation per chunk of C rows (ARCHITECTURE.md §2.4, "chunked form"):

    G = cumsum(g) in the chunk,   At[i,j] = sum_d k_id k_jd exp(G_id - G_jd)  (j < i, same segment)
    M = (I + diag(beta) At)^-1,   W = M diag(beta m) (exp(G) * k),   U = M diag(beta) v
    V' = U - W S,   O = Qg S + Aqk V',   S_out = diag(gamma) S + Kg^T V'
    Qg = scale m exp(G) q,  Aqk[i,j] = scale sum_d q_id k_jd exp(G_id - G_jd) (j <= i, same segment)
    Kg = e exp(G_last - G) k,  gamma = m_last exp(G_last)

with m the rows that still continue the incoming state and e the rows of the chunk's last segment
(all ones without `segment_ids`). The state S is kept transposed, S^T [V, K] ("v-first"), so that
per-key-channel decays are row vectors [1, K] on both backends.

Overflow (ARCHITECTURE.md §6 item 7): exp(G_i - G_j) is never formed as exp(G_i) * exp(-G_j) over a
whole chunk. Rows are grouped into sub-chunks of 16 with reference r_a = G at the sub-chunk's first
row; E_a = exp(G_a - r_a) <= 1 and F_a = exp(r_a - G_a) <= exp(15 * 5) stay finite for the safe gate
(g >= -5), and pairs of sub-chunks are joined by exp(r_a - r_b) <= 1. All pairwise products are then
[16, K] x [K, 16] matmuls, and the 16 x 16 triangular inverses are exact products of 4 doubling
factors, combined by block forward substitution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
BC = 16  # sub-chunk rows
HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Cfg:
    """Static configuration of one KDA Pallas call (hashable; part of every jit cache key)."""

    backend: str  # "triton" (GPU) or "tpu" (Mosaic TPU)
    interpret: bool
    chunk: int  # C
    t_valid: int  # sequence length before padding to a multiple of C
    n_chunks: int
    dk: int
    dv: int
    scale: float
    gate: str | None  # None: g is the log decay; "lb": lower-bound sigmoid gate; "kimi": softplus gate
    lower_bound: float
    l2norm: bool
    segments: bool
    cd: str  # dtype of large matmul operands and stored intermediates ("bfloat16" or "float32")
    hd: str  # dtype of the stored per-chunk states
    bv: int  # value columns per program of the sequential kernels
    bv_bwd: int  # value columns per step of the V loops of the chunk-parallel backward kernels
    bk: int  # key columns per step of the K loops of the chunk-parallel kernels (dk: one step)
    warps_intra: int = 4
    warps_state: int = 4
    warps_bwd: int = 8
    stages_state: int = 2

    @property
    def exact(self) -> bool:
        return self.cd == "float32"

    @property
    def padded(self) -> bool:
        return self.t_valid != self.n_chunks * self.chunk

    @property
    def layout(self) -> str:
        return "bthd" if self.backend == "triton" else "bhtd"


# ----------------------------------------------------------------------------------------------
# small helpers that lower on both Triton and Mosaic TPU
# ----------------------------------------------------------------------------------------------


def _prec(cfg: Cfg, kind: str):
    if kind == "hi" or cfg.exact or (kind == "solve" and cfg.backend == "tpu"):
        return HI
    return lax.Precision.DEFAULT


def _cast(cfg: Cfg, x: jax.Array, kind: str) -> jax.Array:
    if kind == "lo":
        return x.astype(cfg.cd)
    return x.astype(F32)


def mm(cfg: Cfg, a: jax.Array, b: jax.Array, kind: str = "lo") -> jax.Array:
    """a [M, K] @ b [K, N] with float32 accumulation. kind: "hi" exact f32, "mid" f32 operands
    (TF32 on GPU for bf16 inputs), "solve" the triangular solve's products (TF32 on GPU for bf16
    inputs, as FLA's solve; exact f32 on TPU, whose default f32 dot is one bf16 pass), "lo"
    operands in the compute dtype."""
    return lax.dot_general(_cast(cfg, a, kind), _cast(cfg, b, kind), (((1,), (0,)), ((), ())),
                           precision=_prec(cfg, kind), preferred_element_type=F32)


def mm_nt(cfg: Cfg, a: jax.Array, b: jax.Array, kind: str = "lo") -> jax.Array:
    """a [M, K] @ b[N, K]^T."""
    if cfg.backend == "tpu":
        b = b.T
        return mm(cfg, a, b, kind)
    return lax.dot_general(_cast(cfg, a, kind), _cast(cfg, b, kind), (((1,), (1,)), ((), ())),
                           precision=_prec(cfg, kind), preferred_element_type=F32)


def mm_tn(cfg: Cfg, a: jax.Array, b: jax.Array, kind: str = "lo") -> jax.Array:
    """a[K, M]^T @ b [K, N]."""
    if cfg.backend == "tpu":
        return mm(cfg, a.T, b, kind)
    return lax.dot_general(_cast(cfg, a, kind), _cast(cfg, b, kind), (((0,), (0,)), ((), ())),
                           precision=_prec(cfg, kind), preferred_element_type=F32)


def iota(shape: tuple[int, int], dim: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def col_to_row(x: jax.Array) -> jax.Array:
    """[n, 1] -> [1, n] without a transpose (a diagonal select and a column sum)."""
    n = x.shape[0]
    return jnp.sum(jnp.where(iota((n, n), 0) == iota((n, n), 1), x, 0.0), axis=0, keepdims=True)


def kloop(cfg: Cfg, width: int, step: int, body, carry):
    """carry = body(cols, carry) over the column blocks [j*step, (j+1)*step) of a `width`-wide ref.

    On GPU a real loop (`scf.for`: one copy of the body in the program, few live registers); on
    TPU the blocks are unrolled with static slices (Mosaic wants static lane offsets; the TPU
    configuration uses one block)."""
    n = width // step
    if cfg.backend == "triton" and n > 1:
        from jax.experimental import pallas as pl

        return lax.fori_loop(0, n, lambda j, c: body(pl.ds(pl.multiple_of(j * step, step), step), c),
                             carry)
    for j in range(n):
        carry = body(slice(j * step, (j + 1) * step), carry)
    return carry


def row(x: jax.Array, i: int) -> jax.Array:
    """Row i of x [R, N] as [1, N] (a masked reduction: no dynamic register indexing)."""
    return jnp.sum(jnp.where(iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


def split_rows(cfg: Cfg, x: jax.Array, n: int) -> list[jax.Array]:
    if cfg.backend == "triton":
        return list(jnp.split(x, n, axis=0))
    s = x.shape[0] // n
    return [x[i * s:(i + 1) * s] for i in range(n)]


def split_cols(cfg: Cfg, x: jax.Array, n: int) -> list[jax.Array]:
    if cfg.backend == "triton":
        return list(jnp.split(x, n, axis=1))
    s = x.shape[1] // n
    return [x[:, i * s:(i + 1) * s] for i in range(n)]


def stack_rows(blocks: Sequence[jax.Array]) -> jax.Array:
    """[s, N] blocks -> [n s, N] (tile + select: Triton has no general concatenate)."""
    n = len(blocks)
    s, cols = blocks[0].shape
    rb = iota((n * s, cols), 0) // s
    out = None
    for i, blk in enumerate(blocks):
        t = jnp.broadcast_to(blk[None], (n, s, cols)).reshape(n * s, cols)
        out = t if out is None else jnp.where(rb == i, t, out)
    return out


def assemble(blocks: dict[tuple[int, int], jax.Array], n: int) -> jax.Array:
    """Lower block-triangular {(a, b): [s, s]} -> [n s, n s], zero where no block is given."""
    s = next(iter(blocks.values())).shape[0]
    rb = iota((n * s, n * s), 0) // s
    cb = iota((n * s, n * s), 1) // s
    out = jnp.zeros((n * s, n * s), F32)
    for (a, b), blk in blocks.items():
        t = jnp.broadcast_to(blk[None, :, None, :], (n, s, n, s)).reshape(n * s, n * s)
        out = jnp.where((rb == a) & (cb == b), t, out)
    return out


def cumsum_rows(cfg: Cfg, x: jax.Array) -> jax.Array:
    """Inclusive cumulative sum over rows, exact in float32."""
    if cfg.backend == "triton":
        return jnp.cumsum(x, axis=0)
    c = x.shape[0]
    tril = (iota((c, c), 0) >= iota((c, c), 1)).astype(F32)
    return mm(cfg, tril, x, "hi")


def revcumsum_rows(cfg: Cfg, x: jax.Array) -> jax.Array:
    """y_t = sum_{s >= t} x_s over rows."""
    return jnp.sum(x, axis=0, keepdims=True) - cumsum_rows(cfg, x) + x


def sigmoid(x: jax.Array) -> jax.Array:
    return 1.0 / (1.0 + jnp.exp(-x))


# ----------------------------------------------------------------------------------------------
# gate, L2 norm and the intra-chunk quantities
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Prep:
    q: jax.Array  # [C, K] normalised q (float32)
    k: jax.Array  # [C, K]
    rq: jax.Array | None  # [C, 1] 1 / ||q|| (None without L2 norm)
    rk: jax.Array | None
    g: jax.Array  # [C, K] log decay, zero on padding rows
    dg_dx: jax.Array | None  # [C, K] d g / d (g_raw) when the gate is fused
    dg_da: jax.Array | None  # [C, K] d g / d a_log
    beta: jax.Array  # [C, 1]
    valid: jax.Array | None  # [C, 1] bool, rows before t_valid (None when T is a chunk multiple)


def prep(cfg: Cfg, chunk_idx, q_raw, k_raw, g_raw, beta, a_log, dt_bias, norm: bool = True) -> Prep:
    """Fused gate and L2 norm, all in float32 (ARCHITECTURE.md §2.4 steps 6-7). `norm=False` leaves
    q and k raw (a block of key columns: the norms need every column and are applied later)."""
    c = cfg.chunk
    q = q_raw.astype(F32)
    k = k_raw.astype(F32)
    rq = rk = None
    if cfg.l2norm and norm:
        rq = lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + 1e-6)
        rk = lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + 1e-6)
        q = q * rq
        k = k * rk
    x = g_raw.astype(F32)
    dg_dx = dg_da = None
    if cfg.gate is None:
        g = x
    else:
        x = x + dt_bias.astype(F32)  # [1, K]
        a = jnp.exp(a_log.astype(F32))  # [1, 1]
        if cfg.gate == "lb":
            s = sigmoid(a * x)
            g = cfg.lower_bound * s
            dg_dx = (cfg.lower_bound * a) * (s * (1.0 - s))
            dg_da = dg_dx * x
        else:
            sp = jnp.where(x > 20.0, x, jnp.log(1.0 + jnp.exp(jnp.minimum(x, 20.0))))
            g = -a * sp
            dg_dx = -a * sigmoid(x)
            dg_da = g
    valid = None
    if cfg.padded:
        valid = (chunk_idx * c + iota((c, 1), 0)) < cfg.t_valid
        g = jnp.where(valid, g, 0.0)
    return Prep(q, k, rq, rk, g, dg_dx, dg_da, beta.astype(F32), valid)


@dataclasses.dataclass
class Intra:
    G: jax.Array  # [C, K] in-chunk cumulative log decay
    G_last: jax.Array  # [1, K]
    E: list[jax.Array]  # exp(G_a - r_a) per sub-chunk [16, K]
    F: list[jax.Array]  # exp(r_a - G_a)
    w: dict[tuple[int, int], jax.Array]  # exp(r_a - r_b) [1, K], b < a
    r: list[jax.Array]  # r_a [1, K]
    kb: list[jax.Array]
    qb: list[jax.Array]
    seg: dict[tuple[int, int], jax.Array] | None  # same-segment masks of sub-chunk pairs


def seg_masks(cfg: Cfg, seg_col: jax.Array | None) -> dict[tuple[int, int], jax.Array] | None:
    """Same-segment masks [16, 16] of the sub-chunk pairs (a, b), b <= a (None without segments)."""
    if seg_col is None:
        return None
    n = cfg.chunk // BC
    sb = split_rows(cfg, seg_col, n)  # [16, 1] each
    return {(a, b): sb[a] == col_to_row(sb[b]) for a in range(n) for b in range(a + 1)}


def intra(cfg: Cfg, p: Prep, seg: dict | None) -> Intra:
    n = cfg.chunk // BC
    G = cumsum_rows(cfg, p.g)
    Gb = split_rows(cfg, G, n)
    r = [row(Ga, 0) for Ga in Gb]
    E = [jnp.exp(Ga - ra) for Ga, ra in zip(Gb, r, strict=True)]
    F = [jnp.exp(ra - Ga) for Ga, ra in zip(Gb, r, strict=True)]
    w = {(a, b): jnp.exp(r[a] - r[b]) for a in range(n) for b in range(a)}
    return Intra(G, row(G, cfg.chunk - 1), E, F, w, r, split_rows(cfg, p.k, n),
                 split_rows(cfg, p.q, n), seg)


def _diag_mask(strict: bool) -> jax.Array:
    i, j = iota((BC, BC), 0), iota((BC, BC), 1)
    return i > j if strict else i >= j


def pair_blocks(cfg: Cfg, it: Intra, left: list[jax.Array], strict: bool) -> dict:
    """{(a, b): sum_d left_a[i, d] k_b[j, d] exp(G_ad - G_bd)} for b <= a, masked (j < i or j <= i
    inside a sub-chunk, same segment)."""
    n = len(left)
    out = {}
    for a in range(n):
        la = left[a] * it.E[a]
        for b in range(a + 1):
            lhs = la if b == a else la * it.w[(a, b)]
            blk = mm_nt(cfg, lhs, it.kb[b] * it.F[b], "mid")
            mask = _diag_mask(strict) if b == a else None
            if it.seg is not None:
                mask = it.seg[(a, b)] if mask is None else mask & it.seg[(a, b)]
            if mask is not None:
                blk = jnp.where(mask, blk, 0.0)
            out[(a, b)] = blk
    return out


def solve_blocks(cfg: Cfg, at: dict, beta_b: list[jax.Array]) -> dict:
    """Blocks of M = (I + diag(beta) At)^-1 (unit lower triangular), float32.

    Diagonal 16 x 16 blocks: (I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8) (A nilpotent);
    off-diagonal: M_ab = -M_aa sum_{c=b}^{a-1} A_ac M_cb.
    """
    n = len(beta_b)
    eye = (iota((BC, BC), 0) == iota((BC, BC), 1)).astype(F32)
    A = {key: beta_b[key[0]] * blk for key, blk in at.items()}
    M = {}
    for a in range(n):
        x = -A[(a, a)]
        inv = eye + x
        for _ in range(3):
            x = mm(cfg, x, x, "solve")
            inv = inv + mm(cfg, inv, x, "solve")
        M[(a, a)] = inv
    for a in range(1, n):
        for b in range(a - 1, -1, -1):
            acc = None
            for c in range(b, a):
                t = mm(cfg, A[(a, c)], M[(c, b)], "solve")
                acc = t if acc is None else acc + t
            M[(a, b)] = -mm(cfg, M[(a, a)], acc, "solve")
    return M


# ----------------------------------------------------------------------------------------------
# kernel bodies (refs are the blocks of one chunk of one head unless stated)
# ----------------------------------------------------------------------------------------------


def _unpack_inputs(cfg: Cfg, refs: list):
    q_ref, k_ref, g_ref, beta_ref = refs[:4]
    i = 4
    alog_ref = dt_ref = None
    if cfg.gate is not None:
        alog_ref, dt_ref = refs[4:6]
        i = 6
    m_ref = e_ref = s_ref = None
    if cfg.segments:
        m_ref, e_ref, s_ref = refs[i:i + 3]
        i += 3
    return (q_ref, k_ref, g_ref, beta_ref, alog_ref, dt_ref, m_ref, e_ref, s_ref), i


def _masks(cfg: Cfg, ins) -> tuple[jax.Array | None, jax.Array | None, jax.Array | None]:
    """The segment columns (m, e, s) [C, 1] float32 of the chunk (None without segments)."""
    if not cfg.segments:
        return None, None, None
    return tuple(r[...].astype(F32) for r in ins[6:9])


def block_prep(cfg: Cfg, ins, ci, cols, rq: jax.Array | None, rk: jax.Array | None) -> Prep:
    """`prep` of one block of key columns of chunk `ci` (read outside any loop: the interpreter
    cannot discharge a program id inside one); q and k scaled by the inverse norms when given."""
    q_ref, k_ref, g_ref, beta_ref, alog_ref, dt_ref = ins[:6]
    p = prep(cfg, ci, q_ref[:, cols], k_ref[:, cols], g_ref[:, cols], beta_ref[...],
             None if alog_ref is None else alog_ref[...], None if dt_ref is None else dt_ref[:, cols],
             norm=False)
    if rq is None:
        return p
    return dataclasses.replace(p, q=p.q * rq, k=p.k * rk, rq=rq, rk=rk)


def inv_norms(cfg: Cfg, ins) -> tuple[jax.Array, jax.Array]:
    """1 / ||q||, 1 / ||k|| [C, 1] of the chunk's rows, summed over blocks of key columns."""
    q_ref, k_ref = ins[:2]
    zero = jnp.zeros((cfg.chunk, 1), F32)

    def step(cols, carry):
        q = q_ref[:, cols].astype(F32)
        k = k_ref[:, cols].astype(F32)
        return (carry[0] + jnp.sum(q * q, axis=1, keepdims=True),
                carry[1] + jnp.sum(k * k, axis=1, keepdims=True))

    sq, sk = kloop(cfg, cfg.dk, cfg.bk, step, (zero, zero))
    return lax.rsqrt(sq + 1e-6), lax.rsqrt(sk + 1e-6)


def _chunk_index(cfg: Cfg):
    return pl_program_id(2)


def pl_program_id(axis: int):
    from jax.experimental import pallas as pl

    return pl.program_id(axis)


@dataclasses.dataclass
class Pairs:
    """The pairwise products of one chunk as [16, 16] sub-chunk blocks {(a, b): [16, 16]}, b <= a:
    At (strictly lower, k on both sides) and Aqk (lower, q on the left; unscaled), L2-normalised and
    masked, with the inverse norms [C, 1] (None without the L2 norm)."""

    at: dict[tuple[int, int], jax.Array]
    aqk: dict[tuple[int, int], jax.Array]
    rq: jax.Array | None
    rk: jax.Array | None


def chunk_pairs(cfg: Cfg, ins, seg: dict | None, with_aqk: bool) -> Pairs:
    """At (and Aqk) of one chunk, accumulated over blocks of `cfg.bk` key columns.

    Each step loads a [C, bk] column block of q, k and the gate input, computes the gate and its
    in-chunk cumulative sum for those channels (both are per channel), and adds the block's share of
    every pairwise product; the L2 norms (which need all columns) scale the sums afterwards, since
    At and Aqk are bilinear in k and q. A program thus holds [C, bk] tiles, not [C, K] ones."""
    n = cfg.chunk // BC
    ci = _chunk_index(cfg)
    keys = [(a, b) for a in range(n) for b in range(a + 1)]
    zero_blocks = {key: jnp.zeros((BC, BC), F32) for key in keys}
    zero_col = jnp.zeros((cfg.chunk, 1), F32)

    def step(cols, carry):
        sq, sk, at, aqk = carry
        p = block_prep(cfg, ins, ci, cols, None, None)
        it = intra(cfg, p, seg)
        at_j = pair_blocks(cfg, it, it.kb, strict=True)
        at = {key: at[key] + at_j[key] for key in keys}
        if with_aqk:
            aqk_j = pair_blocks(cfg, it, it.qb, strict=False)
            aqk = {key: aqk[key] + aqk_j[key] for key in keys}
        if cfg.l2norm:
            sq = sq + jnp.sum(p.q * p.q, axis=1, keepdims=True)
            sk = sk + jnp.sum(p.k * p.k, axis=1, keepdims=True)
        return sq, sk, at, aqk

    sq, sk, at, aqk = kloop(cfg, cfg.dk, cfg.bk, step,
                            (zero_col, zero_col, zero_blocks, zero_blocks if with_aqk else {}))
    rq = rk = None
    if cfg.l2norm:
        rq = lax.rsqrt(sq + 1e-6)
        rk = lax.rsqrt(sk + 1e-6)
        rkb, rqb = split_rows(cfg, rk, n), split_rows(cfg, rq, n)
        rkr = [col_to_row(x) for x in rkb]
        at = {(a, b): rkb[a] * blk * rkr[b] for (a, b), blk in at.items()}
        aqk = {(a, b): rqb[a] * blk * rkr[b] for (a, b), blk in aqk.items()}
    return Pairs(at, aqk, rq, rk)


def fwd_intra_kernel(cfg: Cfg, *refs):
    """Chunk-parallel forward, one (batch, head, chunk) per program.

    Reads q, k, v, the gate input, beta (and a_log, dt_bias, segment masks); computes the gate, the
    L2 norms, the in-chunk cumulative decay, At, the triangular inverse M and W, U, Qg, Kg, Aqk and
    gamma on chip; writes W, U, Qg, Kg [C, K|V], Aqk [C, C] (compute dtype) and gamma [1, K].
    Three loops over column blocks keep the live tiles at [C, bk]: At/Aqk (`chunk_pairs`), then
    W = M diag(beta m) (exp(G) * k), Qg, Kg, gamma per key block (the gate and cumulative sum are
    recomputed: elementwise work and a column scan), then U = M diag(beta) v per value block.
    """
    ins, i = _unpack_inputs(cfg, list(refs))
    v_ref = refs[i]
    w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gam_ref = refs[i + 1:i + 7]
    n, c = cfg.chunk // BC, cfg.chunk
    m, e, s = _masks(cfg, ins)
    pr = chunk_pairs(cfg, ins, seg_masks(cfg, s), with_aqk=True)
    beta = ins[3][...].astype(F32)
    M = assemble(solve_blocks(cfg, pr.at, split_rows(cfg, beta, n)), n)  # [C, C]
    aqk_ref[...] = (cfg.scale * assemble(pr.aqk, n)).astype(aqk_ref.dtype)
    coef = beta if m is None else beta * m
    ci = _chunk_index(cfg)

    def key_block(cols, carry):
        p = block_prep(cfg, ins, ci, cols, pr.rq, pr.rk)
        q, k = p.q, p.k
        G = cumsum_rows(cfg, p.g)
        G_last = row(G, c - 1)
        eg = jnp.exp(G)
        w_ref[:, cols] = mm(cfg, M, coef * eg * k).astype(w_ref.dtype)
        qg = cfg.scale * eg * q
        kappa = jnp.exp(G_last - G)
        gam = jnp.exp(G_last)
        if m is not None:
            qg = qg * m
            kappa = kappa * e
            gam = gam * row(m, c - 1)
        qg_ref[:, cols] = qg.astype(qg_ref.dtype)
        kg_ref[:, cols] = (k * kappa).astype(kg_ref.dtype)
        gam_ref[:, cols] = gam
        return carry

    def value_block(cols, carry):
        u_ref[:, cols] = mm(cfg, M, beta * v_ref[:, cols].astype(F32)).astype(u_ref.dtype)
        return carry

    kloop(cfg, cfg.dk, cfg.bk, key_block, None)
    kloop(cfg, cfg.dv, min(cfg.bk, cfg.dv), value_block, None)


def bwd_intra_kernel(cfg: Cfg, *refs):
    """Chunk-parallel backward, part 1: everything that lives at the [C, C] level.

    Recomputes At and M on chip, loops over value blocks of dO, V', dV', v to form dAqk = dO V'^T and
    dL = -M^T dV' V'^T, writes dv = beta M^T dV' directly, and emits X = scale mask(dAqk),
    Y = beta mask(dL) and M ([C, C] float32) plus the beta gradient of the At and U terms.
    """
    ins, i = _unpack_inputs(cfg, list(refs))
    v_ref, do_ref, vn_ref, dvn_ref = refs[i:i + 4]
    x_ref, y_ref, mo_ref, dbeta_ref, dv_ref = refs[i + 4:i + 9]
    n = cfg.chunk // BC
    c = cfg.chunk
    s = _masks(cfg, ins)[2]
    beta = ins[3][...].astype(F32)
    at = chunk_pairs(cfg, ins, seg_masks(cfg, s), with_aqk=False).at
    M = assemble(solve_blocks(cfg, at, split_rows(cfg, beta, n)), n)
    at_full = assemble(at, n)
    daqk = jnp.zeros((c, c), F32)
    d1 = jnp.zeros((c, c), F32)
    dbeta = jnp.zeros((c, 1), F32)
    bv = cfg.bv_bwd
    for j in range(cfg.dv // bv):
        cols = slice(j * bv, (j + 1) * bv)
        do = do_ref[:, cols]
        vn = vn_ref[:, cols]
        dvn = dvn_ref[:, cols]
        daqk = daqk + mm_nt(cfg, do, vn)
        d1 = d1 + mm_nt(cfg, dvn, vn)
        dbu = mm_tn(cfg, M, dvn, "mid")
        dv_ref[:, cols] = (beta * dbu).astype(dv_ref.dtype)
        dbeta = dbeta + jnp.sum(dbu * v_ref[:, cols].astype(F32), axis=1, keepdims=True)
    ri, ci = iota((c, c), 0), iota((c, c), 1)
    dl = -mm_tn(cfg, M, d1, "mid")
    da = jnp.where(ri > ci, dl, 0.0)
    xm = jnp.where(ri >= ci, daqk, 0.0)
    if s is not None:
        same = s == jnp.sum(jnp.where(ri == ci, s, 0.0), axis=0, keepdims=True)
        da = jnp.where(same, da, 0.0)
        xm = jnp.where(same, xm, 0.0)
    dbeta = dbeta + jnp.sum(da * at_full, axis=1, keepdims=True)
    x_ref[...] = cfg.scale * xm
    y_ref[...] = beta * da
    mo_ref[...] = M
    dbeta_ref[...] = dbeta


def bwd_main_kernel(cfg: Cfg, *refs):
    """Chunk-parallel backward, part 2: the [C, K] level, ending in dq, dk, dg (raw gate), dbeta.

    One loop over blocks of `cfg.bk` key columns (all of this is per key channel): per block, a loop
    over value blocks of the chunk's state S^T and its gradient dS^T ([V, K], v-first) with dO, V',
    dV' forms dQg = dO S^T, dKg = V' dS^T, dW = -dV' S^T and d gamma; then the chain through
    W = M B_w, Qg, Kg, gamma, the two pairwise exp(G_i - G_j) forms (X, Y from part 1, sub-chunk
    factorised), the reverse cumulative sum and the gate. The L2 norm's backward needs a sum over
    all key columns: with the norm, dq/dk are written as rq * dq_hat (float32) together with the
    per-row coefficients rq^2 sum(q_hat * dq_hat), and `pallas._core_bwd` finishes
    dq = rq dq_hat - q * coef (likewise dk) in one elementwise pass.
    """
    ins, i = _unpack_inputs(cfg, list(refs))
    do_ref, vn_ref, dvn_ref, h_ref, dh_ref, m2_ref, x_ref, y_ref, dbp_ref = refs[i:i + 9]
    outs = refs[i + 9:]
    dq_ref, dk_ref, dg_ref, dbeta_ref = outs[:4]
    n, c, bk = cfg.chunk // BC, cfg.chunk, cfg.bk
    m, e, _ = _masks(cfg, ins)
    rq, rk = inv_norms(cfg, ins) if cfg.l2norm else (None, None)
    M = m2_ref[...]
    zero_col = jnp.zeros((c, 1), F32)
    ci = _chunk_index(cfg)

    def xy(ref, a: int, b: int) -> jax.Array:
        return ref[a * BC:(a + 1) * BC, b * BC:(b + 1) * BC]

    def value_block(cols):
        def step(vc, acc):
            dqg, dkg, dw, dgam = acc
            ht = h_ref[vc, cols]
            dht = dh_ref[vc, cols]
            return (dqg + mm(cfg, do_ref[:, vc], ht), dkg + mm(cfg, vn_ref[:, vc], dht),
                    dw - mm(cfg, dvn_ref[:, vc], ht),
                    dgam + jnp.sum(ht.astype(F32) * dht.astype(F32), axis=0, keepdims=True))

        z = jnp.zeros((c, bk), F32)
        return kloop(cfg, cfg.dv, cfg.bv_bwd, step, (z, z, z, jnp.zeros((1, bk), F32)))

    def key_block(cols, carry):
        dbeta, sq, sk = carry
        p = block_prep(cfg, ins, ci, cols, rq, rk)
        it = intra(cfg, p, None)  # X and Y arrive masked
        dqg, dkg, dw, dgam = value_block(cols)
        dbw = mm_tn(cfg, M, dw, "mid")
        gam = jnp.exp(it.G)
        qh, kh = p.q, p.k
        mg = gam if m is None else gam * m
        dqh = (cfg.scale * mg) * dqg
        dG = dqh * qh
        t = (p.beta * mg) * dbw
        dG = dG + t * kh
        dbeta = dbeta + jnp.sum(dbw * mg * kh, axis=1, keepdims=True)
        kappa = jnp.exp(it.G_last - it.G)
        if e is not None:
            kappa = kappa * e
        dkh = t + dkg * kappa
        z = dkg * kh * kappa
        dG = dG - z
        gl = jnp.exp(it.G_last)
        if m is not None:
            gl = gl * row(m, c - 1)
        last = jnp.sum(z, axis=0, keepdims=True) + dgam * gl
        dG = dG + jnp.where(iota((c, 1), 0) == c - 1, last, 0.0)
        # pairwise forms: X (Aqk, q on the left) and Y (At, k on the left), 16x16 blocks.
        kf = [kb * F for kb, F in zip(it.kb, it.F, strict=True)]
        ke = [kb * E for kb, E in zip(it.kb, it.E, strict=True)]
        qe = [qb * E for qb, E in zip(it.qb, it.E, strict=True)]
        rx, ry, cx, cy = [], [], [], []
        for a in range(n):
            accx = accy = None
            for b in range(a + 1):
                rhs = kf[b] if b == a else kf[b] * it.w[(a, b)]
                tx = mm(cfg, xy(x_ref, a, b), rhs, "mid")
                ty = mm(cfg, xy(y_ref, a, b), rhs, "mid")
                accx = tx if accx is None else accx + tx
                accy = ty if accy is None else accy + ty
            rx.append(it.E[a] * accx)
            ry.append(it.E[a] * accy)
        for b in range(n):
            accx = accy = None
            for a in range(b, n):
                rq_ = qe[a] if a == b else qe[a] * it.w[(a, b)]
                rk_ = ke[a] if a == b else ke[a] * it.w[(a, b)]
                tx = mm_tn(cfg, xy(x_ref, a, b), rq_, "mid")
                ty = mm_tn(cfg, xy(y_ref, a, b), rk_, "mid")
                accx = tx if accx is None else accx + tx
                accy = ty if accy is None else accy + ty
            cx.append(it.F[b] * accx)
            cy.append(it.F[b] * accy)
        RX, RY, CX, CY = stack_rows(rx), stack_rows(ry), stack_rows(cx), stack_rows(cy)
        dqh = dqh + RX
        dkh = dkh + RY + CX + CY
        dG = dG + qh * RX + kh * (RY - CX - CY)
        dg = revcumsum_rows(cfg, dG)
        if p.valid is not None:
            dg = jnp.where(p.valid, dg, 0.0)
        if cfg.gate is not None:
            pa_ref, pb_ref = outs[4:6]
            dgraw = dg * p.dg_dx
            pa_ref[:, cols] = jnp.sum(dg * p.dg_da, axis=0, keepdims=True)
            pb_ref[:, cols] = jnp.sum(dgraw, axis=0, keepdims=True)
        else:
            dgraw = dg
        if cfg.l2norm:
            sq = sq + jnp.sum(qh * dqh, axis=1, keepdims=True)
            sk = sk + jnp.sum(kh * dkh, axis=1, keepdims=True)
            dqh, dkh = rq * dqh, rk * dkh
        dq_ref[:, cols] = dqh.astype(dq_ref.dtype)
        dk_ref[:, cols] = dkh.astype(dk_ref.dtype)
        dg_ref[:, cols] = dgraw.astype(dg_ref.dtype)
        return dbeta, sq, sk

    dbeta, sq, sk = kloop(cfg, cfg.dk, bk, key_block, (dbp_ref[...], zero_col, zero_col))
    dbeta_ref[...] = dbeta.astype(dbeta_ref.dtype)
    if cfg.l2norm:
        cq_ref, ck_ref = outs[-2:]
        cq_ref[...] = rq * rq * sq
        ck_ref[...] = rk * rk * sk


# ----------------------------------------------------------------------------------------------
# sequential per-chunk steps (state S^T [BV, K] float32 carried on chip)
# ----------------------------------------------------------------------------------------------


def fwd_state_step(cfg: Cfg, st, w, u, qg, kg, aqk, gam):
    """One chunk of the forward recurrence. st: S^T [BV, K] f32; returns (o, v', st_next)."""
    sc = st.astype(cfg.cd)
    vn = u.astype(F32) - mm_nt(cfg, w, sc)
    o = mm_nt(cfg, qg, sc) + mm(cfg, aqk, vn.astype(cfg.cd))
    st = st * gam + mm_tn(cfg, vn.astype(cfg.cd), kg)
    return o, vn, st


def bwd_state_step(cfg: Cfg, dst, qg, w, kg, aqk, gam, do):
    """One chunk of the reverse recurrence. dst: dS_out^T [BV, K] f32; returns (dV', dS_in^T)."""
    dsc = dst.astype(cfg.cd)
    do = do.astype(cfg.cd)
    dvn = mm_tn(cfg, aqk, do) + mm_nt(cfg, kg, dsc)
    dst = dst * gam + mm_tn(cfg, do, qg) - mm_tn(cfg, dvn.astype(cfg.cd), w)
    return dvn, dst

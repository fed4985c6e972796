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
    warps_intra: int = 4
    split_intra: bool = False  # fwd_intra as two launches (W/U; Qg/Kg/Aqk/gamma): not yet timed
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
    if kind == "hi" or cfg.exact:
        return HI
    return lax.Precision.DEFAULT


def _cast(cfg: Cfg, x: jax.Array, kind: str) -> jax.Array:
    if kind == "lo":
        return x.astype(cfg.cd)
    return x.astype(F32)


def mm(cfg: Cfg, a: jax.Array, b: jax.Array, kind: str = "lo") -> jax.Array:
    """a [M, K] @ b [K, N] with float32 accumulation. kind: "hi" exact f32, "mid" f32 operands
    (TF32 on GPU for bf16 inputs), "lo" operands in the compute dtype."""
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


def prep(cfg: Cfg, chunk_idx, q_raw, k_raw, g_raw, beta, a_log, dt_bias) -> Prep:
    """Fused gate and L2 norm, all in float32 (ARCHITECTURE.md §2.4 steps 6-7)."""
    c = cfg.chunk
    q = q_raw.astype(F32)
    k = k_raw.astype(F32)
    rq = rk = None
    if cfg.l2norm:
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


def intra(cfg: Cfg, p: Prep, seg_col: jax.Array | None) -> Intra:
    n = cfg.chunk // BC
    G = cumsum_rows(cfg, p.g)
    Gb = split_rows(cfg, G, n)
    r = [row(Ga, 0) for Ga in Gb]
    E = [jnp.exp(Ga - ra) for Ga, ra in zip(Gb, r, strict=True)]
    F = [jnp.exp(ra - Ga) for Ga, ra in zip(Gb, r, strict=True)]
    w = {(a, b): jnp.exp(r[a] - r[b]) for a in range(n) for b in range(a)}
    seg = None
    if seg_col is not None:
        sb = split_rows(cfg, seg_col, n)  # [16, 1] each
        seg = {}
        for a in range(n):
            for b in range(a + 1):
                # [16,1] == [1,16] without transposes: compare against a broadcast row.
                srow = jnp.sum(jnp.where(iota((BC, BC), 0) == iota((BC, BC), 1), sb[b], 0.0), axis=0,
                               keepdims=True)
                seg[(a, b)] = sb[a] == srow
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
            x = mm(cfg, x, x, "hi")
            inv = inv + mm(cfg, inv, x, "hi")
        M[(a, a)] = inv
    for a in range(1, n):
        for b in range(a - 1, -1, -1):
            acc = None
            for c in range(b, a):
                t = mm(cfg, A[(a, c)], M[(c, b)], "hi")
                acc = t if acc is None else acc + t
            M[(a, b)] = -mm(cfg, M[(a, a)], acc, "hi")
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


def _load_prep(cfg: Cfg, chunk_idx, refs):
    q_ref, k_ref, g_ref, beta_ref, alog_ref, dt_ref, m_ref, e_ref, s_ref = refs
    p = prep(cfg, chunk_idx, q_ref[...], k_ref[...], g_ref[...], beta_ref[...],
             None if alog_ref is None else alog_ref[...], None if dt_ref is None else dt_ref[...])
    if cfg.segments:
        m = m_ref[...].astype(F32)
        e = e_ref[...].astype(F32)
        s = s_ref[...].astype(F32)
    else:
        m = e = s = None
    return p, m, e, s


def _chunk_index(cfg: Cfg):
    return pl_program_id(2)


def pl_program_id(axis: int):
    from jax.experimental import pallas as pl

    return pl.program_id(axis)


def _fwd_wu(cfg: Cfg, p: Prep, m, it: Intra, v, w_ref, u_ref) -> None:
    """W = M diag(beta m) (exp(G) * k) and U = M diag(beta) v of one chunk, written to w_ref, u_ref."""
    n = cfg.chunk // BC
    at = pair_blocks(cfg, it, it.kb, strict=True)
    beta_b = split_rows(cfg, p.beta, n)
    M = solve_blocks(cfg, at, beta_b)
    v_b = split_rows(cfg, v.astype(F32), n)
    m_b = split_rows(cfg, m, n) if m is not None else None
    bws, bus = [], []
    for a in range(n):
        gam_a = it.E[a] * jnp.exp(it.r[a])  # exp(G_a) without forming exp(-G)
        coef = beta_b[a] if m_b is None else beta_b[a] * m_b[a]
        bws.append(coef * gam_a * it.kb[a])
        bus.append(beta_b[a] * v_b[a])
    for a in range(n):
        w_acc = u_acc = None
        for b in range(a + 1):
            tw = mm(cfg, M[(a, b)], bws[b])
            tu = mm(cfg, M[(a, b)], bus[b])
            w_acc = tw if w_acc is None else w_acc + tw
            u_acc = tu if u_acc is None else u_acc + tu
        w_ref[a * BC:(a + 1) * BC, :] = w_acc.astype(w_ref.dtype)
        u_ref[a * BC:(a + 1) * BC, :] = u_acc.astype(u_ref.dtype)


def _fwd_qk(cfg: Cfg, p: Prep, m, e, it: Intra, qg_ref, kg_ref, aqk_ref, gam_ref) -> None:
    """Qg, Kg, Aqk and gamma of one chunk, written to their refs."""
    n = cfg.chunk // BC
    m_b = split_rows(cfg, m, n) if m is not None else None
    for a in range(n):
        qg_a = cfg.scale * it.E[a] * jnp.exp(it.r[a]) * it.qb[a]
        if m_b is not None:
            qg_a = qg_a * m_b[a]
        qg_ref[a * BC:(a + 1) * BC, :] = qg_a.astype(qg_ref.dtype)
    aqk = pair_blocks(cfg, it, it.qb, strict=False)
    aqk_ref[...] = (cfg.scale * assemble(aqk, n)).astype(aqk_ref.dtype)
    kappa = jnp.exp(it.G_last - it.G)
    if e is not None:
        kappa = kappa * e
    kg_ref[...] = (p.k * kappa).astype(kg_ref.dtype)
    gam = jnp.exp(it.G_last)
    if m is not None:
        gam = gam * row(m, cfg.chunk - 1)
    gam_ref[...] = gam


def fwd_intra_kernel(cfg: Cfg, *refs):
    """Chunk-parallel forward, one (batch, head, chunk) per program.

    Reads q, k, v, the gate input, beta (and a_log, dt_bias, segment masks); computes the gate, the
    L2 norms, the in-chunk cumulative decay, At, the triangular inverse M and W, U, Qg, Kg, Aqk and
    gamma, all on chip; writes W, U, Qg, Kg [C, K|V], Aqk [C, C] (compute dtype) and gamma [1, K].
    With `cfg.split_intra` this is two launches, `fwd_wu_kernel` and `fwd_qk_kernel`, each
    recomputing the gate, norms and decays (fewer live registers per program).
    """
    ins, i = _unpack_inputs(cfg, list(refs))
    v_ref = refs[i]
    w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gam_ref = refs[i + 1:i + 7]
    p, m, e, s = _load_prep(cfg, _chunk_index(cfg), ins)
    it = intra(cfg, p, s)
    _fwd_wu(cfg, p, m, it, v_ref[...], w_ref, u_ref)
    _fwd_qk(cfg, p, m, e, it, qg_ref, kg_ref, aqk_ref, gam_ref)


def fwd_wu_kernel(cfg: Cfg, *refs):
    """The W, U half of `fwd_intra_kernel` (At, the triangular solve, the two products)."""
    ins, i = _unpack_inputs(cfg, list(refs))
    p, m, _, s = _load_prep(cfg, _chunk_index(cfg), ins)
    _fwd_wu(cfg, p, m, intra(cfg, p, s), refs[i][...], refs[i + 1], refs[i + 2])


def fwd_qk_kernel(cfg: Cfg, *refs):
    """The Qg, Kg, Aqk, gamma half of `fwd_intra_kernel`."""
    ins, i = _unpack_inputs(cfg, list(refs))
    p, m, e, s = _load_prep(cfg, _chunk_index(cfg), ins)
    _fwd_qk(cfg, p, m, e, intra(cfg, p, s), *refs[i:i + 4])


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
    p, _m, _e, s = _load_prep(cfg, _chunk_index(cfg), ins)
    it = intra(cfg, p, s)
    at = pair_blocks(cfg, it, it.kb, strict=True)
    beta_b = split_rows(cfg, p.beta, n)
    M = assemble(solve_blocks(cfg, at, beta_b), n)
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
        dv_ref[:, cols] = (p.beta * dbu).astype(dv_ref.dtype)
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
    y_ref[...] = p.beta * da
    mo_ref[...] = M
    dbeta_ref[...] = dbeta


def bwd_main_kernel(cfg: Cfg, *refs):
    """Chunk-parallel backward, part 2: the [C, K] level, ending in dq, dk, dg (raw gate), dbeta.

    Loops over value blocks of the chunk's state S^T and its gradient dS^T ([V, K], v-first) with
    dO, V', dV' to form dQg = dO S^T, dKg = V' dS^T, dW = -dV' S^T and d gamma; then chains through
    W = M B_w, Qg, Kg, gamma, the two pairwise exp(G_i - G_j) forms (X, Y from part 1, sub-chunk
    factorised), the reverse cumulative sum, the gate and the L2 norm. Nothing [C, K] leaves the chip
    except the four gradients.
    """
    ins, i = _unpack_inputs(cfg, list(refs))
    do_ref, vn_ref, dvn_ref, h_ref, dh_ref, m2_ref, x_ref, y_ref, dbp_ref = refs[i:i + 9]
    outs = refs[i + 9:]
    dq_ref, dk_ref, dg_ref, dbeta_ref = outs[:4]
    n = cfg.chunk // BC
    c = cfg.chunk
    p, m, e, s = _load_prep(cfg, _chunk_index(cfg), ins)
    it = intra(cfg, p, s)
    dqg = jnp.zeros((c, cfg.dk), F32)
    dkg = jnp.zeros((c, cfg.dk), F32)
    dw = jnp.zeros((c, cfg.dk), F32)
    dgam = jnp.zeros((1, cfg.dk), F32)
    bv = cfg.bv_bwd
    for j in range(cfg.dv // bv):
        cols = slice(j * bv, (j + 1) * bv)
        ht = h_ref[cols, :]
        dht = dh_ref[cols, :]
        dqg = dqg + mm(cfg, do_ref[:, cols], ht)
        dkg = dkg + mm(cfg, vn_ref[:, cols], dht)
        dw = dw - mm(cfg, dvn_ref[:, cols], ht)
        dgam = dgam + jnp.sum(ht.astype(F32) * dht.astype(F32), axis=0, keepdims=True)
    M = m2_ref[...]
    dbw = mm_tn(cfg, M, dw, "mid")
    gam = jnp.exp(it.G)
    qh, kh = p.q, p.k
    mg = gam if m is None else gam * m
    dqh = (cfg.scale * mg) * dqg
    dG = dqh * qh
    t = (p.beta * mg) * dbw
    dkh = t
    dG = dG + t * kh
    dbeta = dbp_ref[...] + jnp.sum(dbw * mg * kh, axis=1, keepdims=True)
    kappa = jnp.exp(it.G_last - it.G)
    if e is not None:
        kappa = kappa * e
    dkh = dkh + dkg * kappa
    z = dkg * kh * kappa
    dG = dG - z
    gl = jnp.exp(it.G_last)
    if m is not None:
        gl = gl * row(m, c - 1)
    last = jnp.sum(z, axis=0, keepdims=True) + dgam * gl
    dG = dG + jnp.where(iota((c, 1), 0) == c - 1, last, 0.0)
    # pairwise forms: X (Aqk, q on the left) and Y (At, k on the left), split into 16x16 blocks.
    xb = [split_cols(cfg, r_, n) for r_ in split_rows(cfg, x_ref[...], n)]
    yb = [split_cols(cfg, r_, n) for r_ in split_rows(cfg, y_ref[...], n)]
    kf = [kb * F for kb, F in zip(it.kb, it.F, strict=True)]
    ke = [kb * E for kb, E in zip(it.kb, it.E, strict=True)]
    qe = [qb * E for qb, E in zip(it.qb, it.E, strict=True)]
    rx, ry, cx, cy = [], [], [], []
    for a in range(n):
        accx = accy = None
        for b in range(a + 1):
            rhs = kf[b] if b == a else kf[b] * it.w[(a, b)]
            tx = mm(cfg, xb[a][b], rhs, "mid")
            ty = mm(cfg, yb[a][b], rhs, "mid")
            accx = tx if accx is None else accx + tx
            accy = ty if accy is None else accy + ty
        rx.append(it.E[a] * accx)
        ry.append(it.E[a] * accy)
    for b in range(n):
        accx = accy = None
        for a in range(b, n):
            rq_ = qe[a] if a == b else qe[a] * it.w[(a, b)]
            rk_ = ke[a] if a == b else ke[a] * it.w[(a, b)]
            tx = mm_tn(cfg, xb[a][b], rq_, "mid")
            ty = mm_tn(cfg, yb[a][b], rk_, "mid")
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
        pa_ref[...] = jnp.sum(dg * p.dg_da, axis=0, keepdims=True)
        pb_ref[...] = jnp.sum(dgraw, axis=0, keepdims=True)
    else:
        dgraw = dg
    if cfg.l2norm:
        dqh = p.rq * (dqh - qh * jnp.sum(qh * dqh, axis=1, keepdims=True))
        dkh = p.rk * (dkh - kh * jnp.sum(kh * dkh, axis=1, keepdims=True))
    dq_ref[...] = dqh.astype(dq_ref.dtype)
    dk_ref[...] = dkh.astype(dk_ref.dtype)
    dg_ref[...] = dgraw.astype(dg_ref.dtype)
    dbeta_ref[...] = dbeta.astype(dbeta_ref.dtype)


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

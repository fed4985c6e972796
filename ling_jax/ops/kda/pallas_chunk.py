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
row; rows i of sub-chunk a pair with every column j <= i through exp(G_i - r_a) <= 1 and
exp(r_a - G_j), which is <= 1 for earlier sub-chunks and <= exp(15 * 5) inside sub-chunk a for the
safe gate (g >= -5). The pairwise products are then [16, bk] x [bk, C] matmuls per sub-chunk, and
the triangular inverse is a short product of [C, C] doubling factors (`solve`).

The chunk-parallel kernels loop over blocks of `Cfg.bk` key columns (everything except the L2 norms
is per key channel), so a program holds [C, bk] tiles and one copy of the loop body.
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
EXP_CAP = 80.0  # largest exponent a pairwise factor may take (exp(80) ~ 5.5e34; float32 overflows at ~88.7)
# The data the sub-chunk factorisation represents exactly: every step's log decay, and the decay from a
# sub-chunk's first row to its last, >= -EXP_RANGE. Inside a sub-chunk a factor reaches exp(-15 g); the
# range keeps 5 below the cap so that a factor times a small q/k entry stays a normal float (flushed
# subnormals lost terms at the cap), and bounds |G| in a chunk (its cumulative sum cancels).
EXP_RANGE = 75.0
SAFE_LOG_DECAY = -EXP_RANGE / (BC - 1)  # -5: a safe gate with a lower bound in [SAFE_LOG_DECAY, 0] always fits


def bounded_gate(lower_bound: float | None) -> bool:
    """Whether the safe gate with this lower bound keeps every decay in range by construction."""
    return lower_bound is not None and SAFE_LOG_DECAY <= lower_bound <= 0.0


def decay_in_range(g: jax.Array, per_sequence: bool = False) -> jax.Array:
    """Whether the sub-chunk factorisation is exact for the log decay g [B, T, H, K] (any chunk size):
    -EXP_RANGE <= g <= 0, and inside every 16-row sub-chunk the decay from its first row to its last
    (the largest exponent a factor takes) is >= -EXP_RANGE. A scalar, or [B, H] per (sequence, head)
    with `per_sequence` (the kernels run each on its own)."""
    b, t, h, dk = g.shape
    rows = -(-t // BC) * BC
    gs = jnp.pad(g.astype(F32), ((0, 0), (0, rows - t), (0, 0), (0, 0))).reshape(b, rows // BC, BC, h, dk)
    axes = (1, 2, 4) if per_sequence else None
    return ((jnp.max(gs, axes) <= 0.0) & (jnp.min(gs, axes) >= -EXP_RANGE)
            & (jnp.min(jnp.sum(gs[:, :, 1:], axis=2), None if axes is None else (1, 3)) >= -EXP_RANGE))


def supports(chunk: int, dk: int, dv: int) -> bool:
    """Whether the kernels take this chunk size and these head dims (powers of two >= 16)."""
    return chunk in (16, 32, 64, 128) and all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv))


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
    bk: int  # key columns per step of the pairwise kernels' K loops / per bwd_pairs program (dk: one)
    bk_kv: int  # key columns per step of fwd_wu's K loop / per bwd_dqkg program (no [C, C] work per block)
    warps_pairs: int = 4  # the [C, C]-level kernels (fwd_pairs, bwd_intra)
    warps_wu: int = 4  # fwd_wu
    warps_state: int = 4  # the sequential kernels
    warps_dqkg: int = 4  # bwd_dqkg
    warps_bwd_pairs: int = 4  # bwd_pairs
    stages_state: int = 2
    stages_chunk: int = 1  # software-pipelining stages of the chunk-parallel kernels' column loops

    def __post_init__(self) -> None:
        for name in ("bk", "bk_kv"):
            if getattr(self, name) > self.dk or self.dk % getattr(self, name):
                raise ValueError(f"key block {name}={getattr(self, name)} must divide K={self.dk}")
            if self.backend == "tpu" and not self.interpret and getattr(self, name) != self.dk \
                    and getattr(self, name) % 128:
                raise ValueError(f"key block {name}={getattr(self, name)}: on TPU K={self.dk} or a multiple "
                                 "of 128 (the backward's blocks of key columns are lane-dim blocks)")
        if self.chunk % BC:
            raise ValueError(f"chunk={self.chunk} must be a multiple of {BC}")

    @property
    def exact(self) -> bool:
        return self.cd == "float32"

    @property
    def padded(self) -> bool:
        return self.t_valid != self.n_chunks * self.chunk

    @property
    def layout(self) -> str:
        return "bthd" if self.backend == "triton" else "bhtd"

    @property
    def key_axis_last(self) -> bool:
        """Where the backward's key-block grid axis goes: first on GPU (Triton's fastest axis: a chunk's
        key blocks run together and share their [C, V] and [C, C] inputs through L2; the axis last is
        slower, docs/kernels.md), last on TPU (the leading "parallel" axes are then B and H, which a
        megacore splits between its cores, never a key-block axis of size 1)."""
        return self.backend == "tpu"


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
    """One block of key columns of a chunk, in float32: q, k (raw or L2-normalised, see
    `block_prep`), the gate's log decay and its derivatives, beta and the valid-row mask."""

    q: jax.Array  # [C, bk]
    k: jax.Array  # [C, bk]
    g: jax.Array  # [C, bk] log decay, zero on padding rows
    dg_dx: jax.Array | None  # [C, bk] d g / d (g_raw) when the gate is fused
    dg_da: jax.Array | None  # [C, bk] d g / d a_log
    beta: jax.Array  # [C, 1]
    valid: jax.Array | None  # [C, 1] bool, rows before t_valid (None when T is a chunk multiple)


def prep(cfg: Cfg, chunk_idx, q_raw, k_raw, g_raw, beta, a_log, dt_bias) -> Prep:
    """The fused gate of one block of key columns (ARCHITECTURE.md §2.4 step 7), all in float32;
    q and k are returned raw (the L2 norm needs every column: `inv_norms`)."""
    c = cfg.chunk
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
    return Prep(q_raw.astype(F32), k_raw.astype(F32), g, dg_dx, dg_da, beta.astype(F32), valid)


@dataclasses.dataclass
class Decay:
    """The in-chunk decays of one block of key columns, sub-chunk factorised (module docstring).

    Rows of a pairwise form (row i, columns j <= i) use the reference at the first row of i's
    sub-chunk, columns (the backward's transposed forms) the one at the last row of j's sub-chunk:
    then the factor applied after the product is <= 1, and the in-product factor underflows only
    where the term it stands for is negligible."""

    G: jax.Array  # [C, bk] in-chunk cumulative log decay
    G_last: jax.Array  # [1, bk]
    r: list[jax.Array]  # r_a = G at the first row of sub-chunk a, [1, bk] each
    E: jax.Array  # [C, bk] exp(G - r_a(row)) <= 1
    s: list[jax.Array] | None  # s_b = G at the last row of sub-chunk b (columns only)
    Fs: jax.Array | None  # [C, bk] exp(s_b(row) - G) <= 1


def decay(cfg: Cfg, g: jax.Array, columns: bool = False) -> Decay:
    """`Decay` of the log decay block g [C, bk]; `columns`: also the column references."""
    c, n = cfg.chunk, cfg.chunk // BC
    G = cumsum_rows(cfg, g)
    block = iota(G.shape, 0) // BC

    def per_block(refs: list[jax.Array]) -> jax.Array:
        out = refs[0]
        for a in range(1, n):
            out = jnp.where(block == a, refs[a], out)
        return out

    r = [row(G, a * BC) for a in range(n)]
    E = jnp.exp(G - per_block(r))
    s = Fs = None
    if columns:
        s = [row(G, a * BC + BC - 1) for a in range(n)]
        Fs = jnp.exp(per_block(s) - G)
    return Decay(G, row(G, c - 1), r, E, s, Fs)


def right_factor(d: Decay, a: int) -> jax.Array:
    """exp(r_a - G) [C, bk]: <= 1 on rows before sub-chunk a, <= exp(-15 g_min) inside it (exp(75)
    for the safe gate); rows after it (always masked out by the caller) are capped so that a product
    with zero stays zero."""
    return jnp.exp(jnp.minimum(d.r[a] - d.G, EXP_CAP))


def left_factor(d: Decay, b: int) -> jax.Array:
    """exp(G - s_b) [C, bk]: <= 1 on rows after sub-chunk b, <= exp(-15 g_min) inside it; rows before
    it (masked out by the caller) capped like `right_factor`."""
    return jnp.exp(jnp.minimum(d.G - d.s[b], EXP_CAP))


def solve(cfg: Cfg, at: jax.Array, beta: jax.Array) -> jax.Array:
    """M = (I + diag(beta) At)^-1 [C, C] (unit lower triangular), float32, in [C, C] products.

    With A = diag(beta) At split into its 16 x 16 diagonal blocks D and the rest L:
    (I + D)^-1 = (I - D)(I + D^2)(I + D^4)(I + D^8) (each block is nilpotent of order 16), and
    I + A = (I + D)(I + N) with N = (I + D)^-1 L strictly block-lower, so N^(C/16) = 0 and
    M = (I - N)(I + N^2)(I + N^4)... (I + D)^-1.
    """
    c = cfg.chunk
    ri, ci = iota((c, c), 0), iota((c, c), 1)
    eye = (ri == ci).astype(F32)
    A = beta * at
    diag = (ri // BC) == (ci // BC)
    x = -jnp.where(diag, A, 0.0)
    dinv = eye + x
    for _ in range(3):
        x = mm(cfg, x, x, "solve")
        dinv = dinv + mm(cfg, dinv, x, "solve")
    if c == BC:
        return dinv
    n_pow = mm(cfg, dinv, jnp.where(diag, 0.0, A), "solve")  # N
    inv = eye - n_pow
    e = 2
    while e < c // BC:
        n_pow = mm(cfg, n_pow, n_pow, "solve")  # N^e
        inv = inv + mm(cfg, inv, n_pow, "solve")
        e *= 2
    return mm(cfg, inv, dinv, "solve")


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
             None if alog_ref is None else alog_ref[...], None if dt_ref is None else dt_ref[:, cols])
    if rq is None:
        return p
    return dataclasses.replace(p, q=p.q * rq, k=p.k * rk)


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


def _chunk_index(cfg: Cfg | None = None):
    """The chunk's grid index: grid (B, H, NT); with `cfg`, the backward's key-block grid
    (K / bk, B, H, NT), or (B, H, NT, K / bk) where `cfg.key_axis_last`."""
    return pl_program_id(3 if cfg is not None and not cfg.key_axis_last else 2)


def pl_program_id(axis: int):
    from jax.experimental import pallas as pl

    return pl.program_id(axis)


@dataclasses.dataclass
class Pairs:
    """The pairwise products of one chunk, [C, C]: At (strictly lower, k on both sides) and Aqk
    (lower, q on the left; unscaled; None unless asked for) of the L2-normalised q and k, masked
    (same segment)."""

    at: jax.Array
    aqk: jax.Array | None


def chunk_pairs(cfg: Cfg, ins, seg: jax.Array | None, with_aqk: bool) -> Pairs:
    """At (and Aqk) of one chunk, accumulated over blocks of `cfg.bk` key columns.

    A first loop sums the squares of q and k for the L2 norms (they need every column); the second
    loads a [C, bk] column block of q, k and the gate input, computes the gate and its in-chunk
    cumulative sum for those channels (both are per channel), and adds the block's share of every
    pairwise product: for each sub-chunk a, rows a of At are (k_a E_a) [16, bk] times
    (k exp(r_a - G))^T [bk, C] (the same right factor serves Aqk). Normalising before the products
    keeps every term of the sums below exp(EXP_CAP), whatever the inputs' magnitude."""
    n, c = cfg.chunk // BC, cfg.chunk
    ci = _chunk_index()
    rq, rk = inv_norms(cfg, ins) if cfg.l2norm else (None, None)
    zero_rows = [jnp.zeros((BC, c), F32)] * n

    def step(cols, carry):
        at, aqk = carry
        p = block_prep(cfg, ins, ci, cols, rq, rk)
        d = decay(cfg, p.g)
        ke = split_rows(cfg, p.k * d.E, n)
        qe = split_rows(cfg, p.q * d.E, n) if with_aqk else None
        at_new, aqk_new = [], []
        for a in range(n):
            rhs = p.k * right_factor(d, a)
            at_new.append(at[a] + mm_nt(cfg, ke[a], rhs, "mid"))
            if with_aqk:
                aqk_new.append(aqk[a] + mm_nt(cfg, qe[a], rhs, "mid"))
        return at_new, aqk_new

    at, aqk = kloop(cfg, cfg.dk, cfg.bk, step, (zero_rows, zero_rows if with_aqk else []))
    ri, cj = iota((c, c), 0), iota((c, c), 1)
    keep = ri >= cj
    if seg is not None:
        keep = keep & (seg == col_to_row(seg))
    at = jnp.where(keep & (ri != cj), stack_rows(at), 0.0)
    aqk = jnp.where(keep, stack_rows(aqk), 0.0) if with_aqk else None
    return Pairs(at, aqk)


def fwd_pairs_kernel(cfg: Cfg, store_at: bool, *refs):
    """Chunk-parallel forward, part 1, one (batch, head, chunk) per program: the [C, C] level.

    Reads q, k, the gate input, beta (and a_log, dt_bias, segment masks); computes the gate, the L2
    norms, the in-chunk cumulative decay, At and Aqk (`chunk_pairs`) and the triangular inverse M
    (`solve`); writes Aqk (compute dtype), M (float32) and, for the backward, At (float32).
    The [C, C] products live in their own launch: their registers would otherwise limit the
    [C, K]-level kernel below to two 4-warp programs per SM.
    """
    ins, i = _unpack_inputs(cfg, list(refs))
    aqk_ref, m_ref = refs[i:i + 2]
    pr = chunk_pairs(cfg, ins, _masks(cfg, ins)[2], with_aqk=True)
    m_ref[...] = solve(cfg, pr.at, ins[3][...].astype(F32))
    aqk_ref[...] = (cfg.scale * pr.aqk).astype(aqk_ref.dtype)
    if store_at:
        refs[i + 2][...] = pr.at


def fwd_wu_kernel(cfg: Cfg, *refs):
    """Chunk-parallel forward, part 2: the [C, K] level, from part 1's M.

    Reads q, k, v, the gate input, beta (a_log, dt_bias, segment masks) and M; writes
    W = M diag(beta m) (exp(G) * k), Qg, Kg [C, K], gamma [1, K] per block of key columns (the
    gate, norms and cumulative sum recomputed: elementwise work and a column scan) and
    U = M diag(beta) v [C, V] per block of value columns.
    """
    ins, i = _unpack_inputs(cfg, list(refs))
    v_ref, mm_ref = refs[i:i + 2]
    w_ref, u_ref, qg_ref, kg_ref, gam_ref = refs[i + 2:i + 7]
    c = cfg.chunk
    m, e, _ = _masks(cfg, ins)
    rq, rk = inv_norms(cfg, ins) if cfg.l2norm else (None, None)
    beta = ins[3][...].astype(F32)
    coef = beta if m is None else beta * m
    ci = _chunk_index()

    def key_block(cols, carry):
        p = block_prep(cfg, ins, ci, cols, rq, rk)
        G = cumsum_rows(cfg, p.g)
        G_last = row(G, c - 1)
        eg = jnp.exp(G)  # underflows to 0 only where the decay itself does
        w_ref[:, cols] = mm(cfg, mm_ref[...], coef * eg * p.k).astype(w_ref.dtype)
        qg = cfg.scale * eg * p.q
        kappa = jnp.exp(G_last - G)
        gam = jnp.exp(G_last)
        if m is not None:
            qg = qg * m
            kappa = kappa * e
            gam = gam * row(m, c - 1)
        qg_ref[:, cols] = qg.astype(qg_ref.dtype)
        kg_ref[:, cols] = (p.k * kappa).astype(kg_ref.dtype)
        gam_ref[:, cols] = gam
        return carry

    def value_block(cols, carry):
        u_ref[:, cols] = mm(cfg, mm_ref[...], beta * v_ref[:, cols].astype(F32)).astype(u_ref.dtype)
        return carry

    kloop(cfg, cfg.dk, cfg.bk_kv, key_block, None)
    kloop(cfg, cfg.dv, min(cfg.bk_kv, cfg.dv), value_block, None)


def bwd_intra_kernel(cfg: Cfg, *refs):
    """Chunk-parallel backward, part 1: everything that lives at the [C, C] level.

    refs: beta [, m, e, s], v, dO, V', dV', M and At (both stored by the forward). Loops over value
    blocks of dO, V', dV', v to form dAqk = dO V'^T and dL = -M^T dV' V'^T, writes dv = beta M^T dV'
    directly, and emits X = scale mask(dAqk), Y = beta mask(dL) and the beta gradient of the At and
    U terms.
    """
    beta_ref = refs[0]
    i = 4 if cfg.segments else 1
    s = refs[3][...].astype(F32) if cfg.segments else None
    v_ref, do_ref, vn_ref, dvn_ref, mm_ref, at_ref = refs[i:i + 6]
    x_ref, y_ref, dbeta_ref, dv_ref = refs[i + 6:i + 10]
    c = cfg.chunk
    beta = beta_ref[...].astype(F32)
    M = mm_ref[...]
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
        same = s == col_to_row(s)
        da = jnp.where(same, da, 0.0)
        xm = jnp.where(same, xm, 0.0)
    dbeta = dbeta + jnp.sum(da * at_ref[...], axis=1, keepdims=True)
    x_ref[...] = cfg.scale * xm
    y_ref[...] = beta * da
    dbeta_ref[...] = dbeta


def _bwd_norms(cfg: Cfg, refs: list, i: int) -> tuple[jax.Array | None, jax.Array | None, int]:
    """The backward kernels' 1 / ||q||, 1 / ||k|| [C, 1] inputs (computed once, in XLA)."""
    if not cfg.l2norm:
        return None, None, i
    return refs[i][...], refs[i + 1][...], i + 2


def bwd_dqkg_kernel(cfg: Cfg, *refs):
    """Chunk-parallel backward, part 2: the terms through the chunk states, [C, bk] level, one block
    of key columns per program (all of this is per key channel).

    A loop over value blocks of the chunk's state S^T and its gradient dS^T ([V, bk], v-first) with
    dO, V', dV' forms dQg = dO S^T, dKg = V' dS^T, dW = -dV' S^T and d gamma, then chains them
    through W = M B_w, Qg, Kg and gamma. Writes the float32 partial gradients of the normalised q, k
    and of the cumulative log decay G (part 3 adds the pairwise forms) and this block's share of
    dbeta.
    """
    refs = list(refs)
    ins, i = _unpack_inputs(cfg, refs)
    rq, rk, i = _bwd_norms(cfg, refs, i)
    do_ref, vn_ref, dvn_ref, h_ref, dh_ref, m2_ref = refs[i:i + 6]
    dqp_ref, dkp_ref, dGp_ref, dbeta_ref = refs[i + 6:i + 10]
    c, bk = cfg.chunk, cfg.bk_kv
    m, e, _ = _masks(cfg, ins)
    p = block_prep(cfg, ins, _chunk_index(cfg), slice(None), rq, rk)

    def step(vc, acc):
        dqg, dkg, dw, dgam = acc
        ht = h_ref[vc, :]
        dht = dh_ref[vc, :]
        return (dqg + mm(cfg, do_ref[:, vc], ht), dkg + mm(cfg, vn_ref[:, vc], dht),
                dw - mm(cfg, dvn_ref[:, vc], ht),
                dgam + jnp.sum(ht.astype(F32) * dht.astype(F32), axis=0, keepdims=True))

    z = jnp.zeros((c, bk), F32)
    dqg, dkg, dw, dgam = kloop(cfg, cfg.dv, cfg.bv_bwd, step, (z, z, z, jnp.zeros((1, bk), F32)))
    dbw = mm_tn(cfg, m2_ref[...], dw, "mid")
    G = cumsum_rows(cfg, p.g)
    G_last = row(G, c - 1)
    mg = jnp.exp(G)
    if m is not None:
        mg = mg * m
    dqh = (cfg.scale * mg) * dqg
    t = (p.beta * mg) * dbw
    kappa = jnp.exp(G_last - G)
    if e is not None:
        kappa = kappa * e
    z = dkg * p.k * kappa
    gl = jnp.exp(G_last)
    if m is not None:
        gl = gl * row(m, c - 1)
    last = jnp.sum(z, axis=0, keepdims=True) + dgam * gl
    dqp_ref[...] = dqh
    dkp_ref[...] = t + dkg * kappa
    dGp_ref[...] = dqh * p.q + t * p.k - z + jnp.where(iota((c, 1), 0) == c - 1, last, 0.0)
    dbeta_ref[...] = jnp.sum(dbw * mg * p.k, axis=1, keepdims=True)


def bwd_pairs_kernel(cfg: Cfg, *refs):
    """Chunk-parallel backward, part 3: the pairwise forms, the reverse cumulative sum and the gate,
    one block of key columns per program, ending in dq, dk, dg (raw gate input) and the per-chunk
    sums for a_log / dt_bias.

    The pairwise exp(G_i - G_j) forms of X (Aqk, q on the left) and Y (At, k on the left), the
    masked [C, C] gradients from part 1, sub-chunk factorised - by rows of sub-chunk a (X_a: [16, C]
    times k exp(r_a - G)) and by columns of sub-chunk b (X_:b^T: [16, C] times q exp(G - s_b)) - are
    added to part 2's partial gradients. With the L2 norm, dq/dk are written as rq * dq_hat (float32)
    and `pallas._core_bwd` finishes the norm's backward (its per-row sums span every key block).
    """
    refs = list(refs)
    ins, i = _unpack_inputs(cfg, refs)
    rq, rk, i = _bwd_norms(cfg, refs, i)
    x_ref, y_ref, dqp_ref, dkp_ref, dGp_ref = refs[i:i + 5]
    outs = refs[i + 5:]
    dq_ref, dk_ref, dg_ref = outs[:3]
    n = cfg.chunk // BC
    p = block_prep(cfg, ins, _chunk_index(cfg), slice(None), rq, rk)
    d = decay(cfg, p.g, columns=True)
    qh, kh = p.q, p.k
    rx, ry, cx, cy = [], [], [], []
    for a in range(n):
        rhs = kh * right_factor(d, a)
        rows = slice(a * BC, (a + 1) * BC)
        rx.append(mm(cfg, x_ref[rows, :], rhs, "mid"))
        ry.append(mm(cfg, y_ref[rows, :], rhs, "mid"))
    for b in range(n):
        fac = left_factor(d, b)
        cols_b = slice(b * BC, (b + 1) * BC)
        cx.append(mm_tn(cfg, x_ref[:, cols_b], qh * fac, "mid"))
        cy.append(mm_tn(cfg, y_ref[:, cols_b], kh * fac, "mid"))
    RX, RY = d.E * stack_rows(rx), d.E * stack_rows(ry)
    CX, CY = d.Fs * stack_rows(cx), d.Fs * stack_rows(cy)
    dqh = dqp_ref[...] + RX
    dkh = dkp_ref[...] + RY + CX + CY
    dG = dGp_ref[...] + qh * RX + kh * (RY - CX - CY)
    dg = revcumsum_rows(cfg, dG)
    if p.valid is not None:
        dg = jnp.where(p.valid, dg, 0.0)
    if cfg.gate is not None:
        pa_ref, pb_ref = outs[3:5]
        dgraw = dg * p.dg_dx
        pa_ref[...] = jnp.sum(dg * p.dg_da, axis=0, keepdims=True)
        pb_ref[...] = jnp.sum(dgraw, axis=0, keepdims=True)
    else:
        dgraw = dg
    if cfg.l2norm:
        dqh, dkh = rq * dqh, rk * dkh
    dq_ref[...] = dqh.astype(dq_ref.dtype)
    dk_ref[...] = dkh.astype(dk_ref.dtype)
    dg_ref[...] = dgraw.astype(dg_ref.dtype)


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

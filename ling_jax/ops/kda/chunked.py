"""Chunked (WY / UT form) KDA: a `jax.lax.scan` over chunks of `chunk_size` tokens.

Same function as `reference.kda_reference` (ARCHITECTURE.md §2.4 step 9), with the intra-chunk work
done by matmuls and one triangular solve per chunk instead of one state update per token.

Derivation, per (sequence, head), for one chunk of rows i = 1..C entering with state S0 [K, V] and
Γ_i = Σ_{t ≤ i} g_t (the gate summed from the chunk start, per key channel). Unrolling
`S <- diag(e^g) S + k uᵀ` gives S_i = diag(e^Γ_i) S0 + Σ_{j ≤ i} diag(e^(Γ_i - Γ_j)) k_j u_jᵀ, hence
    u_i = β_i (v_i - S0ᵀ (e^Γ_i ⊙ k_i)) - Σ_{j < i} A_kk[i, j] u_j,   A_kk[i, j] = β_i k_i·(e^(Γ_i-Γ_j) ⊙ k_j)
    o_i = S0ᵀ (e^Γ_i ⊙ q_i) + Σ_{j ≤ i} A_qk[i, j] u_j,                A_qk[i, j] = q_i·(e^(Γ_i-Γ_j) ⊙ k_j)
    S_C = diag(e^Γ_C) S0 + Σ_j (e^(Γ_C-Γ_j) ⊙ k_j) u_jᵀ
(q already scaled). So U = (I + A_kk)⁻¹ [β ⊙ V  -  β ⊙ (e^Γ ⊙ K) S0] = U_c - W S0 with
U_c = T V, W = T (e^Γ ⊙ K), T = (I + A_kk)⁻¹ diag(β): the form of ARCHITECTURE.md §2.4, which this
derivation confirms. [U_c | W] comes from one unit-lower-triangular solve of (I + A_kk) against
[β V | β e^Γ K] with `solve_triangular` (LAPACK/cuBLAS trsm), not a `fori_loop` forward
substitution: the loop is C dependent steps per chunk (C tiny kernels per chunk on GPU) and keeps
more gradient temporaries (the comparison: docs/kernels.md, "KDA chunked kernels").

Overflow and rounding (ARCHITECTURE.md §6 item 7). Never form e^Γ_i · e^-Γ_j: with g down to -5 a
64-token chunk reaches Γ = -320. The chunk is split into sub-chunks of s = 16 tokens (a, b index
sub-chunks), and every exponent is built from sums of g over exactly the tokens it spans:
  * gl_i = Σ g from the start of i's sub-chunk to i (inclusive); rl_j = Σ g after j to the end of
    j's sub-chunk; P[a, b] = Σ of whole sub-chunks strictly between b and a.
  * off-diagonal blocks (j in b < a, i in a): Γ_i - Γ_j = gl_i + P[a, b] + rl_j, factorised around
    the boundary before sub-chunk a as (q_i ⊙ e^gl_i)·(k_j ⊙ e^(rl_j + P[a, b])): one batched matmul
    whose two factors are both ≤ 1, so no overflow for any g ≤ 0 (a strong decay only underflows,
    towards the true value 0; g = -inf is taken as `G_FLOOR`);
  * diagonal blocks (i, j in one sub-chunk): the pairwise partial sums D[i, j] = Σ_{j < t ≤ i} g_t
    (a masked sum), then exp, as a [s, s, K] tensor per sub-chunk (C·s·K per chunk, a quarter of
    the full pairwise [C, C, K]);
  * the incoming state and the state update use e^(E_a + gl_i) and e^(rl_j + F_a), where E_a, F_a
    sum the whole sub-chunks before/after a.
Every exponent is ≤ 0, and each is a direct sum of the g it spans, so its rounding error scales
with its own size (|x| e^x · eps), never with |Γ| ~ 320 as a difference Γ_i - Γ_j of chunk-level
cumulative sums would (with g in [-5, -4.5] that puts up to 3.4e-5 relative error, 1e-5 on average
at the chunk end, on the neighbour terms e^g; this path agrees with the reference to ~2e-7). The full
pairwise [C, C, K] form is equally exact but costs 4x the exps and 4x the per-chunk memory (2 MiB
per (sequence, head) at C = 64, K = 128), and the sub-chunk factorisation around a reference row
inside the sub-chunk (upstream fla) reaches e^75 at g = -5 and overflows for unbounded gates.

Segments (`segment_ids`, packed documents). Let seg_i count the resets in the chunk at rows ≤ i
(a reset at the first row counts). Pairs interact only when seg_i == seg_j; the incoming state
reaches row i only when seg_i == 0; the state leaving the chunk keeps S0 only when no reset
occurred in the chunk, and takes the rows j with seg_j == seg_C. The masks multiply finite
quantities (every exponent is ≤ 0 whatever the segments), so they are exact and overflow-free,
including a boundary at a chunk's first row. The states entering chunks (`return_chunk_states`)
are taken before any reset, like the reference.

The tail is padded to a multiple of `chunk_size` with k = v = β = g = 0 (no state change). All
internal math and the state are float32; the output is cast to v's dtype. Differentiable by plain
autodiff through the scan; the chunk body is rematerialised (`jax.checkpoint`), so the backward pass
stores only the state entering each chunk, not the body's residuals: far less temporary memory, at
no cost in speed (docs/kernels.md, "KDA chunked kernels").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.ops.kda.reference import segment_starts

_SUB = 16  # sub-chunk length of the intra-chunk factorisation
# log decays below this (-inf included) are taken as it: e^-1e4 is 0 in float32, and so is every sum
# of steps that includes one, so the result is unchanged, while a -inf would make the masked sums'
# zero terms 0 * -inf = NaN
G_FLOOR = -1e4


def _sub_chunk_size(chunk_size: int) -> int:
    """Largest divisor of `chunk_size` that is at most 16."""
    return max(s for s in range(1, min(chunk_size, _SUB) + 1) if chunk_size % s == 0)


def _masked_sums(spec: str, mask: np.ndarray, x: jax.Array) -> jax.Array:
    """Sums of x over the entries a static 0/1 `mask` selects, as an einsum `spec` (mask first).

    Every gate exponent is such a sum over exactly the tokens it spans (zero terms are exact), so
    its rounding error scales with its own size. Float32 at HIGHEST precision (never bf16/tf32
    passes). A masked matmul compiles several times faster on CPU than `lax.cumsum` (an
    associative scan there) and is an MXU/tensor-core op elsewhere.
    """
    return jnp.einsum(spec, jnp.asarray(mask, jnp.float32), x, precision=jax.lax.Precision.HIGHEST)


def _chunk_body(
    s0_BHKV: jax.Array,
    xs: tuple[jax.Array, ...],
    *,
    scale: float,
    sub: int,
    with_segments: bool,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One chunk: (state entering it, chunk inputs) -> (state leaving it, (o, state entering it))."""
    q_BHCK, k_BHCK, v_BHCV, g_BHCK, beta_BHC, reset_BC = xs
    f32 = jnp.float32
    q_BHCK = q_BHCK.astype(f32) * scale
    k_BHCK = k_BHCK.astype(f32)
    v_BHCV = v_BHCV.astype(f32)
    g_BHCK = jnp.maximum(g_BHCK.astype(f32), G_FLOOR)
    beta_BHC = beta_BHC.astype(f32)
    b, h, c, dk = q_BHCK.shape
    n = c // sub

    # ---- gate sums over sub-chunks (a indexes the sub-chunk of a row, s its row inside it)
    g_BHNSK = g_BHCK.reshape(b, h, n, sub, dk)
    i_S, i_N = np.arange(sub), np.arange(n)
    # gl_i = Σ_{t ≤ i} g_t and rl_j = Σ_{t > j} g_t inside the sub-chunk; D[i, j] = Σ_{j < t ≤ i} g_t
    gl_BHNSK = _masked_sums("it,bhntk->bhnik", i_S[None, :] <= i_S[:, None], g_BHNSK)
    rl_BHNSK = _masked_sums("jt,bhntk->bhnjk", i_S[None, :] > i_S[:, None], g_BHNSK)
    d_mask_SSS = (i_S[None, :, None] < i_S[None, None, :]) & (i_S[None, None, :] <= i_S[:, None, None])
    d_BHNSSK = _masked_sums("ijt,bhntk->bhnijk", d_mask_SSS, g_BHNSK)
    # whole sub-chunks: E[a] = Σ_{c < a}, F[a] = Σ_{c > a}, P[a, b] = Σ_{b < c < a}, Γ_C = Σ_c
    tot_BHNK = jnp.sum(g_BHNSK, axis=3)
    e_BHNK = _masked_sums("ac,bhck->bhak", i_N[None, :] < i_N[:, None], tot_BHNK)
    f_BHNK = _masked_sums("ac,bhck->bhak", i_N[None, :] > i_N[:, None], tot_BHNK)
    p_mask_NNN = (i_N[None, :, None] < i_N[None, None, :]) & (i_N[None, None, :] < i_N[:, None, None])
    p_BHNNK = _masked_sums("xyc,bhck->bhxyk", p_mask_NNN, tot_BHNK)
    gc_BHK = jnp.sum(tot_BHNK, axis=2)

    q_BHNSK = q_BHCK.reshape(b, h, n, sub, dk)
    k_BHNSK = k_BHCK.reshape(b, h, n, sub, dk)

    # ---- diagonal blocks: exact pairwise exps (entries with j > i are e^0 = 1, masked below)
    ed_BHNSSK = jnp.exp(d_BHNSSK)
    kd_BHNSSK = k_BHNSK[:, :, :, None, :, :] * ed_BHNSSK
    dqk_BHNSS = jnp.einsum("bhnik,bhnijk->bhnij", q_BHNSK, kd_BHNSSK)
    dkk_BHNSS = jnp.einsum("bhnik,bhnijk->bhnij", k_BHNSK, kd_BHNSSK)

    # ---- off-diagonal blocks: (x_i e^gl_i) · (k_j e^(rl_j + P[a, b])), both factors ≤ 1
    egl_BHNSK = jnp.exp(gl_BHNSK)
    lq_BHNSK = q_BHNSK * egl_BHNSK
    lk_BHNSK = k_BHNSK * egl_BHNSK
    rexp_BHNNSK = rl_BHNSK[:, :, None] + p_BHNNK[:, :, :, :, None, :]  # [a, b, j]
    rk_BHNNSK = k_BHNSK[:, :, None] * jnp.exp(rexp_BHNNSK)
    oqk_BHNSNS = jnp.einsum("bhaik,bhacjk->bhaicj", lq_BHNSK, rk_BHNNSK)
    okk_BHNSNS = jnp.einsum("bhaik,bhacjk->bhaicj", lk_BHNSK, rk_BHNNSK)

    i_C = np.arange(c)
    same_blk_N1N1 = (i_N[:, None] == i_N[None, :])[:, None, :, None]
    incl_CC = jnp.asarray(i_C[:, None] >= i_C[None, :])
    strict_CC = jnp.asarray(i_C[:, None] > i_C[None, :])

    def assemble(diag_BHNSS: jax.Array, off_BHNSNS: jax.Array) -> jax.Array:
        full = jnp.where(same_blk_N1N1, diag_BHNSS[:, :, :, :, None, :], off_BHNSNS)
        return full.reshape(b, h, c, c)

    aqk_BHCC = assemble(dqk_BHNSS, oqk_BHNSNS)
    akk_BHCC = assemble(dkk_BHNSS, okk_BHNSNS)
    eg_BHCK = jnp.exp(e_BHNK[:, :, :, None, :] + gl_BHNSK).reshape(b, h, c, dk)  # e^Γ_i
    eend_BHCK = jnp.exp(f_BHNK[:, :, :, None, :] + rl_BHNSK).reshape(b, h, c, dk)  # e^(Γ_C - Γ_j)
    decay_BHK = jnp.exp(gc_BHK)  # e^Γ_C

    qmask_BHCC, kmask_BHCC = incl_CC[None, None], strict_CC[None, None]
    s0_dec_BHKV = s0_BHKV  # the incoming state's share of the outgoing one, e^Γ_C S0
    if with_segments:
        # seg_i = number of resets at rows ≤ i (exact small integers in float32)
        seg_BC = _masked_sums("it,bt->bi", i_C[None, :] <= i_C[:, None], reset_BC.astype(f32))
        same_B1CC = (seg_BC[:, :, None] == seg_BC[:, None, :])[:, None]
        qmask_BHCC = qmask_BHCC & same_B1CC
        kmask_BHCC = kmask_BHCC & same_B1CC
        reach_B1C1 = (seg_BC == 0)[:, None, :, None]  # rows the incoming state reaches
        tail_B1C1 = (seg_BC == seg_BC[:, -1:])[:, None, :, None]  # rows of the last segment
        eg_BHCK = jnp.where(reach_B1C1, eg_BHCK, 0.0)
        eend_BHCK = jnp.where(tail_B1C1, eend_BHCK, 0.0)
        s0_dec_BHKV = jnp.where((seg_BC[:, -1] == 0)[:, None, None, None], s0_BHKV, 0.0)
    aqk_BHCC = jnp.where(qmask_BHCC, aqk_BHCC, 0.0)
    akk_BHCC = beta_BHC[..., None] * jnp.where(kmask_BHCC, akk_BHCC, 0.0)

    # ---- [U_c | W] = (I + A_kk)^-1 [β V | β e^Γ K], then V' = U_c - W S0
    rhs_BHCX = beta_BHC[..., None] * jnp.concatenate([v_BHCV, eg_BHCK * k_BHCK], axis=-1)
    x_BHCX = jax.scipy.linalg.solve_triangular(akk_BHCC, rhs_BHCX, lower=True, unit_diagonal=True)
    dv = v_BHCV.shape[-1]
    uc_BHCV, w_BHCK = x_BHCX[..., :dv], x_BHCX[..., dv:]
    # (rows the incoming state does not reach already have zero e^Γ, hence zero W and e^Γ ⊙ Q)
    vp_BHCV = uc_BHCV - jnp.einsum("bhck,bhkv->bhcv", w_BHCK, s0_BHKV)
    o_BHCV = jnp.einsum("bhck,bhkv->bhcv", q_BHCK * eg_BHCK, s0_BHKV) + jnp.einsum(
        "bhcj,bhjv->bhcv", aqk_BHCC, vp_BHCV
    )
    s_BHKV = decay_BHK[..., None] * s0_dec_BHKV + jnp.einsum(
        "bhck,bhcv->bhkv", k_BHCK * eend_BHCK, vp_BHCV
    )
    return s_BHKV, (o_BHCV, s0_BHKV)


def kda_chunked(
    q: jax.Array,  # [B, T, H, K] (already L2-normalised by the caller)
    k: jax.Array,  # [B, T, H, K]
    v: jax.Array,  # [B, T, H, V]
    g: jax.Array,  # [B, T, H, K] log decay <= 0
    beta: jax.Array,  # [B, T, H]
    *,
    scale: float,
    initial_state: jax.Array | None = None,  # [B, H, K, V] float32
    segment_ids: jax.Array | None = None,  # [B, T] int
    chunk_size: int = 64,
    return_chunk_states: bool = False,
) -> tuple[jax.Array, ...]:
    """Returns (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32).

    With `return_chunk_states`, also the states entering each chunk of `chunk_size` tokens,
    [B, ceil(T / chunk_size), H, K, V] float32 (index 0 is the initial state). Same semantics as
    `reference.kda_reference`, computed chunk by chunk (see the module docstring).
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    nc = -(-t // c)
    pad = nc * c - t
    s0_BHKV = (
        jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    )
    with_segments = segment_ids is not None
    reset_BT = segment_starts(segment_ids) if with_segments else jnp.zeros((b, t), bool)

    def chunks(x: jax.Array) -> jax.Array:
        """[B, T, H, ...] -> [NC, B, H, C, ...], the tail padded with zeros."""
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, nc, c, *x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 3))  # [NC, B, H, C, ...]

    reset_NBC = jnp.moveaxis(jnp.pad(reset_BT, [(0, 0), (0, pad)]).reshape(b, nc, c), 1, 0)
    xs = (chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta), reset_NBC)

    def body(s_BHKV: jax.Array, xs_chunk: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple]:
        return _chunk_body(s_BHKV, xs_chunk, scale=scale, sub=_sub_chunk_size(c), with_segments=with_segments)

    s_final, (o_NBHCV, s_in_NBHKV) = jax.lax.scan(jax.checkpoint(body), s0_BHKV, xs)
    o_BTHV = jnp.moveaxis(o_NBHCV, (0, 3), (1, 2)).reshape(b, nc * c, h, dv)[:, :t].astype(v.dtype)
    if not return_chunk_states:
        return o_BTHV, s_final
    return o_BTHV, s_final, jnp.moveaxis(s_in_NBHKV, 0, 1)

"""A KDA layer's decode step between its two projections, in one Pallas kernel, caches in place.

At one token per step, what a KDA layer does between its input projection and its o_proj is a
few thousand values of arithmetic: the short conv + SiLU of q/k/v from the cached window, the q/k
L2 norms, the decay gate, beta, the rank-1 state update and the gated output norm. In XLA that is
~9 launches of 1-3 us each per layer, plus a copy of each cache slice handed to the step kernel
(BENCHMARKS.md, "Decode": 16 us per layer on an H200). Here one program per (row, head) does all
of it: it reads its head's projected inputs straight from the projection's output (by column
offset, so no slice is materialised), its conv window and [K, V] state from the segment's cache
stacks and its small weights from their layer stacks (`ops.layer_gemv.WeightStack`; XLA copies
any sliced operand of a custom call), and writes the new window and state back into the stacks in
place (`input_output_aliases`).

The arithmetic mirrors the XLA form step by step (`layers.kda.kda_mixer` at T = 1:
`ops.short_conv.conv_silu`, `ops.kda.gate`, `ops.kda.decode.kda_decode_step`,
`layers.norms.gated_rms_norm`), including its roundings to the activation dtype (the conv output,
the step's output), so the two agree to float32 rounding.
Triton lowering on GPU, interpret mode elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling_jax.ops.layer_gemv import WeightStack
from ling_jax.ops.pallas_gpu import call_options, is_pow2, whole

NUM_WARPS = 8  # a [128, 128] float32 state is 64 values per thread


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KdaCacheStack:
    """One KDA layer's decode cache, left inside its segment's stacks; `kda_decode_layer` updates
    the layer's entries in place and returns the stacks (thread them to the next layer)."""

    state: jax.Array  # [L, B, H, K, V] float32
    conv: jax.Array  # [L, B, W-1, 3P] the last W-1 q|k|v inputs, activation dtype
    layer: jax.Array  # int32 scalar, this layer's index in the stacks


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Where the layer's projected inputs are: each an (array [B, O], first column) pair; arrays may
    repeat (the fused input projection holds q|k|v, the gate input f, the output gate z and the
    beta logits side by side)."""

    qkv: tuple[jax.Array, int]  # q, k, v of P = H * K channels each, contiguous
    f: tuple[jax.Array, int]  # [H * K]
    z: tuple[jax.Array, int]  # [H * V]
    b: tuple[jax.Array, int]  # [H]


def supported(dk: int, dv: int, width: int) -> bool:
    """Whether the kernel takes heads of K x V (powers of two >= 16) and conv width `width` (>= 2)."""
    return is_pow2(dk) and is_pow2(dv) and min(dk, dv) >= 16 and width >= 2


def _stack(w: jax.Array | WeightStack) -> tuple[jax.Array, jax.Array]:
    """(stack [L, ...], layer) of a layer's weight given whole or as a view of its stack."""
    if isinstance(w, WeightStack):
        return w.stack, jnp.asarray(w.layer, jnp.int32)
    return w[None], jnp.int32(0)


def _kernel(idx_ref, *refs, n_src: int, roles: tuple, p: int, dk: int, dv: int, width: int, scale: float,
            lower_bound: float | None, eps: float, barrier: bool):
    f32 = jnp.float32
    srcs = refs[:n_src]
    conv_w_ref, a_log_ref, dt_ref, norm_ref, state_ref, win_ref, o_ref, state_out, win_out = refs[n_src:]
    b, h = pl.program_id(0), pl.program_id(1)
    lc, lw, la, ld, ln = (idx_ref[i] for i in range(5))
    (sq, oq), (sf, of), (sz, oz), (sb, ob) = roles
    dtype = o_ref.dtype
    # every load first, all in flight at once: the window and state are read and written in place
    channels = (h * dk, p + h * dk, 2 * p + h * dv)  # this head's q, k, v channels of q|k|v
    widths = (dk, dk, dv)
    taps = [[win_ref[lc, b, j, pl.ds(c, n)] for j in range(width - 1)]
            + [srcs[sq][b, pl.ds(oq + c, n)].astype(win_ref.dtype)] for c, n in zip(channels, widths, strict=True)]
    conv_w = [[conv_w_ref[lw, pl.ds(c, n), j] for j in range(width)] for c, n in zip(channels, widths, strict=True)]
    f_K = srcs[sf][b, pl.ds(of + h * dk, dk)]
    dt_K = dt_ref[ld, pl.ds(h * dk, dk)]
    a_log = a_log_ref[la, h]
    b_logit = srcs[sb][b, ob + h]
    z_V = srcs[sz][b, pl.ds(oz + h * dv, dv)]
    norm_V = norm_ref[ln, :]
    s_KV = state_ref[lc, b, h]
    if barrier:  # (Triton) no store below may land before another thread's load above of the same place
        pltriton.debug_barrier()

    def conv_silu(part: int) -> jax.Array:  # silu(conv) of q, k or v in the activation dtype
        acc = jnp.zeros((widths[part],), f32)
        for tap, w in zip(taps[part], conv_w[part], strict=True):
            acc = acc + tap.astype(f32) * w.astype(f32)
        return jax.nn.silu(acc).astype(dtype)

    def l2_normalize(x: jax.Array) -> jax.Array:
        x32 = x.astype(f32)
        return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32) + 1e-6)

    q_K = l2_normalize(conv_silu(0)) * scale
    k_K = l2_normalize(conv_silu(1))
    v_V = conv_silu(2).astype(f32)
    x_K = f_K.astype(f32) + dt_K.astype(f32)
    a = jnp.exp(a_log.astype(f32))
    g_K = -a * jax.nn.softplus(x_K) if lower_bound is None else lower_bound * jax.nn.sigmoid(a * x_K)
    beta = jax.nn.sigmoid(b_logit.astype(f32))
    s_KV = s_KV * jnp.exp(g_K)[:, None]
    u_V = beta * (v_V - jnp.sum(k_K[:, None] * s_KV, axis=0))
    s_KV = s_KV + k_K[:, None] * u_V[None, :]
    o_V = jnp.sum(q_K[:, None] * s_KV, axis=0).astype(dtype).astype(f32)
    y_V = o_V * jax.lax.rsqrt(jnp.mean(o_V * o_V) + eps) * norm_V.astype(f32) * jax.nn.sigmoid(z_V.astype(f32))
    state_out[lc, b, h] = s_KV
    for c, n, part_taps in zip(channels, widths, taps, strict=True):  # the window moves on by one input
        for j in range(width - 1):
            win_out[lc, b, j, pl.ds(c, n)] = part_taps[j + 1]
    o_ref[b, pl.ds(h * dv, dv)] = y_V.astype(dtype)


def kda_decode_layer(
    inputs: Inputs, cache: KdaCacheStack, conv_w: jax.Array | WeightStack, a_log: jax.Array | WeightStack,
    dt_bias: jax.Array | WeightStack, o_norm: jax.Array | WeightStack, *, lower_bound: float | None,
    eps: float, interpret: bool | None = None,
) -> tuple[jax.Array, KdaCacheStack]:
    """One token per row through a KDA layer's conv, gate, recurrence and output norm:
    (gated-normed output [B, H * V] in the activation dtype, the cache stacks with this layer's
    window and state replaced).

    inputs: the projected q|k|v, f, z and beta logits (`Inputs`, activation dtype); conv_w: the
    q|k|v conv weights [3P, W]; a_log [H]; dt_bias [H * K]; o_norm [V] — each the layer's array or
    a `WeightStack` view. The state stack must be float32; the window stack is in the activation
    dtype. `interpret` defaults to True off GPU.
    """
    bsz, h, dk, dv = cache.state.shape[1:5]
    w = cache.conv.shape[2] + 1
    p = h * dk
    src = inputs.qkv[0]
    dtype = src.dtype
    if not supported(dk, dv, w) or dk != dv:
        raise ValueError(f"kda_decode_layer: K={dk}, V={dv} (powers of two >= 16, equal) and conv width {w} (>= 2)")
    if cache.state.dtype != jnp.float32 or cache.conv.shape[1:] != (bsz, w - 1, 3 * p):
        raise ValueError(f"kda_decode_layer: state {cache.state.dtype}{cache.state.shape} must be float32; window "
                         f"{cache.conv.shape} must be [L, {bsz}, {w - 1}, {3 * p}]")
    roles = (inputs.qkv, inputs.f, inputs.z, inputs.b)
    widths = (3 * p, p, h * dv, h)
    for (a, col), n in zip(roles, widths, strict=True):
        if a.shape[0] != bsz or a.ndim != 2 or col + n > a.shape[1]:
            raise ValueError(f"kda_decode_layer: an input [{a.shape}] at column {col} must give {bsz} rows of {n}")
    arrays = list({id(a): a for a, _ in roles}.values())
    slot = {id(a): i for i, a in enumerate(arrays)}
    stacks = [_stack(x) for x in (conv_w, a_log, dt_bias, o_norm)]
    idx = jnp.stack([jnp.asarray(cache.layer, jnp.int32), *(layer for _, layer in stacks)])
    operands = [idx, *arrays, *(s for s, _ in stacks), cache.state, cache.conv]
    n_in = len(operands)
    options = call_options(interpret, num_warps=NUM_WARPS, num_stages=1)
    o, state, conv = pl.pallas_call(
        functools.partial(_kernel, n_src=len(arrays), roles=tuple((slot[id(a)], col) for a, col in roles), p=p,
                          dk=dk, dv=dv, width=w, scale=dk**-0.5, lower_bound=lower_bound, eps=eps,
                          barrier=not options["interpret"]),
        out_shape=[jax.ShapeDtypeStruct((bsz, h * dv), dtype), jax.ShapeDtypeStruct(cache.state.shape, jnp.float32),
                   jax.ShapeDtypeStruct(cache.conv.shape, cache.conv.dtype)],
        grid=(bsz, h),
        in_specs=[whole(a) for a in operands],
        out_specs=[pl.BlockSpec((bsz, h * dv), lambda *_: (0, 0)), whole(cache.state), whole(cache.conv)],
        input_output_aliases={n_in - 2: 1, n_in - 1: 2},
        name="kda_decode_layer",
        **options,
    )(*operands)
    return o, KdaCacheStack(state, conv, cache.layer)

"""A KDA layer's decode step between its input projection and its output norm, in one Pallas kernel.

At one token per step, what a KDA layer does after its input projection is a few thousand values
of arithmetic: the short conv + SiLU of q/k/v from the cached window, the q/k L2 norms, the decay
gate, beta and the rank-1 update of the [K, V] state. In XLA that is several small launches per
layer plus a copy of the state slice handed to the step kernel (docs/decode-performance.md). Here
one launch does it: programs over (row, head, block of V columns) read the head's projected inputs
straight from the projection's output (by column offset: no slice is materialised), the window and
the state block from the segment's cache stacks and the small weights from their layer stacks
(`ops.layer_gemv.WeightStack`; XLA copies any sliced operand of a custom call). Each program
updates its state block in place (`input_output_aliases`); the new window comes back apart, since
every program of a head reads the head's q/k window (the caller writes the windows after the step).

The arithmetic mirrors the XLA form step by step (`ling_jax.decode.layers.kda`, i.e.
`layers.kda.kda_mixer` at T = 1: `ops.short_conv.conv_silu`, `ops.kda.gate`,
`ops.kda.decode.kda_decode_step`), including its roundings to the activation dtype (the conv output,
the step's output), so the two agree to float32 rounding. The gated output norm needs a whole head,
so it is left to the kernel that reads o (the output projection's gemv, `ops.expert_gemv.GatedRows`),
which takes from here each program's sum of squares of its block of o. The decode step runs it where
`kernels.kda_layer_kernel` says so (the `Kernels` record's decode kernels on layer-stack views).
Triton on a GPU, interpret mode elsewhere (`Launch.interpret`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from ling_jax.ops.kda.gate import l2_normalize, log_decay
from ling_jax.ops.layer_gemv import WeightStack
from ling_jax.ops.pallas_gpu import DEFAULT_LAUNCH, Launch, index_operand, is_pow2, triton_call, whole

BV = 32  # state columns per program (16 when rows x heads x V / 32 would not fill the GPU)
NUM_WARPS = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KdaCacheStack:
    """One KDA layer's decode cache, left inside its segment's stacks. `kda_decode_layer` updates the
    layer's state in the state stack in place and returns the layer's new window apart (`window`):
    every program of a head reads the head's q/k window, so none may overwrite it during the kernel;
    the caller writes the windows back after the step (`ling_jax.decode.views.KdaCaches`)."""

    state: jax.Array  # [L, B, H, K, V] float32
    conv: jax.Array  # [L, B, W-1, 3P] the last W-1 q|k|v inputs, activation dtype
    layer: jax.Array | np.integer  # int32 scalar, this layer's index in the stacks (a constant in the decode step)
    window: jax.Array | None = None  # [B, W-1, 3P] this layer's new window (`kda_decode_layer`'s result)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Where the layer's projected inputs are: each an (array [B, O], first column) pair; arrays may
    repeat (the fused input projection holds q|k|v, the gate input f and the beta logits side by side)."""

    qkv: tuple[jax.Array, int]  # q, k, v of P = H * K channels each, contiguous
    f: tuple[jax.Array, int]  # [H * K]
    b: tuple[jax.Array, int]  # [H]


def supported(dk: int, dv: int, width: int) -> bool:
    """Whether the kernel takes heads of K x V (powers of two >= 16) and conv width `width` (>= 2)."""
    return is_pow2(dk) and is_pow2(dv) and min(dk, dv) >= 16 and width >= 2


def _stack(w: jax.Array | WeightStack) -> tuple[jax.Array, jax.Array | np.integer]:
    """(stack [L, ...], layer) of a layer's weight given whole or as a view of its stack; the layer
    stays a numpy constant where it is one (the unrolled decode step's views)."""
    if isinstance(w, WeightStack):
        return w.stack, w.layer
    return w[None], np.int32(0)


def _kernel(idx_ref, *refs, n_src: int, roles: tuple, p: int, dk: int, dv: int, width: int, bv: int,
            scale: float, lower_bound: float | None):
    f32 = jnp.float32
    srcs = refs[:n_src]
    conv_w_ref, a_log_ref, dt_ref, state_ref, win_ref, o_ref, ss_ref, state_out, win_out = refs[n_src:]
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lc, lw, la, ld = (idx_ref[i] for i in range(4))
    (sq, oq), (sf, of), (sb, ob) = roles
    dtype = o_ref.dtype

    def conv_silu(c: int | jax.Array, n: int, keep: bool | jax.Array) -> jax.Array:
        """silu(conv) of q|k|v channels [c, c + n) in the activation dtype; where `keep`, their new window."""
        taps = [win_ref[lc, b, t, pl.ds(c, n)] for t in range(width - 1)]
        taps.append(srcs[sq][b, pl.ds(oq + c, n)].astype(win_ref.dtype))
        acc = jnp.zeros((n,), f32)
        for t, tap in enumerate(taps):
            acc = acc + tap.astype(f32) * conv_w_ref[lw, pl.ds(c, n), t].astype(f32)

        @pl.when(keep)
        def _():
            for t in range(width - 1):
                win_out[b, t, pl.ds(c, n)] = taps[t + 1]

        return jax.nn.silu(acc).astype(dtype)

    q_K = l2_normalize(conv_silu(h * dk, dk, j == 0)) * scale  # every program of the head: the same q, k
    k_K = l2_normalize(conv_silu(p + h * dk, dk, j == 0))
    v_V = conv_silu(2 * p + h * dv + j * bv, bv, True).astype(f32)
    x_K = srcs[sf][b, pl.ds(of + h * dk, dk)].astype(f32) + dt_ref[ld, pl.ds(h * dk, dk)].astype(f32)
    g_K = log_decay(x_K, jnp.exp(a_log_ref[la, h].astype(f32)), lower_bound)
    beta = jax.nn.sigmoid(srcs[sb][b, ob + h].astype(f32))
    cols = pl.ds(j * bv, bv)
    s_KV = state_ref[lc, b, h, :, cols] * jnp.exp(g_K)[:, None]
    u_V = beta * (v_V - jnp.sum(k_K[:, None] * s_KV, axis=0))
    s_KV = s_KV + k_K[:, None] * u_V[None, :]
    state_out[lc, b, h, :, cols] = s_KV
    o_V = jnp.sum(q_K[:, None] * s_KV, axis=0).astype(dtype)
    o_ref[b, h, cols] = o_V
    ss_ref[b, h, j] = jnp.sum(jnp.square(o_V.astype(f32)))


def kda_decode_layer(
    inputs: Inputs, cache: KdaCacheStack, conv_w: jax.Array | WeightStack, a_log: jax.Array | WeightStack,
    dt_bias: jax.Array | WeightStack, *, lower_bound: float | None, interpret: bool | None = None,
    launch: Launch = DEFAULT_LAUNCH,
) -> tuple[jax.Array, jax.Array, KdaCacheStack]:
    """One token per row through a KDA layer's conv, gate and recurrence: (o [B, H, V] in the
    activation dtype, before the output norm; o's sums of squares [B, H, J] float32 over each of a
    head's J blocks of V; the cache with this layer's state replaced in its stack and its new window
    [B, W-1, 3P] in `window`).

    inputs: the projected q|k|v, f and beta logits (`Inputs`; z is not read here); conv_w: the q|k|v
    conv weights [3P, W]; a_log [H]; dt_bias [H * K] — each the layer's array or a `WeightStack`
    view. The state stack must be float32; the window stack is in the activation dtype. Programs
    run over (row, head, block of V columns), each recomputing its head's q and k (a few hundred
    values) so that one row keeps the GPU busy; narrower blocks of V where fewer than
    `launch.kda_programs` would run. `interpret`: None takes `launch.interpret` (None there: chosen
    where the program is lowered). ValueError on unsupported widths (`supported`), a state stack not
    float32, a window stack not [L, B, W-1, 3P], or inputs without the rows or columns named.
    """
    bsz, h, dk, dv = cache.state.shape[1:5]
    w = cache.conv.shape[2] + 1
    p = h * dk
    dtype = inputs.qkv[0].dtype
    if not supported(dk, dv, w) or dk != dv:
        raise ValueError(f"kda_decode_layer: K={dk}, V={dv} (powers of two >= 16, equal) and conv width {w} (>= 2)")
    if cache.state.dtype != jnp.float32 or cache.conv.shape[1:] != (bsz, w - 1, 3 * p):
        raise ValueError(f"kda_decode_layer: state {cache.state.dtype}{cache.state.shape} must be float32; window "
                         f"{cache.conv.shape} must be [L, {bsz}, {w - 1}, {3 * p}]")
    roles = (inputs.qkv, inputs.f, inputs.b)
    for (a, col), n in zip(roles, (3 * p, p, h), strict=True):
        if a.shape[0] != bsz or a.ndim != 2 or col + n > a.shape[1]:
            raise ValueError(f"kda_decode_layer: an input [{a.shape}] at column {col} must give {bsz} rows of {n}")
    arrays = list({id(a): a for a, _ in roles}.values())
    slot = {id(a): i for i, a in enumerate(arrays)}
    stacks = [_stack(x) for x in (conv_w, a_log, dt_bias)]
    layers = [cache.layer, *(layer for _, layer in stacks)]
    idx = index_operand(layers)
    operands = [idx, *arrays, *(s for s, _ in stacks), cache.state, cache.conv]
    bv = min(BV, dv) if bsz * h * dv // min(BV, dv) >= launch.kda_programs else min(BV // 2, dv)
    vec = pl.BlockSpec((bsz, h, dv), lambda *_: (0, 0, 0))
    o, ss, state, window = triton_call(
        functools.partial(_kernel, n_src=len(arrays), roles=tuple((slot[id(a)], col) for a, col in roles), p=p,
                          dk=dk, dv=dv, width=w, bv=bv, scale=dk**-0.5, lower_bound=lower_bound),
        out_shape=[jax.ShapeDtypeStruct((bsz, h, dv), dtype), jax.ShapeDtypeStruct((bsz, h, dv // bv), jnp.float32),
                   jax.ShapeDtypeStruct(cache.state.shape, jnp.float32),
                   jax.ShapeDtypeStruct(cache.conv.shape[1:], cache.conv.dtype)],
        grid=(bsz, h, dv // bv),
        in_specs=[whole(a) for a in operands],
        out_specs=[vec, pl.BlockSpec((bsz, h, dv // bv), lambda *_: (0, 0, 0)), whole(cache.state),
                   pl.BlockSpec(cache.conv.shape[1:], lambda *_: (0, 0, 0))],
        input_output_aliases={len(operands) - 2: 2},
        name="kda_decode_layer",
        interpret=launch.interpret if interpret is None else interpret, num_warps=NUM_WARPS, num_stages=1,
    )(*operands)
    return o, ss, dataclasses.replace(cache, state=state, window=window)

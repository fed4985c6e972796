"""The MoE's expert selection for a decode step as one Pallas kernel: scores, groups, top-k, weights.

`layers.moe.route` ranks `sigmoid(logits) + bias` within the best `topk_group` groups (a group
scores the sum of its two best) and weights the chosen experts by their unbiased scores,
renormalised and scaled. In XLA that is ~9 launches per MoE layer (sigmoid, two `top_k`s, one-hot,
masks, gather, sums), 1-3 us each; a batch-1 decode step of Ling-3.0-tiny spent ~0.35 ms of its
2.8 ms in them (23 MoE layers, BENCHMARKS.md). Here one program (one warp) takes one token row with
all E logits in registers and does every stage by masked max / min reductions over the expert
axis: the group score by two maxima per group, then `topk_group` rounds of "best group, lowest
index on ties" and k rounds of "best expert, lowest index on ties" — the order of `lax.top_k`, so
the kernel picks the experts the XLA form picks whenever the scores are bit-identical (interpret
mode; on a GPU Triton's `exp` may differ from XLA's in the last bit, which can only swap experts
whose scores tie to within that bit).

The weights' gradient (the kernel has none) is the XLA form's, recomputed from the logits and the
chosen indices (`custom_vjp`): the kernel can stand in anywhere `route` runs.

In the batch-1 decode step the router matmul is the gemv kernel's (`layer_gemv.partial_products`)
and this kernel adds its [S, N, E] partial sums, and it reads the layer's bias from its segment's
[L, E] stack (`layer_gemv.WeightStack`): XLA would run the sum as a launch and copy a sliced bias
before the custom call. Those inputs take no gradient (a decode step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from ling_jax.ops.layer_gemv import WeightStack
from ling_jax.ops.pallas_gpu import call_options, next_pow2, pad_axis, whole

NUM_WARPS = 1  # one row per program: every reduction stays inside one warp (shuffles, no barriers)


def combine_weights(scores_NE: jax.Array, idx_NK: jax.Array, scale: float) -> jax.Array:
    """Combine weights [N, k] float32: the chosen experts' unbiased scores, renormalised (k > 1), scaled."""
    w_NK = jnp.take_along_axis(scores_NE, idx_NK, axis=1)
    if idx_NK.shape[1] > 1:
        w_NK = w_NK / (w_NK.sum(-1, keepdims=True) + 1e-20)
    return w_NK * scale


def _kernel(logits_ref, layer_ref, bias_ref, group_ref, idx_ref, w_ref, *, n_group: int, topk_group: int, k: int,
            scale: float):
    f32, ninf = jnp.float32, -jnp.inf
    row = pl.ds(pl.program_id(0), 1)
    # [1, Ep]: the sum of the S partial sums, unrolled so that every load is issued before the adds
    # wait on them (a loop would pay the memory latency S times over)
    logits = functools.reduce(jnp.add, [logits_ref[j, row, :] for j in range(logits_ref.shape[0])])
    scores = jax.nn.sigmoid(logits)
    sel = scores + bias_ref[pl.ds(layer_ref[0], 1), :].astype(f32)  # padded experts: bias -inf
    sel = jnp.where(sel != sel, ninf, sel)  # NaN scores rank last: every chosen index stays a real expert
    grp = group_ref[...]  # [1, Ep] int32 group of each expert; n_group for the padding
    ep = sel.shape[1]
    col = jax.lax.broadcasted_iota(jnp.int32, (1, ep), 1)

    def best(v, ids, none):  # row-wise maximum of v and the lowest id that attains it: [BN, 1] each
        m = jnp.max(v, axis=1, keepdims=True)
        return m, jnp.min(jnp.where(v == m, ids, none), axis=1, keepdims=True)

    group_score = jnp.full(sel.shape, ninf, f32)  # each expert's group score, the sum of its group's top 2
    for g in range(n_group):
        in_g = grp == g
        m1, i1 = best(jnp.where(in_g, sel, ninf), col, ep)
        m2 = jnp.max(jnp.where(in_g & (col != i1), sel, ninf), axis=1, keepdims=True)
        group_score = jnp.where(in_g, m1 + m2, group_score)
    keep = jnp.zeros(sel.shape, jnp.bool_)
    for _ in range(topk_group):
        _, gi = best(group_score, grp, n_group)
        chosen = grp == gi
        keep = keep | chosen
        group_score = jnp.where(chosen, ninf, group_score)
    cand = jnp.where(keep, sel, ninf)
    kp = idx_ref.shape[1]
    kcol = jax.lax.broadcasted_iota(jnp.int32, (1, kp), 1)
    idx = jnp.zeros((sel.shape[0], kp), jnp.int32)
    w = jnp.zeros((sel.shape[0], kp), f32)
    for t in range(k):
        _, i = best(cand, col, ep)
        hit = col == i
        idx = jnp.where(kcol == t, i, idx)
        w = jnp.where(kcol == t, jnp.sum(jnp.where(hit, scores, 0.0), axis=1, keepdims=True), w)
        cand = jnp.where(hit, ninf, cand)
    if k > 1:
        w = w / (jnp.sum(w, axis=1, keepdims=True) + 1e-20)
    idx_ref[...] = idx
    w_ref[...] = w * scale


def _select(logits_SNE: jax.Array, bias: jax.Array | WeightStack, n_group: int, topk_group: int, k: int,
            scale: float, interpret: bool | None) -> tuple[jax.Array, jax.Array]:
    n, e = logits_SNE.shape[1:]
    ep, kp = next_pow2(e), next_pow2(k)
    logits = pad_axis(logits_SNE.astype(jnp.float32), 2, ep)
    if isinstance(bias, WeightStack) and ep == e:  # read in place: row `layer` of the stack
        bias_LE, layer = bias.stack, jnp.asarray(bias.layer, jnp.int32).reshape(1)
    else:
        bias_E = bias.value() if isinstance(bias, WeightStack) else bias
        bias_LE, layer = bias_E.astype(jnp.float32)[None], np.zeros(1, np.int32)
        if ep > e:
            bias_LE = jnp.pad(bias_LE, ((0, 0), (0, ep - e)), constant_values=-jnp.inf)
    group = np.minimum(np.arange(ep, dtype=np.int32) // (e // n_group), n_group)[None]  # a constant
    # one token per program: the rounds of the kernel are a serial chain; rows in parallel fill the GPU
    out = pl.BlockSpec((1, kp), lambda i: (i, 0))
    idx, w = pl.pallas_call(
        functools.partial(_kernel, n_group=n_group, topk_group=topk_group, k=k, scale=scale),
        out_shape=[jax.ShapeDtypeStruct((n, kp), jnp.int32), jax.ShapeDtypeStruct((n, kp), jnp.float32)],
        grid=(n,),
        in_specs=[whole(logits), whole(layer), whole(bias_LE),
                  pl.BlockSpec((1, ep), lambda i: (0, 0))],
        out_specs=[out, out],
        name="route_select",
        **call_options(interpret, num_warps=NUM_WARPS, num_stages=1),
    )(logits, jnp.asarray(layer), bias_LE, jnp.asarray(group))
    return idx[:, :k], w[:, :k]


def select_experts(logits_NE: jax.Array, bias_E: jax.Array | WeightStack, *, n_group: int, topk_group: int,
                   k: int, scale: float, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(expert indices [N, k] int32, combine weights [N, k] float32) from router logits [N, E] and the
    selection bias [E]: `layers.moe.route`'s selection (module doc). E must be divisible by n_group;
    `interpret` defaults to True off GPU. Differentiable in the logits (the bias only ranks).

    Or, in a decode step (no gradient), logits as [S, N, E] partial sums to add and the bias as a
    `WeightStack` of [E] rows (module doc)."""
    e = logits_NE.shape[-1]
    if e % n_group or e // n_group < 2 or not 0 < topk_group <= n_group or not 0 < k <= topk_group * (e // n_group):
        raise ValueError(f"select_experts: E={e}, n_group={n_group}, topk_group={topk_group}, k={k}: need E "
                         "divisible by n_group into groups of >= 2, 0 < topk_group <= n_group, "
                         "0 < k <= topk_group * E / n_group")
    if logits_NE.ndim == 3 or isinstance(bias_E, WeightStack):
        logits_SNE = logits_NE if logits_NE.ndim == 3 else logits_NE[None]
        return _select(logits_SNE, bias_E, n_group, topk_group, k, scale, interpret)
    return _select_vjp(logits_NE, bias_E, n_group, topk_group, k, scale, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _select_vjp(logits_NE, bias_E, n_group, topk_group, k, scale, interpret):
    return _select(logits_NE[None], bias_E, n_group, topk_group, k, scale, interpret)


def _select_fwd(logits_NE, bias_E, n_group, topk_group, k, scale, interpret):
    idx, w = _select(logits_NE[None], bias_E, n_group, topk_group, k, scale, interpret)
    return (idx, w), (logits_NE, bias_E, idx)


def _select_bwd(n_group, topk_group, k, scale, interpret, res, cts):
    logits_NE, bias_E, idx = res
    _, vjp = jax.vjp(lambda lg: combine_weights(jax.nn.sigmoid(lg.astype(jnp.float32)), idx, scale), logits_NE)
    (d_logits,) = vjp(cts[1])
    return d_logits.astype(logits_NE.dtype), jnp.zeros_like(bias_E)


_select_vjp.defvjp(_select_fwd, _select_bwd)

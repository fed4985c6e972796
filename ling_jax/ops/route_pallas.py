"""The MoE's expert selection for a decode step as one Pallas kernel: scores, groups, top-k, weights.

`layers.moe.route` ranks `sigmoid(logits) + bias` within the best `topk_group` groups (a group
scores the sum of its two best) and weights the chosen experts by their unbiased scores,
renormalised and scaled. In XLA that is a chain of small launches per MoE layer (sigmoid, two
`top_k`s, one-hot, masks, gather, sums), which a decode step pays in every MoE layer. Here one
program (one warp) takes one token row with all E logits in registers and does every stage by
masked reductions. A one-warp reduction is a chain of dependent shuffles, so the kernel is as fast
as its chain of reductions is short: all groups' two best at once on a [groups, E] tile (3
reductions), every expert's group score and the number of groups ranked above its group by two
reductions over the group axis, then k rounds of "best expert, lowest index on ties" (2 each) — the
order of `lax.top_k`, so the kernel picks the experts the XLA form picks whenever the scores are
bit-identical (interpret mode; on a GPU Triton's `exp` may differ from XLA's in the last bit, which
can only swap experts whose scores tie to within that bit) — and the chosen experts' weights in one
reduction at the end. The `Kernels` record chooses it (`Kernels.route_for`: calls of up to
`Tuning.route_max_tokens` rows). Its cost in the decode step: BENCHMARKS.md ("Where a batch-1 step
goes"), docs/decode-performance.md.

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

from ling_jax.ops import l2_prefetch
from ling_jax.ops.layer_gemv import WeightStack
from ling_jax.ops.pallas_gpu import next_pow2, pad_axis, triton_call, whole

NUM_WARPS = 1  # one row per program: every reduction stays inside one warp (shuffles, no barriers)


def combine_weights(scores_NE: jax.Array, idx_NK: jax.Array, scale: float) -> jax.Array:
    """Combine weights [N, k] float32: the chosen experts' unbiased scores, renormalised (k > 1), scaled."""
    w_NK = jnp.take_along_axis(scores_NE, idx_NK, axis=1)
    if idx_NK.shape[1] > 1:
        w_NK = w_NK / (w_NK.sum(-1, keepdims=True) + 1e-20)
    return w_NK * scale


def _kernel(logits_ref, layer_ref, bias_ref, *refs, n: int, slabs: tuple[l2_prefetch.Slab, ...], **kw):
    """Programs [0, n) select row program_id's experts; the ones after read the prefetch slabs."""
    pre_refs, out_refs = refs[:2 * len(slabs)], refs[2 * len(slabs):]
    if not slabs:
        _select_row(pl.program_id(0), logits_ref, layer_ref, bias_ref, *out_refs, **kw)
        return
    pid = pl.program_id(0)

    @pl.when(pid < n)
    def _():
        _select_row(pid, logits_ref, layer_ref, bias_ref, *out_refs[:2], **kw)

    @pl.when(pid >= n)
    def _():
        l2_prefetch.read(pid - n, pre_refs, out_refs[2], slabs)


def _select_row(pid: jax.Array, logits_ref, layer_ref, bias_ref, idx_ref, w_ref, *, e: int, n_group: int,
                topk_group: int, k: int, scale: float) -> None:
    f32, ninf = jnp.float32, -jnp.inf
    row = pl.ds(pid, 1)
    # [1, Ep]: the sum of the S partial sums, unrolled so that every load is issued before the adds
    # wait on them (a loop would pay the memory latency S times over)
    logits = functools.reduce(jnp.add, [logits_ref[j, row, :] for j in range(logits_ref.shape[0])])
    scores = jax.nn.sigmoid(logits)
    sel = scores + bias_ref[pl.ds(layer_ref[0], 1), :].astype(f32)  # padded experts: bias -inf
    sel = jnp.where(sel != sel, ninf, sel)  # NaN scores rank last: every chosen index stays a real expert
    ep = sel.shape[1]
    col = jax.lax.broadcasted_iota(jnp.int32, (1, ep), 1)
    grp = jnp.where(col < e, col // (e // n_group), n_group)  # [1, Ep] each expert's group; n_group: padding

    # every group at once, [G, Ep] (a row per group, padded to a power of two; padding groups are empty):
    # the sum of its two best (the lowest index of equal bests counts as the first)
    g_col = jax.lax.broadcasted_iota(jnp.int32, (next_pow2(n_group), 1), 0)
    in_g = grp == g_col
    sel_g = jnp.where(in_g, sel, ninf)
    m1 = jnp.max(sel_g, axis=1, keepdims=True)
    i1 = jnp.min(jnp.where(in_g & (sel_g == m1), col, ep), axis=1, keepdims=True)
    group_score = m1 + jnp.max(jnp.where(in_g & (col != i1), sel, ninf), axis=1, keepdims=True)  # [G, 1]
    # each expert's group score and the number of groups ranked above its group (higher score, or equal
    # with a lower index), both reduced over the group axis: kept are the experts of the best topk_group
    score_e = jnp.sum(jnp.where(in_g, group_score, 0.0), axis=0, keepdims=True)  # [1, Ep]
    ahead = (group_score > score_e) | ((group_score == score_e) & (g_col < grp))
    keep = (jnp.sum(ahead.astype(jnp.int32), axis=0, keepdims=True) < topk_group) & (col < e)

    # k rounds of "best candidate, lowest index on ties" (the order of `lax.top_k`), two reductions each
    cand = jnp.where(keep, sel, ninf)
    kp = idx_ref.shape[0]
    k_col = jax.lax.broadcasted_iota(jnp.int32, (kp, 1), 0)
    idx = jnp.zeros((kp, 1), jnp.int32)
    for t in range(k):
        m = jnp.max(cand, axis=1, keepdims=True)
        i = jnp.min(jnp.where(cand == m, col, ep), axis=1, keepdims=True)
        idx = jnp.where(k_col == t, i, idx)
        cand = jnp.where(col == i, ninf, cand)
    # the chosen experts' unbiased scores, [kp, 1], in one reduction over [kp, Ep]
    w = jnp.sum(jnp.where((col == idx) & (k_col < k), scores, 0.0), axis=1, keepdims=True)
    if k > 1:
        w = w / (jnp.sum(w, axis=0, keepdims=True) + 1e-20)
    idx_ref[...] = idx
    w_ref[...] = w * scale


def _select(logits_SNE: jax.Array, bias: jax.Array | WeightStack, n_group: int, topk_group: int, k: int,
            scale: float, interpret: bool | None,
            prefetch: tuple[l2_prefetch.Prefetch, ...] = ()) -> tuple[jax.Array, jax.Array]:
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
    # one token per program: the rounds of the kernel are a serial chain; rows in parallel fill the GPU.
    # Each program writes its row's choices as a [kp, 1] column (the layout the kernel computes them in);
    # the prefetch programs after them (`ops.l2_prefetch`) write only their scratch value
    slabs, kept = l2_prefetch.plan(prefetch)
    extra = l2_prefetch.operands(kept)
    out = pl.BlockSpec((None, kp, 1), lambda i: (jnp.minimum(i, n - 1), 0, 0))
    scratch = [l2_prefetch.scratch(slabs)] if slabs else []
    outs = triton_call(
        functools.partial(_kernel, n=n, slabs=slabs, e=e, n_group=n_group, topk_group=topk_group, k=k, scale=scale),
        out_shape=[jax.ShapeDtypeStruct((n, kp, 1), jnp.int32), jax.ShapeDtypeStruct((n, kp, 1), jnp.float32)]
        + [a for a, _ in scratch],
        grid=(n + l2_prefetch.programs(slabs),),
        in_specs=[whole(logits), whole(layer), whole(bias_LE), *l2_prefetch.in_specs(extra)],
        out_specs=[out, out] + [spec for _, spec in scratch],
        name="route_select",
        interpret=interpret, num_warps=NUM_WARPS, num_stages=1,
    )(logits, jnp.asarray(layer), bias_LE, *extra)
    idx, w = outs[:2]
    return idx[:, :k, 0], w[:, :k, 0]


def select_experts(logits_NE: jax.Array, bias_E: jax.Array | WeightStack, *, n_group: int, topk_group: int,
                   k: int, scale: float, interpret: bool | None = None,
                   prefetch: tuple[l2_prefetch.Prefetch, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """(expert indices [N, k] int32, combine weights [N, k] float32) from router logits [N, E] and the
    selection bias [E]: `layers.moe.route`'s selection (module doc). E must be divisible by n_group
    into groups of >= 2, 0 < topk_group <= n_group, 0 < k <= topk_group * E / n_group, else
    ValueError. `interpret`: None chooses where the program is lowered (Triton for a GPU, interpret
    mode elsewhere; the decode step passes its record's `Launch.interpret`). Differentiable in the
    logits (the bias only ranks).

    Or, in a decode step (no gradient), logits as [S, N, E] partial sums to add and the bias as a
    `WeightStack` of [E] rows (module doc); there `prefetch` names weight slabs that the launch reads
    into L2 while its rows are selected (`ops.l2_prefetch`: the shared expert that the next launch
    reads)."""
    e = logits_NE.shape[-1]
    if e % n_group or e // n_group < 2 or not 0 < topk_group <= n_group or not 0 < k <= topk_group * (e // n_group):
        raise ValueError(f"select_experts: E={e}, n_group={n_group}, topk_group={topk_group}, k={k}: need E "
                         "divisible by n_group into groups of >= 2, 0 < topk_group <= n_group, "
                         "0 < k <= topk_group * E / n_group")
    if logits_NE.ndim == 3 or isinstance(bias_E, WeightStack):
        logits_SNE = logits_NE if logits_NE.ndim == 3 else logits_NE[None]
        return _select(logits_SNE, bias_E, n_group, topk_group, k, scale, interpret, prefetch)
    if prefetch:
        raise ValueError("select_experts: prefetch is for a decode step's selection ([S, N, E] partial sums)")
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

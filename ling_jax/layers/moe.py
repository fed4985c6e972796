"""MoE block: fp32 sigmoid router with selection-only bias, group-limited top-k, shared expert (§2.7),
and the expert-parallel dispatch of the routed experts.

With no context mesh (or a mesh of one device) the routed experts run on one device
(`ops.moe.routed_experts`). Under `jax.set_mesh(mesh)` they run in a `jax.shard_map` over the
mesh (the only place layer code names mesh axes):

1. tokens [N, D] are split over the token axes (data, fsdp, expert; padded to a multiple of
   their size); routing already happened outside, per token, under GSPMD;
2. the tokens, choices and weights of the devices of one *expert group* (same data/fsdp
   coordinates) are all-gathered over `expert` — every device now sees the tokens that could
   pick its experts;
3. each device runs its local experts on the copies that chose them (`ops.moe.routed_partial`:
   copies sorted by expert so they are contiguous, a grouped matmul over a worst-case-sized
   buffer, other experts' copies cost nothing) and forms float32 partial outputs for all the
   group's tokens;
4. `psum_scatter` over `expert` sums the partials and hands every device its own tokens back;
   a `psum` over `tensor` adds the intermediate-width slices when experts are tensor-sharded.
   FSDP-sharded expert weights are all-gathered over `fsdp` first.

Why all-gather + reduce-scatter and not all-to-all: it is exact and dropless on every backend
(XLA:CPU has no `ragged_all_to_all`), needs no capacity factor and no second routing pass, and
moves about the same bytes as a dispatch all-to-all when the expert-group size is at most k (8):
(EP-1)·N_local·D in, the same out, against k·(EP-1)/EP·N_local·D each way for all-to-all. Beyond
EP = k the all-to-all moves less; a `ragged_all_to_all` path (GPU/TPU) would send each device
only the copies for its experts and then need the receive-side sizes exchanged first (one small
all-to-all of counts) — the local compute below would be unchanged. docs/scaling.md has the
numbers.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling_jax import sharding
from ling_jax.config import LingConfig
from ling_jax.kernels import Kernels
from ling_jax.kernels import select as select_kernels
from ling_jax.layers.mlp import mlp
from ling_jax.ops.moe import EXPERT_LEAVES, expert_counts, routed_experts, routed_partial
from ling_jax.ops.route_pallas import combine_weights, select_experts


def router_logits(x_ND: jax.Array, w_router_DE: jax.Array, kernels: Kernels) -> jax.Array:
    """[N, E] float32 router logits: the float32 matmul at `kernels.precision`."""
    return jnp.matmul(x_ND.astype(jnp.float32), w_router_DE.astype(jnp.float32), precision=kernels.precision)


def select(logits_NE: jax.Array, bias_E: jax.Array, cfg: LingConfig) -> tuple[jax.Array, jax.Array]:
    """(expert indices [N, k] int32, combine weights [N, k] f32) from router logits [N, E] (XLA).

    Selection ranks `sigmoid(logits) + bias`: groups by the sum of their top-2, the best `topk_group`
    groups kept, then the top-k experts inside them. Weights are the *unbiased* scores of the chosen
    experts, renormalised (k > 1) and scaled by `routed_scaling_factor`.
    """
    n, e = logits_NE.shape
    scores_NE = jax.nn.sigmoid(logits_NE)
    sel_NE = scores_NE + bias_E.astype(jnp.float32)
    sel_NGX = sel_NE.reshape(n, cfg.n_group, e // cfg.n_group)
    group_score_NG = jax.lax.top_k(sel_NGX, 2)[0].sum(-1)
    _, top_groups = jax.lax.top_k(group_score_NG, cfg.topk_group)
    keep_NG = jax.nn.one_hot(top_groups, cfg.n_group, dtype=jnp.bool_).any(axis=1)
    masked_NE = jnp.where(keep_NG[..., None], sel_NGX, -jnp.inf).reshape(n, e)
    _, idx_NK = jax.lax.top_k(masked_NE, cfg.num_experts_per_tok)
    idx_NK = idx_NK.astype(jnp.int32)
    return idx_NK, combine_weights(scores_NE, idx_NK, cfg.routed_scaling_factor)


def route(x_ND: jax.Array, w_router_DE: jax.Array, bias_E: jax.Array, cfg: LingConfig,
          kernels: Kernels | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(expert indices [N, k] int32, combine weights [N, k] f32, router logits [N, E] f32): `select`
    on the router's logits, as one Pallas kernel where `kernels.route_for(N)` (same result).
    `kernels`: default `kernels.select` for x's dtype."""
    kernels = kernels or select_kernels(cfg, dtype=x_ND.dtype)
    logits_NE = router_logits(x_ND, w_router_DE, kernels)
    if kernels.route_for(x_ND.shape[0]):
        idx_NK, w_NK = select_experts(logits_NE, bias_E, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                      k=cfg.num_experts_per_tok, scale=cfg.routed_scaling_factor)
        return idx_NK, w_NK, logits_NE
    return *select(logits_NE, bias_E, cfg), logits_NE


def expert_parallel(
    x_ND: jax.Array, idx_NK: jax.Array, w_NK: jax.Array, w_gate_EDI: jax.Array, w_up_EDI: jax.Array,
    w_down_EID: jax.Array, *, limit: jax.Array | float, kernels: Kernels, mesh: jax.sharding.AbstractMesh,
) -> tuple[jax.Array, jax.Array]:
    """Routed-expert output [N, D] (x's dtype) and global tokens per expert [E] over `mesh` (module doc).

    The expert weights' layout inside the shard_map is the sharding table's (`expert_in` /
    `expert_out`, divisibility fallback included), whatever layout they arrive in.
    """
    n, d = x_ND.shape
    e = w_gate_EDI.shape[0]
    sizes = sharding.axis_sizes(mesh)
    tok_axes = tuple(a for a in sharding.BATCH_AXES if sizes[a] > 1)
    n_shards = math.prod(sizes[a] for a in tok_axes)
    n_pad = -n % n_shards
    if n_pad:  # padding rows choose the sentinel expert E: never computed, never counted
        x_ND = jnp.pad(x_ND, ((0, n_pad), (0, 0)))
        idx_NK = jnp.pad(idx_NK, ((0, n_pad), (0, 0)), constant_values=e)
        w_NK = jnp.pad(w_NK, ((0, n_pad), (0, 0)))
    spec_in = sharding.spec("expert_in", w_gate_EDI.shape, mesh)
    spec_out = sharding.spec("expert_out", w_down_EID.shape, mesh)
    spec_in = tuple(spec_in) + (None,) * (3 - len(spec_in))
    ep_on, fsdp_on, tp_on = spec_in[0] == "expert", spec_in[1] == "fsdp", spec_in[2] == "tensor"
    # the gemv kernel cannot run inside this shard_map (its pallas_call has no manual-axis output
    # types under check_vma), and it is a one-device decode kernel anyway: the shards gather
    k = idx_NK.shape[1]
    group_copies = (n + n_pad) // n_shards * (sizes["expert"] if ep_on else 1) * k
    local_impl = kernels.moe_for(group_copies)
    local_impl = "gather" if local_impl == "gemv" else local_impl
    tok = P(tok_axes if tok_axes else None, None)

    def local(x_ND, idx_NK, w_NK, wg_LDI, wu_LDI, wd_LID, limit):
        if fsdp_on:
            wg_LDI = jax.lax.all_gather(wg_LDI, "fsdp", axis=1, tiled=True)
            wu_LDI = jax.lax.all_gather(wu_LDI, "fsdp", axis=1, tiled=True)
            wd_LID = jax.lax.all_gather(wd_LID, "fsdp", axis=2, tiled=True)
        first = 0
        x_GD, idx_GK, w_GK = x_ND, idx_NK, w_NK
        if ep_on:
            x_GD, idx_GK, w_GK = (jax.lax.all_gather(a, "expert", axis=0, tiled=True) for a in (x_ND, idx_NK, w_NK))
            first = jax.lax.axis_index("expert") * wg_LDI.shape[0]
        y_GD = routed_partial(x_GD, idx_GK, w_GK, first, wg_LDI, wu_LDI, wd_LID, limit=limit, impl=local_impl,
                              rows_only=False, launch=kernels.tuning.launch)
        y_ND = jax.lax.psum_scatter(y_GD, "expert", scatter_dimension=0, tiled=True) if ep_on else y_GD
        if tp_on:
            y_ND = jax.lax.psum(y_ND, "tensor")
        counts_E = expert_counts(idx_NK, e)
        if tok_axes:
            counts_E = jax.lax.psum(counts_E, tok_axes)
        return y_ND.astype(x_ND.dtype), counts_E

    y_ND, counts_E = jax.shard_map(
        local, mesh=mesh, in_specs=(tok, tok, tok, P(*spec_in), P(*spec_in), spec_out, P()),
        out_specs=(tok, P()),
    )(x_ND, idx_NK, w_NK, w_gate_EDI, w_up_EDI, w_down_EID, jnp.asarray(limit, jnp.float32))
    return y_ND[:n], counts_E


def moe(p: dict[str, Any], x: jax.Array, *, cfg: LingConfig, kernels: Kernels | None = None,
        limit: jax.Array | float = 0.0, shared_limit: jax.Array | float = 0.0
        ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [..., D] -> ([..., D], router aux).

    Aux: per token (flattened to [N, ...]) "topk_idx", "topk_weight", "logits"; and
    "expert_counts" [E] int32, the copies routed to each expert summed over every token of the
    call (the global batch under a mesh) — what the aux-loss-free bias update needs. The routed
    experts run `kernels.moe_for(N x k)` (default record: `kernels.select` for x's dtype); under a
    multi-device mesh, expert-parallel (module doc).
    """
    kernels = kernels or select_kernels(cfg, dtype=x.dtype)
    x_ND = x.reshape(-1, x.shape[-1])
    with jax.named_scope("router"):
        idx_NK, w_NK, logits_NE = route(x_ND, p["router"], p["expert_bias"], cfg, kernels)
    with jax.named_scope("routed"):
        if not kernels.sharded:
            impl = kernels.moe_for(idx_NK.size)
            y_ND = routed_experts(x_ND, idx_NK, w_NK, p["gate_proj"], p["up_proj"], p["down_proj"],
                                  limit=limit, impl=impl, rows_only=kernels.inference, launch=kernels.tuning.launch)
            counts_E = expert_counts(idx_NK, p["gate_proj"].shape[0])
        else:
            y_ND, counts_E = expert_parallel(x_ND, idx_NK, w_NK, *(p[n] for n in EXPERT_LEAVES), limit=limit,
                                             kernels=kernels, mesh=sharding.context_mesh())
    if "shared_gate_proj" in p:
        with jax.named_scope("shared"):
            y_ND = y_ND + mlp(x_ND, p["shared_gate_proj"], p["shared_up_proj"], p["shared_down_proj"], shared_limit)
    aux = {"topk_idx": idx_NK, "topk_weight": w_NK, "logits": logits_NE, "expert_counts": counts_E}
    return y_ND.reshape(x.shape), aux

"""Memory plans: bytes per device for inference and training, computed from the config, the param
table and the sharding table (docs/scaling.md shows the output).

Params are divided exactly as `ling_jax.sharding` shards them on the given mesh: every leaf of
`params.param_slots` by the product of the mesh axes its PartitionSpec names (divisibility
fallback included). Decode caches use the table's cache roles (`kda_state`, `kda_conv`,
`mla_latent`). Activations are formulas of what our code paths allocate, per device:

  * MoE: the expert-parallel dispatch of layers/moe.py — tokens all-gathered over the expert group
    (N_g = tokens per device x EP), the worst-case sorted-copy buffer cap = N_g * min(k, E_local)
    rows (dropless: every copy may land on one device), its gate/up/act intermediates, the
    unsorted output, the float32 partial sums, and the expert weights gathered over `fsdp`;
  * MLA: the materialised [B, H, T, T] float32 scores and bf16 probabilities of ops/attention.py;
  * KDA: projections, conv outputs, gates and the per-chunk float32 states (chunks of 32 in the GPU
    plans, where the kernels run at 32 (`ops.kda.api.kernel_chunk`), else 64);
  * training: full rematerialisation per layer — each layer's bf16 input is saved, one layer at a
    time is recomputed and differentiated (its working set counted twice: forward values + their
    gradients) — plus float32 logits and their gradient.

These activation numbers are estimates of the dominant buffers (XLA's allocator adds fusion
temporaries and fragmentation on top); the param/optimizer/cache rows are exact for the layouts.

    python -m ling_jax.memory            # the plans of docs/scaling.md
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from ling_jax.config import LingConfig
from ling_jax.ops.kda.api import DEFAULT_CHUNK, kernel_chunk
from ling_jax.params import ParamSlot, param_slots
from ling_jax.sharding import AXES, axis_sizes, param_spec, spec

GB = 1e9
FP8_BLOCK = 128
# linear weights an FP8 checkpoint keeps in bf16 (ARCHITECTURE.md §4): embeddings, lm_head,
# router, KDA beta projection, MLA head-wise gate; everything 1-D or non-linear is never FP8.
FP8_EXCLUDED = {"embed", "lm_head", "router", "b_proj"}


def shards(spec_entries: tuple, sizes: Mapping[str, int]) -> int:
    """How many pieces a PartitionSpec cuts an array into on a mesh of `sizes`."""
    n = 1
    for ax in spec_entries:
        for a in (ax,) if isinstance(ax, str) else (ax or ()):
            n *= sizes[a]
    return n


def bf16_bytes(slot: ParamSlot) -> float:
    """Bytes per element of a leaf held in bf16 (float32 where the table keeps float32)."""
    return 4.0 if slot.leaf.fp32 else 2.0


def fp8_bytes(cfg: LingConfig) -> Callable[[ParamSlot], float]:
    """Bytes per element of a leaf in a block-FP8 checkpoint kept FP8 in memory: 1 byte plus one
    float32 scale per 128x128 block for quantized linear weights, bf16/fp32 otherwise."""
    head_wise = cfg.gated_attention_proj_granularity_type == "head_wise"

    def per_element(slot: ParamSlot) -> float:
        name = slot.path[-1]
        mla_gate = name == "g_proj" and head_wise and slot.shape[-1] == cfg.num_attention_heads
        if slot.leaf.transform != "T" or name in FP8_EXCLUDED or mla_gate:
            return bf16_bytes(slot)
        return 1.0 + 4.0 / (FP8_BLOCK * FP8_BLOCK)

    return per_element


def param_bytes(cfg: LingConfig, sizes: Mapping[str, int], per_element: Callable[[ParamSlot], float],
                select: Callable[[ParamSlot], bool] = lambda s: True) -> float:
    """Bytes per device of the selected param leaves, each divided as the sharding table shards it."""
    total = 0.0
    for slot in param_slots(cfg):
        if select(slot):
            total += math.prod(slot.shape) / shards(tuple(param_spec(cfg, slot, sizes)), sizes) * per_element(slot)
    return total


def param_count(cfg: LingConfig) -> int:
    return sum(math.prod(s.shape) for s in param_slots(cfg))


@dataclasses.dataclass
class Plan:
    """Rows of (item, bytes per device, how it was computed) for one model on one mesh."""

    title: str
    mesh: dict[str, int]
    hbm_bytes: float
    rows: list[tuple[str, float, str]] = dataclasses.field(default_factory=list)

    def add(self, item: str, nbytes: float, how: str) -> None:
        self.rows.append((item, float(nbytes), how))

    @property
    def total(self) -> float:
        return sum(b for _, b, _ in self.rows)

    def markdown(self) -> str:
        mesh = " x ".join(f"{a}={n}" for a, n in self.mesh.items() if n > 1) or "1 device"
        lines = [f"#### {self.title}", "", f"mesh: {mesh} ({math.prod(self.mesh.values())} devices), "
                 f"HBM {self.hbm_bytes / GB:.0f} GB per device", "", "| item | GB per device | how |", "|---|---:|---|"]
        lines += [f"| {item} | {b / GB:.2f} | {how} |" for item, b, how in self.rows]
        fits = "fits" if self.total <= self.hbm_bytes else "**does not fit**"
        lines.append(f"| **total** | **{self.total / GB:.2f}** | {fits} ({self.total / self.hbm_bytes:.0%} of HBM) |")
        return "\n".join(lines)


def _layer_counts(cfg: LingConfig, mtp: bool = True) -> dict[str, int]:
    """Layers by mixer and FFN kind (`mtp`: the MTP layers included)."""
    kinds = list(cfg.layer_kinds) + [("mla", cfg.ffn_of(cfg.num_hidden_layers + j))
                                     for j in range(cfg.num_nextn_predict_layers if mtp else 0)]
    return {"kda": sum(m == "kda" for m, _ in kinds), "mla": sum(m == "mla" for m, _ in kinds),
            "moe": sum(f == "moe" for _, f in kinds), "dense": sum(f == "dense" for _, f in kinds),
            "layers": len(kinds)}


def _token_shards(sizes: Mapping[str, int], batch: int) -> int:
    """Devices the batch rows are split over (the table's `tokens_bt` role, fallback included)."""
    return shards(tuple(spec("tokens_bt", (batch, 1), sizes)), sizes)


def _div(n: int, sizes: Mapping[str, int], axis: str) -> int:
    """n divided by `axis` when the table would shard a dim of n over it (else n)."""
    return n // sizes[axis] if n % sizes[axis] == 0 else n


def moe_buffers(cfg: LingConfig, sizes: Mapping[str, int], tokens: int, act_bytes: int = 2) -> float:
    """Dominant buffers of one MoE layer's routed experts on one device for `tokens` local tokens."""
    e, k, d, i = cfg.num_experts or 0, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    spec_in = tuple(spec("expert_in", (e, d, i), sizes)) + (None,) * 3
    ep = sizes["expert"] if spec_in[0] == "expert" else 1
    i_l = i // sizes["tensor"] if spec_in[2] == "tensor" else i
    e_l = e // ep
    n_g = tokens * ep
    cap = n_g * min(k, e_l)
    total = n_g * d * act_bytes  # all-gathered tokens of the expert group
    total += cap * d * act_bytes * 2  # sorted copies in, expert outputs out
    total += cap * i_l * act_bytes * 3  # gate, up, activation
    total += n_g * k * d * act_bytes  # unsorted outputs [N_g * k, D]
    total += n_g * d * 4  # float32 partial sums before psum_scatter
    if spec_in[1] == "fsdp":  # expert weights gathered over fsdp for this layer
        total += e_l * 3 * d * i_l * act_bytes
    return total


def kda_buffers(cfg: LingConfig, sizes: Mapping[str, int], tokens: int, act_bytes: int = 2,
                training: bool = False, chunk: int = DEFAULT_CHUNK) -> float:
    """Dominant buffers of one KDA layer for `tokens` local tokens (heads split over tensor) at chunks
    of `chunk`; `training`: with the Pallas kernels' backward residuals and float32 partials."""
    p = _div(cfg.kda_dim, sizes, "tensor")
    h = _div(cfg.num_attention_heads, sizes, "tensor")
    dh = cfg.head_dim
    per_token = (3 * p + 3 * p + 2 * p + 2 * p) * act_bytes + p * 4 + cfg.hidden_size * act_bytes
    if training:  # the Pallas kernels' backward: residuals M and At ([C] float32 per head) and the
        per_token += 2 * h * chunk * 4 + 3 * h * dh * 4  # float32 partial dq, dk, dG between bwd_dqkg and bwd_pairs
    return tokens * per_token + math.ceil(tokens / chunk) * h * dh * dh * 4


def mla_buffers(cfg: LingConfig, sizes: Mapping[str, int], rows: int, seq: int, act_bytes: int = 2,
                fused: bool = False) -> float:
    """Dominant buffers of one MLA layer for `rows` local sequences of `seq` tokens: the materialised
    softmax's [H, T, T] scores, probabilities and mask, or (`fused`: the fused kernels of
    ops.attention_pallas, attention_impl "auto" on GPU) the output, row log-sum-exps and the
    backward's per-head float32 rope-key gradient."""
    h = _div(cfg.num_attention_heads, sizes, "tensor")
    qkv = rows * seq * h * (2 * cfg.qk_head_dim + cfg.v_head_dim) * act_bytes
    if fused:
        return qkv + rows * seq * h * (cfg.v_head_dim * act_bytes + 4 + cfg.qk_rope_head_dim * 4)
    return rows * h * seq * seq * (4 + act_bytes) + rows * seq * seq + qkv


def _mla_name(fused: bool) -> str:
    return "MLA fused attention" if fused else "MLA T x T scores"


def _largest(candidates: dict[str, float]) -> tuple[str, float]:
    name = max(candidates, key=candidates.__getitem__)
    return name, candidates[name]


def plan_inference(cfg: LingConfig, mesh: Mapping[str, int], *, batch: int, context: int, weights: str = "fp8",
                   prefill_tokens: int = 8192, hbm_gb: float = 141.0, title: str = "", fused_attention: bool = False
                   ) -> Plan:
    """Serving: weights (FP8 kept FP8, or bf16), decode caches for `batch` sequences of `context`
    tokens, and the working set of prefilling `prefill_tokens` tokens per device (one sequence chunk);
    `fused_attention`: a GPU plan - MLA through the fused kernels instead of the materialised softmax,
    KDA at the kernels' GPU chunk (`api.kernel_chunk`)."""
    sizes = axis_sizes(mesh)
    plan = Plan(title or f"{cfg.num_hidden_layers}-layer model inference", sizes, hbm_gb * GB)
    per_el = fp8_bytes(cfg) if weights == "fp8" else bf16_bytes
    how_w = "FP8 e4m3 + fp32 128x128 block scales; embeddings, lm_head, router, gates bf16" \
        if weights == "fp8" else "bf16"
    experts = param_bytes(cfg, sizes, per_el, lambda s: s.leaf.experts)
    plan.add("routed-expert weights", experts, f"{how_w}; table: [E, D, I] over (expert, fsdp, tensor)")
    plan.add("other weights", param_bytes(cfg, sizes, per_el, lambda s: not s.leaf.experts),
             f"{how_w}; table roles in_proj/out_proj/lora/embed/lm_head")
    if weights == "fp8":  # the model dequantizes one layer's FP8 weights at a time, inside the layer
        fp8 = fp8_bytes(cfg)
        one_layer = _largest_layer(cfg, sizes, lambda s: 2.0 if fp8(s) < 2.0 else 0.0)
        plan.add("one layer dequantized", one_layer, "bf16 copy of the largest layer's FP8 weights, split like them")
    # the caches `generate` allocates: the main layers' (decoding does not run the MTP layer)
    n = _layer_counts(cfg, mtp=False)
    h, dh, p, w = cfg.num_attention_heads, cfg.head_dim, cfg.kda_dim, cfg.short_conv_kernel_size
    state = math.prod((batch, h, dh, dh)) * 4 / shards(tuple(spec("kda_state", (batch, h, dh, dh), sizes)), sizes)
    conv = math.prod((batch, w - 1, 3 * p)) * 2 / shards(tuple(spec("kda_conv", (batch, w - 1, 3 * p), sizes)), sizes)
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    latent = batch * context * width * 2 / shards(tuple(spec("mla_latent", (batch, context, width), sizes)), sizes)
    plan.add("KDA state cache", n["kda"] * (state + conv),
             f"{n['kda']} layers x {batch} seqs x [H {h}, {dh}, {dh}] fp32 + conv window; role kda_state")
    plan.add("MLA latent cache", n["mla"] * latent,
             f"{n['mla']} layers x {batch} seqs x {context} tokens x {width} bf16; role mla_latent")
    t = prefill_tokens
    layer, work = _largest({"MoE worst-case buffers": moe_buffers(cfg, sizes, t),
                            "KDA": kda_buffers(cfg, sizes, t, chunk=kernel_chunk(DEFAULT_CHUNK, gpu=fused_attention)),
                            _mla_name(fused_attention): mla_buffers(cfg, sizes, 1, t, fused=fused_attention)})
    logits = _div(cfg.vocab_size, sizes, "tensor") * 4  # logits of the last position only
    plan.add("prefill working set", work + t * cfg.hidden_size * 2 * 2 + logits,
             f"largest layer at {t} tokens/device: {layer}; + residual stream")
    return plan


def plan_training(cfg: LingConfig, mesh: Mapping[str, int], *, batch: int, seq_len: int, hbm_gb: float,
                  title: str = "", fused_attention: bool = False) -> Plan:
    """Continued pretraining with AdamW: fp32 master params, 2 fp32 moments, fp32 grads, a bf16
    compute copy, full per-layer remat; `batch` sequences of `seq_len` tokens per step (global);
    `fused_attention`: a GPU plan, as in `plan_inference`."""
    sizes = axis_sizes(mesh)
    plan = Plan(title or f"{cfg.num_hidden_layers}-layer model training", sizes, hbm_gb * GB)
    n_params = param_count(cfg)
    master = param_bytes(cfg, sizes, lambda s: 4.0)
    plan.add("fp32 master params", master, f"{n_params / 1e9:.2f} B params, divided by the table")
    plan.add("AdamW moments (2 x fp32)", 2 * master, "sharded like the params")
    plan.add("fp32 gradients", master, "sharded like the params")
    plan.add("bf16 compute copy", master / 2, "cast of the sharded master")
    # FSDP: the layer being computed has its weights gathered over fsdp (experts stay split over expert/tensor)
    unsharded = {a: (1 if a == "fsdp" else sizes[a]) for a in AXES}
    per_layer = _largest_layer(cfg, unsharded, lambda s: 2.0)
    lm_head = cfg.hidden_size * _div(cfg.vocab_size, sizes, "tensor") * 2
    if sizes["fsdp"] > 1:
        plan.add("gathered weights of one layer", 2 * max(per_layer, lm_head),
                 "bf16 weights of the largest layer (or lm_head) gathered over fsdp, x2 (fwd/bwd overlap)")
    rows = batch / _token_shards(sizes, batch)
    t = int(rows * seq_len)
    n = _layer_counts(cfg)
    plan.add("saved layer inputs (remat)", n["layers"] * t * cfg.hidden_size * 2,
             f"{n['layers']} layers x {t} tokens/device x D bf16")
    layer, work = _largest({"MoE worst-case buffers": moe_buffers(cfg, sizes, t) + t * cfg.hidden_size * 2 * 6,
                            "KDA": kda_buffers(cfg, sizes, t, training=True,
                                               chunk=kernel_chunk(DEFAULT_CHUNK, gpu=fused_attention)),
                            _mla_name(fused_attention): mla_buffers(cfg, sizes, max(1, round(rows)), seq_len,
                                                                    fused=fused_attention)})
    plan.add("one layer recomputed + its grads", 2 * work, f"largest layer: {layer}, x2 (values + grads)")
    v_l = _div(cfg.vocab_size, sizes, "tensor")
    heads = 1 + (cfg.num_nextn_predict_layers > 0)
    plan.add("logits + grad (fp32)", heads * 2 * t * v_l * 4, f"{t} tokens x V/{cfg.vocab_size // v_l} x 4 B x 2"
             f"{' (main + MTP)' if heads > 1 else ''}")
    return plan


def _largest_layer(cfg: LingConfig, sizes: Mapping[str, int], per_element: Callable[[ParamSlot], float]) -> float:
    """Bytes per device of the largest single layer's params (one element of a layer stack)."""
    return max(param_bytes(cfg, sizes, per_element, lambda s, st=st: s.path[:len(st)] == st)
               / max(1, math.prod(_stack_shape(cfg, st))) for st in _stack_paths(cfg))


def _stack_paths(cfg: LingConfig) -> list[tuple]:
    from ling_jax.params import layer_stacks

    return [st.path for st in layer_stacks(cfg)]


def _stack_shape(cfg: LingConfig, path: tuple) -> tuple[int, ...]:
    from ling_jax.params import layer_stacks

    return next(st.layers.shape for st in layer_stacks(cfg) if st.path == path)


H200 = 141.0  # GB of HBM3e per H200
V5P = 95.0  # GB of HBM2e per TPU v5p chip


def standard_plans() -> list[Plan]:
    """The plans of docs/scaling.md."""
    flash31 = LingConfig.preset("ling-3.1-flash")
    tiny, flash30 = LingConfig.preset("ling-3.0-tiny"), LingConfig.preset("ling-3.0-flash")
    return [
        plan_inference(flash31, {"expert": 8}, batch=64, context=32768, hbm_gb=H200, fused_attention=True,
                       title="Ling-3.1-flash FP8 inference, 8xH200, EP8 (64 seqs x 32k context)"),
        plan_inference(flash31, {"tensor": 8}, batch=64, context=32768, hbm_gb=H200, fused_attention=True,
                       title="Ling-3.1-flash FP8 inference, 8xH200, TP8 (64 seqs x 32k context)"),
        plan_inference(flash31, {"expert": 8}, batch=64, context=32768, weights="bf16", hbm_gb=H200,
                       fused_attention=True,
                       title="Ling-3.1-flash dequantized to bf16, 8xH200, EP8 (for comparison)"),
        plan_training(tiny, {"fsdp": 8}, batch=16, seq_len=4096, hbm_gb=H200, fused_attention=True,
                      title="Ling-3.0-tiny CPT, 8xH200, FSDP8 (16 x 4096 tokens/step)"),
        plan_training(tiny, {"fsdp": 8, "expert": 8}, batch=64, seq_len=4096, hbm_gb=V5P,
                      title="Ling-3.0-tiny CPT, TPU v5p-64 (64 chips), FSDP8 x EP8 (64 x 4096 tokens/step)"),
        plan_training(flash30, {"fsdp": 8}, batch=16, seq_len=4096, hbm_gb=H200, fused_attention=True,
                      title="Ling-3.0-flash CPT, 8xH200, FSDP8 (16 x 4096 tokens/step)"),
        plan_training(flash30, {"fsdp": 4, "expert": 8}, batch=32, seq_len=4096, hbm_gb=H200, fused_attention=True,
                      title="Ling-3.0-flash CPT, 32xH200 (4 nodes), FSDP4 x EP8 (32 x 4096 tokens/step)"),
        plan_training(flash30, {"fsdp": 8, "expert": 8}, batch=64, seq_len=4096, hbm_gb=V5P,
                      title="Ling-3.0-flash CPT, TPU v5p-64 (64 chips), FSDP8 x EP8 (64 x 4096 tokens/step)"),
    ]


def main() -> None:
    for plan in standard_plans():
        print(plan.markdown())
        print()


if __name__ == "__main__":
    main()

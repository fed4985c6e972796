"""Model FLOPs per token and MFU (model FLOPs utilisation) from the config alone.

Counts what the model must compute, not what an implementation happens to do: 2 FLOPs per
multiply-add of every weight matmul a token touches (routed experts at top-k, the shared expert,
the router, the lm_head), plus the KDA chunked-form work and the causal MLA attention; training is
3x the forward (forward + 2x backward), remat recomputation not counted (as MFU conventions do).
"""

from __future__ import annotations

import jax

from ling_jax.config import LingConfig

# dense bf16 peak per device (vendor datasheets), for MFU; override with TrainConfig.peak_tflops
PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0, "tpu v5p": 459.0, "tpu v5e": 197.0,
               "tpu v5 lite": 197.0, "tpu v6e": 918.0, "tpu v4": 275.0}


def kda_matmul_params(cfg: LingConfig) -> int:
    """Weights of one KDA mixer's matmuls (q, k, v, f, g, b, o projections)."""
    d, p, h, dh = cfg.hidden_size, cfg.kda_dim, cfg.num_attention_heads, cfg.head_dim
    fg = 2 * d * p if cfg.no_kda_lora else 2 * (d * dh + dh * p)
    return 3 * d * p + fg + d * h + p * d


def mla_matmul_params(cfg: LingConfig) -> int:
    """Weights of one MLA mixer's matmuls (query, kv_a, kv_b, gate, dense)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    q = d * h * cfg.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank * (d + h * cfg.qk_head_dim)
    gate = h if cfg.gated_attention_proj_granularity_type == "head_wise" else h * cfg.v_head_dim
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + d * gate + h * cfg.v_head_dim * d


def ffn_matmul_params(cfg: LingConfig, ffn: str) -> int:
    """Weights one token multiplies in an FFN: dense MLP, or router + k routed experts + shared expert."""
    d = cfg.hidden_size
    if ffn == "dense":
        return 3 * d * cfg.intermediate_size
    e = cfg.num_experts or 0
    return d * e + 3 * d * cfg.moe_intermediate_size * cfg.num_experts_per_tok + 3 * d * cfg.shared_intermediate_size


def kda_flops_per_token(cfg: LingConfig, chunk: int = 64) -> float:
    """Chunked-form KDA per token, all heads: 2C(3K+2V) + 6KV + 2C^2 per head (intra-chunk A, solve,
    W/U, state read/write and output)."""
    k = v = cfg.head_dim
    return cfg.num_attention_heads * (2 * chunk * (3 * k + 2 * v) + 6 * k * v + 2 * chunk * chunk)


def mla_attention_flops_per_token(cfg: LingConfig, seq_len: int) -> float:
    """Causal softmax attention: scores and values over (T+1)/2 keys on average, every head."""
    return 2 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * (seq_len + 1) / 2


def forward_flops_per_token(cfg: LingConfig, seq_len: int, *, mtp: bool = False) -> float:
    """Forward FLOPs per token of the main model (+ the MTP layers if `mtp`)."""
    total = 2.0 * cfg.hidden_size * cfg.vocab_size  # lm_head
    for mixer, ffn in cfg.layer_kinds:
        if mixer == "kda":
            total += 2 * kda_matmul_params(cfg) + kda_flops_per_token(cfg)
        else:
            total += 2 * mla_matmul_params(cfg) + mla_attention_flops_per_token(cfg, seq_len)
        total += 2 * ffn_matmul_params(cfg, ffn)
    if mtp:
        for j in range(cfg.num_nextn_predict_layers):
            i = cfg.num_hidden_layers + j
            total += 2 * (2 * cfg.hidden_size * cfg.hidden_size + mla_matmul_params(cfg)
                          + ffn_matmul_params(cfg, cfg.ffn_of(i)) + cfg.hidden_size * cfg.vocab_size)
            total += mla_attention_flops_per_token(cfg, seq_len)
    return total


def train_flops_per_token(cfg: LingConfig, seq_len: int, *, mtp: bool = False) -> float:
    return 3.0 * forward_flops_per_token(cfg, seq_len, mtp=mtp)


def peak_flops_per_device(override_tflops: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of the first device, or None when unknown (e.g. CPU)."""
    if override_tflops:
        return override_tflops * 1e12
    kind = jax.devices()[0].device_kind.lower()
    for name, tflops in PEAK_TFLOPS.items():
        if name in kind:
            return tflops * 1e12
    return None

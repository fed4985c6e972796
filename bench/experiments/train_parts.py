"""The train step of `bench/train.py` timed in parts: trace + lower, XLA compile, then the step.

    python3 bench/experiments/train_parts.py --batch-size 2 --steps 4 --out $OUT/train_parts.json

Ling-3.0-tiny widths with `--layers` layers, `--seq-len` tokens per row (three documents), Pallas KDA,
MoE `auto`, remat `dots_kernels`, layers unrolled, fp32 masters with bf16 compute (as `bench/train.py`'s
GPU command). Reports `trace_lower_s` (`jit(...).lower`), the StableHLO's size and custom calls,
`compile_s` (`.compile()`), and the median of `--steps` step times after one warm-up step. The
parts tell a slower first step's cause (tracing, or XLA and the kernels' compilation) where
`bench/train.py` reports only their sum. `--smoke`: the debug preset, tiny sizes (CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from bench.common import machine, random_params, write_json
from bench.train import batch
from ling_jax.config import LingConfig
from train.config import TrainConfig
from train.optim import make_optimizer
from train.step import init_state, make_train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    preset = "debug" if args.smoke else "ling-3.0-tiny"
    if args.smoke:
        args.layers, args.seq_len, args.batch_size, args.steps = 4, 128, 1, 1
    base = LingConfig.preset(preset, num_hidden_layers=args.layers)
    cfg = dataclasses.replace(base, kda_impl="pallas", moe_impl="auto")
    tcfg = TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len, remat="dots_kernels", unroll_layers=True,
                       logits_dtype="float32", compute_dtype="bfloat16", mtp_loss_weight=0.0)
    opt = make_optimizer(cfg, tcfg)
    state = init_state(cfg, tcfg, opt, random_params(cfg, jnp.float32))
    data = batch(base, args.batch_size, args.seq_len, 0)
    step = jax.jit(make_train_step(cfg, tcfg, opt), donate_argnums=0)
    result = {**machine(), "preset": preset, "layers": args.layers, "seq_len": args.seq_len,
              "batch_size": args.batch_size}
    t0 = time.perf_counter()
    lowered = step.lower(state, data)
    result["trace_lower_s"] = time.perf_counter() - t0
    text = lowered.as_text()
    result["stablehlo_chars"], result["custom_calls"] = len(text), text.count("custom_call")
    print({k: result[k] for k in ("trace_lower_s", "stablehlo_chars", "custom_calls")}, flush=True)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    result["compile_s"] = time.perf_counter() - t0
    print(f"compile {result['compile_s']:.1f} s", flush=True)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        state, metrics = compiled(state, data)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    result["steps_s"], result["step_s"] = times, statistics.median(times[1:])
    result["loss"] = float(metrics["loss"])
    print(f"step {result['step_s']:.4f} s (median of {args.steps}); wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()

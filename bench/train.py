"""Train-step benchmark: step time, tokens/s and MFU of a Ling-3.0-tiny-shaped model.

    python3 bench/train.py --out bench/results/train_h200.json            # the GPU run
    python3 bench/train.py --smoke --out /tmp/train_smoke.json            # CPU, debug preset, a minute
    XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" python3 bench/train.py --out x.json \
        --kda-impl pallas --remat full --profile /tmp/trace                 # + where the step's time goes

The full jitted train step of `train/step.py` (fp32 master params, bf16 compute, AdamW, gradient
clipping, expert-bias update, MTP loss off) on random packed batches of `--seq-len` tokens with a
few document boundaries per row. Ling-3.0-tiny has 24 layers and 8.2 B params; fp32 masters +
Adam moments + grads (16 B/param) do not fit one H200 with activations, so `--layers` reduces the
depth (the layer kinds and every width are Tiny's; the run records the count). Each
(remat policy, KDA implementation) pair is compiled and timed: median of `--steps` warmed-up steps.
MFU = model FLOPs per token (train/flops.py: matmuls at top-k, KDA chunk work, causal MLA;
training = 3x forward) x tokens/s / (peak bf16 FLOP/s of the device: 989 TFLOP/s for an H200 by
datasheet, and the bf16 matmul rate measured in the same run).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, matmul_rate, median_time, random_params, write_json
from bench.device_profile import device_profile, print_profile
from ling_jax.config import LingConfig
from train.config import TrainConfig
from train.flops import peak_flops_per_device, train_flops_per_token
from train.optim import make_optimizer
from train.step import init_state, make_train_step


def batch(cfg: LingConfig, b: int, t: int, seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    inputs = rng.integers(2, cfg.vocab_size, (b, t)).astype(np.int32)
    seg = np.zeros((b, t), np.int32)
    for r in range(b):  # three documents per row, boundaries at random places
        for cut in sorted(rng.integers(1, t, 2)):
            seg[r, cut:] += 1
    labels = np.roll(inputs, -1, axis=1)
    labels[:, -1] = -100
    labels[np.roll(seg, -1, axis=1) != seg] = -100
    return jax.device_put({"inputs": inputs, "labels": labels, "segment_ids": seg})


def peak_gib() -> float | None:
    """The device's peak memory in use so far in this process (GiB; None where not reported)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="ling-3.0-tiny")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--remat", nargs="+", default=["full", "dots"])
    ap.add_argument("--unroll-layers", action="store_true", help="TrainConfig.unroll_layers (no layer scans)")
    ap.add_argument("--logits-dtype", default="float32", help="TrainConfig.logits_dtype (the loss's logits)")
    ap.add_argument("--kda-impl", nargs="+", default=["pallas", "chunked"])
    ap.add_argument("--moe-impl", nargs="+", default=["auto"], help="the config's moe_impl (e.g. aligned, mgpu)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--profile", help="also trace two steps into this folder and record the per-kernel / "
                    "per-op-path summary (op paths need XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text)")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.layers, args.seq_len, args.batch_size, args.steps = "debug", 4, 128, 2, 2
        args.remat, args.kda_impl = ["full"], ["chunked"]
    base = LingConfig.preset(args.preset, num_hidden_layers=args.layers)
    result = {**machine(), "preset": args.preset, "layers": args.layers, "seq_len": args.seq_len,
              "batch_size": args.batch_size,
              "unroll_layers": args.unroll_layers, "logits_dtype": args.logits_dtype, "runs": []}
    peak = peak_flops_per_device()
    measured = matmul_rate(1024 if args.smoke else 8192)
    result["peak_bf16_flops_datasheet"], result["bf16_matmul_flops_measured"] = peak, measured
    print(f"bf16 matmul {measured / 1e12:.0f} TFLOP/s measured; datasheet peak "
          f"{'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}", flush=True)
    data = batch(base, args.batch_size, args.seq_len, 0)
    for impl, moe_impl, remat in itertools.product(args.kda_impl, args.moe_impl, args.remat):
        cfg = dataclasses.replace(base, kda_impl=impl, moe_impl=moe_impl)
        tcfg = TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len, remat=remat,
                           unroll_layers=args.unroll_layers, logits_dtype=args.logits_dtype, compute_dtype="bfloat16",
                           mtp_loss_weight=0.0)
        opt = make_optimizer(cfg, tcfg)
        try:
            params = random_params(cfg, jnp.float32)
            state = init_state(cfg, tcfg, opt, params)
            step = jax.jit(make_train_step(cfg, tcfg, opt), donate_argnums=0)
            t0 = time.perf_counter()
            state, m = step(state, data)
            jax.block_until_ready(m)
            compile_s = time.perf_counter() - t0
            holder = {"s": state}

            def one(holder=holder, step=step):
                holder["s"], met = step(holder["s"], data)
                return met

            dt = median_time(one, reps=args.steps, warmup=1)
            met = jax.device_get(one())
            tok_s = args.batch_size * args.seq_len / dt
            flops = train_flops_per_token(cfg, args.seq_len) * tok_s
            run = {"kda_impl": impl, "moe_impl": moe_impl, "remat": remat, "step_s": dt, "tokens_per_s": tok_s,
                   "model_tflops_per_s": flops / 1e12, "mfu_datasheet": None if peak is None else flops / peak,
                   "mfu_measured_matmul": flops / measured, "loss": float(met["loss"]),
                   "first_step_s_incl_compile": compile_s,
                   "params_B": sum(x.size for x in jax.tree.leaves(params)) / 1e9,
                   "peak_gib_so_far": peak_gib()}
            if args.profile:
                run["profile"] = device_profile(one, f"{args.profile}/{impl}_{moe_impl}_{remat}", calls=2, top=80)
                print_profile(run["profile"])
            del holder, state, params
        except Exception as e:  # record an OOM or compile failure for this variant and go on
            traceback.print_exc()
            run = {"kda_impl": impl, "moe_impl": moe_impl, "remat": remat,
                   "error": f"{type(e).__name__}: {str(e)[:500]}"}
        result["runs"].append(run)
        write_json(args.out, result)
        shown = {k: v for k, v in run.items() if k != "profile"}
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in shown.items()}, flush=True)
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()

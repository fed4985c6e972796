"""Routed-expert (MoE) benchmark on one device: grouped-matmul implementations vs a dense matmul of the same FLOPs.

    python3 bench/moe.py --out bench/results/moe_h200.json            # on the GPU
    python3 bench/moe.py --smoke --out /tmp/moe_smoke.json            # CPU, tiny shapes, a few seconds

For each model shape (one MoE layer of Ling-3.0-tiny: D 1536, I 512, E 128, k 8; of Ling-3.1-flash:
D 4096, I 1280, E 512, k 8) and each token count N (default 4k, 16k, 64k tokens per step), in bf16:

  * routing: the real router (`layers.moe.route`: sigmoid, group-limited top-k) on random
    activations and random router weights, so the per-expert loads are uneven like a real layer's;
  * per implementation (`ragged` = jax.lax.ragged_dot, `aligned` = our Mosaic-GPU grouped matmul
    over tile-aligned rows, `mgpu` = JAX's Mosaic-GPU `ragged_dot_mgpu`, `gmm` = TPU megablox; the
    ones that can run on this backend):
      - `experts`: `ops.moe.routed_experts` forward — sort by expert, gather, the three grouped
        matmuls + SwiGLU, scatter back, weighted combine;
      - `gmm_only`: just the three grouped matmuls + SwiGLU on rows already sorted (laid out as
        the implementation takes them);
      - `experts_fwd_bwd`: forward + backward of `experts` (grads of x and of the three weights);
  * `dense`: one bf16 matmul [N·k, D] x [D, 3·I] — the same FLOPs as the routed forward, measured in
    the same run (and its fwd+bwd counterpart, 3x the FLOPs).

Time = median of warmed-up calls, each ended by `block_until_ready`. FLOPs count only routed work:
2·3·N·k·D·I forward (3x that forward+backward). `ratio_to_dense` = dense time / our time at equal
FLOPs (goal: >= 0.6 at 16k tokens), the dense matmul timed before and after the implementations
and the faster time taken. The JSON (device, versions, date, command, every measurement)
goes to --out (a file, or a directory that receives moe_bench.json).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import LingConfig
from ling_jax.layers.moe import route
from ling_jax.ops import moe as moe_ops

MODELS = {"ling-3.0-tiny": "ling-3.0-tiny", "ling-3.1-flash": "ling-3.1-flash"}
SMOKE_SHAPE = dict(hidden_size=128, moe_intermediate_size=128, num_experts=16, n_group=4, topk_group=2,
                   num_experts_per_tok=4)


REPS = {"min_reps": 3, "max_reps": 20, "budget_s": 3.0}


def timeit(fn, *args) -> dict[str, float]:
    """Compile time, then the median over warmed-up calls (at least `min_reps`, until `budget_s` or `max_reps`)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(fn(*args))  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < REPS["max_reps"] and (len(times) < REPS["min_reps"]
                                             or time.perf_counter() - start < REPS["budget_s"]):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return {"median_s": statistics.median(times), "min_s": min(times), "reps": len(times), "compile_s": compile_s}


def impls_for_backend(backend: str) -> list[str]:
    if backend == "gpu":
        return ["ragged", "aligned", "mgpu"]
    if backend == "tpu":
        return ["ragged", "gmm"]
    return ["ragged", "aligned", "mgpu", "gmm"]  # CPU smoke: the kernels in interpret mode


def bench_shape(cfg: LingConfig, n: int, impls: list[str], backward: bool, dtype: Any, seed: int = 0
                ) -> dict[str, Any]:
    """All measurements for one (model shape, token count)."""
    d, i, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    keys = jax.random.split(jax.random.key(seed), 6)
    x_ND = jax.random.normal(keys[0], (n, d), dtype)
    router_DE = jax.random.normal(keys[1], (d, e), jnp.float32) * d**-0.5
    wg_EDI = (jax.random.normal(keys[2], (e, d, i), dtype) * d**-0.5).astype(dtype)
    wu_EDI = (jax.random.normal(keys[3], (e, d, i), dtype) * d**-0.5).astype(dtype)
    wd_EID = (jax.random.normal(keys[4], (e, i, d), dtype) * i**-0.5).astype(dtype)
    idx_NK, w_NK, _ = jax.jit(functools.partial(route, cfg=cfg))(x_ND, router_DE, jnp.zeros((e,), jnp.float32))
    counts = np.bincount(np.asarray(idx_NK).reshape(-1), minlength=e)
    flops_fwd = 2 * 3 * n * k * d * i
    row: dict[str, Any] = {"tokens": n, "D": d, "I": i, "E": e, "k": k, "flops_fwd": flops_fwd,
                           "load_max_over_mean": float(counts.max() / counts.mean()),
                           "empty_experts": int((counts == 0).sum())}

    # dense matmul of the same FLOPs: [N*k, D] x [D, 3I], timed before and after the implementations
    # (its rate moves between device calls); ratios use the faster of the two
    a_MD = jax.random.normal(keys[5], (n * k, d), dtype)
    b_DF = (jax.random.normal(keys[2], (d, 3 * i), dtype) * d**-0.5).astype(dtype)
    dense = jax.jit(lambda a, b: a @ b)
    dense_bwd = jax.jit(jax.grad(lambda a, b: jnp.sum((a @ b).astype(jnp.float32)), argnums=(0, 1)))

    def time_dense(when: str) -> None:
        for name, fn, f in (("dense", dense, flops_fwd), ("dense_fwd_bwd", dense_bwd, 3 * flops_fwd))[:1 + backward]:
            t = timeit(fn, a_MD, b_DF)
            row.setdefault(f"{name}_runs", {})[when] = t
            if name not in row or t["median_s"] < row[name]["median_s"]:
                row[name] = dict(t, tflops=f / t["median_s"] / 1e12)

    time_dense("before")

    for impl in impls:
        rows = moe_ops.sorted_rows(idx_NK.reshape(-1), e, n * k, aligned=impl == "aligned")
        xs_MD = moe_ops.dispatch(x_ND, rows.copy_S, rows.slot_M)
        res: dict[str, Any] = {}
        try:
            experts = jax.jit(functools.partial(moe_ops.routed_experts, impl=impl))
            res["experts"] = timeit(experts, x_ND, idx_NK, w_NK, wg_EDI, wu_EDI, wd_EID)
            interpreted = impl in ("mgpu", "aligned") and jax.default_backend() != "gpu"  # 1-10 s a call on CPU
            if not interpreted:
                gmm_only = jax.jit(functools.partial(moe_ops.expert_ffn_sorted, limit=0.0, impl=impl,
                                                     tile_group_T=rows.tile_group_T, tiles=rows.tiles))
                res["gmm_only"] = timeit(gmm_only, xs_MD, rows.group_sizes_L, wg_EDI, wu_EDI, wd_EID)
            if interpreted:
                ref = moe_ops.routed_experts(x_ND, idx_NK, w_NK, wg_EDI, wu_EDI, wd_EID, impl="ragged")
                got = experts(x_ND, idx_NK, w_NK, wg_EDI, wu_EDI, wd_EID)
                res["interpret_rel_err"] = float(jnp.linalg.norm((got - ref).astype(jnp.float32))
                                                 / jnp.linalg.norm(ref.astype(jnp.float32)))
            if backward and not interpreted:
                # (off-GPU the dW kernel wants a GPU's SM count; the tests run it with a stand-in)
                def loss(x, wg, wu, wd, impl=impl):
                    y = moe_ops.routed_experts(x, idx_NK, w_NK, wg, wu, wd, impl=impl)
                    return jnp.sum(y.astype(jnp.float32))

                fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
                res["experts_fwd_bwd"] = timeit(fb, x_ND, wg_EDI, wu_EDI, wd_EID)
        except Exception as err:  # one failing implementation must not lose the others' numbers
            res["error"] = f"{type(err).__name__}: {err}"[:2000]
            traceback.print_exc()
        row[impl] = res
    time_dense("after")
    for impl in impls:
        for name, r in row[impl].items():
            if isinstance(r, dict):
                f = flops_fwd * (3 if name.endswith("fwd_bwd") else 1)
                dense_t = row["dense_fwd_bwd" if name.endswith("fwd_bwd") else "dense"]["median_s"] \
                    if (not name.endswith("fwd_bwd") or backward) else None
                r["tflops"] = f / r["median_s"] / 1e12
                if dense_t is not None:
                    r["ratio_to_dense"] = dense_t / r["median_s"]
    return row


def device_info() -> dict[str, Any]:
    import flax
    import jaxlib

    dev = jax.devices()[0]
    return {"platform": dev.platform, "device_kind": dev.device_kind, "num_devices": jax.device_count(),
            "compute_capability": str(getattr(dev, "compute_capability", "")),
            "versions": {"python": platform.python_version(), "jax": jax.__version__,
                         "jaxlib": jaxlib.__version__,
                         "flax": flax.__version__, "numpy": np.__version__}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file (or directory: writes moe_bench.json there)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384, 65536])
    ap.add_argument("--impls", nargs="+", default=None, help="default: what this backend runs")
    ap.add_argument("--no-backward", action="store_true", help="skip the forward+backward timings")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes (D 128, I 128, E 16, k 4; 64 tokens) to check the script on CPU")
    args = ap.parse_args(argv)
    backend = jax.default_backend()
    impls = args.impls or impls_for_backend(backend)
    bad = [i for i in impls if i not in moe_ops.IMPLS or i in ("auto", "dense")]
    if bad:
        ap.error(f"--impls {bad}: choose from ragged, aligned, mgpu, gmm")
    tokens = [64] if args.smoke else args.tokens
    if args.smoke:
        REPS.update(min_reps=1, max_reps=2, budget_s=0.0)
    out = Path(args.out)
    if out.is_dir() or args.out.endswith("/"):
        out = out / "moe_bench.json"
    result: dict[str, Any] = {
        "what": "one MoE layer's routed experts, bf16, single device; TFLOP/s count routed work 2*3*N*k*D*I fwd",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_info(), "smoke": args.smoke, "impls": impls, "rows": [],
    }
    for m, model in enumerate(args.models):
        cfg = LingConfig.preset(MODELS[model], **(SMOKE_SHAPE if args.smoke else {}))
        # smoke: the Mosaic-GPU interpreter takes ~10 s a call on CPU, and every smoke shape is the same
        run = [i for i in impls if not (args.smoke and m > 0 and i in ("mgpu", "aligned") and backend != "gpu")]
        for n in tokens:
            print(f"== {model} N={n}", flush=True)
            row = bench_shape(cfg, n, run, backward=not args.no_backward, dtype=jnp.bfloat16)
            row["model"] = model
            result["rows"].append(row)
            for impl in run:
                for name in ("experts", "gmm_only", "experts_fwd_bwd"):
                    r = row[impl].get(name)
                    if r:
                        print(f"  {impl:7s} {name:16s} {r['median_s'] * 1e3:9.3f} ms {r['tflops']:8.2f} TFLOP/s "
                              f"x{r.get('ratio_to_dense', float('nan')):.3f} of dense", flush=True)
                if "interpret_rel_err" in row[impl]:
                    print(f"  {impl:7s} interpret-mode output vs ragged: rel. L2 {row[impl]['interpret_rel_err']:.2e}")
                if "error" in row[impl]:
                    print(f"  {impl:7s} ERROR {row[impl]['error'][:200]}", flush=True)
            print(f"  dense   matmul           {row['dense']['median_s'] * 1e3:9.3f} ms "
                  f"{row['dense']['tflops']:8.2f} TFLOP/s", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")  # after every row: a timeout keeps what was done
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

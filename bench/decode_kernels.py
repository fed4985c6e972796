"""Decode-step kernels alone: each Pallas kernel against the XLA form it replaces, same run, same inputs.

    python3 bench/decode_kernels.py --out /tmp/decode_kernels.json   # the GPU run
    python3 bench/decode_kernels.py --smoke --out /tmp/dk.json                      # CPU (interpret), seconds

At the preset's widths (default Ling-3.0-tiny) and each batch size, one jitted call runs `--calls`
independent instances of the op (distinct random inputs, so XLA can neither merge nor hoist
them; the KDA step threads its state through them, as the decode loop does): the time per
instance is the call's median / `--calls`, so launch overhead is amortised and every small XLA
kernel around the op (split merges, partial sums) is counted. Ops:

  moe      `ops.moe.routed_experts` at batch x top-k token copies, impl gather vs gemv (only up to
           GATHER_MAX_COPIES copies: gemv's range)
  latent   the absorbed-MLA decode attention over a latent cache filled to each context,
           `mla_decode.latent_attention` vs `latent_attention_pallas`
  kda      one KDA token step on the fp32 state, `kda_decode_step` vs `kda_decode_step_pallas`
  proj     batch 1 only: a KDA layer's two dense projections read from their layer stack (the fused
           input projection, hidden -> 5 x H x K + H padded to the kernel's tile, and o_proj),
           `layer_gemv.linear` on a `WeightStack` (the gemv kernel) vs XLA's product of the slice

Reported: us per instance, GB/s of the bytes the op must read (and write, for the state),
and the relative L2 difference of the two implementations' outputs on the device.

`--sweep` times the Pallas kernels alone over their tuned launch constants (`SWEEPS`: fields of
`ops.pallas_gpu.Launch`, the values `ling_jax.kernels.TUNED` holds; the first variant of each is
the table's default).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, median_time, rel_l2, write_json
from ling_jax.cache import LATENT_BLOCK
from ling_jax.config import LingConfig
from ling_jax.kernels import DEFAULT_TUNING
from ling_jax.ops import expert_gemv
from ling_jax.ops.kda.decode import kda_decode_step, kda_decode_step_pallas
from ling_jax.ops.latent_attention_pallas import latent_attention_pallas
from ling_jax.ops.layer_gemv import WeightStack, linear
from ling_jax.ops.mla_decode import latent_attention
from ling_jax.ops.moe import routed_experts
from ling_jax.ops.pallas_gpu import DEFAULT_LAUNCH, Launch

GATHER_MAX_COPIES = DEFAULT_TUNING.gather_max_copies
GEMV_SWEEP = [dict(gemv_programs=p, gemv_eviction=e) for p, e in itertools.product(
    (DEFAULT_LAUNCH.gemv_programs, 132, 528), (DEFAULT_LAUNCH.gemv_eviction, None))]
SWEEPS: dict[str, list[dict[str, Any]]] = {
    "moe": GEMV_SWEEP,
    "proj_in": GEMV_SWEEP,
    "proj_out": GEMV_SWEEP,
    "latent": [dict(latent_programs=p) for p in (DEFAULT_LAUNCH.latent_programs, 132, 528, 1056)],
    "kda": [dict(kda_programs=p) for p in (DEFAULT_LAUNCH.kda_programs, 0, 264)],
}
# the kernel's name in each bench's timings
PALLAS = {"moe": "gemv", "proj_in": "gemv", "proj_out": "gemv", "latent": "pallas", "kda": "pallas"}


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any, std: float = 1.0) -> jax.Array:
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _gbps(nbytes: float, us: dict[str, float]) -> dict[str, float]:
    return {name: nbytes / t / 1e3 for name, t in us.items()}


def _time(fns: dict[str, Callable[[], Any]], calls: int, reps: int,
          only: str | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """us per instance of each implementation (or of `only`), and each one's outputs."""
    fns = {only: fns[only]} if only else fns
    outs = {name: jax.block_until_ready(f()) for name, f in fns.items()}  # compiles
    us = {name: 1e6 * median_time(f, reps=reps, warmup=1) / calls for name, f in fns.items()}
    return us, outs


def bench_moe(cfg: LingConfig, batch: int, calls: int, reps: int, key: jax.Array,
              only: str | None = None, launch: Launch = DEFAULT_LAUNCH) -> dict[str, Any]:
    e, d, i, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    kw, kx, ki = jax.random.split(key, 3)
    w_gate, w_up = (_normal(kk, (e, d, i), jnp.bfloat16, 0.02) for kk in jax.random.split(kw, 2))
    w_down = _normal(jax.random.fold_in(kw, 2), (e, i, d), jnp.bfloat16, 0.02)
    x = _normal(kx, (calls, batch, d), jnp.bfloat16)
    idx = jnp.argsort(jax.random.uniform(ki, (calls, batch, e)), axis=-1)[..., :k].astype(jnp.int32)
    w = jnp.full((calls, batch, k), 1.0 / k, jnp.float32)

    def run(impl: str) -> Callable[[], Any]:
        f = jax.jit(lambda x, idx, w: jnp.stack([routed_experts(x[c], idx[c], w[c], w_gate, w_up, w_down, impl=impl,
                                                                launch=launch) for c in range(calls)]))
        return lambda: f(x, idx, w)

    us, outs = _time({"gather": run("gather"), "gemv": run("gemv")}, calls, reps, only)
    touched = float(np.mean([len(np.unique(np.asarray(idx[c]))) for c in range(calls)]))
    nbytes = touched * 3 * d * i * 2
    return {"op": "moe", "batch": batch, "copies": batch * k, "us": us, "bytes": nbytes,
            "GBps": _gbps(nbytes, us),
            "rel_l2_gemv_vs_gather": None if only else rel_l2(outs["gemv"], outs["gather"])}


def bench_proj(cfg: LingConfig, which: str, calls: int, reps: int, key: jax.Array,
               only: str | None = None, launch: Launch = DEFAULT_LAUNCH) -> dict[str, Any]:
    """One row through one of `calls` layers' weights of a [calls, C, O] stack per instance."""
    h, dk, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    c, o = (d, -(-(5 * h * dk + h) // expert_gemv.MAX_BO) * expert_gemv.MAX_BO) if which == "in" else (h * dk, d)
    kw, kx = jax.random.split(key)
    stack = _normal(kw, (calls, c, o), jnp.bfloat16, 0.02)
    x = _normal(kx, (calls, 1, c), jnp.bfloat16)
    products = {"gemv": lambda x, i: linear(x, WeightStack(stack, np.int32(i)), launch),
                "xla": lambda x, i: x @ stack[i]}

    def run(impl: str) -> Callable[[], Any]:
        f = jax.jit(lambda x: jnp.stack([products[impl](x[i], i) for i in range(calls)]))
        return lambda: f(x)

    us, outs = _time({"xla": run("xla"), "gemv": run("gemv")}, calls, reps, only)
    nbytes = float(c * o * 2)
    return {"op": f"proj_{which}", "batch": 1, "shape": [c, o], "us": us, "bytes": nbytes, "GBps": _gbps(nbytes, us),
            "rel_l2_gemv_vs_xla": None if only else rel_l2(outs["gemv"], outs["xla"])}


def bench_latent(cfg: LingConfig, batch: int, ctx: int, slots: int, calls: int, reps: int,
                 key: jax.Array, only: str | None = None, launch: Launch = DEFAULT_LAUNCH) -> dict[str, Any]:
    h, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    kq, kc, kn = jax.random.split(key, 3)
    cache = _normal(kc, (batch, slots, r + dr), jnp.bfloat16)
    q = _normal(kq, (calls, batch, h, r + dr), jnp.bfloat16, 0.05)
    new = _normal(kn, (calls, batch, r + dr), jnp.bfloat16)
    lengths = jnp.full((batch,), ctx, jnp.int32) - jnp.arange(batch, dtype=jnp.int32) % 7  # ragged rows
    scale = cfg.qk_head_dim**-0.5

    def run(attend: Callable[..., jax.Array]) -> Callable[[], Any]:
        f = jax.jit(lambda q, cache, lengths, new: jnp.stack(
            [attend(q[c], cache, lengths, new[c], rank=r, scale=scale) for c in range(calls)]))
        return lambda: f(q, cache, lengths, new)

    us, outs = _time({"xla": run(functools.partial(latent_attention, block=LATENT_BLOCK)),
                      "pallas": run(functools.partial(latent_attention_pallas, launch=launch))}, calls, reps, only)
    nbytes = float(batch * ctx * (r + dr) * 2)
    return {"op": "latent", "batch": batch, "context": ctx, "slots": slots, "us": us, "bytes": nbytes,
            "GBps": _gbps(nbytes, us),
            "rel_l2_pallas_vs_xla": None if only else rel_l2(outs["pallas"], outs["xla"])}


def bench_kda(cfg: LingConfig, batch: int, calls: int, reps: int, key: jax.Array,
              only: str | None = None, launch: Launch = DEFAULT_LAUNCH) -> dict[str, Any]:
    h, dk = cfg.num_attention_heads, cfg.head_dim
    ks = jax.random.split(key, 6)
    q, k = (_normal(kk, (calls, batch, h, dk), jnp.bfloat16) for kk in ks[:2])
    q, k = (a / jnp.linalg.norm(a.astype(jnp.float32), axis=-1, keepdims=True).astype(a.dtype) for a in (q, k))
    v = _normal(ks[2], (calls, batch, h, dk), jnp.bfloat16)
    g = -jax.random.uniform(ks[3], (calls, batch, h, dk), jnp.float32, 0.01, 0.5)
    beta = jax.random.uniform(ks[4], (calls, batch, h), jnp.float32)
    state = _normal(ks[5], (batch, h, dk, dk), jnp.float32, 0.1)

    def run(step: Callable[..., tuple[jax.Array, jax.Array]]) -> Callable[[], Any]:
        def chain(q, k, v, g, beta, s):
            outs = []
            for c in range(calls):
                o, s = step(q[c], k[c], v[c], g[c], beta[c], s, scale=dk**-0.5)
                outs.append(o)
            return jnp.stack(outs), s

        f = jax.jit(chain)
        return lambda: f(q, k, v, g, beta, state)

    us, outs = _time({"xla": run(kda_decode_step),
                      "pallas": run(functools.partial(kda_decode_step_pallas, launch=launch))}, calls, reps, only)
    nbytes = float(batch * h * dk * dk * 4 * 2)
    return {"op": "kda", "batch": batch, "us": us, "bytes": nbytes, "GBps": _gbps(nbytes, us),
            "rel_l2_pallas_vs_xla": None if only else {"o": rel_l2(outs["pallas"][0], outs["xla"][0]),
                                                       "state": rel_l2(outs["pallas"][1], outs["xla"][1])}}


def swept(op: str, bench: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`bench(*args)` of the Pallas kernel alone under each of the op's `SWEEPS` launch variants."""
    name = PALLAS[op]
    rows = []
    for v in SWEEPS[op]:
        try:
            r = bench(*args, only=name, launch=dataclasses.replace(DEFAULT_LAUNCH, **v))
        except Exception as e:  # e.g. a tile that needs more shared memory than the GPU has
            rows.append({**v, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"  {op} {v}: {rows[-1]['error']}", flush=True)
            continue
        rows.append({**v, "us": r["us"][name], "GBps": r["GBps"][name]})
        print(f"  {op} B={r['batch']} {r.get('context', '')} {v}: {r['us'][name]:.1f} us", flush=True)
    return {"op": op, "args": [a for a in args if isinstance(a, int)], "sweep": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="ling-3.0-tiny")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ops", nargs="+", default=["moe", "latent", "kda", "proj"],
                    choices=["moe", "latent", "kda", "proj"])
    ap.add_argument("--sweep", action="store_true", help="the Pallas kernels alone over their SWEEPS variants")
    ap.add_argument("--smoke", action="store_true", help="debug preset, tiny sizes (CPU interpret-mode check)")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.batches, args.contexts, args.calls, args.reps = "debug", [1, 3], [64, 100], 2, 1
    cfg = LingConfig.preset(args.preset)
    slots = -(-(max(args.contexts) + 1) // LATENT_BLOCK) * LATENT_BLOCK  # the cache's allocation rule
    result = {**machine(), "preset": args.preset, "calls_per_jit": args.calls, "sweep": args.sweep, "runs": []}
    key = jax.random.key(0)
    for b in args.batches:
        runs = []
        one = swept if args.sweep else (lambda op, bench, *a: bench(*a))
        if "moe" in args.ops and b * cfg.num_experts_per_tok <= GATHER_MAX_COPIES:  # beyond: gemv is not used
            runs.append(one("moe", bench_moe, cfg, b, args.calls, args.reps, jax.random.fold_in(key, b)))
        if "proj" in args.ops and b == 1:  # only batch 1 reads layer projections through the kernel
            runs += [one(f"proj_{w}", bench_proj, cfg, w, args.calls, args.reps, jax.random.fold_in(key, b + 2))
                     for w in ("in", "out")]
        if "kda" in args.ops:
            runs.append(one("kda", bench_kda, cfg, b, args.calls, args.reps, jax.random.fold_in(key, b + 1)))
        if "latent" in args.ops:
            runs += [one("latent", bench_latent, cfg, b, ctx, slots, args.calls, args.reps,
                         jax.random.fold_in(key, b + ctx)) for ctx in args.contexts]
        for r in runs if not args.sweep else []:
            where = f"B={r['batch']:3d}" + (f" ctx={r['context']:6d}" if "context" in r else " " * 11)
            times = "  ".join(f"{n} {t:8.1f} us ({r['GBps'][n]:6.0f} GB/s)" for n, t in r["us"].items())
            diff = {k: v for k, v in r.items() if k.startswith("rel_l2")}
            print(f"{r['op']:6s} {where}  {times}  {diff}", flush=True)
        result["runs"] += runs
        write_json(args.out, result)
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()

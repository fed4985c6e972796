"""One-row projections by weight layout: how fast can a batch-1 decode projection read its weight?

    python3 bench/gemv_layout.py --out bench/results/gemv_layout_h200.json   # the GPU run
    python3 bench/gemv_layout.py --smoke --out /tmp/gl.json                  # CPU (interpret), seconds

The decode step's projections (x [1, C] @ w [C, O]) cost only the weight's read, yet in the batch-1
profiles the gemv kernel reads at 2.2-2.6 TB/s where XLA's lm_head product reads 483 MB at 4.4
TB/s (BENCHMARKS.md, "Decode"). This times, per projection shape, one jitted call of `--calls`
independent instances (distinct weights, more bytes in all than L2 holds; us per instance = the
call's median / calls):

  cols      the committed kernel (`expert_gemv.gathered_products`) on w [C, O]: one [BC, BO] tile
            per program, XLA's sum of the [C / BC, O] partial sums
  rows/...  w stored transposed, [O, C] (the checkpoint's own layout): every program reads BO whole
            rows of C (contiguous) in BCH-wide steps of a pipelined loop, sums them itself and
            writes its BO outputs (no partial sums); the name gives BO, BCH, warps, stages
  xla       XLA's x @ w, and x @ w_t.T on the transposed weight
  read      XLA's float32 sum of w: a read-only stream of the same bytes, the ceiling

and the copy bandwidth the decode benchmark's floor uses (`bench.common.copy_bandwidth`, a 2 GiB
bf16 `a * 2`) against the same pass with the input donated and a 2 GiB read-only sum.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import copy_bandwidth, machine, median_time, write_json
from ling_jax.ops import expert_gemv
from ling_jax.ops.pallas_gpu import call_options, whole

# (BO rows per program, BCH columns per loop step, warps, pipeline stages)
ROW_TILES = [(8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3), (16, 512, 8, 3), (32, 256, 4, 3),
             (32, 256, 8, 4), (64, 128, 4, 4), (4, 512, 4, 4)]
SHAPES = {"kda_in_proj": (1536, 10240), "kda_o_proj": (2048, 1536), "dense_gate_up": (1536, 9216)}


def rows_gemv(x_C: jax.Array, w_OC: jax.Array, *, bo: int, bch: int, warps: int, stages: int,
              interpret: bool | None = None) -> jax.Array:
    """x [C] @ w_t [O, C].T -> [O] float32, every program summing BO whole rows of w_t."""
    o, c = w_OC.shape
    n_ch = c // bch

    def kernel(x_ref, w_ref, out_ref):
        i = pl.program_id(0)

        def step(j: jax.Array, acc_O: jax.Array) -> jax.Array:
            w_OK = pltriton.load(w_ref.at[pl.ds(i * bo, bo), pl.ds(j * bch, bch)], eviction_policy="evict_first")
            x_K = x_ref[pl.ds(j * bch, bch)].astype(jnp.float32)
            return acc_O + jnp.sum(w_OK.astype(jnp.float32) * x_K[None, :], axis=1)

        out_ref[pl.ds(i * bo, bo)] = jax.lax.fori_loop(0, n_ch, step, jnp.zeros((bo,), jnp.float32))

    return pl.pallas_call(
        kernel, grid=(o // bo,), in_specs=[whole(x_C), whole(w_OC)],
        out_specs=pl.BlockSpec((o,), lambda i: (0,)),
        out_shape=jax.ShapeDtypeStruct((o,), jnp.float32),
        **call_options(interpret, num_warps=warps, num_stages=stages))(x_C, w_OC)


def _time(fn: Callable[..., Any], args: tuple, calls: int, reps: int) -> float:
    f = jax.jit(lambda *a: [fn(*xs) for xs in zip(*a, strict=True)])
    return median_time(lambda: f(*args), reps=reps, warmup=2) / calls * 1e6


def bench_shape(name: str, c: int, o: int, calls: int, reps: int, interpret: bool) -> dict[str, Any]:
    key = jax.random.key(hash(name) % 2**31)
    kx, kw = jax.random.split(key)
    xs = [jax.random.normal(k, (c,), jnp.bfloat16) for k in jax.random.split(kx, calls)]
    ws = [jax.random.normal(k, (c, o), jnp.bfloat16) * 0.02 for k in jax.random.split(kw, calls)]
    wts = [w.T.copy() for w in ws]
    idx = jnp.zeros((1,), jnp.int32)
    ref = xs[0].astype(jnp.float32) @ ws[0].astype(jnp.float32)
    def cols(x: jax.Array, w: jax.Array) -> jax.Array:
        return expert_gemv.gathered_products(x[None], idx, (w[None],), interpret=interpret)[0][0]

    fns: dict[str, tuple[Callable[..., Any], list]] = {
        "cols": (cols, ws),
        "cols_l2": (cols, [ws[0]] * calls),
        "xla": (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), ws),
        "xla_t": (lambda x, w: jnp.dot(w, x, preferred_element_type=jnp.float32), wts),
        "read": (lambda x, w: jnp.sum(w.astype(jnp.float32)), ws),
    }
    for bo, bch, warps, stages in ROW_TILES:
        if o % bo == 0 and c % bch == 0:
            fns[f"rows/{bo}x{bch}/w{warps}/s{stages}"] = (
                functools.partial(rows_gemv, bo=bo, bch=bch, warps=warps, stages=stages, interpret=interpret), wts)
    nbytes = c * o * 2
    rows = []
    for label, (fn, weights) in fns.items():
        out = jax.jit(fn)(xs[0], weights[0])
        err = None if label == "read" else float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        us = _time(fn, (xs, weights), calls, reps)
        rows.append({"impl": label, "us": us, "GBps": nbytes / us / 1e3, "rel_l2_vs_f32": err})
        print(f"{name:14s} [{c}, {o}] {label:22s} {us:8.2f} us  {nbytes / us / 1e3:7.0f} GB/s  err {err}", flush=True)
    return {"shape": name, "C": c, "O": o, "bytes": nbytes, "rows": rows}


def copy_rates(gib: float) -> dict[str, float]:
    """The decode floor's copy bandwidth, the same pass donated, and a read-only sum (bytes/s)."""
    n = int(gib * (1 << 30)) // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    state = {"x": x * 1}
    donated = jax.jit(lambda a: a * 2, donate_argnums=0)

    def run_donated() -> jax.Array:
        state["x"] = donated(state["x"])
        return state["x"]

    read = jax.jit(lambda a: jnp.sum(a.astype(jnp.float32)))
    return {"copy_bandwidth_GBps (bench.common)": copy_bandwidth(gib) / 1e9,
            "donated_a_times_2_GBps": 2 * x.nbytes / median_time(run_donated, reps=10, warmup=3) / 1e9,
            "read_only_sum_GBps": x.nbytes / median_time(lambda: read(x), reps=10, warmup=3) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="small shapes, interpret mode (CPU check of the script)")
    args = ap.parse_args()
    interpret = args.smoke or jax.default_backend() != "gpu"
    shapes = {"small": (256, 512)} if args.smoke else SHAPES
    calls, reps = (2, 2) if args.smoke else (args.calls, args.reps)
    result: dict[str, Any] = {**machine(), "calls_per_jit": calls, "reps": reps,
                              "copy": copy_rates(0.01 if args.smoke else 2.0), "runs": []}
    print(result["copy"], flush=True)
    for name, (c, o) in shapes.items():
        result["runs"].append(bench_shape(name, c, o, calls, reps, interpret))
    write_json(args.out, result)


if __name__ == "__main__":
    main()

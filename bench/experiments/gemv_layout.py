"""One-row projections by weight layout: how fast can a batch-1 decode projection read its weight?

    python3 bench/experiments/gemv_layout.py --out $OUT/gemv_layout_h200.json   # the GPU run
    python3 bench/experiments/gemv_layout.py --smoke --out /tmp/gl.json      # CPU (interpret), seconds

The decode step's projections (x [1, C] @ w [C, O]) cost only the weight's read, yet in the batch-1
profiles the gemv kernel reads well below the rate of XLA's lm_head product (docs/decode-performance.md).
This times, per projection shape, one jitted call of `--calls`
independent instances (distinct weights, more bytes in all than L2 holds; us per instance = the
call's median / calls; with `--trace DIR` also the kernels' device time per instance, from a
`jax.profiler` trace: wall clock on calls this short counts dispatch and clock ramp-up too):

  cols      the committed kernel (`expert_gemv.gathered_products`) on w [C, O]: one [BC, BO] tile
            per program, XLA's sum of the [C / BC, O] partial sums
  rows/...  w stored transposed, [O, C] (the checkpoint's own layout): every program reads BO whole
            rows of C (contiguous) in BCH-wide steps of a pipelined loop, sums them itself and
            writes its BO outputs (no partial sums); the name gives BO, BCH, warps, stages
  xla       XLA's x @ w, and x @ w_t.T on the transposed weight
  read      XLA's float32 sum of w: a read-only stream of the same bytes, the ceiling
  mgpu/...  JAX's Hopper matmul (Mosaic GPU; `mgpu_gemv`) on x padded to 64 rows: a persistent
            program per SM streaming the weight by TMA through a ring of shared-memory buffers
            (what a persistent decode kernel's weight stream would be); name: tile_n, tile_k, ring
  mgpu_rows/...  `bench.experiments.pdl_chain.rows_gemv` on w [O, C]: 64 rows and a split of C per program, its
            [64, tk] tiles by TMA through a ring, x as the 8-column operand of wgmma; name: tk,
            ring depth, split (its partial sums and x's padding are XLA's, inside the timed call)

and the copy bandwidth the decode benchmark's floor uses (`bench.common.copy_bandwidth`, XLA's copy
of 2 GiB timed on the device) against a bf16 `a * 2` pass timed by the wall clock (which undercounts the bandwidth),
the same pass donated, the copy and a read-only sum, each by wall clock and device time.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import copy_bandwidth, machine, median_time, write_json
from bench.device_profile import kernel_profile
from bench.experiments import pdl_chain
from ling_jax.ops import expert_gemv
from ling_jax.ops.pallas_gpu import triton_call, whole

# (BO rows per program, BCH columns per loop step, warps, pipeline stages)
ROW_TILES = [(8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3), (16, 512, 8, 3), (32, 256, 4, 3),
             (32, 256, 8, 4), (64, 128, 4, 4), (4, 512, 4, 4)]
SHAPES = {"kda_in_proj": (1536, 10240), "kda_o_proj": (2048, 1536), "dense_gate_up": (1536, 9216),
          "dense_down": (4608, 1536)}
# (tile_n, tile_k, pipeline steps in flight) of JAX's Hopper matmul (Mosaic GPU) with the row padded to 64
# (each ring fits the 227 KB of shared memory: steps x (64 x tile_k + tile_k x 2 tile_n) x 2 bytes)
MGPU_TILES = [(64, 64, 4), (64, 64, 8), (64, 128, 4), (32, 128, 6), (128, 64, 4), (32, 64, 8), (64, 32, 8)]
# (tk, ring depth, split of C) of `pdl_chain.rows_gemv` (Mosaic GPU: w [O, C] by TMA, x as wgmma's N = 8)
MGPU_ROW_TILES = [(128, 4, 1), (128, 4, 2), (256, 4, 2), (128, 4, 4), (256, 3, 1), (128, 6, 2)]


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

    return triton_call(
        kernel, grid=(o // bo,), in_specs=[whole(x_C), whole(w_OC)],
        out_specs=pl.BlockSpec((o,), lambda i: (0,)),
        out_shape=jax.ShapeDtypeStruct((o,), jnp.float32),
        interpret=interpret, num_warps=warps, num_stages=stages)(x_C, w_OC)


def mgpu_gemv(x_C: jax.Array, w_CO: jax.Array, *, tile_n: int, tile_k: int, steps: int,
              interpret: bool = False) -> jax.Array:
    """x [C] @ w [C, O] -> [O] float32 by JAX's Hopper matmul (`hopper_matmul_mgpu`: one persistent
    program per SM, TMA copies of the weight tiles into a ring of `steps` shared-memory buffers, a
    producer warpgroup and two consumer warpgroups; wgmma on x padded to the 64 rows it needs)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    a = jnp.zeros((64, x_C.shape[0]), w_CO.dtype).at[0].set(x_C.astype(w_CO.dtype))
    config = hm.TuningConfig(tile_m=64, tile_n=tile_n, tile_k=tile_k, max_concurrent_steps=steps,
                             epi_tile_n=min(64, tile_n), epi_tile_m=64)
    if not interpret:
        return hm.matmul(a, w_CO, None, config)[0].astype(jnp.float32)
    # the interpreter, on 4 simulated SMs (`get_num_sms` asks the device, which a CPU cannot answer)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()), \
            mock.patch.object(hm, "get_num_sms", return_value=4):
        return hm.matmul(a, w_CO, None, config)[0].astype(jnp.float32)


def mgpu_rows(x_C: jax.Array, w_OC: jax.Array, **kw: Any) -> jax.Array:
    """x [C] @ w_t [O, C].T -> [O] float32 by `bench.experiments.pdl_chain.rows_gemv` (x placed as row 0 of 8)."""
    x_8C = jnp.zeros((pdl_chain.X_COLS, x_C.shape[0]), w_OC.dtype).at[0].set(x_C.astype(w_OC.dtype))
    return pdl_chain.rows_gemv(x_8C, w_OC, pdl="off", **kw)[:, :, 0].sum(0)


def _time(fn: Callable[..., Any], args: tuple, calls: int, reps: int, logdir: str | None) -> dict[str, float]:
    """us per instance: wall (median of reps) and, with a trace dir, device kernel time (3 traced calls)."""
    f = jax.jit(lambda *a: [fn(*xs) for xs in zip(*a, strict=True)])
    out = {"wall_us": median_time(lambda: f(*args), reps=reps, warmup=3) / calls * 1e6}
    prof = kernel_profile(lambda: f(*args), logdir) if logdir else None
    if prof:
        out["device_us"] = prof["kernel_time_s_per_call"] / calls * 1e6
        out["kernels_per_instance"] = prof["kernels_per_call"] / calls
    return out


def bench_shape(name: str, c: int, o: int, calls: int, reps: int, interpret: bool,
                logdir: str | None, only: str | None = None) -> dict[str, Any]:
    kx, kw = jax.random.split(jax.random.key(c * o))
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
    for tn, tk, steps in MGPU_TILES:
        if o % (2 * tn) == 0 and c % tk == 0:
            fns[f"mgpu/{tn}x{tk}/s{steps}"] = (
                functools.partial(mgpu_gemv, tile_n=tn, tile_k=tk, steps=steps, interpret=interpret), ws)
    for tk, depth, split in MGPU_ROW_TILES:
        if o % pdl_chain.ROWS == 0 and c % (tk * split) == 0:
            fns[f"mgpu_rows/{tk}/d{depth}/s{split}"] = (functools.partial(
                mgpu_rows, tk=tk, depth=depth, split=split, interpret=interpret), wts)
    nbytes = c * o * 2
    rows = []
    for label, (fn, weights) in fns.items():
        if only and not re.search(only, label):
            continue
        try:
            out = jax.jit(fn)(xs[0], weights[0])
            err = None if label == "read" else float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            t = _time(fn, (xs, weights), calls, reps, logdir and f"{logdir}/{name}_{label.replace('/', '_')}")
        except Exception as e:  # a tiling this GPU cannot run is a result, not the end of the run
            rows.append({"impl": label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"{name:14s} [{c}, {o}] {label:22s} failed: {rows[-1]['error'][:160]}", flush=True)
            continue
        us = t.get("device_us", t["wall_us"])
        rows.append({"impl": label, **t, "GBps": nbytes / us / 1e3, "rel_l2_vs_f32": err})
        dev = t.get("device_us", float("nan"))
        print(f"{name:14s} [{c}, {o}] {label:22s} wall {t['wall_us']:8.2f} us  device {dev:8.2f} us "
              f"{nbytes / us / 1e3:7.0f} GB/s  err {err}", flush=True)
    return {"shape": name, "C": c, "O": o, "bytes": nbytes, "rows": rows}


def copy_rates(gib: float, logdir: str | None) -> dict[str, float]:
    """GB/s of: the decode floor's copy bandwidth (`bench.common.copy_bandwidth`), then by wall clock
    and (with a trace dir) device time, a bf16 `a * 2` pass, the same with the input
    donated, XLA's copy of the array (read + write) and a float32 sum of it (read only)."""
    n = int(gib * (1 << 30)) // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    state = {"x": x * 1}
    donated = jax.jit(lambda a: a * 2, donate_argnums=0)

    def run_donated() -> jax.Array:
        state["x"] = donated(state["x"])
        return state["x"]

    passes = {"a_times_2": (jax.jit(lambda a: a * 2), 2), "donated_a_times_2": (run_donated, 2),
              "copy": (jax.jit(jnp.copy), 2), "read_only_sum": (jax.jit(lambda a: jnp.sum(a.astype(jnp.float32))), 1)}
    out = {"bench.common.copy_bandwidth": copy_bandwidth(gib) / 1e9}
    for name, (fn, touches) in passes.items():
        call = fn if name.startswith("donated") else functools.partial(fn, x)
        out[f"{name}_wall"] = touches * x.nbytes / median_time(call, reps=10, warmup=3) / 1e9
        prof = kernel_profile(call, f"{logdir}/copy_{name}") if logdir else None
        if prof:
            out[f"{name}_device"] = touches * x.nbytes / prof["kernel_time_s_per_call"] / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--trace", metavar="DIR", help="also time every kernel on the device (jax.profiler traces here)")
    ap.add_argument("--smoke", action="store_true", help="small shapes, interpret mode (CPU check of the script)")
    ap.add_argument("--only", metavar="REGEX", help="only the implementations whose label matches")
    ap.add_argument("--no-copy", action="store_true", help="skip the copy-bandwidth passes")
    args = ap.parse_args()
    interpret = args.smoke or jax.default_backend() != "gpu"
    shapes = {"small": (256, 512)} if args.smoke else SHAPES
    calls, reps = (2, 2) if args.smoke else (args.calls, args.reps)
    result: dict[str, Any] = {**machine(), "calls_per_jit": calls, "reps": reps, "runs": []}
    if not args.no_copy:
        result["copy"] = copy_rates(0.01 if args.smoke else 2.0, args.trace)
        print(result["copy"], flush=True)
    for name, (c, o) in shapes.items():
        result["runs"].append(bench_shape(name, c, o, calls, reps, interpret, args.trace, args.only))
        write_json(args.out, result)  # after every shape: a run cut short keeps what it measured


if __name__ == "__main__":
    main()

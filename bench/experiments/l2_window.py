"""Can a decode weight be read into L2 while the step's HBM is idle, so that its product is faster?

    python3 bench/experiments/l2_window.py --out $OUT/l2_window_h200.json     # the GPU run
    XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT python3 bench/experiments/l2_window.py --out ...
    python3 bench/experiments/l2_window.py --forms serial inkernel --window-iters 250 --fractions 0.25 0.5 1 \
        --between-mb 0 42 --out $OUT/l2_window_inkernel_h200.json
    python3 bench/experiments/l2_window.py --smoke --out /tmp/l2w.json                 # CPU (interpreter)

Why: a batch-1 decode step spends a large share of its device time in kernels that move few bytes
(the KDA recurrence, the router's selection, norms, partial sums; BENCHMARKS.md, "Where a batch-1
step goes"), while its weight products stream below the HBM rate. If the next product's weight could be read into
the L2 cache during those kernels, the product would read it from L2 and the step would approach
the byte floor. Nothing inside one XLA stream overlaps two kernels, so the read must be a kernel of
its own that the command buffer may run beside them: XLA schedules a CUDA graph's independent
kernels concurrently under `--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`.

The chain, `--layers` times, as in the decode step:

    v = window(x[:128])                    (one Pallas program, `--window-iters` dependent FMAs:
                                            a stand-in for the step's latency-bound kernels)
    x = W_l [C, O] @ tile(v)               (the decode step's gemv: `expert_gemv.gathered_products`,
                                            the layer's weight read from its [L, C, O] stack in place)

Forms: `serial` (as above); `prefetch` (plus an XLA reduce of W_l that depends only on the layer's
input, and that the product waits for: in a concurrent graph it may run beside the window);
`inkernel` (the window kernel itself reads the first `--fractions` of W_l's rows into L2: one program
runs the window, the others each load one [64, 128] tile with Triton's `evict_last` policy and
keep its maximum, as a decode step's latency-bound kernels could with the SMs they leave idle);
`window` and `gemv` (each alone, the layers' other half left out). Each layer's weight is its own
array slice and the stack (`--layers` x C x O x 2 bytes) is larger than the L2, so no product finds
its weight in L2 from the call before. `--between-mb` puts a second product between the window and
W_l's, over that many MB of other weights read with `evict_first` (as the step's gemvs read theirs):
does what the window read stay in L2 while other weights stream through it? Per form: the device
span per call and the mean time of each gemv kernel (`expert_gemv*`) and of the window from a
profiler trace; `prefetch` and `inkernel` must match `serial`'s output exactly.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import copy_bandwidth, machine, median_time, write_json
from bench.device_profile import kernel_profile, print_row, span_fields
from ling_jax.ops import expert_gemv
from ling_jax.ops.pallas_gpu import triton_call, whole

FORMS = ("serial", "prefetch", "inkernel", "window", "gemv")
WINDOW = 128  # values the window kernel carries
TILE = (64, 128)  # rows, columns of W read by each of `inkernel`'s prefetch programs


def _fma_chain(x: jax.Array, iters: int) -> jax.Array:
    """The window's work: `iters` dependent multiply-adds on x."""
    return lax.fori_loop(0, iters, lambda i, a: a * 0.999 + 0.001, x)


def window(v: jax.Array, iters: int, interpret: bool) -> jax.Array:
    """`iters` dependent multiply-adds on v [WINDOW] float32 in one program: a latency-bound kernel."""
    def kernel(x_ref, o_ref):
        o_ref[...] = _fma_chain(x_ref[...], iters)

    return triton_call(kernel, out_shape=jax.ShapeDtypeStruct(v.shape, jnp.float32), name="window",
                          interpret=interpret, num_warps=1, num_stages=1)(v)


def window_reading(v: jax.Array, iters: int, stack_LCO: jax.Array, layer: int, rows: int,
                   interpret: bool) -> jax.Array:
    """`window`, whose launch also reads W[layer]'s first `rows` rows into L2: one program per
    [64, 128] tile beside the window's, each loading its tile (`evict_last`) and storing its maximum
    (so that the load stays)."""
    (br, bo), o = TILE, stack_LCO.shape[-1]
    tiles_o = o // bo

    def kernel(x_ref, w_ref, o_ref, seen_ref):
        pid = pl.program_id(0)

        @pl.when(pid == 0)
        def _():
            o_ref[...] = _fma_chain(x_ref[...], iters)

        @pl.when(pid > 0)
        def _():
            r, c = (pid - 1) // tiles_o, (pid - 1) % tiles_o
            tile_ref = w_ref.at[jnp.int32(layer), pl.ds(r * br, br), pl.ds(c * bo, bo)]
            tile = pltriton.load(tile_ref, eviction_policy="evict_last")
            seen_ref[...] = jnp.full((1,), jnp.max(tile.astype(jnp.float32)))

    programs = 1 + rows // br * tiles_o
    out, _ = triton_call(kernel, grid=(programs,),
                            out_shape=[jax.ShapeDtypeStruct(v.shape, jnp.float32),
                                       jax.ShapeDtypeStruct((programs,), jnp.float32)],
                            in_specs=[whole(v), whole(stack_LCO)],
                            out_specs=[whole(v), pl.BlockSpec((1,), lambda i: (i,))], name="window",
                            interpret=interpret, num_warps=4, num_stages=1)(v, stack_LCO)
    return out


def chain(x_O: jax.Array, stack_LCO: jax.Array, between_LCB: jax.Array | None = None, *, form: str, iters: int,
          fraction: float, interpret: bool) -> jax.Array:
    """The chain of the module docstring, through `--layers` weights: [O] float32."""
    layers, c, _ = stack_LCO.shape
    rows = int(fraction * c) // TILE[0] * TILE[0]
    for i in range(layers):
        v = x_O[:WINDOW]
        if form == "inkernel" and rows:
            v = window_reading(v, iters, stack_LCO, i, rows, interpret)
        elif form != "gemv":
            v = window(v, iters, interpret)
        if between_LCB is not None:  # other weights stream through L2 before W_i's product
            y = expert_gemv.gathered_products(jnp.tile(v, c // WINDOW)[None].astype(stack_LCO.dtype),
                                              jnp.full((1,), i % between_LCB.shape[0], jnp.int32), (between_LCB,),
                                              interpret=interpret)[0][0]
            v = v + 1e-30 * y[:WINDOW]
        if form == "window":
            x_O = jnp.tile(v, x_O.shape[0] // WINDOW)
            continue
        if form == "prefetch":  # reads W_i once its layer starts, and the product waits for it
            _, w_after = lax.optimization_barrier((x_O, stack_LCO))
            seen = jnp.max(w_after[i]).astype(jnp.float32)
            v = jnp.where(seen > 1e30, 0.0, v)  # a data dependency XLA cannot drop (weights are finite)
        x_1C = jnp.tile(v, c // WINDOW)[None].astype(stack_LCO.dtype)
        x_O = expert_gemv.gathered_products(x_1C, jnp.full((1,), i, jnp.int32), (stack_LCO,),
                                            interpret=interpret)[0][0]
        x_O = x_O / (1.0 + jnp.max(jnp.abs(x_O)))  # bounded, for the next layer
    return x_O


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dims", type=int, nargs=2, default=[1536, 10240], metavar=("C", "O"),
                    help="the weight [C, O] (default: a Ling-3.0-tiny KDA layer's fused input projection)")
    ap.add_argument("--window-iters", type=int, nargs="+", default=[0, 1000, 4000])
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0],
                    help="inkernel: the share of W_l's rows the window reads")
    ap.add_argument("--between-mb", type=float, nargs="+", default=[0.0],
                    help="MB of other weights read between the window and W_l's product (0: none)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="small sizes, the interpreter (CPU check)")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu" and not args.smoke
    (c, o), layers = ((256, 512), 2) if args.smoke else (args.dims, args.layers)
    if c % TILE[0] or o % TILE[1]:
        raise SystemExit(f"--dims: C must be a multiple of {TILE[0]} and O of {TILE[1]}")
    stack = jax.random.normal(jax.random.key(0), (layers, c, o), jnp.bfloat16) * c ** -0.5
    x = jax.random.normal(jax.random.key(1), (o,), jnp.float32)
    nbytes = int(stack.nbytes)
    bw = copy_bandwidth(2.0 if gpu else 0.01)
    result: dict[str, Any] = {**machine(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "dims": [c, o],
                              "layers": layers, "weight_bytes": nbytes, "copy_GBps": bw / 1e9,
                              "floor_us": nbytes / bw * 1e6, "runs": []}
    print(f"{layers} x [{c}, {o}]: {nbytes / 1e6:.1f} MB of weights, floor {nbytes / bw * 1e6:.1f} us, "
          f"XLA_FLAGS={result['xla_flags']!r}", flush=True)
    outs: dict[tuple, jax.Array] = {}
    for mb in args.between_mb:
        ob = max(TILE[1], round(mb * 1e6 / (2 * c) / TILE[1]) * TILE[1]) if not args.smoke else TILE[1]
        between = (jax.random.normal(jax.random.key(2), (layers, c, ob), jnp.bfloat16) * c ** -0.5) if mb else None
        for iters in args.window_iters:
            for form in args.forms:
                if form == "gemv" and iters != args.window_iters[0]:
                    continue  # no window: one row is enough
                for fraction in args.fractions if form == "inkernel" else [0.0]:
                    row: dict[str, Any] = {"form": form, "window_iters": iters if form != "gemv" else 0,
                                           "between_bytes": int(between.nbytes) // layers if mb else 0}
                    if form == "inkernel":
                        row["fraction"] = fraction
                    fn = functools.partial(chain, form=form, iters=iters, fraction=fraction, interpret=not gpu)
                    call = functools.partial(jax.jit(fn), x, stack, between)
                    out = call()
                    if form in ("serial", "prefetch", "inkernel"):
                        ref = outs.setdefault((mb, iters), out)
                        row["max_abs_diff_vs_serial"] = float(jnp.max(jnp.abs(out - ref)))
                    row["wall_us"] = median_time(call, reps=args.reps if gpu else 1, warmup=3 if gpu else 0) * 1e6
                    prof = kernel_profile(call) if gpu else None
                    if prof:
                        row |= span_fields(prof, nbytes + row["between_bytes"] * layers, bw)
                        row["gemv_mean_us"] = {k["name"]: k["mean_us"] for k in prof["top_kernels"]
                                               if k["name"].startswith("expert_gemv")}
                        win = [k for k in prof["top_kernels"] if k["name"].startswith("window")]
                        row["window_mean_us"] = win[0]["mean_us"] if win else None
                    result["runs"].append(row)
                    print_row(row)
                    write_json(args.out, result)  # after every row: a run cut short keeps what it measured


if __name__ == "__main__":
    main()

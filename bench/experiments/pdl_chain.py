"""Programmatic dependent launch (PDL) for batch-1 decode: do weight reads start before their input is ready?

    python3 bench/experiments/pdl_chain.py --out $OUT/pdl_chain_h200.json   # the GPU run
    python3 bench/experiments/pdl_chain.py --smoke --out /tmp/pdl.json     # CPU (Mosaic-GPU interpreter)

Why: a batch-1 decode step is hundreds of kernels, one after another, and a single launch reads a
decode weight well below the copy rate because it spends microseconds filling and draining the GPU
(BENCHMARKS.md, "Measured bounds on batch-1 decode"); a persistent kernel with grid-wide barriers
did not help in Pallas-Triton (`bench/experiments/persistent_layer.py`, docs/decode-performance.md).
PDL is the hardware's own answer: a kernel launched with programmatic stream serialization may start
while the kernel before it is still running, and blocks at `griddepcontrol.wait` only where it first
reads that kernel's output. JAX's Mosaic GPU kernels expose it (`plgpu.griddepcontrol_wait`,
`plgpu.griddepcontrol_launch_dependents`; a kernel that waits is marked `uses_pdl`); a Pallas-Triton
kernel can issue the same instructions by inline assembly (`triton_rows_gemv`), and XLA then
launches it with PDL.

`rows_gemv` is a matrix-vector product for that: w [O, C] (the checkpoint's layout), one program
per 64 rows and per `split` of C, each streaming its [64, tk] weight tiles by TMA through a ring of
`depth` shared-memory slots and multiplying them by x on the tensor cores (wgmma, x as the first of
8 columns, the other 7 zero). It issues its first `depth` weight copies, then (`pdl` != "off") waits
for the kernel before it, then copies x and runs; with `pdl` = "launch" it also lets the next
kernel start once x is in. Outputs: [split, O, 8] float32 partial sums; column 0 is the product.

The chain: `--layers` dense MLP layers of Ling-3.0-tiny's widths, the decode step's pattern of a
small XLA fusion before every weight read:

    a = bf16(rms_norm(h) * n)            (XLA)     g = w_gu [2F, D] @ a       (gemv)
    u = bf16(silu(g[:F]) * g[F:])        (XLA)     h = h + w_d [D, F] @ u     (gemv, XLA add)

with the products by XLA (`xla`), by the Pallas-Triton gemv the decode step uses (`triton`,
`expert_gemv.gathered_products` on w [C, O], read from the layer stack in place), and by `rows_gemv`
with each `pdl` setting. `rows_independent` / `triton_independent`: the same 2L products all of one
input (`independent`), so that nothing but PDL orders them: the most PDL could overlap. Timed per
chain: wall clock (median of warmed-up calls, `block_until_ready`) and, from a `jax.profiler` trace,
the device span (first kernel start to last kernel end per call: with PDL kernels overlap, so
summed kernel times would count the overlap twice) and the kernels' summed time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import copy_bandwidth, machine, median_time, write_json
from bench.device_profile import kernel_profile, print_row, span_fields
from ling_jax.ops import expert_gemv
from ling_jax.ops.pallas_gpu import triton_call, whole

EPS = 1e-6
ROWS = 64  # wgmma's M: weight rows per program
X_COLS = 8  # wgmma's smallest N: x is column 0 of an [8, C] operand
PDL_MODES = ("off", "wait", "launch")


def rows_gemv(x_8C: jax.Array, w_OC: jax.Array, *, tk: int = 128, depth: int = 4, split: int = 1,
              pdl: str = "wait", interpret: bool = False) -> jax.Array:
    """w [O, C] @ x -> [split, O, 8] float32 partial sums (column 0: the product; x is row 0 of
    x_8C, the other rows zero). See the module docstring for the kernel's structure."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    o, c = w_OC.shape
    if pdl not in PDL_MODES:
        raise ValueError(f"rows_gemv: pdl must be one of {PDL_MODES}, got {pdl!r}")
    if x_8C.shape != (X_COLS, c) or x_8C.dtype != w_OC.dtype or jnp.dtype(w_OC.dtype).itemsize != 2:
        raise ValueError(f"rows_gemv: x {x_8C.shape} {x_8C.dtype} does not fit w {w_OC.shape} {w_OC.dtype} "
                         f"(x is [{X_COLS}, C] in w's 16-bit dtype)")
    c_split = c // split
    if o % ROWS or c % split or c_split % tk or tk % 64:
        raise ValueError(f"rows_gemv: O={o} must be a multiple of {ROWS}, C={c} of split={split} x tk={tk}, "
                         "tk of 64")
    steps = c_split // tk
    depth = min(depth, steps)
    swizzle = plgpu.find_swizzle(64 * 16)  # 64 bf16 per swizzled row: 128 bytes
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(swizzle))

    def body(x_gmem, w_gmem, out_gmem, w_smem, x_smem, out_smem, w_bars, x_bar):
        rows, s = pl.ds(lax.axis_index("o") * ROWS, ROWS), lax.axis_index("s")

        def fetch(step: Any, slot: Any) -> None:
            plgpu.copy_gmem_to_smem(w_gmem.at[rows, pl.ds(s * c_split + step * tk, tk)], w_smem.at[slot],
                                    w_bars.at[slot])

        for step in range(depth):  # the weights do not depend on the kernel before: ask for them first
            fetch(step, step)
        if pdl != "off" and not interpret:  # (the interpreter has no rule for it; it orders kernels anyway)
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(x_gmem.at[:, pl.ds(s * c_split, c_split)], x_smem, x_bar)
        plgpu.barrier_wait(x_bar)
        if pdl == "launch" and not interpret:
            plgpu.griddepcontrol_launch_dependents()

        def run(acc):
            @pl.loop(0, steps)
            def _step(step):
                slot = step % depth
                plgpu.barrier_wait(w_bars.at[slot])
                plgpu.wgmma(acc, w_smem.at[slot], x_smem.at[:, pl.ds(step * tk, tk)].transpose((1, 0)))
                plgpu.wgmma_wait(0)

                @pl.when(step + depth < steps)
                def _refill():
                    fetch(step + depth, slot)

            out_smem[...] = acc[...]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[s, rows, :])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(run, plgpu.ACC((ROWS, X_COLS), jnp.float32))

    call = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((split, o, X_COLS), jnp.float32),
        scratch_types=[plgpu.SMEM((depth, ROWS, tk), w_OC.dtype, transforms=tiled),
                       plgpu.SMEM((X_COLS, c_split), w_OC.dtype, transforms=tiled),
                       plgpu.SMEM((ROWS, X_COLS), jnp.float32),
                       plgpu.Barrier(num_barriers=depth), plgpu.Barrier()],
        grid=(o // ROWS, split), grid_names=("o", "s"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    mode = plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()) if interpret else contextlib.nullcontext()
    with mode:
        return call(x_8C, w_OC)


def triton_rows_gemv(x_C: jax.Array, w_OC: jax.Array, *, bo: int = 16, bch: int = 256, pdl: str = "off",
                     interpret: bool = False) -> jax.Array:
    """w [O, C] @ x -> [O] float32 in Pallas-Triton, every program summing BO whole rows in BCH-wide
    steps, with (`pdl` != "off") `griddepcontrol.wait` by inline assembly after its first weight
    tile is asked for and before x is read, and with "launch" `griddepcontrol.launch_dependents`
    too: whether XLA launches a Triton kernel that does so with programmatic serialization."""
    from jax.experimental.pallas import triton as pltriton

    o, c = w_OC.shape
    bch = math.gcd(bch, c)
    asm = {"off": None, "wait": "griddepcontrol.wait;",
           "launch": "griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;"}[pdl]

    def kernel(x_ref, w_ref, out_ref):
        i = pl.program_id(0)
        rows = pl.ds(i * bo, bo)
        w0 = pltriton.load(w_ref.at[rows, pl.ds(0, bch)], eviction_policy="evict_first").astype(jnp.float32)
        one = jnp.ones((bch,), jnp.float32)
        if asm and not interpret:  # its result (ones) scales x, so x's reads cannot move above the wait
            one = pltriton.elementwise_inline_asm(f"{asm}\n\tmov.b32 $0, $1;", args=[one + (i * 0).astype(jnp.float32)],
                                                  constraints="=r,r", pack=1,
                                                  result_shape_dtypes=[jax.ShapeDtypeStruct((bch,), jnp.float32)])[0]

        def step(j: jax.Array, acc_O: jax.Array) -> jax.Array:
            w_OK = pltriton.load(w_ref.at[rows, pl.ds(j * bch, bch)], eviction_policy="evict_first")
            return acc_O + jnp.sum(w_OK.astype(jnp.float32) * (x_ref[pl.ds(j * bch, bch)] * one)[None, :], axis=1)

        acc = jnp.sum(w0 * (x_ref[pl.ds(i * 0, bch)] * one)[None, :], axis=1)
        out_ref[rows] = lax.fori_loop(1, c // bch, step, acc)

    return triton_call(
        kernel, grid=(o // bo,), in_specs=[whole(x_C), whole(w_OC)], out_specs=pl.BlockSpec((o,), lambda i: (0,)),
        out_shape=jax.ShapeDtypeStruct((o,), jnp.float32),
        interpret=interpret, num_warps=4, num_stages=3)(x_C.astype(jnp.float32), w_OC)


@dataclasses.dataclass(frozen=True)
class Dims:
    """A dense decode layer's widths (Ling-3.0-tiny: hidden 1536, dense MLP 4608)."""

    d: int = 1536
    f: int = 4608


def random_chain(key: jax.Array, layers: int, dims: Dims) -> dict[str, jax.Array]:
    """bf16 weights [L, O, C] (w_gu: gate rows then up rows) and float32 norm scales."""
    k1, k2, k3 = jax.random.split(key, 3)
    return {"w_gu": jax.random.normal(k1, (layers, 2 * dims.f, dims.d), jnp.bfloat16) * dims.d ** -0.5,
            "w_d": jax.random.normal(k2, (layers, dims.d, dims.f), jnp.bfloat16) * dims.f ** -0.5,
            "n": 1 + 0.1 * jax.random.normal(k3, (layers, dims.d), jnp.float32)}


def _norm(h_D: jax.Array, n_D: jax.Array) -> jax.Array:
    return h_D * lax.rsqrt(jnp.mean(h_D * h_D) + EPS) * n_D


def chain(h_D: jax.Array, p: dict[str, jax.Array], *, impl: str, cfg: dict[str, Any] | None = None,
          interpret: bool = False, precision: Any = None) -> jax.Array:
    """The MLP chain with its products by `impl` ("xla", "triton", "rows"; cfg: rows_gemv's knobs)."""
    layers, f = p["w_gu"].shape[0], p["w_d"].shape[2]
    idx = jnp.zeros((1,), jnp.int32)

    def product(x: jax.Array, w_OC: jax.Array, stack_LCO: jax.Array | None, layer: int) -> jax.Array:
        if impl == "xla":
            return jnp.dot(w_OC, x, preferred_element_type=jnp.float32, precision=precision)
        if impl == "triton":  # as the decode step: the layer's weight read from its stack in place
            return expert_gemv.gathered_products(x[None], idx + layer, (stack_LCO,), interpret=interpret)[0][0]
        x_8C = jnp.zeros((X_COLS, x.shape[0]), x.dtype).at[0].set(x)
        return rows_gemv(x_8C, w_OC, interpret=interpret, **(cfg or {}))[:, :, 0].sum(0)

    for i in range(layers):
        w_gu, w_d = p["w_gu"][i], p["w_d"][i]
        g = product(_norm(h_D, p["n"][i]).astype(w_gu.dtype), w_gu, p.get("w_gu_t"), i)
        u = (jax.nn.silu(g[:f]) * g[f:]).astype(w_d.dtype)
        h_D = h_D + product(u, w_d, p.get("w_d_t"), i)
    return h_D


def independent(h_D: jax.Array, p: dict[str, jax.Array], *, cfg: dict[str, Any] | None = None, interpret: bool = False,
                reference: bool = False, triton: bool = False) -> jax.Array:
    """The chain's 2L products, all of one input (h, cut or zero-padded to each weight's C), summed
    at the end: no kernel waits for another's output, so with `pdl` = "launch" each may start and
    ask for its weights while the one before it runs, and XLA launches nothing in between. What PDL
    can overlap at most. `reference`: the same by XLA in float32; `triton`: by `triton_rows_gemv`."""
    total = jnp.zeros(h_D.shape, jnp.float32)
    for i in range(len(p["w_gu"])):
        for w_OC in (p["w_gu"][i], p["w_d"][i]):
            o, c = w_OC.shape
            x_C = jnp.zeros((c,), w_OC.dtype).at[:min(c, h_D.shape[0])].set(h_D[:c].astype(w_OC.dtype))
            if reference:
                y_O = jnp.dot(w_OC.astype(jnp.float32), x_C.astype(jnp.float32), precision=lax.Precision.HIGHEST)
            elif triton:
                y_O = triton_rows_gemv(x_C, w_OC, interpret=interpret, pdl=(cfg or {}).get("pdl", "off"))
            else:
                x_8C = jnp.zeros((X_COLS, c), w_OC.dtype).at[0].set(x_C)
                y_O = rows_gemv(x_8C, w_OC, interpret=interpret, **(cfg or {}))[:, :, 0].sum(0)
            total = total + y_O[:h_D.shape[0]]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tk", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--depth", type=int, nargs="+", default=[4])
    ap.add_argument("--split", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--pdl", nargs="+", default=list(PDL_MODES), choices=PDL_MODES)
    ap.add_argument("--impls", nargs="+", default=["xla", "triton", "rows"],
                    help="rows_independent, triton_independent: the products of one input (`independent`), no chain")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="small widths, 2 layers, the interpreter (CPU check)")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu" and not args.smoke
    if args.smoke:
        args.tk, args.split, args.depth = [64], [1], [2]
    dims = Dims() if not args.smoke else Dims(d=128, f=192)
    layers = args.layers if not args.smoke else 2
    p = random_chain(jax.random.key(0), layers, dims)
    if "triton" in args.impls:
        p |= {"w_gu_t": jnp.swapaxes(p["w_gu"], 1, 2), "w_d_t": jnp.swapaxes(p["w_d"], 1, 2)}
    h = jax.random.normal(jax.random.key(1), (dims.d,), jnp.float32)
    refs = {"chain": jax.jit(functools.partial(chain, impl="xla", precision=lax.Precision.HIGHEST))(h, p),
            "independent": jax.jit(functools.partial(independent, reference=True))(h, p)}
    nbytes = sum(int(p[k].nbytes) for k in ("w_gu", "w_d"))
    bw = copy_bandwidth(2.0 if gpu else 0.01)
    result: dict[str, Any] = {**machine(), "dims": dataclasses.asdict(dims), "layers": layers, "weight_bytes": nbytes,
                              "copy_GBps": bw / 1e9, "floor_us": nbytes / bw * 1e6, "runs": []}
    print(f"{layers} layers, {nbytes / 1e6:.1f} MB of weights, floor {nbytes / bw * 1e6:.1f} us", flush=True)
    configs: list[tuple[str, dict[str, Any]]] = [(i, {}) for i in args.impls if i in ("xla", "triton")]
    rows_grid = [dict(zip(("tk", "depth", "split", "pdl"), c, strict=True))
                 for c in itertools.product(args.tk, args.depth, args.split, args.pdl)]
    configs += [(i, c) for i in ("rows", "rows_independent") if i in args.impls for c in rows_grid]
    if "triton_independent" in args.impls:
        configs += [("triton_independent", {"pdl": m}) for m in args.pdl]
    for impl, cfg in configs:
        row: dict[str, Any] = {"impl": impl, **cfg}
        try:
            if impl.endswith("_independent"):
                fn, ref = jax.jit(functools.partial(independent, cfg=cfg, interpret=not gpu,
                                                    triton=impl.startswith("triton"))), refs["independent"]
                # one array per layer for the Triton kernel: XLA copies a stack's slice before a Triton call
                weights = {k: list(p[k]) for k in ("w_gu", "w_d")} if impl.startswith("triton") else p
            else:
                fn, ref = jax.jit(functools.partial(chain, impl=impl, cfg=cfg, interpret=not gpu)), refs["chain"]
                weights = p
            call = functools.partial(fn, h, weights)
            out = call()
            row["rel_l2_vs_f32"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            row["wall_us"] = median_time(call, reps=args.reps if gpu else 1, warmup=3 if gpu else 0) * 1e6
            prof = kernel_profile(call) if gpu else None
        except Exception as e:  # a configuration this GPU cannot run is a result, not the end of the run
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            prof = None
        if prof:
            row |= span_fields(prof, nbytes, bw)
        result["runs"].append(row)
        print_row(row)
        write_json(args.out, result)  # after every row: a run cut short keeps what it measured


if __name__ == "__main__":
    main()

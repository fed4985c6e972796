"""A persistent batch-1 decode chain: one kernel, grid-wide barriers, the next weights loaded first.

    python3 bench/experiments/persistent_layer.py --out $OUT/persistent_layer_h200.json   # the GPU run
    python3 bench/experiments/persistent_layer.py --check-protocols --out /tmp/b.json   # the barrier alone
    python3 bench/experiments/persistent_layer.py --smoke --out /tmp/pl.json            # CPU (interpret)

Why: the batch-1 decode step is ~430 kernel launches, and each one spends microseconds filling
and draining the GPU around its weight read, so the step runs at ~3x its HBM floor (docs/decode-performance.md).
A persistent kernel keeps every program resident across a layer's stages, waits at a
grid-wide barrier between them, and loads its first tile of the next stage's weights *before*
waiting, so the weight stream need not stop while a stage's last programs finish. This measures
what that buys on a chain of `--layers` dense layers with Ling-3.0-tiny's projection shapes (the
decode step's matrix-vector products, without the attention core):

    stage  input (prologue)          weight [O, C]      output (epilogue)
    in     rms_norm(x) * n1          w_in [A, D]        a = acc              (KDA's fused input projection)
    o      a[:H]                     w_o  [D, H]        y = x + acc          (o_proj + residual)
    gu     rms_norm(y) * n2          w_gu [2F, D]       g = acc              (the MLP's gate | up)
    down   silu(g[:F]) * g[F:]       w_d  [D, F]        x <- y + acc         (down + residual)

Every weight is stored [O, C] (rows contiguous); a stage's output is split into blocks of BO rows,
dealt round-robin to the programs, each summing its rows over C in BC-wide tiles (no partial sums
left for another launch; `--depth` tiles ahead in flight, or with `--unroll 1` every step unrolled
chunk by chunk). Every stage writes its own per-layer buffer. Modes:

  persistent     one launch for all layers; P programs (`--per-sm` per SM); between stages each
                 program sets its flag (`arrive`: an atomic exchange after a block-wide barrier),
                 loads the first `--depth` tiles of the next stage, then spins until every flag
                 says so (`wait`; then an acquiring atomic). The spin gives up after SPIN_LIMIT
                 polls, so a grid larger than what fits on the GPU at once gives wrong results
                 (and seconds per call), not a hang. `--check-protocols` checks the barrier alone
                 (`barrier_check`) under the ways of sharing data in PROTOCOLS
  no_prefetch    the same, the first tile loaded after the wait
  phased         the same stage code, one launch per stage and layer (what a kernel-per-op decode
                 step does; the only mode interpret mode can run: a spin barrier needs every
                 program resident at once)
  xla            the chain in XLA (jnp; its dots read the weights [O, C]); with float32 math, the
                 reference of every mode's error

Times: each mode's device time per chain (kernels in a `jax.profiler` trace) and its wall clock
(median of warmed-up calls with `block_until_ready`); the floor is the chain's weight bytes at the
copy bandwidth `bench/decode.py` uses (`bench.common.copy_bandwidth`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import copy_bandwidth, machine, median_time, write_json
from bench.device_profile import kernel_profile, print_row
from ling_jax.ops.pallas_gpu import next_pow2, pow2_tile, triton_call, whole

EPS = 1e-6
STAGES = ("in", "o", "gu", "down")


@dataclasses.dataclass(frozen=True)
class Dims:
    """The chain's sizes: hidden D, input projection A (its first H values feed o_proj), MLP width F."""

    d: int = 1536
    a: int = 10240
    h: int = 2048
    f: int = 4608


@dataclasses.dataclass(frozen=True)
class Tiling:
    """A stage's work split: output blocks of `bo` rows, summed over C in `bc`-wide tiles."""

    o: int
    c: int
    bo: int
    bc: int

    @property
    def blocks(self) -> int:
        return self.o // self.bo

    @property
    def chunks(self) -> int:
        return self.c // self.bc


def tiling(o: int, c: int, programs: int, tile_values: int) -> Tiling:
    """The widest tile of ~`tile_values` weights whose row blocks deal out evenly over `programs`:
    BC the largest power of two <= 512 dividing C, BO the largest power of two <= tile_values / BC
    dividing O whose last round leaves at most 1/8 of the programs idle (else the smallest)."""
    bc = pow2_tile(c, 512, 8)
    if bc is None:
        raise ValueError(f"C={c} has no power-of-two tile of 8 to 512")
    candidates = [b for b in (64, 32, 16, 8, 4, 2, 1) if b * bc <= tile_values and o % b == 0]
    for bo in candidates:
        blocks = o // bo
        rounds = -(-blocks // programs)
        if blocks >= rounds * programs * 7 // 8:
            return Tiling(o, c, bo, bc)
    return Tiling(o, c, candidates[-1], bc)


def random_chain(key: jax.Array, layers: int, dims: Dims) -> dict[str, jax.Array]:
    """Random bf16 weights [L, O, C] (N(0, 0.02)) and float32 norm weights near 1, on the device."""
    ks = jax.random.split(key, 6)

    def w(k: jax.Array, o: int, c: int) -> jax.Array:
        return (jax.random.normal(k, (layers, o, c), jnp.float32) * 0.02).astype(jnp.bfloat16)

    d = dims.d
    return {"n1": 1 + 0.1 * jax.random.normal(ks[0], (layers, d)),
            "n2": 1 + 0.1 * jax.random.normal(ks[1], (layers, d)), "w_in": w(ks[2], dims.a, d),
            "w_o": w(ks[3], d, dims.h), "w_gu": w(ks[4], 2 * dims.f, d), "w_d": w(ks[5], d, dims.f)}


def chain_xla(x_D: jax.Array, p: dict[str, jax.Array], dims: Dims, precision: Any = None) -> jax.Array:
    """The chain in XLA, float32 activations (the reference at `precision=HIGHEST`)."""

    def norm(v: jax.Array, n: jax.Array) -> jax.Array:
        return v * jax.lax.rsqrt(jnp.mean(v * v) + EPS) * n

    def mv(w: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.einsum("oc,c->o", w, v.astype(w.dtype) if precision is None else v,
                          preferred_element_type=jnp.float32, precision=precision)

    def layer(x: jax.Array, lp: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        a = mv(lp["w_in"], norm(x, lp["n1"]))
        y = x + mv(lp["w_o"], a[: dims.h])
        g = mv(lp["w_gu"], norm(y, lp["n2"]))
        return y + mv(lp["w_d"], jax.nn.silu(g[: dims.f]) * g[dims.f:]), None

    if precision is not None:
        p = {k: v.astype(jnp.float32) for k, v in p.items()}
    return jax.lax.scan(layer, x_D.astype(jnp.float32), p)[0]


# How the programs of a persistent launch share data (module constants, so that `--check-protocols`
# can try each): WRITE "store" (plain stores) or "atomic" (exchanges); ACQUIRE "own" (after the
# spin, +0 on this program's own flag) or "all" (+0 on every flag at once: a vector atomic, which
# the check on the GPU found broken); READ "plain" loads (every stage output has its own buffer per layer,
# so no line of it is read before its barrier: nothing stale in L1), "volatile" or "atomic" (+0).
# The defaults are what the check found exact on the GPU (docs/decode-performance.md).
WRITE = "store"
ACQUIRE = "own"
READ = "plain"
SPIN_LIMIT = 1 << 16  # polls before a wait gives up: a wrong result (programs not all resident), never a hang


def arrive(flags: Any, pid: Any, done: Any) -> None:
    """This program has finished `done` stages: flags[pid] = done once all its threads' stores are
    issued (an atomic exchange: release semantics, and harmless from any number of threads)."""
    pltriton.debug_barrier()
    pltriton.atomic_xchg(flags, pid, done)


def wait(flags: Any, pid: Any, done: Any) -> None:
    """Spin until every program has finished `done` stages (padding flags hold int32 max)."""
    every = pl.ds(0, flags.shape[0])

    def low() -> jax.Array:
        return jnp.min(pltriton.load(flags.at[every], volatile=True))

    seen, _ = jax.lax.while_loop(lambda c: (c[0] < done) & (c[1] < SPIN_LIMIT), lambda c: (low(), c[1] + 1),
                                 (low(), 0))
    zero = jnp.minimum(seen, 0)  # 0, but from the loop: an unused loop would be dropped as dead code
    if ACQUIRE == "all":
        pltriton.atomic_add(flags, every, jnp.full(flags.shape, zero, flags.dtype))
    else:
        pltriton.atomic_add(flags, pid, zero)
    pltriton.debug_barrier()


def write_shared(ref: Any, start: Any, value: jax.Array, persistent: bool = True) -> None:
    """ref[start:start + n] = value, for other programs of this launch to read (`persistent`; else
    for the next launch: a plain store)."""
    if WRITE == "atomic" and persistent:
        pltriton.atomic_xchg(ref, pl.ds(start, value.shape[0]), value)
    else:
        ref[pl.ds(start, value.shape[0])] = value


def read_shared(ref: Any, start: Any, size: int) -> jax.Array:
    """ref[start:start + size] as written by other programs of this launch (never a stale L1 line)."""
    if READ == "atomic":
        return pltriton.atomic_add(ref, pl.ds(start, size), jnp.zeros((size,), ref.dtype))
    return pltriton.load(ref.at[pl.ds(start, size)], volatile=READ == "volatile")


def barrier_check(programs: int, rounds: int = 8) -> tuple[jax.Array, jax.Array]:
    """GPU check of `arrive` / `wait`: in round r every program writes r * programs + pid, passes the
    barrier and sums what all wrote; returns (sums [rounds, P], flags [P])."""
    pp = next_pow2(programs)

    def kernel(flags_in, vals_in, sums_in, flags, vals, sums):
        pid = pl.program_id(0)
        for r in range(rounds):
            write_shared(vals, r * pp + pid, jnp.full((1,), r * programs + pid, jnp.float32))
            arrive(flags, pid, r + 1)
            wait(flags, pid, r + 1)
            sums[r * pp + pid] = jnp.sum(read_shared(vals, r * pp, pp))

    state = [jnp.where(jnp.arange(pp) < programs, 0, jnp.iinfo(jnp.int32).max).astype(jnp.int32),
             jnp.zeros((rounds * pp,), jnp.float32), jnp.zeros((rounds * pp,), jnp.float32)]
    flags, _, sums = triton_call(
        kernel, grid=(programs,), in_specs=[whole(s) for s in state], out_specs=[whole(s) for s in state],
        out_shape=[jax.ShapeDtypeStruct(s.shape, s.dtype) for s in state],
        input_output_aliases={0: 0, 1: 1, 2: 2}, interpret=False, num_warps=4, num_stages=1)(*state)
    return sums.reshape(rounds, pp)[:, :programs], flags[:programs]


PROTOCOLS = [("store", "own", "plain"), ("store", "own", "volatile"), ("atomic", "all", "volatile"),
             ("store", "all", "plain")]


def check_barrier(protocol: tuple[str, str, str], programs: int) -> dict[str, Any]:
    """`barrier_check` under (WRITE, ACQUIRE, READ) = `protocol`: how many of its sums are wrong."""
    global WRITE, ACQUIRE, READ
    saved, (WRITE, ACQUIRE, READ) = (WRITE, ACQUIRE, READ), protocol
    try:
        sums, flags = jax.jit(functools.partial(barrier_check, programs))()
    finally:
        WRITE, ACQUIRE, READ = saved
    rounds = jnp.arange(sums.shape[0])[:, None]
    bad = sums != rounds * programs**2 + programs * (programs - 1) // 2
    return {"protocol": dict(zip(("write", "acquire", "read"), protocol, strict=True)), "programs": programs,
            "wrong_sums": int(bad.sum()), "of": int(bad.size), "wrong_by_round": bad.sum(1).tolist(),
            "flags_ok": bool(jnp.all(flags == sums.shape[0]))}


def _chain_kernel(dims: Dims, tiles: dict[str, Tiling], programs: int, layers: int, mode: str,
                  stage: str | None, depth: int, unroll: bool) -> Any:
    """The kernel body: every stage of every layer with barriers (`stage` None), or one stage of
    the layer in `layer_ref` (phased)."""
    d, f = dims.d, dims.f

    def kernel(layer_ref, n1, n2, w_in, w_o, w_gu, w_d, *refs):
        x, a, y, g, flags = refs[5:]  # the outputs (aliased to refs[:5]): x [(L + 1) D], a, y, g [L .], flat
        pid = pl.program_id(0)
        weights = {"in": w_in, "o": w_o, "gu": w_gu, "down": w_d}
        read = read_shared

        def inv_rms(v: Any, base: Any, bc: int) -> jax.Array:
            ss = jax.lax.fori_loop(0, d // bc, lambda c, s: s + jnp.sum(jnp.square(read(v, base + c * bc, bc))), 0.0)
            return jax.lax.rsqrt(ss / d + EPS)

        def tile_loader(name: str, layer: Any):
            t = tiles[name]

            def load(i: Any) -> jax.Array:
                blk = jnp.minimum(pid + jax.lax.div(i, t.chunks) * programs, t.blocks - 1)
                cix = jax.lax.rem(i, t.chunks)
                return pltriton.load(weights[name].at[layer, pl.ds(blk * t.bo, t.bo), pl.ds(cix * t.bc, t.bc)],
                                     eviction_policy="evict_first")
            return load

        def run_stage(name: str, layer: Any, first: jax.Array | None) -> None:
            t = tiles[name]
            xb, ab, yb, gb = layer * d, layer * dims.a, layer * d, layer * 2 * f  # this layer's buffers
            load = tile_loader(name, layer)
            steps = -(-t.blocks // programs) * t.chunks
            if name == "in":
                scale = inv_rms(x, xb, t.bc)
                prologue = lambda c: read(x, xb + c * t.bc, t.bc) * scale * n1[layer, pl.ds(c * t.bc, t.bc)]  # noqa: E731
            elif name == "o":
                prologue = lambda c: read(a, ab + c * t.bc, t.bc)  # noqa: E731
            elif name == "gu":
                scale = inv_rms(y, yb, t.bc)
                prologue = lambda c: read(y, yb + c * t.bc, t.bc) * scale * n2[layer, pl.ds(c * t.bc, t.bc)]  # noqa: E731
            else:
                prologue = lambda c: jax.nn.silu(read(g, gb + c * t.bc, t.bc)) * read(g, gb + f + c * t.bc, t.bc)  # noqa: E731

            def epilogue(blk: Any, acc: jax.Array) -> None:
                start = blk * t.bo
                if name == "in":
                    write_shared(a, ab + start, acc, stage is None)
                elif name == "o":
                    write_shared(y, yb + start, read(x, xb + start, t.bo) + acc, stage is None)
                elif name == "gu":
                    write_shared(g, gb + start, acc, stage is None)
                else:
                    write_shared(x, xb + d + start, read(y, yb + start, t.bo) + acc, stage is None)

            def step(i: Any, carry: tuple[tuple[jax.Array, ...], jax.Array]) -> tuple[tuple[jax.Array, ...], jax.Array]:
                ahead, acc = carry  # the tiles of steps i .. i + depth - 1, loaded earlier
                w = ahead[0] if depth else load(i)  # depth 0: as loaded here (Triton's pipeliner may hoist it)
                cix, blk = jax.lax.rem(i, t.chunks), pid + jax.lax.div(i, t.chunks) * programs
                acc = acc + jnp.sum(w.astype(jnp.float32) * prologue(cix)[None, :], axis=1)
                last = cix == t.chunks - 1

                @pl.when(last & (blk < t.blocks))
                def _() -> None:
                    epilogue(blk, acc)

                if depth:
                    ahead = (*ahead[1:], load(jnp.minimum(i + depth, steps - 1)))
                return ahead, jnp.where(last, 0.0, acc)

            if unroll:  # chunks outer, each input chunk formed once; every tile load at a static step
                rounds = steps // t.chunks
                accs = [jnp.zeros((t.bo,), jnp.float32)] * rounds
                for cix in range(t.chunks):
                    x_c = prologue(cix)
                    for r in range(rounds):
                        i = r * t.chunks + cix
                        w = first[i] if first is not None and i < len(first) else load(i)
                        accs[r] = accs[r] + jnp.sum(w.astype(jnp.float32) * x_c[None, :], axis=1)
                for r in range(rounds):
                    @pl.when(pid + r * programs < t.blocks)
                    def _(r: int = r) -> None:
                        epilogue(pid + r * programs, accs[r])
                return
            if first is None:
                first = tuple(load(min(j, steps - 1)) for j in range(depth))
            jax.lax.fori_loop(0, steps, step, (first, jnp.zeros((t.bo,), jnp.float32)))

        if stage is not None:
            run_stage(stage, layer_ref[0], None)
            return

        def layer_body(layer: Any, _: Any) -> Any:
            for s, name in enumerate(STAGES):
                k = layer * len(STAGES) + s  # stages every program must have finished first
                load = tile_loader(name, layer)
                first = tuple(load(j) for j in range(depth)) if mode == "persistent" else None
                wait(flags, pid, k)
                run_stage(name, layer, first)
                arrive(flags, pid, k + 1)
            return _

        jax.lax.fori_loop(0, layers, layer_body, 0)

    return kernel


def chain_pallas(x_D: jax.Array, p: dict[str, jax.Array], dims: Dims, *, mode: str, programs: int,
                 tile_values: int = 8192, depth: int = 1, unroll: bool = False, num_warps: int = 4,
                 num_stages: int = 1, interpret: bool | None = None) -> jax.Array:
    """The chain as Pallas (Triton) kernels: `mode` "persistent" / "no_prefetch" (one launch; GPU
    only) or "phased" (one launch per stage and layer); every program keeps the weight tiles of its
    next `depth` steps in flight (`unroll`: every stage's steps unrolled, chunk by chunk, and
    `depth` only the tiles loaded before a barrier)."""
    layers = p["w_in"].shape[0]
    shapes = {"in": (dims.a, dims.d), "o": (dims.d, dims.h), "gu": (2 * dims.f, dims.d), "down": (dims.d, dims.f)}
    tiles = {name: tiling(o, c, programs, tile_values) for name, (o, c) in shapes.items()}
    state = [jnp.zeros(((layers + 1) * dims.d,), jnp.float32).at[: dims.d].set(x_D.astype(jnp.float32)),
             jnp.zeros((layers * dims.a,), jnp.float32), jnp.zeros((layers * dims.d,), jnp.float32),
             jnp.zeros((layers * 2 * dims.f,), jnp.float32),
             jnp.where(jnp.arange(next_pow2(programs)) < programs, 0, jnp.iinfo(jnp.int32).max).astype(jnp.int32)]
    weights = [p["n1"], p["n2"], p["w_in"], p["w_o"], p["w_gu"], p["w_d"]]

    def call(stage: str | None, layer: jax.Array, st: list[jax.Array]) -> list[jax.Array]:
        operands = [layer, *weights, *st]
        return triton_call(
            _chain_kernel(dims, tiles, programs, layers, mode, stage, depth, unroll), grid=(programs,),
            in_specs=[whole(o) for o in operands], out_specs=[whole(s) for s in st],
            out_shape=[jax.ShapeDtypeStruct(s.shape, s.dtype) for s in st],
            input_output_aliases={len(weights) + 1 + i: i for i in range(len(st))},
            interpret=interpret, num_warps=num_warps, num_stages=num_stages)(*operands)

    if mode == "phased":  # unrolled, as the decode step is
        for layer in range(layers):
            for name in STAGES:
                state = call(name, jnp.full((1,), layer, jnp.int32), state)
        return state[0][layers * dims.d:]
    return call(None, jnp.zeros((1,), jnp.int32), state)[0][layers * dims.d:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--per-sm", type=int, nargs="+", default=[1, 2], help="programs per SM (persistent modes)")
    ap.add_argument("--tile-values", type=int, nargs="+", default=[8192], help="weights per tile (BO x BC)")
    ap.add_argument("--depth", type=int, nargs="+", default=[2], help="weight tiles each program keeps in flight")
    ap.add_argument("--num-stages", type=int, nargs="+", default=[1], help="Triton's software-pipelining stages")
    ap.add_argument("--unroll", type=int, nargs="+", default=[0], help="1: stages unrolled chunk by chunk")
    ap.add_argument("--protocol", nargs=3, metavar=("WRITE", "ACQUIRE", "READ"),
                    help="how persistent programs share data (module constants WRITE, ACQUIRE, READ)")
    ap.add_argument("--check-protocols", action="store_true",
                    help="only check the barrier under every protocol in PROTOCOLS (GPU)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=["xla", "phased", "no_prefetch", "persistent"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="small shapes, 2 layers, interpret mode (CPU check)")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu" and not args.smoke
    global WRITE, ACQUIRE, READ
    if args.protocol:
        WRITE, ACQUIRE, READ = args.protocol
    dims = Dims() if not args.smoke else Dims(d=64, a=192, h=64, f=96)
    layers = args.layers if not args.smoke else 2
    sms = jax.devices()[0].core_count if gpu else 2
    p = random_chain(jax.random.key(0), layers, dims)
    x = jax.random.normal(jax.random.key(1), (dims.d,), jnp.float32)
    ref = jax.jit(functools.partial(chain_xla, dims=dims, precision=jax.lax.Precision.HIGHEST))(x, p)
    nbytes = sum(int(v.nbytes) for k, v in p.items() if k.startswith("w_"))
    bw = copy_bandwidth(2.0 if gpu else 0.01)
    result: dict[str, Any] = {**machine(), "dims": dataclasses.asdict(dims), "layers": layers, "weight_bytes": nbytes,
                              "protocol": {"write": WRITE, "acquire": ACQUIRE, "read": READ},
                              "copy_GBps": bw / 1e9, "floor_us": nbytes / bw * 1e6, "sms": sms, "runs": []}
    print(f"{layers} layers, {nbytes / 1e6:.1f} MB of weights, floor {nbytes / bw * 1e6:.1f} us at {bw / 1e9:.0f} GB/s",
          flush=True)
    if gpu:
        for protocol in PROTOCOLS if args.check_protocols else [(WRITE, ACQUIRE, READ)]:
            for k in args.per_sm:
                result.setdefault("barrier_check", []).append(check_barrier(protocol, k * sms))
                print("barrier check", k, "per SM:", result["barrier_check"][-1], flush=True)
        if args.check_protocols:
            write_json(args.out, result)
            return
    grid = [dict(zip(("per_sm", "tile_values", "depth", "num_stages", "unroll"), c, strict=True))
            for c in itertools.product(args.per_sm, args.tile_values, args.depth, args.num_stages, args.unroll)]
    configs = [("xla", {})] if "xla" in args.modes else []
    configs += [(m, c) for c in grid for m in args.modes if m != "xla" and (gpu or m == "phased")]
    for mode, cfg in sorted(configs, key=lambda mc: mc[1].get("per_sm", 0)):  # more per SM (may not fit) last
        if mode == "xla":
            fn = jax.jit(functools.partial(chain_xla, dims=dims))
        else:
            kw = {k: v for k, v in cfg.items() if k != "per_sm"}
            fn = jax.jit(functools.partial(chain_pallas, dims=dims, mode=mode, programs=cfg["per_sm"] * sms,
                                           num_warps=args.warps, interpret=not gpu, **kw))
        out = fn(x, p)
        err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        wall = median_time(lambda fn=fn: fn(x, p), reps=args.reps if gpu else 2, warmup=3 if gpu else 1)
        prof = kernel_profile(lambda fn=fn: fn(x, p)) if gpu else None
        row = {"mode": mode, **cfg, "rel_l2_vs_f32": err, "wall_us": wall * 1e6}
        if prof:
            dev = prof["kernel_time_s_per_call"]
            row |= {"device_us": dev * 1e6, "kernels_per_call": prof["kernels_per_call"], "GBps": nbytes / dev / 1e9,
                    "x_floor": dev / (nbytes / bw)}
        result["runs"].append(row)
        print_row(row)
        write_json(args.out, result)  # after every row: a run cut short keeps what it measured


if __name__ == "__main__":
    main()

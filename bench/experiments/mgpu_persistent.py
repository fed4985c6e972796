"""A persistent Mosaic-GPU weight stream over a decode chain: one launch, semaphore barriers, TMA ahead.

    python3 bench/experiments/mgpu_persistent.py --out $OUT/mgpu_persistent_h200.json   # the GPU run
    python3 bench/experiments/mgpu_persistent.py --smoke --out /tmp/mp.json            # CPU (interpreter)

Why: at batch 1 a decode step is a chain of matrix-vector products, each waiting for the one
before, and launching one kernel per product leaves the weight stream idle while each kernel fills
and drains the GPU (docs/decode-performance.md: even a pure MLP chain of the step's own gemv runs at
2x its HBM floor). A persistent Pallas-Triton kernel did not help (`bench/experiments/persistent_layer.py`):
its programs cannot keep enough loads in flight across a barrier. Here every program is one
warpgroup on its own SM that streams its weight tiles by TMA through a ring of `depth`
shared-memory slots *across stage boundaries*: the weights do not depend on the activations, so
the next stage's first tiles are in flight while the program waits at the grid-wide barrier (a
global-memory semaphore, `plgpu.semaphore_signal` / `semaphore_wait` at GPU scope) and then loads
the stage's input.

The chain: `--layers` x the four weight reads of a Ling-3.0-tiny decode layer (the projections of
`bench/experiments/persistent_layer.py`, same weights: w_in [A, D], w_o [D, H], w_gu [2F, D], w_d [D, F]),
each stage taking the first C values of the stage before as its input; the elementwise work
between them (norms, gates, residuals) is left out, so this measures the weight stream and its
synchronisation alone. How a stage is split (`Stage`):

  * its output rows in blocks of 64 (wgmma's M) and its C in `split` parts (a multiple of 8);
    items (part, block), part-major, in contiguous runs per program (sizes differing by at most
    one), each item `ksteps` tiles [64, tk], tk the widest multiple of 64 up to `--tk-max`
    dividing a part (one view of the ring per width, all with the widest slot's size); a
    program's run spans a few parts, and only those columns of the stage's input are loaded
    (`Stage.window`);
  * an item's partial product goes to row `part` of the stage's output X [split, O] (bf16), so the
    stage's value is the sum of X's rows. The next stage never adds them up: it multiplies its
    weight tile by all N = split rows at once (X as wgmma's [N, tk] operand) and sums the
    accumulator's N columns, which is W @ sum(X) in float32.

The barrier is one counter for the grid (`pl.get_global`: a semaphore in `scratch_types` would be
one per program), zeroed before each launch; each program adds 1 after a stage's outputs are
written and waits for stage x programs. The `dataflow` form has no barrier: a counter per stage and
part of the next stage's C counts the runs of blocks written into that part's columns (a program
adds 1 per part of the stage before and part of the next C it wrote in, `for_each_signal`;
complete at `signal_targets`), and a program starting a stage waits only for the 1-3 parts its
input window holds, so a late program holds back only those that read its outputs. `--l2-ahead K`
has every program also prefetch its tile K past the ring into L2 (no shared memory needed), to keep
the weight stream in flight while it waits.

Forms: `persistent` (all stages in one launch, grid barriers), `dataflow` (one launch, part
counters), `phased` (the same stage code, one launch per stage: what a kernel-per-op step does),
`unsynced` (one launch without waits: a diagnostic of the stream's pace, its results wrong by
design), `triton` (the decode step's Pallas-Triton gemv,
`expert_gemv.gathered_products`, each layer's weight read from its [L, C, O] stack in place) and
`xla` (jnp.dot on [O, C]). Times: the device span per chain from a `jax.profiler` trace
(first kernel start to last kernel end) and the wall clock; floor = weight bytes / copy bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import copy_bandwidth, machine, median_time, rel_l2, write_json
from bench.device_profile import kernel_profile, print_row, span_fields
from bench.experiments.persistent_layer import STAGES, Dims, random_chain
from ling_jax.ops import expert_gemv

ROWS = 64  # wgmma's M: weight rows per item
ROW_GROUP = 8  # X's rows (the partial sums) come in multiples of wgmma's smallest N
WEIGHT = {"in": "w_in", "o": "w_o", "gu": "w_gu", "down": "w_d"}  # role -> `random_chain` key


@dataclasses.dataclass(frozen=True)
class Stage:
    """One weight read of the chain: w[role][layer] [O, C] times the first C values of its input X
    [n, >= C] (n partial rows), C in `split` parts; output X' [split, O]."""

    role: str
    layer: int
    o: int
    c: int
    split: int
    n: int
    tk: int

    @property
    def blocks(self) -> int:
        return self.o // ROWS

    @property
    def items(self) -> int:
        return self.blocks * self.split

    @property
    def part(self) -> int:
        return self.c // self.split

    @property
    def ksteps(self) -> int:
        return self.part // self.tk

    def run(self, p: Any, programs: int) -> tuple[Any, Any]:
        """Program p's items [start, end) (p a Python or traced int)."""
        return p * self.items // programs, (p + 1) * self.items // programs

    def window(self, programs: int) -> int:
        """The most parts one program's run spans: the columns of the input it loads."""
        return max((end - 1) // self.blocks - start // self.blocks + 1
                   for start, end in (self.run(p, programs) for p in range(programs)))

    def first_part(self, p: Any, programs: int) -> Any:
        """The first of the `window` parts program p loads (its run's first part, moved back so that
        the window stays inside C)."""
        return jnp.minimum(self.run(p, programs)[0] // self.blocks, self.split - self.window(programs))


def for_each_signal(prev: Stage, st: Stage, p: Any, programs: int, loop: Callable, emit: Callable) -> None:
    """The `dataflow` form's signals from program p after stage `prev`: `emit(t, q, lo, hi)` once for
    every part t of `prev` and part q of the next stage `st`'s C in which p wrote blocks [lo, hi)
    (an item: one 64-row block of one part of `prev`; q's columns are blocks q x st.part / 64 on).
    Each emit adds 1 to counter q, which is complete at `signal_targets`. `loop(lo, hi)` is a loop
    decorator: `pl.loop` in the kernel, a Python loop in tests. (A signal's increment must be a
    constant in Mosaic GPU, so a signal counts a program's run of blocks, not the blocks.)"""
    start, end = prev.run(p, programs)
    per_part, used = st.part // ROWS, st.c // ROWS  # blocks of prev per part of st; blocks st reads

    @loop(start // prev.blocks, (end - 1) // prev.blocks + 1)
    def _part(t: Any) -> None:  # p's blocks [r0, r1) of prev's part t, those st reads
        r0 = _max(start - t * prev.blocks, 0)
        r1 = _min(end - t * prev.blocks, min(prev.blocks, used))

        @loop(r0 // per_part, (r1 + per_part - 1) // per_part)
        def _q(q: Any) -> None:
            emit(t, q, _max(r0, q * per_part), _min(r1, (q + 1) * per_part))


def _min(a: Any, b: Any) -> Any:  # Python ints stay Python ints (a jnp op under a trace would not)
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _max(a: Any, b: Any) -> Any:
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def python_loop(lo: Any, hi: Any) -> Callable:
    """`for_each_signal`'s loop outside a kernel."""
    return lambda body: [body(i) for i in range(lo, hi)]


def signal_targets(prev: Stage, st: Stage, programs: int) -> list[int]:
    """How many signals each part q of `st`'s C gets from all programs after `prev`."""
    counts = [0] * st.split

    def emit(t: Any, q: Any, lo: Any, hi: Any) -> None:
        counts[int(q)] += 1

    for p in range(programs):
        for_each_signal(prev, st, p, programs, python_loop, emit)
    return counts


def choose_split(o: int, c: int, programs: int, tk: int, max_split: int) -> int:
    """The split of C (a multiple of ROW_GROUP, C / split a multiple of tk) whose items deal out most
    evenly over `programs` (fewest rounds per mean round), the smaller on a tie."""
    if o % ROWS:
        raise ValueError(f"O={o} is not a multiple of {ROWS}")
    cands = [s for s in range(ROW_GROUP, max_split + 1, ROW_GROUP) if c % (s * tk) == 0]
    if not cands:
        raise ValueError(f"C={c} has no split (a multiple of {ROW_GROUP} up to {max_split}) into multiples of tk={tk}")

    def imbalance(s: int) -> float:
        items = o // ROWS * s
        return math.ceil(items / programs) / (items / programs)

    return min(cands, key=lambda s: (round(imbalance(s), 6), s))


def plan(dims: Dims, layers: int, programs: int, tk_max: int = 64, max_split: int = 24) -> list[Stage]:
    """The chain's stages, each split for `programs` (in multiples of 64 columns), its tiles the
    widest multiple of 64 up to `tk_max` dividing a part; the first reads an X of ROW_GROUP rows."""
    shapes = {"in": (dims.a, dims.d), "o": (dims.d, dims.h), "gu": (2 * dims.f, dims.d), "down": (dims.d, dims.f)}
    stages, n, width = [], ROW_GROUP, dims.d
    for layer, role in itertools.product(range(layers), STAGES):
        o, c = shapes[role]
        if c > width:
            raise ValueError(f"plan: stage {role} reads {c} values of an input of {width}")
        width = o
        split = choose_split(o, c, programs, 64, max_split)
        tk = max(t for t in range(64, tk_max + 1, 64) if c // split % t == 0)
        stages.append(Stage(role, layer, o, c, split, n, tk))
        n = split
    return stages


def stage_reference(x_NC: jax.Array, w: dict[str, jax.Array], st: Stage) -> jax.Array:
    """One stage's X [split, O] as the kernel defines it (float32 products, bf16 partial rows)."""
    x_C = x_NC[:, :st.c].astype(jnp.float32).sum(0)
    w_OSP = w[WEIGHT[st.role]][st.layer].astype(jnp.float32).reshape(st.o, st.split, st.part)
    return jnp.einsum("osp,sp->so", w_OSP, x_C.reshape(st.split, st.part),
                      precision=lax.Precision.HIGHEST).astype(jnp.bfloat16)


def chain_reference(x0_NC: jax.Array, w: dict[str, jax.Array], stages: list[Stage]) -> list[jax.Array]:
    """Every stage's X, each stage fed the reference's X before it."""
    outs = [x0_NC]
    for st in stages:
        outs.append(stage_reference(outs[-1], w, st))
    return outs[1:]


def worst_stage_error(x0_NC: jax.Array, outs: list[jax.Array], w: dict[str, jax.Array],
                      stages: list[Stage]) -> float:
    """The largest relative L2 error of a stage's X against its reference fed the kernel's own
    input (bf16 rounding flips would otherwise compound along the chain)."""
    ins = [x0_NC, *outs[:-1]]
    return max(rel_l2(o, stage_reference(x, w, st)) for x, o, st in zip(ins, outs, stages, strict=True))


FORM_SYNC = {"persistent": "grid", "dataflow": "parts", "unsynced": "none"}  # one-launch forms -> chain_mgpu's sync
SYNCS = tuple(FORM_SYNC.values())


def chain_mgpu(x0_NC: jax.Array, w: dict[str, jax.Array], stages: list[Stage], *, programs: int, depth: int,
               sync: str = "grid", l2_ahead: int = 0, interpret: bool = False) -> list[jax.Array]:
    """All `stages` in one Mosaic-GPU launch of `programs` programs (one per SM: a program that waits
    needs every other resident), returning every stage's X. One stage: no waits (the `phased` form).
    How a stage waits for the one before (`sync`): "grid", a barrier of every program; "parts",
    only for the parts of its C that the program's input window holds, each counted complete when
    every 64-row block of the stage before in it is written (the `dataflow` form, `for_each_signal`);
    "none", not at all (wrong results: the weight stream's pace without waits). `l2_ahead` > 0: each
    program also asks for its tile `depth + l2_ahead` ahead into L2 (a TMA prefetch, no shared
    memory), so the weight stream stays in flight while the program waits."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if sync not in SYNCS:
        raise ValueError(f"chain_mgpu: sync {sync!r} is not one of {SYNCS}")

    if any(st.tk % 64 or st.part % st.tk for st in stages):
        raise ValueError("chain_mgpu: every stage's tk must be a multiple of 64 dividing its part")
    # A ring slot holds one tile of any stage: one view of the ring per tile width, all with the
    # widest tile's slot size (a narrower tile fills the first 64 of its view's rows).
    slot_values = ROWS * max(st.tk for st in stages)
    view_rows = {st.tk: slot_values // st.tk for st in stages}
    if any(slot_values % tk or rows % 8 for tk, rows in view_rows.items()):
        raise ValueError(f"chain_mgpu: tile widths {sorted(view_rows)} do not share a slot size")
    widths = sorted(view_rows)
    if len(stages) > 1 and min(st.items for st in stages) < programs:
        raise ValueError(f"chain_mgpu: every stage needs at least {programs} items (one per program)")
    waits = sync != "none" and len(stages) > 1 and programs > 1
    sms = None if interpret else getattr(jax.devices()[0], "core_count", None)
    if waits and sms is not None and programs > sms:  # programs not all resident would wait forever
        raise ValueError(f"chain_mgpu: {programs} programs that wait for each other need as many SMs ({sms} here)")
    # The fetch `depth` tiles ahead may land this many stages on (every program has >= min tiles per stage).
    min_tiles = min(st.items // programs * st.ksteps for st in stages)
    reach = 1 + -(-(depth + l2_ahead) // max(min_tiles, 1))
    swizzle = plgpu.find_swizzle(64 * 16)  # 64 bf16 per swizzled row: 128 bytes
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(swizzle))
    windows = [st.window(programs) for st in stages]
    x_shapes = sorted({(st.n, win * st.part) for st, win in zip(stages, windows, strict=True)})
    roles = list(STAGES)

    def body(x0_gmem, *refs):
        w_gmem = dict(zip(roles, refs[:len(roles)], strict=True))
        outs = refs[len(roles):len(roles) + len(stages)]
        ring_union, x_union, out_smem, w_bars, x_bar = refs[len(roles) + len(stages):]
        ring = dict(zip(widths, ring_union, strict=True))
        # Counters in global memory (a semaphore in scratch_types would be one per program), zeroed
        # before every launch: one for the grid, or one per stage and part of the next stage's C.
        if waits and sync == "grid":
            sem = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        elif waits:
            sem = pl.get_global(plgpu.SemaphoreType.REGULAR((len(stages) - 1, max(st.split for st in stages))))
        x_smem = dict(zip(x_shapes, x_union, strict=True))
        p = lax.axis_index("p")
        runs = [st.run(p, programs) for st in stages]  # this program's items
        tiles = [(end - start) * st.ksteps for (start, end), st in zip(runs, stages, strict=True)]
        base = [sum(tiles[:s], jnp.int32(0)) for s in range(len(stages))]  # flat index of a stage's first tile

        def ring_tile(slot: Any, tk: int) -> Any:
            return ring[tk].at[slot, pl.ds(0, ROWS)]

        def item_rows_part(s: int, j: Any) -> tuple[Any, Any]:  # the output block and part of item j
            i = runs[s][0] + j
            return i % stages[s].blocks, i // stages[s].blocks

        def fetch(s: int, l: Any, to_l2: bool) -> None:  # stage s's local tile l into ring slot (base + l) % depth
            st = stages[s]
            r, t = item_rows_part(s, l // st.ksteps)
            slot = (base[s] + l) % depth
            tk = st.tk
            src = w_gmem[st.role].at[st.layer, pl.ds(r * ROWS, ROWS), pl.ds(t * st.part + (l % st.ksteps) * tk, tk)]
            if to_l2:  # a prefetch into L2 only
                plgpu.async_prefetch(src)
            else:
                plgpu.copy_gmem_to_smem(src, ring_tile(slot, tk), w_bars.at[slot])

        def fetch_ahead(s: int, l: Any, to_l2: bool = False) -> None:  # local tile l of stage s, maybe of a later stage
            lo = jnp.int32(0)
            for s2 in range(s, min(s + reach + 1, len(stages))):
                @pl.when((l >= lo) & (l < lo + tiles[s2]))
                def _fetch(s2=s2, lo=lo):
                    fetch(s2, l - lo, to_l2)
                lo = lo + tiles[s2]

        for l in range(depth + l2_ahead):  # the first weight tiles before anything else
            fetch_ahead(0, jnp.int32(l), to_l2=l >= depth)
        for s, st in enumerate(stages):
            part0 = st.first_part(p, programs)  # the first part of the input this program's run needs
            if waits and s and sync == "grid":  # every program's stage s-1 output is in GMEM before anyone reads it
                plgpu.semaphore_signal(sem, 1, memory_scope="gpu")
                plgpu.semaphore_wait(sem, s * programs, decrement=False, memory_scope="gpu")
            elif waits and s:  # the parts of this stage's C that its run reads: every block of each written
                targets = signal_targets(stages[s - 1], st, programs)

                @pl.loop(part0, part0 + windows[s])
                def _wait(q, targets=targets, s=s):
                    target = functools.reduce(lambda acc, qt: jnp.where(q == qt[0], qt[1], acc),
                                              enumerate(targets), jnp.int32(0))
                    plgpu.semaphore_wait(sem.at[s - 1, q], target, decrement=False, memory_scope="gpu")

            x_ref = x_smem[st.n, windows[s] * st.part]
            src = x0_gmem if s == 0 else outs[s - 1]
            plgpu.copy_gmem_to_smem(src.at[:, pl.ds(part0 * st.part, windows[s] * st.part)], x_ref, x_bar)
            plgpu.barrier_wait(x_bar)

            @pl.loop(0, runs[s][1] - runs[s][0])
            def _item(j, s=s, st=st, x_ref=x_ref, part0=part0):
                r, t = item_rows_part(s, j)

                def product(acc):
                    @pl.loop(0, st.ksteps)
                    def _k(k):
                        l = j * st.ksteps + k
                        slot = (base[s] + l) % depth
                        plgpu.barrier_wait(w_bars.at[slot])
                        x_tile = x_ref.at[:, pl.ds((t - part0) * st.part + k * st.tk, st.tk)]
                        plgpu.wgmma(acc, ring_tile(slot, st.tk), x_tile.transpose((1, 0)))
                        plgpu.wgmma_wait(0)
                        fetch_ahead(s, l + depth)
                        if l2_ahead:
                            fetch_ahead(s, l + depth + l2_ahead, to_l2=True)

                    return acc[...]

                y = pl.run_scoped(product, plgpu.ACC((ROWS, st.n), jnp.float32)).sum(axis=1)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the buffer written two items ago is read
                buf = out_smem.at[j % 2]
                buf[...] = y.astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(buf, outs[s].at[t, pl.ds(r * ROWS, ROWS)])

            plgpu.wait_smem_to_gmem(0)  # this stage's outputs are written (before the next barrier)
            if waits and sync == "parts" and s + 1 < len(stages):  # the items written, per part of the next C
                for_each_signal(st, stages[s + 1], p, programs, pl.loop,
                                lambda t, q, lo, hi, s=s: plgpu.semaphore_signal(sem.at[s, q], 1, memory_scope="gpu"))

    scratch = [plgpu.RefUnion(*[plgpu.SMEM((depth, view_rows[tk], tk), jnp.bfloat16, transforms=tiled)
                                for tk in widths]),
               plgpu.RefUnion(*[plgpu.SMEM(shape, jnp.bfloat16, transforms=tiled) for shape in x_shapes]),
               plgpu.SMEM((2, ROWS), jnp.bfloat16), plgpu.Barrier(num_barriers=depth), plgpu.Barrier()]
    call = plgpu.kernel(
        body, out_type=[jax.ShapeDtypeStruct((st.split, st.o), jnp.bfloat16) for st in stages],
        scratch_types=scratch, grid=(programs,), grid_names=("p",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    mode = plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()) if interpret else contextlib.nullcontext()
    with mode:
        return list(call(x0_NC, *(w[WEIGHT[r]] for r in roles)))


def chain_phased(x0_NC: jax.Array, w: dict[str, jax.Array], stages: list[Stage], **kw: Any) -> list[jax.Array]:
    """The same stage code, one launch per stage."""
    outs, x = [], x0_NC
    for st in stages:
        x = chain_mgpu(x, w, [st], **kw)[0]
        outs.append(x)
    return outs


def chain_plain(x_D: jax.Array, w: dict[str, jax.Array], stages: list[Stage], *, impl: str,
                interpret: bool = False) -> jax.Array:
    """The same chain of products by XLA (`xla`) or the decode step's Triton gemv (`triton`, reading
    w_t[role] [L, C, O] in place); every stage's input is the previous output's first C values, bf16."""
    idx, x = jnp.zeros((1,), jnp.int32), x_D.astype(jnp.bfloat16)
    for st in stages:
        x_C = x[:st.c]
        if impl == "xla":
            y = jnp.dot(w[WEIGHT[st.role]][st.layer], x_C, preferred_element_type=jnp.float32)
        else:
            stack = w["t_" + st.role]
            y = expert_gemv.gathered_products(x_C[None], idx + st.layer, (stack,), interpret=interpret)[0][0]
        x = y.astype(jnp.bfloat16)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dims", type=int, nargs=4, metavar=("D", "A", "H", "F"),
                    help="the chain's widths (default Ling-3.0-tiny's); small ones keep the weights in L2")
    ap.add_argument("--depth", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--tk-max", type=int, nargs="+", default=[64, 256], help="widest weight tile (columns)")
    ap.add_argument("--max-split", type=int, default=24)
    ap.add_argument("--forms", nargs="+", default=["xla", "triton", "phased", "persistent"],
                    help="also `dataflow` (persistent, each program waiting only for the parts it reads) and "
                    "`unsynced` (persistent without waits: a diagnostic; its results are wrong)")
    ap.add_argument("--l2-ahead", type=int, nargs="+", default=[0],
                    help="tiles past the ring each program also prefetches into L2 (0: none)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="small widths, 2 layers, 1 program, the interpreter")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu" and not args.smoke
    dims = Dims(*args.dims) if args.dims else Dims(d=1024, a=512, h=512, f=512) if args.smoke else Dims()
    layers = args.layers if not args.smoke else 2
    programs = jax.devices()[0].core_count if gpu else 1
    depths, tk_maxes = (args.depth, args.tk_max) if not args.smoke else ([3], [64, 128])
    w = random_chain(jax.random.key(0), layers, dims)
    w = {k: v for k, v in w.items() if k.startswith("w_")}
    if "triton" in args.forms:
        w |= {"t_" + r: jnp.swapaxes(w[k], 1, 2) for r, k in WEIGHT.items()}
    plans = {t: plan(dims, layers, programs, t, args.max_split) for t in tk_maxes}  # the same splits for every t
    stages = plans[tk_maxes[0]]
    x = jax.random.normal(jax.random.key(1), (dims.d,), jnp.float32)
    x0 = jnp.zeros((ROW_GROUP, dims.d), jnp.bfloat16).at[0].set(x.astype(jnp.bfloat16))
    ref_final = jax.jit(functools.partial(chain_reference, stages=stages))(x0, w)[-1].astype(jnp.float32).sum(0)
    nbytes = sum(int(v.nbytes) for k, v in w.items() if k.startswith("w_"))
    bw = copy_bandwidth(2.0 if gpu else 0.01)
    result: dict[str, Any] = {**machine(), "dims": dataclasses.asdict(dims), "layers": layers, "programs": programs,
                              "splits": {st.role: st.split for st in stages[:4]}, "weight_bytes": nbytes,
                              "copy_GBps": bw / 1e9, "floor_us": nbytes / bw * 1e6, "runs": []}
    print(f"{layers} layers, {nbytes / 1e6:.1f} MB, floor {nbytes / bw * 1e6:.1f} us; splits {result['splits']}",
          flush=True)
    configs = [(f, {}) for f in ("xla", "triton") if f in args.forms]
    configs += [(f, {"depth": d, "tk_max": t, "l2_ahead": a}) for t in tk_maxes for d in depths
                for a in args.l2_ahead for f in ("phased", *FORM_SYNC) if f in args.forms]
    for form, cfg in configs:
        row: dict[str, Any] = {"form": form, **cfg}
        try:
            if form in ("xla", "triton"):
                fn = jax.jit(functools.partial(chain_plain, stages=stages, impl=form, interpret=not gpu))
                call = functools.partial(fn, x, w)
                row["rel_l2_final"] = rel_l2(call(), ref_final)
            else:
                chain_fn = chain_phased if form == "phased" else functools.partial(chain_mgpu, sync=FORM_SYNC[form])
                fn = jax.jit(functools.partial(chain_fn, stages=plans[cfg["tk_max"]], programs=programs,
                                               depth=cfg["depth"], l2_ahead=cfg["l2_ahead"], interpret=not gpu))
                call = functools.partial(fn, x0, w)
                outs = call()
                row["rel_l2_worst_stage"] = worst_stage_error(x0, outs, w, plans[cfg["tk_max"]])
                row["rel_l2_final"] = rel_l2(outs[-1].astype(jnp.float32).sum(0), ref_final)
            row["wall_us"] = median_time(call, reps=args.reps if gpu else 1, warmup=3 if gpu else 0) * 1e6
            prof = kernel_profile(call) if gpu else None
            if form not in ("xla", "triton"):
                # Again on an input no call has seen: a stage that read its input before the stage
                # before wrote it would find the last call's values there (same shapes, same buffers)
                # and match the check above by luck; here it cannot.
                x1 = jnp.zeros_like(x0).at[0].set(jax.random.normal(jax.random.key(2 + len(result["runs"])),
                                                                    (dims.d,), jnp.bfloat16))
                row["rel_l2_worst_stage_fresh"] = worst_stage_error(x1, fn(x1, w), w, plans[cfg["tk_max"]])
        except Exception as e:  # a configuration this GPU cannot run is a result, not the end of the run
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            prof = None
        if prof:
            row |= span_fields(prof, nbytes, bw, top=4)
        result["runs"].append(row)
        print_row(row)
        write_json(args.out, result)  # after every row: a run cut short keeps what it measured


if __name__ == "__main__":
    main()

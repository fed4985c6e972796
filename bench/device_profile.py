"""Where a jitted call's device time goes: a `jax.profiler` trace summarised per kernel.

    summary = device_profile(lambda: f(x), "/tmp/trace", calls=3)

Reads the trace's device plane (XLA's GPU trace has one line per CUDA stream, one event per
kernel or copy) through `jax.profiler.ProfileData`, so no TensorBoard/xprof is needed. The
summary tells a launch-bound program (device busy for a small share of the wall time, many short
kernels) from a bandwidth- or compute-bound one (busy ~ wall, a few long kernels).

With `hlo_dir` (by default the `--xla_dump_to` of XLA_FLAGS: run with
`XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"` to get the optimised HLO) each kernel is
traced back to the JAX op path its fusion came from (HLO metadata: the `jax.named_scope`s of the
model code, then the primitive), and the time is also summed per op path: which part of the model
costs what.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax


def _device_events(path: str, program: tuple[str, ...] = ("program_id",)) -> list[tuple[str, int, int, Any]]:
    """(name, start ns, end ns, program) of every event on the first accelerator plane's streams; the
    program is the first of the event's stats named in `program` that it has (`program_id`: the compiled
    module's id, an int; `hlo_module`: its name), None where it has none."""
    data = jax.profiler.ProfileData.from_file(path)
    planes = [p for p in data.planes if p.name.startswith("/device:") and "CPU" not in p.name]
    if not planes:
        return []
    events = []
    for line in planes[0].lines:
        if not line.name.lower().startswith("stream"):
            continue
        for e in line.events:
            stats = dict(e.stats)
            name = next((k for k in program if stats.get(k) is not None), None)
            prog = None if name is None else int(stats[name]) if name == "program_id" else stats[name]
            events.append((e.name, int(e.start_ns), int(e.end_ns), prog))
    return events


def _busy_ns(events: list[tuple[str, int, int, int | None]]) -> int:
    """Length of the union of the events' intervals (overlapping streams counted once)."""
    busy, end = 0, -1
    for _, s, e, _ in sorted(events, key=lambda x: x[1]):
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


_HLO_LINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}")


def hlo_op_paths(hlo_dir: str) -> dict[tuple[int, str], str]:
    """(module id, instruction name) -> its JAX op path (named scopes / primitive), from the optimised-HLO
    text dumps (`module_<id>.<name>...after_optimizations.txt`; the id is the trace's `program_id`, so
    equal fusion names in different compiled programs are told apart)."""
    out: dict[tuple[int, str], str] = {}
    for path in glob.glob(os.path.join(hlo_dir, "module_*after_optimizations.txt")):
        module = int(re.match(r"module_(\d+)", os.path.basename(path)).group(1))
        with open(path) as f:
            for line in f:
                m = _HLO_LINE.match(line)
                if not m:
                    continue
                op = re.search(r'op_name="([^"]*)"', m.group(2))
                if op:  # drop the jit(...) root and the loop plumbing, keep the named scopes and the op
                    parts = [q for q in op.group(1).split("/")[1:]
                             if q not in ("while", "body", "cond", "closed_call", "eval_jaxpr")]
                    out.setdefault((module, m.group(1).replace(".", "_")), "/".join(parts))  # kernels: "_" for "."
    return out


_COPY_HEAD = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \(?(\w+)\[([\d,]*)\]")
_COPY_OP = re.compile(r"[\s)}] ?(copy|copy-start)\((.*)$")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8}


def hlo_copies(hlo_dir: str, top: int = 15, module_re: str | None = None) -> list[dict[str, Any]]:
    """The largest `copy` / `copy-start` instructions of the optimised-HLO dumps (what XLA copies
    that the program did not ask for, e.g. a sliced operand of a custom call), per compiled module
    (`module_re` filters the module names): module, shape (a copy-start's copied value), MB, how
    many such instructions there are (not how often they run) and the operand text."""
    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in glob.glob(os.path.join(hlo_dir, "module_*after_optimizations.txt")):
        module = os.path.basename(path).split(".")[1]
        if module_re and not re.search(module_re, module):
            continue
        with open(path) as f:
            for line in f:
                head, op = _COPY_HEAD.match(line), _COPY_OP.search(line)
                if not head or not op:
                    continue
                dims = [int(d) for d in head.group(3).split(",") if d]
                mb = _BYTES.get(head.group(2), 4) * (math.prod(dims) if dims else 1) / 1e6
                operand = op.group(2).split(", metadata")[0][:160]
                key = (module, f"{head.group(2)}{dims}", re.sub(r"[.\d]+", "", operand))
                row = seen.setdefault(key, {"module": module, "shape": key[1], "MB": mb, "count": 0,
                                            "operand": operand})
                row["count"] += 1
    return sorted(seen.values(), key=lambda r: -r["MB"] * r["count"])[:top]


GAP_EDGES_S = (1e-4, 1e-3, 1e-2)


def timeline(events: list[tuple[str, int, int, Any]]) -> dict[str, Any]:
    """Where a traced stretch of serving went on the device: from `_device_events` (`trace_timeline`),
    the span (first kernel's start to last kernel's end), the busy time (union of the kernels'
    intervals) and the idle rest, seconds; the busy time and kernel count of each program (its module
    name, e.g. `jit_prefill_chunk`; "?" where the events carry none), most first; and the idle gaps
    between busy stretches by length (at least each of `GAP_EDGES_S`): how many and their seconds."""
    if not events:
        return {"span_s": 0.0, "busy_s": 0.0, "idle_s": 0.0, "by_program": [], "idle_gaps": []}
    ev = sorted(events, key=lambda x: x[1])
    per: dict[str, list[tuple[str, int, int, Any]]] = collections.defaultdict(list)
    busy, end, gaps = 0, ev[0][1], []
    for x in ev:
        per["?" if x[3] is None else str(x[3])].append(x)
        if x[1] > end:
            gaps.append(x[1] - end)
        if x[2] > end:
            busy += x[2] - max(x[1], end)
            end = x[2]
    span = end - ev[0][1]
    programs = sorted(((name, _busy_ns(xs), len(xs)) for name, xs in per.items()), key=lambda r: -r[1])
    return {"span_s": span / 1e9, "busy_s": busy / 1e9, "idle_s": (span - busy) / 1e9,
            "by_program": [{"program": name, "busy_s": b / 1e9, "kernels": n} for name, b, n in programs],
            "idle_gaps": [{"at_least_s": edge, "count": sum(g >= edge * 1e9 for g in gaps),
                           "total_s": sum(g for g in gaps if g >= edge * 1e9) / 1e9} for edge in GAP_EDGES_S]}


def _newest_trace(logdir: str) -> str:
    """The newest `*.xplane.pb` under `logdir` (what `jax.profiler` wrote last there)."""
    return sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)[-1]


def trace_timeline(logdir: str) -> dict[str, Any]:
    """`timeline` of the newest trace under `logdir` (`jax.profiler.trace(logdir)`), by module name (by
    module id where the trace names none)."""
    return timeline(_device_events(_newest_trace(logdir), ("hlo_module", "program_id")))


def _span_ns(events: list[tuple[str, int, int, Any]], calls: int) -> int:
    """Summed first-start-to-last-end spans of `calls` groups of kernels, split at the longest gaps."""
    if not events:
        return 0
    ev = sorted(events, key=lambda x: x[1])
    end, gaps = ev[0][2], []
    for i, (_, s, e, _) in enumerate(ev[1:], 1):
        gaps.append((s - end, i))
        end = max(end, e)
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[:calls - 1])
    total = 0
    for lo, hi in zip([0, *cuts], [*cuts, len(ev)], strict=True):
        total += max(e for _, _, e, _ in ev[lo:hi]) - ev[lo][1]
    return total


def device_profile(fn: Callable[[], Any], logdir: str, *, calls: int = 3, top: int = 25,
                   hlo_dir: str | None = None, copies_module_re: str | None = None,
                   sequence: int = 0) -> dict[str, Any]:
    """Traces `calls` synchronised calls of fn() (call it once before, to compile) and summarises them.

    Returns wall seconds per call, device busy seconds per call (union of kernel intervals), the
    device span per call (its first kernel's start to its last kernel's end; the calls are told
    apart by the `calls - 1` longest gaps between kernels, where the host waited), the number of
    kernels per call, and the `top` kernels by total time with their count and mean.
    With `sequence` > 0, also the first `sequence` kernels of the last call in launch order
    (name, microseconds, op path, gap in microseconds since the previous one ended): what one
    layer of a step launches, one kernel after another.
    """
    os.makedirs(logdir, exist_ok=True)
    jax.profiler.start_trace(logdir)
    t0 = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn())
    wall = (time.perf_counter() - t0) / calls
    jax.profiler.stop_trace()
    events = _device_events(_newest_trace(logdir))
    dumped = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    hlo_dir = hlo_dir or (dumped.group(1) if dumped else None)
    paths = hlo_op_paths(hlo_dir) if hlo_dir else {}
    per_name: dict[str, list[int]] = collections.defaultdict(list)
    name_path: dict[str, str] = {}
    per_path: dict[str, list[int]] = collections.defaultdict(list)
    for name, s, e, pid in events:
        per_name[name].append(e - s)
        path = paths.get((pid, name), "?") if pid is not None else "?"
        name_path.setdefault(name, path)
        per_path[path].append(e - s)
    last_call = sorted(events, key=lambda x: x[1])[-(len(events) // calls):][:sequence]
    ends = [last_call[0][1]] + [e for _, _, e, _ in last_call[:-1]] if last_call else []
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    path_rows = sorted(per_path.items(), key=lambda kv: -sum(kv[1]))
    return {
        "wall_s_per_call": wall,
        "device_busy_s_per_call": _busy_ns(events) / 1e9 / calls,
        "kernel_time_s_per_call": sum(e - s for _, s, e, _ in events) / 1e9 / calls,
        "span_s_per_call": _span_ns(events, calls) / 1e9 / calls,
        "kernels_per_call": len(events) / calls,
        "top_kernels": [{"name": n[:120], "op_path": name_path[n], "count_per_call": len(d) / calls,
                         "total_ms_per_call": sum(d) / 1e6 / calls, "mean_us": sum(d) / len(d) / 1e3}
                        for n, d in rows[:top]],
        "by_op_path": [{"name": n, "count_per_call": len(d) / calls, "total_ms_per_call": sum(d) / 1e6 / calls,
                            "mean_us": sum(d) / len(d) / 1e3} for n, d in path_rows[:top]] if paths else [],
        "hlo_copies": hlo_copies(hlo_dir, module_re=copies_module_re) if hlo_dir else [],
        "sequence": [{"name": n[:120], "us": (e - s) / 1e3, "gap_us": (s - end) / 1e3,
                      "op_path": paths.get((pid, n), "?") if pid is not None else "?"}
                     for (n, s, e, pid), end in zip(last_call, ends, strict=True)],
    }


def kernel_profile(fn: Callable[[], Any], logdir: str | None = None, calls: int = 3,
                   warmup: int = 3) -> dict[str, Any] | None:
    """`device_profile` of fn() after `warmup` calls (compile, clocks up), traced into `logdir`
    (default a temporary directory), or None where the trace has no kernels (no device plane: CPU)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    with contextlib.ExitStack() as stack:
        summary = device_profile(fn, logdir or stack.enter_context(tempfile.TemporaryDirectory()), calls=calls)
    return summary if summary["kernels_per_call"] else None


def span_fields(summary: dict[str, Any], nbytes: int, bandwidth: float, top: int = 25) -> dict[str, Any]:
    """A weight-stream benchmark's row from `kernel_profile`'s summary: device span and summed kernel
    time per call (us), GB/s over the span for `nbytes`, the span's ratio to nbytes at `bandwidth`
    (B/s), and the `top` kernels."""
    span = summary["span_s_per_call"]
    return {"span_us": span * 1e6, "kernel_sum_us": summary["kernel_time_s_per_call"] * 1e6,
            "kernels_per_call": summary["kernels_per_call"], "GBps": nbytes / span / 1e9,
            "x_floor": span / (nbytes / bandwidth),
            "top_kernels": [{k: r[k] for k in ("name", "count_per_call", "mean_us")}
                            for r in summary["top_kernels"][:top]]}


def print_row(row: dict[str, Any]) -> None:
    """One benchmark row as `key=value` pairs, without its kernel list."""
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                   if k != "top_kernels"), flush=True)


def print_profile(summary: dict[str, Any]) -> None:
    """The summary as a few readable lines."""
    wall, busy = summary["wall_s_per_call"], summary["device_busy_s_per_call"]
    print(f"  wall {wall * 1e3:.2f} ms/call, device busy {busy * 1e3:.2f} ms ({100 * busy / max(wall, 1e-12):.0f}%), "
          f"{summary['kernels_per_call']:.0f} kernels/call", flush=True)
    for r in summary["top_kernels"]:
        print(f"    {r['total_ms_per_call']:8.3f} ms  {r['count_per_call']:7.1f} x {r['mean_us']:8.1f} us  {r['name']}"
              f"  {r['op_path']}", flush=True)
    if summary["by_op_path"]:
        print("  by op path:", flush=True)
    for r in summary["by_op_path"]:
        print(f"    {r['total_ms_per_call']:8.3f} ms  {r['count_per_call']:7.1f} x {r['mean_us']:8.1f} us  {r['name']}",
              flush=True)
    if summary.get("hlo_copies"):
        print("  largest copies in the optimised HLO:", flush=True)
    for r in summary.get("hlo_copies", []):
        print(f"    {r['count']:4d} x {r['MB']:9.2f} MB  {r['shape']}  <- {r['operand'][:80]}  [{r['module']}]",
              flush=True)

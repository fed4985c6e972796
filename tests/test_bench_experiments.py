"""The decode probes of bench/experiments/: each runs on the CPU and computes what it claims (the
products, the barrier's spin loop, the persistent chains' plans), so their recorded measurements
stay reproducible."""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import rel_l2


@pytest.mark.heavy
@pytest.mark.parametrize("script,args", [("l2_window.py", ["--window-iters", "0", "10", "--fractions", "0.5", "1",
                                                           "--between-mb", "0", "1"]), ("normed_gemv.py", []),
                                         ("decode_sync.py", ["--steps", "4", "--group", "2", "--reps", "1"])])
def test_decode_probe_scripts_run(tmp_path, script, args):
    """The L2-window, normed-gemv and host-round-trip probes run on the CPU (`--smoke`) and check what
    they must: the prefetch (XLA's, or the window kernel's own, with or without weights read between)
    leaves the chain's result unchanged, the kernel's norm matches XLA's, and every decode loop form
    emits the same greedy tokens."""
    out = tmp_path / "out.json"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "bench" / "experiments" / script), "--smoke", *args, "--out", str(out)],
                   check=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    runs = json.loads(out.read_text())["runs"]
    checks = {"l2_window.py": "max_abs_diff_vs_serial", "normed_gemv.py": "rel_l2_vs_xla_norm",
              "decode_sync.py": "tokens_match_first_form"}[script]
    got = [r[checks] for r in runs if checks in r]
    assert got and len(runs) >= 3
    if script == "l2_window.py":
        assert sum("max_abs_diff_vs_serial" in r and r["form"] == "inkernel" for r in runs) == 8
    assert all(g is True for g in got) if script == "decode_sync.py" else all(g < 1e-2 for g in got), runs


@pytest.mark.heavy
def test_train_parts_runs(tmp_path):
    """bench/experiments/train_parts.py (the train step's first-call cost in parts) on the CPU: trace and
    lower, compile and steps timed, the loss finite."""
    import math

    out = tmp_path / "out.json"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "bench" / "experiments" / "train_parts.py"), "--smoke", "--out",
                    str(out)], check=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    r = json.loads(out.read_text())
    assert r["trace_lower_s"] > 0 and r["compile_s"] > 0 and r["stablehlo_chars"] > 0
    assert len(r["steps_s"]) == 2 and r["step_s"] == r["steps_s"][1] and math.isfinite(r["loss"])


@pytest.mark.heavy
def test_engine_calls_runs(tmp_path):
    """bench/experiments/engine_calls.py on the CPU (`--smoke`): the engine's prefill and decode calls
    (with output snapshots too) and decode_loop timed, so the probe follows the engine's call signatures."""
    out = tmp_path / "out.json"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "bench" / "experiments" / "engine_calls.py"), "--smoke",
                    "--output-snapshots", "--out", str(out)], check=True, timeout=600,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    r = json.loads(out.read_text())
    assert set(r["decode_call"]) == {"1", "8"} and r["prefill_call"] and r["batch_prefill"]
    assert r["decode_loop"]["ms_per_step"] > 0 and r["context"] == 16
    assert all(v["ms_per_step"] > 0 for v in r["decode_call_output_snapshots"].values())
    assert set(r["decode_call_output_snapshots"]) == {"none", "one"}


@pytest.mark.heavy
def test_compile_probe_runs(tmp_path):
    """bench/experiments/compile_probe.py on the CPU (`--smoke`): each call's compilations recorded; on the
    CPU a call compiled once compiles nothing again, in any thread, nor through the engine's thread."""
    out = tmp_path / "out.json"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "bench" / "experiments" / "compile_probe.py"), "--smoke", "--out",
                    str(out)], check=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    steps = {s["call"]: s["compiled"] for s in json.loads(out.read_text())["steps"]}
    assert steps["prefill"] == ["jit(prefill_chunk)"] and steps["decode 16 slots x 1"] == ["jit(decode_steps)"]
    assert all(not c for name, c in steps.items() if "again" in name or "after" in name or "thread" in name)


@pytest.mark.heavy
@pytest.mark.parametrize("prefix", [False, True])
def test_serve_loop_runs(tmp_path, prefix):
    """bench/experiments/serve_loop.py on the CPU (`--smoke`, with and without the prefix cache): the
    dispatch probe and the engine's timed rounds (8-step decode calls, each round's parts recorded), so
    the probe follows the engine's methods."""
    out = tmp_path / "out.json"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "bench" / "experiments" / "serve_loop.py"), "--smoke", "--requests",
                    "2", "--out", str(out), *["--prefix-cache"] * prefix], check=True, timeout=600,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    r = json.loads(out.read_text())
    assert r["prefix_cache"] == prefix and ("prefix_misses" in r["stats"]) == prefix
    assert set(r["dispatch_probe"]) == {f"{f}_{t}_ms" for f in ("dynamic", "static") for t in ("returns", "ready")}
    assert len(r["requests"]) == 2
    for q in r["requests"]:  # 24 new tokens: the first from the prefill, then 23 steps in calls of 8
        assert q["calls"] == 3 and q["steps_per_call"] == 8 and q["tpot_ms"] > 0
        assert all(q[k] > 0 for k in ("period_ms", "dispatch_ms", "wait_for_tokens_ms", "deliver_ms"))


@pytest.mark.parametrize(("depth", "unroll"), [(0, False), (2, False), (1, True)])
def test_persistent_chain_stages_match_the_reference(depth, unroll):
    """bench/experiments/persistent_layer.py's stage code (run one launch per stage: interpret mode cannot spin
    at a barrier) gives the float32 chain: 3 programs over odd block counts (clamped loads, idle
    programs in the last round) and several column tiles per row."""
    from bench.experiments.persistent_layer import Dims, chain_pallas, chain_xla, random_chain, tiling

    dims = Dims(d=64, a=192, h=64, f=96)
    p = random_chain(jax.random.key(0), 2, dims)
    x = jax.random.normal(jax.random.key(1), (dims.d,), jnp.float32)
    ref = chain_xla(x, p, dims, precision=jax.lax.Precision.HIGHEST)
    out = chain_pallas(x, p, dims, mode="phased", programs=3, tile_values=256, depth=depth, unroll=unroll,
                       interpret=True)
    assert rel_l2(out, ref) < 1e-5
    shapes = ((dims.a, dims.d), (dims.d, dims.h), (2 * dims.f, dims.d), (dims.d, dims.f))
    tiles = [tiling(o, c, 3, 256) for o, c in shapes]
    assert any(t.chunks > 1 for t in tiles) and any(t.blocks % 3 for t in tiles)  # what the case is meant to cover


def test_persistent_kernels_keep_their_spin_loop(h200_lowering, monkeypatch, capsys):
    """The barrier's spin loop survives lowering to Triton (its result feeds the acquiring atomic:
    a loop whose result is unused is dropped as dead code, and the barrier with it)."""
    import bench.experiments.persistent_layer as pl_bench

    monkeypatch.setattr(pl_bench.pl, "pallas_call", functools.partial(pl_bench.pl.pallas_call, debug=True))
    h200_lowering(lambda: pl_bench.barrier_check(8, rounds=2))
    printed = capsys.readouterr().out
    assert printed.count("scf.while") == 2 and "tt.atomic_rmw exch" in printed
    dims, sd = pl_bench.Dims(d=64, a=192, h=64, f=96), jax.ShapeDtypeStruct
    p = {k: sd(v.shape, v.dtype) for k, v in pl_bench.random_chain(jax.random.key(0), 2, dims).items()}
    h200_lowering(functools.partial(pl_bench.chain_pallas, dims=dims, mode="persistent", programs=8, interpret=False),
                  sd((dims.d,), jnp.float32), p)
    assert capsys.readouterr().out.count("scf.while") == len(pl_bench.STAGES)  # one per stage of the layer loop


def test_gemv_layout_mgpu_variant_is_the_product():
    """bench/experiments/gemv_layout.py's Mosaic-GPU variant (JAX's Hopper matmul on the row padded to 64 rows)
    gives x @ w, in the Mosaic-GPU interpreter on 4 simulated SMs."""
    from bench.experiments.gemv_layout import mgpu_gemv

    x = jax.random.normal(jax.random.key(0), (256,), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (256, 512), jnp.bfloat16) * 0.02
    out = mgpu_gemv(x, w, tile_n=64, tile_k=64, steps=4, interpret=True)
    assert rel_l2(out, x.astype(jnp.float32) @ w.astype(jnp.float32)) < 4e-3  # the output is bf16


@pytest.mark.parametrize(("split", "pdl"), [(1, "off"), (2, "launch")])
def test_pdl_chain_row_gemv_is_the_product(split, pdl):
    """bench/experiments/pdl_chain.py's Mosaic-GPU row gemv (w [O, C] by TMA through a 2-slot ring, x as wgmma's
    8-column operand) gives w @ x in the Mosaic-GPU interpreter: 3 ring steps per program (the
    refill path), 2 row blocks, C split in 1 and 2; column 0 holds the product, the rest zero."""
    from bench.experiments.pdl_chain import X_COLS, rows_gemv

    o, c = 128, 3 * 64 * split
    x = jax.random.normal(jax.random.key(0), (c,), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (o, c), jnp.bfloat16)
    x_8C = jnp.zeros((X_COLS, c), x.dtype).at[0].set(x)
    out = rows_gemv(x_8C, w, tk=64, depth=2, split=split, pdl=pdl, interpret=True)
    assert out.shape == (split, o, X_COLS)
    assert rel_l2(out[:, :, 0].sum(0), w.astype(jnp.float32) @ x.astype(jnp.float32)) < 1e-5
    assert not jnp.any(out[:, :, 1:])
    with pytest.raises(ValueError, match="multiple of"):
        rows_gemv(x_8C, w[:100], tk=64, split=split, interpret=True)  # O not a multiple of 64 rows


def test_pdl_chain_triton_row_gemv_is_the_product_and_waits(h200_lowering):
    """bench/experiments/pdl_chain.py's Pallas-Triton row gemv gives w @ x (interpret mode, C not a multiple of
    its 256-wide step), and lowered for the H200 it carries `griddepcontrol` only when asked to."""
    from bench.experiments.pdl_chain import triton_rows_gemv

    x = jax.random.normal(jax.random.key(0), (192,), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 192), jnp.bfloat16)
    out = triton_rows_gemv(x, w, pdl="launch", interpret=True)
    assert rel_l2(out, w.astype(jnp.float32) @ x.astype(jnp.float32)) < 1e-5
    sd = (jax.ShapeDtypeStruct((1536,), jnp.bfloat16), jax.ShapeDtypeStruct((256, 1536), jnp.bfloat16))
    lowered = {m: h200_lowering(functools.partial(triton_rows_gemv, pdl=m), *sd) for m in ("off", "wait", "launch")}
    assert "griddepcontrol" not in lowered["off"]
    assert "griddepcontrol.wait" in lowered["wait"] and "launch_dependents" not in lowered["wait"]
    assert "griddepcontrol.launch_dependents" in lowered["launch"]


def test_mgpu_persistent_plan_deals_every_item_once():
    """bench/experiments/mgpu_persistent.py's split choice: the most even deal of (part, block) items over the
    programs, parts a multiple of 64 columns; a program's run and the input columns it loads."""
    from bench.experiments.mgpu_persistent import (
        Dims,
        Stage,
        choose_split,
        for_each_signal,
        plan,
        python_loop,
        signal_targets,
    )

    assert choose_split(1536, 2048, 132, 64, 24) == 16  # 384 items: 3 rounds of 132 (2.9 on average)
    assert choose_split(1536, 4608, 132, 64, 24) == 24  # 8: 192 items would take 2 rounds for 1.45
    with pytest.raises(ValueError, match="no split"):
        choose_split(128, 96, 4, 64, 24)
    with pytest.raises(ValueError, match="multiple of 64"):
        choose_split(100, 512, 4, 64, 24)
    with pytest.raises(ValueError, match="reads 2048 values of an input of 1024"):
        plan(Dims(d=512, a=1024, h=2048, f=512), 1, 4)
    st = Stage("o", 0, o=640, c=1024, split=8, n=8, tk=128)
    runs = [st.run(p, 7) for p in range(7)]
    assert runs[0][0] == 0 and runs[-1][1] == st.items and all(a[1] == b[0] for a, b in itertools.pairwise(runs))
    assert {e - s for s, e in runs} <= {st.items // 7, st.items // 7 + 1}
    blocks = st.o // 64
    assert st.window(7) == max((e - 1) // blocks - s // blocks + 1 for s, e in runs)
    # The dataflow form's signals: over all programs, the runs signalled to each part of the next
    # stage's C hold every block of the stage before in its columns exactly once (a counter that
    # completed before that would let a stage read unwritten input), and their number is the target.
    for programs in (5, 7, 132):
        stages = plan(Dims(), 2, programs)
        for prev, st in itertools.pairwise(stages):
            written, signals = collections.defaultdict(list), collections.Counter()

            def emit(t, q, lo, hi, written=written, signals=signals):
                assert int(lo) < int(hi)
                written[int(q)] += [(int(t), b) for b in range(int(lo), int(hi))]
                signals[int(q)] += 1

            for p in range(programs):
                for_each_signal(prev, st, p, programs, python_loop, emit)
            per_part = st.part // 64
            assert {q: sorted(v) for q, v in written.items()} == {
                q: list(itertools.product(range(prev.split), range(q * per_part, (q + 1) * per_part)))
                for q in range(st.split)}
            assert signal_targets(prev, st, programs) == [signals[q] for q in range(st.split)]
            for p in range(programs):  # and a program waits for every part its items read
                start, end = st.run(p, programs)
                part0 = int(st.first_part(p, programs))
                assert {i // st.blocks for i in range(start, end)} <= set(range(part0, part0 + st.window(programs)))


@pytest.mark.parametrize(("form", "programs"), [("phased", 3), ("persistent", 1)])
def test_mgpu_persistent_chain_matches_the_reference(form, programs):
    """The Mosaic-GPU chain in the interpreter, one layer with tiles of 128 and 64 columns (two views
    of the ring): each stage's partial rows equal the float32 reference fed the same input.
    `persistent` with one program runs the weight ring across stage boundaries (the barrier itself
    needs every program resident: GPU only); `phased` with 3 programs covers runs and windows."""
    from bench.experiments.mgpu_persistent import (
        ROW_GROUP,
        Dims,
        chain_mgpu,
        chain_phased,
        plan,
        random_chain,
        worst_stage_error,
    )

    dims = Dims(d=1024, a=512, h=512, f=512)
    w = {k: v for k, v in random_chain(jax.random.key(0), 1, dims).items() if k.startswith("w_")}
    stages = plan(dims, 1, programs, tk_max=128)
    assert {st.tk for st in stages} == {64, 128}
    x0 = jnp.zeros((ROW_GROUP, dims.d), jnp.bfloat16).at[0].set(
        jax.random.normal(jax.random.key(1), (dims.d,), jnp.bfloat16))
    fn = chain_phased if form == "phased" else chain_mgpu
    outs = fn(x0, w, stages, programs=programs, depth=3, interpret=True)
    assert [o.shape for o in outs] == [(st.split, st.o) for st in stages]
    assert worst_stage_error(x0, outs, w, stages) < 1e-3


def test_makespan_bound(tmp_path):
    """bench/experiments/makespan.py: the longest slot's steps of requests taken in order by the first free
    slot, static batches' steps, and the bound they set on the engine against static `generate`."""
    from bench.experiments import makespan

    assert makespan.makespan([5, 5, 5, 5], 2) == 8 and makespan.makespan([9, 2, 2, 2, 2], 2) == 8
    assert makespan.makespan([3, 9], 4) == 8 and makespan.static_steps([9, 2, 2, 2, 2], 2) == 9 + 2 + 2
    out = tmp_path / "out.json"
    assert makespan.main(["--num-requests", "128", "--concurrency", "8", "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["runs"]
    assert r["perfectly_packed_steps"] <= r["engine_steps"] <= r["static_steps"]
    assert r["engine_s"] > r["engine_s_free_prefill"] and r["bound_vs_static"] < r["bound_vs_static_free_prefill"]

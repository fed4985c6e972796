"""The benchmark helpers whose output BENCHMARKS.md relies on: FP8-resident random params, the
profile's kernel -> op-path attribution and copy list, the decode benchmark's variants, and the
decode-kernel / prefill scripts."""

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

from bench.common import random_fp8_params, random_params
from bench.decode import parse_variant, patched
from bench.device_profile import hlo_copies, hlo_op_paths
from ling_jax.checkpoint.fp8 import BlockFP8, is_block_fp8
from ling_jax.config import LingConfig


@pytest.mark.heavy  # 20-70 s on 2 cores (default suite kept well under 20 min)
def test_random_fp8_params_follow_the_checkpoint_layout():
    """Layer linear weights become BlockFP8 (router, b_proj, embeddings stay dense) whose dequantized
    values are the bf16 random weights of the same seed, rounded to e4m3 (debug widths < 128: the
    scale grid has partial blocks)."""
    cfg = LingConfig.preset("debug")
    params = random_fp8_params(cfg, jnp.float32)
    dense = random_params(cfg, jnp.float32)
    seg = params["segments"][-1]
    moe = seg.get("mla", seg)["mlp"]
    assert isinstance(moe["gate_proj"], BlockFP8) and not isinstance(moe["router"], BlockFP8)
    assert not isinstance(params["embed"], BlockFP8) and not isinstance(params["lm_head"], BlockFP8)
    pairs = list(zip(jax.tree.leaves(params, is_leaf=is_block_fp8), jax.tree.leaves(dense), strict=True))
    fp8 = [(q, w) for q, w in pairs if isinstance(q, BlockFP8)]
    assert len(fp8) > 10
    for q, w in fp8:
        assert q.value.dtype == jnp.float8_e4m3fn and q.shape == w.shape
        err = rel_l2(q.dequantize(jnp.float32), w)
        assert 0 < err < 0.05, err  # e4m3 keeps 3 mantissa bits
    assert all(q is w or bool(jnp.array_equal(q, w)) for q, w in pairs if not isinstance(q, BlockFP8))


def test_hlo_op_paths_name_the_named_scopes(tmp_path):
    """Compiled instructions map back to the `jax.named_scope` path they came from (a fresh process:
    XLA reads its dump flags once, at start)."""
    code = ("import jax, jax.numpy as jnp\n"
            "def f(x):\n"
            "    with jax.named_scope('outer'), jax.named_scope('inner'):\n"
            "        return jnp.sin(x) * 3.0\n"
            "jax.block_until_ready(jax.jit(f)(jnp.arange(17.0)))\n")
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text",
           "JAX_ENABLE_COMPILATION_CACHE": "false", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    paths = hlo_op_paths(str(tmp_path))
    assert any(p.startswith("outer/inner/") for p in paths.values()), paths


def test_hlo_copies_lists_the_largest_copies(tmp_path):
    """Copies (and copy-starts, whose result is a tuple) in optimised-HLO dumps are grouped by module,
    shape and operand, sorted by bytes, and filtered by module name."""
    (tmp_path / "module_0007.jit_step.sm_9.0_gpu_after_optimizations.txt").write_text(
        "  %slice.3 = bf16[128,1536,512]{2,1,0} slice(bf16[4,128,1536,512]{3,2,1,0} %p.1), slice={[1:2]}\n"
        "  %copy.1 = bf16[128,1536,512]{2,1,0} copy(bf16[128,1536,512]{2,1,0} %slice.3), metadata={op_name=\"a\"}\n"
        "  %copy.2 = bf16[128,1536,512]{2,1,0} copy(bf16[128,1536,512]{2,1,0} %slice.4)\n"
        "  %copy-start.5 = (f32[16,128]{1,0}, f32[16,128]{1,0}, u32[]) copy-start(f32[16,128]{1,0} %x.2)\n"
        "  %fusion.9 = f32[16,128]{1,0} fusion(f32[16,128]{1,0} %copy.1), kind=kLoop\n")
    (tmp_path / "module_0009.jit_other.sm_9.0_gpu_after_optimizations.txt").write_text(
        "  ROOT %copy.7 = f32[4]{0} copy(f32[4]{0} %y)\n")
    rows = hlo_copies(str(tmp_path), module_re="step")
    assert [(r["module"], r["shape"], r["count"]) for r in rows] == [
        ("jit_step", "bf16[128, 1536, 512]", 2), ("jit_step", "f32[16, 128]", 1)]
    assert rows[0]["MB"] == 128 * 1536 * 512 * 2 / 1e6 and "%slice.3" in rows[0]["operand"]
    assert {r["module"] for r in hlo_copies(str(tmp_path))} == {"jit_step", "jit_other"}


def test_decode_variants_patch_module_constants():
    """`bench/decode.py --variant NAME:module.ATTR=VALUE,...`: parsed to patches that hold inside
    `patched` only; malformed specs and unknown attributes stop the run before any timing."""
    from ling_jax.ops import expert_gemv

    name, patches = parse_variant("narrow:ling_jax.ops.expert_gemv.MAX_BC=32, ling_jax.ops.expert_gemv.NUM_WARPS=8")
    assert name == "narrow" and patches == {("ling_jax.ops.expert_gemv", "MAX_BC"): 32,
                                            ("ling_jax.ops.expert_gemv", "NUM_WARPS"): 8}
    before = expert_gemv.MAX_BC, expert_gemv.NUM_WARPS
    with patched(patches):
        assert (expert_gemv.MAX_BC, expert_gemv.NUM_WARPS) == (32, 8)
    assert before == (expert_gemv.MAX_BC, expert_gemv.NUM_WARPS)
    for bad in ("no_colon_here", ":ling_jax.ops.expert_gemv.MAX_BC=32", "x:MAX_BC=32",
                "x:ling_jax.ops.expert_gemv.MAX_BC", "x:ling_jax.ops.expert_gemv.NOT_THERE=1"):
        with pytest.raises(SystemExit):
            parse_variant(bad)


@pytest.mark.heavy
@pytest.mark.parametrize("script", ["decode_kernels.py", "prefill_mla.py"])
def test_bench_scripts_run(tmp_path, script):
    """The decode-kernel and prefill benchmarks run end to end on the CPU (`--smoke`: debug preset,
    interpret mode) and agree with their XLA references there."""
    out = tmp_path / "out.json"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "bench" / script), "--smoke", "--out", str(out)],
                   check=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) >= 2
    for r in runs:
        diffs = [v for k, v in r.items() if k.startswith("rel_l2")]
        flat = [x for d in diffs for x in (d.values() if isinstance(d, dict) else [d])]
        assert flat and all(x < 1e-2 for x in flat), r


@pytest.mark.heavy
@pytest.mark.parametrize("script,args", [("l2_window.py", ["--window-iters", "0", "10", "--fractions", "0.5", "1",
                                                           "--between-mb", "0", "1"]), ("normed_gemv.py", []),
                                         ("decode_sync.py", ["--steps", "4", "--group", "2", "--reps", "1"])])
def test_decode_probe_scripts_run(tmp_path, script, args):
    """The twenty-first session's decode probes run on the CPU (`--smoke`) and check what they must:
    the prefetch (XLA's, or the window kernel's own, with or without weights read between) leaves the
    chain's result unchanged, the kernel's norm matches XLA's, and every decode loop form emits the
    same greedy tokens."""
    out = tmp_path / "out.json"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "bench" / script), "--smoke", *args, "--out", str(out)],
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
def test_kda_bench_runs(tmp_path):
    """bench/kda.py on the CPU (interpret mode, tiny shapes, no FLA): the per-launch timings with every
    sweep option, and the end-to-end run with its GPU-style checks against the reference at the default
    chunk and at chunk 32, and a --variant; the public call's row ("api")."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    tiny = ["--heads", "1", "--seq", "128", "--dk", "32"]
    subprocess.run([sys.executable, str(root / "bench" / "kda.py"), "--per-kernel", *tiny, "--chunk", "32",
                    "--block-k", "16", "--warps", "default", "2", "--block-v", "16", "--unfused",
                    "--state-warps", "default", "2", "--state-stages", "default", "1",
                    "--out", str(tmp_path)], check=True, timeout=900, env=env)
    res = json.loads((tmp_path / "kda_per_kernel.json").read_text())["H1"]
    for name in ("fwd_pairs", "bwd_pairs", "fwd_pairs_bk16_w2", "fwd_state_bv16", "bwd_pairs_nogate_nonorm",
                 "fwd_state_w2_s1", "bwd_state_s1"):
        assert res[f"{name}_ms"] > 0, name
    subprocess.run([sys.executable, str(root / "bench" / "kda.py"), *tiny, "--check-seq", "40", "--no-fla",
                    "--no-chunked", "--chunks", "32", "--copy-gib", "0.01", "--mm", "128",
                    "--variant", 'chunk32_bv16={"chunk_size": 32, "block_v": 16}', "--profile", str(tmp_path / "prof"),
                    "--out", str(tmp_path)], check=True, timeout=900, env=env)
    report = json.loads((tmp_path / "kda_bench.json").read_text())
    checks = report["checks_vs_reference"]
    assert not [k for k in checks if k.endswith("error")], checks
    exact = {k: v for k, v in checks.items() if "bf16" not in k}  # fp32 forward and gradients
    assert len(exact) == 20 and all(v < 1e-4 for v in exact.values()), exact  # 2 chunk sizes x 10
    assert all(v < 1e-2 for k, v in checks.items() if "bf16" in k), checks
    assert {"H1_default", "H1_api", "H1_chunk32", "H1_chunk32_bv16"} <= set(report["results"])
    # traced (the CPU trace has no device plane: the per-launch table itself fills only on a GPU)
    assert {"device_busy_ms", "kernels"} <= set(report["results"]["H1_chunk32"]["fwdbwd_profile"])
    assert list((tmp_path / "prof" / "H1_chunk32_fwdbwd").rglob("*.xplane.pb"))


def test_kda_bench_archives_triton_autotuning(tmp_path, monkeypatch):
    """bench/kda.py hands FLA's autotuning results back as one archive (the device tool returns a
    limited number of files) that restores the cache's layout; nothing without TRITON_CACHE_DIR."""
    import tarfile

    from bench.kda import save_autotune

    cache = tmp_path / "cache"
    for key, name in (("AAA", "l2norm_fwd_kernel"), ("BBB", "chunk_kda_bwd_kernel_intra")):
        (cache / key).mkdir(parents=True)
        (cache / key / f"{name}.autotune.json").write_text(json.dumps({"key": key}))
        (cache / key / f"{name}.cubin").write_bytes(b"\0")  # compiled kernels are not archived
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    save_autotune(tmp_path / "none")
    assert not (tmp_path / "none").exists()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    save_autotune(tmp_path / "out")
    with tarfile.open(tmp_path / "out" / "triton_autotune.tgz") as tar:
        assert sorted(tar.getnames()) == ["AAA/l2norm_fwd_kernel.autotune.json",
                                          "BBB/chunk_kda_bwd_kernel_intra.autotune.json"]
        tar.extractall(tmp_path / "restored", filter="data")
    assert json.loads((tmp_path / "restored" / "BBB" / "chunk_kda_bwd_kernel_intra.autotune.json").read_text()) == {
        "key": "BBB"}


@pytest.mark.parametrize(("depth", "unroll"), [(0, False), (2, False), (1, True)])
def test_persistent_chain_stages_match_the_reference(depth, unroll):
    """bench/persistent_layer.py's stage code (run one launch per stage: interpret mode cannot spin
    at a barrier) gives the float32 chain: 3 programs over odd block counts (clamped loads, idle
    programs in the last round) and several column tiles per row."""
    from bench.persistent_layer import Dims, chain_pallas, chain_xla, random_chain, tiling

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
    import bench.persistent_layer as pl_bench

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
    """bench/gemv_layout.py's Mosaic-GPU variant (JAX's Hopper matmul on the row padded to 64 rows)
    gives x @ w, in the Mosaic-GPU interpreter on 4 simulated SMs."""
    from bench.gemv_layout import mgpu_gemv

    x = jax.random.normal(jax.random.key(0), (256,), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (256, 512), jnp.bfloat16) * 0.02
    out = mgpu_gemv(x, w, tile_n=64, tile_k=64, steps=4, interpret=True)
    assert rel_l2(out, x.astype(jnp.float32) @ w.astype(jnp.float32)) < 4e-3  # the output is bf16


@pytest.mark.parametrize(("split", "pdl"), [(1, "off"), (2, "launch")])
def test_pdl_chain_row_gemv_is_the_product(split, pdl):
    """bench/pdl_chain.py's Mosaic-GPU row gemv (w [O, C] by TMA through a 2-slot ring, x as wgmma's
    8-column operand) gives w @ x in the Mosaic-GPU interpreter: 3 ring steps per program (the
    refill path), 2 row blocks, C split in 1 and 2; column 0 holds the product, the rest zero."""
    from bench.pdl_chain import X_COLS, rows_gemv

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


def test_device_profile_span_splits_calls_at_the_longest_gaps():
    """The per-call span (first start to last end, calls told apart by the host's waits) counts the
    gaps between one call's kernels and overlapping kernels once."""
    from bench.device_profile import _span_ns

    call = [("a", 0, 10, None), ("b", 12, 20, None), ("c", 15, 18, None)]  # c inside b: span 20
    events = [(n, s + t, e + t, p) for t in (0, 1000, 5000) for n, s, e, p in call]
    assert _span_ns(events, 3) == 60
    assert _span_ns(events, 1) == 5020


def test_pdl_chain_triton_row_gemv_is_the_product_and_waits(h200_lowering):
    """bench/pdl_chain.py's Pallas-Triton row gemv gives w @ x (interpret mode, C not a multiple of
    its 256-wide step), and lowered for the H200 it carries `griddepcontrol` only when asked to."""
    from bench.pdl_chain import triton_rows_gemv

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
    """bench/mgpu_persistent.py's split choice: the most even deal of (part, block) items over the
    programs, parts a multiple of 64 columns; a program's run and the input columns it loads."""
    from bench.mgpu_persistent import Dims, Stage, choose_split, for_each_signal, plan, python_loop, signal_targets

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
    from bench.mgpu_persistent import ROW_GROUP, Dims, chain_mgpu, chain_phased, plan, random_chain, worst_stage_error

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


def test_span_fields_rate_the_span_against_the_floor():
    """The weight-stream row: GB/s and the ratio to the floor come from the span, not the summed kernels."""
    from bench.device_profile import span_fields

    kernels = [{"name": f"k{i}", "count_per_call": 1.0, "mean_us": 1.0, "op_path": ""} for i in range(3)]
    summary = {"span_s_per_call": 2e-6, "kernel_time_s_per_call": 3e-6, "kernels_per_call": 3.0, "top_kernels": kernels}
    row = span_fields(summary, nbytes=4000, bandwidth=4e9, top=2)
    assert row["span_us"] == pytest.approx(2.0) and row["kernel_sum_us"] == pytest.approx(3.0)
    assert row["GBps"] == pytest.approx(2.0) and row["x_floor"] == pytest.approx(2.0)  # floor 1 us
    assert [k["name"] for k in row["top_kernels"]] == ["k0", "k1"] and "op_path" not in row["top_kernels"][0]


def test_step_budget_cuts_one_step_and_sets_the_gemvs_against_their_floor():
    """One step: from the first gemv after the longest gap (not the sampling launches between) up to
    that kernel's next launch, sampling and cache writes included wherever they run; its longest XLA
    launch is the lm_head (not a longer Pallas kernel); launches summed by kind; the bounds from
    the run's floor. A sequence that ends inside the step is refused."""
    from bench.step_budget import budget

    cfg = LingConfig.preset("debug")
    lm_head_bytes = 2 * cfg.vocab_size * cfg.hidden_size
    seq = [("loop_pad_fusion", 300.0, 0.0), ("loop_dynamic_update_slice_fusion", 1.0, 900.0),  # setup; the gap
           ("input_reduce_fusion", 1.0, 0.0), ("expert_gemv", 10.0, 0.0),  # sampling, then the step
           ("loop_convert_fusion_14", 1.0, 0.0), ("kda_decode_layer__2", 4.0, 0.0),
           ("expert_gemv__16", 5.0, 0.0), ("latent_attention__1", 200.0, 0.0), ("route_select__3", 3.0, 0.0),
           ("gemm_fusion_dot_44", 100.0, 0.0), ("input_reduce_select_fusion", 2.0, 0.0),  # lm_head, sampling
           ("expert_gemv", 10.0, 0.0), ("loop_convert_fusion_14", 1.0, 0.0)]  # the next step
    run = {"batch": 1, "context": 1024, "hbm_floor_ms": 0.2,
           "bytes_per_step": {"weights": lm_head_bytes + 10e6}, "profile": {"ms_per_step_busy": 0.3, "sequence": [
               {"name": n, "us": us, "gap_us": gap} for n, us, gap in seq]}}
    b = budget(run, "debug", bandwidth_gbps=1000.0)  # 1e9 bytes/ms: the gemvs' 10 MB take 10 us at the floor
    assert b["launches"] == 8 and b["lm_head_us"] == 100.0
    assert b["by_kind"] == {"latent_attention": {"launches": 1, "us": 200.0},
                            "expert_gemv": {"launches": 2, "us": 15.0},
                            "kda_decode_layer": {"launches": 1, "us": 4.0},
                            "route_select": {"launches": 1, "us": 3.0}, "xla": {"launches": 2, "us": 3.0}}
    assert b["gemv_floor_us"] == pytest.approx(10.0) and b["gemv_x_floor"] == pytest.approx(1.5)
    assert b["launch_time_us"] == pytest.approx(325.0) and b["launches_x_floor"] == pytest.approx(325 / 200)
    assert b["gemvs_at_floor_x"] == pytest.approx(320 / 200)
    assert b["only_weight_reads_x"] == pytest.approx(115 / 200)
    run["profile"]["sequence"] = run["profile"]["sequence"][:-2]
    with pytest.raises(ValueError, match="profile a longer one"):
        budget(run, "debug", bandwidth_gbps=1000.0)

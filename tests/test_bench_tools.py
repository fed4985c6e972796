"""The benchmark helpers whose output BENCHMARKS.md relies on: FP8-resident random params, the
profile's kernel -> op-path attribution, copy list and spans, the decode benchmark's variants, the
step budget, and the decode-kernel / prefill / KDA scripts."""

from __future__ import annotations

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
from bench.decode import parse_variant
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


def test_decode_variants_override_the_tuned_table():
    """`bench/decode.py --variant NAME:FIELD=VALUE,...`: parsed to overrides of the tuned table that the
    records `kernels.select` returns inside `tuned` carry; malformed specs and unknown fields stop the
    run before any timing."""
    from ling_jax.config import LingConfig
    from ling_jax.kernels import select, tuned

    name, fields = parse_variant("narrow:gemv_programs=132, prefetch_shared=False")
    assert name == "narrow" and fields == {"gemv_programs": 132, "prefetch_shared": False}
    cfg = LingConfig.preset("debug")
    with tuned(**fields):
        k = select(cfg, dtype=jnp.bfloat16)
    assert k.tuning.launch.gemv_programs == 132 and not k.tuning.prefetch_shared
    for bad in ("no_colon_here", ":gemv_programs=32", "x:gemv_programs", "x:NOT_THERE=1"):
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
def test_decode_bench_speculative_runs(tmp_path):
    """`bench/decode.py --speculative-tokens 2` on the CPU (`--smoke`): the one-token step, the verify step
    of 3 positions and the 2 drafts timed at every batch and context, with their ratios."""
    out = tmp_path / "out.json"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "bench" / "decode.py"), "--smoke", "--speculative-tokens", "2",
                    "--out", str(out)], check=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    runs = json.loads(out.read_text())["runs"]
    assert [(r["batch"], r["context"]) for r in runs] == [(1, 64), (1, 300), (4, 64), (4, 300)]
    for r in runs:
        assert r["speculative_tokens"] == 2 and min(r["one_token_step_ms"], r["verify_step_ms"], r["drafts_ms"]) > 0
        assert r["verify_over_one_token"] == pytest.approx(r["verify_step_ms"] / r["one_token_step_ms"])
        assert r["breakeven_accepted_length"] == pytest.approx(
            (r["verify_step_ms"] + r["drafts_ms"]) / r["one_token_step_ms"])


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


def test_device_profile_span_splits_calls_at_the_longest_gaps():
    """The per-call span (first start to last end, calls told apart by the host's waits) counts the
    gaps between one call's kernels and overlapping kernels once."""
    from bench.device_profile import _span_ns

    call = [("a", 0, 10, None), ("b", 12, 20, None), ("c", 15, 18, None)]  # c inside b: span 20
    events = [(n, s + t, e + t, p) for t in (0, 1000, 5000) for n, s, e, p in call]
    assert _span_ns(events, 3) == 60
    assert _span_ns(events, 1) == 5020


def test_timeline_splits_the_span_into_programs_and_idle_gaps():
    """Busy time is the union of the kernels (overlaps once), per program too; the idle gaps between busy
    stretches are counted by length; kernels without a program go under "?"."""
    from bench.device_profile import timeline

    ms = 1_000_000
    events = [("k", 0, 2 * ms, "jit_decode"), ("k", 1 * ms, 3 * ms, "jit_decode"),  # overlap: busy 3 ms
              ("k", 3 * ms + 50_000, 13 * ms, "jit_prefill"),  # after a 0.05 ms gap
              ("k", 15 * ms, 16 * ms, None),  # after 2 ms
              ("k", 16 * ms + 500_000, 17 * ms, "jit_decode")]  # after 0.5 ms
    t = timeline(events)
    assert t["span_s"] == pytest.approx(17e-3) and t["busy_s"] == pytest.approx(14.45e-3)
    assert t["idle_s"] == pytest.approx(2.55e-3)
    assert [(p["program"], p["kernels"]) for p in t["by_program"]] == [("jit_prefill", 1), ("jit_decode", 3),
                                                                       ("?", 1)]
    assert [p["busy_s"] for p in t["by_program"]] == pytest.approx([9.95e-3, 3.5e-3, 1e-3])
    assert [(g["at_least_s"], g["count"]) for g in t["idle_gaps"]] == [(1e-4, 2), (1e-3, 1), (1e-2, 0)]
    assert [g["total_s"] for g in t["idle_gaps"]] == pytest.approx([2.5e-3, 2e-3, 0.0])
    assert timeline([])["busy_s"] == 0.0


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

"""bench/serve.py on CPU: an in-process engine (the engine under test) against static generate
batches, a running server under Poisson arrivals, the prefix-cache workloads (shared prefix,
multi-turn conversations, cache on against off), the decode step timing, and its argument checks."""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import pytest

from bench.serve import against_warmup, main, make_conversations, make_requests, traced
from ling_jax.engine import Engine
from tests.serve.harness import make_engine, serve

pytest_plugins = ["tests.serve.fixtures"]  # the fixtures: model, tokenizer, servers


@pytest.mark.heavy  # a benchmark tool's run (default suite kept well under 20 min on 2 cores)
def test_in_process_engine_against_static(tmp_path):
    out = tmp_path / "r.json"
    assert main(["--preset", "debug", "--random-weights", "--dtype", "float32", "--num-requests", "4",
                 "--concurrency", "2", "--prompt-len", "4:12", "--output-len", "2:6", "--static", "--scan-layers",
                 "--prefill-rows", "2", "--compare-prefill-rows", "1", "--decode-buckets", "1",
                 "--also-concurrency", "1:3", "--profile", str(tmp_path / "trace"), "--out", str(out)],
                engine_cls=Engine) == 0
    r = json.loads(out.read_text())
    for name in ("engine", "engine_prefill_rows_1", "engine_concurrency_1"):  # a trace of each run; no device plane
        assert list((tmp_path / "trace" / name).rglob("*.xplane.pb"))
        assert r[name]["device_timeline"] == {"span_s": 0.0, "busy_s": 0.0, "idle_s": 0.0, "by_program": [],
                                              "idle_gaps": []}
    want = sum(q.max_tokens for q in make_requests(4, (4, 12), (2, 6), 512, 0))
    assert r["engine"]["output_tokens"] == r["static"]["output_tokens"] == want
    # the same requests with one prompt per prefill call: a call for each prompt's chunk
    one = r["engine_prefill_rows_1"]
    assert one["output_tokens"] == want and one["stats"]["prefill_calls_total"] == 4
    assert r["engine"]["stats"]["prefill_calls_total"] <= 4
    assert set(r["prefill_rows_2_vs_1"]) == {"ttft_p50", "output_tokens_per_s", "total_tokens_per_s"}
    assert r["engine"]["requests"] == r["static"]["requests"] == 4
    assert r["static"]["generated_tokens"] >= want and r["output_tokens_per_s_vs_static"] > 0
    for key in ("request_throughput", "output_tokens_per_s", "total_tokens_per_s"):
        assert r["engine"][key] > 0 and r["static"][key] > 0
    assert r["engine"]["ttft_s"]["p50"] > 0 and r["engine"]["tpot_s"]["p99"] >= r["engine"]["tpot_s"]["p50"] > 0
    assert r["static"]["tpot_s"]["p50"] is None
    assert r["device"] and r["jax"] and r["date"] and r["command"] and "git" in r
    assert r["engine"]["stats"]["generation_tokens_total"] == want
    for name in ("engine", "engine_prefill_rows_1", "engine_concurrency_1"):
        assert r[name]["compiles_during_run_s"] == r[name]["compiled_during_run"] == []  # warm-up compiled all
    slow = r["engine"]["slowest_ttft"]
    assert len(slow) == 4 and slow[0]["ttft_s"] >= r["engine"]["ttft_s"]["p99"] >= slow[-1]["ttft_s"] > 0
    assert all(s["start_s"] >= 0 and 4 <= s["prompt_tokens"] < 12 for s in slow)
    # the first 3 requests again, one at a time, on the same engine options (decode bucket 1 of 2 slots)
    c1 = r["engine_concurrency_1"]
    assert c1["requests"] == 3 and c1["max_batch"] == 2
    assert c1["output_tokens"] == sum(q.max_tokens for q in make_requests(4, (4, 12), (2, 6), 512, 0)[:3])


@pytest.mark.heavy  # a benchmark tool's run (default suite kept well under 20 min on 2 cores)
def test_a_compile_during_the_run_is_timed_and_named(tmp_path):
    """A program first compiled while requests run (here: by the engine's submit, for a shape its warm-up
    did not compile) shows in the run's compile times and in `compiled_during_run`, with where its
    compilation differs from the warm-up's."""
    tripled = jax.jit(lambda x: x * 3)

    class Compiling(Engine):
        def warmup(self, **kwargs):
            tripled(np.ones(5, np.float32))
            super().warmup(**kwargs)

        def submit(self, *args, **kwargs):
            tripled(np.ones(7, np.float32))
            return super().submit(*args, **kwargs)

    out = tmp_path / "r.json"
    assert main(["--preset", "debug", "--random-weights", "--dtype", "float32", "--num-requests", "2",
                 "--concurrency", "1", "--prompt-len", "4:6", "--output-len", "2:3", "--out", str(out)],
                engine_cls=Compiling) == 0
    r = json.loads(out.read_text())["engine"]
    assert len(r["compiles_during_run_s"]) == 1 and r["compiles_during_run_s"][0] > 0
    (c,) = r["compiled_during_run"]
    assert c["function"] == "jit(<lambda>)" and "float32[7]" in c["head"]
    diff = c["differs_from_warmup"]  # 40 characters before the first difference, then the rest
    assert diff["warmup"][40:].startswith("5]),)") and diff["run"][40:].startswith("7]),)")


def test_against_warmup_finds_the_first_difference():
    warm = ["Compiling jit(f) with global shapes and types (ShapedArray(int32[4]),). Argument mapping: (A,).",
            "Compiling jit(f) with global shapes and types (ShapedArray(int32[8]),). Argument mapping: (B,).",
            "Compiling jit(g) with global shapes and types (ShapedArray(int32[8]),). Argument mapping: (C,)."]
    run = "Compiling jit(f) with global shapes and types (ShapedArray(int32[8]),). Argument mapping: (D,)."
    c = against_warmup(run, warm, context=3)
    assert c["function"] == "jit(f)" and c["head"] == run
    i = run.index("(D")
    assert c["differs_from_warmup"] == {"at": i + 1, "warmup": run[i - 39:i + 1] + "B,)", "run": run[i - 39:i + 4]}
    assert against_warmup(run.replace("jit(f)", "jit(h)"), warm)["differs_from_warmup"] is None


def test_server_under_poisson_arrivals(tmp_path, model):
    engine = make_engine(model, max_batch=2, max_len=64)
    with serve(engine, model_name="m", api_key="k") as s:
        out = tmp_path / "r.json"
        assert main(["--url", s.url, "--api-key", "k", "--model", "m", "--vocab-size", "512", "--num-requests", "5",
                     "--rate", "40", "--prompt-len", "3:9", "--output-len", "1:5", "--out", str(out)]) == 0
    engine.shutdown(0.0)
    r = json.loads(out.read_text())
    assert r["server"]["output_tokens"] == sum(q.max_tokens for q in make_requests(5, (3, 9), (1, 5), 512, 0))
    assert r["load"] == {"rate": 40.0, "prompt_len": [3, 9], "output_len": [1, 5]}


def _prompt_tokens(convs) -> int:
    """Prompt tokens sent for the conversations: each turn's prompt holds every earlier turn's tokens and
    output (each request generates exactly its max_tokens) and its own."""
    total = 0
    for conv in convs:
        history = 0
        for turn in conv:
            total += history + len(turn.prompt)
            history += len(turn.prompt) + turn.max_tokens
    return total


@pytest.mark.heavy  # a benchmark tool's run (default suite kept well under 20 min on 2 cores)
def test_multi_turn_shared_prefix_cache_on_against_off(tmp_path):
    """Conversations of 3 turns whose first prompts share 8 tokens, with the prefix cache on and then
    off in one run: every turn is sent with the conversation so far, the cache serves part of the
    prompts (hit rate = cached / prompt tokens) and none with it off."""
    out = tmp_path / "r.json"
    assert main(["--preset", "debug", "--random-weights", "--dtype", "float32", "--num-requests", "3",
                 "--concurrency", "2", "--multi-turn", "3", "--shared-prefix", "8", "--prompt-len", "4:8",
                 "--output-len", "2:5", "--page-size", "4", "--prefill-chunk", "16", "--compare-prefix-cache",
                 "--out", str(out)], engine_cls=Engine) == 0
    r = json.loads(out.read_text())
    convs = make_conversations(3, (4, 8), (2, 5), 512, 0, shared_prefix=8, turns=3)
    assert len({tuple(c[0].prompt[:8]) for c in convs}) == 1 and len({tuple(c[0].prompt) for c in convs}) == 3
    on, off = r["engine"], r["engine_no_prefix_cache"]
    for run in (on, off):
        assert run["requests"] == 9 and run["prompt_tokens"] == _prompt_tokens(convs)
        assert run["output_tokens"] == sum(t.max_tokens for c in convs for t in c)
        assert run["ttft_s"]["p99"] >= run["ttft_s"]["p50"] > 0
    assert on["prefix"]["cached_prompt_tokens"] == on["stats"]["prefix_cached_tokens"] > 0
    assert on["prefix"]["hit_rate"] == on["prefix"]["cached_prompt_tokens"] / on["prompt_tokens"]
    assert on["prefix"]["requests_with_hit"] >= 6  # every later turn reads its conversation's earlier prompt
    assert off["prefix"] == {"cached_prompt_tokens": 0, "requests_with_hit": 0, "hit_rate": 0.0}
    assert "prefix_hits" not in off["stats"]
    assert set(r["prefix_cache_vs_off"]) == {"ttft_p50", "ttft_p99", "output_tokens_per_s", "total_tokens_per_s"}
    assert r["load"]["shared_prefix"] == 8 and r["load"]["turns"] == 3


def test_shared_prefix_through_the_server(tmp_path, server):
    """--shared-prefix against a running server with its prefix cache: the cached prompt tokens come from
    the streamed usage; every request after the first reads the shared 12 tokens."""
    out = tmp_path / "r.json"
    assert main(["--url", server.url, "--vocab-size", "512", "--num-requests", "4", "--concurrency", "1",
                 "--shared-prefix", "12", "--prompt-len", "2:5", "--output-len", "1:3", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["server"]
    assert r["prompt_tokens"] == sum(len(c[0].prompt) for c in make_conversations(4, (2, 5), (1, 3), 512, 0,
                                                                                   shared_prefix=12))
    assert r["prefix"]["cached_prompt_tokens"] >= 3 * 12 and r["prefix"]["requests_with_hit"] >= 3


@pytest.mark.heavy  # a benchmark tool's run (default suite kept well under 20 min on 2 cores)
def test_step_timing(tmp_path):
    """--step-timing: the engine's step with every slot busy and decode_loop's, at the same batch and
    context, from runs of `steps` and twice as many steps (rounded up to whole decode calls)."""
    out = tmp_path / "r.json"
    assert main(["--preset", "debug", "--random-weights", "--dtype", "float32", "--step-timing", "--max-batch", "2",
                 "--prompt-len", "8", "--output-len", "6", "--decode-steps", "4", "--prefill-chunk", "16",
                 "--step-reps", "2", "--out", str(out)], engine_cls=Engine) == 0
    t = json.loads(out.read_text())["step_timing"]
    assert (t["batch"], t["context"], t["steps"], t["decode_steps"]) == (2, 8, [8, 16], 4)
    # (CPU timings of the debug model are too short to order: the differences are checked, not their sign)
    assert min(t["engine_window_s"]["16"], t["engine_window_s"]["8"]) > 0
    assert min(t["decode_loop_call_s"]["16"], t["decode_loop_call_s"]["8"]) > 0
    assert t["decode_loop_ms_per_step"] == pytest.approx(1e3 * (t["decode_loop_call_s"]["16"]
                                                                - t["decode_loop_call_s"]["8"]) / 8)
    assert t["engine_ms_per_step"] == pytest.approx(1e3 * (t["engine_window_s"]["16"] - t["engine_window_s"]["8"]) / 8)
    assert t["engine_vs_decode_loop"] == pytest.approx(t["engine_ms_per_step"] / t["decode_loop_ms_per_step"])


def test_snapshot_timing(tmp_path):
    """The snapshot cost: save and restore times of the preset's snapshot, whose bytes are the KDA
    states and conv windows of one row (the engine's prefix pool unit)."""
    from ling_jax.cache import nbytes, paged_cache_shapes
    from ling_jax.config import LingConfig

    out = tmp_path / "s.json"
    assert main(["--preset", "debug", "--snapshot-timing", "--dtype", "float32", "--out", str(out)]) == 0
    t = json.loads(out.read_text())["snapshot_timing"]
    cfg = LingConfig.preset("debug")
    row = paged_cache_shapes(cfg, 1, 1, 64, "float32")["segments"]
    want = nbytes([c[k] for c in row for k in ("state", "conv") if k in c]
                  + [c["kda"][k] for c in row if "kda" in c for k in ("state", "conv")])
    assert t["snapshot_bytes"] == want > 0
    assert t["save_ms"] > 0 and t["restore_ms"] > 0 and t["reps"] == 50


@pytest.mark.parametrize("args", [["--url", "http://x", "--static", "--vocab-size", "9"], ["--url", "http://x"],
                                  ["--random-weights"], [], ["--preset", "debug", "--random-weights",
                                                             "--prompt-len", "5:2"],
                                  ["--url", "http://x", "--vocab-size", "9", "--concurrency", "0"],
                                  ["--url", "http://x", "--vocab-size", "9", "--compare-prefix-cache"],
                                  ["--url", "http://x", "--vocab-size", "9", "--step-timing"],
                                  ["--url", "http://x", "--vocab-size", "9", "--compare-prefill-rows", "2"],
                                  ["--preset", "debug", "--random-weights", "--compare-prefill-rows", "0"],
                                  ["--preset", "debug", "--random-weights", "--compare-prefill-rows", "2",
                                   "--compare-prefix-cache"],
                                  ["--preset", "debug", "--random-weights", "--static", "--multi-turn", "2"],
                                  ["--preset", "debug", "--random-weights", "--step-timing", "--shared-prefix", "4"],
                                  ["--preset", "debug", "--random-weights", "--multi-turn", "0"],
                                  ["--preset", "debug", "--random-weights", "--shared-prefix", "-1"],
                                  ["--preset", "debug", "--random-weights", "--also-concurrency", "2"],
                                  ["--preset", "debug", "--random-weights", "--also-concurrency", "2:65"],
                                  ["--url", "http://x", "--vocab-size", "9", "--also-concurrency", "1:2"],
                                  ["--random-weights", "--snapshot-timing"],
                                  ["--preset", "debug", "--random-weights", "--profile-window", "1:2"],
                                  ["--preset", "debug", "--random-weights", "--profile", "p", "--profile-window", "1"],
                                  ["--preset", "debug", "--random-weights", "--profile", "p",
                                   "--profile-window", "a:b"],
                                  ["--preset", "debug", "--random-weights", "--profile", "p",
                                   "--profile-window", "1:0"]])
def test_bad_arguments(args):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2


def test_traced_covers_the_window_it_is_given(tmp_path):
    """`traced` (`--profile`, `--profile-window`): the whole block, a stretch of it that starts and ends
    inside it, or nothing where the block ends before the window opens."""

    def work(seconds):
        x, t = jax.numpy.ones((64, 64)), time.perf_counter()
        while time.perf_counter() - t < seconds:
            x = (x @ x) / 64
        jax.block_until_ready(x)

    with traced(str(tmp_path / "whole")) as whole:
        work(0.3)
    with traced(str(tmp_path / "part"), (0.2, 0.6)) as part:
        work(2.0)
    with traced(str(tmp_path / "late"), (5.0, 1.0)) as late:
        work(0.1)
    assert whole[0] < whole[1] and whole[1] >= 0.3  # ended with the block
    assert 0.2 <= part[0] < part[1] and 0.8 <= part[1] < 2.0  # started late, ended by its timer, before the block
    assert late == [] and not (tmp_path / "late").exists()
    for name in ("whole", "part"):
        assert list((tmp_path / name).rglob("*.xplane.pb"))

"""bench/serve.py on CPU: an in-process engine (the engine under test) against static generate
batches, a running server under Poisson arrivals, and its argument checks."""

from __future__ import annotations

import json

import pytest

from bench.serve import main, make_requests
from ling_jax.engine import Engine
from tests.serve.harness import make_engine, serve

pytest_plugins = ["tests.serve.fixtures"]  # the fixtures: model, tokenizer, servers


def test_in_process_engine_against_static(tmp_path):
    out = tmp_path / "r.json"
    assert main(["--preset", "debug", "--random-weights", "--dtype", "float32", "--num-requests", "4",
                 "--concurrency", "2", "--prompt-len", "4:12", "--output-len", "2:6", "--static", "--scan-layers",
                 "--out", str(out)], engine_cls=Engine) == 0
    r = json.loads(out.read_text())
    want = sum(q.max_tokens for q in make_requests(4, (4, 12), (2, 6), 512, 0))
    assert r["engine"]["output_tokens"] == r["static"]["output_tokens"] == want
    assert r["engine"]["requests"] == r["static"]["requests"] == 4
    assert r["static"]["generated_tokens"] >= want and r["output_tokens_per_s_vs_static"] > 0
    for key in ("request_throughput", "output_tokens_per_s", "total_tokens_per_s"):
        assert r["engine"][key] > 0 and r["static"][key] > 0
    assert r["engine"]["ttft_s"]["p50"] > 0 and r["engine"]["tpot_s"]["p99"] >= r["engine"]["tpot_s"]["p50"] > 0
    assert r["static"]["tpot_s"]["p50"] is None
    assert r["device"] and r["jax"] and r["date"] and r["command"] and "git" in r
    assert r["engine"]["stats"]["generation_tokens_total"] == want


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


@pytest.mark.parametrize("args", [["--url", "http://x", "--static", "--vocab-size", "9"], ["--url", "http://x"],
                                  ["--random-weights"], [], ["--preset", "debug", "--random-weights",
                                                             "--prompt-len", "5:2"],
                                  ["--url", "http://x", "--vocab-size", "9", "--concurrency", "0"]])
def test_bad_arguments(args):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2

"""The `ling-serve` command: --help without JAX, one-line usage (2) and runtime (1) errors, and a
real process that drains on SIGTERM (in-flight request finished, new ones 503) and exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from ling_jax.checkpoint.export import save_hf_checkpoint
from ling_jax.config import LingConfig
from ling_jax.params import init_params
from serve.server import main
from tests.conftest import SUBPROCESS_CACHE
from tests.serve.harness import engine_factory

pytest_plugins = ["tests.serve.fixtures"]  # the fixtures: model, tokenizer, servers

ROOT = Path(__file__).parent.parent.parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    cfg = LingConfig.preset("debug")
    path = tmp_path_factory.mktemp("serve") / "tiny"
    save_hf_checkpoint(cfg, init_params(cfg, seed=0), path, dtype="float32")
    return path


def test_help_does_not_import_jax():
    code = ("import sys\nfrom serve.server import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0\nassert 'jax' not in sys.modules, 'jax imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--checkpoint" in proc.stdout and "--api-key" in proc.stdout and "--shutdown-grace" in proc.stdout


@pytest.mark.parametrize("args, msg", [
    (["--checkpoint", "/nonexistent"], "no such directory"),
    (["--checkpoint", __file__], "not a directory"),
    (["--port", "70000"], "--port 70000: must be <= 65535"),
    (["--max-batch", "0"], "--max-batch 0: must be >= 1"),
    (["--max-len", "1"], "--max-len 1: must be >= 2"),
    (["--prefill-chunk", "0"], "--prefill-chunk 0: must be >= 1"),
    (["--prefill-rows", "0"], "--prefill-rows 0: must be >= 1"),
    (["--decode-steps", "0"], "--decode-steps 0: must be >= 1"),
    (["--compile-threads", "0"], "--compile-threads 0: must be >= 1"),
    (["--decode-buckets", "1,9"], "--decode-buckets 1,9: each must be in 1 .. --max-batch 8"),
    (["--decode-buckets", "0"], "--decode-buckets 0: each must be in 1"),
    (["--decode-buckets", "2", "--speculative-tokens", "1"], "--decode-buckets apply to plain decoding"),
    (["--prefix-cache-gb", "0"], "--prefix-cache-gb 0.0: must be > 0"),
    (["--shutdown-grace", "nan"], "--shutdown-grace nan"),
    (["--api-key", " "], "--api-key is empty"),
    (["--tokenizer", "/nonexistent/tokenizer.json"], "not a readable tokenizer.json"),
    (["--mesh", "expert=x"], "--mesh: 'expert=x'"),
])
def test_usage_errors_exit_2_with_one_line(checkpoint, capsys, args, msg):
    if "--checkpoint" not in args:
        args = ["--checkpoint", str(checkpoint), *args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and err.startswith("ling-serve: ")


def test_runtime_errors_exit_1_with_one_line(checkpoint, tmp_path, capsys, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["--checkpoint", str(checkpoint), "--port", str(taken.getsockname()[1])]) == 1
    err = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1:" in err and err.count("\n") == 1
    (tmp_path / "empty").mkdir()
    assert main(["--checkpoint", str(tmp_path / "empty"), "--port", "0"], engine_cls=engine_factory()) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "empty") in err and err.count("\n") == 1

    def broken():
        raise ImportError("no module named 'x'")

    monkeypatch.setattr("serve.server._default_engine", broken)
    assert main(["--checkpoint", str(checkpoint), "--port", "0"]) == 1
    assert capsys.readouterr().err == "ling-serve: the serving engine cannot be imported: no module named 'x'\n"


def test_speculative_tokens_reach_the_engine(tmp_path, capsys):
    """`--speculative-tokens 2` builds the engine with 2 drafts per call: a checkpoint without an MTP
    layer is refused with the engine's one-line message (exit 1)."""
    cfg = LingConfig.preset("debug", num_nextn_predict_layers=0)
    save_hf_checkpoint(cfg, init_params(cfg, seed=0), tmp_path / "no-mtp", dtype="float32")
    assert main(["--checkpoint", str(tmp_path / "no-mtp"), "--port", "0", "--speculative-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "speculative_tokens=2 drafts with the MTP layer" in err and err.count("\n") == 1


SERVE_UNDER_TEST = """
import sys
from serve.server import main
from tests.serve.harness import engine_factory
sys.exit(main(sys.argv[1:], engine_cls=engine_factory(token_delay=0.25)))
"""


@pytest.mark.heavy  # a fresh process compiles the model: ~10 s on 2 cores
@pytest.mark.parametrize("k", [0, 2], ids=["plain", "speculative"])
def test_sigterm_drains_and_exits_0(checkpoint, tokenizer_dir, k):
    """The real command (the engine paced to tokens 0.25 s apart, compiled before it listens, with k
    MTP drafts per call ahead of time in two threads) under SIGTERM mid-stream."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": SUBPROCESS_CACHE,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "LING_API_KEY": "k"}
    cmd = [sys.executable, "-c", SERVE_UNDER_TEST, "--checkpoint", str(checkpoint), "--tokenizer",
           str(tokenizer_dir / "tokenizer.json"), "--port", "0", "--dtype", "float32", "--served-model-name", "tiny",
           "--shutdown-grace", "30", "--prefill-chunk", "16", "--max-len", "256", "--speculative-tokens", str(k),
           "--compile-threads", "2" if k else "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ling-serve: serving tiny on http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split()[-1]
        auth = {"Authorization": "Bearer k"}  # the key from $LING_API_KEY
        assert httpx.get(url + "/v1/models").status_code == 401
        events, first = [], threading.Event()

        def stream():
            body = {"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True, "stream": True, "return_token_ids": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth, timeout=120) as r:
                for chunk in r.iter_lines():
                    if chunk.startswith("data: {"):
                        events.append(json.loads(chunk[6:]))
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(120), proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        assert "ling-serve: draining" in next(x for x in proc.stdout if x.startswith("ling-serve: "))
        r = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers=auth)
        assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down"
        t.join(timeout=60)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert len([i for e in events for i in e["choices"][0]["token_ids"]]) == 8
        assert [x for x in proc.stdout.read().splitlines() if x.startswith("ling-serve: ")] == ["ling-serve: stopped"]
        err = proc.stderr.read()  # each serving shape reported as it compiles, then the total
        assert re.search(r"ling-serve: compiled prefill 1 x 16 \(1/\d+\) in [\d.]+ s", err), err
        last = "speculative step" if k else r"decode \d+ slots, 1(-\d+)? steps?"
        assert re.search(rf"ling-serve: compiled {last} \(\d+/\d+\)", err) and "ling-serve: compiled in" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.heavy  # a fresh process compiles the model on a mesh of 8 simulated devices: ~1 min on 2 cores
def test_mesh_and_fp8_weights_end_to_end(tmp_path):
    """The real command with `--mesh data=2,expert=4 --fp8-weights` (and the prefix cache) on the golden
    block-FP8 checkpoint converted to Orbax, on 8 simulated CPU devices: a completion's token ids are
    `generate`'s with the same FP8-resident weights; SIGTERM exits 0."""
    import numpy as np

    import ling_jax
    from ling_jax.checkpoint.convert import convert_hf_to_orbax
    from serve.generate import load_any
    from tests.conftest import GOLDEN

    ck = convert_hf_to_orbax(GOLDEN / "ling3_tiny_a_fp8", tmp_path / "ck", dtype="float8")
    prompt = np.load(GOLDEN / "ling3_tiny_a_fp8" / "golden.npz")["decode_prompt_ids"][0].tolist()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8",
           "JAX_COMPILATION_CACHE_DIR": SUBPROCESS_CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    cmd = [sys.executable, "-m", "serve.server", "--checkpoint", str(ck), "--fp8-weights", "--mesh",
           "data=2,expert=4", "--port", "0", "--dtype", "float32", "--served-model-name", "fp8", "--max-batch", "2",
           "--max-len", "64", "--page-size", "8", "--prefill-chunk", "16", "--decode-steps", "4", "--prefix-cache",
           "--prefix-cache-gb", "0.01"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cfg, params = load_any(ck, "float32", True)
        want = ling_jax.generate(cfg, params, [prompt], max_new_tokens=12, stop_tokens=())[0]
        line = proc.stdout.readline()
        assert line.startswith("ling-serve: serving fp8 on http://127.0.0.1:"), line + proc.stderr.read()
        r = httpx.post(line.split()[-1] + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        assert proc.stdout.read().splitlines()[-1] == "ling-serve: stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

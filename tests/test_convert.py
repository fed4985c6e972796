"""ling-convert / load_checkpoint / ling-export: golden logits, bit-exact round trips, crash and resume,
re-runs onto a finished output, bad input through the command line (exit 2 / 1), and bounded memory
(heavy)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import GOLDEN, rel_l2

import ling_jax
from ling_jax.checkpoint.convert import main as convert_main
from ling_jax.checkpoint.export import main as export_main
from ling_jax.checkpoint.fp8 import FP8, BlockFP8
from ling_jax.checkpoint.orbax_io import (
    CONVERT_STATE,
    IncompleteCheckpointError,
    load_checkpoint,
    partial_dir,
    save_checkpoint,
)
from ling_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsDir, SafetensorsFile, write_safetensors
from ling_jax.checkpoint.synthetic import LING_FP8_EXCLUSIONS, scaled_config, write_random_hf_checkpoint
from ling_jax.config import LingConfig, QuantConfig

FP8_SRC, BF16_SRC = GOLDEN / "ling3_tiny_a_fp8", GOLDEN / "ling3_tiny_a"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _convert(src: Path, out: Path, *extra: str) -> Path:
    assert convert_main(["--hf-dir", str(src), "--out", str(out), "--quiet", *extra]) == 0
    return out


def _rerun_finds_it_done(out: Path, capsys) -> None:
    """The command that converted BF16_SRC into `out` again: exit 0, saying there was nothing to do."""
    capsys.readouterr()
    assert convert_main(["--hf-dir", str(BF16_SRC), "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err == f"ling-convert: {out} already holds this conversion of {BF16_SRC}: nothing to do\n"


@pytest.fixture(scope="module")
def ck_float8(tmp_path_factory) -> Path:
    return _convert(FP8_SRC, tmp_path_factory.mktemp("c") / "fp8", "--dtype", "float8")


@pytest.fixture(scope="module")
def ck_fp8_as_bf16(tmp_path_factory) -> Path:
    return _convert(FP8_SRC, tmp_path_factory.mktemp("c") / "bf16")


def _assert_same_tensors(mine: Path, ref: Path) -> None:
    """Same names, dtypes, shapes and bytes for every tensor."""
    a, b = SafetensorsDir(mine), SafetensorsDir(ref)
    assert sorted(a.keys()) == sorted(b.keys())
    for k in b:
        x, y = a.get(k), b.get(k)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), k
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), k


def _export(ck: Path, out: Path, *extra: str) -> Path:
    assert export_main(["--checkpoint", str(ck), "--out", str(out), "--quiet", *extra]) == 0
    return out


# ---------------------------------------------------------------- golden logits
def test_float8_checkpoint_matches_golden_logits(ck_float8):
    g = np.load(FP8_SRC / "golden.npz")
    cfg, params = load_checkpoint(ck_float8, dtype="float32")
    assert params["segments"][0]["attn"]["q_proj"].dtype == jnp.float32
    logits = ling_jax.forward(cfg, params, jnp.asarray(g["prefill_input_ids"]))
    assert rel_l2(logits, g["prefill_logits"]) <= 1e-5
    # stored FP8: dtype=None gives the source's codes and scales, transposed into our layout
    _, q = load_checkpoint(ck_float8)
    w = q["segments"][2]["attn"]["kv_a_proj"]  # layer 3 (MLA): [128, 80] with a partial edge block
    assert isinstance(w, BlockFP8) and w.value.dtype == FP8 and w.block == (32, 32)
    src = SafetensorsDir(FP8_SRC)
    name = "model.layers.3.attention.kv_a_proj_with_mqa.weight"
    np.testing.assert_array_equal(np.asarray(w.value[0]).view(np.uint8), src.get(name).T.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(w.scale[0]), src.get(name + "_scale_inv").T)
    assert not isinstance(q["segments"][1]["mlp"]["router"], BlockFP8)  # excluded in the source: bf16
    assert q["segments"][1]["mlp"]["router"].dtype == jnp.bfloat16


def test_bfloat16_conversion_of_fp8_matches_bf16_golden(ck_fp8_as_bf16):
    g = np.load(FP8_SRC / "golden_bf16w.npz")
    cfg, params = load_checkpoint(ck_fp8_as_bf16)
    kda = params["segments"][0]["attn"]
    assert kda["q_proj"].dtype == jnp.bfloat16
    assert kda["A_log"].dtype == kda["dt_bias"].dtype == jnp.float32
    assert params["segments"][1]["mlp"]["expert_bias"].dtype == jnp.float32
    logits = ling_jax.forward(cfg, jax.tree.map(lambda a: a.astype(jnp.float32), params),
                              jnp.asarray(g["prefill_input_ids"]))
    assert rel_l2(logits, g["prefill_logits"]) <= 1e-4


# ---------------------------------------------------------------- round trips
def test_bf16_roundtrip_bit_exact(tmp_path):
    ck = _convert(BF16_SRC, tmp_path / "ck")
    assert json.loads((ck / "ling_checkpoint.json").read_text())["stored"] == "bfloat16"
    out = _export(ck, tmp_path / "hf")
    _assert_same_tensors(out, BF16_SRC)
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) == 938
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    cfg, params = ling_jax.load_hf_checkpoint(out, dtype="bfloat16")
    assert cfg == LingConfig.from_hf(BF16_SRC)


def test_fp8_roundtrip_bit_exact(tmp_path, ck_float8):
    out = _export(ck_float8, tmp_path / "hf", "--max-shard-size", "1MB")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    _assert_same_tensors(out, FP8_SRC)
    cfg = LingConfig.from_hf(out)
    assert cfg.quantization == LingConfig.from_hf(FP8_SRC).quantization
    ling_jax.load_hf_checkpoint(out)


def test_fp8_export_keeps_the_source_float_leaves(tmp_path):
    """An FP8 source whose exclusions do not name a float weight (b_proj here): converted with
    --dtype float8 and exported, that weight stays BF16 as in the source, bit for bit."""
    src = shutil.copytree(FP8_SRC, tmp_path / "src")
    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"]["modules_to_not_convert"].remove("b_proj")
    (src / "config.json").write_text(json.dumps(hf))
    out = _export(_convert(src, tmp_path / "ck", "--dtype", "float8"), tmp_path / "hf")
    _assert_same_tensors(out, src)


def test_export_of_dequantized_checkpoint(tmp_path, ck_fp8_as_bf16):
    """A bf16 checkpoint of an FP8 source re-quantizes with the source's exclusions (auto), or stays bf16."""
    fp8_out, bf16_out = _export(ck_fp8_as_bf16, tmp_path / "a"), _export(ck_fp8_as_bf16, tmp_path / "b",
                                                                         "--dtype", "bfloat16")
    mine, src = SafetensorsDir(fp8_out), SafetensorsDir(FP8_SRC)
    assert {k: (mine.dtype_name(k), mine.shape(k)) for k in mine} == {k: (src.dtype_name(k), src.shape(k)) for k in src}
    plain = SafetensorsDir(bf16_out)
    assert not any(k.endswith("_scale_inv") for k in plain)
    assert plain.dtype_name("model.layers.0.attention.q_proj.weight") == "BF16"
    assert plain.dtype_name("model.layers.0.attention.A_log") == "F32"


def test_save_checkpoint_orbax_native(tmp_path, ck_float8):
    """Params in memory (BlockFP8 leaves) -> Orbax's own OCDBT layout -> load and export: bit-exact."""
    cfg, q = load_checkpoint(ck_float8)
    ck = save_checkpoint(tmp_path / "ck", cfg, q)
    assert (ck / "params" / "manifest.ocdbt").is_file()
    _, again = load_checkpoint(ck)
    flat = jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a).view(np.uint8),
                                                                     np.asarray(b).view(np.uint8)), q, again))
    assert flat and all(flat)
    _assert_same_tensors(_export(ck, tmp_path / "hf"), FP8_SRC)


def test_training_step_directory(tmp_path, monkeypatch):
    """A CheckpointManager step as train/ writes it (params inside a `state` item, config.json in the run
    directory): load_checkpoint restores only the params, from an absolute or a relative path (Orbax
    takes absolute ones only); ling-export exports them."""
    import orbax.checkpoint as ocp

    from ling_jax.params import init_params

    cfg = LingConfig.preset("debug")
    params = init_params(cfg, seed=3, dtype=jnp.bfloat16)
    state = {"params": params, "opt_state": {"mu": jax.tree.map(jnp.zeros_like, params)}, "step": jnp.int32(7)}
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_hf()))
    with ocp.CheckpointManager(run / "checkpoints") as mgr:
        mgr.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"i": 7})))
        mgr.wait_until_finished()
    cfg2, loaded = load_checkpoint(run / "checkpoints" / "7", dtype="float32")
    assert cfg2 == cfg
    same = jax.tree.map(lambda a, b: a.dtype == jnp.float32 and np.array_equal(np.asarray(a), np.asarray(b)), loaded,
                        jax.tree.map(lambda a: a.astype(jnp.float32), params))
    assert all(jax.tree.leaves(same))
    monkeypatch.chdir(run)
    _, relative = load_checkpoint(Path("checkpoints") / "7", dtype="float32")
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), relative,
                                            loaded)))
    out = _export(run / "checkpoints" / "7", tmp_path / "hf")
    _, back = ling_jax.load_hf_checkpoint(out, dtype="bfloat16")
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), back, params)))


# ---------------------------------------------------------------- interruption
def test_rerun_after_the_commit_finishes_the_cleanup(tmp_path, monkeypatch, capsys):
    """Killed between the commit's rename and the removal of its state: the output loads, and a
    re-run of the same command removes the leftover and exits 0 (another conversion is refused)."""
    import ling_jax.checkpoint.convert as conv

    out, real = tmp_path / "ck", conv.fsync_dir

    class Killed(BaseException):
        pass

    def dies_after_rename(d: Path) -> None:
        if d == out.parent:
            raise Killed
        real(d)

    monkeypatch.setattr(conv, "fsync_dir", dies_after_rename)
    with pytest.raises(Killed):
        conv.convert_hf_to_orbax(BF16_SRC, out)
    monkeypatch.setattr(conv, "fsync_dir", real)
    assert (out / CONVERT_STATE).is_dir() and not partial_dir(out).exists()
    with pytest.raises(FileExistsError, match=r"already holds a conversion of other inputs or options \(dtype "
                                              r"bfloat16 -> float32\)"):
        conv.convert_hf_to_orbax(BF16_SRC, out, dtype="float32")
    assert (out / CONVERT_STATE).is_dir()
    _rerun_finds_it_done(out, capsys)
    assert not (out / CONVERT_STATE).exists()
    load_checkpoint(out)


# ---------------------------------------------------------------- re-runs onto a finished output
def _manifest(ck: Path) -> dict:
    return json.loads((ck / "ling_checkpoint.json").read_text())


def test_rerun_of_a_finished_conversion_changes_nothing(tmp_path, capsys):
    out = _convert(BF16_SRC, tmp_path / "ck")
    record = _manifest(out)["conversion"]
    assert record["source"] == str(BF16_SRC.resolve()) and record["dtype"] == "bfloat16" and record["verified"]
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    _rerun_finds_it_done(out, capsys)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_other_inputs_onto_a_finished_conversion_are_refused(tmp_path, capsys):
    """Another dtype, option or source, a source whose files or config changed since, or a checkpoint
    that no conversion wrote: exit 2, one line saying what differs, the output untouched."""
    src = shutil.copytree(BF16_SRC, tmp_path / "src")
    out = _convert(src, tmp_path / "ck")
    manifest = _manifest(out)

    def refused(hf: Path, ck: Path, *extra: str) -> str:
        capsys.readouterr()
        assert convert_main(["--hf-dir", str(hf), "--out", str(ck), "--quiet", *extra]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"ling-convert: error: {ck} already holds a "), err
        return err[0]

    assert "(dtype bfloat16 -> float32): remove it" in refused(src, out, "--dtype", "float32")
    assert "(compress False -> True)" in refused(src, out, "--compress")
    assert f"(source {src.resolve()} -> {BF16_SRC.resolve()})" in refused(BF16_SRC, out)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    assert "(the source's config.json changed)" in refused(src, out)
    (src / "config.json").write_text(json.dumps(cfg))
    assert "the source's config.json changed" in refused(src, out)  # same values, other bytes
    shutil.copy2(BF16_SRC / "config.json", src / "config.json")
    os.utime(src / "model.safetensors", ns=(0, 0))
    assert "(the source's safetensors files changed (names, sizes or modification times))" in refused(src, out)
    assert _manifest(out) == manifest
    cfg, params = load_checkpoint(out)
    saved = save_checkpoint(tmp_path / "saved", cfg, params)
    assert "checkpoint that records no conversion of an HF source" in refused(BF16_SRC, saved)


def test_verifying_rerun_verifies_an_unverified_conversion(tmp_path, capsys):
    """Written with --no-verify, then the same command without it: every tensor is read back against
    the source; a match is recorded as verified (exit 0), a changed chunk is a failure (exit 1)."""
    out = _convert(BF16_SRC, tmp_path / "ck", "--no-verify")
    assert _manifest(out)["conversion"]["verified"] is False
    bad = shutil.copytree(out, tmp_path / "bad")
    chunk = next(f for f in (bad / "params" / "segments.0.attn.q_proj" / "c" / "0").rglob("*") if f.is_file())
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    capsys.readouterr()
    assert convert_main(["--hf-dir", str(BF16_SRC), "--out", str(bad), "--quiet"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"ling-convert: error: verify: {bad}: 1 tensors read back with other "
                                               "bytes than the source gives (first: segments.0.attn.q_proj[0]"), err
    assert _manifest(bad)["conversion"]["verified"] is False
    assert convert_main(["--hf-dir", str(BF16_SRC), "--out", str(out), "--quiet"]) == 0
    assert _manifest(out)["conversion"]["verified"] is True


def test_convert_and_export_do_not_import_each_other():
    """What the two commands share lives in ling_jax.cli and ling_jax.checkpoint.layout."""
    root = Path(ling_jax.__file__).parent / "checkpoint"
    for mine, other in (("convert", "export"), ("export", "convert")):
        tree = ast.parse((root / f"{mine}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert f"ling_jax.checkpoint.{other}" not in imported, mine


def _big_fp8_source(path: Path, num_layers: int) -> Path:
    cfg = scaled_config(num_layers, hidden=512, vocab=4096, experts=16, expert_width=512)
    quant = QuantConfig(block_size=(128, 128), exclusions=LING_FP8_EXCLUSIONS)
    return write_random_hf_checkpoint(cfg, path, quantization=quant, max_shard_bytes=32 << 20)


def test_sigkill_then_resume(tmp_path):
    src = _big_fp8_source(tmp_path / "src", 8)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ling_jax.checkpoint.convert", "--hf-dir", str(src), "--out", str(out)]
    n_tensors = len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = partial_dir(out) / CONVERT_STATE / "progress.log"
    deadline = time.monotonic() + 120
    while not (log.is_file() and log.read_text().count("\n") >= 100):
        assert proc.poll() is None, "conversion ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    n_done = log.read_text().count("\n")
    assert 100 <= n_done < n_tensors / 2  # killed mid-way (the scale tensors are not logged separately)
    assert not out.exists()
    with pytest.raises(IncompleteCheckpointError, match="incomplete checkpoint"):
        load_checkpoint(out)
    with pytest.raises(IncompleteCheckpointError, match="incomplete checkpoint"):
        load_checkpoint(partial_dir(out))
    # a logged element whose chunk was lost (as after a machine crash) is found by the verification and rewritten
    key, idx = next(line.split("\t")[:2] for line in log.read_text().splitlines() if line.split("\t")[1])
    chunks = partial_dir(out) / "params" / key / "c"  # zarr3 chunk keys: c/<stack indices>/<element chunk>
    lost = [f for f in chunks.rglob("*") if f.is_file() and f.relative_to(chunks).parts[:idx.count(",") + 1]
            == tuple(idx.split(","))]
    assert lost
    for f in lost:
        f.unlink()
    rerun = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{n_done} of " in rerun.stderr and "already converted" in rerun.stderr
    assert "1 tensors read back with other bytes than logged; writing them again" in rerun.stderr
    assert not partial_dir(out).exists() and not (out / CONVERT_STATE).exists()
    cfg, params = load_checkpoint(out)
    _, ref = ling_jax.load_hf_checkpoint(src, dtype="bfloat16")
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint8),
                                                                          np.asarray(b).view(np.uint8)), params, ref)
    assert all(jax.tree.leaves(same))


def test_incomplete_or_missing_checkpoint(tmp_path, ck_float8):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="an empty directory, not a checkpoint"):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="a Hugging Face checkpoint, not an Orbax one"):
        load_checkpoint(FP8_SRC)
    broken = tmp_path / "broken"
    shutil.copytree(ck_float8, broken)
    (broken / "ling_checkpoint.json").unlink()
    (broken / "_CHECKPOINT_METADATA").unlink()
    with pytest.raises(IncompleteCheckpointError, match="incomplete checkpoint"):
        load_checkpoint(broken)
    shutil.rmtree(broken)
    shutil.copytree(ck_float8, broken)
    (broken / "params" / "_METADATA").unlink()
    with pytest.raises(IncompleteCheckpointError, match="incomplete checkpoint"):
        load_checkpoint(broken)


# ---------------------------------------------------------------- bad input through the CLI
def _rewrite(src_dir: Path, dst_dir: Path, edit) -> Path:
    shutil.copytree(src_dir, dst_dir)
    (dst_dir / "model.safetensors").unlink()
    f = SafetensorsFile(src_dir / "model.safetensors")
    write_safetensors(dst_dir / "model.safetensors", edit({k: np.array(f.get(k)) for k in f}))
    return dst_dir


def _truncated(tmp: Path) -> Path:
    d = shutil.copytree(FP8_SRC, tmp / "src")
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate((d / "model.safetensors").stat().st_size - 1000)
    return d


def _index_missing_file(tmp: Path) -> Path:
    d = tmp / "src"
    write_random_hf_checkpoint(LingConfig.preset("debug"), d, max_shard_bytes=100_000)
    victim = sorted(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (d / victim).unlink()
    return d


def _bad_scale(tmp: Path) -> Path:
    name = "model.layers.0.attention.q_proj.weight_scale_inv"
    return _rewrite(FP8_SRC, tmp / "src", lambda t: {**t, name: t[name][:, :2]})


def _bad_architecture(tmp: Path) -> Path:
    d = shutil.copytree(BF16_SRC, tmp / "src")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["BailingMoeV2_5ForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(("make", "message", "code"), [
    (_truncated, "model.safetensors: truncated: tensor", 1),
    (_index_missing_file, "model.safetensors.index.json names model-0000", 1),
    (_bad_scale, "scale model.layers.0.attention.q_proj.weight_scale_inv has shape", 1),
    (_bad_architecture, "architectures=.*BailingMoeV3ForCausalLM", 1),
    (lambda tmp: tmp / "does-not-exist", "--hf-dir .*does-not-exist: no such directory", 2),
    (lambda tmp: Path(__file__), "--hf-dir .*test_convert.py: not a directory", 2),
])
def test_bad_input_fails_cleanly(tmp_path, capsys, make, message, code):
    """A corrupt source is a failure (exit 1), a --hf-dir that is no directory a usage error (exit 2)."""
    src = make(tmp_path)
    out = tmp_path / "out"
    assert convert_main(["--hf-dir", str(src), "--out", str(out), "--quiet"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ling-convert: error: "), err
    assert re.search(message, err[0]), err[0]
    assert not out.exists() and not partial_dir(out).exists()


def test_cli_refusals(tmp_path, capsys, ck_float8):
    """Usage errors exit 2 (an output taken, a flag value the input cannot take, a missing path, a bad
    flag value); a failure of the work exits 1 (a directory that is not a checkpoint); one line each."""

    def one_line(prog: str, *parts: str) -> None:
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"{prog}: error: ") and all(p in err[0] for p in parts), err

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    assert convert_main(["--hf-dir", str(BF16_SRC), "--out", str(tmp_path / "taken"), "--quiet"]) == 2
    one_line("ling-convert", "taken already exists")
    assert convert_main(["--hf-dir", str(BF16_SRC), "--out", str(tmp_path / "o"), "--dtype", "float8"]) == 2
    one_line("ling-convert", "no block-FP8 weights")
    assert export_main(["--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    one_line("ling-export", "--checkpoint", "nothing: no such directory")
    assert export_main(["--checkpoint", str(ck_float8), "--out", str(tmp_path / "taken"), "--quiet"]) == 2
    one_line("ling-export", "taken already exists")
    assert export_main(["--checkpoint", str(tmp_path / "taken"), "--out", str(tmp_path / "o")]) == 1
    one_line("ling-export", "incomplete checkpoint")
    for main in (convert_main, export_main):
        with pytest.raises(SystemExit) as e:
            main(["--hf-dir" if main is convert_main else "--checkpoint", str(BF16_SRC), "--out", str(tmp_path / "o"),
                  "--dtype", "int4"])
        assert e.value.code == 2
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("module", ["convert", "export"])
def test_help_does_not_start_jax(module):
    """--help works where JAX has no usable backend at all (so it never initialises one)."""
    r = subprocess.run([sys.executable, "-m", f"ling_jax.checkpoint.{module}", "--help"], capture_output=True,
                       text=True, env={**os.environ, "JAX_PLATFORMS": "no-such-platform"}, timeout=120)
    assert r.returncode == 0 and "--out" in r.stdout, r.stderr


def test_mesh_restore_places_each_leaf(ck_float8):
    pytest.importorskip("ling_jax.sharding")
    from ling_jax.params import default_sharding, param_slots

    mesh = ling_jax.make_mesh(expert=4, data=2)
    cfg, params = load_checkpoint(ck_float8, dtype="bfloat16", mesh=mesh)
    sharding = default_sharding(cfg, mesh)
    for slot in param_slots(cfg):
        leaf = params
        for k in slot.path:
            leaf = leaf[k]
        assert leaf.sharding.is_equivalent_to(sharding(slot), len(slot.shape)), slot.path


# ---------------------------------------------------------------- memory
# VmHWM (peak RSS of this address space), not ru_maxrss, which Linux carries over from the forking parent
PEAK = 'print("MAXRSS", 1024 * next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")))'
RSS_SNIPPET = f"""
import sys
from ling_jax.checkpoint.convert import main
rc = main(sys.argv[1:])
{PEAK}
sys.exit(rc)
"""
# the same interpreter with everything a conversion imports, before it reads a tensor
BASELINE_SNIPPET = f"""
import orbax.checkpoint, tensorstore, tqdm
import ling_jax.checkpoint.convert
{PEAK}
"""


def _peak_rss(*argv: str) -> int:
    """Peak RSS (bytes) of `ling-convert argv` (or of the imports alone, without argv) in a fresh interpreter."""
    snippet = RSS_SNIPPET if argv else BASELINE_SNIPPET
    r = subprocess.run([sys.executable, "-c", snippet, *argv], env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split("MAXRSS")[1])


@pytest.mark.heavy
def test_peak_rss_is_bounded_by_the_largest_tensor(tmp_path):
    """FP8 models of 1.0 and 2.8 GB with the same largest tensor (a 64 MB bf16 embedding), converted to
    bfloat16 (the path with dequantization temporaries): both peak within the imports plus 6 x the
    largest tensor (2 x in flight to tensorstore, tensorstore's copies of them, the tensor being made
    and its float32 temporaries), however many tensors the model has.

    The peak itself varies run to run by ~50 MB (how full the write window is when the largest
    tensors pass, heap fragmentation): measured 365-456 MB for either size, so no finer "no growth"
    comparison between the two is asserted.
    """
    quant = QuantConfig(block_size=(128, 128), exclusions=LING_FP8_EXCLUSIONS)
    largest = 32768 * 1024 * 2
    baseline = _peak_rss()
    peaks, sizes = {}, {}
    for layers in (8, 24):
        src = write_random_hf_checkpoint(scaled_config(layers), tmp_path / f"src{layers}", quantization=quant)
        sizes[layers] = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        peaks[layers] = _peak_rss("--hf-dir", str(src), "--out", str(tmp_path / "o"), "--dtype", "bfloat16", "--quiet")
        shutil.rmtree(tmp_path / "o")
        shutil.rmtree(src)
    print(f"peak RSS: imports {baseline / 1e6:.0f} MB; {peaks[8] / 1e6:.0f} MB for {sizes[8] / 1e9:.2f} GB, "
          f"{peaks[24] / 1e6:.0f} MB for {sizes[24] / 1e9:.2f} GB")
    assert sizes[24] > 2.5 * sizes[8]
    assert max(peaks.values()) < baseline + 6 * largest, (baseline, peaks)


def test_bfloat16_target_rounds_fp8_once(ck_fp8_as_bf16):
    """--dtype bfloat16 == bf16(float32 dequantization): one rounding, checked element-wise on one weight."""
    _, params = load_checkpoint(ck_fp8_as_bf16)
    src = SafetensorsDir(FP8_SRC)
    name = "model.layers.1.mlp.experts.5.down_proj.weight"  # [128, 24]: a partial edge block column
    w = src.get(name).astype(np.float32) * np.repeat(np.repeat(src.get(name + "_scale_inv"), 32, 0), 32, 1)[:128, :24]
    got = np.asarray(params["segments"][1]["mlp"]["down_proj"][0, 5])
    np.testing.assert_array_equal(got.view(np.uint16), w.T.astype(ml_dtypes.bfloat16).view(np.uint16))

"""`ling-demo`, the README's main job: it runs end to end, replaces only its own outputs in `--out`, and
refuses a bad step count, preset or `--out` before doing anything (exit 2)."""

from __future__ import annotations

import pytest

from ling_jax.demo import main


def test_bad_step_count_is_refused_first(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "demo"), "--train-steps", "0"])
    assert e.value.code == 2 and "--train-steps 0: must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


def test_usage_errors_exit_2_with_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for argv, msg in ((["--preset", "nope", "--out", str(tmp_path / "demo")], "--preset: unknown preset 'nope'"),
                      (["--out", str(tmp_path / "file")], f"--out {tmp_path / 'file'}: not a directory")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ling-demo: error: {msg}") and err.count("\n") == 1, err
    assert not (tmp_path / "demo").exists()


@pytest.mark.heavy  # ~1.5 min on 2 cores
def test_runs_end_to_end_and_keeps_other_files(tmp_path, capsys):
    out = tmp_path / "demo"
    (out / "orbax").mkdir(parents=True)
    (out / "orbax" / "stale").write_text("a previous demo's output")
    (out / "notes.txt").write_text("mine")
    assert main(["--out", str(out), "--train-steps", "1"]) == 0
    log = capsys.readouterr().out
    assert all(f"[{i}/6]" in log for i in range(1, 7)) and "at step 1" in log
    assert "3/3 continuations identical" in log  # the shipped text model, with and without speculation
    assert (out / "notes.txt").read_text() == "mine"  # not the demo's: left alone
    assert not (out / "orbax" / "stale").exists()  # the demo's own output: replaced
    assert (out / "train" / "checkpoints" / "1").is_dir() and (out / "hf-fp8" / "config.json").is_file()

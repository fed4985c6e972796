"""`ling-generate`: text prompts through a tokenizer.json, token-id prompts, clear errors (exit 2 for a
usage error, 1 for a checkpoint that cannot be read)."""

from __future__ import annotations

import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import ling_jax
from ling_jax.checkpoint.export import save_hf_checkpoint
from ling_jax.config import LingConfig
from ling_jax.params import init_params
from serve.generate import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = LingConfig.preset("debug")
    path = tmp_path_factory.mktemp("gen") / "hf"
    save_hf_checkpoint(cfg, init_params(cfg, seed=4), path, dtype="float32")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path.parent / "tokenizer.json"))
    return path


def test_text_and_id_prompts(checkpoint, capsys):
    rc = main(["--checkpoint", str(checkpoint), "--tokenizer", str(checkpoint.parent / "tokenizer.json"),
               "--prompt", "w5 w6 w7", "--prompt-ids", "9,10", "--max-new-tokens", "5", "--stop-tokens", "",
               "--dtype", "float32", "--scan-layers", "--timed-rerun"])  # scanned step: the unrolled one's tokens
    out = capsys.readouterr().out
    assert rc == 0
    cfg, params = ling_jax.load_hf_checkpoint(checkpoint)
    want = ling_jax.generate(cfg, params, [[5, 6, 7], [9, 10]], max_new_tokens=5, stop_tokens=())
    assert f"[0] prompt 3 tokens -> 5 new: {want[0]}" in out
    assert f"[1] prompt 2 tokens -> 5 new: {want[1]}" in out
    assert "tokens/s (" in out and "s warm; first call with compilation" in out
    assert "'w" in out  # decoded text


@pytest.mark.parametrize("args, msg", [
    (["--checkpoint", "/nonexistent", "--prompt-ids", "1"], "no such directory"),
    (["--checkpoint", __file__, "--prompt-ids", "1"], "not a directory"),
    (["--prompt", "hello"], "need --tokenizer"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--prompt-ids", "1,999"], "outside"),
    (["--prompt-ids", "1", "--stop-tokens", "1.5"], "--stop-tokens: '1.5' is not a token id"),
    (["--prompt-ids", "1", "--seed", str(2**70)], "seed="),
    (["--prompt-ids", "1", "--temperature", "nan"], "temperature=nan"),
    ([], "at least one"),
    (["--prompt-ids", "1", "--mesh", "expert=x"], "--mesh: 'expert=x'"),
    (["--prompt-ids", "1", "--mesh", "experts=2"], "--mesh: 'experts=2'"),
    (["--prompt-ids", "1", "--mesh", "expert=16"], "16 but 8 devices"),
    (["--prompt-ids", "1", "--fp8-weights"], "--fp8-weights needs an Orbax checkpoint with FP8 weights"),
    (["--prompt-ids", "1", "--tokenizer", "/nonexistent.json"], "--tokenizer /nonexistent.json"),
    (["--prompt-ids", "1", "--speculative-tokens", "-1"], "speculative_tokens=-1 must be an integer >= 0"),
])
def test_bad_input_exits_with_one_line(checkpoint, capsys, args, msg):
    if "--checkpoint" not in args:
        args = ["--checkpoint", str(checkpoint), *args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("ling-generate: error: ") and msg in err and err.count("\n") == 1


def test_unreadable_checkpoint_is_a_failure(checkpoint, tmp_path, capsys):
    """A checkpoint directory whose contents cannot be loaded: exit 1 and one line."""
    (tmp_path / "empty").mkdir()
    broken = shutil.copytree(checkpoint, tmp_path / "broken")
    shard = next(broken.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    for path, msg in ((tmp_path / "empty", "an empty directory, not a checkpoint"), (broken, "truncated")):
        assert main(["--checkpoint", str(path), "--prompt-ids", "1"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("ling-generate: error: ") and msg in err and err.count("\n") == 1, err


def test_speculative_tokens(checkpoint, tmp_path, capsys):
    """`--speculative-tokens K`: the greedy tokens without it, and the mean accepted length; a checkpoint
    without an MTP layer is a usage error (exit 2, one line)."""
    rc = main(["--checkpoint", str(checkpoint), "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--max-new-tokens", "6",
               "--stop-tokens", "", "--dtype", "float32", "--speculative-tokens", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    cfg, params = ling_jax.load_hf_checkpoint(checkpoint)
    want = ling_jax.generate(cfg, params, [[5, 6, 7], [9]], max_new_tokens=6, stop_tokens=())
    assert f"[0] prompt 3 tokens -> 6 new: {want[0]}" in out and f"[1] prompt 1 tokens -> 6 new: {want[1]}" in out
    assert "speculative decoding, 2 drafts per step: mean accepted length " in out
    no_mtp = LingConfig.preset("debug", num_nextn_predict_layers=0)
    save_hf_checkpoint(no_mtp, init_params(no_mtp, seed=4), tmp_path / "no_mtp", dtype="float32")
    assert main(["--checkpoint", str(tmp_path / "no_mtp"), "--prompt-ids", "1", "--speculative-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ling-generate: error: ") and "has none (num_nextn_predict_layers=0)" in err
    assert err.count("\n") == 1

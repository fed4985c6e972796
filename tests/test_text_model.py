"""The text model's pipeline (train/text_model.py): corpus split, shipped tokenizer, held-out metrics,
export sizes, and the whole `all` command on a small slice (default suite) or the real standard
library (heavy)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import ling_jax
from ling_jax.checkpoint.export import save_hf_checkpoint
from ling_jax.checkpoint.safetensors_io import SafetensorsDir
from ling_jax.config import LingConfig
from ling_jax.params import init_params
from train import text_model as tm

# the text model's shape at toy widths: KDA, MLA, dense layer 0 then MoE, MTP, tied embeddings, FP8 export
TINY_MODEL = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=16, kv_lora_rank=16,
                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, qk_head_dim=32, rotary_dim=16,
                  num_hidden_layers=4, layer_group_size=2, intermediate_size=64, moe_intermediate_size=16,
                  moe_shared_expert_intermediate_size=32)


def tiny_config_file(path: Path) -> Path:
    d = json.loads((Path(ling_jax.config.PRESETS_DIR) / "text-model.json").read_text())
    path.write_text(json.dumps({**d, **TINY_MODEL}))
    return path


def fake_stdlib(root: Path) -> dict[str, str]:
    """A small standard-library-like tree; returns the files the corpus must take (path -> text)."""
    keep = {
        "abc.py": "def f(x):\n    return x + 1\n",
        "json/__init__.py": '"""JSON."""\nfrom .decoder import JSONDecoder\n',
        "json/decoder.py": "class JSONDecoder:\n    pass  # π ≈ 3.14159\n" * 20,
        "email/mime/text.py": "import email\n\n\ndef g():\n\treturn 'tab'\n",
    }
    keep.update({f"pkg{i}/mod{j}.py": f"# module {i}.{j}\nVALUE_{i}_{j} = {i * j}\n"
                 for i in range(6) for j in range(8)})
    skipped = {"test/test_abc.py": "x", "idlelib/run.py": "x", "site-packages/p/q.py": "x", "json/tests/t.py": "x",
               "__pycache__/abc.py": "x", "config-3.12-x86_64-linux-gnu/python-config.py": "x",
               "_sysconfigdata__linux.py": "x", "empty.py": "", "notes.txt": "x"}
    for rel, text in {**keep, **skipped}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return keep


def fake_stdlib_dir(tmp_path: Path) -> Path:
    fake_stdlib(tmp_path / "lib")
    return tmp_path / "lib"


def test_corpus_files_split_and_streams(tmp_path):
    keep = fake_stdlib(tmp_path / "lib")
    assert [f for f in tm.corpus_files(tmp_path / "lib") if f != "empty.py"] == sorted(keep)
    split = tm.split_files(tmp_path / "lib", 0.2)
    assert sorted(split["train"] + split["heldout"]) == sorted(keep) and split["heldout"]
    # a file's split depends on its path alone: the same in a tree missing other files
    (tmp_path / "lib" / "abc.py").unlink()
    again = tm.split_files(tmp_path / "lib", 0.2)
    assert again["heldout"] == [f for f in split["heldout"] if f != "abc.py"]
    names = [f"m{i}/x.py" for i in range(20000)]
    assert abs(np.mean([tm.is_heldout(n, 0.05) for n in names]) - 0.05) < 0.005
    # the streams hold each file's tokens, in order, each followed by eos
    man = tm.build_corpus(tmp_path / "c", tm.TOKENIZER, stdlib=tmp_path / "lib", heldout_fraction=0.2)
    tok = tm.load_tokenizer(tm.TOKENIZER)
    for name in ("train", "heldout"):
        docs = tm.read_documents_bin(tmp_path / "c" / f"{name}.bin")
        assert [tok.decode(d.tolist()) for d in docs] == [keep[f] for f in man["splits"][name]["files"]]
        assert man["splits"][name]["tokens"] == sum(d.size + 1 for d in docs)
    assert man["splits"]["heldout"]["files"] == again["heldout"] + ["abc.py"] * ("abc.py" in split["heldout"])


def test_large_files_are_never_held_out(tmp_path):
    big = next(f"big{i}.py" for i in range(1000) if tm.is_heldout(f"big{i}.py", 0.05))
    (tmp_path / big).write_text("x = 1\n" * (tm.MAX_HELDOUT_BYTES // 6 + 1))
    (tmp_path / "small.py").write_text("y = 2\n")
    with pytest.raises(tm.TextModelError, match="empty train or held-out split"):
        tm.split_files(tmp_path, 0.05)  # the big file trains; nothing is left to hold out
    (tmp_path / big).write_text("x = 1\n")
    assert big in tm.split_files(tmp_path, 0.05)["heldout"]


def test_shipped_tokenizer_round_trips_text():
    tok = tm.load_tokenizer(tm.TOKENIZER)
    assert tok.get_vocab_size() == LingConfig.preset(tm.PRESET).vocab_size == tm.VOCAB_SIZE
    texts = [Path(__file__).read_text(), "déjà vu — 日本語 🐍\ttab\r\nCRLF  \x00\x7f", "    return self._x\n"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
        assert 0 not in ids and 1 not in ids
    source = (Path(__file__).parent.parent / "train" / "main.py").read_text()
    assert len(source) / len(tok.encode(source).ids) > 2.5  # merges learnt from code, not bytes
    config = json.loads((tm.ASSETS / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["pad_token"]) == (tm.EOS, tm.PAD)


def test_evaluate_matches_per_document_reference():
    """Windows batched with padding give the metrics computed per window without padding: main
    token t+1 and MTP token t+2 at t, MTP agreement with the main argmax at t+1."""
    cfg = LingConfig.preset("debug")
    params = init_params(cfg, seed=3)
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, cfg.vocab_size, n).astype(np.uint32) for n in (12, 25, 1, 7)]
    res = tm.evaluate(cfg, params, docs, seq_len=12, batch_size=3)
    sums = np.zeros(7)
    for w in tm.windows(docs, 12):
        logits, (mtp,) = ling_jax.forward_with_mtp(cfg, params, jax.numpy.asarray(w[None], np.int32))
        lg, mt = np.asarray(logits[0], np.float64), np.asarray(mtp[0], np.float64)
        lp = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
        mp = mt - np.log(np.exp(mt - mt.max(-1, keepdims=True)).sum(-1, keepdims=True)) - mt.max(-1, keepdims=True)
        n = w.size
        sums += [-lp[np.arange(n - 1), w[1:]].sum(), (lg[:-1].argmax(-1) == w[1:]).sum(), n - 1,
                 -mp[np.arange(n - 2), w[2:]].sum(), (mt[:-2].argmax(-1) == w[2:]).sum(),
                 (mt[:-2].argmax(-1) == lg[1:-1].argmax(-1)).sum(), n - 2]
    assert res["windows"] == 4 and res["main"]["tokens"] == sums[2] and res["mtp"][0]["tokens"] == sums[6]
    np.testing.assert_allclose(res["main"]["loss"], sums[0] / sums[2], rtol=1e-5)
    np.testing.assert_allclose(res["mtp"][0]["loss"], sums[3] / sums[6], rtol=1e-5)
    assert res["main"]["top1"] == sums[1] / sums[2]
    assert res["mtp"][0]["top1"] == sums[4] / sums[6] and res["mtp"][0]["agreement"] == sums[5] / sums[6]


def test_export_sizes_are_the_writers(tmp_path):
    cfg = LingConfig.from_hf(tiny_config_file(tmp_path / "c.json"))
    sizes = tm.export_sizes(cfg)
    params = init_params(cfg, seed=0)
    for name, quant in (("bfloat16", None), ("float8", cfg.quantization)):
        d = save_hf_checkpoint(cfg, params, tmp_path / name, quantization=quant)
        assert sizes[name] == tm.dir_bytes(d)
    assert sizes["params"] == sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.heavy  # (default suite kept well under 20 min on 2 cores)
def test_all_on_a_slice(tmp_path):
    """`all` on a small tree with a toy-width model: two training steps, both checkpoints evaluated,
    the better one exported as block-FP8 with the tokenizer files, and that export evaluated."""
    fake_stdlib(tmp_path / "lib")
    (tmp_path / "t.json").write_text(json.dumps({"compute_dtype": "float32", "unroll_layers": False}))
    out = tmp_path / "out"
    rc = tm.main(["all", "--out", str(out), "--stdlib", str(tmp_path / "lib"), "--heldout-fraction", "0.2",
                  "--model-config", str(tiny_config_file(tmp_path / "m.json")), "--train-config",
                  str(tmp_path / "t.json"), "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                  "--warmup-steps", "1", "--checkpoint-every", "1", "--eval-dtype", "float32",
                  "--eval-seq-len", "64", "--eval-batch-size", "4", "--spec-prompts", "2", "--spec-prompt-len", "3",
                  "--spec-new-tokens", "5", "--spec-batch-sizes", "2"])
    assert rc == 0
    report = json.loads((out / "eval.json").read_text())
    assert [r["step"] for r in report["checkpoints"]] == [1, 2]
    best = min(report["checkpoints"], key=lambda r: r["main"]["loss"])
    assert report["best_step"] == best["step"]
    model = out / "model"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in model.iterdir()}
    st = SafetensorsDir(model)
    assert st.dtype_name("model.layers.1.mlp.experts.0.up_proj.weight") == "F8_E4M3"
    assert st.dtype_name("model.word_embeddings.weight") == "BF16" and "lm_head.weight" not in st
    assert report["model_dir_bytes"] == tm.dir_bytes(model)
    ex, src = report["exported"], best
    assert ex["main"]["tokens"] == src["main"]["tokens"] > 0
    assert abs(ex["main"]["loss"] - src["main"]["loss"]) < 0.01  # FP8 weights, nearly the same model
    runs = report["speculative"]["runs"]
    assert [(r["batch_size"], r["speculative_tokens"]) for r in runs] == [(2, 0), (2, 1), (2, 2), (2, 3)]
    for r in runs:  # float32: speculation changes no greedy token
        assert r["prompts"] == 2 and r["rows_equal_to_plain"] == 2 and r["output_tokens_per_s"] > 0
        if r["speculative_tokens"]:
            assert 1 <= r["mean_accepted_length"] <= r["speculative_tokens"] + 1
            assert r["acceptance_rate"] == pytest.approx((r["mean_accepted_length"] - 1) / r["speculative_tokens"])
    metrics = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["mtp_loss"] > 0 for m in metrics)


@pytest.mark.parametrize("case, msg", [
    ("no corpus", "train.bin: no such token file (run the corpus stage first)"),
    ("option", "training options: TrainConfig.__init__() got an unexpected keyword argument 'nope'"),
    ("vocab", "the tokenizer has 4096 ids, more than the model's vocab_size 512"),
    ("checkpoint", "no such directory: not a directory"),
])
def test_bad_input(tmp_path, capsys, case, msg):
    tm.build_corpus(tmp_path / "corpus", tm.TOKENIZER, stdlib=fake_stdlib_dir(tmp_path), heldout_fraction=0.2)
    if case == "no corpus":
        (tmp_path / "corpus" / "train.bin").unlink()
    (tmp_path / "t.json").write_text(json.dumps({"nope": 1} if case == "option" else {}))
    model = tiny_config_file(tmp_path / "m.json")
    if case == "vocab":
        model.write_text(json.dumps({**json.loads(model.read_text()), "vocab_size": 512}))
    argv = ["train", "--out", str(tmp_path), "--model-config", str(model), "--train-config", str(tmp_path / "t.json")]
    if case == "checkpoint":
        argv = ["eval", "--checkpoint", str(tmp_path / "no such directory"), "--heldout", str(tmp_path / "x.bin")]
    assert tm.main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err


def test_shipped_model_loads_and_speculates_exactly():
    """The model that ships in ling_jax/assets/text-model/ is the `text-model` preset in block-FP8 with the
    shipped tokenizer, and continues held-out-like text with the same greedy tokens with and without
    speculation."""
    cfg, params = ling_jax.load_hf_checkpoint(tm.ASSETS, dtype="float32")
    want = LingConfig.preset(tm.PRESET)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (want.hidden_size, want.num_hidden_layers,
                                                                        want.vocab_size)
    assert SafetensorsDir(tm.ASSETS).dtype_name("model.layers.1.mlp.experts.0.up_proj.weight") == "F8_E4M3"
    tok = tm.load_tokenizer(tm.TOKENIZER)
    ids = [np.asarray(tok.encode(t, add_special_tokens=False).ids) for t in ("import sys\n", "def main():\n")]
    res = tm.speculative_eval(cfg, params, ids, new_tokens=8, ks=(2,), batch_sizes=(2,))
    assert all(r["rows_equal_to_plain"] == 2 for r in res["runs"])
    assert res["runs"][1]["mean_accepted_length"] > 1  # a trained MTP layer's drafts are accepted


@pytest.mark.heavy
def test_all_on_the_standard_library(tmp_path):
    """`all` on this interpreter's standard library with a toy-width model: the corpus is split as
    documented and the held-out loss falls with training."""
    (tmp_path / "t.json").write_text(json.dumps({"compute_dtype": "float32", "unroll_layers": False}))
    out = tmp_path / "out"
    rc = tm.main(["all", "--out", str(out), "--model-config", str(tiny_config_file(tmp_path / "m.json")),
                  "--train-config", str(tmp_path / "t.json"), "--steps", "40", "--batch-size", "4",
                  "--seq-len", "128", "--lr", "3e-3", "--warmup-steps", "4", "--checkpoint-every", "20",
                  "--eval-dtype", "float32", "--eval-seq-len", "512"])
    assert rc == 0
    report = json.loads((out / "eval.json").read_text())
    man = json.loads((out / "corpus" / "manifest.json").read_text())
    held, train = man["splits"]["heldout"], man["splits"]["train"]
    assert 0.02 < held["documents"] / (held["documents"] + train["documents"]) < 0.1
    assert train["tokens"] > 1_000_000 and held["tokens"] > 20_000
    assert all(tm.is_heldout(f, tm.HELDOUT_FRACTION) for f in held["files"])
    losses = [r["main"]["loss"] for r in report["checkpoints"]]
    assert [r["step"] for r in report["checkpoints"]] == [20, 40] and losses[1] < losses[0] < np.log(tm.VOCAB_SIZE)
    assert report["exported"]["mtp"][0]["loss"] < np.log(tm.VOCAB_SIZE)

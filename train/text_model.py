"""A small Ling-3 model trained on real text: the CPython standard library's own sources.

    python -m train.text_model all --out DIR [--steps N] [--batch-size B] [--seq-len T] ...

runs every stage on a fresh machine with Python and this repository (no download):

1. `corpus`: the running interpreter's standard library (`sysconfig.get_paths()["stdlib"]`, or
   `--stdlib DIR`): every `.py` file outside test suites, site-packages and the packages that
   distributions ship separately (`SKIP_DIRS`), in sorted order of relative path. A file is held
   out for evaluation iff the SHA-256 of its relative POSIX path, read as a fraction of 2**64,
   is below `--heldout-fraction`, so the split of a file never depends on which other files
   exist; files over `MAX_HELDOUT_BYTES` are always trained on. Each file (UTF-8, undecodable
   bytes replaced) is one document; the tokens are written as `DIR/corpus/{train,heldout}.bin`
   (little-endian uint32, every document followed by eos: `ling-train`'s format) with
   `manifest.json` (interpreter, files and their split, counts, checksums).
2. `tokenizer`: a byte-level BPE `tokenizer.json` trained with `tokenizers` on the train split,
   ids 0 and 1 the special `<|pad|>` and `<|endoftext|>` (eos), plus a `tokenizer_config.json`
   whose chat template concatenates the messages' contents (the model is a plain text model:
   chat is continuation). The one trained here ships in `ling_jax/assets/text-model/` and is
   what the other stages use unless told otherwise.
3. `train`: `ling-train` (in this process) from random weights of the `text-model` preset
   (`configs/text-model.json`: 8 layers of 6 KDA + 2 MLA, layer 0 dense then MoE, one MTP
   layer, `mtp_loss_scaling_factor` 0.3, tied embeddings) or `--model-config FILE`, with
   `TRAIN_DEFAULTS` overridden by `--train-config FILE` and the flags; the run lives in `DIR/run`.
4. `eval`: on the held-out documents, the main model's loss, perplexity and top-1 accuracy,
   and per MTP layer j its loss and top-1 accuracy for token t+2+j (ARCHITECTURE.md §2.8: the
   layer sees the main model's hidden state at t and the embedding of token t+1+j) and its
   agreement with the main model (argmax of MTP layer j at t == argmax of the main model at
   t+1+j: the rate at which a greedy verifier accepts the layer's draft along the text). The
   held-out documents come from `read_documents_bin(DIR/corpus/heldout.bin)`, the form in which
   further measurements on them (speculative decoding's accepted length) read them too.
5. `speculate`: greedy generation on held-out prompts (the first `--spec-prompt-len` tokens of
   held-out documents), without and with MTP speculation (k = 1, 2, 3) at each batch size of
   `--spec-batch-sizes`: the mean accepted length and acceptance rate, output tokens/s and its
   ratio to plain decoding on this machine, and how many rows' tokens equal plain decoding's.
6. `export`: a checkpoint as an HF directory (`DIR/model`: block-FP8 weights with the config's
   `quantization_config`, plus the tokenizer files), which `load_hf_checkpoint`, `ling-generate`
   and `ling-convert` read.

`all` evaluates every checkpoint the run kept, exports the one of least held-out loss to
`DIR/model`, evaluates that export too (FP8 weights dequantized to `--eval-dtype`), measures
speculative decoding on it, and writes everything to `DIR/eval.json`. The `DIR/model` directory holds what
`ling_jax/assets/text-model/` holds when the model ships there.

`size` prints a config's parameter count and the exact bytes of its HF export in bfloat16 and
in block-FP8 (written from constant weights into a temporary directory, so the numbers are those
of the real writer).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import ConfigError, LingConfig
from ling_jax.params import Params

ASSETS = Path(__file__).resolve().parent.parent / "ling_jax" / "assets" / "text-model"
TOKENIZER = ASSETS / "tokenizer.json"
PRESET = "text-model"
PAD, EOS = "<|pad|>", "<|endoftext|>"  # ids 0 and 1 of every tokenizer trained here
VOCAB_SIZE = 4096
HELDOUT_FRACTION = 0.05
# files larger than this are always trained on: one of them (pydoc_data/topics.py, 0.8 MB of English
# documentation) would otherwise be most of the held-out set
MAX_HELDOUT_BYTES = 128 << 10
# directories (any level) whose files are left out: test suites, and packages that Linux distributions
# ship separately or not at all (so the corpus is the same on any CPython install of one version)
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
                       "encodings", "site-packages", "dist-packages", "__pycache__"})
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# `ling-train` options of the text model's run (train/config.py::TrainConfig); --train-config and the
# flags override them. checkpoint_every/keep_checkpoints keep checkpoints for `all`'s selection.
TRAIN_DEFAULTS: dict[str, Any] = {
    "steps": 3000, "batch_size": 16, "seq_len": 1024, "lr": 2e-3, "warmup_steps": 100, "schedule": "cosine",
    "min_lr_ratio": 0.1, "weight_decay": 0.1, "clip_norm": 1.0, "compute_dtype": "bfloat16", "remat": "none",
    "unroll_layers": True, "checkpoint_every": 300, "log_every": 50, "seed": 0,
}


class TextModelError(ValueError):
    """Bad input to a stage (missing corpus, mismatched tokenizer, ...); the message says what."""


# ----------------------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[str]:
    """Relative POSIX paths of the corpus's `.py` files under `root`, sorted: none inside `SKIP_DIRS`,
    none under a top-level `config-*` directory (build configuration), no `_sysconfigdata*` module."""
    root = Path(root)
    if not root.is_dir():
        raise TextModelError(f"{root}: not a directory (expected a Python standard library)")
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        dirs = rel.parts[:-1]
        if SKIP_DIRS.intersection(dirs) or (dirs and dirs[0].startswith("config-")):
            continue
        if rel.name.startswith("_sysconfigdata") or not p.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel: str, fraction: float) -> bool:
    """Whether the file at relative POSIX path `rel` is held out: the first 8 bytes of the SHA-256 of
    the path, as a big-endian integer over 2**64, are below `fraction`."""
    h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")
    return h < fraction * 2**64


def read_documents(root: Path, files: Sequence[str]) -> list[str]:
    """Each file's text (UTF-8, undecodable bytes replaced by U+FFFD)."""
    return [(Path(root) / f).read_bytes().decode("utf-8", errors="replace") for f in files]


def split_files(root: Path, heldout_fraction: float) -> dict[str, list[str]]:
    """{"train": [...], "heldout": [...]}: the non-empty corpus files of `root` by split, sorted (held out:
    `is_heldout` and at most `MAX_HELDOUT_BYTES`)."""
    if not 0 < heldout_fraction < 1:
        raise TextModelError(f"--heldout-fraction {heldout_fraction}: must be in (0, 1)")
    sizes = {f: (Path(root) / f).stat().st_size for f in corpus_files(root)}
    files = [f for f, n in sizes.items() if n > 0]
    split: dict[str, list[str]] = {"train": [], "heldout": []}
    for f in files:
        held = is_heldout(f, heldout_fraction) and sizes[f] <= MAX_HELDOUT_BYTES
        split["heldout" if held else "train"].append(f)
    if not split["train"] or not split["heldout"]:
        raise TextModelError(f"{root}: {len(files)} corpus files give an empty train or held-out split")
    return split


def load_tokenizer(path: str | Path) -> Any:
    """A `tokenizers.Tokenizer` from `path`, checked to have `<|pad|>` = 0 and `<|endoftext|>` = 1."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise TextModelError(f"--tokenizer {path}: {e}") from None
    if tok.token_to_id(PAD) != 0 or tok.token_to_id(EOS) != 1:
        raise TextModelError(f"--tokenizer {path}: expected {PAD} = 0 and {EOS} = 1 (a tokenizer of "
                             "`python -m train.text_model tokenizer`)")
    return tok


def encode_documents(tok: Any, docs: Sequence[str]) -> list[np.ndarray]:
    """Token ids (uint32) of each document, without specials."""
    return [np.asarray(e.ids, np.uint32) for e in tok.encode_batch(list(docs), add_special_tokens=False)]


def write_stream(path: Path, docs: Sequence[np.ndarray]) -> int:
    """Writes the documents as one little-endian uint32 stream, eos (1) after each; returns its length."""
    eos = np.ones(1, np.uint32)
    stream = np.concatenate([x for d in docs for x in (d, eos)]).astype("<u4")
    stream.tofile(path)
    return int(stream.size)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_corpus(out: Path, tokenizer: Path, *, stdlib: Path | None = None,
                 heldout_fraction: float = HELDOUT_FRACTION) -> dict[str, Any]:
    """Writes `out/{train,heldout}.bin` and `out/manifest.json` (returned) from `stdlib` (default: the
    running interpreter's) tokenized with `tokenizer`."""
    root = stdlib_root() if stdlib is None else Path(stdlib)
    split = split_files(root, heldout_fraction)
    tok = load_tokenizer(tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "python": sys.version.split()[0], "stdlib": str(root), "heldout_fraction": heldout_fraction,
        "tokenizer_sha256": sha256_file(tokenizer), "vocab_size": tok.get_vocab_size(), "eos_id": 1, "splits": {}}
    for name, files in split.items():
        texts = read_documents(root, files)
        ids = encode_documents(tok, texts)
        n = write_stream(out / f"{name}.bin", ids)
        manifest["splits"][name] = {
            "documents": len(files), "bytes": sum(len(t.encode("utf-8")) for t in texts), "tokens": n,
            "sha256": sha256_file(out / f"{name}.bin"), "files": files}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_documents_bin(path: Path) -> list[np.ndarray]:
    """The documents of a token stream written by `build_corpus` (split at eos, eos dropped): the
    held-out set in the form the evaluation, and any later measurement on it, reads."""
    path = Path(path)
    if not path.is_file():
        raise TextModelError(f"{path}: no such token file (run the corpus stage first)")
    stream = np.fromfile(path, "<u4")
    ends = np.flatnonzero(stream == 1)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [stream[a:b] for a, b in zip(starts, ends, strict=True) if b > a]


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE tokenizer of `vocab_size` ids trained on `texts` (ids 0, 1: pad, eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer)
    return tok


def write_tokenizer(tok: Any, out: Path, model_max_length: int) -> None:
    """`out/tokenizer.json` and `out/tokenizer_config.json` (eos, pad, the chat template)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=False)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS, "pad_token": PAD,
              "unk_token": None, "add_bos_token": False, "add_eos_token": False,
              "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------- model and training


def model_config(path: str | Path | None = None) -> LingConfig:
    """The `text-model` preset, or the HF config.json at `path`."""
    return LingConfig.preset(PRESET) if path is None else LingConfig.from_hf(path)


def check_vocab(cfg: LingConfig, tokenizer: Path) -> None:
    """TextModelError unless the tokenizer's ids fit the model and its eos is the model's."""
    n = load_tokenizer(tokenizer).get_vocab_size()
    if n > cfg.vocab_size:
        raise TextModelError(f"the tokenizer has {n} ids, more than the model's vocab_size {cfg.vocab_size}")
    if cfg.eos_token_id[:1] != (1,) or cfg.pad_token_id != 0:
        raise TextModelError(f"the model's eos_token_id {cfg.eos_token_id} / pad_token_id {cfg.pad_token_id} must "
                             "be 1 / 0, the tokenizer's")


def train_options(train_config: str | Path | None, **flags: Any) -> dict[str, Any]:
    """TRAIN_DEFAULTS, then the options of the JSON file `train_config`, then the non-None `flags`;
    `keep_checkpoints` (unless given) keeps every checkpoint of the run."""
    opts = dict(TRAIN_DEFAULTS)
    if train_config is not None:
        p = Path(train_config)
        try:
            opts.update(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise TextModelError(f"--train-config {p}: {e}") from None
    opts.update({k: v for k, v in flags.items() if v is not None})
    if "schedule_steps" not in opts and opts.get("schedule") == "cosine":
        opts["schedule_steps"] = opts["steps"]
    opts.setdefault("keep_checkpoints", -(-opts["steps"] // opts["checkpoint_every"]) + 1)
    return opts


def train(out: Path, corpus: Path, tokenizer: Path, opts: dict[str, Any], model_config_path: str | Path | None
          ) -> Path:
    """Runs `ling-train` on `corpus/train.bin` into `out/run`; returns the run directory. A run that
    already holds checkpoints resumes (up to `opts["steps"]`)."""
    from train.config import TrainConfig
    from train.main import main as ling_train

    cfg = model_config(model_config_path)
    check_vocab(cfg, tokenizer)
    data = corpus / "train.bin"
    if not data.is_file():
        raise TextModelError(f"{data}: no such token file (run the corpus stage first)")
    out.mkdir(parents=True, exist_ok=True)
    model_file = out / "model_config.json"
    model_file.write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    tcfg = {k: v for k, v in opts.items() if k != "steps"}
    try:
        TrainConfig.load(None, **opts)  # a bad option fails here, with its name
    except (TypeError, ValueError) as e:
        raise TextModelError(f"training options: {e}") from None
    config_file = out / "train_config.json"
    config_file.write_text(json.dumps(tcfg, indent=2) + "\n")
    run = out / "run"
    rc = ling_train(["--init", f"random:{model_file}", "--data", str(data), "--out", str(run),
                     "--steps", str(opts["steps"]), "--config", str(config_file)])
    if rc != 0:
        raise TextModelError(f"ling-train exited with {rc}")
    return run


def run_checkpoints(run: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint a `ling-train` run kept, by step."""
    d = Path(run) / "checkpoints"
    steps = sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()) if d.is_dir() else []
    if not steps:
        raise TextModelError(f"{run}: no checkpoints (run the train stage first)")
    return [(s, d / str(s)) for s in steps]


# ----------------------------------------------------------------------------- evaluation


def load_model(path: str | Path, dtype: str) -> tuple[LingConfig, Params]:
    """(config, params) of an HF directory (one holding `*.safetensors`) or an Orbax checkpoint."""
    import ling_jax

    p = Path(path)
    if not p.is_dir():
        raise TextModelError(f"--checkpoint {p}: not a directory")
    if any(p.glob("*.safetensors")):
        return ling_jax.load_hf_checkpoint(p, dtype=dtype)
    return ling_jax.load_checkpoint(p, dtype=dtype)


def windows(docs: Sequence[np.ndarray], seq_len: int) -> list[np.ndarray]:
    """Each document cut into consecutive windows of at most `seq_len` tokens (each evaluated on its
    own, so a window's first tokens lack the context before it); windows of one token are dropped."""
    out = [d[i : i + seq_len] for d in docs for i in range(0, d.size, seq_len)]
    return [w for w in out if w.size >= 2]


@functools.partial(jax.jit, static_argnums=0)
def _window_sums(cfg: LingConfig, params: Params, ids: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Sums over the real positions of a padded batch [B, T] (right padding, `mask` True at tokens):
    main NLL / correct / count for token t+1 at t; per MTP layer j NLL / correct / agreement / count
    for token t+2+j at t."""
    import ling_jax

    logits, mtp = ling_jax.forward_with_mtp(cfg, params, ids, attention_mask=mask)
    pred = jnp.argmax(logits, -1)

    def nll(lg: jax.Array, tgt: jax.Array) -> jax.Array:
        lse = jax.nn.logsumexp(lg, -1)
        return lse - jnp.take_along_axis(lg, tgt[..., None], -1)[..., 0]

    def total(x: jax.Array, valid: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(valid, x, 0).astype(jnp.float32))

    v1 = mask[:, 1:]
    out = {"main_nll": total(nll(logits[:, :-1], ids[:, 1:]), v1),
           "main_correct": total(pred[:, :-1] == ids[:, 1:], v1), "main_count": total(v1, v1)}
    for j, lg in enumerate(mtp):
        k = 2 + j  # MTP layer j at t predicts token t + 2 + j
        vk = mask[:, k:]
        mpred = jnp.argmax(lg[:, :-k], -1)
        out[f"mtp{j}_nll"] = total(nll(lg[:, :-k], ids[:, k:]), vk)
        out[f"mtp{j}_correct"] = total(mpred == ids[:, k:], vk)
        out[f"mtp{j}_agree"] = total(mpred == pred[:, k - 1 : -1], vk)
        out[f"mtp{j}_count"] = total(vk, vk)
    return out


def evaluate(cfg: LingConfig, params: Params, docs: Sequence[np.ndarray], *, seq_len: int = 1024, batch_size: int = 16
             ) -> dict[str, Any]:
    """Held-out metrics of a model on `docs` (token arrays), in windows of `seq_len` (see `windows`),
    `batch_size` windows per jitted call (the last batch padded with empty rows): `main` {loss (mean
    NLL in nats over predicted tokens), perplexity, top1, tokens}, and `mtp`, one entry per MTP layer
    j: {loss, top1 (token t+2+j), agreement (with the main model's argmax at t+1+j), tokens}."""
    rows = windows(docs, seq_len)
    if not rows:
        raise TextModelError("no held-out window of 2 or more tokens to evaluate")
    t = max(w.size for w in rows)
    sums: dict[str, float] = {}
    for lo in range(0, len(rows), batch_size):
        ids = np.zeros((batch_size, t), np.int32)
        mask = np.zeros((batch_size, t), bool)
        for r, w in enumerate(rows[lo : lo + batch_size]):
            ids[r, : w.size], mask[r, : w.size] = w, True
        for k, v in _window_sums(cfg, params, ids, mask).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    main_loss = sums["main_nll"] / sums["main_count"]
    out: dict[str, Any] = {
        "windows": len(rows), "seq_len": t,
        "main": {"loss": main_loss, "perplexity": float(np.exp(main_loss)),
                 "top1": sums["main_correct"] / sums["main_count"], "tokens": int(sums["main_count"])},
        "mtp": []}
    for j in range(cfg.num_nextn_predict_layers):
        n = sums[f"mtp{j}_count"]
        out["mtp"].append({"layer": j, "predicts": f"t+{2 + j}", "loss": sums[f"mtp{j}_nll"] / n,
                           "top1": sums[f"mtp{j}_correct"] / n, "agreement": sums[f"mtp{j}_agree"] / n,
                           "tokens": int(n)})
    return out


def eval_checkpoint(path: Path, heldout: Path, *, dtype: str, seq_len: int, batch_size: int) -> dict[str, Any]:
    """`evaluate` of the checkpoint at `path` (HF or Orbax) on the documents of `heldout` (.bin)."""
    cfg, params = load_model(path, dtype)
    docs = read_documents_bin(heldout)
    res = evaluate(cfg, params, docs, seq_len=seq_len, batch_size=batch_size)
    return {"checkpoint": str(path), "dtype": dtype, "documents": len(docs), **res}


def speculative_prompts(docs: Sequence[np.ndarray], n: int, prompt_len: int, new_tokens: int) -> list[np.ndarray]:
    """The first `prompt_len` tokens of each of the first `n` documents (in their order) holding at least
    `prompt_len + new_tokens` tokens: prompts whose continuation is real held-out text."""
    out = [d[:prompt_len] for d in docs if d.size >= prompt_len + new_tokens][:n]
    if not out:
        raise TextModelError(f"no held-out document holds {prompt_len} + {new_tokens} tokens")
    return out


def speculative_eval(cfg: LingConfig, params: Params, prompts: Sequence[np.ndarray], *, new_tokens: int,
                     ks: Sequence[int] = (1, 2, 3), batch_sizes: Sequence[int] = (1,)) -> dict[str, Any]:
    """Greedy `generate` of `new_tokens` per prompt (never stopping early), without speculation and with
    `speculative_tokens=k` for each k in `ks`, in batches of each size in `batch_sizes` (prompts in
    order; a size larger than the prompts gives one batch of all): per (batch size, k) the mean accepted
    length (tokens per row per verify step, 1 to k + 1) and acceptance rate over all batches, the rows
    whose tokens equal the plain ones, and wall-clock output tokens/s (every shape compiled by an untimed
    first batch; block until the tokens are on the host) with its ratio to plain decoding."""
    import ling_jax

    runs: list[dict[str, Any]] = []
    for bs in batch_sizes:
        batches = [list(prompts[i : i + bs]) for i in range(0, len(prompts), bs)]
        plain: list[list[int]] = []
        plain_rate = 0.0
        for k in (0, *ks):
            run = functools.partial(ling_jax.generate, cfg, params, max_new_tokens=new_tokens, stop_tokens=(),
                                    speculative_tokens=k)
            run(batches[0])  # compiles this batch shape (a smaller last batch compiles inside the clock)
            toks: list[list[int]] = []
            sums = {"row_steps": 0, "accepted_drafts": 0}
            t0 = time.perf_counter()
            for b in batches:
                st: dict[str, Any] = {}
                toks += run(b, stats=st)
                for key in sums if k else ():
                    sums[key] += st[key]
            seconds = time.perf_counter() - t0
            rate = sum(map(len, toks)) / seconds
            if k == 0:
                plain, plain_rate = toks, rate
            r: dict[str, Any] = {"batch_size": len(batches[0]), "speculative_tokens": k, "prompts": len(toks),
                                 "new_tokens": new_tokens, "seconds": seconds, "output_tokens_per_s": rate,
                                 "rows_equal_to_plain": sum(x == y for x, y in zip(toks, plain, strict=True))}
            if k:
                rs, acc = sums["row_steps"], sums["accepted_drafts"]
                r.update(mean_accepted_length=(rs + acc) / rs, acceptance_rate=acc / (k * rs),
                         speedup=rate / plain_rate)
            runs.append(r)
    return {"runs": runs}


def speculative_checkpoint(path: Path, heldout: Path, *, dtype: str, prompts: int, prompt_len: int,
                           new_tokens: int, batch_sizes: Sequence[int]) -> dict[str, Any]:
    """`speculative_eval` of the checkpoint at `path` on prompts from the documents of `heldout` (.bin)."""
    cfg, params = load_model(path, dtype)
    if not cfg.num_nextn_predict_layers:
        raise TextModelError(f"{path}: the model has no MTP layer to draft with")
    ps = speculative_prompts(read_documents_bin(heldout), prompts, prompt_len, new_tokens)
    res = speculative_eval(cfg, params, ps, new_tokens=new_tokens, batch_sizes=batch_sizes)
    return {"checkpoint": str(path), "dtype": dtype, "prompt_len": prompt_len, "device": jax.devices()[0].device_kind,
            **res}


def speculative_summary(res: dict[str, Any]) -> str:
    lines = []
    for r in res["runs"]:
        s = (f"batch {r['batch_size']} k={r['speculative_tokens']}: {r['output_tokens_per_s']:.1f} tok/s, "
             f"{r['rows_equal_to_plain']}/{r['prompts']} rows equal to plain")
        if r["speculative_tokens"]:
            s += (f", accepted length {r['mean_accepted_length']:.3f}, acceptance {100 * r['acceptance_rate']:.1f}%,"
                  f" {r['speedup']:.2f}x plain")
        lines.append(s)
    return "\n".join(lines)


def summary(res: dict[str, Any]) -> str:
    m = res["main"]
    s = f"loss {m['loss']:.4f} (ppl {m['perplexity']:.2f}, top-1 {100 * m['top1']:.1f}%)"
    for x in res["mtp"]:
        s += (f" | MTP {x['layer']} ({x['predicts']}): loss {x['loss']:.4f}, top-1 {100 * x['top1']:.1f}%, "
              f"agrees with main {100 * x['agreement']:.1f}%")
    return s


# ----------------------------------------------------------------------------- export and size


def export(checkpoint: Path, out: Path, tokenizer: Path) -> Path:
    """The Orbax checkpoint as an HF directory at `out` (replaced if it exists): block-FP8 with the
    config's `quantization_config` (bfloat16 when it has none), with `tokenizer` copied in as
    `tokenizer.json` and the `tokenizer_config.json` beside it, if there is one."""
    from ling_jax.checkpoint.export import export_checkpoint
    from ling_jax.checkpoint.orbax_io import open_checkpoint

    dtype = "float8" if open_checkpoint(checkpoint).cfg.quantization is not None else "bfloat16"
    shutil.rmtree(out, ignore_errors=True)
    export_checkpoint(checkpoint, out, dtype=dtype)
    shutil.copyfile(tokenizer, out / "tokenizer.json")
    if (Path(tokenizer).parent / "tokenizer_config.json").is_file():
        shutil.copyfile(Path(tokenizer).parent / "tokenizer_config.json", out / "tokenizer_config.json")
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def export_sizes(cfg: LingConfig) -> dict[str, int]:
    """{"params": count, "bfloat16": bytes, "float8": bytes (absent without a quantization_config)}:
    the on-disk size of the config's HF export (config.json, index, safetensors), from the real
    writer run on constant weights in a temporary directory."""
    from ling_jax.checkpoint.export import save_hf_checkpoint
    from ling_jax.params import build_tree, param_slots

    params = build_tree(cfg, lambda s: np.full(s.shape, 0.01, np.float32))
    out = {"params": sum(int(np.prod(s.shape)) for s in param_slots(cfg))}
    quants = {"bfloat16": None} | ({} if cfg.quantization is None else {"float8": cfg.quantization})
    with tempfile.TemporaryDirectory() as tmp:
        for name, quant in quants.items():
            d = save_hf_checkpoint(cfg, params, Path(tmp) / name, dtype="bfloat16", quantization=quant)
            out[name] = dir_bytes(d)
    return out


# ----------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m train.text_model", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(name: str, help: str, out: str | None = None, tokenizer: bool = False) -> argparse.ArgumentParser:
        """A subcommand, with a required --out (its help `out`) and --tokenizer where asked."""
        p = sub.add_parser(name, help=help, description=help)
        if out is not None:
            p.add_argument("--out", type=Path, required=True, metavar=out.split(",")[0], help=out)
        if tokenizer:
            p.add_argument("--tokenizer", type=Path, default=TOKENIZER, help="default: the shipped tokenizer.json")
        return p

    def corpus_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--stdlib", type=Path, help="standard library directory (default: this interpreter's)")
        p.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION)

    def train_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model-config", type=Path, help=f"HF config.json (default: configs/{PRESET}.json)")
        p.add_argument("--train-config", type=Path, help="JSON of TrainConfig options over the defaults")
        for flag, typ in (("--steps", int), ("--batch-size", int), ("--seq-len", int), ("--lr", float),
                          ("--warmup-steps", int), ("--checkpoint-every", int)):
            p.add_argument(flag, type=typ, help=f"default {TRAIN_DEFAULTS[flag[2:].replace('-', '_')]}")

    def spec_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--spec-dtype", default="float32", choices=("bfloat16", "float32"))
        p.add_argument("--spec-prompts", type=int, default=16, help="held-out prompts (default 16)")
        p.add_argument("--spec-prompt-len", type=int, default=128)
        p.add_argument("--spec-new-tokens", type=int, default=128)
        p.add_argument("--spec-batch-sizes", type=int, nargs="+", default=[1, 16])

    def eval_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--eval-dtype", default="bfloat16", choices=("bfloat16", "float32"))
        p.add_argument("--eval-seq-len", type=int, default=TRAIN_DEFAULTS["seq_len"])
        p.add_argument("--eval-batch-size", type=int, default=16)

    corpus_args(add("corpus", "tokenized train / held-out corpus from the standard library -> DIR/corpus/",
                    "DIR", tokenizer=True))
    p = add("tokenizer", "train the byte-level BPE tokenizer on the train split -> OUT/tokenizer{,_config}.json",
            "OUT")
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    corpus_args(p)
    train_args(add("train", "ling-train on DIR/corpus/train.bin -> DIR/run", "DIR, holding corpus/",
                   tokenizer=True))
    p = add("eval", "held-out metrics of a checkpoint (HF or Orbax) -> printed and --json")
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--heldout", type=Path, required=True, help="heldout.bin of the corpus stage")
    p.add_argument("--json", type=Path, help="write the results here")
    eval_args(p)
    p = add("speculate", "greedy generate on held-out prompts with and without MTP speculation (k = 1, 2, 3): "
            "accepted length, tokens/s, equality to plain decoding -> printed and --json")
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--heldout", type=Path, required=True, help="heldout.bin of the corpus stage")
    p.add_argument("--json", type=Path, help="write the results here")
    spec_args(p)
    p = add("export", "an Orbax checkpoint -> HF directory OUT (block-FP8 where the config quantizes) with the "
            "tokenizer.json and the tokenizer_config.json beside it", "OUT", tokenizer=True)
    p.add_argument("--checkpoint", type=Path, required=True)
    p = add("all", "corpus, train, evaluate every checkpoint, export the best and evaluate it -> DIR", "DIR",
            tokenizer=True)
    p.add_argument("--train-tokenizer", action="store_true",
                   help="train a tokenizer on this machine's corpus into DIR/tokenizer (else --tokenizer)")
    corpus_args(p)
    train_args(p)
    eval_args(p)
    spec_args(p)
    p = add("size", "parameter count and exact HF export bytes (bfloat16, block-FP8) of a config")
    p.add_argument("--model-config", type=Path, help=f"HF config.json (default: configs/{PRESET}.json)")
    return ap


def _log(msg: str) -> None:
    print(f"[text-model] {msg}", flush=True)


def _train_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
            "warmup_steps": args.warmup_steps, "checkpoint_every": args.checkpoint_every}


def _corpus_log(manifest: dict[str, Any]) -> None:
    for name, s in manifest["splits"].items():
        _log(f"{name}: {s['documents']} files, {s['bytes']:,} bytes, {s['tokens']:,} tokens")


def _tokenizer_stage(out: Path, stdlib: Path | None, heldout_fraction: float, vocab_size: int) -> Path:
    root = stdlib_root() if stdlib is None else stdlib
    files = split_files(root, heldout_fraction)["train"]
    tok = train_tokenizer(read_documents(root, files), vocab_size)
    write_tokenizer(tok, out, LingConfig.preset(PRESET).max_position_embeddings)
    return out / "tokenizer.json"


def _speculate_stage(checkpoint: Path, heldout: Path, args: argparse.Namespace) -> dict[str, Any]:
    res = speculative_checkpoint(checkpoint, heldout, dtype=args.spec_dtype, prompts=args.spec_prompts,
                                 prompt_len=args.spec_prompt_len, new_tokens=args.spec_new_tokens,
                                 batch_sizes=args.spec_batch_sizes)
    _log(f"speculative decoding ({args.spec_dtype}, {res['device']}):\n{speculative_summary(res)}")
    return res


def _provenance() -> dict[str, Any]:
    """Where and when a report was made: device, versions, date, command line."""
    dev = jax.devices()[0]
    return {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """The `all` command: every stage into `args.out`; returns what it writes to `eval.json`."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer = args.tokenizer
    if args.train_tokenizer:
        tokenizer = _tokenizer_stage(out / "tokenizer", args.stdlib, args.heldout_fraction, VOCAB_SIZE)
        _log(f"tokenizer -> {tokenizer} ({time.perf_counter() - t0:.1f} s)")
    manifest = build_corpus(out / "corpus", tokenizer, stdlib=args.stdlib, heldout_fraction=args.heldout_fraction)
    _corpus_log(manifest)
    _log(f"corpus -> {out / 'corpus'} ({time.perf_counter() - t0:.1f} s)")
    opts = train_options(args.train_config, **_train_flags(args))
    run = train(out, out / "corpus", tokenizer, opts, args.model_config)
    _log(f"trained -> {run} ({time.perf_counter() - t0:.1f} s)")
    heldout = out / "corpus" / "heldout.bin"
    ev = functools.partial(eval_checkpoint, heldout=heldout, dtype=args.eval_dtype, seq_len=args.eval_seq_len,
                           batch_size=args.eval_batch_size)
    results = []
    for step, path in run_checkpoints(run):
        res = {"step": step, **ev(path)}
        _log(f"step {step}: {summary(res)}")
        results.append(res)
    best = min(results, key=lambda r: r["main"]["loss"])
    model_dir = export(Path(best["checkpoint"]), out / "model", Path(tokenizer))
    exported = ev(model_dir)
    size = dir_bytes(model_dir)
    _log(f"exported step {best['step']} -> {model_dir} ({size:,} bytes): {summary(exported)}")
    spec = _speculate_stage(model_dir, heldout, args)
    report = {"best_step": best["step"], "model_dir": str(model_dir), "model_dir_bytes": size,
              "exported": exported, "speculative": spec, "checkpoints": results, "train_options": opts,
              "corpus": {k: {x: v for x, v in s.items() if x != "files"} for k, s in manifest["splits"].items()},
              "python": manifest["python"], "seconds": time.perf_counter() - t0, **_provenance()}
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    _log(f"done in {report['seconds']:.1f} s -> {out / 'eval.json'}")
    return report


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    try:
        if args.cmd == "corpus":
            _corpus_log(build_corpus(args.out / "corpus", args.tokenizer, stdlib=args.stdlib,
                                     heldout_fraction=args.heldout_fraction))
        elif args.cmd == "tokenizer":
            _log(f"wrote {_tokenizer_stage(args.out, args.stdlib, args.heldout_fraction, args.vocab_size)}")
        elif args.cmd == "train":
            train(args.out, args.out / "corpus", args.tokenizer, train_options(args.train_config,
                                                                               **_train_flags(args)),
                  args.model_config)
        elif args.cmd == "eval":
            res = eval_checkpoint(args.checkpoint, args.heldout, dtype=args.eval_dtype, seq_len=args.eval_seq_len,
                                  batch_size=args.eval_batch_size)
            print(json.dumps(res, indent=2))
            if args.json is not None:
                args.json.write_text(json.dumps(res, indent=2) + "\n")
        elif args.cmd == "speculate":
            res = _speculate_stage(args.checkpoint, args.heldout, args)
            if args.json is not None:
                args.json.write_text(json.dumps(res, indent=2) + "\n")
        elif args.cmd == "export":
            d = export(args.checkpoint, args.out, args.tokenizer)
            _log(f"wrote {d} ({dir_bytes(d):,} bytes)")
        elif args.cmd == "size":
            print(json.dumps(export_sizes(model_config(args.model_config)), indent=2))
        else:
            run_all(args)
    except (TextModelError, ConfigError, OSError) as e:
        print(f"text_model: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training data: token files or raw text -> packed [B, T] batches with segment ids.

A corpus is one flat stream of token ids in which each document ends with the end-of-sequence id:
`.bin` (raw little-endian uint32) and `.npy` (an integer array) files are read memory-mapped and
are expected to carry those separators already; `.txt` (one document per non-empty line) and
`.jsonl` (one `{"text": ...}` object per line) are tokenized with a `tokenizer.json` and get an
eos appended to each document. A directory means all such files in it, in sorted order.

Packing cuts the stream into consecutive windows of T + 1 tokens (inputs and next-token labels).
Inside a window a new segment starts after every eos, so KDA, the short conv and MLA never look
across a document boundary; the label of an eos (the next document's first token) is masked.
The iterator is deterministic and checkpointable: its state is `{"epoch", "index"}` (plus the
window count, length, seed and order it refers to, checked on resume), and epoch e visits the
windows in the order of a permutation seeded by (seed, e). The tail of fewer than T + 1 tokens
is never trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ling_jax.cli import UsageError

IGNORE = -100
TOKEN_SUFFIXES = (".bin", ".npy")
TEXT_SUFFIXES = (".txt", ".jsonl")


class DataError(ValueError):
    """A corpus that cannot be trained on; the message names the file."""


class DataArgumentError(DataError, UsageError):
    """A corpus that cannot be trained on as the command line asks: a `--data` path that is missing or
    holds no corpus files, text without a tokenizer, a batch larger than the corpus, a resume with
    another corpus or order."""


class TokenStream:
    """Token arrays (memory-mapped files, tokenized text) read as one stream without concatenating
    them: `size` and `[lo:hi]` slices, which copy only the parts they cover."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.starts = np.cumsum([0] + [p.size for p in parts])
        self.size = int(self.starts[-1])

    def __getitem__(self, sl: slice) -> np.ndarray:
        lo, hi, _ = sl.indices(self.size)
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        pieces = []
        for k in range(max(first, 0), len(self.parts)):
            if self.starts[k] >= hi:
                break
            a, b = max(lo - self.starts[k], 0), min(hi - self.starts[k], self.parts[k].size)
            pieces.append(np.asarray(self.parts[k][a:b]))
        return np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)


def data_files(path: str | Path) -> list[Path]:
    """The corpus files `path` names (itself, or a directory's corpus files in sorted order);
    DataArgumentError when there are none."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in TOKEN_SUFFIXES + TEXT_SUFFIXES)
        if not files:
            raise DataArgumentError(f"--data {path}: no .bin/.npy/.txt/.jsonl files in this directory")
        return files
    if not path.exists():
        raise DataArgumentError(f"--data {path}: no such file or directory")
    if path.suffix not in TOKEN_SUFFIXES + TEXT_SUFFIXES:
        raise DataArgumentError(f"--data {path}: unsupported file type {path.suffix!r} (use .bin, .npy, .txt or "
                                ".jsonl)")
    return [path]


def _documents(path: Path) -> list[str]:
    docs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                docs.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{path}:{n}: not a JSON object with a 'text' field ({e})") from None
        else:
            docs.append(line)
    return docs


def load_tokens(path: str | Path, *, vocab_size: int, eos_id: int, tokenizer: str | Path | None = None
                ) -> np.ndarray | TokenStream:
    """The whole corpus as one 1-D integer stream: an array for one file (memory-mapped for a token
    file), a `TokenStream` over a directory's files (each memory-mapped, never copied whole)."""
    parts: list[np.ndarray] = []
    tok = None
    for f in data_files(path):
        if f.suffix in TOKEN_SUFFIXES and f.stat().st_size == 0:
            raise DataError(f"{f}: the corpus is empty (0 bytes)")
        if f.suffix == ".bin":
            if f.stat().st_size % 4:
                raise DataError(f"{f}: size {f.stat().st_size} is not a multiple of 4 (uint32 tokens)")
            parts.append(np.memmap(f, dtype="<u4", mode="r"))
        elif f.suffix == ".npy":
            arr = np.load(f, mmap_mode="r")
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise DataError(f"{f}: expected a 1-D integer array, got {arr.dtype} {arr.shape}")
            parts.append(arr)
        else:
            if tokenizer is None:
                raise DataArgumentError(f"{f}: text data needs --tokenizer tokenizer.json")
            if tok is None:
                from tokenizers import Tokenizer

                try:
                    tok = Tokenizer.from_file(str(tokenizer))
                except Exception as e:  # the tokenizers library raises plain Exceptions
                    raise DataArgumentError(f"--tokenizer {tokenizer}: {e}") from None
            ids = [t for doc in _documents(f) for t in [*tok.encode(doc, add_special_tokens=False).ids, eos_id]]
            parts.append(np.asarray(ids, np.uint32))
    tokens = parts[0] if len(parts) == 1 else TokenStream(parts)
    if tokens.size < 2:
        raise DataError(f"--data {path}: the corpus is empty (needs at least 2 tokens)")
    for lo in range(0, tokens.size, 1 << 24):  # bounded memory even for huge memmaps
        chunk = np.asarray(tokens[lo : lo + (1 << 24)])
        if chunk.max() >= vocab_size or chunk.min() < 0:
            bad = int(chunk.max() if chunk.max() >= vocab_size else chunk.min())
            at = lo + int(np.argmax(chunk == bad))
            raise DataError(f"--data {path}: token id {bad} at position {at} is outside [0, vocab_size={vocab_size})")
    return tokens


class PackedBatches:
    """Deterministic, checkpointable iterator of packed batches {"inputs", "labels", "segment_ids"} [B, T]."""

    def __init__(self, tokens: np.ndarray | TokenStream, *, seq_len: int, batch_size: int, eos_id: int,
                 seed: int = 0, shuffle: bool = True, state: dict[str, int] | None = None):
        self.tokens, self.seq_len, self.batch_size, self.eos_id = tokens, seq_len, batch_size, eos_id
        self.seed, self.shuffle = seed, shuffle
        self.n_windows = (tokens.size - 1) // seq_len
        if self.n_windows < batch_size:
            raise DataArgumentError(f"the corpus has {tokens.size} tokens: {self.n_windows} sequences of "
                                    f"seq_len={seq_len} + 1, fewer than one batch of {batch_size} (each batch "
                                    "would repeat sequences)")
        self.epoch, self.index = (0, 0) if state is None else (int(state["epoch"]), int(state["index"]))
        if state is not None:
            self._check_resume(state)
        self._order = self._permutation(self.epoch)

    def _check_resume(self, state: dict[str, int]) -> None:
        """DataArgumentError unless `state` was taken over this corpus with this order (a position in another
        corpus or order would resume at other tokens)."""
        ours = self.state()
        changed = [f"{k} {state[k]} -> {ours[k]}" for k in ("n_windows", "seq_len", "seed", "shuffle")
                   if k in state and state[k] != ours[k]]
        if changed or not 0 <= self.index <= self.n_windows:
            raise DataArgumentError("the checkpoint's data position belongs to another corpus or order ("
                                    + (", ".join(changed) or f"window {self.index} of {self.n_windows}")
                                    + "): resume with the run's --data, --seq-len, seed and shuffle, or start a "
                                      "new --out")

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_windows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def state(self) -> dict[str, int]:
        """The position (epoch, index), with what it is a position in (corpus windows, order)."""
        return {"epoch": self.epoch, "index": self.index, "n_windows": self.n_windows, "seq_len": self.seq_len,
                "seed": self.seed, "shuffle": int(self.shuffle)}

    def window(self, w: int) -> dict[str, np.ndarray]:
        """Inputs, labels and segment ids of window `w`: each [T]."""
        t = self.seq_len
        seq = np.asarray(self.tokens[w * t : w * t + t + 1]).astype(np.int32)
        is_eos = seq[:-1] == self.eos_id
        seg = np.concatenate([[0], np.cumsum(is_eos)[:-1]]).astype(np.int32)  # new segment after each eos
        labels = np.where(is_eos, IGNORE, seq[1:]).astype(np.int32)
        return {"inputs": seq[:-1], "labels": labels, "segment_ids": seg}

    def __iter__(self) -> PackedBatches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rows = []
        for _ in range(self.batch_size):
            if self.index == self.n_windows:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            rows.append(self.window(int(self._order[self.index])))
            self.index += 1
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

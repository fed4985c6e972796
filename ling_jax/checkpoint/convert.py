"""`ling-convert`: an HF Ling-3 checkpoint (BF16/FP32 or block-FP8 safetensors) -> our Orbax checkpoint.

`convert_hf_to_orbax` is the whole job (the CLI is a thin wrapper):

1. Validate everything first: config.json (architecture, fields), the index against the files,
   every tensor's presence, shape and dtype, every FP8 scale grid (`HFSource.validate`), from the
   headers only. A bad input fails here and nothing is created at or next to the output path.
2. Plan every leaf (stored dtype, FP8 or not) and every source tensor, sorted by (file, offset)
   so each shard is read once, front to back.
3. Stream: read one source tensor into a fresh buffer (no memory map, whose pages would stay
   resident), dequantize / transpose it into our layout and hand it to tensorstore, which writes
   it into the element's own chunks of the stacked zarr3 array (`orbax_io.ItemWriter`). At most
   `window` bytes of writes are in flight, so host memory is a few times the largest tensor,
   whatever the size of the model or of a stacked leaf.
4. Each finished element is appended, with a CRC32 of its bytes, to `.convert/progress.log` in
   `<out>.partial`; a re-run with the same source and options reopens the arrays and skips what
   the log lists (resume). A run with other inputs discards the partial directory first.
5. Verify: read every element back through Orbax's read spec and compare its CRC32; parse the
   items with Orbax's own metadata reader. Then write the Orbax metadata, config.json and the
   manifest (which records the fingerprint of the source and options), and rename `<out>.partial`
   onto `<out>` (atomic commit).
6. A re-run onto a committed output whose manifest records this same conversion (same source
   files, config and options) changes nothing and succeeds (verifying it first against the
   source if it was written without verification and this run verifies); any other committed
   output is refused.

`--dtype bfloat16` dequantizes FP8 blocks in float32 and rounds once to bfloat16; tensors stored in
float32 (A_log, dt_bias, expert_bias, a float32 router) stay float32. `--dtype float8` keeps the FP8
weights bit for bit, transposed into our layout, with their block scales in the `scales` item.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fcntl
import hashlib
import json
import shutil
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ling_jax.checkpoint import fp8
from ling_jax.checkpoint.hf import HFSource, scale_name
from ling_jax.checkpoint.layout import transpose2d
from ling_jax.checkpoint.orbax_io import (
    CONFIG,
    CONVERT_STATE,
    DEFAULT_CHUNK_BYTES,
    MANIFEST,
    PARAMS,
    SCALES,
    CheckpointReader,
    ItemWriter,
    fsync_dir,
    leaf_key,
    open_checkpoint,
    partial_dir,
    scale_shape,
    write_manifest,
    write_step_metadata,
    write_text_atomic,
)
from ling_jax.checkpoint.safetensors_io import CheckpointError
from ling_jax.cli import OutputExistsError, UsageError, existing_dir, run_command
from ling_jax.config import LingConfig
from ling_jax.params import ParamSlot, param_slots

DTYPES = ("bfloat16", "float8", "float32")
BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
STATE_VERSION = 1


@dataclasses.dataclass
class LeafPlan:
    """How one leaf of the param pytree is stored."""

    slot: ParamSlot
    key: str
    dtype: np.dtype
    fp8_block: tuple[int, int] | None  # our layout; set when the leaf is stored FP8 (+ a scale leaf)
    source_dtypes: list[str]

    @property
    def n_stack(self) -> int:
        return len(self.slot.stack_shape)

    def scale_shape(self) -> tuple[int, ...]:
        assert self.fp8_block is not None
        return scale_shape(self.slot, self.fp8_block)


@dataclasses.dataclass
class Work:
    """One source tensor (one stacked element of a leaf)."""

    leaf: LeafPlan
    idx: tuple[int, ...]
    name: str  # as stored in the source
    fp8: bool  # stored FP8 with a block scale in the source
    nbytes: int  # source bytes (weight + scale)
    out_bytes: int  # bytes of the element in our layout and dtype
    order: tuple[str, int]

    @property
    def log_key(self) -> str:
        return f"{self.leaf.key}\t{','.join(map(str, self.idx))}"


def _plan(cfg: LingConfig, src: HFSource, dtype: str) -> tuple[list[LeafPlan], list[Work]]:
    leaves, work = [], []
    for slot in param_slots(cfg):
        names = [(idx, src.resolve(name)) for idx, name in slot.hf_names()]
        n_fp8 = sum(src.is_fp8(n) for _, n in names)
        src_dtypes = sorted({"F8_E4M3" if src.is_fp8(n) else src.st.dtype_name(n) for _, n in names})
        block = None
        if dtype == "float8" and n_fp8 == len(names) and n_fp8 > 0:
            b = src.block
            assert b is not None
            block = (b[1], b[0]) if slot.leaf.transform == "T" else b
            store = np.dtype(fp8.FP8)
        else:
            wide = (slot.leaf.fp32 or dtype == "float32" or bool({"F32", "F64"} & set(src_dtypes))
                    or (dtype == "float8" and 0 < n_fp8 < len(names)))  # a mixed FP8/float leaf: exact in f32
            store = F32 if wide else BF16
        lp = LeafPlan(slot, leaf_key(slot.path), store, block, src_dtypes)
        leaves.append(lp)
        out_bytes = store.itemsize * int(np.prod(slot.shape[len(slot.stack_shape):]))
        for idx, name in names:
            nbytes = src.st.nbytes(name) + (src.st.nbytes(scale_name(name)) if src.is_fp8(name) else 0)
            work.append(Work(lp, idx, name, src.is_fp8(name), nbytes, out_bytes, src.st.offset(name)))
    work.sort(key=lambda w: w.order)
    return leaves, work


def _produce(src: HFSource, w: Work) -> tuple[np.ndarray, np.ndarray | None]:
    """The element in our layout and stored dtype (+ its scale grid in our layout when kept FP8).

    Transposes move raw codes (1 byte for FP8) before any widening, and FP8 blocks are dequantized
    in the transposed layout with the transposed scale grid: the same float32 products as
    `fp8.dequantize` in the HF layout, on a quarter of the bytes to transpose.
    """
    leaf, lp = w.leaf.slot.leaf, w.leaf
    raw = src.st.read(w.name)
    scale = src.st.read(scale_name(w.name)).astype(np.float32) if w.fp8 else None
    block = src.block
    if leaf.transform == "T":
        raw = transpose2d(raw)
        if scale is not None:
            assert block is not None
            scale, block = np.ascontiguousarray(scale.T), (block[1], block[0])
    elif leaf.transform == "conv":
        raw = raw.reshape(raw.shape[0], raw.shape[-1])
    if lp.fp8_block is not None:
        return raw, scale
    if scale is not None:
        assert block is not None
        raw = fp8.dequantize(raw, scale, block)
    return np.ascontiguousarray(raw.astype(lp.dtype, copy=False)), None


def _crc(arr: np.ndarray | None) -> int:
    return -1 if arr is None else zlib.crc32(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def _fingerprint(hf_dir: Path, src: HFSource, dtype: str, compress: bool, chunk_bytes: int) -> dict[str, Any]:
    files = [[f, (hf_dir / f).stat().st_size, (hf_dir / f).stat().st_mtime_ns] for f in sorted(src.st.files)]
    cfg_hash = hashlib.sha256((hf_dir / CONFIG).read_bytes()).hexdigest()
    return {"state_version": STATE_VERSION, "source": str(hf_dir.resolve()), "files": files, "config": cfg_hash,
            "dtype": dtype, "compress": compress, "chunk_bytes": chunk_bytes}


def _read_log(path: Path) -> dict[str, tuple[int, int]]:
    done: dict[str, tuple[int, int]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 4 and parts[2].lstrip("-").isdigit() and parts[3].lstrip("-").isdigit():
                done[f"{parts[0]}\t{parts[1]}"] = (int(parts[2]), int(parts[3]))  # a torn last line is skipped
    return done


def _same_job(state: Path, fingerprint: dict[str, Any]) -> bool:
    """Whether the conversion state directory `state` was written by this exact job."""
    try:
        return json.loads((state / "state.json").read_text()) == fingerprint
    except (OSError, json.JSONDecodeError):
        return False


def _prepare_partial(tmp: Path, fingerprint: dict[str, Any], log: Callable[[str], None]) -> Any:
    """Creates or reopens `<out>.partial` for this exact job, under an exclusive lock; returns the lock.

    A partial directory left by a conversion of other inputs or options is emptied first.
    """
    state = tmp / CONVERT_STATE
    state.mkdir(parents=True, exist_ok=True)
    lock = open(state / "lock", "a")  # noqa: SIM115 (held until the conversion ends)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise CheckpointError(f"{tmp} is being written by another ling-convert") from None
    if not _same_job(state, fingerprint):
        stale = [f for f in (*tmp.iterdir(), *state.iterdir()) if f not in (state, state / "lock")]
        if stale:
            log(f"discarding the contents of {tmp}: an earlier conversion of other inputs or options")
        for f in stale:
            shutil.rmtree(f) if f.is_dir() else f.unlink()
        write_text_atomic(state / "state.json", json.dumps(fingerprint))
    return lock


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise UsageError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return dtype


def convert_hf_to_orbax(hf_dir: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16",
                        show_progress: bool = False, compress: bool = False, verify: bool = True,
                        chunk_bytes: int = DEFAULT_CHUNK_BYTES, log: Callable[[str], None] | None = None) -> Path:
    """Converts the HF checkpoint in `hf_dir` into our Orbax checkpoint at `out_dir`; returns its path.

    `dtype`: "bfloat16" (FP8 dequantized in float32, then rounded; float32 tensors kept float32),
    "float32", or "float8" (FP8 weights and their scales kept as they are; needs an FP8 source).
    `compress`: zstd chunks (Orbax's default; smaller, slower to write and read).
    `verify`: read every element back and compare its checksum before committing.
    Resumes an interrupted conversion of the same source with the same options. An `out_dir` that
    already holds the committed result of this same conversion is returned as it is (verified
    against the source first when `verify` and it was written without); `OutputExistsError` for
    an `out_dir` holding anything else.
    """
    _check_dtype(dtype)
    say = log or ((lambda m: print(m, file=sys.stderr)) if show_progress else (lambda m: None))
    hf = Path(hf_dir)
    out = Path(out_dir)
    if not hf.is_dir():
        raise CheckpointError(f"{hf}: no such directory")
    committed = (out / MANIFEST).is_file()  # the manifest is written just before the commit's rename
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not committed:
        raise OutputExistsError(f"{out} already exists (remove it or choose another output directory)")
    cfg = LingConfig.from_hf(hf)
    src = HFSource(hf, cfg)
    src.validate(param_slots(cfg))
    fingerprint = _fingerprint(hf, src, dtype, compress, chunk_bytes)
    leaves, work = _plan(cfg, src, dtype)
    if dtype == "float8" and not any(lp.fp8_block for lp in leaves):
        raise UsageError(f"{hf} has no block-FP8 weights to keep; --dtype float8 needs an FP8 source "
                         "(ling-export --dtype float8 quantizes a checkpoint whose config.json has a "
                         "quantization_config)")
    if committed:
        return _reuse(out, src, fingerprint, leaves, work, verify=verify, show=show_progress, say=say)
    # ---------------------------------------------------------------- everything checked: start writing
    tmp = partial_dir(out)
    init_ns = time.time_ns()
    lock = _prepare_partial(tmp, fingerprint, say)
    try:
        state = tmp / CONVERT_STATE
        done = _read_log(state / "progress.log")
        writers = {PARAMS: ItemWriter(tmp / PARAMS, compress=compress, chunk_bytes=chunk_bytes)}
        if any(lp.fp8_block for lp in leaves):
            writers[SCALES] = ItemWriter(tmp / SCALES, compress=compress, chunk_bytes=chunk_bytes)
        stores = {}
        for lp in leaves:
            stores[lp.key] = writers[PARAMS].array(lp.slot.path, lp.slot.shape, lp.dtype, lp.n_stack)
            if lp.fp8_block is not None:
                stores[lp.key + "/scale"] = writers[SCALES].array(lp.slot.path, lp.scale_shape(), F32, lp.n_stack)
        todo = [w for w in work if w.log_key not in done]
        if done:
            say(f"resuming {tmp}: {len(work) - len(todo)} of {len(work)} tensors already converted")
        _stream(src, todo, stores, state / "progress.log", done, total=sum(w.nbytes for w in work),
                initial=sum(w.nbytes for w in work if w.log_key in done), show=show_progress)
        for w in writers.values():
            w.finalize()
        if verify:
            reader = _reader(tmp, cfg, leaves)
            bad = _mismatches(reader, work, done, show_progress)
            if bad:  # e.g. chunks of a resumed run lost to a crash of the machine: write them again
                say(f"{len(bad)} tensors read back with other bytes than logged; writing them again")
                _stream(src, bad, stores, state / "progress.log", done, total=sum(w.nbytes for w in bad), initial=0,
                        show=show_progress)
                bad = _mismatches(_reader(tmp, cfg, leaves), bad, done, show_progress)
                if bad:
                    raise CheckpointError(f"verify: {bad[0].leaf.key}{list(bad[0].idx)} (from {bad[0].name}) reads "
                                          f"back with other bytes than were written ({len(bad)} tensors)")
            _check_orbax_view(tmp, leaves)
        write_step_metadata(tmp, writers, init_ns)
        write_text_atomic(tmp / CONFIG, json.dumps(cfg.to_hf(), indent=2) + "\n")
        stored = {lp.dtype.name for lp in leaves if not lp.slot.leaf.fp32}
        write_manifest(tmp, stored="float8" if dtype == "float8" else stored.pop() if len(stored) == 1 else "mixed",
                       fp8_blocks={lp.key: lp.fp8_block for lp in leaves if lp.fp8_block},
                       source_dtypes={lp.key: lp.source_dtypes for lp in leaves}, source=str(hf.resolve()),
                       tool="ling-convert", conversion={**fingerprint, "verified": verify})
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
        fsync_dir(out.parent)
    finally:
        lock.close()
    shutil.rmtree(out / CONVERT_STATE, ignore_errors=True)
    if verify:
        open_checkpoint(out)  # the committed directory opens as a complete checkpoint
    return out


# what a fingerprint's fields say when they differ (the others are named with both values)
_CHANGED = {"files": "the source's safetensors files changed (names, sizes or modification times)",
            "config": "the source's config.json changed", "state_version": "another conversion format"}


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two conversion fingerprints, in words."""
    return [_CHANGED.get(k) or f"{k} {old.get(k)} -> {new.get(k)}" for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k)]


def _reuse(out: Path, src: HFSource, fingerprint: dict[str, Any], leaves: list[LeafPlan], work: list[Work], *,
           verify: bool, show: bool, say: Callable[[str], None]) -> Path:
    """`out`, a committed checkpoint, when its manifest records this same conversion; else OutputExistsError.

    Removes the conversion state a run killed between its commit and its cleanup left in `out`.
    When `verify` and the recorded conversion was not verified, every element is read back and
    compared with the source's (CRC32), then the record says verified.
    """
    manifest = json.loads((out / MANIFEST).read_text())
    record = manifest.get("conversion")
    if not isinstance(record, dict):
        raise OutputExistsError(f"{out} already holds a checkpoint that records no conversion of an HF source "
                                "(remove it or choose another output directory)")
    recorded = {k: v for k, v in record.items() if k != "verified"}
    if recorded != fingerprint:
        raise OutputExistsError(f"{out} already holds a conversion of other inputs or options "
                                f"({'; '.join(_differences(recorded, fingerprint))}): remove it or choose "
                                "another output directory")
    if (out / CONVERT_STATE).exists():
        shutil.rmtree(out / CONVERT_STATE)
        say(f"{out} was committed by an interrupted run of this conversion; removed its leftover state")
    reader = CheckpointReader(open_checkpoint(out))
    reader.check([lp.slot for lp in leaves])
    if verify and not record.get("verified"):
        expected = {w.log_key: (_crc(arr), _crc(scale)) for w in work for arr, scale in [_produce(src, w)]}
        bad = _mismatches(reader, work, expected, show)
        if bad:
            raise CheckpointError(f"verify: {out}: {len(bad)} tensors read back with other bytes than the source "
                                  f"gives (first: {bad[0].leaf.key}{list(bad[0].idx)} from {bad[0].name}); remove "
                                  "it and convert again")
        manifest["conversion"] = {**record, "verified": True}
        write_text_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        say(f"{out}: every tensor verified against the source")
    say(f"{out} already holds this conversion; nothing written")
    return out


def _stream(src: HFSource, todo: list[Work], stores: dict[str, Any], log_path: Path, done: dict[str, tuple[int, int]],
            *, total: int, initial: int, show: bool) -> None:
    from tqdm import tqdm

    largest = max((w.out_bytes for w in todo), default=0)
    window = max(2 * largest, 32 << 20)  # bytes of writes in flight
    pending: collections.deque[tuple[Work, list[Any], int, int]] = collections.deque()
    in_flight = 0
    with open(log_path, "a") as logf, tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
                                           desc="converting", disable=not show, file=sys.stderr) as bar:

        def retire() -> None:
            nonlocal in_flight
            w, futures, crc_w, crc_s = pending.popleft()
            for f in futures:
                f.result()
            logf.write(f"{w.log_key}\t{crc_w}\t{crc_s}\n")
            logf.flush()
            done[w.log_key] = (crc_w, crc_s)
            in_flight -= w.out_bytes
            bar.update(w.nbytes)

        for w in todo:
            arr, scale = _produce(src, w)
            futures = [stores[w.leaf.key][w.idx].write(arr)]
            if scale is not None:
                futures.append(stores[w.leaf.key + "/scale"][w.idx].write(scale))
            pending.append((w, futures, _crc(arr), _crc(scale)))
            in_flight += w.out_bytes
            del arr, scale
            while pending and in_flight > window:
                retire()
        while pending:
            retire()


def _reader(tmp: Path, cfg: LingConfig, leaves: list[LeafPlan]) -> CheckpointReader:
    """Reads the finalized items of `tmp` (their `_METADATA` written) before the commit."""
    from ling_jax.checkpoint.orbax_io import Checkpoint

    manifest = {"fp8_blocks": {lp.key: list(lp.fp8_block) for lp in leaves if lp.fp8_block}}
    scales = tmp / SCALES if manifest["fp8_blocks"] else None
    reader = CheckpointReader(Checkpoint(tmp, cfg, manifest, tmp / PARAMS, (), scales))
    reader.check([lp.slot for lp in leaves])
    return reader


def _mismatches(reader: CheckpointReader, work: list[Work], done: dict[str, tuple[int, int]], show: bool
                ) -> list[Work]:
    """The elements whose bytes, read back through Orbax's read spec, differ from what was written."""
    from tqdm import tqdm

    bad = []
    with tqdm(total=sum(w.out_bytes for w in work), unit="B", unit_scale=True, unit_divisor=1024, desc="verifying",
              disable=not show, file=sys.stderr) as bar:
        for w in work:
            try:
                got = (_crc(reader.element(w.leaf.slot, w.idx)),
                       _crc(reader.scale(w.leaf.slot, w.idx)) if w.leaf.fp8_block else -1)
            except ValueError:  # tensorstore: a chunk that is missing or unreadable
                got = None
            if got != done.get(w.log_key):
                bad.append(w)
            bar.update(w.out_bytes)
    return bad


def _check_orbax_view(tmp: Path, leaves: list[LeafPlan]) -> None:
    """Orbax's own metadata reader sees every leaf with its shape and dtype."""
    import orbax.checkpoint as ocp
    from etils import epath

    handler = ocp.PyTreeCheckpointHandler()  # the item's reader (the step's own metadata is not written yet)
    try:
        meta = handler.metadata(epath.Path(tmp / PARAMS))
    finally:
        handler.close()
    tree = getattr(meta, "tree", meta)
    for lp in leaves:
        node = tree
        for k in lp.slot.path:
            node = node[k]
        if tuple(node.shape) != tuple(lp.slot.shape) or np.dtype(node.dtype) != lp.dtype:
            raise CheckpointError(f"verify: Orbax reads leaf {lp.key} as {node.dtype}{list(node.shape)}, "
                                  f"written as {lp.dtype}{list(lp.slot.shape)}")


# ----------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ling-convert",
        description="Convert an HF Ling-3 checkpoint (BF16 or block-FP8 safetensors) into a ling-jax Orbax "
                    "checkpoint, tensor by tensor, atomically and resumably.")
    parser.add_argument("--hf-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--out", required=True,
                        help="output checkpoint directory: new or empty (the same command again: an interrupted "
                             "conversion resumes, a complete one is left as it is)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                        help="bfloat16: dequantize FP8 (float32 tensors stay float32); float8: keep FP8 weights "
                             "and their block scales; float32: every tensor in float32, FP8 dequantized "
                             "(default: %(default)s)")
    parser.add_argument("--compress", action="store_true", help="zstd-compress chunks (slower, smaller)")
    parser.add_argument("--no-verify", action="store_true", help="skip reading every tensor back before committing")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    def job() -> str:
        hf, out = existing_dir("--hf-dir", args.hf_dir), Path(args.out)
        complete = (out / MANIFEST).is_file()  # convert_hf_to_orbax returns it as it is, or refuses it
        convert_hf_to_orbax(hf, out, dtype=args.dtype, show_progress=not args.quiet, compress=args.compress,
                            verify=not args.no_verify)
        return f"{out} already holds this conversion of {hf}: nothing to do" if complete else f"wrote {out}"

    return run_command("ling-convert", job, "run the same command again to resume")


if __name__ == "__main__":
    sys.exit(main())

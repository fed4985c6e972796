"""Reading and writing safetensors files tensor by tensor, FP8 included.

The `safetensors` package cannot read F8_E4M3 (its numpy loader knows no float8 dtype), so reading
is done here: the file is an 8-byte little-endian header length, a JSON header of
`{name: {dtype, shape, data_offsets}}`, then raw little-endian data. Each tensor is a zero-copy
`np.memmap` view, so a checkpoint of any size is read one tensor at a time. Headers are validated
against the file size up front, so a truncated file fails before anything is loaded, naming the file
and the first tensor it lacks.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file or tensor."""


class SafetensorsFile:
    """One .safetensors file: its validated header and memory-mapped tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{self.path}: truncated or not a safetensors file (header of {n} bytes)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (a JSON {type(header).__name__}, "
                                  "not an object)")
        meta = header.pop("__metadata__", None) or {}
        self.metadata: dict[str, str] = meta if isinstance(meta, dict) else {}
        self.data_start = 8 + n
        self.header: dict[str, dict] = header
        spans = []
        for name, info in header.items():
            self._check_entry(name, info)
            begin, end = info["data_offsets"]
            want = DTYPES[info["dtype"]].itemsize * int(np.prod(info["shape"], dtype=np.int64))
            if end - begin != want:
                raise CheckpointError(f"{self.path}: tensor {name} has {end - begin} bytes, its shape needs {want}")
            if self.data_start + end > size:
                raise CheckpointError(
                    f"{self.path}: truncated: tensor {name} ends at byte {self.data_start + end}, "
                    f"the file has {size}"
                )
            if end > begin:
                spans.append((begin, end, name))
        spans.sort()
        for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
            if begin < end:
                raise CheckpointError(f"{self.path}: corrupt safetensors header: the data of tensors {first} and "
                                      f"{second} overlap")
        self._map: np.memmap | None = None

    def _check_entry(self, name: str, info: Any) -> None:
        """CheckpointError naming the tensor unless its header entry has a known dtype, a shape of
        sizes >= 0 and data_offsets [begin, end] with 0 <= begin <= end."""
        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 0

        if not isinstance(info, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header: tensor {name}'s entry is not an object")
        if info.get("dtype") not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {info.get('dtype')}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(map(is_int, shape)):
            raise CheckpointError(f"{self.path}: corrupt safetensors header: tensor {name} has shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_int, offsets))
                or offsets[0] > offsets[1]):
            raise CheckpointError(f"{self.path}: corrupt safetensors header: tensor {name} has data_offsets "
                                  f"{offsets!r}")

    def keys(self) -> list[str]:
        return list(self.header)

    def __iter__(self) -> Iterator[str]:
        return iter(self.header)

    def dtype_name(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def offset(self, name: str) -> int:
        """Byte offset of tensor `name` in the file."""
        return self.data_start + self.header[name]["data_offsets"][0]

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` read into a fresh array (no mapping kept, so it is freed with the array).

        Streaming converters use this rather than `get`: pages of a memory map stay in the
        process's resident set while the map lives, so reading a whole shard through one map
        would grow RSS to the size of the shard.
        """
        info = self.header[name]
        begin, end = info["data_offsets"]
        buf = np.empty(end - begin, np.uint8)
        view = memoryview(buf)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            done = 0
            while done < len(buf):
                n = f.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"{self.path}: truncated while reading tensor {name}")
                done += n
        return buf.view(DTYPES[info["dtype"]]).reshape(info["shape"])

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of tensor `name` (no copy until used)."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        info = self.header[name]
        begin, end = info["data_offsets"]
        raw = self._map[self.data_start + begin : self.data_start + end]
        return raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])


class SafetensorsDir:
    """All tensors of an HF checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
            for fname in files:
                if not (self.path / fname).is_file():
                    raise CheckpointError(f"{index} names {fname}, which is not in {self.path}")
            self.files = {fname: SafetensorsFile(self.path / fname) for fname in files}
            self.where: dict[str, str] = {}
            for name, fname in weight_map.items():
                if name not in self.files[fname].header:
                    raise CheckpointError(f"{index} places {name} in {fname}, which does not hold it")
                self.where[name] = fname
        elif single.is_file():
            self.files = {single.name: SafetensorsFile(single)}
            self.where = {name: single.name for name in self.files[single.name]}
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def keys(self) -> list[str]:
        return list(self.where)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def file_of(self, name: str) -> SafetensorsFile:
        return self.files[self.where[name]]

    def get(self, name: str) -> np.ndarray:
        return self.file_of(name).get(name)

    def read(self, name: str) -> np.ndarray:
        """A fresh copy of tensor `name` (see `SafetensorsFile.read`)."""
        return self.file_of(name).read(name)

    def offset(self, name: str) -> tuple[str, int]:
        """(file name, byte offset) of tensor `name`: sorting by it reads the checkpoint sequentially."""
        return self.where[name], self.file_of(name).offset(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file_of(name).shape(name)

    def dtype_name(self, name: str) -> str:
        return self.file_of(name).dtype_name(name)

    def nbytes(self, name: str) -> int:
        begin, end = self.file_of(name).header[name]["data_offsets"]
        return end - begin


def write_safetensors(
    path: str | Path, tensors: Iterable[tuple[str, np.ndarray]] | Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes tensors (any DTYPES dtype, FP8 included) held in memory to `path`."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    write_safetensors_stream(path, [(n, a.dtype, a.shape) for n, a in items], (a for _, a in items), metadata)


def write_safetensors_stream(
    path: str | Path, entries: Sequence[tuple[str, Any, Sequence[int]]], arrays: Iterable[np.ndarray],
    metadata: Mapping[str, str] | None = None, on_tensor: Callable[[int], None] | None = None,
) -> None:
    """Writes a safetensors file whose tensors are produced one at a time.

    `entries` lists (name, dtype, shape) of every tensor, so the header is written first; `arrays`
    then yields the tensors in that order, each written and dropped before the next is asked for
    (memory: one tensor). Written to `path.tmp`, fsynced, then renamed onto `path`.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    specs = []
    for name, dtype, shape in entries:
        dt = np.dtype(dtype)
        if dt not in NAMES:
            raise CheckpointError(f"{name}: dtype {dt} cannot be written to safetensors")
        nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": NAMES[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        specs.append((name, dt, tuple(shape)))
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        it = iter(arrays)
        for name, dt, shape in specs:
            arr = next(it, None)
            if arr is None:
                raise CheckpointError(f"{path}: no data for tensor {name}")
            if arr.dtype != dt or tuple(arr.shape) != shape:
                raise CheckpointError(f"{path}: tensor {name} is {arr.dtype}{list(arr.shape)}, "
                                      f"the header says {dt}{list(shape)}")
            f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
            if on_tensor is not None:
                on_tensor(arr.nbytes)
        if next(it, None) is not None:
            raise CheckpointError(f"{path}: more tensors than header entries")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

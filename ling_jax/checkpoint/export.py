"""Params -> an HF Ling-3 directory (config.json, sharded safetensors, index), BF16 or block-FP8.

The inverse of `load_hf_checkpoint`, walking the same table (`params.param_slots`), one HF tensor
at a time: the tensors are planned from shapes alone (names, dtypes, shard of each), then each
shard's header is written and its tensors are produced and streamed in, so memory holds one
tensor (plus its quantization temporaries), never a stacked leaf or a shard.

Where the tensors come from is an `ElementSource`: in-memory params (`save_hf_checkpoint`) or an
Orbax checkpoint on disk read element by element with tensorstore (`export_checkpoint`, the
`ling-export` command). Per tensor:

- a leaf stored FP8 (`BlockFP8` or an FP8 checkpoint) is written back bit for bit with its scales
  when exporting FP8, or dequantized when exporting a float dtype;
- with a `QuantConfig`, every other linear weight not matched by its exclusions is re-quantized to
  e4m3 with block scales (`weight_scale_inv`), the layout of Ling's `-fp8` repositories;
- everything else is cast to the export dtype, except A_log / dt_bias / expert_bias and tensors
  the original source stored in float32 (the checkpoint's manifest says which), which stay float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

import jax.numpy as jnp
import numpy as np

from ling_jax.checkpoint import fp8
from ling_jax.checkpoint.layout import to_hf_layout
from ling_jax.checkpoint.safetensors_io import SafetensorsDir, write_safetensors_stream
from ling_jax.cli import OutputExistsError, UsageError, existing_dir, run_command
from ling_jax.config import ConfigError, LingConfig, QuantConfig
from ling_jax.params import Leaf, Params, ParamSlot, get_path, param_slots

EXPORT_DTYPES = ("auto", "bfloat16", "float32", "float8")


def is_quantizable(name: str, leaf: Leaf, quant: QuantConfig | None) -> bool:
    """Linear weights are FP8 unless their module is listed in the exclusions (suffix match); the
    router and lm_head never are (ARCHITECTURE.md §4)."""
    return (quant is not None and leaf.transform == "T" and leaf.quantizable
            and not quant.excludes(name.removesuffix(".weight")))


class ElementSource(Protocol):
    """Where exported tensors come from: one stacked element (layer / expert) of a leaf at a time."""

    def stored_dtype(self, slot: ParamSlot) -> np.dtype: ...

    def fp8_block(self, slot: ParamSlot) -> tuple[int, int] | None:
        """(bk, bn) in our layout when the leaf is stored block-FP8 (then `scale` is defined)."""

    def source_float32(self, slot: ParamSlot) -> bool:
        """Whether the original HF source stored this leaf's tensors in float32."""

    def element(self, slot: ParamSlot, idx: tuple[int, ...]) -> np.ndarray: ...

    def scale(self, slot: ParamSlot, idx: tuple[int, ...]) -> np.ndarray: ...


class MemorySource:
    """An in-memory param pytree (jax or numpy arrays, `fp8.BlockFP8` leaves allowed)."""

    def __init__(self, params: Params):
        self.params = params

    def _leaf(self, slot: ParamSlot) -> Any:
        return get_path(self.params, slot.path)

    def stored_dtype(self, slot: ParamSlot) -> np.dtype:
        leaf = self._leaf(slot)
        return np.dtype((leaf.value if isinstance(leaf, fp8.BlockFP8) else leaf).dtype)

    def fp8_block(self, slot: ParamSlot) -> tuple[int, int] | None:
        leaf = self._leaf(slot)
        return leaf.block if isinstance(leaf, fp8.BlockFP8) else None

    def source_float32(self, slot: ParamSlot) -> bool:
        return False

    def element(self, slot: ParamSlot, idx: tuple[int, ...]) -> np.ndarray:
        leaf = self._leaf(slot)
        return np.asarray((leaf.value if isinstance(leaf, fp8.BlockFP8) else leaf)[idx])

    def scale(self, slot: ParamSlot, idx: tuple[int, ...]) -> np.ndarray:
        return np.asarray(self._leaf(slot).scale[idx])


Action = Literal["cast", "copy_fp8", "quantize", "dequantize"]


@dataclasses.dataclass(frozen=True)
class _Group:
    """One stacked element -> its HF tensor (and scale): how to produce it and what it looks like."""

    slot: ParamSlot
    idx: tuple[int, ...]
    action: Action
    tensors: tuple[tuple[str, np.dtype, tuple[int, ...]], ...]  # (name, dtype, shape), weight first
    order: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(dt.itemsize * int(np.prod(shape)) for _, dt, shape in self.tensors)


def _layer_of(name: str) -> int:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _plan(cfg: LingConfig, source: ElementSource, *, dtype: Any, quant: QuantConfig | None) -> list[_Group]:
    """Every HF tensor to write, in HF order (embeddings, layer by layer, final norm and head).

    A source that keeps FP8 leaves (`ling-convert --dtype float8`) had its float leaves stored as
    floats in the FP8 checkpoint it came from: they stay floats. An all-float source is quantized by
    `is_quantizable`."""
    groups = []
    f32 = np.dtype(np.float32)
    slots = param_slots(cfg)
    keeps_fp8 = any(source.fp8_block(slot) is not None for slot in slots)
    for s, slot in enumerate(slots):
        hf_shape = slot.leaf.hf_shape(cfg)
        block = source.fp8_block(slot)
        cast_to = f32 if slot.leaf.fp32 or source.source_float32(slot) else np.dtype(jnp.dtype(dtype))
        for idx, name in slot.hf_names():
            if block is not None and quant is not None and block == _our_block(quant, slot.leaf):
                action: Action = "copy_fp8"
            elif quant is not None and (block is not None or not keeps_fp8) and is_quantizable(name, slot.leaf, quant):
                action = "quantize"
            else:
                action = "dequantize" if block is not None else "cast"
            if action in ("copy_fp8", "quantize"):
                assert quant is not None
                tensors = ((name, np.dtype(fp8.FP8), hf_shape),
                           (f"{name}_scale_inv", f32, fp8.scale_shape(hf_shape, quant.block_size)))
            else:
                tensors = ((name, cast_to, hf_shape),)
            layer = _layer_of(name)
            where = 0 if slot.path == ("embed",) else 2 if layer < 0 else 1
            groups.append(_Group(slot, idx, action, tensors, (where, layer, s, *idx)))
    groups.sort(key=lambda g: g.order)
    return groups


def _our_block(quant: QuantConfig, leaf: Leaf) -> tuple[int, int]:
    b = quant.block_size
    return (b[1], b[0]) if leaf.transform == "T" else b


def _produce(g: _Group, source: ElementSource, quant: QuantConfig | None) -> Iterator[np.ndarray]:
    leaf = g.slot.leaf
    if g.action == "copy_fp8":
        yield to_hf_layout(source.element(g.slot, g.idx), leaf)
        yield to_hf_layout(source.scale(g.slot, g.idx).astype(np.float32), leaf)
        return
    x = source.element(g.slot, g.idx)
    block = source.fp8_block(g.slot)
    if block is not None:  # an FP8 leaf exported as floats, or re-quantized with another block size
        x = fp8.dequantize(x, source.scale(g.slot, g.idx), block)
    x = to_hf_layout(x, leaf)
    if g.action == "quantize":
        assert quant is not None
        yield from fp8.quantize(x.astype(np.float32), quant.block_size, quant.scale_fmt)
    else:
        yield x.astype(g.tensors[0][1], copy=False)


def write_hf_checkpoint(cfg: LingConfig, source: ElementSource, out_dir: str | Path, *, dtype: Any = "bfloat16",
                        quantization: QuantConfig | None = None, max_shard_bytes: int = 4 << 30,
                        show_progress: bool = False) -> Path:
    """Writes `out_dir` (must not exist, or be empty) as an HF checkpoint directory from `source`.

    `dtype`: dtype of non-FP8 tensors; `quantization`: block-FP8 format and exclusions of the
    linear weights (None: no FP8). Shards hold whole tensors, in HF order, up to `max_shard_bytes`
    (a larger tensor gets a shard of its own). Written into `<out_dir>.partial`, then renamed.
    """
    from tqdm import tqdm

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OutputExistsError(f"{out} already exists (remove it or choose another output directory)")
    if quantization is not None and quantization.scale_fmt not in fp8.SCALE_FMTS:
        raise ConfigError(f"quantization_config.scale_fmt={quantization.scale_fmt!r}: only null or 'ue8m0' can "
                          "be written")
    groups = _plan(cfg, source, dtype=dtype, quant=quantization)
    shards: list[list[_Group]] = [[]]
    filled = 0
    for g in groups:
        if shards[-1] and filled + g.nbytes > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(g)
        filled += g.nbytes
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = sum(g.nbytes for g in groups)
    with tqdm(total=total, desc="exporting", unit="B", unit_scale=True, unit_divisor=1024, disable=not show_progress,
              file=sys.stderr) as bar:
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            entries = [t for g in shard for t in g.tensors]
            arrays = (a for g in shard for a in _produce(g, source, quantization))
            write_safetensors_stream(tmp / fname, entries, arrays, on_tensor=bar.update)
            weight_map.update((name, fname) for name, _, _ in entries)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_cfg = cfg.to_hf()
    if quantization is None:
        hf_cfg.pop("quantization_config", None)
    else:
        hf_cfg["quantization_config"] = quantization.to_hf()
    hf_cfg["torch_dtype"] = jnp.dtype(dtype).name
    if "dtype" in hf_cfg:  # transformers v5's name for it
        hf_cfg["dtype"] = hf_cfg["torch_dtype"]
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    SafetensorsDir(tmp)  # every header and the index parse back
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def save_hf_checkpoint(
    cfg: LingConfig, params: Params, out_dir: str | Path, *, dtype: Any = "bfloat16",
    quantization: QuantConfig | None = None, max_shard_bytes: int = 4 << 30, show_progress: bool = False,
) -> Path:
    """Writes in-memory params as an HF checkpoint directory (see `write_hf_checkpoint`).

    `dtype`: dtype of non-FP8 tensors (A_log, dt_bias, expert_bias stay float32);
    `quantization`: block-FP8 format and exclusions for linear weights (None: no FP8).
    """
    return write_hf_checkpoint(cfg, MemorySource(params), out_dir, dtype=dtype, quantization=quantization,
                               max_shard_bytes=max_shard_bytes, show_progress=show_progress)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, dtype: str = "auto",
                      max_shard_bytes: int = 4 << 30, show_progress: bool = False) -> Path:
    """Our Orbax checkpoint (`ling-convert` or training output) -> an HF directory, streamed.

    `dtype`: "auto" (block-FP8 with the source's block size and exclusions when the model came from
    an FP8 checkpoint, i.e. its config has a `quantization_config`; else bfloat16), "bfloat16",
    "float32", or "float8" (needs a `quantization_config`). FP8 leaves of the checkpoint are
    written back bit for bit; float ones are quantized.
    """
    from ling_jax.checkpoint.orbax_io import CheckpointReader, open_checkpoint

    if dtype not in EXPORT_DTYPES:
        raise UsageError(f"dtype {dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
    ck = open_checkpoint(checkpoint)
    reader = CheckpointReader(ck)
    reader.check(param_slots(ck.cfg))
    quant = ck.cfg.quantization
    if dtype == "float8" and quant is None:
        raise UsageError(f"{ck.path}: its config has no quantization_config (block size, exclusions) to "
                         "quantize with; export bfloat16, or add one to its config.json")
    fp8_out = dtype == "float8" or (dtype == "auto" and quant is not None)
    return write_hf_checkpoint(ck.cfg, reader, out_dir, dtype="float32" if dtype == "float32" else "bfloat16",
                               quantization=quant if fp8_out else None, max_shard_bytes=max_shard_bytes,
                               show_progress=show_progress)


def parse_size(text: str) -> int:
    """'4GB', '500MB', '1.5GiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 4GB, 500MB)")
    base = 1024 if m.group(3) else 1000
    size = int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))
    if size <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be positive")
    return size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ling-export",
        description="Export a ling-jax Orbax checkpoint (from ling-convert or training) as an HF safetensors "
                    "directory (config.json, sharded model-*.safetensors, index).")
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory")
    parser.add_argument("--out", required=True, help="output HF directory (must not exist or be empty)")
    parser.add_argument("--dtype", default="auto", choices=EXPORT_DTYPES,
                        help="auto: block-FP8 with the source's exclusions if the model came from an FP8 "
                             "checkpoint, else bfloat16 (default: %(default)s)")
    parser.add_argument("--max-shard-size", type=parse_size, default="4GiB", help="per file (default: 4GiB)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    def job() -> str:
        out = export_checkpoint(existing_dir("--checkpoint", args.checkpoint), args.out, dtype=args.dtype,
                                max_shard_bytes=args.max_shard_size, show_progress=not args.quiet)
        return f"wrote {out}"

    return run_command("ling-export", job, "nothing was written at the output path")


if __name__ == "__main__":
    sys.exit(main())

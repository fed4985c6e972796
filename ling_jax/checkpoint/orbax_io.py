"""Our Orbax checkpoint format: writing it array slice by array slice, checking it is complete, loading it.

A checkpoint is one directory laid out like a step of an Orbax `CheckpointManager`:

    <dir>/_CHECKPOINT_METADATA    Orbax step metadata (the item handlers)
    <dir>/params/                 Orbax PyTree item: the param pytree of `params.py` (stacked layout)
    <dir>/scales/                 FP8 checkpoints only: PyTree item holding, at the same paths, the
                                  block scales of the FP8 leaves of params/ (in our [in, out] layout)
    <dir>/config.json             the model's HF config (`LingConfig.to_hf()`)
    <dir>/ling_checkpoint.json    our manifest (format version, stored dtype, the source's dtype per
                                  leaf, the FP8 block of each FP8 leaf); written last

`ItemWriter` writes a PyTree item without ever holding a whole array: each leaf is a zarr3 array
(non-OCDBT, one directory per leaf, the tensorstore spec Orbax itself builds through
`ocp.type_handlers.get_json_tspec_write`) whose chunk grid never straddles two stacked elements,
so one layer's (or one expert's) tensor is written at a time with no read-modify-write; then
`_METADATA` is written in the JSON format of Orbax's PyTree handler. Orbax restores such an item
like its own output, and `load_checkpoint` restores through Orbax (each array directly in its
target sharding). `save_checkpoint` writes the same layout through Orbax itself (OCDBT) from
in-memory params, e.g. at the end of training; `CheckpointReader` reads single elements of either.

A conversion writes into `<dir>.partial` and renames it onto `<dir>` at the end, so `<dir>` either
does not exist or is complete; `open_checkpoint` turns every other state into an
`IncompleteCheckpointError`.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from ling_jax.checkpoint.fp8 import BlockFP8, dequantize_jax
from ling_jax.checkpoint.safetensors_io import CheckpointError
from ling_jax.cli import OutputExistsError
from ling_jax.config import LingConfig
from ling_jax.params import Params, ParamSlot, build_tree, default_sharding, get_path, param_slots, set_path

FORMAT = "ling-jax-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "ling_checkpoint.json"
CONFIG = "config.json"
PARAMS, SCALES = "params", "scales"
PARTIAL_SUFFIX = ".partial"
CONVERT_STATE = ".convert"  # inside the partial directory of a conversion in progress
STEP_METADATA = "_CHECKPOINT_METADATA"
DEFAULT_CHUNK_BYTES = 64 << 20


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint directory whose writing never finished (e.g. an interrupted conversion)."""


def leaf_key(path: tuple[Any, ...]) -> str:
    """The Orbax parameter name of a pytree path (keys joined by dots): also its directory name."""
    return ".".join(str(k) for k in path)


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)


def write_text_atomic(path: Path, text: str) -> None:
    """Writes `path` through a fsynced temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ocp() -> Any:
    import orbax.checkpoint as ocp  # heavy import, kept off the CLI's --help path

    return ocp


def _handler_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def write_step_metadata(directory: Path, items: Iterable[str], init_ns: int) -> None:
    """`_CHECKPOINT_METADATA` as Orbax's composite handler writes it (items handled as PyTrees)."""
    handler = _handler_name(_ocp().PyTreeCheckpointHandler)
    meta = {"item_handlers": dict.fromkeys(items, handler), "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": init_ns, "commit_timestamp_nsecs": time.time_ns(), "custom_metadata": {}}
    write_text_atomic(directory / STEP_METADATA, json.dumps(meta))


class ItemWriter:
    """Writes one Orbax PyTree item whose leaves are filled slice by slice with tensorstore.

    `array()` creates (or, when resuming, reopens) the zarr3 array of one leaf; the caller writes
    `store[idx]` for each stacked element. `finalize()` writes the item's `_METADATA` and
    `_sharding` once every leaf is complete.
    """

    def __init__(self, directory: Path, *, compress: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.dir = directory
        self.compress = compress
        self.chunk_bytes = chunk_bytes
        self.leaves: dict[tuple[Any, ...], tuple[int, ...]] = {}
        self.context = _ocp().type_handlers.get_ts_context(use_ocdbt=False)
        directory.mkdir(parents=True, exist_ok=True)

    def array(self, path: tuple[Any, ...], shape: tuple[int, ...], dtype: np.dtype, n_stack: int) -> ts.TensorStore:
        """The leaf at `path`: `shape` with `n_stack` leading stack axes, one element per chunk row."""
        from etils import epath

        ocp = _ocp()
        write_shape = (1,) * n_stack + tuple(shape[n_stack:])
        info = ocp.type_handlers.ParamInfo(name=leaf_key(path), parent_dir=epath.Path(self.dir), use_zarr3=True,
                                           use_compression=self.compress)
        spec = ocp.type_handlers.get_json_tspec_write(
            info, use_ocdbt=False, global_shape=tuple(shape), local_shape=write_shape, dtype=np.dtype(dtype),
            arg=ocp.SaveArgs(chunk_byte_size=self.chunk_bytes))
        # Orbax stores chunks equal to the fill value (zeros) too and restores with missing chunks an error,
        # so an element that was never written cannot pass for zeros
        spec["store_data_equal_to_fill_value"] = True
        store = ts.open(spec, create=True, open=True, dtype=ts.dtype(np.dtype(dtype).name),
                        context=self.context).result()
        if tuple(store.shape) != tuple(shape):
            raise CheckpointError(f"{self.dir / leaf_key(path)}: existing array has shape {list(store.shape)}, "
                                  f"expected {list(shape)}")
        self.leaves[path] = write_shape
        return store

    def finalize(self) -> None:
        """`_METADATA` (tree structure, Orbax's JSON) and `_sharding` (single host device, as Orbax on CPU)."""
        tree, sharding = {}, {}
        for path, write_shape in self.leaves.items():
            keys = [{"key": str(k), "key_type": 1 if isinstance(k, int) else 2} for k in path]
            tree[str(tuple(str(k) for k in path))] = {
                "key_metadata": keys,
                "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                   "write_shape": list(write_shape)},
            }
            name = base64.urlsafe_b64encode(leaf_key(path).encode()).decode()
            sharding[name] = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": "cpu:0"})
        meta = {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": True,
                "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
        write_text_atomic(self.dir / "_sharding", json.dumps(sharding))
        write_text_atomic(self.dir / "_METADATA", json.dumps(meta))


# ----------------------------------------------------------------------------- reading
class Checkpoint:
    """A complete checkpoint directory, opened: its config, manifest and the Orbax items behind it."""

    def __init__(self, path: Path, cfg: LingConfig, manifest: dict[str, Any], item: Path, prefix: tuple[Any, ...],
                 scales: Path | None):
        self.path = path
        self.cfg = cfg
        self.manifest = manifest
        self.item = item  # the PyTree item holding the params
        self.prefix = prefix  # path of the param pytree inside that item: () or ("params",) (training state)
        self.scales = scales

    @property
    def fp8_blocks(self) -> dict[str, tuple[int, int]]:
        return {k: (int(v[0]), int(v[1])) for k, v in self.manifest.get("fp8_blocks", {}).items()}

    @property
    def source_dtypes(self) -> dict[str, list[str]]:
        return dict(self.manifest.get("source_dtypes", {}))


def _item_meta(item: Path) -> dict[str, Any]:
    try:
        return json.loads((item / "_METADATA").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise IncompleteCheckpointError(f"incomplete checkpoint: {item}/_METADATA cannot be read ({e})") from None


def _find_params_item(path: Path) -> tuple[Path, tuple[Any, ...]]:
    if (path / PARAMS / "_METADATA").is_file():
        return path / PARAMS, ()
    state = path / "state"  # a training step (`train/checkpointing.py`): the params are state["params"]
    if (state / "_METADATA").is_file() and any(
            k.startswith("('params',") for k in _item_meta(state).get("tree_metadata", {})):
        return state, ("params",)
    raise IncompleteCheckpointError(
        f"incomplete checkpoint: {path} has no {PARAMS}/_METADATA (not a ling-jax/Orbax checkpoint, or its "
        "writing was interrupted)")


def open_checkpoint(path: str | Path, **config_options: Any) -> Checkpoint:
    """Checks that `path` is a complete checkpoint and opens it (no array data read).

    Raises `IncompleteCheckpointError` for the partial output of an interrupted conversion (or an
    output path whose conversion never finished) and `CheckpointError` when there is nothing there.
    """
    p = Path(path).absolute()  # Orbax takes absolute paths only
    if not p.exists():
        if partial_dir(p).exists():
            raise IncompleteCheckpointError(
                f"incomplete checkpoint: {p} was never completed; {partial_dir(p)} holds an interrupted "
                "conversion into it (re-run the same ling-convert command to finish it)")
        raise CheckpointError(f"{p}: no such checkpoint directory")
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a directory")
    manifest: dict[str, Any] = {}
    if (p / MANIFEST).is_file():
        try:
            manifest = json.loads((p / MANIFEST).read_text())
        except json.JSONDecodeError as e:
            raise IncompleteCheckpointError(f"incomplete checkpoint: {p / MANIFEST} is corrupt ({e})") from None
        if manifest.get("format") != FORMAT or int(manifest.get("version", 0)) > FORMAT_VERSION:
            raise CheckpointError(f"{p / MANIFEST}: format {manifest.get('format')!r} version "
                                  f"{manifest.get('version')!r} is not one this ling-jax reads")
    elif (p / CONVERT_STATE).exists() or p.name.endswith(PARTIAL_SUFFIX) or ".orbax-checkpoint-tmp" in p.name:
        raise IncompleteCheckpointError(
            f"incomplete checkpoint: {p} is the partial output of an interrupted write (re-run the conversion)")
    elif not (p / STEP_METADATA).is_file() and not (p / PARAMS / STEP_METADATA).is_file():
        if not any(p.iterdir()):
            raise CheckpointError(f"{p}: an empty directory, not a checkpoint")
        if (p / CONFIG).is_file() and any(p.glob("*.safetensors")):
            raise CheckpointError(f"{p}: a Hugging Face checkpoint, not an Orbax one (load_hf_checkpoint reads it; "
                                  "ling-convert converts it)")
        raise IncompleteCheckpointError(f"incomplete checkpoint: {p} has neither {MANIFEST} nor Orbax's "
                                        f"{STEP_METADATA} (not a checkpoint, or its writing never finished)")
    item, prefix = _find_params_item(p)
    scales = p / SCALES if (p / SCALES / "_METADATA").is_file() else None
    if manifest.get("fp8_blocks") and scales is None:
        raise IncompleteCheckpointError(f"incomplete checkpoint: {p} has FP8 leaves but no {SCALES}/_METADATA")
    cfg_path = next((d / CONFIG for d in (p, *list(p.parents)[:3]) if (d / CONFIG).is_file()), None)
    if cfg_path is None:
        raise CheckpointError(f"{p}: no {CONFIG} in the checkpoint directory or above it")
    return Checkpoint(p, LingConfig.from_hf(cfg_path, **config_options), manifest, item, prefix, scales)


class CheckpointReader:
    """Reads single stacked elements of a checkpoint's leaves with tensorstore (bounded memory)."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self._stores: dict[tuple[str, str], ts.TensorStore] = {}
        self._meta = {ck.item: _item_meta(ck.item)}
        if ck.scales is not None:
            self._meta[ck.scales] = _item_meta(ck.scales)
        self._ctx: dict[bool, ts.Context] = {}

    def _store(self, item: Path, path: tuple[Any, ...]) -> ts.TensorStore:
        from etils import epath

        key = leaf_key(path)
        if (str(item), key) not in self._stores:
            meta = self._meta[item]
            if str(tuple(str(k) for k in path)) not in meta.get("tree_metadata", {}):
                raise CheckpointError(f"{item}: no leaf {key} (expected by the config)")
            ocp = _ocp()
            use_ocdbt = bool(meta.get("use_ocdbt"))
            if use_ocdbt not in self._ctx:
                self._ctx[use_ocdbt] = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
            info = ocp.type_handlers.ParamInfo(name=key, parent_dir=epath.Path(item),
                                               use_zarr3=bool(meta.get("use_zarr3")))
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt)
            try:
                self._stores[str(item), key] = ts.open(spec, open=True, context=self._ctx[use_ocdbt]).result()
            except ValueError as e:
                raise IncompleteCheckpointError(f"incomplete checkpoint: leaf {key} of {item} cannot be opened "
                                                f"({e})") from None
        return self._stores[str(item), key]

    def leaf(self, slot: ParamSlot) -> ts.TensorStore:
        return self._store(self.ck.item, self.ck.prefix + slot.path)

    def check(self, slots: list[ParamSlot]) -> None:
        """Every leaf the config expects is there with its shape (FP8 leaves with their scales)."""
        blocks = self.ck.fp8_blocks
        for slot in slots:
            shape = tuple(self.leaf(slot).shape)
            if shape != tuple(slot.shape):
                raise CheckpointError(f"{self.ck.path}: leaf {leaf_key(slot.path)} has shape {list(shape)}, "
                                      f"the config expects {list(slot.shape)}")
            if leaf_key(slot.path) in blocks:
                want = scale_shape(slot, blocks[leaf_key(slot.path)])
                got = tuple(self._scale_store(slot).shape)
                if got != want:
                    raise CheckpointError(f"{self.ck.path}: scales of {leaf_key(slot.path)} have shape {list(got)}, "
                                          f"expected {list(want)}")

    def _scale_store(self, slot: ParamSlot) -> ts.TensorStore:
        if self.ck.scales is None:
            raise CheckpointError(f"{self.ck.path}: no {SCALES} item for FP8 leaf {leaf_key(slot.path)}")
        return self._store(self.ck.scales, slot.path)

    # --- the element-source interface of checkpoint/export.py
    def stored_dtype(self, slot: ParamSlot) -> np.dtype:
        return np.dtype(self.leaf(slot).dtype.numpy_dtype)

    def fp8_block(self, slot: ParamSlot) -> tuple[int, int] | None:
        return self.ck.fp8_blocks.get(leaf_key(slot.path))

    def source_float32(self, slot: ParamSlot) -> bool:
        return bool({"F32", "F64"} & set(self.ck.source_dtypes.get(leaf_key(slot.path), ())))

    def element(self, slot: ParamSlot, idx: tuple[int, ...]) -> np.ndarray:
        return self.leaf(slot)[idx].read().result()

    def scale(self, slot: ParamSlot, idx: tuple[int, ...]) -> np.ndarray:
        return self._scale_store(slot)[idx].read().result()


def scale_shape(slot: ParamSlot, block: tuple[int, int]) -> tuple[int, ...]:
    """Full (stacked) shape of the scale leaf of an FP8 leaf with `block` in our layout."""
    k, n = slot.shape[-2:]
    return (*slot.shape[:-2], -(-k // block[0]), -(-n // block[1]))


def _scale_sharding(sharding: jax.sharding.Sharding, n_stack: int) -> jax.sharding.Sharding:
    """A scale grid is split like its weight along the stack axes and replicated along the block axes."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * n_stack
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:n_stack], None, None))
    return sharding


def load_checkpoint(path: str | Path, *, dtype: Any = None, mesh: jax.sharding.Mesh | None = None,
                    keep_fp8: bool = False, **config_options: Any) -> tuple[LingConfig, Params]:
    """Reads a checkpoint written by `ling-convert`, `save_checkpoint` or training into (config, params).

    A float `dtype` casts every leaf to it (A_log, dt_bias, expert_bias stay float32) and
    dequantizes FP8 leaves (float32 product, then the cast); `dtype=None` keeps the stored dtypes.
    FP8-resident inference (`keep_fp8=True`, or `dtype=None`): the FP8 weights of the layers stay
    `BlockFP8(value, scale, block)` leaves (1 byte per weight plus the scales), which `forward`,
    `generate` and the decode loop dequantize one layer at a time; an FP8 embedding or output head
    (read outside the layers) is still dequantized, to `dtype` or bfloat16.
    Each array is restored by Orbax directly in its sharding (`params.default_sharding(cfg, mesh)`).
    `config_options` set runtime fields of `LingConfig` (e.g. `kda_impl="chunked"`).
    """
    ck = open_checkpoint(path, **config_options)
    cfg = ck.cfg
    reader = CheckpointReader(ck)
    slots = param_slots(cfg)
    reader.check(slots)
    want = None if dtype is None else jnp.dtype(dtype)
    sharding = default_sharding(cfg, mesh)
    ocp = _ocp()
    args: dict[str, Any] = {}
    scale_args: dict[str, Any] = {}
    for slot in slots:
        block = reader.fp8_block(slot)
        target = None if want is None or block is not None else jnp.dtype(jnp.float32 if slot.leaf.fp32 else want)
        sh = sharding(slot)
        set_path(args, ck.prefix + slot.path, ocp.ArrayRestoreArgs(sharding=sh, global_shape=slot.shape, dtype=target))
        if block is not None:
            set_path(scale_args, slot.path, ocp.ArrayRestoreArgs(
                sharding=_scale_sharding(sh, len(slot.stack_shape)), global_shape=scale_shape(slot, block)))
    with ocp.PyTreeCheckpointer() as ckptr:
        values = ckptr.restore(ck.item, args=ocp.args.PyTreeRestore(
            item=jax.tree.map(lambda _: 0, args), restore_args=args, partial_restore=bool(ck.prefix)))
        scales = ckptr.restore(ck.scales, args=ocp.args.PyTreeRestore(
            item=jax.tree.map(lambda _: 0, scale_args), restore_args=scale_args)) if scale_args else {}

    def make(slot: ParamSlot) -> Any:
        value = get_path(values, ck.prefix + slot.path)
        block = reader.fp8_block(slot)
        if block is None:
            return value
        q = BlockFP8(value, get_path(scales, slot.path), block)
        in_layers = slot.path[0] in ("segments", "mtp")
        if in_layers and (keep_fp8 or want is None):
            return q
        dequant = jax.jit(dequantize_jax, static_argnums=(2, 3), out_shardings=sharding(slot))
        return dequant(q.value, q.scale, block, want or jnp.dtype(jnp.bfloat16))

    return cfg, build_tree(cfg, make)


def write_manifest(directory: Path, *, stored: str, fp8_blocks: dict[str, tuple[int, int]],
                   source_dtypes: dict[str, list[str]], source: str | None, tool: str,
                   conversion: dict[str, Any] | None = None) -> None:
    """Writes `ling_checkpoint.json` (last, atomically). `conversion`: the record of the conversion
    that wrote the checkpoint (`ling-convert`'s fingerprint of its inputs and options, and whether
    it was verified), which a re-run of that conversion recognises."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("ling-jax")
    except PackageNotFoundError:
        ver = "unknown"
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "stored": stored,
                "fp8_blocks": {k: list(v) for k, v in fp8_blocks.items()}, "source_dtypes": source_dtypes,
                "source": source, "created_by": f"ling-jax {ver} {tool}",
                "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    if conversion is not None:
        manifest["conversion"] = conversion
    write_text_atomic(directory / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def save_checkpoint(path: str | Path, cfg: LingConfig, params: Params) -> Path:
    """Writes in-memory params (jax arrays, `BlockFP8` leaves allowed) as a checkpoint through Orbax.

    The layout `load_checkpoint` and `ling-export` read (Orbax's default OCDBT storage inside the
    items); written to `<path>.partial` and renamed, so `path` is complete or absent.
    """
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OutputExistsError(f"{out} already exists")
    tmp = partial_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    values: dict[str, Any] = {}
    scales: dict[str, Any] = {}
    blocks: dict[str, tuple[int, int]] = {}
    dtypes = set()
    for slot in param_slots(cfg):
        leaf = get_path(params, slot.path)
        if isinstance(leaf, BlockFP8):
            set_path(values, slot.path, leaf.value)
            set_path(scales, slot.path, leaf.scale)
            blocks[leaf_key(slot.path)] = leaf.block
            dtypes.add("float8")
        else:
            set_path(values, slot.path, leaf)
            if not slot.leaf.fp32:
                dtypes.add(jnp.dtype(leaf.dtype).name)
    ocp = _ocp()
    items = {PARAMS: ocp.args.PyTreeSave(values)}
    if scales:
        items[SCALES] = ocp.args.PyTreeSave(scales)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(tmp.absolute(), args=ocp.args.Composite(**items))
    write_text_atomic(tmp / CONFIG, json.dumps(cfg.to_hf(), indent=2) + "\n")
    write_manifest(tmp, stored=dtypes.pop() if len(dtypes) == 1 else "mixed", fp8_blocks=blocks, source_dtypes={},
                   source=None, tool="save_checkpoint")
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out

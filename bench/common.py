"""Shared pieces of the benchmark scripts: machine facts, ceilings, timing, random device params.

Timings are medians of warmed-up runs, each ended by `block_until_ready`; the ceilings (copy
bandwidth, bf16 matmul rate) are measured in the same process so ratios use this card's numbers.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.device_profile import kernel_profile
from ling_jax.checkpoint.export import is_quantizable
from ling_jax.checkpoint.fp8 import FP8, BlockFP8
from ling_jax.checkpoint.synthetic import LING_FP8_EXCLUSIONS
from ling_jax.config import LingConfig, QuantConfig
from ling_jax.params import ParamSlot, build_tree, get_path


def git_revision() -> str | None:
    """HEAD of the checkout the bench runs from (+ "-dirty" with uncommitted changes), or None (no git:
    e.g. a copied tree)."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


def source_digest() -> str:
    """First 12 hex digits of a SHA-256 over the library, train and bench sources (sorted paths and
    contents): the code a result came from, also where `git` names a stale HEAD (a copied work tree).
    Match it against a checkout by running this function there."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(p for d in ("ling_jax", "train", "bench") for p in (root / d).rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def machine() -> dict[str, Any]:
    import flax
    import optax

    dev = jax.devices()[0]
    return {"device": dev.device_kind, "platform": dev.platform, "n_devices": jax.device_count(),
            "git": git_revision(), "source_sha256": source_digest(),
            "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)}


def median_time(fn: Callable[[], Any], *, reps: int = 5, warmup: int = 1) -> float:
    """Median seconds of `reps` calls of fn() (each synchronised) after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes/s of a device-to-device copy of a `gib` GiB array (bytes read + bytes written): XLA's copy,
    timed on the device (its kernels' time in a `jax.profiler` trace of 3 calls), or by the wall
    clock where the trace has no device plane (CPU).

    Not the wall clock of a bf16 `a * 2` pass, which reads far below the device-timed copy: the wall
    clock of one short call counts its dispatch and the clocks' ramp-up (docs/decode-performance.md,
    "Measuring a decode step"; BENCHMARKS.md, "Copy bandwidth")."""
    n = int(gib * (1 << 30)) // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    f = jax.jit(jnp.copy)
    prof = kernel_profile(lambda: f(x))
    t = prof["kernel_time_s_per_call"] if prof else median_time(lambda: f(x), reps=10, warmup=3)
    return 2 * x.nbytes / t


def matmul_rate(n: int = 8192) -> float:
    """bf16 FLOP/s of an n^3 matmul on random data."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / median_time(lambda: f(a, b), reps=10, warmup=2)


def random_params(cfg: LingConfig, dtype: Any, seed: int = 0) -> Any:
    """Random params generated on the device (one small jit per leaf shape), for benchmarks.

    Same distributions as `params.random_element` (linear N(0, 0.02), norms 1, A_log log U(1,16),
    router/conv uniform), but without the host round trip, so billions of params take seconds.
    """
    counter = iter(range(1 << 30))

    @jax.jit(static_argnums=(1, 2, 3))
    def leaf(key: jax.Array, shape: tuple[int, ...], kind: str, dt: Any) -> jax.Array:
        if kind == "ones":
            return jnp.ones(shape, dt)
        if kind == "zeros":
            return jnp.zeros(shape, dt)
        if kind == "a_log":
            return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dt)
        if kind in ("conv", "router"):
            bound = 1.0 / math.sqrt(shape[-1] if kind == "conv" else shape[-2])
            return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dt)
        return (cfg.initializer_range * jax.random.normal(key, shape, jnp.float32)).astype(dt)

    def make(slot: ParamSlot) -> jax.Array:
        return leaf(jax.random.key(seed * 100003 + next(counter)), slot.shape, slot.leaf.init,
                    jnp.dtype(slot.dtype(dtype)))

    return build_tree(cfg, make)


def random_fp8_params(cfg: LingConfig, dtype: Any, seed: int = 0, block: tuple[int, int] = (128, 128)) -> Any:
    """`random_params` with the layers' linear weights FP8-resident, as `load_checkpoint(keep_fp8=True)`
    returns a Ling FP8 checkpoint (`BlockFP8` leaves; the `LING_FP8_EXCLUSIONS` modules stay `dtype`).

    Values are e4m3 casts of N(0, 1) with every block scale 0.02, so weights have the bf16 ones' spread.
    """
    dense = random_params(cfg, dtype, seed)
    quant = QuantConfig(block_size=(block[1], block[0]), exclusions=LING_FP8_EXCLUSIONS)
    to_fp8 = jax.jit(lambda w: (w.astype(jnp.float32) / 0.02).astype(FP8))

    def make(slot: ParamSlot) -> Any:
        w = get_path(dense, slot.path)
        if slot.path[0] not in ("segments", "mtp") or not is_quantizable(next(slot.hf_names())[1], slot.leaf, quant):
            return w
        k, n = slot.shape[-2:]
        scale = jnp.full((*slot.shape[:-2], -(-k // block[0]), -(-n // block[1])), 0.02, jnp.float32)
        return BlockFP8(to_fp8(w), scale, block)

    return build_tree(cfg, make)


def rel_l2(a: jax.Array, b: jax.Array) -> float:
    """Relative L2 error of a against b, in float64 on the host."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, default=lambda o: float(o) if isinstance(o, np.floating) else str(o)))
    return p

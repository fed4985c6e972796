"""Shared test setup: 8 simulated CPU devices, full-precision matmuls, LLVM at -O0, an opt-in
persistent jit cache, and the golden checkpoints (copied from ../shared/golden into tests/golden)."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
import types
from pathlib import Path

# The suite is bound by XLA:CPU compiles, not by running the programs: LLVM at -O0 compiles about
# a quarter faster (set before jax starts its backend; subprocesses inherit it). It changes how the
# CPU code is generated, not what it computes.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax
import numpy as np
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
# The persistent cache is opt-in (LING_JAX_TEST_CACHE=DIR: reruns skip compiles). Off by default, as
# in CI: there XLA:CPU (jax 0.11.2) segfaulted in `executable.serialize()` writing an entry, late in
# the default suite's process (test_train's packing test, which passes alone), and a clean
# checkout starts with an empty cache anyway. (That was probably the memory-map limit that
# `_release_compiled_programs` below guards against.)
if os.environ.get("LING_JAX_TEST_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["LING_JAX_TEST_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
# The CLI tests' subprocesses (each killed-and-resumed ling-train run would recompile its step) share
# a cache either way: that one, or a temporary directory removed when the test run exits.
SUBPROCESS_CACHE = os.environ.get("LING_JAX_TEST_CACHE") or tempfile.mkdtemp(prefix="ling-jax-test-cache-")
if not os.environ.get("LING_JAX_TEST_CACHE"):
    atexit.register(shutil.rmtree, SUBPROCESS_CACHE, ignore_errors=True)

GOLDEN = Path(__file__).parent / "golden"


_DECODE_STEP = None


def decode_one(cfg, params, cache, tok, unroll=True, **override):
    """`ling_jax.decode.decode_step` jitted, with the kernels `select` picks for it (fields of the record
    `override`n): (cache, logits)."""
    import dataclasses

    from ling_jax.decode import decode_step
    from ling_jax.kernels import select

    global _DECODE_STEP
    _DECODE_STEP = _DECODE_STEP or jax.jit(decode_step, static_argnums=(0, 1, 5))
    kernels = dataclasses.replace(select(cfg, dtype=params["embed"].dtype, decode=True, unroll=unroll), **override)
    return _DECODE_STEP(cfg, kernels, params, cache, tok, unroll)


def prefill_cache(cfg, params, ids, lengths, max_len):
    """`ling_jax.decode.prefill` with the kernels `select` picks for it: (cache, last logits)."""
    from ling_jax.decode import prefill
    from ling_jax.kernels import select

    return prefill(cfg, select(cfg, dtype=params["embed"].dtype, inference=True), params, ids, lengths, max_len)


def fused_params(cfg, params):
    """`ling_jax.decode.fuse_for_decode` of `params` (the decode loop's params)."""
    from ling_jax.decode import fuse_for_decode
    from ling_jax.kernels import select

    return fuse_for_decode(cfg, select(cfg, dtype=params["embed"].dtype, decode=True), params)


def rel_l2(x, y) -> float:
    """||x - y|| / ||y|| over the whole array, in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


@pytest.fixture(scope="session")
def golden_a():
    """(config, float32 params, golden arrays) of SET A, loaded through the real HF loader."""
    import ling_jax

    cfg, params = ling_jax.load_hf_checkpoint(GOLDEN / "ling3_tiny_a", dtype="float32")
    return cfg, params, dict(np.load(GOLDEN / "ling3_tiny_a" / "golden.npz"))


@pytest.fixture(scope="session")
def golden_fp8():
    import ling_jax

    cfg, params = ling_jax.load_hf_checkpoint(GOLDEN / "ling3_tiny_a_fp8", dtype="float32")
    return cfg, params, dict(np.load(GOLDEN / "ling3_tiny_a_fp8" / "golden.npz"))


MAPS_PATH, MAX_MAPS_PATH = Path("/proc/self/maps"), Path("/proc/sys/vm/max_map_count")


def _release_compiled_programs(share: float) -> None:
    """Drops JAX's caches of compiled programs once this process holds more than `share` of the
    kernel's memory-map limit (Linux `vm.max_map_count`, 65530 by default).

    Every XLA:CPU executable keeps its code in memory maps, and the jit caches keep the executables:
    the interpret-mode Pallas tests add 200-400 maps each, an engine test thousands. XLA:CPU segfaults
    compiling once a process crosses the limit (seen in the default suite, at test_train's bf16 step,
    and in the heavy cases, inside test_engine.py: each passes alone)."""
    if not (MAPS_PATH.exists() and MAX_MAPS_PATH.exists()):
        return
    with MAPS_PATH.open() as f:
        n_maps = sum(1 for _ in f)
    if n_maps > int(MAX_MAPS_PATH.read_text()) * share:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_between_modules():
    """After each test module, past a third of the limit: the next module mostly compiles programs of
    its own, so clearing there costs little, and keeps the shared caches for the modules that stay
    small."""
    yield
    _release_compiled_programs(1 / 3)


@pytest.fixture(autouse=True)
def _release_inside_a_module():
    """After each test, past half of the limit: bounds what one module's tests can add between two
    module boundaries (an engine test adds about 5 k maps), while clearing less often than the module
    check, since a clear inside a module recompiles its shared programs. No test counts compiles
    across a test boundary, so a clear between two tests changes no outcome."""
    yield
    _release_compiled_programs(1 / 2)


@pytest.fixture
def h200_lowering(monkeypatch):
    """Lets Pallas lower Triton kernels for platform "cuda" on this CPU box, as for an H200 (no device
    needed). Returns `lower(fn, *arg_shapes) -> MLIR text` of `jax.jit(fn)` exported for cuda."""
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    if not hasattr(gpu_info, "registry"):
        pytest.skip("this jax has no GPU-info registry to describe an H200 with")
    monkeypatch.setitem(gpu_info.registry, jax.devices()[0].device_kind,
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

    def lower(fn, *args):
        return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()

    return lower


class _JaxWithCores(types.ModuleType):
    """`jax` for transposed_ragged_dot_mgpu, which reads `jax.devices()[0].core_count` (a GPU attribute)."""

    def __init__(self):
        super().__init__("jax")

    def __getattr__(self, name):
        return getattr(jax, name)

    @staticmethod
    def devices():
        return [types.SimpleNamespace(core_count=4)]


@pytest.fixture
def mgpu_dw_on_cpu(monkeypatch):
    """Lets JAX's `transposed_ragged_dot_mgpu` (the dW of the "mgpu" and "aligned" MoE kernels) run in
    the Mosaic-GPU interpreter here: it sizes its grid by the GPU's SM count, which a CPU lacks."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    monkeypatch.setattr(transposed_ragged_dot_mgpu, "jax", _JaxWithCores())

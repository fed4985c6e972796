"""The architecture the folders promise: imports point one way, and nothing below the selection point
chooses an implementation by probing the platform."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ling_jax"


def _imports(path: Path) -> set[str]:
    """Every `ling_jax...` module a file imports (at any depth: function-level imports count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ling_jax"):
            if node.module == "ling_jax":  # `from ling_jax import sharding`: the submodules named
                out.update(f"ling_jax.{a.name}" for a in node.names)
            else:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("ling_jax"))
    return out


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder, allowed", [
    ("ops", ("ling_jax.ops",)),
    ("layers", ("ling_jax.ops", "ling_jax.layers", "ling_jax.config", "ling_jax.kernels", "ling_jax.sharding")),
    ("checkpoint", ("ling_jax.checkpoint", "ling_jax.config", "ling_jax.params", "ling_jax.cli")),
])
def test_imports_point_one_way(folder, allowed):
    """ops/ imports nothing from outside ops/; layers/ nothing of the decode step, the engine, the model or
    the generate loop; checkpoint/ nothing of the model."""
    for path in _modules(folder):
        bad = sorted(m for m in _imports(path) if not m.startswith(allowed))
        assert not bad, f"{path.relative_to(ROOT.parent)} imports {bad}"


def test_config_imports_no_kernels():
    assert not _imports(ROOT / "config.py")


def test_convert_and_export_do_not_import_each_other():
    assert not any(m.startswith("ling_jax.checkpoint.export") for m in _imports(ROOT / "checkpoint" / "convert.py"))
    assert not any(m.startswith("ling_jax.checkpoint.convert") for m in _imports(ROOT / "checkpoint" / "export.py"))


def test_only_the_selection_point_probes_the_platform():
    """`jax.default_backend()` / `jax.devices()` decide implementations in `kernels.py` only (ops choose a
    kernel's backend where the program is lowered, `ops.platform`, which reads the default backend only to
    decide where a form its platform refuses raises: never which kernel runs)."""
    probes = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name in ("kernels.py", "demo.py", "distributed.py", "sharding.py", "memory.py", "nnx.py") or \
                path.relative_to(ROOT).as_posix() == "ops/platform.py":
            continue
        text = path.read_text()
        if "default_backend()" in text:
            probes.append(str(path.relative_to(ROOT.parent)))
    assert not probes, probes

"""`ops.platform.on_platform`: the lowering platform's form; a form its platform refuses falls back to the
interpreted ("cpu") form where the program does not run, and raises where it does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ling_jax.ops.platform import on_platform


def _make(refuses: str):
    def make(p):
        def form(x):
            if p == refuses:
                raise ValueError(f"{p} refuses these arguments")
            return x + {"cpu": 1.0, "cuda": 2.0, "rocm": 3.0, "tpu": 4.0}[p]

        return form

    return make


def _exported(fn, platform):
    return jax.export.export(jax.jit(fn), platforms=[platform])(jnp.zeros(3)).mlir_module()


def test_each_platform_lowers_its_form():
    fn = lambda x: on_platform(_make(refuses=""), x)  # noqa: E731
    assert float(jax.jit(fn)(jnp.zeros(3))[0]) == 1.0
    assert "4.0" in _exported(fn, "tpu") and "2.0" in _exported(fn, "cuda")


def test_a_refused_form_falls_back_where_the_program_does_not_run():
    fn = lambda x: on_platform(_make(refuses="tpu"), x)  # noqa: E731
    assert float(jax.jit(fn)(jnp.zeros(3))[0]) == 1.0  # runs here (cpu): the tpu branch never fails it
    text = _exported(fn, "tpu")
    assert "4.0" not in text and "1.0" in text  # exported for the TPU: the interpreted form


def test_a_refused_form_raises_where_the_program_runs():
    with pytest.raises(ValueError, match="cpu refuses"):
        jax.jit(lambda x: on_platform(_make(refuses="cpu"), x))(jnp.zeros(3))

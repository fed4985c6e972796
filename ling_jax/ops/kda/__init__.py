"""Kimi Delta Attention: one public entry point, several implementations (see `api.py`)."""

from ling_jax.ops.kda.api import kimi_delta_attention

__all__ = ["kimi_delta_attention"]

"""Hot paths behind stable signatures, each with a plain-JAX reference implementation."""

from ling_jax.ops.kda import kimi_delta_attention

__all__ = ["kimi_delta_attention"]

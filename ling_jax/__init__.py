"""ling-jax: Ling-3 (BailingMoeV3) models in JAX — the public API of ../shared/spec/API.md."""

from ling_jax import ops
from ling_jax.checkpoint.hf import load_hf_checkpoint
from ling_jax.checkpoint.orbax_io import load_checkpoint
from ling_jax.config import LingConfig
from ling_jax.generate import generate
from ling_jax.model import forward, forward_with_mtp
from ling_jax.sharding import make_mesh

__all__ = [
    "LingConfig", "forward", "forward_with_mtp", "generate", "load_checkpoint", "load_hf_checkpoint", "make_mesh",
    "ops",
]

"""The serving engine: continuous batching over a paged latent cache (`Engine`), and what a request
hands it and gets back (`SamplingParams`, `RequestHandle`, `TokenOutput`)."""

from ling_jax.engine.engine import Engine
from ling_jax.engine.request import MAX_LOGPROBS, QueueFull, RequestHandle, SamplingParams, TokenOutput

__all__ = ["MAX_LOGPROBS", "Engine", "QueueFull", "RequestHandle", "SamplingParams", "TokenOutput"]

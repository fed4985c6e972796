"""The decode step and what serves it: `decode_step` over explicit caches (`step`), the layers' one-token
forms (`layers`), the views through which decode kernels read layer stacks in place (`views`),
sampling (`sampling`) and the batch decode loop (`loop`)."""

from ling_jax.decode.loop import decode_loop
from ling_jax.decode.sampling import sample
from ling_jax.decode.step import decode_step, fuse_for_decode, prefill

__all__ = ["decode_loop", "decode_step", "fuse_for_decode", "prefill", "sample"]

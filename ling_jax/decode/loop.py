"""The batch decode loop: tokens for every row in one jitted `lax.while_loop` on a donated cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ling_jax.cache import Cache
from ling_jax.config import LingConfig
from ling_jax.decode.sampling import sample
from ling_jax.decode.step import decode_step, fuse_for_decode
from ling_jax.kernels import Kernels, select
from ling_jax.params import Params


def decode_loop(cfg: LingConfig, params: Params, cache: Cache, logits_BV: jax.Array, max_new: int,
                keys_B: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                stop_S: jax.Array, n_new: jax.Array | None = None, *, unroll_layers: bool = True,
                kernels: Kernels | None = None) -> tuple[jax.Array, jax.Array, Cache]:
    """Generates up to `n_new` (default `max_new`) tokens per row: (tokens [B, max_new] (-1 past each
    row's end), count per row [B], final cache). `max_new` only sizes the output buffer (static);
    `n_new` is traced, so calls asking for different numbers of tokens within one buffer size share a
    compilation.

    Row b samples step i with `fold_in(keys_B[b], i)` (`generate` derives `keys_B` from the seed and
    each row's prompt). A row stops after emitting a token of `stop_S`; the loop ends when every
    row has stopped. The cache is donated and returned, so the loop updates it in place.
    `unroll_layers` (default) compiles the step as one straight-line program over the layers:
    faster steps than the layer scans (which copy every layer's cache slice in and out), for a longer
    compile. `kernels`: default `kernels.select` for the params' dtype and this step.
    """
    kernels = kernels or select(cfg, dtype=params["embed"].dtype, decode=True, unroll=unroll_layers)
    return _decode_loop(cfg, kernels, params, cache, logits_BV, max_new, keys_B, temperature, top_k, top_p, stop_S,
                        n_new, unroll_layers=unroll_layers)


@functools.partial(jax.jit, static_argnums=(0, 1, 5), static_argnames=("unroll_layers",), donate_argnums=(3,))
def _decode_loop(cfg: LingConfig, kernels: Kernels, params: Params, cache: Cache, logits_BV: jax.Array, max_new: int,
                 keys_B: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, stop_S: jax.Array,
                 n_new: jax.Array | None, *, unroll_layers: bool) -> tuple[jax.Array, jax.Array, Cache]:
    b = logits_BV.shape[0]
    limit = jnp.int32(max_new) if n_new is None else jnp.minimum(n_new, max_new)
    params = fuse_for_decode(cfg, kernels, params)

    def cond(state):
        step, _, _, _, done = state
        return (step < limit) & ~jnp.all(done)

    def body(state):
        step, cache, logits, out, done = state
        with jax.named_scope("sample"):
            tok = sample(logits, keys_B, step, temperature, top_k, top_p)
        out = out.at[:, step].set(jnp.where(done, -1, tok))
        done = done | jnp.isin(tok, stop_S)
        cache, logits = decode_step(cfg, kernels, params, cache, tok, unroll_layers)
        return step + 1, cache, logits, out, done

    init = (jnp.int32(0), cache, logits_BV, jnp.full((b, max_new), -1, jnp.int32), jnp.zeros((b,), bool))
    _, cache, _, out, _ = jax.lax.while_loop(cond, body, init)
    return out, jnp.sum(out >= 0, axis=1), cache

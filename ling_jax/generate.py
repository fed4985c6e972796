"""Batch generation: one jitted prefill that fills every cache, one jitted `lax.while_loop` decode.

Prompts of different lengths are right-padded into one batch; each row keeps its own length, so
cache slot = position, padding never reaches a KDA state, conv window or attended latent, and a
prompt's tokens do not depend on its neighbours. The decode loop (`ling_jax.decode.loop`) runs
entirely on device (no Python per token) on a donated cache: per step `ling_jax.decode.decode_step`,
sampling, stop handling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.cache import cache_length
from ling_jax.config import LingConfig
from ling_jax.decode import decode_loop, prefill
from ling_jax.decode.sampling import row_keys
from ling_jax.decode.speculative import speculative_loop
from ling_jax.decode.verify import has_mtp, prefill_speculative
from ling_jax.kernels import select
from ling_jax.params import Params
from ling_jax.sharding import warn_without_mesh


def _bucket(n: int, minimum: int = 16) -> int:
    """Powers of two (>= 16): prompt lengths and output buffers are padded to them so few shapes compile."""
    return max(minimum, 1 << (n - 1).bit_length())


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def _is_real(x: Any) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool | np.bool_)


def _token_ids(p: Any, what: str, vocab_size: int) -> np.ndarray:
    """`p` (a list / tuple / numpy or JAX array of token ids) as int32 [T]; ValueError naming `what`
    and the first bad id."""
    if isinstance(p, np.ndarray | jax.Array):
        arr = np.asarray(p)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{what}: token ids must be integers, got an array of {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"{what}: expected a 1-D sequence of token ids, got shape {arr.shape}")
        ids = arr.tolist()
    else:
        if isinstance(p, str | bytes) or not isinstance(p, Sequence):
            raise ValueError(f"{what}: expected a sequence of token ids, got {type(p).__name__}")
        bad = [t for t in p if not _is_int(t)]
        if bad:
            raise ValueError(f"{what}: token id {bad[0]!r} is not an integer")
        ids = list(p)
    outside = [t for t in ids if not 0 <= t < vocab_size]  # in Python: numpy overflows past 64 bits
    if outside:
        raise ValueError(f"{what} has token id {outside[0]} outside [0, vocab_size={vocab_size})")
    return np.asarray(ids, np.int32)


def _check_sampling(max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any) -> None:
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if not _is_real(temperature) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy)")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 = off)")
    if not _is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be a number in (0, 1]")


def generate(config: LingConfig, params: Params, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | Sequence[int] = 0,
             stop_tokens: Sequence[int] | None = None, unroll_layers: bool = True, speculative_tokens: int = 0,
             stats: dict[str, Any] | None = None) -> list[list[int]]:
    """New tokens for each prompt (token ids: a list, tuple or 1-D array), stopping after a stop token
    (included).

    `stop_tokens=None` uses the config's `eos_token_id`; `()` never stops early. Greedy when
    `temperature == 0`. Sampling draws each row from its own key, made from `seed` and its prompt:
    a prompt's output is the same in any batch, and identical prompts in one call draw alike unless
    `seed` is a sequence (one seed per prompt). Seeds are 64-bit integers. One jitted prefill and one
    jitted decode loop; `unroll_layers=False` compiles its step with layer scans (`decode_loop`): a
    faster compile, slower steps.

    `speculative_tokens=k` (> 0; needs an MTP layer, else ValueError) decodes with the MTP layer
    drafting k tokens per step and the main model verifying k + 1 positions in one call
    (`ling_jax.decode.speculative`): greedy tokens are the ones without it (the verify step's logits
    are the one-token step's up to rounding: in float32 the same tokens, exact ties aside), sampled
    tokens have the same distribution (drawn differently: other tokens for a seed).
    `stats`, a dict, receives the decoding statistics: "speculative_tokens", and with k > 0 "steps"
    (verify calls), "row_steps" (verify steps summed over the rows still generating), "accepted_drafts",
    "mean_accepted_length" (tokens per row per verify step, 1 to k + 1) and "acceptance_rate" (accepted
    drafts / drafted); the two ratios are None when no verify step ran.
    """
    if not isinstance(prompts, Sequence | np.ndarray | jax.Array) or isinstance(prompts, str | bytes):
        raise ValueError(f"prompts: expected a list of token-id sequences, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    if not _is_int(speculative_tokens) or speculative_tokens < 0:
        raise ValueError(f"speculative_tokens={speculative_tokens!r} must be an integer >= 0 (0 = off)")
    if speculative_tokens and not has_mtp(config, params):
        raise ValueError(f"speculative_tokens={speculative_tokens} drafts with the MTP layer, and this model has none "
                         f"(num_nextn_predict_layers={config.num_nextn_predict_layers})")
    warn_without_mesh(params)
    max_new_tokens, top_k, k = int(max_new_tokens), int(top_k), int(speculative_tokens)  # numpy scalars as ints
    seeds = [seed] * len(prompts) if _is_int(seed) else list(seed) if isinstance(seed, Sequence) else None
    if seeds is None or len(seeds) != len(prompts) or not all(_is_int(s) and -2**63 <= s < 2**64 for s in seeds):
        raise ValueError(f"seed={seed!r} must be a 64-bit integer or a sequence of one per prompt")
    rows = [_token_ids(p, f"prompt {i}", config.vocab_size) for i, p in enumerate(prompts)]
    lengths = [len(r) for r in rows]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"prompt {i} is empty")
        if n + max_new_tokens > config.max_position_embeddings:
            raise ValueError(f"prompt {i}: {n} tokens + max_new_tokens={max_new_tokens} exceeds "
                             f"max_position_embeddings={config.max_position_embeddings}")
    if stop_tokens is None:
        stop = tuple(config.eos_token_id)
    else:
        stop = tuple(_token_ids(stop_tokens, "stop_tokens", config.vocab_size).tolist())
    t = _bucket(max(lengths))
    ids = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    stop_S = jnp.asarray(stop if stop else (-2,), jnp.int32)  # -2 never sampled
    # static shapes come in buckets (cache slots in whole decode-attention blocks, the output buffer in
    # powers of two), so calls with other prompt lengths or token budgets reuse the compilations
    slots = cache_length(max(lengths) + max_new_tokens + k)  # a verify step writes k rows past the last token
    dtype = params["embed"].dtype
    sampling = (jnp.float32(temperature), jnp.int32(min(top_k, config.vocab_size)), jnp.float32(top_p))
    if k:
        out, counts = _speculative(config, params, jnp.asarray(ids), lengths, slots, _bucket(max_new_tokens),
                                   row_keys(seeds, rows), sampling, stop_S, max_new_tokens, k, unroll_layers, stats)
    else:
        cache, logits = prefill(config, select(config, dtype=dtype, inference=True), params, jnp.asarray(ids),
                                jnp.asarray(lengths, jnp.int32), slots)
        out, counts, _ = decode_loop(config, params, cache, logits, _bucket(max_new_tokens), row_keys(seeds, rows),
                                     *sampling, stop_S, jnp.int32(max_new_tokens), unroll_layers=unroll_layers,
                                     kernels=select(config, dtype=dtype, decode=True, unroll=unroll_layers))
        if stats is not None:
            stats.update(speculative_tokens=0)
    out, counts = np.asarray(out), np.asarray(counts)
    return [out[i, : counts[i]].tolist() for i in range(len(rows))]


def _speculative(config: LingConfig, params: Params, ids: jax.Array, lengths: list[int], slots: int, max_new: int,
                 keys: jax.Array, sampling: tuple[jax.Array, ...], stop_S: jax.Array, n_new: int, k: int,
                 unroll_layers: bool, stats: dict[str, Any] | None) -> tuple[jax.Array, jax.Array]:
    """`generate`'s prefill and decode loop with k drafts per step: (tokens [B, max_new], counts [B])."""
    kernels = select(config, dtype=params["embed"].dtype, inference=True)
    cache, logits, hidden, mtp_latent = prefill_speculative(config, kernels, params, ids,
                                                            jnp.asarray(lengths, jnp.int32), slots)
    out, counts, _, _, st = speculative_loop(config, params, cache, mtp_latent, logits, hidden, max_new, keys,
                                             *sampling, stop_S, jnp.int32(n_new), k=k, unroll_layers=unroll_layers,
                                             kernels=kernels)
    if stats is not None:
        steps, row_steps, accepted = (int(st[n]) for n in ("steps", "row_steps", "accepted"))
        stats.update(speculative_tokens=k, steps=steps, row_steps=row_steps, accepted_drafts=accepted,
                     mean_accepted_length=(row_steps + accepted) / row_steps if row_steps else None,
                     acceptance_rate=accepted / (k * row_steps) if row_steps else None)
    return out, counts

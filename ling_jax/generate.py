"""Batch generation: one jitted prefill that fills every cache, one jitted `lax.while_loop` decode.

Prompts of different lengths are right-padded into one batch; each row keeps its own length, so
cache slot = position, padding never reaches a KDA state, conv window or attended latent, and a
prompt's tokens do not depend on its neighbours. The decode loop runs entirely on device (no
Python per token) on a donated cache: per step one token per row through every layer (KDA: one
recurrent step; MLA: absorbed attention over the latent cache), sampling, stop handling.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.cache import Cache, cache_length, place
from ling_jax.checkpoint.fp8 import is_block_fp8
from ling_jax.config import LingConfig
from ling_jax.layers import kda, mla
from ling_jax.layers.mlp import fuse_gate_up
from ling_jax.layers.norms import rms_norm
from ling_jax.layers.rope import rope_cos_sin
from ling_jax.model import decoder_layer, embed, lm_head, make_context, run_stack, sequence_mixer
from ling_jax.ops.moe import inference as moe_inference
from ling_jax.params import Params, get_path, layer_stacks, set_path
from ling_jax.sharding import context_mesh, multi_device, warn_without_mesh


def _last(h_BTD: jax.Array, lengths_B: jax.Array) -> jax.Array:
    return jnp.take_along_axis(h_BTD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnums=(0, 4))
def prefill(cfg: LingConfig, params: Params, ids_BT: jax.Array, lengths_B: jax.Array,
            max_len: int) -> tuple[Cache, jax.Array]:
    """Runs right-padded prompts, returns (cache for `max_len` tokens, logits of each row's last token).

    ids: [B, T]; row b's prompt is ids[b, :lengths[b]]. KDA layers keep their final state and the
    conv window of the last real token; MLA layers write their latent rows into slots [0, T).
    """
    b, t = ids_BT.shape
    slots = cache_length(max_len)
    valid = jnp.arange(t)[None, :] < lengths_B[:, None]
    ctx = make_context(cfg, ids_BT, attention_mask=valid)
    mix = sequence_mixer(cfg, ctx)

    def layer(p, x, lim, _, mixer, ffn):
        x, c, _ = decoder_layer(p, x, lim, cfg=cfg, ffn=ffn, mix=lambda pa, h: mix(pa, h, mixer, None))
        if mixer == "mla":
            n = min(t, slots)  # the prompt bucket may outgrow the cache; rows past every length are padding
            c = {"latent": jnp.zeros((b, slots, c["latent"].shape[-1]), x.dtype).at[:, :n].set(c["latent"][:, :n])}
        return x, c

    with moe_inference():  # nothing differentiates a prefill
        x, caches = run_stack(cfg, params, embed(params, ids_BT), layer)
    h = rms_norm(_last(x, lengths_B), params["final_norm"], cfg.rms_norm_eps)
    return place({"segments": caches, "lengths": lengths_B.astype(jnp.int32)}), lm_head(cfg, params, h)


def decode_step(cfg: LingConfig, params: Params, cache: Cache, tokens_B: jax.Array,
                unroll: bool = True) -> tuple[Cache, jax.Array]:
    """One token per row at position cache["lengths"]: (updated cache, logits [B, V] float32).

    `unroll`: the layer scans unrolled (see `run_stack`)."""
    lengths = cache["lengths"]
    cos, sin = rope_cos_sin(lengths[:, None], cfg.qk_rope_head_dim, cfg.rope_theta)

    def mix(p, h_B1D, mixer, c):
        if mixer == "kda":
            return kda.kda_mixer(p, h_B1D, cfg=cfg, cache=c)
        out_BD, row_BW = mla.mla_decode(p, h_B1D[:, 0], c["latent"], lengths, cfg=cfg, cos=cos, sin=sin)
        return out_BD[:, None], row_BW

    def layer(p, x, lim, c, mixer, ffn):
        x, new, _ = decoder_layer(p, x, lim, cfg=cfg, ffn=ffn, mix=lambda pa, h: mix(pa, h, mixer, c))
        return x, new

    with moe_inference():
        x, new = run_stack(cfg, params, embed(params, tokens_B[:, None]), layer, caches=cache["segments"],
                           unroll=unroll)
    # the cache writes below wait for the last layer: else XLA may schedule a segment's latent write
    # before that segment's attention has read the cache, and then copies the whole cache to keep the
    # old rows (H200, batch 128, 33k slots: 2 x 5 GB per step)
    x, new = jax.lax.optimization_barrier((x, new))
    rows = jnp.arange(tokens_B.shape[0])

    def merge(seg_cache: dict, seg_new: Any) -> dict:
        if "latent" in seg_cache:  # scatter the new latent row of every layer into slot `lengths`
            return {"latent": seg_cache["latent"].at[:, rows, lengths].set(seg_new)}
        return seg_new

    with jax.named_scope("cache_write"):
        segs = []
        for seg, c, y in zip(cfg.segments, cache["segments"], new, strict=True):
            segs.append(merge(c, y) if seg.kind == "run" else {k: merge(c[k], y[k]) for k in c})
    with jax.named_scope("lm_head"):
        logits = lm_head(cfg, params, rms_norm(x[:, 0], params["final_norm"], cfg.rms_norm_eps))
    return place({"segments": segs, "lengths": lengths + 1}), logits


def sample(logits_BV: jax.Array, keys_B: jax.Array, step: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
    """Next token per row: greedy when temperature == 0, else top-k / top-p filtered sampling, row b
    drawing with `fold_in(keys_B[b], step)` (its own key: its draws do not depend on its batch)."""
    greedy = jnp.argmax(logits_BV, axis=-1)

    def sampled() -> jax.Array:
        logits = logits_BV / jnp.maximum(temperature, 1e-6)
        srt = jnp.sort(logits, axis=-1)[:, ::-1]
        kth = jnp.where(top_k > 0, jnp.take(srt, jnp.clip(top_k - 1, 0, srt.shape[-1] - 1), axis=-1), -jnp.inf)
        probs = jax.nn.softmax(jnp.where(srt >= kth[:, None], srt, -jnp.inf), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
        keep = (before < top_p) & (srt >= kth[:, None])
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1)
        masked = jnp.where(logits >= cutoff[:, None], logits, -jnp.inf)
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, step)
        return jax.vmap(jax.random.categorical)(keys, masked)

    return jax.lax.cond(temperature > 0, sampled, lambda: greedy).astype(jnp.int32)


def fuse_for_decode(cfg: LingConfig, params: Params) -> Params:
    """`params` with the weights that multiply the same input also side by side in one matrix: each
    KDA layer's six input projections (`layers.kda.fuse_input_projections`), each MLA layer's three
    (`layers.mla.fuse_input_projections`) and each MLP's or shared expert's gate and up projections
    (`layers.mlp.fuse_gate_up`). A batch-1 Ling-3.0-tiny step then launches 18 products instead of
    108 for the KDA inputs, 6 instead of 18 for the MLA inputs and 24 instead of 48 for the shared
    experts. Made inside the decode loop's jit, once per call (a second copy of those weights
    meanwhile). Unchanged under a multi-device mesh (the concatenation would regather sharded
    columns); FP8-resident weights are left separate (it would dequantize them)."""
    if multi_device(context_mesh()):
        return params
    new = jax.tree.map(lambda x: x, params, is_leaf=is_block_fp8)  # fresh containers: set_path below mutates

    def fuse(path: tuple, fn: Callable[[dict], dict]) -> None:
        set_path(new, path, fn(get_path(new, path)))

    for stack in layer_stacks(cfg):
        if stack.mtp:
            continue
        fuse((*stack.path, "attn"), (kda if stack.mixer == "kda" else mla).fuse_input_projections)
        if stack.ffn == "dense":
            fuse((*stack.path, "mlp"), fuse_gate_up)
        elif "shared_gate_proj" in get_path(new, (*stack.path, "mlp")):
            fuse((*stack.path, "mlp"), functools.partial(fuse_gate_up, prefix="shared_"))
    return new


@functools.partial(jax.jit, static_argnums=(0, 4), static_argnames=("unroll_layers",), donate_argnums=(2,))
def decode_loop(cfg: LingConfig, params: Params, cache: Cache, logits_BV: jax.Array, max_new: int,
                keys_B: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                stop_S: jax.Array, n_new: jax.Array | None = None, *,
                unroll_layers: bool = True) -> tuple[jax.Array, jax.Array, Cache]:
    """Generates up to `n_new` (default `max_new`) tokens per row: (tokens [B, max_new], count per row
    [B], final cache). `max_new` only sizes the output buffer (static); `n_new` is traced, so calls
    asking for different numbers of tokens within one buffer size share a compilation.

    Row b samples step i with `fold_in(keys_B[b], i)` (`generate` derives `keys_B` from the seed and
    each row's prompt). A row stops after emitting a token of `stop_S`; the loop ends when every
    row has stopped.
    The cache is donated and returned, so the loop updates it in place (no second copy).
    `unroll_layers` (default) compiles the step as one straight-line program over the layers
    (`run_stack`): on an H200 a Ling-3.0-tiny step took 5.9 instead of 12.9 ms at batch 1 and
    12.0 instead of 18.2 ms at batch 16 (the scans copied every layer's cache slice in and out),
    for a longer compile (2.5x at batch 1, 1.3x at batch 16).
    """
    b = logits_BV.shape[0]
    limit = jnp.int32(max_new) if n_new is None else jnp.minimum(n_new, max_new)
    params = fuse_for_decode(cfg, params)

    def cond(state):
        step, _, _, _, done = state
        return (step < limit) & ~jnp.all(done)

    def body(state):
        step, cache, logits, out, done = state
        with jax.named_scope("sample"):
            tok = sample(logits, keys_B, step, temperature, top_k, top_p)
        out = out.at[:, step].set(jnp.where(done, -1, tok))
        done = done | jnp.isin(tok, stop_S)
        cache, logits = decode_step(cfg, params, cache, tok, unroll_layers)
        return step + 1, cache, logits, out, done

    init = (jnp.int32(0), cache, logits_BV, jnp.full((b, max_new), -1, jnp.int32), jnp.zeros((b,), bool))
    _, cache, _, out, _ = jax.lax.while_loop(cond, body, init)
    return out, jnp.sum(out >= 0, axis=1), cache


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


def _row_keys(seeds: Sequence[int], rows: Sequence[np.ndarray]) -> jax.Array:
    """One PRNG key per row from its 64-bit seed and a hash (CRC-32) of its prompt's ids, so a row's
    draws depend on nothing else in its batch."""
    words = np.array([(int(s) & 0xFFFFFFFF, (int(s) >> 32) & 0xFFFFFFFF, zlib.crc32(r.astype("<i4").tobytes()))
                      for s, r in zip(seeds, rows, strict=True)], np.uint32)

    def key(w_3: jax.Array) -> jax.Array:
        k = jax.random.key(0)
        for j in range(3):
            k = jax.random.fold_in(k, w_3[j])
        return k

    return jax.vmap(key)(jnp.asarray(words))


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
             stop_tokens: Sequence[int] | None = None, unroll_layers: bool = True) -> list[list[int]]:
    """New tokens for each prompt (token ids: a list, tuple or 1-D array), stopping after a stop token
    (included).

    `stop_tokens=None` uses the config's `eos_token_id`; `()` never stops early. Greedy when
    `temperature == 0`. Sampling draws each row from its own key, made from `seed` and its prompt:
    a prompt's output is the same in any batch, and identical prompts in one call draw alike unless
    `seed` is a sequence (one seed per prompt). Seeds are 64-bit integers. One jitted prefill and one
    jitted decode loop; `unroll_layers=False` compiles its step with layer scans (`decode_loop`): a
    faster compile, slower steps.
    """
    if not isinstance(prompts, Sequence | np.ndarray | jax.Array) or isinstance(prompts, str | bytes):
        raise ValueError(f"prompts: expected a list of token-id sequences, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    warn_without_mesh(params)
    max_new_tokens, top_k = int(max_new_tokens), int(top_k)  # numpy scalars as Python ints
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
    slots = cache_length(max(lengths) + max_new_tokens)
    cache, logits = prefill(config, params, jnp.asarray(ids), jnp.asarray(lengths, jnp.int32), slots)
    out, counts, _ = decode_loop(config, params, cache, logits, _bucket(max_new_tokens), _row_keys(seeds, rows),
                                 jnp.float32(temperature), jnp.int32(min(top_k, config.vocab_size)),
                                 jnp.float32(top_p), stop_S, jnp.int32(max_new_tokens), unroll_layers=unroll_layers)
    out, counts = np.asarray(out), np.asarray(counts)
    return [out[i, : counts[i]].tolist() for i in range(len(rows))]

"""Decode benchmark: ms per step of the jitted decode loop against the HBM floor.

    python3 bench/decode.py --out bench/results/decode_h200.json        # the GPU run
    python3 bench/decode.py --smoke --out /tmp/decode_smoke.json        # CPU, debug preset, seconds
    python3 bench/decode.py --batches 1 --contexts 1024 --profile /tmp/trace --out ...   # + kernel table

A Ling-3.0-tiny-shaped model (all 24 layers, random bf16 weights generated on the device) decodes
`--steps` tokens per row with `ling_jax.decode.decode_loop` (one `lax.while_loop`, greedy) at
each batch size and context length. Caches are allocated once per batch size for the longest
context and filled with random latents/states up to the context length (prefill is not timed):
the decode attention walks only the used blocks, so the short context shares the allocation.
Each timed call continues from the cache the previous one returned, so a call starts `steps`
tokens further than the last (the recorded context is where the first call starts).

HBM floor of one step = bytes that must move / measured copy bandwidth (bytes read + written by a
device-timed copy of 2 GiB, same run, `bench.common.copy_bandwidth`; a wall-clock bf16 `a * 2` pass
undercounts the bandwidth by ~1.5x): every attention/dense/shared/router
weight, the routed experts the batch touches (expected distinct experts per layer
E·(1 - (1 - k/E)^B) under uniform routing),
the lm_head, the MLA latent cache read up to the context, the KDA state read + written. Goal at
batch 1: time <= 1.3x the floor.

`--scan` keeps the layer scans (`decode_loop(unroll_layers=False)`); `--fp8` keeps the layers'
linear weights block-FP8 on the device (`BlockFP8` leaves, as `load_checkpoint(keep_fp8=True)`
returns them; the floor then counts 1 byte per such weight); `--profile DIR` traces 3 calls of
every configuration and prints where the device time goes (`bench/device_profile.py`).

`--speculative-tokens K [K ...]` times speculative decoding's parts instead, at each batch and context, in
the same process on the same random cache: the one-token step (`decode_step`, as the loop runs it),
the verify step of K + 1 positions per row with the commit of all of them (`decode.verify`: its row form,
as the loop runs it unrolled; `--sequence-form` times its sequence forms too), and the
K drafts of the MTP layer (`decode.speculative.mtp_drafts`, in the same form); it reports verify / one-token step and
(drafts + verify) / one-token step, the mean accepted length above which a speculative step beats
one-token steps (the acceptance, sampling and output handling left out).

`--variant NAME:FIELD=VALUE,...` (repeatable) times the same configurations again with the tuned
constants overridden (`ling_jax.kernels.tuned`: e.g. `gemv_programs=132,prefetch_shared=False`),
after the table's setting, in the same process: the params are built once and every variant meets
the same device state, so the comparison is not blurred by the spread between device calls.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import copy_bandwidth, machine, median_time, random_fp8_params, random_params, write_json
from bench.device_profile import device_profile, print_profile
from ling_jax.cache import cache_length, cache_shapes
from ling_jax.config import LingConfig
from ling_jax.decode import decode_loop, decode_step, fuse_for_decode
from ling_jax.decode.speculative import mtp_drafts
from ling_jax.decode.verify import commit, verify_rows, verify_step
from ling_jax.kernels import Kernels, select, tuned
from train.flops import ffn_matmul_params, kda_matmul_params, mla_matmul_params


def step_bytes(cfg: LingConfig, batch: int, ctx: int, itemsize: int = 2, fp8: bool = False) -> dict[str, float]:
    """Bytes one decode step must move (see the module docstring); `fp8`: layer weights at 1 byte
    (their scales, 1/16384 of them, left out), the router and lm_head at `itemsize`."""
    kinds = cfg.layer_kinds
    e, k = cfg.num_experts or 0, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch) if e else 0.0
    weights, router = 0.0, 0.0
    for mixer, ffn in kinds:
        weights += kda_matmul_params(cfg) if mixer == "kda" else mla_matmul_params(cfg)
        if ffn == "dense":
            weights += ffn_matmul_params(cfg, "dense")
        else:
            d = cfg.hidden_size
            router += d * e  # never FP8 (an excluded module)
            weights += 3 * d * cfg.shared_intermediate_size + touched * 3 * d * cfg.moe_intermediate_size
    weights *= 1 if fp8 else itemsize
    weights += (router + cfg.hidden_size * cfg.vocab_size) * itemsize  # router, lm_head
    n_mla = sum(m == "mla" for m, _ in kinds)
    n_kda = len(kinds) - n_mla
    h, dh = cfg.num_attention_heads, cfg.head_dim
    latent = n_mla * batch * ctx * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize
    state = n_kda * batch * h * dh * dh * 4 * 2
    return {"weights": weights, "latent_cache": float(latent), "kda_state": float(state),
            "total": weights + latent + state, "experts_touched_per_layer": touched}


def random_cache(cfg: LingConfig, batch: int, slots: int, ctx: int, dtype) -> dict:
    shapes = cache_shapes(cfg, batch, slots, dtype)

    @jax.jit
    def make(key):
        leaves, tree = jax.tree.flatten(shapes)
        keys = jax.random.split(key, len(leaves))
        out = [jnp.full(s.shape, ctx, s.dtype) if s.dtype == jnp.int32
               else (0.1 * jax.random.normal(kk, s.shape, jnp.float32)).astype(s.dtype)
               for s, kk in zip(leaves, keys, strict=True)]
        return jax.tree.unflatten(tree, out)

    return make(jax.random.key(ctx))


def parse_variant(spec: str) -> tuple[str, dict[str, object]]:
    """'NAME:FIELD=VALUE,...' -> (NAME, {FIELD: VALUE}): fields of `ling_jax.kernels.Tuning` or of its
    `Launch` (`ling_jax.kernels.tuned` checks the names); VALUE a Python literal."""
    name, sep, body = spec.partition(":")
    items = [item.partition("=") for item in body.split(",") if item.strip()]
    if not (name and sep and items and all(eq for _, eq, _ in items)):
        raise SystemExit(f"--variant {spec!r}: expected NAME:FIELD=VALUE[,FIELD=VALUE...]")
    fields = {field.strip(): ast.literal_eval(value.strip()) for field, _, value in items}
    try:
        with tuned(**fields):
            pass
    except ValueError as e:
        raise SystemExit(f"--variant {spec!r}: {e}") from None
    return name, fields


def measure(cfg: LingConfig, params: Any, b: int, ctx: int, args: argparse.Namespace, bw: float,
            name: str) -> dict[str, Any]:
    """One configuration: ms per step of `args.steps`-token decode calls at batch b from context ctx,
    against the HBM floor at copy bandwidth bw (bytes/s); with --profile, where the device time went."""
    # every call continues the cache (warm-up, reps, 3 profiled calls): room for all their tokens
    slots = max(args.contexts) + args.steps * (args.reps + 1 + (3 if args.profile else 0))
    logits = jax.random.normal(jax.random.key(b), (b, cfg.vocab_size), jnp.float32)
    state = {"cache": random_cache(cfg, b, slots, ctx, jnp.bfloat16)}
    stop = jnp.asarray([-2], jnp.int32)
    zero, no_k, one = jnp.float32(0.0), jnp.int32(0), jnp.float32(1.0)
    keys = jax.random.split(jax.random.key(0), b)

    def call() -> tuple[jax.Array, jax.Array]:  # continues from the donated cache the last call returned
        out, counts, state["cache"] = decode_loop(cfg, params, state["cache"], logits, args.steps,
                                                  keys, zero, no_k, one, stop,
                                                  unroll_layers=not args.scan)
        return out, counts

    jax.block_until_ready(state["cache"])
    times, compile_s = [], 0.0
    for rep in range(args.reps + 1):
        t = time.perf_counter()
        _, counts = jax.block_until_ready(call())
        if rep == 0:
            compile_s = time.perf_counter() - t
        else:
            times.append(time.perf_counter() - t)
    assert int(np.min(np.asarray(counts))) == args.steps
    ms = 1e3 * float(np.median(times)) / args.steps
    need = step_bytes(cfg, b, ctx, fp8=args.fp8)
    floor_ms = 1e3 * need["total"] / bw
    run = {"variant": name, "batch": b, "context": ctx, "ms_per_step": ms, "tokens_per_s": b * 1e3 / ms,
           "hbm_floor_ms": floor_ms, "ratio_to_floor": ms / floor_ms, "bytes_per_step": need,
           "first_call_s_incl_compile": compile_s, "allocated_slots": slots}
    if args.profile:
        run["profile"] = prof = device_profile(call, f"{args.profile}/{name}_b{b}_c{ctx}",
                                               copies_module_re="decode_loop", sequence=args.profile_sequence)
        prof["ms_per_step_busy"] = 1e3 * prof["device_busy_s_per_call"] / args.steps
        prof["kernels_per_step"] = prof["kernels_per_call"] / args.steps
    return run


_one_token = jax.jit(decode_step, static_argnums=(0, 1, 5), donate_argnums=(3,))


@functools.partial(jax.jit, static_argnums=(0, 1, 5, 6), donate_argnums=(3,))
def _verify_all(cfg: LingConfig, kernels: Kernels, params: Any, cache: dict, tokens_BT: jax.Array,
                unroll: bool, rows: bool) -> tuple[dict, jax.Array]:
    """The verify step on T tokens per row, all committed: (cache advanced by T, logits [B, T, V]). `rows`:
    its row form (`verify_rows`: a decode record, fused params), else its sequence forms."""
    if rows:
        logits, _, new = verify_rows(cfg, kernels, params, cache, tokens_BT)
    else:
        logits, _, new = verify_step(cfg, kernels, params, cache, tokens_BT, unroll)
    return commit(cache, new, jnp.full((tokens_BT.shape[0],), tokens_BT.shape[1], jnp.int32)), logits


@functools.partial(jax.jit, static_argnums=(0, 1, 9, 10), donate_argnums=(3,))
def _drafts(cfg: LingConfig, kernels: Kernels, params: Any, latent: jax.Array, tok_BT: jax.Array, h_BTD: jax.Array,
            lengths_B: jax.Array, keys_B: jax.Array, counts_B: jax.Array, k: int,
            rows: Kernels | None) -> tuple[jax.Array, jax.Array]:
    """k greedy drafts per row after a verify that accepted every position, in the static greedy form (the
    engine's greedy speculative call's): (drafts [B, k], MTP cache); with `rows` (a decode record) in the
    row form."""
    b = tok_BT.shape[0]
    greedy = (jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32))
    drafts, _, latent = mtp_drafts(cfg, kernels, params, latent, tok_BT, h_BTD, jnp.full((b,), k + 1, jnp.int32),
                                   lengths_B, keys_B, counts_B, greedy, k, rows, sampled=False)
    return drafts, latent


def measure_speculative(cfg: LingConfig, params: Any, b: int, ctx: int, args: argparse.Namespace,
                        name: str) -> list[dict[str, Any]]:
    """One configuration of `--speculative-tokens K ...` (module doc): ms per one-token step, and for each K
    per verify step of K + 1 positions (committed) and per K drafts, each the median of `args.reps` calls
    continuing the cache; one record per K."""
    reps, unroll = args.reps, not args.scan
    dtype = jnp.bfloat16
    k_max = max(args.speculative_tokens)
    slots = ctx + (reps + 1) * (k_max + 1) + k_max
    decode_kernels = select(cfg, dtype=dtype, decode=True, unroll=unroll)
    seq_kernels = select(cfg, dtype=dtype, inference=True)
    rng = np.random.default_rng(b)
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, k_max + 1)), jnp.int32)
    keys = jax.random.split(jax.random.key(0), b)
    fused = jax.jit(fuse_for_decode, static_argnums=(0, 1))(cfg, decode_kernels, params)  # what the loop steps on
    state = {"one": random_cache(cfg, b, slots, ctx, dtype)}

    def one() -> jax.Array:
        state["one"], logits = _one_token(cfg, decode_kernels, fused, state["one"], toks[:, 0], unroll)
        return logits

    one_ms = 1e3 * median_time(one, reps=reps)
    del state["one"]
    runs = []
    for k in args.speculative_tokens:
        state["verify"] = random_cache(cfg, b, slots, ctx, dtype)
        state["latent"] = (0.1 * jax.random.normal(jax.random.key(1), (b, cache_length(slots), cfg.kv_lora_rank
                                                                       + cfg.qk_rope_head_dim))).astype(dtype)
        hidden = jax.random.normal(jax.random.key(2), (b, k + 1, cfg.hidden_size), dtype)

        def verify(k: int = k, rows: bool = unroll) -> jax.Array:
            kernels, p = (decode_kernels, fused) if rows else (seq_kernels, params)
            state["verify"], logits = _verify_all(cfg, kernels, p, state["verify"], toks[:, :k + 1], unroll, rows)
            return logits

        def drafts(k: int = k, hidden: jax.Array = hidden, rows: bool = unroll) -> jax.Array:
            out, state["latent"] = _drafts(cfg, seq_kernels, params, state["latent"], toks[:, :k + 1], hidden,
                                           state["verify"]["lengths"], keys, jnp.ones((b,), jnp.int32), k,
                                           decode_kernels if rows else None)
            return out

        verify_ms, drafts_ms = (1e3 * median_time(fn, reps=reps) for fn in (verify, drafts))
        run = {"variant": name, "batch": b, "context": ctx, "speculative_tokens": k,
               "verify_form": "rows" if unroll else "sequence", "one_token_step_ms": one_ms,
               "verify_step_ms": verify_ms, "drafts_ms": drafts_ms, "verify_over_one_token": verify_ms / one_ms,
               "breakeven_accepted_length": (verify_ms + drafts_ms) / one_ms}
        if unroll and args.sequence_form:
            run["verify_sequence_form_ms"] = 1e3 * median_time(functools.partial(verify, rows=False), reps=reps)
            run["drafts_sequence_form_ms"] = 1e3 * median_time(functools.partial(drafts, rows=False), reps=reps)
        runs.append(run)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="ling-3.0-tiny")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scan", action="store_true", help="layer scans, not unrolled (decode_loop(unroll_layers=False))")
    ap.add_argument("--fp8", action="store_true", help="FP8-resident layer weights (block 128x128)")
    ap.add_argument("--moe-impl", default="auto", help="the config's moe_impl (e.g. gemv: the Pallas decode kernel)")
    ap.add_argument("--decode-impl", default="auto", help="the config's decode_impl (xla or pallas)")
    ap.add_argument("--profile", metavar="DIR", help="trace each configuration and print its kernel table")
    ap.add_argument("--profile-sequence", type=int, default=0, metavar="N",
                    help="with --profile: also keep the first N kernels of a traced call in launch order")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                    help="also time every configuration with these tuned constants (module doc)")
    ap.add_argument("--sequence-form", action="store_true",
                    help="--speculative-tokens: also time the verify step's sequence forms (unrolled)")
    ap.add_argument("--speculative-tokens", type=int, nargs="+", default=[], metavar="K",
                    help="time the one-token step, and for each K the verify step of K + 1 positions and K MTP "
                    "drafts (module doc)")
    ap.add_argument("--smoke", action="store_true", help="debug preset, tiny sizes (CPU check of the script)")
    args = ap.parse_args()
    variants = [("tuned", {})] + [parse_variant(v) for v in args.variant]
    if args.smoke:
        args.preset, args.batches, args.contexts, args.steps, args.reps = "debug", [1, 4], [64, 300], 4, 1
    cfg = LingConfig.preset(args.preset, moe_impl=args.moe_impl, decode_impl=args.decode_impl)
    result = {**machine(), "preset": args.preset, "steps": args.steps, "dtype": "bfloat16",
              "unroll_layers": not args.scan, "fp8_resident": args.fp8, "moe_impl": args.moe_impl,
              "decode_impl": args.decode_impl, "runs": []}
    bw = copy_bandwidth(0.25 if args.smoke else 2.0)
    result["copy_bandwidth_GBps"] = bw / 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    t0 = time.perf_counter()
    params = jax.block_until_ready((random_fp8_params if args.fp8 else random_params)(cfg, jnp.bfloat16))
    print(f"random {args.preset} params: {sum(x.size for x in jax.tree.leaves(params)) / 1e9:.2f} B, "
          f"{sum(x.nbytes for x in jax.tree.leaves(params)) / 1e9:.2f} GB "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    for name, patches in variants:
        with tuned(**patches):
            for b in args.batches:
                for ctx in args.contexts:
                    if args.speculative_tokens:
                        for run in measure_speculative(cfg, params, b, ctx, args, name):
                            result["runs"].append(run)
                            k = run["speculative_tokens"]
                            print(f"{name:>12s} B={b:4d} ctx={ctx:6d} K={k}: one-token step "
                                  f"{run['one_token_step_ms']:8.3f} ms  verify ({k + 1} positions) "
                                  f"{run['verify_step_ms']:8.3f} ms ({run['verify_over_one_token']:.2f}x)  {k} drafts "
                                  f"{run['drafts_ms']:8.3f} ms  break-even accepted length "
                                  f"{run['breakeven_accepted_length']:.2f}"
                                  + (f"  sequence forms: verify {run['verify_sequence_form_ms']:8.3f} ms, drafts "
                                     f"{run['drafts_sequence_form_ms']:8.3f} ms"
                                     if "verify_sequence_form_ms" in run else ""), flush=True)
                        write_json(args.out, result)
                        continue
                    result["runs"].append(run := measure(cfg, params, b, ctx, args, bw, name))
                    print(f"{name:>12s} B={b:4d} ctx={ctx:6d}: {run['ms_per_step']:8.3f} ms/step  "
                          f"{run['tokens_per_s']:10.1f} tok/s  floor {run['hbm_floor_ms']:.3f} ms "
                          f"({run['ratio_to_floor']:.2f}x)  [first call {run['first_call_s_incl_compile']:.1f} s]",
                          flush=True)
                    if args.profile:
                        print_profile(run["profile"])
                    write_json(args.out, result)
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()

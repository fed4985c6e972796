"""What the decode loop's per-step host round trips cost at batch 1.

    python3 bench/experiments/decode_sync.py --out $OUT/decode_sync_h200.json   # the GPU run
    python3 bench/experiments/decode_sync.py --smoke --out /tmp/decode_sync.json         # CPU, debug preset

XLA runs a `lax.while_loop` on the GPU by copying its predicate to the host after every iteration
and launching the next, and a `lax.cond` (greedy or sampled, `ling_jax.decode.sample`) the same way. The
same decode step (`ling_jax.decode.decode_step`, Ling-3.0-tiny shape, random bf16 weights, 1k context,
`--steps` tokens per call, each call continuing the cache) in four loops:

    cond     while_loop, sampling through `decode.sample`'s cond (temperature 0): two round trips
    greedy   while_loop, argmax: one round trip per step
    fori     fori_loop with a static trip count: XLA runs it without reading the predicate back
    grouped  while_loop over groups of `--group` steps, each a static fori_loop: one per group

ms per step: the median call's wall time / steps. Every form must emit the first form's tokens.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import machine, random_params, write_json
from bench.decode import random_cache
from ling_jax.config import LingConfig
from ling_jax.decode import decode_step, fuse_for_decode, sample
from ling_jax.kernels import select

FORMS = ("cond", "greedy", "fori", "grouped")


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6), donate_argnums=(2,))
def loop(cfg: LingConfig, params: Any, cache: Any, logits_BV: jax.Array, steps: int, form: str,
         group: int) -> tuple[jax.Array, Any]:
    """`steps` greedy tokens per row in the loop `form`: (tokens [B, steps], the cache)."""
    kernels = select(cfg, dtype=params["embed"].dtype, decode=True, unroll=True)
    params = fuse_for_decode(cfg, kernels, params)

    def one(state):
        step, cache, logits, out = state
        if form == "cond":
            tok = sample(logits, jax.random.split(jax.random.key(0), logits.shape[0]), step, jnp.float32(0),
                         jnp.int32(0), jnp.float32(1))
        else:
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
        cache, logits = decode_step(cfg, kernels, params, cache, tok)
        return step + 1, cache, logits, out.at[:, step].set(tok)

    state = (jnp.int32(0), cache, logits_BV, jnp.zeros((logits_BV.shape[0], steps), jnp.int32))
    if form == "fori":
        state = jax.lax.fori_loop(0, steps, lambda i, s: one(s), state)
    elif form == "grouped":
        state = jax.lax.while_loop(lambda s: s[0] + group <= steps,
                                   lambda s: jax.lax.fori_loop(0, group, lambda i, t: one(t), s), state)
    else:
        state = jax.lax.while_loop(lambda s: s[0] < steps, one, state)
    return state[3], state[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    ap.add_argument("--smoke", action="store_true", help="debug preset, few steps (CPU check)")
    args = ap.parse_args()
    if args.steps % args.group:
        raise SystemExit(f"--steps {args.steps} must be a multiple of --group {args.group}")
    preset = "debug" if args.smoke else "ling-3.0-tiny"
    cfg = LingConfig.preset(preset)
    params = jax.block_until_ready(random_params(cfg, jnp.bfloat16))
    result: dict[str, Any] = {**machine(), "preset": preset, "steps": args.steps, "group": args.group, "runs": []}
    logits = jax.random.normal(jax.random.key(1), (1, cfg.vocab_size), jnp.float32)
    first: list[np.ndarray] = []
    for form in args.forms:
        cache = random_cache(cfg, 1, args.context + args.steps * (args.reps + 1), args.context, jnp.bfloat16)
        times, tokens = [], []
        for _ in range(args.reps + 1):
            t = time.perf_counter()
            out, cache = jax.block_until_ready(loop(cfg, params, cache, logits, args.steps, form, args.group))
            times.append(time.perf_counter() - t)
            tokens.append(np.asarray(out))
        first = first or tokens
        ms = 1e3 * float(np.median(times[1:])) / args.steps
        result["runs"].append({"form": form, "batch": 1, "context": args.context, "ms_per_step": ms,
                               "call_s": times[1:], "first_call_s_incl_compile": times[0],
                               "tokens_match_first_form": all(map(np.array_equal, tokens, first))})
        print(f"{form:>8s}: {ms:.4f} ms/step", flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()

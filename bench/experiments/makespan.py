"""The bound on the engine's output tokens/s against static `generate` that a workload's lengths set.

    python3 bench/experiments/makespan.py --num-requests 128 512 2048 --out bench/results/serve_makespan_c64.json

`bench/serve.py`'s requests (`make_conversations`, seed 0, the Ling-3.0-tiny vocabulary), `--concurrency`
at once, closed loop: a request starts in the slot that frees first, in arrival order, and needs
max_tokens - 1 decode steps (its first token comes from its prefill). The engine can finish no sooner
than its longest slot's steps (the makespan) at `--step-ms` a step, plus its prompts at
`--prefill-tokens-per-s` (prefill and decode calls share the device), prefill free as the loose bound.
Static `generate` runs batches of `--concurrency` in order: each decodes its longest request's steps at
`--static-step-ms` and prefills the batch padded to the longest prompt range at `--batch-prefill-tokens-per-s`.
The defaults are measured figures (BENCHMARKS.md, "Serving: the engine against static generate").
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import machine, write_json
from bench.serve import make_conversations


def makespan(max_tokens: Sequence[int], slots: int) -> int:
    """Decode steps until the last request ends, requests taking the first free slot in order."""
    free = [0] * slots
    end = 0
    for m in max_tokens:
        t = heapq.heappop(free) + m - 1
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def static_steps(max_tokens: Sequence[int], batch: int) -> int:
    """Decode steps of static batches of `batch` in order: each runs to its longest request."""
    return sum(max(max_tokens[i:i + batch]) for i in range(0, len(max_tokens), batch))


def bound(n: int, a: argparse.Namespace) -> dict:
    lo, hi = (int(x) for x in a.prompt_len.split(":"))
    olo, ohi = (int(x) for x in a.output_len.split(":"))
    reqs = [c[0] for c in make_conversations(n, (lo, hi), (olo, ohi), a.vocab_size, a.seed)]
    out = [r.max_tokens for r in reqs]
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    steps, s_steps = makespan(out, a.concurrency), static_steps(out, a.concurrency)
    batches = -(-n // a.concurrency)
    static_s = s_steps * a.static_step_ms / 1e3 + batches * a.concurrency * hi / a.batch_prefill_tokens_per_s
    free_prefill_s = steps * a.step_ms / 1e3
    engine_s = free_prefill_s + prompt_tokens / a.prefill_tokens_per_s
    return {"requests": n, "output_tokens": sum(out), "prompt_tokens": prompt_tokens, "engine_steps": steps,
            "perfectly_packed_steps": -(-sum(m - 1 for m in out) // a.concurrency), "static_steps": s_steps,
            "static_s": static_s, "engine_s_free_prefill": free_prefill_s, "engine_s": engine_s,
            "bound_vs_static_free_prefill": static_s / free_prefill_s, "bound_vs_static": static_s / engine_s}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, nargs="+", default=[128])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", default="256:2048")
    ap.add_argument("--output-len", default="64:512")
    ap.add_argument("--vocab-size", type=int, default=157184, help="Ling-3.0-tiny's (the draws depend on it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-ms", type=float, default=8.38, help="the engine's step, all 64 slots (H100)")
    ap.add_argument("--static-step-ms", type=float, default=10.06, help="decode_loop's step at batch 64 (H100)")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=78198.0,
                    help="the engine's best prefill: 8 prompts of 512 a call (H200)")
    ap.add_argument("--batch-prefill-tokens-per-s", type=float, default=171641.0, help="static's batch prefill (H200)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    runs = [bound(n, a) for n in a.num_requests]
    for r in runs:
        print(f"{r['requests']:>5} requests: engine {r['engine_steps']} steps (packed {r['perfectly_packed_steps']}),"
              f" static {r['static_steps']}; static {r['static_s']:.2f} s; engine >= {r['engine_s_free_prefill']:.2f}"
              f" s free prefill ({r['bound_vs_static_free_prefill']:.2f}x), {r['engine_s']:.2f} s"
              f" ({r['bound_vs_static']:.2f}x)")
    if a.out:
        command = "python3 bench/experiments/makespan.py " + " ".join(sys.argv[1:] if argv is None else argv)
        print(f"wrote {write_json(a.out, {**machine(), 'command': command, 'args': vars(a), 'runs': runs})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

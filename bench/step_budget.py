"""Where one decode step's device time goes, from a profiled `bench/decode.py` result.

    python3 bench/step_budget.py bench/results/decode_h200_b1_residual_shuffle_6b9ce3e_rejected_profile.json

`bench/decode.py --profile DIR --profile-sequence N` records the first N launches of a profiled call
in order (`device_profile`'s `sequence`). This script cuts one decode step out of it: from the first
gemv after the longest gap (where the host hands the loop over) up to the next launch of that same
kernel, the next step's first projection. So the step holds its layers, the lm_head (its longest XLA
launch) and the loop's sampling, bookkeeping and cache writes, wherever XLA schedules them. It sums
the launches by kind: the weight-streaming gemv kernel, each other Pallas kernel, the lm_head, and
every other XLA launch together.
It then sets the gemvs against their own floor (the step's weight bytes less the lm_head's, at the
run's copy bandwidth) and gives the two bounds that say how far each part alone keeps the step
from the HBM floor: the step with its gemvs at their floor and every other
launch as measured, and the step with only its weight reads (every other launch free).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ling_jax.config import LingConfig

GEMV = "expert_gemv"  # the Pallas kernel that streams the layers' weights (`ops.expert_gemv`)
PALLAS = re.compile(r"^(expert_gemv|kda_decode_layer|route_select|latent_attention|residual_add|row_logsumexp)")


def one_step(sequence: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The launches of one whole decode step, its lm_head last: from the first gemv at or after the
    sequence's longest gap up to the next launch of the same kernel (the module doc)."""
    if len(sequence) < 3:
        raise ValueError(f"a sequence of {len(sequence)} launches holds no step")
    gap = max(range(1, len(sequence)), key=lambda i: sequence[i]["gap_us"])
    start = next((i for i in range(gap, len(sequence)) if kind(sequence[i]["name"]) == GEMV), None)
    if start is None:
        raise ValueError(f"no {GEMV} launch follows the sequence's longest gap")
    end = next((i for i in range(start + 1, len(sequence)) if sequence[i]["name"] == sequence[start]["name"]), None)
    if end is None:
        raise ValueError(f"the sequence ends before the next step's first launch ({sequence[start]['name']}): "
                         "profile a longer one (bench/decode.py --profile-sequence)")
    step = sequence[start:end]
    xla = [e for e in step if kind(e["name"]) == "xla"]
    if not xla:
        raise ValueError("the step has no XLA launch (the lm_head)")
    lm_head = max(xla, key=lambda e: e["us"])
    return [e for e in step if e is not lm_head] + [lm_head]


def kind(name: str) -> str:
    """A launch's kind: the Pallas kernel's name without XLA's `__N` suffix, or "xla"."""
    m = PALLAS.match(name)
    return m.group(1) if m else "xla"


def budget(run: dict[str, Any], preset: str, bandwidth_gbps: float) -> dict[str, Any]:
    """One profiled run of `bench/decode.py` -> its step's time by kind and the two bounds (module doc)."""
    step = one_step(run["profile"]["sequence"])
    lm_head = step[-1]
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in step[:-1]:
        by_kind[kind(e["name"])][0] += 1
        by_kind[kind(e["name"])][1] += e["us"]
    cfg = LingConfig.preset(preset)
    bytes_per_us = bandwidth_gbps * 1e3
    floor_us = run["hbm_floor_ms"] * 1e3
    gemv_floor_us = (run["bytes_per_step"]["weights"] - 2 * cfg.vocab_size * cfg.hidden_size) / bytes_per_us
    gemv_us = by_kind[GEMV][1]
    other_us = sum(us for k, (_, us) in by_kind.items() if k != GEMV)
    launches_us = gemv_us + other_us + lm_head["us"]
    return {
        "batch": run["batch"], "context": run["context"], "variant": run.get("variant"),
        "launches": len(step), "launch_time_us": launches_us,
        "busy_us_per_step": run["profile"]["ms_per_step_busy"] * 1e3,
        "by_kind": {k: {"launches": n, "us": us} for k, (n, us) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
        "lm_head_us": lm_head["us"], "gemv_floor_us": gemv_floor_us, "gemv_x_floor": gemv_us / gemv_floor_us,
        "hbm_floor_us": floor_us, "launches_x_floor": launches_us / floor_us,
        "gemvs_at_floor_x": (launches_us - gemv_us + gemv_floor_us) / floor_us,
        "only_weight_reads_x": (gemv_us + lm_head["us"]) / floor_us,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="a bench/decode.py JSON with --profile-sequence")
    args = ap.parse_args()
    data = json.loads(args.result.read_text())
    runs = [r for r in data["runs"] if r.get("profile", {}).get("sequence")]
    if not runs:
        raise SystemExit(f"{args.result}: no run has a profiled sequence (bench/decode.py --profile-sequence)")
    for run in runs:
        b = budget(run, data["preset"], data["copy_bandwidth_GBps"])
        print(f"batch {b['batch']} / {b['context']} ({b['variant'] or 'committed'}): {b['launches']} launches, "
              f"{b['launch_time_us']:.1f} us of launch time, busy {b['busy_us_per_step']:.1f} us per step")
        for k, v in b["by_kind"].items():
            print(f"  {k:18s} {v['launches']:4d} launches {v['us']:8.1f} us")
        print(f"  {'lm_head':18s} {1:4d} launch   {b['lm_head_us']:8.1f} us")
        print(f"  gemvs {b['gemv_x_floor']:.2f}x their floor ({b['gemv_floor_us']:.1f} us); the launches "
              f"{b['launches_x_floor']:.2f}x the HBM floor ({b['hbm_floor_us']:.1f} us); with the gemvs at their "
              f"floor {b['gemvs_at_floor_x']:.2f}x; with only the weight reads {b['only_weight_reads_x']:.2f}x")


if __name__ == "__main__":
    main()

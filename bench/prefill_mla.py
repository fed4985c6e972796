"""Prefill attention of one MLA layer: expanded per-head K/V (XLA softmax or the fused kernels) against
the absorbed (latent) form.

    python3 bench/prefill_mla.py --out bench/results/prefill_mla_h200.json   # the GPU run
    python3 bench/prefill_mla.py --smoke --out /tmp/pm.json                  # CPU, debug preset, seconds

`layers.mla.mla_mixer` of the preset's first MLA layer (random bf16 weights, one group of layers
generated on the device) over B x T prompt tokens with a causal mask: `expanded` (kv_b_proj expands
the latent into 16 heads of 192-wide keys and 128-wide values; `attention_impl="xla"`: the
materialised softmax), `fused` (the same through the fused kernels of `ops.attention_pallas`, what
`prefill` runs on a GPU; GPU only) and `absorbed` (the decode step's form: queries folded into the
512 + 64 latent, W_UV after the weighted sum). Median of warmed-up calls; the attention-core FLOPs of
each form (scores and weighted sum over all T x T pairs, as the XLA path computes them) and the
outputs' relative L2 difference to `expanded`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, median_time, random_params, write_json
from ling_jax.config import LingConfig
from ling_jax.kernels import select
from ling_jax.layers.mla import mla_mixer
from ling_jax.layers.rope import rope_cos_sin
from ling_jax.ops.attention import attention_mask
from ling_jax.ops.attention_pallas import documents
from ling_jax.params import layer_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="ling-3.0-tiny")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="debug preset, tiny sizes (CPU check of the script)")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.lengths, args.reps = "debug", [64, 100], 2
    full = LingConfig.preset(args.preset)
    cfg = LingConfig.preset(args.preset, num_hidden_layers=full.layer_group_size,  # one group: one MLA layer
                            attention_impl="xla")
    forms = {"expanded": (cfg, False), "absorbed": (cfg, True)}
    if jax.default_backend() == "gpu":
        forms["fused"] = (dataclasses.replace(cfg, attention_impl="pallas"), False)
    mla = next(i for i in range(cfg.num_hidden_layers) if cfg.mixer_of(i) == "mla")
    p = layer_params(cfg, random_params(cfg, jnp.bfloat16), mla)["attn"]
    h, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dqk, dv = cfg.qk_head_dim, cfg.v_head_dim
    result = {**machine(), "preset": args.preset, "batch": args.batch, "dtype": "bfloat16", "runs": []}
    for t in args.lengths:
        x = (jax.random.normal(jax.random.key(t), (args.batch, t, cfg.hidden_size), jnp.float32)).astype(jnp.bfloat16)
        pos = jnp.broadcast_to(jnp.arange(t), (args.batch, t))
        cos, sin = rope_cos_sin(pos, dr, cfg.rope_theta)
        mask = attention_mask(pos, pos)
        docs = documents(None, None, args.batch, t)
        run = {"length": t}
        outs = {}
        for name, (c, absorbed) in forms.items():
            f = jax.jit(lambda x, cos, sin, mask, docs, c=c, a=absorbed: mla_mixer(
                p, x, cfg=c, kernels=select(c, dtype=x.dtype), cos=cos, sin=sin, mask_BTS=mask, absorbed=a,
                docs=docs)[0])
            inputs = (x, cos, sin, mask, docs)
            outs[name] = np.asarray(jax.block_until_ready(f(*inputs)), np.float64)
            run[f"{name}_ms"] = 1e3 * median_time(lambda f=f, a=inputs: f(*a), reps=args.reps, warmup=1)
            width = (r + dr + r) if absorbed else (dqk + dv)
            run[f"{name}_attention_GFLOP"] = 2 * args.batch * h * t * t * width / 1e9
            if name != "expanded":
                ref = outs["expanded"]
                run[f"rel_l2_{name}_vs_expanded"] = float(np.linalg.norm(outs[name] - ref) / np.linalg.norm(ref))
        result["runs"].append(run)
        print(f"T={t:6d}: " + "  ".join(f"{n} {run[n + '_ms']:8.3f} ms" for n in forms) + "  (rel L2 vs expanded: "
              + ", ".join(f"{n} {run['rel_l2_' + n + '_vs_expanded']:.1e}" for n in forms if n != "expanded") + ")",
              flush=True)
        write_json(args.out, result)
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()

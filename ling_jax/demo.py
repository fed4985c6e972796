"""`ling-demo`: the main job on an embedded default, for a fresh machine.

Builds a tiny random Ling-3 checkpoint on disk in the real Hugging Face layout (sharded
safetensors + index + config.json, the `debug` preset), loads it back through
`load_hf_checkpoint`, runs a jitted forward pass, then batch generation (jitted prefill +
decode loop over the latent/state caches), and prints what it did.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ling-demo", description=__doc__.split("\n\n")[1])
    ap.add_argument("--out", default="runs/demo", help="working directory (default: runs/demo)")
    ap.add_argument("--preset", default="debug", help="config preset of the random model (default: debug)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import ling_jax
    from ling_jax.checkpoint.export import save_hf_checkpoint
    from ling_jax.config import ConfigError
    from ling_jax.params import init_params

    try:
        cfg = ling_jax.LingConfig.preset(args.preset)
    except ConfigError as e:
        print(f"ling-demo: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    hf_dir = out / "hf"
    shutil.rmtree(hf_dir, ignore_errors=True)
    print(f"[1/4] random {args.preset} model: {cfg.num_hidden_layers} layers "
          f"({sum(m == 'kda' for m, _ in cfg.layer_kinds)} KDA, {sum(m == 'mla' for m, _ in cfg.layer_kinds)} MLA), "
          f"{cfg.num_experts} experts, {cfg.num_nextn_predict_layers} MTP layer(s) -> {hf_dir}")
    params = init_params(cfg, seed=args.seed, dtype=jnp.float32)
    save_hf_checkpoint(cfg, params, hf_dir, dtype="bfloat16", max_shard_bytes=256 << 10)
    files = sorted(p.name for p in hf_dir.iterdir())
    print(f"      wrote {len(files)} files: {', '.join(files[:3])}, ...")

    t0 = time.perf_counter()
    cfg, params = ling_jax.load_hf_checkpoint(hf_dir, dtype="bfloat16")
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"[2/4] loaded {n:,} params through load_hf_checkpoint in {time.perf_counter() - t0:.2f} s")

    ids = jax.random.randint(jax.random.key(args.seed), (2, 32), 0, cfg.vocab_size)
    t0 = time.perf_counter()
    logits = jax.block_until_ready(ling_jax.forward(cfg, params, ids))
    t1 = time.perf_counter()
    jax.block_until_ready(ling_jax.forward(cfg, params, ids))
    t2 = time.perf_counter()
    top = np.asarray(jnp.argmax(logits[:, -1], -1))
    print(f"[3/4] forward {tuple(ids.shape)} -> logits {tuple(logits.shape)} {logits.dtype} on "
          f"{jax.devices()[0].platform}: compile+run {t1 - t0:.2f} s, run {1e3 * (t2 - t1):.1f} ms; "
          f"next-token argmax per row {top.tolist()}")
    if not np.isfinite(np.asarray(logits)).all():
        print("ling-demo: non-finite logits", file=sys.stderr)
        return 1

    prompts = [ids[0, :20].tolist(), ids[1, :7].tolist(), ids[1, 7:19].tolist()]
    kw = dict(max_new_tokens=16, stop_tokens=())
    t0 = time.perf_counter()
    outs = ling_jax.generate(cfg, params, prompts, **kw)
    t1 = time.perf_counter()
    outs = ling_jax.generate(cfg, params, prompts, **kw)
    t2 = time.perf_counter()
    print(f"[4/4] generate: {len(prompts)} prompts of {[len(p) for p in prompts]} tokens, greedy, "
          f"{sum(map(len, outs))} new tokens in {1e3 * (t2 - t1):.0f} ms warm ({t1 - t0:.2f} s with compilation)")
    for i, o in enumerate(outs):
        print(f"      [{i}] {o}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

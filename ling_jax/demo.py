"""`ling-demo`: the main job, end to end, on an embedded default (no download needed).

1. builds a tiny random Ling-3 checkpoint (the `debug` preset) on disk in the real Hugging Face
   block-FP8 layout (sharded safetensors with `weight_scale_inv`, index, config.json);
2. loads it through `load_hf_checkpoint` (FP8 dequantized) and runs a jitted forward pass;
3. converts it with `ling-convert` (HF FP8 -> our Orbax checkpoint, bfloat16);
4. loads the Orbax checkpoint with `load_checkpoint` and generates for a batch of prompts
   (jitted prefill + decode loop over the latent/state caches);
5. runs a few `ling-train` steps from that checkpoint on a small synthetic corpus;
6. loads the text model that ships in `ling_jax/assets/text-model/` (a Ling-3-shaped model trained on
   the CPython standard library's sources by `python -m train.text_model all`, block-FP8) and
   continues a few lines of Python with it, greedy, without and with MTP speculation (the same
   tokens; the mean accepted length per verify step);
printing what each step did. Exits 2 on a usage error, 1 when a step fails (`ling_jax.cli`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ling_jax.cli import EXIT_FAILURE, EXIT_USAGE, device_failed, exit_code, fail

PROG = "ling-demo"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/demo",
                    help="working directory (default: runs/demo); the demo's own outputs in it are replaced, "
                         "anything else is left alone")
    ap.add_argument("--preset", default="debug", help="config preset of the random model (default: debug)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-steps", type=int, default=4)
    args = ap.parse_args(argv)
    if args.train_steps < 1:
        ap.error(f"--train-steps {args.train_steps}: must be at least 1")

    import jax

    import ling_jax
    from ling_jax.config import ConfigError

    try:
        cfg = ling_jax.LingConfig.preset(args.preset)
    except ConfigError as e:
        return fail(PROG, f"--preset: {e}", EXIT_USAGE)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return fail(PROG, f"--out {out}: not a directory", EXIT_USAGE)
    try:
        return _run(args, cfg, out)
    except (ValueError, OSError) as e:  # ConfigError, CheckpointError, DataError derive from ValueError
        return fail(PROG, str(e), exit_code(e))
    except jax.errors.JaxRuntimeError as e:
        return device_failed(PROG, e)


def _run(args: argparse.Namespace, cfg: Any, out: Path) -> int:
    """The six steps of the module doc into `out`; the exit status."""
    import jax
    import numpy as np

    import ling_jax
    from ling_jax.checkpoint.convert import convert_hf_to_orbax
    from ling_jax.checkpoint.export import save_hf_checkpoint
    from ling_jax.checkpoint.synthetic import LING_FP8_EXCLUSIONS
    from ling_jax.config import QuantConfig
    from ling_jax.params import init_params

    hf_dir, orbax_dir = out / "hf-fp8", out / "orbax"
    for own in (hf_dir, orbax_dir, out / "train"):  # a previous demo's outputs; nothing else in --out
        shutil.rmtree(own, ignore_errors=True)
    n_mla = sum(m == "mla" for m, _ in cfg.layer_kinds)
    print(f"[1/6] random {args.preset} model: {cfg.num_hidden_layers} layers ({cfg.num_hidden_layers - n_mla} KDA, "
          f"{n_mla} MLA), {cfg.num_experts} experts, {cfg.num_nextn_predict_layers} MTP layer(s) -> {hf_dir}")
    quant = QuantConfig(block_size=(32, 32), exclusions=LING_FP8_EXCLUSIONS)
    save_hf_checkpoint(cfg, init_params(cfg, seed=args.seed), hf_dir, quantization=quant, max_shard_bytes=256 << 10)
    files = sorted(p.name for p in hf_dir.iterdir())
    print(f"      block-FP8 (32x32 scales), {len(files)} files: {', '.join(files[:2])}, ..., {files[-1]}")

    t0 = time.perf_counter()
    cfg, params = ling_jax.load_hf_checkpoint(hf_dir, dtype="bfloat16")
    ids = jax.random.randint(jax.random.key(args.seed), (2, 32), 0, cfg.vocab_size)
    logits = jax.block_until_ready(ling_jax.forward(cfg, params, ids))
    print(f"[2/6] load_hf_checkpoint ({sum(x.size for x in jax.tree.leaves(params)):,} params, FP8 dequantized) "
          f"+ forward {tuple(ids.shape)} -> {tuple(logits.shape)} {logits.dtype} on {jax.devices()[0].platform} "
          f"in {time.perf_counter() - t0:.1f} s (compilation included)")
    if not np.isfinite(np.asarray(logits)).all():
        return fail(PROG, "non-finite logits", EXIT_FAILURE)

    t0 = time.perf_counter()
    convert_hf_to_orbax(hf_dir, orbax_dir, dtype="bfloat16")
    print(f"[3/6] ling-convert {hf_dir} -> {orbax_dir} (bfloat16) in {time.perf_counter() - t0:.1f} s")

    cfg, params = ling_jax.load_checkpoint(orbax_dir)
    prompts = [ids[0, :20].tolist(), ids[1, :7].tolist(), ids[1, 7:19].tolist()]
    kw = dict(max_new_tokens=16, stop_tokens=())
    t0 = time.perf_counter()
    outs = ling_jax.generate(cfg, params, prompts, **kw)
    t1 = time.perf_counter()
    outs = ling_jax.generate(cfg, params, prompts, **kw)
    t2 = time.perf_counter()
    print(f"[4/6] load_checkpoint + generate: {len(prompts)} prompts of {[len(p) for p in prompts]} tokens, greedy, "
          f"{sum(map(len, outs))} new tokens in {1e3 * (t2 - t1):.0f} ms warm ({t1 - t0:.1f} s with compilation)")
    for i, o in enumerate(outs):
        print(f"      [{i}] {o}")

    from train.main import main as train_main

    rng = np.random.default_rng(args.seed)  # documents counting up mod 64, each ended by eos
    eos = cfg.eos_token_id[0]
    docs = [[2 + (int(s) + i) % 64 for i in range(int(n))] + [eos]
            for s, n in zip(rng.integers(0, 64, 200), rng.integers(6, 30, 200), strict=True)]
    corpus = out / "corpus.bin"
    np.asarray([t for d in docs for t in d], np.uint32).tofile(corpus)
    print(f"[5/6] ling-train --init orbax:{orbax_dir} on {corpus} ({corpus.stat().st_size // 4:,} tokens), "
          f"{args.train_steps} steps")
    rc = train_main(["--init", f"orbax:{orbax_dir}", "--data", str(corpus), "--out", str(out / "train"),
                     "--steps", str(args.train_steps), "--batch-size", "4", "--seq-len", "64", "--lr", "3e-3"])
    return rc or _text_model()


TEXT_PROMPTS = ("def fibonacci(n):\n", "import os\n\n\ndef read_lines(path):\n", "class Stack:\n")


def _text_model() -> int:
    """Step 6 of the module doc; the exit status."""
    import jax
    from tokenizers import Tokenizer

    import ling_jax

    model = Path(__file__).resolve().parent / "assets" / "text-model"
    t0 = time.perf_counter()
    cfg, params = ling_jax.load_hf_checkpoint(model, dtype="float32")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"[6/6] the shipped text model ({model}): {n:,} params, {cfg.num_hidden_layers} layers, vocabulary "
          f"{cfg.vocab_size}, loaded in {time.perf_counter() - t0:.1f} s; greedy continuations, float32:")
    prompts = [tok.encode(p, add_special_tokens=False).ids for p in TEXT_PROMPTS]
    plain = ling_jax.generate(cfg, params, prompts, max_new_tokens=40)
    stats: dict[str, Any] = {}
    spec = ling_jax.generate(cfg, params, prompts, max_new_tokens=40, speculative_tokens=2, stats=stats)
    for p, o in zip(TEXT_PROMPTS, plain, strict=True):
        print("      " + (p + tok.decode(o)).replace("\n", "\n      "))
    same = sum(a == b for a, b in zip(plain, spec, strict=True))
    print(f"      with speculative_tokens=2 (the MTP layer drafts 2, one call verifies 3): {same}/{len(prompts)} "
          f"continuations identical, {stats['mean_accepted_length']:.2f} tokens per verify step")
    if same != len(prompts):
        return fail(PROG, "speculative decoding changed a greedy continuation", EXIT_FAILURE)
    return 0


if __name__ == "__main__":
    sys.exit(main())

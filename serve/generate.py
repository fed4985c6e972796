"""`ling-generate`: batch generation from the command line.

Prompts are text (encoded with a Hugging Face `tokenizer.json` through the `tokenizers` library)
or comma-separated token ids. The model comes from an HF checkpoint directory (BF16 or
block-FP8 safetensors) or an Orbax checkpoint written by `ling-convert` / `ling-train`.
Prints every output and the tokens/s of the whole call (prefill + decode; including compilation
unless `--timed-rerun`), and with `--speculative-tokens K` the mean accepted length (tokens per row
per verify step, 1 to K + 1). Exits 2 on a usage error (a bad flag value, a missing path), 1 when loading
or generating fails (`ling_jax.cli`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from ling_jax.cli import EXIT_USAGE, UsageError, device_failed, existing_dir, exit_code, fail

PROG = "ling-generate"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="HF directory (config.json + safetensors) or Orbax checkpoint")
    ap.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable; needs --tokenizer)")
    ap.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated token ids")
    ap.add_argument("--tokenizer", help="tokenizer.json for text prompts and decoding outputs")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-tokens", default=None, help="comma-separated ids; default: the config's eos; '' = none")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="params/activation dtype")
    ap.add_argument("--mesh", default="", help="device mesh as axis=size pairs, e.g. 'expert=8' or "
                    "'data=2,expert=4' (axes data, fsdp, expert, tensor); default: one device")
    ap.add_argument("--scan-layers", action="store_true",
                    help="compile the decode step with layer scans: a faster compile, slower steps (default: unrolled)")
    ap.add_argument("--timed-rerun", action="store_true",
                    help="generate a second time and report that warm call's tokens/s (the first call compiles)")
    ap.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                    help="draft K tokens per step with the MTP layer, verified by the model in one step (0 = off); "
                         "prints the mean accepted length")
    ap.add_argument("--fp8-weights", action="store_true",
                    help="keep the layer weights of an FP8 checkpoint (ling-convert --dtype float8) in FP8 on the "
                         "device, dequantized one layer at a time")
    return ap


def _usage(msg: str) -> int:
    return fail(PROG, msg, EXIT_USAGE)


def parse_ids(text: str) -> list[int]:
    """'1, 2,3' -> [1, 2, 3]; ValueError naming the part that is not a token id."""
    ids = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        if not part.isdigit():
            raise ValueError(f"{part!r} is not a token id (a non-negative integer)")
        ids.append(int(part))
    return ids


def load_any(path: Path, dtype: str, fp8_weights: bool = False, mesh: Any = None):
    """(config, params) from an HF directory or an Orbax checkpoint directory, placed on `mesh` if given."""
    import jax

    import ling_jax
    from ling_jax.checkpoint.fp8 import is_block_fp8
    from ling_jax.checkpoint.hf import is_hf_dir

    if is_hf_dir(path):
        if fp8_weights:
            raise UsageError(f"--fp8-weights needs an Orbax checkpoint with FP8 weights; convert {path} first "
                             "(ling-convert --dtype float8)")
        return ling_jax.load_hf_checkpoint(path, dtype=dtype, mesh=mesh)
    cfg, params = ling_jax.load_checkpoint(path, dtype=dtype, keep_fp8=fp8_weights, mesh=mesh)
    if fp8_weights and not any(map(is_block_fp8, jax.tree.leaves(params, is_leaf=is_block_fp8))):
        raise UsageError(f"--fp8-weights: {path} has no FP8 weights (convert with ling-convert --dtype float8)")
    return cfg, params


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        path = existing_dir("--checkpoint", args.checkpoint)
    except UsageError as e:
        return _usage(str(e))
    if not args.prompt and not args.prompt_ids:
        return _usage("give at least one --prompt or --prompt-ids")
    tok = None
    if args.tokenizer or args.prompt:
        if not args.tokenizer:
            return _usage("text prompts need --tokenizer tokenizer.json")
        try:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(args.tokenizer)
        except Exception as e:  # the tokenizers library raises plain Exceptions
            return _usage(f"--tokenizer {args.tokenizer}: {e}")
    try:
        prompts = [tok.encode(t).ids for t in args.prompt] + [parse_ids(s) for s in args.prompt_ids]
    except ValueError as e:
        return _usage(f"--prompt-ids: {e}")
    try:
        stop = None if args.stop_tokens is None else parse_ids(args.stop_tokens)
    except ValueError as e:
        return _usage(f"--stop-tokens: {e}")

    import jax

    import ling_jax
    from ling_jax.sharding import parse_mesh

    try:
        sizes = parse_mesh(args.mesh)
        mesh = ling_jax.make_mesh(**sizes) if sizes else None
    except ValueError as e:
        return _usage(str(e))
    try:
        cfg, params = load_any(path, args.dtype, args.fp8_weights, mesh)
    except (ValueError, OSError) as e:  # CheckpointError, ConfigError: the checkpoint could not be read
        return fail(PROG, str(e), exit_code(e))
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, stop_tokens=stop, unroll_layers=not args.scan_layers,
              speculative_tokens=args.speculative_tokens)
    stats: dict[str, Any] = {}
    try:  # under the mesh the MoE layers dispatch experts across `expert`, caches follow the table
        with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
            t0 = time.perf_counter()
            outs = ling_jax.generate(cfg, params, prompts, stats=stats, **kw)  # includes compilation
            t1 = t2 = time.perf_counter()
            if args.timed_rerun:
                outs = ling_jax.generate(cfg, params, prompts, stats=stats, **kw)
                t2 = time.perf_counter()
    except ValueError as e:  # generate's checks of its arguments: the flags' values
        return _usage(str(e))
    except jax.errors.JaxRuntimeError as e:
        return device_failed(PROG, e)
    n_new = sum(len(o) for o in outs)
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        text = f" {tok.decode(o)!r}" if tok else ""
        print(f"[{i}] prompt {len(p)} tokens -> {len(o)} new: {o}{text}")
    if args.speculative_tokens and stats["mean_accepted_length"] is not None:
        print(f"speculative decoding, {args.speculative_tokens} drafts per step: mean accepted length "
              f"{stats['mean_accepted_length']:.2f} tokens per step ({stats['accepted_drafts']} of "
              f"{stats['row_steps'] * args.speculative_tokens} drafts accepted, {stats['steps']} verify steps)")
    where = f"{jax.devices()[0].platform}" + ("" if mesh is None else f" x {mesh.size} ({args.mesh})")
    if args.timed_rerun:
        print(f"{n_new} new tokens for {len(prompts)} prompt{'s' * (len(prompts) != 1)} on {where}: "
              f"{n_new / (t2 - t1):.1f} tokens/s ({t2 - t1:.3f} s warm; first call with compilation {t1 - t0:.2f} s)")
    else:
        print(f"{n_new} new tokens for {len(prompts)} prompt{'s' * (len(prompts) != 1)} on {where} in "
              f"{t1 - t0:.2f} s with compilation ({n_new / (t1 - t0):.1f} tokens/s; --timed-rerun times a warm call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The PyTorch reference's decode speed: Hugging Face transformers' `bailing_hybrid` model
(`BailingHybridForCausalLM`, transformers >= 5.25, its KDA steps in FLA's `fused_recurrent_kda`)
driven by its own `generate`, on the shapes of `bench/decode.py`.

Not part of ling_jax: a PyTorch script for the GPU machine, the peer of `bench/decode.py`. It needs
torch, transformers >= 5.25 and fla-core, carried to the device as wheels (`pip download --no-deps -d .whl
transformers==5.25.0 fla-core==0.6.0 huggingface_hub==2.4.0 kernels==0.19.1 httpx2 httpcore2 truststore
tomlkit regex hf-xet`, there `pip install --no-deps --target /tmp/ref .whl/*.whl` and `PYTHONPATH=/tmp/ref`;
for batch 128 at 32k, `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`). `--check-golden` first runs
the golden set A through the same model class (float32, on the device given) and records how close it
comes to the golden outputs, which the original `modeling_bailing_moe_v3.py` produced: that is what makes
this model "the reference".

Timing. A model of the preset's shape with random bf16 weights (the library's initialisation) and,
per (batch, context), a cache holding `context` tokens of random latents, states and conv windows
(as `bench/decode.py` fills ours; no prefill is timed or run, so FLA's chunked kernels and their
autotuning never start). `generate` (greedy, `min_new_tokens` = `max_new_tokens`, no stop token)
continues from a fresh copy of that cache for n1 and for n2 new tokens; the step time is
(median t(n2) - median t(n1)) / (n2 - n1), which cancels the first step's and the call's fixed
costs, each t a wall clock around the call with `torch.cuda.synchronize()`. A (batch, context) that
runs out of GPU memory is recorded as such.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent


def reference_config(preset: Path, **overrides):
    """The transformers config of a preset (our presets are HF config.json files).

    transformers' port sizes the shared expert as `moe_intermediate_size * num_shared_experts`; the
    checkpoints give its width as `moe_shared_expert_intermediate_size`, so the count is set to match
    (one wider MLP is the same function as the reference's shared expert)."""
    from transformers import AutoConfig

    raw = json.loads(preset.read_text())
    shared = raw.get("moe_shared_expert_intermediate_size")
    if shared:
        n, rem = divmod(shared, raw["moe_intermediate_size"])
        if rem:
            raise ValueError(f"shared expert width {shared} is not a multiple of {raw['moe_intermediate_size']}")
        overrides.setdefault("num_shared_experts", n)
    raw.pop("architectures", None)
    model_type = raw.pop("model_type")
    return AutoConfig.for_model(model_type, **{**raw, **overrides})


def fill_cache(model, batch: int, context: int, states: dict | None = None, seed: int = 0):
    """A `DynamicCache` holding `context` tokens: for every MLA layer its normed latents [B, 1, S, R]
    and rotated rope keys [B, 1, S, Dr] (the reference caches these, not expanded K/V); for every
    KDA layer the conv window [B, 3 H K, W] and the float32 state [B, H, K, V]. `states` (per layer
    index, the tensors of another cache) replaces the random values: the check that this cache is
    what the model's own prefill leaves."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    cfg = model.config
    dev, dt = model.device, model.dtype
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rand(*shape, dtype=dt, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32) * scale).to(dtype)

    cache = DynamicCache(config=cfg)
    for i, layer in enumerate(cache.layers[: cfg.num_hidden_layers]):
        given = (states or {}).get(i)
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            h, d, w = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
            conv = given[0] if given else rand(batch, 3 * h * d, w)
            state = given[1] if given else rand(batch, h, d, d, dtype=torch.float32, scale=0.05)
            layer.update_conv_state(conv, conv_kernel_size=w)  # counts W tokens; the length is set below
            layer.update_recurrent_state(state)
            layer.cumulative_length_linear.fill_(context)
        else:
            keys = given[0] if given else rand(batch, 1, context, cfg.kv_lora_rank)
            vals = given[1] if given else rand(batch, 1, context, cfg.qk_rope_head_dim)
            layer.update(keys, vals)
    return cache


def cache_states(cache, n_layers: int) -> dict:
    """Per layer index, the tensors `fill_cache(states=...)` takes, read from a filled cache."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    out = {}
    for i, layer in enumerate(cache.layers[:n_layers]):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            out[i] = (layer.conv_states[0].clone(), layer.recurrent_states[0].clone())
        else:
            out[i] = (layer.keys.clone(), layer.values.clone())
    return out


def fresh_copy(cache):
    """A copy of `cache` that a `generate` call may advance: the KDA windows and states are updated in
    place, so they are copied; the MLA latents are only ever concatenated into new tensors, so they
    are shared (at batch 128 and 32k context they are 29 GB)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    shared = [t for layer in cache.layers if not isinstance(layer, LinearAttentionCacheLayerMixin)
              for t in (layer.keys, layer.values) if t is not None]
    return copy.deepcopy(cache, memo={id(t): t for t in shared})


def generate(model, ids: torch.Tensor, cache, new: int) -> torch.Tensor:
    """The reference's greedy `generate` continuing from `cache` (which holds ids[:, :-1]): exactly
    `new` tokens."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, eos_token_id=None,
                          pad_token_id=model.config.pad_token_id)


def check_golden(golden: Path, device: str) -> dict:
    """The transformers model on the golden set A checkpoint in float32: relative L2 of its prefill and
    decode-step logits against the golden ones, whether its greedy tokens equal them, and whether a
    cache built by `fill_cache` from its own prefill's tensors generates the same tokens."""
    from transformers import AutoModelForCausalLM

    cfg = reference_config(golden / "config.json")
    model = AutoModelForCausalLM.from_pretrained(golden, config=cfg, dtype=torch.float32).to(device).eval()
    g = np.load(golden / "golden.npz")

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    res = {}
    with torch.no_grad():
        for k in ("prefill", "long"):
            logits = model(torch.tensor(g[k + "_input_ids"], dtype=torch.long, device=device)).logits
            res[f"{k}_logits_rel_l2"] = rel(logits.float().cpu().numpy(), g[k + "_logits"])
        prompt = torch.tensor(g["decode_prompt_ids"], dtype=torch.long, device=device)
        n = g["decode_generated_ids"].shape[1]
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=model.config.pad_token_id, output_logits=True,
                             return_dict_in_generate=True)
        res["generated_equal"] = bool((out.sequences[:, prompt.shape[1]:].cpu().numpy()
                                       == g["decode_generated_ids"]).all())
        res["step_logits_rel_l2"] = rel(torch.stack(out.logits, 1).float().cpu().numpy(), g["decode_step_logits"])
        # the cache of the timed runs: built from the prefill's own tensors it must continue the same way
        ctx = prompt[:, :-1]
        prefill = model(ctx, use_cache=True).cache
        built = fill_cache(model, prompt.shape[0], ctx.shape[1], cache_states(prefill, cfg.num_hidden_layers))
        again = generate(model, prompt, built, n)
        res["filled_cache_generates_equal"] = bool((again[:, prompt.shape[1]:].cpu().numpy()
                                                    == g["decode_generated_ids"]).all())
    return res


def step_kernels(model) -> list[str]:
    """The GPU kernels of a batch-1 decode step whose names mention KDA, a recurrence or a conv: which
    implementation the reference's KDA layers run (FLA's `fused_recurrent_kda` or the torch
    fallback, which transformers announces only once per process)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.zeros((1, 65), dtype=torch.long, device=model.device)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(model, ids, fill_cache(model, 1, 64), 2)
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if any(w in n.lower() for w in ("kda", "recurrent", "conv")))


def time_decode(model, batch: int, context: int, n1: int, n2: int, reps: int) -> dict:
    """ms per decode step of `generate` at (batch, context) (module doc)."""
    gen = torch.Generator(device="cpu").manual_seed(batch * 7919 + context)
    ids = torch.randint(0, model.config.vocab_size, (batch, context + 1), generator=gen).to(model.device)
    base = fill_cache(model, batch, context)
    times: dict[int, list[float]] = {n1: [], n2: []}
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        generate(model, ids, fresh_copy(base), n1)  # warm-up: kernels compiled, allocator grown
        for _ in range(reps):
            for n in (n1, n2):
                cache = fresh_copy(base)
                sync()
                t0 = time.perf_counter()
                generate(model, ids, cache, n)
                sync()
                times[n].append(time.perf_counter() - t0)
                del cache
    ms = (statistics.median(times[n2]) - statistics.median(times[n1])) / (n2 - n1) * 1e3
    return {"batch": batch, "context": context, "ms_per_step": ms, "tokens_per_s": batch / ms * 1e3,
            "n1": n1, "n2": n2, "reps": reps, "times_s": {str(k): v for k, v in times.items()}}


def _git() -> str:
    """The checkout's commit, or "?" where git or its metadata is missing (the device's copy)."""
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=str(ROOT / "configs" / "ling-3.0-tiny.json"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--steps", type=int, nargs=2, default=[4, 20], metavar=("N1", "N2"),
                    help="new tokens of the two timed generate calls")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check-golden", default=None, help="golden set A folder (ling3_tiny_a): check it first")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--golden-device", default=None,
                    help="where --check-golden runs (default --device; cpu spares FLA's chunked-kernel autotuning)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import fla
    import transformers
    from transformers import AutoModelForCausalLM

    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": " ".join(["bench/reference_decode.py", *sys.argv[1:]]),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "git": _git(),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "fla": getattr(fla, "__version__", "?"), "preset": Path(args.preset).stem, "runs": []}
    if args.check_golden:
        report["golden_check"] = check_golden(Path(args.check_golden), args.golden_device or args.device)
        print(json.dumps(report["golden_check"]), flush=True)
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(reference_config(Path(args.preset)), dtype=torch.bfloat16).eval()
    report["model_build_s"] = time.perf_counter() - t0
    report["params"] = sum(p.numel() for p in model.parameters())
    report["attn_implementation"] = model.config._attn_implementation
    if args.device == "cuda":
        report["kda_step_kernels"] = step_kernels(model)
        print("KDA step kernels:", report["kda_step_kernels"], flush=True)
    for b in args.batches:
        for c in args.contexts:
            try:
                run = time_decode(model, b, c, *args.steps, args.reps)
            except torch.OutOfMemoryError as e:
                run = {"batch": b, "context": c, "error": f"out of GPU memory: {str(e).splitlines()[0]}"}
            torch.cuda.empty_cache()
            print(json.dumps({k: v for k, v in run.items() if k != "times_s"}), flush=True)
            report["runs"].append(run)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

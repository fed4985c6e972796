"""KDA kernel benchmark on one GPU: our Pallas path vs FLA's `chunk_kda` vs our chunked XLA path.

Run on the GPU machine (FLA wheel carried in .whl/, BENCHMARKS.md "KDA kernels against FLA"):

    python3 bench/kda.py --out $OUT [--heads 16 64] [--seq 8192] [--variants]

One run does, in this order:
  1. starts a worker process that imports FLA (torch + Triton) and runs `chunk_kda` forward and
     forward+backward once per head count, which triggers FLA's autotuning (~5 minutes per head count
     on a fresh H200), while this process compiles the JAX side (CPU work: the two overlap); with
     TRITON_CACHE_DIR set, the worker archives Triton's autotuning results after each head count as
     $OUT/triton_autotune.tgz (restored into TRITON_CACHE_DIR on a machine with the same Triton and
     FLA, it spares the next run the autotune; `--fla-tune-only` does just this part);
  2. once the worker is tuned (the GPU is then ours), checks our GPU kernels against the reference
     recurrence (fp32: forward and all gradients; bf16: forward);
  3. measures the card's ceilings: a 4 GiB device-to-device copy (bytes read + written) and an
     8192^3 bf16 matmul;
  4. times ours (forward, forward + backward) and the chunked XLA path two ways: median of warmed-up
     calls, each followed by block_until_ready, and per call of back-to-back calls with one wait.
     Ours: "default" = the kernels at `kda_pallas`'s default chunk (64), "api" = the public call with
     its defaults, `kimi_delta_attention(impl="auto")` (on a GPU: the kernels at chunk 32), then
     each `--chunks` / `--variant` of the kernels;
     `--profile DIR` also records each launch's device time inside the calls;
  5. tells the worker to time FLA the same two ways and with triton.testing.do_bench, and to run FLA
     once on our inputs; compares its output and gradients with ours (relative L2);
  6. writes $OUT/kda_bench.json (ours also before step 5) and prints a table.

Byte and FLOP counts (per token and head, C = 64, bf16 inputs): bytes_min = 2 (3K + V) + 2 (q, k, g,
v, beta) + 2 V (o), plus the final state (4 K V per head); the forward+backward minimum adds reading
dO and writing dq, dk, dv, dg, dbeta (same sizes again), i.e. about 2x plus the re-read of the inputs
= 3 x bytes_min. FLOPs: forward 2C(3K + 2V) + 6KV + 2C^2 (the matmuls of the chunked algorithm,
ARCHITECTURE.md §2.4; 1.9e5 for K = V = 128), forward+backward = 3x forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

TMP = Path("/tmp/kda_bench")


# ------------------------------------------------------------------------------------------------
# timing, the same on both sides
# ------------------------------------------------------------------------------------------------


def wall_ms(call: Callable[[], Any], wait: Callable[[Any], Any], n: int = 20, warm: int = 3) -> float:
    """Median wall time (ms) of n calls of call(), each followed by wait(its output), after `warm` calls.
    Both sides use it: wait is block_until_ready (JAX) or torch.cuda.synchronize (FLA)."""
    for _ in range(warm):
        wait(call())
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        wait(call())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts) * 1e3)


def pipelined_ms(call: Callable[[], Any], wait: Callable[[Any], Any], n: int = 20, rounds: int = 5,
                 warm: int = 3) -> float:
    """Per-call wall time (ms) of n back-to-back calls and one wait on the last output (one stream: the
    last call done means all are), median of `rounds`: device time plus launch gaps, without a host
    round trip per call."""
    for _ in range(warm):
        wait(call())
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            out = call()
        wait(out)
        ts.append((time.perf_counter() - t0) / n)
    return float(np.median(ts) * 1e3)


# ------------------------------------------------------------------------------------------------
# FLA worker (torch process)
# ------------------------------------------------------------------------------------------------


def fla_worker(heads: list[int], seq: int, dk: int, out_dir: Path, tune_only: bool = False) -> None:
    """FLA's side, in its own process: autotune (first calls) for each head count, archiving Triton's
    autotuning results after each; then, when the JAX side says go, time FLA and compute its outputs
    on our inputs. `tune_only`: stop after the autotune (a device call of its own, whose archive the
    next call restores: FLA's first-call autotune takes minutes per head count, BENCHMARKS.md)."""
    import torch
    import triton
    from fla.ops.kda import chunk_kda

    log = open(TMP / "fla_worker.log", "a")  # noqa: SIM115

    def say(*a):
        print(*a, file=log, flush=True)

    def sync(_):
        torch.cuda.synchronize()

    def call(q, k, v, g, beta, a_log, dt_bias):
        return chunk_kda(q, k, v, g, beta, scale=dk ** -0.5, A_log=a_log, dt_bias=dt_bias,
                         use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, safe_gate=True,
                         lower_bound=-5.0, output_final_state=True)

    def make(h, gen):
        sh = (1, seq, h, dk)
        q = torch.randn(sh, device="cuda", generator=gen).bfloat16()
        k = torch.randn(sh, device="cuda", generator=gen).bfloat16()
        v = torch.randn(sh, device="cuda", generator=gen).bfloat16()
        g = (2 * torch.randn(sh, device="cuda", generator=gen)).bfloat16()
        beta = torch.sigmoid(torch.randn((1, seq, h), device="cuda", generator=gen)).bfloat16()
        a_log = 0.5 * torch.randn(h, device="cuda", generator=gen)
        dt_bias = torch.randn(h * dk, device="cuda", generator=gen)
        return [q, k, v, g, beta, a_log, dt_bias]

    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for h in heads:  # autotune: first calls of forward and backward for this shape
        xs = [x.requires_grad_(True) for x in make(h, gen)]
        o, _ = call(*xs)
        torch.autograd.grad(o, xs, torch.randn_like(o), allow_unused=True)
        torch.cuda.synchronize()
        say(f"tuned H={h} at {time.time() - t0:.1f}s")
        save_autotune(out_dir)  # per head count: a run killed during the next one keeps these
    (TMP / "fla_tuned").write_text(f"{time.time() - t0:.1f}")
    if tune_only:
        return
    while not (TMP / "fla_go").exists():
        time.sleep(0.2)
    res = {"autotune_s": round(time.time() - t0, 1), "torch": torch.__version__,
           "triton": triton.__version__}
    import fla

    res["fla"] = getattr(fla, "__version__", "?")
    for h in heads:
        xs = [x.requires_grad_(True) for x in make(h, gen)]
        do = torch.randn((1, seq, h, dk), device="cuda", generator=gen).bfloat16()

        def fwd(xs=xs):
            with torch.no_grad():
                return call(*xs)

        def fwdbwd(xs=xs, do=do):
            o, _ = call(*xs)
            return torch.autograd.grad(o, xs, do, allow_unused=True)

        # three rounds: FLA's H=16 medians vary widely between device calls; the spread in one call
        # shows whether that is noise within a run
        rounds = {name: [triton.testing.do_bench(f, warmup=100, rep=500, return_mode="median") for _ in range(3)]
                  for name, f in (("fwd", fwd), ("fwdbwd", fwdbwd))}
        res[f"H{h}"] = {f"{name}_ms": float(np.median(r)) for name, r in rounds.items()}
        res[f"H{h}"].update({f"{name}_ms_rounds": r for name, r in rounds.items()})
        for name, f, n in (("fwd", fwd, 20), ("fwdbwd", fwdbwd, 10)):  # the JAX side's two methods and counts
            res[f"H{h}"][f"{name}_sync_ms"] = wall_ms(f, sync, n=n)
            res[f"H{h}"][f"{name}_pipelined_ms"] = pipelined_ms(f, sync, n=n)
        say(f"timed H={h}: {res[f'H{h}']}")
        # our inputs, same values: output and gradients for the agreement check
        d = np.load(TMP / f"inputs_H{h}.npz")
        ins = []
        for name in ("q", "k", "v", "g", "beta", "a_log", "dt_bias"):
            a = torch.from_numpy(d[name]).cuda()
            if name not in ("a_log", "dt_bias"):
                a = a.bfloat16()
            ins.append(a.requires_grad_(True))
        do = torch.from_numpy(d["do"]).cuda().bfloat16()
        o, ht = call(*ins)
        grads = torch.autograd.grad(o, ins, do, allow_unused=True)
        out = {"o": o.detach().float().cpu().numpy(), "ht": ht.detach().float().cpu().numpy()}
        for name, gr in zip(("q", "k", "v", "g", "beta", "a_log", "dt_bias"), grads, strict=True):
            if gr is not None:
                out["d" + name] = gr.detach().float().cpu().numpy()
        np.savez(TMP / f"fla_out_H{h}.npz", **out)
        del ins, grads, o, ht, xs
        torch.cuda.empty_cache()
    (TMP / "fla_result.json").write_text(json.dumps(res))


# ------------------------------------------------------------------------------------------------
# JAX side
# ------------------------------------------------------------------------------------------------


def _k_fwd_pairs(kp, cfg, store, *a):
    return kp._fwd_pairs(cfg, *a, (), store)


def _k_fwd_wu(kp, cfg, *a):
    return kp._fwd_wu(cfg, *a[:7], (), a[7])


def _k_fwd_state(kp, cfg, h0t, store, *a):
    return kp._fwd_state(cfg, *a, h0t, a[1].dtype, store, store)


def _k_bwd_state(kp, cfg, *a):
    return kp._bwd_state(cfg, *a, None)


def _k_bwd_intra(kp, cfg, *a):
    return kp._bwd_intra(cfg, a[0], (), *a[1:])


def _k_bwd(launch, cfg, *a):
    """bwd_dqkg / bwd_pairs (`launch`): the inputs a[:6], no segments, then the two L2-norm inputs
    where `cfg.l2norm`, then the launch's own arguments."""
    n = 2 if cfg.l2norm else 0
    return launch(cfg, *a[:6], (), a[6:6 + n], *a[6 + n:])


def per_kernel(args) -> None:
    """Times each of the seven launches alone (bf16, default parameters; with --block-k / --warps /
    --stages also the chunk-parallel ones at those settings): where the time goes."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.common import git_revision
    from ling_jax.ops.kda import pallas as kp
    from ling_jax.ops.kda.gate import inv_l2_norm

    out: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "device": jax.devices()[0].device_kind,
                 "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "git": git_revision()}
    kd, t = args.dk, args.seq
    interp = jax.default_backend() == "cpu"
    for h in args.heads:
        cfg = kp.Cfg(backend="triton", interpret=interp, chunk=args.chunk, t_valid=t, n_chunks=t // args.chunk,
                     dk=kd, dv=kd, scale=kd ** -0.5, gate="lb", lower_bound=-5.0, l2norm=True, segments=False,
                     cd="bfloat16", hd="bfloat16", **kp.default_tiles("triton", args.chunk, kd, kd))
        ks = jax.random.split(jax.random.PRNGKey(h), 8)
        bf = jnp.bfloat16
        q, k, v, g, do = (jax.random.normal(ks[i], (1, t, h, kd)).astype(bf) for i in range(5))
        beta = jax.nn.sigmoid(jax.random.normal(ks[5], (1, t, h, 1))).astype(bf)
        al = 0.5 * jax.random.normal(ks[6], (h, 1, 1))
        dtb = jax.random.normal(ks[7], (h, 1, kd))
        h0t = jnp.zeros((1, h, kd, kd), jnp.float32)
        f_pairs = jax.jit(functools.partial(_k_fwd_pairs, kp, cfg, False))
        f_pairs_st = jax.jit(functools.partial(_k_fwd_pairs, kp, cfg, True))
        aqk, mmat, at = f_pairs_st(q, k, g, beta, al, dtb)
        f_wu = jax.jit(functools.partial(_k_fwd_wu, kp, cfg))
        w, u, qg, kg, gam = f_wu(q, k, v, g, beta, al, dtb, mmat)
        f_state = jax.jit(functools.partial(_k_fwd_state, kp, cfg, h0t, False))
        f_state_st = jax.jit(functools.partial(_k_fwd_state, kp, cfg, h0t, True))
        o, ht, hs, vn = f_state_st(w, u, qg, kg, aqk, gam)
        f_bstate = jax.jit(functools.partial(_k_bwd_state, kp, cfg))
        dh, dvn, dh0 = f_bstate(qg, w, kg, aqk, gam, do, ht)
        f_bintra = jax.jit(functools.partial(_k_bwd_intra, kp, cfg))
        x, y, dbp, dv = f_bintra(beta, v, do, vn, dvn, mmat, at)
        norms = (inv_l2_norm(q), inv_l2_norm(k))
        a_dqkg = (q, k, g, beta, al, dtb, *norms, do, vn, dvn, hs, dh, mmat)
        f_dqkg = jax.jit(functools.partial(_k_bwd, kp._bwd_dqkg, cfg))
        dqp, dkp, dgp, _ = f_dqkg(*a_dqkg)
        f_bpairs = jax.jit(functools.partial(_k_bwd, kp._bwd_pairs, cfg))
        a_pairs = (q, k, g, beta, al, dtb)
        a_wu = (q, k, v, g, beta, al, dtb, mmat)
        a_bintra = (beta, v, do, vn, dvn, mmat, at)
        a_bpairs = (q, k, g, beta, al, dtb, *norms, x, y, dqp, dkp, dgp)
        a_state = (w, u, qg, kg, aqk, gam)
        a_bstate = (qg, w, kg, aqk, gam, do, ht)
        cases = [("fwd_pairs", f_pairs, a_pairs), ("fwd_pairs_storing_at", f_pairs_st, a_pairs),
                 ("fwd_wu", f_wu, a_wu), ("fwd_state", f_state, a_state),
                 ("fwd_state_storing_h_vn", f_state_st, a_state), ("bwd_state", f_bstate, a_bstate),
                 ("bwd_intra", f_bintra, a_bintra), ("bwd_dqkg", f_dqkg, a_dqkg),
                 ("bwd_pairs", f_bpairs, a_bpairs)]
        for bk, warps, stages in itertools.product(args.block_k or [cfg.bk], args.warps, args.stages):
            # the chunk-parallel kernels at other key blocks / warps / pipeline stages
            if bk == cfg.bk and warps is None and stages is None:
                continue
            var = dataclasses.replace(cfg, bk=bk, bk_kv=bk if args.block_k else cfg.bk_kv, **({} if warps is None else {
                "warps_pairs": warps, "warps_wu": warps, "warps_dqkg": warps, "warps_bwd_pairs": warps}),
                **({} if stages is None else {"stages_chunk": stages}))
            tag = f"bk{bk}" + ("" if warps is None else f"_w{warps}") + ("" if stages is None else f"_s{stages}")
            cases += [(f"fwd_pairs_{tag}", jax.jit(functools.partial(_k_fwd_pairs, kp, var, False)), a_pairs),
                      (f"fwd_wu_{tag}", jax.jit(functools.partial(_k_fwd_wu, kp, var)), a_wu),
                      (f"bwd_dqkg_{tag}", jax.jit(functools.partial(_k_bwd, kp._bwd_dqkg, var)), a_dqkg),
                      (f"bwd_pairs_{tag}", jax.jit(functools.partial(_k_bwd, kp._bwd_pairs, var)), a_bpairs)]
            if warps is not None or stages is not None:  # bwd_intra has no key loop
                cases.append((f"bwd_intra_{tag}", jax.jit(functools.partial(_k_bwd_intra, kp, var)), a_bintra))
        for warps, stages in itertools.product(args.state_warps, args.state_stages):
            if warps is None and stages is None:
                continue
            var = dataclasses.replace(cfg, warps_state=warps or cfg.warps_state,
                                      stages_state=stages or cfg.stages_state)
            tag = ("" if warps is None else f"_w{warps}") + ("" if stages is None else f"_s{stages}")
            cases += [(f"fwd_state{tag}", jax.jit(functools.partial(_k_fwd_state, kp, var, h0t, False)), a_state),
                      (f"bwd_state{tag}", jax.jit(functools.partial(_k_bwd_state, kp, var)), a_bstate)]
        for bv in args.block_v:  # the sequential kernels at other value blocks (programs = B x H x V / bv)
            var = dataclasses.replace(cfg, bv=bv)
            cases += [(f"fwd_state_bv{bv}", jax.jit(functools.partial(_k_fwd_state, kp, var, h0t, False)), a_state),
                      (f"fwd_state_storing_h_vn_bv{bv}", jax.jit(functools.partial(_k_fwd_state, kp, var, h0t, True)),
                       a_state),
                      (f"bwd_state_bv{bv}", jax.jit(functools.partial(_k_bwd_state, kp, var)), a_bstate)]
        if args.unfused:  # the gate (then also the L2 norm) computed outside the kernels: what fusing costs
            gd = (-5.0 * jax.nn.sigmoid(g.astype(jnp.float32))).astype(bf)  # a log decay in the kernels' range
            for tag, kw in (("nogate", {"gate": None}), ("nogate_nonorm", {"gate": None, "l2norm": False})):
                var = dataclasses.replace(cfg, **kw)
                kept = slice(6 if var.l2norm else 8, None)  # after the six inputs: the norms only where used
                cases += [
                    (f"fwd_pairs_{tag}", jax.jit(functools.partial(_k_fwd_pairs, kp, var, False)),
                     (q, k, gd, *a_pairs[3:])),
                    (f"fwd_wu_{tag}", jax.jit(functools.partial(_k_fwd_wu, kp, var)), (q, k, v, gd, *a_wu[4:])),
                    (f"bwd_dqkg_{tag}", jax.jit(functools.partial(_k_bwd, kp._bwd_dqkg, var)),
                     (q, k, gd, *a_dqkg[3:6], *a_dqkg[kept])),
                    (f"bwd_pairs_{tag}", jax.jit(functools.partial(_k_bwd, kp._bwd_pairs, var)),
                     (q, k, gd, *a_bpairs[3:6], *a_bpairs[kept]))]
        res = {}
        for name, fn, a in cases:
            for _ in range(2):
                jax.block_until_ready(fn(*a))
            ts = []
            for _ in range(10):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*a))
                ts.append(time.perf_counter() - t0)
            res[name + "_ms"] = float(np.median(ts) * 1e3)
            print(f"H={h} {name}: {res[name + '_ms']:.3f} ms", flush=True)
            out[f"H{h}"] = res  # written after every case: a run cut off by its time limit keeps them
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "kda_per_kernel.json").write_text(json.dumps(out, indent=1))


def save_autotune(out_dir: Path) -> None:
    """Archive Triton's autotuning results (FLA's) from TRITON_CACHE_DIR as out_dir/triton_autotune.tgz (one
    file: the device tool hands back a limited number of files), for the next run to restore with
    `tar -xzf triton_autotune.tgz -C $TRITON_CACHE_DIR`. Called as soon as FLA has tuned each head count,
    so a run killed later still hands them back."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        return
    import tarfile

    cache = Path(os.environ["TRITON_CACHE_DIR"])
    tuned = sorted(cache.rglob("*.autotune.json"))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "triton_autotune.tgz.part"
    with tarfile.open(tmp, "w:gz") as tar:
        for f in tuned:
            tar.add(f, arcname=str(f.relative_to(cache)))
    tmp.replace(out_dir / "triton_autotune.tgz")
    print(f"saved {len(tuned)} autotuning results to {out_dir / 'triton_autotune.tgz'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-chunked", action="store_true")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--check-seq", type=int, default=1000, help="length of the GPU correctness checks")
    ap.add_argument("--copy-gib", type=float, default=4.0, help="size of the copy-bandwidth probe")
    ap.add_argument("--mm", type=int, default=8192, help="size of the matmul probe")
    ap.add_argument("--variants", action="store_true", help="also time kernel-parameter variants")
    ap.add_argument("--chunk", type=int, default=64, help="--per-kernel: the chunk size")
    ap.add_argument("--chunks", type=int, nargs="*", default=[], help="also time ours at these chunk sizes")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help='also time ours with these kda_pallas keywords, e.g. chunk32_bv64=\'{"chunk_size": 32, '
                         '"block_v": 64}\' (repeatable)')
    ap.add_argument("--checks-only", action="store_true", help="only the GPU checks against the reference")
    ap.add_argument("--fla-worker", action="store_true")
    ap.add_argument("--fla-tune-only", action="store_true",
                    help="only run FLA's first-call autotune for --heads, archived in $OUT/triton_autotune.tgz "
                         "(set TRITON_CACHE_DIR)")
    ap.add_argument("--profile", metavar="DIR", help="also trace ours (every variant, forward and forward+backward) "
                    "and record each launch's device time in the run (no dispatch in it)")
    ap.add_argument("--per-kernel", action="store_true", help="only time each Pallas launch separately")
    ap.add_argument("--block-k", type=int, nargs="*", default=[],
                    help="--per-kernel: also time the chunk-parallel kernels at these key blocks (default: Cfg's)")
    ap.add_argument("--warps", type=lambda s: None if s == "default" else int(s), nargs="*",
                    default=[None], help="--per-kernel: ... and these warp counts ('default': Cfg's)")
    ap.add_argument("--stages", type=lambda s: None if s == "default" else int(s), nargs="*",
                    default=[None], help="--per-kernel: ... and these pipeline stages ('default': Cfg's)")
    ap.add_argument("--block-v", type=int, nargs="*", default=[],
                    help="--per-kernel: also time the sequential kernels at these value blocks")
    ap.add_argument("--state-warps", type=lambda s: None if s == "default" else int(s), nargs="*",
                    default=[None], help="--per-kernel: also time the sequential kernels at these warps")
    ap.add_argument("--state-stages", type=lambda s: None if s == "default" else int(s), nargs="*",
                    default=[None], help="--per-kernel: ... and these pipeline stages")
    ap.add_argument("--unfused", action="store_true",
                    help="--per-kernel: also time the chunk-parallel kernels with the gate (and the L2 norm) outside")
    args = ap.parse_args()
    TMP.mkdir(parents=True, exist_ok=True)
    if args.fla_worker or args.fla_tune_only:
        fla_worker(args.heads, args.seq, args.dk, Path(args.out), tune_only=args.fla_tune_only)
        return
    if args.per_kernel:
        per_kernel(args)
        return
    for f in ("fla_tuned", "fla_go", "fla_result.json"):
        (TMP / f).unlink(missing_ok=True)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    worker = None
    if not args.no_fla and not args.checks_only:
        worker = subprocess.Popen([sys.executable, __file__, "--fla-worker", "--heads", *map(str, args.heads),
                                   "--seq", str(args.seq), "--dk", str(args.dk), "--out", args.out])
    t_start = time.time()

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ling_jax.ops.kda import kimi_delta_attention
    from ling_jax.ops.kda.gate import kda_gate, l2_normalize
    from ling_jax.ops.kda.pallas import kda_pallas
    from ling_jax.ops.kda.reference import kda_reference

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from bench.common import git_revision

    report: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git": git_revision(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "shapes": {"B": 1, "T": args.seq, "K": args.dk, "V": args.dk, "heads": args.heads, "dtype": "bfloat16"},
        "timing": "*_ms: median of 20 (fwd) / 10 (fwdbwd) warmed-up calls, each followed by block_until_ready "
                  "(JAX) or torch.cuda.synchronize (FLA's *_sync_ms); *_pipelined_ms: per call of 20 / 10 "
                  "back-to-back calls and one wait, median of 5 rounds (both); FLA's *_ms: "
                  "triton.testing.do_bench median (CUDA events, L2 flushed before each call)",
    }

    def rel(a, b) -> float:
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    def timeit(fn, *a, n=20, pipelined=False) -> float:
        return (pipelined_ms if pipelined else wall_ms)(lambda: fn(*a), jax.block_until_ready, n=n)

    def inputs(key, b, t, h, dk, dtype):
        ks = jax.random.split(key, 8)
        q = jax.random.normal(ks[0], (b, t, h, dk)).astype(dtype)
        k = jax.random.normal(ks[1], (b, t, h, dk)).astype(dtype)
        v = jax.random.normal(ks[2], (b, t, h, dk)).astype(dtype)
        g = (2.0 * jax.random.normal(ks[3], (b, t, h, dk))).astype(dtype)
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))).astype(dtype)
        a_log = 0.5 * jax.random.normal(ks[5], (h,))
        dt_bias = jax.random.normal(ks[6], (h * dk,))
        return q, k, v, g, beta, a_log, dt_bias

    def ours(q, k, v, g, beta, a_log, dt_bias, h0=None, impl="auto", **kw):
        """The public op (`kimi_delta_attention`) with Ling's fused gate and L2 norm."""
        return kimi_delta_attention(q, k, v, g, beta, initial_state=h0, impl=impl, use_qk_l2norm=True,
                                    a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0, **kw)

    def kernels(q, k, v, g, beta, a_log, dt_bias, h0=None, **kw):
        """Our kernels at exactly the chunk (and tiles) `kw` asks for: `kda_pallas` itself."""
        return kda_pallas(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=h0, use_qk_l2norm=True,
                          a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0, **kw)

    def ref(q, k, v, g, beta, a_log, dt_bias, h0=None):
        gg = kda_gate(g, a_log, dt_bias, -5.0)
        return kda_reference(l2_normalize(q), l2_normalize(k), v, gg, beta, scale=q.shape[-1] ** -0.5,
                             initial_state=h0)

    # ---- 2. correctness on the GPU -----------------------------------------------------------
    @functools.cache
    def check_data() -> dict:
        """The checks' inputs and the reference's outputs (computed once for every chunk size checked)."""
        with jax.default_matmul_precision("highest"):
            tc = args.check_seq
            d = {"x": inputs(jax.random.PRNGKey(1), 2, tc, 4, args.dk, jnp.float32),
                 "h0": 0.3 * jax.random.normal(jax.random.PRNGKey(2), (2, 4, args.dk, args.dk)),
                 "segs": jnp.asarray(np.repeat(np.cumsum(np.isin(np.arange(tc), [5, 64, 300, 301, 777]))[None],
                                               2, 0).astype(np.int32)),
                 "xb": inputs(jax.random.PRNGKey(4), 1, tc, 4, args.dk, jnp.bfloat16)}
            d["ro"], d["rht"] = jax.jit(lambda *a: kimi_delta_attention(
                *a[:5], initial_state=a[7], impl="reference", use_qk_l2norm=True, a_log=a[5], dt_bias=a[6],
                segment_ids=d["segs"]))(*d["x"], d["h0"])
            d["w"] = jax.random.normal(jax.random.PRNGKey(3), d["ro"].shape)
            d["gr"] = jax.jit(jax.grad(weighted_loss(ref, d["w"]), argnums=tuple(range(8))))(*d["x"], d["h0"])
            d["rb"], _ = jax.jit(ref)(*d["xb"])
        return d

    def weighted_loss(fn, w):
        return lambda *a: jnp.sum(fn(*a)[0] * w) + jnp.sum(fn(*a)[1])

    def gpu_checks(kw: dict, tag: str) -> dict:
        """Ours (with `kw`) against the reference: fp32 forward + every gradient, bf16 forward."""
        d = check_data()
        out = {}
        with jax.default_matmul_precision("highest"):
            o, ht = jax.jit(lambda *a: kernels(*a, segment_ids=d["segs"], **kw))(*d["x"], d["h0"])
            out[f"{tag}fp32_fwd_o"] = rel(o, d["ro"])
            out[f"{tag}fp32_fwd_state"] = rel(ht, d["rht"])
            gp = jax.jit(jax.grad(weighted_loss(lambda *a: kernels(*a, **kw), d["w"]), argnums=tuple(range(8))))(
                *d["x"], d["h0"])
            for name, a, b in zip(("q", "k", "v", "g", "beta", "a_log", "dt_bias", "h0"), gp, d["gr"], strict=True):
                out[f"{tag}fp32_grad_{name}"] = rel(a, b)
            ob, _ = jax.jit(lambda *a: kernels(*a, **kw))(*d["xb"])
            out[f"{tag}bf16_fwd_o_vs_fp32_reference"] = rel(ob, d["rb"])
        return out

    def checks_and_ceilings() -> None:
        """The GPU checks against the reference, then the copy and matmul ceilings (run once FLA has tuned:
        its autotuning benchmarks then have the GPU to themselves)."""
        checks = {}
        chunk_kws = [("", {})] + [(f"chunk{c}_", {"chunk_size": c}) for c in args.chunks]
        for tag, kw in chunk_kws:  # the default chunk, then each extra one
            try:
                if args.no_checks:
                    raise RuntimeError("skipped (--no-checks)")
                checks.update(gpu_checks(kw, tag))
            except Exception as e:  # keep going: the timings are still worth having
                checks[f"{tag}error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        report["checks_vs_reference"] = checks
        print("checks", json.dumps(checks, indent=1), flush=True)

        # ---- 3. ceilings -------------------------------------------------------------------------
        n_copy = int(args.copy_gib * (1 << 29))  # bf16 elements
        big = jnp.ones((n_copy,), jnp.bfloat16) * 1.5
        copy_ms = timeit(jax.jit(lambda a: a * jnp.bfloat16(2.0)), big, n=10)
        del big
        nm = args.mm
        a = jax.random.normal(jax.random.PRNGKey(0), (nm, nm), jnp.bfloat16)
        b2 = jax.random.normal(jax.random.PRNGKey(1), (nm, nm), jnp.bfloat16)
        mm_ms = timeit(jax.jit(lambda a, b: a @ b), a, b2, n=10)
        del a, b2
        report["ceilings"] = {
            "copy_GiB": args.copy_gib, "copy_ms": copy_ms,
            "copy_GBps_read_plus_write": 2 * 2 * n_copy / copy_ms / 1e6,
            "matmul_n": nm, "matmul_bf16_ms": mm_ms, "matmul_TFLOPs": 2 * nm ** 3 / mm_ms / 1e9,
        }
        print("ceilings", report["ceilings"], flush=True)

    if args.checks_only:
        checks_and_ceilings()
        (out_dir / "kda_bench.json").write_text(json.dumps(report, indent=1))
        return

    # ---- 4. compile + time ours --------------------------------------------------------------
    have_chunked = Path(__file__).resolve().parents[1].joinpath("ling_jax/ops/kda/chunked.py").exists()
    results = {}
    kd = args.dk
    flop_fwd_tok = 2 * 64 * (3 * kd + 2 * kd) + 6 * kd * kd + 2 * 64 * 64
    # "default": the kernels at kda_pallas's default chunk (64); "api": the public call with its defaults,
    # kimi_delta_attention(impl="auto"), which on a GPU runs the kernels at api.GPU_KERNEL_CHUNK
    variant_list: list[tuple[str, dict | None]] = [("default", {}), ("api", None)]
    if args.variants:
        variant_list += [("bv32", {"block_v": 32}), ("bv128", {"block_v": 128}),
                         ("warps_8", {"num_warps": {"pairs": 8, "wu": 8, "dqkg": 8, "bwd_pairs": 8}}),
                         ("bvb128", {"block_v_bwd": 128}), ("bk64", {"block_k": 64}),
                         ("bk128", {"block_k": 128})]
    variant_list += [(f"chunk{c}", {"chunk_size": c}) for c in args.chunks]
    variant_list += [(v.split("=", 1)[0], json.loads(v.split("=", 1)[1])) for v in args.variant]
    inputs_by_h = {}
    for h in args.heads:
        x = inputs(jax.random.PRNGKey(10 + h), 1, args.seq, h, kd, jnp.bfloat16)
        do = jax.random.normal(jax.random.PRNGKey(20 + h), (1, args.seq, h, kd), jnp.bfloat16)
        inputs_by_h[h] = (x, do)
        names = ("q", "k", "v", "g", "beta", "a_log", "dt_bias")
        host = {n: np.asarray(a.astype(jnp.float32)) for n, a in zip(names, x, strict=True)}
        host["do"] = np.asarray(do.astype(jnp.float32))
        np.savez(TMP / f"inputs_H{h}.npz", **host)

    fns = {}
    for h in args.heads:
        x, do = inputs_by_h[h]
        for vname, kw in variant_list:
            def fwd(*a, kw=kw):
                return ours(*a[:7]) if kw is None else kernels(*a[:7], **kw)

            def fwdbwd(*a, fwd=fwd):
                o, vjp = jax.vjp(lambda *b: fwd(*b)[0], *a[:7])
                return vjp(a[7])

            fns[(h, vname)] = (jax.jit(fwd), jax.jit(fwdbwd))
            t0 = time.time()
            try:
                jax.block_until_ready(fns[(h, vname)][0](*x))
                jax.block_until_ready(fns[(h, vname)][1](*x, do))
                print(f"compiled H={h} {vname} in {time.time() - t0:.1f}s", flush=True)
            except Exception as e:
                results[f"H{h}_{vname}"] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
                print("FAILED", h, vname, str(e)[:3000], flush=True)
                fns.pop((h, vname))
        if have_chunked and not args.no_chunked:
            def cfwd(*a):
                return ours(*a, impl="chunked")

            def cfwdbwd(*a):
                o, vjp = jax.vjp(lambda *b: cfwd(*b)[0], *a[:7])
                return vjp(a[7])

            fns[(h, "chunked")] = (jax.jit(cfwd), jax.jit(cfwdbwd))
            try:
                jax.block_until_ready(fns[(h, "chunked")][0](*x))
                jax.block_until_ready(fns[(h, "chunked")][1](*x, do))
            except Exception as e:
                results[f"H{h}_chunked"] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
                fns.pop((h, "chunked"))
    report["jax_ready_s"] = round(time.time() - t_start, 1)

    if worker is not None:
        while not (TMP / "fla_tuned").exists() and worker.poll() is None:
            time.sleep(0.5)
        report["fla_autotune_s"] = (TMP / "fla_tuned").read_text() if (TMP / "fla_tuned").exists() else None
    checks_and_ceilings()
    for (h, vname), (f1, f2) in fns.items():
        x, do = inputs_by_h[h]
        tok = args.seq * h
        bytes_min = tok * (2 * 4 * kd + 2 + 2 * kd) + h * kd * kd * 4
        r = {"fwd_ms": timeit(f1, *x), "fwdbwd_ms": timeit(f2, *x, do, n=10),
             "fwd_pipelined_ms": timeit(f1, *x, pipelined=True),
             "fwdbwd_pipelined_ms": timeit(f2, *x, do, n=10, pipelined=True)}
        r["fwd_GBps_min_bytes"] = bytes_min / r["fwd_ms"] / 1e6
        r["fwdbwd_GBps_min_bytes"] = 3 * bytes_min / r["fwdbwd_ms"] / 1e6
        r["fwd_TFLOPs"] = tok * flop_fwd_tok / r["fwd_ms"] / 1e9
        r["fwdbwd_TFLOPs"] = 3 * tok * flop_fwd_tok / r["fwdbwd_ms"] / 1e9
        results[f"H{h}_{vname}"] = r
        print(f"H={h} {vname}: {r}", flush=True)

    if args.profile:  # where the time goes inside one call: each launch's device time, in place
        from bench.device_profile import device_profile

        for (h, vname), (f1, f2) in fns.items():
            if vname == "chunked":
                continue
            x, do = inputs_by_h[h]
            for tag, fn in (("fwd", lambda f1=f1, x=x: f1(*x)), ("fwdbwd", lambda f2=f2, x=x, do=do: f2(*x, do))):
                prof = device_profile(fn, f"{args.profile}/H{h}_{vname}_{tag}", calls=5, top=12)
                results[f"H{h}_{vname}"][f"{tag}_profile"] = {
                    "device_busy_ms": prof["device_busy_s_per_call"] * 1e3,
                    "kernels": {r["name"][:60]: round(r["total_ms_per_call"], 4) for r in prof["top_kernels"]}}
                print(f"H={h} {vname} {tag} profile:", results[f"H{h}_{vname}"][f"{tag}_profile"], flush=True)
    report["results"] = results  # written now too: a run killed during FLA's part keeps ours
    (out_dir / "kda_bench.json").write_text(json.dumps(report, indent=1))

    # ---- 5. FLA ------------------------------------------------------------------------------
    if worker is not None:
        (TMP / "fla_go").write_text("go")
        worker.wait(timeout=900)
        if (TMP / "fla_result.json").exists():
            fr = json.loads((TMP / "fla_result.json").read_text())
            report["fla"] = fr
            for h in args.heads:
                x, do = inputs_by_h[h]
                fo = np.load(TMP / f"fla_out_H{h}.npz") if (TMP / f"fla_out_H{h}.npz").exists() else None
                for vname in [v for hh, v in fns if hh == h and v != "chunked"]:  # every variant of ours vs FLA
                    agree = {}
                    if fo is not None:
                        o, ht = fns[(h, vname)][0](*x)
                        agree["o"] = rel(o, fo["o"])
                        agree["final_state"] = rel(ht, fo["ht"])
                        grads = fns[(h, vname)][1](*x, do)
                        for name, gr in zip(("q", "k", "v", "g", "beta", "a_log", "dt_bias"), grads, strict=True):
                            if "d" + name in fo:
                                agree["d" + name] = rel(gr, fo["d" + name])
                    report[f"agreement_vs_fla_H{h}" + ("" if vname == "default" else f"_{vname}")] = agree
                    ours_r = results.get(f"H{h}_{vname}", {})
                    if "fwd_ms" in ours_r and f"H{h}" in fr:
                        theirs = fr[f"H{h}"]
                        for m in ("fwd", "fwdbwd"):  # ours against do_bench, then each method against itself
                            ours_r[f"{m}_ratio_to_fla"] = ours_r[f"{m}_ms"] / theirs[f"{m}_ms"]
                            if f"{m}_sync_ms" in theirs:
                                ours_r[f"{m}_ratio_to_fla_sync"] = ours_r[f"{m}_ms"] / theirs[f"{m}_sync_ms"]
                                ours_r[f"{m}_ratio_to_fla_pipelined"] = (ours_r[f"{m}_pipelined_ms"]
                                                                         / theirs[f"{m}_pipelined_ms"])
        else:
            report["fla"] = {"error": "worker produced no result; see fla_worker.log"}
    report["results"] = results
    (out_dir / "kda_bench.json").write_text(json.dumps(report, indent=1))
    if (TMP / "fla_worker.log").exists():
        (out_dir / "fla_worker.log").write_text((TMP / "fla_worker.log").read_text())
    print("\n=== summary (ms) ===")
    for key, r in results.items():
        print(key, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    if "fla" in report:
        print("fla", report["fla"])
    for key in [k for k in report if k.startswith("agreement_vs_fla_")]:
        print(key, report[key])



if __name__ == "__main__":
    main()

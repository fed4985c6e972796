"""`ling-train`: continued pretraining, from an HF or Orbax checkpoint or a random preset.

    ling-train --init random:PRESET|random:CONFIG.json|hf:DIR|orbax:DIR --data PATH --out DIR --steps N \\
               --batch-size B --seq-len T [--lr LR] [--warmup-steps W] [--config FILE] [--tokenizer FILE] \\
               [--mesh AXIS=N,...]

`--steps N` is the total: if `--out` already holds a checkpoint the run resumes from it and
continues up to N (a run of 20 steps then the same command with `--steps 40` equals one run of
40). A checkpoint is written when a run ends after any step: at `--steps`, on an error, on Ctrl-C
or on SIGTERM (a scheduler's preemption). In a single-process run both stop the loop after the step
in flight (exit 130 / 143); a second Ctrl-C stops at once. Every step appends one JSON line
to `<out>/metrics.jsonl` (step, loss, grad_norm, lr, tokens_per_s, mfu, MoE load, ...; a resumed
run first drops the lines after its checkpoint) and prints a progress line; metrics are read one
step late so the device never waits for the host, and a step's time excludes checkpoint writes.

Exits 2 on a usage error (flags, `--config`, the paths given: checked before anything is written),
1 when the run fails (`ling_jax.cli`). A run that ends without a checkpoint removes the `--out`
directory it created (never one that existed before it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ling_jax.cli import (
    EXIT_USAGE,
    OutputExistsError,
    UsageError,
    device_failed,
    existing_dir,
    existing_file,
    exit_code,
    fail,
)

PROG = "ling-train"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", required=True, help="random:PRESET (a name in configs/), random:PATH.json (an HF "
                    "config.json), hf:DIR or orbax:DIR (ignored when resuming)")
    ap.add_argument("--data", required=True, help=".bin/.npy token file, .txt/.jsonl text, or a directory of them")
    ap.add_argument("--out", required=True, help="run directory (checkpoints, metrics.jsonl, config.json)")
    ap.add_argument("--steps", type=int, required=True, help="total steps of the run (resumes up to it)")
    ap.add_argument("--batch-size", type=int, help="global batch in sequences")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--warmup-steps", type=int)
    ap.add_argument("--config", help="JSON/YAML TrainConfig file (see train/config.py)")
    ap.add_argument("--tokenizer", help="tokenizer.json for .txt/.jsonl data")
    ap.add_argument("--mesh", help="device mesh as axis=size pairs of data, fsdp, expert, tensor, e.g. "
                    "'data=2,expert=4' (overrides the config's mesh; default: one device)")
    return ap


def init_model(spec: str, dtype: str, mesh: Any, seed: int = 0) -> tuple[Any, Any]:
    """(config, float32 params) from random:PRESET or random:PATH.json (an HF config.json; drawn with
    `seed`), hf:DIR or orbax:DIR."""
    import ling_jax
    from ling_jax.params import init_params

    kind, _, arg = spec.partition(":")
    if kind == "random":
        cfg = ling_jax.LingConfig.from_hf(arg) if arg.endswith(".json") else ling_jax.LingConfig.preset(arg)
        return cfg, init_params(cfg, seed=seed, dtype=dtype, mesh=mesh)
    if kind == "hf":
        return ling_jax.load_hf_checkpoint(arg, dtype=dtype, mesh=mesh)
    if kind == "orbax":
        return ling_jax.load_checkpoint(arg, dtype=dtype, mesh=mesh)
    raise UsageError(f"--init {spec!r}: expected random:PRESET, random:PATH.json, hf:DIR or orbax:DIR")


def check_command_line(args: argparse.Namespace) -> None:
    """UsageError unless the paths given exist as what they name: `--out` a directory or nothing,
    `--data` a corpus file or a directory of them, `--tokenizer` a file, and (unless `--out` holds a
    checkpoint to resume) `--init` a known preset or an existing directory."""
    from ling_jax.config import ConfigError, LingConfig
    from train.checkpointing import has_checkpoint
    from train.data import data_files

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"--out {out}: a file, not a run directory")
    data_files(args.data)
    if args.tokenizer is not None:
        existing_file("--tokenizer", args.tokenizer)
    if has_checkpoint(out):
        return
    kind, _, arg = args.init.partition(":")
    if kind in ("hf", "orbax"):
        existing_dir("--init", arg)
    elif kind == "random":
        try:
            LingConfig.from_hf(arg) if arg.endswith(".json") else LingConfig.preset(arg)
        except ConfigError as e:
            raise UsageError(f"--init {args.init}: {e}") from None
    else:
        raise UsageError(f"--init {args.init!r}: expected random:PRESET, random:PATH.json, hf:DIR or orbax:DIR")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ling_jax.sharding import parse_mesh
    from train.checkpointing import has_checkpoint
    from train.config import TrainConfig

    try:
        tcfg = TrainConfig.load(args.config, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                                lr=args.lr, warmup_steps=args.warmup_steps,
                                mesh=None if args.mesh is None else parse_mesh(args.mesh))
        check_command_line(args)
    except (ValueError, OSError, TypeError) as e:  # the flags, the --config file, the paths given
        return fail(PROG, str(e), EXIT_USAGE)
    out = Path(args.out)
    made = _outermost_missing(out)  # what the run's mkdir creates
    rc = _run(args, tcfg)
    if rc != 0 and made is not None and not has_checkpoint(out):  # nothing to resume: no half-made run left
        shutil.rmtree(made, ignore_errors=True)
    return rc


def _outermost_missing(path: Path) -> Path | None:
    """The outermost directory that creating `path` with its parents makes (None: `path` exists)."""
    if path.exists():
        return None
    top = path.absolute()
    while not top.parent.exists():
        top = top.parent
    return top


def _run(args: argparse.Namespace, tcfg: Any) -> int:
    """`run`, its errors as one line: exit 2 (usage), 1 (failure) or 130 (a second Ctrl-C)."""
    import jax

    try:
        return run(args, tcfg)
    except (ValueError, OSError) as e:  # ConfigError, CheckpointError, DataError derive from ValueError
        return fail(PROG, str(e), exit_code(e))
    except jax.errors.JaxRuntimeError as e:
        return device_failed(PROG, e)
    except KeyboardInterrupt:  # a second Ctrl-C (or one in a multi-process run): what was saved is reported
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def run(args: argparse.Namespace, tcfg: Any) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ling_jax import distributed
    from ling_jax.config import LingConfig
    from ling_jax.params import build_tree, default_sharding
    from ling_jax.sharding import batch_sharding, make_mesh
    from train.checkpointing import RunCheckpoints
    from train.data import PackedBatches, load_tokens
    from train.flops import peak_flops_per_device, train_flops_per_token
    from train.optim import make_optimizer
    from train.step import checkpointed, init_state, make_train_step, mtp_weight, with_compute_copy

    distributed.initialize()  # joins a multi-process job when one is configured; else nothing
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lead = jax.process_index() == 0  # the process that writes the run's files and prints
    mesh = make_mesh(**tcfg.mesh) if tcfg.mesh else None
    if mesh is None and jax.device_count() > 1 and lead:
        print(f"ling-train: running on 1 of {jax.device_count()} devices (--mesh, or the config's mesh, spreads "
              "the run over them)")
    ckpts = RunCheckpoints(out, keep=tcfg.keep_checkpoints)
    resume = ckpts.latest_step()
    if resume is None:
        cfg, params = init_model(args.init, "float32", mesh, seed=tcfg.seed)
        if lead:
            (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    else:
        cfg = LingConfig.from_hf(out / "config.json")
        params = None
    if tcfg.seq_len > cfg.max_position_embeddings:
        raise UsageError(f"--seq-len {tcfg.seq_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    eos = cfg.eos_token_id[0] if cfg.eos_token_id else cfg.vocab_size - 1
    tokens = load_tokens(args.data, vocab_size=cfg.vocab_size, eos_id=eos, tokenizer=args.tokenizer)
    optimizer = make_optimizer(cfg, tcfg)

    def fresh_state(p):
        return checkpointed(init_state(cfg, tcfg, optimizer, p))

    data_state = None
    if resume is None:
        # donated: the state's masters take the params' buffers (no second fp32 copy of the model)
        state = jax.jit(functools.partial(init_state, cfg, tcfg, optimizer), donate_argnums=0)(params)
        del params
        start = 0
    else:
        shard = default_sharding(cfg, mesh)
        params_abs = build_tree(cfg, lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=shard(s)))
        compiled = jax.jit(fresh_state).lower(params_abs).compile()
        state_abs = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                 jax.eval_shape(fresh_state, params_abs), compiled.output_shardings)
        state, data_state, meta = ckpts.restore(state_abs, resume)
        state = jax.jit(functools.partial(with_compute_copy, cfg, tcfg), donate_argnums=0)(state)
        start = int(meta["iteration"])
        print(f"resuming {out} at step {start}")
        if lead:
            _truncate_metrics(out / "metrics.jsonl", start)
    if start >= tcfg.steps:
        print(f"{out}: already at step {start} >= --steps {tcfg.steps}; nothing to do")
        ckpts.close()
        return 0
    batches = PackedBatches(tokens, seq_len=tcfg.seq_len, batch_size=tcfg.batch_size, eos_id=eos, seed=tcfg.seed,
                            shuffle=tcfg.shuffle, state=data_state)
    step_fn = jax.jit(make_train_step(cfg, tcfg, optimizer), donate_argnums=0)
    flops_tok = train_flops_per_token(cfg, tcfg.seq_len, mtp=mtp_weight(cfg, tcfg) > 0)
    peak = peak_flops_per_device(tcfg.peak_tflops)
    n_dev = 1 if mesh is None else mesh.size  # the devices the steps run on
    meta = {"train_config": tcfg.to_json(), "model": cfg.to_hf()}

    def put(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Every process draws the same global batch; it hands JAX only the rows its devices hold."""
        if mesh is None:
            return jax.device_put(batch)
        shape = batch["inputs"].shape
        rows = distributed.local_rows(batch_sharding(mesh, shape), shape)
        return distributed.global_batch({k: v[rows] for k, v in batch.items()}, mesh, shape[0])

    last_saved = start  # the step of the run's newest checkpoint

    def save(it: int) -> None:
        nonlocal last_saved
        ckpts.save(it, checkpointed(state), data_pos, {**meta, "iteration": it})
        last_saved = it
        clock["free"] = time.perf_counter()  # the next step's time starts after the write

    def report(it: int, m: dict[str, Any], dt: float) -> None:
        tok_s = tcfg.batch_size * tcfg.seq_len / dt if dt > 0 else 0.0
        line = {"step": it, "loss": float(m["loss"]), "mtp_loss": float(m["mtp_loss"]),
                "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]), "finite": bool(m["finite"]),
                "tokens_per_s": tok_s, "step_time_s": dt,
                "mfu": None if peak is None else flops_tok * tok_s / (peak * n_dev),
                "moe_max_load_mean": float(np.mean(m["max_load"])) if m["max_load"].size else None,
                "moe_max_load_per_layer": [round(float(x), 3) for x in m["max_load"]]}
        if not lead:
            return
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        if it % tcfg.log_every == 0 or it == tcfg.steps:
            mfu = "" if line["mfu"] is None else f" mfu {100 * line['mfu']:.1f}%"
            print(f"step {it:>6} | loss {line['loss']:.4f} | grad {line['grad_norm']:.3f} | lr {line['lr']:.2e} | "
                  f"{tok_s:,.0f} tok/s{mfu} | moe max/mean load {line['moe_max_load_mean'] or 0:.2f}"
                  + ("" if line["finite"] else " | NON-FINITE: update skipped"), flush=True)

    pending: tuple[int, Any, float] | None = None  # (step, its metrics on device, its dispatch time)
    clock = {"free": time.perf_counter()}  # when the device last became free of our work (a step, a save)
    bad = 0

    def flush() -> None:
        """Reads and reports the pending step: its time runs from its dispatch (or the end of the
        step or save before it, whichever is later) to its metrics' arrival."""
        nonlocal pending, bad
        if pending is None:
            return
        p_it, p_m, p_t0 = pending
        p_m = jax.device_get(p_m)
        done = time.perf_counter()
        report(p_it, p_m, done - max(p_t0, clock["free"]))
        clock["free"] = done
        bad = 0 if p_m["finite"] else bad + 1
        pending = None

    stop = _StopOnSignal(enabled=jax.process_count() == 1)
    it = start
    data_pos = batches.state()  # the data position after the steps taken so far
    gave_up = finished = False
    # under the mesh, the MoE layers dispatch experts across the `expert` axis (layers/moe.py)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh), stop:
        try:
            while it < tcfg.steps and not stop.requested:
                batch = put(next(batches))
                t0 = time.perf_counter()
                state, metrics = step_fn(state, batch)
                it += 1
                data_pos = batches.state()
                flush()  # the previous step's metrics, read while this one runs
                pending = (it, metrics, t0)
                if it % tcfg.checkpoint_every == 0 and it < tcfg.steps:
                    flush()
                    save(it)
                if bad >= tcfg.max_bad_steps:  # (a non-finite step leaves the state as it was)
                    gave_up = True
                    print(f"ling-train: stopping after {bad} consecutive non-finite steps", file=sys.stderr)
                    break
            flush()
            finished = True
        finally:
            if it > last_saved and finished:  # else nothing moved since (e.g. interrupted compiling the first step)
                save(it)
            elif it > last_saved:  # an error or Ctrl-C: keep what the last step made, if it still exists
                with contextlib.suppress(Exception):
                    flush()  # an interrupted run still reports its last step
                try:
                    save(it)
                except Exception as e:  # e.g. the state's buffers were donated to the interrupted step
                    print(f"ling-train: no checkpoint at step {it} ({type(e).__name__}: {e}); the last saved "
                          "one stands", file=sys.stderr)
            ckpts.wait()
            ckpts.close()
    if stop.requested and it < tcfg.steps:
        print(f"ling-train: {stop.requested}: stopped at step {it}, "
              + ("checkpoint saved" if last_saved == it > start else "before any step: nothing to save" if it == start
                 else f"the checkpoint of step {last_saved} stands"), file=sys.stderr)
        return 143 if stop.requested == "SIGTERM" else 130
    print(f"saved {out / 'checkpoints'} at step {it}")
    return 1 if gave_up or bad >= tcfg.max_bad_steps else 0


class _StopOnSignal:
    """While entered, SIGTERM and a first Ctrl-C (SIGINT) set `requested` (the signal's name): the loop
    then stops after the step in flight and saves, instead of dying inside a step whose donated
    state it can no longer save. A second Ctrl-C interrupts at once (`KeyboardInterrupt`).

    `enabled` False (a multi-process job: processes stopping at different steps would deadlock in
    the save's collectives) leaves both signals as they are; such a job resumes from its last
    periodic checkpoint. An ignored SIGINT (a background job's) stays ignored."""

    def __init__(self, enabled: bool = True) -> None:
        self.requested: str | None = None
        self.enabled = enabled
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopOnSignal:
        if self.enabled and threading.current_thread() is threading.main_thread():
            sigs = [signal.SIGTERM] + [signal.SIGINT] * (signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
            self._old = {sig: signal.signal(sig, self._handle) for sig in sigs}
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            if self.requested == "Ctrl-C":
                raise KeyboardInterrupt
            print("ling-train: Ctrl-C: stopping after the step in flight, then saving (Ctrl-C again: stop now; "
                  "the steps since the last checkpoint may be lost)", file=sys.stderr, flush=True)
        self.requested = "Ctrl-C" if signum == signal.SIGINT else self.requested or "SIGTERM"

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drops the metric lines of steps after `step` (written by a run that stopped past its last
    checkpoint), so a resumed run's file has each step once."""
    if not path.is_file():
        return
    def kept(line: str) -> bool:
        try:
            return json.loads(line)["step"] <= step
        except (json.JSONDecodeError, KeyError, TypeError):  # a line cut short by a kill
            return False

    lines = path.read_text().splitlines(keepends=True)
    keep = [ln for ln in lines if kept(ln)]
    if len(keep) != len(lines):
        path.write_text("".join(line if line.endswith("\n") else line + "\n" for line in keep))


if __name__ == "__main__":
    sys.exit(main())

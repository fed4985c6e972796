"""Continued pretraining: learning, exact resume (after SIGKILL, after a failure), gradients, bias balancing,
packing, bad input (exit 2 / 1), no half-made run directory left behind."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import SUBPROCESS_CACHE, rel_l2

from ling_jax.checkpoint.export import save_hf_checkpoint
from ling_jax.config import LingConfig
from ling_jax.model import forward_hidden, lm_head
from ling_jax.ops.logsumexp import row_logsumexp
from ling_jax.params import init_params
from train import loss as ce_loss
from train.config import TrainConfig
from train.data import IGNORE, DataError, PackedBatches
from train.optim import make_optimizer
from train.step import (
    apply_bias_update,
    checkpointed,
    clip_by_norm,
    init_state,
    load_stats,
    loss_terms,
    make_train_step,
)

# one MoE layer kind per mixer (no dense prefix) keeps compilation small: 2 KDA + 2 MLA + MTP
TINY = dict(num_hidden_layers=4, layer_group_size=2, first_k_dense_replace=0)
TCFG = dict(batch_size=4, seq_len=32, compute_dtype="float32", remat="full", lr=3e-3, warmup_steps=2,
            mtp_loss_weight=0.3, bias_update_rate=1e-3, checkpoint_every=4, shuffle=True)


def corpus(n_docs: int, seed: int = 0) -> np.ndarray:
    """Learnable documents: counting runs mod 64 (ids 2..65, next = current + 1), each ended by eos = 1."""
    rng = np.random.default_rng(seed)
    toks: list[int] = []
    for _ in range(n_docs):
        start, n = rng.integers(0, 64), rng.integers(6, 30)
        toks += [int(2 + (start + i) % 64) for i in range(n)] + [1]
    return np.asarray(toks, np.uint32)


@pytest.fixture(scope="module")
def tiny():
    cfg = LingConfig.preset("debug", **TINY)
    tcfg = TrainConfig(**TCFG)
    opt = make_optimizer(cfg, tcfg)
    return cfg, tcfg, opt, jax.jit(make_train_step(cfg, tcfg, opt), donate_argnums=0)


def fresh_state(cfg, opt, seed=0, tcfg=None):
    return init_state(cfg, tcfg or TrainConfig(**TCFG), opt, init_params(cfg, seed=seed))


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_tiny_model_learns(tiny):
    cfg, tcfg, opt, step = tiny
    batches = PackedBatches(corpus(300), seq_len=tcfg.seq_len, batch_size=tcfg.batch_size, eos_id=1)
    state, losses = fresh_state(cfg, opt), []
    for _ in range(40):
        state, m = step(state, jax.device_put(next(batches)))
        losses.append(float(m["loss"]))
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:3]) - 2.5, losses  # from ~ln(512) = 6.2 nats


@pytest.mark.heavy  # (default suite kept well under 20 min on 2 cores)
def test_non_finite_step_is_skipped(tiny):
    cfg, tcfg, opt, step = tiny
    state = fresh_state(cfg, opt)
    state["params"]["final_norm"] = state["params"]["final_norm"].at[0].set(jnp.nan)
    before = jax.tree.map(np.asarray, state["params"])
    batch = jax.device_put(next(PackedBatches(corpus(50), seq_len=32, batch_size=4, eos_id=1)))
    state, m = step(state, batch)
    assert not bool(m["finite"]) and int(state["bad_steps"]) == 1 and int(state["step"]) == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state["params"], before)


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_bf16_compute_copy_follows_the_masters(tiny):
    """bf16 compute: the state carries the masters' bf16 copy (None at the float32-kept leaves) that
    the forward reads; each finite step rewrites it from the new masters, a skipped step keeps it,
    checkpoints leave it out; and the step's loss is the float32 step's within bf16 rounding."""
    cfg, tcfg32, opt, step32 = tiny
    tcfg = TrainConfig(**{**TCFG, "compute_dtype": "bfloat16"})
    step = jax.jit(make_train_step(cfg, tcfg, opt), donate_argnums=0)
    batches = PackedBatches(corpus(50), seq_len=32, batch_size=4, eos_id=1)
    state, state32 = fresh_state(cfg, opt, tcfg=tcfg), fresh_state(cfg, opt)
    assert "compute" not in state32 and "compute" not in checkpointed(state)
    assert state["compute"]["segments"][0]["kda"]["attn"]["A_log"] is None

    def copy_matches(st):
        jax.tree.map(lambda p, c: c is None or np.testing.assert_array_equal(
            np.asarray(c), np.asarray(p.astype(jnp.bfloat16))), st["params"], st["compute"])
        assert {x.dtype for x in jax.tree.leaves(st["compute"])} == {jnp.dtype(jnp.bfloat16)}

    copy_matches(state)
    for _ in range(2):
        batch = jax.device_put(next(batches))
        state, m = step(state, batch)
        state32, m32 = step32(state32, batch)
        assert bool(m["finite"]) and abs(float(m["loss"]) - float(m32["loss"])) < 2e-2 * float(m32["loss"])
        copy_matches(state)
    state["compute"]["final_norm"] = state["compute"]["final_norm"].at[0].set(jnp.nan)  # what the forward reads
    before = jax.tree.map(np.asarray, {k: state[k] for k in ("params", "compute")})
    state, m = step(state, jax.device_put(next(batches)))
    assert not bool(m["finite"]) and int(state["bad_steps"]) == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), b.astype(np.float32)),
                 {k: state[k] for k in ("params", "compute")}, before)  # float32: numpy's NaN test skips bf16
    with pytest.raises(ValueError, match="compute-dtype copy"):
        step(checkpointed(state), jax.device_put(next(batches)))


@pytest.mark.parametrize("max_norm", [0.5, 50.0], ids=["clipped", "unclipped"])
def test_clip_by_norm_is_optax_clip_by_global_norm(max_norm):
    """The step's clipping (with the norm it already has, bf16 grads in) equals optax's."""
    ks = jax.random.split(jax.random.key(3), 2)
    grads = {"a": jax.random.normal(ks[0], (7, 5), jnp.bfloat16), "b": [jax.random.normal(ks[1], (11,))]}
    g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    want, _ = optax.clip_by_global_norm(max_norm).update(g32, optax.EmptyState())
    got = clip_by_norm(grads, optax.tree.norm(g32), max_norm)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), got, want)
    assert (float(optax.tree.norm(got)) < max_norm) == (max_norm == 50.0)


def test_pad_row_of_the_embedding_gets_no_gradient():
    """As the reference's padding_idx: the lookup of pad ids sends no gradient to that row."""
    cfg = LingConfig.preset("debug", **GRAD_SHAPE)
    ids = jnp.asarray([[5, cfg.pad_token_id, 7, 5]])

    def loss(emb):
        return jnp.sum(forward_hidden(cfg, {**params, "embed": emb}, ids)["final"] ** 2)

    params = init_params(cfg, seed=0)
    g = jax.grad(loss)(params["embed"])
    assert float(jnp.abs(g[cfg.pad_token_id]).max()) == 0.0 and float(jnp.abs(g[5]).max()) > 0


def test_clip_norm_zero_means_no_clipping():
    grads = {"a": jnp.full((3,), 10.0)}
    np.testing.assert_array_equal(clip_by_norm(grads, optax.tree.norm(grads), 0.0)["a"], grads["a"])


@pytest.mark.parametrize("change, msg", [
    (dict(max_bad_steps=0), "max_bad_steps=0 must be at least 1"), (dict(log_every=0), "log_every=0"),
    (dict(lr=-1.0), "lr=-1.0 must be positive"), (dict(clip_norm=-1.0), "clip_norm=-1.0 must be >= 0"),
    (dict(compute_dtype="fp16"), "compute_dtype='fp16'"), (dict(mesh={"model": 2}), "mesh={'model': 2}"),
    (dict(lr="3e-4"), "lr='3e-4': must be float"), (dict(beta2=1.0), "beta2=1.0 must be in"),
])
def test_train_config_refuses_bad_values(change, msg):
    with pytest.raises(ValueError, match=msg):
        TrainConfig.load(None, **change)


@pytest.mark.heavy  # (default suite kept well under 20 min on 2 cores)
def test_untrained_mtp_layer_is_frozen():
    """With MTP loss weight 0 no gradient reaches the MTP layer: weight decay must not shrink it either."""
    cfg = LingConfig.preset("debug", **TINY)
    params = init_params(cfg, seed=0)
    grads = jax.tree.map(jnp.ones_like, params)
    for weight, mtp_moves in ((0.0, False), (0.3, True)):
        opt = make_optimizer(cfg, TrainConfig(**{**TCFG, "mtp_loss_weight": weight, "warmup_steps": 0}))
        updates, _ = opt.update(grads, opt.init(params), params)
        assert any(np.any(np.asarray(u) != 0) for u in jax.tree.leaves(updates["mtp"])) == mtp_moves
        assert np.any(np.asarray(updates["embed"]) != 0)


def test_token_stream_over_files_equals_their_concatenation(tmp_path):
    """A directory of token files is read as one stream of memory maps (never concatenated whole)."""
    from train.data import TokenStream, load_tokens

    parts = [corpus(n, seed=n) for n in (3, 1, 5)]
    for i, arr in enumerate(parts):
        arr.tofile(tmp_path / f"{i}.bin")
    stream, whole = load_tokens(tmp_path, vocab_size=512, eos_id=1), np.concatenate(parts)
    assert isinstance(stream, TokenStream) and stream.size == whole.size
    for lo, hi in ((0, whole.size), (5, parts[0].size + 3), (parts[0].size, parts[0].size + parts[1].size + 1)):
        np.testing.assert_array_equal(stream[lo:hi], whole[lo:hi])
    a = PackedBatches(stream, seq_len=16, batch_size=2, eos_id=1, seed=3)
    b = PackedBatches(whole, seq_len=16, batch_size=2, eos_id=1, seed=3)
    for _ in range(4):
        jax.tree.map(np.testing.assert_array_equal, next(a), next(b))


def test_data_position_must_belong_to_the_corpus():
    toks = corpus(40)
    with pytest.raises(DataError, match="fewer than one batch of 1000"):
        PackedBatches(toks, seq_len=16, batch_size=1000, eos_id=1)
    batches = PackedBatches(toks, seq_len=16, batch_size=4, eos_id=1)
    next(batches)
    state = batches.state()
    assert PackedBatches(toks, seq_len=16, batch_size=4, eos_id=1, state=state).state() == state
    with pytest.raises(DataError, match="seq_len 16 -> 32"):
        PackedBatches(toks, seq_len=32, batch_size=4, eos_id=1, state=state)
    with pytest.raises(DataError, match="seed 0 -> 1"):
        PackedBatches(toks, seq_len=16, batch_size=4, eos_id=1, seed=1, state=state)
    old = {"epoch": state["epoch"], "index": state["index"]}  # written before the position named its corpus
    assert PackedBatches(toks, seq_len=16, batch_size=4, eos_id=1, state=old).state() == state
    with pytest.raises(DataError, match="window 1000 of"):
        PackedBatches(toks, seq_len=16, batch_size=4, eos_id=1, state={"epoch": 0, "index": 1000})


def test_resumed_metrics_drop_the_steps_after_the_checkpoint(tmp_path):
    from train.main import _truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(1, 7)) + '{"step": 7, "lo')
    _truncate_metrics(path, 4)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.heavy
@pytest.mark.parametrize("sig,name,rc", [(signal.SIGTERM, "SIGTERM", 143), (signal.SIGINT, "Ctrl-C", 130)])
def test_signal_saves_and_resumes(tmp_path, sig, name, rc):
    """SIGTERM (a scheduler's preemption) or Ctrl-C stops the run after the step in flight with a
    checkpoint there (exit 143 / 130, no traceback); the same command then finishes the run, each
    step in metrics.jsonl once."""
    data = tmp_path / "corpus.bin"
    corpus(200).tofile(data)
    cfg_file = tmp_path / "train.json"
    cfg_file.write_text(json.dumps({**TCFG, "checkpoint_every": 100}))
    run = _train_cli(tmp_path / "r", 1000, data, cfg_file)  # stopped long before the end
    metrics, deadline = tmp_path / "r" / "metrics.jsonl", time.time() + 900
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert run.poll() is None and time.time() < deadline, run.communicate()[0]
        time.sleep(0.05)
    run.send_signal(sig)
    log = run.communicate(timeout=600)[0]
    assert run.returncode == rc and f"{name}: stopped at step" in log and "Traceback" not in log, log
    stopped = int(re.search(rf"{name}: stopped at step (\d+)", log).group(1))
    assert 2 <= stopped < 1000 and (tmp_path / "r" / "checkpoints" / str(stopped)).is_dir()
    assert sorted(_losses(tmp_path / "r")) == list(range(1, stopped + 1))
    resumed = _train_cli(tmp_path / "r", stopped + 2, data, cfg_file)
    log = resumed.communicate(timeout=900)[0]
    assert resumed.returncode == 0 and f"at step {stopped}" in log, log
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, stopped + 3))


def test_a_second_ctrl_c_interrupts_at_once():
    """The first Ctrl-C asks the loop to stop after its step; a second raises KeyboardInterrupt now;
    SIGTERM after a Ctrl-C keeps the Ctrl-C's exit; the handlers are restored on exit; with the
    handler disabled, or SIGINT ignored (a background job), SIGINT is left as it was."""
    from train.main import _StopOnSignal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal (CI may ignore it)
    try:
        with _StopOnSignal() as stop:
            assert signal.getsignal(signal.SIGINT) == stop._handle == signal.getsignal(signal.SIGTERM)
            stop._handle(signal.SIGINT, None)
            assert stop.requested == "Ctrl-C"
            stop._handle(signal.SIGTERM, None)
            assert stop.requested == "Ctrl-C"
            with pytest.raises(KeyboardInterrupt):
                stop._handle(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with _StopOnSignal() as stop:
            stop._handle(signal.SIGTERM, None)
            assert stop.requested == "SIGTERM"
        with _StopOnSignal(enabled=False):
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with _StopOnSignal() as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stop._handle
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_unrolled_layers_step_equals_scanned(tiny):
    """unroll_layers=True (straight-line layers) takes the same step as the layer scans."""
    cfg, tcfg, opt, step = tiny
    unrolled = jax.jit(make_train_step(cfg, TrainConfig(**{**TCFG, "unroll_layers": True}), opt))
    batch = jax.device_put(next(PackedBatches(corpus(50), seq_len=32, batch_size=4, eos_id=1)))
    (sa, ma), (sb, mb) = step(fresh_state(cfg, opt), batch), unrolled(fresh_state(cfg, opt), batch)
    assert abs(float(ma["loss"]) - float(mb["loss"])) < 1e-6 * float(ma["loss"])
    flat = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(s["params"])]) for s in (sa, sb)]
    assert rel_l2(flat[1], flat[0]) < 1e-6


def _train_cli(out: Path, steps: int, data: Path, cfg_file: Path) -> subprocess.Popen:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": SUBPROCESS_CACHE,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    cmd = [sys.executable, "-m", "train.main", "--init", "random:debug", "--data", str(data), "--out", str(out),
           "--steps", str(steps), "--config", str(cfg_file)]
    # Ctrl-C as at a terminal, even where this process ignores it (a background job: `nohup`, CI): an
    # ignored signal stays ignored across exec, a handled one starts at its default
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=Path(__file__).parent.parent)
    finally:
        signal.signal(signal.SIGINT, previous)


def _losses(out: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m["loss"] for m in lines}  # the last record of a step wins (a resumed run rewrites it)


def _final_params(out: Path):
    with ocp.CheckpointManager(out / "checkpoints") as mngr:
        step = mngr.latest_step()
        return step, mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]["params"]


@pytest.mark.heavy
def test_resume_after_sigkill_is_exact(tmp_path):
    """8 steps straight == 8 steps killed (SIGKILL) after the step-4 checkpoint, then resumed: same
    losses bit for bit and identical final params."""
    data = tmp_path / "corpus.bin"
    corpus(200).tofile(data)
    cfg_file = tmp_path / "train.json"
    cfg_file.write_text(json.dumps({**TCFG, "batch_size": 4, "seq_len": 32, "checkpoint_every": 4}))
    straight = _train_cli(tmp_path / "a", 8, data, cfg_file)
    log = straight.communicate(timeout=900)[0]
    assert straight.returncode == 0, log
    killed = _train_cli(tmp_path / "b", 8, data, cfg_file)
    deadline = time.time() + 900
    while not (tmp_path / "b" / "checkpoints" / "4").is_dir():
        assert killed.poll() is None and time.time() < deadline, killed.communicate()[0]
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    resumed = _train_cli(tmp_path / "b", 8, data, cfg_file)
    log = resumed.communicate(timeout=900)[0]
    assert resumed.returncode == 0 and "resuming" in log, log
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(a) == list(range(1, 9)) and [a[i] for i in range(1, 9)] == [b[i] for i in range(1, 9)]
    (sa, pa), (sb, pb) = _final_params(tmp_path / "a"), _final_params(tmp_path / "b")
    assert sa == sb == 8
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), pa, pb)


# a dense 2-layer model with unrolled layers: its train step compiles in seconds
RESUME_MODEL = dict(num_hidden_layers=2, layer_group_size=2, first_k_dense_replace=0, num_nextn_predict_layers=0,
                    num_experts=None)
RESUME_TCFG = dict(batch_size=2, seq_len=16, compute_dtype="float32", remat="none", unroll_layers=True,
                   checkpoint_every=2)


@pytest.fixture(scope="module")
def failed_then_resumed(tmp_path_factory):
    """ling-train for 5 steps on a tiny model whose corpus fails at the 4th batch (after the step-2
    checkpoint; the failure saves step 3), then the same command again. Returns both exit codes,
    the checkpoint steps the failed run left, the inputs of the batches each run drew, the run
    directory and the corpus."""
    from train import data as train_data
    from train.main import main

    tmp = tmp_path_factory.mktemp("resume")
    cfg = LingConfig.preset("debug", **RESUME_MODEL)
    save_hf_checkpoint(cfg, init_params(cfg, seed=0), tmp / "hf", dtype="float32")
    corpus(60).tofile(tmp / "d.bin")
    (tmp / "c.json").write_text(json.dumps(RESUME_TCFG))
    argv = ["--init", f"hf:{tmp / 'hf'}", "--data", str(tmp / "d.bin"), "--out", str(tmp / "run" / "a"),
            "--steps", "5", "--config", str(tmp / "c.json")]
    drawn: list[list[np.ndarray]] = []
    real_next = train_data.PackedBatches.__next__

    def recording_next(self):
        if len(drawn) == 1 and len(drawn[0]) == 3:
            raise DataError("the corpus became unreadable")
        batch = real_next(self)
        drawn[-1].append(batch["inputs"].copy())
        return batch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_data.PackedBatches, "__next__", recording_next)
        drawn.append([])
        codes = [main(argv)]
        left = sorted(int(p.name) for p in (tmp / "run" / "a" / "checkpoints").iterdir())
        drawn.append([])
        codes.append(main(argv))
    return codes, left, drawn, tmp / "run" / "a", tmp / "d.bin"


def test_resume_draws_the_batches_of_a_straight_run(failed_then_resumed):
    """The failed run drew batches 1-3 and checkpointed step 3 with its data position; the resumed
    run drew 4 and 5: exactly the 5 batches of a straight run, and its last checkpoint holds the
    straight run's data position."""
    codes, left, drawn, out, data = failed_then_resumed
    assert codes == [1, 0]
    straight = PackedBatches(np.fromfile(data, np.uint32), seq_len=16, batch_size=2, eos_id=1)
    want = [next(straight)["inputs"] for _ in range(5)]
    assert [len(d) for d in drawn] == [3, 2]
    for got, w in zip(drawn[0] + drawn[1], want, strict=True):
        np.testing.assert_array_equal(got, w)
    with ocp.CheckpointManager(out / "checkpoints") as mngr:
        assert mngr.latest_step() == 5
        position = mngr.restore(5, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    assert position == straight.state()
    assert sorted(_losses(out)) == [1, 2, 3, 4, 5]


def test_failed_run_keeps_its_checkpoints(failed_then_resumed):
    """A run that fails after its first checkpoint keeps the --out it created, with the checkpoint of
    its last step."""
    codes, left, *_ = failed_then_resumed
    assert codes[0] == 1 and left == [2, 3]


GRAD_SHAPE = dict(num_hidden_layers=2, layer_group_size=2, first_k_dense_replace=0)  # 1 KDA + 1 MLA layer
# the fused attention kernels take power-of-two head dims >= 16 (debug's rope width is 8; both impls
# get the same shapes, so the same params)
FUSED_ATTENTION = {impl: dict(attention_impl=impl, qk_rope_head_dim=16) for impl in ("xla", "pallas")}


def grad_loss(p, cfg):
    """Main + weighted MTP cross-entropy of one fixed packed batch (the gradient tests' loss)."""
    tcfg = TrainConfig(batch_size=2, seq_len=24, compute_dtype="float32", remat="none", mtp_loss_weight=0.3)
    batch = jax.device_put(next(PackedBatches(corpus(40), seq_len=24, batch_size=2, eos_id=1)))
    ce, mtp, _ = loss_terms(cfg, tcfg, p, batch)
    return ce + 0.3 * mtp


def test_gradients_match_reference_paths():
    """jax.grad of the full MoE model through the chunked KDA path == through the token-by-token reference."""
    moe_cfg = {impl: LingConfig.preset("debug", **GRAD_SHAPE, kda_impl=impl) for impl in ("chunked", "reference")}
    params = init_params(moe_cfg["chunked"], seed=1)
    g_chunk, g_ref = (jax.jit(jax.grad(lambda p, c=c: grad_loss(p, c)))(params) for c in moe_cfg.values())
    flat = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]) for g in (g_chunk, g_ref)]
    assert rel_l2(*flat) < 1e-5
    kda = g_chunk["segments"][0]["kda"]["attn"]
    assert float(jnp.abs(kda["A_log"]).max()) > 0 and float(jnp.abs(kda["q_conv"]).max()) > 0


@pytest.mark.heavy
def test_gradients_match_finite_differences():
    """The gradient of a dense-FFN model agrees with a central finite difference along a random
    direction (top-k routing is piecewise constant, so finite differences need a dense model)."""
    dense = LingConfig.preset("debug", **GRAD_SHAPE, num_experts=None)
    params = init_params(dense, seed=1)
    grad = jax.jit(jax.grad(lambda p: grad_loss(p, dense)))(params)
    rng = np.random.default_rng(0)
    # a direction on the scale of each leaf (weights ~ 0.02): the finite difference stays in the linear regime
    direction = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype) * (jnp.std(x) + 1e-2),
                             params)
    eps = 3e-3
    f = jax.jit(lambda p: grad_loss(p, dense))
    shifted = [float(f(jax.tree.map(lambda p, d, s=s: p + s * eps * d, params, direction))) for s in (1.0, -1.0)]
    fd = (shifted[0] - shifted[1]) / (2 * eps)
    analytic = sum(float(jnp.vdot(g, d))
                   for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(direction), strict=True))
    assert abs(fd - analytic) < 2e-3 * abs(analytic), (fd, analytic)


@pytest.mark.parametrize("dtype, logits_dtype, tol, kernel", [
    (jnp.float32, "float32", 1e-6, False), (jnp.bfloat16, "float32", 2e-2, False),
    (jnp.float32, "bfloat16", 1e-2, False), (jnp.float32, "float32", 1e-6, True)])
def test_cross_entropy_and_its_gradient_match_the_dense_softmax(monkeypatch, dtype, logits_dtype, tol, kernel):
    """The chunked CE (gradient made in the forward pass, 37 tokens in chunks of 8 with padding,
    unlabelled rows) == -log_softmax of the whole float32 logits matrix, value and both gradients;
    bf16 logits within their rounding; `kernel`: the GPU's log-sum-exp kernel (interpreted)."""
    monkeypatch.setattr(ce_loss, "CE_CHUNK", 8)
    if kernel:
        monkeypatch.setattr(ce_loss, "row_logsumexp", functools.partial(row_logsumexp, impl="pallas", interpret=True))
    ks = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(ks[0], (37, 16)).astype(dtype)
    w = (jax.random.normal(ks[1], (16, 50)) * 0.5).astype(dtype)
    labels = jax.random.randint(ks[2], (37,), 0, 50).at[jnp.array([0, 9, 36])].set(IGNORE)
    cot = 0.37  # the loss's cotangent (1 / tokens in the train step)

    def dense(h, w):
        logp = jax.nn.log_softmax((h.astype(jnp.float32) @ w.astype(jnp.float32)), axis=-1)
        nll = -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[:, None], axis=1)[:, 0]
        return cot * jnp.sum(jnp.where(labels != IGNORE, nll, 0.0))

    def ce(h, w):
        return ce_loss.cross_entropy_sum(h, w, labels, logits_dtype)

    value, grads = jax.value_and_grad(lambda h, w: cot * ce(h, w), (0, 1))(h, w)
    ref_value, ref_grads = jax.value_and_grad(dense, (0, 1))(h, w)
    assert abs(float(value) - float(ref_value)) < tol * abs(float(ref_value))
    assert abs(float(ce(h, w)) * cot - float(ref_value)) < tol * abs(float(ref_value))
    if logits_dtype == "bfloat16":  # the option reaches the matmul: its rounding shows
        assert abs(float(value) - float(ref_value)) > 1e-6 * abs(float(ref_value))
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == dtype and rel_l2(g, r) < tol


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_dots_kernels_policy_keeps_the_kernels_outputs():
    """Under remat "dots" the backward reruns the KDA forward kernels and the fused attention's
    forward; under "dots_kernels" it does not (as without remat), and the gradients are the same.

    Counted in the compiled program, where XLA has removed what nothing reads: on CPU each
    interpreted Pallas kernel is a `while` loop over its grid."""
    cfg = LingConfig.preset("debug", **GRAD_SHAPE, **FUSED_ATTENTION["pallas"], kda_impl="pallas")
    params = init_params(cfg, seed=1)
    ids = jax.random.randint(jax.random.key(0), (1, 64), 0, cfg.vocab_size)

    def loss(p, remat):
        h = forward_hidden(cfg, p, ids, remat=remat)["final"]
        return jnp.sum(lm_head(cfg, p, h)[..., :8] ** 2)

    loops, grads = {}, {}
    for remat in ("none", "dots", "dots_kernels"):
        compiled = jax.jit(jax.grad(lambda p, remat=remat: loss(p, remat))).lower(params).compile()
        loops[remat] = compiled.as_text().count(" while(")
        grads[remat] = np.concatenate([np.ravel(x) for x in jax.tree.leaves(compiled(params))])
    # rerun under "dots": KDA's 3 forward launches, the attention's forward (and the MoE's row maps)
    assert loops["dots_kernels"] == loops["none"] <= loops["dots"] - 4, loops
    assert rel_l2(grads["dots_kernels"], grads["none"]) < 1e-6 and rel_l2(grads["dots"], grads["none"]) < 1e-6


def test_bias_update_moves_router_toward_balance():
    cfg = LingConfig.preset("debug", **TINY)
    params = init_params(cfg, seed=2)
    skew = jnp.zeros(cfg.num_experts).at[:2].set(0.2)  # experts 0 and 1 win nearly every token
    for seg in params["segments"]:
        for sub in seg.values():
            sub["mlp"]["expert_bias"] = jnp.broadcast_to(skew, sub["mlp"]["expert_bias"].shape)
    ids = jnp.asarray(corpus(60)[: 4 * 64].reshape(4, 64).astype(np.int32))
    counts_fn = jax.jit(lambda p: forward_hidden(cfg, p, ids, expert_counts=True)["expert_counts"])
    first = float(load_stats(counts_fn(params)).mean())
    for _ in range(40):
        params = apply_bias_update(params, {"segments": counts_fn(params), "mtp": []}, rate=0.01)
    last = float(load_stats(counts_fn(params)).mean())
    assert first > 2.5 and last < 0.6 * first, (first, last)


def test_train_step_applies_the_expert_bias_update(tiny):
    """One real step moves every MoE layer's expert_bias, the MTP layer's included, by exactly
    bias_update_rate * sign(mean load - load) of that step's expert counts (no gradient reaches it)."""
    cfg, tcfg, opt, step = tiny
    state = fresh_state(cfg, opt)
    batch = jax.device_put(next(PackedBatches(corpus(50), seq_len=32, batch_size=4, eos_id=1)))
    counts = jax.jit(lambda p, b: loss_terms(cfg, tcfg, p, b)[2])(state["params"], batch)

    def biases(params):
        return [np.asarray(x, np.float64) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
                if path[-1] == jax.tree_util.DictKey("expert_bias")]

    before = biases(state["params"])  # (the step donates the state)
    state, m = step(state, batch)
    assert bool(m["finite"])
    after, loads = biases(state["params"]), [np.asarray(c, np.float64) for c in jax.tree.leaves(counts)]
    assert len(before) == len(loads) == 3  # the MTP layer's, then the KDA and MLA layers' stacks [2, (1,) E]
    for old, new, load in zip(before, after, loads, strict=True):
        assert load.shape == old.shape
        want = tcfg.bias_update_rate * np.sign(load.mean(-1, keepdims=True) - load)
        assert np.any(want != 0)
        np.testing.assert_allclose(new - old, want, rtol=0, atol=1e-9)


@pytest.mark.parametrize("attention", ["xla", pytest.param("pallas", marks=pytest.mark.heavy)])
def test_packing_equals_documents_one_by_one(attention):
    """Per-document loss of a packed sequence == each document run alone (KDA, conv and MLA reset),
    with MLA's materialised softmax and with the fused attention kernels (interpret mode on CPU)."""
    cfg = LingConfig.preset("debug", **TINY, **FUSED_ATTENTION[attention])
    params = init_params(cfg, seed=3)
    docs = [[*range(10, 23), 1], [*range(40, 49), 1], list(range(300, 310))]
    stream = np.asarray([t for d in docs for t in d] + [7], np.uint32)
    packed = PackedBatches(stream, seq_len=len(stream) - 1, batch_size=1, eos_id=1, shuffle=False).window(0)
    assert packed["segment_ids"].max() == 2

    def nll(ids, labels, seg=None):
        seg = None if seg is None else jnp.asarray(seg)[None]
        h = forward_hidden(cfg, params, jnp.asarray(ids)[None], segment_ids=seg)
        logp = jax.nn.log_softmax(lm_head(cfg, params, h["final"])[0])
        lab = np.asarray(labels)
        return np.where(lab != IGNORE, -np.take_along_axis(np.asarray(logp), np.maximum(lab, 0)[:, None], 1)[:, 0], 0)

    per_tok = nll(packed["inputs"], packed["labels"], packed["segment_ids"])
    start = 0
    for d in docs:
        alone = nll(d, [*d[1:], IGNORE])
        got = per_tok[start : start + len(d)]
        np.testing.assert_allclose(got[: len(d) - 1], alone[: len(d) - 1], rtol=2e-5, atol=2e-5)
        start += len(d)
    # without segment ids the second document would see the first: the test can fail
    leaky = nll(packed["inputs"], packed["labels"])
    assert np.abs(leaky[14:22] - per_tok[14:22]).max() > 1e-3


def test_init_random_from_a_config_file(tmp_path, capsys):
    """--init random:PATH.json draws the model of that config.json; a missing file is one error line."""
    from train.main import init_model, main

    path = tmp_path / "m.json"
    path.write_text(json.dumps({**LingConfig.preset("debug").to_hf(), "hidden_size": 32, "vocab_size": 300}))
    cfg, params = init_model(f"random:{path}", "float32", None)
    assert cfg == LingConfig.from_hf(path) and params["embed"].shape == (300, 32)
    data = tmp_path / "d.bin"
    corpus(5).tofile(data)
    rc = main(["--init", f"random:{tmp_path / 'nope.json'}", "--data", str(data), "--out", str(tmp_path / "o"),
               "--steps", "1", "--batch-size", "1", "--seq-len", "16"])
    err = capsys.readouterr().err
    assert rc == 2 and f"no config.json at {tmp_path / 'nope.json'}" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("case, msg, code", [
    ("missing", "--data {tmp}/d.bin: no such file", 2), ("empty", "corpus is empty", 1),
    ("vocab", "token id 9999 at position 3", 1), ("seqlen", "exceeds the model's max_position_embeddings", 2),
    ("batch", "fewer than one batch of 1000", 2), ("mesh", "--mesh: 'dta=2' is not axis=size", 2),
    ("config", "c.json: not valid JSON (Expecting value", 2), ("yaml", "c.yaml: not valid YAML (while parsing", 2),
    ("list", "c.json: expected a mapping of options, got list", 2),
    ("init", "--init 'hf/x': expected random:PRESET, random:PATH.json, hf:DIR or orbax:DIR", 2),
    ("preset", "--init random:nope: unknown preset 'nope'", 2), ("init_dir", "--init {tmp}/none: no such directory", 2),
    ("init_file", "--init {tmp}/d.bin: not a directory", 2), ("tokenizer", "--tokenizer {tmp}/t.json: no such file", 2),
    ("out_file", "--out {tmp}/o: a file, not a run directory", 2), ("not_checkpoint", "no config.json at", 1),
])
def test_bad_input(tmp_path, capsys, case, msg, code):
    """Usage errors exit 2, failures of the run 1, with one line; the --out the run would have made is
    not left behind (a file given as --out stays)."""
    from train.main import main

    data = tmp_path / "d.bin"
    if case not in ("missing", "empty", "vocab"):
        corpus(5).tofile(data)
    if case == "empty":
        data.write_bytes(b"")
    elif case == "vocab":
        np.asarray([1, 2, 3, 9999, 4], np.uint32).tofile(data)
    configs = {"config": ("c.json", "nope"), "yaml": ("c.yaml", "a: [1\n"), "list": ("c.json", "[1, 2]")}
    extra = {"mesh": ["--mesh", "dta=2"], "tokenizer": ["--tokenizer", str(tmp_path / "t.json")]}.get(case, [])
    if case in configs:
        name, text = configs[case]
        (tmp_path / name).write_text(text)
        extra = ["--config", str(tmp_path / name)]
    init = {"init": "hf/x", "preset": "random:nope", "init_dir": f"hf:{tmp_path / 'none'}",
            "init_file": f"orbax:{data}", "not_checkpoint": f"hf:{tmp_path}"}.get(case, "random:debug")
    out = tmp_path / "o"
    if case == "out_file":
        out.write_text("")
    seq, batch = "4096" if case == "seqlen" else "16", "1000" if case == "batch" else "1"
    rc = main(["--init", init, "--data", str(data), "--out", str(out), "--steps", "1", "--batch-size", batch,
               "--seq-len", seq, *extra])
    err = capsys.readouterr().err
    assert rc == code and err.startswith("ling-train: error: ") and err.count("\n") == 1, err
    assert msg.format(tmp=tmp_path) in err, err
    assert out.is_file() if case == "out_file" else not out.exists()


def test_failed_run_removes_only_the_out_it_created(tmp_path, capsys):
    """A run failing before its first checkpoint removes the --out it made (with the parents it made),
    never a directory that was there before it."""
    from train.main import main

    corpus(20).tofile(tmp_path / "d.bin")
    (tmp_path / "empty").mkdir()  # a directory, so the command line is fine; loading it as a model fails
    argv = ["--init", f"hf:{tmp_path / 'empty'}", "--data", str(tmp_path / "d.bin"), "--steps", "1",
            "--batch-size", "1", "--seq-len", "16", "--out"]
    assert main([*argv, str(tmp_path / "new" / "run")]) == 1
    assert "no config.json at" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main([*argv, str(mine)]) == 1
    assert (mine / "notes.txt").read_text() == "mine"


@pytest.mark.heavy
def test_cli_under_a_data_expert_mesh_matches_one_device(tmp_path):
    """ling-train with mesh {data: 2, expert: 4} on 8 simulated devices (MoE experts dispatched over
    the expert axis, batch rows over data x expert; from the config file, or from --mesh over the
    file's one device) gives the single-device losses."""
    data = tmp_path / "corpus.bin"
    corpus(100).tofile(data)
    losses = []
    runs = (("one", {}, []), ("mesh", {"data": 2, "expert": 4}, []), ("flag", {}, ["--mesh", "data=2,expert=4"]))
    for name, mesh, flag in runs:
        cfg_file = tmp_path / f"{name}.json"
        cfg_file.write_text(json.dumps({**TCFG, "batch_size": 8, "seq_len": 32, "mesh": mesh}))
        env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8"}
        proc = subprocess.run(
            [sys.executable, "-m", "train.main", "--init", "random:debug", "--data", str(data), "--out",
             str(tmp_path / name), "--steps", "2", "--config", str(cfg_file), *flag],
            env={**env, "JAX_COMPILATION_CACHE_DIR": SUBPROCESS_CACHE, "JAX_DEFAULT_MATMUL_PRECISION": "highest"},
            capture_output=True, text=True, cwd=Path(__file__).parent.parent, timeout=1200)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert ("running on 1 of 8 devices" in proc.stdout) == (name == "one"), proc.stdout
        losses.append(_losses(tmp_path / name))
    assert losses[0].keys() == losses[1].keys() == losses[2].keys() == {1, 2}
    for step in (1, 2):
        assert abs(losses[0][step] - losses[1][step]) < 1e-4 * abs(losses[0][step]), losses
    assert losses[1] == losses[2]


@pytest.mark.heavy
def test_gradients_through_pallas_kda_path():
    """Full-model gradients through the Pallas KDA kernels (interpret mode on CPU, custom VJP)
    equal those through the token-by-token reference."""
    grads = []
    for impl in ("pallas", "reference"):
        cfg = LingConfig.preset("debug", **GRAD_SHAPE, kda_impl=impl)
        g = jax.jit(jax.grad(lambda p, cfg=cfg: grad_loss(p, cfg)))(init_params(cfg, seed=1))
        grads.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]))
    assert rel_l2(*grads) < 1e-5


@pytest.mark.heavy
def test_gradients_through_fused_attention():
    """Full-model gradients (packed batch: documents reset MLA) through the fused MLA attention
    kernels (interpret mode on CPU, custom VJP) equal those through the materialised softmax.

    Heavy (its own pytest process in CI): late in the default suite's process, XLA:CPU segfaulted
    compiling this step (twice at 8500dc4, with a fresh and a warm compilation cache); alone, in
    subsets of the suite and in the heavy run it passes. Root cause not found."""
    grads = []
    for impl in ("pallas", "xla"):
        cfg = LingConfig.preset("debug", **GRAD_SHAPE, **FUSED_ATTENTION[impl], kda_impl="chunked")
        g = jax.jit(jax.grad(lambda p, cfg=cfg: grad_loss(p, cfg)))(init_params(cfg, seed=1))
        grads.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]))
    assert rel_l2(*grads) < 1e-5


@pytest.mark.heavy
def test_gradient_accumulation_equals_one_big_batch():
    """grad_accum=2 over 2 micro-batches == one step on the whole batch (losses, params, expert bias)."""
    cfg = LingConfig.preset("debug", **TINY)
    batch = jax.device_put(next(PackedBatches(corpus(100), seq_len=32, batch_size=4, eos_id=1)))
    outs = []
    for accum in (1, 2):
        tcfg = TrainConfig(**{**TCFG, "grad_accum": accum})
        opt = make_optimizer(cfg, tcfg)
        state, m = jax.jit(make_train_step(cfg, tcfg, opt))(fresh_state(cfg, opt), batch)
        outs.append((float(m["loss"]), np.concatenate([np.ravel(x) for x in jax.tree.leaves(state["params"])])))
    assert abs(outs[0][0] - outs[1][0]) < 1e-5 * outs[0][0]
    assert rel_l2(outs[1][1], outs[0][1]) < 1e-6

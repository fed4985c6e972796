"""The serving engine: every request's tokens equal `generate` of its prompt alone (float32), under
concurrency, chunked prefill, page reuse and cancellation; memory follows the tokens held; serving
compiles nothing after warm-up."""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ling_jax
from ling_jax.config import LingConfig
from ling_jax.engine import Engine, QueueFull, SamplingParams
from ling_jax.params import init_params


@pytest.fixture(scope="module")
def model():
    cfg = LingConfig.preset("debug")
    return cfg, init_params(cfg, seed=3)


def _reference(cfg, params, prompts, max_tokens, **kw):
    """`generate` of each prompt alone (batched: a prompt's tokens do not depend on its batch), greedy
    without stopping unless `kw` says otherwise, each cut to its own max_tokens."""
    out = ling_jax.generate(cfg, params, prompts, max_new_tokens=max(max_tokens), stop_tokens=kw.pop("stop", ()),
                            **kw)
    return [o[:m] for o, m in zip(out, max_tokens, strict=True)]


def _prompts(rng, cfg, n, lo, hi):
    return [rng.integers(0, cfg.vocab_size, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _concurrent(engine, prompts, max_tokens, concurrency, sampling=None):
    """Submits the requests from `concurrency` client threads, each waiting for its request before the
    next: the tokens of each request, in order."""
    results = [None] * len(prompts)
    nxt = iter(range(len(prompts)))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            sp = sampling(i) if sampling else SamplingParams(max_tokens=max_tokens[i], ignore_eos=True)
            results[i] = engine.submit(prompts[i], sp).result()

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _serve(engine):
    engine.start()
    return engine


@pytest.mark.parametrize("n,concurrency", [(24, 8), pytest.param(200, 32, marks=pytest.mark.heavy)])
def test_tokens_equal_generate_under_concurrency(model, n, concurrency):
    """Requests of random lengths from more clients than slots, greedy with ignore_eos: each one's tokens
    are `generate`'s for its prompt alone. Prompts longer than a chunk are prefilled in several chunks
    between other requests' decode steps; slots and pages are reused."""
    cfg, params = model
    rng = np.random.default_rng(n)
    prompts = _prompts(rng, cfg, n, 1, 90)
    max_tokens = [int(m) for m in rng.integers(1, 20, n)]
    engine = _serve(Engine(cfg, params, max_batch=8, max_len=128, page_size=16, prefill_chunk=32, decode_steps=4))
    try:
        got = _concurrent(engine, prompts, max_tokens, concurrency)
        stats = engine.stats()
    finally:
        engine.shutdown(5)
    assert got == _reference(cfg, params, prompts, max_tokens)
    assert stats["running"] == 0 and stats["pages_used"] == 0 and stats["requests_total"] == n
    assert stats["generation_tokens_total"] == sum(max_tokens)


def test_golden_greedy_tokens(golden_a):
    """The reference's greedy tokens come back through the engine."""
    cfg, params, g = golden_a
    engine = _serve(Engine(cfg, params, max_batch=2, max_len=64, page_size=16, prefill_chunk=16))
    try:
        hs = [engine.submit(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in g["decode_prompt_ids"]]
        assert [h.result() for h in hs] == g["decode_generated_ids"].tolist()
    finally:
        engine.shutdown(5)


def test_seeded_sampling_is_the_requests_own(model):
    """A seeded sampled request draws the same tokens alone and beside other requests (other seeds,
    greedy rows, other filters), and the same as `generate` with that seed."""
    cfg, params = model
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, cfg.vocab_size, 11).tolist()
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_k=30, top_p=0.9, seed=7, ignore_eos=True)
    engine = _serve(Engine(cfg, params, max_batch=4, max_len=64, page_size=16, prefill_chunk=16))
    try:
        alone = engine.submit(prompt, sp).result()
        others = [engine.submit(p, SamplingParams(max_tokens=12, temperature=t, seed=s, ignore_eos=True))
                  for p, t, s in zip(_prompts(rng, cfg, 3, 2, 30), (0.0, 1.3, 0.5), (1, 2, 3), strict=True)]
        beside = engine.submit(prompt, sp)
        assert beside.result() == alone
        for h in others:
            h.result()
        assert engine.submit(prompt, dataclasses.replace(sp, seed=8)).result() != alone
    finally:
        engine.shutdown(5)
    assert alone == ling_jax.generate(cfg, params, [prompt], max_new_tokens=10, temperature=0.9, top_k=30,
                                      top_p=0.9, seed=7, stop_tokens=())[0]


def test_pages_follow_the_tokens_held(model):
    """Between loop iterations the pages in use are each running request's tokens rounded up to a page;
    a prompt longer than the token budget is prefilled in chunks while the running requests decode."""
    cfg, params = model
    k = 16
    engine = Engine(cfg, params, max_batch=4, max_len=160, page_size=k, prefill_chunk=32, decode_steps=3)
    rng = np.random.default_rng(2)
    short = [engine.submit(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in _prompts(rng, cfg, 2, 3, 20)]
    for _ in range(4):
        engine._iterate()
    long = engine.submit(rng.integers(0, cfg.vocab_size, 100).tolist(), SamplingParams(max_tokens=5, ignore_eos=True))
    seen = []
    while not long.finished:
        engine._iterate()
        held = [s.length for s in engine.slots if s is not None]
        assert engine.stats()["pages_used"] == sum(math.ceil(n / k) for n in held)
        seen.append((engine.counters["prefill_chunks_total"], sum(len(h.tokens) for h in short)))
    chunks = [c for c, _ in seen]
    # the long prompt took 4 chunks (100 tokens, 32 at a time), each iteration the short ones decoded
    assert chunks[-1] - chunks[0] >= 3
    assert all(b[1] > a[1] for a, b in itertools.pairwise(seen) if b[0] > a[0] and not short[0].finished)
    while not all(h.finished for h in short):
        engine._iterate()
    assert engine.stats()["pages_used"] == 0


@pytest.mark.parametrize("logprobs", [True, False])
def test_no_compiles_after_warmup(model, logprobs):
    """After `warmup`, requests of every prompt length, with and without log-probabilities, greedy and
    sampled, compile nothing; after `warmup(logprobs=False)`, those without log-probabilities."""
    cfg, params = model
    engine = Engine(cfg, params, max_batch=3, max_len=96, page_size=16, prefill_chunk=32, decode_steps=4)
    engine.warmup(logprobs=logprobs)
    compiles = []

    def listener(event, duration, **_):
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        _serve(engine)
        rng = np.random.default_rng(4)
        hs = [engine.submit(p, SamplingParams(max_tokens=int(m), temperature=float(t), seed=1, ignore_eos=True,
                                              logprobs=lp, prompt_logprobs=plp))
              for p, m, t, lp, plp in zip(_prompts(rng, cfg, 8, 1, 80), rng.integers(1, 12, 8),
                                          (0, 0.7, 0, 1.0, 0, 0.3, 0, 2.0),
                                          (None, 2, None, None, 5, None, 0, None) if logprobs else (None,) * 8,
                                          (None, None, 1, None, None, 0, None, None) if logprobs else (None,) * 8,
                                          strict=True)]
        for h in hs:
            h.result()
    finally:
        engine.shutdown(5)
        jax.monitoring.clear_event_listeners()
    assert not compiles, compiles


def test_logprobs_match_the_forward(model):
    """Log-probabilities of the new tokens and of the prompt tokens (with the top alternatives) are
    the model's: log_softmax of `forward`'s logits at each position."""
    cfg, params = model
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, cfg.vocab_size, 37).tolist()
    engine = _serve(Engine(cfg, params, max_batch=2, max_len=64, page_size=16, prefill_chunk=16))
    try:
        h = engine.submit(prompt, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2))
        outs = list(h)
        scored = engine.submit(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
        assert scored.result() == [] and scored.finish_reason == "length"
    finally:
        engine.shutdown(5)
    seq = prompt + [o.token_id for o in outs]
    lp = np.asarray(jax.nn.log_softmax(ling_jax.forward(cfg, params, jnp.asarray([seq]))[0], axis=-1))
    for j, o in enumerate(outs):
        row = lp[len(prompt) - 1 + j]
        assert o.logprob == pytest.approx(row[o.token_id], abs=1e-4)
        assert [t for t, _ in o.top_logprobs] == np.argsort(-row)[:3].tolist()
    assert h.prompt_logprobs[0].logprob is None and len(h.prompt_logprobs) == len(prompt)
    for i, o in enumerate(h.prompt_logprobs[1:], start=1):
        assert o.token_id == prompt[i] and o.logprob == pytest.approx(lp[i - 1, prompt[i]], abs=1e-4)
        assert len(o.top_logprobs) == 2
    assert [o.logprob for o in scored.prompt_logprobs] == [o.logprob for o in h.prompt_logprobs]


def test_stop_cancel_and_limits(model):
    """A stop token ends a request (included); cancellation frees the slot for the queue; bad input is
    refused at submission with a message; a full queue raises QueueFull; after shutdown nothing is
    admitted."""
    cfg, params = model
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, cfg.vocab_size, 9).tolist()
    free = _reference(cfg, params, [prompt], [12])[0]
    engine = Engine(cfg, params, max_batch=1, max_len=64, page_size=16, prefill_chunk=16, max_waiting=2)
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="token id 512 outside"):
        engine.submit([1, 512], SamplingParams())
    with pytest.raises(ValueError, match="exceed max_len=64"):
        engine.submit([1] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="top_p"):
        engine.submit([1], SamplingParams(top_p=0.0))
    stopped = engine.submit(prompt, SamplingParams(max_tokens=12, stop_token_ids=(free[4],)))
    blocked = engine.submit(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    with pytest.raises(QueueFull):
        engine.submit(prompt, SamplingParams())
    _serve(engine)
    try:
        assert stopped.result() == free[: free.index(free[4]) + 1] and stopped.finish_reason == "stop"
        first = next(iter(blocked))
        engine.cancel(blocked)
        assert blocked.finish_reason == "cancelled" or blocked.result() is not None
        assert first.token_id == free[0]
        after = engine.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        assert after.result() == free[:3]
    finally:
        engine.shutdown(5)
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit(prompt, SamplingParams())
    assert engine.stats()["pages_used"] == 0


def test_next_call_dispatched_before_reading_the_last(model):
    """While requests decode, each decode call is dispatched before the host reads the previous call's
    tokens (the device runs call n + 1 while the host delivers call n's), and the tokens are still
    `generate`'s."""
    cfg, params = model
    events = []

    class Recorded(Engine):
        def _decode(self, *args):
            cache, out = super()._decode(*args)
            events.append(("dispatch", id(out)))
            return cache, out

        def _deliver(self, out, *args):
            events.append(("read", id(out)))
            super()._deliver(out, *args)

    rng = np.random.default_rng(8)
    prompts = _prompts(rng, cfg, 3, 5, 30)
    engine = _serve(Recorded(cfg, params, max_batch=4, max_len=64, page_size=16, prefill_chunk=16, decode_steps=2))
    try:
        got = [h.result() for h in [engine.submit(p, SamplingParams(max_tokens=9, ignore_eos=True)) for p in prompts]]
    finally:
        engine.shutdown(5)
    assert got == _reference(cfg, params, prompts, [9] * 3)
    order = [e for e, _ in events]
    reads = [i for i, (e, _) in enumerate(events) if e == "read"]
    dispatches = {o: i for i, (e, o) in enumerate(events) if e == "dispatch"}
    assert len(reads) == order.count("dispatch") >= 4
    for i in reads[:-1]:  # every read but the last comes after the next call was dispatched
        assert events[i - 1][0] == "dispatch" and dispatches[events[i][1]] < i - 1

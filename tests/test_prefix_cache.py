"""The engine's prefix cache: requests that reuse cached prompt pages and KDA snapshots give the tokens
of `generate` (float32), at every reuse depth, across evictions and under concurrent sharing; the
index's bookkeeping (hits, pins, leaf-first eviction) and its memory bound."""

from __future__ import annotations

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ling_jax
from ling_jax.config import LingConfig
from ling_jax.decode.verify import prefill_speculative
from ling_jax.engine import Engine, SamplingParams
from ling_jax.engine.prefix import Hit, PrefixIndex, page_keys
from ling_jax.kernels import select
from ling_jax.params import init_params

K = 4  # tokens per page in these tests


@pytest.fixture(scope="module")
def model():
    cfg = LingConfig.preset("debug")
    return cfg, init_params(cfg, seed=11)


def _greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _expected(cfg, params, prompts, n):
    return ling_jax.generate(cfg, params, prompts, max_new_tokens=n, stop_tokens=())


def _run(engine, prompts, n):
    """Starts the engine, then each prompt in turn (the next one submitted after the last finished),
    then shuts it down: [(tokens, cached_tokens)]."""
    engine.start()
    try:
        return [(h.result(), h.cached_tokens) for h in (engine.submit(p, _greedy(n)) for p in prompts)]
    finally:
        engine.shutdown(5)


def test_reuse_at_every_depth_equals_generate(model):
    """A base prompt, then prompts sharing 0 .. all of it (on and off page, chunk and snapshot
    boundaries): every request's tokens are `generate`'s, and each reuses the deepest cached boundary
    below its last token that has a snapshot."""
    cfg, params = model
    rng = np.random.default_rng(0)
    base = rng.integers(0, cfg.vocab_size, 43).tolist()
    # snapshots of the base: every 2 pages (8, 16, .., 40) and the last boundary below its last token (40)
    shared = [0, 3, 4, 7, 8, 9, 16, 17, 23, 24, 40, 41, 42, 43]
    prompts = [base] + [base[:m] + rng.integers(0, cfg.vocab_size, 6).tolist() for m in shared] + [base]
    engine = Engine(cfg, params, max_batch=2, max_len=96, page_size=K, prefill_chunk=16, prefix_cache=True,
                    prefix_cache_gb=0.01, snapshot_pages=2)
    got = _run(engine, prompts, 6)
    assert [t for t, _ in got] == _expected(cfg, params, prompts, 6)
    cached = [c for _, c in got]
    assert cached[0] == 0 and cached[-1] == 40  # the repeat restores the snapshot at 40 and runs 41..43
    for m, c in zip(shared, cached[1:-1], strict=True):
        # the deepest snapshot of the base at or below both the shared part and the new prompt's last token
        assert c == max([b for b in (*range(8, 41, 8), 40) if b <= m] or [0]), (m, c)
    stats = engine.stats()
    assert stats["prefix_hits"] == sum(c > 0 for c in cached) and stats["prefix_cached_tokens"] == sum(cached)


def test_logprobs_equal_the_cache_off(model):
    """The log-probabilities (and top alternatives) of the new tokens of requests served from the
    cache are those of the same requests with the cache off."""
    cfg, params = model
    rng = np.random.default_rng(4)
    base = rng.integers(0, cfg.vocab_size, 37).tolist()
    prompts = [base, [*base[:30], 5, 6], [*base, 7], [*base[:17], 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    sampling = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3)
    outs = {}
    for on in (False, True):
        engine = Engine(cfg, params, max_batch=1, max_len=64, page_size=K, prefill_chunk=16, prefix_cache=on,
                        prefix_cache_gb=0.01, snapshot_pages=2)
        engine.start()
        try:
            hs = [engine.submit(p, sampling) for p in prompts]
            outs[on] = [(list(h), h.cached_tokens) for h in hs]
        finally:
            engine.shutdown(5)
    assert [c for _, c in outs[True]] == [0, 24, 36, 16]
    for (off, _), (on, _) in zip(outs[False], outs[True], strict=True):
        assert [o.token_id for o in on] == [o.token_id for o in off]
        for a, b in zip(on, off, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            np.testing.assert_allclose([v for _, v in a.top_logprobs], [v for _, v in b.top_logprobs], atol=1e-5)


@pytest.mark.parametrize("rows", [1, pytest.param(3, marks=pytest.mark.heavy)])
def test_sharing_under_concurrency_equals_generate(model, rows):
    """Many clients whose prompts share a few system prefixes (some of them long enough to be
    prefilled in several chunks), with more clients than slots, `rows` prompts per prefill call at
    most: every request's tokens are `generate`'s; after they finish no page is read by anyone and the
    pool holds only cached pages."""
    cfg, params = model
    rng = np.random.default_rng(1)
    systems = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (13, 30, 52)]
    prompts = [systems[i % 3] + rng.integers(0, cfg.vocab_size, int(rng.integers(1, 9))).tolist() for i in range(18)]
    n = [int(m) for m in rng.integers(1, 10, len(prompts))]
    engine = Engine(cfg, params, max_batch=4, max_len=80, page_size=K, prefill_chunk=16, decode_steps=3,
                    prefix_cache=True, prefix_cache_gb=0.01, snapshot_pages=3, prefill_rows=rows)
    engine.start()
    results: list = [None] * len(prompts)
    nxt = iter(range(len(prompts)))
    lock = threading.Lock()

    def client():
        while (i := _next(nxt, lock)) is not None:
            h = engine.submit(prompts[i], _greedy(n[i]))
            results[i] = (h.result(), h.cached_tokens)

    _run_clients(engine, [threading.Thread(target=client) for _ in range(6)])
    want = _expected(cfg, params, prompts, max(n))
    assert [r[0] for r in results] == [w[:m] for w, m in zip(want, n, strict=True)]
    assert sum(r[1] > 0 for r in results) >= 9  # most requests found their system prompt cached
    index = engine.prefix
    assert all(r == 0 for r in index.refs.values()) and not index.pinned
    assert engine.stats()["pages_used"] == len(index.pages)


@pytest.mark.parametrize("outputs", [True, pytest.param(False, marks=pytest.mark.heavy)],
                         ids=["outputs-cached", "prompts-only"])
def test_multi_turn_reuses_the_reply_and_equals_generate(model, outputs):
    """Conversations of 4 turns from 3 clients over 2 slots (decode buckets 1 and 2), each turn's prompt
    the last prompt, its reply and 1-6 new tokens: every turn's tokens are `generate`'s of its prompt
    alone. With output snapshots each later turn reuses the last prompt and the reply up to the page
    boundary below the reply's last token, or (every other turn, whose prompt + n ends on a page) the
    end of the reply; with prompt snapshots only, at most the last prompt's boundary below its last
    token."""
    cfg, params = model
    rng = np.random.default_rng(21)
    firsts = [rng.integers(0, cfg.vocab_size, int(m)).tolist() for m in (5, 9, 14)]
    news = [[rng.integers(0, cfg.vocab_size, int(rng.integers(1, 7))).tolist() for _ in range(3)] for _ in firsts]
    lens = [[int(m) for m in rng.integers(4, 11, 4)] for _ in firsts]  # odd turns: up to a page boundary
    engine = Engine(cfg, params, max_batch=2, max_len=112, page_size=K, prefill_chunk=16, decode_steps=3,
                    decode_buckets=[1], prefix_cache=True, prefix_cache_gb=0.01, snapshot_pages=2,
                    cache_outputs=outputs)
    engine.start()
    turns: list = [[] for _ in firsts]  # (prompt, tokens, cached_tokens) per turn

    def client(c: int):
        prompt = firsts[c]
        for t in range(4):
            n = lens[c][t] if t % 2 == 0 else 4 + (-len(prompt)) % K
            h = engine.submit(prompt, _greedy(n))
            turns[c].append((prompt, h.result(), h.cached_tokens))
            if t < 3:
                prompt = prompt + h.result() + news[c][t]

    _run_clients(engine, [threading.Thread(target=client, args=(c,)) for c in range(len(firsts))])
    for conv in turns:
        prompts = [p for p, _, _ in conv]
        want = _expected(cfg, params, prompts, 10)
        assert [tok for _, tok, _ in conv] == [w[:len(tok)] for w, (_, tok, _) in zip(want, conv, strict=True)]
        for (prev, out, _), (prompt, _, cached) in itertools.pairwise(conv):
            below = (len(prompt) - 1) // K * K  # a hit leaves the last token to prefill
            if outputs:
                end = len(prev) + len(out)
                want = end if end % K == 0 else (end - 1) // K * K
                assert cached == min(want, below), (len(prev), len(out), len(prompt), cached)
            else:
                assert cached <= (len(prev) - 1) // K * K
    if outputs:
        assert engine.stats()["prefix_output_snapshots"] > 0
    assert all(r == 0 for r in engine.prefix.refs.values()) and not engine.prefix.pinned
    assert engine.stats()["pages_used"] == len(engine.prefix.pages)  # the pool holds cached pages only


def test_decode_call_snapshots_only_the_rows_named(model):
    """A decode call of 3 steps over 2 slots taking output snapshots of slot 1 after step 0 and of slot 0
    after step 2: those two store rows hold the states a 1-step and a 3-step call leave in those slots,
    and every other store row is unchanged (the steps without a snapshot write nowhere)."""
    cfg, params = model
    engine = Engine(cfg, params, max_batch=2, max_len=32, page_size=K, prefill_chunk=16, decode_steps=3,
                    prefix_cache=True, prefix_cache_gb=0.001)
    rng = np.random.default_rng(5)
    noise = lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype)  # noqa: E731
    segments = jax.tree_util.tree_map_with_path(lambda path, a: a if path[-1].key == "pages" else noise(a),
                                                engine.cache["segments"])
    engine.cache = {**engine.cache, "lengths": jnp.asarray([5, 9], jnp.int32), "segments": segments}
    engine.store = {**engine.store, "segments": jax.tree.map(noise, engine.store["segments"])}
    store0, cache0 = jax.tree.map(np.asarray, engine.store), jax.tree.map(np.asarray, engine.cache)
    table, follow = np.asarray([[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 6, 0, 0, 0, 0, 0]], np.int32), np.zeros(2, bool)

    def run(steps, snaps):
        engine.cache = jax.tree.map(jnp.asarray, cache0)
        cache, _ = engine._decode(steps, False, table[:, :engine.max_pages], follow, snaps)
        return jax.tree.map(np.asarray, cache)

    after1, after3 = run(1, []), run(3, [])
    engine.store = jax.tree.map(jnp.asarray, store0)
    run(3, [(1, 0, 0, 2), (0, 0, 2, 4)])  # (slot, boundary, step, store row)
    for (path, got), want, one, three in zip(jax.tree_util.tree_leaves_with_path(engine.store["segments"]),
                                             jax.tree.leaves(store0["segments"]),
                                             jax.tree.leaves(after1["segments"]),
                                             jax.tree.leaves(after3["segments"]), strict=True):
        if path[-1].key == "pages":
            continue
        axis = got.ndim - {"state": 4, "conv": 3}[path[-1].key]
        got, want = np.moveaxis(np.asarray(got), axis, 0), np.moveaxis(want, axis, 0)
        np.testing.assert_array_equal(got[2], np.moveaxis(one, axis, 0)[1])
        np.testing.assert_array_equal(got[4], np.moveaxis(three, axis, 0)[0])
        rest = [r for r in range(got.shape[0]) if r not in (2, 4)]
        np.testing.assert_array_equal(got[rest], want[rest])


@pytest.mark.heavy  # 12-17 s on 2 cores (default suite kept under 20 min)
def test_next_turn_waits_for_the_reply_snapshot_in_flight(model):
    """One step per call: a reply that ends on a page boundary (6 + 6 tokens, pages of 4) feeds its last
    token in the call after the one that samples it, so when the request ends that call is still in
    flight and its pages wait for it; the next turn, submitted right then, is admitted a round later
    and reuses all 12 tokens (not the 8 of the reply's previous boundary), with `generate`'s tokens."""
    cfg, params = model
    rng = np.random.default_rng(31)
    first = rng.integers(0, cfg.vocab_size, 6).tolist()
    engine = Engine(cfg, params, max_batch=2, max_len=64, page_size=K, prefill_chunk=16, decode_steps=1,
                    prefix_cache=True, prefix_cache_gb=0.01)
    h = engine.submit(first, _greedy(6))
    while not h.finished:
        engine._iterate()
    assert engine._draining and engine.pool.used > len(engine.prefix.pages)
    second = first + h.result() + rng.integers(0, cfg.vocab_size, 3).tolist()
    h2 = engine.submit(second, _greedy(5))
    while not h2.finished:
        engine._iterate()
    assert h2.cached_tokens == 12 and h2.result() == _expected(cfg, params, [second], 5)[0]
    engine._iterate()  # the call in flight read: nothing waits, the pool holds cached pages only
    assert not engine._draining and engine.pool.used == len(engine.prefix.pages)


def _run_clients(engine, threads):
    """Runs the client threads to their end, then shuts the (started) engine down."""
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.shutdown(5)


def _next(it, lock):
    with lock:
        return next(it, None)


def test_eviction_and_rebuild_equal_generate(model):
    """A pool and snapshot store too small to keep every prefix: cached pages and snapshots are
    evicted (least recently used first) to admit new requests, evicted prefixes are rebuilt when
    their prompts return, and every request's tokens are still `generate`'s (prompt snapshots only, so
    that which prefix is evicted when is known)."""
    cfg, params = model
    rng = np.random.default_rng(2)
    systems = [rng.integers(0, cfg.vocab_size, 24).tolist() for _ in range(4)]
    order = [0, 1, 2, 3, 0, 1, 0, 2, 3, 3, 1]
    prompts = [systems[i] + rng.integers(0, cfg.vocab_size, 3).tolist() for i in order]
    probe = Engine(cfg, params, max_batch=1, max_len=40, page_size=K, prefix_cache=True, prefix_cache_gb=1e-3)
    row = probe.prefix_bytes // len(probe.prefix.free_rows)
    # 2 requests' worth of pages (10 each) + page 0; two snapshot rows
    engine = Engine(cfg, params, max_batch=1, max_len=40, page_size=K, num_pages=21, prefill_chunk=16,
                    prefix_cache=True, prefix_cache_gb=2.5 * row / 1e9, cache_outputs=False)
    assert engine.prefix_bytes == 2 * row and engine.prefix_bytes <= 2.5 * row
    got = _run(engine, prompts, 5)
    assert [t for t, _ in got] == _expected(cfg, params, prompts, 5)
    stats = engine.stats()
    assert stats["prefix_page_evictions"] > 0 and stats["prefix_snapshot_evictions"] > 0
    assert stats["prefix_snapshots"] <= 2 and stats["pages_used"] <= 20
    cached = [c for _, c in got]
    assert cached[4] == 0 and cached[6] == 24  # system 0 was evicted by 2 and 3, then rebuilt and reused
    assert cached[9] == 24  # 3 right after 3


@pytest.mark.heavy  # (default suite kept well under 20 min on 2 cores)
def test_a_request_waiting_for_pages_is_counted_once(model):
    """A request that hits a cached prefix but waits for pages (the pool holds one request) is looked up
    again at every admission attempt, and counted once, when admitted: hits, misses and cached tokens
    are those of the requests."""
    cfg, params = model
    rng = np.random.default_rng(4)
    system = rng.integers(0, cfg.vocab_size, 24).tolist()
    prompts = [system + rng.integers(0, cfg.vocab_size, 3).tolist() for _ in range(2)]
    # one request of 27 + 12 tokens holds 10 pages: the second waits until the first ends
    engine = Engine(cfg, params, max_batch=2, max_len=40, page_size=K, num_pages=11, prefill_chunk=16,
                    decode_steps=1, prefix_cache=True, prefix_cache_gb=0.01)
    first = engine.submit(prompts[0], _greedy(12))
    while first.first_token_at is None:  # its prompt prefilled: pages and snapshot cached
        engine._iterate()
    second = engine.submit(prompts[1], _greedy(12))
    engine.start()
    try:
        assert second.result() == _expected(cfg, params, [prompts[1]], 12)[0] and first.result()
    finally:
        engine.shutdown(5)
    stats = engine.stats()
    assert second.cached_tokens == 24 and engine.counters["decode_calls_total"] > 3
    assert (stats["prefix_hits"], stats["prefix_misses"], stats["prefix_cached_tokens"]) == (1, 1, 24)


@pytest.mark.heavy  # 12-17 s on 2 cores (default suite kept under 20 min)
def test_a_miss_waiting_for_pages_is_admitted_later(model):
    """Two prompts with nothing cached and a pool for one request: the second misses, waits for pages and
    is admitted when the first ends; both give `generate`'s tokens."""
    cfg, params = model
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, cfg.vocab_size, 27).tolist() for _ in range(2)]
    engine = Engine(cfg, params, max_batch=2, max_len=40, page_size=K, num_pages=11, prefill_chunk=16,
                    prefix_cache=True, prefix_cache_gb=0.01)
    hs = [engine.submit(p, _greedy(12)) for p in prompts]
    engine.start()
    try:
        assert [h.result() for h in hs] == _expected(cfg, params, prompts, 12)
    finally:
        engine.shutdown(5)
    assert engine.stats()["prefix_misses"] == 2


@pytest.mark.heavy  # 12-17 s on 2 cores (default suite kept under 20 min)
def test_prompt_logprobs_bypass_the_cache(model):
    """A request asking for prompt log-probabilities runs its whole prompt (cached_tokens 0) and gets
    one per prompt token; greedy tokens are the same either way."""
    cfg, params = model
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, cfg.vocab_size, 21).tolist()
    engine = Engine(cfg, params, max_batch=1, max_len=40, page_size=K, num_pages=21, prefix_cache=True,
                    prefix_cache_gb=0.01)
    engine.start()
    try:
        first = engine.submit(prompt, _greedy(4))
        first.result()
        scored = engine.submit(prompt, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1))
        again = engine.submit(prompt, _greedy(4))
        assert scored.result() == again.result() == first.result()
    finally:
        engine.shutdown(5)
    assert scored.cached_tokens == 0 and len(scored.prompt_logprobs) == len(prompt)
    assert again.cached_tokens == 20


@pytest.mark.heavy  # 25-45 s on 2 cores (default suite kept under 20 min)
@pytest.mark.parametrize("rows", [1, 2])
def test_speculative_reuse_equals_generate(model, rows):
    """With MTP speculation (k = 2), requests that reuse cached pages (their MTP rows with them) and
    snapshots (with the main hidden state at the boundary) at several depths, in chunks: before every
    speculative call each decoding row's MTP rows of the positions before its last accepted tokens are
    `prefill_speculative`'s rows of its tokens so far (those the chunks wrote, shared pages' included,
    then those the calls wrote); greedy tokens are `generate`'s and seeded sampled ones
    `generate(..., speculative_tokens=2, seed=...)`'s."""
    cfg, params = model
    k, bucket = 2, 64
    rng = np.random.default_rng(5)
    base = rng.integers(0, cfg.vocab_size, 30).tolist()
    prompts = [base] + [base[:m] + rng.integers(0, cfg.vocab_size, 5).tolist() for m in (4, 9, 16, 29, 30)] + [base]
    kernels = select(cfg, dtype=params["embed"].dtype, inference=True)
    checked = []

    class Checked(Engine):
        def _speculate(self, want_lp, table, active):
            pages = np.asarray(self.drafting["pages"])
            for i, s in active:
                seq = np.concatenate([s.prompt, s.handle.tokens]).astype(np.int32)
                ids = np.zeros((1, bucket), np.int32)
                ids[0, :len(seq)] = seq
                *_, want = prefill_speculative(cfg, kernels, params, ids, np.array([len(seq)]), bucket)
                n = s.length - len(s.fresh or [s.last])  # positions whose rows are final
                rows = pages[table[i]].reshape(-1, pages.shape[-1])[1:n + 1]  # page slot t + 1: position t
                np.testing.assert_allclose(rows, np.asarray(want)[0, :n], rtol=1e-4, atol=1e-4)
                checked.append(n)
            return super()._speculate(want_lp, table, active)

    engine = Checked(cfg, params, max_batch=2, max_len=bucket - k, page_size=K, prefill_chunk=8, prefix_cache=True,
                     prefix_cache_gb=0.01, snapshot_pages=2, speculative_tokens=k, prefill_rows=rows)
    got = {}
    for mode in ("greedy", "sampled"):
        sampling = [SamplingParams(max_tokens=7, ignore_eos=True, **({"temperature": 1.0, "seed": i}
                                                                       if mode == "sampled" else {}))
                    for i in range(len(prompts))]
        hs = [engine.submit(p, sp) for p, sp in zip(prompts, sampling, strict=True)]
        while not all(h.finished for h in hs):
            engine._iterate()
        got[mode] = ([h.result() for h in hs], [h.cached_tokens for h in hs])
    assert got["greedy"][0] == _expected(cfg, params, prompts, 7)
    assert got["sampled"][0] == ling_jax.generate(cfg, params, prompts, max_new_tokens=7, stop_tokens=(),
                                                  temperature=1.0, seed=list(range(len(prompts))),
                                                  speculative_tokens=k)
    assert sum(c > 0 for c in got["greedy"][1] + got["sampled"][1]) >= 8
    assert len(checked) > 20 and max(checked) > 30


def test_index_bookkeeping():
    """Lookup finds the deepest prefix with every page and a snapshot; acquired pages are not evicted;
    a pinned snapshot row is not reused; eviction takes a prefix's later pages before its earlier
    ones and drops the snapshots past an evicted page."""
    index = PrefixIndex(page_size=2, snapshot_rows=2)
    a = [1, 2, 3, 4, 5, 6, 7]  # 3 full pages
    keys = page_keys(a, 2)
    assert keys == page_keys([*a[:6], 9], 2) and keys[:1] != page_keys([1, 3], 2)
    assert index.add_pages(keys, [10, 11, 12]) == [10, 11, 12]
    assert index.release([10, 11, 12]) == [] and index.evictable() == 3  # their request ends
    assert index.lookup(np.array(a)) == Hit()  # pages but no snapshot
    r1 = index.snapshot_row(keys[0])
    r2 = index.snapshot_row(keys[2])
    assert index.snapshot_row(keys[2]) is None  # already there
    assert index.lookup(np.array(a)) == Hit(6, [10, 11, 12], r2)
    assert index.lookup(np.array(a[:6])) == Hit(2, [10], r1)  # the last token is always run
    hit = index.lookup(np.array([*a, 8]))
    index.acquire(hit)
    assert hit.row == r2 and index.evict(3) == []  # every page is read
    assert index.snapshot_row(keys[1]) == r1 and keys[0] not in index.snapshots  # r2 is pinned: r1 goes
    b = [1, 2, 9, 9]  # shares page 0 with a
    keys_b = page_keys(b, 2)
    assert index.add_pages(keys_b, [10, 13]) == [13]
    assert index.snapshot_row(keys_b[1]) == r1  # still not r2
    index.restored(hit.row)
    index.release(hit.pages)
    assert index.evict(1) == [12] and keys[2] not in index.snapshots  # a's deepest page first, its snapshot
    assert index.evict(1) == [11]  # then the next deepest (page 0 was used with b, after a's pages)
    assert index.counters["prefix_snapshot_evictions"] == 2 and index.counters["prefix_page_evictions"] == 2
    assert index.release([10, 99]) == [99]  # a page not in the index is the caller's to free


def test_prefix_cache_arguments(model):
    cfg, params = model
    with pytest.raises(ValueError, match="holds no KDA snapshot"):
        Engine(cfg, params, max_batch=1, max_len=40, page_size=K, prefix_cache=True, prefix_cache_gb=1e-9)
    with pytest.raises(ValueError, match="snapshot_pages=0"):
        Engine(cfg, params, max_batch=1, max_len=40, page_size=K, prefix_cache=True, snapshot_pages=0)

"""Speculative decoding with the MTP layer: the verify step and commit against one-token steps, the MTP
layer's cached forms against its sequence form, greedy tokens unchanged by speculation, the sampled
distribution unchanged (acceptance rule alone and end to end), reproducible seeded sampling, the
statistics, and models without an MTP layer refused."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import decode_one, prefill_cache, rel_l2

import ling_jax
from ling_jax.config import LingConfig
from ling_jax.decode.sampling import row_keys
from ling_jax.decode.speculative import accept, draft_token, index_keys, mtp_drafts, speculative_loop
from ling_jax.decode.step import fuse_for_decode
from ling_jax.decode.verify import commit, prefill_speculative, verify_rows, verify_step
from ling_jax.generate import generate
from ling_jax.kernels import select
from ling_jax.params import init_params


@pytest.fixture(scope="module")
def debug_model():
    cfg = LingConfig.preset("debug")
    assert cfg.num_nextn_predict_layers == 1
    return cfg, init_params(cfg, seed=3)


def _kernels(cfg, params):
    return select(cfg, dtype=params["embed"].dtype, inference=True)


def _prompts(cfg, lengths=(7, 3, 12, 1, 5), seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]


@pytest.mark.parametrize("form", ["unrolled", pytest.param("layer_scans", marks=pytest.mark.heavy), "rows"])
def test_verify_and_commit_equal_one_token_steps(debug_model, form):
    """Verifying T tokens per row gives the logits of T one-token steps, and committing a[b] of them
    (0..T, per row) gives the cache of a[b] one-token steps (rows past the new lengths aside); the
    verify's sequence forms with layers unrolled and in scans, and its row form (`verify_rows`)."""
    cfg, params = debug_model
    rng = np.random.default_rng(0)
    lengths = jnp.asarray([9, 4, 6, 2])
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 9)))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 3)))
    cache, _ = prefill_cache(cfg, params, prompt, lengths, 16)
    if form == "rows":
        kernels = select(cfg, dtype=params["embed"].dtype, decode=True, unroll=True)
        fused = fuse_for_decode(cfg, kernels, params)
        logits, _, new = jax.jit(verify_rows, static_argnums=(0, 1))(cfg, kernels, fused, cache, tokens)
    else:
        logits, _, new = jax.jit(verify_step, static_argnums=(0, 1, 5))(cfg, _kernels(cfg, params), params, cache,
                                                                         tokens, form == "unrolled")
    steps, c = [cache], cache
    want = []
    for i in range(3):
        c, lg = decode_one(cfg, params, c, tokens[:, i])
        steps.append(c)
        want.append(lg)
    assert rel_l2(logits, jnp.stack(want, 1)) < 1e-5
    advance = jnp.asarray([0, 3, 1, 2])
    got = jax.jit(commit)(cache, new, advance)
    np.testing.assert_array_equal(got["lengths"], lengths + advance)
    for b, a in enumerate(advance.tolist()):
        want_leaves = dict(jax.tree_util.tree_leaves_with_path(steps[a]))
        for path, x in jax.tree_util.tree_leaves_with_path(got):
            _assert_row_equal(x, want_leaves[path], b, int(lengths[b]) + a, jax.tree_util.keystr(path))


def _assert_row_equal(x, want, b, n, name):
    """Row b of two cache leaves equal: lengths, a KDA state or window, or the first n latent rows."""
    if "lengths" in name:
        return
    x, want = (np.take(np.asarray(a), b, axis=-4 if "state" in name else -3) for a in (x, want))
    if "latent" in name:
        x, want = x[..., :n, :], want[..., :n, :]
    np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-5, err_msg=f"row {b} {name}")


@pytest.mark.heavy  # (default suite kept well under 20 min on 2 cores)
@pytest.mark.parametrize("form", ["sequence", "rows"])
def test_mtp_cache_follows_the_sequence_form(debug_model, form):
    """Drafting from the prefill (MTP position L - 1), then after a verify of 3 tokens (positions L to
    L + 2, replacing the draft rows there) gives the MTP layer's distribution of `forward_with_mtp` over
    the whole sequence at the last position: position t sees the token at t + 1 and the main hidden
    state at t, and the rows before it hold the same; the MTP layer in its sequence forms and in the
    decode step's row form."""
    cfg, params = debug_model
    kernels = _kernels(cfg, params)
    rows = select(cfg, dtype=params["embed"].dtype, decode=True, unroll=True) if form == "rows" else None
    k = 3
    rng = np.random.default_rng(2)
    lengths = np.array([7, 4])
    ids = rng.integers(0, cfg.vocab_size, (2, 7))
    more = rng.integers(0, cfg.vocab_size, (2, 4))  # x_L, then three verified tokens' successors
    cache, _, h_last, latent = prefill_speculative(cfg, kernels, params, jnp.asarray(ids), jnp.asarray(lengths), 32)
    keys = jax.random.split(jax.random.key(0), 2)
    sampling = (jnp.ones((2,)), jnp.zeros((2,), jnp.int32), jnp.ones((2,)))  # temperature 1, unfiltered: q = softmax

    @jax.jit
    def drafts(latent, tok, h, m, lengths):
        pad = k + 1 - tok.shape[1]
        tok, h = jnp.pad(tok, ((0, 0), (0, pad))), jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        return mtp_drafts(cfg, kernels, params, latent, tok, h, m, lengths, keys, jnp.ones((2,), jnp.int32),
                          sampling, k, rows)

    _, logq_first, latent = drafts(latent, jnp.asarray(more[:, :1]), h_last[:, None], jnp.ones((2,), jnp.int32),
                                   jnp.asarray(lengths))
    _, h_new, _ = jax.jit(verify_step, static_argnums=(0, 1, 5))(cfg, kernels, params, cache,
                                                                  jnp.asarray(more[:, :3]), True)
    _, logq_next, _ = drafts(latent, jnp.asarray(more[:, 1:]), h_new, jnp.full((2,), 3, jnp.int32),
                             jnp.asarray(lengths + 3))
    for r, n in enumerate(lengths):
        seq = np.concatenate([ids[r, :n], more[r]])[None]
        _, (want,) = ling_jax.forward_with_mtp(cfg, params, jnp.asarray(seq))
        want = jax.nn.log_softmax(want[0, [n - 1, n + 2]], axis=-1)
        assert rel_l2(jnp.stack([logq_first[r, 0], logq_next[r, 0]]), want) < 1e-6, f"row {r}"


def _speculate(cfg, params, prompts, max_new, k, *, forced=None, stop=(), temperature=0.0, top_k=0, top_p=1.0,
               seeds=None):
    """The speculative loop as `generate` runs it, with `forced` drafts (the test hook): (outputs, stats)."""
    rows = [np.asarray(p, np.int32) for p in prompts]
    lengths = [len(r) for r in rows]
    ids = np.zeros((len(rows), max(16, max(lengths))), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    kernels = _kernels(cfg, params)
    cache, logits, h, latent = prefill_speculative(cfg, kernels, params, jnp.asarray(ids), jnp.asarray(lengths),
                                                   max(lengths) + max_new + k)
    out, counts, _, _, st = speculative_loop(
        cfg, params, cache, latent, logits, h, 16, row_keys(seeds or [0] * len(rows), rows), jnp.float32(temperature),
        jnp.int32(top_k), jnp.float32(top_p), jnp.asarray(stop or (-2,), jnp.int32), jnp.int32(max_new), k=k,
        kernels=kernels, forced_drafts=None if forced is None else jnp.asarray(forced, jnp.int32))
    out, counts = np.asarray(out), np.asarray(counts)
    return [out[i, :counts[i]].tolist() for i in range(len(rows))], {n: int(v) for n, v in st.items()}


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.heavy), 2, pytest.param(3, marks=pytest.mark.heavy)])
def test_greedy_tokens_unchanged(debug_model, k):
    """Greedy tokens with k drafts per step are the tokens without, in a batch of mixed prompt lengths:
    with the MTP layer's drafts, with drafts forced to the model's own tokens (all accepted: k + 1
    tokens per step), with forced drafts wrong at row-dependent places (rows advance by different
    counts), and with a stop token inside an accepted run."""
    cfg, params = debug_model
    prompts = _prompts(cfg)
    want = generate(cfg, params, prompts, max_new_tokens=12, stop_tokens=())
    stats = {}
    assert generate(cfg, params, prompts, max_new_tokens=12, stop_tokens=(), speculative_tokens=k, stats=stats) == want
    assert stats["speculative_tokens"] == k and 1 <= stats["mean_accepted_length"] <= k + 1
    assert stats["row_steps"] >= 5 * 11 / (k + 1)
    one = generate(cfg, params, prompts, max_new_tokens=1, stop_tokens=(), speculative_tokens=k, stats=stats)
    assert one == [w[:1] for w in want] and stats["row_steps"] == 0 and stats["mean_accepted_length"] is None
    forced = np.asarray(generate(cfg, params, prompts, max_new_tokens=12 + k + 1, stop_tokens=()))
    out, st = _speculate(cfg, params, prompts, 12, k, forced=forced)
    assert out == want
    assert st["accepted"] == k * st["row_steps"] and st["row_steps"] == 5 * -(-11 // (k + 1))
    wrong = forced.copy()
    b, j = np.nonzero((np.arange(5)[:, None] + np.arange(wrong.shape[1])[None]) % 4 == 0)
    wrong[b, j] = (wrong[b, j] + 1) % cfg.vocab_size
    out, st = _speculate(cfg, params, prompts, 12, k, forced=wrong)
    assert out == want and 0 < st["accepted"] < k * st["row_steps"]
    stop = want[0][5]
    out, _ = _speculate(cfg, params, prompts, 12, k, forced=forced, stop=(stop,))
    assert out == generate(cfg, params, prompts, max_new_tokens=12, stop_tokens=[stop])


@pytest.mark.heavy  # suite time
@pytest.mark.parametrize("k", [1, 2, 3])
def test_golden_greedy_decode_speculative(golden_a, k):
    """The reference's greedy tokens of golden set A, decoded with k drafts per step: the MTP layer's
    drafts (this random model's are all rejected) and drafts forced to the reference tokens (accepted
    but at the end of the 16)."""
    cfg, params, g = golden_a
    stats = {}
    prompts, want = g["decode_prompt_ids"].tolist(), g["decode_generated_ids"].tolist()
    assert generate(cfg, params, prompts, max_new_tokens=16, stop_tokens=(), speculative_tokens=k, stats=stats) == want
    assert 1 <= stats["mean_accepted_length"] <= k + 1
    got, st = _speculate(cfg, params, prompts, 16, k, forced=g["decode_generated_ids"])
    assert got == want and st["accepted"] >= 2 * (15 // (k + 1)) * k


def _filtered_probs(logits, temperature, top_k, top_p):
    """What `sample` draws from, in numpy: softmax(logits / temperature) over the top_k most likely
    tokens and, within those, the smallest set whose probability reaches top_p; [..., V]."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, axis=-1)
    srt = np.take_along_axis(z, order, axis=-1)
    kept = np.arange(z.shape[-1]) < (top_k or z.shape[-1])
    p = np.where(kept, np.exp(srt - srt[..., :1]), 0.0)
    p /= p.sum(-1, keepdims=True)
    kept = kept & ((np.cumsum(p, -1) - p) < top_p)
    out = np.zeros_like(z)
    np.put_along_axis(out, order, np.where(kept, np.exp(srt - srt[..., :1]), 0.0), axis=-1)
    return out / out.sum(-1, keepdims=True)


def _chi2_pvalue(tokens, probs):
    """p-value of a chi-square goodness-of-fit test of sampled `tokens` against `probs` [V] (cells
    expecting fewer than 5 counts pooled into one)."""
    from scipy.stats import chisquare

    n = len(tokens)
    observed = np.bincount(np.asarray(tokens), minlength=len(probs)).astype(np.float64)
    expected = n * np.asarray(probs)
    small = expected < 5
    if small.any():
        assert observed[expected == 0].sum() == 0, "a token outside the distribution's support was drawn"
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
        if expected[-1] == 0:
            observed, expected = observed[:-1], expected[:-1]
    return chisquare(observed, expected).pvalue


ACCEPT_LOGITS = np.array([  # main model's logits at the 3 verified slots, vocabulary 8
    [2.0, 1.6, 1.2, 0.4, 0.0, -1.0, -2.0, 0.8],
    [0.0, 0.5, 2.2, 1.9, -0.5, 1.0, 0.3, -1.0],
    [1.0, -1.0, 0.0, 2.0, 1.5, 0.2, -0.3, 0.7]], np.float32)
DRAFT_LOGITS = np.array([  # the drafts' logits: overlapping the main model's, not equal to them
    [0.3, 2.0, 1.8, 0.0, -0.5, 0.5, -1.0, 1.5],
    [1.5, 0.0, 1.0, 2.4, 0.2, -1.0, 0.8, 0.0]], np.float32)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 6, 0.9)])
def test_acceptance_keeps_the_model_distribution(temperature, top_k, top_p):
    """Drafts drawn from q, accepted or replaced by the rule (`draft_token`, `accept`), give each
    emitted token the main model's filtered distribution p: the first token p_0, the second (where the
    first draft was accepted) p_1, the third (both accepted: the bonus token) p_2 — chi-square over
    many keys. The rule's distribution differs from p when a draft is always accepted or a rejected
    one is replaced by a draw from p rather than from max(0, p - q)."""
    n, k = 40000, 2
    keys = jax.random.split(jax.random.key(7), n)
    index = jnp.asarray(np.random.default_rng(0).integers(1, 50, n), jnp.int32)  # rows at various output indices
    sampling = (jnp.full((n,), temperature), jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p))

    @jax.jit
    def run(keys, index):
        drafts, logq = zip(*(draft_token(jnp.broadcast_to(DRAFT_LOGITS[i], (n, 8)), index_keys(keys, index + i, 1),
                                         *sampling) for i in range(k)), strict=True)
        logits = jnp.broadcast_to(ACCEPT_LOGITS, (n, k + 1, 8))
        return jnp.stack(drafts, 1), accept(logits, jnp.stack(drafts, 1), jnp.stack(logq, 1), keys, index, *sampling)

    drafts, (accepted, final) = jax.device_get(run(keys, index))
    emitted = np.where(np.arange(k + 1) < accepted[:, None], np.pad(drafts, ((0, 0), (0, 1))), final[:, None])
    p = _filtered_probs(ACCEPT_LOGITS, temperature, top_k, top_p)
    q = _filtered_probs(DRAFT_LOGITS, temperature, top_k, top_p)
    for slot in range(k + 1):
        rows = accepted >= slot
        assert _chi2_pvalue(emitted[rows, slot], p[slot]) > 1e-4, f"slot {slot}"
    assert 0.2 < np.mean(accepted >= 1) < 0.9  # drafts are accepted and rejected
    assert np.abs(p[0] - q[0]).sum() > 0.3  # the test distinguishes p from q


def test_static_sampling_forms_equal_the_conditional():
    """`draft_token` and `accept` in their static forms (the engine's speculative calls: the host picks
    the form) give the drafts, log q, counts and tokens of their `lax.cond` form: the sampled form on a
    batch mixing greedy and sampled rows, the greedy form on greedy rows."""
    n, k = 64, 2
    keys = jax.random.split(jax.random.key(3), n)
    index = jnp.arange(n, dtype=jnp.int32)
    rng = np.random.default_rng(1)
    draft_logits = jnp.asarray(2 * rng.normal(size=(k, n, 8)), jnp.float32)
    logits = jnp.asarray(2 * rng.normal(size=(n, k + 1, 8)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=1)
    def run(temperature, form):
        sampling = (temperature, jnp.full((n,), 5, jnp.int32), jnp.full((n,), 0.9))
        drafts, logq = zip(*(draft_token(draft_logits[i], index_keys(keys, index + i, 1), *sampling, sampling=form)
                             for i in range(k)), strict=True)
        drafts, logq = jnp.stack(drafts, 1), jnp.stack(logq, 1)
        return drafts, logq, accept(logits, drafts, logq, keys, index, *sampling, sampling=form)

    mixed = jnp.where(jnp.arange(n) % 2 == 0, 0.0, 1.0)
    for temperature, form in ((mixed, True), (jnp.zeros((n,)), False)):
        jax.tree.map(np.testing.assert_array_equal, run(temperature, form), run(temperature, None))
    assert (run(mixed, True)[0] != run(mixed, False)[0]).any()  # the sampled rows draw


@pytest.mark.heavy  # suite time
def test_sampled_tokens_have_the_model_distribution():
    """Over 2000 seeds, the tokens sampled with 2 drafts per step (MTP drafts, top-k and top-p on)
    and without speculation both follow the model's marginal distribution at each output index,
    computed exactly from its logits over every continuation (chi-square). A small vocabulary and a
    scaled lm_head make the main and draft distributions peaked and partly overlapping, so that drafts
    are accepted and rejected; a wrong acceptance rule fails this test (accepting every draft, or
    drawing a rejected draft's replacement from p instead of max(0, p - q))."""
    cfg = LingConfig.preset("debug", vocab_size=16, num_hidden_layers=3, kv_lora_rank=8)
    params = init_params(cfg, seed=11)
    params["lm_head"] = params["lm_head"] * 5
    prompt, n, v = [3, 5, 7], 2000, cfg.vocab_size
    kw = dict(max_new_tokens=4, temperature=1.0, top_k=10, top_p=0.95, stop_tokens=(), seed=list(range(n)))
    stats = {}
    spec = np.asarray(generate(cfg, params, [prompt] * n, speculative_tokens=2, stats=stats, **kw))
    plain = np.asarray(generate(cfg, params, [prompt] * n, **kw))
    cont = np.array(list(itertools.product(range(v), repeat=3)))  # every continuation of 3 tokens
    logits = np.asarray(ling_jax.forward(cfg, params, jnp.asarray([prompt + c.tolist() for c in cont])))
    probs = _filtered_probs(logits[:, len(prompt) - 1:], 1.0, 10, 0.95)  # [V^3, 4, V]: each index given the prefix
    prefix = probs[:, 0, :][0][cont[:, 0]] * probs[np.arange(len(cont)), 1, cont[:, 1]]  # P(x0, x1)
    marginals = [np.bincount(cont[:, 1], weights=prefix, minlength=v) / v,  # each (x0, x1) appears V times
                 np.bincount(cont[:, 2], weights=prefix * probs[np.arange(len(cont)), 2, cont[:, 2]], minlength=v),
                 (prefix * probs[np.arange(len(cont)), 2, cont[:, 2]]) @ probs[:, 3, :]]
    for j, m in enumerate(marginals, start=1):
        assert _chi2_pvalue(spec[:, j], m) > 1e-4, f"speculative, token {j}"
        assert _chi2_pvalue(plain[:, j], m) > 1e-4, f"plain, token {j}"
    assert 0.1 < stats["acceptance_rate"] < 0.9  # drafts are accepted and rejected


def test_seeded_sampling_is_reproducible_and_batch_invariant(debug_model):
    """With speculation a sampled row draws from its own keys: the same tokens again, alone and at
    another place in a batch; another seed draws other tokens."""
    cfg, params = debug_model
    prompts = _prompts(cfg)
    kw = dict(max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.9, stop_tokens=(), speculative_tokens=2)
    a = generate(cfg, params, prompts, seed=5, **kw)
    assert a == generate(cfg, params, prompts, seed=5, **kw)
    assert a != generate(cfg, params, prompts, seed=6, **kw)
    assert generate(cfg, params, [prompts[2]], seed=5, **kw) == [a[2]]
    assert generate(cfg, params, prompts[::-1], seed=5, **kw) == a[::-1]


def test_speculation_needs_an_mtp_layer():
    cfg = LingConfig.preset("debug", num_nextn_predict_layers=0)
    params = init_params(cfg, seed=0)
    assert not params["mtp"]
    with pytest.raises(ValueError, match=r"speculative_tokens=2 drafts with the MTP layer.*num_nextn_predict_layers=0"):
        generate(cfg, params, [[1, 2]], max_new_tokens=4, speculative_tokens=2)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="speculative_tokens=.* must be an integer >= 0"):
            generate(cfg, params, [[1, 2]], max_new_tokens=4, speculative_tokens=bad)
    stats = {}
    generate(cfg, params, [[1, 2]], max_new_tokens=2, speculative_tokens=0, stats=stats)
    assert stats == {"speculative_tokens": 0}

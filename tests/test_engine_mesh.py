"""The serving engine under a device mesh (8 simulated CPU devices) and with FP8-resident weights: every
request's tokens equal `generate`'s (float32, greedy) — under no mesh for the mesh cases, with the same
FP8-resident params for the FP8 cases — with more clients than slots, prompts of several chunks and
the prefix cache on."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
from conftest import GOLDEN
from jax.sharding import NamedSharding

import ling_jax
from ling_jax import sharding
from ling_jax.cache import ROLES, STORE_ROLES
from ling_jax.checkpoint.convert import convert_hf_to_orbax
from ling_jax.checkpoint.fp8 import is_block_fp8
from ling_jax.engine import Engine, SamplingParams
from serve.generate import load_any

ENGINE = dict(max_batch=4, max_len=80, page_size=8, prefill_chunk=16, decode_steps=3)


@functools.cache
def _golden_on(mesh_sizes: tuple[tuple[str, int], ...]):
    mesh = ling_jax.make_mesh(**dict(mesh_sizes))
    cfg, params = ling_jax.load_hf_checkpoint(GOLDEN / "ling3_tiny_a", dtype="float32", mesh=mesh)
    return mesh, cfg, params


def _workload(cfg, seed: int, n: int):
    """`n` prompts of 1-47 tokens (up to 3 prefill chunks of 16), about half of them continuing one of
    two shared bases (hits for the prefix cache), and their max_tokens."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, cfg.vocab_size, 30).tolist() for _ in range(2)]
    prompts = []
    for i in range(n):
        tail = rng.integers(0, cfg.vocab_size, int(rng.integers(1, 18))).tolist()
        prompts.append(bases[i % 2][:int(rng.integers(8, 31))] + tail if i % 3 else tail + tail)
    return prompts, [int(m) for m in rng.integers(1, 12, n)]


def _serve_all(engine: Engine, prompts, max_tokens, concurrency: int):
    """Every request through the engine (started here, warmed up first) from `concurrency` client
    threads, each submitting its next request when the last finished: (tokens per request,
    cached_tokens per request, the compiles serving took after the warm-up)."""
    compiles = []

    def one(i: int):
        h = engine.submit(prompts[i], SamplingParams(max_tokens=max_tokens[i], ignore_eos=True))
        return h.result(), h.cached_tokens

    engine.warmup(logprobs=False)
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.append(event) if "backend_compile" in event else None)
    engine.start()
    try:
        with ThreadPoolExecutor(concurrency) as clients:
            got = list(clients.map(one, range(len(prompts))))
    finally:
        engine.shutdown(5)
        jax.monitoring.clear_event_listeners()
    return [t for t, _ in got], [c for _, c in got], compiles


def _reference(cfg, params, prompts, max_tokens):
    out = ling_jax.generate(cfg, params, prompts, max_new_tokens=max(max_tokens), stop_tokens=())
    return [o[:m] for o, m in zip(out, max_tokens, strict=True)]


def _assert_laid_out(engine: Engine, mesh) -> None:
    """The engine's paged cache (its lengths and last tokens with the rows), staging row and snapshot
    store are laid out by their roles."""
    trees = [(engine.cache, ROLES), (engine.staging, ROLES)]
    if engine.prefix is not None:
        trees.append((engine.store, STORE_ROLES))
    for tree, roles in trees:
        for path, x in jax.tree_util.tree_leaves_with_path(tree["segments"]):
            want = NamedSharding(mesh, sharding.spec(roles[path[-1].key], x.shape, mesh))
            assert x.sharding.is_equivalent_to(want, x.ndim), (path, x.sharding, want)
    for name in ("lengths", "tokens"):
        x = engine.cache[name]
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, sharding.spec("cache_rows", x.shape, mesh)), 1), name


@pytest.mark.parametrize("mesh_sizes,prefix,spec,rows,buckets", [
    pytest.param((("data", 2), ("expert", 2), ("tensor", 2)), True, 0, 1, None, marks=pytest.mark.heavy,
                 id="2x2x2-prefix"),
    pytest.param((("data", 2), ("expert", 2), ("tensor", 2)), True, 2, 1, None, marks=pytest.mark.heavy,
                 id="2x2x2-prefix-speculative"),
    pytest.param((("data", 2), ("expert", 2), ("tensor", 2)), True, 0, 3, None, marks=pytest.mark.heavy,
                 id="2x2x2-prefix-3-prompts-per-prefill"),
    pytest.param((("data", 2), ("expert", 4)), False, 0, 1, (1, 2), marks=pytest.mark.heavy, id="2x4-decode-buckets"),
    pytest.param((("data", 2), ("expert", 4)), True, 0, 1, None, marks=pytest.mark.heavy, id="2x4-prefix"),
    pytest.param((("expert", 8),), True, 0, 1, None, marks=pytest.mark.heavy, id="1x8-prefix"),
])
def test_engine_under_a_mesh_equals_generate(golden_a, mesh_sizes, prefix, spec, rows, buckets):
    """The engine on params placed on a mesh, every call under it: each request's tokens are those of
    `generate` under no mesh; with the prefix cache the requests continuing a cached base read it;
    with speculation (k = `spec` MTP drafts per call) the same tokens; serving compiles nothing after
    the warm-up, and the paged cache, staging rows and snapshot store stay laid out by the sharding
    table; with `rows` > 1 prompts per prefill call the same; with decode `buckets` (calls over the
    first 1 or 2 of the 4 slots, rows the data axis does not divide) the same."""
    cfg, params, _ = golden_a
    mesh, _, sparams = _golden_on(mesh_sizes)
    prompts, max_tokens = _workload(cfg, 1, 12)
    engine = Engine(cfg, sparams, mesh=mesh, prefix_cache=prefix, prefix_cache_gb=0.01, snapshot_pages=2,
                    speculative_tokens=spec, prefill_rows=rows, decode_buckets=buckets, **ENGINE)
    got, cached, compiles = _serve_all(engine, prompts, max_tokens, concurrency=6)
    assert got == _reference(cfg, params, prompts, max_tokens)
    assert not compiles, compiles  # every call's inputs keep the layout its warm-up compiled for
    _assert_laid_out(engine, mesh)
    if prefix:
        assert sum(cached) > 0 and engine.stats()["prefix_hits"] == sum(c > 0 for c in cached)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return convert_hf_to_orbax(GOLDEN / "ling3_tiny_a_fp8", tmp_path_factory.mktemp("fp8") / "ck", dtype="float8")


@pytest.mark.parametrize("mesh_sizes", [pytest.param((), id="one-device"), pytest.param((("data", 2), ("expert", 4)),
                                                                                   id="2x4")])
@pytest.mark.heavy  # ~35 s on one device on 2 cores; FP8-resident generate is in the default suite (test_fp8_resident)
def test_engine_with_fp8_resident_weights_equals_generate(fp8_checkpoint, mesh_sizes):
    """Weights loaded as `ling-serve --fp8-weights` loads them (block-FP8 layer weights kept on the
    device; on a mesh, placed on it): each request's tokens are those of `generate` with the same
    FP8-resident params under no mesh, with the prefix cache on."""
    mesh = ling_jax.make_mesh(**dict(mesh_sizes)) if mesh_sizes else None
    cfg, params = load_any(fp8_checkpoint, "float32", True)
    _, placed = load_any(fp8_checkpoint, "float32", True, mesh) if mesh is not None else (cfg, params)
    assert any(map(is_block_fp8, jax.tree.leaves(placed, is_leaf=is_block_fp8)))
    prompts, max_tokens = _workload(cfg, 2, 8)
    engine = Engine(cfg, placed, mesh=mesh, prefix_cache=True, prefix_cache_gb=0.01, snapshot_pages=2, **ENGINE)
    got, cached, compiles = _serve_all(engine, prompts, max_tokens, concurrency=6)
    assert got == _reference(cfg, params, prompts, max_tokens)
    assert sum(cached) > 0 and not compiles, compiles

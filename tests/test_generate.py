"""Inference: latent/state caches, absorbed MLA, the jitted decode loop and `generate`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import decode_one as _step
from conftest import fused_params as _fused
from conftest import prefill_cache as _prefill
from conftest import rel_l2

import ling_jax
from ling_jax.cache import cache_bytes, cache_length, cache_shapes, nbytes
from ling_jax.config import LingConfig
from ling_jax.decode import layers as decode_layers
from ling_jax.decode.views import FUSED_INPUT, LINEAR_LEAVES, stackable
from ling_jax.generate import generate
from ling_jax.kernels import select
from ling_jax.layers.mla import mla_mixer
from ling_jax.layers.rope import rope_cos_sin
from ling_jax.ops import expert_gemv
from ling_jax.ops.attention import attention_mask
from ling_jax.params import get_path, init_params, layer_params, layer_stacks


def _teacher_forced(cfg, params, prompt_BT, lengths, forced_BN, max_len, unroll=False, **override):
    """Logits of prefill then one decode step per forced token: [B, N + 1, V]."""
    cache, logits = _prefill(cfg, params, prompt_BT, lengths, max_len)
    out = [logits]
    for s in range(forced_BN.shape[1]):
        cache, logits = _step(cfg, params, cache, forced_BN[:, s], unroll, **override)
        out.append(logits)
    return jnp.stack(out, axis=1)


@pytest.mark.parametrize("attention", ["auto", pytest.param("pallas", marks=pytest.mark.heavy)])
def test_golden_greedy_decode(golden_a, attention):
    """The reference's greedy tokens and per-step logits; prefill's MLA also through the fused
    attention kernels (interpret mode on CPU; "auto" is the XLA softmax here)."""
    cfg, params, g = golden_a
    cfg = dataclasses.replace(cfg, attention_impl=attention)
    prompts = g["decode_prompt_ids"].tolist()
    assert generate(cfg, params, prompts, max_new_tokens=16, stop_tokens=()) == g["decode_generated_ids"].tolist()
    ids = jnp.asarray(g["decode_prompt_ids"])
    logits = _teacher_forced(cfg, params, ids, jnp.full((2,), 12, jnp.int32),
                             jnp.asarray(g["decode_generated_ids"][:, :15]), 12 + 16)
    for s in range(16):
        assert rel_l2(logits[:, s], g["decode_step_logits"][:, s]) < 1e-5, f"step {s}"


@pytest.fixture(scope="module")
def debug_model():
    cfg = LingConfig.preset("debug")
    return cfg, init_params(cfg, seed=3)


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases (golden greedy decode runs the fused params)
@pytest.mark.parametrize("lora", [False, True], ids=["full_rank_gates", "low_rank_gates"])
def test_fused_decode_projections(lora, monkeypatch):
    """The decode loop's params (`fuse_for_decode`: each KDA layer's six input projections side by
    side, low-rank gates through their second factor; each MLA layer's three; each MLP's and shared
    expert's gate and up) give the same step as the separate weights. With low-rank gates, also through the KDA
    decode layer (decode_impl "pallas", batch 2; batch 1: `test_batch1_projections_read_from_their_stacks`)."""
    cfg = LingConfig.preset("debug", no_kda_lora=not lora)
    params = init_params(cfg, seed=5)
    fused = _fused(cfg, params)
    attn = {(st.mixer, st.path): get_path(fused, (*st.path, "attn")) for st in layer_stacks(cfg) if not st.mtp}
    assert {m for m, _ in attn} == {"kda", "mla"} and all(FUSED_INPUT in a for a in attn.values())
    gates = ("f_a_proj", "g_a_proj") if lora else ("f_proj", "g_proj")
    for (mixer, _), a in attn.items():  # side by side, then zero columns up to the gemv kernel's widest tile
        assert mixer == "mla" or ("f_a_proj" in a) == lora
        names = ("q_proj", "k_proj", "v_proj", *gates, "b_proj") if mixer == "kda" else (
            "q_proj" if "q_proj" in a else "q_a_proj", "kv_a_proj", "g_proj")
        width = sum(a[n].shape[-1] for n in names)
        assert a[FUSED_INPUT].shape[-1] == -(-width // expert_gemv.MAX_BO) * expert_gemv.MAX_BO
        np.testing.assert_array_equal(a[FUSED_INPUT][..., width - a[names[-1]].shape[-1]:width], a[names[-1]])
        assert not np.asarray(a[FUSED_INPUT][..., width:]).any()
    mlps = [get_path(fused, (*st.path, "mlp")) for st in layer_stacks(cfg) if not st.mtp]
    assert all("gate_up_proj" in m or "shared_gate_up_proj" in m for m in mlps)
    prompt = jax.random.randint(jax.random.key(1), (2, 7), 0, cfg.vocab_size)
    cache, _ = _prefill(cfg, params, prompt, jnp.array([7, 4]), 12)
    tok = jnp.array([3, 9], jnp.int32)
    (c_sep, l_sep), (c_fused, l_fused) = (_step(cfg, p, cache, tok, True) for p in (params, fused))
    assert rel_l2(l_fused, l_sep) < 1e-6
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         rtol=1e-5, atol=1e-6), c_fused, c_sep)
    if not lora:
        return
    calls = []
    monkeypatch.setattr(decode_layers, "kda_decode_layer",
                        lambda *a, real=decode_layers.kda_decode_layer, **k: calls.append(1) or real(*a, **k))
    pallas = dataclasses.replace(cfg, decode_impl="pallas")
    c_pal, l_pal = _step(pallas, fused, cache, tok, True)
    assert len(calls) == sum(cfg.mixer_of(i) == "kda" for i in range(cfg.num_hidden_layers))
    assert rel_l2(l_pal, l_sep) < 1e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         rtol=1e-4, atol=1e-5), c_pal, c_sep)


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_decode_loop_does_not_copy_the_latent_cache(debug_model):
    """The compiled decode loop updates the latent caches in place: no `copy` of a latent stack (XLA
    scheduled a segment's cache write before its attention read the cache, and then copied the whole
    cache twice per step to keep the old rows: 2 x 5 GB per step on an H200 at batch 128)."""
    cfg, params = debug_model
    cache = _prefill(cfg, params, jnp.ones((2, 4), jnp.int32), jnp.array([4, 3]), 1024)[0]
    latent_shapes = {tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(cache)
                     if "latent" in jax.tree_util.keystr(path)}
    assert latent_shapes
    args = (cfg, params, cache, jnp.zeros((2, cfg.vocab_size), jnp.float32), 4,
            jax.random.split(jax.random.key(0), 2), jnp.float32(0),
            jnp.int32(0), jnp.float32(1), jnp.asarray([-2], jnp.int32))
    from ling_jax.decode.loop import _decode_loop

    kernels = select(cfg, dtype=params["embed"].dtype, decode=True, unroll=True)
    hlo = _decode_loop.lower(args[0], kernels, *args[1:], None, unroll_layers=True).compile().as_text()
    copied = [line for line in hlo.splitlines() if " copy(" in line
              and any(f"[{','.join(map(str, shp))}]" in line.split("copy(")[0] for shp in latent_shapes)]
    assert not copied, copied[:2]


@pytest.mark.parametrize("unroll", [pytest.param(False, marks=pytest.mark.heavy), True],
                         ids=["layer_scans", "unrolled"])
def test_decode_equals_forward(debug_model, unroll):
    """Prefill of right-padded prompts + decode steps == one forward over each whole sequence,
    with the decode step's layers in scans and unrolled (what `decode_loop` runs by default)."""
    cfg, params = debug_model
    rng = np.random.default_rng(0)
    lengths = np.array([9, 4])
    full = rng.integers(0, cfg.vocab_size, (2, 9 + 6))
    prompt = full[:, :9].copy()
    prompt[1, 4:] = 0  # padding after the short prompt
    forced = np.stack([full[0, 9:15], full[1, 4:10]])
    got = _teacher_forced(cfg, params, jnp.asarray(prompt), jnp.asarray(lengths), jnp.asarray(forced), 16, unroll)
    for r, n in enumerate(lengths):
        seq = np.concatenate([full[r, :n], forced[r]])[None]
        want = ling_jax.forward(cfg, params, jnp.asarray(seq))[0, n - 1 :]
        assert rel_l2(got[r], want) < 1e-5, f"row {r}"


@pytest.mark.parametrize("unroll", [pytest.param(False, marks=pytest.mark.heavy), True],
                         ids=["layer_scans", "unrolled"])
def test_pallas_decode_kernels_in_the_decode_step(debug_model, unroll, monkeypatch):
    """The decode step's Pallas kernels give the XLA step's logits: decode_impl="pallas" (latent
    attention, KDA step, and unrolled the dense projections of the two rows read from their
    stacks by `ops.stack_matmul`) with moe_impl="gemv" (routed experts; unrolled, read from the
    stacked weights as `ExpertStack`s, with scans from the sliced layer)."""
    from ling_jax.ops import stack_matmul

    cfg, params = debug_model
    rng = np.random.default_rng(5)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)))
    lengths, forced = jnp.asarray([9, 6]), jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 3)))
    want = _teacher_forced(cfg, params, prompt, lengths, forced, 16)
    pallas = dataclasses.replace(cfg, decode_impl="pallas", moe_impl="gemv")
    shapes = []
    real = stack_matmul.partial_products
    monkeypatch.setattr(stack_matmul, "partial_products",
                        lambda x, w, *a, **k: shapes.append(w.shape) or real(x, w, *a, **k))
    assert rel_l2(_teacher_forced(pallas, params, prompt, lengths, forced, 16, unroll), want) < 1e-5
    d = cfg.hidden_size
    # unrolled: every layer's output projection ([*, heads x head dim, D]) at least, read in place
    assert ({s[-1] for s in shapes} >= {d} and len(shapes) >= cfg.num_hidden_layers) if unroll else not shapes


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_shared_expert_rides_in_the_gemv_launches(monkeypatch):
    """With the fused decode params and a shared expert as wide as the routed ones, the unrolled
    gemv step runs the shared expert as one more copy per token in the routed launches
    (`ops.moe.SharedStacks`, read from its stack), the selection launch before them reads its two
    slabs into L2 (`ops.l2_prefetch`), and the step gives the XLA step's logits and caches."""
    from ling_jax.ops import expert_gemv, route_pallas

    cfg = LingConfig.preset("debug", moe_shared_expert_intermediate_size=16, num_hidden_layers=6)
    params = init_params(cfg, seed=7)
    prompt = jax.random.randint(jax.random.key(2), (2, 7), 0, cfg.vocab_size)
    cache, _ = _prefill(cfg, params, prompt, jnp.array([7, 5]), 12)
    tok = jnp.array([4, 11], jnp.int32)
    c_want, want = _step(cfg, params, cache, tok, True)
    extras = []
    real = expert_gemv.gathered_products
    monkeypatch.setattr(expert_gemv, "gathered_products",
                        lambda *a, **k: extras.append([w.shape for w, _ in k.get("extra", ())]) or real(*a, **k))
    prefetched = []
    real_select = route_pallas._select
    monkeypatch.setattr(route_pallas, "_select", lambda *a: prefetched.append(
        [(p.stack.shape, len(p.index)) for p in a[7]]) or real_select(*a))
    pallas = dataclasses.replace(cfg, decode_impl="pallas", moe_impl="gemv")
    c_got, got = _step(pallas, _fused(pallas, params), cache, tok, True)
    assert rel_l2(got, want) < 1e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         rtol=1e-4, atol=1e-5), c_got, c_want)
    n_moe = sum(seg.ffn == "moe" for seg in cfg.segments)  # traced MoE bodies: one per segment kind
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    assert len(extras) >= 2 * n_moe and all(e for e in extras)  # every launch carried the shared expert
    assert {s[1:] for e in extras for s in e} == {(d, 2 * i), (i, d)}  # its fused gate|up and its down
    assert len(prefetched) >= n_moe and all(  # every selection read the same two slabs of their stacks
        [(s[2:], n) for s, n in p] == [((d, 2 * i), 2), ((i, d), 2)] for p in prefetched)


@pytest.mark.heavy
def test_auto_gemv_reads_every_layer_from_its_stack(monkeypatch):
    """With the gemv kernel picked for the routed experts (as "auto" does on one GPU; the kernel runs in
    interpret mode here) the step decodes through ExpertStacks and the gemv kernel in every MoE layer
    — 11 layers: two groups (layer offsets n x (G-1) + j) and a run segment — and gives the
    one-device XLA step's logits."""
    from ling_jax.ops import expert_gemv

    cfg = LingConfig.preset("debug", num_hidden_layers=11)
    params = init_params(cfg, seed=5)
    rng = np.random.default_rng(6)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 7)))
    lengths, forced = jnp.asarray([7, 3]), jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 2)))
    want = _teacher_forced(cfg, params, prompt, lengths, forced, 12, True)
    calls = []
    real = expert_gemv.gathered_products
    monkeypatch.setattr(expert_gemv, "gathered_products", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    got = _teacher_forced(dataclasses.replace(cfg, moe_impl="auto", kda_impl="chunked"), params, prompt, lengths,
                          forced, 12, True, moe_small="gemv", expert_stacks=True)
    assert rel_l2(got, want) < 1e-5
    # every traced MoE body (one per scanned segment, unrolled when lowered) read its segment's whole
    # stack: [layers x E, C, O], the groups' KDA layers as one [n x (G-1) x E] stack
    want_lead = set()
    for seg in cfg.segments:
        if seg.kind == "groups":
            want_lead |= {seg.length * seg.kda_per_group, seg.length}
        elif seg.ffn == "moe":
            want_lead.add(seg.length)
    assert all(w.shape[0] % cfg.num_experts == 0 for ws in calls for w in ws)
    assert {w.shape[0] // cfg.num_experts for ws in calls for w in ws} == want_lead


def test_absorbed_equals_expanded_attention(debug_model):
    """The latent-cache (absorbed) attention of the last token == the expanded K/V attention."""
    cfg, params = debug_model
    p = layer_params(cfg, params, 2)["attn"]  # an MLA layer
    t = 300
    x = jax.random.normal(jax.random.key(1), (2, t, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    cos, sin = rope_cos_sin(pos, cfg.qk_rope_head_dim, cfg.rope_theta)
    kernels = select(cfg, dtype=x.dtype)
    want, cache = mla_mixer(p, x, cfg=cfg, kernels=kernels, cos=cos, sin=sin, mask_BTS=attention_mask(pos, pos))
    latent = jnp.zeros((2, cache_length(t), cache["latent"].shape[-1])).at[:, : t - 1].set(cache["latent"][:, :-1])
    got, row = decode_layers.mla(p, x[:, -1], latent, jnp.full((2,), t - 1), cfg=cfg, kernels=kernels,
                                 cos=cos[:, -1:], sin=sin[:, -1:])
    assert rel_l2(got, want[:, -1]) < 1e-5
    np.testing.assert_allclose(row, cache["latent"][:, -1], rtol=1e-6, atol=1e-6)


def test_absorbed_prefill_equals_expanded(debug_model):
    """`mla_mixer(absorbed=True)` (attention over the latent rows, W_UK/W_UV folded in) == the expanded
    per-head K/V form, with a padded row; both return the same latent rows to cache."""
    cfg, params = debug_model
    p = layer_params(cfg, params, 2)["attn"]  # an MLA layer
    t = 37
    x = jax.random.normal(jax.random.key(4), (2, t, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    valid = pos < jnp.asarray([[t], [20]])
    cos, sin = rope_cos_sin(pos, cfg.qk_rope_head_dim, cfg.rope_theta)
    mask = attention_mask(pos, pos, valid)
    kernels = select(cfg, dtype=x.dtype)
    want, c_want = mla_mixer(p, x, cfg=cfg, kernels=kernels, cos=cos, sin=sin, mask_BTS=mask)
    got, c_got = mla_mixer(p, x, cfg=cfg, kernels=kernels, cos=cos, sin=sin, mask_BTS=mask, absorbed=True)
    assert rel_l2(got[0], want[0]) < 1e-5 and rel_l2(got[1, :20], want[1, :20]) < 1e-5
    np.testing.assert_array_equal(c_got["latent"], c_want["latent"])


def test_batch_invariance_and_sampling(debug_model):
    cfg, params = debug_model
    _batch_invariance_and_sampling(cfg, params)


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_batch_invariance_fused_attention():
    """Prompts of mixed lengths (right-padded by prefill) with its MLA through the fused kernels:
    each prompt's greedy output as alone (interpret mode on CPU)."""
    cfg = LingConfig.preset("debug", qk_rope_head_dim=16, attention_impl="pallas")
    _batch_invariance_and_sampling(cfg, init_params(cfg, seed=3), sampling=False)


def _batch_invariance_and_sampling(cfg, params, sampling=True):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (7, 3, 12, 1, 5)]
    batch = generate(cfg, params, prompts, max_new_tokens=6, stop_tokens=())
    assert [len(o) for o in batch] == [6] * 5
    for p, o in zip(prompts, batch, strict=True):
        assert generate(cfg, params, [p], max_new_tokens=6, stop_tokens=()) == [o]
    if not sampling:
        return
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=20, top_p=0.9, stop_tokens=())
    a = generate(cfg, params, prompts, seed=5, **kw)
    assert a == generate(cfg, params, prompts, seed=5, **kw)
    assert a != generate(cfg, params, prompts, seed=6, **kw)
    # a sampled row draws from its own key: the same tokens alone and at another place in a batch
    for i in (0, 3):
        assert generate(cfg, params, [prompts[i]], seed=5, **kw) == [a[i]]
    assert generate(cfg, params, prompts[::-1], seed=5, **kw) == a[::-1]
    # seeds are 64-bit (2**32 is not 0); one seed per prompt samples copies of a prompt differently
    assert generate(cfg, params, prompts[:1], seed=2**32, **kw) != generate(cfg, params, prompts[:1], seed=0, **kw)
    twice = generate(cfg, params, [prompts[0]] * 2, seed=[5, 6], **kw)
    assert twice[0] == a[0] and twice[1] != twice[0]


def test_stop_tokens(debug_model):
    cfg, params = debug_model
    prompt = [[5, 6, 7]]
    free = generate(cfg, params, prompt, max_new_tokens=8, stop_tokens=())[0]
    stop = free[3]
    out = generate(cfg, params, prompt, max_new_tokens=8, stop_tokens=[stop])[0]
    assert out == free[: free.index(stop) + 1]


def test_bad_input(debug_model):
    cfg, params = debug_model
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(cfg, params, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="token id 512 outside"):
        generate(cfg, params, [[1, 512]], max_new_tokens=2)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=2048"):
        generate(cfg, params, [[1] * 2000], max_new_tokens=100)
    with pytest.raises(ValueError, match="prompts is empty"):
        generate(cfg, params, [], max_new_tokens=2)
    with pytest.raises(ValueError, match=f"token id {2**70} outside"):
        generate(cfg, params, [[1, 2**70]], max_new_tokens=2)
    assert generate(cfg, params, [[5, 6]], max_new_tokens=np.int64(2), top_k=np.int32(3)) == generate(
        cfg, params, [[5, 6]], max_new_tokens=2, top_k=3)
    with pytest.raises(ValueError, match="token id 2.7 is not an integer"):
        generate(cfg, params, [[1, 2.7]], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 0: token ids must be integers"):
        generate(cfg, params, [np.array([1.0, 2.0])], max_new_tokens=2)
    with pytest.raises(ValueError, match="stop_tokens: expected a sequence"):
        generate(cfg, params, [[1]], max_new_tokens=2, stop_tokens=5)
    for bad in (dict(max_new_tokens=2.0), dict(max_new_tokens=None), dict(max_new_tokens=2, temperature=float("nan")),
                dict(max_new_tokens=2, top_k=1.5), dict(max_new_tokens=2, top_p=0.0),
                dict(max_new_tokens=2, seed=2**64), dict(max_new_tokens=2, seed=[1, 2])):
        with pytest.raises(ValueError, match=next(iter(bad.keys() - {"max_new_tokens"}), "max_new_tokens")):
            generate(cfg, params, [[1]], **bad)
    # arrays are prompts too; a huge top_k is every token
    assert generate(cfg, params, [np.array([5, 6, 7])], max_new_tokens=2) == generate(
        cfg, params, [[5, 6, 7]], max_new_tokens=2)
    assert generate(cfg, params, [[5]], max_new_tokens=2, top_k=2**40, temperature=1.0) == generate(
        cfg, params, [[5]], max_new_tokens=2, temperature=1.0)


def test_cache_size_ling31_flash():
    """9 MLA layers x 576 latent values x 2 bytes per token, plus the constant KDA state."""
    cfg = LingConfig.preset("ling-3.1-flash")
    per_token = 9 * 576 * 2
    report = cache_bytes(cfg, batch=1, max_len=4096)
    assert report["per_token_mla"] == per_token == 10368
    assert report["mla_latent"] == 4096 * per_token
    assert report["kda_state"] == 63 * 64 * 128 * 128 * 4  # 252 MiB
    shapes = cache_shapes(cfg, 1, 4096)  # no allocation: ShapeDtypeStructs
    assert nbytes(shapes) == report["total"] + 4  # + the lengths vector
    assert nbytes(cache_shapes(cfg, 1, 8192)) - nbytes(shapes) == 4096 * per_token
    expanded = 9 * 64 * (192 + 128) * 2  # the reference's per-head K and V
    assert expanded / per_token == pytest.approx(35.56, abs=0.01)


def test_latent_attention_blocks_and_lengths():
    """The blocked online softmax over the latent cache == a plain softmax over each row's visible
    rows plus the new one, for lengths spanning several blocks (and a block never reached)."""
    from ling_jax.ops.mla_decode import latent_attention

    rng = np.random.default_rng(4)
    b, h, w, r, s = 3, 2, 12, 8, 64
    q = jnp.asarray(rng.standard_normal((b, h, w)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((b, s, w)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((b, w)), jnp.float32)
    lengths = jnp.asarray([0, 17, 40])
    got = latent_attention(q, cache, lengths, new, rank=r, scale=0.3, block=16)
    for i, n in enumerate([0, 17, 40]):
        rows = np.concatenate([np.asarray(cache[i, :n]), np.asarray(new[i])[None]])
        p = jax.nn.softmax(0.3 * np.asarray(q[i]) @ rows.T, axis=-1)
        np.testing.assert_allclose(got[i], p @ rows[:, :r], rtol=1e-5, atol=1e-6)


@pytest.mark.heavy
def test_long_prompt_bucket_larger_than_the_cache(golden_a):
    """A 2100-token prompt pads to a 4096 bucket while the cache holds 3072 slots: prefill keeps
    the real rows, and the first new token is the forward pass's argmax."""
    cfg, params, _ = golden_a
    prompt = np.random.default_rng(5).integers(0, cfg.vocab_size, 2100).tolist()
    out = generate(cfg, params, [prompt], max_new_tokens=4, stop_tokens=())[0]
    want = int(jnp.argmax(ling_jax.forward(cfg, params, jnp.asarray([prompt]))[0, -1]))
    assert out[0] == want and len(out) == 4


def test_batch1_moe_routes_from_its_stacks(monkeypatch):
    """At batch 1 with the gemv MoE, the pallas step's router matmul runs in the gemv kernel and
    `route_select` takes its partial sums and the expert bias in its stack (`WeightStack`), in
    every MoE layer, the kernel applying the post-attention RMSNorm to the rows it reads
    (`expert_gemv.NormedRows`), and the step gives the XLA step's logits and caches."""
    from ling_jax.ops import route_pallas
    from ling_jax.ops.layer_gemv import WeightStack

    cfg = LingConfig.preset("debug", num_hidden_layers=4, num_experts=16, hidden_size=128)  # router [128, 16]: 2 tiles
    params = init_params(cfg, seed=4)
    prompt = jax.random.randint(jax.random.key(3), (1, 6), 0, cfg.vocab_size)
    cache, _ = _prefill(cfg, params, prompt, jnp.array([6]), 10)
    tok = jnp.array([5], jnp.int32)
    c_want, want = _step(cfg, params, cache, tok, True)
    seen, router = [], []
    real, real_pp = route_pallas._select, decode_layers.partial_products
    monkeypatch.setattr(route_pallas, "_select", lambda lg, b, *a: seen.append((lg.shape, type(b))) or real(lg, b, *a))
    monkeypatch.setattr(decode_layers, "partial_products",
                        lambda x, w, *a: router.append((type(x), w.shape)) or real_pp(x, w, *a))
    pallas = dataclasses.replace(cfg, decode_impl="pallas", moe_impl="gemv")
    c_got, got = _step(pallas, _fused(pallas, params), cache, tok, True)
    assert rel_l2(got, want) < 1e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         rtol=1e-4, atol=1e-5), c_got, c_want)
    n_moe = sum(cfg.ffn_of(i) == "moe" for i in range(cfg.num_hidden_layers))
    # the router matmul in the gemv kernel, on rows it RMS-norms itself (the post-attention norm)
    assert router == [(expert_gemv.NormedRows, (cfg.hidden_size, cfg.num_experts))] * n_moe
    assert seen == [((cfg.hidden_size // expert_gemv.MAX_BC, 1, cfg.num_experts), WeightStack)] * n_moe


@pytest.mark.heavy  # slow on 2 cores; CI runs it with the heavy cases
def test_batch1_projections_read_from_their_stacks(monkeypatch):
    """At batch 1 the unrolled pallas step runs every dense projection (the fused KDA input, o_proj,
    the fused MLA input (q_a|kv_a|g), q_b, dense, the dense MLP, the MoE router) through the gemv kernel on its whole
    segment stack (`ops.layer_gemv`), with every layer's two RMSNorms applied by the kernels that read
    the normed rows (`expert_gemv.NormedRows`) and every KDA layer's gated output norm by o_proj's
    (`expert_gemv.GatedRows`), and gives the XLA step's logits and caches; at batch 2 it does not."""
    from ling_jax.ops import expert_gemv

    cfg = LingConfig.preset("debug", num_hidden_layers=6, num_experts=16)  # a router [64, 16] the kernel tiles
    params = init_params(cfg, seed=9)
    fused = _fused(cfg, params)
    pallas = dataclasses.replace(cfg, decode_impl="pallas", moe_impl="gather")
    real = expert_gemv.gathered_partials
    calls = []
    normed = []  # (rows, norm weight stack) of the calls on normed rows
    gated = []  # the calls on KDA outputs with their gated norm left to the kernel
    monkeypatch.setattr(expert_gemv, "gathered_partials", lambda *a, **k: calls.append(a[2][0].shape) or (
        isinstance(a[0], expert_gemv.NormedRows) and normed.append((a[0].shape, a[0].weight.shape))) or (
        isinstance(a[0], expert_gemv.GatedRows) and gated.append(a[0].shape)) or real(*a, **k))
    for b in (1, 2):
        prompt = jax.random.randint(jax.random.key(b), (b, 7), 0, cfg.vocab_size)
        cache, _ = _prefill(cfg, params, prompt, jnp.full((b,), 7), 12)
        tok = jnp.arange(3, 3 + b, dtype=jnp.int32)
        c_want, want = _step(cfg, params, cache, tok, True)
        calls.clear()
        normed.clear()
        gated.clear()
        c_got, got = _step(pallas, fused, cache, tok, True)
        assert rel_l2(got, want) < 1e-5
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                             rtol=1e-4, atol=1e-5), c_got, c_want)
        if b == 2:
            assert not calls
            continue
        readers = 0  # the kernel's projections of a layer's input-normed and post-attention-normed rows
        for i in range(cfg.num_hidden_layers):
            lp = layer_params(cfg, fused, i)
            ws = [lp["attn"][FUSED_INPUT]]  # the KDA and MLA layers' fused input projections
            ws.append(lp["mlp"]["router" if cfg.ffn_of(i) == "moe" else "gate_up_proj"])
            readers += sum(w is not None and stackable(w, 0, w.dtype) for w in ws)
        assert readers >= 2 * cfg.num_hidden_layers
        assert len(normed) == readers and all(r == (1, cfg.hidden_size) and w[1:] == r[1:] for r, w in normed)
        n_kda = sum(m == "kda" for m, _ in cfg.layer_kinds)
        assert n_kda and gated == [(1, cfg.num_attention_heads * cfg.head_dim)] * n_kda
        want_shapes = set()  # every stackable projection of the decode params, by [C, O] and stack size
        for seg, sp in zip(cfg.segments, fused["segments"], strict=True):
            parts = [(sp, 1)] if seg.kind == "run" else [(sp["kda"], 2), (sp["mla"], 1)]
            for tree, lead in parts:
                # the projections the fused input holds are not read on their own
                fused_in = {"q_proj", "q_a_proj", "kv_a_proj", "g_proj"} if FUSED_INPUT in tree["attn"] else set()
                for sub, names in LINEAR_LEAVES.items():
                    for name in set(names) - fused_in:
                        w = tree[sub].get(name)
                        if stackable(w, lead, params["embed"].dtype):
                            want_shapes.add((int(np.prod(w.shape[:lead])), *w.shape[lead:]))
                r = tree["mlp"].get("router")  # float32, through the kernel too where it tiles
                if stackable(r, lead, getattr(r, "dtype", None)):
                    want_shapes.add((int(np.prod(r.shape[:lead])), *r.shape[lead:]))
        assert {(cfg.kda_dim, cfg.hidden_size), (cfg.hidden_size, cfg.hidden_size)} & {s[1:] for s in want_shapes}
        assert (cfg.hidden_size, cfg.num_experts) in {s[1:] for s in want_shapes}
        assert set(calls) == want_shapes  # whole segment stacks (the group's KDA layers: a stack of 2)

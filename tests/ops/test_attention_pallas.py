"""The fused MLA attention kernels (interpret mode on CPU) against `ops.attention.attention`, the
materialised XLA form with its boolean mask: outputs and the gradients of all five inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.ops.attention import attention, attention_mask
from ling_jax.ops.attention_pallas import Blocks, _visibility, documents, mla_attention_pallas
from tests.conftest import rel_l2

SMALL = Blocks(bq=16, bk=16, bq_dkv=16, bk_dkv=16, bq_dq=16, bk_dq=16)
MIXED = Blocks(bq=32, bk=16, bq_dkv=16, bk_dkv=32, bq_dq=32, bk_dq=16)
# key blocks taller than query blocks (and the reverse in dK/dV): the bounds' rounding matters here
TALL = Blocks(bq=16, bk=32, bq_dkv=32, bk_dkv=16, bq_dq=16, bk_dq=32)


def _inputs(b: int, t: int, h: int, dn: int, dr: int, dv: int, dtype, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 6)
    qn = jax.random.normal(ks[0], (b, t, h, dn), dtype)
    qr = jax.random.normal(ks[1], (b, t, h, dr), dtype)
    kn = jax.random.normal(ks[2], (b, t, h, dn), dtype)
    kr = jax.random.normal(ks[3], (b, t, dr), dtype)
    v = jax.random.normal(ks[4], (b, t, h, dv), dtype)
    do = jax.random.normal(ks[5], (b, t, h, dv), jnp.float32)
    return qn, qr, kn, kr, v, do


def _segments(b: int, t: int, cuts: list[list[int]]) -> jax.Array:
    seg = np.zeros((b, t), np.int32)
    for r, row in enumerate(cuts):
        for c in row:
            seg[r, c:] += 1
    return jnp.asarray(seg * 7 + 3)  # arbitrary ids: only changes mark documents


def _reference(qn, qr, kn, kr, v, valid, seg, scale):
    b, t, h, _ = qn.shape
    q = jnp.concatenate([qn, qr], -1)
    k = jnp.concatenate([kn, jnp.broadcast_to(kr[:, :, None], (*kn.shape[:3], kr.shape[-1]))], -1)
    idx = jnp.broadcast_to(jnp.arange(t), (b, t))
    return attention(q, k, v, attention_mask(idx, idx, valid, seg, seg), scale=scale)


def _ours(qn, qr, kn, kr, v, valid, seg, scale, blocks):
    doc_q, doc_k = documents(valid, seg, *qn.shape[:2])
    return mla_attention_pallas(qn, qr, kn, kr, v, doc_q, doc_k, scale=scale, blocks=blocks, interpret=True)


def _check(t, cuts, pad_front, dtype, tol_o, tol_g, blocks, b=2, h=2, dn=32, dr=16, dv=32):
    qn, qr, kn, kr, v, do = _inputs(b, t, h, dn, dr, dv, dtype)
    seg = _segments(b, t, cuts) if cuts is not None else None
    valid = None
    if pad_front:
        valid = jnp.asarray(np.arange(t)[None, :] >= np.array(pad_front)[:, None])
        do = do * valid[:, :, None, None]  # queries that see no key: zero cotangent, output not compared
    rows = np.ones((b, t), bool) if valid is None else np.asarray(valid)
    scale = (dn + dr) ** -0.5
    ref = functools.partial(_reference, valid=valid, seg=seg, scale=scale)
    ours = functools.partial(_ours, valid=valid, seg=seg, scale=scale, blocks=blocks)
    args = (qn, qr, kn, kr, v)
    o_ref, o = ref(*args), ours(*args)
    assert o.shape == o_ref.shape and o.dtype == v.dtype
    assert rel_l2(np.asarray(o, np.float32)[rows], np.asarray(o_ref, np.float32)[rows]) < tol_o

    def loss(fn, *a):
        return jnp.sum(fn(*a).astype(jnp.float32) * do)

    g_ref = jax.grad(functools.partial(loss, ref), argnums=range(5))(*args)
    g = jax.grad(functools.partial(loss, ours), argnums=range(5))(*args)
    # T=1: dq is 0 up to rounding, so its error is measured against the gradients' scale (dv's norm)
    floor = float(np.linalg.norm(np.asarray(g_ref[-1], np.float64)))
    for name, x, y in zip(("dq_nope", "dq_rope", "dk_nope", "dk_rope", "dv"), g, g_ref, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.linalg.norm(x - y) <= tol_g * max(np.linalg.norm(y), floor), name


@pytest.mark.parametrize("t, cuts, pad_front", [
    (1, None, None),
    (37, [[5, 20], [36]], None),  # segment boundaries at awkward places, a one-token last document
    pytest.param(64, [[16], [1, 2, 3]], None, marks=pytest.mark.heavy),  # a boundary on a block edge; one-token docs
    pytest.param(100, None, [0, 13], marks=pytest.mark.heavy),  # left padding (a row's first 13 keys invisible)
    (77, [[30], [40, 41]], [3, 0]),  # padding and segments
])
def test_matches_xla_float32(t, cuts, pad_front):
    _check(t, cuts, pad_front, jnp.float32, 1e-5, 1e-4, SMALL)


@pytest.mark.parametrize("blocks", [SMALL, MIXED, TALL], ids=["square", "mixed", "tall"])
def test_matches_xla_bfloat16(blocks):
    _check(70, [[9, 33], [50]], None, jnp.bfloat16, 2e-2, 3e-2, blocks)


@pytest.mark.parametrize("blocks", [MIXED, TALL], ids=["mixed", "tall"])
def test_long_documents_many_blocks(blocks):
    """Several query and key blocks per document, documents spanning block edges, skipped blocks."""
    _check(160, [[47, 112], [80]], None, jnp.float32, 1e-5, 1e-4, blocks, b=2, h=1, dn=16, dr=16, dv=16)


def test_tall_key_blocks():
    """Key blocks taller than query blocks: a wrong rounding of the loop bounds drops keys."""
    _check(75, [[5, 40], [33]], [0, 2], jnp.float32, 1e-5, 1e-4, TALL)


def test_bad_tiles_raise():
    with pytest.raises(ValueError, match="power of two"):
        Blocks(bq=96)


def test_documents():
    valid = jnp.asarray([[False, True, True, True, True]])
    seg = jnp.asarray([[5, 5, 9, 9, 5]])
    doc_q, doc_k = documents(valid, seg, 1, 5)
    np.testing.assert_array_equal(doc_q, [[0, 0, 1, 1, 2]])  # a repeated id after a change: a new document
    np.testing.assert_array_equal(doc_k, [[-1, 0, 1, 1, 2]])
    doc_q, doc_k = documents(None, None, 1, 3)
    np.testing.assert_array_equal(doc_q, [[0, 0, 0]])


def test_unsupported_head_dims_raise():
    qn, qr, kn, kr, v, _ = _inputs(1, 8, 1, 24, 16, 32, jnp.float32)
    doc = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="powers of two"):
        mla_attention_pallas(qn, qr, kn, kr, v, doc, doc, scale=1.0, interpret=True)


def test_triton_lowering(h200_lowering):
    """The kernels (forward and both backward launches) lower to Triton for an H200 at Ling's head
    dims (nope 128, rope 64, v 128) with the default tiles."""
    b, t, h = 1, 384, 2  # 3 x 128: whole-sequence blocks of a length that is not a power of two
    bf = jnp.bfloat16
    sd = jax.ShapeDtypeStruct

    def fn(qn, qr, kn, kr, v, doc):
        f = functools.partial(mla_attention_pallas, scale=0.07, interpret=False)
        o, vjp = jax.vjp(lambda *a: f(*a, doc, doc), qn, qr, kn, kr, v)
        return o, vjp(o)

    mlir = h200_lowering(fn, sd((b, t, h, 128), bf), sd((b, t, h, 64), bf), sd((b, t, h, 128), bf),
                         sd((b, t, 64), bf), sd((b, t, h, 128), bf), sd((b, t), jnp.int32))
    for name in ("mla_attention_fwd", "mla_attention_dkv", "mla_attention_dq"):
        assert name in mlir


def test_document_bounds():
    """`_visibility`'s start and end of each token's document (sorted document numbers per row, with
    pads after the last document) equal a direct scan, and lower without a while loop (on a GPU each
    step of one waits on the host)."""
    rng = np.random.default_rng(3)
    doc_BT = np.sort(rng.integers(0, 9, (3, 257)), axis=1).astype(np.int32)
    doc_BT[2] = 4  # one document over the whole row
    _, _, start, end = _visibility(jnp.asarray(doc_BT), jnp.asarray(doc_BT))
    for b, row in enumerate(doc_BT):
        want_start = [int(np.flatnonzero(row == d)[0]) for d in row]
        want_end = [int(np.flatnonzero(row == d)[-1]) + 1 for d in row]
        np.testing.assert_array_equal(start[b], want_start)
        np.testing.assert_array_equal(end[b], want_end)
    assert "while" not in jax.jit(_visibility).lower(jnp.asarray(doc_BT), jnp.asarray(doc_BT)).as_text()

"""The decode-sized routed-expert kernel (`ops.expert_gemv`) against plain einsums of gathered weights
(its use as `routed_experts(impl="gemv")` is tested with the other impls in test_layers.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.ops import expert_gemv
from ling_jax.ops.expert_gemv import GatedRows, add_partials, gathered_products, normed_rows, output_tile, supported
from ling_jax.ops.norms import gated_rms_norm, rms_norm


def _case(rng, m, e, c, o, dtype):
    x = jnp.asarray(rng.standard_normal((m, c)), dtype)
    ws = tuple(jnp.asarray(rng.standard_normal((e, c, o)) * 0.1, dtype) for _ in range(2))
    idx = jnp.asarray(rng.integers(0, e, m), jnp.int32)
    return x, idx, ws


@pytest.mark.parametrize("m,c,o", [(1, 64, 16), (5, 96, 48), (64, 160, 128)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-6)])
def test_products_equal_gathered_einsum(m, c, o, dtype, tol):
    """Awkward copy counts and widths whose tiles are not the largest ones (96 -> 32, 48 -> 16, 160 -> 32)."""
    x, idx, ws = _case(np.random.default_rng(m), m, 7, c, o, dtype)
    got = gathered_products(x, idx, ws)
    for g, w in zip(got, ws, strict=True):
        want = jnp.einsum("mc,mco->mo", x.astype(jnp.float32), w[idx].astype(jnp.float32), precision="highest")
        assert g.dtype == jnp.float32 and rel_l2(g, want) < tol


def test_each_token_row_serves_its_copies():
    """rows: copy m reads row rows[m] (the MoE's k choices per token read its row, no repeated x)."""
    rng = np.random.default_rng(7)
    x, _, ws = _case(rng, 3, 5, 64, 32, jnp.float32)
    idx = jnp.asarray(rng.integers(0, 5, 12), jnp.int32)
    got = gathered_products(x, idx, ws, rows=np.arange(12) // 4)
    for g, want in zip(got, gathered_products(jnp.repeat(x, 4, axis=0), idx, ws), strict=True):
        np.testing.assert_array_equal(g, want)
    with pytest.raises(ValueError, match="rows"):
        gathered_products(x, idx, ws, rows=np.arange(12) // 3)  # row 3 of 3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_extra_copies_read_the_second_stack(dtype):
    """extra: the copies from n_main on (one per token row) read output j from (stack_j, first column) — the shared
    expert's gate and up from one fused [C, 2O] matrix at columns 0 and O, in the routed launch."""
    rng = np.random.default_rng(8)
    r, k, e, c, o = 3, 2, 5, 64, 32
    x, _, ws = _case(rng, r, e, c, o, dtype)
    fused = jnp.asarray(rng.standard_normal((4, c, 2 * o)) * 0.1, dtype)  # 4 layers of a shared gate|up
    idx = jnp.asarray(np.concatenate([rng.integers(0, e, r * k), [2] * r]), jnp.int32)
    rows = np.concatenate([np.arange(r * k) // k, np.arange(r)])
    got = gathered_products(x, idx, ws, rows=rows, extra=((fused, 0), (fused, o)), n_main=r * k)
    f32 = jnp.float32
    for j, (g, w) in enumerate(zip(got, ws, strict=True)):
        routed = jnp.einsum("mc,mco->mo", jnp.repeat(x, k, 0).astype(f32), w[idx[:r * k]].astype(f32),
                            precision="highest")
        shared = x.astype(f32) @ fused[2, :, j * o:(j + 1) * o].astype(f32)
        assert g.shape == (r * k + r, o)
        assert rel_l2(g[:r * k], routed) < 1e-6 and rel_l2(g[r * k:], shared) < 1e-6
    with pytest.raises(ValueError, match="extra"):
        gathered_products(x, idx, ws, rows=rows, extra=((fused, o + 1), (fused, 0)), n_main=r * k)
    with pytest.raises(ValueError, match="extra"):
        gathered_products(x, idx, ws, rows=rows, extra=((fused, 0), (fused, o)))  # extra weights, no n_main


@pytest.mark.parametrize("traced", [False, True])
def test_offset_and_extra_index_from_the_operand(traced):
    """offset / extra_idx (the MoE's layer offset in the flattened stacks and the shared expert's layer,
    constants or traced): the main copies read idx + offset, those from n_main on expert extra_idx,
    exactly as with the [M] indices built in XLA; idx then holds only the n_main main copies."""
    rng = np.random.default_rng(9)
    r, k, e, c, o = 2, 3, 12, 64, 32
    x, _, ws = _case(rng, r, e, c, o, jnp.float32)
    fused = jnp.asarray(rng.standard_normal((4, c, 2 * o)) * 0.1, jnp.float32)
    sel = jnp.asarray(rng.integers(0, 4, r * k), jnp.int32)
    rows = np.concatenate([np.arange(r * k) // k, np.arange(r)])
    kw = dict(rows=rows, extra=((fused, 0), (fused, o)), n_main=r * k)

    def run(sel, offset, shared):
        return gathered_products(x, sel, ws, offset=offset, extra_idx=shared, **kw)

    got = jax.jit(run)(sel, 8, 3) if traced else run(sel, np.int32(8), np.int32(3))
    want = gathered_products(x, jnp.concatenate([sel + 8, jnp.full((r,), 3, jnp.int32)]), ws, **kw)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match="extra_idx"):
        gathered_products(x, jnp.concatenate([sel, sel[:r]]), ws, extra_idx=3, **kw)


@pytest.mark.parametrize("c", [96, 2048])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-3)])
def test_normed_rows_are_normalised_in_the_kernel(c, dtype, tol):
    """x as `NormedRows`: each program RMS-norms its tile of the row (with the row's 1 / RMS computed
    in XLA, the norm weight read from its stack at a traced layer) and the products equal those of the rows
    normed in XLA (`rms_norm`), the shared expert's extra copies included."""
    rng = np.random.default_rng(c)
    r, k, e, o = 2, 3, 4, 16
    x, _, ws = _case(rng, r, e, c, o, dtype)
    x = x * 3.0 + 0.5
    norm_LC = jnp.asarray(1.0 + 0.3 * rng.standard_normal((5, c)), dtype)
    fused = jnp.asarray(rng.standard_normal((5, c, 2 * o)) * 0.1, dtype)
    idx = jnp.asarray(np.concatenate([rng.integers(0, e, r * k), [1] * r]), jnp.int32)
    rows = np.concatenate([np.arange(r * k) // k, np.arange(r)])

    @jax.jit
    def both(layer):
        xs = normed_rows(x, norm_LC, layer, 1e-6)
        kw = dict(rows=rows, extra=((fused, 0), (fused, o)), n_main=r * k)
        return gathered_products(xs, idx, ws, **kw), gathered_products(xs.value(), idx, ws, **kw)

    got, want = both(jnp.int32(3))
    np.testing.assert_array_equal(normed_rows(x, norm_LC, jnp.int32(3), 1e-6).value(), rms_norm(x, norm_LC[3], 1e-6))
    for g, w in zip(got, want, strict=True):
        assert rel_l2(g, w) < tol
    with pytest.raises(ValueError, match="norm weights"):
        gathered_products(normed_rows(x, norm_LC[:, :-16], jnp.int32(0), 1e-6), idx[:r * k], ws, rows=rows[:r * k])
    with pytest.raises(ValueError, match="must stay last"):
        normed_rows(x, norm_LC, jnp.int32(0), 1e-6)[:, 0]


def test_normed_rows_keep_each_rows_scale_through_indexing_and_reshapes():
    """A row's 1 / RMS follows it through `NormedRows` indexing and reshapes (rows differ in scale)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)) * np.arange(1, 7).reshape(2, 3, 1), jnp.float32)
    norm_LC = jnp.asarray(1.0 + 0.3 * rng.standard_normal((2, 64)), jnp.float32)
    xs = normed_rows(x, norm_LC, jnp.int32(1), 1e-6)
    for got, rows in ((xs[:, 1], x[:, 1]), (xs[1], x[1]), (xs.reshape(6, 64), x.reshape(6, 64)),
                      (xs.reshape(3, 2, 64)[2, None], x.reshape(3, 2, 64)[2, None])):
        np.testing.assert_array_equal(got.value(), rms_norm(rows, norm_LC[1], 1e-6))


@pytest.mark.parametrize("s", [1, 7, 24, expert_gemv.MAX_ADDED_PARTIALS + 1])
def test_partial_sums_are_elementwise_adds(s):
    """`add_partials` gives the sum over the split, as elementwise adds of slices (which XLA fuses
    with the sum's consumers) up to MAX_ADDED_PARTIALS partials and as one reduce beyond."""
    parts = jnp.asarray(np.random.default_rng(s).standard_normal((s, 3, 40)), jnp.float32)
    got = add_partials(parts)
    np.testing.assert_allclose(got, np.asarray(parts, np.float64).sum(0), rtol=1e-5, atol=1e-6)
    prims = {e.primitive.name for e in jax.make_jaxpr(add_partials)(parts).eqns}
    assert ("reduce_sum" in prims) == (s > expert_gemv.MAX_ADDED_PARTIALS)


def test_unsupported_shapes_raise():
    assert not supported(64, 12) and not supported(24, 64) and supported(1536, 1280)
    x, idx, ws = _case(np.random.default_rng(0), 2, 3, 64, 12, jnp.float32)
    with pytest.raises(ValueError, match="no power-of-two tile"):
        gathered_products(x, idx, ws)


def test_triton_lowering(h200_lowering):
    """The kernel lowers to Triton for an H200 at the Ling-3.0-tiny and 3.1-flash expert shapes."""
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    def fn(x, i, a, b):
        return gathered_products(x, i, (a, b), interpret=False)

    def with_shared(x, i, a, b, gu):  # the shared expert as the last copy, from its fused gate|up
        return gathered_products(x, i, (a, b), rows=np.array([0] * 8 + [0]), extra=((gu, 0), (gu, a.shape[-1])),
                                 n_main=8, interpret=False)

    for e, c, o in ((128, 1536, 512), (512, 4096, 1280), (512, 1280, 4096), (24, 1536, 10368)):
        mlir = h200_lowering(fn, sd((8, c), bf), sd((8,), jnp.int32), sd((e, c, o), bf), sd((e, c, o), bf))
        assert "triton" in mlir
    mlir = h200_lowering(with_shared, sd((1, 1536), bf), sd((9,), jnp.int32), sd((128, 1536, 512), bf),
                         sd((128, 1536, 512), bf), sd((23, 1536, 1024), bf))
    assert "triton" in mlir

    def normed(x, norm, layer, i, a):  # the RMSNorm prologue at Ling-3.0-tiny's hidden size
        return gathered_products(normed_rows(x, norm, layer, 1e-6), i, (a,), interpret=False)

    mlir = h200_lowering(normed, sd((1, 1536), bf), sd((23, 1536), jnp.float32), sd((), jnp.int32),
                         sd((1,), jnp.int32), sd((23, 1536, 6272), bf))
    assert "triton" in mlir

    def gated(x, ss, z, norm, layer, i, a):  # a KDA layer's o_proj with its gated output norm (16 heads of 128)
        return gathered_products(GatedRows(x, ss, z, norm, layer, 8192, 1e-6), i, (a,), interpret=False)

    mlir = h200_lowering(gated, sd((1, 2048), bf), sd((1, 16, 4), jnp.float32), sd((1, 10240), bf),
                         sd((18, 128), jnp.float32), sd((), jnp.int32), sd((1,), jnp.int32), sd((18, 2048, 1536), bf))
    assert "triton" in mlir


@pytest.mark.parametrize("r,j", [(1, 4), (3, 2)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-3)])
def test_gated_rows_are_normalised_in_the_kernel(r, j, dtype, tol):
    """x as `GatedRows` (a KDA layer's output, 4 heads of 32, each head's sum of squares in j parts, the
    gate z read at a column offset of a wider array, the norm weight from its stack at a traced
    layer): the products equal those of the rows normed by `gated_rms_norm` in XLA."""
    rng = np.random.default_rng(r * 10 + j)
    h, v, o, z_col = 4, 32, 48, 24
    x = jnp.asarray(rng.standard_normal((r, h * v)) * np.arange(1, h + 1).repeat(v), dtype)  # heads differ in scale
    ss = jnp.sum(jnp.square(x.astype(jnp.float32)).reshape(r, h, j, v // j), -1)
    z = jnp.asarray(rng.standard_normal((r, z_col + h * v + 8)) * 2, dtype)
    norm = jnp.asarray(1.0 + 0.3 * rng.standard_normal((3, v)), jnp.float32)
    ws = (jnp.asarray(rng.standard_normal((2, h * v, o)) * 0.1, dtype),)
    idx = jnp.asarray([1] * r, jnp.int32)

    @jax.jit
    def both(layer):
        rows = GatedRows(x, ss, z, norm, layer, z_col, 1e-6)
        return gathered_products(rows, idx, ws), gathered_products(rows.value(), idx, ws), rows.value()

    got, want, normed = both(jnp.int32(2))
    z_RHV = z[:, z_col:z_col + h * v].reshape(r, h, v)
    want_normed = gated_rms_norm(x.reshape(r, h, v), z_RHV, norm[2], 1e-6).reshape(r, h * v)
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want_normed, np.float32), rtol=1e-5,
                               atol=1e-6)
    assert rel_l2(got[0], want[0]) < tol
    with pytest.raises(ValueError, match="GatedRows"):  # heads of 24: no tile of C inside one
        gathered_products(GatedRows(x[:, :96], ss, z, norm[:, :24], 0, z_col, 1e-6), idx, ws)
    with pytest.raises(ValueError, match="GatedRows"):  # the norm weight without its stack axis
        gathered_products(GatedRows(x, ss, z, norm[0], 0, z_col, 1e-6), idx, ws)
    with pytest.raises(ValueError, match="rows stay"):
        GatedRows(x, ss, z, norm, 0, z_col, 1e-6).reshape(r * h, v)


@pytest.mark.parametrize("m,c,o", [(1, 1536, 128), (1, 256, 3072), (1, 1536, 10240), (9, 1536, 512), (1, 64, 48)])
def test_output_tiles_narrow_until_the_grid_fills_the_gpu(m, c, o):
    """Small weights get narrower output tiles, down to MIN_TILE, until the grid has the tuned least
    number of programs; a grid that has them keeps the widest tile. Every tile is a power of two dividing O."""
    from ling_jax.ops.pallas_gpu import DEFAULT_LAUNCH

    least = DEFAULT_LAUNCH.gemv_programs
    s = c // expert_gemv.MAX_BC
    bo = output_tile(m, s, o)
    widest = next(t for t in (128, 64, 32, 16) if o % t == 0)
    assert o % bo == 0 and bo & (bo - 1) == 0 and expert_gemv.MIN_TILE <= bo <= widest
    programs = m * s * (o // bo)
    if bo < widest:  # narrowed: the tile twice as wide had too few programs
        assert programs // 2 < least
    assert programs >= least or bo == expert_gemv.MIN_TILE or o % (bo // 2)
    assert output_tile(m, s, o, 1) == widest  # one program is always enough: the widest tile

"""The tile-aligned grouped matmul (`ops.aligned_gmm`, Mosaic-GPU interpreter here) and the MoE's
aligned row layout (`ops.moe.sorted_rows(aligned=True)`), against float32 XLA products per tile and
the dense routed-experts reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_l2

from ling_jax.ops import aligned_gmm
from ling_jax.ops import moe as moe_ops

TM = aligned_gmm.TILES.m


def per_tile(x_SK: jax.Array, w_GKN: jax.Array, tile_group_T: np.ndarray) -> np.ndarray:
    """Row tile t times w[tile_group[t]] in float64 numpy (zero where the group is -1)."""
    x = np.asarray(x_SK, np.float64).reshape(len(tile_group_T), x_SK.shape[0] // len(tile_group_T), -1)
    w = np.asarray(w_GKN, np.float64)
    return np.concatenate([x[t] @ w[g] if g >= 0 else np.zeros((x.shape[1], w.shape[2]))
                           for t, g in enumerate(tile_group_T)])


@pytest.mark.parametrize("dtype, k, n, tiles", [
    # K and N padded; one column tile, fewer k-steps than pipeline stages
    (jnp.bfloat16, 96, 200, aligned_gmm.TILES),
    (jnp.float16, 96, 200, aligned_gmm.TILES),
    (jnp.bfloat16, 320, 600, aligned_gmm.TILES),  # 5 k-steps through 4 stages, 3 column tiles (N padded to 768)
    (jnp.bfloat16, 320, 600, aligned_gmm.Tiles(band=2)),  # the persistent loop in bands of 2 column tiles
    (jnp.bfloat16, 320, 600, aligned_gmm.DECODE_TILES),  # half-height row tiles, 5 column tiles
])
def test_aligned_matmul_matches_per_tile_products(dtype, k, n, tiles):
    """Both weight layouts, widths that are not multiples of the tiles, tiles in any group order and
    tiles of group -1 (exact zeros: the interpreter fills what is never written with NaN)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rng = np.random.default_rng(0)
    tile_group = np.array([2, 0, -1, 2, 1])
    tm = tiles.m
    x = jnp.asarray(rng.standard_normal((len(tile_group) * tm, k)), dtype)
    w = jnp.asarray(rng.standard_normal((3, k, n)) * 0.1, dtype)
    want = per_tile(x, w, tile_group)
    mm = functools.partial(aligned_gmm.aligned_matmul, tiles=tiles,
                           interpret_params=plgpu.InterpretGPUParams(detect_races=True))
    y = mm(x, w, jnp.asarray(tile_group))
    y_t = mm(x, jnp.swapaxes(w, 1, 2), jnp.asarray(tile_group), transpose_rhs=True)
    for got in (y, y_t):
        assert got.shape == (len(tile_group) * tm, n) and got.dtype == dtype
        assert rel_l2(got.astype(jnp.float32), want) <= 5e-3
        assert np.all(np.asarray(got[2 * tm:3 * tm]) == 0)


def test_tiles_for_picks_decode_tiles_for_few_copies():
    decode = aligned_gmm.DECODE_TILES
    assert aligned_gmm.tiles_for(16 * 8) == aligned_gmm.tiles_for(aligned_gmm.DECODE_MAX_ROWS) == decode
    assert aligned_gmm.tiles_for(aligned_gmm.DECODE_MAX_ROWS + 1) == aligned_gmm.TILES


@pytest.mark.parametrize("d, i", [(1536, 512), (4096, 1280)])  # Ling-3.0-tiny's and Ling-3.1-flash's MoE
def test_aligned_matmul_lowers_for_hopper(d, i, monkeypatch):
    """Every grouped matmul of a training step lowers to a Mosaic-GPU kernel for CUDA that fits an
    H100/H200's shared memory (Mosaic checks it while lowering: 6 pipeline stages would not)."""
    monkeypatch.setattr(aligned_gmm, "_num_programs", lambda interpret: 132)  # an H200's SMs (none here)
    tiles_T = jax.ShapeDtypeStruct((8,), jnp.int32)

    def lower(rows_k, w_shape, transpose_rhs, tiles=aligned_gmm.TILES):
        fn = functools.partial(aligned_gmm.aligned_matmul, transpose_rhs=transpose_rhs, tiles=tiles, interpret=False)
        args = (jax.ShapeDtypeStruct((8 * tiles.m, rows_k), jnp.bfloat16), jax.ShapeDtypeStruct(w_shape, jnp.bfloat16))
        return jax.export.export(jax.jit(fn), platforms=["cuda"])(*args, tiles_T).mlir_module()

    for rows_k, w_shape, transpose_rhs in ((d, (4, d, i), False), (i, (4, i, d), False),  # forward
                                           (i, (4, d, i), True), (d, (4, i, d), True)):  # dX
        assert "mosaic_gpu" in lower(rows_k, w_shape, transpose_rhs)
        assert "mosaic_gpu" in lower(rows_k, w_shape, transpose_rhs, aligned_gmm.DECODE_TILES)
    with pytest.raises(ValueError, match="shared memory"):
        lower(d, (4, d, i), False, aligned_gmm.Tiles(steps=6))


def test_aligned_matmul_rejects_bad_operands():
    x = jnp.ones((2 * TM, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="tiles of"):
        aligned_gmm.aligned_matmul(x, jnp.ones((2, 64, 64), jnp.bfloat16), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="16-bit"):
        aligned_gmm.aligned_matmul(x.astype(jnp.float32), jnp.ones((2, 64, 64)), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="store window"):
        aligned_gmm.aligned_matmul(x, jnp.ones((2, 64, 64), jnp.bfloat16), jnp.zeros((2,), jnp.int32),
                                   tiles=aligned_gmm.Tiles(epi_n=48))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU has SMs: there is nothing to reject")
def test_aligned_matmul_compiled_for_a_cpu_is_rejected():
    x = jnp.ones((2 * TM, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="SM count"):  # compiled for a device (a CPU) that has no SMs
        aligned_gmm.aligned_matmul(x, jnp.ones((2, 64, 64), jnp.bfloat16), jnp.zeros((2,), jnp.int32), interpret=False)


def test_tile_layout_and_bound():
    gs = jnp.array([0, 130, 128, 1, 0], jnp.int32)
    first, group = aligned_gmm.tile_layout(gs, 6, TM)
    np.testing.assert_array_equal(first, [0, 0, 2, 3, 4])
    np.testing.assert_array_equal(group, [1, 1, 2, 3, -1, -1])
    # no while loop (jnp.searchsorted's default): on a GPU each of its steps waits on the host
    assert "while" not in jax.jit(aligned_gmm.tile_layout, static_argnums=(1, 2)).lower(gs, 6, TM).as_text()
    rng = np.random.default_rng(1)
    for _ in range(20):  # the bound holds for any split, including every row in one group
        g = int(rng.integers(1, 9))
        rows = int(rng.integers(1, 3000))
        cuts = np.sort(rng.integers(0, rows + 1, g - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [rows]]))
        assert int(np.sum(-(-sizes // TM))) <= aligned_gmm.num_tiles(rows, g, TM)


@pytest.mark.parametrize("skew, decode_max_rows", [(False, aligned_gmm.DECODE_MAX_ROWS),
                                                   (True, aligned_gmm.DECODE_MAX_ROWS), (True, 0)])
def test_sorted_rows_aligned_layout(skew, decode_max_rows, monkeypatch):
    """Every computed copy sits in a tile of its own expert and the row maps invert each other;
    rows holding no copy, and copies of other devices' experts, point past the end. The tiles are
    those `tiles_for` picks for the 1200 copies (decode tiles, or with decode_max_rows=0 TILES)."""
    monkeypatch.setattr(aligned_gmm, "DECODE_MAX_ROWS", decode_max_rows)
    rng = np.random.default_rng(2)
    n, k, e, n_local, first = 300, 4, 8, 5, 2
    idx = np.argsort(rng.random((n, e)), axis=1)[:, :k]
    if skew:  # every token picks expert 3 (local 1), its other picks stay distinct
        idx[:, 1:] = np.where(idx[:, 1:] == 3, idx[:, :1], idx[:, 1:])
        idx[:, 0] = 3
    local = idx - first
    key = np.where((local >= 0) & (local < n_local), local, n_local).reshape(-1)
    cap = n * min(k, n_local)
    rows = moe_ops.sorted_rows(jnp.asarray(key, jnp.int32), n_local, cap, aligned=True)
    assert rows.tiles == aligned_gmm.tiles_for(cap)
    tm = rows.tiles.m
    copy_S, slot_M = np.asarray(rows.copy_S), np.asarray(rows.slot_M)
    tile_group = np.asarray(rows.tile_group_T)
    s, m = len(copy_S), n * k
    assert s == aligned_gmm.num_tiles(cap, n_local, tm) * tm
    computed = key < n_local
    assert np.all(slot_M[~computed] == s)
    assert np.all(copy_S[slot_M[computed]] == np.flatnonzero(computed))
    assert np.all(tile_group[slot_M[computed] // tm] == key[computed])
    held = copy_S < m
    assert held.sum() == computed.sum() and np.all(slot_M[copy_S[held]] == np.flatnonzero(held))
    np.testing.assert_array_equal(rows.group_sizes_L, -(-np.bincount(key[computed], minlength=n_local) // tm) * tm)


def routed_equals_dense(idx, w, x, ws, first: int) -> None:
    """Values and gradients (x, the three weight stacks) of the aligned path = the dense reference,
    for all experts and for the share of experts first.. (one device's, maybe fewer than top-k)."""

    def whole(impl, x, *ws):
        return jnp.sum(moe_ops.routed_experts(x, idx, w, *ws, impl=impl, limit=0.5).astype(jnp.float32) ** 2)

    def share(impl, x, *ws):
        return jnp.sum(moe_ops.routed_partial(x, idx, w, first, *(a[first:] for a in ws), impl=impl, limit=0.5) ** 2)

    for fn in (whole, share):
        ref = jax.value_and_grad(functools.partial(fn, "dense"), argnums=(0, 1, 2, 3))(x, *ws)
        got = jax.jit(jax.value_and_grad(functools.partial(fn, "aligned"), argnums=(0, 1, 2, 3)))(x, *ws)
        assert abs(float(got[0]) - float(ref[0])) <= 3e-2 * abs(float(ref[0]))
        for a, b in zip(got[1], ref[1], strict=True):
            assert rel_l2(a.astype(jnp.float32), b.astype(jnp.float32)) <= 3e-2


@pytest.mark.heavy  # 20-70 s on 2 cores (default suite kept well under 20 min)
def test_routed_experts_aligned_equals_dense(mgpu_dw_on_cpu, monkeypatch):
    """Skewed routing (expert 2 gets nothing); the share of experts 2, 3. With the training tiles
    (TILES: 128-row tiles), where the other case takes the decode tiles `tiles_for` picks."""
    monkeypatch.setattr(aligned_gmm, "DECODE_MAX_ROWS", 0)
    rng = np.random.default_rng(6)
    n, d, e, i = 40, 64, 4, 64
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.2, jnp.bfloat16) for s in ((e, d, i), (e, d, i), (e, i, d))]
    idx = jnp.asarray(np.tile([1, 3], (n, 1)), jnp.int32).at[:5, 0].set(0)
    routed_equals_dense(idx, jnp.asarray(rng.random((n, 2)), jnp.float32), x, ws, first=2)


@pytest.mark.heavy
def test_routed_experts_aligned_equals_dense_multi_tile(mgpu_dw_on_cpu):
    """Expert 5 takes all 150 tokens (two tiles), expert 3 none; several k-steps and padded widths
    (I = 192); the share of experts 4, 5 is fewer than top-k (copies past its capacity not computed)."""
    rng = np.random.default_rng(6)
    n, d, e, i, k = 150, 128, 6, 192, 3
    dt = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((n, d)), dt)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.1, dt) for s in ((e, d, i), (e, d, i), (e, i, d))]
    other = np.where(rng.random((n, 2)) < 0.5, [0, 1], [2, 4])  # distinct picks, never expert 3
    idx = jnp.asarray(np.concatenate([np.full((n, 1), 5), other], axis=1), jnp.int32)
    routed_equals_dense(idx, jnp.asarray(rng.random((n, k)), jnp.float32), x, ws, first=4)


def test_auto_picks_aligned_on_hopper():
    from ling_jax.config import LingConfig
    from ling_jax.kernels import select

    cfg = LingConfig.preset("debug")
    assert select(cfg, dtype=jnp.bfloat16, platform="gpu").moe_for(4096) == "aligned"  # sm90
    assert select(cfg, dtype=jnp.float32, platform="gpu").moe_for(4096) == "ragged"
    with pytest.raises(ValueError, match="tile_group_T"):
        moe_ops.grouped_matmul(jnp.ones((TM, 8), jnp.bfloat16), jnp.ones((1, 8, 8)), jnp.array([TM]), impl="aligned")

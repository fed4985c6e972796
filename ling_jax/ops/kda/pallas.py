"""`kda_pallas`: chunked KDA as Pallas kernels, GPU (Triton) and TPU (Mosaic) lowerings.

Forward, three launches (kernel bodies in `pallas_chunk.py`; the chunk-parallel kernels loop over
blocks of key columns, `Cfg.bk` for the pairwise products, `Cfg.bk_kv` for the [C, K]-only work):
  1. `fwd_pairs` (chunk-parallel, grid B x H x NT): gate, q/k L2 norm, in-chunk cumulative decay, At,
     Aqk, the triangular inverse M; writes Aqk, M (and At for the backward), [C, C] per chunk.
  2. `fwd_wu` (chunk-parallel): W, U, Qg, Kg, gamma from the inputs and M.
  3. `fwd_state` (sequential over chunks, grid B x H x V/BV): the state S^T [BV, K] float32 stays on
     chip for the whole sequence; per chunk V' = U - W S, O = Qg S + Aqk V', S <- gamma S + Kg^T V'.
Backward, four launches (`jax.custom_vjp`; the residuals are the forward's per-chunk products, M,
At and the chunk states):
  4. `bwd_state` (sequential, reverse): dV' and the gradient of every chunk's state, dh0.
  5. `bwd_intra` (chunk-parallel, [C, C] level): dAqk, dL = -M^T dV' V'^T, dv, part of dbeta.
  6. `bwd_dqkg` (chunk-parallel, [C, K] level): the terms through the chunk states and W, Qg, Kg,
     gamma: float32 partial dq, dk, dG and the final dbeta.
  7. `bwd_pairs` (chunk-parallel, [C, K] level): adds the pairwise forms, reverse cumulative sum and
     gate: dq, dk, d(gate input) and per-chunk sums for a_log/dt_bias; the L2 norm's backward is
     finished by one elementwise XLA pass.
  (6 and 7 are one computation split in two launches: together their registers limited a program to
  one per SM, with spills.)

On GPU the kernels lower through Triton (`pl.pallas_call` + `pltriton.CompilerParams`); on TPU through
Mosaic (`pltpu.CompilerParams`, sequential kernels as an "arbitrary" grid axis with a VMEM state);
on CPU they run in interpret mode. Layouts: GPU keeps [B, T, H, D] (no transposes), TPU uses
[B, H, T, D] blocks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from ling_jax.ops.kda import pallas_chunk as pc
from ling_jax.ops.kda.gate import inv_l2_norm, kda_gate
from ling_jax.ops.kda.reference import segment_starts
from ling_jax.ops.platform import GPU_PLATFORMS, on_platform
from ling_jax.ops.saved import keep

F32 = jnp.float32
Cfg = pc.Cfg
# warps per program of each kernel group on GPU (Cfg.warps_*): "pairs" (fwd_pairs, bwd_intra), "wu",
# "state" (the sequential kernels), "dqkg", "bwd_pairs"
WARPS = {"pairs": 4, "wu": 4, "state": 4, "dqkg": 4, "bwd_pairs": 4}


def default_tiles(backend: str, chunk: int, dk: int, dv: int, exact: bool = False) -> dict:
    """The tile defaults of a call, as `Cfg` field values: value blocks `bv` (sequential kernels) and
    `bv_bwd`, key blocks `bk` (pairwise kernels) and `bk_kv`, `warps_<group>` per kernel group (WARPS)
    and the sequential kernels' pipeline `stages_state`; `exact`: float32 inputs. On GPU they are
    tuned at B=1, T=8192, K=V=128, bf16 (docs/kernels.md, "KDA chunked kernels"): for chunks of 64
    and more, 4 warps everywhere, bk 32, 64-wide value blocks, 2 stages; for chunks of 32 and less the
    [C, C] kernels and bwd_dqkg at 2 warps, bk 64, and 32-wide value blocks and 3 stages for the
    sequential kernels (whose step count doubles: more, smaller programs keep more of them in flight).
    float32 takes bwd_dqkg at 2 warps at every chunk size: at 4 (chunk 64, bk_kv 64, bv_bwd 64)
    Triton's lowering of it makes misaligned 16-byte shared-memory writes, a CUDA error
    (docs/kernels.md, "Measuring a kernel"). TPU: whole key blocks, bv 128."""
    if backend != "triton":
        tiles, warps = {"bv": min(dv, 128), "bv_bwd": min(dv, 64), "bk": dk, "bk_kv": dk, "stages_state": 2}, WARPS
    elif chunk <= 32:
        tiles = {"bv": min(dv, 32), "bv_bwd": min(dv, 64), "bk": min(dk, 64), "bk_kv": min(dk, 64), "stages_state": 3}
        warps = {**WARPS, "pairs": 2, "dqkg": 2}
    else:
        tiles = {"bv": min(dv, 64), "bv_bwd": min(dv, 64), "bk": min(dk, 32), "bk_kv": min(dk, 64), "stages_state": 2}
        warps = {**WARPS, "dqkg": 2} if exact else WARPS
    return {**tiles, **{f"warps_{group}": n for group, n in warps.items()}}


def _compiler_params(cfg: Cfg, warps: int, stages: int | None = None, sequential: bool = False,
                     key_blocks: bool = False):
    if cfg.backend == "triton":
        return pltriton.CompilerParams(num_warps=warps, num_stages=stages if stages else 1)
    sem = ("parallel",) * (4 if key_blocks else 3) + (("arbitrary",) if sequential else ())
    return pltpu.CompilerParams(dimension_semantics=sem)


# ---------------------------------------------------------------------------------------------
# block specs (chunk-parallel kernels: grid (B, H, NT); the backward's [C, K]-level kernels take one
# block of key columns per program, grid (K / bk, B, H, NT) on GPU: the key blocks of a chunk are
# adjacent in launch order (Triton's fastest axis), so their shared [C, V] and [C, C] inputs are read
# from L2; (B, H, NT, K / bk) on TPU, `Cfg.key_axis_last`)
# ---------------------------------------------------------------------------------------------


def _tok(cfg: Cfg, d: int) -> pl.BlockSpec:
    c = cfg.chunk
    if cfg.layout == "bthd":
        return pl.BlockSpec((None, c, None, d), lambda b, h, t: (b, t, h, 0))
    return pl.BlockSpec((None, None, c, d), lambda b, h, t: (b, h, t, 0))


def _kmap(cfg: Cfg, fn: Callable[..., tuple]) -> Callable[..., tuple]:
    """An index map fn(j, b, h, t) of the key-block grid, taking its indices in the grid's order
    (`Cfg.key_axis_last`: (B, H, NT, K / bk) on TPU, else (K / bk, B, H, NT))."""
    if cfg.key_axis_last:
        return lambda b, h, t, j: fn(j, b, h, t)
    return fn


def _tok_kb(cfg: Cfg, d: int) -> pl.BlockSpec:
    """[C, d] per token, the d-wide block numbered by the key-block grid axis."""
    c = cfg.chunk
    if cfg.layout == "bthd":
        return pl.BlockSpec((None, c, None, d), _kmap(cfg, lambda j, b, h, t: (b, t, h, j)))
    return pl.BlockSpec((None, None, c, d), _kmap(cfg, lambda j, b, h, t: (b, h, t, j)))


def _msk(cfg: Cfg) -> pl.BlockSpec:
    c = cfg.chunk
    if cfg.layout == "bthd":
        return pl.BlockSpec((None, c, None, 1), lambda b, h, t: (b, t, 0, 0))
    return pl.BlockSpec((None, None, c, 1), lambda b, h, t: (b, 0, t, 0))


def _chk(r: int, d: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, None, None, r, d), lambda b, h, t: (b, h, t, 0, 0))


def _chk_kb(cfg: Cfg, r: int, d: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, None, None, r, d), _kmap(cfg, lambda j, b, h, t: (b, h, t, 0, j)))


def _head(d: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, 1, d), lambda b, h, t: (h, 0, 0))


def _kb(cfg: Cfg, spec: pl.BlockSpec) -> pl.BlockSpec:
    """A chunk-parallel spec for the key-block grid (the same block for every key block)."""
    return pl.BlockSpec(spec.block_shape, _kmap(cfg, lambda j, b, h, t: spec.index_map(b, h, t)))


def _tok_shape(cfg: Cfg, b: int, h: int, d: int) -> tuple[int, ...]:
    t = cfg.n_chunks * cfg.chunk
    return (b, t, h, d) if cfg.layout == "bthd" else (b, h, t, d)


def _input_specs(cfg: Cfg, kb: int = 0) -> list[pl.BlockSpec]:
    """q, k, g, beta [, a_log, dt_bias] [, segment masks]; `kb` > 0: for the key-block grid, one
    block of kb key columns of q, k, g, dt_bias."""
    if kb:
        cols = _tok_kb(cfg, kb)
        specs = [cols, cols, cols, _kb(cfg, _tok(cfg, 1))]
        if cfg.gate is not None:
            specs += [_kb(cfg, _head(1)), pl.BlockSpec((None, 1, kb), _kmap(cfg, lambda j, b, h, t: (h, 0, j)))]
        return specs + [_kb(cfg, _msk(cfg))] * (3 if cfg.segments else 0)
    specs = [_tok(cfg, cfg.dk)] * 3 + [_tok(cfg, 1)]
    if cfg.gate is not None:
        specs += [_head(1), _head(cfg.dk)]
    if cfg.segments:
        specs += [_msk(cfg)] * 3
    return specs


def _inputs(cfg: Cfg, q, k, g, beta, a_log, dt, masks) -> list[jax.Array]:
    xs = [q, k, g, beta]
    if cfg.gate is not None:
        xs += [a_log, dt]
    return xs + list(masks)


# ---------------------------------------------------------------------------------------------
# launches
# ---------------------------------------------------------------------------------------------


def _num_heads(cfg: Cfg, x: jax.Array) -> tuple[int, int]:
    return x.shape[0], x.shape[2] if cfg.layout == "bthd" else x.shape[1]


def _fwd_pairs(cfg: Cfg, q, k, g, beta, a_log, dt, masks, store_at: bool):
    """Aqk (compute dtype), M (float32) [, At (float32) when `store_at`], [.., C] per token."""
    b, h = _num_heads(cfg, q)
    c = cfg.chunk
    out_shape = [jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, c), jnp.dtype(cfg.cd)),
                 jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, c), F32)]
    out_shape += out_shape[1:] if store_at else []
    return pl.pallas_call(
        functools.partial(pc.fwd_pairs_kernel, cfg, store_at),
        out_shape=out_shape,
        grid=(b, h, cfg.n_chunks),
        in_specs=_input_specs(cfg),
        out_specs=[_tok(cfg, c)] * len(out_shape),
        compiler_params=_compiler_params(cfg, cfg.warps_pairs, cfg.stages_chunk),
        interpret=cfg.interpret,
        name="kda_fwd_pairs",
    )(*_inputs(cfg, q, k, g, beta, a_log, dt, masks))


def _fwd_wu(cfg: Cfg, q, k, v, g, beta, a_log, dt, masks, mmat):
    """W, U, Qg, Kg (compute dtype) and gamma [B, H, NT, 1, K] from part 1's M."""
    b, h = _num_heads(cfg, q)
    c, dk, dv, nt = cfg.chunk, cfg.dk, cfg.dv, cfg.n_chunks
    cd = jnp.dtype(cfg.cd)
    out_shape = [
        jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, dk), cd),  # W
        jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, dv), cd),  # U
        jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, dk), cd),  # Qg
        jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, dk), cd),  # Kg
        jax.ShapeDtypeStruct((b, h, nt, 1, dk), F32),  # gamma
    ]
    return pl.pallas_call(
        functools.partial(pc.fwd_wu_kernel, cfg),
        out_shape=out_shape,
        grid=(b, h, nt),
        in_specs=[*_input_specs(cfg), _tok(cfg, dv), _tok(cfg, c)],
        out_specs=[_tok(cfg, dk), _tok(cfg, dv), _tok(cfg, dk), _tok(cfg, dk), _chk(1, dk)],
        compiler_params=_compiler_params(cfg, cfg.warps_wu, cfg.stages_chunk),
        interpret=cfg.interpret,
        name="kda_fwd_wu",
    )(*_inputs(cfg, q, k, g, beta, a_log, dt, masks), v, mmat)


def _fwd_state(cfg: Cfg, w, u, qg, kg, aqk, gam, h0t, out_dtype, store_h: bool, store_vn: bool):
    """Sequential forward. h0t: [B, H, V, K] f32 (v-first). Returns (o, ht, h | None, vn | None)."""
    b, h = gam.shape[:2]
    c, dk, dv, nt, bv = cfg.chunk, cfg.dk, cfg.dv, cfg.n_chunks, cfg.bv
    nv = dv // bv
    out_shape = [jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, dv), out_dtype),
                 jax.ShapeDtypeStruct((b, h, dv, dk), F32)]
    if store_h:
        out_shape.append(jax.ShapeDtypeStruct((b, h, nt, dv, dk), jnp.dtype(cfg.hd)))
    if store_vn:
        out_shape.append(jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, dv), jnp.dtype(cfg.cd)))

    if cfg.backend == "triton":

        def kernel(w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gam_ref, h0_ref, o_ref, ht_ref, *rest):
            ib, ih, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
            vs = pl.ds(iv * bv, bv)
            st = h0_ref[ib, ih, vs, :]

            def body(t, st):
                ts = pl.ds(t * c, c)
                if store_h:
                    rest[0][ib, ih, t, vs, :] = st.astype(rest[0].dtype)
                o, vn, st = pc.fwd_state_step(
                    cfg, st, w_ref[ib, ts, ih, :], u_ref[ib, ts, ih, vs], qg_ref[ib, ts, ih, :],
                    kg_ref[ib, ts, ih, :], aqk_ref[ib, ts, ih, :], gam_ref[ib, ih, t])
                o_ref[ib, ts, ih, vs] = o.astype(o_ref.dtype)
                if store_vn:
                    rest[-1][ib, ts, ih, vs] = vn.astype(rest[-1].dtype)
                return st

            st = jax.lax.fori_loop(0, nt, body, st)
            ht_ref[ib, ih, vs, :] = st

        return pl.pallas_call(
            kernel, out_shape=out_shape, grid=(b, h, nv),
            compiler_params=_compiler_params(cfg, cfg.warps_state, cfg.stages_state),
            interpret=cfg.interpret, name="kda_fwd_state",
        )(w, u, qg, kg, aqk, gam, h0t)

    def tkernel(w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gam_ref, h0_ref, o_ref, ht_ref, *rest):
        st_ref = rest[-1]
        rest = rest[:-1]
        t = pl.program_id(3)

        @pl.when(t == 0)
        def _():
            st_ref[...] = h0_ref[...]

        st = st_ref[...]
        if store_h:
            rest[0][...] = st.astype(rest[0].dtype)
        o, vn, st = pc.fwd_state_step(cfg, st, w_ref[...], u_ref[...], qg_ref[...], kg_ref[...],
                                      aqk_ref[...], gam_ref[...])
        o_ref[...] = o.astype(o_ref.dtype)
        if store_vn:
            rest[-1][...] = vn.astype(rest[-1].dtype)
        st_ref[...] = st

        @pl.when(t == nt - 1)
        def _():
            ht_ref[...] = st

    def tspec(d, vblock=False):
        if vblock:
            return pl.BlockSpec((None, None, c, bv), lambda ib, ih, iv, t: (ib, ih, t, iv))
        return pl.BlockSpec((None, None, c, d), lambda ib, ih, iv, t: (ib, ih, t, 0))

    sspec = pl.BlockSpec((None, None, bv, dk), lambda ib, ih, iv, t: (ib, ih, iv, 0))
    in_specs = [tspec(dk), tspec(dv, True), tspec(dk), tspec(dk), tspec(c),
                pl.BlockSpec((None, None, None, 1, dk), lambda ib, ih, iv, t: (ib, ih, t, 0, 0)), sspec]
    out_specs = [tspec(dv, True), sspec]
    if store_h:
        out_specs.append(pl.BlockSpec((None, None, None, bv, dk),
                                      lambda ib, ih, iv, t: (ib, ih, t, iv, 0)))
    if store_vn:
        out_specs.append(tspec(dv, True))
    return pl.pallas_call(
        tkernel, out_shape=out_shape, grid=(b, h, nv, nt), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((bv, dk), F32)],
        compiler_params=_compiler_params(cfg, 0, sequential=True),
        interpret=cfg.interpret, name="kda_fwd_state",
    )(w, u, qg, kg, aqk, gam, h0t)


def _bwd_state(cfg: Cfg, qg, w, kg, aqk, gam, do, dht, dcs):
    """Reverse sequential pass. dht: [B, H, V, K] f32; dcs: cotangents of the chunk states
    [B, H, NT, V, K] or None. Returns (dh [B, H, NT, V, K], dvn, dh0 [B, H, V, K])."""
    b, h = gam.shape[:2]
    c, dk, dv, nt, bv = cfg.chunk, cfg.dk, cfg.dv, cfg.n_chunks, cfg.bv
    nv = dv // bv
    cd = jnp.dtype(cfg.cd)
    out_shape = [jax.ShapeDtypeStruct((b, h, nt, dv, dk), cd),
                 jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, dv), cd),
                 jax.ShapeDtypeStruct((b, h, dv, dk), F32)]
    args = [qg, w, kg, aqk, gam, do, dht] + ([] if dcs is None else [dcs])

    if cfg.backend == "triton":

        def kernel(qg_ref, w_ref, kg_ref, aqk_ref, gam_ref, do_ref, dht_ref, *rest):
            dcs_ref = rest[0] if dcs is not None else None
            dh_ref, dvn_ref, dh0_ref = rest[-3:]
            ib, ih, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
            vs = pl.ds(iv * bv, bv)
            dst = dht_ref[ib, ih, vs, :]

            def body(i, dst):
                t = nt - 1 - i
                ts = pl.ds(t * c, c)
                dh_ref[ib, ih, t, vs, :] = dst.astype(dh_ref.dtype)
                dvn, dst = pc.bwd_state_step(
                    cfg, dst, qg_ref[ib, ts, ih, :], w_ref[ib, ts, ih, :], kg_ref[ib, ts, ih, :],
                    aqk_ref[ib, ts, ih, :], gam_ref[ib, ih, t], do_ref[ib, ts, ih, vs])
                dvn_ref[ib, ts, ih, vs] = dvn.astype(dvn_ref.dtype)
                if dcs_ref is not None:
                    dst = dst + dcs_ref[ib, ih, t, vs, :]
                return dst

            dst = jax.lax.fori_loop(0, nt, body, dst)
            dh0_ref[ib, ih, vs, :] = dst

        return pl.pallas_call(
            kernel, out_shape=out_shape, grid=(b, h, nv),
            compiler_params=_compiler_params(cfg, cfg.warps_state, cfg.stages_state),
            interpret=cfg.interpret, name="kda_bwd_state",
        )(*args)

    def tkernel(qg_ref, w_ref, kg_ref, aqk_ref, gam_ref, do_ref, dht_ref, *rest):
        dst_ref = rest[-1]
        dcs_ref = rest[0] if dcs is not None else None
        dh_ref, dvn_ref, dh0_ref = rest[-4:-1]
        i = pl.program_id(3)

        @pl.when(i == 0)
        def _():
            dst_ref[...] = dht_ref[...]

        dst = dst_ref[...]
        dh_ref[...] = dst.astype(dh_ref.dtype)
        dvn, dst = pc.bwd_state_step(cfg, dst, qg_ref[...], w_ref[...], kg_ref[...], aqk_ref[...],
                                     gam_ref[...], do_ref[...])
        dvn_ref[...] = dvn.astype(dvn_ref.dtype)
        if dcs_ref is not None:
            dst = dst + dcs_ref[...]
        dst_ref[...] = dst

        @pl.when(i == nt - 1)
        def _():
            dh0_ref[...] = dst

    def rev(d, vblock=False):
        if vblock:
            return pl.BlockSpec((None, None, c, bv), lambda ib, ih, iv, i: (ib, ih, nt - 1 - i, iv))
        return pl.BlockSpec((None, None, c, d), lambda ib, ih, iv, i: (ib, ih, nt - 1 - i, 0))

    sspec = pl.BlockSpec((None, None, bv, dk), lambda ib, ih, iv, i: (ib, ih, iv, 0))
    cspec = pl.BlockSpec((None, None, None, bv, dk), lambda ib, ih, iv, i: (ib, ih, nt - 1 - i, iv, 0))
    in_specs = [rev(dk), rev(dk), rev(dk), rev(c),
                pl.BlockSpec((None, None, None, 1, dk), lambda ib, ih, iv, i: (ib, ih, nt - 1 - i, 0, 0)),
                rev(dv, True), sspec] + ([] if dcs is None else [cspec])
    return pl.pallas_call(
        tkernel, out_shape=out_shape, grid=(b, h, nv, nt), in_specs=in_specs,
        out_specs=[cspec, rev(dv, True), sspec],
        scratch_shapes=[pltpu.VMEM((bv, dk), F32)],
        compiler_params=_compiler_params(cfg, 0, sequential=True),
        interpret=cfg.interpret, name="kda_bwd_state",
    )(*args)


def _bwd_intra(cfg: Cfg, beta, masks, v, do, vn, dvn, mmat, at):
    b, h = _num_heads(cfg, v)
    c, dv = cfg.chunk, cfg.dv
    out_shape = [
        jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, c), F32),  # X
        jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, c), F32),  # Y
        jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, 1), F32),  # dbeta (partial)
        jax.ShapeDtypeStruct(_tok_shape(cfg, b, h, dv), v.dtype),  # dv
    ]
    return pl.pallas_call(
        functools.partial(pc.bwd_intra_kernel, cfg),
        out_shape=out_shape,
        grid=(b, h, cfg.n_chunks),
        in_specs=[_tok(cfg, 1), *([_msk(cfg)] * len(masks)), _tok(cfg, dv), _tok(cfg, dv), _tok(cfg, dv),
                  _tok(cfg, dv), _tok(cfg, c), _tok(cfg, c)],
        out_specs=[_tok(cfg, c), _tok(cfg, c), _tok(cfg, 1), _tok(cfg, dv)],
        compiler_params=_compiler_params(cfg, cfg.warps_pairs, cfg.stages_chunk),
        interpret=cfg.interpret,
        name="kda_bwd_intra",
    )(beta, *masks, v, do, vn, dvn, mmat, at)


def _bwd_grid(cfg: Cfg, q: jax.Array, bk: int) -> tuple[int, int, int, int]:
    b, h = _num_heads(cfg, q)
    if cfg.key_axis_last:
        return b, h, cfg.n_chunks, cfg.dk // bk
    return cfg.dk // bk, b, h, cfg.n_chunks


def _bwd_dqkg(cfg: Cfg, q, k, g, beta, a_log, dt, masks, norms, do, vn, dvn, hs, dh, mm_):
    """The state terms, one block of key columns per program: float32 partial dq_hat, dk_hat, dG
    [.., K] and dbeta's share of every key block [K / bk, .., 1]."""
    bk = cfg.bk_kv
    grid = _bwd_grid(cfg, q, bk)
    c, dv = cfg.chunk, cfg.dv
    out_shape = [jax.ShapeDtypeStruct(q.shape, F32)] * 3 + [jax.ShapeDtypeStruct((cfg.dk // bk, *beta.shape), F32)]
    if cfg.layout == "bthd":  # dbeta's share of each key block: the block index leads (TPU lane blocks)
        dbk_spec = pl.BlockSpec((None, None, c, None, 1), _kmap(cfg, lambda j, b, h, t: (j, b, t, h, 0)))
    else:
        dbk_spec = pl.BlockSpec((None, None, None, c, 1), _kmap(cfg, lambda j, b, h, t: (j, b, h, t, 0)))
    in_specs = [*_input_specs(cfg, kb=bk), *[_kb(cfg, _tok(cfg, 1))] * len(norms),
                *[_kb(cfg, _tok(cfg, dv))] * 3, _chk_kb(cfg, dv, bk), _chk_kb(cfg, dv, bk), _kb(cfg, _tok(cfg, c))]
    return pl.pallas_call(
        functools.partial(pc.bwd_dqkg_kernel, cfg),
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=[_tok_kb(cfg, bk)] * 3 + [dbk_spec],
        compiler_params=_compiler_params(cfg, cfg.warps_dqkg, cfg.stages_chunk, key_blocks=True),
        interpret=cfg.interpret,
        name="kda_bwd_dqkg",
    )(*_inputs(cfg, q, k, g, beta, a_log, dt, masks), *norms, do, vn, dvn, hs, dh, mm_)


def _bwd_pairs(cfg: Cfg, q, k, g, beta, a_log, dt, masks, norms, x, y, dqp, dkp, dgp):
    """The pairwise terms on top of `_bwd_dqkg`'s, one block of key columns per program: dq, dk
    (with the norm: rq * dq_hat in float32, finished in `_core_bwd`), dg [, a_log / dt_bias
    per-chunk partial sums]."""
    bk = cfg.bk
    grid = _bwd_grid(cfg, q, bk)
    c, dk = cfg.chunk, cfg.dk
    qk_dtype = F32 if cfg.l2norm else q.dtype
    out_shape = [jax.ShapeDtypeStruct(q.shape, qk_dtype), jax.ShapeDtypeStruct(k.shape, qk_dtype),
                 jax.ShapeDtypeStruct(g.shape, g.dtype)]
    out_specs = [_tok_kb(cfg, bk)] * 3
    if cfg.gate is not None:
        b, h = _num_heads(cfg, q)
        out_shape += [jax.ShapeDtypeStruct((b, h, cfg.n_chunks, 1, dk), F32)] * 2
        out_specs += [_chk_kb(cfg, 1, bk)] * 2
    return pl.pallas_call(
        functools.partial(pc.bwd_pairs_kernel, cfg),
        out_shape=out_shape,
        grid=grid,
        in_specs=[*_input_specs(cfg, kb=bk), *[_kb(cfg, _tok(cfg, 1))] * len(norms), *[_kb(cfg, _tok(cfg, c))] * 2,
                  *[_tok_kb(cfg, bk)] * 3],
        out_specs=out_specs,
        compiler_params=_compiler_params(cfg, cfg.warps_bwd_pairs, cfg.stages_chunk, key_blocks=True),
        interpret=cfg.interpret,
        name="kda_bwd_pairs",
    )(*_inputs(cfg, q, k, g, beta, a_log, dt, masks), *norms, x, y, dqp, dkp, dgp)


# ---------------------------------------------------------------------------------------------
# custom_vjp core (inputs already padded to whole chunks and in the kernel layout)
# ---------------------------------------------------------------------------------------------


def _run_forward(cfg: Cfg, q, k, v, g, beta, h0t, a_log, dt, masks, states: bool, for_grad: bool):
    """The three forward launches; `states`: also the chunk states, `for_grad`: also the backward's
    residuals (At, the chunk states, V')."""
    aqk, mmat, *at = _fwd_pairs(cfg, q, k, g, beta, a_log, dt, masks, store_at=for_grad)
    w, u, qg, kg, gam = _fwd_wu(cfg, q, k, v, g, beta, a_log, dt, masks, mmat)
    outs = _fwd_state(cfg, w, u, qg, kg, aqk, gam, h0t, v.dtype, store_h=states or for_grad, store_vn=for_grad)
    return outs, (w, qg, kg, aqk, gam, mmat, *at)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _core(cfg: Cfg, want_states: bool, q, k, v, g, beta, h0t, a_log, dt, masks):
    outs, _ = _run_forward(cfg, q, k, v, g, beta, h0t, a_log, dt, masks, states=want_states, for_grad=False)
    o, ht = outs[:2]
    return (o, ht, outs[2]) if want_states else (o, ht)


def _core_fwd(cfg: Cfg, want_states: bool, q, k, v, g, beta, h0t, a_log, dt, masks):
    (o, ht, hs, vn), chunk_res = _run_forward(cfg, q, k, v, g, beta, h0t, a_log, dt, masks, states=True,
                                              for_grad=True)
    o, *kept = keep(o, *chunk_res, hs, vn)
    res = (q, k, v, g, beta, a_log, dt, masks, *kept)
    return ((o, ht, hs.astype(F32)) if want_states else (o, ht)), res


def _norm_bwd(x: jax.Array, r: jax.Array, rdxh: jax.Array) -> jax.Array:
    """dx = r dx_hat - x r^2 sum(x_hat dx_hat) = rdxh - x r^2 sum(x rdxh), from rdxh = r dx_hat."""
    xf = x.astype(F32)
    return (rdxh - xf * (r * r) * jnp.sum(xf * rdxh, axis=-1, keepdims=True)).astype(x.dtype)


def _core_bwd(cfg: Cfg, want_states: bool, res, cts):
    q, k, v, g, beta, a_log, dt, masks, w, qg, kg, aqk, gam, mmat, at, hs, vn = res
    do, dht = cts[0], cts[1]
    dcs = cts[2].astype(F32) if want_states else None
    cd = jnp.dtype(cfg.cd)
    do = do.astype(cd)
    dh, dvn, dh0 = _bwd_state(cfg, qg, w, kg, aqk, gam, do, dht.astype(F32), dcs)
    x, y, dbp, dv = _bwd_intra(cfg, beta, masks, v, do, vn, dvn, mmat, at)
    norms = (inv_l2_norm(q), inv_l2_norm(k)) if cfg.l2norm else ()
    dqp, dkp, dgp, dbk = _bwd_dqkg(cfg, q, k, g, beta, a_log, dt, masks, norms, do, vn, dvn, hs.astype(cd), dh,
                                   mmat)
    dbeta = (dbp + jnp.sum(dbk, axis=0)).astype(beta.dtype)
    outs = _bwd_pairs(cfg, q, k, g, beta, a_log, dt, masks, norms, x, y, dqp, dkp, dgp)
    dq, dk, dg = outs[:3]
    if cfg.l2norm:  # the L2 norm's backward, from the kernels' r * d(x_hat): x_hat = r x, r = 1 / ||x||
        dq = _norm_bwd(q, norms[0], dq)
        dk = _norm_bwd(k, norms[1], dk)
    if cfg.gate is not None:
        pa, pb = outs[3:5]
        da_log = jnp.sum(pa, axis=(0, 2, 3, 4)).reshape(a_log.shape).astype(a_log.dtype)
        ddt = jnp.sum(pb, axis=(0, 2)).reshape(dt.shape).astype(dt.dtype)
    else:
        da_log, ddt = jnp.zeros_like(a_log), jnp.zeros_like(dt)
    dmasks = jax.tree.map(jnp.zeros_like, masks)
    return dq, dk, dv, dg, dbeta, dh0, da_log, ddt, dmasks


_core.defvjp(_core_fwd, _core_bwd)


# ---------------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------------


def _segment_masks(segment_ids: jax.Array, c: int, t_pad: int) -> tuple[jax.Array, ...]:
    """[B, T] ids -> (m, e, s) [B, T_pad] float32: row continues the chunk's incoming state, row is
    in the chunk's last segment, monotone segment index."""
    b, t = segment_ids.shape
    idx = jnp.cumsum(segment_starts(segment_ids).astype(jnp.int32), axis=1)
    if t_pad != t:
        idx = jnp.pad(idx, ((0, 0), (0, t_pad - t)), mode="edge")
    ch = idx.reshape(b, t_pad // c, c)
    prev_last = jnp.concatenate([ch[:, :1, :1], ch[:, :-1, -1:]], axis=1)  # segment of incoming state
    m = (ch == prev_last).reshape(b, t_pad)
    e = (ch == ch[:, :, -1:]).reshape(b, t_pad)
    return m.astype(F32), e.astype(F32), idx.astype(F32)


def kda_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    return_chunk_states: bool = False,
    use_qk_l2norm: bool = False,
    a_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    lower_bound: float | None = -5.0,
    backend: str | None = None,
    interpret: bool | None = None,
    block_v: int | None = None,
    block_v_bwd: int | None = None,
    num_warps: Mapping[str, int] | None = None,
    block_k: int | None = None,
    block_k_kv: int | None = None,
) -> tuple[jax.Array, ...]:
    """KDA with the keyword signature of `reference.kda_reference`, plus the fused gate/L2 norm.

    `g` is the log decay, or the raw gate input when `a_log` is given (then `dt_bias` is required
    and the gate is `lower_bound * sigmoid(exp(a_log) * (g + dt_bias))`, or the softplus gate when
    `lower_bound` is None). `backend` ("triton" | "tpu") and `interpret`, where not given, are
    chosen where the program is lowered (`ops.platform`): Triton on a GPU, the TPU kernels on a TPU,
    the Triton-style kernels in interpret mode on CPU. chunk_size: 16, 32, 64 or 128.
    `block_v` / `block_v_bwd` / `block_k` / `block_k_kv`: tile sizes of the kernels (`Cfg.bv`,
    `Cfg.bv_bwd`, `Cfg.bk`, `Cfg.bk_kv`), defaults per backend and chunk size (`default_tiles`);
    `num_warps`: warps per program on GPU by kernel group, overriding the default (e.g. {"dqkg": 8}).

    The kernels factor the in-chunk decays by 16-row sub-chunks, exact while every step's log decay
    and the decay over the last 15 rows of every sub-chunk stay >= -`pallas_chunk.EXP_RANGE` (-75),
    i.e. always for per-step log decays in [`SAFE_LOG_DECAY`, 0] = [-5, 0], as the safe gate with a
    `lower_bound` in that interval guarantees. For any other gate (another bound, the softplus gate,
    a precomputed `g`) the condition is checked on the data (`decay_in_range`) and the outputs of a
    (sequence, head) are NaN where it fails; `kimi_delta_attention(impl="auto")` then runs the chunked path instead.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    if not pc.supports(c, dk, dv):
        raise ValueError(f"kda_pallas supports chunk_size 16, 32, 64 or 128 and power-of-two head dims >= 16, "
                         f"got chunk_size={c}, K={dk}, V={dv}")
    if a_log is not None and dt_bias is None:
        raise ValueError("a_log given without dt_bias")
    if backend is None or interpret is None:
        kw = dict(scale=scale, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
                  return_chunk_states=return_chunk_states, use_qk_l2norm=use_qk_l2norm, a_log=a_log, dt_bias=dt_bias,
                  lower_bound=lower_bound, block_v=block_v, block_v_bwd=block_v_bwd, num_warps=num_warps,
                  block_k=block_k, block_k_kv=block_k_kv)
        forms = {p: functools.partial(kda_pallas, **kw, backend=backend or ("tpu" if p == "tpu" else "triton"),
                                      interpret=p == "cpu" if interpret is None else interpret)
                 for p in ("cpu", "cuda", "tpu")}
        return on_platform(lambda p: forms["cuda" if p in GPU_PLATFORMS else p], q, k, v, g, beta)
    nt = max(1, math.ceil(t / c))
    t_pad = nt * c
    # bf16 operands run the dots in bf16; anything else (float32, float16: too narrow a range for the
    # kernels' factors) in float32
    cd = "bfloat16" if all(x.dtype == jnp.bfloat16 for x in (q, k, v)) else "float32"
    hd = "float32" if (cd == "float32" or return_chunk_states) else "bfloat16"
    gate = None if a_log is None else ("lb" if lower_bound is not None else "kimi")
    if set(num_warps or {}) - set(WARPS):
        raise ValueError(f"num_warps keys are {sorted(WARPS)}, got {sorted(num_warps or {})}")
    given = {"bv": block_v, "bv_bwd": block_v_bwd, "bk": block_k, "bk_kv": block_k_kv,
             **{f"warps_{group}": n for group, n in (num_warps or {}).items()}}
    tiles = {**default_tiles(backend, c, dk, dv, exact=cd == "float32"), **{name: n for name, n in given.items() if n}}
    cfg = Cfg(backend=backend, interpret=bool(interpret), chunk=c, t_valid=t, n_chunks=nt, dk=dk, dv=dv,
              scale=float(scale), gate=gate, lower_bound=float(lower_bound or 0.0),
              l2norm=bool(use_qk_l2norm), segments=segment_ids is not None, cd=cd, hd=hd, **tiles)

    def pad_t(x):
        if t_pad == t:
            return x
        return jnp.pad(x, [(0, 0), (0, t_pad - t)] + [(0, 0)] * (x.ndim - 2))

    qp, kp, vp, gp = (pad_t(x) for x in (q, k, v, g))
    bp = pad_t(beta)[..., None]
    masks: tuple[jax.Array, ...] = ()
    if segment_ids is not None:
        masks = _segment_masks(segment_ids, c, t_pad)
    if cfg.layout == "bthd":
        masks = tuple(x[:, :, None, None] for x in masks)
    else:
        qp, kp, vp, gp, bp = (jnp.swapaxes(x, 1, 2) for x in (qp, kp, vp, gp, bp))
        masks = tuple(x[:, None, :, None] for x in masks)
    h0 = jnp.zeros((b, h, dk, dv), F32) if initial_state is None else initial_state.astype(F32)
    h0t = jnp.swapaxes(h0, 2, 3)
    if gate is None:
        al = jnp.zeros((h, 1, 1), F32)
        dtb = jnp.zeros((h, 1, dk), F32)
    else:
        al = a_log.astype(F32).reshape(h, 1, 1)
        dtb = dt_bias.astype(F32).reshape(h, 1, dk)
    raw = _core(cfg, bool(return_chunk_states), qp, kp, vp, gp, bp, h0t, al, dtb, masks)
    o = jnp.swapaxes(raw[0], 1, 2) if cfg.layout == "bhtd" else raw[0]
    outs = [o[:, :t], jnp.swapaxes(raw[1], 2, 3)]  # o [B, T, H, V], final state [B, H, K, V]
    if return_chunk_states:
        outs.append(jnp.swapaxes(jnp.swapaxes(raw[2], 3, 4), 1, 2))  # [B, NT, H, K, V]
    if gate != "lb" or not pc.bounded_gate(lower_bound):  # not bounded by construction: NaN outside the range
        ok_BH = pc.decay_in_range(g if gate is None else kda_gate(g, a_log, dt_bias, lower_bound), per_sequence=True)
        shapes = [(b, 1, h, 1), (b, h, 1, 1), (b, 1, h, 1, 1)]
        outs = [jnp.where(ok_BH.reshape(s), x, jnp.nan).astype(x.dtype) for x, s in zip(outs, shapes, strict=False)]
    return tuple(outs)


kda_pallas.fuses_gate_and_norm = True  # type: ignore[attr-defined]

"""`kimi_delta_attention`: the stable signature behind which every KDA implementation sits.

Every implementation module exposes one function with the keyword signature of
`reference.kda_reference` (q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size,
return_chunk_states). The fused options (gate and L2 norm inside the kernel) are resolved here
for implementations that do not fuse them.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.ops.kda.gate import kda_gate, l2_normalize
from ling_jax.ops.kda.pallas_chunk import bounded_gate, decay_in_range, supports
from ling_jax.ops.platform import GPU_PLATFORMS, on_platform

IMPLS = ("auto", "reference", "chunked", "pallas")
DEFAULT_CHUNK = 64  # `chunk_size` of `kimi_delta_attention` unless given
GPU_KERNEL_CHUNK = 32  # the chunk the Pallas kernels run at on a GPU (`kernel_chunk`)
_MODULES = {
    "reference": ("ling_jax.ops.kda.reference", "kda_reference"),
    "chunked": ("ling_jax.ops.kda.chunked", "kda_chunked"),
    "pallas": ("ling_jax.ops.kda.pallas", "kda_pallas"),
}


def pallas_safe_gate(fused_gate: bool, lower_bound: float | None) -> bool:
    """Whether the decay is bounded, by construction, inside the range the Pallas kernels represent
    exactly: the fused safe gate with SAFE_LOG_DECAY (-5) <= lower bound <= 0 (Ling-3's is -5)."""
    return fused_gate and bounded_gate(lower_bound)


def kernel_chunk(chunk_size: int, gpu: bool) -> int:
    """The chunk the Pallas kernels run a call of `chunk_size` at: GPU_KERNEL_CHUNK on a GPU where it
    divides `chunk_size` (the faster chunk there: docs/kernels.md, "KDA chunked kernels"), else
    `chunk_size`. The result is the same up to rounding; the chunk states asked for are taken every
    `chunk_size / GPU_KERNEL_CHUNK` kernel chunks."""
    return GPU_KERNEL_CHUNK if gpu and chunk_size % GPU_KERNEL_CHUNK == 0 else chunk_size


def kimi_delta_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    impl: str = "auto",
    chunk_size: int = DEFAULT_CHUNK,
    segment_ids: jax.Array | None = None,
    return_chunk_states: bool = False,
    use_qk_l2norm: bool = False,
    a_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    lower_bound: float | None = -5.0,
) -> tuple[jax.Array, ...]:
    """Gated delta-rule attention with per-channel decay (ARCHITECTURE.md §2.4 step 9).

    q, k: [B, T, H, K] (used as given unless `use_qk_l2norm`); v: [B, T, H, V];
    g: [B, T, H, K] log decay <= 0, or, when `a_log` is given, the gate pre-activation from which
    the gate `lower_bound * sigmoid(exp(a_log) * (g + dt_bias))` is computed; beta: [B, T, H];
    initial_state: [B, H, K, V] float32; segment_ids: [B, T] int, the state restarts from zero
    where the id changes (packed documents). `scale` and `lower_bound` are static numbers (kernel
    constants); a_log holds H values and dt_bias H * K. T may be 0 (the state passes through) and g
    may reach -inf (a decay to zero). Every argument is checked, with an error naming it.
    Returns (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32), plus the states
    entering each chunk [B, ceil(T / chunk_size), H, K, V] when `return_chunk_states`.
    `impl`: "reference", "chunked", "pallas" (the kernels: Triton where the program is lowered for a
    GPU, Mosaic where for a TPU, interpret mode on CPU, chosen at lowering: `ops.platform`) or "auto":
    where lowered for a GPU or TPU the kernels when the gate is bounded by construction
    (`pallas_safe_gate`) and the shapes `pallas_chunk.supports` them, else, on an unbounded gate,
    the kernels where the data keep the decay in their range (`decay_in_range`) and the chunked
    path where not; on CPU the chunked path. The kernels may run at a chunk dividing `chunk_size`
    (`kernel_chunk`: 32 on a GPU).
    """
    scale, lower_bound, a_log, dt_bias = _checked(q, k, v, g, beta, scale, initial_state, chunk_size, segment_ids,
                                                  a_log, dt_bias, lower_bound)
    if q.shape[1] == 0:  # no tokens: the state passes through
        return _empty(q, v, initial_state, return_chunk_states)
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {IMPLS}")
    opts = dict(scale=scale, initial_state=initial_state, chunk_size=chunk_size, segment_ids=segment_ids,
                return_chunk_states=return_chunk_states, use_qk_l2norm=use_qk_l2norm, a_log=a_log, dt_bias=dt_bias,
                lower_bound=lower_bound)
    if impl == "auto":
        chunked = functools.partial(kimi_delta_attention, impl="chunked", **opts)
        kernels = _accelerator_form(q, v, chunk_size, a_log is not None, lower_bound, opts)
        return on_platform(lambda p: chunked if p == "cpu" else kernels, q, k, v, g, beta)
    if impl != "pallas":
        return _run(impl, chunk_size, q, k, v, g, beta, **opts)
    forms = {p: functools.partial(_run, "pallas", kernel_chunk(chunk_size, p in GPU_PLATFORMS), **opts,
                                  backend="tpu" if p == "tpu" else "triton", interpret=p == "cpu")
             for p in ("cpu", "cuda", "tpu")}
    return on_platform(lambda p: forms["cuda" if p in GPU_PLATFORMS else p], q, k, v, g, beta)


def _accelerator_form(q: jax.Array, v: jax.Array, chunk_size: int, fused_gate: bool, lower_bound: float | None,
                      opts: dict) -> Callable[..., tuple[jax.Array, ...]]:
    """What impl "auto" runs where the program is lowered for a GPU or TPU (see `kimi_delta_attention`)."""
    run = functools.partial(kimi_delta_attention, **opts)
    if not supports(chunk_size, q.shape[-1], v.shape[-1]):
        return functools.partial(run, impl="chunked")
    if pallas_safe_gate(fused_gate, lower_bound):
        return functools.partial(run, impl="pallas")

    def checked(q, k, v, g, beta):
        g_log = g if opts["a_log"] is None else kda_gate(g, opts["a_log"], opts["dt_bias"], lower_bound)
        return jax.lax.cond(decay_in_range(g_log), functools.partial(run, impl="pallas"),
                            functools.partial(run, impl="chunked"), q, k, v, g, beta)

    return checked


def _run(impl: str, run_chunk: int, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
         chunk_size: int, return_chunk_states: bool, use_qk_l2norm: bool, a_log: jax.Array | None,
         dt_bias: jax.Array | None, lower_bound: float | None, **kw: object) -> tuple[jax.Array, ...]:
    """One implementation at chunk `run_chunk`, its chunk states taken every `chunk_size`."""
    module, name = _MODULES[impl]
    fn = getattr(importlib.import_module(module), name)
    kwargs = dict(kw, chunk_size=run_chunk, return_chunk_states=return_chunk_states)
    if getattr(fn, "fuses_gate_and_norm", False):
        outs = fn(q, k, v, g, beta, use_qk_l2norm=use_qk_l2norm, a_log=a_log, dt_bias=dt_bias,
                  lower_bound=lower_bound, **kwargs)
    else:
        if a_log is not None:
            g = kda_gate(g, a_log, dt_bias, lower_bound)
        if use_qk_l2norm:
            q, k = l2_normalize(q), l2_normalize(k)
        outs = fn(q, k, v, g, beta, **kwargs)
    if return_chunk_states and run_chunk != chunk_size:  # [B, NT_run, ...] -> the states entering each chunk
        outs = (*outs[:2], outs[2][:, :: chunk_size // run_chunk])
    return outs


def _static_number(name: str, x: object) -> float:
    """x as a Python float: `scale` and `lower_bound` are constants of the kernels (and of the gate's
    range check), so every implementation refuses traced values alike."""
    try:
        return float(x)
    except (TypeError, ValueError) as e:  # a jax ConcretizationTypeError is a TypeError
        got = "a traced value (keep it out of jit's arguments)" if isinstance(e, jax.errors.ConcretizationTypeError) \
            else type(x).__name__
        raise ValueError(f"{name} must be a static number (a Python float), got {got}") from None


def _checked(q, k, v, g, beta, scale, initial_state, chunk_size, segment_ids, a_log, dt_bias, lower_bound):
    """Every argument of `kimi_delta_attention` checked against q's [B, T, H, K] and v's V, with a
    message naming it (no implementation silently broadcasts, truncates or ignores one). Returns the
    scale (default K**-0.5) and lower bound as floats, a_log as [H] and dt_bias as [H * K]."""
    if q.ndim != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share one [B, T, H, K] shape; got {q.shape}, {k.shape}, {g.shape}")
    b, t, h, dk = q.shape
    if v.ndim != 4 or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] and beta [B, T, H]; got {v.shape}, {beta.shape}")
    dv = v.shape[-1]
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
    if initial_state is not None and (tuple(initial_state.shape) != (b, h, dk, dv)
                                      or not jnp.issubdtype(initial_state.dtype, jnp.floating)):
        raise ValueError(f"initial_state must be a float [B, H, K, V] = {[b, h, dk, dv]} array; got "
                         f"{initial_state.dtype}{list(initial_state.shape)}")
    if segment_ids is not None and (tuple(segment_ids.shape) != (b, t)
                                    or not (jnp.issubdtype(segment_ids.dtype, jnp.integer)
                                            or segment_ids.dtype == jnp.bool_)):
        raise ValueError(f"segment_ids must be an int (or bool) [B, T] = {[b, t]} array; got "
                         f"{segment_ids.dtype}{list(segment_ids.shape)}")
    if (a_log is None) != (dt_bias is None):
        raise ValueError("a_log and dt_bias come together (the fused gate); got only "
                         f"{'a_log' if dt_bias is None else 'dt_bias'}")
    if a_log is not None:
        if a_log.size != h or dt_bias.size != h * dk:
            raise ValueError(f"a_log must hold H = {h} values and dt_bias H * K = {h * dk}; got shapes "
                             f"{list(a_log.shape)}, {list(dt_bias.shape)}")
        a_log, dt_bias = a_log.reshape(h), dt_bias.reshape(h * dk)
    scale = dk**-0.5 if scale is None else _static_number("scale", scale)
    lower_bound = None if lower_bound is None else _static_number("lower_bound", lower_bound)
    return scale, lower_bound, a_log, dt_bias


def _empty(q: jax.Array, v: jax.Array, initial_state: jax.Array | None, chunk_states: bool) -> tuple[jax.Array, ...]:
    """The outputs for T = 0: no o rows, the initial state (or zeros) as the final state."""
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    state = jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    o = jnp.zeros((b, 0, h, dv), v.dtype)
    return (o, state, jnp.zeros((b, 0, h, dk, dv), jnp.float32)) if chunk_states else (o, state)

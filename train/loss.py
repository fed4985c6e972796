"""Cross-entropy of the lm_head's logits, chunk by chunk, with its gradient made in the same pass.

A [tokens, vocab] logits tensor never exists: the tokens go through in chunks of `CE_CHUNK`. Under
differentiation each chunk's softmax gradient is turned into dh and dW (summed in float32) right
away (a custom VJP), so the backward pass only scales them: the lm_head matmul runs once per chunk, not
again in the backward pass as it would under `jax.checkpoint`. On one GPU the log-sum-exp reads each
chunk's logits once (`ops.logsumexp`, a Triton kernel) instead of XLA's two passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ling_jax.ops.logsumexp import row_logsumexp
from train.data import IGNORE

LOGITS_DTYPES = ("float32", "bfloat16")  # what the lm_head matmul may write its logits in
CE_CHUNK = 4096  # tokens per chunk: its float32 logits [CE_CHUNK, vocab] are the largest temporary
F32 = jnp.float32


def cross_entropy_sum(h_ND: jax.Array, w_DV: jax.Array, labels_N: jax.Array, logits_dtype: str = "float32",
                      lse: str = "xla") -> jax.Array:
    """Sum over tokens with a label (not IGNORE) of -log softmax(h w)[label].

    The matmul writes its logits in `logits_dtype`; the softmax always sums in float32. "bfloat16"
    (MaxText's default) halves the traffic of the softmax passes over the [tokens, vocab] logits, at
    bf16's rounding of each logit (|error| <= |logit| / 256). `lse`: the row log-sum-exp's
    implementation (`ops.logsumexp.row_logsumexp`, "xla" or "pallas": `Kernels.logsumexp`)."""
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype={logits_dtype!r}: must be one of {LOGITS_DTYPES}")
    return _ce(h_ND, w_DV, labels_N, min(CE_CHUNK, h_ND.shape[0]), logits_dtype, lse)


def _chunks(h_ND: jax.Array, labels_N: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    n, d = h_ND.shape
    pad = -n % c
    h_JCD = jnp.pad(h_ND, ((0, pad), (0, 0))).reshape(-1, c, d)
    lab_JC = jnp.pad(labels_N, (0, pad), constant_values=IGNORE).reshape(-1, c)
    return h_JCD, lab_JC


def _nll(h_CD: jax.Array, w_DV: jax.Array, lab_C: jax.Array, logits_dtype: str, lse: str
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(summed nll, logits [C, V] in `logits_dtype`, float32 log-sum-exp [C]) of one chunk."""
    logits_CV = jnp.einsum("cd,dv->cv", h_CD, w_DV, preferred_element_type=logits_dtype)
    lse_C = row_logsumexp(logits_CV, impl=lse)
    tgt_C = jnp.take_along_axis(logits_CV, jnp.maximum(lab_C, 0)[:, None], axis=1)[:, 0].astype(F32)
    return jnp.sum(jnp.where(lab_C != IGNORE, lse_C - tgt_C, 0.0)), logits_CV, lse_C


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ce(h_ND: jax.Array, w_DV: jax.Array, labels_N: jax.Array, c: int, logits_dtype: str, lse: str) -> jax.Array:
    h_JCD, lab_JC = _chunks(h_ND, labels_N, c)
    w_DV = w_DV.astype(h_ND.dtype)

    def chunk(total, xs):
        return total + _nll(xs[0], w_DV, xs[1], logits_dtype, lse)[0], None

    return jax.lax.scan(chunk, F32(0.0), (h_JCD, lab_JC))[0]


def _ce_fwd(h_ND, w_DV, labels_N, c, logits_dtype, lse):
    n, d = h_ND.shape
    h_JCD, lab_JC = _chunks(h_ND, labels_N, c)
    wc_DV = w_DV.astype(h_ND.dtype)
    vocab = w_DV.shape[1]

    def chunk(carry, xs):
        total, dw_DV = carry
        h_CD, lab_C = xs
        nll, logits_CV, lse_C = _nll(h_CD, wc_DV, lab_C, logits_dtype, lse)
        # d nll / d logits = softmax - onehot(label); zero on rows without a label
        onehot_CV = jnp.arange(vocab, dtype=lab_C.dtype) == lab_C[:, None]
        dlogits_CV = jnp.where((lab_C != IGNORE)[:, None], jnp.exp(logits_CV.astype(F32) - lse_C[:, None]) - onehot_CV,
                               0.0)
        dlogits_CV = dlogits_CV.astype(h_CD.dtype)
        dh_CD = jnp.einsum("cv,dv->cd", dlogits_CV, wc_DV, preferred_element_type=F32)
        dw_DV = dw_DV + jnp.einsum("cd,cv->dv", h_CD, dlogits_CV, preferred_element_type=F32)
        return (total + nll, dw_DV), dh_CD

    (total, dw_DV), dh_JCD = jax.lax.scan(chunk, (F32(0.0), jnp.zeros(w_DV.shape, F32)), (h_JCD, lab_JC))
    return total, (dh_JCD.reshape(-1, d)[:n].astype(h_ND.dtype), dw_DV.astype(w_DV.dtype))


def _ce_bwd(c, logits_dtype, lse, res, g):
    dh_ND, dw_DV = res
    return (g * dh_ND).astype(dh_ND.dtype), (g * dw_DV).astype(dw_DV.dtype), None


_ce.defvjp(_ce_fwd, _ce_bwd)

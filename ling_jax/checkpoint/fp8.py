"""Block-FP8 (e4m3) weights: dequantization at load and quantization at export (ARCHITECTURE.md §4).

A quantized `X.weight` [N, K] comes with `X.weight_scale_inv` [ceil(N/bn), ceil(K/bk)], a
*multiplier* despite its name: W[n, c] = float32(Wq[n, c]) * S[n // bn, c // bk]. Edge blocks
are partial and use their own scale.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Shape of the block-scale grid of a [N, K] weight."""
    n, k = shape
    return (-(-n // block[0]), -(-k // block[1]))


def _expand(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    rows = np.repeat(scale, block[0], axis=0)[: shape[0]]
    return np.repeat(rows, block[1], axis=1)[:, : shape[1]]


def dequantize(wq: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 W from an FP8 [N, K] weight and its block scales (float32 multiply)."""
    if wq.ndim != 2:
        raise ValueError(f"block-FP8 weights must be 2-D, got shape {wq.shape}")
    return wq.astype(np.float32) * _expand(scale.astype(np.float32), wq.shape, block)


def quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(FP8 weight, float32 block scales) with scale = amax(block) / 448, round to nearest even."""
    w32 = np.asarray(w, np.float32)
    n, k = w32.shape
    sn, sk = scale_shape((n, k), block)
    padded = np.zeros((sn * block[0], sk * block[1]), np.float32)
    padded[:n, :k] = np.abs(w32)
    amax = padded.reshape(sn, block[0], sk, block[1]).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    wq = (w32 / _expand(scale, (n, k), block)).astype(FP8)
    return wq, scale

"""Moving one tensor between the HF checkpoint layout and ours (params.py's `Leaf.transform`)."""

from __future__ import annotations

import numpy as np

from ling_jax.params import Leaf


def transpose2d(x: np.ndarray, rows: int = 16) -> np.ndarray:
    """`x.T` as a new C-contiguous array, copied `rows` source rows at a time.

    Same bytes as `np.ascontiguousarray(x.T)`, faster on large 1/2/4-byte matrices (numpy's
    whole-array strided copy thrashes the cache on power-of-two shapes); copies raw bits, so it is
    exact for bfloat16 / float8.
    """
    n, k = x.shape
    bits = np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}") if x.dtype.itemsize in (1, 2, 4, 8) else x
    out = np.empty((k, n), bits.dtype)
    for i in range(0, n, rows):
        out[:, i : i + rows] = bits[i : i + rows].T
    return out.view(x.dtype)


def to_hf_layout(arr: np.ndarray, leaf: Leaf) -> np.ndarray:
    """One tensor from our layout to the checkpoint's."""
    if leaf.transform == "T":
        return transpose2d(arr)
    if leaf.transform == "conv":
        return arr.reshape(arr.shape[0], 1, arr.shape[1])
    return np.ascontiguousarray(arr)

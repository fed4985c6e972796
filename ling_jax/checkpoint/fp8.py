"""Block-FP8 (e4m3) weights: dequantization at load and quantization at export (ARCHITECTURE.md §4).

A quantized `X.weight` [N, K] comes with `X.weight_scale_inv` [ceil(N/bn), ceil(K/bk)], a
*multiplier* despite its name: W[n, c] = float32(Wq[n, c]) * S[n // bn, c // bk]. Edge blocks
are partial and use their own scale.

`BlockFP8` carries such a weight in our param pytree (value and scale in our `[in, out]` layout),
which is how `load_checkpoint` returns the layer weights of an FP8 checkpoint kept FP8-resident;
the model dequantizes them one layer at a time (`dense_weights`), inside its layer scans.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0


_DECODE = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)  # every e4m3 code -> its float32 value


def to_float32(wq: np.ndarray) -> np.ndarray:
    """`wq.astype(float32)` for e4m3 arrays through a 256-entry table (same values, a few times faster)."""
    return np.take(_DECODE, np.ascontiguousarray(wq).view(np.uint8))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Shape of the block-scale grid of a [N, K] weight."""
    n, k = shape
    return (-(-n // block[0]), -(-k // block[1]))


def _expand(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    rows = np.repeat(scale, block[0], axis=0)[: shape[0]]
    return np.repeat(rows, block[1], axis=1)[:, : shape[1]]


def dequantize(wq: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 W from an FP8 [N, K] weight and its block scales (float32 multiply).

    Multiplies in place one block row at a time, so the only temporary besides the float32
    result is one row of expanded scales (1/block[0] of the result).
    """
    if wq.ndim != 2:
        raise ValueError(f"block-FP8 weights must be 2-D, got shape {wq.shape}")
    w = to_float32(wq)
    cols = np.repeat(np.asarray(scale, np.float32), block[1], axis=1)[:, : wq.shape[1]]
    for i in range(cols.shape[0]):
        w[i * block[0] : (i + 1) * block[0]] *= cols[i]
    return w


SCALE_FMTS = (None, "ue8m0")  # quantization_config.scale_fmt values `quantize` writes


def quantize(w: np.ndarray, block: tuple[int, int], scale_fmt: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(FP8 weight, float32 block scales) with scale = amax(block) / 448, round to nearest even.

    `scale_fmt="ue8m0"` (ARCHITECTURE.md §4): each scale rounded up to a power of two, so the block
    still fits in ±448."""
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt={scale_fmt!r}: only null or 'ue8m0' is known")
    w32 = np.asarray(w, np.float32)
    n, k = w32.shape
    sn, sk = scale_shape((n, k), block)
    padded = np.zeros((sn * block[0], sk * block[1]), np.float32)
    padded[:n, :k] = np.abs(w32)
    amax = padded.reshape(sn, block[0], sk, block[1]).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    if scale_fmt == "ue8m0":
        scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
    wq = (w32 / _expand(scale, (n, k), block)).astype(FP8)
    return wq, scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockFP8:
    """A block-FP8 weight in our layout: `value` [..., K, N] e4m3 and `scale` [..., ceil(K/bk), ceil(N/bn)].

    `block` = (bk, bn) in our layout (an HF `[N, K]` weight with `weight_block_size` [bn, bk],
    transposed). Leading axes are the stack axes of the leaf (layers, experts). A pytree node:
    `value` and `scale` are its leaves, so it passes through `jax.tree` functions and `jit`.
    """

    value: Any
    scale: Any
    block: tuple[int, int] = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """W = float32(value) * scale of its block, then cast to `dtype` (exact float32 product)."""
        return dequantize_jax(self.value, self.scale, self.block, dtype)


def dequantize_jax(value: jax.Array, scale: jax.Array, block: tuple[int, int], dtype: Any = jnp.float32) -> jax.Array:
    """`dequantize` for stacked arrays in JAX: value [..., K, N], scale [..., ceil(K/bk), ceil(N/bn)]."""
    k, n = value.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block[0], axis=-2)[..., :k, :], block[1], axis=-1)[..., :n]
    return (value.astype(jnp.float32) * s).astype(dtype)


def is_block_fp8(x: Any) -> bool:
    """Whether a pytree node is an FP8-resident weight (the `is_leaf` of tree maps that must see it whole)."""
    return isinstance(x, BlockFP8)


def dense_weights(tree: Any, dtype: Any) -> Any:
    """`tree` with every `BlockFP8` leaf dequantized to `dtype` (float32 product, then the cast);
    other leaves unchanged. Called on one layer's params inside the layer, so only that layer's
    weights exist dequantized at a time."""
    return jax.tree.map(lambda x: x.dequantize(dtype) if is_block_fp8(x) else x, tree, is_leaf=is_block_fp8)

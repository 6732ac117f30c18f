"""4-bit weights quantized in blocks along their inputs (weight-only quantization).

A MatMul weight ``W`` of shape ``(K, N)`` (K inputs, N outputs) is held as ``(N, K)``: each
output's row of K inputs is cut into blocks of `block_size` consecutive inputs (the last block
padded when K is not a multiple), and every block gets its own scale and zero point:

    lo = min(0, min(block)), hi = max(0, max(block))
    scale = (hi - lo) / 15                      (float32; 1 for an all-zero block)
    zero_point = clip(round(-lo / scale), 0, 15)
    code = clip(round(w / scale) + zero_point, 0, 15)     (round half to even, float32)
    value = (code - zero_point) * scale

Asymmetric uint4, as onnxruntime's MatMulNBits reads it: its kernels at the default accuracy
level dequantize a block to float before the product, so a zero point costs nothing there,
and it lets a block whose values lean to one side use all 16 codes instead of 8 or 9.
The range holds 0 so that 0 is a code and the zero point a code too.

Packing (MatMulNBits and ONNX's UINT4): two codes a byte, the first in the low four bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "BITS", "LEVELS", "BlockQuant", "block_qparams", "dequantize_blocks", "pack_nibbles",
    "quantize_blocks", "quantize_rtn", "unpack_nibbles",
]

BITS = 4
LEVELS = 2**BITS - 1  # largest code


@dataclass(frozen=True)
class BlockQuant:
    """A weight quantized in blocks.

    Attributes:
        codes: uint8 codes, ``(N, blocks, block_size)``; the padding past K holds the zero
            point (it dequantizes to 0).
        scales: float32, ``(N, blocks)``.
        zero_points: uint8, ``(N, blocks)``.
        inputs: K, the weight's inputs before padding.
    """

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    inputs: int

    @property
    def block_size(self) -> int:
        return int(self.codes.shape[2])

    def dequantized(self) -> np.ndarray:
        """The float32 weight the codes stand for, ``(N, K)``."""
        values = dequantize_blocks(self.codes, self.scales, self.zero_points)
        return values.reshape(values.shape[0], -1)[:, : self.inputs]


def block_qparams(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale (float32) and zero point (uint8) of each block: the last axis of `values` is one
    block (padding excluded)."""
    v = np.asarray(values, dtype=np.float32)
    lo = np.minimum(v.min(axis=-1), np.float32(0))
    hi = np.maximum(v.max(axis=-1), np.float32(0))
    scale = ((hi - lo) / np.float32(LEVELS)).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    zero_point = np.clip(np.rint(-lo / scale), 0, LEVELS).astype(np.uint8)
    return scale, zero_point


def quantize_blocks(values: np.ndarray, scale: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
    """Codes of `values` ``(..., b)`` with one scale and zero point per block ``(...)``."""
    v = np.asarray(values, dtype=np.float32)
    q = np.rint(v / scale[..., None]) + zero_point[..., None].astype(np.float32)
    codes: np.ndarray = np.clip(q, 0, LEVELS).astype(np.uint8)
    return codes


def dequantize_blocks(codes: np.ndarray, scale: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
    """float32 values of codes ``(..., b)`` (DequantizeLinear's arithmetic)."""
    centred = codes.astype(np.float32) - zero_point[..., None].astype(np.float32)
    values: np.ndarray = (centred * scale[..., None]).astype(np.float32)
    return values


def _padded_blocks(weights: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`weights` ``(N, K)`` as ``(N, blocks, block_size)`` padded with zeros, and a mask of the
    real positions."""
    rows, inputs = weights.shape
    blocks = -(-inputs // block_size)
    padded = np.zeros((rows, blocks * block_size), dtype=np.float32)
    padded[:, :inputs] = weights
    real = np.zeros(blocks * block_size, dtype=bool)
    real[:inputs] = True
    return (padded.reshape(rows, blocks, block_size),
            real.reshape(blocks, block_size))


def quantize_rtn(weights: np.ndarray, block_size: int) -> BlockQuant:
    """`weights` ``(N, K)`` rounded to nearest, block by block."""
    w = np.asarray(weights, dtype=np.float32)
    blocks, real = _padded_blocks(w, block_size)
    # Padding is 0 and the range holds 0 anyway: it changes no block's parameters.
    scale, zero_point = block_qparams(blocks)
    codes = quantize_blocks(blocks, scale, zero_point)
    codes = np.where(real[None], codes, zero_point[..., None]).astype(np.uint8)
    return BlockQuant(codes, scale, zero_point, w.shape[1])


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Codes 0..15 along the last axis, two a byte, the first in the low bits (an odd count
    gets a zero high nibble in its last byte)."""
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2:
        c = np.concatenate([c, np.zeros(c.shape[:-1] + (1,), np.uint8)], axis=-1)
    packed: np.ndarray = (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
    return packed


def unpack_nibbles(packed: np.ndarray, count: int) -> np.ndarray:
    """The first `count` codes of each row of bytes packed by `pack_nibbles`."""
    p = np.asarray(packed, dtype=np.uint8)
    both = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[:-1] + (-1,))
    codes: np.ndarray = both[..., :count]
    return codes

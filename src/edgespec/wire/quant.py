"""8-bit blockwise quantization of hidden states (``Encoding.Q8``, docs/design.md 5.1).

Blocks of ``Q8_BLOCK`` values along the last axis, one float16 scale per block, int8 values in
[-127, 127]: 34 bytes per 32 values.
"""

from __future__ import annotations

import math

import numpy as np

from edgespec.wire.header import WireError

Q8_BLOCK = 32


def q8_layout(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, blocks per row) of a q8 matrix of ``shape``."""
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    return rows, -(-shape[-1] // Q8_BLOCK)


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise 8-bit quantization along the last axis.

    Returns (scales float16 [rows, blocks], values int8 [rows, blocks * Q8_BLOCK]); the last
    block is zero-padded. The scale is rounded to float16 *before* quantizing, so the decoded
    value is exactly ``scale * q`` and the error is bounded by half a step.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise WireError("q8 needs a non-empty last axis")
    if not np.all(np.isfinite(x)):
        raise WireError("hidden states contain NaN or inf")
    rows, blocks = q8_layout(x.shape)
    padded = np.zeros((rows, blocks * Q8_BLOCK), dtype=np.float32)
    padded[:, : x.shape[-1]] = x.reshape(rows, x.shape[-1])
    b = padded.reshape(rows, blocks, Q8_BLOCK)
    amax = np.abs(b).max(axis=2)
    scales = (amax / 127.0).astype(np.float16)
    if not np.all(np.isfinite(scales)):
        raise WireError("hidden state magnitude exceeds the q8 scale range (float16); use f32")
    s32 = scales.astype(np.float32)
    safe = np.where(s32 > 0, s32, 1.0)[:, :, None]
    q = np.clip(np.rint(b / safe), -127, 127).astype(np.int8)
    return scales, q.reshape(rows, blocks * Q8_BLOCK)


def dequantize_q8(scales: np.ndarray, values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of ``quantize_q8``: float32 array of ``shape``."""
    rows, blocks = q8_layout(shape)
    q = values.reshape(rows, blocks, Q8_BLOCK).astype(np.float32)
    out = (q * scales.reshape(rows, blocks, 1).astype(np.float32)).reshape(rows, blocks * Q8_BLOCK)
    return np.ascontiguousarray(out[:, : shape[-1]]).reshape(shape)

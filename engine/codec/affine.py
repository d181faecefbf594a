"""Affine KV codec: MLX's group-wise `mx.quantize` / `mx.dequantize` (mlx-lm's `kv_bits`).

Every `group_size` consecutive elements of a (..., head_dim) vector share a scale and a
bias (stored in the input's dtype); each element keeps a `bits`-bit integer packed into
uint32 words. Round-trip error is about a quarter of the group's scale on average and at
most one scale step (MLX rounds the bias so that zero is exact, which can move an edge
element past half a step).
Mutually exclusive with TurboQuant (DESIGN.md §3.2).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64)


class AffineEncoded(NamedTuple):
    """`mx.quantize`'s planes with the input's leading axes kept."""

    wq: mx.array  # uint32, (..., head_dim * bits // 32)
    scales: mx.array  # input dtype, (..., head_dim // group_size)
    biases: mx.array  # input dtype, (..., head_dim // group_size)


class AffineCodec:
    """Encode/decode (..., head_dim) vectors with group-wise affine quantization."""

    def __init__(self, bits: int, group_size: int) -> None:
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits {bits} is not supported; use one of {SUPPORTED_BITS}")
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(
                f"group_size {group_size} is not supported; use one of {SUPPORTED_GROUP_SIZES}"
            )
        self.bits = bits
        self.group_size = group_size

    def encode(self, x: mx.array) -> AffineEncoded:
        """Quantize the last axis, which must be a multiple of group_size."""
        if x.ndim == 0 or x.shape[-1] % self.group_size:
            raise ValueError(
                f"last axis of shape {x.shape} is not a multiple of group_size {self.group_size}"
            )
        lead, head_dim = x.shape[:-1], x.shape[-1]
        wq, scales, biases = mx.quantize(
            x.reshape(math.prod(lead), head_dim), group_size=self.group_size, bits=self.bits
        )
        num_groups = head_dim // self.group_size
        return AffineEncoded(
            wq=wq.reshape(*lead, head_dim * self.bits // 32),
            scales=scales.reshape(*lead, num_groups),
            biases=biases.reshape(*lead, num_groups),
        )

    def decode(self, encoded: AffineEncoded, dtype: mx.Dtype = mx.float32) -> mx.array:
        """Dequantize to (..., head_dim) in `dtype`."""
        wq, scales, biases = encoded
        lead, head_dim = wq.shape[:-1], wq.shape[-1] * 32 // self.bits
        rows = math.prod(lead)
        if rows == 0:  # mx.dequantize cannot take zero rows
            return mx.zeros((*lead, head_dim), dtype=dtype)
        x = mx.dequantize(
            wq.reshape(rows, wq.shape[-1]),
            scales.reshape(rows, scales.shape[-1]),
            biases.reshape(rows, biases.shape[-1]),
            group_size=self.group_size,
            bits=self.bits,
        )
        return x.reshape(*lead, head_dim).astype(dtype)

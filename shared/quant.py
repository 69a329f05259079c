"""Per-channel affine quantizer: each of the K columns gets its own [min, max] mapped onto 0..2^bits-1.

    q = PerChannelQuantizer.fit(coeffs, bits=8)
    planes = q.quantize(coeffs)        # [T, K] uint8 (uint16 for bits > 8)
    approx = q.dequantize(planes)      # float32, |approx - coeffs| <= q.step / 2 per channel
    q2 = PerChannelQuantizer.from_bytes(q.to_bytes())   # the parameters travel in the bitstream
"""
from __future__ import annotations

import dataclasses
import struct

import numpy as np

from .errors import BitstreamError, InvalidTensorError


@dataclasses.dataclass
class PerChannelQuantizer:
    lo: np.ndarray  # [K] float32, value mapped to 0
    step: np.ndarray  # [K] float32, value of one quantization level (> 0)
    bits: int = 8

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @classmethod
    def fit(cls, x: np.ndarray, bits: int = 8) -> "PerChannelQuantizer":
        if not 1 <= bits <= 16:
            raise InvalidTensorError(f"bits must be in 1..16, got {bits}")
        x = np.asarray(x, np.float32)
        if x.ndim != 2 or x.shape[0] == 0:
            raise InvalidTensorError(f"fit needs a non-empty [T, K] array, got shape {x.shape}")
        lo, hi = x.min(axis=0), x.max(axis=0)
        span = hi - lo
        # A constant channel still needs a positive step; any value reproduces it exactly.
        step = np.where(span > 0, span / ((1 << bits) - 1), 1.0).astype(np.float32)
        return cls(lo.astype(np.float32), step, bits)

    def quantize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != self.lo.shape[0]:
            raise InvalidTensorError(f"quantizer fitted for {self.lo.shape[0]} channels, got shape {x.shape}")
        q = np.rint((x - self.lo) / self.step)
        # Values outside the fitted range are clipped; fit() on the same tensor never clips.
        q = np.clip(q, 0, self.levels)
        return q.astype(np.uint8 if self.bits <= 8 else np.uint16)

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        if q.ndim != 2 or q.shape[1] != self.lo.shape[0]:
            raise InvalidTensorError(f"quantizer fitted for {self.lo.shape[0]} channels, got shape {q.shape}")
        return (q.astype(np.float32) * self.step + self.lo).astype(np.float32)

    def to_bytes(self) -> bytes:
        k = self.lo.shape[0]
        return struct.pack("<BI", self.bits, k) + self.lo.astype("<f4").tobytes() + self.step.astype("<f4").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, bits: int | None = None) -> "PerChannelQuantizer":
        """The parameters from to_bytes(), checked: bits (== `bits` when given), K against the
        length, every lo and step finite, steps positive, and the top level lo + step * levels finite."""
        if len(data) < 5:
            raise BitstreamError("chunk 'QPAR': quantizer parameters truncated")
        got_bits, k = struct.unpack_from("<BI", data)
        if not 1 <= got_bits <= 16 or (bits is not None and got_bits != bits):
            raise BitstreamError(f"chunk 'QPAR': quantizer bits {got_bits}, expected {bits or '1..16'}: corrupt")
        if len(data) != 5 + 8 * k:
            raise BitstreamError(f"chunk 'QPAR': expected {5 + 8 * k} bytes for K={k}, got {len(data)}")
        lo = np.frombuffer(data, "<f4", k, 5).astype(np.float32)
        step = np.frombuffer(data, "<f4", k, 5 + 4 * k).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            top = lo.astype(np.float64) + step.astype(np.float64) * ((1 << got_bits) - 1)
        if not (np.isfinite(lo).all() and np.isfinite(step).all() and (step > 0).all()
                and (np.abs(top) < np.finfo(np.float32).max).all()):
            raise BitstreamError("chunk 'QPAR': quantizer offsets or steps are not finite, or a step is not "
                                 "positive, or the top level overflows float32: the bitstream is corrupt")
        return cls(lo, step, got_bits)

"""Tile a [T, K] uint8 plane matrix into YUV 4:4:4 frames (F, 3, H, W) and back.

The matrix is cut into H x W tiles, row-major over (token block, component block); tile i becomes
plane i % 3 of frame i // 3. Neighbouring pixels are neighbouring tokens (vertically) and
neighbouring components (horizontally), which is what a codec's intra prediction can use.
Edges are padded by repeating the last row/column (cheaper to code than zeros) and the
padding is recorded in the layout so unpacking crops it exactly.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .errors import InvalidTensorError

DEFAULT_FRAME = 256  # pixels, both sides


@dataclasses.dataclass(frozen=True)
class FrameLayout:
    tokens: int  # T
    channels: int  # K
    height: int  # H of every frame
    width: int  # W of every frame

    @property
    def tile_rows(self) -> int:
        return math.ceil(self.tokens / self.height)

    @property
    def tile_cols(self) -> int:
        return math.ceil(self.channels / self.width)

    @property
    def n_tiles(self) -> int:
        return self.tile_rows * self.tile_cols

    @property
    def n_frames(self) -> int:
        return math.ceil(self.n_tiles / 3)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def layout_for(tokens: int, channels: int, height: int = DEFAULT_FRAME, width: int | None = None) -> FrameLayout:
    width = height if width is None else width
    if tokens <= 0 or channels <= 0:
        raise InvalidTensorError(f"cannot tile an empty plane matrix ({tokens} x {channels})")
    if height % 8 or width % 8 or height < 64 or width < 64:
        # HEVC encoders and NVDEC want frame sides that are multiples of 8 and at least 64
        raise InvalidTensorError(f"frame size {width}x{height}: use multiples of 8, at least 64x64")
    return FrameLayout(tokens, channels, height, width)


def to_frames(planes: np.ndarray, layout: FrameLayout) -> np.ndarray:
    """[T, K] uint8 -> (F, 3, H, W) uint8."""
    if planes.dtype != np.uint8 or planes.ndim != 2:
        raise InvalidTensorError(f"planes must be a 2-D uint8 array, got {planes.dtype} {planes.shape}")
    if planes.shape != (layout.tokens, layout.channels):
        raise InvalidTensorError(f"planes {planes.shape} do not match layout {layout}")
    H, W = layout.height, layout.width
    padded = np.pad(planes, ((0, layout.tile_rows * H - layout.tokens), (0, layout.tile_cols * W - layout.channels)),
                    mode="edge")
    tiles = padded.reshape(layout.tile_rows, H, layout.tile_cols, W).transpose(0, 2, 1, 3).reshape(-1, H, W)
    n_pad_tiles = layout.n_frames * 3 - layout.n_tiles
    if n_pad_tiles:
        tiles = np.concatenate([tiles, np.repeat(tiles[-1:], n_pad_tiles, axis=0)])
    return np.ascontiguousarray(tiles.reshape(layout.n_frames, 3, H, W))


def from_frames(frames: np.ndarray, layout: FrameLayout) -> np.ndarray:
    """(F, 3, H, W) uint8 -> [T, K] uint8 (the inverse of to_frames)."""
    expected = (layout.n_frames, 3, layout.height, layout.width)
    if frames.shape != expected:
        raise InvalidTensorError(f"frames {frames.shape} do not match layout (expected {expected})")
    H, W = layout.height, layout.width
    tiles = frames.reshape(-1, H, W)[: layout.n_tiles]
    padded = tiles.reshape(layout.tile_rows, layout.tile_cols, H, W).transpose(0, 2, 1, 3)
    padded = padded.reshape(layout.tile_rows * H, layout.tile_cols * W)
    return np.ascontiguousarray(padded[: layout.tokens, : layout.channels])

"""Tile a [T, K] uint8 plane matrix into YUV 4:4:4 frames (F, 3, H, W) and back.

Each plane of a frame is an H x W tile; tile i becomes plane i % 3 of frame i // 3. Vertically
neighbouring pixels are neighbouring tokens and horizontally neighbouring pixels are neighbouring
components, which is what a codec's intra prediction can use.
- K <= W: a tile holds W // K blocks of H consecutive tokens side by side (block j in columns
  j*K .. j*K+K-1), so narrow matrices fill the frame instead of padding it.
- K > W: the matrix is cut into H x W tiles, row-major over (token block, component block).
Edges are padded by repeating the last row/column (cheaper to code than zeros), planes of the last
frame that hold no tile are zero; the layout is a function of (T, K, H, W) alone, so unpacking
crops the padding exactly.
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

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
    def side_by_side(self) -> int:
        """Token blocks per tile: W // K when the components fit in one tile, else 1."""
        return max(self.width // self.channels, 1)

    @property
    def tile_rows(self) -> int:
        return math.ceil(self.tokens / (self.height * self.side_by_side))

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


def _tile(planes: np.ndarray, layout: FrameLayout) -> np.ndarray:
    H, W, g = layout.height, layout.width, layout.side_by_side
    if g > 1:  # tile r holds token blocks r*g .. r*g+g-1 side by side
        K = layout.channels
        padded = np.pad(planes, ((0, layout.tile_rows * g * H - layout.tokens), (0, 0)), mode="edge")
        tiles = padded.reshape(layout.tile_rows, g, H, K).transpose(0, 2, 1, 3).reshape(-1, H, g * K)
        tiles = np.pad(tiles, ((0, 0), (0, 0), (0, W - g * K)), mode="edge")
    else:
        padded = np.pad(planes, ((0, layout.tile_rows * H - layout.tokens),
                                 (0, layout.tile_cols * W - layout.channels)), mode="edge")
        tiles = padded.reshape(layout.tile_rows, H, layout.tile_cols, W).transpose(0, 2, 1, 3).reshape(-1, H, W)
    n_pad_tiles = layout.n_frames * 3 - layout.n_tiles
    if n_pad_tiles:
        tiles = np.concatenate([tiles, np.repeat(tiles[-1:], n_pad_tiles, axis=0)])
    return tiles.reshape(layout.n_frames, 3, H, W)


def _untile(frames: np.ndarray, layout: FrameLayout) -> np.ndarray:
    H, W, g = layout.height, layout.width, layout.side_by_side
    tiles = frames.reshape(-1, H, W)[: layout.n_tiles]
    if g > 1:
        K = layout.channels
        blocks = tiles[:, :, : g * K].reshape(layout.tile_rows, H, g, K).transpose(0, 2, 1, 3)
        return blocks.reshape(-1, K)[: layout.tokens]
    padded = tiles.reshape(layout.tile_rows, layout.tile_cols, H, W).transpose(0, 2, 1, 3)
    padded = padded.reshape(layout.tile_rows * H, layout.tile_cols * W)
    return padded[: layout.tokens, : layout.channels]


@lru_cache(maxsize=8)
def gather_index(layout: FrameLayout) -> np.ndarray:
    """(F, 3, H, W) flat indices into the [T, K] planes: frames = planes.reshape(-1)[index]."""
    n = layout.tokens * layout.channels
    return _tile(np.arange(n, dtype=np.int64 if n >= 2**31 else np.int32).reshape(layout.tokens, layout.channels),
                 layout)


@lru_cache(maxsize=8)
def scatter_index(layout: FrameLayout) -> np.ndarray:
    """[T, K] flat indices into the frames: planes = frames.reshape(-1)[index]."""
    n = layout.n_frames * 3 * layout.height * layout.width
    frames = np.arange(n, dtype=np.int64 if n >= 2**31 else np.int32)
    return np.ascontiguousarray(_untile(frames.reshape(layout.n_frames, 3, layout.height, layout.width), layout))


@lru_cache(maxsize=8)
def _device_index(layout: FrameLayout, gather: bool, device: str):
    """The index as an int64 torch tensor on `device`, made once (no host copy per call)."""
    import torch

    return torch.from_numpy((gather_index if gather else scatter_index)(layout)).to(device=device, dtype=torch.int64)


def _take(values, layout: FrameLayout, gather: bool):
    """values.reshape(-1)[index] for numpy arrays and torch tensors (on the tensor's device)."""
    if isinstance(values, np.ndarray):
        return values.reshape(-1)[(gather_index if gather else scatter_index)(layout)]
    return values.reshape(-1)[_device_index(layout, gather, str(values.device))]


def to_frames(planes, layout: FrameLayout):
    """[T, K] integer planes (numpy or torch, uint8 for the 8-bit codecs) -> (F, 3, H, W), same type."""
    if planes.ndim != 2 or str(planes.dtype).replace("torch.", "") not in ("uint8", "uint16", "int16", "int32"):
        raise InvalidTensorError(f"planes must be a 2-D integer array, got {planes.dtype} {tuple(planes.shape)}")
    if tuple(planes.shape) != (layout.tokens, layout.channels):
        raise InvalidTensorError(f"planes {tuple(planes.shape)} do not match layout {layout}")
    frames = _take(planes, layout, gather=True)
    # Planes of the last frame that hold no tile are set to one constant: a codec codes that for
    # almost nothing, where a copy of the last tile would cost as much as the tile (intra coding).
    frames.reshape(-1, layout.height, layout.width)[layout.n_tiles:] = 0
    return frames


def from_frames(frames, layout: FrameLayout):
    """(F, 3, H, W) -> [T, K] (the inverse of to_frames), numpy or torch."""
    expected = (layout.n_frames, 3, layout.height, layout.width)
    if tuple(frames.shape) != expected:
        raise InvalidTensorError(f"frames {tuple(frames.shape)} do not match layout (expected {expected})")
    return _take(frames, layout, gather=False)

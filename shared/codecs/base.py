"""The codec interface, shaped like a hardware codec's lifecycle, and the backend registry.

Every backend offers an encoder session and a decoder session:

    with backend.encoder(width, height, **settings) as enc:   # open
        enc.submit(frames)                                   # (F, 3, H, W) uint8, any number of calls
        payload = enc.flush()                                # bytes
    # close() runs on leaving the block
    with backend.decoder(width, height, **settings) as dec:
        dec.submit(payload)
        frames = dec.flush()                                 # (F, 3, H, W) uint8

A session can be reused: after flush() it is ready for the next submit(). Opening is the costly
part on real hardware (NVENC/NVDEC) and in FFmpeg, so benchmarks keep sessions open.

`kind` says what a backend codes: "frames" backends take YUV 4:4:4 frames (F, 3, H, W) uint8;
"bytes" backends (zstd, nvCOMP) take the same frames but see only their bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from ..errors import BackendUnavailable, BitstreamError, ConfigurationError, InvalidTensorError


def check_frames(frames: np.ndarray, width: int, height: int) -> np.ndarray:
    """Validate an (F, 3, H, W) uint8 batch of YUV 4:4:4 frames for a session of this size."""
    if not isinstance(frames, np.ndarray):
        raise InvalidTensorError(f"frames must be a numpy array, got {type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise InvalidTensorError(f"frames must be uint8, got {frames.dtype}; quantize first (shared.quant)")
    if frames.ndim != 4 or frames.shape[1] != 3 or frames.shape[2:] != (height, width):
        raise InvalidTensorError(
            f"frames must have shape (F, 3, {height}, {width}) for this session, got {tuple(frames.shape)}"
        )
    return np.ascontiguousarray(frames)


class _Session:
    """What both directions share: the size, the settings, close() and the context manager."""

    def __init__(self, width: int, height: int, **settings):
        self.width, self.height, self.settings = int(width), int(height), settings
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class EncoderSession(_Session):
    """open in __init__, submit(frames), flush() -> bytes, close()."""

    def submit(self, frames: np.ndarray) -> None:
        raise NotImplementedError

    def flush(self) -> bytes:
        raise NotImplementedError


class BufferedEncoder(EncoderSession):
    """An encoder that codes everything at flush(): submit() only checks and keeps the frame bytes."""

    def __init__(self, width: int, height: int, **settings):
        super().__init__(width, height, **settings)
        self._parts: list[bytes] = []

    def submit(self, frames: np.ndarray) -> None:
        self._parts.append(check_frames(frames, self.width, self.height).tobytes())

    def take(self) -> bytes:
        """The bytes of every frame submitted since the last flush."""
        data, self._parts = b"".join(self._parts), []
        return data


class DecoderSession(_Session):
    """open in __init__, submit(payload bytes), flush() -> (F, 3, H, W) uint8, close().

    expect_frames(n) before submit: the payload should hold n frames; a decoder stops (and raises
    BitstreamError) as soon as it would produce more, so a payload cannot make it decode more."""

    max_frames: int | None = None

    def expect_frames(self, n_frames: int) -> None:
        self.max_frames = int(n_frames)

    def frame_bytes(self) -> int | None:
        """Bytes of the frames expected (None: not told)."""
        return None if self.max_frames is None else self.max_frames * 3 * self.height * self.width

    def submit(self, payload: bytes) -> None:
        raise NotImplementedError

    def flush(self) -> np.ndarray:
        raise NotImplementedError

    def frames_from_bytes(self, data: bytes, n_frames: int | None = None) -> np.ndarray:
        plane = 3 * self.height * self.width
        if len(data) % plane:
            raise BitstreamError(
                f"decoded {len(data)} bytes, not a whole number of {self.width}x{self.height} YUV444 frames"
            )
        frames = np.frombuffer(data, np.uint8).reshape(-1, 3, self.height, self.width)
        n_frames = self.max_frames if n_frames is None else n_frames
        if n_frames is not None and len(frames) != n_frames:
            raise BitstreamError(f"expected {n_frames} frames, decoded {len(frames)}")
        return frames


class BufferedDecoder(DecoderSession):
    """A decoder that decodes everything at flush(): submit() only keeps the payload bytes."""

    def __init__(self, width: int, height: int, **settings):
        super().__init__(width, height, **settings)
        self._parts: list[bytes] = []

    def submit(self, payload: bytes) -> None:
        self._parts.append(bytes(payload))

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


@dataclasses.dataclass(frozen=True)
class Backend:
    """One registered codec backend.

    name: registry key and the codec id written into bitstream headers.
    lossless: True when decode(encode(x)) == x for every setting (zstd); None when it depends on
        the settings (x265 with qp=None is lossless, with qp=N is not).
    probe: returns None when the backend can run here, else a sentence saying why not and the fix.
    """

    name: str
    kind: str  # "frames" or "bytes"
    description: str
    encoder_cls: Callable[..., EncoderSession]
    decoder_cls: Callable[..., DecoderSession]
    probe: Callable[[], str | None]
    lossless: bool | None = None
    device: str = "cpu"  # "cpu" or "cuda": where its sessions do their work
    # Backends with the same stream format read each other's payloads (x265 -> NVDEC).
    stream_format: str | None = None

    def unavailable_reason(self) -> str | None:
        return self.probe()

    def require(self) -> None:
        reason = self.probe()
        if reason is not None:
            raise BackendUnavailable(f"codec backend '{self.name}' is not available here: {reason}")

    def encoder(self, width: int, height: int, **settings) -> EncoderSession:
        self.require()
        return self.encoder_cls(width, height, **settings)

    def decoder(self, width: int, height: int, **settings) -> DecoderSession:
        self.require()
        return self.decoder_cls(width, height, **settings)

    def is_lossless(self, settings: dict) -> bool:
        if self.lossless is not None:
            return self.lossless
        return settings.get("qp") is None


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if backend.name in _REGISTRY:
        raise ValueError(f"codec backend '{backend.name}' registered twice")
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str, from_bitstream: bool = False) -> Backend:
    """The backend registered as `name`. An unknown name is a ConfigurationError listing the known
    ones; from_bitstream=True (a name read from a header) makes it a BitstreamError instead."""
    from . import _load_all

    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        if from_bitstream:
            raise BitstreamError(f"the bitstream names codec '{name}', which this build does not know (known: "
                                 f"{known}): the blob is corrupt, or was written by a newer build") from None
        raise ConfigurationError(f"unknown codec backend '{name}'; known: {known}") from None


def all_backends() -> list[Backend]:
    from . import _load_all

    _load_all()
    return list(_REGISTRY.values())


def availability() -> dict[str, str | None]:
    """{backend name: None if it runs here, else the reason it does not}."""
    return {b.name: b.unavailable_reason() for b in all_backends()}

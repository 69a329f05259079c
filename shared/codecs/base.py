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
import difflib
from collections.abc import Sequence
from typing import Callable

import numpy as np

from ..errors import BackendUnavailable, BitstreamError, ConfigurationError, InvalidTensorError, UnknownBackend


class LazyViews(Sequence):
    """The results of a many-tensor call as one sequence of views into a shared tensor, each made
    when first indexed (a view costs ~0.5-1 us of host time, so making dozens on every call costs
    more than coding a small tensor). Subclasses say how view i is made (_view); list(...), slicing
    and + give plain lists."""

    __slots__ = ("_views",)

    def __init__(self, n: int):
        self._views = [None] * n

    def _view(self, i: int):
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        view = self._views[i]
        if view is None:
            view = self._views[i] = self._view(i)
        return view

    def __add__(self, other) -> list:
        return list(self) + list(other)

    def __radd__(self, other) -> list:
        return list(other) + list(self)


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
    settings: the settings its encoder takes (they travel in the bitstream header, so its decoder
        takes them too and needs none of them: the stream says the rest); None where they go on
        to a library that checks them itself (nvCOMP's codec options).
    decoder_settings: settings only its decoder takes (where and how it runs on this machine).
    A setting outside these is a ConfigurationError naming it (a typo such as QP= is not ignored).
    check_values: checks the encoder settings' values (ranges, types) and raises ConfigurationError
        naming the valid ones; it runs in check_settings, so a codec made with qp=80 is refused when
        it is made (TensorCodec), not at its first encode.
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
    settings: tuple[str, ...] | None = ()
    decoder_settings: tuple[str, ...] = ()
    check_values: Callable[[dict], None] | None = None

    def check_settings(self, settings: dict, decoder: bool = False) -> None:
        """Raise ConfigurationError naming each setting this backend's encoder (decoder=False) or
        decoder does not take, with the closest known name and the full list; for the encoder also
        a value out of range (check_values). A decoder takes a header's settings as they are."""
        if self.settings is not None:
            self._check_names(settings, decoder)
        if not decoder and self.check_values is not None:
            self.check_values(settings)

    def _check_names(self, settings: dict, decoder: bool) -> None:
        known = set(self.settings) | (set(self.decoder_settings) if decoder else set())
        unknown = sorted(set(settings) - known)
        if not unknown:
            return
        lower = {k.lower(): k for k in known}
        named = []
        for key in unknown:
            close = difflib.get_close_matches(str(key).lower(), list(lower), n=1)
            named.append(f"{key!r}" + (f" (did you mean {lower[close[0]]!r}?)" if close else ""))
        takes = ", ".join(sorted(known)) or "no settings"
        raise ConfigurationError(f"codec backend '{self.name}' {'decoder' if decoder else 'encoder'} does not know the "
                                 f"setting(s) {', '.join(named)}; it takes: {takes}")

    def accepted(self, settings: dict) -> dict:
        """The settings of a bitstream header this backend's decoder takes (a header written by
        another backend of the same stream format names that backend's encoder settings)."""
        if self.settings is None:
            return dict(settings)
        return {k: v for k, v in settings.items() if k in self.settings}

    def unavailable_reason(self) -> str | None:
        return self.probe()

    def require(self) -> None:
        reason = self.probe()
        if reason is not None:
            raise BackendUnavailable(f"codec backend '{self.name}' is not available here: {reason}")

    def encoder(self, width: int, height: int, **settings) -> EncoderSession:
        self.check_settings(settings)
        self.require()
        return self.encoder_cls(width, height, **settings)

    def decoder(self, width: int, height: int, **settings) -> DecoderSession:
        self.check_settings(settings, decoder=True)
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


AVAILABILITY_HINT = 'python -c "from shared.codecs import availability; print(availability())"'


def get_backend(name: str, *, from_bitstream: bool = False) -> Backend:
    """The registered backend `name`. An unknown name raises UnknownBackend listing the known ones;
    with from_bitstream=True (a name read from a bitstream header) BitstreamError instead."""
    from . import _load_all

    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        if from_bitstream:
            raise BitstreamError(
                f"unknown codec id '{name}' in the bitstream header; this build knows: {known}. The blob was "
                "written by a newer or different build, or its header is corrupt") from None
        raise UnknownBackend(
            f"unknown codec backend '{name}'; known backends: {known}. "
            f"Which of them run on this machine: {AVAILABILITY_HINT}") from None


def all_backends() -> list[Backend]:
    from . import _load_all

    _load_all()
    return list(_REGISTRY.values())


class Availability(dict):
    """{backend name: None if it runs here, else the reason it does not}; prints as a table."""

    def __str__(self) -> str:
        width = max((len(n) for n in self), default=7)
        lines = [f"{'backend':<{width}}  runs here  why not / fix", f"{'-' * width}  ---------  {'-' * 40}"]
        lines += [f"{name:<{width}}  {'yes' if reason is None else 'no':<9}  {reason or ''}"
                  for name, reason in self.items()]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython / Jupyter: the table too
        p.text(str(self))


def availability() -> Availability:
    """Every registered backend (in registration order), whether it runs here and, if not, why not
    and what to install. `print(availability())` shows a table."""
    return Availability((b.name, b.unavailable_reason()) for b in all_backends())


def require_cuda(what: str, device=None) -> None:
    """Raise BackendUnavailable, naming `what` and the fix, when `device` (default: "cuda") asks for
    CUDA and this machine's torch cannot reach a CUDA GPU. The one check every CUDA entry point uses."""
    if device is not None and not str(device).startswith("cuda"):
        return
    try:
        import torch
    except ImportError:
        raise BackendUnavailable(f"{what} needs CUDA, but torch is not installed. Fix: install a CUDA build of "
                                 "torch on a machine with an NVIDIA GPU, or stay on the CPU") from None
    if torch.cuda.is_available():
        return
    build = (f"this torch ({torch.__version__}) is a CPU-only build" if torch.version.cuda is None else
             f"this torch ({torch.__version__}, CUDA {torch.version.cuda}) sees no CUDA GPU")
    raise BackendUnavailable(f"{what} needs CUDA, but CUDA is not available here: {build}. Fix: leave device=None "
                             "(the CPU decodes the same blob), or run on a machine with an NVIDIA GPU, its driver and "
                             "a CUDA build of torch")

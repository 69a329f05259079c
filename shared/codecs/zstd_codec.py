"""zstd on the raw plane bytes: the general-purpose CPU reference every codec is measured against."""
from __future__ import annotations

import numpy as np

from ..errors import BitstreamError, ConfigurationError
from .base import Backend, BufferedDecoder, BufferedEncoder, register

DEFAULT_LEVEL = 19
MIN_LEVEL = -(1 << 17)  # zstd's fastest negative level


def _max_level() -> int:
    try:
        import zstandard
    except ImportError:  # the backend is unavailable then (its probe says why); zstd's maximum level
        return 22
    return zstandard.MAX_COMPRESSION_LEVEL


def _check_settings(settings: dict) -> None:
    """ConfigurationError, naming the valid range, for a level or threads zstd does not take."""
    level, threads = settings.get("level", DEFAULT_LEVEL), settings.get("threads", 0)
    if isinstance(level, bool) or not isinstance(level, int) or not MIN_LEVEL <= level <= _max_level():
        raise ConfigurationError(f"zstd level={level!r}: use an int from {MIN_LEVEL} (fastest) to "
                                 f"{_max_level()} (smallest)")
    if isinstance(threads, bool) or not isinstance(threads, int) or not -1 <= threads <= 256:
        raise ConfigurationError(f"zstd threads={threads!r}: use an int from -1 (one per core) to 256")


def _probe() -> str | None:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return "zstandard is not installed: pip install zstandard"
    return None


class ZstdEncoder(BufferedEncoder):
    def __init__(self, width, height, **settings):
        super().__init__(width, height, **settings)
        import zstandard

        _check_settings(settings)
        level, threads = settings.get("level", DEFAULT_LEVEL), settings.get("threads", 0)
        self._compressor = zstandard.ZstdCompressor(level=level, threads=threads)

    def flush(self) -> bytes:
        return self._compressor.compress(self.take())


class ZstdDecoder(BufferedDecoder):
    def __init__(self, width, height, **settings):
        super().__init__(width, height, **settings)
        import zstandard

        self._decompressor = zstandard.ZstdDecompressor()

    def flush(self) -> np.ndarray:
        """Decompresses at most the expected frame bytes (expect_frames): a frame declaring or
        holding more is refused before more is produced."""
        import zstandard

        payload = self.take()
        limit = self.frame_bytes()
        try:
            declared = zstandard.get_frame_parameters(payload).content_size
            if limit is not None and declared != zstandard.CONTENTSIZE_UNKNOWN and declared != limit:
                raise BitstreamError(f"zstd frame declares {declared} bytes, the header's frames are {limit}")
            if limit is None:
                data = self._decompressor.decompress(payload)
            else:  # streaming, so nothing beyond limit + 1 bytes is ever produced
                parts, total = [], 0
                with self._decompressor.stream_reader(payload) as reader:
                    while total <= limit:
                        part = reader.read(min(limit + 1 - total, 1 << 22))
                        if not part:
                            break
                        parts.append(part)
                        total += len(part)
                if total > limit:
                    raise BitstreamError(f"zstd payload decompresses to more than the header's {limit} bytes of frames")
                data = b"".join(parts)
        except zstandard.ZstdError as e:
            raise BitstreamError(f"zstd payload is corrupt or truncated ({e})") from e
        return self.frames_from_bytes(data).copy()


ZSTD = register(Backend(
    name="zstd", kind="bytes", settings=("level", "threads"), description="zstd (level 19 by default) on the raw plane bytes, CPU",
    encoder_cls=ZstdEncoder, decoder_cls=ZstdDecoder, probe=_probe, lossless=True, check_values=_check_settings,
))

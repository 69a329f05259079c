"""zstd on the raw plane bytes: the general-purpose CPU reference every codec is measured against."""
from __future__ import annotations

import numpy as np

from ..errors import BitstreamError
from .base import Backend, BufferedDecoder, BufferedEncoder, register

DEFAULT_LEVEL = 19


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

        level = int(settings.get("level", DEFAULT_LEVEL))
        self._compressor = zstandard.ZstdCompressor(level=level, threads=int(settings.get("threads", 0)))

    def flush(self) -> bytes:
        return self._compressor.compress(self.take())


class ZstdDecoder(BufferedDecoder):
    def __init__(self, width, height, **settings):
        super().__init__(width, height, **settings)
        import zstandard

        self._decompressor = zstandard.ZstdDecompressor()

    def flush(self) -> np.ndarray:
        import zstandard

        payload = self.take()
        try:
            data = self._decompressor.decompress(payload)
        except zstandard.ZstdError as e:
            raise BitstreamError(f"zstd payload is corrupt or truncated ({e})") from e
        return self.frames_from_bytes(data).copy()


ZSTD = register(Backend(
    name="zstd", kind="bytes", description="zstd (level 19 by default) on the raw plane bytes, CPU",
    encoder_cls=ZstdEncoder, decoder_cls=ZstdDecoder, probe=_probe, lossless=True,
))

"""The identity codec: frames stored as they are. Also the fallback when a codec would expand data."""
import numpy as np

from .base import Backend, DecoderSession, EncoderSession, check_frames, register


class RawEncoder(EncoderSession):
    def __init__(self, width, height, **settings):
        super().__init__(width, height, **settings)
        self._parts: list[bytes] = []

    def submit(self, frames):
        self._parts.append(check_frames(frames, self.width, self.height).tobytes())

    def flush(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out


class RawDecoder(DecoderSession):
    def __init__(self, width, height, **settings):
        super().__init__(width, height, **settings)
        self._parts: list[bytes] = []

    def submit(self, payload: bytes):
        self._parts.append(bytes(payload))

    def flush(self) -> np.ndarray:
        data, self._parts = b"".join(self._parts), []
        return self.frames_from_bytes(data).copy()


RAW = register(Backend(
    name="raw", kind="bytes", description="frames stored uncompressed (the fallback for incompressible data)",
    encoder_cls=RawEncoder, decoder_cls=RawDecoder, probe=lambda: None, lossless=True,
))

"""The identity codec: frames stored as they are. Also the fallback when a codec would expand data."""
import numpy as np

from .base import Backend, BufferedDecoder, BufferedEncoder, register


class RawEncoder(BufferedEncoder):
    def flush(self) -> bytes:
        return self.take()


class RawDecoder(BufferedDecoder):
    def flush(self) -> np.ndarray:
        return self.frames_from_bytes(self.take()).copy()


RAW = register(Backend(
    name="raw", kind="bytes", description="frames stored uncompressed (the fallback for incompressible data)",
    encoder_cls=RawEncoder, decoder_cls=RawDecoder, probe=lambda: None, lossless=True,
))

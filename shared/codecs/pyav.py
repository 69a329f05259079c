"""FFmpeg codecs in process through PyAV: libx265 (HEVC 4:4:4 8-bit) and FFV1.

Backends:
  "x265": settings qp=None (lossless) or an int 0..51 (constant QP), preset (x265 preset name),
          intra (True: every frame a keyframe). The payload is a plain HEVC Annex-B stream
          (parameter sets in front), the same bytes an FFmpeg subprocess or NVDEC consumes.
  "ffv1": lossless. The payload is FFV1 packets, each prefixed by its length (FFV1 has no
          elementary-stream framing of its own).

A session keeps its FFmpeg codec context open across submit/flush cycles, like a hardware session;
x265 cannot be reset after a drain, so its context is reopened per flush (the cost is measured by PoC 08).
"""
from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np

from ..errors import BitstreamError, CodecError, ConfigurationError
from .base import Backend, DecoderSession, EncoderSession, check_frames, register


def _probe_av(codec_name: str) -> str | None:
    try:
        import av
    except ImportError:
        return "PyAV is not installed: pip install av"
    try:
        av.codec.Codec(codec_name, "w")
    except Exception as e:  # noqa: BLE001 - PyAV raises several types for a missing codec
        return f"this PyAV build has no '{codec_name}' encoder ({e}); the av wheels from PyPI carry it"
    return None


def _frames_to_av(frames: np.ndarray, pix_fmt: str = "yuv444p"):
    import av

    for f in frames:
        vf = av.VideoFrame(f.shape[2], f.shape[1], pix_fmt)
        for plane_index in range(3):
            plane = vf.planes[plane_index]
            if plane.line_size == f.shape[2]:
                plane.update(f[plane_index])
            else:  # rows padded for alignment
                buf = np.frombuffer(plane, np.uint8).reshape(-1, plane.line_size)
                buf[: f.shape[1], : f.shape[2]] = f[plane_index]
        yield vf


X265_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow",
                "placebo")


def _check_x265_settings(settings: dict) -> None:
    """ConfigurationError, naming the valid values, for a qp, preset or intra libx265 does not take
    (also the check of 'ffmpeg-x265', the same encoder in a subprocess)."""
    qp, preset, intra = settings.get("qp"), settings.get("preset", "medium"), settings.get("intra", False)
    if qp is not None and (isinstance(qp, bool) or not isinstance(qp, int) or not 0 <= qp <= 51):
        raise ConfigurationError(f"x265 qp={qp!r}: use None (lossless) or an int from 0 to 51")
    if preset not in X265_PRESETS:
        raise ConfigurationError(f"x265 preset={preset!r}: use one of {', '.join(X265_PRESETS)}")
    if not isinstance(intra, bool):
        raise ConfigurationError(f"x265 intra={intra!r}: use True or False")


def _av_to_frames(vframes, width: int, height: int) -> np.ndarray:
    out = np.empty((len(vframes), 3, height, width), np.uint8)
    for i, vf in enumerate(vframes):
        if vf.format.name != "yuv444p" or vf.width != width or vf.height != height:
            raise BitstreamError(
                f"decoded a {vf.width}x{vf.height} {vf.format.name} frame, expected {width}x{height} yuv444p"
            )
        for p in range(3):
            plane = vf.planes[p]
            out[i, p] = np.frombuffer(plane, np.uint8).reshape(-1, plane.line_size)[:height, :width]
    return out


class _AvEncoder(EncoderSession):
    codec_name = ""

    def __init__(self, width, height, **settings):
        super().__init__(width, height, **settings)
        self._packets: list[bytes] = []
        self._ctx = None
        self._pts = 0

    def _open(self):
        raise NotImplementedError

    def submit(self, frames):
        frames = check_frames(frames, self.width, self.height)
        if self._ctx is None:
            self._ctx = self._open()
        try:
            for vf in _frames_to_av(frames):
                vf.pts = self._pts
                self._pts += 1
                self._packets.extend(bytes(p) for p in self._ctx.encode(vf))
        except Exception as e:  # noqa: BLE001
            raise CodecError(f"{self.codec_name} encode failed: {e}; check frame size and settings") from e

    def _drain(self) -> list[bytes]:
        if self._ctx is None:
            return []
        packets = [bytes(p) for p in self._ctx.encode(None)]
        self._ctx, self._pts = None, 0
        return packets

    def close(self):
        self._ctx = None
        super().close()


class X265Encoder(_AvEncoder):
    codec_name = "libx265"

    def __init__(self, width, height, **settings):
        _check_x265_settings(settings)
        super().__init__(width, height, **settings)

    def _open(self):
        import av

        qp, preset = self.settings.get("qp"), self.settings.get("preset", "medium")
        params = ["log-level=error"]
        params.append("lossless=1" if qp is None else f"qp={int(qp)}")
        if self.settings.get("intra", False):
            params.append("keyint=1")
        ctx = av.CodecContext.create("libx265", "w")
        ctx.width, ctx.height, ctx.pix_fmt = self.width, self.height, "yuv444p"
        ctx.time_base = Fraction(1, 25)
        ctx.options = {"preset": preset, "x265-params": ":".join(params)}
        ctx.open()
        return ctx

    def flush(self) -> bytes:
        packets, self._packets = self._packets + self._drain(), []
        return b"".join(packets)


class FFV1Encoder(_AvEncoder):
    codec_name = "ffv1"

    def _open(self):
        import av

        ctx = av.CodecContext.create("ffv1", "w")
        ctx.width, ctx.height, ctx.pix_fmt = self.width, self.height, "yuv444p"
        ctx.time_base = Fraction(1, 25)
        # level 1 keeps every parameter inside the packets (no extradata to carry)
        ctx.options = {"level": "1", "coder": "1", "context": "1"}
        ctx.open()
        return ctx

    def flush(self) -> bytes:
        extradata = bytes(self._ctx.extradata or b"") if self._ctx is not None else b""
        packets, self._packets = self._packets + self._drain(), []
        # First record: the codec's extradata (empty at level 1), then one record per packet.
        return b"".join(struct.pack("<I", len(p)) + p for p in [extradata, *packets])


class _AvDecoder(DecoderSession):
    codec_name = ""

    def __init__(self, width, height, **settings):
        super().__init__(width, height, **settings)
        self._frames = []
        self._ctx = None

    def _new_ctx(self):
        import av

        ctx = av.CodecContext.create(self.codec_name, "r")
        ctx.thread_type = "NONE"
        # FFmpeg refuses a picture larger than the session's frames before allocating it
        ctx.options = {"max_pixels": str(self.width * self.height)}
        return ctx

    def _packets(self, payload: bytes):
        raise NotImplementedError

    def submit(self, payload: bytes):
        import av

        if self._ctx is None:
            self._ctx = self._new_ctx()
        try:
            for packet in self._packets(bytes(payload)):
                self._take(self._ctx.decode(packet))
        except av.error.FFmpegError as e:
            raise BitstreamError(f"{self.codec_name} could not decode the payload ({e}): corrupt or truncated") from e

    def _take(self, frames) -> None:
        """Keeps decoded frames, refusing any of another size and any beyond the expected count."""
        for vf in frames:
            if vf.width != self.width or vf.height != self.height:
                raise BitstreamError(f"{self.codec_name} decoded a {vf.width}x{vf.height} frame, the header's "
                                     f"frames are {self.width}x{self.height}: the payload is corrupt")
            self._frames.append(vf)
            if self.max_frames is not None and len(self._frames) > self.max_frames:
                raise BitstreamError(f"{self.codec_name} payload holds more than the header's {self.max_frames} "
                                     "frames: the payload is corrupt")

    def flush(self) -> np.ndarray:
        import av

        if self._ctx is not None:
            try:
                self._take(self._ctx.decode(None))
            except av.error.FFmpegError as e:
                raise BitstreamError(f"{self.codec_name} failed while draining ({e}): corrupt or truncated") from e
        frames, self._frames, self._ctx = self._frames, [], None
        if self.max_frames is not None and len(frames) != self.max_frames:
            raise BitstreamError(f"{self.codec_name} decoded {len(frames)} frames, the header says {self.max_frames}")
        return _av_to_frames(frames, self.width, self.height)


class HevcDecoder(_AvDecoder):
    codec_name = "hevc"

    def _packets(self, payload):
        packets = self._ctx.parse(payload)
        return packets + self._ctx.parse(None) if hasattr(self._ctx, "parse") else packets


class FFV1Decoder(_AvDecoder):
    codec_name = "ffv1"

    def _new_ctx(self):
        ctx = super()._new_ctx()
        ctx.width, ctx.height, ctx.pix_fmt = self.width, self.height, "yuv444p"
        return ctx

    def _packets(self, payload):
        import av

        records = list(self._records(payload))
        if not records:
            raise BitstreamError("FFV1 payload is empty")
        if records[0]:
            self._ctx.extradata = records[0]
        for record in records[1:]:
            yield av.Packet(record)

    @staticmethod
    def _records(payload):
        offset = 0
        while offset < len(payload):
            if offset + 4 > len(payload):
                raise BitstreamError("FFV1 payload truncated inside a packet length")
            (n,) = struct.unpack_from("<I", payload, offset)
            offset += 4
            if offset + n > len(payload):
                raise BitstreamError(f"FFV1 packet of {n} bytes truncated at {len(payload) - offset}")
            yield payload[offset: offset + n]
            offset += n


X265 = register(Backend(
    name="x265", kind="frames", settings=("qp", "preset", "intra"),
    description="libx265 HEVC 4:4:4 8-bit in process (PyAV); qp=None lossless, else constant QP",
    encoder_cls=X265Encoder, decoder_cls=HevcDecoder, probe=lambda: _probe_av("libx265"), lossless=None,
    stream_format="hevc-annexb", check_values=_check_x265_settings,
))
FFV1 = register(Backend(
    name="ffv1", kind="frames", description="FFV1 lossless intra codec in process (PyAV)",
    encoder_cls=FFV1Encoder, decoder_cls=FFV1Decoder, probe=lambda: _probe_av("ffv1"), lossless=True,
))

"""The baseline: one `ffmpeg` process per encode or decode call, frames through pipes.

This is how tensors usually meet video codecs (and the original write-up's starting point). Every flush pays a
process spawn and a codec initialisation; PoC 08 splits the time into those parts.
The binary comes from the imageio-ffmpeg PyPI package, or FFMPEG_BINARY / the system PATH.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache

import numpy as np

from ..errors import BitstreamError, CodecError
from .base import Backend, BufferedDecoder, BufferedEncoder, register
from .pyav import _check_x265_settings  # the same libx265 settings (pyav imports PyAV only when a session opens)


@lru_cache(maxsize=None)
def ffmpeg_binary() -> str | None:
    if os.environ.get("FFMPEG_BINARY"):
        return os.environ["FFMPEG_BINARY"]
    try:
        import imageio_ffmpeg

        return imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError):
        return shutil.which("ffmpeg")


@lru_cache(maxsize=None)
def _probe() -> str | None:
    exe = ffmpeg_binary()
    if exe is None:
        return "no ffmpeg binary: pip install imageio-ffmpeg, or set FFMPEG_BINARY"
    out = subprocess.run([exe, "-hide_banner", "-encoders"], capture_output=True, text=True)
    if "libx265" not in out.stdout:
        return f"{exe} has no libx265 encoder; set FFMPEG_BINARY to an ffmpeg built with --enable-libx265"
    return None


def _run(args: list[str], data: bytes, what: str) -> bytes:
    exe = ffmpeg_binary()
    proc = subprocess.run([exe, "-hide_banner", "-loglevel", "error", *args], input=data, capture_output=True)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()[-500:]
        raise (BitstreamError if what == "decode" else CodecError)(
            f"ffmpeg {what} exited with status {proc.returncode}: {err}"
        )
    return proc.stdout


def encode_args(width: int, height: int, qp: int | None, preset: str) -> list[str]:
    params = "lossless=1" if qp is None else f"qp={int(qp)}"
    return ["-f", "rawvideo", "-pix_fmt", "yuv444p", "-s", f"{width}x{height}", "-i", "pipe:0",
            "-c:v", "libx265", "-preset", preset, "-x265-params", f"log-level=error:{params}", "-f", "hevc", "pipe:1"]


class SubprocessEncoder(BufferedEncoder):
    def flush(self) -> bytes:
        data = self.take()
        args = encode_args(self.width, self.height, self.settings.get("qp"), self.settings.get("preset", "medium"))
        return _run(args, data, "encode")


class SubprocessDecoder(BufferedDecoder):
    def flush(self) -> np.ndarray:
        payload = self.take()
        # bounded like the in-process decoder: no picture beyond the session's size (FFmpeg's
        # max_pixels), no frame beyond the expected count plus one (which frames_from_bytes refuses)
        limit = ["-frames:v", str(self.max_frames + 1)] if self.max_frames is not None else []
        raw = _run(["-max_pixels", str(self.width * self.height), "-f", "hevc", "-i", "pipe:0", *limit,
                    "-f", "rawvideo", "-pix_fmt", "yuv444p", "pipe:1"], payload, "decode")
        return self.frames_from_bytes(raw).copy()


FFMPEG_X265 = register(Backend(
    name="ffmpeg-x265", kind="frames", settings=("qp", "preset"),
    description="libx265 through one ffmpeg subprocess per call (the baseline); same stream format as 'x265'",
    encoder_cls=SubprocessEncoder, decoder_cls=SubprocessDecoder, probe=_probe, lossless=None,
    stream_format="hevc-annexb", check_values=_check_x265_settings,
))

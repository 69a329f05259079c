"""NVDEC decode, and NVENC encode where the GPU has it, through PyNvVideoCodec: backend "nvdec-hevc".

    from shared.codecs import get_backend
    dec = get_backend("nvdec-hevc").decoder(256, 256)   # one persistent NVDEC session
    dec.submit(payload)                                 # HEVC Annex-B bytes, e.g. from backend "x265"
    frames = dec.flush_cuda()                           # torch uint8 (F, 3, H, W) on the GPU, no host copy
    frames_np = dec.flush()                             # the common interface: numpy (one device->host copy)

    multi = MultiDecoder(2048, 2048, sessions=14)       # N sessions in threads, spread over the engines
    outs = multi.decode(payloads)                       # one CUDA tensor per payload, in order

The decoder takes the stream from memory: PyNvVideoCodec's `PacketData` carries a host address
(`bsl_data`) and a length (`bsl`); `PyNvDecoder.Decode(packet)` parses the Annex-B bytes itself, so a
whole stream goes in one packet and an empty packet (bsl=0) is the end of stream that drains it.
No demuxer, no temporary file. Decode releases the GIL, so sessions in threads run concurrently.
Each decoded frame is a DLPack view (3H, W) into the decoder's own surface pool, valid only until the
next Decode call, so it is copied once on the GPU into the output tensor.

A session survives end-of-stream and decodes the next stream without reopening, provided the
stream is no larger than the session (NVDEC reconfigures only down to maxwidth/maxheight, error
801 otherwise, after which the decoder is unusable: the session then reopens it).

NVENC: `NvencEncoder` (HEVC 4:4:4, lossless or constant QP, presets P1..P7, input from CUDA tensors,
bound to a CUDA stream) asks `GetEncoderCaps` first. On a GPU without NVENC (the NVIDIA H200 here:
nvEncOpenEncodeSessionEx returns 2, NV_ENC_ERR_NO_ENCODE_DEVICE) it raises BackendUnavailable
naming the GPU. The encode path is written to PyNvVideoCodec 2.2's documented parameters and has
not run on any GPU in this project: it is "not measured here".

Importing this module imports neither PyNvVideoCodec nor torch.cuda; both load on first use.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from ..errors import BackendUnavailable, BitstreamError, CodecError, ConfigurationError, InvalidTensorError
from .base import Backend, DecoderSession, EncoderSession, check_frames, register

NAME = "nvdec-hevc"
NVENC_PRESETS = ("P1", "P2", "P3", "P4", "P5", "P6", "P7")
NO_NVENC_FIX = "encode with backend 'x265' and decode with 'nvdec-hevc'"


# -- loading and diagnostics ------------------------------------------------------------------------

def probe() -> str | None:
    """None when PyNvVideoCodec loads and a CUDA GPU is present, else the reason and the fix."""
    if importlib.util.find_spec("PyNvVideoCodec") is None:
        return "PyNvVideoCodec not installed: pip install PyNvVideoCodec"
    try:
        import torch
    except ImportError:
        return "torch is not installed: pip install torch (NVDEC frames are handed over as torch CUDA tensors)"
    if not torch.cuda.is_available():
        return "no CUDA GPU: NVDEC needs an NVIDIA GPU and driver; on a CPU machine decode with backend 'x265'"
    try:
        _nvc()
    except BackendUnavailable as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=None)
def _load_nvc():
    import logging

    # The package logs its own import failure at ERROR level before raising; our message says it once.
    logging.getLogger("PyNvVideoCodec").setLevel(logging.CRITICAL)
    import PyNvVideoCodec

    return PyNvVideoCodec


def _nvc():
    try:
        return _load_nvc()
    except Exception as e:  # noqa: BLE001 - the package raises RuntimeError for a missing driver library
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BackendUnavailable(
            f"PyNvVideoCodec is installed but does not load ({first_line}); it needs an NVIDIA driver with its "
            "video libraries (libnvcuvid, libnvidia-encode; in a container set NVIDIA_DRIVER_CAPABILITIES to "
            "include 'video')"
        ) from e


def nvc_status(exc: BaseException) -> tuple[int | None, str]:
    """(status code, error text) out of a PyNvVCException message ('Error code : 801 / Error Type : ...')."""
    text = str(exc)
    code = re.search(r"Error code\s*:\s*(-?\d+)", text)
    kind = re.search(r"Error Type\s*:\s*(.+)", text)
    return (int(code.group(1)) if code else None), (kind.group(1).strip() if kind else text.strip())


def _codec_error(call: str, exc: BaseException, fix: str) -> CodecError:
    code, text = nvc_status(exc)
    return CodecError(f"{call} failed (status {code}: {text}); {fix}")


def gpu_name(gpu: int = 0) -> str:
    import torch

    return torch.cuda.get_device_name(gpu)


@functools.lru_cache(maxsize=None)
def decoder_caps(codec: str = "HEVC", chroma: str = "444", bit_depth: int = 8, gpu: int = 0) -> dict:
    """What NVDEC on this GPU reports for a codec / chroma format / bit depth (GetDecoderCaps).

    Keys: supported, num_decoder_engines, width_min/max, height_min/max, mb_num_max, ... .
    codec is a member name of cudaVideoCodec ('HEVC', 'AV1', 'H264', 'VP9'); chroma one of
    '420', '422', '444', 'Monochrome' (the enum members are named by digits, hence getattr).
    """
    nvc = _nvc()
    try:
        codec_id = getattr(nvc.cudaVideoCodec, codec)
        chroma_id = getattr(nvc.cudaVideoChromaFormat, chroma)
    except AttributeError as e:
        raise InvalidTensorError(f"unknown codec/chroma name ({e}); codecs: "
                                 f"{', '.join(nvc.cudaVideoCodec.__members__)}") from None
    try:
        return dict(nvc.GetDecoderCaps(gpuid=gpu, codec=codec_id, chromaformat=chroma_id, bitdepth=bit_depth))
    except Exception as e:  # noqa: BLE001
        raise _codec_error("GetDecoderCaps", e, "check the GPU index and that the NVIDIA driver is loaded") from e


def engine_count(gpu: int = 0) -> int:
    """Number of NVDEC engines that decode HEVC 4:4:4 8-bit on this GPU (7 on an NVIDIA H200)."""
    return int(decoder_caps("HEVC", "444", 8, gpu)["num_decoder_engines"])


def _check_decodable(width: int, height: int, bit_depth: int, gpu: int) -> None:
    caps = decoder_caps("HEVC", "444", bit_depth, gpu)
    if not caps.get("supported"):
        raise BackendUnavailable(
            f"{gpu_name(gpu)}'s NVDEC does not decode HEVC 4:4:4 {bit_depth}-bit; decode with backend 'x265'")
    lo_w, lo_h, hi_w, hi_h = caps["width_min"], caps["height_min"], caps["width_max"], caps["height_max"]
    if not (lo_w <= width <= hi_w and lo_h <= height <= hi_h):
        raise InvalidTensorError(
            f"{width}x{height} frames are outside what NVDEC on {gpu_name(gpu)} decodes for HEVC 4:4:4 "
            f"({lo_w}x{lo_h} to {hi_w}x{hi_h}); choose a frame size in that range (e.g. 256)")


def _stream_handle(stream) -> int:
    if stream is None:
        return 0
    return int(getattr(stream, "cuda_stream", stream))


def _torch_stream_ctx(stream):
    import torch

    if stream is None or isinstance(stream, int):
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


# -- NVDEC ----------------------------------------------------------------------------------------------

class NvdecDecoder(DecoderSession):
    """One persistent NVDEC session for HEVC 4:4:4 streams of at most width x height.

    settings: gpu (int, 0), stream (torch.cuda.Stream or raw handle; None = the current stream),
    bit_depth (8: uint8 frames; 10: uint16 frames holding the 10-bit values). Encoder settings that
    travel in a bitstream header (qp, preset, ...) are accepted and ignored: the stream says all.
    """

    def __init__(self, width, height, gpu: int = 0, stream=None, bit_depth: int = 8, **settings):
        super().__init__(width, height, **settings)
        if bit_depth not in (8, 10):
            raise InvalidTensorError(f"bit_depth must be 8 or 10, got {bit_depth}")
        self.gpu, self.stream, self.bit_depth = int(gpu), stream, bit_depth
        _check_decodable(self.width, self.height, bit_depth, self.gpu)
        self._payloads: list[np.ndarray] = []
        self._decoder = None
        self._open()

    def _open(self):
        nvc = _nvc()
        try:
            self._decoder = nvc.CreateDecoder(
                gpuid=self.gpu, codec=nvc.cudaVideoCodec.HEVC, cudacontext=0,
                cudastream=_stream_handle(self.stream), usedevicememory=True,
                maxwidth=self.width, maxheight=self.height)
        except Exception as e:  # noqa: BLE001
            raise _codec_error("CreateDecoder (NVDEC HEVC)", e,
                               "check that no other process holds every decode session and that the GPU has memory free") from e

    def submit(self, payload) -> None:
        if self.closed:
            raise CodecError("submit on a closed NVDEC session; open a new one with backend.decoder(...)")
        data = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) else payload
        if data.dtype != np.uint8 or data.ndim != 1:
            raise InvalidTensorError(f"payload must be bytes or a 1-D uint8 array, got {data.dtype} {data.shape}")
        if data.size == 0:
            raise BitstreamError("empty payload: nothing to decode (an encoder produced no bytes?)")
        self._payloads.append(np.ascontiguousarray(data))

    def _decode_into(self, data: np.ndarray | None, sink: list):
        import torch

        nvc = _nvc()
        packet = nvc.PacketData()
        packet.bsl_data = 0 if data is None else data.ctypes.data
        packet.bsl = 0 if data is None else data.nbytes
        try:
            decoded = self._decoder.Decode(packet)
        except Exception as e:  # noqa: BLE001
            self._decoder = None  # NVDEC leaves the session unusable after a failed call; reopen next time
            code, text = nvc_status(e)
            if code == 801:
                raise BitstreamError(
                    f"the stream's frames are larger than this {self.width}x{self.height} NVDEC session "
                    f"(status 801: {text}); open the decoder with the stream's frame size") from e
            raise CodecError(f"NVDEC Decode failed (status {code}: {text}); the payload is not a valid HEVC "
                             "Annex-B stream (corrupt, truncated, or another codec)") from e
        if not decoded:
            return
        views = [torch.from_dlpack(frame) for frame in decoded]
        self._check_view(views[0])
        if self.bit_depth == 10:  # torch's uint16 has few kernels: stack the same bits as int16
            views = [v.view(torch.int16) for v in views]
        sink.append(torch.stack(views))  # the one GPU copy, before the next Decode reuses the surfaces

    def _check_view(self, view):
        import torch

        want_dtype = torch.uint8 if self.bit_depth == 8 else torch.uint16
        want = (3 * self.height, self.width)
        if tuple(view.shape) == want and view.dtype == want_dtype:
            return
        self._decoder = None  # mid-stream and reconfigured to another format: reopen for the next flush
        if view.shape[0] * 2 == self.height * 3:
            raise BitstreamError("the stream is HEVC 4:2:0; this backend carries 4:4:4 frames (encode with "
                                 "pix_fmt yuv444p, as backend 'x265' does)")
        if view.dtype != want_dtype:
            raise BitstreamError(f"decoded {view.dtype} samples, the session expects bit_depth={self.bit_depth}: "
                                 "open the decoder with the stream's bit depth")
        raise BitstreamError(f"decoded frames of {tuple(view.shape)} (3H, W), the session expects {want}: "
                             "the stream has another frame size; open the decoder with that frame size")

    def flush_cuda(self, out=None):
        """All submitted payloads, decoded: a torch CUDA tensor (F, 3, H, W), no host copy of frame data.

        out: an optional preallocated CUDA tensor (F, 3, H, W) to fill (its F must match the stream).
        The work is queued on the session's stream (or the current one); synchronize before host use.
        """
        import torch

        if self.closed:
            raise CodecError("flush on a closed NVDEC session; open a new one with backend.decoder(...)")
        payloads, self._payloads = self._payloads, []
        if self._decoder is None:
            self._open()
        chunks: list = []
        with _torch_stream_ctx(self.stream):
            for data in payloads:
                self._decode_into(data, chunks)
            self._decode_into(None, chunks)  # end of stream: drain the frames NVDEC still holds
            n = sum(len(c) for c in chunks)
            dtype = torch.uint8 if self.bit_depth == 8 else torch.int16
            if out is not None:
                if self.bit_depth != 8:
                    raise InvalidTensorError("out= is for 8-bit sessions; 10-bit frames are returned as a new tensor")
                if out.shape[0] != n or tuple(out.shape[1:]) != (3, self.height, self.width):
                    raise InvalidTensorError(f"out has shape {tuple(out.shape)}, the stream decoded to "
                                             f"({n}, 3, {self.height}, {self.width})")
                result = out
                offset = 0
                for c in chunks:
                    result[offset: offset + len(c)].view(len(c), 3 * self.height, self.width).copy_(c)
                    offset += len(c)
            elif len(chunks) == 1:
                result = chunks[0].view(n, 3, self.height, self.width)
            elif chunks:
                result = torch.cat(chunks).view(n, 3, self.height, self.width)
            else:
                result = torch.empty((0, 3, self.height, self.width), dtype=dtype, device=f"cuda:{self.gpu}")
            if self.bit_depth == 10:  # NVDEC's 16-bit surfaces hold 10-bit samples in the top bits (P016)
                result = ((result.to(torch.int32) & 0xFFFF) >> 6).to(torch.int16).view(torch.uint16)
        return result

    def flush(self) -> np.ndarray:
        frames = self.flush_cuda()
        return frames.cpu().numpy()

    def close(self):
        self._decoder = None
        self._payloads = []
        super().close()


class MultiDecoder:
    """N NVDEC sessions, one thread and one CUDA stream each; payload i goes to session i mod N.

    The default N is the engine count GetDecoderCaps reports; more sessions than engines can still
    help (the driver time-slices them and hides per-call overhead), which PoC 10 measures.
    """

    def __init__(self, width: int, height: int, sessions: int | None = None, gpu: int = 0, **settings):
        import torch

        reason = probe()
        if reason is not None:
            raise BackendUnavailable(f"codec backend '{NAME}' is not available here: {reason}")
        self.width, self.height, self.gpu = int(width), int(height), int(gpu)
        self.n = int(sessions) if sessions else engine_count(gpu)
        if self.n < 1:
            raise InvalidTensorError(f"sessions must be at least 1, got {self.n}")
        self.streams = [torch.cuda.Stream(device=self.gpu) for _ in range(self.n)]
        self.sessions = [NvdecDecoder(width, height, gpu=gpu, stream=s, **settings) for s in self.streams]
        self._pool = ThreadPoolExecutor(self.n, thread_name_prefix="nvdec")
        self._lock = threading.Lock()

    def decode(self, payloads: Sequence[bytes]) -> list:
        """Decode each payload (a whole stream) to a CUDA tensor (F, 3, H, W); results in input order,
        ready on the caller's current stream."""
        import torch

        outputs: list = [None] * len(payloads)

        def work(j: int):
            session = self.sessions[j]
            for i in range(j, len(payloads), self.n):
                session.submit(payloads[i])
                outputs[i] = session.flush_cuda()

        with self._lock:  # one decode() at a time: each session belongs to one thread
            futures = [self._pool.submit(work, j) for j in range(min(self.n, len(payloads)))]
            for f in futures:
                f.result()
        consumer = torch.cuda.current_stream(self.gpu)
        for j, s in enumerate(self.streams[: len(futures)]):
            consumer.wait_stream(s)
            for i in range(j, len(payloads), self.n):
                outputs[i].record_stream(consumer)
        return outputs

    def close(self):
        self._pool.shutdown(wait=True)
        for s in self.sessions:
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- NVENC ----------------------------------------------------------------------------------------------

def require_nvenc(gpu: int = 0) -> dict:
    """GetEncoderCaps for HEVC, or BackendUnavailable naming the GPU when it has no usable NVENC."""
    nvc = _nvc()
    name = gpu_name(gpu)
    try:
        caps = dict(nvc.GetEncoderCaps(gpuid=gpu, codec="hevc"))
    except Exception as e:  # noqa: BLE001
        code, text = nvc_status(e)
        if code == 2 or "returned error 2" in text:
            raise BackendUnavailable(
                f"{name} has no NVENC engine (nvEncOpenEncodeSessionEx returned 2, NV_ENC_ERR_NO_ENCODE_DEVICE); "
                f"{NO_NVENC_FIX}") from e
        raise BackendUnavailable(f"NVENC could not be opened on {name} (status {code}: {text}); {NO_NVENC_FIX}") from e
    if int(caps.get("num_encoder_engines", 1)) == 0:
        raise BackendUnavailable(f"{name} reports 0 NVENC engines; {NO_NVENC_FIX}")
    if int(caps.get("support_yuv444_encode", 1)) == 0:
        raise BackendUnavailable(f"{name}'s NVENC cannot encode HEVC 4:4:4; {NO_NVENC_FIX}")
    return caps


class _Yuv444Planes:
    """A (3, H, W) uint8 CUDA tensor shown to PyNvVideoCodec as three CUDA-array-interface planes."""

    def __init__(self, frame):
        self.frame = frame  # keeps the memory alive while NVENC reads it
        h, w = frame.shape[1:]
        base = frame.data_ptr()
        self._planes = [_CudaPlane(base + p * h * w, h, w) for p in range(3)]

    def cuda(self):
        return self._planes


class _CudaPlane:
    def __init__(self, ptr: int, h: int, w: int):
        self.__cuda_array_interface__ = {"shape": (h, w, 1), "strides": (w, 1, 1), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


def _check_nvenc_settings(settings: dict) -> None:
    """ConfigurationError, naming the valid values, for a qp or preset NVENC does not take (checked
    when the codec is made; a preset in any case, a qp anything int() reads as 0..51, as before)."""
    qp, preset = settings.get("qp"), settings.get("preset", "P4")
    if str(preset).upper() not in NVENC_PRESETS:
        raise ConfigurationError(f"NVENC preset={preset!r}: use one of {', '.join(NVENC_PRESETS)}")
    if qp is not None:
        try:
            ok = 0 <= int(qp) <= 51
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ConfigurationError(f"NVENC qp={qp!r}: use None (lossless) or an int from 0 to 51")


class NvencEncoder(EncoderSession):
    """NVENC HEVC 4:4:4 8-bit. settings: qp=None (lossless) or 0..51 (constant QP), preset 'P1'..'P7'
    (default 'P4'), gpu (0), stream (torch.cuda.Stream or handle; None = default stream).

    submit() takes a torch CUDA tensor (F, 3, H, W) uint8 (no host copy) or a numpy array (copied to
    the GPU once). Not measured here: the NVIDIA H200 has no NVENC, and this raises BackendUnavailable.
    """

    def __init__(self, width, height, qp: int | None = None, preset: str = "P4", gpu: int = 0, stream=None,
                 **settings):
        super().__init__(width, height, qp=qp, preset=preset, **settings)
        _check_nvenc_settings({"qp": qp, "preset": preset})
        preset = str(preset).upper()
        self.qp, self.preset, self.gpu, self.stream = qp, preset, int(gpu), stream
        self.caps = require_nvenc(self.gpu)
        if qp is None and int(self.caps.get("support_lossless_encode", 1)) == 0:
            raise BackendUnavailable(f"{gpu_name(self.gpu)}'s NVENC has no lossless HEVC mode; use qp=0..51 "
                                     f"or {NO_NVENC_FIX}")
        self._encoder = None
        self._packets: list[bytes] = []

    def _open(self):
        nvc = _nvc()
        params = {"codec": "hevc", "preset": self.preset.lower(), "rc": "constqp", "gpu_id": str(self.gpu),
                  "bf": "0", "cudastream": _stream_handle(self.stream)}
        if self.qp is None:
            params.update(tuning_info="lossless", constqp="0")
        else:
            params.update(tuning_info="high_quality", constqp=str(int(self.qp)))
        try:
            self._encoder = nvc.CreateEncoder(self.width, self.height, "YUV444", False, **params)
        except Exception as e:  # noqa: BLE001
            raise _codec_error("CreateEncoder (NVENC HEVC 4:4:4)", e,
                               f"check the frame size and settings, or {NO_NVENC_FIX}") from e

    @staticmethod
    def _bytes_of(packets) -> list[bytes]:
        out = []
        for p in packets or []:
            out.append(bytes(p["data"]) if isinstance(p, dict) else bytes(bytearray(p)))
        return out

    def submit(self, frames) -> None:
        import torch

        if isinstance(frames, np.ndarray):
            frames = torch.from_numpy(check_frames(frames, self.width, self.height)).cuda(self.gpu)
        if frames.dtype != torch.uint8 or tuple(frames.shape[1:]) != (3, self.height, self.width) or not frames.is_cuda:
            raise InvalidTensorError(f"frames must be a CUDA uint8 tensor (F, 3, {self.height}, {self.width}), "
                                     f"got {frames.dtype} {tuple(frames.shape)} on {frames.device}")
        if self._encoder is None:
            self._open()
        frames = frames.contiguous()
        for f in frames:
            try:
                self._packets += self._bytes_of(self._encoder.Encode(_Yuv444Planes(f)))
            except Exception as e:  # noqa: BLE001
                raise _codec_error("NVENC Encode", e, "check the input tensor's shape and device") from e

    def flush(self) -> bytes:
        if self._encoder is not None:
            try:
                self._packets += self._bytes_of(self._encoder.EndEncode())
            except Exception as e:  # noqa: BLE001
                raise _codec_error("NVENC EndEncode", e, "reopen the encoder session") from e
            self._encoder = None  # an ended NVENC session does not take new frames: reopen on next submit
        out, self._packets = b"".join(self._packets), []
        return out

    def close(self):
        self._encoder = None
        super().close()


NVDEC_HEVC = register(Backend(
    name=NAME, kind="frames", device="cuda", lossless=None, probe=probe,
    settings=("qp", "preset", "gpu", "stream"), decoder_settings=("gpu", "stream", "bit_depth"),
    description="NVIDIA NVDEC HEVC 4:4:4 decode through PyNvVideoCodec (frames straight into CUDA tensors); "
                "its encoder is NVENC, absent on the NVIDIA H200",
    encoder_cls=NvencEncoder, decoder_cls=NvdecDecoder, stream_format="hevc-annexb",
    check_values=_check_nvenc_settings,
))

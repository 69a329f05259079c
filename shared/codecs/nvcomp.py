"""nvCOMP GPU entropy coders on plane bytes: ANS, zstd, GDeflate, Bitcomp, Cascaded, LZ4.

Backends "nvcomp-ans", "nvcomp-zstd", "nvcomp-gdeflate", "nvcomp-bitcomp", "nvcomp-cascaded" and
"nvcomp-lz4" (kind "bytes", device "cuda", lossless). They need the `nvidia-nvcomp-cu13` wheel
(`from nvidia import nvcomp`) and a CUDA GPU; importing this module imports neither nvCOMP nor
touches CUDA.

Two ways in:

    # the registry's session interface (frames in host memory, bytes out), as every backend has
    with get_backend("nvcomp-ans").encoder(256, 256) as enc:
        enc.submit(frames); payload = enc.flush()

    # the fast path that never leaves the GPU (what the benchmarks time)
    coder = gpu_coder("nvcomp-ans")                 # or GpuCoder("ans", chunk_size=65536)
    stream = coder.encode_cuda(planes)              # torch uint8 CUDA tensor: nvCOMP's native bitstream
    planes_again = coder.decode_cuda(stream)        # torch uint8 CUDA tensor, flat, bit-exact

Payloads. `encode_cuda` returns nvCOMP's native bitstream (NVCOMP_NATIVE: its own header with
the algorithm and the uncompressed size, then the chunks), self-contained. The session payload
puts a 24-byte header of ours in front (magic b"NVCP", version, algorithm, uncompressed and
compressed byte counts) so that a truncated or mislabelled payload is refused on the host,
before nvCOMP reads it. nvCOMP itself does not notice damage (measured on an NVIDIA H200 with
nvCOMP 6.0.0.12): half an ANS stream, or one with 4 KiB overwritten, decodes to the full size
with wrong bytes and no error. Only the session header's length check and the pipeline's CRC32
catch that; a stream of another algorithm and random bytes are refused with BitstreamError.

Layout. nvCOMP codes fixed-size chunks (64 KiB by default), each with its own statistics (ANS
builds one frequency table per chunk). Planes laid out component-major ([K, T]: every PCA
component's tokens contiguous; `component_major()` below) put similar bytes into each chunk.

Object lifetimes (why this module looks the way it does; findings on an NVIDIA H200, nvCOMP
6.0.0.12, torch 2.11):
  * torch owns every buffer. nvCOMP gets views of torch tensors (`nvcomp.as_array(tensor)`) for
    its input and for its output (`out=nvcomp.as_array(buffer)`: nvCOMP writes in place and the
    returned Array, the same object, reports the compressed size in `buffer_size`; a torch
    tensor passed directly as `out=` comes back as itself, without a size). nvCOMP never hands
    out memory of its own, so nothing of nvCOMP's is exported through DLPack.
  * Exporting nvCOMP's own results through DLPack is a trap even where it works: the decoded
    Array carries the dtype recorded in the stream (ANS and LZ4: int8; Cascaded: uint32 with a
    quarter of the elements), so `torch.from_dlpack(decoded)` compares unequal to the uint8 input
    although the bytes are identical.
  * No allocator is installed. `nvcomp.set_device_allocator(<Python allocator>)` kills the
    process at exit (SIGSEGV after the script's last line, 2 of 2 runs) unless the allocator is
    reset with `set_device_allocator(None)` and the codecs are dropped before the interpreter
    shuts down (or the process leaves through os._exit): nvCOMP still holds Python objects when
    its C++ state is torn down after Python's.
  * One `nvcomp.Codec` per (algorithm, settings, device, stream) is made once and kept for the
    life of the process (`_CODECS`). Creating and dropping codecs one after another in one
    process did not fail in any of 14 variants tried (every deletion order, 16 MiB and 256 MiB
    inputs), so this is caution, not a known requirement.

Streams. nvCOMP runs on the caller's current torch stream. On the default (legacy) stream it runs
on a private side stream that waits for the caller's stream and is waited for afterwards, so
ordering with surrounding torch work always holds. Both encode and decode block the host until
nvCOMP has the result's size (measured: host time of a call equals its CUDA-event time).
"""
from __future__ import annotations

import importlib
import struct
from functools import lru_cache

import numpy as np

from ..errors import BackendUnavailable, BitstreamError, CodecError, InvalidTensorError, TensorCodecError
from .base import Backend, DecoderSession, EncoderSession, check_frames, register

# backend suffix -> nvCOMP algorithm name (the `algorithm=` of nvcomp.Codec)
ALGORITHMS = {
    "ans": "ANS",
    "zstd": "Zstd",
    "gdeflate": "GDeflate",
    "bitcomp": "Bitcomp",
    "cascaded": "Cascaded",
    "lz4": "LZ4",
}
DEFAULT_CHUNK = 65536  # bytes of uncompressed data per nvCOMP chunk (nvCOMP's own default)
MAX_DECODED = 1 << 40  # bytes; a header claiming more is corrupt, not a tensor

HEADER = struct.Struct("<4sBBHQQ")  # magic, version, algorithm index, reserved, uncompressed, compressed
MAGIC = b"NVCP"
VERSION = 1
ALGO_INDEX = {name: i for i, name in enumerate(ALGORITHMS)}

INSTALL_HINT = "pip install nvidia-nvcomp-cu13 (CUDA 13 drivers; nvidia-nvcomp-cu12 for CUDA 12)"


# --------------------------------------------------------------------------------------------
# availability
# --------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _probe() -> str | None:
    try:
        importlib.import_module("nvidia.nvcomp")
    except ImportError as e:
        return f"nvCOMP's Python package is missing ({e}): {INSTALL_HINT}"
    try:
        import torch
    except ImportError:
        return "PyTorch is missing: pip install torch (a CUDA build)"
    if not torch.cuda.is_available():
        return ("no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False): run on a machine "
                "with an NVIDIA GPU and a CUDA build of torch")
    return None


def _require():
    reason = _probe()
    if reason is not None:
        raise BackendUnavailable(f"nvCOMP backends are not available here: {reason}")
    import torch

    return importlib.import_module("nvidia.nvcomp"), torch


# --------------------------------------------------------------------------------------------
# codecs and streams, made once per process (see the module docstring: no Codec is destroyed)
# --------------------------------------------------------------------------------------------
_CODECS: dict[tuple, object] = {}
_SIDE_STREAMS: dict[int, object] = {}


def _side_stream(torch, device_index: int):
    if device_index not in _SIDE_STREAMS:
        _SIDE_STREAMS[device_index] = torch.cuda.Stream(device=device_index)
    return _SIDE_STREAMS[device_index]


def _explain(e: Exception) -> str:
    text = str(e)
    if "driver version is insufficient" in text:
        return (f"{text}. nvCOMP's CUDA runtime is newer than this driver: upgrade the NVIDIA driver, or "
                "install the nvCOMP wheel for your CUDA major version (nvidia-nvcomp-cu12 / -cu13)")
    return text


def _landed(torch, result, buf, stream) -> int:
    """Bytes of nvCOMP's result in the torch buffer `buf` (copied there if nvCOMP wrote elsewhere)."""
    cai = getattr(result, "__cuda_array_interface__", None)
    if cai is None or not hasattr(result, "buffer_size"):
        raise CodecError(f"nvCOMP returned a {type(result).__name__} without a size; this module expects "
                         "nvidia-nvcomp-cu13 6.x (pip install -U nvidia-nvcomp-cu13)")
    n = int(result.buffer_size)
    if cai["data"][0] == buf.data_ptr():
        return n
    # nvCOMP put the result into memory of its own: copy it into torch's buffer, then let it go
    if n > buf.numel():
        raise CodecError(f"nvCOMP returned {n} bytes, more than the {buf.numel()}-byte buffer it was given")
    LANDED_BY_COPY.append(n)
    with torch.cuda.stream(stream):
        buf[:n].copy_(torch.as_tensor(result, device=buf.device).reshape(-1).view(torch.uint8)[:n])
    stream.synchronize()  # the nvCOMP Array is freed when it goes out of scope
    return n


LANDED_BY_COPY: list[int] = []  # sizes of results nvCOMP did not write in place (expected: none)
FALLBACKS: list[str] = []  # why an out= call was retried without out= (expected: none for good input)


def component_major(planes):
    """[T, K] planes -> [K, T] contiguous (each component's tokens together); torch or numpy."""
    if hasattr(planes, "is_cuda"):
        return planes.t().contiguous()
    return np.ascontiguousarray(np.asarray(planes).T)


def token_major(planes_kt):
    """The inverse of component_major: [K, T] -> [T, K] contiguous."""
    return component_major(planes_kt)


class GpuCoder:
    """One nvCOMP algorithm with fixed settings. encode_cuda/decode_cuda never leave the GPU.

    algorithm: a key of ALGORITHMS ("ans", "zstd", ...) or a backend name ("nvcomp-ans").
    chunk_size: uncompressed bytes per nvCOMP chunk.
    options: further nvcomp.Codec keyword options (e.g. algorithm_type=2 for GDeflate).
    """

    def __init__(self, algorithm: str, chunk_size: int = DEFAULT_CHUNK, **options):
        key = algorithm.lower().removeprefix("nvcomp-")
        if key not in ALGORITHMS:
            raise InvalidTensorError(f"unknown nvCOMP algorithm '{algorithm}'; known: {', '.join(ALGORITHMS)}")
        if chunk_size <= 0 or chunk_size % 8:
            raise InvalidTensorError(f"chunk_size must be a positive multiple of 8 bytes, got {chunk_size}")
        self.key, self.algorithm = key, ALGORITHMS[key]
        self.chunk_size = int(chunk_size)
        self.options = dict(options)

    def __repr__(self):
        return f"GpuCoder({self.key!r}, chunk_size={self.chunk_size}, {self.options})"

    # -- plumbing ----------------------------------------------------------------------------
    def _codec(self, nvcomp, device_index: int, stream_handle: int):
        key = (self.algorithm, self.chunk_size, tuple(sorted(self.options.items())), device_index, stream_handle)
        codec = _CODECS.get(key)
        if codec is None:
            try:
                codec = nvcomp.Codec(algorithm=self.algorithm, device_id=device_index, cuda_stream=stream_handle,
                                     uncomp_chunk_size=self.chunk_size, **self.options)
            except Exception as e:  # noqa: BLE001 - nvCOMP raises RuntimeError/ValueError/TypeError
                raise CodecError(f"nvcomp.Codec(algorithm={self.algorithm!r}, {self.options}) failed: {_explain(e)}. "
                                 "Check the options against the nvCOMP Python API reference") from e
            _CODECS[key] = codec
        return codec

    @staticmethod
    def _flat_bytes(torch, t, what: str):
        if not hasattr(t, "is_cuda") or not t.is_cuda:
            raise InvalidTensorError(f"{what} must be a torch CUDA tensor, got {type(t).__name__}"
                                     f"{'' if not hasattr(t, 'device') else ' on ' + str(t.device)}; move it with .cuda()")
        if t.numel() == 0:
            raise InvalidTensorError(f"{what} is empty")
        t = t.contiguous().reshape(-1)
        return t if t.dtype == torch.uint8 else t.view(torch.uint8)

    def _run(self, nvcomp, torch, device, work):
        """Run work(codec, stream) on the caller's stream, or on a side stream if that is the legacy default."""
        with torch.cuda.device(device):
            user = torch.cuda.current_stream(device)
            if user.cuda_stream != 0:
                return work(self._codec(nvcomp, device.index, user.cuda_stream), user)
            side = _side_stream(torch, device.index)
            side.wait_stream(user)
            result = work(self._codec(nvcomp, device.index, side.cuda_stream), side)
            user.wait_stream(side)
            return result

    # -- the fast path -----------------------------------------------------------------------
    def encode_cuda(self, data):
        """Any contiguous CUDA tensor (its bytes) -> nvCOMP native bitstream, a uint8 CUDA tensor."""
        nvcomp, torch = _require()
        flat = self._flat_bytes(torch, data, "encode_cuda input")

        def work(codec, stream):
            try:
                src = nvcomp.as_array(flat, stream.cuda_stream)
                capacity = int(codec.get_max_comp_buffer_size(src))
                out = torch.empty(capacity, dtype=torch.uint8, device=flat.device)
                # out= as an nvcomp view of a torch buffer: nvCOMP writes there and the returned Array
                # says how many bytes (a torch tensor passed directly as out= comes back without a size)
                try:
                    result = codec.encode(src, out=nvcomp.as_array(out, stream.cuda_stream))
                except Exception as e:  # noqa: BLE001 - retried without out=, then copied into torch's buffer
                    FALLBACKS.append(f"encode out=: {e}")
                    result = codec.encode(src)
                n = _landed(torch, result, out, stream)
            except TensorCodecError:
                raise
            except Exception as e:  # noqa: BLE001
                raise CodecError(f"nvCOMP {self.algorithm} encode of {flat.numel()} bytes failed: {_explain(e)}. "
                                 "Pass a contiguous CUDA tensor on the current device") from e
            if not 0 < n <= capacity:
                raise CodecError(f"nvCOMP {self.algorithm} encode reported {n} bytes for a buffer of {capacity}")
            flat.record_stream(stream)
            out.record_stream(stream)
            return out[:n]

        return self._run(nvcomp, torch, flat.device, work)

    def decoded_bytes(self, stream) -> int:
        """The uncompressed size written in a native bitstream's header (synchronizes the stream)."""
        nvcomp, torch = _require()
        flat = self._flat_bytes(torch, stream, "decode_cuda payload")

        def work(codec, s):
            try:
                n = int(codec.get_uncomp_buffer_size(nvcomp.as_array(flat, s.cuda_stream)))
            except Exception as e:  # noqa: BLE001
                raise BitstreamError(f"nvCOMP {self.algorithm} could not read the payload header ({_explain(e)}): "
                                     "not an nvCOMP native bitstream, or corrupt") from e
            if not 0 < n <= MAX_DECODED:
                raise BitstreamError(f"nvCOMP {self.algorithm} payload header claims {n} bytes: corrupt payload")
            return n

        return self._run(nvcomp, torch, flat.device, work)

    def decode_cuda(self, stream, out=None):
        """nvCOMP native bitstream (uint8 CUDA tensor) -> its bytes as a flat uint8 CUDA tensor.

        out: optional uint8 CUDA tensor of exactly the decoded size (then no size query is needed).
        """
        nvcomp, torch = _require()
        flat = self._flat_bytes(torch, stream, "decode_cuda payload")
        if out is None:
            out = torch.empty(self.decoded_bytes(flat), dtype=torch.uint8, device=flat.device)
        elif not (hasattr(out, "is_cuda") and out.is_cuda and out.dtype == torch.uint8 and out.is_contiguous()):
            raise InvalidTensorError("decode_cuda out= must be a contiguous uint8 CUDA tensor")
        target = out.reshape(-1)

        def work(codec, s):
            try:
                src = nvcomp.as_array(flat, s.cuda_stream)
                try:
                    result = codec.decode(src, out=nvcomp.as_array(target, s.cuda_stream))
                except Exception as e:  # noqa: BLE001 - retried without out=, then copied into torch's buffer
                    FALLBACKS.append(f"decode out=: {e}")
                    result = codec.decode(src)
                n = _landed(torch, result, target, s)
            except TensorCodecError:
                raise
            except Exception as e:  # noqa: BLE001
                raise BitstreamError(f"nvCOMP {self.algorithm} decode of a {flat.numel()}-byte payload failed "
                                     f"({_explain(e)}): corrupt payload, another algorithm's payload, or out= too "
                                     "small") from e
            if n != target.numel():
                raise BitstreamError(f"nvCOMP {self.algorithm} decoded {n} bytes, expected {target.numel()}")
            flat.record_stream(s)
            target.record_stream(s)
            return out

        return self._run(nvcomp, torch, flat.device, work)

    def checked_round_trip(self, flat, stream):
        """Encode and decode `flat` (uint8 CUDA) on `stream`, wait, and check the result bit for bit.

        Returns (payload, out): the bitstream and a buffer of the decoded size, ready for timed decodes
        into it. Raises CodecError when the round trip is not exact, before anything is timed."""
        _, torch = _require()
        with torch.cuda.stream(stream):
            payload = self.encode_cuda(flat)
            out = torch.empty_like(flat)
            self.decode_cuda(payload, out=out)
        stream.synchronize()
        if not torch.equal(out, flat):
            raise CodecError(f"nvCOMP {self.algorithm} round trip of {flat.numel()} bytes is not bit-exact")
        return payload, out


def gpu_coder(backend_name: str, **settings) -> GpuCoder:
    """The GpuCoder behind a registered backend name ("nvcomp-ans"), with session-style settings."""
    return GpuCoder(backend_name, **settings)


# --------------------------------------------------------------------------------------------
# sessions (the registry interface)
# --------------------------------------------------------------------------------------------
class _NvcompEncoder(EncoderSession):
    key = ""

    def __init__(self, width, height, **settings):
        super().__init__(width, height, **settings)
        self.coder = GpuCoder(self.key, **settings)
        self._parts: list[np.ndarray] = []

    def submit(self, frames):
        self._parts.append(check_frames(frames, self.width, self.height))

    def flush(self) -> bytes:
        _, torch = _require()
        parts, self._parts = self._parts, []
        if not parts:
            raise InvalidTensorError("flush() without any submitted frames")
        host = np.concatenate(parts) if len(parts) > 1 else parts[0]
        encoded = self.coder.encode_cuda(torch.from_numpy(host.reshape(-1)).cuda())
        body = encoded.cpu().numpy().tobytes()
        return HEADER.pack(MAGIC, VERSION, ALGO_INDEX[self.key], 0, host.nbytes, len(body)) + body


class _NvcompDecoder(DecoderSession):
    key = ""

    def __init__(self, width, height, **settings):
        super().__init__(width, height, **settings)
        self.coder = GpuCoder(self.key, **settings)
        self._parts: list[bytes] = []

    def submit(self, payload):
        self._parts.append(bytes(payload))

    def flush(self) -> np.ndarray:
        parts, self._parts = self._parts, []
        checked = [self.check_payload(p) for p in parts]  # every header, before any GPU work
        frames = [self._decode_one(body, n_raw) for body, n_raw in checked]
        if not frames:
            return np.empty((0, 3, self.height, self.width), np.uint8)
        return np.concatenate(frames) if len(frames) > 1 else frames[0]

    def check_payload(self, payload: bytes) -> tuple[bytes, int]:
        """Validate our header on the host; returns (nvCOMP bitstream, decoded byte count)."""
        if len(payload) < HEADER.size:
            raise BitstreamError(f"nvCOMP payload of {len(payload)} bytes is shorter than its {HEADER.size}-byte header")
        magic, version, algo, _, n_raw, n_body = HEADER.unpack_from(payload)
        if magic != MAGIC:
            raise BitstreamError(f"not an nvCOMP backend payload: magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise BitstreamError(f"nvCOMP payload version {version}; this build reads {VERSION}: upgrade the reader")
        names = list(ALGORITHMS)
        if algo >= len(names) or names[algo] != self.key:
            made_by = f"nvcomp-{names[algo]}" if algo < len(names) else f"algorithm #{algo}"
            raise BitstreamError(f"payload was made by {made_by}; decode it with that backend, not nvcomp-{self.key}")
        if len(payload) != HEADER.size + n_body:
            raise BitstreamError(f"nvCOMP payload truncated or padded: header says {n_body} bytes of bitstream, "
                                 f"{len(payload) - HEADER.size} present")
        plane = 3 * self.width * self.height
        if n_raw == 0 or n_raw % plane or n_raw > MAX_DECODED:
            raise BitstreamError(f"nvCOMP payload claims {n_raw} decoded bytes, not a whole number of "
                                 f"{self.width}x{self.height} YUV444 frames")
        return payload[HEADER.size:], n_raw

    def _decode_one(self, body: bytes, n_raw: int) -> np.ndarray:
        _, torch = _require()
        body = torch.frombuffer(bytearray(body), dtype=torch.uint8).cuda()
        out = torch.empty(n_raw, dtype=torch.uint8, device=body.device)
        self.coder.decode_cuda(body, out=out)
        return out.cpu().numpy().reshape(-1, 3, self.height, self.width)


def _make_backend(key: str) -> Backend:
    enc = type(f"Nvcomp{ALGORITHMS[key]}Encoder", (_NvcompEncoder,), {"key": key})
    dec = type(f"Nvcomp{ALGORITHMS[key]}Decoder", (_NvcompDecoder,), {"key": key})
    return register(Backend(
        name=f"nvcomp-{key}", kind="bytes", settings=None,  # chunk_size and nvcomp.Codec's options
        description=f"nvCOMP {ALGORITHMS[key]} on the GPU (plane bytes, {DEFAULT_CHUNK // 1024} KiB chunks by default)",
        encoder_cls=enc, decoder_cls=dec, probe=_probe, lossless=True, device="cuda",
    ))


BACKENDS = {key: _make_backend(key) for key in ALGORITHMS}

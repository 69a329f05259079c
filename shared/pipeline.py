"""TensorCodec: a [T, D] tensor -> a self-describing bitstream -> the tensor back.

    codec = TensorCodec(basis, backend="x265", qp=18)      # basis=None codes the raw channels
    blob = codec.encode(x)                                 # bytes
    x_hat = codec.decode(blob)                             # torch tensor, x's dtype and shape

Bitstream layout (all integers little-endian):

    b"TNSC" | version u8 | header_len u32 | header JSON (UTF-8) | header CRC32 u32
    then one chunk per entry of header["chunks"]:  tag 4 bytes | length u64 | payload | CRC32 u32

The header names everything the receiver needs: shape, dtype, basis content hash and K,
quantizer kind and bits, codec id and settings, frame layout, and whether the codec's output
was replaced by the raw planes because it would have been larger ("fallback"). The quantizer's
per-channel parameters travel in chunk "QPAR", the codec payload in chunk "DATA".
The basis itself is a per-model artifact and travels separately (PoC 07 measures its size).
"""
from __future__ import annotations

import json
import struct
import zlib

import numpy as np

from . import frames as framing
from .basis import PCABasis, as_float_matrix
from .codecs import get_backend, require_cuda
from .errors import BasisMismatchError, BitstreamError, InvalidTensorError
from .quant import PerChannelQuantizer

SYMBOL_CODER = "rans"  # the compute codec: integer symbols, not frames
MAGIC = b"TNSC"
VERSION = 1
DTYPES = {"bfloat16", "float16", "float32", "float64"}


def _dtype_name(x) -> str:
    name = str(x.dtype).replace("torch.", "")
    if name not in DTYPES:
        raise InvalidTensorError(f"dtype {name} is not supported: pass a float tensor ({', '.join(sorted(DTYPES))})")
    return name


def _to_output(values: np.ndarray, dtype: str):
    import torch

    return torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(getattr(torch, dtype))


def pack(header: dict, chunks: dict[str, bytes]) -> bytes:
    header = dict(header, chunks=list(chunks))
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    prefix = MAGIC + struct.pack("<BI", VERSION, len(head)) + head
    out = [prefix, struct.pack("<I", zlib.crc32(prefix))]
    for tag, payload in chunks.items():
        tag_b = tag.encode()
        if len(tag_b) != 4:
            raise ValueError(f"chunk tag must be 4 ASCII bytes, got {tag!r}")
        out += [tag_b, struct.pack("<Q", len(payload)), payload, struct.pack("<I", zlib.crc32(payload))]
    return b"".join(out)


def unpack(blob: bytes) -> tuple[dict, dict[str, bytes]]:
    blob = bytes(blob)
    if len(blob) < 9:
        raise BitstreamError(f"bitstream truncated: {len(blob)} bytes is shorter than the fixed header")
    if blob[:4] != MAGIC:
        raise BitstreamError(f"not a tensor-codec bitstream: magic {blob[:4]!r}, expected {MAGIC!r}")
    version, head_len = struct.unpack_from("<BI", blob, 4)
    if version != VERSION:
        raise BitstreamError(f"bitstream version {version}; this build reads version {VERSION}: upgrade the reader")
    end = 9 + head_len
    if len(blob) < end + 4:
        raise BitstreamError("bitstream truncated inside its header")
    (crc,) = struct.unpack_from("<I", blob, end)
    if crc != zlib.crc32(blob[:end]):
        raise BitstreamError("header CRC32 mismatch: the bitstream is corrupt")
    header = json.loads(blob[9:end])
    offset, chunks = end + 4, {}
    for tag in header["chunks"]:
        if offset + 12 > len(blob):
            raise BitstreamError(f"bitstream truncated before chunk {tag!r}")
        got_tag = blob[offset: offset + 4].decode(errors="replace")
        if got_tag != tag:
            raise BitstreamError(f"expected chunk {tag!r}, found {got_tag!r}: the bitstream is corrupt")
        (n,) = struct.unpack_from("<Q", blob, offset + 4)
        start = offset + 12
        if start + n + 4 > len(blob):
            raise BitstreamError(f"chunk {tag!r} truncated: needs {n} bytes, {len(blob) - start - 4} left")
        payload = blob[start: start + n]
        (crc,) = struct.unpack_from("<I", blob, start + n)
        if crc != zlib.crc32(payload):
            raise BitstreamError(f"chunk {tag!r} CRC32 mismatch: the bitstream is corrupt")
        chunks[tag] = payload
        offset = start + n + 4
    if offset != len(blob):
        raise BitstreamError(f"{len(blob) - offset} unexpected bytes after the last chunk")
    return header, chunks


class TensorCodec:
    """basis (or None for the raw channels) -> per-channel uint8 quantizer -> frames -> codec backend."""

    def __init__(self, basis: PCABasis | None = None, backend: str = "x265", frame_size: int = framing.DEFAULT_FRAME,
                 bits: int = 8, decoder: str | None = None, target_cos: float | None = None,
                 step: float | None = None, water_fill: bool = True, **codec_settings):
        """decoder: decode with this backend instead of the one that encoded (e.g. "nvdec-hevc" for
        streams made by "x265"); it must read the same stream format.

        backend="rans" selects the compute codec instead of the frame path: one quantization step
        shared by all components (shared.rdquant; given as `step`, or searched per tensor for
        `target_cos`, measured against the original tensor), coded by shared.codecs.rans."""
        self.basis = basis
        self.symbols = backend == SYMBOL_CODER
        if self.symbols:
            if (step is None) == (target_cos is None):
                raise InvalidTensorError("backend 'rans' needs exactly one of step= or target_cos=")
            self.step, self.target_cos, self.water_fill = step, target_cos, water_fill
            self.backend = None
        else:
            self.backend = get_backend(backend)
        self.decoder = get_backend(decoder) if decoder else None
        if bits != 8:
            raise InvalidTensorError(f"the frame path carries 8-bit planes; got bits={bits}")
        self.bits = bits
        self.frame_size = frame_size
        self.codec_settings = codec_settings

    # -- the stages, exposed so benchmarks can time them separately ---------------------------
    def to_planes(self, x) -> tuple[np.ndarray, PerChannelQuantizer]:
        values = as_float_matrix(x)
        coeffs = self.basis.project(values) if self.basis is not None else values
        quantizer = PerChannelQuantizer.fit(coeffs, self.bits)
        return quantizer.quantize(coeffs), quantizer

    def from_planes(self, planes: np.ndarray, quantizer: PerChannelQuantizer) -> np.ndarray:
        coeffs = quantizer.dequantize(planes)
        return self.basis.reconstruct(coeffs) if self.basis is not None else coeffs

    def _reconstruct(self, coeffs):
        return self.basis.reconstruct(coeffs) if self.basis is not None else coeffs

    def _encode_symbols(self, x, dtype: str) -> bytes:
        from .codecs import rans
        from .rdquant import RDQuantizer, find_step

        values = as_float_matrix(x)
        coeffs = self.basis.project(values) if self.basis is not None else values
        quantizer = RDQuantizer(self.step) if self.step is not None else find_step(
            coeffs, self.target_cos, "cos", reconstruct=self._reconstruct, reference=values,
            water_fill=self.water_fill)
        symbols = np.asarray(quantizer.quantize(coeffs), np.int32)
        return self._pack_symbols(values.shape, dtype, quantizer, rans.encode(symbols))

    def _pack_symbols(self, shape, dtype: str, quantizer, payload: bytes) -> bytes:
        """The container of a compute-codec payload (the CPU and GPU encoders write the same header)."""
        header = {
            "shape": [int(shape[0]), int(shape[1])],
            "dtype": dtype,
            "basis": None if self.basis is None else {"hash": self.basis.content_hash, "k": self.basis.k},
            "quant": {"kind": "rd_shared_step", "step": quantizer.step},
            "codec": {"id": SYMBOL_CODER, "settings": {}},
            "frames": None,
            "fallback": None,
        }
        return pack(header, {"QPAR": quantizer.to_bytes(), "DATA": payload})

    def _cuda_basis(self, D: int, device):
        """(mean [D], components [D, K]) float32 on the device, cached; the identity without a basis."""
        import torch

        key = str(device)
        if getattr(self, "_cuda_cache", (None,))[0] != key:
            if self.basis is not None:
                if self.basis.dim != D:
                    raise BasisMismatchError(f"basis is for D={self.basis.dim}, tensor has D={D}")
                mean, comps = self.basis.mean, self.basis.components
            else:
                mean, comps = np.zeros(D, np.float32), np.eye(D, dtype=np.float32)
            self._cuda_cache = (key, torch.as_tensor(np.asarray(mean, np.float32), device=device),
                                torch.as_tensor(np.asarray(comps, np.float32), device=device).contiguous())
        return self._cuda_cache[1], self._cuda_cache[2]

    def _encode_symbols_cuda(self, x, dtype: str) -> bytes:
        """The compute codec on a CUDA tensor: projection and quantization in one Triton kernel,
        the rANS coder's kernels, and one copy of the payload to the host."""
        import torch

        from .codecs import rans
        from .rdquant import CudaProjection, RDQuantizer, find_step

        if x.dim() != 2 or x.numel() == 0:
            raise InvalidTensorError(f"tensor must be a non-empty 2-D [tokens, channels] tensor, got {tuple(x.shape)}")
        if not bool(torch.isfinite(x).all()):
            raise InvalidTensorError("tensor holds NaN/Inf; fix the producer, nothing is clipped here")
        mean, comps = self._cuda_basis(x.shape[1], x.device)
        if self.step is not None:
            quantizer = RDQuantizer(self.step)
        else:
            xf = x.float()
            quantizer = find_step((xf - mean) @ comps, self.target_cos, "cos", reconstruct=lambda c: c @ comps.T + mean,
                                  reference=xf, water_fill=self.water_fill)
        proj = CudaProjection(mean, comps, device=x.device)
        symbols, stats, amax = proj.quantize_unchecked(x, quantizer.step)
        if quantizer.keep is not None and not quantizer.keep.all():  # water-filling dropped components
            symbols[:, torch.as_tensor(~quantizer.keep, device=x.device)] = 0
            stats = None
        payload = rans.encode_cuda(symbols, stats=stats, guard=amax)
        return self._pack_symbols(x.shape, dtype, quantizer, payload.cpu().numpy().tobytes())

    # -- whole tensor --------------------------------------------------------------------------
    def encode(self, x) -> bytes:
        """x: [T, D] float tensor (numpy or torch). backend "rans" codes a CUDA tensor on its GPU
        (same container, same rANS bitstream; the GPU quantizer multiplies in bf16, so its symbols
        can differ from the CPU's in the last bit of a few values)."""
        dtype = _dtype_name(x)
        if self.symbols:
            if getattr(x, "is_cuda", False):
                return self._encode_symbols_cuda(x, dtype)
            return self._encode_symbols(x, dtype)
        planes, quantizer = self.to_planes(x)
        layout = framing.layout_for(*planes.shape, height=self.frame_size)
        frames = framing.to_frames(planes, layout)
        with self.backend.encoder(layout.width, layout.height, **self.codec_settings) as enc:
            enc.submit(frames)
            payload = enc.flush()
        codec_id, fallback = self.backend.name, None
        if len(payload) >= frames.nbytes:
            fallback = f"{codec_id} produced {len(payload)} bytes >= {frames.nbytes} raw bytes; stored raw"
            codec_id, payload = "raw", frames.tobytes()
        header = {
            "shape": list(planes.shape[:1]) + [self.basis.dim if self.basis is not None else planes.shape[1]],
            "dtype": dtype,
            "basis": None if self.basis is None else {"hash": self.basis.content_hash, "k": self.basis.k},
            "quant": {"kind": "per_channel", "bits": self.bits},
            "codec": {"id": codec_id, "settings": self.codec_settings},
            "frames": layout.to_dict(),
            "fallback": fallback,
        }
        return pack(header, {"QPAR": quantizer.to_bytes(), "DATA": payload})

    def decode(self, blob: bytes, device=None):
        """The tensor, as a torch tensor of the encoded dtype. device="cuda": a compute-codec
        payload is decoded and reconstructed on that GPU; other payloads are decoded here and moved."""
        if device is not None and str(device).startswith("cuda"):
            require_cuda(f"decode(device={str(device)!r})", device)
        header, chunks = unpack(blob)
        if device is not None and str(device).startswith("cuda") and header["quant"]["kind"] == "rd_shared_step":
            return self._decode_symbols_cuda(header, chunks, device)
        out = _to_output(self.decode_values(header, chunks), header["dtype"])
        return out if device is None else out.to(device)

    def _decode_symbols_cuda(self, header: dict, chunks: dict[str, bytes], device):
        import torch

        from .codecs import rans
        from .rdquant import RDQuantizer

        self._check_basis(header)
        quantizer = RDQuantizer.from_bytes(chunks["QPAR"])
        symbols = rans.decode_cuda(torch.frombuffer(bytearray(chunks["DATA"]), dtype=torch.uint8).to(device))
        mean, comps = self._cuda_basis(header["shape"][1], symbols.device)
        if symbols.shape[1] != comps.shape[1]:
            raise BitstreamError(f"payload holds {symbols.shape[1]} components, the basis has {comps.shape[1]}")
        values = (symbols.float() * quantizer.step) @ comps.T + mean
        if list(values.shape) != header["shape"]:
            raise BitstreamError(f"decoded shape {tuple(values.shape)} differs from header shape {header['shape']}")
        return values.to(getattr(torch, header["dtype"]))

    def _check_basis(self, header: dict):
        expected = header["basis"]
        if expected is not None:
            if self.basis is None:
                raise BasisMismatchError(f"bitstream needs basis {expected['hash']} (K={expected['k']}); "
                                         "construct TensorCodec with that basis")
            if expected["hash"] != self.basis.content_hash or expected["k"] != self.basis.k:
                raise BasisMismatchError(
                    f"bitstream was coded with basis {expected['hash']} (K={expected['k']}), this codec holds "
                    f"{self.basis.content_hash} (K={self.basis.k}); load the sender's basis file"
                )

    def decode_values(self, header: dict, chunks: dict[str, bytes]) -> np.ndarray:
        self._check_basis(header)
        if header["quant"]["kind"] == "rd_shared_step":
            from .codecs import rans
            from .rdquant import RDQuantizer

            quantizer = RDQuantizer.from_bytes(chunks["QPAR"])
            values = self._reconstruct(np.asarray(quantizer.dequantize(rans.decode(chunks["DATA"])), np.float32))
            if list(values.shape) != header["shape"]:
                raise BitstreamError(f"decoded shape {values.shape} differs from header shape {header['shape']}")
            return values
        backend = get_backend(header["codec"]["id"], from_bitstream=True)
        if self.decoder is not None and backend.name != "raw":
            if self.decoder.stream_format is None or self.decoder.stream_format != backend.stream_format:
                raise BitstreamError(f"decoder '{self.decoder.name}' cannot read '{backend.name}' payloads "
                                     f"({self.decoder.stream_format} vs {backend.stream_format})")
            backend = self.decoder
        layout = framing.FrameLayout(**header["frames"])
        quantizer = PerChannelQuantizer.from_bytes(chunks["QPAR"])
        with backend.decoder(layout.width, layout.height, **header["codec"]["settings"]) as dec:
            dec.submit(chunks["DATA"])
            frames = dec.flush()
        if frames.shape[0] != layout.n_frames:
            raise BitstreamError(f"decoded {frames.shape[0]} frames, header says {layout.n_frames}")
        values = self.from_planes(framing.from_frames(frames, layout), quantizer)
        if list(values.shape) != header["shape"]:
            raise BitstreamError(f"decoded shape {values.shape} differs from header shape {header['shape']}")
        return values


def read_header(blob: bytes) -> dict:
    """The header of a bitstream, after checking every CRC in it."""
    return unpack(blob)[0]

"""TensorCodec: a [T, D] tensor -> a self-describing bitstream -> the tensor back.

    codec = TensorCodec(basis, backend="x265", qp=18)      # basis=None codes the raw channels
    blob = codec.encode(x)                                 # bytes
    x_hat = codec.decode(blob)                             # torch tensor, x's dtype and shape

TensorCodec(...) makes one of two codecs, chosen once by `backend`: FrameCodec (per-channel uint8 planes
tiled into frames for a video codec or a byte coder) or ComputeCodec (backend "rans": one shared step,
rANS-coded integer symbols, on the CPU or the GPU). Below them: encode_many / decode_many code a list of
tensors in one call (on a GPU, replayed as CUDA graphs where a list repeats); StagedDecode replays a
decode of containers at fixed places with no host work.

The container's byte layout (magic, version, header JSON, CRC-checked chunks): shared/container.py.

The header names everything the receiver needs: shape, dtype, basis content hash and K,
quantizer kind and bits, codec id and settings, frame layout, and whether the codec's output
was replaced by the raw planes because it would have been larger ("fallback"). The quantizer's
per-channel parameters travel in chunk "QPAR", the codec payload in chunk "DATA".
The basis itself is a per-model artifact and travels separately (PoC 07 measures its size).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from . import frames as framing
from . import schema
from .basis import PCABasis, as_float_matrix
from .codecs import get_backend, require_cuda
from .codecs.base import LazyViews
from .codecs.rans import read_header as read_rans_header, whole_component_groups
from .container import (PAYLOAD_ALIGN, PREFIX_READ, SELF_CHECKED, _is_tensor, _parse, container_prefix, pack,
                        parse_resident, unpack)
from .container import MAGIC, VERSION, read_header, unpack_container  # noqa: F401  re-exported (shared.pipeline's API)
from .errors import BasisMismatchError, BitstreamError, ConfigurationError, InvalidTensorError
from .quant import PerChannelQuantizer

SYMBOL_CODER = "rans"  # the compute codec: integer symbols, not frames
FLOAT32_HEADROOM = 1e37  # |coefficient| x basis gain the coder accepts (float32 max is 3.4e38)
DTYPES = set(schema.FLOAT_DTYPES)
FRAME_MIN_COS = 0.95  # the frame path refuses a tensor its 8-bit planes alone code below this mean cosine


class Prepared(NamedTuple):
    """A CUDA tensor checked and its codec readied for encode_many (TensorCodec._cuda_prepare)."""
    projection: object  # rdquant.CudaProjection of the codec's basis on the tensor's GPU
    quantizer: object  # the codec's rdquant.RDQuantizer (its step)
    front: bytes  # the container's bytes before its payload, for a payload of length 0


class DecodeJob(NamedTuple):
    """A compute-codec container decode_many decodes on the GPU."""
    index: int  # its place in the caller's list
    header: dict  # the container's header
    qpar: bytes  # its QPAR chunk (the quantizer)
    payload: object  # its DATA chunk, a uint8 CUDA tensor
    payload_head: bytes  # the payload's first 64 bytes (its own header)
    inner: object  # the payload's parsed header (rans_cuda), or None where the container came from the host
    front: bytes | None  # the container's bytes before its payload (GPU-resident containers), else None


class StagedJob(NamedTuple):
    """A container of a StagedDecode, checked on the host."""
    index: int
    inner: object  # the payload's parsed header
    offset: int  # where its payload starts in the staging buffer
    step: float  # its quantizer's step
    projection: object  # rdquant.CudaProjection of its codec's basis


def _dtype_name(x) -> str:
    if not (isinstance(x, np.ndarray) or (hasattr(x, "detach") and hasattr(x, "dtype"))):
        raise InvalidTensorError(f"cannot code a {type(x).__name__}: pass a torch.Tensor or numpy.ndarray "
                                 f"[tokens, channels] of a float dtype ({', '.join(sorted(DTYPES))})")
    name = str(x.dtype).replace("torch.", "")
    if name not in DTYPES:
        raise InvalidTensorError(f"dtype {name} is not supported: pass a float tensor ({', '.join(sorted(DTYPES))})")
    return name


def _to_output(values: np.ndarray, header: dict):
    """The decoded values as a torch tensor of the header's dtype and shape, checked finite."""
    import torch

    out = torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(getattr(torch, header["dtype"]))
    if list(out.shape) != header["shape"]:
        raise BitstreamError(f"decoded shape {tuple(out.shape)} differs from header field 'shape' {header['shape']}")
    if not bool(torch.isfinite(out).all()):
        raise BitstreamError(f"decoded values are not finite in {header['dtype']} (chunk 'QPAR' or 'DATA' holds "
                             "out-of-range parameters): the bitstream is corrupt")
    return out


SAMPLE_TOKENS = 4096  # tokens a target_cos search looks at (evenly spaced rows of the first tensor coded)


# what a codec's CUDA graphs are made from: setting one gives the codec a new token, an object no
# other codec holds (a count would repeat in a process that unpickles a codec), so one read per
# codec keys a graph (TensorCodec.__setattr__)
_GRAPH_FIELDS = frozenset({"basis", "quantizer", "_proj", "lane_tokens", "lanes_by_component", "water_fill"})


def _check_basis(basis) -> None:
    """Refuse, naming the fix, a basis that is neither None nor a PCABasis: a path (load the file
    first; a path is not loaded here, so the one basis can serve several codecs and a missing file
    fails where it is read), a backend name (it goes to backend=), or another object."""
    if basis is None or isinstance(basis, PCABasis):
        return
    import os

    if isinstance(basis, (str, os.PathLike)):
        from .codecs import all_backends

        text = os.fspath(basis)
        if isinstance(text, str) and text in {b.name for b in all_backends()}:
            raise ConfigurationError(f"TensorCodec's first argument is the basis (a PCABasis, or None for the raw "
                                     f"channels), got the backend name {text!r}. Fix: TensorCodec(basis, "
                                     f"backend={text!r}), or TensorCodec(None, backend={text!r}) without a basis")
        raise ConfigurationError(f"TensorCodec takes a PCABasis (or None for the raw channels) as its basis, got the "
                                 f"path {text!r}. Fix: load the basis first: TensorCodec(PCABasis.load({text!r}), ...) "
                                 "(from shared.basis import PCABasis)")
    raise ConfigurationError(f"TensorCodec takes a PCABasis (or None for the raw channels) as its basis, got a "
                             f"{type(basis).__name__}. Fix: fit one (shared.basis.fit_basis) or load one "
                             "(PCABasis.load(path))")


class TensorCodec:
    """basis (or None for the raw channels) -> quantizer -> codec -> a self-describing bitstream.

    Two paths behind one interface; `TensorCodec(...)` makes the one `backend` names, once:
      FrameCodec, the frame path ("x265", "ffv1", "zstd", "nvdec-hevc", ...): per-channel uint8 planes
        tiled into YUV 4:4:4 frames for a video codec or a byte coder;
      ComputeCodec, the compute codec ("rans"): one quantization step shared by every component
        (shared.rdquant), integer symbols coded by shared.codecs.rans on the CPU, or on the GPU for
        CUDA tensors (and the batched calls encode_many / decode_many).
    Both are TensorCodecs. Decoding reads the container, so either decodes any container its basis
    fits (a blob says how it was coded).
    """

    symbols = False  # whether this codec codes integer symbols (the compute codec)
    DEFAULT_BACKEND = "x265"

    def __new__(cls, basis: PCABasis | None = None, backend: str | None = None, *args, **kwargs):
        if cls is TensorCodec:
            cls = ComputeCodec if backend == SYMBOL_CODER else FrameCodec
        return object.__new__(cls)

    def __init__(self, basis: PCABasis | None = None, backend: str | None = None, frame_size: int = framing.DEFAULT_FRAME,
                 bits: int = 8, decoder: str | None = None, target_cos: float | None = None,
                 step: float | None = None, water_fill: bool = False, lane_tokens: int | None = None,
                 lanes_by_component: bool = False, min_cos: float | None = FRAME_MIN_COS, **codec_settings):
        """decoder: decode with this backend instead of the one that encoded (e.g. "nvdec-hevc" for
        streams made by "x265"); it must read the same stream format.

        backend="rans": the step is `step`, or the one stored in a basis calibrated by
        shared.rdquant.calibrate_step (a property of the layer, fitted on calibration captures),
        or, for `target_cos`, the largest step meeting it on up to SAMPLE_TOKENS rows of the first
        tensor this codec codes, kept for the tensors after it (one codec per layer). Guarantee:
        the target holds on the data the step was fitted on; `measure(x)` reports what a tensor gets.
        water_fill drops components whose variance is below step^2 / 12 (helps diffusion activations).
        lane_tokens: tokens per rANS lane (default: shared.codecs.rans.default_lane_tokens, >= 512
        so the 4-byte lane states stay near 1.5% of the payload); shorter lanes make small tensors
        code faster on a GPU (more lanes in parallel, shorter chains) for a slightly larger payload.
        lanes_by_component: each rANS lane group walks one component's token chunks (the same size), so a
        warp's table lookups hit one table, where a tensor's token chunks come in whole groups (a multiple
        of 32 chunks of lane_tokens; rans.whole_component_groups): the GPU decoder then runs 16 components a
        program and stores their rows through shared memory (a 64K-token KV layer's lanes kernel 1.7x
        faster than the default order's on an NVIDIA H100). Other tensors keep the default order, which
        decodes them faster (docs/findings.md); lane_order() says which a tensor gets.

        min_cos: the frame path refuses (InvalidTensorError) a tensor whose 8-bit planes alone
        reach a mean cosine below this in coefficient space (an outlier that stretches a channel's
        range); None turns the check off. backend None: "x265" (FrameCodec), "rans" (ComputeCodec)."""
        backend = self.DEFAULT_BACKEND if backend is None else backend
        self.basis = basis
        get_backend(backend)  # an unknown name is a ConfigurationError listing the known ones
        self._configure(backend, step=step, target_cos=target_cos, water_fill=water_fill, lane_tokens=lane_tokens,
                        lanes_by_component=lanes_by_component, codec_settings=codec_settings)
        self.decoder = get_backend(decoder) if decoder else None
        if bits != 8:
            raise ConfigurationError(f"the frame path carries 8-bit planes; got bits={bits}")
        self._check_frame_size(frame_size)
        if min_cos is not None and not (isinstance(min_cos, (int, float)) and -1 <= min_cos <= 1):
            raise ConfigurationError(f"min_cos={min_cos!r}: use a cosine in [-1, 1], or None to turn the check off")
        self.min_cos = min_cos
        self.bits = bits
        self.frame_size = frame_size
        self.codec_settings = codec_settings
        self._proj = None
        # on the GPU the symbols go from the projection to the coder as int16 (a third less memory
        # traffic than int32) until a tensor's values outgrow int16; then int32 for this codec
        self._wide_symbols = False

    def __setattr__(self, name, value):
        """Setting what a CUDA graph of this codec was made from (basis, step, lane length) gives
        the codec a new graph token, so encode_many and decode_many key their graphs by one read
        per codec instead of three. A new basis drops the projections and header made from the old one.
        A basis that is not a PCABasis (or None) is a ConfigurationError, here and in __init__."""
        if name == "basis":
            _check_basis(value)
        object.__setattr__(self, name, value)
        if name in _GRAPH_FIELDS:
            if name == "basis":
                for made in ("_proj", "_cpu_proj", "_front"):
                    self.__dict__.pop(made, None)
                object.__setattr__(self, "_proj", None)
            object.__setattr__(self, "_graph_token", object())

    # -- the stages, exposed so benchmarks can time them separately ---------------------------
    def _project(self, values: np.ndarray) -> np.ndarray:
        """The coefficients, refused when they or their reconstruction would leave float32."""
        coeffs = self.basis.project(values) if self.basis is not None else values
        amax = float(np.abs(coeffs).max()) if np.isfinite(coeffs).all() else math.inf
        gain = 1.0 if self.basis is None else self.basis.gain
        offset = 0.0 if self.basis is None else float(np.abs(self.basis.mean).max())
        if not amax * gain + offset < FLOAT32_HEADROOM:
            raise InvalidTensorError(f"values up to {float(np.abs(values).max()):.3g} overflow float32 in the "
                                     f"projection or its reconstruction (limit about {FLOAT32_HEADROOM:.1e}); "
                                     "scale the tensor down before coding it")
        return coeffs

    def from_planes(self, planes: np.ndarray, quantizer: PerChannelQuantizer) -> np.ndarray:
        """The frame path's inverse of FrameCodec.to_planes: uint8 planes -> float32 values [T, D]."""
        return self._reconstruct(quantizer.dequantize(planes))

    def _reconstruct(self, coeffs):
        return self.basis.reconstruct(coeffs) if self.basis is not None else coeffs

    def _cpu_projection(self, x, dtype: str, dim: int | None = None):
        """The bf16 CPU path's projection (shared.rdquant.CpuProjection), made once; None where it
        does not apply (another dtype, not a 2-D torch tensor, no compiled coder)."""
        from .codecs import rans_cpu

        if dtype != "bfloat16" or not rans_cpu.AVAILABLE:
            return None
        if dim is None:
            if not (_is_tensor(x) and x.dim() == 2 and x.numel() > 0 and x.device.type == "cpu"):
                return None
            dim = x.shape[1]
        if self.basis is not None and self.basis.dim != dim:
            return None  # the general path raises the mismatch
        if getattr(self, "_cpu_proj", None) is None or self._cpu_proj.D != dim:
            from .rdquant import CpuProjection

            self._cpu_proj = (CpuProjection(None, None, dim) if self.basis is None
                              else CpuProjection(self.basis.mean, self.basis.components, synthesis=self.basis.synthesis))
        return self._cpu_proj

    def _projection(self, D: int, device):
        """The fused GPU projection/quantizer/reconstruction of this codec's basis (the identity
        without one), made once per device."""
        from .rdquant import CudaProjection

        if self._proj is None or self._proj[0] != str(device):
            if self.basis is not None:
                if self.basis.dim != D:
                    raise BasisMismatchError(f"basis is for D={self.basis.dim}, tensor has D={D}")
                mean, comps, synthesis = self.basis.mean, self.basis.components, self.basis.synthesis
            else:
                mean, comps, synthesis = np.zeros(D, np.float32), np.eye(D, dtype=np.float32), None
            self._proj = (str(device), CudaProjection(mean, comps, device=device, synthesis=synthesis))
        if self._proj[1].D != D:
            raise BasisMismatchError(f"this codec's basis is for D={self._proj[1].D}, tensor has D={D}")
        return self._proj[1]

    # -- whole tensor --------------------------------------------------------------------------
    def decode(self, blob, device=None, max_elements: int = schema.DEFAULT_MAX_ELEMENTS):
        """The tensor, as a torch tensor of the encoded dtype. blob: bytes-like, or a uint8 tensor
        (CPU or CUDA) holding a container. device="cuda": a compute-codec payload is decoded and
        reconstructed on that GPU (a container already there is read in place); other payloads are
        decoded here and moved.

        A bitstream is checked against shared.schema before anything is sized from it; one
        declaring more than max_elements values (or bytes of frames) is refused with BitstreamError,
        as is every other malformed, inconsistent or corrupt one."""
        return decode_many([self], [blob], device=device, max_elements=max_elements)[0]

    def join(self, blobs, device=None, max_elements: int = schema.DEFAULT_MAX_ELEMENTS) -> bytes:
        """Compute-codec containers joined into one: ComputeCodec.join."""
        raise ConfigurationError("join takes compute-codec containers (backend 'rans'); the frame path "
                                 "quantizes each tensor's channels on their own ranges, so its planes do not join")

    def measure(self, x) -> dict:
        """Encode and decode x; the ratio vs bf16 and the quality this tensor gets (shared.metrics)."""
        from .metrics import quality

        blob = self.encode(x)
        y = self.decode(blob, device="cuda" if getattr(x, "is_cuda", False) else None)
        ref = x.float().cpu().numpy() if _is_tensor(x) else np.asarray(x, np.float32)
        return dict(quality(ref, y.float().cpu().numpy()), ratio=2 * ref.size / len(blob), bytes=len(blob))

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

    def _decode_symbols_bf16(self, header: dict, chunks: dict[str, bytes]):
        """A compute-codec container of a bf16 tensor -> the bf16 CPU tensor (CpuProjection's
        reconstruction); None where that path does not apply."""
        proj = self._cpu_projection(None, header["dtype"], dim=header["shape"][1]) \
            if header["quant"]["kind"] == "rd_shared_step" else None
        if proj is None:
            return None
        from .codecs import rans_cpu
        from .rdquant import RDQuantizer

        self._check_basis(header)
        quantizer = RDQuantizer.from_bytes(chunks["QPAR"])  # its step checked against the header (schema)
        symbols = rans_cpu.decode(chunks["DATA"], max_elements=header["shape"][0] * schema.components(header))
        if [symbols.shape[0], symbols.shape[1]] != [header["shape"][0], proj.K]:
            raise BitstreamError(f"payload holds [{symbols.shape[0]}, {symbols.shape[1]}] symbols; the header's shape "
                                 f"{header['shape']} and the basis (K={proj.K}) need [{header['shape'][0]}, {proj.K}]")
        return proj.reconstruct(symbols, quantizer.step)

    def decode_values(self, header: dict, chunks: dict[str, bytes]) -> np.ndarray:
        """A parsed container (header, chunks: shared.container.unpack) -> float32 values [T, D] on the
        CPU, whichever path coded it; BitstreamError where its payload does not decode to the header's shape."""
        self._check_basis(header)
        if header["quant"]["kind"] == "rd_shared_step":
            from .codecs import rans_cpu
            from .rdquant import RDQuantizer

            quantizer = RDQuantizer.from_bytes(chunks["QPAR"])  # its step checked against the header (schema)
            symbols = rans_cpu.coder().decode(chunks["DATA"], max_elements=header["shape"][0] * schema.components(header))
            values = self._reconstruct(np.asarray(quantizer.dequantize(symbols), np.float32))
            if list(values.shape) != header["shape"]:
                raise BitstreamError(f"decoded shape {values.shape} differs from header shape {header['shape']}")
            return values
        backend = get_backend(header["codec"]["id"], from_bitstream=True)
        if self.decoder is not None and backend.name != "raw":
            if self.decoder.stream_format is None or self.decoder.stream_format != backend.stream_format:
                raise BitstreamError(f"decoder '{self.decoder.name}' cannot read '{backend.name}' payloads "
                                     f"({self.decoder.stream_format} vs {backend.stream_format})")
            backend = self.decoder
        layout = schema.frame_layout(header)
        quantizer = PerChannelQuantizer.from_bytes(chunks["QPAR"], bits=header["quant"]["bits"])
        # the header names the encoder's settings; the decoder takes those it knows (the stream says the rest)
        with backend.decoder(layout.width, layout.height, **backend.accepted(header["codec"]["settings"])) as dec:
            dec.expect_frames(layout.n_frames)
            dec.submit(chunks["DATA"])
            frames = dec.flush()
        if frames.shape[0] != layout.n_frames:
            raise BitstreamError(f"decoded {frames.shape[0]} frames, header says {layout.n_frames}")
        values = self.from_planes(framing.from_frames(frames, layout), quantizer)
        if list(values.shape) != header["shape"]:
            raise BitstreamError(f"decoded shape {values.shape} differs from header shape {header['shape']}")
        return values


class FrameCodec(TensorCodec):
    """The frame path: per-channel uint8 planes of the coefficients, tiled into YUV 4:4:4 frames, coded by a
    video codec or a byte coder (backend "x265", "ffv1", "zstd", ...). Made by TensorCodec(...)."""

    def _configure(self, backend: str, *, step, target_cos, water_fill, lane_tokens, lanes_by_component,
                   codec_settings) -> None:
        if backend == SYMBOL_CODER:
            raise ConfigurationError(f"backend {SYMBOL_CODER!r} is the compute codec. Fix: ComputeCodec (or "
                                     f"TensorCodec) with backend={SYMBOL_CODER!r}")
        if lanes_by_component:
            raise ConfigurationError("lanes_by_component is a setting of the compute codec's rANS lanes (backend 'rans')")
        self.backend = get_backend(backend)
        self.backend.check_settings(codec_settings)  # a typo (QP=18) is an error here, not a silent default

    def _check_frame_size(self, frame_size) -> None:
        schema.check_frame_side("frame_size", frame_size)

    def to_planes(self, x) -> tuple[np.ndarray, PerChannelQuantizer]:
        """x [T, D] -> (uint8 planes [T, K] of its coefficients, the per-channel quantizer that made them);
        InvalidTensorError where the planes alone fall below min_cos."""
        coeffs = self._project(as_float_matrix(x))
        quantizer = PerChannelQuantizer.fit(coeffs, self.bits)
        planes = quantizer.quantize(coeffs)
        if self.min_cos is not None:
            from .rdquant import quality

            cos = quality(coeffs.astype(np.float64), quantizer.dequantize(planes).astype(np.float64), "cos")
            if cos < self.min_cos:
                worst = int(np.argmax(quantizer.step))
                raise InvalidTensorError(
                    f"the 8-bit frame path cannot represent this tensor: its planes alone reach cos {cos:.4f} "
                    f"< min_cos={self.min_cos} (component {worst} spans {float(quantizer.step[worst]) * 255:.3g}: "
                    "an outlier stretches its range); use backend='rans', clip the outlier, or pass min_cos=None")
        return planes, quantizer

    def encode(self, x):
        """x: [T, D] float tensor (numpy or torch) -> the container (bytes): per-channel uint8 planes
        tiled into frames for the backend; stored raw where the backend's output would be larger."""
        dtype = _dtype_name(x)
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
            # where the session ran (threads, gpu, stream) is not part of the stream
            "codec": {"id": codec_id, "settings": {k: v for k, v in self.codec_settings.items()
                                                   if k not in schema.RESERVED_SETTINGS}},
            "frames": layout.to_dict(),
            "fallback": fallback,
        }
        return pack(header, {"QPAR": quantizer.to_bytes(), "DATA": payload})


class ComputeCodec(TensorCodec):
    """The compute codec: one quantization step shared by every component, integer symbols coded by rANS on
    the CPU or on the GPU (backend "rans"). Made by TensorCodec(..., backend="rans")."""

    DEFAULT_BACKEND = SYMBOL_CODER
    symbols = True

    def _configure(self, backend: str, *, step, target_cos, water_fill, lane_tokens, lanes_by_component,
                   codec_settings) -> None:
        if backend != SYMBOL_CODER:
            raise ConfigurationError(f"ComputeCodec codes with backend {SYMBOL_CODER!r}, got {backend!r}. Fix: "
                                     f"FrameCodec (or TensorCodec) for backend {backend!r}")
        if codec_settings:
            raise ConfigurationError(f"backend 'rans' does not know the setting(s) {', '.join(sorted(codec_settings))}; "
                                     "it takes step=, target_cos=, water_fill=, lane_tokens= and lanes_by_component=")
        if lane_tokens is not None and not (isinstance(lane_tokens, int) and lane_tokens >= 1):
            raise ConfigurationError(f"lane_tokens must be a positive int, got {lane_tokens!r}")
        if step is not None and target_cos is not None:
            raise ConfigurationError("backend 'rans' takes exactly one of step= or target_cos=")
        calibrated = None if self.basis is None else self.basis.meta.get("rans_step")
        if step is None and target_cos is None and calibrated is None:
            raise ConfigurationError("backend 'rans' needs exactly one of step= or target_cos=, or a basis calibrated "
                                     "with shared.rdquant.calibrate_step (which stores the step in the basis)")
        if target_cos is not None and not (isinstance(target_cos, (int, float)) and 0 < target_cos <= 1):
            raise ConfigurationError(f"target_cos={target_cos!r}: use a cosine in (0, 1]")
        from .rdquant import RDQuantizer

        step = float(calibrated) if step is None and target_cos is None else step
        self.quantizer = None if step is None else RDQuantizer(step)
        self.target_cos, self.water_fill, self.lane_tokens = target_cos, water_fill, lane_tokens
        self.lanes_by_component = bool(lanes_by_component)
        self.backend = None

    def _check_frame_size(self, frame_size) -> None:
        pass  # no frames on this path

    # -- the compute codec's step ---------------------------------------------------------------
    def _step_quantizer(self, values, coeffs, reconstruct):
        """The codec's quantizer; with target_cos, found once on a row sample of the first tensor."""
        if self.quantizer is None:
            from .rdquant import find_step

            rows = slice(None, None, max(1, -(-values.shape[0] // SAMPLE_TOKENS)))
            self.quantizer = find_step(coeffs[rows], self.target_cos, "cos", reconstruct=reconstruct,
                                       reference=values[rows], water_fill=self.water_fill)
        return self.quantizer

    def lane_order(self, T: int, K: int) -> bool:
        """Whether this codec codes a tensor of T tokens and K components with its rANS lanes by component:
        lanes_by_component=True, and the lanes make whole groups of one component."""
        return self.lanes_by_component and whole_component_groups(T, K, self.lane_tokens)

    def _encode_symbols(self, x, dtype: str) -> bytes:
        from .codecs import rans_cpu

        proj = self._cpu_projection(x, dtype)
        if proj is not None:
            return self._encode_symbols_bf16(x, proj)
        values = as_float_matrix(x)
        coeffs = self._project(values)
        quantizer = self._step_quantizer(values, coeffs, self._reconstruct)
        symbols = np.asarray(quantizer.quantize(coeffs), np.int32)
        header, qpar = self._symbols_header(values.shape, dtype, quantizer)
        return pack(header, {"QPAR": qpar, "DATA": rans_cpu.coder().encode(
            symbols, lane_tokens=self.lane_tokens, lanes_by_component=self.lane_order(*symbols.shape))})

    def _encode_symbols_bf16(self, x, proj) -> bytes:
        """The compute codec's CPU path for a bf16 tensor: bf16 GEMM, then one compiled pass that
        quantizes and gathers the coder's column statistics (CpuProjection); the general path's
        checks (finite values, float32 headroom) are read off the symbols, and where one fails
        the general path runs to name the cause."""
        from .codecs import rans_cpu

        if self.quantizer is None:  # target_cos: the step from a row sample, once
            values = as_float_matrix(x)
            rows = slice(None, None, max(1, -(-values.shape[0] // SAMPLE_TOKENS)))
            self._step_quantizer(values[rows], self._project(values[rows]), self._reconstruct)
        try:
            symbols, stats = proj.quantize(x, self.quantizer)
            amax = max(-int(stats[0].min()), int(stats[1].max()))
            if not (amax + 0.5) * self.quantizer.step * proj.gain + proj.offset < FLOAT32_HEADROOM:
                raise InvalidTensorError("values overflow float32 in the projection or its reconstruction")
        except InvalidTensorError:
            self._project(as_float_matrix(x))  # raises with the cause named
            raise
        header, qpar = self._symbols_header(x.shape, "bfloat16", self.quantizer)
        return pack(header, {"QPAR": qpar, "DATA": rans_cpu.encode(symbols, lane_tokens=self.lane_tokens,
                                                                   stats=stats,
                                                                   lanes_by_component=self.lane_order(*symbols.shape))})

    def _symbols_header(self, shape, dtype: str, quantizer) -> tuple[dict, bytes]:
        """The container header of a compute-codec payload and its QPAR chunk (the CPU and GPU
        encoders write the same container)."""
        header = {
            "shape": [int(shape[0]), int(shape[1])],
            "dtype": dtype,
            "basis": None if self.basis is None else {"hash": self.basis.content_hash, "k": self.basis.k},
            "quant": {"kind": "rd_shared_step", "step": quantizer.step},
            "codec": {"id": SYMBOL_CODER, "settings": {}},
            "frames": None,
            "fallback": None,
            "checks": {"DATA": SELF_CHECKED},
        }
        return header, quantizer.to_bytes()

    def _cuda_prepare(self, x) -> Prepared:
        """Checks a CUDA tensor and readies this codec for it."""
        dtype = _dtype_name(x)
        if x.dim() != 2 or x.numel() == 0:
            raise InvalidTensorError(f"tensor must be a non-empty 2-D [tokens, channels] tensor, got {tuple(x.shape)}")
        proj = self._projection(x.shape[1], x.device)
        if self.quantizer is None:
            mean, comps, back = proj.mean, proj.components.float(), proj.components_t.float()
            self._step_quantizer(x.float(), (x.float() - mean) @ comps, lambda c: c @ back + mean)
        key = (tuple(x.shape), dtype, self.quantizer.step)
        if getattr(self, "_front", (None,))[0] != key:  # the same header for every tensor of this shape
            header, qpar = self._symbols_header(x.shape, dtype, self.quantizer)
            self._front = (key, container_prefix(header, {"QPAR": qpar}, "DATA", 0))
        return Prepared(proj, self.quantizer, self._front[1])

    def encode(self, x):
        """x: [T, D] float tensor (numpy or torch) -> the container: bytes, or for a CUDA tensor a uint8
        CUDA tensor holding the same container bytes, coded on its GPU with one host synchronization
        (the GPU quantizer multiplies in bf16, so its symbols can differ from the CPU's in the last bit
        of a few values)."""
        if getattr(x, "is_cuda", False):
            return encode_many([self], [x])[0]
        return self._encode_symbols(x, _dtype_name(x))

    def join(self, blobs, device=None, max_elements: int = schema.DEFAULT_MAX_ELEMENTS) -> bytes:
        """Compute-codec containers of this codec ([T_i, D] each, one dtype, one quantization step) -> one
        container of all their rows, in order. They are joined as integer symbols, so every decoded value is
        what it was; decoding the rows and coding them again would quantize them a second time (bf16
        rounding moves values across step boundaries). blobs: bytes-like or uint8 tensors (a CUDA one is
        read through the host). device None: the CPU coder; a torch device: the GPU coder's kernels there
        (the same bytes, at GPU speed: a cache joining a long context's chunks wants that). One container
        comes back coded again."""
        if len(blobs) == 0:
            raise ConfigurationError("join needs at least one container")
        from .codecs import rans_cpu
        from .rdquant import RDQuantizer

        parts, first = [], None
        for i, blob in enumerate(blobs):
            header, chunks = unpack(blob, max_elements=max_elements)
            if header["quant"]["kind"] != "rd_shared_step":
                raise BitstreamError(f"container {i} is not a compute-codec payload (quantization "
                                     f"{header['quant']['kind']!r}); join takes containers of backend 'rans'")
            self._check_basis(header)
            key = (header["dtype"], header["shape"][1], bytes(chunks["QPAR"]))
            if first is None:
                first = key
            elif key != first:
                raise BitstreamError(f"container {i} differs from container 0 in dtype, width or quantization "
                                     f"step ({key[:2]} vs {first[:2]}); only containers of one codec and step join")
            parts.append((chunks["DATA"], header["shape"][0] * schema.components(header)))
        if device is None:
            symbols = np.concatenate([rans_cpu.coder().decode(data, max_elements=n) for data, n in parts])
            tokens, data = symbols.shape[0], rans_cpu.coder().encode(np.ascontiguousarray(symbols, np.int32),
                                                                    lane_tokens=self.lane_tokens,
                                                                    lanes_by_component=self.lane_order(*symbols.shape))
        else:
            import torch

            from .codecs import rans_cuda

            payloads = [torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) for data, _ in parts]
            symbols, _ = rans_cuda.decode_many_cuda(payloads, max_elements=[n for _, n in parts])
            joined = torch.cat(symbols)
            tokens, data = joined.shape[0], rans_cuda.encode_cuda(
                joined, lane_tokens=self.lane_tokens,
                lanes_by_component=self.lane_order(*joined.shape)).cpu().numpy().tobytes()
        header, qpar = self._symbols_header((tokens, first[1]), first[0], RDQuantizer.from_bytes(first[2]))
        return pack(header, {"QPAR": qpar, "DATA": data})



_STACKED = {}  # stacked projections of codec lists coded together (a model's layers), by the codecs' identity


def _stacked_projection(projs):
    """One CudaProjection over several same-shape bases, kept while the same codecs code together
    (and by a CUDA graph captured with it)."""
    from .codecs.rans_cuda import held_by_capture
    from .rdquant import CudaProjection

    key = tuple(id(p) for p in projs)
    if key not in _STACKED:
        if len(_STACKED) >= 16:
            _STACKED.pop(next(iter(_STACKED)))
        _STACKED[key] = (projs, CudaProjection.stack(projs))  # holding projs keeps their ids unique
    return held_by_capture(_STACKED[key][1])


def _same_shape_groups(keys) -> list[list[int]]:
    groups = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


GRAPH_MAX_BYTES = 1 << 30  # calls moving up to this many input bytes replay a CUDA graph (0: never); a graph
# keeps its buffers on the GPU (see docs/library.md, "CUDA graphs keep GPU memory", for what each direction holds
# per input byte)
COPY_OUT_SLACK = 4096  # bytes a sync graph's output buffer holds beyond 9/8 of the last call's containers
GRAPH_PLANS = 4  # CUDA graphs kept, one per repeated list of codecs and shapes (each holds its buffers)
_GRAPHS = {}  # key -> _EncodeGraph, or the number of eager calls seen with that key so far


def drop_graphs() -> None:
    """Drop every CUDA graph encode_many and decode_many keep, and with them their GPU buffers."""
    _GRAPHS.clear()
    _DECODE_GRAPHS.clear()


def _on_stream(stream):
    """A context running work on `stream` after what the current stream has queued (its inputs)."""
    import contextlib

    import torch

    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    return torch.cuda.stream(stream)


def encode_many(codecs, tensors, stream=None) -> Sequence:
    """Code tensors[i] with codecs[i] (e.g. every layer's K and V of one step, each layer's codec
    holding its basis and step): a sequence of one blob per tensor, each decodable and checked
    alone. CUDA tensors on the compute codec are coded on their GPU, tensors of one shape together
    in one launch per kernel, with one host synchronization for the whole list, and come back as
    uint8 CUDA tensors (views into one buffer); the rest as bytes. When every tensor is coded on a
    GPU, the sequence is a rans_cuda.Containers: those views, each made when first indexed, whose
    `buffer` and `spans` a transport can send whole and decode_many reads directly.

    stream: a torch.cuda.Stream to queue the GPU work on (it first waits for the current stream,
    which made the inputs); the host synchronization then waits for that stream alone.
    encode_many_async is the same call without the host synchronization.

    A list of codecs and shapes seen again (a decode step's KV, a pipeline stage's activations)
    of up to GRAPH_MAX_BYTES is replayed as one CUDA graph: one launch for every kernel, inputs
    read in place, the blobs copied out of the graph's buffers."""
    return _encode_many(codecs, tensors, stream, sync=True)


def encode_many_async(codecs, tensors, stream=None) -> "rans_cuda.PendingEncode":
    """encode_many without any host synchronization (every tensor a CUDA tensor on the compute
    codec): a rans_cuda.PendingEncode whose buffer and spans (start, length of each container, on the
    device) can be sent as they are, and whose result() gives the blobs, waiting for this call's work
    alone (not for calls queued after it). Calls queued this way run back to back on the GPU while the
    host prepares the next or reads an earlier one's result (a pipeline's steady state); keep each
    call's inputs unchanged until its work has run. A list seen again replays a CUDA graph of its own
    (int32 symbols and escape room for every value, as the eager call codes them), its outputs copied
    out on the stream."""
    return _encode_many(codecs, tensors, stream, sync=False)


def _encode_many(codecs, tensors, stream, sync: bool):
    if len(codecs) != len(tensors):
        raise ConfigurationError(f"{len(codecs)} codecs for {len(tensors)} tensors: give one codec per tensor")
    if not tensors:
        if not sync:
            raise ConfigurationError("encode_many_async needs at least one tensor (it returns one PendingEncode)")
        return []
    if stream is None:  # a list seen before: its graph, before any other work (the key pins every check)
        plan = _GRAPHS.get(_mode_key(_graph_key(codecs, tensors), sync))
        if isinstance(plan, _EncodeGraph):
            return plan.run(tensors) if sync else plan.queue(tensors)
    # the common case (every tensor on a GPU, every codec a compute codec) without a Python loop over the list
    everything = all(map(_SYMBOLS, codecs)) and all(getattr(x, "is_cuda", False) for x in tensors)
    if not sync and not everything:
        raise ConfigurationError("encode_many_async needs every tensor on a GPU and every codec a compute codec "
                                 "(backend='rans'); encode the others with encode_many")
    if everything:
        cs, xs = list(codecs), list(tensors)
    else:
        out = [None] * len(tensors)
        gpu = [i for i, (c, x) in enumerate(zip(codecs, tensors)) if c.symbols and getattr(x, "is_cuda", False)]
        for i in sorted(set(range(len(tensors))) - set(gpu)):
            out[i] = codecs[i].encode(tensors[i])
        if not gpu:
            return out
        cs, xs = [codecs[i] for i in gpu], [tensors[i] for i in gpu]
    with _on_stream(stream):
        key = _mode_key(_graph_key(cs, xs), sync)
        plan = _GRAPHS.get(key)
        if not isinstance(plan, _EncodeGraph):  # a repeat skips the checks: the key pins every codec and shape
            prepared = [c._cuda_prepare(x) for c, x in zip(cs, xs)]
            if key is not None:  # a first call makes the codecs' projections (and quantizers): part of the key
                key = _mode_key(_graph_key(cs, xs), sync)
            plan = _graph_plan(key, cs, xs, prepared)
        if plan is not None and not sync:
            return plan.queue(xs)
        if plan is not None:
            blobs = plan.run(xs)
        else:
            # sync=False: int32 symbols, so that no container needs coding again after its spans are sent
            pending = _encode_launch(cs, xs, prepared, sync=sync, narrow=sync)
            if not sync:
                pending.queue_summary_read(event=True)  # result() waits for this call's work alone
                return pending
            blobs = pending.result()
    if everything:  # a rans_cuda.Containers: views made as they are indexed
        return blobs
    for i, blob in zip(gpu, blobs):
        out[i] = blob
    return out


def _encode_groups(xs, prepared):
    """Tensors that share launches: one input shape and dtype, one device, one basis shape."""
    return _same_shape_groups([(tuple(x.shape), x.dtype, str(x.device), p.projection.K) for x, p in zip(xs, prepared)])


def _encode_launch(codecs, xs, prepared, sync: bool, addresses=None, retry=None, narrow: bool = True):
    """Queue the projection and the coder of every tensor; returns the coder's PendingEncode.
    addresses: per group of _encode_groups, int64 CUDA [n] where the projection reads the group's
    inputs (rdquant.CudaProjection.quantize_many), instead of stacking xs. narrow: a group's
    symbols are int16 unless one of its codecs has met values beyond int16; where a tensor's do
    not fit, the PendingEncode's result() codes the list again (recode) with int32 for that
    tensor's codec. Else int32: every container valid once the queued work has run."""
    import torch

    from .codecs import rans_cuda

    n = len(xs)
    symbols, stats, guards = [None] * n, [None] * n, [None] * n
    for g, idx in enumerate(_encode_groups(xs, prepared)):
        projs = [prepared[i].projection for i in idx]
        # int32 where water-filling drops components: their statistics are then taken from the
        # symbols, which would hide a value wrapped in int16
        group_narrow = narrow and not any(codecs[i]._wide_symbols or _drops_components(prepared[i].quantizer) for i in idx)
        proj = projs[0] if len(idx) == 1 else _stacked_projection(projs)
        if addresses is not None:  # the shape alone: the kernel reads each input at its address
            stack = xs[idx[0]].unsqueeze(0).expand(len(idx), -1, -1)
        else:
            stack = xs[idx[0]].unsqueeze(0) if len(idx) == 1 else torch.stack([xs[i] for i in idx])
        # amax is inf where a tensor holds NaN/Inf: the coder's guard refuses it in its one sync
        sym, (mn, mx, sm), amax = proj.quantize_many(stack, [prepared[i].quantizer.step for i in idx], narrow=group_narrow,
                                                     addresses=None if addresses is None else addresses[g])
        for j, i in enumerate(idx):
            symbols[i], stats[i], guards[i] = sym[j], (mn[j], mx[j], sm[j]), amax[j:j + 1]
            keep = prepared[i].quantizer.keep
            if _drops_components(prepared[i].quantizer):  # water-filling dropped components
                symbols[i] = sym[j].clone()
                symbols[i][:, torch.as_tensor(~keep, device=sym.device)] = 0
                stats[i] = None
    fronts = [p.front for p in prepared]
    pending = rans_cuda.encode_many_cuda(
        symbols, stats=stats, guards=guards, fronts=fronts, backs=[4] * n,  # a self-checked chunk's trailer: 0
        length_field=True,  # the DATA length ends the prefix
        lane_tokens=[c.lane_tokens for c in codecs],
        lanes_by_component=[c.lane_order(*s.shape) for c, s in zip(codecs, symbols)],
        sync=False, retry=sync if retry is None else retry)
    pending.recode = _recode_wide(codecs, xs, prepared)
    return pending


def _drops_components(quantizer) -> bool:
    return quantizer.keep is not None and not quantizer.keep.all()


def _recode_wide(codecs, xs, prepared):
    """PendingEncode.recode for _encode_launch's list: the codecs of the tensors whose values
    outgrew int16 keep int32 symbols from now on, and the list is coded again, eagerly."""
    def recode(copy: bool, flagged) -> list:
        for i in flagged:
            codecs[i]._wide_symbols = True
        return _encode_launch(codecs, xs, prepared, sync=True).result(copy)
    return recode


def _graph_key(codecs, xs):
    """What a CUDA graph of encode_many depends on: each codec's basis, quantizer, projection and
    lane setting (its graph token, new whenever one of them is set: a new step or basis is a new
    object), each input's shape, dtype and device, and the stream. None where no graph applies (graphs off, under Triton's interpreter,
    during a capture, an input that is not a torch tensor or a codec without a projection). Runs
    first on every call, so it maps over the lists (a Python loop over 60 tensors costs ~100 us on
    an NVIDIA H200's host) and reads the stream as the tuple torch.cuda.current_stream() is made
    from (that call costs ~7 us); _graph_plan applies the size limit."""
    import torch

    from .codecs import rans_cuda

    if GRAPH_MAX_BYTES <= 0 or rans_cuda.interpreting():
        return None
    try:
        devices = tuple(map(torch.Tensor.get_device, xs))
        # a host tensor is coded without a graph; checked before the capture query, which a
        # CPU-only build of torch cannot answer
        if not devices or min(devices) < 0 or torch.cuda.is_current_stream_capturing():
            return None
        return (tuple(map(_GRAPH_TOKEN, codecs)), tuple(map(_SHAPE, xs)), tuple(map(_DTYPE, xs)), devices,
                torch._C._cuda_getCurrentStream(devices[0]))
    except (TypeError, AttributeError):  # not a torch tensor; a codec of another kind
        return None


_QUEUED = "queued"  # first field of the key of a graph that encode_many_async replays


def _mode_key(key, sync: bool):
    """The graph key of encode_many_async: the same list's key marked, since that graph
    codes as the eager encode_many_async does (int32 symbols, escape room for every value: no
    container needs coding again once queued) and copies its outputs out on the stream."""
    return key if sync or key is None else (_QUEUED,) + key


def _key_stream(key):
    """The torch.cuda.Stream a graph key names (its last field)."""
    import torch

    stream_id, device_index, device_type = key[-1]
    return torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)


_NBYTES, _DTYPE, _SYMBOLS = operator.attrgetter("nbytes"), operator.attrgetter("dtype"), operator.attrgetter("symbols")
_OFF_16 = 15  # an address's bits below 16-byte alignment
_GRAPH_TOKEN, _SHAPE = operator.attrgetter("_graph_token"), operator.attrgetter("shape")


def _graph_plan(key, codecs, xs, prepared):
    """The CUDA graph of this list of codecs and shapes, captured on its second eager call; None
    while it runs eagerly (first call, no key, water-filled)."""
    from .rdquant import IN_PLACE_DTYPES

    if key is None or sum(map(_NBYTES, xs)) > GRAPH_MAX_BYTES or any(_drops_components(p.quantizer) for p in prepared) \
            or any(_dtype_name(x) not in IN_PLACE_DTYPES for x in xs):
        return None
    return _second_call_graph(_GRAPHS, key, lambda: _EncodeGraph(codecs, xs, prepared, key))


def _second_call_graph(graphs: dict, key, make):
    """The graph kept for key in graphs (encode's or decode's), made by make() on the second eager
    call with that key; None on the first, which compiles the kernels and fills the caches. Keeps
    at most GRAPH_PLANS graphs and 4 x GRAPH_PLANS keys, dropping the oldest."""
    seen = graphs.get(key, 0)
    if not isinstance(seen, int):
        return seen
    if seen == 0:
        graphs[key] = 1
        if len(graphs) > 4 * GRAPH_PLANS:
            graphs.pop(next(k for k, v in graphs.items() if isinstance(v, int)))
        return None
    plans = [k for k, v in graphs.items() if not isinstance(v, int)]
    if len(plans) >= GRAPH_PLANS:
        graphs.pop(plans[0])
    graphs[key] = make()
    return graphs[key]


class _EncodeGraph:
    """encode_many of one list of codecs and shapes as a CUDA graph: every kernel of the projection
    and the coder, the containers in a buffer of worst-case room, and last a kernel that copies
    them (and for queue() the spans, flags and summary) into buffers the call allocated, through
    slots it writes before each replay (PendingEncode.copy_out). run() (sync=True) gives the
    replay a buffer the size of the last call's containers and an eighth more, reads the summary
    after one synchronization, and returns containers in that buffer (copied from the graph's own
    on the host where they outgrew it); queue() (encode_many_async, a key made by _mode_key) gives it
    buffers of worst-case room and returns at once. The projection reads each call's inputs where
    they are, through a table of their addresses, copied to the GPU with the slots: no input is
    copied into the graph (at 256 MB that copy cost 155 us on an NVIDIA H200), but one the kernel
    cannot read in place (not contiguous, or not 16-byte aligned), which is copied into a buffer
    the graph keeps for it."""

    def __init__(self, codecs, xs, prepared, key):
        import torch

        from .codecs import rans_cuda

        self.key, self.groups = key, _encode_groups(xs, prepared)
        self.dev = dev = xs[0].device
        self.order = [i for idx in self.groups for i in idx]  # the address table's order: group by group
        # the inputs' addresses, then the slots of copy_out: where this call's outputs go
        self.addr = torch.zeros(len(xs) + 3, dtype=torch.int64, device=dev)
        at = np.cumsum([0] + [len(idx) for idx in self.groups])
        self.addresses = [self.addr[a:b] for a, b in zip(at[:-1], at[1:])]
        self.codecs, self.prepared = codecs, prepared
        self.held = [c._proj for c in codecs]  # with codecs: keeps the key's ids unique
        self.in_order = self.order == list(range(len(xs)))
        self.staging, self._last = {}, None
        self.place(xs, (0, 0, 0))
        queued = key[0] == _QUEUED
        # sync=False: int32 symbols and escape room for every value, as the eager path codes them
        mode = dict(sync=False, retry=False, narrow=False) if queued else dict(sync=True, retry=True)
        # compiles the in-place variant of the projection outside the capture
        _encode_launch(codecs, xs, prepared, addresses=self.addresses, **mode)
        self.graph = torch.cuda.CUDAGraph()

        def capture():
            # thread_local: another thread may launch on its own stream meanwhile (HostStream decodes on a worker)
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                pending = _encode_launch(codecs, xs, prepared, addresses=self.addresses, **mode)
                pending.copy_out(self.addr[len(xs):], meta=queued)
                if not queued:  # the summary's copy to the host is part of the replay
                    pending.queue_summary_read()
                return pending

        self.pending = rans_cuda.holding_cached(self, capture)
        self.pending.stream = _key_stream(key)  # a replay runs on the current stream the key names
        # sync calls of one shape: the replay copies the containers into a buffer of the call's own,
        # `room` bytes, sized from the last call's (0 until one has run, or where copied on the host)
        self.room = 0
        self.compact_on_device = len(self.pending.jobs) == 1 and self.pending._in_order

    @staticmethod
    def readable(xs, ptrs=None) -> bool:
        """Whether the projection can read every input in place: contiguous and 16-byte aligned."""
        import torch

        ptrs = ptrs or list(map(torch.Tensor.data_ptr, xs))
        return all(map(torch.Tensor.is_contiguous, xs)) and not any(map(_OFF_16.__and__, ptrs))

    def place(self, xs, slots):
        """Points the address table at xs, each input the kernel cannot read in place first copied
        into its staging buffer, and copy_out's slots at this call's output buffers: one small copy
        to the GPU, none when every address is the last call's (the caching allocator often hands
        a call the output block the last call's caller has freed)."""
        import torch

        ptrs = list(map(torch.Tensor.data_ptr, xs))
        if not self.readable(xs, ptrs):
            ptrs = [p if self.readable([x], [p]) else self._staged(i, x) for i, (x, p) in enumerate(zip(xs, ptrs))]
        row = (ptrs if self.in_order else [ptrs[i] for i in self.order]) + list(slots)
        if row == self._last:
            return
        # a new pinned block each time: a queued call's copy may not have run when the next call
        # places its inputs (torch's caching host allocator keeps a block until its copy has run)
        host = torch.empty(len(row), dtype=torch.int64, pin_memory=True)
        host.numpy()[:] = row
        self.addr.copy_(host, non_blocking=True)
        self._last = row

    def _staged(self, i, x) -> int:
        import torch

        if i not in self.staging:
            self.staging[i] = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return self.staging[i].copy_(x).data_ptr()

    def queue(self, xs):
        """encode_many_async by the graph: a rans_cuda.PendingEncode whose buffer, spans and
        flags are copies of the replay's own (on the stream, after it), so later calls may replay
        the graph before its result() is read. The inputs are read in place: keep them unchanged
        until the queued work has run."""
        import torch

        buffer = torch.empty_like(self.pending.buffer)  # room for every container, as the graph's own
        meta = torch.empty(self.pending.meta_words(), dtype=torch.int64, device=self.dev)
        self.place(xs, (buffer.data_ptr(), buffer.numel() // 8, meta.data_ptr()))
        self.graph.replay()
        queued = self.pending.copied(buffer, meta)
        queued.queue_summary_read(event=True)  # result() waits for this call's work alone
        queued.recode = _recode_wide(self.codecs, xs, self.prepared)  # this call's tensors
        return queued

    def run(self, xs) -> list:
        import torch

        out = torch.empty(self.room, dtype=torch.uint8, device=self.dev) if self.room else None
        self.place(xs, (0 if out is None else out.data_ptr(), self.room // 8, 0))
        self.graph.replay()
        self.pending.recode = _recode_wide(self.codecs, xs, self.prepared)  # this call's tensors
        # copied out: the next replay rewrites the graph's buffer
        blobs = self.pending.result(copy=True, out=None if out is None else (out, self.room))
        if self.pending.retried:  # coded again outside the graph: capture afresh later
            _GRAPHS.pop(self.key, None)
        elif self.compact_on_device:  # the next call's room: this one's containers and an eighth more
            self.room = (blobs.buffer.numel() * 9 // 8 + COPY_OUT_SLACK + 15) // 16 * 16
        return blobs


def decode_many(codecs, blobs, device=None, max_elements: int = schema.DEFAULT_MAX_ELEMENTS) -> Sequence:
    """decode() of blobs[i] with codecs[i]. With device="cuda", compute-codec containers are
    decoded on the GPU, payloads of one shape together in one launch per kernel: containers
    already there are read in place (their headers reach the host in one copy for the whole
    list), containers on the host go over through pinned memory; one host synchronization checks
    every payload at the end and names a corrupt one by its index.

    A list of codecs decoded again (GPU-resident containers of one shape, bf16, up to
    GRAPH_MAX_BYTES of output) replays one CUDA graph from its third call on, with no header read:
    each container is held on the GPU against the one the host checked when the graph was made
    (rans_cuda.SlotDecoder), and one that differs or is corrupt is decoded here again, on the host path.
    A replayed call returns a Tensors (views made when indexed, all of them as `stacked`), else a list."""
    import torch

    if len(codecs) != len(blobs):
        raise ConfigurationError(f"{len(codecs)} codecs for {len(blobs)} blobs: give one codec per blob")
    on_gpu = device is not None and str(device).startswith("cuda")
    if on_gpu:
        require_cuda(f"decode(device={str(device)!r})", device)
    key = _decode_graph_key(codecs, blobs, device, max_elements) if on_gpu else None
    plan = _DECODE_GRAPHS.get(key)
    if isinstance(plan, _DecodeGraph):
        values = plan.run(blobs)
        if values is not None:
            return values
        # a container differs from the one the graph checked, is corrupt, or does not fit its slots:
        # the host path decodes the list (and names a corrupt one), and a graph is made again from it
        _DECODE_GRAPHS.pop(key)
    resident = [i for i, b in enumerate(blobs) if on_gpu and _is_tensor(b) and b.is_cuda]
    heads = {}
    if resident:  # every resident container's first bytes, in one device->host copy
        lens = [min(blobs[i].numel(), PREFIX_READ) for i in resident]
        host = torch.cat([blobs[i][:n] for i, n in zip(resident, lens)]).cpu().numpy().tobytes()
        starts = np.cumsum([0] + lens)
        heads = {i: host[starts[j]:starts[j + 1]] for j, i in enumerate(resident)}
    out, jobs = [None] * len(blobs), []  # DecodeJob of each container decoded on the GPU
    for i, (codec, blob) in enumerate(zip(codecs, blobs)):
        if i in heads:
            header, spans = parse_resident(blob, heads[i], blob.numel(), max_elements)
            (qa, qb), (a, b) = spans.get("QPAR", (0, 0)), spans["DATA"]
            if header["quant"]["kind"] == "rd_shared_step" and a + 64 <= len(heads[i]) and qb <= len(heads[i]):
                inner = schema.check_chunks(header, {"QPAR": heads[i][qa:qb], "DATA": heads[i][a:a + 64]},
                                            data_len=b - a, read_inner=read_rans_header)  # as its decoder checks it
                jobs.append(DecodeJob(i, header, heads[i][qa:qb], blob[a:b], heads[i][a:a + 64], inner, heads[i][:a]))
                continue
        header, chunks = unpack(blob, max_elements)
        if on_gpu and header["quant"]["kind"] == "rd_shared_step":
            from .codecs import rans_cuda

            data = chunks["DATA"]
            jobs.append(DecodeJob(i, header, chunks["QPAR"], rans_cuda.pinned(data).to(device, non_blocking=True),
                                  data[:64], None, None))
        else:
            values = codec._decode_symbols_bf16(header, chunks)
            values = _to_output(codec.decode_values(header, chunks), header) if values is None else values
            out[i] = values if device is None else values.to(device)
    if jobs:
        _decode_symbols_cuda(codecs, jobs, out)
        _decode_graph_plan(key, codecs, blobs, jobs)
    return out


def _decode_symbols_cuda(codecs, jobs, out):
    """Compute-codec payloads on the GPU -> out[i]: the coder for all of them, the reconstruction
    by shape, then the one host synchronization on their error flags."""
    import torch

    from .codecs import rans_cuda
    from .rdquant import RDQuantizer

    quantizers, projs, scales = [], [], []
    for i, header, qpar, payload, *_ in jobs:
        codecs[i]._check_basis(header)
        quantizers.append(RDQuantizer.from_bytes(qpar))  # its step checked against the header (schema)
        proj = codecs[i]._projection(header["shape"][1], payload.device)
        projs.append(proj)
        # bf16 output: the decoder writes scaled coefficient rows and one GEMM reconstructs them
        scales.append((quantizers[-1].step, proj.coefficient_bound(), proj.coefficient_width(), proj.K)
                      if header["dtype"] == "bfloat16" else None)
    symbols, err = rans_cuda.decode_many_cuda([j.payload for j in jobs], [j.payload_head for j in jobs], check=False,
                                              max_elements=[j.header["shape"][0] * schema.components(j.header)
                                                            for j in jobs],
                                              parsed=[j.inner for j in jobs], scales=scales)
    for (i, header, *_), sym, proj, scale in zip(jobs, symbols, projs, scales):
        K = sym.shape[1] if scale is None else proj.K  # a scaled decode has checked its K against the basis
        if K != proj.K or [sym.shape[0], proj.D] != header["shape"]:
            raise BitstreamError(f"payload holds [{sym.shape[0]}, {K}] symbols; the header's shape "
                                 f"{header['shape']} and the basis (K={proj.K}) need [{header['shape'][0]}, {proj.K}]")
    # every output bf16: the error flags are final before the reconstruction, so their copy to the
    # host is queued first and the host waits for it alone while the GEMMs run
    early = rans_cuda.EarlyRead().start(err) if all(s is not None for s in scales) else None
    keys = [(tuple(s.shape), projs[j].D, str(s.device), jobs[j].header["dtype"]) for j, s in enumerate(symbols)]
    for group in _same_shape_groups(keys):
        steps = [quantizers[j].step for j in group]
        if jobs[group[0]].header["dtype"] == "bfloat16":
            proj = projs[group[0]] if len(group) == 1 else _stacked_projection([projs[j] for j in group])
            # finite by construction: the decoder flagged every value past the projection's bound
            values = proj.reconstruct_coefficients(rans_cuda._stacked(torch, [symbols[j] for j in group])).unbind(0)
        else:
            values = [((symbols[j].float() * quantizers[j].step) @ projs[j].components_t.float() + projs[j].mean).to(
                getattr(torch, jobs[j].header["dtype"])) for j in group]
            nonfinite = torch.stack([~torch.isfinite(v).all() for v in values]).to(err.dtype)
            err[group] |= nonfinite  # non-finite output (out-of-range parameters) is corruption too
        for j, v in zip(group, values):
            out[jobs[j].index] = v
    bad = rans_cuda.read_on_host(err) if early is None else early.wait()  # the one host synchronization
    if bool(bad.any()):
        rans_cuda.check_lane_map(bad)
        raise BitstreamError(f"{rans_cuda.CORRUPT} (blob {jobs[int(bad.nonzero()[0])].index} of the list)")


_DECODE_GRAPHS = {}  # key -> _DecodeGraph, or the number of eager calls seen with that key so far


def _decode_graph_key(codecs, blobs, device, max_elements):
    """What a CUDA graph of decode_many depends on: each codec and its basis (its graph token), the one
    GPU holding every blob, the output device, the limit, and the stream; the containers
    themselves are held against the ones checked when the graph was made, on the GPU, every call.
    None where no graph applies (a blob on the host or on another GPU, under Triton's interpreter).
    This runs on every call, so it maps over the lists instead of looping in Python."""
    import torch

    from .codecs import rans_cuda

    if rans_cuda.interpreting() or not blobs or GRAPH_MAX_BYTES <= 0:
        return None
    try:
        gpus = {blobs.buffer.get_device()} if isinstance(blobs, rans_cuda.Containers) \
            else set(map(torch.Tensor.get_device, blobs))
    except TypeError:  # a blob that is not a tensor
        return None
    if len(gpus) != 1 or -1 in gpus or torch.cuda.is_current_stream_capturing():
        return None
    gpu = gpus.pop()
    return (tuple(map(_GRAPH_TOKEN, codecs)), gpu, str(device), max_elements,
            torch._C._cuda_getCurrentStream(gpu))  # what torch.cuda.current_stream() is made from (see _graph_key)


def _decode_graph_plan(key, codecs, blobs, jobs):
    """After an eager decode_many that checked every container on the host: count the call, and on
    the second one with this key make its CUDA graph (GPU-resident compute-codec containers of one
    shape, bf16 output of up to GRAPH_MAX_BYTES)."""
    if key is None or len(jobs) != len(blobs) or any(j.front is None or j.header["dtype"] != "bfloat16" for j in jobs):
        return
    shapes = {(tuple(j.header["shape"]), j.inner.T, j.inner.K, j.inner.S, j.inner.G, j.inner.prob_bits, j.inner.layout.flags) for j in jobs}
    if len(shapes) != 1 or any(len(j.front) % 16 for j in jobs):
        return
    T, D = next(iter(shapes))[0]
    if len(jobs) * T * D * 2 > GRAPH_MAX_BYTES:
        return
    _second_call_graph(_DECODE_GRAPHS, key, lambda: _DecodeGraph(codecs, blobs, jobs, key))  # jobs in blob order


class _DecodeGraph:
    """decode_many of one list of codecs as a CUDA graph: the containers staged into fixed slots and
    held against the ones the host checked (rans_cuda.SlotDecoder) and the decoder's kernels, which
    write scaled coefficient rows; then the reconstruction GEMM, launched after the replay into new
    tensors (the graph's own output would need a copy per call, 122 us at 256 MB on an NVIDIA H200);
    one host synchronization per call, on the decoder's error flags alone: the GEMM may still be
    running when the tensors are returned, ordered on the caller's stream like any torch result."""

    def __init__(self, codecs, blobs, jobs, key):
        import torch

        from .codecs import rans_cuda
        from .rdquant import RDQuantizer

        dev = blobs[0].device
        inner, D = jobs[0].inner, jobs[0].header["shape"][1]
        fronts = [j.front for j in jobs]
        self.held = codecs  # keeps the key's ids unique
        cap = rans_cuda.slot_bytes(fronts, inner, max(b.numel() for b in blobs))
        self.projs = [codecs[j.index]._projection(D, dev) for j in jobs]
        self.steps = [RDQuantizer.from_bytes(j.qpar).step for j in jobs]
        self.proj = self.projs[0] if len(self.projs) == 1 else _stacked_projection(self.projs)
        # the decoder writes scaled bf16 coefficient rows into the slot decoder's own buffer; the
        # reconstruction GEMM runs after the replay, into new tensors
        scaled = (rans_cuda.floats_on([float(s) for s in self.steps], dev),
                  rans_cuda.floats_on([p.coefficient_bound() for p in self.projs], dev),
                  self.proj.coefficient_width())
        self.dec = rans_cuda.SlotDecoder(fronts, [j.payload_head for j in jobs], inner, cap, dev, scaled=scaled)
        self.dec.set_sources(blobs)
        self.dec.launch()  # outside the capture: compiles and fills the caches the graph reads
        self.graph = torch.cuda.CUDAGraph()

        # the error flags' copy to the host is part of the replay, and an event recorded after it
        # marks the decoder's end: the host waits for that alone while the GEMM runs (a copy and an
        # event record queued after each replay cost ~25 us of host time on an NVIDIA H200)
        self.err_host = torch.zeros(len(jobs), dtype=torch.int32, pin_memory=True)
        self.err_flags = self.err_host.numpy()

        def capture():
            # thread_local: another thread may launch on its own stream meanwhile (HostStream decodes on a worker)
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                rows, err = self.dec.launch()
                self.err_host.copy_(err, non_blocking=True)
                return rows, err

        rows, self.err = rans_cuda.holding_cached(self, capture)
        self.rows = rans_cuda._stacked(torch, rows)  # [N, T, width], refilled by every replay
        self.proj.coefficient_weights()  # made before the first replay, not inside a timed call
        self.stream, self.decoded = _key_stream(key), torch.cuda.Event()

    def run(self, blobs):
        """The tensors, or None where a container differs from the checked one, is corrupt, or is
        not a 1-D uint8 tensor that fits the graph's slots. The host work is bounded: a few maps
        over the list, the replay, one launch, one synchronization."""
        import torch

        from .codecs import rans_cuda

        sources = self.dec.placed(blobs)
        if sources is None:
            return None
        self.dec.set_sources(blobs, sources)
        self.graph.replay()
        self.decoded.record(self.stream)  # before the GEMM: the host waits for the decoder alone
        values = self.proj.reconstruct_coefficients(self.rows)
        self.decoded.synchronize()  # the one host synchronization
        if self.err_flags.any():
            return None
        return Tensors(values)


class Tensors(LazyViews):
    """The tensors of a decode_many that replayed its CUDA graph: views into one stacked tensor
    [N, T, D] (`stacked`), each made when first indexed (codecs.base.LazyViews): unbinding 60 on
    every call took 75 us on a 2-core CPU machine."""

    __slots__ = ("stacked",)

    def __init__(self, stacked):
        super().__init__(stacked.shape[0])
        self.stacked = stacked

    def _view(self, i: int):
        return self.stacked[i]

    def __repr__(self) -> str:
        return f"Tensors({len(self)} x {list(self.stacked.shape[1:])} {self.stacked.dtype} on {self.stacked.device})"


class StagedDecode:
    """A decode that repeats with no host work: compute-codec containers of bf16 tensors, laid out
    at fixed byte offsets of one GPU buffer, decoded into fixed output rows, as one CUDA graph.

        plan = StagedDecode(codecs, heads, totals, offsets, buffer, outs)
        # each step: bytes of the same containers copied into buffer (an H2D copy on another stream), then
        plan.replay()     # queued on the current stream: no host read, no synchronization
        ...               # after the stream passed the replay (an event, a synchronize):
        plan.check()      # BitstreamError naming the first corrupt container, from flags the replay copied to host

    The host checks each container once, here, from its first bytes (`heads[i]`: at least its header,
    QPAR and the payload's first 64 bytes; `totals[i]`: its length): header and chunk CRCs, the schema,
    the basis, the payload header against the shape. Every replay then checks each payload on the GPU
    (its checksum, tables and lane states, as decode_many does) and raises nothing itself: a caller
    that needs the answer before using the output waits for the stream and calls check(). A payload
    whose bytes changed after this check is decoded as the corrupt data it is and flagged; the header
    bytes before it are not read again (change a container: make a new plan).

    Payloads of one shape decode in one set of launches; outs[i] ([T, D] bf16, contiguous, on the
    buffer's GPU) receives container i. scratch: a uint8 GPU tensor for the coefficient rows (at least
    scratch_bytes()) that plans replayed one after another on one stream may share; pool: a CUDA-graph
    memory pool the same plans may share (torch.cuda.graph_pool_handle()). graph=False: launch eagerly
    (the same kernels; the fallback where a capture fails). stream: where the warm-up and the capture
    run (default: a new side stream). The graph's GEMMs keep the cuBLAS workspace of the stream they
    were captured on, so a caller that replays plans beside other work gives the stream it replays them
    on, one no other graph was captured on (two GEMMs running at once on one workspace can corrupt each
    other or hang).

    reconstruct=False stops before the reconstruction GEMM: outs[i] is then [T, width] bf16 (width =
    the codec's CudaProjection.coefficient_width()) and receives the coefficient rows R, with
    x = R @ coefficient_weights() (the mean rides in two columns of ones). An attention that reads R
    (scores q.x = R @ (W q), outputs p.X = (p.R) @ W) never needs x: the GEMM and its write skipped.

    after: a callable of torch GPU work on the outputs (e.g. RoPE on decoded keys), run after the
    decode in the same graph: it must only queue work on the current stream, allocate nothing it
    keeps, and give the same result when run more than once on freshly decoded outputs."""

    def __init__(self, codecs, heads, totals, offsets, buffer, outs, *, scratch=None, pool=None, graph: bool = True,
                 reconstruct: bool = True, stream=None, max_elements: int = schema.DEFAULT_MAX_ELEMENTS, after=None):
        import torch

        from .codecs import rans_cuda
        from .rdquant import RDQuantizer

        n = len(codecs)
        if not (len(heads) == len(totals) == len(offsets) == len(outs) == n) or n == 0:
            raise ConfigurationError(f"StagedDecode needs one head, length, offset and output per codec; got {n} "
                                     f"codecs, {len(heads)} heads, {len(totals)} lengths, {len(offsets)} offsets, "
                                     f"{len(outs)} outputs")
        if not (_is_tensor(buffer) and buffer.is_cuda and buffer.dtype == torch.uint8 and buffer.dim() == 1):
            raise InvalidTensorError("StagedDecode's buffer must be a 1-D uint8 CUDA tensor")
        if buffer.numel() % PAYLOAD_ALIGN or buffer.data_ptr() % PAYLOAD_ALIGN:
            raise ConfigurationError(f"StagedDecode's buffer must start {PAYLOAD_ALIGN}-byte aligned and hold a multiple of "
                                     f"{PAYLOAD_ALIGN} bytes (the kernels read it as 4- and 8-byte words); it holds "
                                     f"{buffer.numel()}. Fix: allocate it rounded up")
        dev = buffer.device
        jobs = []
        for i, (codec, head, total, offset, out) in enumerate(zip(codecs, heads, totals, offsets, outs)):
            head = bytes(head)
            header, spans = _parse(head, int(total), lazy_last=True, max_elements=max_elements)
            if header["quant"]["kind"] != "rd_shared_step" or header["dtype"] != "bfloat16":
                raise ConfigurationError(f"container {i}: StagedDecode decodes compute-codec containers of bfloat16 "
                                         f"tensors; this one is {header['dtype']} with quantizer "
                                         f"{header['quant']['kind']!r}. Fix: decode it with decode_many")
            (qa, qb), (a, b) = spans["QPAR"], spans["DATA"]
            if min(a + 64, b) > len(head):
                raise ConfigurationError(f"container {i}: its head holds {len(head)} bytes; the payload's header "
                                         f"needs the first {min(a + 64, b)}")
            inner = schema.check_chunks(header, {"QPAR": head[qa:qb], "DATA": head[a:min(a + 64, b)]}, data_len=b - a,
                                        read_inner=read_rans_header)
            codec._check_basis(header)
            proj = codec._projection(header["shape"][1], dev)
            if inner.K != proj.K:
                raise BitstreamError(f"container {i}: payload holds {inner.K} components per token; its basis has {proj.K}")
            shape = header["shape"] if reconstruct else [header["shape"][0], proj.coefficient_width()]
            if not (_is_tensor(out) and out.is_cuda and out.device == dev and out.dtype == torch.bfloat16
                    and list(out.shape) == shape and out.is_contiguous()):
                raise InvalidTensorError(f"output {i} must be a contiguous bfloat16 tensor {shape} on {dev}; "
                                         f"got {getattr(out, 'dtype', type(out).__name__)} "
                                         f"{tuple(getattr(out, 'shape', ()))}")
            if offset % PAYLOAD_ALIGN or offset < 0 or offset + int(total) > buffer.numel():
                raise ConfigurationError(f"container {i} at byte {offset} ({total} bytes) must start 16-byte aligned "
                                         f"inside the buffer of {buffer.numel()} bytes")
            jobs.append(StagedJob(i, inner, offset + a, RDQuantizer.from_bytes(head[qa:qb]).step, proj))
        self.outs, self.buffer, self.n, self.reconstruct, self.after = list(outs), buffer, n, reconstruct, after
        self.groups = []
        # without the GEMM each container decodes straight into its output (a group of one)
        keys = [(j.inner.T, j.inner.K, j.inner.S, j.inner.G, j.inner.prob_bits, j.inner.layout.flags, j.projection.coefficient_width(),
                 reconstruct or j.index) for j in jobs]
        cursor = 0
        for members in _same_shape_groups(keys):
            T, K, width = keys[members[0]][0], keys[members[0]][1], keys[members[0]][6]
            hdrs = [jobs[m].inner for m in members]
            pad = torch.zeros(width - K, dtype=torch.bfloat16)
            pad[:2] = 1  # the mean's two columns (coefficient_rows)
            group = dict(members=members, hdrs=hdrs, K=K, rows_at=cursor, shape=(len(members), T, width),
                         segs=rans_cuda.segment_table(hdrs, [jobs[m].offset for m in members], dev),
                         scaled=(rans_cuda.floats_on([float(jobs[m].step) for m in members], dev),
                                 rans_cuda.floats_on([jobs[m].projection.coefficient_bound() for m in members], dev),
                                 width),
                         weights=[jobs[m].projection.coefficient_weights() for m in members],
                         pad=pad.pin_memory().to(dev, non_blocking=True),  # no host wait on a busy stream
                         err=torch.zeros(len(members), dtype=torch.int32, device=dev),
                         err_host=torch.zeros(len(members), dtype=torch.int32, pin_memory=True))
            if reconstruct:
                cursor += self.scratch_bytes([(len(members), T, width)])
            self.groups.append(group)
        self.rows_bytes = cursor
        if scratch is None:
            scratch = torch.empty(cursor, dtype=torch.uint8, device=dev)
        elif not (_is_tensor(scratch) and scratch.device == dev and scratch.dtype == torch.uint8
                  and scratch.numel() >= cursor):
            raise ConfigurationError(f"scratch must be a uint8 tensor of at least {cursor} bytes on {dev}")
        for g in self.groups:
            g["rows"] = scratch[g["rows_at"]:g["rows_at"] + g["shape"][0] * g["shape"][1] * g["shape"][2] * 2] \
                .view(torch.bfloat16).view(g["shape"]) if reconstruct else outs[g["members"][0]].unsqueeze(0)
        self.scratch, self.graph = scratch, None
        side = torch.cuda.Stream(dev) if stream is None else stream  # an eager run, then the capture
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self._launch()  # compiles the kernels and fills the caches a capture reads
            if graph and not rans_cuda.interpreting():
                self.graph = torch.cuda.CUDAGraph()

                def capture():
                    # capture_begin directly: torch.cuda.graph's entry synchronizes the device and empties
                    # the allocator's cache, which a cache making one plan per layer should not pay
                    self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        self._launch()
                    finally:
                        self.graph.capture_end()

                rans_cuda.holding_cached(self, capture)
        torch.cuda.current_stream(dev).wait_stream(side)

    @staticmethod
    def scratch_bytes(shapes) -> int:
        """Scratch bytes a plan needs for groups of (count, T, width) coefficient rows."""
        return sum((n * T * w * 2 + 255) // 256 * 256 for n, T, w in shapes)

    def _launch(self) -> None:
        import torch

        from .codecs import rans_cuda

        for g in self.groups:
            g["err"].zero_()
            g["rows"][:, :, g["K"]:] = g["pad"]
            rans_cuda.decode_placed(self.buffer, g["segs"], g["hdrs"], g["err"], g["scaled"], g["rows"])
            if self.reconstruct:
                for m, rows, w in zip(g["members"], g["rows"].unbind(0), g["weights"]):
                    torch.mm(rows, w, out=self.outs[m])
            g["err_host"].copy_(g["err"], non_blocking=True)
        if self.after is not None:
            self.after()

    def replay(self) -> None:
        """Queue the decode on the current stream (the buffer must hold the containers' bytes by then)."""
        if self.graph is None:
            self._launch()
        else:
            self.graph.replay()

    def corrupt(self) -> int | None:
        """After the stream passed the last replay: the index of the first container whose payload
        failed its check there, or None."""
        from .codecs import rans_cuda

        bad = [m for g in self.groups for m, flag in zip(g["members"], g["err_host"].numpy()) if flag]
        for g in self.groups:
            rans_cuda.check_lane_map(g["err_host"].numpy())
        return min(bad) if bad else None

    def check(self) -> None:
        """After the stream passed the last replay: BitstreamError naming the first corrupt container."""
        from .codecs import rans_cuda

        first = self.corrupt()
        if first is not None:
            raise BitstreamError(f"{rans_cuda.CORRUPT} (container {first} of the list)")

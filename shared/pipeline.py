"""TensorCodec: a [T, D] tensor -> a self-describing bitstream -> the tensor back.

    codec = TensorCodec(basis, backend="x265", qp=18)      # basis=None codes the raw channels
    blob = codec.encode(x)                                 # bytes
    x_hat = codec.decode(blob)                             # torch tensor, x's dtype and shape

TensorCodec(...) makes one of two codecs, chosen once by `backend`: FrameCodec (per-channel uint8 planes
tiled into frames for a video codec or a byte coder) or ComputeCodec (backend "rans": one shared step,
rANS-coded integer symbols, on the CPU or the GPU). encode_many / decode_many code a list of tensors in
one call (on a GPU, replayed as CUDA graphs where a list repeats); StagedDecode replays a decode of
containers at fixed places with no host work. This module holds the codec classes; it re-exports the
batched calls, which live below it:

  container.py    the byte layout (magic, version, header JSON, CRC-checked chunks), parse and pack
  launches.py     the compute codec's GPU launches (projection + coder, decoder + reconstruction)
  cuda_graphs.py  those launches captured and replayed (EncodeGraph, DecodeGraph, StagedDecode)
  batched.py      encode_many / encode_many_async / decode_many: which path a list takes
  pipeline.py     FrameCodec, ComputeCodec and the TensorCodec facade (this file)

Each imports only the modules listed before it; launches, cuda_graphs and batched take codec objects
and call their methods. The CUDA-graph knobs (GRAPH_MAX_BYTES: 0 turns graphs off) are set on
shared.cuda_graphs; setting one here raises ConfigurationError.

The header names everything the receiver needs: shape, dtype, basis content hash and K,
quantizer kind and bits, codec id and settings, frame layout, and whether the codec's output
was replaced by the raw planes because it would have been larger ("fallback"). The quantizer's
per-channel parameters travel in chunk "QPAR", the codec payload in chunk "DATA".
The basis itself is a per-model artifact and travels separately (PoC 07 measures its size).
"""
from __future__ import annotations

import math
import sys
import types
from typing import NamedTuple

import numpy as np

from . import frames as framing
from . import schema
from .basis import PCABasis, as_float_matrix
from .batched import decode_many, encode_many
from .batched import encode_many_async  # noqa: F401  re-exported (shared.pipeline's API)
from .codecs import get_backend
from .codecs.rans import whole_component_groups
from .container import SELF_CHECKED, _is_tensor, container_prefix, pack, unpack
from .container import MAGIC, VERSION, read_header, unpack_container  # noqa: F401  re-exported (shared.pipeline's API)
from .cuda_graphs import StagedDecode, Tensors, drop_graphs  # noqa: F401  re-exported (shared.pipeline's API)
from .errors import BasisMismatchError, BitstreamError, ConfigurationError, InvalidTensorError
from .launches import Prepared, dtype_name
from .quant import PerChannelQuantizer

SYMBOL_CODER = "rans"  # the compute codec: integer symbols, not frames
FLOAT32_HEADROOM = 1e37  # |coefficient| x basis gain the coder accepts (float32 max is 3.4e38)
FRAME_MIN_COS = 0.95  # the frame path refuses a tensor its 8-bit planes alone code below this mean cosine


SAMPLE_TOKENS = 4096  # tokens a target_cos search looks at (evenly spaced rows of the first tensor coded)


# what a codec's CUDA graphs are made from: setting one gives the codec a new token, an object no
# other codec holds (a count would repeat in a process that unpickles a codec), so one read per
# codec keys a graph (TensorCodec.__setattr__)
_GRAPH_FIELDS = frozenset({"basis", "quantizer", "_proj", "lane_tokens", "lanes_by_component", "water_fill"})


class DeviceProjection(NamedTuple):
    """A codec's GPU projection (TensorCodec._projection), kept for the device it was made on."""
    device: str
    projection: object  # rdquant.CudaProjection


class ContainerFront(NamedTuple):
    """The container bytes before the payload that every tensor of one shape, dtype and step shares."""
    key: tuple  # (shape, dtype, step)
    prefix: bytes


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

        if self._proj is None or self._proj.device != str(device):
            if self.basis is not None:
                if self.basis.dim != D:
                    raise BasisMismatchError(f"basis is for D={self.basis.dim}, tensor has D={D}")
                mean, comps, synthesis = self.basis.mean, self.basis.components, self.basis.synthesis
            else:
                mean, comps, synthesis = np.zeros(D, np.float32), np.eye(D, dtype=np.float32), None
            self._proj = DeviceProjection(str(device), CudaProjection(mean, comps, device=device, synthesis=synthesis))
        if self._proj.projection.D != D:
            raise BasisMismatchError(f"this codec's basis is for D={self._proj.projection.D}, tensor has D={D}")
        return self._proj.projection

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
        dtype = dtype_name(x)
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
        dtype = dtype_name(x)
        if x.dim() != 2 or x.numel() == 0:
            raise InvalidTensorError(f"tensor must be a non-empty 2-D [tokens, channels] tensor, got {tuple(x.shape)}")
        proj = self._projection(x.shape[1], x.device)
        if self.quantizer is None:
            mean, comps, back = proj.mean, proj.components.float(), proj.components_t.float()
            self._step_quantizer(x.float(), (x.float() - mean) @ comps, lambda c: c @ back + mean)
        key = (tuple(x.shape), dtype, self.quantizer.step)
        front = getattr(self, "_front", None)
        if front is None or front.key != key:  # the same header for every tensor of this shape
            header, qpar = self._symbols_header(x.shape, dtype, self.quantizer)
            front = self._front = ContainerFront(key, container_prefix(header, {"QPAR": qpar}, "DATA", 0))
        return Prepared(proj, self.quantizer, front.prefix)

    def encode(self, x):
        """x: [T, D] float tensor (numpy or torch) -> the container: bytes, or for a CUDA tensor a uint8
        CUDA tensor holding the same container bytes, coded on its GPU with one host synchronization
        (the GPU quantizer multiplies in bf16, so its symbols can differ from the CPU's in the last bit
        of a few values)."""
        if getattr(x, "is_cuda", False):
            return encode_many([self], [x])[0]
        return self._encode_symbols(x, dtype_name(x))

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


class _PipelineModule(types.ModuleType):
    """shared.pipeline as a module that refuses, naming the right one, a CUDA-graph knob set on it: the knobs
    live in shared.cuda_graphs, and an assignment here would silently change nothing."""

    def __setattr__(self, name, value):
        if name in _GRAPH_KNOBS:
            raise ConfigurationError(f"shared.pipeline.{name} is not read: the CUDA-graph knobs live in "
                                     f"shared.cuda_graphs. Fix: shared.cuda_graphs.{name} = {value!r}")
        super().__setattr__(name, value)


_GRAPH_KNOBS = frozenset({"GRAPH_MAX_BYTES", "GRAPH_PLANS", "COPY_OUT_SLACK"})
sys.modules[__name__].__class__ = _PipelineModule

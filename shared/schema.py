"""What a bitstream may declare: the container header's schema and the decoder's limits, in one place.

A receiver cannot trust a sender: CRC32 catches noise, not a sender who writes a valid CRC. So
every field of the header is checked against this schema before it sizes an allocation or a loop:

    header = parse_header_json(raw)                  # bounded JSON: an object, shallow, short ints
    validate_header(header, max_elements)            # types, ranges, dtypes, chunk list, frame layout
    check_chunks(header, chunks)                     # chunk sizes against what the header implies

Limits (a caller raises or lowers them with `TensorCodec.decode(blob, max_elements=...)`):
- max_elements: values of the decoded tensor (T x D) and bytes of its decoded frames; default 2^31.
- MAX_HEADER_BYTES of header JSON, nested at most MAX_DEPTH deep, integers of at most MAX_INT_DIGITS digits.
- frame sides FRAME_SIDE_MIN..FRAME_SIDE_MAX pixels, multiples of 8 (also what the encoder accepts).
Every failure is a BitstreamError that names the field at fault.
"""
from __future__ import annotations

import json
import math
import re
import struct

from .errors import BitstreamError, ConfigurationError

DEFAULT_MAX_ELEMENTS = 2**31  # values of one decoded tensor (and bytes of its decoded frames)
MAX_HEADER_BYTES = 1 << 16
MAX_DEPTH = 6  # the header nests 3 deep (codec.settings.key); some room for additions
MAX_INT_DIGITS = 24
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
CHUNKS = ["QPAR", "DATA"]
FRAME_SIDE_MIN, FRAME_SIDE_MAX = 64, 4096  # pixels; multiples of 8 (HEVC encoders and NVDEC want them)
MAX_SETTINGS, MAX_STRING = 32, 256
# Settings that name where or how a session runs on this machine never come from a bitstream.
RESERVED_SETTINGS = {"width", "height", "gpu", "stream", "device", "threads", "sessions", "out"}
_HASH = re.compile(r"[0-9a-f]{16}")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def check_max_elements(max_elements) -> int:
    """The caller's decode limit, itself validated (a configuration error, not a bitstream one)."""
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 1:
        raise ConfigurationError(f"max_elements must be a positive int (values of one decoded tensor), "
                                 f"got {max_elements!r}")
    return max_elements


def check_frame_side(name: str, value) -> int:
    """A frame side the encoder may use: an int, a multiple of 8, FRAME_SIDE_MIN..FRAME_SIDE_MAX."""
    if isinstance(value, bool) or not isinstance(value, int) or value % 8 or \
            not FRAME_SIDE_MIN <= value <= FRAME_SIDE_MAX:
        raise ConfigurationError(f"{name}={value!r}: use a multiple of 8 from {FRAME_SIDE_MIN} to {FRAME_SIDE_MAX}")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BitstreamError(f"header holds an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _no_constant(name: str):
    raise BitstreamError(f"header holds {name}, which JSON does not allow")


def _depth(value, level: int = 1) -> int:
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max([level] + [_depth(v, level + 1) for v in value.values()])
    if isinstance(value, list):
        return max([level] + [_depth(v, level + 1) for v in value])
    return level


def parse_header_json(raw: bytes) -> dict:
    """The header object from its UTF-8 JSON bytes, or BitstreamError (never a json/Recursion error)."""
    if len(raw) > MAX_HEADER_BYTES:
        raise BitstreamError(f"header is {len(raw)} bytes, more than {MAX_HEADER_BYTES}: the bitstream is corrupt")
    # nesting is bounded before parsing: the parser recurses once per bracket
    opened = raw.count(b"[") + raw.count(b"{")
    if opened > 4 * MAX_SETTINGS + 16:
        raise BitstreamError(f"header holds {opened} brackets; the bitstream is corrupt")
    try:
        header = json.loads(raw.decode("utf-8"), parse_int=_bounded_int, parse_constant=_no_constant)
    except BitstreamError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BitstreamError(f"header is not valid JSON ({type(e).__name__}: {e}); the bitstream is corrupt") from None
    if not isinstance(header, dict):
        raise BitstreamError(f"header is a JSON {type(header).__name__}, not an object; the bitstream is corrupt")
    if _depth(header) > MAX_DEPTH:
        raise BitstreamError(f"header nests deeper than {MAX_DEPTH} levels; the bitstream is corrupt")
    return header


def _field(obj: dict, key: str, where: str, types, allow_none: bool = False):
    if not isinstance(obj, dict) or key not in obj:
        raise BitstreamError(f"header field '{where}{key}' is missing; the bitstream is corrupt")
    value = obj[key]
    if value is None and allow_none:
        return None
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in (types if isinstance(types, tuple)
                                                                                    else (types,)))
    if not ok:
        raise BitstreamError(f"header field '{where}{key}' is {type(value).__name__} {value!r:.60}, "
                             f"expected {getattr(types, '__name__', types)}; the bitstream is corrupt")
    return value


def _int_in(obj: dict, key: str, where: str, lo: int, hi: int) -> int:
    value = _field(obj, key, where, int)
    if not lo <= value <= hi:
        raise BitstreamError(f"header field '{where}{key}' = {value} is outside {lo}..{hi}; the bitstream is corrupt")
    return value


def _settings(settings: dict) -> None:
    if len(settings) > MAX_SETTINGS:
        raise BitstreamError(f"header field 'codec.settings' holds {len(settings)} entries (at most {MAX_SETTINGS})")
    for key, value in settings.items():
        if not _KEY.fullmatch(key) or key in RESERVED_SETTINGS:
            raise BitstreamError(f"header field 'codec.settings' names setting {key!r:.70}, which a bitstream "
                                 "may not set; the bitstream is corrupt")
        if isinstance(value, float) and not math.isfinite(value) or \
                isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**31 or \
                isinstance(value, str) and len(value) > MAX_STRING or \
                not isinstance(value, (bool, int, float, str, type(None))):
            raise BitstreamError(f"header field 'codec.settings.{key}' = {value!r:.60} is not a short scalar; "
                                 "the bitstream is corrupt")


def frame_layout(header: dict):
    """The header's frame layout (a FrameLayout), validated; None on the compute-codec path."""
    from .frames import FrameLayout

    frames = header["frames"]
    if frames is None:
        return None
    if set(frames) != {"tokens", "channels", "height", "width"}:
        raise BitstreamError(f"header field 'frames' has keys {sorted(frames)}, expected "
                             "channels, height, tokens, width; the bitstream is corrupt")
    for side in ("height", "width"):
        value = _int_in(frames, side, "frames.", FRAME_SIDE_MIN, FRAME_SIDE_MAX)
        if value % 8:
            raise BitstreamError(f"header field 'frames.{side}' = {value} is not a multiple of 8")
    tokens = _int_in(frames, "tokens", "frames.", 1, 2**62)
    channels = _int_in(frames, "channels", "frames.", 1, 2**62)
    return FrameLayout(tokens, channels, frames["height"], frames["width"])


def frame_bytes(layout) -> int:
    """Bytes of the decoded frames of a layout (n_frames x 3 planes x H x W)."""
    return layout.n_frames * 3 * layout.height * layout.width


def validate_header(header: dict, max_elements: int = DEFAULT_MAX_ELEMENTS) -> dict:
    """Check every field a decoder reads, and their consistency, before any of them is used.
    Returns the header (unchanged) for chaining."""
    max_elements = check_max_elements(max_elements)
    chunks = _field(header, "chunks", "", list)
    if chunks != CHUNKS:
        raise BitstreamError(f"header field 'chunks' = {chunks!r:.80}, expected {CHUNKS}; the bitstream is corrupt")
    shape = _field(header, "shape", "", list)
    if len(shape) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in shape):
        raise BitstreamError(f"header field 'shape' = {shape!r:.60} is not two integers [T, D]")
    T, D = shape
    if T < 1 or D < 1:
        raise BitstreamError(f"header field 'shape' = {shape} holds a size below 1; the bitstream is corrupt")
    if T * D > max_elements:
        raise BitstreamError(f"header field 'shape' = {shape} declares {T * D} values, more than the decode limit "
                             f"max_elements={max_elements}; pass a larger max_elements if this tensor is expected")
    dtype = _field(header, "dtype", "", str)
    if dtype not in FLOAT_DTYPES:
        raise BitstreamError(f"header field 'dtype' = {dtype!r:.40} is not one of {', '.join(FLOAT_DTYPES)}")
    basis = _field(header, "basis", "", dict, allow_none=True)
    K = D
    if basis is not None:
        if set(basis) != {"hash", "k"}:
            raise BitstreamError(f"header field 'basis' has keys {sorted(basis)!r:.80}, expected hash, k")
        if not _HASH.fullmatch(_field(basis, "hash", "basis.", str)):
            raise BitstreamError(f"header field 'basis.hash' = {basis['hash']!r:.40} is not 16 hex digits")
        K = _int_in(basis, "k", "basis.", 1, D)
    quant = _field(header, "quant", "", dict)
    kind = _field(quant, "kind", "quant.", str)
    codec = _field(header, "codec", "", dict)
    codec_id = _field(codec, "id", "codec.", str)
    _settings(_field(codec, "settings", "codec.", dict))
    fallback = _field(header, "fallback", "", str, allow_none=True)
    if fallback is not None and len(fallback) > 4 * MAX_STRING:
        raise BitstreamError(f"header field 'fallback' is {len(fallback)} characters long (at most {4 * MAX_STRING})")
    _field(header, "frames", "", dict, allow_none=True)
    if kind == "rd_shared_step":
        step = _field(quant, "step", "quant.", (float, int))
        if not (math.isfinite(step) and 0 < step <= 3.4e38):
            raise BitstreamError(f"header field 'quant.step' = {step!r} is not a positive finite float32")
        if codec_id != "rans" or header["frames"] is not None:
            raise BitstreamError(f"header pairs quant.kind 'rd_shared_step' with codec '{codec_id:.40}' and frames "
                                 f"{header['frames']!r:.60}; expected codec 'rans' and no frames")
        if codec["settings"]:
            raise BitstreamError("header field 'codec.settings' must be empty for codec 'rans'")
    elif kind == "per_channel":
        _int_in(quant, "bits", "quant.", 8, 8)
        if codec_id == "rans":
            raise BitstreamError("header pairs codec 'rans' with quant.kind 'per_channel'; the bitstream is corrupt")
        layout = frame_layout(header)
        if layout is None:
            raise BitstreamError("header field 'frames' is missing (null) on the frame path")
        if (layout.tokens, layout.channels) != (T, K):
            raise BitstreamError(f"header field 'frames' holds {layout.tokens} x {layout.channels} planes, the shape "
                                 f"and basis say {T} x {K}; the bitstream is corrupt")
        if frame_bytes(layout) > max_elements:
            raise BitstreamError(f"header field 'frames' declares {frame_bytes(layout)} bytes of frames, more than "
                                 f"the decode limit max_elements={max_elements}; pass a larger max_elements")
    else:
        raise BitstreamError(f"header field 'quant.kind' = {kind!r:.40} is not 'per_channel' or 'rd_shared_step'")
    checks = header.get("checks")
    if checks is not None and (checks != {"DATA": "payload"} or codec_id != "rans"):
        raise BitstreamError(f"header field 'checks' = {checks!r:.60}: only a rans DATA payload checks itself "
                             "({'DATA': 'payload'}); the bitstream is corrupt")
    return header


def components(header: dict) -> int:
    """K: the number of coded components (the basis's K, or D without a basis)."""
    return header["basis"]["k"] if header["basis"] is not None else header["shape"][1]


def check_chunks(header: dict, chunks: dict[str, bytes], data_len: int | None = None, read_inner=None):
    """Each chunk's size against what the (validated) header implies; the rANS payload's own header
    against the container's shape and K (so its decoder, CPU or GPU, sizes nothing beyond them).
    data_len: DATA's length when chunks["DATA"] holds only its first bytes (a container read in
    place on a GPU). read_inner: the compute codec's payload-header reader (shared.codecs.rans.
    read_header), which a compute-codec container needs: the container format imports no codec.
    Returns the rANS payload's parsed header (limited to the container's T x K values) for a
    compute-codec container, else None."""
    K = components(header)
    qpar, data = chunks["QPAR"], chunks["DATA"]
    if header["quant"]["kind"] == "per_channel":
        if len(qpar) != 5 + 8 * K:
            raise BitstreamError(f"chunk 'QPAR' is {len(qpar)} bytes, the header's K={K} needs {5 + 8 * K}")
        if header["codec"]["id"] == "raw" and len(data) != frame_bytes(frame_layout(header)):
            raise BitstreamError(f"chunk 'DATA' holds {len(data)} bytes of raw frames, the header's frame layout "
                                 f"needs {frame_bytes(frame_layout(header))}")
        return
    if len(qpar) not in (17, 17 + (K + 7) // 8):
        raise BitstreamError(f"chunk 'QPAR' is {len(qpar)} bytes, the header's K={K} needs 17 or {17 + (K + 7) // 8}")
    (step,) = struct.unpack_from("<d", qpar, 4)
    if step != header["quant"]["step"]:
        raise BitstreamError(f"chunk 'QPAR' step {step!r} differs from header field 'quant.step' "
                             f"{header['quant']['step']!r}: the bitstream is corrupt")
    if read_inner is None:
        raise ValueError("check_chunks needs read_inner (shared.codecs.rans.read_header) for a compute-codec container")
    T = header["shape"][0]
    try:
        inner = read_inner(data, max_elements=T * K, total_len=data_len)
    except BitstreamError as e:
        raise BitstreamError(f"chunk 'DATA': {e}") from None
    if (inner.T, inner.K) != (T, K):
        raise BitstreamError(f"chunk 'DATA' codes a {inner.T} x {inner.K} rANS matrix, the header's shape and basis "
                             f"say {T} x {K}; the bitstream is corrupt")
    return inner

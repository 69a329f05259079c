"""The container every bitstream of this library travels in: TensorCodec's (shared.pipeline) and the
KV codec's (shared.kvcodec), each with its own header fields and chunks.

Bitstream layout (all integers little-endian):

    b"TNSC" | version u8 | header_len u32 | header JSON (UTF-8) | header CRC32 u32
    then one chunk per entry of header["chunks"]:  tag 4 bytes | length u64 | payload | CRC32 u32

Version 2 (this build writes it and reads 1 and 2): the header JSON is padded with spaces so the
last chunk's payload starts at a multiple of 16 bytes (a GPU encoder writes its payload in place
behind the header), and a chunk named in header["checks"] as "payload" carries its own checksum
instead of a CRC32 (its trailer is 0): the rANS payload does (a Fletcher-style sum over every
byte, plus its lanes' final states), which the GPU checks where the payload lies, without a copy.
"""
from __future__ import annotations

import functools
import json
import struct
import zlib

import numpy as np

from . import schema
from .codecs.rans import read_header as read_rans_header
from .errors import BitstreamError, InvalidTensorError

MAGIC = b"TNSC"
VERSION = 2
READABLE_VERSIONS = (1, 2)
SELF_CHECKED = "payload"  # header["checks"][tag]: the chunk's payload verifies itself (no CRC32)
PAYLOAD_ALIGN = 16  # the last chunk's payload starts at a multiple of this many bytes
PREFIX_READ = 4096  # bytes of a GPU-resident container read to the host to parse its header


def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch")


def _host_bytes(blob) -> bytes:
    if _is_tensor(blob):
        import torch

        if blob.dtype != torch.uint8 or blob.dim() != 1:
            raise InvalidTensorError(f"a container tensor is 1-D uint8, got {blob.dtype} {tuple(blob.shape)}")
        return bytes(blob.cpu().numpy())
    if not isinstance(blob, (bytes, bytearray, memoryview, np.ndarray)):
        raise InvalidTensorError(f"decode takes a bitstream (bytes-like or a uint8 tensor), got {type(blob).__name__}")
    return bytes(blob)


def _chunk_head(tag: str, n: int) -> bytes:
    tag_b = tag.encode()
    if len(tag_b) != 4:
        raise ValueError(f"chunk tag must be 4 ASCII bytes, got {tag!r}")
    return tag_b + struct.pack("<Q", n)


def container_prefix(header: dict, chunks: dict, last_tag: str, last_len: int) -> bytes:
    """Every byte of a container before its last chunk's payload (which starts 16-byte aligned):
    the fixed header, the header JSON and its CRC, the other chunks, the last chunk's tag and length.
    A GPU encoder writes this in front of a payload it made in place; pack() uses it too."""
    header = dict(header, chunks=list(chunks) + [last_tag])
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    checks = header.get("checks") or {}
    body = b"".join(_chunk_head(tag, len(payload)) + bytes(payload)
                    + struct.pack("<I", 0 if checks.get(tag) == SELF_CHECKED else zlib.crc32(payload))
                    for tag, payload in chunks.items()) + _chunk_head(last_tag, last_len)
    head += b" " * (-(9 + len(head) + 4 + len(body)) % PAYLOAD_ALIGN)  # JSON allows trailing spaces
    prefix = MAGIC + struct.pack("<BI", VERSION, len(head)) + head
    return prefix + struct.pack("<I", zlib.crc32(prefix)) + body


def pack(header: dict, chunks: dict[str, bytes]) -> bytes:
    *first, last = chunks
    payload = bytes(chunks[last])
    trailer = 0 if (header.get("checks") or {}).get(last) == SELF_CHECKED else zlib.crc32(payload)
    return (container_prefix(header, {t: chunks[t] for t in first}, last, len(payload)) + payload
            + struct.pack("<I", trailer))


def unpack(blob, max_elements: int = schema.DEFAULT_MAX_ELEMENTS) -> tuple[dict, dict[str, bytes]]:
    """(header, chunks) of a bitstream (bytes-like or a 1-D uint8 array/tensor), every CRC and the
    header's schema (shared.schema) checked; a header declaring more than max_elements values is refused."""
    blob = _host_bytes(blob)
    header, spans = _parse(blob, len(blob), max_elements=max_elements)
    chunks = {tag: blob[a:b] for tag, (a, b) in spans.items()}
    schema.check_chunks(header, chunks, read_inner=read_rans_header)
    return header, chunks


def _checked_header(raw: bytes, max_elements: int) -> dict:
    return schema.validate_header(schema.parse_header_json(raw), max_elements)


@functools.lru_cache(maxsize=256)
def _cached_header(raw: bytes, max_elements: int) -> dict:
    """A header parsed and validated once (GPU-resident containers of one layer repeat it); never
    handed to callers, who could change it."""
    return _checked_header(raw, max_elements)


def _parse(blob: bytes, total: int, lazy_last: bool = False,
           max_elements: int | None = schema.DEFAULT_MAX_ELEMENTS) -> tuple[dict, dict[str, tuple[int, int]]]:
    """Header and chunk spans (start, end) of a container of `total` bytes whose first len(blob)
    bytes are given; CRCs checked. lazy_last: the last chunk may lie beyond `blob` when it checks
    itself (a GPU-resident container read from its prefix only)."""
    if len(blob) < 9:
        raise BitstreamError(f"bitstream truncated: {len(blob)} bytes is shorter than the fixed header")
    if blob[:4] != MAGIC:
        raise BitstreamError(f"not a tensor-codec bitstream (magic {blob[:4]!r}, expected {MAGIC!r}): "
                             "corrupt, or not ours")
    version, head_len = struct.unpack_from("<BI", blob, 4)
    if version not in READABLE_VERSIONS:
        hint = ("written by a newer build: upgrade the reader" if VERSION < version <= VERSION + 4
                else "the bitstream is corrupt, or not ours")
        raise BitstreamError(f"bitstream version {version}; this build reads versions {READABLE_VERSIONS}: {hint}")
    if head_len > schema.MAX_HEADER_BYTES:
        raise BitstreamError(f"header length field says {head_len} bytes (at most {schema.MAX_HEADER_BYTES}): "
                             "the bitstream is corrupt")
    end = 9 + head_len
    if len(blob) < end + 4:
        raise BitstreamError("bitstream truncated inside its header")
    (crc,) = struct.unpack_from("<I", blob, end)
    if crc != zlib.crc32(blob[:end]):
        raise BitstreamError("header CRC32 mismatch: the bitstream is corrupt")
    raw = bytes(blob[9:end])
    if max_elements is None:  # another format's header in this container: bounded JSON, a chunk list
        header = schema.parse_header_json(raw)
        if not (isinstance(header.get("chunks"), list) and all(isinstance(t, str) for t in header["chunks"])
                and len(header["chunks"]) <= 8):
            raise BitstreamError("header field 'chunks' is not a short list of chunk tags; the bitstream is corrupt")
    else:
        header = _cached_header(raw, max_elements) if lazy_last else _checked_header(raw, max_elements)
    checks = header.get("checks") or {}
    offset, spans = end + 4, {}
    for i, tag in enumerate(header["chunks"]):
        if offset + 12 > len(blob):
            raise BitstreamError(f"bitstream truncated before chunk {tag!r}")
        got_tag = blob[offset: offset + 4].decode(errors="replace")
        if got_tag != tag:
            raise BitstreamError(f"expected chunk {tag!r}, found {got_tag!r}: the bitstream is corrupt")
        (n,) = struct.unpack_from("<Q", blob, offset + 4)
        start = offset + 12
        if start + n + 4 > total:
            raise BitstreamError(f"chunk {tag!r} truncated: needs {n} bytes, {total - start - 4} left")
        self_checked = checks.get(tag) == SELF_CHECKED
        if self_checked and tag != "DATA":
            raise BitstreamError(f"chunk {tag!r} claims to check itself; only a DATA payload can")
        if not (lazy_last and self_checked and i == len(header["chunks"]) - 1):
            if start + n + 4 > len(blob):
                raise BitstreamError(f"chunk {tag!r} truncated: needs {n} bytes, {len(blob) - start - 4} left")
            (crc,) = struct.unpack_from("<I", blob, start + n)
            if crc != (0 if self_checked else zlib.crc32(blob[start: start + n])):
                raise BitstreamError(f"chunk {tag!r} CRC32 mismatch: the bitstream is corrupt")
        spans[tag] = (start, start + n)
        offset = start + n + 4
    if offset != total:
        raise BitstreamError(f"{total - offset} unexpected bytes after the last chunk")
    return header, spans


def parse_resident(blob, head: bytes, total: int, max_elements: int):
    """Header and chunk spans of a GPU-resident container (a uint8 CUDA tensor of `total` bytes) from
    `head`, its first bytes already on the host; the whole container is read to the host only where
    the header runs past them (longer than PREFIX_READ)."""
    try:
        return _parse(head, total, lazy_last=True, max_elements=max_elements)
    except BitstreamError:
        if len(head) >= total:
            raise
        return _parse(bytes(blob.cpu().numpy()), total, lazy_last=True, max_elements=max_elements)


def unpack_container(blob) -> tuple[dict, dict[str, bytes]]:
    """(header, chunks) of a container that holds another format than a TensorCodec's (the KV codec of
    shared.kvcodec): magic, version, CRCs and the chunk list checked, the header a bounded JSON
    object; its fields are that format's to check."""
    blob = _host_bytes(blob)
    header, spans = _parse(blob, len(blob), max_elements=None)
    return header, {tag: blob[a:b] for tag, (a, b) in spans.items()}


def read_header(blob, max_elements: int = schema.DEFAULT_MAX_ELEMENTS) -> dict:
    """The header of a bitstream (bytes-like or a uint8 tensor), after checking every CRC in it and its schema."""
    return unpack(blob, max_elements)[0]

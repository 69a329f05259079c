"""Tensors through pinned host memory and back to a GPU, chunked and pipelined: the host-staged transfer
(a KV offload's host link, GPUs without peer access, the staging of a send to another machine); and lists
of tensors between processes over torch.distributed (PeerStream, at the end of this file).

    stream = HostStream(codecs)          # codecs[i]: a compute-codec TensorCodec for tensor i, or None: raw
    out = stream.round_trip(tensors)     # CUDA tensors -> pinned host memory -> the same GPU (or device=)
    copy = stream.offload(tensors)       # ... or the two halves apart: to pinned host memory (a HostCopy)
    out = stream.fetch(copy)             #     and back to a GPU later, as a KV offload does
    stream.last                          # what the last call moved: original and wire bytes, chunks

The list is cut into chunks of about `chunk_mb` original bytes (whole tensors, or row blocks of a larger
one). While chunk k is encoded on the encode stream, chunk k-1 crosses to the host on one copy engine and
back on the other; chunk k-1 is then decoded on the decode stream by a worker thread before chunk k+1 is
encoded (encodes and decodes take turns on the SMs; take_turns=False runs them side by side): the GPU's SMs
code, its two copy engines move, and the host only launches. `HostStream(None)` (every tensor raw) runs the
same pipeline without the codec, so both copy engines overlap: it is the baseline every figure is
compared with, not a D2H followed by an H2D.

Received tensors come back in the caller's order, shapes and dtypes; compressed ones at the codec's
quality (each container is checked by its CRC when decoded: a corrupt one raises BitstreamError).
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .batched import decode_many, encode_many
from .codecs.base import require_cuda
from .errors import ConfigurationError, InvalidTensorError, TransferError

CHUNK_MB = 256.0      # original bytes per pipelined chunk of a compressed stream (MiB): the codec's GPU work
#                       is the bottleneck, and it runs faster in larger calls (PoC 15 on an NVIDIA H100: 256 MB
#                       chunks beat 64 and 128 MB ones for 8 x 64 MB and 8 x 256 MB at D = 1024 and 4096)
RAW_CHUNK_MB = 16.0   # bytes per chunk of a raw stream (MiB): small enough that the two copies overlap
SLOTS = 3             # pinned host buffers in rotation (a chunk's D2H may start while two others are held)
TAKE_TURNS = True     # a round trip's encodes and decodes take turns on the SMs by default (HostStream's take_turns)


@dataclass
class Piece:
    """Rows [start, stop) of tensor `index` of the caller's list."""
    index: int
    start: int
    stop: int


@dataclass
class Chunk:
    coded: bool
    pieces: list = field(default_factory=list)
    nbytes: int = 0


@dataclass
class HostCopy:
    """Tensors that HostStream.offload put in pinned host memory, for HostStream.fetch: per chunk its plan,
    its pinned bytes (containers, or raw bytes) and, for a coded chunk, where each container starts and
    ends; each tensor's shape and dtype; the codecs that coded them (fetch decodes with these)."""
    chunks: list
    buffers: list
    spans: list
    layout: list
    codecs: list

    @property
    def nbytes(self) -> int:
        """Host bytes held: what crossed the link."""
        return sum(b.numel() for b in self.buffers)


def compute_codecs(codecs, who: str):
    """codecs as a list (None stays None), each entry a compute-codec TensorCodec or None; a codec of
    the frame path is refused, naming `who` needs the compute codec."""
    if codecs is None:
        return None
    codecs = list(codecs)
    for i, c in enumerate(codecs):
        if c is not None and not getattr(c, "symbols", False):
            raise ConfigurationError(f"codecs[{i}] uses backend {getattr(c.backend, 'name', c.backend)!r}: "
                                     f"{who} codes on the GPU, so give it compute codecs "
                                     "(TensorCodec(basis, backend='rans', ...)) or None for a raw tensor")
    return codecs


def plan_chunks(tensors, coded: list[bool], chunk_bytes: int) -> list[Chunk]:
    """Consecutive tensors of one lane grouped into chunks of at least chunk_bytes (the last may be
    smaller); a tensor larger than chunk_bytes is cut into row blocks of about chunk_bytes, each its own chunk."""
    chunks: list[Chunk] = []
    open_chunk = None
    for i, (x, c) in enumerate(zip(tensors, coded)):
        rows, nbytes = x.shape[0], x.numel() * x.element_size()
        if nbytes > chunk_bytes and rows > 1:
            open_chunk = None
            parts = min(rows, math.ceil(nbytes / chunk_bytes))
            bounds = [rows * p // parts for p in range(parts + 1)]
            for a, b in zip(bounds[:-1], bounds[1:]):
                chunks.append(Chunk(c, [Piece(i, a, b)], nbytes * (b - a) // rows))
            continue
        if open_chunk is None or open_chunk.coded != c or open_chunk.nbytes >= chunk_bytes:
            open_chunk = Chunk(c)
            chunks.append(open_chunk)
        open_chunk.pieces.append(Piece(i, 0, rows))
        open_chunk.nbytes += nbytes
    return chunks


class HostStream:
    """A pipelined round trip of a list of CUDA tensors through pinned host memory (see the module's
    docstring). codecs: a list (one per tensor position; None sends that tensor raw) or None (every
    tensor raw). Settings are fixed when the stream is made; the pinned buffers, CUDA streams and the
    decode worker are made on first use and kept for the calls after it.

    take_turns (round trips on one GPU): the encodes and decodes share the SMs in turns (encode k+1,
    decode k, encode k+2, ...; the copies still overlap both), instead of side by side. Run together,
    the two rANS kernels slowed each other more than the overlap gained: on an NVIDIA H100 at D = 1024,
    256 MB chunks, the encoder's lanes took 2.28 ms beside a decode against 0.40 ms alone, the decoder's
    2.34 against 1.18; 8 x 64 MB round trips ran at 68 GB/s taking turns against 43 GB/s side by side
    (dev/profile_round_trip.py). Where the decode goes to another GPU the two never meet."""

    def __init__(self, codecs=None, *, chunk_mb: float | None = None, slots: int = SLOTS,
                 take_turns: bool = TAKE_TURNS):
        codecs = compute_codecs(codecs, "a host stream")
        chunk_mb = (RAW_CHUNK_MB if not codecs or all(c is None for c in codecs) else CHUNK_MB) \
            if chunk_mb is None else chunk_mb
        if not (isinstance(chunk_mb, (int, float)) and chunk_mb > 0):
            raise ConfigurationError(f"chunk_mb={chunk_mb!r}: use a positive size in MiB")
        if not (isinstance(slots, int) and slots >= 2):
            raise ConfigurationError(f"slots={slots!r}: use at least 2 pinned buffers (one filling, one emptying)")
        if not isinstance(take_turns, bool):
            raise ConfigurationError(f"take_turns={take_turns!r}: use True (a round trip's encodes and decodes "
                                     "take turns on the SMs) or False (they run side by side)")
        self.codecs, self.chunk_bytes, self.slots = codecs, int(chunk_mb * 2**20), slots
        self.take_turns = take_turns
        self._pinned = [None] * slots
        self._streams = {}
        self._worker = None
        self.last: dict = {}

    # -- set-up kept between calls ---------------------------------------------------------------
    def _cuda_streams(self, src, dst):
        import torch

        key = (src.index, dst.index)
        if key not in self._streams:
            self._streams[key] = dict(encode=torch.cuda.Stream(src), d2h=torch.cuda.Stream(src),
                                      h2d=torch.cuda.Stream(dst), decode=torch.cuda.Stream(dst),
                                      free=[torch.cuda.Event() for _ in range(self.slots)])
        return self._streams[key]

    def _slot(self, s: int, nbytes: int):
        import torch

        buf = self._pinned[s]
        if buf is None or buf.numel() < nbytes:
            # grown by a quarter over the need; the old block stays alive (torch's caching host
            # allocator) until the copies queued on it have run
            self._pinned[s] = buf = torch.empty(nbytes + nbytes // 4 + 4096, dtype=torch.uint8, pin_memory=True)
        return buf

    def close(self):
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- the call ---------------------------------------------------------------------------------
    def _checked(self, tensors, call: str):
        """(codecs, the GPU of tensors) after checking the list for this stream; raises naming the problem."""
        import torch

        require_cuda(f"HostStream.{call}")
        codecs = self.codecs if self.codecs is not None else [None] * len(tensors)
        if len(codecs) != len(tensors):
            raise ConfigurationError(f"this stream has {len(codecs)} codecs for {len(tensors)} tensors: give one "
                                     "codec (or None) per tensor position")
        for i, x in enumerate(tensors):
            if not isinstance(x, torch.Tensor) or not x.is_cuda:
                raise InvalidTensorError(f"tensors[{i}] is {type(x).__name__} on "
                                         f"{getattr(x, 'device', 'the host')}: a host stream sends CUDA tensors")
            if x.numel() == 0 or x.dim() == 0:
                raise InvalidTensorError(f"tensors[{i}] is empty or 0-D ({tuple(x.shape)})")
            if codecs[i] is not None and x.dim() != 2:
                raise InvalidTensorError(f"tensors[{i}] has shape {tuple(x.shape)}: the codec takes 2-D [tokens, "
                                         "channels] tensors")
        src = tensors[0].device
        if any(x.device != src for x in tensors):
            raise InvalidTensorError("every tensor of one call must be on one GPU")
        return codecs, src

    def round_trip(self, tensors, device=None, timeline: bool = False) -> list:
        """tensors: CUDA tensors [T, D] (the coded ones 2-D, a dtype the codec takes; raw ones any
        shape) -> the same list on `device` (default: each tensor's own GPU), having crossed to pinned
        host memory and back. The results are ordered on the caller's current stream. timeline=True:
        self.last["timeline"] holds each chunk's stages as (stage, chunk, start_ms, end_ms) from CUDA
        events, relative to the call's start."""
        import torch

        tensors = list(tensors)
        if not tensors:
            return []
        codecs, src = self._checked(tensors, "round_trip")
        dst = _gpu(device, src)
        st = self._cuda_streams(src, dst)
        caller = torch.cuda.current_stream(src)
        for name in ("encode", "d2h"):
            st[name].wait_stream(caller)  # the inputs were made on the caller's stream
        chunks = plan_chunks(tensors, [c is not None for c in codecs], self.chunk_bytes)
        marks = _Marks(timeline, caller)
        raw_out = {}
        decoded: list = []
        held = []  # device buffers read by work on other streams: kept until the call's end
        wire = 0
        if any(ch.coded for ch in chunks) and self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="host-stream-decode")
        # taking turns: decode j starts once encode j+1 has run (encoded[j + 1] set), encode j+2 once decode j
        # has (its future done), so the GPU runs one codec kernel at a time while the host prepares the next
        encoded = [threading.Event() for ch in chunks if ch.coded]
        turns = self.take_turns and dst == src  # decodes on another GPU share no SMs with the encodes
        try:
            for k, ch in enumerate(chunks):
                s = k % self.slots
                if ch.coded:
                    j = len(decoded)
                    if turns and j >= 2:
                        decoded[j - 2].result()
                    xs = [tensors[p.index][p.start:p.stop] for p in ch.pieces]
                    with torch.cuda.stream(st["encode"]):
                        marks.at("encode", k, st["encode"], start=True)
                        blobs = encode_many([codecs[p.index] for p in ch.pieces], xs)
                        marks.at("encode", k, st["encode"])
                    encoded[j].set()
                    buf = blobs.buffer
                    n = buf.numel()
                    held.append(buf)
                    host = self._slot(s, n)
                    dev_buf = self._cross(st, s, k, [(buf, 0, n)], host, n, lambda: torch.empty(
                        n, dtype=torch.uint8, device=dst), marks)
                    held.append(dev_buf)
                    from .codecs.rans_cuda import Containers

                    ready = torch.cuda.Event()
                    ready.record(st["h2d"])
                    decoded.append(self._worker.submit(
                        self._decode, st["decode"], ready, [codecs[p.index] for p in ch.pieces],
                        Containers(dev_buf, blobs.starts, blobs.ends), dst, k, marks,
                        encoded[j + 1] if turns and j + 1 < len(encoded) else None))
                    wire += n
                else:
                    for p in ch.pieces:
                        if p.index not in raw_out:
                            x = tensors[p.index]
                            with torch.cuda.stream(st["h2d"]):
                                raw_out[p.index] = torch.empty(x.shape, dtype=x.dtype, device=dst)
                    sources = _row_ranges(tensors, ch.pieces)
                    held += [b for b, _, _ in sources]  # read by the D2H copy after this call returns
                    n = sum(z - a for _, a, z in sources)
                    host = self._slot(s, n)
                    self._cross(st, s, k, sources, host, n,
                                lambda pieces=ch.pieces: _row_ranges(raw_out, pieces), marks)
                    wire += n
            results = [f.result() for f in decoded]
        except BaseException:
            for e in encoded:  # no decode waits for an encode that will not come
                e.set()
            for f in decoded:
                f.cancel()
            raise
        coded = [ch for ch in chunks if ch.coded]
        outputs = _assemble(len(tensors), [(p, y) for ch, ys in zip(coded, results) for p, y in zip(ch.pieces, ys)],
                            raw_out, caller, st)
        for b in held:  # freed by the caller's next allocation only after the streams that read them
            for name in ("d2h", "h2d", "decode"):
                b.record_stream(st[name])
        original = sum(x.numel() * x.element_size() for x in tensors)
        self.last = dict(original_bytes=original, wire_bytes=wire, chunks=len(chunks),
                         ratio=original / wire if wire else math.inf)
        if timeline:
            self.last["timeline"] = marks.rows()
        return outputs

    def offload(self, tensors) -> "HostCopy":
        """tensors (CUDA, as round_trip takes them) -> a HostCopy in pinned host memory: the coded ones as
        their containers, the raw ones as their bytes. Chunk k is encoded while chunk k-1 is copied to the
        host, so a compressed offload runs at the encoder's speed where that beats the copy. Returns once
        every byte is on the host (the inputs may then change)."""
        import torch

        tensors = list(tensors)
        codecs, src = self._checked(tensors, "offload") if tensors else ([], None)
        copy = HostCopy([], [], [], [(tuple(x.shape), x.dtype) for x in tensors], codecs)
        if not tensors:
            return copy
        st = self._cuda_streams(src, src)
        caller = torch.cuda.current_stream(src)
        st["encode"].wait_stream(caller)
        st["d2h"].wait_stream(caller)
        held = []
        for ch in plan_chunks(tensors, [c is not None for c in codecs], self.chunk_bytes):
            if ch.coded:
                with torch.cuda.stream(st["encode"]):
                    blobs = encode_many([codecs[p.index] for p in ch.pieces],
                                        [tensors[p.index][p.start:p.stop] for p in ch.pieces])
                sources, n = [(blobs.buffer, 0, blobs.buffer.numel())], blobs.buffer.numel()
                held.append(blobs.buffer)
                spans = (blobs.starts, blobs.ends)
            else:
                sources, spans = _row_ranges(tensors, ch.pieces), None
                n = sum(z - a for _, a, z in sources)
            host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            st["d2h"].wait_stream(st["encode"])
            with torch.cuda.stream(st["d2h"]):
                _gather(host, sources)
            copy.chunks.append(ch)
            copy.buffers.append(host)
            copy.spans.append(spans)
        st["d2h"].synchronize()  # every byte on the host: the inputs and the encoder's buffers are free again
        original = sum(x.numel() * x.element_size() for x in tensors)
        self.last = dict(original_bytes=original, wire_bytes=copy.nbytes, chunks=len(copy.chunks),
                         ratio=original / copy.nbytes)
        return copy

    def fetch(self, copy: "HostCopy", device=None) -> list:
        """A HostCopy -> its tensors on `device` (default: the current GPU): every chunk's copy to the GPU
        queued at once on the H2D stream, each chunk decoded as soon as its bytes are there, so the copies
        run behind the decoder. The results are ordered on the caller's current stream."""
        import torch

        from .codecs.rans_cuda import Containers

        require_cuda("HostStream.fetch")
        if not isinstance(copy, HostCopy):
            raise InvalidTensorError(f"fetch takes the HostCopy that offload made, got {type(copy).__name__}")
        dst = _gpu(device, torch.device("cuda"))
        st = self._cuda_streams(dst, dst)
        caller = torch.cuda.current_stream(dst)
        st["h2d"].wait_stream(caller)
        raw_out, arrived = {}, []
        with torch.cuda.stream(st["h2d"]):
            for ch, host, spans in zip(copy.chunks, copy.buffers, copy.spans):
                if ch.coded:
                    dev = torch.empty(host.numel(), dtype=torch.uint8, device=dst)
                    dev.copy_(host, non_blocking=True)
                else:
                    for p in ch.pieces:
                        if p.index not in raw_out:
                            shape, dtype = copy.layout[p.index]
                            raw_out[p.index] = torch.empty(shape, dtype=dtype, device=dst)
                    _scatter(host, _row_ranges(raw_out, ch.pieces))
                    dev = None
                ready = torch.cuda.Event()
                ready.record(st["h2d"])
                arrived.append((dev, ready))
        decoded = []
        for ch, spans, (dev, ready) in zip(copy.chunks, copy.spans, arrived):
            if not ch.coded:
                continue
            st["decode"].wait_event(ready)
            with torch.cuda.stream(st["decode"]):
                values = decode_many([copy.codecs[p.index] for p in ch.pieces], Containers(dev, *spans), device=dst)
            dev.record_stream(st["decode"])
            decoded += zip(ch.pieces, values)
        return _assemble(len(copy.layout), decoded, raw_out, caller, st)

    def _cross(self, st, s, k, sources, host, n, make_destination, marks):
        """D2H of sources (device uint8 tensors, byte ranges) into pinned slot s, then H2D of the same
        bytes into make_destination() (made on the H2D stream: one tensor, or a list of (tensor, start,
        stop) byte ranges); returns what make_destination made."""
        import torch

        d2h, h2d = st["d2h"], st["h2d"]
        d2h.wait_stream(st["encode"])
        d2h.wait_event(st["free"][s])  # the H2D that last read this slot has run
        with torch.cuda.stream(d2h):
            marks.at("d2h", k, d2h, start=True)
            _gather(host, sources)
            marks.at("d2h", k, d2h)
        h2d.wait_stream(d2h)
        with torch.cuda.stream(h2d):
            made = make_destination()
            marks.at("h2d", k, h2d, start=True)
            if isinstance(made, list):
                _scatter(host, made)
            else:
                made.copy_(host[:n], non_blocking=True)
            marks.at("h2d", k, h2d)
            st["free"][s].record(h2d)
        return made

    @staticmethod
    def _decode(stream, ready, codecs, blobs, dst, k, marks, after=None):
        import torch

        if after is not None:  # the next chunk's encode has run: the SMs are this decode's
            after.wait()
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            marks.at("decode", k, stream, start=True)
            values = list(decode_many(codecs, blobs, device=dst))
            marks.at("decode", k, stream)
        return values


def _gpu(device, default):
    """torch.device of the GPU `device` names (default: `default`); ConfigurationError for anything else."""
    import torch

    dst = torch.device(device) if device is not None else default
    if dst.type != "cuda":
        raise ConfigurationError(f"device={device!r}: a host stream's tensors come back to a GPU")
    return torch.device("cuda", torch.cuda.current_device() if dst.index is None else dst.index)


def _row_ranges(tensors, pieces) -> list:
    """(bytes of tensors[p.index], start, stop) of each piece's rows: a flat uint8 view and a byte range."""
    out = []
    for p in pieces:
        x = tensors[p.index]
        row = x.numel() // x.shape[0] * x.element_size()
        out.append((_bytes_of(x), p.start * row, p.stop * row))
    return out


def _gather(host, ranges):
    """Queue copies of the byte ranges [(uint8 tensor, start, stop)], one after the other, into host."""
    at = 0
    for b, a, z in ranges:
        host[at:at + z - a].copy_(b[a:z], non_blocking=True)
        at += z - a


def _scatter(host, ranges):
    """_gather's inverse: host's bytes, in order, into the byte ranges."""
    at = 0
    for b, a, z in ranges:
        b[a:z].copy_(host[at:at + z - a], non_blocking=True)
        at += z - a


def _assemble(n: int, decoded, raw_out: dict, caller, st) -> list:
    """The call's n results: each coded tensor's decoded pieces ((piece, tensor) in row order) joined, the raw
    ones as received; ordered on the caller's stream after the copies and decodes that made them."""
    import torch

    caller.wait_stream(st["h2d"])
    caller.wait_stream(st["decode"])
    pieces_of = {}
    for p, y in decoded:
        pieces_of.setdefault(p.index, []).append(y)
    outputs = [None] * n
    for i, ys in pieces_of.items():
        outputs[i] = ys[0] if len(ys) == 1 else torch.cat(ys)
    for i, y in raw_out.items():
        outputs[i] = y
    for y in outputs:
        y.record_stream(caller)
    return outputs


def _bytes_of(x):
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    x = x if x.is_contiguous() else x.contiguous()
    return x.reshape(-1).view(__import__("torch").uint8)


class _Marks:
    """CUDA events at each stage's start and end when a timeline is asked for; nothing otherwise."""

    def __init__(self, on: bool, caller):
        import torch

        self.on, self.events = on, []
        if on:
            self.zero = torch.cuda.Event(enable_timing=True)
            self.zero.record(caller)
            self.t0 = time.perf_counter()

    def at(self, stage: str, k: int, stream, start: bool = False):
        if self.on:
            import torch

            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            self.events.append((stage, k, start, e))

    def rows(self) -> list[tuple]:
        import torch

        torch.cuda.synchronize()
        begun = {}
        out = []
        for stage, k, start, e in self.events:
            if start:
                begun[(stage, k)] = self.zero.elapsed_time(e)
            else:
                out.append((stage, k, begun.pop((stage, k)), self.zero.elapsed_time(e)))
        return sorted(out, key=lambda r: r[2])


# ------------------------------------------------------------------------- between processes (torch.distributed)
# A list of tensors goes to one peer rank as messages of torch.distributed's point-to-point calls (gloo over TCP,
# NCCL between GPUs): a head, a descriptor, the coded tensors' containers in one blob (if any), then each raw
# tensor's bytes as they are. The head and the descriptor say everything the receiver needs besides the basis of
# a coded tensor (each container names its basis by hash): shapes, dtypes, which tensors are coded, their sizes.
WIRE_MAGIC = int.from_bytes(b"TCSTREAM", "big")  # 0x5443535452454D41, first word of every head
WIRE_VERSION = 1
HEAD_WORDS = 8       # magic, version, stream id, sequence number, tensors, descriptor words, payload bytes, check
MAX_DIMS = 8
TENSOR_WORDS = 5 + MAX_DIMS  # per tensor: lane (0 raw, 1 coded), dtype, ndim, dims, then for a coded tensor its
#                              container's offset in the blob and length, for a raw one 0 and its payload check
RAW, CODED = 0, 1
MAX_TENSORS = 1 << 16        # a head naming more is refused before anything is sized from it
CHECK_BLOCK_WORDS = 1 << 24  # 32-bit words a payload check sums at a time (64 MiB of payload)
TIMEOUT_S = 120.0            # a receive waits this long for each message before naming the stall (a sender's
#                              first list may wait for its GPU coder's kernels to compile: tens of seconds)


def _wire_dtypes():
    import torch

    return [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
            torch.float32, torch.float64, torch.bool]


def _mix(words) -> int:
    """A check word of int64 words (a multiply-xor hash, kept within int64): detects a garbled head or
    descriptor, or a message of another protocol read as ours."""
    h = 0x2545F4914F6CDD1D
    for w in words:
        h = ((h ^ (int(w) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


def payload_check(t) -> int:
    """A 63-bit check of a tensor's bytes, computed where it lies (CPU or GPU): the wrapped sum of its 32-bit
    words plus a multiple of their position-weighted sum. Any flipped, swapped or truncated word changes it;
    it guards against a broken wire or peer, not an adversary (a coded tensor's container has its own CRC32)."""
    import torch

    b = _bytes_of(t)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    words = b.view(torch.int32)
    s1 = s2 = 0
    # in blocks: int64 copies of the whole payload (words, positions, products) would be 6x its size; the
    # sums are taken mod 2^63 at the end, so adding the blocks' wrapped int64 sums gives the same check
    for at in range(0, words.numel(), CHECK_BLOCK_WORDS):
        w = words[at:at + CHECK_BLOCK_WORDS].to(torch.int64)
        pos = torch.arange(at + 1, at + w.numel() + 1, device=w.device, dtype=torch.int64)
        s1, s2 = s1 + int(w.sum()), s2 + int((w * pos).sum())
    return ((s1 + 0x9E3779B97F4A7C15 * s2 + t.numel() * element_bits(t)) & 0x7FFFFFFFFFFFFFFF)


def element_bits(t) -> int:
    return t.element_size() * 8


class PeerStream:
    """Lists of tensors to or from one peer rank over torch.distributed, each message self-describing.

        # rank 0                                        # rank 1
        tx = PeerStream(peer=1, codecs=codecs)          rx = PeerStream(peer=0, codecs=codecs)
        tx.send(tensors)                                tensors = rx.recv(device="cuda")

    codecs: one per tensor position (a compute-codec TensorCodec, or None: raw), the same list at both ends
    (the receiver needs each coded tensor's basis: its container names it by hash and the decoder checks it);
    None sends everything raw. stream_id tells streams apart: a message of another stream (a mixed-up peer)
    is refused. The process group's backend sets where messages live: NCCL sends CUDA tensors, gloo CPU ones
    (CUDA tensors are staged through pinned host memory). Each receive waits at most timeout_s for its
    message; a dead, stalled or wrong peer raises TransferError (a corrupt container BitstreamError), and no
    tensor of a failed list is returned. After a TransferError the process group may hold a posted receive:
    tear it down (torch.distributed.destroy_process_group) before using it again."""

    def __init__(self, peer: int, codecs=None, *, stream_id: int = 0, group=None, timeout_s: float = TIMEOUT_S,
                 max_bytes: int = 1 << 40):
        codecs = compute_codecs(codecs, "a peer stream")
        if not (isinstance(stream_id, int) and 0 <= stream_id < 2**62):
            raise ConfigurationError(f"stream_id={stream_id!r}: use an int in [0, 2^62)")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ConfigurationError(f"timeout_s={timeout_s!r}: use a positive number of seconds")
        self.peer, self.codecs, self.stream_id, self.group = peer, codecs, stream_id, group
        self.timeout_s, self.max_bytes = float(timeout_s), int(max_bytes)
        self.sent = self.received = 0  # sequence numbers: a lost or repeated list is refused
        self.last: dict = {}

    # -- both ends ----------------------------------------------------------------------------------
    def _device(self):
        import torch
        import torch.distributed as dist

        return torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def _codec(self, i: int, n: int):
        if self.codecs is None:
            return None
        if len(self.codecs) != n:
            raise ConfigurationError(f"this stream has {len(self.codecs)} codecs for a list of {n} tensors")
        return self.codecs[i]

    def _send(self, t):
        import torch.distributed as dist

        try:
            dist.send(t, self.peer, group=self.group)
        except Exception as e:  # noqa: BLE001 - as in _recv
            raise TransferError(f"sending list {self.sent} to rank {self.peer} failed: the peer died or closed the "
                                f"link ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from e

    def _recv(self, t, what: str):
        import datetime

        import torch.distributed as dist

        try:
            work = dist.irecv(t, self.peer, group=self.group)
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - gloo and NCCL raise RuntimeError and DistBackendError alike
            raise TransferError(f"receiving the {what} of list {self.received} from rank {self.peer} failed after at "
                                f"most {self.timeout_s:g} s: the peer died, stalled or closed the link "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from e
        return t

    # -- sender ---------------------------------------------------------------------------------------
    def send(self, tensors) -> dict:
        """Send tensors (a list; coded ones 2-D as the codec takes them) to the peer; returns the bytes moved."""
        import torch

        tensors = list(tensors)
        n = len(tensors)
        if n > MAX_TENSORS:
            raise InvalidTensorError(f"{n} tensors in one list; at most {MAX_TENSORS}")
        dev = self._device()
        dtypes = _wire_dtypes()
        coded = [i for i in range(n) if self._codec(i, n) is not None]
        blob, spans = None, {}
        if coded:  # every coded tensor's container in one blob: one message however many there are
            from .codecs.rans_cuda import Containers

            blobs = encode_many([self.codecs[i] for i in coded], [tensors[i] for i in coded])
            if isinstance(blobs, Containers):  # on the GPU, already in one buffer
                starts, lengths = blobs.starts.tolist(), blobs.lengths.tolist()
                blob = blobs.buffer[:max(a + b for a, b in zip(starts, lengths))]
            else:
                parts = [b.reshape(-1) if isinstance(b, torch.Tensor) else torch.frombuffer(bytearray(b), dtype=torch.uint8)
                         for b in blobs]
                lengths = [p.numel() for p in parts]
                starts = _offsets(lengths)
                blob = torch.cat([p.to(dev) for p in parts])
            blob = blob.to(dev)
            spans = {i: (a, b) for i, a, b in zip(coded, starts, lengths)}
        desc = []
        raw_parts = []
        for i, x in enumerate(tensors):
            if not isinstance(x, torch.Tensor):
                raise InvalidTensorError(f"tensors[{i}] is {type(x).__name__}, not a torch tensor")
            if x.dtype not in dtypes or x.dim() > MAX_DIMS:
                raise InvalidTensorError(f"tensors[{i}]: {x.dtype} with {x.dim()} dims; the wire carries "
                                         f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)} up to {MAX_DIMS} dims")
            dims = list(x.shape) + [0] * (MAX_DIMS - x.dim())
            if i in spans:
                desc += [CODED, dtypes.index(x.dtype), x.dim(), *dims, *spans[i]]
            else:
                part = _bytes_of(x).to(dev) if x.numel() else torch.empty(0, dtype=torch.uint8, device=dev)
                raw_parts.append(part)
                desc += [RAW, dtypes.index(x.dtype), x.dim(), *dims, 0, payload_check(part) if part.numel() else 0]
        desc.append(_mix(desc))
        payload = (0 if blob is None else blob.numel()) + sum(p.numel() for p in raw_parts)
        head = [WIRE_MAGIC, WIRE_VERSION, self.stream_id, self.sent, n, len(desc), payload]
        head.append(_mix(head))
        self._send(torch.tensor(head, dtype=torch.int64, device=dev))
        self._send(torch.tensor(desc, dtype=torch.int64, device=dev))
        if blob is not None:
            self._send(blob)
        for p in raw_parts:
            if p.numel():
                self._send(p)
        self.sent += 1
        self.last = dict(tensors=n, coded=len(coded), wire_bytes=payload,
                         original_bytes=sum(x.numel() * x.element_size() for x in tensors))
        return self.last

    # -- receiver -------------------------------------------------------------------------------------
    def recv(self, device=None) -> list:
        """The next list from the peer, checked whole before it is returned: on `device` (default: where the
        process group's messages live; coded tensors are decoded there)."""
        import torch

        dev = self._device()
        head = self._recv(torch.empty(HEAD_WORDS, dtype=torch.int64, device=dev), "head").tolist()
        magic, version, stream_id, seq, n, desc_words, payload, check = head
        if magic != WIRE_MAGIC or check != _mix(head[:-1]):
            raise TransferError(f"rank {self.peer} sent a head that is not this protocol's (magic {magic:#x}, check "
                                f"{'ok' if check == _mix(head[:-1]) else 'failed'}): a wrong or mixed-up peer")
        if version != WIRE_VERSION:
            raise TransferError(f"rank {self.peer} speaks wire version {version}; this end reads {WIRE_VERSION}")
        if stream_id != self.stream_id:
            raise TransferError(f"rank {self.peer} sent a list of stream {stream_id} to this stream ({self.stream_id}): "
                                "a mixed-up peer")
        if seq != self.received:
            raise TransferError(f"rank {self.peer} sent list {seq}, this end expected list {self.received}: a list "
                                "was lost or repeated")
        if not (0 <= n <= MAX_TENSORS and desc_words == n * TENSOR_WORDS + 1 and 0 <= payload <= self.max_bytes):
            raise TransferError(f"rank {self.peer}'s head declares {n} tensors, {desc_words} descriptor words and "
                                f"{payload} bytes: out of range (at most {MAX_TENSORS} tensors, {self.max_bytes} bytes)")
        desc = self._recv(torch.empty(desc_words, dtype=torch.int64, device=dev), "descriptor").tolist()
        if desc[-1] != _mix(desc[:-1]):
            raise TransferError(f"rank {self.peer}'s descriptor of list {seq} fails its check: corrupt")
        dtypes = _wire_dtypes()
        entries, coded_bytes, raw_bytes = [], 0, 0
        for i in range(n):
            lane, code, ndim, *rest = desc[i * TENSOR_WORDS:(i + 1) * TENSOR_WORDS]
            dims, at, last = rest[:MAX_DIMS], rest[MAX_DIMS], rest[MAX_DIMS + 1]
            if lane not in (RAW, CODED) or not 0 <= code < len(dtypes) or not 0 <= ndim <= MAX_DIMS \
                    or any(d < 0 for d in dims) or any(dims[ndim:]):
                raise TransferError(f"rank {self.peer}'s descriptor of tensor {i} is malformed "
                                    f"(lane {lane}, dtype code {code}, {ndim} dims {dims})")
            shape, dtype = tuple(dims[:ndim]), dtypes[code]
            if lane == CODED:
                if self._codec(i, n) is None:
                    raise TransferError(f"rank {self.peer} sent tensor {i} coded, and this end has no codec for it")
                if not (0 <= at and 0 < last and at + last <= payload):
                    raise TransferError(f"rank {self.peer}'s coded tensor {i} declares bytes [{at}, {at + last})")
                coded_bytes = max(coded_bytes, at + last)
            else:
                raw_bytes += math.prod(shape) * dtype.itemsize
            entries.append((lane, shape, dtype, at, last))
        if coded_bytes + raw_bytes != payload:
            raise TransferError(f"rank {self.peer}'s descriptor sums to {coded_bytes + raw_bytes} bytes, its head "
                                f"says {payload}: corrupt")
        blob = self._recv(torch.empty(coded_bytes, dtype=torch.uint8, device=dev), "coded blob") if coded_bytes \
            else None
        out, coded = [None] * n, []
        for i, (lane, shape, dtype, at, last) in enumerate(entries):
            if lane == CODED:
                coded.append((i, at, last))
                continue
            y = torch.empty(shape, dtype=dtype, device=dev)
            if y.numel():
                self._recv(_bytes_of(y), f"tensor {i}")
                if payload_check(y) != last:
                    raise TransferError(f"tensor {i} of list {seq} from rank {self.peer} fails its payload check: "
                                        "corrupt on the wire or at the sender")
            out[i] = y
        target = dev if device is None else __import__("torch").device(device)
        if coded:
            from .codecs.rans_cuda import Containers

            starts = np.array([a for _, a, _ in coded], np.int64)
            ends = starts + np.array([b for _, _, b in coded], np.int64)
            if target.type == "cuda":  # decoded in place: views of the received blob
                blobs = Containers(blob.to(target), starts, ends)
            else:
                host = blob.cpu().numpy().tobytes()
                blobs = [host[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
            values = decode_many([self.codecs[i] for i, _, _ in coded], blobs,
                                 device=target if target.type == "cuda" else None)
            for (i, _, _), v in zip(coded, values):
                _, shape, dtype, _, _ = entries[i]
                if tuple(v.shape) != shape or v.dtype != dtype:
                    raise TransferError(f"tensor {i}'s container decodes to {tuple(v.shape)} {v.dtype}, its "
                                        f"descriptor says {shape} {dtype}: a mixed-up peer")
                out[i] = v
        self.received += 1
        self.last = dict(tensors=n, coded=len(coded), wire_bytes=payload)
        return [y if y.device == target else y.to(target) for y in out]


def _offsets(lengths):
    at, out = 0, []
    for n in lengths:
        out.append(at)
        at += n
    return out

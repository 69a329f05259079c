"""The rANS coder of shared/codecs/rans.py on a GPU: the same bitstream, written and read by Triton kernels.

    from shared.codecs import rans_cuda
    p = rans_cuda.encode_cuda(t)        # torch int32 CUDA [T, K] -> torch uint8 CUDA (the bytes rans.encode writes)
    t = rans_cuda.decode_cuda(p)        # torch uint8 CUDA (any rans payload) -> torch int32 CUDA [T, K]

The format, the table rules and the numpy reference live in rans.py; this module holds only the
host code that sizes buffers and launches the kernels of _rans_triton.py.
"""
from __future__ import annotations

import copy
import operator
import os

import numpy as np

from ..errors import BackendUnavailable, BitstreamError, InvalidTensorError
from .base import LazyViews
from .rans import (CHECKED_HEADER_BYTES, DEFAULT_GROUP_LANES, HEADER, LANES_BY_COMPONENT, MAGIC, VERSION, Layout,
                   Parsed, _check_settings, _parse_header_only, default_lane_tokens, default_prob_bits,
                   whole_component_groups)
from .rans_tables import (ESCAPE_COST, MODEL_MIN_SHARE, MODEL_SEARCH, N_SHAPES, PARAM_BYTES, SHAPE_STEPS,
                          TABLE_ENTRY_COST, _bitlen, _neg_log2_table, hist_row_stride, max_alphabet, model_tables)

_DTYPE = operator.attrgetter("dtype")

# --------------------------------------------------------------------------------------------
# Kernels are loaded on first use, so importing this module needs neither Triton nor a GPU. With TRITON_INTERPRET=1 they also run on CPU tensors
# (slowly), which is how the CPU machine tests them against the numpy coder.

_KERNELS = None


def interpreting() -> bool:
    """True where Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1: the tests on a machine without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels():
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(f"the GPU rANS coder needs Triton ({e}); pip install triton, "
                                 "or use the CPU coder rans.encode/rans.decode") from None

    from . import _rans_triton as kt

    _KERNELS = dict(fields=kt.SUMMARY_FIELDS, seg_fields=kt.SEG_FIELDS, hist=kt.hist_kernel, tables=kt.tables_kernel, encode=kt.encode_kernel,
                    pack_meta=kt.pack_meta_kernel, gather=kt.gather_streams_kernel, checksum=kt.checksum_kernel,
                    finish=kt.finish_checksum_kernel, copy_out=kt.copy_out_kernel, layout=kt.layout_kernel,
                    fronts=kt.fronts_kernel, decode_meta=kt.decode_meta_kernel, decode=kt.decode_kernel,
                    stage=kt.stage_kernel, check_fronts=kt.check_fronts_kernel,
                    recip_max_prob_bits=kt.RECIP_MAX_PROB_BITS)
    return _KERNELS


def _torch():
    try:
        import torch
    except ImportError as e:
        raise BackendUnavailable(f"the GPU rANS coder needs torch ({e})") from None
    return torch


def _check_device(t, what: str):
    if t.device.type != "cuda" and not interpreting():
        raise BackendUnavailable(
            f"{what} needs a CUDA tensor (got one on {t.device}); move it with .cuda(), or use the CPU coder "
            "(rans.encode/rans.decode), or set TRITON_INTERPRET=1 to run the kernels on the CPU for tests")


def read_on_host(t, host=None, stream=None):
    """A small device tensor on the host: copied into host (pinned memory, made when None) on
    stream (default: the current one), then that stream alone is waited for; returns host. On an
    NVIDIA H200's host this costs ~60 us less than t.cpu(), whose pageable copy is staged."""
    torch = _torch()
    if t.device.type != "cuda":  # Triton's CPU interpreter (tests)
        return t.clone()
    if host is None or host.shape != t.shape:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    if stream is None:
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
    else:
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        stream.synchronize()
    return host


class EarlyRead:
    """A small device tensor read to the host as soon as the work queued so far has made it, while
    later work (a reconstruction GEMM) is queued behind it: start() queues the copy into pinned
    memory and an event, wait() waits for that event alone and returns the host tensor, so the
    host's remaining work overlaps the GPU's instead of following it. A caller that keeps the object
    (the decode graph) reuses its pinned buffer and event; a new one per call makes both anew, as
    read_on_host(t) without a host buffer does."""

    def __init__(self):
        self.host, self.event = None, None

    def start(self, t):
        torch = _torch()
        if t.device.type != "cuda":  # Triton's CPU interpreter (tests)
            self.host = t.clone()
            return self
        if self.host is None or self.host.shape != t.shape or self.host.dtype != t.dtype:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.event = torch.cuda.Event()
        self.host.copy_(t, non_blocking=True)
        self.event.record(torch.cuda.current_stream(t.device))
        return self

    def wait(self):
        if self.event is not None:
            self.event.synchronize()
        return self.host


def pinned(data: bytes):
    """A host copy of `data` in pinned memory (torch's caching host allocator keeps the block alive
    until the asynchronous copy that reads it has run), so a host->device copy of it is asynchronous."""
    torch = _torch()
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t.pin_memory() if torch.cuda.is_available() else t


_SUMMARY_START = {}


def _summary_start(torch, dev):
    """The encoder summary's initial slots (lo_min starts high, lo_max low), kept on the device."""
    key = str(dev)
    if key not in _SUMMARY_START:
        _SUMMARY_START[key] = torch.tensor([0, 0, 0, 2**62, -2**62, 0, 0, 0, 0, 0], dtype=torch.int64).to(dev)
    return _SUMMARY_START[key]


GROUPS_PER_PROGRAM = 1  # lane groups per Triton program on a GPU: one warp, so each step's values keep one layout
# (with more, Triton moves them between layouts through shared memory; instruction counts in docs/findings.md)
INTERPRETER_GROUPS_PER_PROGRAM = 4  # under Triton's CPU interpreter (tests): the same lanes in a quarter of the programs
USE_WARP_VOTE = True  # lanes kernels: a lane's rank in its group's stream by warp vote (see _rans_triton.lanes_before)
# histogram: sampled tokens a thread walks (<= 255: 8-bit packed counters), a program's row chunks and
# components (its tile, [components, row chunks] in the kernel) and its warps. Many tokens a thread halve the
# programs, so the atomics that flush their bins; the loop's work per value, not its loads' latency, bounds it
# (measurements in docs/findings.md).
HIST_TOKENS, HIST_CHUNKS, HIST_COMPONENTS, HIST_WARPS = 64, 8, 16, 4
HIST_AHEAD = 4  # sampled rows a thread loads before counting them (1, 2 or 4): their loads in flight together.
# 4, the most, ran fastest at every size measured, with the same bytes (docs/findings.md)
CHECKSUM_BLOCK, CHECKSUM_ITERS = 4096, 4  # checksum: bytes per step, steps per program (product <= 65521);
# 4 steps suit short payloads, long ones run faster at 15 (measurements in docs/findings.md); payloads of
CHECKSUM_LONG_BYTES, CHECKSUM_LONG_ITERS = 32 << 20, 15  # this many bytes or more (the longest one) take 15 steps
# warps per component of the encoder's and the decoder's table kernels: more for a few components
# (latency), one where there are many (throughput); measurements in docs/findings.md
TABLE_WARPS, META_WARPS = 4, 2  # up to MANY_COMPONENTS components in a launch
MANY_COMPONENTS = 1024  # more in one launch: one warp each (pack_meta too)
META_BLOCK = 256  # components a meta kernel sums at a time for the offsets of those before its own
# registers a thread of the tables kernel may hold with one warp a component: 128 without a bound, so 16
# warps an SM; at 80 more warps share an SM and the kernel runs faster despite the stores it spills
# (docs/findings.md)
TABLE_MAXNREG = 80
TABLE_TRY_BLOCK, TABLE_CHUNK = 4, 64  # tables' model search: candidates costed at once, symbols per step
USE_STREAM_PREFETCH = True  # decoder lanes: prefetch each group's stream into L2 a few steps ahead
SYMBOL_LOOKUP = False  # decoder lanes, prob_bits <= 11: True looks the slot's symbol up in one byte, then the
# symbol's (cum, freq) entry (a quarter of the table bytes, a second dependent load); False reads one packed int32.
# The packed lookup decodes PoC 17's spilled KV faster (docs/findings.md); dev/symbol_lookup.py times both
USE_RECIPROCALS = True  # encoder lanes: floor(x / f) by a multiply-high with the table's reciprocal (prob_bits <= 14),
# not a 32-bit division (about 16 instructions, three of them quarter-rate, on the state's dependency chain)
COPY_OUT_WORDS, COPY_OUT_META = 2048, 1024  # PendingEncode.copy_out: int64 words a program of copy_out_kernel copies; meta words a step
QUEUED_META = ("spans", "flags", "summary")  # a queued call's int64 device state copy_out copies, in this order
COMPONENT_TILE = 16  # decoder, lanes by component: components (one warp each) a program, stored as runs of rows
                    # (0: one lane group a program, each step's values stored lane by lane)
ESCAPES_PER_GROUP = 1024  # first try's escape buffer per lane group (more: coded again with room for all)


def encode_cuda(t, prob_bits: int | None = None, group_lanes: int = DEFAULT_GROUP_LANES,
                lane_tokens: int | None = None, stats=None, guard=None, lanes_by_component: bool = False):
    """encode() on the GPU: int32 (or int16) CUDA tensor [T, K] -> uint8 CUDA tensor holding the
    same bytes.

    stats: optional (min, max, sum) per component, int tensors [K] on t's device, when the
    producer already has them (rdquant's fused projection does); saves a pass over t. For int16
    symbols stored from int32 values, stats are those values' and a component beyond int16 sets
    the overflow flag 3 (PendingEncode).
    guard: optional float tensor [1] that must be below 2^31 (the fused quantizer's largest
    |value|), checked in the same host synchronization as everything else.

    Kernels: histogram of sampled tokens, tables, lanes, then the layout, meta, streams and
    checksum, all sized on the device; the one host synchronization reads the payload's length.
    lanes_by_component: as rans.encode's (the same bytes as it writes)."""
    return encode_many_cuda([t], prob_bits, group_lanes, lane_tokens, [stats], [guard],
                            lanes_by_component=lanes_by_component)[0]


def encode_many_cuda(ts, prob_bits: int | None = None, group_lanes: int = DEFAULT_GROUP_LANES,
                     lane_tokens: int | None = None, stats=None, guards=None, fronts=None, backs=None,
                     length_field: bool = False, sync: bool = True, retry: bool | None = None,
                     lanes_by_component: bool = False):
    """encode_cuda() of each tensor of a list: tensors of one shape share every kernel launch (a
    segment axis in each grid), every container lands in one buffer, and one host synchronization
    serves the whole list. lane_tokens: one value, or one per tensor. stats, guards: lists of
    encode_cuda's arguments, one per tensor, or None.

    fronts: bytes to write before each payload (a container's header; each a multiple of 16
    long), with the payload's length as a little-endian u64 in their last 8 bytes when
    length_field; backs: zero bytes after each payload (at most 16). A tensor's blob is its front,
    payload and back. Returns uint8 CUDA tensors, views into one compact buffer; with sync=False,
    a PendingEncode instead, before any host synchronization (see there). retry (default: sync):
    size the escape buffers for the usual case and code a lane group again in result() when it
    escaped more values than that (else sized for every value escaping, never coded again).
    lanes_by_component: rans.encode's lane order, one value or one per tensor."""
    torch = _torch()
    n_t = len(ts)
    stats, guards = stats or [None] * n_t, guards or [None] * n_t
    fronts = [bytes(f) for f in fronts] if fronts is not None else [b""] * n_t
    backs = list(backs) if backs is not None else [0] * n_t
    if any(len(f) % 16 for f in fronts) or (length_field and any(len(f) < 8 for f in fronts)):
        raise ValueError(f"fronts must be multiples of 16 bytes long (at least 16 with length_field), got "
                         f"{sorted({len(f) for f in fronts})}")
    if any(not 0 <= b <= 16 for b in backs):
        raise ValueError(f"backs are 0..16 zero bytes, got {backs}")
    ts = [_as_symbols(torch, t) for t in ts]
    lanes = lane_tokens if isinstance(lane_tokens, (list, tuple)) else [lane_tokens] * n_t
    orders = lanes_by_component if isinstance(lanes_by_component, (list, tuple)) else [lanes_by_component] * n_t
    groups = {}
    for i, t in enumerate(ts):
        groups.setdefault((tuple(t.shape), t.dtype, str(t.device), lanes[i], bool(orders[i])), []).append(i)
    jobs = [_EncodeBatch([ts[i] for i in members], prob_bits, group_lanes, key[3], [stats[i] for i in members],
                         [guards[i] for i in members], [fronts[i] for i in members], [backs[i] for i in members],
                         length_field, key[4]) for key, members in groups.items()]
    pending = PendingEncode(torch, jobs, list(groups.values()), n_t, retry=sync if retry is None else retry)
    return pending.result() if sync else pending


class PendingEncode:
    """An encode whose kernels are queued but whose host synchronization has not happened.

    buffer: one uint8 CUDA tensor holding every container at its final place; spans: int64 CUDA
    [N, 2], each container's (start, length) in it; flags: int64 CUDA [N], nonzero where a tensor
    could not be coded (1: NaN/Inf or coefficients beyond int32; 2: the lanes kernel's warp vote
    met a lane off its warp lane, see LANE_MAP_FAULT; 3: int16 symbols made from values beyond
    int16, coded again by result() through recode). All three are valid once the queued
    work has run, so a caller can send buffer and spans (torch.distributed, a copy to the host)
    without waiting. Without a retry (sync=False) the escape buffers are sized for the worst case.
    result() synchronizes once and returns the blobs as views into a compact copy, raising
    InvalidTensorError where a tensor could not be coded (RuntimeError for flag 2).
    recode: set by a producer that stored int16 symbols, a function (copy, indices) -> blobs that
    codes the list again with int32 symbols for the tensors at those indices of the caller's list
    (result() calls it on flag 3; without it, flag 3 raises)."""

    def __init__(self, torch, jobs, members, n_t, retry: bool):
        self.torch, self.jobs, self.members, self.n_t, self.retry = torch, jobs, members, n_t, retry
        self.retried, self.recode = False, None
        dev = jobs[0].dev
        # the stream the work is queued on, which result() waits for (None: the caller's current one)
        self.stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        self._host, self._queued = None, False
        self._caller = np.concatenate([np.asarray(m, np.int64) for m in members])
        self._in_order = bool((self._caller == np.arange(n_t)).all())
        self.spans = torch.empty((n_t, 2), dtype=torch.int64, device=dev)
        self.flags = torch.empty(n_t, dtype=torch.int64, device=dev)
        for job in jobs:
            job.code_lanes(min(job.cap, ESCAPES_PER_GROUP) if retry else job.cap)
        self._assemble()

    def _assemble(self):
        """Every container into one buffer sized for the jobs' worst cases, then the spans and
        flags in the callers' order."""
        torch = self.torch
        self.offsets, total = [], 0
        for job in self.jobs:
            self.offsets.append(total)
            total += job.capacity()
        self.buffer = torch.empty(total, dtype=torch.uint8, device=self.jobs[0].dev)
        col = self.jobs[0].kern["fields"].index("overflow")
        for job, off, members in zip(self.jobs, self.offsets, self.members):
            job.assemble(self.buffer, off)
            if len(self.jobs) == 1:
                self.spans.copy_(job.span)
                self.flags.copy_(job.scal[:, col])
            else:
                idx = _index_on(torch, self.buffer.device, members)
                self.spans[idx] = job.span
                self.flags[idx] = job.scal[:, col]
        # each tensor's summary and span, in the jobs' order: what result() reads in its one copy
        self.summary = torch.cat([torch.cat([job.scal, job.span], 1) for job in self.jobs])
        # what result() needs besides that table, made here once rather than after every synchronization
        fields = self.jobs[0].kern["fields"]
        self._overflow, self._esc_max = fields.index("overflow"), fields.index("group_escapes_max")
        self._bounds = np.cumsum([0] + [job.N for job in self.jobs])
        self._ecap_rows = np.repeat([job.ecap for job in self.jobs], [job.N for job in self.jobs])
        # result()'s test of the summary in one comparison: any overflow flag > 0, or escapes > the room
        self._flagged_cols = [self._overflow, self._esc_max]
        self._flagged_at = np.stack([np.zeros(len(self._ecap_rows), np.int64), self._ecap_rows], 1)
        self._queued, self._ready = False, None

    def copy_out(self, slots, meta: bool):
        """Queue the copy of this encode's outputs to where slots (int64 CUDA [3]) point when it runs
        (copy_out_kernel): the containers, up to the last one's end as the device knows it, to
        address slots[0] if they fit its room of slots[1] words; with meta, the spans, flags and
        summary (meta_words() int64, in that order) to address slots[2] (0: none). Made for a CUDA
        graph, whose slots are rewritten before each replay: every call's outputs land in buffers
        of its own without a launch of its own (copied(), and result(out=...))."""
        torch = self.torch
        words = torch.cat([getattr(self, name).view(-1) for name in QUEUED_META]) if meta else self.flags[:0]
        grid = (triton_cdiv(self.buffer.numel() // 8, COPY_OUT_WORDS),)  # the buffer's size is a multiple of 16
        _kernels()["copy_out"][grid](self.buffer.view(torch.int64), slots, self.spans, self.n_t, words, words.numel(),
                                     BLOCK=COPY_OUT_WORDS, BLOCK_N=_pow2(self.n_t), BLOCK_M=COPY_OUT_META)

    def meta_words(self) -> int:
        return sum(getattr(self, name).numel() for name in QUEUED_META)

    def copied(self, buffer, meta):
        """A PendingEncode over what copy_out() wrote: buffer (uint8 CUDA, this one's size: room for
        every container) and meta (int64 CUDA [meta_words()]) hold their own copy of the containers,
        spans, flags and summary, so that the call that made this one's buffers (a CUDA graph) can
        run again before this one's result() is read."""
        out = copy.copy(self)
        out.buffer = buffer
        at = 0
        for name in QUEUED_META:
            part = getattr(self, name)
            setattr(out, name, meta[at:at + part.numel()].view(part.shape))
            at += part.numel()
        out._host, out._queued, out._ready = None, False, None
        return out

    def queue_summary_read(self, event: bool = False):
        """Queue the summary's copy into pinned memory now, behind the work queued so far (in a CUDA
        graph: as part of every replay), so that result() only waits for the stream: the copy and
        the current-stream lookup after a replay cost ~20 us of host time on an NVIDIA H200.
        event (not inside a graph capture): also record an event after the copy, which result()
        waits for instead of the whole stream, so that a queued call's result does not wait for
        the calls queued after it, nor copy its summary behind theirs."""
        torch = self.torch
        if self.summary.device.type != "cuda":  # Triton's CPU interpreter (tests)
            return
        self._host = torch.empty(self.summary.shape, dtype=self.summary.dtype, pin_memory=True)
        self._host.copy_(self.summary, non_blocking=True)
        self._rows, self._queued = self._host.numpy(), True
        self._ready = None
        if event:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def _table(self):
        """Each tensor's summary and span, in the jobs' order, as int64 numpy [N, fields + 2] (a view
        of pinned memory, valid until the next call reads it back)."""
        if self._queued:
            if self._ready is not None:
                self._ready.synchronize()
            else:
                self.stream.synchronize()
            return self._rows
        self._host = read_on_host(self.summary, self._host, self.stream)
        return self._host.numpy()

    def result(self, copy: bool = True, out=None):
        """The blobs (one host synchronization; a second only when a lane group escaped more
        values than its first buffer held). copy: a Containers over a compact copy of the buffer
        (each container, and the copy's end, 16-byte aligned, so a decoder reads them in place),
        else a list of views into the buffer itself (which holds every container's worst-case room).
        out: (uint8 CUDA tensor, its room in bytes, a multiple of 16) where a CUDA graph's copy_out
        put the containers; for one shape, where they fit that room, the compact copy is that one, with no launch after the
        synchronization (a clone cost ~90 us of host time at 64 MB on an NVIDIA H200). The host work
        after the synchronization is on every call's critical path (the GPU idles through it), so
        the common case is a few numpy operations on the summary table: Python loops over 60
        tensors' rows cost ~70 us, and a dozen numpy calls ~150 us, on an NVIDIA H100's host."""
        rows = self._table()  # the host synchronization
        if (rows[:, self._flagged_cols] > self._flagged_at).any():
            return self._refused_or_retried(rows, copy)
        starts, lengths = rows[:, -2], rows[:, -1]
        if not copy:
            out = [None] * self.n_t
            for i, a, n in zip(self._caller.tolist(), starts.tolist(), lengths.tolist()):
                out[i] = self.buffer[a:a + n]
            return out
        if len(self.jobs) == 1:  # one shape: one slice of the buffer, its containers already in place
            off = self.offsets[0]
            end = int((starts + lengths).max())
            used = (end - off + 15) // 16 * 16  # within the job's capacity
            if out is not None and off == 0 and (end + 7) // 8 <= out[1] // 8:
                buf = out[0].narrow(0, 0, used)  # copied there on the device (copy_out)
            else:
                buf = self.buffer.narrow(0, off, used).clone()
            moved = starts - off
            if self._in_order:
                return Containers(buf, moved, moved + lengths)
        else:
            bounds, parts, shift, new = self._bounds, [], [], 0
            for j, off in enumerate(self.offsets):
                end = int((starts[bounds[j]:bounds[j + 1]] + lengths[bounds[j]:bounds[j + 1]]).max())
                parts.append(self.buffer[off:off + (end - off + 15) // 16 * 16])
                shift.append(new - off)
                new += (end - off + 15) // 16 * 16
            buf = self.torch.cat(parts)
            moved = starts + np.repeat(shift, np.diff(bounds))
        starts, ends = np.empty(self.n_t, np.int64), np.empty(self.n_t, np.int64)
        starts[self._caller], ends[self._caller] = moved, moved + lengths
        return Containers(buf, starts, ends)

    def _refused_or_retried(self, rows, copy: bool):
        """result() where a summary row is flagged or a lane group outgrew its escape buffer: the
        error it names, or the list coded again (int32 symbols, or more escape room)."""
        overflow, bounds = rows[:, self._overflow], self._bounds
        narrow_overflow = overflow == NARROW_OVERFLOW_ENCODE
        if narrow_overflow.any():
            if self.recode is None:
                raise InvalidTensorError("int16 symbols were stored from values beyond int16; give int32 symbols")
            self.retried = True  # rare: a producer's values outgrew int16 (it keeps int32 for them from now on)
            return self.recode(copy, self._caller[narrow_overflow].tolist())
        if (overflow == 2).any():
            raise RuntimeError(LANE_MAP_FAULT)
        if overflow.any():
            raise InvalidTensorError("quantized coefficients reach beyond int32 (or the tensor holds NaN/Inf); "
                                     "use a larger step or fix the producer")
        if not self.retry:
            raise RuntimeError("a lane group escaped more values than its buffer holds with retry off")
        for j, job in enumerate(self.jobs):  # rare: code those lanes again with room for every value
            if rows[bounds[j]:bounds[j + 1], self._esc_max].max() > job.ecap:
                job.code_lanes(job.cap)
        self._assemble()
        self.retried = True
        return self.result(copy)


class Containers(LazyViews):
    """The containers of one encode: a sequence of 1-D uint8 CUDA tensors, each a view into one
    compact buffer, made when first indexed (base.LazyViews). A transport sends `buffer` whole (with
    `spans`), and decode_many reads the containers from it without a view apiece: making 60 of them
    on every call cost more than coding a small tensor.

    buffer: uint8 CUDA tensor; starts, ends: int64 numpy [N], container i is buffer[starts[i]:ends[i]]."""

    __slots__ = ("buffer", "starts", "ends")

    def __init__(self, buffer, starts, ends):
        super().__init__(len(starts))
        self.buffer, self.starts, self.ends = buffer, starts, ends

    def _view(self, i: int):
        return self.buffer[int(self.starts[i]):int(self.ends[i])]

    @property
    def lengths(self):
        return self.ends - self.starts

    @property
    def spans(self):
        """int64 numpy [N, 2]: each container's (start, length) in buffer."""
        return np.stack([self.starts, self.lengths], 1)

    def __repr__(self) -> str:
        return f"Containers({len(self)} in {self.buffer.numel()} bytes on {self.buffer.device})"


def _stacked(torch, ts):
    """torch.stack(ts), or without a copy the tensor ts were cut from when they are its
    consecutive slices (what a batched producer such as the fused quantizer hands over)."""
    t0 = ts[0]
    if len(ts) == 1:
        return t0.unsqueeze(0)
    step = t0.numel() * t0.element_size()
    start = t0.data_ptr()
    if t0.is_contiguous() and [t.data_ptr() for t in ts] == list(range(start, start + len(ts) * step, step)) \
            and all(t.shape == t0.shape and t.dtype == t0.dtype and t.is_contiguous() for t in ts) \
            and all(t.untyped_storage().data_ptr() == ts[0].untyped_storage().data_ptr() for t in ts):
        return t0.as_strided((len(ts),) + tuple(t0.shape), (t0.numel(),) + tuple(t0.stride()), t0.storage_offset())
    return torch.stack(ts)


def _as_symbols(torch, t):
    if not isinstance(t, torch.Tensor):
        raise InvalidTensorError(f"encode_cuda takes a torch tensor, got {type(t).__name__}; use encode() for numpy")
    _check_device(t, "encode_cuda")
    if t.dim() != 2:
        raise InvalidTensorError(f"symbols must be 2-D [T tokens, K components], got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise InvalidTensorError(f"symbols is empty (shape {tuple(t.shape)}); there is nothing to code")
    if t.dtype not in (torch.int32, torch.int16):
        if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
            raise InvalidTensorError(f"symbols must be integers, got {t.dtype}; quantize first (shared.rdquant)")
        if t.dtype == torch.int64 and (int(t.min()) < -(2**31) or int(t.max()) > 2**31 - 1):
            raise InvalidTensorError("symbols overflow int32; use a larger quantization step")
        t = t.to(torch.int32)
    return t.contiguous()


class _EncodeBatch:
    """The encode of N tensors of one shape [T, K]: every kernel's grid has a segment axis of N.
    The lanes run before the host learns the payloads' sizes; then the payloads are assembled."""

    def __init__(self, ts, prob_bits, group_lanes, lane_tokens, stats, guards, fronts, backs, length_field,
                 lanes_by_component=False):
        torch = _torch()
        N = len(ts)
        T, K = ts[0].shape
        prob_bits = default_prob_bits(T) if prob_bits is None else prob_bits
        S = _check_settings(prob_bits, group_lanes, lane_tokens or default_lane_tokens(T, K), T)
        n, G, HCAP = prob_bits, group_lanes, max_alphabet(prob_bits)
        kern = _kernels()
        dev = ts[0].device
        t = _stacked(torch, ts)
        if all(s is not None for s in stats):
            mn, mx, sm = (_stacked(torch, list(x)) for x in zip(*stats))
        else:
            mn, mx = torch.aminmax(t, dim=1)
            sm = t.sum(1, dtype=torch.int64)
        has_guard = all(g is not None for g in guards)
        guard = _stacked(torch, [g.view(()) for g in guards]) if has_guard else None

        # 1. histograms of the sampled tokens inside the first windows; 2. trimmed windows and tables
        wide_index = (T + 1) * K >= 2**31
        R = hist_row_stride(T)
        n_sampled = triton_cdiv(T, R)
        counts = torch.zeros((N, K, HCAP), dtype=torch.int32, device=dev)
        grid = (triton_cdiv(n_sampled, HIST_CHUNKS * HIST_TOKENS) * triton_cdiv(K, HIST_COMPONENTS), N)
        kern["hist"][grid](t, mn, mx, sm, counts, T, K, n_sampled, R, HS=HIST_TOKENS, CHUNKS=HIST_CHUNKS,
                           KB=HIST_COMPONENTS, HCAP=HCAP, WIDE_INDEX=wide_index, NARROW=t.dtype == torch.int16,
                           AHEAD=HIST_AHEAD, num_warps=HIST_WARPS)
        lo = torch.empty((N, K), dtype=torch.int64, device=dev)
        W, A = torch.empty_like(lo), torch.empty_like(lo)
        codes = torch.empty((N, K, HCAP), dtype=torch.uint8, device=dev)
        recip = USE_RECIPROCALS and n <= kern["recip_max_prob_bits"]
        tab = torch.empty((N, K, HCAP), dtype=torch.int64 if recip else torch.int32, device=dev)
        model, scale, mu16 = torch.empty_like(lo), torch.empty_like(lo), torch.empty_like(lo)
        scal = _summary_start(torch, dev).view(1, -1).repeat(N, 1)
        mt = _model_tables_on(torch, dev, n)
        kern["tables"][(K, N)](counts, mn, mx, sm, guard if has_guard else scal, lo, W, A, codes, tab,
                               model, scale, mu16, mt["shapes"], mt["inv_sigma"], mt["sigma16_sq"], mt["nlog"],
                               mt["recip"] if recip else mt["nlog"], scal,
                               T, R, n_sampled, HCAP=HCAP, PROB_BITS=n, ESC_COST=ESCAPE_COST,
                               ENTRY_COST=TABLE_ENTRY_COST, HAS_GUARD=has_guard, N_SHAPES=N_SHAPES,
                               SEARCH=MODEL_SEARCH, SHAPE_STEPS=SHAPE_STEPS, PARAM_BYTES=PARAM_BYTES,
                               MIN_SHARE=MODEL_MIN_SHARE, TRY_BLOCK=TABLE_TRY_BLOCK, CHUNK=TABLE_CHUNK,
                               NARROW=t.dtype == torch.int16, RECIP=recip,
                               # where its counts, then its bit costs, provably fit int32 (see tables_kernel)
                               COUNTS32=ESCAPE_COST * R * (n_sampled + HCAP) + TABLE_ENTRY_COST * HCAP < 2**31 - 1,
                               COSTS32=(ESCAPE_COST * R * (n_sampled + HCAP) + TABLE_ENTRY_COST * HCAP < 2**31 - 1
                                        and (n_sampled + HCAP + 1) * 65536 * n < 2**31),
                               **(dict(num_warps=TABLE_WARPS) if N * K <= MANY_COMPONENTS
                                  else dict(num_warps=1, maxnreg=TABLE_MAXNREG)))
        # 3. the lanes: words and escaped values into per-group buffers
        lay = Layout(T, K, S, G, 0, 0, 0, flags=LANES_BY_COMPONENT if lanes_by_component else 0)
        self.NL, self.NG, self.cap, self.flags, self.by_component = lay.n_lanes, lay.n_groups, G * S, lay.flags, \
            lay.by_component
        self.buf = torch.empty((N, self.NG * self.cap), dtype=torch.int16, device=dev)
        self.states = torch.empty((N, self.NL), dtype=torch.int32, device=dev)
        self.glen = torch.empty((N, self.NG), dtype=torch.int32, device=dev)
        self.gesc = torch.empty((N, self.NG), dtype=torch.int32, device=dev)
        self.torch, self.t, self.kern, self.dev, self.n, self.G, self.HCAP = torch, t, kern, dev, n, G, HCAP
        self.N, self.T, self.K, self.S, self.wide_index = N, T, K, S, wide_index
        self.lo, self.W, self.A, self.codes, self.tab = lo, W, A, codes, tab
        self.model, self.scale, self.mu16, self.scal = model, scale, mu16, scal
        self.P, self.length_field, self.recip = lay.P, length_field, recip
        self.front_src, self.front_off, self.front_len, self.back_len = _fronts_on(torch, dev, fronts, backs)
        self.room = max(len(f) for f in fronts) + max(backs) + 16
        self.ecap = None  # escape room per lane group, set by code_lanes

    def code_lanes(self, ecap):
        torch, kern = self.torch, self.kern
        if self.ecap is not None:  # coding again: the lanes add to these slots
            for f in ("stream_words", "n_escapes", "group_escapes_max"):
                self.scal[:, kern["fields"].index(f)] = 0
        self.ecap = ecap
        self.ebuf = torch.empty((self.N, self.NG * ecap), dtype=torch.int32, device=self.dev)
        kern["encode"][(triton_cdiv(self.NG, _groups_per_program()), self.N)](
            self.t, self.lo, self.W, self.A, self.tab, self.buf, self.states, self.glen, self.ebuf, self.gesc,
            self.scal, self.T, self.K, self.NL, self.NG, self.S, self.cap, ecap,
            HCAP=self.HCAP, PROB_BITS=self.n, G=self.G, GPP=_groups_per_program(), WIDE_INDEX=self.wide_index,
            VOTE=_vote(self.G), RECIP=self.recip, BY_COMPONENT=self.by_component, num_warps=_warps(self.G))
        self.gend, self.geend = torch.cumsum(torch.stack([self.glen, self.gesc]), 2, dtype=torch.int64)

    def capacity(self) -> int:
        """Bytes that hold these N containers whatever the lanes wrote: the widest header fields,
        every table explicit, every lane group's escape buffer full, one word per value."""
        K = self.K
        worst = Layout(self.T, K, self.S, self.G, K * self.HCAP, min(self.NG * self.ecap, self.T * K),
                       self.NG * self.cap, K, 4, 2, K)
        return self.N * ((self.room + worst.total + 15) // 16 * 16)

    def assemble(self, buffer, origin: int):
        """The containers, one after the other from byte `origin` of buffer (16-byte aligned): the
        layout of each payload from its summary on the device, then front, header, meta, escapes,
        states, streams, back and checksums, with no host synchronization. self.span: each
        container's (start, length) in buffer."""
        torch, kern, dev = self.torch, self.kern, self.dev
        T, K, S, G, n, N = self.T, self.K, self.S, self.G, self.n, self.N
        fields = kern["seg_fields"]
        segs = torch.empty((N, len(fields)), dtype=torch.int64, device=dev)
        self.span = torch.empty((N, 2), dtype=torch.int64, device=dev)
        kern["layout"][(1,)](self.scal, self.front_len, self.back_len, segs, self.span, origin, N, K, self.P, self.NG,
                             BLOCK_N=_pow2(N), SEG_FIELDS=len(fields), HEADER_BYTES=HEADER.size,
                             CHECK_AT=CHECKED_HEADER_BYTES)
        b8, b16, b32 = buffer.view(torch.int8), buffer.view(torch.int16), buffer.view(torch.int32)
        kern["fronts"][(N,)](self.front_src, self.front_off, self.front_len, self.back_len, segs, self.span, b8, b32,
                             T, K, S, MAGIC_WORD=MAGIC_WORD, VERSION=VERSION, PROB_BITS=n, G=G,
                             LENGTH_FIELD=self.length_field, HEADER_BYTES=HEADER.size, BLOCK=256,
                             SEG_FIELDS=len(fields), FLAGS=self.flags)
        kern["pack_meta"][(K, N)](self.lo, self.W, self.A, self.codes, self.states, self.model, self.scale, self.mu16,
                                  b8, b16, b32, segs, K, self.P, HCAP=self.HCAP, BLOCK_K=min(_pow2(K), META_BLOCK), BLOCK_P=256,
                                  SEG_FIELDS=len(fields), BY_COMPONENT=self.by_component,
                                  num_warps=4 if N * K <= MANY_COMPONENTS else 1)
        kern["gather"][(self.NG, N)](self.buf, self.glen, self.gend, self.cap, self.ebuf, self.gesc, self.geend,
                                     self.ecap, b16, b32, segs, self.NG, BLOCK=1024, SEG_FIELDS=len(fields))
        sums = torch.zeros((N, 2), dtype=torch.int64, device=dev)
        _checksum_torch(torch, buffer, segs, sums, self.capacity() // N)
        kern["finish"][(N,)](sums, b32, segs, SEG_FIELDS=len(fields))


MAGIC_WORD = int.from_bytes(MAGIC, "little")
_FRONTS_ON, _INDEX_ON = {}, {}


_HOLDS = None  # a list while a CUDA graph is captured: what cached_on_device handed out, for it to keep


def cached_on_device(cache: dict, key, make, limit: int = 64):
    """make() once per key (tensors on a device, so they cross to it once), keeping the newest
    `limit` entries of cache; a graph being captured keeps what it was handed (held_by_capture)."""
    if key not in cache:
        if len(cache) >= limit:
            cache.pop(next(iter(cache)))
        cache[key] = make()
    return held_by_capture(cache[key])


def held_by_capture(value):
    """value, kept alive by the CUDA graph being captured (if one is, under holding_cached()): for
    device tensors from a cache that may drop them while the graph still reads them."""
    if _HOLDS is not None:
        _HOLDS.append(value)
    return value


def holding_cached(graph, capture):
    """Runs capture() (a CUDA-graph capture) and stores on graph.held_cached every cached device
    tensor it was handed (held_by_capture)."""
    global _HOLDS
    _HOLDS = []
    try:
        return capture()
    finally:
        graph.held_cached, _HOLDS = _HOLDS, None


def _fronts_on(torch, dev, fronts, backs):
    """The fronts (concatenated), their offsets and lengths, and the back lengths, on the device;
    cached, since a codec writes the same front before every tensor of one shape."""
    def make():
        off = np.cumsum([0] + [len(f) for f in fronts[:-1]])
        return (torch.frombuffer(bytearray(b"".join(fronts) or b"\0"), dtype=torch.uint8).to(dev),
                torch.as_tensor(off, dtype=torch.int64).to(dev),
                torch.as_tensor([len(f) for f in fronts], dtype=torch.int64).to(dev),
                torch.as_tensor(backs, dtype=torch.int64).to(dev))

    return cached_on_device(_FRONTS_ON, (str(dev), tuple(fronts), tuple(backs)), make)


def _index_on(torch, dev, members):
    return cached_on_device(_INDEX_ON, (str(dev), tuple(members)),
                            lambda: torch.as_tensor(members, dtype=torch.int64).to(dev))


_MODEL_TABLES_ON = {}


def recip_multipliers(prob_bits: int) -> np.ndarray:
    """The high words of the encoder's division-free table entries (_rans_triton.recip_entry):
    ceil(2^(32+l) / f) - 2^32 with l = ceil(log2 f), for f = 0..2^n (0 for f = 0); exact integers."""
    f = np.arange(1 << prob_bits | 1, dtype=np.int64)
    fs = np.maximum(f, 1)
    l = _bitlen(fs - 1)  # ceil(log2 f)
    return np.where(f > 0, ((np.int64(1) << (32 + l)) + fs - 1) // fs - (1 << 32), 0)


def _model_tables_on(torch, dev, prob_bits: int) -> dict:
    """The parametric model's integer tables (and -log2 f for the encoder's costs, and its
    reciprocals' multipliers where prob_bits allows them) on a device, cached."""
    key = (str(dev), prob_bits)
    if key not in _MODEL_TABLES_ON:
        t = dict(model_tables(), nlog=_neg_log2_table(prob_bits))
        if prob_bits <= _kernels()["recip_max_prob_bits"]:
            t["recip"] = recip_multipliers(prob_bits)
        _MODEL_TABLES_ON[key] = {name: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for name, v in t.items()}
    return _MODEL_TABLES_ON[key]


class _TorchInt(dict):
    def __missing__(self, nbytes):
        import torch

        return {1: torch.int8, 2: torch.int16, 4: torch.int32}[nbytes]


_TORCH_INT = _TorchInt()


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _groups_per_program() -> int:
    return INTERPRETER_GROUPS_PER_PROGRAM if interpreting() else GROUPS_PER_PROGRAM


def _warps(G: int, groups_per_program: int | None = None) -> int:
    return max(1, min(16, (groups_per_program or _groups_per_program()) * G // 32))


def _ptx() -> bool:
    """Whether kernels may use inline PTX: an NVIDIA build of torch, not Triton's interpreter."""
    return not interpreting() and not getattr(_torch().version, "hip", None)


def _vote(G: int) -> bool:
    """Whether the lanes kernels count ranks by warp vote (inline PTX): one group of 32 lanes per
    warp, on an NVIDIA GPU (not under the interpreter, not on ROCm, whose warps are 64 wide)."""
    return USE_WARP_VOTE and G == 32 and _groups_per_program() == 1 and not interpreting() \
        and not getattr(_torch().version, "hip", None)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _checksum_torch(torch, buf, segs, sums, max_len: int):
    """Adds the sums of checksum() of every payload in buf (segs: the segment table on the device,
    base and length of each) but its check fields (before the mod 2^32) to sums, int64 [N, 2] zeros."""
    kern = _kernels()
    iters = CHECKSUM_LONG_ITERS if max_len >= CHECKSUM_LONG_BYTES else CHECKSUM_ITERS
    kern["checksum"][(triton_cdiv(max_len, CHECKSUM_BLOCK * iters), segs.shape[0])](
        buf, segs, sums, SKIP_LO=CHECKED_HEADER_BYTES, SKIP_HI=HEADER.size, BLOCK=CHECKSUM_BLOCK,
        ITERS=iters, SEG_FIELDS=segs.shape[1])


def _segment_row(fields, lay: Layout, base: int) -> list[int]:
    """A payload's row of the kernels' segment table (_rans_triton.SEG_FIELDS): where its sections
    start in a batch buffer when the payload starts at byte `base` (16-byte aligned), as element
    offsets for the sections read through typed views, and the header counts the kernels check."""
    row = dict(base=base, len=lay.total, lo_el=(base + lay.lo) // lay.lo_bytes,
               wflag_el=(base + lay.wflag) // lay.w_bytes, model=base + lay.model, mu16_el=(base + lay.mu16) // 2,
               scale=base + lay.scale, codes=base + lay.codes, check_el=(base + CHECKED_HEADER_BYTES) // 4,
               gw_el=(base + lay.group_words) // 4, ge_el=(base + lay.group_escapes) // 4,
               esc_el=(base + lay.escapes) // 4, states_el=(base + lay.states) // 4,
               streams_el=(base + lay.streams) // 2, n_table=lay.n_table, k_coded=lay.k_coded, n_param=lay.n_param,
               n_words=lay.stream_words, n_esc=lay.n_escapes, lo_bytes=lay.lo_bytes, w_bytes=lay.w_bytes)
    return [row[f] for f in fields]


def _device_table(torch, rows, dev):
    """An int64 table [N, F] on the device, copied asynchronously from pinned host memory."""
    host = np.ascontiguousarray(rows, dtype=np.int64)
    return pinned(host.tobytes()).view(torch.int64).reshape(host.shape).to(dev, non_blocking=True)


def segment_table(hdrs, bases, device):
    """The kernels' segment table for payloads of one shape (hdrs: their parsed headers, checked on
    the host) that start at byte offsets `bases` (16-byte aligned) of one buffer, on the device: made
    once, outside a CUDA-graph capture, for decode_placed()."""
    if any(b % 16 for b in bases):
        raise ValueError("payloads must start 16-byte aligned in their buffer")
    fields = _kernels()["seg_fields"]
    return _device_table(_torch(), [_segment_row(fields, h.layout, b) for h, b in zip(hdrs, bases)], device)


def decode_placed(buf, segs, hdrs, err, scaled, out):
    """The scaled decoder over payloads of one shape already in `buf` where `segs` (segment_table)
    places them: bf16 coefficient rows into `out` ([N, T, width], its columns past K set by the caller),
    each payload's error flag into err[i] (zeroed by the caller). No host read, no allocation the caller
    keeps: the body of a CUDA graph (pipeline.StagedDecode) once the kernels are compiled."""
    h0 = hdrs[0]
    _decode_kernels(buf, segs, err, h0, max(h.layout.total for h in hdrs), scaled=scaled, out=out)


def decode_cuda(payload, head: bytes | None = None, check: bool = True):
    """decode() on the GPU: uint8 CUDA tensor (a payload from encode or encode_cuda) -> int32 CUDA [T, K].

    The header is read on the host (it sizes every allocation): pass its first HEADER.size bytes
    as `head` when the host already has them, which saves a device->host read. Checksum, tables,
    lookup and lanes run as kernels whose errors meet in one flag; check=True reads it (the one
    host synchronization) and raises BitstreamError, check=False returns (symbols, flag) for the
    caller to read later (nonzero: corrupt)."""
    outs, errs = decode_many_cuda([payload], None if head is None else [head], check=check)
    return outs[0] if check else (outs[0], errs[0:1])


def decode_many_cuda(payloads, heads=None, check: bool = True, max_elements=None, parsed=None, scales=None):
    """decode_cuda() of a list of payloads in one set of kernel launches, for payloads of one shape
    (T, K, lane tokens, group lanes, prob_bits: e.g. every layer's K of one step); payloads of
    other shapes go in their own launches. Returns (symbols list, error flags int32 [N]); with
    check=True the flags are read in one host synchronization and a corrupt payload raises
    BitstreamError naming its index. max_elements: the most values a payload may declare (one
    limit, or one per payload; default shared.schema.DEFAULT_MAX_ELEMENTS), checked before
    anything is allocated, as the CPU decoder checks it. parsed: rans.read_header() of each payload
    where the caller has already checked it with these limits (None entries are parsed here).
    scales: optional (step, bound, width, K) per payload (None entries decode to symbols): that
    payload, whose header must declare K components, decodes to bf16 coefficient rows [T, width]
    (see _decode_kernels' scaled) instead."""
    torch = _torch()
    limits = max_elements if isinstance(max_elements, (list, tuple)) else [max_elements] * len(payloads)
    for p in payloads:
        if not isinstance(p, torch.Tensor):
            raise InvalidTensorError(f"decode_cuda takes a torch uint8 tensor, got {type(p).__name__}; "
                                     "use decode() for bytes")
        _check_device(p, "decode_cuda")
        if p.dtype != torch.uint8 or p.dim() != 1:
            raise InvalidTensorError(f"payload must be a 1-D uint8 tensor, got {p.dtype} {tuple(p.shape)}")
    if heads is None:  # every payload's header in one device->host copy
        host = torch.cat([p[:HEADER.size] for p in payloads]).cpu().numpy().tobytes()
        heads = [host[i * HEADER.size:(i + 1) * HEADER.size] for i in range(len(payloads))]
    hdrs = []
    for p, h, limit, known in zip(payloads, heads, limits, parsed or [None] * len(payloads)):
        if known is None:
            known = Parsed.__new__(Parsed)
            _parse_header_only(known, bytes(h[:HEADER.size]), len(p), limit)
        hdrs.append(known)
    scales = scales or [None] * len(payloads)
    for i, (h, scale) in enumerate(zip(hdrs, scales)):
        if scale is not None and (h.K != scale[3] or scale[2] < h.K + 2):
            raise BitstreamError(f"payload {i} holds {h.K} components per token; its basis has {scale[3]}")
    groups = {}
    for i, h in enumerate(hdrs):
        width = None if scales[i] is None else scales[i][2]
        groups.setdefault((h.T, h.K, h.S, h.G, h.prob_bits, h.layout.flags, width), []).append(i)
    outs, errs = [None] * len(payloads), [None] * len(payloads)
    for key, members in groups.items():
        scaled = None
        if key[-1] is not None:
            dev = payloads[members[0]].device
            scaled = (floats_on([float(scales[i][0]) for i in members], dev),
                      floats_on([float(scales[i][1]) for i in members], dev), key[-1])
        o, e = _decode_same_shape([payloads[i] for i in members], [hdrs[i] for i in members], scaled)
        for j, i in enumerate(members):
            outs[i], errs[i] = o[j], e[j:j + 1]
    err = torch.cat(errs)
    if check:
        bad = read_on_host(err)  # the one host synchronization after the headers
        if bool(bad.any()):
            check_lane_map(bad)
            raise BitstreamError(CORRUPT + (f" (payload {int(bad.nonzero()[0])} of the list)" if len(bad) > 1 else ""))
    return outs, err


_FLOATS_ON = {}  # small float32 tensors by (values, device): steps and bounds repeat call after call


def floats_on(values: list, dev):
    """values as a float32 tensor on dev, made once: they cross to the GPU once, not in every call."""
    torch = _torch()
    return cached_on_device(_FLOATS_ON, (tuple(values), str(dev)),
                            lambda: torch.tensor(values, dtype=torch.float32).to(dev))


def _shared_view(torch, payloads):
    """(buffer, each payload's offset in it) when every payload is a contiguous uint8 view of one
    storage starting at a 16-byte aligned address, and that storage holds the span from the first to
    the last one rounded up to 16 bytes (the decoder reads 2-, 4- and 8-byte words); else (None, None).
    The decoder only reads the buffer, each payload within its own segment."""
    first = payloads[0]
    storage = first.untyped_storage()
    base = storage.data_ptr()
    if any(p.data_ptr() % 16 or not p.is_contiguous() or p.untyped_storage().data_ptr() != base for p in payloads):
        return None, None
    start = min(p.storage_offset() for p in payloads)
    end = max(p.storage_offset() + p.numel() for p in payloads)
    end = start + (end - start + 15) // 16 * 16
    if end > storage.nbytes():
        return None, None
    return first.as_strided((end - start,), (1,), start), [p.storage_offset() - start for p in payloads]


def _decode_same_shape(payloads, hdrs, scaled=None):
    torch = _torch()
    dev = payloads[0].device
    h0, N = hdrs[0], len(payloads)
    fields = _kernels()["seg_fields"]
    # one buffer holding every payload at a 16-byte aligned offset: a view of the memory they already
    # share where they can be read in place (one container, or a list from one encode_many or one
    # receive buffer), else a copy (at 64 MB on an NVIDIA H200 the copy took 48 us of GPU time)
    buf, bases = _shared_view(torch, payloads)
    if buf is None:
        bases, total = [], 0
        for p in payloads:
            bases.append(total)
            total += (len(p) + 15) // 16 * 16
        zeros = torch.zeros(16, dtype=torch.uint8, device=dev)
        buf = torch.cat([t for p in payloads for t in (p, zeros[:(-len(p)) % 16])])
    table = [_segment_row(fields, hdr.layout, base) for hdr, base in zip(hdrs, bases)]
    segs = _device_table(torch, table, dev)
    err = torch.zeros(N, dtype=torch.int32, device=dev)
    return _decode_kernels(buf, segs, err, h0, max(h.layout.total for h in hdrs), scaled=scaled)


def coefficient_rows(N: int, T: int, K: int, width: int, device):
    """A SCALED decode's output: bf16 [N, T, width], columns K and K + 1 set to 1 and the rest past K
    to 0 (the decoder writes the first K of each row), for rdquant's reconstruction GEMM."""
    torch = _torch()
    out = torch.empty((N, T, width), dtype=torch.bfloat16, device=device)
    pad = torch.zeros(width - K, dtype=torch.bfloat16)
    pad[:2] = 1
    if K % 4 == 0 and width % 4 == 0:  # the pad as whole 8-byte words: a quarter of the stores (256 MB: 72 -> ~20 us)
        out.view(torch.int64)[:, :, K // 4:] = pad.view(torch.int64).to(device)
    else:
        out[:, :, K:] = pad.to(device)
    return out


_UNSCALED = {}  # the float32 [N] zeros an unscaled decode passes for its step and bound


def _decode_kernels(buf, segs, err, h0, max_len: int, narrow: bool = False, scaled=None, out=None):
    """The decoder's kernels over N payloads of h0's shape in buf, as the segment table segs places
    them: checksum, tables and lookup, then the lanes. Returns (symbols [N] of int32 [T, K], err);
    narrow: int16 symbols, err bit 3 (8) set for a payload holding a value beyond int16.
    scaled: (steps, bounds, width), float32 CUDA [N] each and an int: the values as bf16(value * step)
    in rows of width (coefficient_rows; out, if given, is one already filled), and a value beyond its
    bound is corruption (see _rans_triton.decode_kernel); returns the [T, width] rows instead."""
    torch = _torch()
    dev, N = buf.device, segs.shape[0]
    n, G, S, K, T = h0.prob_bits, h0.G, h0.S, h0.K, h0.T
    M, HCAP = 1 << n, max_alphabet(n)
    NL, NG = h0.layout.n_lanes, h0.layout.n_groups
    kern = _kernels()
    fields = kern["seg_fields"]
    sums = torch.zeros((N, 2), dtype=torch.int64, device=dev)
    _checksum_torch(torch, buf, segs, sums, max_len)
    lo = torch.empty((N, K), dtype=torch.int64, device=dev)
    W, A, rank = torch.empty_like(lo), torch.empty_like(lo), torch.empty_like(lo)
    tab = torch.empty((N, K + 1, HCAP), dtype=torch.int32, device=dev)
    packed = n <= 11 and not SYMBOL_LOOKUP
    lut = torch.empty((N, (K + 1) * M), device=dev,
                      dtype=torch.int32 if packed else torch.uint8 if HCAP <= 256 else torch.int16)
    b8, b16, b32 = buf.view(torch.int8), buf.view(torch.int16), buf.view(torch.int32)
    mt = _model_tables_on(torch, dev, n)
    kern["decode_meta"][(K + 1, N)](
        b8, b16, b32, segs, sums, mt["shapes"], mt["inv_sigma"], lo, W, A, rank, tab, lut, err, K, HCAP=HCAP,
        PROB_BITS=n, BLOCK_K=min(_pow2(K), META_BLOCK), PACKED=packed, N_SHAPES=N_SHAPES, SHAPE_STEPS=SHAPE_STEPS,
        SEG_FIELDS=len(fields), num_warps=META_WARPS if N * (K + 1) <= MANY_COMPONENTS else 1)
    col = {f: i for i, f in enumerate(fields)}
    ar = torch.arange(NG, device=dev)
    glen = b32[segs[:, col["gw_el"]:col["gw_el"] + 1] + ar]  # [N, NG]
    gesc = b32[segs[:, col["ge_el"]:col["ge_el"] + 1] + ar]
    gend, geend = torch.cumsum(torch.stack([glen, gesc]), 2, dtype=torch.int64)
    if scaled is not None:
        steps, bounds, width = scaled
        if out is None:
            out = coefficient_rows(N, T, K, width, dev)
    else:
        steps = bounds = cached_on_device(_UNSCALED, (N, str(dev)),
                                          lambda: torch.zeros(N, dtype=torch.float32, device=dev))
        width = K
        out = torch.empty((N, T, K), dtype=torch.int16 if narrow else torch.int32, device=dev)
    # lanes by component in whole groups of 32 blocks: COMPONENT_TILE components' groups a program (see decode_kernel)
    tile = COMPONENT_TILE > 0 and h0.layout.by_component and whole_component_groups(T, K, S, G)
    gpp = COMPONENT_TILE if tile else _groups_per_program()
    grid = (h0.layout.P // 32 * triton_cdiv(K, gpp) if tile else triton_cdiv(NG, gpp), N)
    kern["decode"][grid](
        b16, b32, segs, gend, glen.contiguous(), lo, W, A, rank, lut, tab, out, gesc.contiguous(), geend, err,
        steps, bounds, T, K, NL, NG, S, width, HCAP=HCAP, PROB_BITS=n, G=G, GPP=gpp,
        WIDE_INDEX=(T + 1) * max(K, width) >= 2**31, PACKED=packed, num_warps=_warps(G, gpp),
        SEG_FIELDS=len(fields),
        VOTE=_vote(G), NARROW=narrow, SCALED=scaled is not None, PREFETCH=USE_STREAM_PREFETCH and _ptx(),
        BY_COMPONENT=h0.layout.by_component, TILE=tile)
    return list(out.unbind(0)), err


STAGE_BLOCK, STAGE_ITERS = 4096, 16  # staging copy: bytes per step, steps per program
TRAILER_BYTES = 4  # after a payload in its container: the chunk's CRC field, 0 for a self-checked chunk


def _empty_container_bytes(fronts, hdr) -> int:
    """The longest front, then an empty payload of hdr's shape (what a container failing the
    device-side check is decoded as), then its trailer."""
    return max(len(f) for f in fronts) + Layout(hdr.T, hdr.K, hdr.S, hdr.G, 0, 0, 0, 0, 4, 2, 0).total + TRAILER_BYTES


def slot_bytes(fronts, hdr, longest: int) -> int:
    """A SlotDecoder slot size: room for containers up to twice the longest one seen (their payload
    sizes vary call to call), and always for an empty payload of this shape."""
    return (max(2 * longest, _empty_container_bytes(fronts, hdr) + 64) + 15) // 16 * 16


class SlotDecoder:
    """Decodes N payloads of one shape in containers the host has parsed and checked once, with no
    host work per call: each call's containers are copied into fixed slots of one buffer (one
    launch), a kernel holds each against the checked one (the same bytes before the payload but
    its length, the same fixed payload header fields) and checks the rest of its header as the
    host parser does, writing the segment table on the device; then the decoder's kernels run. Made
    for CUDA-graph capture: launch() allocates nothing the next call needs to see.

        dec = SlotDecoder(fronts, heads, hdr, cap, device)  # fronts[i]: container bytes before payload i
        dec.set_sources(blobs)                               # host: addresses and lengths, one copy (if moved)
        symbols, err = dec.launch()                          # err[i] != 0: payload i differs or is corrupt

    A container that fails the check (err 2) is decoded as an empty payload of this shape inside its
    slot, so a hostile one never steers a read; the caller decodes such a list again on the host path.
    narrow: int16 symbols (err 8 where a payload holds a value beyond int16: decode it as int32).
    scaled: (steps, bounds, width) as _decode_kernels takes it: bf16 coefficient rows, in one
    buffer filled once (launch() returns views of it)."""

    def __init__(self, fronts: list, heads: list, hdr, cap: int, device, narrow: bool = False, scaled=None):
        torch = _torch()
        self.N, self.hdr, self.cap, self.device = len(fronts), hdr, cap, torch.device(device)
        self.narrow, self.scaled = narrow, scaled
        self.rows = None if scaled is None else coefficient_rows(self.N, hdr.T, hdr.K, scaled[2], self.device)
        if cap % 16 or any(len(f) % 16 for f in fronts):
            raise ValueError("slots and payloads must start 16-byte aligned")
        if _empty_container_bytes(fronts, hdr) > cap:
            raise ValueError(f"slots of {cap} bytes cannot hold an empty payload of this shape")
        self.block = _pow2(max(len(f) for f in fronts) + 20)
        ref = np.zeros((self.N, self.block), np.uint8)
        for i, (f, h) in enumerate(zip(fronts, heads)):
            ref[i, :len(f) + 20] = np.frombuffer(bytes(f) + bytes(h[:20]), np.uint8)
        self.ref = torch.from_numpy(ref).to(self.device)
        self.ref_len = torch.tensor([len(f) for f in fronts], dtype=torch.int64, device=self.device)
        self.buf = torch.zeros(self.N * cap, dtype=torch.uint8, device=self.device)
        self.sources_host = torch.zeros((self.N, 2), dtype=torch.int64)
        if self.device.type == "cuda":
            self.sources_host = self.sources_host.pin_memory()
        self.sources = torch.zeros((self.N, 2), dtype=torch.int64, device=self.device)
        self.device_index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if self.device.type == "cuda" else -1
        self._last_sources = None
        self.segs = torch.zeros((self.N, len(_kernels()["seg_fields"])), dtype=torch.int64, device=self.device)
        self.err = torch.zeros(self.N, dtype=torch.int32, device=self.device)

    def placed(self, blobs):
        """(addresses, lengths) of this call's containers, or None where one is not a 1-D uint8
        tensor of at most cap bytes on this device. Runs before every graph replay, so each check
        is one C-level map over the list rather than Python code per container."""
        torch = _torch()
        if len(blobs) != self.N:
            return None
        if isinstance(blobs, Containers):  # one buffer: no map over views
            lens = blobs.lengths
            if blobs.buffer.get_device() != self.device_index or lens.max() > self.cap:
                return None
            return (blobs.starts + blobs.buffer.data_ptr()).tolist(), lens.tolist()
        try:
            if set(map(torch.Tensor.get_device, blobs)) != {self.device_index} \
                    or set(map(_DTYPE, blobs)) != {torch.uint8} or set(map(torch.Tensor.dim, blobs)) != {1}:
                return None
            lens = list(map(torch.Tensor.numel, blobs))
            if max(lens) > self.cap:
                return None
            return list(map(torch.Tensor.data_ptr, blobs)), lens
        except TypeError:  # not a tensor
            return None

    def fits(self, blobs) -> bool:
        return self.placed(blobs) is not None

    def set_sources(self, blobs, sources=None):
        """Where this call's containers are (sources: what placed(blobs) returned, every one
        checked); one small copy to the device, none when they are where the last call's were."""
        sources = sources or self.placed(blobs)
        if sources is None:
            raise ValueError("a container is not a 1-D uint8 tensor of at most this decoder's slot size on its device")
        if sources == self._last_sources:
            return
        host = self.sources_host.numpy()
        host[:, 0], host[:, 1] = sources
        self.sources.copy_(self.sources_host, non_blocking=True)
        self._last_sources = sources

    def launch(self):
        kern, lay = _kernels(), self.hdr.layout
        kern["stage"][(triton_cdiv(self.cap, STAGE_BLOCK * STAGE_ITERS), self.N)](
            self.sources, self.buf, self.buf.view(_torch().int64), self.cap, BLOCK=STAGE_BLOCK, ITERS=STAGE_ITERS)
        kern["check_fronts"][(self.N,)](
            self.buf, self.sources, self.ref, self.ref_len, self.segs, self.err, self.cap, self.hdr.T, self.hdr.K,
            lay.P, lay.n_groups, BLOCK=self.block, SEG_FIELDS=self.segs.shape[1], HEADER_BYTES=HEADER.size,
            CHECK_AT=CHECKED_HEADER_BYTES, FLAGS=lay.flags)
        return _decode_kernels(self.buf, self.segs, self.err, self.hdr, self.cap, self.narrow, self.scaled, self.rows)


CORRUPT = "rANS payload is corrupt (checksum, tables or lane states do not check out)"
LANE_MAP_FAULT = ("the GPU lanes kernels found a lane group not laid out one lane per warp lane, so their warp "
                  "vote cannot be trusted (a Triton version that lays tensors out differently); set "
                  "shared.codecs.rans_cuda.USE_WARP_VOTE = False")


NARROW_OVERFLOW = 8  # a decode's error bit: a payload decoded into int16 holds a value beyond it
NARROW_OVERFLOW_ENCODE = 3  # an encode's overflow flag: int16 symbols stored from values beyond int16


def check_lane_map(flags) -> None:
    """Raise RuntimeError(LANE_MAP_FAULT) where a decode's error flags (on the host) have bit 2 set: the
    warp vote met a lane off its warp lane, a fault of this code, not of the data. (The encoder reports
    the same fault as 2 in its overflow slot.)"""
    if bool((flags & 4).any()):
        raise RuntimeError(LANE_MAP_FAULT)



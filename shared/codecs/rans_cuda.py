"""The rANS coder of shared/codecs/rans.py on a GPU: the same bitstream, written and read by Triton kernels.

    from shared.codecs import rans_cuda
    p = rans_cuda.encode_cuda(t)        # torch int32 CUDA [T, K] -> torch uint8 CUDA (the bytes rans.encode writes)
    t = rans_cuda.decode_cuda(p)        # torch uint8 CUDA (any rans payload) -> torch int32 CUDA [T, K]

The format, the table rules and the numpy reference live in rans.py; this module holds only the
host code that sizes buffers and launches the kernels of _rans_triton.py.
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import BackendUnavailable, BitstreamError, InvalidTensorError
from .rans import (CHECKED_HEADER_BYTES, DEFAULT_GROUP_LANES, DEFAULT_PROB_BITS, ESCAPE_COST, HEADER, MAGIC,
                   MODEL_MIN_SHARE, MODEL_SEARCH, N_SHAPES, PARAM_BYTES, SHAPE_STEPS, TABLE_ENTRY_COST, VERSION,
                   Layout, Parsed, _check_settings, _neg_log2_table, _parse_header_only, _widths, default_lane_tokens,
                   hist_row_stride, max_alphabet, model_tables)

# --------------------------------------------------------------------------------------------
# Kernels are loaded on first use, so importing this module needs neither Triton nor a GPU. With TRITON_INTERPRET=1 they also run on CPU tensors
# (slowly), which is how the CPU machine tests them against the numpy coder.

_KERNELS = None


def _interpreting() -> bool:
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
                    finish=kt.finish_checksum_kernel, scatter=kt.scatter_kernel, decode_meta=kt.decode_meta_kernel, decode=kt.decode_kernel)
    return _KERNELS


def _torch():
    try:
        import torch
    except ImportError as e:
        raise BackendUnavailable(f"the GPU rANS coder needs torch ({e})") from None
    return torch


def _check_device(t, what: str):
    if t.device.type != "cuda" and not _interpreting():
        raise BackendUnavailable(
            f"{what} needs a CUDA tensor (got one on {t.device}); move it with .cuda(), or use the CPU coder "
            "(rans.encode/rans.decode), or set TRITON_INTERPRET=1 to run the kernels on the CPU for tests")


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


GROUPS_PER_PROGRAM = 4  # lane groups per Triton program: 4 x 32 lanes = 128 threads
HIST_TOKENS, HIST_BLOCK = 32, 128  # histogram: sampled tokens per thread, threads per program
CHECKSUM_BLOCK, CHECKSUM_ITERS = 4096, 15  # checksum: bytes per step, steps per program (product <= 65521)
TABLE_WARPS, META_WARPS = 8, 8  # warps per component of the encoder's and the decoder's table kernels
TABLE_TRY_BLOCK, TABLE_CHUNK = 4, 64  # tables' model search: candidates costed at once, symbols per step
ESCAPES_PER_GROUP = 1024  # first try's escape buffer per lane group (more: coded again with room for all)


def encode_cuda(t, prob_bits: int = DEFAULT_PROB_BITS, group_lanes: int = DEFAULT_GROUP_LANES,
                lane_tokens: int | None = None, stats=None, guard=None, reserve_front: int = 0,
                reserve_back: int = 0):
    """encode() on the GPU: int32 CUDA tensor [T, K] -> uint8 CUDA tensor holding the same bytes.

    stats: optional (min, max, sum) per component, int tensors [K] on t's device, when the
    producer already has them (rdquant's fused projection does); saves a pass over t.
    guard: optional float tensor [1] that must be below 2^31 (the fused quantizer's largest
    |value|), checked in the same host synchronization as everything else.
    reserve_front, reserve_back: bytes left (uninitialized) before and after the payload in the
    returned buffer, where a container writes its header and trailer without copying the payload;
    reserve_front is a multiple of 16. The payload is out[reserve_front:len(out) - reserve_back].

    Kernels: histogram of sampled tokens, tables, lanes, then (after the one host
    synchronization, which learns the payload's size) meta, streams and checksum."""
    return encode_many_cuda([t], prob_bits, group_lanes, lane_tokens, [stats], [guard], [reserve_front],
                            [reserve_back])[0]


def encode_many_cuda(ts, prob_bits: int = DEFAULT_PROB_BITS, group_lanes: int = DEFAULT_GROUP_LANES,
                     lane_tokens: int | None = None, stats=None, guards=None, reserve_fronts=None,
                     reserve_backs=None, make_front=None) -> list:
    """encode_cuda() of each tensor of a list: tensors of one shape share every kernel launch (a
    segment axis in each grid), and one host synchronization serves the whole list. lane_tokens:
    one value, or one per tensor. stats,
    guards, reserve_*: lists of encode_cuda's arguments, one per tensor, or None. make_front(i,
    payload_len) -> bytes: what to write into tensor i's reserved front once its payload's
    length is known (a container's header), else it is zeros. Returns uint8 CUDA tensors, views
    into one buffer per shape."""
    torch = _torch()
    n_t = len(ts)
    stats, guards = stats or [None] * n_t, guards or [None] * n_t
    fronts, backs = reserve_fronts or [0] * n_t, reserve_backs or [0] * n_t
    if any(f % 16 for f in fronts):
        raise ValueError(f"reserve_front must be a multiple of 16, got {fronts}")
    ts = [_as_symbols(torch, t) for t in ts]
    lanes = lane_tokens if isinstance(lane_tokens, (list, tuple)) else [lane_tokens] * n_t
    groups = {}
    for i, t in enumerate(ts):
        groups.setdefault((tuple(t.shape), str(t.device), lanes[i]), []).append(i)
    jobs = [_EncodeBatch([ts[i] for i in members], prob_bits, group_lanes, key[2], [stats[i] for i in members],
                         [guards[i] for i in members]) for key, members in groups.items()]
    for job in jobs:
        job.code_lanes(min(job.cap, ESCAPES_PER_GROUP))
    summaries = torch.cat([job.scal for job in jobs]).cpu().tolist()  # the host synchronization
    outs = [None] * n_t
    row = 0
    for job, members in zip(jobs, groups.values()):
        fields = job.kern["fields"]
        rows = [dict(zip(fields, r)) for r in summaries[row:row + len(members)]]
        row += len(members)
        if max(r["group_escapes_max"] for r in rows) > job.ecap:  # a group escaped more than its buffer holds
            job.scal[:, fields.index("stream_words")] = 0
            job.scal[:, fields.index("n_escapes")] = 0
            job.code_lanes(job.cap)
            rows = [dict(zip(fields, r)) for r in job.scal.cpu().tolist()]
        views = job.finish(rows, [fronts[i] for i in members], [backs[i] for i in members],
                           None if make_front is None else [lambda n, i=i: make_front(i, n) for i in members])
        for i, v in zip(members, views):
            outs[i] = v
    return outs


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
    if t.dtype != torch.int32:
        if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
            raise InvalidTensorError(f"symbols must be integers, got {t.dtype}; quantize first (shared.rdquant)")
        if t.dtype == torch.int64 and (int(t.min()) < -(2**31) or int(t.max()) > 2**31 - 1):
            raise InvalidTensorError("symbols overflow int32; use a larger quantization step")
        t = t.to(torch.int32)
    return t.contiguous()


class _EncodeBatch:
    """The encode of N tensors of one shape [T, K]: every kernel's grid has a segment axis of N.
    The lanes run before the host learns the payloads' sizes; then the payloads are assembled."""

    def __init__(self, ts, prob_bits, group_lanes, lane_tokens, stats, guards):
        torch = _torch()
        N = len(ts)
        T, K = ts[0].shape
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
        n_hist = triton_cdiv(n_sampled, HIST_TOKENS) * K
        kern["hist"][(triton_cdiv(n_hist, HIST_BLOCK), N)](
            t, mn, mx, sm, counts, T, K, n_hist, R, HS=HIST_TOKENS, HCAP=HCAP, BLOCK=HIST_BLOCK,
            WIDE_INDEX=wide_index, num_warps=HIST_BLOCK // 32)
        lo = torch.empty((N, K), dtype=torch.int64, device=dev)
        W, A = torch.empty_like(lo), torch.empty_like(lo)
        codes = torch.empty((N, K, HCAP), dtype=torch.uint8, device=dev)
        tab = torch.empty((N, K, HCAP), dtype=torch.int32, device=dev)
        model, scale, mu16 = torch.empty_like(lo), torch.empty_like(lo), torch.empty_like(lo)
        scal = _summary_start(torch, dev).view(1, -1).repeat(N, 1)
        mt = _model_tables_on(torch, dev, n)
        kern["tables"][(K, N)](counts, mn, mx, sm, guard if has_guard else scal, lo, W, A, codes, tab,
                               model, scale, mu16, mt["shapes"], mt["inv_sigma"], mt["sigma16_sq"], mt["nlog"], scal,
                               T, R, n_sampled, HCAP=HCAP, PROB_BITS=n, ESC_COST=ESCAPE_COST,
                               ENTRY_COST=TABLE_ENTRY_COST, HAS_GUARD=has_guard, N_SHAPES=N_SHAPES,
                               SEARCH=MODEL_SEARCH, SHAPE_STEPS=SHAPE_STEPS, PARAM_BYTES=PARAM_BYTES,
                               MIN_SHARE=MODEL_MIN_SHARE, TRY_BLOCK=TABLE_TRY_BLOCK, CHUNK=TABLE_CHUNK,
                               num_warps=TABLE_WARPS)
        # 3. the lanes: words and escaped values into per-group buffers
        lay = Layout(T, K, S, G, 0, 0, 0)
        self.NL, self.NG, self.cap = lay.n_lanes, lay.n_groups, G * S
        self.buf = torch.empty((N, self.NG * self.cap), dtype=torch.int16, device=dev)
        self.states = torch.empty((N, self.NL), dtype=torch.int32, device=dev)
        self.glen = torch.empty((N, self.NG), dtype=torch.int32, device=dev)
        self.gesc = torch.empty((N, self.NG), dtype=torch.int32, device=dev)
        self.torch, self.t, self.kern, self.dev, self.n, self.G, self.HCAP = torch, t, kern, dev, n, G, HCAP
        self.N, self.T, self.K, self.S, self.wide_index = N, T, K, S, wide_index
        self.lo, self.W, self.A, self.codes, self.tab = lo, W, A, codes, tab
        self.model, self.scale, self.mu16, self.scal = model, scale, mu16, scal

    def code_lanes(self, ecap):
        torch, kern = self.torch, self.kern
        self.ecap = ecap
        self.ebuf = torch.empty((self.N, self.NG * ecap), dtype=torch.int32, device=self.dev)
        kern["encode"][(triton_cdiv(self.NG, GROUPS_PER_PROGRAM), self.N)](
            self.t, self.lo, self.W, self.A, self.tab, self.buf, self.states, self.glen, self.ebuf, self.gesc,
            self.scal, self.T, self.K, self.NL, self.NG, self.S, self.cap, ecap,
            HCAP=self.HCAP, PROB_BITS=self.n, G=self.G, GPP=GROUPS_PER_PROGRAM, WIDE_INDEX=self.wide_index,
            num_warps=_warps(self.G))
        self.gend, self.geend = torch.cumsum(torch.stack([self.glen, self.gesc]), 2, dtype=torch.int64)

    def finish(self, summaries, fronts, backs, make_fronts):
        """The payloads, each in its container's place in one buffer: header, meta, escapes,
        states and streams, then the checksums."""
        torch, kern, dev = self.torch, self.kern, self.dev
        T, K, S, G, n, N = self.T, self.K, self.S, self.G, self.n, self.N
        fields = kern["seg_fields"]
        lays, starts, total = [], [], 0
        for r, front, back in zip(summaries, fronts, backs):
            if r["overflow"]:
                raise InvalidTensorError("quantized coefficients reach beyond int32 (or the tensor holds NaN/Inf); "
                                         "use a larger step or fix the producer")
            lo_bytes, w_bytes = _widths(r["lo_min"], r["lo_max"], r["w_max"])
            lays.append(Layout(T, K, S, G, r["n_table"], r["n_escapes"], r["stream_words"], r["k_coded"], lo_bytes,
                               w_bytes, r["n_param"]))
            starts.append(total)
            total += (front + lays[-1].total + back + 15) // 16 * 16
        out = torch.zeros(total, dtype=torch.uint8, device=dev)  # header, padding between sections, trailers
        table = np.zeros((N, len(fields)), np.int64)
        patches, patch_rows, at = [], [], 0
        for s, (lay, r, start, front) in enumerate(zip(lays, summaries, starts, fronts)):
            table[s] = _segment_row(fields, lay, start + front)
            head = HEADER.pack(MAGIC, VERSION, n, G, T, K, S, r["n_table"], r["n_escapes"], r["k_coded"],
                               r["n_param"], lay.lo_bytes, lay.w_bytes, 0, r["stream_words"], 0,
                               0)[:CHECKED_HEADER_BYTES]
            prefix = make_fronts[s](lay.total) if make_fronts is not None else bytes(front)
            if len(prefix) != front:
                raise ValueError(f"make_front wrote {len(prefix)} bytes into a front of {front}")
            patches.append(prefix + head)
            patch_rows.append((at, start, front + CHECKED_HEADER_BYTES))
            at += front + CHECKED_HEADER_BYTES
        # one host->device copy: the segment table, the scatter's rows, then every container's
        # front and its payload's first header bytes (written by one scatter)
        rows = np.asarray(patch_rows, np.int64)
        up = pinned(table.tobytes() + rows.tobytes() + b"".join(patches)).to(dev, non_blocking=True)
        segs = up[:table.nbytes].view(torch.int64).view(table.shape)
        rows_dev = up[table.nbytes:table.nbytes + rows.nbytes].view(torch.int64).view(rows.shape)
        kern["scatter"][(N,)](up[table.nbytes + rows.nbytes:], rows_dev, out, BLOCK=1024)
        b8, b16, b32 = out.view(torch.int8), out.view(torch.int16), out.view(torch.int32)
        kern["pack_meta"][(K, N)](self.lo, self.W, self.A, self.codes, self.states, self.model, self.scale, self.mu16,
                                  b8, b16, b32, segs, K, -(-T // S), HCAP=self.HCAP, BLOCK_K=_pow2(K), BLOCK_P=256,
                                  SEG_FIELDS=len(fields))
        kern["gather"][(self.NG, N)](self.buf, self.glen, self.gend, self.cap, self.ebuf, self.gesc, self.geend,
                                     self.ecap, b16, b32, segs, self.NG, BLOCK=1024, SEG_FIELDS=len(fields))
        sums = torch.zeros((N, 2), dtype=torch.int64, device=dev)
        _checksum_torch(torch, out, segs, sums, max(lay.total for lay in lays))
        kern["finish"][(N,)](sums, b32, segs, SEG_FIELDS=len(fields))
        return [out[start:start + front + lay.total + back]
                for start, front, back, lay in zip(starts, fronts, backs, lays)]


_MODEL_TABLES_ON = {}


def _model_tables_on(torch, dev, prob_bits: int) -> dict:
    """The parametric model's integer tables (and -log2 f for the encoder's costs) on a device, cached."""
    key = (str(dev), prob_bits)
    if key not in _MODEL_TABLES_ON:
        t = dict(model_tables(), nlog=_neg_log2_table(prob_bits))
        _MODEL_TABLES_ON[key] = {name: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for name, v in t.items()}
    return _MODEL_TABLES_ON[key]


class _TorchInt(dict):
    def __missing__(self, nbytes):
        import torch

        return {1: torch.int8, 2: torch.int16, 4: torch.int32}[nbytes]


_TORCH_INT = _TorchInt()


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _warps(G: int) -> int:
    return max(1, min(16, GROUPS_PER_PROGRAM * G // 32))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _checksum_torch(torch, buf, segs, sums, max_len: int):
    """Adds the sums of checksum() of every payload in buf (segs: the segment table on the device,
    base and length of each) but its check fields (before the mod 2^32) to sums, int64 [N, 2] zeros."""
    kern = _kernels()
    kern["checksum"][(triton_cdiv(max_len, CHECKSUM_BLOCK * CHECKSUM_ITERS), segs.shape[0])](
        buf, segs, sums, SKIP_LO=CHECKED_HEADER_BYTES, SKIP_HI=HEADER.size, BLOCK=CHECKSUM_BLOCK,
        ITERS=CHECKSUM_ITERS, SEG_FIELDS=segs.shape[1])


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


def decode_cuda(payload, head: bytes | None = None, check: bool = True):
    """decode() on the GPU: uint8 CUDA tensor (a payload from encode or encode_cuda) -> int32 CUDA [T, K].

    The header is read on the host (it sizes every allocation): pass its first HEADER.size bytes
    as `head` when the host already has them, which saves a device->host read. Checksum, tables,
    lookup and lanes run as kernels whose errors meet in one flag; check=True reads it (the one
    host synchronization) and raises BitstreamError, check=False returns (symbols, flag) for the
    caller to read later (nonzero: corrupt)."""
    outs, errs = decode_many_cuda([payload], None if head is None else [head], check=check)
    return outs[0] if check else (outs[0], errs[0:1])


def decode_many_cuda(payloads, heads=None, check: bool = True, max_elements=None):
    """decode_cuda() of a list of payloads in one set of kernel launches, for payloads of one shape
    (T, K, lane tokens, group lanes, prob_bits: e.g. every layer's K of one step); payloads of
    other shapes go in their own launches. Returns (symbols list, error flags int32 [N]); with
    check=True the flags are read in one host synchronization and a corrupt payload raises
    BitstreamError naming its index. max_elements: the most values a payload may declare (one
    limit, or one per payload; default shared.schema.DEFAULT_MAX_ELEMENTS), checked before
    anything is allocated, as the CPU decoder checks it."""
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
    for p, h, limit in zip(payloads, heads, limits):
        hdr = Parsed.__new__(Parsed)
        _parse_header_only(hdr, bytes(h[:HEADER.size]), len(p), limit)
        hdrs.append(hdr)
    groups = {}
    for i, h in enumerate(hdrs):
        groups.setdefault((h.T, h.K, h.S, h.G, h.prob_bits), []).append(i)
    outs, errs = [None] * len(payloads), [None] * len(payloads)
    for members in groups.values():
        o, e = _decode_same_shape([payloads[i] for i in members], [hdrs[i] for i in members])
        for j, i in enumerate(members):
            outs[i], errs[i] = o[j], e[j:j + 1]
    err = torch.cat(errs)
    if check:
        bad = err.cpu()  # the one host synchronization after the headers
        if bool(bad.any()):
            raise BitstreamError(CORRUPT + (f" (payload {int(bad.nonzero()[0])} of the list)" if len(bad) > 1 else ""))
    return outs, err


def _decode_same_shape(payloads, hdrs):
    torch = _torch()
    dev = payloads[0].device
    h0 = hdrs[0]
    n, G, S, K, T = h0.prob_bits, h0.G, h0.S, h0.K, h0.T
    M, HCAP, N = 1 << n, max_alphabet(n), len(payloads)
    lay0 = h0.layout
    NL, NG = lay0.n_lanes, lay0.n_groups
    kern = _kernels()
    fields = kern["seg_fields"]
    # one buffer holding every payload at a 16-byte aligned offset (a view when there is one)
    bases, total = [], 0
    for p in payloads:
        bases.append(total)
        total += (len(p) + 15) // 16 * 16
    if N == 1 and payloads[0].data_ptr() % 16 == 0 and len(payloads[0]) % 16 == 0:
        buf = payloads[0]
    else:
        zeros = torch.zeros(16, dtype=torch.uint8, device=dev)
        buf = torch.cat([t for p in payloads for t in (p, zeros[:(-len(p)) % 16])])
    table = [_segment_row(fields, hdr.layout, base) for hdr, base in zip(hdrs, bases)]
    segs = _device_table(torch, table, dev)
    err = torch.zeros(N, dtype=torch.int32, device=dev)
    sums = torch.zeros((N, 2), dtype=torch.int64, device=dev)
    _checksum_torch(torch, buf, segs, sums, max(h.layout.total for h in hdrs))
    lo = torch.empty((N, K), dtype=torch.int64, device=dev)
    W, A, rank = torch.empty_like(lo), torch.empty_like(lo), torch.empty_like(lo)
    tab = torch.empty((N, K + 1, HCAP), dtype=torch.int32, device=dev)
    lut = torch.empty((N, (K + 1) * M), dtype=torch.int32, device=dev)
    packed = n <= 11
    b8, b16, b32 = buf.view(torch.int8), buf.view(torch.int16), buf.view(torch.int32)
    mt = _model_tables_on(torch, dev, n)
    kern["decode_meta"][(K + 1, N)](
        b8, b16, b32, segs, sums, mt["shapes"], mt["inv_sigma"], lo, W, A, rank, tab, lut, err, K, HCAP=HCAP,
        PROB_BITS=n, BLOCK_K=_pow2(K), PACKED=packed, N_SHAPES=N_SHAPES, SHAPE_STEPS=SHAPE_STEPS,
        SEG_FIELDS=len(fields), num_warps=META_WARPS)
    col = {f: i for i, f in enumerate(fields)}
    ar = torch.arange(NG, device=dev)
    glen = b32[segs[:, col["gw_el"]:col["gw_el"] + 1] + ar]  # [N, NG]
    gesc = b32[segs[:, col["ge_el"]:col["ge_el"] + 1] + ar]
    gend, geend = torch.cumsum(torch.stack([glen, gesc]), 2, dtype=torch.int64)
    out = torch.empty((N, T, K), dtype=torch.int32, device=dev)
    kern["decode"][(triton_cdiv(NG, GROUPS_PER_PROGRAM), N)](
        b16, b32, segs, gend, glen.contiguous(), lo, W, A, rank, lut, tab, out, gesc.contiguous(), geend, err,
        T, K, NL, NG, S, HCAP=HCAP, PROB_BITS=n, G=G, GPP=GROUPS_PER_PROGRAM,
        WIDE_INDEX=(T + 1) * K >= 2**31, PACKED=packed, num_warps=_warps(G), SEG_FIELDS=len(fields))
    return list(out.unbind(0)), err


CORRUPT = "rANS payload is corrupt (checksum, tables or lane states do not check out)"



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

    _KERNELS = dict(fields=kt.SUMMARY_FIELDS, hist=kt.hist_kernel, tables=kt.tables_kernel, encode=kt.encode_kernel,
                    pack_meta=kt.pack_meta_kernel, gather=kt.gather_streams_kernel, checksum=kt.checksum_kernel,
                    finish=kt.finish_checksum_kernel, decode_meta=kt.decode_meta_kernel, decode=kt.decode_kernel)
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
                     reserve_backs=None) -> list:
    """encode_cuda() of each tensor of a list with one host synchronization for all of them
    (stats, guards, reserve_*: lists of encode_cuda's arguments, one per tensor, or None)."""
    torch = _torch()
    n_t = len(ts)
    jobs = [_EncodeJob(t, prob_bits, group_lanes, lane_tokens, (stats or [None] * n_t)[i],
                       (guards or [None] * n_t)[i]) for i, t in enumerate(ts)]
    for job in jobs:
        job.code_lanes(min(job.cap, ESCAPES_PER_GROUP))
    summaries = torch.stack([job.scal for job in jobs]).cpu().tolist()  # the host synchronization
    outs = []
    for i, (job, summary) in enumerate(zip(jobs, summaries)):
        summary = dict(zip(job.kern["fields"], summary))
        if summary["group_escapes_max"] > job.ecap:  # a group escaped more than its buffer holds: again, with room
            job.scal[job.kern["fields"].index("stream_words")] = job.scal[job.kern["fields"].index("n_escapes")] = 0
            job.code_lanes(job.cap)
            summary = dict(zip(job.kern["fields"], job.scal.cpu().tolist()))
        outs.append(job.finish(summary, (reserve_fronts or [0] * n_t)[i], (reserve_backs or [0] * n_t)[i]))
    return outs


class _EncodeJob:
    """One tensor's encode: the lanes (before the host learns the payload's size), then the payload."""

    def __init__(self, t, prob_bits, group_lanes, lane_tokens, stats, guard):
        torch = _torch()
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
        t = t.contiguous()
        T, K = t.shape
        S = _check_settings(prob_bits, group_lanes, lane_tokens or default_lane_tokens(T, K), T)
        n, G, HCAP = prob_bits, group_lanes, max_alphabet(prob_bits)
        kern = _kernels()
        dev = t.device
        if stats is None:
            mn, mx = torch.aminmax(t, dim=0)
            sm = t.sum(0, dtype=torch.int64)
        else:
            mn, mx, sm = stats

        # 1. histograms of the sampled tokens inside the first windows; 2. trimmed windows and tables
        wide_index = (T + 1) * K >= 2**31
        R = hist_row_stride(T)
        n_sampled = triton_cdiv(T, R)
        counts = torch.zeros((K, HCAP), dtype=torch.int32, device=dev)
        hs = min(n_sampled, HIST_TOKENS)
        n_hist = triton_cdiv(n_sampled, hs) * K
        kern["hist"][(triton_cdiv(n_hist, HIST_BLOCK),)](
            t, mn, mx, sm, counts, T, K, n_hist, hs, R, HCAP=HCAP, BLOCK=HIST_BLOCK, WIDE_INDEX=wide_index,
            num_warps=HIST_BLOCK // 32)
        lo = torch.empty(K, dtype=torch.int64, device=dev)
        W, A = torch.empty_like(lo), torch.empty_like(lo)
        codes = torch.empty((K, HCAP), dtype=torch.uint8, device=dev)
        tab = torch.empty((K, HCAP), dtype=torch.int32, device=dev)
        model, scale, mu16 = torch.empty_like(lo), torch.empty_like(lo), torch.empty_like(lo)
        scal = _summary_start(torch, dev).clone()
        mt = _model_tables_on(torch, dev, n)
        kern["tables"][(K,)](counts, mn, mx, sm, guard if guard is not None else scal, lo, W, A, codes, tab,
                             model, scale, mu16, mt["shapes"], mt["inv_sigma"], mt["sigma16_sq"], mt["nlog"], scal,
                             T, R, n_sampled, HCAP=HCAP, PROB_BITS=n, ESC_COST=ESCAPE_COST,
                             ENTRY_COST=TABLE_ENTRY_COST, HAS_GUARD=guard is not None, N_SHAPES=N_SHAPES,
                             SEARCH=MODEL_SEARCH, SHAPE_STEPS=SHAPE_STEPS, PARAM_BYTES=PARAM_BYTES,
                             MIN_SHARE=MODEL_MIN_SHARE)

        # 3. the lanes: words and escaped values into per-group buffers
        lay = Layout(T, K, S, G, 0, 0, 0)
        NL, NG, cap = lay.n_lanes, lay.n_groups, G * S
        buf = torch.empty(NG * cap, dtype=torch.int16, device=dev)
        states = torch.empty(NL, dtype=torch.int32, device=dev)
        glen = torch.empty(NG, dtype=torch.int32, device=dev)
        gesc = torch.empty(NG, dtype=torch.int32, device=dev)
        sums = torch.zeros(2, dtype=torch.int64, device=dev)
        self.torch, self.t, self.kern, self.dev, self.n, self.G, self.HCAP = torch, t, kern, dev, n, G, HCAP
        self.T, self.K, self.S, self.wide_index = T, K, S, wide_index
        self.lo, self.W, self.A, self.codes, self.tab = lo, W, A, codes, tab
        self.model, self.scale, self.mu16, self.scal = model, scale, mu16, scal
        self.NL, self.NG, self.cap = NL, NG, cap
        self.buf, self.states, self.glen, self.gesc, self.sums = buf, states, glen, gesc, sums

    def code_lanes(self, ecap):
        torch, kern, dev, t = self.torch, self.kern, self.dev, self.t
        self.ecap = ecap
        self.ebuf = torch.empty(self.NG * ecap, dtype=torch.int32, device=dev)
        kern["encode"][(triton_cdiv(self.NG, GROUPS_PER_PROGRAM),)](
            t, self.lo, self.W, self.A, self.tab, self.buf, self.states, self.glen, self.ebuf, self.gesc, self.scal,
            self.T, self.K, self.NL, self.NG, self.S, self.cap, ecap,
            HCAP=self.HCAP, PROB_BITS=self.n, G=self.G, GPP=GROUPS_PER_PROGRAM, WIDE_INDEX=self.wide_index,
            num_warps=_warps(self.G))
        self.gend, self.geend = torch.cumsum(torch.stack([self.glen, self.gesc]), 1, dtype=torch.int64)

    def finish(self, summary, reserve_front, reserve_back):
        torch, kern, dev = self.torch, self.kern, self.dev
        T, K, S, G, n, HCAP, NG, cap = self.T, self.K, self.S, self.G, self.n, self.HCAP, self.NG, self.cap
        lo, W, A, codes, model, scale, mu16 = self.lo, self.W, self.A, self.codes, self.model, self.scale, self.mu16
        buf, states, glen, gesc, sums = self.buf, self.states, self.glen, self.gesc, self.sums
        ebuf, gend, geend, ecap = self.ebuf, self.gend, self.geend, self.ecap
        n_table, k_coded, stream_words, n_escapes = (summary[f] for f in ("n_table", "k_coded", "stream_words",
                                                                           "n_escapes"))
        w_max, lo_min, lo_max, n_param = summary["w_max"], summary["lo_min"], summary["lo_max"], summary["n_param"]
        if summary["overflow"]:
            raise InvalidTensorError("quantized coefficients reach beyond int32 (or the tensor holds NaN/Inf); "
                                     "use a larger step or fix the producer")

        # 4. the payload: header, meta, escapes, states and streams, then the checksum
        lo_bytes, w_bytes = _widths(lo_min, lo_max, w_max)
        lay = Layout(T, K, S, G, n_table, n_escapes, stream_words, k_coded, lo_bytes, w_bytes, n_param)
        if reserve_front % 16:
            raise ValueError(f"reserve_front must be a multiple of 16, got {reserve_front}")
        out = torch.empty(reserve_front + lay.total + reserve_back, dtype=torch.uint8, device=dev)
        payload = out[reserve_front:reserve_front + lay.total]
        payload[:lay.group_words].zero_()  # header and the padding between meta sections
        head = HEADER.pack(MAGIC, VERSION, n, G, T, K, S, n_table, n_escapes, k_coded, n_param, lo_bytes, w_bytes, 0,
                           stream_words, 0, 0)[:CHECKED_HEADER_BYTES]
        payload[:CHECKED_HEADER_BYTES].copy_(pinned(head), non_blocking=True)
        kern["pack_meta"][(K,)](lo, W, A, codes, states, model, scale, mu16,
                                payload[lay.lo:lay.wflag].view(_TORCH_INT[lo_bytes]),
                                payload[lay.wflag:lay.wflag + w_bytes * K].view(_TORCH_INT[w_bytes]),
                                payload[lay.model:lay.model + K],
                                payload[lay.mu16:lay.scale].view(torch.int16) if n_param else mu16,
                                payload[lay.scale:lay.scale + n_param] if n_param else mu16,
                                payload[lay.codes:lay.group_words], payload[lay.states:lay.streams].view(torch.int32),
                                K, lay.P, k_coded, HCAP=HCAP, BLOCK_K=_pow2(K), BLOCK_P=256,
                                FLAG_SHIFT=8 * w_bytes - 1)
        esc_out = payload[lay.escapes:lay.states].view(torch.int32) if n_escapes else gesc
        kern["gather"][(NG,)](buf, glen, gend, payload[lay.streams:].view(torch.int16),
                              payload[lay.group_words:lay.group_escapes].view(torch.int32), cap,
                              ebuf, gesc, geend, esc_out, payload[lay.group_escapes:lay.escapes].view(torch.int32), ecap,
                              BLOCK=1024)
        _checksum_torch(torch, payload, sums)
        kern["finish"][(1,)](sums, payload[CHECKED_HEADER_BYTES:HEADER.size].view(torch.int32))
        return out


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


def _checksum_torch(torch, payload, sums):
    """Adds the sums of checksum() over the whole payload but its check fields (before the
    mod 2^32) to sums, int64 [2] zeros on the payload's device."""
    n = len(payload)
    _kernels()["checksum"][(triton_cdiv(n, CHECKSUM_BLOCK * CHECKSUM_ITERS),)](
        payload, n, sums, SKIP_LO=CHECKED_HEADER_BYTES, SKIP_HI=HEADER.size, BLOCK=CHECKSUM_BLOCK,
        ITERS=CHECKSUM_ITERS)


def decode_cuda(payload, head: bytes | None = None, check: bool = True):
    """decode() on the GPU: uint8 CUDA tensor (a payload from encode or encode_cuda) -> int32 CUDA [T, K].

    The header is read on the host (it sizes every allocation): pass its first HEADER.size bytes
    as `head` when the host already has them, which saves a device->host read. Checksum, tables,
    lookup and lanes run as kernels whose errors meet in one flag; check=True reads it (the one
    host synchronization) and raises BitstreamError, check=False returns (symbols, flag) for the
    caller to read later, e.g. once for many payloads (nonzero: corrupt)."""
    torch = _torch()
    if not isinstance(payload, torch.Tensor):
        raise InvalidTensorError(f"decode_cuda takes a torch uint8 tensor, got {type(payload).__name__}; "
                                 "use decode() for bytes")
    _check_device(payload, "decode_cuda")
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise InvalidTensorError(f"payload must be a 1-D uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
    payload = payload.contiguous()
    dev = payload.device
    hdr = Parsed.__new__(Parsed)
    head = bytes(head[:HEADER.size]) if head is not None else bytes(payload[:HEADER.size].cpu().numpy())
    _parse_header_only(hdr, head,
                       len(payload))
    lay, n, G, S, K, T = hdr.layout, hdr.prob_bits, hdr.G, hdr.S, hdr.K, hdr.T
    M, HCAP = 1 << n, max_alphabet(n)
    NL, NG = lay.n_lanes, lay.n_groups
    kern = _kernels()
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    sums = torch.zeros(2, dtype=torch.int64, device=dev)
    _checksum_torch(torch, payload, sums)
    lo = torch.empty(K, dtype=torch.int64, device=dev)
    W, A, rank = torch.empty_like(lo), torch.empty_like(lo), torch.empty_like(lo)
    tab = torch.empty((K + 1, HCAP), dtype=torch.int32, device=dev)
    lut = torch.empty((K + 1) * M, dtype=torch.int32, device=dev)
    packed = n <= 11
    codes_section = payload[lay.codes:lay.codes + hdr.n_table] if hdr.n_table else payload[:1]
    mt = _model_tables_on(torch, dev, n)
    n_param = lay.n_param
    kern["decode_meta"][(K + 1,)](
        payload[lay.lo:lay.wflag].view(_TORCH_INT[lay.lo_bytes]),
        payload[lay.wflag:lay.wflag + lay.w_bytes * K].view(_TORCH_INT[lay.w_bytes]),
        payload[lay.model:lay.model + K], payload[lay.mu16:lay.scale].view(torch.int16) if n_param else sums,
        payload[lay.scale:lay.scale + n_param] if n_param else codes_section, codes_section,
        payload[CHECKED_HEADER_BYTES:HEADER.size].view(torch.int32), sums, hdr.n_table, lay.k_coded, n_param,
        mt["shapes"], mt["inv_sigma"], lo, W, A, rank, tab, lut, err, K, HCAP=HCAP, PROB_BITS=n,
        BLOCK_K=_pow2(K), TOP=8 * lay.w_bytes - 1, PACKED=packed, N_SHAPES=N_SHAPES, SHAPE_STEPS=SHAPE_STEPS)
    glen = payload[lay.group_words:lay.group_escapes].view(torch.int32)
    gesc = payload[lay.group_escapes:lay.escapes].view(torch.int32)
    gend, geend = torch.cumsum(torch.stack([glen, gesc]), 1, dtype=torch.int64)
    words = payload[lay.streams:].view(torch.int16) if hdr.stream_words else torch.zeros(1, dtype=torch.int16,
                                                                                         device=dev)
    states = payload[lay.states:lay.streams].view(torch.int32) if lay.k_coded else err
    out = torch.empty((T, K), dtype=torch.int32, device=dev)
    n_esc = hdr.n_escapes
    esc_in = payload[lay.escapes:lay.states].view(torch.int32) if n_esc else err
    kern["decode"][(triton_cdiv(NG, GROUPS_PER_PROGRAM),)](
        words, gend, glen, states, lo, W, A, rank, lut, tab, out, esc_in, gesc, geend, err, T, K, NL, NG, S,
        hdr.stream_words, n_esc, lay.k_coded, HCAP=HCAP, PROB_BITS=n, G=G, GPP=GROUPS_PER_PROGRAM,
        WIDE_INDEX=(T + 1) * K >= 2**31, PACKED=packed, num_warps=_warps(G))
    if not check:
        return out, err
    if err.item():  # the one host synchronization after the header
        raise BitstreamError(CORRUPT)
    return out


CORRUPT = "rANS payload is corrupt (checksum, tables or lane states do not check out)"



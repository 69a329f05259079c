"""Interleaved rANS for integer symbol matrices [T, K] with per-component statistics.

The entropy-coding stage of the compute codec: PCA coefficients quantized with one shared step
(shared/rdquant.py) are integers whose distribution differs per component, so every component
(column) gets its own frequency table. Many independent rANS lanes make it parallel: a lane codes
`lane_tokens` consecutive tokens of one component, and lanes are grouped `group_lanes` at a time
into one shared word stream, so a GPU runs one lane per thread and writes/reads each group's
stream coalesced.

    from shared.codecs import rans
    payload = rans.encode(symbols)            # numpy int32 [T, K] -> bytes (CPU reference)
    symbols = rans.decode(payload)            # bytes -> numpy int32 [T, K]
    rans.entropy_bound_bytes(symbols)         # the per-component memoryless empirical entropy, bytes

This module is the format and its numpy reference coder; the frequency-table rules and the
parametric models both coders compute live in rans_tables.py; shared/codecs/rans_cuda.py codes
the same bitstream on a GPU (Triton kernels in _rans_triton.py), rans_cpu.py with numba, and each
decodes the others'.
Importing this module needs neither a GPU nor Triton.

Bitstream (all little-endian; offsets follow from the header):

    header, 56 bytes: magic b"TRNS", u8 version=3, u8 prob_bits n (9..15), u16 group_lanes G,
        u32 T, u32 K, u32 lane_tokens S, u32 n_table, u32 n_escapes, u32 k_coded, u32 n_param,
        u8 lo_bytes, u8 w_bytes, u16 flags, u64 stream_words, u32 check0, u32 check1
        (flags: bit 0 LANES_BY_COMPONENT, see lanes below; the other bits 0)
    lo        int{8,16,32}[K]  first symbol value of each component's window (lo_bytes wide)
    wflag     uint{8,16}[K]    window width W | escape flag in the top bit (w_bytes wide);
                               alphabet A = W + flag
    model     uint8[K]         0: explicit weight codes; 1..4: parametric (shape 0..3, see below)
    (zero padding to a multiple of 2 bytes)
    mu16      int16[n_param]   centre of each parametric component, 1/16 symbol from lo
    scale     uint8[n_param]   its scale code: sigma = 2^(code/8 - 2) symbols
    (zero padding to a multiple of 4 bytes)
    codes     uint8[n_table]   weights of each explicit component, A entries each, 8-bit minifloat
    (zero padding to a multiple of 4 bytes)
    group_words uint32[n_groups]   words in each group's stream
    group_escapes uint32[n_groups] escaped values of each group
    escapes   int32[n_escapes]     values outside their component's window, group after group; within
                                   a group in the order the encoder meets them (tokens last to first,
                                   lanes in order), so the decoder reads them from the group's end
    states    uint32[P * k_coded]  final rANS state of each lane of a component with A > 1, in lane order
                                   (a component of one symbol codes nothing: its state stays 2^16)
    streams   uint16[stream_words] the groups' word streams, group after group

    lanes: P = ceil(T / S) token chunks; lane g codes tokens [p*S, min(T, (p+1)*S)) of component k,
    where g = p * K + k (a group's lanes are consecutive components of one chunk), or with flag
    LANES_BY_COMPONENT g = k * P + p (a group's lanes are consecutive chunks of one component: a GPU
    warp then reads one component's table, which stays in L1, where 32 components' tables do not, but
    writes values S rows apart);
    n_lanes = P * K; group = g // G; n_groups = ceil(n_lanes / G).

check0/check1 are a Fletcher-like checksum of the whole payload except these 8 bytes (sum of
bytes, and sum of bytes times (position mod 65521 + 1), both mod 2^32; positions count the bytes
checked). Decoding verifies it, and also that every lane ends in the initial state 2^16 and every
group consumes exactly its words and escapes, so a corrupt or truncated payload raises
BitstreamError rather than returning wrong symbols (rANS resynchronizes after a corrupt word, so the state check alone
would miss some corruption).

Windows (the encoder's choice; the decoder reads them from the payload): a component whose values
span at most 2^(n-2) symbols takes its whole range; a wider one gets 2^(n-2) - 1 symbols centred on
the floor of its mean. Tails are then trimmed while escaping their values (ESCAPE_COST bytes each)
is cheaper than their table entries (TABLE_ENTRY_COST each), always keeping the mode; values outside
the window are coded as the escape symbol (the last one of the alphabet) and stored raw in
`escapes`. The histogram behind these choices counts every token of a short tensor, else every R-th token
(hist_row_stride: R = 2 from 1024 tokens, about 32768 sampled from 65536).

Frequencies: from integer weights w (0 = absent) -- the decoded 8-bit codes of an explicit
component, or a parametric component's model (model_weights: a shape sampled at |j - mu| / sigma,
from integer tables stored in rans_models.npz) -- both coders compute the same table summing to
2^n: f = max(1, floor(w * s / sum(w))) for w > 0 with the largest integer s <= 2^(n+1) that keeps
the sum <= 2^n (bisection), the remainder added to the heaviest symbol. The encoder gives a
component a model where that codes it in fewer bytes than its explicit table (fit_models); on
short tensors (1024 tokens) most components take one. The rANS state is 32 bits in [2^16, 2^32),
renormalized 16 bits at a time; encoding runs from the last token of a lane to the first, and each
step's emitted words are appended to the group stream in lane order; the decoder reads them back
from the end of the stream.
"""
from __future__ import annotations

import math
import struct

import numpy as np

from ..errors import BitstreamError, InvalidTensorError
from ..schema import DEFAULT_MAX_ELEMENTS
from .rans_tables import (N_SHAPES, choose_tables, fit_models, hist_row_stride, initial_windows, max_alphabet,
                          minifloat_decode, model_weights, normalize_weights)

MAGIC = b"TRNS"
VERSION = 3  # 3: parametric tables; 2: escapes per group in coding order (1: row-major, needed a sort)
HEADER = struct.Struct("<4sBBHIIIIIIIBBHQII")  # 56 bytes
CHECKED_HEADER_BYTES = 48  # the header bytes before check0
STATE_LOW = 1 << 16  # rANS state lower bound L; states live in [L, 2^32)

DEFAULT_PROB_BITS = 10  # frequency precision n: tables sum to 2^n (<= 11: one-load GPU decode; 10 keeps a batch's lookup tables in L2 for <0.1% more bytes than 11)
MIN_PROB_BITS, MAX_PROB_BITS = 9, 15  # the precisions the format allows (both coders' checks read these)
SHORT_TOKENS, SHORT_PROB_BITS = 2048, 9  # and for tensors of at most SHORT_TOKENS tokens (see default_prob_bits)
DEFAULT_GROUP_LANES = 32  # lanes sharing one word stream (a GPU warp)
LANES_BY_COMPONENT = 1  # header flag: lane g = k * P + p (see the bitstream above)


def default_prob_bits(T: int) -> int:
    """The precision n when the caller names none. Short tensors (one layer's K or V of a KV step)
    are decoded many to a launch, whose slot -> symbol lookups (K x 2^n entries each) then share
    the GPU's L2: 9 bits halve them (60 x [1024, 192] on an NVIDIA H200: decoder lanes 365 -> 240
    us) for 0.04% more bytes on SmolLM2's K at cos 0.999. A 9-bit table keeps at most 128 values
    per component and escapes the rest (~5 bytes each): wide alphabets pay, e.g. per-channel 8-bit
    planes code 25-30% larger than at 10 bits (docs/findings.md); pass prob_bits for those."""
    return SHORT_PROB_BITS if T <= SHORT_TOKENS else DEFAULT_PROB_BITS


MIN_DEFAULT_LANE_TOKENS = 512  # shortest default lane: its 4-byte state costs ~1.5% over the entropy bound


def whole_component_groups(T: int, K: int, lane_tokens: int | None = None,
                           group_lanes: int = DEFAULT_GROUP_LANES) -> bool:
    """Whether a [T, K] tensor's lanes, taken by component (LANES_BY_COMPONENT), make whole groups of one
    component: groups of 32 lanes and a multiple of 32 token chunks. Only such payloads does the GPU
    decoder tile (16 components a program, rows stored through shared memory); others decode one group a
    program, slower than the default order."""
    S = lane_tokens or default_lane_tokens(T, K)
    return group_lanes == 32 and (-(-T // S)) % 32 == 0


def default_lane_tokens(T: int, K: int) -> int:
    """Tokens per lane: enough lanes (~2^17) to fill a GPU, as a lane's steps run one after the
    other (a 1024-token lane costs ~0.4 ms however few lanes there are), but >= 512 tokens so the
    per-lane state stays small. On the real K at cos 0.999: 1024 tokens code 0.8% above the
    entropy bound, 512 tokens 1.6%, 256 tokens 3.1%."""
    s = 1 << max(0, round(math.log2(max(1, T * K) / (1 << 17))))
    return int(min(T, max(MIN_DEFAULT_LANE_TOKENS, min(4096, s))))


def checksum(*parts) -> tuple[int, int]:
    """(sum of bytes, sum of bytes * (position mod 65521 + 1)), both mod 2^32, over the parts."""
    s0 = s1 = 0
    pos = 0
    for part in parts:
        b = np.frombuffer(part, np.uint8)
        for start in range(0, len(b), 1 << 22):
            chunk = b[start:start + (1 << 22)].astype(np.int64)
            w = (np.arange(pos + start, pos + start + len(chunk), dtype=np.int64) % 65521) + 1
            s0 += int(chunk.sum())
            s1 += int((chunk * w).sum())
        pos += len(b)
    return s0 & 0xFFFFFFFF, s1 & 0xFFFFFFFF


def _pad4(n: int) -> int:
    return (n + 3) & ~3


class Layout:
    """Byte offsets of every section, computed from the header fields alone."""

    def __init__(self, T, K, S, G, n_table, n_escapes, stream_words, k_coded=0, lo_bytes=4, w_bytes=2, n_param=0,
                 flags=0):
        self.T, self.K, self.S, self.G, self.flags = T, K, S, G, flags
        self.by_component = bool(flags & LANES_BY_COMPONENT)
        self.lo_bytes, self.w_bytes, self.k_coded, self.n_param = lo_bytes, w_bytes, k_coded, n_param
        self.n_table, self.n_escapes, self.stream_words = n_table, n_escapes, stream_words
        self.P = -(-T // S)
        self.n_lanes = self.P * K
        self.n_groups = -(-self.n_lanes // G)
        self.lo = HEADER.size
        self.wflag = self.lo + lo_bytes * K + (lo_bytes * K) % w_bytes  # aligned for its width
        self.model = self.wflag + w_bytes * K
        self.mu16 = (self.model + K + 1) & ~1  # aligned for int16
        self.scale = self.mu16 + 2 * n_param
        self.codes = _pad4(self.scale + n_param)
        self.group_words = _pad4(self.codes + n_table)
        self.group_escapes = self.group_words + 4 * self.n_groups
        self.escapes = self.group_escapes + 4 * self.n_groups
        self.states = self.escapes + 4 * n_escapes
        self.streams = self.states + 4 * self.P * k_coded
        self.total = self.streams + 2 * stream_words

    def lane_cells(self) -> np.ndarray:
        """Each lane's cell p * K + k (its token chunk p and component k), lanes in order."""
        g = np.arange(self.n_lanes, dtype=np.int64)
        return (g % self.P) * self.K + g // self.P if self.by_component else g

    def coded_lanes(self, A) -> np.ndarray:
        """Which lanes, in order, code a component of more than one symbol (alphabet sizes A [K]): the
        lanes whose final states the payload stores."""
        return np.tile(np.asarray(A) > 1, self.P)[self.lane_cells()]


def _widths(lo_min: int, lo_max: int, w_max: int) -> tuple[int, int]:
    """Narrowest lo and wflag widths (bytes) that hold every component's values."""
    lo_bytes = next(b for b in (1, 2, 4) if lo_min >= -(1 << (8 * b - 1)) and lo_max < (1 << (8 * b - 1)))
    return lo_bytes, (1 if w_max < 128 else 2)


_INT = {1: "<i1", 2: "<i2", 4: "<i4"}
_UINT = {1: "<u1", 2: "<u2"}


def _validate_symbols(symbols) -> np.ndarray:
    if not isinstance(symbols, np.ndarray):
        raise InvalidTensorError(f"symbols must be a numpy array, got {type(symbols).__name__}")
    if symbols.ndim != 2:
        raise InvalidTensorError(f"symbols must be 2-D [T tokens, K components], got shape {symbols.shape}")
    if symbols.size == 0:
        raise InvalidTensorError(f"symbols is empty (shape {symbols.shape}); there is nothing to code")
    if symbols.dtype.kind not in "iub":
        raise InvalidTensorError(f"symbols must be integers, got {symbols.dtype}; quantize first (shared.rdquant)")
    if symbols.dtype != np.int32:
        if symbols.dtype.itemsize >= 4 and (symbols.min() < -(2**31) or symbols.max() > 2**31 - 1):
            raise InvalidTensorError(
                f"symbols overflow int32 (range {symbols.min()}..{symbols.max()}); use a larger quantization step"
            )
        symbols = symbols.astype(np.int32)
    if symbols.shape[0] >= 2**31 or symbols.shape[1] >= 2**31:
        raise InvalidTensorError(f"symbols shape {symbols.shape} too large for one payload; split it")
    return np.ascontiguousarray(symbols)


MAX_LANE_TOKENS = 1 << 14  # tokens per lane: a decoder's steps are sequential, so both coders bound them
TABLE_ENTRIES_PER_VALUE = 16  # decoding tables (K x 2^prob_bits entries) may exceed this many per value...
MAX_TABLE_ENTRIES = 1 << 24  # ...only up to this many in all: bounds a decoder's table memory by the output


def table_budget_ok(T: int, K: int, prob_bits: int) -> bool:
    """Whether the decoding tables of a [T, K] payload stay within the budget both coders enforce."""
    return K << prob_bits <= max(TABLE_ENTRIES_PER_VALUE * T * K, MAX_TABLE_ENTRIES)


def _check_settings(prob_bits, group_lanes, lane_tokens, T):
    if not MIN_PROB_BITS <= prob_bits <= MAX_PROB_BITS:
        raise InvalidTensorError(f"prob_bits must be {MIN_PROB_BITS}..{MAX_PROB_BITS}, got {prob_bits}")
    if group_lanes < 1 or group_lanes > 1024 or group_lanes & (group_lanes - 1):
        raise InvalidTensorError(f"group_lanes must be a power of two up to 1024, got {group_lanes}")
    if lane_tokens < 1:
        raise InvalidTensorError(f"lane_tokens must be >= 1, got {lane_tokens}")
    if min(int(lane_tokens), T) > MAX_LANE_TOKENS:
        raise InvalidTensorError(f"lane_tokens={lane_tokens}: at most {MAX_LANE_TOKENS} (a decoder refuses longer lanes)")
    return min(int(lane_tokens), T)


def _tables_cpu(sym: np.ndarray, prob_bits: int):
    """Per-component window and tables from the symbols (CPU path)."""
    T, K = sym.shape
    s64 = sym.astype(np.int64)
    mn, mx = s64.min(0), s64.max(0)
    lo0, h0 = initial_windows(mn, mx, s64.sum(0), T, prob_bits)
    stride = hist_row_stride(T)
    sample = s64[::stride]
    H = int(h0.max())
    idx = sample - lo0
    inwin = (idx >= 0) & (idx < h0)
    key = (np.arange(K, dtype=np.int64)[None, :] * H + idx)[inwin]
    counts = np.bincount(key, minlength=K * H).reshape(K, H)
    lo, W, esc, codes, kept = choose_tables(counts, h0, lo0, mn, mx, len(sample), stride)
    model, scale, mu16 = fit_models(kept, W, esc, W + esc, codes, prob_bits, stride)
    return lo, W, esc, codes, model, scale, mu16


def encode(symbols: np.ndarray, prob_bits: int | None = None, group_lanes: int = DEFAULT_GROUP_LANES,
           lane_tokens: int | None = None, lanes_by_component: bool = False) -> bytes:
    """Code an integer matrix [T tokens, K components] (int32 range) into a self-contained payload.
    prob_bits: default_prob_bits(T) unless given. lanes_by_component: a lane group walks one
    component's token chunks rather than one chunk's components (flag LANES_BY_COMPONENT: the same
    size, the lanes in another order; for payloads decoded many times on a GPU, whose warps then
    each read one table)."""
    sym = _validate_symbols(symbols)
    T, K = sym.shape
    prob_bits = default_prob_bits(T) if prob_bits is None else prob_bits
    S = _check_settings(prob_bits, group_lanes, lane_tokens or default_lane_tokens(T, K), T)
    if not table_budget_ok(T, K, prob_bits):
        raise InvalidTensorError(f"{K} components of {T} tokens need {K << prob_bits} table entries, beyond what a "
                                 f"decoder accepts ({MAX_TABLE_ENTRIES}); code more tokens per payload or fewer "
                                 "components, or lower prob_bits")
    n, M, G = prob_bits, 1 << prob_bits, group_lanes
    lo, W, esc, codes, model, scale, mu16 = _tables_cpu(sym, prob_bits)
    A = W + esc
    freq, cum = normalize_weights(_component_weights(codes, model, scale, mu16, W, esc), prob_bits)

    idx = sym.astype(np.int64) - lo
    outside = (idx < 0) | (idx >= W)
    idx = np.where(outside, W, idx)
    lay = Layout(T, K, S, G, 0, int(outside.sum()), 0, flags=LANES_BY_COMPONENT if lanes_by_component else 0)
    P, NL, NG = lay.P, lay.n_lanes, lay.n_groups
    cells = lay.lane_cells()

    # Per-step, per-lane (f, c): rows [P*S] padded with the no-op symbol (f = M, c = 0).
    rows_k = np.arange(K)[None, :]
    F = np.full((P * S, K), M, np.int64)
    C = np.zeros((P * S, K), np.int64)
    F[:T] = freq[rows_k, idx]
    C[:T] = cum[rows_k, idx]
    F = _steps_by_lane(F, cells, P, S, K, NG * G, M)
    C = _steps_by_lane(C, cells, P, S, K, NG * G, 0)
    # escaped values, group after group, each group's in coding order (tokens last to first)
    esc_flag = _in_coding_order(_steps_by_lane(_pad_rows(outside, P * S, False), cells, P, S, K, NG * G, False),
                                NG, G)
    esc_vals = _in_coding_order(_steps_by_lane(_pad_rows(sym, P * S, 0), cells, P, S, K, NG * G, 0), NG, G)
    escapes = esc_vals[esc_flag]
    group_escapes = esc_flag.sum((1, 2))

    x = np.full(NG * G, STATE_LOW, np.int64)
    ptr = np.zeros(NG, np.int64)
    cap = G * S
    buf = np.zeros(NG * cap, np.uint16)
    group_base = np.arange(NG, dtype=np.int64) * cap
    for i in range(S - 1, -1, -1):
        f = F[i]
        emit = (x >> (32 - n)) >= f
        e2 = emit.reshape(NG, G)
        cnt = e2.sum(1)
        if cnt.any():
            rank = np.cumsum(e2, 1) - e2
            pos = (group_base + ptr)[:, None] + rank
            buf[pos.ravel()[emit]] = x[emit] & 0xFFFF
            ptr += cnt
            x = np.where(emit, x >> 16, x)
        q = x // f
        x = (q << n) + (x - q * f) + C[i]

    words = buf.reshape(NG, cap)
    streams = np.concatenate([words[g, :ptr[g]] for g in range(NG)]) if NG else np.zeros(0, np.uint16)
    return _assemble(lay, n, lo, W, esc, codes, model, scale, mu16, ptr.astype(np.uint32), group_escapes, escapes,
                     x[:NL][lay.coded_lanes(A)].astype(np.uint32), streams)


def _component_weights(codes, model, scale, mu16, W, esc) -> np.ndarray:
    """Each component's weights: its explicit codes, or its parametric model."""
    explicit = minifloat_decode(codes)
    par = model_weights(np.maximum(model - 1, 0), scale, mu16, W, esc, codes.shape[1])
    return np.where(np.asarray(model)[:, None] > 0, par, explicit)


def _pad_rows(a: np.ndarray, rows: int, fill) -> np.ndarray:
    out = np.full((rows,) + a.shape[1:], fill, a.dtype)
    out[:len(a)] = a
    return out


def _in_coding_order(a: np.ndarray, NG: int, G: int) -> np.ndarray:
    """[S, lanes] -> [groups, S, G] with steps last to first: the order escapes are stored in."""
    S = a.shape[0]
    return a[::-1].reshape(S, NG, G).transpose(1, 0, 2)


def _steps_by_lane(a: np.ndarray, cells, P, S, K, n_lanes_padded, fill) -> np.ndarray:
    """[P*S, K] per-token values -> [S, lanes] (lane g holds cell cells[g] = p*K + k), padded lanes filled."""
    out = np.full((S, n_lanes_padded), fill, a.dtype)
    out[:, :P * K] = a.reshape(P, S, K).transpose(1, 0, 2).reshape(S, P * K)[:, cells]
    return out


def _assemble(lay: Layout, prob_bits, lo, W, esc, codes, model, scale, mu16, group_words, group_escapes, escapes,
              states, streams, checksum_fn=None) -> bytes:
    stream_words = int(group_words.astype(np.int64).sum())
    lo_bytes, w_bytes = _widths(int(lo.min()), int(lo.max()), int(W.max()))
    A = W + esc
    k_coded = int((A > 1).sum())
    explicit = model == 0
    n_table, n_param = int(A[explicit].sum()), int((~explicit).sum())
    lay = Layout(lay.T, lay.K, lay.S, lay.G, n_table, len(escapes), stream_words, k_coded, lo_bytes, w_bytes,
                 n_param, lay.flags)
    meta = bytearray(lay.states - HEADER.size)

    def put(offset, arr):
        raw = np.ascontiguousarray(arr).tobytes()
        meta[offset - HEADER.size: offset - HEADER.size + len(raw)] = raw

    put(lay.lo, lo.astype(_INT[lo_bytes]))
    put(lay.wflag, (W | (esc << (8 * w_bytes - 1))).astype(_UINT[w_bytes]))
    put(lay.model, model.astype(np.uint8))
    put(lay.mu16, mu16[~explicit].astype("<i2"))
    put(lay.scale, scale[~explicit].astype(np.uint8))
    put(lay.codes, np.concatenate([codes[k, :A[k]] for k in range(lay.K) if explicit[k]] + [np.zeros(0, np.uint8)]))
    put(lay.group_words, group_words.astype(np.uint32))
    put(lay.group_escapes, np.asarray(group_escapes, np.uint32))
    put(lay.escapes, np.asarray(escapes, np.int32))
    head = HEADER.pack(MAGIC, VERSION, prob_bits, lay.G, lay.T, lay.K, lay.S, n_table, len(escapes),
                       k_coded, n_param, lo_bytes, w_bytes, lay.flags, stream_words, 0, 0)
    tail = [bytes(meta), memoryview(np.ascontiguousarray(states, "<u4")).cast("B"),
            memoryview(np.ascontiguousarray(streams, "<u2")).cast("B")]  # views: join copies once
    c0, c1 = (checksum_fn or checksum)(head[:CHECKED_HEADER_BYTES], *tail)
    return b"".join([head[:CHECKED_HEADER_BYTES], struct.pack("<II", c0, c1)] + tail)


class Parsed:
    """Header and meta of a payload, validated against the checksum; arrays are numpy."""

    def __init__(self, payload: bytes, max_elements: int | None = None, checksum_fn=None):
        mv = memoryview(payload)
        _parse_header_only(self, bytes(mv[:HEADER.size]), len(mv), max_elements)
        lay, n, K = self.layout, self.prob_bits, self.K
        if (checksum_fn or checksum)(mv[:CHECKED_HEADER_BYTES], mv[HEADER.size:]) != (self.check0, self.check1):
            raise BitstreamError("rANS payload checksum mismatch: the payload is corrupt")
        meta = mv[HEADER.size:lay.states]
        n_table, n_esc, stream_words = self.n_table, self.n_escapes, self.stream_words

        def get(offset, dtype, count):
            o = offset - HEADER.size
            return np.frombuffer(meta, dtype, count, o)

        self.lo = get(lay.lo, _INT[lay.lo_bytes], K).astype(np.int64)
        wflag = get(lay.wflag, _UINT[lay.w_bytes], K).astype(np.int64)
        top = 8 * lay.w_bytes - 1
        self.W, self.esc = wflag & ((1 << top) - 1), wflag >> top
        self.A = self.W + self.esc
        self.model = get(lay.model, "u1", K).astype(np.int64)
        explicit = self.model == 0
        if (self.W < 1).any() or (self.A > max_alphabet(n)).any() or int(self.A[explicit].sum()) != n_table \
                or (self.lo + self.W - 1 > 2**31 - 1).any() or int((self.A > 1).sum()) != lay.k_coded \
                or (self.model > N_SHAPES).any() or int((~explicit).sum()) != lay.n_param:
            raise BitstreamError("rANS payload tables are corrupt (alphabet sizes or models out of range)")
        self.mu16 = np.zeros(K, np.int64)
        self.scale = np.zeros(K, np.int64)
        self.mu16[~explicit] = get(lay.mu16, "<i2", lay.n_param)
        self.scale[~explicit] = get(lay.scale, "u1", lay.n_param)
        self.codes_flat = get(lay.codes, "u1", n_table)
        self.group_words = get(lay.group_words, "<u4", lay.n_groups).astype(np.int64)
        if int(self.group_words.sum()) != stream_words:
            raise BitstreamError("rANS payload group lengths do not add up to its stream length")
        self.group_escapes = get(lay.group_escapes, "<u4", lay.n_groups).astype(np.int64)
        if int(self.group_escapes.sum()) != n_esc:
            raise BitstreamError("rANS payload group escape counts do not add up to its escape count")
        self.escapes = get(lay.escapes, "<i4", n_esc)

    def weights(self) -> np.ndarray:
        """Every component's weights [K, max A]: explicit codes or its parametric model."""
        A, explicit = self.A, self.model == 0
        codes = np.zeros((self.K, int(A.max())), np.uint8)
        mask = (np.arange(codes.shape[1])[None, :] < A[:, None]) & explicit[:, None]
        codes[mask] = self.codes_flat
        return _component_weights(codes, self.model, self.scale, self.mu16, self.W, self.esc)


def parse(payload, max_elements: int | None = None, checksum_fn=None) -> Parsed:
    """Read and validate the header and meta of a payload, checksum included (no decoding).
    checksum_fn: another implementation of `checksum` (the compiled CPU coder's)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidTensorError(f"payload must be bytes, got {type(payload).__name__}")
    return Parsed(payload, max_elements, checksum_fn)


def decode(payload, max_elements: int | None = None) -> np.ndarray:
    """Inverse of encode (and of encode_cuda): payload bytes -> int32 [T, K]. A payload declaring
    more than max_elements values (default schema.DEFAULT_MAX_ELEMENTS) is refused before decoding."""
    if isinstance(payload, np.ndarray):
        payload = payload.tobytes()
    hdr = parse(payload, max_elements)
    lay, n, G, S, K, T = hdr.layout, hdr.prob_bits, hdr.G, hdr.S, hdr.K, hdr.T
    M, P, NL, NG = 1 << n, lay.P, lay.n_lanes, lay.n_groups
    freq, cum = normalize_weights(hdr.weights(), n)
    A1 = freq.shape[1]
    # A virtual component K with one symbol of frequency M: decoding it leaves the state unchanged.
    freq = np.concatenate([freq, np.zeros((1, A1), np.int64)])
    freq[K, 0] = M
    cum = np.concatenate([cum, np.zeros((1, A1), np.int64)])
    lut = np.repeat(np.tile(np.arange(A1, dtype=np.int16), K + 1), freq.ravel())  # [(K+1) * M], A1 <= 2^13
    freq, cum = freq.ravel(), cum.ravel()

    cells = lay.lane_cells()
    mv = memoryview(payload)
    states = np.full(NL, STATE_LOW, np.int64)
    states[lay.coded_lanes(hdr.A)] = np.frombuffer(mv[lay.states:lay.streams], "<u4")
    if (states < STATE_LOW).any():
        raise BitstreamError("rANS payload lane states are corrupt")
    words = np.frombuffer(mv[lay.streams:lay.total], "<u2").astype(np.int64)
    x = np.full(NG * G, STATE_LOW, np.int64)
    x[:NL] = states
    group_start = np.concatenate([[0], np.cumsum(hdr.group_words)[:-1]]).astype(np.int64)
    ptr = hdr.group_words.copy()
    lane_k = np.full(NG * G, K, np.int64)
    lane_k[:NL] = cells % K
    last_len = T - (P - 1) * S
    lane_k_last = lane_k.copy()
    lane_k_last[:NL][cells >= (P - 1) * K] = K  # lanes of the last chunk, past its end
    out = np.empty((S, NG * G), np.int64)
    bad = False
    n_words = max(len(words), 1)
    if len(words) == 0:
        words = np.zeros(1, np.int64)
    for i in range(S):
        comp = lane_k if i < last_len else lane_k_last
        slot = x & (M - 1)
        s = lut[comp * M + slot]
        fc = comp * A1 + s
        x = freq[fc] * (x >> n) + slot - cum[fc]
        out[i] = s
        need = x < STATE_LOW
        n2 = need.reshape(NG, G)
        cnt = n2.sum(1)
        if cnt.any():
            rank = np.cumsum(n2, 1) - n2
            ptr = ptr - cnt
            bad = bad or bool((ptr < 0).any())
            pos = np.clip((group_start + ptr)[:, None] + rank, 0, n_words - 1).ravel()
            x = np.where(need, (x << 16) | words[pos], x)
    if bad or (ptr != 0).any() or (x != STATE_LOW).any():
        raise BitstreamError("rANS payload streams are corrupt (lane states do not return to their start)")
    # the escape symbol of each lane's component (-1: none), per step (the last chunk ends early)
    esc_sym = np.append(np.where(hdr.esc > 0, hdr.W, -1), -1)
    lo_ext = np.append(hdr.lo, 0)
    comp = np.where((np.arange(S) < last_len)[:, None], lane_k[None, :], lane_k_last[None, :])
    is_esc = out == esc_sym[comp]
    flags = _in_coding_order(is_esc, NG, G)
    if (flags.sum((1, 2)) != hdr.group_escapes).any():
        raise BitstreamError("rANS payload escape counts do not match the decoded escape symbols")
    vals = np.zeros(flags.shape, np.int64)
    vals[flags] = hdr.escapes
    vals = vals.transpose(1, 0, 2).reshape(S, NG * G)[::-1]
    vals = np.where(is_esc, vals, out + lo_ext[comp])
    by_cell = np.empty((S, NL), np.int64)
    by_cell[:, cells] = vals[:, :NL]
    return by_cell.reshape(S, P, K).transpose(1, 0, 2).reshape(P * S, K)[:T].astype(np.int32)


def entropy_bound_bytes(symbols) -> float:
    """Per-component memoryless empirical entropy of the symbols, in bytes (no table costs).
    numpy arrays, or torch tensors (computed on their device)."""
    if hasattr(symbols, "detach") and not isinstance(symbols, np.ndarray):
        import torch

        t = symbols.detach()
        if t.dim() != 2 or t.numel() == 0:
            raise InvalidTensorError(f"symbols must be a non-empty 2-D tensor, got shape {tuple(t.shape)}")
        T, K = t.shape
        col_sorted = torch.sort(t, dim=0).values.t().contiguous()
        starts = torch.ones_like(col_sorted, dtype=torch.bool)
        starts[:, 1:] = col_sorted[:, 1:] != col_sorted[:, :-1]
        flat_starts = torch.nonzero(starts.reshape(-1)).reshape(-1)
        counts = torch.diff(flat_starts, append=torch.tensor([K * T], device=t.device)).double()
        return float(-(counts * torch.log2(counts / T)).sum() / 8)
    sym = _validate_symbols(np.asarray(symbols))
    T, K = sym.shape
    col_sorted = np.sort(sym, axis=0).T  # [K, T]
    starts = np.ones((K, T), bool)
    starts[:, 1:] = col_sorted[:, 1:] != col_sorted[:, :-1]
    flat_starts = np.flatnonzero(starts.ravel())
    counts = np.diff(np.append(flat_starts, K * T)).astype(np.float64)
    return float(-(counts * np.log2(counts / T)).sum() / 8)


def _parse_header_only(hdr: "Parsed", head: bytes, total_len: int, max_elements: int | None = None) -> None:
    """The 56-byte header, checked before anything is sized from it (shared by the CPU and GPU
    decoders, so both reject the same payloads): every field in range, T x K within the caller's
    limit max_elements (default schema.DEFAULT_MAX_ELEMENTS), and the sections it implies adding up
    to the payload's length, which bounds K, the lanes, groups, tables, escapes and stream words
    by the bytes received. (T itself is bounded only by the limit: a component of one symbol, or a
    table giving one symbol all of 2^n, codes any number of tokens in no bits.)"""
    max_elements = DEFAULT_MAX_ELEMENTS if max_elements is None else max_elements
    if len(head) < HEADER.size:
        raise BitstreamError(f"rANS payload truncated: {len(head)} bytes, the header alone is {HEADER.size}")
    (magic, version, n, G, T, K, S, n_table, n_esc, k_coded, n_param, lo_bytes, w_bytes, flags, stream_words,
     c0, c1) = HEADER.unpack(head)
    if magic != MAGIC:
        raise BitstreamError(f"not an rANS payload (magic {magic!r}, expected {MAGIC!r}): corrupt or not ours")
    if version != VERSION:
        newer = VERSION < version <= VERSION + 4
        raise BitstreamError(f"rANS payload version {version}; this build reads version {VERSION}"
                             + (": written by a newer build, upgrade the reader" if newer
                                else ": the payload is corrupt or not ours"))
    fields = dict(prob_bits=(n, MIN_PROB_BITS <= n <= MAX_PROB_BITS), group_lanes=(G, 1 <= G <= 1024 and G & (G - 1) == 0),
                  T=(T, T >= 1), K=(K, K >= 1), lane_tokens=(S, 1 <= S <= min(T, MAX_LANE_TOKENS)), flags=(flags, flags & ~LANES_BY_COMPONENT == 0),
                  n_escapes=(n_esc, n_esc <= T * K), k_coded=(k_coded, k_coded <= K), n_param=(n_param, n_param <= K),
                  lo_bytes=(lo_bytes, lo_bytes in (1, 2, 4)), w_bytes=(w_bytes, w_bytes in (1, 2)))
    bad = [f"{name}={value}" for name, (value, ok) in fields.items() if not ok]
    if bad:
        raise BitstreamError(f"rANS payload header is corrupt (out of range: {', '.join(bad)})")
    if T * K > max_elements:
        raise BitstreamError(f"rANS payload declares {T} x {K} = {T * K} values, more than the decode limit "
                             f"max_elements={max_elements}; pass a larger max_elements if this tensor is expected")
    if not table_budget_ok(T, K, n):
        raise BitstreamError(f"rANS payload header is corrupt: K={K} tables of 2^{n} entries for T={T} tokens "
                             f"exceed {TABLE_ENTRIES_PER_VALUE} entries per value and {MAX_TABLE_ENTRIES} in all")
    hdr.prob_bits, hdr.G, hdr.T, hdr.K, hdr.S = n, G, T, K, S
    hdr.n_table, hdr.n_escapes, hdr.stream_words = n_table, n_esc, stream_words
    hdr.check0, hdr.check1 = c0, c1
    hdr.layout = Layout(T, K, S, G, n_table, n_esc, stream_words, k_coded, lo_bytes, w_bytes, n_param, flags)
    if hdr.layout.total != total_len:
        raise BitstreamError(f"rANS payload truncated or its header is corrupt (its sections add up to "
                             f"{hdr.layout.total} bytes, the payload has {total_len})")


def read_header(payload, max_elements: int | None = None, total_len: int | None = None) -> "Parsed":
    """The payload's header fields (T, K, prob_bits, layout...), checked as decoding checks them,
    without the checksum or the tables: what a caller needs to size or refuse a decode.
    total_len: the payload's length when `payload` holds only its first bytes."""
    hdr = Parsed.__new__(Parsed)
    _parse_header_only(hdr, bytes(memoryview(payload)[:HEADER.size]), len(payload) if total_len is None else total_len,
                       max_elements)
    return hdr


# --------------------------------------------------------------------------------------------
# The registry entry: the compute codec codes integer symbol matrices, not frames, so it has no
# frame sessions; TensorCodec(backend="rans") and rans.encode/decode (rans_cuda on a GPU) use it.


def _no_frame_sessions(*_args, **_kwargs):
    from ..errors import ConfigurationError

    raise ConfigurationError("backend 'rans' codes integer symbol matrices, not frames: use TensorCodec(basis, "
                             "backend='rans', step=...) or shared.codecs.rans.encode/decode")


def _gpu_note() -> str | None:
    return None  # the numpy coder runs everywhere; the GPU coder (rans_cuda) needs CUDA and Triton


def _register():
    from .base import Backend, register

    return register(Backend(
        name="rans", kind="symbols", lossless=True,
        description="the compute codec: per-component interleaved rANS on shared-step PCA symbols "
                    "(CPU: numpy; CUDA tensors: Triton kernels, same bitstream)",
        encoder_cls=_no_frame_sessions, decoder_cls=_no_frame_sessions, probe=_gpu_note))


RANS = _register()

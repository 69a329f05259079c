"""Triton kernels of the GPU rANS coder (rans.py holds the format, rans_cuda.py the host code).

Imported only when a GPU coder function is first called, so importing rans.py needs no Triton.
Every integer rule here mirrors the numpy coder (rans.py, rans_tables.py) exactly; tests compare the bytes.
"""
import triton
import triton.language as tl


@triton.jit
def bitlen(v):
    """Bits in v (0 <= v < 2^53; int64): the exponent field of float64(v), which the conversion
    gives exactly below 2^53; a loop over 32 shifts cost ~7 instructions per bit on the GPU."""
    e = (v.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1022
    return tl.where(v > 0, e, 0)

@triton.jit
def mf_encode(v):
    """minifloat_encode() of weights 0 <= v < 2^18, in v's integer type: their bit lengths from the
    exponent of float32(v), exact below 2^24 (bitlen's float64 costs twice the instructions)."""
    e = tl.maximum(tl.where(v > 0, (v.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126, 0) - 4, 2).to(v.dtype)
    q = (v + ((v * 0 + 1) << (e - 2))) >> (e - 1)
    carry = q >= 32
    e = e + carry.to(v.dtype)
    q = tl.where(carry, 16, q)
    return tl.where(v < 32, v, e * 16 + q - 16)

@triton.jit
def mf_decode(c):
    e = c >> 4
    return tl.where(c < 32, c, (16 + (c & 15)) << tl.maximum(e - 1, 0))

@triton.jit
def divisor(d):
    """(m, l) with floor(x / d) = (mulhi(x, m) + x) >> l for every 32-bit x, for int64 0 < d <= 2^30
    (so that 2^(32+l) fits): l = ceil(log2 d), m = ceil(2^(32+l) / d) - 2^32 < 2^32, Granlund and
    Montgomery's round-up method as in recip_entry; one integer division for all the quotients by d."""
    l = bitlen(d - 1)
    # unsigned: every operand is non-negative, and the unsigned 64-bit division is the shorter routine
    m = ((((d * 0 + 1) << (32 + l)) + d - 1).to(tl.uint64) // d.to(tl.uint64)).to(tl.int64) - (1 << 32)
    return m, l


@triton.jit
def divided(x, m, l):
    """floor(x / d) for 0 <= x < 2^32, with (m, l) = divisor(d): a multiply-high, an add and a shift
    where a 32-bit division takes about 20 instructions."""
    xu = x.to(tl.uint32)
    t = tl.umulhi(xu, m.to(tl.uint32))
    return ((t.to(tl.uint64) + xu.to(tl.uint64)) >> l.to(tl.uint64)).to(x.dtype)


@triton.jit
def _quotient(x, d, m, l, PROB_BITS: tl.constexpr):
    """x // d in normalize_row: by (m, l) = divisor(d) where its products fit 32 bits (n <= 11)."""
    if PROB_BITS <= 11:
        return divided(x, m, l)
    else:
        return x // d


@triton.jit
def normalize_row(w, j, PROB_BITS: tl.constexpr):
    """Same integer rule as numpy normalize(); returns (freq, cum, ok), freq and cum int32."""
    M: tl.constexpr = 1 << PROB_BITS
    # every weight is < 2^19 (the largest minifloat weight; model weights are < 2^16) and the
    # bisection's mid <= 2^(n+1): for n <= 11 the products and the sum fit int32, and the quotients by
    # the sum are multiplies by its reciprocal (divisor / divided)
    if PROB_BITS <= 11:
        wn = w.to(tl.int32)
    else:
        wn = w.to(tl.int64)
    total = tl.sum(wn, 0)
    safe = tl.maximum(total, 1)
    if PROB_BITS <= 11:  # total < 2^28 (at most 2^(n-2) weights below 2^19)
        m, l = divisor(safe.to(tl.int64))
    else:
        m = safe * 0
        l = m
    # The largest multiplier s with sum(max(w * s // total, 1)) <= M, as the reference's bisection
    # over [1, 2M) finds it, from a narrower bracket: with nnz weights the sum lies in
    # (s - nnz, s + nnz], so s = M - nnz fits and s = M + nnz does not. log2(2 nnz) steps instead of
    # n + 2 (60 x [1024, 192] on an NVIDIA H200: tables kernel 191 -> 176 us, decoder tables 47 -> 39).
    nnz = tl.sum((wn > 0).to(wn.dtype), 0)
    lo = tl.maximum(M - nnz, 1)
    hi = tl.minimum(M + nnz, 2 * M)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        f = tl.where(wn > 0, tl.maximum(_quotient(wn * mid, safe, m, l, PROB_BITS), 1), 0)
        ok = tl.sum(f, 0) <= M
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    # int32 from here (on one warp an int64 scan or sum takes twice the shuffles): the weights are
    # non-negative, so each w * lo // total <= lo <= 2M, and a row's sums stay below
    # HCAP * 2M = 2^(2n - 1) <= 2^29; wn holds w exactly, so its argmax is w's
    f = tl.where(wn > 0, tl.maximum(_quotient(wn * lo, safe, m, l, PROB_BITS), 1), 0).to(tl.int32)
    top = tl.argmax(wn, 0, tie_break_left=True)
    f = f + tl.where(j == top, M - tl.sum(f, 0), 0)
    good = total > 0
    f = tl.where(good, f, tl.where(j == 0, M, 0))  # a safe table for a corrupt (empty) row
    return f, tl.cumsum(f, 0) - f, good

@triton.jit
def first_window(mn, mx, sm, T, A_MAX: tl.constexpr):
    """initial_windows() of rans_tables.py for int64 (min, max, sum): returns (lo0, h0, centre)."""
    span = mx - mn + 1
    wide = span > A_MAX
    h0 = tl.where(wide, A_MAX - 1, span)
    # floor(sm / T), written so that both operands are non-negative (no signed-division convention):
    # one unsigned division, the shorter routine, where two signed ones were
    q = (tl.where(sm >= 0, sm, T - 1 - sm).to(tl.uint64) // (sm * 0 + T).to(tl.uint64)).to(tl.int64)
    centre = tl.where(sm >= 0, q, -q)
    lo0 = tl.where(wide, tl.maximum(tl.minimum(centre - (A_MAX - 1) // 2, mx - h0 + 1), mn), mn)
    return lo0, h0, centre


RECIP_MAX_PROB_BITS = 14  # recip_entry packs M - f, c and the shift into 32 bits: 14 + 14 + 4


@triton.jit
def recip_entry(f, c, mult_ptr, PROB_BITS: tl.constexpr):
    """An encoder table entry (int64) that codes a symbol of frequency f (0 < f <= 2^n) and
    cumulative frequency c without a division: the high word holds m = ceil(2^(32+l) / f) - 2^32
    with l = ceil(log2 f), so floor(x / f) = (mulhi(x, m) + x) >> l for every 32-bit x (the
    round-up method of Granlund and Montgomery with a 33-bit multiplier); the low word holds
    2^n - f (bits 0-13), c (14-27) and l (28-31). Unused symbols (f = 0) get the identity entry.
    mult_ptr: m for f = 0..2^n (rans_cuda.recip_multipliers), read where a float64 division per
    entry cost ~70 instructions."""
    M: tl.constexpr = 1 << PROB_BITS
    fs = tl.maximum(f, 1)
    # ceil(log2 f) from the exponent of float(f - 1), exact below 2^24 (float32: 16 instructions a
    # component fewer than bitlen's float64 here)
    l = tl.maximum(((fs - 1).to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126, 0)
    m = tl.load(mult_ptr + fs).to(tl.int64)
    # the low word built unsigned 32-bit (0 <= f <= 2^n, 0 <= c <= 2^n: no field reaches bit 32) and
    # zero-extended, where int64 operations took two instructions each
    fu = f.to(tl.uint32)
    low = tl.where(f > 0, (M - fu) | (c.to(tl.uint32) << 14) | (l.to(tl.uint32) << 28), PROB_BITS << 28)
    return tl.where(f > 0, m, 0) << 32 | low.to(tl.int64)


@triton.jit
def recip_step(x, e, PROB_BITS: tl.constexpr):
    """One encoder step with a recip_entry e: renormalize (whether x emits its low 16 bits), then
    x' = floor(x / f) * 2^n + x mod f + c, written x + c + floor(x / f) * (2^n - f)."""
    M: tl.constexpr = 1 << PROB_BITS
    low = e.to(tl.uint32)
    cf = low & 0x3FFF
    emit = ((x >> (32 - PROB_BITS)) + cf) >= M
    xs = tl.where(emit, x >> 16, x)
    t = tl.umulhi(xs, (e >> 32).to(tl.uint32))
    q = ((t.to(tl.uint64) + xs.to(tl.uint64)) >> (low >> 28).to(tl.uint64)).to(tl.uint32)
    return emit, xs + ((low >> 14) & 0x3FFF) + q * cf


@triton.jit
def _packed_bin(acc, q, one, Q: tl.constexpr):
    return acc + tl.where(q == Q, one, 0)


@triton.jit
def _flush_bins(acc, counts_ptr, row_ptr, c0, ok, FIRST: tl.constexpr):
    """The four 8-bit counters packed in acc ([components, rows]), summed over the rows, added to
    bins c0 + FIRST .. c0 + FIRST + 3 of each component's histogram row. Two sums instead of four:
    bytes 0 and 2, then 1 and 3, each widened to 16 bits (a program's rows x HS <= 65535)."""
    even = tl.sum(acc & 0x00FF00FF, 1)
    odd = tl.sum((acc >> 8) & 0x00FF00FF, 1)
    at = counts_ptr + row_ptr + c0 + FIRST
    for b in tl.static_range(2):
        n = (even >> (16 * b)) & 0xFFFF
        tl.atomic_add(at + 2 * b, n, mask=ok & (n > 0), sem="relaxed")
        n = (odd >> (16 * b)) & 0xFFFF
        tl.atomic_add(at + 2 * b + 1, n, mask=ok & (n > 0), sem="relaxed")


@triton.jit
def _sampled_load(sym_ptr, chunk, i, n_sampled, R, K, k, k_ok, HS: tl.constexpr, WIDE_INDEX: tl.constexpr):
    """Row i of each of the program's row chunks, its KB components: ([KB, CHUNKS] values, where valid)."""
    sampled = chunk * HS + i
    active = k_ok[:, None] & (sampled < n_sampled)[None, :]
    row = sampled * R
    if WIDE_INDEX:
        off = row.to(tl.int64)[None, :] * K + k[:, None]
    else:
        off = row[None, :] * K + k[:, None]
    return tl.load(sym_ptr + off, mask=active, other=0), active


@triton.jit
def _count_sampled(v, active, lo0, h0, h0_32, c0, counts_ptr, row_ptr, a0, a1, a2, a3, a4, a5, a6, a7,
                   NARROW: tl.constexpr):
    """One [KB, CHUNKS] tile of sampled values counted: the 32 packed bins in a0..a7, other in-window
    hits by a relaxed global atomic each."""
    if NARROW:
        idx = v.to(tl.int32) - lo0.to(tl.int32)[:, None]
        inw = active & (idx >= 0) & (idx < h0_32[:, None])
    else:
        idx64 = v.to(tl.int64) - lo0[:, None]
        inw = active & (idx64 >= 0) & (idx64 < h0[:, None])
        idx = tl.where(inw, idx64, 0).to(tl.int32)
    d = idx - c0[:, None]
    packed = inw & (d >= 0) & (d < 32)
    one = tl.where(packed, 1 << ((d & 3) * 8), 0)
    q = d >> 2
    a0 = _packed_bin(a0, q, one, 0)
    a1 = _packed_bin(a1, q, one, 1)
    a2 = _packed_bin(a2, q, one, 2)
    a3 = _packed_bin(a3, q, one, 3)
    a4 = _packed_bin(a4, q, one, 4)
    a5 = _packed_bin(a5, q, one, 5)
    a6 = _packed_bin(a6, q, one, 6)
    a7 = _packed_bin(a7, q, one, 7)
    tail = inw & ~packed
    tl.atomic_add(counts_ptr + row_ptr[:, None] + tl.where(tail, idx, 0), 1, mask=tail, sem="relaxed")
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def hist_kernel(sym_ptr, mn_ptr, mx_ptr, sm_ptr, counts_ptr, T, K, n_sampled, R,
                HS: tl.constexpr, CHUNKS: tl.constexpr, KB: tl.constexpr, HCAP: tl.constexpr,
                WIDE_INDEX: tl.constexpr, NARROW: tl.constexpr, AHEAD: tl.constexpr = 1):
    """Per-component histograms of the sampled rows (every R-th token) inside the first windows.
    A program takes CHUNKS x HS sampled rows of KB components, a [KB, CHUNKS] tile a step. The 32
    bins around the component's mean (99% of the hits on a real K at cos 0.999, 81% for 8) are 8-bit
    counters packed four to an int32 register (HS <= 255), summed over the program's rows before one
    atomic per bin and component; the other in-window hits get a global atomic each, relaxed (counts
    need no ordering). NARROW: int16 symbols, whose offsets fit int32. [components, rows] tiles keep
    the loop in one layout (no barriers). The rows are a loop, not unrolled: unrolled rows took over a
    minute to compile for sm_90, once per specialization at a user's first call, and ran no faster
    (measurements in docs/findings.md).
    AHEAD (1, 2 or 4; divides HS): a step of the loop loads AHEAD rows before counting any, so that
    their loads are in flight together; with one, each step waits a full memory latency for its row
    (the program's rows are R x K apart: no two share a cache line)."""
    tl.static_assert(HS <= 255 and CHUNKS * HS <= 65535)  # the packed counters, their 16-bit sums
    tl.static_assert((AHEAD == 1 or AHEAD == 2 or AHEAD == 4) and HS % AHEAD == 0)
    s = tl.program_id(1).to(tl.int64)  # the tensor of a batch of same-shape tensors
    n_kb = tl.cdiv(K, KB)
    rb = tl.program_id(0) // n_kb
    k = (tl.program_id(0) % n_kb) * KB + tl.arange(0, KB)
    sym_ptr += s * T * K
    counts_ptr += s * K * HCAP
    k_ok = k < K
    mn = tl.load(mn_ptr + s * K + k, mask=k_ok, other=0).to(tl.int64)
    mx = tl.load(mx_ptr + s * K + k, mask=k_ok, other=0).to(tl.int64)
    sm = tl.load(sm_ptr + s * K + k, mask=k_ok, other=0).to(tl.int64)
    lo0, h0, centre = first_window(mn, mx, sm, T, HCAP)
    c0 = (centre - lo0 - 15).to(tl.int32)  # first of the 32 packed bins
    h0_32 = h0.to(tl.int32)
    row_ptr = k.to(tl.int64) * HCAP
    chunk = rb * CHUNKS + tl.arange(0, CHUNKS)
    # [components, rows] tiles: the loads' pointers are contiguous along dim 0, and the tail atomics'
    # along none, so Triton gives both the same layout; as [rows, components] the loads took one with
    # dim 1 fastest and the atomics another, and each value crossed between them through shared memory
    # (4 block barriers a sampled value on sm_90)
    a0 = tl.zeros([KB, CHUNKS], tl.int32)
    a1 = tl.zeros([KB, CHUNKS], tl.int32)
    a2 = tl.zeros([KB, CHUNKS], tl.int32)
    a3 = tl.zeros([KB, CHUNKS], tl.int32)
    a4 = tl.zeros([KB, CHUNKS], tl.int32)
    a5 = tl.zeros([KB, CHUNKS], tl.int32)
    a6 = tl.zeros([KB, CHUNKS], tl.int32)
    a7 = tl.zeros([KB, CHUNKS], tl.int32)
    for i in range(0, HS, AHEAD):
        v0, ok0 = _sampled_load(sym_ptr, chunk, i, n_sampled, R, K, k, k_ok, HS, WIDE_INDEX)
        if AHEAD >= 2:
            v1, ok1 = _sampled_load(sym_ptr, chunk, i + 1, n_sampled, R, K, k, k_ok, HS, WIDE_INDEX)
        if AHEAD == 4:
            v2, ok2 = _sampled_load(sym_ptr, chunk, i + 2, n_sampled, R, K, k, k_ok, HS, WIDE_INDEX)
            v3, ok3 = _sampled_load(sym_ptr, chunk, i + 3, n_sampled, R, K, k, k_ok, HS, WIDE_INDEX)
        a0, a1, a2, a3, a4, a5, a6, a7 = _count_sampled(v0, ok0, lo0, h0, h0_32, c0, counts_ptr, row_ptr,
                                                        a0, a1, a2, a3, a4, a5, a6, a7, NARROW)
        if AHEAD >= 2:
            a0, a1, a2, a3, a4, a5, a6, a7 = _count_sampled(v1, ok1, lo0, h0, h0_32, c0, counts_ptr, row_ptr,
                                                            a0, a1, a2, a3, a4, a5, a6, a7, NARROW)
        if AHEAD == 4:
            a0, a1, a2, a3, a4, a5, a6, a7 = _count_sampled(v2, ok2, lo0, h0, h0_32, c0, counts_ptr, row_ptr,
                                                            a0, a1, a2, a3, a4, a5, a6, a7, NARROW)
            a0, a1, a2, a3, a4, a5, a6, a7 = _count_sampled(v3, ok3, lo0, h0, h0_32, c0, counts_ptr, row_ptr,
                                                            a0, a1, a2, a3, a4, a5, a6, a7, NARROW)
    c0_64 = c0.to(tl.int64)
    _flush_bins(a0, counts_ptr, row_ptr, c0_64, k_ok, 0)
    _flush_bins(a1, counts_ptr, row_ptr, c0_64, k_ok, 4)
    _flush_bins(a2, counts_ptr, row_ptr, c0_64, k_ok, 8)
    _flush_bins(a3, counts_ptr, row_ptr, c0_64, k_ok, 12)
    _flush_bins(a4, counts_ptr, row_ptr, c0_64, k_ok, 16)
    _flush_bins(a5, counts_ptr, row_ptr, c0_64, k_ok, 20)
    _flush_bins(a6, counts_ptr, row_ptr, c0_64, k_ok, 24)
    _flush_bins(a7, counts_ptr, row_ptr, c0_64, k_ok, 28)


# the encoder's scalar summary: one int64 slot per field, read by the host in its one synchronization
SUMMARY_FIELDS = ("n_table", "k_coded", "w_max", "lo_min", "lo_max", "stream_words", "n_escapes", "overflow",
                  "group_escapes_max", "n_param")
(SCAL_N_TABLE, SCAL_K_CODED, SCAL_W_MAX, SCAL_LO_MIN, SCAL_LO_MAX, SCAL_WORDS, SCAL_ESCAPES,
 SCAL_OVERFLOW, SCAL_GROUP_ESC_MAX, SCAL_N_PARAM) = (tl.constexpr(i) for i in range(len(SUMMARY_FIELDS)))
SCAL_SLOTS = tl.constexpr(len(SUMMARY_FIELDS))


# A decoder's segment table: one row of int64 fields per payload of a batch, all payloads in one
# byte buffer; "_el" fields are element offsets into the buffer viewed in that section's dtype.
SEG_FIELDS = ("base", "len", "lo_el", "wflag_el", "model", "mu16_el", "scale", "codes", "check_el", "gw_el",
              "ge_el", "esc_el", "states_el", "streams_el", "n_table", "k_coded", "n_param", "n_words", "n_esc",
              "lo_bytes", "w_bytes")
(SEG_BASE, SEG_LEN, SEG_LO, SEG_WFLAG, SEG_MODEL, SEG_MU16, SEG_SCALE, SEG_CODES, SEG_CHECK, SEG_GW, SEG_GE,
 SEG_ESC, SEG_STATES, SEG_STREAMS, SEG_N_TABLE, SEG_K_CODED, SEG_N_PARAM, SEG_N_WORDS, SEG_N_ESC, SEG_LO_BYTES,
 SEG_W_BYTES) = (tl.constexpr(i) for i in range(len(SEG_FIELDS)))


@triton.jit
def model_row(shapes_ptr, inv_ptr, shape, code, mu16, W, has_esc, j, SHAPE_STEPS: tl.constexpr):
    """rans_tables.model_weights() for one component: the parametric weights (int32, < 2^16) of its
    HCAP symbols. |16 j - mu16| < 2^18 (j < HCAP <= 2^13; mu16 an int16, or a mean below 16 HCAP) and
    the inverse sigmas are <= 2^28, so the step index min(product >> 24, SHAPE_STEPS - 1) comes from
    one 32 x 32-bit product, its high word (>= 4: the product is >= 2^34, past every step) and its low
    word, where int64 arithmetic took 2-3 instructions an operation."""
    tl.static_assert(SHAPE_STEPS <= 1024)
    inv = tl.load(inv_ptr + code).to(tl.uint32)
    x = tl.abs(16 * j - mu16).to(tl.uint32)
    hi = tl.umulhi(x, inv)
    idx = tl.where(hi >= 4, SHAPE_STEPS - 1, tl.minimum((hi << 8) | ((x * inv) >> 24), SHAPE_STEPS - 1))
    w = tl.maximum(tl.load(shapes_ptr + shape * SHAPE_STEPS + idx).to(tl.int32), 1)
    return tl.where(j < W, w, tl.where((j == W) & has_esc, 1, 0))


@triton.jit
def _proxy_cost(wp, wsum, kept_ptr, jc, n, nlog_ptr, PROB_BITS: tl.constexpr, COSTS32: tl.constexpr):
    """fit_models()' cost proxy of one chunk of symbols for a block of candidate models: their weights wp
    ([candidates, chunk], int32 model_row weights) normalized by the sums wsum without the table's rule,
    against the chunk's counts (the first n of kept_ptr's). COSTS32: see tables_kernel."""
    if PROB_BITS <= 11:  # model weights are < 2^16, so the proxy's products fit int32; unsigned: no signs to fix
        q = (wp * (1 << PROB_BITS)).to(tl.uint32) // wsum.to(tl.uint32)[:, None]
        fp = tl.where(wp > 0, tl.maximum(q.to(tl.int32), 1), 0)
    else:
        fp = tl.where(wp > 0, tl.maximum(wp.to(tl.int64) * (1 << PROB_BITS) // wsum[:, None], 1), 0)
    kc = tl.load(kept_ptr + jc, mask=jc < n, other=0)
    if COSTS32:  # where kc = 0, nlog's 2^40 (f = 0) is multiplied by 0 whatever its truncation
        return tl.sum(kc.to(tl.int32)[None, :] * tl.load(nlog_ptr + fp).to(tl.int32), 1)
    else:
        return tl.sum(kc.to(tl.int64)[None, :] * tl.load(nlog_ptr + fp), 1)


@triton.jit
def tables_kernel(counts_ptr, mn_ptr, mx_ptr, sm_ptr, guard_ptr, lo_ptr, w_ptr, a_ptr, codes_ptr, tab_ptr,
                  model_ptr, scale_ptr, mu16_ptr, shapes_ptr, inv_ptr, sig2_ptr, nlog_ptr, recip_ptr,
                  scal_ptr, T, R, n_sampled, HCAP: tl.constexpr, PROB_BITS: tl.constexpr,
                  ESC_COST: tl.constexpr, ENTRY_COST: tl.constexpr, HAS_GUARD: tl.constexpr,
                  N_SHAPES: tl.constexpr, SEARCH: tl.constexpr, SHAPE_STEPS: tl.constexpr,
                  PARAM_BYTES: tl.constexpr, MIN_SHARE: tl.constexpr, TRY_BLOCK: tl.constexpr,
                  CHUNK: tl.constexpr, NARROW: tl.constexpr = False, RECIP: tl.constexpr = False,
                  COUNTS32: tl.constexpr = False, COSTS32: tl.constexpr = False):
    """choose_tables() and fit_models() of rans_tables.py for one component, then its rANS table (RECIP:
    int64 entries of recip_entry, whose multipliers recip holds, for the encoder's division-free step;
    else int32 c << 16 | f); sums,
    counts and extremes of the results go to the scalar summary. guard (optional): a float the
    producer wants checked below 2^31 (the fused quantizer's largest |value|; NaN fails too).
    NARROW: the symbols are int16 stored from int32 values whose min and max these are; a
    component beyond int16 (stored wrapped) sets overflow 3, and the caller codes it again
    from int32 symbols. Bit lengths from float64 exponents, the reciprocals' multipliers from a
    table, one pass per model candidate over a one-chunk alphabet and the normalization's quotients
    by multiply-high; counts, scans and bit costs in int32 where COUNTS32 / COSTS32 say they fit
    (fewer instructions). Each of these made the kernel faster (measurements in docs/findings.md)."""
    k = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)  # the tensor of a batch of same-shape tensors
    nk = tl.num_programs(0).to(tl.int64)
    counts_ptr += s * nk * HCAP
    codes_ptr += s * nk * HCAP
    tab_ptr += s * nk * HCAP
    mn_ptr += s * nk
    mx_ptr += s * nk
    sm_ptr += s * nk
    lo_ptr += s * nk
    w_ptr += s * nk
    a_ptr += s * nk
    model_ptr += s * nk
    scale_ptr += s * nk
    mu16_ptr += s * nk
    guard_ptr += s
    scal_ptr += s * SCAL_SLOTS
    j = tl.arange(0, HCAP)
    j64 = j.to(tl.int64)
    mn = tl.load(mn_ptr + k).to(tl.int64)
    mx = tl.load(mx_ptr + k).to(tl.int64)
    sm = tl.load(sm_ptr + k).to(tl.int64)
    lo0, h0, centre = first_window(mn, mx, sm, T, HCAP)
    # COUNTS32 (set by the host where ESC_COST * R * (n_sampled + HCAP) + ENTRY_COST * HCAP < 2^31 - 1):
    # the counts, their sums and scans and the trimming costs in int32, where one warp's int64 scan,
    # sum or argmin takes twice the shuffles. The histogram counts each sampled value at most once,
    # so sum(raw) <= n_sampled, every count, n_in, scan and n_esc is <= n_sampled + HCAP, and every
    # trimming cost lies in [-HCAP, ESC_COST * R * (n_sampled + HCAP) + ENTRY_COST * HCAP], below the
    # int32 sentinel that stands for the int64 one (argmin's ties are the same)
    if COUNTS32:
        raw = tl.load(counts_ptr + k * HCAP + j)
        big = tl.full([HCAP], 2147483647, tl.int32)
    else:
        raw = tl.load(counts_ptr + k * HCAP + j).to(tl.int64)
        big = tl.full([HCAP], 1 << 62, tl.int64)
    jw = j.to(raw.dtype)
    h0_32 = h0.to(tl.int32)  # <= HCAP
    outside0 = n_sampled - tl.sum(raw, 0)
    cnt = tl.where((j < h0_32) & (R > 1), raw + 1, raw)  # a sampled histogram counts each value at least once
    n_in = tl.sum(cnt, 0)
    mode = tl.argmax(cnt, 0, tie_break_left=True)
    incl = tl.cumsum(cnt, 0)
    left_out = incl - cnt
    right_out = n_in - incl
    cost_l = tl.where(j <= mode, ESC_COST * R * left_out - ENTRY_COST * jw, big)
    a = tl.argmin(cost_l, 0, tie_break_left=True)
    cost_r = tl.where((j >= mode) & (j < h0_32), ENTRY_COST * jw + ESC_COST * R * right_out, big)
    b = tl.argmin(cost_r, 0, tie_break_left=True)
    n_esc = outside0 + tl.sum(tl.where(j == a, left_out, 0), 0) + tl.sum(tl.where(j == b, right_out, 0), 0)
    W32 = b - a + 1  # <= HCAP
    W = W32.to(tl.int64)
    lo = lo0 + a
    has_esc = (lo > mn) | (lo + W - 1 < mx)
    kept = tl.load(counts_ptr + k * HCAP + a + j, mask=j < W32, other=0).to(raw.dtype)
    kept = tl.where((j < W32) & (R > 1), kept + 1, kept)
    kept = tl.where((j == W32) & has_esc, tl.maximum(n_esc, 1), kept)
    shift = tl.maximum(bitlen(tl.max(kept, 0)) - 18, 0).to(kept.dtype)
    wts = tl.where(kept > 0, tl.maximum(kept >> shift, 1), 0)
    code = mf_encode(wts)
    f, c, good = normalize_row(mf_decode(code), j, PROB_BITS)
    A = W + has_esc.to(tl.int64)
    # fit_models(): the parametric model that codes the counts in the fewest bits, if it beats the table.
    # COSTS32 (set by the host where (n_sampled + HCAP + 1) * 65536 * PROB_BITS < 2^31, and only with
    # COUNTS32): kept sums to at most n_sampled + HCAP + 1 (the window's counts, those trimmed off
    # and those outside it are the sample's, plus at most HCAP ones for values it missed, plus the
    # escape's 1), each of its symbols costs at most nlog[1] = 65536 n (f >= 1 wherever kept > 0), and
    # 16 j < 65536 n: the costs' sums (table and proxy) and the mean's sum fit int32
    tl.static_assert(COUNTS32 or not COSTS32)
    inside = tl.where(j < W32, kept, 0)
    if COSTS32:
        best = tl.sum(kept * tl.load(nlog_ptr + f).to(tl.int32), 0).to(tl.int64) * R + 8 * 65536 * A
        n_in_w = tl.maximum(tl.sum(inside, 0), 1)
        mu16 = (tl.sum(inside * 16 * j, 0) // n_in_w).to(tl.int64)
    else:
        best = tl.sum(kept.to(tl.int64) * tl.load(nlog_ptr + f), 0) * R + 8 * 65536 * A
        n_in_w = tl.maximum(tl.sum(inside.to(tl.int64), 0), 1)
        mu16 = tl.sum(inside.to(tl.int64) * 16 * j64, 0) // n_in_w
    var16 = tl.sum(inside.to(tl.int64) * (16 * j64 - mu16) * (16 * j64 - mu16), 0)
    var16 = (var16.to(tl.uint64) // n_in_w.to(tl.uint64)).to(tl.int64)  # both >= 0: unsigned, the shorter routine
    mu16_32 = mu16.to(tl.int32)  # a mean index below HCAP, times 16
    c256 = tl.arange(0, 256)
    code0 = tl.sum((tl.load(sig2_ptr + c256) < var16).to(tl.int32), 0)
    model = best * 0
    best_code = best * 0
    # searched only where a model can pay, and where its mean fits the stored int16 (as rans_tables.fit_models)
    n_try = tl.where((MIN_SHARE * 8 * 65536 * A >= best) & (mu16 <= 32767), N_SHAPES * (2 * SEARCH + 1), 0)
    # The candidates (shape, scale code) in fit_models' order, TRY_BLOCK at a time, over the A
    # symbols only (CHUNK at a time; weights past A are 0): the first of the cheapest below the
    # running best wins, as in the reference's one-by-one search. kept is read back from this
    # component's table row, used as scratch until the table is written.
    if n_try > 0:
        tl.store(tab_ptr + k * HCAP + j, kept.to(tab_ptr.dtype.element_ty))
        tl.debug_barrier()
    tb = tl.arange(0, TRY_BLOCK)
    jc = tl.arange(0, CHUNK)
    kept_row = tab_ptr + k * HCAP
    # the model weights are < 2^16, so a candidate's sum over at most HCAP <= 2^13 symbols fits int32
    for t0 in range(0, n_try, TRY_BLOCK):
        t = t0 + tb
        shape = tl.minimum(t // (2 * SEARCH + 1), N_SHAPES - 1)
        scode = tl.minimum(tl.maximum(code0 + (t % (2 * SEARCH + 1)) - SEARCH, 0), 255)
        if A <= CHUNK:  # the whole alphabet in one chunk: its weights are made once, not once a pass
            wp = model_row(shapes_ptr, inv_ptr, shape[:, None], scode[:, None], mu16_32, W32, has_esc,
                           jc[None, :], SHAPE_STEPS)
            cost = _proxy_cost(wp, tl.sum(wp, 1), kept_row, jc, A, nlog_ptr, PROB_BITS, COSTS32)
        else:
            wsum = tl.zeros([TRY_BLOCK], tl.int32)
            for j0 in range(0, A, CHUNK):
                jj = (j0 + jc)[None, :]
                wsum += tl.sum(model_row(shapes_ptr, inv_ptr, shape[:, None], scode[:, None], mu16_32, W32, has_esc,
                                         jj, SHAPE_STEPS), 1)
            cost = tl.zeros([TRY_BLOCK], tl.int32 if COSTS32 else tl.int64)
            for j0 in range(0, A, CHUNK):
                wp = model_row(shapes_ptr, inv_ptr, shape[:, None], scode[:, None], mu16_32, W32, has_esc,
                               (j0 + jc)[None, :], SHAPE_STEPS)
                cost += _proxy_cost(wp, wsum, kept_row + j0, jc, A - j0, nlog_ptr, PROB_BITS, COSTS32)
        # a model's bits, cost * R + 8 * 65536 * PARAM_BYTES, increase strictly with its proxy cost (R >= 1), so
        # the proxy's first minimum is theirs; its sentinel exceeds every proxy cost (see COSTS32), and
        # the block's first candidate t0 < n_try always counts
        cost = tl.where(t < n_try, cost, 2147483647 if COSTS32 else 1 << 62)
        c_min = tl.min(cost, 0).to(tl.int64) * R + 8 * 65536 * PARAM_BYTES
        i = tl.argmin(cost, 0, tie_break_left=True)
        better = c_min < best
        best = tl.where(better, c_min, best)
        model = tl.where(better, 1 + tl.sum(tl.where(tb == i, shape, 0), 0), model)
        best_code = tl.where(better, tl.sum(tl.where(tb == i, scode, 0), 0), best_code)
    if n_try > 0:
        tl.debug_barrier()  # every read of the scratch row is done before the table overwrites it
    if model > 0:  # the chosen model's exact table
        fm, cm, okm = normalize_row(model_row(shapes_ptr, inv_ptr, model - 1, best_code, mu16_32, W32, has_esc, j,
                                              SHAPE_STEPS), j, PROB_BITS)
        f = fm
        c = cm
    tl.store(codes_ptr + k * HCAP + j, code.to(tl.uint8))
    if RECIP:
        tl.store(tab_ptr + k * HCAP + j, recip_entry(f, c, recip_ptr, PROB_BITS))
    else:
        tl.store(tab_ptr + k * HCAP + j, ((c << 16) | f).to(tl.int32))
    tl.store(lo_ptr + k, lo)
    tl.store(w_ptr + k, W)
    tl.store(a_ptr + k, A)
    tl.store(model_ptr + k, model)
    tl.store(scale_ptr + k, best_code)
    tl.store(mu16_ptr + k, tl.where(model > 0, mu16, 0))
    tl.atomic_add(scal_ptr + SCAL_N_TABLE, tl.where(model > 0, 0, A))
    tl.atomic_add(scal_ptr + SCAL_N_PARAM, (model > 0).to(tl.int64))
    tl.atomic_add(scal_ptr + SCAL_K_CODED, (A > 1).to(tl.int64))
    tl.atomic_max(scal_ptr + SCAL_W_MAX, W)
    tl.atomic_min(scal_ptr + SCAL_LO_MIN, lo)
    tl.atomic_max(scal_ptr + SCAL_LO_MAX, lo)
    if HAS_GUARD:
        fits_int32 = tl.load(guard_ptr) < 2147483520.0  # False for NaN too
        tl.atomic_max(scal_ptr + SCAL_OVERFLOW, (~fits_int32).to(tl.int64), mask=k == 0)
    else:
        fits_int32 = True
    if NARROW:  # not for a tensor the guard refuses (NaN/Inf): that is an error, not a reason for int32
        tl.atomic_max(scal_ptr + SCAL_OVERFLOW,
                      tl.where(((mn < -32768) | (mx > 32767)) & fits_int32, 3, 0).to(tl.int64))


@triton.jit
def table_index(v, lo, hi, W):
    """A value's symbol in its component's table: v - lo inside the window [lo, hi], else the escape W."""
    return tl.where((v < lo) | (v > hi), W, v - lo)


STREAM_PREFETCH_GROUPS = tl.constexpr(3)  # decode_kernel: lane groups' word windows prefetched this many windows below the reader


@triton.jit
def prefetch_l2(ptrs, mask):
    """Asks for the lines at ptrs to be brought into L2 (PTX prefetch: no register waits on it)."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        constraints="=r,l,r", args=[ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_in_place(ptrs, mask=None, U16: tl.constexpr = False):
    """tl.load of the 32-bit words (U16: the 16-bit words, zero-extended) at ptrs, 0 where mask is 0, as
    inline PTX, which the compiler leaves in its operands' layout: a tl.load of a gather may be given
    another layout (in a tiled decode it was given the store's, and the lanes' work moved there with it,
    a shared-memory round trip at each step)."""
    # one return at the end: Triton compiles every static branch after an early return too
    if mask is None:
        value = tl.inline_asm_elementwise(asm="ld.global.b32 $0, [$1];", constraints="=r,l", args=[ptrs],
                                          dtype=tl.int32, is_pure=True, pack=1)
    elif U16:
        value = tl.inline_asm_elementwise(
            asm="{ .reg .pred p; .reg .b16 h; setp.ne.b32 p, $2, 0; mov.b16 h, 0; @p ld.global.b16 h, [$1]; cvt.u32.u16 $0, h; }",
            constraints="=r,l,r", args=[ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1)
    else:
        value = tl.inline_asm_elementwise(
            asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.b32 $0, [$1]; }",
            constraints="=r,l,r", args=[ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1)
    return value


@triton.jit
def word_window(words_ptr, base, ptr, jg, G: tl.constexpr, last_word, mask, IN_PLACE: tl.constexpr = False):
    """The G words of each lane group's stream just below its read position ptr ([GPP, G], the
    group's position in each of its lanes; base [GPP]). IN_PLACE: read by load_in_place."""
    wp = tl.minimum(tl.maximum(base[:, None] + (ptr - G + jg), 0), last_word)
    if IN_PLACE:
        return load_in_place(words_ptr + wp, tl.broadcast_to(mask, wp.shape), U16=True)
    return tl.load(words_ptr + wp, mask=mask, other=0).to(tl.int32) & 0xFFFF


@triton.jit
def group_lanes(grp, K, P, n_lanes, G: tl.constexpr, BY_COMPONENT: tl.constexpr):
    """The lanes of lane groups grp [GPP], as [GPP, G]: their numbers, whether they exist, and each one's
    token block p and component k (lane = p * K + k: a group's lanes are consecutive components; or
    BY_COMPONENT, lane = k * P + p: consecutive token blocks of one component, whose one table a warp
    then reads from L1)."""
    lane = grp[:, None] * G + tl.arange(0, G)[None, :]
    if BY_COMPONENT:
        k = lane // P
        return lane, lane < n_lanes, lane - k * P, k
    else:
        p = lane // K
        return lane, lane < n_lanes, p, lane - p * K


@triton.jit
def lanes_before(flag, jg, VOTE: tl.constexpr):
    """For 0/1 int32 flags [GPP, G] of lane groups: how many lanes before each one in its group are
    flagged (an exclusive prefix count, the rank at which a lane writes or reads a shared stream),
    how many in its whole group (in every lane: the kernels keep a group's stream position in
    each of its lanes, so no step reduces across the warp), and 1 where those counts cannot be
    trusted. VOTE (G = 32, one group per warp): one warp vote and two population counts, where
    Triton's scan and sum take five shuffle rounds each (faster lanes kernels: docs/findings.md);
    it holds only while element j of the group sits on
    lane j of the warp, which every call checks (the third result)."""
    if VOTE:
        rank, count, wrong = tl.inline_asm_elementwise(
            asm="""{ .reg .pred p, q; .reg .b32 b, m, l;
            setp.ne.b32 p, $3, 0; vote.sync.ballot.b32 b, p, 0xffffffff; popc.b32 $1, b;
            mov.u32 m, %lanemask_lt; and.b32 b, b, m; popc.b32 $0, b;
            mov.u32 l, %laneid; setp.ne.u32 q, l, $4; selp.u32 $2, 1, 0, q; }""",
            constraints="=r,=r,=r,r,r", args=[flag, jg], dtype=(tl.int32, tl.int32, tl.int32), is_pure=True,
            pack=1)
    else:
        rank = tl.cumsum(flag, 1) - flag
        count = tl.sum(flag, 1)[:, None] + tl.zeros_like(flag)
        wrong = tl.zeros_like(flag)
    return rank, count, wrong


ENCODE_UNROLL = 8  # encode_kernel's steps a loop iteration (its software pipeline's depth)


@triton.jit
def _symbol_at(sym_ptr, off, top, j, T, S, K, lane_ok):
    """The symbol of step j (row top - j), 0 for a step past the lane's end or a row past T."""
    return tl.load(sym_ptr + (off - j * K), mask=lane_ok & (top - j < T) & (j < S), other=0).to(tl.int32)


@triton.jit
def _entry_at(tab_row, v, lo, hi, W, top, j, T, S, lane_ok, IDENTITY: tl.constexpr):
    """The table entry of step j's symbol v; the identity entry for a step that codes nothing."""
    return tl.load(tab_row + table_index(v, lo, hi, W), mask=lane_ok & (top - j < T) & (j < S), other=IDENTITY)


@triton.jit
def _encode_step(x, ptr, eptr, wrong, v, e, v_ahead, j, sym_ptr, off, tab_row, lo, hi, W, top, T, S, K, lane_ok,
                 out_row, esc_row, ecap, jg, may_escape, PROB_BITS: tl.constexpr, VOTE: tl.constexpr,
                 RECIP: tl.constexpr, IDENTITY: tl.constexpr):
    """Step j of encode_kernel's lanes: codes symbol v with entry e, then loads the entry of step
    j + 4 (its symbol v_ahead) and the symbol of step j + 8, into the slots v and e just freed."""
    active = lane_ok & (top - j < T) & (j < S)
    if may_escape:
        esc_now = active & ((v < lo) | (v > hi))
        ee = esc_now.to(tl.int32)
        erank, ecount, ewrong = lanes_before(ee, jg, VOTE)
        wrong |= ewrong
        epos = eptr + erank
        tl.store(esc_row + epos, v, mask=esc_now & (epos < ecap))
        eptr += ecount
    if RECIP:
        emit, x_next = recip_step(x, e, PROB_BITS)
    else:
        f = (e & 0xFFFF).to(tl.uint32)
        c = (e >> 16).to(tl.uint32)
        emit = (x >> (32 - PROB_BITS)) >= f
        xs = tl.where(emit, x >> 16, x)
        q = xs // f
        x_next = (q << PROB_BITS) + (xs - q * f) + c
    em = emit.to(tl.int32)
    rank, count, rwrong = lanes_before(em, jg, VOTE)
    wrong |= rwrong
    tl.store(out_row + (ptr + rank), (x & 0xFFFF).to(tl.int32).to(tl.int16), mask=emit)
    ptr += count
    e_next = _entry_at(tab_row, v_ahead, lo, hi, W, top, j + 4, T, S, lane_ok, IDENTITY)
    v_next = _symbol_at(sym_ptr, off, top, j + 8, T, S, K, lane_ok)
    return x_next, ptr, eptr, wrong, e_next, v_next


@triton.jit
def encode_kernel(sym_ptr, lo_ptr, w_ptr, a_ptr, tab_ptr, buf_ptr, state_ptr, glen_ptr, ebuf_ptr, gesc_ptr,
                  scal_ptr, T, K, n_lanes, n_groups, S, cap, ecap,
                  HCAP: tl.constexpr, PROB_BITS: tl.constexpr, G: tl.constexpr, GPP: tl.constexpr,
                  WIDE_INDEX: tl.constexpr, VOTE: tl.constexpr, RECIP: tl.constexpr = False,
                  BY_COMPONENT: tl.constexpr = False):
    """One thread per lane, G lanes per shared word stream, GPP streams per program. Walks its
    tokens last to first. Escaped values go to their group's escape buffer (ecap slots) in the
    order the stored format wants. A group that escapes more stores ecap as its count, so that
    the payload assembled before the host looks (a wrong one, coded again with more room) stays
    inside the room it was given, and its true count goes to the summary's
    group_escapes_max, which the host reads to code it again; programs none of whose
    components has an escape symbol skip that bookkeeping. VOTE: see lanes_before; a lane found
    off its warp lane sets the overflow slot to 2, and the host refuses the result."""
    M: tl.constexpr = 1 << PROB_BITS
    s = tl.program_id(1).to(tl.int64)  # the tensor of a batch of same-shape tensors
    sym_ptr += s * T * K
    lo_ptr += s * K
    w_ptr += s * K
    a_ptr += s * K
    tab_ptr += s * K * HCAP
    buf_ptr += s * n_groups * cap
    state_ptr += s * n_lanes
    glen_ptr += s * n_groups
    gesc_ptr += s * n_groups
    ebuf_ptr += s * n_groups * ecap
    scal_ptr += s * SCAL_SLOTS
    grp = tl.program_id(0) * GPP + tl.arange(0, GPP)
    lane, lane_ok, p, k = group_lanes(grp, K, n_lanes // K, n_lanes, G, BY_COMPONENT)
    lo64 = tl.load(lo_ptr + k, mask=lane_ok, other=0)
    W64 = tl.load(w_ptr + k, mask=lane_ok, other=1)
    may_escape = tl.max(tl.max((tl.load(a_ptr + k, mask=lane_ok, other=0) > W64).to(tl.int32), 1), 0) > 0
    # int32 arithmetic: the window [lo, hi] lies in int32 (the format requires it), so comparing
    # against both ends is exact; v - lo can wrap only for values outside it, which are replaced
    lo = lo64.to(tl.int32)
    hi = (lo64 + W64 - 1).to(tl.int32)
    W = W64.to(tl.int32)
    tab_row = tab_ptr + k * HCAP
    x = tl.full([GPP, G], 65536, tl.uint32)
    ptr = tl.zeros([GPP, G], tl.int32)  # each group's words and escapes so far, in each of its lanes
    eptr = tl.zeros([GPP, G], tl.int32)
    row0 = p * S
    out_row = buf_ptr + grp.to(tl.int64)[:, None] * cap
    esc_row = ebuf_ptr + grp.to(tl.int64)[:, None] * ecap
    jg = tl.zeros([GPP, G], tl.int32) + tl.arange(0, G)[None, :]
    wrong = tl.zeros([GPP, G], tl.int32)
    # Software pipeline, unrolled 8 steps a loop iteration so that no value moves between registers:
    # a step's symbol is loaded 8 steps before it is coded, into the slot (v0..v7) that step j - 8
    # just used, and its table entry 4 steps before, into slot e0..e3. (A rotation of registers
    # made every step wait on a load issued the step before: a move reads the loaded register. So
    # each step took one memory latency, ~0.4 us on an NVIDIA H200, however the loads were led.)
    if RECIP:
        IDENTITY: tl.constexpr = PROB_BITS << 28  # recip_entry of f = 2^n: a row past T leaves x as it is
    else:
        IDENTITY: tl.constexpr = M
    top = row0 + (S - 1)  # the row of step 0: lanes walk their tokens last to first
    if WIDE_INDEX:
        off = top.to(tl.int64) * K + k
    else:
        off = top * K + k
    v0 = _symbol_at(sym_ptr, off, top, 0, T, S, K, lane_ok)
    v1 = _symbol_at(sym_ptr, off, top, 1, T, S, K, lane_ok)
    v2 = _symbol_at(sym_ptr, off, top, 2, T, S, K, lane_ok)
    v3 = _symbol_at(sym_ptr, off, top, 3, T, S, K, lane_ok)
    v4 = _symbol_at(sym_ptr, off, top, 4, T, S, K, lane_ok)
    v5 = _symbol_at(sym_ptr, off, top, 5, T, S, K, lane_ok)
    v6 = _symbol_at(sym_ptr, off, top, 6, T, S, K, lane_ok)
    v7 = _symbol_at(sym_ptr, off, top, 7, T, S, K, lane_ok)
    e0 = _entry_at(tab_row, v0, lo, hi, W, top, 0, T, S, lane_ok, IDENTITY)
    e1 = _entry_at(tab_row, v1, lo, hi, W, top, 1, T, S, lane_ok, IDENTITY)
    e2 = _entry_at(tab_row, v2, lo, hi, W, top, 2, T, S, lane_ok, IDENTITY)
    e3 = _entry_at(tab_row, v3, lo, hi, W, top, 3, T, S, lane_ok, IDENTITY)
    for j in range(0, S, 8):
        x, ptr, eptr, wrong, e0, v0 = _encode_step(x, ptr, eptr, wrong, v0, e0, v4, j, sym_ptr, off, tab_row, lo, hi, W, top, T, S, K, lane_ok, out_row, esc_row, ecap, jg, may_escape, PROB_BITS, VOTE, RECIP, IDENTITY)
        x, ptr, eptr, wrong, e1, v1 = _encode_step(x, ptr, eptr, wrong, v1, e1, v5, j + 1, sym_ptr, off, tab_row, lo, hi, W, top, T, S, K, lane_ok, out_row, esc_row, ecap, jg, may_escape, PROB_BITS, VOTE, RECIP, IDENTITY)
        x, ptr, eptr, wrong, e2, v2 = _encode_step(x, ptr, eptr, wrong, v2, e2, v6, j + 2, sym_ptr, off, tab_row, lo, hi, W, top, T, S, K, lane_ok, out_row, esc_row, ecap, jg, may_escape, PROB_BITS, VOTE, RECIP, IDENTITY)
        x, ptr, eptr, wrong, e3, v3 = _encode_step(x, ptr, eptr, wrong, v3, e3, v7, j + 3, sym_ptr, off, tab_row, lo, hi, W, top, T, S, K, lane_ok, out_row, esc_row, ecap, jg, may_escape, PROB_BITS, VOTE, RECIP, IDENTITY)
        x, ptr, eptr, wrong, e0, v4 = _encode_step(x, ptr, eptr, wrong, v4, e0, v0, j + 4, sym_ptr, off, tab_row, lo, hi, W, top, T, S, K, lane_ok, out_row, esc_row, ecap, jg, may_escape, PROB_BITS, VOTE, RECIP, IDENTITY)
        x, ptr, eptr, wrong, e1, v5 = _encode_step(x, ptr, eptr, wrong, v5, e1, v1, j + 5, sym_ptr, off, tab_row, lo, hi, W, top, T, S, K, lane_ok, out_row, esc_row, ecap, jg, may_escape, PROB_BITS, VOTE, RECIP, IDENTITY)
        x, ptr, eptr, wrong, e2, v6 = _encode_step(x, ptr, eptr, wrong, v6, e2, v2, j + 6, sym_ptr, off, tab_row, lo, hi, W, top, T, S, K, lane_ok, out_row, esc_row, ecap, jg, may_escape, PROB_BITS, VOTE, RECIP, IDENTITY)
        x, ptr, eptr, wrong, e3, v7 = _encode_step(x, ptr, eptr, wrong, v7, e3, v3, j + 7, sym_ptr, off, tab_row, lo, hi, W, top, T, S, K, lane_ok, out_row, esc_row, ecap, jg, may_escape, PROB_BITS, VOTE, RECIP, IDENTITY)
    tl.store(state_ptr + lane, x.to(tl.int32, bitcast=True), mask=lane_ok)
    ptr = tl.max(ptr, 1)
    eptr = tl.max(eptr, 1)
    tl.store(glen_ptr + grp, ptr, mask=grp < n_groups)
    stored = tl.minimum(eptr, ecap)  # what the escape buffer holds (see above)
    tl.store(gesc_ptr + grp, stored, mask=grp < n_groups)
    tl.atomic_add(scal_ptr + SCAL_WORDS, tl.sum(ptr.to(tl.int64), 0))
    tl.atomic_add(scal_ptr + SCAL_ESCAPES, tl.sum(stored.to(tl.int64), 0))
    tl.atomic_max(scal_ptr + SCAL_GROUP_ESC_MAX, tl.max(eptr, 0).to(tl.int64))
    if VOTE:
        tl.atomic_max(scal_ptr + SCAL_OVERFLOW, 2 * tl.max(tl.max(wrong, 1), 0).to(tl.int64))


@triton.jit
def _store_width(p8, p16, p32, el, v, width, mask):
    """Store into a section whose width (1, 2 or 4 bytes, a runtime value) varies by payload."""
    if width == 1:
        tl.store(p8 + el, v.to(tl.int8), mask=mask)
    elif width == 2:
        tl.store(p16 + el, v.to(tl.int16), mask=mask)
    else:
        tl.store(p32 + el, v.to(tl.int32), mask=mask)


@triton.jit
def pack_meta_kernel(lo_ptr, w_ptr, a_ptr, codes_ptr, states_ptr, model_ptr, scale_ptr, mu16_ptr,
                     b8, b16, b32, seg_ptr, K, P, HCAP: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_P: tl.constexpr, SEG_FIELDS: tl.constexpr, BY_COMPONENT: tl.constexpr = False):
    """One component's meta into payload s = program_id(1) of a batch (b8/b16/b32: the batch buffer
    as int8/int16/int32; seg_ptr: its segment table row): lo, W | escape flag, its model, then
    its parameters (after those of the parametric components before it) or its A weight codes
    (after those of the explicit ones before it), and its lanes' final states when it codes
    anything (A > 1)."""
    k = tl.program_id(0)
    s = tl.program_id(1)
    seg = seg_ptr + s * SEG_FIELDS
    lob = tl.load(seg + SEG_LO_BYTES)
    wb = tl.load(seg + SEG_W_BYTES)
    k_coded = tl.load(seg + SEG_K_CODED)
    lo_ptr += s * K
    w_ptr += s * K
    a_ptr += s * K
    model_ptr += s * K
    scale_ptr += s * K
    mu16_ptr += s * K
    codes_ptr += s.to(tl.int64) * K * HCAP
    states_ptr += s.to(tl.int64) * P * K
    # the components before k, BLOCK_K at a time (a block of all K at once spilled its registers at
    # K = 4096, one warp a program: 330 us at 64 MB on an NVIDIA H100, the encode's second largest kernel)
    off = tl.zeros([], tl.int64)
    poff = tl.zeros([], tl.int64)
    rank = tl.zeros([], tl.int64)
    for j0 in range(0, k, BLOCK_K):
        jk = j0 + tl.arange(0, BLOCK_K)
        before = jk < k
        A_all = tl.load(a_ptr + jk, mask=before, other=0).to(tl.int64)
        par_all = tl.load(model_ptr + jk, mask=before, other=0) > 0
        off += tl.sum(tl.where(before & ~par_all, A_all, 0), 0)
        poff += tl.sum(tl.where(before & par_all, 1, 0), 0).to(tl.int64)
        rank += tl.sum(tl.where(before & (A_all > 1), 1, 0), 0).to(tl.int64)
    A = tl.load(a_ptr + k)
    W = tl.load(w_ptr + k)
    model = tl.load(model_ptr + k)
    _store_width(b8, b16, b32, tl.load(seg + SEG_LO) + k, tl.load(lo_ptr + k), lob, k < K)
    _store_width(b8, b16, b32, tl.load(seg + SEG_WFLAG) + k, W | ((A - W) << (8 * wb - 1)), wb, k < K)
    tl.store(b8 + tl.load(seg + SEG_MODEL) + k, model.to(tl.int8))
    tl.store(b16 + tl.load(seg + SEG_MU16) + poff, tl.load(mu16_ptr + k).to(tl.int16), mask=model > 0)
    tl.store(b8 + tl.load(seg + SEG_SCALE) + poff, tl.load(scale_ptr + k).to(tl.uint8).to(tl.int8, bitcast=True),
             mask=model > 0)
    j = tl.arange(0, HCAP)
    tl.store(b8 + tl.load(seg + SEG_CODES) + off + j,
             tl.load(codes_ptr + k * HCAP + j).to(tl.int8, bitcast=True), mask=(j < A) & (model == 0))
    states_out = b32 + tl.load(seg + SEG_STATES)
    if A > 1:
        for p0 in range(0, P, BLOCK_P):
            pp = (p0 + tl.arange(0, BLOCK_P)).to(tl.int64)
            m = pp < P
            if BY_COMPONENT:  # the states of coded lanes, in lane order
                st = tl.load(states_ptr + k * P + pp, mask=m)
                tl.store(states_out + rank * P + pp, st, mask=m)
            else:
                st = tl.load(states_ptr + pp * K + k, mask=m)
                tl.store(states_out + pp * k_coded + rank, st, mask=m)


@triton.jit
def gather_streams_kernel(buf_ptr, glen_ptr, gend_ptr, cap, ebuf_ptr, gesc_ptr, geend_ptr, ecap, b16, b32, seg_ptr,
                          n_groups, BLOCK: tl.constexpr, SEG_FIELDS: tl.constexpr):
    """Group g of payload s = program_id(1): its words and escapes to their places in the payload
    (gend, geend: inclusive prefix sums of the counts), and both counts to their sections."""
    g = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    seg = seg_ptr + s * SEG_FIELDS
    out_ptr = b16 + tl.load(seg + SEG_STREAMS)
    gw_out = b32 + tl.load(seg + SEG_GW)
    ge_out = b32 + tl.load(seg + SEG_GE)
    eout_ptr = b32 + tl.load(seg + SEG_ESC)
    buf_ptr += s * n_groups * cap
    ebuf_ptr += s * n_groups * ecap
    glen_ptr += s * n_groups
    gend_ptr += s * n_groups
    gesc_ptr += s * n_groups
    geend_ptr += s * n_groups
    n = tl.load(glen_ptr + g)
    o = tl.load(gend_ptr + g) - n
    tl.store(gw_out + g, n)
    for st in range(0, n, BLOCK):
        offs = st + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + o + offs, tl.load(buf_ptr + g * cap + offs, mask=m), mask=m)
    ne = tl.load(gesc_ptr + g)
    oe = tl.load(geend_ptr + g) - ne
    tl.store(ge_out + g, ne)
    for st in range(0, ne, BLOCK):
        offs = st + tl.arange(0, BLOCK)
        m = offs < ne
        tl.store(eout_ptr + oe + offs, tl.load(ebuf_ptr + g * ecap + offs, mask=m), mask=m)


@triton.jit
def _checksum_step(pay, offs, local, n, base, start, SKIP_LO: tl.constexpr, SKIP_HI: tl.constexpr,
                   MASKED: tl.constexpr):
    """One block's bytes and their weights (position mod 65521, + 1) for checksum_kernel."""
    D: tl.constexpr = SKIP_HI - SKIP_LO
    if MASKED:
        b = tl.load(pay + offs, mask=offs < n, other=0).to(tl.uint32)
    else:
        b = tl.load(pay + offs).to(tl.uint32)
    b = tl.where((offs >= SKIP_LO) & (offs < SKIP_HI), 0, b)
    adj = tl.where((start < SKIP_HI) & (offs >= SKIP_HI), D, 0)  # only the first program straddles them
    w = base + local - adj  # < 2 * 65521: BLOCK * ITERS <= 65521
    w = tl.where(w >= 65521, w - 65521, w) + 1
    return b, b * w.to(tl.uint32)


@triton.jit
def checksum_kernel(ptr, seg_ptr, out_ptr, SKIP_LO: tl.constexpr, SKIP_HI: tl.constexpr, BLOCK: tl.constexpr,
                    ITERS: tl.constexpr, SEG_FIELDS: tl.constexpr):
    """Partial sums of rans.checksum over ITERS blocks of payload s = program_id(1), which lies at
    bytes [base, base + n) of ptr (seg_ptr[s]: base, n); its bytes [SKIP_LO, SKIP_HI) (the check
    fields themselves) are left out and do not count as positions. Sums go to out_ptr[2 s: 2 s + 2].
    Only the sums mod 2^32 are kept, so they run in wrapping uint32. A payload starts 16-byte
    aligned, so a program inside it loads 16 bytes a thread at once (unmasked; the program that
    holds the payload's end loads bytewise, masked); byte loads everywhere ran at a fifth of the speed."""
    tl.static_assert(BLOCK * ITERS <= 65521)
    D: tl.constexpr = SKIP_HI - SKIP_LO
    s = tl.program_id(1)
    pay = tl.multiple_of(ptr + tl.load(seg_ptr + s * SEG_FIELDS + SEG_BASE), 16)
    n = tl.load(seg_ptr + s * SEG_FIELDS + SEG_LEN)
    start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    if start >= n:  # the grid covers the longest payload a batch can hold
        return
    base = ((start - tl.where(start >= SKIP_HI, D, 0)) % 65521).to(tl.int32)  # first byte's position mod 65521
    s0 = tl.zeros([BLOCK], tl.uint32)
    s1 = tl.zeros([BLOCK], tl.uint32)
    if start + BLOCK * ITERS <= n:
        for it in range(ITERS):
            local = it * BLOCK + tl.arange(0, BLOCK)
            b, bw = _checksum_step(pay, tl.multiple_of(start, 16) + local, local, n, base, start, SKIP_LO, SKIP_HI,
                                   MASKED=False)
            s0 += b
            s1 += bw
    else:
        for it in range(ITERS):
            local = it * BLOCK + tl.arange(0, BLOCK)
            b, bw = _checksum_step(pay, start + local, local, n, base, start, SKIP_LO, SKIP_HI, MASKED=True)
            s0 += b
            s1 += bw
    tl.atomic_add(out_ptr + 2 * s, tl.sum(s0, 0).to(tl.int64))
    tl.atomic_add(out_ptr + 2 * s + 1, tl.sum(s1, 0).to(tl.int64))


@triton.jit
def copy_out_kernel(src_ptr, slot_ptr, span_ptr, N, meta_ptr, M, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """An encode's outputs copied to where slot_ptr (int64 [3]) points when the kernel runs, so that a
    CUDA graph gives every replay buffers of its own without a launch after it: the words [0, end)
    of src, end = the last byte of the N containers (span_ptr: int64 [N, 2], each one's start and
    length in bytes) rounded up to a word, to address slot[0] when they fit its room of slot[1]
    words (else nothing: the host, which reads the same spans, copies them itself); and the M int64
    words of meta_ptr to address slot[2] unless it is 0. A program copies BLOCK words; those past
    end return; the first one also copies the meta."""
    n = tl.arange(0, BLOCK_N)
    start = tl.load(span_ptr + 2 * n, mask=n < N, other=0)
    length = tl.load(span_ptr + 2 * n + 1, mask=n < N, other=0)
    end = (tl.max(start + length, 0) + 7) // 8
    first = tl.program_id(0).to(tl.int64) * BLOCK
    if (first < end) & (end <= tl.load(slot_ptr + 1)):
        dst_ptr = tl.load(slot_ptr).to(tl.pointer_type(tl.int64))
        offs = first + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < end), mask=offs < end)
    meta_at = tl.load(slot_ptr + 2)
    if (tl.program_id(0) == 0) & (meta_at != 0):
        meta_out = meta_at.to(tl.pointer_type(tl.int64))
        for m0 in range(0, M, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            tl.store(meta_out + m, tl.load(meta_ptr + m, mask=m < M), mask=m < M)


@triton.jit
def finish_checksum_kernel(sums_ptr, b32, seg_ptr, SEG_FIELDS: tl.constexpr):
    """Payload s = program_id(0): the checksum's two words (mod 2^32) into its header."""
    s = tl.program_id(0)
    v = tl.load(sums_ptr + 2 * s + tl.arange(0, 2))
    check_out = b32 + tl.load(seg_ptr + s * SEG_FIELDS + SEG_CHECK)
    tl.store(check_out + tl.arange(0, 2), (v & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True))


@triton.jit
def _pad_to(n, a: tl.constexpr):
    return (n + (a - 1)) // a * a


@triton.jit
def _sections(K, P, n_groups, lob, wb, n_table, k_coded, n_param, words, n_esc, HEADER_BYTES: tl.constexpr):
    """rans.Layout's section offsets (bytes from the payload's start), from its header fields."""
    lo = HEADER_BYTES + tl.zeros_like(n_table)
    wflag = lo + lob * K + (lob * K) % wb
    model = wflag + wb * K
    mu16 = (model + K + 1) // 2 * 2
    scale = mu16 + 2 * n_param
    codes = _pad_to(scale + n_param, 4)
    gw = _pad_to(codes + n_table, 4)
    ge = gw + 4 * n_groups
    esc = ge + 4 * n_groups
    states = esc + 4 * n_esc
    streams = states + 4 * P * k_coded
    total = streams + 2 * words
    return lo, wflag, model, mu16, scale, codes, gw, ge, esc, states, streams, total


@triton.jit
def _payload_bytes(K, P, n_groups, lob, wb, n_table, k_coded, n_param, words, n_esc, HEADER_BYTES: tl.constexpr):
    lo, wflag, model, mu16, scale, codes, gw, ge, esc, states, streams, total = _sections(
        K, P, n_groups, lob, wb, n_table, k_coded, n_param, words, n_esc, HEADER_BYTES)
    return total


@triton.jit
def _store_segment_row(row, base, K, P, n_groups, lob, wb, n_table, k_coded, n_param, words, n_esc, m,
                       HEADER_BYTES: tl.constexpr, CHECK_AT: tl.constexpr):
    """A payload's row of the segment table (SEG_FIELDS) when it starts at byte `base` of the buffer."""
    lo, wflag, model, mu16, scale, codes, gw, ge, esc, states, streams, total = _sections(
        K, P, n_groups, lob, wb, n_table, k_coded, n_param, words, n_esc, HEADER_BYTES)
    tl.store(row + SEG_BASE, base, mask=m)
    tl.store(row + SEG_LEN, total, mask=m)
    tl.store(row + SEG_LO, (base + lo) // lob, mask=m)
    tl.store(row + SEG_WFLAG, (base + wflag) // wb, mask=m)
    tl.store(row + SEG_MODEL, base + model, mask=m)
    tl.store(row + SEG_MU16, (base + mu16) // 2, mask=m)
    tl.store(row + SEG_SCALE, base + scale, mask=m)
    tl.store(row + SEG_CODES, base + codes, mask=m)
    tl.store(row + SEG_CHECK, (base + CHECK_AT) // 4, mask=m)
    tl.store(row + SEG_GW, (base + gw) // 4, mask=m)
    tl.store(row + SEG_GE, (base + ge) // 4, mask=m)
    tl.store(row + SEG_ESC, (base + esc) // 4, mask=m)
    tl.store(row + SEG_STATES, (base + states) // 4, mask=m)
    tl.store(row + SEG_STREAMS, (base + streams) // 2, mask=m)
    tl.store(row + SEG_N_TABLE, n_table, mask=m)
    tl.store(row + SEG_K_CODED, k_coded, mask=m)
    tl.store(row + SEG_N_PARAM, n_param, mask=m)
    tl.store(row + SEG_N_WORDS, words, mask=m)
    tl.store(row + SEG_N_ESC, n_esc, mask=m)
    tl.store(row + SEG_LO_BYTES, lob, mask=m)
    tl.store(row + SEG_W_BYTES, wb, mask=m)


@triton.jit
def layout_kernel(scal_ptr, front_ptr, back_ptr, seg_ptr, span_ptr, origin, N, K, P, n_groups,
                  BLOCK_N: tl.constexpr, SEG_FIELDS: tl.constexpr, HEADER_BYTES: tl.constexpr,
                  CHECK_AT: tl.constexpr):
    """rans.Layout on the device, for all N payloads of a batch in one program: from each encoder
    summary (scal) the sections' offsets, written as the segment table the later kernels read, and
    where each container (front bytes, payload, back bytes) starts in the batch buffer: containers
    follow each other 16-byte aligned, so span = (start, container length) per payload."""
    i = tl.arange(0, BLOCK_N)
    m = i < N
    sc = scal_ptr + i * SCAL_SLOTS
    n_table = tl.load(sc + SCAL_N_TABLE, mask=m, other=0)
    k_coded = tl.load(sc + SCAL_K_CODED, mask=m, other=0)
    w_max = tl.load(sc + SCAL_W_MAX, mask=m, other=0)
    lo_min = tl.load(sc + SCAL_LO_MIN, mask=m, other=0)
    lo_max = tl.load(sc + SCAL_LO_MAX, mask=m, other=0)
    words = tl.load(sc + SCAL_WORDS, mask=m, other=0)
    n_esc = tl.load(sc + SCAL_ESCAPES, mask=m, other=0)
    n_param = tl.load(sc + SCAL_N_PARAM, mask=m, other=0)
    front = tl.load(front_ptr + i, mask=m, other=0)
    back = tl.load(back_ptr + i, mask=m, other=0)
    lob = tl.where((lo_min >= -128) & (lo_max < 128), 1, tl.where((lo_min >= -32768) & (lo_max < 32768), 2, 4))
    wb = tl.where(w_max < 128, 1, 2)
    total = _payload_bytes(K, P, n_groups, lob, wb, n_table, k_coded, n_param, words, n_esc, HEADER_BYTES)
    length = front + total + back
    slot = tl.where(m, _pad_to(length, 16), 0)
    start = origin + tl.cumsum(slot, 0) - slot
    _store_segment_row(seg_ptr + i * SEG_FIELDS, start + front, K, P, n_groups, lob, wb, n_table, k_coded, n_param,
                       words, n_esc, m, HEADER_BYTES, CHECK_AT)
    tl.store(span_ptr + 2 * i, start, mask=m)
    tl.store(span_ptr + 2 * i + 1, length, mask=m)


@triton.jit
def _u32(v):
    return (v & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)


@triton.jit
def fronts_kernel(src_ptr, src_off_ptr, front_ptr, back_ptr, seg_ptr, span_ptr, b8, b32, T, K, S,
                  MAGIC_WORD: tl.constexpr, VERSION: tl.constexpr, PROB_BITS: tl.constexpr, G: tl.constexpr,
                  LENGTH_FIELD: tl.constexpr, HEADER_BYTES: tl.constexpr, BLOCK: tl.constexpr,
                  SEG_FIELDS: tl.constexpr, FLAGS: tl.constexpr = 0):
    """Container s = program_id(0) of a batch, all but what pack_meta, gather and the checksum
    write: its front bytes (with the payload length, u64, in their last 8 bytes when LENGTH_FIELD),
    the payload header's first 48 bytes, zeros in the alignment gaps between sections, and its back
    bytes (zeros)."""
    s = tl.program_id(0)
    seg = seg_ptr + s * SEG_FIELDS
    start = tl.load(span_ptr + 2 * s)
    front = tl.load(front_ptr + s)
    back = tl.load(back_ptr + s)
    src = src_ptr + tl.load(src_off_ptr + s)
    base = tl.load(seg + SEG_BASE)
    total = tl.load(seg + SEG_LEN)
    n_copy = front - 8 if LENGTH_FIELD else front
    for st in range(0, n_copy, BLOCK):
        offs = st + tl.arange(0, BLOCK)
        tl.store(b8 + start + offs, tl.load(src + offs, mask=offs < n_copy), mask=offs < n_copy)
    if LENGTH_FIELD:
        tl.store(b32 + (base - 8) // 4 + tl.arange(0, 2), _u32(total >> (32 * tl.arange(0, 2))))
    lob = tl.load(seg + SEG_LO_BYTES)
    wb = tl.load(seg + SEG_W_BYTES)
    j = tl.arange(0, 16)
    field = tl.where(j == 0, MAGIC_WORD, 0)
    field = tl.where(j == 1, VERSION | (PROB_BITS << 8) | (G << 16), field)
    field = tl.where(j == 2, T, field)
    field = tl.where(j == 3, K, field)
    field = tl.where(j == 4, S, field)
    field = tl.where(j == 5, tl.load(seg + SEG_N_TABLE), field)
    field = tl.where(j == 6, tl.load(seg + SEG_N_ESC), field)
    field = tl.where(j == 7, tl.load(seg + SEG_K_CODED), field)
    field = tl.where(j == 8, tl.load(seg + SEG_N_PARAM), field)
    field = tl.where(j == 9, lob | (wb << 8) | (FLAGS << 16), field)
    words = tl.load(seg + SEG_N_WORDS)
    field = tl.where(j == 10, words, field)
    field = tl.where(j == 11, words >> 32, field)
    tl.store(b32 + base // 4 + j, _u32(field), mask=j < 12)
    # the gaps: after lo (to wflag's width), after model (to 2), after scale and codes (to 4)
    model = tl.load(seg + SEG_MODEL)
    n_param = tl.load(seg + SEG_N_PARAM)
    scale = tl.load(seg + SEG_SCALE)
    codes = tl.load(seg + SEG_CODES)
    gw = tl.load(seg + SEG_GW) * 4
    lo_end = tl.load(seg + SEG_LO) * lob + lob * K
    z = tl.zeros([4], tl.int8)
    k4 = tl.arange(0, 4)
    wflag = tl.load(seg + SEG_WFLAG) * wb
    tl.store(b8 + lo_end + k4, z, mask=lo_end + k4 < wflag)
    tl.store(b8 + model + K + k4, z, mask=model + K + k4 < tl.load(seg + SEG_MU16) * 2)
    tl.store(b8 + scale + n_param + k4, z, mask=scale + n_param + k4 < codes)
    codes_end = codes + tl.load(seg + SEG_N_TABLE)
    tl.store(b8 + codes_end + k4, z, mask=codes_end + k4 < gw)
    end = base + total
    tl.store(b8 + end + j, tl.zeros([16], tl.int8), mask=j < back)


@triton.jit
def stage_kernel(src_ptr, dst_ptr, dst64_ptr, cap, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Container i = program_id(1) (src_ptr[2 i]: its address, src_ptr[2 i + 1]: its length, at
    most cap) -> bytes [i cap, i cap + length) of dst (dst64: the same buffer as int64, cap a
    multiple of 16): a list of GPU tensors staged in one launch. An 8-byte aligned container is
    copied in 8-byte words (eight times fewer loads), then its last length % 8 bytes."""
    i = tl.program_id(1).to(tl.int64)
    addr = tl.load(src_ptr + 2 * i)
    src = addr.to(tl.pointer_type(tl.uint8))
    n = tl.minimum(tl.load(src_ptr + 2 * i + 1), cap)
    start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    if addr % 8 == 0:
        src64 = addr.to(tl.pointer_type(tl.int64))
        n_words = n // 8
        for it in range(ITERS):
            w = start // 8 + it * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
            m = w < n_words
            tl.store(dst64_ptr + i * (cap // 8) + w, tl.load(src64 + w, mask=m), mask=m)
        offs = n_words * 8 + tl.arange(0, 8)
        m = (offs < n) & (offs >= start) & (offs < start + BLOCK * ITERS)
        tl.store(dst_ptr + i * cap + offs, tl.load(src + offs, mask=m), mask=m)
    else:
        for it in range(ITERS):
            offs = start + it * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst_ptr + i * cap + offs, tl.load(src + offs, mask=m), mask=m)


@triton.jit
def _le(p, NB: tl.constexpr):
    """The little-endian unsigned integer in bytes p[0:NB] (NB <= 8; 8 bytes wrap past 2^63)."""
    k = tl.arange(0, NB)
    return tl.sum(tl.load(p + k).to(tl.int64) << (8 * k).to(tl.int64), 0)


@triton.jit
def check_fronts_kernel(buf, src_ptr, ref_ptr, ref_len_ptr, seg_ptr, err_ptr, cap, T, K, P, n_groups,
                        BLOCK: tl.constexpr, SEG_FIELDS: tl.constexpr, HEADER_BYTES: tl.constexpr,
                        CHECK_AT: tl.constexpr, FLAGS: tl.constexpr = 0):
    """Container i = program_id(0), staged at byte i cap of buf (its length: src_ptr[2 i + 1]), held
    against the container the host last parsed and checked for that place of the list: ref_ptr row
    i holds its ref_len_ptr[i] bytes before the payload (whose last 8, the payload's length, are
    not compared) and the payload header's first 20 bytes (magic, version, prob_bits, G, T, K, S),
    which must all be equal; then the payload length, the 4 zero bytes after it, and the header's
    other fields are checked as rans._parse_header_only checks them, and its segment-table row is
    written. Anything else sets err[i] = 2 and writes the row of an empty payload of this shape
    (within the slot), so no later kernel reads outside it."""
    i = tl.program_id(0).to(tl.int64)
    p = buf + i * cap
    n = tl.load(src_ptr + 2 * i + 1)
    a = tl.load(ref_len_ptr + i)
    j = tl.arange(0, BLOCK)
    fixed = j < a + 20
    got = tl.load(p + j, mask=fixed, other=0)
    want = tl.load(ref_ptr + i * BLOCK + j, mask=fixed, other=0)
    bad = tl.sum(tl.where(fixed & ((j < a - 8) | (j >= a)) & (got != want), 1, 0), 0) > 0
    data_len = n - a - 4
    bad = bad | (n > cap) | (data_len < HEADER_BYTES) | (_le(p + a - 8, 8) != data_len)
    bad = bad | (_le(p + tl.maximum(n - 4, 0), 4) != 0)  # a self-checked chunk's CRC field is 0
    h = p + a
    n_table = _le(h + 20, 4)
    n_esc = _le(h + 24, 4)
    k_coded = _le(h + 28, 4)
    n_param = _le(h + 32, 4)
    lob = _le(h + 36, 1)
    wb = _le(h + 37, 1)
    words = _le(h + 40, 8)
    bad = bad | (n_esc > T * K) | (k_coded > K) | (n_param > K) | ((lob != 1) & (lob != 2) & (lob != 4)) \
        | ((wb != 1) & (wb != 2)) | (_le(h + 38, 2) != FLAGS) | (words < 0) | (words >= (1 << 32))
    total = _payload_bytes(K, P, n_groups, tl.where(bad, 4, lob), tl.where(bad, 2, wb), n_table, k_coded, n_param,
                           words, n_esc, HEADER_BYTES)
    bad = bad | (total != data_len)
    zero = n_table * 0
    _store_segment_row(seg_ptr + i * SEG_FIELDS, i * cap + a, K, P, n_groups, tl.where(bad, 4, lob),
                       tl.where(bad, 2, wb), tl.where(bad, zero, n_table), tl.where(bad, zero, k_coded),
                       tl.where(bad, zero, n_param), tl.where(bad, zero, words), tl.where(bad, zero, n_esc), i >= 0,
                       HEADER_BYTES, CHECK_AT)
    tl.store(err_ptr + i, tl.where(bad, 2, 0).to(tl.int32))


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _load_width(p8, p16, p32, el, width, mask):
    """Elements of a section whose width (1, 2 or 4 bytes, a runtime value) varies by payload."""
    if width == 1:
        v = tl.load(p8 + el, mask=mask, other=0).to(tl.int64)
    elif width == 2:
        v = tl.load(p16 + el, mask=mask, other=0).to(tl.int64)
    else:
        v = tl.load(p32 + el, mask=mask, other=0).to(tl.int64)
    return v


@triton.jit
def decode_meta_kernel(b8, b16, b32, seg_ptr, sums_ptr, shapes_ptr, inv_ptr, lo_ptr, w_ptr, a_ptr, rank_ptr,
                       tab_ptr, lut_ptr, err_ptr, K,
                       HCAP: tl.constexpr, PROB_BITS: tl.constexpr, BLOCK_K: tl.constexpr,
                       PACKED: tl.constexpr, N_SHAPES: tl.constexpr, SHAPE_STEPS: tl.constexpr,
                       SEG_FIELDS: tl.constexpr):
    """Payload s = program_id(1) of a batch (b8/b16/b32: the batch buffer as int8/int16/int32;
    seg_ptr: its segment table row). Program k < K: component k's window and weights (explicit
    codes or its parametric model) -> its rANS table and its slot -> symbol lookup (the symbol, in
    lut's type; PACKED: symbol << 2n | f - 1 << n | slot - cum, int32); program K: the virtual no-op
    component (one symbol of frequency 2^n). Anything out of range, and (program K) a checksum or table-size
    mismatch, sets the payload's error flag."""
    M: tl.constexpr = 1 << PROB_BITS
    k = tl.program_id(0)
    s = tl.program_id(1)
    seg = seg_ptr + s * SEG_FIELDS
    lob = tl.load(seg + SEG_LO_BYTES)
    wb = tl.load(seg + SEG_W_BYTES)
    lo_el = tl.load(seg + SEG_LO)
    wf_el = tl.load(seg + SEG_WFLAG)
    model_in = b8 + tl.load(seg + SEG_MODEL)
    mu16_in = b16 + tl.load(seg + SEG_MU16)
    scale_in = b8 + tl.load(seg + SEG_SCALE)
    codes_in = b8 + tl.load(seg + SEG_CODES)
    check_in = b32 + tl.load(seg + SEG_CHECK)
    n_table = tl.load(seg + SEG_N_TABLE)
    k_coded = tl.load(seg + SEG_K_CODED)
    n_param = tl.load(seg + SEG_N_PARAM)
    top = 8 * wb - 1
    lo_ptr += s * K
    w_ptr += s * K
    a_ptr += s * K
    rank_ptr += s * K
    tab_ptr += s.to(tl.int64) * (K + 1) * HCAP
    lut_ptr += s.to(tl.int64) * (K + 1) * M
    real = k < K
    # the components before k, BLOCK_K at a time (all K at once spilled its registers at K = 4096:
    # 528 us at 64 MB on an NVIDIA H100); program K, past the last, sums them all for the totals
    off = tl.zeros([], tl.int64)
    poff = tl.zeros([], tl.int64)
    rank = tl.zeros([], tl.int64)
    for j0 in range(0, k, BLOCK_K):
        jk = j0 + tl.arange(0, BLOCK_K)
        mk = jk < k
        wf_all = _load_width(b8, b16, b32, wf_el + jk, wb, mk) & ((2 << top) - 1)
        A_all = (wf_all & ((1 << top) - 1)) + (wf_all >> top)
        par_all = tl.load(model_in + jk, mask=mk, other=0).to(tl.int64) > 0
        off += tl.sum(tl.where(mk & ~par_all, A_all, 0), 0)
        poff += tl.sum(tl.where(mk & par_all, 1, 0), 0).to(tl.int64)
        rank += tl.sum(tl.where(mk & (A_all > 1), 1, 0), 0).to(tl.int64)
    wf = tl.where(real, _load_width(b8, b16, b32, wf_el + k, wb, real), 1) & ((2 << top) - 1)
    W = wf & ((1 << top) - 1)
    has_esc = (wf >> top) > 0
    A = W + (wf >> top)
    lo = _load_width(b8, b16, b32, lo_el + k, lob, real)
    model = tl.load(model_in + k, mask=real, other=0).to(tl.int64)
    bad = real & ((W < 1) | (A > HCAP) | (lo + W - 1 > 2147483647) | (model > N_SHAPES))
    sums = tl.load(sums_ptr + 2 * s + tl.arange(0, 2)) & 0xFFFFFFFF
    check = tl.load(check_in + tl.arange(0, 2)).to(tl.int64) & 0xFFFFFFFF
    # program K's sums run over every component: the table size, coded and parametric counts
    bad_global = (tl.sum((sums != check).to(tl.int32), 0) > 0) | (off != n_table) | (rank != k_coded) \
        | (poff != n_param)
    bad = bad | ((k == K) & bad_global)
    j = tl.arange(0, HCAP)
    j64 = j.to(tl.int64)
    code = tl.load(codes_in + off + j, mask=real & (model == 0) & (j < A) & (off + j < n_table), other=0)
    w = mf_decode(code.to(tl.uint8).to(tl.int64))
    par = real & (model > 0) & (poff < n_param)
    mu16 = tl.load(mu16_in + poff, mask=par, other=0).to(tl.int64)
    scode = tl.load(scale_in + poff, mask=par, other=0).to(tl.uint8).to(tl.int64)
    shape = tl.minimum(tl.maximum(model - 1, 0), N_SHAPES - 1)
    w = tl.where(par, model_row(shapes_ptr, inv_ptr, shape, scode, mu16, W, has_esc, j64, SHAPE_STEPS), w)
    w = tl.where((~real) & (j == 0), 1, w)
    f, c, good = normalize_row(w, j, PROB_BITS)
    bad = bad | (real & ~good)
    tl.store(lo_ptr + k, lo, mask=real)
    tl.store(w_ptr + k, W, mask=real)
    tl.store(a_ptr + k, A, mask=real)
    tl.store(rank_ptr + k, rank.to(tl.int64), mask=real)
    tl.store(tab_ptr + k * HCAP + j, ((c << 16) | f).to(tl.int32))
    # slot -> symbol: mark each symbol's first slot, then a running maximum fills its range (in the
    # lookup's own type: uint8 / int16 symbols, or int32 PACKED entries)
    LUT_T = lut_ptr.dtype.element_ty
    row = lut_ptr + k.to(tl.int64) * M
    slots = tl.arange(0, M)
    tl.store(row + slots, tl.zeros([M], LUT_T))
    tl.debug_barrier()
    tl.store(row + c, j.to(LUT_T), mask=f > 0)
    tl.debug_barrier()
    sym = tl.associative_scan(tl.load(row + slots).to(tl.int32), 0, _max_combine)
    if PACKED:
        t = tl.load(tab_ptr + k * HCAP + sym)
        fs = t & 0xFFFF
        cs = t >> 16
        val = (sym << (2 * PROB_BITS)) | ((fs - 1) << PROB_BITS) | (slots - cs)
    else:
        val = sym
    tl.debug_barrier()
    tl.store(row + slots, val.to(LUT_T))
    tl.atomic_or(err_ptr + s, bad.to(tl.int32))


@triton.jit
def decode_kernel(b16, b32, seg_ptr, gend_ptr, glen_ptr, lo_ptr, w_ptr, a_ptr, rank_ptr, lut_ptr, tab_ptr,
                  out_ptr, gesc_ptr, geend_ptr, err_ptr, step_ptr, bound_ptr, T, K, n_lanes, n_groups, S, OUT_W,
                  HCAP: tl.constexpr, PROB_BITS: tl.constexpr, G: tl.constexpr, GPP: tl.constexpr,
                  WIDE_INDEX: tl.constexpr, PACKED: tl.constexpr, SEG_FIELDS: tl.constexpr, VOTE: tl.constexpr,
                  NARROW: tl.constexpr = False, SCALED: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                  BY_COMPONENT: tl.constexpr = False, TILE: tl.constexpr = False):
    """The encoder's mirror, for payload s = program_id(1) of a batch: lanes walk their tokens
    first to last, reading each group's words from the end of its stream. PACKED: lut holds
    symbol | f-1 | slot-cum in one int32 (n <= 11); else lut holds the symbol (uint8, or int16 past
    256 symbols: a quarter or half of the bytes, so more lanes' lookups stay in cache) and tab the
    (cum << 16 | f) entry. Escaped values are read from the end of each group's escapes, as its
    words. Any inconsistency sets the payload's error flag (bit 0); a lane found off its warp lane
    (VOTE, see lanes_before) sets bit 2, which the host reports as a fault of its own, not corruption.
    NARROW: out is int16 (half the bytes to write, and for the reconstruction to read); a value
    beyond it (a window reaching past int16, or an escaped value) sets bit 3, and the caller
    decodes that payload into int32 instead.
    SCALED: out is bf16 rows of OUT_W values (the coefficients of a reconstruction GEMM, whose
    columns past K the caller fills): each value is written as bf16(value * step[s]). A value
    with |value * step| beyond bound[s] (or a step that is not finite) is corruption (bit 0): the
    caller's GEMM then cannot overflow. The window's ends are checked once per lane, escaped
    values as they are met. PREFETCH (NVIDIA GPUs, not the interpreter): each step asks L2 for the
    words STREAM_PREFETCH_GROUPS windows below the next one, so the next steps' window loads do not
    wait for memory. BY_COMPONENT: the payload's lanes are in that order (see group_lanes); with TILE
    too (G = 32 and P a multiple of 32, so a group is 32 token blocks of one component) a program
    decodes the groups of GPP consecutive components at one set of blocks, one warp each, and its
    [GPP, 32] values a step are rows' GPP consecutive components, which the compiler stores through
    shared memory as contiguous runs of each row (lanes of one component alone write values S rows
    apart: 32 stores a warp where a run of 32 components takes 2)."""
    sg = tl.program_id(1)
    seg = seg_ptr + sg * SEG_FIELDS
    words_ptr = b16 + tl.load(seg + SEG_STREAMS)
    states_in = b32 + tl.load(seg + SEG_STATES)
    esc_in = b32 + tl.load(seg + SEG_ESC)
    n_words = tl.load(seg + SEG_N_WORDS)
    n_esc = tl.load(seg + SEG_N_ESC)
    k_coded = tl.load(seg + SEG_K_CODED)
    gend_ptr += sg.to(tl.int64) * n_groups
    glen_ptr += sg.to(tl.int64) * n_groups
    gesc_ptr += sg.to(tl.int64) * n_groups
    geend_ptr += sg.to(tl.int64) * n_groups
    lo_ptr += sg * K
    w_ptr += sg * K
    a_ptr += sg * K
    rank_ptr += sg * K
    lut_ptr += sg.to(tl.int64) * (K + 1) * (1 << PROB_BITS)
    tab_ptr += sg.to(tl.int64) * (K + 1) * HCAP
    step = tl.load(step_ptr + sg)  # SCALED only (other callers pass any float32 [N])
    bound = tl.load(bound_ptr + sg)
    if SCALED:
        out_ptr += sg.to(tl.int64) * T * OUT_W
    else:
        out_ptr += sg.to(tl.int64) * T * K
    err_ptr += sg
    M: tl.constexpr = 1 << PROB_BITS
    P = n_lanes // K
    if TILE:
        nb = P // G  # groups a component
        blk = tl.program_id(0) % nb
        kk = (tl.program_id(0) // nb) * GPP + tl.arange(0, GPP)
        grp = kk * nb + blk
        grp_ok = kk < K
        # the lanes' own component and block, from arithmetic that tells the compiler nothing of runs, so
        # the lanes' work keeps the lanes' layout; the store's offsets (below) say their runs
        lane2d = tl.arange(0, GPP)[:, None] * G + tl.arange(0, G)[None, :]
        k = (tl.program_id(0) // nb) * GPP + lane2d // G
        p = blk * G + lane2d % G
        lane_ok = k < K
        run_k = tl.broadcast_to(kk[:, None], [GPP, G])  # contiguous down the program's groups
        run_row0 = tl.broadcast_to((blk * G + tl.arange(0, G)[None, :]) * S, [GPP, G])
    else:
        grp = tl.program_id(0) * GPP + tl.arange(0, GPP)
        grp_ok = grp < n_groups
        _, lane_ok, p, k = group_lanes(grp, K, P, n_lanes, G, BY_COMPONENT)
    lo = tl.load(lo_ptr + k, mask=lane_ok, other=0)
    W = tl.load(w_ptr + k, mask=lane_ok, other=0)
    A = tl.load(a_ptr + k, mask=lane_ok, other=0)
    rank = tl.load(rank_ptr + k, mask=lane_ok, other=0)
    lo32 = lo.to(tl.int32)
    coded = lane_ok & (A > 1) & (rank < k_coded)
    may_escape = tl.max(tl.max((A > W).to(tl.int32), 1), 0) > 0
    if BY_COMPONENT:  # coded lanes' states in lane order
        state_at = rank.to(tl.int64) * P + p
    else:
        state_at = p.to(tl.int64) * k_coded + rank
    x = tl.load(states_in + state_at, mask=coded, other=65536).to(tl.uint32, bitcast=True)
    bad = (x < 65536).to(tl.int32)
    wide = ((lo < -32768) | (lo + tl.maximum(W, 1) - 1 > 32767)) & lane_ok  # NARROW: a window past int16
    if SCALED:  # the window's ends bound every value that is not escaped
        reach = tl.maximum(tl.abs(lo.to(tl.float32)), tl.abs((lo + tl.maximum(W, 1) - 1).to(tl.float32))) * step
        bad |= (lane_ok & ~(reach <= bound)).to(tl.int32)
    glen = tl.load(glen_ptr + grp, mask=grp_ok, other=0)
    ptr = glen[:, None] + tl.zeros([GPP, G], tl.int32)  # each group's read position, in each of its lanes
    base = tl.load(gend_ptr + grp, mask=grp_ok, other=0) - glen
    gesc = tl.load(gesc_ptr + grp, mask=grp_ok, other=0)
    eptr = gesc[:, None] + tl.zeros([GPP, G], tl.int32)
    ebase = tl.load(geend_ptr + grp, mask=grp_ok, other=0) - gesc
    last_esc = tl.maximum(n_esc - 1, 0)
    if tl.program_id(0) == 0:  # the groups' counts must add up to the stream's and the escapes'
        bad |= ((tl.load(gend_ptr + n_groups - 1) != n_words) | (tl.load(geend_ptr + n_groups - 1) != n_esc)).to(
            tl.int32)
    row0 = p * S
    last_word = tl.maximum(n_words - 1, 0)
    if SCALED:
        row_w = OUT_W
    else:
        row_w = K
    if WIDE_INDEX:
        off = row0.to(tl.int64) * row_w + k
    else:
        off = row0 * row_w + k
        # word offsets then fit int32 (a stream holds at most T * K words); a hostile base only wraps,
        # and the window's clamp to [0, last_word] still bounds every read
        base = base.to(tl.int32)
        last_word = tl.minimum(last_word, 2147483647).to(tl.int32)
    jg = tl.zeros([GPP, G], tl.int32) + tl.arange(0, G)[None, :]
    wrong = tl.zeros([GPP, G], tl.int32)
    has_words = grp_ok[:, None] & (n_words > 0)
    # a tiled decode on a GPU reads its lanes' tables, words and escapes in place (load_in_place)
    IN_PLACE: tl.constexpr = TILE and PREFETCH and PACKED
    window = word_window(words_ptr, base, ptr, jg, G, last_word, has_words, IN_PLACE)
    step_bad = tl.zeros([GPP, G], tl.int32)  # the steps' checks, apart from bad: it stays in the lanes' layout
    for i in range(0, S):
        row = row0 + i
        active = lane_ok & (row < T)
        comp = tl.where(active, k, K)
        slot = (x & (M - 1)).to(tl.int32)
        if IN_PLACE:
            e = load_in_place(lut_ptr + comp * M + slot)
        else:
            e = tl.load(lut_ptr + comp * M + slot)
        if PACKED:
            s = e >> (2 * PROB_BITS)
            f = ((e >> PROB_BITS) & (M - 1)).to(tl.uint32) + 1
            x = f * (x >> PROB_BITS) + (e & (M - 1)).to(tl.uint32)
        else:
            s = e.to(tl.int32)
            t = tl.load(tab_ptr + comp * HCAP + s)
            f = (t & 0xFFFF).to(tl.uint32)
            c = (t >> 16).to(tl.uint32)
            x = f * (x >> PROB_BITS) + (slot.to(tl.uint32) - c)
        need = x < 65536
        nd = need.to(tl.int32)
        rank_w, tot, rwrong = lanes_before(nd, jg, VOTE)
        wrong |= rwrong
        ptr -= tot
        step_bad |= (ptr < 0).to(tl.int32)
        # the lane of rank r reads word ptr + r, which is window slot G - tot + r
        wd = tl.gather(window, tl.minimum(G - tot + rank_w, G - 1), 1)
        # the next step's window: the G words below the new read position (issued now, so its
        # latency overlaps the next lookup's)
        window = word_window(words_ptr, base, ptr, jg, G, last_word, has_words, IN_PLACE)
        if PREFETCH:  # the stream's words a few steps ahead: the window's load then finds them in L2
            ahead = base[:, None] + (ptr - (STREAM_PREFETCH_GROUPS + 1) * G + jg)
            prefetch_l2(words_ptr + tl.minimum(tl.maximum(ahead, 0), last_word), has_words & (ahead >= 0))
        x = tl.where(need, (x << 16) | wd.to(tl.uint32), x)
        val = lo32 + s  # wraps only for an escape symbol, whose value is replaced
        if may_escape:
            esc_now = active & (s == W) & (A > W)
            ee = esc_now.to(tl.int32)
            erank, ecount, ewrong = lanes_before(ee, jg, VOTE)
            wrong |= ewrong
            eptr -= ecount
            step_bad |= (eptr < 0).to(tl.int32)
            ep = tl.minimum(tl.maximum(ebase[:, None] + (eptr + erank), 0), last_esc)
            if IN_PLACE:
                val = tl.where(esc_now, load_in_place(esc_in + ep, esc_now), val)
            else:
                val = tl.where(esc_now, tl.load(esc_in + ep, mask=esc_now, other=0), val)
            if NARROW:
                wide |= esc_now & ((val < -32768) | (val > 32767))
            if SCALED:
                step_bad |= (esc_now & ~(tl.abs(val.to(tl.float32)) * step <= bound)).to(tl.int32)
        if SCALED:
            val = (val.to(tl.float32) * step).to(tl.bfloat16)
        if TILE:  # offsets the compiler knows run along the components: the store is laid out for runs
            if WIDE_INDEX:
                run_off = (run_row0 + i).to(tl.int64) * row_w + run_k
            else:
                run_off = (run_row0 + i) * row_w + run_k
            tl.store(out_ptr + run_off, val, mask=(run_k < K) & (run_row0 + i < T))
        else:
            tl.store(out_ptr + off, val, mask=active)
            off += row_w
    bad |= step_bad
    bad |= ((x != 65536) & lane_ok).to(tl.int32)
    bad |= ((ptr != 0) | (eptr != 0)).to(tl.int32)
    bad |= 4 * wrong
    if NARROW:
        bad |= 8 * wide.to(tl.int32)
    tl.atomic_or(err_ptr, tl.max(tl.max(tl.where(lane_ok, bad, 0), 1), 0))

"""Triton kernels of the GPU rANS coder (shared/codecs/rans.py holds the format and the host code).

Imported only when a GPU coder function is first called, so importing rans.py needs no Triton.
Every integer rule here mirrors the numpy coder in rans.py exactly; tests compare the bytes.
"""
import triton
import triton.language as tl


@triton.jit
def bitlen(v):
    n = v * 0
    for b in tl.static_range(32):
        n += ((v >> b) > 0).to(tl.int64)
    return n

@triton.jit
def mf_encode(v):
    e = tl.maximum(bitlen(v) - 4, 2)
    q = (v + ((v * 0 + 1) << (e - 2))) >> (e - 1)
    carry = q >= 32
    e = e + carry.to(tl.int64)
    q = tl.where(carry, 16, q)
    return tl.where(v < 32, v, e * 16 + q - 16)

@triton.jit
def mf_decode(c):
    e = c >> 4
    return tl.where(c < 32, c, (16 + (c & 15)) << tl.maximum(e - 1, 0))

@triton.jit
def normalize_row(w, j, PROB_BITS: tl.constexpr):
    """Same integer rule as numpy normalize(); returns (freq, cum, ok)."""
    M: tl.constexpr = 1 << PROB_BITS
    total = tl.sum(w, 0)
    safe = tl.maximum(total, 1)
    lo = total * 0 + 1
    hi = total * 0 + 2 * M
    for _ in tl.static_range(PROB_BITS + 2):
        mid = (lo + hi) // 2
        f = tl.where(w > 0, tl.maximum(w * mid // safe, 1), 0)
        ok = tl.sum(f, 0) <= M
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    f = tl.where(w > 0, tl.maximum(w * lo // safe, 1), 0)
    top = tl.argmax(w, 0, tie_break_left=True)
    f = f + tl.where(j == top, M - tl.sum(f, 0), 0)
    good = total > 0
    f = tl.where(good, f, tl.where(j == 0, M, 0))  # a safe table for a corrupt (empty) row
    return f, tl.cumsum(f, 0) - f, good

@triton.jit
def hist_kernel(sym_ptr, lo0_ptr, h0_ptr, centre_ptr, counts_ptr, T, K, n_lanes, HS,
                HCAP: tl.constexpr, BLOCK: tl.constexpr, WIDE_INDEX: tl.constexpr):
    """Exact per-component histograms inside the first windows. One thread walks HS tokens of
    one component (lanes like the coder's, so loads are coalesced over components) and keeps
    the 8 bins around the component's mean in registers: those take most of the hits and would
    otherwise serialize on a few global atomics. Other bins get a global atomic each."""
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lane_ok = lane < n_lanes
    p = lane // K
    k = lane - p * K
    lo0 = tl.load(lo0_ptr + k, mask=lane_ok, other=0)
    h0 = tl.load(h0_ptr + k, mask=lane_ok, other=0)
    c0 = tl.load(centre_ptr + k, mask=lane_ok, other=0) - lo0 - 3  # first of the 8 register bins
    row_ptr = k.to(tl.int64) * HCAP
    n0 = tl.zeros([BLOCK], tl.int32)
    n1 = tl.zeros([BLOCK], tl.int32)
    n2 = tl.zeros([BLOCK], tl.int32)
    n3 = tl.zeros([BLOCK], tl.int32)
    n4 = tl.zeros([BLOCK], tl.int32)
    n5 = tl.zeros([BLOCK], tl.int32)
    n6 = tl.zeros([BLOCK], tl.int32)
    n7 = tl.zeros([BLOCK], tl.int32)
    row0 = p * HS
    for i in range(0, HS):
        row = row0 + i
        active = lane_ok & (row < T)
        if WIDE_INDEX:
            off = row.to(tl.int64) * K + k
        else:
            off = row * K + k
        v = tl.load(sym_ptr + off, mask=active, other=0).to(tl.int64)
        idx = v - lo0
        inw = active & (idx >= 0) & (idx < h0)
        d = idx - c0
        n0 += (inw & (d == 0)).to(tl.int32)
        n1 += (inw & (d == 1)).to(tl.int32)
        n2 += (inw & (d == 2)).to(tl.int32)
        n3 += (inw & (d == 3)).to(tl.int32)
        n4 += (inw & (d == 4)).to(tl.int32)
        n5 += (inw & (d == 5)).to(tl.int32)
        n6 += (inw & (d == 6)).to(tl.int32)
        n7 += (inw & (d == 7)).to(tl.int32)
        tail = inw & ((d < 0) | (d >= 8))
        tl.atomic_add(counts_ptr + row_ptr + tl.where(tail, idx, 0), 1, mask=tail)
    tl.atomic_add(counts_ptr + row_ptr + c0 + 0, n0, mask=n0 > 0)
    tl.atomic_add(counts_ptr + row_ptr + c0 + 1, n1, mask=n1 > 0)
    tl.atomic_add(counts_ptr + row_ptr + c0 + 2, n2, mask=n2 > 0)
    tl.atomic_add(counts_ptr + row_ptr + c0 + 3, n3, mask=n3 > 0)
    tl.atomic_add(counts_ptr + row_ptr + c0 + 4, n4, mask=n4 > 0)
    tl.atomic_add(counts_ptr + row_ptr + c0 + 5, n5, mask=n5 > 0)
    tl.atomic_add(counts_ptr + row_ptr + c0 + 6, n6, mask=n6 > 0)
    tl.atomic_add(counts_ptr + row_ptr + c0 + 7, n7, mask=n7 > 0)


@triton.jit
def tables_kernel(counts_ptr, h0_ptr, a_ptr, w_ptr, esc_ptr, nesc_ptr, codes_ptr, tab_ptr, T,
                  HCAP: tl.constexpr, PROB_BITS: tl.constexpr, ESC_COST: tl.constexpr,
                  ENTRY_COST: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HCAP)
    j64 = j.to(tl.int64)
    h0 = tl.load(h0_ptr + k)
    cnt = tl.load(counts_ptr + k * HCAP + j).to(tl.int64)
    n_in = tl.sum(cnt, 0)
    esc0 = T - n_in
    mode = tl.argmax(cnt, 0, tie_break_left=True)
    incl = tl.cumsum(cnt, 0)
    left_out = incl - cnt
    right_out = n_in - incl
    big = tl.full([HCAP], 1 << 62, tl.int64)
    cost_l = tl.where(j <= mode, ESC_COST * left_out - ENTRY_COST * j64, big)
    a = tl.argmin(cost_l, 0, tie_break_left=True)
    cost_r = tl.where((j >= mode) & (j64 < h0), ENTRY_COST * j64 + ESC_COST * right_out, big)
    b = tl.argmin(cost_r, 0, tie_break_left=True)
    n_esc = esc0 + tl.sum(tl.where(j == a, left_out, 0), 0) + tl.sum(tl.where(j == b, right_out, 0), 0)
    has_esc = n_esc > 0
    W = b - a + 1
    kept = tl.load(counts_ptr + k * HCAP + a + j, mask=j < W, other=0).to(tl.int64)
    kept = tl.where((j == W) & has_esc, n_esc, kept)
    shift = tl.maximum(bitlen(tl.max(kept, 0)) - 18, 0)
    wts = tl.where(kept > 0, tl.maximum(kept >> shift, 1), 0)
    code = mf_encode(wts)
    f, c, good = normalize_row(mf_decode(code), j, PROB_BITS)
    tl.store(codes_ptr + k * HCAP + j, code.to(tl.uint8))
    tl.store(tab_ptr + k * HCAP + j, ((c << 16) | f).to(tl.int32))
    tl.store(a_ptr + k, a.to(tl.int64))
    tl.store(w_ptr + k, W.to(tl.int64))
    tl.store(esc_ptr + k, has_esc.to(tl.int64))
    tl.store(nesc_ptr + k, n_esc)

@triton.jit
def decode_tables_kernel(codes_ptr, tab_ptr, freq_ptr, bad_ptr, HCAP: tl.constexpr, PROB_BITS: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HCAP)
    code = tl.load(codes_ptr + k * HCAP + j).to(tl.int64)
    f, c, good = normalize_row(mf_decode(code), j, PROB_BITS)
    tl.store(tab_ptr + k * HCAP + j, ((c << 16) | f).to(tl.int32))
    tl.store(freq_ptr + k * HCAP + j, f.to(tl.int32))
    tl.store(bad_ptr + k, (~good).to(tl.int32))


@triton.jit
def encode_kernel(sym_ptr, lo_ptr, w_ptr, tab_ptr, buf_ptr, state_ptr, glen_ptr, esc_key_ptr, esc_val_ptr,
                  esc_count_ptr, T, K, n_lanes, n_groups, S, cap,
                  HCAP: tl.constexpr, PROB_BITS: tl.constexpr, G: tl.constexpr, GPP: tl.constexpr,
                  HAS_ESC: tl.constexpr, WIDE_INDEX: tl.constexpr):
    """One thread per lane, G lanes per shared word stream, GPP streams per program. Walks its
    tokens last to first; escaped values go to (key = row * K + k, value) slots, sorted later."""
    M: tl.constexpr = 1 << PROB_BITS
    grp = tl.program_id(0) * GPP + tl.arange(0, GPP)
    lane = grp[:, None] * G + tl.arange(0, G)[None, :]
    lane_ok = lane < n_lanes
    p = lane // K
    k = lane - p * K
    lo = tl.load(lo_ptr + k, mask=lane_ok, other=0)
    W = tl.load(w_ptr + k, mask=lane_ok, other=1)
    tab_row = tab_ptr + k * HCAP
    x = tl.full([GPP, G], 65536, tl.uint32)
    ptr = tl.zeros([GPP], tl.int32)
    row0 = p * S
    out_row = buf_ptr + grp.to(tl.int64)[:, None] * cap
    row = row0 + (S - 1)
    active = lane_ok & (row < T)
    if WIDE_INDEX:
        off_next = row.to(tl.int64) * K + k
    else:
        off_next = row * K + k
    v_next = tl.load(sym_ptr + off_next, mask=active, other=0)
    for jj in range(0, S):
        row = row0 + (S - 1 - jj)
        active = lane_ok & (row < T)
        off = off_next
        v = v_next.to(tl.int64)
        # fetch the next step's symbols now, so their latency overlaps this step's arithmetic
        off_next = off - K
        v_next = tl.load(sym_ptr + off_next, mask=lane_ok & (row - 1 < T) & (jj + 1 < S), other=0)
        idx = v - lo
        outside = (idx < 0) | (idx >= W)
        idx = tl.where(outside, W, idx)
        if HAS_ESC:
            esc_now = active & outside
            slot = tl.atomic_add(esc_count_ptr + k * 0, 1, mask=esc_now)
            tl.store(esc_key_ptr + slot, off.to(tl.int64), mask=esc_now)
            tl.store(esc_val_ptr + slot, v.to(tl.int32), mask=esc_now)
        e = tl.load(tab_row + idx.to(tl.int32), mask=active, other=M)
        f = (e & 0xFFFF).to(tl.uint32)
        c = (e >> 16).to(tl.uint32)
        emit = (x >> (32 - PROB_BITS)) >= f
        em = emit.to(tl.int32)
        rank = tl.cumsum(em, 1) - em
        tl.store(out_row + (ptr[:, None] + rank), (x & 0xFFFF).to(tl.int32).to(tl.int16), mask=emit)
        ptr += tl.sum(em, 1)
        x = tl.where(emit, x >> 16, x)
        q = x // f
        x = (q << PROB_BITS) + (x - q * f) + c
    tl.store(state_ptr + lane, x.to(tl.int32, bitcast=True), mask=lane_ok)
    tl.store(glen_ptr + grp, ptr, mask=grp < n_groups)


@triton.jit
def gather_streams_kernel(buf_ptr, glen_ptr, goff_ptr, out_ptr, cap, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    n = tl.load(glen_ptr + g)
    o = tl.load(goff_ptr + g)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + o + offs, tl.load(buf_ptr + g * cap + offs, mask=m), mask=m)

@triton.jit
def decode_kernel(words_ptr, goff_ptr, glen_ptr, state_ptr, lo_ptr, w_ptr, lut_ptr, tab_ptr,
                  out_ptr, esc_key_ptr, esc_count_ptr, bad_ptr, T, K, n_lanes, n_groups, S, n_words, n_esc,
                  HCAP: tl.constexpr, PROB_BITS: tl.constexpr, G: tl.constexpr, GPP: tl.constexpr,
                  HAS_ESC: tl.constexpr, WIDE_INDEX: tl.constexpr, PACKED: tl.constexpr):
    """The encoder's mirror: lanes walk their tokens first to last, reading each group's words
    from the end of its stream. PACKED: lut holds symbol | f-1 | slot-cum in one int32 (n <= 11);
    else lut holds the symbol and tab the (cum << 16 | f) entry. Escapes leave their position
    (row * K + k) in esc_key; the caller sorts them and scatters the stored values."""
    M: tl.constexpr = 1 << PROB_BITS
    grp = tl.program_id(0) * GPP + tl.arange(0, GPP)
    grp_ok = grp < n_groups
    lane = grp[:, None] * G + tl.arange(0, G)[None, :]
    lane_ok = lane < n_lanes
    p = lane // K
    k = lane - p * K
    lo = tl.load(lo_ptr + k, mask=lane_ok, other=0)
    W = tl.load(w_ptr + k, mask=lane_ok, other=0)
    x = tl.load(state_ptr + lane, mask=lane_ok, other=65536).to(tl.uint32, bitcast=True)
    bad = (x < 65536).to(tl.int32)
    ptr = tl.load(glen_ptr + grp, mask=grp_ok, other=0)
    base = tl.load(goff_ptr + grp, mask=grp_ok, other=0)
    row0 = p * S
    last_word = tl.maximum(n_words - 1, 0)
    if WIDE_INDEX:
        off = row0.to(tl.int64) * K + k
    else:
        off = row0 * K + k
    for i in range(0, S):
        row = row0 + i
        active = lane_ok & (row < T)
        comp = tl.where(active, k, K)
        slot = (x & (M - 1)).to(tl.int32)
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
        rank = tl.cumsum(nd, 1) - nd
        ptr -= tl.sum(nd, 1)
        bad |= (ptr < 0).to(tl.int32)[:, None]
        rp = tl.minimum(tl.maximum(base[:, None] + (ptr[:, None] + rank), 0), last_word)
        wd = tl.load(words_ptr + rp, mask=need, other=0).to(tl.int32) & 0xFFFF
        x = tl.where(need, (x << 16) | wd.to(tl.uint32), x)
        tl.store(out_ptr + off, (lo + s).to(tl.int32), mask=active)
        if HAS_ESC:
            esc_now = active & (s == W)
            slot_e = tl.atomic_add(esc_count_ptr + k * 0, 1, mask=esc_now)
            tl.store(esc_key_ptr + slot_e, off.to(tl.int64), mask=esc_now & (slot_e < n_esc))
        off += K
    bad |= ((x != 65536) & lane_ok).to(tl.int32)
    bad |= (ptr != 0).to(tl.int32)[:, None]
    tl.store(bad_ptr + lane, bad, mask=lane_ok)


@triton.jit
def checksum_kernel(ptr, n, out_ptr, SKIP_LO: tl.constexpr, SKIP_HI: tl.constexpr, BLOCK: tl.constexpr):
    """Partial sums of rans.checksum over one block of the payload, bytes [SKIP_LO, SKIP_HI) left out."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    b = tl.load(ptr + offs, mask=m, other=0).to(tl.int64)
    b = tl.where((offs >= SKIP_LO) & (offs < SKIP_HI), 0, b)
    pos = tl.where(offs < SKIP_LO, offs, offs - (SKIP_HI - SKIP_LO))
    tl.atomic_add(out_ptr, tl.sum(b, 0))
    tl.atomic_add(out_ptr + 1, tl.sum(b * (pos % 65521 + 1), 0))


# ---------------------------------------------------------------------------------------------
# The compute codec's dense stages (used by shared/rdquant.py): PCA projection fused with the
# shared-step quantizer and the per-component statistics the rANS coder needs, and its inverse.


@triton.jit
def project_quantize_kernel(x_ptr, basis_ptr, bias_ptr, sym_ptr, mn_ptr, mx_ptr, sum_ptr, amax_ptr,
                            T, D, K, inv_step,
                            BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, UPCAST: tl.constexpr):
    """sym = round(((x @ basis) - bias) * inv_step), int32 [T, K]; with bias = mean @ basis.

    Also folds each column's min, max and integer sum into mn/mx/sum (atomics), and the largest
    |scaled value| into amax, so the caller can refuse int32 overflow."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < T
    cmask = cols < K
    acc = tl.zeros([BM, BN], tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < D
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * D + dd[None, :], mask=rmask[:, None] & dmask[None, :],
                    other=0.0)
        b = tl.load(basis_ptr + dd.to(tl.int64)[:, None] * K + cols[None, :], mask=dmask[:, None] & cmask[None, :],
                    other=0.0)
        if UPCAST:  # Triton's CPU interpreter cannot multiply bf16 tiles
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0)
    v = (acc - bias[None, :]) * inv_step
    m = rmask[:, None] & cmask[None, :]
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.where(m, tl.abs(v), 0.0), 1), 0))
    v = tl.minimum(tl.maximum(v, -2147483520.0), 2147483520.0)  # refused by the caller via amax
    s = tl.floor(v + 0.5).to(tl.int32)
    tl.store(sym_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], s, mask=m)
    big = 2147483647
    tl.atomic_min(mn_ptr + cols, tl.min(tl.where(m, s, big), 0), mask=cmask)
    tl.atomic_max(mx_ptr + cols, tl.max(tl.where(m, s, -big - 1), 0), mask=cmask)
    tl.atomic_add(sum_ptr + cols, tl.sum(tl.where(m, s, 0).to(tl.int64), 0), mask=cmask)


@triton.jit
def reconstruct_kernel(sym_ptr, basis_t_ptr, mean_ptr, out_ptr, T, D, K, step,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    """out = bf16((sym * step) @ basis_t + mean), [T, D]; basis_t is [K, D] bf16."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < T
    cmask = cols < D
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        s = tl.load(sym_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0)
        a = (s.to(tl.float32) * step).to(tl.bfloat16)
        b = tl.load(basis_t_ptr + kk.to(tl.int64)[:, None] * D + cols[None, :], mask=kmask[:, None] & cmask[None, :],
                    other=0.0)
        if UPCAST:  # Triton's CPU interpreter cannot multiply bf16 tiles
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0)
    out = (acc + mean[None, :]).to(tl.bfloat16)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], out, mask=rmask[:, None] & cmask[None, :])


# Tile shapes tried once per (D, K) on a GPU; the fastest is kept (triton.autotune).
_MATMUL_CONFIGS = [
    triton.Config(dict(BM=bm, BN=bn, BD=bd), num_warps=w, num_stages=st)
    for bm, bn, bd, w, st in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
                              (64, 128, 64, 4, 4)]
]
project_quantize_tuned = triton.autotune(_MATMUL_CONFIGS, key=["D", "K"], reset_to_zero=["sum_ptr"])(
    project_quantize_kernel)
_RECON_CONFIGS = [triton.Config(dict(BM=c.kwargs["BM"], BN=c.kwargs["BN"], BK=c.kwargs["BD"]),
                                num_warps=c.num_warps, num_stages=c.num_stages) for c in _MATMUL_CONFIGS]
reconstruct_tuned = triton.autotune(_RECON_CONFIGS, key=["D", "K"])(reconstruct_kernel)

"""Compiled CPU coder (numba) of the rANS format in shared/codecs/rans.py: the same bytes, fast.

    from shared.codecs import rans_cpu
    payload = rans_cpu.encode(symbols)        # numpy int32 [T, K] -> bytes, identical to rans.encode
    symbols = rans_cpu.decode(payload)        # bytes -> numpy int32 [T, K], identical to rans.decode
    rans_cpu.AVAILABLE, rans_cpu.WHY_NOT      # numba importable here? if not, why

The format, the table rules and every integer formula are those of rans.py and rans_tables.py (rans.py's
docstring is the specification; the numpy coder there stays the readable reference, the tests compare
the two byte for byte). Here they run as loops compiled by numba: one pass for each column's min, max and sum
(skipped when the caller passes `stats=`, as TensorCodec does from its quantizer's pass), one for
the histogram (row after row), one over components for windows, parametric models and frequency
tables, and one coding pass over lane groups (parallel over groups with numba's prange when
NUMBA_NUM_THREADS > 1). In the common group (32 consecutive components of one token chunk) each
coding step is a loop of table lookups, a branch-free loop that LLVM vectorizes (32-bit states;
the encoder divides by an exact reciprocal multiply, floor((2^32 - 1) / f) and one correction)
and a loop that appends (encoder) or reads (decoder) the renormalization words in lane order.
Compiled functions are cached on disk (cache=True), so only the first import on a machine pays the
compile time.

shared/codecs/rans_cpu_bench.py times TensorCodec's CPU path on this coder, stage by stage.
"""
from __future__ import annotations


import numpy as np

from ..errors import BackendUnavailable, BitstreamError, InvalidTensorError
from . import rans, rans_tables

try:
    import numba
    from numba import njit, prange

    if "NUMBA_THREADING_LAYER" not in __import__("os").environ:  # GNU OpenMP dies in a forked child
        numba.config.THREADING_LAYER = "forksafe"

    AVAILABLE, WHY_NOT = True, None
except ImportError as exc:  # the numpy reference coder still works
    AVAILABLE, WHY_NOT = False, f"numba is not installed ({exc}); pip install numba (see requirements.txt)"

    def njit(*args, **kwargs):
        return (lambda f: f) if not (len(args) == 1 and callable(args[0])) else args[0]

    prange = range

_JIT = dict(cache=True, nogil=True)
_BIG = 1 << 62
L = rans.STATE_LOW


_WARNED = []


def coder():
    """The fastest CPU coder here: this module, or the numpy reference where numba is missing
    (said once, as a warning)."""
    if AVAILABLE:
        import sys

        return sys.modules[__name__]
    if not _WARNED:
        import warnings

        warnings.warn(f"using the numpy rANS reference coder (about 100x slower): {WHY_NOT}", RuntimeWarning,
                      stacklevel=2)
        _WARNED.append(True)
    return rans


def _require():
    if not AVAILABLE:
        raise BackendUnavailable(f"compiled CPU rANS coder unavailable: {WHY_NOT}")


# --------------------------------------------------------------------------------------------
# integer helpers: the same formulas as rans.py's vectorized ones, one value at a time


@njit(**_JIT)
def _bitlen(v):
    n = 0
    while v > 0:
        v >>= 1
        n += 1
    return n


@njit(**_JIT)
def _minifloat_encode(v):
    if v < 32:
        return v
    e = max(_bitlen(v) - 4, 2)
    q = (v + (1 << (e - 2))) >> (e - 1)
    if q >= 32:
        e += 1
        q = 16
    return e * 16 + q - 16


@njit(**_JIT)
def _minifloat_decode(c):
    if c < 32:
        return c
    return (16 + (c & 15)) << max((c >> 4) - 1, 0)


@njit(**_JIT)
def _floordiv(a, b, inv_b):
    """a // b for 0 <= a < 2^52, 1 <= b, given inv_b = 1.0 / b: a float product, corrected exactly."""
    q = np.int64(a * inv_b)
    r = a - q * b
    return q + np.int64(r >= b) - np.int64(r < 0)


@njit(**_JIT)
def _model_weight(j, W, esc, shape, code, mu16, shapes, inv_sigma):
    if j < W:
        idx = min((abs(16 * j - mu16) * inv_sigma[code]) >> 24, shapes.shape[1] - 1)
        return max(shapes[shape, idx], 1)
    return 1 if (j == W and esc > 0) else 0


@njit(**_JIT)
def _normalize(w, A, M, prob_bits, f):
    """f[:A] = the frequencies of weights w[:A] summing to M (rans_tables.normalize_weights); False if impossible."""
    total = 0
    for j in range(A):
        total += w[j]
    if total <= 0:
        return False
    lo, hi = 1, 2 * M
    inv = 1.0 / total
    for _ in range(prob_bits + 2):
        mid = (lo + hi) // 2
        s = 0
        for j in range(A):
            if w[j] > 0:
                s += max(1, _floordiv(w[j] * mid, total, inv))
        if s <= M:
            lo = mid
        else:
            hi = mid
    s = 0
    jmax = 0
    for j in range(A):
        f[j] = max(1, _floordiv(w[j] * lo, total, inv)) if w[j] > 0 else 0
        s += f[j]
        if w[j] > w[jmax]:
            jmax = j
    f[jmax] += M - s
    return f[jmax] >= 0


# --------------------------------------------------------------------------------------------
# encoder passes


@njit(parallel=True, **_JIT)
def _column_stats(sym):
    """Per column: min, max, sum (int64)."""
    T, K = sym.shape
    nchunk = max(1, min(64, T // 256))
    mn = np.empty((nchunk, K), np.int64)
    mx = np.empty((nchunk, K), np.int64)
    sm = np.zeros((nchunk, K), np.int64)
    for c in prange(nchunk):
        t0, t1 = c * T // nchunk, (c + 1) * T // nchunk
        for k in range(K):
            mn[c, k] = sym[t0, k]
            mx[c, k] = sym[t0, k]
        for t in range(t0, t1):
            for k in range(K):
                v = np.int64(sym[t, k])
                mn[c, k] = min(mn[c, k], v)
                mx[c, k] = max(mx[c, k], v)
                sm[c, k] += v
    out_mn, out_mx, out_sm = mn[0].copy(), mx[0].copy(), sm[0].copy()
    for c in range(1, nchunk):
        for k in range(K):
            out_mn[k] = min(out_mn[k], mn[c, k])
            out_mx[k] = max(out_mx[k], mx[c, k])
            out_sm[k] += sm[c, k]
    return out_mn, out_mx, out_sm


@njit(parallel=True, **_JIT)
def _histogram(sym, stride, lo0, h0, H, nchunk):
    """counts [K, H] of the values of every stride-th token inside the first window: row after
    row (the symbols are read once, in memory order), one count table per chunk of rows."""
    T, K = sym.shape
    n_rows = (T + stride - 1) // stride
    nchunk = max(1, min(nchunk, n_rows // 256))
    part = np.zeros((nchunk, K * H), np.int32)  # n_rows < 2^31
    for c in prange(nchunk):
        cf = part[c]
        for r in range(c * n_rows // nchunk, (c + 1) * n_rows // nchunk):
            row = sym[r * stride]
            for k in range(K):
                j = np.uint64(np.int64(row[k]) - lo0[k])  # unsigned: below the window is out of range too
                if j < np.uint64(h0[k]):
                    cf[np.uint64(k * H) + j] += 1
    counts = np.zeros((K, H), np.int64)
    cflat = counts.ravel()
    for c in range(nchunk):
        for i in range(K * H):
            cflat[i] += part[c, i]
    return counts, n_rows


@njit(parallel=True, **_JIT)
def _tables(counts, h0, lo0, mn, mx, n_sampled, stride, prob_bits, shapes, inv_sigma, sigma16_sq, nlog,
            escape_cost, entry_cost, param_bytes, min_share, search):
    """rans_tables.choose_tables + rans_tables.fit_models + rans_tables.normalize_weights, one component at a time.

    Returns lo, W, esc, codes [K, H+1] uint8, model, scale, mu16, freq/cum [K, H+1] int64, ok [K]."""
    K, H = counts.shape
    M = 1 << prob_bits
    lo = np.empty(K, np.int64)
    W = np.empty(K, np.int64)
    esc = np.empty(K, np.int64)
    codes = np.zeros((K, H + 1), np.uint8)
    model = np.zeros(K, np.int64)
    scale = np.zeros(K, np.int64)
    mu16_out = np.zeros(K, np.int64)
    freq = np.zeros((K, H + 1), np.int64)
    cum = np.zeros((K, H + 1), np.int64)
    ok = np.ones(K, np.bool_)
    n_shapes = shapes.shape[0]
    shapes32 = shapes.astype(np.int32)  # values < 2^16
    nchunk = min(K, 64)  # scratch arrays per chunk of components, not per component
    n_d = 2 * search + 1
    for ch in prange(nchunk):
        cnt = np.empty(H, np.int64)
        kept = np.empty(H + 1, np.int64)
        w = np.empty(H + 1, np.int64)
        f = np.empty(H + 1, np.int64)
        idx = np.empty((n_d, H + 1), np.int32)  # 32-bit sample indices and weights: 16-wide gathers
        w32 = np.empty(H + 2, np.int32)
        nz = np.empty(H + 1, np.int64)
        kz = np.empty(H + 1, np.int64)
        for k in range(ch * K // nchunk, (ch + 1) * K // nchunk):
            cnt[:] = counts[k]
            outside0 = n_sampled
            for j in range(H):
                outside0 -= cnt[j]
            if stride > 1:
                for j in range(min(H, h0[k])):
                    cnt[j] += 1
            n_in = 0
            mode = 0
            for j in range(H):
                n_in += cnt[j]
                if cnt[j] > cnt[mode]:
                    mode = j
            # trimming: a = first argmin of cost_l, b = first argmin of cost_r
            incl = 0
            best_l, a, left_a = _BIG, 0, 0
            best_r, b, right_b = _BIG, 0, 0
            for j in range(H):
                left = incl
                incl += cnt[j]
                right = n_in - incl
                cl = escape_cost * stride * left - entry_cost * j if j <= mode else _BIG
                cr = entry_cost * j + escape_cost * stride * right if (j >= mode and j < h0[k]) else _BIG
                if j == 0 or cl < best_l:
                    best_l, a, left_a = cl, j, left
                if j == 0 or cr < best_r:
                    best_r, b, right_b = cr, j, right
            n_esc = outside0 + left_a + right_b
            Wk = b - a + 1
            lok = lo0[k] + a
            ek = 1 if (lok > mn[k] or lok + Wk - 1 < mx[k]) else 0
            kept[:] = 0
            for j in range(H):
                if j < Wk:
                    kept[j] = cnt[min(a + j, H - 1)]
            if Wk >= 0:
                kept[Wk] = max(n_esc, 1) if ek > 0 else 0
            kmax = 0
            for j in range(H + 1):
                kmax = max(kmax, kept[j])
            shift = max(_bitlen(kmax) - 18, 0)
            A = Wk + ek
            w[:] = 0
            for j in range(H + 1):
                if kept[j] > 0:
                    codes[k, j] = _minifloat_encode(max(kept[j] >> shift, 1))
                    w[j] = _minifloat_decode(np.int64(codes[k, j]))
            lo[k], W[k], esc[k] = lok, Wk, ek
            # parametric models (rans_tables.fit_models): moments of the in-window counts
            n = 0
            s1 = 0
            for j in range(min(Wk, H + 1)):
                n += kept[j]
                s1 += kept[j] * 16 * j
            n = max(n, 1)
            mu16 = s1 // n
            s2 = 0
            for j in range(min(Wk, H + 1)):
                d = 16 * j - mu16
                s2 += kept[j] * d * d
            var16 = s2 // n
            code0 = 0
            for c in range(sigma16_sq.shape[0]):
                if sigma16_sq[c] < var16:
                    code0 += 1
            f[:] = 0
            if not _normalize(w, A, M, prob_bits, f):  # w is 0 from A on
                ok[k] = False
                continue
            cost = 0
            for j in range(A):
                cost += kept[j] * nlog[f[j]]
            best = cost * stride + 8 * 65536 * A
            if min_share * 8 * 65536 * A >= best and mu16 <= 32767:  # a model's mean is stored as int16
                # the shape's sample index of each window symbol, per scale code tried (shape-independent)
                for d in range(n_d):
                    code = min(max(code0 + d - search, 0), 255)
                    for j in range(Wk):
                        idx[d, j] = min((abs(16 * j - mu16) * inv_sigma[code]) >> 24, shapes.shape[1] - 1)
                # nz, kz: the symbols that occur (kept > 0 implies w > 0), and their counts
                n_nz = 0
                for j in range(A):
                    if kept[j] > 0:
                        nz[n_nz] = j
                        kz[n_nz] = kept[j]
                        n_nz += 1
                for shape in range(n_shapes):
                    srow = shapes32[shape]
                    for d in range(n_d):  # the order of rans_tables.fit_models: ties keep the first
                        tot = ek
                        for j in range(Wk):
                            w32[j] = max(srow[idx[d, j]], 1)
                            tot += w32[j]
                        if ek > 0:
                            w32[Wk] = 1
                        # floor(w * M / tot) as a float product: w * M < 2^31 and tot < 2^29, so a
                        # fraction is 0 or >= 2^-29 while the product errs by < 2^-36: +2^-33 makes it exact
                        inv = M / tot
                        limit = (best - 8 * 65536 * param_bytes) // stride + 1  # terms are >= 0: stop once it cannot win
                        cost = 0
                        for i0 in range(0, n_nz, 16):
                            for i in range(i0, min(n_nz, i0 + 16)):
                                cost += kz[i] * nlog[max(1, np.int64(w32[nz[i]] * inv + 1.1641532182693481e-10))]
                            if cost >= limit:
                                break
                        cost = cost * stride + 8 * 65536 * param_bytes
                        if cost < best:
                            best = cost
                            model[k] = 1 + shape
                            scale[k] = min(max(code0 + d - search, 0), 255)
            if model[k] > 0:
                mu16_out[k] = mu16
                for j in range(H + 1):
                    w[j] = _model_weight(j, Wk, ek, model[k] - 1, scale[k], mu16, shapes, inv_sigma)
            else:
                for j in range(H + 1):
                    w[j] = _minifloat_decode(np.int64(codes[k, j]))
            if not _normalize(w, A, M, prob_bits, f):  # w is 0 from A on
                ok[k] = False
                continue
            c = 0
            for j in range(H + 1):
                freq[k, j] = f[j]
                cum[k, j] = c
                c += f[j]
    return lo, W, esc, codes, model, scale, mu16_out, freq, cum, ok


@njit(**_JIT)
def _lane_layout(g0, G, K, S, P, by_component):
    """First token and component of each lane of the group starting at lane g0 (lane g = p * K + k,
    or k * P + p by_component)."""
    row0 = np.empty(G, np.int64)
    comp = np.empty(G, np.int64)
    for l in range(G):
        if by_component:
            k = (g0 + l) // P
            row0[l] = (g0 + l - k * P) * S
            comp[l] = k
        else:
            p = (g0 + l) // K
            comp[l] = g0 + l - p * K
            row0[l] = p * S
    return row0, comp


@njit(**_JIT)
def _encode_group_fast(sym, r0, k0, lo, W, fc, rcp, S, G, prob_bits, x, words, base, escv):
    """The coding pass of one group whose G lanes are consecutive components k0.. of one full token
    chunk starting at row r0 (the common case); x: the lanes' states (uint32). Per step: one loop
    gathers each lane's table entry, a branch-free one (vectorized, 32-bit but for the product
    of the division) updates the states, with an exact reciprocal-multiply division, and one
    appends the emitted words in lane order. Returns (words written, escapes written)."""
    A1 = fc.shape[1]
    fcf = fc.ravel()
    rcf = rcp.ravel()
    symf = sym.ravel()
    K = sym.shape[1]
    sh = np.uint32(32 - prob_bits)
    n = np.uint32(prob_bits)
    fv = np.empty(G, np.uint32)
    rv = np.empty(G, np.uint32)
    emw = np.empty(G, np.uint16)
    em = np.empty(G, np.uint8)
    lo32 = np.empty(G, np.int32)
    w32 = np.empty(G, np.uint32)
    tbase = np.empty(G, np.uint64)
    for l in range(G):
        lo32[l] = lo[k0 + l]
        w32[l] = W[k0 + l]
        tbase[l] = (k0 + l) * A1
    ptr = 0
    ne = 0
    for ii in range(S):
        row = np.uint64((r0 + S - 1 - ii) * K + k0)  # tokens last to first
        n_out = 0
        for l in range(G):  # unsigned indices: no negative-index wraparound in the loops
            # v - lo taken mod 2^32: below the window wraps past every window (lo + W - 1 < 2^31)
            j = np.uint32(symf[row + np.uint64(l)] - lo32[l])
            out = j >= w32[l]  # below or above the window: the escape symbol
            n_out += out
            idx = tbase[l] + np.uint64(w32[l] if out else j)
            fv[l] = fcf[idx]
            rv[l] = rcf[idx]
        for l in range(G):
            xl = x[l]
            e = fv[l]
            f = e & np.uint32(0xFFFF)
            emit = (xl >> sh) >= f
            emw[l] = np.uint16(xl & np.uint32(0xFFFF))
            em[l] = np.uint8(emit)
            xl = (xl >> np.uint32(16)) if emit else xl
            q = np.uint32((np.uint64(xl) * np.uint64(rv[l])) >> np.uint64(32))  # floor(xl / f) or one less
            r = xl - q * f
            up = r >= f
            q = q + np.uint32(up)
            r = r - (f if up else np.uint32(0))
            x[l] = (q << n) + r + (e >> np.uint32(16))
        for l in range(G):
            words[base + ptr] = emw[l]  # kept only when emitted
            ptr += em[l]
        if n_out > 0:
            for l in range(G):
                v = symf[row + np.uint64(l)]
                j = np.int64(v) - lo[k0 + l]
                if j < 0 or j >= W[k0 + l]:
                    escv[base + ne] = v
                    ne += 1
    return ptr, ne


@njit(**_JIT)
def _encode_table(freq, cum):
    """Per (component, symbol): fc = freq | cum << 16 and rcp = floor((2^32 - 1) / freq), uint32.

    After renormalization a state x is below freq * 2^(32 - prob_bits), so x * rcp < 2^54 and
    (x * rcp) >> 32 is floor(x / freq) or one less: one correction step makes it exact."""
    K, A1 = freq.shape
    fc = np.empty((K, A1), np.uint32)
    rcp = np.empty((K, A1), np.uint32)
    for k in range(K):
        for j in range(A1):
            f = max(freq[k, j], 1)
            fc[k, j] = np.uint32((f & 0xFFFF) | ((cum[k, j] & 0xFFFF) << 16))
            rcp[k, j] = np.uint32(4294967295 // f)
    return fc, rcp


@njit(parallel=True, **_JIT)
def _encode_lanes(sym, lo, W, fc, rcp, S, G, NG, prob_bits, by_component):
    """The coding pass. Per group: words [cap] and escapes [cap] in its slice of the buffers,
    counts in group_words / group_escapes; final states per lane. fc, rcp: _encode_table."""
    T, K = sym.shape
    P = (T + S - 1) // S
    NL = P * K
    cap = G * S
    words = np.empty(NG * cap, np.uint16)
    escv = np.empty(NG * cap, np.int32)
    group_words = np.zeros(NG, np.int64)
    group_escapes = np.zeros(NG, np.int64)
    states = np.empty(NG * G, np.uint32)
    sh = 32 - prob_bits
    for gi in prange(NG):
        g0 = gi * G
        n_lane = min(G, NL - g0)
        x = np.full(G, L, np.uint32)
        row0, comp = _lane_layout(g0, G, K, S, P, by_component)
        ptr = 0
        ne = 0
        base = gi * cap
        if not by_component and n_lane == G and comp[0] + G <= K and row0[0] + S <= T:
            ptr, ne = _encode_group_fast(sym, row0[0], comp[0], lo, W, fc, rcp, S, G, prob_bits, x, words, base,
                                         escv)
            n_lane = 0  # done
        for i in range(S - 1, -1, -1):
            for l in range(n_lane):
                t = row0[l] + i
                if t >= T:
                    continue
                k = comp[l]
                v = sym[t, k]
                j = np.int64(v) - lo[k]
                if j < 0 or j >= W[k]:
                    j = W[k]
                    escv[base + ne] = v
                    ne += 1
                e = np.int64(fc[k, j])
                f = e & 0xFFFF  # prob_bits <= 15: frequencies and cumulatives fit 16 bits
                xl = np.int64(x[l])
                emit = np.int64((xl >> sh) >= f)
                words[base + ptr] = np.uint16(xl & 0xFFFF)  # kept only when emitted (ptr advances)
                ptr += emit
                xl >>= 16 * emit
                q = (xl * np.int64(rcp[k, j])) >> 32
                r = xl - q * f
                if r >= f:
                    q += 1
                    r -= f
                x[l] = np.uint32((q << prob_bits) + r + (e >> 16))
        group_words[gi] = ptr
        group_escapes[gi] = ne
        for l in range(G):
            states[g0 + l] = x[l]
    return words, escv, group_words, group_escapes, states


@njit(parallel=True, **_JIT)
def _gather(buf, counts, cap, out):
    """Concatenate the first counts[g] entries of each group's slice of buf into out."""
    NG = counts.shape[0]
    start = np.zeros(NG + 1, np.int64)
    for g in range(NG):
        start[g + 1] = start[g] + counts[g]
    for g in prange(NG):
        out[start[g]:start[g + 1]] = buf[g * cap:g * cap + counts[g]]


@njit(parallel=True, **_JIT)
def _checksum_parts(a, b, pos_b):
    """rans.checksum over two byte arrays, b's positions starting at pos_b."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    for i in range(a.shape[0]):
        s0 += np.uint64(a[i])
        s1 += np.uint64(a[i]) * np.uint64(i % 65521 + 1)
    n = b.shape[0]
    block = 65521 * 16
    nb = (n + block - 1) // block
    p0 = np.zeros(nb, np.uint64)
    p1 = np.zeros(nb, np.uint64)
    for c in prange(nb):
        i0 = c * block
        i1 = min(n, i0 + block)
        t0 = 0
        t1 = 0
        i = i0
        while i < i1:  # segments over which the weight (position mod 65521 + 1) rises by one per byte
            w0 = (pos_b + i) % 65521
            e = min(i1, i + 65521 - w0)
            u0 = 0
            u1 = 0
            for m in range(i, e):
                v = np.int64(b[m])
                u0 += v
                u1 += v * (m - i)
            t0 += u0
            t1 += u1 + (w0 + 1) * u0
            i = e
        p0[c] = np.uint64(t0)
        p1[c] = np.uint64(t1)
    for c in range(nb):
        s0 += p0[c]
        s1 += p1[c]
    return s0 & np.uint64(0xFFFFFFFF), s1 & np.uint64(0xFFFFFFFF)


def checksum(*parts) -> tuple[int, int]:
    """rans.checksum (same values), compiled: the parts are the checked header bytes and the rest."""
    _require()
    head = np.frombuffer(parts[0], np.uint8)
    c0, c1 = _checksum_parts(head, np.zeros(0, np.uint8), len(head))
    pos = len(head)
    for part in parts[1:]:  # the sums are additive: each part alone at its position, no join
        b = np.frombuffer(part, np.uint8)
        p0, p1 = _checksum_parts(np.zeros(0, np.uint8), b, pos)
        c0, c1, pos = c0 + p0, c1 + p1, pos + len(b)
    return int(c0) & 0xFFFFFFFF, int(c1) & 0xFFFFFFFF


def encode(symbols: np.ndarray, prob_bits: int | None = None, group_lanes: int = rans.DEFAULT_GROUP_LANES,
           lane_tokens: int | None = None, stats=None, lanes_by_component: bool = False) -> bytes:
    """rans.encode, compiled: the identical payload. stats: each column's (min, max, sum) of the
    symbols, when the caller has them (RDQuantizer.quantize_with_stats makes them in its pass)."""
    _require()
    sym = rans._validate_symbols(symbols)
    T, K = sym.shape
    prob_bits = rans.default_prob_bits(T) if prob_bits is None else prob_bits
    S = rans._check_settings(prob_bits, group_lanes, lane_tokens or rans.default_lane_tokens(T, K), T)
    G = group_lanes
    if stats is None:
        mn, mx, sm = _column_stats(sym)
    else:
        mn, mx, sm = (np.asarray(v, np.int64).reshape(-1) for v in stats)
        if not mn.shape == mx.shape == sm.shape == (K,):
            raise InvalidTensorError(f"stats must be three arrays of {K} column statistics (min, max, sum), got "
                                     f"shapes {mn.shape}, {mx.shape}, {sm.shape}")
    lo0, h0 = rans_tables.initial_windows(mn, mx, sm, T, prob_bits)
    stride = rans_tables.hist_row_stride(T)
    H = int(h0.max())
    counts, n_sampled = _histogram(sym, stride, lo0, h0, H, numba.get_num_threads())
    tab = rans_tables.model_tables()
    lo, W, esc, codes, model, scale, mu16, freq, cum, ok = _tables(
        counts, h0, lo0, mn, mx, n_sampled, stride, prob_bits, tab["shapes"], tab["inv_sigma"], tab["sigma16_sq"],
        rans_tables._neg_log2_table(prob_bits), rans_tables.ESCAPE_COST, rans_tables.TABLE_ENTRY_COST, rans_tables.PARAM_BYTES,
        rans_tables.MODEL_MIN_SHARE, rans_tables.MODEL_SEARCH)
    if not ok.all():
        raise BitstreamError("a component's frequency table cannot be normalized")
    lay = rans.Layout(T, K, S, G, 0, 0, 0, flags=rans.LANES_BY_COMPONENT if lanes_by_component else 0)
    words, escv, group_words, group_escapes, states = _encode_lanes(sym, lo, W, *_encode_table(freq, cum), S, G,
                                                                    lay.n_groups, prob_bits, lay.by_component)
    cap = G * S
    streams = np.empty(int(group_words.sum()), np.uint16)
    _gather(words, group_words, cap, streams)
    escapes = np.empty(int(group_escapes.sum()), np.int32)
    _gather(escv, group_escapes, cap, escapes)
    return rans._assemble(lay, prob_bits, lo, W, esc, codes, model, scale, mu16, group_words.astype(np.uint32),
                          group_escapes, escapes, states[:lay.n_lanes][lay.coded_lanes(W + esc)], streams,
                          checksum_fn=checksum)


# --------------------------------------------------------------------------------------------
# decoder


@njit(parallel=True, **_JIT)
def _decode_tables(codes_flat, model, scale, mu16, W, esc, prob_bits, shapes, inv_sigma, lut):
    """Per component: packed (freq | cum << 16) [K, A1] and, into lut [K, M] (uint8 where every
    alphabet fits: half the cache), the slot -> symbol table."""
    K = W.shape[0]
    M = 1 << prob_bits
    A = W + esc
    A1 = 1
    for k in range(K):
        A1 = max(A1, A[k])
    offs = np.zeros(K + 1, np.int64)
    for k in range(K):
        offs[k + 1] = offs[k] + (A[k] if model[k] == 0 else 0)
    fc = np.zeros((K, A1), np.uint32)
    ok = np.ones(K, np.bool_)
    for k in prange(K):
        w = np.zeros(A1, np.int64)
        for j in range(A[k]):
            if model[k] == 0:
                w[j] = _minifloat_decode(np.int64(codes_flat[offs[k] + j]))
            else:
                w[j] = _model_weight(j, W[k], esc[k], model[k] - 1, scale[k], mu16[k], shapes, inv_sigma)
        f = np.zeros(A1, np.int64)
        if not _normalize(w, A[k], M, prob_bits, f):  # w is 0 from A[k] on
            ok[k] = False
            continue
        c = 0
        for j in range(A1):
            fc[k, j] = np.uint32(f[j] | (c << 16))
            for s in range(c, c + f[j]):
                lut[k, s] = j
            c += f[j]
    return fc, lut, ok


@njit(**_JIT)
def _decode_group_fast(words, wb, ptr, states, g0, escapes, eb, eptr, fc, lut, lo, esc_sym, r0, k0, S, G, prob_bits,
                       out):
    """The decoding pass of one group whose G lanes are consecutive components k0.. of one full
    token chunk starting at row r0 (the common case). Per step: one loop looks up each lane's
    symbol and table entry, a branch-free one (vectorized, 32-bit: a state stays below 2^32)
    updates the states and writes the values, one lists the lanes that renormalize and one
    reads their words, in lane order. Returns (words left, escapes left, error: 0 ok, 1 streams,
    2 escapes)."""
    K = out.shape[1]
    A1 = fc.shape[1]
    M = lut.shape[1]
    fcf = fc.ravel()
    lutf = lut.ravel()
    outf = out.ravel()
    n = np.uint32(prob_bits)
    mask = np.uint32((1 << prob_bits) - 1)
    x = np.empty(G, np.uint32)
    sv = np.empty(G, np.uint32)
    fv = np.empty(G, np.uint32)
    need = np.empty(G, np.int64)
    lo32 = np.empty(G, np.int32)
    es32 = np.empty(G, np.int32)
    for l in range(G):
        x[l] = states[g0 + l]
        lo32[l] = lo[k0 + l]
        es32[l] = esc_sym[k0 + l]
    esc_bad = False
    for i in range(S):
        row = np.uint64((r0 + i) * K + k0)
        for l in range(G):
            s = lutf[np.uint64((k0 + l) * M) + np.uint64(x[l] & mask)]
            sv[l] = s
            fv[l] = fcf[np.uint64((k0 + l) * A1) + np.uint64(s)]
        n_esc = 0
        for l in range(G):
            xl = x[l]
            e = fv[l]
            x[l] = (e & np.uint32(0xFFFF)) * (xl >> n) + (xl & mask) - (e >> np.uint32(16))
            n_esc += np.int32(sv[l]) == es32[l]
            outf[row + np.uint64(l)] = np.int32(sv[l]) + lo32[l]
        m = 0
        for l in range(G):
            need[m] = l
            m += x[l] < np.uint32(L)
        if m > 0:
            ptr -= m
            if ptr < 0:
                return 0, eptr, 1
            r = wb + ptr  # the words of this step, lanes in order (r + m <= the group's end)
            for q in range(m):
                l = need[q]
                x[l] = (x[l] << np.uint32(16)) | np.uint32(words[r + q])
        if n_esc > 0:
            eptr -= n_esc
            if eptr < 0:  # as the general pass: flagged, the values stay, a stream error wins
                esc_bad = True
                eptr = 0
                continue
            r = eb + eptr
            for l in range(G):
                if np.int32(sv[l]) == es32[l]:
                    outf[row + np.uint64(l)] = escapes[r]
                    r += 1
    for l in range(G):
        if x[l] != L:
            return ptr, eptr, 1
    return ptr, eptr, 2 if esc_bad else 0


@njit(parallel=True, **_JIT)
def _decode_lanes(words, group_words, states, escapes, group_escapes, fc, lut, lo, W, esc, T, K, S, G, prob_bits,
                  by_component):
    """The decoding pass; out int32 [T, K] and an error code per group (0 ok, 1 streams, 2 escapes)."""
    NG = group_words.shape[0]
    NL = states.shape[0]
    mask = (1 << prob_bits) - 1
    out = np.empty((T, K), np.int32)
    err = np.zeros(NG, np.int64)
    wstart = np.zeros(NG + 1, np.int64)
    estart = np.zeros(NG + 1, np.int64)
    for g in range(NG):
        wstart[g + 1] = wstart[g] + group_words[g]
        estart[g + 1] = estart[g] + group_escapes[g]
    esc_sym = np.where(esc > 0, W, -1)  # each component's escape symbol, -1: none
    n_words = words.shape[0]
    for gi in prange(NG):
        g0 = gi * G
        n_lane = min(G, NL - g0)
        x = np.empty(G, np.int64)
        row0, comp = _lane_layout(g0, G, K, S, NL // K, by_component)
        sy = np.empty(G, np.int64)
        for l in range(n_lane):
            x[l] = states[g0 + l]
        ptr = group_words[gi]
        eptr = group_escapes[gi]
        wb = wstart[gi]
        eb = estart[gi]
        bad = False
        if not by_component and n_lane == G and comp[0] + G <= K and row0[0] + S <= T:
            ptr, eptr, err[gi] = _decode_group_fast(words, wb, ptr, states, g0, escapes, eb, eptr, fc, lut, lo,
                                                    esc_sym, row0[0], comp[0], S, G, prob_bits, out)
            if ptr != 0:
                err[gi] = 1
            elif eptr != 0:
                err[gi] = max(err[gi], 2)
            continue
        for i in range(S):
            # pass 1: every lane's symbol and state before renormalization
            n_need = 0
            n_esc = 0
            for l in range(n_lane):
                t = row0[l] + i
                k = comp[l]
                live = t < T  # lanes of the last chunk stop at its end
                xl = x[l]
                slot = xl & mask
                s = np.int64(lut[k, slot])
                e = np.int64(fc[k, s])
                xn = (e & 0xFFFF) * (xl >> prob_bits) + slot - (e >> 16)
                x[l] = xn if live else xl
                sy[l] = s if live else -2
                n_need += live & (xn < L)
                n_esc += live & (s == esc_sym[k])
            # pass 2: the words, read back from the end of the group's stream, lanes in order
            if n_need > 0:
                ptr -= n_need
                if ptr < 0:
                    bad = True
                    break
                r = wb + ptr
                for l in range(n_lane):
                    nd = x[l] < L
                    w = np.int64(words[min(r, n_words - 1)])
                    x[l] = ((x[l] << 16) | w) if nd else x[l]
                    r += nd
            # pass 3: values, escapes from the end of the group's escape list
            if n_esc > 0:
                eptr -= n_esc
                if eptr < 0:
                    err[gi] = 2
                    eptr = 0
                    n_esc = 0
            r = eb + eptr
            for l in range(n_lane):
                s = sy[l]
                if s == -2:
                    continue
                k = comp[l]
                if n_esc > 0 and s == esc_sym[k]:
                    out[row0[l] + i, k] = escapes[r]
                    r += 1
                else:
                    out[row0[l] + i, k] = np.int32(s + lo[k])
        if not bad and ptr == 0:
            for l in range(n_lane):
                if x[l] != L:
                    bad = True
        if bad or ptr != 0:
            err[gi] = 1
        elif eptr != 0:
            err[gi] = 2
    return out, err


def parse(payload, max_elements: int | None = None) -> rans.Parsed:
    """rans.parse with the compiled checksum."""
    return rans.parse(payload, max_elements, checksum_fn=checksum)


def decode(payload, max_elements: int | None = None) -> np.ndarray:
    """rans.decode, compiled: payload bytes -> int32 [T, K], the identical symbols and errors
    (a payload declaring more than max_elements values is refused before decoding)."""
    _require()
    if isinstance(payload, np.ndarray):
        payload = payload.tobytes()
    hdr = parse(payload, max_elements)
    lay, n = hdr.layout, hdr.prob_bits
    tab = rans_tables.model_tables()
    lut = np.empty((hdr.K, 1 << n), np.uint8 if int(hdr.A.max()) <= 256 else np.uint16)
    fc, lut, ok = _decode_tables(np.asarray(hdr.codes_flat), hdr.model, hdr.scale, hdr.mu16, hdr.W, hdr.esc, n,
                                 tab["shapes"], tab["inv_sigma"], lut)
    if not ok.all():
        raise BitstreamError("a component's frequency table cannot be normalized; the payload is corrupt")
    mv = memoryview(payload)
    states = np.full(lay.n_lanes, L, np.uint32)
    states[lay.coded_lanes(hdr.A)] = np.frombuffer(mv[lay.states:lay.streams], "<u4")
    if (states < L).any():
        raise BitstreamError("rANS payload lane states are corrupt")
    words = np.frombuffer(mv[lay.streams:lay.total], "<u2")
    out, err = _decode_lanes(words, hdr.group_words, states, np.asarray(hdr.escapes), hdr.group_escapes, fc, lut,
                             hdr.lo, hdr.W, hdr.esc, hdr.T, hdr.K, hdr.S, hdr.G, n, lay.by_component)
    if (err == 1).any():
        raise BitstreamError("rANS payload streams are corrupt (lane states do not return to their start)")
    if (err == 2).any():
        raise BitstreamError("rANS payload escape counts do not match the decoded escape symbols")
    return out

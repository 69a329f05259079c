"""Frequency tables of the compute codec's rANS format: the integer rules that both coders (the
numpy reference in rans.py, the Triton kernels of rans_cuda.py) compute identically from a
component's statistics and sampled histogram, and the parametric models that replace a table
with 3 bytes. Depends on nothing of the format or the coders (they import from here).
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import BitstreamError

ESCAPE_COST = 5  # bytes an escaped value costs (4 raw + its escape code), for window trimming
TABLE_ENTRY_COST = 1  # bytes one table entry costs
HIST_SAMPLE_ROWS = 32768  # tokens sampled for the frequency tables of a long tensor (hist_row_stride)
HIST_HALF_TOKENS = 1024  # from this many tokens on, the tables sample at most every 2nd token
_BIG = 1 << 62


def max_alphabet(prob_bits: int) -> int:
    """Largest per-component alphabet (window + escape); wider ranges escape their tails."""
    return 1 << (prob_bits - 2)


# --------------------------------------------------------------------------------------------
# Table construction: integer-only, shared by the CPU coder and mirrored exactly by the Triton
# kernels (tested against each other).


def _bitlen(v: np.ndarray) -> np.ndarray:
    """Number of bits of non-negative int64 values below 2^53 (0 -> 0)."""
    return np.frexp(v.astype(np.float64))[1].astype(np.int64)


def minifloat_encode(v: np.ndarray) -> np.ndarray:
    """Nearest 8-bit minifloat code of integer weights 0 <= v < 2^18 (exact below 32)."""
    v = np.asarray(v, np.int64)
    e = np.maximum(_bitlen(v) - 4, 2)
    q = (v + (np.int64(1) << (e - 2))) >> (e - 1)
    carry = q >= 32
    e = e + carry
    q = np.where(carry, 16, q)
    return np.where(v < 32, v, e * 16 + q - 16).astype(np.uint8)


def minifloat_decode(code: np.ndarray) -> np.ndarray:
    c = np.asarray(code, np.int64)
    e = c >> 4
    return np.where(c < 32, c, (16 + (c & 15)) << np.maximum(e - 1, 0))


def initial_windows(mn, mx, sm, T: int, prob_bits: int):
    """First window [lo0, lo0 + h0) per component from its min, max and integer sum.

    Ranges up to the maximum alphabet are taken whole; wider ones are centred on the floor of
    the mean and leave room for the escape symbol."""
    a_max = max_alphabet(prob_bits)
    mn, mx, sm = (np.asarray(a, np.int64) for a in (mn, mx, sm))
    span = mx - mn + 1
    wide = span > a_max
    h0 = np.where(wide, a_max - 1, span)
    centre = sm // T
    lo0 = np.where(wide, np.clip(centre - (a_max - 1) // 2, mn, mx - h0 + 1), mn)
    return lo0, h0


def hist_row_stride(T: int) -> int:
    """Rows between the tokens whose values make the frequency tables: every token below
    HIST_HALF_TOKENS tokens, every 2nd one up to 2 * HIST_SAMPLE_ROWS tokens, then about
    HIST_SAMPLE_ROWS evenly spaced ones (a sample this size costs ~0.3% of ratio). The GPU's
    histogram is bound by its work per sampled value (PoC 09 --profile: 78 us for 60
    tensors of [1024, 192], a sixth of their encoding), so every 2nd token halves its work for
    a few tenths of a percent of bytes (test_sampled_tables_cost_little); shorter tensors, where a
    sample costs more, keep every token."""
    return max(2 if T >= HIST_HALF_TOKENS else 1, T // HIST_SAMPLE_ROWS)


def choose_tables(counts: np.ndarray, h0, lo0, mn, mx, n_sampled: int, stride: int):
    """Trim each component's window and make its weight codes.

    counts: [K, H] int64 histogram of the sampled values (every stride-th token, n_sampled of
    them) inside the first window [lo0, lo0 + h0); mn, mx: the component's exact extremes.
    Returns (lo, W, esc, codes [K, H+1] uint8, kept [K, H+1]): the kept window is [lo, lo + W);
    esc is 1 when the window does not cover [mn, mx], and codes then hold an escape symbol after
    the W others; kept holds the counts the codes were made from (escapes at column W).

    Tails are trimmed where escaping their values (ESCAPE_COST bytes each, counted as stride
    values per sampled one) is cheaper than their table entries (TABLE_ENTRY_COST each); the
    window always keeps the mode. With a sample (stride > 1) every value of the first window
    counts at least once (for trimming and weights alike), because values the sample missed may
    still occur: a rare tail value is then kept rather than escaped at a cost the sample hides."""
    counts = np.asarray(counts, np.int64)
    h0, lo0, mn, mx = (np.asarray(v, np.int64) for v in (h0, lo0, mn, mx))
    K, H = counts.shape
    j = np.arange(H, dtype=np.int64)[None, :]
    outside0 = n_sampled - counts.sum(1)  # sampled values outside the first window
    if stride > 1:  # the sample may miss a value that occurs: count each one at least once
        counts = counts + (j < h0[:, None])
    n_in = counts.sum(1)
    mode = counts.argmax(1)[:, None]
    incl = np.cumsum(counts, 1)
    left_out = incl - counts  # values below j
    right_out = n_in[:, None] - incl  # values above j
    cost_l = np.where(j <= mode, ESCAPE_COST * stride * left_out - TABLE_ENTRY_COST * j, _BIG)
    cost_r = np.where((j >= mode) & (j < h0[:, None]), TABLE_ENTRY_COST * j + ESCAPE_COST * stride * right_out,
                      _BIG)
    a = cost_l.argmin(1)
    b = cost_r.argmin(1)
    rows = np.arange(K)
    n_esc = outside0 + left_out[rows, a] + right_out[rows, b]
    W = b - a + 1
    lo = lo0 + a
    esc = ((lo > mn) | (lo + W - 1 < mx)).astype(np.int64)
    src = a[:, None] + j
    kept = np.where(j < W[:, None], counts[rows[:, None], np.minimum(src, H - 1)], 0)
    kept = np.concatenate([kept, np.zeros((K, 1), np.int64)], 1)
    kept[rows, W] = np.where(esc > 0, np.maximum(n_esc, 1), 0)
    shift = np.maximum(_bitlen(kept.max(1)) - 18, 0)[:, None]
    weights = np.where(kept > 0, np.maximum(kept >> shift, 1), 0)
    return lo, W, esc, minifloat_encode(weights), kept


# --------------------------------------------------------------------------------------------
# Parametric tables. A component's weights can come from 3 bytes instead of one byte per symbol:
# a shape (Gaussian, exp(-|x|^1.5), Laplace, Student-t with 3 degrees of freedom), a centre mu16
# (1/16 symbol, from the window's start) and a scale code (sigma = 2^(code/8 - 2) symbols). The
# weight of symbol j is SHAPES[shape][min(|16 j - mu16| * INV_SIGMA[code] >> 24, 1023)] (at
# least 1), i.e. the shape at x = |j - mu| / sigma sampled every 1/64; an escape symbol weighs 1.
# The integer tables are data (rans_models.npz, made by make_model_tables()), so every machine
# computes the same frequencies. The encoder keeps a component's explicit table unless the model
# codes its (sampled) values in fewer bytes, tables included.

N_SHAPES, SHAPE_STEPS = 4, 1024  # shapes; samples per shape, every 1/64 of sigma
MODEL_SEARCH = 1  # scale codes tried on each side of the moment estimate (4: 0.03% fewer bytes on real K, 1.4x the GPU table time)
PARAM_BYTES = 3  # mu16 (int16) + scale code (uint8)
MU16_MAX = 2**15 - 1  # the largest stored mean (16 x the mean's index): n >= 14 windows can reach past it
MODEL_MIN_SHARE = 64  # models are tried where the explicit table is at least 1/64 of a component's bytes
_MODEL_TABLES = None


def make_model_tables() -> dict:
    """The integer tables of the parametric model, from their formulas (float64, rounded)."""
    x = np.arange(SHAPE_STEPS) / 64.0
    shapes = [np.exp(-x ** 2 / 2), np.exp(-1.2 * x ** 1.5), np.exp(-np.sqrt(2) * x), (1 + x ** 2 / 3) ** -2.0]
    code = np.arange(256)
    return dict(shapes=np.rint(65535 * np.stack(shapes)).astype(np.int64),
                inv_sigma=np.rint(2.0 ** (28 - code / 8)).astype(np.int64),  # 2^26 / sigma
                sigma16_sq=np.minimum(np.rint(2.0 ** (code / 4 + 4)), 2.0 ** 62).astype(np.int64))  # (16 sigma)^2


def model_tables() -> dict:
    global _MODEL_TABLES
    if _MODEL_TABLES is None:
        with np.load(os.path.join(os.path.dirname(__file__), "rans_models.npz")) as f:
            _MODEL_TABLES = {k: f[k].astype(np.int64) for k in f.files}
    return _MODEL_TABLES


def model_weights(shape, code, mu16, W, esc, H: int) -> np.ndarray:
    """Weights [K, H] of parametric components (shape 0..3, scale code, centre mu16, window W,
    escape flag): what both coders normalize."""
    tab = model_tables()
    j = np.arange(H, dtype=np.int64)[None, :]
    shape, code, mu16, W, esc = (np.asarray(v, np.int64)[:, None] for v in (shape, code, mu16, W, esc))
    idx = np.minimum((np.abs(16 * j - mu16) * tab["inv_sigma"][code]) >> 24, SHAPE_STEPS - 1)
    w = np.maximum(tab["shapes"][shape, idx], 1)
    return np.where(j < W, w, np.where((j == W) & (esc > 0), 1, 0))


def _neg_log2_table(prob_bits: int) -> np.ndarray:
    """-log2(f / 2^n) in units of 2^-16 bit, for f = 0..2^n (f = 0 never occurs in a table)."""
    M = 1 << prob_bits
    f = np.arange(M + 1, dtype=np.float64)
    out = np.rint(65536 * (prob_bits - np.log2(np.maximum(f, 1)))).astype(np.int64)
    out[0] = 1 << 40
    return out


def fit_models(kept: np.ndarray, W, esc, A, codes, prob_bits: int, stride: int):
    """Per component: the parametric model that codes its counts (kept [K, H], escape count at
    column W) in the fewest bits, and whether it beats the explicit table (codes). A model's
    cost uses its unnormalized frequencies max(1, w * 2^n // sum(w)), one pass instead of the
    bisection; the chosen model's table is then normalized exactly.
    Returns (model [K] 0 = explicit / 1 + shape, scale code [K], mu16 [K]). Integer only, the
    same rule as the GPU tables kernel."""
    kept = np.asarray(kept, np.int64)
    W, esc, A = (np.asarray(v, np.int64) for v in (W, esc, A))
    K, H = kept.shape
    tab = model_tables()
    nlog = _neg_log2_table(prob_bits)
    j = np.arange(H, dtype=np.int64)[None, :]
    inside = np.where(j < W[:, None], kept, 0)
    n = np.maximum(inside.sum(1), 1)
    mu16 = (inside * 16 * j).sum(1) // n
    var16 = (inside * (16 * j - mu16[:, None]) ** 2).sum(1) // n
    code0 = (tab["sigma16_sq"][None, :] < var16[:, None]).sum(1)
    f_exp = normalize_weights(minifloat_decode(codes[:, :H]), prob_bits)[0]
    best = (kept * nlog[f_exp]).sum(1) * stride + 8 * 65536 * A  # explicit: its stream and its table
    # a model saves at most the table; where that is under 1/64 of the cost, it is not searched for
    # and a model's mean is stored as int16: a window whose mean lies past index 2047 keeps its table
    eligible = (MODEL_MIN_SHARE * 8 * 65536 * A >= best) & (mu16 <= MU16_MAX)
    model = np.zeros(K, np.int64)
    best_code = np.zeros(K, np.int64)
    for shape in range(N_SHAPES):
        for d in range(-MODEL_SEARCH, MODEL_SEARCH + 1):
            code = np.clip(code0 + d, 0, 255)
            w = model_weights(np.full(K, shape), code, mu16, W, esc, H)
            f = np.where(w > 0, np.maximum(1, w * (1 << prob_bits) // w.sum(1, keepdims=True)), 0)  # cost proxy
            cost = (kept * nlog[f]).sum(1) * stride + 8 * 65536 * PARAM_BYTES
            better = eligible & (cost < best)
            best = np.where(better, cost, best)
            model = np.where(better, 1 + shape, model)
            best_code = np.where(better, code, best_code)
    return model, best_code, np.where(model > 0, mu16, 0)


def normalize_weights(w: np.ndarray, prob_bits: int):
    """Frequencies summing to 2^prob_bits from integer weights [K, A] (0 = absent): (freq, cum) int64."""
    M = 1 << prob_bits
    w = np.asarray(w, np.int64)
    total = w.sum(1, keepdims=True)
    if (total <= 0).any():
        raise BitstreamError("a component's frequency table is empty; the payload is corrupt")
    lo = np.ones((w.shape[0], 1), np.int64)
    hi = np.full((w.shape[0], 1), 2 * M, np.int64)
    for _ in range(prob_bits + 2):
        mid = (lo + hi) // 2
        f = np.where(w > 0, np.maximum(1, w * mid // total), 0)
        ok = f.sum(1, keepdims=True) <= M
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid)
    f = np.where(w > 0, np.maximum(1, w * lo // total), 0)
    rows = np.arange(w.shape[0])
    f[rows, w.argmax(1)] += M - f.sum(1)
    if (f.sum(1) != M).any() or (f < 0).any():
        raise BitstreamError("a component's frequency table cannot be normalized; the payload is corrupt")
    return f, np.cumsum(f, 1) - f

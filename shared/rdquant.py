"""Rate-distortion quantizer for PCA coefficients: one uniform step shared by all K components.

After a decorrelating (PCA) transform, the quantizer that minimizes MSE at a given rate uses the
same step on every component (high-rate theory); a component whose spread is below the step then
quantizes to (almost) all zeros by itself, which is the 'reverse water-filling' of rate-distortion
theory. The symbols are integers of any range (int32), coded per component by shared/codecs/rans.py.

    q = find_step(coeffs, target=0.999, metric="cos", reconstruct=basis.reconstruct, reference=x)
    symbols = q.quantize(coeffs)              # int32 [T, K], numpy or torch (same type out)
    coeffs_hat = q.dequantize(symbols)        # float32, symbol * step (means belong to the basis)
    blob = q.to_bytes(); RDQuantizer.from_bytes(blob)

`water_fill=True` also drops (zeroes) whole components whose variance is below the distortion
level step^2/12, so they cost nothing; PoC 06 measures whether that wins. It never drops every
component: where all variances are below it (one token, a constant tensor), components keep by
their mean square instead (at least the largest one).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import struct
from typing import Callable

import numpy as np

from .errors import BackendUnavailable, BitstreamError, InvalidTensorError

INT32_MAX = 2**31 - 1
IN_PLACE_DTYPES = ("bfloat16", "float16", "float32")  # inputs CudaProjection.quantize_many can read by address
_MAGIC = b"RDQ1"
_HEAD = struct.Struct("<4sdIB")  # magic, step, K, has_keep_mask


# numba kernels of the quantizer and dequantizer (the numpy formulas, one pass each); _KERNELS is
# None without numba. Compiled functions are cached on disk (cache=True).
try:
    import numba
    from numba import njit, prange

    if "NUMBA_THREADING_LAYER" not in __import__("os").environ:  # GNU OpenMP dies in a forked child
        numba.config.THREADING_LAYER = "forksafe"
except ImportError:
    numba = None
if numba is not None:
    jit = dict(cache=True, nogil=True)

    @njit(**jit)
    def _quantize_row(v, bias, step, keep, out, mn, mx, sm):
        """One row: out = round((v - bias) / step) in float64, half to even (np.rint), as int32
        (0 outside keep), folded into the column min / max / sum; returns whether a value was
        NaN, infinite or beyond int32 (branch-free, so the loop vectorizes)."""
        bad = False
        for k in range(v.shape[0]):
            r = np.rint(np.float64(v[k] - bias[k]) / step)
            ok = np.abs(r) <= 2147483647.0  # False for NaN too
            bad |= not ok
            s = np.int32(r) if ok and keep[k] else np.int32(0)
            out[k] = s
            mn[k] = min(mn[k], s)
            mx[k] = max(mx[k], s)
            sm[k] += s
        return bad

    @njit(parallel=True, **jit)
    def _quantize_stats(c, bias, step, keep, bf16, nchunk):
        """Symbols int32 [T, K] of c [T, K] (float32 / float64, or with bf16=True uint16 bfloat16
        bits), each column's (min, max, sum), and whether any round((c - bias) / step) was NaN,
        infinite or beyond int32 (the caller raises before using the symbols). The subtraction is
        in c's precision (float32 for bf16 bits)."""
        T, K = c.shape
        out = np.empty((T, K), np.int32)
        nchunk = max(1, min(T, nchunk))  # one per thread
        mn = np.full((nchunk, K), 2147483647, np.int32)
        mx = np.full((nchunk, K), -2147483648, np.int32)
        sm = np.zeros((nchunk, K), np.int64)
        bad = np.zeros(nchunk, np.bool_)
        for ch in prange(nchunk):
            row = np.empty(K, np.uint32)
            vals = row.view(np.float32)
            b = False
            for t in range(ch * T // nchunk, (ch + 1) * T // nchunk):
                if bf16:
                    for k in range(K):
                        row[k] = np.uint32(c[t, k]) << np.uint32(16)
                    b |= _quantize_row(vals, bias, step, keep, out[t], mn[ch], mx[ch], sm[ch])
                else:
                    b |= _quantize_row(c[t], bias, step, keep, out[t], mn[ch], mx[ch], sm[ch])
            bad[ch] = b
        for ch in range(1, nchunk):
            for k in range(K):
                mn[0, k] = min(mn[0, k], mn[ch, k])
                mx[0, k] = max(mx[0, k], mx[ch, k])
                sm[0, k] += sm[ch, k]
        return out, mn[0].astype(np.int64), mx[0].astype(np.int64), sm[0], bad.any()

    @njit(parallel=True, **jit)
    def _dequantize(sym, step):
        T, K = sym.shape
        out = np.empty((T, K), np.float32)
        for t in prange(T):
            for k in range(K):
                out[t, k] = np.float32(sym[t, k]) * step
        return out

    @njit(parallel=True, **jit)
    def _dequantize_bf16(sym, step, out):
        """out[:, :K] = the bfloat16 bits (round to nearest even, torch's rule) of float32(sym) *
        step; a column beyond K is set to 1.0 (it carries the mean through a GEMM). Returns
        whether every value is finite."""
        T, K = sym.shape
        bad = np.zeros(T, np.bool_)
        for t in prange(T):
            row = np.empty(K, np.float32)
            bits = row.view(np.uint32)
            for k in range(K):
                row[k] = np.float32(sym[t, k]) * step
            b = False
            for k in range(K):
                u = bits[k]
                h = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
                b |= (h & np.uint16(0x7F80)) == np.uint16(0x7F80)
                out[t, k] = h
            for k in range(K, out.shape[1]):
                out[t, k] = np.uint16(0x3F80)
            bad[t] = b
        return not bad.any()

    @njit(parallel=True, **jit)
    def _bf16_finite(bits):
        """Whether no bfloat16 value (uint16 bits, [T, D]) is NaN or infinite."""
        T, D = bits.shape
        bad = np.zeros(T, np.bool_)
        for t in prange(T):
            b = False
            for d in range(D):
                b |= (bits[t, d] & np.uint16(0x7F80)) == np.uint16(0x7F80)
            bad[t] = b
        return not bad.any()

    _KERNELS = dict(quantize_stats=_quantize_stats, dequantize=_dequantize, dequantize_bf16=_dequantize_bf16,
                    bf16_finite=_bf16_finite)
else:
    _KERNELS = None


def _is_torch(x) -> bool:
    return hasattr(x, "detach") and hasattr(x, "device")


@dataclasses.dataclass
class RDQuantizer:
    """Mid-tread uniform quantizer: symbol = round(c / step); dequantize = symbol * step.

    keep: optional bool mask [K]; components outside it are quantized to 0 (dropped)."""

    step: float
    keep: np.ndarray | None = None

    def __post_init__(self):
        if not (math.isfinite(self.step) and self.step > 0):
            raise InvalidTensorError(f"quantization step must be a positive finite number, got {self.step}")
        if self.keep is not None:
            self.keep = np.asarray(self.keep, bool).ravel()

    def _check(self, coeffs):
        if coeffs.ndim != 2:
            raise InvalidTensorError(f"coefficients must be 2-D [T, K], got shape {tuple(coeffs.shape)}")
        if coeffs.shape[0] == 0 or coeffs.shape[1] == 0:
            raise InvalidTensorError(f"coefficients are empty (shape {tuple(coeffs.shape)})")
        if self.keep is not None and len(self.keep) != coeffs.shape[1]:
            raise InvalidTensorError(f"quantizer keeps a mask of {len(self.keep)} components, "
                                     f"coefficients have {coeffs.shape[1]}")

    def quantize(self, coeffs):
        """float [T, K] (numpy or torch, any device) -> int32 symbols of the same kind."""
        self._check(coeffs)
        if _is_torch(coeffs):
            import torch

            if not torch.is_floating_point(coeffs):
                raise InvalidTensorError(f"coefficients must be floating point, got {coeffs.dtype}")
            scaled = torch.round(coeffs.float() / self.step)  # round half to even, like np.rint
            amax = scaled.abs().amax()
            if not bool(torch.isfinite(amax)):
                raise InvalidTensorError("coefficients hold NaN/Inf; fix the producer, nothing is clipped here")
            if float(amax) > INT32_MAX:
                raise InvalidTensorError(f"quantized coefficients reach {float(amax):.3g}, beyond int32; "
                                         "use a larger step")
            sym = scaled.to(torch.int32)
            if self.keep is not None:
                sym = sym * torch.as_tensor(self.keep, device=sym.device).to(torch.int32)[None, :]
            return sym
        c = np.asarray(coeffs)
        if c.dtype.kind != "f":
            raise InvalidTensorError(f"coefficients must be floating point, got {c.dtype}")
        if _KERNELS is not None and c.dtype in (np.float32, np.float64):
            return self.quantize_with_stats(c)[0]
        scaled = np.rint(c.astype(np.float64) / self.step)
        if not np.isfinite(scaled).all():
            raise InvalidTensorError("coefficients hold NaN/Inf; fix the producer, nothing is clipped here")
        if np.abs(scaled).max() > INT32_MAX:
            raise InvalidTensorError(f"quantized coefficients reach {np.abs(scaled).max():.3g}, beyond int32; "
                                     "use a larger step")
        sym = scaled.astype(np.int32)
        if self.keep is not None:
            sym = sym * self.keep[None, :].astype(np.int32)
        return sym

    def quantize_with_stats(self, values, bias=None, bf16: bool = False):
        """Compiled CPU quantizer: symbols round((values - bias) / step) of a numpy [T, K] array
        (float32 / float64, or with bf16=True uint16 holding bfloat16 bits), and in the same pass
        each column's (min, max, sum) as int64, the statistics the rANS coder's tables start from
        (shared.codecs.rans_cpu.encode(symbols, stats=...)). bias: float32 [K], default 0."""
        if _KERNELS is None:
            raise BackendUnavailable("the compiled quantizer needs numba (pip install numba, see requirements.txt)")
        c = np.ascontiguousarray(values)
        self._check(c)
        K = c.shape[1]
        bias = np.zeros(K, np.float32 if bf16 or c.dtype == np.float32 else np.float64) if bias is None else \
            np.ascontiguousarray(bias, np.float32)
        keep = self.keep if self.keep is not None else np.ones(K, bool)
        sym, mn, mx, sm, bad = _KERNELS["quantize_stats"](c, bias, float(self.step), keep, bf16,
                                                             numba.get_num_threads())
        if bad:  # name the cause (numpy, on this path only)
            v = (c.astype(np.uint32) << 16).view(np.float32) if bf16 else c
            amax = np.abs(np.rint((v - bias).astype(np.float64) / self.step)).max()
            if not math.isfinite(amax):
                raise InvalidTensorError("coefficients hold NaN/Inf; fix the producer, nothing is clipped here")
            raise InvalidTensorError(f"quantized coefficients reach {amax:.3g}, beyond int32; use a larger step")
        return sym, (mn, mx, sm)

    def dequantize(self, symbols):
        """int symbols [T, K] -> float32 coefficients (numpy or torch, like the input)."""
        if _is_torch(symbols):
            import torch

            return symbols.to(torch.float32) * self.step
        symbols = np.asarray(symbols)
        if _KERNELS is not None and symbols.dtype == np.int32 and symbols.ndim == 2:
            return _KERNELS["dequantize"](np.ascontiguousarray(symbols), np.float32(self.step))
        return symbols.astype(np.float32) * np.float32(self.step)

    def to_bytes(self) -> bytes:
        K = 0 if self.keep is None else len(self.keep)
        head = _HEAD.pack(_MAGIC, float(self.step), K, int(self.keep is not None))
        return head + (np.packbits(self.keep).tobytes() if self.keep is not None else b"")

    @classmethod
    def from_bytes(cls, blob: bytes) -> "RDQuantizer":
        if len(blob) < _HEAD.size:
            raise BitstreamError(f"quantizer parameters truncated ({len(blob)} bytes)")
        magic, step, K, has_keep = _HEAD.unpack(blob[:_HEAD.size])
        if magic != _MAGIC:
            raise BitstreamError(f"not rate-distortion quantizer parameters (magic {magic!r})")
        # the step is applied in float32: it must be a positive, finite float32
        if not (math.isfinite(step) and float(np.finfo(np.float32).tiny) <= step <= float(np.finfo(np.float32).max)):
            raise BitstreamError(f"quantizer parameters are corrupt: step {step!r} is not a positive finite float32")
        if has_keep > 1 or (not has_keep and (K or len(blob) != _HEAD.size)):
            raise BitstreamError(f"quantizer parameters are corrupt (keep flag {has_keep}, K={K}, "
                                 f"{len(blob)} bytes)")
        keep = None
        if has_keep:
            bits = np.frombuffer(blob[_HEAD.size:], np.uint8)
            if len(bits) != (K + 7) // 8:
                raise BitstreamError("quantizer keep-mask truncated")
            keep = np.unpackbits(bits)[:K].astype(bool)
        try:
            return cls(step, keep)
        except InvalidTensorError as e:
            raise BitstreamError(f"quantizer parameters are corrupt: {e}") from None

    def to_dict(self) -> dict:
        return {"step": float(self.step), "keep": None if self.keep is None else self.keep.astype(int).tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "RDQuantizer":
        return cls(float(d["step"]), None if d.get("keep") is None else np.asarray(d["keep"], bool))


def _to_np64(x) -> np.ndarray:
    if _is_torch(x):
        import torch

        x = x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, np.float64)


def _quality_torch(reference, approx, metric: str) -> float:
    import torch

    r, a = reference.double(), approx.double()
    if metric == "cos":
        nr, na = r.norm(dim=1), a.norm(dim=1)
        den = nr * na
        cos = torch.where(den > 0, (r * a).sum(1) / torch.where(den > 0, den, torch.ones_like(den)),
                          ((nr == 0) & (na == 0)).double())
        return float(cos.mean())
    if metric == "rel_mse":
        energy = float((r ** 2).sum())
        err = float(((r - a) ** 2).sum())
        return err / energy if energy > 0 else (0.0 if err == 0 else math.inf)
    raise InvalidTensorError(f"unknown quality metric '{metric}'; use 'cos' or 'rel_mse'")


def quality(reference, approx, metric: str) -> float:
    """'cos': mean over tokens of the cosine similarity; 'rel_mse': ||x - y||^2 / ||x||^2.
    numpy arrays, or torch tensors (computed on their device in float64)."""
    if _is_torch(reference):
        return _quality_torch(reference, approx if _is_torch(approx) else
                              __import__("torch").as_tensor(approx, device=reference.device), metric)
    if metric == "cos":
        num = (reference * approx).sum(1)
        nr, na = np.linalg.norm(reference, axis=1), np.linalg.norm(approx, axis=1)
        den = nr * na
        cos = np.where(den > 0, num / np.where(den > 0, den, 1), np.where((nr == 0) & (na == 0), 1.0, 0.0))
        return float(cos.mean())
    if metric == "rel_mse":
        energy = float((reference ** 2).sum())
        err = float(((reference - approx) ** 2).sum())
        return err / energy if energy > 0 else (0.0 if err == 0 else math.inf)
    raise InvalidTensorError(f"unknown quality metric '{metric}'; use 'cos' or 'rel_mse'")


def meets(value: float, target: float, metric: str) -> bool:
    return value >= target if metric == "cos" else value <= target


def find_step(coeffs, target: float, metric: str = "cos", reconstruct: Callable | None = None,
              reference=None, water_fill: bool = False, iters: int = 32) -> RDQuantizer:
    """The largest shared step whose reconstruction meets the target quality, by bisection.

    coeffs: [T, K] PCA coefficients. reconstruct: maps dequantized coefficients back to the
    original space (e.g. basis.reconstruct), so quality is measured where it matters; identity if
    None. reference: what quality is measured against; default reconstruct(coeffs), i.e. the
    quantization error alone (pass the original tensor to include the truncation error of K < D).
    target: cos >= target, or rel_mse <= target. Raises InvalidTensorError when even a step of
    1e-6 of the coefficients' RMS misses the target (e.g. the truncation alone misses it)."""
    recon = (lambda y: y) if reconstruct is None else reconstruct
    if _is_torch(coeffs):  # stay on the tensor's device (a GPU makes the search fast)
        c = coeffs.detach().float()
        if c.ndim != 2 or c.numel() == 0:
            raise InvalidTensorError(f"coefficients must be a non-empty 2-D [T, K] tensor, got {tuple(c.shape)}")
        if not bool(c.isfinite().all()):
            raise InvalidTensorError("coefficients hold NaN/Inf; fix the producer, nothing is clipped here")
        ref = recon(c) if reference is None else reference
        var = c.double().var(0, unbiased=False).cpu().numpy()
        msq = c.double().pow(2).mean(0).cpu().numpy()
        rms = float(c.double().pow(2).mean().sqrt())
        cmax = float(c.abs().max())
    else:
        c = _to_np64(coeffs)
        if c.ndim != 2 or c.size == 0:
            raise InvalidTensorError(f"coefficients must be a non-empty 2-D [T, K] array, got shape {c.shape}")
        if not np.isfinite(c).all():
            raise InvalidTensorError("coefficients hold NaN/Inf; fix the producer, nothing is clipped here")
        c = c.astype(np.float32)
        ref = _to_np64(recon(c) if reference is None else reference)
        var = c.astype(np.float64).var(0)
        msq = (c.astype(np.float64) ** 2).mean(0)
        rms = float(np.sqrt((c.astype(np.float64) ** 2).mean()))
        cmax = float(np.abs(c).max())
    if rms == 0:
        return RDQuantizer(1.0, None)

    def make(step):
        keep = var >= step * step / 12 if water_fill else None
        if keep is not None and not keep.any():  # never drop everything (one token, a constant tensor):
            keep = msq >= step * step / 12  # then keep what the quantizer sees, energy about zero
            keep[int(np.argmax(msq))] = True
        return RDQuantizer(step, keep)

    def score(step):
        q = make(step)
        approx = recon(q.dequantize(q.quantize(c)))
        return quality(ref, approx if _is_torch(ref) else _to_np64(approx), metric)

    # the finest step tried: 1e-6 of the RMS, but no finer than keeps every symbol within int32 (heavy
    # tails put the largest coefficient thousands of RMS out)
    lo, hi = math.log(max(rms * 1e-6, cmax / 2**30)), math.log(cmax * 4 + rms)
    if not meets(score(math.exp(lo)), target, metric):
        raise InvalidTensorError(
            f"no quantization step reaches {metric} {target}: even a step of {math.exp(lo):.3g} (1e-6 x RMS, or "
            f"the finest that keeps symbols within int32) gives {score(math.exp(lo)):.6g}; the target is beyond "
            "what the basis (K components) allows")
    if meets(score(math.exp(hi)), target, metric):
        return make(math.exp(hi))
    for _ in range(iters):
        mid = (lo + hi) / 2
        if meets(score(math.exp(mid)), target, metric):
            lo = mid
        else:
            hi = mid
    return make(math.exp(lo))


def calibrate_step(basis, captures, target_cos: float, water_fill: bool = False):
    """The basis with the compute codec's step for `target_cos` stored in it (meta "rans_step",
    "rans_target_cos"): the largest shared step whose reconstruction of the calibration captures
    (a list of [T, D] tensors of this layer, all rows together) meets the target. The step is then
    a property of the layer, saved with the basis file: TensorCodec(basis, backend="rans") uses
    it and searches nothing per call. Guarantee: the target holds on these captures; held-out
    tensors of the same layer land near it (PoC 05 and PoC 06 measure how near)."""
    from .basis import PCABasis

    values = np.concatenate([np.asarray(_to_np64(c), np.float32).reshape(-1, basis.dim) for c in captures])
    coeffs = basis.project(values)
    q = find_step(coeffs, target_cos, "cos", reconstruct=basis.reconstruct, reference=values, water_fill=water_fill)
    meta = dict(basis.meta, rans_step=float(q.step), rans_target_cos=float(target_cos))
    return PCABasis(basis.mean, basis.components, basis.eigenvalues, meta, basis.synthesis)


@functools.lru_cache(maxsize=None)
def _sm_count(dev) -> int:
    import torch

    return torch.cuda.get_device_properties(dev).multi_processor_count


SUM32_MAX_TOKENS = 32 * 65535  # int16 symbols of shorter tensors: the projection sums them in int32


class CudaProjection:
    """The compute codec's dense stages on a GPU, fused into one Triton kernel each way:

        proj = CudaProjection(basis.mean, basis.components)          # [D], [D, K]
        symbols, stats = proj.quantize(x, step)   # bf16 CUDA [T, D] -> int32 [T, K] + (min, max, sum)
        payload = rans_cuda.encode_cuda(symbols, stats=stats)
        # or, with no host sync before the coder's own: proj.quantize_unchecked -> encode_cuda(guard=amax)
        x_hat = proj.reconstruct(rans_cuda.decode_cuda(payload), step)    # -> bf16 [T, D]

    quantize computes round(((x - mean) @ components) / step) with bf16 inputs and float32
    accumulation (round half up; the CPU quantizer rounds half to even, which only differs on
    exact ties); reconstruct computes bf16((symbols * step) @ components.T + mean).
    CudaProjection.stack(projs) codes a list of same-shape tensors, each with its own basis, in
    one launch per direction (quantize_many / reconstruct_many)."""

    BLOCK = dict(BM=32, BN=32, BD=32)  # the CPU interpreter's tile (the GPU autotunes its own)
    ROW_PROGRAMS = 3  # the interpreter's programs per column tile: each walks several row tiles, as on a GPU

    def __init__(self, mean, components, device="cuda", synthesis=None):
        import torch

        comp = torch.as_tensor(np.asarray(components, np.float32) if not _is_torch(components) else components)
        mu = torch.as_tensor(np.asarray(mean, np.float32) if not _is_torch(mean) else mean)
        self.D, self.K = comp.shape[-2:]
        self.components = comp.to(device, torch.bfloat16).contiguous()  # [(N,) D, K]
        # the map back: components.T for an orthonormal basis, else the basis' synthesis [K, D]
        self.components_t = (self.components.transpose(-1, -2) if synthesis is None else
                             torch.as_tensor(np.asarray(synthesis, np.float32)).to(device, torch.bfloat16)).contiguous()
        if tuple(self.components_t.shape[-2:]) != (self.K, self.D):
            raise InvalidTensorError(f"synthesis must be [K={self.K}, D={self.D}], got {tuple(self.components_t.shape)}")
        self.mean = mu.to(device, torch.float32).contiguous()
        # (x - mean) @ B = x @ B - mean @ B, with mean @ B from the same bf16 basis the kernel uses
        self.bias = (self.mean.unsqueeze(-2) @ self.components.float()).squeeze(-2).contiguous()
        self.device = torch.device(device)
        self._weights = self._bound = None

    @classmethod
    def stack(cls, projs: list) -> "CudaProjection":
        """One projection holding N same-shape bases (components [N, D, K]) for the *_many calls."""
        import torch

        out = cls.__new__(cls)
        out.D, out.K, out.device = projs[0].D, projs[0].K, projs[0].device
        if any((p.D, p.K) != (out.D, out.K) for p in projs):
            raise InvalidTensorError("stacked projections need bases of one shape [D, K]")
        for name in ("components", "components_t", "mean", "bias"):
            setattr(out, name, torch.stack([getattr(p, name) for p in projs]).contiguous())
        out._weights = torch.stack([p.coefficient_weights() for p in projs]).contiguous()
        out._bound = None
        return out

    # -- reconstruction as one GEMM of scaled coefficients -----------------------------------
    # The GPU decoder writes each value as bf16(value * step) into rows of coefficient_width()
    # (rans_cuda's SCALED decode, columns K and K + 1 set to 1, the rest 0), and the
    # reconstruction is a cuBLAS GEMM of those rows with coefficient_weights(): the basis rows,
    # then the mean's bf16 part and its bf16 remainder, so the mean rides along the GEMM and the
    # output is rounded once (CpuProjection's numerics). On an NVIDIA H200 the GEMM runs at the
    # memory's speed, where the fused Triton reconstruction ran at 40% of it.

    def coefficient_width(self) -> int:
        """Columns of a coefficient row: K, two ones for the mean, padded to 8 (16-byte rows)."""
        return (self.K + 2 + 7) // 8 * 8

    def coefficient_weights(self):
        """bf16 [(N,) coefficient_width, D]: components.T, mean's bf16 part, its remainder, zeros."""
        import torch

        if self._weights is None:
            hi = self.mean.to(torch.bfloat16)
            lo = (self.mean - hi.float()).to(torch.bfloat16)
            pad = self.coefficient_width() - self.K - 2
            zeros = torch.zeros(self.mean.shape[:-1] + (pad, self.D), dtype=torch.bfloat16, device=self.device)
            self._weights = torch.cat([self.components_t, hi.unsqueeze(-2), lo.unsqueeze(-2), zeros], -2).contiguous()
        return self._weights

    def coefficient_bound(self) -> float:
        """The largest |value * step| a decoder accepts: beyond it the GEMM's output could pass
        1e38 (bf16 and float32 top out at 3.4e38); the encoder refuses coefficients 10x smaller
        (pipeline.FLOAT32_HEADROOM), so no payload it makes comes near. Corrupt or hostile
        payloads are refused instead of decoding to Inf."""
        if self._bound is None:
            gain = float(self.components_t.float().abs().sum(-2).max())  # |coefficients| <= b -> |x - mean| <= b * gain
            self._bound = (1e38 - float(self.mean.abs().max())) / max(gain, 1e-30)
        return self._bound

    def reconstruct_coefficients(self, coeffs):
        """bf16 [(N,) T, coefficient_width] rows from the SCALED decoder -> bf16 [(N,) T, D]: one
        GEMM (a batched one for a stacked projection), float32 accumulation, rounded once."""
        import torch

        w = self.coefficient_weights()
        # mm / bmm, not matmul: its shape dispatch cost ~20 us of host time a call, and in a graph-
        # replayed decode the host's time is the call's
        if coeffs.dim() == 2:
            return torch.mm(coeffs, w)
        if w.dim() == 2:
            return torch.mm(coeffs.reshape(-1, coeffs.shape[-1]), w).view(*coeffs.shape[:-1], w.shape[-1])
        return torch.bmm(coeffs, w)

    def quantize(self, x, step: float):
        """bf16 CUDA [T, D] -> int32 symbols [T, K] and their (min, max, sum) per component;
        refuses values beyond int32 (a step too small, or NaN/Inf in x) at once (a host sync)."""
        sym, stats, amax = self.quantize_unchecked(x, step)
        if not float(amax) < INT32_MAX:  # also catches NaN/Inf in x
            raise InvalidTensorError(f"quantized coefficients reach {float(amax):.3g} (beyond int32, or NaN/Inf "
                                     "in the tensor); use a larger step or fix the producer")
        return sym, stats

    def quantize_unchecked(self, x, step: float):
        """quantize() without its host sync: also returns the largest |scaled value| (float32
        CUDA [1]; inf where a value is NaN, Inf or beyond int32) for the caller to check later, e.g. as
        rans_cuda.encode_cuda(..., guard=amax)."""
        if x.dim() != 2 or x.shape[1] != self.D:
            raise InvalidTensorError(f"tensor must be [T, {self.D}], got {tuple(x.shape)}")
        sym, (mn, mx, sm), amax = self.quantize_many(x.unsqueeze(0), [step])
        return sym[0], (mn[0], mx[0], sm[0]), amax

    def quantize_many(self, xs, steps, addresses=None, narrow: bool = False):
        """bf16 CUDA [N, T, D] (a stacked projection's N tensors) -> symbols [N, T, K], their
        (min, max, sum) [N, K] each, and the largest |scaled value| of each [N] (inf: NaN, Inf or
        beyond int32); one launch.
        narrow: int16 symbols (half the bytes to write, and for the coder to read), stored
        wrapped where a value is beyond int16; the statistics are always the int32 values', so
        a caller tells from min and max whether the symbols hold (rans_cuda's coder does).
        addresses: optional int64 CUDA [N], where each tensor is (contiguous [T, D] of xs's dtype,
        one of IN_PLACE_DTYPES, 16-byte aligned), read by the kernel instead of xs's data, which
        then only give the shape (a CUDA graph replays this with new tensors by rewriting the
        addresses, copying no input)."""
        import torch

        from . import _rdquant_triton as kt
        from .codecs.rans_cuda import floats_on, interpreting

        N, T = xs.shape[0], xs.shape[1]
        if xs.dim() != 3 or xs.shape[2] != self.D or (self.components.dim() == 3 and self.components.shape[0] != N):
            raise InvalidTensorError(f"tensors must be [N, T, {self.D}] for this projection, got {tuple(xs.shape)}")
        if addresses is not None and (addresses.dtype != torch.int64 or addresses.shape != (N,)):
            raise ValueError(f"addresses must be int64 [{N}], got {addresses.dtype} {tuple(addresses.shape)}")
        x = xs.to(torch.bfloat16).contiguous() if addresses is None else addresses
        in_place = {}
        if addresses is not None:
            name = str(xs.dtype).removeprefix("torch.")
            if name not in IN_PLACE_DTYPES:
                raise ValueError(f"inputs read by address must be one of {IN_PLACE_DTYPES}, got {name}")
            in_place = dict(X_TABLE=True, X_DTYPE=getattr(kt.tl, name))  # Triton's types carry torch's names
        K, dev = self.K, x.device
        sym = torch.empty((N, T, K), dtype=torch.int16 if narrow else torch.int32, device=dev)
        mn = torch.full((N, K), 2**31 - 1, dtype=torch.int32, device=dev)
        mx = torch.full((N, K), -2**31, dtype=torch.int32, device=dev)
        sm = torch.zeros((N, K), dtype=torch.int64, device=dev)
        amax = torch.zeros(N, dtype=torch.float32, device=dev)
        inv = floats_on([1.0 / s for s in steps], dev)
        args = (x, self.components, self.bias, sym, mn, mx, sm, amax, T, self.D, K, inv, T.bit_length())
        # int16 symbols: int32 running sums, while no program can walk 2^16 row tiles (tiles >= 32 rows)
        sum32 = narrow and T < SUM32_MAX_TOKENS
        if interpreting():  # Triton's CPU interpreter (tests): one fixed tile shape
            b = self.BLOCK
            if not kt.hoists(self.D, b["BD"]):
                kt.project_quantize_wide_kernel[kt.wide_grid(T, K, N)(b)](*args, UPCAST=True, SUM32=sum32,
                                                                         GROUP_M=kt.WIDE_GROUP_M, **in_place, **b)
                return sym, (mn, mx, sm), amax
            grid = (min(-(-T // b["BM"]), self.ROW_PROGRAMS) * -(-K // b["BN"]), N)
            kt.project_quantize_kernel[grid](*args, UPCAST=True, SUM32=sum32, **in_place, **b)
        elif not kt.hoists(self.D, kt.PROJECT_BD):  # wide tensors: tensor-core tiles, per-tile statistics
            kt.project_quantize_wide_tuned[kt.wide_grid(T, K, N)](*args, UPCAST=False, SUM32=sum32, **in_place)
        else:
            kt.project_quantize_tuned[kt.project_grid(T, K, N, _sm_count(dev))](
                *args, UPCAST=False, SUM32=sum32, **in_place)
        return sym, (mn, mx, sm), amax

    def reconstruct(self, symbols, step: float):
        if symbols.dim() != 2 or symbols.shape[1] != self.K:
            raise InvalidTensorError(f"symbols must be [T, {self.K}], got {tuple(symbols.shape)}")
        return self.reconstruct_many(symbols.unsqueeze(0), [step])[0]

    def reconstruct_many(self, symbols, steps, bad=None, out=None):
        """int32 (or int16) [N, T, K] -> bf16 [N, T, D], tensor i with its basis and steps[i]; one launch.
        bad: optional int32 [N] on the device, set to 1 where tensor i's output is not finite.
        out: optional bf16 [N, T, D] on the device to write into (else a new tensor)."""
        import torch

        from . import _rdquant_triton as kt
        from .codecs.rans_cuda import floats_on, interpreting

        N, T, K = symbols.shape
        if K != self.K:
            raise InvalidTensorError(f"symbols must be [N, T, {self.K}], got {tuple(symbols.shape)}")
        dev = symbols.device
        if out is None:
            out = torch.empty((N, T, self.D), dtype=torch.bfloat16, device=dev)
        st = floats_on([float(v) for v in steps], dev)
        if bad is None:
            bad = torch.zeros(N, dtype=torch.int32, device=dev)
        args = (symbols.contiguous(), self.components_t, self.mean, out, T, self.D, K, st, bad, T.bit_length())
        if interpreting():
            b = self.BLOCK
            kt.reconstruct_kernel[kt.reconstruct_grid(T, self.D, N)(b)](
                *args, BM=b["BM"], BN=b["BN"], BK=b["BD"], UPCAST=True)
        else:
            kt.reconstruct_tuned[kt.reconstruct_grid(T, self.D, N)](*args, UPCAST=False)
        return out


class CpuProjection:
    """The compute codec's dense stages on the CPU for bfloat16 tensors, in CudaProjection's
    numerics: the basis rounded to bf16, bf16 GEMMs with float32 accumulation (oneDNN through
    torch, AVX512-BF16 / AMX where the CPU has them), then the compiled quantizer:

        proj = CpuProjection(basis.mean, basis.components)    # or CpuProjection(None, None, D): raw channels
        symbols, stats = proj.quantize(x, quantizer)   # bf16 torch [T, D] -> int32 numpy [T, K] + (min, max, sum)
        x_hat = proj.reconstruct(symbols, step)        # int32 numpy [T, K] -> bf16 torch [T, D]

    quantize computes round((bf16(x @ components) - mean @ components) / step), half to even;
    the coefficient is rounded to bf16 once (relative error <= 2^-9) before the quantizer sees it.
    reconstruct computes bf16(bf16(symbols * step) @ components.T + mean) with one rounding at
    the end, as the GPU's kernel does (the mean rides along the GEMM: its bf16 part as the bias,
    its remainder as one more component whose coefficient is 1). Without a basis, x's bits go to
    the quantizer and the symbols' bf16 values come back directly."""

    def __init__(self, mean, components, dim: int | None = None, synthesis=None):
        import torch

        self.identity = components is None
        if self.identity:
            self.D = self.K = int(dim)
            self.gain, self.offset = 1.0, 0.0
            return
        comp = np.asarray(components, np.float32)
        mu = np.asarray(mean, np.float32)
        self.D, self.K = comp.shape
        self.components = torch.from_numpy(comp).bfloat16().contiguous()  # [D, K]
        self.bias = (torch.from_numpy(mu) @ self.components.float()).numpy()  # mean @ the bf16 basis, float32
        mean_t = torch.from_numpy(mu)
        self.mean_hi = mean_t.bfloat16()
        mean_lo = (mean_t - self.mean_hi.float()).bfloat16()
        # the map back, [D, K]: the basis itself when orthonormal, else its synthesis transposed
        back = comp if synthesis is None else np.ascontiguousarray(np.asarray(synthesis, np.float32).T)
        if back.shape != comp.shape:
            raise InvalidTensorError(f"synthesis must be [K={self.K}, D={self.D}], got {tuple(back.shape[::-1])}")
        self.weight = torch.cat([torch.from_numpy(back).bfloat16(), mean_lo[:, None]], 1).contiguous()  # [D, K + 1]
        self.gain = float(np.abs(back).sum(1).max())  # |coefficients| -> |reconstruction| bound, as TensorCodec's check
        self.offset = float(np.abs(mu).max())

    def quantize(self, x, quantizer: RDQuantizer):
        """bf16 CPU tensor [T, D] -> (int32 symbols [T, K], (min, max, sum) per component)."""
        import torch

        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.D:
            raise InvalidTensorError(f"CpuProjection takes a bf16 [T, {self.D}] tensor, got {x.dtype} {tuple(x.shape)}")
        y = x.contiguous() if self.identity else x @ self.components
        bits = y.view(torch.int16).numpy().view(np.uint16)
        return quantizer.quantize_with_stats(bits, bias=None if self.identity else self.bias, bf16=True)

    def reconstruct(self, symbols: np.ndarray, step: float):
        """int32 symbols [T, K] -> bf16 CPU tensor [T, D]; BitstreamError where a value is not finite."""
        import torch

        T, K = symbols.shape
        if K != self.K:
            raise InvalidTensorError(f"symbols must be [T, {self.K}], got {tuple(symbols.shape)}")
        coeffs = np.empty((T, K if self.identity else K + 1), np.uint16)
        finite = _KERNELS["dequantize_bf16"](np.ascontiguousarray(symbols, np.int32), np.float32(step), coeffs)
        a = torch.from_numpy(coeffs.view(np.int16)).view(torch.bfloat16)
        if self.identity:
            out = a
        else:
            out = torch.addmm(self.mean_hi, a, self.weight.t())  # bias added in float32, one rounding
            finite = _KERNELS["bf16_finite"](out.view(torch.int16).numpy().view(np.uint16))
        if not finite:
            raise BitstreamError("decoded values are not finite in bfloat16 (chunk 'QPAR' or 'DATA' holds "
                                 "out-of-range parameters): the bitstream is corrupt")
        return out

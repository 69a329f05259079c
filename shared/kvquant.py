"""The KV-cache quantizers a user reaches for first, as round trips that also count every stored byte.

    k_hat, v_hat, nbytes = kivi(bits=4, k_group=128, v_group=64)(k, v)   # k, v: [T, C] rows of one layer
    int8_per_token()(k, v); fp8_per_tensor()(k, v)
    hf_quantized_cache("quanto")(k, v, heads=3)     # transformers' QuantizedCache layer at its defaults

Each method maps one layer's K and V rows [T tokens, C channels] (float) to their reconstructions
(float32, same shape) and the bytes a cache would hold for them: packed integer codes plus every
scale and zero-point, in the dtype stated (fp16 unless said). bits per value = 8 * nbytes / (2 T C).

- KIVI-style (Liu et al. 2024, "KIVI: a tuning-free asymmetric 2bit quantization for KV cache"):
  keys per channel with groups of `k_group` consecutive tokens, values per token with groups of
  `v_group` consecutive channels; asymmetric (min/max) uniform codes of `bits` bits, an fp16 scale and
  an fp16 zero per group. KIVI also keeps the most recent tokens unquantized; here every prefix token
  is quantized (a last partial group gets its own scale and zero, counted).
- int8 absmax per token: symmetric, one fp16 scale per token.
- fp8 e4m3 per tensor: one float32 scale per tensor (amax / 448), values cast to float8_e4m3fn.
- transformers' QuantoQuantizedLayer / HQQQuantizedLayer (optimum-quanto, hqq) at their defaults
  (4 bits, axis 0, groups of 64, residual 128): the prefix goes in through `update`, as a prefill
  does; what comes back is the backend's dequantization of what it stored, and the bytes are those
  of the tensors it stored (codes, scales, zero-points).
"""
from __future__ import annotations

from typing import Callable

import torch

from .errors import BackendUnavailable, InvalidTensorError

Method = Callable[..., tuple[torch.Tensor, torch.Tensor, int]]
FP16_ROUND_UP = 1 + 2.0 ** -10  # a scale rounded to fp16 after this factor is never below the exact one


def _check(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.numel() == 0:
        raise InvalidTensorError(f"{name} must be a non-empty 2-D [tokens, channels] tensor, got "
                                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not torch.is_floating_point(x):
        raise InvalidTensorError(f"{name} must be floating point, got {x.dtype}")
    if not bool(torch.isfinite(x).all()):
        raise InvalidTensorError(f"{name} holds NaN/Inf; fix the producer, nothing is clipped here")
    return x.float()


def packed_bytes(n_values: int, bits: int) -> int:
    """Bytes of n_values codes of `bits` bits packed densely."""
    return -(-n_values * bits // 8)


def minmax_groups(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, int]:
    """Asymmetric uniform quantization of each row of x [R, N] in groups of `group` consecutive
    entries (the last group may be shorter), fp16 scale and zero per group.
    Returns (reconstruction float32 [R, N], bytes: packed codes + 4 bytes per group)."""
    if not 1 <= bits <= 8:
        raise InvalidTensorError(f"bits must be in 1..8, got {bits}")
    if group < 1:
        raise InvalidTensorError(f"group size must be >= 1, got {group}")
    levels = (1 << bits) - 1
    out = torch.empty_like(x)
    n_groups = 0
    for start in range(0, x.shape[1], group):
        g = x[:, start:start + group]
        lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
        zero = lo.half().float()
        scale = ((hi - zero) / levels * FP16_ROUND_UP).half().float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.clamp(torch.round((g - zero) / scale), 0, levels)
        out[:, start:start + group] = q * scale + zero
        n_groups += g.shape[0]
    return out, packed_bytes(x.numel(), bits) + 4 * n_groups


def kivi(bits: int, k_group: int, v_group: int) -> Method:
    """KIVI-style: K per channel (groups of k_group tokens), V per token (groups of v_group channels)."""

    def method(k: torch.Tensor, v: torch.Tensor, heads: int | None = None):
        k, v = _check(k, "K"), _check(v, "V")
        k_hat, k_bytes = minmax_groups(k.t().contiguous(), bits, k_group)  # rows = channels, along tokens
        v_hat, v_bytes = minmax_groups(v, bits, v_group)  # rows = tokens, along channels
        return k_hat.t().contiguous(), v_hat, k_bytes + v_bytes

    return method


def absmax_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Symmetric int8 per row, fp16 scale per row: (reconstruction, bytes)."""
    scale = (x.abs().amax(1, keepdim=True) / 127 * FP16_ROUND_UP).half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(x / scale), -127, 127)
    return q * scale, x.numel() + 2 * x.shape[0]


def int8_per_token() -> Method:
    def method(k: torch.Tensor, v: torch.Tensor, heads: int | None = None):
        (k_hat, kb), (v_hat, vb) = absmax_int8_rows(_check(k, "K")), absmax_int8_rows(_check(v, "V"))
        return k_hat, v_hat, kb + vb

    return method


def fp8_e4m3_tensor(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """float8_e4m3fn with one float32 scale per tensor (amax maps to 448): (reconstruction, bytes)."""
    fp8 = torch.float8_e4m3fn
    scale = (x.abs().amax() / torch.finfo(fp8).max).clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scale).to(fp8).float() * scale, x.numel() + 4


def fp8_per_tensor() -> Method:
    def method(k: torch.Tensor, v: torch.Tensor, heads: int | None = None):
        (k_hat, kb), (v_hat, vb) = fp8_e4m3_tensor(_check(k, "K")), fp8_e4m3_tensor(_check(v, "V"))
        return k_hat, v_hat, kb + vb

    return method


def _stored_bytes(obj) -> int:
    """Bytes of every tensor held by a backend's quantized object (nested tensors, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        inner = [getattr(obj, name) for name in getattr(obj, "__tensor_flatten__", lambda: ([], None))()[0]]
        if inner:
            return sum(_stored_bytes(t) for t in inner)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_stored_bytes(t) for t in obj)
    if isinstance(obj, dict):
        return sum(_stored_bytes(t) for t in obj.values())
    return 0


HF_BACKENDS = {"quanto": "QuantoQuantizedLayer", "hqq": "HQQQuantizedLayer"}


def hf_quantized_cache(backend: str, dtype: torch.dtype = torch.bfloat16, **settings) -> Method:
    """transformers' quantized cache layer of `backend` ("quanto" | "hqq") with its default settings
    (or `settings`), fed the prefix in `dtype` (bf16: what a user would hold)."""
    import transformers.cache_utils as cu

    if backend not in HF_BACKENDS:
        raise InvalidTensorError(f"unknown QuantizedCache backend {backend!r}; use one of {sorted(HF_BACKENDS)}")
    layer_class = getattr(cu, HF_BACKENDS[backend])
    try:
        layer_class(**settings)
    except ImportError as error:
        raise BackendUnavailable(f"transformers' {backend} KV cache backend cannot load: {error}. "
                                 f"Fix: pip install {'optimum-quanto' if backend == 'quanto' else 'hqq'}") from None

    def method(k: torch.Tensor, v: torch.Tensor, heads: int | None = None):
        from .llm import rows_to_kv, kv_to_rows

        if heads is None:
            raise InvalidTensorError("the transformers cache backends need the number of KV heads (heads=)")
        k, v = _check(k, "K"), _check(v, "V")
        layer = layer_class(**settings)
        layer.update(rows_to_kv(k.to(dtype), heads), rows_to_kv(v.to(dtype), heads))
        k_hat = kv_to_rows(layer._dequantize(layer._quantized_keys)).float()
        v_hat = kv_to_rows(layer._dequantize(layer._quantized_values)).float()
        return k_hat, v_hat, _stored_bytes(layer._quantized_keys) + _stored_bytes(layer._quantized_values)

    return method


def bits_per_value(nbytes: int, n_values: int) -> float:
    return 8.0 * nbytes / n_values

"""An attention-aware KV-cache codec: the compute codec's shared-step quantizer and rANS coder, with
what attention cares about built into its transform, its step per tensor and its raw tokens.

    codec = fit_kv_codec(calib_kv, heads=3, rope=rope_of(model), key_metric=q_cov, value_metric=w_o_cov,
                         sink=4, recent=0, pre_rope=True, per_head=False)
    codec.set_scale(0.8)                        # or calibrate_scale(...) for a perplexity target
    blob = codec.encode(k_rows, layer=3, kind="k", start=0)      # bytes, the TNSC container
    k_hat = codec.decode(blob)                  # float32 [T, C]; decode(blob, device="cuda") on a GPU
    codec.save("kv_codec.safetensors"); KVCodec.load(...)
    codec = load_shipped("smollm2", target_pct=0.3)   # the calibrated SmolLM2-135M codec in artifacts/kv_codec/

Per layer and kind (K or V) the codec holds a transform (mean [C], analysis A [C, C], synthesis
S [C, C] with A S = I) and a step. Encoding a tensor of T tokens:
  1. the first `sink` tokens (they draw much of the attention) travel raw, bf16, and so do the last
     `recent` tokens (the ones the next queries attend to most, as KIVI keeps its residual raw);
  2. keys may be rotated back to before RoPE (their positions are start..start+T-1, stored in the
     header) and rotated forward again after decoding: RoPE spreads a key's low-rank structure over
     many components, and undoing it is exact up to float rounding;
  3. c = (x - mean) A, symbols = round(c / step), coded by shared.codecs.rans.
A and S come from PCA after a weighting W (per layer, block-diagonal per KV head): A = W U,
S = U^T W^-1, so one step shared by all components minimizes the weighted error
e^T W^T W e. For keys W^T W is the covariance of the queries that read them (an error's cost is
its change of q.k); for values it is o_proj's W_o^T W_o (what reaches the residual stream).
Without weighting W = I (plain PCA). `per_head` fits U per KV head (block diagonal).

The step of a tensor is scale * unit[layer, kind]: `unit` is either the RMS of its coefficients
(equal relative error everywhere) or set by measured sensitivity (allocate_by_sensitivity:
the step that equalizes the marginal perplexity cost per bit across tensors). The global `scale`
is what a target sets: `calibrate_scale` finds the largest scale whose perplexity change on
calibration text, plus z paired standard errors, stays at or below the stated target, and the
codec stores the target (and the rule, the points measured) with it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .codecs.rans import HEADER as RANS_HEADER
from .container import pack, unpack_container
from .errors import BitstreamError, CodecError, CodecFileMissing, ConfigurationError, InvalidTensorError

CODEC_ID = "kv_attn_rans"
KINDS = ("k", "v")  # what a fitted KV codec codes: keys and values


# ---------------------------------------------------------------- RoPE

@dataclasses.dataclass
class Rope:
    """The rotary embedding of a Llama-style model (HF layout: dimension i pairs with i + head_dim/2)."""
    inv_freq: np.ndarray  # [head_dim / 2]
    scaling: float = 1.0

    @property
    def head_dim(self) -> int:
        return 2 * len(self.inv_freq)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = torch.as_tensor(self.inv_freq, dtype=torch.float64, device=positions.device)
        freqs = positions.double()[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def _apply(self, rows: torch.Tensor, positions: torch.Tensor, sign: float) -> torch.Tensor:
        T, C = rows.shape
        d = self.head_dim
        if C % d:
            raise InvalidTensorError(f"{C} channels are not a whole number of heads of head_dim {d}")
        if positions.shape != (T,):
            raise InvalidTensorError(f"need one position per row ({T}), got {tuple(positions.shape)}")
        cos, sin = self.cos_sin(positions)
        x = rows.double().reshape(T, C // d, d)
        half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
        if sign > 0:
            out = x * cos[:, None] + half * sin[:, None]
        else:  # the inverse rotation; with attention_scaling != 1 also divide out its gain
            out = (x * cos[:, None] - half * sin[:, None]) / (self.scaling ** 2)
        return out.reshape(T, C).to(rows.dtype)

    def apply(self, rows: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate pre-RoPE rows [T, heads * head_dim] at positions start.. (what the model does to keys),
        or at the given per-row positions."""
        positions = torch.arange(start, start + rows.shape[0], device=rows.device) if positions is None else positions
        return self._apply(rows, positions.to(rows.device), +1)

    def invert(self, rows: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Undo apply(): post-RoPE rows back to pre-RoPE."""
        return self._apply(rows, torch.arange(start, start + rows.shape[0], device=rows.device), -1)


def rope_of(model) -> Rope:
    """The rotary embedding of a loaded Llama-style transformers model (`model.model.rotary_emb`):
    its inverse frequencies and attention scaling, what fit_kv_codec(pre_rope=True) needs to rotate
    keys back to before RoPE."""
    emb = model.model.rotary_emb
    return Rope(emb.inv_freq.detach().double().cpu().numpy(), float(getattr(emb, "attention_scaling", 1.0)))


# ---------------------------------------------------------------- fitting

def _sqrt_psd(m: np.ndarray, eps: float = 1e-4) -> tuple[np.ndarray, np.ndarray]:
    """(W, W^-1) with W = (m + eps * mean eigenvalue * I)^(1/2), symmetric."""
    m = (m + m.T) / 2
    vals, vecs = np.linalg.eigh(m)
    vals = np.clip(vals, 0, None) + eps * max(float(vals.mean()), 1e-30)
    return (vecs * np.sqrt(vals)) @ vecs.T, (vecs / np.sqrt(vals)) @ vecs.T


def _pca(x: np.ndarray) -> np.ndarray:
    """Eigenvectors [n, n] of x's covariance (x already centred), largest variance first."""
    vals, vecs = np.linalg.eigh(x.T @ x)
    return vecs[:, np.argsort(vals)[::-1]]


def fit_transform(x: np.ndarray, heads: int, metric: np.ndarray | None, per_head: bool):
    """(mean [C], A [C, C], S [C, C]) for calibration rows x [N, C]; metric: [heads, d, d] blocks
    of the weighting W^T W, or None for plain PCA."""
    x = np.asarray(x, np.float64)
    C = x.shape[1]
    d = C // heads
    mean = x.mean(0)
    W, W_inv = np.eye(C), np.eye(C)
    if metric is not None:
        for h in range(heads):
            sl = slice(h * d, (h + 1) * d)
            W[sl, sl], W_inv[sl, sl] = _sqrt_psd(metric[h])
    xw = (x - mean) @ W
    if per_head:
        U = np.zeros((C, C))
        for h in range(heads):
            sl = slice(h * d, (h + 1) * d)
            U[sl, sl] = _pca(xw[:, sl])
    else:
        U = _pca(xw)
    return mean, W @ U, U.T @ W_inv


def query_metric(queries: list[torch.Tensor], heads: int, rope: Rope, prefix: int, pre_rope: bool,
                 rng: np.random.Generator) -> np.ndarray:
    """[kv_heads, d, d]: sum over each KV head's query heads of E[q q^T] of the queries that read the
    cache. queries: pre-RoPE q rows [T, q_heads * d] of the scored tokens (positions >= prefix).
    pre_rope False: post-RoPE queries (for keys coded post-RoPE); True: queries rotated by their offset
    to a random cached position, m - n (for keys coded pre-RoPE: q_m^T R(n - m) dk).
    prefix: how many cached tokens come before the scored ones (>= 1 with pre_rope: the random
    position is drawn from 0..prefix-1). Raises ConfigurationError for a prefix out of range,
    InvalidTensorError without a rope or queries."""
    if rope is None:
        raise InvalidTensorError("query_metric needs the model's rotary embedding (rope=rope_of(model))")
    if isinstance(prefix, bool) or not isinstance(prefix, (int, np.integer)) or prefix < 0:
        raise ConfigurationError(f"query_metric prefix={prefix!r}: use the number of cached tokens before the scored "
                                 "queries, an int >= 0")
    if pre_rope and prefix < 1:
        raise ConfigurationError("query_metric(pre_rope=True) rotates each query by its offset to a random cached "
                                 f"position in 0..prefix-1, so it needs prefix >= 1, got prefix={prefix}. Fix: pass "
                                 "the number of cached tokens the scored queries attend to, or pre_rope=False for keys "
                                 "coded post-RoPE")
    if not len(queries):
        raise InvalidTensorError("query_metric got no queries: pass the pre-RoPE q rows of the scored tokens")
    out = None
    for q in queries:
        T, Cq = q.shape
        positions = torch.arange(prefix, prefix + T)
        if not pre_rope:
            qr = rope.apply(q.float(), positions=positions)
        else:
            qr = rope.apply(q.float(), positions=positions - torch.as_tensor(rng.integers(0, prefix, T)))
        d = rope.head_dim
        qh = qr.double().reshape(T, Cq // d, d)
        group = (Cq // d) // heads
        m = np.stack([sum((qh[:, h * group + j].T @ qh[:, h * group + j]).numpy() for j in range(group))
                      for h in range(heads)])
        out = m if out is None else out + m
    return out / sum(q.shape[0] for q in queries)


def value_metric(o_proj_weight: torch.Tensor, heads: int, head_dim: int) -> np.ndarray:
    """[kv_heads, d, d]: sum over each KV head's query heads j of W_o[:, j]^T W_o[:, j], the gain from
    a value error to the attention block's output (o_proj weight [hidden, q_heads * d])."""
    w = o_proj_weight.detach().double().cpu()
    q_heads = w.shape[1] // head_dim
    group = q_heads // heads
    blocks = [w[:, j * head_dim:(j + 1) * head_dim] for j in range(q_heads)]
    return np.stack([sum((blocks[h * group + j].T @ blocks[h * group + j]).numpy() for j in range(group))
                     for h in range(heads)])


def fit_kv_codec(calib: list[list[tuple[torch.Tensor, torch.Tensor]]], heads: int, *, sink: int = 0,
                 recent: int = 0, pre_rope: bool = False, rope: Rope | None = None, key_metric: dict | None = None,
                 value_metric: dict | None = None, per_head: bool = False, meta: dict | None = None) -> KVCodec:
    """A KVCodec fitted on calibration caches: calib[chunk][layer] = (K rows, V rows) [P, C].
    key_metric / value_metric: {layer: [heads, d, d]} weightings (None: plain PCA). Units start as
    the RMS of each tensor's coefficients (equal relative error); scale 1. The transform is fitted
    on the tokens the codec quantizes (neither the sink nor the recent ones)."""
    probe = KVCodec({}, sink=sink, recent=recent, pre_rope=pre_rope, rope=rope)
    transforms = {}
    for layer in range(len(calib[0])):
        for i, kind in enumerate("kv"):
            x = torch.cat([probe._body(probe._prepare(chunk[layer][i], kind, 0)) for chunk in calib]).double().numpy()
            metric = (key_metric if kind == "k" else value_metric)
            mean, A, S = fit_transform(x, heads, None if metric is None else metric[layer], per_head)
            unit = float(np.sqrt((((x - mean) @ A) ** 2).mean()))
            transforms[(layer, kind)] = TensorTransform(mean.astype(np.float32), A.astype(np.float32),
                                                        S.astype(np.float32), unit)
    settings = dict(sink=sink, recent=recent, pre_rope=pre_rope, weighted_k=key_metric is not None,
                    weighted_v=value_metric is not None, per_head=per_head, **(meta or {}))
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for key in sorted(transforms):
        h.update(np.ascontiguousarray(transforms[key].analysis).tobytes())
    settings["hash"] = h.hexdigest()[:16]
    return KVCodec(transforms, sink=sink, recent=recent, pre_rope=pre_rope, rope=rope, meta=settings)


def allocate_by_sensitivity(codec: KVCodec, delta: dict[tuple[int, str], float], probe_scale: float,
                            floor: float = 0.1, max_shift: float = 4.0, se: dict[tuple[int, str], float] | None = None,
                            se_mult: float = 2.0) -> KVCodec:
    """Set each tensor's unit from its measured sensitivity: delta[(layer, kind)] is the perplexity
    change (fraction) when that tensor alone was coded at probe_scale. With a cost a = delta / step^2
    (quantization error ~ step^2), the steps that minimize the total bits for a total cost satisfy
    step ~ 1 / sqrt(a) (equal marginal cost per bit). Deltas below floor x their median magnitude
    are raised to it (a tensor that seems free still gets a step); with `se` (the standard error of
    each delta) a delta is never taken below se_mult x its SE either, so a tensor whose cost is lost
    in the measurement noise is not given a coarse step on the strength of that noise. The
    geometric mean of the units is kept (scales stay comparable), and no unit moves more than
    max_shift from equal relative error."""
    keys = sorted(codec.transforms)
    d = np.array([delta[k] for k in keys], np.float64)
    d = np.maximum(d, floor * max(float(np.median(np.abs(d))), 1e-6))
    if se is not None:
        d = np.maximum(d, se_mult * np.array([se[k] for k in keys], np.float64))
    probe = np.array([probe_scale * codec.transforms[k].unit for k in keys])
    new = 1 / np.sqrt(d / probe ** 2)
    old = np.array([codec.transforms[k].unit for k in keys])
    new *= np.exp(np.log(old).mean() - np.log(new).mean())
    new = np.clip(new, old / max_shift, old * max_shift)  # a noisy measurement moves a step at most this far
    transforms = {k: dataclasses.replace(codec.transforms[k], unit=float(u)) for k, u in zip(keys, new)}
    meta = dict(codec.meta, allocation="sensitivity", probe_scale=probe_scale,
                **({"allocation_se_mult": se_mult} if se is not None else {}))
    meta["hash"] = hashlib.sha256((codec.meta.get("hash", "") + json.dumps(new.tolist())).encode()).hexdigest()[:16]
    return KVCodec(transforms, sink=codec.sink, recent=codec.recent, pre_rope=codec.pre_rope, rope=codec.rope,
                   scale=codec.scale, meta=meta)


def fit_power_law(points: dict[float, float]) -> tuple[float, float]:
    """(a, b) of change = a * scale^b fitted by least squares to measured (scale, change) points
    (b searched over 1..5: a perplexity change measured on a few thousand tokens is noisy and can
    come out negative at small scales, which rules out a fit in log space)."""
    s = np.array(list(points), np.float64)
    c = np.array(list(points.values()), np.float64)
    best = None
    for b in np.linspace(1, 5, 81):
        x = s ** b
        a = max(float((x * c).sum() / (x * x).sum()), 1e-12)
        err = float(((c - a * x) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, a, float(b))
    return best[1], best[2]


def calibrate_scale(codec: KVCodec, evaluate: Callable[[KVCodec], float | tuple[float, float]], target: float,
                    grid: tuple[float, ...] = (0.1, 0.2, 0.4), refine: int = 3, z: float = 1.0,
                    shrink: int = 4) -> KVCodec:
    """Set the codec's scale for a perplexity-change target (a fraction: 0.003 = +0.3%).

    evaluate(codec) measures the change at codec.scale on calibration text and returns
    (change, se) -- se the standard error of that change, e.g. the paired per-token SE -- or a
    bare change (se 0). Each measured scale s has an upper bound u(s) = change(s) + z * se(s).
    The grid is measured, then `refine` times a power law u = a * s^b is fitted to every measured
    bound and the scale it predicts for u = target is measured too (kept inside the bracket between
    the largest passing and the smallest failing scale, else its geometric middle); if no scale
    passes, the smallest is halved up to `shrink` times.

    Acceptance rule (what is guaranteed): the stored scale is a MEASURED one, the largest s such
    that every measured scale <= s has u <= target (a noisy pass above a failure is not taken).
    So on the calibration text the change at the stored scale is at most target - z * se. If the
    text the codec then meets behaves like the calibration text (the same source, other
    passages), its change there is at most the target with the confidence z gives (z = 1: about
    84% one-sided, z = 1.64: 95%), for a measurement that is itself within its own SE of that.
    Calibrate on text disjoint from the text the transform was fitted on: in-sample text codes
    better and the bound would be optimistic. Stores the target, z, the change and SE at the
    stored scale and every measured point (scale -> [change, se]) in codec.meta."""
    if not target > 0:
        raise InvalidTensorError(f"the perplexity target must be a positive fraction (0.003 = +0.3%), got {target}")
    if not z >= 0:
        raise InvalidTensorError(f"z (standard errors of margin) must be >= 0, got {z}")
    measured: dict[float, tuple[float, float]] = {}

    def measure(scale: float) -> None:
        unit = 10.0 ** (math.floor(math.log10(scale)) - 3)
        scale = float(f"{math.floor(scale / unit * (1 + 1e-12)) * unit:.4g}")  # 4 digits, rounded down: a stable label
        if scale not in measured:
            out = evaluate(codec.set_scale(scale))
            change, se = out if isinstance(out, tuple) else (out, 0.0)
            measured[scale] = (float(change), float(se))

    def bound(scale: float) -> float:
        return measured[scale][0] + z * measured[scale][1]

    def accepted() -> float | None:
        best = None
        for scale in sorted(measured):
            if bound(scale) > target:
                break
            best = scale
        return best

    for g in grid:
        measure(g)
    for _ in range(refine):
        a, b = fit_power_law({sc: bound(sc) for sc in measured})
        guess = min(max(float((target / a) ** (1 / b)), min(measured) / 8), max(measured) * 4)
        lo = accepted()
        above = [sc for sc in measured if bound(sc) > target and (lo is None or sc > lo)]
        if lo is not None and above:  # keep inside the bracket, away from its ends (a repeat teaches nothing)
            hi = min(above)
            if not lo * 1.03 < guess < hi / 1.03:
                guess = math.sqrt(lo * hi)
        measure(guess)
    for _ in range(shrink):
        if accepted() is not None:
            break
        measure(min(measured) / 2)
    scale = accepted()
    if scale is None:
        raise InvalidTensorError(
            f"no scale down to {min(measured):.3g} keeps the perplexity change + {z} SE at or below the target "
            f"{100 * target:g}% on the calibration text (points {sorted(measured.items())}); "
            "fix: a larger target, more calibration tokens (a smaller SE), or a smaller grid")
    codec.set_scale(scale)
    a, b = fit_power_law({sc: bound(sc) for sc in measured})
    codec.meta.update(target_ppl_change=target, calibration_z=z, calibrated_ppl_change=measured[scale][0],
                      calibrated_se=measured[scale][1], fit_a=a, fit_b=b,
                      calibration_rule="largest measured scale with every smaller measured scale at "
                                       "change + z*SE <= target",
                      calibration_points={f"{k:.6g}": list(v) for k, v in sorted(measured.items())})
    return codec


# ---------------------------------------------------------------- the codec

@dataclasses.dataclass
class TensorTransform:
    mean: np.ndarray  # [C] float32
    analysis: np.ndarray  # [C, C]
    synthesis: np.ndarray  # [C, C]
    unit: float  # step at scale 1


class KVCodec:
    """A fitted attention-aware KV codec (see the module docstring): one transform and unit per
    (layer, "k" | "v"), the raw sink / recent token counts, whether keys are coded before RoPE, and
    the global scale that sets every step. Made by fit_kv_codec or KVCodec.load; encode / decode one
    tensor of rows [T, C] at a time; save writes the artifact a decoder loads."""

    def __init__(self, transforms: dict[tuple[int, str], TensorTransform], *, sink: int = 0, recent: int = 0,
                 pre_rope: bool = False, rope: Rope | None = None, scale: float = 1.0, meta: dict | None = None):
        if pre_rope and rope is None:
            raise InvalidTensorError("pre_rope=True needs the model's rotary embedding (rope=rope_of(model))")
        if int(sink) < 0 or int(recent) < 0:
            raise InvalidTensorError(f"sink and recent are token counts >= 0, got sink={sink}, recent={recent}")
        self.transforms, self.sink, self.recent = transforms, int(sink), int(recent)
        self.pre_rope, self.rope = bool(pre_rope), rope
        self.scale = float(scale)
        self.meta = dict(meta or {})
        self._torch: dict = {}

    def set_scale(self, scale: float) -> "KVCodec":
        """Set the global scale (every tensor's step is scale x its unit) in place; returns the codec."""
        if not (math.isfinite(scale) and scale > 0):
            raise InvalidTensorError(f"scale must be a positive finite number, got {scale}")
        self.scale = float(scale)
        return self

    def with_recent(self, recent: int) -> "KVCodec":
        """The same tables and steps with the last `recent` tokens kept raw (bf16); its own hash."""
        meta = dict(self.meta, recent=int(recent))
        meta["hash"] = hashlib.sha256(f"{self.meta.get('hash', '')} recent {int(recent)}".encode()).hexdigest()[:16]
        return KVCodec(self.transforms, sink=self.sink, recent=recent, pre_rope=self.pre_rope, rope=self.rope,
                       scale=self.scale, meta=meta)

    def transform(self, layer: int, kind: str) -> TensorTransform:
        """The transform and unit of (layer, kind). A kind the codec holds no transform of is a
        ConfigurationError listing the ones it holds ('k' and 'v' for a fitted KV codec); a layer it
        was not fitted on, an InvalidTensorError naming the layers it holds."""
        t = self.transforms.get((layer, kind))
        if t is not None:
            return t
        kinds = sorted({key[1] for key in self.transforms}, key=lambda k: (k not in KINDS, str(k)))
        if kind not in kinds:
            hint = (f" (did you mean {kind.lower()!r}?)" if isinstance(kind, str) and kind.lower() in kinds else "")
            names = {"k": "'k' (keys)", "v": "'v' (values)"}
            held = " or ".join(names.get(k, repr(k)) for k in kinds) or "nothing (no transforms)"
            raise ConfigurationError(f"kind={kind!r}{hint}: this codec codes kind {held}")
        layers = sorted({key[0] for key in self.transforms if key[1] == kind})
        held = (f"layer {layers[0]}" if len(layers) == 1 else
                f"layers {layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1))
                else f"layers {layers}")
        raise InvalidTensorError(f"the codec has no transform for layer {layer!r} {kind!r} (it holds {held}); "
                                 "fit it on that model")

    def step(self, layer: int, kind: str) -> float:
        """The quantization step of (layer, kind "k" or "v"): scale x that tensor's unit."""
        return self.scale * self.transform(layer, kind).unit

    def tensor_codec(self, layer: int, kind: str, lane_tokens: int | None = None, lanes_by_component: bool = False):
        """The coded body of (layer, kind) as a compute codec: TensorCodec(backend="rans") whose basis is
        this transform (components = the analysis A, synthesis S) at this codec's step, so that it runs
        through every encoder and decoder the compute codec has (CPU, GPU batched, graph-replayed
        shared.pipeline.StagedDecode) and writes their container. It codes rows as they are given:
        the caller takes off the raw sink rows and, for keys of a pre_rope codec, rotates them back
        first (shared.kvcache.SpillCache.from_kv_codec does both). One object per (layer, kind, scale).
        lane_tokens, lanes_by_component: the rANS lanes' settings (shared.pipeline.TensorCodec)."""
        from .basis import PCABasis
        from .pipeline import TensorCodec

        key = ("tensor_codec", layer, kind, self.scale, lane_tokens, lanes_by_component)
        if key not in self._torch:
            t = self.transform(layer, kind)
            C = t.analysis.shape[0]
            basis = PCABasis(np.asarray(t.mean, np.float32), np.ascontiguousarray(t.analysis, np.float32),
                             np.zeros(C, np.float32), {"kv_codec": self.meta.get("hash"), "layer": layer, "kind": kind},
                             np.ascontiguousarray(t.synthesis, np.float32))
            self._torch[key] = TensorCodec(basis, backend="rans", step=self.step(layer, kind), lane_tokens=lane_tokens,
                                           lanes_by_component=lanes_by_component)
        return self._torch[key]

    def _mats(self, layer: int, kind: str, device="cpu"):
        key = (layer, kind, str(device))
        if key not in self._torch:
            t = self.transforms[(layer, kind)]
            self._torch[key] = tuple(torch.as_tensor(np.asarray(a, np.float32), device=device)
                                     for a in (t.mean, t.analysis, t.synthesis))
        return self._torch[key]

    def _prepare(self, x: torch.Tensor, kind: str, start: int) -> torch.Tensor:
        x = x.float()
        return self.rope.invert(x, start) if kind == "k" and self.pre_rope else x

    def _body(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows the codec quantizes: all but the first `sink` and the last `recent`."""
        return rows[self.sink:rows.shape[0] - self.recent]

    def _raw(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(first sink rows, last recent rows) of x in bf16: the tokens that travel raw."""
        return x[:self.sink].to(torch.bfloat16), x[x.shape[0] - self.recent:].to(torch.bfloat16)

    def symbols(self, x: torch.Tensor, layer: int, kind: str, start: int = 0) -> torch.Tensor:
        """int32 [T - sink - recent, C] on x's device: the quantized coefficients of the coded tokens."""
        self.transform(layer, kind)
        mean, A, _ = self._mats(layer, kind, x.device)
        body = self._body(self._prepare(x, kind, start))
        return torch.round(((body - mean) @ A) / self.step(layer, kind)).to(torch.int32)

    def encode(self, x: torch.Tensor, layer: int, kind: str, start: int = 0, coder: str = "auto") -> bytes:
        """The container of one tensor [T, C]; coder "auto" codes a CUDA tensor's symbols on its GPU
        (rans_cuda, the same bytes as the CPU coder), "cpu" always with the compiled CPU coder."""
        return self._encode(x, layer, kind, start, coder)[0]

    def _check_rows(self, x: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[0] <= self.sink + self.recent or not torch.isfinite(x).all():
            raise InvalidTensorError(f"need a finite [T > {self.sink} sink + {self.recent} recent tokens, C] tensor, "
                                     f"got {tuple(x.shape)}")

    def _encode(self, x: torch.Tensor, layer: int, kind: str, start: int, coder: str = "auto"
                ) -> tuple[bytes, torch.Tensor]:
        from .codecs import rans_cpu, rans_cuda

        if coder not in ("auto", "cpu"):
            raise InvalidTensorError(f"coder must be 'auto' or 'cpu', got {coder!r}")
        self.transform(layer, kind)
        self._check_rows(x)
        sink, recent = (t.cpu().contiguous().view(torch.int16).numpy().tobytes() for t in self._raw(x))
        header = {"shape": list(x.shape), "dtype": "bfloat16", "layer": layer, "kind": kind, "start": start,
                  "sink": self.sink, "recent": self.recent, "pre_rope": self.pre_rope and kind == "k",
                  "step": self.step(layer, kind), "codec": {"id": CODEC_ID}, "basis": self.meta.get("hash")}
        sym = self.symbols(x, layer, kind, start)
        # a CUDA tensor is entropy-coded on its GPU (the same bytes as the CPU coder)
        if sym.is_cuda and coder == "auto":
            data = rans_cuda.encode_cuda(sym).cpu().numpy().tobytes()
        else:
            data = rans_cpu.coder().encode(sym.cpu().numpy())
        chunks = {"RAWS": sink, "RCNT": recent} if self.recent else {"RAWS": sink}
        return pack(header, {**chunks, "DATA": data}), sym

    def reconstruct(self, symbols, raw: torch.Tensor, layer: int, kind: str, start: int,
                    step: float, pre_rope: bool, recent_raw: torch.Tensor | None = None) -> torch.Tensor:
        """The decoded rows: raw sink rows, the dequantized body, raw recent rows (if any)."""
        symbols = torch.as_tensor(symbols)
        mean, _, S = self._mats(layer, kind, symbols.device)
        body = (symbols.float() * step) @ S + mean
        raw = raw.to(symbols.device)
        if pre_rope:
            body = self.rope.apply(body, start + raw.shape[0])
        parts = [raw.float(), body] + ([] if recent_raw is None else [recent_raw.to(symbols.device).float()])
        return torch.cat(parts, 0)

    def decode(self, blob: bytes, device=None) -> torch.Tensor:
        """The float32 rows [T, C] of a container made by encode (raw sink rows, the dequantized body,
        raw recent rows; keys rotated forward again when coded pre-RoPE). Raises BitstreamError for a
        blob of another codec or one fitted with other transforms (the header's hash differs).
        device None: the CPU coder, rows on the CPU; a torch device ("cuda"): the payload goes there and
        the GPU coder's kernels decode it (shared.codecs.rans_cuda, the same symbols), the rows are
        reconstructed and rotated there."""
        from .codecs import rans_cpu, rans_cuda

        header, chunks = unpack_container(blob)
        if header.get("codec", {}).get("id") != CODEC_ID:
            raise BitstreamError(f"not a {CODEC_ID} bitstream (codec {header.get('codec')})")
        if header.get("basis") != self.meta.get("hash"):
            raise BitstreamError(f"bitstream was coded with codec tables {header.get('basis')}, this codec holds "
                                 f"{self.meta.get('hash')}; load the sender's codec file")
        T, C = header["shape"]
        if not isinstance(header.get("layer"), int) or (header["layer"], header.get("kind")) not in self.transforms:
            raise BitstreamError(f"the header names layer {header.get('layer')!r} kind {header.get('kind')!r}, which "
                                 "this codec has no transform for: the blob is corrupt or from another codec")

        def rows(tag: str, n: int) -> torch.Tensor:
            if not n:
                return torch.zeros(0, C)
            if tag not in chunks or len(chunks[tag]) != 2 * n * C:
                raise BitstreamError(f"the header names {n} raw rows in chunk {tag}, the container holds "
                                     f"{len(chunks.get(tag, b''))} bytes there")
            return torch.frombuffer(bytearray(chunks[tag]), dtype=torch.int16).view(torch.bfloat16).reshape(n, C)

        recent = int(header.get("recent", 0))
        if device is None:
            symbols = rans_cpu.coder().decode(chunks["DATA"])
        else:
            payload = torch.frombuffer(bytearray(chunks["DATA"]), dtype=torch.uint8).to(device)
            symbols = rans_cuda.decode_cuda(payload, head=bytes(chunks["DATA"][:RANS_HEADER.size]))
        out = self.reconstruct(symbols, rows("RAWS", header["sink"]),
                               header["layer"], header["kind"], header["start"], header["step"], header["pre_rope"],
                               rows("RCNT", recent) if recent else None)
        if list(out.shape) != [T, C]:
            raise BitstreamError(f"decoded shape {tuple(out.shape)} differs from the header's {[T, C]}")
        return out

    def roundtrip(self, x: torch.Tensor, layer: int, kind: str, start: int = 0, *, count_bytes: bool = True,
                  coder: str = "auto") -> tuple[torch.Tensor, int]:
        """(decode(encode(x)), len(encode(x))) without running the rANS decoder: the symbols are
        what the decoder returns (tests check it), so the reconstruction is made from them.
        count_bytes False skips the entropy coder too and returns 0 bytes (for a search that only
        needs the reconstruction, e.g. calibrating the scale)."""
        if count_bytes:
            blob, sym = self._encode(x, layer, kind, start, coder)
            blob_len = len(blob)
        else:
            self._check_rows(x)
            sym, blob_len = self.symbols(x, layer, kind, start), 0
        sink, recent = self._raw(x)
        return self.reconstruct(sym, sink, layer, kind, start, self.step(layer, kind),
                                self.pre_rope and kind == "k", recent if self.recent else None), blob_len

    # -- the artifact ----------------------------------------------------------------------------
    def save(self, path: str | Path, *, synthesis: bool = True, dtype: str = "float32") -> None:
        """Write the codec to a safetensors file: every transform, the RoPE frequencies and, as
        metadata, sink, recent, pre_rope, scale, units and meta (a calibrated target with it).

        synthesis=False leaves out the synthesis matrices (half the file): load() rebuilds each as
        the inverse of its analysis matrix (A S = I), so the encoder's symbols are the same and the
        decoded rows differ only by float32 rounding. dtype "float16" stores the analysis (and
        synthesis) matrices in half precision, half the file again, but the symbols are then no
        longer all the same (on SmolLM2's KV 0.04% differ); the means stay float32. The meta hash is
        kept, so blobs coded with either file decode with the other."""
        from safetensors.numpy import save_file

        if dtype not in ("float32", "float16"):
            raise ConfigurationError(f"dtype={dtype!r}: the codec's matrices are stored as 'float32' or 'float16'")
        tensors = {}
        for (layer, kind), t in self.transforms.items():
            tensors[f"{layer}.{kind}.mean"] = np.asarray(t.mean, np.float32)
            tensors[f"{layer}.{kind}.analysis"] = np.asarray(t.analysis, dtype)
            if synthesis:
                tensors[f"{layer}.{kind}.synthesis"] = np.asarray(t.synthesis, dtype)
        if self.rope is not None:
            tensors["rope.inv_freq"] = np.asarray(self.rope.inv_freq, np.float64)
        units = {f"{layer}.{kind}": t.unit for (layer, kind), t in self.transforms.items()}
        meta = {"settings": json.dumps({"sink": self.sink, "recent": self.recent, "pre_rope": self.pre_rope,
                                        "scale": self.scale,
                                        "rope_scaling": None if self.rope is None else self.rope.scaling,
                                        "units": units, "meta": self.meta})}
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> "KVCodec":
        """The codec a save() wrote, ready to decode (and encode) what the saved one did; a file
        saved without synthesis matrices gets each as its analysis matrix's inverse."""
        from safetensors import safe_open

        with safe_open(str(path), "numpy") as f:
            s = json.loads(f.metadata()["settings"])
            t = {k: f.get_tensor(k) for k in f.keys()}
        transforms = {}
        for key, unit in s["units"].items():
            layer, kind = key.split(".")
            analysis = np.asarray(t[f"{key}.analysis"], np.float32)
            synthesis = t.get(f"{key}.synthesis")
            synthesis = (np.linalg.inv(analysis.astype(np.float64)) if synthesis is None else synthesis).astype(np.float32)
            transforms[(int(layer), kind)] = TensorTransform(t[f"{key}.mean"].astype(np.float32), analysis, synthesis,
                                                             float(unit))
        rope = Rope(t["rope.inv_freq"], s["rope_scaling"]) if "rope.inv_freq" in t else None
        return cls(transforms, sink=s["sink"], recent=s.get("recent", 0), pre_rope=s["pre_rope"], rope=rope,
                   scale=s["scale"], meta=s["meta"])


# ---------------------------------------------------------------- the codec files the repository ships

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "artifacts" / "kv_codec"
SHIPPED_MODELS = ("smollm2",)  # the file-name stem of each model a codec file ships for
SHIPPED_BUILD = "make kv-codec"  # rebuilds the shipped files from the text through PoC 05


def shipped_path(model: str = "smollm2", target_pct: float = 0.3, prefix: int = 512, *,
                 keys_after_rope: bool = False) -> Path:
    """Where the codec file of `model` calibrated for +target_pct% perplexity at a `prefix`-token
    cache lives in the repository (artifacts/kv_codec/), whether or not it is there; keys_after_rope:
    the variant that codes keys as attention reads them (so attention can run on its coefficient rows)."""
    return SHIPPED_DIR / f"{model}_p{prefix}_target{target_pct:g}pct{'_keys_after_rope' if keys_after_rope else ''}.safetensors"


def load_shipped(model: str = "smollm2", target_pct: float = 0.3, prefix: int = 512, *,
                 keys_after_rope: bool = False) -> KVCodec:
    """The KV codec the repository ships for `model`, calibrated (PoC 05's protocol) for a perplexity
    change of at most +target_pct% with a `prefix`-token cache, every layer's K and V coded:

        codec = load_shipped("smollm2", target_pct=0.3)
        blob = codec.encode(k_rows, layer=3, kind="k", start=0); k_hat = codec.decode(blob)

    Its meta names the model (`model`), the target (`target_ppl_change`, a fraction, and
    `operating_point`) and the calibration. keys_after_rope=True: the variant that codes keys as
    attention reads them (no rotation at decode; attention can run on its coefficient rows,
    SpillCache(coefficients=True)), shipped for +0.3%. Raises CodecFileMissing, naming the make target
    that rebuilds the file, when it is not in this checkout."""
    if model not in SHIPPED_MODELS:
        raise ConfigurationError(f"model={model!r}: KV codec files ship for {', '.join(SHIPPED_MODELS)}; for another "
                                 "model fit one (fit_kv_codec, calibrate_scale) as pocs/05_downstream_quality.py does")
    path = shipped_path(model, target_pct, prefix, keys_after_rope=keys_after_rope)
    if not path.is_file():
        held = sorted(p.name for p in SHIPPED_DIR.glob("*.safetensors")) if SHIPPED_DIR.is_dir() else []
        raise CodecFileMissing(
            f"no shipped KV codec {path.name} in {SHIPPED_DIR} (this checkout holds "
            f"{', '.join(held) if held else 'none'}). Fix: `{SHIPPED_BUILD}` rebuilds the shipped files from the "
            "text through PoC 05 (" + ("the keys-after-RoPE files after the others, 25 more minutes on a 2-core CPU; "
                                       "KV_CODEC_AFTER_ROPE_TARGETS=\"0.3 1\" ships +1% too)" if keys_after_rope else
                                       "43 minutes on a 2-core CPU; KV_CODEC_TARGETS=\"0.3 1 5\" ships +5% too)"))
    return KVCodec.load(path)


def compare_decoding(full: KVCodec, other: KVCodec, kv: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict:
    """How `other` (e.g. a reduced file of the same codec) codes real KV rows kv[chunk][layer] = (K, V)
    against `full`: how many symbols differ (of how many), the largest |decoded difference| of the two
    round trips and of a blob of `full` decoded by `other`, the largest |x| (the scale of those
    differences), and the squared-error ratio of other's round trip to full's (1 = the same quality)."""
    differ = total = 0
    max_diff = max_cross = max_abs = 0.0
    err_full = err_other = 0.0
    for chunk in kv:
        for layer, pair in enumerate(chunk):
            for kind, x in zip(KINDS, pair):
                x = x.float()
                sym_full, sym_other = full.symbols(x, layer, kind), other.symbols(x, layer, kind)
                differ += int((sym_full != sym_other).sum())
                total += sym_full.numel()
                x_full = full.roundtrip(x, layer, kind, count_bytes=False)[0]
                x_other = other.roundtrip(x, layer, kind, count_bytes=False)[0]
                max_diff = max(max_diff, float((x_full - x_other).abs().max()))
                max_abs = max(max_abs, float(x.abs().max()))
                err_full += float(((x_full - x) ** 2).sum())
                err_other += float(((x_other - x) ** 2).sum())
        x = chunk[0][0].float()  # one blob per chunk through the real container and decoder
        cross = other.decode(full.encode(x, 0, "k", coder="cpu")) - full.decode(full.encode(x, 0, "k", coder="cpu"))
        max_cross = max(max_cross, float(cross.abs().max()))
    return dict(symbols=total, symbols_differ=differ, max_abs_diff=max_diff, max_abs_diff_cross_decode=max_cross,
                max_abs_x=max_abs, squared_error_ratio=err_other / err_full if err_full else float("nan"))


def _ship(args) -> None:
    """Write the reduced codec files of artifacts/kv_codec/ from PoC 05's full ones (data/kv_codec/),
    after checking on real captured KV that they code it as the full files do."""
    from .captures import CaptureStore
    from .llm import SMOLLM2_LABEL

    root = SHIPPED_DIR.parent.parent
    stores = sorted((root / "data" / "captures").glob(f"smollm2_kv05_p{args.prefix}_*"))[:args.check_chunks]
    if not stores:
        raise FileNotFoundError(f"no captured KV of PoC 05 in {root / 'data' / 'captures'} to check the reduced file "
                                f"on. Fix: run PoC 05 first (`{SHIPPED_BUILD}` does)")
    kv = []
    for path in stores:
        store = CaptureStore(path)
        for key in store.keys():
            t = store.load(key)
            kv.append([(t[f"layer{L}.k"], t[f"layer{L}.v"]) for L in range(len(t) // 2)])
    SHIPPED_DIR.mkdir(parents=True, exist_ok=True)
    for target in args.targets:
        source = root / "data" / "kv_codec" / shipped_path(args.model, target, args.prefix,
                                                           keys_after_rope=args.keys_after_rope).name
        if not source.is_file():
            raise CodecFileMissing(f"{source} is missing. Fix: `{SHIPPED_BUILD}` (PoC 05 writes it)")
        full = KVCodec.load(source)
        full.meta.setdefault("model", SMOLLM2_LABEL)  # files written before PoC 05 recorded the model
        out = shipped_path(args.model, target, args.prefix, keys_after_rope=args.keys_after_rope)
        full.save(out, synthesis=False, dtype=args.dtype)
        check = compare_decoding(full, KVCodec.load(out), kv)
        print(f"{out.relative_to(root)}: {out.stat().st_size / 1e6:.2f} MB ({source.stat().st_size / 1e6:.2f} MB "
              f"in full), scale {full.scale:g}, hash {full.meta.get('hash')}; on {len(kv)} chunks of real KV "
              f"({check['symbols']} symbols): {check['symbols_differ']} symbols differ, decoded rows differ by at "
              f"most {check['max_abs_diff']:.3g} (|x| up to {check['max_abs_x']:.3g}; a full blob decoded by the "
              f"reduced file: {check['max_abs_diff_cross_decode']:.3g}), squared error "
              f"{check['squared_error_ratio']:.6f} x the full file's")
        if not check["squared_error_ratio"] <= 1 + args.max_error_increase:
            out.unlink()
            raise CodecError(f"the reduced file codes {check['squared_error_ratio']:.4f} x the full file's squared "
                             f"error, more than 1 + {args.max_error_increase:g}: not written. Fix: --dtype float32")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="KV codec files: `ship` writes artifacts/kv_codec/ from PoC 05's "
                                             "data/kv_codec/ (analysis matrices only; the decoder inverts them)")
    sub = ap.add_subparsers(dest="command", required=True)
    ship = sub.add_parser("ship", help="write the reduced codec files the repository ships")
    ship.add_argument("--model", default="smollm2", choices=SHIPPED_MODELS)
    ship.add_argument("--prefix", type=int, default=512, help="cache length the codec was calibrated at")
    ship.add_argument("--targets", type=float, nargs="+", default=[0.3], help="perplexity targets, percent")
    ship.add_argument("--dtype", default="float32", choices=["float32", "float16"], help="of the analysis matrices")
    ship.add_argument("--keys-after-rope", action="store_true",
                      help="the variant that codes keys after RoPE (PoC 05's part after_rope)")
    ship.add_argument("--check-chunks", type=int, default=8, help="captured chunks of real KV the check codes")
    ship.add_argument("--max-error-increase", type=float, default=0.01,
                      help="largest relative increase of the squared error over the full file's that is written")
    _ship(ap.parse_args())

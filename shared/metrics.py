"""Quality and size metrics, one definition for every PoC and table.

ratio:    bytes of the original tensor at 2 bytes per value (bf16) / bytes of the whole bitstream.
cos_mean: mean over tokens of the cosine similarity between original and reconstructed token vectors.
cos_min:  the worst capture's cos_mean (over a set of captures; for one tensor it is its cos_mean).
p1:       the 1st percentile over channels of the per-channel cosine similarity (channel columns,
          centred): how the worst 1% of channels fare.
rel_mse:  ||x - x_hat||^2 / ||x||^2.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

BF16_BYTES = 2


def ratio(original_shape: Sequence[int], n_bytes: int) -> float:
    return float(np.prod(original_shape)) * BF16_BYTES / n_bytes


def _cos_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    num = (a * b).sum(axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    # A zero row reconstructed as zero is perfect; against anything else it is undefined -> 0.
    both_zero = (np.linalg.norm(a, axis=1) == 0) & (np.linalg.norm(b, axis=1) == 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(den > 0, num / np.where(den > 0, den, 1), 0.0)
    return np.where(both_zero, 1.0, cos)


def token_cosines(x: np.ndarray, x_hat: np.ndarray) -> np.ndarray:
    x, x_hat = np.asarray(x, np.float64), np.asarray(x_hat, np.float64)
    return _cos_rows(x, x_hat)


def quality(x: np.ndarray, x_hat: np.ndarray) -> dict[str, float]:
    """cos_mean, cos_min_token, p1, rel_mse, max_abs_err of one reconstruction."""
    x, x_hat = np.asarray(x, np.float64), np.asarray(x_hat, np.float64)
    if x.shape != x_hat.shape:
        raise ValueError(f"shapes differ: {x.shape} vs {x_hat.shape}")
    cos_t = _cos_rows(x, x_hat)
    xc, yc = x - x.mean(axis=0), x_hat - x.mean(axis=0)
    cos_c = _cos_rows(xc.T, yc.T)
    energy = float((x ** 2).sum())
    err = float(((x - x_hat) ** 2).sum())
    return {
        "cos_mean": float(cos_t.mean()),
        "cos_min_token": float(cos_t.min()),
        "p1": float(np.percentile(cos_c, 1)),
        "rel_mse": err / energy if energy > 0 else (0.0 if err == 0 else float("inf")),
        "max_abs_err": float(np.abs(x - x_hat).max()),
    }


def aggregate(per_capture: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine per-capture quality dicts: means, with cos_min = the worst capture's cos_mean."""
    out = {k: float(np.mean([q[k] for q in per_capture])) for k in per_capture[0]}
    out["cos_min"] = float(min(q["cos_mean"] for q in per_capture))
    out["p1"] = float(min(q["p1"] for q in per_capture))
    return out

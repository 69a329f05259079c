"""Per-layer PCA basis: a streaming float64 covariance, K kept components, safetensors on disk.

    acc = CovarianceAccumulator(dim=192)
    for x in captures:                 # each [T, D]; only one sits in memory at a time
        acc.add(x)
    basis = acc.basis(k=64, model="smollm2-135m", layer="15.k")
    coeffs = basis.project(x)          # [T, K] float32
    x_hat = basis.reconstruct(coeffs)  # [T, D] float32
    basis.save("basis.safetensors"); PCABasis.load("basis.safetensors")

Leave-one-out: `leave_one_out(captures, k)` yields (i, basis fitted without capture i) from
per-capture sums computed once, so N bases cost one pass over the data plus N eigendecompositions.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from .errors import BasisMismatchError, InvalidTensorError


def as_float_matrix(x, name: str = "tensor") -> np.ndarray:
    """A [T, D] float32 numpy view of a numpy array or torch tensor (any float dtype), validated."""
    if hasattr(x, "detach"):  # torch tensor; bf16 has no numpy dtype
        import torch

        if not torch.is_floating_point(x):
            raise InvalidTensorError(f"{name} must be floating point, got {x.dtype}")
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise InvalidTensorError(f"{name} must be floating point, got {x.dtype}")
    if x.ndim != 2:
        raise InvalidTensorError(f"{name} must be 2-D [tokens, channels], got shape {x.shape}; reshape first")
    if x.size == 0:
        raise InvalidTensorError(f"{name} is empty (shape {x.shape})")
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x)).sum())
        raise InvalidTensorError(f"{name} holds {bad} NaN/Inf values; fix the producer, nothing is clipped here")
    return x.astype(np.float32, copy=False)


class CovarianceAccumulator:
    """Sum of x and of x^T x in float64, so means and covariances of many captures stay exact."""

    def __init__(self, dim: int):
        self.dim = dim
        self.count = 0
        self.sum = np.zeros(dim, np.float64)
        self.outer = np.zeros((dim, dim), np.float64)
        self.n_captures = 0

    def add(self, x) -> "CovarianceAccumulator":
        x = as_float_matrix(x, "capture").astype(np.float64)
        if x.shape[1] != self.dim:
            raise BasisMismatchError(f"capture has {x.shape[1]} channels, accumulator expects {self.dim}")
        self.count += x.shape[0]
        self.sum += x.sum(axis=0)
        self.outer += x.T @ x
        self.n_captures += 1
        return self

    def __iadd__(self, other: "CovarianceAccumulator"):
        self.count += other.count
        self.sum += other.sum
        self.outer += other.outer
        self.n_captures += other.n_captures
        return self

    def __isub__(self, other: "CovarianceAccumulator"):
        self.count -= other.count
        self.sum -= other.sum
        self.outer -= other.outer
        self.n_captures -= other.n_captures
        return self

    def copy(self) -> "CovarianceAccumulator":
        c = CovarianceAccumulator(self.dim)
        c.count, c.sum, c.outer, c.n_captures = self.count, self.sum.copy(), self.outer.copy(), self.n_captures
        return c

    def mean_cov(self) -> tuple[np.ndarray, np.ndarray]:
        if self.count < 2:
            raise InvalidTensorError("need at least 2 tokens to estimate a covariance")
        mean = self.sum / self.count
        cov = (self.outer - self.count * np.outer(mean, mean)) / (self.count - 1)
        return mean, (cov + cov.T) / 2

    def spectrum(self) -> np.ndarray:
        """Eigenvalues of the covariance, largest first."""
        return np.linalg.eigvalsh(self.mean_cov()[1])[::-1].clip(min=0)

    def basis(self, k: int, **meta) -> "PCABasis":
        mean, cov = self.mean_cov()
        if not 1 <= k <= self.dim:
            raise InvalidTensorError(f"K={k} must be in 1..D={self.dim}")
        eigvals, eigvecs = np.linalg.eigh(cov)
        order = np.argsort(eigvals)[::-1]
        eigvals, eigvecs = eigvals[order].clip(min=0), eigvecs[:, order]
        # Fix each eigenvector's sign (largest entry positive) so bases are reproducible.
        signs = np.sign(eigvecs[np.abs(eigvecs).argmax(axis=0), np.arange(self.dim)])
        eigvecs = eigvecs * np.where(signs == 0, 1, signs)
        meta = {"n_captures": self.n_captures, "n_tokens": self.count, **meta}
        return PCABasis(mean.astype(np.float32), np.ascontiguousarray(eigvecs[:, :k], np.float32),
                        eigvals.astype(np.float32), meta)


@dataclasses.dataclass
class PCABasis:
    mean: np.ndarray  # [D] float32
    components: np.ndarray  # [D, K] float32, orthonormal columns, largest variance first
    eigenvalues: np.ndarray  # [D] float32, the whole spectrum (largest first)
    meta: dict

    @property
    def dim(self) -> int:
        return self.components.shape[0]

    @property
    def k(self) -> int:
        return self.components.shape[1]

    @functools.cached_property
    def content_hash(self) -> str:
        """sha256 of mean and components (computed once: a basis is not changed in place)."""
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.mean, "<f4").tobytes())
        h.update(np.ascontiguousarray(self.components, "<f4").tobytes())
        return h.hexdigest()[:16]

    def truncate(self, k: int) -> "PCABasis":
        if not 1 <= k <= self.k:
            raise InvalidTensorError(f"cannot keep K={k} of {self.k} components")
        return PCABasis(self.mean, np.ascontiguousarray(self.components[:, :k]), self.eigenvalues, dict(self.meta))

    def check(self, x: np.ndarray) -> None:
        if x.shape[1] != self.dim:
            raise BasisMismatchError(
                f"tensor has D={x.shape[1]} channels but the basis was fitted for D={self.dim} "
                f"(model={self.meta.get('model')}, layer={self.meta.get('layer')}); use that layer's basis"
            )

    def project(self, x) -> np.ndarray:
        x = as_float_matrix(x)
        self.check(x)
        return (x - self.mean) @ self.components

    def reconstruct(self, coeffs: np.ndarray) -> np.ndarray:
        if coeffs.ndim != 2 or coeffs.shape[1] != self.k:
            raise BasisMismatchError(f"coefficients {coeffs.shape} do not match a basis with K={self.k}")
        return coeffs.astype(np.float32) @ self.components.T + self.mean

    def nbytes(self) -> int:
        """Bytes a receiver needs: the mean and the K kept components, float32."""
        return 4 * (self.dim + self.dim * self.k)

    def save(self, path: str | Path, dtype=np.float32) -> None:
        from safetensors.numpy import save_file

        meta = {k: str(v) for k, v in self.meta.items()}
        meta.update(content_hash=self.content_hash, dim=str(self.dim), k=str(self.k), meta_json=json.dumps(self.meta))
        tensors = {"mean": self.mean.astype(dtype), "components": self.components.astype(dtype),
                   "eigenvalues": self.eigenvalues.astype(np.float32)}
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> "PCABasis":
        from safetensors import safe_open

        with safe_open(str(path), "numpy") as f:
            meta = json.loads(f.metadata()["meta_json"])
            t = {k: f.get_tensor(k).astype(np.float32) for k in f.keys()}
        return cls(t["mean"], t["components"], t["eigenvalues"], meta)


def fit_basis(captures: Iterable, k: int, **meta) -> PCABasis:
    acc = None
    for x in captures:
        x = as_float_matrix(x, "capture")
        acc = acc or CovarianceAccumulator(x.shape[1])
        acc.add(x)
    if acc is None:
        raise InvalidTensorError("fit_basis got no captures")
    return acc.basis(k, **meta)


def leave_one_out(captures: Sequence, k: int, groups: Sequence | None = None, **meta) -> Iterator[tuple[int, PCABasis]]:
    """(i, basis fitted without capture i) for each i: the honest, held-out basis.

    With `groups` (one label per capture, e.g. the seed or prompt it came from), the basis for
    capture i leaves out every capture of i's group, so related captures cannot leak into it.
    One pass over the data; one eigendecomposition per group.
    """
    if len(captures) < 2:
        raise InvalidTensorError("leave-one-out needs at least 2 captures")
    groups = list(range(len(captures))) if groups is None else list(groups)
    if len(groups) != len(captures):
        raise InvalidTensorError(f"{len(groups)} group labels for {len(captures)} captures")
    per_group: dict = {}
    for x, g in zip(captures, groups):
        x = as_float_matrix(x, "capture")
        per_group.setdefault(g, CovarianceAccumulator(x.shape[1])).add(x)
    if len(per_group) < 2:
        raise InvalidTensorError("leave-one-out needs captures from at least 2 groups")
    total = None
    for acc in per_group.values():
        total = acc.copy() if total is None else total.__iadd__(acc)
    bases = {}
    for g, acc in per_group.items():
        held_out = total.copy()
        held_out -= acc
        bases[g] = held_out.basis(k, held_out=str(g), **meta)
    for i, g in enumerate(groups):
        yield i, bases[g]

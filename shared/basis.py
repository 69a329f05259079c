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

from .errors import BasisMismatchError, BitstreamError, ConfigurationError, InvalidTensorError


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
        meta = {"n_captures": self.n_captures, "n_tokens": self.count, **meta}
        return _basis_from_eigh(mean, eigvals, eigvecs, k, meta)


def _basis_from_eigh(mean: np.ndarray, eigvals: np.ndarray, eigvecs: np.ndarray, k: int, meta: dict) -> "PCABasis":
    """The PCABasis of a symmetric eigendecomposition (any order): largest first, signs fixed."""
    order = np.argsort(eigvals)[::-1]
    eigvals, eigvecs = eigvals[order].clip(min=0), eigvecs[:, order]
    # Fix each eigenvector's sign (largest entry positive) so bases are reproducible.
    signs = np.sign(eigvecs[np.abs(eigvecs).argmax(axis=0), np.arange(eigvecs.shape[1])])
    eigvecs = eigvecs * np.where(signs == 0, 1, signs)
    return PCABasis(np.asarray(mean, np.float32), np.ascontiguousarray(eigvecs[:, :k], np.float32),
                    eigvals.astype(np.float32), meta)


@dataclasses.dataclass
class PCABasis:
    mean: np.ndarray  # [D] float32
    components: np.ndarray  # [D, K] float32, orthonormal columns, largest variance first (the analysis)
    eigenvalues: np.ndarray  # [D] float32, the whole spectrum (largest first)
    meta: dict
    # [K, D] float32 or None: the map back from coefficients. None: components.T (an orthonormal
    # basis). A weighted transform (shared.kvcodec: analysis A = W U, synthesis S = U^T W^-1, A S = I)
    # sets it, and every encoder and decoder of a TensorCodec then codes with A and reconstructs with S.
    synthesis: np.ndarray | None = None

    @property
    def decoder_matrix(self) -> np.ndarray:
        """[K, D]: coefficients @ decoder_matrix + mean reconstructs the rows."""
        return self.components.T if self.synthesis is None else self.synthesis

    @property
    def gain(self) -> float:
        """The largest |reconstruction - mean| per unit of max |coefficient| (overflow checks)."""
        return float(np.abs(self.decoder_matrix).sum(0).max())

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
        if self.synthesis is not None:
            h.update(np.ascontiguousarray(self.synthesis, "<f4").tobytes())
        return h.hexdigest()[:16]

    def truncate(self, k: int) -> "PCABasis":
        if not 1 <= k <= self.k:
            raise InvalidTensorError(f"cannot keep K={k} of {self.k} components")
        synthesis = None if self.synthesis is None else np.ascontiguousarray(self.synthesis[:k])
        return PCABasis(self.mean, np.ascontiguousarray(self.components[:, :k]), self.eigenvalues, dict(self.meta),
                        synthesis)

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
        return coeffs.astype(np.float32) @ self.decoder_matrix + self.mean

    def nbytes(self) -> int:
        """Bytes a receiver needs: the mean and the K kept components (and the synthesis, where one is set), float32."""
        return 4 * (self.dim + self.dim * self.k * (1 if self.synthesis is None else 2))

    def save(self, path: str | Path, dtype=np.float32) -> None:
        """Write the basis to a safetensors file at `path` (the per-layer artifact both ends load).

        Args: path: the file to write (replaced if it exists; its folder must exist). dtype: of the
        mean and components on disk (np.float16 halves the file; PCABasis.load reads them back as
        float32, and a basis read back from float16 has another content_hash); the eigenvalues stay float32.
        The metadata holds meta as JSON (meta_json), each meta value as text, dim, k and content_hash.
        Returns None. Raises ConfigurationError where meta holds a value JSON cannot write (it must
        travel with the file), FileNotFoundError where the folder does not exist."""
        from safetensors.numpy import save_file

        try:
            meta_json = json.dumps(self.meta)
        except TypeError as e:
            raise ConfigurationError(f"the basis meta cannot be written to the file ({e}): give fit_basis(..., **meta) "
                                     "values JSON can hold (str, int, float, bool, None, lists, dicts)") from None
        if not Path(path).parent.is_dir():
            raise FileNotFoundError(f"cannot write the basis to {str(path)!r}: its folder {str(Path(path).parent)!r} "
                                    "does not exist; create it first")
        meta = {k: str(v) for k, v in self.meta.items()}
        meta.update(content_hash=self.content_hash, dim=str(self.dim), k=str(self.k), meta_json=meta_json)
        tensors = {"mean": self.mean.astype(dtype), "components": self.components.astype(dtype),
                   "eigenvalues": self.eigenvalues.astype(np.float32)}
        if self.synthesis is not None:
            tensors["synthesis"] = self.synthesis.astype(dtype)
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> "PCABasis":
        """Read a basis written by PCABasis.save.

        Args: path: the safetensors file. Returns the PCABasis, mean, components and eigenvalues as
        float32, meta as saved. Raises FileNotFoundError where there is no such file,
        BitstreamError where the file is not a readable safetensors file (truncated, corrupt) or is
        one but not a basis (no basis metadata, or no mean / components / eigenvalues: e.g. a KV
        codec's file, which KVCodec.load reads)."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "numpy") as f:
                meta_json = (f.metadata() or {}).get("meta_json")
                t = {k: f.get_tensor(k).astype(np.float32) for k in f.keys()}
        except SafetensorError as e:
            raise BitstreamError(f"{str(path)!r} is not a readable safetensors file ({e}): truncated or corrupt; "
                                 "write it again with PCABasis.save") from None
        missing = [k for k in ("mean", "components", "eigenvalues") if k not in t]
        if meta_json is None or missing:
            what = "no basis metadata (meta_json)" if meta_json is None else f"no {', '.join(missing)}"
            raise BitstreamError(f"{str(path)!r} is a safetensors file but not a PCABasis: {what}; it holds "
                                 f"{', '.join(sorted(t)) or 'no tensors'}. A basis file is written by PCABasis.save "
                                 "(a KV codec's file loads with shared.kvcodec.KVCodec.load)")
        return cls(t["mean"], t["components"], t["eigenvalues"], json.loads(meta_json), t.get("synthesis"))


def fit_basis(captures: Iterable, k: int, **meta) -> PCABasis:
    """The PCA basis of calibration captures: their float64 mean and covariance (streamed, one
    capture in memory at a time), its k largest-variance eigenvectors kept.

    Args: captures: an iterable (list, generator) of [T, D] tensors (numpy or torch, any float
    dtype), all with the same D; a single tensor goes in a list: fit_basis([x], k). k: components
    kept, 1..D. meta: what to record with the basis (model=, layer=...; saved with it, so
    JSON-serializable), beside n_captures and n_tokens. Returns a PCABasis (float32 mean [D],
    components [D, k], the whole eigenvalue spectrum [D]). Raises InvalidTensorError for no
    captures, a single tensor passed bare, a capture that is not a finite 2-D float tensor, fewer
    than 2 tokens in all or k outside 1..D; BasisMismatchError for captures of different D."""
    if (hasattr(captures, "detach") or isinstance(captures, np.ndarray)) and getattr(captures, "ndim", 0) == 2:
        raise InvalidTensorError(f"fit_basis takes a list of [T, D] captures, got one tensor of shape "
                                 f"{tuple(captures.shape)}; pass it in a list: fit_basis([x], k)")
    acc = None
    for x in captures:
        x = as_float_matrix(x, "capture")
        acc = acc or CovarianceAccumulator(x.shape[1])
        acc.add(x)
    if acc is None:
        raise InvalidTensorError("fit_basis got no captures")
    return acc.basis(k, **meta)


def fit_basis_torch(x, k: int, **meta) -> PCABasis:
    """fit_basis for one torch tensor [T, D] (any float dtype), computed on its device: the float64
    mean and covariance and their eigendecomposition stay there, so a GPU fits a D=1024 basis in
    milliseconds where the CPU needs a second. Same result as fit_basis([x], k) up to rounding."""
    import torch

    if not hasattr(x, "detach") or not torch.is_floating_point(x) or x.dim() != 2 or x.numel() == 0:
        raise InvalidTensorError(f"fit_basis_torch takes a non-empty 2-D float torch tensor [T, D], got "
                                 f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}")
    if x.shape[0] < 2:
        raise InvalidTensorError("need at least 2 tokens to estimate a covariance")
    if not 1 <= k <= x.shape[1]:
        raise InvalidTensorError(f"K={k} must be in 1..D={x.shape[1]}")
    xd = x.detach().double()
    if not bool(torch.isfinite(xd).all()):
        raise InvalidTensorError("tensor holds NaN/Inf values; fix the producer, nothing is clipped here")
    mean = xd.mean(0)
    centred = xd - mean
    cov = centred.T @ centred / (x.shape[0] - 1)
    eigvals, eigvecs = torch.linalg.eigh((cov + cov.T) / 2)
    meta = {"n_captures": 1, "n_tokens": int(x.shape[0]), **meta}
    return _basis_from_eigh(mean.cpu().numpy(), eigvals.cpu().numpy(), eigvecs.cpu().numpy(), k, meta)


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

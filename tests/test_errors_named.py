"""Issue #42: every mistake gets a named error of shared.errors, when the object is made where it can be
known then, with a message that names the cause and the fix. Fast: no model, tiny tensors."""
import pathlib

import numpy as np
import pytest
import torch

from shared.basis import PCABasis, fit_basis
from shared.errors import ConfigurationError
from shared.pipeline import TensorCodec


@pytest.fixture(scope="module")
def basis():
    x = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    return fit_basis([x], 4, model="demo", layer="0.k")


# ---------------------------------------------------------------- 1. a path instead of a PCABasis

@pytest.mark.parametrize("path", ["layer.safetensors", pathlib.Path("layer.safetensors")])
def test_a_path_as_the_basis_says_to_load_it(path):
    with pytest.raises(ConfigurationError, match=r"got the path 'layer.safetensors'.*"
                                                 r"TensorCodec\(PCABasis.load\('layer.safetensors'\)"):
        TensorCodec(path, backend="zstd")


def test_a_backend_name_as_the_basis_says_backend_eq():
    with pytest.raises(ConfigurationError, match=r"backend name 'x265'.*backend='x265'"):
        TensorCodec("x265")


def test_another_object_as_the_basis_is_named(basis):
    with pytest.raises(ConfigurationError, match="got a ndarray.*PCABasis.load"):
        TensorCodec(basis.components, backend="zstd")
    codec = TensorCodec(basis, backend="zstd")
    with pytest.raises(ConfigurationError, match="got the path"):  # set later, too
        codec.basis = "other.safetensors"
    assert codec.basis is basis


def test_a_loaded_basis_still_codes(basis, tmp_path):
    basis.save(tmp_path / "b.safetensors")
    loaded = PCABasis.load(tmp_path / "b.safetensors")
    x = torch.randn(32, 16)
    codec = TensorCodec(loaded, backend="zstd", frame_size=64)
    assert codec.decode(codec.encode(x)).shape == x.shape

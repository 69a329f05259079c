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


# ---------------------------------------------------------------- 2. a KV codec's kind

@pytest.fixture(scope="module")
def kv_codec():
    from shared.kvcodec import fit_kv_codec

    g = torch.Generator().manual_seed(0)
    calib = [[(torch.randn(24, 8, generator=g), torch.randn(24, 8, generator=g)) for _ in range(2)]]
    return fit_kv_codec(calib, heads=2)


def test_a_kv_kind_typo_lists_the_kinds(kv_codec):
    x = torch.randn(10, 8)
    with pytest.raises(ConfigurationError, match=r"kind='K' \(did you mean 'k'\?\): this codec codes kind "
                                                 r"'k' \(keys\) or 'v' \(values\)"):
        kv_codec.encode(x, layer=0, kind="K")
    with pytest.raises(ConfigurationError, match="kind='keys'"):
        kv_codec.roundtrip(x, 0, "keys", count_bytes=False)
    with pytest.raises(ConfigurationError, match="kind='q'"):
        kv_codec.step(0, "q")


def test_a_kv_layer_it_was_not_fitted_on_is_named(kv_codec):
    from shared.errors import InvalidTensorError

    with pytest.raises(InvalidTensorError, match=r"no transform for layer 5 'k' \(it holds layers 0..1\)"):
        kv_codec.encode(torch.randn(10, 8), layer=5, kind="k")


def test_a_kv_header_naming_another_layer_is_a_bitstream_error(kv_codec):
    from shared.container import pack, unpack_container
    from shared.errors import BitstreamError

    blob = kv_codec.encode(torch.randn(10, 8), layer=1, kind="v")
    assert kv_codec.decode(blob).shape == (10, 8)
    header, chunks = unpack_container(blob)
    with pytest.raises(BitstreamError, match="layer 9 kind 'v'.*no transform"):
        kv_codec.decode(pack(dict(header, layer=9), chunks))


def test_a_kv_codec_of_other_kinds_names_its_own():
    """PoC 05 codes diffusion activations with kind 'x': the kinds listed are the codec's."""
    from shared.kvcodec import KVCodec, TensorTransform

    eye = np.eye(4, dtype=np.float32)
    codec = KVCodec({(0, "x"): TensorTransform(np.zeros(4, np.float32), eye, eye, 1.0)})
    assert codec.step(0, "x") == 1.0
    with pytest.raises(ConfigurationError, match=r"kind='k': this codec codes kind 'x'"):
        codec.step(0, "k")


# ---------------------------------------------------------------- 3. query_metric's prefix

@pytest.fixture(scope="module")
def rope():
    from shared.kvcodec import Rope

    return Rope(1.0 / 10000 ** (np.arange(0, 8, 2) / 8))  # head_dim 8


def test_query_metric_prefix_out_of_range_is_named(rope):
    from shared.kvcodec import query_metric

    qs = [torch.randn(5, 16)]
    with pytest.raises(ConfigurationError, match=r"needs prefix >= 1, got prefix=0.*pre_rope=False"):
        query_metric(qs, 2, rope, 0, True, np.random.default_rng(0))
    with pytest.raises(ConfigurationError, match=r"prefix=-3: .*an int >= 0"):
        query_metric(qs, 2, rope, -3, False, np.random.default_rng(0))
    with pytest.raises(ConfigurationError, match=r"prefix=2.5"):
        query_metric(qs, 2, rope, 2.5, False, np.random.default_rng(0))
    assert query_metric(qs, 2, rope, 0, False, np.random.default_rng(0)).shape == (2, 8, 8)  # post-RoPE: 0 is fine
    assert query_metric(qs, 2, rope, np.int64(4), True, np.random.default_rng(0)).shape == (2, 8, 8)


def test_query_metric_without_rope_or_queries_is_named(rope):
    from shared.errors import InvalidTensorError
    from shared.kvcodec import query_metric

    with pytest.raises(InvalidTensorError, match="rotary embedding"):
        query_metric([torch.randn(5, 16)], 2, None, 4, False, np.random.default_rng(0))
    with pytest.raises(InvalidTensorError, match="no queries"):
        query_metric([], 2, rope, 4, False, np.random.default_rng(0))


# ---------------------------------------------------------------- 4. setting values, checked when the codec is made

@pytest.mark.parametrize("backend, settings, message", [
    ("zstd", dict(level=99), r"zstd level=99: use an int from -131072 \(fastest\) to 22 \(smallest\)"),
    ("zstd", dict(level="3"), r"zstd level='3': use an int"),
    ("zstd", dict(threads=1000), r"zstd threads=1000: use an int from -1"),
    ("x265", dict(qp=80), r"x265 qp=80: use None \(lossless\) or an int from 0 to 51"),
    ("x265", dict(qp=18.5), r"x265 qp=18.5"),
    ("x265", dict(preset="fastest"), r"x265 preset='fastest': use one of ultrafast, .*placebo"),
    ("x265", dict(intra="yes"), r"x265 intra='yes': use True or False"),
    ("ffmpeg-x265", dict(qp=80), r"x265 qp=80: use None \(lossless\) or an int from 0 to 51"),
    ("nvdec-hevc", dict(qp=60), r"NVENC qp=60: use None \(lossless\) or an int from 0 to 51"),
    ("nvdec-hevc", dict(preset="P9"), r"NVENC preset='P9': use one of P1, .*P7"),
])
def test_a_setting_out_of_range_is_refused_when_the_codec_is_made(basis, backend, settings, message):
    """No encode runs (nor a GPU is needed): the codec is refused where it is made."""
    with pytest.raises(ConfigurationError, match=message):
        TensorCodec(basis, backend=backend, **settings)
    with pytest.raises(ConfigurationError, match=message):
        TensorCodec(None, backend=backend, **settings)


def test_settings_in_range_are_taken(basis):
    for backend, settings in [("zstd", dict(level=22)), ("zstd", dict(level=-5, threads=-1)),
                              ("x265", dict(qp=51, preset="ultrafast", intra=True)), ("x265", dict(qp=None)),
                              ("ffmpeg-x265", dict(qp=0, preset="slow")), ("nvdec-hevc", dict(qp=30, preset="p1"))]:
        TensorCodec(basis, backend=backend, **settings)


def test_a_session_checks_the_values_and_a_decoder_takes_a_header_as_it_is():
    from shared.codecs import get_backend

    with pytest.raises(ConfigurationError, match="zstd level=99"):
        get_backend("zstd").encoder(64, 64, level=99)
    get_backend("zstd").decoder(64, 64, level=99).close()  # a header's settings: not the decoder's to judge
    get_backend("x265").decoder(64, 64, qp=80).close()


def test_zstd_level_99_used_to_fail_only_at_encode(basis):
    """The reported case, end to end: made and coded with a valid level, refused at once with 99."""
    x = torch.randn(32, 16)
    codec = TensorCodec(basis, backend="zstd", level=3, frame_size=64)
    assert codec.decode(codec.encode(x)).shape == x.shape
    with pytest.raises(ConfigurationError, match="level=99"):
        TensorCodec(basis, backend="zstd", level=99, frame_size=64)


# ---------------------------------------------------------------- 5. SpillCache's mode

def test_a_spill_cache_mode_typo_lists_the_modes():
    from shared.kvcache import SpillCache

    with pytest.raises(ConfigurationError, match=r"mode must be one of raw_fetch, compressed_fetch, gpu_resident; "
                                                 r"got 'raw_fecth' \(did you mean 'raw_fetch'\?\)"):
        SpillCache(2, "raw_fecth")
    with pytest.raises(ConfigurationError, match=r"got 'swap'$"):
        SpillCache(2, "swap")
    with pytest.raises(ConfigurationError, match=r"compressed_fetch needs codecs: one \(codec_k, codec_v\) pair"):
        SpillCache(2, "compressed_fetch")
    with pytest.raises(ConfigurationError, match="chunk_tokens must be >= 1"):
        SpillCache(2, chunk_tokens=0)
    assert SpillCache(2, "gpu_resident").mode == "gpu_resident"


# ---------------------------------------------------------------- 6. fit_basis, PCABasis.save / load

@pytest.mark.parametrize("fn", [fit_basis, PCABasis.save, PCABasis.load])
def test_the_basis_functions_say_what_they_take_return_and_raise(fn):
    doc = fn.__doc__ or ""
    assert len(doc.split()) > 20 and "Args" in doc and "Raises" in doc and "Returns" in doc


def test_fit_basis_mistakes_are_named(basis):
    from shared.errors import BasisMismatchError, InvalidTensorError

    x = np.random.default_rng(1).standard_normal((32, 16)).astype(np.float32)
    with pytest.raises(InvalidTensorError, match=r"got one tensor of shape \(32, 16\); pass it in a list: fit_basis\(\[x\], k\)"):
        fit_basis(x, 4)
    with pytest.raises(InvalidTensorError, match=r"got one tensor of shape \(32, 16\)"):
        fit_basis(torch.from_numpy(x), 4)
    with pytest.raises(InvalidTensorError, match="no captures"):
        fit_basis([], 4)
    with pytest.raises(InvalidTensorError, match=r"K=17 must be in 1..D=16"):
        fit_basis([x], 17)
    with pytest.raises(BasisMismatchError, match="capture has 8 channels"):
        fit_basis([x, x[:, :8]], 4)
    assert fit_basis(x[None], 4).k == 4  # a stack of captures [N, T, D] is an iterable of them


def test_basis_save_and_load_mistakes_are_named(basis, tmp_path):
    from safetensors.numpy import save_file

    from shared.errors import BitstreamError

    path = tmp_path / "b.safetensors"
    basis.save(path)
    back = PCABasis.load(path)
    assert back.content_hash == basis.content_hash and back.meta == basis.meta
    with pytest.raises(FileNotFoundError):
        PCABasis.load(tmp_path / "missing.safetensors")
    (tmp_path / "cut.safetensors").write_bytes(path.read_bytes()[:40])
    with pytest.raises(BitstreamError, match="not a readable safetensors file.*PCABasis.save"):
        PCABasis.load(tmp_path / "cut.safetensors")
    save_file({"0.k.mean": np.zeros(4, np.float32)}, str(tmp_path / "kv.safetensors"), metadata={"settings": "{}"})
    with pytest.raises(BitstreamError, match=r"not a PCABasis: no basis metadata.*holds 0.k.mean.*KVCodec.load"):
        PCABasis.load(tmp_path / "kv.safetensors")
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        basis.save(tmp_path / "no" / "b.safetensors")
    odd = fit_basis([np.random.default_rng(2).standard_normal((8, 4))], 2, model=object())
    with pytest.raises(ConfigurationError, match="values JSON can hold"):
        odd.save(tmp_path / "odd.safetensors")
    assert not (tmp_path / "odd.safetensors").exists()

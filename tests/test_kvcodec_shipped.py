"""The KV codec file the repository ships (artifacts/kv_codec/): it loads by one call, codes a layer's
rows, names its model and target; a reduced file (no synthesis matrices, float16) reads back as the
full one codes; a missing file names the make target that rebuilds it. No model is loaded."""
import numpy as np
import pytest
import torch

from shared import kvcodec
from shared.errors import CodecFileMissing, ConfigurationError
from shared.kvcodec import KVCodec, Rope, fit_kv_codec, load_shipped

C, HEADS = 128, 2


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def rows_like_the_codec(codec: KVCodec, layer: int, kind: str, tokens: int, start: int = 0) -> torch.Tensor:
    """Synthetic rows [tokens, C] the codec's transform was made for: its mean plus coefficients of
    about 8 steps RMS through its synthesis (keys rotated by RoPE when the codec codes them before it)."""
    t = codec.transform(layer, kind)
    g = torch.Generator().manual_seed(layer)
    coefficients = torch.randn(tokens, len(t.mean), generator=g) * 8 * codec.step(layer, kind)
    rows = coefficients @ torch.as_tensor(t.synthesis) + torch.as_tensor(t.mean)
    return codec.rope.apply(rows, start) if kind == "k" and codec.pre_rope else rows


@pytest.fixture(scope="module")
def shipped() -> KVCodec:
    return load_shipped("smollm2", target_pct=0.3)


def test_the_shipped_codec_names_its_model_and_target(shipped):
    assert "SmolLM2-135M" in shipped.meta["model"]
    assert shipped.meta["target_ppl_change"] == pytest.approx(0.003)
    assert "+0.3%" in shipped.meta["operating_point"] and shipped.meta["calibration_prefix"] == 512
    assert sorted({layer for layer, _ in shipped.transforms}) == list(range(30))


@pytest.mark.parametrize("kind", ["k", "v"])
def test_the_shipped_codec_codes_a_layer(shipped, kind):
    x = rows_like_the_codec(shipped, 7, kind, tokens=96, start=5)
    assert x.shape == (96, 192)
    blob = shipped.encode(x, layer=7, kind=kind, start=5)
    x_hat = shipped.decode(blob)
    assert x_hat.shape == x.shape and cos(x_hat, x) > 0.99
    assert len(blob) < x.numel() * 2  # smaller than the bf16 rows


def test_a_missing_shipped_file_names_the_make_target(monkeypatch, tmp_path):
    monkeypatch.setattr(kvcodec, "SHIPPED_DIR", tmp_path / "nothing_here")
    with pytest.raises(CodecFileMissing, match="make kv-codec") as caught:
        load_shipped("smollm2", target_pct=0.3)
    assert isinstance(caught.value, FileNotFoundError) and "smollm2_p512_target0.3pct.safetensors" in str(caught.value)
    with pytest.raises(CodecFileMissing, match="make kv-codec"):
        kvcodec.load_shipped("smollm2", target_pct=7)  # a target no file is shipped for
    with pytest.raises(ConfigurationError, match="smollm2"):
        load_shipped("mistral")


@pytest.fixture(scope="module")
def small_codec() -> KVCodec:
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(C, C, generator=g) / C ** 0.5
    calib = [[((torch.randn(64, C, generator=g) * torch.linspace(3, 0.1, C)) @ mix + 0.5,
               torch.randn(64, C, generator=g) * torch.linspace(2, 0.2, C)) for _ in range(2)] for _ in range(3)]
    rope = Rope(1.0 / 10000 ** (np.arange(0, 64, 2) / 64))
    codec = fit_kv_codec(calib, HEADS, sink=4, pre_rope=True, rope=rope, meta={"model": "a random stand-in"})
    return codec.set_scale(0.3)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_reduced_file_codes_as_the_full_one(small_codec, dtype, tmp_path):
    small_codec.save(tmp_path / "full.safetensors")
    small_codec.save(tmp_path / "reduced.safetensors", synthesis=False, dtype=dtype)
    full, reduced = KVCodec.load(tmp_path / "full.safetensors"), KVCodec.load(tmp_path / "reduced.safetensors")
    assert (tmp_path / "reduced.safetensors").stat().st_size < 0.55 * (tmp_path / "full.safetensors").stat().st_size
    assert reduced.meta == full.meta and reduced.scale == full.scale
    x = [[rows_like_the_codec(full, layer, kind, 80) for kind in "kv"] for layer in range(2)]
    check = kvcodec.compare_decoding(full, reduced, [x])
    if dtype == "float32":  # the same analysis matrices: the same symbols, the synthesis its inverse
        assert check["symbols_differ"] == 0 and check["max_abs_diff"] < 1e-4 * check["max_abs_x"]
    assert check["squared_error_ratio"] == pytest.approx(1, abs=0.01)
    # a blob coded with the full file decodes with the reduced one (the meta hash is the same)
    blob = full.encode(x[1][0], 1, "k")
    assert cos(reduced.decode(blob), full.decode(blob)) > 0.9999


def test_save_refuses_an_unknown_dtype(small_codec, tmp_path):
    with pytest.raises(ConfigurationError, match="float16"):
        small_codec.save(tmp_path / "c.safetensors", dtype="int8")

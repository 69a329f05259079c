"""The compiled CPU rANS coder (shared/codecs/rans_cpu.py) writes the numpy reference's bytes
(shared/codecs/rans.py) on every input, and each decodes the other's payloads; the compiled
quantizer gives the numpy quantizer's symbols; TensorCodec's CPU path uses the compiled coder.
Skipped where numba is not installed."""
import numpy as np
import pytest

pytest.importorskip("numba")

from shared import rdquant  # noqa: E402
from shared.codecs import rans, rans_cpu  # noqa: E402
from shared.errors import BitstreamError, InvalidTensorError  # noqa: E402
from test_rans import cases, pca_like  # noqa: E402


def assert_same_coder(x, **settings):
    """Identical bytes from both encoders; both decoders give x back from either payload."""
    ref = rans.encode(x, **settings)
    fast = rans_cpu.encode(x, **settings)
    assert fast == ref, f"payloads differ ({len(fast)} vs {len(ref)} bytes)"
    want = np.asarray(x).astype(np.int32)
    np.testing.assert_array_equal(rans_cpu.decode(ref), want)
    np.testing.assert_array_equal(rans.decode(fast), want)
    return fast


def wide_windows(T=900, K=6, seed=4):
    """Components spanning more than the widest alphabet: windows centred on the mean, tails escaped."""
    rng = np.random.default_rng(seed)
    return np.rint(rng.standard_normal((T, K)) * np.array([3000, 700, 200, 60, 2, 0.1])[:K]).astype(np.int32)


@pytest.mark.parametrize("name", list(cases()))
def test_reference_cases_identical(name):
    assert_same_coder(cases()[name])


@pytest.mark.parametrize("shape", [(1, 1), (1, 37), (5000, 1), (33, 33), (1025, 70), (2048, 64)])
def test_shapes_identical(shape):
    assert_same_coder(pca_like(*shape, seed=shape[0] + shape[1]))


@pytest.mark.parametrize("prob_bits", range(10, 16))
def test_every_prob_bits_identical(prob_bits):
    x = np.concatenate([pca_like(700, 12, seed=prob_bits), wide_windows(700)], 1)
    assert_same_coder(x, prob_bits=prob_bits)


@pytest.mark.parametrize("settings", [dict(lane_tokens=1), dict(lane_tokens=7), dict(lane_tokens=100),
                                      dict(lane_tokens=5000), dict(group_lanes=1), dict(group_lanes=2),
                                      dict(group_lanes=8, lane_tokens=64), dict(group_lanes=64),
                                      dict(group_lanes=1024, lane_tokens=50)])
def test_lane_layouts_identical(settings):
    """Groups inside one token chunk, groups straddling chunks and components, partial last chunks."""
    x = np.concatenate([pca_like(1000, 40, seed=1), wide_windows(1000)], 1)
    assert_same_coder(x, **settings)


def test_escapes_and_single_symbol_components_identical():
    x = wide_windows(2048, 6)
    x[:, 5] = 7  # one symbol: codes nothing
    x[::97, 1] = 2**31 - 1  # rare extremes escape
    x[::131, 2] = -2**31
    hdr = rans.parse(assert_same_coder(x, group_lanes=4))
    assert hdr.n_escapes > 0 and hdr.layout.k_coded == 5


def test_sampled_tables_identical():
    """A tensor long enough that the tables come from every R-th token (R > 1)."""
    x = pca_like(70000, 3, seed=9)
    x[12345, 0] = 10**6  # a value the sample may miss
    assert rans.hist_row_stride(len(x)) > 1
    assert_same_coder(x)


def test_real_pca_coefficients_identical():
    """Activations with a decaying spectrum, rotated into their PCA basis and quantized with one shared step."""
    from shared.basis import fit_basis

    rng = np.random.default_rng(3)
    D = 96
    mix = rng.standard_normal((D, D)) * (np.arange(1, D + 1) ** -1.0)[None, :]
    calib = [(rng.standard_normal((1024, D)) @ mix.T + 0.5).astype(np.float32) for _ in range(2)]
    basis = fit_basis(calib, k=64)
    x = (rng.standard_normal((3000, D)) @ mix.T + 0.5).astype(np.float32)
    coeffs = basis.project(x)
    for step in (0.002, 0.05, 1.0):
        q = rdquant.RDQuantizer(step)
        assert_same_coder(q.quantize(coeffs))


def test_corrupt_payloads_raise_like_the_reference():
    x = wide_windows(1024, 6)
    payload = bytearray(rans_cpu.encode(x))
    for pos in (3, 30, 60, len(payload) // 2, len(payload) - 3):
        bad = bytearray(payload)
        bad[pos] ^= 0x5A
        with pytest.raises(BitstreamError):
            rans.decode(bytes(bad))
        with pytest.raises(BitstreamError):
            rans_cpu.decode(bytes(bad))
    with pytest.raises(BitstreamError, match="truncated"):
        rans_cpu.decode(bytes(payload[:-2]))


def test_corrupt_streams_behind_a_valid_checksum_raise():
    """Words changed and the checksum rewritten: only the lane-state and escape checks can tell."""
    x = pca_like(2048, 32, seed=11)
    payload = bytearray(rans_cpu.encode(x))
    lay = rans.parse(bytes(payload)).layout
    payload[lay.streams + 10] ^= 0xFF
    c0, c1 = rans_cpu.checksum(payload[:rans.CHECKED_HEADER_BYTES], payload[rans.HEADER.size:])
    payload[rans.CHECKED_HEADER_BYTES:rans.HEADER.size] = np.array([c0, c1], "<u4").tobytes()
    with pytest.raises(BitstreamError, match="streams are corrupt"):
        rans.decode(bytes(payload))
    with pytest.raises(BitstreamError, match="streams are corrupt"):
        rans_cpu.decode(bytes(payload))


@pytest.mark.parametrize("n", [0, 1, 47, 65520, 65521, 65522, 200000])
def test_checksum_matches_reference(n):
    rng = np.random.default_rng(n)
    head, rest = rng.integers(0, 256, 48, np.uint8).tobytes(), rng.integers(0, 256, n, np.uint8).tobytes()
    assert rans_cpu.checksum(head, rest) == rans.checksum(head, rest)
    assert rans_cpu.checksum(head, rest[:n // 3], rest[n // 3:]) == rans.checksum(head, rest)


def test_bad_input_errors_match_reference():
    with pytest.raises(InvalidTensorError, match="empty"):
        rans_cpu.encode(np.zeros((0, 4), np.int32))
    with pytest.raises(InvalidTensorError, match="prob_bits"):
        rans_cpu.encode(pca_like(10, 2), prob_bits=16)
    with pytest.raises(InvalidTensorError, match="group_lanes"):
        rans_cpu.encode(pca_like(10, 2), group_lanes=3)


def test_compiled_quantizer_matches_numpy():
    rng = np.random.default_rng(0)
    c = (rng.standard_normal((513, 37)) * 3).astype(np.float32)
    c[0, :6] = [0.5, 1.5, 2.5, -0.5, -2.5, 0.0]  # ties round to even
    for step in (1.0, 0.37, 1e-3):
        for keep in (None, rng.random(37) > 0.3):
            q = rdquant.RDQuantizer(step, keep)
            ref = np.rint(c.astype(np.float64) / step).astype(np.int32) * (1 if keep is None else keep[None, :])
            np.testing.assert_array_equal(q.quantize(c), ref)
            np.testing.assert_array_equal(q.quantize(c.astype(np.float64)), ref)
            np.testing.assert_array_equal(q.dequantize(ref), ref.astype(np.float32) * np.float32(step))
    bad = c.copy()
    bad[3, 3] = np.nan
    with pytest.raises(InvalidTensorError, match="NaN"):
        rdquant.RDQuantizer(0.1).quantize(bad)
    with pytest.raises(InvalidTensorError, match="beyond int32"):
        rdquant.RDQuantizer(1e-12).quantize(c)


def test_tensor_codec_uses_the_compiled_coder(monkeypatch):
    import torch

    from shared.pipeline import TensorCodec, unpack

    assert rans_cpu.coder() is rans_cpu
    x = torch.from_numpy(wide_windows(1500, 6).astype(np.float32) / 50).bfloat16()
    codec = TensorCodec(None, backend="rans", step=0.02)
    blob = codec.encode(x)
    header, chunks = unpack(blob)
    symbols = rdquant.RDQuantizer(0.02).quantize(x.float().numpy())
    assert chunks["DATA"] == rans.encode(symbols)
    out = codec.decode(blob)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    np.testing.assert_array_equal(out.float().numpy(), torch.from_numpy(symbols * np.float32(0.02)).bfloat16().float())
    # without numba the reference coder runs, and says so
    monkeypatch.setattr(rans_cpu, "AVAILABLE", False)
    monkeypatch.setattr(rans_cpu, "_WARNED", [])
    with pytest.warns(RuntimeWarning, match="numpy rANS reference"):
        assert codec.encode(x) == blob

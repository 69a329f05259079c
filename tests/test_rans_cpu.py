"""The compiled CPU rANS coder (shared/codecs/rans_cpu.py) writes the numpy reference's bytes
(shared/codecs/rans.py) on every input, and each decodes the other's payloads; the compiled
quantizer gives the numpy quantizer's symbols; TensorCodec's CPU path uses the compiled coder.
Skipped where numba is not installed."""
import numpy as np
import pytest

pytest.importorskip("numba")

from shared import rdquant  # noqa: E402
from shared.codecs import rans, rans_cpu, rans_cpu_bench, rans_tables  # noqa: E402
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


@pytest.mark.parametrize("prob_bits", range(9, 16))
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


@pytest.mark.parametrize("settings", [dict(lane_tokens=64), dict(lane_tokens=7), dict(lane_tokens=100, group_lanes=8),
                                      dict(lane_tokens=5000), dict(lane_tokens=16, group_lanes=1024)])
def test_lanes_by_component_identical(settings):
    """Lane groups walking one component's token chunks (flag LANES_BY_COMPONENT): both coders write
    the same bytes, of the same size as the default order's but not the same, and decode each other's;
    groups straddle components where the chunks do not fill them."""
    x = np.concatenate([pca_like(1000, 40, seed=3), wide_windows(1000)], 1)
    x[::97, 3] += 9000  # escapes
    by_component = assert_same_coder(x, lanes_by_component=True, **settings)
    by_token = rans.encode(x, **settings)
    assert rans.parse(by_component).layout.by_component and not rans.parse(by_token).layout.by_component
    assert len(by_component) == len(by_token) and by_component != by_token


def test_unknown_header_flags_are_refused():
    payload = bytearray(rans.encode(pca_like(100, 4), lanes_by_component=True))
    at = rans.HEADER.size - 18  # the u16 flags field
    payload[at] |= 2
    c0, c1 = rans.checksum(payload[:rans.CHECKED_HEADER_BYTES], payload[rans.HEADER.size:])
    payload[rans.CHECKED_HEADER_BYTES:rans.HEADER.size] = np.array([c0, c1], "<u4").tobytes()
    for decode in (rans.decode, rans_cpu.decode):
        with pytest.raises(BitstreamError, match="flags=3"):
            decode(bytes(payload))


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
    assert rans_tables.hist_row_stride(len(x)) > 1
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

    from shared.container import unpack
    from shared.pipeline import TensorCodec

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


# -- the bf16 CPU path: fused quantizer statistics, CpuProjection, the coder given statistics ---------


def test_encode_given_column_statistics_is_identical():
    x = np.concatenate([pca_like(1500, 20, seed=5), wide_windows(1500)], 1)
    stats = (x.min(0), x.max(0), x.astype(np.int64).sum(0))
    assert rans_cpu.encode(x, stats=stats) == rans.encode(x)
    with pytest.raises(InvalidTensorError, match="stats"):
        rans_cpu.encode(x, stats=(x.min(0), x.max(0)[:3], x.sum(0)))


def _bf16_bits(a):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).bfloat16().view(torch.int16).numpy().view(np.uint16)


def test_quantize_with_stats_matches_numpy_for_float_and_bf16_bits():
    import torch

    rng = np.random.default_rng(1)
    c = (rng.standard_normal((700, 37)) * 5).astype(np.float32)
    c[0, :5] = [0.5, 1.5, 2.5, -0.5, -2.5]  # ties round to even
    bias = (rng.standard_normal(37) * 0.3).astype(np.float32)
    cb = torch.from_numpy(c).bfloat16().float().numpy()  # the values the bf16 bits hold
    for step in (1.0, 0.013):
        for keep in (None, rng.random(37) > 0.4):
            q = rdquant.RDQuantizer(step, keep)
            mask = 1 if keep is None else keep[None, :]
            for values, b, bits, ref_in in ((c, None, False, c), (c.astype(np.float64), None, False, c),
                                            (_bf16_bits(c), bias, True, cb - bias)):
                sym, (mn, mx, sm) = q.quantize_with_stats(values, b, bf16=bits)
                ref = np.rint(ref_in.astype(np.float64) / step).astype(np.int32) * mask
                np.testing.assert_array_equal(sym, ref)
                np.testing.assert_array_equal(mn, ref.min(0))
                np.testing.assert_array_equal(mx, ref.max(0))
                np.testing.assert_array_equal(sm, ref.astype(np.int64).sum(0))
    bad = c.copy()
    bad[3, 3] = np.inf
    with pytest.raises(InvalidTensorError, match="NaN/Inf"):
        rdquant.RDQuantizer(0.1).quantize_with_stats(_bf16_bits(bad), bf16=True)
    with pytest.raises(InvalidTensorError, match="beyond int32"):
        rdquant.RDQuantizer(1e-9).quantize_with_stats(c)


def test_dequantize_to_bf16_bits_matches_torch_rounding():
    import torch

    rng = np.random.default_rng(2)
    sym = rng.integers(-40000, 40000, (300, 9)).astype(np.int32)
    sym[0, 0] = 2**31 - 1
    for step in (0.37, 1e-3, 3.3e-3):
        out = np.empty((300, 10), np.uint16)
        assert rdquant._KERNELS["dequantize_bf16"](sym, np.float32(step), out)
        want = torch.from_numpy(sym.astype(np.float32) * np.float32(step)).bfloat16().view(torch.int16).numpy()
        np.testing.assert_array_equal(out[:, :9].view(np.int16), want)
        assert (out[:, 9] == 0x3F80).all()  # 1.0: the column that carries the mean
    out = np.empty((300, 9), np.uint16)
    assert not rdquant._KERNELS["dequantize_bf16"](sym, np.float32(3e34), out)  # rounds to inf in bf16


def _bf16_case(T=2048, D=64, K=40, seed=3):
    import torch

    from shared.basis import fit_basis

    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((D, D)) * (np.arange(1, D + 1) ** -1.1)[None, :]
    calib = [(rng.standard_normal((T, D)) @ mix.T + 2.0).astype(np.float32) for _ in range(2)]
    x = torch.from_numpy((rng.standard_normal((T, D)) @ mix.T + 2.0).astype(np.float32)).bfloat16()
    return x, fit_basis(calib, k=K)


def test_bf16_cpu_path_follows_the_gpu_formulas():
    """A bf16 CPU tensor: projection and reconstruction in the GPU kernels' numerics (bf16 basis,
    float32 accumulation, the mean added before the one rounding), evaluated in float64 here; the
    payload is the numpy reference coder's for those symbols."""
    import torch

    from shared.container import unpack
    from shared.pipeline import TensorCodec

    x, basis = _bf16_case()
    codec = TensorCodec(basis, backend="rans", target_cos=0.999)
    blob = codec.encode(x)
    step = codec.quantizer.step
    header, chunks = unpack(blob)
    sym = rans.decode(chunks["DATA"])
    assert chunks["DATA"] == rans.encode(sym)
    gsym, gout = rans_cpu_bench._gpu_formula(x, basis, step, sym)
    assert (gsym == sym).mean() > 0.99 and np.abs(gsym - sym).max() <= 1  # bf16-rounded coefficients
    out = codec.decode(blob)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert (out == gout).float().mean() > 0.995  # the rest: float32 sums in another order, one ulp apart
    # one bf16 ulp, or near zero where the mean (about 2) cancels, float32 rounding of the mean's size
    torch.testing.assert_close(out.float(), gout.float(), rtol=2**-7, atol=1e-4)
    cos = rdquant.quality(x.float().numpy().astype(np.float64), out.float().numpy().astype(np.float64), "cos")
    assert cos >= 0.998
    # the float32 path of the same tensor reaches the same quality (its numerics: float32 basis)
    ref = TensorCodec(basis, backend="rans", step=step)
    y = ref.decode(ref.encode(x.float()))
    assert y.dtype == torch.float32
    assert abs(rdquant.quality(x.float().numpy().astype(np.float64), y.numpy().astype(np.float64), "cos") - cos) < 2e-4


def test_bf16_cpu_path_without_basis_is_the_float32_path():
    import torch

    from shared.container import unpack
    from shared.pipeline import TensorCodec

    x = torch.from_numpy(wide_windows(1500, 6).astype(np.float32) / 50).bfloat16()
    codec = TensorCodec(None, backend="rans", step=0.02)
    header, chunks = unpack(codec.encode(x))
    symbols = rdquant.RDQuantizer(0.02).quantize(x.float().numpy())
    assert chunks["DATA"] == rans.encode(symbols)
    np.testing.assert_array_equal(codec.decode(codec.encode(x)).float().numpy(),
                                  torch.from_numpy(symbols * np.float32(0.02)).bfloat16().float().numpy())


def test_bf16_cpu_path_refuses_what_the_general_path_refuses():
    import torch

    from shared.errors import BasisMismatchError
    from shared.pipeline import TensorCodec

    x, basis = _bf16_case(T=300)
    bad = x.clone()
    bad[7, 3] = float("nan")
    for b in (None, basis):
        with pytest.raises(InvalidTensorError, match="NaN/Inf"):
            TensorCodec(b, backend="rans", step=0.05).encode(bad)
    with pytest.raises(InvalidTensorError, match="overflow float32"):
        TensorCodec(None, backend="rans", step=0.1).encode(torch.full((8, 4), 3e38).bfloat16())
    with pytest.raises(BasisMismatchError):
        TensorCodec(basis, backend="rans", step=0.05).encode(x[:, :32].contiguous())
    blob = bytearray(TensorCodec(basis, backend="rans", step=0.05).encode(x))
    with pytest.raises(BasisMismatchError):
        TensorCodec(None, backend="rans", step=0.05).decode(bytes(blob))


@pytest.mark.gpu
def test_cpu_and_gpu_decoders_agree_on_bf16():
    """The same container decoded by the CPU (CpuProjection) and by the GPU (CudaProjection): the
    same formulas, so equal values but where float32 sums in another order round differently."""
    import torch

    from shared.pipeline import TensorCodec

    x, basis = _bf16_case(T=4096, D=128, K=96)
    codec = TensorCodec(basis, backend="rans", target_cos=0.999)
    blob = codec.encode(x.cuda())
    host = bytes(blob.cpu().numpy())
    on_gpu, on_cpu = codec.decode(blob, device="cuda").cpu(), codec.decode(host)
    assert (on_gpu == on_cpu).float().mean() > 0.99
    torch.testing.assert_close(on_gpu.float(), on_cpu.float(), rtol=2**-7, atol=1e-4)

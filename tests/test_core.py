"""Round trips, error bounds and bad input for basis, quant, frames, codecs, pipeline, metrics."""
import struct
import time

import numpy as np
import pytest
import torch

from shared import BackendUnavailable, BasisMismatchError, BitstreamError, ConfigurationError, InvalidTensorError
from shared import frames as framing
from shared.basis import CovarianceAccumulator, PCABasis, fit_basis, leave_one_out
from shared.codecs import availability, get_backend
from shared.container import pack, read_header, unpack
from shared.metrics import aggregate, quality, ratio
from shared.pipeline import TensorCodec
from shared.quant import PerChannelQuantizer

RNG = np.random.default_rng(0)


def low_rank(tokens=300, dim=64, rank=8, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(tokens, rank)) @ rng.normal(size=(rank, dim)) + noise * rng.normal(size=(tokens, dim))
            + 3.0).astype(np.float32)


# -- basis ----------------------------------------------------------------------------------------
def test_streaming_covariance_matches_numpy():
    parts = [low_rank(seed=s) for s in range(3)]
    acc = CovarianceAccumulator(64)
    for p in parts:
        acc.add(p)
    mean, cov = acc.mean_cov()
    allx = np.concatenate(parts).astype(np.float64)
    np.testing.assert_allclose(mean, allx.mean(0), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(cov, np.cov(allx.T), rtol=1e-7, atol=1e-9)


def test_basis_full_rank_reconstructs_exactly_and_low_rank_captures_variance():
    x = low_rank()
    full = fit_basis([x], k=64)
    np.testing.assert_allclose(full.reconstruct(full.project(x)), x, atol=1e-4)
    k8 = fit_basis([x], k=8)
    assert quality(x, k8.reconstruct(k8.project(x)))["rel_mse"] < 1e-4
    assert np.allclose(k8.components.T @ k8.components, np.eye(8), atol=1e-5)


def test_basis_save_load_roundtrip(tmp_path):
    b = fit_basis([low_rank()], k=16, model="toy", layer="3")
    b.save(tmp_path / "b.safetensors")
    c = PCABasis.load(tmp_path / "b.safetensors")
    assert c.content_hash == b.content_hash and c.k == 16 and c.meta["model"] == "toy" and c.meta["n_captures"] == 1
    np.testing.assert_array_equal(c.components, b.components)


def test_leave_one_out_equals_fit_on_the_others():
    parts = [low_rank(seed=s) for s in range(4)]
    for i, b in leave_one_out(parts, k=8):
        ref = fit_basis([p for j, p in enumerate(parts) if j != i], k=8)
        np.testing.assert_allclose(np.abs(b.components.T @ ref.components), np.eye(8), atol=1e-4)
        np.testing.assert_allclose(b.mean, ref.mean, atol=1e-5)


def test_basis_for_other_dim_is_refused():
    b = fit_basis([low_rank(dim=64)], k=8, model="toy", layer="1")
    with pytest.raises(BasisMismatchError, match="D=32.*D=64"):
        b.project(low_rank(dim=32))


# -- quant -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8, 12])
def test_quantizer_error_bound_and_params_roundtrip(bits):
    x = low_rank()
    q = PerChannelQuantizer.fit(x, bits)
    codes = q.quantize(x)
    assert codes.max() <= (1 << bits) - 1
    err = np.abs(q.dequantize(codes) - x)
    assert (err <= q.step / 2 * (1 + 1e-5) + 1e-6).all()
    q2 = PerChannelQuantizer.from_bytes(q.to_bytes())
    np.testing.assert_array_equal(q2.dequantize(codes), q.dequantize(codes))


def test_quantizer_constant_channel_is_exact():
    x = np.ones((10, 3), np.float32) * np.array([1.5, -2.0, 0.0], np.float32)
    q = PerChannelQuantizer.fit(x)
    np.testing.assert_array_equal(q.dequantize(q.quantize(x)), x)


# -- frames ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (256, 256), (300, 192), (1000, 70), (5, 600), (4096, 16), (130, 64), (999, 33)])
def test_frames_roundtrip_any_shape(shape):
    planes = RNG.integers(0, 256, shape, dtype=np.uint8)
    layout = framing.layout_for(*shape, height=64)
    f = framing.to_frames(planes, layout)
    assert f.shape == (layout.n_frames, 3, 64, 64) and f.dtype == np.uint8
    np.testing.assert_array_equal(framing.from_frames(f, layout), planes)


def test_frames_reject_bad_sizes():
    with pytest.raises(InvalidTensorError):
        framing.layout_for(0, 10)
    with pytest.raises(InvalidTensorError, match="multiples of 8"):
        framing.layout_for(10, 10, height=100)


# -- codecs ------------------------------------------------------------------------------------------
def smooth_frames(n=3, size=64):
    yy, xx = np.mgrid[:size, :size]
    base = (64 + 40 * np.sin(xx / 7.0) + 30 * np.cos(yy / 5.0)).astype(np.float32)
    return np.stack([np.stack([base + 10 * c + 3 * i for c in range(3)]) for i in range(n)]).clip(0, 255).astype(np.uint8)


@pytest.mark.parametrize("name,settings", [("x265", {"preset": "ultrafast"}), ("ffv1", {}), ("zstd", {}), ("raw", {}),
                                           ("ffmpeg-x265", {"preset": "ultrafast"})])
def test_lossless_backends_are_bit_exact_across_session_reuse(name, settings):
    backend = get_backend(name)
    if backend.unavailable_reason():
        pytest.skip(backend.unavailable_reason())
    frames = smooth_frames()
    with backend.encoder(64, 64, **settings) as enc, backend.decoder(64, 64) as dec:
        for _ in range(2):  # a session is reusable after flush
            enc.submit(frames[:2])
            enc.submit(frames[2:])
            payload = enc.flush()
            dec.submit(payload)
            np.testing.assert_array_equal(dec.flush(), frames)
    if name != "raw":
        assert len(payload) < frames.nbytes


def test_x265_constant_qp_is_lossy_but_close():
    frames = smooth_frames()
    backend = get_backend("x265")
    with backend.encoder(64, 64, qp=30, preset="ultrafast") as enc:
        enc.submit(frames)
        payload = enc.flush()
    with backend.decoder(64, 64) as dec:
        dec.submit(payload)
        out = dec.flush()
    diff = np.abs(out.astype(int) - frames)
    assert 0 < diff.max() < 40 and diff.mean() < 3


def test_codec_rejects_wrong_frames():
    with get_backend("zstd").encoder(64, 64) as enc:
        with pytest.raises(InvalidTensorError, match="uint8"):
            enc.submit(np.zeros((1, 3, 64, 64), np.float32))
        with pytest.raises(InvalidTensorError, match="shape"):
            enc.submit(np.zeros((1, 3, 32, 64), np.uint8))


def test_registry_explains_unavailable_backends(monkeypatch):
    table = availability()
    assert table["x265"] is None and table["zstd"] is None
    for name, reason in table.items():
        if reason is not None:
            with pytest.raises(BackendUnavailable, match=name):
                get_backend(name).encoder(64, 64)


def test_unknown_codec_id_is_named():
    """A wrong name in code is a configuration error listing the known backends (rans among them);
    a name read from a bitstream is a bitstream error."""
    with pytest.raises(ConfigurationError, match="unknown codec backend 'h266'; known backends: .*rans"):
        get_backend("h266")
    with pytest.raises(ConfigurationError, match="h266"):
        TensorCodec(None, backend="h266")
    with pytest.raises(BitstreamError, match="unknown codec id 'h266' in the bitstream"):
        get_backend("h266", from_bitstream=True)


def test_a_setting_a_backend_does_not_know_is_named():
    """A typo (QP= for qp=) or a setting of another backend is a configuration error that names it,
    the close name and the ones the backend takes, when the codec is made and when a session opens;
    decoders take their encoder's settings (a header carries them); a header does not carry where
    a session ran (zstd's threads), so such a blob still decodes."""
    x = torch.from_numpy(low_rank(256, 32, seed=3)).to(torch.bfloat16)
    with pytest.raises(ConfigurationError, match=r"'QP' \(did you mean 'qp'\?\); it takes: intra, preset, qp"):
        TensorCodec(None, backend="x265", QP=18)
    with pytest.raises(ConfigurationError, match="'level'"):
        TensorCodec(None, backend="x265", level=3)
    with pytest.raises(ConfigurationError, match="zstd' encoder does not know the setting.*'qp'"):
        get_backend("zstd").encoder(64, 64, qp=18)
    with pytest.raises(ConfigurationError, match="'ffv1' encoder does not know.*it takes: no settings"):
        get_backend("ffv1").encoder(64, 64, preset="fast")
    get_backend("x265").decoder(64, 64, qp=18, preset="fast").close()  # a header's settings
    codec = TensorCodec(None, backend="zstd", frame_size=64, level=5, threads=1)
    blob = codec.encode(x)
    assert read_header(blob)["codec"]["settings"] == {"level": 5}
    assert torch.equal(codec.decode(blob), TensorCodec(None, backend="zstd", frame_size=64).decode(blob))


def test_availability_prints_a_table():
    table = availability()
    text = str(table)
    lines = text.splitlines()
    assert lines[0].split() == ["backend", "runs", "here", "why", "not", "/", "fix"]
    assert len(lines) == 2 + len(table)
    x265 = next(line for line in lines if line.split()[0] == "x265")
    assert x265.split()[1] == "yes"
    for name, reason in table.items():
        if reason is not None:
            row = next(line for line in lines if line.split()[0] == name)
            assert row.split()[1] == "no" and reason in row


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_decode_on_cuda_without_cuda_says_so():
    blob = TensorCodec(None, backend="zstd", frame_size=64).encode(make_tensor())
    with pytest.raises(BackendUnavailable, match="CUDA is not available here.*device=None"):
        TensorCodec(None, backend="zstd").decode(blob, device="cuda")


# -- pipeline ----------------------------------------------------------------------------------------
def make_tensor(dtype=torch.bfloat16, tokens=300, dim=64):
    return torch.from_numpy(low_rank(tokens, dim)).to(dtype)


@pytest.mark.parametrize("backend,settings", [("x265", {"preset": "ultrafast"}), ("ffv1", {}), ("zstd", {})])
def test_pipeline_roundtrip_preserves_shape_dtype_and_quality(backend, settings):
    x = make_tensor()
    basis = fit_basis([x], k=16)
    codec = TensorCodec(basis, backend=backend, frame_size=64, **settings)
    blob = codec.encode(x)
    y = codec.decode(blob)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    q = quality(x.float().numpy(), y.float().numpy())
    assert q["cos_mean"] > 0.999
    header = read_header(blob)
    assert header["codec"]["id"] in (backend, "raw") and header["basis"]["k"] == 16 and header["shape"] == [300, 64]


def test_pipeline_lossless_stage_equals_quantizer_only():
    """With a lossless codec the only error is the quantizer's: decode equals dequantize(quantize(x))."""
    x = make_tensor(torch.float32)
    codec = TensorCodec(None, backend="ffv1", frame_size=64)
    planes, quantizer = codec.to_planes(x)
    expected = quantizer.dequantize(planes)
    np.testing.assert_array_equal(codec.decode(codec.encode(x)).numpy(), expected)


def test_incompressible_data_falls_back_to_raw_and_says_so():
    noise = torch.from_numpy(RNG.uniform(-1, 1, (192, 64)).astype(np.float32))
    codec = TensorCodec(None, backend="zstd", frame_size=64)
    blob = codec.encode(noise)
    header = read_header(blob)
    assert header["codec"]["id"] == "raw" and "stored raw" in header["fallback"]
    np.testing.assert_allclose(codec.decode(blob).numpy(), noise.numpy(), atol=2 / 255 + 1e-6)


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), "NaN/Inf"),
    (torch.tensor([[1.0, float("inf")], [0.0, 1.0]]), "NaN/Inf"),
    (torch.zeros((4, 4), dtype=torch.int32), "dtype"),
    (torch.zeros((2, 3, 4)), "2-D"),
    (torch.zeros((0, 4)), "empty"),
])
def test_bad_tensors_are_refused_clearly(bad, match):
    with pytest.raises(InvalidTensorError, match=match):
        TensorCodec(None, backend="zstd", frame_size=64).encode(bad)


def test_basis_mismatch_on_encode_and_decode():
    x = make_tensor()
    codec = TensorCodec(fit_basis([x], k=16), backend="zstd", frame_size=64)
    with pytest.raises(BasisMismatchError, match="D=32"):
        codec.encode(make_tensor(dim=32))
    blob = codec.encode(x)
    other = TensorCodec(fit_basis([make_tensor(tokens=200)], k=16), backend="zstd", frame_size=64)
    with pytest.raises(BasisMismatchError, match="load the sender's basis"):
        other.decode(blob)


def test_truncated_and_corrupted_bitstreams_are_detected():
    x = make_tensor()
    codec = TensorCodec(None, backend="x265", frame_size=64, preset="ultrafast")
    blob = codec.encode(x)
    for cut in (0, 5, 20, len(blob) // 2, len(blob) - 1):
        with pytest.raises(BitstreamError):
            codec.decode(blob[:cut])
    for pos in (2, 12, len(blob) // 3, len(blob) - 10):
        flipped = bytearray(blob)
        flipped[pos] ^= 0x40
        with pytest.raises(BitstreamError):
            codec.decode(bytes(flipped))
    with pytest.raises(BitstreamError, match="unexpected bytes"):
        codec.decode(blob + b"\0")


def test_unknown_codec_id_in_bitstream():
    header, chunks = unpack(TensorCodec(None, backend="zstd", frame_size=64).encode(make_tensor()))
    header["codec"]["id"] = "h266"
    header.pop("chunks")
    with pytest.raises(BitstreamError, match="unknown codec id 'h266'"):
        TensorCodec(None, backend="zstd").decode(pack(header, chunks))


def test_pack_rejects_bad_tag():
    with pytest.raises(ValueError):
        pack({}, {"TOOLONG": b""})
    blob = pack({"a": 1}, {"QPAR": b"q", "DATA": b"xyz"})
    assert struct.unpack_from("<B", blob, 4)[0] == 2
    assert blob.index(b"xyz") % 16 == 0  # the last payload starts aligned, for in-place GPU encoders
    with pytest.raises(BitstreamError, match="'shape'"):  # a container, but not a tensor's header (shared.schema)
        unpack(blob)


def test_version_1_containers_still_read():
    """A version-1 container (no alignment padding, CRC32 on every chunk) decodes as before."""
    import json
    import zlib

    x = make_tensor()
    header, chunks = unpack(TensorCodec(None, backend="zstd", frame_size=64).encode(x))
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    prefix = b"TNSC" + struct.pack("<BI", 1, len(head)) + head
    blob = prefix + struct.pack("<I", zlib.crc32(prefix)) + b"".join(
        tag.encode() + struct.pack("<Q", len(p)) + p + struct.pack("<I", zlib.crc32(p)) for tag, p in chunks.items())
    y = TensorCodec(None, backend="zstd").decode(blob)
    assert quality(x.float().numpy(), y.float().numpy())["cos_mean"] > 0.99


@pytest.mark.slow
def test_compute_codec_container_checks_itself():
    """A rans DATA chunk carries no CRC32 (trailer 0): its own checksum catches every flipped byte,
    and a nonzero trailer is refused."""
    x = make_tensor(tokens=256)
    codec = TensorCodec(fit_basis([x], k=16), backend="rans", step=0.05)
    blob = codec.encode(x)
    header, chunks = unpack(blob)
    assert header["checks"] == {"DATA": "payload"} and blob[-4:] == b"\0\0\0\0"
    start = blob.index(chunks["DATA"])
    assert start % 16 == 0
    for pos in range(start, start + len(chunks["DATA"]), max(1, len(chunks["DATA"]) // 97)):
        bad = bytearray(blob)
        bad[pos] ^= 0x10
        with pytest.raises(BitstreamError):
            codec.decode(bytes(bad))
    with pytest.raises(BitstreamError, match="CRC32"):
        codec.decode(blob[:-1] + b"\1")


def test_lanes_by_component_only_where_they_make_whole_groups():
    """TensorCodec(lanes_by_component=True) codes a tensor's rANS lanes by component only where its token
    chunks make whole groups of 32 (the GPU decoder tiles those); others keep the default order. Every
    container decodes, and the joined one takes the order of its own length."""
    from shared.codecs import rans

    x = make_tensor(tokens=512)
    codec = TensorCodec(fit_basis([x], k=16), backend="rans", step=0.05, lane_tokens=8, lanes_by_component=True)
    plain = TensorCodec(codec.basis, backend="rans", step=0.05, lane_tokens=8)
    blobs = {}
    for tokens, by_component in ((256, True), (200, False), (512, True), (264, False)):
        blobs[tokens] = codec.encode(x[:tokens])
        data = unpack(blobs[tokens])[1]["DATA"]
        assert rans.read_header(data).layout.by_component is by_component, tokens
        assert codec.lane_order(tokens, 16) is by_component
        np.testing.assert_array_equal(codec.decode(blobs[tokens]).float().numpy(),
                                      plain.decode(plain.encode(x[:tokens])).float().numpy())
    joined = codec.join([blobs[256], blobs[256]])  # 512 tokens: whole groups
    assert rans.read_header(unpack(joined)[1]["DATA"]).layout.by_component
    assert not TensorCodec(codec.basis, backend="rans", step=0.05, lane_tokens=8).lane_order(512, 16)


# -- metrics -----------------------------------------------------------------------------------------
def test_metrics_definitions():
    x = low_rank()
    assert ratio((100, 64), 100 * 64) == 2.0
    q = quality(x, x)
    assert q["cos_mean"] == pytest.approx(1.0) and q["rel_mse"] == 0 and q["p1"] == pytest.approx(1.0)
    q_neg = quality(x, -x)
    assert q_neg["cos_mean"] == pytest.approx(-1.0)
    noisy = x + 0.5 * RNG.normal(size=x.shape).astype(np.float32)
    qn = quality(x, noisy)
    assert 0 < qn["cos_mean"] < 1 and qn["rel_mse"] > 0 and qn["p1"] <= qn["cos_mean"] + 0.1
    agg = aggregate([q, qn])
    assert agg["cos_min"] == pytest.approx(qn["cos_mean"])


def test_group_leave_one_out_excludes_the_whole_group():
    parts = [low_rank(seed=s) for s in range(4)]
    groups = ["a", "a", "b", "b"]
    bases = dict(leave_one_out(parts, k=8, groups=groups))
    ref = fit_basis(parts[2:], k=8)
    np.testing.assert_allclose(bases[0].mean, ref.mean, atol=1e-5)
    assert bases[0].content_hash == bases[1].content_hash != bases[2].content_hash
    with pytest.raises(InvalidTensorError, match="2 groups"):
        list(leave_one_out(parts, k=8, groups=["a"] * 4))


def test_sweep_reports_ratio_quality_and_operating_points():
    from shared.sweep import loo_sweep, operating_points

    rng = np.random.default_rng(1)
    mixing = rng.normal(size=(8, 64))  # one shared rank-8 subspace, different coefficients per capture
    parts = [torch.from_numpy((rng.normal(size=(256, 8)) @ mixing + 0.01 * rng.normal(size=(256, 64)))
                              .astype(np.float32)).to(torch.bfloat16) for _ in range(3)]
    rows = loo_sweep(parts, ks=[4, 8, 64], codecs=[("zstd", {})], frame=64)
    by_k = {(r["basis"], r["k"]): r for r in rows}
    assert set(by_k) == {("pca_loo", 4), ("pca_loo", 8), ("pca_loo", 64), ("raw", 64)}
    # the data has rank 8: K=4 loses signal, K=8 keeps it and compresses more than K=64
    assert by_k[("pca_loo", 4)]["cos_mean"] < by_k[("pca_loo", 8)]["cos_mean"] > 0.999
    assert by_k[("pca_loo", 8)]["ratio"] > by_k[("pca_loo", 64)]["ratio"]
    best = operating_points(rows, thresholds=(0.999,))
    assert best[0]["k"] == 8 and best[0]["threshold"] == 0.999


def test_decoder_override_reads_same_format_and_refuses_others():
    if get_backend("ffmpeg-x265").unavailable_reason():
        pytest.skip(get_backend("ffmpeg-x265").unavailable_reason())
    x = make_tensor()
    blob = TensorCodec(None, backend="x265", frame_size=64, preset="ultrafast", qp=30).encode(x)
    assert read_header(blob)["codec"]["id"] == "x265"
    same = TensorCodec(None, backend="x265", decoder="ffmpeg-x265", frame_size=64).decode(blob)
    np.testing.assert_array_equal(same.float().numpy(), TensorCodec(None, backend="x265").decode(blob).float().numpy())
    with pytest.raises(BitstreamError, match="cannot read"):
        TensorCodec(None, backend="x265", decoder="ffv1").decode(blob)


def test_narrow_planes_fill_frames_side_by_side():
    planes = RNG.integers(0, 256, (1024, 32), dtype=np.uint8)
    layout = framing.layout_for(*planes.shape, height=64)
    assert layout.side_by_side == 2 and layout.n_tiles == 8  # 1024 tokens / (64 rows x 2 blocks)
    f = framing.to_frames(planes, layout)
    np.testing.assert_array_equal(f[0, 0, :, 32:], planes[64:128])  # second token block beside the first


@pytest.mark.parametrize("shape", [(300, 192), (1000, 70), (5, 600)])
def test_frames_work_on_torch_and_uint16(shape):
    planes = RNG.integers(0, 1024, shape).astype(np.uint16)
    layout = framing.layout_for(*shape, height=64)
    f = framing.to_frames(planes, layout)
    np.testing.assert_array_equal(framing.from_frames(f, layout), planes)
    t = torch.from_numpy(planes.astype(np.int32))
    ft = framing.to_frames(t, layout)
    assert isinstance(ft, torch.Tensor)
    np.testing.assert_array_equal(ft.numpy(), f.astype(np.int32))
    np.testing.assert_array_equal(framing.from_frames(ft, layout).numpy(), planes.astype(np.int32))


@pytest.mark.slow
def test_compute_codec_path_meets_target_and_round_trips():
    x = make_tensor(tokens=512)
    basis = fit_basis([make_tensor(tokens=512)], k=64)
    codec = TensorCodec(basis, backend="rans", target_cos=0.999)
    blob = codec.encode(x)
    header = read_header(blob)
    assert header["codec"]["id"] == "rans" and header["quant"]["kind"] == "rd_shared_step"
    y = codec.decode(blob)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert quality(x.float().numpy(), y.float().numpy())["cos_mean"] >= 0.999 - 1e-3  # bf16 output rounding
    assert ratio(x.shape, len(blob)) > 1.5
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 1
    with pytest.raises(BitstreamError):
        codec.decode(bytes(flipped))
    with pytest.raises(ConfigurationError, match="exactly one"):
        TensorCodec(basis, backend="rans")
    with pytest.raises(ConfigurationError, match="qp"):
        TensorCodec(basis, backend="rans", step=0.1, qp=18)


@pytest.mark.gpu
@pytest.mark.parametrize("with_basis", [True, False])
def test_compute_codec_on_a_cuda_tensor(with_basis):
    """TensorCodec(backend="rans") on a CUDA tensor: the container comes back as a uint8 CUDA
    tensor; the CPU and the GPU decode it (from the GPU or from host bytes) to the same values,
    at the target quality."""
    x = make_tensor(tokens=4096).cuda()
    basis = fit_basis([make_tensor(tokens=2048)], k=64) if with_basis else None
    codec = TensorCodec(basis, backend="rans", target_cos=0.999)
    blob = codec.encode(x)
    assert isinstance(blob, torch.Tensor) and blob.is_cuda and blob.dtype == torch.uint8
    header = read_header(blob)
    assert header["codec"]["id"] == "rans" and header["shape"] == list(x.shape)
    on_gpu = codec.decode(blob, device="cuda")
    host_bytes = bytes(blob.cpu().numpy())
    from_host = codec.decode(host_bytes, device="cuda")
    on_cpu = codec.decode(host_bytes)
    assert on_gpu.is_cuda and on_gpu.dtype == x.dtype and on_gpu.shape == x.shape
    assert torch.equal(on_gpu, from_host)
    # the GPU reconstructs in bf16 on bf16 tensor cores, the CPU in float32: within about one bf16 ulp
    torch.testing.assert_close(on_gpu.cpu().float(), on_cpu.float(), rtol=2**-6, atol=0.05)
    assert quality(x.float().cpu().numpy(), on_gpu.float().cpu().numpy())["cos_mean"] >= 0.998
    assert TensorCodec(basis, backend="rans", step=header["quant"]["step"]).decode(blob, device="cuda").is_cuda
    bad = x.clone()
    bad[3, 5] = float("nan")
    with pytest.raises(InvalidTensorError, match="NaN"):
        codec.encode(bad)
    # the symbols cross from the projection to the coder as int16 (a NaN is refused, not a reason for
    # int32); values beyond int16 are coded again from int32 symbols, and the codec keeps int32
    # from then on: the same bytes as its next call, coded from int32 at once
    assert not codec._wide_symbols
    loud = x * 10000
    got = codec.encode(loud)
    assert codec._wide_symbols and torch.equal(got, codec.encode(loud))
    assert quality(loud.float().cpu().numpy(), codec.decode(got, device="cuda").float().cpu().numpy())["cos_mean"] >= 0.998


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1024, 65536, 700000])
def test_int16_and_int32_symbols_write_the_same_bytes(tokens):
    """The projection hands the coder int16 symbols (a codec that met values beyond int16 keeps
    int32): eager, graph-captured and replayed calls write the bytes of int32 symbols."""
    x = torch.from_numpy(low_rank(tokens, 64, seed=11)).to(torch.bfloat16).cuda()
    basis = fit_basis([x[:1024].cpu()], k=48)
    narrow = TensorCodec(basis, backend="rans", step=0.05)
    wide = TensorCodec(basis, backend="rans", step=0.05)
    wide._wide_symbols = True
    want = wide.encode(x)
    assert all(torch.equal(narrow.encode(x), want) for _ in range(4)) and not narrow._wide_symbols


def test_decoded_tensors_are_views_of_one_stacked_tensor_made_when_indexed():
    import torch

    from shared import pipeline

    stacked = torch.arange(24, dtype=torch.float32).view(4, 3, 2)
    out = pipeline.Tensors(stacked)
    assert len(out) == 4 and out._views == [None] * 4
    assert torch.equal(out[1], stacked[1]) and out[1] is out[1] and out[1].data_ptr() == stacked[1].data_ptr()
    assert torch.equal(out[-1], stacked[3]) and out._views[3] is not None and out._views[2] is None
    assert isinstance(out[1:3], list) and [t.tolist() for t in out[1:3]] == stacked[1:3].tolist()
    assert isinstance(out + [stacked[0]], list) and len([stacked[0]] + out) == 5
    assert [t.tolist() for t in out] == stacked.tolist() and "4 x [3, 2]" in repr(out)
    with pytest.raises(IndexError):
        out[4]


def test_a_codec_given_a_new_basis_codes_with_it():
    """Setting what a codec's graphs are made from (basis, step, lane length) gives it a new graph
    token; a new basis also drops what was made from the old one, so the next blob names and uses it."""
    from shared.rdquant import RDQuantizer

    x = torch.from_numpy(low_rank(512, 32, seed=1)).to(torch.bfloat16)
    old, new = (fit_basis([torch.from_numpy(low_rank(256, 32, seed=s)).to(torch.bfloat16)], k=k) for s, k in ((2, 24), (3, 16)))
    codec = TensorCodec(old, backend="rans", step=0.05)
    first = codec.encode(x)
    token = codec._graph_token
    codec.quantizer = RDQuantizer(0.05)
    assert codec._graph_token is not token
    token = codec._graph_token
    codec.min_cos = 0.5  # not part of a graph: the token stays
    assert codec._graph_token is token
    codec.basis = new
    assert codec._graph_token is not token
    second = codec.encode(x)
    assert read_header(first)["basis"] == {"hash": old.content_hash, "k": 24}
    assert read_header(second)["basis"] == {"hash": new.content_hash, "k": 16}
    assert bytes(second) == bytes(TensorCodec(new, backend="rans", step=0.05).encode(x))
    with pytest.raises(BasisMismatchError):
        codec.decode(first)


def test_encode_many_async_refuses_what_it_cannot_queue():
    """encode_many_async always returns one PendingEncode: an empty list is refused, and host tensors with
    the call that codes them instead."""
    from shared.pipeline import encode_many, encode_many_async

    assert list(encode_many([], [])) == []
    with pytest.raises(ConfigurationError, match="at least one tensor"):
        encode_many_async([], [])
    basis = fit_basis([np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)], 16)
    with pytest.raises(ConfigurationError, match="encode_many_async needs every tensor on a GPU"):
        encode_many_async([TensorCodec(basis, backend="rans", step=0.1)], [torch.zeros(8, 16)])


def test_encode_many_on_host_tensors_equals_single_calls():
    """encode_many / decode_many on CPU tensors (no GPU, or a CPU-only build of torch): the bytes
    single calls write, the tensors single decodes return; nothing asks CUDA a question it cannot
    answer without a GPU."""
    from shared.pipeline import decode_many, encode_many
    from shared.rdquant import calibrate_step

    codecs, xs = [], []
    for layer in range(3):
        rows = torch.from_numpy(low_rank(512, 32, seed=layer)).to(torch.bfloat16)
        basis = calibrate_step(fit_basis([rows[:256]], k=24), [rows[:256]], 0.999)
        codecs.append(TensorCodec(basis, backend="rans"))
        xs.append(rows[256:])
    for _ in range(2):  # a repeat is where a GPU call would look for its graph
        blobs = encode_many(codecs, xs)
        assert [bytes(b) for b in blobs] == [bytes(c.encode(x)) for c, x in zip(codecs, xs)]
        ys = decode_many(codecs, blobs)
        for c, b, y, x in zip(codecs, blobs, ys, xs):
            assert torch.equal(y, c.decode(b))
            assert quality(x.float().numpy(), y.float().numpy())["cos_mean"] >= 0.99


@pytest.mark.gpu
def test_encode_many_equals_single_calls_and_names_the_corrupt_blob():
    """encode_many over 12 layers' tensors (each its own basis and calibrated step) writes the
    bytes 12 single calls write; decode_many returns what single decodes return; a corrupt blob
    in the list is named by its index."""
    from shared.pipeline import decode_many, encode_many
    from shared.rdquant import calibrate_step

    codecs, xs = [], []
    for layer in range(12):
        rows = torch.from_numpy(low_rank(2048, 64, seed=layer)).to(torch.bfloat16)
        calib, held_out = rows[:1024], rows[1024:]
        basis = calibrate_step(fit_basis([calib], k=48), [calib], 0.999)
        codecs.append(TensorCodec(basis, backend="rans"))
        xs.append(held_out.cuda())
    blobs = encode_many(codecs, xs)
    singles = [c.encode(x) for c, x in zip(codecs, xs)]
    assert all(torch.equal(b, s) for b, s in zip(blobs, singles))
    ys = decode_many(codecs, blobs, device="cuda")
    for c, b, y, x in zip(codecs, blobs, ys, xs):
        assert torch.equal(y, c.decode(b, device="cuda"))
        assert quality(x.float().cpu().numpy(), y.float().cpu().numpy())["cos_mean"] >= 0.99
    hosts = [bytes(b.cpu().numpy()) for b in blobs]
    assert all(torch.equal(a, b) for a, b in zip(decode_many(codecs, hosts, device="cuda"), ys))
    bad = blobs[7].clone()
    bad[len(bad) // 2] ^= 0x40
    with pytest.raises(BitstreamError, match="blob 7"):
        decode_many(codecs, blobs[:7] + [bad] + blobs[8:], device="cuda")
    # same [T, D] but another basis K, and another dtype: coded in launches of their own, same bytes as alone
    rows = torch.from_numpy(low_rank(2048, 64, seed=99)).to(torch.bfloat16)
    other = TensorCodec(calibrate_step(fit_basis([rows[:1024]], k=24), [rows[:1024]], 0.999), backend="rans")
    mixed_codecs = codecs[:2] + [other, codecs[2]]
    mixed = xs[:2] + [rows[1024:].cuda(), xs[2].float()]
    mixed_blobs = encode_many(mixed_codecs, mixed)
    assert all(torch.equal(b, c.encode(x)) for b, c, x in zip(mixed_blobs, mixed_codecs, mixed))
    back = decode_many(mixed_codecs, mixed_blobs, device="cuda")
    assert back[3].dtype == torch.float32 and back[2].shape == mixed[2].shape


@pytest.mark.gpu
def test_encode_many_replays_a_graph_on_a_stream_and_without_a_sync():
    """The third call of one list of codecs and shapes replays a CUDA graph: the same bytes as the
    eager calls, new inputs give new blobs, and earlier blobs stay as they were. On a side stream
    the same bytes; with encode_many_async the containers sit at their spans in the pending buffer."""
    from shared import cuda_graphs
    from shared.pipeline import decode_many, encode_many, encode_many_async
    from shared.rdquant import calibrate_step

    rows = torch.from_numpy(low_rank(4096, 64, seed=3)).to(torch.bfloat16)
    basis = calibrate_step(fit_basis([rows[:1024]], k=48), [rows[:1024]], 0.999)
    codecs = [TensorCodec(basis, backend="rans") for _ in range(6)]
    first = [rows[1024 + 256 * i:1024 + 256 * (i + 1)].cuda() for i in range(6)]
    second = [x.flip(0).contiguous() for x in first]
    eager = [encode_many(codecs, xs) for xs in (first, second)]  # the second call captures the graph
    assert any(isinstance(v, cuda_graphs.EncodeGraph) for v in cuda_graphs.ENCODE_GRAPHS.values())
    replayed = [encode_many(codecs, xs) for xs in (first, second)]
    for a, b in zip(eager, replayed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, c.encode(t)) for x, c, t in zip(replayed[0], codecs, first))  # not overwritten
    ys = decode_many(codecs, replayed[1], device="cuda")
    assert all(quality(x.float().cpu().numpy(), y.float().cpu().numpy())["cos_mean"] >= 0.99
               for x, y in zip(second, ys))
    side = torch.cuda.Stream()
    on_side = encode_many(codecs, first, stream=side)
    side.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(on_side, eager[0]))
    pending = encode_many_async(codecs, first)
    spans = pending.spans.tolist()
    assert all(torch.equal(pending.buffer[a:a + n], y) for (a, n), y in zip(spans, eager[0]))
    assert not pending.flags.any()
    # encode_many_async again: its own graph (int32 symbols, as the eager path), calls queued back to back
    # without a synchronization, each pending keeping its own copy of the containers
    queued = [encode_many_async(codecs, xs) for xs in (first, second, first, second, second)]
    assert sum(isinstance(v, cuda_graphs.EncodeGraph) and k[0] == cuda_graphs.QUEUED
               for k, v in cuda_graphs.ENCODE_GRAPHS.items()) == 1
    assert len({p.buffer.data_ptr() for p in queued}) == len(queued)
    for p, want in zip(queued, [eager[0], eager[1], eager[0], eager[1], eager[1]]):
        assert all(torch.equal(p.buffer[a:a + n], y) for (a, n), y in zip(p.spans.tolist(), want))
        assert all(torch.equal(x, y) for x, y in zip(p.result(), want))
    # a queued call's result() waits for that call's work alone: not for a second of GPU work queued after it
    pending = encode_many_async(codecs, second)
    torch.cuda._sleep(2_000_000_000)  # GPU clock cycles, about a second
    t0 = time.perf_counter()
    got = pending.result()
    waited = time.perf_counter() - t0
    assert waited < 0.5, f"result() waited {waited:.2f} s for work queued after its call"
    assert all(torch.equal(x, y) for x, y in zip(got, eager[1]))
    with pytest.raises(ConfigurationError, match="encode_many_async needs every tensor on a GPU"):
        encode_many_async([TensorCodec(basis, backend="rans")], [first[0].cpu()])
    # the graph reads inputs in place: ones it cannot (a transposed view, an address off 16 bytes)
    # are copied into buffers it keeps for them, to the same bytes
    strided = [x.t().contiguous().t() for x in first]
    flat = torch.cat([first[0].reshape(-1)[:1]] + [x.reshape(-1) for x in first])  # each at 2 bytes past 16
    shifted = [flat[1 + i * x.numel():1 + (i + 1) * x.numel()].view(x.shape) for i, x in enumerate(first)]
    for xs in (strided, shifted):
        assert not cuda_graphs.EncodeGraph.readable(xs)
        assert all(torch.equal(x, y) for x, y in zip(encode_many(codecs, xs), eager[0]))
    # float16 inputs are rounded to bf16 as the graph reads them: the bytes of their eager calls
    halves = [x.half() for x in first]
    eager_half = [encode_many(codecs, halves) for _ in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(encode_many(codecs, halves), eager_half[0]))
    assert sum(isinstance(v, cuda_graphs.EncodeGraph) for v in cuda_graphs.ENCODE_GRAPHS.values()) >= 2
    # one tensor of the list beyond int16 (the graph's symbols): coded again eagerly with int32
    # symbols for its codec alone, the graph dropped; the graph made next keeps int32 for that codec
    loud = first[:2] + [first[2] * 10000] + first[3:]
    wide = [TensorCodec(basis, backend="rans") for _ in range(6)]
    wide[2]._wide_symbols = True
    want = encode_many(wide, loud)
    graph = cuda_graphs.ENCODE_GRAPHS.get(cuda_graphs.graph_key(codecs, first))
    assert isinstance(graph, cuda_graphs.EncodeGraph)
    for _ in range(4):
        assert all(torch.equal(x, y) for x, y in zip(encode_many(codecs, loud), want))
    assert [c._wide_symbols for c in codecs] == [False, False, True, False, False, False]
    assert cuda_graphs.ENCODE_GRAPHS.get(cuda_graphs.graph_key(codecs, first)) is not graph


@pytest.mark.gpu
def test_decode_many_replays_a_graph_that_checks_each_container_on_the_gpu(monkeypatch):
    """The third decode_many of one list of codecs replays a CUDA graph: the same tensors as the
    eager path for new containers of the same codecs, earlier outputs untouched. A container with
    another step (a front the graph did not check) is decoded by the host path; a corrupt one
    still raises and names its index; a longer list or a host blob takes the host path."""
    from shared import cuda_graphs, pipeline
    from shared.pipeline import decode_many, encode_many
    from shared.rdquant import calibrate_step

    rows = torch.from_numpy(low_rank(4096, 64, seed=5)).to(torch.bfloat16)
    basis = calibrate_step(fit_basis([rows[:1024]], k=48), [rows[:1024]], 0.999)
    codecs = [TensorCodec(basis, backend="rans") for _ in range(6)]
    calls = [[rows[1024 + 256 * i + 7 * c:1024 + 256 * (i + 1) + 7 * c].cuda() for i in range(6)] for c in range(4)]
    blobs = [encode_many(codecs, xs) for xs in calls]
    monkeypatch.setattr(cuda_graphs, "GRAPH_MAX_BYTES", 0)  # no graphs: the host path's tensors
    eager = [[c.decode(b, device="cuda") for c, b in zip(codecs, bs)] for bs in blobs]
    monkeypatch.undo()
    cuda_graphs.DECODE_GRAPHS.clear()
    got = [decode_many(codecs, bs, device="cuda") for bs in blobs]  # the second call makes the graph
    assert any(isinstance(v, cuda_graphs.DecodeGraph) for v in cuda_graphs.DECODE_GRAPHS.values())
    for a, b in zip(eager, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    again = decode_many(codecs, blobs[0], device="cuda")
    assert all(torch.equal(x, y) for x, y in zip(again, eager[0])) and torch.equal(got[3][0], eager[3][0])
    assert isinstance(again, pipeline.Tensors) and again.stacked.shape == (6, 256, 64)
    # the replay reads an encoder's Containers from its one buffer, or the same containers as a list of views
    from shared.codecs.rans_cuda import Containers

    assert isinstance(blobs[1], Containers)
    as_list = decode_many(codecs, list(blobs[1]), device="cuda")
    assert all(torch.equal(x, y) for x, y in zip(as_list, eager[1]))
    other = TensorCodec(basis, backend="rans", step=codecs[2].quantizer.step * 1.5)
    swapped = list(blobs[1])
    swapped[2] = other.encode(calls[1][2])
    mixed = decode_many(codecs, swapped, device="cuda")
    assert torch.equal(mixed[2], other.decode(swapped[2], device="cuda"))
    assert all(torch.equal(mixed[i], eager[1][i]) for i in (0, 1, 3, 4, 5))
    for _ in range(2):  # the graph is made again from the new list
        decode_many(codecs, blobs[2], device="cuda")
    assert any(isinstance(v, cuda_graphs.DecodeGraph) for v in cuda_graphs.DECODE_GRAPHS.values())
    # containers holding values beyond int16 (the graph's symbols): the int16 graph refuses them (the
    # host path decodes them), then the graph made from them decodes into int32
    loud = encode_many(codecs, [x * 10000 for x in calls[0]])
    want = [c.decode(b, device="cuda") for c, b in zip(codecs, loud)]
    for _ in range(3):
        assert all(torch.equal(x, y) for x, y in zip(decode_many(codecs, loud, device="cuda"), want))
    graphs = [v for v in cuda_graphs.DECODE_GRAPHS.values() if isinstance(v, cuda_graphs.DecodeGraph)]
    assert len(graphs) == 1 and not graphs[0].dec.narrow
    bad = blobs[3][4].clone()
    bad[len(bad) // 2] ^= 0x20
    with pytest.raises(BitstreamError, match="blob 4 of the list"):
        decode_many(codecs, blobs[3][:4] + [bad] + blobs[3][5:], device="cuda")
    host = decode_many(codecs, [bytes(b.cpu().numpy()) for b in blobs[3]], device="cuda")
    assert all(torch.equal(x, y) for x, y in zip(host, eager[3]))


def test_calibrated_step_lives_in_the_basis(tmp_path):
    """calibrate_step stores the step for a target in the basis file; a codec made from the loaded
    basis uses it without a search, and held-out tensors of the same source meet the target closely."""
    from shared.rdquant import calibrate_step

    rows = torch.from_numpy(low_rank(2048, 64)).to(torch.bfloat16)
    calib, held_out = list(rows[:1536].split(512)), rows[1536:]
    basis = calibrate_step(fit_basis(calib, k=48), calib, 0.999)
    basis.save(tmp_path / "b.safetensors")
    loaded = PCABasis.load(tmp_path / "b.safetensors")
    assert loaded.meta["rans_step"] == basis.meta["rans_step"] and loaded.content_hash == basis.content_hash
    codec = TensorCodec(loaded, backend="rans")
    blob = codec.encode(held_out)
    assert read_header(blob)["quant"]["step"] == basis.meta["rans_step"]
    assert codec.measure(held_out)["cos_mean"] >= 0.998


def test_results_writer_never_replaces_gpu_rows_with_a_cpu_run(tmp_path, monkeypatch):
    import pandas as pd

    from shared import results

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(results, "ROOT", tmp_path)
    gpu = results.ResultsWriter("99", "probe")
    gpu.path = tmp_path / "99_probe.csv"
    gpu.add(backend="x", metric="m", value=1.0, unit="1", device="NVIDIA H200")
    gpu.save()
    cpu = results.ResultsWriter("99", "probe")
    cpu.path = tmp_path / "99_probe.csv"
    cpu.add(backend="x", metric="m", value=2.0, unit="1")
    written = cpu.save()
    assert written == tmp_path / "local" / "99_probe.csv"
    assert pd.read_csv(tmp_path / "99_probe.csv").device.tolist() == ["NVIDIA H200"]


def test_join_keeps_every_symbol_and_refuses_what_does_not_join():
    """TensorCodec.join: containers of one codec joined along tokens decode to the rows each decoded to
    (the symbols are coded again, not the values quantized again), in one container no larger than the
    parts; the frame path, another step, another basis and an empty list are refused by name, a
    damaged part as corrupt."""
    x = torch.from_numpy(low_rank(tokens=900, dim=48, rank=12)).to(torch.bfloat16)
    basis = fit_basis([x.float().numpy()], k=48)
    codec = TensorCodec(basis, backend="rans", step=0.02)
    parts = [codec.encode(x[a:b]) for a, b in ((0, 500), (500, 520), (520, 900))]
    joined = codec.join(parts)
    assert read_header(joined)["shape"] == [900, 48]
    assert torch.equal(codec.decode(joined), torch.cat([codec.decode(p) for p in parts]))
    assert len(joined) < sum(len(p) for p in parts)
    with pytest.raises(ConfigurationError, match="compute-codec"):
        TensorCodec(basis, backend="zstd").join(parts)
    with pytest.raises(ConfigurationError, match="at least one"):
        codec.join([])
    with pytest.raises(BitstreamError, match="container 1 differs"):
        codec.join([parts[0], TensorCodec(basis, backend="rans", step=0.03).encode(x[:50])])
    with pytest.raises(BasisMismatchError):
        codec.join([TensorCodec(fit_basis([x[:300].float().numpy()], k=48), backend="rans", step=0.02).encode(x[:50])])
    damaged = bytearray(parts[2])
    damaged[len(damaged) // 2] ^= 0x10
    with pytest.raises(BitstreamError):
        codec.join([parts[0], bytes(damaged)])


def test_a_cuda_graph_knob_set_on_pipeline_is_refused_naming_cuda_graphs(monkeypatch):
    """The graph knobs live in shared.cuda_graphs; setting one on shared.pipeline (where they once were)
    would change nothing, so it raises naming the module to set instead; other attributes set as usual."""
    from shared import cuda_graphs, pipeline

    with pytest.raises(ConfigurationError, match="shared.cuda_graphs.GRAPH_MAX_BYTES = 0"):
        pipeline.GRAPH_MAX_BYTES = 0
    assert not hasattr(pipeline, "GRAPH_MAX_BYTES") and cuda_graphs.GRAPH_MAX_BYTES > 0
    monkeypatch.setattr(pipeline, "SAMPLE_TOKENS", 7)  # restored however the test ends
    assert pipeline.SAMPLE_TOKENS == 7

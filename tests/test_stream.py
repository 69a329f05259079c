"""shared.stream: the pipelined host round trip (chunk plan and errors on any machine; round trips,
raw bit-exact and compressed at the codec's quality, on a GPU), and the wide projection kernel."""
import numpy as np
import pytest
import torch

from shared import BackendUnavailable, ConfigurationError, InvalidTensorError
from shared.basis import fit_basis
from shared.pipeline import TensorCodec
from shared.stream import HostStream, plan_chunks


def _heavy_tailed(tokens, dim, seed):
    rng = np.random.default_rng(seed)
    scales = (np.arange(dim) + 1.0) ** -0.5
    rot = np.linalg.qr(rng.standard_normal((dim, dim)))[0]
    return ((rng.standard_t(3, size=(tokens, dim)) * scales) @ rot.T + 0.5).astype(np.float32)


def test_plan_cuts_large_tensors_into_row_blocks_and_groups_small_ones_by_lane():
    xs = [torch.zeros(1000, 64, dtype=torch.bfloat16) for _ in range(5)] + [torch.zeros(10_000, 64, dtype=torch.bfloat16)]
    chunks = plan_chunks(xs, [True] * 3 + [False] * 3, chunk_bytes=300_000)
    assert [c.coded for c in chunks] == [True, False] + [False] * 5
    assert [(p.index, p.start, p.stop) for p in chunks[0].pieces] == [(0, 0, 1000), (1, 0, 1000), (2, 0, 1000)]
    assert [(p.index, p.start, p.stop) for p in chunks[1].pieces] == [(3, 0, 1000), (4, 0, 1000)]
    blocks = [p for c in chunks[2:] for p in c.pieces]
    assert all(p.index == 5 for p in blocks)  # tensor 5 (1.28 MB) in five row blocks covering every row once
    assert [(p.start, p.stop) for p in blocks] == [(a, a + 2000) for a in range(0, 10_000, 2000)]
    assert sum(c.nbytes for c in chunks) == sum(x.numel() * 2 for x in xs)


def test_settings_are_checked_when_the_stream_is_made():
    basis = fit_basis([_heavy_tailed(256, 16, 0)], k=16)
    with pytest.raises(ConfigurationError, match="compute codecs"):
        HostStream([TensorCodec(basis, backend="zstd")])
    with pytest.raises(ConfigurationError, match="chunk_mb"):
        HostStream(None, chunk_mb=0)
    with pytest.raises(ConfigurationError, match="slots"):
        HostStream(None, slots=1)
    with pytest.raises(ConfigurationError, match="take_turns"):
        HostStream(None, take_turns="yes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")
def test_round_trip_without_cuda_names_the_cause():
    with pytest.raises(BackendUnavailable, match="HostStream.round_trip"):
        HostStream(None).round_trip([torch.zeros(4, 4)])


@pytest.mark.gpu
def test_raw_round_trip_is_bit_exact_in_every_shape_and_dtype():
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(3000, 96, device="cuda", generator=g).bfloat16(),
          torch.randn(7, 5, 3, device="cuda", generator=g),                        # any shape on the raw lane
          torch.randint(-2**31, 2**31 - 1, (40_000,), device="cuda", generator=g, dtype=torch.int32),
          torch.randn(20_000, 64, device="cuda", generator=g).half()]               # cut into row blocks
    s = HostStream(None, chunk_mb=0.5)
    for _ in range(3):  # the pinned slots and streams are kept between calls
        ys = s.round_trip(xs)
        assert all(y.dtype == x.dtype and y.shape == x.shape and torch.equal(x, y) for x, y in zip(xs, ys))
    assert s.last["wire_bytes"] == s.last["original_bytes"] and s.last["chunks"] >= 5
    with pytest.raises(InvalidTensorError, match="CUDA tensors"):
        s.round_trip([xs[0].cpu()])


@pytest.mark.gpu
def test_compressed_round_trip_meets_the_codec_quality_with_raw_tensors_beside_it():
    from shared.rdquant import calibrate_step

    D = 256
    calib = _heavy_tailed(4096, D, 1)
    basis = calibrate_step(fit_basis([calib], k=D), [calib], 0.999)
    codec = TensorCodec(basis, backend="rans")
    xs = [torch.from_numpy(_heavy_tailed(t, D, 2 + i)).cuda().bfloat16() for i, t in enumerate((4096, 1000, 9000))]
    xs.insert(1, torch.arange(1000, device="cuda", dtype=torch.float32))  # raw, between coded ones
    s = HostStream([codec, None, codec, codec], chunk_mb=1.0)  # the 9000-row tensor crosses in row blocks
    for _ in range(3):  # eager, then graph-replayed encodes and decodes
        ys = s.round_trip(xs)
        assert torch.equal(ys[1], xs[1])
        for i in (0, 2, 3):
            assert ys[i].shape == xs[i].shape and ys[i].dtype == torch.bfloat16
            x, y = xs[i].float(), ys[i].float()
            cos = ((x * y).sum(1) / (x.norm(dim=1) * y.norm(dim=1))).mean().item()
            assert cos >= 0.998, (i, cos)
    assert s.last["ratio"] > 2 and s.last["chunks"] >= 4
    s.round_trip(xs, timeline=True)
    stages = {row[0] for row in s.last["timeline"]}
    assert stages == {"encode", "d2h", "h2d", "decode"}
    assert all(start <= end for _, _, start, end in s.last["timeline"])


@pytest.mark.gpu
def test_taking_turns_gives_the_same_tensors_and_never_runs_two_codec_stages_at_once():
    from shared.rdquant import calibrate_step

    D = 256
    calib = _heavy_tailed(4096, D, 3)
    codec = TensorCodec(calibrate_step(fit_basis([calib], k=D), [calib], 0.999), backend="rans")
    xs = [torch.from_numpy(_heavy_tailed(4096, D, 10 + i)).cuda().bfloat16() for i in range(6)]
    apart, turns = HostStream([codec] * 6, chunk_mb=1.0, take_turns=False), HostStream([codec] * 6, chunk_mb=1.0)
    assert turns.take_turns and not apart.take_turns
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(apart.round_trip(xs), turns.round_trip(xs)))
    turns.round_trip(xs, timeline=True)
    spans = {(stage, k): (t0, t1) for stage, k, t0, t1 in turns.last["timeline"]}
    chunks = 1 + max(k for _, k in spans)
    assert chunks >= 4
    for k in range(chunks - 1):  # decode k starts after encode k+1 has ended, and encode k+2 after decode k
        assert spans["decode", k][0] >= spans["encode", k + 1][1]
        if k + 2 < chunks:
            assert spans["encode", k + 2][0] >= spans["decode", k][1]


@pytest.mark.gpu
@pytest.mark.parametrize("D,K", [(1024, 1024), (2048, 512)])
def test_wide_projection_matches_the_float64_reference(D, K):
    """D > 192 takes project_quantize_wide_kernel: symbols equal the float64 reference but at rounding
    ties, statistics exact, int16 symbols the same values."""
    from shared.rdquant import CudaProjection

    rng = np.random.default_rng(D)
    x = torch.from_numpy(rng.standard_normal((3000, D)).astype(np.float32)).cuda().bfloat16()
    comps = np.linalg.qr(rng.standard_normal((D, D)))[0][:, :K].astype(np.float32)
    proj = CudaProjection(np.zeros(D, np.float32) + 0.25, comps)
    step = 0.01
    sym, (mn, mx, sm) = proj.quantize(x, step)
    ref = torch.floor((x.double() @ proj.components.double() - proj.bias.double()) / step + 0.5)
    assert (sym.double() - ref).abs().max() <= 1 and (sym.double() == ref).double().mean() > 0.999
    assert torch.equal(mn, sym.min(0).values) and torch.equal(mx, sym.max(0).values)
    assert torch.equal(sm, sym.long().sum(0))
    narrow, stats, _ = proj.quantize_many(x.unsqueeze(0), [step], narrow=True)
    assert narrow.dtype == torch.int16 and torch.equal(narrow[0].int(), sym) and torch.equal(stats[2][0], sm)


@pytest.mark.gpu
def test_offload_then_fetch_gives_the_tensors_back():
    from shared.rdquant import calibrate_step
    from shared.stream import HostCopy

    D = 256
    calib = _heavy_tailed(4096, D, 1)
    codec = TensorCodec(calibrate_step(fit_basis([calib], k=D), [calib], 0.999), backend="rans")
    xs = [torch.from_numpy(_heavy_tailed(t, D, 5 + i)).cuda().bfloat16() for i, t in enumerate((3000, 9000))]
    xs.append(torch.randn(5000, 33, device="cuda").half())  # raw, cut into row blocks
    s = HostStream([codec, codec, None], chunk_mb=1.0)
    for _ in range(3):
        copy = s.offload(xs)
        assert isinstance(copy, HostCopy) and all(b.is_pinned() for b in copy.buffers)
        assert copy.nbytes < sum(x.numel() * x.element_size() for x in xs)
        ys = s.fetch(copy)
        assert torch.equal(ys[2], xs[2])
        for x, y in zip(xs[:2], ys[:2]):
            a, b = x.float(), y.float()
            assert y.shape == x.shape and ((a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))).mean() >= 0.998
    with pytest.raises(InvalidTensorError, match="HostCopy"):
        s.fetch(xs)


def test_row_blocks_gathered_to_host_bytes_and_scattered_back_are_the_tensors():
    """The byte plumbing every HostStream call uses (on the CPU here): each chunk's row ranges copied one after
    the other into a host buffer and back into empty tensors of the same shapes give the inputs bit for bit."""
    from shared.stream import _gather, _row_ranges, _scatter

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3000, 96, generator=g).bfloat16(), torch.randint(0, 9, (7, 5, 3), generator=g),
          torch.randn(20_000, 64, generator=g).half()]
    outs = {i: torch.empty_like(x) for i, x in enumerate(xs)}
    for ch in plan_chunks(xs, [False] * 3, chunk_bytes=500_000):
        sources = _row_ranges(xs, ch.pieces)
        host = torch.empty(sum(z - a for _, a, z in sources), dtype=torch.uint8)
        assert host.numel() == ch.nbytes
        _gather(host, sources)
        _scatter(host, _row_ranges(outs, ch.pieces))
    assert all(torch.equal(x, outs[i]) for i, x in enumerate(xs))


def test_payload_check_in_blocks_equals_the_whole_sum(monkeypatch):
    """payload_check sums its words in blocks; any block size gives the same check, and a changed word changes it."""
    from shared import stream

    x = torch.randint(-2**31, 2**31 - 1, (10_001,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    whole = stream.payload_check(x)
    monkeypatch.setattr(stream, "CHECK_BLOCK_WORDS", 1000)
    assert stream.payload_check(x) == whole
    y = x.clone()
    y[7777] ^= 1
    assert stream.payload_check(y) != whole

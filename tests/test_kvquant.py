"""The KV-cache peers (KIVI-style, int8 per token, fp8 per tensor, transformers' quantized caches)
and the attention-aware KV codec: round-trip error bounds, byte accounting, RoPE inversion."""
import importlib.util

import numpy as np
import pytest
import torch

from shared import kvquant as kq
from shared.errors import BitstreamError, InvalidTensorError
from shared.kvcodec import (KVCodec, Rope, allocate_by_sensitivity, calibrate_scale, fit_kv_codec, query_metric,
                            value_metric)

T, C, HEADS = 256, 192, 3


@pytest.fixture(scope="module")
def kv():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(T, C, generator=g) * torch.linspace(0.2, 4, C) + 1.5
    v = torch.randn(T, C, generator=g) * torch.linspace(1, 0.3, C)
    return k, v


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("groups", [(32, 32), (128, 64), (100, 50)])
def test_kivi_error_bound_and_bits(kv, bits, groups):
    k, v = kv
    k_hat, v_hat, nbytes = kq.kivi(bits, *groups)(k, v)
    levels = 2 ** bits - 1
    # K: per channel, groups of tokens; V: per token, groups of channels
    for x, x_hat, rows_along in ((k.t(), k_hat.t(), groups[0]), (v, v_hat, groups[1])):
        for s in range(0, x.shape[1], rows_along):
            g, gh = x[:, s:s + rows_along], x_hat[:, s:s + rows_along]
            span = (g.amax(1) - g.amin(1))[:, None]
            tol = span / levels / 2 * (1 + 2e-3) + 2e-3 * g.abs().amax(1, keepdim=True)
            assert bool(((g - gh).abs() <= tol).all())
    k_groups = C * -(-T // groups[0])
    v_groups = T * -(-C // groups[1])
    assert nbytes == 2 * (T * C * bits // 8) + 4 * (k_groups + v_groups)
    if groups == (128, 64):
        assert kq.bits_per_value(nbytes, 2 * T * C) == pytest.approx(bits + 0.5 * (32 / 128 + 32 / 64))


def test_int8_and_fp8_bounds_and_bits(kv):
    k, v = kv
    k_hat, v_hat, nbytes = kq.int8_per_token()(k, v)
    assert bool(((k - k_hat).abs() <= k.abs().amax(1, keepdim=True) / 127 * 0.502).all())
    assert nbytes == 2 * (T * C + 2 * T)
    k_hat, v_hat, nbytes = kq.fp8_per_tensor()(k, v)
    assert nbytes == 2 * (T * C + 4)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal values
    big = k.abs() > k.abs().amax() / 448 * 2 ** -6 * 8
    assert bool(((k - k_hat).abs()[big] <= k.abs()[big] * 2 ** -4 * 1.001).all())


def test_peers_refuse_bad_input(kv):
    with pytest.raises(InvalidTensorError, match="NaN"):
        kq.kivi(4, 32, 32)(torch.full((4, 8), float("nan")), torch.zeros(4, 8))
    with pytest.raises(InvalidTensorError, match="2-D"):
        kq.int8_per_token()(torch.zeros(4), torch.zeros(4, 8))
    with pytest.raises(InvalidTensorError, match="bits"):
        kq.kivi(9, 32, 32)(*kv)


@pytest.mark.parametrize("backend,package", [pytest.param("quanto", "optimum.quanto", marks=pytest.mark.slow),
                                             ("hqq", "hqq")])
def test_transformers_backends_count_their_stored_bytes(kv, backend, package):
    if importlib.util.find_spec(package.split(".")[0]) is None:
        pytest.skip(f"{package} is not installed")
    k, v = kv
    k_hat, v_hat, nbytes = kq.hf_quantized_cache(backend)(k, v, heads=HEADS)
    # defaults: 4-bit codes, groups of 64 along head_dim with a bf16 scale and zero each: 4.5 bits
    assert kq.bits_per_value(nbytes, 2 * T * C) == pytest.approx(4.5)
    for x, x_hat in ((k, k_hat), (v, v_hat)):
        assert float(((x - x_hat) ** 2).mean() / x.var()) < 0.02  # 4 bits: about (range / 15)^2 / 12


def test_rope_matches_transformers_and_inverts_exactly():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                      rope_theta=100000.0, max_position_embeddings=4096)
    emb = LlamaRotaryEmbedding(cfg)
    rope = Rope(emb.inv_freq.double().numpy(), float(emb.attention_scaling))
    x = torch.randn(40, 128, dtype=torch.float64)
    pos = torch.arange(100, 140)
    cos, sin = emb(x.float(), pos[None])
    hf_rows = apply_rotary_pos_emb(x.float().reshape(1, 40, 2, 64).transpose(1, 2),
                                   x.float().reshape(1, 40, 2, 64).transpose(1, 2), cos, sin)[1]
    hf_rows = hf_rows.transpose(1, 2).reshape(40, 128).double()
    torch.testing.assert_close(rope.apply(x, 100), hf_rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope.invert(rope.apply(x, 100), 100), x, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def calib():
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(C, C, generator=g) / C ** 0.5
    return [[((torch.randn(T, C, generator=g) * torch.linspace(3, 0.1, C)) @ mix + 0.5,
              torch.randn(T, C, generator=g) * torch.linspace(2, 0.2, C)) for _ in range(2)] for _ in range(3)]


@pytest.fixture(scope="module")
def rope():
    return Rope(1.0 / 10000 ** (np.arange(0, 64, 2) / 64))


@pytest.mark.parametrize("options", [dict(), dict(sink=4, pre_rope=True), dict(per_head=True, weighted=True)])
def test_codec_round_trip_is_what_roundtrip_reports(calib, rope, options, tmp_path):
    weighted = options.pop("weighted", False)
    qs = [torch.randn(64, 2 * C) for _ in range(2)]
    km = {L: query_metric(qs, HEADS, rope, T, options.get("pre_rope", False), np.random.default_rng(0))
          for L in range(2)} if weighted else None
    vm = {L: value_metric(torch.randn(C, 2 * C), HEADS, 64) for L in range(2)} if weighted else None
    codec = fit_kv_codec(calib[:2], HEADS, rope=rope, key_metric=km, value_metric=vm, **options).set_scale(0.3)
    x = calib[2][1][0]
    for kind in "kv":
        blob = codec.encode(x, 1, kind, start=0)
        x_hat = codec.decode(blob)
        rt, n = codec.roundtrip(x, 1, kind)
        assert n == len(blob)
        torch.testing.assert_close(x_hat, rt, rtol=0, atol=1e-5)
        if codec.sink:
            torch.testing.assert_close(x_hat[:codec.sink], x[:codec.sink].bfloat16().float(), rtol=0, atol=0)
        rel = float(((x_hat - x) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())
        assert rel < 0.05
        # a finer scale gives a smaller error and more bytes
        fine, n_fine = codec.set_scale(0.1).roundtrip(x, 1, kind)
        assert float(((fine - x) ** 2).sum()) < float(((x_hat - x) ** 2).sum()) and n_fine > n
        codec.set_scale(0.3)
    codec.save(tmp_path / "c.safetensors")
    again = KVCodec.load(tmp_path / "c.safetensors")
    assert again.decode(codec.encode(x, 0, "k")).equal(codec.decode(codec.encode(x, 0, "k")))
    other = fit_kv_codec(calib[1:], HEADS, rope=rope)
    with pytest.raises(BitstreamError, match="codec tables"):
        other.decode(codec.encode(x, 0, "k"))


def test_allocation_and_calibration(calib, rope):
    codec = fit_kv_codec(calib[:2], HEADS)
    delta = {(L, kind): (0.04 if (L, kind) == (0, "k") else 0.01) for L in range(2) for kind in "kv"}
    alloc = allocate_by_sensitivity(codec, delta, probe_scale=1.0)
    ratio = {key: alloc.transforms[key].unit / codec.transforms[key].unit for key in delta}
    assert ratio[(0, "k")] == pytest.approx(ratio[(1, "v")] / 2)  # 4x the cost: half the step
    # a delta lost in its noise counts as se_mult x its SE: (1, "v") measured 0.01 +- 0.02 acts as 0.04
    se = {key: (0.02 if key == (1, "v") else 0.0) for key in delta}
    noisy = allocate_by_sensitivity(codec, delta, probe_scale=1.0, se=se, se_mult=2.0)
    got = {key: noisy.transforms[key].unit / codec.transforms[key].unit for key in delta}
    assert got[(1, "v")] == pytest.approx(got[(0, "k")]) and got[(1, "v")] == pytest.approx(got[(0, "v")] / 2)
    assert noisy.meta["hash"] != alloc.meta["hash"] and noisy.meta["allocation_se_mult"] == 2.0


def test_calibration_stores_a_measured_scale_whose_bound_meets_the_target(calib):
    codec = fit_kv_codec(calib[:2], HEADS)
    calls = []

    def evaluate(c):  # change 0.01 s^2 with an SE of a tenth of it
        calls.append(c.scale)
        return 0.01 * c.scale ** 2, 0.001 * c.scale ** 2

    got = calibrate_scale(codec, evaluate, target=0.0025, grid=(0.1, 0.2, 0.4), z=1.0)
    points = {float(k): v for k, v in got.meta["calibration_points"].items()}
    assert got.scale in points and got.scale in calls  # a measured scale, not an extrapolation
    change, se = points[got.scale]
    assert change + se <= 0.0025 + 1e-15
    assert got.scale == pytest.approx((0.0025 / 0.011) ** 0.5, rel=0.05)  # just below the bound's root
    assert got.meta["target_ppl_change"] == 0.0025 and got.meta["calibration_z"] == 1.0
    assert got.meta["calibrated_ppl_change"] == pytest.approx(change)
    # a larger margin gives a smaller scale; z = 0 reaches the change's own root
    strict = calibrate_scale(fit_kv_codec(calib[:2], HEADS), evaluate, target=0.0025, grid=(0.1, 0.2, 0.4), z=3.0)
    loose = calibrate_scale(fit_kv_codec(calib[:2], HEADS), evaluate, target=0.0025 * (1 + 1e-9), grid=(0.1, 0.2, 0.4),
                            z=0.0)
    assert strict.scale < got.scale < loose.scale <= 0.5 + 1e-9
    assert loose.scale == pytest.approx(0.5, rel=0.05)


def test_calibration_never_takes_a_noisy_pass_above_a_failure(calib):
    codec = fit_kv_codec(calib[:2], HEADS)
    table = {0.1: (0.001, 0.0), 0.2: (0.004, 0.0), 0.4: (0.002, 0.0)}  # 0.4 passes by noise, 0.2 fails
    got = calibrate_scale(codec, lambda c: table[round(c.scale, 6)], target=0.003, grid=(0.1, 0.2, 0.4), refine=0)
    assert got.scale == 0.1
    # a bare float from evaluate means an SE of 0; the SE counts against the target otherwise
    assert calibrate_scale(codec, lambda c: table[round(c.scale, 6)][0], target=0.003, grid=(0.1, 0.2, 0.4),
                           refine=0).scale == 0.1
    with_se = {0.1: (0.001, 0.0015), 0.2: (0.004, 0.0), 0.4: (0.002, 0.0)}
    got = calibrate_scale(codec, lambda c: with_se[round(c.scale, 6)] if c.scale in with_se else (0.0, 0.0),
                          target=0.003, grid=(0.1, 0.2, 0.4), refine=0, z=2.0)
    assert got.scale == 0.05  # 0.1 fails with its margin: the smallest scale is halved until one passes


def test_calibration_refuses_bad_targets_and_impossible_ones(calib):
    codec = fit_kv_codec(calib[:2], HEADS)
    with pytest.raises(InvalidTensorError, match="target"):
        calibrate_scale(codec, lambda c: 1.0, target=-0.003)
    with pytest.raises(InvalidTensorError, match="z"):
        calibrate_scale(codec, lambda c: 1.0, target=0.003, z=-1)
    with pytest.raises(InvalidTensorError, match="no scale"):
        calibrate_scale(codec, lambda c: (0.0, 0.01), target=0.003, grid=(0.1, 0.2), refine=1)


def test_recent_tokens_travel_raw_and_cost_their_bytes(calib, rope, tmp_path):
    x = calib[2][1][0]
    plain = fit_kv_codec(calib[:2], HEADS, sink=4, pre_rope=True, rope=rope).set_scale(0.3)
    codec = fit_kv_codec(calib[:2], HEADS, sink=4, recent=16, pre_rope=True, rope=rope).set_scale(0.3)
    assert codec.meta["recent"] == 16 and codec.meta["hash"] != plain.meta["hash"]
    for kind in "kv":
        blob = codec.encode(x, 1, kind)
        x_hat = codec.decode(blob)
        rt, n = codec.roundtrip(x, 1, kind)
        assert n == len(blob) and x_hat.shape == x.shape
        torch.testing.assert_close(x_hat, rt, rtol=0, atol=1e-5)
        torch.testing.assert_close(x_hat[-16:], x[-16:].bfloat16().float(), rtol=0, atol=0)
        torch.testing.assert_close(x_hat[:4], x[:4].bfloat16().float(), rtol=0, atol=0)
        assert codec.symbols(x, 1, kind).shape == (T - 4 - 16, C)
        # the raw rows are 2 bytes per value on top of fewer coded rows
        assert len(blob) > len(plain.encode(x, 1, kind)) + 16 * C
        # the same reconstruction without the entropy coder, and no bytes counted
        fast, zero = codec.roundtrip(x, 1, kind, count_bytes=False)
        assert zero == 0 and fast.equal(rt)
    # the same tables with recent tokens added: its own hash, the same coded body as the plain codec
    added = plain.with_recent(16)
    assert added.recent == 16 and added.meta["hash"] not in (plain.meta["hash"], codec.meta["hash"])
    assert added.symbols(x, 1, "v").equal(plain.symbols(x, 1, "v")[:-16])
    assert added.decode(added.encode(x, 1, "k"))[-16:].equal(x[-16:].bfloat16().float())
    codec.save(tmp_path / "r.safetensors")
    again = KVCodec.load(tmp_path / "r.safetensors")
    assert again.recent == 16 and again.decode(codec.encode(x, 0, "k")).equal(codec.decode(codec.encode(x, 0, "k")))
    with pytest.raises(InvalidTensorError, match="recent"):
        codec.encode(x[:20], 0, "k")  # 20 rows: nothing left between 4 sink and 16 recent tokens
    with pytest.raises(InvalidTensorError, match="recent"):
        KVCodec({}, recent=-1)
    with pytest.raises(InvalidTensorError, match="coder"):
        codec.encode(x, 0, "k", coder="gpu")


@pytest.mark.gpu
def test_codec_on_cuda_codes_the_same_bytes_and_rows_as_on_the_cpu(calib, rope):
    codec = fit_kv_codec(calib[:2], HEADS, sink=4, recent=8, pre_rope=True, rope=rope).set_scale(0.3)
    x = calib[2][1][0]
    for kind in "kv":
        cpu_blob = codec.encode(x, 1, kind)
        gpu_blob = codec.encode(x.cuda(), 1, kind)  # coder "auto": rans_cuda on the GPU
        assert bytes(gpu_blob) == cpu_blob
        assert bytes(codec.encode(x.cuda(), 1, kind, coder="cpu")) == cpu_blob
        rt, n = codec.roundtrip(x.cuda(), 1, kind)
        assert rt.is_cuda and n == len(cpu_blob)
        torch.testing.assert_close(rt.cpu(), codec.decode(cpu_blob), rtol=0, atol=1e-4)
        on_gpu = codec.decode(cpu_blob, device="cuda")  # the GPU coder decodes the CPU coder's bytes
        assert on_gpu.is_cuda
        torch.testing.assert_close(on_gpu.cpu(), codec.decode(cpu_blob), rtol=0, atol=1e-4)


def test_calibration_closes_in_on_a_cost_the_power_law_does_not_fit():
    # a floor the power law lacks: its predictions miss, the bracket still closes on the root
    root = (0.2) ** 0.5
    got = calibrate_scale(KVCodec({}), lambda c: 0.001 + 0.01 * c.scale ** 2, 0.003, grid=(0.15, 0.3, 0.6, 0.9),
                          refine=4)
    assert root / 1.04 < got.scale <= root
    assert len(got.meta["calibration_points"]) == 4 + 4  # every refinement measured a new scale

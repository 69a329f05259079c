"""The shared-step rate-distortion quantizer (shared/rdquant.py): exact quantize/dequantize rules,
the step search meets its target and is the largest that does, parameters survive serialization,
clear errors on bad input; the fused GPU projection matches the CPU arithmetic.
"""
import numpy as np
import pytest

from shared.errors import BitstreamError, InvalidTensorError
from shared.rdquant import RDQuantizer, find_step, quality
from test_rans import needs_triton, run_interpreted


def pca_setup(T=512, D=48, seed=0):
    rng = np.random.default_rng(seed)
    q = np.linalg.qr(rng.standard_normal((D, D)))[0]
    x = ((rng.standard_normal((T, D)) * np.arange(1, D + 1) ** -0.6) @ q.T + 0.5).astype(np.float32)
    mean = x.mean(0)
    comps = np.linalg.eigh(np.cov((x - mean).T))[1][:, ::-1].astype(np.float32)
    coeffs = (x - mean) @ comps
    return x, mean, comps, coeffs


def test_quantize_is_mid_tread_rounding_and_dequantize_multiplies():
    q = RDQuantizer(0.5)
    c = np.array([[0.24, 0.26, -0.26, 1.74, 1e6]], np.float32)
    s = q.quantize(c)
    assert s.dtype == np.int32
    np.testing.assert_array_equal(s, [[0, 1, -1, 3, 2_000_000]])
    np.testing.assert_allclose(q.dequantize(s), s * 0.5)
    # error per coefficient is at most half a step
    rng = np.random.default_rng(0)
    c = rng.standard_normal((100, 7)).astype(np.float32) * 10
    assert np.abs(q.dequantize(q.quantize(c)) - c).max() <= 0.25 + 1e-5


@pytest.mark.parametrize("metric,target", [("cos", 0.999), ("cos", 0.97), ("rel_mse", 1e-3), ("rel_mse", 3e-2)])
def test_find_step_meets_target_and_is_nearly_the_largest(metric, target):
    x, mean, comps, coeffs = pca_setup()
    recon = lambda c: c @ comps.T + mean  # noqa: E731
    q = find_step(coeffs, target, metric, reconstruct=recon, reference=x)
    achieved = quality(x.astype(np.float64), recon(q.dequantize(q.quantize(coeffs))).astype(np.float64), metric)
    assert achieved >= target if metric == "cos" else achieved <= target
    bigger = RDQuantizer(q.step * 1.05)
    worse = quality(x.astype(np.float64), recon(bigger.dequantize(bigger.quantize(coeffs))).astype(np.float64), metric)
    assert worse < target if metric == "cos" else worse > target


def test_a_coefficient_thousands_of_rms_out_still_gets_a_step_within_int32():
    """Heavy tails put the largest coefficient far out: the search must not try steps so fine that its
    symbol leaves int32 (that raised before a step meeting the target was found)."""
    import torch

    rng = np.random.default_rng(1)
    coeffs = rng.standard_normal((1 << 20, 8)).astype(np.float32)
    coeffs[7, 3] = 1e5  # |c| / RMS about 2900 (the RMS counts it too): beyond 2^31 x 1e-6
    c = torch.from_numpy(coeffs)  # the torch path refuses symbols beyond int32
    q = find_step(c, 0.999)
    symbols = q.quantize(c)
    assert int(symbols.abs().max()) < 2**31 - 1
    assert quality(c.double(), q.dequantize(symbols).double(), "cos") >= 0.999


def test_lower_quality_target_gives_larger_step():
    x, mean, comps, coeffs = pca_setup()
    steps = [find_step(coeffs, t, reconstruct=lambda c: c @ comps.T + mean, reference=x).step
             for t in (0.9999, 0.999, 0.99)]
    assert steps[0] < steps[1] < steps[2]


def test_water_fill_drops_low_variance_components():
    x, mean, comps, coeffs = pca_setup()
    q = find_step(coeffs, 0.97, reconstruct=lambda c: c @ comps.T + mean, reference=x, water_fill=True)
    assert q.keep is not None and 0 < q.keep.sum() < len(q.keep)
    s = q.quantize(coeffs)
    assert (s[:, ~q.keep] == 0).all()
    assert q.keep[0]  # the first component has the largest variance


def test_unreachable_target_is_refused_clearly():
    x, mean, comps, coeffs = pca_setup()
    k = 4  # truncation alone loses far more than cos 0.9999 allows
    with pytest.raises(InvalidTensorError, match="beyond what the basis"):
        find_step(coeffs[:, :k], 0.9999, reconstruct=lambda c: c @ comps[:, :k].T + mean, reference=x)


def test_serialization_round_trips():
    for q in (RDQuantizer(0.0123), RDQuantizer(2.5, np.array([True, False, True, True, False]))):
        for back in (RDQuantizer.from_bytes(q.to_bytes()), RDQuantizer.from_dict(q.to_dict())):
            assert back.step == q.step
            assert (back.keep is None and q.keep is None) or np.array_equal(back.keep, q.keep)
    assert len(RDQuantizer(1.0).to_bytes()) <= 20


def test_bad_input_errors():
    with pytest.raises(InvalidTensorError, match="positive"):
        RDQuantizer(0.0)
    with pytest.raises(InvalidTensorError, match="NaN"):
        RDQuantizer(1.0).quantize(np.array([[np.nan, 1.0]], np.float32))
    with pytest.raises(InvalidTensorError, match="beyond int32"):
        RDQuantizer(1e-9).quantize(np.array([[10.0]], np.float32))
    with pytest.raises(InvalidTensorError, match="2-D"):
        RDQuantizer(1.0).quantize(np.zeros(3, np.float32))
    with pytest.raises(InvalidTensorError, match="floating point"):
        RDQuantizer(1.0).quantize(np.zeros((2, 2), np.int32))
    with pytest.raises(InvalidTensorError, match="metric"):
        find_step(np.ones((4, 2), np.float32), 0.9, metric="psnr")
    with pytest.raises(BitstreamError):
        RDQuantizer.from_bytes(b"RDQ2" + bytes(13))
    with pytest.raises(BitstreamError):
        RDQuantizer.from_bytes(b"RDQ1")


def test_torch_tensors_quantize_like_numpy():
    torch = pytest.importorskip("torch")
    x, mean, comps, coeffs = pca_setup()
    q = RDQuantizer(0.05)
    np.testing.assert_array_equal(q.quantize(torch.from_numpy(coeffs)).numpy(), q.quantize(coeffs))
    tq = find_step(torch.from_numpy(coeffs), 0.999, reconstruct=lambda c: c @ torch.from_numpy(comps).T
                   + torch.from_numpy(mean), reference=torch.from_numpy(x))
    nq = find_step(coeffs, 0.999, reconstruct=lambda c: c @ comps.T + mean, reference=x)
    assert tq.step == pytest.approx(nq.step, rel=1e-3)


@pytest.mark.slow
@needs_triton
def test_fused_projection_in_triton_interpreter():
    """CudaProjection's kernels (run by Triton's CPU interpreter): symbols equal the float64
    reference except at rounding ties, statistics exact, reconstruction within bf16 precision."""
    run_interpreted("""
        import torch
        from shared.rdquant import CudaProjection, quality
        from test_rdquant import pca_setup

        x, mean, comps, coeffs = pca_setup(T=200, D=40)
        proj = CudaProjection(mean, comps, device="cpu")
        xt = torch.from_numpy(x).to(torch.bfloat16)
        step = 0.02
        sym, (mn, mx, sm) = proj.quantize(xt, step)
        ref = np.floor((xt.float().numpy().astype(np.float64) @ proj.components.double().numpy()
                        - proj.bias.double().numpy()) / step + 0.5)
        assert (np.abs(sym.numpy() - ref) <= 1).all() and (sym.numpy() == ref).mean() > 0.999
        s = sym.numpy()
        assert (mn.numpy() == s.min(0)).all() and (mx.numpy() == s.max(0)).all()
        assert (sm.numpy() == s.astype(np.int64).sum(0)).all()
        # the basis hoisted out of the row-tile loop (D <= 3 BD, as above) or read per tile in a loop over D
        looped = CudaProjection(mean, comps, device="cpu")
        looped.BLOCK = dict(proj.BLOCK, BD=8)
        from shared._rdquant_triton import hoists
        assert hoists(proj.D, proj.BLOCK["BD"]) and not hoists(looped.D, looped.BLOCK["BD"])
        sym_l, (mn_l, mx_l, sm_l) = looped.quantize(xt, step)
        assert torch.equal(sym_l, sym) and torch.equal(mn_l, mn) and torch.equal(mx_l, mx) and torch.equal(sm_l, sm)
        payload = rans_cuda.encode_cuda(sym, stats=(mn, mx, sm))
        assert bytes(payload.numpy()) == rans.encode(s)
        # inputs read in place through an address table (a CUDA graph's way): the same symbols, also
        # from float16, which is rounded to bf16 as it is read
        for xin in (xt, xt.half()):
            got = proj.quantize_many(xin.unsqueeze(0), [step], addresses=torch.tensor([xin.data_ptr()]))
            assert torch.equal(got[0][0], sym) and torch.equal(got[1][0][0], mn)
        # int16 symbols: the same values and statistics, the same bytes from the coder
        narrow = proj.quantize_many(xt.unsqueeze(0), [step], narrow=True)
        assert narrow[0].dtype == torch.int16 and torch.equal(narrow[0][0].int(), sym)
        assert torch.equal(narrow[1][1][0], mx) and torch.equal(narrow[1][2][0], sm)
        assert bytes(rans_cuda.encode_cuda(narrow[0][0], stats=(mn, mx, sm)).numpy()) == rans.encode(s)
        # values beyond int16 are stored wrapped, the statistics still the int32 values': the coder
        # flags the tensor (3), and result() codes it again through recode, or raises without one
        sym_fine, stats_fine, _ = proj.quantize_many(xt.unsqueeze(0), [step * 20], narrow=True)
        sym_loud, stats_loud, amax = proj.quantize_many(xt.unsqueeze(0), [step / 2000], narrow=True)
        assert int(stats_loud[1].max()) > 32767 and float(amax) < 2**31
        def pending():
            return rans_cuda.encode_many_cuda([sym_fine[0], sym_loud[0]], stats=[tuple(v[0] for v in stats_fine),
                                              tuple(v[0] for v in stats_loud)], sync=False)
        p = pending()
        assert p.flags.tolist() == [0, rans_cuda.NARROW_OVERFLOW_ENCODE]
        with pytest.raises(InvalidTensorError, match="int16"):
            p.result()
        p = pending()
        p.recode = lambda copy, flagged: flagged
        assert p.result() == [1] and p.retried
        # int16 symbols (a decode graph's) reconstruct exactly as int32 ones
        assert torch.equal(proj.reconstruct(sym.to(torch.int16), step), proj.reconstruct(sym, step))
        x_hat = proj.reconstruct(rans_cuda.decode_cuda(payload), step).float().numpy()
        assert quality(x.astype(np.float64), x_hat.astype(np.float64), "cos") > 0.999
        # NaN or Inf in the input makes the largest |scaled value| infinite (the coder's guard refuses it)
        for bad_value in (float("nan"), float("inf")):
            xb = xt.clone()
            xb[7, 3] = bad_value
            assert float(proj.quantize_unchecked(xb, step)[2]) == float("inf"), bad_value
        assert float(proj.quantize_unchecked(xt, step)[2]) < 2**31
        # a step that makes outputs overflow bf16 raises the tensor's flag, and only that tensor's
        flags = torch.zeros(2, dtype=torch.int32)
        proj.reconstruct_many(torch.stack([sym, sym]), [step, 1e38], bad=flags)
        assert flags.tolist() == [0, 1]
    """)

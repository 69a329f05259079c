"""PoC 05's diffusion helpers: the ratio at a PSNR read off a measured curve, the step calibrated for a
PSNR target, and the per-step hook's byte count."""
import math

import pytest
import torch

from poc_module import load_poc


@pytest.fixture(scope="module")
def poc():
    return load_poc("05_downstream_quality.py", "poc05")


def test_ratio_at_psnr_interpolates_log_ratio_and_refuses_outside_the_curve(poc):
    points = [(30.0, 16.0), (50.0, 4.0)]
    assert poc.ratio_at_psnr(points, 40.0) == pytest.approx(8.0)  # geometric mean: log ratio linear in PSNR
    assert poc.ratio_at_psnr(points, 50.0) == pytest.approx(4.0)
    assert poc.ratio_at_psnr(points, 55.0) is None and poc.ratio_at_psnr(points, 29.0) is None
    assert poc.ratio_at_psnr(points[:1], 30.0) is None
    # a point dominated by one at higher PSNR and ratio does not pull the curve down
    assert poc.ratio_at_psnr([(30.0, 16.0), (40.0, 2.0), (50.0, 8.0)], 40.0) == pytest.approx(8.0)


def test_calibrated_step_meets_the_target_and_is_near_the_largest_that_does(poc):
    def psnr(step):  # 6.02 dB per halving, 40 dB at step 0.37
        return 40.0 - 20 * math.log10(step / 0.37)

    step, points = poc.calibrate_psnr(psnr, 40.0, 0.2, iters=3)
    assert psnr(step) >= 40.0 and step == pytest.approx(0.37, rel=1e-3)
    assert 3 <= len(points) <= 5 and max(points) >= step and psnr(max(points)) < 40.0


def test_counting_hook_uses_each_steps_method_and_counts_its_bytes(poc):
    calls = []
    hook = poc.CountingHook([lambda x, i=i: (calls.append(i) or x * 0 + i, 10 + i) for i in range(3)])
    x = torch.ones(4, 8)
    outs = [hook(x) for _ in range(4)]
    assert calls == [0, 1, 2, 0] and [float(o[0, 0]) for o in outs] == [0, 1, 2, 0]
    assert hook.raw_bytes == 4 * 2 * 32 and hook.coded_bytes == 10 + 11 + 12 + 10
    fn = poc.per_channel(4)
    y, nbytes = fn(torch.randn(64, 8))
    assert y.shape == (64, 8) and nbytes == 64 * 8 // 2 + 4 * 8  # packed int4 + fp16 scale and zero per channel

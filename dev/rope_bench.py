"""Fused RoPE (SpillCache's rotation of keys coded before RoPE) against the torch ops it replaces: one
layer's keys [T, 8 x 128] bf16, checked equal to rounding, then timed with CUDA events (median of 20).

Command:  python3 dev/rope_bench.py            (an NVIDIA GPU; a few seconds)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.kvcache import _rotate_forward  # noqa: E402
from shared.kvcodec import Rope  # noqa: E402

HEADS, HEAD_DIM = 8, 128
rope = Rope(1e6 ** (-torch.arange(HEAD_DIM // 2, dtype=torch.float64) / (HEAD_DIM // 2)).numpy())
for T in (4096, 32768, 65536):
    cos, sin = (t.float().cuda().contiguous() for t in rope.cos_sin(torch.arange(T)))
    rows = torch.randn(T, HEADS * HEAD_DIM, device="cuda").to(torch.bfloat16)
    a, b = rows.clone(), rows.clone()
    _rotate_forward(a, cos, sin, HEAD_DIM, fused=True)
    _rotate_forward(b, cos, sin, HEAD_DIM, fused=False)
    assert float((a.float() - b.float()).abs().max()) <= 2 ** -6 * float(rows.float().abs().max()), "fused RoPE differs"
    times = {}
    for fused in (True, False):
        runs = []
        for _ in range(23):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            _rotate_forward(rows, cos, sin, HEAD_DIM, fused=fused)
            e.record()
            e.synchronize()
            runs.append(s.elapsed_time(e))
        times[fused] = sorted(runs[3:])[10]
    print(f"{torch.cuda.get_device_name()} T={T}: fused matches torch; fused {times[True]:.3f} ms, "
          f"torch ops {times[False]:.3f} ms ({2 * rows.numel() * 2 / times[True] / 1e6:.0f} GB/s of keys read + written)")

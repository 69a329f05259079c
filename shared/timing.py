"""Timing for every benchmark: warm-up, synchronize, median of repeats."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np


def wall_ms(fn: Callable[[], object], repeats: int, warmup: int = 1,
            sync: Callable[[], None] | None = None, stat: str = "median") -> float:
    """Median (or, stat="mean", mean) wall-clock ms of fn(); `sync` (e.g. torch.cuda.synchronize) runs before
    and after each call, for work that leaves the CPU (hardware engines, other streams). The mean is what a
    stream of calls takes per call on a shared machine, where the median hides the calls that were preempted."""
    if stat not in ("median", "mean"):
        raise ValueError(f"stat must be 'median' or 'mean', got {stat!r}")
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples) if stat == "median" else np.mean(samples)) * 1e3


def cuda_ms(fn: Callable[[int], object], repeats: int, warmup: int, stream) -> float:
    """Median ms of fn(i) on a CUDA stream, measured with CUDA events recorded on that stream."""
    import torch

    with torch.cuda.stream(stream):
        for i in range(warmup):
            fn(i)
        torch.cuda.synchronize()
        samples = []
        for i in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn(i)
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end))
    return float(np.median(samples))

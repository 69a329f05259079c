"""Where does the GPU rANS decoder's lanes kernel spend its time on one layer's spilled KV, in each lane order?

One layer's K and V at 64K tokens (KV-like rows, PoC 17's step and 256-token lanes), one container each, as
PoC 17 stores a prompt, decoded to coefficient rows by pipeline.StagedDecode launched eagerly (so a profiler
sees each kernel), coded twice: lane groups of 32 components of one token chunk (the default order), and
lane groups of 32 token chunks of one component (rans LANES_BY_COMPONENT: a warp reads one table), decoded
one lane group a program or COMPONENT_TILE components a program (their rows stored through shared memory).
Every decode's checks pass (plan.check) and give the same rows, then each is timed (CUDA events, median). Under
Nsight Compute it gives the lanes kernel's issue rate, occupancy and stall reasons (docs/findings.md has
what they said on an NVIDIA H100 for the default order: L1TEX-bound table lookups).

Command:  python3 dev/profile_decode_lanes.py               (an NVIDIA GPU; about 30 s)
          ncu --kernel-name decode_kernel --launch-skip 1 --launch-count 1 --section WarpStateStats \\
              --section SchedulerStats --section Occupancy python3 dev/profile_decode_lanes.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from staged_decode_sizes import timed  # noqa: E402  (CUDA events, median of its REPEATS)
from symbol_lookup import D_KV, staged_layer  # noqa: E402
from shared.codecs import rans_cuda  # noqa: E402
from shared.pipeline import StagedDecode  # noqa: E402

CONTEXT = 65536  # tokens of one layer's K and V
REPLAYS = 3      # eager replays before timing (a profiler skips the first)
PROFILED = 5     # replays under torch.profiler for the per-kernel breakdown


def kernel_times(fn) -> str:
    """Each GPU kernel's mean time over PROFILED calls of fn (torch.profiler), longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            fn()
        torch.cuda.synchronize()
    kernels = sorted(((e.self_device_time_total / PROFILED / 1000, e.key) for e in prof.key_averages()
                      if e.self_device_time_total > 0), reverse=True)
    return "kernels (ms a replay): " + ", ".join(f"{name[:40]} {ms:.3f}" for ms, name in kernels[:8])


VARIANTS = {  # name: (lanes by component, rans_cuda.COMPONENT_TILE)
    "by token": (False, rans_cuda.COMPONENT_TILE),
    "by component, a warp a program": (True, 0),
    f"by component, {rans_cuda.COMPONENT_TILE} components a program": (True, rans_cuda.COMPONENT_TILE),
}


def main() -> None:
    rows = {}
    tile = rans_cuda.COMPONENT_TILE
    for name, (by_component, components_a_program) in VARIANTS.items():
        rans_cuda.COMPONENT_TILE = components_a_program  # read by the decoder at each launch
        layer = staged_layer(CONTEXT, CONTEXT, by_component)  # one container per K and V
        coeff = [torch.empty(CONTEXT, layer.width, dtype=torch.bfloat16, device="cuda") for _ in layer.blobs]
        plan = StagedDecode(layer.codecs, layer.heads, [b.numel() for b in layer.blobs], layer.offsets, layer.stage,
                            coeff, reconstruct=False, graph=False)
        for _ in range(REPLAYS):
            plan.replay()
        torch.cuda.synchronize()
        plan.check()
        rows[name] = coeff
        ms = timed(plan.replay)
        print(f"{torch.cuda.get_device_name()}: 2 x [{CONTEXT}, {D_KV}] decoded to coefficient rows, lanes {name}, "
              f"ratio {2 * CONTEXT * D_KV * 2 / layer.total:.2f}x: {ms:.3f} ms a replay (eager, all kernels)", flush=True)
        print("    " + kernel_times(plan.replay), flush=True)
    rans_cuda.COMPONENT_TILE = tile
    first, *others = rows.values()
    if not all(torch.equal(a, b) for other in others for a, b in zip(first, other)):
        raise SystemExit("the lane orders decode different rows")
    print("every lane order decodes the same rows")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU (it profiles the GPU decoder)")
    main()

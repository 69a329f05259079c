"""Where does a host round trip (GPU -> pinned host -> GPU through shared.stream.HostStream) spend its time,
and does a basis truncated to the components the step keeps lift the wide (D = 4096) case?

1. Timeline: one warm round trip of N tensors, each stage's span from CUDA events (encode, d2h, h2d, decode
   per chunk), then the host side of the same call from torch.profiler: the CUDA runtime calls that block
   the host (synchronizations, allocations), per thread, with their total time.
2. Truncation: the same tensors' codec at full rank K = D and at the K that water-filling keeps for the cos
   target (PoC 15's host_codec(truncate=True)), each round trip checked (cos) before it is timed beside the
   pipelined raw trip.

    python3 dev/profile_round_trip.py [--width 1024] [--mb 256] [--n 8] [--trace out.json] [--truncate]
"""
import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent.parent / "tests")]

import torch  # noqa: E402
from poc_module import load_poc  # noqa: E402

from shared.pipeline import TensorCodec  # noqa: E402
from shared.stream import HostStream  # noqa: E402

poc15 = load_poc("15_p2p_multi_gpu.py", "poc15")
ap = argparse.ArgumentParser()
ap.add_argument("--width", type=int, default=1024)
ap.add_argument("--mb", type=float, default=256, help="MB of bf16 per tensor")
ap.add_argument("--n", type=int, default=8, help="tensors per round trip")
ap.add_argument("--chunk-mb", type=float, default=256)
ap.add_argument("--trace", default=None, help="write the profiler's Chrome trace here")
ap.add_argument("--truncate", action="store_true", help="also time the codec truncated to the kept components")
ap.add_argument("--by-component", action="store_true", help="profile the codec with its lanes by component")
a = ap.parse_args()

gen = torch.Generator(device="cuda").manual_seed(0)
(codec, *shorter), mix = poc15.host_codec(torch, a.width, gen, truncate=a.truncate)
T = int(a.mb * 2**20) // (2 * a.width)
xs = [poc15.gpu_activations(torch, T, a.width, mix, gen) for _ in range(a.n)]
total = sum(2 * x.numel() for x in xs)


def time_stream(label, stream):
    """Check stream's round trip (cos), then time it, its offload and its fetch; print one line."""
    cm = min(poc15.cos_mean(x, y) for x, y in zip(xs, stream.round_trip(xs)))
    s = poc15.median_call_s(torch, lambda: stream.round_trip(xs), 3, 5)
    off = poc15.median_call_s(torch, lambda: stream.offload(xs), 3, 5)
    copy = stream.offload(xs)
    fetch = poc15.median_call_s(torch, lambda: stream.fetch(copy), 3, 5)
    print(f"{label}: cos_min {cm:.5f}, ratio {stream.last['ratio']:.2f}x, round trip {1e3 * s:.2f} ms "
          f"{total / s / 1e9:.1f} GB/s ({raw_s / s:.2f}x raw); offload {total / off / 1e9:.1f}, "
          f"fetch {total / fetch / 1e9:.1f} GB/s")


raw = HostStream(None)
assert all(torch.equal(x, y) for x, y in zip(xs, raw.round_trip(xs))), "raw round trip differs"
raw_s = min(poc15.median_call_s(torch, lambda s=HostStream(None, chunk_mb=c): s.round_trip(xs), 3, 5) for c in (8, 16, 64))
print(f"{a.n} x [{T}, {a.width}] bf16: raw pipelined round trip bit-exact, best {total / raw_s / 1e9:.1f} GB/s")

# the schedule (encodes and decodes side by side, or taking turns) x the rANS lane order, same tensors
by_component = TensorCodec(codec.basis, backend="rans", step=codec.quantizer.step, lanes_by_component=True)
for turns in (False, True):
    for name, c in (("by token", codec), ("by component", by_component)):
        time_stream(f"{'taking turns' if turns else 'side by side':12s} lanes {name:12s}",
                    HostStream([c] * a.n, chunk_mb=a.chunk_mb, take_turns=turns))
# kernel-only, one tensor: which kernels each lane order spends its time in
for name, c in (("by token", codec), ("by component", by_component)):
    rows = poc15.kernel_profile(torch, [c], xs[:1])
    for direction in ("encode", "decode"):
        top = [r for r in rows if r["direction"] == direction][:5]
        print(f"kernel-only, lanes {name}, {direction}: " + ", ".join(f"{r['kernel'][:28]} {r['us']:.0f} us" for r in top))
stream = HostStream([by_component if a.by_component else codec] * a.n, chunk_mb=a.chunk_mb)
stream.round_trip(xs)

# 1. the timeline of one warm call
stream.round_trip(xs, timeline=True)
print("stage   chunk   start_ms    end_ms   span_ms")
for stage, k, t0, t1 in sorted(stream.last["timeline"], key=lambda r: r[2]):
    print(f"{stage:7s} {k:5d} {t0:10.3f} {t1:9.3f} {t1 - t0:9.3f}")

# the host side: which runtime calls block which thread, and for how long
from torch.profiler import ProfilerActivity, profile  # noqa: E402

torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    stream.round_trip(xs)
    torch.cuda.synchronize()
if a.trace:
    prof.export_chrome_trace(a.trace)
per = {}
for e in prof.events():
    if e.device_type.name == "CPU" and (e.name.startswith("cuda") or e.name.startswith("aten::") and
                                        e.name in ("aten::item", "aten::_local_scalar_dense", "aten::copy_",
                                                   "aten::empty", "aten::to", "aten::cat")):
        key = (e.thread, e.name)
        n, us = per.get(key, (0, 0.0))
        per[key] = (n + 1, us + e.cpu_time_total)
print("thread  calls  total_ms  host call (time spent in it)")
for (thread, name), (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:25]:
    print(f"{thread:>6} {n:6d} {us / 1e3:9.3f}  {name}")

# 2. the basis truncated to the components water-filling keeps at the cos target (where that is shorter)
for c in [codec, *shorter] if a.truncate else []:
    time_stream(f"K={c.basis.k:5d} step {c.quantizer.step:.4f}", HostStream([c] * a.n, chunk_mb=a.chunk_mb))

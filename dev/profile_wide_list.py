"""Where does an 8 x 16 MB list of 4096-wide tensors spend its codec time? encode_many and decode_many timed
through the API (median of 7 after 3 warm calls), then each one's kernels (torch.profiler, kernel-only).

    python3 dev/profile_wide_list.py [--width 4096] [--mb 16] [--n 8]
"""
import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent.parent / "tests")]

import torch  # noqa: E402
from poc_module import load_poc  # noqa: E402

from shared.pipeline import decode_many, encode_many  # noqa: E402

poc15 = load_poc("15_p2p_multi_gpu.py", "poc15")
ap = argparse.ArgumentParser()
ap.add_argument("--width", type=int, default=4096)
ap.add_argument("--mb", type=float, default=16)
ap.add_argument("--n", type=int, default=8)
ap.add_argument("--lane-tokens", type=int, default=None, help="tokens per rANS lane (default: the codec's)")
ap.add_argument("--no-profile", action="store_true")
a = ap.parse_args()
gen = torch.Generator(device="cuda").manual_seed(0)
(codec, *_), mix = poc15.host_codec(torch, a.width, gen)
codec.lane_tokens = a.lane_tokens
T = int(a.mb * 2**20) // (2 * a.width)
xs = [poc15.gpu_activations(torch, T, a.width, mix, gen) for _ in range(a.n)]
codecs = [codec] * a.n
blobs = encode_many(codecs, xs)
for name, call in (("encode_many", lambda: encode_many(codecs, xs)),
                   ("decode_many", lambda: decode_many(codecs, blobs, device="cuda"))):
    s = poc15.median_call_s(torch, call, 3, 7)
    print(f"{name} of {a.n} x [{T}, {a.width}] bf16 ({a.n * a.mb:g} MB), lane tokens {a.lane_tokens or 'default'}: "
          f"{1e3 * s:.2f} ms through the API, {a.n * a.mb * 2**20 / s / 1e9:.1f} GB/s, "
          f"{sum(2 * x.numel() for x in xs) / sum(b.numel() for b in blobs):.2f}x")
if a.no_profile:
    sys.exit(0)
rows = poc15.kernel_profile(torch, codecs, xs)
for direction in ("encode", "decode"):
    mine = [r for r in rows if r["direction"] == direction]
    print(f"  {direction}: kernels {sum(r['us'] for r in mine):.0f} us a call (kernel-only)")
    for r in mine[:10]:
        print(f"     {r['us']:8.1f} us  {r['kernel']}")

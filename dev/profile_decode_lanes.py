"""Where does the GPU rANS decoder's lanes kernel spend its time on one layer's spilled KV, and does a
second chain of lanes a thread (rans_cuda.DECODE_CHAINS) hide it?

One layer's K and V at 64K tokens (KV-like rows, PoC 17's step and 256-token lanes), one container each, as
PoC 17 stores a prompt; the two are decoded to coefficient rows by pipeline.StagedDecode launched eagerly (so a
profiler sees each kernel), with one and with two lane chains a program: the rows must be equal bit for bit,
then each is timed (CUDA events, median). Under Nsight Compute, one setting, to read the lanes kernel's issue
rate, occupancy and stall reasons:

Command:  python3 dev/profile_decode_lanes.py               (an NVIDIA GPU; about 30 s; last line: the faster)
          ncu --kernel-name decode_kernel --launch-skip 1 --launch-count 1 --section WarpStateStats \
              python3 dev/profile_decode_lanes.py --chains 2
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from staged_decode_sizes import timed  # noqa: E402  (CUDA events, median of its REPEATS)
from symbol_lookup import D_KV, LANE_TOKENS, SEED, STEP_KV, rows  # noqa: E402
from shared.basis import fit_basis_torch  # noqa: E402
from shared.codecs import rans_cuda  # noqa: E402
from shared.pipeline import StagedDecode, TensorCodec, encode_many  # noqa: E402

CONTEXT = 65536  # tokens of one layer's K and V
REPLAYS = 3      # eager replays (the profiler skips the first)
CHAINS = [1, 2]  # lane chains a program, compared


def main(chains: list) -> None:
    kv = [rows(CONTEXT, D_KV, SEED + 1), rows(CONTEXT, D_KV, SEED + 2)]
    codecs = [TensorCodec(fit_basis_torch(t[:8192].float(), D_KV), backend="rans", step=STEP_KV,
                          lane_tokens=LANE_TOKENS) for t in kv]
    blobs = [b.clone() for b in encode_many(codecs, kv)]
    offsets = np.cumsum([0] + [-(-b.numel() // 16) * 16 for b in blobs[:-1]]).tolist()
    total = offsets[-1] + blobs[-1].numel()
    stage = torch.zeros(-(-total // 16) * 16, dtype=torch.uint8, device="cuda")
    for b, a in zip(blobs, offsets):
        stage[a:a + b.numel()].copy_(b)
    heads = [bytes(b[:8192].cpu().numpy()) for b in blobs]
    width = codecs[0]._projection(D_KV, "cuda").coefficient_width()
    print(f"{torch.cuda.get_device_name()}: 2 x [{CONTEXT}, {D_KV}] decoded to coefficient rows, ratio "
          f"{2 * CONTEXT * D_KV * 2 / total:.2f}x; a replay (eager, all kernels):")
    outs, ms = {}, {}
    for n in chains:
        rans_cuda.DECODE_CHAINS = n
        coeff = [torch.empty(CONTEXT, width, dtype=torch.bfloat16, device="cuda") for _ in blobs]
        plan = StagedDecode(codecs, heads, [b.numel() for b in blobs], offsets, stage, coeff, reconstruct=False,
                            graph=False)
        for _ in range(REPLAYS):
            plan.replay()
        torch.cuda.synchronize()
        plan.check()
        outs[n] = coeff
        if not all(torch.equal(a, b) for a, b in zip(outs[chains[0]], coeff)):
            raise SystemExit(f"{n} chains decode other rows than {chains[0]}")
        ms[n] = timed(plan.replay)
        print(f"    {n} lane chain(s) a program: {ms[n]:.3f} ms" + ("" if n == chains[0] else "   rows equal"), flush=True)
    print("faster:", min(ms, key=ms.get))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--chains", type=int, choices=[1, 2], help="time this setting only (for a profiler)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU (it profiles the GPU decoder)")
    main([args.chains] if args.chains else CHAINS)

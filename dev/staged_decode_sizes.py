"""How long does one layer's compressed fetch take, part by part, as the context grows?

One layer of PoC 17's 32B-class shape (K and V rows [T, 1024] bf16 with a heavy-tailed spectrum, the
compute codec at cos 0.999, 256-token lanes): its two containers packed in pinned host memory, then
  copy        one H2D copy of the packed containers (what SpillCache's fetch moves)
  decode      pipeline.StagedDecode replayed (rANS kernels + reconstruction GEMMs), alone on the GPU
  decode_rows the same without the GEMMs (coefficient rows, SpillCache(coefficients=True))
  raw_copy    the H2D copy of the same K and V in bf16 (raw_fetch's bytes)
each checked first (the replay equals decode_many bit for bit), then timed with CUDA events (median of
REPEATS). A stage that takes longer than STALL_S prints every thread's stack: this script is also the
quickest way to see where a compressed fetch stalls at a given context.

Command:  python3 dev/staged_decode_sizes.py            (an NVIDIA GPU; about a minute)
"""
import faulthandler
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.basis import fit_basis_torch  # noqa: E402
from shared.pipeline import StagedDecode, TensorCodec, decode_many, encode_many  # noqa: E402

CONTEXTS = [4096, 8192, 16384, 32768, 65536]  # tokens of one layer's K and V
D = 1024                                       # KV channels (8 heads x 128)
STEP = 0.14                                    # quantization step (PoC 17's random model: 0.135-0.141)
LANE_TOKENS = 256                              # as PoC 17
REPEATS = 20                                   # timed replays per stage
STALL_S = 60                                   # a stage running longer prints its stacks


def rows(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.arange(1, D + 1, device="cuda", dtype=torch.float32) ** -0.8  # heavy-tailed spectrum
    mix = torch.linalg.qr(torch.randn(D, D, generator=g, device="cuda"))[0]
    return ((torch.randn(T, D, generator=g, device="cuda") * scale) @ mix * 8).to(torch.bfloat16)


def timed(fn, repeats: int = REPEATS) -> float:
    """Median ms of fn() over `repeats` calls after one untimed call (CUDA events on the current stream)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; one layer's K and V, D={D}, step {STEP}, {LANE_TOKENS}-token lanes")
    print(f"{'tokens':>7} {'ratio':>6} {'raw_copy':>9} {'copy':>7} {'decode':>7} {'rows':>7}  (ms)")
    for T in CONTEXTS:
        faulthandler.dump_traceback_later(STALL_S, repeat=True)
        x = [rows(T, 1), rows(T, 2)]
        codecs = [TensorCodec(fit_basis_torch(t[:8192].float(), D), backend="rans", step=STEP,
                              lane_tokens=LANE_TOKENS) for t in x]
        blobs = [b.clone() for b in encode_many(codecs, x)]
        offsets = [0, -(-blobs[0].numel() // 16) * 16]
        total = offsets[1] + blobs[1].numel()
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        for b, a in zip(blobs, offsets):
            host[a:a + b.numel()].copy_(b)
        stage = torch.empty(-(-total // 16) * 16, dtype=torch.uint8, device="cuda")  # StagedDecode: whole 16-byte words
        stage[:total].copy_(host)
        heads = [bytes(b[:8192].cpu().numpy()) for b in blobs]
        reference = [t.clone() for t in decode_many(codecs, blobs, device="cuda")]
        outs = [torch.empty_like(t) for t in x]
        plan = StagedDecode(codecs, heads, [b.numel() for b in blobs], offsets, stage, outs)
        plan.replay()
        torch.cuda.synchronize()
        plan.check()
        if not all(torch.equal(o, r) for o, r in zip(outs, reference)):
            raise SystemExit(f"T={T}: the staged decode differs from decode_many")
        width = codecs[0]._projection(D, "cuda").coefficient_width()
        coeff = [torch.empty(T, codecs[i]._projection(D, "cuda").coefficient_width(), dtype=torch.bfloat16,
                             device="cuda") for i in range(2)]
        rows_plan = StagedDecode(codecs, heads, [b.numel() for b in blobs], offsets, stage, coeff, reconstruct=False)
        raw_host = torch.empty(2, T, D, dtype=torch.bfloat16, pin_memory=True)
        raw_dev = torch.empty(2, T, D, dtype=torch.bfloat16, device="cuda")
        ms = dict(raw_copy=timed(lambda: raw_dev.copy_(raw_host, non_blocking=True)),
                  copy=timed(lambda: stage[:total].copy_(host, non_blocking=True)),
                  decode=timed(plan.replay), rows=timed(rows_plan.replay))
        ratio = 2 * T * D * 2 / total
        print(f"{T:>7} {ratio:>6.2f} {ms['raw_copy']:>9.3f} {ms['copy']:>7.3f} {ms['decode']:>7.3f} {ms['rows']:>7.3f}"
              f"   width {width}", flush=True)
        faulthandler.cancel_dump_traceback_later()
        del plan, rows_plan, stage, host, raw_host, raw_dev, blobs, outs, coeff, reference
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU (it times the GPU decoder)")
    main()

"""Does the GPU rANS decoder run faster with a one-byte slot -> symbol table than with one packed int32 per slot,
and how much does the way a layer's KV is cut into containers cost?

Each decoder lane looks up, every step, the entry of its state's slot in its component's table, and every
container brings its own tables (one per component, built on the GPU before its lanes run). One layer's K
and V (64K tokens, 1024 channels, KV-like rows, PoC 17's step and 256-token lanes) is cut into containers of
1024 and 8192 tokens (the chunks a long generation flushes) and of 64K (one per K and V, as a prompt is
stored). Two variants of the same decoder, side by side:

  packed   lut[slot] = symbol << 2n | freq - 1 << n | slot - cum   (int32; one load a step)
  symbol   lut[slot] = symbol (uint8), then tab[symbol] = cum << 16 | freq   (two loads, a quarter of the bytes)

For each case the containers are decoded both ways (pipeline.StagedDecode, one CUDA graph, coefficient rows as
PoC 17's fastest mode reads them; decode_many for a KV step's 60 small tensors), the outputs must be equal bit
for bit, then each is timed with CUDA events (median of 20 runs), beside the H2D copy of the same containers;
the 1024- and 65536-token cases are also profiled per kernel.

Command:  python3 dev/symbol_lookup.py            (an NVIDIA GPU; about a minute)
"""
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from staged_decode_sizes import timed  # noqa: E402  (CUDA events, median of its REPEATS)
from shared.basis import fit_basis_torch  # noqa: E402
from shared.codecs import rans_cuda  # noqa: E402
from shared.pipeline import StagedDecode, TensorCodec, decode_many, encode_many  # noqa: E402

CONTEXT = 65536                 # tokens of one layer's K and V
CHUNKS = [1024, 8192, 65536]    # tokens per container: a long generation's flushed chunks (SpillCache's chunk_tokens);
                                # 65536: one container per K and V, as a prompt is stored
D_KV = 1024                     # KV channels (8 heads x 128)
STEP_KV = 0.14                  # quantization step (PoC 17's random model: 0.135-0.141)
LANE_TOKENS = 256               # as PoC 17
WHOLE = [(60, 1024, 192, 0.14)]  # (tensors, T, D, step): decode_many
PROFILED = 5                    # replays under torch.profiler (the longest context)
SEED = 0


def rows(T: int, D: int, seed: int) -> torch.Tensor:
    """KV-like rows (PoC 17's random model's KV is near isotropic): every component coded, ~60-value
    alphabets at STEP_KV."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)


def with_lookup(symbol: bool, make):
    saved = rans_cuda.SYMBOL_LOOKUP
    rans_cuda.SYMBOL_LOOKUP = symbol
    try:
        return make()
    finally:
        rans_cuda.SYMBOL_LOOKUP = saved


@dataclass
class StagedLayer:
    """One layer's K and V coded as containers, packed (16-byte aligned) in pinned memory and staged on the GPU,
    as SpillCache lays them out: what StagedDecode takes."""
    codecs: list
    blobs: list
    offsets: list
    total: int      # bytes packed
    host: torch.Tensor
    stage: torch.Tensor
    heads: list     # each container's first bytes, for the host's checks
    width: int      # a coefficient row's values


def staged_layer(context: int, chunk: int, lanes_by_component: bool = False) -> StagedLayer:
    """KV-like K and V rows of `context` tokens, cut into 2 x context / chunk containers."""
    kv = [rows(context, D_KV, SEED + 1), rows(context, D_KV, SEED + 2)]
    base = [TensorCodec(fit_basis_torch(t[:8192].float(), D_KV), backend="rans", step=STEP_KV,
                        lane_tokens=LANE_TOKENS, lanes_by_component=lanes_by_component) for t in kv]
    chunks = [(base[i], kv[i][a:a + chunk]) for a in range(0, context, chunk) for i in range(2)]
    codecs = [c for c, _ in chunks]
    blobs = [b.clone() for b in encode_many(codecs, [x for _, x in chunks])]
    offsets = np.cumsum([0] + [-(-b.numel() // 16) * 16 for b in blobs[:-1]]).tolist()
    total = offsets[-1] + blobs[-1].numel()
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    for b, a in zip(blobs, offsets):
        host[a:a + b.numel()].copy_(b)
    stage = torch.empty(-(-total // 16) * 16, dtype=torch.uint8, device="cuda")
    stage[:total].copy_(host)
    return StagedLayer(codecs, blobs, offsets, total, host, stage, [bytes(b[:8192].cpu().numpy()) for b in blobs],
                       codecs[0]._projection(D_KV, "cuda").coefficient_width())


def chunked(context: int, chunk: int) -> dict:
    """One layer's K and V of `context` tokens as 2 x context / chunk containers, one graph."""
    layer = staged_layer(context, chunk)
    codecs, blobs, offsets, total = layer.codecs, layer.blobs, layer.offsets, layer.total
    host, stage, heads, width = layer.host, layer.stage, layer.heads, layer.width
    outs = {}
    ms = {"copy": timed(lambda: stage[:total].copy_(host, non_blocking=True))}
    for name, symbol in (("packed", False), ("symbol", True)):
        coeff = [torch.empty(chunk, width, dtype=torch.bfloat16, device="cuda") for _ in blobs]
        plan = with_lookup(symbol, lambda: StagedDecode(codecs, heads, [b.numel() for b in blobs], offsets, stage,
                                                        coeff, reconstruct=False))
        plan.replay()
        torch.cuda.synchronize()
        plan.check()
        outs[name] = coeff
        ms[name] = timed(plan.replay)
    if not all(torch.equal(a, b) for a, b in zip(outs["packed"], outs["symbol"])):
        raise SystemExit(f"{context} tokens: the two lookups decode different rows")
    if chunk in (CHUNKS[0], CHUNKS[-1]):  # where the time goes: the same kernels launched eagerly, per kernel
        for name, symbol in (("packed", False), ("symbol", True))[:2 if chunk == CHUNKS[0] else 1]:
            def profiled():
                plan = StagedDecode(codecs, heads, [b.numel() for b in blobs], offsets, stage, outs[name],
                                    reconstruct=False, graph=False)
                plan.replay()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(PROFILED):
                        plan.replay()
                    torch.cuda.synchronize()
                return prof
            prof = with_lookup(symbol, profiled)
            print(f"{name}, {len(blobs)} x [{chunk}, {D_KV}]: per replay, by kernel (us)")
            for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
                print(f"    {ev.key[:60]:<60} {ev.device_time_total / PROFILED:>9.1f}")
    return dict(ms, ratio=2 * context * D_KV * 2 / total, containers=len(blobs))


def whole(n: int, T: int, D: int, step: float) -> dict:
    xs = [rows(T, D, SEED + 10 + i) for i in range(n)]
    codec = TensorCodec(fit_basis_torch(xs[0].float(), D), backend="rans", step=step)
    codecs = [codec] * n
    blobs = [b.clone() for b in encode_many(codecs, xs)]
    outs, ms = {}, {}
    for name, symbol in (("packed", False), ("symbol", True)):
        outs[name] = [t.clone() for t in with_lookup(symbol, lambda: decode_many(codecs, blobs, device="cuda"))]
        ms[name] = with_lookup(symbol, lambda: timed(lambda: decode_many(codecs, blobs, device="cuda")))
    if not all(torch.equal(a, b) for a, b in zip(outs["packed"], outs["symbol"])):
        raise SystemExit(f"{n} x [{T}, {D}]: the two lookups decode different tensors")
    host = torch.empty(sum(b.numel() for b in blobs), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    ms["copy"] = timed(lambda: dev.copy_(host, non_blocking=True))
    return dict(ms, ratio=n * T * D * 2 / host.numel(), containers=n)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}: decode time, packed int32 lookup vs one-byte symbol lookup (ms)")
    print(f"{'case':>34} {'ratio':>6} {'copy':>7} {'packed':>7} {'symbol':>7} {'speed-up':>8}")
    for chunk in CHUNKS:
        r = chunked(CONTEXT, chunk)
        case = f"KV {CONTEXT} tok, {r['containers']} x [{chunk}, {D_KV}]"
        print(f"{case:>34} {r['ratio']:>6.2f} {r['copy']:>7.3f} {r['packed']:>7.3f} {r['symbol']:>7.3f} "
              f"{r['packed'] / r['symbol']:>7.2f}x   outputs equal", flush=True)
        torch.cuda.empty_cache()
    for n, T, D, step in WHOLE:
        r = whole(n, T, D, step)
        case = f"decode_many {n} x [{T}, {D}]"
        print(f"{case:>34} {r['ratio']:>6.2f} {r['copy']:>7.3f} {r['packed']:>7.3f} {r['symbol']:>7.3f} "
              f"{r['packed'] / r['symbol']:>7.2f}x   outputs equal", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU (it times the GPU decoder)")
    main()

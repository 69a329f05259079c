"""Would the GPU rANS decoder's table lookups run faster if the 32 lanes of a warp shared one component's table?

Today a warp's 32 lanes decode 32 consecutive components, so each step gathers 32 entries from 32 different
4 KB tables (a layer's 1025 tables: 4 MB per K or V, in L2, not L1); Nsight Compute says the lanes kernel
waits on the L1TEX pipe (docs/findings.md). This script isolates that gather. One warp a program, each lane
walks a chain of STEPS dependent lookups shaped like a decoder step (the state picks a slot, the entry gives
the next state), in three layouts of the same tables:

  spread    lane i of warp w reads table (32 w + i) % TABLES         (the format today)
  shared    every lane of warp w reads table w % TABLES               (one component a warp: a format change)
  gathered  as shared, the table loaded once into the warp's registers and read with tl.gather
            (Triton lowers a gather across lanes through shared memory)

All three compute the same kind of chain; each is checked against a torch reference of its own lanes, then
timed (CUDA events, median) and reported as lookups per ns.

Command:  python3 dev/lookup_locality.py      (an NVIDIA GPU; a few seconds)
"""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from staged_decode_sizes import timed  # noqa: E402  (CUDA events, median of its REPEATS)

TABLES = 2050          # tables (a layer's K and V: 2 x 1025 components)
SLOTS_LOG2 = 10        # slots a table (prob_bits 10: 4 KB of int32)
STEPS = 256            # dependent lookups a lane (PoC 17's lane length)
WARPS_TOTAL = 16384    # programs of one warp (a 64K layer's K and V: 2 x 8192 lane groups)


@triton.jit
def chain_kernel(lut_ptr, seed_ptr, out_ptr, TABLES, STEPS: tl.constexpr, SLOTS_LOG2: tl.constexpr,
                 LAYOUT: tl.constexpr):
    """LAYOUT 0 spread, 1 shared, 2 gathered (see the module docstring)."""
    M: tl.constexpr = 1 << SLOTS_LOG2
    w = tl.program_id(0)
    lane = tl.arange(0, 32)
    if LAYOUT == 0:
        table = (w * 32 + lane) % TABLES
    else:
        table = w % TABLES + tl.zeros([32], tl.int32)
    x = tl.load(seed_ptr + w * 32 + lane).to(tl.uint32) | 65536
    if LAYOUT == 2:
        whole = tl.load(lut_ptr + (w % TABLES) * M + tl.arange(0, M))
    acc = tl.zeros([32], tl.uint32)
    for i in range(STEPS):
        slot = (x & (M - 1)).to(tl.int32)
        if LAYOUT == 2:
            e = tl.gather(whole, slot, 0)
        else:
            e = tl.load(lut_ptr + table * M + slot)
        f = ((e >> SLOTS_LOG2) & (M - 1)).to(tl.uint32) + 1
        x = f * (x >> SLOTS_LOG2) + (e & (M - 1)).to(tl.uint32)
        x = tl.where(x < 65536, (x << 16) | (x & 0xFFFF) ^ 0x9E37, x)  # renormalize from a stand-in word
        acc ^= x
    tl.store(out_ptr + w * 32 + lane, acc.to(tl.int32, bitcast=True))


def reference(lut, seeds, layout: int, warps: int) -> torch.Tensor:
    """The same chains in torch (int64 arithmetic, wrapped to uint32), for the first `warps` programs."""
    M = 1 << SLOTS_LOG2
    w = torch.arange(warps, device=lut.device)[:, None]
    lane = torch.arange(32, device=lut.device)[None, :]
    table = (w * 32 + lane) % TABLES if layout == 0 else (w % TABLES).expand(-1, 32)
    x = (seeds[:warps * 32].view(warps, 32).long() & 0xFFFFFFFF) | 65536
    acc = torch.zeros_like(x)
    for _ in range(STEPS):
        e = lut.view(TABLES, M)[table, x & (M - 1)].long()
        x = ((((e >> SLOTS_LOG2) & (M - 1)) + 1) * (x >> SLOTS_LOG2) + (e & (M - 1))) & 0xFFFFFFFF
        x = torch.where(x < 65536, ((x << 16) | ((x & 0xFFFF) ^ 0x9E37)) & 0xFFFFFFFF, x)
        acc ^= x
    return acc.to(torch.int64).view(-1)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    M = 1 << SLOTS_LOG2
    freq = torch.randint(0, 64, (TABLES, M), generator=g, device="cuda", dtype=torch.int32)  # f - 1 of a slot's symbol
    slot_cum = torch.randint(0, M, (TABLES, M), generator=g, device="cuda", dtype=torch.int32)
    lut = ((freq << SLOTS_LOG2) | slot_cum).reshape(-1).contiguous()
    seeds = torch.randint(0, 2**31 - 1, (WARPS_TOTAL * 32,), generator=g, device="cuda", dtype=torch.int32)
    out = torch.empty_like(seeds)
    print(f"{torch.cuda.get_device_name()}: {WARPS_TOTAL} warps x 32 lanes x {STEPS} dependent lookups, "
          f"{TABLES} tables of {M} int32")
    for layout, name in enumerate(("spread", "shared", "gathered")):
        run = lambda: chain_kernel[(WARPS_TOTAL,)](lut, seeds, out, TABLES, STEPS, SLOTS_LOG2, layout, num_warps=1)
        run()
        torch.cuda.synchronize()
        want = reference(lut, seeds, layout, 64)
        got = out[:64 * 32].long() & 0xFFFFFFFF
        if not torch.equal(got, want & 0xFFFFFFFF):
            sys.exit(f"{name}: the kernel's chains differ from torch's")
        ms = timed(run)
        lookups = WARPS_TOTAL * 32 * STEPS
        print(f"  {name:>9}: {ms:7.3f} ms, {lookups / ms / 1e6:6.1f} lookups/ns   (matches torch)", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU (it times a GPU gather)")
    main()

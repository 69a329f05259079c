"""If a warp's 32 lanes shared one component's table (one component, 32 token blocks), where should they write?

dev/lookup_locality.py found the table lookups 6x faster when every lane of a warp reads one table. But the
decoder also writes one value a lane a step, and today's lanes (32 consecutive components of one token)
write 64 contiguous bytes of a [T, K] row. Lanes of one component over 32 token blocks write 32 values
that are S rows apart. This script times the lookup chain of lookup_locality.py plus that store, in the
layouts a format change could pick (one layer's K and V at 64K tokens: 2 x 1024 components, 256-token lanes):

  spread-rows     lanes = 32 components of one token block; store 2 B into [T, K] rows (today)
  shared-rows     lanes = 32 token blocks of one component;  store 2 B into [T, K] rows (S rows apart)
  shared-cols     the same lanes; store 2 B into [K, T] (one component's tokens contiguous)
  shared-cols4    the same lanes; four steps' values packed into one 8 B store into [K, T]
  shared-cols8    the same lanes; eight steps' values packed into one 16 B store into [K, T] (st.global.v4.b32,
                  the widest store sm_90 has: a warp's store is 32 half sectors, 4 requests a step where
                  shared-cols4 makes 8 and spread-rows 2)
  tile-rows       the same lanes, TILE warps a program (TILE consecutive components): the program's [TILE, 32]
                  values stored into [T, K] rows, which Triton lays out for contiguous stores through shared memory
                  (the lookups as in-place PTX loads, so only the stored values change layout; as the decoder)

Each variant is checked against a torch reference of its chains and of a sample of what it stored, then
timed (CUDA events, median).

Command:  python3 dev/decode_store_layout.py      (an NVIDIA GPU; a few seconds)
"""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from staged_decode_sizes import timed  # noqa: E402  (CUDA events, median of its REPEATS)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.codecs._rans_triton import load_in_place  # noqa: E402

COMPONENTS = 2048      # a layer's K and V components (tables: one each)
SLOTS_LOG2 = 10        # slots a table (prob_bits 10: 4 KB of int32)
STEPS = 256            # tokens a lane (PoC 17's lane length)
BLOCKS = 256           # token blocks (64K tokens / 256)
T = BLOCKS * STEPS     # tokens
LAYOUTS = ("spread-rows", "shared-rows", "shared-cols", "shared-cols4", "shared-cols8", "tile-rows")
TILE = 16              # tile-rows: components (warps) a program


@triton.jit
def _step(lut_ptr, table, x, SLOTS_LOG2: tl.constexpr, IN_PLACE: tl.constexpr = False):
    M: tl.constexpr = 1 << SLOTS_LOG2
    slot = (x & (M - 1)).to(tl.int32)
    if IN_PLACE:  # keeps the lanes' layout (see _rans_triton.load_in_place)
        e = load_in_place(lut_ptr + table * M + slot)
    else:
        e = tl.load(lut_ptr + table * M + slot)
    f = ((e >> SLOTS_LOG2) & (M - 1)).to(tl.uint32) + 1
    x = f * (x >> SLOTS_LOG2) + (e & (M - 1)).to(tl.uint32)
    x = tl.where(x < 65536, (x << 16) | (x & 0xFFFF) ^ 0x9E37, x)
    return x, (e >> 20).to(tl.int16)  # a stand-in symbol: the entry's top bits


@triton.jit
def store_16_bytes(ptrs, w0, w1, w2, w3):
    """Each lane's four int32 words to its 16-byte-aligned address: one st.global.v4.b32 (Triton stores a
    lane's values one by one unless it can prove them contiguous)."""
    return tl.inline_asm_elementwise(asm="st.global.v4.b32 [$1], {$2, $3, $4, $5}; mov.b32 $0, 0;",
                                     constraints="=r,l,r,r,r,r", args=[ptrs, w0, w1, w2, w3], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _two_steps(lut_ptr, table, x, acc, SLOTS_LOG2: tl.constexpr):
    """Two steps of the chain: the new state, the running xor, and their two stand-in symbols in one int32
    (the first in the low half)."""
    x, s0 = _step(lut_ptr, table, x, SLOTS_LOG2)
    acc ^= x
    x, s1 = _step(lut_ptr, table, x, SLOTS_LOG2)
    acc ^= x
    return x, acc, (s0.to(tl.int32) & 0xFFFF) | (s1.to(tl.int32) << 16)


@triton.jit
def chain_store_kernel(lut_ptr, seed_ptr, out_ptr, acc_ptr, K, T, STEPS: tl.constexpr, BLOCKS: tl.constexpr,
                       SLOTS_LOG2: tl.constexpr, LAYOUT: tl.constexpr):
    w = tl.program_id(0)
    lane = tl.arange(0, 32)
    if LAYOUT == 0:  # lanes: 32 components of one block
        k = (w * 32 + lane) % K
        p = (w * 32 // K) + tl.zeros([32], tl.int32)
    else:  # lanes: 32 blocks of one component
        k = (w // (BLOCKS // 32)) + tl.zeros([32], tl.int32)
        p = (w % (BLOCKS // 32)) * 32 + lane
    x = tl.load(seed_ptr + w * 32 + lane).to(tl.uint32) | 65536
    acc = tl.zeros([32], tl.uint32)
    if LAYOUT == 3:
        base = out_ptr.to(tl.pointer_type(tl.int64)) + (k.to(tl.int64) * T + p * STEPS) // 4
        for i in range(0, STEPS, 4):
            x, acc, w0 = _two_steps(lut_ptr, k, x, acc, SLOTS_LOG2)
            x, acc, w1 = _two_steps(lut_ptr, k, x, acc, SLOTS_LOG2)
            tl.store(base + i // 4, (w0.to(tl.int64) & 0xFFFFFFFF) | (w1.to(tl.int64) << 32))
    elif LAYOUT == 4:
        base = out_ptr.to(tl.pointer_type(tl.int32)) + (k.to(tl.int64) * T + p * STEPS) // 2
        for i in range(0, STEPS, 8):
            x, acc, w0 = _two_steps(lut_ptr, k, x, acc, SLOTS_LOG2)
            x, acc, w1 = _two_steps(lut_ptr, k, x, acc, SLOTS_LOG2)
            x, acc, w2 = _two_steps(lut_ptr, k, x, acc, SLOTS_LOG2)
            x, acc, w3 = _two_steps(lut_ptr, k, x, acc, SLOTS_LOG2)
            store_16_bytes(base + i // 2, w0, w1, w2, w3)
    else:
        if LAYOUT == 2:
            off = k.to(tl.int64) * T + p * STEPS
            row = 1
        else:
            off = (p * STEPS).to(tl.int64) * K + k
            row = K
        for i in range(STEPS):
            x, s = _step(lut_ptr, k, x, SLOTS_LOG2)
            acc ^= x
            tl.store(out_ptr + off, s)
            off += row
    tl.store(acc_ptr + w * 32 + lane, acc.to(tl.int32, bitcast=True))


@triton.jit
def chain_store_tile_kernel(lut_ptr, seed_ptr, out_ptr, acc_ptr, K, STEPS: tl.constexpr, BLOCKS: tl.constexpr,
                            SLOTS_LOG2: tl.constexpr, TILE: tl.constexpr):
    """shared-rows' lanes (warp w: component w // (BLOCKS / 32), blocks 32 (w % (BLOCKS / 32)) + lane), TILE
    such warps of consecutive components a program; values stored into [T, K] rows."""
    nb: tl.constexpr = BLOCKS // 32
    pid = tl.program_id(0)
    kk = tl.arange(0, TILE)[:, None]
    lane = tl.arange(0, 32)[None, :]
    k = (pid // nb) * TILE + kk + 0 * lane
    blk = pid % nb
    w = k * nb + blk  # the warp number of the same lanes in shared-rows
    x = tl.load(seed_ptr + w * 32 + lane).to(tl.uint32) | 65536
    acc = tl.zeros([TILE, 32], tl.uint32)
    base = ((blk * 32 + lane) * STEPS).to(tl.int64) * K + k
    for i in range(STEPS):
        x, s = _step(lut_ptr, k, x, SLOTS_LOG2, True)
        acc ^= x
        tl.store(out_ptr + base + i * K, s)
    tl.store(acc_ptr + w * 32 + lane, acc.to(tl.int32, bitcast=True))


def lanes_of(layout: int, warps: int, device):
    w = torch.arange(warps, device=device)[:, None]
    lane = torch.arange(32, device=device)[None, :]
    if layout == 0:
        return ((w * 32 + lane) % COMPONENTS), (w * 32 // COMPONENTS).expand(-1, 32)
    return (w // (BLOCKS // 32)).expand(-1, 32), (w % (BLOCKS // 32)) * 32 + lane


def reference(lut, seeds, layout: int, warps: int):
    """The first `warps` programs' chains in torch: their final xor and every stand-in symbol, [warps, 32, STEPS]."""
    M = 1 << SLOTS_LOG2
    k, _ = lanes_of(layout, warps, lut.device)
    x = (seeds[:warps * 32].view(warps, 32).long() & 0xFFFFFFFF) | 65536
    acc, syms = torch.zeros_like(x), []
    for _ in range(STEPS):
        e = lut.view(COMPONENTS, M)[k, x & (M - 1)].long()
        x = ((((e >> SLOTS_LOG2) & (M - 1)) + 1) * (x >> SLOTS_LOG2) + (e & (M - 1))) & 0xFFFFFFFF
        x = torch.where(x < 65536, ((x << 16) | ((x & 0xFFFF) ^ 0x9E37)) & 0xFFFFFFFF, x)
        acc ^= x
        syms.append((e >> 20).to(torch.int16))
    return acc, torch.stack(syms, -1)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    M = 1 << SLOTS_LOG2
    freq = torch.randint(0, 64, (COMPONENTS, M), generator=g, device="cuda", dtype=torch.int32)
    slot_cum = torch.randint(0, M, (COMPONENTS, M), generator=g, device="cuda", dtype=torch.int32)
    lut = ((freq << SLOTS_LOG2) | slot_cum).reshape(-1).contiguous()
    warps = COMPONENTS * BLOCKS // 32
    seeds = torch.randint(0, 2**31 - 1, (warps * 32,), generator=g, device="cuda", dtype=torch.int32)
    out = torch.empty(T * COMPONENTS, dtype=torch.int16, device="cuda")
    acc = torch.empty_like(seeds)
    print(f"{torch.cuda.get_device_name()}: {warps} warps x 32 lanes x {STEPS} steps (lookup + store), "
          f"{COMPONENTS} tables of {M} int32, {out.numel() * 2 / 1e6:.0f} MB written")
    for layout, name in enumerate(LAYOUTS):
        if name == "tile-rows":
            run = lambda: chain_store_tile_kernel[(warps // TILE,)](lut, seeds, out, acc, COMPONENTS, STEPS, BLOCKS,
                                                                    SLOTS_LOG2, TILE, num_warps=TILE)
            layout = 1  # the same lanes and stores as shared-rows: its reference
        else:
            run = lambda: chain_store_kernel[(warps,)](lut, seeds, out, acc, COMPONENTS, T, STEPS, BLOCKS, SLOTS_LOG2,
                                                       layout, num_warps=1)
        out.zero_()
        run()
        torch.cuda.synchronize()
        check = 16
        want_acc, want_syms = reference(lut, seeds, layout, check)
        if not torch.equal(acc[:check * 32].long() & 0xFFFFFFFF, want_acc.view(-1)):
            sys.exit(f"{name}: the kernel's chains differ from torch's")
        k, p = lanes_of(layout, check, out.device)
        i = torch.arange(STEPS, device=out.device)
        if layout <= 1:
            where = (p[..., None] * STEPS + i) * COMPONENTS + k[..., None]
        else:
            where = k[..., None] * T + p[..., None] * STEPS + i
        if not torch.equal(out[where], want_syms):
            sys.exit(f"{name}: the stored symbols are not where this layout puts them")
        ms = timed(run)
        print(f"  {name:>12}: {ms:7.3f} ms, {out.numel() / ms / 1e6:6.1f} values/ns   (matches torch)", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU (it times GPU lookups and stores)")
    main()

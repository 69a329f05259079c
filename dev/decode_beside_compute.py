"""Does a spilled layer's decode overlap the dense compute of the layer before it, and does stream priority help?

In a KV-spill decode step (PoC 17) layer i's dense parts run on the compute stream while layer i+1's KV is
copied to the GPU and decoded on side streams. Both the dense parts (batch-1 GEMVs reading ~1 GB of weights,
HBM-bound) and the rANS decoder (L1-bound table lookups) want every streaming multiprocessor; if their
blocks do not share the SMs, a layer costs their sum, not their maximum. This times the pattern alone:
one 32B-class layer's dense parts (a CUDA graph: QKV, Wo, gate/up and down GEMVs for one token) beside one
layer's K and V decoded to coefficient rows (one StagedDecode graph of by-component lanes, at a step that
gives the KV codec's ~6x), the next layer's compressed bytes crossing on a copy stream, for LAYERS layers in
the pipelined order (decode i+1 beside dense i; decode i+2 waits for dense i, as a two-slot ring does), with
the side streams at default priority, the decode at high priority, or the dense compute at high priority.

Command:  python3 dev/decode_beside_compute.py      (an NVIDIA GPU; about a minute)
Output (an NVIDIA H100 80GB HBM3): the pipelined layer costs the sum of the dense parts and the decode, whichever
stream has priority; the two do not share the SMs, and priority changes the layer by about 1%:
    NVIDIA H100 80GB HBM3: 32768 tokens, ratio 5.54x; per layer: dense 0.334 ms (2922 GB/s of weights), decode 0.461 ms, copy 0.441 ms; their sum 0.795, max 0.461
        pipelined, default      : 0.830 ms a layer
        pipelined, decode high  : 0.821 ms a layer
        pipelined, compute high : 0.822 ms a layer
    NVIDIA H100 80GB HBM3: 65536 tokens, ratio 5.54x; per layer: dense 0.334 ms (2916 GB/s of weights), decode 0.802 ms, copy 0.879 ms; their sum 1.137, max 0.879
        pipelined, default      : 1.119 ms a layer
        pipelined, decode high  : 1.106 ms a layer
        pipelined, compute high : 1.131 ms a layer
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import symbol_lookup  # noqa: E402
from staged_decode_sizes import timed  # noqa: E402  (CUDA events, median)
from shared.pipeline import StagedDecode  # noqa: E402

CONTEXTS = [32768, 65536]    # tokens of one layer's K and V
STEP = 0.61                  # quantization step: PoC 17's KV codec setting scales the 0.14 of cos 0.9992 by ~4.4
HIDDEN, KV_DIM, MLP = 5120, 1024, 27648   # the 32B-class layer of PoC 17
LAYERS = 48                  # layers a timed pass runs
REPEATS = 7                  # timed passes (median)
HIGH = -1                    # torch's high stream priority (lower is higher)


def dense_graph():
    """One token through one layer's dense parts, replayed as a CUDA graph (weights ~1 GB, read once a replay)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = {name: (torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.01)
         for name, shape in dict(qkv=(HIDDEN, HIDDEN + 2 * KV_DIM), o=(HIDDEN, HIDDEN), gate_up=(HIDDEN, 2 * MLP),
                                 down=(MLP, HIDDEN)).items()}
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def layer():
        qkv = x @ w["qkv"]
        h = qkv[:, :HIDDEN] @ w["o"]
        gu = h @ w["gate_up"]
        return (torch.nn.functional.silu(gu[:, :MLP]) * gu[:, MLP:]) @ w["down"]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    nbytes = sum(t.numel() * 2 for t in w.values())
    return graph, nbytes, w


def decode_plan(context: int, stream):
    symbol_lookup.STEP_KV = STEP
    layer = symbol_lookup.staged_layer(context, context, True)   # one container per K and V, lanes by component
    coeff = [torch.empty(context, layer.width, dtype=torch.bfloat16, device="cuda") for _ in layer.blobs]
    plan = StagedDecode(layer.codecs, layer.heads, [b.numel() for b in layer.blobs], layer.offsets, layer.stage,
                        coeff, reconstruct=False, stream=stream)
    with torch.cuda.stream(stream):
        plan.replay()
    torch.cuda.synchronize()
    plan.check()
    reference = [c.clone() for c in coeff]
    return plan, layer, coeff, reference


def per_layer(run) -> float:
    """Median ms a layer over REPEATS passes of run(), each pass LAYERS layers."""
    return timed(run, REPEATS) / LAYERS


def main() -> None:
    device = torch.cuda.get_device_name()
    dense, dense_bytes, _weights = dense_graph()
    for context in CONTEXTS:
        streams = {"default": (torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()),
                   "decode high": (torch.cuda.Stream(), torch.cuda.Stream(priority=HIGH), torch.cuda.Stream()),
                   "compute high": (torch.cuda.Stream(priority=HIGH), torch.cuda.Stream(), torch.cuda.Stream())}
        plans = {name: decode_plan(context, s[1]) for name, s in streams.items()}
        first = next(iter(plans.values()))[3]
        for name, (_, _, _, reference) in plans.items():
            if not all(torch.equal(a, b) for a, b in zip(first, reference)):
                raise SystemExit(f"{name}: decoded rows differ")
        layer = next(iter(plans.values()))[1]
        landing = torch.empty_like(layer.stage)   # the next layer's bytes land here (the other staging buffer)

        def dense_only():
            for _ in range(LAYERS):
                dense.replay()

        def decode_only():
            for _ in range(LAYERS):
                plans["default"][0].replay()

        def pipelined(name):
            compute, decode, copy = streams[name]
            plan = plans[name][0]
            main = torch.cuda.current_stream()
            done = [torch.cuda.Event() for _ in range(LAYERS)]
            decoded = [torch.cuda.Event() for _ in range(LAYERS + 1)]
            compute.wait_stream(main)
            decode.wait_stream(main)
            copy.wait_stream(main)
            with torch.cuda.stream(decode):
                plan.replay()
                decoded[0].record()
            for i in range(LAYERS):
                with torch.cuda.stream(copy):        # the next layer's compressed bytes cross
                    landing[:layer.total].copy_(layer.host, non_blocking=True)
                with torch.cuda.stream(decode):     # decode i+1 beside dense i; a two-slot ring waits for dense i-1
                    if i:
                        decode.wait_event(done[i - 1])
                    decode.wait_stream(copy)
                    plan.replay()
                    decoded[i + 1].record()
                with torch.cuda.stream(compute):
                    compute.wait_event(decoded[i])
                    dense.replay()
                    done[i].record()
            for s in (compute, decode, copy):
                main.wait_stream(s)

        t_dense = per_layer(dense_only)
        torch.cuda.synchronize()
        with torch.cuda.stream(streams["default"][1]):  # the stream its graph was captured for
            t_decode = per_layer(decode_only)
        copy_ms = per_layer(lambda: [landing[:layer.total].copy_(layer.host, non_blocking=True) for _ in range(LAYERS)])
        print(f"{device}: {context} tokens, ratio {2 * context * KV_DIM * 2 / layer.total:.2f}x; per layer: dense "
              f"{t_dense:.3f} ms ({dense_bytes / t_dense / 1e6:.0f} GB/s of weights), decode {t_decode:.3f} ms, "
              f"copy {copy_ms:.3f} ms; their sum {t_dense + t_decode:.3f}, max {max(t_dense, t_decode, copy_ms):.3f}",
              flush=True)
        for name in streams:
            ms = per_layer(lambda: pipelined(name))
            plans[name][0].check()
            print(f"    pipelined, {name:13s}: {ms:.3f} ms a layer", flush=True)
        for name, (plan, _, coeff, reference) in plans.items():
            if not all(torch.equal(a, b) for a, b in zip(coeff, reference)):
                raise SystemExit(f"{name}: rows changed after the timed passes")
        plans.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU")
    main()

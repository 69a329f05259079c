"""PoC 12 - Does codec work overlap with model compute: a GEMM loop on one CUDA stream, decoding on another?

The original write-up ran a GEMM loop (30 x 4096^2 fp16) beside NVENC encoding and got 67% of the ideal overlap.
This GPU (an NVIDIA H200) has no NVENC, so the codec side here is decoding:

  nvdec-hevc   NVDEC decodes 64 frames of 256x256 (x265 lossless streams, from memory) into CUDA
               tensors. NVDEC is a separate engine: only the copy out of its surfaces uses the SMs.
  nvcomp-ans   nvCOMP ANS decodes the same planes on the SMs, the resource the GEMM needs too;
               repeated until it takes about as long alone as the GEMM loop (for a fair contrast).

For each: the GEMM loop alone, the codec alone, both one after the other (serialized), both at
once on two streams (parallel), and the floor max(GEMM, codec). Share of the ideal overlap =
(serialized - parallel) / (serialized - floor): 100% means the shorter job hid completely.
Decoded frames are checked bit-exact before timing, and again after the parallel runs; the GEMM
result is checked against a float32 product. Wall clock around each case with
torch.cuda.synchronize() (NVDEC's engines sit outside the CUDA streams), median of repeats.

Command:   make poc-12            (or: python pocs/12_overlap.py [--quick] [--frames 64] [--iters 30])
Writes:    results/12_overlap.csv, figures/12_overlap.png
Sample output (an NVIDIA H200, --codecs nvcomp; the nvdec line needs PyNvVideoCodec and PyAV there):
    GEMM 30 x 4096^2 fp16: relative error vs float32 2.1e-04 (matches)
    nvcomp-ans: decode bit-exact (matches), ratio 1.66; 0.291 ms per decode, repeated 19x to match the GEMM loop
    nvcomp-ans  gemm 6.38 ms  codec 4.34 ms  serialized 10.13  parallel 8.33  floor 6.38  -> 48% of ideal overlap
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.codecs import get_backend  # noqa: E402
from shared.results import ResultsWriter, apply_style, load, save_figure  # noqa: E402
from shared.sources import benchmark_frames  # noqa: E402
from shared.timing import wall_ms  # noqa: E402

GEMM_N = 4096          # square GEMM side (the original write-up's)
GEMM_ITERS = 30        # GEMMs per loop (the original write-up's)
FRAMES = 64            # frames decoded per codec run (the original write-up's)
FRAME = 256            # frame side, pixels
REPEATS = 7            # timed runs per case (median), after one untimed
NVCOMP_ALGO = "nvcomp-ans"
X265_PRESET = "ultrafast"
SOURCE = "llm_kv"       # real planes if exported (make planes), else synthetic (labelled)
SEED = 0


def measure(torch, gemm, codec, repeats: int) -> dict:
    gemm_ms = wall_ms(gemm, repeats, sync=torch.cuda.synchronize)
    codec_ms = wall_ms(codec, repeats, sync=torch.cuda.synchronize)

    def serialized():
        gemm()
        torch.cuda.synchronize()
        codec()

    def parallel():
        gemm()  # queued on its stream; the host goes straight on to the codec
        codec()

    serial_ms = wall_ms(serialized, repeats, sync=torch.cuda.synchronize)
    parallel_ms = wall_ms(parallel, repeats, sync=torch.cuda.synchronize)
    floor_ms = max(gemm_ms, codec_ms)
    share = (serial_ms - parallel_ms) / (serial_ms - floor_ms) if serial_ms > floor_ms else float("nan")
    return {"gemm_ms": gemm_ms, "codec_ms": codec_ms, "serialized_ms": serial_ms, "parallel_ms": parallel_ms,
            "floor_ms": floor_ms, "overlap_share": 100 * share}


def run(args) -> ResultsWriter | None:
    import torch

    if not torch.cuda.is_available():
        print("PoC 12 needs a CUDA GPU (it overlaps GPU work); nothing to measure on this machine")
        return None
    res = ResultsWriter("12", "overlap", gpu=True)
    gemm_stream, codec_stream = torch.cuda.Stream(), torch.cuda.Stream()
    g = torch.Generator(device="cuda").manual_seed(SEED)
    a = torch.randn(args.gemm_n, args.gemm_n, device="cuda", dtype=torch.float16, generator=g)
    b = torch.randn(args.gemm_n, args.gemm_n, device="cuda", dtype=torch.float16, generator=g)
    c = torch.empty_like(a)

    def gemm():
        with torch.cuda.stream(gemm_stream):
            for _ in range(args.iters):
                torch.matmul(a, b, out=c)

    gemm()
    torch.cuda.synchronize()
    ref = a[:64].float() @ b.float()
    err = ((c[:64].float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        raise AssertionError(f"fp16 GEMM differs from the float32 product by {err:.2e}")
    print(f"GEMM {args.iters} x {args.gemm_n}^2 fp16: relative error vs float32 {err:.1e} (matches)")

    frames, source = benchmark_frames(FRAME, args.frames, SOURCE, SEED)
    print(f"frames: {args.frames} of {FRAME}x{FRAME}, planes: {source}")
    frames_gpu = torch.from_numpy(frames).cuda()
    common = dict(source=source, gemm_n=args.gemm_n, gemm_iters=args.iters, frames=args.frames, frame_size=FRAME,
                  gemm_dtype="float16", timing="wall+synchronize", repeats=args.repeats)
    results = {}

    nvdec = get_backend("nvdec-hevc")
    reason = nvdec.unavailable_reason() if "nvdec" in args.codecs else "not selected (--codecs)"
    if reason is None:
        with get_backend("x265").encoder(FRAME, FRAME, qp=None, preset=X265_PRESET) as enc:
            enc.submit(frames)
            stream = enc.flush()
        with nvdec.decoder(FRAME, FRAME, stream=codec_stream) as dec:
            def decode_nvdec():
                dec.submit(stream)
                return dec.flush_cuda()

            out = decode_nvdec()
            torch.cuda.synchronize()
            if not torch.equal(out, frames_gpu):
                raise AssertionError("NVDEC decode of the x265 lossless stream is not bit-exact")
            print(f"nvdec-hevc: {args.frames} frames of {FRAME}x{FRAME} decode bit-exact (matches)")
            results["nvdec-hevc"] = measure(torch, gemm, decode_nvdec, args.repeats)
            last = decode_nvdec()
            gemm()
            torch.cuda.synchronize()
            if not torch.equal(last, frames_gpu):
                raise AssertionError("NVDEC output differs after running beside the GEMM loop")
        results["nvdec-hevc"].update(settings=dict(common, stream_bytes=len(stream), codec_work=f"{args.frames} frames"))
    elif "nvdec" in args.codecs:
        print(f"nvdec-hevc not available: {reason}")
        res.add(backend="nvdec-hevc", metric="available", value=0.0, unit="bool", reason=reason, **common)

    nvcomp = get_backend(NVCOMP_ALGO)
    reason = nvcomp.unavailable_reason() if "nvcomp" in args.codecs else "not selected (--codecs)"
    if reason is None:
        from shared.codecs.nvcomp import gpu_coder

        coder = gpu_coder(NVCOMP_ALGO)
        flat = frames_gpu.reshape(-1)
        payload, out = coder.checked_round_trip(flat, codec_stream)
        def decode_once():
            with torch.cuda.stream(codec_stream):
                coder.decode_cuda(payload, out=out)

        one_ms = wall_ms(decode_once, args.repeats, sync=torch.cuda.synchronize)
        gemm_alone = wall_ms(gemm, args.repeats, sync=torch.cuda.synchronize)
        reps = max(1, round(gemm_alone / one_ms))
        print(f"{NVCOMP_ALGO}: decode bit-exact (matches), ratio {flat.numel() / payload.numel():.2f}; "
              f"{one_ms:.3f} ms per decode, repeated {reps}x to match the GEMM loop")

        def decode_nvcomp():
            with torch.cuda.stream(codec_stream):
                for _ in range(reps):
                    coder.decode_cuda(payload, out=out)

        results[NVCOMP_ALGO] = measure(torch, gemm, decode_nvcomp, args.repeats)
        out.zero_()
        gemm()
        decode_nvcomp()
        torch.cuda.synchronize()
        if not torch.equal(out, flat):
            raise AssertionError(f"{NVCOMP_ALGO} output differs after running beside the GEMM loop")
        results[NVCOMP_ALGO].update(settings=dict(common, nvcomp_decodes=reps, payload_bytes=payload.numel(),
                                                  codec_work=f"{reps} decodes of {args.frames} frames"))
    elif "nvcomp" in args.codecs:
        print(f"{NVCOMP_ALGO} not available: {reason}")
        res.add(backend=NVCOMP_ALGO, metric="available", value=0.0, unit="bool", reason=reason, **common)

    for backend, r in results.items():
        settings = r.pop("settings")
        for metric, value in r.items():
            res.add(backend=backend, metric=metric, value=value, unit="%" if metric == "overlap_share" else "ms",
                    **settings)
        print(f"{backend:11s} gemm {r['gemm_ms']:.2f} ms  codec {r['codec_ms']:.2f} ms  serialized "
              f"{r['serialized_ms']:.2f}  parallel {r['parallel_ms']:.2f}  floor {r['floor_ms']:.2f}  -> "
              f"{r['overlap_share']:.0f}% of ideal overlap")
    return res


def plot(csv: str = "12_overlap", name: str = "12_overlap"):
    plt = apply_style()
    df = load(csv)
    from shared.results import legend_outside

    share = df[df.metric == "overlap_share"].set_index("backend").value
    df = df[df.metric.isin(["gemm_ms", "codec_ms", "serialized_ms", "parallel_ms", "floor_ms"])]
    backends = list(dict.fromkeys(df.backend))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    metrics = {"gemm_ms": "GEMM loop alone", "codec_ms": "codec alone", "serialized_ms": "one after the other",
               "parallel_ms": "on two streams", "floor_ms": "floor: max(GEMM, codec)"}
    width = 0.8 / len(metrics)
    for i, (metric, label) in enumerate(metrics.items()):
        vals = [df[(df.backend == b) & (df.metric == metric)].value.iloc[0] for b in backends]
        ax.bar(np.arange(len(backends)) + i * width, vals, width, label=label,
               hatch="//" if metric == "floor_ms" else None, edgecolor="white")
    for j, b in enumerate(backends):
        top = df[df.backend == b].value.max()
        ax.text(j + 2 * width, top * 1.03, f"{share.get(b, float('nan')):.0f}% of the ideal overlap", ha="center",
                fontsize=8)
    ax.set_xticks(np.arange(len(backends)) + 2 * width)
    ax.set_xticklabels(backends)
    ax.set_ylabel("wall time (ms)")
    ax.set_ylim(top=df.value.max() * 1.15)
    ax.set_title(f"a GEMM loop beside decoding on another stream ({df.device.iloc[0]}); "
                 "the original write-up: 67% (NVENC encode, another GPU)", fontsize=9)
    legend_outside(ax)
    fig.suptitle("PoC 12: beside a GEMM, decoding hides " + " and ".join(f"{share[b]:.0f}% ({b})" for b in backends
                                                                       if b in share)
                 + " of the ideal overlap", x=0.02, ha="left", fontsize=10.5)
    save_figure(fig, name, f"{csv}.csv")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (still needs a GPU)")
    ap.add_argument("--gemm-n", type=int, default=GEMM_N)
    ap.add_argument("--iters", type=int, default=GEMM_ITERS)
    ap.add_argument("--frames", type=int, default=FRAMES)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--codecs", default="nvdec,nvcomp", help="which codec sides to run (comma-separated)")
    ap.add_argument("--merge", action="store_true",
                    help="replace only this run's codecs in an existing CSV (runs split by the wheels they need)")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    args = ap.parse_args()
    if args.quick:
        args.gemm_n, args.iters, args.frames, args.repeats = 1024, 4, 8, 2
    if not args.plot_only:
        res = run(args)
        if res is None:
            sys.exit(0)
        if args.merge and res.path.exists():  # keep the other codec's rows from an earlier run
            import pandas as pd

            new = res.frame()
            old = pd.read_csv(res.path, dtype={"poc": str})
            res.save(frame=pd.concat([old[~old.backend.isin(set(new.backend))], new]))
        else:
            res.save()
    plot()

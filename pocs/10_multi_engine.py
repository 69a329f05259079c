"""PoC 10 - How does NVDEC decode throughput scale with the number of concurrent decoder sessions?

The GPU's hardware decoders (GetDecoderCaps reports how many engines decode HEVC 4:4:4) are fed
libx265-lossless HEVC 4:4:4 streams of PCA-like uint8 planes straight from memory; each session is a
persistent NVDEC decoder in its own thread with its own CUDA stream, and the frames land in torch
CUDA tensors (shared.codecs.nvdec.MultiDecoder). For 1 to 2x the engine count sessions and frame
sizes 256, 1024 and 2048, it reports GB/s of decoded planes, GB/s of the bf16 bytes those planes
stand for, ms per frame (aggregate and per session) and GB/s per busy engine. Every size is first
decoded once and compared with its source planes ("matches"); nothing is timed before that.
NVENC scaling is not measured: the NVIDIA H200 has no NVENC.

Planes are real when `python -m shared.sources export` has been run (SmolLM2-135M K and V of 7
layers, each in its own PCA basis, K=128, per-channel uint8; label source="real llm_kv"), cycled when
a stream needs more than were exported (the label says by how much; streams are intra-only so no
frame is predicted from an identical earlier one); otherwise synthetic PCA-like planes
(shared.sources.synthetic_planes, labelled source=synthetic). Decode speed depends on the bitrate,
so each row carries the payload bytes/frame. Timing is wall clock around a whole multi-session
pass with the GPU synchronized on both sides (the engines are driven by host threads), median of
repeats after a warm-up pass.

Command:   make poc-10            (or: python pocs/10_multi_engine.py [--quick] [--sizes 256 2048] [--sessions 1 7 14])
Writes:    results/10_multi_engine.csv (on a machine with NVDEC; elsewhere it says why and writes nothing)
Sample output (NVIDIA H200, 7 NVDEC engines, driver 580, PyNvVideoCodec 2.2.4):
    frame 2048: x265 lossless 7.77 MB/frame (planes ratio 1.62x, ...); decoded 8/8 frames: matches
     size sessions  GB/s planes  GB/s bf16  ms/frame  ms/frame/sess  GB/s/engine
      256        1         0.28       0.55     0.710          0.710         0.28
      256       14         1.49       2.97     0.132          1.852         0.21
     2048        1         0.35       0.69    36.307         36.307         0.35
     2048        7         2.39       4.78     5.266         36.862         0.34
     2048       14         2.45       4.90     5.133         71.858         0.35
    best: 2.45 GB/s of planes (4.90 GB/s bf16) at 2048x2048 with 14 sessions on 7 engines
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.codecs import get_backend  # noqa: E402
from shared.codecs import nvdec  # noqa: E402
from shared.results import ResultsWriter, apply_style, load, save_figure  # noqa: E402
from shared.sources import benchmark_frames  # noqa: E402

FRAME_SIZES = [256, 1024, 2048]                 # frame side, pixels
FRAMES_PER_STREAM = {256: 64, 1024: 16, 2048: 8}  # frames in one x265 stream (one payload)
STREAMS_PER_SESSION = 2                         # payloads each session decodes per timed pass
SESSIONS = None                                 # None: 1, 2, 4, engines, engines+1, ..., 2 x engines
REPEATS = 3                                     # timed passes per point (median reported), after 1 warm-up
X265_PRESET = "ultrafast"                       # x265 preset of the lossless streams (decode cost depends on bitrate)
BF16_BYTES_PER_PLANE_BYTE = 2.0                 # one uint8 coefficient stands for one bf16 value (K = D)
SOURCE = "llm_kv"                               # real planes if exported (shared.sources), else synthetic
SEED = 0


def x265_lossless(frames: np.ndarray) -> bytes:
    with get_backend("x265").encoder(frames.shape[3], frames.shape[2], qp=None, preset=X265_PRESET,
                                     intra=True) as enc:
        enc.submit(frames)
        return enc.flush()


def session_counts(engines: int) -> list[int]:
    counts = {1, 2, 4, engines, engines + 1, 3 * engines // 2, 2 * engines}
    return sorted(c for c in counts if 1 <= c <= 2 * engines)


def timed_pass(multi, payloads) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = multi.decode(payloads)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    del outs
    return elapsed


def run(sizes, sessions_list, frames_per_stream, streams_per_session, repeats) -> ResultsWriter | None:
    import torch

    reason = nvdec.probe()
    if reason is not None:
        print(f"NVDEC unavailable here: {reason}\nresults/10_multi_engine.csv left as it is (GPU results come "
              "from the GPU machine)")
        return None
    engines = nvdec.engine_count()
    gpu = nvdec.gpu_name()
    sessions_list = sessions_list or session_counts(engines)
    print(f"{gpu}: GetDecoderCaps reports {engines} NVDEC engines for HEVC 4:4:4 8-bit; sessions {sessions_list}")
    res = ResultsWriter("10", "multi_engine", gpu=True)
    res.add(backend="nvdec-hevc", metric="engines", value=engines, unit="count", source="GetDecoderCaps")
    print(f"{'size':>5}{'sessions':>9}{'GB/s planes':>13}{'GB/s bf16':>11}{'ms/frame':>10}"
          f"{'ms/frame/sess':>15}{'GB/s/engine':>13}")
    for size in sizes:
        n_frames = frames_per_stream[size]
        frames, source = benchmark_frames(size, n_frames, SOURCE, SEED + size)
        t0 = time.perf_counter()
        payload = x265_lossless(frames)
        encode_s = time.perf_counter() - t0
        frame_bytes = frames[0].nbytes
        plane_ratio = frames.nbytes / len(payload)
        with get_backend("nvdec-hevc").decoder(size, size) as dec:
            dec.submit(payload)
            decoded = dec.flush_cuda()
            exact = bool(torch.equal(decoded, torch.from_numpy(frames).to(decoded.device)))
        print(f"frame {size}: x265 lossless {len(payload) / n_frames / 1e6:.2f} MB/frame (planes ratio "
              f"{plane_ratio:.2f}x, encoded in {encode_s:.1f} s on the CPU); decoded {len(decoded)}/{n_frames} "
              f"frames: {'matches' if exact else 'MISMATCH'}")
        if not exact:
            raise AssertionError(f"NVDEC output differs from the source planes at {size}x{size}")
        common = dict(source=source, frame=size, frames_per_stream=n_frames, preset=X265_PRESET,
                      payload_bytes_per_frame=len(payload) / n_frames, plane_ratio=plane_ratio)
        res.add(backend="nvdec-hevc", metric="exact", value=1, unit="bool", sessions=1, **common)
        for n in sessions_list:
            payloads = [payload] * (n * streams_per_session)
            with nvdec.MultiDecoder(size, size, sessions=n) as multi:
                timed_pass(multi, payloads)  # warm-up: first-use costs of sessions and allocator
                times = [timed_pass(multi, payloads) for _ in range(repeats)]
            seconds = float(np.median(times))
            total_frames = n_frames * len(payloads)
            planes_gbps = total_frames * frame_bytes / seconds / 1e9
            row = dict(sessions=n, engines=engines, streams_per_session=streams_per_session, repeats=repeats, **common)
            res.add(backend="nvdec-hevc", metric="throughput_planes", value=planes_gbps, unit="GB/s", **row)
            res.add(backend="nvdec-hevc", metric="throughput_bf16", value=planes_gbps * BF16_BYTES_PER_PLANE_BYTE,
                    unit="GB/s", bf16_bytes_per_plane_byte=BF16_BYTES_PER_PLANE_BYTE, **row)
            res.add(backend="nvdec-hevc", metric="ms_per_frame", value=seconds / total_frames * 1e3, unit="ms", **row)
            res.add(backend="nvdec-hevc", metric="ms_per_frame_per_session",
                    value=seconds / (total_frames / n) * 1e3, unit="ms", **row)
            res.add(backend="nvdec-hevc", metric="throughput_planes_per_engine",
                    value=planes_gbps / min(n, engines), unit="GB/s", **row)
            print(f"{size:>5}{n:>9}{planes_gbps:>13.2f}{planes_gbps * BF16_BYTES_PER_PLANE_BYTE:>11.2f}"
                  f"{seconds / total_frames * 1e3:>10.3f}{seconds / (total_frames / n) * 1e3:>15.3f}"
                  f"{planes_gbps / min(n, engines):>13.2f}", flush=True)
    best = max((r for r in res.rows if r["metric"] == "throughput_planes"), key=lambda r: r["value"])
    print(f"best: {best['value']:.2f} GB/s of planes ({best['value'] * BF16_BYTES_PER_PLANE_BYTE:.2f} GB/s bf16) at "
          f"{best['frame']}x{best['frame']} with {best['sessions']} sessions on {engines} engines")
    return res


def plot(csv: str = "10_multi_engine", name: str = "10_multi_engine"):
    plt = apply_style()
    df = load(csv)
    engines = int(df[df.metric == "engines"].value.iloc[0])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.3))
    from shared.results import series_style

    for ax, metric in ((ax1, "throughput_planes"), (ax2, "ms_per_frame")):
        for i, (size, s) in enumerate(df[df.metric == metric].groupby("frame")):
            ax.plot(s.sessions, s.value, "-", **series_style(i), label=f"{int(size)}x{int(size)}")
    for ax in (ax1, ax2):
        ax.axvline(engines, color="0.5", ls=":", lw=1)
        ax.text(engines, ax.get_ylim()[1], f" {engines} engines", va="top", fontsize=8, color="0.4")
        ax.set_xlabel("concurrent NVDEC sessions (count, one thread each)")
    ax1.set_ylabel("throughput (GB/s of decoded uint8 planes)")
    ax1.set_title("aggregate decode throughput")
    ax2.set_yscale("log")
    ax2.set_ylabel("time per frame, aggregate (ms, log)")
    ax2.set_title("time per frame")
    from shared.results import legend_outside

    legend_outside(ax2, title="frame (pixels)")
    src = df[df.metric == "throughput_planes"].source.iloc[0]
    tp = df[df.metric == "throughput_planes"]
    one, best = tp[tp.sessions == 1].value.max(), tp.value.max()
    fig.suptitle(f"PoC 10: NVDEC scales with sessions up to its {engines} engines: {one:.2f} -> {best:.2f} GB/s",
                 x=0.02, ha="left")
    ax1.annotate(f"{df.device.iloc[0]}, HEVC 4:4:4 lossless; planes: {src}", (0.99, 0.02), xycoords="axes fraction",
                 ha="right", fontsize=7, color="0.4")
    save_figure(fig, name, f"{csv}.csv")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run: 256 and 1024 frames, sessions 1/2/engines")
    ap.add_argument("--sizes", type=int, nargs="+", help=f"frame sides (default {FRAME_SIZES})")
    ap.add_argument("--sessions", type=int, nargs="+", help="session counts (default 1..2 x engines)")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="timed passes per point")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    args = ap.parse_args()
    if args.plot_only:
        plot()
        sys.exit(0)
    sizes = args.sizes or ([256, 1024] if args.quick else FRAME_SIZES)
    per_stream = {s: FRAMES_PER_STREAM.get(s, 8) for s in sizes}
    sessions = args.sessions
    if args.quick:
        per_stream = {s: min(per_stream[s], 8) for s in sizes}
        if sessions is None and nvdec.probe() is None:
            sessions = sorted({1, 2, nvdec.engine_count()})
    result = run(sizes, sessions, per_stream, 1 if args.quick else STREAMS_PER_SESSION, 1 if args.quick else args.repeats)
    if result is not None:
        result.save()
        plot()

"""PoC 08 - Where does the FFmpeg-subprocess baseline spend its time?

The usual way to put tensors through a video codec is one `ffmpeg` process per call, frames through
pipes. Its wall time per call splits into: process spawn (start an ffmpeg that does nothing),
codec initialisation (the fixed cost of a call beyond the spawn), and real coding (the per-frame
slope). We time calls of N = 1..64 frames, fit time = fixed + N * per_frame by least squares, and
compare with the in-process PyAV session (`x265` backend) on the same frames. Both paths must
produce bit-exact lossless round trips of the frames first.

Command:   make poc-08            (or: python pocs/08_subprocess_overhead.py [--quick])
Writes:    results/08_subprocess_overhead.csv, figures/08_subprocess_overhead.png
Sample output (full run on a 2-core CPU machine busy with other jobs, so its timings are noisy):
    frames: 64 of 256x256, planes: synthetic
    lossless round trips (subprocess and in-process): bit-exact, matches
    ffmpeg spawn (ffmpeg -version): 59.7 ms per call
    encode ffmpeg-x265  fixed   294.4 ms +  10.88 ms/frame
    decode ffmpeg-x265  fixed    80.0 ms +   0.97 ms/frame
    encode x265         fixed   167.8 ms +   9.04 ms/frame
    decode x265         fixed     6.0 ms +   5.09 ms/frame
    in-process session vs subprocess, encode: 1 frames 1.05x, 2 frames 5.74x, 4 frames 1.72x, 8 frames 1.81x, 16 frames 0.88x, 32 frames 0.95x, 64 frames 1.47x
    in-process session vs subprocess, decode: 1 frames 37.77x, 2 frames 3.23x, 4 frames 4.74x, 8 frames 0.86x, 16 frames 1.53x, 32 frames 0.69x, 64 frames 0.40x
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.codecs import get_backend  # noqa: E402
from shared.codecs.ffmpeg_subprocess import ffmpeg_binary  # noqa: E402
from shared.results import ResultsWriter, announce, apply_style, load, save_figure  # noqa: E402
from shared.sources import benchmark_frames  # noqa: E402
from shared.timing import wall_ms  # noqa: E402

FRAME = 256                       # frame side, pixels
FRAME_COUNTS = [1, 2, 4, 8, 16, 32, 64]  # frames per call
REPEATS = 5                       # timed calls per point (median reported)
QP = 18                           # constant QP (the original write-up's speed setting); lossless checked separately
PRESET = "ultrafast"              # x265 preset: the fastest, so fixed costs show most plainly
SOURCE = "llm_kv"       # real planes if exported (make planes), else synthetic (labelled)
SEED = 0


def roundtrip(backend, frames, settings) -> tuple[bytes, np.ndarray]:
    with backend.encoder(FRAME, FRAME, preset=PRESET, **settings) as enc:
        enc.submit(frames)
        payload = enc.flush()
    with backend.decoder(FRAME, FRAME) as dec:
        dec.submit(payload)
        return payload, dec.flush()


def run(quick: bool) -> ResultsWriter:
    announce("08")
    global FRAME
    counts, repeats = ([1, 4, 8], 2) if quick else (FRAME_COUNTS, REPEATS)
    FRAME = 64 if quick else FRAME
    frames, source = benchmark_frames(FRAME, max(counts), SOURCE, SEED)
    print(f"frames: {max(counts)} of {FRAME}x{FRAME}, planes: {source}")
    sub, inproc = get_backend("ffmpeg-x265"), get_backend("x265")
    sub.require()
    inproc.require()

    # correctness first: both paths lossless and bit-exact, and they make the same kind of stream
    for backend in (sub, inproc):
        _, out = roundtrip(backend, frames[:4], {"qp": None})
        if not np.array_equal(out, frames[:4]):
            raise AssertionError(f"{backend.name} lossless round trip is not bit-exact")
    print("lossless round trips (subprocess and in-process): bit-exact, matches")

    res = ResultsWriter("08", "subprocess_overhead")
    exe = ffmpeg_binary()
    spawn_ms = wall_ms(lambda: subprocess.run([exe, "-hide_banner", "-version"], capture_output=True, check=True),
                         repeats * 2)
    res.add(backend="ffmpeg-x265", metric="spawn_ms", value=spawn_ms, unit="ms", direction="both", frame=FRAME)
    print(f"ffmpeg spawn (ffmpeg -version): {spawn_ms:.1f} ms per call")

    for backend in (sub, inproc):
        payloads = {}
        for n in tqdm(counts, desc=f"{backend.name} encode", leave=False):
            batch = frames[:n]

            def encode():
                with backend.encoder(FRAME, FRAME, qp=QP, preset=PRESET) as enc:
                    enc.submit(batch)
                    payloads[n] = enc.flush()

            ms = wall_ms(encode, repeats)
            res.add(backend=backend.name, metric="call_ms", value=ms, unit="ms", direction="encode", frames=n,
                    frame=FRAME, qp=QP, preset=PRESET)
        with backend.decoder(FRAME, FRAME) as persistent:
            for n in tqdm(counts, desc=f"{backend.name} decode", leave=False):
                def decode():
                    persistent.submit(payloads[n])
                    persistent.flush()

                ms = wall_ms(decode, repeats)
                res.add(backend=backend.name, metric="call_ms", value=ms, unit="ms", direction="decode", frames=n,
                        frame=FRAME, qp=QP, preset=PRESET)

    # fit time = fixed + n * per_frame for each path and direction
    for backend in (sub, inproc):
        for direction in ("encode", "decode"):
            pts = [(r["frames"], r["value"]) for r in res.rows
                   if r["backend"] == backend.name and r.get("direction") == direction and r["metric"] == "call_ms"]
            n, ms = np.array(pts, dtype=float).T
            per_frame, fixed = np.polyfit(n, ms, 1)
            common = dict(backend=backend.name, direction=direction, frame=FRAME, qp=QP, preset=PRESET)
            res.add(metric="fixed_ms", value=fixed, unit="ms", **common)
            res.add(metric="per_frame_ms", value=per_frame, unit="ms", **common)
            if backend is sub:
                res.add(metric="init_ms", value=fixed - spawn_ms, unit="ms", **common)
            print(f"{direction} {backend.name:<12} fixed {fixed:7.1f} ms + {per_frame:6.2f} ms/frame")
    calls = {(r["backend"], r["direction"], r["frames"]): r["value"] for r in res.rows if r["metric"] == "call_ms"}
    for direction in ("encode", "decode"):
        for n in counts:
            speedup = calls[(sub.name, direction, n)] / calls[(inproc.name, direction, n)]
            res.add(backend="x265", metric="speedup_vs_subprocess", value=speedup, unit="x", direction=direction,
                    frames=n, frame=FRAME, qp=QP, preset=PRESET)
        print(f"in-process session vs subprocess, {direction}: "
              + ", ".join(f"{n} frames {calls[(sub.name, direction, n)] / calls[(inproc.name, direction, n)]:.2f}x"
                          for n in counts))
    for row in res.rows:
        row["source"] = source
    return res


def plot(csv: str = "08_subprocess_overhead", name: str = "08_subprocess_overhead"):
    plt = apply_style()
    df = load(csv)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    from shared.results import series_style

    calls = df[df.metric == "call_ms"]
    paths = {"ffmpeg-x265": "ffmpeg subprocess", "x265": "in-process session (PyAV)"}
    for i, (backend, direction) in enumerate([(b, d) for b in paths for d in ("encode", "decode")]):
        sub = calls[(calls.backend == backend) & (calls.direction == direction)].sort_values("frames")
        ax1.plot(sub.frames, sub.value, "-" if direction == "encode" else "--", **series_style(i),
                 label=f"{paths[backend]}, {direction}")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("frames per call (count, log)")
    ax1.set_ylabel("wall time per call (ms, log)")
    ax1.set_title(f"time per call, {int(calls.frame.iloc[0])}px YUV444 frames, QP {int(calls.qp.iloc[0])}")
    ax1.legend(loc="upper left")

    spawn = df[df.metric == "spawn_ms"].value.iloc[0]
    n = int(calls.frames.min())  # the small-call case, where fixed costs matter
    labels, parts = [], []
    for backend in ("ffmpeg-x265", "x265"):
        for direction in ("encode", "decode"):
            sel = df[(df.backend == backend) & (df.direction == direction)]
            fixed = sel[sel.metric == "fixed_ms"].value.iloc[0]
            per = sel[sel.metric == "per_frame_ms"].value.iloc[0]
            is_sub = backend == "ffmpeg-x265"
            labels.append(f"{'subprocess' if is_sub else 'in-process'}\n{direction}")
            parts.append((spawn if is_sub else 0.0, max(fixed - (spawn if is_sub else 0.0), 0.0), per * n))
    parts = np.array(parts)
    bottom = np.zeros(len(labels))
    for i, (lab, color) in enumerate([("process spawn", "#D55E00"), ("codec init / fixed", "#E69F00"),
                                      (f"coding ({n} frame{'s' if n > 1 else ''})", "#0072B2")]):
        ax2.bar(labels, parts[:, i], bottom=bottom, label=lab, color=color)
        bottom += parts[:, i]
    ax2.set_ylabel(f"ms per call of {n} frame{'s' if n > 1 else ''} (linear fit over frame counts)")
    ax2.set_title("where the time goes")
    ax2.legend(loc="upper right")
    at_n = calls[calls.frames == n].groupby(["backend", "direction"]).value.median()
    speed = {d: at_n[("ffmpeg-x265", d)] / at_n[("x265", d)] for d in ("encode", "decode")}
    fig.suptitle(f"PoC 08: spawning ffmpeg costs {spawn:.0f} ms per call; in process, a {n}-frame call is "
                 f"{speed['encode']:.1f}x (encode) and {speed['decode']:.1f}x (decode) faster (measured calls)",
                 x=0.02, ha="left")
    save_figure(fig, name, f"{csv}.csv")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    args = ap.parse_args()
    if not args.plot_only:
        run(args.quick).save()
    plot()

"""PoC 11 - Can a torch CUDA tensor go to a bitstream and back to a CUDA tensor bit-exactly, and how many
host copies of frame data does that take?

A bf16 activation on the GPU is rotated into its PCA basis, quantized per channel to uint8 and
tiled into YUV 4:4:4 frames, all on the GPU (torch ops mirroring shared.quant and shared.frames,
checked against them). The encoder is NVENC where the GPU has one; the NVIDIA H200 has none, so
the frames take one device->host copy to libx265 (backend "x265", lossless). NVDEC then decodes the
bitstream from host memory straight into a CUDA tensor (backend "nvdec-hevc"), which is untiled,
dequantized and rotated back on the GPU. Checks: decoded frames == encoded frames, and the output
tensor == the same reconstruction computed without the codec (bit for bit). Host copies are counted
from the CUDA driver's own memcpy records (torch profiler / CUPTI) for each side, not assumed.

Command:   make poc-11            (or: python pocs/11_zero_copy_roundtrip.py [--quick])
Writes:    results/11_zero_copy_roundtrip.csv (on a machine with NVDEC; elsewhere it says why and writes nothing)
Sample output (NVIDIA H200; 16384 x 1024 synthetic activation, K=256, 22 frames of 256x256):
    NVENC: NVIDIA H200 has no NVENC engine (nvEncOpenEncodeSessionEx returned 2, ...); encode with backend 'x265' ...
    decoded frames == encoded frames: matches; output tensor == codec-free reconstruction: matches
    side      frame host copies       bytes  kind  small host copies    bytes  DtoD
    encode                    1     4325376  DtoH                  0        0     0
    decode                    0           0     -                  0        0    66
    x265_encode_cpu 655 ms, nvdec_decode_to_cuda 19.5 ms (0.89 ms/frame)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared import BackendUnavailable  # noqa: E402
from shared import frames as framing  # noqa: E402
from shared.basis import fit_basis  # noqa: E402
from shared.codecs import get_backend  # noqa: E402
from shared.codecs import nvdec  # noqa: E402
from shared.metrics import quality  # noqa: E402
from shared.quant import PerChannelQuantizer  # noqa: E402
from shared.sources import synthetic_activation  # noqa: E402
from shared.results import ResultsWriter, apply_style, load, save_figure  # noqa: E402

TOKENS = 16384          # rows of the activation
CHANNELS = 1024         # D, its channels
K = 256                 # PCA components kept (the planes' width)
FRAME = 256             # frame side, pixels
X265_PRESET = "medium"  # libx265 preset (lossless)
RHO = 0.9               # AR(1) correlation between neighbouring tokens of the synthetic activation
SPECTRUM_POWER = 1.0    # channel variance ~ (index + 1) ** -power in the synthetic activation's eigenbasis
REPEATS = 3             # timed round trips (median)
SEED = 0


# -- the GPU side of the pipeline: torch mirrors of shared.basis / shared.quant (shared.frames takes CUDA tensors) --------------
def gpu_planes(x, mean, components):
    """[T, D] CUDA -> ([T, K] uint8 CUDA planes, lo [K], step [K]) like PerChannelQuantizer.fit + quantize."""
    import torch

    coeffs = (x.float() - mean) @ components
    lo, hi = coeffs.amin(0), coeffs.amax(0)
    span = hi - lo
    step = torch.where(span > 0, span / 255, torch.ones_like(span))
    planes = torch.clamp(torch.round((coeffs - lo) / step), 0, 255).to(torch.uint8)
    return planes, lo, step


def gpu_reconstruct(planes, lo, step, mean, components, dtype):
    return ((planes.float() * step + lo) @ components.T + mean).to(dtype)


# -- counting copies --------------------------------------------------------------------------------------
def memcpy_records(fn):
    """Run fn under the torch profiler; return (fn's result, [(kind, bytes)] of every CUDA memcpy)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    copies = []
    for e in events:
        if e.get("cat") == "gpu_memcpy":
            name = e.get("name", "")
            kind = "DtoH" if "DtoH" in name else "HtoD" if "HtoD" in name else "DtoD" if "DtoD" in name else name
            copies.append((kind, int(e.get("args", {}).get("bytes", 0))))
    return result, copies


def summarize(copies, frame_bytes):
    """Host copies of frame data are DtoH/HtoD copies of at least one frame's bytes; the rest are small."""
    host = [(k, b) for k, b in copies if k in ("DtoH", "HtoD")]
    frame_copies = [(k, b) for k, b in host if b >= frame_bytes]
    return {
        "frame_host_copies": len(frame_copies),
        "frame_host_bytes": sum(b for _, b in frame_copies),
        "frame_host_kinds": ",".join(sorted({k for k, _ in frame_copies})) or "-",
        "small_host_copies": len(host) - len(frame_copies),
        "small_host_bytes": sum(b for _, b in host) - sum(b for _, b in frame_copies),
        "device_copies": sum(1 for k, _ in copies if k == "DtoD"),
    }


def run(tokens: int, channels: int, k: int, frame: int, repeats: int) -> ResultsWriter | None:
    import torch

    reason = nvdec.probe()
    if reason is not None:
        print(f"NVDEC unavailable here: {reason}\nresults/11_zero_copy_roundtrip.csv left as it is (GPU results "
              "come from the GPU machine)")
        return None
    gpu = nvdec.gpu_name()
    res = ResultsWriter("11", "zero_copy_roundtrip", gpu=True)
    common = dict(source="synthetic", tokens=tokens, channels=channels, k=k, frame=frame, preset=X265_PRESET)

    # NVENC first: where it exists it is the encoder; here it says why not.
    try:
        get_backend("nvdec-hevc").encoder(frame, frame, qp=None, preset="P4").close()
        nvenc_note, encoder = "available", "nvenc"
    except BackendUnavailable as e:
        nvenc_note, encoder = str(e), "x265"
    print(f"NVENC: {nvenc_note}")
    res.add(backend="nvenc", metric="available", value=int(encoder == "nvenc"), unit="bool", note=nvenc_note, **common)

    # The activation lives on the GPU; the basis is a per-model artifact fitted beforehand (calibration).
    x_host = synthetic_activation(tokens, channels, SEED, spectrum_power=SPECTRUM_POWER, rho=RHO)
    basis = fit_basis([x_host], k=k)
    x = torch.from_numpy(x_host).to("cuda", torch.bfloat16)
    mean = torch.from_numpy(basis.mean).cuda().float()
    components = torch.from_numpy(basis.components).cuda().float()  # [D, K]
    layout = framing.layout_for(tokens, k, height=frame)
    frame_bytes = 3 * frame * frame

    # Correctness first: GPU stages against the library's CPU stages, then the codec round trip.
    planes, lo, step = gpu_planes(x, mean, components)
    frames = framing.to_frames(planes, layout)
    cpu_quant = PerChannelQuantizer.fit(basis.project(x.float().cpu().numpy()), 8)
    same_planes = np.array_equal(planes.cpu().numpy(), cpu_quant.quantize(basis.project(x.float().cpu().numpy())))
    same_frames = np.array_equal(frames.cpu().numpy(), framing.to_frames(planes.cpu().numpy(), layout))
    print(f"GPU quantize == shared.quant: {'matches' if same_planes else 'differs (float rounding at level edges)'}; "
          f"GPU tiling == shared.frames: {'matches' if same_frames else 'MISMATCH'}")
    if not same_frames:
        raise AssertionError("GPU tiling differs from shared.frames")
    reference = gpu_reconstruct(framing.from_frames(frames, layout), lo, step, mean, components, x.dtype)

    decoder = get_backend("nvdec-hevc").decoder(frame, frame)

    def encode_side():
        planes_, lo_, step_ = gpu_planes(x, mean, components)
        frames_ = framing.to_frames(planes_, layout)
        host_frames = frames_.cpu().numpy()  # libx265 reads host memory: the one device->host copy
        with get_backend("x265").encoder(frame, frame, qp=None, preset=X265_PRESET) as enc:
            enc.submit(host_frames)
            return enc.flush(), lo_, step_

    def decode_side(payload, lo_, step_):
        decoder.submit(payload)
        frames_ = decoder.flush_cuda()
        return frames_, gpu_reconstruct(framing.from_frames(frames_, layout), lo_, step_, mean, components, x.dtype)

    (payload, lo2, step2), enc_copies = memcpy_records(encode_side)
    (decoded, x_hat), dec_copies = memcpy_records(lambda: decode_side(payload, lo2, step2))
    frames_exact = bool(torch.equal(decoded, frames))
    tensor_exact = bool(torch.equal(x_hat, reference))
    print(f"decoded frames == encoded frames: {'matches' if frames_exact else 'MISMATCH'}; "
          f"output tensor == codec-free reconstruction: {'matches' if tensor_exact else 'MISMATCH'}")
    if not (frames_exact and tensor_exact):
        raise AssertionError("the lossless round trip is not bit-exact")
    q = quality(x.float().cpu().numpy(), x_hat.float().cpu().numpy())
    ratio = tokens * channels * 2 / (len(payload) + 8 * k)
    print(f"ratio {ratio:.2f}x vs bf16 (payload + quantizer params), cos_mean {q['cos_mean']:.5f} (K={k} of {channels})")
    res.add(backend="x265+nvdec-hevc", metric="exact_frames", value=int(frames_exact), unit="bool", **common)
    res.add(backend="x265+nvdec-hevc", metric="exact_tensor", value=int(tensor_exact), unit="bool", **common)
    res.add(backend="x265+nvdec-hevc", metric="ratio", value=ratio, unit="x", **common)
    res.add(backend="x265+nvdec-hevc", metric="cos_mean", value=q["cos_mean"], unit="1", **common)

    print(f"{'side':<8}{'frame host copies':>19}{'bytes':>12}{'kind':>6}{'small host copies':>19}{'bytes':>9}{'DtoD':>6}")
    for side, copies, backend in (("encode", enc_copies, encoder), ("decode", dec_copies, "nvdec-hevc")):
        s = summarize(copies, frame_bytes)
        print(f"{side:<8}{s['frame_host_copies']:>19}{s['frame_host_bytes']:>12}{s['frame_host_kinds']:>6}"
              f"{s['small_host_copies']:>19}{s['small_host_bytes']:>9}{s['device_copies']:>6}")
        for metric, unit in (("frame_host_copies", "count"), ("frame_host_bytes", "B"), ("small_host_copies", "count"),
                             ("small_host_bytes", "B"), ("device_copies", "count")):
            res.add(backend=backend, metric=f"{side}_{metric}", value=s[metric], unit=unit,
                    copy_kinds=s["frame_host_kinds"], counted_by="CUPTI memcpy records", **common)

    # Timing after the checks: median of repeats for each stage.
    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    stages: dict[str, list[float]] = {}
    for _ in range(repeats):
        (planes_, lo_, step_), t = timed(lambda: gpu_planes(x, mean, components))
        stages.setdefault("gpu_project_quantize", []).append(t)
        frames_, t = timed(lambda: framing.to_frames(planes_, layout))
        stages.setdefault("gpu_tile", []).append(t)
        host_frames, t = timed(lambda: frames_.cpu().numpy())
        stages.setdefault("device_to_host_frames", []).append(t)

        def x265():
            with get_backend("x265").encoder(frame, frame, qp=None, preset=X265_PRESET) as enc:
                enc.submit(host_frames)
                return enc.flush()
        payload_, t = timed(x265)
        stages.setdefault("x265_encode_cpu", []).append(t)

        def nvdec_decode():
            decoder.submit(payload_)
            return decoder.flush_cuda()
        decoded_, t = timed(nvdec_decode)
        stages.setdefault("nvdec_decode_to_cuda", []).append(t)
        _, t = timed(lambda: gpu_reconstruct(framing.from_frames(decoded_, layout), lo_, step_, mean, components, x.dtype))
        stages.setdefault("gpu_untile_dequantize_reconstruct", []).append(t)
    print(f"{'stage':<36}{'ms':>9}{'ms/frame':>10}")
    for stage, ts in stages.items():
        ms = float(np.median(ts)) * 1e3
        print(f"{stage:<36}{ms:>9.2f}{ms / layout.n_frames:>10.3f}")
        backend = "x265" if stage.startswith("x265") else "nvdec-hevc" if stage.startswith("nvdec") else "torch"
        res.add(backend=backend, metric=f"ms_{stage}", value=ms, unit="ms", n_frames=layout.n_frames, **common)
    decoder.close()
    print(f"{gpu}: round trip bit-exact; frame data crossed to the host {summarize(enc_copies, frame_bytes)['frame_host_copies']} "
          f"time(s) on the encode side and {summarize(dec_copies, frame_bytes)['frame_host_copies']} on the decode side")
    return res


def plot(csv: str = "11_zero_copy_roundtrip", name: str = "11_zero_copy_roundtrip"):
    plt = apply_style()
    df = load(csv)
    v = {(r.backend, r.metric): r.value for r in df.itertuples()}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    from matplotlib.patches import Patch

    from shared.results import COLORS

    stages = [(b, m) for b, m in v if m.startswith("ms_")]  # in pipeline order: drawn top to bottom
    labels = [m.removeprefix("ms_").replace("_", " ") for _, m in stages]
    on_cpu = [b == "x265" for b, _ in stages]
    ms = [v[k] for k in stages]
    ax1.barh(labels, ms, color=[COLORS[3] if c else COLORS[0] for c in on_cpu])
    for y, t in enumerate(ms):
        ax1.text(t * 1.1, y, f"{t:.2f} ms", va="center", fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xscale("log")
    ax1.set_xlim(right=max(ms) * 6)
    ax1.set_xlabel("time for the whole tensor (ms, log)")
    ax1.set_title("where the round trip spends its time (pipeline order)")
    ax1.legend([Patch(color=COLORS[0]), Patch(color=COLORS[3])], ["on the GPU", "on the CPU (libx265: no NVENC)"],
               loc="lower right")
    sides = ["encode", "decode"]
    copies = [v.get(("x265", "encode_frame_host_copies"), 0), v.get(("nvdec-hevc", "decode_frame_host_copies"), 0)]
    ax2.bar(sides, copies, color=[COLORS[3], COLORS[0]])
    for i, c in enumerate(copies):
        ax2.text(i, c, f"{int(c)}", ha="center", va="bottom")
    ax2.set_ylabel("host copies of frame data (count)")
    ax2.yaxis.set_major_locator(plt.matplotlib.ticker.MaxNLocator(integer=True))
    ax2.set_title("copies between GPU and host (profiler)")
    exact = "bit-exact" if v.get(("x265+nvdec-hevc", "exact_tensor")) == 1 else "NOT bit-exact"
    cpu_ms = sum(t for t, c in zip(ms, on_cpu) if c)
    fig.suptitle(f"PoC 11: the CUDA round trip is {exact} and decodes with no host copy; libx265 on the CPU "
                 f"(no NVENC) takes {cpu_ms:.0f} of its {sum(ms):.0f} ms", x=0.02, ha="left")
    ax1.annotate(f"{df.device.iloc[0]}; ratio {v.get(('x265+nvdec-hevc', 'ratio'), float('nan')):.2f}x",
                 (0.99, 1.0), xycoords="axes fraction", ha="right", va="bottom", fontsize=7, color="0.4")
    save_figure(fig, name, f"{csv}.csv")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run (2048 tokens x 256 channels, K=192)")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="timed round trips")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    args = ap.parse_args()
    if args.plot_only:
        plot()
        sys.exit(0)
    if args.quick:
        result = run(2048, 256, 192, FRAME, 1)
    else:
        result = run(TOKENS, CHANNELS, K, FRAME, args.repeats)
    if result is not None:
        result.save()
        plot()

"""PoC 09 - How fast is every codec backend, in ms per frame and GB/s, from 256 to 2048-pixel frames?

Every backend available on the machine codes the same quantized planes: [T, K] uint8 planes that
stand for a bf16 [T, D] tensor, tiled into YUV 4:4:4 frames by shared.frames. Rows:

  raw, zstd, x265 (lossless and QP 18), ffv1      CPU, in-process sessions (PyAV, zstandard)
  ffmpeg-x265                                     CPU, one ffmpeg subprocess per call (the baseline)
  nvdec-hevc                                      NVDEC decode of the x265 lossless streams into CUDA
                                                  tensors; its encode (NVENC) is marked unavailable
                                                  where the GPU has no NVENC (the NVIDIA H200)
  rans                                            the compute codec's entropy coder (Triton) on the planes
                                                  as integer symbols with per-component tables
  nvcomp-*                                        nvCOMP on the GPU: the fast path (CUDA tensor in,
                                                  CUDA tensor out) on every frame of a size in one
                                                  call and one frame per call, and the session path
                                                  (host bytes in and out) on the CPU rows' frames;
                                                  plus the planes component-major ([K, T]) in one call

Speeds count two ways: GB/s of planes (the frame bytes a codec takes in) and GB/s of the original
bf16 bytes those frames stand for (2 * T * D bytes spread over the frames). Every lossless row is
checked bit-exact before it is timed ("matches"). GPU rows: warm-up, CUDA events, median of
repeats (NVDEC: wall clock around decode + synchronize, since its engines sit outside the stream);
CPU rows: wall clock, median of repeats. Planes come from real captures when data/captures holds
the export of `python -m shared.sources export` (cycled to fill the run; every x265 stream is
intra-only, so no frame is predicted from a repeated one), else synthetic planes, labelled.

Command:   make poc-09            (or: python pocs/09_backend_bench.py [--quick] [--sizes 256,2048]
                                   [--backends nvcomp,x265] [--tokens 32768] [--api] [--profile] [--api-cpu])
Writes:    results/09_backend_bench.csv, figures/09_backend_bench.png
Sample output (an NVIDIA H200, --backends raw,nvcomp, synthetic planes; GB/s of planes):
    backend          setting    size path           enc ms/f  dec ms/f  enc GB/s  dec GB/s  ratio  exact
    nvcomp-ans       default    2048 gpu_batch         0.069     0.040    182.37    311.07   1.07  matches
    nvcomp-ans       default    2048 gpu_per_frame     0.407     0.255     30.88     49.39   1.07  matches
    nvcomp-ans       default    2048 gpu_session       7.947     7.037      1.58      1.79   1.07  matches
    nvcomp-zstd      default    2048 gpu_batch         1.444     0.897      8.71     14.03   1.10  matches
    nvcomp-ans       default       - gpu_planes        0.403     0.255    166.51    262.88   1.41  matches

The compute codec through its API on a GPU (`--api`, about 2.5 min on an NVIDIA H200; the CSV
is written after every point, so a run cut short keeps what it measured): the calls a
user makes (`TensorCodec.encode` of a CUDA tensor, `decode(blob, device="cuda")`; `encode_many` /
`decode_many` of 60 KV tensors of one step), wall clock to a synchronize, by tensor size from 0.25 to
512 MB, beside the pinned PCIe copy of the same bytes timed in the same run. Encode, D2H copy, decode and
H2D copy take API_TURNS turns, so that the host's drifts fall on the codec and the copy alike; in each
turn a call runs once timed apart (the metrics *_gbps_after_copy: the first call after the other calls,
which follows a copy that left the SMs idle) and then API_BLOCK times in a row (encode_gbps /
decode_gbps: the median of those, a call in steady use); encode_gbps_queued: API_QUEUE encodes queued
with encode_many_async, then each one's result() (a pipeline's steady state), checked equal
to the synchronous call's bytes first. Every round trip is checked for cos >= 0.999
first, and up to 16 MB the GPU decode is compared with the CPU decoder's. Repeated encodes and decodes of
up to cuda_graphs.GRAPH_MAX_BYTES (1 GiB) replay a CUDA graph (columns encode_graph, decode_graph; metrics
encode_graph_held / decode_graph_held: the GPU memory each graph keeps, per input byte).
Sample output (an NVIDIA H200; GB/s of bf16):
    path              MB        T  ratio     cos  enc GB/s  dec GB/s  D2H GB/s  H2D GB/s  after a copy: enc / dec queued enc
    api S=def       4.00    10417   4.56  0.9990     17.66     17.25     48.38     46.54          13.31 /   13.53     16.81
    api S=def      64.00   166667   4.60  0.9990    168.70    201.22     54.35     54.45         119.25 /  149.94    151.14
    api S=def     256.00   666667   4.61  0.9990    279.29    319.16     54.99     55.07         222.70 /  280.56    257.04
    api_batched    23.59 60x1024 S=def    4.51  0.9990     40.46     63.52     52.25     52.61          33.33 /   50.03     44.63

Where the API's GPU time goes (`--profile`, about 1 min on an NVIDIA H200): each kernel's GPU time per
eager call (CUDA graphs off) from torch.profiler, encode and decode of 64 and 256 MB tensors and of the
60-tensor list, beside cuBLAS's `x @ basis` and a device copy of the 64 and 256 MB tensors (rows
path=profile, metric kernel_us: kernel-only figures that explain the API rows, merged into the CSV).

The compute codec's CPU path (`--api-cpu`, any machine; about 1 min on a 2-core CPU machine): a
bf16 CPU tensor through TensorCodec on one core (torch, numba and BLAS one thread each), each way
and stage by stage, in CPU time of the process (median of 15 calls), beside a memcpy of the same
bytes; real SmolLM2 K ([2048, 192] and [16384, 192], K = 192 of 192) and synthetic [4096, 1024]
tensors (no PCA, K = 256, K = 1024), step for cos 0.999. Every payload is first checked equal to
the numpy reference coder's, the round trip's cosine measured, and with a basis the symbols and
the decoded values compared with the GPU kernels' formulas (evaluated in float64). Its rows
(path=api_cpu, device cpu) are merged into results/09_backend_bench.csv; figures/09_backend_bench_cpu.png.
Sample output (a 2-core CPU machine, load average 6.0 from other jobs; CPU ms, wall ms, GB/s):
    synthetic [4096, 1024], no PCA: 8.4 MB bf16 -> 2651892 bytes, cos 0.999, ratio 3.1633, ...
      encode: api                                     26.85    54.92            0.312
      encode: rANS: tables                             7.61    15.75            1.102
      encode: rANS: coding pass                       10.37    22.24            0.809
      decode: api                                     12.36    24.37            0.679
      decode: rANS: decoding pass                      7.71    15.97            1.088
      reference: memcpy of the bf16 bytes              0.20     0.20           42.644
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared import frames as framing  # noqa: E402
from shared.codecs import all_backends, get_backend  # noqa: E402
from shared.errors import TensorCodecError  # noqa: E402
from shared.sources import real_planes, synthetic_planes  # noqa: E402
from shared.timing import cuda_ms, wall_ms  # noqa: E402
from shared.report import earlier_run  # noqa: E402
from shared.results import CSV_DTYPES, ResultsWriter, apply_style, load, save_figure  # noqa: E402

FRAME_SIZES = [256, 512, 1024, 2048]  # frame side, pixels
TOKENS = 1 << 20               # T: tokens of the plane matrix (128 MiB of planes at K = 128)
SOURCE = "llm_kv"              # exported real planes (python -m shared.sources export); else synthetic
REAL_CHANNELS = {"llm_kv": 192, "diffusion": 128}  # D of the bf16 tensors the real planes stand for
COMPONENTS = 128               # K of synthetic planes (the real ones have K = 128)
CHANNELS = 192                 # D the synthetic planes stand for
CPU_CALL_BYTES = 6 << 20       # bytes of frames per CPU-backend call (at least one frame)
CPU_REPEATS = 3                # timed CPU calls (median), after one untimed call
GPU_REPEATS = 20               # timed GPU calls (median), after GPU_WARMUP untimed ones
GPU_WARMUP = 3
NVDEC_REPEATS = 5              # timed NVDEC decodes of the same stream (median)
X265_PRESET = "ultrafast"      # x265 preset for every x265 row (the fastest: speed is the question)
LOSSY_QP = 18                  # the original write-up's speed setting
ZSTD_LEVEL = 3                 # zstd's default level; PoC 06 compares ratios at higher levels
SEED = 0

CPU_CONFIGS = [  # (backend, setting label, session settings)
    ("raw", "default", {}),
    ("zstd", f"level{ZSTD_LEVEL}", {"level": ZSTD_LEVEL}),
    ("x265", "lossless", {"qp": None, "preset": X265_PRESET, "intra": True}),
    ("x265", f"qp{LOSSY_QP}", {"qp": LOSSY_QP, "preset": X265_PRESET, "intra": True}),
    ("ffv1", "default", {}),
    ("ffmpeg-x265", "lossless", {"qp": None, "preset": X265_PRESET}),
]
NVCOMP = ["nvcomp-ans", "nvcomp-zstd", "nvcomp-gdeflate", "nvcomp-bitcomp", "nvcomp-cascaded", "nvcomp-lz4"]


# -- planes --------------------------------------------------------------------------------------
def source_planes(tokens: int, source: str, components: int, channels: int):
    """(planes [tokens, K] uint8, D they stand for, label): the exported real planes (shared.sources),
    cycled to `tokens` rows when needed (chunked coders see no difference), else synthetic ones."""
    real = real_planes(source) if source != "synthetic" else None
    if real is None:
        return synthetic_planes(tokens, components, SEED), channels, "synthetic"
    data, description = real
    cycles = tokens / len(data)
    label = f"real {source}" + (f" (cycled x{cycles:.1f})" if cycles > 1 else "")
    return np.ascontiguousarray(data[np.arange(tokens) % len(data)]), REAL_CHANNELS[source], label


# -- timing --------------------------------------------------------------------------------------
class Bench:
    """Collects rows; one `add` per measured configuration writes every metric of it."""

    def __init__(self, res: ResultsWriter, source: str, bf16_per_frame: dict[int, float]):
        self.res, self.source, self.bf16_per_frame = res, source, bf16_per_frame
        self.table: list[tuple] = []

    def add(self, backend, setting, size, path, n_frames, frame_bytes, enc_ms, dec_ms, payload_bytes, exact,
            bf16_bytes=None, **extra):
        bf16 = bf16_bytes if bf16_bytes is not None else self.bf16_per_frame[size] * n_frames
        common = dict(backend=backend, setting=setting, frame_size=size, path=path, frames_per_call=n_frames,
                      source=self.source, **extra)
        if path == "cpu_session":
            common["device"] = "cpu"  # CPU rows name the CPU even when the machine has a GPU
        rows = []
        for direction, ms in (("encode", enc_ms), ("decode", dec_ms)):
            if ms is None:
                continue
            rows += [(f"{direction}_ms_per_frame", ms / n_frames, "ms"),
                     (f"{direction}_gbps_planes", frame_bytes / ms / 1e6, "GB/s"),
                     (f"{direction}_gbps_bf16", bf16 / ms / 1e6, "GB/s")]
        if payload_bytes:
            rows += [("ratio_planes", frame_bytes / payload_bytes, "x"), ("ratio_bf16", bf16 / payload_bytes, "x")]
        if exact is not None:
            rows.append(("bit_exact", float(exact), "bool"))
        for metric, value, unit in rows:
            self.res.add(metric=metric, value=value, unit=unit, **common)
        self.table.append((backend, setting, size if size else "-", path, enc_ms, dec_ms, n_frames, frame_bytes,
                           payload_bytes, exact))
        e = "-" if enc_ms is None else f"{enc_ms / n_frames:9.3f}"
        d = "-" if dec_ms is None else f"{dec_ms / n_frames:9.3f}"
        eg = "-" if enc_ms is None else f"{frame_bytes / enc_ms / 1e6:9.2f}"
        dg = "-" if dec_ms is None else f"{frame_bytes / dec_ms / 1e6:9.2f}"
        r = "-" if not payload_bytes else f"{frame_bytes / payload_bytes:6.2f}"
        x = "" if exact is None else ("matches" if exact else "MISMATCH")
        print(f"{backend:16s} {setting:9s} {str(size or '-'):>5s} {path:13s} {e:>9s} {d:>9s} {eg:>9s} {dg:>9s} {r:>6s}  {x}",
              flush=True)


# -- the backends ---------------------------------------------------------------------------------
def bench_cpu(bench: Bench, name, setting, settings, size, frames, repeats, streams, path="cpu_session"):
    backend = get_backend(name)
    with backend.encoder(size, size, **settings) as enc, backend.decoder(size, size, **settings) as dec:
        enc.submit(frames)
        payload = enc.flush()
        dec.submit(payload)
        back = dec.flush()
        lossless = backend.is_lossless(settings)
        exact = bool(np.array_equal(back, frames))
        extra = {}
        if lossless and not exact:
            raise AssertionError(f"{name} {setting} {size}px: lossless round trip is not bit-exact")
        if not lossless:
            err = np.abs(back.astype(np.int16) - frames.astype(np.int16))
            mse = float((err.astype(np.float64) ** 2).mean())
            extra = {"max_abs_err": int(err.max()), "psnr_db": 10 * np.log10(255 ** 2 / mse) if mse else float("inf")}
            bench.res.add(backend=name, metric="psnr_db", value=extra["psnr_db"], unit="dB", setting=setting,
                          frame_size=size, path=path, source=bench.source, device="cpu")

        def encode(_=None):
            enc.submit(frames)
            enc.flush()

        def decode(_=None):
            dec.submit(payload)
            dec.flush()

        enc_ms, dec_ms = wall_ms(encode, repeats), wall_ms(decode, repeats)
    bench.add(name, setting, size, path, len(frames), frames.nbytes, enc_ms, dec_ms, len(payload),
              exact if lossless else None, timing="wall", repeats=repeats, **settings)
    if name == "x265" and settings.get("qp") is None:
        streams[size] = payload  # NVDEC decodes exactly these streams


def bench_nvdec(bench: Bench, torch, size, frames, payload, repeats):
    backend = get_backend("nvdec-hevc")
    try:
        backend.encoder(size, size).close()
        enc_note = "NVENC present but not benchmarked here"
    except TensorCodecError as e:
        enc_note = str(e)
    bench.res.add(backend="nvdec-hevc", metric="encode_available", value=0.0, unit="bool", frame_size=size,
                  reason=enc_note, source=bench.source)
    with backend.decoder(size, size) as dec:
        dec.submit(payload)
        back = dec.flush_cuda()
        torch.cuda.synchronize()
        exact = bool(torch.equal(back.cpu(), torch.from_numpy(frames)))
        if not exact:
            raise AssertionError(f"nvdec-hevc {size}px: decode of the x265 lossless stream is not bit-exact")

        def decode(_=None):
            dec.submit(payload)
            dec.flush_cuda()
            torch.cuda.synchronize()

        dec_ms = wall_ms(decode, repeats)
    bench.add("nvdec-hevc", "lossless", size, "nvdec_cuda", len(frames), frames.nbytes, None, dec_ms, len(payload),
              exact, timing="wall+sync", repeats=repeats, encoder="x265 lossless (CPU)", encode_unavailable=enc_note)


def bench_nvcomp_fast(bench: Bench, torch, name, size, frames_gpu, stream, repeats, warmup, layout="frames",
                      bf16_bytes=None):
    from shared.codecs.nvcomp import gpu_coder

    coder = gpu_coder(name)
    flat = frames_gpu.reshape(-1)
    payload, out = coder.checked_round_trip(flat, stream)
    exact = True  # checked_round_trip raised otherwise
    enc_ms = cuda_ms(lambda i=0: coder.encode_cuda(flat), repeats, warmup, stream)
    dec_ms = cuda_ms(lambda i=0: coder.decode_cuda(payload, out=out), repeats, warmup, stream)
    n = frames_gpu.shape[0] if layout == "frames" else 1
    bench.add(name, "default", size, "gpu_batch" if layout == "frames" else "gpu_planes", n, flat.numel(), enc_ms,
              dec_ms, payload.numel(), exact, bf16_bytes=bf16_bytes, timing="cuda_events", repeats=repeats,
              layout=layout, chunk_bytes=coder.chunk_size)
    if layout != "frames":
        return
    # one frame per call: what a per-frame pipeline pays (launches and a size query per call)
    per = [coder.encode_cuda(f) for f in frames_gpu]
    outs = torch.empty_like(frames_gpu[0]).reshape(-1)
    for f, p in zip(frames_gpu, per):
        coder.decode_cuda(p, out=outs)
        if not torch.equal(outs, f.reshape(-1)):
            raise AssertionError(f"{name} {size}px: per-frame GPU round trip is not bit-exact")
    nf = frames_gpu.shape[0]
    enc1 = cuda_ms(lambda i=0: coder.encode_cuda(frames_gpu[i % nf]), repeats, warmup, stream)
    dec1 = cuda_ms(lambda i=0: coder.decode_cuda(per[i % nf], out=outs), repeats, warmup, stream)
    bench.add(name, "default", size, "gpu_per_frame", 1, frames_gpu[0].numel(), enc1, dec1,
              int(np.mean([p.numel() for p in per])), True, timing="cuda_events", repeats=repeats, layout=layout,
              chunk_bytes=coder.chunk_size)


# -- the run -------------------------------------------------------------------------------------
def run(args) -> ResultsWriter:
    sizes = [int(s) for s in args.sizes.split(",")]
    wanted = [w for w in args.backends.split(",") if w]

    def selected(name):
        return not wanted or any(name.startswith(w) for w in wanted)

    planes, channels, source = source_planes(args.tokens, "synthetic" if args.synthetic else args.source,
                                             args.components, args.channels)
    tokens, components = planes.shape
    print(f"planes [{tokens}, {components}] uint8 from {source}, standing for a bf16 [{tokens}, {channels}] tensor "
          f"({2 * tokens * channels / 2**20:.0f} MiB)")

    torch = None
    try:
        import torch as _torch

        torch = _torch if (_torch.cuda.is_available() and not args.quick) else None
    except ImportError:
        pass
    res = ResultsWriter("09", "backend_bench", gpu=torch is not None)
    layouts = {s: framing.layout_for(tokens, components, s) for s in sizes}
    bf16_per_frame = {s: 2 * tokens * channels / layouts[s].n_frames for s in sizes}
    bench = Bench(res, source, bf16_per_frame)

    status = {b.name: b.unavailable_reason() for b in all_backends() if selected(b.name)}
    for name, reason in status.items():
        res.add(backend=name, metric="available", value=float(reason is None), unit="bool", reason=reason or "",
                source=source)
        if reason:
            print(f"{name}: not available here ({reason})")
    print(f"{'backend':16s} {'setting':9s} {'size':>5s} {'path':13s} {'enc ms/f':>9s} {'dec ms/f':>9s} "
          f"{'enc GB/s':>9s} {'dec GB/s':>9s} {'ratio':>6s}  exact")

    cpu_configs = [c for c in CPU_CONFIGS if selected(c[0]) and status.get(c[0]) is None]
    if args.quick:
        cpu_configs = [c for c in cpu_configs if c[0] in ("raw", "zstd", "ffv1") or c[1] == "lossless" and c[0] == "x265"]
    nvcomp = [n for n in NVCOMP if selected(n) and status.get(n) is None and torch is not None]
    nvdec_ok = torch is not None and selected("nvdec-hevc") and status.get("nvdec-hevc") is None
    stream = torch.cuda.Stream() if torch is not None else None
    known = {c[0] for c in CPU_CONFIGS} | set(NVCOMP) | {"nvdec-hevc"}
    others = [b for b in all_backends() if b.name not in known and b.name in status and status[b.name] is None
              and (b.device == "cpu" or torch is not None) and not args.quick]  # backends added since: session rows

    for size in sizes:
        frames = framing.to_frames(planes, layouts[size])
        n_cpu = max(1, min(len(frames), CPU_CALL_BYTES // frames[0].nbytes))
        cpu_frames = np.ascontiguousarray(frames[:n_cpu])
        streams: dict[int, bytes] = {}
        for name, setting, settings in cpu_configs:
            bench_cpu(bench, name, setting, settings, size, cpu_frames, args.cpu_repeats, streams)
        for b in others:
            bench_cpu(bench, b.name, "default", {}, size, cpu_frames, args.cpu_repeats, streams,
                      path="gpu_session" if b.device == "cuda" else "cpu_session")
        if nvdec_ok:
            if size not in streams:
                with get_backend("x265").encoder(size, size, qp=None, preset=X265_PRESET, intra=True) as enc:
                    enc.submit(cpu_frames)
                    streams[size] = enc.flush()
            bench_nvdec(bench, torch, size, cpu_frames, streams[size], NVDEC_REPEATS)
        if nvcomp:
            frames_gpu = torch.from_numpy(frames).cuda()
            for name in nvcomp:
                bench_nvcomp_fast(bench, torch, name, size, frames_gpu, stream, args.gpu_repeats, GPU_WARMUP)
                bench_cpu(bench, name, "default", {}, size, cpu_frames, args.cpu_repeats, streams, path="gpu_session")
            del frames_gpu
    if nvcomp:  # component-major planes, no frames: each chunk holds whole components
        from shared.codecs.nvcomp import component_major

        planes_km = component_major(torch.from_numpy(planes).cuda())
        for name in nvcomp:
            bench_nvcomp_fast(bench, torch, name, 0, planes_km, stream, args.gpu_repeats, GPU_WARMUP,
                              layout="component_major", bf16_bytes=2 * tokens * channels)
    if torch is not None and selected("rans"):
        bench_rans(bench, torch, planes, stream, args.gpu_repeats, GPU_WARMUP, 2 * tokens * channels)
    res.add(backend="-", metric="planes_shape", value=float(tokens * components), unit="bytes", source=source,
            tokens=tokens, components=components, channels=channels,
            layouts=json.dumps({s: layouts[s].to_dict() for s in sizes}))
    return res


def bench_rans(bench: Bench, torch, planes, stream, repeats, warmup, bf16_bytes):
    """The compute codec's entropy coder (shared/codecs/rans.py, Triton) on the same planes as symbols:
    per-component tables, so it sees the [T, K] matrix, not frames."""
    from shared.codecs import rans, rans_cuda

    symbols = torch.from_numpy(planes.astype(np.int32)).cuda()
    with torch.cuda.stream(stream):
        payload = rans_cuda.encode_cuda(symbols)
        back = rans_cuda.decode_cuda(payload)
    stream.synchronize()
    head = symbols[:16384]  # the numpy decoder is slow: cross-check the formats on a slice
    same_format = np.array_equal(rans.decode(rans_cuda.encode_cuda(head).cpu().numpy().tobytes()), head.cpu().numpy())
    exact = bool(torch.equal(back, symbols)) and same_format
    if not exact:
        raise AssertionError("rans: GPU round trip (or the CPU decode of a GPU payload) is not bit-exact")
    enc_ms = cuda_ms(lambda i=0: rans_cuda.encode_cuda(symbols), repeats, warmup, stream)
    dec_ms = cuda_ms(lambda i=0: rans_cuda.decode_cuda(payload), repeats, warmup, stream)
    bench.add("rans", "per-component tables", 0, "gpu_planes", 1, planes.nbytes, enc_ms, dec_ms, payload.numel(),
              exact, bf16_bytes=bf16_bytes, timing="cuda_events", repeats=repeats, layout="token_major_symbols")


# ---------------------------------------------------------------------------------------------
# The compute codec through the API a user calls (TensorCodec.encode / decode, encode_many /
# decode_many), by tensor size, beside the pinned PCIe copy of the same bytes in the same run.

API_MB = [0.25, 1, 4, 16, 64, 128, 256, 512]  # tensor sizes, MB of bf16
API_TARGET_COS = 0.999        # the step is calibrated for this on held-out-free calibration rows
API_TARGET_PCIE = 5           # the figure's reference line: this many times the PCIe copy's rate
API_BATCH = 60                # tensors in one batched call: one 30-layer model's K and V of one step
API_BATCH_TOKENS = 1024       # tokens of each batched tensor ([1024, 192]: one layer's K of a 1K chunk)
API_TURNS = 6                 # turns per point; each turn times encode, D2H copy, decode, H2D copy in a row
API_BLOCK = 4                 # timed calls of each in a turn (median over turns), after one timed apart
API_WARMUP_S = 2.0            # seconds of GEMMs before the first size, so the GPU runs at its full clock
API_QUEUE = 8                 # encode_many_async calls queued before their results are read (a pipeline's steady state)
API_BATCH_LANES = [None, 256]  # lane tokens of the batched rows: the default (512 for [1024, 192]), and shorter lanes
API_SHORT_LANES_MB = (4, 128)  # single tensors of these sizes also run with 256-token lanes


def api_source():
    """(calibration rows, test rows, description): SmolLM2's exported layer-15 K cache (make planes),
    calibration on chunks 0-3, test rows from chunks 4-5; synthetic PCA-like rows where absent."""
    real = real_planes("act_llm_k15")
    if real is not None:
        k = real[0].astype(np.float32)
        return k[:4096], k[4096:], "SmolLM2-135M layer-15 K (6 x 1024 tokens, D=192), rows cycled"
    from shared.sources import synthetic_activation

    x = synthetic_activation(6144, 192, seed=0)
    return x[:4096], x[4096:], "synthetic PCA-like [T, 192] (no exported captures; run make planes)"


def bench_api(res: ResultsWriter, torch, sizes_mb, saved=lambda: None):
    """Round trip checked first (quality, and GPU decode == CPU decode of the same container), then timed.
    saved() runs after each point (the CSV so far survives a run cut short)."""
    import time

    from shared import cuda_graphs, pipeline
    from shared.basis import fit_basis
    from shared.metrics import quality
    from shared.pipeline import TensorCodec, encode_many_async
    from shared.rdquant import calibrate_step

    calib, test, desc = api_source()
    D = calib.shape[1]
    basis = calibrate_step(fit_basis([calib], k=D), [calib], API_TARGET_COS)
    test_t = torch.from_numpy(test).to(torch.bfloat16)

    def in_turns(calls: dict) -> tuple[dict, dict]:
        """({name: median seconds} of each call in steady use, {name: median seconds} of its first call
        after the others'), wall clock to its synchronize. The calls take turns (API_TURNS), so the
        host's drifts fall on the codec and the copy it is compared with alike (runs of one code
        differed by 15-20% at a size when each was timed in its own block); in each turn a call runs
        once after the others' (timed apart: a PCIe copy leaves the SMs idle, and a codec call right
        after one took 13-41% longer to encode and 5-61% to decode on an NVIDIA H200 at a full SM clock,
        code 51596fb), then API_BLOCK times in a row."""
        for fn in calls.values():
            fn()
        torch.cuda.synchronize()
        steady, first = {name: [] for name in calls}, {name: [] for name in calls}
        for _ in range(API_TURNS):
            for name, fn in calls.items():
                for i in range(1 + API_BLOCK):
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    (first if i == 0 else steady)[name].append(time.perf_counter() - t0)
        med = lambda ts: {name: float(np.median(t)) for name, t in ts.items()}  # noqa: E731
        return med(steady), med(first)

    def add(path, metric, value, unit, mb, **kw):
        res.add(backend="rans", path=path, metric=metric, value=value, unit=unit, tensor_mb=mb, source=desc,
                target_cos=API_TARGET_COS, timing="blocks in turns", repeats=API_TURNS * API_BLOCK, **kw)

    # an idle GPU sits at a low clock and takes a while to reach its full one: without this, the
    # first (smallest) sizes were timed partly at the low clock (4 MB encode: 8.4 GB/s, 14.1 in a probe)
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < API_WARMUP_S:
        warm @ warm
    torch.cuda.synchronize()
    del warm
    print(f"{'path':12s} {'MB':>7s} {'T':>8s} {'ratio':>6s} {'cos':>7s} {'enc GB/s':>9s} {'dec GB/s':>9s} "
          f"{'D2H GB/s':>9s} {'H2D GB/s':>9s} {'after a copy: enc / dec':>24s} {'queued enc':>9s}")
    runs = [(mb, None) for mb in sizes_mb] + [(mb, 256) for mb in sizes_mb if API_SHORT_LANES_MB[0] <= mb <= API_SHORT_LANES_MB[1]]
    for mb, lane_tokens in runs:
        T = max(1, int(round(mb * 1e6 / (2 * D))))
        x = test_t[torch.arange(T) % len(test_t)].cuda()
        codec = TensorCodec(basis, backend="rans", lane_tokens=lane_tokens)
        blob = codec.encode(x)
        y = codec.decode(blob, device="cuda")
        q = quality(x.float().cpu().numpy(), y.float().cpu().numpy())
        on_cpu = codec.decode(bytes(blob.cpu().numpy())).to(torch.bfloat16) if mb <= 16 else None
        same = None if on_cpu is None else torch.equal(y.cpu(), on_cpu)
        same_share = None if on_cpu is None else float((y.cpu() == on_cpu).float().mean())
        if q["cos_mean"] < API_TARGET_COS - 5e-4:
            raise SystemExit(f"round trip at {mb} MB gives cos {q['cos_mean']:.5f} < {API_TARGET_COS}")
        nbytes = x.numel() * 2
        graph = nbytes <= cuda_graphs.GRAPH_MAX_BYTES
        lanes = dict(lane_tokens=lane_tokens or "default", encode_graph=graph, decode_graph=graph)
        pipeline.drop_graphs()  # so the memory a graph holds is this size's alone
        m0, m1, m2 = graphs_made(lambda: codec.encode(x), lambda: codec.decode(blob, device="cuda"))
        pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        flat = x.view(-1).view(torch.uint8)
        queued = queued_encodes(lambda: encode_many_async([codec], [x]), blob)
        t, t1 = in_turns({"enc": lambda: codec.encode(x), "enc_queued": queued,
                          "d2h": lambda: pinned.copy_(flat, non_blocking=True),
                          "dec": lambda: codec.decode(blob, device="cuda"),
                          "h2d": lambda: flat.copy_(pinned, non_blocking=True)})
        t_enc, t_dec, t_d2h, t_h2d, t_queued = t["enc"], t["dec"], t["d2h"], t["h2d"], t["enc_queued"]
        ratio = nbytes / blob.numel()
        for metric, t in (("encode_gbps", t_enc), ("decode_gbps", t_dec)):
            add("api", metric, nbytes / t / 1e9, "GB/s of bf16", mb, tokens=T, channels=D, **lanes)
        for metric, t in (("encode_gbps_after_copy", t1["enc"]), ("decode_gbps_after_copy", t1["dec"])):
            add("api", metric, nbytes / t / 1e9, "GB/s of bf16", mb, tokens=T, channels=D, **lanes)
        add("api", "encode_gbps_queued", nbytes * API_QUEUE / t_queued / 1e9, "GB/s of bf16", mb, tokens=T,
            channels=D, queued=API_QUEUE, **lanes)
        add("api", "encode_ms", t_enc * 1e3, "ms", mb, tokens=T, channels=D, **lanes)
        add("api", "decode_ms", t_dec * 1e3, "ms", mb, tokens=T, channels=D, **lanes)
        add("api", "ratio", ratio, "x vs bf16", mb, tokens=T, channels=D, **lanes)
        add("api", "cos_mean", q["cos_mean"], "cos", mb, tokens=T, channels=D, **lanes)
        if graph:
            add("api", "encode_graph_held", (m1 - m0) / nbytes, "GPU bytes per input byte", mb, tokens=T, channels=D,
                **lanes)
            add("api", "decode_graph_held", (m2 - m1) / nbytes, "GPU bytes per input byte", mb, tokens=T, channels=D,
                **lanes)
        if same is not None:
            add("api", "gpu_decode_equals_cpu_decode", float(same), "bool", mb, tokens=T, channels=D, **lanes)
            add("api", "gpu_cpu_decode_equal_fraction", same_share, "fraction of values", mb, tokens=T, channels=D,
                **lanes)
        if lane_tokens is None:
            add("pcie_copy", "d2h_gbps", nbytes / t_d2h / 1e9, "GB/s", mb, tokens=T, channels=D)
            add("pcie_copy", "h2d_gbps", nbytes / t_h2d / 1e9, "GB/s", mb, tokens=T, channels=D)
        print(f"{'api S=' + str(lane_tokens or 'def'):12s} {mb:7.2f} {T:8d} {ratio:6.2f} {q['cos_mean']:7.4f} {nbytes / t_enc / 1e9:9.2f} "
              f"{nbytes / t_dec / 1e9:9.2f} {nbytes / t_d2h / 1e9:9.2f} {nbytes / t_h2d / 1e9:9.2f} "
              f"{nbytes / t1['enc'] / 1e9:14.2f} / {nbytes / t1['dec'] / 1e9:7.2f} "
              f"{nbytes * API_QUEUE / t_queued / 1e9:9.2f}")
        saved()

    for lane_tokens in API_BATCH_LANES:
        bench_api_batched(res, torch, basis, test_t, D, in_turns, graphs_made, add, lane_tokens)
        saved()


def queued_encodes(encode_queued, want):
    """A function that queues API_QUEUE encodes (encode_queued: one encode_many_async call,
    no host synchronization) and then reads each one's result(): a pipeline's steady state, where
    the host readies a call while the GPU codes the ones before it. Checked first: the second such
    call makes encode_many_async's graph, and every queued result equals `want` (the synchronous call's
    containers, a blob or a list of them)."""
    import torch

    want = list(want) if isinstance(want, (list, tuple)) or not hasattr(want, "dtype") else [want]

    def queued():
        pending = [encode_queued() for _ in range(API_QUEUE)]
        return [p.result() for p in pending]

    for _ in range(3):
        for got in queued():
            if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want)):
                raise SystemExit("a queued encode (encode_many_async) wrote other bytes than the synchronous call")
    return queued


def graphs_made(encode, decode, calls: int = 3):
    """GPU memory allocated before, after `calls` encodes and after as many decodes: the second call of
    each makes its CUDA graph (cuda_graphs.second_call_graph), so the differences are what the graphs keep."""
    import torch

    m0 = torch.cuda.memory_allocated()
    for _ in range(calls):
        encode()
    torch.cuda.synchronize()
    m1 = torch.cuda.memory_allocated()
    for _ in range(calls):
        decode()
    torch.cuda.synchronize()
    return m0, m1, torch.cuda.memory_allocated()


def bench_api_batched(res, torch, basis, test_t, D, in_turns, graphs_made, add, lane_tokens):
    """API_BATCH tensors of one step, one codec each, in one call per direction."""
    from shared.metrics import quality
    from shared import cuda_graphs, pipeline
    from shared.pipeline import TensorCodec, decode_many, encode_many, encode_many_async

    codecs = [TensorCodec(basis, backend="rans", lane_tokens=lane_tokens) for _ in range(API_BATCH)]
    xs = [test_t[(torch.arange(API_BATCH_TOKENS) + 97 * i) % len(test_t)].cuda() for i in range(API_BATCH)]
    blobs = encode_many(codecs, xs)
    ys = decode_many(codecs, blobs, device="cuda")
    cos = min(quality(a.float().cpu().numpy(), b.float().cpu().numpy())["cos_mean"] for a, b in zip(xs, ys))
    if cos < API_TARGET_COS - 5e-4:
        raise SystemExit(f"batched round trip gives cos {cos:.5f} < {API_TARGET_COS}")
    nbytes = sum(a.numel() * 2 for a in xs)
    mb = nbytes / 1e6
    pipeline.drop_graphs()
    m0, m1, m2 = graphs_made(lambda: encode_many(codecs, xs), lambda: decode_many(codecs, blobs, device="cuda"))
    flat = torch.cat([a.view(-1) for a in xs]).view(torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    queued = queued_encodes(lambda: encode_many_async(codecs, xs), blobs)
    t, t1 = in_turns({"enc": lambda: encode_many(codecs, xs), "enc_queued": queued,
                      "d2h": lambda: pinned.copy_(flat, non_blocking=True),
                      "dec": lambda: decode_many(codecs, blobs, device="cuda"),
                      "h2d": lambda: flat.copy_(pinned, non_blocking=True)})
    t_enc, t_dec, t_d2h, t_h2d = t["enc"], t["dec"], t["d2h"], t["h2d"]
    ratio = nbytes / sum(b.numel() for b in blobs)
    graph = nbytes <= cuda_graphs.GRAPH_MAX_BYTES
    kw = dict(tokens=API_BATCH_TOKENS, channels=D, tensors=API_BATCH, lane_tokens=lane_tokens or "default",
              encode_graph=graph, decode_graph=graph)
    add("api_batched", "encode_gbps", nbytes / t_enc / 1e9, "GB/s of bf16", mb, **kw)
    add("api_batched", "decode_gbps", nbytes / t_dec / 1e9, "GB/s of bf16", mb, **kw)
    add("api_batched", "encode_gbps_after_copy", nbytes / t1["enc"] / 1e9, "GB/s of bf16", mb, **kw)
    add("api_batched", "decode_gbps_after_copy", nbytes / t1["dec"] / 1e9, "GB/s of bf16", mb, **kw)
    add("api_batched", "encode_gbps_queued", nbytes * API_QUEUE / t["enc_queued"] / 1e9, "GB/s of bf16", mb,
        queued=API_QUEUE, **kw)
    add("api_batched", "encode_us_per_tensor", t_enc / API_BATCH * 1e6, "us", mb, **kw)
    add("api_batched", "decode_us_per_tensor", t_dec / API_BATCH * 1e6, "us", mb, **kw)
    if graph:
        add("api_batched", "encode_graph_held", (m1 - m0) / nbytes, "GPU bytes per input byte", mb, **kw)
        add("api_batched", "decode_graph_held", (m2 - m1) / nbytes, "GPU bytes per input byte", mb, **kw)
    add("api_batched", "ratio", ratio, "x vs bf16", mb, **kw)
    add("api_batched", "cos_min", cos, "cos", mb, **kw)
    add("pcie_copy", "d2h_gbps", nbytes / t_d2h / 1e9, "GB/s", mb, batched=API_BATCH, **kw)
    add("pcie_copy", "h2d_gbps", nbytes / t_h2d / 1e9, "GB/s", mb, batched=API_BATCH, **kw)
    print(f"{'api_batched':12s} {mb:7.2f} {API_BATCH}x{API_BATCH_TOKENS} S={lane_tokens or 'def':<4} {ratio:6.2f} {cos:7.4f} "
          f"{nbytes / t_enc / 1e9:9.2f} {nbytes / t_dec / 1e9:9.2f} {nbytes / t_d2h / 1e9:9.2f} "
          f"{nbytes / t_h2d / 1e9:9.2f} {nbytes / t1['enc'] / 1e9:14.2f} / {nbytes / t1['dec'] / 1e9:7.2f} "
          f"{nbytes * API_QUEUE / t['enc_queued'] / 1e9:9.2f}")


# ---------------------------------------------------------------------------------------------
# Where the API's GPU time goes (--profile): kernel times of eager calls (CUDA graphs off) from
# torch.profiler, beside cuBLAS's x @ basis and a device copy of the same tensor. Kernel-only figures:
# they explain the API rows above and never stand for them.

PROFILE_MB = [64, 256]         # single tensors profiled (MB of bf16); plus the 60-tensor list
PROFILE_CALLS = 5              # profiled calls per direction (GPU time per call = total / calls)


def _kernel_times(torch, fn, calls: int) -> dict:
    """{kernel name: GPU microseconds per call} over `calls` calls of fn, after one untimed call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}


def bench_profile(res: ResultsWriter, torch):
    """Rows path=profile, metric=kernel_us: each kernel's GPU time per eager API call."""
    from triton.testing import do_bench

    from shared import cuda_graphs
    from shared.basis import fit_basis
    from shared.pipeline import TensorCodec, decode_many, encode_many
    from shared.rdquant import calibrate_step

    calib, test, desc = api_source()
    D = calib.shape[1]
    basis = calibrate_step(fit_basis([calib], k=D), [calib], API_TARGET_COS)
    test_t = torch.from_numpy(test).to(torch.bfloat16)
    graphs, cuda_graphs.GRAPH_MAX_BYTES = cuda_graphs.GRAPH_MAX_BYTES, 0  # eager calls: every kernel launched
    try:
        def rows(times, direction, mb, **kw):
            for name, us in sorted(times.items(), key=lambda r: -r[1]):
                res.add(backend="rans", path="profile", metric="kernel_us", value=us, unit="us of GPU time per call",
                        kernel=name[:80], direction=direction, tensor_mb=mb, source=desc, **kw)
            top = ", ".join(f"{k[:28]} {v:.0f}" for k, v in sorted(times.items(), key=lambda r: -r[1])[:5])
            print(f"{direction:7s} {mb:7.2f} MB {kw}: {top}")

        for mb in PROFILE_MB:
            T = int(round(mb * 1e6 / (2 * D)))
            x = test_t[torch.arange(T) % len(test_t)].cuda()
            codec = TensorCodec(basis, backend="rans")
            blob = codec.encode(x)
            rows(_kernel_times(torch, lambda: codec.encode(x), PROFILE_CALLS), "encode", mb, tokens=T, channels=D)
            rows(_kernel_times(torch, lambda: codec.decode(blob, device="cuda"), PROFILE_CALLS), "decode", mb,
                 tokens=T, channels=D)
            comps = codec._projection(D, x.device).components
            y = torch.empty_like(x)
            reference = {"reference: cuBLAS x @ basis (bf16)": do_bench(lambda: x @ comps, rep=50) * 1e3,
                         "reference: device copy of the tensor": do_bench(lambda: y.copy_(x), rep=50) * 1e3}
            rows(reference, "reference", mb, tokens=T, channels=D)
            del x, y, blob
            torch.cuda.empty_cache()
        codecs = [TensorCodec(basis, backend="rans") for _ in range(API_BATCH)]
        xs = [test_t[(torch.arange(API_BATCH_TOKENS) + 97 * i) % len(test_t)].cuda() for i in range(API_BATCH)]
        blobs = encode_many(codecs, xs)
        mb = API_BATCH * API_BATCH_TOKENS * D * 2 / 1e6
        kw = dict(tokens=API_BATCH_TOKENS, channels=D, tensors=API_BATCH)
        rows(_kernel_times(torch, lambda: encode_many(codecs, xs), PROFILE_CALLS), "encode", mb, **kw)
        rows(_kernel_times(torch, lambda: decode_many(codecs, blobs, device="cuda"), PROFILE_CALLS), "decode", mb, **kw)
    finally:
        cuda_graphs.GRAPH_MAX_BYTES = graphs


# ---------------------------------------------------------------------------------------------
# The compute codec's CPU path through the API (TensorCodec on a bf16 CPU tensor), on one core,
# stage by stage, beside a memcpy of the same bytes in the same run (rans_cpu_bench.benchmark_cpu_pipeline).

CPU_API_TOKENS = [2048, 16384]  # tokens of the real-K tensors ([T, 192]; 16384 cycles the held-out rows)
CPU_API_SYNTHETIC_K = (None, 256, 1024)  # synthetic [4096, 1024] bf16: raw channels, PCA K=256 and K=1024
CPU_API_REPEATS = 15          # timed calls per stage (median of CPU time), after one untimed call
CPU_API_TARGET_GBPS = 0.3     # the speed each direction is meant to reach on one core (GB/s of bf16)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "unknown CPU"
    return f"{name}, {__import__('os').cpu_count()} cores"


def bench_api_cpu(res: ResultsWriter, repeats: int, quick: bool = False):
    """Real SmolLM2 K (K = 192 of 192, step calibrated for cos 0.999 on other rows) and synthetic
    [4096, 1024] tensors through the CPU path, on one core: rows with device 'cpu', path 'api_cpu'."""
    import torch

    from shared.basis import fit_basis
    from shared.codecs import rans_cpu_bench
    from shared.rdquant import calibrate_step

    calib, test, desc = api_source()
    D = calib.shape[1]
    basis = calibrate_step(fit_basis([calib], k=D), [calib], API_TARGET_COS)
    test_t = torch.from_numpy(test).to(torch.bfloat16)
    cases = [(f"{desc.split(' (')[0]} [{T}, {D}], PCA K={D}", test_t[torch.arange(T) % len(test_t)].contiguous(),
              basis, float(basis.meta["rans_step"])) for T in (CPU_API_TOKENS[:1] if quick else CPU_API_TOKENS)]
    cases += rans_cpu_bench.synthetic_cases(T=1024 if quick else 4096, ks=CPU_API_SYNTHETIC_K[:2] if quick
                                      else CPU_API_SYNTHETIC_K, target_cos=API_TARGET_COS)
    machine = _cpu_model()
    for row in rans_cpu_bench.benchmark_cpu_pipeline(cases, threads=1, reps=repeats, check_reference=not quick):
        res.add(backend="rans", device="cpu", path="api_cpu", cpu_model=machine, source=desc,
                target_gbps=CPU_API_TARGET_GBPS, **row)


def plot_api_cpu(df, name: str = "09_backend_bench_cpu"):
    """GB/s of bf16 per CPU second through the CPU path, each way, per case, beside the target."""
    plt = apply_style()
    rows = df[df.path == "api_cpu"] if "path" in df else df.iloc[:0]
    if rows.empty:
        return
    api = rows[(rows.stage == "api") & (rows.metric == "gbps")]
    cases = list(dict.fromkeys(api.case))
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.75 * len(cases)))
    y = np.arange(len(cases))
    for off, direction, color in ((-0.2, "encode", "#0072B2"), (0.2, "decode", "#E69F00")):
        v = [float(api[(api.case == c) & (api.direction == direction)].value.iloc[0]) for c in cases]
        ax.barh(y + off, v, height=0.38, color=color, label=f"TensorCodec.{direction} (bf16 CPU tensor)")
        for yi, vi in zip(y + off, v):
            ax.annotate(f"{vi:.2f}", (vi, yi), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    target = float(rows.target_gbps.dropna().iloc[0])
    ax.axvline(target, color="#D55E00", ls="--", label=f"target {target:g} GB/s each way")
    ax.set_yticks(y, cases)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s of bf16 per CPU second (one core, median)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(cases) > 3 else -0.4), ncol=3, fontsize=9)
    met = sum(min(float(api[(api.case == c) & (api.direction == d)].value.iloc[0]) for d in ("encode", "decode"))
              >= target for c in cases)
    fig.suptitle(f"PoC 09: the compute codec on one CPU core ({rows.cpu_model.iloc[0]}): {met} of {len(cases)} "
                 f"cases reach {target:g} GB/s both ways", fontsize=11)
    save_figure(fig, name, "09_backend_bench.csv")


def plot_api(df, name: str = "09_backend_bench_api"):
    """GB/s of bf16 through the API against tensor size, beside the pinned PCIe copy."""
    plt = apply_style()
    rows = df[df.path.isin(["api", "api_batched", "pcie_copy"])] if "path" in df else df.iloc[:0]
    if rows.empty:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)

    def ratios(path, lane):
        r = rows[(rows.path == path) & (rows.metric == "ratio")]
        r = r[r.lane_tokens.astype(str) == lane].value if "lane_tokens" in r else r.value
        return f"ratio {r.min():.2f}x" if r.min() == r.max() else f"ratio {r.min():.2f}-{r.max():.2f}x"
    for ax, direction, copy_metric in zip(axes, ("encode", "decode"), ("d2h_gbps", "h2d_gbps")):
        api = rows[(rows.path == "api") & (rows.metric == f"{direction}_gbps")].sort_values("tensor_mb")
        api_lanes = api.lane_tokens.astype(str) if "lane_tokens" in api else None
        pcie = rows[(rows.path == "pcie_copy") & (rows.metric == copy_metric) & rows.batched.isna()] \
            if "batched" in rows else rows[(rows.path == "pcie_copy") & (rows.metric == copy_metric)]
        pcie = pcie.sort_values("tensor_mb")
        batch = rows[(rows.path == "api_batched") & (rows.metric == f"{direction}_gbps")]
        lanes = batch.lane_tokens.astype(str) if "lane_tokens" in batch else None
        for lane, g in (api.groupby(api_lanes) if api_lanes is not None else [("default", api)]):
            default = lane == "default"
            earlier = earlier_run(g, rows)
            ax.plot(g.tensor_mb, g.value, "o-" if default else "o:", color="#0072B2" if default else "#56B4E9",
                    label=f"TensorCodec.encode / .decode (one tensor a call, lane tokens {lane}, {ratios('api', lane)})"
                          + (f" [some sizes: {earlier}]" if earlier else ""))
        if direction == "encode":  # encode_many_async calls queued, then their results: a pipeline's steady state
            q = rows[(rows.path == "api") & (rows.metric == "encode_gbps_queued")]
            q = q[q.lane_tokens.astype(str) == "default"] if "lane_tokens" in q else q
            if len(q):
                ax.plot(q.sort_values("tensor_mb").tensor_mb, q.sort_values("tensor_mb").value, "o--", color="#E69F00",
                        label=f"one tensor a call, {API_QUEUE} calls queued (encode_many_async) before their results are read")
            qb = rows[(rows.path == "api_batched") & (rows.metric == "encode_gbps_queued")]
            qb = qb[qb.lane_tokens.astype(str) == "default"] if "lane_tokens" in qb else qb
            if len(qb):
                ax.plot(qb.tensor_mb, qb.value, "D", mfc="none", color="#009E73", ms=11,
                        label=f"the 60-tensor list, {API_QUEUE} calls queued (encode_many_async)")
        ax.plot(pcie.tensor_mb, pcie.value, "s--", color="#D55E00",
                label="pinned PCIe copy (device->host beside encode, host->device beside decode)")
        ax.plot(pcie.tensor_mb, API_TARGET_PCIE * pcie.value, ":", color="#D55E00", lw=1.2,
                label=f"{API_TARGET_PCIE:g}x that copy (the target from 64 MB up)")
        for (lane, g), marker, color in zip(batch.groupby(lanes) if lanes is not None else [("default", batch)],
                                            "D^v", ("#009E73", "#CC79A7", "#56B4E9")):
            earlier = earlier_run(g, rows)
            ax.plot(g.tensor_mb, g.value, marker, color=color, ms=9,
                    label=f"encode_many / decode_many: 60 tensors of 1024x192 in one call (lane tokens {lane}, "
                          f"{ratios('api_batched', lane)})"
                          + (f" [{earlier}]" if earlier else ""))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (MB of bf16)")
        ax.set_title(direction)
    axes[0].set_ylabel("GB/s of original bf16 bytes (log)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=9)
    device = rows.device.iloc[0]
    fig.suptitle(f"PoC 09: the compute codec through its API on {device} vs the PCIe copy it must beat "
                 f"(cos >= {API_TARGET_COS}; steady calls, median)", fontsize=11)
    save_figure(fig, name, "09_backend_bench.csv")


def plot(csv: str = "09_backend_bench", name: str = "09_backend_bench"):
    from shared.results import legend_outside, series_style

    plt = apply_style()
    df = load(csv)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    frame_paths = ["cpu_session", "gpu_batch", "nvdec_cuda"]
    rows = df[df.path.isin(frame_paths + ["gpu_planes"])]
    on_gpu = {f"{r.backend} {r.setting}": r.path != "cpu_session" for r in rows.itertuples()}
    # ordered: GPU backends, then CPU ones, each by name; a colour and marker each, GPU dashed, CPU solid
    labels = sorted(on_gpu, key=lambda lab: (not on_gpu[lab], lab))
    styles = {lab: series_style(i) for i, lab in enumerate(labels)}
    planes_x = 2 ** 12.2  # where the whole-matrix rows (no frames) are drawn
    handles = {}
    for ax, direction in zip(axes, ("encode", "decode")):
        sel = rows[rows.metric == f"{direction}_gbps_planes"]
        for (backend, setting, path), g in sel.groupby(["backend", "setting", "path"]):
            label, cpu = f"{backend} {setting}", path == "cpu_session"
            st = styles[label]
            if path == "gpu_planes":
                (h,) = ax.plot([planes_x] * len(g), g.value, ls="none", ms=8, mfc="none", mew=1.6, **st)
            else:
                g = g.sort_values("frame_size")
                (h,) = ax.plot(g.frame_size, g.value, "-" if cpu else "--", **st)
            handles.setdefault(f"{label} ({'CPU' if cpu else 'GPU'})", h)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([256, 512, 1024, 2048, planes_x], ["256", "512", "1024", "2048", "whole\nmatrix"])
        ax.set_xlabel("frame side (pixels)")
        ax.set_title(f"{direction}")
        ax.tick_params(which="both", labelleft=True)
    axes[0].set_ylabel("throughput (GB/s of plane bytes, log)")
    order = sorted(handles, key=lambda lab: labels.index(lab.rsplit(" (", 1)[0]))
    handles = {lab: handles[lab] for lab in order}
    handles["hollow markers at 'whole matrix': the [T, K] matrix coded whole, no frames"] = plt.Line2D(
        [], [], color="0.4", marker="o", mfc="none", ls="")
    legend_outside(axes[1], list(handles.values()), list(handles.keys()))
    gpu = df[df.device != "cpu"].device
    dec = rows[rows.metric == "decode_gbps_planes"]
    fast = dec[dec.path != "cpu_session"].value.max()
    video = dec[dec.backend.isin(["x265", "nvdec-hevc", "ffv1"])].value.max()
    fig.suptitle(f"PoC 09: GPU entropy coders decode up to {fast:.0f} GB/s; the video codecs at most {video:.2f} GB/s "
                 f"({gpu.iloc[0] if len(gpu) else 'cpu'}; CPU rows: its host CPU)", x=0.02, ha="left")
    axes[0].annotate(f"planes: {df.source.dropna().iloc[0]}", (0.01, 0.01), xycoords="axes fraction", fontsize=7,
                     color="0.4")
    save_figure(fig, name, f"{csv}.csv")


def merge_rows(path: Path, frame, replaced: list[str]) -> None:
    """Writes `frame` into the CSV at path, in place of its rows of the `path` kinds in replaced;
    the file's other rows (other backends, sections measured on other machines) stay."""
    import pandas as pd

    if path.exists():
        old = pd.read_csv(path, dtype=CSV_DTYPES)
        frame = pd.concat([old[~old.get("path", pd.Series(index=old.index)).isin(replaced)], frame])
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run: CPU backends, 256-pixel frames, small planes")
    ap.add_argument("--sizes", default=",".join(map(str, FRAME_SIZES)), help="frame sides, comma-separated")
    ap.add_argument("--backends", default="", help="only backends whose names start with these (comma-separated)")
    ap.add_argument("--tokens", type=int, default=TOKENS, help="T of the plane matrix")
    ap.add_argument("--components", type=int, default=COMPONENTS, help="K of the plane matrix")
    ap.add_argument("--channels", type=int, default=CHANNELS, help="D of the bf16 tensor (synthetic source)")
    ap.add_argument("--cpu-repeats", type=int, default=CPU_REPEATS)
    ap.add_argument("--gpu-repeats", type=int, default=GPU_REPEATS)
    ap.add_argument("--synthetic", action="store_true", help="ignore exported real planes; use synthetic ones")
    ap.add_argument("--source", default=SOURCE, choices=sorted(REAL_CHANNELS), help="which exported real planes")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    ap.add_argument("--api", action="store_true",
                    help="only the compute codec through its API by tensor size (GPU), merged into the CSV by path")
    ap.add_argument("--api-sizes", default=",".join(map(str, API_MB)), help="tensor sizes for --api, MB")
    ap.add_argument("--profile", action="store_true",
                    help="only the GPU time of each kernel of the API's eager calls (kernel-only rows path=profile, merged)")
    ap.add_argument("--api-cpu", action="store_true",
                    help="only the compute codec's CPU path on one core, stage by stage (rows path=api_cpu, merged)")
    ap.add_argument("--out", default=None, help="CSV path (default results/09_backend_bench.csv); --api, --profile "
                    "and --api-cpu merge their rows into it, and no figure is drawn")
    ap.add_argument("--merge", action="store_true",
                    help="replace only this run's backends in an existing CSV (runs split by the wheels they need)")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.tokens, args.components, args.channels, args.cpu_repeats = "256", 1024, 512, 1024, 1
    if args.api and not args.plot_only:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--api times the GPU path of the compute codec: it needs a CUDA GPU")
        res = ResultsWriter("09", "backend_bench", gpu=True)
        path = Path(args.out) if args.out else res.path
        # the other backends' rows stay; this run's API rows replace the earlier run's, saved after each size
        bench_api(res, torch, [float(s) for s in args.api_sizes.split(",")],
                  lambda: merge_rows(path, res.frame(), ["api", "api_batched", "pcie_copy"]))
        print(f"merged {len(res.rows)} API rows into {path}")
        args.plot_only = True
    if args.profile and not args.plot_only:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--profile times the GPU path of the compute codec: it needs a CUDA GPU")
        res = ResultsWriter("09", "backend_bench", gpu=True)
        bench_profile(res, torch)
        path = Path(args.out) if args.out else res.path
        merge_rows(path, res.frame(), ["profile"])
        print(f"merged {len(res.rows)} profile rows into {path}")
        raise SystemExit(0)
    if args.api_cpu and not args.plot_only:
        res = ResultsWriter("09", "backend_bench")
        bench_api_cpu(res, args.cpu_repeats if args.quick else CPU_API_REPEATS, quick=args.quick)
        path = Path(args.out) if args.out else res.path
        merge_rows(path, res.frame(), ["api_cpu"])
        print(f"merged {len(res.rows)} CPU API rows into {path}")
        if args.out is None:
            plot_api_cpu(load("09_backend_bench"))
        raise SystemExit(0)
    if not args.plot_only:
        res = run(args)
        path = Path(args.out) if args.out else res.path
        import pandas as pd

        old = pd.read_csv(path, dtype=CSV_DTYPES) if path.exists() else None
        frame = res.frame()
        if old is not None and args.merge:  # keep the other backends' rows from an earlier run
            frame = pd.concat([old[~old.backend.isin(set(frame.backend))], frame])
        elif old is not None and "path" in old:  # the CPU API rows (--api-cpu, another machine) are kept
            frame = pd.concat([frame, old[old.path == "api_cpu"]])
        res.save(path, frame=frame)
    if args.out is None:
        plot()
        plot_api(load("09_backend_bench"))
        plot_api_cpu(load("09_backend_bench"))

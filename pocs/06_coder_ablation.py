"""PoC 06 - Where does the ratio come from? Every coder on identical PCA coefficients.

For each tensor source (synthetic PCA-like data, SmolLM2 layer-15 K and V, the embedded diffusion
transformer's image stream) every capture is projected onto a leave-one-out PCA basis with all
components (K = D), so only quantization and coding decide the ratio. Two quantizers:

  per-channel 8-bit planes (the frame pipeline's quantizer), coded by libx265 lossless and at
      constant QP (a sweep), FFV1, zstd, the nvCOMP algorithms (GPU), this project's rANS coder,
      and the planes' empirical entropy (the bound a memoryless per-component coder can reach);
  one shared step (shared/rdquant.py), searched per capture for cos 0.999 / 0.99 / 0.97, coded by
      the compute codec's rANS (shared/codecs/rans.py), zstd, libx265 lossless (where the symbols
      fit 8 bits) and nvCOMP ANS (GPU), with the symbols' entropy bound; also the shared step
      with water-filling (components whose variance is below step^2/12 dropped).

Rows: ratio (bf16 bytes of the tensors / coder payload plus quantizer parameters; no container
header), cos_mean, cos_min (worst capture), and each coder's encode/decode speed in GB/s of
original bf16 bytes (its own stage only: planes or symbols in, bytes out). ratio_at_target is the
ratio at exactly the target cos: for x265's QP sweep interpolated (log ratio, linear in cos)
between the bracketing QPs. On a GPU, also the whole compute codec on an H200-sized tensor
(benchmark_cuda: bf16 CUDA tensor -> projection + quantization -> rANS -> payload in GPU memory,
and back; CUDA events, after a bit-exact check of the integer stage).

Command:   make poc-06            (or: python pocs/06_coder_ablation.py [--quick] [--sources ...])
           python pocs/06_coder_ablation.py --plot-only     (figure from the CSV)
Writes:    results/06_coder_ablation.csv, figures/06_coder_ablation.png
Sample output (a 2-core CPU machine, full run; speeds are this machine's Python/numpy coders):
    source     coder           quant              target   ratio       cos  enc GB/s  dec GB/s
    llm_k      x265            per_channel_8bit        18    3.00   0.99966    0.0019    0.0181
    llm_k      zstd            per_channel_8bit             2.12   0.99999    0.0040    0.2764
    llm_k      entropy_bound   per_channel_8bit             2.22   0.99999
    llm_k      rans            rd_shared_step      0.999    4.58   0.99900    0.0047    0.0044
    llm_k      entropy_bound   rd_shared_step      0.999    4.71   0.99900
    llm_k      zstd            rd_shared_step      0.999    4.21   0.99900    0.0044    0.3541
    llm_k      x265            rd_shared_step      0.999    4.00   0.99900    0.0023    0.0248
On the GPU machine, `--gpu-rows-only --merge` adds the GPU coders' rows (nvCOMP, the GPU rANS coder
on the same symbols) and the whole-pipeline benchmark; the captures come from `make planes` there.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared import frames as framing  # noqa: E402
from shared.basis import as_float_matrix, leave_one_out  # noqa: E402
from shared.codecs import get_backend, rans, rans_cuda  # noqa: E402
from shared.errors import BackendUnavailable  # noqa: E402
from shared.quant import PerChannelQuantizer  # noqa: E402
from shared.rdquant import CudaProjection, find_step, quality  # noqa: E402
from shared.results import ResultsWriter, announce, apply_style, save_figure  # noqa: E402
from shared.timing import cuda_ms  # noqa: E402

SOURCES = ["synthetic", "llm_k", "llm_v", "diffusion"]
TARGETS = [0.999, 0.99, 0.97]  # cos_mean the shared step is searched for (per capture)
CURVE_TARGETS = [0.9999, 0.995, 0.98, 0.95]  # extra points of the compute codec's curve (figure only)
QPS = [None, 4, 10, 18, 26, 34]  # libx265: None = lossless, else constant QP
PRESET = "medium"  # x265 preset
FRAME = 256  # frame side, pixels
LOSSLESS_PLANE_CODERS = ["ffv1", "zstd"]  # CPU lossless coders of the 8-bit planes
NVCOMP_CODERS = ["nvcomp-ans", "nvcomp-cascaded", "nvcomp-bitcomp", "nvcomp-gdeflate", "nvcomp-zstd", "nvcomp-lz4"]
SYNTHETIC = dict(captures=6, tokens=1024, channels=192, power=1.0)  # Gaussian, eigenvalues i^-power
LLM = dict(layer=15, chunks=6, tokens=1024)  # SmolLM2 KV, as PoC 04
DIFFUSION = dict(seeds=6, step=10, steps=20, grid=8)  # embedded diffusion transformer, one sampler step, as PoC 03;
# grid: its tokens are 8 x 8 patches per image, row-major, images one after another

# GPU pipeline benchmark (bf16 CUDA tensor -> projection -> quantization -> rANS -> payload, and back)
BENCH_SHAPES = [(131072, 1024, 1024), (655360, 192, 192)]  # (T tokens, D channels, K components): 256/240 MiB bf16
BENCH_TARGET_COS = 0.999  # quality the shared step is searched for
BENCH_SPECTRUM_POWER = 1.0  # synthetic eigenvalues lambda_i = i^-power
BENCH_REPEATS = 10  # timed repeats (median)
BENCH_WARMUP = 3
GPU_CAPTURE_REPEATS = 10  # timed repeats of the GPU coder per capture (median)




# ---------------------------------------------------------------------------------------------
# tensor sources: lists of [T, D] captures and their leave-out groups


def synthetic_captures(n: int, tokens: int, channels: int, power: float, seed: int = 0):
    """Synthetic, clearly not a model: Gaussian tokens with eigenvalues i^-power in a random basis."""
    rng = np.random.default_rng(seed)
    q = np.linalg.qr(rng.standard_normal((channels, channels)))[0]
    scale = np.arange(1, channels + 1) ** (-power / 2)
    mean = 0.3 * rng.standard_normal(channels)
    return [((rng.standard_normal((tokens, channels)) * scale) @ q.T + mean).astype(np.float32) for _ in range(n)]


def exported_captures(name: str, n: int):
    """The PoC's captures from the exported activations (`make planes`), split into n, or None."""
    from shared.sources import real_planes

    found = real_planes(name)
    return None if found is None else [as_float_matrix(a) for a in np.split(found[0], n)]


def llm_captures(quick: bool):
    from shared import llm

    try:
        model, tokenizer = llm.load_smollm2()
    except (ImportError, OSError) as e:  # e.g. a GPU machine without the GGUF: the same tensors, exported
        k, v = exported_captures("act_llm_k15", LLM["chunks"]), exported_captures("act_llm_v15", LLM["chunks"])
        if quick or k is None or v is None or LLM["layer"] != 15:
            raise
        print(f"SmolLM2 unavailable ({e}); using its exported layer-15 K/V (data/planes, `make planes`)")
        return {"k": k, "v": v}
    n, tokens = (3, 256) if quick else (LLM["chunks"], LLM["tokens"])
    store = llm.capture_kv(model, llm.text_chunks(tokenizer, n, tokens), f"smollm2_kv_{n}x{tokens}")
    return {kind: [as_float_matrix(t) for t in store.stack(f"layer{LLM['layer']}.{kind}")] for kind in ("k", "v")}


def diffusion_captures(quick: bool):
    import torch
    from shared import diffusion

    seeds, steps, step = (3, 4, 2) if quick else (DIFFUSION["seeds"], DIFFUSION["steps"], DIFFUSION["step"])
    try:
        store = diffusion.capture_tiny_flux(seeds=range(seeds), classes=range(10), steps=steps)
    except (ImportError, OSError) as e:  # e.g. a GPU machine without diffusers: the same tensors, exported
        caps = None if quick else exported_captures("act_diffusion", seeds)
        if caps is None:
            raise
        print(f"tiny FLUX unavailable ({e}); using its exported activations (data/planes, `make planes`)")
        return caps
    return [as_float_matrix(torch.cat([store.load(f"seed{s}_class{c}_step{step:02d}")["act"] for c in range(10)]))
            for s in range(seeds)]


def load_sources(names, quick: bool) -> dict:
    out = {}
    if "synthetic" in names:
        cfg = dict(SYNTHETIC, captures=3, tokens=256) if quick else SYNTHETIC
        out["synthetic"] = synthetic_captures(cfg["captures"], cfg["tokens"], cfg["channels"], cfg["power"])
    if {"llm_k", "llm_v"} & set(names):
        kv = llm_captures(quick)
        for kind in ("k", "v"):
            if f"llm_{kind}" in names:
                out[f"llm_{kind}"] = kv[kind]
    if "diffusion" in names:
        try:
            out["diffusion"] = diffusion_captures(quick)
        except Exception as e:  # noqa: BLE001 - a missing checkpoint is reported, the other sources still run
            print(f"diffusion source skipped: {e}")
    return out


# ---------------------------------------------------------------------------------------------
# coders: each takes an integer [T, K] matrix and returns (payload bytes, decode function)


def plane_frames(planes: np.ndarray, frame: int):
    """Frames of the planes. The frame packer fills the unused planes of the last frame with
    copies of the last tile, which a lossless video coder pays for in full (here: a third of the
    bytes for 1024 x 192 planes in 256 x 256 frames); the ablation zero-fills them instead, so the
    video codec is charged for the data only (they are never read back)."""
    layout = framing.layout_for(*planes.shape, height=min(frame, framing.DEFAULT_FRAME))
    frames = framing.to_frames(planes, layout)
    flat = frames.reshape(-1, *frames.shape[2:])
    flat[layout.n_tiles:] = 0
    return frames, layout


def frame_coder(backend: str, settings: dict, frame: int):
    """A frames/bytes backend of the registry on uint8 planes [T, K]."""
    be = get_backend(backend)

    def encode(planes):
        frames, layout = plane_frames(planes, frame)
        with be.encoder(layout.width, layout.height, **settings) as enc:
            enc.submit(frames)
            payload = enc.flush()

        def decode(blob):
            with be.decoder(layout.width, layout.height, **settings) as dec:
                dec.submit(blob)
                return framing.from_frames(dec.flush(), layout)
        return payload, decode
    return encode


def rans_coder(planes_or_symbols):
    payload = rans.encode(np.asarray(planes_or_symbols, np.int32))
    return payload, rans.decode


def zstd_symbols_coder(symbols):
    """zstd (level 19) on the symbols, component-major, in the narrowest integer type that holds them."""
    import zstandard

    dtype = np.int8 if np.abs(symbols).max() < 128 else np.int16 if np.abs(symbols).max() < 32768 else np.int32
    raw = np.ascontiguousarray(symbols.T.astype(dtype))
    payload = zstandard.ZstdCompressor(level=19).compress(raw.tobytes())

    def decode(blob):
        return np.frombuffer(zstandard.ZstdDecompressor().decompress(blob), dtype).reshape(raw.shape).T.astype(
            np.int32)
    return payload, decode


def predicted_bound_bytes(symbols: np.ndarray, grid: int | None = None) -> float:
    """What prediction along the tokens could add to a memoryless coder: per component, the
    smallest empirical entropy (bytes) of its symbols or of their residual after a predictor.
    Predictors: the previous token; on a grid x grid patch layout (diffusion) also the patch
    above, the mean of left and above, and the median of left, above and left + above - upper-left.
    A bound for a per-component choice of predictor, not a coder."""
    s = symbols.astype(np.int64)
    residuals = [s, s - np.concatenate([np.zeros_like(s[:1]), s[:-1]])]
    if grid is not None and len(s) % (grid * grid) == 0:
        g = s.reshape(-1, grid, grid, s.shape[1])
        left, up, upleft = (np.zeros_like(g) for _ in range(3))
        left[:, :, 1:], up[:, 1:], upleft[:, 1:, 1:] = g[:, :, :-1], g[:, :-1], g[:, :-1, :-1]
        med = np.median(np.stack([left, up, left + up - upleft]), axis=0).astype(np.int64)
        residuals += [(g - p).reshape(s.shape) for p in (left, up, (left + up) // 2, med)]
    per = np.array([[rans.entropy_bound_bytes(r[:, [k]].astype(np.int32)) for k in range(s.shape[1])]
                    for r in residuals])
    return float(per.min(0).sum())


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def run_coder(name, encode, data, check, n_bf16_bytes):
    """Encode every capture's integer matrix, decode, check bit-exactness; sizes and speeds."""
    total, t_enc, t_dec = 0, 0.0, 0.0
    for arr in data:
        (payload, decode), dt = timed(encode, arr)
        back, dt2 = timed(decode, payload)
        if check and not np.array_equal(np.asarray(back).astype(np.int64), np.asarray(arr).astype(np.int64)):
            raise AssertionError(f"{name} is not lossless on these integers")
        total += len(payload)
        t_enc += dt
        t_dec += dt2
    return dict(bytes=total, encode_gbps=n_bf16_bytes / t_enc / 1e9, decode_gbps=n_bf16_bytes / t_dec / 1e9)


# ---------------------------------------------------------------------------------------------
# the ablation


def interp_ratio_at(points, target):
    """Ratio at exactly cos = target from (cos, ratio) points: log-ratio linear between neighbours."""
    pts = sorted(points)
    for (c0, r0), (c1, r1) in zip(pts, pts[1:]):
        if c0 <= target <= c1 and c1 > c0:
            w = (target - c0) / (c1 - c0)
            return float(math.exp((1 - w) * math.log(r0) + w * math.log(r1)))
    return None


def ablate_source(res: ResultsWriter, source: str, caps: list, quick: bool, gpu: bool, cpu_coders: bool = True):
    """Every coder on this source's coefficients. cpu_coders=False: only the GPU coders' rows
    (a GPU run whose CPU rows come from a CPU machine)."""
    grid = DIFFUSION["grid"] if source == "diffusion" else None
    D = caps[0].shape[1]
    n_bf16 = sum(x.size for x in caps) * 2
    bases = [b for _, b in leave_one_out(caps, D)]
    coeffs = [b.project(x) for b, x in zip(bases, caps)]
    common = dict(source=source, k=D, n_captures=len(caps), tokens=caps[0].shape[0])
    printed = []

    def report(coder, quant, q, sizes, extra_bytes, **settings):
        ratio = n_bf16 / (sizes["bytes"] + extra_bytes)
        row = dict(common, quant=quant, **settings)
        res.add(backend=coder, metric="ratio", value=ratio, unit="x", **row)
        res.add(backend=coder, metric="cos_mean", value=q["cos_mean"], unit="1", **row)
        res.add(backend=coder, metric="cos_min", value=q["cos_min"], unit="1", **row)
        for m in ("encode_gbps", "decode_gbps"):
            if sizes.get(m) is not None:
                res.add(backend=coder, metric=m, value=sizes[m], unit="GB/s", **row)
        printed.append((coder, quant, settings.get("target", settings.get("qp", "")), ratio, q["cos_mean"], sizes.get("encode_gbps"),
                        sizes.get("decode_gbps")))
        return ratio

    def recon_quality(dequantized):
        per = [quality(x.astype(np.float64), b.reconstruct(c).astype(np.float64), "cos")
               for x, b, c in zip(caps, bases, dequantized)]
        return dict(cos_mean=float(np.mean(per)), cos_min=float(min(per)))

    # 1. per-channel 8-bit planes: one quality, many coders
    quants = [PerChannelQuantizer.fit(c, 8) for c in coeffs]
    planes = [q.quantize(c) for q, c in zip(quants, coeffs)]
    q8 = recon_quality([q.dequantize(p) for q, p in zip(quants, planes)])
    qpar = sum(len(q.to_bytes()) for q in quants)
    frame = 64 if quick else FRAME
    preset = "ultrafast" if quick else PRESET  # (x265 'lossless' at preset medium is not bit-exact on 64x64 frames)
    x265_points = []
    for qp in ([None, 18] if quick else QPS) if cpu_coders else []:
        settings = {"qp": qp, "preset": preset}
        enc = frame_coder("x265", settings, frame)
        if qp is None:
            r = report("x265", "per_channel_8bit", q8, run_coder("x265", enc, planes, True, n_bf16), qpar,
                       qp="lossless")
            x265_points.append((q8["cos_mean"], r))
            continue
        decoded, total, t_enc, t_dec = [], 0, 0.0, 0.0
        for p in planes:
            (payload, dec), dt = timed(enc, p)
            back, dt2 = timed(dec, payload)
            decoded.append(back)
            total, t_enc, t_dec = total + len(payload), t_enc + dt, t_dec + dt2
        qq = recon_quality([q.dequantize(b) for q, b in zip(quants, decoded)])
        r = report("x265", "per_channel_8bit", qq, dict(bytes=total, encode_gbps=n_bf16 / t_enc / 1e9,
                                                           decode_gbps=n_bf16 / t_dec / 1e9), qpar, qp=qp)
        x265_points.append((qq["cos_mean"], r))
    for name in LOSSLESS_PLANE_CODERS if cpu_coders else []:
        report(name, "per_channel_8bit", q8, run_coder(name, frame_coder(name, {}, frame), planes, True, n_bf16),
               qpar)
    if cpu_coders:
        report("rans", "per_channel_8bit", q8, run_coder("rans", rans_coder, planes, True, n_bf16), qpar)
        report("entropy_bound", "per_channel_8bit", q8,
               dict(bytes=sum(rans.entropy_bound_bytes(p.astype(np.int32)) for p in planes)), qpar)
    if gpu:
        gpu_plane_rows(report, planes, q8, qpar, n_bf16)

    # 2. one shared step per capture, searched for each target
    for target in TARGETS + ([] if quick else CURVE_TARGETS):
        for water_fill in (False, True):
            rdq = [find_step(c, target, "cos", reconstruct=b.reconstruct, reference=x, water_fill=water_fill)
                   for c, b, x in zip(coeffs, bases, caps)]
            symbols = [q.quantize(c) for q, c in zip(rdq, coeffs)]
            qrd = recon_quality([q.dequantize(s) for q, s in zip(rdq, symbols)])
            rpar = sum(len(q.to_bytes()) for q in rdq)
            quant = "rd_water_fill" if water_fill else "rd_shared_step"
            if cpu_coders:
                report("rans", quant, qrd, run_coder("rans", rans_coder, symbols, True, n_bf16), rpar, target=target)
                report("entropy_bound", quant, qrd,
                       dict(bytes=sum(rans.entropy_bound_bytes(s) for s in symbols)), rpar, target=target)
                if not water_fill:
                    report("predicted_bound", quant, qrd,
                           dict(bytes=sum(predicted_bound_bytes(s, grid) for s in symbols)), rpar, target=target)
            if water_fill or target not in TARGETS:
                continue
            if cpu_coders:
                report("zstd", quant, qrd, run_coder("zstd", zstd_symbols_coder, symbols, True, n_bf16), rpar,
                       target=target)
            offsets = [s.min(0) for s in symbols]
            if all(int((s - o).max()) < 256 for s, o in zip(symbols, offsets)):
                as_planes = [(s - o).astype(np.uint8) for s, o in zip(symbols, offsets)]
                obytes = sum(o.size * 4 for o in offsets)
                if cpu_coders:
                    report("x265", quant, qrd, run_coder("x265", frame_coder("x265", {"qp": None, "preset": preset},
                                                                             frame), as_planes, True, n_bf16),
                           rpar + obytes, target=target, qp="lossless")
                if gpu:
                    gpu_plane_rows(report, as_planes, qrd, rpar + obytes, n_bf16, target=target, quant=quant,
                                   only=["nvcomp-ans"])
            if gpu:
                report("rans-cuda", quant, qrd, gpu_rans_sizes(symbols, n_bf16), rpar, target=target)
        for_target = interp_ratio_at(x265_points, target)
        if for_target is not None:
            res.add(backend="x265", metric="ratio_at_target", value=for_target, unit="x", quant="per_channel_8bit",
                    target=target, **common)
    return printed


def gpu_plane_rows(report, planes, q, extra, n_bf16, only=None, **settings):
    """nvCOMP algorithms on the same uint8 planes (component-major), where nvCOMP is installed."""
    for name in only or NVCOMP_CODERS:
        try:
            sizes = run_coder(name, frame_coder(name, {}, FRAME), planes, True, n_bf16)
        except BackendUnavailable as e:
            print(f"{name} skipped: {e}")
            return
        sizes.pop("encode_gbps"), sizes.pop("decode_gbps")  # host-staged sessions: speeds belong to PoC 09
        report(name, settings.pop("quant", "per_channel_8bit"), q, sizes, extra, **settings)


def gpu_rans_sizes(symbols, n_bf16: int) -> dict:
    """The GPU coder on real symbols: it must write the CPU coder's bytes and decode them back
    (checked), then encode_cuda/decode_cuda are timed per capture (CUDA events, median)."""
    import torch

    stream = torch.cuda.current_stream()
    total, t_enc, t_dec = 0, 0.0, 0.0
    for s in symbols:
        t = torch.from_numpy(s).cuda()
        payload = rans_cuda.encode_cuda(t)
        if bytes(payload.cpu().numpy()) != rans.encode(s) or not torch.equal(rans_cuda.decode_cuda(payload), t):
            raise AssertionError("GPU rANS does not match the CPU coder on real symbols")
        total += len(payload)
        t_enc += cuda_ms(lambda i: rans_cuda.encode_cuda(t), GPU_CAPTURE_REPEATS, 2, stream)
        t_dec += cuda_ms(lambda i: rans_cuda.decode_cuda(payload), GPU_CAPTURE_REPEATS, 2, stream)
    return dict(bytes=total, encode_gbps=n_bf16 / (t_enc * 1e-3) / 1e9, decode_gbps=n_bf16 / (t_dec * 1e-3) / 1e9)


def synthetic_gpu_tensor(T: int, D: int, power: float, seed: int = 0):
    """bf16 CUDA [T, D]: Gaussian with eigenvalues i^-power in a random orthonormal basis, plus a mean."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn((D, D), device="cuda", generator=g))
    scale = torch.arange(1, D + 1, device="cuda", dtype=torch.float32) ** (-power / 2)
    mean = 0.3 * torch.randn(D, device="cuda", generator=g)
    x = torch.empty((T, D), dtype=torch.bfloat16, device="cuda")
    for start in range(0, T, 65536):  # in slices, to keep the float32 temporaries small
        z = torch.randn((min(65536, T - start), D), device="cuda", generator=g) * scale
        x[start:start + len(z)] = (z @ q.T + mean).to(torch.bfloat16)
    return x


def gpu_basis(x, sample: int = 65536):
    """PCA of the first `sample` tokens on the GPU: (mean [D], components [D, D]) float32."""
    import torch

    xs = x[:sample].float()
    mean = xs.mean(0)
    cov = (xs - mean).T @ (xs - mean) / (len(xs) - 1)
    vals, vecs = torch.linalg.eigh(cov.double())
    return mean, vecs.flip(1).float().contiguous()


def benchmark_cuda(T: int, D: int, K: int, target_cos: float = BENCH_TARGET_COS, repeats: int = BENCH_REPEATS,
                   warmup: int = BENCH_WARMUP, power: float = BENCH_SPECTRUM_POWER, lane_tokens: int | None = None,
                   profile: bool = False, source: str = "synthetic") -> dict:
    """The whole compute codec on the GPU, each direction, in GB/s of original bf16 bytes.

    Encode: bf16 CUDA [T, D] -> projection + quantization (one fused kernel) -> rANS -> payload
    (uint8 CUDA). Decode: payload -> rANS -> dequantization + reconstruction (one fused kernel)
    -> bf16 [T, D]. The integer stage is checked bit-exact (decoded symbols == encoded symbols,
    and the same payload as encode_cuda without the fused statistics) before anything is timed.
    source "synthetic": a Gaussian with a power-law spectrum (not a model's activations);
    "llm_k15": SmolLM2's layer-15 K cache exported by `make planes`, its 6144 rows cycled to T
    (per-component statistics, which rANS codes, are those of the real tensor)."""
    import torch

    if source == "synthetic":
        x = synthetic_gpu_tensor(T, D, power)
    else:
        from shared.sources import real_planes

        found = real_planes("act_" + source)
        if found is None:
            raise FileNotFoundError("no exported real activations: run `make planes` first (data/planes/)")
        real = torch.from_numpy(found[0]).cuda()
        if real.shape[1] != D:
            raise ValueError(f"{source} has D={real.shape[1]}, the benchmark shape asks for D={D}")
        x = real[torch.arange(T, device="cuda") % len(real)].to(torch.bfloat16)
    mean, comps = gpu_basis(x)
    comps = comps[:, :K].contiguous()
    sample = x[:16384].float()
    coeffs = (sample - mean) @ comps
    q = find_step(coeffs, target_cos, metric="cos", reconstruct=lambda c: c @ comps.T + mean, reference=sample)
    step = q.step
    proj = CudaProjection(mean, comps)

    def encode():  # one host sync: the coder's (the quantizer's overflow check rides along as guard)
        sym, stats, amax = proj.quantize_unchecked(x, step)
        return rans_cuda.encode_cuda(sym, stats=stats, guard=amax, lane_tokens=lane_tokens)

    def decode(payload):
        return proj.reconstruct(rans_cuda.decode_cuda(payload), step)

    sym, stats = proj.quantize(x, step)
    payload = rans_cuda.encode_cuda(sym, stats=stats, lane_tokens=lane_tokens)
    sym_back = rans_cuda.decode_cuda(payload)
    matches = bool(torch.equal(sym_back, sym)) and bool(
        torch.equal(rans_cuda.encode_cuda(sym, lane_tokens=lane_tokens), payload))
    if not matches:
        raise AssertionError("GPU rANS round trip is not bit-exact")
    x_hat = decode(payload)
    cos = quality(x.float(), x_hat.float(), "cos")
    n_bytes = x.numel() * 2
    out = dict(source=source if source != "synthetic" else "synthetic_gpu", T=T, D=D, K=K, step=step,
               target_cos=target_cos, cos_mean=cos, ratio=n_bytes / len(payload),
               payload_bytes=len(payload), matches=matches,
               lane_tokens=lane_tokens or rans.default_lane_tokens(T, K))
    out["entropy_bound_bytes"] = rans.entropy_bound_bytes(sym)
    out["payload_over_bound"] = len(payload) / out["entropy_bound_bytes"]
    stream = torch.cuda.current_stream()
    t_enc = cuda_ms(lambda i: encode(), repeats, warmup, stream)
    t_dec = cuda_ms(lambda i: decode(payload), repeats, warmup, stream)
    t_quant = cuda_ms(lambda i: proj.quantize(x, step), repeats, warmup, stream)
    t_rans_enc = cuda_ms(lambda i: rans_cuda.encode_cuda(sym, stats=stats, lane_tokens=lane_tokens), repeats, warmup,
                         stream)
    t_rans_dec = cuda_ms(lambda i: rans_cuda.decode_cuda(payload), repeats, warmup, stream)
    t_recon = cuda_ms(lambda i: proj.reconstruct(sym, step), repeats, warmup, stream)
    gbps = lambda ms: n_bytes / (ms * 1e-3) / 1e9  # noqa: E731
    out.update(encode_ms=t_enc, decode_ms=t_dec, encode_gbps=gbps(t_enc), decode_gbps=gbps(t_dec),
               quantize_ms=t_quant, rans_encode_ms=t_rans_enc, rans_decode_ms=t_rans_dec, reconstruct_ms=t_recon)
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof

        with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
            for _ in range(3):
                decode(encode())
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=24))
    return out


def add_bench_rows(res: ResultsWriter, r: dict):
    settings = dict(source=r["source"], tokens=r["T"], channels=r["D"], k=r["K"], target=r["target_cos"],
                    lane_tokens=r["lane_tokens"], quant="rd_shared_step")
    for metric, unit in [("encode_gbps", "GB/s"), ("decode_gbps", "GB/s"), ("ratio", "x"), ("cos_mean", "1"),
                         ("encode_ms", "ms"), ("decode_ms", "ms"), ("quantize_ms", "ms"), ("rans_encode_ms", "ms"),
                         ("rans_decode_ms", "ms"), ("reconstruct_ms", "ms"), ("payload_over_bound", "x")]:
        res.add(backend="compute-codec-cuda", metric=metric, value=r[metric], unit=unit, **settings)



# ---------------------------------------------------------------------------------------------


def plot(csv, png):
    """Ratio against cos_mean for every coder, one panel per source, from the CSV alone."""
    import pandas as pd

    plt = apply_style()
    df = pd.read_csv(csv)
    df = df[df["source"].isin(SOURCES)]
    sources = [s for s in SOURCES if s in set(df["source"])]
    fig, axes = plt.subplots(1, max(1, len(sources)), figsize=(4.4 * max(1, len(sources)), 5.4), squeeze=False)
    nines = lambda c: -np.log10(np.clip(1 - np.asarray(c, float), 1e-7, None))  # noqa: E731
    ticks = [0.9, 0.97, 0.99, 0.997, 0.999, 0.9999, 0.99999]
    keys = ["backend", "quant", "qp", "target"]
    from shared.results import legend_outside, series_style

    # Coders first (ours, then peers on the same symbols, then the video path), then the two bounds:
    # each its own colour and marker; the bounds drawn last, thin and black, so no coder hides them.
    coders = [("rans", "rd_shared_step", "compute codec: shared step + rANS"),
              ("rans", "rd_water_fill", "compute codec + water-filling"),
              ("zstd", "rd_shared_step", "zstd-19 on the shared-step symbols"),
              ("nvcomp-ans", "rd_shared_step", "nvCOMP ANS on the shared-step symbols"),
              ("x265", "rd_shared_step", "x265 lossless on the shared-step symbols"),
              ("x265", "per_channel_8bit", "x265 QP sweep (lossless..QP34) on 8-bit planes")]
    bounds = [("entropy_bound", "rd_shared_step", dict(color="k", ls=":", lw=1.6, marker=""),
               "entropy bound of the shared-step symbols (theory, not a coder)"),
              ("predicted_bound", "rd_shared_step", dict(color="k", ls="-.", lw=1.2, marker=""),
               "bound with a predictor along tokens (theory)")]
    handles = {}
    gaps = []
    for ax, source in zip(axes[0], sources):
        d = df[df["source"] == source]
        for k in keys:
            if k not in d:
                d = d.assign(**{k: np.nan})
        d = d.assign(**{k: d[k].astype(object).where(d[k].notna(), "-").astype(str) for k in keys})
        wide = d.pivot_table(index=keys, columns="metric", values="value", aggfunc="first").reset_index()
        wide = wide.dropna(subset=["ratio", "cos_mean"])
        pick = lambda b, q: wide[(wide["backend"] == b) & (wide["quant"] == q)].sort_values("cos_mean")  # noqa: E731
        for i, (backend, quant, label) in enumerate(coders):
            g = pick(backend, quant)
            if len(g):
                (h,) = ax.plot(nines(g["cos_mean"]), g["ratio"], "-", ms=5, lw=1.3, zorder=3 if i == 0 else 2, **series_style(i),
                               label=label)
                handles.setdefault(label, h)
        for backend, quant, style, label in bounds:
            g = pick(backend, quant)
            if len(g):
                (h,) = ax.plot(nines(g["cos_mean"]), g["ratio"], zorder=4, **style, label=label)
                handles.setdefault(label, h)
        ours, bound = pick("rans", "rd_shared_step"), pick("entropy_bound", "rd_shared_step")
        both = ours.merge(bound, on="target", suffixes=("", "_b"))
        both = both[both["target"].isin(["0.999", "0.99"])]
        gaps += list(both["ratio_b"] / both["ratio"] - 1)
        lossless = wide[(wide["quant"] == "per_channel_8bit") & ~wide["backend"].isin(["x265", "entropy_bound"])]
        if len(lossless):  # every lossless coder on the 8-bit planes: one grey group, their range written
            label = "lossless coders on the 8-bit planes (FFV1, zstd, nvCOMP x6, rANS)"
            (h,) = ax.plot(nines(lossless["cos_mean"]), lossless["ratio"], "x", color="0.45", ms=6, ls="none",
                           label=label)
            handles.setdefault(label, h)
            ax.annotate(f"{lossless['ratio'].min():.1f}-{lossless['ratio'].max():.1f}x",
                        (nines(lossless["cos_mean"]).mean(), lossless["ratio"].max()), textcoords="offset points",
                        xytext=(-4, 6), fontsize=7, color="0.35", ha="right")
        ax.set_xticks(nines(ticks))
        ax.set_xticklabels([str(t) for t in ticks], rotation=45)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plt.matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(plt.matplotlib.ticker.FuncFormatter(
            lambda v, _: f"{v:g}" if f"{v:g}"[0] in "235" else ""))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel("cos_mean (mean per-token cosine, 1 = exact)")
        ax.set_ylabel("ratio (x: bf16 bytes / payload bytes, log)")
        ax.set_title(source + (" (Gaussian, not a model)" if source == "synthetic" else ""))
    gap = f"; within {100 * min(gaps):.0f}-{100 * max(gaps):.0f}% of the entropy bound at cos 0.99-0.999" if gaps else ""
    fig.suptitle("PoC 06: on identical PCA coefficients the compute codec (shared step + rANS) beats libx265" + gap,
                 x=0.02, ha="left")
    fig.tight_layout()
    legend_outside(fig, list(handles.values()), list(handles.keys()), where="below", ncol=3, fontsize=8)
    save_figure(fig, Path(png).stem, Path(csv).name)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run: small captures, two QPs, fast presets")
    ap.add_argument("--sources", nargs="*", default=SOURCES, choices=SOURCES)
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    ap.add_argument("--gpu-bench-only", action="store_true", help="only the GPU pipeline benchmark (printed)")
    ap.add_argument("--no-gpu", action="store_true", help="skip the GPU rows even where CUDA is available")
    ap.add_argument("--profile", action="store_true", help="print a kernel profile of the GPU benchmark")
    ap.add_argument("--lane-tokens", type=int, nargs="*", default=[0], help="GPU benchmark: tokens per lane (0=auto)")
    ap.add_argument("--shapes", type=str, default=None, help="GPU benchmark shapes 'T,D,K;T,D,K'")
    ap.add_argument("--bench-source", default="synthetic", choices=["synthetic", "llm_k15"],
                    help="GPU benchmark tensor: synthetic, or the exported real SmolLM2 layer-15 K (make planes)")
    ap.add_argument("--merge", action="store_true",
                    help="replace only the CSV rows of this run's device (CPU rows and GPU rows come from two machines)")
    ap.add_argument("--gpu-rows-only", action="store_true",
                    help="on a GPU machine: the GPU coders' rows and the benchmark only (the CPU rows come from a CPU run)")
    args = ap.parse_args()
    csv = Path(__file__).resolve().parent.parent / "results" / "06_coder_ablation.csv"
    if args.plot_only:
        plot(csv, csv.parent.parent / "figures" / "06_coder_ablation.png")
        return
    gpu = False
    if not args.no_gpu:
        try:
            import torch

            gpu = torch.cuda.is_available()
        except ImportError:
            pass
    shapes = BENCH_SHAPES if not args.shapes else [tuple(map(int, s.split(","))) for s in args.shapes.split(";")]
    announce("06")
    res = ResultsWriter("06", "coder_ablation", gpu=gpu)
    if gpu:
        for T, D, K in ([(16384, 192, 192)] if args.quick else shapes):
            for lt in args.lane_tokens:
                r = benchmark_cuda(T, D, K, lane_tokens=lt or None, profile=args.profile, source=args.bench_source)
                print("GPU compute codec matches (bit-exact integer stage):", r["matches"])
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
                add_bench_rows(res, r)
    if args.gpu_bench_only:
        if args.merge and res.rows:
            import pandas as pd

            old = pd.read_csv(csv, dtype={"poc": str})
            res.save(csv, frame=pd.concat([old, res.frame()]))
        return
    print(f"{'source':<11}{'coder':<16}{'quant':<18}{'target':>7}{'ratio':>8}{'cos':>10}{'enc GB/s':>10}"
          f"{'dec GB/s':>10}")
    for source, caps in load_sources(args.sources, args.quick).items():
        for coder, quant, target, ratio, cos, enc, dec in ablate_source(res, source, caps, args.quick, gpu,
                                                                        cpu_coders=not args.gpu_rows_only):
            fmt = lambda v: f"{v:10.4f}" if v is not None else f"{'':>10}"  # noqa: E731
            print(f"{source:<11}{coder:<16}{quant:<18}{target!s:>7}{ratio:8.2f}{cos:10.5f}{fmt(enc)}{fmt(dec)}",
                  flush=True)
    if args.merge and csv.exists():
        import pandas as pd

        new = res.frame()
        old = pd.read_csv(csv, dtype={"poc": str})
        print(f"replacing the {', '.join(sorted(set(new.device)))} rows of {csv.name} ({len(new)} rows)")
        saved = res.save(csv, frame=pd.concat([old[~old.device.isin(set(new.device))], new]))
    else:
        saved = res.save(csv)
    plot(saved, csv.parent.parent / "figures" / "06_coder_ablation.png")


if __name__ == "__main__":
    main()

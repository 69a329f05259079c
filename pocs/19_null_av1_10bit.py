"""PoC 19 - Negative results: do AV1 (4:2:0, one channel per luma plane) or 10-bit HEVC beat HEVC 4:4:4
8-bit on PCA-rotated planes?

The same [T, K] PCA coefficients go through four codec paths at matched settings (lossless, and a
sweep of constant QPs), and each is scored on ratio (bf16 bytes / payload + quantizer parameters)
and quality of the reconstructed tensor (cos_mean, rel_mse, p1):
  hevc444_8bit      libx265 yuv444p, the project's default path (backend "x265")
  hevc444_10bit_x4  libx265 yuv444p10le carrying the same 8-bit planes scaled by 4 (no new information)
  hevc444_10bit_q   libx265 yuv444p10le carrying 10-bit quantized coefficients (finer quantizer)
  av1_420_luma      libsvtav1 yuv420p: every plane becomes the luma of its own frame, chroma constant
                    (SVT-AV1 codes 4:2:0 only; this is the workaround)
On a GPU machine it also records what NVDEC there reports for AV1 and 10-bit HEVC (GetDecoderCaps)
and decodes the 10-bit lossless stream through NVDEC bit-exactly (GPU-only rows); the CPU rows run anywhere.

Source: the LLM KV captures (shared.llm, store 'smollm2_kv', layer 15 K) or the diffusion captures
(shared.diffusion, store 'tiny_flux_block*') when a finished capture store is present; otherwise a
synthetic activation with a heavy-tailed spectrum, labelled source=synthetic.

Command:   make poc-19            (or: python pocs/19_null_av1_10bit.py [--quick] [--source synthetic|llm|diffusion])
Writes:    results/19_null_av1_10bit.csv
Sample output (synthetic 4096 x 1024, K=256, 6 frames of 256x256; CPU rows, then the NVIDIA H200's NVDEC):
    codec             setting     ratio  cos_mean    rel_mse  exact
    hevc444_8bit      lossless     7.54   0.95773   7.58e-02    yes
    hevc444_10bit_q   lossless     5.19   0.95779   7.57e-02    yes
    hevc444_8bit      qp18        18.38   0.95012   9.00e-02      -
    hevc444_10bit_q   qp18        18.35   0.95020   8.99e-02      -
    av1_420_luma      lossless     8.52   0.95773   7.58e-02    yes
    av1_420_luma      qp18        19.94   0.95262   8.50e-02      -
      AV1 420 8-bit: supported=0 engines=0 ... NVDEC decode of the 10-bit lossless HEVC stream: matches (6/6 frames)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1: errors only
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared import frames as framing  # noqa: E402
from shared.basis import fit_basis  # noqa: E402
from shared.captures import DEFAULT_ROOT, CaptureStore  # noqa: E402
from shared.codecs import get_backend  # noqa: E402
from shared.codecs import nvdec  # noqa: E402
from shared.metrics import quality  # noqa: E402
from shared.quant import PerChannelQuantizer  # noqa: E402
from shared.sources import real_planes, synthetic_activation  # noqa: E402
from shared.results import ResultsWriter, apply_style, load, save_figure  # noqa: E402

TOKENS = 4096                 # synthetic activation rows
CHANNELS = 1024               # synthetic activation channels (D)
K = 256                       # PCA components kept
FRAME = 256                   # frame side, pixels (NVDEC decodes 144..8192)
HEVC_QPS = [4, 10, 18, 26]    # x265 constant QPs (0..51); the 10-bit paths get the same nominal QP
AV1_QPS = [4, 10, 18, 26, 40] # SVT-AV1 constant QPs (0..63; its scale is not HEVC's, hence the wider sweep)
X265_PRESET = "medium"        # libx265 preset for every HEVC path
SVT_PRESET = "8"              # SVT-AV1 preset (0 slowest .. 13 fastest)
RHO = 0.9                     # synthetic: AR(1) correlation between neighbouring tokens
SEED = 0


# -- sources -------------------------------------------------------------------------------------------
def captured_activation(kind: str) -> tuple[np.ndarray, str] | None:
    """All captures of one tensor stacked into [T, D], or None when no finished store exists."""
    if kind == "llm" and (exported := real_planes("act_llm_k15")) is not None:
        return exported[0], exported[1]
    stores = {"llm": [("smollm2_kv_6x1024", "layer15.k")],
              "diffusion": [(p.name, "act") for p in sorted(DEFAULT_ROOT.glob("tiny_flux_block*"))]}[kind]
    for name, tensor in stores:
        store = CaptureStore(name)
        if store.manifest_path.exists():
            parts = [t.float().numpy().reshape(-1, t.shape[-1]) for t in store.stack(tensor)]
            return np.concatenate(parts), f"{name}:{tensor}"
    return None


# -- codec paths (PyAV directly for the formats the shared backends do not carry) ---------------------
def _encode(codec: str, pix_fmt: str, images, options: dict) -> list[bytes]:
    """images: list of per-frame plane lists (numpy, already in the pixel format's sample type)."""
    import av

    height, width = images[0][0].shape
    ctx = av.CodecContext.create(codec, "w")
    ctx.width, ctx.height, ctx.pix_fmt, ctx.time_base = width, height, pix_fmt, Fraction(1, 25)
    ctx.options = options
    packets = []
    for i, planes in enumerate(images):
        vf = av.VideoFrame(width, height, pix_fmt)
        for p, plane in enumerate(planes):
            buf = np.frombuffer(vf.planes[p], np.uint8).reshape(plane.shape[0], -1)
            row = plane.view(np.uint8).reshape(plane.shape[0], -1)
            buf[:, : row.shape[1]] = row
        vf.pts = i
        packets += [bytes(pk) for pk in ctx.encode(vf)]
    packets += [bytes(pk) for pk in ctx.encode(None)]
    return packets


def _decode(decoder: str, packets: list[bytes], n_planes: int, dtype) -> np.ndarray:
    import av

    ctx = av.CodecContext.create(decoder, "r")
    frames = []
    for pk in packets:
        frames += ctx.decode(av.Packet(pk))
    frames += ctx.decode(None)
    out = []
    for f in frames:
        planes = []
        for p in range(n_planes):
            plane = f.planes[p]
            h = f.height if p == 0 or f.format.name.startswith("yuv444") else f.height // 2
            w = f.width if p == 0 or f.format.name.startswith("yuv444") else f.width // 2
            planes.append(np.frombuffer(plane, dtype).reshape(h, -1)[:, :w])
        out.append(np.stack(planes) if n_planes > 1 else planes[0])
    return np.stack(out)


def hevc_8bit(frames: np.ndarray, qp):
    with get_backend("x265").encoder(frames.shape[3], frames.shape[2], qp=qp, preset=X265_PRESET) as enc:
        enc.submit(frames)
        payload = enc.flush()
    with get_backend("x265").decoder(frames.shape[3], frames.shape[2]) as dec:
        dec.submit(payload)
        return payload, dec.flush()


def hevc_10bit(frames16: np.ndarray, qp):
    params = "lossless=1" if qp is None else f"qp={qp}"
    packets = _encode("libx265", "yuv444p10le", [list(f) for f in frames16],
                      {"preset": X265_PRESET, "x265-params": f"{params}:log-level=error"})
    return b"".join(packets), _decode("hevc", packets, 3, np.uint16)


def av1_luma(frames: np.ndarray, qp):
    """Every plane of every 4:4:4 frame becomes the luma of one 4:2:0 frame; chroma is constant 128."""
    h, w = frames.shape[2:]
    grey = np.full((h // 2, w // 2), 128, np.uint8)
    images = [[plane, grey, grey] for plane in frames.reshape(-1, h, w)]
    options = {"preset": SVT_PRESET, "svtav1-params": "lossless=1"} if qp is None else {"preset": SVT_PRESET, "qp": str(qp)}
    packets = _encode("libsvtav1", "yuv420p", images, options)
    lumas = _decode("libdav1d", packets, 1, np.uint8)
    return b"".join(packets), lumas.reshape(frames.shape), packets


def plane_psnr(a: np.ndarray, b: np.ndarray, peak: float) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(peak ** 2 / mse)


# -- the experiment ----------------------------------------------------------------------------------------
def run(source: str, tokens: int, channels: int, k: int, frame: int, hevc_qps, av1_qps) -> ResultsWriter:
    res = ResultsWriter("19", "null_av1_10bit")
    captured = None if source == "synthetic" else captured_activation(source)
    if captured is not None:
        x, label = captured
        k = min(k, x.shape[1])
    else:
        if source != "synthetic":
            print(f"no finished '{source}' capture store under {DEFAULT_ROOT}; using the synthetic activation")
        x, label = synthetic_activation(tokens, channels, SEED, rho=RHO), "synthetic"
    basis = fit_basis([x], k=k)
    coeffs = basis.project(x)
    q8, q10 = PerChannelQuantizer.fit(coeffs, 8), PerChannelQuantizer.fit(coeffs, 10)
    planes8, planes10 = q8.quantize(coeffs), q10.quantize(coeffs)
    layout = framing.layout_for(*planes8.shape, height=frame)
    frames8 = framing.to_frames(planes8, layout)
    frames10 = framing.to_frames(planes10, layout)
    frames8x4 = frames8.astype(np.uint16) << 2
    bf16_bytes = x.shape[0] * x.shape[1] * 2
    qparam_bytes = len(q8.to_bytes())
    print(f"source {label}: [{x.shape[0]} x {x.shape[1]}], K={k}, {layout.n_frames} frames of {frame}x{frame}")
    common = dict(source=label, tokens=x.shape[0], channels=x.shape[1], k=k, frame=frame)

    def score(codec, setting, qp, payload, planes_hat, quantizer, peak, planes_ref, encode_s):
        x_hat = basis.reconstruct(quantizer.dequantize(planes_hat))
        qual = quality(x, x_hat)
        ratio = bf16_bytes / (len(payload) + qparam_bytes)
        exact = bool(np.array_equal(planes_hat, planes_ref))
        row = dict(codec=codec, setting=setting, qp=qp, **common)
        res.add(backend=codec, metric="ratio", value=ratio, unit="x", **row)
        res.add(backend=codec, metric="bytes", value=len(payload), unit="B", **row)
        for m in ("cos_mean", "rel_mse", "p1"):
            res.add(backend=codec, metric=m, value=qual[m], unit="1", **row)
        res.add(backend=codec, metric="plane_psnr", value=plane_psnr(planes_hat, planes_ref, peak), unit="dB", **row)
        res.add(backend=codec, metric="encode_s", value=encode_s, unit="s", **row)
        if qp is None:
            res.add(backend=codec, metric="exact", value=int(exact), unit="bool", **row)
            if not exact:
                raise AssertionError(f"{codec} lossless is not bit-exact")
        print(f"{codec:<18}{setting:<10}{ratio:>7.2f}{qual['cos_mean']:>10.5f}{qual['rel_mse']:>11.2e}"
              f"{('yes' if exact else 'no') if qp is None else '-':>7}{encode_s:>8.1f}", flush=True)

    print(f"{'codec':<18}{'setting':<10}{'ratio':>7}{'cos_mean':>10}{'rel_mse':>11}{'exact':>7}{'enc s':>8}")
    ten_bit_lossless = None
    for qp in [None, *hevc_qps]:
        setting = "lossless" if qp is None else f"qp{qp}"
        t0 = time.perf_counter()
        payload, dec = hevc_8bit(frames8, qp)
        score("hevc444_8bit", setting, qp, payload, framing.from_frames(dec, layout), q8, 255, planes8, time.perf_counter() - t0)
        t0 = time.perf_counter()
        payload, dec = hevc_10bit(frames8x4, qp)
        back = np.clip((dec.astype(np.int32) + 2) >> 2, 0, 255).astype(np.uint8)  # nearest 8-bit level
        score("hevc444_10bit_x4", setting, qp, payload, framing.from_frames(back, layout), q8, 255, planes8, time.perf_counter() - t0)
        t0 = time.perf_counter()
        payload, dec = hevc_10bit(frames10, qp)
        score("hevc444_10bit_q", setting, qp, payload, framing.from_frames(dec, layout), q10, 1023, planes10, time.perf_counter() - t0)
        if qp is None:
            ten_bit_lossless = payload
    for qp in [None, *av1_qps]:
        setting = "lossless" if qp is None else f"qp{qp}"
        t0 = time.perf_counter()
        payload, dec, _ = av1_luma(frames8, qp)
        score("av1_420_luma", setting, qp, payload, framing.from_frames(dec, layout), q8, 255, planes8, time.perf_counter() - t0)

    gpu_rows(res, ten_bit_lossless, frames10, common)
    return res


def gpu_rows(res: ResultsWriter, payload10: bytes, frames10: np.ndarray, common: dict) -> None:
    """What NVDEC on this GPU reports for AV1 and 10-bit HEVC, and a 10-bit lossless decode through it."""
    reason = nvdec.probe()
    if reason is not None:
        print(f"NVDEC rows skipped: {reason}")
        return
    gpu = nvdec.gpu_name()
    print(f"{gpu} NVDEC (GetDecoderCaps):")
    for codec, chroma, depth in [("HEVC", "444", 8), ("HEVC", "444", 10), ("HEVC", "420", 10),
                                 ("AV1", "420", 8), ("AV1", "420", 10), ("AV1", "444", 8)]:
        caps = nvdec.decoder_caps(codec, chroma, depth)
        print(f"  {codec} {chroma} {depth}-bit: supported={caps['supported']} engines={caps['num_decoder_engines']} "
              f"max {caps['width_max']}x{caps['height_max']}")
        row = dict(nvdec_codec=codec, chroma=chroma, bit_depth=depth, **common)
        res.add(backend="nvdec", device=gpu, metric="nvdec_supported", value=caps["supported"], unit="bool", **row)
        res.add(backend="nvdec", device=gpu, metric="nvdec_engines", value=caps["num_decoder_engines"], unit="count", **row)
    h, w = frames10.shape[2:]
    with get_backend("nvdec-hevc").decoder(w, h, bit_depth=10) as dec:
        dec.submit(payload10)
        out = dec.flush_cuda().cpu().numpy()
    exact = bool(np.array_equal(out.astype(np.uint16), frames10))
    print(f"  NVDEC decode of the 10-bit lossless HEVC stream: {'matches' if exact else 'MISMATCH'} "
          f"({len(out)}/{len(frames10)} frames)")
    res.add(backend="nvdec-hevc", device=gpu, metric="nvdec_10bit_exact", value=int(exact), unit="bool",
            codec="hevc444_10bit_q", setting="lossless", **common)


def plot(csv: str = "19_null_av1_10bit", name: str = "19_null_av1_10bit"):
    plt = apply_style()
    df = load(csv)
    from shared.results import COLORS, series_style

    codecs = df[df.metric == "ratio"].backend.unique()
    names = {"hevc444_8bit": "HEVC 4:4:4 8-bit (reference)", "hevc444_10bit_x4": "HEVC 4:4:4 10-bit, values x4",
             "hevc444_10bit_q": "HEVC 4:4:4 10-bit, 10-bit quantizer", "av1_420_luma": "AV1 4:2:0, one channel per luma plane"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for i, codec in enumerate(codecs):
        r = df[(df.backend == codec) & (df.metric == "ratio")].set_index("setting").value
        c = df[(df.backend == codec) & (df.metric == "cos_mean")].set_index("setting").value
        ax1.plot(1 - c.reindex(r.index), r, "-", **series_style(i), label=names.get(codec, codec))
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.yaxis.set_major_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax1.yaxis.set_minor_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax1.set_xlabel("1 - cos_mean (mean per-token cosine; log, left = better)")
    ax1.set_ylabel("compression ratio vs bf16 (x, log)")
    ax1.set_title("the same planes through four coders (QP sweep)")
    ax1.legend(loc="upper left", fontsize=8)
    ax1.annotate(f"source: {df.source.dropna().iloc[0]}", (0.99, 0.02), xycoords="axes fraction", ha="right",
                 fontsize=7, color="0.4")
    caps = df[df.metric == "nvdec_supported"]
    if len(caps):
        labels = [f"{r.nvdec_codec} {int(float(r.chroma))} {int(r.bit_depth)}-bit" for r in caps.itertuples()]
        ax2.barh(labels, [1] * len(caps), color=[COLORS[2] if v else COLORS[3] for v in caps.value])
        for y, v in enumerate(caps.value):
            ax2.text(0.5, y, "decodes" if v else "not supported", ha="center", va="center", color="white",
                     fontweight="bold")
        ax2.set_xticks([])
        ax2.grid(False)
        ax2.set_title(f"NVDEC support reported by {caps.device.iloc[0]} (GetDecoderCaps)")
    else:
        ax2.text(0.5, 0.5, "no GPU in this run:\nNVDEC capabilities not queried", ha="center", va="center")
        ax2.set_axis_off()
    fig.suptitle("PoC 19: AV1 codes these planes at least as well as HEVC 4:4:4 (lossy), but this GPU's NVDEC cannot decode it; "
                 "10-bit is no better", x=0.02, ha="left", fontsize=10.5)
    fig.tight_layout()
    save_figure(fig, name, f"{csv}.csv")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run (1024 x 256 synthetic, K=128, 2 QPs)")
    ap.add_argument("--source", choices=["auto", "synthetic", "llm", "diffusion"], default="auto",
                    help="auto: LLM captures, else diffusion captures, else synthetic")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    args = ap.parse_args()
    if args.plot_only:
        plot()
        sys.exit(0)
    source = args.source
    if source == "auto":
        source = next((s for s in ("llm", "diffusion") if captured_activation(s) is not None), "synthetic")
    if args.quick:
        result = run("synthetic", 1024, 256, 128, FRAME, [10, 26], [10, 40])
    else:
        result = run(source, TOKENS, CHANNELS, K, FRAME, HEVC_QPS, AV1_QPS)
    result.save()
    plot()

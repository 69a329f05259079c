"""PoC 13 - Over which links does compressing a stream of tensors beat sending them raw, and does a
pipelined model of codec + wire predict what real links measure?

The stream: SmolLM2-135M's KV cache, layer by layer (K and V of several layers, each [T, 192] bf16, T
tokens of a context), as a prefill node would hand it to a decode node. Every (layer, K/V) tensor has
its own PCA basis (all 192 components) fitted on calibration chunks that are not in the stream.

Model. Per tensor of S bytes: encode e(S), decode d(S), compressed bytes C = S / ratio, wire time
C / B on a link of payload bandwidth B. A sender with an encode thread and a send thread, and a
receiver with a recv thread and a decode thread, move N tensors in
    latency + e + C/B + d + (N - 1) * max(e, C/B, d)          (first tensor's latency, then the slowest stage)
and raw in latency + N * S / B. latency = one-way delay plus TCP slow start (the congestion window
doubling from 10 segments each round trip until it covers the bandwidth-delay product). e(S) and d(S)
come from TensorCodec encode/decode measured here by tensor size (the CPU codecs), or from the GPU's
API rows of results/09_backend_bench.csv (`path` api / api_batched: encode_gbps / decode_gbps by
`tensor_mb`; `pcie_copy`: d2h_gbps / h2d_gbps), never invented: without those rows the GPU curves are
left out and the run says so. B of a tc-shaped link is its tbf rate times the TCP payload share of a
1514-byte frame (shared.links.TCP_PAYLOAD_FRACTION).

Codecs (CPU rows measured on this machine; GPU rows from PoC 09 on the GPU its rows name):
  compute codec (CPU)    TensorCodec(backend="rans", step=...): one shared quantization step per tensor,
                         calibrated on the calibration chunks for cos TARGET_COS; numpy rANS coder
  zstd (CPU)             per-channel uint8 planes of the PCA coefficients, zstd level ZSTD_LEVEL
  x265 (CPU)             the same planes as frames, libx265 preset X265_PRESET, constant QP X265_QP, intra
  compute codec (GPU)    the same bitstream on the H200 (Triton kernels; the ratio is the CPU coder's here)
  NVDEC decode (GPU)     x265 streams (encoded by libx265 on this CPU: the H200 has no NVENC), NVDEC decode
  nvCOMP ANS (GPU)       nvCOMP's ANS on the planes (ratio from its PoC 09 rows)

Check against real links. TCP between two network namespaces joined by a veth pair shaped by tc
(shared.links.ShapedLink: tbf at 1 Gbit, 100 Mbit, 50 Mbit; 10 ms each way by netem, or by a user-space
delay line where the kernel lacks sch_netem): the
sender process (shared.transfer) encodes the stream on a thread and sends length-prefixed blobs from
another, the receiver receives on one thread and decodes on another, then checks every tensor against
the original (raw: bit-exact; compressed: cos, stated). A short stream crosses first, and is checked,
before anything is timed. Rows `metric=model_error_pct` = |model - measured| / measured for each point.
On the H200 (`--gpu`) the pinned host-to-device PCIe copy is the real link: raw tensors from pinned host
memory, and compute-codec blobs copied on one CUDA stream while the previous one decodes on another.

Command:   make poc-13   (python pocs/13_wire_simulation.py [--quick] [--plot-only] [--no-links] [--gpu | --gpu-only]
                          [--model-only: the model rows again from the CSV and PoC 09's GPU API rows])
Writes:    results/13_wire_simulation.csv, figures/13_wire_simulation.png
Sample output (a 2-core CPU machine shared with other jobs; its kernel has no sch_netem, so the 10 ms
points run through the user-space delay line of shared.links):
      compute codec (CPU)  k      2 MiB  encode    249.3 ms ( 0.008 GB/s)  decode    257.5 ms ( 0.008 GB/s)  ratio  4.59  cos 0.99899
      zstd (CPU)           k      2 MiB  encode     45.1 ms ( 0.046 GB/s)  decode     21.1 ms ( 0.099 GB/s)  ratio  2.17  cos 0.99999
    model: zstd (CPU)             crossover 0.336 Gbit/s; speed-up at 1 Gbit 0.34x, 100 Mbit 2.07x, 50 Mbit 2.12x
    short streams over the link (no added delay) match: raw bit-exact, compressed at the stated cos
       1000 Mbit + 0.0 ms  raw                    measured    17.66 ms/tensor  model    17.54  error   0.7%  (with this run's stage times   0.7%)  ratio 1.00
       1000 Mbit + 0.0 ms  zstd (CPU)             measured    78.95 ms/tensor  model    48.98  error  38.0%  (with this run's stage times   2.6%)  ratio 2.20
         50 Mbit + 0.0 ms  zstd (CPU)             measured   169.21 ms/tensor  model   163.95  error   3.1%  (with this run's stage times   0.4%)  ratio 2.20
        100 Mbit +10.0 ms  x265 (CPU)             measured   692.11 ms/tensor  model   740.66  error   7.0%  (with this run's stage times   1.1%)  ratio 3.30
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):   # one thread per codec call, as
    os.environ.setdefault(_var, "1")                                          # the model assumes (before numpy)

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.links import TCP_PAYLOAD_FRACTION, ShapedLink, delay_unavailable_reason, link_unavailable_reason  # noqa: E402
from shared.metrics import quality  # noqa: E402
from shared.results import RESULTS, ResultsWriter, announce, apply_style, device_name, load, save_figure  # noqa: E402
from shared.timing import wall_ms  # noqa: E402
from shared.transfer import exported_kv, kv_cache_tensors, kv_codecs, tokens_for  # noqa: E402

# ---------------------------------------------------------------------------------------------- knobs
CHUNKS, CHUNK_TOKENS = 32, 1024      # SmolLM2 KV capture: chunks x tokens of the fixed text
CALIB_CHUNKS = 4                     # chunks 0..3 fit the bases and steps; the stream uses the rest
SPEED_LAYER = 15                     # layer whose K and V are timed by size
SIZES_MB = [1, 2, 4, 8]              # MiB of bf16 per tensor for the codec timings (T = size / 384 bytes)
STREAM_MB = 2                        # MiB of bf16 per tensor in the link streams
STREAM_LAYERS = [2, 6, 10, 14, 18, 22, 26, 29]   # K and V of these layers: 16 tensors
TARGET_COS = 0.999                   # compute codec: cos its per-tensor step is calibrated for
ZSTD_LEVEL = 3                       # zstd level (its default; PoC 06 compares higher levels)
X265_PRESET, X265_QP = "ultrafast", 18   # libx265 preset and constant QP
REPEATS = 4                          # timed encode/decode calls per size (mean: preempted calls count), after one untimed
LINKS = [(1000, 0.0), (100, 0.0), (50, 0.0), (1000, 10.0), (100, 10.0), (50, 10.0)]  # (Mbit/s tbf, ms one-way)
STREAM_TIMEOUT = 180                 # s: a link stream that takes longer is an error
INIT_CWND = 10 * 1448                # bytes: Linux's initial congestion window (10 segments)
BW_GRID = np.logspace(np.log10(5e6 / 8), np.log10(450e9), 400)   # payload bytes/s of the model sweep (5 Mbit/s up)
NAMED_LINKS = [("NVLink 4 (450 GB/s a direction, nominal)", 450e9), ("PCIe gen5 x16 (63 GB/s nominal)", 63e9),
               ("100 GbE", 100e9 / 8), ("10 GbE", 10e9 / 8), ("1 GbE", 1e9 / 8), ("100 Mbit/s", 100e6 / 8),
               ("50 Mbit/s", 50e6 / 8)]
GPU_STREAM_TENSORS, GPU_REPEATS = 32, 10   # --gpu: tensors per PCIe stream, timed repeats (median)
GPU_CHUNKS = 10                      # --gpu-only: chunks captured (calibration + the stream's first tokens)
QUICK = dict(chunks=4, chunk_tokens=256, calib=1, sizes=[0.125, 0.25], stream_mb=0.125, layers=[3, 15],
             links=[(100, 0.0)], repeats=1)

CPU_CODECS = {  # label -> TensorCodec settings (the compute codec's step is added per tensor)
    "compute codec (CPU)": dict(backend="rans"),
    "zstd (CPU)": dict(backend="zstd", level=ZSTD_LEVEL),
    "x265 (CPU)": dict(backend="x265", qp=X265_QP, preset=X265_PRESET, intra=True),
}
GPU_CODECS = {  # label -> (PoC 09 backend, where encode time comes from, where the ratio comes from)
    "compute codec (GPU)": ("rans", "gpu", "compute codec (CPU)"),
    "NVDEC decode (GPU)": ("nvdec-hevc", "x265 (CPU)", "x265 (CPU)"),
    "nvCOMP ANS (GPU)": ("nvcomp-ans", "gpu", "gpu"),
}


# ------------------------------------------------------------------------------------------- tensors
def kv_tensors(cfg) -> tuple[dict, str]:
    """{(layer, kind): [T, 192] float32} of SmolLM2's KV cache; on a machine without the model, the exported
    layer-15 K/V, and the stream shrinks to fit (layer 15 only, 2 calibration chunks, 1.5 MiB tensors)."""
    layers = sorted(set(cfg["layers"]) | {SPEED_LAYER})
    try:
        return kv_cache_tensors(cfg["chunks"], cfg["chunk_tokens"], layers)
    except (ImportError, OSError) as e:
        tensors, label = exported_kv(e)
        cfg.update(chunks=6, chunk_tokens=1024, calib=2, layers=[15], stream_mb=1.5,
                   sizes=[s for s in cfg["sizes"] if tokens_for(s) <= 4 * 1024])
        print(f"SmolLM2 unavailable ({e}); using {label}: layer 15 only, {cfg['stream_mb']} MiB tensors")
        return tensors, label


def make_codecs(calib: torch.Tensor) -> dict:
    return kv_codecs(calib, CPU_CODECS, TARGET_COS)


# --------------------------------------------------------------------------------- codec timing by size
def time_codecs(res, tensors, cfg, source) -> dict:
    """Encode/decode every CPU codec on the layer-SPEED_LAYER K and V at each size; round trip checked first."""
    calib_tokens = cfg["calib"] * cfg["chunk_tokens"]
    table = {}
    jobs = [(mb, kind, label) for mb in cfg["sizes"] for kind in "kv" for label in CPU_CODECS]
    codecs = {kind: make_codecs(tensors[(SPEED_LAYER, kind)][:calib_tokens]) for kind in "kv"}
    for mb, kind, label in tqdm(jobs, desc="codec timings", unit="call"):
        held = tensors[(SPEED_LAYER, kind)][calib_tokens:]
        T = tokens_for(mb)
        if T > held.shape[0]:
            raise ValueError(f"{mb} MiB needs {T} tokens; the capture holds {held.shape[0]} beyond calibration. "
                             "Fix: raise CHUNKS or lower SIZES_MB")
        x = held[:T].to(torch.bfloat16)
        codec = codecs[kind][label]
        blob = codec.encode(x)
        q = quality(x.float().numpy(), codec.decode(blob).float().numpy())
        enc_ms = wall_ms(lambda: codec.encode(x), cfg["repeats"], stat="mean")
        dec_ms = wall_ms(lambda: codec.decode(blob), cfg["repeats"], stat="mean")
        nbytes = x.numel() * 2
        common = dict(backend=label, source=source, layer=SPEED_LAYER, kind=kind, tensor_mb=mb, tokens=T,
                      part="codec_by_size", repeats=cfg["repeats"])
        for metric, value, unit in [("encode_ms", enc_ms, "ms"), ("decode_ms", dec_ms, "ms"),
                                    ("encode_gbps", nbytes / enc_ms / 1e6, "GB/s"),
                                    ("decode_gbps", nbytes / dec_ms / 1e6, "GB/s"),
                                    ("ratio", nbytes / len(blob), "x"), ("cos_mean", q["cos_mean"], "cos")]:
            res.add(metric=metric, value=value, unit=unit, **common)
        tqdm.write(f"  {label:20s} {kind} {mb:6.3g} MiB  encode {enc_ms:8.1f} ms ({nbytes / enc_ms / 1e6:6.3f} GB/s)  "
                   f"decode {dec_ms:8.1f} ms ({nbytes / dec_ms / 1e6:6.3f} GB/s)  ratio {nbytes / len(blob):5.2f}  "
                   f"cos {q['cos_mean']:.5f}")
        table.setdefault(label, []).append((mb, enc_ms / 1e3, dec_ms / 1e3, nbytes / len(blob)))
    print(f"round trips checked before timing (cos vs the original, target {TARGET_COS} for the compute codec)")
    return table


def cpu_speeds(df) -> dict:
    """label -> {tensor_mb: (encode_s, decode_s, ratio)}, the mean of K and V, from this PoC's CPU rows."""
    d = df[(df.part == "codec_by_size") & (df.device == "cpu")]
    out = {}
    for (label, mb), g in d.groupby(["backend", "tensor_mb"]):
        m = g.groupby("metric").value.mean()
        out.setdefault(label, {})[float(mb)] = (m.encode_ms / 1e3, m.decode_ms / 1e3, m.ratio)
    return out


def gpu_speeds(cpu: dict) -> tuple[dict, dict, list[str], str]:
    """From PoC 09's API rows: label -> {tensor_mb: (encode_s, decode_s, ratio)}, the pinned PCIe copy
    {tensor_mb: (d2h_gbps, h2d_gbps)}, notes on what is missing, and the GPU(s) the rows name."""
    import pandas as pd

    path = RESULTS / "09_backend_bench.csv"
    df = pd.read_csv(path) if path.exists() else pd.DataFrame(columns=["path"])
    notes = []
    if "tensor_mb" not in df.columns or not df.path.isin(["api", "api_batched"]).any():
        notes.append("no GPU API rows yet in results/09_backend_bench.csv (path api/api_batched): GPU curves omitted")
        return {}, {}, notes, ""
    api = df[df.path.isin(["api", "api_batched"])]
    device = ", ".join(sorted(map(str, api.device.dropna().unique())))
    out = {}
    for label, (backend, enc_from, ratio_from) in GPU_CODECS.items():
        g = api[api.backend == backend]
        if g.empty:
            notes.append(f"{label}: no API rows for backend {backend} in PoC 09: omitted")
            continue
        # per size, the faster of the per-call and batched API
        piv = g.pivot_table(index="tensor_mb", columns="metric", values="value", aggfunc="max")
        table = {}
        for mb, row in piv.iterrows():
            nbytes = float(mb) * 2**20
            dec = nbytes / (row["decode_gbps"] * 1e9) if "decode_gbps" in row and row["decode_gbps"] > 0 else None
            enc = nbytes / (row["encode_gbps"] * 1e9) if enc_from == "gpu" and row.get("encode_gbps", 0) > 0 else None
            if enc_from != "gpu":
                enc = interp_stage(cpu.get(enc_from, {}), float(mb), 0)
            ratio = row.get("ratio") if ratio_from == "gpu" else interp_stage(cpu.get(ratio_from, {}), float(mb), 2)
            if dec is None or enc is None or ratio is None or not ratio > 0:
                continue
            table[float(mb)] = (enc, dec, float(ratio))
        if table:
            out[label] = table
        else:
            notes.append(f"{label}: PoC 09 rows lack encode/decode/ratio for it: omitted")
    pcie = df[df.path == "pcie_copy"].pivot_table(index="tensor_mb", columns="metric", values="value", aggfunc="median")
    copies = {float(mb): (r.get("d2h_gbps"), r.get("h2d_gbps")) for mb, r in pcie.iterrows()}
    return out, copies, notes, device


def interp_stage(table: dict, mb: float, index: int):
    """Stage `index` of a {tensor_mb: (enc_s, dec_s, ratio)} table at size mb: times scale linearly with
    size between measured sizes (per-byte speed interpolated in log size); None outside the measured range."""
    if not table:
        return None
    sizes = sorted(table)
    if mb < sizes[0] * 0.999 or mb > sizes[-1] * 1.001:
        return None
    per = [table[s][index] / (s if index < 2 else 1) for s in sizes]
    v = float(np.interp(np.log(mb), np.log(sizes), per)) if len(sizes) > 1 else per[0]
    return v * mb if index < 2 else v


# --------------------------------------------------------------------------------------------- model
def slow_start_s(bw: float, rtt: float) -> float:
    """Time TCP slow start costs beyond the bandwidth-limited time: each round trip sends one window,
    which doubles from INIT_CWND until it covers bw * rtt."""
    if rtt <= 0:
        return 0.0
    lost, cwnd = 0.0, INIT_CWND
    while cwnd < bw * rtt:
        lost += rtt - cwnd / bw
        cwnd *= 2
    return lost


def model_stream_s(n: int, nbytes: float, bw: float, one_way: float = 0.0, enc=None, dec=None,
                   ratio: float = 1.0) -> float:
    """Wall time of n tensors of nbytes each over a link of payload bandwidth bw (bytes/s); raw when enc is None."""
    latency = one_way + slow_start_s(bw, 2 * one_way)
    if enc is None:
        return latency + n * nbytes / bw
    wire = nbytes / ratio / bw
    return latency + enc + wire + dec + (n - 1) * max(enc, wire, dec)


def model_curves(speeds: dict, mb: float, n: int) -> dict:
    """label -> speed-up over raw at every BW_GRID bandwidth (no delay)."""
    nbytes = mb * 2**20
    out = {}
    for label, table in speeds.items():
        enc, dec, ratio = (interp_stage(table, mb, i) for i in range(3))
        if enc is None:
            continue
        out[label] = np.array([model_stream_s(n, nbytes, bw) / model_stream_s(n, nbytes, bw, 0, enc, dec, ratio)
                               for bw in BW_GRID])
    return out


def crossover(speedup: np.ndarray) -> float | None:
    """Highest bandwidth (bytes/s) at which the speed-up falls through 1, interpolated in log bandwidth."""
    above = speedup >= 1
    if above.all() or not above.any():
        return None
    i = int(np.where(above[:-1] & ~above[1:])[0][-1]) if (above[:-1] & ~above[1:]).any() else None
    if i is None:
        return None
    x0, x1, y0, y1 = np.log(BW_GRID[i]), np.log(BW_GRID[i + 1]), speedup[i], speedup[i + 1]
    return float(np.exp(x0 + (1 - y0) * (x1 - x0) / (y1 - y0)))


# ------------------------------------------------------------------------------------------ real links
def stream_tensors(tensors, cfg):
    """The link stream: K and V of the stream layers at stream_mb each, and per tensor its CPU codecs."""
    calib_tokens, T = cfg["calib"] * cfg["chunk_tokens"], tokens_for(cfg["stream_mb"])
    xs, codecs = [], []
    for L in cfg["layers"]:
        for kind in "kv":
            full = tensors[(L, kind)]
            if calib_tokens + T > full.shape[0]:
                raise ValueError(f"stream tensors of {cfg['stream_mb']} MiB need {calib_tokens + T} tokens; "
                                 f"the capture holds {full.shape[0]}. Fix: raise CHUNKS or lower STREAM_MB")
            xs.append(full[calib_tokens:calib_tokens + T].to(torch.bfloat16).contiguous())
            codecs.append(make_codecs(full[:calib_tokens]))
    return xs, codecs


def measure_links(res, tensors, cfg, speeds, source) -> None:
    from shared.transfer import check_summary, run_stream, write_stream

    why = link_unavailable_reason()
    if why:
        print(f"real links skipped: {why}")
        res.add(backend="-", metric="link_unavailable", value=float("nan"), unit="-", reason=why, part="link")
        return
    xs, per_tensor = stream_tensors(tensors, cfg)
    n, nbytes = len(xs), xs[0].numel() * 2
    labels = ["raw"] + list(CPU_CODECS)
    with tempfile.TemporaryDirectory(prefix="poc13_") as tmp:
        specs = {lab: write_stream(Path(tmp) / lab.split()[0], xs,
                                   [None if lab == "raw" else c[lab] for c in per_tensor]) for lab in labels}
        checks = {lab: write_stream(Path(tmp) / f"check_{lab.split()[0]}", xs[:2],
                                    [None if lab == "raw" else c[lab] for c in per_tensor[:2]]) for lab in labels}
        points = [p for p in cfg["links"] if p[1] == 0 or delay_unavailable_reason() is None]
        for rate, delay in cfg["links"]:
            if (rate, delay) not in points:
                res.add(backend="-", metric="link_unavailable", value=float("nan"), unit="-", link_mbit=rate,
                        delay_ms=delay, reason=delay_unavailable_reason(), part="link")
                print(f"{rate} Mbit + {delay} ms skipped: {delay_unavailable_reason()}")
        # links without and with delay are made apart: without netem, only a link made with a delay has the
        # user-space delay line in its middle
        groups = [[p for p in points if (p[1] > 0) == delayed] for delayed in (False, True)]
        for group in (g for g in groups if g):
            with ShapedLink(rate_mbit=group[0][0], delay_ms=group[0][1]) as link:
                for lab in labels:                    # correctness first: a short checked stream per codec
                    summ = check_summary(run_stream(link, checks[lab], timeout=STREAM_TIMEOUT)["checks"])
                    assert_checks(lab, summ)
                print(f"short streams over the link ({link.delay_by or 'no added delay'}) match: raw bit-exact, "
                      "compressed at the stated cos")
                stream_points(res, link, group, labels, specs, speeds, cfg, n, nbytes, source)


def stream_points(res, link, points, labels, specs, speeds, cfg, n, nbytes, source) -> None:
    """Every stream over every link shape of `points`, with the model's prediction beside each."""
    from shared.transfer import check_summary, run_stream

    for rate, delay in tqdm(points, desc="real links", unit="link"):
        link.reshape(rate_mbit=rate, delay_ms=delay)
        bw, measured = rate * 1e6 / 8 * TCP_PAYLOAD_FRACTION, {}
        for lab in labels:
            r = run_stream(link, specs[lab], timeout=STREAM_TIMEOUT)
            summ = assert_checks(lab, check_summary(r["checks"]))
            ratio = n * nbytes / (r["bytes_on_wire"] - 12 * n)
            if lab == "raw":
                model = model_stream_s(n, nbytes, bw, delay / 1e3)
            else:
                enc, dec = (interp_stage(speeds[lab], cfg["stream_mb"], i) for i in range(2))
                model = model_stream_s(n, nbytes, bw, delay / 1e3, enc, dec, ratio)
            measured[lab] = r["seconds"]
            err = abs(model - r["seconds"]) / r["seconds"] * 100
            # the same formula fed with the stage times the two ends measured during this stream
            enc_run = [v for v, c in zip(r["encode_s"], r["checks"]) if c["lane"] == "coded"]
            dec_run = [v for v, c in zip(r["decode_s"], r["checks"]) if c["lane"] == "coded"]
            same = (model if lab == "raw" else
                    model_stream_s(n, nbytes, bw, delay / 1e3, float(np.mean(enc_run)),
                                   float(np.mean(dec_run)), ratio))
            common = dict(backend=lab, source=source, part="link", link="tcp_veth_tbf", link_mbit=rate,
                          delay_ms=delay, delay_by=link.delay_by or "-", tensors=n,
                          tensor_mb=cfg["stream_mb"], device="cpu")
            res.add(metric="measured_ms_per_tensor", value=r["seconds"] / n * 1e3, unit="ms", **common)
            res.add(metric="model_ms_per_tensor", value=model / n * 1e3, unit="ms", **common)
            res.add(metric="model_error_pct", value=err, unit="%", **common)
            res.add(metric="model_error_pct_run_stages", value=abs(same - r["seconds"]) / r["seconds"] * 100,
                    unit="%", **common)
            res.add(metric="stream_ratio", value=ratio, unit="x", **common)
            if summ["cos_min"] is not None:
                res.add(metric="cos_min", value=summ["cos_min"], unit="cos", **common)
            res.add(metric="measured_encode_ms", value=float(np.mean(r["encode_s"])) * 1e3, unit="ms", **common)
            res.add(metric="measured_decode_ms", value=float(np.mean(r["decode_s"])) * 1e3, unit="ms", **common)
            tqdm.write(f"  {rate:5d} Mbit +{delay:4.1f} ms  {lab:22s} measured {r['seconds'] / n * 1e3:8.2f} "
                       f"ms/tensor  model {model / n * 1e3:8.2f}  error {err:5.1f}%  (with this run's stage times "
                       f"{abs(same - r['seconds']) / r['seconds'] * 100:5.1f}%)  ratio {ratio:.2f}")
        for lab in labels[1:]:
            res.add(metric="measured_speedup", value=measured["raw"] / measured[lab], unit="x", backend=lab,
                    source=source, part="link", link="tcp_veth_tbf", link_mbit=rate, delay_ms=delay,
                    delay_by=link.delay_by or "-", tensors=n, tensor_mb=cfg["stream_mb"], device="cpu")


def assert_checks(label: str, summ: dict) -> dict:
    if label == "raw" and not summ["raw_bit_exact"]:
        raise AssertionError("raw tensors did not arrive bit-exact")
    if label != "raw" and not summ["shapes_ok"]:
        raise AssertionError(f"{label}: decoded tensors have the wrong shape or dtype")
    if label.startswith("compute") and summ["cos_min"] < TARGET_COS - 5e-4:
        raise AssertionError(f"{label}: cos {summ['cos_min']:.5f} below the target {TARGET_COS}")
    return summ


# --------------------------------------------------------------------------------- the H200's PCIe link
def gpu_pcie_check(res, tensors, cfg, source) -> None:
    """Pinned host -> GPU over PCIe as the real link: raw copies vs compute-codec blobs copied on one
    stream while the previous blob decodes on another; the model from this run's single-call timings."""
    if not torch.cuda.is_available():
        print("GPU PCIe check skipped: no CUDA device")
        return
    dev = torch.device("cuda")
    calib_tokens, T = cfg["calib"] * cfg["chunk_tokens"], tokens_for(cfg["stream_mb"])
    xs, codecs = [], []
    for i in range(GPU_STREAM_TENSORS):
        L, kind = cfg["layers"][(i // 2) % len(cfg["layers"])], "kv"[i % 2]
        full = tensors[(L, kind)]
        xs.append(full[calib_tokens:calib_tokens + T].to(torch.bfloat16).to(dev))
        codecs.append(make_codecs(full[:calib_tokens])["compute codec (CPU)"])
    n, nbytes = len(xs), xs[0].numel() * 2
    blobs = [c.encode(x) for c, x in zip(codecs, xs)]                   # GPU encode, bytes on the host
    q = min(quality(x.float().cpu().numpy(), c.decode(b, device="cuda").float().cpu().numpy())["cos_mean"]
            for x, c, b in zip(xs, codecs, blobs))
    host_raw = [x.cpu().pin_memory() for x in xs]
    host_blob = [torch.frombuffer(bytearray(b), dtype=torch.uint8).pin_memory() for b in blobs]
    for h, x in zip(host_raw, xs):
        if not torch.equal(h.to(dev), x):
            raise AssertionError("pinned copy is not bit-exact")
    print(f"GPU round trips match: raw copies bit-exact, compute codec cos >= {q:.5f}")
    copy_stream, dec_stream = torch.cuda.Stream(), torch.cuda.Stream()

    probe = host_blob[0].to(dev)
    try:                                    # does decode take the blob as a CUDA uint8 tensor?
        codecs[0].decode(probe, device="cuda")
        resident = True
    except Exception as e:  # noqa: BLE001 - any refusal means bytes only
        resident = False
        print(f"decode does not take a CUDA blob ({type(e).__name__}: {e}); it gets bytes and copies them itself")

    def raw_stream():
        with torch.cuda.stream(copy_stream):
            outs = [h.to(dev, non_blocking=True) for h in host_raw]
        copy_stream.synchronize()
        return outs

    def coded_stream():
        if not resident:                    # the API copies the bytes itself: no overlap to arrange
            return [c.decode(b, device="cuda") for c, b in zip(codecs, blobs)]
        outs, copies = [], []
        with torch.cuda.stream(copy_stream):
            for h in host_blob:
                ev = torch.cuda.Event()
                copies.append((h.to(dev, non_blocking=True), ev))
                ev.record(copy_stream)
        with torch.cuda.stream(dec_stream):
            for (blob_dev, ev), codec in zip(copies, codecs):
                dec_stream.wait_event(ev)
                outs.append(codec.decode(blob_dev, device="cuda"))
        dec_stream.synchronize()
        return outs

    sync = torch.cuda.synchronize
    for got, x in zip(coded_stream(), xs):  # the pipelined path decodes what was sent
        if quality(x.float().cpu().numpy(), got.float().cpu().numpy())["cos_mean"] < q - 1e-6:
            raise AssertionError("the pipelined GPU stream decoded a different tensor")
    raw_ms = wall_ms(raw_stream, GPU_REPEATS, warmup=2, sync=sync)
    coded_ms = wall_ms(coded_stream, GPU_REPEATS, warmup=2, sync=sync)
    one_copy_s = wall_ms(lambda: host_raw[0].to(dev, non_blocking=True), GPU_REPEATS, 2, sync) / 1e3
    blob_copy_s = wall_ms(lambda: host_blob[0].to(dev, non_blocking=True), GPU_REPEATS, 2, sync) / 1e3
    inputs = [h.to(dev) for h in host_blob[:2]] if resident else blobs[:2]
    dec_s = float(np.median([wall_ms(lambda c=c, b=b: c.decode(b, device="cuda"), GPU_REPEATS, 2, sync)
                             for c, b in zip(codecs[:2], inputs)])) / 1e3
    big = torch.cat([h.view(torch.uint8).reshape(-1) for h in host_raw]).pin_memory()   # PCIe bandwidth alone
    bw = big.numel() / (wall_ms(lambda: big.to(dev, non_blocking=True), GPU_REPEATS, 2, sync) / 1e3)
    latency = max(0.0, one_copy_s - nbytes / bw)          # a lone copy's launch + sync beyond its bytes
    ratio = n * nbytes / sum(len(b) for b in blobs)
    model_raw = latency + n * nbytes / bw
    if resident:   # copy of blob i+1 overlaps the decode of blob i
        wire = nbytes / ratio / bw
        model_coded = latency + wire + dec_s + (n - 1) * max(wire, dec_s)
    else:          # each decode call copies its own bytes first
        model_coded = n * dec_s
    res.add(backend="compute codec (GPU)", metric="blob_copy_ms", value=blob_copy_s * 1e3, unit="ms",
            device=device_name(True), part="gpu_link", source=source)
    res.add(backend="compute codec (GPU)", metric="decode_ms", value=dec_s * 1e3, unit="ms",
            device=device_name(True), part="gpu_link", source=source)
    gdev = device_name(True)
    common = dict(source=source, part="gpu_link", link="pcie_h2d_pinned", tensors=n, tensor_mb=cfg["stream_mb"],
                  device=gdev, decode_takes_gpu_blob=resident)
    for lab, meas, model in [("raw", raw_ms / 1e3, model_raw), ("compute codec (GPU)", coded_ms / 1e3, model_coded)]:
        err = abs(model - meas) / meas * 100
        res.add(backend=lab, metric="measured_ms_per_tensor", value=meas / n * 1e3, unit="ms", **common)
        res.add(backend=lab, metric="model_ms_per_tensor", value=model / n * 1e3, unit="ms", **common)
        res.add(backend=lab, metric="model_error_pct", value=err, unit="%", **common)
        print(f"  PCIe H2D  {lab:22s} measured {meas / n * 1e3:8.3f} ms/tensor  model {model / n * 1e3:8.3f}  "
              f"error {err:5.1f}%")
    res.add(backend="compute codec (GPU)", metric="measured_speedup", value=raw_ms / coded_ms, unit="x", **common)
    res.add(backend="raw", metric="h2d_gbps", value=bw / 1e9, unit="GB/s", **common)
    res.add(backend="compute codec (GPU)", metric="stream_ratio", value=ratio, unit="x", **common)
    res.add(backend="compute codec (GPU)", metric="cos_min", value=q, unit="cos", **common)


# --------------------------------------------------------------------------------------------- model rows
def add_model_rows(res, df, cfg, n: int, source) -> dict:
    """Model speed-up curves (CPU codecs measured here, GPU ones from PoC 09) and crossover rows."""
    cpu = cpu_speeds(df)
    gpu, copies, notes, gpu_device = gpu_speeds(cpu)
    for note in notes:
        print(note)
        res.add(backend="-", metric="gpu_rows_missing", value=float("nan"), unit="-", reason=note, part="model",
                device="cpu")
    curves = model_curves({**cpu, **gpu}, cfg["stream_mb"], n)
    for label, sp in curves.items():
        x = crossover(sp)
        dev = f"{gpu_device} (PoC 09 rows)" if label in gpu else "cpu"
        res.add(backend=label, metric="crossover_gbps", value=(x or float("nan")) / 1e9 * 8, unit="Gbit/s",
                part="model", tensor_mb=cfg["stream_mb"], tensors=n, source=source, device=dev,
                reason="" if x else ("pays at every bandwidth swept" if sp[0] >= 1 else "never pays"))
        for bw, s in zip(BW_GRID[::4], sp[::4]):
            res.add(backend=label, metric="model_speedup", value=float(s), unit="x", part="model", link_gbps=bw * 8 / 1e9,
                    tensor_mb=cfg["stream_mb"], tensors=n, source=source, device=dev)
    return curves


# -------------------------------------------------------------------------------------------------- plot
def plot(csv: str = "13_wire_simulation", name: str = "13_wire_simulation"):
    from matplotlib.lines import Line2D

    import pandas as pd

    plt = apply_style()
    df = load(csv)
    m = df[(df.part == "model") & (df.metric == "model_speedup")]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5.6), gridspec_kw={"width_ratios": [2.2, 1]})
    labels = sorted(set(m.backend) | set(df[df.part.isin(["link", "gpu_link"])].backend) - {"raw"})
    colors = dict(zip(labels, plt.rcParams["axes.prop_cycle"].by_key()["color"]), raw="0.35")
    cross = df[df.metric == "crossover_gbps"].set_index("backend")
    for label, g in m.groupby("backend"):
        g = g.sort_values("link_gbps")
        x = cross.value.get(label)
        has_x = x is not None and np.isfinite(x)
        ax.plot(g.link_gbps, g.value, "--" if "GPU" in label else "-", color=colors[label],
                label=f"{label}: model" + (f", pays below {x:.3g} Gbit/s" if has_x else f" ({cross.reason.get(label)})"))
        if has_x:
            ax.plot([x], [1], "|", color=colors[label], ms=22, mew=2.5)
    pts = df[(df.metric == "measured_speedup") & (df.part == "link")]
    delayed = pts.delay_ms.fillna(0) > 0 if "delay_ms" in pts else pd.Series(False, index=pts.index)
    for (label, dl), g in pts.groupby([pts.backend, delayed]):
        ax.plot(g.link_mbit * TCP_PAYLOAD_FRACTION / 1e3 * (1.06 if dl else 1), g.value, "D" if dl else "o",
                color=colors[label], ms=6 if dl else 7, mec="k")
    gp = df[(df.metric == "measured_speedup") & (df.part == "gpu_link")]
    h2d = df[(df.part == "gpu_link") & (df.metric == "h2d_gbps")].value
    for label, g in gp.groupby("backend"):
        ax.plot(h2d.values[:1] * 8, g.value.values[:1], "s", color=colors.get(label, "k"), ms=8, mec="k")
    for lname, bw in NAMED_LINKS:
        ax.axvline(bw * 8 / 1e9, color="0.82", lw=0.8, zorder=0)
        ax.text(bw * 8 / 1e9, 0.02, lname, rotation=90, fontsize=6.5, color="0.45", va="bottom", ha="right",
                transform=ax.get_xaxis_transform())
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(1e-3, max(5.0, float(m.value.max()) * 1.5) if len(m) else 5.0)
    ax.set_xlabel("link payload bandwidth (Gbit/s, log)")
    ax.set_ylabel("speed-up over sending raw (x, log)")
    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], ls="", marker="o", color="0.6", mec="k", label="measured: TCP over a tc-shaped veth link")]
    if delayed.any():
        handles.append(Line2D([], [], ls="", marker="D", color="0.6", mec="k",
                              label=f"measured, + {pts.delay_ms.max():g} ms each way (drawn 6% right)"))
    handles += [
                Line2D([], [], ls="", marker="|", color="0.3", ms=12, mew=2, label="crossover (speed-up 1)")]
    if len(gp):
        handles.append(Line2D([], [], ls="", marker="s", color="0.6", mec="k", label="measured: pinned PCIe H2D"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, -0.13), ncol=2, frameon=False)
    mb, n = m.tensor_mb.iloc[0], int(m.tensors.iloc[0])
    best = cross.value.dropna()
    ax.set_title((f"Compression pays only below {best.max():.2g} Gbit/s here, with {best.idxmax()}" if len(best) else
                  "Compression never pays over the links swept") + f"; {n} KV tensors of {mb:g} MiB")
    e = df[df.metric == "model_error_pct"]
    meas = df[df.metric == "measured_ms_per_tensor"].reset_index(drop=True)
    mod = df[df.metric == "model_ms_per_tensor"].reset_index(drop=True)
    for label in meas.backend.unique():
        a, b = meas[meas.backend == label], mod[mod.backend == label]
        ax2.plot(a.value.values, b.value.values, "o", color=colors.get(label, "0.3"), label=label, mec="k")
    if len(meas):
        lo, hi = meas.value.min() * 0.7, meas.value.max() * 1.4
        xs = np.array([lo, hi])
        ax2.plot(xs, xs, "k-", lw=0.8)
        ax2.fill_between(xs, xs * 0.85, xs * 1.15, color="0.88", zorder=0, label="within 15%")
        ax2.set_xscale("log")
        ax2.set_yscale("log")
        ax2.legend(loc="upper left", bbox_to_anchor=(0, -0.13), ncol=2, frameon=False)
        within = int((e.value <= 15).sum())
        er = df[df.metric == "model_error_pct_run_stages"]
        ax2.set_title(f"Model within 15% at {within} of {len(e)} real-link points\n"
                      f"({int((er.value <= 15).sum())} of {len(er)} fed the stage times measured in the stream)")
    ax2.set_xlabel("measured ms per tensor (log)")
    ax2.set_ylabel("model ms per tensor (log)")
    save_figure(fig, name, f"{csv}.csv")


# -------------------------------------------------------------------------------------------------- main
def print_curves(curves: dict) -> None:
    for label, sp in curves.items():
        x = crossover(sp)
        at = lambda mbit: np.interp(np.log(mbit * 1e6 / 8), np.log(BW_GRID), sp)  # noqa: E731
        print(f"model: {label:22s} crossover {'-' if x is None else f'{x * 8 / 1e9:.3g} Gbit/s'}; speed-up at "
              f"1 Gbit {at(1000):.2f}x, 100 Mbit {at(100):.2f}x, 50 Mbit {at(50):.2f}x")


def model_only() -> None:
    """Recompute the model rows from the CSV's codec rows and PoC 09's GPU API rows (no measurement)."""
    import pandas as pd

    csv = RESULTS / "13_wire_simulation.csv"
    old = pd.read_csv(csv, dtype={"poc": str})
    cfg = dict(stream_mb=STREAM_MB, layers=STREAM_LAYERS)
    res = ResultsWriter("13", "wire_simulation")
    source = old.source.dropna().iloc[0]
    print_curves(add_model_rows(res, old, cfg, 2 * len(STREAM_LAYERS), source))
    res.merge(part="model")


def main(args) -> None:
    announce("13")
    cfg = dict(chunks=CHUNKS, chunk_tokens=CHUNK_TOKENS, calib=CALIB_CHUNKS, sizes=SIZES_MB, stream_mb=STREAM_MB,
               layers=STREAM_LAYERS, links=LINKS, repeats=REPEATS)
    if args.quick:
        cfg.update(QUICK)
    elif args.gpu_only:    # the same stream tensors come from the first chunks: capture only those
        cfg.update(chunks=GPU_CHUNKS)
    res = ResultsWriter("13", "wire_simulation")
    t0 = time.time()
    tensors, source = kv_tensors(cfg)
    print(f"tensors: {source}; {len(tensors)} (layer, K/V) tensors of {next(iter(tensors.values())).shape[0]} tokens")
    if not args.gpu_only:
        time_codecs(res, tensors, cfg, source)
    import pandas as pd

    n = 2 * len(cfg["layers"])
    if not args.gpu_only:
        print_curves(add_model_rows(res, pd.DataFrame(res.rows), cfg, n, source))
    if not args.no_links and not args.gpu_only:
        measure_links(res, tensors, cfg, cpu_speeds(pd.DataFrame(res.rows)), source)
    if args.gpu or args.gpu_only:
        gpu_pcie_check(res, tensors, cfg, source)
    if args.gpu_only:      # add the GPU rows to the CPU machine's CSV
        res.merge(part="gpu_link")
    else:
        res.save()
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized: tiny tensors, one short 100 Mbit link point")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    ap.add_argument("--no-links", action="store_true", help="model only: skip the real-link streams")
    ap.add_argument("--gpu", action="store_true", help="also the pinned PCIe check on the GPU")
    ap.add_argument("--gpu-only", action="store_true", help="only the pinned PCIe check on the GPU")
    ap.add_argument("--model-only", action="store_true",
                    help="recompute the model rows from the CSV and results/09_backend_bench.csv's GPU API rows")
    a = ap.parse_args()
    if a.model_only:
        model_only()
    elif not a.plot_only:
        main(a)
    plot()

"""PoC 14 - Does splitting a stream of tensors between a raw lane and a codec lane, both running at
once, beat sending everything raw or everything compressed? Which split is best, and does a model find it?

The stream is PoC 13's: SmolLM2-135M's KV cache, K and V of several layers, [T, 192] bf16 each, with a
PCA basis per tensor fitted on calibration chunks not in the stream. A fraction f of the tensors (spread
evenly through the stream) goes raw, the rest through the codec, concurrently:

  TCP over a tc-shaped veth link (shared.links.ShapedLink, 1 Gbit / 100 Mbit / 50 Mbit): one TCP
  connection per lane; the sender's codec lane encodes on a pool of ENCODE_WORKERS threads while its send
  thread writes finished blobs, the raw lane's thread writes tensor bytes; the receiver reads both lanes
  on their own threads and decodes on a pool of DECODE_WORKERS threads (shared.transfer). Both lanes share
  the one shaped link, as they would share a NIC. Every tensor is checked at the receiver (raw bit-exact,
  compressed at the stated cos) after the clock stops; a short checked stream runs before any timing.
  H200 (`--gpu`): device -> pinned host over PCIe; the raw lane copies on one CUDA stream (the copy
  engine) while the codec lane encodes with the compute codec on another and copies its compressed bytes.

Model (beside every measured split): N tensors of S bytes, n_r = round(f N) raw, n_c coded, ratio r, encode
e and decode d per tensor measured here through TensorCodec, payload bandwidth B:
    T(f) = max( (n_r S + n_c S / r) / B,                      both lanes' bytes through the one wire
                e + S/(rB) + d + (n_c - 1) max(e, S/(rB), d) ) the codec lane's own pipeline
Best f = argmin T. On the GPU the lanes share no wire: T(f) = max(n_r S / B_copy, n_c e_gpu).

Reported elsewhere: the dual-lane write-up of github.com/shootthesound/torch-nvenc-compress (README,
"Measured today", poc/09_dual_lane.py) reports 1.69x over all-direct at 1 Gbit for a half/half split of
8 tensors on an RTX 5090, with the wire simulated by time.sleep(bytes / bandwidth) in each lane's own
thread (so its two lanes did not share one wire's bandwidth). Its number is cited, not rerun, here.

Command:   make poc-14   (python pocs/14_dual_lane.py [--quick] [--plot-only] [--gpu | --gpu-only]; --gpu-only
                          merges the H200 rows into the CPU machine's CSV)
Writes:    results/14_dual_lane.csv, figures/14_dual_lane.png
Sample output (a 2-core CPU machine shared with other jobs):
    compute codec (CPU): encode 256.0 ms, decode 219.8 ms per tensor, ratio 4.03
    compute codec (CPU): a checked two-lane stream matches (raw bit-exact, compressed cos 0.99901)
        100 Mbit  f=0.750  measured   144.89 ms/tensor  model   142.44  (with the all-compressed run's stage times   142.44)
      best f 0.750 (model: 0.625); gain over all-raw 1.21x, over all-compressed 2.06x
         50 Mbit  f=0.000  measured   375.85 ms/tensor  model   275.16  (with the all-compressed run's stage times   376.44)
         50 Mbit  f=0.500  measured   219.27 ms/tensor  model   218.96  (with the all-compressed run's stage times   218.96)
         50 Mbit  f=1.000  measured   350.20 ms/tensor  model   350.82  (with the all-compressed run's stage times   350.82)
      best f 0.500 (model: 0.375); gain over all-raw 1.60x, over all-compressed 1.71x
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):   # one thread per codec call
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.links import TCP_PAYLOAD_FRACTION, ShapedLink, link_unavailable_reason  # noqa: E402
from shared.metrics import quality  # noqa: E402
from shared.results import ResultsWriter, announce, apply_style, device_name, load, save_figure  # noqa: E402
from shared.timing import wall_ms  # noqa: E402
from shared.transfer import (check_summary, exported_kv, kv_cache_tensors, kv_codecs, run_stream,  # noqa: E402
                             tokens_for, write_stream)

# ---------------------------------------------------------------------------------------------- knobs
CHUNKS, CHUNK_TOKENS = 32, 1024      # SmolLM2 KV capture (the same as PoC 13's)
CALIB_CHUNKS = 4                     # chunks 0..3 fit the bases and steps; the stream uses the rest
STREAM_MB = 2                        # MiB of bf16 per tensor
STREAM_LAYERS = [2, 6, 10, 14, 18, 22, 26, 29]   # K and V of these layers: 16 tensors
TARGET_COS = 0.999                   # compute codec: cos its per-tensor step is calibrated for
CODECS = {                           # label -> TensorCodec settings of the codec lane (one sweep each)
    "zstd (CPU)": dict(backend="zstd", level=3),
    "compute codec (CPU)": dict(backend="rans"),
}
LINKS_MBIT = [1000, 100, 50]         # tbf rates of the shaped link (Mbit/s), no added delay
FRACTIONS = [0.0, 0.25, 0.5, 0.75, 0.875, 1.0]   # f: share of tensors sent raw
ENCODE_WORKERS, DECODE_WORKERS = 1, 1            # codec lane threads at each end (2 cores here)
REPEATS = 4                          # timed encode/decode calls (mean) for the model's e and d
STREAM_TIMEOUT = 240                 # s
PUBLIC_CLAIM = dict(speedup=1.69, link_mbit=1000,  # cited, not measured here
                    source="github.com/shootthesound/torch-nvenc-compress README (poc/09_dual_lane.py)")
GPU_TENSORS, GPU_REPEATS = 32, 10    # --gpu: tensors per stream, timed repeats (median)
GPU_CHUNKS = 10                      # --gpu-only: chunks captured (calibration + the stream's first tokens)
QUICK = dict(chunks=4, chunk_tokens=256, calib=1, stream_mb=0.125, layers=[3, 15], links=[100],
             fractions=[0.0, 0.5, 1.0], codecs=["zstd (CPU)"], repeats=1)


# ------------------------------------------------------------------------------------------- stream
def stream(cfg):
    """The stream's tensors (bf16) and per tensor its codec-lane TensorCodecs, plus a source label."""
    try:
        tensors, source = kv_cache_tensors(cfg["chunks"], cfg["chunk_tokens"], cfg["layers"])
    except (ImportError, OSError) as e:
        tensors, source = exported_kv(e)
        cfg.update(chunk_tokens=1024, calib=2, layers=[15], stream_mb=1.5)
        print(f"SmolLM2 unavailable ({e}); using {source}: layer 15 only, {cfg['stream_mb']} MiB tensors")
    calib, T = cfg["calib"] * cfg["chunk_tokens"], tokens_for(cfg["stream_mb"])
    xs, codecs = [], []
    for L in cfg["layers"]:
        for kind in "kv":
            full = tensors[(L, kind)]
            if calib + T > full.shape[0]:
                raise ValueError(f"{cfg['stream_mb']} MiB tensors need {calib + T} tokens, the capture holds "
                                 f"{full.shape[0]}. Fix: raise CHUNKS or lower STREAM_MB")
            xs.append(full[calib:calib + T].to(torch.bfloat16).contiguous())
            wanted = set(cfg["codecs"]) | {"compute codec (CPU)"}     # the GPU lane codes with the compute codec
            codecs.append(kv_codecs(full[:calib], {k: CODECS[k] for k in wanted}, TARGET_COS))
    return xs, codecs, source


def raw_mask(n: int, f: float) -> list[bool]:
    """True for the round(f n) tensors that go raw, spread evenly through the stream."""
    n_raw = int(round(f * n))
    picked = set(np.round(np.linspace(0, n - 1, n_raw)).astype(int).tolist()) if n_raw else set()
    return [i in picked for i in range(n)]


def codec_stage_times(xs, codecs, label, repeats) -> tuple[float, float, float]:
    """(encode s, decode s, ratio) per tensor: median over the first two tensors, round trip checked first."""
    enc, dec, ratios = [], [], []
    for x, c in zip(xs[:2], codecs[:2]):
        codec = c[label]
        blob = codec.encode(x)
        q = quality(x.float().numpy(), codec.decode(blob).float().numpy())["cos_mean"]
        if label.startswith("compute") and q < TARGET_COS - 5e-4:
            raise AssertionError(f"{label}: round trip cos {q:.5f} misses {TARGET_COS}")
        enc.append(wall_ms(lambda: codec.encode(x), repeats, stat="mean") / 1e3)
        dec.append(wall_ms(lambda: codec.decode(blob), repeats, stat="mean") / 1e3)
        ratios.append(x.numel() * 2 / len(blob))
    return float(np.median(enc)), float(np.median(dec)), float(np.mean(ratios))


# -------------------------------------------------------------------------------------------- model
def model_dual_s(n: int, f: float, nbytes: float, bw: float, enc: float, dec: float, ratio: float) -> float:
    n_r = int(round(f * n))
    n_c = n - n_r
    wire_all = (n_r * nbytes + n_c * nbytes / ratio) / bw
    if n_c == 0:
        return wire_all
    w = nbytes / ratio / bw
    return max(wire_all, enc + w + dec + (n_c - 1) * max(enc, w, dec))


def model_gpu_s(n: int, f: float, copy_s: float, enc_s: float) -> float:
    n_r = int(round(f * n))
    return max(n_r * copy_s, (n - n_r) * enc_s)


def best_f(fn, n: int) -> float:
    """The f in {0, 1/n, ..., 1} with the least model time."""
    grid = np.arange(n + 1) / n
    return float(grid[int(np.argmin([fn(f) for f in grid]))])


# ------------------------------------------------------------------------------------------ TCP lanes
def measure_tcp(res, xs, codecs, cfg, source) -> None:
    why = link_unavailable_reason()
    if why:
        print(f"TCP lanes skipped: {why}")
        res.add(backend="-", metric="link_unavailable", value=float("nan"), unit="-", reason=why, part="tcp")
        return
    n, nbytes = len(xs), xs[0].numel() * 2
    with tempfile.TemporaryDirectory(prefix="poc14_") as tmp, ShapedLink(rate_mbit=cfg["links"][0]) as link:
        for label in cfg["codecs"]:
            enc, dec, ratio = codec_stage_times(xs, codecs, label, cfg["repeats"])
            res.add(metric="encode_ms", value=enc * 1e3, unit="ms", backend=label, part="codec", device="cpu",
                    source=source, tensor_mb=cfg["stream_mb"])
            res.add(metric="decode_ms", value=dec * 1e3, unit="ms", backend=label, part="codec", device="cpu",
                    source=source, tensor_mb=cfg["stream_mb"])
            res.add(metric="ratio", value=ratio, unit="x", backend=label, part="codec", device="cpu", source=source,
                    tensor_mb=cfg["stream_mb"])
            print(f"{label}: encode {enc * 1e3:.1f} ms, decode {dec * 1e3:.1f} ms per tensor, ratio {ratio:.2f}")
            specs = {f: write_stream(Path(tmp) / f"{label.split()[0]}_{f}", xs,
                                     [None if raw else c[label] for raw, c in zip(raw_mask(n, f), codecs)])
                     for f in cfg["fractions"]}
            check = write_stream(Path(tmp) / f"{label.split()[0]}_check", xs[:2], [None, codecs[1][label]])
            summ = check_summary(run_stream(link, check, encode_workers=ENCODE_WORKERS,
                                            decode_workers=DECODE_WORKERS, timeout=STREAM_TIMEOUT)["checks"])
            assert_ok(label, summ)
            print(f"{label}: a checked two-lane stream matches (raw bit-exact, compressed cos {summ['cos_min']:.5f})")
            for rate in tqdm(cfg["links"], desc=f"links ({label})", unit="link"):
                link.reshape(rate_mbit=rate)
                bw = rate * 1e6 / 8 * TCP_PAYLOAD_FRACTION
                common = dict(backend=label, source=source, part="tcp", link_mbit=rate, tensors=n,
                              tensor_mb=cfg["stream_mb"], encode_workers=ENCODE_WORKERS,
                              decode_workers=DECODE_WORKERS, device="cpu")
                runs = {}
                for f in cfg["fractions"]:
                    runs[f] = run_stream(link, specs[f], encode_workers=ENCODE_WORKERS, decode_workers=DECODE_WORKERS,
                                         timeout=STREAM_TIMEOUT)
                    assert_ok(label, check_summary(runs[f]["checks"]))
                # the same model fed with the stage times the two ends measured in the most-compressed stream
                r0 = runs[min(runs)]
                coded = [(e, d) for e, d, c in zip(r0["encode_s"], r0["decode_s"], r0["checks"]) if c["lane"] == "coded"]
                enc_run, dec_run = (float(np.mean(v)) for v in zip(*coded))
                model = lambda f: model_dual_s(n, f, nbytes, bw, enc, dec, ratio)  # noqa: E731
                model_run = lambda f: model_dual_s(n, f, nbytes, bw, enc_run, dec_run, ratio)  # noqa: E731
                for f, r in runs.items():
                    summ = check_summary(r["checks"])
                    kw = dict(raw_fraction=f, **common)
                    res.add(metric="measured_ms_per_tensor", value=r["seconds"] / n * 1e3, unit="ms", **kw)
                    res.add(metric="model_ms_per_tensor", value=model(f) / n * 1e3, unit="ms", **kw)
                    res.add(metric="model_run_stages_ms_per_tensor", value=model_run(f) / n * 1e3, unit="ms", **kw)
                    if summ["cos_min"] is not None:
                        res.add(metric="cos_min", value=summ["cos_min"], unit="cos", **kw)
                    tqdm.write(f"  {rate:5d} Mbit  f={f:5.3f}  measured {r['seconds'] / n * 1e3:8.2f} ms/tensor  "
                               f"model {model(f) / n * 1e3:8.2f}  (with the all-compressed run's stage times "
                               f"{model_run(f) / n * 1e3:8.2f})")
                res.add(metric="run_encode_ms", value=enc_run * 1e3, unit="ms", **common)
                res.add(metric="run_decode_ms", value=dec_run * 1e3, unit="ms", **common)
                add_best_rows(res, {f: r["seconds"] for f, r in runs.items()}, model, n, common, model_run)


def add_best_rows(res, times: dict, model, n: int, common: dict, model_run=None) -> None:
    f_best = min(times, key=times.get)
    res.add(metric="best_raw_fraction", value=f_best, unit="f", **common)
    res.add(metric="model_best_raw_fraction", value=best_f(model, n), unit="f", **common)
    res.add(metric="model_best_raw_fraction_on_grid", value=min(times, key=model), unit="f", **common)
    if model_run is not None:
        res.add(metric="model_run_stages_best_raw_fraction", value=best_f(model_run, n), unit="f", **common)
    if 1.0 in times:
        res.add(metric="gain_over_all_raw", value=times[1.0] / times[f_best], unit="x", **common)
    if 0.0 in times:
        res.add(metric="gain_over_all_compressed", value=times[0.0] / times[f_best], unit="x", **common)
    tqdm.write(f"  best f {f_best:.3f} (model: {best_f(model, n):.3f}); gain over all-raw "
               f"{times.get(1.0, float('nan')) / times[f_best]:.2f}x, over all-compressed "
               f"{times.get(0.0, float('nan')) / times[f_best]:.2f}x")


def assert_ok(label: str, summ: dict) -> dict:
    if summ["raw_bit_exact"] is False:
        raise AssertionError("raw tensors did not arrive bit-exact")
    if summ["cos_min"] is not None and label.startswith("compute") and summ["cos_min"] < TARGET_COS - 5e-4:
        raise AssertionError(f"{label}: cos {summ['cos_min']:.5f} below {TARGET_COS}")
    if summ["shapes_ok"] is False:
        raise AssertionError(f"{label}: decoded tensors have the wrong shape or dtype")
    return summ


# --------------------------------------------------------------------------------------- the H200 lanes
def measure_gpu(res, xs, codecs, cfg, source) -> None:
    """GPU -> pinned host: raw copies on one CUDA stream while the compute codec encodes on another."""
    if not torch.cuda.is_available():
        print("GPU lanes skipped: no CUDA device")
        return
    dev, label = torch.device("cuda"), "compute codec (GPU)"
    gx = [xs[i % len(xs)].to(dev) for i in range(GPU_TENSORS)]
    gc = [kv_codecs_for_gpu(codecs[i % len(codecs)]) for i in range(GPU_TENSORS)]
    n, nbytes = len(gx), gx[0].numel() * 2
    pinned = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in gx]
    blobs = [c.encode(x) for c, x in zip(gc, gx)]
    q = min(quality(x.float().cpu().numpy(), c.decode(b).float().numpy())["cos_mean"]
            for x, c, b in zip(gx, gc, blobs))
    pinned[0].copy_(gx[0])
    if not torch.equal(pinned[0], gx[0].cpu()):
        raise AssertionError("pinned copy is not bit-exact")
    print(f"GPU round trips match: raw copy bit-exact, compute codec cos >= {q:.5f} (decoded on the CPU)")
    copy_stream, code_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def run(f):
        mask = raw_mask(n, f)

        def raw_lane():
            with torch.cuda.stream(copy_stream):
                for i in (i for i in range(n) if mask[i]):
                    pinned[i].copy_(gx[i], non_blocking=True)
            copy_stream.synchronize()

        def codec_lane():
            with torch.cuda.stream(code_stream):
                for i in (i for i in range(n) if not mask[i]):
                    gc[i].encode(gx[i])
            code_stream.synchronize()

        ths = [threading.Thread(target=raw_lane), threading.Thread(target=codec_lane)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()

    sync = torch.cuda.synchronize
    big_dev = torch.cat([x.view(torch.uint8).reshape(-1) for x in gx])            # PCIe bandwidth alone
    big_host = torch.empty(big_dev.shape, dtype=torch.uint8, pin_memory=True)
    copy_s = wall_ms(lambda: big_host.copy_(big_dev, non_blocking=True), GPU_REPEATS, 2, sync) / 1e3 / n
    enc_s = float(np.median([wall_ms(lambda c=c, x=x: c.encode(x), GPU_REPEATS, 2, sync) for c, x in
                             zip(gc[:2], gx[:2])])) / 1e3
    gdev = device_name(True)
    common = dict(backend=label, source=source, part="gpu", link="pcie_d2h_pinned", tensors=n,
                  tensor_mb=cfg["stream_mb"], device=gdev)
    times = {}
    for f in tqdm(cfg["fractions"], desc="GPU splits", unit="split"):
        times[f] = wall_ms(lambda: run(f), GPU_REPEATS, 1, sync) / 1e3
        model = model_gpu_s(n, f, copy_s, enc_s)
        res.add(metric="measured_ms_per_tensor", value=times[f] / n * 1e3, unit="ms", raw_fraction=f, **common)
        res.add(metric="model_ms_per_tensor", value=model / n * 1e3, unit="ms", raw_fraction=f, **common)
        tqdm.write(f"  PCIe D2H  f={f:5.3f}  measured {times[f] / n * 1e3:8.3f} ms/tensor  model {model / n * 1e3:8.3f}")
    res.add(metric="d2h_gbps", value=nbytes / copy_s / 1e9, unit="GB/s", **common)
    res.add(metric="encode_gbps", value=nbytes / enc_s / 1e9, unit="GB/s", **common)
    res.add(metric="cos_min", value=q, unit="cos", **common)
    add_best_rows(res, times, lambda f: model_gpu_s(n, f, copy_s, enc_s), n, common)


def kv_codecs_for_gpu(per_tensor: dict):
    """The compute codec of a stream tensor (its basis and calibrated step) for the GPU lane."""
    return next(c for label, c in per_tensor.items() if label.startswith("compute"))


# -------------------------------------------------------------------------------------------------- plot
def plot(csv: str = "14_dual_lane", name: str = "14_dual_lane"):
    from matplotlib.lines import Line2D

    plt = apply_style()
    df = load(csv)
    meas = df[df.metric == "measured_ms_per_tensor"]
    panels = list(meas.groupby(["part", "backend"], sort=False).groups)
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5.6 * (len(panels) + 1), 4.8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = [("measured_ms_per_tensor", "-", "o", "measured"),
              ("model_ms_per_tensor", "--", "", "model (stage times timed alone)"),
              ("model_run_stages_ms_per_tensor", ":", "", "model (stage times of the all-compressed stream)")]
    for ax, (part, backend) in zip(axes[0], panels):
        d = df[(df.part == part) & (df.backend == backend)]
        key = "link_mbit" if part == "tcp" else "link"
        links = sorted(d[d.metric == "measured_ms_per_tensor"][key].unique(), reverse=part == "tcp")
        for j, lk in enumerate(links):
            for metric, ls, mk, _ in styles:
                g = d[(d.metric == metric) & (d[key] == lk)].sort_values("raw_fraction")
                ax.plot(g.raw_fraction, g.value, ls=ls, marker=mk, color=colors[j], ms=5)
            g = d[(d.metric == "measured_ms_per_tensor") & (d[key] == lk)]
            b = g.loc[g.value.idxmin()]
            ax.plot([b.raw_fraction], [b.value], "*", color=colors[j], ms=15, mec="k", zorder=5)
        ax.set_yscale("log")
        ax.set_xlabel("f, share of tensors sent raw (0: all compressed)")
        ax.set_ylabel("ms per tensor (log)")
        ax.set_title(f"{backend} lane + raw lane" + (" (TCP)" if part == "tcp" else f" ({d.device.iloc[0]})"))
        handles = [Line2D([], [], color=colors[j], lw=2, label=f"{lk:g} Mbit/s" if part == "tcp" else str(lk))
                   for j, lk in enumerate(links)]
        handles += [Line2D([], [], color="0.3", ls=ls, marker=mk, label=lab) for _, ls, mk, lab in styles]
        handles.append(Line2D([], [], ls="", marker="*", color="0.6", mec="k", ms=12, label="best split measured"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, -0.15), ncol=2, frameon=False)
    ax = axes[0][-1]
    best = df[df.metric == "best_raw_fraction"].reset_index(drop=True)
    gain_raw = df[df.metric == "gain_over_all_raw"].value.values
    gain_comp = df[df.metric == "gain_over_all_compressed"].value.values
    short = lambda b: b.replace("compute codec", "compute").split(" (")[0]  # noqa: E731
    labels = [f"{short(r.backend)}\n{r.link_mbit:g} Mb/s\nf={r.value:.2f}" if r.part == "tcp" else
              f"{short(r.backend)} GPU\nPCIe\nf={r.value:.2f}" for r in best.itertuples()]
    x = np.arange(len(best))
    ax.bar(x - 0.2, gain_raw, 0.4, label="best split vs all raw")
    ax.bar(x + 0.2, gain_comp, 0.4, label="best split vs all compressed")
    claim = PUBLIC_CLAIM
    ax.axhline(claim["speedup"], color="k", ls=":", lw=1,
               label=f"{claim['speedup']}x vs all raw at 1 Gbit, reported by torch-nvenc-compress (sleep-simulated wire)")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("gain of the best split (x, log)")
    split = best[(best.value > 0) & (best.value < 1)]
    both = np.minimum(gain_raw, gain_comp)
    ax.set_title(f"A split beats both pure modes at {len(split)} of {len(best)} points\n"
                 f"(by at most {both.max():.2f}x over the better of the two)")
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.2), frameon=False)
    save_figure(fig, name, f"{csv}.csv")


# -------------------------------------------------------------------------------------------------- main
def main(args) -> None:
    announce("14")
    cfg = dict(chunks=CHUNKS, chunk_tokens=CHUNK_TOKENS, calib=CALIB_CHUNKS, stream_mb=STREAM_MB, layers=STREAM_LAYERS,
               links=LINKS_MBIT, fractions=FRACTIONS, codecs=list(CODECS), repeats=REPEATS)
    if args.quick:
        cfg.update(QUICK)
    elif args.gpu_only:    # the same stream tensors come from the first chunks: capture only those
        cfg.update(chunks=GPU_CHUNKS)
    t0 = time.time()
    xs, codecs, source = stream(cfg)
    print(f"stream: {len(xs)} tensors of {cfg['stream_mb']} MiB bf16 ({source})")
    res = ResultsWriter("14", "dual_lane")
    if not args.gpu_only:
        measure_tcp(res, xs, codecs, cfg, source)
    if args.gpu or args.gpu_only:
        measure_gpu(res, xs, codecs, cfg, source)
    if args.gpu_only:      # add the GPU rows to the CPU machine's CSV
        res.merge(part="gpu")
    else:
        res.save()
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized: tiny tensors, one 100 Mbit link, three splits")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    ap.add_argument("--gpu", action="store_true", help="also the GPU lanes (CUDA streams + copy engine)")
    ap.add_argument("--gpu-only", action="store_true", help="only the GPU lanes, merged into the CSV")
    a = ap.parse_args()
    if not a.plot_only:
        main(a)
    plot()

"""Rewrite the results tables from results/*.csv (run by `make readme`).

Every number in the generated tables comes from here: each table names the CSV it was read from and
the device that measured it. A PoC whose CSV is missing gets no table. The tables live between markers
(<!-- RESULTS --> ... <!-- /RESULTS -->, now in docs/results.md; <!-- FUZZ --> ... <!-- /FUZZ -->, now
in docs/decoder-checks.md); `update_readme` rewrites them in every file among README.md and docs/*.md
that holds them.
"""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from .results import CSV_DTYPES, RESULTS, ROOT

WRITEUP_NUMBERS = {  # the original write-up's numbers (README.md, 'Where this started'), on much larger models
    ("diffusion", 0.99): "6.1x at cos 0.991 (FLUX.2 Klein 9B)",
    ("diffusion", 0.97): "18.4x at cos 0.966",
    ("diffusion", 0.94): "37x at cos 0.943",
    ("k", 0.999): "2.7x at cos 0.999 (Mistral 7B L16)",
    ("v", 0.999): "2.7x at cos 0.999 (Mistral 7B L16)",
}


def _csv(name: str) -> pd.DataFrame | None:
    path = RESULTS / f"{name}.csv"
    return pd.read_csv(path, dtype=CSV_DTYPES) if path.exists() else None


def _table(rows: list[list], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _source(df: pd.DataFrame, name: str) -> str:
    devices = ", ".join(sorted(set(df.device.astype(str))))
    date = df.date.iloc[0] if "date" in df else ""
    return f"_From `results/{name}.csv`; measured on: {devices}; {date}._"


def _qp(v) -> str:
    return "lossless" if pd.isna(v) else f"QP {int(v)}"


def compression() -> str | None:
    parts = []
    for name, domain in (("03_pareto_diffusion", "diffusion"), ("04_pareto_llm_kv", None)):
        df = _csv(name)
        if df is None:
            continue
        best = df[df.metric == "best_ratio"]
        rows = []
        for r in best.itertuples():
            kind = domain or r.source
            label = {"diffusion": "tiny FLUX activations", "k": "SmolLM2 L15 K", "v": "SmolLM2 L15 V"}[kind]
            rows.append([label, f">= {r.threshold:g}", f"**{r.value:.2f}x**", int(r.k), f"x265 {_qp(r.qp)}",
                         f"{r.cos_mean:.4f}", f"{r.cos_min:.4f}", f"{r.p1:.3f}",
                         WRITEUP_NUMBERS.get((kind, r.threshold), "")])
        raw = df[(df.metric == "ratio") & (df.basis == "raw") & df.qp.isna()]
        for src, r in raw.groupby("source" if domain is None else "basis"):
            v = r.value.max()
            label = {"k": "SmolLM2 L15 K", "v": "SmolLM2 L15 V"}.get(src, "tiny FLUX activations")
            rows.append([f"{label}, raw channels (no PCA)", "control", f"{v:.2f}x", "all", "x265 lossless", "", "", "",
                         ""])
        parts.append(_table(rows, ["tensor", "cos_mean target", "best ratio", "K", "codec", "cos_mean", "cos_min",
                                   "p1", "the original write-up (other model)"]) + "\n\n" + _source(df, name))
    return "\n\n".join(parts) if parts else None


def _pct(v, se=None) -> str:
    return f"{100 * v:+.2f}%" + (f" ± {100 * se:.2f}%" if se is not None and not pd.isna(se) else "")


def downstream() -> str | None:
    df = _csv("05_downstream_quality")
    if df is None:
        return None
    if "curve" not in df:  # the older layout (x265 operating points only)
        return None
    parts = []
    llm = df[(df.domain == "llm")]
    change = llm[llm.metric == "perplexity_change"]
    for prefix, g in change.groupby("prefix"):
        rows = [[r.method, f"{r.bits_per_value:.2f}", f"{r.ratio:.2f}x", _pct(r.value, r.se_token),
                 f"{100 * r.se_chunk:.2f}%", int(r.chunks), int(r.tokens_scored)] for r in g.itertuples()]
        base = g.base_ppl.iloc[0]
        parts.append(f"Every layer's K and V of a {int(prefix)}-token prefix through each method, the next tokens "
                     f"scored on held-out text (untouched perplexity {base:.3f}); ± is the paired standard error "
                     f"per token, then over chunks:\n\n" + _table(rows, ["method", "bits / value", "ratio vs bf16",
                                                                      "perplexity change ± SE (token)", "SE (chunks)",
                                                                      "chunks", "tokens scored"]))
    at = llm[llm.metric == "ratio_at_ppl_change"]
    if len(at):
        targets = sorted(at.target.unique())
        rows = []
        for (prefix, curve), g in at.groupby(["prefix", "curve"], sort=False):
            vals = {t: g[g.target == t].value for t in targets}
            rows.append([int(prefix), curve] + [f"{v.iloc[0]:.2f}x" if len(v) else "outside the measured range"
                                                for v in vals.values()])
        parts.append("Ratio at equal perplexity change, interpolated along each method's measured points "
                     "(the best ratio at or below that change):\n\n" +
                     _table(rows, ["prefix", "method"] + [f"at {_pct(t)}" for t in targets]))
    cal = change[change.curve.str.contains("calibrated")]
    if len(cal):
        def on_calibration(r) -> str:
            if pd.isna(r.calibrated_change):
                return "(same file)"
            se = getattr(r, "calibrated_se", float("nan"))
            return _pct(r.calibrated_change, None if pd.isna(se) else se)

        def met(r) -> str:
            return "yes" if r.value <= r.target + r.se_token else "no"

        has_z = "calibration_z" in cal and cal.calibration_z.notna().any()
        rows = [[int(r.prefix), _pct(r.target), on_calibration(r)]
                + ([f"{r.calibration_z:g}", f"{int(r.calibration_tokens)}"] if has_z else [])
                + [f"{r.scale:.3g}", f"{r.ratio:.2f}x", f"{r.bits_per_value:.2f}", _pct(r.value, r.se_token), met(r)]
                for r in cal.itertuples()]
        rule = (" The stored scale is the largest measured one whose calibration change plus z standard errors "
                "(the larger of per token and over windows) is at or below the target, every smaller measured "
                "scale passing too; the calibration text is disjoint from the fit text and from the held-out "
                "text. 'met': held-out change <= target + its SE." if has_z else "")
        parts.append("The codec's operating point set by a perplexity target on calibration text (stored in the "
                     "codec file), then measured on held-out text." + rule + "\n\n" +
                     _table(rows, ["prefix", "target", "on calibration text ± SE"]
                            + (["z", "calibration tokens"] if has_z else [])
                            + ["scale", "ratio vs bf16", "bits / value", "held-out change ± SE", "met"]))
    return "\n\n".join(parts) + "\n\n" + _source(df, "05_downstream_quality")


def downstream_diffusion() -> str | None:
    """PoC 05's diffusion rows: every method's final-image PSNR and ratio, then the ratios at the target."""
    df = _csv("05_downstream_quality")
    if df is None or "curve" not in df:
        return None
    d = df[df.domain == "diffusion"]
    psnr = d[d.metric == "psnr"]
    if not len(psnr) or "psnr_se" not in d:
        return None

    def other(metric):
        return d[d.metric == metric].set_index("method").value.to_dict()

    low, p5, agree = other("psnr_min"), other("psnr_p5"), other("classifier_agreement")
    rows = [[r.method, f"{r.bits_per_value:.2f}", f"{r.ratio:.2f}x", f"{r.value:.2f} ± {r.psnr_se:.2f} dB",
             f"{r.psnr_sd:.2f} dB", f"{p5[r.method]:.1f} dB", f"{low[r.method]:.1f} dB",
             f"{100 * agree[r.method]:.1f}%"] for r in psnr.itertuples()]
    first = psnr.iloc[0]
    parts = [f"Images of the embedded diffusion transformer with its middle double block's image-stream output "
             f"through each method at every one of {int(first.steps)} denoising steps, {int(first.images)} held-out "
             f"images ({int(first.seeds)} seeds x 10 classes, noise never used for fitting or calibration); PSNR "
             f"against the untouched generation from the same noise, ± its standard error over images, the spread "
             f"(SD), the 5th percentile and the worst image; the digit classifier's agreement with its label of "
             f"the untouched image:\n\n"
             + _table(rows, ["method", "bits / value", "ratio vs bf16", "PSNR ± SE", "SD over images",
                             "5th percentile", "worst image", "classifier agrees"])]
    at = d[d.metric == "ratio_at_psnr"]
    vs = d[d.metric == "ratio_vs_best_quantizer_at_psnr"]
    if len(at) and "criterion" in at:
        target = at.target.iloc[0]
        criteria = list(dict.fromkeys(at.criterion))

        def cell(frame, curve, criterion, fmt):
            v = frame[(frame.curve == curve) & (frame.criterion == criterion)].value
            return fmt.format(v.iloc[0]) if len(v) else "outside the measured range"

        interp = vs[vs.psnr_measured.isna()] if "psnr_measured" in vs else vs
        order = at[at.criterion == criteria[0]].sort_values("value").curve.tolist()
        order += [c for c in dict.fromkeys(at.curve) if c not in order]
        simple = set(at[at.kind == "simple"].curve)
        rows = [[c, "simple quantizer" if c in simple else "codec"] +
                sum([[cell(at, c, k, "{:.2f}x"), "" if c in simple else cell(interp, c, k, "{:.2f}")]
                     for k in criteria], []) for c in order]
        cal = vs[vs.psnr_measured.notna()] if "psnr_measured" in vs else vs[:0]
        for c in dict.fromkeys(cal.curve):
            g = cal[cal.curve == c]
            ratio = psnr[psnr.curve == c].ratio.iloc[0]
            held = {k: g[g.criterion == k].iloc[0] for k in criteria if (g.criterion == k).any()}
            rows.append([c, "codec, calibrated"] + sum([[f"{ratio:.2f}x at {held[k].psnr_measured:.2f} dB held out",
                                                          f"{held[k].value:.2f}"] if k in held else ["", ""]
                                                         for k in criteria], []))
        best = {k: vs[vs.criterion == k].best_quantizer.iloc[0] for k in criteria if (vs.criterion == k).any()}
        header = ["curve", "kind"] + sum([[f"ratio at {target:g} dB ({k})", "x the best simple quantizer"]
                                          for k in criteria], [])
        parts.append(f"Ratio at {target:g} dB, interpolated along each curve (log ratio linear in PSNR between its "
                     f"measured points), by the mean PSNR over images and by the PSNR 95% of images reach, and each "
                     f"codec's multiple of the best simple quantizer there ("
                     + "; ".join(f"{k}: {v}" for k, v in best.items()) + "). The calibrated codecs' step was set on "
                     "calibration generations; their row is the held-out measurement (ratio, and the mean PSNR or "
                     "the PSNR 95% of images reach):\n\n" + _table(rows, header))
    art = psnr[psnr.artifact_bytes > 0].groupby("curve", sort=False).artifact_bytes.agg(["min", "max"])
    if len(art):
        parts.append("Per-model tables each codec holds (float32 means and matrices; not in the ratios above; one "
                     f"generation's block outputs are {first.generation_bf16_bytes / 1e6:.2f} MB in bf16): " +
                     "; ".join(f"{c} {'' if lo == hi else 'up to '}{hi / 1e3:.0f} kB"
                               for c, lo, hi in art.itertuples()) + ".")
    return "\n\n".join(parts) + "\n\n" + _source(d, "05_downstream_quality")


def spectrum() -> str | None:
    df = _csv("02_spectrum")
    if df is None:
        return None
    stats = df[df.metric != "eigenvalue"].pivot_table(index="source", columns="metric", values="value")
    pick = [s for s in stats.index if s == "tiny_flux image stream" or s.endswith(("L15 k", "L15 v", "L0 k", "L29 v"))]
    rows = [[s, int(df[df.source == s].channels.iloc[0]), f"{stats.loc[s, 'effective_rank']:.1f}",
             f"{stats.loc[s, 'var_top10pct']:.3f}", f"{stats.loc[s, 'max_over_median']:.0f}"] for s in pick]
    return _table(rows, ["tensor", "D", "effective rank", "variance in top 10%", "max / median eigenvalue"]) + \
        "\n\n" + _source(df, "02_spectrum")


def controls() -> str | None:
    df = _csv("01_synthetic_controls")
    if df is None:
        return None
    r = df[df.metric == "ratio"].copy()
    r["codec"] = r.backend + " " + r.setting
    cos = df[df.metric == "cos_mean"].set_index(["source", "backend", "setting"]).value
    wide = r.pivot_table(index="source", columns="codec", values="value", sort=False)
    rows = []
    for src, row in wide.iterrows():
        cells = [f"{row[c]:.2f}x (cos {cos[(src, *c.split(' '))]:.4f})" for c in wide.columns]
        rows.append([src, *cells])
    exact = df[df.metric == "exact"]
    note = (f"Lossless codec stages bit-exact: {int(exact.value.sum())}/{len(exact)}. The original write-up's controls "
            "(another pipeline and model): Gaussian noise 4.2x, a real activation without PCA 4.8x.")
    return _table(rows, ["source", *wide.columns]) + f"\n\n{note} " + _source(df, "01_synthetic_controls")


def subprocess_overhead() -> str | None:
    df = _csv("08_subprocess_overhead")
    if df is None:
        return None
    g = {(r.backend, r.direction, r.metric): r.value for r in df.itertuples() if r.metric != "call_ms"
         and r.metric != "speedup_vs_subprocess"}
    spawn = df[df.metric == "spawn_ms"].value.iloc[0]
    rows = []
    for backend, label in (("ffmpeg-x265", "ffmpeg subprocess"), ("x265", "in-process session (PyAV)")):
        for d in ("encode", "decode"):
            rows.append([label, d, f"{g[(backend, d, 'fixed_ms')]:.1f}", f"{g[(backend, d, 'per_frame_ms')]:.2f}"])
    sp = df[df.metric == "speedup_vs_subprocess"]
    speed = ", ".join(f"{r.direction} {r.value:.1f}x at {int(r.frames)} frame{'s' if r.frames > 1 else ''}"
                      for r in sp[sp.frames.isin([sp.frames.min(), sp.frames.max()])].itertuples())
    frame = int(df.frame.dropna().iloc[0])
    return (_table(rows, ["path", "direction", "fixed ms per call", f"ms per {frame}x{frame} frame"])
            + f"\n\nProcess spawn alone: {spawn:.1f} ms. In-process speed-up: {speed}. "
            + _source(df, "08_subprocess_overhead"))


def coder_ablation() -> str | None:
    df = _csv("06_coder_ablation")
    if df is None:
        return None
    cpu = df[df.device == "cpu"]
    rows = []
    for (source, target), g in cpu[cpu.target.isin([0.999, 0.99, 0.97])].groupby(["source", "target"], sort=False):
        def pick(backend, quant, metric="ratio"):
            v = g[(g.backend == backend) & (g.quant == quant) & (g.metric == metric)].value
            return v.iloc[0] if len(v) else None

        rans_ = pick("rans", "rd_shared_step")
        wf = pick("rans", "rd_water_fill")
        x265 = pick("x265", "per_channel_8bit", "ratio_at_target")
        bound = pick("entropy_bound", "rd_shared_step")
        predicted = pick("predicted_bound", "rd_shared_step")
        zstd = pick("zstd", "rd_shared_step")
        fmt = (lambda v: "n/a" if v is None else f"{v:.2f}x")
        gain = "n/a" if (x265 is None or rans_ is None) else f"{max(rans_, wf or 0) / x265:.2f}"
        rows.append([source, f"{target:g}", fmt(rans_), fmt(wf), fmt(zstd), fmt(x265), gain, fmt(bound),
                     fmt(predicted)])
    text = _table(rows, ["source", "cos target", "compute codec (shared step + rANS)", "same + water-filling",
                         "zstd-19 on the same symbols", "libx265 const-QP (interpolated)", "best compute / x265",
                         "entropy bound (memoryless)", "bound with a predictor along tokens"])
    gpu = df[(df.backend == "compute-codec-cuda")]
    if len(gpu):
        g = gpu.pivot_table(index=["source", "tokens", "channels"], columns="metric", values="value").reset_index()
        text += "\n\nThe whole compute codec on the GPU (bf16 CUDA tensor -> projection -> shared-step quantizer -> rANS -> " \
                "payload in GPU memory, and back; integer stage bit-exact first):\n\n"
        text += _table([[f"[{int(r.tokens)}, {int(r.channels)}] " + {"synthetic_gpu": "synthetic"}.get(
                            r.source, f"real {r.source}, rows cycled"), f"{r.ratio:.2f}x", f"{r.cos_mean:.4f}",
                         f"{r.encode_gbps:.1f}", f"{r.decode_gbps:.1f}", f"{r.payload_over_bound:.3f}"]
                        for r in g.itertuples()],
                       ["tensor (bf16)", "ratio", "cos_mean", "encode GB/s of bf16", "decode GB/s of bf16",
                        "payload / entropy bound"])
    caps = df[(df.device != "cpu") & df.backend.isin(["rans-cuda", "nvcomp-ans"]) & (df.quant == "rd_shared_step")]
    if len(caps):
        rows = []
        for (source, target), g in caps.groupby(["source", "target"], sort=False):
            def get(backend, metric):
                v = g[(g.backend == backend) & (g.metric == metric)].value
                return v.iloc[0] if len(v) else None
            fmt = (lambda v, unit="x": "n/a" if v is None else (f"{v:.2f}x" if unit == "x" else f"{v:.2f}"))
            rows.append([source, f"{target:g}", fmt(get("rans-cuda", "ratio")), fmt(get("rans-cuda", "encode_gbps"), ""),
                         fmt(get("rans-cuda", "decode_gbps"), ""), fmt(get("nvcomp-ans", "ratio"))])
        text += "\n\nThe same captures' symbols on the GPU, one capture per call (a 1024 x 192 or 640 x 128 tensor: " \
                "launch-bound; the table above shows the coder on a large tensor). The GPU coder writes the CPU " \
                "coder's bytes (checked on every capture); nvCOMP ANS codes the same symbols as uint8 planes:\n\n"
        text += _table(rows, ["source", "cos target", "GPU rANS ratio", "GPU rANS encode GB/s of bf16",
                              "GPU rANS decode GB/s of bf16", "nvCOMP ANS ratio"])
    return text + "\n\n" + _source(df, "06_coder_ablation")


def gpu_speed() -> str | None:
    parts = []
    df = _csv("09_backend_bench")
    if df is not None:
        tp = df[df.metric.isin(["encode_gbps_planes", "decode_gbps_planes"])]
        rows = []
        for (backend, device), g in tp.groupby(["backend", "device"], sort=False):
            cells = [backend, device]
            for metric in ("encode_gbps_planes", "decode_gbps_planes"):
                m = g[g.metric == metric]
                if len(m):
                    r = m.loc[m.value.idxmax()]
                    where = "component-major" if pd.isna(r.frame_size) or r.frame_size == 0 else f"{int(r.frame_size)}px"
                    cells.append(f"{r.value:.2f} ({r.path}, {where})")
                else:
                    cells.append("not available (no NVENC)" if backend == "nvdec-hevc" else "-")
            ratio = df[(df.backend == backend) & (df.metric == "ratio_planes") & (df.device == device)].value
            cells.append(f"{ratio.median():.2f}" if len(ratio) else "")
            rows.append(cells)
        src = df[df.metric == "planes_shape"].source
        parts.append(_table(rows, ["backend", "device", "best encode GB/s of planes (path, frame)",
                                   "best decode GB/s of planes (path, frame)", "plane ratio (median)"])
                     + f"\n\nPlanes: {src.iloc[0] if len(src) else ''}; rows with device `cpu` ran on the CPU of the "
                       "GPU machine (16 cores). " + _source(df, "09_backend_bench"))
    df = _csv("10_multi_engine")
    if df is not None:
        t = df[df.metric == "throughput_planes"]
        b = t.loc[t.value.idxmax()]
        one = t[(t.sessions == 1) & (t.frame == b.frame)].value
        parts.append(f"NVDEC (PoC 10): {int(df[df.metric == 'engines'].value.iloc[0])} engines; best "
                     f"{b.value:.2f} GB/s of planes at {int(b.frame)}x{int(b.frame)} with {int(b.sessions)} sessions "
                     f"({one.iloc[0]:.2f} GB/s with one), planes: {b.source}. " + _source(df, "10_multi_engine"))
    df = _csv("12_overlap")
    if df is not None:
        rows = []
        for backend, g in df.groupby("backend", sort=False):
            v = dict(zip(g.metric, g.value))
            if "overlap_share" in v:
                rows.append([backend, f"{v['gemm_ms']:.2f}", f"{v['codec_ms']:.2f}", f"{v['serialized_ms']:.2f}",
                             f"{v['parallel_ms']:.2f}", f"{v['floor_ms']:.2f}", f"{v['overlap_share']:.0f}%"])
        parts.append("Overlap (PoC 12), a 30 x 4096^2 fp16 GEMM loop on one stream and the codec on another:\n\n"
                     + _table(rows, ["codec", "GEMM ms", "codec ms", "serialized ms", "parallel ms", "floor ms",
                                     "share of ideal overlap"]) + "\n\n" + _source(df, "12_overlap"))
    return "\n\n".join(parts) if parts else None


def earlier_run(rows, measured) -> str:
    """'' where rows come from the code of the latest run among measured (the code of the last row
    that names one), else which code they come from: a PoC 09 --api run cut short keeps an
    earlier run's rows for the points it did not reach, labelled by the commit of the code that
    measured them (column code)."""
    if "code" not in rows or "code" not in measured or rows.code.isna().all() or measured.code.isna().all():
        return ""
    latest = measured.code.dropna().iloc[-1]
    earlier = sorted(set(rows.code.dropna()) - {latest})
    return f"an earlier run, code of {', '.join(earlier)}" if earlier else ""


def api_speed() -> str | None:
    """The compute codec through TensorCodec on a GPU by tensor size, beside the PCIe copy."""
    df = _csv("09_backend_bench")
    if df is None or "path" not in df or not df.path.isin(["api"]).any():
        return None
    df = df[df.path.isin(["api", "api_batched", "pcie_copy"])]
    if "lane_tokens" in df:
        df = df.assign(lane_tokens=df.lane_tokens.fillna("default").astype(str))

    def val(path, metric, mb, lanes=None):
        sel = df[(df.path == path) & (df.metric == metric) & (df.tensor_mb.round(4) == round(mb, 4))]
        if "lane_tokens" in sel and lanes is not None:
            sel = sel[sel.lane_tokens.astype(str) == lanes]
        if path == "pcie_copy" and "batched" in sel:
            sel = sel[sel.batched.isna()] if lanes is None else sel[sel.batched.notna()]
        elif path == "pcie_copy":
            sel = sel.head(1)
        return float(sel.value.iloc[0]) if len(sel) else float("nan")

    def held(path, mb, lanes):
        enc, dec = val(path, "encode_graph_held", mb, lanes), val(path, "decode_graph_held", mb, lanes)
        return "-" if enc != enc else f"{enc:.1f}x / {dec:.1f}x"

    def queued(path, mb, lanes, d2h):
        enc = val(path, "encode_gbps_queued", mb, lanes)
        return "-" if enc != enc else f"{enc:.1f} ({enc / d2h:.2f}x)"

    def after_copy(path, mb, lanes):
        enc, dec = val(path, "encode_gbps_after_copy", mb, lanes), val(path, "decode_gbps_after_copy", mb, lanes)
        return "-" if enc != enc else f"{enc:.1f} / {dec:.1f}"

    rows = []
    api = df[df.path == "api"]
    lane_values = sorted(set(api.lane_tokens.astype(str)), key=lambda s: (s != "default", s)) \
        if "lane_tokens" in api else ["default"]
    for lanes in lane_values:
        for mb in sorted(api[api.lane_tokens.astype(str) == lanes].tensor_mb.unique() if "lane_tokens" in api
                         else api.tensor_mb.unique()):
            enc, dec = val("api", "encode_gbps", mb, lanes), val("api", "decode_gbps", mb, lanes)
            d2h, h2d = val("pcie_copy", "d2h_gbps", mb), val("pcie_copy", "h2d_gbps", mb)
            earlier = earlier_run(api[(api.tensor_mb.round(4) == round(mb, 4)) & (api.lane_tokens.astype(str) == lanes)]
                                  if "lane_tokens" in api else api[api.tensor_mb.round(4) == round(mb, 4)], df)
            earlier = f" ({earlier})" if earlier else ""
            rows.append([f"{mb:g}", f"one tensor, lane tokens {lanes}{earlier}", f"{val('api', 'ratio', mb, lanes):.2f}x",
                         f"{enc:.2f}", f"{dec:.2f}", f"{d2h:.1f} / {h2d:.1f}", f"{enc / d2h:.2f}x / {dec / h2d:.2f}x",
                         queued("api", mb, lanes, d2h), after_copy("api", mb, lanes), held("api", mb, lanes)])
    batched = df[(df.path == "api_batched") & (df.metric == "encode_gbps")]
    for r in batched.itertuples():
        lanes = str(getattr(r, "lane_tokens", "default"))
        mb = r.tensor_mb
        enc, dec = val("api_batched", "encode_gbps", mb, lanes), val("api_batched", "decode_gbps", mb, lanes)
        d2h, h2d = val("pcie_copy", "d2h_gbps", mb, lanes), val("pcie_copy", "h2d_gbps", mb, lanes)
        earlier = earlier_run(batched.loc[[r.Index]], df)
        earlier = f" ({earlier})" if earlier else ""
        rows.append([f"{mb:.1f}", f"{int(r.tensors)} x [{int(r.tokens)}, {int(r.channels)}] in one call, lane tokens "
                     f"{lanes}{earlier}", f"{val('api_batched', 'ratio', mb, lanes):.2f}x", f"{enc:.2f}", f"{dec:.2f}",
                     f"{d2h:.1f} / {h2d:.1f}", f"{enc / d2h:.2f}x / {dec / h2d:.2f}x",
                     queued("api_batched", mb, lanes, d2h), after_copy("api_batched", mb, lanes),
                     held("api_batched", mb, lanes)])
    source = df.source.dropna().iloc[0] if "source" in df else ""
    api = df[df.path.isin(["api", "api_batched"])]
    turns = api.timing.dropna() if "timing" in api else None
    if turns is not None and len(turns) and (turns == "blocks in turns").all():
        timing = (f"median of {int(api.repeats.dropna().iloc[0])} calls in turns: encode, D2H copy, decode, H2D copy "
                  "take turns (so that the host's drifts fall on the codec and the copy alike), each turn a few "
                  "calls of one in a row after one timed apart: that first call after the other's is the "
                  "'right after a copy' column (a PCIe copy leaves the SMs idle, and the call after it runs slower)")
    elif turns is not None and len(turns) and (turns == "in turns").all():
        timing = (f"median of {int(api.repeats.dropna().iloc[0])} turns, each a call of encode, decode and both "
                  "copies in a row (so that the host's drifts fall on the codec and the copy alike)")
    else:  # rows of runs before the turns: each call timed in its own block of 10
        timing = "median of 10"
    return (_table(rows, ["MB of bf16", "call", "ratio", "encode GB/s", "decode GB/s", "pinned PCIe D2H / H2D GB/s",
                          "codec / PCIe (enc / dec)", "encode, calls queued: GB/s (x D2H)",
                          "right after a copy: enc / dec GB/s",
                          "GPU memory a graph keeps (enc / dec, x input)"])
            + f"\n\nTensor: {source}; step calibrated for cos >= 0.999 (every row checked before timing). "
            + "Encode: `TensorCodec.encode(x_cuda)` -> the container in GPU memory; decode: "
            + "`TensorCodec.decode(blob, device=\"cuda\")` of it; batched: `encode_many` / `decode_many`. "
            + f"Wall clock of the call a user makes, {timing}; calls queued: `encode_many_async` "
            + "called several times, then each one's `result()` (the time per call of a pipeline's steady state, "
            + "where the host readies a call while the GPU codes the ones before it). Repeated calls replay a CUDA graph, whose "
            + "buffers stay on the GPU (last column; - : no graph). " + _source(df, "09_backend_bench"))


PROFILE_TOP = 6  # kernels named per call in the profile table; the rest are summed
_KERNEL_NAMES = [("nvjet", "cuBLAS GEMM"), ("CatArrayBatchedCopy", "torch.cat copy"),
                 ("index_elementwise", "torch indexing"), ("elementwise_kernel", "torch elementwise"),
                 ("scan_innermost", "torch cumsum"), ("Memcpy DtoD", "device copy"), ("Memcpy", "host copy")]


def _kernel_name(name: str) -> str:
    """A profiler's kernel name, short: the project's Triton kernels by name, torch's and cuBLAS's by kind."""
    for part, short in _KERNEL_NAMES:
        if part in name:
            return short
    return name.removeprefix("reference: ")[:48]


def api_profile() -> str | None:
    """PoC 09 --profile: the largest kernels of each eager API call, GPU time per call (kernel-only)."""
    df = _csv("09_backend_bench")
    if df is None or "path" not in df or not df.path.isin(["profile"]).any():
        return None
    df = df[df.path == "profile"]
    rows = []
    for (mb, direction), g in df.groupby(["tensor_mb", "direction"], sort=True):
        g = g.assign(kernel=g.kernel.map(_kernel_name)).groupby("kernel", as_index=False).agg(
            value=("value", "sum"), tokens=("tokens", "first"), channels=("channels", "first"),
            **({"tensors": ("tensors", "first")} if "tensors" in g else {})).sort_values("value", ascending=False)
        what = f"{int(g.tensors.iloc[0])} x [{int(g.tokens.iloc[0])}, {int(g.channels.iloc[0])}]" \
            if "tensors" in g and pd.notna(g.tensors.iloc[0]) else f"[{int(g.tokens.iloc[0])}, {int(g.channels.iloc[0])}]"
        top = "; ".join(f"{k} {v:.0f}" for k, v in zip(g.kernel.head(PROFILE_TOP), g.value.head(PROFILE_TOP)))
        rest = g.value.iloc[PROFILE_TOP:].sum()
        rows.append([f"{mb:.3g}", what, direction, "-" if direction == "reference" else f"{g.value.sum():.0f}",
                     top + (f"; others {rest:.0f}" if rest > 0 else "")])
    code = f" Code: {', '.join(sorted(set(df.code.astype(str))))}." if "code" in df else ""
    return _table(rows, ["MB of bf16", "tensor(s)", "call", "GPU us per call", "largest kernels (us)"]) + \
        ("\n\nKernel-only figures: GPU time per eager call (CUDA graphs off), torch.profiler's total over 5 "
         "calls divided by 5. They explain the API table above, whose wall times are what a call costs. "
         "`reference`: cuBLAS's `x @ basis` (bf16) and a device copy of the same tensor, kernel times by "
         "triton.testing.do_bench." + code + " " + _source(df, "09_backend_bench"))


def api_cpu_speed() -> str | None:
    """The compute codec's CPU path on one core (PoC 09 --api-cpu): each way, and stage by stage."""
    df = _csv("09_backend_bench")
    if df is None or "path" not in df or not df.path.isin(["api_cpu"]).any():
        return None
    df = df[df.path == "api_cpu"]
    cases = list(dict.fromkeys(df.case))

    def val(case, stage, metric, direction=None):
        sel = df[(df.case == case) & (df.stage == stage) & (df.metric == metric)]
        sel = sel if direction is None else sel[sel.direction == direction]
        return float(sel.value.iloc[0]) if len(sel) else float("nan")

    target = float(df.target_gbps.dropna().iloc[0])
    rows, stages = [], []
    for c in cases:
        enc, dec = val(c, "api", "gbps", "encode"), val(c, "api", "gbps", "decode")
        agree = val(c, "check", "symbols_equal_gpu_formula"), val(c, "check", "decode_equals_gpu_formula")
        rows.append([c, f"{val(c, 'check', 'ratio'):.2f}x ({val(c, 'check', 'ratio_float32_path'):.2f}x)",
                     f"{val(c, 'check', 'cos'):.5f} ({val(c, 'check', 'cos_float32_path'):.5f})", f"{enc:.3f}", f"{dec:.3f}",
                     "yes" if min(enc, dec) >= target else f"no ({'encode' if enc < target else 'decode'})",
                     f"{val(c, 'memcpy of the bf16 bytes', 'gbps', 'reference'):.0f}",
                     f"{8 * val(c, 'api', 'crossover_link_gbps'):.2f}",
                     "-" if agree[0] != agree[0] else f"{100 * agree[0]:.2f}% / {100 * agree[1]:.2f}%",
                     f"{val(c, 'machine', 'load_average'):.1f}"])
        mine = df[df.case == c]
        ms = {(d, st): val(c, st, "cpu_ms", d) for d, st in zip(mine.direction, mine.stage)}
        enc_parts = [ms.get(("encode", k), float("nan")) for k in (
            "projection: bf16 GEMM x @ C", "quantize + column statistics", "rANS: histogram", "rANS: tables",
            "rANS: coding pass")]
        dec_re = next((v for (d, st), v in ms.items() if d == "decode" and st.startswith("reconstruct")), float("nan"))
        dec_parts = [ms.get(("decode", k), float("nan")) for k in (
            "rANS: parse, checksum", "rANS: tables", "rANS: decoding pass")] + [dec_re]
        fmt = [("-" if v != v else f"{v:.1f}") for v in enc_parts + [ms[("encode", "api")]] + dec_parts
               + [ms[("decode", "api")]]]
        stages.append([c] + fmt)
    return (_table(rows, ["tensor (bf16, CPU)", "ratio (float32 path)", "cos (float32 path)", "encode GB/s", "decode GB/s",
                          f">= {target:g} GB/s both ways", "memcpy GB/s", "codec wins below (Gbit/s)",
                          "symbols / decode equal to the GPU formulas", "load average"])
            + "\n\nWhere the time goes (CPU ms of one call, median):\n\n"
            + _table(stages, ["tensor", "enc: bf16 GEMM", "quantize + stats", "histogram", "tables", "coding pass",
                              "encode (API)", "dec: parse + checksum", "tables", "decoding pass",
                              "reconstruct", "decode (API)"])
            + "\n\n`TensorCodec.encode(x)` / `decode(blob)` of a bf16 CPU tensor on one core of "
            + f"{df.cpu_model.iloc[0]} (torch, numba and BLAS one thread each): GB/s of bf16 per second of the "
            + "process's CPU time (the machine ran other jobs: wall-clock rows are in the CSV), median of "
            + f"{int(df.repeats.iloc[0])} calls after one untimed call, beside a memcpy of the same bytes in the "
            + "same run. Every payload equals the numpy reference coder's and decodes to the same symbols "
            + "(checked before timing). 'codec wins below': the link rate under which encode + sending the "
            + "payload + decode, one after the other, beats sending the raw bf16. In brackets: the same "
            + "values coded as a float32 tensor (float32 basis and GEMMs, the CPU path's numerics for other "
            + "dtypes). The GPU formulas are the "
            + "GPU kernels' arithmetic evaluated in float64 on the CPU (bf16 basis, float32 accumulation), "
            + "not a GPU run. " + _source(df, "09_backend_bench"))


FAILURE_METRICS = ["non_library_exceptions", "memory_errors", "worker_deaths", "hangs", "non_finite_outputs",
                   "wrong_dtype_or_shape"]


def fuzz_summary() -> str | None:
    """The long fuzz run (make fuzz), one row per backend."""
    df = _csv("fuzz_summary")
    if df is None:
        return None
    rows = []
    for backend in df.backend.unique():
        v = df[df.backend == backend].set_index("metric").value
        rows.append([backend, int(v["cases"]), int(v["accepted"]), int(v["rejected_bitstream"]),
                     int(v["rejected_other_library"]), int(sum(v.get(m, 0) for m in FAILURE_METRICS)),
                     int(v["stale_crc_accepted_changed"]), f"{v['max_decode_s']:.2f}", f"{v['max_peak_mib']:.1f}",
                     f"{v['max_memory_ratio']:.2f}", f"{v['max_memory_ratio_large']:.1f}"])
    return (_table(rows, ["backend", "cases", "accepted", "refused (BitstreamError)", "other library errors",
                          "failures", "stale-CRC mutants accepted", "slowest decode s", "peak MiB",
                          "memory ratio (x)", "same, outputs >= 512 KiB, no allowance (x)"])
            + "\n\n" + _source(df, "fuzz_summary") + " Failures sum " + ", ".join(FAILURE_METRICS) + ".")
def wire_simulation() -> str | None:
    df = _csv("13_wire_simulation")
    if df is None or "part" not in df:
        return None
    link = df[df.part.isin(["link", "gpu_link"])]
    rows = []
    for (part, rate, delay, backend), g in link.groupby(["part", "link_mbit", "delay_ms", "backend"], dropna=False,
                                                        sort=False):
        m = g.set_index("metric").value
        if "measured_ms_per_tensor" not in m:
            continue
        by = g.delay_by.iloc[0] if "delay_by" in g else "netem"
        where = (f"{rate:g} Mbit/s tbf" + (f" + {delay:g} ms ({'user-space delay line' if by == 'delay_line' else by})"
                                           if delay and delay == delay else "")
                 if part == "link" else f"pinned PCIe H2D ({g.device.iloc[0]})")
        rows.append([where, backend, f"{m.measured_ms_per_tensor:.2f}", f"{m.model_ms_per_tensor:.2f}",
                     f"{m.model_error_pct:.1f}%", f"{m['model_error_pct_run_stages']:.1f}%"
                     if "model_error_pct_run_stages" in m else "-",
                     f"{m.measured_speedup:.2f}x" if "measured_speedup" in m else "-",
                     f"{m.stream_ratio:.2f}" if "stream_ratio" in m else "-"])
    cross = df[df.metric == "crossover_gbps"]
    cross_txt = "; ".join(f"{r.backend} {r.value:.3g} Gbit/s" if r.value == r.value else f"{r.backend}: {r.reason}"
                          for r in cross.itertuples())
    missing = df[df.metric.isin(["gpu_rows_missing", "link_unavailable"])].reason.dropna().unique()
    notes = "".join(f" {m[0].upper()}{m[1:]}." for m in missing)
    return (_table(rows, ["link", "codec", "measured ms/tensor", "model ms/tensor", "model error",
                          "error with the run's own stage times", "measured speed-up", "ratio"])
            + f"\n\nModel crossover bandwidths (compression pays below): {cross_txt}.{notes} "
            + _source(df, "13_wire_simulation"))


def dual_lane() -> str | None:
    df = _csv("14_dual_lane")
    if df is None or "part" not in df:
        return None
    rows = []
    if "link_mbit" not in df:
        df["link_mbit"] = float("nan")
    for r in df[df.metric == "best_raw_fraction"].itertuples():
        same_link = (df.link_mbit == r.link_mbit) | (df.link_mbit.isna() & pd.isna(r.link_mbit))
        m = df[(df.part == r.part) & (df.backend == r.backend) & same_link].drop_duplicates("metric")
        m = m.set_index("metric").value
        where = f"{r.link_mbit:g} Mbit/s tbf (TCP)" if r.part == "tcp" else f"PCIe D2H ({r.device})"
        run_f = m.get("model_run_stages_best_raw_fraction")
        rows.append([where, r.backend, f"{m.best_raw_fraction:.3f}", f"{m.model_best_raw_fraction:.3f}",
                     "-" if run_f is None else f"{run_f:.3f}", f"{m.gain_over_all_raw:.2f}x",
                     f"{m.gain_over_all_compressed:.2f}x"])
    return (_table(rows, ["link", "codec lane", "best raw share f (measured)", "model's best f",
                          "model's best f (the stream's stage times)", "gain over all raw",
                          "gain over all compressed"])
            + "\n\nReported elsewhere: 1.69x over all-direct at 1 Gbit (github.com/shootthesound/torch-nvenc-compress, "
              "README; RTX 5090, NVENC, wire simulated by a sleep in each lane's thread). "
            + _source(df, "14_dual_lane"))
def host_round_trip() -> str | None:
    df = _csv("15_p2p_multi_gpu")
    if df is None or "effective_gbps" not in set(df.metric):
        return None
    df = df.assign(k=df.k.fillna(df.channels).astype(int)) if "k" in df else df.assign(k=df.channels)
    if "schedule" not in df:
        df = df.assign(schedule=None)
    t = df[df.metric == "effective_gbps"]
    keys = ["source", "channels", "k", "tensor_mb", "mode", "variant"]
    best = t.groupby(keys).value.max()
    top = t.loc[t.groupby(keys).value.idxmax()].set_index(keys)

    def where(*key):  # the best pipelined row's chunk size (and schedule, where timed both ways)
        r = top.loc[key]
        return f"{r.chunk_mb:g} MB" + (f", {str(r.schedule).replace('_', ' ')}" if isinstance(r.schedule, str) else "")

    q = df[df.metric.isin(["ratio", "cos_min"])].set_index(["source", "channels", "k", "tensor_mb", "metric"]).value
    rows, one_way = [], []
    n = int(t.stream.iloc[0])
    for (src, D, K, mb), _ in t[t["mode"] == "compressed"].groupby(["source", "channels", "k", "tensor_mb"]):
        b = {k[4:]: v for k, v in best.items() if k[:4] == (src, D, K, mb)}
        r = {k[4:]: v for k, v in best.items() if k[:4] == (src, D, D, mb)}  # the raw rows of these tensors
        rows.append([src, f"{int(D)}", f"{int(K)}", f"{n} x {mb:g} MB", f"{r[('raw', 'serial')]:.1f}",
                     f"{r[('raw', 'pipelined')]:.1f} ({where(src, D, D, mb, 'raw', 'pipelined')})",
                     f"{b[('compressed', 'serial')]:.1f}",
                     f"{b[('compressed', 'pipelined')]:.1f} ({where(src, D, K, mb, 'compressed', 'pipelined')})",
                     f"**{b[('compressed', 'pipelined')] / r[('raw', 'pipelined')]:.2f}x**",
                     f"{q[(src, D, K, mb, 'ratio')]:.2f}x", f"{q[(src, D, K, mb, 'cos_min')]:.5f}"])
        if ("raw", "offload") in r and ("compressed", "offload") in b:
            one_way.append([src, f"{int(D)}", f"{int(K)}", f"{n} x {mb:g} MB"] + [
                f"{r[('raw', v)]:.1f} / {b[('compressed', v)]:.1f} (**{b[('compressed', v)] / r[('raw', v)]:.2f}x**)"
                for v in ("offload", "fetch")])
    prof = df[df.metric == "kernel_us"]
    lines = []
    for (D, K, direction), g in prof.groupby(["channels", "k", "direction"]):
        most = g.sort_values("value", ascending=False).head(3)
        lines.append(f"D={int(D)}{f' K={int(K)}' if K != D else ''} {direction} {g.value.sum():.0f} us (" +
                     ", ".join(f"{_kernel_name(r.backend)} {r.value:.0f}" for r in most.itertuples()) + ")")
    return ("Effective GB/s (original bf16 bytes / call time, the call from tensors on the GPU to tensors back on "
            "it, checked first: raw bit-exact, compressed at the cos shown) of `HostStream.round_trip`, GPU -> "
            "pinned host -> the same GPU, synthetic heavy-tailed activations and SmolLM2's layer-15 hidden states, every "
            "variant on the same tensors "
            "in one run; pipelined rows give their best chunk size and, compressed, the better schedule (encodes "
            "and decodes in turns on the SMs, or side by side). K < D: the basis truncated to the components "
            "water-filling keeps at the same cos target, beside the full one:\n\n"
            + _table(rows, ["activations", "D", "K", "tensors", "raw, serial", "raw, pipelined (chunk)", "compressed, serial",
                            "compressed, pipelined (chunk)", "compressed / raw pipelined", "ratio", "cos (worst)"])
            + ("\n\nOne direction at a time, as a KV offload moves (`HostStream.offload`: GPU -> pinned host, "
               "checked by a `fetch` first; `HostStream.fetch`: pinned host -> GPU), effective GB/s raw / compressed "
               "in the same run:\n\n" + _table(one_way, ["activations", "D", "K", "tensors", "offload, raw / compressed",
                                                          "fetch, raw / compressed"]) if one_way else "")
            + ("\n\nKernel-only GPU time of one 64 MB tensor (torch.profiler; not a transfer figure): "
               + "; ".join(lines) + "." if lines else "")
            + "\n\n" + _source(df, "15_p2p_multi_gpu"))


def kv_codec_path(rows) -> dict:
    """What PoC 17's compressed_kv_codec rows (of one run) timed, from their columns: keys_after_rope,
    on_coefficients (attention on its coefficient rows), setting_ratio (the SmolLM2 ratio its steps were
    set for, or None) and stored (the ratios it coded at)."""
    rows = rows[rows["mode"] == "compressed_kv_codec"]

    def first(column):
        values = rows[column].dropna() if column in rows else []
        return values.iloc[0] if len(values) else None
    after = first("kv_codec_keys") not in (None, "before_rope")
    return dict(keys_after_rope=after, on_coefficients=after and str(first("kv_codec_coefficients")) != "False",
                setting_ratio=first("setting_ratio"), stored=rows[rows.metric == "ratio"].value)


def _kv_codec_path(timing) -> str:
    """What PoC 17's compressed_kv_codec rows time: where its keys were coded, how its steps were set."""
    path = kv_codec_path(timing)
    if not path["keys_after_rope"]:
        return "raw sink rows, keys before RoPE"
    ratio = path["setting_ratio"]
    return ("raw sink rows, keys after RoPE, "
            + ("attention on its coefficient rows" if path["on_coefficients"] else "KV reconstructed")
            + (f"; steps for the {ratio:.2f}x the setting reaches on SmolLM2" if ratio else ""))


def kv_spill() -> str | None:
    df = _csv("17_kv_spill_decode")
    if df is None:
        return None
    parts = []
    timing = df[df.loop == "own decode loop"]
    if (timing.device != "cpu").any():
        timing = timing[timing.device != "cpu"]
    if len(timing):
        rows, coefficient_mode = [], (timing["mode"] == "compressed_coefficients").any()
        kv_codec_mode = (timing["mode"] == "compressed_kv_codec").any()
        for context, g in timing.groupby("context"):
            v = {(r.mode, r.metric): r.value for r in g.itertuples()}
            tps = {m: v.get((m, "tokens_per_s")) for m in ("raw_fetch", "compressed_fetch", "gpu_resident")}
            if None in tps.values():
                continue
            coef = v.get(("compressed_coefficients", "tokens_per_s"))
            kv_path = v.get(("compressed_kv_codec", "tokens_per_s"))
            best = max(tps["compressed_fetch"], coef or 0, kv_path or 0)

            def ms(mode, metric):
                value = v.get((mode, f"per_layer_{metric}_ms"))
                return "-" if value is None or value != value else f"{value:.2f}"

            kv_ratio = v.get(("compressed_kv_codec", "ratio"))
            rows.append([f"{int(context) // 1024}K" if context >= 1024 else int(context),
                         f"{tps['raw_fetch']:.2f}", f"{tps['compressed_fetch']:.2f}"]
                        + ([f"{coef:.2f}" if coef else "-"] if coefficient_mode else [])
                        + ([f"{kv_path:.2f} ({kv_path / tps['raw_fetch']:.2f}x raw; ratio {kv_ratio:.2f}x)"
                            if kv_path else "-"] if kv_codec_mode else [])
                        + [f"{tps['gpu_resident']:.2f}", f"**{best / tps['raw_fetch']:.2f}x**",
                           f"{v[('raw_fetch', 'fetched_bytes_per_step')] / 1e9:.2f} / "
                           f"{v[('compressed_fetch', 'fetched_bytes_per_step')] / 1e9:.2f}",
                           f"{v[('compressed_fetch', 'ratio')]:.2f}x", f"{v[('compressed_fetch', 'cos')]:.5f}"]
                        + ([f"{ms('raw_fetch', 'layer')} / {ms('raw_fetch', 'copy')}",
                            f"{ms('compressed_fetch', 'layer')} / {ms('compressed_fetch', 'copy')} / "
                            f"{ms('compressed_fetch', 'decode')}"]
                           + ([f"{ms('compressed_coefficients', 'layer')} / {ms('compressed_coefficients', 'decode')}"]
                              if coefficient_mode else [])
                           if ("raw_fetch", "per_layer_layer_ms") in v else []))
        first = timing.iloc[0]
        graphs = "CUDA graphs for each layer's dense parts" if str(first.cuda_graphs) == "True" else "eager"
        api = timing[timing["mode"] == "compressed_fetch"].decode_api.dropna()
        profiled = "per_layer_layer_ms" in set(timing.metric)
        header = (["context", "raw_fetch tok/s", "compressed_fetch tok/s"]
                  + (["compressed, attention on coefficients tok/s"] if coefficient_mode else [])
                  + ([f"KV codec's path ({_kv_codec_path(timing)}) tok/s"] if kv_codec_mode else [])
                  + ["gpu_resident tok/s (bound)", "best compressed / raw", "GB fetched per step (raw / compressed)",
                     "ratio", "KV cos"]
                  + (["raw: ms per layer / its copy", "compressed: ms per layer / copy / decode"]
                     + (["coefficients: ms per layer / decode"] if coefficient_mode else []) if profiled else []))
        hbm = timing[timing.metric == "hbm_fraction"]
        bound = "" if not len(hbm) else (
            " The GPU-resident step reads its weights and KV at "
            + ", ".join(f"{r.value:.0%} ({int(r.context) // 1024}K)" for r in hbm.sort_values("context").itertuples())
            + " of the memory bandwidth a device-to-device copy measured in the same run.")
        parts.append(
            f"Decode tokens/s (batch 1) with every layer's KV in host memory, fetched each step ({first.model}; "
            f"own decode loop, {graphs}; bases fitted on the model's own prompt; {first.fetch_path}):\n\n"
            + _table(rows, header)
            + (f"\n\nCompressed blobs decoded by: {api.iloc[0]}." if len(api) else "")
            + (" Per-layer times are medians over one profiled step's layers (CUDA events): a layer's span on the "
               "compute stream (waits for its fetch included), its fetch's H2D copy, its decode." if profiled else "")
            + bound)
    lm = df[df.loop != "own decode loop"]
    if len(lm):
        codec = lm["codec"].astype(str) if "codec" in lm else pd.Series("", index=lm.index)
        v = {(r.mode, c, r.metric): r.value for r, c in zip(lm.itertuples(), codec)}
        same = [m for m in ("raw_fetch", "gpu_resident") if any(
            val == 1.0 for (mode, _, metric), val in v.items() if mode == m and metric == "greedy_identical")]
        rows = []
        for name in sorted({c for (mode, c, metric) in v if mode == "compressed_fetch" and metric == "ppl_change_pct"}):
            def get(metric, fmt):
                value = v.get(("compressed_fetch", name, metric))
                return "-" if value is None or value != value else format(value, fmt)
            se = get("ppl_change_se_pct", ".3f")
            rows.append([name if name not in ("", "nan") else "compressed_fetch", get("ratio", ".2f") + "x",
                         f"{get('cos', '.5f')} ({get('cos_min', '.5f')})", f"**{get('ppl_change_pct', '+.3f')}%**"
                         + ("" if se == "-" else f" ± {se}%"),
                         get("top1_agreement", ".4f"), get("agreement", ".4f"), get("first_divergence", ".0f"),
                         get("tokens_per_s", ".1f")])
        if rows:
            base = next((val for (mode, _, metric), val in v.items() if metric == "perplexity_dynamic_cache"), None)
            chunks = lm["evaluated_chunks"].dropna().astype(str) if "evaluated_chunks" in lm else pd.Series([], dtype=str)
            gen = {m: val for (m, _, metric), val in v.items() if metric == "tokens_per_s" and m in
                   ("dynamic_cache", "raw_fetch", "gpu_resident")}
            parts.append(
                "SmolLM2-135M through transformers' forward and generate() with the cache, each compressed setting "
                f"against DynamicCache (perplexity {base:.4f}) on text chunks "
                f"{chunks.iloc[0] if len(chunks) else '(see the CSV)'} of the evaluation text, which neither codec "
                "was fitted or calibrated on"
                + (" (± a standard error over the chunks, paired with DynamicCache's)"
                   if any(metric == "ppl_change_se_pct" for (_, _, metric) in v) else "")
                + "; greedy-output agreement along DynamicCache's greedy output"
                + (f" ({int(lm.prompts.dropna().max())} prompts x {int(lm.steps.dropna().max())} steps)"
                   if "prompts" in lm and lm.prompts.notna().any() and "steps" in lm else "") + ":\n\n"
                + _table(rows, ["codec", "ratio", "KV cos (worst layer)", "perplexity change", "next-token agreement",
                                "greedy-output agreement", "a free run first differs at token", "generate() tokens/s"])
                + "\n\n" + (f"{' and '.join(same)} gave DynamicCache's greedy output exactly. " if same else
                              "WARNING: an uncompressed mode differed from DynamicCache. ")
                + "generate() tokens/s uncompressed: " + ", ".join(f"{m} {t:.1f}" for m, t in gen.items())
                + f" ({', '.join(sorted(set(lm.device.astype(str))))}).")
    return "\n\n".join(parts) + "\n\n" + _source(df, "17_kv_spill_decode") if parts else None


SECTIONS = [
    ("Compression at quality targets (PoCs 03, 04)", compression),
    ("Downstream cost (PoC 05)", downstream),
    ("Diffusion: final-image PSNR against the compressed size (PoC 05)", downstream_diffusion),
    ("Channel spectra (PoC 02)", spectrum),
    ("Known-compressibility controls (PoC 01)", controls),
    ("FFmpeg subprocess vs in-process session (PoC 08)", subprocess_overhead),
    ("Which coder wins on identical coefficients (PoC 06)", coder_ablation),
    ("Speed of every backend (PoCs 09, 10, 12)", gpu_speed),
    ("The compute codec through its API, by tensor size (PoC 09 --api)", api_speed),
    ("Where the API's GPU time goes, kernel by kernel (PoC 09 --profile)", api_profile),
    ("The compute codec on one CPU core (PoC 09 --api-cpu)", api_cpu_speed),
    ("Compressed vs raw over real links, and the pipelined model (PoC 13)", wire_simulation),
    ("Raw lane + codec lane at once (PoC 14)", dual_lane),
    ("Host round trip through the pipelined stream (PoC 15)", host_round_trip),
    ("KV cache spilled to host memory: decode tokens/s (PoC 17)", kv_spill),
]


def render() -> str:
    out = []
    for title, fn in SECTIONS:
        body = fn()
        if body:
            out.append(f"### {title}\n\n{body}")
    return "\n\n".join(out)


MARKERS = ("RESULTS", "FUZZ")  # <!-- NAME --> ... <!-- /NAME -->: the blocks update_readme rewrites


def marked_files(root: Path = ROOT) -> list[Path]:
    """README.md and docs/*.md, those of them that hold a start marker of MARKERS."""
    candidates = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [p for p in candidates
            if p.exists() and any(f"<!-- {m} -->" in p.read_text() for m in MARKERS)]


def _substitute(text: str, name: str, body: str) -> str:
    return re.sub(rf"<!-- {name} -->.*<!-- /{name} -->", lambda _: f"<!-- {name} -->\n{body}\n<!-- /{name} -->",
                  text, flags=re.S)


def update_readme(path: Path | None = None) -> list[Path]:
    """Rewrite the generated tables between the markers, wherever they live.

    With no path: every file among README.md and docs/*.md that holds a marker (the RESULTS block is in
    docs/results.md, the FUZZ block in docs/decoder-checks.md). With a path: that file alone. Returns the
    files it rewrote; a file whose text did not change is left untouched.
    """
    paths = [Path(path)] if path is not None else marked_files()
    if not paths:
        raise SystemExit("no file among README.md and docs/*.md holds a <!-- RESULTS --> or <!-- FUZZ --> marker")
    results = fuzz = None
    rewritten = []
    for p in paths:
        text = p.read_text()
        new = text
        if "<!-- RESULTS -->" in new:
            results = render() if results is None else results
            new = _substitute(new, "RESULTS", results)
        if "<!-- FUZZ -->" in new:
            fuzz = fuzz_summary() if fuzz is None else fuzz
            if fuzz:
                new = _substitute(new, "FUZZ", fuzz)
        if new != text:
            p.write_text(new)
            rewritten.append(p)
        name = p.relative_to(ROOT) if p.resolve().is_relative_to(ROOT.resolve()) else p
        print(f"{'rewrote' if new != text else 'already current:'} the generated tables of {name}")
    return rewritten


if __name__ == "__main__":
    update_readme()

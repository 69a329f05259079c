"""Leave-one-out sweeps of PCA rank K x codec setting, and the operating points they give.

Used by the Pareto PoCs (03 diffusion, 04 LLM KV) and the downstream PoC (05): each held-out
capture is coded with a basis fitted on all the others, so no number benefits from having seen
the tensor it compresses.

    rows = loo_sweep(captures, ks=[16, 64, 192], codecs=[("x265", {"qp": None}), ("x265", {"qp": 18})])
    best = operating_points(rows, thresholds=(0.999, 0.99, 0.97, 0.94))
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
from tqdm import tqdm

from .basis import as_float_matrix, leave_one_out
from .metrics import aggregate, quality, ratio
from .pipeline import TensorCodec

COS_THRESHOLDS = (0.999, 0.99, 0.97, 0.94)


def codec_label(backend: str, settings: dict) -> str:
    if "qp" in settings:
        return f"{backend} {'lossless' if settings['qp'] is None else 'qp' + str(settings['qp'])}"
    return backend


def loo_sweep(captures: Sequence, ks: Iterable[int], codecs: Sequence[tuple[str, dict]], frame: int = 256,
              raw_control: bool = True, desc: str = "sweep", groups: Sequence | None = None,
              **fixed) -> list[dict]:
    """One dict per (K or 'raw', codec): ratio and aggregated quality over held-out captures."""
    ks = sorted(set(int(k) for k in ks))
    dim = as_float_matrix(captures[0]).shape[1]
    ks = [k for k in ks if k <= dim]
    bases = [b for _, b in leave_one_out(captures, max(ks), groups)]
    settings_list = [(k, b, s) for k in ks for b, s in codecs]
    if raw_control:
        settings_list += [(None, b, s) for b, s in codecs]
    rows = []
    for k, backend, settings in tqdm(settings_list, desc=desc, leave=False):
        per_capture, total_bytes, total_values = [], 0, 0
        for i, x in enumerate(captures):
            basis = bases[i].truncate(k) if k is not None else None
            codec = TensorCodec(basis, backend=backend, frame_size=frame, **settings)
            blob = codec.encode(x)
            x_hat = codec.decode(blob)
            per_capture.append(quality(as_float_matrix(x), x_hat.float().numpy()))
            total_bytes += len(blob)
            total_values += int(np.prod(x.shape))
        q = aggregate(per_capture)
        rows.append({"k": k if k is not None else dim, "basis": "pca_loo" if k is not None else "raw",
                     "backend": backend, "codec": codec_label(backend, settings), "qp": settings.get("qp"),
                     "ratio": ratio((total_values,), total_bytes), "bytes": total_bytes, **q, "dim": dim,
                     "n_captures": len(captures), "frame": frame, **fixed})
    return rows


def operating_points(rows: Sequence[dict], thresholds=COS_THRESHOLDS, basis: str = "pca_loo",
                     key: str = "cos_mean") -> list[dict]:
    """For each threshold, the row with the best ratio whose quality is at least the threshold."""
    best = []
    for t in thresholds:
        ok = [r for r in rows if r["basis"] == basis and r[key] >= t]
        if ok:
            best.append({**max(ok, key=lambda r: r["ratio"]), "threshold": t})
    return best


def report_sweep(res, rows: Sequence[dict], label: str = "") -> None:
    """Write the sweep and its operating points (metric best_ratio) into a ResultsWriter and print them."""
    add_rows(res, rows)
    keep = ("source", "model", "layer", "frame", "basis")
    for op in operating_points(rows):
        res.add(backend=op["backend"], metric="best_ratio", value=op["ratio"], unit="x", threshold=op["threshold"],
                k=op["k"], codec=op["codec"], qp=op["qp"], cos_mean=op["cos_mean"], cos_min=op["cos_min"],
                p1=op["p1"], **{k: op[k] for k in keep if k in op})
        print(f"{label:<6}{op['threshold']:<8}{op['ratio']:>7.2f}{op['k']:>5}  {op['codec']:<14}"
              f"{op['cos_min']:>8.4f}{op['p1']:>7.3f}")
    raw = max((r for r in rows if r["basis"] == "raw" and r["qp"] is None), key=lambda r: r["ratio"])
    print(f"{label:<6}raw-channel control, lossless codec stage: {raw['ratio']:.2f}x at cos {raw['cos_mean']:.5f}")


def add_rows(res, rows: Sequence[dict], metrics=("ratio", "cos_mean", "cos_min", "p1", "rel_mse"), **extra) -> None:
    """Write sweep rows into a ResultsWriter in long format."""
    units = {"ratio": "x", "bytes": "B"}
    for r in rows:
        settings = {k: v for k, v in r.items() if k not in metrics and k not in ("backend", "bytes", "cos_min_token",
                                                                                  "max_abs_err")}
        for m in metrics:
            res.add(backend=r["backend"], metric=m, value=r[m], unit=units.get(m, "1"), **settings, **extra)


def sweep_frame(df):
    """Long-format rows of a sweep -> one row per (source, basis, k, codec) with ratio and cos_mean columns."""
    keys = [c for c in ("source", "basis", "k", "codec") if c in df.columns]
    wide = df[df.metric.isin(["ratio", "cos_mean", "cos_min"])].pivot_table(index=keys, columns="metric",
                                                                             values="value").reset_index()
    return wide


def codec_order(codec: str):
    """Sort key for codec labels: lossless first, then constant QP from fine to coarse."""
    tail = codec.split()[-1]
    return (codec.split()[0], -1 if tail == "lossless" else int(tail[2:]) if tail[2:].isdigit() else 999)


def plot_pareto(ax, wide, anchors: Sequence[tuple[float, float, str]] = (), title: str = "",
                anchor_source: str = "the original write-up, another model", label_k=("first", "last")):
    """Ratio against 1 - cos_mean for every codec setting (ordered lossless, QP fine..coarse), one colour
    and marker each; PCA points joined along K and labelled with K on the first and last setting; the
    raw-channel control as a cross of the setting's colour; another project's numbers as grey stars."""
    import matplotlib.ticker as mticker

    from .results import REFERENCE, series_style

    codecs = sorted(dict.fromkeys(wide.codec), key=codec_order)
    labelled = {codecs[0] if "first" in label_k else None, codecs[-1] if "last" in label_k else None}
    for i, codec in enumerate(codecs):
        st = series_style(i)
        pca = wide[(wide.codec == codec) & (wide.basis == "pca_loo")].sort_values("k")
        ax.plot(1 - pca.cos_mean, pca.ratio, "-", lw=1.2, ms=4.5, **st, label=f"{codec}, PCA (K sweep)")
        if codec in labelled:
            for r in pca.itertuples():
                ax.annotate(f"K{int(r.k)}", (1 - r.cos_mean, r.ratio), textcoords="offset points", xytext=(3, -9),
                            fontsize=6, color=st["color"])
        raw = wide[(wide.codec == codec) & (wide.basis == "raw")]
        ax.plot(1 - raw.cos_mean, raw.ratio, "x", ms=8, mew=2, color=st["color"], ls="none")
    ax.plot([], [], "x", ms=8, mew=2, color="0.3", ls="none", label="raw channels, no PCA (colour: setting)")
    for j, (cos, r, label) in enumerate(anchors):
        ax.plot(1 - cos, r, **REFERENCE, zorder=5, label=f"{anchor_source}" if j == 0 else None)
        ax.annotate(label, (1 - cos, r), textcoords="offset points", xytext=(7, 2), fontsize=7, color="0.3")
    ax.set_xscale("log")
    ax.set_yscale("log")
    fmt = mticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "2357" else ""))
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xlabel("1 - cos_mean (mean per-token cosine; log, left = better)")
    ax.set_ylabel("compression ratio vs bf16 (x, log)")
    for t in COS_THRESHOLDS:
        ax.axvline(1 - t, color="0.75", lw=0.7, ls=":")
        ax.annotate(f"cos {t:g}", (1 - t, 0.01), xycoords=("data", "axes fraction"), fontsize=6, color="0.5",
                    rotation=90, va="bottom", ha="right")
    ax.set_title(title)

"""Long-format results CSVs and the one plotting style every figure uses.

    res = ResultsWriter("01", "synthetic_controls")
    res.add(backend="x265", metric="ratio", value=4.1, unit="x", source="gaussian", qp=18)
    res.save()            # results/01_synthetic_controls.csv

Every row carries poc, device (the GPU name from the driver, or 'cpu'), backend, metric, value,
unit, the settings given, the run size (`run`: full or quick), and the versions of the libraries
that made it.

Committed results are not overwritten by accident:
- a `--quick` run (the PoC's command line holds `--quick`) writes results/local/ and figures/local/
  (both ignored by git), and its rows say `run=quick`; figures drawn in that run read the quick CSV;
- a full run that would replace a CSV first prints what changes and what it reproduced (diff_summary:
  rows matched on the PoC's own columns and the device, not on the code, date or versions; rows
  added, removed; values reproduced exactly and within 5%; those that moved most), then writes it:
  `git diff --stat results/` and `git checkout results/` undo it;
- a run on a machine without the GPU that measured a committed CSV writes results/local/ instead.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
FIGURES = ROOT / "figures"
LOCAL = "local"  # results/local/ and figures/local/: quick runs and runs that must not replace committed rows
FIRST_COLUMNS = ["poc", "device", "backend", "metric", "value", "unit"]
VERSIONED = ["torch", "numpy", "av", "zstandard", "transformers", "diffusers", "PyNvVideoCodec",
             "nvidia-nvcomp-cu13", "triton"]


@lru_cache(maxsize=None)
def device_name(use_gpu: bool = True) -> str:
    """'NVIDIA H200' style name of GPU 0 when the run uses a GPU, else 'cpu'."""
    if use_gpu:
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(0)
        except ImportError:
            pass
    return "cpu"


@lru_cache(maxsize=None)
def environment() -> dict[str, str]:
    env = {"python": platform.python_version(), "cpu_count": str(os.cpu_count())}
    for pkg in VERSIONED:
        try:
            env[f"v_{pkg}"] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            env["driver"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    code = _code()
    if code:
        env["code"] = code
    return env


CSV_DTYPES = {"poc": str, "code": str}  # read as text: a PoC number keeps its zero, an all-digit commit stays a commit


def _code() -> str | None:
    """The commit of the running code, '+' where the tree differs from it; $PROJECT_CODE, where set,
    names it instead (a copy of the tree sent to a GPU machine, whose .git, if any, is not its commit)."""
    if os.environ.get("PROJECT_CODE"):
        return os.environ["PROJECT_CODE"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "shared", "pocs"],
                                   cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("+" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("PROJECT_CODE") or None


def is_quick() -> bool:
    """True in a CI-sized run: every PoC's command line spells it `--quick`."""
    return "--quick" in sys.argv[1:]


def results_dir(quick: bool | None = None) -> Path:
    return RESULTS / LOCAL if (is_quick() if quick is None else quick) else RESULTS


def figures_dir(quick: bool | None = None) -> Path:
    return FIGURES / LOCAL if (is_quick() if quick is None else quick) else FIGURES


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# What a rerun's row carries beside the PoC's own columns: the machine and libraries (environment();
# each v_<package> of VERSIONED), and the bookkeeping ResultsWriter.frame adds (run, date). A PoC
# column of the same name as an environment key keeps its name and the environment's becomes env_<key>.
ENV_COLUMNS = {"python", "cpu_count", "driver", "code"}
BOOKKEEPING_COLUMNS = {"run", "date"}
EXACT_RTOL, EXACT_ATOL = 1e-6, 1e-9  # a value within these of the committed one reproduced
NEAR = 0.05  # ... and within this relative change it reproduced as a timing does
TIMING_UNITS = re.compile(r"^(ns|us|ms|s)\b|/s\b")  # ms, us of GPU time per call, GB/s, tokens/s, ...


def is_environment_column(name: str, columns=()) -> bool:
    """True for a column that says where and when a row was made, not what was measured: the value
    of no PoC setting (environment() keys, v_<package>, env_<key>, run, date). `columns`: the frame's
    columns (a PoC's own column X sits beside env_X, and stays a key)."""
    name = str(name)
    if name.startswith(("v_", "env_")) or name in BOOKKEEPING_COLUMNS:
        return True
    return name in ENV_COLUMNS and f"env_{name}" not in columns


def key_columns(df) -> list[str]:
    """The columns that say which measurement a row is (the PoC's key): every column but the value,
    the environment and bookkeeping columns, and columns holding fractional numbers (measurements
    recorded beside the value, like cos_mean or call_ms). device stays: another GPU is another row."""
    import pandas as pd

    cols = []
    for c in df.columns:
        if c == "value" or is_environment_column(c, df.columns):
            continue
        if pd.api.types.is_float_dtype(df[c]) and (df[c].dropna() % 1 != 0).any():
            continue
        cols.append(c)
    return cols


def _key_text(v) -> str:
    """A key cell as text that reads the same from a CSV and from memory (8, 8.0 and '8.0' are '8')."""
    import pandas as pd

    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return ""
    if isinstance(v, bool):
        return str(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if f != f or f in (float("inf"), float("-inf")):
        return str(v)
    return str(int(f)) if f.is_integer() and abs(f) < 2 ** 63 else repr(f)


def diff_summary(old, new, show: int = 5) -> list[str]:
    """What replacing CSV `old` by `new` changes, and what the rerun reproduced.

    Rows are matched on the key columns both frames share (key_columns: the PoC's own settings and
    device; never the environment, the code, the date or the run), repeated keys in order. Lines: rows
    added / removed / matched and how many matched values changed; how many reproduced exactly
    (within EXACT_RTOL relative, EXACT_ATOL absolute) and within NEAR (5%, the run-to-run spread of a
    timing), with the timing rows (TIMING_UNITS) counted apart; then the `show` values that changed
    most, each named by its key."""
    import numpy as np
    import pandas as pd

    old, new = old.reset_index(drop=True), new.reset_index(drop=True)
    old_keys, new_keys = key_columns(old), key_columns(new)
    cols = [c for c in old_keys if c in new_keys]
    lines = []
    only_old, only_new = [c for c in old_keys if c not in cols], [c for c in new_keys if c not in cols]
    if only_old or only_new:
        lines.append("key columns not matched on: " + "; ".join(
            part for part in (f"only before: {', '.join(only_old)}" if only_old else "",
                              f"only now: {', '.join(only_new)}" if only_new else "") if part))

    def texts(df):
        return df[cols].apply(lambda col: col.map(_key_text)) if cols else pd.DataFrame(index=df.index)

    def keyed(df, text):
        key = text.agg("\x1f".join, axis=1) if cols else pd.Series("", index=df.index)
        df = df[["value"] + (["unit"] if "unit" in df else [])].assign(_key=key.to_numpy(), _row=df.index)
        return df.assign(_n=df.groupby("_key").cumcount())

    new_text = texts(new)
    m = keyed(old, texts(old)).merge(keyed(new, new_text), on=["_key", "_n"], how="outer", suffixes=("_old", "_new"),
                                     indicator=True)
    gone, added = int((m["_merge"] == "left_only").sum()), int((m["_merge"] == "right_only").sum())
    both = m[m["_merge"] == "both"].reset_index(drop=True)
    a = pd.to_numeric(both["value_old"], errors="coerce").to_numpy(float)
    b = pd.to_numeric(both["value_new"], errors="coerce").to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(b - a) / np.abs(a)
    rel[(a == b) | (np.isnan(a) & np.isnan(b))] = 0.0
    exact = np.isclose(b, a, rtol=EXACT_RTOL, atol=EXACT_ATOL) | (np.isnan(a) & np.isnan(b))
    near = exact | (rel <= NEAR)
    unit = both["unit_new"] if "unit_new" in both else pd.Series("", index=both.index)
    timing = unit.map(lambda u: bool(isinstance(u, str) and TIMING_UNITS.search(u))).to_numpy(bool)
    n = len(both)
    lines.append(f"{len(old)} rows before, {len(new)} now: {added} added, {gone} removed, "
                 f"{int((~exact).sum())} of {n} matched values changed")
    tol = f"within rel {EXACT_RTOL:g}, abs {EXACT_ATOL:g}"
    if n and exact.all():
        lines.append(f"all {n} matched values reproduced ({tol})")
    elif n:
        line = (f"reproduced: {int(exact.sum())} of {n} matched values {tol}, {int(near.sum())} within "
                f"{100 * NEAR:g}%")
        if timing.any():
            line += (f"; timings ({', '.join(sorted(set(unit[timing])))[:60]}): {int(near[timing].sum())} of "
                     f"{int(timing.sum())} within {100 * NEAR:g}%")
        lines.append(line)
    if not exact.all():
        lines.append(f"changed most (of {int((~exact).sum())}):" if (~exact).sum() > show else "changed:")
        order = np.argsort(-np.nan_to_num(np.where(exact, -1.0, rel), nan=np.inf), kind="stable")
        for i in order[:show]:
            if exact[i]:
                break
            row = new_text.loc[int(both["_row_new"].iloc[i])]
            named = [c for c in ("metric", "backend") if c in cols] + [c for c in cols if c not in (
                "metric", "backend", "poc", "unit", "device")] + (["device"] if "device" in cols else [])
            key = ", ".join(f"{c}={row[c]}" for c in named if row[c])
            key = key if len(key) <= 200 else key[:197] + "..."
            change = (f"{a[i]:.6g} -> {b[i]:.6g} ({100 * (b[i] - a[i]) / abs(a[i]):+.1f}%)" if np.isfinite(rel[i])
                      else f"{a[i]} -> {b[i]}")
            lines.append(f"  [{key}]: {change}")
    return lines


# How long each CPU PoC takes on a 2-core CPU machine from a clean state (captures included), in
# minutes: (full run, --quick run). CPU time (user + system) measured with /usr/bin/time on
# 2026-12-01 (PoC 07's full run: 2026-12-07, captures included), which is about the wall time of an idle
# machine (those days' machines were busy). None: not measured.
# The "Run times" table of docs/hardware.md gives the same numbers with the wall times.
RUN_MINUTES = {
    "01": (1.5, 0.05), "02": (3.2, 0.63), "03": (7.6, 0.27), "04": (1.5, 0.4), "05": (None, None),
    "06": (2.1, 0.73), "07": (1.9, 0.52), "08": (0.23, 0.05), "13": (7.2, 0.75), "14": (3.5, 0.23),
    "15": (None, 0.29), "16": (20, 0.77), "17": (None, 0.72), "18": (1.3, 0.37),
}


def _minutes(m: float) -> str:
    return f"{m * 60:.0f} s" if m < 2 else f"{m:.0f} min"


def announce(poc: str, machine: str = "a 2-core CPU machine") -> None:
    """Say, before a long run starts, how long it takes on `machine` (RUN_MINUTES)."""
    full, quick = RUN_MINUTES.get(poc, (None, None))
    mine, other = (quick, full) if is_quick() else (full, quick)
    kind, other_kind = ("quick", "full") if is_quick() else ("full", "quick")
    said = (f"a {kind} run takes about {_minutes(mine)} on {machine} (measured there, captures included; "
            "longer when the machine is busy)" if mine is not None else f"a {kind} run's time on {machine} is not "
            "measured (docs/hardware.md: Run times)")
    if other is not None:
        said += f"; the {other_kind} run takes about {_minutes(other)}"
    print(f"PoC {poc}: {said}. Progress bars follow.", flush=True)


class ResultsWriter:
    def __init__(self, poc: str, name: str, gpu: bool = False, quick: bool | None = None):
        self.poc, self.name, self.gpu = poc, name, gpu
        self.quick = is_quick() if quick is None else quick
        self.rows: list[dict] = []
        self.path = results_dir(self.quick) / f"{poc}_{name}.csv"

    def add(self, *, backend: str, metric: str, value: float, unit: str, device: str | None = None, **settings):
        row = {"poc": self.poc, "device": device or device_name(self.gpu), "backend": backend,
               "metric": metric, "value": value, "unit": unit}
        row.update(settings)
        self.rows.append(row)
        return row

    def frame(self):
        import pandas as pd

        df = pd.DataFrame(self.rows)
        env = environment()
        for k, v in env.items():  # a PoC's own column of the same name keeps its values
            df[k if k not in df else f"env_{k}"] = v
        df["run"] = "quick" if self.quick else "full"
        df["date"] = datetime.date.today().isoformat()
        cols = FIRST_COLUMNS + [c for c in df.columns if c not in FIRST_COLUMNS]
        return df[cols]

    def save(self, path: str | Path | None = None, frame=None) -> Path:
        """Write `frame` (default: this run's rows) to `path` (default: self.path), never over committed
        results by accident: a quick run goes to results/local/, a full run prints what it changes."""
        import pandas as pd

        path = Path(path) if path else self.path
        frame = self.frame() if frame is None else frame
        if self.quick and path.parent == RESULTS:
            path = RESULTS / LOCAL / path.name
        if path.exists() and path.parent == RESULTS:
            old = pd.read_csv(path, dtype=CSV_DTYPES)
            lost = set(old.device.astype(str)) - set(frame.device.astype(str)) - {"cpu"}
            if lost:  # never replace GPU measurements with a run on a machine without that GPU
                path = RESULTS / LOCAL / path.name
                print(f"results/{path.name} holds rows measured on {', '.join(sorted(lost))}, which this run did "
                      f"not use: writing {_rel(path)} instead")
            else:
                lines = diff_summary(old, frame.astype({"poc": str}))
                print(f"replacing {_rel(path)} (undo: git checkout {_rel(path)}):")
                print("\n".join("  " + line for line in lines))
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(path, index=False)
        print(f"wrote {_rel(path)} ({len(frame)} rows{', quick run' if self.quick else ''})")
        return path

    def merge(self, **match) -> Path:
        """Write this run's rows into the existing CSV, replacing its rows whose columns equal `match`
        (e.g. part="gpu_link": a GPU-only rerun on another machine); a plain save() if there is no CSV."""
        if not self.path.exists():
            return self.save()
        import pandas as pd

        old = pd.read_csv(self.path, dtype=CSV_DTYPES)
        hit = pd.Series(True, index=old.index)
        for col, value in match.items():
            hit &= old[col] == value if col in old else False
        pd.concat([old[~hit], self.frame()]).to_csv(self.path, index=False)
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        print(f"merged {len(self.rows)} rows into {where} (replacing {int(hit.sum())} rows with {match})")
        return self.path


def csv_path(poc_name: str) -> Path:
    """results/<poc_name>.csv, or in a quick run the quick run's results/local/<poc_name>.csv."""
    local = results_dir() / f"{poc_name}.csv"
    return local if local.exists() else RESULTS / f"{poc_name}.csv"


def load(poc_name: str):
    """Read the CSV a figure is drawn from (csv_path) into a DataFrame."""
    import pandas as pd

    return pd.read_csv(csv_path(poc_name), dtype=CSV_DTYPES)


# Okabe-Ito (colour-blind safe; its yellow is left out: it vanishes on white), each with its own marker,
# so two series never share both colour and marker, and a grey print still tells them apart.
COLORS = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h"]
# Another project's (or a theoretical) number drawn beside ours: grey star, labelled as such.
REFERENCE = dict(color="0.45", marker="*", markersize=12, linestyle="none")


def series_style(i: int) -> dict:
    """Colour and marker of the i-th series of a figure (a distinct pair for i < 70)."""
    n = len(COLORS)  # the marker steps by 3 (prime to 10) each time the colours wrap round
    return dict(color=COLORS[i % n], marker=MARKERS[(i % n + 3 * (i // n)) % len(MARKERS)])


def apply_style():
    """The one look for every figure: white, readable fonts, light grid, colour-blind-safe colours
    with a marker per series, legends outside the data (legend_outside)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({
        "figure.dpi": 110, "savefig.dpi": 150, "savefig.bbox": "tight", "savefig.pad_inches": 0.15,
        "font.size": 10, "axes.titlesize": 10.5, "axes.labelsize": 10, "legend.fontsize": 8,
        "figure.titlesize": 12, "figure.titleweight": "bold",
        "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
        "legend.frameon": False, "lines.markersize": 5,
        "axes.prop_cycle": matplotlib.cycler(color=COLORS) + matplotlib.cycler(marker=MARKERS[:len(COLORS)]),
    })
    return plt


def legend_outside(target, handles=None, labels=None, where: str = "right", ncol: int = 1, title=None, **kw):
    """A legend beside the axes (where='right') or below the figure (where='below'), never over data.

    `target` is an Axes or a Figure; handles/labels default to the target's own, in drawing order."""
    import matplotlib.figure

    if handles is None:
        src = target.axes[0] if isinstance(target, matplotlib.figure.Figure) else target
        handles, labels = src.get_legend_handles_labels()
    if where == "right":
        kw = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), **kw)
    else:
        kw = dict(loc="upper center", bbox_to_anchor=(0.5, -0.02 if isinstance(target, matplotlib.figure.Figure)
                                                        else -0.18), **kw)
    return target.legend(handles, labels, ncol=ncol, title=title, **kw)


def save_figure(fig, name: str, source_csv: str) -> Path:
    """Save figures/<name>.png (a quick run: figures/local/) with a footer, below everything drawn,
    naming the CSV it was drawn from."""
    out = figures_dir()
    out.mkdir(parents=True, exist_ok=True)
    src = csv_path(Path(source_csv).stem)
    fig.canvas.draw()
    box = fig.get_tightbbox(fig.canvas.get_renderer())  # inches
    note = " (quick run)" if src.parent.name == LOCAL and is_quick() else ""
    fig.text(box.x1 / fig.get_figwidth(), box.y0 / fig.get_figheight() - 0.01, f"data: {_rel(src)}{note}",
             ha="right", va="top", fontsize=7, color="0.4")
    path = out / f"{name}.png"
    fig.savefig(path)
    print(f"wrote {_rel(path)}")
    return path

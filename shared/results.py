"""Long-format results CSVs (DESIGN section 7) and the one plotting style every figure uses.

    res = ResultsWriter("01", "synthetic_controls")
    res.add(backend="x265", metric="ratio", value=4.1, unit="x", source="gaussian", qp=18)
    res.save()            # results/01_synthetic_controls.csv

Every row carries poc, device (the GPU name from the driver, or 'cpu'), backend, metric, value,
unit, the settings given, and the versions of the libraries that made it.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
FIGURES = ROOT / "figures"
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
    env = {"python": platform.python_version(), "cpu_count": str(__import__("os").cpu_count())}
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
    return env


class ResultsWriter:
    def __init__(self, poc: str, name: str, gpu: bool = False):
        self.poc, self.name, self.gpu = poc, name, gpu
        self.rows: list[dict] = []
        self.path = RESULTS / f"{poc}_{name}.csv"

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
        for k, v in env.items():
            df[k] = v
        df["date"] = datetime.date.today().isoformat()
        cols = FIRST_COLUMNS + [c for c in df.columns if c not in FIRST_COLUMNS]
        return df[cols]

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path else self.path
        frame = self.frame()
        if path.exists():
            import pandas as pd

            lost = set(pd.read_csv(path, usecols=["device"]).device.astype(str)) - set(frame.device) - {"cpu"}
            if lost:  # never replace GPU measurements with a run on a machine without that GPU
                path = RESULTS / "local" / path.name
                print(f"results/{path.name} holds rows measured on {', '.join(sorted(lost))}, which this run did "
                      f"not use: writing {path.relative_to(ROOT)} instead")
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(path, index=False)
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} ({len(self.rows)} rows)")
        return path

    def merge(self, **match) -> Path:
        """Write this run's rows into the existing CSV, replacing its rows whose columns equal `match`
        (e.g. part="gpu_link": a GPU-only rerun on another machine); a plain save() if there is no CSV."""
        if not self.path.exists():
            return self.save()
        import pandas as pd

        old = pd.read_csv(self.path, dtype={"poc": str})
        hit = pd.Series(True, index=old.index)
        for col, value in match.items():
            hit &= old[col] == value if col in old else False
        pd.concat([old[~hit], self.frame()]).to_csv(self.path, index=False)
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        print(f"merged {len(self.rows)} rows into {where} (replacing {int(hit.sum())} rows with {match})")
        return self.path


def load(poc_name: str):
    """Read results/<poc_name>.csv into a DataFrame."""
    import pandas as pd

    return pd.read_csv(RESULTS / f"{poc_name}.csv")


def apply_style():
    """The one look for every figure: white, readable fonts, light grid, colour-blind-safe colours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({
        "figure.dpi": 110, "savefig.dpi": 150, "savefig.bbox": "tight",
        "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 8,
        "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
        "axes.prop_cycle": matplotlib.cycler(color=["#0072B2", "#E69F00", "#009E73", "#D55E00",
                                                    "#CC79A7", "#56B4E9", "#F0E442", "#000000"]),
    })
    return plt


def save_figure(fig, name: str, source_csv: str) -> Path:
    """Save figures/<name>.png with a footer naming the CSV it was drawn from."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    fig.text(0.99, 0.005, f"data: results/{source_csv}", ha="right", va="bottom", fontsize=7, color="0.4")
    path = FIGURES / f"{name}.png"
    fig.savefig(path)
    print(f"wrote {path.relative_to(ROOT)}")
    return path

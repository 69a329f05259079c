"""PoC 02 - How heavy-tailed is the channel covariance of diffusion activations and of LLM K and V?

A PCA basis only pays if a few directions hold most of the variance. For every layer's K and V of
SmolLM2-135M (6 chunks x 1024 tokens of text that ships with Python) and for the image stream of the
embedded diffusion transformer's middle double block (8 seeds x 10 classes x 20 denoising steps),
we accumulate the channel covariance in float64 and report its eigenvalue spectrum:
effective rank (exp of the entropy of the normalized eigenvalues), participation ratio
((sum l)^2 / sum l^2), the share of variance in the top 1%, 10% and 25% of components, and the
max/median eigenvalue ratio.

Command:   make poc-02            (or: python pocs/02_spectrum.py [--quick])
Writes:    results/02_spectrum.csv, figures/02_spectrum.png
Sample output (quick run, --quick, on a 2-core CPU machine; its first 6 of 61 rows):
    source                        D  eff_rank part_ratio  top10%  max/median
    tiny_flux image stream      128      11.5        6.8   0.940      2090.7
    smollm2 L0 k                192      34.5       16.8   0.744       570.9
    smollm2 L0 v                192      20.8        7.1   0.816       710.4
    smollm2 L1 k                192      58.5       33.1   0.652        55.8
    smollm2 L1 v                192      57.5       27.7   0.600       114.7
    smollm2 L2 k                192      64.9       35.2   0.598        61.5
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.basis import CovarianceAccumulator  # noqa: E402
from shared.results import ResultsWriter, announce, apply_style, load, save_figure  # noqa: E402

LLM_CHUNKS = 6            # text chunks
LLM_TOKENS = 1024         # tokens per chunk
DIFF_SEEDS = range(8)     # generations per class
DIFF_CLASSES = range(10)  # digit classes
DIFF_STEPS = 20           # Euler steps of the rectified-flow sampler
TOP_SHARES = (0.01, 0.10, 0.25)  # fractions of D whose variance share is reported


def spectrum_stats(eigenvalues: np.ndarray) -> dict[str, float]:
    lam = np.clip(np.sort(eigenvalues)[::-1], 0, None)
    p = lam / lam.sum()
    nz = p[p > 0]
    stats = {
        "effective_rank": float(np.exp(-(nz * np.log(nz)).sum())),
        "participation_ratio": float(lam.sum() ** 2 / (lam ** 2).sum()),
        "max_over_median": float(lam[0] / max(np.median(lam), 1e-30)),
    }
    cum = np.cumsum(p)
    for f in TOP_SHARES:
        stats[f"var_top{int(f * 100)}pct"] = float(cum[max(int(round(f * len(lam))), 1) - 1])
    return stats


def llm_spectra(quick: bool) -> dict[str, tuple[np.ndarray, dict]]:
    from shared import llm

    model, tokenizer = llm.load_smollm2()
    n_chunks, tokens = (2, 256) if quick else (LLM_CHUNKS, LLM_TOKENS)
    chunks = llm.text_chunks(tokenizer, n_chunks, tokens)
    store = llm.capture_kv(model, chunks, f"smollm2_kv_{n_chunks}x{tokens}")
    n_layers = model.config.num_hidden_layers
    out = {}
    for layer in range(n_layers):
        for kind in ("k", "v"):
            acc = None
            for key in store.keys():
                x = store.load(key)[f"layer{layer}.{kind}"]
                acc = acc or CovarianceAccumulator(x.shape[1])
                acc.add(x)
            out[f"smollm2 L{layer} {kind}"] = (acc.spectrum(), {"model": "SmolLM2-135M-Instruct", "layer": layer,
                                                                "kind": kind, "tokens": acc.count})
    return out


def diffusion_spectra(quick: bool) -> dict[str, tuple[np.ndarray, dict]]:
    from shared import diffusion

    seeds, steps = (range(2), 4) if quick else (DIFF_SEEDS, DIFF_STEPS)
    store = diffusion.capture_tiny_flux(seeds=seeds, classes=DIFF_CLASSES, steps=steps)
    acc = None
    for key in store.keys():
        x = store.load(key)["act"]
        acc = acc or CovarianceAccumulator(x.shape[1])
        acc.add(x)
    block = store.meta()["block"]
    return {"tiny_flux image stream": (acc.spectrum(), {"model": "tiny_flux", "layer": block, "kind": "act",
                                                        "tokens": acc.count})}


def run(quick: bool) -> ResultsWriter:
    announce("02")
    spectra = {**diffusion_spectra(quick), **llm_spectra(quick)}
    res = ResultsWriter("02", "spectrum")
    print(f"{'source':<26}{'D':>5}{'eff_rank':>10}{'part_ratio':>11}{'top10%':>8}{'max/median':>12}")
    for name, (lam, info) in spectra.items():
        stats = spectrum_stats(lam)
        common = dict(source=name, channels=len(lam), **info)
        for metric, value in stats.items():
            res.add(backend="pca", metric=metric, value=value, unit="1", **common)
        for i, value in enumerate(lam):  # the whole spectrum, for the figure
            res.add(backend="pca", metric="eigenvalue", value=float(value), unit="1", index=i + 1, **common)
        print(f"{name:<26}{len(lam):>5}{stats['effective_rank']:>10.1f}{stats['participation_ratio']:>11.1f}"
              f"{stats['var_top10pct']:>8.3f}{stats['max_over_median']:>12.1f}")
    return res


def plot(csv: str = "02_spectrum", name: str = "02_spectrum"):
    from shared.results import series_style

    plt = apply_style()
    df = load(csv)
    eig = df[df.metric == "eigenvalue"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    layers = sorted(eig[eig.model.str.startswith("SmolLM2")].layer.dropna().unique())
    shown = [layers[0], layers[len(layers) // 2], layers[-1]] if layers else []
    every = dict(markevery=0.1, ms=4)  # markers spread along the log axis, one series each
    for ax, kind in zip(axes[:2], ("k", "v")):
        for i, layer in enumerate(shown):
            s = eig[(eig.kind == kind) & (eig.layer == layer)]
            ax.loglog(s["index"], s.value / s.value.sum(), "-", **series_style(i), **every,
                      label=f"layer {int(layer)}")
        ax.set_title(f"SmolLM2-135M {'key' if kind == 'k' else 'value'} cache, per layer")
        ax.legend(loc="lower left")
    s = eig[eig.model == "tiny_flux"]
    axes[2].loglog(s["index"], s.value / s.value.sum(), "-", **series_style(3), **every,
                   label="tiny FLUX, image stream")
    for i, kind in ((4, "k"), (5, "v")):
        mid = eig[(eig.kind == kind) & (eig.layer == shown[1])] if shown else eig.iloc[:0]
        if len(mid):
            axes[2].loglog(mid["index"], mid.value / mid.value.sum(), "--", **series_style(i), **every,
                           label=f"SmolLM2 L{int(shown[1])} {'key' if kind == 'k' else 'value'} cache")
    axes[2].set_title("diffusion vs LLM (middle layer)")
    axes[2].legend(loc="lower left")
    for ax in axes:
        ax.set_xlabel("component rank (largest first, log)")
    axes[0].set_ylabel("share of the variance (fraction, log)")
    top = df[df.metric == "var_top10pct"].set_index("source").value
    mid = int(shown[1]) if shown else None
    parts = [f"{100 * top[k]:.0f}% ({label})" for k, label in
             (("tiny_flux image stream", "diffusion activations"), (f"smollm2 L{mid} k", "LLM keys"),
              (f"smollm2 L{mid} v", "LLM values")) if k in top]
    fig.suptitle("PoC 02: share of the variance in the top 10% of components: " + ", ".join(parts)
                 + "; flat LLM spectra leave PCA less to take", x=0.02, ha="left")
    fig.tight_layout()
    save_figure(fig, name, f"{csv}.csv")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run (2 short chunks, 2 seeds, 4 steps)")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    args = ap.parse_args()
    if not args.plot_only:
        run(args.quick).save()
    plot()

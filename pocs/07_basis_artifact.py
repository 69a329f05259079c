"""PoC 07 - What does the PCA basis cost, and how many calibration captures does it need?

The basis is a per-model artifact the receiver must hold (like a LoRA). Three questions:
1. Its size: bytes per layer as a function of K (mean + D x K components, fp16 and fp32), and for
   all layers of the model (SmolLM2-135M: 30 layers x K and V; tiny FLUX: every double block).
2. The leave-one-out vs in-sample gap: a basis fitted on the tensor it codes looks better than it is.
3. Calibration: held-out quality (PCA projection alone, no quantizer or codec, so only the basis
   is measured) as a function of the number of calibration captures N.

Command:   make poc-07            (or: python pocs/07_basis_artifact.py [--quick])
Writes:    results/07_basis_artifact.csv, figures/07_basis_artifact.png
Sample output (quick run, --quick, on a 2-core CPU machine):
    SmolLM2 L15: basis of one layer at K=64: 24.4 KiB fp16; whole model (60 tensors): 1.43 MiB
    source        kind    K   N  in-sample  held-out
    SmolLM2 L15   k       8   1    0.91153   0.87841
    SmolLM2 L15   k       8   2    0.91153   0.88518
    SmolLM2 L15   k      32   1    0.96659   0.92786
    SmolLM2 L15   k      32   2    0.96659   0.93507
    SmolLM2 L15   v       8   1    0.71209   0.56980
    SmolLM2 L15   v       8   2    0.71209   0.60051
    SmolLM2 L15   v      32   1    0.88453   0.72974
    SmolLM2 L15   v      32   2    0.88453   0.75897
    tiny_flux: basis of one layer at K=64: 16.2 KiB fp16; whole model (3 tensors): 0.05 MiB
    source        kind    K   N  in-sample  held-out
    tiny_flux     act     8   1    0.94909   0.94810
    tiny_flux     act     8   2    0.94909   0.94833
    tiny_flux     act    32   1    0.99484   0.99448
    tiny_flux     act    32   2    0.99484   0.99456
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.basis import CovarianceAccumulator  # noqa: E402
from shared.metrics import aggregate, quality  # noqa: E402
from shared.results import ResultsWriter, announce, apply_style, load, save_figure  # noqa: E402

LAYER = 15               # LLM layer for the calibration study
CHUNKS = 6               # LLM text chunks of TOKENS tokens
TOKENS = 1024
SEEDS = range(8)         # diffusion seeds (10 classes x STEPS steps each)
STEPS = 20
KS = [8, 16, 32, 64, 96]  # ranks for the calibration study
BYTES_PER_VALUE = {"fp16": 2, "fp32": 4}


def basis_bytes(dim: int, k: int, bytes_per_value: int) -> int:
    return (dim + dim * k) * bytes_per_value  # mean + components


def llm_groups(quick: bool):
    from shared import llm

    model, tokenizer = llm.load_smollm2()
    n_chunks, tokens = (3, 256) if quick else (CHUNKS, TOKENS)
    store = llm.capture_kv(model, llm.text_chunks(tokenizer, n_chunks, tokens), f"smollm2_kv_{n_chunks}x{tokens}")
    layers = model.config.num_hidden_layers
    dim = store.load(store.keys()[0])[f"layer{LAYER}.k"].shape[1]
    groups = {kind: [[store.load(k)[f"layer{LAYER}.{kind}"]] for k in store.keys()] for kind in ("k", "v")}
    return groups, {"model": "SmolLM2-135M-Instruct", "dim": dim, "tensors_per_model": 2 * layers}


def diffusion_groups(quick: bool):
    from shared import diffusion

    seeds, steps = (range(3), 4) if quick else (SEEDS, STEPS)
    store = diffusion.capture_tiny_flux(seeds=seeds, classes=range(10), steps=steps)
    by_seed = [[store.load(k)["act"] for k in store.keys() if k.startswith(f"seed{s}_")] for s in seeds]
    model = diffusion.load_tiny_flux()
    n_double = len(model.transformer.transformer_blocks)
    return {"act": by_seed}, {"model": "tiny_flux", "dim": by_seed[0][0].shape[1], "tensors_per_model": n_double}


def calibration_study(groups: list[list[torch.Tensor]], ks: list[int], bar) -> dict[tuple[int, int], tuple[float, float]]:
    """{(K, N): (in-sample cos, held-out cos)}, each the mean over test groups: held out = a basis
    fitted on N other groups, in sample = a basis fitted on the test group itself.

    Each group's covariance is accumulated once; a basis from N groups sums their accumulators and
    is decomposed once for the largest K (a smaller K keeps its leading components). One step of
    `bar` = one held-out basis (one N, one test group)."""
    dim = groups[0][0].shape[1]
    accs = [CovarianceAccumulator(dim) for _ in groups]
    for acc, g in zip(accs, groups):
        for x in g:
            acc.add(x)
    kmax, data = max(ks), [[x.float().numpy() for x in g] for g in groups]
    ins = {k: [] for k in ks}
    for acc, g in zip(accs, data):
        own = acc.basis(kmax)
        for k in ks:
            b = own.truncate(k)
            ins[k] += [quality(x, b.reconstruct(b.project(x))) for x in g]
    out = {}
    for n in range(1, len(groups)):
        outs = {k: [] for k in ks}
        for test in range(len(groups)):
            calib = CovarianceAccumulator(dim)
            for i in [i for i in range(len(groups)) if i != test][:n]:
                calib += accs[i]
            calib = calib.basis(kmax)
            for k in ks:
                b = calib.truncate(k)
                outs[k] += [quality(x, b.reconstruct(b.project(x))) for x in data[test]]
            bar.update(1)
        for k in ks:
            out[(k, n)] = (aggregate(ins[k])["cos_mean"], aggregate(outs[k])["cos_mean"])
    return out


def run(quick: bool) -> ResultsWriter:
    announce("07")
    res = ResultsWriter("07", "basis_artifact")
    sources = [("SmolLM2 L%d" % LAYER, *llm_groups(quick)), ("tiny_flux", *diffusion_groups(quick))]
    steps = sum(len(g) * (len(g) - 1) for _, groups, _ in sources for g in groups.values())
    bar = tqdm(total=steps, desc="PoC 07 held-out bases (N x test group)", unit="basis")
    tables = []
    for name, groups, info in sources:
        dim = info["dim"]
        for k in sorted(set([8, 16, 32, 64, 96, 128, dim])):
            if k > dim:
                continue
            for fmt, bpv in BYTES_PER_VALUE.items():
                per_layer = basis_bytes(dim, k, bpv)
                common = dict(source=name, model=info["model"], k=k, dim=dim, storage=fmt)
                res.add(backend="pca", metric="basis_bytes_per_tensor", value=per_layer, unit="B", **common)
                res.add(backend="pca", metric="basis_bytes_per_model", value=per_layer * info["tensors_per_model"],
                        unit="B", tensors=info["tensors_per_model"], **common)
        tables.append(f"{name}: basis of one layer at K={min(64, dim)}: {basis_bytes(dim, min(64, dim), 2) / 1024:.1f} "
                      f"KiB fp16; whole model ({info['tensors_per_model']} tensors): "
                      f"{basis_bytes(dim, min(64, dim), 2) * info['tensors_per_model'] / 2**20:.2f} MiB")
        tables.append(f"{'source':<14}{'kind':<5}{'K':>4}{'N':>4}{'in-sample':>11}{'held-out':>10}")
        ks = [k for k in ([8, 32] if quick else KS) if k < dim]
        for kind, g in groups.items():
            for (k, n), (cin, cout) in sorted(calibration_study(g, ks, bar).items()):
                common = dict(source=name, kind=kind, model=info["model"], k=k, n_calibration=n, dim=dim)
                res.add(backend="pca", metric="cos_in_sample", value=cin, unit="1", **common)
                res.add(backend="pca", metric="cos_held_out", value=cout, unit="1", **common)
                res.add(backend="pca", metric="loo_gap", value=cin - cout, unit="1", **common)
                tables.append(f"{name:<14}{kind:<5}{k:>4}{n:>4}{cin:>11.5f}{cout:>10.5f}")
    bar.close()
    print("\n".join(tables))  # after the bar has closed
    return res


def plot(csv: str = "07_basis_artifact", name: str = "07_basis_artifact"):
    from matplotlib.lines import Line2D

    from shared.results import legend_outside, series_style

    plt = apply_style()
    df = load(csv)
    cal = df[df.metric.isin(["cos_in_sample", "cos_held_out"])]
    panels = [(src, kind) for src in cal.source.unique() for kind in ("k", "v", "act")
              if len(cal[(cal.source == src) & (cal.kind == kind)])]
    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(4.2 * (1 + len(panels)), 4.3))
    size = df[(df.metric == "basis_bytes_per_model") & (df.storage == "fp16")]
    for i, (src, s) in enumerate(size.groupby("source")):
        axes[0].plot(s.k, s.value / 2**20, "-", **series_style(i),
                     label=f"{src} ({int(s.tensors.iloc[0])} tensors, D={int(s.dim.iloc[0])})")
    axes[0].set_xlabel("K, components kept (count)")
    axes[0].set_ylabel("basis size for the whole model, fp16 (MiB)")
    axes[0].set_title("the artifact a receiver must hold")
    axes[0].legend(loc="upper left")
    names = {"k": "key cache", "v": "value cache", "act": "activations"}
    ranks = sorted(cal.k.unique())
    for ax, (src, kind) in zip(axes[1:], panels):
        sub = cal[(cal.source == src) & (cal.kind == kind)]
        for k, s in sub.groupby("k"):
            st = series_style(ranks.index(k))
            out, inn = s[s.metric == "cos_held_out"], s[s.metric == "cos_in_sample"]
            ax.plot(out.n_calibration, 1 - out.value, "-", **st)
            ax.plot(inn.n_calibration, 1 - inn.value, "--", color=st["color"], lw=1, alpha=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("calibration captures N (count)")
        ax.set_title(f"{src} {names[kind]}\n(N = {'seeds' if kind == 'act' else 'text chunks'})")
    axes[1].set_ylabel("1 - cos_mean of the PCA projection (log)")
    handles = [Line2D([], [], ls="-", **series_style(i)) for i in range(len(ranks))]
    labels = [f"rank K={int(k)}" for k in ranks]
    handles += [Line2D([], [], color="0.3", ls="-"), Line2D([], [], color="0.3", ls="--")]
    labels += ["held out (basis from N other captures)", "in sample (basis from the tensor itself)"]
    legend_outside(axes[-1], handles, labels)
    held = cal[cal.metric == "cos_held_out"]
    first = held[held.n_calibration == 1].set_index(["source", "kind", "k"]).value
    last = held.loc[held.groupby(["source", "kind", "k"]).n_calibration.idxmax()].set_index(["source", "kind", "k"])
    gain = ((1 - first) / (1 - last.value) - 1).max()
    big = size[size.k == min(64, size.k.max())].value.max() / 2**20
    fig.suptitle(f"PoC 07: a basis is small ({big:.1f} MiB for a whole model at K=64, fp16) and one calibration "
                 f"capture is within {100 * gain:.0f}% of the most captures' held-out error", x=0.02, ha="left")
    fig.tight_layout()
    save_figure(fig, name, f"{csv}.csv")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    args = ap.parse_args()
    if not args.plot_only:
        run(args.quick).save()
    plot()

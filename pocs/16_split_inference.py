"""PoC 16 - Does compressing the hidden state make split inference faster over a real, shaped link?

A model is cut in two and each half runs in its own process; the processes are joined by
torch.distributed (gloo, TCP) across two network namespaces whose veth pair is shaped by `tc` to
1 Gbit, 100 Mbit and 50 Mbit. What crosses the link is the hidden state at the cut, raw (bf16) or
through the compute codec (a PCA basis of that layer's hidden states fitted on calibration text, one
shared quantization step chosen so every calibration chunk reaches cos >= 0.999, rANS on the CPU).

- LLM: SmolLM2-135M, stage 0 (namespace a) = embeddings + layers [0, 15), stage 1 (namespace b) =
  layers [15, 30) + norm + head. A prefill step of 1024 and 2048 tokens, then 32 greedy decode steps;
  stage 1 sends each next token back to stage 0. Per-step latency (and its parts: compute, encode,
  wire, decode), tokens/s, bytes per step; perplexity and next-token agreement of the split model
  against the unsplit one on held-out text. A decode step carries one token (576 values, 1152 bytes
  raw); where the codec's container is larger than the raw tensor (measured at setup), the
  compressed mode sends that tensor raw and the rows say so (`sent_as`).
- Diffusion: the embedded FLUX-architecture transformer cut after its middle double block; per
  sampler step the image stream (compressed or raw) and the text stream and time embedding (raw)
  cross; stage 1 returns the velocity. Step latency and final-image PSNR against the unsplit model.

- GPU compute (--gpu): both stage processes on one CUDA GPU, the codec's GPU path (encode on the GPU,
  only the container crosses to host memory for gloo; decode and reconstruct on the GPU), plus a
  4096-wide Llama-architecture decoder with random bf16 weights (32 layers, cut after 16; prefills of
  512 and 2048 random tokens), where the wire, not the compute, is most of a step. Its basis and step
  come from its own calibration prompts (other random tokens than the timed ones); its quality is the
  cosine and the agreement of the split model with the unsplit one (perplexity means nothing for it).

Correctness first: before anything is timed, the received tensor is checked against the sent one
(bit-exact raw; the cosine of the compressed one on the evaluation data is measured and printed).

Command:   make poc-16            (or: python pocs/16_split_inference.py [--quick] [--plot-only] [--loopback] [--gpu])
           Needs root and iproute2 (ip netns, tc) for the shaped link; without them --quick runs over
           unshaped loopback and says so (rows: link=loopback); a full run refuses unless --loopback.
           A machine without iproute2: `source dev/iproute2_from_debs.sh DEBS` first (Debian packages).
Writes:    results/16_split_inference.csv, figures/16_split_inference.png (CPU rows) and
           figures/16_split_inference_gpu.png (GPU rows) (--out DIR: all there)
Sample output (`--table`, from the committed run on a 2-core CPU machine at a load average of 17-20,
numba CPU coder; the compute of both stages dominates every LLM step there):
    | task, step | link | raw ms/step | compressed ms/step | bytes ratio | step speed-up | speed-up / ratio | hop ms raw -> compressed (encode + wire + decode) | compressed sent as |
    | LLM prefill 2048 tokens | 50 Mbit | 26897.4 | 28979.9 | 4.35x | 0.93x | 0.21 | 385.1 -> 275.1 (112.5 + 84.7 + 77.9) | coded |
    | LLM decode (after 2048) | 50 Mbit | 206.6 | 236.2 | 1.00x | 0.87x | 0.87 | 4.4 -> 7.6 (0.0 + 7.0 + 0.0) | raw |
    | diffusion sampler step | 50 Mbit | 419.9 | 453.6 | 4.43x | 0.93x | 0.21 | 112.0 -> 64.8 (37.6 + 20.2 + 4.9) | coded |
    | LLM | 2048 | 0.9990 | 11.698 / 11.696 / 11.721 | 0.999 / 0.976 | 1.000 / 0.938 |
"""
from __future__ import annotations

import argparse
import json
import math
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.results import ResultsWriter, announce, apply_style, save_figure  # noqa: E402

# ---------------------------------------------------------------- knobs
SPLIT_LAYER = 15                 # LLM: stage 0 = embeddings + layers [0, 15); stage 1 = layers [15, 30) + norm + head
PREFILL_TOKENS = [1024, 2048]    # tokens of one prefill step
DECODE_TOKENS = 32               # greedy decode steps after each prefill
CAL_CHUNKS, CAL_TOKENS = 4, 512  # calibration text (the start of the text): basis and quantization step
EVAL_CHUNKS = 2                  # held-out chunks (after the calibration text) for perplexity and agreement
TARGET_COS = 0.999               # mean per-token cosine every calibration tensor must reach
LINKS_MBIT = [1000, 100, 50]     # tc rate of the veth link, Mbit/s
DELAY_MS = 0.0                   # added one-way delay on the link, ms
REPEATS = 2                      # timed sessions per (link, mode, size): prefill + decode, or one generation
DIFF_SPLIT_BLOCK = 1             # diffusion: stage 0 = embedders + double blocks [0, 1]; stage 1 = the rest
DIFF_BATCH = 40                  # images per sampler step (labels 0..9 repeated)
DIFF_STEPS = 20                  # Euler steps per generation
DIFF_CAL_SEEDS = [100, 101, 102, 103]  # calibration generations for the diffusion basis and step
DIFF_EVAL_SEED = 0               # the evaluated generation (its noise)
WORKER_THREADS = 2               # torch threads per stage process (the stages take turns)
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE",  # a waiting stage must not spin on the cores the other computes on
              "OPENBLAS_NUM_THREADS": "1",   # numpy's BLAS (the codec's projection) single-threaded: no spinning pool
              "NUMBA_NUM_THREADS": "2"}      # the compiled rANS coder's threads
PORT = 29516                     # TCP port of the gloo rendezvous on stage 0's address
TIMEOUT_S = 1800                 # any gloo operation or worker command gives up after this, s
QUICK = dict(PREFILL_TOKENS=[128], DECODE_TOKENS=8, CAL_CHUNKS=2, CAL_TOKENS=128, EVAL_CHUNKS=1, REPEATS=1,
             DIFF_BATCH=10, DIFF_STEPS=4, DIFF_CAL_SEEDS=[100, 101], TIMEOUT_S=300)

# -- GPU compute (--gpu): both stages on one CUDA GPU (each in its own process), the codec on that GPU
WIDE_SHAPE = dict(layers=32, hidden=4096, heads=32, kv_heads=8, mlp=14336, vocab=32000)  # random bf16 weights in
                                 # an 8B-class shape: the 4096-wide hidden state such models are split at
WIDE_SPLIT = 16                  # wide decoder: stage 0 = embeddings + layers [0, 16)
WIDE_PREFILL = [512, 2048]       # wide decoder: tokens of one prefill step (random token ids)
WIDE_CAL_CHUNKS = 4              # wide decoder: calibration prompts of random tokens (WIDE_PREFILL[-1] each)
WIDE_SEED = 0                    # its weights (both processes build the same ones) and its token ids
STEP_SEARCH_ROWS = 1024          # wide decoder: rows of each calibration tensor its step search sees (CPU time)
GPU_QUICK = dict(WIDE_SHAPE=dict(WIDE_SHAPE, layers=4), WIDE_SPLIT=2, WIDE_PREFILL=[256], WIDE_CAL_CHUNKS=2)

NAME = "16_split_inference"
PROTOCOL = "@@ "                 # prefix of the worker's result lines on stdout


def settings(quick: bool, gpu: bool = False) -> dict:
    cfg = {k: v for k, v in globals().items()
           if k.isupper() and k not in ("QUICK", "GPU_QUICK", "NAME", "PROTOCOL", "WORKER_ENV")}
    cfg.update(QUICK if quick else {})
    cfg.update(GPU_QUICK if quick and gpu else {})
    cfg["DEVICE"] = "cuda" if gpu else "cpu"
    return cfg


def now() -> float:
    """CLOCK_MONOTONIC seconds: one clock for every process on the machine (namespaces share it)."""
    return time.perf_counter()


def tick(device) -> float:
    """now(), after the GPU's queued work is done when running there (so a time covers that work)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return now()


# ---------------------------------------------------------------- the codec call and the wire
RAW, CODED = 0, 1
WIRE_DTYPES = [torch.bfloat16, torch.float32, torch.int64]


def encode_tensor(codec, x: torch.Tensor) -> torch.Tensor:
    """The one codec call of the sender: the container as a uint8 CPU tensor, ready for gloo. A CUDA
    tensor is coded on its GPU (TensorCodec's GPU path) and only the container comes to the host."""
    blob = codec.encode(x)
    return blob.cpu() if isinstance(blob, torch.Tensor) else torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def decode_tensor(codec, blob: torch.Tensor, device="cpu") -> torch.Tensor:
    """The one codec call of the receiver: on a GPU the container is decoded and reconstructed there."""
    return codec.decode(blob, device=None if torch.device(device).type == "cpu" else device)


def send_tensor(x: torch.Tensor, dst: int, codec=None) -> dict:
    """Send a [rows, cols] tensor raw (its bytes) or coded (codec container): a 5-int64 head, then
    the payload as uint8. Returns encode_ms, bytes on the wire and the clock at the first send.
    gloo sends from host memory, so a CUDA tensor's bytes (raw) or container (coded) are copied to the
    host first, inside encode_ms."""
    import torch.distributed as dist

    t0 = tick(x.device)
    if codec is None:
        kind, payload = RAW, x.contiguous().view(-1).view(torch.uint8).cpu()
    else:
        kind, payload = CODED, encode_tensor(codec, x)
    t1 = now()
    head = torch.tensor([kind, payload.numel(), x.shape[0], x.shape[1], WIRE_DTYPES.index(x.dtype)])
    dist.send(head, dst)
    dist.send(payload, dst)
    return {"encode_ms": (t1 - t0) * 1e3, "bytes": int(payload.numel() + 8 * head.numel()), "t_send": t1,
            "sent_as": "coded" if kind == CODED else "raw"}


def recv_tensor(src: int) -> tuple[list[int], torch.Tensor]:
    import torch.distributed as dist

    head = torch.empty(5, dtype=torch.int64)
    dist.recv(head, src)
    payload = torch.empty(int(head[1]), dtype=torch.uint8)
    dist.recv(payload, src)
    return head.tolist(), payload


def open_tensor(head: list[int], payload: torch.Tensor, codec=None, device="cpu") -> tuple[torch.Tensor, float]:
    """(tensor on `device`, decode_ms) of a received message; on a GPU decode_ms includes the copy there."""
    kind, _, rows, cols, dtype = head
    t0 = now()
    if kind == RAW:
        x = payload.view(WIRE_DTYPES[dtype]).view(rows, cols).to(device)
    else:
        if codec is None:
            raise RuntimeError("received a coded tensor but this side holds no codec")
        x = decode_tensor(codec, payload, device)
        if tuple(x.shape) != (rows, cols):
            raise RuntimeError(f"decoded shape {tuple(x.shape)} differs from the sent shape {(rows, cols)}")
    return x, (tick(device) - t0) * 1e3


def coder_for(mode: str, rows: int, codec, min_rows: int):
    """The codec when this tensor is worth coding (compressed mode, enough tokens), else None (raw)."""
    return codec if mode == "compressed" and rows >= min_rows else None


# ---------------------------------------------------------------- the LLM halves
def llm_layers(model, h: torch.Tensor, layers: range, start: int, cache) -> torch.Tensor:
    """Run decoder layers `layers` on h [1, T, D] at positions start..start+T-1 (SDPA: causal when T > 1)."""
    positions = torch.arange(start, start + h.shape[1], device=h.device)[None]
    rotary = model.model.rotary_emb(h, position_ids=positions)
    for i in layers:
        h = model.model.layers[i](h, attention_mask=None, position_embeddings=rotary, position_ids=positions,
                                  cache=cache, use_cache=True)
    return h


def llm_stage0(model, ids: torch.Tensor, start: int, cache, split: int) -> torch.Tensor:
    """Token ids [1, T] -> hidden state [T, D] entering layer `split`."""
    return llm_layers(model, model.model.embed_tokens(ids), range(split), start, cache)[0]


def llm_stage1(model, x: torch.Tensor, start: int, cache, split: int, all_positions: bool) -> torch.Tensor:
    """Hidden state [T, D] -> logits [T or 1, vocab] (float32)."""
    h = llm_layers(model, x.to(model.dtype)[None], range(split, model.config.num_hidden_layers), start, cache)[0]
    return model.lm_head(model.model.norm(h if all_positions else h[-1:])).float()


def score_logits(logits: torch.Tensor, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(argmax per position [T], NLL of the next token per position [T-1]) in blocks of 512 positions."""
    top, nll = [], []
    for s in range(0, logits.shape[0], 512):
        block = logits[s: s + 512].float()
        top.append(block.argmax(-1))
        logp = torch.log_softmax(block, -1)
        targets = ids[s + 1: s + 1 + block.shape[0]]
        nll.append(-logp[: len(targets)].gather(1, targets[:, None])[:, 0])
    return torch.cat(top).cpu().numpy(), torch.cat(nll).double().cpu().numpy()


def llm_reference(model, ids: torch.Tensor, new_tokens: int) -> dict:
    """The unsplit model (transformers' own forward): argmax and NLL per position, greedy continuation."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=ids[None], cache=cache, use_cache=True)
    top, nll = score_logits(out.logits[0], ids)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(new_tokens - 1):
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=ids.device), cache=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return {"top": top, "nll": nll, "tokens": tokens}


def llm_session(rank: int, ctx: dict, task: str, ids: torch.Tensor, mode: str, new_tokens: int, score: bool) -> dict:
    """One prefill of ids [T] and `new_tokens` greedy decode steps of the LM `task` across the link.

    Rank 0 returns per-step timings of its side; rank 1 those of its side, the tokens it produced
    and, with score, the prefill's argmax/NLL per position (all positions through the head)."""
    from transformers import DynamicCache

    lm, device = ctx["lms"][task], ctx["cfg"]["DEVICE"]
    model, split, codec, min_rows = lm["model"], lm["split"], lm["codec"], lm["min_rows"]
    ids = ids.to(device)
    cache, steps, start = DynamicCache(), [], 0
    if rank == 0:
        step_ids = ids[None]
        for _ in range(1 + new_tokens):
            t0 = tick(device)
            h = llm_stage0(model, step_ids, start, cache, split).to(torch.bfloat16)
            t1 = tick(device)
            sent = send_tensor(h, 1, coder_for(mode, h.shape[0], codec, min_rows))
            head, payload = recv_tensor(1)
            token, _ = open_tensor(head, payload, device=device)
            t2 = tick(device)
            steps.append(dict(sent, step_ms=(t2 - t0) * 1e3, stage0_ms=(t1 - t0) * 1e3, rows=h.shape[0]))
            start += step_ids.shape[1]
            step_ids = token.view(1, 1)
        return {"steps": steps}
    tokens, scored = [], None
    for i in range(1 + new_tokens):
        head, payload = recv_tensor(0)
        t_recv = now()
        x, decode_ms = open_tensor(head, payload, codec, device)
        t1 = now()
        logits = llm_stage1(model, x, start, cache, split, all_positions=score and i == 0)
        token = int(logits[-1].argmax())
        t2 = now()
        send_tensor(torch.tensor([[token]]), 0)
        steps.append({"t_recv": t_recv, "decode_ms": decode_ms, "stage1_ms": (t2 - t1) * 1e3})
        if score and i == 0:
            scored = score_logits(logits, ids)
        tokens.append(token)
        start += x.shape[0]
    return {"steps": steps, "tokens": tokens, "scored": scored}


# ---------------------------------------------------------------- the diffusion halves
def flux_rotary(flux):
    return flux.transformer.pos_embed(torch.cat((flux.txt_ids, flux.img_ids), 0))


def flux_stage0(flux, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor, split: int):
    """Packed latents [B, T, C] -> (image stream [B, T, D], text stream [B, S, D], temb [B, D])
    after double block `split`, the way FluxTransformer2DModel.forward computes them."""
    tr = flux.transformer
    text = flux.label_tokens(labels).reshape(len(labels), flux.text_tokens, tr.config.joint_attention_dim)
    hidden = tr.x_embedder(x)
    temb = tr.time_text_embed(sigma.to(hidden.dtype) * 1000, flux.label_pooled(labels))
    encoder = tr.context_embedder(text)
    rotary = flux_rotary(flux)
    for block in tr.transformer_blocks[: split + 1]:
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb, image_rotary_emb=rotary)
    return hidden, encoder, temb


def flux_stage1(flux, hidden: torch.Tensor, encoder: torch.Tensor, temb: torch.Tensor, split: int) -> torch.Tensor:
    """The rest of the transformer: the velocity [B, T, C]."""
    tr = flux.transformer
    rotary = flux_rotary(flux)
    for block in list(tr.transformer_blocks[split + 1:]) + list(tr.single_transformer_blocks):
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb, image_rotary_emb=rotary)
    return tr.proj_out(tr.norm_out(hidden, temb))


def diffusion_labels(cfg: dict) -> torch.Tensor:
    return torch.arange(cfg["DIFF_BATCH"]) % 10


def psnr_db(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def diffusion_session(rank: int, ctx: dict, mode: str) -> dict:
    """One generation (DIFF_STEPS Euler steps, the noise of DIFF_EVAL_SEED) across the link. Per step
    the image stream (mode) and the text stream + time embedding (raw bf16) cross; the velocity
    comes back raw (float32). Rank 0 returns its timings and the images' PSNR vs the unsplit model."""
    cfg, flux, device = ctx["cfg"], ctx["flux"], ctx["cfg"]["DEVICE"]
    split, codec, labels = cfg["DIFF_SPLIT_BLOCK"], ctx["diff_codec"], diffusion_labels(cfg).to(device)
    B, T, D = len(labels), flux.tokens, flux.transformer.inner_dim
    sigmas = torch.linspace(1.0, 0.0, cfg["DIFF_STEPS"] + 1, device=device)
    steps = []
    if rank == 0:
        x = torch.randn(B, T, flux.token_values, generator=torch.Generator().manual_seed(cfg["DIFF_EVAL_SEED"]))
        x = x.to(device)
        for i in range(cfg["DIFF_STEPS"]):
            t0 = tick(device)
            hidden, encoder, temb = flux_stage0(flux, x, sigmas[i].expand(B), labels, split)
            image = hidden.reshape(B * T, D).to(torch.bfloat16)
            side = torch.cat([encoder.reshape(-1, D), temb]).to(torch.bfloat16)
            t1 = tick(device)
            sent = send_tensor(image, 1, coder_for(mode, image.shape[0], codec, ctx["diff_min_rows"]))
            side_sent = send_tensor(side, 1)
            head, payload = recv_tensor(1)
            velocity, _ = open_tensor(head, payload, device=device)
            x = x + (sigmas[i + 1] - sigmas[i]) * velocity.view(B, T, -1)
            t2 = tick(device)
            steps.append(dict(sent, bytes=sent["bytes"] + side_sent["bytes"], image_bytes=sent["bytes"],
                              step_ms=(t2 - t0) * 1e3, stage0_ms=(t1 - t0) * 1e3, rows=image.shape[0]))
        images = ((flux.unpack(x) + 1) / 2).clamp(0, 1).cpu()
        return {"steps": steps, "psnr_db": psnr_db(images, ctx["diff_reference"])}
    S = flux.text_tokens
    for i in range(cfg["DIFF_STEPS"]):
        head, payload = recv_tensor(0)
        side_head, side_payload = recv_tensor(0)
        t_recv = now()
        image, decode_ms = open_tensor(head, payload, codec, device)
        side, _ = open_tensor(side_head, side_payload, device=device)
        t1 = now()
        side = side.float()
        velocity = flux_stage1(flux, image.float().view(B, T, D), side[: B * S].view(B, S, D), side[B * S:], split)
        t2 = tick(device)
        send_tensor(velocity.reshape(B * T, -1).float().contiguous(), 0)
        steps.append({"t_recv": t_recv, "decode_ms": decode_ms, "stage1_ms": (t2 - t1) * 1e3})
    return {"steps": steps}


# ---------------------------------------------------------------- worker: setup, check, measure
def emit(obj: dict) -> None:
    print(PROTOCOL + json.dumps(obj), flush=True)


def calibrated_step(tensors: list[torch.Tensor], basis, target: float,
                    search_rows: int | None = None) -> tuple[float, list[float]]:
    """The largest shared step with which every calibration tensor reaches cos >= target, and each one's cos.
    search_rows: the step search sees every n-th row of each tensor, at most this many (the cos reported
    is still over all rows)."""
    from shared.rdquant import RDQuantizer, find_step, quality

    arrays = [t.float().cpu().numpy() for t in tensors]
    every = [max(1, -(-len(a) // search_rows)) if search_rows else 1 for a in arrays]
    step = min(find_step(basis.project(a[::n]), target, "cos", reconstruct=basis.reconstruct, reference=a[::n]).step
               for a, n in zip(arrays, every))
    q = RDQuantizer(step)
    cos = [quality(a, basis.reconstruct(q.dequantize(q.quantize(basis.project(a)))), "cos") for a in arrays]
    return step, cos


def min_coded_rows(codec, x: torch.Tensor) -> tuple[int, list[dict]]:
    """The fewest rows (tokens) of x, in powers of two, for which the container is smaller than raw,
    and the measured sizes (container, its header, raw) at each size tried."""
    from shared.container import unpack

    sizes, found = [], None
    rows = 1
    while rows <= x.shape[0]:
        part = x[1: 1 + rows] if x.shape[0] > rows else x[:rows]  # skip the first (attention-sink) token
        blob = encode_tensor(codec, part).numpy().tobytes()
        _, chunks = unpack(blob)
        sizes.append({"rows": rows, "container_bytes": len(blob), "payload_bytes": len(chunks["DATA"]),
                      "raw_bytes": part.numel() * part.element_size()})
        if found is None and len(blob) < part.numel() * part.element_size():
            found = rows
        rows *= 2
    return (found if found is not None else x.shape[0] + 1), sizes


def text_split(tokenizer, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration chunks [CAL_CHUNKS, CAL_TOKENS] from the start of the text, held-out chunks
    [EVAL_CHUNKS, max prefill] after it)."""
    from shared.llm import text_chunks

    cal_len = cfg["CAL_CHUNKS"] * cfg["CAL_TOKENS"]
    length = max(cal_len, max(cfg["PREFILL_TOKENS"]))
    chunks = text_chunks(tokenizer, 1 + cfg["EVAL_CHUNKS"], length)
    cal = chunks[0, :cal_len].view(cfg["CAL_CHUNKS"], cfg["CAL_TOKENS"])
    return cal, chunks[1:, : max(cfg["PREFILL_TOKENS"])]


def random_tokens(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The wide decoder's (calibration prompts, held-out prompts) of random token ids: it has random
    weights, so no text means more to it than any other; held-out prompts are other draws."""
    g = torch.Generator().manual_seed(cfg["WIDE_SEED"] + 1)
    ids = torch.randint(0, cfg["WIDE_SHAPE"]["vocab"], (cfg["WIDE_CAL_CHUNKS"] + cfg["EVAL_CHUNKS"],
                                                        max(cfg["WIDE_PREFILL"])), generator=g)
    return ids[: cfg["WIDE_CAL_CHUNKS"]], ids[cfg["WIDE_CAL_CHUNKS"]:]


def wide_decoder(cfg: dict):
    """A Llama-architecture transformers model of WIDE_SHAPE with random bf16 weights, built on the GPU
    from WIDE_SEED (both stage processes build the same weights). Timing only: its outputs mean nothing,
    but the split and the unsplit model must still agree on them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = cfg["WIDE_SHAPE"]
    config = LlamaConfig(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         intermediate_size=shape["mlp"], vocab_size=shape["vocab"], rope_theta=5e5,
                         max_position_embeddings=8192, attn_implementation="sdpa")
    torch.manual_seed(cfg["WIDE_SEED"])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(cfg["DEVICE"]):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def language_models(ctx: dict) -> dict:
    """The LMs this run splits, each with its cut, its calibration and held-out token ids and prefill sizes:
    SmolLM2 (task "llm", real text) everywhere; the wide random decoder (task "wide") on a GPU."""
    cfg, lms = ctx["cfg"], {}
    if ctx["model"] is not None:
        cal, evals = text_split(ctx["tokenizer"], cfg)
        lms["llm"] = dict(model=ctx["model"], split=cfg["SPLIT_LAYER"], cal=cal, evals=evals,
                          prefill=cfg["PREFILL_TOKENS"], label="smollm2", search_rows=None)
    if cfg["DEVICE"] != "cpu":
        cal, evals = random_tokens(cfg)
        lms["wide"] = dict(model=wide_decoder(cfg), split=cfg["WIDE_SPLIT"], cal=cal, evals=evals,
                           prefill=cfg["WIDE_PREFILL"], label="random_llama_4096", search_rows=cfg["STEP_SEARCH_ROWS"])
    return lms


def calibrate(tensors: list[torch.Tensor], meta: dict, target: float, search_rows: int | None, device
              ) -> tuple[tuple, dict]:
    """One hand-over's codec from its calibration tensors: the basis (fitted where the tensors are: the
    GPU fits a 4096-wide one in a blink), the shared step and the fewest rows worth coding; as
    ((basis, step, min_rows), the report's step / cal_cos / min_rows / sizes)."""
    from shared.basis import fit_basis, fit_basis_torch
    from shared.pipeline import TensorCodec

    basis = (fit_basis(tensors, **meta) if tensors[0].device.type == "cpu"
             else fit_basis_torch(torch.cat(tensors), **meta))
    step, cal_cos = calibrated_step(tensors, basis, target, search_rows)
    min_rows, sizes = min_coded_rows(TensorCodec(basis, backend="rans", step=step), tensors[0].to(device))
    return (basis, step, min_rows), {"step": step, "cal_cos": cal_cos, "min_rows": min_rows, "sizes": sizes}


def setup_stage0(ctx: dict) -> dict:
    """Rank 0: calibration hidden states -> basis and step (each LM and diffusion); the unsplit images."""
    from tqdm import tqdm

    from shared.diffusion import generate, record_block_output

    cfg, flux, device = ctx["cfg"], ctx["flux_cpu"], ctx["cfg"]["DEVICE"]
    shared, report = {}, {}
    for task, lm in ctx["lms"].items():
        model, split = lm["model"], lm["split"]
        with torch.no_grad():
            hidden = [llm_stage0(model, c[None].to(device), 0, None, split).to(torch.bfloat16)
                      for c in tqdm(lm["cal"], desc=f"calibration: {task} hidden states", unit="chunk")]
        meta = dict(k=model.config.hidden_size, model=lm["label"], layer=f"hidden{split}")
        shared[task], got = calibrate(hidden, meta, cfg["TARGET_COS"], lm["search_rows"], device)
        report.update({f"{task}_{k}": v for k, v in got.items()})

    labels = diffusion_labels(cfg)
    captures = []
    for seed in tqdm(cfg["DIFF_CAL_SEEDS"], desc="calibration: diffusion activations", unit="seed"):
        with record_block_output(flux.transformer, cfg["DIFF_SPLIT_BLOCK"]) as outputs:
            generate(flux, labels, seed, cfg["DIFF_STEPS"], block=cfg["DIFF_SPLIT_BLOCK"])
        captures += [o.reshape(-1, o.shape[-1]).to(torch.bfloat16) for o in outputs]
    meta = dict(k=flux.transformer.inner_dim, model="tiny_flux", layer=f"double{cfg['DIFF_SPLIT_BLOCK']}.image")
    shared["diff"], got = calibrate(captures, meta, cfg["TARGET_COS"], None, device)
    report.update({f"diff_{k}": v for k, v in got.items()})
    ctx["diff_reference"] = generate(flux, labels, cfg["DIFF_EVAL_SEED"], cfg["DIFF_STEPS"])

    # the split halves composed in one process equal the unsplit model (checked before any transfer)
    x0 = torch.randn(len(labels), flux.tokens, flux.token_values, generator=torch.Generator().manual_seed(1))
    sigma = torch.full((len(labels),), 0.5)
    with torch.no_grad():
        split_velocity = flux_stage1(flux, *flux_stage0(flux, x0, sigma, labels, cfg["DIFF_SPLIT_BLOCK"]),
                                     cfg["DIFF_SPLIT_BLOCK"])
        diff_split_err = float((split_velocity - flux(x0, sigma, labels)).abs().max())
    report["diff_split_max_abs_err"] = diff_split_err
    return {"shared": shared, "report": report}


def setup_stage1(ctx: dict) -> dict:
    """Rank 1: each LM's unsplit outputs on its held-out prompts (every prefill size, every chunk)."""
    cfg, device, report = ctx["cfg"], ctx["cfg"]["DEVICE"], {}
    for task, lm in ctx["lms"].items():
        model, split, evals = lm["model"], lm["split"], lm["evals"].to(device)
        lm["refs"] = {}
        with torch.no_grad():
            for c in range(len(evals)):  # no bar: stage 0's calibration bar runs at the same time
                for T in lm["prefill"]:
                    lm["refs"][(c, T)] = llm_reference(model, evals[c, :T], cfg["DECODE_TOKENS"])
            # the split halves composed in one process equal the unsplit forward (no transfer involved)
            ids = evals[0, :min(lm["prefill"])]
            logits = llm_stage1(model, llm_stage0(model, ids[None], 0, None, split), 0, None, split, all_positions=True)
            report[f"{task}_split_max_abs_err"] = float((logits - model(input_ids=ids[None]).logits[0].float()).abs().max())
    return {"report": report}


def check_hop(rank: int, reference: torch.Tensor | None, codec, name: str, device="cpu") -> dict:
    """Send a float32 tensor raw as the reference, then its bf16 raw and its bf16 coded forms; the
    receiver checks the raw one bit for bit and measures the coded one's cosine."""
    from shared.rdquant import quality

    if rank == 0:
        x = reference.float().contiguous()
        for msg, c in ((x, None), (x.to(torch.bfloat16), None), (x.to(torch.bfloat16), codec)):
            send_tensor(msg, 1, c)
        return {}
    got = []
    for _ in range(3):
        head, payload = recv_tensor(0)
        got.append(open_tensor(head, payload, codec, device)[0].cpu().clone())
    ref, raw, coded = got
    bit_exact = raw.dtype == torch.bfloat16 and torch.equal(raw.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
    if not bit_exact:
        raise RuntimeError(f"{name}: the raw tensor received differs from the one sent: the transport is broken")
    r = ref.double().numpy()
    return {"name": name, "rows": ref.shape[0], "bit_exact": bool(bit_exact),
            "cos_raw_vs_f32": quality(r, raw.double().numpy(), "cos"),
            "cos_coded_vs_f32": quality(r, coded.double().numpy(), "cos"),
            "cos_coded_vs_bf16": quality(raw.double().numpy(), coded.double().numpy(), "cos")}


def run_check(rank: int, ctx: dict) -> dict:
    """Correctness of the transfer (bit-exact raw, cos coded), then the split models' quality runs."""
    from tqdm import tqdm

    cfg, device = ctx["cfg"], ctx["cfg"]["DEVICE"]
    hops = []
    with torch.no_grad():
        for task, lm in ctx["lms"].items():
            for T in lm["prefill"]:
                ids = lm["evals"][0, :T][None].to(device)
                h = llm_stage0(lm["model"], ids, 0, None, lm["split"]) if rank == 0 else None
                hops.append(dict(check_hop(rank, h, lm["codec"], f"{task} prefill {T}", device), task=task))
        flux, labels = ctx["flux"], diffusion_labels(cfg).to(device)
        image = None
        if rank == 0:
            x = torch.randn(len(labels), flux.tokens, flux.token_values,
                            generator=torch.Generator().manual_seed(cfg["DIFF_EVAL_SEED"])).to(device)
            hidden, _, _ = flux_stage0(flux, x, torch.ones(len(labels), device=device), labels, cfg["DIFF_SPLIT_BLOCK"])
            image = hidden.reshape(-1, hidden.shape[-1])
        hops.append(dict(check_hop(rank, image, ctx["diff_codec"], "diffusion step 0", device), task="diffusion"))
        if rank == 1:
            for hop in hops:
                print(f"  check {hop['name']}: raw bit-exact {hop['bit_exact']}, compressed cos "
                      f"{hop['cos_coded_vs_f32']:.5f} vs float32 ({hop['cos_coded_vs_bf16']:.5f} vs the bf16 sent)",
                      file=sys.stderr, flush=True)
        quality_runs = []
        jobs = [(task, c, T, mode) for task, lm in ctx["lms"].items() for c in range(len(lm["evals"]))
                for T in lm["prefill"] for mode in ("raw", "compressed")]
        for task, c, T, mode in tqdm(jobs, desc="quality runs (1st link)", unit="run", disable=rank != 0):
            lm = ctx["lms"][task]
            out = llm_session(rank, ctx, task, lm["evals"][c, :T], mode, cfg["DECODE_TOKENS"], score=True)
            if rank == 1:
                ref = lm["refs"][(c, T)]
                top, nll = out["scored"]
                quality_runs.append({"task": task, "chunk": c, "tokens": T, "mode": mode, "nll_sum": float(nll.sum()),
                                     "ref_nll_sum": float(ref["nll"].sum()), "scored": int(len(nll)),
                                     "agree": int((top == ref["top"]).sum()), "positions": int(len(top)),
                                     "greedy_agree": int(sum(a == b for a, b in zip(out["tokens"], ref["tokens"]))),
                                     "greedy_total": len(ref["tokens"])})
        diffusion = {mode: diffusion_session(rank, ctx, mode) for mode in ("raw", "compressed")}
    if rank == 0:
        return {"diffusion_psnr": {m: d["psnr_db"] for m, d in diffusion.items()}}
    return {"hops": hops, "quality": quality_runs}


def run_measure(rank: int, ctx: dict, link_mbit) -> dict:
    """The timed sessions at the current link setting."""
    from tqdm import tqdm

    cfg = ctx["cfg"]
    jobs = [(task, T, mode, r) for task, lm in ctx["lms"].items() for T in lm["prefill"]
            for r in range(cfg["REPEATS"]) for mode in ("raw", "compressed")]
    jobs += [("diffusion", None, mode, r) for r in range(cfg["REPEATS"]) for mode in ("raw", "compressed")]
    sessions = []
    with torch.no_grad():
        for task, T, mode, r in tqdm(jobs, desc=f"timed sessions at {link_mbit} Mbit", unit="session",
                                     disable=rank != 0):
            if task == "diffusion":
                out = diffusion_session(rank, ctx, mode)
            else:
                out = llm_session(rank, ctx, task, ctx["lms"][task]["evals"][0, :T], mode, cfg["DECODE_TOKENS"],
                                  score=False)
            sessions.append({"task": task, "tokens": T, "mode": mode, "repeat": r,
                             **{k: v for k, v in out.items() if k != "scored"}})
    return {"sessions": sessions}


def worker(rank: int, master: str, port: int, quick: bool, gpu: bool) -> None:
    import copy

    import torch.distributed as dist

    from shared.diffusion import load_tiny_flux
    from shared.errors import WeightsUnavailable
    from shared.llm import load_smollm2
    from shared.pipeline import TensorCodec

    cfg = settings(quick, gpu)
    torch.set_num_threads(cfg["WORKER_THREADS"])
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=cfg["TIMEOUT_S"]))
    try:
        model, tokenizer = load_smollm2(cfg["DEVICE"])
    except WeightsUnavailable as e:
        if not gpu:
            raise
        model = tokenizer = None  # the GPU run goes on with the wide decoder and the diffusion transformer
        print(f"NOTE: no SmolLM2 on this machine ({e}); the GPU rows have no SmolLM2 task", flush=True)
    flux = load_tiny_flux()  # calibration and the reference images on the CPU; the sessions on DEVICE
    ctx = {"cfg": cfg, "model": model, "tokenizer": tokenizer, "flux_cpu": flux,
           "flux": flux if cfg["DEVICE"] == "cpu" else copy.deepcopy(flux).to(cfg["DEVICE"])}
    ctx["lms"] = language_models(ctx)
    with torch.no_grad():
        setup = setup_stage0(ctx) if rank == 0 else setup_stage1(ctx)
    shared = [setup.get("shared")]
    dist.broadcast_object_list(shared, src=0)
    for task, (basis, step, min_rows) in shared[0].items():
        codec = TensorCodec(basis, backend="rans", step=step)
        if task == "diff":
            ctx["diff_codec"], ctx["diff_min_rows"] = codec, min_rows
        else:
            ctx["lms"][task].update(codec=codec, min_rows=min_rows)
    emit({"ready": rank, **setup["report"]})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        result = run_check(rank, ctx) if cmd["cmd"] == "check" else run_measure(rank, ctx, cmd["link_mbit"])
        emit(result)
    dist.destroy_process_group()


# ---------------------------------------------------------------- orchestrator
class Loopback:
    """Both stages as plain processes on 127.0.0.1, unshaped: the fallback where namespaces cannot be made."""

    ip_a = ip_b = "127.0.0.1"

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        return self

    def popen(self, _side: str, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, **kwargs)
        self.procs.append(proc)
        return proc

    def reshape(self, **_):
        pass

    def __exit__(self, *exc):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


class Worker:
    """A stage process in its namespace; commands go in on stdin, '@@ {json}' results come out on stdout."""

    def __init__(self, link, side: str, rank: int, port: int, quick: bool, gpu: bool, timeout_s: float):
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(rank), "--master", link.ip_a,
                "--port", str(port)] + (["--quick"] if quick else []) + (["--gpu"] if gpu else [])
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **WORKER_ENV,
                   GLOO_SOCKET_IFNAME=getattr(link, f"dev_{side}", "lo"))  # gloo's pairs use the veth end
        self.rank, self.timeout_s, self.lines = rank, timeout_s, queue.Queue()
        self.proc = link.popen(side, argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               cwd=str(Path(__file__).resolve().parent.parent))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(PROTOCOL):
                self.lines.put(json.loads(line[len(PROTOCOL):]))
            else:
                print(f"[stage {self.rank}] {line}", end="", flush=True)
        self.lines.put(None)

    def send(self, cmd: dict):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        try:
            out = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise RuntimeError(f"stage {self.rank} gave no result within {self.timeout_s} s") from None
        if out is None:
            raise RuntimeError(f"stage {self.rank} exited (code {self.proc.wait()}) before its result; "
                               "its error is printed above")
        return out


def command(workers: list[Worker], cmd: dict) -> list[dict]:
    for w in workers:
        w.send(cmd)
    return [w.result() for w in workers]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_link_experiment(quick: bool, force_loopback: bool, gpu: bool = False) -> dict:
    """Both stages on the shaped link (or loopback): setup, correctness and quality, then each link speed."""
    cfg = settings(quick, gpu)
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA GPU is visible to torch here; run without --gpu for the CPU stages")
    reason = "--loopback given" if force_loopback else None
    if reason is None:
        from shared.links import link_unavailable_reason
        reason = link_unavailable_reason()
    if reason is not None and not (quick or force_loopback):
        raise SystemExit(f"the shaped link cannot be built on this machine: {reason}. Run as root with iproute2 "
                         "(ip netns, tc), or pass --loopback for an unshaped run over 127.0.0.1")
    if reason is None:
        from shared.links import ShapedLink
        link_cm, links, port, link_kind = (ShapedLink(rate_mbit=cfg["LINKS_MBIT"][0], delay_ms=cfg["DELAY_MS"]),
                                           cfg["LINKS_MBIT"], cfg["PORT"], "veth+tc")
    else:
        print(f"NOTE: no shaped link ({reason}): both stages run over unshaped loopback (127.0.0.1); "
              "the rows say link=loopback")
        link_cm, links, port, link_kind = Loopback(), [None], free_port(), "loopback"
    out = {"link": link_kind, "reason": reason, "cfg": cfg, "measures": [], "gpu": gpu}
    with link_cm as link:
        workers = [Worker(link, side, rank, port, quick, gpu, cfg["TIMEOUT_S"]) for rank, side in ((0, "a"), (1, "b"))]
        out["setup"] = [w.result() for w in workers]
        s0 = out["setup"][0]
        print("setup: " + "; ".join(f"{task} step {s0[f'{task}_step']:.4g} (calibration cos >= "
                                    f"{min(s0[f'{task}_cal_cos']):.5f}), coded from {s0[f'{task}_min_rows']} tokens"
                                    for task in ("llm", "wide", "diff") if f"{task}_step" in s0), flush=True)
        out["check"] = command(workers, {"cmd": "check"})
        for mbit in links:
            if mbit is not None:
                link.reshape(rate_mbit=mbit, delay_ms=cfg["DELAY_MS"])
            results = command(workers, {"cmd": "measure", "link_mbit": mbit})
            results[0]["load_1min"] = os.getloadavg()[0]  # the machine's load when this point finished
            out["measures"].append((mbit, results))
        for w in workers:
            w.send({"cmd": "quit"})
        for w in workers:
            w.proc.wait(timeout=60)
    return out


# ---------------------------------------------------------------- rows
def step_table(session0: dict, session1: dict) -> list[dict]:
    """Per-step timings of both sides joined: wire_ms = receiver's clock at receipt - sender's at first send."""
    steps = []
    for a, b in zip(session0["steps"], session1["steps"]):
        wire = (b["t_recv"] - a["t_send"]) * 1e3
        hop = a["encode_ms"] + wire + b["decode_ms"]
        steps.append({**{k: v for k, v in a.items() if k not in ("t_send",)}, "wire_ms": wire,
                      "decode_ms": b["decode_ms"], "stage1_ms": b["stage1_ms"], "hop_ms": hop})
    return steps


def coder_label() -> str:
    """Which CPU rANS coder TensorCodec used: the compiled one, or the numpy reference without numba."""
    from shared.codecs import rans_cpu

    return "numba coder" if rans_cpu.AVAILABLE else "numpy reference coder"


def make_rows(out: dict) -> ResultsWriter:
    gpu = out.get("gpu", False)
    res = ResultsWriter("16", "split_inference", gpu=gpu)
    cfg, link_kind = out["cfg"], out["link"]
    coder = "GPU coder (TensorCodec on CUDA tensors)" if gpu else coder_label()
    s0, s1 = out["setup"]
    common = dict(link=link_kind, delay_ms=cfg["DELAY_MS"], target_cos=cfg["TARGET_COS"], coder=coder,
                  compute="gpu" if gpu else "cpu")

    def add(task, metric, value, unit, mode="", phase="", **kw):
        backend = "rans" if mode == "compressed" else ("raw-bf16" if mode == "raw" else "")
        res.add(backend=backend, metric=metric, value=float(value), unit=unit, task=task, phase=phase, mode=mode,
                **{**common, **kw})

    split = {"llm": f"layer {cfg['SPLIT_LAYER']}", "diffusion": f"after double block {cfg['DIFF_SPLIT_BLOCK']}",
             "wide": f"layer {cfg['WIDE_SPLIT']} of {cfg['WIDE_SHAPE']['layers']}"}
    lm_tasks = [t for t in ("llm", "wide") if f"{t}_step" in s0]
    for task, key in [(t, t) for t in lm_tasks] + [("diffusion", "diff")]:
        add(task, "quant_step", s0[f"{key}_step"], "", "compressed", "calibration", split=split[task])
        add(task, "cos", min(s0[f"{key}_cal_cos"]), "", "compressed", "calibration", split=split[task],
            note="worst calibration tensor")
        add(task, "min_coded_rows", s0[f"{key}_min_rows"], "tokens", "compressed", "calibration", split=split[task],
            note="fewest tokens whose container is smaller than raw (powers of two tried); fewer go raw")
        for size in s0[f"{key}_sizes"]:
            for metric in ("container_bytes", "payload_bytes", "raw_bytes"):
                add(task, metric, size[metric], "bytes", "compressed", "container_size", tokens=size["rows"],
                    split=split[task])
    for task in lm_tasks:
        add(task, "max_abs_err", s1[f"{task}_split_max_abs_err"], "logit", "unsplit", "split_in_one_process",
            split=split[task], note="both halves in one process vs the unsplit forward, no transfer")
    add("diffusion", "max_abs_err", s0["diff_split_max_abs_err"], "velocity", "unsplit", "split_in_one_process",
        split=split["diffusion"], note="both halves in one process vs the unsplit forward, no transfer")

    check0, check1 = out["check"]
    first = out["measures"][0][0]
    for hop in check1["hops"]:
        task = hop["task"]
        add(task, "bit_exact", hop["bit_exact"], "bool", "raw", "check", tokens=hop["rows"], link_mbit=first)
        add(task, "cos", hop["cos_raw_vs_f32"], "", "raw", "check", tokens=hop["rows"], link_mbit=first,
            note="bf16 received vs the float32 hidden state")
        add(task, "cos", hop["cos_coded_vs_f32"], "", "compressed", "check", tokens=hop["rows"], link_mbit=first,
            note="decoded vs the float32 hidden state (evaluation data)")
        add(task, "cos_vs_bf16", hop["cos_coded_vs_bf16"], "", "compressed", "check", tokens=hop["rows"],
            link_mbit=first, note="decoded vs the bf16 tensor raw mode sends")
    quality = check1["quality"]
    for task, T in sorted({(q["task"], q["tokens"]) for q in quality}):
        runs = {m: [q for q in quality if q["task"] == task and q["tokens"] == T and q["mode"] == m]
                for m in ("raw", "compressed")}
        n_scored = sum(q["scored"] for q in runs["raw"])
        if task == "llm":  # the wide decoder's random weights and tokens give no meaningful perplexity
            add(task, "perplexity", math.exp(sum(q["ref_nll_sum"] for q in runs["raw"]) / n_scored), "", "unsplit",
                "quality", tokens=T, chunks=len(runs["raw"]))
        for mode, rs in runs.items():
            if task == "llm":
                add(task, "perplexity", math.exp(sum(q["nll_sum"] for q in rs) / n_scored), "", mode, "quality",
                    tokens=T, chunks=len(rs), link_mbit=first)
            add(task, "agreement", sum(q["agree"] for q in rs) / sum(q["positions"] for q in rs), "fraction", mode,
                "quality", tokens=T, chunks=len(rs), link_mbit=first,
                note="argmax of the next token at every prefill position, same as the unsplit model")
            add(task, "greedy_agreement", sum(q["greedy_agree"] for q in rs) / sum(q["greedy_total"] for q in rs),
                "fraction", mode, "quality", tokens=T, chunks=len(rs), link_mbit=first,
                note=f"greedy tokens equal to the unsplit model's, position by position, {cfg['DECODE_TOKENS']} per chunk")
    for mode, value in check0["diffusion_psnr"].items():
        add("diffusion", "psnr_db", value, "dB", mode, "quality", link_mbit=first, steps=cfg["DIFF_STEPS"],
            images=cfg["DIFF_BATCH"], note="final images vs the unsplit model, same noise")

    for mbit, (m0, m1) in out["measures"]:
        groups: dict = {}
        for a, b in zip(m0["sessions"], m1["sessions"]):
            steps = step_table(a, b)
            if a["task"] != "diffusion":
                groups.setdefault((a["task"], "prefill", a["tokens"], a["mode"]), []).extend(steps[:1])
                groups.setdefault((a["task"], "decode", a["tokens"], a["mode"]), []).extend(steps[1:])
            else:
                groups.setdefault(("diffusion", "sampler_step", None, a["mode"]), []).extend(steps)
                add("diffusion", "psnr_db", a["psnr_db"], "dB", a["mode"], "quality", link_mbit=mbit,
                    repeat=a["repeat"], steps=cfg["DIFF_STEPS"], images=cfg["DIFF_BATCH"])
        medians = {}
        for (task, phase, T, mode), steps in groups.items():
            med = {k: float(np.median([s[k] for s in steps])) for k in
                   ("step_ms", "stage0_ms", "encode_ms", "wire_ms", "decode_ms", "stage1_ms", "hop_ms", "bytes")}
            medians[(task, phase, T, mode)] = med
            kw = dict(link_mbit=mbit, tokens=T if phase != "decode" else 1, context=T, samples=len(steps),
                      sent_as=steps[0]["sent_as"], split=split[task], load_1min=m0["load_1min"])
            for k in ("step_ms", "stage0_ms", "encode_ms", "wire_ms", "decode_ms", "stage1_ms", "hop_ms"):
                add(task, k, med[k], "ms", mode, phase, **kw)
            add(task, "bytes_per_step", med["bytes"], "bytes", mode, phase, **kw)
            add(task, "wire_mbit_per_s", med["bytes"] * 8 / (med["wire_ms"] * 1e3), "Mbit/s", mode, phase, **kw,
                note="bytes of the step / wire_ms: the rate the link delivered")
            per_step = 1 if phase == "decode" else (T or cfg["DIFF_BATCH"])
            unit = "images/s" if task == "diffusion" else "tokens/s"
            add(task, "images_per_s" if task == "diffusion" else "tokens_per_s", per_step * 1e3 / med["step_ms"], unit,
                mode, phase, **kw)
        for (task, phase, T, mode), med in medians.items():
            if mode != "compressed":
                continue
            raw = medians[(task, phase, T, "raw")]
            kw = dict(link_mbit=mbit, tokens=T if phase != "decode" else 1, context=T, split=split[task])
            add(task, "ratio", raw["bytes"] / med["bytes"], "x", mode, phase, **kw,
                note="raw bytes per step / compressed bytes per step (framing heads included)")
            add(task, "speedup", raw["step_ms"] / med["step_ms"], "x", mode, phase, **kw,
                note="raw step_ms / compressed step_ms")
            add(task, "hop_speedup", raw["hop_ms"] / med["hop_ms"], "x", mode, phase, **kw,
                note="raw (encode+wire+decode) / compressed (encode+wire+decode)")
            ratio = raw["bytes"] / med["bytes"]
            add(task, "speedup_free_codec", raw["step_ms"] / (raw["step_ms"] - raw["wire_ms"] + raw["wire_ms"] / ratio),
                "x", mode, phase, **kw, note="the step speed-up a codec costing 0 ms would give: raw step with its "
                "wire time divided by the ratio (the compute share of the step bounds it)")
    return res


# ---------------------------------------------------------------- figure
def plot(csv_path: Path, fig_dir: Path | None = None):
    """figures/16_split_inference.png from the rows whose stages and codec ran on the CPU, and
    figures/16_split_inference_gpu.png from those that ran on a GPU (where there are any)."""
    import pandas as pd

    df = pd.read_csv(csv_path)
    df["link_mbit"] = df.link_mbit.fillna(-1)
    df["compute"] = df["compute"].fillna("cpu") if "compute" in df else "cpu"
    for compute, name in (("cpu", NAME), ("gpu", f"{NAME}_gpu")):
        if (df.compute == compute).any():
            plot_compute(df[df.compute == compute], compute, name, fig_dir)


TASK_NAMES = {"llm": "SmolLM2", "wide": "4096-wide decoder", "diffusion": "diffusion"}


def plot_compute(df, compute: str, fig_name: str, fig_dir: Path | None):
    """Top row: the whole step per link speed, raw vs compressed, split into its measured parts.
    Bottom row: the hand-over alone (encode + wire + decode), where compression acts."""
    plt = apply_style()
    timed = df[df.phase.isin(["prefill", "decode", "sampler_step"])]
    panels = []
    for task in ("llm", "wide"):
        prefills = sorted(timed[(timed.task == task) & (timed.phase == "prefill")].context.dropna().unique())
        panels += [(task, "prefill", t) for t in prefills] + ([(task, "decode", max(prefills))] if prefills else [])
    panels += [("diffusion", "sampler_step", None)]
    fig, axes = plt.subplots(2, len(panels), figsize=(3.7 * len(panels) + 1.6, 7.4), squeeze=False)
    compute_parts = [("stage0_ms", "stage 0 compute", "#0072B2"), ("stage1_ms", "stage 1 compute", "#56B4E9")]
    hop = [("encode_ms", "encode", "#D55E00"), ("wire_ms", "wire", "#009E73"), ("decode_ms", "decode", "#E69F00")]
    rows = [(compute_parts + hop, "step_ms", "speedup", "step", "ms per step"),
            (hop, "hop_ms", "hop_speedup", "hand-over", "ms per hand-over (encode + wire + decode)")]
    links = sorted(timed.link_mbit.unique(), reverse=True)
    for r, (parts, total, speed_metric, speed_name, ylabel) in enumerate(rows):
        for ax, (task, phase, ctx_tokens) in zip(axes[r], panels):
            sel = df[(df.task == task) & (df.phase == phase)]
            if ctx_tokens is not None:
                sel = sel[sel.context == ctx_tokens]
            ticks, labels = [], []
            for i, link in enumerate(links):
                at = sel[sel.link_mbit == link]
                for j, mode in enumerate(("raw", "compressed")):
                    m = at[at["mode"] == mode].drop_duplicates("metric").set_index("metric").value
                    if total not in m:
                        continue
                    x, bottom = i * 3 + j, 0.0
                    for key, label, colour in parts:
                        v = float(m.get(key, 0.0))
                        ax.bar(x, v, bottom=bottom, color=colour, label=label if (i, j) == (0, 0) else None,
                               hatch="//" if mode == "compressed" else None, edgecolor="white", width=0.85)
                        bottom += v
                    ax.text(x, max(bottom, float(m[total])), f"{float(m[total]):.0f}", ha="center", va="bottom",
                            fontsize=7)
                c = at[at["mode"] == "compressed"].drop_duplicates("metric").set_index("metric").value
                name = "loopback" if link == -1 else (f"{link / 1000:g} Gbit" if link >= 1000 else f"{link:g} Mbit")
                extra = (f"\nbytes {c['ratio']:.1f}x less\n{speed_name} {c[speed_metric]:.2f}x"
                         if "ratio" in c and speed_metric in c else "")
                ticks.append(i * 3 + 0.5)
                labels.append(name + extra)
            ax.set_xticks(ticks, labels, fontsize=7)
            ax.set_ylabel(ylabel, fontsize=8)
            sent = set(sel[(sel.metric == "step_ms") & (sel["mode"] == "compressed")].sent_as.dropna())
            what = {"prefill": f"{TASK_NAMES[task]} prefill, {int(ctx_tokens) if ctx_tokens else ''} tokens",
                    "decode": f"{TASK_NAMES[task]} decode, 1 token per step",
                    "sampler_step": "diffusion, one sampler step"}[phase]
            how = "both modes send it raw (container > raw)" if sent == {"raw"} else "hatched: compressed"
            ax.set_title(f"{what} ({speed_name})\nplain: raw bf16; {how}", fontsize=8)
        axes[r, -1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    gains = df[(df.metric.isin(["speedup", "hop_speedup"])) & (df.link_mbit.between(0, 100)) & (df.phase != "decode")]
    where = "a tc-shaped veth link" if (df.link == "veth+tc").any() else "unshaped loopback (no namespaces here)"
    if compute == "gpu":
        title = f"Split inference on {', '.join(df.device.unique())} across {where} (both stages and the codec on the GPU)"
    else:
        title = f"Split inference on a CPU across {where} (CPU codec: {coder_label_from(df)})"
    if len(gains):
        hs, ss = gains[gains.metric == "hop_speedup"].value, gains[gains.metric == "speedup"].value
        title += (f":\nat <= 100 Mbit compression speeds the hand-over {hs.min():.2f}-{hs.max():.2f}x, "
                  f"the whole step {ss.min():.2f}-{ss.max():.2f}x" + (" (compute-bound on this CPU)" if compute == "cpu" else ""))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if fig_dir is None:
        save_figure(fig, fig_name, f"{NAME}.csv")
    else:
        fig.savefig(fig_dir / f"{fig_name}.png")
        print(f"wrote {fig_dir / (fig_name + '.png')}")


def coder_label_from(df) -> str:
    coders = df.coder.dropna().unique() if "coder" in df else []
    return ", ".join(coders) if len(coders) else "?"


# ---------------------------------------------------------------- console
def summary(res: ResultsWriter) -> None:
    import pandas as pd

    df = pd.DataFrame(res.rows)
    df["context"] = df.get("context", pd.Series(index=df.index, dtype=float)).fillna(-1)
    df["link_mbit"] = df.get("link_mbit", pd.Series(index=df.index, dtype=float)).fillna(-1)
    t = df[df.metric.isin(["step_ms", "encode_ms", "wire_ms", "decode_ms", "bytes_per_step"])]
    if len(t):
        table = t.pivot_table(index=["task", "phase", "context", "link_mbit", "mode"], columns="metric",
                              values="value", dropna=False).dropna(how="all")
        print(table.round(2).to_string())
    q = df[df.metric.isin(["perplexity", "agreement", "greedy_agreement", "psnr_db", "cos"]) &
           df.phase.isin(["quality", "check"])]
    print(q[["task", "phase", "mode", "metric", "tokens", "value"]].drop_duplicates(
        subset=["task", "phase", "mode", "metric", "tokens"]).to_string(index=False))
    cfg_rows = df[(df.metric.isin(["speedup", "ratio", "hop_speedup"]))]
    if len(cfg_rows):
        piv = cfg_rows.pivot_table(index=["task", "phase", "context", "link_mbit"], columns="metric",
                                   values="value", dropna=False).dropna(how="all")
        piv["speedup / ratio"] = piv["speedup"] / piv["ratio"]
        print(piv.round(3).to_string())


def markdown_table(csv_path: Path) -> str:
    """The PoC 16 tables of docs/results.md ("Split inference over a shaped link"), from the CSV alone
    (python pocs/16_split_inference.py --table): one pair of tables per place the stages ran (CPU, GPU)."""
    import pandas as pd

    df = pd.read_csv(csv_path)
    df["context"], df["link_mbit"] = df.context.fillna(-1), df.link_mbit.fillna(-1)  # -1: loopback
    df["compute"] = df["compute"].fillna("cpu") if "compute" in df else "cpu"
    out = []
    for compute in ("cpu", "gpu"):
        sub = df[df.compute == compute]
        if len(sub):
            where = "a CPU" if compute == "cpu" else ", ".join(sub.device.unique())
            out += [f"Stages and codec on {where}:", "", timing_table(sub), "", quality_table(sub), ""]
    return "\n".join(out).rstrip()


def timing_table(df) -> str:
    timed = df[df.phase.isin(["prefill", "decode", "sampler_step"])]
    lines = ["| task, step | link | raw ms/step | compressed ms/step | bytes ratio | step speed-up | speed-up / ratio "
             "| hop ms raw -> compressed (encode + wire + decode) | compressed sent as |",
             "|---|---|---|---|---|---|---|---|---|"]
    order = {"prefill": 0, "decode": 1, "sampler_step": 2}
    tasks = {"llm": 0, "wide": 1, "diffusion": 2}
    keys = sorted({(t, p, c) for t, p, c in zip(timed.task, timed.phase, timed.context)},
                  key=lambda k: (tasks[k[0]], order[k[1]], k[2]))
    for task, phase, ctx in keys:
        sel = timed[(timed.task == task) & (timed.phase == phase) & (timed.context == ctx)]
        for mbit in sorted(sel.link_mbit.unique(), reverse=True):
            at = sel[sel.link_mbit == mbit]

            def get(metric, mode="compressed"):
                v = at[(at.metric == metric) & (at["mode"] == mode)].value
                return float(v.iloc[0]) if len(v) else float("nan")
            name = TASK_NAMES[task]
            what = {"prefill": f"{name} prefill {int(ctx)} tokens", "decode": f"{name} decode (after {int(ctx)})",
                    "sampler_step": "diffusion sampler step"}[phase]
            sent = at[(at.metric == "step_ms") & (at["mode"] == "compressed")].sent_as.iloc[0]
            lines.append(
                f"| {what} | {'loopback' if mbit == -1 else f'{mbit:g} Mbit'} | {get('step_ms', 'raw'):.1f} | {get('step_ms'):.1f} | {get('ratio'):.2f}x "
                f"| {get('speedup'):.2f}x | {get('speedup') / get('ratio'):.2f} | {get('hop_ms', 'raw'):.1f} -> "
                f"{get('hop_ms'):.1f} ({get('encode_ms'):.1f} + {get('wire_ms'):.1f} + {get('decode_ms'):.1f}) | {sent} |")
    return "\n".join(lines)


def quality_table(df) -> str:
    q = df[df.phase.isin(["quality", "check", "calibration"])]

    def val(task, phase, mode, metric, tokens=None):
        v = q[(q.task == task) & (q.phase == phase) & (q["mode"] == mode) & (q.metric == metric)]
        if tokens is not None:
            v = v[v.tokens == tokens]
        return float(v.value.iloc[0]) if len(v) else float("nan")
    lines = ["| task | tokens | cos (eval, compressed) | perplexity unsplit / raw / compressed | "
             "next-token agreement raw / compressed | greedy agreement raw / compressed |", "|---|---|---|---|---|---|"]
    for task in ("llm", "wide"):
        for T in sorted(q[(q.task == task) & (q.metric == "agreement")].tokens.dropna().unique()):
            ppl = (f"{val(task, 'quality', 'unsplit', 'perplexity', T):.3f} / "
                   f"{val(task, 'quality', 'raw', 'perplexity', T):.3f} / "
                   f"{val(task, 'quality', 'compressed', 'perplexity', T):.3f}" if task == "llm"
                   else "(random weights: not meaningful)")
            lines.append(
                f"| {TASK_NAMES[task]} | {int(T)} | {val(task, 'check', 'compressed', 'cos', T):.4f} | {ppl} | "
                f"{val(task, 'quality', 'raw', 'agreement', T):.3f} / {val(task, 'quality', 'compressed', 'agreement', T):.3f}"
                f" | {val(task, 'quality', 'raw', 'greedy_agreement', T):.3f} / "
                f"{val(task, 'quality', 'compressed', 'greedy_agreement', T):.3f} |")
    psnr = q[(q.task == "diffusion") & (q.metric == "psnr_db")]
    rows = q[(q.task == "diffusion") & (q.phase == "check") & (q.metric == "cos")].tokens
    lines.append(f"| diffusion | {int(rows.iloc[0]) if len(rows) else ''} | "
                 f"{val('diffusion', 'check', 'compressed', 'cos'):.4f} | final-image PSNR vs unsplit: raw "
                 f"{psnr[psnr['mode'] == 'raw'].value.median():.1f} dB, compressed "
                 f"{psnr[psnr['mode'] == 'compressed'].value.median():.1f} dB | | |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run (under ~90 s on a 2-core CPU machine)")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    ap.add_argument("--loopback", action="store_true", help="unshaped 127.0.0.1 instead of the shaped veth link")
    ap.add_argument("--table", action="store_true", help="print docs/results.md's PoC 16 tables from the CSV")
    ap.add_argument("--gpu", action="store_true", help="both stages and the codec on the CUDA GPU (adds the 4096-wide "
                    "random decoder); its rows replace the CSV's GPU rows and keep the CPU ones")
    ap.add_argument("--out", type=Path, default=None, help="write the CSV and figure into this folder instead")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=PORT, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.master, args.port, args.quick, args.gpu)
        return
    csv_path = (args.out / f"{NAME}.csv") if args.out else None
    if args.table:
        from shared.results import RESULTS
        print(markdown_table(csv_path or RESULTS / f"{NAME}.csv"))
        return
    if not args.plot_only:
        announce("16")
        t0 = time.time()
        res = make_rows(run_link_experiment(args.quick, args.loopback, args.gpu))
        summary(res)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            csv_path = res.save(csv_path)
        elif args.quick:
            csv_path = res.save()
        else:  # the CPU run and the GPU run are made on different machines: each replaces only its own rows
            csv_path = res.merge(compute="gpu" if args.gpu else "cpu")
        print(f"total {time.time() - t0:.0f} s")
    from shared.results import RESULTS
    plot(csv_path or RESULTS / f"{NAME}.csv", args.out)


if __name__ == "__main__":
    main()

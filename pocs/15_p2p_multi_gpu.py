"""PoC 15 - Does compressing an activation make it cross between GPUs, or to host memory and back,
faster: over the host-staged PCIe path (device -> pinned host -> device) that GPUs without peer access
and a KV offload take, and over NVLink (NCCL peer-to-peer)?

Host round trip (a GPU): a list of 8 bf16 activations [tokens, D] of 16-256 MB, D = 1024 and 4096 (synthetic),
and of SmolLM2's layer-15 hidden states (D = 576, 2K and 8K tokens; from data/planes/, `make planes`, or
computed with the embedded model), goes GPU -> pinned host -> the same GPU through shared.stream.HostStream,
raw and through the compute codec (a PCA basis and a step for cos >= 0.999 fitted on calibration tokens, not
sent; at D = 4096 also a basis truncated to the components water-filling keeps at that cos). Raw: serial
(every D2H, then every H2D) and pipelined (chunks of 8-64 MB, both copy engines busy: the baseline).
Compressed: serial (encode_many, the containers across and back, decode_many) and pipelined (chunk k
encoded while chunk k-1 crosses; chunks of 64-256 MB; encodes and decodes in turns on the SMs, and side by
side). Every variant runs on the same tensors
in one run; each list is checked first (raw bit-exact, compressed at the cos target), then timed (median
of HOST_REPEATS calls, wall clock from a synchronized start to the results ready). Also written: each
stage's span in the best pipeline (CUDA events) and, kernel-only, the codec's kernels on one 64 MB tensor.
One direction at a time too, as a KV offload moves: HostStream.offload (GPU -> pinned host; the encode of
chunk k overlaps the copy of chunk k-1) and HostStream.fetch (pinned host -> GPU; every copy queued at once,
each chunk decoded as it lands), raw and compressed.

Two processes (torch.multiprocessing spawn, ranks 0 -> 1): with 2 GPUs, torch.distributed NCCL send/recv
of the raw tensor or of the codec's blob (NVLink multicast off: NCCL_NVLS_ENABLE=0); without a GPU
(`--quick` in CI), the host-staged code path over gloo on the CPU (its numbers are not a link's).

Command:   make poc-15 [ARGS=--quick]   (or: python pocs/15_p2p_multi_gpu.py [--quick] [--widths ...] [--sizes ...])
Writes:    results/15_p2p_multi_gpu.csv, figures/15_p2p_multi_gpu.png
Sample output (an NVIDIA H100 80GB HBM3; lines of one size):
    D=1024 8 x 256 MB host round trip: raw bit-exact (matches); compressed cos >= 0.99900 (target 0.999), ratio 6.79x
        raw        serial    chunk     - MB     86.53 ms    24.8 GB/s
        raw        pipelined chunk     8 MB     51.32 ms    41.8 GB/s
        compressed serial    chunk     - MB     42.71 ms    50.3 GB/s
        compressed pipelined chunk   256 MB     36.06 ms    59.6 GB/s
        => compressed 1.42x the best pipelined raw round trip (chunks of 256 MB)
        raw        offload   chunk  16.0 MB     40.66 ms    52.8 GB/s
        raw        fetch     chunk  16.0 MB     47.79 ms    44.9 GB/s
        compressed offload   chunk 256.0 MB     14.63 ms   146.8 GB/s
        compressed fetch     chunk 256.0 MB     14.41 ms   149.1 GB/s
        => offload 2.78x, fetch 3.32x the raw copy's
    world: 1 GPU; two-process paths: none; the NCCL rows need 2 GPUs (this machine has 1): they wait for that machine
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ[_var] = "0" if _var == "NCCL_NVLS_ENABLE" else "1"  # NVLink multicast off, before NCCL starts

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.results import RESULTS, ResultsWriter, announce, apply_style, save_figure  # noqa: E402

NAME = "15_p2p_multi_gpu"
SIZES_MB = (1, 4, 16, 64, 256)  # original bf16 MB per tensor (synthetic)
QUICK_SIZES_MB = (1, 4)
CHANNELS = 1024                 # hidden size of the synthetic activations
STREAM = 8                      # tensors per pipelined stream
QUICK_STREAM = 3
LATENCY_REPEATS = 7             # one-at-a-time transfers per case (median), after the checked ones
QUICK_LATENCY_REPEATS = 2
TARGET_COS = 0.999              # step calibrated for this cos on the first tensor's sample
COS_SLACK = 5e-4                # received tensors must reach TARGET_COS - COS_SLACK
CALIB_TOKENS = 8192             # tokens the synthetic basis is fitted on (not sent)
STEP_SAMPLE_TOKENS = 8192       # tokens of the first tensor the step is searched on
ROLL_TOKENS = 7919              # stream tensor i = the source rolled by i * ROLL_TOKENS tokens
REAL_LAYER = 15                 # SmolLM2 hidden-state layer
REAL_CHUNK = 1024               # tokens per text chunk
REAL_CALIB_CHUNKS = 4           # chunks the real basis is fitted on
REAL_TOKENS = (1024, 4096, 16384)  # tokens per real tensor (1.2 / 4.7 / 18.9 MB at 576 channels)
QUICK_REAL_CHUNK, QUICK_REAL_CALIB_CHUNKS, QUICK_REAL_TOKENS = 512, 1, (512,)
SEED = 0
# the host round trip through shared.stream.HostStream (one process: GPU -> pinned host -> GPU)
HOST_WIDTHS = (1024, 4096)      # channels D of the synthetic activations
HOST_SIZES_MB = (16, 64, 256)   # MB of bf16 per tensor
HOST_TENSORS = 8                # distinct tensors per round trip (one call)
HOST_RAW_CHUNKS_MB = (8, 16, 64)        # the raw pipeline's chunk sizes: its best is the baseline
HOST_CODEC_CHUNKS_MB = (64, 128, 256)   # the compressed pipeline's chunk sizes
HOST_CALIB_TOKENS = 16384       # tokens the basis and the step are fitted on (not sent)
HOST_WARMUP, HOST_REPEATS = 3, 7  # calls before timing (graphs are captured on the second), timed calls (median)
HOST_SCHEDULES = (True, False)  # HostStream take_turns: encodes and decodes in turns, or side by side; the best counts
HOST_TRUNCATE_WIDTHS = (4096,)  # widths also coded with the basis truncated to the components water-filling keeps
TRUNCATE_MULTIPLE = 128         # the truncated K is rounded up to this (whole GEMM tiles)
SCHEDULE = {True: "turns", False: "side_by_side"}  # the schedule column's names for take_turns
HOST_REAL_LAYER = 15            # SmolLM2 hidden states of this layer: the real activations of the host round trip
HOST_REAL_CHUNKS = 16           # text chunks of REAL_CHUNK tokens they are taken from (the export's size)
HOST_REAL_CALIB_TOKENS = 4096   # of those, the tokens the basis and the step are fitted on (not sent)
HOST_REAL_TOKENS = (2048, 8192)  # tokens per real tensor (2.25 / 9 MB of bf16 at 576 channels)
QUICK_HOST = dict(widths=(1024,), sizes=(16,), tensors=3, raw_chunks=(8,), codec_chunks=(16,), repeats=3)


# ---------------------------------------------------------------- workloads (made once, in the parent)

def synthetic_workload(sizes_mb, channels: int) -> dict:
    from shared.basis import fit_basis
    from shared.sources import synthetic_activation

    tokens = [int(mb * 2**20) // (2 * channels) for mb in sizes_mb]
    x = synthetic_activation(CALIB_TOKENS + max(tokens), channels, seed=SEED)
    basis = fit_basis([x[:CALIB_TOKENS]], k=channels, model="synthetic", layer="activation")
    return dict(source="synthetic", base=x[CALIB_TOKENS:], basis=basis, tokens=tokens)


def real_workload(quick: bool) -> dict:
    import torch

    from shared.basis import fit_basis
    from shared.llm import load_smollm2, text_chunks

    chunk, n_calib, tokens = (QUICK_REAL_CHUNK, QUICK_REAL_CALIB_CHUNKS, QUICK_REAL_TOKENS) if quick else \
        (REAL_CHUNK, REAL_CALIB_CHUNKS, REAL_TOKENS)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_smollm2(device)
    ids = text_chunks(tokenizer, n_calib + -(-max(tokens) // chunk), chunk)
    with torch.no_grad():
        states = [model(ids[i:i + 1].to(device), output_hidden_states=True).hidden_states[REAL_LAYER][0].float().cpu()
                  for i in range(len(ids))]
    basis = fit_basis([s.numpy() for s in states[:n_calib]], k=states[0].shape[1], model="SmolLM2-135M",
                      layer=f"hidden.{REAL_LAYER}")
    return dict(source="smollm2_hidden", base=torch.cat(states[n_calib:]).numpy(), basis=basis, tokens=list(tokens))


def calibrate_step(workload: dict) -> float:
    """The step for TARGET_COS on a sample of the first tensor (the codec is then given it)."""
    from shared.rdquant import find_step

    sample = workload["base"][:STEP_SAMPLE_TOKENS].astype(np.float32)
    basis = workload["basis"]
    return find_step(basis.project(sample), TARGET_COS, "cos", reconstruct=basis.reconstruct, reference=sample,
                     water_fill=False).step


def stream_tensors(torch, base, T: int, n: int, device):
    """n different bf16 [T, D] tensors on the device: the source rolled along tokens."""
    src = torch.from_numpy(np.ascontiguousarray(base)).to(device)
    return [torch.roll(src, shifts=-i * ROLL_TOKENS, dims=0)[:T].bfloat16().contiguous() for i in range(n)]


# ---------------------------------------------------------------- the codec calls

def blob_tensor(torch, blob, device, path: str):
    """The codec's blob as a uint8 tensor: on the device for NCCL; where the codec left it for
    host staging (bytes already on the host are copied to the staging buffer from there)."""
    t = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if isinstance(blob, (bytes, bytearray)) else blob
    return t.to(device) if path == "nccl" else t


def decode_buffer(codec, buf, device):
    """Decode a uint8 tensor holding a blob (on the device it was received to)."""
    dev = None if str(device) == "cpu" else device
    return codec.decode(buf, device=dev)


# ---------------------------------------------------------------- one rank

class Link:
    """Rank 0 -> rank 1 over one path; control messages (float64 [4]) over the gloo group."""

    def __init__(self, torch, dist, path, device, slots, meta_group, capacity):
        self.torch, self.dist, self.path, self.device = torch, dist, path, device
        self.slots, self.meta, self.pending = slots, meta_group, 0
        self.rbuf = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.count = 0
        self.sent = []  # control messages in flight (isend: a blocking send could meet the peer's send)

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _msg(self, vals=None, src=None, dst=1):
        t = self.torch.zeros(4, dtype=self.torch.float64)
        if vals is not None:
            t[:len(vals)] = self.torch.tensor(vals, dtype=self.torch.float64)
            self.sent.append((self.dist.isend(t, dst, group=self.meta), t))
            return None
        self.dist.recv(t, 0 if src is None else src, group=self.meta)
        return t.tolist()

    def settle(self):
        """Wait for this rank's control messages to be delivered."""
        for work, _ in self.sent:
            work.wait()
        self.sent = []

    def send(self, payload, t0: float):
        """payload: uint8 tensor on this device (raw view or blob); t0: the sender's start time."""
        n = payload.numel()
        if self.path == "nccl":
            self._msg([n, t0])
            self.dist.send(payload, 1)
            return
        slot = self.count % len(self.slots)
        if self.pending == len(self.slots):  # both buffers in flight: wait for the receiver to free one
            self._msg(src=1)
            self.pending -= 1
        if n > self.slots.shape[1]:
            raise RuntimeError(f"a {n}-byte payload exceeds the {self.slots.shape[1]}-byte staging buffer")
        self.slots[slot, :n].copy_(payload, non_blocking=True)  # device -> pinned host
        self.sync()
        self._msg([n, t0, slot])
        self.pending += 1
        self.count += 1

    def drain(self):
        while self.pending:
            self._msg(src=1)
            self.pending -= 1
        self.settle()

    def recv(self):
        """(uint8 tensor on this device, the sender's t0)."""
        n, t0, slot, _ = self._msg()
        n = int(n)
        out = self.rbuf[:n]
        if self.path == "nccl":
            self.dist.recv(out, 0)
        else:
            out.copy_(self.slots[int(slot), :n], non_blocking=True)  # pinned host -> device
            self.sync()
        if self.path != "nccl":
            self._msg([0], dst=0)  # the buffer is free again
        return out, t0


def worker(rank: int, cfg: dict, workloads: list, slots, out_path: str):
    import torch
    import torch.distributed as dist

    from shared.pipeline import TensorCodec
    from shared.rdquant import quality

    n_gpu = torch.cuda.device_count()
    device = torch.device(f"cuda:{rank if n_gpu >= 2 else 0}") if n_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        err = torch.cuda.cudart().cudaHostRegister(slots.data_ptr(), slots.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the staging buffers failed (error {int(err)})")
    else:  # two ranks share the CPU: each gets its share of the cores (spinning thread pools would starve the other)
        import numba
        import threadpoolctl

        share = max(1, (os.cpu_count() or 2) // 2)
        torch.set_num_threads(share)
        numba.set_num_threads(min(share, numba.config.NUMBA_NUM_THREADS))
        threadpoolctl.threadpool_limits(share)
    init = f"tcp://127.0.0.1:{cfg['port']}"
    if "nccl" in cfg["paths"]:
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2, device_id=device)
        meta = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        meta = None
    rows = []
    for wl in workloads:
        codec = TensorCodec(wl["basis"], backend="rans", step=wl["step"])
        D = wl["base"].shape[1]
        for T in wl["tokens"]:
            xs = stream_tensors(torch, wl["base"], T, cfg["stream"], device)
            mb = 2 * T * D / 2**20
            for path in cfg["paths"]:
                link = Link(torch, dist, path, device, slots, meta, slots.shape[1])
                for backend in ("raw", "rans"):
                    case = dict(source=wl["source"], path=path, backend=backend, tensor_mb=round(mb, 3), tokens=T,
                                channels=D, k=wl["basis"].k, stream=len(xs), step=wl["step"])
                    rows += run_case(torch, dist, rank, link, codec, xs, case, cfg, quality, meta)
    dist.destroy_process_group()
    if rank == 1:
        Path(out_path).write_text(json.dumps(rows))


def run_case(torch, dist, rank, link, codec, xs, case, cfg, quality, meta) -> list[dict]:
    """Check every tensor of the stream, then time one-at-a-time transfers and the pipelined stream."""
    from shared.pipeline import decode_many, encode_many

    compressed = case["backend"] == "rans"
    orig = xs[0].numel() * 2

    def send(x):
        link.sync()
        t0 = time.perf_counter()
        payload = blob_tensor(torch, codec.encode(x), link.device, link.path) if compressed else \
            x.view(torch.uint8).reshape(-1)
        link.send(payload, t0)

    def receive():
        buf, t0 = link.recv()
        y = decode_buffer(codec, buf, link.device) if compressed else buf.view(torch.bfloat16).view(xs[0].shape)
        link.sync()
        return y, t0, time.perf_counter(), buf.numel()

    # 1. every tensor checked (the sender's blobs made by one batched call)
    dist.barrier(group=meta)
    if rank == 0:
        blobs = encode_many([codec] * len(xs), xs) if compressed else None
        for i, x in enumerate(xs):
            link.sync()
            link.send(blob_tensor(torch, blobs[i], link.device, link.path) if compressed else
                      x.view(torch.uint8).reshape(-1), 0)
        link.drain()
    else:
        got = []
        for _ in xs:  # each arrives in the one receive buffer: kept as a copy
            buf, t0 = link.recv()
            got.append((buf.clone(), t0))
        link.settle()
        if compressed:
            ys = decode_many([codec] * len(xs), [g[0] for g in got],
                             device=link.device if link.device.type == "cuda" else None)
            cos = min(quality(x.float(), y.to(x.device).float(), "cos") for x, y in zip(xs, ys))
            ratio = orig / float(np.mean([g[0].numel() for g in got]))
            ok = cos >= TARGET_COS - COS_SLACK
            print(f"{case['source']} {case['tensor_mb']:.3g} MB {case['path']}: compressed cos >= {cos:.5f} "
                  f"(target {TARGET_COS}), ratio {ratio:.2f}x{'' if ok else '  (BELOW TARGET)'}", flush=True)
            if not ok:
                raise RuntimeError(f"received cos {cos:.5f} is below {TARGET_COS - COS_SLACK}")
        else:
            exact = all(torch.equal(g[0].view(torch.bfloat16).view(x.shape), x) for g, x in zip(got, xs))
            print(f"{case['source']} {case['tensor_mb']:.3g} MB {case['path']}: raw bit-exact on {len(xs)} tensors "
                  f"({'matches' if exact else 'DIFFERS'})", flush=True)
            if not exact:
                raise RuntimeError("a raw tensor arrived changed")
    # 2. latency: one tensor at a time
    lat = []
    for r in range(cfg["latency_repeats"]):
        dist.barrier(group=meta)
        if rank == 0:
            send(xs[r % len(xs)])
            link.drain()
        else:
            _, t0, t1, _ = receive()
            lat.append(t1 - t0)
            link.settle()
    # 3. the pipelined stream
    dist.barrier(group=meta)
    if rank == 0:
        for x in xs:
            send(x)
        link.drain()
        return []
    first = last = None
    for _ in xs:
        _, t0, t1, nbytes = receive()
        first = t0 if first is None else first
        last = t1
    link.settle()
    ms = 1e3 * float(np.median(lat))
    gbps_stream = len(xs) * orig / (last - first) / 1e9
    print(f"{case['source']:>14s} {case['tensor_mb']:7.1f} MB {case['path']:11s} {case['backend']:4s} latency "
          f"{ms:8.2f} ms  single {orig / ms / 1e6:7.2f} GB/s  stream {gbps_stream:7.2f} GB/s", flush=True)
    out = [dict(case, metric="latency_ms", value=ms, unit="ms"),
           dict(case, metric="single_gbps", value=orig / ms / 1e6, unit="GB/s"),
           dict(case, metric="stream_gbps", value=gbps_stream, unit="GB/s")]
    if compressed:
        out += [dict(case, metric="cos_min", value=cos, unit="cos"), dict(case, metric="ratio", value=ratio, unit="x")]
    return out


# ---------------------------------------------------------------- host round trip through the stream

def gpu_activations(torch, tokens: int, D: int, mix, gen):
    """[tokens, D] bf16 on the GPU: Student-t(3) components with variances falling as 1/(i+1), in a
    random rotation, plus a per-channel offset N(0, 0.5) (shared.sources.synthetic_activation's recipe, made on
    the GPU because a 4096 x 4096 rotation takes minutes on the CPU; without its AR(1) correlation
    between tokens, which a per-token codec does not use)."""
    scales = (torch.arange(D, device="cuda", dtype=torch.float32) + 1).pow(-0.5)
    chi2 = sum(torch.randn(tokens, D, device="cuda", generator=gen).square_() for _ in range(3))  # 3 degrees, from gen
    z = torch.randn(tokens, D, device="cuda", generator=gen).div_(chi2.div_(3).sqrt_())
    rotation, offset = mix
    return (z.mul_(scales) @ rotation.T + offset).bfloat16()


def host_codec(torch, D: int, gen, truncate: bool = False):
    """Compute codecs for D-wide synthetic activations, fitted on HOST_CALIB_TOKENS calibration tokens
    (calibrated_codecs), and the rotation and offset the tensors share: ([codec, ...], mix)."""
    mix = (torch.linalg.qr(torch.randn(D, D, device="cuda", generator=gen))[0],
           0.5 * torch.randn(D, device="cuda", generator=gen))
    calib = gpu_activations(torch, HOST_CALIB_TOKENS, D, mix, gen).float()
    return calibrated_codecs(torch, calib, truncate, model="synthetic", layer=f"activation D={D}"), mix


def calibrated_codecs(torch, calib, truncate: bool = False, **meta) -> list:
    """[the compute codec of calib (float32 [T, D] on the GPU): its PCA basis and the step meeting TARGET_COS
    on it, both fitted on the GPU]; with truncate, also, where it is shorter, one whose basis keeps only the
    components that water-filling at that target codes (variance >= step^2 / 12; the others quantize to zero
    anyway), rounded up to a multiple of TRUNCATE_MULTIPLE, its step searched again with the truncation's
    error counted: its projection GEMMs and its coder work on K < D components."""
    from shared.basis import fit_basis_torch
    from shared.pipeline import TensorCodec
    from shared.rdquant import find_step

    D = calib.shape[1]
    basis = fit_basis_torch(calib, k=D, **meta)
    mean, comps = torch.as_tensor(basis.mean, device="cuda"), torch.as_tensor(basis.components, device="cuda")

    def search(comps, water_fill=False):
        return find_step((calib - mean) @ comps, TARGET_COS, "cos", reconstruct=lambda c: c @ comps.T + mean,
                         reference=calib, water_fill=water_fill)

    codecs = [TensorCodec(basis, backend="rans", step=search(comps).step)]
    if truncate:
        kept = int(search(comps, water_fill=True).keep.sum())
        K = min(D, -(-kept // TRUNCATE_MULTIPLE) * TRUNCATE_MULTIPLE)
        if K < D:
            codecs.append(TensorCodec(basis.truncate(K), backend="rans", step=search(comps[:, :K].contiguous()).step))
    return codecs


def median_call_s(torch, call, warmup: int, repeats: int) -> float:
    """Median wall time of call() from a synchronized start to its results ready (synchronize)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def raw_serial_trip(torch, xs):
    """The unpipelined baseline: every tensor to pinned host memory, then every one back, on one stream."""
    hosts = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in xs]

    def call():
        for h, x in zip(hosts, xs):
            h.copy_(x, non_blocking=True)
        return [h.to(x.device, non_blocking=True) for h, x in zip(hosts, xs)]
    return call


def codec_serial_trip(torch, codecs, xs):
    """The codec one step after another: encode_many, the containers to pinned memory and back, decode_many."""
    from shared.codecs.rans_cuda import Containers
    from shared.pipeline import decode_many, encode_many

    room = {}

    def call():
        blobs = encode_many(codecs, xs)
        n = blobs.buffer.numel()
        if room.get("n", 0) < n:
            room["host"], room["n"] = torch.empty(n + n // 4, dtype=torch.uint8, pin_memory=True), n + n // 4
        room["host"][:n].copy_(blobs.buffer, non_blocking=True)
        back = room["host"][:n].to(xs[0].device, non_blocking=True)
        return list(decode_many(codecs, Containers(back, blobs.starts, blobs.ends), device=xs[0].device))
    return call


def kernel_profile(torch, codecs, xs) -> list[dict]:
    """Kernel-only: each kernel's GPU time in one encode_many and one decode_many of xs (torch.profiler,
    3 calls each, after warm calls). Labelled as such: the API times are the rows beside it."""
    from torch.profiler import ProfilerActivity, profile

    from shared.pipeline import decode_many, encode_many

    blobs = encode_many(codecs, xs)
    for _ in range(2):
        decode_many(codecs, blobs, device="cuda")
        encode_many(codecs, xs)
    torch.cuda.synchronize()
    rows = []
    for direction in ("encode", "decode"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                encode_many(codecs, xs) if direction == "encode" else decode_many(codecs, blobs, device="cuda")
            torch.cuda.synchronize()
        per = {}
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", 0) or 0
            if us > 0:
                per[e.key] = per.get(e.key, 0.0) + us / 3
        for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
            rows.append(dict(direction=direction, kernel=name[:80], us=us))
    return rows


def host_round_trips(res: ResultsWriter, quick: bool, widths=None, sizes=None, profile: bool = True):
    """Rows of the host round trip (path=host_staged): each tensor list checked (raw bit-exact, compressed
    at TARGET_COS), then the raw and compressed trips timed, serial and through HostStream; synthetic
    activations of each width and size, then SmolLM2's hidden states (host_real_case)."""
    import torch

    q = QUICK_HOST if quick else {}
    widths = widths or q.get("widths", HOST_WIDTHS)
    sizes = sizes or q.get("sizes", HOST_SIZES_MB)
    n = q.get("tensors", HOST_TENSORS)
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    for D in widths:
        codecs_k, mix = host_codec(torch, D, gen, truncate=D in HOST_TRUNCATE_WIDTHS)
        for mb in sizes:
            T = int(mb * 2**20) // (2 * D)
            xs = [gpu_activations(torch, T, D, mix, gen) for _ in range(n)]
            host_case(res, xs, codecs_k, dict(source="synthetic", tensor_mb=mb), q, profile and mb == 64)
            xs.clear()  # free the GPU memory before the next size
            torch.cuda.empty_cache()
    if not quick:
        host_real_case(res, q)


def host_real_case(res: ResultsWriter, q: dict):
    """The host round trip of SmolLM2's layer-HOST_REAL_LAYER hidden states (real activations): a basis and
    step fitted on the first HOST_REAL_CALIB_TOKENS tokens, the rest rolled into the stream's tensors."""
    import torch

    states, label = host_hidden_states()
    if states is None:
        print(f"real activations skipped: {label}")
        return
    x = torch.as_tensor(states, device="cuda").float()
    calib, rest = x[:HOST_REAL_CALIB_TOKENS], x[HOST_REAL_CALIB_TOKENS:]
    codecs = calibrated_codecs(torch, calib, model="SmolLM2-135M", layer=f"hidden.{HOST_REAL_LAYER}")
    n = q.get("tensors", HOST_TENSORS)
    print(f"SmolLM2 hidden states ({label}): {tuple(x.shape)}, basis and step on {HOST_REAL_CALIB_TOKENS} tokens")
    for T in HOST_REAL_TOKENS:
        xs = [torch.roll(rest, shifts=-i * ROLL_TOKENS, dims=0)[:T].bfloat16().contiguous() for i in range(n)]
        host_case(res, xs, codecs, dict(source=f"smollm2_hidden{HOST_REAL_LAYER}", tensor_mb=round(T * x.shape[1] * 2 / 2**20, 2)),
                  q, False)


def host_hidden_states():
    """(float32 [tokens, 576] SmolLM2 hidden states, where they came from): the exported file (make planes)
    when present, else computed with the embedded model; (None, why) when neither is there."""
    from shared.sources import host_activations

    found = host_activations(f"smollm2_hidden{HOST_REAL_LAYER}")
    if found is not None:
        return found[0].astype(np.float32), found[1]
    try:
        from shared.sources import smollm2_hidden_states

        return smollm2_hidden_states(HOST_REAL_LAYER, HOST_REAL_CHUNKS, REAL_CHUNK), "computed now"
    except Exception as exc:  # noqa: BLE001 - the synthetic rows stand; say why these are missing
        return None, f"no export (make planes) and the model did not load: {type(exc).__name__}: {exc}"


def host_case(res: ResultsWriter, xs: list, codecs_k: list, source: dict, q: dict, profile: bool):
    """One host round-trip case: the tensors xs (bf16 [T, D] on the GPU) raw, then through each codec of
    codecs_k (compressed), every variant checked before it is timed."""
    import torch

    from shared.stream import HostStream

    n, (T, D) = len(xs), xs[0].shape
    repeats = q.get("repeats", HOST_REPEATS)
    device = torch.cuda.get_device_name()
    total = sum(x.numel() * 2 for x in xs)
    mb = source["tensor_mb"]
    base = dict(source, path="host_staged", tokens=T, channels=D, stream=n, target_cos=TARGET_COS, world="1 GPU")

    def timed(mode, variant, chunk, call, case, schedule=None):
        s = median_call_s(torch, call, HOST_WARMUP, repeats)
        gbps = total / s / 1e9
        res.add(backend="rans" if mode == "compressed" else "raw", mode=mode, variant=variant,
                chunk_mb=chunk, schedule=schedule, metric="effective_gbps", value=gbps, unit="GB/s",
                device=device, call_ms=1e3 * s, **case)
        print(f"    {mode:10s} {variant:9s} chunk {chunk if chunk else '-':>5} MB "
              f"{schedule or '':12s} {1e3 * s:9.2f} ms {gbps:7.1f} GB/s", flush=True)
        return gbps

    # the raw trips: checked bit-exact, then timed (the baselines of every codec below)
    case = dict(base, k=D)
    raw = HostStream(None)
    exact = all(torch.equal(x, y) for x, y in zip(xs, raw.round_trip(xs)))
    exact &= all(torch.equal(x, y) for x, y in zip(xs, raw_serial_trip(torch, xs)()))
    print(f"{source['source']} D={D} {n} x {mb:g} MB host round trip: raw bit-exact "
          f"({'matches' if exact else 'DIFFERS'})", flush=True)
    if not exact:
        raise RuntimeError(f"D={D} {mb} MB: a raw round trip came back wrong")
    timed("raw", "serial", None, raw_serial_trip(torch, xs), case)
    best_raw = 0.0
    for ch in q.get("raw_chunks", HOST_RAW_CHUNKS_MB):
        s = HostStream(None, chunk_mb=ch)
        best_raw = max(best_raw, timed("raw", "pipelined", ch, lambda: s.round_trip(xs), case))
    raw_one_way = {}
    s = HostStream(None)
    copy = s.offload(xs)
    if not all(torch.equal(x, y) for x, y in zip(xs, s.fetch(copy))):
        raise RuntimeError(f"D={D} {mb} MB: raw offload + fetch came back wrong")
    for v, call in (("offload", lambda: s.offload(xs)), ("fetch", lambda: s.fetch(copy))):
        raw_one_way[v] = timed("raw", v, s.chunk_bytes / 2**20, call, case)
    del copy
    for codec in codecs_k:
        codecs = [codec] * n
        case = dict(base, k=codec.basis.k, step=codec.quantizer.step)
        # 1. correctness, before any timing
        coded = HostStream(codecs)
        cos = min(min(cos_mean(x, y) for x, y in zip(xs, coded.round_trip(xs))),
                  min(cos_mean(x, y) for x, y in zip(xs, codec_serial_trip(torch, codecs, xs)())))
        ratio = coded.last["ratio"]
        print(f"  K={codec.basis.k}: compressed cos >= {cos:.5f} (target {TARGET_COS}), ratio {ratio:.2f}x",
              flush=True)
        if cos < TARGET_COS - COS_SLACK:
            raise RuntimeError(f"D={D} K={codec.basis.k} {mb} MB: a compressed round trip came back at cos {cos:.5f}")
        res.add(backend="rans", mode="compressed", metric="cos_min", value=cos, unit="cos", device=device, **case)
        res.add(backend="rans", mode="compressed", metric="ratio", value=ratio, unit="x", device=device, **case)

        # 2. timing: the same tensors, every variant in this run
        timed("compressed", "serial", None, codec_serial_trip(torch, codecs, xs), case)
        best, best_chunk, best_turns = 0.0, None, None
        for turns in HOST_SCHEDULES:
            for ch in q.get("codec_chunks", HOST_CODEC_CHUNKS_MB):
                s = HostStream(codecs, chunk_mb=ch, take_turns=turns)
                g = timed("compressed", "pipelined", ch, lambda: s.round_trip(xs), case, schedule=SCHEDULE[turns])
                if g > best:
                    best, best_chunk, best_turns = g, ch, turns
        res.add(backend="rans", mode="compressed", variant="pipelined", chunk_mb=best_chunk,
                schedule=SCHEDULE[best_turns], metric="speedup_vs_raw", value=best / best_raw, unit="x",
                device=device, **case)
        print(f"    => compressed {best / best_raw:.2f}x the best pipelined raw round trip "
              f"(chunks of {best_chunk:g} MB, {SCHEDULE[best_turns]})", flush=True)
        # 3. one direction at a time, as a KV offload moves: to pinned host memory now, back later
        s = HostStream(codecs, chunk_mb=best_chunk)
        copy = s.offload(xs)
        if min(cos_mean(x, y) for x, y in zip(xs, s.fetch(copy))) < TARGET_COS - COS_SLACK:
            raise RuntimeError(f"D={D} K={codec.basis.k} {mb} MB: offload + fetch came back wrong")
        one_way = {v: timed("compressed", v, s.chunk_bytes / 2**20, call, case)
                   for v, call in (("offload", lambda: s.offload(xs)), ("fetch", lambda: s.fetch(copy)))}
        del copy
        for v in ("offload", "fetch"):
            res.add(backend="rans", mode="compressed", variant=v, chunk_mb=best_chunk,
                    metric="speedup_vs_raw", value=one_way[v] / raw_one_way[v], unit="x", device=device, **case)
        print(f"    => offload {one_way['offload'] / raw_one_way['offload']:.2f}x, fetch "
              f"{one_way['fetch'] / raw_one_way['fetch']:.2f}x the raw copy's", flush=True)
        # 4. where the time goes: the best pipeline's stages, from CUDA events
        s = HostStream(codecs, chunk_mb=best_chunk, take_turns=best_turns)
        for _ in range(HOST_WARMUP):  # graphs captured, kernels tuned: the steady state's timeline
            s.round_trip(xs)
        s.round_trip(xs, timeline=True)
        for stage, k, t0, t1 in s.last["timeline"]:
            res.add(backend=stage, mode="compressed", variant="pipelined", chunk_mb=best_chunk, chunk=k,
                    schedule=SCHEDULE[best_turns], metric="stage_ms", value=t1 - t0, unit="ms", start_ms=t0,
                    device=device, **case)
        if profile:
            for row in kernel_profile(torch, codecs[:1], xs[:1]):
                res.add(backend=row["kernel"], mode="compressed", variant="kernel_only", direction=row["direction"],
                        metric="kernel_us", value=row["us"], unit="us", device=device,
                        **dict(case, tensor_mb=64, stream=1))

def cos_mean(x, y) -> float:
    """Mean cosine over tokens of two [T, D] CUDA tensors (float32)."""
    x, y = x.float(), y.float()
    return float(((x * y).sum(1) / (x.norm(dim=1) * y.norm(dim=1)).clamp_min(1e-30)).mean())


# ---------------------------------------------------------------- the run

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args) -> ResultsWriter:
    announce("15")
    import torch
    import torch.multiprocessing as mp

    n_gpu = torch.cuda.device_count()
    res = ResultsWriter("15", "p2p_multi_gpu", gpu=n_gpu > 0)
    if n_gpu:  # host staging through shared.stream.HostStream, in this process
        host_round_trips(res, args.quick, widths=args.widths, sizes=args.sizes, profile=not args.quick)
    # two processes: NCCL between two GPUs; without a GPU, the host-staged code path over gloo on the CPU
    paths = ["nccl"] if n_gpu >= 2 else [] if n_gpu else ["host_staged"]
    world = {0: "cpu (gloo): 2 ranks on the CPU", 1: "1 GPU"}.get(n_gpu, f"{n_gpu} GPUs: ranks on 0 and 1")
    print(f"world: {world}; two-process paths: {', '.join(paths) or 'none'}" +
          ("" if n_gpu >= 2 else f"; the NCCL rows need 2 GPUs (this machine has {n_gpu}): they wait for that machine"))
    if not paths:
        return res
    sizes = args.sizes or (QUICK_SIZES_MB if args.quick else SIZES_MB)
    workloads = [synthetic_workload(sizes, CHANNELS)]
    if args.real:
        try:
            workloads.append(real_workload(args.quick))
        except Exception as exc:  # the synthetic rows still stand; say why the real ones are missing
            print(f"real activations skipped: {type(exc).__name__}: {exc}")
    for wl in workloads:
        wl["step"] = calibrate_step(wl)
    capacity = max(int(1.1 * 2 * max(wl["tokens"]) * wl["base"].shape[1]) + (1 << 20) for wl in workloads)
    import shutil

    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    if shm is not None and shm < 2 * capacity + (64 << 20):
        raise SystemExit(f"the two host staging buffers need {2 * capacity / 2**20:.0f} MiB of shared memory and "
                         f"/dev/shm has {shm / 2**20:.0f} MiB free: enlarge /dev/shm or pass smaller --sizes")
    slots = torch.empty((2, capacity), dtype=torch.uint8).share_memory_()
    cfg = dict(paths=paths, stream=QUICK_STREAM if args.quick else args.stream, port=args.port or free_port(),
               latency_repeats=QUICK_LATENCY_REPEATS if args.quick else LATENCY_REPEATS)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        mp.spawn(worker, args=(cfg, workloads, slots, str(out)), nprocs=2, join=True)
        rows = json.loads(out.read_text())
    label = {0: "cpu", 1: "1 GPU"}.get(n_gpu, "2 GPUs")
    for row in rows:
        res.add(**dict(row, world=label, target_cos=TARGET_COS))
    return res


def best_rows(df):
    """The host round trip's effective GB/s per (channels, k, tensor_mb, mode, variant): the best chunk size's
    and schedule's (raw rows have k = channels)."""
    g = df[df.metric == "effective_gbps"].copy()
    g["k"] = g.k.fillna(g.channels).astype(int)
    return g.groupby(["source", "channels", "k", "tensor_mb", "mode", "variant"], as_index=False).value.max()


def plot(csv: Path | None = None, out: Path | None = None):
    import pandas as pd

    plt = apply_style()
    csv = csv or RESULTS / f"{NAME}.csv"
    df = pd.read_csv(csv)
    host = df[df.metric == "effective_gbps"]
    one_way = host[host.variant.isin(["offload", "fetch"])] if "variant" in host else host.iloc[:0]
    host = host.drop(one_way.index)
    pair = df[df.metric == "stream_gbps"]
    panels = [p for p, rows in (("host", host), ("one_way", one_way), ("pair", pair)) if len(rows)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 4.4 * len(panels)), squeeze=False)
    axes = axes.T
    for ax, panel in zip(axes[0], panels):
        if panel in ("host", "one_way"):
            best = best_rows(host if panel == "host" else one_way)
            first, second = ("pipelined", "serial") if panel == "host" else ("offload", "fetch")
            keys = sorted({(src, D, K) for src, D, K in zip(best.source, best.channels, best.k)})
            colors = {key: c for key, c in zip(keys, ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00"))}
            for (src, D, K, mode, variant), g in best.groupby(["source", "channels", "k", "mode", "variant"]):
                g = g.sort_values("tensor_mb")
                ax.plot(g.tensor_mb, g.value, "-" if mode == "compressed" else "--", color=colors[src, D, K],
                        marker="o" if variant == first else "x", alpha=1.0 if variant == first else 0.55,
                        label=f"{'' if src == 'synthetic' else src + ', '}D={D}{f' K={K}' if K != D else ''}, "
                              f"{mode}, {variant}")
            for variant in (("pipelined",) if panel == "host" else ("offload", "fetch")):
                rows = best[best.variant == variant]
                raw = rows[rows["mode"] == "raw"].set_index(["source", "channels", "tensor_mb"]).value
                for _, r in rows[rows["mode"] == "compressed"].iterrows():  # x of raw, same tensors and direction
                    if (r.source, r.channels, r.tensor_mb) in raw.index:
                        ax.annotate(f"{r.value / raw[r.source, r.channels, r.tensor_mb]:.2f}x", (r.tensor_mb, r.value),
                                    textcoords="offset points", xytext=(0, 6 if variant == "offload" else -13),
                                    ha="center", fontsize=8, color=colors[r.source, r.channels, r.k],
                                    weight="bold" if variant != "offload" else "normal")
            what = ("GPU -> pinned host -> GPU in one call (labels: compressed / raw, both pipelined)"
                    if panel == "host" else "one way: offload GPU -> pinned host, fetch pinned host -> GPU "
                    "(labels: compressed / raw)")
            ax.set_title(f"{what}\n{int(host.stream.iloc[0])} tensors a call  [{host.device.iloc[0]}]", fontsize=9)
            ax.set_ylabel("effective GB/s (original bf16 bytes / call time)")
        else:
            styles = {"raw": "--", "rans": "-"}
            colors = {"nccl": "#0072B2", "host_staged": "#D55E00"}
            names = {"nccl": "NCCL (NVLink)", "host_staged": "host-staged, two processes"}
            for (path, backend, source), g in pair.groupby(["path", "backend", "source"]):
                g = g.sort_values("tensor_mb")
                ax.plot(g.tensor_mb, g.value, styles[backend], marker="o" if source == "synthetic" else "^",
                        color=colors[path], label=f"{names[path]}, {'raw' if backend == 'raw' else 'compressed'}, {source}")
            ax.set_title(f"rank 0 -> rank 1, pipelined stream  [{pair.device.iloc[0]}, {pair.world.iloc[0]}]",
                         fontsize=9)
            ax.set_ylabel("effective GB/s (original bf16 bytes, pipelined stream)")
        ax.set_xscale("log")
        if panel == "pair":
            ax.set_yscale("log")
        else:
            ax.set_ylim(0, best.value.max() * 1.15)
        ax.xaxis.set_major_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
        sizes = {"host": host, "one_way": one_way, "pair": pair}[panel].tensor_mb.unique()
        ax.set_xticks(sorted(sizes))
        ax.set_xlabel("tensor size (MB of bf16)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    if out is None:
        save_figure(fig, NAME, f"{NAME}.csv")
    else:
        fig.savefig(out)
        print(f"wrote {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (the CPU over gloo where there is no GPU)")
    ap.add_argument("--real", action=argparse.BooleanOptionalAction, default=None,
                    help="also SmolLM2 hidden states (default: on, off with --quick)")
    ap.add_argument("--stream", type=int, default=STREAM, help="tensors per pipelined stream")
    ap.add_argument("--sizes", type=float, nargs="+", default=None,
                    help=f"tensor sizes, MB of bf16 (default {HOST_SIZES_MB} on a GPU, {SIZES_MB} for NCCL)")
    ap.add_argument("--widths", type=int, nargs="+", default=None,
                    help=f"channels of the host round trip's activations (default {HOST_WIDTHS})")
    ap.add_argument("--port", type=int, default=None, help="rendezvous port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--csv", type=Path, default=None, help="write the CSV here instead of results/")
    ap.add_argument("--figure", type=Path, default=None, help="write the figure here instead of figures/")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    args = ap.parse_args()
    args.real = (not args.quick) if args.real is None else args.real
    csv = args.csv
    if not args.plot_only:
        res = run(args)
        csv = res.save(args.csv)
    plot(csv, args.figure)

"""PoC 15 - Does compressing an activation make it cross from one GPU to another faster, over NVLink
(NCCL peer-to-peer) and over the host-staged PCIe path that GPUs without peer access take?

Two processes, one per GPU (torch.multiprocessing spawn, ranks 0 -> 1), send a stream of bf16
activations [tokens, channels] of 1-256 MB, raw and through the compute codec
(`TensorCodec(basis, backend="rans", step=...)`, a per-layer PCA basis and a step calibrated once on
a sample of the first tensor for cos >= 0.999):

  nccl         torch.distributed NCCL send/recv of the raw tensor, or of the codec's blob as a uint8
               CUDA tensor (needs 2 GPUs; NVLink multicast off: NCCL_NVLS_ENABLE=0)
  host_staged  device -> pinned host buffer (shared by both processes) -> other device, double
               buffered, raw or the blob; small control messages over gloo

Sources: synthetic activations (shared.sources.synthetic_activation: heavy-tailed spectrum, AR(1)
tokens; the basis is fitted on other tokens of the same process), and SmolLM2-135M hidden states of
one layer (the basis fitted on other text chunks). Before anything is timed, the receiver checks
every tensor of the stream: raw bit-exact, compressed at the stated cos (printed). Then per tensor
size: latency (sender starts with the tensor on its GPU, receiver has it decoded on its GPU; one
tensor at a time, median) and the pipelined rate (a stream of tensors back to back), both as GB/s
of the original bf16 bytes. Same-host processes share CLOCK_MONOTONIC, so the latency runs from
the sender's clock reading to the receiver's.

With 1 GPU both ranks share it and only host_staged runs (GPU -> pinned -> the same GPU); the NCCL
rows wait for a two-GPU machine, and the run says so. Without a GPU (`--quick` in CI) the ranks run
on the CPU over gloo, host-staged only: the code is tested, the numbers are not a link's.

Command:   make poc-15 [ARGS=--quick]   (or: python pocs/15_p2p_multi_gpu.py [--quick] [--real | --no-real])
           --quick: sizes 1 and 4 MB, 3-tensor streams, synthetic only (--real adds 512 real tokens)
Writes:    results/15_p2p_multi_gpu.csv, figures/15_p2p_multi_gpu.png
Sample output (a 2-core CPU machine shared with other jobs, --quick --real: gloo, both ranks on the
CPU, so these are not a link's numbers; the run only shows that the code works):
    world: cpu (gloo): 2 ranks on the CPU; paths: host_staged; the NCCL rows need 2 GPUs (this machine has 0): ...
    synthetic 4 MB host_staged: raw bit-exact on 3 tensors (matches)
         synthetic     4.0 MB host_staged raw  latency    31.42 ms  single    0.13 GB/s  stream    1.41 GB/s
    synthetic 4 MB host_staged: compressed cos >= 0.99900 (target 0.999), ratio 6.48x
         synthetic     4.0 MB host_staged rans latency   641.52 ms  single    0.01 GB/s  stream    0.01 GB/s
    smollm2_hidden 0.562 MB host_staged: compressed cos >= 0.99900 (target 0.999), ratio 4.19x
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


# ---------------------------------------------------------------- the codec calls (batched where the API has them)

def _api():
    from shared import pipeline

    return pipeline


def encode_list(codecs, xs):
    api = _api()
    return api.encode_many(codecs, xs) if hasattr(api, "encode_many") else [c.encode(x) for c, x in zip(codecs, xs)]


def decode_list(codecs, blobs, device):
    api = _api()
    if hasattr(api, "decode_many"):
        return api.decode_many(codecs, blobs, device=device)
    return [c.decode(_as_bytes(b), device=device) for c, b in zip(codecs, blobs)]


def _as_bytes(blob):
    return blob if isinstance(blob, (bytes, bytearray)) else blob.cpu().numpy().tobytes()


def gpu_resident_api() -> bool:
    """Whether the codec takes and returns blobs as uint8 tensors (else bytes on the host)."""
    return hasattr(_api(), "decode_many")


def blob_tensor(torch, blob, device, path: str):
    """The codec's blob as a uint8 tensor: on the device for NCCL; where the codec left it for
    host staging (bytes already on the host are copied to the staging buffer from there)."""
    t = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if isinstance(blob, (bytes, bytearray)) else blob
    return t.to(device) if path == "nccl" else t


def decode_buffer(codec, buf, device):
    """Decode a uint8 tensor holding a blob: passed as it is where the API takes tensors, else as bytes."""
    dev = None if str(device) == "cpu" else device
    return codec.decode(buf if gpu_resident_api() else _as_bytes(buf), device=dev)


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

    def recv(self, to_device: bool = True):
        """(uint8 tensor, the sender's t0): on this device, or for host staging with to_device=False
        a host copy of the staging buffer (for a decoder that takes bytes)."""
        n, t0, slot, _ = self._msg()
        n = int(n)
        out = self.rbuf[:n]
        if self.path == "nccl":
            self.dist.recv(out, 0)
        elif to_device:
            out.copy_(self.slots[int(slot), :n], non_blocking=True)  # pinned host -> device
            self.sync()
        else:
            out = self.slots[int(slot), :n].clone()
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
    compressed = case["backend"] == "rans"
    orig = xs[0].numel() * 2

    def send(x):
        link.sync()
        t0 = time.perf_counter()
        payload = blob_tensor(torch, codec.encode(x), link.device, link.path) if compressed else \
            x.view(torch.uint8).reshape(-1)
        link.send(payload, t0)

    to_device = not compressed or gpu_resident_api()

    def receive():
        buf, t0 = link.recv(to_device)
        y = decode_buffer(codec, buf, link.device) if compressed else buf.view(torch.bfloat16).view(xs[0].shape)
        link.sync()
        return y, t0, time.perf_counter(), buf.numel()

    # 1. every tensor checked (the sender's blobs made by the batched call where the API has one)
    dist.barrier(group=meta)
    if rank == 0:
        blobs = encode_list([codec] * len(xs), xs) if compressed else None
        for i, x in enumerate(xs):
            link.sync()
            link.send(blob_tensor(torch, blobs[i], link.device, link.path) if compressed else
                      x.view(torch.uint8).reshape(-1), 0)
        link.drain()
    else:
        got = []
        for _ in xs:  # each arrives in the one receive buffer: kept as a copy
            buf, t0 = link.recv(to_device)
            got.append((buf.clone(), t0))
        link.settle()
        if compressed:
            ys = decode_list([codec] * len(xs), [g[0] for g in got], link.device if
                             link.device.type == "cuda" else None)
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
    paths = (["nccl"] if n_gpu >= 2 else []) + ["host_staged"]
    world = {0: "cpu (gloo): 2 ranks on the CPU", 1: "1 GPU: both ranks on it"}.get(n_gpu, f"{n_gpu} GPUs: ranks on 0 and 1")
    print(f"world: {world}; paths: {', '.join(paths)}" +
          ("" if n_gpu >= 2 else f"; the NCCL rows need 2 GPUs (this machine has {n_gpu}): they wait for that machine"))
    sizes = args.sizes or (QUICK_SIZES_MB if args.quick else SIZES_MB)
    workloads = [synthetic_workload(sizes, args.channels)]
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
    res = ResultsWriter("15", "p2p_multi_gpu", gpu=n_gpu > 0)
    label = {0: "cpu", 1: "1 GPU"}.get(n_gpu, "2 GPUs")
    for row in rows:
        res.add(**dict(row, world=label, target_cos=TARGET_COS))
    return res


def plot(csv: Path | None = None, out: Path | None = None):
    import pandas as pd

    plt = apply_style()
    csv = csv or RESULTS / f"{NAME}.csv"
    df = pd.read_csv(csv)
    df = df[df.metric == "stream_gbps"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    styles = {"raw": "--", "rans": "-"}
    colors = {"nccl": "#0072B2", "host_staged": "#D55E00"}
    names = {"nccl": "NCCL (NVLink)", "host_staged": "host-staged (PCIe)"}
    notes = []
    for (path, backend), g in df[df.source == "synthetic"].groupby(["path", "backend"]):
        g = g.sort_values("tensor_mb")
        ax.plot(g.tensor_mb, g.value, styles[backend], marker="o", color=colors[path],
                label=f"{names[path]}, {'raw' if backend == 'raw' else 'compressed'}, synthetic")
    for (path, backend), g in df[df.source != "synthetic"].groupby(["path", "backend"]):
        ax.plot(g.tensor_mb, g.value, "s" if backend == "raw" else "^", ms=7, mfc="none", color=colors[path],
                label=f"{names[path]}, {'raw' if backend == 'raw' else 'compressed'}, {g.source.iloc[0]}")
    for path, g in df[df.source == "synthetic"].groupby("path"):
        big = g[g.tensor_mb == g.tensor_mb.max()]
        raw, comp = big[big.backend == "raw"].value, big[big.backend == "rans"].value
        if len(raw) and len(comp):
            notes.append(f"{names[path]}: compressed {float(comp.iloc[0]) / float(raw.iloc[0]):.3g}x raw at "
                         f"{big.tensor_mb.iloc[0]:.0f} MB")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
    ax.set_xlabel("tensor size (MB of bf16)")
    ax.set_ylabel("effective GB/s (original bf16 bytes, pipelined stream)")
    ax.set_title("; ".join(notes) + f"  [{df.device.iloc[0]}, {df.world.iloc[0]}]", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
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
    ap.add_argument("--sizes", type=float, nargs="+", default=None, help="synthetic tensor sizes, MB of bf16")
    ap.add_argument("--channels", type=int, default=CHANNELS, help="channels of the synthetic activations")
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

"""A stream of tensors over TCP, pipelined: the sender encodes on a thread pool while its send threads
write finished blobs; the receiver's recv threads read while its decode pool decodes. Each tensor goes
by one of two lanes, `raw` (its bytes as they are) or `coded` (a TensorCodec blob); each lane used has
its own TCP connection, so a dual-lane stream sends both at once.

    spec = write_stream(tmpdir, tensors, codecs)          # codecs[i]: TensorCodec, or None = raw lane
    with ShapedLink(rate_mbit=100) as link:
        result = run_stream(link, spec, encode_workers=1, decode_workers=1)
    result["seconds"]        # wall time from the sender's start to the last tensor ready at the receiver
    result["checks"]         # per tensor: bit_exact (raw) or cos_mean / cos_min_token (coded)

Wire format per message: little-endian uint32 index, uint64 length, then the payload; index
0xFFFFFFFF ends a lane. The raw payload is the tensor's bytes in its dtype (bf16 stays 2 bytes a value).
A raw message describes itself: after the index and length come its dtype code, its number of dims and
each dim (uint8, uint8, uint64 each), so the receiver builds the tensor from the message alone. A coded
message is a container, which describes itself too; the receiver needs only its codec's basis. Both ends
read the stream's folder (codecs.json and the basis files it names: a codec is rebuilt from its settings
and basis, never unpickled; tensors.safetensors, which the receiver reads only to check what it got
against the original after the clock stops).
Both ends time with time.perf_counter (CLOCK_MONOTONIC, one clock for every namespace of the machine).

The stream the transfer PoCs send: SmolLM2's KV cache, one tensor per (layer, K/V), [T, 192] (`kv_cache_tensors`),
each with its own PCA basis and compute-codec step fitted on calibration tokens (`kv_codecs`).
"""
from __future__ import annotations

import argparse
import json
import queue
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from shared.links import LinkError, connect, listen, recv_exact

HEAD = struct.Struct("<IQ")
RAW_DESC = struct.Struct("<BB")  # a raw message's dtype code and number of dims, then that many uint64 dims
RAW_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool")
END = 0xFFFFFFFF
LANES = ("raw", "coded")
PORT = 5301                      # first TCP port on the receiver; lane i listens on PORT + i


# ----------------------------------------------------------------------------------------- the stream
KV_ROW_BYTES = 192 * 2           # bytes per token of one SmolLM2 layer's K (or V) in bf16


def tokens_for(mb: float, row_bytes: int = KV_ROW_BYTES) -> int:
    """Tokens of a [T, 192] bf16 tensor of `mb` MiB."""
    return int(round(mb * 2**20 / row_bytes))


def kv_cache_tensors(chunks: int, chunk_tokens: int, layers) -> tuple[dict, str]:
    """{(layer, "k" | "v"): float32 [chunks * chunk_tokens, 192]} of SmolLM2's KV cache over consecutive
    chunks of the fixed text, and a label. A finished capture of the same chunks is read without loading
    the model; otherwise the model runs (raises ImportError/OSError where it is absent)."""
    from shared import llm
    from shared.captures import CaptureStore

    store = CaptureStore(f"smollm2_kv_{chunks}x{chunk_tokens}")
    try:
        meta = store.meta()
        reuse = (meta["n_chunks"], meta["tokens"], meta["text_source"], meta["model"]) == (
            chunks, chunk_tokens, llm.TEXT_SOURCE, llm.SMOLLM2_LABEL)
    except (FileNotFoundError, KeyError):
        reuse = False
    if not reuse:
        model, tokenizer = llm.load_smollm2()
        store = llm.capture_kv(model, llm.text_chunks(tokenizer, chunks, chunk_tokens), store)
    out = {(L, kind): torch.cat(store.stack(f"layer{L}.{kind}")).float() for L in layers for kind in "kv"}
    return out, f"SmolLM2-135M KV cache, {chunks} x {chunk_tokens} tokens of pydoc text"


def exported_kv(cause: BaseException) -> tuple[dict, str]:
    """{(15, "k" | "v"): float32 [6144, 192]} from the export of `make planes` (data/planes), for machines
    without the model; raises naming both causes when the export is absent too."""
    from shared.sources import real_planes

    found = {kind: real_planes(f"act_llm_{kind}15") for kind in "kv"}
    if any(f is None for f in found.values()):
        raise RuntimeError(f"SmolLM2 unavailable ({cause}) and no exported K/V (data/planes): run `make planes` "
                           "on a machine with the model and copy data/planes here") from cause
    return ({(15, kind): torch.from_numpy(np.asarray(f[0], np.float32)) for kind, f in found.items()},
            "SmolLM2-135M layer-15 KV cache (exported by `make planes`), 6 x 1024 tokens of pydoc text")


def kv_codecs(calib: torch.Tensor, settings: dict, target_cos: float) -> dict:
    """label -> TensorCodec(**settings[label]) for one tensor of the stream: a PCA basis of all components fitted
    on the calibration tokens; the compute codec ("rans") gets the shared step that meets target_cos there."""
    from shared.basis import fit_basis
    from shared.pipeline import TensorCodec
    from shared.rdquant import find_step

    x = calib.numpy()
    basis = fit_basis([x], k=x.shape[1])
    step = find_step(basis.project(x), target_cos, "cos", reconstruct=basis.reconstruct, reference=x).step
    return {label: TensorCodec(basis, **({"step": step} if s["backend"] == "rans" else {}), **s)
            for label, s in settings.items()}


def codec_spec(codec, folder: Path) -> dict | None:
    """A TensorCodec as JSON-able settings, its basis saved beside them (once per basis, named by its hash)."""
    if codec is None:
        return None
    basis = None
    if codec.basis is not None:
        basis = f"basis_{codec.basis.content_hash[:16]}.safetensors"
        if not (folder / basis).exists():
            codec.basis.save(folder / basis)
    quantizer = getattr(codec, "quantizer", None) if codec.symbols else None  # the frame path has none
    step = None if quantizer is None else float(quantizer.step)
    return {"backend": "rans" if codec.symbols else codec.backend.name, "basis": basis, "step": step,
            "target_cos": codec.target_cos if codec.symbols else None,
            "water_fill": bool(getattr(codec, "water_fill", False)), "lane_tokens": getattr(codec, "lane_tokens", None),
            "lanes_by_component": bool(getattr(codec, "lanes_by_component", False)),
            "frame_size": codec.frame_size, "min_cos": codec.min_cos, "settings": dict(codec.codec_settings),
            "decoder": None if codec.decoder is None else codec.decoder.name}


def codec_from_spec(spec: dict | None, folder: Path):
    """The TensorCodec codec_spec described (its basis loaded from folder)."""
    if spec is None:
        return None
    from shared.basis import PCABasis
    from shared.pipeline import TensorCodec

    basis = None if spec["basis"] is None else PCABasis.load(folder / spec["basis"])
    kw = dict(frame_size=spec["frame_size"], min_cos=spec["min_cos"], decoder=spec["decoder"], **spec["settings"])
    if spec["backend"] == "rans":
        kw = dict(min_cos=spec["min_cos"], water_fill=spec["water_fill"], lane_tokens=spec["lane_tokens"],
                  lanes_by_component=spec.get("lanes_by_component", False),
                  **({"step": spec["step"]} if spec["step"] is not None else {"target_cos": spec["target_cos"]}))
    return TensorCodec(basis, backend=spec["backend"], **kw)


def write_stream(folder: str | Path, tensors: list[torch.Tensor], codecs: list) -> Path:
    """Save a stream (tensors as they are, codecs[i] a TensorCodec or None for the raw lane) for both ends."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if len(tensors) != len(codecs):
        raise ValueError(f"{len(tensors)} tensors but {len(codecs)} codecs; give one codec (or None) per tensor")
    save_file({f"t{i:05d}": t.contiguous() for i, t in enumerate(tensors)}, str(folder / "tensors.safetensors"))
    (folder / "codecs.json").write_text(json.dumps([codec_spec(c, folder) for c in codecs]))
    return folder


def load_stream(folder: str | Path) -> tuple[list[torch.Tensor], list]:
    from safetensors.torch import load_file

    folder = Path(folder)
    loaded = load_file(str(folder / "tensors.safetensors"))
    tensors = [loaded[k] for k in sorted(loaded)]
    return tensors, [codec_from_spec(spec, folder) for spec in json.loads((folder / "codecs.json").read_text())]


def raw_header(x: torch.Tensor) -> bytes:
    """What a raw message carries before the tensor's bytes: its dtype code, dims and shape."""
    return RAW_DESC.pack(RAW_DTYPES.index(str(x.dtype).removeprefix("torch.")), x.dim()) + \
        struct.pack(f"<{x.dim()}Q", *x.shape)


def read_raw(sock, n: int) -> torch.Tensor:
    """A raw message's tensor (n: the message length, header included), built from the message alone."""
    code, ndim = RAW_DESC.unpack(recv_exact(sock, RAW_DESC.size))
    if code >= len(RAW_DTYPES) or ndim > 8:
        raise LinkError(f"a raw message names dtype code {code} and {ndim} dims: not this stream's")
    shape = struct.unpack(f"<{ndim}Q", recv_exact(sock, 8 * ndim))
    dtype = getattr(torch, RAW_DTYPES[code])
    body = n - RAW_DESC.size - 8 * ndim
    if body != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise LinkError(f"a raw message of shape {shape} {RAW_DTYPES[code]} carries {body} bytes: truncated or corrupt")
    buf = bytearray(body)
    recv_exact(sock, body, buf)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape) if body else \
        torch.empty(shape, dtype=dtype)


def tensor_bytes(x: torch.Tensor) -> memoryview:
    """The tensor's bytes in its own dtype (CPU, contiguous), without a copy."""
    return memoryview(x.contiguous().view(torch.uint8).numpy()).cast("B")


def _lanes_used(codecs) -> list[str]:
    return [lane for lane in LANES if any((c is None) == (lane == "raw") for c in codecs)]


# ------------------------------------------------------------------------------------------- sender
def sender(host: str, folder: str, encode_workers: int, timeout: float) -> dict:
    tensors, codecs = load_stream(folder)
    lanes = _lanes_used(codecs)
    socks = {lane: connect(host, PORT + LANES.index(lane), timeout) for lane in lanes}
    for s in socks.values():
        recv_exact(s, 1)                                       # the receiver is loaded and listening
    sent = {lane: 0 for lane in lanes}
    enc_s = [0.0] * len(tensors)
    pool = ThreadPoolExecutor(max(1, encode_workers), thread_name_prefix="encode")

    def encode(i):
        t = time.perf_counter()
        blob = codecs[i].encode(tensors[i])
        enc_s[i] = time.perf_counter() - t
        return blob

    def send_lane(lane, items):
        s = socks[lane]
        for i, payload in items:
            parts = payload if isinstance(payload, tuple) else (payload.result(),)  # raw: (its header, its bytes)
            n = sum(len(p) for p in parts)
            s.sendall(HEAD.pack(i, n))
            for p in parts:
                s.sendall(p)
            sent[lane] += n + HEAD.size
        s.sendall(HEAD.pack(END, 0))

    t0 = time.perf_counter()
    futures = [(i, pool.submit(encode, i)) for i, c in enumerate(codecs) if c is not None]
    raw = [(i, (raw_header(tensors[i]), tensor_bytes(tensors[i]))) for i, c in enumerate(codecs) if c is None]
    threads = [threading.Thread(target=send_lane, args=(lane, futures if lane == "coded" else raw))
               for lane in lanes]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t_sent = time.perf_counter()
    for s in socks.values():
        recv_exact(s, 1)                                       # the receiver has everything
        s.close()
    pool.shutdown()
    return {"t0": t0, "t_sent": t_sent, "bytes": sent, "encode_s": enc_s}


# ----------------------------------------------------------------------------------------- receiver
def receiver(host: str, folder: str, decode_workers: int, timeout: float) -> dict:
    tensors, codecs = load_stream(folder)
    lanes = _lanes_used(codecs)
    servers = {}
    results: list = [None] * len(tensors)
    done_t = [0.0] * len(tensors)
    dec_s = [0.0] * len(tensors)
    errors: "queue.Queue[BaseException]" = queue.Queue()
    pool = ThreadPoolExecutor(max(1, decode_workers), thread_name_prefix="decode")

    accept_threads = []
    for lane in lanes:
        th = threading.Thread(target=lambda ln=lane: servers.__setitem__(ln, listen(host, PORT + LANES.index(ln),
                                                                                      timeout)))
        th.start()
        accept_threads.append(th)
    for th in accept_threads:
        th.join()
    if set(servers) != set(lanes):
        raise LinkError(f"lanes {sorted(set(lanes) - set(servers))} never connected")

    def decode(i, blob):
        t = time.perf_counter()
        results[i] = codecs[i].decode(blob)
        done_t[i] = time.perf_counter()
        dec_s[i] = done_t[i] - t

    def recv_lane(lane):
        s = servers[lane]
        try:
            while True:
                i, n = HEAD.unpack(recv_exact(s, HEAD.size))
                if i == END:
                    return
                if lane == "raw":
                    results[i] = read_raw(s, n)
                    done_t[i] = time.perf_counter()
                else:
                    buf = bytearray(n)
                    recv_exact(s, n, buf)
                    futures.append(pool.submit(decode, i, bytes(buf)))
        except BaseException as e:   # noqa: BLE001 - handed to the main thread
            errors.put(e)

    futures: list = []
    for s in servers.values():
        s.sendall(b"r")
    threads = [threading.Thread(target=recv_lane, args=(lane,)) for lane in lanes]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for f in futures:
        f.result()
    pool.shutdown()
    if not errors.empty():
        raise errors.get()
    for s in servers.values():
        s.sendall(b"d")
    checks = []
    for i, (x, y, c) in enumerate(zip(tensors, results, codecs)):
        if c is None:
            checks.append({"i": i, "lane": "raw", "bit_exact": bool(torch.equal(x, y))})
        else:
            from shared.metrics import quality
            q = quality(x.float().numpy(), y.float().numpy())
            checks.append({"i": i, "lane": "coded", "cos_mean": q["cos_mean"], "cos_min_token": q["cos_min_token"],
                           "shape_dtype_ok": bool(y.shape == x.shape and y.dtype == x.dtype)})
    return {"t_done": done_t, "decode_s": dec_s, "checks": checks}


# ------------------------------------------------------------------------------------- both, on a link
def run_stream(link, folder: str | Path, *, encode_workers: int = 1, decode_workers: int = 1,
               timeout: float = 120, python: str = sys.executable) -> dict:
    """Receiver in namespace b, sender in namespace a; both reports merged, plus `seconds` (wall time of
    the whole stream: sender start to the last tensor ready), `bytes_on_wire` and the `checks`."""
    from shared.links import _child_env

    base = [python, "-m", "shared.transfer"]
    rx = link.popen("b", base + ["recv", link.ip_b, str(folder), str(decode_workers), str(timeout)],
                    stdout=__import__("subprocess").PIPE, stderr=__import__("subprocess").PIPE, text=True,
                    env=_child_env())
    try:
        tx = link.run("a", base + ["send", link.ip_b, str(folder), str(encode_workers), str(timeout)],
                      timeout=timeout + 30, capture_output=True, text=True, env=_child_env())
        out, err = rx.communicate(timeout=timeout + 30)
    finally:
        if rx.poll() is None:
            rx.kill()
    if tx.returncode != 0 or rx.returncode != 0:
        raise LinkError(f"stream failed: sender rc={tx.returncode} {tx.stderr.strip()[-800:]}; "
                        f"receiver rc={rx.returncode} {err.strip()[-800:]}")
    s, r = json.loads(tx.stdout.strip().splitlines()[-1]), json.loads(out.strip().splitlines()[-1])
    return {**s, **r, "seconds": max(r["t_done"]) - s["t0"], "bytes_on_wire": sum(s["bytes"].values())}


def check_summary(checks: list[dict]) -> dict:
    """{raw_bit_exact: all raw tensors equal, cos_min: the worst coded tensor's cos_mean} of a run's checks."""
    raw = [c["bit_exact"] for c in checks if c["lane"] == "raw"]
    coded = [c for c in checks if c["lane"] == "coded"]
    return {"raw_bit_exact": all(raw) if raw else None,
            "cos_min": min(c["cos_mean"] for c in coded) if coded else None,
            "shapes_ok": all(c["shape_dtype_ok"] for c in coded)}


def _main() -> None:
    ap = argparse.ArgumentParser(description="one end of a tensor stream (started by run_stream)")
    ap.add_argument("role", choices=["send", "recv"])
    ap.add_argument("host")
    ap.add_argument("folder")
    ap.add_argument("workers", type=int)
    ap.add_argument("timeout", type=float)
    a = ap.parse_args()
    torch.set_num_threads(1)
    fn = sender if a.role == "send" else receiver
    print(json.dumps(fn(a.host, a.folder, a.workers, a.timeout)))


if __name__ == "__main__":
    np.seterr(all="ignore")
    _main()

"""Fuzzing the decoder as a hostile sender would: mutated bitstreams, each decoded in a worker
process under a time and a memory limit.

    python -m shared.fuzz --cases 4000       # `make fuzz`: every CPU backend, writes results/fuzz_summary.csv
    python -m shared.fuzz --gpu-parity --cases 2000   # on a GPU: do the CPU and the CUDA decoder refuse the same?
    summary = run(BACKENDS, cases=60)        # tests/test_fuzz.py: a CI-sized run

Mutations know the container (shared.pipeline) and the rANS payload (shared.codecs.rans): header
JSON fields set to hostile values (huge, negative, NaN, wrong types, deep nesting, long integers),
chunks dropped, swapped, renamed, resized; rANS header fields (T together with the lane size, so
every section keeps its length), its meta and streams; quantizer parameters; codec payload bytes.
Each of those recomputes the CRC32s and the rANS checksum, so the mutation reaches the parser
behind them. Plain bit flips and truncations (CRCs left stale) check that CRC32 catches them.

A case's outcome: accepted (the output is then checked: finite, declared dtype and shape),
rejected with a library error (TensorCodecError), or a failure: another exception, a worker that
died, a MemoryError (the worker's address space is capped), or a hang (killed after hang_s).
Memory: the worker's peak resident memory above its level before the decode (/proc VmHWM, reset
per case), as a ratio to (declared output + blob + MEMORY_ALLOWANCE); declared output is what the
mutated header declares (4-byte values of the [T, D] tensor, plus its frames on the frame path),
or the original's where the header does not parse. Cases declaring at least 512 KiB also get the
ratio without the allowance (max_memory_ratio_large).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import multiprocessing as mp
import random
import resource
import struct
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

BACKENDS = ("rans", "zstd", "raw", "x265", "ffv1")
FUZZ_MAX_ELEMENTS = 1 << 22  # the decode limit the fuzz decodes under (values), as a caller would set it
HANG_S = 5.0  # a decode running longer is killed and counted as a hang
MEMORY_LIMIT = 2 << 30  # bytes of address space a worker may add to what it holds at start (RLIMIT_AS)
MEMORY_ALLOWANCE = 16 << 20  # bytes a decode may use beyond its output and blob (codec contexts, tables)
LARGE = 1 << 19  # cases declaring at least this many bytes (output + blob) also get a ratio without the allowance
INTERESTING_INTS = [0, -1, 1, 2, 3, 7, 8, 63, 64, 255, 256, 4095, 4096, 65535, 2**16, 2**31 - 1, 2**31, 2**32 - 1,
                    2**32, 2**40, 2**53 + 1, 2**63 - 1, 2**64, -(2**31), -(2**63)]
INTERESTING = INTERESTING_INTS + [0.0, -0.0, 0.5, -1.5, 1e-300, 1e300, 3.5e38, float("nan"), float("inf"),
                                  float("-inf"), "", "x", "float32", "int8", "bool", "complex64", "uint8",
                                  "bfloat16", "rans", "raw", "zstd", "x265", "ffv1", "per_channel",
                                  "rd_shared_step", "nvdec-hevc", None, True, False, [], {}, [1], [1, 2],
                                  [2**31, 2**31], [1, 2, 3], {"a": 1}, ["QPAR"], ["DATA", "QPAR"],
                                  ["QPAR", "DATA", "DATA"]]


# -- the container, taken apart and put back together with valid CRCs ----------------------------
def split(blob: bytes) -> tuple[bytes, list[list]]:
    """(header JSON bytes, [[tag, payload], ...]) of a well-formed bitstream."""
    (head_len,) = struct.unpack_from("<I", blob, 5)
    head = blob[9:9 + head_len]
    offset, chunks = 9 + head_len + 4, []
    while offset < len(blob):
        tag = blob[offset:offset + 4]
        (n,) = struct.unpack_from("<Q", blob, offset + 4)
        chunks.append([tag, blob[offset + 12:offset + 12 + n]])
        offset += 12 + n + 4
    return head, chunks


def assemble(head: bytes, chunks, version: int = 2, declared: dict | None = None) -> bytes:
    """A bitstream with every check right (CRC32s; the trailer 0 of a chunk the header says checks
    itself); declared: {chunk index: length field to write instead}."""
    try:
        checks = json.loads(head).get("checks") or {}
    except (ValueError, AttributeError, RecursionError):
        checks = {}
    prefix = b"TNSC" + struct.pack("<BI", version, len(head)) + head
    out = [prefix, struct.pack("<I", zlib.crc32(prefix))]
    for i, (tag, payload) in enumerate(chunks):
        n = (declared or {}).get(i, len(payload)) & (2**64 - 1)
        own = isinstance(checks, dict) and checks.get(tag.decode(errors="replace")) == "payload"
        out += [tag, struct.pack("<Q", n), payload, struct.pack("<I", 0 if own else zlib.crc32(payload))]
    return b"".join(out)


def _json(header) -> bytes:
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode()


def _paths(obj, prefix=()):
    """Every key path of a JSON object, containers included."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for k, v in items:
        yield prefix + (k,)
        yield from _paths(v, prefix + (k,))


def _set(obj, path, value, delete=False):
    for k in path[:-1]:
        obj = obj[k]
    if delete and isinstance(obj, dict):
        del obj[path[-1]]
    elif delete:
        obj.pop(path[-1])
    else:
        obj[path[-1]] = value


# -- mutations: each takes (rng, head, chunks) of a valid stream and returns a blob ----------------
def mut_header_field(rng, head, chunks):
    header = json.loads(head)
    paths = list(_paths(header))
    path = rng.choice(paths)
    r = rng.random()
    if r < 0.1:
        _set(header, path, None, delete=True)
    elif r < 0.15:
        header[rng.choice(["extra", "shape2", "x" * 40])] = rng.choice(INTERESTING)
    elif r < 0.45:  # a number moved by a little or a lot
        old = _get(header, path)
        if isinstance(old, (int, float)) and not isinstance(old, bool):
            _set(header, path, rng.choice([old + 1, old - 1, old * 2, old * 1000, -old, old // 2 if isinstance(old, int)
                                           else old / 2, old * 2**20]))
        else:
            _set(header, path, rng.choice(INTERESTING))
    else:
        _set(header, path, rng.choice(INTERESTING))
    return assemble(_json(header), chunks)


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def mut_header_raw(rng, head, chunks):
    text = head.decode()
    choice = rng.randrange(9)
    if choice == 0:
        new = rng.choice([b"", b"[]", b"1", b'"x"', b"null", b"{", b"{}", b"\xff\xfe", b"NaN"])
    elif choice == 1:
        depth = rng.choice([50, 1000, 100000])
        new = (b"[" * depth + b"]" * depth) if rng.random() < 0.5 else (b'{"a":' * depth + b"1" + b"}" * depth)
    elif choice == 2:
        new = text.replace('"shape":[', '"shape":[' + "9" * rng.choice([30, 5000]) + ",", 1).encode()
    elif choice == 3:
        new = head[:rng.randrange(len(head))]
    elif choice == 4:
        new = head + b" " * rng.randrange(1, 100) + rng.choice([b"", b"{}", b"x"])
    elif choice == 5:
        new = text.replace("}", ',"k":' + "[" * 200 + "]" * 200 + "}", 1).encode()
    elif choice == 6:  # a big but valid header
        header = json.loads(head)
        header["fallback"] = "x" * rng.choice([1000, 70000])
        new = _json(header)
    elif choice == 7:
        new = text.replace('"dtype":"', '"dtype":"\\u0000', 1).encode()
    else:
        new = head.replace(b'"', b"'", rng.randrange(1, 4))
    return assemble(new, chunks)


def mut_chunks(rng, head, chunks):
    chunks = [list(c) for c in chunks]
    choice = rng.randrange(8)
    declared = None
    i = rng.randrange(len(chunks))
    if choice == 0:
        chunks.pop(i)
    elif choice == 1:
        chunks.insert(i, list(chunks[i]))
    elif choice == 2:
        chunks.reverse()
    elif choice == 3:
        chunks[i][0] = rng.choice([b"QPAR", b"DATA", b"XXXX", b"\x00\x00\x00\x00"])
    elif choice == 4:
        chunks.append([b"EXTR", bytes(rng.randrange(64))])
    elif choice == 5:
        declared = {i: len(chunks[i][1]) + rng.choice([-1, 1, 4, -12, 2**32, 2**63, 2**64 - 1])}
    elif choice == 6:
        chunks[i][1] = chunks[i][1][:rng.randrange(len(chunks[i][1]) + 1)]
    else:
        chunks[i][1] = chunks[i][1] + rng.randbytes(rng.randrange(1, 64))
    return assemble(head, chunks, declared=declared)


def _bytes_mutated(rng, data: bytes, start: int = 0, end: int | None = None, n: int | None = None) -> bytes:
    data = bytearray(data)
    end = len(data) if end is None else min(end, len(data))
    if end <= start:
        return bytes(data)
    for _ in range(n or rng.choice([1, 1, 2, 4, 16])):
        j = rng.randrange(start, end)
        r = rng.random()
        if r < 0.4:
            data[j] ^= 1 << rng.randrange(8)
        elif r < 0.7:
            data[j] = rng.choice([0, 1, 0x7F, 0x80, 0xFF])
        else:
            data[j] = rng.randrange(256)
    return bytes(data)


def _rans_fix(payload: bytes) -> bytes:
    """The rANS payload with its checksum recomputed (so a mutation reaches the parser)."""
    from .codecs import rans

    if len(payload) < rans.HEADER.size:
        return payload
    mv = memoryview(payload)
    c0, c1 = rans.checksum(mv[:rans.CHECKED_HEADER_BYTES], mv[rans.HEADER.size:])
    return bytes(payload[:rans.CHECKED_HEADER_BYTES]) + struct.pack("<II", c0, c1) + bytes(payload[rans.HEADER.size:])


RANS_FIELDS = ("magic", "version", "prob_bits", "G", "T", "K", "S", "n_table", "n_escapes", "k_coded", "n_param",
               "lo_bytes", "w_bytes", "flags", "stream_words")


def mut_rans_field(rng, head, chunks):
    from .codecs import rans

    data_i = [c[0] for c in chunks].index(b"DATA")
    payload = chunks[data_i][1]
    fields = list(rans.HEADER.unpack(payload[:rans.HEADER.size]))
    limits = [None, 255, 255, 65535] + [2**32 - 1] * 7 + [255, 255, 65535, 2**64 - 1]
    r = rng.random()
    if r < 0.35:  # T and the lane size raised together: every section keeps its length
        f = rng.choice([2, 16, 1000, 2**16, 2**20])
        fields[4] = min(fields[4] * f, 2**32 - 1)
        fields[6] = min(fields[6] * f, 2**32 - 1)
    else:
        i = rng.randrange(1, len(RANS_FIELDS))
        v = rng.choice(INTERESTING_INTS + [fields[i] + 1, fields[i] - 1, fields[i] * 2])
        fields[i] = max(0, min(int(v), limits[i]))
    if rng.random() < 0.05:
        fields[0] = rng.choice([b"TRNX", b"\0\0\0\0"])
    new = rans.HEADER.pack(*fields) + payload[rans.HEADER.size:]
    chunks = [list(c) for c in chunks]
    chunks[data_i][1] = _rans_fix(new)
    return assemble(head, chunks)


def mut_rans_consistent(rng, head, chunks):
    """What a careful attacker sends: the container's T and the rANS payload's T (with its lane
    size, so every section keeps its length) raised together; the payload stays self-consistent."""
    from .codecs import rans

    header = json.loads(head)
    data_i = [c[0] for c in chunks].index(b"DATA")
    payload = chunks[data_i][1]
    fields = list(rans.HEADER.unpack(payload[:rans.HEADER.size]))
    f = rng.choice([2, 4, 16, 64, 1024])
    fields[4], fields[6] = fields[4] * f, fields[6] * f
    header["shape"][0] = fields[4]
    chunks = [list(c) for c in chunks]
    chunks[data_i][1] = _rans_fix(rans.HEADER.pack(*fields) + payload[rans.HEADER.size:])
    return assemble(_json(header), chunks)


def mut_data_bytes(rng, head, chunks):
    """Bytes of the codec payload changed, CRC32 (and a rANS payload's checksum) recomputed."""
    from .codecs import rans

    header = json.loads(head)
    data_i = [c[0] for c in chunks].index(b"DATA")
    payload = chunks[data_i][1]
    is_rans = header.get("codec", {}).get("id") == "rans"
    if is_rans and rng.random() < 0.6:  # the meta: tables, windows, group lengths, escapes, states
        lay = rans.read_header(payload).layout
        new = _bytes_mutated(rng, payload, rans.HEADER.size, lay.streams)
    elif rng.random() < 0.3:  # the first bytes: zstd frame header, HEVC parameter sets, FFV1 lengths
        new = _bytes_mutated(rng, payload, 0, 64 if not is_rans else len(payload))
    elif rng.random() < 0.2 and len(payload) > 4:  # truncated or extended inside
        cut = rng.randrange(len(payload))
        new = payload[:cut] if rng.random() < 0.5 else payload + rng.randbytes(rng.randrange(1, 4096))
    else:
        new = _bytes_mutated(rng, payload)
    chunks = [list(c) for c in chunks]
    chunks[data_i][1] = _rans_fix(new) if is_rans else new
    return assemble(head, chunks)


def mut_qpar(rng, head, chunks):
    qi = [c[0] for c in chunks].index(b"QPAR")
    q = bytearray(chunks[qi][1])
    hostile = [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-300, 1e300, 3.4e38, 1e-45, 1e30]
    if q[:4] == b"RDQ1":
        r = rng.random()
        if r < 0.6:
            struct.pack_into("<d", q, 4, rng.choice(hostile))
        elif r < 0.8:
            struct.pack_into("<I", q, 12, rng.choice(INTERESTING_INTS) & 0xFFFFFFFF)
        else:
            q[16] = rng.choice([0, 1, 2, 255])
    else:
        k = struct.unpack_from("<I", q, 1)[0]
        r = rng.random()
        if r < 0.15:
            q[0] = rng.choice([0, 1, 7, 9, 16, 17, 255])
        elif r < 0.3:
            struct.pack_into("<I", q, 1, rng.choice(INTERESTING_INTS) & 0xFFFFFFFF)
        else:
            for _ in range(rng.choice([1, 1, 3])):
                j = rng.randrange(2 * k)
                struct.pack_into("<f", q, 5 + 4 * j, rng.choice([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e38,
                                                                 -3.4e38, 1e-45, 1e20]))
    chunks = [list(c) for c in chunks]
    chunks[qi][1] = bytes(q)
    return assemble(head, chunks)


def mut_version(rng, head, chunks):
    return assemble(head, chunks, version=rng.choice([0, 2, 3, 200, 255]))


BOMBS: dict[str, list[bytes]] = {}  # per backend: payloads that decode to far more than a header declares


def make_bombs() -> dict[str, list[bytes]]:
    """Codec payloads a hostile sender would craft: a zstd frame of 1 GiB of zeros (its size
    declared, and not), HEVC streams of 1000 frames or of 4096 x 4096 frames, an FFV1 stream whose
    packet repeats 1000 times."""
    import zstandard

    from .codecs import get_backend

    bombs = {}
    size, block = 1 << 30, bytes(1 << 20)
    for declared in (True, False):
        cobj = zstandard.ZstdCompressor(level=1).compressobj(size=size if declared else -1)
        bombs.setdefault("zstd", []).append(b"".join([cobj.compress(block) for _ in range(size >> 20)] + [cobj.flush()]))
    for n, side in ((1000, 64), (1, 4096)):
        with get_backend("x265").encoder(side, side, qp=51, preset="ultrafast") as enc:
            enc.submit(np.zeros((n, 3, side, side), np.uint8))
            bombs.setdefault("x265", []).append(enc.flush())
    with get_backend("ffv1").encoder(64, 64) as enc:
        enc.submit(np.zeros((1, 3, 64, 64), np.uint8))
        records = enc.flush()
    (n0,) = struct.unpack_from("<I", records, 0)
    first = records[4 + n0:]
    bombs["ffv1"] = [records[:4 + n0] + first * 1000]
    return bombs


def mut_bomb(rng, head, chunks, backend):
    chunks = [list(c) for c in chunks]
    data_i = [c[0] for c in chunks].index(b"DATA")
    chunks[data_i][1] = rng.choice(BOMBS[backend])
    return assemble(head, chunks)


def mut_bitflip(rng, blob):
    return _bytes_mutated(rng, blob, n=rng.choice([1, 1, 2, 8]))


def mut_truncate(rng, blob):
    r = rng.random()
    if r < 0.7:
        return blob[:rng.randrange(len(blob))]
    if r < 0.85:
        return blob + rng.randbytes(rng.randrange(1, 256))
    return b"TNSC" + rng.randbytes(rng.randrange(0, 64))


STRUCTURED = [(mut_header_field, 25), (mut_header_raw, 8), (mut_chunks, 10), (mut_qpar, 10), (mut_data_bytes, 20),
              (mut_version, 2)]
RAW = [(mut_bitflip, 8), (mut_truncate, 5)]
RANS_ONLY = [(mut_rans_field, 25), (mut_rans_consistent, 10)]


def mutate(rng: random.Random, blob: bytes, backend: str) -> tuple[str, bytes]:
    """One mutant of a valid bitstream: (mutation name, blob)."""
    table = STRUCTURED + RAW + (RANS_ONLY if backend == "rans" else []) + ([(mut_bomb, 4)] if backend in BOMBS else [])
    fn = rng.choices([f for f, _ in table], [w for _, w in table])[0]
    if fn is mut_bomb:
        return fn.__name__, mut_bomb(rng, *split(blob), backend)
    if fn in (mut_bitflip, mut_truncate):
        return fn.__name__, fn(rng, blob)
    out = fn(rng, *split(blob))
    if rng.random() < 0.1:  # havoc: a second structured mutation on top, when the first left a parseable stream
        try:
            head, chunks = split(out)
            json.loads(head)
            fn2 = rng.choice([f for f, _ in STRUCTURED])
            return f"{fn.__name__}+{fn2.__name__}", fn2(rng, head, chunks)
        except Exception:  # noqa: BLE001 - the first mutant is not well-formed enough to stack on
            pass
    return fn.__name__, out


# -- valid streams to start from ------------------------------------------------------------------
@dataclass
class Seed:
    backend: str
    name: str
    codec: object  # the TensorCodec that decodes it
    blob: bytes
    out_bytes: int  # bytes of its decoded float32 tensor


def make_seeds(backends=BACKENDS) -> list[Seed]:
    """A few valid bitstreams per backend: with and without a basis, one token, a constant tensor."""
    import torch

    from .basis import fit_basis
    from .pipeline import TensorCodec

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4096, 48)) * np.linspace(2, 0.1, 48)).astype(np.float32)
    basis = fit_basis([x], k=16)
    tensors = {"t256": torch.from_numpy(x[:256].copy()), "t1": torch.from_numpy(x[:1].copy()),
               "t4096": torch.from_numpy(x),
               "const": torch.full((40, 48), 0.5), "bf16": torch.from_numpy(x[:100]).to(torch.bfloat16)}
    seeds = []
    for backend in backends:
        for name, t in tensors.items():
            for b in (None, basis):
                if backend == "rans":
                    enc = TensorCodec(b, backend="rans", target_cos=0.999 if name != "bf16" else 0.99)
                elif backend == "x265":
                    enc = TensorCodec(b, backend="x265", frame_size=64, qp=20, preset="ultrafast")
                else:
                    enc = TensorCodec(b, backend=backend, frame_size=64)
                try:
                    blob = enc.encode(t)
                except Exception:  # noqa: BLE001 - e.g. a target the truncated basis cannot reach
                    continue
                dec = TensorCodec(b, backend="rans", step=1.0) if backend == "rans" else TensorCodec(b, backend="raw")
                seeds.append(Seed(backend, f"{name}{'_basis' if b else ''}", dec, blob, 4 * t.numel()))
    return seeds


def declared_bytes(blob: bytes, seed: Seed) -> int:
    """Output bytes the (mutated) header declares: 4 per value, plus its frames; else the seed's."""
    try:
        head, _ = split(blob)
        h = json.loads(head)
        T, D = (int(v) for v in h["shape"])
        out = 4 * T * D
        if isinstance(h.get("frames"), dict):
            from .frames import FrameLayout

            out += FrameLayout(**{k: int(h["frames"][k]) for k in ("tokens", "channels", "height", "width")}
                               ).n_frames * 3 * int(h["frames"]["height"]) * int(h["frames"]["width"])
        return out if 0 < out < 2**62 else seed.out_bytes
    except Exception:  # noqa: BLE001 - an unparseable header declares nothing
        return seed.out_bytes


# -- the worker: decodes one case at a time under the limits --------------------------------------
def _rss(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name):
                return int(line.split()[1]) * 1024
    return 0


def _worker(conn, seeds, max_elements, memory_limit):
    import torch

    from .errors import BitstreamError, TensorCodecError

    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: big buffers come from mmap and go back on free
    for s in seeds:  # warm: libraries loaded, codec contexts made once
        s.codec.decode(s.blob)
    vm = _rss("VmSize:")
    resource.setrlimit(resource.RLIMIT_AS, (vm + memory_limit, resource.RLIM_INFINITY))
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        i, blob = msg
        seed = seeds[i]
        libc.malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
        except OSError:
            pass
        base = _rss("VmRSS:")
        t0 = time.perf_counter()
        res = {"error": None, "library": True, "bitstream": True, "finite": True, "typed": True}
        try:
            out = seed.codec.decode(blob, max_elements=max_elements)
            res["outcome"] = "accepted"
            h = json.loads(split(blob)[0])
            res["finite"] = bool(torch.isfinite(out).all())
            res["typed"] = str(out.dtype) == f"torch.{h['dtype']}" and list(out.shape) == h["shape"]
        except TensorCodecError as e:
            res.update(outcome="rejected", error=f"{type(e).__name__}: {str(e)[:160]}",
                       bitstream=isinstance(e, BitstreamError))
        except MemoryError as e:
            res.update(outcome="memory", error=f"MemoryError: {str(e)[:160]}", library=False)
        except BaseException as e:  # noqa: BLE001 - this is what the fuzz looks for
            res.update(outcome="exception", error=f"{type(e).__name__}: {str(e)[:160]}", library=False)
        res["seconds"] = time.perf_counter() - t0
        res["peak"] = max(0, _rss("VmHWM:") - base)
        conn.send(res)


class Pool:
    """One worker process (forked, so it holds the seeds' codecs), restarted after a hang or a death."""

    def __init__(self, seeds, max_elements=FUZZ_MAX_ELEMENTS, memory_limit=MEMORY_LIMIT):
        self.args = (seeds, max_elements, memory_limit)
        self.proc = None

    def _start(self):
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, *self.args), daemon=True)
        self.proc.start()
        child.close()

    def decode(self, i: int, blob: bytes, timeout: float) -> dict:
        if self.proc is None or not self.proc.is_alive():
            self._start()
            if not self.conn.poll(120) or self.conn.recv() != "ready":  # the warm-up decodes
                raise RuntimeError("fuzz worker did not start")
        self.conn.send((i, blob))
        if self.conn.poll(timeout):
            try:
                return self.conn.recv()
            except EOFError:
                pass
        else:
            self.stop()
            return {"outcome": "hang", "error": f"no answer in {timeout} s", "library": False, "bitstream": False,
                    "finite": True, "typed": True, "seconds": timeout, "peak": 0}
        code = self.proc.exitcode if self.proc is not None else None
        self.stop()
        return {"outcome": "died", "error": f"worker died (exit code {code})", "library": False, "bitstream": False,
                "finite": True, "typed": True, "seconds": 0.0, "peak": 0}

    def stop(self):
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()  # the worker this pool started, by its own handle
        if self.proc is not None:
            self.proc.join(5)
        self.proc = None


@dataclass
class Summary:
    backend: str
    cases: int = 0
    accepted: int = 0
    rejected_bitstream: int = 0
    rejected_other_library: int = 0
    non_library_exceptions: int = 0
    memory_errors: int = 0
    worker_deaths: int = 0
    hangs: int = 0
    non_finite_outputs: int = 0
    wrong_dtype_or_shape: int = 0
    stale_crc_accepted_changed: int = 0
    max_decode_s: float = 0.0
    max_peak_mib: float = 0.0
    max_memory_ratio: float = 0.0
    max_memory_ratio_large: float = 0.0  # peak / (declared output + blob), no allowance, where those are >= 512 KiB
    failures: list = field(default_factory=list)
    other_errors: list = field(default_factory=list)  # library errors that are not BitstreamError

    def failed(self) -> int:
        return (self.non_library_exceptions + self.memory_errors + self.worker_deaths + self.hangs
                + self.non_finite_outputs + self.wrong_dtype_or_shape)


def run(backends=BACKENDS, cases: int = 100, seed: int = 0, hang_s: float = HANG_S, progress: bool = False,
        max_elements: int = FUZZ_MAX_ELEMENTS) -> dict[str, Summary]:
    """`cases` mutants per backend, decoded one by one in a worker; a Summary per backend."""
    seeds = make_seeds(backends)
    if not BOMBS:
        BOMBS.update(make_bombs())
    pool = Pool(seeds, max_elements)
    summaries = {b: Summary(b) for b in backends}
    rng = random.Random(seed)
    order = [b for _ in range(cases) for b in backends]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(order), desc="fuzz cases", unit="case")
    try:
        for backend in order:
            choices = [i for i, s in enumerate(seeds) if s.backend == backend]
            i = rng.choice(choices)
            kind, blob = mutate(rng, seeds[i].blob, backend)
            res = pool.decode(i, blob, timeout=hang_s)
            _tally(summaries[backend], kind, blob, seeds[i], res)
            if bar is not None:
                bar.update()
    finally:
        pool.stop()
        if bar is not None:
            bar.close()
    return summaries


def _tally(s: Summary, kind: str, blob: bytes, seed: Seed, res: dict) -> None:
    s.cases += 1
    outcome = res["outcome"]
    bad = None
    if outcome == "accepted":
        s.accepted += 1
        if not res["finite"]:
            s.non_finite_outputs += 1
            bad = "non-finite output"
        if not res["typed"]:
            s.wrong_dtype_or_shape += 1
            bad = "output of another dtype or shape than declared"
        if kind in ("mut_bitflip", "mut_truncate") and blob != seed.blob:
            s.stale_crc_accepted_changed += 1
    elif outcome == "rejected":
        if res["bitstream"]:
            s.rejected_bitstream += 1
        else:
            s.rejected_other_library += 1
            if len(s.other_errors) < 5:
                s.other_errors.append((kind, seed.name, res["error"]))
    elif outcome == "memory":
        s.memory_errors += 1
        bad = res["error"]
    elif outcome == "hang":
        s.hangs += 1
        bad = res["error"]
    elif outcome == "died":
        s.worker_deaths += 1
        bad = res["error"]
    else:
        s.non_library_exceptions += 1
        bad = res["error"]
    s.max_decode_s = max(s.max_decode_s, res["seconds"])
    s.max_peak_mib = max(s.max_peak_mib, res["peak"] / 2**20)
    ratio = res["peak"] / (declared_bytes(blob, seed) + len(blob) + MEMORY_ALLOWANCE)
    s.max_memory_ratio = max(s.max_memory_ratio, ratio)
    size = declared_bytes(blob, seed) + len(blob)
    if size >= LARGE:
        s.max_memory_ratio_large = max(s.max_memory_ratio_large, res["peak"] / size)
    if bad is not None and len(s.failures) < 20:
        s.failures.append((kind, seed.name, bad))


METRICS = [("cases", "cases"), ("accepted", "cases"), ("rejected_bitstream", "cases"),
           ("rejected_other_library", "cases"), ("non_library_exceptions", "cases"), ("memory_errors", "cases"),
           ("worker_deaths", "cases"), ("hangs", "cases"), ("non_finite_outputs", "cases"),
           ("wrong_dtype_or_shape", "cases"), ("stale_crc_accepted_changed", "cases"), ("max_decode_s", "s"),
           ("max_peak_mib", "MiB"), ("max_memory_ratio", "x"), ("max_memory_ratio_large", "x")]


def _outcome(fn):
    """('accepted', output) / ('refused', message) / ('error', message) of one decode."""
    from .errors import TensorCodecError

    try:
        return "accepted", fn()
    except TensorCodecError as e:
        return "refused", f"{type(e).__name__}: {str(e)[:160]}"
    except Exception as e:  # noqa: BLE001 - what the comparison looks for
        return "error", f"{type(e).__name__}: {str(e)[:160]}"


def gpu_parity(cases: int = 2000, seed: int = 0, max_elements: int = FUZZ_MAX_ELEMENTS) -> dict:
    """rANS mutants decoded by the CPU and by the CUDA path (`decode(blob, device="cuda")`), in
    this process: do both refuse the same ones? Stops at the first non-library GPU error (a CUDA
    fault can leave the context unusable)."""
    import torch

    from .errors import BackendUnavailable

    if not torch.cuda.is_available():
        raise BackendUnavailable("the GPU parity run needs a CUDA GPU; on this machine run `make fuzz`")
    seeds = make_seeds(("rans",))
    rng = random.Random(seed)
    n = dict(cases=0, both_refused=0, both_accepted=0, cpu_only_refused=0, gpu_only_refused=0,
             cpu_non_library=0, gpu_non_library=0, gpu_non_finite=0)
    examples = []
    for _ in range(cases):
        i = rng.randrange(len(seeds))
        kind, blob = mutate(rng, seeds[i].blob, "rans")
        codec = seeds[i].codec
        cpu, cpu_v = _outcome(lambda: codec.decode(blob, max_elements=max_elements))

        def on_gpu():
            out = codec.decode(blob, device="cuda", max_elements=max_elements)
            torch.cuda.synchronize()
            return out

        gpu, gpu_v = _outcome(on_gpu)
        n["cases"] += 1
        if cpu == "error" or gpu == "error":
            n["cpu_non_library" if cpu == "error" else "gpu_non_library"] += 1
            examples.append((kind, seeds[i].name, cpu_v if cpu == "error" else gpu_v))
            if gpu == "error":
                break
            continue
        if cpu == gpu:
            n["both_refused" if cpu == "refused" else "both_accepted"] += 1
        else:
            n["cpu_only_refused" if cpu == "refused" else "gpu_only_refused"] += 1
            if len(examples) < 20:
                examples.append((kind, seeds[i].name, f"cpu {cpu}: {cpu_v if cpu == 'refused' else ''} / "
                                                      f"gpu {gpu}: {gpu_v if gpu == 'refused' else ''}"))
        if gpu == "accepted" and not bool(torch.isfinite(gpu_v).all()):
            n["gpu_non_finite"] += 1
    return dict(n, examples=examples)


def main_gpu_parity(cases: int, seed: int) -> None:
    from .results import ResultsWriter

    t0 = time.time()
    r = gpu_parity(cases, seed)
    res = ResultsWriter("fuzz", "gpu_parity", gpu=True)
    for metric, value in r.items():
        if metric != "examples":
            res.add(backend="rans", metric=metric, value=value, unit="cases", cases=cases, fuzz_seed=seed,
                    max_elements=FUZZ_MAX_ELEMENTS)
    print({k: v for k, v in r.items() if k != "examples"})
    for e in r["examples"]:
        print("   ", *e)
    res.save()
    print(f"{r['cases']} cases in {time.time() - t0:.0f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=2000, help="mutants per backend")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--hang-s", type=float, default=HANG_S)
    ap.add_argument("--quick", action="store_true", help="100 mutants per backend")
    ap.add_argument("--gpu-parity", action="store_true", help="rANS mutants through the CPU and the CUDA decoder "
                    "(needs a GPU; writes results/fuzz_gpu_parity.csv)")
    args = ap.parse_args()
    if args.gpu_parity:
        return main_gpu_parity(100 if args.quick else args.cases, args.seed)
    backends = tuple(args.backends.split(","))
    cases = 100 if args.quick else args.cases
    t0 = time.time()
    summaries = run(backends, cases, args.seed, args.hang_s, progress=True)
    from .results import ResultsWriter

    res = ResultsWriter("fuzz", "summary")
    for s in summaries.values():
        for metric, unit in METRICS:
            res.add(backend=s.backend, metric=metric, value=getattr(s, metric), unit=unit, device="cpu",
                    cases_per_backend=cases, fuzz_seed=args.seed, max_elements=FUZZ_MAX_ELEMENTS, hang_s=args.hang_s,
                    memory_limit_mib=MEMORY_LIMIT >> 20, memory_allowance_mib=MEMORY_ALLOWANCE >> 20)
        print(f"{s.backend:5s} cases {s.cases}  accepted {s.accepted}  rejected {s.rejected_bitstream}"
              f"+{s.rejected_other_library}  failures {s.failed()}  max {s.max_decode_s:.2f} s  "
              f"{s.max_peak_mib:.1f} MiB  ratio {s.max_memory_ratio:.2f} ({s.max_memory_ratio_large:.1f} "
              "without the allowance, outputs >= 512 KiB)")
        for f in s.failures + s.other_errors:
            print("   ", *f)
    if not args.quick:
        res.save()
    print(f"{sum(s.cases for s in summaries.values())} cases in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()

"""The batched calls: encode_many / encode_many_async / decode_many code a list of tensors (a model's
layers, a decode step's KV) with one codec each, in one call. Each decides once which path a list takes:
a CUDA graph replayed (shared/cuda_graphs.py), the GPU launches (shared/launches.py), or each codec's own
host path. Layering: shared/launches.py.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import schema
from .codecs import require_cuda
from .codecs.rans import read_header as read_rans_header
from .container import PREFIX_READ, _is_tensor, parse_resident, unpack
from .cuda_graphs import (DECODE_GRAPHS, ENCODE_GRAPHS, DecodeGraph, EncodeGraph, decode_graph_key, decode_graph_plan,
                          graph_key, graph_plan, mode_key)
from .errors import BitstreamError, ConfigurationError
from .launches import DecodeJob, decode_symbols_cuda, encode_launch

if TYPE_CHECKING:
    from .codecs import rans_cuda

_SYMBOLS = operator.attrgetter("symbols")

def to_output(values: np.ndarray, header: dict):
    """The decoded values as a torch tensor of the header's dtype and shape, checked finite."""
    import torch

    out = torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(getattr(torch, header["dtype"]))
    if list(out.shape) != header["shape"]:
        raise BitstreamError(f"decoded shape {tuple(out.shape)} differs from header field 'shape' {header['shape']}")
    if not bool(torch.isfinite(out).all()):
        raise BitstreamError(f"decoded values are not finite in {header['dtype']} (chunk 'QPAR' or 'DATA' holds "
                             "out-of-range parameters): the bitstream is corrupt")
    return out


def _on_stream(stream):
    """A context running work on `stream` after what the current stream has queued (its inputs)."""
    import contextlib

    import torch

    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    return torch.cuda.stream(stream)


def encode_many(codecs, tensors, stream=None) -> Sequence:
    """Code tensors[i] with codecs[i] (e.g. every layer's K and V of one step, each layer's codec
    holding its basis and step): a sequence of one blob per tensor, each decodable and checked
    alone. CUDA tensors on the compute codec are coded on their GPU, tensors of one shape together
    in one launch per kernel, with one host synchronization for the whole list, and come back as
    uint8 CUDA tensors (views into one buffer); the rest as bytes. When every tensor is coded on a
    GPU, the sequence is a rans_cuda.Containers: those views, each made when first indexed, whose
    `buffer` and `spans` a transport can send whole and decode_many reads directly.

    stream: a torch.cuda.Stream to queue the GPU work on (it first waits for the current stream,
    which made the inputs); the host synchronization then waits for that stream alone.
    encode_many_async is the same call without the host synchronization.

    A list of codecs and shapes seen again (a decode step's KV, a pipeline stage's activations)
    of up to cuda_graphs.GRAPH_MAX_BYTES is replayed as one CUDA graph: one launch for every kernel, inputs
    read in place, the blobs copied out of the graph's buffers."""
    return _encode_many(codecs, tensors, stream, sync=True)


def encode_many_async(codecs, tensors, stream=None) -> "rans_cuda.PendingEncode":
    """encode_many without any host synchronization (every tensor a CUDA tensor on the compute
    codec): a rans_cuda.PendingEncode whose buffer and spans (start, length of each container, on the
    device) can be sent as they are, and whose result() gives the blobs, waiting for this call's work
    alone (not for calls queued after it). Calls queued this way run back to back on the GPU while the
    host prepares the next or reads an earlier one's result (a pipeline's steady state); keep each
    call's inputs unchanged until its work has run. A list seen again replays a CUDA graph of its own
    (int32 symbols and escape room for every value, as the eager call codes them), its outputs copied
    out on the stream."""
    return _encode_many(codecs, tensors, stream, sync=False)


def _encode_many(codecs, tensors, stream, sync: bool):
    if len(codecs) != len(tensors):
        raise ConfigurationError(f"{len(codecs)} codecs for {len(tensors)} tensors: give one codec per tensor")
    if not tensors:
        if not sync:
            raise ConfigurationError("encode_many_async needs at least one tensor (it returns one PendingEncode)")
        return []
    if stream is None:  # a list seen before: its graph, before any other work (the key pins every check)
        plan = ENCODE_GRAPHS.get(mode_key(graph_key(codecs, tensors), sync))
        if isinstance(plan, EncodeGraph):
            return plan.run(tensors) if sync else plan.queue(tensors)
    # the common case (every tensor on a GPU, every codec a compute codec) without a Python loop over the list
    everything = all(map(_SYMBOLS, codecs)) and all(getattr(x, "is_cuda", False) for x in tensors)
    if not sync and not everything:
        raise ConfigurationError("encode_many_async needs every tensor on a GPU and every codec a compute codec "
                                 "(backend='rans'); encode the others with encode_many")
    if everything:
        cs, xs = list(codecs), list(tensors)
    else:
        out = [None] * len(tensors)
        gpu = [i for i, (c, x) in enumerate(zip(codecs, tensors)) if c.symbols and getattr(x, "is_cuda", False)]
        for i in sorted(set(range(len(tensors))) - set(gpu)):
            out[i] = codecs[i].encode(tensors[i])
        if not gpu:
            return out
        cs, xs = [codecs[i] for i in gpu], [tensors[i] for i in gpu]
    with _on_stream(stream):
        key = mode_key(graph_key(cs, xs), sync)
        plan = ENCODE_GRAPHS.get(key)
        if not isinstance(plan, EncodeGraph):  # a repeat skips the checks: the key pins every codec and shape
            prepared = [c._cuda_prepare(x) for c, x in zip(cs, xs)]
            if key is not None:  # a first call makes the codecs' projections (and quantizers): part of the key
                key = mode_key(graph_key(cs, xs), sync)
            plan = graph_plan(key, cs, xs, prepared)
        if plan is not None and not sync:
            return plan.queue(xs)
        if plan is not None:
            blobs = plan.run(xs)
        else:
            # sync=False: int32 symbols, so that no container needs coding again after its spans are sent
            pending = encode_launch(cs, xs, prepared, sync=sync, narrow=sync)
            if not sync:
                pending.queue_summary_read(event=True)  # result() waits for this call's work alone
                return pending
            blobs = pending.result()
    if everything:  # a rans_cuda.Containers: views made as they are indexed
        return blobs
    for i, blob in zip(gpu, blobs):
        out[i] = blob
    return out


def decode_many(codecs, blobs, device=None, max_elements: int = schema.DEFAULT_MAX_ELEMENTS) -> Sequence:
    """decode() of blobs[i] with codecs[i]. With device="cuda", compute-codec containers are
    decoded on the GPU, payloads of one shape together in one launch per kernel: containers
    already there are read in place (their headers reach the host in one copy for the whole
    list), containers on the host go over through pinned memory; one host synchronization checks
    every payload at the end and names a corrupt one by its index.

    A list of codecs decoded again (GPU-resident containers of one shape, bf16, up to
    cuda_graphs.GRAPH_MAX_BYTES of output) replays one CUDA graph from its third call on, with no header read:
    each container is held on the GPU against the one the host checked when the graph was made
    (rans_cuda.SlotDecoder), and one that differs or is corrupt is decoded here again, on the host path.
    A replayed call returns a Tensors (views made when indexed, all of them as `stacked`), else a list."""
    import torch

    if len(codecs) != len(blobs):
        raise ConfigurationError(f"{len(codecs)} codecs for {len(blobs)} blobs: give one codec per blob")
    on_gpu = device is not None and str(device).startswith("cuda")
    if on_gpu:
        require_cuda(f"decode(device={str(device)!r})", device)
    key = decode_graph_key(codecs, blobs, device, max_elements) if on_gpu else None
    plan = DECODE_GRAPHS.get(key)
    if isinstance(plan, DecodeGraph):
        values = plan.run(blobs)
        if values is not None:
            return values
        # a container differs from the one the graph checked, is corrupt, or does not fit its slots:
        # the host path decodes the list (and names a corrupt one), and a graph is made again from it
        DECODE_GRAPHS.pop(key)
    resident = [i for i, b in enumerate(blobs) if on_gpu and _is_tensor(b) and b.is_cuda]
    heads = {}
    if resident:  # every resident container's first bytes, in one device->host copy
        lens = [min(blobs[i].numel(), PREFIX_READ) for i in resident]
        host = torch.cat([blobs[i][:n] for i, n in zip(resident, lens)]).cpu().numpy().tobytes()
        starts = np.cumsum([0] + lens)
        heads = {i: host[starts[j]:starts[j + 1]] for j, i in enumerate(resident)}
    out, jobs = [None] * len(blobs), []  # DecodeJob of each container decoded on the GPU
    for i, (codec, blob) in enumerate(zip(codecs, blobs)):
        if i in heads:
            header, spans = parse_resident(blob, heads[i], blob.numel(), max_elements)
            (qa, qb), (a, b) = spans.get("QPAR", (0, 0)), spans["DATA"]
            if header["quant"]["kind"] == "rd_shared_step" and a + 64 <= len(heads[i]) and qb <= len(heads[i]):
                inner = schema.check_chunks(header, {"QPAR": heads[i][qa:qb], "DATA": heads[i][a:a + 64]},
                                            data_len=b - a, read_inner=read_rans_header)  # as its decoder checks it
                jobs.append(DecodeJob(i, header, heads[i][qa:qb], blob[a:b], heads[i][a:a + 64], inner, heads[i][:a]))
                continue
        header, chunks = unpack(blob, max_elements)
        if on_gpu and header["quant"]["kind"] == "rd_shared_step":
            from .codecs import rans_cuda

            data = chunks["DATA"]
            jobs.append(DecodeJob(i, header, chunks["QPAR"], rans_cuda.pinned(data).to(device, non_blocking=True),
                                  data[:64], None, None))
        else:
            values = codec._decode_symbols_bf16(header, chunks)
            values = to_output(codec.decode_values(header, chunks), header) if values is None else values
            out[i] = values if device is None else values.to(device)
    if jobs:
        decode_symbols_cuda(codecs, jobs, out)
        decode_graph_plan(key, codecs, blobs, jobs)
    return out

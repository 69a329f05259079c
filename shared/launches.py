"""The compute codec's GPU launches, and the records they pass along: a list of CUDA tensors projected,
quantized and rANS-coded with one launch per kernel for each group of one shape (encode_launch), and
compute-codec payloads decoded and reconstructed on their GPU (decode_symbols_cuda).

The modules of the codec import one another in one direction:
  container (the bitstream format) <- launches (this file) <- cuda_graphs (the same launches captured
  as CUDA graphs and replayed; StagedDecode) <- batched (encode_many / decode_many: which path a call
  takes) <- pipeline (FrameCodec, ComputeCodec, and the TensorCodec facade that chooses between them).
The launches take codec objects and call their methods (_projection, _check_basis, lane_order); they
never import the codec classes. torch, and rdquant and codecs.rans_cuda (which bring numba and triton),
are imported inside the functions that use them, so `import shared.pipeline` stays quick where only the
frame path is used.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import schema
from .errors import BitstreamError, InvalidTensorError

DTYPES = set(schema.FLOAT_DTYPES)

class Prepared(NamedTuple):
    """A CUDA tensor checked and its codec readied for encode_many (TensorCodec._cuda_prepare)."""
    projection: object  # rdquant.CudaProjection of the codec's basis on the tensor's GPU
    quantizer: object  # the codec's rdquant.RDQuantizer (its step)
    front: bytes  # the container's bytes before its payload, for a payload of length 0


class DecodeJob(NamedTuple):
    """A compute-codec container decode_many decodes on the GPU."""
    index: int  # its place in the caller's list
    header: dict  # the container's header
    qpar: bytes  # its QPAR chunk (the quantizer)
    payload: object  # its DATA chunk, a uint8 CUDA tensor
    payload_head: bytes  # the payload's first 64 bytes (its own header)
    inner: object  # the payload's parsed header (rans_cuda), or None where the container came from the host
    front: bytes | None  # the container's bytes before its payload (GPU-resident containers), else None


class StagedJob(NamedTuple):
    """A container of a StagedDecode, checked on the host."""
    index: int
    inner: object  # the payload's parsed header
    offset: int  # where its payload starts in the staging buffer
    step: float  # its quantizer's step
    projection: object  # rdquant.CudaProjection of its codec's basis


def dtype_name(x) -> str:
    if not (isinstance(x, np.ndarray) or (hasattr(x, "detach") and hasattr(x, "dtype"))):
        raise InvalidTensorError(f"cannot code a {type(x).__name__}: pass a torch.Tensor or numpy.ndarray "
                                 f"[tokens, channels] of a float dtype ({', '.join(sorted(DTYPES))})")
    name = str(x.dtype).replace("torch.", "")
    if name not in DTYPES:
        raise InvalidTensorError(f"dtype {name} is not supported: pass a float tensor ({', '.join(sorted(DTYPES))})")
    return name


class StackedProjection(NamedTuple):
    """One CudaProjection over several same-shape bases (stacked_projection), with the ones it was made from."""
    parts: list  # the codecs' CudaProjections: held, so their ids (the key) stay unique
    stacked: object  # rdquant.CudaProjection of all of them


_STACKED = {}  # codecs' ids -> StackedProjection, for codec lists coded together (a model's layers)


def stacked_projection(projs):
    """One CudaProjection over several same-shape bases, kept while the same codecs code together
    (and by a CUDA graph captured with it)."""
    from .codecs.rans_cuda import held_by_capture
    from .rdquant import CudaProjection

    key = tuple(id(p) for p in projs)
    if key not in _STACKED:
        if len(_STACKED) >= 16:
            _STACKED.pop(next(iter(_STACKED)))
        _STACKED[key] = StackedProjection(projs, CudaProjection.stack(projs))  # holding projs keeps their ids unique
    return held_by_capture(_STACKED[key].stacked)


def same_shape_groups(keys) -> list[list[int]]:
    groups = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def encode_groups(xs, prepared):
    """Tensors that share launches: one input shape and dtype, one device, one basis shape."""
    return same_shape_groups([(tuple(x.shape), x.dtype, str(x.device), p.projection.K) for x, p in zip(xs, prepared)])


def encode_launch(codecs, xs, prepared, sync: bool, addresses=None, retry=None, narrow: bool = True):
    """Queue the projection and the coder of every tensor; returns the coder's PendingEncode.
    addresses: per group of encode_groups, int64 CUDA [n] where the projection reads the group's
    inputs (rdquant.CudaProjection.quantize_many), instead of stacking xs. narrow: a group's
    symbols are int16 unless one of its codecs has met values beyond int16; where a tensor's do
    not fit, the PendingEncode's result() codes the list again (recode) with int32 for that
    tensor's codec. Else int32: every container valid once the queued work has run."""
    import torch

    from .codecs import rans_cuda

    n = len(xs)
    symbols, stats, guards = [None] * n, [None] * n, [None] * n
    for g, idx in enumerate(encode_groups(xs, prepared)):
        projs = [prepared[i].projection for i in idx]
        # int32 where water-filling drops components: their statistics are then taken from the
        # symbols, which would hide a value wrapped in int16
        group_narrow = narrow and not any(codecs[i]._wide_symbols or drops_components(prepared[i].quantizer) for i in idx)
        proj = projs[0] if len(idx) == 1 else stacked_projection(projs)
        if addresses is not None:  # the shape alone: the kernel reads each input at its address
            stack = xs[idx[0]].unsqueeze(0).expand(len(idx), -1, -1)
        else:
            stack = xs[idx[0]].unsqueeze(0) if len(idx) == 1 else torch.stack([xs[i] for i in idx])
        # amax is inf where a tensor holds NaN/Inf: the coder's guard refuses it in its one sync
        sym, (mn, mx, sm), amax = proj.quantize_many(stack, [prepared[i].quantizer.step for i in idx], narrow=group_narrow,
                                                     addresses=None if addresses is None else addresses[g])
        for j, i in enumerate(idx):
            symbols[i], stats[i], guards[i] = sym[j], (mn[j], mx[j], sm[j]), amax[j:j + 1]
            keep = prepared[i].quantizer.keep
            if drops_components(prepared[i].quantizer):  # water-filling dropped components
                symbols[i] = sym[j].clone()
                symbols[i][:, torch.as_tensor(~keep, device=sym.device)] = 0
                stats[i] = None
    fronts = [p.front for p in prepared]
    pending = rans_cuda.encode_many_cuda(
        symbols, stats=stats, guards=guards, fronts=fronts, backs=[4] * n,  # a self-checked chunk's trailer: 0
        length_field=True,  # the DATA length ends the prefix
        lane_tokens=[c.lane_tokens for c in codecs],
        lanes_by_component=[c.lane_order(*s.shape) for c, s in zip(codecs, symbols)],
        sync=False, retry=sync if retry is None else retry)
    pending.recode = recode_wide(codecs, xs, prepared)
    return pending


def drops_components(quantizer) -> bool:
    return quantizer.keep is not None and not quantizer.keep.all()


def recode_wide(codecs, xs, prepared):
    """PendingEncode.recode for encode_launch's list: the codecs of the tensors whose values
    outgrew int16 keep int32 symbols from now on, and the list is coded again, eagerly."""
    def recode(copy: bool, flagged) -> list:
        for i in flagged:
            codecs[i]._wide_symbols = True
        return encode_launch(codecs, xs, prepared, sync=True).result(copy)
    return recode


def decode_symbols_cuda(codecs, jobs, out):
    """Compute-codec payloads on the GPU -> out[i]: the coder for all of them, the reconstruction
    by shape, then the one host synchronization on their error flags."""
    import torch

    from .codecs import rans_cuda
    from .rdquant import RDQuantizer

    quantizers, projs, scales = [], [], []
    for job in jobs:
        header = job.header
        codecs[job.index]._check_basis(header)
        quantizers.append(RDQuantizer.from_bytes(job.qpar))  # its step checked against the header (schema)
        proj = codecs[job.index]._projection(header["shape"][1], job.payload.device)
        projs.append(proj)
        # bf16 output: the decoder writes scaled coefficient rows and one GEMM reconstructs them
        scales.append((quantizers[-1].step, proj.coefficient_bound(), proj.coefficient_width(), proj.K)
                      if header["dtype"] == "bfloat16" else None)
    symbols, err = rans_cuda.decode_many_cuda([j.payload for j in jobs], [j.payload_head for j in jobs], check=False,
                                              max_elements=[j.header["shape"][0] * schema.components(j.header)
                                                            for j in jobs],
                                              parsed=[j.inner for j in jobs], scales=scales)
    for header, sym, proj, scale in zip((j.header for j in jobs), symbols, projs, scales):
        K = sym.shape[1] if scale is None else proj.K  # a scaled decode has checked its K against the basis
        if K != proj.K or [sym.shape[0], proj.D] != header["shape"]:
            raise BitstreamError(f"payload holds [{sym.shape[0]}, {K}] symbols; the header's shape "
                                 f"{header['shape']} and the basis (K={proj.K}) need [{header['shape'][0]}, {proj.K}]")
    # every output bf16: the error flags are final before the reconstruction, so their copy to the
    # host is queued first and the host waits for it alone while the GEMMs run
    early = rans_cuda.EarlyRead().start(err) if all(s is not None for s in scales) else None
    keys = [(tuple(s.shape), projs[j].D, str(s.device), jobs[j].header["dtype"]) for j, s in enumerate(symbols)]
    for group in same_shape_groups(keys):
        if jobs[group[0]].header["dtype"] == "bfloat16":
            proj = projs[group[0]] if len(group) == 1 else stacked_projection([projs[j] for j in group])
            # finite by construction: the decoder flagged every value past the projection's bound
            values = proj.reconstruct_coefficients(rans_cuda._stacked(torch, [symbols[j] for j in group])).unbind(0)
        else:
            values = [((symbols[j].float() * quantizers[j].step) @ projs[j].components_t.float() + projs[j].mean).to(
                getattr(torch, jobs[j].header["dtype"])) for j in group]
            nonfinite = torch.stack([~torch.isfinite(v).all() for v in values]).to(err.dtype)
            err[group] |= nonfinite  # non-finite output (out-of-range parameters) is corruption too
        for j, v in zip(group, values):
            out[jobs[j].index] = v
    bad = rans_cuda.read_on_host(err) if early is None else early.wait()  # the one host synchronization
    if bool(bad.any()):
        rans_cuda.check_lane_map(bad)
        raise BitstreamError(f"{rans_cuda.CORRUPT} (blob {jobs[int(bad.nonzero()[0])].index} of the list)")

"""CUDA-graph plans of the compute codec's batched calls: a list of codecs and shapes coded or decoded
again is captured once (on its second eager call) and replayed with one launch for every kernel.

  EncodeGraph   encode_many / encode_many_async of one list of codecs and shapes
  DecodeGraph   decode_many of one list of GPU-resident containers, held against the ones checked
  StagedDecode  a decode of containers at fixed places of one GPU buffer, with no host work a step

Keys and limits: graph_key / decode_graph_key (what a graph depends on), GRAPH_MAX_BYTES (the largest
call replayed; 0 turns graphs off), GRAPH_PLANS (graphs kept a direction). Layering: shared/launches.py.
"""
from __future__ import annotations

import operator

import numpy as np

from . import schema
from .codecs.base import LazyViews
from .codecs.rans import read_header as read_rans_header
from .container import PAYLOAD_ALIGN, _is_tensor, _parse
from .errors import BitstreamError, ConfigurationError, InvalidTensorError
from .launches import (StagedJob, drops_components, dtype_name, encode_groups, encode_launch, recode_wide,
                       same_shape_groups, stacked_projection)

GRAPH_MAX_BYTES = 1 << 30  # calls moving up to this many input bytes replay a CUDA graph (0: never); a graph
# keeps its buffers on the GPU (see docs/library.md, "CUDA graphs keep GPU memory", for what each direction holds
# per input byte)
COPY_OUT_SLACK = 4096  # bytes a sync graph's output buffer holds beyond 9/8 of the last call's containers
GRAPH_PLANS = 4  # CUDA graphs kept, one per repeated list of codecs and shapes (each holds its buffers)
ENCODE_GRAPHS = {}  # key -> EncodeGraph, or the number of eager calls seen with that key so far


def drop_graphs() -> None:
    """Drop every CUDA graph encode_many and decode_many keep, and with them their GPU buffers."""
    ENCODE_GRAPHS.clear()
    DECODE_GRAPHS.clear()


def graph_key(codecs, xs):
    """What a CUDA graph of encode_many depends on: each codec's basis, quantizer, projection and
    lane setting (its graph token, new whenever one of them is set: a new step or basis is a new
    object), each input's shape, dtype and device, and the stream. None where no graph applies (graphs off, under Triton's interpreter,
    during a capture, an input that is not a torch tensor or a codec without a projection). Runs
    first on every call, so it maps over the lists (a Python loop over 60 tensors costs ~100 us on
    an NVIDIA H200's host) and reads the stream as the tuple torch.cuda.current_stream() is made
    from (that call costs ~7 us); graph_plan applies the size limit."""
    import torch

    from .codecs import rans_cuda

    if GRAPH_MAX_BYTES <= 0 or rans_cuda.interpreting():
        return None
    try:
        devices = tuple(map(torch.Tensor.get_device, xs))
        # a host tensor is coded without a graph; checked before the capture query, which a
        # CPU-only build of torch cannot answer
        if not devices or min(devices) < 0 or torch.cuda.is_current_stream_capturing():
            return None
        return (tuple(map(_GRAPH_TOKEN, codecs)), tuple(map(_SHAPE, xs)), tuple(map(_DTYPE, xs)), devices,
                torch._C._cuda_getCurrentStream(devices[0]))
    except (TypeError, AttributeError):  # not a torch tensor; a codec of another kind
        return None


QUEUED = "queued"  # first field of the key of a graph that encode_many_async replays


def mode_key(key, sync: bool):
    """The graph key of encode_many_async: the same list's key marked, since that graph
    codes as the eager encode_many_async does (int32 symbols, escape room for every value: no
    container needs coding again once queued) and copies its outputs out on the stream."""
    return key if sync or key is None else (QUEUED,) + key


def _key_stream(key):
    """The torch.cuda.Stream a graph key names (its last field)."""
    import torch

    stream_id, device_index, device_type = key[-1]
    return torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)


_NBYTES, _DTYPE = operator.attrgetter("nbytes"), operator.attrgetter("dtype")
_OFF_16 = 15  # an address's bits below 16-byte alignment
_GRAPH_TOKEN, _SHAPE = operator.attrgetter("_graph_token"), operator.attrgetter("shape")


def graph_plan(key, codecs, xs, prepared):
    """The CUDA graph of this list of codecs and shapes, captured on its second eager call; None
    while it runs eagerly (first call, no key, water-filled)."""
    from .rdquant import IN_PLACE_DTYPES

    if key is None or sum(map(_NBYTES, xs)) > GRAPH_MAX_BYTES or any(drops_components(p.quantizer) for p in prepared) \
            or any(dtype_name(x) not in IN_PLACE_DTYPES for x in xs):
        return None
    return second_call_graph(ENCODE_GRAPHS, key, lambda: EncodeGraph(codecs, xs, prepared, key))


def second_call_graph(graphs: dict, key, make):
    """The graph kept for key in graphs (encode's or decode's), made by make() on the second eager
    call with that key; None on the first, which compiles the kernels and fills the caches. Keeps
    at most GRAPH_PLANS graphs and 4 x GRAPH_PLANS keys, dropping the oldest."""
    seen = graphs.get(key, 0)
    if not isinstance(seen, int):
        return seen
    if seen == 0:
        graphs[key] = 1
        if len(graphs) > 4 * GRAPH_PLANS:
            graphs.pop(next(k for k, v in graphs.items() if isinstance(v, int)))
        return None
    plans = [k for k, v in graphs.items() if not isinstance(v, int)]
    if len(plans) >= GRAPH_PLANS:
        graphs.pop(plans[0])
    graphs[key] = make()
    return graphs[key]


class EncodeGraph:
    """encode_many of one list of codecs and shapes as a CUDA graph: every kernel of the projection
    and the coder, the containers in a buffer of worst-case room, and last a kernel that copies
    them (and for queue() the spans, flags and summary) into buffers the call allocated, through
    slots it writes before each replay (PendingEncode.copy_out). run() (sync=True) gives the
    replay a buffer the size of the last call's containers and an eighth more, reads the summary
    after one synchronization, and returns containers in that buffer (copied from the graph's own
    on the host where they outgrew it); queue() (encode_many_async, a key made by mode_key) gives it
    buffers of worst-case room and returns at once. The projection reads each call's inputs where
    they are, through a table of their addresses, copied to the GPU with the slots: no input is
    copied into the graph (at 256 MB that copy cost 155 us on an NVIDIA H200), but one the kernel
    cannot read in place (not contiguous, or not 16-byte aligned), which is copied into a buffer
    the graph keeps for it."""

    def __init__(self, codecs, xs, prepared, key):
        import torch

        from .codecs import rans_cuda

        self.key, self.groups = key, encode_groups(xs, prepared)
        self.dev = dev = xs[0].device
        self.order = [i for idx in self.groups for i in idx]  # the address table's order: group by group
        # the inputs' addresses, then the slots of copy_out: where this call's outputs go
        self.addr = torch.zeros(len(xs) + 3, dtype=torch.int64, device=dev)
        at = np.cumsum([0] + [len(idx) for idx in self.groups])
        self.addresses = [self.addr[a:b] for a, b in zip(at[:-1], at[1:])]
        self.codecs, self.prepared = codecs, prepared
        self.held = [c._proj for c in codecs]  # with codecs: keeps the key's ids unique
        self.in_order = self.order == list(range(len(xs)))
        self.staging, self._last = {}, None
        self.place(xs, (0, 0, 0))
        queued = key[0] == QUEUED
        # sync=False: int32 symbols and escape room for every value, as the eager path codes them
        mode = dict(sync=False, retry=False, narrow=False) if queued else dict(sync=True, retry=True)
        # compiles the in-place variant of the projection outside the capture
        encode_launch(codecs, xs, prepared, addresses=self.addresses, **mode)
        self.graph = torch.cuda.CUDAGraph()

        def capture():
            # thread_local: another thread may launch on its own stream meanwhile (HostStream decodes on a worker)
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                pending = encode_launch(codecs, xs, prepared, addresses=self.addresses, **mode)
                pending.copy_out(self.addr[len(xs):], meta=queued)
                if not queued:  # the summary's copy to the host is part of the replay
                    pending.queue_summary_read()
                return pending

        self.pending = rans_cuda.holding_cached(self, capture)
        self.pending.stream = _key_stream(key)  # a replay runs on the current stream the key names
        # sync calls of one shape: the replay copies the containers into a buffer of the call's own,
        # `room` bytes, sized from the last call's (0 until one has run, or where copied on the host)
        self.room = 0
        self.compact_on_device = len(self.pending.jobs) == 1 and self.pending._in_order

    @staticmethod
    def readable(xs, ptrs=None) -> bool:
        """Whether the projection can read every input in place: contiguous and 16-byte aligned."""
        import torch

        ptrs = ptrs or list(map(torch.Tensor.data_ptr, xs))
        return all(map(torch.Tensor.is_contiguous, xs)) and not any(map(_OFF_16.__and__, ptrs))

    def place(self, xs, slots):
        """Points the address table at xs, each input the kernel cannot read in place first copied
        into its staging buffer, and copy_out's slots at this call's output buffers: one small copy
        to the GPU, none when every address is the last call's (the caching allocator often hands
        a call the output block the last call's caller has freed)."""
        import torch

        ptrs = list(map(torch.Tensor.data_ptr, xs))
        if not self.readable(xs, ptrs):
            ptrs = [p if self.readable([x], [p]) else self._staged(i, x) for i, (x, p) in enumerate(zip(xs, ptrs))]
        row = (ptrs if self.in_order else [ptrs[i] for i in self.order]) + list(slots)
        if row == self._last:
            return
        # a new pinned block each time: a queued call's copy may not have run when the next call
        # places its inputs (torch's caching host allocator keeps a block until its copy has run)
        host = torch.empty(len(row), dtype=torch.int64, pin_memory=True)
        host.numpy()[:] = row
        self.addr.copy_(host, non_blocking=True)
        self._last = row

    def _staged(self, i, x) -> int:
        import torch

        if i not in self.staging:
            self.staging[i] = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return self.staging[i].copy_(x).data_ptr()

    def queue(self, xs):
        """encode_many_async by the graph: a rans_cuda.PendingEncode whose buffer, spans and
        flags are copies of the replay's own (on the stream, after it), so later calls may replay
        the graph before its result() is read. The inputs are read in place: keep them unchanged
        until the queued work has run."""
        import torch

        buffer = torch.empty_like(self.pending.buffer)  # room for every container, as the graph's own
        meta = torch.empty(self.pending.meta_words(), dtype=torch.int64, device=self.dev)
        self.place(xs, (buffer.data_ptr(), buffer.numel() // 8, meta.data_ptr()))
        self.graph.replay()
        queued = self.pending.copied(buffer, meta)
        queued.queue_summary_read(event=True)  # result() waits for this call's work alone
        queued.recode = recode_wide(self.codecs, xs, self.prepared)  # this call's tensors
        return queued

    def run(self, xs) -> list:
        import torch

        out = torch.empty(self.room, dtype=torch.uint8, device=self.dev) if self.room else None
        self.place(xs, (0 if out is None else out.data_ptr(), self.room // 8, 0))
        self.graph.replay()
        self.pending.recode = recode_wide(self.codecs, xs, self.prepared)  # this call's tensors
        # copied out: the next replay rewrites the graph's buffer
        blobs = self.pending.result(copy=True, out=None if out is None else (out, self.room))
        if self.pending.retried:  # coded again outside the graph: capture afresh later
            ENCODE_GRAPHS.pop(self.key, None)
        elif self.compact_on_device:  # the next call's room: this one's containers and an eighth more
            self.room = (blobs.buffer.numel() * 9 // 8 + COPY_OUT_SLACK + 15) // 16 * 16
        return blobs


DECODE_GRAPHS = {}  # key -> DecodeGraph, or the number of eager calls seen with that key so far


def decode_graph_key(codecs, blobs, device, max_elements):
    """What a CUDA graph of decode_many depends on: each codec and its basis (its graph token), the one
    GPU holding every blob, the output device, the limit, and the stream; the containers
    themselves are held against the ones checked when the graph was made, on the GPU, every call.
    None where no graph applies (a blob on the host or on another GPU, under Triton's interpreter).
    This runs on every call, so it maps over the lists instead of looping in Python."""
    import torch

    from .codecs import rans_cuda

    if rans_cuda.interpreting() or not blobs or GRAPH_MAX_BYTES <= 0:
        return None
    try:
        gpus = {blobs.buffer.get_device()} if isinstance(blobs, rans_cuda.Containers) \
            else set(map(torch.Tensor.get_device, blobs))
    except TypeError:  # a blob that is not a tensor
        return None
    if len(gpus) != 1 or -1 in gpus or torch.cuda.is_current_stream_capturing():
        return None
    gpu = gpus.pop()
    return (tuple(map(_GRAPH_TOKEN, codecs)), gpu, str(device), max_elements,
            torch._C._cuda_getCurrentStream(gpu))  # what torch.cuda.current_stream() is made from (see graph_key)


def decode_graph_plan(key, codecs, blobs, jobs):
    """After an eager decode_many that checked every container on the host: count the call, and on
    the second one with this key make its CUDA graph (GPU-resident compute-codec containers of one
    shape, bf16 output of up to GRAPH_MAX_BYTES)."""
    if key is None or len(jobs) != len(blobs) or any(j.front is None or j.header["dtype"] != "bfloat16" for j in jobs):
        return
    shapes = {(tuple(j.header["shape"]), j.inner.T, j.inner.K, j.inner.S, j.inner.G, j.inner.prob_bits, j.inner.layout.flags) for j in jobs}
    if len(shapes) != 1 or any(len(j.front) % 16 for j in jobs):
        return
    T, D = next(iter(shapes))[0]
    if len(jobs) * T * D * 2 > GRAPH_MAX_BYTES:
        return
    second_call_graph(DECODE_GRAPHS, key, lambda: DecodeGraph(codecs, blobs, jobs, key))  # jobs in blob order


class DecodeGraph:
    """decode_many of one list of codecs as a CUDA graph: the containers staged into fixed slots and
    held against the ones the host checked (rans_cuda.SlotDecoder) and the decoder's kernels, which
    write scaled coefficient rows; then the reconstruction GEMM, launched after the replay into new
    tensors (the graph's own output would need a copy per call, 122 us at 256 MB on an NVIDIA H200);
    one host synchronization per call, on the decoder's error flags alone: the GEMM may still be
    running when the tensors are returned, ordered on the caller's stream like any torch result."""

    def __init__(self, codecs, blobs, jobs, key):
        import torch

        from .codecs import rans_cuda
        from .rdquant import RDQuantizer

        dev = blobs[0].device
        inner, D = jobs[0].inner, jobs[0].header["shape"][1]
        fronts = [j.front for j in jobs]
        self.held = codecs  # keeps the key's ids unique
        cap = rans_cuda.slot_bytes(fronts, inner, max(b.numel() for b in blobs))
        self.projs = [codecs[j.index]._projection(D, dev) for j in jobs]
        self.steps = [RDQuantizer.from_bytes(j.qpar).step for j in jobs]
        self.proj = self.projs[0] if len(self.projs) == 1 else stacked_projection(self.projs)
        # the decoder writes scaled bf16 coefficient rows into the slot decoder's own buffer; the
        # reconstruction GEMM runs after the replay, into new tensors
        scaled = (rans_cuda.floats_on([float(s) for s in self.steps], dev),
                  rans_cuda.floats_on([p.coefficient_bound() for p in self.projs], dev),
                  self.proj.coefficient_width())
        self.dec = rans_cuda.SlotDecoder(fronts, [j.payload_head for j in jobs], inner, cap, dev, scaled=scaled)
        self.dec.set_sources(blobs)
        self.dec.launch()  # outside the capture: compiles and fills the caches the graph reads
        self.graph = torch.cuda.CUDAGraph()

        # the error flags' copy to the host is part of the replay, and an event recorded after it
        # marks the decoder's end: the host waits for that alone while the GEMM runs (a copy and an
        # event record queued after each replay cost ~25 us of host time on an NVIDIA H200)
        self.err_host = torch.zeros(len(jobs), dtype=torch.int32, pin_memory=True)
        self.err_flags = self.err_host.numpy()

        def capture():
            # thread_local: another thread may launch on its own stream meanwhile (HostStream decodes on a worker)
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                rows, err = self.dec.launch()
                self.err_host.copy_(err, non_blocking=True)
                return rows, err

        rows, self.err = rans_cuda.holding_cached(self, capture)
        self.rows = rans_cuda._stacked(torch, rows)  # [N, T, width], refilled by every replay
        self.proj.coefficient_weights()  # made before the first replay, not inside a timed call
        self.stream, self.decoded = _key_stream(key), torch.cuda.Event()

    def run(self, blobs):
        """The tensors, or None where a container differs from the checked one, is corrupt, or is
        not a 1-D uint8 tensor that fits the graph's slots. The host work is bounded: a few maps
        over the list, the replay, one launch, one synchronization."""
        sources = self.dec.placed(blobs)
        if sources is None:
            return None
        self.dec.set_sources(blobs, sources)
        self.graph.replay()
        self.decoded.record(self.stream)  # before the GEMM: the host waits for the decoder alone
        values = self.proj.reconstruct_coefficients(self.rows)
        self.decoded.synchronize()  # the one host synchronization
        if self.err_flags.any():
            return None
        return Tensors(values)


class Tensors(LazyViews):
    """The tensors of a decode_many that replayed its CUDA graph: views into one stacked tensor
    [N, T, D] (`stacked`), each made when first indexed (codecs.base.LazyViews): unbinding 60 on
    every call took 75 us on a 2-core CPU machine."""

    __slots__ = ("stacked",)

    def __init__(self, stacked):
        super().__init__(stacked.shape[0])
        self.stacked = stacked

    def _view(self, i: int):
        return self.stacked[i]

    def __repr__(self) -> str:
        return f"Tensors({len(self)} x {list(self.stacked.shape[1:])} {self.stacked.dtype} on {self.stacked.device})"


class StagedDecode:
    """A decode that repeats with no host work: compute-codec containers of bf16 tensors, laid out
    at fixed byte offsets of one GPU buffer, decoded into fixed output rows, as one CUDA graph.

        plan = StagedDecode(codecs, heads, totals, offsets, buffer, outs)
        # each step: bytes of the same containers copied into buffer (an H2D copy on another stream), then
        plan.replay()     # queued on the current stream: no host read, no synchronization
        ...               # after the stream passed the replay (an event, a synchronize):
        plan.check()      # BitstreamError naming the first corrupt container, from flags the replay copied to host

    The host checks each container once, here, from its first bytes (`heads[i]`: at least its header,
    QPAR and the payload's first 64 bytes; `totals[i]`: its length): header and chunk CRCs, the schema,
    the basis, the payload header against the shape. Every replay then checks each payload on the GPU
    (its checksum, tables and lane states, as decode_many does) and raises nothing itself: a caller
    that needs the answer before using the output waits for the stream and calls check(). A payload
    whose bytes changed after this check is decoded as the corrupt data it is and flagged; the header
    bytes before it are not read again (change a container: make a new plan).

    Payloads of one shape decode in one set of launches; outs[i] ([T, D] bf16, contiguous, on the
    buffer's GPU) receives container i. scratch: a uint8 GPU tensor for the coefficient rows (at least
    scratch_bytes()) that plans replayed one after another on one stream may share; pool: a CUDA-graph
    memory pool the same plans may share (torch.cuda.graph_pool_handle()). graph=False: launch eagerly
    (the same kernels; the fallback where a capture fails). stream: where the warm-up and the capture
    run (default: a new side stream). The graph's GEMMs keep the cuBLAS workspace of the stream they
    were captured on, so a caller that replays plans beside other work gives the stream it replays them
    on, one no other graph was captured on (two GEMMs running at once on one workspace can corrupt each
    other or hang).

    reconstruct=False stops before the reconstruction GEMM: outs[i] is then [T, width] bf16 (width =
    the codec's CudaProjection.coefficient_width()) and receives the coefficient rows R, with
    x = R @ coefficient_weights() (the mean rides in two columns of ones). An attention that reads R
    (scores q.x = R @ (W q), outputs p.X = (p.R) @ W) never needs x: the GEMM and its write skipped.

    after: a callable of torch GPU work on the outputs (e.g. RoPE on decoded keys), run after the
    decode in the same graph: it must only queue work on the current stream, allocate nothing it
    keeps, and give the same result when run more than once on freshly decoded outputs."""

    def __init__(self, codecs, heads, totals, offsets, buffer, outs, *, scratch=None, pool=None, graph: bool = True,
                 reconstruct: bool = True, stream=None, max_elements: int = schema.DEFAULT_MAX_ELEMENTS, after=None):
        import torch

        from .codecs import rans_cuda
        from .rdquant import RDQuantizer

        n = len(codecs)
        if not (len(heads) == len(totals) == len(offsets) == len(outs) == n) or n == 0:
            raise ConfigurationError(f"StagedDecode needs one head, length, offset and output per codec; got {n} "
                                     f"codecs, {len(heads)} heads, {len(totals)} lengths, {len(offsets)} offsets, "
                                     f"{len(outs)} outputs")
        if not (_is_tensor(buffer) and buffer.is_cuda and buffer.dtype == torch.uint8 and buffer.dim() == 1):
            raise InvalidTensorError("StagedDecode's buffer must be a 1-D uint8 CUDA tensor")
        if buffer.numel() % PAYLOAD_ALIGN or buffer.data_ptr() % PAYLOAD_ALIGN:
            raise ConfigurationError(f"StagedDecode's buffer must start {PAYLOAD_ALIGN}-byte aligned and hold a multiple of "
                                     f"{PAYLOAD_ALIGN} bytes (the kernels read it as 4- and 8-byte words); it holds "
                                     f"{buffer.numel()}. Fix: allocate it rounded up")
        dev = buffer.device
        jobs = []
        for i, (codec, head, total, offset, out) in enumerate(zip(codecs, heads, totals, offsets, outs)):
            head = bytes(head)
            header, spans = _parse(head, int(total), lazy_last=True, max_elements=max_elements)
            if header["quant"]["kind"] != "rd_shared_step" or header["dtype"] != "bfloat16":
                raise ConfigurationError(f"container {i}: StagedDecode decodes compute-codec containers of bfloat16 "
                                         f"tensors; this one is {header['dtype']} with quantizer "
                                         f"{header['quant']['kind']!r}. Fix: decode it with decode_many")
            (qa, qb), (a, b) = spans["QPAR"], spans["DATA"]
            if min(a + 64, b) > len(head):
                raise ConfigurationError(f"container {i}: its head holds {len(head)} bytes; the payload's header "
                                         f"needs the first {min(a + 64, b)}")
            inner = schema.check_chunks(header, {"QPAR": head[qa:qb], "DATA": head[a:min(a + 64, b)]}, data_len=b - a,
                                        read_inner=read_rans_header)
            codec._check_basis(header)
            proj = codec._projection(header["shape"][1], dev)
            if inner.K != proj.K:
                raise BitstreamError(f"container {i}: payload holds {inner.K} components per token; its basis has {proj.K}")
            shape = header["shape"] if reconstruct else [header["shape"][0], proj.coefficient_width()]
            if not (_is_tensor(out) and out.is_cuda and out.device == dev and out.dtype == torch.bfloat16
                    and list(out.shape) == shape and out.is_contiguous()):
                raise InvalidTensorError(f"output {i} must be a contiguous bfloat16 tensor {shape} on {dev}; "
                                         f"got {getattr(out, 'dtype', type(out).__name__)} "
                                         f"{tuple(getattr(out, 'shape', ()))}")
            if offset % PAYLOAD_ALIGN or offset < 0 or offset + int(total) > buffer.numel():
                raise ConfigurationError(f"container {i} at byte {offset} ({total} bytes) must start 16-byte aligned "
                                         f"inside the buffer of {buffer.numel()} bytes")
            jobs.append(StagedJob(i, inner, offset + a, RDQuantizer.from_bytes(head[qa:qb]).step, proj))
        self.outs, self.buffer, self.n, self.reconstruct, self.after = list(outs), buffer, n, reconstruct, after
        self.groups = []
        # without the GEMM each container decodes straight into its output (a group of one)
        keys = [(j.inner.T, j.inner.K, j.inner.S, j.inner.G, j.inner.prob_bits, j.inner.layout.flags, j.projection.coefficient_width(),
                 reconstruct or j.index) for j in jobs]
        cursor = 0
        for members in same_shape_groups(keys):
            T, K, width = keys[members[0]][0], keys[members[0]][1], keys[members[0]][6]
            hdrs = [jobs[m].inner for m in members]
            pad = torch.zeros(width - K, dtype=torch.bfloat16)
            pad[:2] = 1  # the mean's two columns (coefficient_rows)
            group = dict(members=members, hdrs=hdrs, K=K, rows_at=cursor, shape=(len(members), T, width),
                         segs=rans_cuda.segment_table(hdrs, [jobs[m].offset for m in members], dev),
                         scaled=(rans_cuda.floats_on([float(jobs[m].step) for m in members], dev),
                                 rans_cuda.floats_on([jobs[m].projection.coefficient_bound() for m in members], dev),
                                 width),
                         weights=[jobs[m].projection.coefficient_weights() for m in members],
                         pad=pad.pin_memory().to(dev, non_blocking=True),  # no host wait on a busy stream
                         err=torch.zeros(len(members), dtype=torch.int32, device=dev),
                         err_host=torch.zeros(len(members), dtype=torch.int32, pin_memory=True))
            if reconstruct:
                cursor += self.scratch_bytes([(len(members), T, width)])
            self.groups.append(group)
        self.rows_bytes = cursor
        if scratch is None:
            scratch = torch.empty(cursor, dtype=torch.uint8, device=dev)
        elif not (_is_tensor(scratch) and scratch.device == dev and scratch.dtype == torch.uint8
                  and scratch.numel() >= cursor):
            raise ConfigurationError(f"scratch must be a uint8 tensor of at least {cursor} bytes on {dev}")
        for g in self.groups:
            g["rows"] = scratch[g["rows_at"]:g["rows_at"] + g["shape"][0] * g["shape"][1] * g["shape"][2] * 2] \
                .view(torch.bfloat16).view(g["shape"]) if reconstruct else outs[g["members"][0]].unsqueeze(0)
        self.scratch, self.graph = scratch, None
        side = torch.cuda.Stream(dev) if stream is None else stream  # an eager run, then the capture
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self._launch()  # compiles the kernels and fills the caches a capture reads
            if graph and not rans_cuda.interpreting():
                self.graph = torch.cuda.CUDAGraph()

                def capture():
                    # capture_begin directly: torch.cuda.graph's entry synchronizes the device and empties
                    # the allocator's cache, which a cache making one plan per layer should not pay
                    self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        self._launch()
                    finally:
                        self.graph.capture_end()

                rans_cuda.holding_cached(self, capture)
        torch.cuda.current_stream(dev).wait_stream(side)

    @staticmethod
    def scratch_bytes(shapes) -> int:
        """Scratch bytes a plan needs for groups of (count, T, width) coefficient rows."""
        return sum((n * T * w * 2 + 255) // 256 * 256 for n, T, w in shapes)

    def _launch(self) -> None:
        import torch

        from .codecs import rans_cuda

        for g in self.groups:
            g["err"].zero_()
            g["rows"][:, :, g["K"]:] = g["pad"]
            rans_cuda.decode_placed(self.buffer, g["segs"], g["hdrs"], g["err"], g["scaled"], g["rows"])
            if self.reconstruct:
                for m, rows, w in zip(g["members"], g["rows"].unbind(0), g["weights"]):
                    torch.mm(rows, w, out=self.outs[m])
            g["err_host"].copy_(g["err"], non_blocking=True)
        if self.after is not None:
            self.after()

    def replay(self) -> None:
        """Queue the decode on the current stream (the buffer must hold the containers' bytes by then)."""
        if self.graph is None:
            self._launch()
        else:
            self.graph.replay()

    def corrupt(self) -> int | None:
        """After the stream passed the last replay: the index of the first container whose payload
        failed its check there, or None."""
        from .codecs import rans_cuda

        bad = [m for g in self.groups for m, flag in zip(g["members"], g["err_host"].numpy()) if flag]
        for g in self.groups:
            rans_cuda.check_lane_map(g["err_host"].numpy())
        return min(bad) if bad else None

    def check(self) -> None:
        """After the stream passed the last replay: BitstreamError naming the first corrupt container."""
        from .codecs import rans_cuda

        first = self.corrupt()
        if first is not None:
            raise BitstreamError(f"{rans_cuda.CORRUPT} (container {first} of the list)")

"""SpillCache: a transformers Cache whose KV lives off the GPU between uses and is fetched back layer by
layer, the next layer prefetched on side CUDA streams while the current one computes.

    from shared.kvcache import SpillCache, cache_kwarg
    cache = SpillCache(model.config.num_hidden_layers, "raw_fetch")           # pinned host memory
    cache = SpillCache(n_layers, "compressed_fetch", codecs=codecs)          # codecs[i] = (codec_k, codec_v)
    out = model.generate(**inputs, **cache_kwarg(model, cache), max_new_tokens=64, do_sample=False)

Modes
- raw_fetch: each layer's stored KV sits in pinned host memory in the model's dtype and crosses to the GPU
  whole at every step (what transformers' offloaded caches do).
- compressed_fetch: each layer's stored KV is a list of compute-codec containers (TensorCodec backend
  "rans", one per K and V per flushed chunk), packed one after another in one pinned host buffer per
  layer; a step copies that buffer to the GPU in one copy and decodes it there (pipeline.StagedDecode).
- gpu_resident: everything stays in GPU memory (the upper bound; no fetch).

Layout and the recent window
A layer's K (and V) is handled as rows [T, kv_heads * head_dim] (token-major, channel = head * head_dim + d),
the codec's layout; the tensors handed to attention are views [1, kv_heads, T, head_dim] of such rows
(copied to contiguous tensors when `contiguous=True`, the default, so attention sees exactly the tensors a
DynamicCache would hand it). New tokens go to a recent window kept on the compute device; when it reaches
`chunk_tokens` tokens it is flushed to the stored form as one piece (one host copy, or one blob per K/V),
so appending never quantizes stored KV again. With `merge_chunks` (the default) a flushed chunk is then
joined with the chunk before it while that one is no longer (TensorCodec.join: the symbols are coded again,
their values unchanged), so a long generation keeps a few large containers per layer, not one per flush. The first call's tokens (the prompt; `store_prompt=True`, the
default) and any call that brings `chunk_tokens` or more tokens at once are flushed as one piece: the
prompt becomes one large blob per layer per K/V, and a step decodes few, large blobs. Tokens are attended exactly within the call that produced them and from their stored form in
every later call once flushed; tokens still in the recent window are exact.

Fetch pipeline (CUDA)
Two staging slots of [capacity, D] per K and V take the fetched KV of one layer each; update(i) waits
(GPU-side, on an event) for layer i's fetch, queues layer i+1's into the other slot, and copies the recent
window after the fetched rows. A slot is reused only after an event recorded at the next update call, i.e.
after the attention that read it was queued. raw_fetch: one H2D copy per K/V on a copy stream.
compressed_fetch: layer i+1's packed containers cross in one H2D copy on the copy stream into one of two
GPU staging buffers, then decode on a decode stream straight into the slot (one CUDA graph per layer and
slot, pipeline.StagedDecode: rANS kernels and the reconstruction GEMMs, no host read), while layer i
computes on the current stream. Nothing waits on the host per layer: each decode's payload checks land
in pinned flags, read once per step, at the last layer's update (one synchronization), and a corrupt
container raises BitstreamError there, naming its layer and chunk, before that step's attention output
is returned. The plans are made at a layer's first fetch after a flush (the host checks the containers'
headers then) and replayed until its next flush.
On a CPU the same code runs synchronously (stored blobs decoded by the numpy coder; `keep_decoded`, on by
default there, decodes each blob once and keeps the result, which gives attention the same values as
decoding at every step).

Limits: a SpillCache holds one sequence; BatchSpillCache holds a batch (one SpillCache per sequence:
left-padded batches, num_return_sequences, beam search: a beam that survives twice gets a fork of its
sequence's cache, the stored form copied as it is). `crop` (assisted and
prompt-lookup decoding) removes recent-window tokens at once and cuts stored chunks: the kept part of
a compressed chunk the cut falls in is decoded back into the recent window and coded again at the next flush.
`cache.layers[i].keys` / `.values` read a layer as transformers' layers hold it ([1, kv_heads, T, head_dim]),
fetched as a step would fetch it (a copy; None while empty).
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .container import _host_bytes
from .errors import BitstreamError, ConfigurationError, InvalidTensorError, TensorCodecError
from .batched import decode_many, encode_many
from .cuda_graphs import StagedDecode

MODES = ("raw_fetch", "compressed_fetch", "gpu_resident")
SLOTS = 2  # staging slots: the layer in use and the one being fetched
CAPACITY_STEP = 1024  # staging and host buffers grow in multiples of this many tokens
PACK_ALIGN = 16  # containers start at multiples of this in a layer's packed buffer (their payloads then do too)
HEAD_BYTES = 8192  # a container's first bytes kept on the host: its header, QPAR and the payload's header
BYTES_STEP = 1 << 20  # packed and staging buffers grow in multiples of this many bytes


# ---------------------------------------------------------------- the codec calls

def encode_blobs(codecs, tensors) -> list:
    """One container per (codec, [T, D] tensor), coded together (shared.pipeline.encode_many)."""
    return list(encode_many(list(codecs), list(tensors)))


def decode_blobs(codecs, blobs, device=None) -> list:
    """The tensors of containers (device None: the CPU decoder), decoded together (shared.pipeline.decode_many)."""
    return list(decode_many(list(codecs), list(blobs), device=device))


def _align(n: int, step: int) -> int:
    return -(-n // step) * step


def cache_kwarg(model, cache) -> dict:
    """{name: cache} for model(...) / model.generate(...): transformers >= 5.2x calls it `cache`,
    earlier releases `past_key_values`."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


# ---------------------------------------------------------------- layout helpers

def states_to_rows(states: torch.Tensor) -> torch.Tensor:
    """[1, heads, T, head_dim] -> [T, heads * head_dim] (contiguous)."""
    _, heads, tokens, head_dim = states.shape
    return states[0].transpose(0, 1).reshape(tokens, heads * head_dim).contiguous()


def rows_to_states(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, heads * head_dim] -> a [1, heads, T, head_dim] view (no copy)."""
    tokens, channels = rows.shape
    return rows.view(tokens, heads, channels // heads).permute(1, 0, 2).unsqueeze(0)


def _stream_apart(device, taken: set):
    """A stream from torch's pool whose CUDA stream is none of `taken` (raw handles)."""
    for _ in range(2 * 32 + 1):
        stream = torch.cuda.Stream(device)
        if stream.cuda_stream not in taken:
            return stream
    raise TensorCodecError("no CUDA stream apart from the compute and capture streams in torch's stream pool")


def _rotate_forward(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                    fused: bool | None = None) -> None:
    """RoPE on rows [T, heads * head_dim] in place (HF layout: dimension i pairs with i + head_dim / 2),
    cos / sin float32 [T, head_dim] of the rows' positions: a step of a graph-replayed decode. fused: one
    Triton kernel that reads and writes each value once, where the torch ops make several float32
    passes (dev/rope_bench.py); None: FUSED_ROPE on a GPU."""
    if fused is None:
        fused = rows.is_cuda and FUSED_ROPE
    if fused:
        _rope_in_place(rows, cos, sin, head_dim)
        return
    x = rows.view(rows.shape[0], -1, head_dim)
    xf = x.float()
    half = head_dim // 2
    x.copy_(xf * cos[:, None] + torch.cat([-xf[..., half:], xf[..., :half]], -1) * sin[:, None])


_ROPE_KERNEL = None
ROPE_BLOCK_ROWS = 16  # rows per program of the fused RoPE
# the fused kernel equals the torch rotation to rounding on a GPU (tests/test_kvcache.py::
# test_gpu_fused_rope_equals_the_torch_rotation) and takes a tenth of its time at 32K-64K tokens
# (dev/rope_bench.py); False takes the torch ops
FUSED_ROPE = True


def _rope_in_place(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    global _ROPE_KERNEL
    if _ROPE_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def rope(x_ptr, cos_ptr, sin_ptr, T, table_stride, CHANNELS: tl.constexpr, HALF: tl.constexpr,
                 PAIRS: tl.constexpr, BLOCK_PAIRS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
            # each row holds PAIRS = heads * HALF pairs (x[h, j], x[h, j + HALF]); the tables hold each
            # position's cos / sin, of which the first HALF columns are read (the rest repeat them)
            t = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]).to(tl.int64)
            p = tl.arange(0, BLOCK_PAIRS)[None, :]
            mask = (t < T) & (p < PAIRS)
            j = p % HALF
            first = t * CHANNELS + (p // HALF) * (2 * HALF) + j
            c = tl.load(cos_ptr + t * table_stride + j, mask=mask, other=0.0)
            s = tl.load(sin_ptr + t * table_stride + j, mask=mask, other=0.0)
            a = tl.load(x_ptr + first, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(x_ptr + first + HALF, mask=mask, other=0.0).to(tl.float32)
            tl.store(x_ptr + first, (a * c - b * s).to(x_ptr.dtype.element_ty), mask=mask)
            tl.store(x_ptr + first + HALF, (b * c + a * s).to(x_ptr.dtype.element_ty), mask=mask)

        _ROPE_KERNEL = (rope, triton)
    kernel, triton = _ROPE_KERNEL
    T, C = rows.shape
    if not (rows.is_contiguous() and cos.stride() == sin.stride() and cos.stride(1) == 1 and cos.shape[0] >= T):
        raise TensorCodecError("internal: the fused RoPE takes contiguous rows and row-major tables")
    pairs = C // 2
    grid = (triton.cdiv(T, ROPE_BLOCK_ROWS),)
    kernel[grid](rows, cos, sin, T, cos.stride(0), CHANNELS=C, HALF=head_dim // 2, PAIRS=pairs,
                 BLOCK_PAIRS=triton.next_power_of_2(pairs), BLOCK_ROWS=ROPE_BLOCK_ROWS)


def _round_up(n: int, step: int = CAPACITY_STEP) -> int:
    return max(step, -(-n // step) * step)


# ---------------------------------------------------------------- the layer

def _stored_kv(which: int) -> property:
    """keys (0) or values (1) of a spilled layer: read on demand (_read), never assigned."""
    return property(lambda self: self._read(which), lambda self, value: self._refuse(value))


class _ReadOnlyKV:
    """transformers' layers hold .keys / .values [batch, kv_heads, T, head_dim]; a spilled layer holds its KV
    in the stored form, so it reads them on demand (_read) and refuses to be assigned them."""

    keys = _stored_kv(0)
    values = _stored_kv(1)

    @staticmethod
    def _refuse(value) -> None:
        if value is not None:  # DynamicLayer's own constructor and reset store None
            raise TensorCodecError("a SpillLayer's keys and values are filled through its cache: call "
                                   "cache.update(k, v, layer_idx)")


class SpillLayer(_ReadOnlyKV, DynamicLayer):
    """One layer of a SpillCache: its stored KV (host rows, blobs, or GPU rows) and its recent window.
    The cache moves the data; this object answers the Cache API's per-layer questions."""

    is_compileable = False
    is_croppable = True  # SpillCache.crop: the recent window, and stored chunks (the kept part of one decoded)
    supports_early_init = False  # the cache sets itself up at the first update

    def __init__(self, cache=None, index: int = 0):
        super().__init__()
        self._cache = weakref.ref(cache) if cache is not None else None  # the SpillCache that fills this layer
        self._index = index
        self.length = 0  # tokens held: stored + recent
        self.stored = 0  # tokens in the stored form
        self.version = 0  # bumped when the stored form changes (a prefetch made before is refetched)
        self.heads = self.head_dim = self.dim = None
        self.dtype = None
        self.recent = 0  # valid rows of recent_k / recent_v
        self.recent_k = self.recent_v = None  # [chunk_tokens, D] on the compute device
        self.store_k = self.store_v = None  # raw_fetch: host rows [capacity, D]; gpu_resident: device rows
        self.blobs: list[tuple[int, object, object]] = []  # compressed_fetch: (tokens, k_blob, v_blob) per chunk
        self.decoded: list[tuple[torch.Tensor, torch.Tensor]] = []  # keep_decoded: decoded rows per blob
        # compressed_fetch on CUDA: every container in one pinned buffer (blobs are views of it)
        self.packed = None  # uint8 pinned host tensor
        self.packed_len = 0  # bytes in use
        self.places: list[tuple[int, int]] = []  # (offset, length) of each container, in blob order (k0, v0, k1, ...)
        self.container_heads: list[bytes] = []  # each container's first HEAD_BYTES bytes
        self.plans: dict = {}  # slot -> (version, buffers' addresses, StagedDecode)
        # compressed_fetch with sink > 0: the layer's first tokens, kept raw on the compute device
        self.sink = 0  # rows held
        self.sink_k = self.sink_v = None  # [cache.sink, D]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.heads, self.head_dim = int(key_states.shape[1]), int(key_states.shape[3])
        self.dim = self.heads * self.head_dim
        self.is_initialized = True

    def update(self, *args, **kwargs):
        raise TensorCodecError("a SpillLayer is filled through its cache: call cache.update(k, v, layer_idx)")

    def _read(self, which: int) -> torch.Tensor | None:
        """keys (0) or values (1) as [1, kv_heads, T, head_dim], fetched as a step would (a new tensor, the
        values attention reads; None while the layer is empty). It costs a fetch: read it between steps."""
        cache = self._cache() if self._cache is not None else None
        if cache is None or self.length == 0:
            return None
        return rows_to_states(cache.fetched_kv(self._index)[which], self.heads).contiguous()

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.length

    def get_mask_sizes(self, query, *args, **kwargs) -> tuple[int, int]:
        # transformers >= 5 passes the query length, 4.5x the cache_position tensor
        query_length = query if isinstance(query, int) else int(query.shape[0])
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def offload(self):  # the cache places the data itself
        pass

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx) -> None:
        if len(beam_idx) == 1 and int(beam_idx[0]) == 0:  # the one sequence stays where it is
            return
        raise TensorCodecError("SpillCache holds one sequence; beam search reorders a batch of them. Fix: "
                               "BatchSpillCache (same arguments) for beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise TensorCodecError("SpillCache holds one sequence (batch 1); it cannot be repeated. Fix: "
                                   "BatchSpillCache (same arguments) for num_return_sequences")

    def batch_select_indices(self, indices) -> None:
        if len(indices) != 1:
            raise TensorCodecError("SpillCache holds one sequence (batch 1)")

    def chunks(self) -> list[tuple[int, int]]:
        """(first token, tokens) of each stored chunk, in blob order (the raw sink rows come before them)."""
        out, first = [], self.sink
        for m, _, _ in self.blobs:
            out.append((first, m))
            first += m
        return out

    def nbytes_stored(self, value_bytes: int | None = None) -> int:
        """Bytes of the stored form (host rows, blobs and raw sink rows, or GPU rows); value_bytes: count raw
        rows at this many bytes a value (2: as bf16) instead of the model's dtype."""
        size = value_bytes or (self.dtype.itemsize if self.dtype else 0)
        if self.blobs or self.sink:
            return sum(_nbytes(k) + _nbytes(v) for _, k, v in self.blobs) + 2 * self.sink * self.dim * size
        return 2 * self.stored * (self.dim or 0) * size


def _copied(t: torch.Tensor | None, rows: int | None = None) -> torch.Tensor | None:
    """A tensor of t's shape, dtype, device and pinning holding t's first `rows` rows (all of them by default)."""
    if t is None:
        return None
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device, pin_memory=t.device.type == "cpu" and t.is_pinned())
    n = t.shape[0] if rows is None else rows
    out[:n].copy_(t[:n])
    return out


def _copy_layer(src: SpillLayer, dst: SpillLayer) -> None:
    """dst (a new layer of another cache) holds what src holds: SpillCache.fork."""
    if not src.is_initialized:
        return
    for name in ("device", "dtype", "heads", "head_dim", "dim", "length", "stored", "version", "recent", "sink",
                 "packed_len", "is_initialized"):
        setattr(dst, name, getattr(src, name))
    dst.recent_k, dst.recent_v = _copied(src.recent_k, src.recent), _copied(src.recent_v, src.recent)
    dst.sink_k, dst.sink_v = _copied(src.sink_k, src.sink), _copied(src.sink_v, src.sink)
    stored_rows = src.length if src.store_k is not None and src.store_k.device.type != "cpu" else src.stored
    dst.store_k, dst.store_v = _copied(src.store_k, stored_rows), _copied(src.store_v, stored_rows)
    dst.decoded = list(src.decoded)  # decoded rows are never written in place
    dst.places, dst.container_heads = list(src.places), list(src.container_heads)
    if src.packed is None:
        dst.blobs = list(src.blobs)  # containers as host bytes: never written in place
        return
    dst.packed = _copied(src.packed, src.packed_len)  # the containers' pinned buffer: the twin's own
    views = [dst.packed[a:a + n] for a, n in dst.places]
    dst.blobs = [(m, k, v) for (m, _, _), k, v in zip(src.blobs, views[0::2], views[1::2])]


def _nbytes(blob) -> int:
    return blob.numel() if isinstance(blob, torch.Tensor) else len(blob)


# ---------------------------------------------------------------- the fetch machinery

@dataclass
class _Fetch:
    layer: int
    slot: int
    version: int
    tokens: int  # stored tokens this fetch brings
    blobs: list = field(default_factory=list)  # compressed_fetch: the layer's blobs when it was issued
    ready: object = None  # torch.cuda.Event recorded when the slot holds the data


@dataclass
class _Decoded:
    """A queued StagedDecode replay whose payload checks the host has not read yet."""
    layer: int
    plan: object
    chunks: list  # (first token, tokens) of each chunk, in blob order
    done: object  # torch.cuda.Event recorded after the replay


@dataclass
class _Slot:
    k: torch.Tensor
    v: torch.Tensor
    released: object = None  # torch.cuda.Event recorded once the last reader was queued
    ck: torch.Tensor | None = None  # coefficients=True: the stored tokens' coefficient rows, flat bf16
    cv: torch.Tensor | None = None


@dataclass
class CoefficientKV:
    """What update_coefficients hands a decode loop's attention for one layer: the coded tokens as
    coefficient rows (x = rows @ weights; [S, width] and [width, D], bf16) and every other token as plain
    rows [R, D]: the raw sink rows (the layer's first `sink` tokens), then the recent window with this
    call's tokens. Attention may read the two parts in any order (keys carry their positions already);
    in sequence order the keys are cat(raw_k[:sink], rows_k @ weights_k, raw_k[sink:])."""
    rows_k: torch.Tensor
    rows_v: torch.Tensor
    weights_k: torch.Tensor
    weights_v: torch.Tensor
    recent_k: torch.Tensor
    recent_v: torch.Tensor
    sink: int = 0

    def reconstructed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V rows [T, D] in sequence order: sink rows, coded rows reconstructed, recent rows."""
        s = self.sink
        return (torch.cat([self.recent_k[:s], self.rows_k @ self.weights_k, self.recent_k[s:]]),
                torch.cat([self.recent_v[:s], self.rows_v @ self.weights_v, self.recent_v[s:]]))


@dataclass
class _Stats:
    fetches: int = 0
    fetched_bytes: int = 0  # bytes that crossed host -> device for fetches
    flushes: int = 0
    flushed_tokens: int = 0
    merges: int = 0  # stored chunks joined into one (merge_chunks)


class SpillCache(Cache):
    """A KV cache that spills every layer to host memory (raw or compute-codec blobs) and fetches it
    back each step; see the module docstring. `codecs[i] = (codec_k, codec_v)` for compressed_fetch."""

    def __init__(self, num_layers: int, mode: str = "raw_fetch", *, codecs=None, chunk_tokens: int = 1024,
                 max_tokens: int | None = None, prefetch: bool = True, keep_decoded: bool | None = None,
                 contiguous: bool = True, coefficients: bool = False, store_prompt: bool = True,
                 staged: bool = True, sink: int = 0, rope=None, merge_chunks: bool = True):
        if mode not in MODES:
            import difflib

            close = difflib.get_close_matches(str(mode), MODES, n=1)
            raise ConfigurationError(f"SpillCache mode must be one of {', '.join(MODES)}; got {mode!r}"
                                     + (f" (did you mean {close[0]!r}?)" if close else ""))
        if mode == "compressed_fetch":
            if codecs is None or len(codecs) != num_layers or any(len(pair) != 2 for pair in codecs):
                raise ConfigurationError(
                    f"compressed_fetch needs codecs: one (codec_k, codec_v) pair per layer ({num_layers}); got "
                    f"{'none' if codecs is None else len(codecs)}. Fix: codecs=[(TensorCodec(basis_k[i], "
                    f"backend='rans', step=s), TensorCodec(basis_v[i], ...)) for i in range({num_layers})]")
        if int(chunk_tokens) < 1:
            raise ConfigurationError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if coefficients and mode != "compressed_fetch":
            raise ConfigurationError(f"coefficients=True hands attention the decoder's coefficient rows; mode {mode!r} "
                                     "has none. Fix: mode='compressed_fetch', or coefficients=False")
        if (int(sink) or rope is not None) and mode != "compressed_fetch":
            raise ConfigurationError(f"sink and rope shape what the codec codes; mode {mode!r} codes nothing. Fix: "
                                     "mode='compressed_fetch', or leave them out")
        if int(sink) < 0:
            raise ConfigurationError(f"sink is a token count >= 0, got {sink}")
        if coefficients and rope is not None:
            raise ConfigurationError("coefficients=True hands attention the stored keys as coefficient rows, which it reads "
                                     "as they are; keys coded before RoPE (rope) must be rotated per position first. Fix: "
                                     "a codec that codes keys after RoPE (kvcodec.load_shipped(keys_after_rope=True)), "
                                     "or coefficients=False")
        super().__init__(layers=[SpillLayer(self, i) for i in range(num_layers)])  # each knows its cache (.keys)
        self._settings = dict(mode=mode, codecs=codecs, chunk_tokens=chunk_tokens, max_tokens=max_tokens,
                              prefetch=prefetch, keep_decoded=keep_decoded, contiguous=contiguous,
                              coefficients=coefficients, store_prompt=store_prompt, staged=staged, sink=sink,
                              rope=rope, merge_chunks=merge_chunks)  # what fork() makes its twin with
        if coefficients and not staged:
            raise ConfigurationError("coefficients=True needs the staged decode (staged=True)")
        self.sink, self.rope = int(sink), rope
        self._rope_table = None  # CUDA, rope set: (cos, sin) float32 [slot capacity, head_dim]
        self.coefficients, self.store_prompt, self.staged = coefficients, store_prompt, staged
        self.mode, self.codecs = mode, codecs
        self.chunk_tokens, self.max_tokens = int(chunk_tokens), max_tokens
        self.merge_chunks = bool(merge_chunks)
        self.prefetch_enabled, self.keep_decoded, self.contiguous = prefetch, keep_decoded, contiguous
        self.device = None
        self.stats = _Stats()
        self._slots: list[_Slot] = []
        self._next_slot = 0
        self._in_use: int | None = None
        self._pending: dict[int, _Fetch] = {}
        self._copy_stream = self._decode_stream = None
        # compressed_fetch on CUDA: per slot a GPU buffer the packed containers cross into, the events
        # that order it (copied in; free again after its decode), the plans' shared scratch and pool
        self._stage: list[torch.Tensor] = []
        self._staged_events, self._stage_free = [], []
        self._scratch = self._pool = None
        self._unchecked: list[_Decoded] = []
        self.timeline: list | None = None  # set to [] to record each fetch's copy and decode spans (CUDA events)

    @classmethod
    def from_kv_codec(cls, kv_codec, model=None, *, num_layers: int | None = None, lane_tokens: int | None = None,
                      lanes_by_component: bool = False, **kwargs) -> "SpillCache":
        """A compressed_fetch cache coded by the attention-aware KV codec (shared.kvcodec.KVCodec, e.g. a
        loaded codec file): each layer's K and V coded by kv_codec.tensor_codec (its transform and step),
        the first kv_codec.sink tokens of every layer kept raw, and keys coded before RoPE where the codec
        was fitted so (the cache knows every stored token's absolute position, and rotates decoded keys
        forward again on the device they are fetched to). The codec's `recent` plays no part: the
        cache's recent window (chunk_tokens) is never coded. model: the transformers model the cache
        serves, to refuse now a codec fitted on another (layer count, KV channels, RoPE frequencies);
        num_layers without a model; lane_tokens, lanes_by_component: the rANS lanes (shared.pipeline.TensorCodec).
        Other keywords go to SpillCache()."""
        held = sorted({layer for layer, _ in kv_codec.transforms})
        if not held:
            raise ConfigurationError("the KV codec holds no transforms")
        if model is not None:
            cfg = model.config
            num_layers = cfg.num_hidden_layers
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            dim = cfg.num_key_value_heads * head_dim
            width = kv_codec.transform(held[0], "k").analysis.shape[0]
            if width != dim:
                raise ConfigurationError(f"the KV codec codes {width} channels per layer; this model's layers hold {dim} "
                                         f"({cfg.num_key_value_heads} KV heads x {head_dim}). Fix: the codec file of "
                                         "this model")
            if kv_codec.pre_rope:
                import numpy as np

                from .kvcodec import rope_of

                mine = rope_of(model)
                if mine.inv_freq.shape != kv_codec.rope.inv_freq.shape or not np.allclose(
                        mine.inv_freq, kv_codec.rope.inv_freq, rtol=1e-6) or mine.scaling != kv_codec.rope.scaling:
                    raise ConfigurationError("the KV codec codes keys before RoPE with other rotary frequencies than "
                                             "this model's. Fix: the codec file of this model")
        num_layers = len(held) if num_layers is None else int(num_layers)
        if held != list(range(num_layers)):
            raise ConfigurationError(f"the KV codec holds layers {held[0]}..{held[-1]} ({len(held)}); the model has "
                                     f"{num_layers}. Fix: the codec file of this model")
        codecs = [tuple(kv_codec.tensor_codec(i, kind, lane_tokens, lanes_by_component) for kind in "kv")
                  for i in range(num_layers)]
        return cls(num_layers, "compressed_fetch", codecs=codecs, sink=kv_codec.sink,
                   rope=kv_codec.rope if kv_codec.pre_rope else None, **kwargs)

    # -- public helpers --------------------------------------------------------------------------------
    @property
    def on_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def stored_bytes(self, value_bytes: int | None = None) -> int:
        """Bytes of every layer's stored form (host memory, or GPU memory for gpu_resident); value_bytes:
        raw rows counted at this many bytes a value (2: as bf16, the unit of a compression ratio)."""
        return sum(layer.nbytes_stored(value_bytes) for layer in self.layers)

    def stored_tokens(self) -> int:
        """Tokens of each layer held in the stored form (raw sink rows and coded chunks; the recent window not)."""
        return self.layers[0].stored if self.layers else 0

    def fetched_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K rows, V rows) [T, D] of one layer as attention would see them now (fetched through the same
        path as a step: stored form + recent window), as new tensors: for checking a round trip."""
        layer = self.layers[layer_idx]
        if layer.length == 0:
            raise TensorCodecError(f"layer {layer_idx} holds no tokens yet")
        if self.mode == "gpu_resident":
            return layer.store_k[:layer.length].clone(), layer.store_v[:layer.length].clone()
        self.drain()
        self._release()
        fetch = self._take(layer_idx)
        self._check_decodes(wait=True)
        if self.coefficients:
            none = torch.empty((0, layer.dim), dtype=layer.dtype, device=self.device)
            got = self._coefficient_kv(layer_idx, fetch, none, none)
            self._in_use = fetch.slot
            return got.reconstructed()
        k, v = self._assemble(layer, fetch, None, None)
        self._in_use = fetch.slot
        return k.clone(), v.clone()

    def fork(self) -> "SpillCache":
        """A new cache, made with this one's settings, holding a copy of its KV: what beam search needs when a
        beam survives twice. The stored form is copied as it is (coded chunks are not decoded and coded
        again, so the twin's values are this cache's exactly); host copies cost the stored bytes, a coded
        cache's a fraction of its raw size. The twin makes its own staging buffers and decode plans."""
        self.drain()  # queued copies and decodes finish before their buffers are read
        twin = SpillCache(len(self.layers), **self._settings)
        for mine, theirs in zip(self.layers, twin.layers):
            _copy_layer(mine, theirs)
        started = [layer for layer in twin.layers if layer.is_initialized]
        if started:
            twin._setup(started[0])  # the device, the copy and decode streams, as the first update would
        return twin

    def flush(self) -> None:
        """Move every layer's recent window to the stored form now (e.g. right after a prompt)."""
        for i, layer in enumerate(self.layers):
            if self.mode != "gpu_resident" and layer.recent:
                self._flush(i, layer.recent_k[:layer.recent].contiguous(), layer.recent_v[:layer.recent].contiguous())
                layer.recent = 0

    def drain(self) -> None:
        """Wait for every queued fetch, check every queued decode, and forget the prefetched fetches."""
        self._pending.clear()
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        self._check_decodes(wait=True)

    def close(self) -> None:
        """Wait for queued fetches and let go of the GPU buffers and decode plans."""
        self.drain()
        for layer in self.layers:
            if isinstance(layer, SpillLayer):
                layer.plans.clear()
        self._slots, self._stage, self._scratch = [], [], None

    # -- the Cache API ----------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The Cache API: store this call's K/V of a layer and return the layer's whole K and V
        [1, kv_heads, T, head_dim] (with coefficients=True, reconstructed from the coefficient rows)."""
        got = self._update(key_states, value_states, layer_idx)
        if not isinstance(got, CoefficientKV):
            return got
        layer = self.layers[layer_idx]
        k, v = got.reconstructed()
        return rows_to_states(k, layer.heads).contiguous(), rows_to_states(v, layer.heads).contiguous()

    def update_coefficients(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> CoefficientKV:
        """update() for an attention that reads coefficient rows (a cache made with coefficients=True): the
        stored tokens come back as the decoder wrote them, never reconstructed (see CoefficientKV)."""
        if not self.coefficients:
            raise ConfigurationError("update_coefficients needs a cache made with coefficients=True")
        return self._update(key_states, value_states, layer_idx)

    def _update(self, key_states, value_states, layer_idx: int):
        layer = self.layers[layer_idx]
        self._check(key_states, value_states, layer, layer_idx)
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        if self.device is None or not self._slots_fit(layer):
            self._setup(layer)
        k_new, v_new = states_to_rows(key_states), states_to_rows(value_states)
        n = k_new.shape[0]
        if self.mode == "gpu_resident":
            k, v = self._append_resident(layer, k_new, v_new)
            return self._out(k, layer), self._out(v, layer)
        if layer.length == 0:  # nothing stored yet: attention needs only the new tokens
            self._release()
            self._append(layer_idx, k_new, v_new)
            layer.length = n
            self._prefetch_after(layer_idx)
            if self.coefficients:
                return self._coefficient_kv(layer_idx, None, k_new, v_new)
            return key_states, value_states
        self._release()
        self._ensure_slots(layer.length + n, layer.dim, layer.dtype)
        fetch = self._take(layer_idx)
        if self.coefficients:
            out = self._coefficient_kv(layer_idx, fetch, k_new, v_new)
        else:
            k, v = self._assemble(layer, fetch, k_new, v_new)
            out = self._out(k, layer), self._out(v, layer)
        self._in_use = fetch.slot
        self._append(layer_idx, k_new, v_new)
        layer.length += n
        queued = len(self._unchecked)
        self._prefetch_after(layer_idx)
        if self._unchecked:  # once per step, at the last layer (its decode queued, the next one too): the
            # step's payload checks, before its attention output leaves this call
            self._check_decodes(wait=layer_idx == len(self.layers) - 1, upto=queued)
        return out

    def _coefficient_kv(self, layer_idx: int, fetch, k_new, v_new) -> CoefficientKV:
        """The fetched coefficient rows (views of the slot) and the recent window + new rows (copied to
        the slot's plain rows, from its start)."""
        layer = self.layers[layer_idx]
        codec_k, codec_v = self.codecs[layer_idx]
        proj_k, proj_v = (c._projection(layer.dim, self.device) for c in (codec_k, codec_v))
        wk, wv = proj_k.coefficient_width(), proj_v.coefficient_width()
        stored = 0 if fetch is None else fetch.tokens
        if fetch is not None and stored != layer.stored:
            raise TensorCodecError("internal: a fetch of a stale stored form was used")
        if fetch is None:
            rows_k = torch.empty((0, wk), dtype=torch.bfloat16, device=self.device)
            rows_v = torch.empty((0, wv), dtype=torch.bfloat16, device=self.device)
            return CoefficientKV(rows_k, rows_v, proj_k.coefficient_weights(), proj_v.coefficient_weights(),
                                 k_new, v_new)
        slot = self._slots[fetch.slot]
        # the slot's plain rows: the raw sink rows (placed there by the fetch), the recent window, the new rows
        sink, r, n = layer.sink, layer.recent, k_new.shape[0]
        if r:
            slot.k[sink:sink + r].copy_(layer.recent_k[:r])
            slot.v[sink:sink + r].copy_(layer.recent_v[:r])
        slot.k[sink + r:sink + r + n].copy_(k_new)
        slot.v[sink + r:sink + r + n].copy_(v_new)
        coded = stored - sink
        return CoefficientKV(slot.ck[:coded * wk].view(coded, wk), slot.cv[:coded * wv].view(coded, wv),
                             proj_k.coefficient_weights(), proj_v.coefficient_weights(), slot.k[:sink + r + n],
                             slot.v[:sink + r + n], sink)

    def reset(self) -> None:
        self.drain()
        for i in range(len(self.layers)):
            self.layers[i] = SpillLayer(self, i)
        self._in_use = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last tokens (negative count, as transformers passes it, or a positive final length
        as older releases did), as assisted decoding does after rejected candidates. Tokens of the
        recent window go at once; stored chunks past the new length are dropped, and the kept part of
        the chunk the cut falls in comes back to the recent window (decoded: the values attention read)."""
        if tokens_to_remove == 0:
            return
        for i, layer in enumerate(self.layers):
            target = tokens_to_remove if tokens_to_remove > 0 else layer.length + tokens_to_remove
            drop = layer.length - max(target, 0)
            if drop <= 0:
                continue
            if self.mode == "gpu_resident":
                layer.length = layer.stored = layer.length - drop
                continue
            if drop <= layer.recent:
                layer.recent -= drop
                layer.length -= drop
                continue
            self._crop_stored(i, layer.length - drop)

    def _crop_stored(self, layer_idx: int, keep: int) -> None:
        """Cut a layer to its first `keep` tokens, `keep` < its stored tokens."""
        layer = self.layers[layer_idx]
        if self.on_cuda:
            self.drain()  # queued fetches may read what is cut
        if self.mode == "raw_fetch":  # the rows stay where they are; the next flush writes over the rest
            layer.stored = layer.length = keep
            layer.recent = 0
            layer.version += 1
            return
        chunks = layer.chunks()
        starts = [a for a, _ in chunks]
        kept = [c for c, a in enumerate(starts) if a < keep]
        last = kept[-1] if kept else None
        rows = None
        if keep < layer.sink:  # the cut falls in the raw sink rows: every chunk goes
            layer.sink = keep
        if last is not None and sum(chunks[last]) > keep:  # the cut falls inside this chunk
            _, blob_k, blob_v = layer.blobs[last]
            k_rows, v_rows = self._decode_rows(layer_idx, [blob_k, blob_v], chunks[last:last + 1],
                                               self.device if self.on_cuda else None)
            n = keep - starts[last]
            rows = (k_rows[:n].to(self.device, layer.dtype), v_rows[:n].to(self.device, layer.dtype))
            kept = kept[:-1]
        stored = min(keep, starts[len(kept)] if len(kept) < len(starts) else layer.stored)
        self._keep_chunks(layer, len(kept))
        layer.stored, layer.recent = stored, 0
        layer.version += 1
        if rows is not None:
            n = rows[0].shape[0]
            if layer.recent_k is None or layer.recent_k.shape[0] < max(n + 1, self.chunk_tokens):
                layer.recent_k = torch.empty((max(n + 1, self.chunk_tokens), layer.dim), dtype=layer.dtype,
                                             device=layer.device)
                layer.recent_v = torch.empty_like(layer.recent_k)
            layer.recent_k[:n].copy_(rows[0])
            layer.recent_v[:n].copy_(rows[1])
            layer.recent = n
        layer.length = keep

    # -- setup -------------------------------------------------------------------------------------------
    def _check(self, k: torch.Tensor, v: torch.Tensor, layer: SpillLayer, idx: int) -> None:
        if k.dim() != 4 or k.shape != v.shape:
            raise InvalidTensorError(f"layer {idx}: key and value states must be [batch, kv_heads, T, head_dim] "
                                     f"of one shape; got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[0] != 1:
            raise InvalidTensorError(f"SpillCache holds one sequence (batch 1); got batch {k.shape[0]}. Fix: "
                                     "BatchSpillCache (same arguments) for a batch")
        if layer.is_initialized and (k.shape[1] * k.shape[3] != layer.dim or k.dtype != layer.dtype
                                     or k.device != layer.device):
            raise InvalidTensorError(f"layer {idx} holds {layer.dtype} KV of {layer.dim} channels on {layer.device}; "
                                     f"got {k.dtype} {tuple(k.shape)} on {k.device}")
        if self.device is not None and k.device != self.device:
            raise InvalidTensorError(f"this cache computes on {self.device}; layer {idx} sent KV on {k.device}. "
                                     "Fix: one cache per device (the model on one device)")

    def _slots_fit(self, layer: SpillLayer) -> bool:
        return not self._slots or (self._slots[0].k.shape[1] == layer.dim and self._slots[0].k.dtype == layer.dtype)

    def _setup(self, layer: SpillLayer) -> None:
        if not self._slots_fit(layer):
            raise InvalidTensorError("every layer of a SpillCache must hold the same number of KV channels and "
                                     f"dtype (staging is shared): got {layer.dim} {layer.dtype} after "
                                     f"{self._slots[0].k.shape[1]} {self._slots[0].k.dtype}")
        if self.device is not None:
            return
        if self.mode == "compressed_fetch":  # a codec made for another model is refused before anything is coded
            for i, pair in enumerate(self.codecs):
                for kind, codec in zip("KV", pair):
                    dim = getattr(getattr(codec, "basis", None), "dim", None)
                    if dim is not None and dim != layer.dim:
                        raise ConfigurationError(
                            f"layer {i}'s {kind} codec has a basis for {dim} channels; this model's layers hold "
                            f"{layer.dim} KV channels ({layer.heads} KV heads x {layer.head_dim}). Fix: codecs "
                            "fitted on this model's KV")
        self.device = layer.device
        if self.keep_decoded is None:
            self.keep_decoded = not self.on_cuda
        if self.coefficients and layer.dtype != torch.bfloat16:
            raise ConfigurationError(f"coefficients=True reads the GPU decoder's bf16 coefficient rows; this model's KV is "
                                     f"{layer.dtype}. Fix: a bfloat16 model, or coefficients=False")
        if self.coefficients and not self.on_cuda:
            raise ConfigurationError("coefficients=True reads the GPU decoder's coefficient rows; this cache computes "
                                     f"on {self.device}. Fix: coefficients=False on a CPU")
        if self.on_cuda and self.mode != "gpu_resident":
            # torch hands out streams from a pool of 32: the copy and decode streams must not be the
            # compute stream, each other, or the stream graphs are captured on by default (a decode plan's
            # GEMMs, captured on the decode stream, keep that stream's cuBLAS workspace; sharing it with
            # GEMMs running at the same time elsewhere corrupts them or hangs)
            taken = {torch.cuda.current_stream(self.device).cuda_stream}
            default_capture = getattr(torch.cuda.graph, "default_capture_stream", None)
            if default_capture is not None:
                taken.add(default_capture.cuda_stream)
            self._copy_stream = _stream_apart(self.device, taken)
            if self.mode == "compressed_fetch":
                self._decode_stream = _stream_apart(self.device, taken | {self._copy_stream.cuda_stream})
                self._pool = torch.cuda.graph_pool_handle()

    def _pin(self) -> bool:
        return self.on_cuda

    def _ensure_slots(self, tokens: int, dim: int, dtype) -> None:
        if self._slots and self._slots[0].k.shape[0] >= tokens:
            return
        capacity = _round_up(max(tokens + self.chunk_tokens, self.max_tokens or 0))
        if self._slots:  # grow: nothing may still read or write the old slots
            self.drain()
            self._in_use = None
        self._slots = []
        for _ in range(SLOTS):
            k = torch.empty((capacity, dim), dtype=dtype, device=self.device)
            slot = _Slot(k, torch.empty_like(k), torch.cuda.Event() if self.on_cuda else None)
            if self.coefficients:
                width = max(max(self._widths(i)) for i in range(len(self.layers)))
                slot.ck = torch.empty(capacity * width, dtype=torch.bfloat16, device=self.device)
                slot.cv = torch.empty_like(slot.ck)
            for stream in (self._copy_stream, self._decode_stream):  # written there: freed only once it is done
                if stream is not None:
                    for t in (slot.k, slot.v, slot.ck, slot.cv):
                        if t is not None:
                            t.record_stream(stream)
            self._slots.append(slot)

    def _widths(self, layer_idx: int) -> tuple[int, int]:
        """The coefficient-row widths of a layer's K and V codecs."""
        dim = next(layer.dim for layer in self.layers if layer.dim)
        return tuple(c._projection(dim, self.device).coefficient_width() for c in self.codecs[layer_idx])

    # -- storing -----------------------------------------------------------------------------------------
    def _append_resident(self, layer: SpillLayer, k_new, v_new):
        need = layer.length + k_new.shape[0]
        if layer.store_k is None or layer.store_k.shape[0] < need:
            capacity = _round_up(max(need + self.chunk_tokens, self.max_tokens or 0))
            k_store = torch.empty((capacity, layer.dim), dtype=layer.dtype, device=layer.device)
            v_store = torch.empty_like(k_store)
            if layer.length:
                k_store[:layer.length].copy_(layer.store_k[:layer.length])
                v_store[:layer.length].copy_(layer.store_v[:layer.length])
            layer.store_k, layer.store_v = k_store, v_store
        layer.store_k[layer.length:need].copy_(k_new)
        layer.store_v[layer.length:need].copy_(v_new)
        layer.length = layer.stored = need
        return layer.store_k[:need], layer.store_v[:need]

    def _append(self, layer_idx: int, k_new, v_new) -> None:
        """New rows into the recent window; a full window (or a call of chunk_tokens or more) is flushed."""
        layer = self.layers[layer_idx]
        n = k_new.shape[0]
        prompt = self.store_prompt and layer.length == 0 and n > 1  # the first call's tokens: stored at once
        if layer.recent + n < self.chunk_tokens and not prompt:
            if layer.recent_k is None:
                layer.recent_k = torch.empty((self.chunk_tokens, layer.dim), dtype=layer.dtype, device=layer.device)
                layer.recent_v = torch.empty_like(layer.recent_k)
            layer.recent_k[layer.recent:layer.recent + n].copy_(k_new)
            layer.recent_v[layer.recent:layer.recent + n].copy_(v_new)
            layer.recent += n
            return
        if layer.recent:
            k_new = torch.cat([layer.recent_k[:layer.recent], k_new])
            v_new = torch.cat([layer.recent_v[:layer.recent], v_new])
        self._flush(layer_idx, k_new.contiguous(), v_new.contiguous())
        layer.recent = 0

    def _flush(self, layer_idx: int, k_rows, v_rows) -> None:
        layer = self.layers[layer_idx]
        m = k_rows.shape[0]
        if self.mode == "raw_fetch":
            need = layer.stored + m
            if layer.store_k is None or layer.store_k.shape[0] < need:
                capacity = _round_up(max(need + self.chunk_tokens, self.max_tokens or 0))
                if layer.store_k is not None and self.on_cuda:
                    self.drain()  # queued copies may still read the old host buffer
                k_host = torch.empty((capacity, layer.dim), dtype=layer.dtype, pin_memory=self._pin())
                v_host = torch.empty((capacity, layer.dim), dtype=layer.dtype, pin_memory=self._pin())
                if layer.stored:
                    k_host[:layer.stored].copy_(layer.store_k[:layer.stored])
                    v_host[:layer.stored].copy_(layer.store_v[:layer.stored])
                layer.store_k, layer.store_v = k_host, v_host
            layer.store_k[layer.stored:need].copy_(k_rows)  # device -> pinned host (waits for the stream)
            layer.store_v[layer.stored:need].copy_(v_rows)
        else:
            k_rows, v_rows = self._keep_sink(layer, k_rows, v_rows)
            coded = k_rows.shape[0]
            if coded:
                if self.rope is not None:  # keys coded as they were before RoPE, at their absolute positions
                    k_rows = self.rope.invert(k_rows, layer.stored + m - coded).to(layer.dtype).contiguous()
                codec_k, codec_v = self.codecs[layer_idx]
                self._store_chunk(layer, coded, *encode_blobs([codec_k, codec_v], [k_rows, v_rows]))
                if self.merge_chunks:
                    self._merge_tail(layer_idx)
        layer.stored += m
        layer.version += 1
        self.stats.flushes += 1
        self.stats.flushed_tokens += m

    def _merge_tail(self, layer_idx: int) -> None:
        """Joins the layer's last two stored chunks into one while the older holds no more tokens than the
        newer (a binary counter: a layer keeps about log2(stored / chunk_tokens) + 1 chunks, not one per
        flush), as integer symbols (TensorCodec.join: every decoded value stays what it was). Each chunk's
        containers bring their own tables, which a step decodes and looks up again: a 64K-token layer kept
        as 1024-token chunks decodes about 12x slower than as one container (docs/findings.md)."""
        layer = self.layers[layer_idx]
        codec_k, codec_v = self.codecs[layer_idx]
        if not (codec_k.symbols and codec_v.symbols):
            return
        device = self.device if self.on_cuda else None  # a GPU's coder joins a long context's chunks in ms
        while len(layer.blobs) >= 2 and layer.blobs[-2][0] <= layer.blobs[-1][0]:
            (m1, k1, v1), (m2, k2, v2) = layer.blobs[-2:]
            blob_k, blob_v = codec_k.join([k1, k2], device), codec_v.join([v1, v2], device)
            if self.on_cuda:
                self.drain()  # queued copies may still read the bytes about to be written over
            self._keep_chunks(layer, len(layer.blobs) - 2)
            self._store_chunk(layer, m1 + m2, blob_k, blob_v)
            self.stats.merges += 1

    def _store_chunk(self, layer: SpillLayer, m: int, blob_k, blob_v) -> None:
        """A coded chunk of m tokens after the layer's others: packed into its pinned buffer on CUDA, its
        containers' bytes kept on a CPU."""
        if self.on_cuda:
            self._pack(layer, m, blob_k, blob_v)
        else:
            layer.blobs.append((m, _host_bytes(blob_k), _host_bytes(blob_v)))

    @staticmethod
    def _keep_chunks(layer: SpillLayer, n: int) -> None:
        """Drops the layer's stored chunks past its first n: their blobs, their kept decoded rows and, on CUDA,
        their bytes in the packed buffer (the next chunk packs where the kept ones end) and every plan."""
        layer.blobs, layer.decoded = layer.blobs[:n], layer.decoded[:n]
        if layer.places:
            layer.places, layer.container_heads = layer.places[:2 * n], layer.container_heads[:2 * n]
            layer.packed_len = _align(sum(layer.places[-1]), PACK_ALIGN) if layer.places else 0
            layer.plans.clear()

    def _keep_sink(self, layer: SpillLayer, k_rows, v_rows):
        """The layer's first `sink` tokens go to its raw sink rows; returns the rows left to code."""
        take = min(self.sink - layer.sink, k_rows.shape[0])
        if take <= 0:
            return k_rows, v_rows
        if layer.sink_k is None:
            layer.sink_k = torch.empty((self.sink, layer.dim), dtype=layer.dtype, device=layer.device)
            layer.sink_v = torch.empty_like(layer.sink_k)
        layer.sink_k[layer.sink:layer.sink + take].copy_(k_rows[:take])
        layer.sink_v[layer.sink:layer.sink + take].copy_(v_rows[:take])
        layer.sink += take
        return k_rows[take:], v_rows[take:]

    def _decode_rows(self, layer_idx: int, containers, chunks, device=None) -> list:
        """The rows [k0, v0, k1, v1, ...] of a layer's containers (K and V of each chunk of `chunks`, in its
        order; device None: the CPU decoder), keys rotated forward again where the codec coded them before
        RoPE (the graph-replayed decode does that in _after_decode). A corrupt container raises
        BitstreamError naming the layer, K or V, and the chunk's tokens."""
        if not containers:
            return []
        codec_k, codec_v = self.codecs[layer_idx]
        pairs = [codec_k, codec_v] * (len(containers) // 2)
        try:
            outs = decode_blobs(pairs, containers, device)
        except BitstreamError as error:  # which one: decoded alone, in order (a rare path)
            for c, (codec, blob) in enumerate(zip(pairs, containers)):
                try:
                    decode_blobs([codec], [blob], device)
                except BitstreamError as alone:
                    first, tokens = chunks[c // 2]
                    raise BitstreamError(f"layer {layer_idx}: the {'KV'[c % 2]} container of tokens {first}.."
                                         f"{first + tokens - 1} is corrupt ({alone})") from None
            raise BitstreamError(f"layer {layer_idx}: {error}") from None
        if self.rope is not None:
            outs[0::2] = [self.rope.apply(k, first).to(k.dtype) for (first, _), k in zip(chunks, outs[0::2])]
        return outs

    # -- fetching ----------------------------------------------------------------------------------------
    def _release(self) -> None:
        """Everything queued so far (the attention that read the slot in use) comes before the slot's reuse."""
        if self._in_use is not None and self.on_cuda:
            self._slots[self._in_use].released.record(torch.cuda.current_stream(self.device))
        self._in_use = None

    def _issue(self, layer_idx: int) -> _Fetch:
        layer = self.layers[layer_idx]
        self._ensure_slots(layer.length + 1, layer.dim, layer.dtype)
        slot = self._next_slot
        self._next_slot = (slot + 1) % SLOTS
        for other in [i for i, f in self._pending.items() if f.slot == slot]:
            del self._pending[other]  # its slot is taken: fetched again when needed
        fetch = _Fetch(layer_idx, slot, layer.version, layer.stored, layer.blobs[:])
        if self.on_cuda:
            fetch.ready = torch.cuda.Event()
        self.stats.fetches += 1
        self._run(fetch)
        return fetch

    def _take(self, layer_idx: int) -> _Fetch:
        fetch = self._pending.pop(layer_idx, None)
        if fetch is None or fetch.version != self.layers[layer_idx].version:
            fetch = self._issue(layer_idx)
        if self.on_cuda:
            torch.cuda.current_stream(self.device).wait_event(fetch.ready)
        return fetch

    def _prefetch_after(self, layer_idx: int) -> None:
        if not (self.prefetch_enabled and self.on_cuda):
            return
        nxt = (layer_idx + 1) % len(self.layers)
        if nxt not in self._pending and self.layers[nxt].stored:
            self._pending[nxt] = self._issue(nxt)

    def _run(self, fetch: _Fetch) -> None:
        """Fill the fetch's slot with the layer's stored rows (queued on side streams on CUDA)."""
        layer, slot, n = self.layers[fetch.layer], self._slots[fetch.slot], fetch.tokens
        if n == 0:  # everything is in the recent window
            if self.on_cuda:
                fetch.ready.record(torch.cuda.current_stream(self.device))
            return
        if self.mode == "raw_fetch":
            self.stats.fetched_bytes += 2 * n * layer.dim * layer.dtype.itemsize
            if not self.on_cuda:
                slot.k[:n].copy_(layer.store_k[:n])
                slot.v[:n].copy_(layer.store_v[:n])
                return
            stream = self._copy_stream
            stream.wait_event(slot.released)
            with torch.cuda.stream(stream):
                mark = self._mark(fetch.layer, "copy", stream)
                slot.k[:n].copy_(layer.store_k[:n], non_blocking=True)
                slot.v[:n].copy_(layer.store_v[:n], non_blocking=True)
                if mark:
                    mark[3].record(stream)
                fetch.ready.record(stream)
            return
        blobs = fetch.blobs
        if not self.on_cuda:
            self.stats.fetched_bytes += sum(_nbytes(k) + _nbytes(v) for _, k, v in blobs)
            chunks = layer.chunks()
            if self.keep_decoded:
                done = len(layer.decoded)
                new = self._decode_rows(fetch.layer, [b for _, k, v in blobs[done:] for b in (k, v)], chunks[done:])
                layer.decoded += list(zip(new[0::2], new[1::2]))
                outs = [t for pair in layer.decoded for t in pair]
            else:
                outs = self._decode_rows(fetch.layer, [b for _, k, v in blobs for b in (k, v)], chunks)
            self._place(slot, layer, blobs, outs)
            return
        # CUDA: the layer's packed containers cross in one copy, then its plan decodes them into the slot
        nbytes = layer.packed_len
        self.stats.fetched_bytes += nbytes
        s = fetch.slot
        self._ensure_stage(max(other.packed_len for other in self.layers))  # sized once for every layer
        copy, decode = self._copy_stream, self._decode_stream
        copy.wait_event(self._stage_free[s])
        with torch.cuda.stream(copy):
            mark = self._mark(fetch.layer, "copy", copy)
            self._stage[s][:nbytes].copy_(layer.packed[:nbytes], non_blocking=True)
            if mark:
                mark[3].record(copy)
            self._staged_events[s].record(copy)
        decode.wait_event(self._staged_events[s])
        decode.wait_event(slot.released)
        if layer.dtype != torch.bfloat16 or not self.staged or not blobs:  # StagedDecode reconstructs bf16: other dtypes
            with torch.cuda.stream(decode):  # (and staged=False) take decode_many, which reads the headers and
                # checks the payloads on the host
                views = [self._stage[s][a:a + n] for a, n in layer.places]
                outs = self._decode_rows(fetch.layer, views, layer.chunks(), self.device)
                self._place(slot, layer, blobs, outs)
                self._stage_free[s].record(decode)
                fetch.ready.record(decode)
            return
        with torch.cuda.stream(decode):
            plan = self._plan(fetch.layer, s)
            mark = self._mark(fetch.layer, "decode", decode)
            plan.replay()
            if mark:
                mark[3].record(decode)
            self._stage_free[s].record(decode)
            fetch.ready.record(decode)
        self._unchecked.append(_Decoded(fetch.layer, plan, layer.chunks(), fetch.ready))

    def _mark(self, layer_idx: int, stage: str, stream):
        """With timeline on: a (layer, stage, start, end) entry whose start is recorded now on stream."""
        if self.timeline is None:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        self.timeline.append((layer_idx, stage, start, end))
        return self.timeline[-1]

    def timeline_ms(self) -> list[dict]:
        """The recorded spans (after a synchronize): layer, stage ("copy" / "decode"), start and end in ms
        from the first span's start."""
        torch.cuda.synchronize(self.device)
        if not self.timeline:
            return []
        origin = self.timeline[0][2]
        return [dict(layer=layer, stage=stage, start_ms=origin.elapsed_time(a), end_ms=origin.elapsed_time(b))
                for layer, stage, a, b in self.timeline]

    # -- compressed_fetch on CUDA: packed containers, staging, plans ---------------------------------
    def _pack(self, layer: SpillLayer, m: int, blob_k, blob_v) -> None:
        """Append a chunk's two containers to the layer's pinned buffer (each starting PACK_ALIGN-aligned)."""
        blobs = [b if isinstance(b, torch.Tensor) else torch.frombuffer(bytearray(b), dtype=torch.uint8)
                 for b in (blob_k, blob_v)]
        need = layer.packed_len + sum(_align(b.numel(), PACK_ALIGN) for b in blobs)
        if layer.packed is None or layer.packed.numel() < need:
            if layer.packed is not None:
                self.drain()  # queued copies may still read the old buffer
            grown = torch.empty(_align(max(need + need // 4, BYTES_STEP), BYTES_STEP), dtype=torch.uint8,
                                pin_memory=True)
            if layer.packed_len:
                grown[:layer.packed_len].copy_(layer.packed[:layer.packed_len])
            layer.packed = grown
        for blob in blobs:
            offset = layer.packed_len
            layer.packed[offset:offset + blob.numel()].copy_(blob.reshape(-1))  # waits for the encode
            layer.places.append((offset, blob.numel()))
            layer.container_heads.append(bytes(layer.packed[offset:offset + min(blob.numel(), HEAD_BYTES)].numpy()))
            layer.packed_len = _align(offset + blob.numel(), PACK_ALIGN)
        views = [layer.packed[a:a + n] for a, n in layer.places]
        layer.blobs = [(tokens, k, v) for (tokens, _, _), k, v in zip(layer.blobs + [(m, None, None)], views[0::2],
                                                                        views[1::2])]
        layer.plans.clear()

    def _ensure_stage(self, nbytes: int) -> None:
        if self._stage and self._stage[0].numel() >= nbytes:
            return
        if self._stage:  # grow: nothing may still read the old buffers, and every plan names them
            self.drain()
            for layer in self.layers:
                layer.plans.clear()
        size = _align(max(nbytes + nbytes // 4, BYTES_STEP), BYTES_STEP)
        self._stage = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(SLOTS)]
        self._staged_events = [torch.cuda.Event() for _ in range(SLOTS)]
        self._stage_free = [torch.cuda.Event() for _ in range(SLOTS)]
        for event in self._stage_free:
            event.record(torch.cuda.current_stream(self.device))

    def _plan(self, layer_idx: int, s: int) -> StagedDecode:
        """The layer's decode from staging buffer s into slot s (made at its first use after a flush)."""
        layer, slot = self.layers[layer_idx], self._slots[s]
        where = (self._stage[s].data_ptr(), slot.k.data_ptr(), None if self._scratch is None else self._scratch.data_ptr())
        held = layer.plans.get(s)
        if held is not None and held[0] == layer.version and held[1] == where:
            return held[2]
        codec_k, codec_v = self.codecs[layer_idx]
        codecs = [codec_k, codec_v] * len(layer.blobs)
        wk, wv = self._widths(layer_idx)
        outs = []
        if self.coefficients:  # the decoder's rows are the output: no reconstruction, no scratch; coded tokens
            for a, m in layer.chunks():  # start after the raw sink rows, coefficient rows at the slot's start
                a -= layer.sink
                outs += [slot.ck[a * wk:(a + m) * wk].view(m, wk), slot.cv[a * wv:(a + m) * wv].view(m, wv)]
            need = 0
        else:
            for a, m in layer.chunks():
                outs += [slot.k[a:a + m], slot.v[a:a + m]]
            need = StagedDecode.scratch_bytes([(1, m, w) for _, m in layer.chunks() for w in (wk, wv)])
        if need and (self._scratch is None or self._scratch.numel() < need):
            # plans replay one after another on the decode stream, so they share it; a larger one
            # renames it, so every plan is made again
            torch.cuda.current_stream(self.device).synchronize()
            for other in self.layers:
                other.plans.clear()
            self._scratch = torch.empty(_align(need + need // 4, BYTES_STEP), dtype=torch.uint8, device=self.device)
            where = where[:2] + (self._scratch.data_ptr(),)
        if not any(other.plans for other in self.layers):
            # a pool whose graphs are all gone may not take a new capture (torch's allocator asserts): plans
            # share a pool only while one of them lives
            self._pool = torch.cuda.graph_pool_handle()
        try:
            plan = StagedDecode(codecs, layer.container_heads, [n for _, n in layer.places], [a for a, _ in layer.places],
                                self._stage[s], outs, scratch=self._scratch if need else None, pool=self._pool,
                                reconstruct=not self.coefficients, stream=self._decode_stream,
                                after=self._after_decode(layer, slot))
        except BitstreamError as error:
            raise BitstreamError(f"layer {layer_idx}: {error}") from None
        layer.plans[s] = (layer.version, where, plan)
        return plan

    def _after_decode(self, layer: SpillLayer, slot: _Slot):
        """What a layer's decode plan does after decoding into the slot: the raw sink rows in front, and
        the decoded keys rotated forward again (codecs that code keys before RoPE); None where neither."""
        sink, stored = layer.sink, layer.stored
        if not sink and (self.rope is None or stored == sink):
            return None
        if self.rope is not None and (self._rope_table is None or self._rope_table[0].shape[0] < stored):
            cos, sin = self.rope.cos_sin(torch.arange(slot.k.shape[0], device=self.device))
            self._rope_table = (cos.float().contiguous(), sin.float().contiguous())
        table = self._rope_table

        def after():
            self._place_sink(slot, layer, sink)
            if self.rope is not None and stored > sink:
                _rotate_forward(slot.k[sink:stored], table[0][sink:stored], table[1][sink:stored], self.rope.head_dim)
        return after

    def _check_decodes(self, wait: bool, upto: int | None = None) -> None:
        """Read the payload checks of queued decodes that are done (all of the first `upto`, or of all,
        when `wait`): a corrupt container raises BitstreamError naming its layer, K or V, and chunk."""
        upto = len(self._unchecked) if upto is None else upto
        pending = []
        for i, job in enumerate(self._unchecked):
            if not (wait and i < upto) and not job.done.query():
                pending.append(job)
                continue
            job.done.synchronize()
            bad = job.plan.corrupt()
            if bad is not None:
                self._unchecked = []
                first, tokens = job.chunks[bad // 2]
                raise BitstreamError(f"layer {job.layer}: the {'KV'[bad % 2]} container of tokens {first}.."
                                     f"{first + tokens - 1} is corrupt (its checksum, tables or lane states do not "
                                     "check out): the cache's stored copy was damaged in host memory or on the way; "
                                     "this step's output is not to be used")
        self._unchecked = pending

    @staticmethod
    def _place_sink(slot: _Slot, layer: SpillLayer, sink: int) -> None:
        """The layer's first `sink` raw rows to the front of the slot."""
        if sink:
            slot.k[:sink].copy_(layer.sink_k[:sink])
            slot.v[:sink].copy_(layer.sink_v[:sink])

    @staticmethod
    def _place(slot: _Slot, layer: SpillLayer, blobs, outs) -> None:
        offset = layer.sink
        SpillCache._place_sink(slot, layer, offset)
        for (m, _, _), k_rows, v_rows in zip(blobs, outs[0::2], outs[1::2]):
            if k_rows.shape[0] != m or v_rows.shape[0] != m:
                raise TensorCodecError(f"a blob decoded to {k_rows.shape[0]} / {v_rows.shape[0]} tokens, "
                                       f"{m} were stored")
            slot.k[offset:offset + m].copy_(k_rows)
            slot.v[offset:offset + m].copy_(v_rows)
            offset += m

    def _assemble(self, layer: SpillLayer, fetch: _Fetch, k_new, v_new):
        """The slot's fetched rows + the recent window (+ the new rows): views [T, D] of the slot."""
        slot = self._slots[fetch.slot]
        start = fetch.tokens
        if start != layer.stored:
            raise TensorCodecError("internal: a fetch of a stale stored form was used")
        end = start + layer.recent
        if layer.recent:
            slot.k[start:end].copy_(layer.recent_k[:layer.recent])
            slot.v[start:end].copy_(layer.recent_v[:layer.recent])
        if k_new is not None:
            n = k_new.shape[0]
            if end + n > slot.k.shape[0]:
                raise TensorCodecError("internal: staging slot too small")
            slot.k[end:end + n].copy_(k_new)
            slot.v[end:end + n].copy_(v_new)
            end += n
        return slot.k[:end], slot.v[:end]

    def _out(self, rows: torch.Tensor, layer: SpillLayer) -> torch.Tensor:
        states = rows_to_states(rows, layer.heads)
        return states.contiguous() if self.contiguous else states


class _BatchLayer(_ReadOnlyKV, DynamicLayer):
    """One layer of a BatchSpillCache: answers the Cache API's per-layer questions from the sequences'
    own layers (every sequence of a batch holds the same number of tokens, padding included)."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache, index: int):
        super().__init__()
        self._cache, self._index = weakref.ref(cache), index

    def _layers(self) -> list:
        return [seq.layers[self._index] for seq in self._cache().sequences]

    def get_seq_length(self, *args, **kwargs) -> int:
        return self._layers()[0].get_seq_length()

    def get_mask_sizes(self, query, *args, **kwargs) -> tuple[int, int]:
        return self._layers()[0].get_mask_sizes(query)

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def offload(self):
        pass

    def prefetch(self):
        pass

    def _read(self, which: int) -> torch.Tensor | None:
        """keys (0) or values (1) of every sequence, stacked on the batch axis."""
        layers = self._layers()
        if layers[0].length == 0:
            return None
        return torch.cat([layer._read(which) for layer in layers])


class BatchSpillCache(Cache):
    """SpillCache for a batch of sequences: one SpillCache per sequence (each its own stored form, fetch
    pipeline and staging), the batch split on the way in and joined on the way out. generate() drives it
    as it drives DynamicCache: batches with left padding, sampling with num_return_sequences, assisted
    decoding (crop), beam search (a beam that survives twice gets a fork of its sequence's cache: the
    stored form copied as it is, coded chunks not coded again).

    Keys coded before RoPE (from_kv_codec of a codec fitted so): a sequence's stored keys are un-rotated at
    their index in the cache and rotated back at the same index, so a left-padded sequence comes back
    right, its keys coded as rotated by its pad count (slightly off the codec's fitted basis)."""

    def __init__(self, num_layers: int, mode: str = "raw_fetch", **kwargs):
        self._begin(lambda: SpillCache(num_layers, mode, **kwargs))

    @classmethod
    def from_kv_codec(cls, kv_codec, model=None, **kwargs) -> "BatchSpillCache":
        """SpillCache.from_kv_codec for a batch: every sequence coded by the attention-aware KV codec."""
        cache = cls.__new__(cls)
        cache._begin(lambda: SpillCache.from_kv_codec(kv_codec, model, **kwargs))
        return cache

    def _begin(self, make) -> None:
        """make: a new SpillCache for one sequence. The first is made now, so wrong settings (or a codec of
        another model) are refused when this cache is made; the others at the first update."""
        self._make = make
        self.sequences: list[SpillCache] = [make()]
        self._started = False
        Cache.__init__(self, layers=[_BatchLayer(self, i) for i in range(len(self.sequences[0].layers))])

    @property
    def mode(self) -> str:
        return self.sequences[0].mode

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The Cache API: each sequence's K/V [1, kv_heads, T, head_dim] to its own SpillCache; the whole
        layer's K and V of the batch back."""
        batch = int(key_states.shape[0])
        if not self._started:
            self.sequences += [self._make() for _ in range(batch - len(self.sequences))]
            self._started = True
        if batch != len(self.sequences):
            raise InvalidTensorError(f"layer {layer_idx}: this cache holds {len(self.sequences)} sequences; got a batch "
                                     f"of {batch}. Fix: one cache per generate() call")
        outs = [seq.update(key_states[b:b + 1], value_states[b:b + 1], layer_idx, *args, **kwargs)
                for b, seq in enumerate(self.sequences)]
        if batch == 1:
            return outs[0]
        return torch.cat([k for k, _ in outs]), torch.cat([v for _, v in outs])

    def _reordered(self, order: list[int]) -> None:
        """The batch becomes sequences[order[0]], sequences[order[1]], ...: a sequence named once keeps its
        cache, one named again gets a fork of it."""
        if not self._started:  # nothing stored yet: the first update makes one cache per sequence it brings
            return
        if any(not 0 <= i < len(self.sequences) for i in order):
            raise InvalidTensorError(f"this cache holds {len(self.sequences)} sequences; asked for {order}")
        taken: set[int] = set()
        sequences = []
        for i in order:
            sequences.append(self.sequences[i].fork() if i in taken else self.sequences[i])
            taken.add(i)
        self.sequences = sequences

    def reorder_cache(self, beam_idx) -> None:
        self._reordered([int(i) for i in beam_idx])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reordered([i for i in range(len(self.sequences)) for _ in range(int(repeats))])

    def batch_select_indices(self, indices) -> None:
        self._reordered([int(i) for i in indices])

    def crop(self, tokens_to_remove: int) -> None:
        for seq in self.sequences:
            seq.crop(tokens_to_remove)

    def reset(self) -> None:
        for seq in self.sequences:
            seq.reset()

    def stored_bytes(self, value_bytes: int | None = None) -> int:
        """Bytes of every sequence's stored form (see SpillCache.stored_bytes)."""
        return sum(seq.stored_bytes(value_bytes) for seq in self.sequences)

    def stored_tokens(self) -> int:
        """Tokens of each sequence held in the stored form (the same for every sequence of the batch)."""
        return self.sequences[0].stored_tokens()

    def flush(self) -> None:
        """SpillCache.flush of every sequence."""
        for seq in self.sequences:
            seq.flush()

    def drain(self) -> None:
        """SpillCache.drain of every sequence."""
        for seq in self.sequences:
            seq.drain()

    def close(self) -> None:
        """SpillCache.close of every sequence."""
        for seq in self.sequences:
            seq.close()

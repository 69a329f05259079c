"""SpillCache (shared/kvcache.py): driven by transformers' forward and generate() it gives DynamicCache's
output exactly in raw_fetch and gpu_resident modes and stays within its stated quality compressed;
it flushes in chunks, fetches bit-exact, refuses what it cannot do; PoC 17's decoder agrees with its
own prefill. GPU tests (marked gpu) run the CUDA streams, the staged decodes and the CUDA graphs."""
import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from poc_module import load_poc
from shared.basis import fit_basis, fit_basis_torch
from shared.errors import BitstreamError, ConfigurationError, InvalidTensorError, TensorCodecError
from shared.kvcache import MODES, BatchSpillCache, SpillCache, cache_kwarg, rows_to_states, states_to_rows
from shared.llm import cache_kv, kv_to_rows
from shared.pipeline import TensorCodec
from shared.rdquant import find_step, quality

PROMPT, NEW, CHUNK = 40, 24, 8  # prompt tokens, generated tokens, chunk_tokens (so generation flushes)
HEADS, KV_HEADS, HIDDEN = 4, 2, 64  # D = 2 KV heads x 16 = 32 channels


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama(device="cpu"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval().to(device)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def prefill_kv(model, ids):
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, **cache_kwarg(model, cache))
    return [(kv_to_rows(k).clone(), kv_to_rows(v).clone()) for k, v in cache_kv(cache)]


def make_codecs(kv, cos=0.9995):
    codecs = []
    for k_rows, v_rows in kv:
        pair = []
        for rows in (k_rows, v_rows):
            basis = fit_basis([rows], rows.shape[1])
            values = rows.numpy()
            step = find_step(basis.project(values), cos, "cos", reconstruct=basis.reconstruct, reference=values).step
            pair.append(TensorCodec(basis, backend="rans", step=step))
        codecs.append(tuple(pair))
    return codecs


@pytest.fixture(scope="module")
def codecs(llama, prompt):
    return make_codecs(prefill_kv(llama, prompt))


def generate(model, ids, cache, new=NEW):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0, **cache_kwarg(model, cache))


def test_rows_and_states_round_trip():
    states = torch.randn(1, 3, 5, 4)
    rows = states_to_rows(states)
    assert rows.shape == (5, 12) and rows.is_contiguous()
    assert torch.equal(rows, kv_to_rows(states))
    back = rows_to_states(rows, 3)
    assert torch.equal(back, states) and back.data_ptr() == rows.data_ptr()  # a view


@pytest.mark.parametrize("mode", ["raw_fetch", "gpu_resident"])
def test_generate_matches_dynamic_cache_exactly(llama, prompt, mode):
    reference = generate(llama, prompt, DynamicCache())
    cache = SpillCache(2, mode, chunk_tokens=CHUNK)
    assert torch.equal(generate(llama, prompt, cache), reference)
    if mode == "raw_fetch":  # the prompt flushed at once, then every CHUNK generated tokens
        assert cache.stats.flushes == 2 * (1 + (NEW - 1) // CHUNK)
        assert cache.stored_tokens() == PROMPT + CHUNK * ((NEW - 1) // CHUNK)
        assert cache.stats.fetched_bytes > 0


@pytest.mark.parametrize("mode", ["raw_fetch", "gpu_resident"])
def test_forward_logits_and_fetched_kv_bit_exact(llama, prompt, mode):
    ids = torch.cat([prompt, prompt.flip(1)], 1)
    dyn, spill = DynamicCache(), SpillCache(2, mode, chunk_tokens=16)
    with torch.no_grad():
        for cache in (dyn, spill):
            llama(ids[:, :PROMPT], **cache_kwarg(llama, cache))
        a = llama(ids[:, PROMPT:PROMPT + 5], **cache_kwarg(llama, dyn)).logits
        b = llama(ids[:, PROMPT:PROMPT + 5], **cache_kwarg(llama, spill)).logits
    assert torch.equal(a, b)
    assert spill.get_seq_length() == dyn.get_seq_length() == PROMPT + 5
    for i, (k, v) in enumerate(cache_kv(dyn)):  # stored form + the recent window (5 tokens)
        fk, fv = spill.fetched_kv(i)
        assert torch.equal(fk, kv_to_rows(k)) and torch.equal(fv, kv_to_rows(v))


def test_compressed_within_stated_quality(llama, prompt, codecs):
    kv = prefill_kv(llama, prompt)
    cache = SpillCache(2, "compressed_fetch", codecs=codecs, chunk_tokens=CHUNK)
    with torch.no_grad():
        llama(prompt, **cache_kwarg(llama, cache))
    assert cache.stored_tokens() == PROMPT and cache.stats.flushes == 2
    for i, (k_rows, v_rows) in enumerate(kv):
        k, v = cache.fetched_kv(i)
        assert 0.999 <= quality(k_rows, k, "cos") < 1 and 0.999 <= quality(v_rows, v, "cos") < 1
    raw = sum(2 * k.numel() * 2 for k, _ in kv)
    assert 0 < cache.stored_bytes() < 4 * raw  # blobs exist (tiny tensors do not compress)
    reference = generate(llama, prompt, DynamicCache())
    out = generate(llama, prompt, SpillCache(2, "compressed_fetch", codecs=codecs, chunk_tokens=CHUNK))
    assert (out == reference).float().mean() >= 0.9


def test_compressed_decoding_every_step_equals_decoding_once(llama, prompt, codecs):
    outs = [generate(llama, prompt, SpillCache(2, "compressed_fetch", codecs=codecs, chunk_tokens=CHUNK,
                                               keep_decoded=keep), new=10) for keep in (True, False)]
    assert torch.equal(outs[0], outs[1])


def test_a_prompt_shorter_than_a_chunk_is_stored_at_once(llama, prompt, codecs):
    cache = SpillCache(2, "compressed_fetch", codecs=codecs, chunk_tokens=1024)
    generate(llama, prompt, cache, new=20)
    assert cache.stored_tokens() == PROMPT and cache.layers[0].recent == 19 and cache.stored_bytes() > 0


def test_flushed_chunks_are_joined_as_a_binary_counter(llama, prompt, codecs):
    """merge_chunks (the default): a chunk is joined with the one before it while that one is no longer,
    so 3 x 8 + 4 tokens flushed after a prompt leave the prompt, 16 and 8 (not four chunks), and attention
    gets exactly the rows a cache that keeps every chunk apart gives it."""
    caches = [SpillCache(2, "compressed_fetch", codecs=codecs, chunk_tokens=CHUNK, merge_chunks=merge)
              for merge in (True, False)]
    for cache in caches:
        generate(llama, prompt, cache, new=3 * CHUNK + 1)
    merged, apart = caches
    assert [m for m, _, _ in merged.layers[0].blobs] == [PROMPT, 2 * CHUNK, CHUNK]
    assert [m for m, _, _ in apart.layers[0].blobs] == [PROMPT, CHUNK, CHUNK, CHUNK]
    assert merged.stats.merges == 2 and apart.stats.merges == 0  # one a layer
    for i in range(2):  # the same values reconstructed: a joined chunk's rows come from one GEMM, the kept-apart
        # chunks' from two, which a CPU BLAS may round apart by an ulp or two (seen on an AVX512 EPYC); a
        # wrong join would be off by a quantization step (~1e-2)
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(merged.fetched_kv(i), apart.fetched_kv(i)))
    assert merged.stored_bytes() < apart.stored_bytes()


def test_a_corrupt_stored_container_is_named_by_layer_kind_and_tokens(llama, prompt, codecs):
    cache = SpillCache(2, "compressed_fetch", codecs=codecs, chunk_tokens=CHUNK)
    with torch.no_grad():
        llama(prompt, **cache_kwarg(llama, cache))  # the prompt stored as one chunk a layer
        tokens, k, v = cache.layers[1].blobs[0]
        bad = bytearray(v)
        bad[len(bad) // 2] ^= 0x10
        cache.layers[1].blobs[0] = (tokens, k, bytes(bad))
        with pytest.raises(BitstreamError, match=rf"layer 1: the V container of tokens 0\.\.{PROMPT - 1} is corrupt"):
            llama(torch.tensor([[3]]), **cache_kwarg(llama, cache))


def test_flush_spills_the_recent_window(llama, prompt):
    cache = SpillCache(2, "raw_fetch", chunk_tokens=1000, store_prompt=False)
    with torch.no_grad():
        llama(prompt, **cache_kwarg(llama, cache))
    assert cache.stored_tokens() == 0 and cache.layers[0].recent == PROMPT and cache.stored_bytes() == 0
    cache.flush()
    assert cache.stored_tokens() == PROMPT and cache.layers[0].recent == 0
    assert cache.stored_bytes() == 2 * 2 * PROMPT * 32 * 4  # layers x K/V x tokens x channels x float32


def test_crop_removes_recent_tokens_only(llama, prompt):
    cache = SpillCache(2, "raw_fetch", chunk_tokens=16)
    with torch.no_grad():
        llama(prompt, **cache_kwarg(llama, cache))
        llama(prompt[:, :5], **cache_kwarg(llama, cache))
    cache.crop(-3)
    assert cache.get_seq_length() == PROMPT + 2 and cache.stored_tokens() == PROMPT
    cache.crop(PROMPT + 1)  # the final-length form of older transformers releases
    assert cache.get_seq_length() == PROMPT + 1 and cache.stored_tokens() == PROMPT


@pytest.mark.parametrize("mode", ["raw_fetch", "compressed_fetch"])
def test_crop_across_a_flush_continues_as_the_cut_cache_would(llama, prompt, codecs, mode):
    """Cut into stored chunks (as assisted decoding does when a rejected candidate straddles a flush),
    then run the same tokens again: raw_fetch gives DynamicCache's logits exactly, compressed_fetch
    stays within its quality, and the kept part of the cut chunk is back in the recent window."""
    ids = torch.cat([prompt, prompt.flip(1)], 1)  # 80 tokens
    dyn = DynamicCache()
    spill = SpillCache(2, mode, codecs=codecs if mode == "compressed_fetch" else None, chunk_tokens=CHUNK)
    with torch.no_grad():
        for cache in (dyn, spill):
            llama(ids[:, :PROMPT], **cache_kwarg(llama, cache))
            for t in range(PROMPT, PROMPT + 20):  # 20 single tokens: two more chunks flushed
                llama(ids[:, t:t + 1], **cache_kwarg(llama, cache))
        assert spill.stored_tokens() == PROMPT + 16 and spill.layers[0].recent == 4
        for cache in (dyn, spill):
            cache.crop(-13)  # to 47 tokens: into the first generated chunk (40..47)
        assert spill.get_seq_length() == dyn.get_seq_length() == PROMPT + 7
        if mode == "raw_fetch":  # stored rows are cut where they lie
            assert spill.stored_tokens() == PROMPT + 7 and spill.layers[0].recent == 0
        else:  # the chunk 40..47 decoded, its first 7 rows back in the recent window
            assert spill.stored_tokens() == PROMPT and spill.layers[0].recent == 7
        a = llama(ids[:, PROMPT + 7:PROMPT + 12], **cache_kwarg(llama, dyn)).logits
        b = llama(ids[:, PROMPT + 7:PROMPT + 12], **cache_kwarg(llama, spill)).logits
    if mode == "raw_fetch":
        assert torch.equal(a, b)
    else:
        assert float((a - b).abs().max()) < 0.1 * float(a.abs().max())
    assert spill.get_seq_length() == PROMPT + 12
    spill.crop(-(PROMPT + 12))  # everything, the prompt's chunk too
    assert spill.get_seq_length() == 0 and spill.stored_tokens() == 0


def test_reorder_keeps_the_one_sequence(llama, prompt):
    cache = SpillCache(2, "raw_fetch", chunk_tokens=16)
    with torch.no_grad():
        llama(prompt, **cache_kwarg(llama, cache))
    cache.reorder_cache(torch.tensor([0]))  # the identity: what generate() asks of a batch of one
    assert cache.get_seq_length() == PROMPT
    with pytest.raises(TensorCodecError, match="beam search"):
        cache.reorder_cache(torch.tensor([0, 0]))


def test_refuses_what_it_cannot_do(llama, prompt):
    with pytest.raises(ConfigurationError, match="mode must be one of"):
        SpillCache(2, "swap")
    with pytest.raises(ConfigurationError, match="needs codecs"):
        SpillCache(2, "compressed_fetch")
    with pytest.raises(ConfigurationError, match="chunk_tokens"):
        SpillCache(2, chunk_tokens=0)
    cache = SpillCache(2)
    with pytest.raises(InvalidTensorError, match="batch 1"):
        cache.update(torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3, 16), 0)
    with torch.no_grad():
        llama(prompt, **cache_kwarg(llama, cache))
    with pytest.raises(InvalidTensorError, match="channels"):
        cache.update(torch.zeros(1, 3, 1, 16), torch.zeros(1, 3, 1, 16), 0)
    with pytest.raises(TensorCodecError, match="beam search"):
        cache.reorder_cache(torch.tensor([1]))
    with pytest.raises(TensorCodecError, match="batch 1"):
        cache.batch_repeat_interleave(2)


def test_fit_basis_torch_matches_fit_basis():
    x = torch.randn(300, 24, generator=torch.Generator().manual_seed(2)) @ torch.randn(24, 24)
    a, b = fit_basis([x], 10), fit_basis_torch(x, 10)
    assert np.allclose(a.components, b.components, atol=1e-5) and np.allclose(a.mean, b.mean, atol=1e-5)
    assert np.allclose(a.eigenvalues, b.eigenvalues, rtol=1e-4)
    with pytest.raises(InvalidTensorError):
        fit_basis_torch(x[:1], 4)


# ---------------------------------------------------------------- PoC 17's decoder

def poc17():
    return load_poc("17_kv_spill_decode.py", "poc17", register=True)


SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96, vocab=50)


@pytest.mark.parametrize("mode", MODES)
def test_decoder_steps_agree_with_its_prefill(mode):
    p17 = poc17()
    model = p17.RandomDecoder(SMALL, "cpu", torch.float32, max_positions=64)
    ids = torch.randint(0, SMALL["vocab"], (24,), generator=torch.Generator().manual_seed(3))
    kv, _ = model.prefill(ids[:20], progress=False)
    codecs, _ = p17.fit_codecs_on_prompt(kv, progress=False) if mode == "compressed_fetch" else (None, None)
    cache = SpillCache(SMALL["layers"], mode, codecs=codecs, chunk_tokens=2, contiguous=False)
    p17.fill(cache, kv, 20, SMALL["kv_heads"])
    assert p17.check_fetch(cache, kv, 20)["exact"] == (mode != "compressed_fetch")
    for position in range(20, 24):  # flushes every 2 steps
        _, logits = model.step(ids[position:position + 1], position, cache)
        _, reference = model.prefill(ids[:position + 1], progress=False)
        tolerance = 1e-4 if mode != "compressed_fetch" else 0.05 * float(reference.abs().max())
        assert float((logits - reference).abs().max()) < tolerance
    assert cache.get_seq_length() == 24


def test_step_profile_says_which_layer_and_whether_the_host_paced_the_step():
    """PoC 17's profile of decode steps: medians per stage over layers and steps, the slowest layer found
    in the step that holds it, and the steps' GPU time (the layer spans' sum) beside their wall time."""
    p17 = poc17()
    steps = [({"layer": [1.0, 1.0, 5.0], "copy": [0.5, 0.5, 0.5]}, 9.0),
             ({"layer": [1.0, 1.2, 1.0], "copy": [0.5, 0.6, 0.5]}, 12.0),
             ({"layer": [1.0, 1.0, 1.1]}, 10.0)]
    out = p17.step_profile(steps)
    assert out["per_layer_layer_ms"] == 1.0 and out["per_layer_copy_ms"] == 0.5
    assert out["per_layer_layer_max_ms"] == 5.0 and out["slowest_layer"] == 2
    assert out["profiled_step_gpu_ms"] == 3.2 and out["profiled_step_wall_ms"] == 10.0
    assert "per_layer_decode_ms" not in out
    assert p17.step_profile([({}, 4.0)]) == {}


def test_timing_model_kv_codec_codes_at_the_ratio_it_is_given():
    """PoC 17 times the KV codec's path at the ratio its setting reaches on SmolLM2: the random model's
    steps are scaled until the prompt's entropy gives that ratio, and the cache's stored bytes come within
    10% of it (container headers and tables on top of the entropy); keys after RoPE, sink rows raw."""
    p17 = poc17()
    shape = p17.SHAPE_CPU
    model = p17.RandomDecoder(shape, "cpu", torch.float32, max_positions=2100)
    ids = torch.randint(0, shape["vocab"], (2048,), generator=torch.Generator().manual_seed(0))
    kv, _ = model.prefill(ids, progress=False)
    scales = []
    for ratio in (3.0, 6.0):
        codec = p17.kv_codec_on_prompt(model, kv, "cpu", ratio)
        assert not codec.pre_rope and codec.sink == p17.KV_SINK
        cache = SpillCache.from_kv_codec(codec, num_layers=shape["layers"], chunk_tokens=64)
        p17.fill(cache, kv, 2048, shape["kv_heads"])
        measured = 2 * shape["layers"] * model.kv_dim * 2 * 2048 / cache.stored_bytes(value_bytes=2)
        assert abs(measured / ratio - 1) < 0.10, (ratio, measured)
        k, _ = cache.fetched_kv(0)
        assert torch.equal(k[:p17.KV_SINK], kv[0][0][:p17.KV_SINK])
        scales.append(codec.scale)
    assert scales[0] < scales[1]  # a higher ratio: coarser steps


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["raw_fetch", "gpu_resident"])
def test_gpu_generate_matches_dynamic_cache(mode):
    model = tiny_llama("cuda")
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1)).cuda()
    reference = generate(model, ids, DynamicCache())
    cache = SpillCache(2, mode, chunk_tokens=CHUNK)
    assert torch.equal(generate(model, ids, cache), reference)
    if mode == "raw_fetch":
        assert cache.layers[0].store_k.is_pinned()
        assert cache.stats.fetches >= 2 * (NEW - 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_compressed_fetch_through_staged_decodes(dtype):
    model = tiny_llama("cuda").to(dtype)
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1)).cuda()
    kv = prefill_kv(model, ids)
    codecs = make_codecs([(k.float().cpu(), v.float().cpu()) for k, v in kv])
    cache = SpillCache(2, "compressed_fetch", codecs=codecs, chunk_tokens=CHUNK)
    with torch.no_grad():
        model(ids, **cache_kwarg(model, cache))
    layer = cache.layers[0]
    assert layer.packed.is_pinned() and len(layer.places) == 2 and all(a % 16 == 0 for a, _ in layer.places)
    for i, (k_rows, v_rows) in enumerate(kv):
        k, v = cache.fetched_kv(i)
        assert k.is_cuda and quality(k_rows, k, "cos") >= 0.999 and quality(v_rows, v, "cos") >= 0.999
        # bf16: the decode is a plan, replayed until the next flush; other dtypes take decode_many
        assert bool(cache.layers[i].plans) == (dtype == torch.bfloat16)
    reference = generate(model, ids, DynamicCache())
    spill = SpillCache(2, "compressed_fetch", codecs=codecs, chunk_tokens=CHUNK)
    out = generate(model, ids, spill)
    assert (out == reference).float().mean() >= 0.9
    assert spill.stats.flushes >= 2 * (1 + (NEW - 1) // CHUNK)
    spill.drain()  # reads the payload checks still queued (the next step's prefetch)
    assert not spill._unchecked
    cache.close()


@pytest.mark.gpu
def test_gpu_corrupt_stored_container_is_named_by_the_step_that_read_it():
    model = tiny_llama("cuda").to(torch.bfloat16)  # bf16: the staged decode's path
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1)).cuda()
    codecs = make_codecs([(k.float().cpu(), v.float().cpu()) for k, v in prefill_kv(model, ids)])
    for via in ("fetched_kv", "decode step"):
        cache = SpillCache(2, "compressed_fetch", codecs=codecs, chunk_tokens=4 * PROMPT)
        with torch.no_grad():
            logits = model(ids, **cache_kwarg(model, cache)).logits
            cache.flush()
            cache.fetched_kv(1)  # healthy: its plan is made and checked
            offset, length = cache.layers[1].places[1]  # layer 1's V container
            cache.layers[1].packed[offset + length // 2 + 24] ^= 0x3C  # inside its payload: host memory damaged
            with pytest.raises(BitstreamError, match=r"layer 1: the V container of tokens 0\.\.39 is corrupt"):
                if via == "fetched_kv":
                    cache.fetched_kv(1)
                else:
                    model(logits[:, -1:].argmax(-1), **cache_kwarg(model, cache))
        cache.close()


def small_decoder_on_gpu():
    """PoC 17's decoder in a small shape on the GPU, its 512-token prefill's KV and codecs fitted on it."""
    p17 = poc17()
    shape = dict(SMALL, layers=3, hidden=256, heads=8, kv_heads=2, head_dim=64, mlp=512, vocab=512)
    model = p17.RandomDecoder(shape, "cuda", torch.bfloat16, max_positions=600)
    ids = torch.randint(0, shape["vocab"], (520,), generator=torch.Generator().manual_seed(4))
    kv, _ = model.prefill(ids[:512], progress=False)
    codecs, _ = p17.fit_codecs_on_prompt(kv, progress=False)
    return p17, shape, model, ids, kv, codecs


@pytest.mark.gpu
def test_gpu_decoder_graphs_match_eager_and_raw_matches_resident():
    p17, shape, model, ids, kv, codecs = small_decoder_on_gpu()
    logits = {}
    for graphs in (False, True):
        if graphs:
            model.capture_graphs()
        for mode in MODES:
            cache = SpillCache(shape["layers"], mode, codecs=codecs, chunk_tokens=4, contiguous=False)
            p17.fill(cache, kv, 512, shape["kv_heads"], "cuda")
            check = p17.check_fetch(cache, kv, 512)
            assert check["exact"] if mode != "compressed_fetch" else check["cos_min"] >= 0.999
            for position in range(512, 520):  # the same tokens in every case; flushes twice
                _, out = model.step(ids[position:position + 1].cuda(), position, cache)
            logits[(graphs, mode)] = out.float()
            cache.close()
    assert torch.equal(logits[(True, "raw_fetch")], logits[(True, "gpu_resident")])
    assert torch.equal(logits[(False, "raw_fetch")], logits[(False, "gpu_resident")])
    assert torch.allclose(logits[(True, "gpu_resident")], logits[(False, "gpu_resident")], atol=0.05, rtol=0.05)
    scale = float(logits[(False, "gpu_resident")].abs().max())
    assert float((logits[(True, "compressed_fetch")] - logits[(True, "gpu_resident")]).abs().max()) < 0.2 * scale


def test_codecs_of_another_model_are_refused_before_coding(llama, prompt):
    rng = np.random.default_rng(0)
    other = TensorCodec(fit_basis([rng.standard_normal((64, 48))], 48), backend="rans", step=0.05)
    cache = SpillCache(2, "compressed_fetch", codecs=[(other, other)] * 2)
    with pytest.raises(ConfigurationError, match="layer 0's K codec has a basis for 48 channels.*32 KV channels"), \
            torch.no_grad():
        llama(prompt, **cache_kwarg(llama, cache))


def test_coefficient_rows_are_refused_where_there_are_none(llama, prompt, codecs):
    with pytest.raises(ConfigurationError, match="mode 'raw_fetch' has none"):
        SpillCache(2, "raw_fetch", coefficients=True)
    cache = SpillCache(2, "compressed_fetch", codecs=codecs, coefficients=True)
    with pytest.raises(ConfigurationError, match="bf16 coefficient rows; this model's KV is torch.float32"), \
            torch.no_grad():
        llama(prompt, **cache_kwarg(llama, cache))
    cache = SpillCache(2, "compressed_fetch", codecs=codecs, coefficients=True)
    bf16 = tiny_llama().to(torch.bfloat16)
    with pytest.raises(ConfigurationError, match="GPU decoder's coefficient rows"), torch.no_grad():
        bf16(prompt, **cache_kwarg(bf16, cache))
    with pytest.raises(ConfigurationError, match="coefficients=True"):
        SpillCache(2, "compressed_fetch", codecs=codecs).update_coefficients(None, None, 0)


@pytest.mark.gpu
def test_gpu_attention_on_coefficient_rows_matches_attention_on_reconstructed_kv():
    p17, shape, model, ids, kv, codecs = small_decoder_on_gpu()
    model.capture_graphs()
    logits = {}
    for coefficients in (False, True):
        cache = SpillCache(shape["layers"], "compressed_fetch", codecs=codecs, chunk_tokens=4, contiguous=False,
                           coefficients=coefficients)
        p17.fill(cache, kv, 512, shape["kv_heads"], "cuda")
        assert p17.check_fetch(cache, kv, 512)["cos_min"] >= 0.999  # fetched_kv reconstructs the rows
        for position in range(512, 520):  # flushes twice: stored rows and the recent window both attended
            _, out = model.step(ids[position:position + 1].cuda(), position, cache)
        logits[coefficients] = out.float()
        cache.close()
    scale = float(logits[False].abs().max())
    assert float((logits[True] - logits[False]).abs().max()) < 0.02 * scale


def test_coefficient_kv_puts_the_raw_sink_rows_first_in_sequence_order():
    from shared.kvcache import CoefficientKV

    g = torch.Generator().manual_seed(0)
    rows, weights = torch.randn(5, 8, generator=g), torch.randn(8, 6, generator=g)
    raw = torch.randn(3 + 2, 6, generator=g)  # 3 sink rows, then 2 recent ones
    kv = CoefficientKV(rows, rows, weights, weights, raw, raw, sink=3)
    k, v = kv.reconstructed()
    assert torch.equal(k[:3], raw[:3]) and torch.equal(k[3:8], rows @ weights) and torch.equal(k[8:], raw[3:])
    assert torch.equal(k, v)


def test_coefficient_rows_of_keys_coded_before_rope_are_refused(llama, prompt):
    codec = fit_kv(llama, prefill_kv(llama, prompt), pre_rope=True)
    with pytest.raises(ConfigurationError, match="keys coded before RoPE.*keys_after_rope=True"):
        SpillCache.from_kv_codec(codec, llama, coefficients=True)


@pytest.mark.gpu
def test_gpu_kv_codec_with_keys_after_rope_attends_on_coefficient_rows():
    """The KV codec's path with raw sink rows and keys coded after RoPE: attention on its coefficient rows
    (the sink rows attended raw) gives what attention on its reconstructed KV gives."""
    p17, shape, model, ids, kv, _ = small_decoder_on_gpu()
    model.capture_graphs()
    assert p17.KV_CODEC_KEYS_AFTER_ROPE
    codec = p17.kv_codec_on_prompt(model, kv, "cuda")
    assert not codec.pre_rope and codec.sink == p17.KV_SINK
    logits = {}
    for coefficients in (False, True):
        cache = SpillCache.from_kv_codec(codec, num_layers=shape["layers"], chunk_tokens=4, contiguous=False,
                                         coefficients=coefficients)
        p17.fill(cache, kv, 512, shape["kv_heads"], "cuda")
        assert p17.check_fetch(cache, kv, 512)["cos_min"] >= 0.999  # fetched_kv in sequence order
        k, v = cache.fetched_kv(1)
        sink = p17.KV_SINK
        assert torch.equal(k[:sink], kv[1][0][:sink].cuda()) and torch.equal(v[:sink], kv[1][1][:sink].cuda())
        for position in range(512, 520):  # flushes twice: coded rows, sink rows and the recent window attended
            _, out = model.step(ids[position:position + 1].cuda(), position, cache)
        logits[coefficients] = out.float()
        cache.close()
    scale = float(logits[False].abs().max())
    assert float((logits[True] - logits[False]).abs().max()) < 0.02 * scale


@pytest.mark.parametrize("mode", ["raw_fetch", "compressed_fetch"])
@pytest.mark.parametrize("speculation", [{"assistant_model": "tiny"}, {"prompt_lookup_num_tokens": 3}])
def test_assisted_and_prompt_lookup_decoding_run_on_the_cache(llama, prompt, codecs, mode, speculation):
    """Speculative decoding crops rejected candidates, across flushes too (chunk_tokens 8): greedy
    output as a DynamicCache gives it (raw_fetch exactly)."""
    kwargs = {k: (tiny_llama() if v == "tiny" else v) for k, v in speculation.items()}
    reference = generate(llama, prompt, DynamicCache())
    cache = SpillCache(2, mode, codecs=codecs if mode == "compressed_fetch" else None, chunk_tokens=CHUNK)
    with torch.no_grad():
        out = llama.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0, **cache_kwarg(llama, cache), **kwargs)
    assert torch.equal(out, reference) if mode == "raw_fetch" else (out == reference).float().mean() >= 0.9


# -- the attention-aware KV codec on the cache (SpillCache.from_kv_codec) ------------------------------
def fit_kv(model, kv, sink=4, pre_rope=True):
    from shared.kvcodec import fit_kv_codec, rope_of

    calib = [[(k.float(), v.float()) for k, v in kv]]
    codec = fit_kv_codec(calib, KV_HEADS, sink=sink, pre_rope=pre_rope, rope=rope_of(model) if pre_rope else None)
    return codec.set_scale(0.05)


@pytest.mark.parametrize("sink", [0, 4])
def test_kv_codec_cache_decodes_what_the_kv_codec_decodes(llama, prompt, sink):
    kv = prefill_kv(llama, prompt)
    codec = fit_kv(llama, kv, sink=sink)
    cache = SpillCache.from_kv_codec(codec, llama, chunk_tokens=CHUNK)
    ids = torch.cat([prompt, prompt.flip(1)[:, :2 * CHUNK]], 1)
    full = prefill_kv(llama, ids)  # rows handed to the cache as a model would: the prompt, then a token a call
    for t in [slice(0, PROMPT)] + [slice(t, t + 1) for t in range(PROMPT, ids.shape[1])]:
        for i, (k_rows, v_rows) in enumerate(full):
            cache.update(rows_to_states(k_rows[t], KV_HEADS), rows_to_states(v_rows[t], KV_HEADS), i)
    # keys coded at 0.. and 40..: the two 8-token chunks flushed at 40 and 48 were joined (merge_chunks)
    assert cache.stored_tokens() == ids.shape[1] and [m for m, _, _ in cache.layers[0].blobs] == [PROMPT - sink, 2 * CHUNK]
    assert cache.stats.merges == 2  # one a layer
    assert cache.layers[0].sink == sink and cache.layers[0].chunks()[0] == (sink, PROMPT - sink)
    for i, (k_rows, v_rows) in enumerate(full):
        k, v = cache.fetched_kv(i)
        want_k, _ = codec.roundtrip(k_rows, i, "k", count_bytes=False)  # the whole tensor at once, from position 0
        want_v, _ = codec.roundtrip(v_rows, i, "v", count_bytes=False)
        # the sink rows stay in the model's dtype (the KV codec's container carries them in bf16)
        assert torch.equal(k[:sink], k_rows[:sink]) and torch.equal(v[:sink], v_rows[:sink])
        torch.testing.assert_close(k[sink:], want_k[sink:], rtol=0, atol=1e-4)
        torch.testing.assert_close(v[sink:], want_v[sink:], rtol=0, atol=1e-4)
        assert quality(k_rows, k, "cos") > 0.99 and quality(v_rows, v, "cos") > 0.99
    # crop into the prompt's chunk, and into the sink rows: the kept tokens come back as they were decoded
    k_before, _ = cache.fetched_kv(1)
    cache.crop(-(ids.shape[1] - 20))
    k_after, _ = cache.fetched_kv(1)
    assert cache.get_seq_length() == 20 and torch.allclose(k_after, k_before[:20], atol=1e-5)
    cache.crop(-(20 - 2))
    k_after, _ = cache.fetched_kv(1)
    assert cache.get_seq_length() == 2 and torch.equal(k_after, k_before[:2])


def test_kv_codec_of_another_model_is_refused_when_the_cache_is_made(llama, prompt):
    codec = fit_kv(llama, prefill_kv(llama, prompt))
    with pytest.raises(ConfigurationError, match="layers 0..1"):
        SpillCache.from_kv_codec(codec, num_layers=3)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=HEADS, num_key_value_heads=1)).eval()
    with pytest.raises(ConfigurationError, match="codes 32 channels"):
        SpillCache.from_kv_codec(codec, other)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                         rope_theta=500.0)).eval()
    with pytest.raises(ConfigurationError, match="rotary"):
        SpillCache.from_kv_codec(codec, other)


@pytest.mark.gpu
def test_gpu_kv_codec_cache_staged_equals_unstaged_and_generates():
    model = tiny_llama("cuda").to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1)).cuda()
    kv = prefill_kv(model, ids)
    codec = fit_kv(model, [(k.float().cpu(), v.float().cpu()) for k, v in kv])
    got = {}
    for staged in (True, False):
        cache = SpillCache.from_kv_codec(codec, model, chunk_tokens=CHUNK, staged=staged)
        with torch.no_grad():
            model(ids, **cache_kwarg(model, cache))
            model(ids[:, :CHUNK], **cache_kwarg(model, cache))  # a second chunk, keys at positions 40..47
        got[staged] = [cache.fetched_kv(i) for i in range(2)]
        assert bool(cache.layers[0].plans) == staged  # a staged fetch decodes through a plan
    for (k1, v1), (k2, v2) in zip(got[True], got[False]):  # RoPE in float32 in the graph, float64 outside
        assert torch.equal(v1, v2) and quality(k2.float(), k1.float(), "cos") > 0.99999
    for i, (k_rows, _) in enumerate(kv):
        assert quality(k_rows.float(), got[True][i][0][:PROMPT].float(), "cos") > 0.99
    reference = generate(model, ids, DynamicCache())
    out = generate(model, ids, SpillCache.from_kv_codec(codec, model, chunk_tokens=CHUNK))
    assert (out == reference).float().mean() >= 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim", [(8, 128), (3, 64)])  # PoC 17's timing shape, SmolLM2's
def test_gpu_fused_rope_equals_the_torch_rotation(heads, head_dim):
    from shared.kvcache import _rotate_forward
    from shared.kvcodec import Rope

    rope = Rope(1e4 ** (-np.arange(head_dim // 2) / (head_dim // 2)))
    cos, sin = (t.float().cuda().contiguous() for t in rope.cos_sin(torch.arange(5000)))
    rows = torch.randn(4999, heads * head_dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).cuda()
    fused, eager = rows.clone(), rows.clone()
    _rotate_forward(fused[3:], cos[3:4999], sin[3:4999], head_dim, fused=True)  # a slice, as the cache rotates
    _rotate_forward(eager[3:], cos[3:4999], sin[3:4999], head_dim, fused=False)
    assert torch.equal(fused[:3], rows[:3])  # rows before the slice untouched
    assert float((fused.float() - eager.float()).abs().max()) <= 2 ** -6 * float(rows.float().abs().max())
    assert quality(eager.float(), fused.float(), "cos") > 0.99999


@pytest.mark.parametrize("mode", ["raw_fetch", "gpu_resident", "compressed_fetch"])
def test_layer_keys_and_values_read_as_dynamic_caches_do(llama, prompt, codecs, mode):
    reference, cache = DynamicCache(), SpillCache(2, mode, chunk_tokens=CHUNK,
                                                  codecs=codecs if mode == "compressed_fetch" else None)
    assert cache.layers[0].keys is None and cache.layers[1].values is None  # empty: as a DynamicLayer before use
    generate(llama, prompt, reference)
    generate(llama, prompt, cache)
    for mine, theirs in zip(cache.layers, reference.layers):
        for got, want in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert got.shape == want.shape == (1, KV_HEADS, PROMPT + NEW - 1, HIDDEN // HEADS)
            if mode == "compressed_fetch":  # stored chunks come back through the codec
                assert quality(want[0].transpose(0, 1).reshape(want.shape[2], -1),
                               got[0].transpose(0, 1).reshape(got.shape[2], -1), "cos") > 0.999
            else:
                assert torch.equal(got, want)
    with pytest.raises(TensorCodecError, match="through its cache"):
        cache.layers[0].keys = torch.zeros(1)
    # reading them fetched and changed nothing: the same rows again, the same length
    assert torch.equal(cache.layers[1].keys, cache.layers[1].keys)
    assert cache.get_seq_length() == reference.get_seq_length() == PROMPT + NEW - 1


def left_padded_batch():
    """Two prompts of 40 and 31 tokens, the shorter one padded on the left (as a tokenizer pads for generation)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (2, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :9], mask[1, :9] = 0, 0
    return ids, mask


def prompt_then_step(model, ids, mask, cache, explicit_positions: bool = False):
    """The batch's prompts into the cache (stored at once), then one step that reads them back: its last
    logits. explicit_positions: position ids from the mask, as generate() gives a left-padded batch."""
    step = torch.randint(1, 128, (2, 1), generator=torch.Generator().manual_seed(4)).to(ids.device)
    positions = ((mask.cumsum(1) - 1).clamp(min=0), mask.sum(1, keepdim=True)) if explicit_positions else (None, None)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions[0], **cache_kwarg(model, cache))
        return model(step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1), position_ids=positions[1],
                     **cache_kwarg(model, cache)).logits[:, -1]


def generate_batch(model, ids, mask, cache, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
                              **cache_kwarg(model, cache), **kw)


@pytest.mark.parametrize("mode", ["raw_fetch", "gpu_resident"])
def test_batch_with_left_padding_matches_dynamic_cache_exactly(llama, mode):
    ids, mask = left_padded_batch()
    reference = generate_batch(llama, ids, mask, DynamicCache(), do_sample=False)
    cache = BatchSpillCache(2, mode, chunk_tokens=CHUNK)
    assert torch.equal(generate_batch(llama, ids, mask, cache, do_sample=False), reference)
    assert len(cache.sequences) == 2 and cache.get_seq_length() == PROMPT + NEW - 1
    if mode == "raw_fetch":
        assert cache.stored_tokens() == PROMPT + CHUNK * ((NEW - 1) // CHUNK)
    assert cache.layers[1].keys.shape == (2, KV_HEADS, PROMPT + NEW - 1, HIDDEN // HEADS)


def test_sampling_several_sequences_per_prompt_matches_dynamic_cache(llama, prompt):
    outputs = []
    for cache in (DynamicCache(), BatchSpillCache(2, "raw_fetch", chunk_tokens=CHUNK)):
        torch.manual_seed(7)
        outputs.append(generate_batch(llama, prompt, torch.ones_like(prompt), cache, do_sample=True,
                                      num_return_sequences=3))
    assert outputs[0].shape[0] == 3 and torch.equal(*outputs)


@pytest.mark.parametrize("mode", ["raw_fetch", "compressed_fetch"])
def test_a_fork_holds_the_same_kv_and_goes_its_own_way(llama, prompt, codecs, mode):
    cache = SpillCache(2, mode, chunk_tokens=CHUNK, codecs=codecs if mode == "compressed_fetch" else None)
    generate(llama, prompt, cache, new=CHUNK + 3)  # a stored prompt, a flushed chunk, a recent window
    assert 0 < cache.layers[0].recent and cache.stored_tokens() > PROMPT
    twin = cache.fork()
    for i in range(2):  # the stored form copied as it is: the values attention reads are the same
        for a, b in zip(cache.fetched_kv(i), twin.fetched_kv(i)):
            assert torch.equal(a, b)
    assert twin.stored_bytes() == cache.stored_bytes() and twin.get_seq_length() == cache.get_seq_length()
    before = [t.clone() for t in cache.fetched_kv(1)]
    step = torch.tensor([[5]])
    with torch.no_grad():
        for _ in range(CHUNK):  # the twin flushes (and joins chunks) into buffers of its own
            llama(step, **cache_kwarg(llama, twin))
    assert twin.get_seq_length() == cache.get_seq_length() + CHUNK
    assert twin.stats.merges == (2 if mode == "compressed_fetch" else 0)  # its two 8-token chunks joined, a layer
    for a, b in zip(before, cache.fetched_kv(1)):
        assert torch.equal(a, b)


def counting_forks(monkeypatch) -> list:
    forks, fork = [], SpillCache.fork
    monkeypatch.setattr(SpillCache, "fork", lambda self: forks.append(self) or fork(self))
    return forks


def test_beam_search_matches_dynamic_cache_exactly_in_raw_fetch(llama, prompt, monkeypatch):
    forks = counting_forks(monkeypatch)
    reference = generate_batch(llama, prompt, torch.ones_like(prompt), DynamicCache(), do_sample=False, num_beams=3,
                               num_return_sequences=2)
    cache = BatchSpillCache(2, "raw_fetch", chunk_tokens=CHUNK)
    got = generate_batch(llama, prompt, torch.ones_like(prompt), cache, do_sample=False, num_beams=3,
                         num_return_sequences=2)
    assert got.shape[0] == 2 and torch.equal(got, reference) and forks  # beams survived twice, forked
    assert len(cache.sequences) == 3 and len({id(s) for s in cache.sequences}) == 3


def test_beam_search_runs_compressed_with_forked_coded_chunks(llama, prompt, codecs, monkeypatch):
    forks = counting_forks(monkeypatch)
    ids, mask = left_padded_batch()
    cache = BatchSpillCache(2, "compressed_fetch", codecs=codecs, chunk_tokens=CHUNK)
    out = generate_batch(llama, ids, mask, cache, do_sample=False, num_beams=2)
    assert out.shape == (2, PROMPT + NEW) and len(cache.sequences) == 4 and forks
    assert cache.stored_tokens() >= PROMPT and cache.stored_bytes() > 0
    with pytest.raises(InvalidTensorError, match="holds 4 sequences"):
        cache.reorder_cache(torch.tensor([0, 4]))


def test_batch_compressed_fetch_stays_close(llama, codecs):
    ids, mask = left_padded_batch()
    reference, cache = DynamicCache(), BatchSpillCache(2, "compressed_fetch", codecs=codecs, chunk_tokens=CHUNK)
    logits = [prompt_then_step(llama, ids, mask, c) for c in (reference, cache)]  # the prompts stored (coded)
    assert cache.stored_tokens() == PROMPT
    for want, got in zip(*logits):  # each sequence through its own cache, the codec's error only
        assert quality(want[None].double(), got[None].double(), "cos") > 0.999 and not torch.equal(want, got)
    assert cache.stored_bytes(value_bytes=2) < 2 * 2 * 2 * cache.stored_tokens() * KV_HEADS * (HIDDEN // HEADS) * 2
    with pytest.raises(ConfigurationError, match="mode"):  # settings are checked when the cache is made
        BatchSpillCache(2, "raw_fetc")


def test_batch_kv_codec_cache_with_left_padding_keeps_positions_right(llama, prompt):
    """Keys coded before RoPE in a left-padded batch: each sequence's keys are un-rotated and rotated back
    at the same index, so the padded one comes back right (its logits at the codec's error, not a shift's)."""
    codec = fit_kv(llama, prefill_kv(llama, prompt))
    ids, mask = left_padded_batch()
    cache = BatchSpillCache.from_kv_codec(codec, llama, chunk_tokens=CHUNK)
    logits = [prompt_then_step(llama, ids, mask, c, explicit_positions=True) for c in (DynamicCache(), cache)]
    assert cache.stored_tokens() == PROMPT and cache.sequences[1].sink == codec.sink
    for want, got in zip(*logits):
        assert quality(want[None].double(), got[None].double(), "cos") > 0.999, quality(want[None].double(), got[None].double(), "cos")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["raw_fetch", "compressed_fetch"])
def test_gpu_batch_with_left_padding(mode):
    model = tiny_llama("cuda").to(torch.bfloat16)
    ids, mask = left_padded_batch()
    ids, mask = ids.cuda(), mask.cuda()
    codecs = make_codecs([(k.float().cpu(), v.float().cpu()) for k, v in prefill_kv(model, ids[:1])])
    cache = BatchSpillCache(2, mode, chunk_tokens=CHUNK, codecs=codecs if mode == "compressed_fetch" else None)
    if mode == "raw_fetch":
        reference = generate_batch(model, ids, mask, DynamicCache(), do_sample=False)
        assert torch.equal(generate_batch(model, ids, mask, cache, do_sample=False), reference)
        return
    logits = [prompt_then_step(model, ids, mask, c).float().cpu() for c in (DynamicCache(), cache)]
    for want, got in zip(*logits):
        assert quality(want[None].double(), got[None].double(), "cos") > 0.99
    cache.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["raw_fetch", "compressed_fetch"])
def test_gpu_beam_search_forks_pinned_and_packed_stores(mode):
    model = tiny_llama("cuda").to(torch.bfloat16)
    ids, mask = (t.cuda() for t in left_padded_batch())
    codecs = make_codecs([(k.float().cpu(), v.float().cpu()) for k, v in prefill_kv(model, ids[:1])])
    kwargs = dict(chunk_tokens=CHUNK, codecs=codecs if mode == "compressed_fetch" else None)
    reference = generate_batch(model, ids, mask, DynamicCache(), do_sample=False, num_beams=2)
    cache = BatchSpillCache(2, mode, **kwargs)
    got = generate_batch(model, ids, mask, cache, do_sample=False, num_beams=2)
    if mode == "raw_fetch":
        assert torch.equal(got, reference)
    twin = cache.sequences[0].fork()  # the packed containers and pinned rows copied: the same values back
    for i in range(2):
        for a, b in zip(cache.sequences[0].fetched_kv(i), twin.fetched_kv(i)):
            assert torch.equal(a, b)

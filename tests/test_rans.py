"""The rANS coder (shared/codecs/rans.py): bit-exact round trips, ratio near the entropy bound,
clear errors on bad input and corrupt payloads; the Triton kernels write the same bytes.

CPU tests run the numpy coder. The Triton kernels run on the CPU through Triton's interpreter
(TRITON_INTERPRET=1) when triton is installed, else those tests skip. Tests marked gpu run the
compiled kernels on a CUDA GPU and cross-decode with the CPU coder.
"""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from shared.codecs import rans, rans_cuda, rans_tables
from shared.errors import BitstreamError, InvalidTensorError

ROOT = Path(__file__).resolve().parent.parent
HAS_TRITON = importlib.util.find_spec("triton") is not None


def pca_like(T=2048, K=48, scale=60.0, seed=0):
    """Gaussian coefficients with a power-law spectrum, quantized with one step: like PCA output."""
    rng = np.random.default_rng(seed)
    sigma = scale * np.arange(1, K + 1) ** -0.7
    return np.rint(rng.standard_normal((T, K)) * sigma).astype(np.int32)


def assert_gpu_decoder_refuses(blob: bytes):
    """The GPU decoder raises BitstreamError on a damaged payload (interpreted tests call it)."""
    import torch

    with pytest.raises(BitstreamError):
        rans_cuda.decode_cuda(torch.frombuffer(bytearray(blob), dtype=torch.uint8))


def cases():
    rng = np.random.default_rng(7)
    heavy = pca_like(1000, 16)
    heavy[rng.integers(0, 1000, 20), rng.integers(0, 16, 20)] = rng.integers(-10**6, 10**6, 20)
    extremes = pca_like(300, 5, seed=3)
    extremes[0, 0], extremes[1, 1], extremes[2, 2] = -2**31, 2**31 - 1, 0
    return {
        "pca_like": pca_like(),
        "skewed": rng.geometric(0.3, (3000, 8)).astype(np.int32) - 1,
        "constant_columns": np.tile(np.array([[5, -3, 0, 2**31 - 1]], np.int32), (700, 1)),
        "single_token": np.array([[3, -7, 100000, 0]], np.int32),
        "single_component": pca_like(777, 1),
        "negatives": -np.abs(pca_like(900, 6)) - 1000,
        "huge_alphabet": rng.integers(-2**31, 2**31 - 1, (400, 3), dtype=np.int64).astype(np.int32),
        "heavy_tails": heavy,
        "int32_extremes": extremes,
    }


@pytest.mark.parametrize("name", list(cases()))
def test_round_trip(name):
    x = cases()[name]
    payload = rans.encode(x)
    y = rans.decode(payload)
    assert y.dtype == np.int32 and y.shape == x.shape
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("settings", [dict(lane_tokens=1), dict(lane_tokens=100), dict(group_lanes=1),
                                      dict(group_lanes=128), dict(prob_bits=9), dict(prob_bits=10), dict(prob_bits=15)])
def test_round_trip_settings(settings):
    x = pca_like(1000, 40)
    np.testing.assert_array_equal(rans.decode(rans.encode(x, **settings)), x)


@pytest.mark.parametrize("name", list(cases()))
def test_round_trip_with_sampled_tables(name, monkeypatch):
    """Tables from every 50th-or-so token: values the sample missed must still be coded."""
    monkeypatch.setattr(rans_tables, "HIST_SAMPLE_ROWS", 10)
    x = cases()[name]
    np.testing.assert_array_equal(rans.decode(rans.encode(x)), x)


def test_default_precision_follows_the_tensor_length():
    short, long = pca_like(rans.SHORT_TOKENS, 8), pca_like(rans.SHORT_TOKENS + 1, 8)
    assert rans.read_header(rans.encode(short)).prob_bits == rans.SHORT_PROB_BITS == 9
    assert rans.read_header(rans.encode(long)).prob_bits == rans.DEFAULT_PROB_BITS == 10
    with pytest.raises(InvalidTensorError, match="9..15"):
        rans.encode(short, prob_bits=8)


def test_sampled_tables_cost_little(monkeypatch):
    """Every token below 1024 tokens, every 2nd up to 65535, about 32768 from 65536 on; the
    tables from every 2nd token (or every 10th) of 40000 cost under 0.5% (1%) more bytes than
    from every token (0.26% here; 0.00-0.14% on SmolLM2's real K and V)."""
    assert [rans_tables.hist_row_stride(T) for T in (1, 1023, 1024, 65535, 65536, 10**6)] == [1, 1, 2, 2, 2, 30]
    x = pca_like(40000, 16, seed=5)
    rule = len(rans.encode(x))
    monkeypatch.setattr(rans_tables, "HIST_HALF_TOKENS", 10**9)  # every token
    full = len(rans.encode(x))
    monkeypatch.setattr(rans_tables, "HIST_SAMPLE_ROWS", 4000)  # every 10th
    sampled = len(rans.encode(x))
    assert full <= rule < 1.005 * full and full <= sampled < 1.01 * full


def test_model_tables_are_their_formulas():
    """The committed integer tables (every machine decodes with these) match their formulas."""
    made, stored = rans_tables.make_model_tables(), rans_tables.model_tables()
    assert made.keys() == stored.keys()
    for name in made:
        assert made[name].shape == stored[name].shape
        assert np.abs(made[name] - stored[name]).max() <= 1, name


def test_parametric_tables_shrink_small_payloads():
    """1024 Gaussian tokens: most components take 3-byte models instead of their tables, and the
    payload lands within 5% of the entropy bound."""
    x = pca_like(1024, 64, scale=40.0, seed=2)
    hdr = rans.parse(rans.encode(x))
    assert hdr.layout.n_param > 48
    assert hdr.layout.total < 1.05 * rans.entropy_bound_bytes(x)


def test_wide_windows_keep_a_table_where_a_model_mean_would_not_fit(monkeypatch):
    """At prob_bits 15 a window of up to 8191 symbols can have its mean past index 2047, where the
    stored int16 mean (16 x index) would wrap: such a component keeps its explicit table, so the
    payload decodes (a model there once made the reference coder write undecodable payloads)."""
    monkeypatch.setattr(rans_tables, "HIST_SAMPLE_ROWS", 64)
    x = cases()["heavy_tails"][:300]
    payload = rans.encode(x, lane_tokens=64, prob_bits=15)
    np.testing.assert_array_equal(rans.decode(payload), x)
    hdr = rans.parse(payload)
    assert (hdr.model == 0).any()


def test_other_integer_dtypes_accepted():
    x = pca_like(500, 4)
    for dtype in (np.int8, np.int16, np.int64, np.uint8):
        y = np.clip(x, 0, 100).astype(dtype)
        np.testing.assert_array_equal(rans.decode(rans.encode(y)), y.astype(np.int32))


def test_within_a_few_percent_of_entropy_bound():
    x = pca_like(8192, 64)
    bound = rans.entropy_bound_bytes(x)
    size = len(rans.encode(x))
    assert bound < size < 1.03 * bound, (size, bound)


def test_entropy_bound_matches_definition():
    x = np.array([[0, 1], [0, 1], [1, 1], [2, 1]], np.int32)
    # column 0: p = (1/2, 1/4, 1/4) -> 1.5 bits x 4 tokens; column 1 constant -> 0
    assert rans.entropy_bound_bytes(x) == pytest.approx(6 / 8)


def test_constant_matrix_costs_only_header_tables_and_states():
    x = np.full((5000, 8), -42, np.int32)
    lanes = 8 * -(-5000 // rans.default_lane_tokens(5000, 8))
    assert len(rans.encode(x)) <= 48 + 8 * 7 + 4 + 4 * lanes + 8  # no stream words at all


def test_bad_input_errors():
    with pytest.raises(InvalidTensorError, match="empty"):
        rans.encode(np.zeros((0, 4), np.int32))
    with pytest.raises(InvalidTensorError, match="2-D"):
        rans.encode(np.zeros(10, np.int32))
    with pytest.raises(InvalidTensorError, match="integers"):
        rans.encode(np.zeros((3, 3), np.float32))
    with pytest.raises(InvalidTensorError, match="overflow int32"):
        rans.encode(np.array([[2**31]], np.int64))
    with pytest.raises(InvalidTensorError, match="numpy array"):
        rans.encode([[1, 2]])


def test_every_single_byte_corruption_is_detected():
    x = pca_like(300, 6, scale=20)
    x[3, 2] = 10**6  # an escape, so the escapes section is exercised too
    payload = rans.encode(x)
    missed = []
    for i in range(len(payload)):
        bad = bytearray(payload)
        bad[i] ^= 0x5A
        try:
            rans.decode(bytes(bad))
            missed.append(i)
        except BitstreamError:
            pass
    assert not missed, f"corruption at bytes {missed} of {len(payload)} went unnoticed"


def test_truncated_and_extended_payloads():
    payload = rans.encode(pca_like(500, 8))
    for cut in (0, 10, 47, 48, 100, len(payload) - 1):
        with pytest.raises(BitstreamError):
            rans.decode(payload[:cut])
    with pytest.raises(BitstreamError):
        rans.decode(payload + b"\0")
    with pytest.raises(BitstreamError, match="magic"):
        rans.decode(b"XXXX" + payload[4:])


def test_importing_needs_no_gpu_libraries():
    code = textwrap.dedent("""
        import sys
        import shared.codecs.rans as r
        assert "triton" not in sys.modules, "rans imported triton at import time"
        import numpy as np
        assert (r.decode(r.encode(np.ones((4, 2), np.int32))) == 1).all()
    """)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ---------------------------------------------------------------------------------------------
# The Triton kernels, run on the CPU by Triton's interpreter: same bytes as the numpy coder.
# Triton picks interpreter or compiler when a kernel module is first imported, for the whole
# process, so these tests run in a fresh interpreter process with TRITON_INTERPRET=1 from the start.


def enable_interpreter():
    """Run kernels through Triton's interpreter. Triton 3.6's interpreter turns 1-element arrays
    into loop bounds with int(), which numpy >= 2.4 refuses; read the element instead."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.runtime.interpreter as ti

    if not getattr(ti._patch_lang_tensor, "_fixed", False):
        original = ti._patch_lang_tensor

        def patched(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

        patched._fixed = True
        ti._patch_lang_tensor = patched


def run_interpreted(body: str):
    """Run test code in a new process under Triton's CPU interpreter; fail with its output."""
    code = "import sys; sys.path[:0] = ['tests', '.']\nfrom test_rans import *\nenable_interpreter()\n" \
        + textwrap.dedent(body)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"interpreted test failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (pip install triton)")


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("sample_rows,escape_slots", [(rans_tables.HIST_SAMPLE_ROWS, rans_cuda.ESCAPES_PER_GROUP), (64, 2)])
def test_triton_interpreter_writes_the_same_bytes(sample_rows, escape_slots):
    """Every case, with the histogram over all tokens and over a sample (stride 4); with room for
    2 escapes per lane group the encoder must code the lanes again with more room."""
    run_interpreted(f"""
        import torch
        rans_tables.HIST_SAMPLE_ROWS = {sample_rows}
        rans_cuda.ESCAPES_PER_GROUP = {escape_slots}
        all_cases = cases()
        for name, x in [("pca_like_small", pca_like(300, 20)), ("heavy_tails", all_cases["heavy_tails"][:300]),
                        ("constant_columns", all_cases["constant_columns"][:300]),
                        ("single_token", all_cases["single_token"]),
                        ("huge_alphabet_small", all_cases["huge_alphabet"][:40]),
                        ("int32_extremes", all_cases["int32_extremes"])]:
            payload = rans.encode(x, lane_tokens=64)
            gpu_payload = rans_cuda.encode_cuda(torch.from_numpy(x), lane_tokens=64)
            assert bytes(gpu_payload.numpy()) == payload, name
            y = rans_cuda.decode_cuda(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            np.testing.assert_array_equal(y.numpy(), x, err_msg=name)
        x = all_cases["heavy_tails"][:300]
        for prob_bits in (10, 11, 12, 15):  # beside the default 9 of short tensors; int32 arithmetic for n <= 11, int64 above
            payload = rans.encode(x, lane_tokens=64, prob_bits=prob_bits)
            assert bytes(rans_cuda.encode_cuda(torch.from_numpy(x), lane_tokens=64, prob_bits=prob_bits).numpy()) \
                == payload, prob_bits
            y = rans_cuda.decode_cuda(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            np.testing.assert_array_equal(y.numpy(), x, err_msg=str(prob_bits))
        # every value escapes (2048 a lane group): before the host learns that a group escaped more
        # values than its room, the containers are assembled from what the room holds, every one
        # inside the buffer sized for the first try (with a group's full count the assembly read
        # and wrote past it: a corrupted heap under the interpreter), then coded again to the same bytes
        loud = np.random.default_rng(7).integers(-2**30, 2**30, (1024, 32)).astype(np.int32)
        pending = rans_cuda.encode_many_cuda([torch.from_numpy(loud)] * 2, lane_tokens=64, sync=False, retry=True)
        ends = pending.spans.sum(1)
        esc_max = pending.summary[:, list(rans_cuda._kernels()["fields"]).index("group_escapes_max")]
        assert int(ends.max()) <= pending.buffer.numel() and int(esc_max.min()) > {escape_slots}
        assert all(bytes(b.numpy()) == rans.encode(loud, lane_tokens=64) for b in pending.result())
    """)


@needs_triton
def test_triton_interpreter_writes_the_same_bytes_on_a_small_case():
    """The fast stand-in of the test above (which is marked slow): one small tensor, the GPU
    encoder's bytes equal the numpy coder's and the GPU decoder gives the tensor back, with either
    slot lookup (one byte per slot then the symbol's entry, or one packed int32 per slot), on a
    tensor with escapes in several lane groups too; a flipped byte is caught."""
    run_interpreted("""
        import torch
        x = pca_like(200, 8)
        payload = rans.encode(x, lane_tokens=64)
        assert bytes(rans_cuda.encode_cuda(torch.from_numpy(x), lane_tokens=64).numpy()) == payload
        wide = pca_like(320, 40)
        wide[::37, :5] += 5000  # escapes in several groups
        wide_payload = rans.encode(wide, lane_tokens=64)
        assert rans.parse(wide_payload).n_escapes > 0
        for lookup in (True, False):
            rans_cuda.SYMBOL_LOOKUP = lookup
            for data, blob in ((x, payload), (wide, wide_payload)):
                y = rans_cuda.decode_cuda(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
                np.testing.assert_array_equal(y.numpy(), data, err_msg=f"SYMBOL_LOOKUP={lookup}")
        bad = bytearray(wide_payload)
        bad[len(bad) // 2] ^= 0x5A
        assert_gpu_decoder_refuses(bad)
    """)


@pytest.mark.slow
@needs_triton
def test_triton_interpreter_lanes_by_component_write_the_same_bytes():
    """The GPU coder's other lane order (a lane group walks one component's token chunks): its bytes
    equal the numpy coder's, which differ from the default order's; it decodes them to the tensor,
    as symbols and as scaled coefficient rows, in a list beside a default-order payload."""
    run_interpreted("""
        import torch
        x = pca_like(160, 24)
        x[::37, :5] += 5000  # escapes in several groups
        payload = rans.encode(x, lane_tokens=16, lanes_by_component=True)
        assert payload != rans.encode(x, lane_tokens=16)
        assert bytes(rans_cuda.encode_cuda(torch.from_numpy(x), lane_tokens=16, lanes_by_component=True).numpy()) \
            == payload
        other = rans.encode(x[:, :8], lane_tokens=64)
        blobs = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in (payload, other)]
        ys, _ = rans_cuda.decode_many_cuda(blobs)
        np.testing.assert_array_equal(ys[0].numpy(), x)
        np.testing.assert_array_equal(ys[1].numpy(), x[:, :8])
        # 32 blocks of 8 tokens, 20 components: whole groups of one component, decoded 16 components a
        # program (the last program's components past 20 masked)
        tall = pca_like(256, 20, seed=5)
        tall[::53, :3] += 7000
        tall_blob = rans.encode(tall, lane_tokens=8, lanes_by_component=True)
        ys, _ = rans_cuda.decode_many_cuda([torch.frombuffer(bytearray(tall_blob), dtype=torch.uint8)])
        np.testing.assert_array_equal(ys[0].numpy(), tall)
        tall_rows, _ = rans_cuda.decode_many_cuda(
            [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in (tall_blob, rans.encode(tall, lane_tokens=8))],
            scales=[(0.25, 1e9, 22, 20)] * 2)
        assert torch.equal(tall_rows[0], tall_rows[1])
        bad = bytearray(tall_blob)
        bad[len(bad) - 100] ^= 0x21
        assert_gpu_decoder_refuses(bad)
        by_token = torch.frombuffer(bytearray(rans.encode(x, lane_tokens=16)), dtype=torch.uint8)
        rows, _ = rans_cuda.decode_many_cuda([blobs[0], by_token], scales=[(0.5, 1e9, 26, 24)] * 2)
        want = torch.from_numpy(x * 0.5).float()
        assert torch.equal(rows[0], rows[1]) and bool(((rows[0][:, :24].float() - want).abs() <= want.abs() / 128).all())  # within one bf16 step
    """)


@pytest.mark.slow
@needs_triton
def test_triton_interpreter_tables_int64_fallbacks_write_the_same_bytes():
    """The tables kernel's int64 paths, which the host picks where counts or bit costs could pass
    int32 (COUNTS32 / COSTS32 False: tensors far longer than a test's), forced on short tensors."""
    run_interpreted("""
        import torch
        rans_tables.HIST_SAMPLE_ROWS = 64  # a sampled histogram (stride > 1) too
        kern = rans_cuda._kernels()
        tables = kern["tables"]

        class Forced:  # the launch, with the kernel's int32 switches overridden
            def __init__(self, **over):
                self.over = over

            def __getitem__(self, grid):
                return lambda *args, **kw: tables[grid](*args, **{**kw, **self.over})

        all_cases = cases()
        xs = [pca_like(300, 20), all_cases["heavy_tails"][:300], pca_like(1024, 12)]
        for over in (dict(COUNTS32=True, COSTS32=False), dict(COUNTS32=False, COSTS32=False)):
            kern["tables"] = Forced(**over)
            for i, x in enumerate(xs):
                for prob_bits in (9, 12):
                    payload = rans.encode(x, lane_tokens=64, prob_bits=prob_bits)
                    got = rans_cuda.encode_cuda(torch.from_numpy(x), lane_tokens=64, prob_bits=prob_bits)
                    assert bytes(got.numpy()) == payload, (over, i, prob_bits)
        kern["tables"] = tables
    """)


@needs_triton
def test_triton_interpreter_rejects_corruption():
    run_interpreted("""
        import torch
        payload = bytearray(rans.encode(pca_like(200, 8), lane_tokens=64))
        for i in (5, 47, 60, len(payload) // 2, len(payload) - 2):
            bad = bytearray(payload)
            bad[i] ^= 0xFF
            with pytest.raises(BitstreamError):
                rans_cuda.decode_cuda(torch.frombuffer(bad, dtype=torch.uint8))
        with pytest.raises(BitstreamError):
            rans_cuda.decode_cuda(torch.frombuffer(payload[:-3], dtype=torch.uint8))
    """)


@pytest.mark.slow
@needs_triton
def test_triton_interpreter_codes_many_payloads_in_one_launch():
    """encode_many_cuda writes the numpy coder's bytes for each tensor; decode_many_cuda: payloads of one shape but different tables, widths and escapes decode
    in shared launches (another shape in its own), each equal to the numpy decoder's output; a
    corrupt payload in the list is named by its index."""
    run_interpreted("""
        import torch
        extremes = pca_like(200, 16, seed=4)
        extremes[0, 0], extremes[1, 1] = -2**31, 2**31 - 1
        same_shape = [pca_like(200, 16, seed=s) for s in range(3)] + [cases()["heavy_tails"][:200], extremes,
                                                                      -np.abs(pca_like(200, 16, seed=5)) - 1000]
        xs = same_shape + [pca_like(64, 8, seed=9)]
        payloads = [rans.encode(np.ascontiguousarray(x), lane_tokens=64) for x in xs]
        tensors = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads]
        outs, err = rans_cuda.decode_many_cuda(tensors)
        assert not err.any()
        for x, y in zip(xs, outs):
            np.testing.assert_array_equal(y.numpy(), x)
        many = rans_cuda.encode_many_cuda([torch.from_numpy(np.ascontiguousarray(x)) for x in xs], lane_tokens=64)
        assert [bytes(m.numpy()) for m in many] == payloads
        # one buffer, views made on demand: the spans, slices and a list built from it agree
        assert isinstance(many, rans_cuda.Containers) and len(many) == len(xs)
        assert [bytes(many.buffer[a:a + n].numpy()) for a, n in many.spans.tolist()] == payloads
        assert [bytes(m.numpy()) for m in many[2:4] + many[-1:]] == payloads[2:4] + payloads[-1:]
        assert many[1] is many[1] and many.spans[:, 0].min() % 16 == 0
        # containers: each front (its last 8 bytes the payload length), payload, zero back; the
        # deferred form gives the same bytes at its spans before any host synchronization
        fronts = [bytes(range(16 * (1 + i % 3))) for i in range(len(xs))]
        backs = [4, 0, 16, 1, 4, 4, 7]
        ts = [torch.from_numpy(np.ascontiguousarray(x)) for x in xs]
        boxed = rans_cuda.encode_many_cuda(ts, lane_tokens=64, fronts=fronts, backs=backs, length_field=True)
        want = [f[:-8] + len(p).to_bytes(8, "little") + p + bytes(b) for f, p, b in zip(fronts, payloads, backs)]
        assert [bytes(m.numpy()) for m in boxed] == want
        pending = rans_cuda.encode_many_cuda(ts, lane_tokens=64, fronts=fronts, backs=backs, length_field=True,
                                             sync=False)
        assert [bytes(pending.buffer[a:a + n].numpy()) for a, n in pending.spans.tolist()] == want
        assert not pending.flags.any() and [bytes(m.numpy()) for m in pending.result(copy=False)] == want
        # copy_out (a CUDA graph's last kernel): the containers (up to the last one's end) and the
        # spans, flags and summary, copied where the slots point when it runs: a copy of its own,
        # untouched when the buffers it was copied from are written again (a graph's next replay)
        buffer = torch.zeros_like(pending.buffer)
        meta = torch.zeros(pending.meta_words(), dtype=torch.int64)
        pending.copy_out(torch.tensor([buffer.data_ptr(), buffer.numel() // 8, meta.data_ptr()]), meta=True)
        kept = pending.copied(buffer, meta)
        # containers beyond the room: not copied (the host copies them); no meta address: none written
        small = torch.zeros(64, dtype=torch.uint8)
        pending.copy_out(torch.tensor([small.data_ptr(), 8, 0]), meta=False)
        assert not small.any()
        # one shape: a sync result() over the device's copy (`out`) where it fits the room, else its own
        one = rans_cuda.encode_many_cuda(ts[:3], lane_tokens=64, fronts=fronts[:3], backs=backs[:3],
                                         length_field=True, sync=False)
        end = int((one.spans[:, 0] + one.spans[:, 1]).max())
        room = (end + 15) // 16 * 16
        fits = torch.zeros(room, dtype=torch.uint8)
        one.copy_out(torch.tensor([fits.data_ptr(), room // 8, 0]), meta=False)
        got = one.result(out=(fits, room))
        assert got.buffer.data_ptr() == fits.data_ptr() and [bytes(m.numpy()) for m in got] == want[:3]
        got = one.result(out=(small, 64))
        assert got.buffer.data_ptr() != small.data_ptr() and [bytes(m.numpy()) for m in got] == want[:3]
        for t in (pending.buffer, pending.spans, pending.flags, pending.summary):
            t.fill_(7)
        assert [bytes(kept.buffer[a:a + n].numpy()) for a, n in kept.spans.tolist()] == want
        assert not kept.flags.any() and [bytes(m.numpy()) for m in kept.result()] == want
        assert kept.buffer.data_ptr() != pending.buffer.data_ptr()
        with pytest.raises(ValueError, match="multiples of 16"):
            rans_cuda.encode_many_cuda(ts[:1], fronts=[b"x" * 8])
        bad = bytearray(payloads[3])
        bad[len(bad) // 2] ^= 0x10
        with pytest.raises(BitstreamError, match="payload 3 of the list"):
            rans_cuda.decode_many_cuda(tensors[:3] + [torch.frombuffer(bad, dtype=torch.uint8)] + tensors[4:])
    """)


def _quotients_by_reciprocal(x, d):
    """floor(x / d) as the kernels take it without dividing: (mulhi(x, m) + x) >> l with
    l = ceil(log2 d) and m = ceil(2^(32+l) / d) - 2^32 (x < 2^32, uint64 arithmetic)."""
    x, d = np.asarray(x, np.uint64), np.asarray(d, np.uint64)
    l = np.array([int(v - 1).bit_length() for v in d.ravel()], np.uint64).reshape(d.shape)
    m = ((np.uint64(1) << (np.uint64(32) + l)) + d - np.uint64(1)) // d - (np.uint64(1) << np.uint64(32))
    return (((x * m) >> np.uint64(32)) + x) >> l, m


def test_division_free_quotients_are_exact():
    """The rule behind the encoder lanes' reciprocals (frequencies up to 2^14, rans_cuda.recip_multipliers)
    and the tables kernel's quotients by a row's weight sum (up to 2^28, _rans_triton.divided): exact for
    every 32-bit numerator tried, near every multiple of the divisor and at the ends of the range."""
    rng = np.random.default_rng(3)
    powers = [(1 << b) + e for b in range(1, 29) for e in (-1, 0, 1)]
    ds = np.concatenate([np.arange(1, (1 << 14) + 1), powers, rng.integers(1, 1 << 28, 4000)]).astype(np.uint64)
    top = np.uint64((1 << 32) - 1)
    for d in np.array_split(ds, 16):
        k = (top // d)[:, None]  # the largest multiple below 2^32, and multiples near random ones
        mult = np.concatenate([k, rng.integers(0, k + 1, (len(d), 6)).astype(np.uint64), np.ones_like(k)], 1) * d[:, None]
        x = np.concatenate([mult, np.minimum(mult + 1, top), mult - 1, np.full_like(k, top),
                            rng.integers(0, 1 << 32, (len(d), 8)).astype(np.uint64)], 1)
        x[x > top] = 0  # 0 - 1 wrapped
        q, m = _quotients_by_reciprocal(x, d[:, None])
        np.testing.assert_array_equal(q, x // d[:, None])
        assert (m < (np.uint64(1) << np.uint64(32))).all()
    for n in (9, 11, 14):
        f = np.arange(1, (1 << n) + 1, dtype=np.uint64)
        np.testing.assert_array_equal(rans_cuda.recip_multipliers(n)[1:], _quotients_by_reciprocal(f, f)[1].astype(np.int64))


@needs_triton
def test_triton_interpreter_divides_by_reciprocal():
    """_rans_triton.divisor / divided, as the tables kernel runs them, give floor(x / d)."""
    run_interpreted("""
        import torch, triton, triton.language as tl
        from shared.codecs._rans_triton import divisor, divided

        @triton.jit
        def quotients(x_ptr, d_ptr, q_ptr, B: tl.constexpr):
            i = tl.program_id(0) * B + tl.arange(0, B)
            m, l = divisor(tl.load(d_ptr + i))
            tl.store(q_ptr + i, divided(tl.load(x_ptr + i), m, l))

        rng = np.random.default_rng(4)
        d = np.concatenate([np.arange(1, 4097), rng.integers(1, 1 << 28, 4096)]).astype(np.int64)
        x = np.concatenate([rng.integers(0, 1 << 31, 4096), (rng.integers(0, 1 << 31, 4096) // d[4096:]) * d[4096:] - 1])
        x = np.maximum(x, 0).astype(np.int32)
        q = torch.empty(len(d), dtype=torch.int32)
        quotients[(len(d) // 1024,)](torch.from_numpy(x), torch.from_numpy(d), q, B=1024)
        np.testing.assert_array_equal(q.numpy(), x // d)
    """)


# Compiling a kernel for sm_90 on this (GPU-less) machine and reading its SASS: (address, line) of
# each instruction, and the loops (backward branches; a warp's divergent-shuffle fallbacks past the
# exit are not loops) as (first, last) addresses.
SASS_TOOLS = r"""
import os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def sass(fn, signature, consts, num_warps):
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [(int(m.group(1), 16), l) for l in text.splitlines() if (m := re.search(r"/\*([0-9a-f]{4,})\*/\s+\S", l))]


def loops(lines):
    return [(int(b.group(1), 16), a) for a, l in lines if (b := re.search(r"\bBRA (0x[0-9a-f]+)", l))
            and int(b.group(1), 16) < a]
"""


def _run_sass_script(body: str) -> dict:
    """Runs SASS_TOOLS + body in a fresh process (Triton compiling, not interpreting); returns the
    JSON its last line prints, or skips where Triton's CUDA tools do not run."""
    code = SASS_TOOLS + textwrap.dedent(body)
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0 and ("ptxas" in r.stderr or "cuobjdump" in r.stderr):
        pytest.skip(f"Triton's CUDA tools are not usable here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# SASS instructions a step on sm_90 (when written: encode 71 with reciprocals and 87 dividing, decode 93,
# scaled decode 102, both with the stream's prefetch)
LANES_LOOP_BUDGET = {"encode": 80, "encode_divide": 100, "decode": 100, "decode_scaled": 105}


@needs_triton
def test_lanes_kernels_compile_to_lean_loops_for_hopper():
    """The lanes kernels compiled for sm_90 on this (GPU-less) machine, with the settings a GPU
    run uses: their per-step loop holds no barrier (values moved between layouts through shared
    memory cost the 4-group programs 17 a step) and stays within its instruction budget."""
    loops_found = _run_sass_script(r"""
        import inspect, json, sys
        sys.path[:0] = ['.']
        from shared.codecs import _rans_triton as kt, rans_cuda
        G, GPP = 32, rans_cuda.GROUPS_PER_PROGRAM
        types = {"buf_ptr": "*i16", "b16": "*i16", "b32": "*i32", "state_ptr": "*i32", "scal_ptr": "*i64",
                 "lo_ptr": "*i64", "w_ptr": "*i64", "a_ptr": "*i64", "rank_ptr": "*i64", "seg_ptr": "*i64",
                 "gend_ptr": "*i64", "geend_ptr": "*i64", "sym_ptr": "*i16", "step_ptr": "*fp32",
                 "bound_ptr": "*fp32", "lut_ptr": "*i32" if not rans_cuda.SYMBOL_LOOKUP else "*u8"}
        common = dict(HCAP=256, PROB_BITS=10, G=G, GPP=GPP, WIDE_INDEX=False, VOTE=True)
        decode = dict(common, PACKED=not rans_cuda.SYMBOL_LOOKUP, SEG_FIELDS=24, PREFETCH=True)
        out = {}
        for name, fn, consts in (("encode", kt.encode_kernel, dict(common, RECIP=True)),
                                 ("encode_divide", kt.encode_kernel, dict(common, RECIP=False)),
                                 ("decode", kt.decode_kernel, decode),
                                 ("decode_scaled", kt.decode_kernel, dict(decode, SCALED=True))):
            # defaulted constexpr parameters stay constexpr, as in a launch (else both branches compile)
            for a, prm in inspect.signature(fn.fn).parameters.items():
                if prm.default is not inspect.Parameter.empty and "constexpr" in str(prm.annotation):
                    consts.setdefault(a, prm.default)
            tab = {"tab_ptr": "*i64" if consts.get("RECIP") else "*i32"} if fn is kt.encode_kernel else {}
            sig = {a: "constexpr" if a in consts else {**types, **tab}.get(a, "*i32" if a.endswith("_ptr") else "i32")
                   for a in fn.arg_names}
            lines = sass(fn, sig, consts, GPP * G // 32)
            lo, hi = max(loops(lines), key=lambda r: r[1] - r[0])  # the longest backward branch: the per-step loop
            body = [l for a, l in lines if lo <= a <= hi]
            steps = kt.ENCODE_UNROLL if fn is kt.encode_kernel else 1  # the encoder's loop runs 8 steps
            out[name] = dict(instructions=len(body) / steps, barriers=sum("BAR.SYNC" in l for l in body),
                             spills=sum("LDL" in l or "STL" in l for l in body))
        print(json.dumps(out))
    """)
    print("lanes kernels, SASS instructions a step on sm_90:", loops_found)
    for name, stats in loops_found.items():
        assert stats["barriers"] == 0 and stats["spills"] == 0, (name, stats)
        assert stats["instructions"] <= LANES_LOOP_BUDGET[name], (name, stats)


# The encoder's tables kernel for one component of a short tensor (9-bit tables, one warp, as for a KV
# step's 60 x 192 components), SASS on sm_90, when written: 1688 instructions outside its loops (was
# 2646 with int64 counts, scans, sums and costs; 3400 while bit lengths took a 32-step loop and the
# reciprocals' multipliers a float64 division each), 383 in a step of its model search when the
# alphabet fits one chunk (was 582 in int64; 906 with two passes over it), 40 in a step of a table's
# normalization (91 dividing by the weights' sum); 3336 in all (was 5128)
TABLES_BUDGET = {"outside_loops": 1750, "search_step": 410, "bisection_step": 45}


@needs_triton
def test_tables_kernel_compiles_lean_for_hopper():
    """The tables kernel's straight-line code, model-search step and normalization step stay within
    their budgets: at 60 x 192 components a call, a few hundred instructions more per component cost
    microseconds."""
    stats = _run_sass_script(r"""
        import json, sys
        sys.path[:0] = ['.']
        from shared.codecs import _rans_triton as kt, rans_cuda, rans_tables
        fn = kt.tables_kernel
        types = dict(counts_ptr="*i32", mn_ptr="*i32", mx_ptr="*i32", codes_ptr="*u8", T="i32", R="i32", n_sampled="i32")
        sig = {a: types.get(a, "*i64") for a in fn.arg_names}
        consts = dict(HCAP=rans_tables.max_alphabet(9), PROB_BITS=9, ESC_COST=rans_tables.ESCAPE_COST,
                      ENTRY_COST=rans_tables.TABLE_ENTRY_COST, HAS_GUARD=False, N_SHAPES=rans_tables.N_SHAPES,
                      SEARCH=rans_tables.MODEL_SEARCH, SHAPE_STEPS=rans_tables.SHAPE_STEPS,
                      PARAM_BYTES=rans_tables.PARAM_BYTES, MIN_SHARE=rans_tables.MODEL_MIN_SHARE,
                      TRY_BLOCK=rans_cuda.TABLE_TRY_BLOCK, CHUNK=rans_cuda.TABLE_CHUNK, NARROW=False, RECIP=True,
                      COUNTS32=True, COSTS32=True)  # as the host sets them for T = 1024
        sig.update({k: "constexpr" for k in consts})
        lines = sass(fn, sig, consts, 1)
        end = min(a for a, l in lines if re.search(r"\s EXIT ;", l))  # the fallbacks past it run only on divergence
        found = [(lo, hi) for lo, hi in loops(lines) if hi < end]
        inside = {a for lo, hi in found for a, _ in lines if lo <= a <= hi}
        search = max(found, key=lambda r: r[1] - r[0])  # the model search: candidates, TRY_BLOCK at a time
        # the branch for an alphabet of one chunk ends in a jump over the two-pass one, which holds
        # the loops nested in the search
        first_nested = min(lo for lo, hi in found if search[0] < lo and hi < search[1])
        jumps = [(a, int(m.group(1), 16)) for a, l in lines if search[0] <= a < first_nested
                 and (m := re.search(r"^\s+/\*[0-9a-f]+\*/\s+BRA (0x[0-9a-f]+)", l))]
        jump, past = max(jumps, default=(search[1], search[1]))  # none: every step takes the whole loop
        one_pass = [a for a, _ in lines if search[0] <= a <= jump or past <= a <= search[1]]
        # the normalizations' bisections: the loops outside the search
        bisections = [hi - lo for lo, hi in found if hi < search[0] or lo > search[1]]
        print(json.dumps(dict(outside_loops=sum(1 for a, _ in lines if a < end and a not in inside),
                              search_step=len(one_pass), bisection_step=max(bisections) // 16 + 1)))
    """)
    print("tables kernel, SASS instructions on sm_90:", stats)
    for name, n in stats.items():
        assert n <= TABLES_BUDGET[name], (name, stats)


# the histogram's row loop on sm_90, int16 symbols, when written: 62 instructions a sampled value and no
# barrier; on [rows, components] tiles it took 92, 4 of them block barriers (each value moved from the
# loads' layout to the atomics' through shared memory). With 4 rows loaded a step: 54 a value, the 4
# loads in the step's first fifth
HIST_LOOP_BUDGET = 70


@needs_triton
def test_histogram_loop_keeps_one_layout_on_hopper():
    """The sampled histogram's loop over rows, compiled for sm_90 with the launch's settings: no block
    barrier (no value changes layout inside it), within its instruction budget a sampled value, and
    the step's HIST_AHEAD loads issued before its counting (in flight together)."""
    stats = _run_sass_script(r"""
        import json, sys
        sys.path[:0] = ['.']
        from shared.codecs import _rans_triton as kt, rans_cuda
        fn = kt.hist_kernel
        types = dict(sym_ptr="*i16", mn_ptr="*i32", mx_ptr="*i32", sm_ptr="*i64", counts_ptr="*i32")
        sig = {a: types.get(a, "i32") for a in fn.arg_names}
        consts = dict(HS=rans_cuda.HIST_TOKENS, CHUNKS=rans_cuda.HIST_CHUNKS, KB=rans_cuda.HIST_COMPONENTS,
                      HCAP=128, WIDE_INDEX=False, NARROW=True, AHEAD=rans_cuda.HIST_AHEAD)
        sig.update({k: "constexpr" for k in consts})
        lines = sass(fn, sig, consts, rans_cuda.HIST_WARPS)
        lo, hi = max(loops(lines), key=lambda r: r[1] - r[0])
        body = [l for a, l in lines if lo <= a <= hi]
        at = [i for i, l in enumerate(body) if " LDG" in l]
        print(json.dumps(dict(per_value=len(body) / rans_cuda.HIST_AHEAD, barriers=sum("BAR.SYNC" in l for l in body),
                              loads=len(at), last_load=max(at) / len(body), ahead=rans_cuda.HIST_AHEAD)))
    """)
    print("histogram row loop, SASS on sm_90:", stats)
    assert stats["barriers"] == 0 and stats["loads"] == stats["ahead"], stats
    assert stats["last_load"] < 0.25, stats  # every load before the counting
    assert stats["per_value"] <= HIST_LOOP_BUDGET, stats


@needs_triton
def test_triton_interpreter_stages_aligned_and_unaligned_containers():
    """The decode graph's staging copy: a container at an 8-byte aligned address goes over in words
    and its tail in bytes, any other byte by byte; each slot gets its container's bytes, nothing past."""
    run_interpreted("""
        import torch
        cap = 4096
        store = torch.arange(3 * cap, dtype=torch.int64).to(torch.uint8)
        assert store.data_ptr() % 8 == 0
        srcs = [store[a:a + n] for a, n in ((0, 1003), (8 * 300 + 3, 4093), (5016, 7))]
        table = torch.tensor([[s.data_ptr(), s.numel()] for s in srcs], dtype=torch.int64)
        buf = torch.full((3 * cap,), 0xAB, dtype=torch.uint8)
        rans_cuda._kernels()["stage"][(rans_cuda.triton_cdiv(cap, 256 * 4), 3)](
            table, buf, buf.view(torch.int64), cap, BLOCK=256, ITERS=4)
        for i, s in enumerate(srcs):
            assert torch.equal(buf[i * cap:i * cap + s.numel()], s), i
            assert bool((buf[i * cap + s.numel():(i + 1) * cap] == 0xAB).all()), i
    """)


@pytest.mark.slow
@needs_triton
def test_triton_interpreter_decodes_staged_containers_checked_on_the_device():
    """SlotDecoder (the decode CUDA graph's body): containers copied into slots in one launch, each
    held against the container the host checked (same bytes before the payload but its length, same
    fixed payload fields) and its header checked on the device as the host parser checks it. Valid
    containers of new payloads decode to the numpy decoder's output; a changed front, a header field
    out of range, a wrong length or trailer flags that container alone (2) and decodes nothing
    outside its slot; corrupt data is caught by the checksum (1)."""
    run_interpreted("""
        import torch
        def box(front, p):
            return front[:-8] + len(p).to_bytes(8, "little") + p + bytes(4)
        def tensor(b):
            return torch.frombuffer(bytearray(b), dtype=torch.uint8)
        first = [pca_like(200, 16, seed=s) for s in range(3)]
        later = [pca_like(200, 16, seed=10 + s) for s in range(2)] + [cases()["heavy_tails"][:200]]
        pay0 = [rans.encode(x, lane_tokens=64) for x in first]
        pay1 = [rans.encode(np.ascontiguousarray(x), lane_tokens=64) for x in later]
        fronts = [bytes(range(16 * (1 + i))) for i in range(3)]
        hdr = rans.read_header(pay0[0])
        dec = rans_cuda.SlotDecoder([box(f, p)[:len(f)] for f, p in zip(fronts, pay0)], pay0, hdr, 4096, "cpu")
        for xs, pays in ((first, pay0), (later, pay1)):
            blobs = [tensor(box(f, p)) for f, p in zip(fronts, pays)]
            assert dec.fits(blobs)
            dec.set_sources(blobs)
            outs, err = dec.launch()
            assert err.tolist() == [0, 0, 0]
            for x, y in zip(xs, outs):
                np.testing.assert_array_equal(y.numpy(), x)
        def flags(i, edit):
            raw = [bytearray(box(f, p)) for f, p in zip(fronts, pay1)]
            edit(raw[i], len(fronts[i]))
            blobs = [tensor(r) for r in raw]
            dec.set_sources(blobs)
            outs, err = dec.launch()
            for j in range(3):
                if j != i:
                    np.testing.assert_array_equal(outs[j].numpy(), later[j])
            return err.tolist()
        def checked(i, edit):  # the device-side container and header check's flag (the kernels may add 1)
            return [e & 2 for e in flags(i, edit)]
        def poke(at, value):
            def edit(r, a):
                r[a + at if at >= 0 else len(r) + at] = value
            return edit
        assert checked(1, lambda r, a: r.__setitem__(3, r[3] ^ 1)) == [0, 2, 0]           # a front byte
        assert checked(0, poke(8, 17)) == [2, 0, 0]                                         # T, a fixed field
        assert checked(2, poke(36, 3)) == [0, 0, 2]                                         # lo_bytes = 3
        assert checked(1, poke(38, 1)) == [0, 2, 0]                                         # reserved
        assert checked(0, poke(27, 0x7F)) == [2, 0, 0]                                      # n_escapes
        assert checked(2, poke(47, 0x80)) == [0, 0, 2]                                      # stream words
        assert checked(1, poke(-1, 1)) == [0, 2, 0]                                         # trailer
        assert flags(0, poke(-9, 0)) != [0, 0, 0]                                          # last payload byte
        assert checked(2, lambda r, a: r.__setitem__(a - 8, r[a - 8] ^ 2)) == [0, 0, 2]     # length field
        assert flags(1, lambda r, a: r.__setitem__(a + 300, r[a + 300] ^ 4)) == [0, 1, 0]  # data: checksum
    """)


@pytest.mark.slow
@needs_triton
def test_triton_interpreter_slot_decoder_narrow_symbols_flag_values_beyond_int16():
    """The decode graph's int16 symbols: the int32 decoder's values where every value fits; a
    payload with an escaped value beyond int16, or a window reaching past it, flags 8, alone."""
    run_interpreted("""
        import torch
        rng = np.random.default_rng(0)
        xs = [rng.integers(-40, 40, (128, 16)).astype(np.int32) for _ in range(3)]
        xs[1][7, 3] = 100000  # an escape beyond int16
        xs[2] += 32760  # a window [32720, 32799]
        pays = [rans.encode(x, lane_tokens=64) for x in xs]
        blobs = [bytes(8) + len(p).to_bytes(8, "little") + p + bytes(4) for p in pays]
        hdr = rans.read_header(pays[0])
        cap = rans_cuda.slot_bytes([b[:16] for b in blobs], hdr, max(map(len, blobs)))
        sources, got = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs], {}
        for narrow in (False, True):
            dec = rans_cuda.SlotDecoder([b[:16] for b in blobs], pays, hdr, cap, "cpu", narrow=narrow)
            dec.set_sources(sources)
            outs, err = dec.launch()
            got[narrow] = [o.numpy().copy() for o in outs], err.tolist()
        assert got[False][1] == [0, 0, 0] and all((y == x).all() for y, x in zip(got[False][0], xs))
        assert got[True][1] == [0, rans_cuda.NARROW_OVERFLOW, rans_cuda.NARROW_OVERFLOW]
        assert got[True][0][0].dtype == np.int16 and (got[True][0][0] == xs[0]).all()
    """)


@needs_triton
def test_slot_decoder_places_only_what_fits_and_uploads_addresses_only_when_they_move():
    """A decode graph's per-call host work: placed() accepts 1-D uint8 tensors of at most a slot on
    the decoder's device and nothing else; set_sources() copies the address table to the device
    only when an address or a length changed since the last call."""
    import torch

    pays = [rans.encode(pca_like(200, 16, seed=s), lane_tokens=64) for s in range(2)]
    fronts = [bytes(16), bytes(32)]
    dec = rans_cuda.SlotDecoder(fronts, pays, rans.read_header(pays[0]), 4096, "cpu")
    blobs = [torch.zeros(1000, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)]
    ptrs, lens = dec.placed(blobs)
    assert ptrs == [b.data_ptr() for b in blobs] and lens == [1000, 4096]
    for wrong in ([blobs[0]], blobs + blobs[:1], [blobs[0], torch.zeros(4097, dtype=torch.uint8)],
                  [blobs[0], torch.zeros(64, dtype=torch.int16)], [blobs[0], torch.zeros((2, 8), dtype=torch.uint8)],
                  [blobs[0], bytes(64)], [blobs[0], np.zeros(64, np.uint8)]):
        assert dec.placed(wrong) is None and not dec.fits(wrong)
    with pytest.raises(ValueError, match="slot size"):
        dec.set_sources([blobs[0], bytes(64)])
    dec.set_sources(blobs)
    assert dec.sources.tolist() == [[p, n] for p, n in zip(ptrs, lens)]
    dec.sources.zero_()  # a second call with the containers where they were: no copy
    dec.set_sources(blobs)
    assert dec.sources.tolist() == [[0, 0], [0, 0]]
    moved = [blobs[0], torch.ones(4000, dtype=torch.uint8)]
    dec.set_sources(moved)
    assert dec.sources.tolist() == [[blobs[0].data_ptr(), 1000], [moved[1].data_ptr(), 4000]]
    # an encoder's Containers: placed from its buffer and spans, the same addresses its views have
    buffer = torch.zeros(9000, dtype=torch.uint8)
    held = rans_cuda.Containers(buffer, np.array([4096, 0]), np.array([8192, 1000]))
    assert dec.placed(held) == ([v.data_ptr() for v in held], [4096, 1000])
    too_long = rans_cuda.Containers(buffer, np.array([0, 4096]), np.array([4097, 4100]))
    assert dec.placed(too_long) is None and dec.placed(rans_cuda.Containers(buffer, np.array([0]), np.array([8]))) is None


def test_decode_graphs_are_keyed_only_for_containers_on_one_gpu():
    """decode_many's graph key (computed on every call): none for host tensors, bytes or an empty
    list, so those lists always take the host path."""
    import torch

    from shared import cuda_graphs

    codecs = [object(), object()]
    for blobs in ([torch.zeros(64, dtype=torch.uint8)] * 2, [bytes(64)] * 2, [np.zeros(64, np.uint8)] * 2, []):
        assert cuda_graphs.decode_graph_key(codecs, blobs, "cuda", 1 << 20) is None


def test_a_graph_keeps_the_cached_tensors_it_was_captured_with():
    """A cache of device tensors drops its oldest entry when full; a CUDA graph captured with one
    (under holding_cached) keeps it, so the graph never reads freed memory."""
    class Graph:
        pass

    cache, graph = {}, Graph()
    first = object()
    got = rans_cuda.holding_cached(graph, lambda: rans_cuda.cached_on_device(cache, "a", lambda: first, limit=1))
    assert got is first and graph.held_cached == [first]
    rans_cuda.cached_on_device(cache, "b", object, limit=1)  # outside a capture: nothing is held
    assert "a" not in cache and graph.held_cached == [first] and rans_cuda._HOLDS is None


def test_a_lane_off_its_warp_lane_is_reported_as_a_fault_of_the_coder():
    import torch

    rans_cuda.check_lane_map(torch.tensor([0, 1, 2, 1], dtype=torch.int32))  # corruption and mismatches: not this fault
    with pytest.raises(RuntimeError, match="USE_WARP_VOTE"):
        rans_cuda.check_lane_map(torch.tensor([0, 5], dtype=torch.int32))


def test_cuda_functions_need_a_cuda_tensor(monkeypatch):
    torch = pytest.importorskip("torch")
    from shared.errors import BackendUnavailable

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailable, match="CUDA tensor"):
        rans_cuda.encode_cuda(torch.zeros((4, 4), dtype=torch.int32))
    with pytest.raises(InvalidTensorError):
        rans_cuda.encode_cuda(np.zeros((4, 4), np.int32))


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(cases()))
def test_cuda_and_cpu_cross_decode(name, monkeypatch):
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = cases()[name]
    t = torch.from_numpy(x).cuda()
    gpu_payload = rans_cuda.encode_cuda(t)
    cpu_payload = rans.encode(x)
    assert bytes(gpu_payload.cpu().numpy()) == cpu_payload
    np.testing.assert_array_equal(rans.decode(bytes(gpu_payload.cpu().numpy())), x)
    y = rans_cuda.decode_cuda(torch.frombuffer(bytearray(cpu_payload), dtype=torch.uint8).cuda())
    assert torch.equal(y, t)


@pytest.mark.gpu
@pytest.mark.parametrize("vote,lookup", [(True, True), (False, True), (True, False)])
def test_cuda_large_round_trip(vote, lookup, monkeypatch):
    """Both ways of ranking a group's lanes (warp vote, Triton's scan) write the CPU coder's bytes;
    both slot lookups (SYMBOL_LOOKUP) decode them."""
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(rans_cuda, "USE_WARP_VOTE", vote)
    monkeypatch.setattr(rans_cuda, "SYMBOL_LOOKUP", lookup)
    g = torch.Generator(device="cuda").manual_seed(0)
    sigma = 40 * torch.arange(1, 257, device="cuda", dtype=torch.float32) ** -0.7
    t = torch.round(torch.randn((65536, 256), device="cuda", generator=g) * sigma).to(torch.int32)
    payload = rans_cuda.encode_cuda(t)
    assert torch.equal(rans_cuda.decode_cuda(payload), t)
    assert len(payload) < 1.03 * rans.entropy_bound_bytes(t.cpu().numpy())
    t[::97, :40] += 100000  # outliers: escapes in many groups, more than the first try's buffer in some
    monkeypatch.setattr(rans_cuda, "ESCAPES_PER_GROUP", 8)
    payload = rans_cuda.encode_cuda(t)
    assert rans.parse(bytes(payload.cpu().numpy())).n_escapes > 0
    assert bytes(payload.cpu().numpy()) == rans.encode(t.cpu().numpy())
    assert torch.equal(rans_cuda.decode_cuda(payload), t)


@pytest.mark.gpu
def test_cuda_rejects_corruption(monkeypatch):
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    payload = rans_cuda.encode_cuda(torch.from_numpy(pca_like(3000, 32)).cuda())
    for i in (7, 100, len(payload) // 2, len(payload) - 2):
        bad = payload.clone()
        bad[i] ^= 0xFF
        with pytest.raises(BitstreamError):
            rans_cuda.decode_cuda(bad)


@pytest.mark.slow
@needs_triton
def test_triton_interpreter_scaled_decode_and_gemm_match_the_cpu_decoder():
    """The GPU decode of bf16 containers, under the interpreter on CPU tensors: the decoder writes
    bf16(value * step) rows and one GEMM with the basis and the mean reconstructs them. Two tensors
    of one shape decoded together (a stacked projection) and one of another shape, each within one
    bf16 rounding of the CPU decoder's tensor (the interpreter truncates where a GPU rounds); a
    payload whose window reaches past the decoder's bound is named as corrupt; a payload whose K
    differs from its rows' is refused before anything runs (a wider K would write past them)."""
    run_interpreted('''
        import torch
        from shared import launches
        from shared.basis import fit_basis
        from shared.container import unpack
        from shared.errors import BitstreamError
        from shared.pipeline import TensorCodec
        from shared.rdquant import calibrate_step
        rng = np.random.default_rng(3)
        calib = rng.standard_normal((400, 24)).astype(np.float32) @ rng.standard_normal((24, 24)).astype(np.float32)
        basis = calibrate_step(fit_basis([calib], k=24), [calib], 0.999)
        small = TensorCodec(fit_basis([calib], k=12), backend="rans", step=0.05)
        xs = [rng.standard_normal((n, 24)).astype(np.float32) @ rng.standard_normal((24, 24)).astype(np.float32) + 3
              for n in (130, 130, 70)]
        codecs = [TensorCodec(basis, backend="rans") for _ in xs[:2]] + [small]
        blobs = [c.encode(torch.from_numpy(x).bfloat16()) for c, x in zip(codecs, xs)]

        def jobs_of(blobs):
            jobs = []
            for i, b in enumerate(blobs):
                header, chunks = unpack(b)
                data = chunks["DATA"]
                jobs.append(launches.DecodeJob(i, header, chunks["QPAR"],
                                               torch.frombuffer(bytearray(data), dtype=torch.uint8), data[:64], None,
                                               None))
            return jobs

        out = [None] * 3
        launches.decode_symbols_cuda(codecs, jobs_of(blobs), out)
        for c, b, got in zip(codecs, blobs, out):
            want = c.decode(b).bfloat16().float()
            err = (got.float() - want).abs()
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            # each coefficient rounded once either way (2^-8 relative where the interpreter truncates):
            # the difference is bounded by the sum of the GEMM's terms, not by the output
            terms = (want - torch.from_numpy(c.basis.mean)).abs().max() + 1
            rms = float(((got.float() - want) ** 2).mean().sqrt() / (want ** 2).mean().sqrt())
            assert float(err.max()) <= 2 ** -5 * float(terms) and rms < 2 ** -6, (float(err.max()), rms)
        # a payload decoding past the bound: scale the basis down so its bound shrinks below the values
        loud = TensorCodec(basis, backend="rans")
        proj = loud._projection(24, "cpu")
        proj._bound = 1e-3
        try:
            launches.decode_symbols_cuda([codecs[0], loud], jobs_of(blobs[:2]), [None, None])
            raise SystemExit("a value past the bound decoded")
        except BitstreamError as e:
            assert "blob 1" in str(e), e
        # K of the payload (24) against rows made for a basis of 12 components
        try:
            rans_cuda.decode_many_cuda([jobs_of(blobs[:1])[0].payload], scales=[(0.05, 1e30, 16, 12)])
            raise SystemExit("a payload with another K decoded")
        except BitstreamError as e:
            assert "holds 24 components" in str(e), e
    ''')


@pytest.mark.gpu
def test_cuda_scaled_decode_rounds_as_torch_and_reads_payloads_in_place(monkeypatch):
    """On a GPU the scaled decode writes exactly torch's bf16(float32(value) * step) (round to nearest
    even), its padding columns 1, 1, 0...; payloads cut from one buffer are decoded in place (no
    copy) to the same rows as each alone; a step that pushes a value past the bound is flagged."""
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    t = torch.from_numpy(pca_like(3000, 40)).cuda()
    blobs = rans_cuda.encode_many_cuda([t, t + 1])  # views of one compact buffer
    assert len({b.untyped_storage().data_ptr() for b in blobs}) == 1
    assert rans_cuda._shared_view(torch, blobs)[0] is not None
    step, width = 0.0123, 48
    rows, err = rans_cuda.decode_many_cuda(blobs, scales=[(step, 1e30, width, 40)] * 2, check=False)
    assert not bool(err.any())
    for want, got in zip((t, t + 1), rows):
        assert torch.equal(got[:, :40], (want.float() * step).to(torch.bfloat16))
        assert torch.equal(got[:, 40:42], torch.ones_like(got[:, 40:42])) and not bool(got[:, 42:].any())
    alone, _ = rans_cuda.decode_many_cuda([blobs[1].clone()], scales=[(step, 1e30, width, 40)], check=False)
    assert torch.equal(alone[0], rows[1])
    bound = float(t.abs().max()) * step / 2  # half the largest |value x step|: some lane passes it
    _, err = rans_cuda.decode_many_cuda(blobs, scales=[(step, 1e30, width, 40), (step, bound, width, 40)],
                                        check=False)
    assert err.tolist()[0] == 0 and err.tolist()[1] & 1


@needs_triton
def test_triton_interpreter_joins_containers_to_the_cpu_coders_bytes():
    """TensorCodec.join through the GPU coder's kernels (here under Triton's interpreter, on CPU tensors)
    writes the container the CPU coder's join writes: the same symbols, coded again to the same bytes."""
    run_interpreted("""
        import torch
        from shared.basis import fit_basis
        from shared.pipeline import TensorCodec
        x = torch.from_numpy(pca_like(300, 16)).to(torch.bfloat16)
        codec = TensorCodec(fit_basis([x.float().numpy()], k=16), backend="rans", step=0.05, lane_tokens=64)
        parts = [codec.encode(x[:200]), codec.encode(x[200:])]
        assert codec.join(parts, device="cpu") == codec.join(parts)
    """)


@pytest.mark.slow
@needs_triton
def test_triton_interpreter_decodes_kv_codec_blobs_as_the_cpu_coder_does():
    """KVCodec.decode(blob, device): the payload decoded by the GPU coder's kernels (here under Triton's
    interpreter, on CPU tensors) gives the CPU coder's symbols, so the same rows (raw sink rows, keys
    rotated forward again)."""
    run_interpreted("""
        import numpy as np
        import torch
        from shared.kvcodec import Rope, fit_kv_codec
        g = torch.Generator().manual_seed(3)
        calib = [[(torch.randn(96, 32, generator=g) * torch.linspace(3, 0.1, 32),
                   torch.randn(96, 32, generator=g) * torch.linspace(2, 0.2, 32))] for _ in range(2)]
        rope = Rope(1.0 / 10000 ** (np.arange(0, 16, 2) / 16))
        codec = fit_kv_codec(calib, 2, sink=4, pre_rope=True, rope=rope).set_scale(0.3)
        x = torch.randn(80, 32, generator=g) * torch.linspace(3, 0.1, 32)
        for kind in "kv":
            blob = codec.encode(x, 0, kind, start=7)
            on_cpu, by_kernels = codec.decode(blob), codec.decode(blob, device="cpu")
            torch.testing.assert_close(by_kernels, on_cpu, rtol=0, atol=1e-5)
            assert torch.equal(by_kernels[:4], x[:4].bfloat16().float())
    """)


@pytest.mark.slow
@needs_triton
def test_triton_interpreter_runs_the_batched_launches_and_their_records():
    """The encode side of the compute codec's GPU launches (shared/launches.py) under Triton's interpreter, on
    CPU tensors: a codec readied for a tensor keeps its device projection and container front by name and
    reuses them; two tensors of one shape share a stacked projection; encode_launch's containers decode on the
    CPU to the stated quality; a new basis drops what was made from the old one. (decode_symbols_cuda has its
    own interpreter test above: test_triton_interpreter_scaled_decode_and_gemm_match_the_cpu_decoder.)"""
    run_interpreted("""
        import torch

        from shared import launches
        from shared.basis import fit_basis
        from shared.pipeline import TensorCodec
        rng = np.random.default_rng(3)
        mix = rng.standard_normal((24, 24)).astype(np.float32)
        basis = fit_basis([rng.standard_normal((400, 24)).astype(np.float32) @ mix], k=24)
        codecs = [TensorCodec(basis, backend="rans", step=0.05) for _ in range(3)]
        xs = [torch.from_numpy(rng.standard_normal((n, 24)).astype(np.float32) @ mix).bfloat16() for n in (130, 130, 70)]
        prepared = [c._cuda_prepare(x) for c, x in zip(codecs, xs)]
        assert type(codecs[0]._proj).__name__ == "DeviceProjection" and codecs[0]._proj.device == "cpu"
        again = [c._cuda_prepare(x) for c, x in zip(codecs, xs)]
        assert all(a.front == b.front and a.projection is b.projection for a, b in zip(prepared, again))
        blobs = [bytes(b.numpy()) for b in launches.encode_launch(codecs, xs, prepared, sync=True).result()]
        assert len(launches._STACKED) == 1 and type(next(iter(launches._STACKED.values()))).__name__ == "StackedProjection"
        for b, c, x in zip(blobs, codecs, xs):
            cos = torch.nn.functional.cosine_similarity(c.decode(b).float(), x.float(), dim=1).mean()
            assert cos > 0.999, cos
        front = codecs[2]._front
        codecs[2]._cuda_prepare(xs[0])
        assert codecs[2]._front.key != front.key
        codecs[2].basis = basis
        assert codecs[2]._proj is None and "_front" not in codecs[2].__dict__
    """)

"""A decoder that a hostile or broken sender cannot crash, hang or exhaust: one test per class of
failure (every CRC32 recomputed, so the mutation reaches the parser), and the encoder's refusals."""
import json
import math
import random
import struct
import time

import numpy as np
import pytest
import torch

from shared import fuzz, schema
from shared.basis import fit_basis
from shared.codecs import rans
from shared.container import read_header, unpack
from shared.errors import BitstreamError, ConfigurationError, InvalidTensorError, TensorCodecError
from shared.pipeline import TensorCodec
from shared.quant import PerChannelQuantizer
from shared.rdquant import RDQuantizer, find_step, quality
from test_rans import needs_triton, run_interpreted


def tensor(T=256, D=48, seed=0):
    rng = np.random.default_rng(seed)
    return torch.from_numpy((rng.standard_normal((T, D)) * np.linspace(2, 0.1, D)).astype(np.float32))


@pytest.fixture(scope="module")
def streams():
    x = tensor()
    basis = fit_basis([x], k=16)
    out = {"basis": basis, "x": x}
    for backend in ("zstd", "raw", "x265", "ffv1"):
        out[backend] = TensorCodec(None, backend=backend, frame_size=64).encode(x)
    out["rans"] = TensorCodec(basis, backend="rans", step=0.02).encode(x)
    return out


def edit_header(blob, fn):
    head, chunks = fuzz.split(blob)
    header = json.loads(head)
    fn(header)
    return fuzz.assemble(json.dumps(header).encode(), chunks)


def decoder(streams, backend):
    return TensorCodec(streams["basis"] if backend == "rans" else None, backend="raw")


# -- the header's JSON ------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,match", [
    (b"", "not valid JSON"), (b"[" * 1000 + b"]" * 1000, "brackets|nests"), (b"[]", "not an object"),
    (b'"x"', "not an object"), (b"1", "not an object"), (b"\xff\xfe", "not valid JSON"),
    (b'{"shape":[' + b"9" * 5000 + b',2]}', "digits"), (b'{"a":NaN}', "NaN"),
])
def test_malformed_header_json_is_a_bitstream_error(streams, raw, match):
    _, chunks = fuzz.split(streams["zstd"])
    with pytest.raises(BitstreamError, match=match):
        unpack(fuzz.assemble(raw, chunks))


@pytest.mark.parametrize("key", ["shape", "dtype", "basis", "quant", "codec", "frames", "fallback", "chunks"])
def test_missing_or_wrong_typed_header_fields_are_named(streams, key):
    for backend in ("zstd", "rans"):
        with pytest.raises(BitstreamError, match=f"'{key}"):
            unpack(edit_header(streams[backend], lambda h: h.pop(key)))
        with pytest.raises(BitstreamError, match=f"'{key}"):
            unpack(edit_header(streams[backend], lambda h: h.__setitem__(key, 7)))


@pytest.mark.parametrize("dtype", ["int8", "bool", "complex64", "uint8", "\x00float32", "Tensor", ""])
def test_only_float_dtypes_are_accepted(streams, dtype):
    with pytest.raises(BitstreamError, match="'dtype'"):
        unpack(edit_header(streams["zstd"], lambda h: h.__setitem__("dtype", dtype)))


@pytest.mark.parametrize("chunks", [[], ["DATA"], ["QPAR"], ["DATA", "QPAR"], ["QPAR", "DATA", "DATA"]])
def test_the_chunk_list_must_be_exactly_qpar_data(streams, chunks):
    head, parts = fuzz.split(streams["zstd"])
    header = dict(json.loads(head), chunks=chunks)
    by_tag = dict((t.decode(), p) for t, p in parts)
    blob = fuzz.assemble(json.dumps(header).encode(), [[t.encode(), by_tag[t]] for t in chunks])
    with pytest.raises(BitstreamError, match="'chunks'"):
        unpack(blob)


@pytest.mark.parametrize("field,value", [("height", 0), ("height", 60), ("width", float("nan")), ("width", 64.0),
                                         ("height", 2**40), ("tokens", 0), ("tokens", 257), ("channels", -1),
                                         ("channels", 47), ("width", True)])
def test_frame_layout_fields_are_checked(streams, field, value):
    blob = edit_header(streams["x265"], lambda h: h["frames"].__setitem__(field, value))
    with pytest.raises(BitstreamError, match="frames" if value == value else "NaN"):
        TensorCodec(None, backend="raw").decode(blob)


@pytest.mark.parametrize("edit,match", [
    (lambda h: h.__setitem__("shape", [256, 0]), "shape"), (lambda h: h.__setitem__("shape", [2**40, 48]), "max_elements"),
    (lambda h: h["basis"].__setitem__("k", 49), "basis.k"), (lambda h: h["basis"].__setitem__("hash", "../x"), "hash"),
    (lambda h: h["quant"].__setitem__("step", float("inf")), "Infinity"),
    (lambda h: h["quant"].__setitem__("step", 1e300), "quant.step"),
    (lambda h: h["quant"].__setitem__("step", -1.0), "quant.step"),
    (lambda h: h["quant"].__setitem__("kind", "per_channel"), "quant|frames"),
    (lambda h: h["codec"].__setitem__("settings", {"stream": 1234}), "settings"),
])
def test_header_ranges_and_consistency(streams, edit, match):
    with pytest.raises(BitstreamError, match=match):
        TensorCodec(streams["basis"], backend="raw").decode(edit_header(streams["rans"], edit))


def test_settings_a_bitstream_may_not_choose(streams):
    for settings in ({"width": 8}, {"gpu": 3}, {"device": "cuda:7"}, {"qp": [1]}, {"x" * 100: 1}, {"qp": 2**40}):
        with pytest.raises(BitstreamError, match="settings"):
            unpack(edit_header(streams["x265"], lambda h: h["codec"].__setitem__("settings", settings)))


def test_fixed_header_says_corrupt_or_not_ours_and_upgrade_only_when_plausible(streams):
    blob = bytearray(streams["zstd"])
    with pytest.raises(BitstreamError, match="not ours"):
        unpack(b"XXXX" + bytes(blob[4:]))
    blob[4] = 200
    with pytest.raises(BitstreamError, match="not ours"):
        unpack(bytes(blob))
    blob[4] = 3  # this build writes version 2
    with pytest.raises(BitstreamError, match="upgrade"):
        unpack(bytes(blob))
    head_len = struct.pack("<I", 2**31)
    with pytest.raises(BitstreamError, match="header length"):
        unpack(bytes(streams["zstd"][:5]) + head_len + bytes(streams["zstd"][9:]))


# -- chunk sizes against the header -----------------------------------------------------------------
def test_chunk_sizes_must_match_the_header(streams):
    for backend, tag, delta in (("raw", b"DATA", -1), ("zstd", b"QPAR", 8), ("rans", b"QPAR", 3)):
        head, chunks = fuzz.split(streams[backend])
        chunks = [[t, p + bytes(delta) if t == tag and delta > 0 else p[:delta] if t == tag else p] for t, p in chunks]
        with pytest.raises(BitstreamError, match=f"'{tag.decode()}'"):
            unpack(fuzz.assemble(head, chunks))


# -- rANS: sizes bounded before allocating ----------------------------------------------------------
def rans_payload_with(payload, **fields):
    names = list(fuzz.RANS_FIELDS)
    values = list(rans.HEADER.unpack(payload[:rans.HEADER.size]))[:len(names)]
    for k, v in fields.items():
        values[names.index(k)] = v
    return fuzz._rans_fix(rans.HEADER.pack(*values, 0, 0) + payload[rans.HEADER.size:])


def test_rans_tokens_and_lane_size_raised_together_are_refused_at_once(streams):
    """The attack from the issue: T and the lane size S scaled together keep every section's length."""
    payload = unpack(streams["rans"])[1]["DATA"]
    hdr = rans.read_header(payload)
    for f in (16, 2**12, 2**20):
        bad = rans_payload_with(payload, T=hdr.T * f, S=min(hdr.S * f, 2**32 - 1))
        t0 = time.perf_counter()
        with pytest.raises(BitstreamError, match="max_elements|lane_tokens"):
            rans.decode(bad, max_elements=hdr.T * hdr.K)
        with pytest.raises(BitstreamError):
            rans.decode(bad)  # the default limit or the checks behind it
        # inside the container the rANS header must agree with the header's shape and K
        head, chunks = fuzz.split(streams["rans"])
        blob = fuzz.assemble(head, [[t, bad if t == b"DATA" else p] for t, p in chunks])
        with pytest.raises(BitstreamError, match="DATA"):
            unpack(blob)
        assert time.perf_counter() - t0 < 2


def test_rans_header_fields_name_what_is_out_of_range(streams):
    payload = unpack(streams["rans"])[1]["DATA"]
    for field, value, match in (("prob_bits", 20, "prob_bits=20"), ("G", 3, "group_lanes=3"), ("K", 0, "K=0"),
                                ("lo_bytes", 3, "lo_bytes=3"), ("n_escapes", 2**32 - 1, "n_escapes"),
                                ("stream_words", 2**40, "add up"), ("version", 9, "not ours"),
                                ("version", 4, "upgrade")):
        with pytest.raises(BitstreamError, match=match):
            rans.decode(rans_payload_with(payload, **{field: value}))


def test_rans_table_budget_bounds_decoder_memory():
    # one token of 8192 components at 2^15 table entries each would be 2^28 entries: refused, both ways
    assert not rans.table_budget_ok(1, 8192, 15) and rans.table_budget_ok(1, 8192, 11)
    assert rans.table_budget_ok(4096, 8192, 15)
    with pytest.raises(InvalidTensorError, match="table entries"):
        rans.encode(np.zeros((1, 8192), np.int32), prob_bits=15)


def test_limits_are_caller_settable(streams):
    codec = TensorCodec(streams["basis"], backend="raw")
    with pytest.raises(BitstreamError, match="max_elements=1000"):
        codec.decode(streams["rans"], max_elements=1000)
    with pytest.raises(BitstreamError, match="max_elements"):
        TensorCodec(None, backend="raw").decode(streams["zstd"], max_elements=256 * 48)  # its frames are larger
    assert codec.decode(streams["rans"], max_elements=256 * 48).shape == (256, 48)
    for bad in (0, -1, 1.5, True, "big"):
        with pytest.raises(ConfigurationError, match="max_elements"):
            codec.decode(streams["rans"], max_elements=bad)


@needs_triton
def test_cpu_and_gpu_decoders_reject_the_same_rans_headers():
    """decode_cuda reads the header with the same function before it allocates: the same
    mutants are refused, with the same messages (run under Triton's CPU interpreter)."""
    run_interpreted("""
        import random
        import torch
        from shared import fuzz
        from shared.errors import BitstreamError
        x = np.random.default_rng(0).integers(-20, 20, (300, 6)).astype(np.int32)
        payload = rans.encode(x)
        rng = random.Random(0)
        head = rans.HEADER.unpack(payload[:56])
        checked = 0
        for i in range(60):
            values = list(head)
            j = rng.randrange(1, 15)
            values[j] = rng.choice([0, 1, 3, 2**31, 2**32 - 1, values[j] * 2, values[j] + 1]) & (
                [0, 255, 255, 65535] + [2**32 - 1] * 7 + [255, 255, 65535, 2**64 - 1])[j]
            if i % 3 == 0:
                values[4], values[6] = min(values[4] * 4096, 2**32 - 1), min(values[6] * 4096, 2**32 - 1)
            bad = fuzz._rans_fix(rans.HEADER.pack(*values[:15], 0, 0) + payload[56:])
            try:
                rans.read_header(bad, max_elements=2**20)
                continue  # passes the header: the kernels then check tables and states
            except BitstreamError as e:
                cpu = str(e)
            try:
                rans_cuda.decode_cuda(torch.frombuffer(bytearray(bad), dtype=torch.uint8))
                raise AssertionError("decode_cuda accepted a header the CPU decoder refuses: " + cpu)
            except BitstreamError as e:
                assert "max_elements" in cpu or str(e) == cpu, (cpu, str(e))
            checked += 1
        assert checked > 20, checked
    """)


# -- bounded zstd and PyAV decodes ------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker():
    seeds = fuzz.make_seeds(("zstd", "x265", "ffv1"))
    fuzz.BOMBS.update(fuzz.make_bombs())
    pool = fuzz.Pool(seeds)
    yield seeds, pool
    pool.stop()


@pytest.mark.parametrize("backend", ["zstd", "x265", "ffv1"])
def test_decompression_bombs_stop_at_the_declared_size(worker, backend):
    seeds, pool = worker
    i = next(i for i, s in enumerate(seeds) if s.backend == backend and s.name == "t256")
    for bomb in fuzz.BOMBS[backend]:
        head, chunks = fuzz.split(seeds[i].blob)
        blob = fuzz.assemble(head, [[t, bomb if t == b"DATA" else p] for t, p in chunks])
        res = pool.decode(i, blob, timeout=20)
        assert res["outcome"] == "rejected" and res["bitstream"], res
        assert res["peak"] < 64 << 20 and res["seconds"] < 5, res  # the bombs hold 12 MiB .. 1 GiB
        if backend == "x265":  # the ffmpeg subprocess reads the same streams, under the same bounds
            with pytest.raises(BitstreamError, match="frames|ffmpeg decode"):
                TensorCodec(None, backend="raw").decode(
                    edit_header(blob, lambda h: h["codec"].__setitem__("id", "ffmpeg-x265")))


# -- quantizer parameters and the output ------------------------------------------------------------
@pytest.mark.parametrize("step", [math.nan, math.inf, 0.0, -1.0, 1e300, 1e-300])
def test_rd_quantizer_step_must_be_a_positive_finite_float32(step):
    blob = bytearray(RDQuantizer(0.5).to_bytes())
    struct.pack_into("<d", blob, 4, step)
    with pytest.raises(BitstreamError, match="step"):
        RDQuantizer.from_bytes(bytes(blob))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -1.0, 3e38])
def test_per_channel_parameters_must_be_finite_with_positive_steps(value):
    q = PerChannelQuantizer.fit(np.random.default_rng(0).standard_normal((20, 4)).astype(np.float32))
    blob = bytearray(q.to_bytes())
    struct.pack_into("<f", blob, 5 + 4 * 5, value)  # the second step
    with pytest.raises(BitstreamError, match="QPAR"):
        PerChannelQuantizer.from_bytes(bytes(blob))
    with pytest.raises(BitstreamError, match="bits"):
        PerChannelQuantizer.from_bytes(q.to_bytes(), bits=4)


def test_decoded_output_is_finite_and_of_the_declared_dtype(streams):
    # a lo of 3e38 is finite, and so is each step, but reconstruction overflows: refused, not returned as inf
    head, chunks = fuzz.split(streams["zstd"])
    q = bytearray(chunks[0][1])
    struct.pack_into("<f", q, 5, 3.0e38)
    struct.pack_into("<f", q, 5 + 4 * 48, 1e36)
    blob = fuzz.assemble(head, [[chunks[0][0], bytes(q)], chunks[1]])
    with pytest.raises(BitstreamError, match="not finite"):
        TensorCodec(None, backend="raw").decode(blob)
    out = TensorCodec(None, backend="raw").decode(edit_header(streams["zstd"], lambda h: h.__setitem__("dtype",
                                                                                                       "float16")))
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


def test_every_structured_mutation_reaches_past_the_crcs(streams):
    """The fuzz's mutations recompute CRC32s and the rANS checksum: none is refused for a CRC
    (but a chunk length field that was changed)."""
    rng = random.Random(0)
    for backend in ("zstd", "rans"):
        fns = [f for f, _ in fuzz.STRUCTURED] + ([fuzz.mut_rans_field] if backend == "rans" else [])
        for fn in fns:
            for _ in range(15):
                blob = fn(rng, *fuzz.split(streams[backend]))
                try:
                    decoder(streams, backend).decode(blob)
                except TensorCodecError as e:  # (a chunk's length field, changed, frames another span)
                    if fn is not fuzz.mut_chunks:
                        assert "CRC32" not in str(e) and "checksum" not in str(e), (fn.__name__, str(e))


# -- the encoder's refusals --------------------------------------------------------------------------
def test_encoder_refuses_non_tensors_naming_the_accepted_types():
    for bad in ([[1.0, 2.0]], (1.0,), "x", None, 3.0):
        with pytest.raises(InvalidTensorError, match="torch.Tensor or numpy.ndarray"):
            TensorCodec(None, backend="zstd", frame_size=64).encode(bad)


@pytest.mark.parametrize("backend", ["zstd", "rans"])
def test_encoder_refuses_values_that_overflow_float32(backend):
    x = torch.full((8, 4), 3e38)
    kw = dict(step=0.1) if backend == "rans" else dict(frame_size=64)
    with pytest.raises(InvalidTensorError, match="overflow float32"):
        TensorCodec(None, backend=backend, **kw).encode(x)


def test_frame_path_refuses_an_outlier_it_cannot_represent():
    x = tensor()
    x[5, 3] = 1e30
    basis = fit_basis([tensor(seed=1)], k=16)
    for b in (None, basis):
        with pytest.raises(InvalidTensorError, match="min_cos"):
            TensorCodec(b, backend="zstd", frame_size=64).encode(x)
    codec = TensorCodec(None, backend="zstd", frame_size=64, min_cos=None)  # the caller's choice, then
    assert codec.decode(codec.encode(x)).shape == x.shape


@pytest.mark.parametrize("kw,match", [
    (dict(backend="x265", qp=99), "qp"), (dict(backend="x265", qp=-1), "qp"), (dict(backend="x265", qp="18"), "qp"),
    (dict(backend="x265", preset="fastest"), "preset"), (dict(backend="zstd", level=99), "level"),
    (dict(backend="zstd", level="3"), "level"), (dict(backend="zstd", frame_size=2**16), "frame_size"),
    (dict(backend="zstd", frame_size=100), "frame_size"), (dict(backend="x265", bits=10), "bits"),
    (dict(backend="rans", target_cos=1.5), "target_cos"), (dict(backend="zstd", min_cos=2), "min_cos"),
])
def test_out_of_range_settings_are_configuration_errors(kw, match):
    with pytest.raises(ConfigurationError, match=match):
        TensorCodec(None, **kw).encode(tensor(64, 8))


@pytest.mark.parametrize("name", ["one_token", "constant"])
def test_water_filling_never_drops_every_component(name):
    x = tensor(1, 48) if name == "one_token" else torch.full((50, 48), 0.7)
    basis = fit_basis([tensor(seed=2)], k=48)
    for b in (None, basis):
        codec = TensorCodec(b, backend="rans", target_cos=0.999)
        y = codec.decode(codec.encode(x))
        assert quality(x.double().numpy(), y.double().numpy(), "cos") >= 0.999
    q = find_step(x.numpy(), 0.999, water_fill=True)
    assert q.keep is not None and q.keep.any()


def test_valid_streams_still_decode(streams):
    for backend in ("zstd", "raw", "x265", "ffv1", "rans"):
        out = decoder(streams, backend).decode(streams[backend])
        assert out.shape == streams["x"].shape and torch.isfinite(out).all()
        assert read_header(streams[backend], max_elements=schema.DEFAULT_MAX_ELEMENTS)["shape"] == [256, 48]

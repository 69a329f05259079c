"""nvCOMP backends: bit-exact round trips, several algorithms in one process, clear errors.

CPU tests run everywhere (no nvCOMP import at module import, the probe's reasons, the host-side
payload checks). Tests marked gpu run on the GPU machine and skip cleanly elsewhere.
"""
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import shared.codecs.nvcomp as nvc
from shared.codecs import get_backend
from shared.errors import BackendUnavailable, BitstreamError, InvalidTensorError

ROOT = Path(__file__).resolve().parent.parent
NAMES = [f"nvcomp-{key}" for key in nvc.ALGORITHMS]


def nvcomp_ready() -> bool:
    nvc._probe.cache_clear()
    return nvc._probe() is None


def pca_like_frames(n_frames=4, size=256, seed=0):
    """Smooth along tokens, heavier-tailed in later components: compressible, not trivial."""
    rng = np.random.default_rng(seed)
    rows = n_frames * 3 * size
    walk = np.cumsum(rng.standard_t(4, size=(rows, size)), axis=0) * 0.05
    noise = rng.standard_t(3, size=(rows, size)) * np.linspace(2, 12, size)
    planes = np.clip(128 + walk + noise, 0, 255).astype(np.uint8)
    return planes.reshape(n_frames, 3, size, size)


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------
def test_import_touches_neither_nvcomp_nor_cuda():
    code = ("import sys; import shared.codecs.nvcomp; from shared.codecs import all_backends; all_backends(); "
            "t = sys.modules.get('torch'); "
            "print('nvidia.nvcomp' in sys.modules, bool(t and t.cuda.is_initialized()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_backends_registered():
    for name in NAMES:
        b = get_backend(name)
        assert (b.kind, b.device, b.lossless) == ("bytes", "cuda", True)


def test_probe_names_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.nvcomp", None)  # makes the import fail
    nvc._probe.cache_clear()
    try:
        reason = nvc._probe()
    finally:
        nvc._probe.cache_clear()
    assert reason is not None and "pip install nvidia-nvcomp-cu13" in reason


@pytest.mark.skipif(nvcomp_ready(), reason="nvCOMP and a GPU are present here")
def test_unavailable_backend_raises_clear_error():
    with pytest.raises(BackendUnavailable, match="nvcomp-ans"):
        get_backend("nvcomp-ans").encoder(256, 256)
    with pytest.raises(BackendUnavailable, match="nvCOMP"):
        nvc.GpuCoder("ans").encode_cuda(np.zeros(16, np.uint8))
    assert nvc._probe()  # a sentence, not None


def test_unknown_algorithm_and_bad_chunk():
    with pytest.raises(InvalidTensorError, match="known: ans"):
        nvc.GpuCoder("brotli")
    with pytest.raises(InvalidTensorError, match="chunk_size"):
        nvc.GpuCoder("ans", chunk_size=1000 + 1)


def _decoder(key="ans", size=256):
    return nvc.BACKENDS[key].decoder_cls(size, size)  # the class itself: no GPU needed for header checks


def _payload(key="ans", n_raw=3 * 256 * 256, body=b"\0" * 40, n_body=None):
    n_body = len(body) if n_body is None else n_body
    return nvc.HEADER.pack(nvc.MAGIC, nvc.VERSION, nvc.ALGO_INDEX[key], 0, n_raw, n_body) + body


@pytest.mark.parametrize("payload, message", [
    (b"NVCP\x01", "shorter than"),
    (b"XXXX" + _payload()[4:], "magic"),
    (_payload(key="zstd"), "made by nvcomp-zstd"),
    (_payload(n_body=41), "truncated"),
    (_payload(n_raw=1000), "whole number"),
    (struct.pack("<4sBBHQQ", b"NVCP", 9, 0, 0, 196608, 0), "version 9"),
])
def test_session_payload_checked_on_host(payload, message):
    dec = _decoder()
    dec.submit(payload)
    with pytest.raises(BitstreamError, match=message):
        dec.flush()


def test_component_major_round_trip_numpy():
    planes = np.arange(6 * 4, dtype=np.uint8).reshape(6, 4)
    km = nvc.component_major(planes)
    assert km.shape == (4, 6) and km.flags.c_contiguous
    assert np.array_equal(nvc.token_major(km), planes)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("name", NAMES)
def test_session_round_trip_bit_exact(name):
    if not nvcomp_ready():
        pytest.skip(nvc._probe())
    frames = pca_like_frames()
    backend = get_backend(name)
    with backend.encoder(256, 256) as enc:
        enc.submit(frames[:2])
        enc.submit(frames[2:])
        payload = enc.flush()
    with backend.decoder(256, 256) as dec:
        dec.submit(payload)
        back = dec.flush()
    assert back.shape == frames.shape and np.array_equal(back, frames)
    if name in ("nvcomp-ans", "nvcomp-zstd", "nvcomp-gdeflate"):
        assert len(payload) < frames.nbytes


@gpu
@pytest.mark.parametrize("key", list(nvc.ALGORITHMS))
def test_fast_path_round_trip_bit_exact(key):
    if not nvcomp_ready():
        pytest.skip(nvc._probe())
    import torch

    planes = torch.from_numpy(pca_like_frames(seed=1).reshape(-1, 256)).cuda()
    coder = nvc.GpuCoder(key)
    payload = coder.encode_cuda(planes)
    assert payload.is_cuda and payload.dtype == torch.uint8 and payload.dim() == 1
    assert coder.decoded_bytes(payload) == planes.numel()
    assert torch.equal(coder.decode_cuda(payload), planes.reshape(-1))
    out = torch.empty(planes.numel(), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a non-default stream: nvCOMP runs on it directly
        payload2 = coder.encode_cuda(planes)
        coder.decode_cuda(payload2, out=out)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, planes.reshape(-1))
    # bf16 tensors are coded as their bytes
    raw = torch.randn(1000, 64, device="cuda").to(torch.bfloat16)
    back = coder.decode_cuda(coder.encode_cuda(raw)).view(torch.bfloat16).reshape(raw.shape)
    assert torch.equal(back, raw)


SEVERAL_IN_ONE_PROCESS = textwrap.dedent("""
    import gc, sys, numpy as np, torch
    sys.path.insert(0, sys.argv[1])
    from shared.codecs import get_backend
    from shared.codecs.nvcomp import ALGORITHMS, GpuCoder
    x = (torch.randn(8 << 20, device="cuda") * 10 + 128).clamp(0, 255).to(torch.uint8)
    frames = x[: 4 * 3 * 256 * 256].cpu().numpy().reshape(4, 3, 256, 256)
    for rep in range(2):
        for key in ALGORITHMS:
            coder = GpuCoder(key)
            assert torch.equal(coder.decode_cuda(coder.encode_cuda(x)), x), key
            b = get_backend("nvcomp-" + key)
            with b.encoder(256, 256) as enc:
                enc.submit(frames); payload = enc.flush()
            with b.decoder(256, 256) as dec:
                dec.submit(payload); assert np.array_equal(dec.flush(), frames), key
            del coder, enc, dec, payload
            gc.collect()
    torch.cuda.synchronize()
    print("done")
""")


@gpu
def test_several_algorithms_one_after_another_in_one_process():
    """Regression test for the 'free(): double free' abort seen in an early probe.

    Runs in its own process so that an abort fails this test instead of killing pytest, and
    includes the process exit (a Python allocator installed into nvCOMP crashed exactly there).
    """
    if not nvcomp_ready():
        pytest.skip(nvc._probe())
    out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SEVERAL_IN_ONE_PROCESS, str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    assert out.stdout.strip().endswith("done")
    assert "double free" not in out.stderr


@gpu
def test_bad_payload_raises_clear_error():
    if not nvcomp_ready():
        pytest.skip(nvc._probe())
    import torch

    frames = pca_like_frames(n_frames=2)
    backend = get_backend("nvcomp-ans")
    with backend.encoder(256, 256) as enc:
        enc.submit(frames)
        payload = enc.flush()
    with backend.decoder(256, 256) as dec:
        dec.submit(payload[:-100])
        with pytest.raises(BitstreamError, match="truncated"):
            dec.flush()
    with get_backend("nvcomp-zstd").decoder(256, 256) as dec:
        dec.submit(payload)
        with pytest.raises(BitstreamError, match="made by nvcomp-ans"):
            dec.flush()
    coder = nvc.GpuCoder("ans")
    garbage = torch.randint(0, 256, (1 << 14,), dtype=torch.uint8, device="cuda")
    with pytest.raises(BitstreamError, match="nvCOMP ANS"):
        coder.decode_cuda(garbage)
    with pytest.raises(InvalidTensorError, match="CUDA tensor"):
        coder.decode_cuda(garbage.cpu())
    assert torch.ones(4, device="cuda").sum().item() == 4.0  # the CUDA context survived

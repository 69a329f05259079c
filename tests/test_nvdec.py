"""The NVDEC/NVENC backend "nvdec-hevc": clear unavailability on CPU machines, bit-exact decode on a GPU.

CPU tests run everywhere. Tests marked gpu need a CUDA GPU with PyNvVideoCodec and skip cleanly
without them (PyNvVideoCodec and PyAV travel to the GPU machine as wheels).
"""
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shared import BackendUnavailable, BitstreamError, CodecError, InvalidTensorError
from shared.codecs import availability, get_backend
from shared.codecs import nvdec

ROOT = Path(__file__).resolve().parent.parent


def nvdec_reason():
    return nvdec.probe()


requires_nvdec = pytest.mark.skipif(nvdec_reason() is not None, reason=f"NVDEC unavailable: {nvdec_reason()}")
# the streams these tests decode are made by x265 in process (PyAV), which a GPU machine may lack
X265_REASON = get_backend("x265").probe()
requires_x265 = pytest.mark.skipif(X265_REASON is not None, reason=f"x265 unavailable to make test streams: {X265_REASON}")


def smooth_frames(n, size, seed):
    """PCA-plane-like content: smooth along rows and columns plus noise, as quantized coefficients look."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = 128 + 60 * np.sin(6 * y + 3 * x + seed)
    noise = rng.normal(0, 6, size=(n, 3, size, size))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def x265_lossless(frames):
    with get_backend("x265").encoder(frames.shape[3], frames.shape[2], qp=None, preset="ultrafast") as enc:
        enc.submit(frames)
        return enc.flush()


# -- CPU: import, probe, errors ---------------------------------------------------------------------------
def test_import_loads_neither_pynvvideocodec_nor_cuda():
    code = ("import sys; import shared.codecs.nvdec, shared.codecs; shared.codecs.availability; "
            "assert 'PyNvVideoCodec' not in sys.modules, 'PyNvVideoCodec imported at module import'; "
            "t = sys.modules.get('torch'); assert t is None or not t.cuda.is_initialized(), 'CUDA touched'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_probe_without_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "PyNvVideoCodec" else real(name, *a))
    assert nvdec.probe() == "PyNvVideoCodec not installed: pip install PyNvVideoCodec"


def test_probe_without_a_gpu(monkeypatch):
    import torch

    if importlib.util.find_spec("PyNvVideoCodec") is None:
        pytest.skip("PyNvVideoCodec not installed here; the no-package reason is tested above")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert nvdec.probe().startswith("no CUDA GPU")


def test_asking_for_the_backend_without_a_gpu_raises_the_reason(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend = get_backend("nvdec-hevc")
    reason = backend.unavailable_reason()
    assert reason and availability()["nvdec-hevc"] == reason
    with pytest.raises(BackendUnavailable, match="nvdec-hevc") as err:
        backend.decoder(256, 256)
    assert reason in str(err.value)
    with pytest.raises(BackendUnavailable, match=reason.split(":")[0]):
        backend.encoder(256, 256)
    with pytest.raises(BackendUnavailable):
        nvdec.MultiDecoder(256, 256)


def test_backend_registration():
    backend = get_backend("nvdec-hevc")
    assert (backend.kind, backend.device, backend.lossless) == ("frames", "cuda", None)
    assert backend.is_lossless({"qp": None}) and not backend.is_lossless({"qp": 18})


def test_status_codes_are_parsed_for_messages():
    msg = ("ReconfigureDecoder : \nError code : 801\nError Type : Reconfigure Not supported when width/height > "
           "maxwidth/maxheight\nat NvDecoder.cpp:476")
    assert nvdec.nvc_status(RuntimeError(msg)) == (801, "Reconfigure Not supported when width/height > maxwidth/maxheight")
    err = nvdec._codec_error("Decode", RuntimeError(msg), "open a larger session")
    assert isinstance(err, CodecError) and "Decode failed (status 801" in str(err) and "open a larger session" in str(err)


# -- GPU --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@requires_nvdec
def test_caps_report_engines_and_444():
    caps = nvdec.decoder_caps("HEVC", "444", 8)
    assert caps["supported"] == 1 and nvdec.engine_count() >= 1
    assert caps["width_max"] >= 2048 and caps["height_max"] >= 2048


@pytest.mark.gpu
@requires_nvdec
@requires_x265
def test_x265_lossless_streams_decode_bit_exact_from_memory_in_one_persistent_session():
    import torch

    first, second = smooth_frames(6, 256, 0), smooth_frames(4, 256, 1)
    with get_backend("nvdec-hevc").decoder(256, 256) as dec:
        for frames in (first, second, first):  # the same session across streams
            dec.submit(x265_lossless(frames))
            out = dec.flush_cuda()
            assert out.is_cuda and out.dtype == torch.uint8 and tuple(out.shape) == frames.shape
            assert np.array_equal(out.cpu().numpy(), frames)
        dec.submit(x265_lossless(second))
        assert np.array_equal(dec.flush(), second)  # the common numpy interface


@pytest.mark.gpu
@requires_nvdec
@requires_x265
def test_flush_cuda_fills_a_preallocated_tensor():
    import torch

    frames = smooth_frames(5, 256, 2)
    out = torch.empty(frames.shape, dtype=torch.uint8, device="cuda")
    with get_backend("nvdec-hevc").decoder(256, 256) as dec:
        dec.submit(x265_lossless(frames))
        assert dec.flush_cuda(out=out) is out
    assert np.array_equal(out.cpu().numpy(), frames)


@pytest.mark.gpu
@requires_nvdec
@requires_x265
def test_bad_streams_give_clear_errors_and_the_session_recovers():
    good = smooth_frames(3, 256, 3)
    with get_backend("nvdec-hevc").decoder(256, 256) as dec:
        # A larger stream: NVDEC either refuses it (status 801) or, as the first stream of a session,
        # decodes it at its own size; both end in a BitstreamError naming the frame size.
        dec.submit(x265_lossless(smooth_frames(2, 320, 4)))
        with pytest.raises(BitstreamError, match="frame size"):
            dec.flush_cuda()
        dec.submit(x265_lossless(good))
        assert np.array_equal(dec.flush(), good)
        with pytest.raises(BitstreamError, match="empty payload"):
            dec.submit(b"")


@pytest.mark.gpu
@requires_nvdec
def test_frame_size_outside_nvdec_range_is_refused():
    with pytest.raises(InvalidTensorError, match="outside what NVDEC"):
        get_backend("nvdec-hevc").decoder(128, 128)


@pytest.mark.gpu
@requires_nvdec
@requires_x265
def test_multi_decoder_returns_every_stream_exact_and_in_order():
    inputs = [smooth_frames(3 + i % 2, 256, 10 + i) for i in range(7)]
    payloads = [x265_lossless(f) for f in inputs]
    with nvdec.MultiDecoder(256, 256, sessions=3) as multi:
        for _ in range(2):  # sessions are reused between calls
            outs = multi.decode(payloads)
            assert len(outs) == len(inputs)
            for frames, out in zip(inputs, outs):
                assert np.array_equal(out.cpu().numpy(), frames)


@pytest.mark.gpu
@requires_nvdec
def test_nvenc_absent_on_h200_is_a_clear_error():
    name = nvdec.gpu_name()
    if "H200" not in name:
        pytest.skip(f"{name} is not the NVENC-less NVIDIA H200 this test documents")
    with pytest.raises(BackendUnavailable, match="NVIDIA H200 has no NVENC engine") as err:
        get_backend("nvdec-hevc").encoder(256, 256, qp=None)
    assert "encode with backend 'x265' and decode with 'nvdec-hevc'" in str(err.value)


NVCOMP_READY = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.nvcomp") is not None


@pytest.mark.gpu
@requires_nvdec
@pytest.mark.skipif(not NVCOMP_READY, reason="nvCOMP (nvidia-nvcomp-cu13) is not installed")
def test_nvcomp_still_works_after_nvdec_in_the_same_process():
    """nvCOMP on a torch stream keeps working after an NVDEC session in the same process (passes on the H200;
    PoC 09 still saw "invalid resource handle" from nvCOMP after its NVDEC rows, a case this does not reproduce)."""
    import torch

    from shared.codecs.nvcomp import gpu_coder

    stream = (Path(__file__).parent / "data" / "x265_qp30_256x256_2frames.hevc").read_bytes()
    with get_backend("nvdec-hevc").decoder(256, 256) as dec:
        dec.submit(stream)
        frames = dec.flush_cuda()
    assert tuple(frames.shape) == (2, 3, 256, 256)
    coder = gpu_coder("nvcomp-ans")
    torch_stream = torch.cuda.Stream()
    with torch.cuda.stream(torch_stream):
        flat = frames.reshape(-1).contiguous()
        payload = coder.encode_cuda(flat)
        out = torch.empty_like(flat)
        coder.decode_cuda(payload, out=out)
    torch_stream.synchronize()
    assert torch.equal(out, flat)

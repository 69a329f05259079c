"""A tensor stream over a shaped link: both lanes arrive, raw bit-exact, coded at its quality, fewer bytes."""
import pytest
import torch

from shared.basis import fit_basis
from shared.links import ShapedLink, link_unavailable_reason
from shared.pipeline import TensorCodec
from shared.transfer import check_summary, load_stream, run_stream, tokens_for, write_stream

WHY = link_unavailable_reason()


def low_rank_stream(n=4, tokens=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(24, 192, generator=g)
    xs = [(torch.randn(tokens, 24, generator=g) @ mix).to(torch.bfloat16) for _ in range(n)]
    basis = fit_basis([xs[0].float().numpy()], k=192)
    return xs, TensorCodec(basis, backend="zstd", level=3)


def test_write_stream_refuses_a_codec_list_of_another_length(tmp_path):
    xs, codec = low_rank_stream(n=2)
    with pytest.raises(ValueError, match="one codec"):
        write_stream(tmp_path, xs, [codec])


def test_stream_files_round_trip(tmp_path):
    from shared.rdquant import calibrate_step

    xs, codec = low_rank_stream(n=3)
    rans = TensorCodec(calibrate_step(codec.basis, [xs[0].float().numpy()], 0.999), backend="rans", lane_tokens=256)
    back, codecs = load_stream(write_stream(tmp_path, xs, [None, codec, rans]))
    assert all(torch.equal(a, b) for a, b in zip(xs, back))
    assert not list(tmp_path.glob("*.pkl"))  # settings and basis files: nothing is unpickled from a peer
    assert codecs[0] is None and codecs[1].backend.name == "zstd" and codecs[1].codec_settings == {"level": 3}
    assert codecs[2].symbols and codecs[2].quantizer.step == rans.quantizer.step and codecs[2].lane_tokens == 256
    assert codecs[1].basis.content_hash == codec.basis.content_hash
    for original, rebuilt in zip((codec, rans), codecs[1:]):  # the rebuilt codec writes the same bitstream
        assert bytes(rebuilt.encode(xs[1])) == bytes(original.encode(xs[1]))


def test_tokens_for_a_size():
    assert tokens_for(2) * 384 == pytest.approx(2 * 2**20, abs=384)


@pytest.mark.skipif(WHY is not None, reason=f"no shaped links here: {WHY}")
def test_two_lanes_cross_a_shaped_link_checked(tmp_path):
    xs, codec = low_rank_stream()
    spec = write_stream(tmp_path, xs, [None, codec, None, codec])
    with ShapedLink(rate_mbit=200) as link:
        r = run_stream(link, spec, timeout=60)
    summ = check_summary(r["checks"])
    assert summ["raw_bit_exact"] is True and summ["shapes_ok"] and summ["cos_min"] > 0.999
    raw_bytes = 2 * xs[0].numel() * 2
    assert r["bytes"]["raw"] == raw_bytes + 2 * (12 + 2 + 2 * 8)       # tensor bytes + its header and shape
    assert r["bytes"]["coded"] < raw_bytes                              # low-rank tensors compress
    wire_s = r["bytes_on_wire"] * 8 / (200e6 * 0.95)
    assert wire_s * 0.8 < r["seconds"] < 60


def test_a_raw_message_describes_itself_and_a_wrong_length_is_refused():
    import socket

    from shared.links import LinkError
    from shared.transfer import raw_header, read_raw

    x = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    head, body = raw_header(x), x.numpy().tobytes()
    for message, length, error in ((head + body, len(head) + len(body), None),
                                   (head + body[:-2], len(head) + len(body) - 2, "truncated or corrupt"),
                                   (bytes([200, 2]), 100, "not this stream's")):
        a, b = socket.socketpair()
        with a, b:
            a.sendall(message)
            if error is None:
                y = read_raw(b, length)
                assert torch.equal(x, y) and y.dtype == torch.int16
            else:
                with pytest.raises(LinkError, match=error):
                    read_raw(b, length)

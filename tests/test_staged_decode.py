"""pipeline.StagedDecode: containers at fixed offsets of a GPU buffer decode, as a replayed CUDA graph,
to exactly what decode_many gives; a payload changed after the host's check is flagged (and named) by
the replay; a bad head, layout or output is refused when the plan is made."""
import numpy as np
import pytest
import torch

from shared.basis import fit_basis
from shared.errors import BitstreamError, ConfigurationError, InvalidTensorError
from shared.pipeline import StagedDecode, decode_many, encode_many
from shared.codecs import rans_cuda

D = 96


def make_codec(seed: int):
    from shared.pipeline import TensorCodec

    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((512, 24)) @ rng.standard_normal((24, D))).astype(np.float32)
    return TensorCodec(fit_basis([rows], D), backend="rans", step=0.05), rows


def test_refuses_a_host_buffer():
    codec, rows = make_codec(0)
    blob = codec.encode(torch.from_numpy(rows).to(torch.bfloat16))
    with pytest.raises(InvalidTensorError, match="1-D uint8 CUDA tensor"):
        StagedDecode([codec], [blob[:8192]], [len(blob)], [0], torch.zeros(len(blob) + 16, dtype=torch.uint8),
                     [torch.zeros(512, D, dtype=torch.bfloat16)])
    with pytest.raises(ConfigurationError, match="one head, length, offset and output per codec"):
        StagedDecode([codec, codec], [blob[:8192]], [len(blob)], [0], torch.zeros(16, dtype=torch.uint8), [])


def staged(seed=0, lengths=(300, 300, 64, 64)):
    """Containers of two shapes packed at 16-byte aligned offsets of one GPU buffer, their outputs,
    and decode_many's tensors for the same containers."""
    codecs, tensors = [], []
    for i, T in enumerate(lengths):
        codec, rows = make_codec(seed + i)
        codecs.append(codec)
        reps = -(-T // rows.shape[0])
        tensors.append(torch.from_numpy(np.tile(rows, (reps, 1))[:T]).to("cuda", torch.bfloat16))
    blobs = [b.clone() for b in encode_many(codecs, tensors)]
    offsets, cursor = [], 0
    for b in blobs:
        offsets.append(cursor)
        cursor += -(-b.numel() // 16) * 16 + 16
    buffer = torch.zeros(cursor, dtype=torch.uint8, device="cuda")
    for b, a in zip(blobs, offsets):
        buffer[a:a + b.numel()] = b
    heads = [bytes(b[:8192].cpu().numpy()) for b in blobs]
    outs = [torch.zeros_like(t) for t in tensors]
    reference = [t.clone() for t in decode_many(codecs, blobs, device="cuda")]
    return codecs, heads, [b.numel() for b in blobs], offsets, buffer, outs, reference


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [True, False])
def test_replay_equals_decode_many_bit_for_bit(graph):
    codecs, heads, totals, offsets, buffer, outs, reference = staged()
    plan = StagedDecode(codecs, heads, totals, offsets, buffer, outs, graph=graph)
    assert (plan.graph is not None) == graph
    assert len(plan.groups) == 2  # two shapes: two sets of launches
    for _ in range(3):  # each replay rewrites the outputs
        for out in outs:
            out.zero_()
        plan.replay()
        torch.cuda.synchronize()
        plan.check()
        assert all(torch.equal(out, ref) for out, ref in zip(outs, reference))


@pytest.mark.gpu
def test_plans_share_scratch_and_pool():
    first = staged(0)
    second = staged(10, lengths=(128, 128))
    scratch = torch.empty(StagedDecode.scratch_bytes([(2, 300, 104), (2, 64, 104), (2, 128, 104)]),
                          dtype=torch.uint8, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    plans = [StagedDecode(*case[:6], scratch=scratch, pool=pool) for case in (first, second)]
    for _ in range(2):
        for plan in plans:
            plan.replay()
    torch.cuda.synchronize()
    for plan, case in zip(plans, (first, second)):
        plan.check()
        assert all(torch.equal(out, ref) for out, ref in zip(case[5], case[6]))


@pytest.mark.gpu
def test_a_payload_changed_after_the_check_is_flagged_and_named():
    codecs, heads, totals, offsets, buffer, outs, reference = staged()
    plan = StagedDecode(codecs, heads, totals, offsets, buffer, outs)
    spot = offsets[2] + totals[2] // 2 + 40  # inside container 2's payload
    buffer[spot] ^= 0x5A
    plan.replay()
    torch.cuda.synchronize()
    assert plan.corrupt() == 2
    with pytest.raises(BitstreamError, match="container 2 of the list"):
        plan.check()
    buffer[spot] ^= 0x5A
    plan.replay()
    torch.cuda.synchronize()
    assert plan.corrupt() is None
    assert torch.equal(outs[2], reference[2])


@pytest.mark.gpu
def test_bad_heads_layouts_and_outputs_are_refused_when_made():
    codecs, heads, totals, offsets, buffer, outs, _ = staged()
    bad = bytearray(heads[1])
    bad[20] ^= 0xFF  # inside the header JSON: its CRC fails
    with pytest.raises(BitstreamError):
        StagedDecode(codecs, [heads[0], bytes(bad)] + heads[2:], totals, offsets, buffer, outs)
    with pytest.raises(ConfigurationError, match="16-byte aligned"):
        StagedDecode(codecs, heads, totals, [offsets[0] + 8] + offsets[1:], buffer, outs)
    with pytest.raises(InvalidTensorError, match="output 3"):
        StagedDecode(codecs, heads, totals, offsets, buffer, outs[:3] + [outs[3].float()])
    other, _ = make_codec(99)
    with pytest.raises(Exception, match="basis"):
        StagedDecode([other] + codecs[1:], heads, totals, offsets, buffer, outs)
    assert rans_cuda.CORRUPT  # the message a replay's flags raise with

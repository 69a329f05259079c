"""A CI-sized run of the decoder fuzz (shared/fuzz.py; `make fuzz` runs the long one): mutated
bitstreams of every CPU backend, each decoded in a worker under a time and memory limit."""
import pytest

from shared import fuzz


@pytest.fixture(scope="module")
def summaries():
    # hang limit above the long run's 5 s: this machine may be shared; a real hang runs far longer
    return fuzz.run(fuzz.BACKENDS, cases=60, seed=1234, hang_s=20)


@pytest.mark.parametrize("backend", fuzz.BACKENDS)
def test_no_mutant_crashes_hangs_exhausts_or_returns_garbage(summaries, backend):
    s = summaries[backend]
    assert s.cases == 60
    assert s.failed() == 0, s.failures
    assert s.stale_crc_accepted_changed == 0  # CRC32 catches bit flips and truncations
    assert s.max_memory_ratio < 2, s  # peak memory / (declared output + blob + allowance)


def test_the_mutants_reach_the_decoders(summaries):
    """Most mutants are refused, but some pass every check and decode (payload bytes of a lossy
    codec, a field the decoder does not need): the fuzz reaches the decoders, not just the CRCs."""
    for s in summaries.values():
        assert s.rejected_bitstream > s.cases // 2 and s.accepted > 0, s

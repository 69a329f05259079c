"""Shaped links between network namespaces: they exist, shape the rate, add delay, and leave nothing behind."""
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared.links import (TCP_PAYLOAD_FRACTION, LinkError, ShapedLink, cleanup_stale, delay_unavailable_reason,
                          link_unavailable_reason, netem_unavailable_reason)

ROOT = Path(__file__).resolve().parent.parent
WHY = link_unavailable_reason()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no shaped links here: {WHY}")


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_link_exists_with_its_addresses_and_shape():
    with ShapedLink(rate_mbit=100) as link:
        assert {link.ns_a, link.ns_b} <= namespaces()
        addr = link.run("a", ["ip", "-4", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
        assert f"{link.ip_a}/30" in addr and link.ip_b not in addr
        assert "tbf" in link.qdiscs("a") and "100Mbit" in link.qdiscs("b")
        # b answers a; nothing else is routed from inside the namespace
        assert link.run("a", ["ip", "route", "get", link.ip_b], capture_output=True, timeout=10).returncode == 0
        assert link.run("a", ["ip", "route", "get", "8.8.8.8"], capture_output=True, timeout=10).returncode != 0


def test_tcp_rate_matches_the_shape_at_100_mbit():
    with ShapedLink(rate_mbit=100) as link:
        m = link.measure(nbytes=4 << 20, timeout=30)
    expect = 100 * TCP_PAYLOAD_FRACTION
    assert abs(m["mbit"] / expect - 1) < 0.10, f"{m['mbit']:.1f} Mbit/s of payload on a 100 Mbit tbf"


def test_tcp_rate_at_1_gbit_reaches_the_shape_and_not_beyond():
    # the burst must let 1 Gbit through (a 16 KB burst gives ~10% less); the best of two transfers, since
    # at 1 Gbit TCP over veth needs CPU time that a loaded 2-core machine does not always give
    with ShapedLink(rate_mbit=1000) as link:
        best = max(link.measure(nbytes=24 << 20, timeout=30, port=5201 + i)["mbit"] for i in range(2))
    expect = 1000 * TCP_PAYLOAD_FRACTION
    assert 0.85 < best / expect < 1.10, f"{best:.1f} Mbit/s of payload on a 1000 Mbit tbf"


def test_reshape_changes_the_rate_in_place():
    with ShapedLink(rate_mbit=100) as link:
        fast = link.measure(nbytes=2 << 20, timeout=30)["mbit"]
        link.reshape(rate_mbit=25)
        assert "25Mbit" in link.qdiscs("a")
        slow = link.measure(nbytes=1 << 20, timeout=30, port=5202)["mbit"]
    assert 3.3 < fast / slow < 4.7, (fast, slow)


@pytest.mark.skipif(delay_unavailable_reason() is not None, reason=f"{delay_unavailable_reason()}")
def test_delay_shows_in_the_round_trip_and_its_namespaces_go():
    with ShapedLink(rate_mbit=100, delay_ms=10) as link:
        rtt = link.measure(nbytes=1 << 20, timeout=30)["rtt_ms"]
        link.reshape(rate_mbit=100, delay_ms=0)
        rtt0 = link.measure(nbytes=1 << 20, timeout=30, port=5202)["rtt_ms"]
        # best of three: a user-space delay line on a loaded machine is sometimes descheduled
        rate = max(link.measure(nbytes=2 << 20, timeout=30, port=5203 + i)["mbit"] for i in range(3))
        relayed = link.delay_by == "delay_line"
        names = {link.ns_a, link.ns_b, link.ns_m} if relayed else {link.ns_a, link.ns_b}
        assert names <= namespaces()
    assert 19.5 < rtt < 30 and rtt0 < 8, (rtt, rtt0)
    # the tbf caps the rate (+10%); below it, a relay in user space on a 2-core CI machine running the
    # test suite once moved 79.7 of 95.6 Mbit/s (best of two), so its floor is looser than netem's
    floor = 0.75 if relayed else 0.90
    assert floor < rate / (100 * TCP_PAYLOAD_FRACTION) < 1.10, rate
    assert not names & namespaces()


def test_without_netem_loss_and_late_delay_are_refused_with_the_reason():
    if netem_unavailable_reason() is None:
        pytest.skip("this kernel has netem: loss and delay work on any link")
    with pytest.raises(LinkError, match="netem"):
        with ShapedLink(rate_mbit=100, loss_pct=1):
            pass
    with ShapedLink(rate_mbit=100) as link:       # made without delay: no delay line to change
        with pytest.raises(LinkError, match="delay_ms > 0"):
            link.reshape(rate_mbit=100, delay_ms=10)


def test_namespaces_and_processes_are_gone_after_an_exception():
    with pytest.raises(RuntimeError, match="body failed"):
        with ShapedLink(rate_mbit=50) as link:
            names = {link.ns_a, link.ns_b}
            p = link.popen("b", ["sleep", "60"])
            assert names <= namespaces()
            raise RuntimeError("body failed")
    assert p.poll() is not None
    assert not names & namespaces()


def test_sigterm_deletes_the_namespaces():
    code = ("import sys, time; sys.path.insert(0, %r); from shared.links import ShapedLink\n"
            "link = ShapedLink(rate_mbit=10).open(); print(link.ns_a, link.ns_b, flush=True); time.sleep(60)"
            % str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    names = set(p.stdout.readline().split())
    assert len(names) == 2 and names <= namespaces()
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=20)
    assert not names & namespaces()


def test_stale_namespaces_of_dead_processes_are_cleaned_and_live_ones_kept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"tcodec-{dead.pid}-0-a"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with ShapedLink(rate_mbit=10) as link:           # opening a link runs the cleanup
            assert stale not in namespaces()
            assert cleanup_stale() == [] and {link.ns_a, link.ns_b} <= namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="rate_mbit"):
        ShapedLink(rate_mbit=0)
    with pytest.raises(ValueError, match="loss_pct"):
        ShapedLink(rate_mbit=10, loss_pct=100)
    with ShapedLink(rate_mbit=10) as link:
        with pytest.raises(ValueError, match="side"):
            link.run("c", ["true"])
    with pytest.raises(LinkError, match="closed"):
        link.run("a", ["true"])

"""Real, shaped network links on one machine: two network namespaces joined by a veth pair, with
`tc` shaping (tbf for the rate, netem under it for delay and loss) on both ends' egress.

    from shared.links import ShapedLink, link_unavailable_reason
    if (why := link_unavailable_reason()) is None:
        with ShapedLink(rate_mbit=100, delay_ms=10) as link:
            rx = link.popen("b", [sys.executable, "-m", "my.receiver", link.ip_b])
            link.run("a", [sys.executable, "-m", "my.sender", link.ip_b], timeout=60)
            link.reshape(rate_mbit=50, delay_ms=0)     # tc qdisc replace, in place

Traffic stays inside the two namespaces: the only addresses are a private /30 configured on the veth
ends there, and nothing is routed anywhere else. On leaving the `with` block (also on an exception,
SIGTERM or interpreter exit) the processes started through the link are killed and both namespaces
deleted. Namespace names carry this module's prefix and the creating process's pid, so
`cleanup_stale()` (run on every new link) deletes only namespaces left by processes that are gone.

Shaping: `rate_mbit` counts what tbf counts, Ethernet frames (IP + TCP headers + 14 bytes), so a TCP
stream's payload rate is at most `rate_mbit * TCP_PAYLOAD_FRACTION`. `delay_ms` is added on each
direction, so the round-trip time grows by 2 * delay_ms. `loss_pct` drops that share of packets on
each direction. Delay and loss come from the kernel's netem qdisc under tbf. On a kernel without
sch_netem, a link created with delay_ms > 0 gets a third namespace in the middle instead, where a
user-space delay line (`delay_line`, AF_PACKET sockets that keep the kernel's offload metadata, so
64 KB GSO segments pass whole) holds every frame for delay_ms before passing it on; `link.delay_by`
says which ("netem" or "delay_line"). Loss still needs netem.

`python -m shared.links` runs a short self-check (payload rate and round trip on a few shapes).
"""
from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from functools import lru_cache

from shared.errors import TensorCodecError

PREFIX = "tcodec"                       # every namespace this module makes is named tcodec-<pid>-<n>-a|b
MTU = 1500                              # bytes, the veth MTU
TCP_PAYLOAD_FRACTION = (MTU - 52) / (MTU + 14)   # TCP payload per Ethernet frame tbf counts (IP 20 + TCP 32 with timestamps)
BURST_S = 0.002                         # s of line rate tbf may send at once (at least BURST_MIN bytes)
BURST_MIN = 64 * 1024                   # bytes: one full GSO segment passes tbf without being split
QUEUE_S = 0.05                          # s of line rate the tbf queue holds before dropping
NETEM_LIMIT = 100_000                   # packets netem may hold (delay * rate must fit)
MAX_LINKS = 4                           # links open at once in one process
_TIMEOUT = 20                           # s for any single ip/tc command

SOL_PACKET, PACKET_VNET_HDR, PACKET_IGNORE_OUTGOING = 263, 15, 23   # <linux/socket.h>, <linux/if_packet.h>
_counter = itertools.count()
_live: list["ShapedLink"] = []
_lock = threading.Lock()
_handlers_installed = False


class LinkError(TensorCodecError, RuntimeError):
    """A namespace, veth or tc command failed; the message names the command and its error."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = list(args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT)
    if check and out.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out


def _netns_list() -> list[str]:
    out = _ip("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete namespaces with this module's prefix whose creating process no longer runs; return their names."""
    gone = []
    for name in _netns_list():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-\d+-[abm]", name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _kill_netns_pids(name)
            _ip("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone


def _kill_netns_pids(name: str) -> None:
    out = _ip("ip", "netns", "pids", name, check=False)
    for tok in out.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError):
            pass


@lru_cache(maxsize=None)
def link_unavailable_reason() -> str | None:
    """None if this machine can make rate-shaped links (root, `ip`, `tc`, netns, veth, tbf), else why not."""
    if sys.platform != "linux":
        return f"shaped links need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "shaped links need root (ip netns / tc); run as root, e.g. in CI or a container with CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed; install iproute2 (apt-get install iproute2)"
    try:
        with ShapedLink(rate_mbit=10, _probe=True):
            pass
    except (LinkError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot build a tbf-shaped veth link here: {e}"
    return None


@lru_cache(maxsize=None)
def netem_unavailable_reason() -> str | None:
    """None if added delay and loss work here (the kernel's sch_netem), else why not."""
    why = link_unavailable_reason()
    if why:
        return why
    try:
        with ShapedLink(rate_mbit=10, _probe=True) as link:
            _ip("tc", "-n", link.ns_a, "qdisc", "replace", "dev", link.dev_a, "parent", "1:1", "handle", "10:",
                "netem", "delay", "1ms")
    except LinkError as e:
        return (f"added delay/loss needs the kernel's netem qdisc (sch_netem), which this kernel lacks "
                f"(tc said: {str(e).rsplit('Error: ', 1)[-1].strip()}); load it (modprobe sch_netem) or run on a kernel that has it")
    return None


def _burst_bytes(rate_mbit: float) -> int:
    return max(BURST_MIN, int(rate_mbit * 1e6 / 8 * BURST_S))


def _close_all(*_a) -> None:
    for link in list(_live):
        link.close()


def _on_sigterm(signum, frame):
    _close_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_handlers() -> None:
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


class ShapedLink:
    """Two namespaces `ns_a`, `ns_b` joined by a veth pair (`ip_a` <-> `ip_b`), shaped on both egresses.

    rate_mbit: tbf rate in Mbit/s of Ethernet frames (None: unshaped veth); delay_ms: one-way delay added
    on each direction (ms); loss_pct: packets dropped on each direction (%).
    """

    def __init__(self, rate_mbit: float | None = 100, delay_ms: float = 0.0, loss_pct: float = 0.0,
                 _probe: bool = False):
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 Mbit/s or None (unshaped), got {rate_mbit}")
        if delay_ms < 0 or not 0 <= loss_pct < 100:
            raise ValueError(f"delay_ms must be >= 0 and loss_pct in [0, 100), got {delay_ms}, {loss_pct}")
        self.rate_mbit, self.delay_ms, self.loss_pct = rate_mbit, float(delay_ms), float(loss_pct)
        self._probe = _probe
        n = next(_counter)
        self.ns_a, self.ns_b = f"{PREFIX}-{os.getpid()}-{n}-a", f"{PREFIX}-{os.getpid()}-{n}-b"
        self.ns_m = f"{PREFIX}-{os.getpid()}-{n}-m"     # only with the user-space delay line
        self.dev_a, self.dev_b = "veth-a", "veth-b"
        self.delay_by = None
        self._line: subprocess.Popen | None = None
        third = n % 250
        self.ip_a, self.ip_b = f"10.254.{third}.1", f"10.254.{third}.2"
        self._procs: list[subprocess.Popen] = []
        self._open = False

    # lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "ShapedLink":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> "ShapedLink":
        with _lock:
            if len(_live) >= MAX_LINKS:
                raise LinkError(f"{MAX_LINKS} shaped links are already open in this process; close one first")
            if not self._probe:
                cleanup_stale()
            _install_handlers()
            _live.append(self)
        self._open = True
        if self.loss_pct > 0 and netem_unavailable_reason():
            self.close()
            raise LinkError(netem_unavailable_reason())
        line = self.delay_ms > 0 and not self._probe and netem_unavailable_reason() is not None
        try:
            for ns in (self.ns_a, self.ns_b) + ((self.ns_m,) if line else ()):
                _ip("ip", "netns", "add", ns)
                _ip("ip", "-n", ns, "link", "set", "lo", "up")
            if line:   # a <-> m <-> b, the delay line in m
                for ns, dev, mdev in ((self.ns_a, self.dev_a, "veth-ma"), (self.ns_b, self.dev_b, "veth-mb")):
                    _ip("ip", "link", "add", dev, "netns", ns, "mtu", str(MTU), "type", "veth",
                        "peer", "name", mdev, "netns", self.ns_m, "mtu", str(MTU))
                    _ip("ip", "-n", self.ns_m, "link", "set", mdev, "up")
                self.delay_by = "delay_line"
            else:
                _ip("ip", "link", "add", self.dev_a, "netns", self.ns_a, "mtu", str(MTU), "type", "veth",
                    "peer", "name", self.dev_b, "netns", self.ns_b, "mtu", str(MTU))
            for ns, dev, addr in ((self.ns_a, self.dev_a, self.ip_a), (self.ns_b, self.dev_b, self.ip_b)):
                _ip("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _ip("ip", "-n", ns, "link", "set", dev, "up")
            self.reshape(self.rate_mbit, self.delay_ms, self.loss_pct)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 3
        for p in self._procs:
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)
        for ns in (self.ns_a, self.ns_b) + ((self.ns_m,) if self.delay_by == "delay_line" else ()):
            _kill_netns_pids(ns)
            _ip("ip", "netns", "del", ns, check=False)
        with _lock:
            if self in _live:
                _live.remove(self)

    # shaping -----------------------------------------------------------------------------------
    def qdisc_commands(self, dev: str, rate_mbit, delay_ms, loss_pct) -> list[list[str]]:
        """The tc commands that set this shape on one device (after any existing root qdisc is replaced)."""
        netem = []
        if delay_ms > 0 or loss_pct > 0:
            netem = ["netem", "limit", str(NETEM_LIMIT)]
            if delay_ms > 0:
                netem += ["delay", f"{delay_ms}ms"]
            if loss_pct > 0:
                netem += ["loss", f"{loss_pct}%"]
        if rate_mbit is None:
            return [["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:"] + netem] if netem else []
        burst = _burst_bytes(rate_mbit)
        limit = max(2 * burst, int(rate_mbit * 1e6 / 8 * QUEUE_S))
        cmds = [["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{rate_mbit}mbit",
                 "burst", str(burst), "limit", str(limit)]]
        if netem:
            cmds.append(["tc", "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:"] + netem)
        return cmds

    def reshape(self, rate_mbit: float | None = None, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Change the shape of both directions in place (rate None: unshaped)."""
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 Mbit/s or None (unshaped), got {rate_mbit}")
        if loss_pct > 0 and netem_unavailable_reason():
            raise LinkError(netem_unavailable_reason())
        if self.delay_by == "delay_line":
            self._start_delay_line(delay_ms)
            delay_tc = 0.0
        elif delay_ms > 0 and netem_unavailable_reason():
            raise LinkError(f"{netem_unavailable_reason()}. Without netem, create the link with delay_ms > 0 "
                            "to get the user-space delay line")
        else:
            delay_tc = delay_ms
            self.delay_by = "netem" if delay_ms > 0 else None
        for ns, dev in ((self.ns_a, self.dev_a), (self.ns_b, self.dev_b)):
            cur = _ip("tc", "-n", ns, "qdisc", "show", "dev", dev, check=False).stdout
            kind_now = cur.split()[1] if cur.split()[:1] == ["qdisc"] else ""
            wanted = self.qdisc_commands(dev, rate_mbit, delay_tc, loss_pct)
            want_kind = wanted[0][wanted[0].index("1:") + 1] if wanted else None
            if kind_now in ("tbf", "netem") and kind_now != want_kind:
                _ip("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            elif kind_now == "tbf" and len(wanted) == 1:   # tbf stays, its netem child goes
                _ip("tc", "-n", ns, "qdisc", "del", "dev", dev, "parent", "1:1", check=False)
            for cmd in wanted:
                _ip(*cmd[:1], "-n", ns, *cmd[1:])
        self.rate_mbit, self.delay_ms, self.loss_pct = rate_mbit, float(delay_ms), float(loss_pct)

    def _start_delay_line(self, delay_ms: float) -> None:
        if self._line is not None and self._line.poll() is None:
            os.killpg(self._line.pid, signal.SIGKILL)
            self._line.wait(timeout=5)
        self._line = subprocess.Popen(["ip", "netns", "exec", self.ns_m, sys.executable, "-m", "shared.links",
                                       "delayline", "veth-ma", "veth-mb", str(delay_ms)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=_child_env(), start_new_session=True)
        self._procs.append(self._line)
        ready = self._line.stdout.readline()             # the sockets are bound once it prints
        if ready.strip() != "ready":
            raise LinkError(f"the delay line did not start: {ready.strip()} {self._line.stderr.read()[-600:]}")

    def qdiscs(self, side: str = "a") -> str:
        """`tc qdisc show` of one end (for logs)."""
        ns, dev = self._side(side)
        return _ip("tc", "-n", ns, "qdisc", "show", "dev", dev).stdout

    @property
    def payload_mbit(self) -> float | None:
        """The most TCP payload per second the shape lets through (None: unshaped)."""
        return None if self.rate_mbit is None else self.rate_mbit * TCP_PAYLOAD_FRACTION

    # processes ---------------------------------------------------------------------------------
    def _side(self, side: str) -> tuple[str, str]:
        if side not in ("a", "b"):
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        if not self._open:
            raise LinkError("the link is closed; use it inside its `with` block")
        return (self.ns_a, self.dev_a) if side == "a" else (self.ns_b, self.dev_b)

    def popen(self, side: str, argv: list[str], **popen_kw) -> subprocess.Popen:
        """Start argv inside namespace `side` ('a' or 'b'); it is killed when the link closes."""
        ns, _ = self._side(side)
        popen_kw.setdefault("start_new_session", True)
        p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **popen_kw)
        self._procs.append(p)
        return p

    def run(self, side: str, argv: list[str], timeout: float = 60, check: bool = False,
            **run_kw) -> subprocess.CompletedProcess:
        """subprocess.run of argv inside namespace `side`, killed after `timeout` seconds."""
        ns, _ = self._side(side)
        run_kw.setdefault("start_new_session", True)
        return subprocess.run(["ip", "netns", "exec", ns, *argv], timeout=timeout, check=check, **run_kw)

    # measurements ------------------------------------------------------------------------------
    def measure(self, nbytes: int = 4 << 20, pings: int = 20, timeout: float = 60, port: int = 5201) -> dict:
        """TCP from a to b: payload rate of one bulk transfer of nbytes (Mbit/s), and the median round trip
        of `pings` 1-byte echoes (ms). Bounded by nbytes and timeout."""
        sink = self.popen("b", [sys.executable, "-m", "shared.links", "sink", self.ip_b, str(port), str(timeout)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env())
        try:
            src = self.run("a", [sys.executable, "-m", "shared.links", "source", self.ip_b, str(port),
                                 str(nbytes), str(pings), str(timeout)],
                           timeout=timeout + 10, capture_output=True, text=True, env=_child_env())
            out, err = sink.communicate(timeout=timeout + 10)
        finally:
            if sink.poll() is None:
                os.killpg(sink.pid, signal.SIGKILL)
        if src.returncode != 0 or sink.returncode != 0:
            raise LinkError(f"link measurement failed: source rc={src.returncode} {src.stderr.strip()[-400:]}; "
                            f"sink rc={sink.returncode} {err.strip()[-400:]}")
        seconds, got = (float(v) for v in out.split())
        rtts = sorted(float(v) for v in src.stdout.split())
        if got != nbytes:
            raise LinkError(f"link measurement: sent {nbytes} bytes, received {got:.0f}")
        return {"mbit": nbytes * 8 / seconds / 1e6, "seconds": seconds, "rtt_ms": rtts[len(rtts) // 2]}


def _child_env() -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# the two ends of `ShapedLink.measure`, run as `python -m shared.links sink|source ...` -------------
def recv_exact(sock: socket.socket, n: int, buf: bytearray | None = None) -> memoryview:
    """Read exactly n bytes (raises ConnectionError on a short stream)."""
    buf = bytearray(n) if buf is None else buf
    view, got = memoryview(buf)[:n], 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return view


def listen(host: str, port: int, timeout: float) -> socket.socket:
    """Accept one TCP connection on host:port within timeout seconds."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(4)
    srv.settimeout(timeout)
    conn, _ = srv.accept()
    srv.close()
    conn.settimeout(timeout)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """Connect to host:port, retrying until the listener is up (at most timeout seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((host, port), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _sink(host: str, port: int, timeout: float) -> None:
    conn = listen(host, port, timeout)
    while True:                                   # echo pings until the bulk phase starts
        c = recv_exact(conn, 1).tobytes()
        if c == b"p":
            conn.sendall(b"p")
            continue
        break                                     # b"b": 8-byte length, then the bulk bytes
    (n,) = struct.unpack("<Q", recv_exact(conn, 8))
    buf, got = bytearray(1 << 20), 0
    t0 = time.perf_counter()
    while got < n:
        k = conn.recv_into(buf, min(len(buf), n - got))
        if k == 0:
            break
        got += k
    dt = time.perf_counter() - t0
    conn.sendall(b"d")
    print(f"{dt} {got}")


def _source(host: str, port: int, nbytes: int, pings: int, timeout: float) -> None:
    s = connect(host, port, timeout)
    rtts = []
    for _ in range(pings + 1):
        t0 = time.perf_counter()
        s.sendall(b"p")
        recv_exact(s, 1)
        rtts.append((time.perf_counter() - t0) * 1e3)
    s.sendall(b"b" + struct.pack("<Q", nbytes))
    chunk = b"\x5a" * (1 << 20)
    sent = 0
    while sent < nbytes:
        k = min(len(chunk), nbytes - sent)
        s.sendall(chunk[:k])
        sent += k
    recv_exact(s, 1)
    print(" ".join(f"{r:.4f}" for r in rtts[1:]))


def delay_line(dev1: str, dev2: str, delay_ms: float) -> None:
    """Forward every frame between dev1 and dev2 after delay_ms (run inside the middle namespace).
    AF_PACKET with PACKET_VNET_HDR: each frame comes with its offload header (GSO size, checksum to
    fill in), and goes out with it, so TCP's 64 KB segments cross whole and checksums stay right."""
    import collections

    delay = delay_ms / 1e3
    try:   # the wire runs at the default priority even when the run that made it is niced
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass
    socks = []
    for dev in (dev1, dev2):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)            # SO_RCVBUFFORCE (root)
        s.bind((dev, 0))
        socks.append(s)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        queue_, cv = collections.deque(), threading.Condition()

        def rx():
            while True:
                frame = src.recv(1 << 17)
                with cv:
                    queue_.append((time.monotonic() + delay, frame))
                    cv.notify()

        def tx():
            while True:
                with cv:
                    while not queue_:
                        cv.wait()
                    due, frame = queue_.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                dst.send(frame)

        for fn in (rx, tx):
            threading.Thread(target=fn, daemon=True).start()

    pump(socks[0], socks[1])
    pump(socks[1], socks[0])
    print("ready", flush=True)
    threading.Event().wait()


@lru_cache(maxsize=None)
def delay_unavailable_reason() -> str | None:
    """None if links with added delay can be made here (netem, or else the user-space delay line)."""
    why = link_unavailable_reason()
    if why or netem_unavailable_reason() is None:
        return why
    try:
        with ShapedLink(rate_mbit=10, delay_ms=1.0) as link:
            if link.delay_by != "delay_line":
                return "no delay mechanism"
    except (LinkError, OSError, subprocess.TimeoutExpired) as e:
        return f"no netem and the user-space delay line failed: {e}"
    return None


def _selfcheck() -> None:
    why = link_unavailable_reason()
    if why:
        print(f"shaped links unavailable: {why}")
        return
    print("added delay:", "netem" if netem_unavailable_reason() is None else
          f"user-space delay line ({netem_unavailable_reason()})")
    for rate, delay in ((1000, 0.0), (1000, 10.0), (100, 0.0), (100, 10.0), (50, 0.0), (None, 0.0)):
        with ShapedLink(rate_mbit=rate, delay_ms=delay) as link:
            nbytes = (8 << 20) if rate is None or rate >= 1000 else (4 << 20) if rate >= 100 else (2 << 20)
            m = link.measure(nbytes=nbytes)
            exp = link.payload_mbit
            print(f"rate {rate} Mbit delay {delay} ms: payload {m['mbit']:.1f} Mbit/s "
                  f"(shape allows {exp and round(exp, 1)}), rtt {m['rtt_ms']:.2f} ms")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "delayline":
        delay_line(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "sink":
        _sink(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "source":
        _source(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
    else:
        _selfcheck()

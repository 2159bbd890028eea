"""pdserve.testbed.hosts: hosts as network namespaces, their links, teardown, and DelayProxy.

Needs root and iproute2; every test that builds hosts skips with `skip_reason()` elsewhere.
Timings are lower bounds only (a slow machine never fails a test).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from pdserve.testbed import hosts as hosts_mod
from pdserve.testbed.hosts import DelayProxy, Hosts, HostsError, netem_reason, skip_reason

# argv: BIND PORT. Echoes each connection until EOF, then half-closes it.
ECHO = r"""
import socket, sys, threading
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
def serve(c):
    with c:
        while data := c.recv(65536):
            c.sendall(data)
        c.shutdown(socket.SHUT_WR)
print("ready", flush=True)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

# argv: HOST PORT NBYTES [TIMEOUT]. One echo round trip: "OK n seconds", "BAD n" or "ERR name".
CLIENT = r"""
import socket, sys, threading, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
payload = (bytes(range(256)) * (n // 256 + 1))[:n]
t0 = time.monotonic()
try:
    s = socket.create_connection((host, port), timeout=float((sys.argv[4:] or [2])[0]))
    def send():
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
    threading.Thread(target=send, daemon=True).start()
    got = bytearray()
    while data := s.recv(65536):
        got += data
except OSError as exc:
    print("ERR", type(exc).__name__)
    sys.exit(0)
print("OK" if got == payload else "BAD", len(got), time.monotonic() - t0)
"""


def _our_netns() -> set[str]:
    """This process's namespaces (their names carry its pid)."""
    prefix = f"pdh-{os.getpid()}-"
    return {ns for ns in hosts_mod._netns_names() if ns.startswith(prefix)}


def _assert_gone(h: Hosts) -> None:
    left = [ns for ns in hosts_mod._netns_names() if ns.startswith(h.switch_netns)]
    assert left == []
    assert not hosts_mod._link_exists(h.client_ifname)


def echo_server(h: Hosts, name: str, port: int, bind: str = "0.0.0.0") -> subprocess.Popen:
    proc = h.popen(name, [sys.executable, "-c", ECHO, bind, str(port)], stdout=subprocess.PIPE)
    assert hosts_mod._read_line(proc, 10) == "ready"
    return proc


def client(
    h: Hosts, name: str, host: str, port: int, nbytes: int = 5, timeout: float = 2.0
) -> list[str]:
    argv = [sys.executable, "-c", CLIENT, host, str(port), str(nbytes), str(timeout)]
    return h.run(name, argv).stdout.split()


def roundtrip(host: str, port: int, payload: bytes, timeout: float = 5.0) -> tuple[bytes, float]:
    """Send payload, half-close, read the echo to EOF: (echo, seconds)."""
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=timeout) as s:

        def send() -> None:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        got = bytearray()
        while data := s.recv(65536):
            got += data
        sender.join(timeout)
    return bytes(got), time.monotonic() - t0


def echo_ok(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        got, _ = roundtrip(host, port, b"ping", timeout)
    except OSError:
        return False
    return got == b"ping"


@pytest.fixture(scope="module")
def need_hosts() -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(f"hosts cannot be built here: {reason}")


@pytest.fixture(scope="module")
def hosts(need_hosts: None):
    with Hosts(["a", "b", "c"]) as h:
        yield h


def test_hosts_reach_each_other_and_the_client(hosts: Hosts) -> None:
    addrs = [hosts.addr(n) for n in ("a", "b", "c")]
    assert len(set(addrs)) == 3
    assert [a.rsplit(".", 1)[1] for a in addrs] == ["1", "2", "3"]
    assert hosts.client_addr.endswith(".254")
    assert hosts.netns("a") != hosts.netns("b")
    with pytest.raises(KeyError):
        hosts.addr("nope")
    echo_server(hosts, "a", 7000)
    for other in ("b", "c"):
        assert client(hosts, other, hosts.addr("a"), 7000)[:2] == ["OK", "5"]
    got, _ = roundtrip(hosts.addr("a"), 7000, b"x" * 300_000)
    assert got == b"x" * 300_000
    # The server sees the client by its own address on the bridge.
    out = hosts.run("b", ["ip", "-4", "-br", "addr", "show", "dev", "eth0"]).stdout
    assert f"{hosts.addr('b')}/24" in out


def test_popen_pid_is_the_command(hosts: Hosts) -> None:
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    proc = hosts.popen("b", [sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert int(hosts_mod._read_line(proc, 10)) == proc.pid
    st = os.stat(f"/proc/{proc.pid}/ns/net")
    assert (st.st_dev, st.st_ino) == hosts_mod._ns_inode(hosts.netns("b"))
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(5) == -signal.SIGKILL


def test_loopback_is_per_host(hosts: Hosts) -> None:
    echo_server(hosts, "a", 7001, bind="127.0.0.1")
    assert client(hosts, "a", "127.0.0.1", 7001)[:2] == ["OK", "5"]
    assert client(hosts, "b", "127.0.0.1", 7001) == ["ERR", "ConnectionRefusedError"]
    assert client(hosts, "b", hosts.addr("a"), 7001) == ["ERR", "ConnectionRefusedError"]


@pytest.mark.parametrize("side", ["host", "switch"])
def test_link_down_cuts_a_host_off(hosts: Hosts, side: str) -> None:
    port = 7002 if side == "host" else 7003
    echo_server(hosts, "c", port)
    assert echo_ok(hosts.addr("c"), port)
    hosts.link_down("c", side=side)
    try:
        assert not echo_ok(hosts.addr("c"), port, timeout=0.3)
        assert client(hosts, "c", hosts.addr("a"), 7000, timeout=0.3)[0] == "ERR"
    finally:
        hosts.link_up("c", side=side)
    deadline = time.monotonic() + 10
    while not echo_ok(hosts.addr("c"), port):
        assert time.monotonic() < deadline, "link_up did not restore the host"
        time.sleep(0.05)


def test_close_kills_everything_and_leaves_nothing(need_hosts: None) -> None:
    h = Hosts(["x", "y"], term_grace_s=0.3)
    assert hosts_mod._link_exists(h.client_ifname)
    assert {h.switch_netns, h.netns("x"), h.netns("y")} <= _our_netns()
    sleeper = h.popen("x", ["sleep", "100"])
    stubborn_code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(100)"
    )
    stubborn = h.popen("y", [sys.executable, "-c", stubborn_code], stdout=subprocess.PIPE)
    assert hosts_mod._read_line(stubborn, 10) == "ready"
    # One that left its process group and was never a Popen of ours.
    out = h.run("y", ["sh", "-c", "setsid sleep 100 </dev/null >/dev/null 2>&1 & echo $!"])
    escaped = int(out.stdout)
    h.close()
    assert sleeper.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    try:
        with open(f"/proc/{escaped}/status") as f:
            assert "State:\tZ" in f.read()  # killed; its parent (init) reaps it
    except FileNotFoundError:
        pass
    _assert_gone(h)
    h.close()  # idempotent
    with pytest.raises(HostsError):
        h.popen("x", ["true"])


def test_close_after_an_exception_inside_with(need_hosts: None) -> None:
    with pytest.raises(ZeroDivisionError):
        with Hosts(["x"]) as h:
            h.popen("x", ["sleep", "100"])
            1 / 0  # noqa: B018
    _assert_gone(h)


def test_close_after_a_build_that_failed_half_way(need_hosts: None, monkeypatch) -> None:
    tag = secrets.token_hex(3)
    monkeypatch.setattr(hosts_mod, "_new_tag", lambda: tag)
    base = f"pdh-{os.getpid()}-{tag}"
    real_cmd = hosts_mod._cmd

    def failing_cmd(argv, *args, **kwargs):
        if list(argv[:4]) == ["ip", "-n", f"{base}-y", "addr"]:
            raise HostsError("injected")
        return real_cmd(argv, *args, **kwargs)

    monkeypatch.setattr(hosts_mod, "_cmd", failing_cmd)
    with pytest.raises(HostsError, match="injected"):
        Hosts(["x", "y", "z"])
    left = [ns for ns in hosts_mod._netns_names() if ns.startswith(base)]
    assert left == []
    assert not hosts_mod._link_exists(f"pdh{tag}")


def test_two_hosts_at_once_do_not_clash(need_hosts: None) -> None:
    with Hosts(["a"]) as h1, Hosts(["a"]) as h2:
        assert h1.netns("a") != h2.netns("a")
        assert h1.client_ifname != h2.client_ifname
        assert h1.subnet != h2.subnet
        for h in (h1, h2):
            echo_server(h, "a", 7000)
            assert echo_ok(h.addr("a"), 7000)
        # Neither sees the other: no route between their subnets.
        assert client(h1, "a", h2.addr("a"), 7000)[0] == "ERR"
    _assert_gone(h1)
    _assert_gone(h2)


def test_delay_proxy_adds_the_delay_and_keeps_bytes(hosts: Hosts) -> None:
    delay = 0.1
    payload = os.urandom(1_000_000)
    echo_server(hosts, "a", 7004)
    # In this process, to a host's echo server.
    with DelayProxy("127.0.0.1", 0, hosts.addr("a"), 7004, delay) as proxy:
        got, seconds = roundtrip("127.0.0.1", proxy.port, b"hi")
        assert got == b"hi"
        assert seconds >= 2 * delay  # once each way
        got, _ = roundtrip("127.0.0.1", proxy.port, payload, timeout=30)
        assert got == payload
    assert proxy.counters() == {"up": 2 + len(payload), "down": 2 + len(payload), "connections": 2}
    # Inside host b, as its own process (python -m pdserve.testbed.hosts proxy ...).
    remote = hosts.start_proxy("b", 7100, "a", 7004, delay)
    assert (remote.addr, remote.port) == (hosts.addr("b"), 7100)
    got, seconds = roundtrip(remote.addr, remote.port, b"hi")
    assert got == b"hi"
    assert seconds >= 2 * delay
    got, _ = roundtrip(remote.addr, remote.port, payload, timeout=30)
    assert got == payload
    counters = remote.close()
    assert counters == {"up": 2 + len(payload), "down": 2 + len(payload), "connections": 2}


def test_delay_proxy_passes_resets_and_closes_cleanly() -> None:
    with socket.create_server(("127.0.0.1", 0)) as dead:
        port = dead.getsockname()[1]
    # Nothing listens on the target: the proxy drops the client.
    with DelayProxy("127.0.0.1", 0, "127.0.0.1", port, 0.01) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as s:
            assert s.recv(10) == b""
    assert proxy.connections == 0
    proxy.close()  # idempotent


def _class_bytes(h: Hosts, name: str) -> int:
    out = h.run(name, ["tc", "-s", "class", "show", "dev", "eth0", "classid", "1:1"]).stdout
    return int(out.split("Sent ", 1)[1].split()[0])


def test_shape_limits_egress_to_dst_only(hosts: Hosts) -> None:
    echo_server(hosts, "b", 7005)
    hosts.shape("a", "20mbit", dst=["b"])
    try:
        nbytes = 1 << 20
        status, n, seconds = client(hosts, "a", hosts.addr("b"), 7005, nbytes)
        assert (status, int(n)) == ("OK", nbytes)
        # 20 Mbit/s is 2.5 MB/s; tbf lets its 128 KiB burst through at once.
        assert float(seconds) >= (nbytes - (128 << 10)) / 2.5e6 * 0.8
        shaped = _class_bytes(hosts, "a")
        assert shaped >= nbytes
        # a's traffic to the client (its echo of what we send) stays out of the class.
        got, _ = roundtrip(hosts.addr("a"), 7000, b"z" * nbytes)
        assert len(got) == nbytes
        assert _class_bytes(hosts, "a") - shaped < nbytes // 10
    finally:
        hosts.unshape("a")
    out = hosts.run("a", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" not in out and "htb" not in out


def test_netem_reason(hosts: Hosts) -> None:
    reason = netem_reason()
    if reason is not None:  # this kernel has no sch_netem: say so, and refuse netem()
        assert isinstance(reason, str) and "netem" in reason
        with pytest.raises(HostsError, match="netem"):
            hosts.netem("a", delay_ms=50)
        return
    echo_server(hosts, "b", 7006)
    hosts.netem("a", delay_ms=100, dst=["b"])
    try:
        status, _, seconds = client(hosts, "a", hosts.addr("b"), 7006)
        assert status == "OK"
        assert float(seconds) >= 0.1
    finally:
        hosts.unshape("a")

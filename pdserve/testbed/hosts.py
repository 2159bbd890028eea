"""Hosts as Linux network namespaces, for the multi-host tests and benchmarks.

`with Hosts(["router", "p0", "d0"]) as hosts:` builds one network namespace per host, each
with one interface (`eth0`) on a Linux bridge that lives in a namespace of its own (the
switch), and an IPv4 address on a /24 picked at random under 10.0.0.0/8 (host i is .i+1).
The process that built them (the root namespace) gets an interface on the same bridge with
address .254 (`hosts.client_addr`), so it can talk to every host directly. Hosts see one
another and the client, nothing else: no default route, and each has its own loopback.

`hosts.popen(name, argv)` runs a command inside a host (`ip netns exec` execs it, so the
Popen's pid is the command itself); `link_down`/`link_up` cut a host off the switch and back;
`shape` limits a host's egress rate (tbf), `netem` adds delay and loss (where the kernel has
sch_netem: see `netem_reason()`). `close()` kills whatever runs in the hosts and deletes every
namespace and interface it made, then checks that none is left.

Where netem is missing, `DelayProxy` adds latency in userspace: a TCP forwarder that delivers
each chunk `delay_s` after it arrived, per direction. Inside a host it runs as
`python -m pdserve.testbed.hosts proxy LISTEN_HOST:PORT TARGET_HOST:PORT --delay-ms N`
(`hosts.start_proxy(...)` starts it and waits until it listens).

Needs root and iproute2; `skip_reason()` says why hosts cannot be built where they cannot.
Every `ip`/`tc` call has a timeout. Stdlib only.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import fcntl
import functools
import ipaddress
import json
import os
import random
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

IFNAME = "eth0"  # a host's interface, inside its namespace
BRIDGE = "br0"  # the bridge, inside the switch namespace
CMD_TIMEOUT = 10.0  # seconds, every ip/tc call
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
_LOCK = os.path.join(tempfile.gettempdir(), "pdserve-hosts.lock")
_UNLIMITED = "100gbit"  # the rate of an htb class that only exists to hold a leaf qdisc


class HostsError(RuntimeError):
    """An ip/tc command failed, or close() found something of its hosts left."""


def _cmd(argv: Sequence[str], timeout: float = CMD_TIMEOUT, check: bool = True):
    """Run a short command, output captured; HostsError when it fails or times out."""
    try:
        proc = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
        )
    except FileNotFoundError as exc:
        raise HostsError(f"{argv[0]}: not installed") from exc
    except subprocess.TimeoutExpired as exc:
        raise HostsError(f"{' '.join(argv)}: no answer in {timeout} s") from exc
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()
        raise HostsError(f"{' '.join(argv)}: exit {proc.returncode}: {msg}")
    return proc


def _new_tag() -> str:
    """Six hex digits naming one Hosts' namespaces and its root-side interface."""
    return secrets.token_hex(3)


def _netns_names() -> set[str]:
    out = _cmd(["ip", "netns", "list"]).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _link_exists(ifname: str) -> bool:
    return _cmd(["ip", "link", "show", "dev", ifname], check=False).returncode == 0


def _root_routes() -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix routed in the root namespace, in any table."""
    out = _cmd(["ip", "-4", "-j", "route", "show", "table", "all"]).stdout
    nets = []
    for route in json.loads(out or "[]"):
        dst = route.get("dst")
        if not dst or dst == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.IPv4Network(dst, strict=False))
    return nets


def _pick_subnet(taken: Sequence[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    # SystemRandom: a test run that seeds `random` must not pick what a parallel run picks.
    rng = random.SystemRandom()
    for _ in range(2000):
        net = ipaddress.IPv4Network(f"10.{rng.randrange(256)}.{rng.randrange(256)}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise HostsError("no free /24 under 10.0.0.0/8: the root namespace routes all of it")


def _ns_inode(ns: str) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/run/netns/{ns}")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _pids_in(inodes: set[tuple[int, int]]) -> set[int]:
    """The live processes whose network namespace is one of `inodes` (as `ip netns pids`)."""
    pids = set()
    if not inodes:
        return pids
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")  # a zombie has none: skipped
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in inodes:
            pids.add(int(entry))
    return pids


def _probe_netns() -> tuple[str | None, str]:
    """Make a scratch namespace: (why it failed or None, its name)."""
    name = f"pdh-{os.getpid()}-{_new_tag()}-probe"
    try:
        proc = _cmd(["ip", "netns", "add", name], check=False)
    except HostsError as exc:
        return f"`ip netns add` failed: {exc}", name
    if proc.returncode != 0:
        return f"`ip netns add` failed: {proc.stderr.strip()}", name
    return None, name


def _del_netns(name: str) -> None:
    with contextlib.suppress(HostsError):
        _cmd(["ip", "netns", "del", name], check=False)


def _scratch_reason(commands: Callable[[str], list[tuple[list[str], str]]]) -> str | None:
    """Run `commands(ns)` in a fresh scratch namespace `ns`, deleted after: why the first
    (argv, what it shows) failed, or None when they all ran."""
    reason, ns = _probe_netns()
    if reason:
        return reason
    try:
        for argv, what in commands(ns):
            proc = _cmd(argv, check=False)
            if proc.returncode != 0:
                return f"{what}: {proc.stderr.strip() or f'exit {proc.returncode}'}"
    except HostsError as exc:
        return str(exc)
    finally:
        _del_netns(ns)
    return None


@functools.cache
def skip_reason() -> str | None:
    """Why Hosts cannot be built here, or None when they can (tests skip with this)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    return _scratch_reason(
        lambda ns: [
            (
                ["ip", "-n", ns, "link", "add", BRIDGE, "type", "bridge"],
                "cannot make a bridge in a namespace",
            ),
            (
                ["ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                "cannot make veth in a namespace",
            ),
        ]
    )


@functools.cache
def netem_reason() -> str | None:
    """Why `tc qdisc ... netem` is unavailable here (tried in a scratch namespace), or None."""
    reason = skip_reason()
    if reason:
        return reason
    if shutil.which("tc") is None:
        return "`tc` (iproute2) is not installed"
    return _scratch_reason(
        lambda ns: [
            (
                ["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                "tc qdisc netem is unavailable (no sch_netem in this kernel?)",
            )
        ]
    )


def _bits_per_s(rate: float | str) -> int:
    """A rate as tc writes it (`100mbit`, `1gbit`, `10mbps` = bytes) or bits/s, in bits/s."""
    if isinstance(rate, (int, float)):
        bits = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
        if not m:
            raise ValueError(f"rate {rate!r}: want a number of bits/s or e.g. '100mbit'")
        scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
        bits = float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1)
    if bits < 8:
        raise ValueError(f"rate {rate!r} is too low")
    return int(bits)


@dataclass
class ProxyProcess:
    """A `python -m pdserve.testbed.hosts proxy ...` running in a host (`Hosts.start_proxy`)."""

    proc: subprocess.Popen
    addr: str  # where it listens
    port: int

    def close(self, timeout: float = 5.0) -> dict[str, int]:
        """Stop it; its counters: {"up": bytes to the target, "down": back, "connections"}."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=timeout)
        for line in reversed((out or b"").decode(errors="replace").splitlines()):
            with contextlib.suppress(ValueError):
                return json.loads(line)
        return {}


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One line of a child's stdout pipe (read byte by byte, so nothing after it is taken)."""
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise HostsError(f"no line from {proc.args} in {timeout} s")
        byte = os.read(fd, 1)
        if not byte:
            raise HostsError(f"{proc.args} exited (status {proc.wait(timeout)}) before a line")
        buf += byte
    return buf.decode(errors="replace").strip()


class Hosts:
    """One network namespace per host name on a shared bridge; see the module docstring.

    Construction builds everything (and cleans up what it made if it fails half-way);
    `close()` (also `__exit__` and atexit) undoes it and is idempotent.
    """

    def __init__(self, names: Sequence[str], *, term_grace_s: float = 1.0):
        names = list(names)
        if not names:
            raise ValueError("Hosts needs at least one host name")
        if len(names) > 253:
            raise ValueError("at most 253 hosts on one /24 (.254 is the client)")
        for name in names:
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ValueError(f"host name {name!r}: want [A-Za-z0-9][A-Za-z0-9_.-]{{0,31}}")
        if len(set(names)) != len(names):
            raise ValueError(f"host names repeat: {names}")
        self.names = names
        self.term_grace_s = term_grace_s
        self.tag = _new_tag()
        # The pid keeps two processes apart even if their tags matched; the switch
        # namespace is the base name, the hosts' names extend it.
        self.switch_netns = f"pdh-{os.getpid()}-{self.tag}"
        self._netns = {name: f"{self.switch_netns}-{name}" for name in names}
        self._port = {name: f"p{i}" for i, name in enumerate(names)}  # switch-side veth ends
        self.client_ifname = f"pdh{self.tag}"  # root-side veth end: 9 of at most 15 chars
        self.subnet = ""
        self.client_addr = ""
        self._addr: dict[str, str] = {}
        self._made: list[str] = []  # namespaces this instance created, in order
        self._client_link = False  # whether it created client_ifname
        self._procs: list[tuple[subprocess.Popen, bool]] = []  # (proc, own process group)
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException as exc:
            try:
                self.close()
            except Exception as close_exc:
                raise HostsError(f"building failed ({exc!r}); cleanup: {close_exc}") from exc
            raise

    # -- building

    def _add_netns(self, ns: str) -> None:
        _cmd(["ip", "netns", "add", ns])
        self._made.append(ns)
        _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self) -> None:
        sw = self.switch_netns
        self._add_netns(sw)
        _cmd(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"])
        _cmd(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
        # Pick the /24 and claim it (the root-side address routes it) under a lock, so two
        # runs starting at once cannot both pick one that is free.
        with open(_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                net = _pick_subnet(_root_routes())
                self.subnet = str(net)
                self.client_addr = str(net.network_address + 254)
                self._addr = {n: str(net.network_address + i + 1) for i, n in enumerate(self.names)}
                veth = ["type", "veth", "peer", "name", "client", "netns", sw]
                _cmd(["ip", "link", "add", self.client_ifname, *veth])
                self._client_link = True
                _cmd(["ip", "addr", "add", f"{self.client_addr}/24", "dev", self.client_ifname])
                _cmd(["ip", "link", "set", self.client_ifname, "up"])
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        _cmd(["ip", "-n", sw, "link", "set", "client", "master", BRIDGE, "up"])
        for name in self.names:
            ns, port = self._netns[name], self._port[name]
            self._add_netns(ns)
            veth = ["type", "veth", "peer", "name", IFNAME, "netns", ns]
            _cmd(["ip", "-n", sw, "link", "add", port, *veth])
            _cmd(["ip", "-n", sw, "link", "set", port, "master", BRIDGE, "up"])
            _cmd(["ip", "-n", ns, "addr", "add", f"{self._addr[name]}/24", "dev", IFNAME])
            _cmd(["ip", "-n", ns, "link", "set", IFNAME, "up"])

    # -- addresses

    def _check(self, name: str) -> None:
        if name not in self._netns:
            raise KeyError(f"no host {name!r}; hosts are {self.names}")

    def addr(self, name: str) -> str:
        """The host's IPv4 address."""
        self._check(name)
        return self._addr[name]

    def netns(self, name: str) -> str:
        """The name of the host's network namespace (for `ip netns exec`, `ip -n`, `tc -n`)."""
        self._check(name)
        return self._netns[name]

    def _resolve(self, host_or_ip: str) -> str:
        if host_or_ip in self._addr:
            return self._addr[host_or_ip]
        return str(ipaddress.IPv4Address(host_or_ip))

    def __repr__(self) -> str:
        hosts = ", ".join(f"{n}={self._addr.get(n, '?')}" for n in self.names)
        return f"Hosts({hosts}; client={self.client_addr or '?'}, netns={self.switch_netns})"

    # -- processes

    def popen(self, name: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start argv inside the host. `ip netns exec` execs it, so the pid is argv's own.

        Defaults: stdin from /dev/null and a session of its own (`close()` signals the whole
        process group); pass start_new_session=False to keep it in ours.
        """
        if self._closed:
            raise HostsError("Hosts is closed")
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        popen_kwargs.setdefault("start_new_session", True)
        own_group = bool(popen_kwargs["start_new_session"])
        argv = ["ip", "netns", "exec", self.netns(name), *map(str, argv)]
        proc = subprocess.Popen(argv, **popen_kwargs)
        self._procs.append((proc, own_group))
        return proc

    def run(
        self,
        name: str,
        argv: Sequence[str],
        timeout: float = 30.0,
        *,
        check: bool = True,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a short command inside the host; its output captured as text.

        subprocess.TimeoutExpired past `timeout` (the command is killed); HostsError on a
        nonzero exit when `check`.
        """
        if self._closed:
            raise HostsError("Hosts is closed")
        argv = ["ip", "netns", "exec", self.netns(name), *map(str, argv)]
        proc = subprocess.run(
            argv,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip()
            raise HostsError(f"{' '.join(argv)}: exit {proc.returncode}: {msg}")
        return proc

    def start_proxy(
        self,
        name: str,
        listen_port: int,
        target_addr: str,
        target_port: int,
        delay_s: float,
        *,
        listen_addr: str = "0.0.0.0",
        timeout: float = 10.0,
    ) -> ProxyProcess:
        """Run a DelayProxy inside the host (its own process) and wait until it listens.

        target_addr may be a host name of these Hosts. `.close()` on the result stops it and
        returns its byte counters; `Hosts.close()` kills it in any case.
        """
        argv = [sys.executable, "-m", "pdserve.testbed.hosts", "proxy"]
        argv += [f"{listen_addr}:{listen_port}", f"{self._resolve(target_addr)}:{target_port}"]
        argv += ["--delay-ms", repr(delay_s * 1000.0)]
        proc = self.popen(name, argv, stdout=subprocess.PIPE)
        try:
            line = _read_line(proc, timeout)
            if not line.startswith("listening "):
                raise HostsError(f"proxy in {name}: unexpected {line!r}")
            host, _, port = line.split(" ", 1)[1].rpartition(":")
        except BaseException:
            proc.kill()
            proc.wait(timeout)
            raise
        addr = self.addr(name) if listen_addr == "0.0.0.0" else host
        return ProxyProcess(proc, addr, int(port))

    # -- the links

    def _link(self, name: str, state: str, side: str) -> None:
        if side == "host":
            _cmd(["ip", "-n", self.netns(name), "link", "set", IFNAME, state])
        elif side == "switch":
            self._check(name)
            _cmd(["ip", "-n", self.switch_netns, "link", "set", self._port[name], state])
        else:
            raise ValueError(f"side {side!r}: 'host' or 'switch'")

    def link_down(self, name: str, side: str = "host") -> None:
        """Cut the host off the switch.

        side="host" downs its own eth0 (inside its namespace): its own sends then fail at
        once (no route), packets to it are lost. side="switch" downs the switch's end: the
        host keeps its route and its sends are lost silently too, like a pulled cable.
        """
        self._link(name, "down", side)

    def link_up(self, name: str, side: str = "host") -> None:
        """Undo link_down (the same side)."""
        self._link(name, "up", side)

    def _set_egress(self, name: str, leaf: list[str], dst: Sequence[str] | None) -> None:
        """Make `leaf` the qdisc of the host's egress, or of its traffic to `dst` only."""
        ns = self.netns(name)
        ips = [self._resolve(d) for d in dst or ()]
        self.unshape(name)
        dev = ["dev", IFNAME]
        if not ips:
            _cmd(["tc", "-n", ns, "qdisc", "add", *dev, "root", "handle", "1:", *leaf])
            return
        # htb without a default class sends unclassified packets (ARP too) straight out;
        # u32 filters put the packets to `dst` into class 1:1, which holds the leaf.
        _cmd(["tc", "-n", ns, "qdisc", "add", *dev, "root", "handle", "1:", "htb"])
        htb = ["htb", "rate", _UNLIMITED, "quantum", "65536"]
        _cmd(["tc", "-n", ns, "class", "add", *dev, "parent", "1:", "classid", "1:1", *htb])
        _cmd(["tc", "-n", ns, "qdisc", "add", *dev, "parent", "1:1", "handle", "10:", *leaf])
        for ip in ips:
            u32 = ["u32", "match", "ip", "dst", f"{ip}/32", "flowid", "1:1"]
            filt = ["filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio", "1"]
            _cmd(["tc", "-n", ns, *filt, *u32])

    def shape(
        self,
        name: str,
        rate: float | str,
        *,
        dst: Sequence[str] | None = None,
        burst_bytes: int | None = None,
        latency_ms: float = 50.0,
    ) -> None:
        """Limit the host's egress to `rate` (bits/s, or tc's '100mbit'), with tbf.

        Only its traffic to `dst` (addresses or host names) when given. Replaces any earlier
        shape/netem of this host; `unshape` removes it. Shape both ends for both directions.
        """
        bits = _bits_per_s(rate)
        # 10 ms worth, and no less than two 64 KiB GSO segments (smaller ones tbf must split).
        burst = burst_bytes or max(bits // 8 // 100, 128 * 1024)
        leaf = ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", f"{latency_ms}ms"]
        self._set_egress(name, leaf, dst)

    def netem(
        self,
        name: str,
        delay_ms: float = 0.0,
        loss_pct: float = 0.0,
        dst: Sequence[str] | None = None,
        *,
        jitter_ms: float = 0.0,
        limit: int = 100_000,
    ) -> None:
        """Delay (and drop loss_pct % of) the host's egress with netem, only to `dst` if given.

        HostsError with netem_reason() where the kernel has no netem. Replaces any earlier
        shape/netem of this host; a round trip between two hosts gets it once unless both
        ends have it.
        """
        reason = netem_reason()
        if reason:
            raise HostsError(reason)
        leaf = ["netem", "limit", str(limit), "delay", f"{delay_ms}ms"]
        if jitter_ms:
            leaf.append(f"{jitter_ms}ms")
        if loss_pct:
            leaf += ["loss", f"{loss_pct}%"]
        self._set_egress(name, leaf, dst)

    def unshape(self, name: str) -> None:
        """Remove the host's shape/netem (its default qdisc comes back)."""
        _cmd(["tc", "-n", self.netns(name), "qdisc", "del", "dev", IFNAME, "root"], check=False)

    # -- teardown

    def _kill_all(self) -> None:
        inodes = {ino for ns in self._made if (ino := _ns_inode(ns))}

        def signal_all(sig: int) -> None:
            for proc, own_group in self._procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        if own_group:
                            os.killpg(proc.pid, sig)
                        else:
                            proc.send_signal(sig)
            for pid in _pids_in(inodes):  # also what they spawned, and anything else in there
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

        def wait_all(seconds: float) -> bool:
            deadline = time.monotonic() + seconds
            while True:
                alive = [p for p, _ in self._procs if p.poll() is None] or _pids_in(inodes)
                if not alive:
                    return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.02)

        if not self._procs and not _pids_in(inodes):
            return
        signal_all(signal.SIGTERM)
        if not wait_all(self.term_grace_s):
            signal_all(signal.SIGKILL)
            wait_all(5.0)
        for proc, _ in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)

    def close(self) -> None:
        """Kill every process in the hosts (SIGTERM, then SIGKILL after term_grace_s), delete
        every namespace and the root-side interface this instance made, and check that none
        is left (HostsError if one is). Safe to call again, and after a failed build."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._kill_all()
        finally:
            if self._client_link:  # deleting the pair now: netns del frees its end lazily
                with contextlib.suppress(HostsError):
                    _cmd(["ip", "link", "del", self.client_ifname], check=False)
            for ns in reversed(self._made):
                _del_netns(ns)
            self._verify_gone()

    def _verify_gone(self) -> None:
        deadline = time.monotonic() + 5.0
        while True:
            left = [ns for ns in self._made if ns in _netns_names()]
            if self._client_link and _link_exists(self.client_ifname):
                left.append(f"interface {self.client_ifname}")
            if not left:
                return
            if time.monotonic() >= deadline:
                raise HostsError(f"Hosts.close() left {left}")
            for ns in left:
                if ns in self._made:
                    _del_netns(ns)
            time.sleep(0.05)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DelayProxy:
    """A TCP forwarder that delivers every chunk `delay_s` after it arrived, per direction.

    Each accepted connection gets its own connection to the target; both directions keep
    their order, and a half-close (EOF) is passed on after the delay too. No rate limit
    beyond its own forwarding cost; it buffers at most max_buffer_bytes per direction (the
    bandwidth-delay product it can carry). `start()` runs an asyncio loop in a thread;
    `port` is the bound port (listen_port 0 picks one). bytes_up counts what it delivered
    to the target, bytes_down what it delivered back; connections the ones it forwarded.
    """

    CHUNK = 1 << 16

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        target_host: str,
        target_port: int,
        delay_s: float,
        *,
        max_buffer_bytes: int = 256 << 20,
        connect_timeout: float = 10.0,
    ):
        if delay_s < 0:
            raise ValueError("delay_s must be >= 0")
        self.listen_host, self.listen_port = listen_host, listen_port
        self.target_host, self.target_port = target_host, target_port
        self.delay_s = delay_s
        self.max_buffer_bytes = max_buffer_bytes
        self.connect_timeout = connect_timeout
        self.port = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._tasks: set[asyncio.Task] = set()

    def counters(self) -> dict[str, int]:
        return {"up": self.bytes_up, "down": self.bytes_down, "connections": self.connections}

    def start(self, timeout: float = 10.0) -> DelayProxy:
        if self._thread is not None:
            raise RuntimeError("DelayProxy already started")
        self._thread = threading.Thread(target=self._run, name="DelayProxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"DelayProxy did not start in {timeout} s")
        if self._error is not None:
            self._thread.join(timeout)
            raise self._error
        return self

    def close(self, timeout: float = 5.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # reported to start()
            self._error = self._error or exc
        finally:
            self._ready.set()
            loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        try:
            server = await asyncio.start_server(self._handle, self.listen_host, self.listen_port)
        except OSError as exc:
            self._error = exc
            return
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        target_writer: asyncio.StreamWriter | None = None
        ok = False
        pumps: list[asyncio.Future] = []
        try:
            target = asyncio.open_connection(self.target_host, self.target_port)
            t_reader, target_writer = await asyncio.wait_for(target, self.connect_timeout)
            for w in (writer, target_writer):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.connections += 1
            pumps = [
                asyncio.ensure_future(self._forward(reader, target_writer, "up")),
                asyncio.ensure_future(self._forward(t_reader, writer, "down")),
            ]
            await asyncio.gather(*pumps)
            ok = True
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass  # a reset or an unreachable target: both sides are dropped below
        finally:
            for pump in pumps:
                pump.cancel()
            for w in (writer, target_writer):
                if w is None:
                    continue
                if ok:
                    w.close()  # flushes what is still buffered
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(w.wait_closed(), 5.0)
                else:
                    w.transport.abort()
            self._tasks.discard(task)

    async def _forward(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str
    ) -> None:
        """src to dst, each chunk written delay_s after it was read; EOF passed on likewise."""
        line = _DelayLine(self.delay_s, self.max_buffer_bytes)
        tasks = [
            asyncio.ensure_future(line.receive(src, self.CHUNK)),
            asyncio.ensure_future(line.deliver(dst, lambda n: self._count(direction, n))),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
        finally:
            for t in tasks:
                t.cancel()

    def _count(self, direction: str, nbytes: int) -> None:
        if direction == "up":
            self.bytes_up += nbytes
        else:
            self.bytes_down += nbytes


class _DelayLine:
    """One direction of a DelayProxy connection: chunks wait, in order, until delay_s after
    they were read; reading pauses while more than max_buffer_bytes wait (the proxy's memory
    stays bounded whatever the sender does). b"" queued is EOF."""

    def __init__(self, delay_s: float, max_buffer_bytes: int) -> None:
        self.delay_s = delay_s
        self.max_buffer_bytes = max_buffer_bytes
        self.items: deque[tuple[float, bytes]] = deque()  # (due, data)
        self.arrived = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()
        self.pending = 0

    async def receive(self, src: asyncio.StreamReader, chunk: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await src.read(chunk)
            self.items.append((loop.time() + self.delay_s, data))
            self.arrived.set()
            if not data:
                return
            self.pending += len(data)
            while self.pending > self.max_buffer_bytes:
                self.room.clear()
                await self.room.wait()

    async def deliver(self, dst: asyncio.StreamWriter, count: Callable[[int], None]) -> None:
        while True:
            out, eof = await self._due()
            if out:
                payload = b"".join(out)  # everything due goes in one write
                dst.write(payload)
                await dst.drain()
                self.pending -= len(payload)
                count(len(payload))
                if self.pending <= self.max_buffer_bytes:
                    self.room.set()
            if eof:
                if dst.can_write_eof():
                    dst.write_eof()
                return

    async def _due(self) -> tuple[list[bytes], bool]:
        """Once the oldest chunk is due: every chunk due by then, and whether EOF came."""
        loop = asyncio.get_running_loop()
        while not self.items:
            self.arrived.clear()
            await self.arrived.wait()
        wait = self.items[0][0] - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        now = loop.time()
        out: list[bytes] = []
        while self.items and self.items[0][0] <= now:
            data = self.items.popleft()[1]
            if not data:
                return out, True
            out.append(data)
        return out, False


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: want HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.testbed.hosts", description="network-namespace hosts: helpers"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    proxy = sub.add_parser("proxy", help="a TCP forwarder that adds a delay each way")
    proxy.add_argument("listen", type=_hostport, help="HOST:PORT to listen on (port 0: any)")
    proxy.add_argument("target", type=_hostport, help="HOST:PORT to forward to")
    proxy.add_argument("--delay-ms", type=float, required=True, help="added each way")
    proxy.add_argument("--max-buffer-mb", type=float, default=256.0, help="per direction")
    sub.add_parser("check", help="say whether hosts and netem work here")
    args = parser.parse_args(argv)

    if args.cmd == "check":
        print(f"hosts: {skip_reason() or 'ok'}")
        print(f"netem: {netem_reason() or 'ok'}")
        return 0

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    (lhost, lport), (thost, tport) = args.listen, args.target
    max_buffer = int(args.max_buffer_mb * (1 << 20))
    dp = DelayProxy(lhost, lport, thost, tport, args.delay_ms / 1000.0, max_buffer_bytes=max_buffer)
    dp.start()
    print(f"listening {lhost}:{dp.port}", flush=True)
    while not stop.wait(0.5):
        pass
    dp.close()
    print(json.dumps(dp.counters()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

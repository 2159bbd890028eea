"""What a long-running server process does once it has started."""

from __future__ import annotations

import gc
import os
import socket


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (modules, weights' wrappers, tokenizers) out of
    the garbage collector's reach.

    A server imports torch and transformers: hundreds of thousands of long-lived objects that
    every full collection walks again. Under load such a pass took 0.2 s on an idle 2-core
    machine and over a second on a busy one, long enough for a router's event loop to miss
    every node's heartbeats at once. Objects made later are collected as usual."""
    gc.collect()
    gc.freeze()


def host_id() -> str:
    """This host as shared memory sees it: the kernel's boot id and the network namespace.

    Two processes share /dev/shm only on one machine; two network namespaces (containers,
    Kubernetes pods, the test suite's hosts) are separate hosts to every connector, even when
    a filesystem happens to be shared, so both parts must match."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "-"
    return f"{boot}/{netns}"


def route_source(peer_host: str, peer_port: int) -> str:
    """The local address this host would use to reach peer_host (no packet is sent): what a
    node bound to a wildcard advertises to its peers by default."""
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    infos = socket.getaddrinfo(peer_host, peer_port, family, socket.SOCK_DGRAM)
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(infos[0][4])  # UDP connect only picks a route
        return s.getsockname()[0]

"""Nodes joining the router: a registration is taken in (or again), a decode node only once
its KV endpoint answers, and a node that comes back as a new process has what the old one
held failed over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

from pdserve.common.node.config import is_wildcard
from pdserve.common.wire.messages import Registered, RegisterNode
from pdserve.router.cluster.streams import ControlServer, RequestTable

log = logging.getLogger(__name__)


async def probe_endpoint(endpoint: str, timeout: float) -> str | None:
    """Why peers cannot reach a node's KV endpoint from here (None: a TCP connection opens)."""
    scheme, _, address = endpoint.partition("://")
    if scheme != "tcp":
        return None  # ipc:// and the like: one host, nothing to route
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    hint = "start the node with --advertise-host set to an address other hosts reach"
    if is_wildcard(host):
        return f"its KV endpoint {endpoint} names no address peers can dial: {hint}"
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    except (OSError, ValueError, asyncio.TimeoutError) as exc:
        why = str(exc) or type(exc).__name__
        return f"its KV endpoint {endpoint} is not reachable from the router ({why}): {hint}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


class Registrar:
    """Takes nodes into the registry as they register, and answers them."""

    def __init__(self, table: RequestTable, control: ControlServer, probe_timeout: float) -> None:
        self.table = table
        self.registry = table.registry
        self.control = control
        self.probe_timeout = probe_timeout
        self._probing: set[str] = set()  # nodes whose KV endpoint is being checked
        # RegisterNode messages this router got, by node: one per node process, unless the
        # router lost its answer (operators read it in /internal/integrity).
        self.registrations: Counter[str] = Counter()

    def probing(self, node_id: str) -> bool:
        """Whether the node's first registration is being checked."""
        return node_id in self._probing

    def register(self, sender: str, msg: RegisterNode, now: float) -> None:
        """Check a node's KV endpoint first (a decode node), then take it in and say so."""
        self.registrations[sender] += 1
        if sender in self._probing:
            return  # its first registration is being checked
        known = self.registry.get(sender)
        if msg.kv_endpoints and (known is None or known.incarnation != msg.incarnation):
            self._probing.add(sender)
            self.control.spawn(self._probe_then_register(sender, msg))
            return
        self._take(sender, msg, now)

    async def _probe_then_register(self, sender: str, msg: RegisterNode) -> None:
        """A decode node is only taken in once its advertised KV endpoints (one per rank)
        answer here: a wrong --advertise-host fails the node at registration, naming the
        address, instead of every prefill later hanging on it."""
        try:
            why = None
            for endpoint in msg.kv_endpoints:
                why = why or await probe_endpoint(endpoint, self.probe_timeout)
        finally:
            self._probing.discard(sender)
        if why is not None:
            log.error("node %s refused: %s", sender, why)
            await self.control.send(sender, Registered(accepted=False, reason=why))
            return
        self._take(sender, msg, self.registry.clock())

    def _take(self, sender: str, msg: RegisterNode, now: float) -> None:
        """Add a node, or take it again; a new incarnation under a known id is a restarted
        process that holds nothing the old one held: fail those requests over now."""
        self.control.spawn(self.control.send(sender, Registered()))
        old = self.registry.get(sender)
        if old is not None and old.incarnation != msg.incarnation:
            log.warning("node %s restarted: failing over what it held", sender)
            self.table.node_restarted(sender)
        elif old is not None:
            old.last_seen = now
            return
        log.info("node %s registered (%s, %s KV)", sender, msg.role, msg.kv_connector or "no")
        self.registry.add(sender, msg, now)
        why = self.registry.unpairable(sender)
        if why:
            log.warning("node %s can exchange KV with no node of the other role: %s", sender, why)

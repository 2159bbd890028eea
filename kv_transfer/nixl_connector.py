"""KV pages written by NIXL straight from the prefill node's cache blocks into the decode
node's reserved blocks: no gather, no staging, no scatter.

Each process has one NIXL agent (`_Agent`) that registers its KV cache tensors once. The
handshake runs over the zmq side channel every connector shares: the receiver's welcome
carries its agent metadata and where each layer's cache lives (base address, block count,
memory type), so the sender can describe any of the receiver's pages. Per layer, as soon as
the layer's K/V are written, the sender posts one WRITE pairing its source pages with the
reserved destination pages (one descriptor per K or V half of a block; NIXL merges runs of
contiguous blocks into one descriptor). A WRITE is DONE only after its endpoint flush, so
the data is in the receiver's memory when the sender says so.

Ownership rules (the receiver cannot refuse a remote write, so the sender must never issue
one that could land where it should not):

- A sender writes only blocks the receiver itself announced for the transfer (`KVExpect`,
  sent to every connected sender when the decode node reserves, and to a sender that
  connects later): not what the router relayed. Pages outside the announcement are never
  written; the transfer then fails at `send_done`.
- When the decode node cancels a transfer (abort, failure, renewal), the receiver fences
  its blocks and sends `KVCancel` to every sender. A sender that gets it stops writing that
  transfer for good, waits for its WRITEs in flight, and answers `KVSettled`; a done message
  settles too. The fence lifts once every sender connected at the cancel has settled, or
  after `fence_timeout` (a sender silent that long is dropped: it must handshake again).
  The decode node keeps the blocks of a fenced transfer out of its free pool until then
  (`released`), and a renewed transfer into the same blocks is not admitted before.
- The sender's own pages: `send_done` returns only after every WRITE of the transfer is
  DONE, and `abandon` (the prefill node dropped the request) waits the same way, so a
  source block is never reused while a WRITE still reads it. A block sent again (a partly
  filled last block that the next chunk completed) waits for its earlier WRITE first, so
  two WRITEs of one page never race.
- Fail closed: the sender sums each layer's pages after posting its WRITE; each WRITE carries
  a NIXL notification, delivered after its data, on which the receiver sums the same pages
  as they land. The done message carries the pages written and the sender's checksum; the
  receiver admits the request only if its checksum of exactly those pages is the same.

Without the `nixl` extra installed, choosing this connector raises an error naming
`pip install 'pdserve[nixl]'`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import torch
import zmq

from pdserve.common.wire.messages import Message, ProtocolError, decode, message
from pdserve.common.wire.security import CurveKeys
from pdserve.kv_transfer.base import TransferError, TransferResult, TransferTimeout
from pdserve.kv_transfer.channel import ChannelReceiver, ChannelSender, Peer
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.wire import (
    KVDone,
    KVHello,
    KVRefused,
    check_welcome,
    corrupt_first_byte,
    welcome_extra,
)

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pdserve[nixl]'"
# Python packages that ship NIXL's bindings, in order of preference (nixl-cu12 on PyPI).
_NIXL_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")
# The checksum of a transfer's pages (see `pages_digest`).
NIXL_CHECKSUM = "pdserve-nixl-pages/2"
_POLL_S = 0.0005
_MASK64 = (1 << 64) - 1
_ANNOUNCED_KEPT = 16384  # reservations a sender remembers (see NixlSender._on_message)
_NOTIF_GRACE_S = 1.0  # how long a finished transfer waits for its last WRITEs' notifications


# -- side-channel messages --------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class KVExpect(Message):
    """Receiver -> every sender: the blocks reserved for a transfer, the only ones a sender
    may write for it."""

    TYPE: ClassVar[str] = "kvx.expect"
    xfer_id: str
    block_ids: tuple[int, ...]


@message
@dataclass(frozen=True, slots=True)
class KVCancel(Message):
    """Receiver -> every sender: never write this transfer again; answer KVSettled."""

    TYPE: ClassVar[str] = "kvx.cancel"
    xfer_id: str


@message
@dataclass(frozen=True, slots=True)
class KVSettled(Message):
    """Sender -> receiver: nothing of this transfer is in flight from here, and nothing more
    will be written."""

    TYPE: ClassVar[str] = "kvx.settled"
    xfer_id: str


# -- the process's agent ------------------------------------------------------------------------


def nixl_installed() -> bool:
    """Whether a package that ships NIXL's bindings is installed, whether it imports or not."""
    return any(importlib.util.find_spec(name.partition(".")[0]) for name in _NIXL_MODULES)


def load_nixl() -> Any:
    """NIXL's Python API module. TransferError naming the extra when it is not installed, and
    naming the import error when it is installed but does not load (a broken install must not
    pass for a missing one)."""
    for name in _NIXL_MODULES:
        package = name.partition(".")[0]
        if importlib.util.find_spec(package) is None:
            continue
        try:
            api = importlib.import_module(name)
        except ImportError as e:
            raise TransferError(f"NIXL ({package}) is installed but does not load: {e}") from e
        # NIXL's Python logger prints INFO lines to stdout; a node's stdout is not a log.
        nixl_log = logging.getLogger("nixl")
        for handler in list(nixl_log.handlers):
            nixl_log.removeHandler(handler)
        nixl_log.propagate = True
        nixl_log.setLevel(logging.WARNING)
        return api
    raise TransferError(f"the nixl KV connector needs NIXL, which is not installed: {INSTALL_HINT}")


class _Agent:
    """This process's NIXL agent and the cache tensors it registered (once each)."""

    _instance: ClassVar[_Agent | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        api = load_nixl()
        bindings = importlib.import_module(api.__name__.rpartition(".")[0] + "._bindings")
        # NIXL's bindings raise these (plain Exceptions) where a transport fails.
        self.errors: tuple[type[Exception], ...] = tuple(
            getattr(bindings, n)
            for n in dir(bindings)
            if n.startswith("nixl") and n.endswith("Error")
        )
        # No NIXL progress thread: it spins (NIXL gives it no delay) and took a core from the
        # forward (KV transfer throughput nearly doubled without it). A sender progresses in its
        # own calls; a receiver runs `Progress`, a thread that reads notifications every
        # half millisecond (hence the locking mode).
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.name = f"pdserve-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.agent = api.nixl_agent(self.name, config)
        self._registered: dict[tuple[int, int], Any] = {}  # (address, bytes) -> reg descs
        self._local_lists: dict[tuple[int, int, int], Any] = {}  # prepped local page lists
        self._remotes: dict[str, int] = {}  # remote agent name -> senders using it

    @classmethod
    def get(cls) -> _Agent:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def register(self, caches: Sequence[torch.Tensor]) -> None:
        for cache in caches:
            key = (cache.data_ptr(), cache.numel() * cache.element_size())
            if key not in self._registered:
                self._registered[key] = self.agent.register_memory([cache])

    def deregister(self, caches: Sequence[torch.Tensor]) -> None:
        for cache in caches:
            key = (cache.data_ptr(), cache.numel() * cache.element_size())
            descs = self._registered.pop(key, None)
            if descs is not None:
                self.agent.deregister_memory(descs)
        self._local_lists = {
            k: v for k, v in self._local_lists.items() if all(k[0] != c.data_ptr() for c in caches)
        }

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes[name] = self._remotes.get(name, 0) + 1
        return name

    def drop_remote(self, name: str) -> None:
        left = self._remotes.get(name, 0) - 1
        if left > 0:
            self._remotes[name] = left
            return
        self._remotes.pop(name, None)
        try:
            self.agent.remove_remote_agent(name)
        except Exception:  # already gone with the peer; nothing to release
            pass

    def local_pages(self, cache: torch.Tensor) -> Any:
        """The prepped list of a local layer cache's pages: index kv * num_blocks + block."""
        key = (cache.data_ptr(), cache.shape[1], cache.element_size())
        pages = self._local_lists.get(key)
        if pages is None:
            self.register([cache])
            pages = self.prep(
                "NIXL_INIT_AGENT", cache.data_ptr(), cache.shape[1], _half_bytes(cache), cache
            )
            self._local_lists[key] = pages
        return pages

    def prep(self, agent: str, base: int, num_blocks: int, half: int, like: Any) -> Any:
        """Prep the 2 * num_blocks half-pages (K then V) of a layer cache at `base`."""
        import numpy as np

        device, mem = _mem_of(like)
        starts = base + np.arange(2 * num_blocks, dtype=np.uint64) * np.uint64(half)
        descs = np.stack([starts, np.full_like(starts, half), np.full_like(starts, device)], axis=1)
        return self.agent.prep_xfer_dlist(agent, descs, mem)


def _half_bytes(cache: torch.Tensor) -> int:
    """Bytes of one block's K (or V) half in a [2, num_blocks, bs, H, D] layer cache."""
    return cache[0, 0].numel() * cache.element_size()


def _mem_of(like: Any) -> tuple[int, str]:
    """(device id, NIXL memory type) of a tensor, or of a welcome's layer entry."""
    if isinstance(like, torch.Tensor):
        return (like.device.index or 0, "VRAM") if like.is_cuda else (0, "DRAM")
    return int(like["device"]), str(like["mem"])


def _page_indices(blocks: Sequence[int], num_blocks: int) -> list[int]:
    """Indices into a prepped layer list of the K and V halves of `blocks`."""
    return [*blocks, *(num_blocks + b for b in blocks)]


def describe_caches(caches: Sequence[torch.Tensor]) -> dict[str, Any]:
    """What a peer needs to write into these (registered) layer caches: this process's agent
    metadata and, per layer, the base address, device and memory type."""
    agent = _Agent.get()
    agent.register(caches)
    layers = []
    for cache in caches:
        device, mem = _mem_of(cache)
        layers.append({"base": cache.data_ptr(), "device": device, "mem": mem})
    return {
        "agent": agent.metadata(),
        "layers": layers,
        "num_blocks": caches[0].shape[1],
        "half_bytes": _half_bytes(caches[0]),
    }


def remote_pages(target: dict[str, Any]) -> tuple[str, list[Any]]:
    """The remote agent's name and a prepped page list per layer of `describe_caches`'s
    answer (loads the agent; `_Agent.drop_remote` unloads it)."""
    agent = _Agent.get()
    name = agent.add_remote(bytes(target["agent"]))
    half, n = int(target["half_bytes"]), int(target["num_blocks"])
    return name, [agent.prep(name, int(e["base"]), n, half, e) for e in target["layers"]]


def write_pages(
    caches: Any,
    remote: Any,
    remote_blocks: int,
    layers: Sequence[int],
    src: Sequence[int],
    dst: Sequence[int],
    notif: bytes = b"",
) -> list[Any]:
    """Post one WRITE per layer of pages `src` of `caches` into pages `dst` of `remote`;
    returns the handles (the raw baseline of `pdserve bench kv-transfer` times exactly this)."""
    agent = _Agent.get()
    handles = []
    for layer in layers:
        cache = caches[layer]
        try:
            handle = agent.agent.make_prepped_xfer(
                "WRITE",
                agent.local_pages(cache),
                _page_indices(src, cache.shape[1]),
                remote[layer],
                _page_indices(dst, remote_blocks),
                notif_msg=notif,
            )
            state = agent.agent.transfer(handle)
        except agent.errors as exc:
            raise TransferError(f"NIXL WRITE failed: {exc!r}") from None
        if state == "ERR":
            _release(handle)
            raise TransferError("NIXL WRITE failed to post")
        handles.append(handle)
    return handles


def _release(handle: Any) -> None:
    """Release a transfer handle (aborting it if still in flight); errors of a dead peer's
    handle are no news."""
    try:
        handle.release()
    except Exception:  # noqa: BLE001 - NIXL raises plain Exceptions
        pass


def _state(handle: Any) -> str:
    """A handle's state; a transport error reads as "ERR"."""
    agent = _Agent.get()
    try:
        return agent.agent.check_xfer_state(handle)
    except agent.errors:
        return "ERR"


def _finish(handle: Any, deadline: float, what: str) -> str:
    """Wait for a handle to leave the in-flight state, release it, return "DONE" or "ERR"
    (TransferTimeout past `deadline`, the handle kept for the caller to abort)."""
    state = _state(handle)
    while state == "PROC":
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{what} not done in time")
        time.sleep(_POLL_S)
        state = _state(handle)
    _release(handle)
    return state


def wait_handles(handles: Sequence[Any], timeout: float) -> None:
    """Until every handle is DONE (TransferError on ERR, TransferTimeout past `timeout`)."""
    deadline = time.monotonic() + timeout
    for handle in handles:
        state = _finish(handle, deadline, "NIXL WRITE")
        if state != "DONE":
            raise TransferError(f"NIXL WRITE failed ({state})")


# -- checksums ------------------------------------------------------------------------------------


_GATHER_BYTES = 64 << 20  # scattered pages are summed through gathers of at most this


def page_sums(cache: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
    """[len(blocks), 2] int64: the word sums (mod 2**64) of each block's K and V half in a
    [2, num_blocks, ...] layer cache. Runs of contiguous blocks are summed in place; blocks
    scattered across the cache are gathered in bounded chunks first. No sync (CUDA)."""
    if not blocks:
        return torch.zeros(0, 2, dtype=torch.int64, device=cache.device)
    words = _words(cache)  # [2, num_blocks, W]
    order = sorted(range(len(blocks)), key=blocks.__getitem__)
    ids = [blocks[i] for i in order]
    runs = _runs(ids)
    if len(runs) * 8 <= len(ids):  # mostly contiguous
        sums = torch.cat([words[:, b0 : b0 + n].sum(-1) for b0, n in runs], dim=1)
    else:
        index = torch.tensor(ids, device=cache.device)
        step = max(1, _GATHER_BYTES // (words.shape[2] * 16))
        sums = torch.cat(
            [words[:, index[i : i + step]].sum(-1) for i in range(0, len(ids), step)], dim=1
        )
    back = torch.empty_like(sums)
    back[:, order] = sums  # the caller's order
    return back.t()


def pages_digest(sums: dict[int, dict[int, tuple[int, int]]]) -> int:
    """The transfer checksum (`pdserve-nixl-pages/2`) of per-page sums, layer -> destination
    block -> (K sum, V sum): per layer and half, the plain sum and the sum weighted by each
    page's rank (1, 2, ...) among the layer's destination blocks, mod 2**64, hashed. A
    changed byte changes a plain sum (as in `page_checksum`); a page written to the wrong
    block or missing changes a weighted one or the count."""
    words: list[int] = []
    for layer in sorted(sums):
        pages = sums[layer]
        k_plain = v_plain = k_ranked = v_ranked = 0
        for rank, block in enumerate(sorted(pages), start=1):
            k, v = pages[block]
            k_plain, v_plain = k_plain + k, v_plain + v
            k_ranked, v_ranked = k_ranked + rank * k, v_ranked + rank * v
        words += [layer, len(pages), *(x & _MASK64 for x in (k_plain, v_plain, k_ranked, v_ranked))]
    return int.from_bytes(hashlib.blake2b(msgpack.packb(words), digest_size=8).digest(), "little")


def collect_sums(
    parts: Sequence[tuple[int, Sequence[int], torch.Tensor]],
) -> dict[int, dict[int, tuple[int, int]]]:
    """(layer, destination blocks, page_sums) in the order they were written -> the sums of
    each page's last write."""
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for layer, dsts, part in parts:
        pages = out.setdefault(layer, {})
        for dst, (k, v) in zip(dsts, part.tolist(), strict=True):
            pages[dst] = (k & _MASK64, v & _MASK64)
    return out


def _words(cache: torch.Tensor) -> torch.Tensor:
    """A [2, num_blocks, ...] layer cache as [2, num_blocks, W] int64 words (a copy only when
    a block's bytes are not a whole number of words)."""
    raw = cache.reshape(2, cache.shape[1], -1).view(torch.uint8)
    if raw.shape[2] % 8:
        return raw.to(torch.int64)
    return raw.view(torch.int64)


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first block, length) of each run of consecutive ids in a sorted list."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((ids[start], i - start))
            start = i
    return runs


# -- sender ---------------------------------------------------------------------------------------


@dataclass
class _Outbound:
    """One transfer on the sender: WRITEs in flight, pages written, what went wrong."""

    handles: list[tuple[int, Any]] = field(default_factory=list)  # (layer, xfer handle)
    # (layer, destination blocks, page_sums of their source pages), in the order written
    sums: list[tuple[int, list[int], torch.Tensor]] = field(default_factory=list)
    writes: int = 0  # WRITEs posted (each notifies the receiver when its data is in)
    problems: list[str] = field(default_factory=list)
    unannounced: bool = False  # waited for the receiver's announcement in vain


class NixlSender(ChannelSender):
    """Prefill side: WRITEs from this process's cache into the receiver's reserved blocks.
    Option `send_timeout` (s) bounds every wait: for a WRITE to finish, for the receiver's
    announcement of a transfer."""

    CONNECTOR: ClassVar[str] = "nixl"

    def __init__(
        self,
        layout: KVLayout,
        send_timeout: float = 30.0,
        curve: CurveKeys | None = None,
        announce_timeout: float = 5.0,
    ) -> None:
        super().__init__(layout, send_timeout, curve)
        self._announce_timeout = announce_timeout
        self._agent = _Agent.get()
        self._remote = ""
        self._remote_pages: dict[int, Any] = {}  # layer -> prepped list of the receiver's
        self._remote_blocks = 0
        self._caches: dict[int, torch.Tensor] = {}  # layer -> our cache, as sent from
        self._expected: dict[str, frozenset[int]] = {}  # announced by the receiver
        self._cancelled: dict[str, None] = {}  # insertion-ordered, bounded
        self._out: dict[str, _Outbound] = {}
        self._refused = ""  # the receiver dropped us: the next send fails, we reconnect

    # -- handshake

    def _on_welcome(self, extra: dict[str, Any], timeout: float) -> None:
        check_welcome(extra, self._endpoint)
        if extra.get("pages") != NIXL_CHECKSUM:
            raise TransferError(f"{self._endpoint} checks pages with {extra.get('pages')!r}")
        try:
            layers = list(extra["layers"])
            if len(layers) != self.layout.num_layers:
                raise ValueError(f"{len(layers)} layers offered")
            self._remote_blocks = int(extra["num_blocks"])
            if int(extra["half_bytes"]) * 2 != self.layout.page_bytes:
                raise ValueError(f"pages of {2 * int(extra['half_bytes'])} bytes")
            self._remote, pages = remote_pages(extra)
            self._remote_pages = dict(enumerate(pages))
        except (KeyError, TypeError, ValueError, RuntimeError, *self._agent.errors) as exc:
            raise TransferError(f"bad nixl welcome from {self._endpoint}: {exc!r}") from None

    # -- messages from the receiver

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, KVExpect):
            if msg.xfer_id not in self._cancelled:
                self._expected[msg.xfer_id] = frozenset(msg.block_ids)
                # Every reservation is announced to every sender, most of them for other
                # prefill nodes: keep the newest (a request waits here far less than this).
                while len(self._expected) > _ANNOUNCED_KEPT:
                    del self._expected[next(iter(self._expected))]
        elif isinstance(msg, KVCancel):
            self._stop(msg.xfer_id)
        elif isinstance(msg, KVRefused):
            self._refused = msg.reason

    def poll(self) -> None:
        """Take the receiver's messages now: announcements, and cancels, answered at once."""
        sock = self._sock
        while sock is not None and sock.poll(0):
            try:
                msg = decode(sock.recv())
            except ProtocolError:
                continue
            self._on_message(msg)

    def _stop(self, xfer_id: str) -> None:
        """Never write the transfer again; once its WRITEs are done, say so."""
        self._cancelled[xfer_id] = None
        while len(self._cancelled) > 4096:  # the receiver never reuses an id
            del self._cancelled[next(iter(self._cancelled))]
        self._expected.pop(xfer_id, None)
        out = self._out.pop(xfer_id, None)
        if out is not None:
            self._settle(out)
        self._send(KVSettled(xfer_id))

    # -- sending

    def send_layer(
        self,
        xfer_id: str,
        layer: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        layer_cache: torch.Tensor,
    ) -> None:
        self._check_send_args(layer, src_block_ids, dst_block_ids, layer_cache)
        self._caches[layer] = layer_cache
        self.poll()
        if self._refused:
            raise TransferError(f"{self._endpoint} dropped this sender: {self._refused}")
        if xfer_id in self._cancelled or not src_block_ids:
            return
        out = self._out.setdefault(xfer_id, _Outbound())
        allowed = self._announced(xfer_id)
        if allowed is None:  # cancelled meanwhile, or never announced
            if xfer_id not in self._cancelled:
                out.problems.append("the receiver never announced this transfer")
            return
        outside = sorted(set(dst_block_ids) - allowed)
        if outside:
            out.problems.append(f"layer {layer}: blocks {outside[:8]} are outside the reservation")
            return
        if self.faults is not None and self.faults.drop(xfer_id):
            # Booked, never written: the receiver's checksum catches it.
            out.sums.append((layer, dst_block_ids, page_sums(layer_cache, src_block_ids)))
            return
        # A page sent again (a last block that a later chunk completed) must not race its
        # earlier WRITE: this layer's earlier WRITEs of the transfer finish first.
        self._wait(out, time.monotonic() + self._send_timeout, layer)
        restore = self._fault_corrupt(xfer_id, layer_cache, src_block_ids[0])
        try:
            (handle,) = write_pages(
                self._caches,
                self._remote_pages,
                self._remote_blocks,
                [layer],
                src_block_ids,
                dst_block_ids,
                notif=msgpack.packb([xfer_id, layer, dst_block_ids]),
            )
        except TransferError as exc:
            if restore is not None:
                restore()
            raise TransferError(f"NIXL WRITE to {self._endpoint}: {exc}") from None
        out.handles.append((layer, handle))
        out.writes += 1
        if restore is not None:  # test hook: the page goes out damaged, stays clean here
            self._wait(out, time.monotonic() + self._send_timeout, layer)
            restore()
        # The pages' sums, read while the WRITE runs (the receiver sums what lands).
        out.sums.append((layer, dst_block_ids, page_sums(layer_cache, src_block_ids)))

    def send_done(self, xfer_id: str, meta: dict[str, Any]) -> None:
        self._require_connected()
        self.poll()
        if xfer_id in self._cancelled:
            return  # the receiver cancelled it and was told it settled
        out = self._out.pop(xfer_id, None) or _Outbound()
        self._expected.pop(xfer_id, None)
        self._settle(out)
        done_meta = dict(meta)
        if out.problems:
            done_meta["kv_error"] = "; ".join(out.problems)
        sums = collect_sums(out.sums)
        done_meta["kv_blocks"] = sorted({dst for pages in sums.values() for dst in pages})
        done_meta["kv_writes"] = out.writes
        per_layer = tuple(len(sums.get(i, {})) for i in range(self.layout.num_layers))
        checksum = pages_digest(sums) if sums else 0
        self._send(KVDone(xfer_id, done_meta, checksum, per_layer, NIXL_CHECKSUM))

    def abandon(self, xfer_id: str) -> None:
        """The prefill node dropped the transfer: its WRITEs finish, the receiver hears."""
        if self._sock is not None and xfer_id not in self._cancelled:
            self._stop(xfer_id)

    def flush(self, timeout: float = 10.0) -> None:
        self._require_connected()
        deadline = time.monotonic() + timeout
        for out in self._out.values():
            self._wait(out, deadline)

    def close(self) -> None:
        for out in self._out.values():
            try:
                self._settle(out)
            except TransferError:
                pass
        self._out.clear()
        if self._remote:
            self._agent.drop_remote(self._remote)
            self._remote = ""
        super().close()

    # -- helpers

    def _announced(self, xfer_id: str) -> frozenset[int] | None:
        """The receiver's blocks for the transfer, waiting (bounded) for its announcement
        (it normally arrives before the router's request does); None if it never came."""
        out = self._out[xfer_id]
        if out.unannounced:
            return None
        deadline = time.monotonic() + self._announce_timeout
        while xfer_id not in self._expected:
            if xfer_id in self._cancelled:
                return None
            if time.monotonic() >= deadline:
                out.unannounced = True
                return None
            assert self._sock is not None
            if self._sock.poll(10):
                self.poll()
        return self._expected[xfer_id]

    def _wait(self, out: _Outbound, deadline: float, layer: int | None = None) -> None:
        """WRITEs of `out` (of one layer, or all) out of flight; failures become problems."""
        keep = []
        for lay, handle in out.handles:
            if layer is not None and lay != layer:
                keep.append((lay, handle))
                continue
            state = _finish(handle, deadline, f"NIXL WRITE to {self._endpoint}")
            if state != "DONE":
                out.problems.append(f"layer {lay}: NIXL WRITE failed ({state})")
        out.handles = keep

    def _settle(self, out: _Outbound) -> None:
        """Every WRITE of the transfer finished, or was aborted: its source pages are free."""
        try:
            self._wait(out, time.monotonic() + self._send_timeout)
        finally:
            for _, handle in out.handles:  # timed out: release aborts the rest
                _release(handle)
            out.handles.clear()

    def _fault_corrupt(self, xfer_id: str, cache: torch.Tensor, block: int) -> Any:
        """Under a test's faults only: damage a source page for the WRITE to carry; returns how
        to undo it once the WRITE is done (the checksum reads the clean page)."""
        if self.faults is None or not self.faults.corrupt(xfer_id):
            return None
        page = cache[0, block]
        corrupt_first_byte(page)
        return lambda: corrupt_first_byte(page)  # xor twice: the original byte


class _Progress:
    """A receiver's progress: UCX moves a large WRITE only while the target's worker is
    progressed, which reading notifications does. A daemon thread does it every half
    millisecond while a transfer is live (every 5 ms when idle), whatever the decode loop is
    busy with, and keeps what it read."""

    def __init__(self, agent: _Agent) -> None:
        self._agent = agent
        self.busy = False  # a transfer may be writing: read every half ms, else every 5 ms
        self._got: deque[bytes] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nixl-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.0005 if self.busy else 0.005):
            try:
                notifs = self._agent.agent.get_new_notifs()
            except self._agent.errors:
                continue
            for messages in notifs.values():
                self._got.extend(messages)

    def take(self) -> list[bytes]:
        out = []
        while self._got:
            out.append(self._got.popleft())
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


# -- receiver -------------------------------------------------------------------------------------


@dataclass
class _Fence:
    """A cancelled transfer's blocks: writes may still land until every sender settled."""

    waiting: set[bytes]  # peers that have not answered
    deadline: float


class NixlReceiver(ChannelReceiver):
    """Decode side: registers the cache with this process's agent, announces reservations,
    fences cancelled ones, and checks each finished transfer's pages before admitting it.
    Option `fence_timeout` (s): how long a cancelled transfer's blocks wait for senders that
    do not answer."""

    CONNECTOR: ClassVar[str] = "nixl"
    fences: ClassVar[bool] = True

    def __init__(
        self,
        layout: KVLayout,
        kv_caches: list[torch.Tensor],
        host: str = "127.0.0.1",
        port: int = 0,
        curve: CurveKeys | None = None,
        fence_timeout: float = 30.0,
    ) -> None:
        super().__init__(layout, kv_caches, host, port, curve=curve)
        self._agent = _Agent.get()
        self._agent.register(kv_caches)
        self._fence_timeout = fence_timeout
        self._reserved: dict[str, tuple[int, ...]] = {}  # live transfers, blocks in order
        self._fences: dict[str, _Fence] = {}
        self._fenced_blocks: dict[str, frozenset[int]] = {}
        self._waiting_done: dict[str, tuple[KVDone, float]] = {}  # done, with its deadline
        self._released: list[str] = []
        # Per live transfer: page sums of each WRITE whose data is in (its notification came),
        # in arrival order, read while later layers still travel.
        self._landed: dict[str, list[tuple[int, list[int], torch.Tensor]]] = {}
        self._progress_thread = _Progress(self._agent)

    # -- public API

    def expect(self, xfer_id: str, block_ids: list[int]) -> None:
        super().expect(xfer_id, block_ids)
        self._reserved[xfer_id] = tuple(block_ids)
        self._progress_thread.busy = True
        self._broadcast(KVExpect(xfer_id, tuple(block_ids)))

    def cancel(self, xfer_id: str) -> None:
        blocks = self._reserved.pop(xfer_id, None)
        self._book.cancel(xfer_id)
        self._waiting_done.pop(xfer_id, None)
        self._landed.pop(xfer_id, None)
        if blocks is None:
            return
        peers = set(self._peers)
        if not peers:
            self._released.append(xfer_id)
            return
        self._fences[xfer_id] = _Fence(peers, time.monotonic() + self._fence_timeout)
        self._fenced_blocks[xfer_id] = frozenset(blocks)
        self._broadcast(KVCancel(xfer_id))

    def released(self) -> list[str]:
        """Cancelled transfers whose blocks no write can reach any more, since the last call:
        the decode node may free them now."""
        out, self._released = self._released, []
        return out

    # -- handshake

    def _accept_peer(self, peer: Peer) -> dict[str, Any]:
        return welcome_extra(**describe_caches(self.kv_caches), pages=NIXL_CHECKSUM)

    def _after_welcome(self, peer: Peer) -> None:
        for xfer_id, blocks in self._reserved.items():  # reservations made before it came
            self._reply(peer.identity, KVExpect(xfer_id, blocks))

    # -- messages

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        msg = None
        if len(frames) == 2 and identity in self._peers:
            try:
                msg = decode(frames[1].bytes)
            except ProtocolError:
                msg = None
        elif len(frames) == 2:
            try:
                if isinstance(decode(frames[1].bytes), KVHello):
                    super()._handle(frames)
                    return
            except ProtocolError:
                pass
        if isinstance(msg, KVSettled):
            self._settled(msg.xfer_id, identity)
        elif isinstance(msg, KVDone):
            self._settled(msg.xfer_id, identity, done=True)
            self._on_done(msg)
        else:
            if len(frames) == 2 and identity not in self._peers:
                # A sender dropped after a fence timeout (or never welcomed): tell it to
                # handshake again rather than let it wait for announcements.
                self._reply(identity, KVRefused("handshake", "not connected: handshake again"))
            super()._handle(frames)

    def _settled(self, xfer_id: str, identity: bytes, done: bool = False) -> None:
        fence = self._fences.get(xfer_id)
        if fence is None:
            return
        fence.waiting.discard(identity)
        if done or not fence.waiting:  # the writer finished, or every sender answered
            self._lift(xfer_id)

    def _lift(self, xfer_id: str) -> None:
        del self._fences[xfer_id]
        del self._fenced_blocks[xfer_id]
        self._released.append(xfer_id)

    def _on_done(self, done: KVDone) -> None:
        if done.xfer_id not in self._reserved:
            self._book.on_done(done)  # not live: counted as late or unknown, nothing else
            return
        # Notifications of the last WRITEs may still be on their way (the bytes are in: the
        # sender saw every WRITE done); wait for them briefly, else sum the pages here.
        self._waiting_done[done.xfer_id] = (done, time.monotonic() + _NOTIF_GRACE_S)
        self._progress()

    def _progress(self) -> None:
        now = time.monotonic()
        for xfer_id, fence in list(self._fences.items()):
            if now >= fence.deadline:  # senders silent that long must handshake again
                for identity in fence.waiting:
                    peer = self._peers.pop(identity, None)
                    if peer is not None:
                        self._drop_peer(peer)
                self._book.counters["fence_timeout"] += 1
                log.warning("nixl: senders did not settle transfer %s in time", xfer_id)
                self._lift(xfer_id)
        self._take_notifications()
        fenced = frozenset().union(*self._fenced_blocks.values()) if self._fences else frozenset()
        for xfer_id, (done, deadline) in list(self._waiting_done.items()):
            if fenced and fenced & set(self._reserved[xfer_id]):
                continue  # an older transfer into these blocks may still write: wait
            landed = self._landed.get(xfer_id, [])
            writes = done.meta.get("kv_writes")
            if isinstance(writes, int) and len(landed) < writes and now < deadline:
                continue
            del self._waiting_done[xfer_id]
            blocks = self._reserved.pop(xfer_id)
            self._landed.pop(xfer_id, None)
            if not isinstance(writes, int) or len(landed) != writes:
                landed = []  # not every WRITE was seen landing: sum every page here
            self._book.cancel(xfer_id)  # finished: later messages for it are refused
            self._completed.append(self._check(done, blocks, landed))
        self._progress_thread.busy = self._busy()

    def _take_notifications(self) -> None:
        """Sum the pages of every WRITE whose data arrived (NIXL notifies after the data)."""
        for raw in self._progress_thread.take():
            try:
                xfer_id, layer, dsts = msgpack.unpackb(raw)
            except (ValueError, TypeError, msgpack.ExtraData):
                self._book.counters["bad_notification"] += 1
                continue
            parts = self._landed.get(xfer_id) if xfer_id in self._reserved else None
            valid = (
                isinstance(layer, int)
                and 0 <= layer < self.layout.num_layers
                and isinstance(dsts, list)
                and set(dsts) <= set(self._reserved.get(xfer_id, ()))
            )
            if xfer_id not in self._reserved:
                self._book.counters["late_notification"] += 1  # finished or cancelled
                continue
            if not valid:
                self._book.counters["bad_notification"] += 1
                continue
            if parts is None:
                parts = self._landed[xfer_id] = []
            parts.append((layer, dsts, page_sums(self.kv_caches[layer], dsts)))
            self._book.pages_received += len(dsts)

    def _busy(self) -> bool:
        return bool(self._fences or self._waiting_done or self._reserved)

    def _check(
        self,
        done: KVDone,
        reserved: tuple[int, ...],
        landed: Sequence[tuple[int, Sequence[int], torch.Tensor]],
    ) -> TransferResult:
        """The transfer's result: ok only if the sender wrote each of its pages into the
        reservation and the pages here sum as the sender's did (pages not summed on
        arrival are summed now)."""
        meta = {k: v for k, v in done.meta.items() if not k.startswith("kv_")}
        error = done.meta.get("kv_error", "")
        blocks = done.meta.get("kv_blocks")
        if not error and done.checksum_scheme != NIXL_CHECKSUM:
            error = f"pages checked with {done.checksum_scheme!r}, not {NIXL_CHECKSUM!r}"
        if not error and (not isinstance(blocks, list) or not set(blocks) <= set(reserved)):
            error = "the sender wrote blocks outside the reservation"
        if not error:
            for layer, n in enumerate(done.pages_per_layer):
                if n != len(blocks):
                    error = f"layer {layer}: {n} pages written of {len(blocks)}"
                    break
        if not error:
            sums = collect_sums(landed)
            for layer in range(self.layout.num_layers):
                pages = sums.setdefault(layer, {})
                missing = [b for b in blocks if b not in pages]
                if missing:
                    sums[layer].update(
                        collect_sums([(layer, missing, page_sums(self.kv_caches[layer], missing))])[
                            layer
                        ]
                    )
                for extra in set(pages) - set(blocks):
                    del pages[extra]
            if pages_digest(sums) != done.checksum:
                error = "checksum of the written pages does not match the sender's"
        return TransferResult(done.xfer_id, meta, not error, error)

    def _broadcast(self, msg: Message) -> None:
        for identity in self._peers:
            self._reply(identity, msg)

    def _on_page_data(self, peer: Peer, page: Any, frames: list[Any], admitted: bool) -> None:
        # Pages never come through the side channel here.
        self._book.counters["unexpected_message"] += 1

    def close(self) -> None:
        self._progress_thread.stop()
        self._released.extend(self._fences)
        self._fences.clear()
        self._fenced_blocks.clear()
        super().close()
        if self.kv_caches:
            self._agent.deregister(self.kv_caches)
            self.kv_caches = []

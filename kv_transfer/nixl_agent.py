"""The process's NIXL agent (`Agent`, one per process: registers the KV caches once), NIXL's
import, and WRITEs of pages described from both sides (see `nixl_connector`)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from pdserve.kv_transfer.base import TransferError, TransferTimeout

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pdserve[nixl]'"
# Python packages that ship NIXL's bindings, in order of preference (nixl-cu12 on PyPI).
_NIXL_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")
POLL_S = 0.0005  # how often a wait on WRITE handles looks again


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


class Agent:
    """This process's NIXL agent and the cache tensors it registered (once each)."""

    _instance: ClassVar[Agent | None] = None
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
        # own calls; receivers have `Notifications`, a thread that reads notifications every
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
        self.notifications = Notifications(self)

    @classmethod
    def get(cls) -> Agent:
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

    def add_remote(self, metadata: bytes, name: str) -> str:
        """Load agent `name` from its metadata (counted). Loaded again on every welcome: the
        remote process may have registered caches since (a new receiver there, one agent per
        process), and descriptors of memory its old metadata lacks are not found. This
        process's own agent (a prefill and a decode rank in one process, as in tests) is its
        own loopback target."""
        if name != self.name:
            loaded = self.agent.add_remote_agent(metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != name:
                raise ValueError(f"NIXL agent metadata of {loaded!r}, announced as {name!r}")
        self._remotes[name] = self._remotes.get(name, 0) + 1
        return name

    def drop_remote(self, name: str) -> None:
        left = self._remotes.get(name, 0) - 1
        if left > 0:
            self._remotes[name] = left
            return
        self._remotes.pop(name, None)
        if name == self.name:
            return
        try:
            self.agent.remove_remote_agent(name)
        except Exception:  # already gone with the peer; nothing to release
            pass

    def local_pages(self, cache: torch.Tensor) -> Any:
        """The prepped list of a local layer cache's pages: index plane * num_blocks + block."""
        # A cache freed and another of other heads made at its address needs another list.
        key = (cache.data_ptr(), cache.shape[0], cache.shape[1], _plane_bytes(cache))
        pages = self._local_lists.get(key)
        if pages is None:
            self.register([cache])
            pages = self.prep("NIXL_INIT_AGENT", cache.data_ptr(), key[1:], cache)
            self._local_lists[key] = pages
        return pages

    def prep(self, agent: str, base: int, geometry: tuple[int, int, int], like: Any) -> Any:
        """Prep the planes * num_blocks plane pages (K's then V's; or the latent's) of a layer
        cache at `base`; `geometry` is (planes, num_blocks, bytes of one block's plane)."""
        import numpy as np

        planes, num_blocks, size = geometry
        device, mem = _mem_of(like)
        starts = base + np.arange(planes * num_blocks, dtype=np.uint64) * np.uint64(size)
        descs = np.stack([starts, np.full_like(starts, size), np.full_like(starts, device)], axis=1)
        return self.agent.prep_xfer_dlist(agent, descs, mem)


@dataclass(eq=False)
class Inbox:
    """A receiver's copy of its process's NIXL notifications; `busy` while a transfer into it
    may be writing."""

    got: deque[bytes] = field(default_factory=deque)
    busy: bool = False

    def take(self) -> list[bytes]:
        out = []
        while self.got:
            out.append(self.got.popleft())
        return out


class Notifications:
    """An agent's notifications, read by one daemon thread and copied into every subscribed
    receiver's `Inbox`: NIXL hands a notification to whoever reads first, so receivers that
    share their process's agent must not each read (one took the other's). Reading also
    progresses UCX, which moves a large WRITE into this process only then: every half
    millisecond while an inbox is busy, every 5 ms when idle, whatever the receivers' loops
    are busy with."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._inboxes: tuple[Inbox, ...] = ()  # replaced, never changed: the thread reads it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def subscribe(self) -> Inbox:
        inbox = Inbox()
        with self._lock:
            self._inboxes = (*self._inboxes, inbox)
            if self._thread is None:  # the first receiver of the process starts the reader
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._stop,), name="nixl-progress", daemon=True
                )
                self._thread.start()
        return inbox

    def unsubscribe(self, inbox: Inbox) -> None:
        with self._lock:
            self._inboxes = tuple(i for i in self._inboxes if i is not inbox)
            thread = self._thread
            if self._inboxes or thread is None:
                return
            self._thread = None  # the last one stops it
            self._stop.set()
        thread.join(timeout=2.0)

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(0.0005 if any(i.busy for i in self._inboxes) else 0.005):
            try:
                notifs = self._agent.agent.get_new_notifs()
            except self._agent.errors:
                continue
            got = [message for messages in notifs.values() for message in messages]
            if got:
                for inbox in self._inboxes:
                    inbox.got.extend(got)


def _plane_bytes(cache: torch.Tensor) -> int:
    """Bytes of one block's plane (its K or V half; or its latent, MLA's one plane) in a
    [planes, num_blocks, bs, H, D] layer cache."""
    return cache[0, 0].numel() * cache.element_size()


def _mem_of(like: Any) -> tuple[int, str]:
    """(device id, NIXL memory type) of a tensor, or of a welcome's layer entry."""
    if isinstance(like, torch.Tensor):
        return (like.device.index or 0, "VRAM") if like.is_cuda else (0, "DRAM")
    return int(like["device"]), str(like["mem"])


def _page_indices(blocks: Sequence[int], num_blocks: int, planes: int) -> list[int]:
    """Indices into a prepped layer list of every plane (K and V; or the latent) of `blocks`."""
    return [plane * num_blocks + b for plane in range(planes) for b in blocks]


def describe_caches(caches: Sequence[torch.Tensor]) -> dict[str, Any]:
    """What a peer needs to write into these (registered) layer caches: this process's agent
    metadata and name and, per layer, the base address, device and memory type."""
    agent = Agent.get()
    agent.register(caches)
    layers = []
    for cache in caches:
        device, mem = _mem_of(cache)
        layers.append({"base": cache.data_ptr(), "device": device, "mem": mem})
    return {
        "agent": agent.metadata(),
        "name": agent.name,
        "layers": layers,
        "planes": caches[0].shape[0],
        "num_blocks": caches[0].shape[1],
        "half_bytes": _plane_bytes(caches[0]),  # one plane's bytes (the name predates MLA)
    }


def remote_pages(target: dict[str, Any]) -> tuple[str, list[Any]]:
    """The remote agent's name and a prepped page list per layer of `describe_caches`'s
    answer (loads the agent; `Agent.drop_remote` unloads it)."""
    agent = Agent.get()
    name = agent.add_remote(bytes(target["agent"]), str(target["name"]))
    geometry = int(target["planes"]), int(target["num_blocks"]), int(target["half_bytes"])
    return name, [agent.prep(name, int(e["base"]), geometry, e) for e in target["layers"]]


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
    agent = Agent.get()
    handles = []
    for layer in layers:
        cache = caches[layer]
        planes = cache.shape[0]
        src_pages = _page_indices(src, cache.shape[1], planes)
        dst_pages = _page_indices(dst, remote_blocks, planes)
        local = agent.local_pages(cache)
        make = agent.agent.make_prepped_xfer
        handles.append(_post(make, "WRITE", local, src_pages, remote[layer], dst_pages, notif))
    return handles


@dataclass(frozen=True, slots=True)
class Rows:
    """A layer cache [planes, num_blocks, block_size, heads, head_dim] as token rows: where it
    lies (`base`, `device`, NIXL memory type `mem`), its geometry, and one head's bytes of a
    token. A range of heads is contiguous within a token's row only, so a slice of a block's
    heads is one descriptor per (plane, block, token)."""

    base: int
    device: int
    mem: str
    num_blocks: int
    block_size: int
    heads: int
    head_bytes: int
    planes: int = 2

    @classmethod
    def of(cls, cache: torch.Tensor) -> Rows:
        device, mem = _mem_of(cache)
        planes, num_blocks, block_size, heads, head_dim = cache.shape
        head_bytes = head_dim * cache.element_size()
        return cls(cache.data_ptr(), device, mem, num_blocks, block_size, heads, head_bytes, planes)

    def descs(self, blocks: Sequence[int], heads: range) -> Any:
        """Nx3 (address, bytes, device) of `heads` of every token of `blocks`, plane by plane."""
        import numpy as np

        u64 = np.uint64
        kv = np.arange(self.planes, dtype=u64)[:, None, None] * u64(self.num_blocks)
        b = np.asarray(blocks, dtype=u64)[None, :, None]
        t = np.arange(self.block_size, dtype=u64)[None, None, :]
        row = u64(self.heads * self.head_bytes)
        first = u64(self.base + heads.start * self.head_bytes)
        starts = (first + ((kv + b) * u64(self.block_size) + t) * row).reshape(-1)
        size = np.full_like(starts, len(heads) * self.head_bytes)
        return np.stack([starts, size, np.full_like(starts, self.device)], axis=1)


def remote_rows(target: dict[str, Any], heads: int, block_size: int, head_bytes: int) -> list[Rows]:
    """Each layer cache of a receiver's `describe_caches` answer as `Rows`, its blocks holding
    `heads` KV heads."""
    n, planes = int(target["num_blocks"]), int(target["planes"])
    geometry = n, block_size, heads, head_bytes, planes
    return [Rows(int(e["base"]), *_mem_of(e), *geometry) for e in target["layers"]]


def write_rows(
    cache: torch.Tensor,
    src: Sequence[int],
    src_heads: range,
    remote: tuple[str, Rows],
    dst: Sequence[int],
    dst_heads: range,
    notif: bytes,
) -> Any:
    """Post one WRITE of heads `src_heads` of pages `src` of a local layer cache into heads
    `dst_heads` of pages `dst` of the remote agent's layer cache (`remote`: its name and
    rows); returns its handle."""
    agent = Agent.get()
    agent.register([cache])
    local, (name, target) = Rows.of(cache), remote
    mine = agent.agent.get_xfer_descs(local.descs(src, src_heads), local.mem)
    theirs = agent.agent.get_xfer_descs(target.descs(dst, dst_heads), target.mem)
    return _post(agent.agent.initialize_xfer, "WRITE", mine, theirs, name, notif)


def _post(make: Callable[..., Any], *args: Any) -> Any:
    """Make a WRITE (`make(*args)`) and post it; TransferError when NIXL refuses either."""
    agent = Agent.get()
    try:
        handle = make(*args)
        state = agent.agent.transfer(handle)
    except agent.errors as exc:
        raise TransferError(f"NIXL WRITE failed: {exc!r}") from None
    if state == "ERR":
        release_handle(handle)
        raise TransferError("NIXL WRITE failed to post")
    return handle


def release_handle(handle: Any) -> None:
    """Release a transfer handle (aborting it if still in flight); errors of a dead peer's
    handle are no news."""
    try:
        handle.release()
    except Exception:  # noqa: BLE001 - NIXL raises plain Exceptions
        pass


def _state(handle: Any) -> str:
    """A handle's state; a transport error reads as "ERR"."""
    agent = Agent.get()
    try:
        return agent.agent.check_xfer_state(handle)
    except agent.errors:
        return "ERR"


def finish_handle(handle: Any, deadline: float, what: str) -> str:
    """Wait for a handle to leave the in-flight state, release it, return "DONE" or "ERR"
    (TransferTimeout past `deadline`, the handle kept for the caller to abort)."""
    state = _state(handle)
    while state == "PROC":
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{what} not done in time")
        time.sleep(POLL_S)
        state = _state(handle)
    release_handle(handle)
    return state


def wait_handles(handles: Sequence[Any], timeout: float) -> None:
    """Until every handle is DONE (TransferError on ERR, TransferTimeout past `timeout`)."""
    deadline = time.monotonic() + timeout
    for handle in handles:
        state = finish_handle(handle, deadline, "NIXL WRITE")
        if state != "DONE":
            raise TransferError(f"NIXL WRITE failed ({state})")

"""KV-transfer faults for tests and fault-injection runs: frames dropped, corrupted or delayed.

A sender has a `faults` attribute (`kv_transfer.wire.SendFaults`), None in production. A test
in the same process sets it (`sender.faults = PlannedFaults(FaultPlan.parse("drop=1"))`). For
node processes, `child_env(plan)` gives the environment that installs the plan in every sender
they make: `site/sitecustomize.py` (on PYTHONPATH) calls `install_from_env`, which gives each
`ChannelSender` built in that process its own seeded `PlannedFaults`. Production code reads
none of this.

Plans: `"drop=0.02,corrupt=0.02,delay=0.1,delay_s=0.05,seed=1"` (probabilities per frame, or
per layer WRITE on nixl) and `"targets=a;b"` (corrupt every frame of those transfer ids,
`targets=*` all of them).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

PLAN_ENV = "PDSERVE_FAULT_KV"
SITE_DIR = Path(__file__).with_name("site")
_CHANNEL = "pdserve.kv_transfer.channel"


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """What happens to each frame a sender ships: dropped (booked in the done message, never
    sent), corrupted after its checksum, delayed by `delay_s` first, with these probabilities
    from a stream seeded by `seed`; frames of transfer ids in `targets` are always corrupted."""

    drop: float = 0.0
    corrupt: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.05
    seed: int = 0
    targets: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """ValueError naming the item when `text` is not `key=value,...` of the fields."""
        fields: dict[str, Any] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep or key not in cls.__dataclass_fields__:
                raise ValueError(f"bad fault plan item {item!r} in {text!r}")
            if key == "targets":
                fields[key] = frozenset(value.split(";"))
            else:
                fields[key] = int(value) if key == "seed" else float(value)
        return cls(**fields)


class PlannedFaults:
    """One sender's faults (`kv_transfer.wire.SendFaults`) drawn from a plan's seeded stream."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed)

    def drop(self, xfer_id: str) -> bool:
        if self._rng.random() < self.plan.delay:
            time.sleep(self.plan.delay_s)
        return self._rng.random() < self.plan.drop

    def corrupt(self, xfer_id: str) -> bool:
        if {"*", xfer_id} & self.plan.targets:
            return True
        return self._rng.random() < self.plan.corrupt


def child_env(plan: str | None) -> dict[str, str | None]:
    """Environment changes that install `plan` in the senders of child processes (None: none)."""
    if not plan:
        return {PLAN_ENV: None}
    FaultPlan.parse(plan)  # refuse a bad plan here, not in every child
    path = os.pathsep.join(p for p in (str(SITE_DIR), os.environ.get("PYTHONPATH")) if p)
    return {PLAN_ENV: plan, "PYTHONPATH": path}


def install(plan: FaultPlan, channel: ModuleType) -> None:
    """Give every sender that `channel` (kv_transfer.channel) builds from now on this plan."""
    sender_cls = channel.ChannelSender
    init = sender_cls.__init__

    def init_with_faults(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.faults = PlannedFaults(plan)

    sender_cls.__init__ = init_with_faults


def install_from_env() -> None:
    """Called by `site/sitecustomize.py` at interpreter start: install the plan of PLAN_ENV,
    if any, as soon as the connectors' base module is imported (it pulls in torch, so a process
    that never sends KV, such as a router, never imports it for this)."""
    text = os.environ.get(PLAN_ENV)
    if not text:
        return
    plan = FaultPlan.parse(text)
    if _CHANNEL in sys.modules:
        install(plan, sys.modules[_CHANNEL])
    else:
        sys.meta_path.insert(0, _AfterImport(_CHANNEL, lambda module: install(plan, module)))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` right after module `name` has executed, once."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, then = spec.loader, self.then

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                then(module)

        spec.loader = Loader()
        return spec

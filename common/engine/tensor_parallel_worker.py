"""A worker rank of a tensor-parallel node (`pdserve tp-worker`, or spawned by rank 0's
`RankDriver` on the same host): it joins rank 0's rendezvous, reads its `WorkerSpec` there,
builds its model runner and its agent, then follows rank 0: each `Step` runs the forward with
the other ranks; each command goes to its agent (`common.wire.ranks.answer`). A node that
traces has each worker export a span of its part of every step that runs a traced request
(`tp.forward`, under the node span `Step.traces` names)."""

from __future__ import annotations

import argparse
import datetime
import importlib
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.tensor_parallel import (
    CALL,
    STEP,
    STEPS,
    STOP,
    Step,
    StepChannel,
    WorkerSpec,
    open_group,
    spec_key,
    threads_per_rank,
)
from pdserve.common.model.parallel import TPGroup, TPShard
from pdserve.common.node.cli import parser
from pdserve.common.tracing import Tracer, TracingConfig, tracer_of
from pdserve.common.wire.ranks import answer

_LEADER_WAIT_S = 600.0  # a worker waits this long for rank 0's rendezvous and its spec


def worker_parser() -> argparse.ArgumentParser:
    p = parser(
        "pdserve tp-worker",
        "One worker rank (1..N-1) of a tensor-parallel node whose rank 0 runs elsewhere\n"
        "(`--tp-workers external`): it joins rank 0's rendezvous, reads its settings there,\n"
        "loads its shard of the model and runs every step rank 0 sends.",
    )
    p.add_argument("--leader", required=True, metavar="HOST:PORT", help="rank 0's --tp-port")
    p.add_argument("--rank", required=True, type=int, help="this worker's rank, 1..N-1")
    p.add_argument(
        "--host", default=None, help="bind this rank's KV receiver here (default: rank 0's --host)"
    )
    p.add_argument(
        "--advertise-host",
        default=None,
        help="the address other hosts reach this rank's KV receiver at (default: rank 0's)",
    )
    return p


def worker_main(argv: list[str] | None = None) -> None:
    """A worker rank: join the group, load this rank's shard, then follow rank 0's steps
    until STOP or until the group breaks."""
    args = worker_parser().parse_args(argv)
    # A stop is rank 0's to decide: it drains, then sends STOP (or the group breaks when it
    # exits). A SIGTERM or Ctrl-C sent to the whole group must not cut its drain short.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    host, _, port = args.leader.rpartition(":")
    wait = datetime.timedelta(seconds=_LEADER_WAIT_S)
    store = dist.TCPStore(host.strip("[]"), int(port), None, False, timeout=wait)
    spec = WorkerSpec.from_json(store.get(spec_key(args.rank)).decode())
    if spec.rank != args.rank:
        raise SystemExit(f"pdserve tp-worker: rank {args.rank} got the spec of {spec.rank}")
    _run_worker(spec, store, int(port), args)


def _run_worker(spec: WorkerSpec, store: dist.Store, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(threads_per_rank(spec.parallel))
    size = spec.parallel.tensor_parallel_size
    shard = TPShard(spec.rank, size, spec.model.enable_expert_parallel)
    own_host = args.advertise_host or args.host
    group = open_group(shard, store, port, spec.parallel, spec.model.device, own_host)
    runner = ModelRunner(
        spec.model,
        spec.cache,
        spec.max_num_seqs,
        spec.max_model_len,
        spec.parallel,
        group,
        spec.speculative,
    )
    agent = _make_agent(spec, runner, group, _here(args))
    plane = None if agent is None else agent.PLANE
    handlers = {} if agent is None else agent.handlers()
    channel = StepChannel(group)
    endpoint = spec.parallel.otlp_traces_endpoint
    tracer = tracer_of(spec.parallel.trace_service, TracingConfig(endpoint))
    try:
        while True:
            kind, payload = channel.recv()
            if kind == STOP:
                return
            if kind == STEP:
                step = STEPS.decode(payload)
                assert isinstance(step, Step), f"a step frame held {step.TYPE}"
                hook = None if not step.hook else agent.layer_hook(plane.decode(step.hook))
                start = time.monotonic()
                runner.follow(step.scheduled(), step.compiled, hook)
                if step.traces and tracer is not None:
                    _rank_spans(tracer, step, spec.rank, start)
            elif kind == CALL:
                channel.gather(answer(plane, handlers, payload))
    finally:
        if tracer is not None:
            tracer.close()  # what is still batched goes out


def _rank_spans(tracer: Tracer, step: Step, rank: int, start: float) -> None:
    """This rank's part of the step, under each traced request's node span."""
    tokens = sum(len(s.token_ids) for s in step.seqs)
    attrs = {"pdserve.tp_rank": rank, "pdserve.step.tokens": tokens}
    end = time.monotonic()
    for parent in step.traces:
        tracer.span("tp.forward", parent, start, end, dict(attrs))


def _here(args: argparse.Namespace) -> dict[str, str]:
    """Agent options this host overrides: where its own sockets bind and are reached."""
    given = {"host": args.host, "advertise_host": args.advertise_host}
    return {k: v for k, v in given.items() if v is not None}


def _make_agent(spec: WorkerSpec, runner: Any, group: TPGroup, here: dict[str, str]) -> Any:
    """The rank's agent the node named (`ParallelConfig.rank_agent`, a `RankAgent`), or None;
    a node's own options, but for the addresses this host gives (`here`)."""
    if spec.parallel.rank_agent is None:
        return None
    module, _, name = spec.parallel.rank_agent.partition(":")
    cls = getattr(importlib.import_module(module), name)
    options = spec.parallel.rank_agent_options or {}
    return cls(runner, group, **{**options, **{k: v for k, v in here.items() if k in options}})


if __name__ == "__main__":
    worker_main()

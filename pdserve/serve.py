"""`pdserve serve MODEL`: the whole deployment on this host, in the foreground, supervised.

A router plus N prefill and M decode nodes (or N colocated nodes) run as child processes
(`pdserve.local_cluster.LocalCluster`, in their own process group: only the supervisor signals
them). The supervisor restarts a child that exits, after an exponential backoff and up to a
restart limit, logging each change of state with the exit status; the router serves from the
surviving nodes meanwhile, and the nodes register again with a restarted router by themselves
(a restarted node keeps its `--node-id`, so the router knows it for a restart). SIGINT, SIGTERM
or SIGHUP stop restarts and drain every child; a second signal stops them at once.

This module is the command: its flags, the deployment they describe (`cluster_from_args`) and
the signals; the supervisor that keeps the children running is `pdserve.supervisor`.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import subprocess
import sys

from pdserve.common.node.cli import (
    add_engine_args,
    add_model_arg,
    add_options,
    option_flags,
    options_of,
    parser,
    resolve_model,
)
from pdserve.common.node.config import NodeConfig
from pdserve.local_cluster import LocalCluster
from pdserve.placement import DEFAULT_PLACEMENT, PLACEMENTS
from pdserve.planner.config import PlannerConfig
from pdserve.planner.loop import PlannerLoop, SupervisorExecutor
from pdserve.planner.source import RouterSource
from pdserve.router.config import add_router_args, router_config
from pdserve.supervisor import MAX_RESTARTS, SUPERVISOR, Backoff, StopFlag, Supervisor

__all__ = ["build_parser", "cluster_from_args", "main", "supervisor_from_args"]

log = logging.getLogger("pdserve.serve")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 15.0  # beyond the nodes' drain timeout, before what is left gets SIGKILL


def _engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given on this command line (not at their defaults), spelled again for
    the nodes; the flags are those `add_engine_args` defines, so the list never drifts."""
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    out = []
    for action in engine._actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse.BooleanOptionalAction):  # --flag / --no-flag
            flag = action.option_strings[0 if value else 1]
        out += [flag] if action.nargs == 0 else [flag, str(value)]
    return out


# The router flags `pdserve serve` leaves out: --control-host, since its nodes reach the router
# on 127.0.0.1 (LocalCluster binds control there), and --max-model-len, which is the engine flag
# of that name here, for the router and every node alike.
SERVE_OMITS = frozenset({"control_host", "max_model_len"})
# Router settings LocalCluster spells itself (the API key by environment, never in `ps`).
CLUSTER_SETS = frozenset({"host", "port", "control_host", "control_port", "api_key"})
# The node flags `pdserve serve` takes itself and hands on to every node.
NODE_OPTIONS = frozenset(
    {"tensor_parallel_size", "threads_per_rank", "kv_connector", "drain_timeout"}
)


def build_parser() -> argparse.ArgumentParser:
    p = parser(
        "pdserve serve",
        "Serve MODEL on this host: a router (OpenAI-compatible HTTP API) plus prefill and decode\n"
        "nodes as supervised child processes: a child that exits is restarted (the router too).\n"
        "Ctrl-C (or SIGTERM) drains and stops them all (what still runs "
        f"{STOP_GRACE_S:.0f} s past\n--drain-timeout is killed); a second Ctrl-C stops them "
        "at once.",
    )
    add_model_arg(p)
    _add_deployment_args(p)
    add_options(p, NodeConfig, only=NODE_OPTIONS)
    add_router_args(p, omit=SERVE_OMITS)
    _add_supervisor_args(p)
    _add_child_flag_args(p)
    _add_planner_args(p)
    add_engine_args(p)
    return p


def _add_planner_args(p: argparse.ArgumentParser) -> None:
    """`--planner` and the planner's own options (its node start timeout is --start-timeout)."""
    group = p.add_argument_group("planner")
    group.add_argument(
        "--planner",
        action="store_true",
        help="size the prefill and decode pools from the router's measurements: start, drain "
        "and flip nodes between the bounds below (docs/planner.md; P/D deployments only)",
    )
    add_options(p, PlannerConfig, omit=frozenset({"start_timeout"}))


def _add_deployment_args(p: argparse.ArgumentParser) -> None:
    """How many nodes of each role, their tensor parallelism, connector and drain."""
    topo = p.add_argument_group("deployment")
    topo.add_argument(
        "--num-prefill", type=int, default=None, metavar="N", help="prefill nodes (default: 1)"
    )
    topo.add_argument(
        "--num-decode", type=int, default=None, metavar="M", help="decode nodes (default: 1)"
    )
    topo.add_argument(
        "--colocated",
        type=int,
        default=0,
        metavar="N",
        help="N colocated nodes (prefill and decode in one engine) instead of P/D nodes",
    )
    topo.add_argument(
        "--num-routers",
        type=int,
        default=1,
        metavar="R",
        help="routers, every node registered with each; the first on --port, the others on "
        "free ports (named router1, ...; default: 1)",
    )
    topo.add_argument(
        "--cpu-placement",
        choices=PLACEMENTS,
        default=DEFAULT_PLACEMENT,
        help="auto: pin each child to its share of this process's cores, by the work (decode "
        "nodes a quarter, at least a core each; prefill nodes and routers the rest; colocated "
        "nodes evenly; nothing where there are fewer cores than nodes), each node's torch "
        "threads at most its cores; off: leave them to the kernel (default: %(default)s)",
    )
    topo.add_argument(
        "--prefill-tp", type=int, default=None, metavar="N", help="prefill nodes' TP (default: -tp)"
    )
    topo.add_argument(
        "--decode-tp", type=int, default=None, metavar="N", help="decode nodes' TP (default: -tp)"
    )


def _add_supervisor_args(p: argparse.ArgumentParser) -> None:
    """How the supervisor restarts, reports, logs and waits for its children."""
    sup = p.add_argument_group(SUPERVISOR)
    sup.add_argument(
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        help="restarts of a child that exits again and again (each within --restart-reset s "
        "of its start) before it is left down; for the router, everything stops",
    )
    add_options(p, Backoff)  # into the group above
    sup.add_argument(
        "--supervisor-metrics-port",
        type=int,
        default=None,
        help="serve each child's state as Prometheus metrics on --host:PORT (0: a free port; "
        "default: off)",
    )
    sup.add_argument("--log-dir", default=None, help="one log file per child (default: stdout)")
    sup.add_argument(
        "--start-timeout", type=float, default=300.0, help="seconds for every child to be ready"
    )


def _add_child_flag_args(p: argparse.ArgumentParser) -> None:
    """Free-form flags passed on to the router and the nodes as given."""
    extra = p.add_argument_group("more flags for the children")
    extra.add_argument(
        "--router-flags",
        default="",
        help='extra `pdserve router` flags, one quoted string, e.g. "--heartbeat-timeout 2" '
        "(default: none)",
    )
    extra.add_argument(
        "--node-flags", default="", help="extra flags for every node, one string (default: none)"
    )


def _tp_flags(
    p: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[str], list[str], list[str]]:
    """The tensor-parallel flags of every node, of prefill nodes and of decode nodes."""
    sizes = (args.tensor_parallel_size, args.prefill_tp, args.decode_tp)
    if any(n is not None and n < 1 for n in sizes):
        p.error("tensor-parallel sizes must be >= 1")
    every = ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.threads_per_rank is not None:
        every += ["--threads-per-rank", str(args.threads_per_rank)]
    role = [[] if n is None else ["--tensor-parallel-size", str(n)] for n in sizes[1:]]
    return every, role[0], role[1]


def cluster_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> LocalCluster:
    """The deployment of parsed `build_parser` flags (ValueError on a bad router flag)."""
    resolve_model(p, args)
    if args.colocated and (args.num_prefill or args.num_decode):
        p.error("--colocated N replaces --num-prefill/--num-decode: give one or the other")
    if args.colocated < 0:
        p.error("--colocated must be >= 0")
    num_p = 0 if args.colocated else (1 if args.num_prefill is None else args.num_prefill)
    num_d = 0 if args.colocated else (1 if args.num_decode is None else args.num_decode)
    if not args.colocated and (num_p < 1 or num_d < 1):
        p.error("a P/D deployment needs at least one prefill and one decode node")
    if args.num_routers < 1:
        p.error("--num-routers must be >= 1")
    router = router_config(args)
    nodes = _engine_flags(args) + ["--drain-timeout", str(args.drain_timeout)]
    nodes += option_flags(router.tracing)  # every process exports its own spans
    if router.curve_dir:
        nodes += ["--curve-dir", router.curve_dir]
    tp = _tp_flags(p, args)
    return LocalCluster(
        args.model,
        num_prefill=num_p,
        num_decode=num_d,
        num_colocated=args.colocated,
        num_routers=args.num_routers,
        kv_connector=args.kv_connector,
        port=router.port,
        control_port=router.control_port,
        engine_args=nodes + tp[0] + shlex.split(args.node_flags),
        prefill_args=tp[1],
        decode_args=tp[2],
        router_args=option_flags(router, CLUSTER_SETS)
        + option_flags(router.tracing)
        + shlex.split(args.router_flags),
        log_dir=args.log_dir,
        host=router.host,
        inherit_output=args.log_dir is None,
        own_process_group=True,
        api_key=router.api_key,
        placement=args.cpu_placement,
    )


def supervisor_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> Supervisor:
    try:
        backoff = options_of(Backoff, args)
        return Supervisor(cluster_from_args(p, args), args.max_restarts, backoff)
    except ValueError as exc:
        p.error(str(exc))


def planner_from_args(
    p: argparse.ArgumentParser, args: argparse.Namespace, sup: Supervisor
) -> PlannerLoop:
    """The planner loop of `--planner`, on the supervisor's children and the first router."""
    if args.colocated:
        p.error("--planner sizes prefill and decode pools: it needs a P/D deployment")
    try:
        config = options_of(PlannerConfig, args)
    except ValueError as exc:
        p.error(str(exc))
    source = RouterSource(sup.cluster.urls, sup.cluster.api_key)
    return PlannerLoop(config, source, SupervisorExecutor(sup), sup.registry)


def _on_stop_signals(sup: Supervisor, stop: StopFlag) -> None:
    """First signal: leave the supervising loop (main then drains). Next ones: SIGTERM the
    children again, which stops a draining node at once."""

    def handle(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if not stop.is_set():
            log.info("%s: draining every child (again to stop at once)", name)
            sup.stopping = True
            stop.set()
        else:
            log.warning("%s again: stopping every child at once", name)
            sup.cluster.terminate()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    sup = supervisor_from_args(p, args)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = StopFlag()
    _on_stop_signals(sup, stop)
    try:
        if args.supervisor_metrics_port is not None:
            port = sup.serve_metrics(args.supervisor_metrics_port, args.host)
            log.info("supervisor metrics at http://%s:%d/metrics", args.host, port)
        if sup.start(args.start_timeout, stop):
            nodes = ", ".join(sup.cluster.node_names)
            urls = " ".join(sup.cluster.urls)
            log.info("pdserve ready at %s (routers, %s); Ctrl-C to stop", urls, nodes)
            print(f"pdserve ready at {urls}", flush=True)
            planner = planner_from_args(p, args, sup) if args.planner else None
            sup.run(stop, tick=planner.tick if planner else None)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.error("%s", exc)
        sup.failed = str(exc)
    finally:
        sup.stop(args.drain_timeout + STOP_GRACE_S)
    if sup.failed:
        sys.exit(f"pdserve serve: {sup.failed}")

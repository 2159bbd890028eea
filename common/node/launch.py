"""Process entry helpers: logging, signals, and the run of one node."""

from __future__ import annotations

import logging
import signal

from pdserve.common.node.cli import add_node_args, engine_configs, parser, resolve_model


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_node(
    node_cls,
    prog: str,
    description: str,
    argv: list[str] | None = None,
    pass_args: tuple[str, ...] = (),
) -> None:
    """Parse node flags, build the node, serve until SIGINT/SIGTERM."""
    p = parser(prog, description)
    add_node_args(p)
    args = p.parse_args(argv)
    resolve_model(p, args)
    setup_logging()
    model, cache, sched = engine_configs(args)
    kwargs = {k: getattr(args, k) for k in pass_args}
    node = node_cls(
        model,
        cache,
        sched,
        router_addr=args.router,
        node_id=args.node_id,
        heartbeat_interval=args.heartbeat_interval,
        lease_timeout=args.lease_timeout,
        max_queued_requests=args.max_queued_requests,
        drain_timeout=args.drain_timeout,
        stall_timeout=args.stall_timeout,
        curve_dir=args.curve_dir,
        **kwargs,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):  # drain; a second signal stops at once
        signal.signal(sig, lambda *_: node.drain())
    logging.getLogger(node_cls.__module__).info("%s %s serving", node.role, node.node_id)
    node.run()

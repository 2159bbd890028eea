"""Process entry helpers: logging, signals, and the run of one node."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import TYPE_CHECKING

from pdserve.common.node.cli import (
    add_node_args,
    engine_configs,
    node_config,
    parser,
    resolve_model,
)
from pdserve.common.node.config import NodeConfig
from pdserve.common.process import freeze_startup_heap

if TYPE_CHECKING:
    from pdserve.common.node.loop import EngineNode


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def parse_node_args(
    prog: str, description: str, argv: list[str] | None = None
) -> tuple[argparse.Namespace, NodeConfig]:
    """A node's flags and the NodeConfig they make; a bad value is a usage error (exit 2)."""
    p = parser(prog, description)
    add_node_args(p)
    args = p.parse_args(argv)
    resolve_model(p, args)
    try:
        return args, node_config(args)
    except ValueError as exc:
        p.error(str(exc))


def run_node(
    node_cls: type[EngineNode], prog: str, description: str, argv: list[str] | None = None
) -> None:
    """Parse node flags, build the node, serve until SIGINT/SIGTERM."""
    args, node = parse_node_args(prog, description, argv)
    setup_logging()
    server = node_cls(*engine_configs(args), node)
    freeze_startup_heap()
    for sig in (signal.SIGINT, signal.SIGTERM):  # drain; a second signal stops at once
        signal.signal(sig, lambda *_: server.drain())
    logging.getLogger(node_cls.__module__).info("%s %s serving", server.role, server.node_id)
    server.run()
    if server.fatal:
        sys.exit(f"{prog}: {server.fatal}")

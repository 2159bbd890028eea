"""Process entry helpers: logging, signals, and the run of one node."""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

from pdserve.common.node.cli import (
    add_node_args,
    engine_configs,
    node_config,
    parser,
    resolve_model,
)
from pdserve.common.process import freeze_startup_heap

if TYPE_CHECKING:
    from pdserve.common.node.loop import EngineNode


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_node(
    node_cls: type[EngineNode], prog: str, description: str, argv: list[str] | None = None
) -> None:
    """Parse node flags, build the node, serve until SIGINT/SIGTERM."""
    p = parser(prog, description)
    add_node_args(p)
    args = p.parse_args(argv)
    resolve_model(p, args)
    try:
        node = node_config(args)
    except ValueError as exc:
        p.error(str(exc))
    setup_logging()
    server = node_cls(*engine_configs(args), node)
    freeze_startup_heap()
    for sig in (signal.SIGINT, signal.SIGTERM):  # drain; a second signal stops at once
        signal.signal(sig, lambda *_: server.drain())
    logging.getLogger(node_cls.__module__).info("%s %s serving", server.role, server.node_id)
    server.run()

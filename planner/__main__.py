"""`pdserve planner`: the planner as its own process, on Kubernetes (deploy/planner.yaml): it
reads the routers every --interval and sets the replicas of the prefill and decode Deployments
(`k8s.KubeExecutor`). `pdserve serve --planner` runs the same loop on its own child processes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

from prometheus_client import CollectorRegistry, start_http_server

from pdserve.common.node.cli import add_options, options_of, parser
from pdserve.planner.config import PlannerConfig
from pdserve.planner.k8s import KubeExecutor, KubeTarget
from pdserve.planner.loop import PlannerLoop
from pdserve.planner.source import RouterSource

TICK_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = parser(
        "pdserve planner",
        "Size the prefill and decode Deployments of a pdserve cluster on Kubernetes from its\n"
        "routers' measurements (docs/planner.md; the router's API key from PDSERVE_API_KEY).",
    )
    k8s = p.add_argument_group("cluster")
    k8s.add_argument(
        "--router-url",
        action="append",
        required=True,
        metavar="URL",
        help="a router's HTTP address; once per router (every one is read)",
    )
    k8s.add_argument("--prefill-deployment", default="pdserve-prefill", help="(%(default)s)")
    k8s.add_argument("--decode-deployment", default="pdserve-decode", help="(%(default)s)")
    k8s.add_argument("--namespace", default=None, help="(default: the service account's)")
    k8s.add_argument("--metrics-port", type=int, default=9100,
                     help="serve pdserve:planner_* on this port (0: off; %(default)s)")  # fmt: skip
    add_options(p, PlannerConfig)
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        config = options_of(PlannerConfig, args)
        target = KubeTarget.in_cluster(args.prefill_deployment, args.decode_deployment,
                                       args.namespace)  # fmt: skip
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    registry = CollectorRegistry()
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=registry)
    source = RouterSource(args.router_url, os.environ.get("PDSERVE_API_KEY"))
    loop = PlannerLoop(config, source, KubeExecutor(target), registry)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        while True:
            loop.tick()
            time.sleep(TICK_S)
    except KeyboardInterrupt:
        logging.getLogger("pdserve.planner").info("planner: stopped")


if __name__ == "__main__":
    main()

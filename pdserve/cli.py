"""The `pdserve` command: one entry point for the whole deployment, each role, the benchmarks,
keys and the demo. Each subcommand owns its flags (`pdserve SUBCOMMAND --help`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from pdserve import __version__

# name -> (module:function taking argv, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdserve.serve:main", "the whole deployment on this host, supervised (foreground)"),
    "router": ("pdserve.router.__main__:main", "one router (HTTP API) for a multi-host cluster"),
    "prefill": ("pdserve.prefill_node.__main__:main", "one prefill node"),
    "decode": ("pdserve.decode_node.__main__:main", "one decode node (--role both: colocated)"),
    "tp-worker": (
        "pdserve.common.engine.tensor_parallel_worker:worker_main",
        "one worker rank of a tensor-parallel node whose rank 0 runs on another host",
    ),
    "planner": (
        "pdserve.planner.__main__:main",
        "the planner on Kubernetes: sets the prefill and decode Deployments' replicas",
    ),
    "bench": ("pdserve.bench:main", "benchmarks: serve, kv-transfer, offline, compare"),
    "keygen": ("pdserve.cli:keygen", "write the cluster's CurveZMQ keys into DIR"),
    "demo": ("pdserve.demo:main", "serve SmolLM2 on 1 prefill + 1 decode node, ask it questions"),
}


def _top_parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
    p = argparse.ArgumentParser(
        prog="pdserve",
        description="pdserve: prefill/decode disaggregated LLM inference.",
        epilog=f"commands:\n{listing}\n\n`pdserve COMMAND --help` shows a command's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"pdserve {__version__}")
    p.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND")
    return p


def _entry(command: str) -> Callable[[list[str]], None]:
    module, func = COMMANDS[command][0].split(":")
    return getattr(importlib.import_module(module), func)


def keygen(argv: list[str]) -> None:
    from pdserve.common.node.cli import parser

    p = parser("pdserve keygen", "Write DIR/cluster.key and DIR/cluster.key_secret (CurveZMQ).")
    p.add_argument("dir", metavar="DIR", help="where to write the key pair (made if missing)")
    args = p.parse_args(argv)
    from pdserve.common.wire.security import keygen as write_keys

    public, secret = write_keys(args.dir)
    print(f"wrote {public} and {secret}; give every router and node --curve-dir {args.dir}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0].startswith("-"):
        top.parse_args(argv or ["--help"])  # --help, --version, or an error
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        top.error(f"unknown command {command!r}; choose from {', '.join(COMMANDS)}")
    _entry(command)(rest)


if __name__ == "__main__":
    main()

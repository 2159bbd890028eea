"""`pdserve router MODEL [flags]` (also `python -m pdserve.router`): the HTTP front of a
cluster; `pdserve router --help` lists the flags."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import uvicorn

from pdserve.common.model.checkpoint import Checkpoint
from pdserve.common.node.cli import add_curve_arg, add_model_arg, parser, resolve_model
from pdserve.common.process import freeze_startup_heap
from pdserve.router.app import RouterLimits, create_app
from pdserve.router.cluster import POLICIES, ClusterBackend
from pdserve.router.cluster.placement import PLACEMENTS, PlacementConfig
from pdserve.router.tools import PARSERS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(
        "pdserve router",
        "The OpenAI-compatible HTTP front: tokenizes, routes to prefill and decode nodes,\n"
        "streams tokens back. Nodes register on its control port.",
    )
    add_model_arg(p)
    api = p.add_argument_group("HTTP API")
    api.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: MODEL as given)",
    )
    api.add_argument("--host", default="127.0.0.1", help="address to bind HTTP (and control) on")
    api.add_argument("--port", type=int, default=8000, help="HTTP port")
    api.add_argument(
        "--api-key",
        default=None,
        help="Bearer key every route but /health requires (default: env PDSERVE_API_KEY)",
    )
    api.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens per request (default: the model's own limit)",
    )
    api.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=PARSERS,
        help="how replies are read as tool calls: hermes (<tool_call> blocks: Qwen2.5, Qwen3, "
        "SmolLM2 with the default tool prompt) or llama3_json (Llama 3.1+)",
    )
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--control-host", default=None, help="default: --host")
    cluster.add_argument("--control-port", type=int, default=8100, help="port nodes register on")
    cluster.add_argument(
        "--policy", default="least_loaded", choices=sorted(POLICIES), help="how nodes are picked"
    )
    cluster.add_argument(
        "--prefill-placement",
        default=os.environ.get("PDSERVE_PREFILL_PLACEMENT", "auto"),
        choices=PLACEMENTS,
        help="where prompts are prefilled when decode nodes exist: auto (per request, by a cost "
        "model from the nodes' measured rates, or by --local-prefill-threshold), remote (always "
        "on a prefill node) or local (always on the decode node). Default: auto, or "
        "$PDSERVE_PREFILL_PLACEMENT",
    )
    cluster.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=None,
        metavar="TOKENS",
        help="with auto placement: prefill on the decode node when it lacks at most this many "
        "prompt tokens, else remotely (replaces the cost model)",
    )
    cluster.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=5.0,
        help="a node silent this long (s) leaves the rotation; its requests fail over",
    )
    cluster.add_argument(
        "--lease-interval",
        type=float,
        default=1.0,
        help="how often (s) the router renews the leases of the requests nodes hold",
    )
    defaults = RouterLimits()
    limits = p.add_argument_group("limits and admission")
    limits.add_argument(
        "--max-request-bytes",
        type=int,
        default=defaults.max_request_bytes,
        help="larger request bodies get 413 (bytes)",
    )
    limits.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="backend requests (choices) in flight beyond which new requests get 503",
    )
    limits.add_argument(
        "--max-queued-tokens",
        type=int,
        default=defaults.max_queued_tokens,
        help="prompt tokens in flight beyond which new requests get 503",
    )
    add_curve_arg(p, "only nodes holding them join")
    args = p.parse_args(argv)
    resolve_model(p, args)
    # From the environment, so that --help never prints it and `ps` never shows it.
    args.api_key = args.api_key or os.environ.get("PDSERVE_API_KEY")
    return args


def limits_of(args: argparse.Namespace) -> RouterLimits:
    return RouterLimits(
        max_request_bytes=args.max_request_bytes,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
    )


def max_model_len_of(model_dir: str, override: int | None) -> int:
    limit = Checkpoint.resolve(model_dir).config_dict().get("max_position_embeddings", 2048)
    return min(limit, override) if override else limit


async def serve(args: argparse.Namespace) -> None:
    limits = limits_of(args)  # a bad flag fails here, before anything is started
    placement = PlacementConfig(args.prefill_placement, args.local_prefill_threshold)

    tokenizer = Checkpoint.resolve(args.model).tokenizer()
    backend = ClusterBackend(
        host=args.control_host or args.host,
        control_port=args.control_port,
        policy=args.policy,
        max_model_len=max_model_len_of(args.model, args.max_model_len),
        heartbeat_timeout=args.heartbeat_timeout,
        lease_interval=args.lease_interval,
        curve_dir=args.curve_dir,
        placement=placement,
    )
    await backend.start()
    name = args.served_model_name or args.model  # vLLM's rule: MODEL as the user typed it
    app = create_app(
        backend,
        tokenizer,
        name,
        api_key=args.api_key,
        limits=limits,
        tool_call_parser=args.tool_call_parser,
    )

    @app.get("/internal/integrity")  # behind the API key like every route but /health
    async def integrity() -> dict:
        """Block-pool integrity of every node: all blocks free or cached when idle."""
        return await backend.integrity()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    freeze_startup_heap()
    try:
        await uvicorn.Server(config).serve()
    finally:
        await backend.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

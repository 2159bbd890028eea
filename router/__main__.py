"""python -m router --model DIR [--host 127.0.0.1] [--port 8000] [--control-port 8100]
[--policy NAME] [--api-key KEY] [--max-request-bytes N] [--max-queued-requests N]
[--max-queued-tokens N]"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import uvicorn

from router.api import RouterLimits, create_app
from router.cluster import POLICIES, ClusterBackend


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="pdserve router (OpenAI-compatible HTTP API)")
    p.add_argument("--model", required=True, help="checkpoint directory (for its tokenizer)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--control-host", default=None, help="defaults to --host")
    p.add_argument("--control-port", type=int, default=8100)
    p.add_argument("--policy", default="least_loaded", choices=sorted(POLICIES))
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    p.add_argument("--max-model-len", type=int, default=None)
    defaults = RouterLimits()
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=defaults.max_request_bytes,
        help="larger request bodies get 413",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="backend requests (choices) in flight beyond which new requests get 503",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=defaults.max_queued_tokens,
        help="prompt tokens in flight beyond which new requests get 503",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=5.0,
        help="a node silent this long (s) leaves the rotation; its requests fail over",
    )
    p.add_argument(
        "--lease-interval",
        type=float,
        default=1.0,
        help="how often (s) the router renews the leases of the requests nodes hold",
    )
    p.add_argument(
        "--curve-dir",
        default=None,
        help="CurveZMQ keys (python -m common.security keygen DIR): only nodes with them join",
    )
    return p.parse_args(argv)


def limits_of(args: argparse.Namespace) -> RouterLimits:
    return RouterLimits(
        max_request_bytes=args.max_request_bytes,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
    )


def max_model_len_of(model_dir: str, override: int | None) -> int:
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    return min(limit, override) if override else limit


async def serve(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    limits = limits_of(args)  # a bad flag fails here, before anything is started

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    backend = ClusterBackend(
        host=args.control_host or args.host,
        control_port=args.control_port,
        policy=args.policy,
        max_model_len=max_model_len_of(args.model, args.max_model_len),
        heartbeat_timeout=args.heartbeat_timeout,
        lease_interval=args.lease_interval,
        curve_dir=args.curve_dir,
    )
    await backend.start()
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = create_app(backend, tokenizer, name, api_key=args.api_key, limits=limits)

    @app.get("/internal/integrity")  # behind the API key like every route but /health
    async def integrity() -> dict:
        """Block-pool integrity of every node: all blocks free or cached when idle."""
        return await backend.integrity()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    try:
        await uvicorn.Server(config).serve()
    finally:
        await backend.close()


def main() -> None:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(parse_args()))


if __name__ == "__main__":
    main()

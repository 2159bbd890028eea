"""`pdserve router MODEL [flags]` (also `python -m pdserve.router`): the HTTP front of a
cluster; `pdserve router --help` lists the flags."""

from __future__ import annotations

import argparse
import asyncio
import logging

import uvicorn

from pdserve.common.model.checkpoint import Checkpoint
from pdserve.common.node.cli import add_model_arg, parser, resolve_model
from pdserve.common.process import freeze_startup_heap
from pdserve.router.app import create_app
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.registry import NODE_ROLES, NodeInfo
from pdserve.router.config import RouterConfig, add_router_args, router_config


def build_parser() -> argparse.ArgumentParser:
    p = parser(
        "pdserve router",
        "The OpenAI-compatible HTTP front: tokenizes, routes to prefill and decode nodes,\n"
        "streams tokens back. Nodes register on its control port.",
    )
    add_model_arg(p)
    add_router_args(p)
    return p


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    p = build_parser()
    args = p.parse_args(argv)
    resolve_model(p, args)
    try:
        return router_config(args)  # a bad flag fails here, before anything is started
    except ValueError as exc:
        p.error(str(exc))


def max_model_len_of(model_dir: str, override: int | None) -> int:
    limit = Checkpoint.resolve(model_dir).config_dict().get("max_position_embeddings", 2048)
    return min(limit, override) if override else limit


def node_load(node: NodeInfo) -> dict:
    fields = ("role", "draining", "num_blocks", "free_blocks", "queued_tokens", "num_waiting")
    return {name: getattr(node, name) for name in fields} | {
        "in_flight": node.inflight,
        "prefill_rate": node.prefill_rate,
        "busy_seconds": node.busy_seconds,
    }


async def serve(config: RouterConfig) -> None:
    tokenizer = Checkpoint.resolve(config.model).tokenizer()
    backend = ClusterBackend(config, max_model_len_of(config.model, config.max_model_len))
    await backend.start()
    app = create_app(
        backend,
        tokenizer,
        config.served_name,
        api_key=config.api_key,
        limits=config.limits,
        tool_call_parser=config.tool_call_parser,
    )

    @app.get("/internal/integrity")  # behind the API key like every route but /health
    async def integrity() -> dict:
        """Block-pool integrity of every node: all blocks free or cached when idle."""
        return await backend.integrity()

    @app.get("/internal/load")
    async def load() -> dict:
        """Every live node's load as its last heartbeat told it (what `pdserve.planner` reads)."""
        return {n.node_id: node_load(n) for n in backend.registry.alive(NODE_ROLES)}

    http = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning")
    freeze_startup_heap()
    try:
        await uvicorn.Server(http).serve()
    finally:
        await backend.close()


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()

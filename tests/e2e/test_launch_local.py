"""`scripts/launch_local.sh` keeps its flags (`--model DIR --num-prefill N --num-decode M --port P
--kv-connector NAME`): it runs `pdserve serve`, answers like the offline engine, and SIGTERM
stops it whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve import LLM, SamplingParams
from pdserve.local_cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The launch script starts a router, a prefill node and a decode node"


def _children(control: int) -> list[int]:
    """Pids of `python -m pdserve ...` processes that use this control port."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "-m pdserve" in line and (f":{control} " in line or f"-port {control} " in line):
            out.append(int(entry.name))
    return out


def _ready(http: httpx.Client, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "launch_local.sh exited"
        try:
            if http.get("/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"not healthy after {timeout}s")


def test_launch_local_serves_and_stops(tiny_model_dir, tmp_path) -> None:
    model = str(tiny_model_dir("llama"))
    llm = LLM(model, dtype="float32")
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (offline,) = llm.generate([ids], params)

    port, control = free_port(), free_port()
    flags = ["--model", model, "--num-prefill", "1", "--num-decode", "1", "--port", str(port)]
    flags += ["--kv-connector", "shm", "--control-port", str(control), "--num-blocks", "128"]
    flags += ["--dtype", "float32"]
    env = dict(os.environ, PDSERVE_VENV=sys.prefix)
    with (tmp_path / "out.log").open("wb") as log:
        proc = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "launch_local.sh"), *flags],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            _ready(http, proc, 180)
            body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0}
            body |= {"ignore_eos": True, "return_token_ids": True}
            r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == list(offline.token_ids)
        children = _children(control)
        assert len(children) == 3, children  # the script became `pdserve serve`: its children
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, (tmp_path / "out.log").read_text()
        assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in _children(control):
            os.kill(pid, signal.SIGKILL)

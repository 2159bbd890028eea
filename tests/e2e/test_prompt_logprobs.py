"""Prompt logprobs and echo through real processes, colocated and 1P1D: the numbers equal HF
transformers' log-softmax of the same prompt (float32) across chunk boundaries, for OpenAI's
echo + logprobs, vLLM's prompt_logprobs, and a log-likelihood request shaped as
lm-evaluation-harness sends it."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch

from pdserve.local_cluster import LocalCluster
from pdserve.tiny_model import make_tiny_model

TOL = 1e-4
CHUNK = 32  # --max-num-batched-tokens: the prompts below cross several chunk boundaries
ENGINE = ["--block-size", "16", "--max-num-batched-tokens", str(CHUNK), "--max-model-len", "512"]
ENGINE += ["--dtype", "float32"]  # as the HF reference
SHAPES = {"colocated": (0, 0, 1), "1P1D": (1, 1, 0)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("plp") / "m", max_position=2048))


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)

    return logprobs


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def post(url: str, body: dict) -> dict:
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prompt_logprobs_through_the_router_equal_hf(model_dir, hf, shape):
    p, d, c = SHAPES[shape]
    with LocalCluster(model_dir, p, d, num_colocated=c, engine_args=ENGINE) as cluster:
        url = cluster.url
        ids = prompt(90, 1)
        want = hf(ids)
        ref = [want[i - 1, ids[i]].item() for i in range(1, len(ids))]

        # OpenAI's echo + logprobs, scoring only (max_tokens 0).
        body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
        (choice,) = post(url, body)["choices"]
        lps = choice["logprobs"]
        assert choice["finish_reason"] == "length"
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        assert len(lps["token_logprobs"]) == len(ids)
        assert max(abs(a - b) for a, b in zip(lps["token_logprobs"][1:], ref)) < TOL
        assert all(len(top) <= 2 for top in lps["top_logprobs"][1:])
        detok = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()
        assert choice["text"] == detok["prompt"]

        # echo with a completion after it: the prompt's entries, then the generated ones.
        body = {"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 0, "temperature": 0}
        (choice,) = post(url, body)["choices"]
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 3
        assert choice["text"].startswith(detok["prompt"])

        # vLLM's prompt_logprobs: per position the prompt's token (with its rank) and top N.
        body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1, "temperature": 0}
        (choice,) = post(url, body)["choices"]
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for i in range(1, len(ids)):
            entry = plp[i][str(ids[i])]
            assert abs(entry["logprob"] - ref[i - 1]) < TOL
            assert entry["rank"] == int((want[i - 1] > want[i - 1, ids[i]]).sum()) + 1
            best = str(int(want[i - 1].argmax()))
            assert best in plp[i] and plp[i][best]["rank"] == 1

        # Streaming echo: the first chunk carries the prompt's text.
        body = {"prompt": ids, "max_tokens": 2, "echo": True, "stream": True, "temperature": 0}
        text = ""
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        assert text.startswith(detok["prompt"]) and len(text) > len(detok["prompt"])

        lm_eval_loglikelihood(url, hf)
        for node, info in cluster.integrity().items():
            report = info["report"]
            assert report["ok"] and not report["live_requests"], (node, report)
            assert report["free_blocks"] == report["num_blocks"], node


def lm_eval_loglikelihood(url: str, hf) -> None:
    """lm-evaluation-harness's local-completions log-likelihood request: context and
    continuation as one token prompt, echo, logprobs 1, max_tokens 0; it sums the
    continuation's token_logprobs and checks each is the top one (is_greedy)."""
    batch = [(prompt(40, 7), prompt(5, 8)), (prompt(70, 9), prompt(12, 10))]
    body = {
        "prompt": [ctx + cont for ctx, cont in batch],
        "temperature": 0,
        "max_tokens": 0,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    choices = post(url, body)["choices"]
    for (ctx, cont), choice in zip(batch, sorted(choices, key=lambda c: c["index"])):
        lps = choice["logprobs"]
        got = sum(lps["token_logprobs"][len(ctx) :])
        want = hf(ctx + cont)
        ref = sum(want[len(ctx) + i - 1, t].item() for i, t in enumerate(cont))
        assert abs(got - ref) < TOL * len(cont)
        tops = lps["top_logprobs"][len(ctx) :]
        greedy = all(
            max(top.values()) <= lp + 1e-6
            for top, lp in zip(tops, lps["token_logprobs"][len(ctx) :])
        )
        ref_greedy = all(int(want[len(ctx) + i - 1].argmax()) == t for i, t in enumerate(cont))
        assert greedy == ref_greedy

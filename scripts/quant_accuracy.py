"""Accuracy of quantized weights (issue 25): perplexity of a fixed text through the engine's
prompt logprobs, and greedy agreement on chat prompts, per (dtype, quantization), against the
float32 dequantized model. The table goes into docs/benchmarks.md by hand.

    PYTHONPATH=. python scripts/quant_accuracy.py [--gguf FILE] [--threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams

TEXT = Path(__file__).parent / "data" / "quant_text.txt"
# (dtype, quantization): the first is the reference every other row is measured against.
RUNS = [
    ("float32", "none"),
    ("float32", "int8"),
    ("float32", "int4"),
    ("bfloat16", "none"),
    ("bfloat16", "int8"),
    ("bfloat16", "int4"),
]
GOALS = {"none": None, "int8": 2.0, "int4": 6.0}  # % perplexity over the reference
CHAT = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain in one sentence why the sky is blue.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Give me a tip for sleeping better.",
    "Who wrote Romeo and Juliet?",
    "What does a bee make?",
    "Translate 'good morning' into Spanish.",
    "Suggest a name for a small grey cat.",
]
ANSWER_TOKENS = 32


@dataclass(frozen=True, slots=True)
class Row:
    dtype: str
    quantization: str
    tokens: int
    perplexity: float
    answers: list[list[int]]
    seconds: float


def perplexity(llm: LLM, ids: list[int]) -> float:
    """exp of the mean negative logprob of every prompt token after the first."""
    params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
    (out,) = llm.generate([ids], params)
    logprobs = [lp.logprob for lp in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def chat_prompts(llm: LLM) -> list[list[int]]:
    """CHAT through the checkpoint's chat template (its default system prompt included)."""
    out = []
    for question in CHAT:
        chat = [{"role": "user", "content": question}]
        text = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append(llm.tokenizer(text, add_special_tokens=False).input_ids)
    return out


def measure(gguf: str, dtype: str, quantization: str, text: str) -> Row:
    start = time.perf_counter()
    llm = LLM(gguf, dtype=dtype, quantization=quantization)
    ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    greedy = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
    answers = [o.token_ids for o in llm.generate(chat_prompts(llm), greedy)]
    row = Row(
        dtype, quantization, len(ids), perplexity(llm, ids), answers, time.perf_counter() - start
    )
    llm.close()
    return row


def table(rows: list[Row]) -> str:
    """The markdown table: each row's perplexity against the first's, and the fraction of chat
    prompts whose first ANSWER_TOKENS tokens equal the first's."""
    ref = rows[0]
    lines = [
        "| dtype | quantization | perplexity | vs float32 none | goal | greedy agreement |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta = 100.0 * (r.perplexity / ref.perplexity - 1.0)
        goal = GOALS[r.quantization]
        verdict = "" if goal is None else f"<= +{goal:.0f}%: {'met' if delta <= goal else 'missed'}"
        same = sum(a == b for a, b in zip(r.answers, ref.answers, strict=True))
        mode = "int4 (Q4_1 kept)" if r.quantization == "int4" else r.quantization
        lines.append(
            f"| {r.dtype} | {mode} | {r.perplexity:.4f} | {delta:+.2f}% | {verdict} | "
            f"{same}/{len(ref.answers)} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default=None, help="a GGUF file (default: SmolLM2-135M Q4_1)")
    p.add_argument("--text", default=str(TEXT), help="the text scored (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gguf is None:
        from pdserve.models import smollm2

        args.gguf = str(smollm2())
    text = Path(args.text).read_text(encoding="utf-8")
    rows = []
    for dtype, quantization in RUNS:
        rows.append(measure(args.gguf, dtype, quantization, text))
        gc.collect()
        print(f"{dtype} {quantization}: {rows[-1].perplexity:.4f} ({rows[-1].seconds:.0f} s)")
    print(f"\n{rows[0].tokens} tokens of {args.text}, {torch.get_num_threads()} threads\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()

"""`mtp` speculation through P/D (issue 38): router + prefill + decode processes on loopback,
both nodes started with the MTP method on the tiny DeepSeek-V3 (float32). The prefill node
writes the target's hidden states and the MTP layer's KV with the prompt and ships them as the
layers after the target's, on the same transfer; the decode node drafts from them without
recomputing. Greedy answers equal the colocated engine's without speculation, and the accepted
drafts of each request equal the colocated engine's exactly, on zmq, nccl (gloo), shm and
nixl (its WRITEs move the one latent plane of MLA's pages, and the hidden-state pages of the
same shape); every pool is clean after. (The negative control, a decode side whose
MTP pages are zeros after the prompt as a fresh pool holds them when they are not shipped,
accepts another number:
tests/common/spec/test_mtp.py::test_acceptance_depends_on_the_page_group.)"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from pdserve.bench.systems import wait_until
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.local_cluster import LocalCluster, free_port
from tests.common.spec.test_mtp import COPY_MIX, with_mtp
from tests.e2e.test_disaggregated import ENGINE, assert_clean, complete
from tests.e2e.test_spec_disaggregated import ACCEPTED, DRAFTS, NCCL, _metric, _reached
from tests.kv_transfer.helpers import needs_nixl

NIXL = pytest.param("nixl", marks=needs_nixl)

PROMPTS = [[9, 10, 11] * 7 + [9], [5, 6, 7, 8] * 10, [17], [101, 57, 3, 98, 250, 7, 77]]
TOKENS = 16
SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
# The tiny DeepSeek holds 512 positions (the later flag wins over ENGINE's 1100).
FLOAT32 = ["--dtype", "float32", "--max-model-len", "512"]


def _colocated(model: str, spec: str | None) -> tuple[list[list[int]], list[float], list[float]]:
    """Greedy tokens and the running totals of drafts and accepted drafts after each prompt,
    one prompt at a time, chunked as the prefill node chunks (ENGINE's flags)."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    options = {"block_size": 16, "max_num_batched_tokens": 96, "dtype": "float32"}
    tokens, drafts, accepted = [], [], []
    with LLM(model, skip_tokenizer_init=True, speculative_config=spec, **options) as llm:
        for prompt in PROMPTS:
            tokens.append(llm.generate([prompt], params)[0].token_ids)
            if spec is not None:
                stats = llm.engine.scheduler.drafter.stats
                drafts.append(stats.num_drafts)
                accepted.append(stats.num_accepted_tokens)
    return tokens, drafts, accepted


@pytest.fixture(scope="module")
def colocated(deepseek_dir, tmp_path_factory) -> dict:
    model = str(with_mtp(Path(deepseek_dir), tmp_path_factory.mktemp("mtp") / "m", COPY_MIX))
    plain = _colocated(model, None)[0]
    tokens, drafts, accepted = _colocated(model, SPEC)
    assert tokens == plain
    assert accepted[-1] > 0, "no draft accepted colocated: the test would show nothing"
    return {"model": model, "tokens": plain, "drafts": drafts, "accepted": accepted}


@pytest.mark.parametrize("connector", ["zmq", NCCL, "shm", NIXL])
def test_mtp_pages_through_1p1d_keep_colocated_acceptance(colocated, connector) -> None:
    health = free_port()
    engine = [*ENGINE, *FLOAT32, "--speculative-config", SPEC]
    decode = ["--health-port", str(health)]
    with LocalCluster(
        colocated["model"], 1, 1, kv_connector=connector, engine_args=engine, decode_args=decode
    ) as c:
        got = []
        for i, prompt in enumerate(PROMPTS):
            out = complete(c.url, prompt, max_tokens=TOKENS)
            assert out["choices"][0]["token_ids"] == colocated["tokens"][i]
            # The gauges come with each heartbeat: wait for this request's verify steps.
            seen = partial(_reached, health, DRAFTS, colocated["drafts"][i])
            wait_until(seen, c.procs, 30, f"drafts of prompt {i}")
            got.append(_metric(health, ACCEPTED))
        assert got == colocated["accepted"]
        assert _metric(health, DRAFTS) == colocated["drafts"][-1]
        assert_clean(c)

"""Multi-turn conversations through real clusters: every turn's prompt is the previous prompt,
its answer and a new message. The decode node that answered a turn holds its KV, the answer's
included; the next turn must reuse it (only missing blocks move, or the decode node prefills
the rest itself) and still equal the colocated engine token for token.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.local_cluster import LocalCluster
from pdserve.testbed.faults import router_metrics
from pdserve.tiny_model import make_tiny_model
from tests.e2e.test_disaggregated import assert_clean, complete

BLOCK = 16
ANSWER = 24  # tokens per answer
TURNS = 4
ENGINE = ["--block-size", str(BLOCK), "--max-num-batched-tokens", "96", "--dtype", "float32"]


def first_turns(n: int = 3, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(60, 200))] for _ in range(n)]


def new_message(conv: int, turn: int) -> list[int]:
    rng = random.Random(conv * 100 + turn)
    return [rng.randrange(512) for _ in range(rng.randrange(10, 30))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("multiturn") / "m"))


@pytest.fixture(scope="module")
def conversations(model_dir) -> list[list[tuple[list[int], list[int]]]]:
    """Each conversation's (prompt, answer) per turn, by the colocated engine."""
    llm = LLM(model_dir, block_size=BLOCK, dtype="float32")
    params = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    out = []
    for c, prompt in enumerate(first_turns()):
        turns = []
        for t in range(TURNS):
            answer = llm.generate([prompt], params)[0].token_ids
            turns.append((prompt, answer))
            prompt = prompt + answer + new_message(c, t)
        out.append(turns)
    return out


def run_turns(cluster: LocalCluster, conversations, turns: range) -> None:
    """Turn by turn, the conversations of a turn at once; each answer equals the engine's."""
    with ThreadPoolExecutor(len(conversations)) as pool:
        for t in turns:
            prompts = [conv[t][0] for conv in conversations]
            replies = pool.map(lambda p: complete(cluster.url, p, max_tokens=ANSWER), prompts)
            for c, reply in enumerate(replies):
                got = reply["choices"][0]["token_ids"]
                assert got == conversations[c][t][1], f"conversation {c} turn {t}"


def reused_on_decode(conversations) -> int:
    """Tokens the decode node holds of each later turn (one decode node): full blocks of
    the previous prompt and answer, less the answer's last token (never computed)."""
    total = 0
    for conv in conversations:
        for (prev, answer), (prompt, _) in zip(conv, conv[1:]):
            held = (len(prev) + len(answer) - 1) // BLOCK
            total += min(held, (len(prompt) - 1) // BLOCK) * BLOCK
    return total


@pytest.mark.parametrize("placement", ["remote", "local"])
def test_1p1d_turns_reuse_the_decode_nodes_kv(model_dir, conversations, placement):
    """Remote: the prefill node sends only blocks the decode node lacks (exactly the turns'
    new blocks). Local (forced): the decode node prefills everything itself, nothing moves;
    it needs no prefill node at all (the cluster is one decode node behind the router)."""
    router = ["--prefill-placement", placement]
    prefills = 1 if placement == "remote" else 0
    with LocalCluster(model_dir, prefills, 1, engine_args=ENGINE, router_args=router) as c:
        run_turns(c, conversations, range(TURNS))
        m = router_metrics(c.url)
        n = len(conversations) * TURNS
        if placement == "remote":
            assert (m["prefills_remote"], m["prefills_local"]) == (n, 0)
            assert m["kv_tokens_reused_on_decode"] == reused_on_decode(conversations)
            total = sum(len(p) for conv in conversations for p, _ in conv)
            assert m["kv_tokens_sent"] == total - m["kv_tokens_reused_on_decode"]
        else:
            assert (m["prefills_remote"], m["prefills_local"]) == (0, n)
            assert m["kv_tokens_sent"] == 0
        assert_clean(c)


def test_2p2d_conditional_and_a_decode_node_lost_between_turns(model_dir, conversations):
    """The cost model: first turns go to prefill nodes, follow-ups mostly stay on the decode
    node holding them. A decode node killed between turns costs only a miss: the next turn is
    prefilled elsewhere and still answers right."""
    router = ["--prefill-placement", "auto", "--heartbeat-timeout", "2"]
    with LocalCluster(model_dir, 2, 2, engine_args=ENGINE, router_args=router) as c:
        run_turns(c, conversations, range(1))
        m = router_metrics(c.url)
        # Each prefill node takes a first turn; a third, arriving at once, may find both
        # prefill nodes' queues dearer than prefilling on an idle decode node.
        assert m["prefills_remote"] >= 2 and m["prefills_local"] <= len(conversations) - 2
        run_turns(c, conversations, range(1, 2))
        m = router_metrics(c.url)
        assert m["prefills_local"] + m["kv_tokens_reused_on_decode"] > 0  # D-side hits
        c.procs["decode0"].kill()
        c.procs["decode0"].wait(10)
        run_turns(c, conversations, range(2, TURNS))
        deadline = time.monotonic() + 15
        while len(c.integrity()) != 3:  # the dead node leaves the registry
            assert time.monotonic() < deadline, c.integrity()
            time.sleep(0.5)
        del c.procs["decode0"]
        assert_clean(c)

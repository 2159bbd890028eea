"""pdserve across hosts: every role in its own network namespace (`pdserve.testbed.hosts`), as
`pdserve router|prefill|decode` processes talking over a bridge, against the colocated engine.

Nodes bind 0.0.0.0 and advertise the address of their own interface (the default of
`--advertise-host`); routers bind their host's address. One router (on host r1) serves every
test but the two-router one, which runs its own pair (r2, r3). Each connector between two
hosts, against the colocated engine, is `tests/e2e/test_disaggregated.py`'s 1P1D case (it
runs across hosts wherever they can be built). Needs root (CI runs as root): elsewhere every
test here skips, saying why.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.testbed.cluster import KV_PORT, HostCluster
from pdserve.testbed.faults import router_failovers
from pdserve.testbed.hosts import Hosts, netem_reason, skip_reason
from pdserve.tiny_model import make_tiny_model
from tests.e2e.test_disaggregated import complete as complete_body

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=f"no hosts: {skip_reason()}")

VOCAB = 512
MAX_TOKENS = 16
ENGINE = ["--block-size", "16", "--max-num-batched-tokens", "96", "--max-model-len", "1100"]
ENGINE += ["--dtype", "float32"]  # the reference is the float32 offline engine
# Fast failure detection, so cut links and killed routers show within seconds.
NODE_FLAGS = ("--heartbeat-interval", "0.25", "--lease-timeout", "3")
ROUTER_FLAGS = ("--heartbeat-timeout", "2", "--lease-interval", "0.5")


def make_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(64)]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 300))] for _ in range(n)]
    prompts[1] = prefix + prompts[1][:20]  # a shared prefix: a prefix-cache hit on P
    prompts[2] = prefix + prompts[2][:30]
    return prompts


PROMPTS = make_prompts(16, seed=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("mh") / "m", max_position=2048))


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    llm = LLM(model_dir, block_size=16, dtype="float32")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def hosts():
    with Hosts(["r1", "r2", "r3", "p1", "p2", "d1", "d2", "relay"]) as h:
        yield h


@pytest.fixture(scope="module")
def cluster(hosts, model_dir, tmp_path_factory):
    """The shared router on r1; each test starts and stops its own nodes."""
    c = HostCluster(hosts, model_dir, str(tmp_path_factory.mktemp("logs")), ENGINE)
    c.router("r1", ROUTER_FLAGS)
    yield c
    c.close()


@pytest.fixture()
def nodes(cluster):
    """Stops the nodes a test started (the shared router stays)."""
    started: list[str] = []
    yield started
    for name in started:
        if name in cluster.procs:
            cluster.stop(name)


def complete(url: str, prompt: list[int]) -> list[int]:
    """The greedy answer's tokens (the request as tests/e2e/test_disaggregated.py's)."""
    return complete_body(url, prompt, max_tokens=MAX_TOKENS)["choices"][0]["token_ids"]


def run_all(url: str, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(url, p), prompts))


def wait_holding(
    cluster: HostCluster, router: str, node_id: str, load: list, timeout: float = 60
) -> None:
    """Until the router has 3 or more requests on node_id that have not ended (its integrity
    check's `in_flight`: some are still left when a cut that follows hits), while the load
    (futures) still runs."""
    deadline = time.monotonic() + timeout
    while (cluster.integrity(router).get(node_id) or {}).get("in_flight", 0) < 3:
        assert not all(f.done() for f in load), f"the load ended before {node_id} held a request"
        assert time.monotonic() < deadline, f"{node_id} held no request within {timeout}s"
        time.sleep(0.02)


def wait_clean(cluster: HostCluster, router: str, node_ids: list[str], timeout: float = 30):
    """Until every node in node_ids answers the integrity check holding nothing."""
    deadline = time.monotonic() + timeout
    while True:
        reports = cluster.integrity(router)
        bad = {}
        for node in node_ids:
            report = (reports.get(node) or {}).get("report")
            if report is None:
                bad[node] = "no report"
            elif not report["ok"] or report["live_requests"]:
                bad[node] = report
            elif report["free_blocks"] != report["num_blocks"]:
                bad[node] = f"{report['free_blocks']} of {report['num_blocks']} blocks free"
        if not bad:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not clean after {timeout}s: {bad}")
        time.sleep(0.5)


def start_pair(cluster, nodes, connector: str, p_host="p1", d_host="d1", routable=True):
    p = cluster.node("prefill", p_host, ["r1"], connector, NODE_FLAGS)
    d = cluster.node("decode", d_host, ["r1"], connector, NODE_FLAGS)
    nodes += [p, d]
    cluster.wait_ready("r1", [p, d], routable=routable)
    return p, d


def test_shm_between_hosts_is_refused_with_a_clear_error(cluster, nodes):
    """shm needs one host: the router makes no route of a prefill and a decode node on two
    hosts, and says why in /health and in the request's error; both nodes keep running."""
    start_pair(cluster, nodes, "shm", routable=False)
    health = httpx.get(cluster.url("r1") + "/health", timeout=10)
    assert health.status_code == 503
    assert "shm needs both on one host" in health.text, health.text
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    resp = httpx.post(cluster.url("r1") + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 503
    assert "shm needs both on one host" in resp.text, resp.text
    assert all(cluster.procs[n].poll() is None for n in nodes)


def test_a_wrong_advertised_address_fails_the_node_at_registration(cluster, hosts, nodes):
    """A decode node whose --advertise-host no peer can reach is refused by the router when
    it registers: it exits with an error naming the address (no request ever hangs on it)."""
    wrong = hosts.subnet.rsplit(".", 1)[0] + ".200"  # on the bridge's subnet, nobody's
    d = cluster.node("decode", "d2", ["r1"], "zmq", (*NODE_FLAGS, "--advertise-host", wrong))
    nodes.append(d)
    try:
        code = cluster.procs[d].wait(30)
    except Exception:
        pytest.fail(f"the node kept running:\n{cluster.log(d)[-3000:]}")
    log = cluster.log(d)
    assert code != 0
    assert f"tcp://{wrong}:{KV_PORT}" in log and "--advertise-host" in log, log[-3000:]
    assert d not in cluster.integrity("r1")


def test_cutting_a_decode_hosts_link_under_load_with_a_slow_relay_left(
    cluster, hosts, nodes, reference
):
    """d1 is reached directly, d2 only through a relay host that delays every byte 10 ms
    each way (it advertises the relay). Pull d1's cable (the switch drops its frames) while
    requests decode there: they fail over to d2 and finish right, their KV crossing the slow
    relay; none hangs. With the cable back, d1 frees what it held once its leases run out,
    and serves again."""
    proxy = hosts.start_proxy("relay", KV_PORT, "d2", KV_PORT, 0.010)
    try:
        p = cluster.node("prefill", "p1", ["r1"], "zmq", NODE_FLAGS)
        d1 = cluster.node("decode", "d1", ["r1"], "zmq", NODE_FLAGS)
        relayed = (*NODE_FLAGS, "--advertise-host", hosts.addr("relay"))
        d2 = cluster.node("decode", "d2", ["r1"], "zmq", relayed)
        nodes += [p, d1, d2]
        cluster.wait_ready("r1", [p, d1, d2])
        prompts = PROMPTS * 4  # a load that lasts: one-thread nodes finish a small one fast
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(complete, cluster.url("r1"), pr) for pr in prompts]
            # cut while d1 decodes: those requests must move
            wait_holding(cluster, "r1", d1, futures)
            hosts.link_down("d1", side="switch")
            try:
                got = [f.result(timeout=120) for f in futures]
                after = run_all(cluster.url("r1"), PROMPTS[:4])  # d2 alone, via the relay
            finally:
                hosts.link_up("d1", side="switch")
        assert got == reference * 4
        assert after == reference[:4]
        assert router_failovers(cluster.url("r1")) > 0, "no request left the cut-off host"
        wait_clean(cluster, "r1", [p, d1, d2], timeout=40)
        assert run_all(cluster.url("r1"), PROMPTS[:6]) == reference[:6]
    finally:
        assert proxy.close()["up"] > 0  # KV pages did cross the relay


def test_netem_delay_and_loss_on_the_kv_link_keep_answers_right(cluster, hosts, nodes, reference):
    """Where the kernel has netem: 10 ms and 1% loss on the prefill host's packets to the
    decode host (only those: control traffic to the router is untouched)."""
    if netem_reason():
        pytest.skip(f"netem: {netem_reason()}")
    hosts.netem("p1", delay_ms=10, loss_pct=1.0, dst=[hosts.addr("d1")])
    try:
        p, d = start_pair(cluster, nodes, "zmq")
        assert run_all(cluster.url("r1"), PROMPTS[:8]) == reference[:8]
        wait_clean(cluster, "r1", [p, d])
    finally:
        hosts.unshape("p1")


def test_two_routers_one_killed_under_load(hosts, model_dir, reference, tmp_path):
    """Nodes register with both routers; clients reach either (as through one Service
    address: a connection that fails is retried on the other). kill -9 of one router under
    load: its streams break and are retried on the other, every answer is right, and what the
    dead router had on the nodes is freed by its leases."""
    c = HostCluster(hosts, model_dir, str(tmp_path), ENGINE)
    try:
        urls = [c.router("r2", ROUTER_FLAGS), c.router("r3", ROUTER_FLAGS)]
        p = c.node("prefill", "p2", ["r2", "r3"], "zmq", NODE_FLAGS)
        d = c.node("decode", "d2", ["r2", "r3"], "zmq", NODE_FLAGS)
        c.wait_ready("r2", [p, d])
        c.wait_ready("r3", [p, d])
        streaming = threading.Event()  # some stream on r2 has its first token
        retried = []

        def stream(url: str, prompt: list[int]) -> list[int]:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            body |= {"ignore_eos": True, "stream": True, "return_token_ids": True}
            ids: list[int] = []
            stream_kw = dict(json=body, timeout=60, verify=False)  # plain HTTP: no CA bundle
            with httpx.stream("POST", url + "/v1/completions", **stream_kw) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        import json

                        ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
                        if url == urls[0]:
                            streaming.set()
            return ids

        def client(i: int) -> list[int]:
            first, other = urls[i % 2], urls[1 - i % 2]
            try:
                got = stream(first, PROMPTS[i % len(PROMPTS)])
                if len(got) == MAX_TOKENS:
                    return got
            except httpx.HTTPError:
                pass
            retried.append(i)  # the connection broke: the client retries elsewhere
            return stream(other, PROMPTS[i % len(PROMPTS)])

        n = 24
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(client, i) for i in range(n)]
            assert streaming.wait(60), "no stream on r2 started"
            c.procs["router@r2"].kill()  # kill -9
            got = [f.result(timeout=120) for f in futures]
        assert got == [reference[i % len(PROMPTS)] for i in range(n)]
        assert retried, "no request was in flight on the killed router"
        wait_clean(c, "r3", [p, d], timeout=30)  # r2's requests: freed by their leases
        assert run_all(urls[1], PROMPTS[:4]) == reference[:4]
    finally:
        c.close()

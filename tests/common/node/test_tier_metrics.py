"""The KV tiers' series on a node's health endpoint: what the loop publishes (`TierReport`) is
what a scrape of /metrics reads, per tier, under the node's labels. The engine test
(tests/common/test_kv_tiers_engine.py) moves them with real tiers under a real pool."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.node.health import HealthServer
from pdserve.common.node.stages import NodeMetrics
from pdserve.common.node.tier_metrics import TierReport
from pdserve.kv_store.cost import TierRate
from pdserve.kv_store.tier import TierStats

LABELS = {"role": "prefill", "node_id": "p0"}


def scrape(port: int) -> dict[tuple[str, str], float]:
    """(sample name, tier label or "") -> value, over HTTP."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels["node_id"] == "p0" and s.labels["role"] == "prefill"
            out[(s.name, s.labels.get("tier", ""))] = s.value
    return out


def test_published_tier_counters_reach_the_scrape() -> None:
    metrics = NodeMetrics(LABELS)
    server = HealthServer("127.0.0.1", 0, lambda: True, lambda: True, LABELS, metrics.registry)
    server.start()
    try:
        before = scrape(server.port)
        assert before[("pdserve:kv_tier_loaded_tokens_total", "")] == 0
        assert not [k for k in before if k[1]], "no tier series before a tier reports"
        host = TierStats("host", hits=3, misses=1, bytes_read=300, load_seconds=0.5)
        store = TierStats("redis://127.0.0.1:1/0", misses=4, errors=2, bad_objects=1)
        rates = (TierRate("host", 600.0, 0, 0.004), TierRate("redis://127.0.0.1:1/0", 0.0, 5))
        metrics.tiers.publish(TierReport((host, store), rates, tokens_loaded=48))
        after = scrape(server.port)
    finally:
        server.close()
    assert after[("pdserve:kv_tier_loaded_tokens_total", "")] == 48
    assert after[("pdserve:kv_tier_hits_total", "host")] == 3
    assert after[("pdserve:kv_tier_misses_total", "host")] == 1
    assert after[("pdserve:kv_tier_loaded_bytes_total", "host")] == 300
    assert after[("pdserve:kv_tier_load_seconds_total", "host")] == 0.5
    assert after[("pdserve:kv_tier_load_bytes_per_second", "host")] == 600
    assert after[("pdserve:kv_tier_load_latency_seconds", "host")] == 0.004
    assert after[("pdserve:kv_tier_misses_total", "redis")] == 4
    assert after[("pdserve:kv_tier_errors_total", "redis")] == 2
    assert after[("pdserve:kv_tier_bad_objects_total", "redis")] == 1
    assert after[("pdserve:kv_tier_recompute_chosen_total", "redis")] == 5
    assert after[("pdserve:kv_tier_stored_bytes_total", "redis")] == 0

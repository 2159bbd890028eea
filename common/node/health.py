"""A node's small HTTP endpoint for orchestrators: liveness, readiness and load metrics.

`--health-port P` serves, on `--host`:

- `/live`: 200 while the node loop made progress within `--stall-timeout` (the same rule as
  the liveness proofs it sends routers), else 503: a liveness probe restarts a wedged node.
- `/ready`: 200 once a router has accepted the node's registration and while it is not
  draining, else 503: a readiness probe keeps a starting or draining node out of rotation.
- `/metrics`: Prometheus text with the gauges an autoscaler needs per role (`NODE_METRICS`),
  the engine's counters (`NODE_COUNTERS`) and the node's request metrics (`stages.NodeMetrics`).

It runs in a daemon thread (stdlib `http.server`), reads values the loop publishes in one
`HealthState`, and never touches the engine: a probe cannot slow or break a step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LIVE_PATH = "/live"
READY_PATH = "/ready"
METRICS_PATH = "/metrics"

# Gauge name -> help. Prefill nodes are short of capacity when queued prefill tokens grow;
# decode nodes when KV usage or running requests grow.
NODE_METRICS: dict[str, str] = {
    "pdserve_node_queued_prefill_tokens": "prompt tokens waiting to be prefilled",
    "pdserve_node_kv_cache_usage": "fraction of KV blocks in use (0 to 1)",
    "pdserve:kv_cache_usage_perc": "fraction of KV blocks in use (0 to 1; vLLM's name)",
    "pdserve_node_free_kv_blocks": "KV blocks free",
    "pdserve_node_running_requests": "requests in the running batch",
    "pdserve_node_waiting_requests": "requests queued, not yet running",
    "pdserve_node_draining": "1 while shutting down (SIGTERM), else 0",
    "pdserve_node_prefill_tokens_per_second": "prompt tokens/s of recent prefill steps",
    "pdserve_node_kv_received_bytes": "KV page bytes received from prefill nodes (decode role)",
    # Speculative decoding (--speculative-config), vLLM's counters since the node started.
    "pdserve_node_spec_decode_num_drafts": "verify steps of a request with drafted tokens",
    "pdserve_node_spec_decode_num_draft_tokens": "tokens drafted",
    "pdserve_node_spec_decode_num_accepted_tokens": "drafted tokens accepted",
}
# Counter name (exported with `_total`) -> help: the engine's totals since the node started,
# published with the gauges (vLLM's names).
NODE_COUNTERS: dict[str, str] = {
    "pdserve:prefix_cache_queries": "prompt tokens looked up in the prefix cache",
    "pdserve:prefix_cache_hits": "prompt tokens the prefix cache held",
    "pdserve:num_preemptions": "requests preempted (freed to be recomputed later)",
}


_FAMILIES = ((GaugeMetricFamily, NODE_METRICS), (CounterMetricFamily, NODE_COUNTERS))


class HealthServer:
    """The HTTP endpoint of one node, on its own daemon thread. `live` and `ready` are called
    from that thread (they only read flags); `gauges` is a dict the node loop replaces whole
    at each heartbeat (one reference swap: no lock needed). `registry` holds the node's own
    metrics; the gauges join it."""

    def __init__(
        self,
        host: str,
        port: int,
        live: Callable[[], bool],
        ready: Callable[[], bool],
        labels: dict[str, str],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.gauges: dict[str, float] = dict.fromkeys([*NODE_METRICS, *NODE_COUNTERS], 0.0)
        self._live, self._ready = live, ready
        self._registry = registry or CollectorRegistry()
        self._registry.register(_Collector(self, labels))
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="health", daemon=True
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a serve_forever that never ran
            self._server.shutdown()
        self._server.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == METRICS_PATH:
                    self._answer(200, generate_latest(server._registry), CONTENT_TYPE_LATEST)
                elif path in (LIVE_PATH, READY_PATH):
                    ok = server._live() if path == LIVE_PATH else server._ready()
                    body = b'{"status": "ok"}' if ok else b'{"status": "unavailable"}'
                    self._answer(200 if ok else 503, body, "application/json")
                else:
                    self._answer(404, b'{"status": "not found"}', "application/json")

            def _answer(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # probes every few seconds: quiet
                pass

        return Handler


class _Collector(Collector):
    """The node's gauges and engine counters as the loop last published them."""

    def __init__(self, server: HealthServer, labels: dict[str, str]) -> None:
        self._server, self._labels = server, labels

    def collect(self) -> Iterator[Metric]:
        gauges = self._server.gauges
        names, values = list(self._labels), list(self._labels.values())
        for kind, metrics in _FAMILIES:
            for name, text in metrics.items():
                family = kind(name, text, labels=names)
                family.add_metric(values, gauges.get(name, 0.0))
                yield family

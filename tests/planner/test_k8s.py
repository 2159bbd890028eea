"""The planner on Kubernetes, offline: `KubeExecutor` against a fake API server (a local HTTP
server) checking what it reads and the PATCH it sends, and deploy/planner.yaml against the
schemas, the `pdserve planner` parser and the calls the executor makes (its Role must allow
each, and nothing else)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pdserve.planner.__main__ import build_parser
from pdserve.planner.k8s import MERGE_PATCH, KubeExecutor, KubeTarget
from pdserve.planner.policy import Decision
from pdserve.planner.snapshot import DECODE, PREFILL, NodeView
from tests.bench.fake_llamacpp import JsonHandler
from tests.deploy.test_manifests import K8S_VERSION, of_kind

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "planner.yaml"
DEPLOYMENTS = "/apis/apps/v1/namespaces/ns/deployments/"


class _Api(JsonHandler):
    """Two Deployments (replicas, ready replicas); records every call."""

    state: dict[str, list[int]] = {}
    calls: list[tuple[str, str, dict[str, str], dict | None]] = []

    def do_GET(self) -> None:  # noqa: N802
        self._record(None)
        name = self.path.removeprefix(DEPLOYMENTS).removesuffix("/scale")
        if name not in self.state:
            self.reply(404, {"kind": "Status", "code": 404})
            return
        wanted, ready = self.state[name]
        self.reply(200, {"spec": {"replicas": wanted}, "status": {"readyReplicas": ready}})

    def do_PATCH(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._record(body)
        name = self.path.removeprefix(DEPLOYMENTS).removesuffix("/scale")
        self.state[name][0] = body["spec"]["replicas"]
        self.reply(200, {"spec": body["spec"]})

    def _record(self, body: dict | None) -> None:
        self.calls.append((self.command, self.path, dict(self.headers), body))


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeExecutor]:
    _Api.state = {"pdserve-prefill": [1, 1], "pdserve-decode": [2, 1]}
    _Api.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("t0\n")
    url = f"http://127.0.0.1:{server.server_port}"
    target = KubeTarget(url, "ns", "pdserve-prefill", "pdserve-decode", token, ca_file=None)
    try:
        yield KubeExecutor(target)
    finally:
        server.shutdown()
        server.server_close()


def test_the_executor_counts_pods_and_patches_the_scale(api: KubeExecutor) -> None:
    nodes = api.nodes(None, now=50.0)
    assert nodes == (
        NodeView("pdserve-prefill-0", PREFILL, True, 0.0),
        NodeView("pdserve-decode-0", DECODE, True, 0.0),
        NodeView("pdserve-decode-1", DECODE, False, 50.0),  # missing since the planner saw it
    )
    assert api.nodes(None, now=80.0)[2].started_at == 50.0  # still the first time seen
    api.target.token_file.write_text("t1")  # a rotated token is read again
    api.apply(Decision(80.0, 3, 2, (), (1, 2)), ())
    method, path, headers, body = _Api.calls[-1]
    assert (method, path, body) == ("PATCH", DEPLOYMENTS + "pdserve-prefill/scale",
                                    {"spec": {"replicas": 3}})  # fmt: skip
    assert headers["Content-Type"] == MERGE_PATCH and headers["Authorization"] == "Bearer t1"
    assert [c[0] for c in _Api.calls].count("PATCH") == 1  # decode already had 2: untouched
    api.apply(Decision(90.0, None, None, ("no figures",), (3, 2)), ())
    assert [c[0] for c in _Api.calls].count("PATCH") == 1  # no decision: nothing sent


def test_an_api_error_is_an_oserror_for_the_loop(api: KubeExecutor) -> None:
    del _Api.state["pdserve-decode"]
    with pytest.raises(OSError, match="404"):
        api.nodes(None, now=0.0)


def _manifest() -> list[dict]:
    return list(yaml.safe_load_all(MANIFEST.read_text()))


def test_the_manifest_passes_the_schemas_and_the_parser() -> None:
    docs = _manifest()
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "planner"
    args = build_parser().parse_args(container["args"][1:])
    assert {args.prefill_deployment, args.decode_deployment} == {
        d["metadata"]["name"] for d in of_kind("base", "Deployment")
    }
    assert container["ports"][0]["containerPort"] == args.metrics_port
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["subjects"][0]["name"] == account


def test_the_role_allows_every_call_the_executor_makes(api: KubeExecutor) -> None:
    api.nodes(None, now=0.0)
    api.apply(Decision(0.0, 2, 3, (), (1, 2)), ())
    rules = next(d for d in _manifest() if d["kind"] == "Role")["rules"]
    verbs = {"GET": "get", "PATCH": "patch"}
    for method, path, _, _ in _Api.calls:
        name, _, sub = path.removeprefix(DEPLOYMENTS).partition("/")
        resource = "deployments" + (f"/{sub}" if sub else "")
        assert any("apps" in r["apiGroups"] and resource in r["resources"]
                   and name in r["resourceNames"] and verbs[method] in r["verbs"]
                   for r in rules), f"the Role does not allow {method} {path}"  # fmt: skip
    allowed = {(res, verb) for r in rules for res in r["resources"] for verb in r["verbs"]}
    assert allowed == {("deployments", "get"), ("deployments/scale", "patch")}

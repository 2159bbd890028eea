"""`KubeExecutor`: the planner's decisions on Kubernetes, as the replicas of the prefill and
decode Deployments (`pdserve planner`, deploy/planner.yaml). It reads each Deployment and
patches its `scale` subresource through the API server, with the pod's service account token,
over HTTPS checked against the service account's CA: a small client on `urllib`, since two
calls do not justify the `kubernetes` package and its dependencies in the image.

Kubernetes does what the supervisor does in `pdserve serve`: a pod is drained by its preStop
and grace period (deploy/kubernetes), a scale-down removes not-ready pods first (so a pod that
never becomes ready goes with the next decision that leaves it out), and there is no role
flip: each role is its own Deployment.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pdserve.planner.actions import Action
from pdserve.planner.policy import Decision
from pdserve.planner.snapshot import DECODE, PREFILL, NodeView

ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True, slots=True)
class KubeTarget:
    """Where the API server is, how to reach it, and the Deployment of each role."""

    api: str  # https://host:port
    namespace: str
    prefill: str
    decode: str
    token_file: Path = ACCOUNT / "token"
    ca_file: Path | None = ACCOUNT / "ca.crt"

    @classmethod
    def in_cluster(cls, prefill: str, decode: str, namespace: str | None = None) -> KubeTarget:
        """The API server and namespace a pod sees (its environment and service account)."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise ValueError("not in a Kubernetes pod: KUBERNETES_SERVICE_HOST is not set")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        namespace = namespace or (ACCOUNT / "namespace").read_text().strip()
        return cls(f"https://{host}:{port}", namespace, prefill, decode)

    def path(self, role: str, scale: bool = False) -> str:
        name = self.prefill if role == PREFILL else self.decode
        tail = "/scale" if scale else ""
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}{tail}"


class KubeExecutor:
    """Counts each Deployment's pods as nodes (its ready replicas ready, the rest starting
    since the planner first saw them missing) and sets its replicas to the decision's."""

    def __init__(self, target: KubeTarget, timeout: float = 10.0) -> None:
        self.target = target
        self.timeout = timeout
        self._tls = None if target.ca_file is None else ssl.create_default_context(
            cafile=str(target.ca_file))  # fmt: skip
        self._replicas: dict[str, int] = {}
        self._unready_since: dict[str, float] = {}

    def nodes(self, registered: frozenset[str] | None, now: float) -> tuple[NodeView, ...]:
        out: list[NodeView] = []
        for role in (PREFILL, DECODE):
            deployment = self._call("GET", self.target.path(role))
            wanted = deployment["spec"].get("replicas", 1)
            ready = min(wanted, deployment.get("status", {}).get("readyReplicas", 0))
            self._replicas[role] = wanted
            since = self._unready_since.setdefault(role, now) if ready < wanted else now
            if ready == wanted:
                self._unready_since.pop(role, None)
            name = self.target.prefill if role == PREFILL else self.target.decode
            out += [NodeView(f"{name}-{i}", role, i < ready, 0.0 if i < ready else since)
                    for i in range(wanted)]  # fmt: skip
        return tuple(out)

    def apply(self, decision: Decision, actions: tuple[Action, ...]) -> None:
        if not decision.decided:
            return
        for role, count in ((PREFILL, decision.prefill), (DECODE, decision.decode)):
            if self._replicas.get(role) != count:
                body = {"spec": {"replicas": count}}
                self._call("PATCH", self.target.path(role, scale=True), body)
                self._replicas[role] = count  # type: ignore[assignment]

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        """One API call; OSError (urllib's errors among them) when it fails."""
        token = self.target.token_file.read_text().strip()  # re-read: bound tokens rotate
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), MERGE_PATCH
        request = urllib.request.Request(self.target.api + path, data, headers, method=method)
        with urllib.request.urlopen(request, timeout=self.timeout, context=self._tls) as resp:
            return json.loads(resp.read())

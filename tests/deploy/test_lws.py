"""overlays/lws, checked offline like the other renderings (test_manifests.py, whose helpers
this reuses): each node a tensor-parallel group across hosts, a LeaderWorkerSet of a leader
(rank 0, the node) and worker pods (`pdserve tp-worker`). The LeaderWorkerSets are checked
against the LWS CRD's schema, the rest against the Kubernetes schemas; the pods are the ones
the LWS controller makes of the templates (its labels and env vars added), their args parsed
by the real parsers, and ports, probes, mounts and network policy checked against them."""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdserve.cli import COMMANDS
from pdserve.common.engine.tensor_parallel_worker import worker_parser
from pdserve.common.node.health import NODE_METRICS
from tests.deploy.kustomize import Resource, normalized, render
from tests.deploy.test_manifests import (
    DRAIN_MARGIN_S,
    IMAGE_TAGS,
    K8S_VERSION,
    KUBE,
    NAMESPACE,
    PROMETHEUS,
    SAMPLE_FIELDS,
    STRANGER,
    Client,
    Workload,
    admits,
    dockerfile,
    expand,
    kubectl_kustomize,
    mount_at,
    parse,
    probe,
    selects,
    volume,
)
from tests.deploy.test_manifests import rendered as rendered_overlay

OVERLAY = KUBE / "overlays" / "lws"
SCHEMA = Path(__file__).with_name("leaderworkerset-v1.schema.json")
LWS_API = "leaderworkerset.x-k8s.io/v1"
# What the LWS controller sets on each pod it makes (kubernetes-sigs/lws, api/.../v1).
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP = 0  # the group whose pods the tests build; every group's are alike
DYNAMIC_PORT = 41234  # a port gloo's listener might get from the kernel


@cache
def rendered() -> tuple[Resource, ...]:
    return tuple(render(OVERLAY))


def of_kind(kind: str) -> list[Resource]:
    return [r for r in rendered() if r["kind"] == kind]


def leader_address(lws: str) -> str:
    """LWS_LEADER_ADDRESS: the leader pod's name under the headless Service the controller
    makes for the set (named as the set), in its namespace."""
    return f"{lws}-{GROUP}.{lws}.{NAMESPACE}"


def created_pod(lws: Resource, index: int) -> Resource:
    """The pod the controller makes for worker `index` (0: the leader) of group 0, with the
    labels and env vars it adds, shaped as a Deployment for `Workload`."""
    spec = lws["spec"]["leaderWorkerTemplate"]
    template = copy.deepcopy(spec["leaderTemplate" if index == 0 else "workerTemplate"])
    name = lws["metadata"]["name"]
    labels = {NAME_LABEL: name, GROUP_LABEL: str(GROUP), WORKER_LABEL: str(index)}
    template["metadata"]["labels"].update(labels)
    env = [
        {"name": "LWS_LEADER_ADDRESS", "value": leader_address(name)},
        {"name": "LWS_GROUP_SIZE", "value": str(spec["size"])},
        {"name": "LWS_WORKER_INDEX", "value": str(index)},
    ]
    pod = template["spec"]
    for container in pod.get("initContainers", []) + pod["containers"]:
        container["env"] = env + container.get("env", [])
    return {"kind": lws["kind"], "metadata": lws["metadata"], "spec": {"template": template}}


def parse_worker(container: dict[str, Any]) -> argparse.Namespace:
    """Parse a worker's args with `pdserve tp-worker`'s parser; fail on a refusal."""
    argv = expand(container)
    assert argv[:1] == ["tp-worker"] and "tp-worker" in COMMANDS, f"a worker runs {argv[:1]}"
    try:
        return worker_parser().parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"`pdserve {' '.join(argv)}` is refused by its parser (exit {exc.code})")


def pod_workload(lws: Resource, index: int) -> Workload:
    resource = created_pod(lws, index)
    pod = resource["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1, f"{lws['metadata']['name']}: one container per pod"
    container = pod["containers"][0]
    if index > 0:
        return Workload(resource, pod, container, parse_worker(container), None)
    role = resource["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
    return Workload(resource, pod, container, *parse(role, container))


@dataclass(frozen=True)
class Group:
    """One LeaderWorkerSet's group: the leader's pod (rank 0, the node) and the workers'."""

    resource: Resource
    leader: Workload
    workers: tuple[Workload, ...]  # ranks 1..size-1

    @property
    def pods(self) -> tuple[Workload, ...]:
        return (self.leader, *self.workers)

    @property
    def name(self) -> str:
        return self.resource["metadata"]["name"]


@cache
def groups() -> dict[str, Group]:
    """role (prefill, decode) -> its group."""
    found = {}
    for lws in of_kind("LeaderWorkerSet"):
        size = lws["spec"]["leaderWorkerTemplate"]["size"]
        leader = pod_workload(lws, 0)
        workers = tuple(pod_workload(lws, i) for i in range(1, size))
        found[leader.labels["app.kubernetes.io/component"]] = Group(lws, leader, workers)
    assert set(found) == {"prefill", "decode"}, sorted(found)
    return found


@cache
def router() -> Workload:
    (sts,) = of_kind("StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    return Workload(sts, pod, pod["containers"][0], *parse("router", pod["containers"][0]))


def client(w: Workload) -> Client:
    return Client(tuple(w.labels.items()))


def clients() -> list[Client]:
    return [client(w) for w in [router()] + [pod for g in groups().values() for pod in g.pods]]


# --- schemas and rendering ---------------------------------------------------------------


def closed(schema: Any) -> Any:
    """The schema with every object refusing fields it does not name: the API server refuses
    them too under `kubectl apply`'s default strict field validation."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


@cache
def lws_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(closed(json.loads(SCHEMA.read_text())))


def check_lws(resource: Resource) -> None:
    error = jsonschema.exceptions.best_match(lws_validator().iter_errors(resource))
    if error is not None:
        raise error


def test_every_manifest_passes_its_schema() -> None:
    assert len(of_kind("LeaderWorkerSet")) == 2
    for r in rendered():
        where = f"{r['kind']} {r['metadata']['name']}"
        try:
            if r["apiVersion"] == LWS_API:
                check_lws(r)
            else:
                kubernetes_validate.validate(r, K8S_VERSION, strict=True)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")


def test_the_lws_schema_check_refuses_a_misspelt_field_and_an_unknown_policy() -> None:
    lws = of_kind("LeaderWorkerSet")[0]
    check_lws(lws)
    bad = copy.deepcopy(lws)
    pod = bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    pod["containers"][0]["livenesProbe"] = {}
    with pytest.raises(jsonschema.ValidationError, match="livenesProbe"):
        check_lws(bad)
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroup"
    with pytest.raises(jsonschema.ValidationError, match="RecreateGroup"):
        check_lws(bad)


def test_the_small_renderer_agrees_with_kubectl_kustomize() -> None:
    out = kubectl_kustomize(OVERLAY)
    assert out.returncode == 0, out.stderr
    theirs = normalized([r for r in yaml.safe_load_all(out.stdout) if r is not None])
    assert normalized(list(rendered())) == theirs


def test_the_groups_replace_the_node_deployments_and_the_rest_is_the_cpu_overlay() -> None:
    assert not of_kind("Deployment")
    cpu = normalized(list(rendered_overlay("cpu")))
    ours = normalized(list(rendered()))
    changed = {("HorizontalPodAutoscaler", f"pdserve-{r}") for r in ("prefill", "decode")}
    changed.add(("NetworkPolicy", "pdserve-nodes"))
    for key, resource in cpu.items():
        if key[0] != "Deployment" and key not in changed:
            assert ours.get(key) == resource, key
    assert {g.name for g in groups().values()} == {"pdserve-prefill", "pdserve-decode"}


def test_a_delete_patch_that_matches_nothing_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{KUBE / 'base'}]\n"
        "patches:\n  - patch: |-\n      $patch: delete\n      apiVersion: apps/v1\n"
        "      kind: Deployment\n      metadata: {name: pdserve-encode}\n"
    )
    with pytest.raises(ValueError, match="pdserve-encode"):
        render(tmp_path)


# --- a group: its size, its restarts, its commands ----------------------------------------


def test_a_group_is_a_leader_and_a_worker_per_other_rank() -> None:
    for g in groups().values():
        spec = g.resource["spec"]
        node = g.leader.node
        assert spec["leaderWorkerTemplate"]["size"] == node.tensor_parallel_size == 2
        assert (node.tp_workers, node.tp_port) == ("external", 8400)
        # A lost rank stops the whole node: the group restarts together.
        assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
        # The leader turns ready only after its workers joined: they start with it.
        assert spec.get("startupPolicy", "LeaderCreated") == "LeaderCreated"
        assert "replicas" not in spec, "`kubectl apply` would reset what the autoscaler chose"


def test_every_container_runs_a_pdserve_command_that_accepts_its_args() -> None:
    for g in groups().values():  # parsing happens in groups()
        for pod in g.pods:
            assert "command" not in pod.container, "`command` would bypass the image's pdserve"
            assert pod.args.host == "0.0.0.0", f"{g.name}: binds {pod.args.host}"
            assert pod.args.advertise_host == SAMPLE_FIELDS["status.podIP"]
        assert g.leader.node.node_id == SAMPLE_FIELDS["metadata.name"]


def test_the_worker_args_check_fails_on_a_misspelt_flag_or_an_undefined_variable() -> None:
    container = groups()["decode"].workers[0].container
    with pytest.raises(pytest.fail.Exception, match="refused"):
        parse_worker({**container, "args": container["args"] + ["--rnak", "1"]})
    plain = {**container, "env": [e for e in container["env"] if e["name"] != "LWS_WORKER_INDEX"]}
    with pytest.raises(AssertionError, match="LWS_WORKER_INDEX"):
        parse_worker(plain)


def test_workers_join_their_leader_s_rendezvous_as_their_own_rank() -> None:
    for g in groups().values():
        leader = f"{leader_address(g.name)}:{g.leader.node.tp_port}"
        for rank, worker in enumerate(g.workers, start=1):
            assert (worker.args.leader, worker.args.rank) == (leader, rank)
    services = {s["metadata"]["name"] for s in of_kind("Service")}
    assert not services & {g.name for g in groups().values()}, "the controller makes those"


def test_every_rank_has_its_pod_s_cpus_and_the_same_model_keys_and_cache() -> None:
    for g in groups().values():
        node = g.leader.node
        model, cache_dir = Path(g.leader.args.model), env_value(g.leader, "PDSERVE_CACHE_DIR")
        fetch = g.leader.pod["initContainers"][0]
        assert "pdserve.models import smollm2" in fetch["command"][-1]
        assert node.threads_per_rank, "the pods' threads must follow their CPU limit"
        for pod in g.pods:  # one rank per pod
            assert node.threads_per_rank <= float(pod.container["resources"]["limits"]["cpu"])
            # A worker gets the leader's paths through the rendezvous and reads them itself.
            assert "emptyDir" in volume(pod, mount_at(pod, str(model.parent))["name"])
            (init,) = pod.pod["initContainers"]
            assert init["command"] == fetch["command"], f"{g.name}: nothing fetches {model.name}"
            assert init["volumeMounts"] == fetch["volumeMounts"]
            assert pod.pod["securityContext"] == g.leader.pod["securityContext"]
            curve = mount_at(pod, node.curve_dir)
            assert volume(pod, curve["name"])["secret"]["secretName"] == "pdserve-curve"
            assert env_value(pod, "PDSERVE_CACHE_DIR") == cache_dir
            assert mount_at(pod, cache_dir)
            assert pod.container["image"] == IMAGE_TAGS["cpu"]
        assert (g.leader.args.device, node.kv_connector) == ("cpu", "zmq")


def test_every_pod_runs_as_the_image_s_user() -> None:
    _, stages = dockerfile()
    users = [rest for op, rest in stages[-1].instructions if op == "USER"]
    for g in groups().values():
        for pod in g.pods:
            assert pod.pod["securityContext"]["runAsUser"] == int(users[-1]), g.name


def env_value(w: Workload, name: str) -> str:
    values = [e["value"] for e in w.container["env"] if e["name"] == name]
    assert values, f"{w.container['name']}: no {name}"
    return values[0]


def test_each_pod_of_a_group_runs_on_its_own_host() -> None:
    for g in groups().values():
        for pod in g.pods:
            terms = pod.pod["affinity"]["podAntiAffinity"]
            terms = terms["requiredDuringSchedulingIgnoredDuringExecution"]
            on_host = [t for t in terms if t["topologyKey"] == "kubernetes.io/hostname"]
            others = [p for p in g.pods if p is not pod]
            assert others and all(
                any(selects(t["labelSelector"], other.labels) for t in on_host) for other in others
            ), f"{g.name}: two ranks could share a host"


# --- ports, probes, lifecycle -------------------------------------------------------------


def test_container_ports_are_the_ports_in_the_args() -> None:
    for role, g in groups().items():
        node = g.leader.node
        named = {p["name"]: p["containerPort"] for p in g.leader.container["ports"]}
        expected = {"health": node.health_port, "tp": node.tp_port}
        if role == "decode":
            expected["kv"] = node.kv_port
        assert named == expected
        for rank, worker in enumerate(g.workers, start=1):
            ports = {p["containerPort"] for p in worker.container.get("ports", [])}
            # A decode rank's KV receiver binds the leader's --kv-port + its rank.
            assert ports == ({node.kv_port + rank} if role == "decode" else set())


def test_the_leader_is_probed_and_scraped_and_a_worker_serves_no_http() -> None:
    for g in groups().values():
        port = g.leader.node.health_port
        assert probe(g.leader, "livenessProbe") == (port, "/live")
        assert probe(g.leader, "startupProbe") == (port, "/live")
        assert probe(g.leader, "readinessProbe") == (port, "/ready")
        notes = g.leader.resource["spec"]["template"]["metadata"]["annotations"]
        assert int(notes["prometheus.io/port"]) == port
        for worker in g.workers:
            assert not [k for k in worker.container if k.endswith("Probe")]
            assert "annotations" not in worker.resource["spec"]["template"]["metadata"]


def test_the_leader_registers_with_every_router_by_its_stable_name() -> None:
    sts = router().resource
    names = {
        f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{router().args.control_port}"
        for i in range(sts["spec"]["replicas"])
    }
    for g in groups().values():
        assert set(g.leader.node.router_addrs) == names


def test_grace_periods_outlast_the_leader_s_drain() -> None:
    for g in groups().values():
        drain = g.leader.node.drain_timeout
        for pod in g.pods:  # a worker gone mid-drain breaks the group
            assert pod.pod["terminationGracePeriodSeconds"] >= drain + DRAIN_MARGIN_S


def test_autoscalers_scale_groups_and_budgets_cover_every_rank() -> None:
    by_name = {g.name: g for g in groups().values()}
    scaled = set()
    for hpa in of_kind("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == (LWS_API, "LeaderWorkerSet")
        scaled.add(ref["name"])
        assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= set(NODE_METRICS)
    assert scaled == set(by_name)
    budgets = of_kind("PodDisruptionBudget")
    for g in by_name.values():
        for pod in g.pods:
            assert [b for b in budgets if selects(b["spec"]["selector"], pod.labels)], g.name


# --- network policy -----------------------------------------------------------------------


def test_every_pdserve_pod_reaches_each_decode_rank_s_kv_port() -> None:
    policies = of_kind("NetworkPolicy")
    decode = groups()["decode"]
    kv = decode.leader.node.kv_port
    receivers = [(pod, kv + rank) for rank, pod in enumerate(decode.pods)]
    for pod, port in receivers:
        assert all(admits(policies, pod, port, c) for c in clients()), port
        assert not admits(policies, pod, port, STRANGER)
        assert not admits(policies, pod, port, PROMETHEUS)
    for g in groups().values():
        health = g.leader.node.health_port
        assert admits(policies, g.leader, health, PROMETHEUS), "metrics: the autoscalers"
        assert not admits(policies, g.leader, health, STRANGER)


def test_a_group_s_ranks_reach_each_other_and_nobody_else_does() -> None:
    policies = of_kind("NetworkPolicy")
    for g in groups().values():
        tp_port = g.leader.node.tp_port
        for worker in g.workers:
            assert admits(policies, g.leader, tp_port, client(worker))
        others = [pod for o in groups().values() if o is not g for pod in o.pods]
        outsiders = [STRANGER, PROMETHEUS, client(router())] + [client(p) for p in others]
        for pod in g.pods:  # gloo listens on a port the kernel picks, on every rank
            assert all(admits(policies, pod, DYNAMIC_PORT, client(peer)) for peer in g.pods)
            assert not any(admits(policies, pod, DYNAMIC_PORT, c) for c in outsiders)
            assert not any(admits(policies, pod, tp_port, c) for c in outsiders)


def test_the_group_policy_needs_the_label_the_controller_sets() -> None:
    policies = of_kind("NetworkPolicy")
    g = groups()["decode"]
    unlabelled = Client(tuple((k, v) for k, v in g.workers[0].labels.items() if k != NAME_LABEL))
    assert admits(policies, g.leader, g.leader.node.tp_port, client(g.workers[0]))
    assert not admits(policies, g.leader, g.leader.node.tp_port, unlabelled)

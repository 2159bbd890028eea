"""deploy/, checked offline (no cluster, no image build): every manifest of the base and both
overlays, as rendered, against the Kubernetes schemas; every container's args through the
real `pdserve` parsers; and every port, probe path, metric name, mount and network rule
against what those parsers and `pdserve.common.node.health` say."""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from pdserve.cli import COMMANDS
from pdserve.common.node.config import NodeConfig
from pdserve.common.node.health import LIVE_PATH, METRICS_PATH, NODE_METRICS, READY_PATH
from pdserve.common.node.launch import parse_node_args
from pdserve.models import SMOLLM2_MEMBER
from pdserve.router.__main__ import parse_args as parse_router_args
from pdserve.router.middleware import OPEN_ROUTES
from tests.deploy.kustomize import Resource, normalized, render

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
RENDERINGS = {
    "base": KUBE / "base",
    "cpu": KUBE / "overlays" / "cpu",
    "cuda": KUBE / "overlays" / "cuda",
    "tp": KUBE / "overlays" / "tp",
}
IMAGE_TAGS = {"base": "pdserve", "cpu": "pdserve:0.1.0-cpu", "cuda": "pdserve:0.1.0-cuda",
              "tp": "pdserve:0.1.0-cpu"}  # fmt: skip
K8S_VERSION = "1.30"  # the schemas checked: the oldest Kubernetes the manifests target
DRAIN_MARGIN_S = 10  # grace beyond --drain-timeout: the exit after the drain
CURVE_SECRET = "pdserve-curve"
CURVE_FILES = {"cluster.key", "cluster.key_secret"}
NAMESPACE = "pdserve"  # any one namespace: the manifests name none
# What the downward API gives each field the manifests read, in one sample pod.
SAMPLE_FIELDS = {"status.podIP": "10.4.2.7", "metadata.name": "pdserve-decode-6d9c7b-x2x7q"}

by_rendering = pytest.mark.parametrize("name", list(RENDERINGS))


@cache
def rendered(name: str) -> tuple[Resource, ...]:
    return tuple(render(RENDERINGS[name]))


def of_kind(name: str, kind: str) -> list[Resource]:
    return [r for r in rendered(name) if r["kind"] == kind]


@dataclass(frozen=True)
class Workload:
    """One role's pod template, its pdserve container, and what the container's args parse to."""

    resource: Resource
    pod: dict[str, Any]
    container: dict[str, Any]
    args: argparse.Namespace
    node: NodeConfig | None  # None for a router

    @property
    def labels(self) -> dict[str, str]:
        return self.resource["spec"]["template"]["metadata"]["labels"]

    def port(self, ref: int | str) -> int:
        """A probe's or a Service's port, given as a number or as a container port's name."""
        if isinstance(ref, int):
            return ref
        named = {p["name"]: p["containerPort"] for p in self.container["ports"]}
        assert ref in named, f"{self.container['name']}: no container port named {ref!r}"
        return named[ref]


def expand(container: dict[str, Any]) -> list[str]:
    """The container's args as the kubelet passes them: each $(VAR) replaced by the value of
    the container's env var VAR (a literal, or the sample pod's downward-API field)."""
    values = {}
    for env in container.get("env", []):
        field = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if "value" in env or field in SAMPLE_FIELDS:
            values[env["name"]] = env["value"] if "value" in env else SAMPLE_FIELDS[field]

    def value(match: re.Match[str]) -> str:
        assert match[1] in values, (
            f"{container['name']}: $({match[1]}) names no env var with a value or a field "
            "the tests know; the kubelet would pass it on as written"
        )
        return values[match[1]]

    return [re.sub(r"\$\((\w+)\)", value, arg) for arg in container.get("args", [])]


def parse(role: str, container: dict[str, Any]) -> tuple[argparse.Namespace, NodeConfig | None]:
    """Parse the container's args with the parser `pdserve ROLE` uses; fail on a refusal."""
    argv = expand(container)
    assert argv and argv[0] in COMMANDS, f"{container['name']}: {argv[:1]} is no pdserve command"
    assert argv[0] == role, f"the {role} pod runs `pdserve {argv[0]}`"
    try:
        if role == "router":
            return parse_router_args(argv[1:]), None
        return parse_node_args(f"pdserve {role}", role, argv[1:])
    except SystemExit as exc:
        pytest.fail(f"`pdserve {shlex.join(argv)}` is refused by its parser (exit {exc.code})")


@cache
def workloads(name: str) -> dict[str, Workload]:
    """role (router, prefill, decode) -> its Workload, in one rendering."""
    found = {}
    for r in rendered(name):
        if r["kind"] not in ("Deployment", "StatefulSet"):
            continue
        role = r["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = r["spec"]["template"]["spec"]
        assert len(pod["containers"]) == 1, f"{role}: one container per pod"
        args, node = parse(role, pod["containers"][0])
        found[role] = Workload(r, pod, pod["containers"][0], args, node)
    assert set(found) == {"router", "prefill", "decode"}, sorted(found)
    return found


def nodes(name: str) -> list[Workload]:
    return [w for role, w in workloads(name).items() if role != "router"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector matches `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    tests: dict[str, Callable[[str, list[str]], bool]] = {
        "In": lambda key, values: labels.get(key) in values,
        "NotIn": lambda key, values: labels.get(key) not in values,
        "Exists": lambda key, values: key in labels,
        "DoesNotExist": lambda key, values: key not in labels,
    }
    return all(
        tests[e["operator"]](e["key"], e.get("values", []))
        for e in selector.get("matchExpressions", [])
    )


# --- schemas and rendering ---------------------------------------------------------------


@by_rendering
def test_every_manifest_passes_the_kubernetes_schemas(name: str) -> None:
    for r in rendered(name):
        where = f"{name}: {r['kind']} {r['metadata']['name']}"
        try:
            kubernetes_validate.validate(r, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")


def test_the_schema_check_refuses_a_misspelt_field() -> None:
    deployment = copy.deepcopy(of_kind("base", "Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def kubectl_kustomize(directory: Path) -> subprocess.CompletedProcess[str]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: the small renderer is not compared with Kustomize")
    return subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )


@by_rendering
def test_the_small_renderer_agrees_with_kubectl_kustomize(name: str) -> None:
    out = kubectl_kustomize(RENDERINGS[name])
    assert out.returncode == 0, out.stderr
    theirs = normalized([r for r in yaml.safe_load_all(out.stdout) if r is not None])
    assert normalized(list(rendered(name))) == theirs


def test_the_small_renderer_refuses_a_field_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [../base]\ncommonLabels: {team: serving}\n"
    )
    with pytest.raises(ValueError, match="commonLabels"):
        render(tmp_path)


def test_the_cuda_overlay_stops_when_the_base_args_move(tmp_path: Path) -> None:
    tree = shutil.copytree(KUBE, tmp_path / "kubernetes")
    prefill = tree / "base" / "prefill.yaml"
    text = prefill.read_text()
    flag = "            - --kv-connector\n"
    moved = text.replace(flag, "            - --seed\n            - '1'\n" + flag, 1)
    assert moved != text
    prefill.write_text(moved)
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        render(tree / "overlays" / "cuda")
    if shutil.which("kubectl"):
        assert kubectl_kustomize(tree / "overlays" / "cuda").returncode != 0


# --- commands, flags and ports -------------------------------------------------------------


@by_rendering
def test_every_container_runs_a_pdserve_command_that_accepts_its_args(name: str) -> None:
    for role, w in workloads(name).items():  # parsing happens in workloads()
        assert "command" not in w.container, f"{role}: `command` would bypass the image's pdserve"
        assert w.args.host == "0.0.0.0", f"{role}: binds {w.args.host}, unreachable from others"


def test_the_args_check_fails_on_a_misspelt_flag_or_an_undefined_variable() -> None:
    container = workloads("base")["decode"].container
    with pytest.raises(pytest.fail.Exception, match="refused"):
        parse("decode", {**container, "args": container["args"] + ["--health-prot", "1"]})
    with pytest.raises(AssertionError, match="NODE_IP"):
        parse("decode", {**container, "args": container["args"] + ["--node-id", "$(NODE_IP)"]})


@by_rendering
def test_container_ports_are_the_ports_in_the_args(name: str) -> None:
    w = workloads(name)
    router = w["router"]
    assert (router.port("http"), router.port("control")) == (
        router.args.port,
        router.args.control_port,
    )
    for node in nodes(name):
        assert node.node.health_port > 0, f"{node.container['name']}: no --health-port"
        assert node.port("health") == node.node.health_port
    assert w["decode"].port("kv") == w["decode"].node.kv_port > 0
    ports = {p["name"] for p in w["prefill"].container["ports"]}
    assert ports == {"health"}, "a prefill node binds no KV port"


@by_rendering
def test_nodes_advertise_their_pod_ip(name: str) -> None:
    for node in nodes(name):
        assert node.node.advertise_host == SAMPLE_FIELDS["status.podIP"]
        assert node.node.node_id == SAMPLE_FIELDS["metadata.name"]


@by_rendering
def test_services_reach_the_router_ports(name: str) -> None:
    router = workloads(name)["router"]
    sts = router.resource
    services = {s["metadata"]["name"]: s for s in of_kind(name, "Service")}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    # Nodes resolve a router by this name before it is ready (ready needs nodes).
    assert headless["spec"]["publishNotReadyAddresses"] is True
    api = services["pdserve-router"]
    for svc, port in ((headless, router.args.control_port), (api, router.args.port)):
        assert selects({"matchLabels": svc["spec"]["selector"]}, router.labels)
        assert [router.port(p["targetPort"]) for p in svc["spec"]["ports"]] == [port]


@by_rendering
def test_nodes_register_with_every_router_by_its_stable_name(name: str) -> None:
    router = workloads(name)["router"]
    sts = router.resource
    names = {
        f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{router.args.control_port}"
        for i in range(sts["spec"]["replicas"])
    }
    assert len(names) >= 2
    for node in nodes(name):
        assert set(node.node.router_addrs) == names


@by_rendering
def test_probes_hit_the_health_endpoints(name: str) -> None:
    router = workloads(name)["router"]
    assert probe(router, "livenessProbe") == (router.args.port, "/live")
    assert probe(router, "startupProbe") == (router.args.port, "/live")
    assert probe(router, "readinessProbe") == (router.args.port, "/health")
    assert {"/live", "/health"} <= set(OPEN_ROUTES), "probes carry no API key"
    for node in nodes(name):
        port = node.node.health_port
        assert probe(node, "livenessProbe") == (port, LIVE_PATH)
        assert probe(node, "startupProbe") == (port, LIVE_PATH)
        assert probe(node, "readinessProbe") == (port, READY_PATH)


def probe(w: Workload, kind: str) -> tuple[int, str]:
    get = w.container[kind]["httpGet"]
    return w.port(get["port"]), get["path"]


@by_rendering
def test_grace_period_outlasts_the_drain(name: str) -> None:
    for node in nodes(name):
        grace = node.pod["terminationGracePeriodSeconds"]
        assert grace >= node.node.drain_timeout + DRAIN_MARGIN_S, (
            f"{node.container['name']}: killed {grace}s after SIGTERM, drains for up to "
            f"{node.node.drain_timeout}s"
        )


# --- secrets, model, user ------------------------------------------------------------------


@by_rendering
def test_curve_keys_are_mounted_where_curve_dir_points(name: str) -> None:
    for role, w in workloads(name).items():
        curve_dir = w.node.curve_dir if w.node else w.args.curve_dir
        mount = mount_at(w, curve_dir)
        assert mount.get("readOnly") is True
        secret = volume(w, mount["name"])["secret"]
        assert secret["secretName"] == CURVE_SECRET and "items" not in secret
        # The non-root user reads the keys through its group (fsGroup).
        assert secret["defaultMode"] & 0o040, f"{role}: keys unreadable by the pod's fsGroup"
        assert w.pod["securityContext"]["fsGroup"] == w.pod["securityContext"]["runAsGroup"]


def mount_at(w: Workload, path: str) -> dict[str, Any]:
    mounts = [m for m in w.container["volumeMounts"] if m["mountPath"] == path]
    assert mounts, f"{w.container['name']}: nothing is mounted at {path}"
    return mounts[0]


def volume(w: Workload, name: str) -> dict[str, Any]:
    return next(v for v in w.pod["volumes"] if v["name"] == name)


@by_rendering
def test_the_api_key_comes_from_a_secret(name: str) -> None:
    router = workloads(name)["router"]
    assert "--api-key" not in router.container["args"], "args show in `kubectl describe`"
    env = {e["name"]: e for e in router.container["env"]}
    assert env["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "pdserve-api-key"


@by_rendering
def test_the_model_is_fetched_onto_the_volume_the_args_name(name: str) -> None:
    models = {w.args.model for w in workloads(name).values()}
    assert len(models) == 1, f"roles serve different models: {models}"
    model = Path(models.pop())
    assert model.name == Path(SMOLLM2_MEMBER).name
    for w in workloads(name).values():
        mount = mount_at(w, str(model.parent))
        assert "emptyDir" in volume(w, mount["name"])
        fetch = [c for c in w.pod["initContainers"] if c["name"] == "fetch-model"][0]
        assert "pdserve.models import smollm2" in fetch["command"][-1]
        env = {e["name"]: e.get("value") for e in fetch["env"]}
        into = [m for m in fetch["volumeMounts"] if m["name"] == mount["name"]]
        assert into and into[0]["mountPath"] == env["PDSERVE_CACHE_DIR"] == str(model.parent)


# --- scaling and disruption ------------------------------------------------------------------


@by_rendering
def test_autoscalers_scale_each_node_role_on_its_node_metrics(name: str) -> None:
    expected = {
        "prefill": {"pdserve_node_queued_prefill_tokens"},
        "decode": {"pdserve_node_kv_cache_usage", "pdserve_node_running_requests"},
    }
    scaled = {}
    for hpa in of_kind(name, "HorizontalPodAutoscaler"):
        assert hpa["apiVersion"] == "autoscaling/v2"
        ref = hpa["spec"]["scaleTargetRef"]
        target = next(w for w in nodes(name) if w.resource["metadata"]["name"] == ref["name"])
        assert ref["kind"] == target.resource["kind"]
        assert all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])
        metrics = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
        assert metrics <= set(NODE_METRICS), metrics - set(NODE_METRICS)
        scaled[target.labels["app.kubernetes.io/component"]] = metrics
        # `kubectl apply` would otherwise reset what the autoscaler chose.
        assert "replicas" not in target.resource["spec"]
    assert scaled == expected


@by_rendering
def test_prometheus_scrapes_the_health_port(name: str) -> None:
    for node in nodes(name):
        notes = node.resource["spec"]["template"]["metadata"]["annotations"]
        assert int(notes["prometheus.io/port"]) == node.node.health_port
        assert notes["prometheus.io/path"] == METRICS_PATH


@by_rendering
def test_every_role_has_a_disruption_budget(name: str) -> None:
    budgets = of_kind(name, "PodDisruptionBudget")
    for role, w in workloads(name).items():
        assert [b for b in budgets if selects(b["spec"]["selector"], w.labels)], role


# --- network policy -----------------------------------------------------------------------


@dataclass(frozen=True)
class Client:
    """A pod that opens a connection: its labels and namespace."""

    labels: tuple[tuple[str, str], ...]
    namespace: str = NAMESPACE


def admits(policies: list[Resource], target: Workload, port: int, client: Client) -> bool:
    """Whether the ingress NetworkPolicies let `client` open TCP `port` on `target`'s pods."""
    labels = target.labels
    chosen = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
    chosen = [p for p in chosen if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not chosen:
        return True  # a pod no policy selects takes every connection
    rules = [rule for p in chosen for rule in p["spec"].get("ingress", [])]
    return any(rule_admits(rule, port, client) for rule in rules)


def rule_admits(rule: dict[str, Any], port: int, client: Client) -> bool:
    ports = rule.get("ports")
    if ports and not any(port_matches(entry, port) for entry in ports):
        return False
    peers = rule.get("from")
    return not peers or any(peer_matches(peer, client) for peer in peers)


def port_matches(entry: dict[str, Any], port: int) -> bool:
    if entry.get("protocol", "TCP") != "TCP":
        return False
    if "port" not in entry:
        return True
    assert isinstance(entry["port"], int), "named ports are not modelled here"
    return entry["port"] <= port <= entry.get("endPort", entry["port"])


def peer_matches(peer: dict[str, Any], client: Client) -> bool:
    assert "ipBlock" not in peer, "ipBlock peers are not modelled here"
    if "namespaceSelector" in peer:
        namespace = {"kubernetes.io/metadata.name": client.namespace}
        if not selects(peer["namespaceSelector"], namespace):
            return False
    elif client.namespace != NAMESPACE:
        return False
    return selects(peer.get("podSelector", {}), dict(client.labels))


def pdserve_clients(name: str) -> list[Client]:
    return [Client(tuple(w.labels.items())) for w in workloads(name).values()]


STRANGER = Client((("app", "curl"),))  # another pod in the same namespace
PROMETHEUS = Client((("app.kubernetes.io/name", "prometheus"),), namespace="monitoring")


@by_rendering
def test_network_policy_lets_only_pdserve_pods_reach_cluster_ports(name: str) -> None:
    policies = of_kind(name, "NetworkPolicy")
    w = workloads(name)
    router, decode = w["router"], w["decode"]
    for client in pdserve_clients(name):
        assert admits(policies, router, router.args.control_port, client)
        for rank in range(decode.node.tensor_parallel_size):  # a receiver per rank
            assert admits(policies, decode, decode.node.kv_port + rank, client)
        for node in nodes(name):
            assert admits(policies, node, node.node.health_port, client)
    for outsider in (STRANGER, PROMETHEUS):
        assert admits(policies, router, router.args.port, outsider), "the API is open"
        assert not admits(policies, router, router.args.control_port, outsider)
        for rank in range(decode.node.tensor_parallel_size):
            assert not admits(policies, decode, decode.node.kv_port + rank, outsider)
    for node in nodes(name):
        assert not admits(policies, node, node.node.health_port, STRANGER)
        assert admits(policies, node, node.node.health_port, PROMETHEUS), "metrics: HPA"


@by_rendering
def test_network_policy_opens_dynamic_ports_only_for_nixl(name: str) -> None:
    policies = of_kind(name, "NetworkPolicy")
    dynamic = 41234  # a port UCX might pick
    for node in nodes(name):
        opened = [admits(policies, node, dynamic, c) for c in pdserve_clients(name)]
        assert all(opened) == (node.node.kv_connector == "nixl")
        assert not admits(policies, node, dynamic, STRANGER)


def test_the_network_check_sees_a_control_port_open_to_all() -> None:
    policies = copy.deepcopy(of_kind("base", "NetworkPolicy"))
    router = workloads("base")["router"]
    for p in policies:
        for rule in p["spec"]["ingress"]:
            rule.pop("from", None)
    assert admits(policies, router, router.args.control_port, STRANGER)


# --- CPU and CUDA -----------------------------------------------------------------------------


@by_rendering
def test_nodes_use_the_device_and_connector_of_their_variant(name: str) -> None:
    cuda = name == "cuda"
    for node in nodes(name):
        gpus = node.container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (node.args.device, node.node.kv_connector, gpus) == (
            ("cuda", "nixl", 1) if cuda else ("cpu", "zmq", None)
        )
    assert "nvidia.com/gpu" not in workloads(name)["router"].container["resources"]["limits"]
    tags = {c["image"] for r in rendered(name) for c in containers(r)}
    assert tags == {IMAGE_TAGS[name]}


@by_rendering
def test_a_tp_group_is_one_pod_whose_cpu_limit_holds_every_rank(name: str) -> None:
    for node in nodes(name):
        tp, threads = node.node.tensor_parallel_size, node.node.threads_per_rank
        limit = float(node.container["resources"]["limits"]["cpu"])
        assert tp == (2 if name == "tp" else 1)
        assert threads is None or tp * threads <= limit, (node.container["name"], tp, threads)
        if node.node.kv_port and tp > 1:  # every rank's receiver port is the pod's
            ports = {p["containerPort"] for p in node.container["ports"]}
            assert {node.node.kv_port + r for r in range(tp)} <= ports


def containers(resource: Resource) -> list[dict[str, Any]]:
    pod = resource.get("spec", {}).get("template", {}).get("spec", {})
    return pod.get("initContainers", []) + pod.get("containers", [])


# --- the image --------------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]]  # (INSTRUCTION, the rest of the line)


def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    """The Dockerfile's global ARG defaults and its stages, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "deploy" / "Dockerfile").read_text())
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        if op.upper() == "FROM":
            base, _, alias = rest.partition(" AS ")
            stages.append(Stage(base.strip(), alias.strip() or None, []))
        elif stages:
            stages[-1].instructions.append((op.upper(), rest.strip()))
        elif op.upper() == "ARG":
            key, _, default = rest.partition("=")
            global_args[key] = default
    return global_args, stages


def stage_args(stage: Stage) -> dict[str, str]:
    return dict(rest.partition("=")[::2] for op, rest in stage.instructions if op == "ARG")


def runs(stage: Stage) -> list[list[str]]:
    """Each RUN's words, with the stage's ARG defaults substituted."""
    args = stage_args(stage)
    out = []
    for op, rest in stage.instructions:
        if op == "RUN":
            text = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), rest)
            out.append(shlex.split(text))
    return out


def test_the_cpu_image_installs_torch_2_13_0_and_pdserve() -> None:
    global_args, stages = dockerfile()
    assert global_args["VARIANT"] == "cpu"
    final = stages[-1]
    assert final.base == "base-${VARIANT}"
    cpu = next(s for s in stages if s.name == "base-cpu")
    cpu_torch = [w for w in runs(cpu) if "pip" in w and "torch==2.13.0" in w]
    assert cpu_torch, "the CPU stage installs no torch==2.13.0"
    index = cpu_torch[0][cpu_torch[0].index("--index-url") + 1]
    assert index == "https://download.pytorch.org/whl/cpu"
    assert ("COPY", ". /src") in final.instructions
    installs = [w for w in runs(final) if "pip" in w and "install" in w]
    words = [word for w in installs for word in w]
    assert any(word.startswith("/src") for word in words), "pdserve itself is not installed"
    assert "torch==2.13.0" in words, "pdserve's dependencies could replace torch"
    entry = [json.loads(rest) for op, rest in final.instructions if op == "ENTRYPOINT"]
    assert entry == [["pdserve"]]


def test_the_image_user_and_ports_are_the_manifests() -> None:
    _, stages = dockerfile()
    final = stages[-1].instructions
    users = [rest for op, rest in final if op == "USER"]
    exposed = {int(p) for op, rest in final if op == "EXPOSE" for p in rest.split()}
    for name in RENDERINGS:
        for role, w in workloads(name).items():
            assert w.pod["securityContext"]["runAsUser"] == int(users[-1]), role
        ports = {p["containerPort"] for w in workloads(name).values() for p in w.container["ports"]}
        decode = workloads(name)["decode"].node
        more_ranks = {decode.kv_port + r for r in range(1, decode.tensor_parallel_size)}
        assert ports - more_ranks == exposed  # the image names rank 0's KV port


def in_docker_context(path: str, patterns: list[str]) -> bool:
    """Whether `docker build` sends `path`: the last pattern matching it or a parent decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    sent = True
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(c, pattern.lstrip("!")) for c in candidates):
            sent = pattern.startswith("!")
    return sent


def test_the_docker_context_holds_the_package_and_nothing_else() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    needed = ["pyproject.toml", project["project"]["readme"]]
    needed += [str(p.relative_to(REPO)) for f in folders for p in (REPO / f).rglob("*.py")]
    missing = [p for p in needed if not in_docker_context(p, patterns)]
    assert not missing, f"`pip install .` in the image lacks {missing[:5]}"
    for path in ("tests/test_layout.py", ".venv/pyvenv.cfg", ".git/HEAD", "build/x.py"):
        assert not in_docker_context(path, patterns), path
    assert not in_docker_context("router/__pycache__/app.cpython-311.pyc", patterns)

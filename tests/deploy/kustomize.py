"""A small Kustomize renderer: exactly the Kustomize features deploy/kubernetes uses.

`kubectl apply -k DIR` renders DIR with Kustomize before it applies anything. PyPI has no
Kustomize and Debian's kubectl (1.20) is too old for `patches`, so the tests render the base
and overlays with this module and compare it with `kubectl kustomize` wherever kubectl is
installed. It does what Kustomize does for:

- `resources`: YAML files, and directories holding a kustomization.yaml, in the order given;
- `images`: `name` with `newName` and/or `newTag`, on every container and init container;
- `patches`: inline JSON6902 patches (`add`, `remove`, `replace`, `move`, `copy`, `test`)
  applied to each resource whose kind and name match the `target` (regular expressions that
  must match the whole value, as in Kustomize).
- `patches` without a target: only the strategic-merge `$patch: delete` of one resource (its
  kind and name), which is how an overlay drops a base's resource.

Any other field or form is refused with ValueError, so a kustomization that starts using one
fails here rather than rendering differently. A patch that matches no resource, or whose `test`
operation fails, is an error too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

Resource = dict[str, Any]

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "images", "patches"}
IMAGE_FIELDS = {"name", "newName", "newTag"}
PATCH_FIELDS = {"target", "patch"}
TARGET_FIELDS = {"kind", "name"}
DELETE_FIELDS = {"$patch", "apiVersion", "kind", "metadata"}


def render(directory: Path) -> list[Resource]:
    """The resources `kubectl kustomize directory` would print, as dicts."""
    spec = _kustomization(directory)
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        resources += _load(directory / entry)
    for patch in spec.get("patches", []):
        _apply_patch(resources, patch)
    for image in spec.get("images", []):
        _set_image(resources, image)
    return resources


def _kustomization(directory: Path) -> dict[str, Any]:
    path = directory / "kustomization.yaml"
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - KUSTOMIZATION_FIELDS
    if unknown:
        raise ValueError(f"{path}: fields this renderer does not implement: {sorted(unknown)}")
    return spec


def _load(path: Path) -> list[Resource]:
    if path.is_dir():
        return render(path)
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _apply_patch(resources: list[Resource], patch: dict[str, Any]) -> None:
    if set(patch) == {"patch"}:
        _delete(resources, yaml.safe_load(patch["patch"]))
        return
    if set(patch) != PATCH_FIELDS or set(patch["target"]) - TARGET_FIELDS:
        raise ValueError(f"only inline patches with a kind/name target are implemented: {patch}")
    ops = yaml.safe_load(patch["patch"])
    if not isinstance(ops, list):
        raise ValueError(f"only JSON6902 patches (a list of operations) are implemented: {patch}")
    target = patch["target"]
    hits = [i for i, r in enumerate(resources) if _matches(target, r)]
    if not hits:
        raise ValueError(f"patch target {target} matches no resource")
    for i in hits:
        resources[i] = jsonpatch.apply_patch(resources[i], ops)


def _delete(resources: list[Resource], doc: Any) -> None:
    if not isinstance(doc, dict) or doc.get("$patch") != "delete" or set(doc) != DELETE_FIELDS:
        raise ValueError(f"without a target, only a `$patch: delete` is implemented: {doc}")
    key = (doc["kind"], doc["metadata"]["name"])
    kept = [r for r in resources if (r["kind"], r["metadata"]["name"]) != key]
    if len(kept) == len(resources):
        raise ValueError(f"delete patch {key} matches no resource")
    resources[:] = kept


def _matches(target: dict[str, str], resource: Resource) -> bool:
    fields = {"kind": resource["kind"], "name": resource["metadata"]["name"]}
    return all(re.fullmatch(pattern, fields[key]) for key, pattern in target.items())


def _set_image(resources: list[Resource], image: dict[str, str]) -> None:
    if "name" not in image or set(image) - IMAGE_FIELDS:
        raise ValueError(f"only images with name, newName and newTag are implemented: {image}")
    for container in _containers(resources):
        name, tag = split_image(container["image"])
        if name == image["name"]:
            name = image.get("newName", name)
            tag = image.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name


def split_image(ref: str) -> tuple[str, str | None]:
    """("registry:5000/pdserve", "tag") of "registry:5000/pdserve:tag"; no digests here."""
    if "@" in ref:
        raise ValueError(f"image digests are not implemented: {ref}")
    head, _, last = ref.rpartition("/")
    if ":" in last:
        last, tag = last.split(":", 1)
        return (f"{head}/{last}" if head else last), tag
    return ref, None


def _containers(resources: list[Resource]) -> list[dict[str, Any]]:
    found = []
    for pod in _pod_specs(resources):
        found += pod.get("initContainers", []) + pod.get("containers", [])
    return found


def _pod_specs(node: Any) -> list[dict[str, Any]]:
    """Every pod spec in `node`: a Deployment's one, a LeaderWorkerSet's leader and worker."""
    if isinstance(node, list):
        return [pod for item in node for pod in _pod_specs(item)]
    if not isinstance(node, dict):
        return []
    if isinstance(node.get("containers"), list):
        return [node]
    return [pod for value in node.values() for pod in _pod_specs(value)]


def normalized(resources: list[Resource]) -> dict[tuple[str, str], Resource]:
    """Resources keyed by (kind, name), for comparing renderings whatever their order."""
    return {(r["kind"], r["metadata"]["name"]): r for r in resources}

"""Offline rendering of deploy/k8s's kustomizations, for tests where `kustomize` is not installed.

Handles exactly the features the manifests use and refuses anything else (so a new feature in a
kustomization fails the test instead of being silently ignored): `resources` (files, or
directories with a kustomization.yaml), `images` (name -> newName/newTag) and `patches` with an
inline RFC 6902 JSON patch and a `target` of kind and name (an anchored regular expression, as
in kustomize).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]  # no stubs in the dev extra

Object = dict[str, Any]
KNOWN_KEYS = {"apiVersion", "kind", "resources", "images", "patches"}


class Unsupported(ValueError):
    pass


def render(directory: Path) -> list[Object]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KNOWN_KEYS
    if unknown:
        raise Unsupported(f"{directory}: kustomization keys {sorted(unknown)} are not handled here")
    objects: list[Object] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in spec.get("patches", []):
        apply_patch(objects, patch, directory)
    for image in spec.get("images", []):
        set_image(objects, image)
    return objects


def apply_patch(objects: list[Object], patch: Object, directory: Path) -> None:
    if set(patch) != {"target", "patch"} or set(patch["target"]) - {"kind", "name"}:
        raise Unsupported(f"{directory}: only inline JSON patches with a kind/name target are handled: {patch}")
    target = patch["target"]
    ops = yaml.safe_load(patch["patch"])
    matched = [
        o
        for o in objects
        if o["kind"] == target.get("kind", o["kind"]) and re.fullmatch(target.get("name", ".*"), o["metadata"]["name"])
    ]
    if not matched:
        raise ValueError(f"{directory}: patch target {target} matches nothing")
    for obj in matched:
        for op in ops:
            json_patch(obj, op)


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(obj: Object, op: Object) -> None:
    *parents, last = _pointer(op["path"])
    node: Any = obj
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    kind = op["op"]
    if kind not in ("add", "replace", "remove"):
        raise Unsupported(f"JSON patch op {kind!r}")
    if isinstance(node, list):
        if kind == "add":
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif kind == "replace":
            node[int(last)] = copy.deepcopy(op["value"])
        else:
            del node[int(last)]
    else:
        if kind in ("replace", "remove") and last not in node:
            raise KeyError(f"JSON patch {kind} of missing {op['path']}")
        if kind == "remove":
            del node[last]
        else:
            node[last] = copy.deepcopy(op["value"])


def set_image(objects: list[Object], image: Object) -> None:
    for obj in objects:
        for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"

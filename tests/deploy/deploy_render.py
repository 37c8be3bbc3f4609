"""Renders the deploy/ kustomizations without the kustomize binary (CI may not have one).

    deploy/overlays/X/kustomization.yaml --resources--> files and bases (recursively)
                                          --patches---> JSON 6902 ops on the named targets
                                          ==> list of Kubernetes objects

Only the subset deploy/ uses is implemented, and anything else fails loudly rather than
rendering something kustomize would not: ``resources`` (files or directories holding a
kustomization.yaml), ``patches`` given by ``path`` with a ``target`` of ``kind`` and
``name``, holding JSON 6902 operations (add, remove, replace, test), and
``configMapGenerator`` entries made of plain ``files`` with ``disableNameSuffixHash`` and
``labels`` options. Where ``kubectl`` is installed, the tests compare this renderer's output
with ``kubectl kustomize``.

Deliberate limits: no strategic-merge patches, name prefixes, namespaces, images or label
transformers; no ``copy``/``move`` operations; no generator name hashes, ``literals``,
``envs`` or ``KEY=path`` file entries.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = ("vllm", "sglang", "trtllm", "vllm-nixl-push")

_KNOWN_KEYS = frozenset({"apiVersion", "kind", "resources", "patches", "configMapGenerator"})
_GENERATOR_KEYS = frozenset({"name", "files", "options"})
_GENERATOR_OPTIONS = frozenset({"disableNameSuffixHash", "labels"})

Obj = dict[str, Any]


class RenderError(Exception):
    """The kustomization uses something this renderer does not implement, or a patch fails."""


def load_documents(path: Path) -> list[Obj]:
    """Every non-empty YAML document in ``path``."""
    with path.open(encoding="utf-8") as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc is not None]


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} must start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    node = doc
    for part in parts:
        if isinstance(node, dict):
            if part not in node:
                raise RenderError(f"{path}: no key {part!r}")
            node = node[part]
        elif isinstance(node, list):
            node = node[_index(node, part, path, allow_end=False)]
        else:
            raise RenderError(f"{path}: {part!r} is below a scalar")
    return node


def _index(seq: list[Any], part: str, path: str, *, allow_end: bool) -> int:
    if part == "-" and allow_end:
        return len(seq)
    if not part.isdigit():
        raise RenderError(f"{path}: {part!r} is not a list index")
    idx = int(part)
    limit = len(seq) if allow_end else len(seq) - 1
    if idx > limit:
        raise RenderError(f"{path}: index {idx} out of range")
    return idx


def apply_json_patch(doc: Obj, ops: list[Obj]) -> Obj:
    """A new document: ``doc`` with the RFC 6902 operations applied in order."""
    out = copy.deepcopy(doc)
    for op in ops:
        name, path = op.get("op"), op.get("path")
        if not isinstance(path, str):
            raise RenderError(f"operation without a path: {op!r}")
        parts = _pointer(path)
        parent = _walk(out, parts[:-1], path)
        last = parts[-1]
        if name == "test":
            if _walk(out, parts, path) != op.get("value"):
                raise RenderError(f"test failed at {path}: want {op.get('value')!r}")
        elif name == "add":
            value = copy.deepcopy(op["value"])
            if isinstance(parent, list):
                parent.insert(_index(parent, last, path, allow_end=True), value)
            else:
                parent[last] = value
        elif name == "replace":
            _walk(out, parts, path)  # the target must exist
            if isinstance(parent, list):
                parent[_index(parent, last, path, allow_end=False)] = copy.deepcopy(op["value"])
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif name == "remove":
            _walk(out, parts, path)
            if isinstance(parent, list):
                del parent[_index(parent, last, path, allow_end=False)]
            else:
                del parent[last]
        else:
            raise RenderError(f"unsupported operation {name!r} at {path}")
    return out


def generate_config_map(directory: Path, spec: Obj) -> Obj:
    """The ConfigMap one ``configMapGenerator`` entry makes: each file's text under its name."""
    if set(spec) - _GENERATOR_KEYS or "name" not in spec:
        raise RenderError(f"{directory}: unsupported configMapGenerator entry {spec!r}")
    options = spec.get("options", {})
    if set(options) - _GENERATOR_OPTIONS or options.get("disableNameSuffixHash") is not True:
        # kustomize's name hash is not reproduced here, so only unhashed names render.
        raise RenderError(f"{directory}: configMapGenerator options must disable the name hash")
    data: dict[str, str] = {}
    for entry in spec.get("files", []):
        if "=" in entry or "/" in entry:
            raise RenderError(f"{directory}: only plain file names are supported, not {entry!r}")
        data[entry] = (directory / entry).read_text(encoding="utf-8")
    metadata: Obj = {"name": spec["name"]}
    if options.get("labels"):
        metadata["labels"] = dict(options["labels"])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def render(directory: Path) -> list[Obj]:
    """The objects the kustomization in ``directory`` produces, in kustomize's resource order."""
    kustomization = load_documents(directory / "kustomization.yaml")[0]
    unknown = set(kustomization) - _KNOWN_KEYS
    if unknown:
        raise RenderError(f"{directory}: unsupported kustomization keys {sorted(unknown)}")
    objects: list[Obj] = []
    for entry in kustomization.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            objects.extend(render(target))
        else:
            objects.extend(load_documents(target))
    objects.extend(
        generate_config_map(directory, spec) for spec in kustomization.get("configMapGenerator", [])
    )
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path", "target"} or set(patch["target"]) != {"kind", "name"}:
            raise RenderError(f"{directory}: unsupported patch form {patch!r}")
        ops = load_documents(directory / patch["path"])[0]
        if not isinstance(ops, list):
            raise RenderError(f"{directory}/{patch['path']}: not a JSON 6902 patch")
        kind, name = patch["target"]["kind"], patch["target"]["name"]
        hits = [
            i for i, o in enumerate(objects) if o["kind"] == kind and o["metadata"]["name"] == name
        ]
        if len(hits) != 1:
            raise RenderError(
                f"{directory}: patch target {kind}/{name} matched {len(hits)} objects"
            )
        objects[hits[0]] = apply_json_patch(objects[hits[0]], ops)
    return objects


def render_overlay(name: str) -> list[Obj]:
    return render(DEPLOY_DIR / "overlays" / name)


def by_kind_name(objects: list[Obj]) -> dict[tuple[str, str], Obj]:
    """Objects keyed by (kind, name); duplicates are an error."""
    out: dict[tuple[str, str], Obj] = {}
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in out:
            raise RenderError(f"duplicate object {key}")
        out[key] = obj
    return out

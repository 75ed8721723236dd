"""`parallax k8s --patch FILE`: what a real job adds to the rendered objects (environment,
volumes, a service account, image pull secrets, labels and annotations, a priority class,
extra containers), merged into them as `kubectl patch --type strategic` would.

A patch file holds YAML documents, each naming its target by `kind` and `metadata.name` as
rendered (e.g. `kind: Job`, `metadata: {name: JOB-worker}`); the rest of the document is
merged into that object:

- mappings key by key, recursively; a `null` value removes the key;
- lists of mappings that all carry a `name` (containers, env, volumes, volumeMounts, ports,
  imagePullSecrets) item by item: an item of a new name is appended, one of a known name is
  merged into it;
- any other list, and every scalar, replaces what was rendered.

A document whose target was not rendered is refused, naming the objects that were.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable

import yaml

from parallax.errors import ConfigError

Object = dict[str, Any]


def _named_items(items: Any) -> bool:
    return isinstance(items, list) and bool(items) and all(
        isinstance(item, dict) and "name" in item for item in items)


def _merge_lists(base: list, patch: list) -> list:
    merged = [copy.deepcopy(item) for item in base]
    index = {item["name"]: i for i, item in enumerate(merged)}
    for item in patch:
        if item["name"] in index:
            merged[index[item["name"]]] = merge(merged[index[item["name"]]], item)
        else:
            merged.append(copy.deepcopy(item))
    return merged


def merge(base: Any, patch: Any) -> Any:
    """`patch` merged into a copy of `base` (the rules in this module's docstring)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(out.get(key), value)
        return out
    if _named_items(base) and _named_items(patch):
        return _merge_lists(base, patch)
    return copy.deepcopy(patch)


def _target(document: Any, where: str) -> tuple[str, str]:
    if not isinstance(document, dict):
        raise ConfigError(f"{where}: a patch must be a mapping with kind and metadata.name, "
                          f"got {type(document).__name__}")
    kind, name = document.get("kind"), (document.get("metadata") or {}).get("name")
    if not isinstance(kind, str) or not isinstance(name, str):
        raise ConfigError(f"{where}: a patch names its target with `kind` and "
                          f"`metadata.name` as rendered, e.g. kind: Job, metadata: "
                          f"{{name: JOB-worker}}")
    return kind, name


def load(path: str) -> list[Object]:
    """The patch documents of a file (empty documents skipped)."""
    try:
        documents = list(yaml.safe_load_all(Path(path).read_text()))
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"--patch {path}: cannot read it as YAML ({err})") from None
    return [d for d in documents if d is not None]


def apply(objects: list[Object], patches: Iterable[tuple[str, Object]]) -> list[Object]:
    """The rendered objects with every (where, document) patch merged into its target."""
    out = [copy.deepcopy(obj) for obj in objects]
    by_target = {(obj["kind"], obj["metadata"]["name"]): i for i, obj in enumerate(out)}
    for where, document in patches:
        target = _target(document, where)
        if target not in by_target:
            rendered = ", ".join(f"{k}/{n}" for k, n in by_target)
            raise ConfigError(f"{where}: no rendered object is {target[0]}/{target[1]}; the "
                              f"job has {rendered}")
        i = by_target[target]
        out[i] = merge(out[i], document)
    return out


def from_files(paths: Iterable[str]) -> list[tuple[str, Object]]:
    """(where, document) of every document of every file, in order."""
    return [(f"--patch {path} (document {n + 1})", document)
            for path in paths for n, document in enumerate(load(path))]

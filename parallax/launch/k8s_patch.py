"""`parallax k8s --patch FILE`: what a real job adds to the rendered objects (environment,
volumes, a service account, image pull secrets, labels and annotations, a priority class,
extra containers), merged into them as `kubectl patch --type strategic` would.

A patch file holds YAML documents, each naming its target by `kind` and `metadata.name` as
rendered (e.g. `kind: Job`, `metadata: {name: JOB-worker}`); the rest of the document is
merged into that object:

- mappings key by key, recursively; a `null` value removes the key;
- the lists Kubernetes merges by a key (`MERGE_KEYS`: containers, initContainers, env,
  volumes and imagePullSecrets by `name`, volumeMounts by `mountPath`, ports by
  `containerPort`; a JobSet's replicatedJobs by `name`) item by item: an item of a new
  key is appended, one of a known key is merged into it; an item without its key is
  refused (it would replace the list);
- any other list, and every scalar, replaces what was rendered.

Refused, naming the document: a target that was not rendered (the error names those that
were); a change of what ties the job together (`FIXED`: an object's kind, name and
namespace, a workload's selector, its pods' labels, its size); `$`-directives of kubectl's
strategic merge (`$patch`, `$retainKeys`), which this merge does not implement.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable

import yaml

from parallax.errors import ConfigError

Object = dict[str, Any]


MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name",
              "volumes": "name", "imagePullSecrets": "name", "volumeMounts": "mountPath",
              "ports": "containerPort",  # Kubernetes' patchMergeKey of each merged list,
              "replicatedJobs": "name"}  # and the JobSet's (--format jobset)
# What ties a job's objects together, as rendered: a patch may not change these paths.
FIXED = (("kind",), ("metadata", "name"), ("metadata", "namespace"), ("spec", "selector"),
         ("spec", "template", "metadata", "labels"), ("spec", "replicas"),
         ("spec", "parallelism"), ("spec", "completions"), ("spec", "completionMode"))


def _merge_lists(field: str, base: list, patch: list) -> list:
    key = MERGE_KEYS[field]
    merged = [copy.deepcopy(item) for item in base]
    index = {item.get(key): i for i, item in enumerate(merged) if isinstance(item, dict)}
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise ConfigError(f"an item of `{field}` without its `{key}`: {item!r}; "
                              f"Kubernetes merges {field} by {key}, so name it (a list "
                              f"without it would replace the rendered one)")
        if item[key] in index:
            merged[index[item[key]]] = merge(merged[index[item[key]]], item)
        else:
            merged.append(copy.deepcopy(item))
    return merged


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """`patch` merged into a copy of `base`, the value of `field` (the rules in this
    module's docstring)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if key.startswith("$"):
                raise ConfigError(f"`{key}`: kubectl's strategic-merge directives are not "
                                  f"supported; write the fields to set, or null to remove")
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(out.get(key), value, key)
        return out
    if field in MERGE_KEYS and isinstance(base, list) and isinstance(patch, list):
        return _merge_lists(field, base, patch)
    return copy.deepcopy(patch)


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _check_fixed(before: Object, after: Object, where: str) -> None:
    for path in FIXED:
        if _at(before, path) != _at(after, path):
            raise ConfigError(f"{where}: changes {'.'.join(path)} of {before['kind']}/"
                              f"{before['metadata']['name']}, which ties the job together; "
                              f"use parallax k8s's own options (--namespace, --workers, "
                              f"--servers) instead")


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
    """The patch documents of a file (empty documents skipped; a file of none is refused)."""
    try:
        documents = list(yaml.safe_load_all(Path(path).read_text()))
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"--patch {path}: cannot read it as YAML ({err})") from None
    found = [d for d in documents if d is not None]
    if not found:
        raise ConfigError(f"--patch {path}: no YAML document in it (a patch names its "
                          f"target with kind and metadata.name)")
    return found


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
        try:
            patched = merge(out[i], document)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        _check_fixed(out[i], patched, where)
        out[i] = patched
    return out


def from_files(paths: Iterable[str]) -> list[tuple[str, Object]]:
    """(where, document) of every document of every file, in order."""
    return [(f"--patch {path} (document {n + 1})", document)
            for path in paths for n, document in enumerate(load(path))]

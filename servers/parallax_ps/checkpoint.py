"""Shard checkpoints keyed by table and global row id, restorable into any shard count.

Layout under the server's data directory:
    <path>/<table>/shard-00000-of-00002.npz   global ids, values, optimizer slots
    <path>/<table>/shard-00000-of-00002.json  manifest: spec summary, step, rows, SHA-256
Files are written to a temporary name, fsynced and renamed, manifest last, so a crash never
leaves a manifest pointing at a partial file. Restore reads every shard file of the newest
complete set, verifies sizes and checksums, keeps the rows the restoring shard owns, and only
then replaces the shard's state: a corrupt or truncated checkpoint changes nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import grpc
import numpy as np

from parallax.specs import TableSpec
from parallax_ps.errors import RequestError, invalid, precondition
from parallax_ps.shard import TableShard

FORMAT_VERSION = 1
_MANIFEST = re.compile(r"^shard-(\d{5})-of-(\d{5})\.json$")


def resolve(data_dir: Path | None, path: str) -> Path:
    """The checkpoint directory for a client-given path, confined to the data directory."""
    if data_dir is None:
        raise precondition("this server has no data directory; start it with "
                           "`parallax server --data-dir DIR` to save or restore")
    if not path or Path(path).is_absolute():
        raise invalid(f"checkpoint path {path!r} must be a non-empty path relative to the "
                      f"server's data directory")
    root = data_dir.resolve()
    target = (root / path).resolve()
    if root != target and root not in target.parents:
        raise invalid(f"checkpoint path {path!r} leaves the server's data directory")
    return target


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_shard(shard: TableShard, directory: Path) -> tuple[Path, int, int]:
    """Write one shard; returns (data file, rows, step)."""
    ids, values, slots, step = shard.snapshot()
    spec = shard.spec
    stem = f"shard-{shard.shard_index:05d}-of-{spec.shard_count:05d}"
    table_dir = directory / spec.name
    data_path = table_dir / f"{stem}.npz"
    arrays = {"ids": ids, "values": values, **{f"slot_{n}": s for n, s in slots.items()}}
    _atomic_write(data_path, lambda f: np.savez(f, **arrays))
    manifest = {
        "format_version": FORMAT_VERSION, "table": spec.name, "shard_index": shard.shard_index,
        "shard_count": spec.shard_count, "vocabulary_size": spec.vocabulary_size,
        "hashed_keys": spec.hashed_keys, "dim": spec.dim, "dtype": spec.dtype,
        "optimizer": spec.optimizer.kind, "slots": sorted(slots), "step": step,
        "rows": int(len(ids)), "file": data_path.name, "bytes": data_path.stat().st_size,
        "sha256": _sha256(data_path),
    }
    _atomic_write(table_dir / f"{stem}.json",
                  lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    return data_path, len(ids), step


def _data_loss(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.DATA_LOSS, message)


def _read_manifests(table_dir: Path, table: str) -> list[dict]:
    if not table_dir.is_dir():
        raise RequestError(grpc.StatusCode.NOT_FOUND,
                           f"no checkpoint of table {table!r} at {table_dir}")
    by_count: dict[int, dict[int, dict]] = {}
    for entry in sorted(table_dir.iterdir()):
        match = _MANIFEST.match(entry.name)
        if not match:
            continue
        try:
            manifest = json.loads(entry.read_text())
        except (OSError, ValueError) as exc:
            raise _data_loss(f"checkpoint manifest {entry} is unreadable: {exc}") from None
        by_count.setdefault(int(match.group(2)), {})[int(match.group(1))] = manifest
    complete = [c for c, parts in by_count.items() if sorted(parts) == list(range(c))]
    if not complete:
        found = sorted((count, sorted(parts)) for count, parts in by_count.items())
        raise _data_loss(f"checkpoint of table {table!r} at {table_dir} has no complete set of "
                         f"shard manifests (found {found})")
    if len(complete) > 1:
        raise _data_loss(f"checkpoint of table {table!r} at {table_dir} mixes shard counts "
                         f"{sorted(complete)}; save each checkpoint to its own path")
    parts = by_count[complete[0]]
    return [parts[i] for i in range(complete[0])]


def _check_compatible(manifest: dict, spec: TableSpec, slot_names: list[str]) -> None:
    theirs = {k: manifest.get(k) for k in ("vocabulary_size", "hashed_keys", "dim", "dtype",
                                           "optimizer", "slots")}
    ours = {"vocabulary_size": spec.vocabulary_size, "hashed_keys": spec.hashed_keys,
            "dim": spec.dim, "dtype": spec.dtype, "optimizer": spec.optimizer.kind,
            "slots": slot_names}
    diff = [f"{k}: checkpoint {theirs[k]!r}, table {ours[k]!r}" for k in ours
            if theirs[k] != ours[k]]
    if diff:
        raise precondition(f"checkpoint of table {spec.name!r} does not fit the table ("
                           + "; ".join(diff) + "); create the table with the saved shape")


def _load_part(table_dir: Path, manifest: dict, spec: TableSpec,
               slot_names: list[str]) -> dict[str, np.ndarray]:
    path = table_dir / str(manifest.get("file", ""))
    if not path.is_file():
        raise _data_loss(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if size != manifest.get("bytes") or _sha256(path) != manifest.get("sha256"):
        raise _data_loss(f"checkpoint file {path} is corrupt or truncated ({size} bytes, "
                         f"manifest says {manifest.get('bytes')}; checksum mismatch)")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in ["ids", "values", *(f"slot_{n}" for n in slot_names)]}
    except (OSError, ValueError, KeyError) as exc:
        raise _data_loss(f"checkpoint file {path} is unreadable: {exc}") from None
    rows = manifest.get("rows")
    expected = {name: ((rows, spec.dim), np.dtype(spec.dtype)) for name in arrays}
    expected["ids"] = ((rows,), np.dtype(np.int64))
    for name, array in arrays.items():
        shape, dtype = expected[name]
        if array.shape != shape or array.dtype != dtype:
            raise _data_loss(f"checkpoint file {path}: {name} is {array.dtype.name}"
                             f"{list(array.shape)}, expected {dtype.name}{list(shape)}")
    return arrays


def load_for_shard(shard: TableShard, directory: Path) -> tuple[np.ndarray, np.ndarray, dict, int]:
    """(ids, values, slots, step) this shard owns in a checkpoint saved with any shard count.

    Reads and verifies everything without touching the shard; `shard.restore` adopts it.
    """
    spec = shard.spec
    table_dir = directory / spec.name
    slot_names = sorted(shard.optimizer.slot_names)
    manifests = _read_manifests(table_dir, spec.name)
    for manifest in manifests:
        _check_compatible(manifest, spec, slot_names)
    steps = {m.get("step") for m in manifests}
    if len(steps) != 1 and spec.sync_mode == "sync":
        raise _data_loss(f"checkpoint of table {spec.name!r} mixes steps {sorted(steps)}; "
                         f"save a sync table between steps")
    kept: dict[str, list[np.ndarray]] = {}
    for manifest in manifests:
        arrays = _load_part(table_dir, manifest, spec, slot_names)
        mine = shard.partitioner.shard_of(arrays["ids"]) == shard.shard_index
        for name, arr in arrays.items():
            kept.setdefault(name, []).append(arr[mine])
    ids = np.concatenate(kept["ids"])
    if len(np.unique(ids)) != len(ids):
        raise _data_loss(f"checkpoint of table {spec.name!r} holds some row id twice")
    if not spec.hashed_keys:
        expected = shard.partitioner.global_ids(shard.shard_index)
        if len(ids) != len(expected) or not np.array_equal(np.sort(ids), expected):
            raise _data_loss(f"checkpoint of table {spec.name!r} does not cover shard "
                             f"{shard.shard_index}'s {len(expected)} rows exactly "
                             f"(found {len(ids)})")
    elif spec.max_rows_per_shard and len(ids) > spec.max_rows_per_shard:
        raise precondition(f"checkpoint of table {spec.name!r} puts {len(ids)} rows on shard "
                           f"{shard.shard_index}, above max_rows_per_shard="
                           f"{spec.max_rows_per_shard}; raise the limit or add shards")
    values = np.concatenate(kept["values"])
    slots = {n: np.concatenate(kept[f"slot_{n}"]) for n in slot_names}
    return ids, values, slots, int(max(steps))  # async shards count their own pushes

"""Shard checkpoints indexed by table and global row id, restorable into any shard count.

Every save writes a new checkpoint directory (see `versions`), holding per table:
    <table>/shard-00000-of-00002.npz   global ids, values, optimizer slots
    <table>/shard-00000-of-00002.json  part: spec summary, sync mode, step, rows, SHA-256
and a checksummed MANIFEST.json covering every file. Restore reads every part of the table
the manifest lists, verifies each file against it, keeps the rows the restoring shard owns,
and only then replaces the shard's state: a corrupt, truncated or edited checkpoint changes
nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import grpc
import numpy as np

from parallax.protocol.checkpoint_names import NO_DATA_DIR
from parallax.protocol.specs import TableSpec
from parallax.ps.v1 import ps_pb2
from parallax_ps import versions
from parallax_ps.admission import SKETCH_DEPTH, SKETCH_WIDTH
from parallax_ps.errors import RequestError, invalid, precondition
from parallax_ps.eviction import Counters
from parallax_ps.shard import TableShard
from parallax_ps.versions import data_loss


def resolve(data_dir: Path | None, path: str) -> Path:
    """The checkpoint directory for a client-given path, confined to the data directory."""
    if data_dir is None:
        raise precondition(f"{NO_DATA_DIR}; start it with `parallax server --data-dir DIR` "
                           f"to save or restore")
    if not path or Path(path).is_absolute():
        raise invalid(f"checkpoint path {path!r} must be a non-empty path relative to the "
                      f"server's data directory")
    _check_path_name(data_dir, path)
    root = data_dir.resolve()
    target = (root / path).resolve()
    if root != target and root not in target.parents:
        raise invalid(f"checkpoint path {path!r} leaves the server's data directory")
    return target


_FILE_PATH_BYTES = 256  # /<checkpoint>/<table (<= 128)>/shard-<i>-of-<S>.json below a path


def _check_path_name(data_dir: Path, path: str) -> None:
    """Refuse a path no file system call could take (a NUL byte, a name or a path over the
    system's limits) before one raises on it."""
    shown = f"{path[:80]!r}{'...' if len(path) > 80 else ''}"
    if "\x00" in path:
        raise invalid(f"checkpoint path {shown} contains a NUL byte")
    longest = max((len(os.fsencode(part)) for part in Path(path).parts), default=0)
    name_max = os.pathconf(data_dir, "PC_NAME_MAX")
    if longest > name_max:
        raise invalid(f"checkpoint path {shown} has a component of {longest} bytes, over the "
                      f"file system's limit of {name_max}")
    total = len(os.fsencode(str(data_dir.resolve() / path)))
    limit = os.pathconf(data_dir, "PC_PATH_MAX") - _FILE_PATH_BYTES
    if total > limit:
        raise invalid(f"checkpoint path {shown} makes a path of {total} bytes under the data "
                      f"directory; it must stay under {limit} (the checkpoint's files go "
                      f"below it)")


def _write(path: Path, write) -> None:
    with versions.writing(path):
        versions.atomic_write(path, write)


def _stem(table: str, index: int, count: int) -> str:
    """A part's path in a checkpoint, without its suffix."""
    return f"{table}/shard-{index:05d}-of-{count:05d}"


def save_shard(shard: TableShard, directory: Path) -> tuple[Path, int, int]:
    """Write one shard into a staging directory; returns (data file, rows, step)."""
    ids, values, slots, step, state = shard.snapshot()
    spec = shard.spec
    data_path = directory / f"{_stem(spec.name, shard.shard_index, spec.shard_count)}.npz"
    arrays = {"ids": ids, "values": values, **{f"slot_{n}": s for n, s in slots.items()},
              **{f"dyn_{n}": a for n, a in state.items()}}
    _write(data_path, lambda f: np.savez(f, **arrays))
    part = {
        "format_version": versions.FORMAT_VERSION, "table": spec.name,
        "shard_index": shard.shard_index, "shard_count": spec.shard_count,
        "vocabulary_size": spec.vocabulary_size, "hashed_keys": spec.hashed_keys,
        "dim": spec.dim, "dtype": spec.dtype, "optimizer": spec.optimizer.kind,
        "slots": sorted(slots), "sync_mode": spec.sync_mode, "step": step,
        "rows": int(len(ids)), "file": data_path.name, "bytes": data_path.stat().st_size,
        "sha256": versions.sha256_of(data_path),
        "dynamic": sorted(state),  # a dynamic table's per-row use, counters and sketch
    }
    _write(data_path.with_suffix(".json"), lambda f: f.write(json.dumps(part, indent=1).encode()))
    return data_path, len(ids), step


def _claimed(stage: Path, shard: TableShard, owner: str) -> bool:
    """Whether this server (`owner`) writes `shard` into `stage`: the first to claim it there
    does. Copies of one shard (replicated shards) held by servers that share a data directory
    are written once, by one of them, never into each other's files; servers with data
    directories of their own each write their copy, which each restores from. A claim of
    this server's own (a PREPARE sent again) stands."""
    claim = stage / shard.spec.name / \
        f"{_stem(shard.spec.name, shard.shard_index, shard.spec.shard_count)}{versions.CLAIM}"
    with versions.writing(claim):
        claim.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return claim.read_text() == owner
        with os.fdopen(fd, "w") as f:
            f.write(owner)
    return True


def _prepare(root: Path, name: str, shards: list[TableShard], owner: str) -> list:
    stage = versions.staging(root, name)
    with versions.writing(stage):
        stage.mkdir(parents=True, exist_ok=True)  # even with no shard here: COMMIT needs it
    out = []
    for shard in shards:
        if not _claimed(stage, shard, owner):
            continue  # a server sharing this data directory writes its copy
        path, rows, step = save_shard(shard, stage)
        out.append(ps_pb2.ShardCheckpoint(
            table=shard.spec.name, shard_index=shard.shard_index, rows=rows, step=step,
            file=str(root / name / path.relative_to(stage)), checkpoint=name,
            sync=shard.spec.sync_mode == "sync"))
    return out


def save(root: Path, request, shards: list[TableShard], owner: str = "") -> list:
    """One phase of a save (see `versions`), one at a time per path; PREPARE answers each
    shard it wrote (`owner`: this server, as its claims on the shards it writes name it)."""
    name = versions.checked_name(request.checkpoint)
    with versions.locked(root):
        return _phase(root, name, request, shards, owner)


def _phase(root: Path, name: str, request, shards: list[TableShard], owner: str) -> list:
    """PREPARE; COMMIT with keep=0 (seal, rename) or keep >= 1 (mark complete, prune); ABORT."""
    if request.phase == ps_pb2.SAVE_PREPARE:
        return _prepare(root, name, shards, owner)
    if request.phase == ps_pb2.SAVE_COMMIT and request.keep < 0:
        raise invalid(f"Save COMMIT with keep={request.keep}: send keep=0 to commit, then "
                      f"keep >= 1 once every server has; use PSClient.save")
    if request.phase == ps_pb2.SAVE_COMMIT:
        versions.commit(root, name)
        if request.keep:
            versions.complete(root, name, request.keep)
    elif request.phase == ps_pb2.SAVE_ABORT:
        versions.abort(root, name)
    else:
        raise invalid(f"Save phase {request.phase} is not PREPARE, COMMIT or ABORT; use "
                      f"PSClient.save, which runs them in turn")
    return []


def open_checkpoint(data_dir: Path | None, request) -> tuple[Path, dict]:
    """(directory, verified manifest) of the checkpoint a Restore asks for."""
    directory = versions.locate(resolve(data_dir, request.path), request.checkpoint)
    return directory, versions.read_manifest(directory)


def newest_holding(data_dir: Path, table: str,
                   skip: frozenset[str] = frozenset()) -> tuple[Path, dict] | None:
    """(directory, verified manifest) of the newest complete checkpoint under `data_dir`
    (any path) that holds `table`, but for those `skip` names (paths relative to
    `data_dir`: --restore-newest-on-restart's, older than the server's instance); None when
    none does. A newer one whose manifest is damaged is an error (DATA_LOSS), not skipped:
    an older one would start the shard at a step the workers may no longer hold the pushes
    since."""
    for directory in reversed(versions.complete_under(data_dir)):
        if str(directory.relative_to(data_dir)) in skip:
            continue
        manifest = versions.read_manifest(directory)
        if any(p.get("table") == table for p in manifest.get("shards", ())):
            return directory, manifest
    return None


def _table_parts(directory: Path, manifest: dict, table: str,
                 own: tuple[int, int]) -> list[dict]:
    """The manifest's record of every shard of `table`, a complete set; else, where servers
    keep separate data directories, the one part saved by shard `own` (index, count) as it
    is now; else an error."""
    parts = [p for p in manifest["shards"] if p["table"] == table]
    if not parts:
        held = sorted({p["table"] for p in manifest["shards"]})
        raise RequestError(grpc.StatusCode.NOT_FOUND,
                           f"no checkpoint of table {table!r} in {directory} (it holds "
                           f"{held}); save the table with the others, or restore another path")
    counts = sorted({p["shard_count"] for p in parts})
    found = sorted(p["shard_index"] for p in parts)
    if len(counts) == 1 and found == list(range(counts[0])):
        return sorted(parts, key=lambda p: p["shard_index"])
    mine = [p for p in parts if (p["shard_index"], p["shard_count"]) == own]
    if mine:
        return mine
    raise data_loss(f"checkpoint {directory} has shards {found} of {counts} of table {table!r}, "
                    f"not shard {own[0]} of {own[1]}: with a data directory per server, "
                    f"restore each shard where it was saved (same shard count and placement, "
                    f"on as many servers: a checkpoint that does not record its layout, as "
                    f"those written while the default was one shard per 64 MiB, needs "
                    f"ParallaxStrategy(shards={counts[-1]}), or shards={{variable: "
                    f"{counts[-1]}}} for a table of its own); to move or reshard tables, give "
                    f"every server one shared data directory")


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


def _part_file(directory: Path, manifest: dict, part: dict, spec: TableSpec,
               slot_names: list[str]) -> tuple[Path, int]:
    """(the part's array file, its rows), its record and file verified against the
    checkpoint's manifest and the table."""
    stem = _stem(part["table"], part["shard_index"], part["shard_count"])
    record = json.loads(versions.verified(directory, manifest, f"{stem}.json").read_text())
    _check_compatible(record, spec, slot_names)
    return (versions.verified(directory, manifest, f"{part['table']}/{record['file']}"),
            record.get("rows"))


def _part_arrays(path: Path, rows: int, names: list[str], spec: TableSpec
                 ) -> dict[str, np.ndarray]:
    """The named arrays of a part's file (each read only when named), shapes checked."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in names}
    except FileNotFoundError:  # verified a moment ago: pruned since, by a newer save
        raise RequestError(grpc.StatusCode.NOT_FOUND,
                           f"checkpoint file {path} was removed while it was being restored "
                           f"(a concurrent save pruned it: only the newest checkpoints are "
                           f"kept); restore a newer checkpoint, or keep more") from None
    except (OSError, ValueError, KeyError) as exc:
        raise data_loss(f"checkpoint file {path} is unreadable: {exc}") from None
    for name, array in arrays.items():
        shape, dtype = _expected(name, rows, spec)
        if array.shape != shape or array.dtype != dtype:
            raise data_loss(f"checkpoint file {path}: {name} is {array.dtype.name}"
                            f"{list(array.shape)}, expected {dtype.name}{list(shape)}")
    return arrays


def _expected(name: str, rows: int, spec: TableSpec) -> tuple[tuple, np.dtype]:
    """The shape and dtype of a part's array."""
    if name in ("ids", "dyn_last_used", "dyn_uses"):
        return (rows,), np.dtype(np.int64)
    if name == "dyn_counters":
        return (len(dataclasses.fields(Counters)),), np.dtype(np.int64)
    if name == "dyn_sketch":
        return (SKETCH_DEPTH, SKETCH_WIDTH), np.dtype(np.uint32)
    return (rows, spec.dim), np.dtype(spec.dtype)


def _names(path: Path) -> set[str]:
    with np.load(path, allow_pickle=False) as data:
        return set(data.files)


def _dynamic_state(shard: TableShard, parts: list[dict], files: list, masks: list) -> dict:
    """A dynamic shard's saved state: per-row last-used steps and use counts of its rows;
    the counters and sketch of the part it was saved as (same shard count), else the sum
    of every part's sketches (a count-min over-estimate, still valid) and fresh counters.
    Empty for other tables and checkpoints saved without it (rows then start unused)."""
    if shard.vocab is None:
        return {}
    names = [_names(path) for path, _ in files]
    if not all("dyn_last_used" in n for n in names):
        return {}
    state: dict[str, list[np.ndarray]] = {}
    for (path, rows), mine in zip(files, masks):
        for name, arr in _part_arrays(path, rows, ["dyn_last_used", "dyn_uses"],
                                      shard.spec).items():
            state.setdefault(name[4:], []).append(arr if mine.all() else arr[mine])
    out = {name: _joined(arrays) for name, arrays in state.items()}
    at = (shard.shard_index, shard.spec.shard_count)
    own = [i for i, p in enumerate(parts) if (p["shard_index"], p["shard_count"]) == at]
    if own:
        path, rows = files[own[0]]
        wanted = [n for n in ("dyn_counters", "dyn_sketch") if n in names[own[0]]]
        out.update({n[4:]: a for n, a in _part_arrays(path, rows, wanted, shard.spec).items()})
    elif all("dyn_sketch" in n for n in names):
        with np.errstate(over="ignore"):
            out["sketch"] = sum(_part_arrays(path, rows, ["dyn_sketch"], shard.spec)
                                ["dyn_sketch"] for path, rows in files)
    return out


def _check_rows(shard: TableShard, ids: np.ndarray) -> None:
    """The restored ids are this shard's: each once, all of them for a fixed vocabulary."""
    spec = shard.spec
    if len(np.unique(ids)) != len(ids):
        raise data_loss(f"checkpoint of table {spec.name!r} holds some row id twice")
    if not spec.hashed_keys:
        expected = shard.router.global_ids(shard.shard_index)
        if len(ids) != len(expected) or not np.array_equal(np.sort(ids), expected):
            raise data_loss(f"checkpoint of table {spec.name!r} does not cover shard "
                            f"{shard.shard_index}'s {len(expected)} rows exactly "
                            f"(found {len(ids)})")
    elif spec.max_rows_per_shard and len(ids) > spec.max_rows_per_shard:
        raise precondition(f"checkpoint of table {spec.name!r} puts {len(ids)} rows on shard "
                           f"{shard.shard_index}, above max_rows_per_shard="
                           f"{spec.max_rows_per_shard}; raise the limit or add shards")


def load_for_shard(shard: TableShard, directory: Path,
                   manifest: dict) -> tuple[np.ndarray, np.ndarray, dict, int, dict]:
    """(ids, values, slots, step, dynamic state) this shard owns in a checkpoint saved with
    any shard count.

    Reads and verifies everything without touching the shard; `shard.restore` adopts it.
    """
    spec = shard.spec
    slot_names = sorted(shard.optimizer.slot_names)
    parts = _table_parts(directory, manifest, spec.name, (shard.shard_index, spec.shard_count))
    steps = {p["step"] for p in parts}
    if len(steps) != 1 and spec.sync_mode == "sync":
        raise data_loss(f"checkpoint {directory} of table {spec.name!r} mixes steps "
                        f"{sorted(steps)}; restore another checkpoint")
    files = [_part_file(directory, manifest, part, spec, slot_names) for part in parts]
    kept: dict[str, list[np.ndarray]] = {"ids": []}
    masks = []
    for part, (path, rows) in zip(parts, files):  # the ids first: what this shard keeps
        ids = _part_arrays(path, rows, ["ids"], spec)["ids"]
        mine = shard.router.shard_of(ids) == shard.shard_index
        if len(parts) < part["shard_count"] and not mine.all():  # its own part only
            raise data_loss(f"checkpoint {directory}: shard {shard.shard_index} of table "
                            f"{spec.name!r} was saved partitioned otherwise; restore it with "
                            f"the partition it was saved with")
        kept["ids"].append(ids if mine.all() else ids[mine])
        masks.append(mine)
    ids = _joined(kept["ids"])
    _check_rows(shard, ids)
    shard.budget.check(shard, *shard.restore_need(len(ids)))  # before the rows are read
    names = ["values", *(f"slot_{n}" for n in slot_names)]
    for (path, rows), mine in zip(files, masks):
        for name, arr in _part_arrays(path, rows, names, spec).items():
            kept.setdefault(name, []).append(arr if mine.all() else arr[mine])
    slots = {n: _joined(kept[f"slot_{n}"]) for n in slot_names}
    state = _dynamic_state(shard, parts, files, masks)
    return ids, _joined(kept["values"]), slots, int(max(steps)), state  # (async: own steps)


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays one after another (one array as it is: no copy)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


# ---- held checkpoints (in memory: `held.py`) ---------------------------------------------------
def save_held(request, shards: list[TableShard]) -> ps_pb2.SaveResponse:
    """One phase of a held save: PREPARE marks every shard (all or none) and, with keep >=
    1, then keeps each shard's newest `keep` marks (the client's one round: a mark needs no
    commit, as it is used only where every server holds it); COMMIT with keep >= 1 keeps
    them too (a client that prunes in a round of its own); ABORT drops the mark."""
    name = versions.checked_name(request.checkpoint)
    response = ps_pb2.SaveResponse()
    if request.phase == ps_pb2.SAVE_PREPARE:
        marked = []
        try:
            for shard in shards:
                step = shard.hold(name)
                marked.append(shard)
                _add_held(response, shard, step, name)
        except BaseException:
            for shard in marked:
                shard.keep_held(0, name)
            raise
        if request.keep > 0:  # (pruned once every shard here is marked: all or none)
            for shard in shards:
                shard.keep_held(request.keep, name)
    elif request.phase == ps_pb2.SAVE_ABORT or request.keep:
        for shard in shards:
            shard.keep_held(0 if request.phase == ps_pb2.SAVE_ABORT else request.keep, name)
    return response


def restore_held(request, shards: list[TableShard]) -> ps_pb2.RestoreResponse:
    """Roll every shard back to held checkpoint `request.checkpoint` (all or none; with
    verify_only, only check that each holds it)."""
    name = versions.checked_name(request.checkpoint)
    response = ps_pb2.RestoreResponse()
    with contextlib.ExitStack() as held:
        for shard in shards:
            held.enter_context(shard.cond)
        steps = [shard.held_step(name) for shard in shards]
        for shard, step in zip(shards, steps):
            if not request.verify_only:
                shard.roll_back(name)
            _add_held(response, shard, step, name)
    return response


def _add_held(response, shard: TableShard, step: int, name: str) -> None:
    """A held checkpoint's shard in a Save or Restore response."""
    response.shards.add(table=shard.spec.name, shard_index=shard.shard_index,
                        rows=shard.storage.num_rows, step=step, checkpoint=name, sync=True)

"""Checkpoint directories: each save a new one, switched to by one atomic rename.

Under `<data dir>/<path>`:
    .staging-<name>/        a save in progress: PREPARE writes each server's shards here
    <name>/                 a committed checkpoint, never written again but for COMPLETE
    <name>/MANIFEST.json    written last: every file's size and SHA-256, every shard's step,
                            and the SHA-256 of the manifest itself
    <name>/COMPLETE         every server committed the save (its second COMMIT round)
COMMIT (keep=0) writes the manifest, fsyncs every file's directory, renames the staging
directory to `<name>` and fsyncs `<path>`: after a crash `<path>` holds the old checkpoints or
the new one too, never a torn one. Once every server has committed, the client sends COMMIT
again with `keep` >= 1 (`complete`): the checkpoint is marked COMPLETE and only then are the
older ones beyond the newest `keep` complete ones removed. A checkpoint some servers committed
and others did not (a server or the client died between them) is never marked, never
restored by default, and pushes no complete one out. ABORT removes a staging directory, never
a committed one. Servers may share a data directory: the first to commit renames, the others
find the checkpoint committed. Within one server, the operations on one path run one at a
time (`locked`), so concurrent saves to it cannot remove each other's files midway.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
from pathlib import Path

import grpc

from parallax.protocol.checkpoint_names import SORTS_BEFORE, is_name
from parallax_ps.errors import RequestError, invalid, precondition

log = logging.getLogger("parallax_ps")

FORMAT_VERSION = 2
MANIFEST = "MANIFEST.json"
STAGING = ".staging-"
DELETING = ".deleting-"
COMPLETE = "COMPLETE"
CLAIM = ".claim"  # <table>/shard-*.claim: the server writing that shard (`checkpoint`)
_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


def data_loss(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.DATA_LOSS, message)


def atomic_write(path: Path, write) -> None:
    """Write a file under a temporary name, fsync it, rename it into place."""
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


@contextlib.contextmanager
def writing(path: Path):
    """A failed write of `path` answered with its cause and what to do about it: a full disk
    is RESOURCE_EXHAUSTED, a file removed underneath FAILED_PRECONDITION, any other I/O error
    (read-only, failing disk, permissions) INTERNAL naming the errno."""
    try:
        yield
    except FileNotFoundError as exc:
        raise precondition(f"cannot write checkpoint file {path}: {exc.strerror}: another save "
                           f"to this path removed it (a newer checkpoint was completed "
                           f"meanwhile); save again") from None
    except OSError as exc:
        raise _write_error(path, exc) from None


def _write_error(path: Path, exc: OSError) -> RequestError:
    reason = f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno, exc.errno)})"
    end = "; the earlier checkpoints are unchanged"
    if exc.errno in _SPACE:
        return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"cannot write checkpoint file {path}: {reason}; free space there "
                            f"or save to a path on a larger disk{end}")
    log.warning("cannot write checkpoint file %s: %s", path, reason)
    return RequestError(grpc.StatusCode.INTERNAL,
                        f"cannot write checkpoint file {path}: {reason}; the server's "
                        f"--data-dir is not writable (read-only, failing disk or "
                        f"permissions): fix it, or restart the server with another "
                        f"--data-dir{end}")


@contextlib.contextmanager
def locked(root: Path):
    """Run one save phase or prune of checkpoint path `root` at a time in this server."""
    with _locks_guard:
        lock = _locks.setdefault(root, threading.Lock())
    with lock:
        yield


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checked_name(name: str) -> str:
    if not is_name(name):
        raise invalid(f"checkpoint name {name!r} is not ckpt-<20 digits>-<8 hex digits>; "
                      f"use PSClient.save, which names each checkpoint")
    return name


def staging(root: Path, name: str) -> Path:
    return root / f"{STAGING}{checked_name(name)}"


def committed(root: Path) -> list[str]:
    """Names of the committed checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if is_name(p.name) and p.is_dir())


def _seal(manifest: dict) -> dict:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return {**body, "sha256": hashlib.sha256(text).hexdigest()}


def _parts(stage: Path) -> list[tuple[str, dict]]:
    """(relative path, content) of every shard manifest staged; every other file must be the
    data file one of them names."""
    parts = [(p.relative_to(stage).as_posix(), json.loads(p.read_text()))
             for p in sorted(stage.glob("*/shard-*.json"))]
    named = {rel.rsplit("/", 1)[0] + "/" + part["file"] for rel, part in parts}
    known = named | {rel for rel, _ in parts} | {MANIFEST, COMPLETE}
    stray = [p for p in stage.rglob("*") if p.is_file() and p.suffix != CLAIM
             and p.relative_to(stage).as_posix() not in known]
    if stray:
        raise precondition(f"staged checkpoint {stage} holds files no shard wrote "
                           f"({[str(p) for p in stray[:3]]}); save again")
    return parts


def write_manifest(stage: Path, name: str) -> None:
    """Seal a checkpoint's files: MANIFEST.json, with every file's size and SHA-256, every
    shard's step, and its own SHA-256 (also to reseal one edited on purpose, in tests)."""
    manifest = _manifest(stage, name)
    atomic_write(stage / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def _manifest(stage: Path, name: str) -> dict:
    files, shards = {}, []
    for rel, part in _parts(stage):
        data = rel.rsplit("/", 1)[0] + "/" + part["file"]
        files[rel] = {"bytes": (stage / rel).stat().st_size, "sha256": sha256_of(stage / rel)}
        files[data] = {"bytes": part["bytes"], "sha256": part["sha256"]}
        shards.append({k: part[k] for k in ("table", "shard_index", "shard_count", "step",
                                             "rows", "sync_mode")})
    return _seal({"format_version": FORMAT_VERSION, "checkpoint": name, "files": files,
                  "shards": shards})


def commit(root: Path, name: str) -> Path:
    """Seal the staged checkpoint `name` and rename it into place; removes nothing."""
    final, stage = root / name, staging(root, name)
    if is_committed(final):
        return final  # a server sharing this data directory committed it
    _check_newest(root, name)
    if not stage.is_dir():
        raise precondition(f"checkpoint {name} was not prepared under {root} (no {stage}: it "
                           f"was aborted); save again")
    with writing(stage / MANIFEST):
        write_manifest(stage, name)
        for directory in {stage, *(p for p in stage.iterdir() if p.is_dir())}:
            _fsync_dir(directory)
        os.rename(stage, final)
        _fsync_dir(root)
    return final


def is_committed(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def is_complete(directory: Path) -> bool:
    return (directory / COMPLETE).is_file()


def _check_newest(root: Path, name: str) -> None:
    """Refuse to commit a checkpoint that would not be the newest."""
    newer = [n for n in committed(root) if n > name]
    if newer:
        raise precondition(f"checkpoint {name} {SORTS_BEFORE} {newer[-1]} "
                           f"under {root}: another save to this path committed a newer one "
                           f"first (or this client's clock went back); save again")


def complete(root: Path, name: str, keep: int) -> None:
    """Mark `name` complete (every server committed it); keep the newest `keep` complete."""
    final = root / name
    if not is_committed(final):
        raise precondition(f"checkpoint {name} is not committed under {root}, so it cannot "
                           f"be marked complete (another save to this path completed a newer "
                           f"one and removed it); save again")
    with writing(final / COMPLETE):
        if not is_complete(final):
            atomic_write(final / COMPLETE, lambda f: f.write(b"every server committed\n"))
            _fsync_dir(final)
    _prune(root, keep)


def complete_names(root: Path) -> list[str]:
    """Names of the checkpoints under `root` every server committed, oldest first."""
    return [n for n in committed(root) if is_complete(root / n)]


def complete_under(data_dir: Path) -> list[Path]:
    """Every complete checkpoint under every checkpoint path of `data_dir`, oldest first by
    name (names sort by time, whatever their path): what a server started with
    --restore-newest chooses from. Checkpoints, stagings and deletions are not searched
    inside (none holds another checkpoint)."""
    found = []
    for top, dirs, _ in os.walk(data_dir):
        here = Path(top)
        found += [here / d for d in dirs if is_name(d) and is_complete(here / d)]
        dirs[:] = [d for d in dirs if not is_name(d) and not d.startswith((STAGING, DELETING))]
    return sorted(found, key=lambda path: path.name)


def _remove(path: Path) -> None:
    """Delete a directory; renamed first, so a crash midway leaves no half checkpoint."""
    doomed = path.with_name(f"{DELETING}{path.name}-{secrets.token_hex(4)}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return  # a server sharing the data directory removed it
    shutil.rmtree(doomed, ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    """Once `keep` checkpoints are complete, remove everything older than the oldest of the
    newest `keep`: complete checkpoints and ones only some servers committed; and, whatever
    `keep`, the stagings older than the newest complete checkpoint (a save killed midway:
    none can commit now, `_check_newest`), plus deletions a crash interrupted. Nothing newer
    is touched: it may be another save in progress."""
    done = complete_names(root)
    if len(done) >= keep:
        oldest = done[-keep]
        for entry in root.iterdir():
            if is_name(entry.name) and entry.name < oldest:
                _remove(entry)
    _sweep(root, done[-1] if done else None)


def _sweep(root: Path, newest: str | None) -> list[Path]:
    """Remove the stagings of `root` older than checkpoint `newest` and interrupted
    deletions; returns what was removed."""
    removed = []
    for entry in root.iterdir():
        label = entry.name[len(STAGING):]
        if newest and entry.name.startswith(STAGING) and is_name(label) and label < newest:
            _remove(entry)
            removed.append(entry)
        elif entry.name.startswith(DELETING):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def sweep_stale(data_dir: Path) -> list[Path]:
    """At a server's start: under every checkpoint path of `data_dir`, the stagings older
    than the newest complete checkpoint beside them (saves killed midway, whose owner is
    gone: none can commit now) and deletions a crash interrupted. A staging newer than every
    complete checkpoint may be a live save of a server sharing the directory: it stays until
    a newer save completes (`_prune`)."""
    roots = {p.parent for pattern in (f"{STAGING}*", f"{DELETING}*")
             for p in data_dir.rglob(pattern) if p.is_dir()}
    removed = []
    for root in sorted(roots):
        with locked(root):
            done = complete_names(root)
            removed += _sweep(root, done[-1] if done else None)
    return removed


def abort(root: Path, name: str) -> None:
    """Forget a failed save's staging directory. A checkpoint already renamed into place
    stays: where servers share a data directory it holds every shard, and where they do not
    it is never marked complete, so it is neither restored by default nor counted by `keep`."""
    stage = staging(root, name)
    if stage.is_dir():
        _remove(stage)


def locate(root: Path, name: str) -> Path:
    """The checkpoint to restore: `root` itself if it is one, else `root/name`, else the
    newest under `root`."""
    if (root / MANIFEST).is_file() and is_name(root.name):
        if name and name != root.name:
            raise invalid(f"checkpoint {name!r} asked for, but path {root} is {root.name}")
        return root
    if name:
        found = root / checked_name(name)
        if not found.is_dir():
            raise RequestError(grpc.StatusCode.NOT_FOUND,
                               f"no checkpoint {name} under {root} (it holds "
                               f"{committed(root)}); restore one of those")
        return found
    names = complete_names(root)
    if not names:
        partial = committed(root)
        raise RequestError(grpc.StatusCode.NOT_FOUND, (
            f"no complete checkpoint under {root}: {partial} were committed by some servers "
            f"only (a save failed midway); restore one by checkpoint=NAME if every server "
            f"holds it" if partial else
            f"no checkpoint under {root}: no ckpt-* directory made by PSClient.save; "
            f"check the path and the server's --data-dir"))
    return root / names[-1]


def _older(directory: Path) -> str:
    others = [n for n in complete_names(directory.parent) if n < directory.name]
    return (f"restore an older one by path, e.g. {directory.parent.name}/{others[-1]}"
            if others else "no older checkpoint is there")


def read_manifest(directory: Path) -> dict:
    """The checkpoint's manifest, its own checksum verified."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise data_loss(f"checkpoint {directory} has no {MANIFEST}: it is incomplete; "
                        f"{_older(directory)}") from None
    except (OSError, ValueError) as exc:
        raise data_loss(f"checkpoint manifest {path} is unreadable ({exc}); "
                        f"{_older(directory)}") from None
    if not isinstance(manifest, dict) or _seal(manifest)["sha256"] != manifest.get("sha256"):
        raise data_loss(f"checkpoint manifest {path} fails its checksum: it was changed after "
                        f"it was written; {_older(directory)}")
    return manifest


def verified(directory: Path, manifest: dict, rel: str) -> Path:
    """A file of the checkpoint, checked against the manifest's size and SHA-256."""
    path = directory / rel
    entry = manifest["files"].get(rel)
    if entry is None:
        raise data_loss(f"checkpoint file {path} is not in {directory / MANIFEST}; "
                        f"{_older(directory)}")
    try:
        size, digest = path.stat().st_size, sha256_of(path)
    except FileNotFoundError:
        raise data_loss(f"checkpoint file {path} is missing; {_older(directory)}") from None
    if size != entry["bytes"] or digest != entry["sha256"]:
        raise data_loss(f"checkpoint file {path} is corrupt or truncated ({size} bytes, "
                        f"manifest says {entry['bytes']}; checksum mismatch); "
                        f"{_older(directory)}")
    return path

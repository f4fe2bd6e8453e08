"""The persistent checkpoint tier: shard files and manifests on a local or shared filesystem.

Layout::

    <root>/<job>/step-<s:09d>/rank-<r:05d>.shard   one rank's shard payload (opaque bytes here)
    <root>/<job>/step-<s:09d>/manifest.json        written LAST, atomically: the step is a checkpoint

Each node writes its ranks' shards (temp file, fsync, rename: ``write_shard``); the broker writes the
manifest once every rank's shard is there (``write_manifest``). A step directory without a valid
manifest is *incomplete*, never a checkpoint: a crash or a full disk half-way through a save leaves the
previous committed step as the newest checkpoint. Readers verify every shard against the manifest's
size and SHA-256 (``load_shard``).

Pure file helpers: no gRPC, no torch, no event bus, so the broker, the agent and the CLI import it.
"""

from __future__ import annotations

import errno as errno_codes
import json
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, NamedTuple

from keel.checkpoint.slots import sha256_hex, write_file_atomic

__all__ = [
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointCorrupt",
    "PersistError",
    "WrittenShard",
    "ShardEntry",
    "Manifest",
    "CheckpointInfo",
    "job_dir",
    "step_dir",
    "locate_step",
    "shard_file",
    "manifest_path",
    "write_shard",
    "write_manifest",
    "read_manifest",
    "load_shard",
    "list_checkpoints",
    "latest_committed",
    "apply_retention",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_SHARD_FILE = re.compile(r"^rank-(\d{5,})\.shard$")


class CheckpointError(RuntimeError):
    """Base class of the persistent tier's errors."""


class CheckpointNotFound(CheckpointError):
    """No committed checkpoint (no valid manifest) for that job and step, or no shard for that rank."""


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint whose shard is missing, truncated, or does not match its manifest,
    or whose manifest cannot be read."""


class PersistError(CheckpointError):
    """Writing a shard or a manifest failed (``ENOSPC``, ``EIO``, ``EFBIG``...). The temp file is gone
    and the previous committed checkpoint is untouched; ``path`` and ``errno`` say what and why."""

    def __init__(self, path: Path, errno: int | None, message: str) -> None:
        name = errno_codes.errorcode.get(errno, str(errno)) if errno is not None else "?"
        super().__init__(f"{path}: {message} ({name})")
        self.path = Path(path)
        self.errno = errno


class WrittenShard(NamedTuple):
    """What ``write_shard`` wrote: unpacks as ``(path, sha256, bytes, seconds)``."""

    path: Path
    sha256: str
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ShardEntry:
    """One rank's shard in a manifest. ``file`` is relative to the step directory."""

    rank: int
    bytes: int
    sha256: str
    file: str = ""

    def __post_init__(self) -> None:
        if not self.file:
            object.__setattr__(self, "file", _shard_name(self.rank))

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "file": self.file, "bytes": self.bytes, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    job: str
    step: int
    world_size: int
    shards: tuple[ShardEntry, ...]
    created_at: str  # ISO-8601, UTC
    path: Path
    digest: str  # hex SHA-256 of the manifest file's bytes (CheckpointPersisted.manifest_digest)

    @property
    def bytes(self) -> int:
        return sum(entry.bytes for entry in self.shards)

    def shard(self, rank: int) -> ShardEntry:
        for entry in self.shards:
            if entry.rank == rank:
                return entry
        raise CheckpointNotFound(f"{self.path}: step {self.step} has no shard for rank {rank}")


@dataclass(frozen=True)
class CheckpointInfo:
    """One step directory as ``list_checkpoints`` sees it."""

    job: str
    step: int
    status: Literal["committed", "incomplete"]
    path: Path
    ranks: int  # manifest entries (committed) or shard files present (incomplete)
    world_size: int | None  # from the manifest; None when incomplete
    bytes: int
    created_at: str  # manifest's created_at, or the directory's mtime when incomplete
    detail: str = ""  # why an incomplete directory is not a checkpoint

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "step": self.step, "status": self.status, "path": str(self.path),
                "ranks": self.ranks, "world_size": self.world_size, "bytes": self.bytes,
                "created_at": self.created_at, "detail": self.detail}


# -- paths ----------------------------------------------------------------------------------------


def _shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.shard"


def job_dir(root: Path, job: str) -> Path:
    if not job or "/" in job or job in (".", ".."):
        raise ValueError(f"invalid job id for a path: {job!r}")
    return Path(root) / job


def step_dir(root: Path, job: str, step: int) -> Path:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return job_dir(root, job) / f"step-{step:09d}"


def locate_step(directory: Path) -> tuple[Path, str, int]:
    """``(root, job, step)`` of a step directory ``<root>/<job>/step-<s>``; ``CheckpointNotFound`` for a folder
    that is not one."""
    directory = Path(directory)
    match = _STEP_DIR.match(directory.name)
    if match is None or not directory.is_dir():
        raise CheckpointNotFound(f"{directory} is not a step directory of the persistent tier (<root>/<job>/step-<9 digits>)")
    return directory.parent.parent, directory.parent.name, int(match.group(1))


def shard_file(root: Path, job: str, step: int, rank: int) -> Path:
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return step_dir(root, job, step) / _shard_name(rank)


def manifest_path(root: Path, job: str, step: int) -> Path:
    return step_dir(root, job, step) / MANIFEST_NAME


# -- writing --------------------------------------------------------------------------------------


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    """``write_file_atomic`` with every ``OSError`` turned into ``PersistError`` (temp file removed)."""
    try:
        write_file_atomic(path, data, fsync=True)
    except OSError as exc:
        # write_file_atomic removed its temp file; a failed mkdir or directory fsync leaves nothing.
        raise PersistError(path, exc.errno, f"cannot write: {exc.strerror or exc}") from exc


def write_shard(root: Path, job: str, step: int, rank: int, payload: bytes | memoryview) -> WrittenShard:
    """Write one rank's shard of ``step``: temp file, fsync, rename, fsync the folder.

    Returns ``(path, sha256, bytes, seconds)``; ``seconds`` is the wall time of the write (hash
    excluded), the node's share of Young's save cost. Raises ``PersistError`` on any write failure.
    """
    path = shard_file(root, job, step, rank)
    digest = sha256_hex(payload)
    started = time.perf_counter()
    _write_atomic(path, payload)
    return WrittenShard(path, digest, len(payload), time.perf_counter() - started)


def _as_entry(item: Any) -> ShardEntry:
    """A ``ShardEntry``, or anything with ``rank``, ``bytes`` and ``sha256`` / ``digest`` (a
    ``ShardRecord`` event item, a mapping)."""
    if isinstance(item, ShardEntry):
        return item
    get = item.get if isinstance(item, dict) else lambda key, default=None: getattr(item, key, default)
    digest = get("sha256") or get("digest")
    rank, size = get("rank"), get("bytes")
    if rank is None or size is None or not digest:
        raise ValueError(f"a shard entry needs rank, bytes and sha256/digest, got {item!r}")
    return ShardEntry(rank=int(rank), bytes=int(size), sha256=str(digest))


def write_manifest(root: Path, job: str, step: int, world_size: int, shards: Iterable[Any]) -> Manifest:
    """Commit ``step``: write ``manifest.json`` atomically, after checking that every rank
    ``0..world_size-1`` has exactly one entry and that each shard file is present with that size.

    Call it last, once every node's ``write_shard`` returned. Rewriting a step's manifest replaces it
    atomically. Raises ``CheckpointError`` when a shard is missing, duplicated or of the wrong size
    (nothing is written), ``PersistError`` when the write itself fails (the old manifest, if any,
    stays).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    entries = sorted((_as_entry(item) for item in shards), key=lambda entry: entry.rank)
    ranks = [entry.rank for entry in entries]
    if ranks != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(ranks))
        extra = sorted({r for r in ranks if ranks.count(r) > 1 or r >= world_size})
        raise CheckpointError(f"step {step} of {job}: shard entries do not cover ranks 0..{world_size - 1} "
                              f"exactly once (missing {missing}, duplicated or out of range {extra})")
    directory = step_dir(root, job, step)
    for entry in entries:
        path = directory / entry.file
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path}: shard of rank {entry.rank} is missing; not committing step {step}") from None
        if size != entry.bytes:
            raise CheckpointError(f"{path}: shard of rank {entry.rank} is {size} bytes, expected {entry.bytes}; "
                                  f"not committing step {step}")
    created_at = datetime.now(UTC).isoformat(timespec="milliseconds")
    document = {"format": MANIFEST_FORMAT, "job": job, "step": step, "world_size": world_size,
                "shards": [entry.to_json() for entry in entries], "created_at": created_at}
    data = (json.dumps(document, indent=1) + "\n").encode()
    path = directory / MANIFEST_NAME
    _write_atomic(path, data)
    return Manifest(job, step, world_size, tuple(entries), created_at, path, sha256_hex(data))


# -- reading --------------------------------------------------------------------------------------


def _parse_manifest(path: Path, data: bytes, job: str, step: int) -> Manifest:
    try:
        document = json.loads(data)
        shards = tuple(ShardEntry(rank=int(s["rank"]), bytes=int(s["bytes"]), sha256=str(s["sha256"]),
                                  file=str(s["file"])) for s in document["shards"])
        manifest = Manifest(str(document["job"]), int(document["step"]), int(document["world_size"]), shards,
                            str(document["created_at"]), path, sha256_hex(data))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorrupt(f"{path}: unreadable manifest: {exc}") from None
    if manifest.job != job or manifest.step != step:
        raise CheckpointCorrupt(f"{path}: manifest is for {manifest.job} step {manifest.step}, not {job} step {step}")
    if any("/" in entry.file or entry.file.startswith(".") for entry in shards):
        raise CheckpointCorrupt(f"{path}: a shard file name points outside the step directory")
    return manifest


def read_manifest(root: Path, job: str, step: int) -> Manifest:
    """The manifest of a committed step. ``CheckpointNotFound`` when there is none,
    ``CheckpointCorrupt`` when it cannot be parsed."""
    path = manifest_path(root, job, step)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointNotFound(f"no committed checkpoint of {job} at step {step} (no {path})") from None
    return _parse_manifest(path, data, job, step)


def load_shard(root: Path, job: str, step: int, rank: int, *, verify: bool = True) -> bytes:
    """Rank ``rank``'s shard of committed ``step``, checked against the manifest.

    Raises ``CheckpointNotFound`` (no manifest, or no entry for the rank) and ``CheckpointCorrupt``
    (file missing, truncated, longer than recorded, or, with ``verify``, a SHA-256 mismatch).
    """
    manifest = read_manifest(root, job, step)
    entry = manifest.shard(rank)
    path = manifest.path.parent / entry.file
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{path}: shard of rank {rank} listed in the manifest of step {step} is missing") from None
    if len(data) != entry.bytes:
        what = "truncated" if len(data) < entry.bytes else "longer than recorded"
        raise CheckpointCorrupt(f"{path}: {what} ({len(data)} of {entry.bytes} bytes)")
    if verify:
        actual = sha256_hex(data)
        if actual != entry.sha256:
            raise CheckpointCorrupt(f"{path}: SHA-256 mismatch (manifest {entry.sha256[:12]}, file {actual[:12]})")
    return data


def _step_dirs(directory: Path) -> Iterator[tuple[int, Path]]:
    try:
        entries = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            yield int(match.group(1)), entry


def _inspect(job: str, step: int, directory: Path) -> CheckpointInfo:
    manifest_file = directory / MANIFEST_NAME
    detail = "no manifest"
    try:
        manifest = _parse_manifest(manifest_file, manifest_file.read_bytes(), job, step)
        return CheckpointInfo(job, step, "committed", directory, len(manifest.shards), manifest.world_size,
                              manifest.bytes, manifest.created_at)
    except FileNotFoundError:
        pass
    except CheckpointCorrupt as exc:
        detail = str(exc)
    shard_sizes = []
    for entry in directory.iterdir():
        if _SHARD_FILE.match(entry.name):
            try:
                shard_sizes.append(entry.stat().st_size)
            except FileNotFoundError:  # removed while listing
                continue
    mtime = datetime.fromtimestamp(directory.stat().st_mtime, UTC).isoformat(timespec="milliseconds")
    return CheckpointInfo(job, step, "incomplete", directory, len(shard_sizes), None, sum(shard_sizes), mtime, detail)


def list_checkpoints(root: Path, job: str | None = None) -> list[CheckpointInfo]:
    """Every step directory under ``root`` (or one job's), sorted by job then step.

    Only steps with a valid manifest are ``committed``; the others are listed as ``incomplete``
    (a save in progress, interrupted, or with an unreadable manifest: ``detail`` says which).
    The manifest is parsed, the shards are not hashed (``load_shard`` verifies).
    """
    root = Path(root)
    if job is not None:
        jobs = [job_dir(root, job)]
    else:
        try:
            jobs = sorted(entry for entry in root.iterdir() if entry.is_dir())
        except FileNotFoundError:
            return []
    out: list[CheckpointInfo] = []
    for directory in jobs:
        for step, path in sorted(_step_dirs(directory)):
            try:
                out.append(_inspect(directory.name, step, path))
            except FileNotFoundError:  # removed by retention while listing
                continue
    return out


def latest_committed(root: Path, job: str) -> Manifest | None:
    """The newest committed step's manifest (unreadable manifests skipped), or ``None``."""
    for step, _path in sorted(_step_dirs(job_dir(root, job)), reverse=True):
        try:
            return read_manifest(root, job, step)
        except CheckpointError:
            continue
    return None


def apply_retention(root: Path, job: str, keep: int) -> list[Path]:
    """Keep the newest ``keep`` committed steps of ``job``; remove older committed step directories
    and incomplete directories older than the newest committed step (a save that never finished).
    Incomplete directories newer than it are saves in progress and stay. Returns what was removed.

    The manifest goes first, so a removal interrupted half-way leaves an incomplete directory (removed
    next time), never a committed checkpoint with missing shards.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest committed checkpoint is never removed), got {keep}")
    infos = list_checkpoints(root, job)
    committed = [info for info in infos if info.status == "committed"]
    if not committed:
        return []
    newest = committed[-1].step
    kept = {info.step for info in committed[-keep:]}
    removed: list[Path] = []
    for info in infos:
        if info.step in kept or (info.status == "incomplete" and info.step > newest):
            continue
        (info.path / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(info.path, ignore_errors=True)
        removed.append(info.path)
    return removed


"""The shared-memory slot layout: the contract between a rank's Checkpointer and its node agent.

A rank writes its every-step snapshot into a small ring of pre-allocated *slot files* in a directory
on a RAM-backed filesystem (``/dev/shm``), which the node agent creates and owns: the files outlive
the training process (a crashed rank's last snapshots are still there for an in-place restart), and
they disappear with the node (a node that is replaced comes back with an empty directory).

Paths::

    <node_dir>/rank<R>.slot<I>        the ring of rank R (I = 0 .. slots-1), written by the rank
    <node_dir>/backup/rank<R>.shard   the committed copy of rank R's shard held for a peer node
    <node_dir>/restore/rank<R>.shard  a shard fetched from a peer or from disk for a restore

Slot file layout: a 4096-byte header page, then the payload (one serialized shard, opaque here).
The header is a fixed ``struct`` (``HEADER``): magic, version, state, step, payload length, SHA-256
digest of the payload, the rank's restart generation, the wall time the snapshot completed and (layout
version 2) the XXH3-128 digest of the same payload.

Two digests, two jobs. The SHA-256 is the shard's identity beyond this node: the agent's inventory
reports it, the peer backup and the persistent tier are checked against it. The XXH3-128 (about 30 GB/s
here, against 1-2 GB/s for SHA-256) is what a rank checks when it restores its own slot from local
memory, so that a verified restore costs little more than the copy: a 128-bit hash catches torn writes
and flipped bits as surely, and nothing is gained by a cryptographic one on a file only this user can
write, who could rewrite both digests in the header anyway. Version 1 slots (no XXH3) still read; their
restore falls back to the SHA-256.

Writing protocol (``SlotWriter``): mark the slot ``WRITING`` (header only), write the payload, then
write the complete header with ``state=COMPLETE``. A reader trusts only ``COMPLETE`` slots and, before
a restore, checks the payload against the digest, so a slot torn by a crash is never loaded.

Slot files sit under a predictable path in a world-writable place, so every open goes through
``keel.checkpoint.owned``: no symbolic link is followed, and a file that is not this user's own (another
owner, writable by others) is refused (``SlotError``); a new slot file is created ``O_EXCL`` with mode 0600.

Python (``mmap``, ``struct``, ``hashlib``, ``xxhash``): no torch, so the agent and the broker import it cheaply.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import xxhash

from keel.checkpoint.owned import UntrustedPathError, open_owned

__all__ = [
    "HEADER_BYTES",
    "SLOT_EMPTY",
    "SLOT_WRITING",
    "SLOT_COMPLETE",
    "SlotHeader",
    "SlotError",
    "SlotWriter",
    "read_header",
    "parse_header",
    "read_payload",
    "read_payload_consistent",
    "verify_payload",
    "slot_path",
    "backup_path",
    "restore_path",
    "list_slots",
    "sha256_hex",
    "xxh3_128_hex",
    "write_file_atomic",
]

MAGIC = b"KEELSLOT"
VERSION = 2
HEADER_BYTES = 4096
SLOT_EMPTY, SLOT_WRITING, SLOT_COMPLETE = 0, 1, 2
# Version 1: magic, version, state, step, payload_len, digest (sha256), generation, completed_at_unix_s.
HEADER_V1 = struct.Struct("<8sIIqQ32sqd")
# Version 2 (written now): the same, then fast_digest (XXH3-128; all zero when the writer gave none).
HEADER = struct.Struct("<8sIIqQ32sqd16s")
_READABLE_VERSIONS = (1, 2)

_SLOT_NAME = re.compile(r"^rank(\d+)\.slot(\d+)$")


class SlotError(RuntimeError):
    """A slot file that is missing, not a Keel slot, or whose payload does not match its digest."""


@dataclass(frozen=True)
class SlotHeader:
    state: int
    step: int
    payload_len: int
    digest: str  # hex SHA-256 of the payload; "" unless COMPLETE
    generation: int
    completed_at_unix_s: float
    fast_digest: str = ""  # hex XXH3-128 of the payload; "" unless COMPLETE and written (layout version 2)

    @property
    def complete(self) -> bool:
        return self.state == SLOT_COMPLETE


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    """Hex SHA-256 (about 1.3 GB/s here with SHA-NI; ``hashlib`` releases the GIL on large buffers)."""
    return hashlib.sha256(data).hexdigest()


def xxh3_128_hex(data: bytes | bytearray | memoryview) -> str:
    """Hex XXH3-128 (about 30 GB/s here; ``xxhash`` releases the GIL): the local restore's check."""
    return xxhash.xxh3_128_hexdigest(data)


def slot_path(node_dir: Path, rank: int, index: int) -> Path:
    return Path(node_dir) / f"rank{rank}.slot{index}"


def backup_path(node_dir: Path, rank: int) -> Path:
    return Path(node_dir) / "backup" / f"rank{rank}.shard"


def restore_path(node_dir: Path, rank: int) -> Path:
    return Path(node_dir) / "restore" / f"rank{rank}.shard"


def _pack(state: int, step: int, payload_len: int, digest_hex: str, generation: int, completed_at: float,
          fast_digest_hex: str = "") -> bytes:
    digest = bytes.fromhex(digest_hex) if digest_hex else b"\0" * 32
    fast = bytes.fromhex(fast_digest_hex) if fast_digest_hex else b"\0" * 16
    return HEADER.pack(MAGIC, VERSION, state, step, payload_len, digest, generation, completed_at, fast)


def _unpack(raw: bytes | memoryview, where: str) -> SlotHeader:
    if len(raw) < HEADER_V1.size:
        raise SlotError(f"{where}: truncated header ({len(raw)} bytes)")
    magic, version = struct.unpack_from("<8sI", raw)
    if magic != MAGIC:
        raise SlotError(f"{where}: not a Keel slot (magic {magic!r})")
    if version not in _READABLE_VERSIONS:
        raise SlotError(f"{where}: slot layout version {version}, this Keel reads {_READABLE_VERSIONS}")
    fast = b""
    if version == 1:
        _, _, state, step, payload_len, digest, generation, completed_at = HEADER_V1.unpack_from(raw)
    else:
        if len(raw) < HEADER.size:
            raise SlotError(f"{where}: truncated header ({len(raw)} bytes)")
        _, _, state, step, payload_len, digest, generation, completed_at, fast = HEADER.unpack_from(raw)
    complete = state == SLOT_COMPLETE
    return SlotHeader(state, step, payload_len, digest.hex() if complete else "", generation, completed_at,
                      fast.hex() if complete and any(fast) else "")


class SlotWriter:
    """One slot file, memory-mapped for writing by its rank. ``capacity`` is the payload capacity.

    ``begin(step)`` marks it WRITING; the caller fills ``payload_view()[:n]``; ``complete(step, n,
    digest, generation, fast_digest)`` publishes it (``fast_digest``: the payload's ``xxh3_128_hex``, which a
    local restore checks; without it the restore checks the SHA-256). A capacity change recreates the file (a new mapping).
    """

    def __init__(self, path: Path, capacity: int) -> None:
        self.path = Path(path)
        self.capacity = capacity
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_slot(self.path, os.O_RDWR, create=True)
        try:
            os.ftruncate(fd, HEADER_BYTES + capacity)
            self._map = mmap.mmap(fd, HEADER_BYTES + capacity)
        finally:
            os.close(fd)

    def payload_view(self) -> memoryview:
        return memoryview(self._map)[HEADER_BYTES:]

    def begin(self, step: int, generation: int) -> None:
        self._map[: HEADER.size] = _pack(SLOT_WRITING, step, 0, "", generation, 0.0)

    def complete(self, step: int, payload_len: int, digest_hex: str, generation: int, fast_digest_hex: str = "") -> None:
        if payload_len > self.capacity:
            raise SlotError(f"{self.path}: payload {payload_len} bytes exceeds capacity {self.capacity}")
        self._map[: HEADER.size] = _pack(SLOT_COMPLETE, step, payload_len, digest_hex, generation, time.time(),
                                         fast_digest_hex)

    def header(self) -> SlotHeader:
        return _unpack(self._map[: HEADER.size], str(self.path))

    def close(self) -> None:
        self._map.close()


def _open_slot(path: Path, flags: int, *, create: bool = False) -> int:
    """A descriptor of slot ``path`` (``open_owned``: no symbolic link, this user's own); with ``create``, a
    missing file is created 0600 (``O_EXCL``). ``SlotError`` when missing (without ``create``) or untrusted."""
    for _ in range(3):  # created or removed by someone else between the two opens: look again
        try:
            return open_owned(path, flags)
        except FileNotFoundError:
            if not create:
                raise SlotError(f"{path}: no such slot") from None
        except UntrustedPathError as exc:
            raise SlotError(f"slot {exc}") from None
        try:
            return open_owned(path, flags | os.O_CREAT, 0o600)
        except FileExistsError:
            continue
        except UntrustedPathError as exc:
            raise SlotError(f"slot {exc}") from None
    raise SlotError(f"{path}: created and removed again while opening it")


def parse_header(raw: bytes | memoryview, where: str) -> SlotHeader:
    """The header at the start of a slot's bytes (e.g. a memory map); ``SlotError`` if not a slot."""
    return _unpack(raw[: HEADER.size], where)


def read_header(path: Path) -> SlotHeader:
    """The header of a slot file; ``SlotError`` if it is missing or not a slot."""
    with os.fdopen(_open_slot(Path(path), os.O_RDONLY), "rb") as f:
        raw = f.read(HEADER.size)
    return _unpack(raw, str(path))


def read_payload(path: Path, *, verify: bool = True) -> tuple[SlotHeader, bytes]:
    """A COMPLETE slot's header and payload bytes, not torn (``read_payload_consistent``). ``verify``:
    also check the payload against its digest (``verify_payload``).

    Raises ``SlotError`` when the slot is not complete, is torn or truncated, or fails verification.
    """
    header, payload = read_payload_consistent(path)
    if verify:
        verify_payload(header, payload, str(path))
    return header, payload


def verify_payload(header: SlotHeader, payload: bytes | bytearray | memoryview, where: str) -> None:
    """Check a COMPLETE slot's payload against its XXH3-128 (its SHA-256 when the slot has none): the
    writer took both of the same bytes, so a match vouches for ``header.digest`` too. ``SlotError`` if not."""
    if header.fast_digest:
        algorithm, expected, actual = "XXH3-128", header.fast_digest, xxh3_128_hex(payload)
    else:
        algorithm, expected, actual = "SHA-256", header.digest, sha256_hex(payload)
    if actual != expected:
        raise SlotError(f"{where}: digest mismatch for step {header.step} ({algorithm} stored {expected[:12]}, "
                        f"actual {actual[:12]})")


def read_payload_consistent(path: Path) -> tuple[SlotHeader, bytes]:
    """A COMPLETE slot's payload without hashing it, guaranteed not torn by a concurrent writer.

    The writer marks a slot WRITING before it touches the payload, so a header that reads the same
    (COMPLETE, same step, same completion time) before and after the payload proves the payload was
    not being rewritten meanwhile. Enough for senders whose receiver verifies the SHA-256 end to end;
    a restore must still verify (``read_payload``). ``SlotError`` when incomplete, torn or truncated.
    """
    with os.fdopen(_open_slot(Path(path), os.O_RDONLY), "rb") as f:
        before = _unpack(f.read(HEADER.size), str(path))
        if not before.complete:
            raise SlotError(f"{path}: slot is not complete (state {before.state}, step {before.step})")
        f.seek(HEADER_BYTES)
        payload = f.read(before.payload_len)
        f.seek(0)
        after = _unpack(f.read(HEADER.size), str(path))
    if after != before:
        raise SlotError(f"{path}: slot of step {before.step} was overwritten while being read")
    if len(payload) != before.payload_len:
        raise SlotError(f"{path}: truncated payload ({len(payload)} of {before.payload_len} bytes)")
    return before, payload


SENT_DIR = "sent"
"""Under a node's slot folder: local copies of the last two snapshots each rank backed up to its peer (slot
format, ``keel.agent.checkpointing.keep_sent_copy``); its shard store serves them as slots too."""


def list_slots(node_dir: Path) -> dict[int, list[Path]]:
    """The slot files under ``node_dir`` by rank (backup and restore folders excluded)."""
    out: dict[int, list[Path]] = {}
    try:
        entries = sorted(Path(node_dir).iterdir())
    except FileNotFoundError:
        return out
    for entry in entries:
        m = _SLOT_NAME.match(entry.name)
        if m:
            out.setdefault(int(m.group(1)), []).append(entry)
    return out


def write_file_atomic(path: Path, data: bytes | bytearray | memoryview, *, fsync: bool = True,
                      mode: int = 0o666) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder, fsync, rename (and fsync the folder).

    A crash or ``ENOSPC`` leaves the old file (if any) untouched; the temp file is removed on error. The
    temp file is created new (``O_EXCL | O_NOFOLLOW``, ``mode`` less the umask, 0666 as ``open`` would by
    default; 0600 for a private file): a name planted in the folder is never written through. Its name is
    unique per call, so threads of one process may write side by side.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

"""The node agent's shard store: the gRPC ``ShardStore`` server, the backup sender, and ``fetch_shard``.

Every node agent serves ``keel.checkpoint.v1.ShardStore`` over its node directory
``<shm root>/<job>/<node>/`` (see ``keel.checkpoint.slots`` for the layout):

- ``PutShard``: a peer streams its rank's committed shard here as a backup. Chunks of at most 1 MiB,
  each with its CRC32 and offset; the first carries the header (job, owner node, rank, step, total
  length, SHA-256, generation). The payload goes into a temp file beside ``backup/rank<R>.shard``
  and is renamed into place only once every CRC32, the length and the SHA-256 match, so a torn or
  corrupted stream never replaces the backup held before. A sidecar ``backup/rank<R>.json`` names
  what the file holds (owner, step, generation, length, SHA-256); a shard without its sidecar is
  never served.
- ``GetShard``: streams a shard this node holds, its own rank's COMPLETE slot or a backup, verified
  against its digest before the first byte leaves.
- ``ListShards``: what the node holds, optionally verified.

``ShardSender`` pushes this node's ranks' committed slots to their backup peers: at most one transfer
in flight per peer, latest wins (a newer step supersedes a pending one; steps are skipped, never
queued). ``fetch_shard`` pulls a shard from a peer into a local file (a restore).

asyncio throughout (``grpc.aio``), on the agent's loop; hashing, slot reads and file writes run in
worker threads (``hashlib`` and ``zlib`` release the GIL on large buffers), so a multi-GiB shard never
stalls the agent's probes. Every call carries the job id and is refused for another job.

Security: mutual TLS only (``TlsMaterial``: a node certificate of the job's CA, ``keel.infra.shard_ca``);
there is no plaintext port. The server reads the peer's node id from its verified certificate and
decides with ``keel.agent.shard_access``: ``PutShard`` only from the node assigned to back that rank up
here (``assign_senders``, from the broker's placement), only as its own shard and only of this node's
generation or newer (``refuse_generations_below``: a fenced host's stale backups are refused), ``GetShard`` and
``ListShards`` from nodes of the job, ranks below the world size, per-peer and total byte quotas and
stream limits (``StoreLimits``). Clients verify the server's certificate against the same CA. Every
file the store writes (backups, sidecars, fetched shards) is created 0600, without following links.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Literal

import grpc
from grpc import aio

from keel.agent.shard_access import (
    Refusal,
    StoreLimits,
    StreamLoad,
    admit_stream,
    authorize_put,
    authorize_read,
)
from keel.checkpoint.slots import (
    SENT_DIR,
    SlotError,
    SlotHeader,
    backup_path,
    list_slots,
    read_header,
    read_payload,
    read_payload_consistent,
    sha256_hex,
    write_file_atomic,
)
from keel.infra.shard_ca import SERVER_NAME, NodeCredentials, ShardCaError, issue_node_certificate, node_identity
from keel.protocol import shard_store_pb2 as pb
from keel.protocol import shard_store_pb2_grpc as pb_grpc

__all__ = [
    "CHUNK_BYTES",
    "TlsMaterial",
    "StoreLimits",
    "ShardTransferError",
    "PeerUnavailable",
    "TransferRejected",
    "ShardIntegrityError",
    "LocalShardError",
    "TransferResult",
    "TransferOutcome",
    "HeldShard",
    "RejectedHeld",
    "ShardStoreServer",
    "ShardSender",
    "fetch_shard",
    "read_committed_slot",
]

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
"""The largest chunk on the wire (the protocol's limit; receivers refuse larger ones)."""
# gRPC refuses messages above 4 MiB by default; a chunk is 1 MiB of data plus a small header.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", CHUNK_BYTES + 64 * 1024),
    ("grpc.max_send_message_length", CHUNK_BYTES + 64 * 1024),
]
# Channels of their own: with gRPC's global subchannel pool a new channel to a peer that just came
# back would inherit the dead connection's reconnect backoff and fail at once. Every node of the job
# serves under one certificate name (``SERVER_NAME``): a peer's address is no identity, its certificate is.
_CLIENT_OPTIONS = [*_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1),
                   ("grpc.ssl_target_name_override", SERVER_NAME)]
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")

BackupCopy = Literal["newest", "previous", "pinned"]
BACKUP_COPIES: tuple[BackupCopy, ...] = ("newest", "previous", "pinned")
"""The copies a store may hold of a rank's backup: the newest, the one it replaced, and the committed step's."""

ShardKind = Literal["slot", "backup"]


@dataclass(frozen=True)
class TlsMaterial:
    """A node's mTLS material, PEM: its certificate (chain), its private key, and the job's CA certificate."""

    cert_chain: bytes
    private_key: bytes
    root_ca: bytes

    def __repr__(self) -> str:  # never the key in a log line
        return f"TlsMaterial(cert_chain={len(self.cert_chain)} bytes, private_key=<hidden>, root_ca={len(self.root_ca)} bytes)"

    @classmethod
    def load(cls, credentials: NodeCredentials) -> TlsMaterial:
        """Read a node's files (each must be private to this user: ``keel.infra.secrets.read_secret``)."""
        cert, key, ca = credentials.load()
        return cls(cert, key, ca)

    @classmethod
    def issue(cls, credentials_dir: Path, job_id: str, node_id: str, hosts: tuple[str, ...] = ()) -> TlsMaterial:
        """Issue ``node_id`` a certificate from ``job_id``'s CA under ``credentials_dir`` (created on first
        use) and load it: what a launcher that holds the credentials folder does for each node."""
        return cls.load(issue_node_certificate(credentials_dir, job_id, node_id, hosts=hosts))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.root_ca,
                                           require_client_auth=True)

    def channel(self, address: str) -> aio.Channel:
        """A client channel to a peer's store: its certificate must chain to the job's CA."""
        creds = grpc.ssl_channel_credentials(self.root_ca, self.private_key, self.cert_chain)
        return aio.secure_channel(address, creds, options=_CLIENT_OPTIONS)


_PRIVATE_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_private_atomic(path: Path, data: bytes, *, fsync: bool) -> None:
    """Write ``data`` to ``path`` through a fresh 0600 temp file beside it, never following a link, then rename."""
    write_file_atomic(path, data, fsync=fsync, mode=0o600)


# -- errors and results ---------------------------------------------------------------------------


class ShardTransferError(RuntimeError):
    """A shard transfer failed; ``address`` is the peer, the message says why."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__(f"{address}: {message}")
        self.address = address
        self.reason = message


class PeerUnavailable(ShardTransferError):
    """The peer is dead, unreachable, or did not finish within the timeout."""


class TransferRejected(ShardTransferError):
    """The peer answered and refused (stale step, wrong job, bad checksum, too large, not held...).

    ``code`` is the gRPC status; ``reason`` the peer's text."""

    def __init__(self, address: str, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(address, f"rejected ({code.name}): {reason}")
        self.code = code
        self.reason = reason


class ShardIntegrityError(ShardTransferError):
    """What arrived does not match: a chunk's CRC32, the offsets, the length, or the SHA-256."""


class LocalShardError(ShardTransferError):
    """The sender has no COMPLETE, verified slot for the requested rank and step."""


@dataclass(frozen=True)
class TransferResult:
    """One finished transfer (for metrics: ``bytes`` in ``seconds``)."""

    address: str
    rank: int
    step: int
    bytes: int
    seconds: float
    sha256: str

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class TransferOutcome:
    """What a background transfer of ``ShardSender.submit`` ended with: ``result`` or ``error``."""

    address: str
    rank: int
    requested_step: int
    result: TransferResult | None = None
    error: ShardTransferError | None = None


@dataclass(frozen=True)
class HeldShard:
    """A shard this node holds: one of its own ranks' COMPLETE slots, or a backup held for a peer."""

    rank: int
    step: int
    bytes: int
    sha256: str
    kind: ShardKind
    owner_node_id: str
    generation: int
    path: Path

    def to_proto(self) -> pb.ShardInfo:
        return pb.ShardInfo(rank=self.rank, step=self.step, bytes=self.bytes, sha256=self.sha256, kind=self.kind,
                            owner_node_id=self.owner_node_id, generation=self.generation, path=str(self.path))


@dataclass(frozen=True)
class RejectedHeld:
    """A slot or backup that failed verification (or whose sidecar is unreadable), and why."""

    rank: int
    step: int
    kind: ShardKind
    path: Path
    reason: str

    def to_proto(self) -> pb.RejectedShardInfo:
        return pb.RejectedShardInfo(rank=self.rank, step=self.step, kind=self.kind, path=str(self.path),
                                    reason=self.reason)


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _chunks(length: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, end) of every chunk; an empty payload is one empty chunk (it still carries the header)."""
    return [(o, min(o + chunk_bytes, length)) for o in range(0, length, chunk_bytes)] or [(0, 0)]


def _chunk_crcs(payload: bytes, spans: list[tuple[int, int]]) -> list[int]:
    """The CRC32 of every chunk, computed up front in a worker thread (off the event loop)."""
    view = memoryview(payload)
    return [zlib.crc32(view[offset:end]) for offset, end in spans]


def _map_rpc_error(address: str, exc: grpc.aio.AioRpcError, timeout: timedelta) -> ShardTransferError:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return PeerUnavailable(address, f"unavailable: {exc.details()}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return PeerUnavailable(address, f"no complete answer within {timeout.total_seconds():g}s")
    return TransferRejected(address, code, exc.details() or "")


# -- the receiving side's file handling (runs in worker threads) ----------------------------------


class _CrcMismatch(Exception):
    def __init__(self, offset: int) -> None:
        super().__init__(f"CRC32 mismatch in the chunk at offset {offset}")
        self.offset = offset


class _Receiver:
    """A stream being written into a temp file, CRC32-checked and hashed chunk by chunk.

    The checks and writes run in one worker thread per stream (so they stay in order), up to
    ``depth`` chunks behind the network: gRPC keeps receiving while the previous chunks are hashed.
    ``received`` counts the bytes accepted from the stream; ``drain()`` waits until all are checked.
    """

    def __init__(self, tmp: Path, depth: int = 4) -> None:
        self.tmp = tmp
        self.file: IO[bytes] | None = None
        self.hasher = hashlib.sha256()
        self.received = 0
        self._depth = depth
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-recv")
        self._inflight: deque[tuple[int, asyncio.Future[bool]]] = deque()
        # The worker writes while discard() may run on the loop (a cancelled stream): never both at once.
        self._lock = threading.Lock()

    async def open(self) -> None:
        def _open() -> None:
            self.tmp.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # A fresh file of this user only: never one planted there, never through a link.
            self.file = os.fdopen(os.open(self.tmp, _PRIVATE_CREATE, 0o600), "wb")

        await asyncio.get_running_loop().run_in_executor(self._executor, _open)

    def _absorb(self, data: bytes, crc32: int) -> bool:
        if zlib.crc32(data) != crc32:
            return False
        with self._lock:
            if self.file is None:
                raise OSError(errno.ECANCELED, "stream discarded")
            self.file.write(data)
        self.hasher.update(data)
        return True

    async def absorb(self, offset: int, data: bytes, crc32: int) -> None:
        """Queue one chunk; raises ``_CrcMismatch`` (for this chunk or an earlier one) or ``OSError``."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._absorb, data, crc32)
        self._inflight.append((offset, future))
        self.received += len(data)
        while len(self._inflight) > self._depth:
            await self._settle_one()

    async def _settle_one(self) -> None:
        offset, future = self._inflight.popleft()
        if not await future:
            raise _CrcMismatch(offset)

    async def drain(self) -> str:
        """Wait for every queued chunk; the hex SHA-256 of everything received."""
        while self._inflight:
            await self._settle_one()
        return self.hasher.hexdigest()

    async def finish(self, dest: Path, fsync: bool) -> None:
        """After ``drain()``: flush (and fsync), close, rename into ``dest``."""
        def _finish() -> None:
            assert self.file is not None
            self.file.flush()
            if fsync:
                os.fsync(self.file.fileno())
            self.file.close()
            self.file = None
            os.replace(self.tmp, dest)

        await asyncio.get_running_loop().run_in_executor(self._executor, _finish)

    def discard(self) -> None:
        """Drop the temp file (idempotent; a no-op after ``finish``). Safe while a chunk is being written."""
        for _, future in self._inflight:
            future.cancel()
        self._inflight.clear()
        with self._lock:
            if self.file is not None:
                self.file.close()
                self.file = None
            self.tmp.unlink(missing_ok=True)
        self._executor.shutdown(wait=False, cancel_futures=True)


# -- the server -----------------------------------------------------------------------------------


class _Abort(Exception):
    """A refusal inside the server's own code, turned into a gRPC status by the handler."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class ShardStoreServer:
    """``ShardStore`` for one node of one job, over ``node_dir`` (``<shm root>/<job>/<node>/``).

    ``tls``: this node's certificate of the job's CA (mTLS only: peers without one cannot connect).
    ``world_size``: ranks ``0..world_size-1`` exist; others are refused. ``limits``: quotas and stream
    limits (``max_shard_bytes`` overrides its largest shard: a PutShard declaring or streaming more is
    refused, RESOURCE_EXHAUSTED). ``fsync``: fsync backups before the rename (off by default: the node
    directory is RAM-backed). Backups are accepted only from the nodes ``assign_senders`` names.
    Use from the agent's event loop: ``address = await server.start(host)``, ``await server.stop()``.
    """

    def __init__(self, job_id: str, node_id: str, node_dir: Path, *, tls: TlsMaterial, world_size: int,
                 limits: StoreLimits | None = None, max_shard_bytes: int | None = None, fsync: bool = False) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        limits = limits or StoreLimits()
        if max_shard_bytes is not None:
            limits = StoreLimits(max_shard_bytes, limits.peer_quota_bytes, limits.total_quota_bytes,
                                 limits.max_streams, limits.max_streams_per_peer)
        self.job_id = job_id
        self.node_id = node_id
        self.node_dir = Path(node_dir)
        self.tls = tls
        self.world_size = world_size
        self.limits = limits
        self.fsync = fsync
        self.senders: dict[int, str] = {}
        """rank -> the node assigned to back it up here (``assign_senders``; kept in ``senders_file``)."""
        self._streams: dict[str, int] = {}  # peer -> streams being served
        self._incoming: dict[str, int] = {}  # peer -> declared bytes of its backups streaming in
        self.refusals = 0
        """Calls refused by ``keel.agent.shard_access`` since start (for tests and metrics)."""
        self.address: str | None = None
        self._server: aio.Server | None = None
        self._rank_locks: dict[int, asyncio.Lock] = {}
        self.backups_received = 0
        """Backups committed since start: the agent reports its held backups when this moves."""
        self.pinned_step = -1
        """The newest peer-committed step of the current history (``pin``; -1: none known)."""
        self._copies_lock = threading.Lock()
        """Moves between a rank's copies happen on the server's threads (a backup arriving) and on the agent's
        (``pin``, ``discard_backup``): one at a time, or a pin could delete the copy a backup just moved."""
        self.on_backup_received: Callable[[], None] | None = None
        """Called (on the server's loop) after each committed backup: wakes the agent's loop."""
        self.min_generation = 0
        """The generation this node runs (``refuse_generations_below``): backups of older ones are refused."""

    def refuse_generations_below(self, generation: int) -> None:
        """This node restarted (or rejoined) as ``generation``: from now on a backup of an older generation is
        refused (``authorize_put``): it comes from a history the job left, such as a host fenced out of it."""
        self.min_generation = max(self.min_generation, generation)

    # lifecycle

    @property
    def max_shard_bytes(self) -> int:
        return self.limits.max_shard_bytes

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen (mTLS) on ``host:port`` (0: a free port); returns the bound ``host:port``."""
        if self._server is not None:
            raise RuntimeError("shard store already started")
        self.backup_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._sweep_temp_files()
        self._load_senders()
        server = aio.server(options=_CHANNEL_OPTIONS)
        pb_grpc.add_ShardStoreServicer_to_server(_Servicer(self), server)
        bound = server.add_secure_port(_format_address(host, port), self.tls.server_credentials())
        if bound == 0:
            raise OSError(errno.EADDRINUSE, f"shard store cannot listen on {_format_address(host, port)}")
        await server.start()
        self._server = server
        self.address = _format_address(host, bound)
        log.info("shard store for %s/%s listening on %s", self.job_id, self.node_id, self.address)
        return self.address

    async def stop(self, grace: timedelta = timedelta(seconds=1)) -> None:
        """Stop serving; streams still running after ``grace`` are cancelled (their temp files removed)."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace.total_seconds())

    # who may send backups here

    @property
    def senders_file(self) -> Path:
        """The assignments in force, kept beside the backups: a restarted agent (``keel.agent.rejoin``)
        accepts its peers' backups again before the broker has a reason to re-send its placement."""
        return self.backup_dir / "senders.json"

    def _load_senders(self) -> None:
        try:
            data = json.loads(self.senders_file.read_text())
            self.senders = {int(rank): str(node) for rank, node in data.items()}
        except FileNotFoundError:
            self.senders = {}
        except (ValueError, TypeError, AttributeError, OSError) as exc:
            log.warning("%s: ignoring unreadable %s (%s): backups are refused until the broker's placement "
                        "arrives again", self.node_id, self.senders_file, exc)
            self.senders = {}

    def assign_senders(self, changes: dict[int, str | None]) -> None:
        """The broker's placement: rank -> the node that now backs it up here (None: no node any more, the
        rank's backups go elsewhere). Takes effect for the next PutShard; kept in ``senders_file``."""
        senders = dict(self.senders)
        for rank, node in changes.items():
            if node is None:
                senders.pop(rank, None)
            else:
                senders[rank] = node
        self.senders = senders  # one assignment: the server's thread sees the old map or the new one
        self.backup_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_private_atomic(self.senders_file, json.dumps({str(r): n for r, n in sorted(senders.items())}).encode(),
                              fsync=False)

    def _held_bytes(self) -> dict[str, int]:
        """Bytes the backups held here take, by owner node (every copy: newest, previous, pinned)."""
        held: dict[str, int] = {}
        for copy in BACKUP_COPIES:
            for sidecar in self._copy_dir(copy).glob("rank*.json"):
                try:
                    meta = json.loads(sidecar.read_text())
                    owner, size = str(meta["owner_node_id"]), int(meta["bytes"])
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # unreadable: the size of its file still counts below, under no owner
                held[owner] = held.get(owner, 0) + size
        return held

    async def _admit(self, peer: str, declared_bytes: int) -> None:
        """Count a stream in for ``peer`` (``_Abort`` when a limit refuses it); pair with ``_release``."""
        if declared_bytes:
            held = await asyncio.to_thread(self._held_bytes)
            peer_bytes = held.get(peer, 0) + self._incoming.get(peer, 0)
            total_bytes = sum(held.values()) + sum(self._incoming.values())
        else:
            peer_bytes = total_bytes = 0
        load = StreamLoad(streams=sum(self._streams.values()), peer_streams=self._streams.get(peer, 0),
                          peer_bytes=peer_bytes, total_bytes=total_bytes)
        self._check(admit_stream(peer, declared_bytes, load, self.limits))
        self._streams[peer] = self._streams.get(peer, 0) + 1
        if declared_bytes:
            self._incoming[peer] = self._incoming.get(peer, 0) + declared_bytes

    def _release(self, peer: str, declared_bytes: int) -> None:
        self._streams[peer] -= 1
        if not self._streams[peer]:
            del self._streams[peer]
        if declared_bytes:
            self._incoming[peer] -= declared_bytes
            if not self._incoming[peer]:
                del self._incoming[peer]

    def _check(self, refusal: Refusal | None) -> None:
        if refusal is not None:
            self.refusals += 1
            raise _Abort(getattr(grpc.StatusCode, refusal.code), refusal.reason)

    def peer_node(self, context: aio.ServicerContext) -> str:
        """The node id the peer's verified certificate names (``_Abort`` PERMISSION_DENIED when none)."""
        pems = context.auth_context().get("x509_pem_cert") or []
        if len(pems) != 1:
            self.refusals += 1
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED, "no client certificate: the shard store serves the "
                                                            "nodes of its job over mutual TLS only")
        try:
            return _identity(pems[0], self.job_id)
        except ShardCaError as exc:
            self.refusals += 1
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None

    # paths

    @property
    def backup_dir(self) -> Path:
        return self.node_dir / "backup"

    def _copy_dir(self, copy: BackupCopy) -> Path:
        return {"newest": self.backup_dir, "previous": self.previous_dir, "pinned": self.pinned_dir}[copy]

    def _sidecar(self, rank: int, copy: BackupCopy = "newest") -> Path:
        return self._copy_dir(copy) / f"rank{rank}.json"

    def _backup_file(self, rank: int, copy: BackupCopy = "newest") -> Path:
        return backup_path(self.node_dir, rank) if copy == "newest" else self._copy_dir(copy) / f"rank{rank}.shard"

    @property
    def previous_dir(self) -> Path:
        """The backup each rank's newest one replaced. Kept because a group lost while a backup round is
        half delivered leaves its peers holding the new round for some ranks and only the old one for
        others: the previous copy keeps a step that every rank still has (else the restore falls back to
        the persistent tier)."""
        return self.backup_dir / "prev"

    @property
    def pinned_dir(self) -> Path:
        """A third copy, of the newest peer-committed step only (``pin``): when a fast rank's rounds push its
        newest and previous backups two rounds past the committed step while a slow rank's delivery lags,
        the committed step still has every rank's copy somewhere, so a group lost then restores from peers
        instead of the persistent tier. Replaced by the next commit's."""
        return self.backup_dir / "pinned"

    def pin(self, step: int) -> None:
        """The broker committed ``step`` on the peer tier (this history): keep each rank's backup of it when
        newer rounds push it out, and drop the pinned copies of other steps. Called from the agent's loop.
        ``step`` -1 (a restart: the next history has committed nothing yet) pins nothing new and drops
        nothing: the restart's inventory may need the copies held (they go with the next commit, with a
        newer generation's backup, or with a restore below them)."""
        with self._copies_lock:
            self.pinned_step = step
            if step >= 0:
                self._drop_pinned_except(step)

    def _drop_pinned_except(self, step: int) -> None:
        for sidecar in sorted(self.pinned_dir.glob("rank*.json")):
            match = re.match(r"^rank(\d+)\.json$", sidecar.name)
            if not match:
                continue
            rank = int(match.group(1))
            try:
                meta = self._backup_meta(rank, "pinned")
            except (ValueError, OSError):
                meta = None
            if meta is not None and int(meta.get("step", -1)) == step:
                continue
            sidecar.unlink(missing_ok=True)
            self._backup_file(rank, "pinned").unlink(missing_ok=True)

    def _sweep_temp_files(self) -> None:
        """Temp files left by an agent that died mid-stream are garbage: nothing refers to them."""
        for entry in self.backup_dir.glob(".rank*.shard.tmp-*"):
            entry.unlink(missing_ok=True)

    # what is held

    def _backup_meta(self, rank: int, copy: BackupCopy = "newest") -> dict[str, Any] | None:
        try:
            meta = json.loads(self._sidecar(rank, copy).read_text())
        except FileNotFoundError:
            return None
        if not isinstance(meta, dict):
            raise ValueError("sidecar is not a JSON object")
        return meta

    def discard_backup(self, rank: int, newer_than: int = -1) -> None:
        """Drop the backups held for ``rank`` (newest, previous and pinned) whose step is above ``newer_than``
        (-1: all): each sidecar first, so a half-removed backup is never served. A previous (else a pinned
        copy) that stays while the newest goes becomes the newest (it is the one a restore to
        ``newer_than`` fetches)."""
        with self._copies_lock:
            self._discard_backup(rank, newer_than)

    def _discard_backup(self, rank: int, newer_than: int) -> None:
        for copy in BACKUP_COPIES:
            try:
                meta = self._backup_meta(rank, copy)
            except (ValueError, OSError):
                meta = None  # unreadable: nothing worth keeping
            if newer_than >= 0 and meta is not None and int(meta.get("step", -1)) <= newer_than:
                continue
            self._sidecar(rank, copy).unlink(missing_ok=True)
            self._backup_file(rank, copy).unlink(missing_ok=True)
        for copy in ("previous", "pinned"):
            kept = self._backup_file(rank, copy)
            if not self._sidecar(rank).exists() and self._sidecar(rank, copy).exists() and kept.exists():
                sidecar = self._sidecar(rank, copy).read_bytes()
                self._sidecar(rank, copy).unlink()
                os.replace(kept, self._backup_file(rank))
                _write_private_atomic(self._sidecar(rank), sidecar, fsync=self.fsync)

    def held_shards(self, *, verify: bool = False) -> tuple[list[HeldShard], list[RejectedHeld]]:
        """Every COMPLETE slot and every backup under the node directory, by rank then step.

        ``verify``: read every payload and check its SHA-256 (the restart inventory); failures, and
        backups whose sidecar is unreadable or whose file is missing or of another size, go to the
        second list. Slots that are EMPTY or WRITING are simply not held. Blocking: call it in a thread.
        """
        held: list[HeldShard] = []
        rejected: list[RejectedHeld] = []
        for rank, paths in list_slots(self.node_dir).items():
            for path in paths:
                step = -1
                try:
                    header = read_header(path)
                    if not header.complete:
                        continue
                    step = header.step
                    if verify:
                        header, _ = read_payload(path, verify=True)
                except SlotError as exc:
                    rejected.append(RejectedHeld(rank, step, "slot", path, str(exc)))
                    continue
                held.append(HeldShard(rank, header.step, header.payload_len, header.digest, "slot", self.node_id,
                                      header.generation, path))
        for copy in BACKUP_COPIES:
            for sidecar in sorted(self._copy_dir(copy).glob("rank*.json")):
                match = re.match(r"^rank(\d+)\.json$", sidecar.name)
                if not match:
                    continue
                rank = int(match.group(1))
                try:
                    shard = self._held_backup(rank, verify=verify, copy=copy)
                except _BadBackup as exc:
                    rejected.append(RejectedHeld(rank, exc.step, "backup", self._backup_file(rank, copy), exc.reason))
                    continue
                if shard is not None:
                    held.append(shard)
        held.sort(key=lambda s: (s.rank, s.step, s.kind))
        return held, rejected

    def _held_backup(self, rank: int, *, verify: bool, payload_out: list[bytes] | None = None,
                     copy: BackupCopy = "newest") -> HeldShard | None:
        """The backup held for ``rank`` (``copy``: the newest, the one before it, or the pinned copy of the
        committed step; None: none); ``_BadBackup`` when it does not check out."""
        path = self._backup_file(rank, copy)
        try:
            meta = self._backup_meta(rank, copy)
        except (ValueError, OSError) as exc:
            raise _BadBackup(-1, f"unreadable sidecar {self._sidecar(rank, copy)}: {exc}") from None
        if meta is None:
            return None
        try:
            shard = HeldShard(rank, int(meta["step"]), int(meta["bytes"]), str(meta["sha256"]), "backup",
                              str(meta["owner_node_id"]), int(meta["generation"]), path)
        except (KeyError, TypeError, ValueError) as exc:
            raise _BadBackup(-1, f"sidecar {self._sidecar(rank, copy)} lacks a field: {exc}") from None
        try:
            if verify or payload_out is not None:
                data = path.read_bytes()
                if len(data) != shard.bytes:
                    raise _BadBackup(shard.step, f"{path}: {len(data)} bytes, sidecar says {shard.bytes}")
                if sha256_hex(data) != shard.sha256:
                    raise _BadBackup(shard.step, f"{path}: SHA-256 does not match its sidecar")
                if payload_out is not None:
                    payload_out.append(data)
            elif path.stat().st_size != shard.bytes:
                raise _BadBackup(shard.step, f"{path}: size does not match its sidecar ({shard.bytes} bytes)")
        except FileNotFoundError:
            raise _BadBackup(shard.step, f"{path}: missing (sidecar says step {shard.step})") from None
        return shard

    def _find(self, rank: int, step: int, owner_node_id: str, kind: str) -> tuple[HeldShard, bytes]:
        """The shard to serve for a GetShard, verified, with its payload. Own slots win over a backup of
        the same step; ``step=-1``: the newest. Raises ``_Abort(NOT_FOUND)`` listing why each failed."""
        candidates: list[tuple[int, int, Path, str]] = []  # (step, preference, path, kind)
        if kind in ("", "slot") and owner_node_id in ("", self.node_id):
            # The ring and the sent copies (a step the ring moved past, kept because its backup is what a lost
            # peer's ranks restore: every rank of a shrunk job may need it from here).
            for path in [*list_slots(self.node_dir).get(rank, []), *list_slots(self.node_dir / SENT_DIR).get(rank, [])]:
                try:
                    header = read_header(path)
                except SlotError:
                    continue
                if header.complete and (step < 0 or header.step == step):
                    candidates.append((header.step, 1, path, "slot"))
        reasons: list[str] = []
        if kind in ("", "backup"):
            for preference, copy in enumerate(BACKUP_COPIES):
                try:
                    meta = self._backup_meta(rank, copy)
                except (ValueError, OSError) as exc:
                    meta = None
                    reasons.append(f"{'' if copy == 'newest' else copy + ' '}backup sidecar unreadable: {exc}")
                if meta is not None and (step < 0 or meta.get("step") == step) \
                        and owner_node_id in ("", meta.get("owner_node_id")):
                    candidates.append((int(meta.get("step", -1)), -1 - preference, self._backup_file(rank, copy),
                                       "backup" if copy == "newest" else f"backup-{copy}"))
        for found_step, _, path, found_kind in sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True):
            if found_kind == "slot":
                try:
                    header, payload = read_payload(path, verify=True)
                except SlotError as exc:  # overwritten by a newer step while we read, or corrupt
                    reasons.append(str(exc))
                    continue
                if header.step != found_step:
                    reasons.append(f"{path}: overwritten by step {header.step} while reading")
                    continue
                return HeldShard(rank, header.step, header.payload_len, header.digest, "slot", self.node_id,
                                 header.generation, path), payload
            out: list[bytes] = []
            try:
                shard = self._held_backup(rank, verify=True, payload_out=out,
                                          copy="newest" if found_kind == "backup" else found_kind.split("-")[1])  # type: ignore[arg-type]
            except _Abort as exc:
                reasons.append(exc.reason)
                continue
            if shard is not None and (step < 0 or shard.step == step):
                return shard, out[0]
        wanted = "newest" if step < 0 else f"step {step}"
        detail = f": {'; '.join(reasons)}" if reasons else ""
        raise _Abort(grpc.StatusCode.NOT_FOUND, f"node {self.node_id} holds no {kind or 'slot or backup'} "
                                                f"shard of rank {rank} at {wanted}{detail}")

    # PutShard pieces

    def _check_job(self, job_id: str) -> None:
        if job_id != self.job_id:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"node {self.node_id} serves job {self.job_id!r}, not {job_id!r}")

    def _check_header(self, header: pb.ShardHeader, peer: str) -> None:
        self._check_job(header.job_id)
        if header.rank < 0 or header.step < 0:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid rank {header.rank} / step {header.step}")
        self._check(authorize_put(peer, header.rank, header.owner_node_id, store_node=self.node_id,
                                  world_size=self.world_size, senders=self.senders, generation=header.generation,
                                  min_generation=self.min_generation))
        if not _SHA256_HEX.match(header.sha256):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"sha256 must be 64 lower-case hex digits, got {header.sha256!r}")
        if header.total_bytes > self.max_shard_bytes:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"shard of {header.total_bytes} bytes exceeds this store's limit of {self.max_shard_bytes}")
        self._check_not_stale(header)

    def _check_not_stale(self, header: pb.ShardHeader) -> None:
        """A backup older than the one held is refused. Ordered by (generation, step): after a restore
        to an older step, the new generation's shards supersede the failed generation's newer steps."""
        try:
            meta = self._backup_meta(header.rank)
        except (ValueError, OSError):
            meta = None  # an unreadable sidecar holds nothing worth protecting
        if meta is None:
            return
        held = (int(meta.get("generation", -1)), int(meta.get("step", -1)))
        if (header.generation, header.step) < held:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"stale: holds rank {header.rank} step {held[1]} (generation {held[0]}), "
                         f"offered step {header.step} (generation {header.generation})")

    async def _commit(self, receiver: _Receiver, header: pb.ShardHeader) -> None:
        """Rename the verified temp file into place. The sidecar goes first and comes back last, so a
        crash in between leaves an unlabeled file (never served), not a label on the wrong bytes."""
        sidecar = self._sidecar(header.rank)
        await asyncio.to_thread(self._keep_previous, header.rank, header.generation)
        await asyncio.to_thread(sidecar.unlink, missing_ok=True)
        await receiver.finish(backup_path(self.node_dir, header.rank), self.fsync)
        meta = {"job_id": header.job_id, "owner_node_id": header.owner_node_id, "rank": header.rank,
                "step": header.step, "generation": header.generation, "bytes": header.total_bytes,
                "sha256": header.sha256, "stored_at_unix_s": time.time()}
        await asyncio.to_thread(_write_private_atomic, sidecar, json.dumps(meta).encode(), fsync=self.fsync)

    def _keep_previous(self, rank: int, generation: int) -> None:
        """Before a new backup of ``generation`` replaces the one held for ``rank``: keep the held one as
        the previous (replacing the one there) if it is of the same generation, the same history. One of
        an older generation is an abandoned history (its steps may carry the same numbers with other
        contents): no previous is kept then. The previous that goes is kept as the pinned copy when it
        holds the committed step (``pin``). A sidecar goes first and the moved one comes last, so no label
        ever names the wrong bytes."""
        with self._copies_lock:
            self._keep_previous_locked(rank, generation)

    def _keep_previous_locked(self, rank: int, generation: int) -> None:
        current_sidecar, current_file = self._sidecar(rank), self._backup_file(rank)
        self._pin_or_drop_previous(rank, generation)
        try:
            meta = self._backup_meta(rank)
        except (ValueError, OSError):
            return
        if meta is None or int(meta.get("generation", -1)) != generation or not current_file.exists():
            return
        self.previous_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.replace(current_file, self._backup_file(rank, "previous"))
        os.replace(current_sidecar, self._sidecar(rank, "previous"))

    def _pin_or_drop_previous(self, rank: int, generation: int) -> None:
        """The previous copy is about to be replaced: keep it as the pinned copy if it is the committed step
        of this history (replacing any pinned copy of the rank), else drop it. A pinned copy of another
        generation is an abandoned history: dropped too."""
        def meta(copy: BackupCopy) -> dict[str, Any] | None:
            try:
                return self._backup_meta(rank, copy)
            except (ValueError, OSError):
                return None  # unreadable: nothing worth keeping

        previous, pinned = meta("previous"), meta("pinned")
        if pinned is not None and int(pinned.get("generation", -1)) != generation:
            self._sidecar(rank, "pinned").unlink(missing_ok=True)
            self._backup_file(rank, "pinned").unlink(missing_ok=True)
        keep = (previous is not None and self.pinned_step >= 0 and int(previous.get("step", -1)) == self.pinned_step
                and int(previous.get("generation", -1)) == generation and self._backup_file(rank, "previous").exists())
        if keep:
            self._sidecar(rank, "pinned").unlink(missing_ok=True)
            self.pinned_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            sidecar = self._sidecar(rank, "previous").read_bytes()
            self._sidecar(rank, "previous").unlink()
            os.replace(self._backup_file(rank, "previous"), self._backup_file(rank, "pinned"))
            _write_private_atomic(self._sidecar(rank, "pinned"), sidecar, fsync=self.fsync)
            return
        self._sidecar(rank, "previous").unlink(missing_ok=True)
        self._backup_file(rank, "previous").unlink(missing_ok=True)

    def rank_lock(self, rank: int) -> asyncio.Lock:
        return self._rank_locks.setdefault(rank, asyncio.Lock())

    async def put_shard(self, chunks: AsyncIterator[pb.ShardChunk], peer: str) -> pb.PutShardReply:
        """The PutShard logic for a stream from node ``peer`` (its certificate's); raises ``_Abort`` for a
        refusal. Temp files never outlive the call."""
        started = time.perf_counter()
        receiver: _Receiver | None = None
        header: pb.ShardHeader | None = None
        admitted = 0
        try:
            async for chunk in chunks:
                if header is None:
                    if not chunk.HasField("header"):
                        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the first chunk must carry the header")
                    header = chunk.header
                    self._check_header(header, peer)
                    await self._admit(peer, max(1, header.total_bytes))
                    admitted = max(1, header.total_bytes)
                    receiver = _Receiver(self.backup_dir / f".rank{header.rank}.shard.tmp-{uuid.uuid4().hex}")
                    await receiver.open()
                assert receiver is not None
                data = chunk.data  # each attribute read of a bytes field copies it: read once
                if chunk.offset != receiver.received:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"chunk at offset {chunk.offset}, expected {receiver.received} (out of order or lost)")
                if len(data) > CHUNK_BYTES:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"chunk of {len(data)} bytes exceeds {CHUNK_BYTES}")
                if receiver.received + len(data) > header.total_bytes:
                    raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"stream longer than the declared {header.total_bytes} bytes")
                await receiver.absorb(chunk.offset, data, chunk.crc32)
            if header is None or receiver is None:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty stream")
            digest = await receiver.drain()
            if receiver.received != header.total_bytes:
                raise _Abort(grpc.StatusCode.DATA_LOSS,
                             f"truncated: {receiver.received} of {header.total_bytes} bytes; backup not replaced")
            if digest != header.sha256:
                raise _Abort(grpc.StatusCode.DATA_LOSS, f"SHA-256 mismatch (header {header.sha256[:12]}, "
                                                        f"received {digest[:12]}); backup not replaced")
            async with self.rank_lock(header.rank):
                self._check_not_stale(header)  # another stream may have committed a newer step meanwhile
                await self._commit(receiver, header)
            self.backups_received += 1
            if self.on_backup_received is not None:
                self.on_backup_received()
            return pb.PutShardReply(rank=header.rank, step=header.step, bytes=header.total_bytes,
                                    sha256=header.sha256, received_s=time.perf_counter() - started)
        except _CrcMismatch as exc:
            raise _Abort(grpc.StatusCode.DATA_LOSS, f"{exc}; backup not replaced") from None
        except OSError as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) \
                else grpc.StatusCode.INTERNAL
            raise _Abort(code, f"node {self.node_id} cannot store the shard: {exc}") from exc
        finally:
            if admitted:
                self._release(peer, admitted)
            if receiver is not None:
                # Runs on success too (the temp file is gone by then), on refusal and on cancellation.
                receiver.discard()


@functools.lru_cache(maxsize=256)
def _identity(pem: bytes, job_id: str) -> str:
    """``node_identity``, parsed once per certificate (every call of a peer presents the same one)."""
    return node_identity(pem, job_id)


class _BadBackup(_Abort):
    def __init__(self, step: int, reason: str) -> None:
        super().__init__(grpc.StatusCode.DATA_LOSS, reason)
        self.step = step


class _Servicer(pb_grpc.ShardStoreServicer):
    def __init__(self, store: ShardStoreServer) -> None:
        self.store = store

    async def PutShard(self, request_iterator: AsyncIterator[pb.ShardChunk],  # noqa: N802 (gRPC names)
                       context: aio.ServicerContext) -> pb.PutShardReply:
        try:
            return await self.store.put_shard(request_iterator, self.store.peer_node(context))
        except _Abort as exc:
            log.info("PutShard refused: %s", exc.reason)
            await context.abort(exc.code, exc.reason)
            raise  # unreachable: abort raises

    async def GetShard(self, request: pb.GetShardRequest,  # noqa: N802
                       context: aio.ServicerContext) -> AsyncIterator[pb.ShardChunk]:
        store = self.store
        peer = ""
        try:
            peer = store.peer_node(context)
            store._check_job(request.job_id)
            store._check(authorize_read(peer, request.rank, world_size=store.world_size))
            if request.kind not in ("", "slot", "backup"):
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"kind must be '', 'slot' or 'backup', got {request.kind!r}")
            await store._admit(peer, 0)
        except _Abort as exc:
            log.info("GetShard from %s refused: %s", peer or context.peer(), exc.reason)
            await context.abort(exc.code, exc.reason)
            return
        try:
            try:
                shard, payload = await asyncio.to_thread(store._find, request.rank, request.step,
                                                         request.owner_node_id, request.kind)
            except _Abort as exc:
                await context.abort(exc.code, exc.reason)
                return
            header = pb.ShardHeader(job_id=store.job_id, owner_node_id=shard.owner_node_id, rank=shard.rank,
                                    step=shard.step, total_bytes=shard.bytes, sha256=shard.sha256,
                                    generation=shard.generation, kind=shard.kind)
            spans = _chunks(len(payload), CHUNK_BYTES)
            crcs = await asyncio.to_thread(_chunk_crcs, payload, spans)
            view = memoryview(payload)
            for (offset, end), crc in zip(spans, crcs, strict=True):
                yield pb.ShardChunk(header=header if offset == 0 else None, offset=offset,
                                    data=bytes(view[offset:end]), crc32=crc)
        finally:
            store._release(peer, 0)

    async def ListShards(self, request: pb.ListShardsRequest,  # noqa: N802
                         context: aio.ServicerContext) -> pb.ListShardsReply:
        try:
            peer = self.store.peer_node(context)
            self.store._check_job(request.job_id)
            self.store._check(authorize_read(peer, None, world_size=self.store.world_size))
        except _Abort as exc:
            log.info("ListShards refused: %s", exc.reason)
            await context.abort(exc.code, exc.reason)
            raise  # unreachable: abort raises
        held, rejected = await asyncio.to_thread(self.store.held_shards, verify=request.verify)
        return pb.ListShardsReply(node_id=self.store.node_id, shards=[s.to_proto() for s in held],
                                  rejected=[r.to_proto() for r in rejected])


# -- the sending side -----------------------------------------------------------------------------


def read_committed_slot(node_dir: Path, rank: int, step: int) -> tuple[SlotHeader, bytes]:
    """The payload of ``rank``'s COMPLETE slot of ``step``, or, when the ring has already overwritten
    it, of the newest COMPLETE slot after it. ``SlotError`` when there is neither.

    Not hashed here (the receiver verifies the SHA-256 end to end, which costs as much as the copy);
    ``read_payload_consistent`` proves the payload was not torn by the rank rewriting the slot."""
    newer: list[tuple[int, Path]] = []
    for path in list_slots(node_dir).get(rank, []):
        try:
            header = read_header(path)
        except SlotError:
            continue
        if header.complete and header.step == step:
            try:
                found, payload = read_payload_consistent(path)
            except SlotError:
                continue  # overwritten while reading: a newer one may serve
            if found.step == step:
                return found, payload
        elif header.complete and header.step > step:
            newer.append((header.step, path))
    errors = []
    for _, path in sorted(newer, reverse=True):
        try:
            return read_payload_consistent(path)
        except SlotError as exc:
            errors.append(str(exc))
    raise SlotError(f"{node_dir}: no COMPLETE verified slot of rank {rank} at step {step} or later"
                    + (f" ({'; '.join(errors)})" if errors else ""))


@dataclass
class _Peer:
    address: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    channel: aio.Channel | None = None
    pending: dict[int, int] = field(default_factory=dict)  # rank -> newest requested step
    sent: dict[int, int] = field(default_factory=dict)  # rank -> newest step the peer accepted
    worker: asyncio.Task[None] | None = None


class ShardSender:
    """Sends this node's ranks' committed slots to their backup peers over ``PutShard``.

    ``submit(address, rank, step)``: background, latest wins: at most one transfer per peer in flight;
    a step submitted while one runs replaces any pending older step of that rank (steps are skipped,
    never queued); each finished transfer is reported to ``on_outcome``. ``send(...)``: one transfer,
    awaited, raising ``PeerUnavailable`` / ``TransferRejected`` / ``LocalShardError``.

    ``tls``: this node's certificate of the job's CA (the peers accept backups over mTLS only, and only
    from the node assigned to send them). ``timeout`` bounds a whole transfer (connect, stream, reply).
    ``max_bytes_per_s`` caps the sending rate (so backups do not starve the training collectives on a
    shared NIC).
    """

    def __init__(self, job_id: str, node_id: str, node_dir: Path, *, tls: TlsMaterial,
                 timeout: timedelta = timedelta(seconds=60),
                 max_bytes_per_s: int | None = None, chunk_bytes: int = CHUNK_BYTES,
                 on_outcome: Callable[[TransferOutcome], None] | None = None) -> None:
        if not 0 < chunk_bytes <= CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{CHUNK_BYTES}, got {chunk_bytes}")
        self.job_id = job_id
        self.node_id = node_id
        self.node_dir = Path(node_dir)
        self.tls = tls
        self.timeout = timeout
        self.max_bytes_per_s = max_bytes_per_s
        self.chunk_bytes = chunk_bytes
        self.on_outcome = on_outcome
        self.skipped_steps = 0  # submitted steps superseded before they were sent
        self._peers: dict[str, _Peer] = {}
        self._closed = False

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = _Peer(address)
        return peer

    def submit(self, address: str, rank: int, step: int) -> None:
        """Send ``rank``'s slot of ``step`` to ``address`` when that peer is free; newest wins."""
        if self._closed:
            raise RuntimeError("shard sender is closed")
        peer = self._peer(address)
        if step <= peer.sent.get(rank, -1):
            return  # the peer already holds this step or a newer one
        pending = peer.pending.get(rank)
        if pending is not None:
            if step <= pending:
                return
            self.skipped_steps += 1
        peer.pending[rank] = step
        if peer.worker is None or peer.worker.done():
            peer.worker = asyncio.get_running_loop().create_task(self._drain(peer), name=f"shard-sender {address}")

    async def _drain(self, peer: _Peer) -> None:
        while peer.pending:
            rank = next(iter(peer.pending))
            step = peer.pending.pop(rank)
            outcome: TransferOutcome
            try:
                result = await self.send(peer.address, rank, step)
                outcome = TransferOutcome(peer.address, rank, step, result=result)
            except ShardTransferError as exc:
                log.warning("backup of rank %d step %d to %s failed: %s", rank, step, peer.address, exc)
                outcome = TransferOutcome(peer.address, rank, step, error=exc)
            if self.on_outcome is not None:
                try:
                    self.on_outcome(outcome)
                except Exception:  # a metrics callback must not stop the backups
                    log.exception("shard sender outcome callback failed")

    def forget_peer(self, address: str) -> None:
        """Drop what is known about ``address`` (a re-assigned or replaced backup node): the next
        submit sends even a step it had accepted before."""
        peer = self._peers.get(address)
        if peer is not None:
            peer.sent.clear()

    async def wait_idle(self) -> None:
        """Return once no transfer is pending or running (newly submitted ones included)."""
        while True:
            workers = [p.worker for p in self._peers.values() if p.worker is not None and not p.worker.done()]
            if not workers:
                return
            await asyncio.gather(*workers, return_exceptions=True)

    async def send(self, address: str, rank: int, step: int) -> TransferResult:
        """Send ``rank``'s committed slot of ``step`` (or of the newest step after it, when the ring
        has already overwritten it) to the peer at ``address``; waits for that peer's running transfer."""
        peer = self._peer(address)
        async with peer.lock:
            def load() -> tuple[SlotHeader, bytes, list[int]]:
                header, payload = read_committed_slot(self.node_dir, rank, step)
                return header, payload, _chunk_crcs(payload, _chunks(len(payload), self.chunk_bytes))

            try:
                header, payload, crcs = await asyncio.to_thread(load)
            except SlotError as exc:
                raise LocalShardError(address, str(exc)) from None
            result = await self._put(peer, rank, header, payload, crcs)
            peer.sent[rank] = max(peer.sent.get(rank, -1), result.step)
            return result

    async def _put(self, peer: _Peer, rank: int, slot: SlotHeader, payload: bytes, crcs: list[int]) -> TransferResult:
        header = pb.ShardHeader(job_id=self.job_id, owner_node_id=self.node_id, rank=rank, step=slot.step,
                                total_bytes=len(payload), sha256=slot.digest, generation=slot.generation)
        spans = _chunks(len(payload), self.chunk_bytes)
        rate = self.max_bytes_per_s

        async def stream() -> AsyncIterator[pb.ShardChunk]:
            view = memoryview(payload)
            began = time.monotonic()
            for (offset, end), crc in zip(spans, crcs, strict=True):
                yield pb.ShardChunk(header=header if offset == 0 else None, offset=offset,
                                    data=bytes(view[offset:end]), crc32=crc)
                if rate:
                    delay = began + end / rate - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)

        if peer.channel is None:
            peer.channel = self.tls.channel(peer.address)
        stub = pb_grpc.ShardStoreStub(peer.channel)
        started = time.perf_counter()
        try:
            reply = await stub.PutShard(stream(), timeout=self.timeout.total_seconds())
        except grpc.aio.AioRpcError as exc:
            error = _map_rpc_error(peer.address, exc, self.timeout)
            if isinstance(error, PeerUnavailable):
                # A fresh channel next time: a restarted peer is reached at once, not after the old
                # channel's reconnect backoff.
                channel, peer.channel = peer.channel, None
                await channel.close()
            raise error from None
        seconds = time.perf_counter() - started
        if reply.step != slot.step or reply.sha256 != slot.digest:
            raise ShardIntegrityError(peer.address, f"peer acknowledged step {reply.step} / {reply.sha256[:12]}, "
                                                    f"sent step {slot.step} / {slot.digest[:12]}")
        return TransferResult(peer.address, rank, slot.step, len(payload), seconds, slot.digest)

    async def close(self) -> None:
        """Cancel pending and running transfers and close the channels."""
        self._closed = True
        for peer in self._peers.values():
            peer.pending.clear()
            if peer.worker is not None and not peer.worker.done():
                peer.worker.cancel()
        for peer in self._peers.values():
            if peer.worker is not None:
                await asyncio.gather(peer.worker, return_exceptions=True)
            if peer.channel is not None:
                await peer.channel.close()
                peer.channel = None


# -- fetching -------------------------------------------------------------------------------------


async def fetch_shard(address: str, job_id: str, owner_node_id: str, rank: int, step: int, dest_path: Path,
                      expected_sha256: str, timeout: timedelta, *, tls: TlsMaterial, kind: str = "") -> TransferResult:
    """Fetch ``rank``'s shard of ``step`` (``-1``: the newest the peer holds) from the shard store at
    ``address`` (over mTLS with ``tls``) into ``dest_path`` (0600): temp file beside it, every chunk's
    CRC32 and offset checked, the total length and SHA-256 checked (against the header and
    ``expected_sha256`` unless that is ""), then an atomic rename. ``owner_node_id`` "" accepts any
    owner; ``kind`` "slot"/"backup"/"".

    Raises ``PeerUnavailable`` (dead, unreachable, or past ``timeout``), ``TransferRejected`` (the peer
    refused or does not hold it) or ``ShardIntegrityError`` (CRC32, offsets, truncation, SHA-256,
    or a shard other than the one asked for); ``dest_path`` is then untouched.
    """
    dest_path = Path(dest_path)
    receiver = _Receiver(dest_path.with_name(f".{dest_path.name}.tmp-{uuid.uuid4().hex}"))
    started = time.perf_counter()
    channel = tls.channel(address)
    header: pb.ShardHeader | None = None
    try:
        call = pb_grpc.ShardStoreStub(channel).GetShard(
            pb.GetShardRequest(job_id=job_id, rank=rank, step=step, owner_node_id=owner_node_id, kind=kind),
            timeout=timeout.total_seconds())
        async for chunk in call:
            if header is None:
                if not chunk.HasField("header"):
                    raise ShardIntegrityError(address, "the first chunk has no header")
                header = chunk.header
                wrong = [f"{name} {got!r} (asked {want!r})" for name, got, want in (
                    ("job", header.job_id, job_id), ("rank", header.rank, rank),
                    ("step", header.step, step if step >= 0 else header.step),
                    ("owner", header.owner_node_id, owner_node_id or header.owner_node_id),
                    ("sha256", header.sha256, expected_sha256 or header.sha256)) if got != want]
                if wrong:
                    raise ShardIntegrityError(address, f"peer sent another shard: {', '.join(wrong)}")
                await receiver.open()
            data = chunk.data  # each attribute read of a bytes field copies it: read once
            if chunk.offset != receiver.received:
                raise ShardIntegrityError(address, f"chunk at offset {chunk.offset}, expected {receiver.received}")
            if receiver.received + len(data) > header.total_bytes:
                raise ShardIntegrityError(address, f"more than the declared {header.total_bytes} bytes")
            await receiver.absorb(chunk.offset, data, chunk.crc32)
        if header is None:
            raise ShardIntegrityError(address, "empty reply stream")
        digest = await receiver.drain()
        if receiver.received != header.total_bytes:
            raise ShardIntegrityError(address, f"truncated: {receiver.received} of {header.total_bytes} bytes")
        if digest != header.sha256:
            raise ShardIntegrityError(address, f"SHA-256 mismatch (expected {header.sha256[:12]}, got {digest[:12]})")
        await receiver.finish(dest_path, True)
    except _CrcMismatch as exc:
        raise ShardIntegrityError(address, str(exc)) from None
    except grpc.aio.AioRpcError as exc:
        raise _map_rpc_error(address, exc, timeout) from None
    finally:
        receiver.discard()
        await channel.close()
    return TransferResult(address, rank, header.step, header.total_bytes, time.perf_counter() - started, header.sha256)

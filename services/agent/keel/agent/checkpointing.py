"""The node agent's checkpoint duties (the node store): everything between a rank's shared-memory slots
and the rest of the cluster.

- Owns the node's slot folder (``$KEEL_CKPT_DIR`` of its ranks): created before the ranks start, kept
  when they crash (an in-place restart loads from it), removed when the job finishes.
- Registers the node's ranks (their parallel groups, this node's shard-store address) with the broker.
- Reports what the node holds per tier (``CheckpointShardsStored``): its ranks' slots ("memory"), the
  backups it holds for peers ("peer"), the shards it persisted ("disk").
- Sends each rank's newest committed snapshot to the rank's backup peer (latest wins: steps are
  skipped, never queued), and persists every K-th step (K from the broker's ``CheckpointScheduleSet``).
- Before a restart: takes a verified inventory (``CheckpointInventoryReported``); after the broker's
  ``CheckpointRestorePlanned`` and this node's parts of it (``CheckpointNodeRestorePlanned``, on the
  node's subject): stages each local rank's shard (fetching from a peer when needed) and writes the plan
  file the ranks' ``Checkpointer.restore()`` waits for. Backup assignments come as this node's parts too
  (``CheckpointNodeBackupsAssigned``), and so does who may send backups to this node's store
  (``CheckpointNodeBackupsHeld``: the store refuses a rank's backups from any other node).

Slow work (hashing, gRPC transfers, disk writes) runs on a small thread pool; its results are folded
into events on the agent's loop (``tick``), so ``emit`` is only ever called from the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from keel.agent.isolation import Pieces
from keel.checkpoint import slots as ckpt_slots
from keel.checkpoint.owned import ensure_owned_dir
from keel.events.envelope import Event
from keel.events.types import (
    BackupAssignment,
    CheckpointBackupAssigned,
    CheckpointBackupFailed,
    CheckpointInventoryReported,
    CheckpointNodeBackupsAssigned,
    CheckpointNodeBackupsHeld,
    CheckpointNodeRestorePlanned,
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CheckpointScheduleSet,
    CheckpointShardsStored,
    CheckpointStepCommitted,
    CheckpointTier,
    CheckpointTierFallback,
    InventoryEntry,
    RankGroups,
    RejectedShard,
    ShardRecord,
)

if TYPE_CHECKING:  # imported where used: an unsupervised or store-less agent never loads gRPC
    from keel.agent.shard_access import StoreLimits
    from keel.agent.shard_store import TlsMaterial

log = logging.getLogger(__name__)

# A backup peer that failed this many sends in a row is reported (the broker re-places the backup);
# sends to it are then retried only every _SEND_RETRY_INTERVAL_S, in case it comes back on the same address.
_SEND_FAILURES_REPORTED = 3
_SEND_RETRY_INTERVAL_S = 10.0

ROUND_PEER_GRACE_S = 2.0
"""How long a completed report round waits for the backups this node holds for peers to reach it."""


def report_round_steps(backup_every: int, step_time_s: float | None, period: timedelta) -> int | None:
    """Steps between two report rounds: the smallest power of two, at least the backup interval (a power
    of two itself), whose steps take at least ``period`` (so report rounds come every ``period`` to
    twice that). None while the step time is unknown (no round: the heartbeat's own interval reports)."""
    if step_time_s is None or step_time_s <= 0:
        return None
    every = max(1, backup_every)
    wanted = period.total_seconds() / step_time_s
    while every < wanted and every < 1 << 40:
        every *= 2
    return every


# Broker events every agent of the job consumes (besides its own commands). CheckpointBackupAssigned:
# the job-wide placement of a broker from before per-node parts (still in older logs and streams).
BROKER_EVENT_TYPES = ("CheckpointBackupAssigned", "CheckpointScheduleSet", "CheckpointRestorePlanned",
                      "CheckpointStepCommitted")
# Broker events addressed to one node (its parts of a placement and of a restore plan): an agent takes
# only its own node's, so none reads the whole placement or plan of a large job.
BROKER_NODE_EVENT_TYPES = ("CheckpointNodeBackupsAssigned", "CheckpointNodeRestorePlanned", "CheckpointNodeBackupsHeld")


class PeerTransport(Protocol):
    """How shards travel between node stores (``GrpcTransport``: the gRPC ``ShardStore``). Blocking calls,
    made from the checkpointing thread pool."""

    address: str
    """Where this node's own shard store listens (peers send it backups)."""

    def send(self, address: str, *, rank: int, step: int) -> None:
        """Send this node's verified slot of ``rank`` at ``step`` to the store at ``address``. Raises
        ``concurrent.futures.CancelledError`` when ``cancel_send`` ends it."""
        ...

    def cancel_send(self, address: str, rank: int) -> bool:
        """End a ``send`` of ``rank`` to ``address`` in flight (from any thread): its caller gets
        ``CancelledError`` at once instead of waiting out the transfer timeout. False when none runs."""
        ...

    def fetch(self, address: str, *, owner_node_id: str, rank: int, step: int, dest: Path, sha256: str) -> None:
        """Fetch a shard held at ``address`` into ``dest`` (atomically), verified against ``sha256``."""
        ...

    def held_backups(self, *, verify: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Backups this node holds for peers, ``{"owner_node_id", "rank", "step", "bytes", "sha256",
        "path"}`` each, and (with ``verify``) the ones that failed verification, ``{"rank", "step", "reason"}``."""
        ...

    def discard_backup(self, rank: int, newer_than: int = -1) -> None:
        """Drop the backups held for ``rank`` with a step above ``newer_than`` (-1: all; sidecars first, so
        none is ever served half-removed)."""
        ...

    def pin_committed(self, step: int) -> None:
        """The broker committed ``step`` on the peer tier: the store keeps each rank's backup of it even when
        two newer rounds arrive before the next commit (-1: nothing pinned, a restart's new history)."""
        ...

    def refuse_generations_below(self, generation: int) -> None:
        """This node runs ``generation``: its store refuses backups of older ones (a fenced host's)."""
        ...

    def backups_received(self) -> int:
        """How many backups this node's store has committed since it started (moves on every new one)."""
        ...

    def on_backup_received(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread) after each backup this node's store commits."""
        ...

    def assign_senders(self, changes: dict[int, str | None]) -> None:
        """The broker's placement, as this node's store sees it: rank -> the node that backs it up here
        (None: its backups go elsewhere now). The store accepts a rank's backups only from that node."""
        ...

    def close(self) -> None: ...


def ensure_slot_dir(node_dir: Path) -> Path:
    """The node's slot folder, created 0700 or checked to be this user's own (``ensure_owned_dir``): its
    default, ``/dev/shm/keel-<hash>``, is a predictable name in a world-writable place. Raises
    ``UntrustedPathError`` before anything is written in a folder someone else made."""
    return ensure_owned_dir(Path(node_dir), "or choose another slot folder (--keel-ckpt-dir)")


class GrpcTransport:
    """``PeerTransport`` over the gRPC ``ShardStore``: runs this node's store server and its client calls
    on one private event loop thread (grpc.aio objects belong to the loop that made them).

    ``tls``: this node's certificate of the job's CA (``keel.agent.shard_store.TlsMaterial``): the store
    serves and dials over mutual TLS only. ``world_size``: the job's ranks. ``limits``: the store's quotas."""

    def __init__(self, job_id: str, node_id: str, node_dir: Path, *, bind: str, tls: TlsMaterial, world_size: int,
                 advertise: str = "", limits: StoreLimits | None = None,
                 timeout: timedelta = timedelta(seconds=60)) -> None:
        import asyncio
        import threading

        from keel.agent import shard_store

        ensure_slot_dir(node_dir)  # before the store makes its folders in it
        self._shard_store = shard_store
        self.job_id, self.node_id, self.node_dir, self.timeout = job_id, node_id, Path(node_dir), timeout
        self.tls = tls
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"keel-store-{node_id}", daemon=True)
        self._thread.start()
        host, _, port = bind.rpartition(":")
        self.server = shard_store.ShardStoreServer(job_id, node_id, self.node_dir, tls=tls, world_size=world_size,
                                                   limits=limits)
        bound = self._call(self.server.start(host.strip("[]"), int(port)))
        bound_host, _, bound_port = bound.rpartition(":")
        if advertise:
            bound_host = advertise
        elif bound_host in ("0.0.0.0", "[::]"):
            import socket

            bound_host = socket.gethostname()
        self.address = f"{bound_host}:{bound_port}"
        self._sender = self._call(self._make_sender())
        self._in_flight: dict[tuple[str, int], Future[None]] = {}  # (address, rank) -> the send on the loop
        self._in_flight_lock = threading.Lock()

    async def _make_sender(self):
        # Backups are sent from the sent ring (``keep_sent_copy``), never straight from the rank's slots.
        return self._shard_store.ShardSender(self.job_id, self.node_id, self.node_dir / SENT_DIR, tls=self.tls,
                                             timeout=self.timeout)

    def _call(self, coroutine):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def send(self, address: str, *, rank: int, step: int) -> None:
        future = asyncio.run_coroutine_threadsafe(self._sender.send(address, rank, step), self._loop)
        key = (address, rank)
        with self._in_flight_lock:
            self._in_flight[key] = future
        try:
            future.result()
        finally:
            with self._in_flight_lock:
                if self._in_flight.get(key) is future:
                    del self._in_flight[key]

    def cancel_send(self, address: str, rank: int) -> bool:
        # A peer cut off the network never resets the connection: the call would wait out ``timeout``
        # (60 s) while holding the rank's backups (one send per rank at a time) and a pool thread.
        with self._in_flight_lock:
            future = self._in_flight.get((address, rank))
        return future is not None and future.cancel()

    def fetch(self, address: str, *, owner_node_id: str, rank: int, step: int, dest: Path, sha256: str) -> None:
        self._call(self._shard_store.fetch_shard(address, self.job_id, owner_node_id, rank, step, dest, sha256,
                                                 self.timeout, tls=self.tls))

    def held_backups(self, *, verify: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        held, rejected = self.server.held_shards(verify=verify)
        return ([{"owner_node_id": h.owner_node_id, "rank": h.rank, "step": h.step, "bytes": h.bytes,
                  "sha256": h.sha256, "path": str(h.path), "generation": h.generation}
                 for h in held if h.kind == "backup"],
                [{"rank": r.rank, "step": r.step, "reason": r.reason} for r in rejected if r.kind == "backup"])

    def discard_backup(self, rank: int, newer_than: int = -1) -> None:
        self.server.discard_backup(rank, newer_than)

    def pin_committed(self, step: int) -> None:
        self.server.pin(step)

    def refuse_generations_below(self, generation: int) -> None:
        self.server.refuse_generations_below(generation)

    def backups_received(self) -> int:
        return self.server.backups_received

    def on_backup_received(self, callback: Callable[[], None]) -> None:
        self.server.on_backup_received = callback

    def assign_senders(self, changes: dict[int, str | None]) -> None:
        self.server.assign_senders(changes)

    def close(self) -> None:
        """Stop the server and the sender; idempotent."""
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        try:
            self._call(self._sender.close())
            self._call(self.server.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._loop.close()


@dataclass
class _RankProgress:
    last_sent_step: int = -1
    send_failures: int = 0
    retry_at_s: float = 0.0
    """After ``_SEND_FAILURES_REPORTED`` failures: the next try (monotonic), in case the peer comes back."""
    last_send_s: float = 0.0
    """How long the last successful transfer took (reported to the broker: it sets the backup interval)."""
    last_persisted_step: int = -1
    persist_missed: int = -1
    """A multiple of K that no slot held any more when the loop looked (not looked for again)."""


@dataclass
class _Plan:
    generation: int
    step: int
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    pending: dict[int, Future] = field(default_factory=dict)
    reshard_from: int = 0
    """A shrunk job's plan: ``entries`` are every saved rank's staged shard (0: this node's ranks' own)."""
    held: dict[int, Path] = field(default_factory=dict)
    """Ranks restored from a backup this node holds, and where the plan points for each: the backup is linked
    there once the abandoned history is dropped (``_stage_held``), because dropping a newer backup moves the
    older one it restores from into the newest copy's place."""


def plan_file(agent_dir: Path, generation: int) -> Path:
    """Where the ranks of ``generation`` find their restore plan (``$KEEL_RESTORE_PLAN``)."""
    return Path(agent_dir) / "restore" / f"g{generation}.json"


SENT_DIR = ckpt_slots.SENT_DIR
"""Under the node folder: local copies of the last two snapshots each rank backed up to its peer (slot
format). When a node is lost, the survivors' rings have moved past the last backed-up step; these copies
let every surviving rank resume at the step the lost ranks' backups hold, from local memory."""


def local_slot_files(node_dir: Path, rank: int) -> list[Path]:
    """The rank's ring slots and its sent copies."""
    return [*ckpt_slots.list_slots(node_dir).get(rank, []), *ckpt_slots.list_slots(Path(node_dir) / SENT_DIR).get(rank, [])]


def keep_sent_copy(node_dir: Path, rank: int, step: int, pinned: int = -1) -> Path:
    """Copy the rank's slot of ``step`` into its sent ring (replacing the older of two, but never the copy
    of ``pinned``, the newest step committed on the peer tier: with it every rank can still restore
    that step if a group is lost while the next round is half delivered); ``SlotError`` when the ring
    has already overwritten that step."""
    source = next((p for p, h in complete_slots(node_dir, rank, sent=False) if h.step == step), None)
    if source is None:
        raise ckpt_slots.SlotError(f"rank {rank}: no complete slot holds step {step} any more")
    header, payload = ckpt_slots.read_payload_consistent(source)
    sent_dir = Path(node_dir) / SENT_DIR
    ring = [ckpt_slots.slot_path(sent_dir, rank, i) for i in (0, 1)]

    def held(path: Path) -> ckpt_slots.SlotHeader | None:
        try:
            found = ckpt_slots.read_header(path)
        except ckpt_slots.SlotError:
            return None
        return found if found.complete else None

    for path in ring:
        found = held(path)
        if found is not None and (found.step, found.digest) == (step, header.digest):
            return path  # copied already (a retried send)
    # A copy of the same step from a failed generation goes first (the sender must not find two copies
    # of one step), then an empty or torn slot, then the older copy.
    def rank_of(path: Path) -> float:
        h = held(path)
        if h is None:
            return -1
        if h.step == step:
            return -2
        return float("inf") if h.step == pinned else h.step

    target = min(ring, key=rank_of)
    writer = ckpt_slots.SlotWriter(target, len(payload))
    try:
        writer.begin(step, header.generation)
        writer.payload_view()[: len(payload)] = payload
        writer.complete(step, len(payload), header.digest, header.generation)
    finally:
        writer.close()
    return target


def complete_slots(node_dir: Path, rank: int, *, sent: bool = True) -> list[tuple[Path, ckpt_slots.SlotHeader]]:
    """The rank's COMPLETE slots (header only, not verified), newest step first; ``sent``: with the
    copies of what was backed up."""
    found = []
    for path in (local_slot_files(node_dir, rank) if sent else ckpt_slots.list_slots(node_dir).get(rank, [])):
        try:
            header = ckpt_slots.read_header(path)
        except ckpt_slots.SlotError:
            continue
        if header.complete:
            found.append((path, header))
    return sorted(found, key=lambda item: item[1].step, reverse=True)


def read_slot_of_step(node_dir: Path, rank: int, step: int) -> tuple[Path, bytes, str]:
    """The verified payload of the rank's slot holding ``step``: ``(path, payload, sha256)``.

    Raises ``SlotError`` when no slot holds that step (overwritten since) or it fails verification.
    """
    for path, header in complete_slots(node_dir, rank):
        if header.step == step:
            _, payload = ckpt_slots.read_payload(path, verify=True)
            return path, payload, header.digest
    raise ckpt_slots.SlotError(f"rank {rank}: no complete slot holds step {step} any more")


class NodeCheckpointing:
    """One node's checkpoint duties. ``emit(payload, subject)`` publishes; call ``tick`` on the loop."""

    def __init__(
        self,
        *,
        job_id: str,
        node_id: str,
        local_ranks: list[int],
        world_size: int,
        node_dir: Path,
        agent_dir: Path,
        emit: Callable[..., None],
        transport: PeerTransport | None,
        persist_root: Path | None,
        report_interval: timedelta = timedelta(seconds=1),
        supervised: bool = True,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.job_id = job_id
        self.node_id = node_id
        self.local_ranks = list(local_ranks)
        self.world_size = world_size
        self.node_dir = Path(node_dir)
        self.agent_dir = Path(agent_dir)
        self.emit = emit
        self.transport = transport
        self.persist_root = persist_root
        self.report_interval = report_interval
        self.supervised = supervised
        self.wake = wake
        if transport is not None:
            transport.on_backup_received(lambda: self.wake())  # self.wake is replaced once the loop runs
        ensure_slot_dir(self.node_dir)
        self.pieces = Pieces(f"{node_id} checkpointing", log)
        """Each duty of a tick runs guarded: one that raises is logged (rate-limited), the others go on."""
        self.pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix=f"keel-ckpt-{node_id}")
        self.generation = 0
        self.registered_generation: int | None = None
        self.assignments: dict[int, BackupAssignment] = {}
        self.every_k_steps: int | None = None
        self.backup_every = 1
        self.peer_committed_step = -1
        """The newest step committed on the peer tier (this generation): its sent copies are kept."""
        self.progress: dict[int, _RankProgress] = {r: _RankProgress() for r in self.local_ranks}
        self.sending: dict[int, tuple[int, str, Future[int]]] = {}
        """rank -> (the generation its backup send started in, the peer's address, the send: the step it
        backed up). One per rank: no second writer touches a rank's sent ring."""
        self.persisting: dict[int, tuple[int, Future]] = {}
        self.persisted: dict[int, dict[int, ShardRecord]] = {}  # step -> rank -> record
        self.reported_round = -1
        """The newest report round a heartbeat carried (``report_due``)."""
        self.round_every: int | None = None
        """Steps between report rounds, as ``report_due`` last computed it (None: no step time yet)."""
        self.round_ready_since: float | None = None
        """When the memory part of the pending report round completed (monotonic s; None: not yet)."""
        self.plan: _Plan | None = None
        self.inventory_future: tuple[int, Future] | None = None
        self.early_plans: dict[int, CheckpointRestorePlanned] = {}
        self.plan_summaries: dict[int, CheckpointRestorePlanned] = {}
        """generation -> the broker's job-wide plan, until this node's parts of it are all here."""
        self.plan_parts: dict[int, dict[int, CheckpointNodeRestorePlanned]] = {}
        """generation -> this node's parts of the broker's plan, by part number."""
        self.verified: dict[tuple[int, int, str], Path] = {}
        """(rank, step, digest) -> the local copy the last inventory hashed (what a plan may trust)."""
        self.saved_ranks: list[int] = []
        self.reshaped_world = 0
        """After ``reshape`` (a shrink) until the next inventory: the ranks this node ran before, whose slots the
        inventory lists too, and the job's new world size, which it reports."""

    # -- lifecycle --------------------------------------------------------------------------------

    def rank_env(self, generation: int) -> dict[str, str]:
        """Environment for the ranks of ``generation``: their slot folder and their restore plan."""
        return {"KEEL_CKPT_DIR": str(self.node_dir), "KEEL_RESTORE_PLAN": str(plan_file(self.agent_dir, generation))}

    def start_fresh(self) -> None:
        """A new launch of the job (generation 0): no slot of an earlier launch may be restored."""
        for paths in ckpt_slots.list_slots(self.node_dir).values():
            for path in paths:
                path.unlink(missing_ok=True)
        shutil.rmtree(self.node_dir / "restore", ignore_errors=True)
        shutil.rmtree(self.node_dir / SENT_DIR, ignore_errors=True)
        shutil.rmtree(self.agent_dir / "restore", ignore_errors=True)
        self._write_plan(0, -1, {}, reason="a new launch starts fresh")

    def rejoin(self, generation: int) -> None:
        """A restarted agent took over ``generation`` of a running job (``keel.agent.rejoin``): the node's
        slots, sent copies and held backups are kept as they are (no ``start_fresh``) for the inventory of
        the restart that follows; its ranks are gone, so nothing is registered for this generation."""
        self.generation = generation
        self.registered_generation = generation
        if self.transport is not None:
            self.transport.refuse_generations_below(generation)

    def close(self, *, job_finished: bool) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.transport is not None:
            self.transport.close()
        if job_finished:
            shutil.rmtree(self.node_dir, ignore_errors=True)

    def take_over(self, local_ranks: list[int]) -> None:
        """The node now runs ``local_ranks`` (a promoted standby, or a node given another slice): the
        per-rank state is rebuilt for them, keeping the shard store (its address and the backups it holds
        for peers). Call before ``prepare_restart`` of the generation that starts them; the broker's
        assignments for the new ranks follow their registration."""
        self.local_ranks = list(local_ranks)
        self.progress = {r: _RankProgress() for r in self.local_ranks}
        self.assignments = {}
        # Work in flight for ranks no longer here is dropped (its result would be folded for the wrong rank).
        for rank in [r for r in self.sending if r not in self.progress]:
            self._cancel_send(rank)
        self.sending = {r: f for r, f in self.sending.items() if r in self.progress}
        self.persisting = {r: f for r, f in self.persisting.items() if r in self.progress}
        self.persisted.clear()
        self.verified = {}
        self.reported_round = -1
        self.round_ready_since = None
        self.registered_generation = None

    def reshape(self, local_ranks: list[int], world_size: int) -> None:
        """The job shrank: this node runs ``local_ranks`` of ``world_size`` from the next generation on. Its
        slots of the ranks it ran before stay listed by the next inventory (every node of the smaller job
        restores from every saved rank's shard). Call before ``prepare_restart``."""
        self.saved_ranks = sorted(set(self.local_ranks) - set(local_ranks))
        self.reshaped_world = world_size
        self.take_over(local_ranks)
        self.world_size = world_size

    # -- before a restart ---------------------------------------------------------------------------

    def prepare_restart(self, generation: int) -> None:
        """The node's ranks are stopped: take a verified inventory for the broker (supervised), or plan
        locally (unsupervised, one node: the newest step every local rank holds) and write the plan.

        The inventory hashes every slot: it runs on the pool (the new ranks start meanwhile and wait for
        the plan) and ``tick`` publishes it. Sends still running are cancelled (their results would be
        ignored: tagged with the old generation) and keep their futures until they end, so no second writer
        touches a rank's sent ring.
        """
        self.peer_committed_step = -1  # commits of the history this restart leaves say nothing of the next
        if self.transport is not None:
            self.transport.pin_committed(-1)
            self.transport.refuse_generations_below(generation)
        self.generation = generation
        self.registered_generation = None
        self.plan = None
        self.reported_round = -1  # the new generation may resume from an older step
        self.round_ready_since = None
        # Plans (or parts) of restarts this one supersedes will never be applied.
        self.plan_summaries = {g: p for g, p in self.plan_summaries.items() if g >= generation}
        self.plan_parts = {g: p for g, p in self.plan_parts.items() if g >= generation}
        for progress in self.progress.values():
            # The new generation may resume from an older step: its snapshots must replace the failed
            # generation's backups on the peers, and its persists the failed generation's steps.
            progress.last_sent_step = -1
            progress.last_persisted_step = -1
            progress.persist_missed = -1
            # Its peers are judged afresh too. Failures counted before the restart are mostly the old
            # history's sends that peers already restarted refused as stale; carried over, they held this
            # generation's backups (and so its report rounds, the restorable steps) for the retry interval.
            progress.send_failures = 0
            progress.retry_at_s = 0.0
        for rank in list(self.sending):
            self._cancel_send(rank)
        self.persisted.clear()
        self.inventory_future = (generation, self.pool.submit(self._inventory_then_wake))

    def _inventory_then_wake(self) -> tuple[list[InventoryEntry], list[RejectedShard]]:
        try:
            return self.inventory()
        finally:
            self.wake()

    def _collect_inventory(self) -> None:
        if self.inventory_future is None or not self.inventory_future[1].done():
            return
        generation, future = self.inventory_future
        self.inventory_future = None
        if generation != self.generation:
            return  # superseded by a newer restart
        try:
            entries, rejected = future.result()
        except Exception as exc:  # noqa: BLE001 - reported, and the restore goes on without this node's memory
            log.error("%s: inventory for generation %d failed: %r", self.node_id, generation, exc)
            entries, rejected = [], [RejectedShard(rank=r, tier="memory", step=-1, reason=f"inventory failed: {exc!r}")
                                     for r in self.local_ranks]
        if self.supervised:
            self.emit(CheckpointInventoryReported(node_id=self.node_id, generation=generation, entries=entries,
                                                  rejected=rejected, ranks=self.local_ranks,
                                                  world_size=self.reshaped_world),
                      subject=f"node/{self.node_id}")
            self.saved_ranks, self.reshaped_world = [], 0
            early = self.early_plans.pop(generation, None)
            if early is not None:
                self._start_plan(early)
            return
        steps_per_rank = [{e.step for e in entries if e.rank == r and e.tier == "memory"} for r in self.local_ranks]
        common = set.intersection(*steps_per_rank) if steps_per_rank else set()
        step = max(common) if common else -1
        shards = {}
        for rank in self.local_ranks if step >= 0 else []:
            digest = next(e.digest for e in entries if e.rank == rank and e.tier == "memory" and e.step == step)
            shards[str(rank)] = {"path": str(self.verified[(rank, step, digest)]), "format": "slot", "digest": digest,
                                 "tier": "memory", "verified_by": "agent"}
        self._discard_newer_than(step, generation)
        self._write_plan(generation, step, shards, reason="local plan (unsupervised): newest step every local rank holds")

    def _discard_newer_than(self, step: int, generation: int) -> None:
        """After a restore to ``step``, drop what the abandoned history left with newer step numbers: ring
        slots and sent copies of older generations, and backups held for peers. Otherwise a later restore
        could take an abandoned step for some ranks and a new one for others. Runs before the plan file is
        written, so no rank of ``generation`` has opened a slot yet."""
        for rank in self.local_ranks:
            for path in local_slot_files(self.node_dir, rank):
                try:
                    header = ckpt_slots.read_header(path)
                except ckpt_slots.SlotError:
                    continue
                if header.step > step and header.generation < generation:
                    path.unlink(missing_ok=True)
        if self.transport is not None:
            for held in self.transport.held_backups()[0]:
                if held["step"] > step and held.get("generation", 0) < generation:
                    # Only the copies above the step: an older one of the same rank may be what this very
                    # plan restores the rank from (a lost group's ranks fetch it from here).
                    self.transport.discard_backup(held["rank"], newer_than=step)

    def inventory(self) -> tuple[list[InventoryEntry], list[RejectedShard]]:
        """Every slot and held backup, each verified against its digest (a slot: its XXH3-128, which the
        writer took with the SHA-256 reported here; a held backup: its SHA-256)."""
        entries: list[InventoryEntry] = []
        rejected: list[RejectedShard] = []
        self.verified = {}
        for rank in [*self.local_ranks, *self.saved_ranks]:
            seen: set[tuple[int, str]] = set()
            for path in local_slot_files(self.node_dir, rank):
                try:
                    header, payload = ckpt_slots.read_payload(path, verify=True)
                except ckpt_slots.SlotError as exc:
                    step = _header_step(path)
                    if step is not None:  # an empty or half-written slot is not worth a report
                        rejected.append(RejectedShard(rank=rank, tier="memory", step=step, reason=str(exc)))
                    continue
                if (header.step, header.digest) in seen:
                    continue  # a ring slot and its sent copy: one entry
                seen.add((header.step, header.digest))
                self.verified[(rank, header.step, header.digest)] = path
                entries.append(InventoryEntry(rank=rank, tier="memory", step=header.step, bytes=len(payload),
                                              digest=header.digest))
        held, bad = self.transport.held_backups(verify=True) if self.transport else ([], [])
        for backup in held:
            entries.append(InventoryEntry(rank=backup["rank"], tier="peer", step=backup["step"], bytes=backup["bytes"],
                                          digest=backup["sha256"]))
        for backup in bad:
            rejected.append(RejectedShard(rank=backup["rank"], tier="peer", step=backup["step"], reason=backup["reason"]))
        return entries, rejected

    # -- broker events ------------------------------------------------------------------------------

    def handle_event(self, event: Event) -> None:
        payload = event.payload
        if isinstance(payload, CheckpointBackupAssigned | CheckpointNodeBackupsAssigned):
            # The node's part (on its subject), or the job-wide placement of an older broker.
            if payload.every_k_steps is not None:  # the schedule in force (news to a replacement node)
                self.every_k_steps = payload.every_k_steps
                self.backup_every = payload.backup_every_k_steps or 1
            for assignment in payload.assignments:
                if assignment.rank in self.progress and assignment.node_id == self.node_id:
                    previous = self.assignments.get(assignment.rank)
                    self.assignments[assignment.rank] = assignment
                    # A new address is a new store (the peer's agent restarted): send again, and
                    # forget the failures of the old one, or a rank that failed 3 times never resumes.
                    if previous is None or (previous.backup_node_id, previous.backup_address) != (
                            assignment.backup_node_id, assignment.backup_address):
                        self.progress[assignment.rank].last_sent_step = -1
                        self.progress[assignment.rank].send_failures = 0
                        # A send to the old peer still running (a host cut off answers nothing) would hold
                        # this rank's backups to the new one until its timeout.
                        if assignment.rank in self.sending and self.sending[assignment.rank][1] != assignment.backup_address:
                            self._cancel_send(assignment.rank)
        elif isinstance(payload, CheckpointNodeBackupsHeld):
            if payload.node_id == self.node_id and self.transport is not None:
                # This node's store accepts each rank's backups from the node assigned to send them only.
                changes: dict[int, str | None] = {rank: None for rank in payload.released}
                changes.update({a.rank: a.node_id for a in payload.held if a.backup_node_id == self.node_id})
                self.transport.assign_senders(changes)
        elif isinstance(payload, CheckpointNodeRestorePlanned) and self.supervised:
            if payload.node_id == self.node_id and payload.generation >= self.generation:
                self.plan_parts.setdefault(payload.generation, {})[payload.part] = payload
                self._plan_if_complete(payload.generation)
        elif isinstance(payload, CheckpointStepCommitted):
            if payload.tier == "peer" and payload.step > self.peer_committed_step:
                self.peer_committed_step = payload.step
                if self.transport is not None:
                    self.transport.pin_committed(payload.step)
        elif isinstance(payload, CheckpointScheduleSet):
            self.every_k_steps = payload.every_k_steps
            self.backup_every = payload.backup_every_k_steps
        elif isinstance(payload, CheckpointRestorePlanned) and self.supervised:
            if payload.generation >= self.generation:
                self.plan_summaries[payload.generation] = payload
                self._plan_if_complete(payload.generation)

    def _plan_if_complete(self, generation: int) -> None:
        """Apply the broker's plan for ``generation`` once it is whole here: the job-wide plan, and this
        node's parts of it (published before it, so normally here first). Complete when the plan starts
        fresh, names every local rank's source, or every part addressed to this node arrived (a rank it
        still lacks is then reported in the plan file as having no source)."""
        summary = self.plan_summaries.get(generation)
        if summary is None:
            return
        parts = self.plan_parts.get(generation, {})
        sources = {s.rank: s for s in summary.sources}
        for part in parts.values():
            if part.step == summary.step:
                sources.update({s.rank: s for s in part.sources})
        counts = {p.parts for p in parts.values() if p.step == summary.step}
        all_parts = bool(counts) and len([p for p in parts.values() if p.step == summary.step]) >= max(counts)
        if summary.step >= 0 and summary.node_parts > 0 and not all_parts and not all(
                r in sources for r in self.local_ranks):
            return  # a part addressed to this node is still on its way
        del self.plan_summaries[generation]
        self.plan_parts.pop(generation, None)
        for old in [g for g in self.plan_parts if g < generation]:
            del self.plan_parts[old]
        planned = summary.model_copy(update={"sources": [sources[r] for r in sorted(sources)]})
        if generation > self.generation or (generation == self.generation and self.inventory_future is not None):
            # Before this node's restart command, or before its inventory is out: apply it then.
            self.early_plans[generation] = planned
        elif generation == self.generation:
            self._start_plan(planned)

    def _start_plan(self, planned: CheckpointRestorePlanned) -> None:
        plan = _Plan(planned.generation, planned.step, reshard_from=planned.reshard_from)
        self._drop_older_restores(planned.generation)
        for source in planned.sources:
            if source.rank not in self.progress and not plan.reshard_from:
                continue
            entry: dict[str, Any] = {"digest": source.digest, "tier": source.tier}
            if source.tier == "memory" and (source.node_id == self.node_id or not plan.reshard_from):
                slot = self.verified.get((source.rank, planned.step, source.digest))
                if slot is None:
                    entry["error"] = f"no verified slot of step {planned.step} in {self.node_dir}"
                else:
                    # Hashed by this agent's inventory, and nothing has written it since (the old ranks
                    # are stopped; new ones write only after restoring): the rank compares the header only.
                    entry.update(path=str(slot), format="slot", verified_by="agent")
            elif source.tier == "disk":
                entry.update(path=source.path, format="shard")
            elif source.node_id == self.node_id and self.transport is not None:
                dest = self.node_dir / "restore" / f"g{planned.generation}" / f"rank{source.rank}.shard"
                entry.update(path=str(dest), format="shard")
                plan.held[source.rank] = dest
            elif self.transport is None:
                entry["error"] = "this agent has no shard transport to fetch a peer copy"
            else:
                # Per generation: a fetch of an older restart still running cannot rename over this one.
                dest = self.node_dir / "restore" / f"g{planned.generation}" / f"rank{source.rank}.shard"
                entry.update(path=str(dest), format="shard")
                plan.pending[source.rank] = self.pool.submit(
                    self._fetch, source.address, source.rank, planned.step, dest, source.digest, source.node_id)
            plan.entries[source.rank] = entry
        if planned.step >= 0 and not plan.reshard_from:
            for rank in self.local_ranks:
                plan.entries.setdefault(rank, {"error": f"the broker's plan for generation {planned.generation} "
                                                        f"(step {planned.step}) names no source for rank {rank}"})
        self.plan = plan
        self._finish_plan_if_ready()

    def _drop_older_restores(self, generation: int) -> None:
        """Remove the shards staged for older generations' restores (``restore/g<h>/``, fetched copies and links
        to held backups): their ranks are stopped, and in memory they would pin a shard per restart."""
        root = self.node_dir / "restore"
        for folder in root.glob("g*") if root.is_dir() else ():
            older = folder.name[1:].isdigit() and int(folder.name[1:]) < generation
            if older and folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)

    def _stage_held(self, plan: _Plan) -> None:
        """Link each backup this node holds that the plan restores from to the plan's path for it (after
        ``_discard_newer_than``, which can move it): a later backup round renaming the held copies cannot pull
        it from under the rank. An entry whose backup is gone says so instead."""
        if not plan.held or self.transport is None:
            return
        held = {(h["rank"], h["sha256"]): Path(h["path"]) for h in self.transport.held_backups()[0]
                if h["step"] == plan.step}
        for rank, dest in plan.held.items():
            source = held.get((rank, plan.entries[rank].get("digest")))  # the very copy the broker planned
            try:
                if source is None:
                    raise FileNotFoundError(f"no backup of step {plan.step}")
                dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                dest.unlink(missing_ok=True)
                os.link(source, dest)  # same file system (the node folder); no copy of the bytes
            except OSError as exc:
                plan.entries[rank] = {**plan.entries[rank], "error": f"backup of rank {rank} step {plan.step} "
                                      f"is gone from this node: {exc}"}
                plan.entries[rank].pop("path", None)

    def _fetch(self, address: str, rank: int, step: int, dest: Path, digest: str, holder: str) -> float:
        started = time.monotonic()
        try:
            assert self.transport is not None
            # The owner is not checked: after a replacement the rank may run on another node than before.
            self.transport.fetch(address, owner_node_id="", rank=rank, step=step, dest=dest, sha256=digest)
        finally:
            self.wake()
        return time.monotonic() - started

    def _finish_plan_if_ready(self) -> None:
        plan = self.plan
        if plan is None or plan.generation != self.generation:
            return
        for rank, future in list(plan.pending.items()):
            if not future.done():
                return
            exc = future.exception()
            if exc is not None:
                reason = f"fetching rank {rank} step {plan.step} from its peer failed: {exc}"
                plan.entries[rank]["error"] = reason
                self.emit(CheckpointTierFallback(generation=plan.generation, rank=rank, step=plan.step,
                                                 from_tier="peer", to_tier="none", reason=reason),
                          subject=f"job/{self.job_id}")  # a job-aggregate event: node/... is refused
            del plan.pending[rank]
        self._discard_newer_than(plan.step, plan.generation)
        self._stage_held(plan)
        shards = {str(rank): entry for rank, entry in plan.entries.items()}
        if plan.reshard_from:
            for rank in range(plan.reshard_from):
                shards.setdefault(str(rank), {"error": f"the broker's plan for generation {plan.generation} (step "
                                                       f"{plan.step}) names no source for saved rank {rank}"})
            self._write_plan(plan.generation, plan.step, {}, reason="planned by the checkpoint broker: the job shrank, "
                             f"every saved rank's shard staged to reshard from {plan.reshard_from} ranks",
                             reshard={"world_size": plan.reshard_from, "shards": shards})
        else:
            self._write_plan(plan.generation, plan.step, shards, reason="planned by the checkpoint broker")
        self.plan = None

    def _write_plan(self, generation: int, step: int, shards: dict[str, Any], reason: str,
                    reshard: dict[str, Any] | None = None) -> None:
        document = {"generation": generation, "step": step, "shards": shards, "reason": reason}
        if reshard is not None:
            document["reshard"] = reshard
        ckpt_slots.write_file_atomic(plan_file(self.agent_dir, generation), json.dumps(document, indent=1).encode(),
                                     fsync=False)
        log.info("%s: restore plan for generation %d: step %d (%s)", self.node_id, generation, step, reason)

    # -- the loop -------------------------------------------------------------------------------------

    def tick(self, monotonic_s: float, groups: dict[int, dict[str, Any] | None],
             checkpoint_steps: dict[int, int]) -> None:
        """Fold finished background work into events and start new work.

        ``groups``/``checkpoint_steps``: what the channel knows of each local rank of the current generation.
        Each duty runs guarded (``self.pieces``): one that raises does not keep the others from running.
        """
        run = self.pieces.run
        run("registration", self._register, groups)
        run("inventory", self._collect_inventory)
        run("backup sends", self._collect_sends)
        run("persists", self._collect_persists)
        run("restore plan", self._finish_plan_if_ready)
        run("backup sends", self._start_sends, checkpoint_steps)
        run("persists", self._start_persists, checkpoint_steps)
        # Memory and peer holdings are no events of their own: they ride on the agent's heartbeat
        # (``holdings``), which goes early when a report round completes (``report_due``).

    def _register(self, groups: dict[int, dict[str, Any] | None]) -> None:
        if self.registered_generation == self.generation:
            return
        if any(groups.get(rank) is None for rank in self.local_ranks):
            return
        ranks = [RankGroups(rank=r, **groups[r]) for r in self.local_ranks]  # type: ignore[arg-type]
        self.emit(CheckpointRanksRegistered(node_id=self.node_id, generation=self.generation,
                                            world_size=self.world_size, store_address=self.transport.address if self.transport else "",
                                            ranks=ranks), subject=f"node/{self.node_id}")
        self.registered_generation = self.generation

    # -- reports (carried by the heartbeat) -----------------------------------------------------------

    def holdings(self) -> dict[CheckpointTier, list[ShardRecord]]:
        """What the node holds now, per tier, for ``NodeHeartbeat.stored``: per local rank, the newest
        report-round step its slots (and sent copies) hold in memory, and per backup held for another
        node's rank, the newest report-round step held. Only round steps (multiples of the report round,
        or of the broker's backup interval before a round is known) are ones every node reports alike,
        so only they can commit; one record per rank and tier keeps a heartbeat small (about 170 bytes a
        record). Tiers with nothing held are left out."""
        every = max(1, self.round_every or self.backup_every)
        memory: dict[int, ShardRecord] = {}
        for rank in self.local_ranks:
            for _, header in complete_slots(self.node_dir, rank):  # newest first
                if header.step % every == 0:
                    memory[rank] = ShardRecord(
                        rank=rank, step=header.step, bytes=header.payload_len, digest=header.digest,
                        send_s=round(self.progress[rank].last_send_s, 3) if rank in self.progress else 0.0)
                    break
        found: dict[CheckpointTier, list[ShardRecord]] = {}
        if memory:
            found["memory"] = [memory[r] for r in sorted(memory)]
        if self.transport is not None:
            peer: dict[tuple[str, int], ShardRecord] = {}
            for h in self.transport.held_backups()[0]:
                key = (h["owner_node_id"], h["rank"])
                if h["step"] % every == 0 and (key not in peer or peer[key].step < h["step"]):
                    peer[key] = ShardRecord(rank=h["rank"], step=h["step"], bytes=h["bytes"], digest=h["sha256"],
                                            owner_node_id=h["owner_node_id"])
            if peer:
                found["peer"] = sorted(peer.values(), key=lambda s: (s.rank, s.owner_node_id))
        return found

    def _backups_behind(self, step: int) -> bool:
        """A backup this node holds for a peer's rank is older than ``step`` (its round has not landed)."""
        assert self.transport is not None
        newest: dict[int, int] = {}
        for held in self.transport.held_backups()[0]:
            newest[held["rank"]] = max(newest.get(held["rank"], -1), held["step"])
        return any(s < step for s in newest.values())

    def report_due(self, monotonic_s: float, checkpoint_steps: dict[int, int], step_time_s: float | None,
                   period: timedelta) -> bool:
        """True when a report round completed and the heartbeat should go now, carrying it.

        A report round is a step that is a multiple of ``report_round_steps`` (a power of two, so nodes
        whose step times round differently still share every multiple of the larger one): every node
        reports the same steps, and the broker can commit them although heartbeats are minutes apart
        in total. The round is complete when every local rank holds it in memory (its backup sent, with
        a peer tier) and every backup this node holds for peers reached it, or ``ROUND_PEER_GRACE_S``
        after the memory part completed (a peer's send may be late or skipped)."""
        every = report_round_steps(self.backup_every, step_time_s, period)
        self.round_every = every
        if every is None or not self.local_ranks:
            return False
        # A rank with a backup peer holds a round once its backup was sent (the sent copy keeps it); one
        # without (no peer tier, a one-node job, before placement) once it stepped there.
        newest = min(self.progress[r].last_sent_step if r in self.assignments and r in self.progress
                     else checkpoint_steps.get(r, -1) for r in self.local_ranks)
        round_step = newest - newest % every if newest >= 0 else -1
        if round_step <= self.reported_round:
            self.round_ready_since = None
            return False
        if self.transport is not None:
            if self.round_ready_since is None:
                self.round_ready_since = monotonic_s
            if monotonic_s - self.round_ready_since < ROUND_PEER_GRACE_S and self._backups_behind(round_step):
                return False
        self.reported_round = round_step
        self.round_ready_since = None
        return True

    # backups to peers

    def _start_sends(self, checkpoint_steps: dict[int, int]) -> None:
        if self.transport is None:
            return
        for rank, assignment in self.assignments.items():
            step = self._backup_step(rank, checkpoint_steps.get(rank, -1))
            progress = self.progress[rank]
            if step <= progress.last_sent_step or rank in self.sending:
                continue
            if progress.send_failures >= _SEND_FAILURES_REPORTED and time.monotonic() < progress.retry_at_s:
                continue
            self.sending[rank] = (self.generation, assignment.backup_address,
                                  self.pool.submit(self._send, assignment, step))

    def _cancel_send(self, rank: int) -> None:
        """Ask the transport to end ``rank``'s send in flight; its future stays in ``sending`` until it
        has ended (``_collect_sends``), so the next send of the rank starts after it."""
        if self.transport is not None and rank in self.sending:
            _, address, _ = self.sending[rank]
            if self.transport.cancel_send(address, rank):
                log.info("%s: cancelled rank %d's backup send to %s (its peer or its generation changed)",
                         self.node_id, rank, address)

    def _backup_step(self, rank: int, newest: int) -> int:
        """The step to back up: the newest multiple of the broker's backup interval the rank's slots
        still hold in this generation (-1: none). Every node backs up the same steps, so the peer tier
        holds one step of every rank.

        A slot written by an older generation is never sent: right after a restart the restored step's
        slot is still the failed history's (its header says so), and peers already on this generation
        refuse it as stale. Three such refusals read as a dead peer and moved the rank's backup away from
        a healthy node (``tests/scenarios/test_checkpoint_resume.py``)."""
        if newest < 0:
            return newest
        wanted = newest if self.backup_every <= 1 else newest - newest % self.backup_every
        generation = {header.step: header.generation for _, header in complete_slots(self.node_dir, rank, sent=False)}
        return wanted if generation.get(wanted, -1) >= self.generation else -1

    def _send(self, assignment: BackupAssignment, step: int) -> int:
        started = time.monotonic()
        try:
            assert self.transport is not None
            # The transport sends from the sent ring: the peer's copy and the local one are the same bytes.
            keep_sent_copy(self.node_dir, assignment.rank, step, pinned=self.peer_committed_step)
            self.transport.send(assignment.backup_address, rank=assignment.rank, step=step)
            self.progress[assignment.rank].last_send_s = time.monotonic() - started
            return step
        finally:
            self.wake()

    def _collect_sends(self) -> None:
        for rank, (generation, address, future) in list(self.sending.items()):
            if not future.done():
                continue
            del self.sending[rank]
            progress = self.progress[rank]
            if future.cancelled() or generation != self.generation:
                continue  # a send of a generation since restarted: its outcome says nothing now
            exc = future.exception()
            current = self.assignments.get(rank)
            if isinstance(exc, CancelledError | asyncio.CancelledError) or current is None or current.backup_address != address:
                continue  # cancelled, or to a peer no longer assigned: it counts neither as sent nor as failed
            if exc is None:
                progress.last_sent_step = future.result()
                progress.send_failures = 0
            elif isinstance(exc, ckpt_slots.SlotError) or type(exc).__name__ == "LocalShardError":
                # The ring overwrote the step before it was copied: the copy is slower than two steps.
                log.warning("%s: rank %d's snapshot moved on before it could be backed up (%s)", self.node_id, rank, exc)
            else:
                progress.send_failures += 1
                progress.retry_at_s = time.monotonic() + _SEND_RETRY_INTERVAL_S
                assignment = self.assignments[rank]
                log.warning("%s: backup of rank %d to %s failed: %s", self.node_id, rank, assignment.backup_node_id, exc)
                if progress.send_failures == _SEND_FAILURES_REPORTED:  # a dead peer: tell the broker once, it re-places the backup
                    self.emit(CheckpointBackupFailed(node_id=self.node_id, rank=rank,
                                                     backup_node_id=assignment.backup_node_id,
                                                     reason=f"{type(exc).__name__}: {exc}"),
                              subject=f"node/{self.node_id}")

    # the persistent tier

    def _start_persists(self, checkpoint_steps: dict[int, int]) -> None:
        if self.persist_root is None or not self.every_k_steps:
            return
        for rank in self.local_ranks:
            progress = self.progress[rank]
            newest = checkpoint_steps.get(rank, -1)
            due = newest - newest % self.every_k_steps  # the newest multiple of K reached
            if newest < 0 or rank in self.persisting or due <= max(progress.last_persisted_step, progress.persist_missed):
                continue
            step = self._persist_step(rank, newest)
            if step <= progress.last_persisted_step:
                progress.persist_missed = due  # overwritten before this wake-up: look again at the next multiple
                continue
            progress.last_persisted_step = step
            self.persisting[rank] = (step, self.pool.submit(self._persist, rank, step))

    def _persist_step(self, rank: int, newest: int) -> int:
        """The newest multiple of K that a slot or sent copy of the rank still holds (-1: none). The
        loop wakes on the rank's reports, but a fast step can move the ring past a multiple of K
        between two wake-ups; the sent copies (backups every k-th step) may still hold it."""
        every = self.every_k_steps or 1
        if newest % every == 0:
            return newest
        held = [header.step for _, header in complete_slots(self.node_dir, rank)
                if header.step % every == 0 and header.step <= newest]
        return max(held, default=-1)

    def _persist(self, rank: int, step: int) -> ShardRecord:
        from keel.checkpoint import disk as ckpt_disk

        try:
            _, payload, digest = read_slot_of_step(self.node_dir, rank, step)
            assert self.persist_root is not None
            started = time.monotonic()
            ckpt_disk.write_shard(self.persist_root, self.job_id, step, rank, payload)
            return ShardRecord(rank=rank, step=step, bytes=len(payload), digest=digest,
                               write_s=time.monotonic() - started)
        finally:
            self.wake()

    def _collect_persists(self) -> None:
        for rank, (step, future) in list(self.persisting.items()):
            if not future.done():
                continue
            del self.persisting[rank]
            exc = future.exception() if not future.cancelled() else None
            if future.cancelled():
                continue
            if exc is not None:
                log.warning("%s: persisting rank %d step %d failed: %s", self.node_id, rank, step, exc)
                continue
            done = self.persisted.setdefault(step, {})
            done[rank] = future.result()
            if len(done) == len(self.local_ranks):
                self.emit(CheckpointShardsStored(node_id=self.node_id, tier="disk",
                                                 shards=[done[r] for r in self.local_ranks]),
                          subject=f"node/{self.node_id}")
                self.persisted = {s: d for s, d in self.persisted.items() if s > step}


def _header_step(path: Path) -> int | None:
    try:
        header = ckpt_slots.read_header(path)
    except ckpt_slots.SlotError:
        return None
    return header.step if header.state != ckpt_slots.SLOT_EMPTY else None


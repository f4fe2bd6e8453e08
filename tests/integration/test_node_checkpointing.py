"""NodeCheckpointing end to end: real gRPC shard stores, the real broker decider, real slot files.

No NATS or PostgreSQL: every node's ``emit`` wraps its payload into an ``Event`` exactly like
``NodeAgent.emit`` (subject defaults to ``node/<id>``) and the in-process ``Cluster`` feeds it to a
``DeciderSession`` over ``CheckpointBrokerDecider``; the broker's decisions go back to every live node's
``handle_event``, as the agents' pull consumers would deliver them. Each node runs a real
``GrpcTransport`` (a ``ShardStore`` server on ``127.0.0.1:0`` and its client) over a node folder in
``/dev/shm``; slots are written with the real ``SlotWriter``. Sends, fetches and persists run on the
node's thread pool, so the tests tick the nodes in a bounded loop until the expected events appear.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from keel.agent.checkpointing import GrpcTransport, NodeCheckpointing, local_slot_files, plan_file
from keel.agent.shard_store import TlsMaterial
from keel.checkpoint import disk as ckpt_disk
from keel.checkpoint.slots import HEADER_BYTES, SlotWriter, read_header, read_payload, slot_path
from keel.checkpoint_broker.decider import CheckpointBrokerDecider
from keel.checkpoint_broker.restore import joined_sources
from keel.checkpoint_broker.state import BrokerPolicy
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CheckpointBackupAssigned,
    CheckpointBackupFailed,
    CheckpointInventoryReported,
    CheckpointNodeBackupsAssigned,
    CheckpointNodeRestorePlanned,
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CheckpointScheduleSet,
    CheckpointShardsStored,
    CheckpointStepCommitted,
    CheckpointTierFallback,
    NodeHeartbeat,
)
from keel.kernel.decider import DeciderSession

JOB = "job-nc"
WAIT_S = 10.0
TRANSFER_TIMEOUT = timedelta(seconds=5)


def solo_groups(rank: int) -> dict[str, list[int]]:
    """Singleton groups: no parallel group spans two nodes, so every other node is an ISOLATED backup
    candidate (placed without a fallback)."""
    return {"dp": [rank], "pp": [rank], "tp": [rank]}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_slot(node_dir: Path, rank: int, step: int, payload: bytes, *, slots: int = 2, generation: int = 0) -> Path:
    """A rank's snapshot of ``step`` in ring slot ``step % slots``, the way the Checkpointer writes it."""
    path = slot_path(node_dir, rank, step % slots)
    writer = SlotWriter(path, len(payload))
    writer.begin(step, generation)
    writer.payload_view()[: len(payload)] = payload
    writer.complete(step, len(payload), sha(payload), generation)
    writer.close()
    return path


def corrupt_payload_byte(path: Path, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + offset)
        byte = f.read(1)
        f.seek(HEADER_BYTES + offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- the harness --------------------------------------------------------------------------------------


class Node:
    """One node agent's checkpoint duties: NodeCheckpointing over a real GrpcTransport (optional)."""

    def __init__(self, cluster: Cluster, node_id: str, ranks: list[int], world_size: int, *,
                 transport: bool = True, persist_root: Path | None = None, supervised: bool = True,
                 transfer_timeout: timedelta = TRANSFER_TIMEOUT) -> None:
        self.cluster = cluster
        self.node_id = node_id
        self.ranks = ranks
        self.dir = cluster.base / "shm" / JOB / node_id
        self.agent_dir = cluster.base / "agents" / node_id
        self.dir.mkdir(parents=True, exist_ok=True)
        # Each node's certificate of the job's CA, as the launcher issues it (keel.cluster.local).
        self.transport = (GrpcTransport(JOB, node_id, self.dir, bind="127.0.0.1:0", timeout=transfer_timeout,
                                        tls=TlsMaterial.issue(cluster.base / "credentials", JOB, node_id, ("127.0.0.1",)),
                                        world_size=world_size)
                          if transport else None)
        self.transport_closed = False
        self.alive = True
        self.ckpt = NodeCheckpointing(
            job_id=JOB, node_id=node_id, local_ranks=ranks, world_size=world_size, node_dir=self.dir,
            agent_dir=self.agent_dir, emit=self.emit, transport=self.transport, persist_root=persist_root,
            report_interval=timedelta(0), supervised=supervised)
        # What the rank channel knows of each local rank (NodeAgent.tick passes these).
        self.groups: dict[int, dict[str, list[int]] | None] = {r: solo_groups(r) for r in ranks}
        self.steps: dict[int, int] = {}
        self.payloads: dict[tuple[int, int], bytes] = {}  # (rank, step) -> payload
        self.last_stored: dict[str, Any] = {}

    def emit(self, payload: EventPayload, subject: str | None = None, causation: Event | None = None) -> None:
        # As NodeAgent.emit: the subject defaults to the node's own.
        event = Event.create(payload, job_id=JOB, subject=subject or f"node/{self.node_id}", producer="agent",
                             occurred_at=datetime.now(UTC))
        self.cluster.queue.append(event)

    def snapshot(self, rank: int, step: int, size: int = 64 * 1024, *, generation: int = 0) -> bytes:
        """The rank completes its snapshot of ``step`` (random payload) and reports it."""
        payload = os.urandom(size)
        write_slot(self.dir, rank, step, payload, generation=generation)
        self.payloads[(rank, step)] = payload
        self.steps[rank] = max(self.steps.get(rank, -1), step)
        return payload

    def kill_store(self) -> None:
        """The node's shard store dies (the peers' sends and fetches then fail); the node stops ticking."""
        assert self.transport is not None
        self.transport.close()
        self.transport_closed = True
        self.alive = False

    def tick(self) -> None:
        self.ckpt.tick(time.monotonic(), self.groups, self.steps)
        # The agent's heartbeat carries the node's memory and peer holdings; here one goes whenever they
        # change (the agent sends one per report round: ``report_due``, tested on its own).
        stored = self.ckpt.holdings()
        if stored != self.last_stored:
            self.last_stored = stored
            self.emit(NodeHeartbeat(node_id=self.node_id, ranks_alive=len(self.ranks),
                                    ranks_expected=len(self.ranks), stored=stored))

    def restart(self, generation: int) -> None:
        """The agent's restart: the inventory runs on the pool; the next tick publishes it (or, unsupervised,
        writes the local plan)."""
        self.ckpt.prepare_restart(generation=generation)
        assert self.ckpt.inventory_future is not None
        self.ckpt.inventory_future[1].result(timeout=10)
        self.ckpt.tick(time.monotonic(), {}, {})  # the new ranks have not reported yet

    def close(self) -> None:
        if self.transport_closed:
            self.ckpt.transport = None  # already closed: a second close would wait on a stopped loop
        self.ckpt.close(job_finished=False)


class Cluster:
    """Nodes plus the broker decider, in one process: events go node -> broker -> nodes."""

    def __init__(self, base: Path) -> None:
        self.base = base
        # Commits as soon as every rank is reported (the broker holds heartbeat-carried commits back to
        # one per 10 s per tier: tests/unit/test_report_budget.py), so each test commits step after step.
        self.session = DeciderSession(CheckpointBrokerDecider(BrokerPolicy(commit_min_period=timedelta(0))))
        self.nodes: dict[str, Node] = {}
        self.retired: list[Node] = []  # replaced by a restarted agent of the same node
        self.queue: list[Event] = []
        self.log: list[Event] = []

    def add(self, node_id: str, ranks: list[int], world_size: int, **kwargs: Any) -> Node:
        node = self.nodes[node_id] = Node(self, node_id, ranks, world_size, **kwargs)
        return node

    def restart(self, node_id: str) -> Node:
        """The node's agent restarts: a new NodeCheckpointing and shard store (a new port) over the same
        node folder; the ranks' slots survive in shared memory."""
        old = self.nodes[node_id]
        old.alive = False
        self.retired.append(old)
        new = self.add(node_id, old.ranks, old.ckpt.world_size)
        new.steps = dict(old.steps)
        return new

    def pump(self) -> None:
        """Deliver queued node events to the broker and the broker's decisions to every live node."""
        while self.queue:
            event = self.queue.pop(0)
            self.log.append(event)
            for decided in self.session.observe(event).emitted:
                self.log.append(decided)
                self.broadcast(decided)

    def broadcast(self, event: Event) -> None:
        for node in self.nodes.values():
            # As the agents' subject filters do: an event on a node's subject reaches that node only.
            if node.alive and (not event.subject.startswith("node/") or event.subject == f"node/{node.node_id}"):
                node.ckpt.handle_event(event)
        self.pump()

    def tick(self) -> None:
        for node in self.nodes.values():
            if node.alive:
                node.tick()
        self.pump()

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            self.tick()
            found = predicate()
            if found:
                return found
            if time.monotonic() > deadline:
                seen = [f"{e.producer}:{e.type}" for e in self.log]
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; events: {seen}")
            time.sleep(0.02)

    def settle(self, seconds: float) -> None:
        """Keep ticking for a while (to check that something does *not* happen)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.tick()
            time.sleep(0.02)

    def placement_events(self) -> list[Event]:
        """Each placement decision's per-node parts (``CheckpointNodeBackupsAssigned``) as one event
        with every assignment (in the shape of the job-wide ``CheckpointBackupAssigned`` of before), in
        log order; each part is checked to be on its node's subject."""
        by_cause: dict[Any, list[Event]] = {}
        for event in self.events(CheckpointNodeBackupsAssigned):
            assert event.subject == f"node/{event.payload.node_id}"
            assert all(a.node_id == event.payload.node_id for a in event.payload.assignments)
            by_cause.setdefault(event.causation_id, []).append(event)
        joined = []
        for parts in by_cause.values():
            first = parts[0].payload
            payload = CheckpointBackupAssigned(
                assignments=sorted((a for e in parts for a in e.payload.assignments), key=lambda a: a.rank),
                reason=first.reason, every_k_steps=first.every_k_steps, backup_every_k_steps=first.backup_every_k_steps)
            joined.append(parts[0].model_copy(update={"payload": payload}))
        return joined

    def placements(self) -> list[CheckpointBackupAssigned]:
        return [e.payload for e in self.placement_events()]

    def plans(self, generation: int) -> list[CheckpointRestorePlanned]:
        """The broker's plans for ``generation``, each with its nodes' parts joined into ``sources``."""
        parts = self.payloads(CheckpointNodeRestorePlanned, generation=generation)
        return [p.model_copy(update={"sources": joined_sources(p, parts)})
                for p in self.payloads(CheckpointRestorePlanned, generation=generation)]

    def payloads(self, kind: type, **fields: Any) -> list[Any]:
        return [e.payload for e in self.events(kind, **fields)]

    def events(self, kind: type, **fields: Any) -> list[Event]:
        return [e for e in self.log if isinstance(e.payload, kind)
                and all(getattr(e.payload, k) == v for k, v in fields.items())]

    def backups(self) -> dict[int, Any]:
        """The broker's current assignment per rank."""
        return dict(self.session.state.job(JOB).backups)

    def held(self, node: Node, rank: int, step: int, owner: str) -> list[Any]:
        """The distinct peer records ``node``'s heartbeats reported for ``rank`` at ``step`` (a heartbeat
        carries every holding, so a record recurs until it is dropped)."""
        found = [s for p in self.payloads(NodeHeartbeat, node_id=node.node_id)
                 for s in p.stored.get("peer", []) if s.rank == rank and s.step == step and s.owner_node_id == owner]
        return list({(s.digest, s.bytes): s for s in found}.values())


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    base = Path(tempfile.mkdtemp(prefix="keel-nc-", dir="/dev/shm"))
    c = Cluster(base)
    try:
        yield c
    finally:
        for node in [*c.retired, *c.nodes.values()]:
            node.close()
        shutil.rmtree(base, ignore_errors=True)


def three_nodes(cluster: Cluster, size: int = 64 * 1024) -> tuple[Node, Node, Node]:
    """Nodes A, B, C with rank 0, 1, 2, each with snapshots of steps 1 and 2 (rank 0's larger than one
    gRPC chunk)."""
    nodes = tuple(cluster.add(n, [r], 3) for r, n in enumerate("ABC"))
    for node in nodes:
        [rank] = node.ranks
        for step in (1, 2):
            node.snapshot(rank, step, size=(1536 * 1024 if rank == 0 else size))
    return nodes  # type: ignore[return-value]


def backed_up(cluster: Cluster, step: int) -> dict[int, str]:
    """Tick until the broker commits ``step`` in memory and on peers; returns rank -> backup node."""
    cluster.wait_for(f"peer commit of step {step}",
                     lambda: cluster.payloads(CheckpointStepCommitted, tier="peer", step=step))
    # The owners fold their finished sends in (a peer may report before its owner's next tick).
    cluster.wait_for("the owners' sends collected", lambda: all(
        n.ckpt.progress[r].last_sent_step == step for n in cluster.nodes.values() for r in n.ranks))
    return {r: a.backup_node_id for r, a in cluster.backups().items()}


# -- 1. registration -> placement -> backup -> commits ---------------------------------------------------


def test_registration_placement_backup_and_commits(cluster: Cluster) -> None:
    a, b, c = three_nodes(cluster)
    cluster.wait_for("backup assignments", lambda: cluster.placements())

    registered = cluster.payloads(CheckpointRanksRegistered)
    assert {(p.node_id, tuple(g.rank for g in p.ranks), p.world_size, p.generation) for p in registered} == {
        ("A", (0,), 3, 0), ("B", (1,), 3, 0), ("C", (2,), 3, 0)}
    assert {p.node_id: p.store_address for p in registered} == {n.node_id: n.transport.address for n in (a, b, c)}
    [assigned] = cluster.placements()
    assert "all 3 ranks registered" in assigned.reason
    by_rank = {x.rank: x for x in assigned.assignments}
    assert sorted(by_rank) == [0, 1, 2]
    nodes = {n.node_id: n for n in (a, b, c)}
    for rank, x in by_rank.items():
        # The invariant: never the rank's own node; no group spans two nodes, so no fallback; the
        # address is the backup node's real shard store.
        assert x.node_id == "ABC"[rank] and x.backup_node_id != x.node_id
        assert x.fallback == "" and x.backup_address == nodes[x.backup_node_id].transport.address
    assert sorted(x.backup_node_id for x in by_rank.values()) == ["A", "B", "C"], "one backup per node"
    assert a.ckpt.assignments[0].backup_node_id == by_rank[0].backup_node_id

    backup = backed_up(cluster, 2)
    # Each backup node reported the newest step of the rank it holds, as the owner's rank, verified.
    for rank, holder in backup.items():
        owner = nodes["ABC"[rank]]
        payload = owner.payloads[(rank, 2)]
        [record] = cluster.held(nodes[holder], rank, 2, owner.node_id)
        assert record.digest == sha(payload) and record.bytes == len(payload)
        held = [h for h in nodes[holder].transport.held_backups(verify=True)[0] if h["rank"] == rank]
        assert [(h["step"], h["owner_node_id"], h["sha256"]) for h in held] == [(2, owner.node_id, sha(payload))]
        assert Path(held[0]["path"]).read_bytes() == payload
        assert owner.ckpt.progress[rank].last_sent_step == 2
    # Memory and peer commits of the newest step every rank holds, once each.
    commits = {(p.tier, p.step): p for p in cluster.payloads(CheckpointStepCommitted)}
    assert sorted(commits) == [("memory", 2), ("peer", 2)]
    total = sum(len(n.payloads[(n.ranks[0], 2)]) for n in (a, b, c))
    assert all(p.ranks == 3 and p.bytes == total for p in commits.values())


# -- 2. a dead backup peer: three failed sends, re-placement, backup on the new peer -----------------------


def test_dead_backup_peer_is_replaced_after_three_failed_sends(cluster: Cluster) -> None:
    a, b, c = three_nodes(cluster)
    nodes = {n.node_id: n for n in (a, b, c)}
    backup = backed_up(cluster, 2)
    dead = nodes[backup[0]]
    survivor = next(n for n in (b, c) if n is not dead)
    dead.kill_store()
    payload = a.snapshot(0, 3)

    [failed] = cluster.wait_for("CheckpointBackupFailed", lambda: cluster.payloads(CheckpointBackupFailed))
    assert (failed.node_id, failed.rank, failed.backup_node_id) == ("A", 0, dead.node_id)
    assert failed.reason.startswith("PeerUnavailable") and dead.transport.address in failed.reason
    moved = cluster.wait_for("rank 0 re-placed", lambda: [
        x for p in cluster.placements() for x in p.assignments
        if x.rank == 0 and x.backup_node_id != dead.node_id])
    assert [(x.node_id, x.backup_node_id, x.backup_address) for x in moved] == [
        ("A", survivor.node_id, survivor.transport.address)]
    [reassigned] = [e for e in cluster.placement_events()
                    if any(x.rank == 0 and x.backup_node_id == survivor.node_id for x in e.payload.assignments)]
    assert f"A could not back up rank 0 on {dead.node_id}" in reassigned.payload.reason
    # Only rank 0 moved; the broker's failure report came before the re-placement.
    assert [x.rank for x in reassigned.payload.assignments] == [0]
    assert cluster.log.index(cluster.events(CheckpointBackupFailed)[0]) < min(
        i for i, e in enumerate(cluster.log) if e.causation_id == reassigned.causation_id)

    [record] = cluster.wait_for("the new peer holding rank 0 step 3",
                                lambda: cluster.held(survivor, 0, 3, "A"))
    assert record.digest == sha(payload) and record.bytes == len(payload)
    cluster.wait_for("A's send collected", lambda: a.ckpt.progress[0].last_sent_step == 3)
    assert a.ckpt.progress[0].send_failures == 0
    assert len(cluster.payloads(CheckpointBackupFailed)) == 1, "the failure is reported once"


# -- 3. a corrupted slot: rejected in the inventory, restored from the peer over gRPC ----------------------


def corrupt_every_local_copy(node_dir: Path, rank: int, step: int) -> None:
    """Corrupt the rank's ring slot of ``step`` and the node's sent copy of it (the same bytes)."""
    copies = [p for p in local_slot_files(node_dir, rank) if read_header(p).step == step]
    assert len(copies) == 2, copies  # the ring slot and the copy kept when it was backed up
    for path in copies:
        corrupt_payload_byte(path)


def test_corrupted_slot_is_restored_from_the_peer_copy(cluster: Cluster) -> None:
    a, b, c = three_nodes(cluster)
    nodes = {n.node_id: n for n in (a, b, c)}
    backup = backed_up(cluster, 2)
    holder = nodes[backup[0]]
    original = a.payloads[(0, 2)]
    corrupt_every_local_copy(a.dir, 0, 2)

    for node in (a, b, c):
        node.groups, node.steps = {}, {}  # ranks stopped: nothing to register or send
        node.restart(1)
        cluster.pump()

    [inventory] = cluster.payloads(CheckpointInventoryReported, node_id="A")
    assert inventory.generation == 1 and inventory.ranks == [0]
    assert len(inventory.rejected) == 2  # the ring slot and the sent copy of step 2
    rejected = inventory.rejected[0]
    assert (rejected.rank, rejected.tier, rejected.step) == (0, "memory", 2)
    assert "digest mismatch" in rejected.reason
    assert {(e.rank, e.tier, e.step) for e in inventory.entries if e.rank == 0} == {(0, "memory", 1)}
    [holder_inventory] = cluster.payloads(CheckpointInventoryReported, node_id=holder.node_id)
    assert [(e.tier, e.step, e.digest) for e in holder_inventory.entries if e.rank == 0] == [
        ("peer", 2, sha(original))]

    [planned] = cluster.plans(1)
    assert planned.step == 2
    sources = {s.rank: s for s in planned.sources}
    assert (sources[0].tier, sources[0].node_id, sources[0].address, sources[0].digest) == (
        "peer", holder.node_id, holder.transport.address, sha(original))
    assert {r: (s.tier, s.node_id) for r, s in sources.items() if r != 0} == {1: ("memory", "B"), 2: ("memory", "C")}
    [fallback] = cluster.payloads(CheckpointTierFallback, generation=1)
    assert (fallback.rank, fallback.step, fallback.from_tier, fallback.to_tier) == (0, 2, "memory", "peer")
    assert "rejected its memory copy of rank 0 step 2" in fallback.reason and "digest mismatch" in fallback.reason

    # A fetches rank 0 from the holder's ShardStore (GetShard) and only then writes the plan.
    path = plan_file(a.agent_dir, 1)
    cluster.wait_for("A's plan file", path.exists)
    plan = json.loads(path.read_text())
    assert (plan["generation"], plan["step"]) == (1, 2)
    entry = plan["shards"]["0"]
    assert (entry["tier"], entry["format"], entry["digest"]) == ("peer", "shard", sha(original))
    assert "error" not in entry and entry["path"] == str(a.dir / "restore" / "g1" / "rank0.shard")
    fetched = Path(entry["path"]).read_bytes()
    assert sha(fetched) == entry["digest"] and fetched == original
    # The other ranks restore from their own slots.
    for node in (b, c):
        [rank] = node.ranks
        other = json.loads(plan_file(node.agent_dir, 1).read_text())
        assert other["step"] == 2 and list(other["shards"]) == [str(rank)]
        mine = other["shards"][str(rank)]
        assert (mine["tier"], mine["format"], mine["path"]) == ("memory", "slot", str(slot_path(node.dir, rank, 0)))
        assert mine["digest"] == sha(node.payloads[(rank, 2)])


def test_failed_peer_fetch_reports_a_job_fallback_and_writes_the_plan(cluster: Cluster) -> None:
    a, b, c = three_nodes(cluster)
    nodes = {n.node_id: n for n in (a, b, c)}
    holder = nodes[backed_up(cluster, 2)[0]]
    corrupt_every_local_copy(a.dir, 0, 2)
    # Every node reports its inventory; the holder of rank 0's backup dies right after reporting.
    others = [n for n in (a, b, c) if n is not holder]
    for node in [holder, *others]:
        node.groups, node.steps = {}, {}
        node.restart(1)
        if node is holder:
            node.kill_store()
        cluster.pump()
    [planned] = cluster.plans(1)
    assert {s.rank: s.node_id for s in planned.sources if s.tier == "peer"} == {0: holder.node_id}

    path = plan_file(a.agent_dir, 1)
    cluster.wait_for("A's plan file", path.exists)
    [event] = [e for e in cluster.events(CheckpointTierFallback) if e.producer == "agent"]
    assert event.subject == f"job/{JOB}"  # a job-level event (Event.create refuses node/...)
    fallback = event.payload
    assert (fallback.generation, fallback.rank, fallback.step, fallback.from_tier, fallback.to_tier) == (
        1, 0, 2, "peer", "none")
    assert "from its peer failed" in fallback.reason
    entry = json.loads(path.read_text())["shards"]["0"]
    assert entry["tier"] == "peer" and "from its peer failed" in entry["error"]
    assert not (a.dir / "restore" / "g1" / "rank0.shard").exists()


# -- 4. the persistent tier on the broker's schedule ------------------------------------------------------


def test_persistent_tier_every_k_steps(cluster: Cluster) -> None:
    root = cluster.base / "persist"
    a = cluster.add("A", [0, 1], 3, transport=False, persist_root=root)
    b = cluster.add("B", [2], 3, transport=False, persist_root=root)
    for node in (a, b):
        for rank in node.ranks:
            node.snapshot(rank, 3)
    schedule = Event.create(
        CheckpointScheduleSet(every_k_steps=2, save_cost_s=1.0, mtbf_s=3600.0, step_time_s=0.1, reason="test"),
        job_id=JOB, subject=f"job/{JOB}", producer="checkpoint-broker", occurred_at=datetime.now(UTC))
    cluster.wait_for("memory commit of step 3",
                     lambda: cluster.payloads(CheckpointStepCommitted, tier="memory", step=3))
    cluster.log.append(schedule)
    cluster.broadcast(schedule)
    assert a.ckpt.every_k_steps == b.ckpt.every_k_steps == 2

    cluster.settle(0.3)  # step 3 is not a multiple of K
    assert cluster.payloads(CheckpointShardsStored, tier="disk") == []
    assert not ckpt_disk.step_dir(root, JOB, 3).exists()

    for node in (a, b):
        for rank in node.ranks:
            node.snapshot(rank, 4)
    [commit] = cluster.wait_for("disk commit of step 4",
                                lambda: cluster.payloads(CheckpointStepCommitted, tier="disk", step=4))
    assert commit.ranks == 3 and commit.bytes == 3 * 64 * 1024
    for node in (a, b):
        [stored] = cluster.payloads(CheckpointShardsStored, node_id=node.node_id, tier="disk")
        assert [s.rank for s in stored.shards] == node.ranks
        for record in stored.shards:
            payload = node.payloads[(record.rank, 4)]
            assert (record.step, record.bytes, record.digest) == (4, len(payload), sha(payload))
            assert record.write_s > 0
            shard = ckpt_disk.shard_file(root, JOB, 4, record.rank)
            assert shard.is_file() and sha(shard.read_bytes()) == sha(payload)
    assert sorted(p.name for p in ckpt_disk.job_dir(root, JOB).iterdir()) == ["step-000000004"]
    assert not ckpt_disk.manifest_path(root, JOB, 4).exists()  # the broker adapter's job, not the node's
    # Not persisted twice.
    cluster.settle(0.2)
    assert len(cluster.payloads(CheckpointShardsStored, tier="disk")) == 2


# -- 5. unsupervised: a local plan ------------------------------------------------------------------------


def test_unsupervised_local_plan_takes_the_newest_step_every_rank_holds(cluster: Cluster) -> None:
    node = cluster.add("solo", [0, 1], 2, transport=False, supervised=False)
    for step in (7, 8):
        node.snapshot(0, step)
    for step in (6, 7):
        node.snapshot(1, step)

    node.restart(1)
    plan = json.loads(plan_file(node.agent_dir, 1).read_text())
    assert (plan["generation"], plan["step"]) == (1, 7)
    assert plan["shards"] == {
        str(rank): {"path": str(slot_path(node.dir, rank, 7 % 2)), "format": "slot",
                    "digest": sha(node.payloads[(rank, 7)]), "tier": "memory", "verified_by": "agent"}
        for rank in (0, 1)}
    assert node.ckpt.rank_env(1)["KEEL_RESTORE_PLAN"] == str(plan_file(node.agent_dir, 1))
    # Rank 0's step 8 belongs to the abandoned history: dropped before the plan, so a later restore can
    # never pair it with a step 8 the resumed run writes.
    assert not slot_path(node.dir, 0, 8 % 2).exists()
    assert slot_path(node.dir, 0, 7 % 2).exists() and slot_path(node.dir, 1, 6 % 2).exists()

    # Rank 0's step 7 rots: no step both ranks hold verified, so the next restart starts fresh.
    corrupt_payload_byte(slot_path(node.dir, 0, 7 % 2))
    node.restart(2)
    fresh = json.loads(plan_file(node.agent_dir, 2).read_text())
    assert (fresh["generation"], fresh["step"], fresh["shards"]) == (2, -1, {})
    cluster.pump()
    assert not [e for e in cluster.log if e.type == "CheckpointInventoryReported"], \
        "an unsupervised node plans alone: no inventory for a broker"


# -- after a restart: the new generation's snapshots replace the failed generation's backups --------------


def test_new_generation_backups_replace_the_failed_generations(cluster: Cluster) -> None:
    a, b, c = three_nodes(cluster)
    nodes = {n.node_id: n for n in (a, b, c)}
    holder = nodes[backed_up(cluster, 2)[0]]
    for node in (a, b, c):
        node.groups, node.steps = {}, {}
        node.restart(1)
        cluster.pump()
    [planned] = cluster.plans(1)
    assert planned.step == 2
    # Generation 1 runs again (say from step 1 of another source) and snapshots step 2 anew: the backup
    # held for rank 0 must become generation 1's (docs: the new generation's shards replace the old).
    for node in (a, b, c):
        [rank] = node.ranks
        node.groups = {rank: solo_groups(rank)}
    payload = a.snapshot(0, 2, generation=1)
    cluster.wait_for("A's registration for generation 1",
                     lambda: cluster.payloads(CheckpointRanksRegistered, node_id="A", generation=1))
    cluster.wait_for("generation 1's step 2 held for rank 0", lambda: [
        s for s in cluster.held(holder, 0, 2, "A") if s.digest == sha(payload)])
    [held] = [h for h in holder.transport.held_backups(verify=True)[0] if h["rank"] == 0]
    assert (held["step"], held["sha256"]) == (2, sha(payload))


# -- a backup peer whose agent restarted (a new store address) gets backups again --------------------------


def test_restarted_peer_with_a_new_address_gets_backups_again(cluster: Cluster) -> None:
    a = cluster.add("A", [0], 2)
    b = cluster.add("B", [1], 2)
    for node in (a, b):
        for step in (1, 2):
            node.snapshot(node.ranks[0], step)
    assert backed_up(cluster, 2) == {0: "B", 1: "A"}
    b.kill_store()
    payload = a.snapshot(0, 3)
    [failed] = cluster.wait_for("CheckpointBackupFailed", lambda: cluster.payloads(CheckpointBackupFailed))
    assert (failed.node_id, failed.rank, failed.backup_node_id) == ("A", 0, "B")
    cluster.settle(0.2)
    # No other node: the broker keeps rank 0 on B (nothing to announce) and A stops sending to it.
    assert [x.backup_node_id for p in cluster.placements() for x in p.assignments
            if x.rank == 0] == ["B"]
    assert a.ckpt.progress[0].send_failures == 3 and not a.ckpt.sending

    # B's agent comes back with a new shard store port and registers: the broker re-sends rank 0's
    # assignment with the new address, and A resumes backing rank 0 up there.
    b2 = cluster.restart("B")
    assert b2.transport.address != b.transport.address
    cluster.wait_for("rank 0's assignment with B's new address", lambda: [
        x for p in cluster.placements() for x in p.assignments
        if x.rank == 0 and x.backup_address == b2.transport.address])
    [record] = cluster.wait_for("B's new store holding rank 0 step 3", lambda: cluster.held(b2, 0, 3, "A"))
    assert record.digest == sha(payload)


def test_a_send_to_a_peer_that_never_answers_does_not_hold_the_rank_when_its_backup_moves(cluster: Cluster) -> None:
    """A backup peer cut off the network answers nothing (no reset, no refusal): a send to it hangs for
    the transfer timeout. When the broker moves the rank's backup elsewhere (the peer was evicted), the
    hung send is cancelled and the rank is backed up to its new peer at once, not a timeout later; the
    cancelled send counts as no failure against anyone."""
    import socket

    a = cluster.add("A", [0], 2, transfer_timeout=timedelta(seconds=60))
    c = cluster.add("C", [1], 2)
    for node in (a, c):
        for step in (1, 2):
            node.snapshot(node.ranks[0], step)
    assert backed_up(cluster, 2) == {0: "C", 1: "A"}
    live = a.ckpt.assignments[0]

    # A host that takes the connection into its backlog and then says nothing: the TLS handshake waits.
    black_hole = socket.socket()
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(8)
    try:
        silent_address = f"127.0.0.1:{black_hole.getsockname()[1]}"

        def assign(backup_node_id: str, address: str) -> None:
            a.ckpt.handle_event(Event.create(CheckpointNodeBackupsAssigned(
                node_id="A", reason="test", assignments=[live.model_copy(update={
                    "backup_node_id": backup_node_id, "backup_address": address})]),
                job_id=JOB, subject="node/A", producer="checkpoint-broker", occurred_at=datetime.now(UTC)))

        assign("X", silent_address)
        a.snapshot(0, 3)
        cluster.wait_for("a send of rank 0 to the silent peer", lambda: a.ckpt.sending.get(0, (0, ""))[1] == silent_address)
        cluster.settle(1.0)
        assert a.ckpt.sending[0][1] == silent_address and not a.ckpt.sending[0][2].done(), "still hanging"

        assign("C", live.backup_address)  # the broker moved rank 0's backup back to C
        started = time.monotonic()
        [record] = cluster.wait_for("C holding rank 0 step 3", lambda: cluster.held(c, 0, 3, "A"), timeout_s=15)
        assert time.monotonic() - started < 15
        assert record.digest == sha(a.payloads[(0, 3)])
        cluster.wait_for("A's send collected", lambda: a.ckpt.progress[0].last_sent_step == 3)
        assert a.ckpt.progress[0].send_failures == 0
        assert not cluster.payloads(CheckpointBackupFailed)
    finally:
        black_hole.close()


# -- report rounds: what the agent's heartbeat carries, and when it goes early --------------------------


def test_a_report_round_completes_once_when_every_local_send_and_every_held_backup_reached_it(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    from keel.agent import checkpointing

    monkeypatch.setattr(checkpointing, "ROUND_PEER_GRACE_S", 60.0)  # only the backups landing complete a round here
    nodes = three_nodes(cluster)
    backed_up(cluster, 2)
    period = timedelta(seconds=5)
    step_time = 2.5  # two steps a round (report_round_steps)

    def due(node: Node) -> bool:
        return node.ckpt.report_due(time.monotonic(), node.steps, step_time, period)

    for node in nodes:
        cluster.wait_for(f"{node.node_id}'s round of step 2", lambda node=node: due(node))
        assert not due(node), "a round completes once"
    for node in nodes:
        [rank] = node.ranks
        node.snapshot(rank, 3)
    cluster.settle(0.3)
    assert not any(due(node) for node in nodes), "step 3 is no round"
    for node in nodes:
        [rank] = node.ranks
        node.snapshot(rank, 4)
    for node in nodes:
        cluster.wait_for(f"{node.node_id}'s round of step 4", lambda node=node: due(node))
        # What its heartbeat then carries: its own rank's step 4, and the step-4 backup it holds.
        stored = node.ckpt.holdings()
        assert (node.ranks[0], 4) in {(s.rank, s.step) for s in stored["memory"]}
        assert 4 in {s.step for s in stored["peer"]}
        assert all(s.owner_node_id not in ("", node.node_id) for s in stored["peer"])
    cluster.wait_for("peer commit of step 4", lambda: cluster.payloads(CheckpointStepCommitted, tier="peer", step=4))


def test_without_a_peer_tier_a_round_is_the_newest_step_of_every_local_rank(cluster: Cluster) -> None:
    node = cluster.add("solo", [0, 1], 2, transport=False)
    period = timedelta(seconds=1)

    def due() -> bool:
        return node.ckpt.report_due(time.monotonic(), node.steps, 0.25, period)  # 4 steps a round

    assert not node.ckpt.report_due(time.monotonic(), node.steps, None, period), "no step time: no round"
    node.snapshot(0, 1)
    node.snapshot(1, 1)
    assert due(), "step 0 is a round (a multiple of every interval)"
    for step in (2, 3):
        node.snapshot(0, step)
        node.snapshot(1, step)
        assert not due()
    node.snapshot(0, 4)
    assert not due(), "rank 1 has not reached the round"
    node.snapshot(1, 4)
    assert due() and not due()
    # The heartbeat carries each rank's newest round step only (the ring also holds step 3).
    assert {(s.rank, s.step) for s in node.ckpt.holdings()["memory"]} == {(0, 4), (1, 4)}
    node.snapshot(0, 5)
    node.snapshot(1, 5)
    assert not due()
    assert {(s.rank, s.step) for s in node.ckpt.holdings()["memory"]} == {(0, 4), (1, 4)}
    # A restart may resume from an older step: its rounds are new.
    node.ckpt.prepare_restart(generation=1)
    assert node.ckpt.reported_round == -1


# -- a job that shrank (the controller's shrink instead of stop) ----------------------------------------------


def test_a_shrunk_job_stages_every_saved_ranks_shard_on_every_node(cluster: Cluster) -> None:
    """C is lost with no standby: A and B go on as a world of 2. Each reports the slots of the ranks it ran and the
    new size; the broker plans every saved rank's source; each node stages all three shards (its own slot, the
    other survivor's slot fetched from its store, the lost rank's backup), byte for byte what the ranks wrote."""
    a, b, c = three_nodes(cluster)
    backup = backed_up(cluster, 2)
    c.kill_store()
    stale = a.ckpt.node_dir / "restore" / "g0" / "rank9.shard"  # an older restart's staged copy
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"old")
    for node, new_rank in ((a, 0), (b, 1)):
        node.groups, node.steps = {}, {}
        node.ckpt.reshape([new_rank], 2)
        node.restart(1)
        cluster.pump()
    inventories = {i.node_id: i for i in cluster.payloads(CheckpointInventoryReported, generation=1)}
    assert {n: (i.ranks, i.world_size) for n, i in inventories.items()} == {"A": ([0], 2), "B": ([1], 2)}
    assert {(e.rank, e.step) for e in inventories["B"].entries if e.tier == "memory"} >= {(1, 2)}, \
        "B lists the slots of the rank it ran, which it no longer runs"
    [planned] = cluster.plans(1)
    assert planned.step == 2 and planned.reshard_from == 3 and planned.node_parts == 0
    assert {s.rank: (s.tier, s.node_id) for s in planned.sources} == {
        0: ("memory", "A"), 1: ("memory", "B"), 2: ("peer", backup[2])}
    for node in (a, b):
        path = plan_file(node.agent_dir, 1)
        cluster.wait_for(f"{node.node_id}'s plan file", path.exists)
        plan = json.loads(path.read_text())
        assert plan["step"] == 2 and plan["shards"] == {} and plan["reshard"]["world_size"] == 3
        staged = plan["reshard"]["shards"]
        assert sorted(staged) == ["0", "1", "2"] and not [e for e in staged.values() if e.get("error")]
        owners = {0: a, 1: b, 2: c}
        for rank, entry in staged.items():
            owner = owners[int(rank)]
            data = Path(entry["path"]).read_bytes()
            if entry["format"] == "slot":
                assert owner is node, "only a node's own slots are read in place"
                data = read_payload(Path(entry["path"]), verify=True)[1]
            assert data == owner.payloads[(int(rank), 2)], (node.node_id, rank, entry)
    # The lost rank's backup, held by one survivor, is staged as a link of its own: the store renaming or
    # dropping its copies afterwards (a newer backup discarded, the next round's rotation) cannot pull it from
    # under the rank that reads it (seen end to end: a discarded newer backup moved the older one away).
    assert not stale.parent.exists(), "an older generation's staged shards are dropped when a new plan starts"
    holder = {"A": a, "B": b}[backup[2]]
    entry = json.loads(plan_file(holder.agent_dir, 1).read_text())["reshard"]["shards"]["2"]
    assert entry["tier"] == "peer" and "/restore/g1/" in entry["path"], entry
    assert holder.ckpt.transport is not None
    holder.ckpt.transport.discard_backup(2)
    assert Path(entry["path"]).read_bytes() == c.payloads[(2, 2)]

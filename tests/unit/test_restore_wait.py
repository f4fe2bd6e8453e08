"""The restore wait's race, as an ordering of events (the broker is a pure decider).

A node is lost (rung 1): the controller evicts it, promotes a standby into its slice and restarts the
survivors in place. The standby has no ranks to stop: its inventory arrives at once and starts the
broker's wait (``restore_plan_timeout``). The survivors first stop their ranks (up to a 5 s grace) and
hash their slots on a busy thread pool; on a loaded machine their inventories can come after the wait
ran out. Planned then, the lost rank's only copy is the backup on a survivor that has not reported, and
the plan fell back to an old persisted step (disk step 10 instead of the peer-committed step 17: the
rung-1 ladder scenario, about 1 run in 7). The newest step committed in a tier that every rank can be
restored from must win: while a node that is not known lost has not reported and planning without it
would restore a step older than the newest memory or peer commit, the broker waits longer (up to
``restore_plan_max_wait``), and says so.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from keel.checkpoint_broker.decider import CheckpointBrokerDecider
from keel.checkpoint_broker.state import BrokerPolicy
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CheckpointInventoryReported,
    CheckpointNodeRestorePlanned,
    CheckpointPersisted,
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CheckpointShardsStored,
    CheckpointStepCommitted,
    InventoryEntry,
    NodeEvictionDecided,
    RankGroups,
    ShardRecord,
    TimerTicked,
)
from keel.kernel.decider import DeciderSession

T0 = datetime(2026, 11, 29, 7, 0, tzinfo=UTC)
JOB = "ladder"
NODES = ["n00", "n01", "n02", "n03"]  # rank r on NODES[r]; n01 is lost, s00 takes rank 1 over
LOST, STANDBY = "n01", "s00"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ev(payload: EventPayload, subject: str, seconds: float, producer: str = "agent") -> Event:
    return Event.create(payload, job_id=JOB, subject=subject, producer=producer, occurred_at=at(seconds))


def digest(rank: int, step: int) -> str:
    return f"{rank:02d}{step:062d}"


def record(rank: int, step: int, owner: str = "") -> ShardRecord:
    return ShardRecord(rank=rank, step=step, bytes=100, digest=digest(rank, step), owner_node_id=owner)


def tick(seconds: float) -> Event:
    return ev(TimerTicked(now=at(seconds)), "clock/ladder", seconds, producer="clock")


def inventory(node: str, seconds: float, memory: dict[int, list[int]], peer: dict[int, list[int]],
              ranks: list[int]) -> Event:
    entries = [InventoryEntry(rank=r, tier=tier, step=s, bytes=100, digest=digest(r, s))  # type: ignore[arg-type]
               for tier, held in (("memory", memory), ("peer", peer)) for r, steps in held.items() for s in steps]
    return ev(CheckpointInventoryReported(node_id=node, generation=1, entries=entries, rejected=[], ranks=ranks),
              f"node/{node}", seconds)


def history(policy: BrokerPolicy | None = None) -> tuple[DeciderSession, dict[int, str]]:
    """Generation 0 up to the loss: registered (DP 2 x PP 2, one rank per node), step 10 persisted,
    step 17 committed in memory and on the peer tier; then n01 evicted. Returns the session and each
    rank's backup holder."""
    session = DeciderSession(CheckpointBrokerDecider(policy))
    for r, node in enumerate(NODES):
        d, p = divmod(r, 2)
        groups = RankGroups(rank=r, dp=[p, 2 + p], pp=[2 * d, 2 * d + 1], tp=[r])
        session.observe(ev(CheckpointRanksRegistered(node_id=node, generation=0, world_size=4,
                                                     store_address=f"{node}:7301", ranks=[groups]), f"node/{node}", 0))
    holder = {r: a.backup_node_id for r, a in session.state.job(JOB).backups.items()}
    assert sorted(holder) == [0, 1, 2, 3]
    committed = []
    for r, node in enumerate(NODES):
        committed += session.observe(ev(CheckpointShardsStored(node_id=node, tier="disk", shards=[record(r, 10)]),
                                        f"node/{node}", 2)).emitted
    session.observe(ev(CheckpointPersisted(step=10, path=f"/p/{JOB}/step-000000010/manifest.json", manifest_digest="m",
                                           bytes=400, save_cost_s=0.1), f"job/{JOB}", 3, producer="checkpoint-persister"))
    for r, node in enumerate(NODES):
        committed += session.observe(ev(CheckpointShardsStored(node_id=node, tier="memory", shards=[record(r, 17)]),
                                        f"node/{node}", 4)).emitted
    for node in NODES:
        held = [record(r, 17, owner=NODES[r]) for r, h in holder.items() if h == node]
        committed += session.observe(ev(CheckpointShardsStored(node_id=node, tier="peer", shards=held),
                                        f"node/{node}", 4.5)).emitted
    assert {(e.payload.tier, e.payload.step) for e in committed if isinstance(e.payload, CheckpointStepCommitted)} == {
        ("disk", 10), ("memory", 17), ("peer", 17)}
    session.observe(ev(NodeEvictionDecided(node_id=LOST, rung=1, reason="xid 79", expires_at=at(60)),
                       f"node/{LOST}", 5, producer="controller"))
    return session, holder


def survivors(holder: dict[int, str], seconds: float) -> list[Event]:
    """The survivors' inventories: their rings hold steps 19 and 20, their sent copies step 17, and each
    holds the backups of step 17 it was assigned (rank 1's among them)."""
    return [inventory(node, seconds, memory={r: [17, 19, 20]},
                      peer={o: [17] for o, h in holder.items() if h == node}, ranks=[r])
            for r, node in enumerate(NODES) if node != LOST]


def plan_of(session: DeciderSession, events: list[Event]) -> tuple[CheckpointRestorePlanned | None, dict[int, tuple[str, str]], list[str]]:
    """The plan the events led to (None: none yet), each rank's (tier, node) and the decisions' reasons."""
    plans, sources, reasons = [], {}, []
    for event in events:
        result = session.observe(event)
        if result.decision is not None:
            reasons.append(result.decision.reason)
        for produced in result.emitted:
            if isinstance(produced.payload, CheckpointRestorePlanned):
                plans.append(produced.payload)
            elif isinstance(produced.payload, CheckpointNodeRestorePlanned):
                sources.update({s.rank: (s.tier, s.node_id) for s in produced.payload.sources})
    assert len(plans) <= 1
    return (plans[0] if plans else None), sources, reasons


def test_late_survivors_are_waited_for_when_planning_without_them_would_lose_committed_steps() -> None:
    session, holder = history()
    # The standby answers at once (nothing to stop, nothing held); the wait's deadline is 10 s later.
    promoted = inventory(STANDBY, 100, memory={}, peer={}, ranks=[1])
    plan, _, reasons = plan_of(session, [promoted, tick(105), tick(110.5), tick(115)])
    # Past the deadline the survivors (not known lost) have not reported; without them rank 1's only
    # copy would be disk step 10, older than step 17 committed on the peer tier: the broker waits.
    assert plan is None, plan
    assert "waiting longer" in reasons[-1] and "step 17" in reasons[-1] and "n00" in reasons[-1], reasons[-1]
    # The survivors' inventories arrive 12 s after the standby's, rank 1's backup holder last (until it
    # reports, rank 1 has no copy of step 17): step 17 for every rank, rank 1 from the backup its holder
    # kept, the others from their own memory.
    arrivals = sorted(survivors(holder, 112), key=lambda e: e.payload.node_id == holder[1])
    plan, _, reasons = plan_of(session, arrivals[:-1])
    assert plan is None and all("waiting longer" in r for r in reasons), reasons
    plan, sources, _ = plan_of(session, arrivals[-1:])
    assert plan is not None and plan.step == 17, plan
    assert "inventories from all 4 node(s) arrived" in plan.reason
    assert sources == {0: ("memory", "n00"), 1: ("peer", holder[1]), 2: ("memory", "n02"), 3: ("memory", "n03")}


def test_the_longer_wait_ends_too_and_plans_with_what_arrived() -> None:
    session, _ = history()
    promoted = inventory(STANDBY, 100, memory={}, peer={}, ranks=[1])
    plan, _, _ = plan_of(session, [promoted, tick(110.5), tick(130)])
    assert plan is None
    plan, sources, _ = plan_of(session, [tick(160.5)])  # restore_plan_max_wait (60 s) after the standby's report
    assert plan is not None and plan.step == 10 and set(sources.values()) == {("disk", "")}
    assert "absent: n00, n02, n03" in plan.reason


def test_no_longer_wait_when_planning_now_loses_nothing() -> None:
    """Every node but one answered and the plan reaches the newest commit anyway: planned at the deadline."""
    session, holder = history()
    late = next(node for node in NODES if node not in (LOST, holder[1]))
    arrived = [e for e in survivors(holder, 101) if e.payload.node_id != late]
    # The late node's rank restores from the backup of step 17 that another node holds.
    plan, sources, _ = plan_of(session, [inventory(STANDBY, 100, memory={}, peer={}, ranks=[1]), *arrived, tick(110.5)])
    assert plan is not None and plan.step == 17
    assert sources[NODES.index(late)][0] == "peer"


def test_no_longer_wait_for_a_node_known_lost() -> None:
    """The standby never answers but its node is being evicted: nothing to wait for."""
    session, holder = history()
    session.observe(ev(NodeEvictionDecided(node_id=STANDBY, rung=1, reason="lost too", expires_at=at(200)),
                       f"node/{STANDBY}", 101, producer="controller"))
    plan, _, _ = plan_of(session, [*survivors(holder, 101), tick(111.5)])
    assert plan is not None and plan.step == 17  # rank 1 from its backup: its own node is not needed

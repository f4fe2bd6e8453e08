"""The broker's restore plan for a job that shrank (the controller's shrink instead of stop), pure."""

from __future__ import annotations

from datetime import timedelta

from keel.events.types import (
    CheckpointInventoryReported,
    CheckpointRanksRegistered,
    InventoryEntry,
    NodeEvicted,
    RankGroups,
    TimerTicked,
)

from .test_checkpoint_broker import T0, digest, ev, plan_events, registered_session, shards, topology


def shrunk_inventory(node: str, memory: dict[int, list[int]], peer: dict[int, list[int]], ranks: list[int],
                     world_size: int, at=T0):  # noqa: ANN001, ANN201 - a test helper
    entries = [InventoryEntry(rank=r, tier=tier, step=s, bytes=100, digest=digest(r, s))  # type: ignore[arg-type]
               for tier, held in (("memory", memory), ("peer", peer)) for r, steps in held.items() for s in steps]
    return ev(CheckpointInventoryReported(node_id=node, generation=1, entries=entries, ranks=ranks,
                                          world_size=world_size), f"node/{node}", at)


def test_a_shrunk_job_stages_every_saved_rank_on_every_node_from_memory_and_peers() -> None:
    sites = topology(4, 1, 1, 4)  # one rank per node, n0..n3
    session = registered_session(sites)
    backup = {r: a.backup_node_id for r, a in session.state.job("job1").backups.items()}
    session.observe(shards("n1", "memory", [(1, 41)]))
    session.observe(ev(NodeEvicted(node_id="n1", decision_id="d", actuator="local", outcome="evicted"), "node/n1"))
    survivors = {"n0": 0, "n2": 1, "n3": 2}  # new node ranks, one rank each: world 3
    events = [shrunk_inventory(node, memory={old: [40, 41]},
                               peer={1: [40, 41]} if backup[1] == node else {}, ranks=[new], world_size=3)
              for node, (old, new) in zip(survivors, [(0, 0), (2, 1), (3, 2)], strict=True)]
    plan, _ = plan_events(session, events[:2])
    assert plan is None, "the node of new rank 2 has not reported yet"
    plan, fallbacks = plan_events(session, events[2:])
    assert plan is not None and plan.step == 41 and plan.reshard_from == 4 and plan.node_parts == 0
    by_rank = {s.rank: (s.tier, s.node_id, s.address) for s in plan.sources}
    assert by_rank == {0: ("memory", "n0", "n0:7301"), 1: ("peer", backup[1], f"{backup[1]}:7301"),
                       2: ("memory", "n2", "n2:7301"), 3: ("memory", "n3", "n3:7301")}
    assert "shrank from 4 to 3 ranks" in plan.reason and "every node stages step 41 of all 4 saved ranks" in plan.reason
    assert [f.rank for f in fallbacks] == [1]
    # The new generation registers at its new size: the ranks past it are gone from the broker's view.
    for node, new in survivors.items():
        session.observe(ev(CheckpointRanksRegistered(node_id=node, generation=1, world_size=3,
                                                     store_address=f"{node}:7301",
                                                     ranks=[RankGroups(rank=new, dp=[0, 1, 2], pp=[new], tp=[new])]),
                           f"node/{node}"))
    job = session.state.job("job1")
    assert job.world_size == 3 and sorted(job.sites) == [0, 1, 2]


def test_a_shrunk_job_with_a_saved_rank_held_nowhere_starts_fresh_and_says_so() -> None:
    sites = topology(2, 1, 1, 2)
    session = registered_session(sites)
    session.observe(ev(NodeEvicted(node_id="n1", decision_id="d", actuator="local", outcome="evicted"), "node/n1"))
    inventory = shrunk_inventory("n0", memory={0: [40]}, peer={}, ranks=[0], world_size=1)
    plan, _ = plan_events(session, [inventory])
    assert plan is not None and plan.step == -1 and plan.reshard_from == 0
    assert "shrank from 2 to 1 ranks" in plan.reason and "start fresh" in plan.reason


def test_a_shrunk_job_plans_without_a_silent_node_after_the_wait() -> None:
    sites = topology(3, 1, 1, 3)
    session = registered_session(sites)
    backup = {r: a.backup_node_id for r, a in session.state.job("job1").backups.items()}
    first = shrunk_inventory("n0", memory={0: [40]}, peer={r: [40] for r, b in backup.items() if b == "n0"},
                             ranks=[0], world_size=2)
    plan, _ = plan_events(session, [first])
    assert plan is None
    late = T0 + timedelta(minutes=5)
    plan, _ = plan_events(session, [ev(TimerTicked(now=late, interval_s=5.0), "clock/job1", late, producer="clock")])
    assert plan is not None and "without the nodes of new ranks 1" in plan.reason

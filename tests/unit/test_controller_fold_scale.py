"""The controller's fold at fleet scale: what it costs per event must not grow with the machine count.

``evolve_job`` runs for every event of a job. A restart of a 1,200-machine job is 9,600 ``RankStarted``
events; a fold that scans every machine per rank started (or rebuilds each view field by field) makes one
restart cost seconds of controller time (the fleet simulator found both). These tests pin the semantics
the faster fold keeps, and bound its cost loosely enough for a loaded 2-core machine.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import UTC, datetime, timedelta

import pytest

from keel.controller import state as controller_state
from keel.controller.policy import ControllerPolicy
from keel.controller.state import JobView, NodeView, evolve_job, new_job
from keel.events.envelope import Event
from keel.events.types import NodeHeartbeat, RankStarted, TimerTicked
from keel.kernel.snapshot import decode_state, encode_state

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)


def started(node: str, rank: int, generation: int, world: int, at: datetime = T0) -> Event:
    return Event.create(RankStarted(node_id=node, rank=rank, local_rank=rank % 8, generation=generation,
                                    world_size=world, pid=1000 + rank),
                        job_id="job1", subject=f"rank/{rank}", producer="agent", occurred_at=at)


def test_replace_builds_what_dataclasses_replace_builds_and_refuses_an_unknown_field() -> None:
    view = NodeView("n1", ranks=frozenset({1, 2}), generation=3)
    fast = controller_state.replace(view, generation=4, standby=True)
    assert fast == dataclasses.replace(view, generation=4, standby=True)
    assert view.generation == 3, "the original is left as it was"
    job = new_job(ControllerPolicy())
    assert controller_state.replace(job, world_size=8) == dataclasses.replace(job, world_size=8)
    with pytest.raises(TypeError, match="no field 'generaton'"):
        controller_state.replace(view, generaton=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.generation = 5  # type: ignore[misc]  # still frozen


def test_a_rank_that_moves_to_another_node_leaves_its_old_node_and_one_restarted_in_place_stays() -> None:
    job = new_job(ControllerPolicy())
    for rank, node in ((0, "n0"), (1, "n0"), (2, "n1"), (3, "n1")):
        job = evolve_job(job, started(node, rank, 0, 4))
    # Generation 1: n0 restarts its ranks in place, a standby s0 takes n1's ranks 2 and 3 (a promotion).
    for rank, node in ((0, "n0"), (1, "n0"), (2, "s0"), (3, "s0")):
        job = evolve_job(job, started(node, rank, 1, 4, T0 + timedelta(minutes=1)))
    assert job.node("n0").ranks == {0, 1} and job.node("s0").ranks == {2, 3}
    assert job.node("n1").ranks == frozenset(), "the ranks that moved left their old node"
    # Generation 2: only rank 2 goes back to n1; s0 keeps rank 3.
    job = evolve_job(job, started("n1", 2, 2, 4, T0 + timedelta(minutes=2)))
    assert job.node("n1").ranks == {2} and job.node("s0").ranks == {3}
    holders = {rank: [n.node_id for n in job.nodes.values() if rank in n.ranks] for rank in range(4)}
    assert holders == {0: ["n0"], 1: ["n0"], 2: ["n1"], 3: ["s0"]}, "every rank held by exactly one node"


def test_a_restart_of_a_1200_machine_job_folds_in_a_fraction_of_the_time_a_scan_per_rank_took() -> None:
    machines, per_machine = 1200, 8
    world = machines * per_machine
    job: JobView = new_job(ControllerPolicy())
    for generation in (0, 1):
        at = T0 + timedelta(minutes=generation)
        events = [started(f"n{rank // per_machine:04d}", rank, generation, world, at) for rank in range(world)]
        began = time.perf_counter()
        for event in events:
            job = evolve_job(job, event)
        seconds = time.perf_counter() - began
    assert len(job.active) == machines and job.generation == 1
    # Measured 0.37 s here (2 cores) for the restart's 9,600 events; the fold that scanned every machine per
    # rank started took 4.2 s. The bound leaves room for a loaded CI machine and still catches that fold.
    assert seconds < 2.0, f"folding one restart of {machines} machines took {seconds:.2f} s"


def _heartbeat_round_s(machines: int) -> tuple[float, JobView]:
    """Fold a tick and then one heartbeat from each of ``machines`` machines (what a round of heartbeats
    between two ticks is on the recorded clock); the seconds the heartbeats took."""
    job: JobView = new_job(ControllerPolicy())
    job = evolve_job(job, Event.create(TimerTicked(now=T0, interval_s=5.0), job_id="job1", subject="clock/job1",
                                       producer="clock", occurred_at=T0))
    at = T0 + timedelta(seconds=1)
    events = [Event.create(NodeHeartbeat(node_id=f"n{i:05d}", ranks_alive=8, ranks_expected=8, last_step=10,
                                         generation=0), job_id="job1", subject=f"node/n{i:05d}", producer="agent",
                           occurred_at=at) for i in range(machines)]
    began = time.perf_counter()
    for event in events:
        job = evolve_job(job, event)
    return time.perf_counter() - began, job


def test_a_heartbeat_round_folds_in_time_linear_in_the_machines_heard() -> None:
    # Every agent event adds its node to ``JobView.heard`` (credited at the next tick). A plain dict copied per
    # event made a round of N heartbeats cost N^2 / 2 entry copies: 12,000 machines took 5 times as long as
    # 1,200 per heartbeat (24,000: 8-11 times). ``HeardMap`` copies one of its buckets.
    # The fastest of a few rounds each: a loaded machine slows some, never speeds one up.
    small_s = min(_heartbeat_round_s(1200)[0] for _ in range(5))
    large_s, job = min((_heartbeat_round_s(24000) for _ in range(2)), key=lambda r: r[0])
    assert len(job.heard) == 24000 and job.heard.get("n23999") == T0 + timedelta(seconds=1)
    per_event_ratio = (large_s / 24000) / (small_s / 1200)
    # Measured here (2 cores, loaded): 1.3-2.5x with HeardMap, 8-11x with the dict copied per event.
    assert per_event_ratio < 5.0, f"a heartbeat costs {per_event_ratio:.1f}x as much at 24,000 machines as at 1,200"
    assert large_s < 3.0, f"a round of 24,000 heartbeats took {large_s:.2f} s to fold"
    # The next tick credits every node heard, as with a plain dict.
    ticked = evolve_job(job, Event.create(TimerTicked(now=T0 + timedelta(seconds=5), interval_s=5.0), job_id="job1",
                                          subject="clock/job1", producer="clock", occurred_at=T0 + timedelta(seconds=5)))
    assert not ticked.heard and len(ticked.window_skews) == 24000


def test_heard_map_is_immutable_equal_to_a_dict_of_its_items_and_survives_a_snapshot() -> None:
    at = T0
    empty = controller_state.HeardMap()
    one = empty.set("n1", at)
    two = one.set("n2", at + timedelta(seconds=1)).set("n1", at + timedelta(seconds=2))
    assert len(empty) == 0 and not empty and dict(one) == {"n1": at}, "an older map is left as it was"
    assert two == {"n1": at + timedelta(seconds=2), "n2": at + timedelta(seconds=1)} and len(two) == 2
    assert {"n1": at + timedelta(seconds=2), "n2": at + timedelta(seconds=1)} == two and empty == {}
    assert two.get("n3") is None and "n2" in two and "n3" not in two
    assert controller_state.HeardMap.of({"n1": at}) == one and controller_state.HeardMap.of(one) is one
    decoded = decode_state(encode_state(two))
    assert decoded == two and decoded.get("n2") == at + timedelta(seconds=1)

"""A job-wide hang from the heartbeats: every rank of the job inside a collective at once for the floor
(``keel.controller.rules.all_blocked``), and none of what only looks like one (a data-loader stall, waits that
did not overlap, another generation's ranks, a standby)."""

from __future__ import annotations

from datetime import timedelta

from keel.controller.policy import ControllerPolicy
from keel.events.envelope import Event
from keel.events.types import NodeHeartbeat, RankCollective
from tests.unit.test_controller import Job, of


def blocked_heartbeat(job: Job, node: str, waits: dict[int, float], *, collective: str = "dp_all_reduce",
                      generation: int = 0, dt: float = 0.1) -> list[Event]:
    """``node``'s heartbeat with the given ranks inside ``collective`` for the given seconds (others outside)."""
    inside = {rank: RankCollective(collective=collective, waited_s=waited) for rank, waited in waits.items()}
    return job.feed(NodeHeartbeat(node_id=node, ranks_alive=job.per_node, ranks_expected=job.per_node, last_step=30,
                                  generation=generation, rank_collectives=inside), f"node/{node}", dt=dt)


def ranks_of(job: Job, node: str) -> list[int]:
    index = job.nodes.index(node)
    return [index * job.per_node + local for local in range(job.per_node)]


def test_every_rank_blocked_together_for_the_floor_is_a_hang_naming_who_waits_longest() -> None:
    job = Job()
    out: list[Event] = []
    # n1's ranks entered dp_all_reduce first (7.5 s ago) and the rest queued behind them a second later.
    for node in job.nodes:
        waits = {rank: (7.5 if node == "n1" else 6.2) for rank in ranks_of(job, node)}
        out = blocked_heartbeat(job, node, waits)
        if node != job.nodes[-1]:
            assert out == [], f"{node}: not every node has said so yet"
    assert [e.type for e in out] == ["IncidentOpened", "StacksRequested"]
    opened, request = out
    assert opened.payload.kind == "hang" and opened.payload.node_id == "n1"
    assert opened.payload.fingerprint == "hang/all_ranks_blocked"
    reason = request.payload.reason
    assert "rung 3" in reason and "every rank of the job (8 on 4 node(s))" in reason
    assert "Waiting longest: rank(s) 2, 3 in dp_all_reduce on n1" in reason
    # Once the incident is open, more of the same evidence is part of it.
    assert blocked_heartbeat(job, "n0", {0: 9.0, 1: 9.0}) == []


def test_a_data_loader_stall_is_no_hang() -> None:
    """Rank 5 loads data for 8 s: its peers wait inside the collective, it is outside one."""
    job = Job()
    for node in job.nodes:
        waits = {rank: 8.0 for rank in ranks_of(job, node) if rank != 5}
        assert blocked_heartbeat(job, node, waits) == []


def test_waits_that_did_not_overlap_for_the_floor_are_no_hang() -> None:
    job = Job()
    # n0..n2 had waited 6 s when they reported; n3 reports 1 s later, inside a collective for 3 s only: all
    # four were inside at once for 2 s at most.
    for node in job.nodes[:3]:
        assert blocked_heartbeat(job, node, {r: 6.0 for r in ranks_of(job, node)}, dt=0.0) == []
    assert blocked_heartbeat(job, "n3", {r: 3.0 for r in ranks_of(job, "n3")}, dt=1.0) == []
    # Blocked nodes report every second: 3 s on, n3 has been inside for 6 s, but n0..n2's newest heartbeats are
    # still those from before n3 entered plus 2 s of overlap, until they too report again.
    assert blocked_heartbeat(job, "n3", {r: 6.0 for r in ranks_of(job, "n3")}, dt=3.0) == []
    out: list[Event] = []
    for node in job.nodes[:3]:
        out += blocked_heartbeat(job, node, {r: 10.0 for r in ranks_of(job, node)}, dt=0.0)
    [opened] = of(out, "IncidentOpened")
    assert "at once for 6.0 s" in of(out, "StacksRequested")[0].payload.reason


def test_a_node_that_moved_on_clears_its_evidence() -> None:
    job = Job()
    for node in job.nodes[:3]:
        blocked_heartbeat(job, node, {r: 6.0 for r in ranks_of(job, node)})
    # n0 steps again (its ranks outside any collective), then n3 reports blocked: not everyone is.
    blocked_heartbeat(job, "n0", {})
    assert blocked_heartbeat(job, "n3", {r: 6.5 for r in ranks_of(job, "n3")}) == []


def test_another_generations_ranks_and_a_zero_floor_decide_nothing() -> None:
    job = Job()
    for node in job.nodes:
        assert blocked_heartbeat(job, node, {r: 9.0 for r in ranks_of(job, node)}, generation=1) == []
    off = Job(policy=ControllerPolicy(all_blocked_hang_after=timedelta(0)))
    for node in off.nodes:
        assert blocked_heartbeat(off, node, {r: 9.0 for r in ranks_of(off, node)}) == []

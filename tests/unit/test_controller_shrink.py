"""Shrink instead of stop: with no ready standby, the controller may go on with the nodes left (pure).

Drives the real ``ControllerDecider`` through ``test_controller.Job``, the harness of the ladder's tests.
"""

from __future__ import annotations

import pytest

from keel.controller.policy import ControllerPolicy
from keel.controller.shrink import Shrink, plan_shrink
from keel.controller.state import NodeView
from keel.events.types import CheckpointRestorePlanned, NodeEvicted, RanksRestartRequested, RankStarted
from keel.kernel.replay import verify

from .test_controller import Job, of, types

SHRINK = ControllerPolicy(shrink_without_standby=True)


def test_off_by_default_a_lost_node_without_a_standby_waits_for_the_pool() -> None:
    job = Job(standbys=0)
    out = job.health("n1")
    [held] = of(out, "ActionHeld")
    assert held.payload.guardrail == "no_standby" and "no shrink" not in held.payload.reason
    assert not of(out, "RanksRestartRequested")


def test_with_the_setting_on_the_nodes_left_restart_as_a_smaller_job_with_new_node_ranks() -> None:
    job = Job(nodes=4, per_node=2, standbys=0, policy=SHRINK)
    out = job.health("n1")
    assert types(out)[:3] == ["IncidentOpened", "NodeEvictionDecided", "RestartDecided"]
    assert not of(out, "ActionHeld"), "nothing waits for the pool"
    [restart] = of(out, "RestartDecided")
    assert restart.payload.world_size == 6 and restart.payload.evict == ["n1"] and restart.payload.promotions == []
    assert restart.payload.restart_nodes == ["n0", "n2", "n3"]
    assert "shrink from 8 to 6 ranks on 3 node(s)" in restart.payload.reason
    assert "shrink_without_standby" in restart.payload.reason
    commands = {e.payload.node_id: e.payload for e in of(out, "RanksRestartRequested")}
    assert {n: (c.node_rank, c.nnodes) for n, c in commands.items()} == {"n0": (0, 3), "n2": (1, 3), "n3": (2, 3)}
    assert all(c.generation == 1 for c in commands.values())
    # The new, smaller generation starts and steps: the incident is recovered and the job's size is 6 ranks.
    for node_rank, node in enumerate(["n0", "n2", "n3"]):
        for local in range(2):
            job.feed(RankStarted(node_id=node, rank=node_rank * 2 + local, local_rank=local, world_size=6, pid=300,
                                 generation=1), f"rank/{node_rank}")
    job.feed(NodeEvicted(node_id="n1", decision_id=str(of(out, "NodeEvictionDecided")[0].id), actuator="local",
                         outcome="evicted"), "node/n1", producer="actuator")
    job.feed(CheckpointRestorePlanned(generation=1, step=18, reason="plan", reshard_from=8), "job/job1",
             producer="checkpoint-broker")
    job.nodes = ["n0", "n2", "n3"]
    [resolved] = of(job.heartbeats(step=19, nodes=["n0"]), "IncidentResolved")
    assert resolved.payload.outcome == "recovered"
    state = job.session.state.job("job1")
    assert state.world_size == 6
    assert sorted(state.node("n2").ranks) == [2, 3] and sorted(state.node("n3").ranks) == [4, 5]
    report = verify(job.decider, job.log)
    assert report.clean, [d.describe() for d in report.divergences]


def test_a_shrink_that_would_break_the_node_multiple_waits_and_says_why() -> None:
    job = Job(nodes=4, per_node=2, standbys=0, policy=ControllerPolicy(shrink_without_standby=True,
                                                                      shrink_node_multiple=2))
    out = job.health("n1")
    [held] = of(out, "ActionHeld")
    assert held.payload.guardrail == "no_standby"
    assert "no shrink: 3 node(s) would stay, not a multiple of shrink_node_multiple 2" in held.payload.reason
    assert not of(out, "RanksRestartRequested")


def test_a_shrink_below_the_floor_waits() -> None:
    job = Job(nodes=2, per_node=2, standbys=0, policy=ControllerPolicy(shrink_without_standby=True, shrink_min_nodes=2))
    [held] = of(job.health("n0"), "ActionHeld")
    assert "fewer than shrink_min_nodes 2" in held.payload.reason


def test_a_ready_standby_is_still_promoted_rather_than_shrinking() -> None:
    job = Job(nodes=4, per_node=2, standbys=1, policy=SHRINK)
    [restart] = of(job.health("n1"), "RestartDecided")
    assert restart.payload.world_size == 0 and [p.standby_node_id for p in restart.payload.promotions] == ["s0"]


def test_losing_node_rank_0_makes_the_next_node_rank_0() -> None:
    job = Job(nodes=3, per_node=2, standbys=0, policy=SHRINK)
    out = job.health("n0")
    commands = {e.payload.node_id: e.payload for e in of(out, "RanksRestartRequested")}
    assert {n: c.node_rank for n, c in commands.items()} == {"n1": 0, "n2": 1}


def _node(node_id: str, ranks: set[int]) -> NodeView:
    return NodeView(node_id=node_id, ranks=frozenset(ranks))


def test_plan_shrink_orders_nodes_by_their_old_ranks_and_refuses_uneven_slices() -> None:
    shrink = plan_shrink([_node("b", {4, 5}), _node("a", {2, 3})], [_node("c", {0, 1})], min_nodes=1, node_multiple=1)
    assert isinstance(shrink, Shrink)
    assert shrink.nodes == ("a", "b") and shrink.world_size == 4 and shrink.old_world_size == 6
    assert shrink.node_rank("b") == 1
    refused = plan_shrink([_node("a", {0, 1}), _node("b", {2})], [_node("c", {3, 4})], min_nodes=1, node_multiple=1)
    assert isinstance(refused, str) and "unequal numbers of ranks" in refused
    assert plan_shrink([], [_node("c", {0})], min_nodes=1, node_multiple=1) == "no node would stay"


def test_the_restart_command_refuses_half_a_layout() -> None:
    with pytest.raises(ValueError, match="both set"):
        RanksRestartRequested(node_id="n0", generation=1, reason="r", expires_at="2026-12-01T00:00:00Z", nnodes=3)
    with pytest.raises(ValueError, match="both set"):
        RanksRestartRequested(node_id="n0", generation=1, reason="r", expires_at="2026-12-01T00:00:00Z", nnodes=2,
                              node_rank=2)


def test_policy_refuses_a_zero_floor() -> None:
    with pytest.raises(ValueError, match="shrink_min_nodes"):
        ControllerPolicy(shrink_min_nodes=0)

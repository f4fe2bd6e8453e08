"""The node agent fenced out of its job (``keel.agent.fencing``), with real rank processes and no NATS (the
outbox never connects: what the agent emitted waits in ``outbox.pending``)."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path

import pytest

from keel.agent.agent import NodeAgent
from keel.agent.fencing import FENCE_FILE, FENCED_EXIT
from keel.events.envelope import now_utc
from keel.events.types import CheckpointRestorePlanned, NodeEvictionDecided, RanksRestartRequested
from tests.integration.test_agent_ladder_commands import agents, command, emitted, make_agent

pytestmark = pytest.mark.integration
__all__ = ["agents"]  # the fixture


def eviction(node: str = "n00", observe_only: bool = False) -> object:
    return command(NodeEvictionDecided(node_id=node, rung=1, reason="silent for 30 s", observe_only=observe_only,
                                       expires_at=now_utc() - timedelta(hours=1)), f"node/{node}")


def test_an_evicted_agent_stops_its_ranks_reports_nothing_more_and_leaves(agents: list[NodeAgent],
                                                                          scratch_dir: Path) -> None:
    agent = make_agent(scratch_dir, nproc=2, gpus=2)
    agents.append(agent)
    agent.start_ranks(0)
    pids = [p.pid for p in agent.supervisor.alive()]
    assert len(pids) == 2
    # Another node's eviction, or an observe-only one, fences nothing.
    assert not agent.check_fence(eviction("n01")) and not agent.check_fence(eviction(observe_only=True))
    assert [p.pid for p in agent.supervisor.alive()] == pids
    # Its own eviction, long expired (the host was frozen for an hour): fenced all the same.
    decided = eviction()
    assert agent.check_fence(decided)
    assert not agent.supervisor.ranks
    assert {e.payload.classification for e in emitted(agent, "RankExited")} == {"stopped_by_agent"}
    fence = json.loads((scratch_dir / "n00" / FENCE_FILE).read_text())
    assert (fence["job_id"], fence["node_id"], fence["decision_id"]) == ("job", "n00", str(decided.id))
    assert oct((scratch_dir / "n00" / FENCE_FILE).stat().st_mode & 0o777) == "0o600"
    beats = len(emitted(agent, "NodeHeartbeat"))
    result = agent.tick(probe=False)
    assert result is not None and result.exit_code == FENCED_EXIT and "fenced out of job job" in result.reason
    agent.heartbeat(now_utc())
    assert len(emitted(agent, "NodeHeartbeat")) == beats, "a fenced node sends no heartbeat"
    # A restart command after the fence starts nothing.
    agent.handle_command(command(RanksRestartRequested(node_id="n00", generation=1, reason="x",
                                                       expires_at=now_utc() + timedelta(minutes=1)), "node/n00"))
    assert not agent.supervisor.ranks and not emitted(agent, "RanksRestarted")


def test_a_newer_generations_plan_stops_the_stale_ranks_and_the_agent_waits(agents: list[NodeAgent],
                                                                            scratch_dir: Path) -> None:
    agent = make_agent(scratch_dir)
    agents.append(agent)
    agent.start_ranks(0)
    assert not agent.check_fence(command(CheckpointRestorePlanned(generation=0, step=5, reason="plan"), "job/job"))
    assert agent.supervisor.alive()
    assert not agent.check_fence(command(CheckpointRestorePlanned(generation=2, step=5, reason="plan"), "job/job"))
    assert not agent.supervisor.ranks and agent.held and agent.fence is None
    assert agent.tick(probe=False) is None, "left behind, the agent waits for a command"


def test_keel_run_refuses_to_start_as_a_worker_where_its_node_was_fenced(scratch_dir: Path) -> None:
    (scratch_dir / "n00").mkdir(parents=True)
    (scratch_dir / "n00" / FENCE_FILE).write_text(json.dumps(
        {"job_id": "job", "node_id": "n00", "generation": 3, "decision_id": "d", "reason": "evicted: silent"}))
    agent = make_agent(scratch_dir)
    try:
        result = asyncio.run(agent.run(asyncio.Event()))
    finally:
        agent.channel.close()
    assert result.exit_code == FENCED_EXIT and "--keel-standby" in result.reason, result
    assert not agent.supervisor.ranks and not emitted(agent, "NodeRegistered")

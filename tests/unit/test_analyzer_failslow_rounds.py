"""Fail-slow rounds in the analyzer's decider: compute times from heartbeats, compared within DP groups
(ranks doing the same work), one round per interval on the recorded clock, a conviction once a node is
flagged most over the last rounds, and counting afresh after it."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from keel.analyzer.core import AnalyzerDecider
from keel.analyzer.failslow_rounds import FailSlowPolicy
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CLOCK_PRODUCER,
    CheckpointRanksRegistered,
    FailSlowConvicted,
    NodeHeartbeat,
    RankGroups,
    TimerTicked,
)
from keel.kernel.decider import DeciderSession

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
POLICY = FailSlowPolicy(interval=timedelta(seconds=10), rounds=5, min_flags=2)


class Job:
    """Four nodes; ``ranks_per_node`` ranks each; rank r's DP group holds the ranks of its PP stage."""

    def __init__(self, *, pp: int = 1, seed: int = 1) -> None:
        self.session = DeciderSession(AnalyzerDecider(POLICY))
        self.rng = random.Random(seed)
        self.now = T0
        self.nodes = {f"n{i}": [i * pp + s for s in range(pp)] for i in range(4)}
        self.pp = pp
        for node, ranks in self.nodes.items():
            self.feed(CheckpointRanksRegistered(node_id=node, generation=0, world_size=4 * pp, store_address="", ranks=[
                RankGroups(rank=r, dp=[n * pp + r % pp for n in range(4)], pp=ranks, tp=[r]) for r in ranks]),
                f"node/{node}")

    def feed(self, payload: EventPayload, subject: str, producer: str = "node-agent") -> list[Event]:
        event = Event.create(payload, job_id="j", subject=subject, producer=producer, occurred_at=self.now)
        return list(self.session.observe(event).emitted)

    def interval(self, slow: dict[str, float], *, stage_cost: float = 0.0) -> list[Event]:
        """Heartbeats every 2 s for one interval (compute times ~0.1 s, jittered; stage s costs
        ``stage_cost * s`` more), then the controller's ticks; returns what the analyzer emitted."""
        emitted: list[Event] = []
        for _ in range(5):
            self.now += timedelta(seconds=2)
            for node, ranks in self.nodes.items():
                compute = {r: (0.1 + stage_cost * (r % self.pp)) * (1 + self.rng.uniform(-0.02, 0.02))
                           * (1 + slow.get(node, 0.0)) for r in ranks}
                self.feed(NodeHeartbeat(node_id=node, ranks_alive=len(ranks), ranks_expected=len(ranks),
                                        rank_compute_time_p50_s=compute), f"node/{node}")
            emitted += self.feed(TimerTicked(now=self.now), "clock/j", producer=CLOCK_PRODUCER)
        return [e for e in emitted if isinstance(e.payload, FailSlowConvicted)]


def test_a_node_30_percent_slower_is_convicted_after_five_rounds() -> None:
    job = Job()
    convictions = []
    for interval in range(5):
        convictions += job.interval({"n2": 0.3})
        if interval < 4:
            assert convictions == [], interval  # five rounds are needed
    [event] = convictions
    verdict = event.payload
    assert verdict.group_nodes == ["n2"] and verdict.group_kind == "node" and verdict.group_ranks == [2]
    assert (verdict.rounds, verdict.flags, verdict.interval_s) == (5, 5, 10.0)
    assert len(verdict.round_evidence) == 5 and "rank 2 (n2)" in verdict.round_evidence[-1]
    assert "flagged in 5 of the last 5 rounds" in verdict.reason
    # Counted afresh: the next conviction needs five new rounds.
    assert job.interval({"n2": 0.3}) == []


def test_healthy_jitter_convicts_nobody() -> None:
    job = Job(seed=7)
    assert [e for _ in range(12) for e in job.interval({})] == []


def test_a_heavier_pipeline_stage_is_not_a_slow_node_but_a_slow_node_within_its_stage_is() -> None:
    job = Job(pp=2)  # ranks 0, 2, 4, 6: stage 0; 1, 3, 5, 7: stage 1, 40 % heavier
    assert [e for _ in range(6) for e in job.interval({}, stage_cost=0.04)] == []
    convictions = [e for _ in range(6) for e in job.interval({"n1": 0.25}, stage_cost=0.04)]
    assert convictions and convictions[0].payload.group_nodes == ["n1"]
    assert convictions[0].payload.group_ranks == [2, 3]


def test_a_node_that_stops_reporting_is_not_judged_on_its_old_samples() -> None:
    job = Job()
    job.interval({"n3": 0.5})
    del job.nodes["n3"]  # its heartbeats stop (evicted, or its agent died)
    job.interval({})  # the round at the start of this interval still saw its last samples
    for _ in range(5):
        job.interval({})
        [latest] = job.session.state.failslow["j"].evidence[-1:]
        assert "(n3)" not in latest and "nothing flagged" in latest, latest

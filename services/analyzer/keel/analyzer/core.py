"""The analyzer's decider (pure): collect a capture round's stacks and judge it once (rung 3).

- ``StacksRequested`` (the controller's) opens a round: its nodes, and a deadline ``timeout_s`` after it.
- ``StacksCaptured`` (agents', possibly in parts) fills the round. When every node's every part is in,
  the round is judged; so it is on the first ``TimerTicked`` (the job clock, keel.infra.clock) past the
  deadline, with the nodes that did not answer listed as missing evidence.
- ``RankStarted`` events tell where each rank runs (and the world size): the ranks of a node that sent
  nothing are then known, and reported as missing evidence.
- The verdict is one ``StacksAnalyzed``: ``judge`` (``keel.analyzer.rung3``) turns the captures into the
  aggregation's inputs and its verdict into the event. A round is judged once: the verdict is folded
  back (it is this decider's own event) and closes the round.
- Rung 5 (``keel.rules.sdc_replay``): ``SdcReplayRequested`` (the controller's) opens a replay round;
  ``SdcReplayCompleted`` (agents') fill it; once every node answered, or on the first tick past its
  deadline, the round is judged with the earlier rounds of the same localisation (a request whose
  phases start at 1 starts a new one) and one ``SdcReplayAnalyzed`` says what it found.
- Fail-slow (``keel.analyzer.failslow_rounds``): ``NodeHeartbeat`` compute times and the ranks' DP
  groups (``CheckpointRanksRegistered``) are folded; every ``interval`` a ``TimerTicked`` takes a round,
  and the round that convicts a group emits one ``FailSlowConvicted``.
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from keel.analyzer.failslow_rounds import (
    FailSlowPolicy,
    JobFailSlow,
    conviction,
    observe_groups,
    observe_heartbeat,
    take_round,
)
from keel.analyzer.rung3 import judge
from keel.events.envelope import Event
from keel.events.types import (
    CheckpointRanksRegistered,
    FailSlowConvicted,
    NodeHeartbeat,
    RankStarted,
    SdcReplayAnalyzed,
    SdcReplayCompleted,
    SdcReplayRequested,
    StacksAnalyzed,
    StacksCaptured,
    StacksRequested,
    TimerTicked,
)
from keel.kernel.decider import Decision, Proposal
from keel.rules.sdc import PhaseResult
from keel.rules.sdc_replay import judge_round, phase_of, verdict_fields

NAME = "analyzer"


@dataclass(frozen=True)
class CaptureRound:
    request_id: str
    round: int
    nodes: frozenset[str]
    deadline: datetime
    correlation_id: uuid.UUID | None = None
    """The incident the request belongs to: the verdict carries it too."""
    parts: Mapping[str, Mapping[int, StacksCaptured]] = field(default_factory=dict)
    """node -> part index -> the part."""

    def complete(self) -> bool:
        return all(node in self.parts and len(self.parts[node]) >= next(iter(self.parts[node].values())).parts
                   for node in self.nodes)

    def captures(self) -> list[StacksCaptured]:
        return [part for node in sorted(self.parts) for _, part in sorted(self.parts[node].items())]

    def silent(self) -> list[str]:
        return sorted(n for n in self.nodes if n not in self.parts)


@dataclass(frozen=True)
class ReplayRound:
    """An open rung-5 replay round: the request and the nodes' answers so far."""

    request_id: str
    request: SdcReplayRequested
    deadline: datetime
    correlation_id: uuid.UUID | None = None
    answers: Mapping[str, SdcReplayCompleted] = field(default_factory=dict)

    def complete(self) -> bool:
        return all(node in self.answers for node in self.request.nodes)


@dataclass(frozen=True)
class Localising:
    """The judged phases of a job's current localisation, and the reference result it settled on."""

    results: tuple[PhaseResult, ...] = ()
    reference: str = ""


@dataclass(frozen=True)
class JobLayout:
    """Where each rank of a job runs now (its newest ``RankStarted``), and the job's world size."""

    world_size: int = 0
    rank_nodes: Mapping[int, tuple[int, str]] = field(default_factory=dict)
    """rank -> (generation, node)."""


@dataclass(frozen=True)
class AnalyzerState:
    rounds: Mapping[tuple[str, int], CaptureRound] = field(default_factory=dict)
    """(job, round) -> an open round (judged rounds are dropped)."""
    layouts: Mapping[str, JobLayout] = field(default_factory=dict)
    failslow: Mapping[str, JobFailSlow] = field(default_factory=dict)
    replays: Mapping[tuple[str, int], ReplayRound] = field(default_factory=dict)
    """(job, round) -> an open replay round (judged rounds are dropped)."""
    localising: Mapping[str, Localising] = field(default_factory=dict)


def _listed(names: Collection[str], limit: int = 8) -> str:
    """The first ``limit`` names (in order) and how many more. A round of 8,192 nodes once sorted and listed
    every node still missing in the reason of every part's decision: 15 s of a 65,536-rank round."""
    head = ", ".join(heapq.nsmallest(limit, names))
    return head if len(names) <= limit else f"{head} and {len(names) - limit} more"


class AnalyzerDecider:
    name = NAME

    def __init__(self, failslow: FailSlowPolicy | None = None) -> None:
        self.failslow = failslow or FailSlowPolicy()

    def initial_state(self) -> AnalyzerState:
        return AnalyzerState()

    def interested_in(self, event: Event) -> bool:
        return event.type in (StacksCaptured.event_name, TimerTicked.event_name, SdcReplayCompleted.event_name)

    def evolve(self, state: AnalyzerState, event: Event) -> AnalyzerState:
        p = event.payload
        if isinstance(p, RankStarted):
            layout = state.layouts.get(event.job_id, JobLayout())
            if layout.rank_nodes.get(p.rank, (-1, ""))[0] > p.generation:
                return state
            layout = JobLayout(max(layout.world_size, p.world_size), {**layout.rank_nodes, p.rank: (p.generation, p.node_id)})
            return replace(state, layouts={**state.layouts, event.job_id: layout})
        if isinstance(p, StacksRequested):
            opened = CaptureRound(str(event.id), p.round, frozenset(p.nodes),
                                  event.occurred_at + timedelta(seconds=p.timeout_s),
                                  correlation_id=event.correlation_id or event.id)
            return replace(state, rounds={**state.rounds, (event.job_id, p.round): opened})
        if isinstance(p, StacksCaptured):
            key = (event.job_id, p.round)
            current = state.rounds.get(key)
            if current is None or p.request_id != current.request_id or p.node_id not in current.nodes:
                return state
            parts = {**current.parts, p.node_id: {**current.parts.get(p.node_id, {}), p.part: p}}
            return replace(state, rounds={**state.rounds, key: replace(current, parts=parts)})
        if isinstance(p, StacksAnalyzed):
            return replace(state, rounds={k: v for k, v in state.rounds.items() if k != (event.job_id, p.round)})
        if isinstance(p, (SdcReplayRequested, SdcReplayCompleted, SdcReplayAnalyzed)):
            return self._evolve_replay(state, event)
        if isinstance(p, (NodeHeartbeat, CheckpointRanksRegistered, TimerTicked, FailSlowConvicted)):
            return self._evolve_failslow(state, event)
        return state

    def _evolve_replay(self, state: AnalyzerState, event: Event) -> AnalyzerState:
        p, job_id = event.payload, event.job_id
        if isinstance(p, SdcReplayRequested):
            opened = ReplayRound(str(event.id), p, event.occurred_at + timedelta(seconds=p.timeout_s),
                                 correlation_id=event.correlation_id or event.id)
            localising = state.localising
            if min(ph.index for ph in p.phases) == 1:  # a new localisation: forget the last one
                localising = {**localising, job_id: Localising()}
            return replace(state, replays={**state.replays, (job_id, p.round): opened}, localising=localising)
        if isinstance(p, SdcReplayCompleted):
            current = state.replays.get((job_id, p.round))
            if current is None or p.request_id != current.request_id or p.node_id not in current.request.nodes:
                return state
            opened = replace(current, answers={**current.answers, p.node_id: p})
            return replace(state, replays={**state.replays, (job_id, p.round): opened})
        assert isinstance(p, SdcReplayAnalyzed)
        current = state.replays.get((job_id, p.round))
        replays = {k: v for k, v in state.replays.items() if k != (job_id, p.round)}
        if current is None:
            return replace(state, replays=replays)
        phases = {ph.index: ph for ph in current.request.phases}
        before = state.localising.get(job_id, Localising())
        judged = tuple(PhaseResult(phase_of(phases[o.phase]), frozenset(o.failed_groups))
                       for o in p.phases if o.phase in phases)
        return replace(state, replays=replays, localising={
            **state.localising, job_id: Localising(before.results + judged, before.reference or p.reference_digest)})

    def _evolve_failslow(self, state: AnalyzerState, event: Event) -> AnalyzerState:
        p = event.payload
        job = state.failslow.get(event.job_id)
        if job is None:
            if isinstance(p, TimerTicked | FailSlowConvicted):
                return state  # nothing sampled yet
            job = JobFailSlow(self.failslow.fresh_rounds())
        if isinstance(p, NodeHeartbeat):
            if p.standby:
                return state
            # Dated on the recorded clock: a node whose clock lags is neither never fresh nor always fresh.
            at = job.clock_at if job.clock_at is not None else event.occurred_at
            job = observe_heartbeat(job, p.node_id, p.rank_compute_time_p50_s, at, self.failslow, p.generation)
        elif isinstance(p, CheckpointRanksRegistered):
            job = observe_groups(job, {g.rank: g.dp for g in p.ranks})
        elif isinstance(p, TimerTicked):
            job = take_round(job, p.now, self.failslow)
            job = replace(job, clock_at=p.now if p.interval_s is not None else None)
        elif isinstance(p, FailSlowConvicted):
            # Convicted: count afresh, without the convicted nodes' old samples.
            job = JobFailSlow(self.failslow.fresh_rounds(), pools=job.pools, clock_at=job.clock_at,
                              samples={r: s for r, s in job.samples.items() if s.node_id not in p.group_nodes},
                              generation=job.generation, warm_until=job.warm_until)
        return replace(state, failslow={**state.failslow, event.job_id: job})

    def needs_clock(self, state: AnalyzerState) -> list[str]:
        return sorted({job for job, _ in state.rounds} | {job for job, _ in state.replays})

    def decide(self, state: AnalyzerState, event: Event) -> Decision:
        p = event.payload
        if isinstance(p, StacksCaptured):
            current = state.rounds.get((event.job_id, p.round))
            if current is None or p.request_id != current.request_id:
                return Decision.nothing(f"stacks of {p.node_id} for round {p.round}, which is not open: recorded")
            if not current.complete():
                return Decision.nothing(f"round {p.round}: stacks of {p.node_id} in; waiting for "
                                        f"{_listed(current.nodes - current.parts.keys()) or 'parts'}")
            return self._judge(state, event.job_id, current, late=())
        if isinstance(p, SdcReplayCompleted):
            replay = state.replays.get((event.job_id, p.round))
            if replay is None or p.request_id != replay.request_id:
                return Decision.nothing(f"replay answer of {p.node_id} for round {p.round}, which is not open: recorded")
            if not replay.complete():
                waiting = sorted(n for n in replay.request.nodes if n not in replay.answers)
                return Decision.nothing(f"replay round {p.round}: {p.node_id} answered; waiting for {', '.join(waiting)}")
            return self._judge_replay(state, event.job_id, replay)
        if isinstance(p, TimerTicked):
            replay_due = [r for (job, _), r in sorted(state.replays.items(), key=lambda kv: kv[0][1])
                          if job == event.job_id and p.now >= r.deadline]
            if replay_due:
                return self._judge_replay(state, event.job_id, replay_due[0])
            due = [r for (job, _), r in sorted(state.rounds.items(), key=lambda kv: kv[0][1])
                   if job == event.job_id and p.now >= r.deadline]
            stacks = (self._judge(state, event.job_id, due[0], late=tuple(due[0].silent())) if due
                      else Decision.nothing("no capture round past its deadline"))
            failslow = self._failslow(state, event.job_id, p.now)
            if failslow is None:
                return stacks
            return Decision(reason=f"{stacks.reason}; {failslow.reason}",
                            proposals=(*stacks.proposals, *failslow.proposals))
        return Decision.nothing(f"{event.type}: nothing to decide")

    def _judge_replay(self, state: AnalyzerState, job_id: str, current: ReplayRound) -> Decision:
        localising = state.localising.get(job_id, Localising())
        judgement = judge_round(current.request, current.answers, localising.reference)
        fields = verdict_fields(current.request, judgement, localising.results)
        verdict = SdcReplayAnalyzed(request_id=current.request_id, round=current.request.round, **fields)
        return Decision(reason=f"replay round {current.request.round}: {verdict.kind}: {verdict.reason}",
                        proposals=(Proposal(verdict, subject=f"job/{job_id}", key=f"sdc/{current.request.round}",
                                            correlation_id=current.correlation_id),))

    def _failslow(self, state: AnalyzerState, job_id: str, now: datetime) -> Decision | None:
        job = state.failslow.get(job_id)
        if job is None:
            return None
        convicted = conviction(job, now)
        if convicted is None:
            return None
        return Decision(reason=convicted.reason,
                        proposals=(Proposal(convicted, subject=f"job/{job_id}",
                                            key=f"failslow/{now.isoformat()}"),))

    def _judge(self, state: AnalyzerState, job_id: str, current: CaptureRound, late: tuple[str, ...]) -> Decision:
        layout = state.layouts.get(job_id, JobLayout())
        fields = judge(current.captures(), silent_nodes=late, world_size=layout.world_size,
                       rank_nodes={rank: node for rank, (_, node) in layout.rank_nodes.items()})
        verdict = StacksAnalyzed(request_id=current.request_id, round=current.round, **fields)
        return Decision(reason=f"round {current.round}: {verdict.reason}",
                        proposals=(Proposal(verdict, subject=f"job/{job_id}", key=f"stacks/{current.round}",
                                            correlation_id=current.correlation_id),))

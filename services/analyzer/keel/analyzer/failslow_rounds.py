"""Fail-slow rounds over the event log (pure): the analyzer's part of rung 3 when nothing hangs.

Inputs, per job:

- ``NodeHeartbeat.rank_compute_time_p50_s``: each rank's median time per step outside collectives (the
  SDK's ``Session.waiting()`` marks them). In synchronous training every rank's step takes as long as
  the slowest rank's; only the slow rank also *computes* longer than the peers doing the same work.
- ``CheckpointRanksRegistered``: each rank's DP group. Ranks of one DP group run the same stage and
  shard, so their compute times are comparable; ranks of different pipeline stages are not (a heavier
  stage is not a slow node). Without groups, all ranks form one pool.
- ``TimerTicked`` (the job clock, keel.infra.clock): every ``interval`` one round compares the fresh
  samples of each pool (``step_time_outliers``), maps the flagged ranks to their nodes and adds the
  round (``FailSlowRounds``); after ``rounds`` rounds ``conclusion`` convicts the group flagged most.

``FailSlowConvicted`` (this decider's own event, folded back) starts the count afresh.

Samples are of one generation (``NodeHeartbeat.generation``): the first heartbeat of a newer generation
(a restart; the job's first generation too) drops every older sample and round, and its first step
samples start a warm-up of ``warmup`` (at least one ``interval``) whose samples are not judged: the first steps after a start or a
restore run slower on some ranks than on others (measured on the local cluster: rank 0 computed 2.3x
its peers' time for about 15 s after each start, which once convicted a healthy node), and the medians the
agents report need their steps. So no round compares ranks across a restart, and no conviction's window
spans one. A heartbeat of an older generation than the newest seen (a node not restarted yet, a fenced
one) is not judged. Heartbeats without a generation (agents before v4) are judged as they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from keel.analyzer.failslow import (
    FailSlowRounds,
    FlaggedGroup,
    StepTimeSettings,
    add_round,
    conclusion,
    step_time_outliers,
)
from keel.events.types import FailSlowConvicted


@dataclass(frozen=True)
class FailSlowPolicy:
    interval: timedelta = timedelta(seconds=10)
    rounds: int = 5
    min_flags: int = 2
    ratio: float = 1.15
    warmup: timedelta = timedelta(seconds=30)
    """A generation's first steps not judged (at least one ``interval``): see the module docstring."""

    @property
    def step_times(self) -> StepTimeSettings:
        return StepTimeSettings(ratio=self.ratio)

    def fresh_rounds(self) -> FailSlowRounds:
        return FailSlowRounds(interval=self.interval, rounds_needed=self.rounds, min_flags=self.min_flags)


@dataclass(frozen=True)
class Sample:
    at: datetime
    node_id: str
    compute_s: float
    generation: int | None = None


@dataclass(frozen=True)
class JobFailSlow:
    rounds: FailSlowRounds
    samples: Mapping[int, Sample] = field(default_factory=dict)
    """rank -> its newest compute-time sample (and the node it ran on)."""
    pools: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """rank -> the ranks doing the same work (its DP group), from the checkpoint registrations."""
    evidence: tuple[str, ...] = ()
    """One line per round in ``rounds``, oldest first."""
    clock_at: datetime | None = None
    """The job clock's latest v2 tick: samples are dated by it (when they arrived), not by the node's own
    clock. None (no such tick yet; logs of v1 ticks): by the heartbeat's timestamp, as such logs were."""
    generation: int | None = None
    """The newest generation a heartbeat reported: only its samples are judged (None: none reported one)."""
    warm_until: datetime | None = None
    """Samples of ``generation`` dated before this are its warm-up, not judged."""
    stepping: bool = False
    """Whether a heartbeat of ``generation`` carried step samples yet: the first one starts the warm-up."""


def observe_heartbeat(job: JobFailSlow, node_id: str, compute: Mapping[int, float], at: datetime,
                      policy: FailSlowPolicy, generation: int | None = None) -> JobFailSlow:
    """``job`` with a heartbeat's compute times dated ``at``. A newer ``generation`` than any seen starts
    afresh (no sample, round or evidence of an older one is kept); its first compute times start a warm-up
    (``policy.warmup``, at least one interval); an older one is ignored (the module docstring says why)."""
    if generation is not None and job.generation is not None and generation < job.generation:
        return job
    if generation is not None and (job.generation is None or generation > job.generation):
        job = replace(job, rounds=policy.fresh_rounds(), samples={}, evidence=(), generation=generation,
                      warm_until=None, stepping=False)
    if not compute:
        return job
    if not job.stepping and job.generation is not None:  # (heartbeats without one: no warm-up, as before v4)
        # The warm-up counts from the generation's first step, not its first heartbeat: a start that spent
        # 20 s importing and meeting its peers (CI saw it) must not use up the warm-up its steps need.
        job = replace(job, stepping=True, warm_until=at + max(policy.interval, policy.warmup))
    if job.warm_until is not None and at < job.warm_until:
        return job
    samples = dict(job.samples)
    for rank, value in compute.items():
        samples[rank] = Sample(at, node_id, value, generation)
    return replace(job, samples=samples)


def observe_groups(job: JobFailSlow, groups: Mapping[int, list[int]]) -> JobFailSlow:
    return replace(job, pools={**job.pools, **{rank: tuple(sorted(dp)) for rank, dp in groups.items() if dp}})


def take_round(job: JobFailSlow, now: datetime, policy: FailSlowPolicy) -> JobFailSlow:
    """One round at ``now`` if one is due, else ``job`` unchanged. Only samples of the last interval are
    judged (a node that stopped reporting is not evidence of anything here)."""
    if not job.rounds.due(now) or (job.rounds.rounds and now <= job.rounds.rounds[-1].at):
        return job
    horizon = now - policy.interval
    fresh = {rank: s for rank, s in job.samples.items() if s.at >= horizon and s.compute_s > 0}
    by_pool: dict[tuple[int, ...], dict[int, float]] = {}
    for rank, sample in sorted(fresh.items()):
        by_pool.setdefault(job.pools.get(rank, ()), {})[rank] = sample.compute_s
    flagged: list[int] = []
    lines: list[str] = []
    for _pool, times in sorted(by_pool.items()):
        result = step_time_outliers(times, policy.step_times)
        flagged += list(result.flagged)
        median = f"median {result.median_s:.4g} s" if result.median_s is not None else "too few to compare"
        shown = ", ".join(f"rank {r} ({fresh[r].node_id}) {t:.4g} s" for r, t in sorted(times.items()))
        lines.append(f"[{shown}; {median}]" + (f": rank(s) {', '.join(map(str, result.flagged))} flagged"
                                                if result.flagged else ""))
    group: FlaggedGroup | None = None
    if flagged:
        nodes = tuple(sorted({fresh[r].node_id for r in flagged}))
        ranks = tuple(sorted(r for r, s in fresh.items() if s.node_id in nodes))
        group = FlaggedGroup("node" if len(nodes) == 1 else "groups", ranks, nodes, "step_times",
                             tuple(sorted(flagged)), nodes)
    evidence = f"{now.isoformat(timespec='seconds')}: compute time per step " + (
        " ".join(lines) if lines else "[no fresh samples]") + ("" if group else ": nothing flagged")
    rounds = add_round(job.rounds, group, now)
    return replace(job, rounds=rounds, evidence=(*job.evidence, evidence)[-policy.rounds:])


def conviction(job: JobFailSlow, now: datetime) -> FailSlowConvicted | None:
    """The conviction the round just taken at ``now`` reaches, if any."""
    if not job.rounds.rounds or job.rounds.rounds[-1].at != now:
        return None
    verdict = conclusion(job.rounds)
    if verdict is None or not verdict.actionable:
        return None
    counted = sum(1 for r in job.rounds.rounds if r.group is not None and r.group.key == (verdict.group_kind,
                                                                                          verdict.group_ranks))
    return FailSlowConvicted(
        group_kind=verdict.group_kind, group_ranks=list(verdict.group_ranks),
        group_nodes=list(verdict.group_nodes), outlier_ranks=list(verdict.outlier_ranks),
        rounds=len(job.rounds.rounds), flags=counted, interval_s=job.rounds.interval.total_seconds(),
        round_evidence=list(job.evidence), reason="; ".join(verdict.reasons))

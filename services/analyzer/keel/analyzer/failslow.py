"""Fail-slow: flag slow ranks or nodes from step times, and convict the group flagged most over rounds.

Pure. Two parts:

- ``step_time_outliers(step_times, settings)``: robust outliers of one snapshot of step times (by rank
  or by node: any hashable key). With ``m`` the median and ``MAD`` the median absolute deviation, a key
  is flagged when its time is more than ``ratio`` x ``m``, or when its modified z-score
  ``0.6745 (t - m) / MAD`` (Iglewicz and Hoaglin) is above ``z_threshold`` AND its time is more than
  ``min_ratio`` x ``m`` (so that a job whose step times agree to the microsecond, MAD ~ 0, does not flag
  noise). Only slow keys are flagged; fast ones are not a fault.
- ``FailSlowRounds``: an immutable accumulator. Every ``interval`` (default 10 s) the adapter adds one
  round: the group the stack aggregation or the step times flagged, or ``None``. ``conclusion`` looks at
  the last ``rounds`` (default 5) rounds and convicts the group flagged most often, provided it was
  flagged at least ``min_flags`` times (default 2: one flag in five rounds is noise) and strictly more
  often than any other group; a tie is inconclusive, and says so. Groups are the same when their kind
  and ranks are.

Time is an input (``at``: an aware ``datetime``), never read here.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Generic, Literal, TypeVar

from keel.analyzer.aggregate import GroupKind, Topology, Verdict, format_ranks

K = TypeVar("K", bound=Hashable)
MAD_TO_Z = 0.6745  # Iglewicz-Hoaglin: 0.6745 (x - median) / MAD ~ a standard normal z-score


@dataclass(frozen=True, slots=True)
class StepTimeSettings:
    """``ratio``: flag above ``ratio`` x median. ``z_threshold``: flag a modified z-score above it (when
    also above ``min_ratio`` x median). ``min_samples``: fewer keys than this flag nothing (a median
    of two says little)."""

    ratio: float = 1.5
    z_threshold: float = 3.5
    min_ratio: float = 1.05
    min_samples: int = 3

    def __post_init__(self) -> None:
        if self.ratio <= 1 or self.min_ratio < 1:
            raise ValueError(f"ratio must be > 1 and min_ratio >= 1, got {self.ratio}, {self.min_ratio}")
        if self.z_threshold <= 0 or self.min_samples < 2:
            raise ValueError("z_threshold must be > 0 and min_samples >= 2")


@dataclass(frozen=True)
class StepTimeOutliers(Generic[K]):
    """Flagged keys (slowest first) with the statistics behind them and a reason per decision."""

    flagged: tuple[K, ...]
    median_s: float | None
    mad_s: float | None
    z_scores: Mapping[K, float]
    reasons: tuple[str, ...]


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2


def step_time_outliers(step_times_s: Mapping[K, float], settings: StepTimeSettings = StepTimeSettings()) -> StepTimeOutliers[K]:
    """Flag the keys (ranks or nodes) whose step time is an upward outlier (module docstring: the rule).

    Non-finite times are not judged (reported in the reasons). Raises ``ValueError`` for a negative time.
    """
    reasons: list[str] = []
    finite: dict[K, float] = {}
    for key, t in step_times_s.items():
        if t < 0:
            raise ValueError(f"step time of {key!r} is negative: {t}")
        if math.isfinite(t):
            finite[key] = float(t)
    bad = [k for k in step_times_s if k not in finite]
    if bad:
        reasons.append(f"{len(bad)} non-finite step time(s) not judged: {bad[:8]!r}")
    if len(finite) < settings.min_samples:
        reasons.append(f"only {len(finite)} step time(s), fewer than {settings.min_samples}: nothing flagged")
        return StepTimeOutliers((), None, None, {}, tuple(reasons))
    values = list(finite.values())
    med = _median(values)
    mad = _median([abs(v - med) for v in values])
    z: dict[K, float] = {}
    flagged: list[tuple[float, K]] = []
    for key, t in finite.items():
        zk = MAD_TO_Z * (t - med) / mad if mad > 0 else (math.inf if t > med else 0.0)
        z[key] = zk
        by_ratio = med > 0 and t > settings.ratio * med
        by_z = zk > settings.z_threshold and t > settings.min_ratio * med
        if by_ratio or by_z:
            flagged.append((t, key))
            why = (f"{t / med:.2f}x the median" if med > 0 else "above a zero median")
            rule = (f"> {settings.ratio}x" if by_ratio else f"modified z {zk:.1f} > {settings.z_threshold}")
            reasons.append(f"{key!r}: step time {t:.4g} s is {why} {med:.4g} s ({rule})")
    flagged.sort(key=lambda tk: (-tk[0], repr(tk[1])))
    if not flagged:
        reasons.append(f"no step time above {settings.ratio}x the median {med:.4g} s or a modified z-score of "
                       f"{settings.z_threshold} (MAD {mad:.4g} s, {len(finite)} samples)")
    return StepTimeOutliers(tuple(k for _, k in flagged), med, mad, z, tuple(reasons))


# ------------------------------------------------------------------------------------------- rounds

Source = Literal["stacks", "step_times"]


@dataclass(frozen=True, slots=True)
class FlaggedGroup:
    """The group one round flagged. Identity (for counting) is ``(kind, ranks)``."""

    kind: GroupKind
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    source: Source
    outlier_ranks: tuple[int, ...] = ()
    outlier_nodes: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[GroupKind, tuple[int, ...]]:
        return (self.kind, self.ranks)


@dataclass(frozen=True, slots=True)
class Round:
    at: datetime
    group: FlaggedGroup | None


@dataclass(frozen=True)
class FailSlowRounds:
    """Immutable fail-slow accumulator: ``add_round`` returns a new one. ``rounds_needed`` rounds are
    judged (the last ones), taken every ``interval``; ``min_flags`` is the least count that convicts."""

    interval: timedelta = timedelta(seconds=10)
    rounds_needed: int = 5
    min_flags: int = 2
    rounds: tuple[Round, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.interval <= timedelta(0):
            raise ValueError(f"interval must be positive, got {self.interval}")
        if self.rounds_needed < 1 or not 1 <= self.min_flags <= self.rounds_needed:
            raise ValueError(f"need rounds_needed >= 1 and 1 <= min_flags <= rounds_needed, got "
                             f"{self.rounds_needed}, {self.min_flags}")

    def due(self, now: datetime) -> bool:
        """Whether the next round is due at ``now`` (the first one always is)."""
        return not self.rounds or now - self.rounds[-1].at >= self.interval


def add_round(state: FailSlowRounds, flagged_group: FlaggedGroup | None, at: datetime) -> FailSlowRounds:
    """``state`` plus one round at ``at`` (``None``: nothing flagged). Keeps the last ``rounds_needed``.

    Raises ``ValueError`` when ``at`` is not after the previous round (rounds are ordered in time).
    Rounds taken sooner than ``interval`` are accepted (a timer is never exact); ``conclusion``
    reports the span the rounds cover.
    """
    if state.rounds and at <= state.rounds[-1].at:
        raise ValueError(f"round at {at.isoformat()} is not after the previous one at {state.rounds[-1].at.isoformat()}")
    rounds = (*state.rounds, Round(at, flagged_group))[-state.rounds_needed:]
    return replace(state, rounds=rounds)


def conclusion(state: FailSlowRounds) -> Verdict | None:
    """``None`` until ``rounds_needed`` rounds are in; then a ``Verdict``: ``"convicted"`` naming the
    group flagged most often (at least ``min_flags`` times, strictly more than any other), else
    ``"inconclusive"`` with the reason (a tie, too few flags, nothing flagged)."""
    if len(state.rounds) < state.rounds_needed:
        return None
    rounds = state.rounds[-state.rounds_needed:]
    n = len(rounds)
    span = (rounds[-1].at - rounds[0].at).total_seconds()
    counts = Counter(r.group.key for r in rounds if r.group is not None)
    latest: dict[tuple[GroupKind, tuple[int, ...]], FlaggedGroup] = {}
    outliers: dict[tuple[GroupKind, tuple[int, ...]], set[int]] = {}
    outlier_nodes: dict[tuple[GroupKind, tuple[int, ...]], set[str]] = {}
    sources: dict[tuple[GroupKind, tuple[int, ...]], set[str]] = {}
    for r in rounds:
        if r.group is not None:
            latest[r.group.key] = r.group
            outliers.setdefault(r.group.key, set()).update(r.group.outlier_ranks)
            outlier_nodes.setdefault(r.group.key, set()).update(r.group.outlier_nodes)
            sources.setdefault(r.group.key, set()).add(r.group.source)

    def name(key: tuple[GroupKind, tuple[int, ...]]) -> str:
        return f"{key[0]} group {format_ranks(key[1])}"

    tally = "; ".join(f"{name(k)}: {c}" for k, c in counts.most_common())
    window = f"{n} rounds over {span:.0f} s (every {state.interval.total_seconds():g} s)"
    none_count = n - sum(counts.values())

    def inconclusive(why: str) -> Verdict:
        return Verdict(kind="inconclusive", outlier_ranks=(), outlier_nodes=(), group_kind="none", group_ranks=(),
                       group_nodes=(), dominant_stack=(), outlier_stacks={}, missing=(),
                       reasons=(f"inconclusive: {why}", f"{window}; flags: {tally or 'none'}; "
                                f"{none_count} round(s) flagged nothing"))

    if not counts:
        return inconclusive(f"no group was flagged in the last {n} rounds")
    top = counts.most_common()
    best_key, best = top[0]
    tied = [k for k, c in top if c == best]
    if len(tied) > 1:
        return inconclusive(f"{len(tied)} groups tie at {best} flag(s) each: {', '.join(name(k) for k in tied)}")
    if best < state.min_flags:
        return inconclusive(f"the most flagged, {name(best_key)}, was flagged {best} time(s), fewer than "
                            f"{state.min_flags}")
    g = latest[best_key]
    outs = tuple(sorted(outliers[best_key])) or g.ranks
    return Verdict(
        kind="convicted", outlier_ranks=outs, outlier_nodes=tuple(sorted(outlier_nodes[best_key])) or g.nodes,
        group_kind=g.kind, group_ranks=g.ranks,
        group_nodes=g.nodes, dominant_stack=(), outlier_stacks={}, missing=(),
        reasons=(f"fail-slow: {name(best_key)} on node(s) {', '.join(g.nodes)} was flagged in {best} of the last "
                 f"{n} rounds (by {', '.join(sorted(sources[best_key]))}), more than any other group",
                 f"{window}; flags: {tally}; {none_count} round(s) flagged nothing"),
    )


def flagged_from_verdict(verdict: Verdict) -> FlaggedGroup | None:
    """The group a stack-aggregation verdict flags, or ``None`` when it is not actionable."""
    if not verdict.actionable:
        return None
    return FlaggedGroup(verdict.group_kind, verdict.group_ranks, verdict.group_nodes, "stacks", verdict.outlier_ranks,
                        verdict.outlier_nodes)


def flagged_from_step_times(result: StepTimeOutliers[K], topology: Topology, by: Literal["rank", "node"]) -> FlaggedGroup | None:
    """The group step-time outliers flag: the slow nodes (``by="node"``: keys are node names; or the
    nodes of the slow ranks, ``by="rank"``), as kind ``"node"`` for one node, ``"groups"`` for several.
    ``None`` when nothing was flagged."""
    if not result.flagged:
        return None
    if by == "node":
        nodes = tuple(sorted(str(k) for k in result.flagged))
        unknown = [n for n in nodes if n not in topology.node_ranks]
        if unknown:
            raise ValueError(f"flagged nodes not in the topology: {unknown}")
        outliers: tuple[int, ...] = ()
    else:
        outliers = tuple(sorted(int(k) for k in result.flagged))  # type: ignore[call-overload]
        nodes = topology.nodes_of(outliers)
    ranks = tuple(sorted(r for n in nodes for r in topology.node_ranks[n]))
    return FlaggedGroup("node" if len(nodes) == 1 else "groups", ranks, nodes, "step_times", outliers or ranks, nodes)

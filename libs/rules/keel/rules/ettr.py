"""ETTR and incidents from the event log (pure): how much of a job's wall time was productive, and where
every lost minute went.

An *incident* starts at the fault (``FaultInjected`` when the fault was injected on purpose and takes
effect at once, else the first failure signal: an injected fault with ``params.at_step`` waits for that
step, and the wait is no lost time) and ends when the job is back at the step it had reached when the fault hit.
Its lost time is split into phases, each from one event to the next:

- detection:    fault -> first failure signal (``RankExited`` with a failure classification, a failed
                fatal ``NodeHealthChanged``, or a rank's failed hang check: ``collective_stuck``,
                ``process_stopped``, ``no_progress``, ``heartbeat_lost``). A fault nobody injected starts
                where its first signal says it began: a hang check's evidence says how long the rank had
                been stuck (``waited_s``, ``stopped_s``, ``silent_for_s``), and that time is lost too
                (detection), never before the job started or the previous incident ended;
- localisation: signal -> the controller's first decision or command (``DiagnosticsRequested``,
                ``RestartDecided``, ``StandbyPromotionRequested``, ``RanksRestartRequested``,
                ``NodeEvictionDecided``; an observe-only eviction does not count);
- failover:     command -> the first rank of the new generation started (``RankStarted``);
- restore:      started -> the new generation stepping past its restore point (``NodeHeartbeat.last_step``
                above the ``CheckpointRestorePlanned`` step, or above -1 with no plan);
- recompute:    stepping -> back at the step reached when the fault hit (between two heartbeats, the
                moment is interpolated at the steps' rate: heartbeats come every 5 s, steps far faster).

A hang the controller resolves at rung 0 (``IncidentResolved``: the stall cleared itself, nothing was
restarted) ends at the first heartbeat of the fault's generation past the step reached at the fault (else
at the resolution); the time after its detection is charged as localisation.

A job whose ranks never report through the SDK (no heartbeat ever shows a rank reporting or a step:
``NodeHeartbeat.ranks_reporting`` 0) has no step to resume at. Its incidents are measured on process
liveness instead (``measure`` "process", coarser): restore ends, and the incident with it, when every
rank of the new generation has started (the world size), once a heartbeat from each node that started
them shows all its ranks alive (a generation that dies first never recovered); recompute is unseen (0).
A rank that runs but hangs or makes no progress is then not visible as lost time.

A phase whose closing event never came is charged up to the end of the log (the job is still down).
A later mark implies the earlier ones (the controller cannot decide before it detected; ranks that
step again were restarted), so a missing or late mark takes the time of the next one that came: the
phases never overlap and always add up to the incident's lost time.

Time lost while the job runs, outside any incident, is *overhead* (``Overhead``), charged too:

- checkpoint:   the seconds the training thread blocked in checkpointing (each snapshot's capture and its
                wait for the previous copy), from ``NodeHeartbeat.checkpoint_blocking_s``: a running total
                per node and generation (the slowest of its ranks; a total that drops is a new process
                counting from 0). Each node's growth outside incidents is spread over the heartbeat interval
                it grew in (a node's first heartbeat of a generation: since the generation began). A
                synchronous job waits for its slowest rank, so each generation is charged its largest node
                total: a lower bound when different nodes are the slowest at different steps.
- fail_slow:    a fail-slow conviction (``FailSlowConvicted``) says the job had been running slowly for
                ``rounds`` x ``interval_s``; the steps it ran slower than before are lost: over ``[S, T]``
                (T the conviction, or the start of an incident open then; S that far back, from an injected
                slow fault's start when there is one, never before the generation, the job, the last
                recovery or the previous conviction's charge began or ended) the charge is ``(T - S) x
                (1 - healthy / degraded)``, with ``healthy`` the median ``step_time_p50_s`` of the same
                generation's heartbeats in the span before S (as long as the slow one, at least
                ``FAIL_SLOW_BASELINE``; never the generation's first ``FAIL_SLOW_WARMUP``; a later
                conviction reuses the first one's) and ``degraded`` their median within ``[S, T]``. No
                heartbeat before S: no baseline, no charge (the report says so). The eviction that follows
                is an incident like any other, opened by the controller's ``IncidentOpened`` (kind
                ``fail_slow``); a conviction the controller declines opens none. An injected slow fault
                (``FaultInjected`` kind ``slow``, no ``at_step``) opens no incident (the job trains on,
                slower).

Not charged (not seen in the log): the time before a fault nobody injected is detected, beyond what a
hang check's own evidence says; steps slowed by a copy thread competing for the cores; fail-slow steps
the analyzer never convicted.

ETTR = 1 - (sum(incident lost) + sum(overhead)) / (end - start of the job). ``EttrReport.window(length)``
gives the same figures over the last ``length`` of the log (``EttrWindow``: lost time clipped to the
window; an overhead spread evenly over its span). Everything comes from events' ``occurred_at``: the same
log always gives the same report.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal, TypeGuard

from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CheckpointRestorePlanned,
    FailSlowConvicted,
    FaultInjected,
    IncidentOpened,
    IncidentResolved,
    NodeHealthChanged,
    NodeHeartbeat,
    RankExited,
    RanksRestartRequested,
    RankStarted,
)

__all__ = ["EttrPoint", "EttrReport", "EttrWindow", "INPUT_TYPES", "Incident", "Measure", "OVERHEAD_KINDS", "Overhead", "PHASES",
           "PROCESS_LEVEL_NOTE", "compute_ettr"]

Measure = Literal["step", "process"]
PROCESS_LEVEL_NOTE = ("process-level (coarser): no rank reports through the SDK, so recovery is when every rank "
                      "of the new generation runs; no step is seen, so a hang or a rank making no progress is not "
                      "counted as lost time")
"""What a process-level report says of itself (``keel ettr`` prints it; ``--json`` carries it)."""

PHASES = ("detection", "localisation", "failover", "restore", "recompute")
_MARKS = ("detected", "decided", "restarted", "resumed", "recovered")
"""The mark that closes each phase, in the order of ``PHASES``."""
_FAILURE_CLASSES = {"user_code", "infrastructure", "unknown"}
_COMMANDS = {"RanksRestartRequested", "NodeEvictionDecided", "RestartDecided", "DiagnosticsRequested",
             "StandbyPromotionRequested"}
INPUT_TYPES = frozenset({"RankStarted", "FaultInjected", "RankExited", "NodeHealthChanged", "IncidentOpened",
                         "CheckpointRestorePlanned", "NodeHeartbeat", "IncidentResolved", "FailSlowConvicted",
                         *_COMMANDS})
"""The event types ``compute_ettr`` reads; every other event only moves the end of the log (a reader
may fetch only these and pass the time of the job's last event as ``until``: the same report)."""


@dataclass
class Incident:
    started_at: datetime
    cause: str
    step_at_fault: int
    generation_at_fault: int
    marks: dict[str, datetime] = field(default_factory=dict)
    """detected, decided, restarted, resumed, recovered: when each happened."""
    restore_step: int | None = None
    restarted_nodes: set[str] = field(default_factory=set)
    """Nodes that started ranks of a generation newer than the fault's."""
    measure: Measure = "step"
    """How its recovery was measured: ``step`` (a reported step), ``process`` (a job without the SDK)."""
    last_beat: tuple[datetime, int] | None = None
    """The newest heartbeat of a restarted node since the job resumed, below the step at the fault."""
    candidate: tuple[int, datetime] | None = None
    """A job without the SDK: the newest generation all of whose ranks started, and when the last one did."""
    started_ranks: dict[int, set[int]] = field(default_factory=dict)
    """A job without the SDK: per generation newer than the fault's, the ranks started so far."""
    started_nodes: dict[int, set[str]] = field(default_factory=dict)
    """Per such generation, the nodes that started its ranks; ``confirmed``: those heard with all alive since."""
    confirmed: set[str] = field(default_factory=set)
    last_start: dict[int, datetime] = field(default_factory=dict)
    """Per such generation, the latest ``occurred_at`` of its rank starts (the log need not be in time order)."""
    stepped_on_at: datetime | None = None
    """No restart yet: the first heartbeat of the fault's generation past ``step_at_fault`` (a stall that
    cleared itself, if the controller then resolves the incident at rung 0)."""

    @property
    def recovered_at(self) -> datetime | None:
        return self.marks.get("recovered")

    def phase_intervals(self, end: datetime) -> dict[str, tuple[datetime, datetime]]:
        """Each phase as ``(from, to)``, contiguous from ``started_at`` to the recovery (or ``end``).

        A missing mark, or one later than a mark after it (a command before a late detection event),
        takes the time of the next mark that came: each bound is the earliest of its own and every
        later mark, and never before the start. An unfinished phase runs to ``end``.
        """
        bounds: list[datetime] = []
        upper = end
        for mark in reversed(_MARKS):
            at = self.marks.get(mark)
            if at is not None and at < upper:
                upper = at
            bounds.append(max(upper, self.started_at))
        bounds.append(self.started_at)
        bounds.reverse()
        return {name: pair for name, pair in zip(PHASES, zip(bounds, bounds[1:]), strict=True)}

    def phases(self, end: datetime) -> dict[str, timedelta]:
        """Each phase's duration (they add up to ``lost(end)``); an unfinished one runs to ``end``."""
        return {name: b - a for name, (a, b) in self.phase_intervals(end).items()}

    def lost(self, end: datetime) -> timedelta:
        return (self.recovered_at or end) - self.started_at

    def to_json(self, end: datetime) -> dict[str, Any]:
        return {"started_at": self.started_at.isoformat(), "cause": self.cause, "step_at_fault": self.step_at_fault,
                "recovered": self.recovered_at is not None, "lost_s": self.lost(end).total_seconds(),
                "phases_s": {k: v.total_seconds() for k, v in self.phases(end).items()},
                "marks": {k: v.isoformat() for k, v in self.marks.items()}, "restore_step": self.restore_step,
                "measure": self.measure}


OverheadKind = Literal["checkpoint", "fail_slow"]
OVERHEAD_KINDS: tuple[OverheadKind, ...] = ("checkpoint", "fail_slow")
FAIL_SLOW_BASELINE = timedelta(minutes=10)
"""A fail-slow charge's healthy step time: the median of the same generation's heartbeats this long (or the
slow span's length, if longer) before the slow span."""
FAIL_SLOW_WARMUP = timedelta(seconds=30)
"""A generation's first step times are no baseline (nor evidence): its first steps run slower (measured on the
local cluster: the median step 0.084 s in the first 15 s against 0.050 s after)."""
FAIL_SLOW_LOOKBACK = timedelta(hours=6)
"""How far back heartbeats are kept for a fail-slow charge (its degraded span and the baseline before it)."""


@dataclass(frozen=True)
class Overhead:
    """Time lost while the job ran (no incident open): ``lost`` spread evenly over ``[started_at, ended_at]``."""

    kind: OverheadKind
    started_at: datetime
    ended_at: datetime
    lost: timedelta
    detail: str = ""

    def within(self, start: datetime, end: datetime) -> timedelta:
        """The share of ``lost`` inside ``[start, end]`` (all of it for an instant inside, else pro rata)."""
        span = self.ended_at - self.started_at
        if span <= timedelta(0):
            return self.lost if start <= self.ended_at <= end else timedelta(0)
        return self.lost * (_overlap(self.started_at, self.ended_at, start, end) / span)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "started_at": self.started_at.isoformat(), "ended_at": self.ended_at.isoformat(),
                "lost_s": self.lost.total_seconds(), "detail": self.detail}


def _by_kind(pairs: Iterable[tuple[OverheadKind, timedelta]]) -> dict[str, timedelta]:
    totals: dict[str, timedelta] = {k: timedelta(0) for k in OVERHEAD_KINDS}
    for kind, spent in pairs:
        totals[kind] += spent
    return totals


@dataclass(frozen=True)
class EttrReport:
    started_at: datetime
    ended_at: datetime
    incidents: tuple[Incident, ...]
    generations: tuple[tuple[datetime, int], ...] = ()
    """Each generation change: when the first rank of a newer generation started, and the generation."""
    restart_requests: tuple[tuple[datetime, int], ...] = ()
    """Each ``RanksRestartRequested`` generation: when the first command for it came, and the generation."""
    measure: Measure = "step"
    """``process``: no rank of the job ever reported through the SDK; every figure is process-level."""
    overheads: tuple[Overhead, ...] = ()
    """Time lost outside incidents (checkpoint blocking, fail-slow steps before a conviction), in log order."""

    @property
    def wall(self) -> timedelta:
        return self.ended_at - self.started_at

    @property
    def incident_lost(self) -> timedelta:
        return sum((i.lost(self.ended_at) for i in self.incidents), timedelta(0))

    def lost_by_overhead(self) -> dict[str, timedelta]:
        """Overhead by kind (``OVERHEAD_KINDS``; 0 for a kind never charged)."""
        return _by_kind((o.kind, o.lost) for o in self.overheads)

    @property
    def lost(self) -> timedelta:
        """Every lost second: the incidents' and the overheads'."""
        return self.incident_lost + sum((o.lost for o in self.overheads), timedelta(0))

    @property
    def note(self) -> str:
        """What the figures can and cannot see ("" for a job measured on steps)."""
        return PROCESS_LEVEL_NOTE if self.measure == "process" else ""

    @property
    def ettr(self) -> float:
        wall = self.wall.total_seconds()
        return 1.0 if wall <= 0 else max(0.0, 1.0 - self.lost.total_seconds() / wall)

    def lost_by_phase(self) -> dict[str, timedelta]:
        totals = {p: timedelta(0) for p in PHASES}
        for incident in self.incidents:
            for phase, spent in incident.phases(self.ended_at).items():
                totals[phase] += spent
        return totals

    @property
    def generation(self) -> int:
        """The newest generation started (0 when the job never restarted)."""
        return self.generations[-1][1] if self.generations else 0

    def window(self, length: timedelta) -> EttrWindow:
        """The figures over the last ``length`` of the log (``[ended_at - length, ended_at]``, never
        before the job started): each incident's and each phase's lost time clipped to the window."""
        if length <= timedelta(0):
            raise ValueError(f"an ETTR window must be longer than 0 s, got {length}")
        start = max(self.started_at, self.ended_at - length)
        end = self.ended_at
        lost: list[tuple[int, timedelta]] = []
        by_phase = {p: timedelta(0) for p in PHASES}
        for index, incident in enumerate(self.incidents):
            spent = _overlap(incident.started_at, incident.recovered_at or end, start, end)
            if spent <= timedelta(0) and not start <= incident.started_at <= end:
                continue
            lost.append((index, spent))
            for phase, (a, b) in incident.phase_intervals(end).items():
                by_phase[phase] += _overlap(a, b, start, end)
        return EttrWindow(
            length=length, started_at=start, ended_at=end, lost_by_incident=tuple(lost), lost_by_phase=by_phase,
            lost_by_overhead=_by_kind((o.kind, o.within(start, end)) for o in self.overheads),
            generation_changes=sum(1 for at, _ in self.generations if start <= at <= end),
            restart_requests=sum(1 for at, _ in self.restart_requests if start <= at <= end),
        )

    def lost_between(self, start: datetime, end: datetime) -> timedelta:
        """Every second lost inside ``[start, end]``: each incident from its start to its recovery (or the end of
        the log), each overhead pro rata. Over the whole log it is ``lost``; over the last ``length``,
        ``window(length).lost``."""
        incidents = sum((_overlap(i.started_at, i.recovered_at or self.ended_at, start, end) for i in self.incidents),
                        timedelta(0))
        return incidents + sum((o.within(start, end) for o in self.overheads), timedelta(0))

    def series(self, points: int, length: timedelta) -> list[EttrPoint]:
        """ETTR at ``points`` instants spread evenly from the start of the log to its end (the last one is the
        end): at each, the cumulative figure since the start and the figure over the ``length`` before it (never
        before the start), both as the log reads now (an incident recovered later counts up to each instant)."""
        if points < 2:
            raise ValueError(f"an ETTR series needs at least 2 points, got {points}")
        if length <= timedelta(0):
            raise ValueError(f"an ETTR window must be longer than 0 s, got {length}")
        out = []
        for k in range(points):
            at = self.started_at + self.wall * (k / (points - 1)) if k < points - 1 else self.ended_at
            since = max(self.started_at, at - length)
            out.append(EttrPoint(at=at, cumulative=_ratio(self.lost_between(self.started_at, at), at - self.started_at),
                                 window=_ratio(self.lost_between(since, at), at - since)))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"started_at": self.started_at.isoformat(), "ended_at": self.ended_at.isoformat(),
                "wall_s": self.wall.total_seconds(), "lost_s": self.lost.total_seconds(), "ettr": self.ettr,
                "incident_lost_s": self.incident_lost.total_seconds(),
                "lost_by_phase_s": {k: v.total_seconds() for k, v in self.lost_by_phase().items()},
                "overhead_s": {k: v.total_seconds() for k, v in self.lost_by_overhead().items()},
                "fail_slow": [o.to_json() for o in self.overheads if o.kind == "fail_slow"],
                "generation": self.generation, "generation_changes": len(self.generations),
                "restart_requests": len(self.restart_requests), "measure": self.measure, "note": self.note,
                "incidents": [i.to_json(self.ended_at) for i in self.incidents]}


@dataclass(frozen=True)
class EttrWindow:
    """ETTR over ``[started_at, ended_at]``, the last ``length`` of a report (shorter when the job is)."""

    length: timedelta
    started_at: datetime
    ended_at: datetime
    lost_by_incident: tuple[tuple[int, timedelta], ...]
    """(index into ``EttrReport.incidents``, lost time inside the window) for each incident the window
    touches, in the report's order."""
    lost_by_phase: dict[str, timedelta]
    generation_changes: int
    restart_requests: int
    lost_by_overhead: dict[str, timedelta] = field(default_factory=lambda: _by_kind(()))
    """Each kind of overhead inside the window (spread evenly over the span it was charged for)."""

    @property
    def wall(self) -> timedelta:
        return self.ended_at - self.started_at

    @property
    def incident_lost(self) -> timedelta:
        return sum((spent for _, spent in self.lost_by_incident), timedelta(0))

    @property
    def lost(self) -> timedelta:
        return self.incident_lost + sum(self.lost_by_overhead.values(), timedelta(0))

    @property
    def ettr(self) -> float:
        wall = self.wall.total_seconds()
        return 1.0 if wall <= 0 else max(0.0, 1.0 - self.lost.total_seconds() / wall)

    def to_json(self) -> dict[str, Any]:
        return {"length_s": self.length.total_seconds(), "started_at": self.started_at.isoformat(),
                "ended_at": self.ended_at.isoformat(), "wall_s": self.wall.total_seconds(),
                "lost_s": self.lost.total_seconds(), "ettr": self.ettr,
                "incident_lost_s": self.incident_lost.total_seconds(),
                "overhead_s": {k: v.total_seconds() for k, v in self.lost_by_overhead.items()},
                "lost_by_incident_s": [{"incident": i, "lost_s": t.total_seconds()} for i, t in self.lost_by_incident],
                "lost_by_phase_s": {k: v.total_seconds() for k, v in self.lost_by_phase.items()},
                "generation_changes": self.generation_changes, "restart_requests": self.restart_requests}


@dataclass(frozen=True)
class EttrPoint:
    """One instant of an ETTR series: the cumulative figure and the sliding window's, both in [0, 1]."""

    at: datetime
    cumulative: float
    window: float

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at.isoformat(), "cumulative": self.cumulative, "window": self.window}


def _ratio(lost: timedelta, wall: timedelta) -> float:
    """ETTR of ``wall`` with ``lost`` of it lost: 1 for an empty span, never below 0."""
    seconds = wall.total_seconds()
    return 1.0 if seconds <= 0 else max(0.0, 1.0 - lost.total_seconds() / seconds)


def _overlap(a: datetime, b: datetime, start: datetime, end: datetime) -> timedelta:
    return max(timedelta(0), min(b, end) - max(a, start))


def compute_ettr(events: Iterable[Event], *, until: datetime | None = None) -> EttrReport | None:
    """The report for one job's events (in log order); None before the job's first rank started.

    ``until`` moves the end of the log later (an incident still open is charged up to it)."""
    started_at: datetime | None = None
    last_at: datetime | None = None
    max_step = -1
    generation = 0
    incidents: list[Incident] = []
    generations: list[tuple[datetime, int]] = []
    requested: dict[int, datetime] = {}
    open_: Incident | None = None
    sdk_seen = False
    checkpointing = _CheckpointCharge()
    step_times = _StepTimes()
    fail_slow: list[Overhead] = []
    slow_since: datetime | None = None
    for event in events:
        p, kind, at = event.payload, event.type, event.occurred_at
        last_at = at if last_at is None or at > last_at else last_at
        # Every event type's payload is its own class (registered once, under the class's name), so
        # isinstance on the payload is the same test as one on ``event.type``, and it narrows the payload.
        if isinstance(p, RankStarted):
            if started_at is None:
                started_at = at
            if open_ is not None and p.generation > open_.generation_at_fault:
                open_.marks.setdefault("restarted", at)
                open_.restarted_nodes.add(p.node_id)
                _process_started(open_, p, at)
            if p.generation > generation:
                generations.append((at, p.generation))
            generation = max(generation, p.generation)
            continue
        if isinstance(p, RanksRestartRequested):
            requested.setdefault(p.generation, at)
        if started_at is None:
            continue
        if isinstance(p, FaultInjected) and p.kind == "slow" and p.params.get("at_step") is None:
            # The job keeps training, slower: no stop, so no incident; its slow steps are charged at the
            # conviction (fail_slow_charge), from here.
            slow_since = slow_since or at
        elif isinstance(p, FaultInjected) and open_ is None:
            if p.params.get("at_step") is not None:
                # It fires only when the rank reaches that step: the wait until then is not lost time, and
                # its first failure signal (a hang's dated back by its own evidence) starts the incident.
                continue
            open_ = Incident(at, f"injected {p.kind} on {p.node_id}", max_step, generation)
            incidents.append(open_)
        elif isinstance(p, IncidentOpened) and p.kind in ("code_update", "fail_slow") and open_ is None:
            # A planned restart onto a new code version, or the eviction of a convicted slow group: no crash,
            # but the time it takes is lost all the same (a slow group's steps before it: see FailSlowConvicted).
            what = "planned restart" if p.kind == "code_update" else "fail-slow eviction"
            open_ = Incident(at, f"{what}: {p.reason[:120]}", max_step, generation)
            incidents.append(open_)
            open_.marks.setdefault("detected", at)
        elif isinstance(p, FailSlowConvicted):
            not_before = max([_last_recovery(incidents, started_at), *(g_at for g_at, _ in generations[-1:])])
            fail_slow.append(fail_slow_charge(p, at if open_ is None else min(at, open_.started_at), not_before,
                                              step_times, generation, slow_since))
            slow_since = None
        elif _is_failure_signal(p) or isinstance(p, RankExited):
            if open_ is not None and isinstance(p, RankExited) and open_.candidate is not None \
                    and p.generation >= open_.candidate[0] and p.classification != "success":
                open_.candidate = None  # the new generation ended before it was seen running: not recovered
            if not _is_failure_signal(p):
                continue
            if open_ is None:
                not_before = max([started_at, *(i.recovered_at for i in incidents if i.recovered_at is not None)])
                open_ = Incident(max(at - symptom_age(p), not_before), _describe(p), max_step, generation)
                incidents.append(open_)
            open_.marks.setdefault("detected", at)
        elif kind in _COMMANDS and open_ is not None and not getattr(p, "observe_only", False):
            open_.marks.setdefault("decided", at)
        elif isinstance(p, IncidentResolved) and open_ is not None and p.rung == 0 and p.outcome == "recovered" \
                and "restarted" not in open_.marks:
            # The controller found the stall cleared itself (every node stepped on; nothing restarted): the
            # incident ended when the job first stepped past where it stood, or at the resolution.
            back = open_.stepped_on_at or at
            open_.marks.setdefault("resumed", back)
            open_.marks["recovered"] = max(back, open_.marks["resumed"])
            open_ = None
        elif isinstance(p, CheckpointRestorePlanned) and open_ is not None and p.generation > open_.generation_at_fault:
            open_.restore_step = p.step
        elif isinstance(p, NodeHeartbeat) and not p.standby:
            step = p.last_step
            generation_began = generations[-1][0] if generations else started_at
            checkpointing.heartbeat(p, at, in_incident=open_ is not None,
                                    not_before=_last_recovery(incidents, started_at), generation_began=generation_began)
            if p.step_time_p50_s is not None and p.generation in (None, generation) \
                    and at >= generation_began + FAIL_SLOW_WARMUP:
                step_times.add(at, generation, p.step_time_p50_s)
            sdk_seen = sdk_seen or p.ranks_reporting is None or p.ranks_reporting > 0 or step >= 0
            if open_ is not None and not sdk_seen and _process_recovered(open_, p):
                open_ = None
                continue
            if open_ is not None and "restarted" not in open_.marks and open_.stepped_on_at is None \
                    and step > open_.step_at_fault and p.generation in (None, open_.generation_at_fault):
                open_.stepped_on_at = at
            # Only a node that started the new generation speaks for it: another's heartbeat may still
            # carry the step its old ranks reached before they were stopped.
            if open_ is not None and "restarted" in open_.marks and p.node_id in open_.restarted_nodes:
                floor = open_.restore_step if open_.restore_step is not None else -1
                if step > floor:
                    open_.marks.setdefault("resumed", at)
                if step >= open_.step_at_fault and "resumed" in open_.marks:
                    open_.marks["recovered"] = back_at_step(open_.last_beat, (at, step), open_.step_at_fault,
                                                            open_.marks["resumed"])
                    open_ = None
                elif "resumed" in open_.marks:
                    open_.last_beat = (at, step)
            max_step = max(max_step, step)
    if started_at is None or last_at is None:
        return None
    end = max(until, last_at) if until is not None else last_at
    if not sdk_seen:
        for incident in incidents:
            incident.measure = "process"
    overheads = sorted([*checkpointing.pieces, *fail_slow], key=lambda o: o.started_at)
    return EttrReport(started_at, end, tuple(incidents), tuple(generations),
                      tuple(sorted(((at, g) for g, at in requested.items()), key=lambda item: item[0])),
                      measure="step" if sdk_seen else "process", overheads=tuple(overheads))


def _last_recovery(incidents: list[Incident], default: datetime) -> datetime:
    """When the newest recovered incident ended (incidents follow one another: the last recovered is the
    newest), else ``default``. Constant time for the usual case of a recovered last incident."""
    return next((i.recovered_at for i in reversed(incidents) if i.recovered_at is not None), default)


CHECKPOINT_PIECE_SPAN = timedelta(minutes=1)
"""Consecutive checkpoint charges are merged into pieces up to this long (a window's edge is that exact)."""


class _CheckpointCharge:
    """The job's checkpoint overhead from the heartbeats' running totals (see the module docstring)."""

    def __init__(self) -> None:
        self.last_total: dict[tuple[str, int | None], float] = {}
        """Per (node, generation): the newest running total seen."""
        self.last_beat_at: dict[tuple[str, int | None], datetime] = {}
        self.node_charged: dict[int | None, dict[str, float]] = {}
        """Per generation, per node: the seconds charged from its totals (outside incidents)."""
        self.generation_charged: dict[int | None, float] = {}
        """Per generation: the largest node's charged seconds, which the job was charged."""
        self.pieces: list[Overhead] = []

    def heartbeat(self, p: NodeHeartbeat, at: datetime, *, in_incident: bool, not_before: datetime,
                  generation_began: datetime) -> None:
        key = (p.node_id, p.generation)
        last_at = self.last_beat_at.get(key)
        if last_at is not None and at < last_at:
            return  # older than a heartbeat already seen from that node: its total is no news
        # A node's first heartbeat of a generation counts from when the generation began.
        since = min(last_at if last_at is not None else generation_began, at)
        self.last_beat_at[key] = at
        if p.checkpoint_blocking_s is None:
            return
        before = self.last_total.get(key, 0.0)
        self.last_total[key] = p.checkpoint_blocking_s
        # A total below the last one is a new count (a rank restarted in place: a new process counts from 0).
        grown = p.checkpoint_blocking_s - before if p.checkpoint_blocking_s >= before else p.checkpoint_blocking_s
        if grown <= 0 or in_incident:
            return
        if since < not_before < at:  # only the part of the interval after the last recovery is not an incident's
            grown *= (at - not_before) / (at - since)
            since = not_before
        per_node = self.node_charged.setdefault(p.generation, {})
        node = per_node.get(p.node_id, 0.0) + grown
        per_node[p.node_id] = node
        charged = self.generation_charged.get(p.generation, 0.0)
        if node <= charged:
            return  # another node of this generation blocked longer: the job waited for that one
        lost = timedelta(seconds=node - charged)
        self.generation_charged[p.generation] = node
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last.started_at < last.ended_at == since and at - last.started_at <= CHECKPOINT_PIECE_SPAN:
            self.pieces[-1] = replace(last, ended_at=at, lost=last.lost + lost)
        else:
            self.pieces.append(Overhead("checkpoint", since, at, lost, "training blocked in checkpointing"))


class _StepTimes:
    """The running generation's recent heartbeats' median step times (``step_time_p50_s``), for fail-slow."""

    def __init__(self) -> None:
        self.beats: deque[tuple[datetime, float]] = deque()
        self.generation: int | None = None
        self.healthy: float | None = None
        """This generation's healthy median step time, once a conviction measured it: a later conviction
        (the controller declined the first; the node is still slow) compares with it, not with slow steps."""
        self.charged_until: datetime | None = None
        """The end of this generation's last fail-slow charge: no span is charged twice."""

    def add(self, at: datetime, generation: int, step_time_s: float) -> None:
        self.reset_for(generation)
        self.beats.append((at, step_time_s))
        while self.beats and self.beats[0][0] < at - FAIL_SLOW_LOOKBACK:
            self.beats.popleft()

    def median(self, start: datetime, end: datetime, *, closed: bool) -> float | None:
        """The median over ``[start, end)`` (``closed``: ``[start, end]``); None without a heartbeat there."""
        values = [v for t, v in self.beats if start <= t and (t <= end if closed else t < end)]
        return statistics.median(values) if values else None

    def reset_for(self, generation: int) -> None:
        """Forget another generation's step times (a restart: new ranks, maybe another machine)."""
        if generation != self.generation:
            self.beats.clear()
            self.generation, self.healthy, self.charged_until = generation, None, None


def fail_slow_charge(p: FailSlowConvicted, until: datetime, floor: datetime, step_times: _StepTimes,
                     generation: int, slow_since: datetime | None = None) -> Overhead:
    """The steps a convicted slow group cost before its conviction (see the module docstring): over
    ``[S, until]``, S = ``rounds x interval_s`` back and never before ``floor``, ``(until - S) x
    (1 - healthy / degraded)``. Without a baseline (no heartbeat of this generation in the span before S)
    the charge is 0 and ``detail`` says why. ``slow_since``: when an injected slow fault began (the span
    starts there instead). A later conviction in the same generation charges only after the previous
    charge's span, against the healthy median the first one measured."""
    step_times.reset_for(generation)
    start = max(slow_since if slow_since is not None and slow_since < until
                else until - timedelta(seconds=p.rounds * p.interval_s), floor, step_times.charged_until or floor)
    nodes = ", ".join(p.group_nodes)
    if start >= until:
        return Overhead("fail_slow", until, until, timedelta(0),
                        f"{nodes}: no slow time left to charge (the span lies before the job or generation began, "
                        "the last recovery, an incident open then, or the previous conviction's charge)")
    healthy = step_times.healthy
    if healthy is None:
        healthy = step_times.healthy = step_times.median(start - max(until - start, FAIL_SLOW_BASELINE), start,
                                                         closed=False)
    degraded = step_times.median(start, until, closed=True)
    if healthy is not None and degraded is not None and degraded > 0:
        step_times.charged_until = until
    if healthy is None or degraded is None or degraded <= 0:
        return Overhead("fail_slow", start, until, timedelta(0),
                        f"{nodes}: no baseline (no step time of generation {generation} before the slow span): "
                        "not charged")
    share = max(0.0, 1.0 - healthy / degraded)
    return Overhead("fail_slow", start, until, (until - start) * share,
                    f"{nodes}: median step {degraded:.3g} s against {healthy:.3g} s before, over "
                    f"{(until - start).total_seconds():.0f} s")


def back_at_step(before: tuple[datetime, int] | None, after: tuple[datetime, int], target: int,
                 not_before: datetime) -> datetime:
    """When the job was back at step ``target``: heartbeats come every few seconds, so between the last one
    below it (``before``) and the first at or past it (``after``) the time is interpolated at the steps' rate
    in between (training steps at a steady pace there: it is recomputing). Without ``before``, ``after``'s."""
    at, step = after
    if before is None or step <= before[1] or before[0] >= at:
        return at
    estimate = before[0] + (at - before[0]) * ((target - before[1]) / (step - before[1]))
    return max(min(estimate, at), not_before)


def _process_started(incident: Incident, p: RankStarted, at: datetime) -> None:
    """A rank of a generation newer than the fault's started: once every rank of that generation has
    (the world size), it is the process-level recovery candidate, timed at the last start."""
    ranks = incident.started_ranks.setdefault(p.generation, set())
    ranks.add(p.rank)
    incident.started_nodes.setdefault(p.generation, set()).add(p.node_id)
    last = incident.last_start.get(p.generation)
    incident.last_start[p.generation] = at if last is None or at > last else last
    newest = incident.candidate[0] if incident.candidate is not None else -1
    if len(ranks) >= p.world_size and p.generation >= newest:
        if p.generation > newest:
            incident.confirmed = set()
        incident.candidate = (p.generation, incident.last_start[p.generation])


def _process_recovered(incident: Incident, p: NodeHeartbeat) -> bool:
    """A job without the SDK: a heartbeat of the candidate generation showing all of a node's ranks alive
    confirms that node; once every node that started the generation is confirmed, the incident recovered
    when its last rank started (process-level). True when it did."""
    if incident.candidate is None:
        return False
    generation, at = incident.candidate
    if p.generation != generation or not 0 < p.ranks_expected <= p.ranks_alive:
        return False
    incident.confirmed.add(p.node_id)
    if not incident.started_nodes.get(generation, set()) <= incident.confirmed:
        return False
    incident.marks.setdefault("resumed", at)
    incident.marks["recovered"] = max(at, incident.marks["resumed"])
    incident.measure = "process"
    return True


RANK_HANG_CHECKS = {"collective_stuck": "waited_s", "process_stopped": "stopped_s", "no_progress": "silent_for_s",
                    "heartbeat_lost": "silent_for_s"}
"""A rank's hang checks, each with the evidence key that says how long the rank had been stuck when it fired."""


def _is_failure_signal(p: EventPayload) -> TypeGuard[RankExited | NodeHealthChanged]:
    if isinstance(p, RankExited):
        return p.classification in _FAILURE_CLASSES
    if isinstance(p, NodeHealthChanged):
        return p.status == "failed" and (p.is_fatal or (p.component == "rank" and p.check in RANK_HANG_CHECKS))
    return False


def symptom_age(p: RankExited | NodeHealthChanged) -> timedelta:
    """How long before its signal the fault began, by the signal's own evidence (0 when it does not say)."""
    if isinstance(p, NodeHealthChanged) and p.component == "rank" and p.check in RANK_HANG_CHECKS:
        value = p.evidence.get(RANK_HANG_CHECKS[p.check])
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 86_400:
            return timedelta(seconds=float(value))
    return timedelta(0)


def _describe(p: RankExited | NodeHealthChanged) -> str:
    if isinstance(p, RankExited):
        return f"rank {p.rank} on {p.node_id} exited ({p.classification}{': ' + p.error_type if p.error_type else ''})"
    return f"{p.component} {p.check} failed on {p.node_id}"

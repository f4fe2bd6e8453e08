"""ETTR and incidents from the event log (pure): how much of a job's wall time was productive, and where
every lost minute went.

An *incident* starts at the fault (``FaultInjected`` when the fault was injected on purpose, else the
first failure signal) and ends when the job is back at the step it had reached when the fault hit.
Its lost time is split into phases, each from one event to the next:

- detection:    fault -> first failure signal (``RankExited`` with a failure classification, or a failed
                fatal ``NodeHealthChanged``);
- localisation: signal -> the controller's first command (``RanksRestartRequested``, ``NodeEvictionDecided``);
- failover:     command -> the first rank of the new generation started (``RankStarted``);
- restore:      started -> the new generation stepping past its restore point (``NodeHeartbeat.last_step``
                above the ``CheckpointRestorePlanned`` step, or above -1 with no plan);
- recompute:    stepping -> back at the step reached when the fault hit.

A phase whose closing event never came is charged up to the end of the log (the job is still down).
ETTR = 1 - sum(lost) / (end - start of the job). Everything comes from events' ``occurred_at``: the
same log always gives the same report.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from keel.core.events import Event

__all__ = ["EttrReport", "Incident", "PHASES", "compute_ettr"]

PHASES = ("detection", "localisation", "failover", "restore", "recompute")
_FAILURE_CLASSES = {"user_code", "infrastructure", "unknown"}
_COMMANDS = {"RanksRestartRequested", "NodeEvictionDecided"}


@dataclass
class Incident:
    started_at: datetime
    cause: str
    step_at_fault: int
    generation_at_fault: int
    marks: dict[str, datetime] = field(default_factory=dict)
    """detected, decided, restarted, resumed, recovered: when each happened."""
    restore_step: int | None = None

    @property
    def recovered_at(self) -> datetime | None:
        return self.marks.get("recovered")

    def phases(self, end: datetime) -> dict[str, timedelta]:
        """Each phase's duration; an unfinished one runs to ``end``."""
        bounds = [self.started_at]
        for mark in ("detected", "decided", "restarted", "resumed", "recovered"):
            bounds.append(self.marks.get(mark, end))
        # A mark can come before the previous one (a command before a late detection event): clamp.
        out: dict[str, timedelta] = {}
        for name, (a, b) in zip(PHASES, zip(bounds, bounds[1:]), strict=True):
            out[name] = max(timedelta(0), min(b, end) - min(a, end))
        return out

    def lost(self, end: datetime) -> timedelta:
        return (self.recovered_at or end) - self.started_at

    def to_json(self, end: datetime) -> dict[str, Any]:
        return {"started_at": self.started_at.isoformat(), "cause": self.cause, "step_at_fault": self.step_at_fault,
                "recovered": self.recovered_at is not None, "lost_s": self.lost(end).total_seconds(),
                "phases_s": {k: v.total_seconds() for k, v in self.phases(end).items()},
                "marks": {k: v.isoformat() for k, v in self.marks.items()}, "restore_step": self.restore_step}


@dataclass(frozen=True)
class EttrReport:
    started_at: datetime
    ended_at: datetime
    incidents: tuple[Incident, ...]

    @property
    def wall(self) -> timedelta:
        return self.ended_at - self.started_at

    @property
    def lost(self) -> timedelta:
        return sum((i.lost(self.ended_at) for i in self.incidents), timedelta(0))

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


def compute_ettr(events: Iterable[Event], *, until: datetime | None = None) -> EttrReport | None:
    """The report for one job's events (in log order); None before the job's first rank started."""
    started_at: datetime | None = None
    last_at: datetime | None = None
    max_step = -1
    generation = 0
    incidents: list[Incident] = []
    open_: Incident | None = None
    for event in events:
        p, kind, at = event.payload, event.type, event.occurred_at
        last_at = at if last_at is None or at > last_at else last_at
        if kind == "RankStarted":
            if started_at is None:
                started_at = at
            if open_ is not None and p.generation > open_.generation_at_fault:
                open_.marks.setdefault("restarted", at)
            generation = max(generation, p.generation)
            continue
        if started_at is None:
            continue
        if kind == "FaultInjected" and open_ is None:
            open_ = Incident(at, f"injected {p.kind} on {p.node_id}", max_step, generation)
            incidents.append(open_)
        elif _is_failure_signal(kind, p):
            if open_ is None:
                open_ = Incident(at, _describe(kind, p), max_step, generation)
                incidents.append(open_)
            open_.marks.setdefault("detected", at)
        elif kind in _COMMANDS and open_ is not None and not getattr(p, "observe_only", False):
            open_.marks.setdefault("decided", at)
        elif kind == "CheckpointRestorePlanned" and open_ is not None and p.generation > open_.generation_at_fault:
            open_.restore_step = p.step
        elif kind == "NodeHeartbeat" and not p.standby:
            step = p.last_step
            if open_ is not None and "restarted" in open_.marks:
                floor = open_.restore_step if open_.restore_step is not None else -1
                if step > floor:
                    open_.marks.setdefault("resumed", at)
                if step >= open_.step_at_fault and "resumed" in open_.marks:
                    open_.marks["recovered"] = at
                    open_ = None
            max_step = max(max_step, step)
    if started_at is None or last_at is None:
        return None
    end = max(until, last_at) if until is not None else last_at
    return EttrReport(started_at, end, tuple(incidents))


def _is_failure_signal(kind: str, p: Any) -> bool:
    if kind == "RankExited":
        return p.classification in _FAILURE_CLASSES
    if kind == "NodeHealthChanged":
        return p.status == "failed" and p.is_fatal
    return False


def _describe(kind: str, p: Any) -> str:
    if kind == "RankExited":
        return f"rank {p.rank} on {p.node_id} exited ({p.classification}{': ' + p.error_type if p.error_type else ''})"
    return f"{p.component} {p.check} failed on {p.node_id}"

"""The controller's guardrails (pure): what stops the ladder from doing harm when its inputs lie.

- ``EvictionBreaker``: no more than ``max_evictions`` evictions, nor more than ``max_fraction`` of the
  job's nodes, within any sliding ``window``. A flood of "bad node" signals is far more often a broken
  probe, a switch or a bad driver push than that many bad machines; past the limit the controller
  stops evicting and pages a human.
- ``CrashLoopBreaker``: a job-wide restart budget per window, and the same failure fingerprint
  ``max_same`` times in a row means restarting will not help (rung 6: stop the job and page).
- ``failure_fingerprint``: what makes two failures "the same": the exit classification and error type,
  plus the innermost frame of the traceback, with numbers (addresses, ranks, steps) masked.

Every check returns a ``Verdict`` with a reason that names the numbers. Times are inputs (the events'
``occurred_at``), never read from a clock, so a replay reaches the same verdicts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

__all__ = ["CrashLoopBreaker", "EvictionBreaker", "Verdict", "failure_fingerprint"]


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str


@dataclass(frozen=True)
class EvictionBreaker:
    """Evictions allowed within any sliding ``window``: at most ``max_evictions`` and at most
    ``max_fraction`` of ``job_nodes`` (the smaller limit wins; at least one eviction is always allowed
    so a single dead node is never stuck behind the fraction on a small job)."""

    window: timedelta = timedelta(hours=1)
    max_evictions: int = 8
    max_fraction: float = 0.1
    history: tuple[datetime, ...] = ()

    def limit(self, job_nodes: int) -> int:
        return max(1, min(self.max_evictions, int(self.max_fraction * job_nodes)))

    def recent(self, now: datetime) -> tuple[datetime, ...]:
        return tuple(t for t in self.history if now - t < self.window)

    def check(self, now: datetime, job_nodes: int) -> Verdict:
        recent, limit = self.recent(now), self.limit(job_nodes)
        if len(recent) >= limit:
            return Verdict(False, f"eviction circuit breaker open: {len(recent)} eviction(s) in the last "
                                  f"{_fmt(self.window)} reach the limit of {limit} (min of {self.max_evictions} and "
                                  f"{self.max_fraction:.0%} of {job_nodes} nodes); evicting more looks like a "
                                  f"fleet-wide cause, paging a human instead")
        return Verdict(True, f"{len(recent)} of {limit} evictions allowed in {_fmt(self.window)} used")

    def record(self, now: datetime) -> EvictionBreaker:
        return EvictionBreaker(self.window, self.max_evictions, self.max_fraction, (*self.recent(now), now))


@dataclass(frozen=True)
class CrashLoopBreaker:
    """A job-wide restart budget per ``window`` and a limit on the same failure in a row."""

    window: timedelta = timedelta(hours=1)
    restart_budget: int = 10
    max_same: int = 3
    restarts: tuple[datetime, ...] = ()
    fingerprints: tuple[str, ...] = field(default_factory=tuple)
    """The fingerprints of the failures since the job last made progress, oldest first."""

    def check(self, now: datetime, fingerprint: str) -> Verdict:
        recent = [t for t in self.restarts if now - t < self.window]
        if len(recent) >= self.restart_budget:
            return Verdict(False, f"restart budget spent: {len(recent)} restart(s) in the last {_fmt(self.window)} "
                                  f"(budget {self.restart_budget}); stopping the job and paging a human")
        streak = 1
        for previous in reversed(self.fingerprints):
            if previous != fingerprint:
                break
            streak += 1
        if streak >= self.max_same:
            return Verdict(False, f"crash loop: the same failure {streak} times in a row ({fingerprint}); "
                                  f"a restart will not fix it, stopping the job and paging a human")
        return Verdict(True, f"restart {len(recent) + 1} of {self.restart_budget} in {_fmt(self.window)}; "
                             f"this failure seen {streak} time(s) in a row (limit {self.max_same})")

    def record(self, now: datetime, fingerprint: str) -> CrashLoopBreaker:
        recent = tuple(t for t in self.restarts if now - t < self.window)
        return CrashLoopBreaker(self.window, self.restart_budget, self.max_same, (*recent, now),
                                (*self.fingerprints[-(self.max_same - 1):], fingerprint) if self.max_same > 1 else ())

    def progressed(self) -> CrashLoopBreaker:
        """The job stepped past where it failed: the failures so far were not a loop."""
        return CrashLoopBreaker(self.window, self.restart_budget, self.max_same, self.restarts, ())


_FRAME = re.compile(r'File "([^"]+)", line \d+, in (\S+)')
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


def failure_fingerprint(classification: str, error_type: str, stderr_tail: str) -> str:
    """``classification/error_type@file:function`` of the innermost traceback frame; numbers masked so
    the same bug on another rank, step or address fingerprints the same."""
    frames: Sequence[tuple[str, str]] = _FRAME.findall(stderr_tail)
    where = ""
    if frames:
        path, function = frames[-1]
        where = f"@{path.rsplit('/', 1)[-1]}:{function}"
    elif stderr_tail.strip():
        where = "@" + _NUMBERS.sub("N", stderr_tail.strip().splitlines()[-1])[:80]
    return f"{classification}/{error_type or '?'}{where}"


def _fmt(window: timedelta) -> str:
    seconds = int(window.total_seconds())
    if seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    if seconds % 60 == 0:
        return f"{seconds // 60} min"
    return f"{seconds} s"

"""Replay: fold a recorded log through the current decider and diff its decisions against the log.

Pure: the caller streams the events (from Postgres, see ``keel replay``) in position order. A
decision is identified by its deterministic id (cause, decider, type, key), so the comparison is
exact: a decision the current code makes that the log lacks is ``missing``; a recorded decision the
current code no longer makes is ``unexpected``; the same decision with a different payload or subject
is ``changed``. The decider follows the recorded history either way, so one divergence does not
cascade into noise.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from keel.events.envelope import Event
from keel.kernel.decider import Decider, DeciderSession

S = TypeVar("S")


@dataclass(frozen=True)
class Divergence:
    kind: str  # "missing" | "unexpected" | "changed"
    cause_id: uuid.UUID
    cause_type: str
    decision_id: uuid.UUID
    decision_type: str
    recorded: dict[str, Any] | None
    replayed: dict[str, Any] | None
    replayed_reason: str = ""

    def describe(self) -> str:
        head = f"{self.kind.upper()} {self.decision_type} {self.decision_id} (cause {self.cause_type} {self.cause_id})"
        if self.kind == "missing":
            return f"{head}\n    the current code decides it, the log does not have it\n    reason now: {self.replayed_reason}"
        if self.kind == "unexpected":
            return f"{head}\n    the log has it, the current code no longer decides it"
        lines = [head]
        for path, old, new in _diff(self.recorded or {}, self.replayed or {}):
            lines.append(f"    {path}: recorded {old!r} -> replayed {new!r}")
        if self.replayed_reason:
            lines.append(f"    reason now: {self.replayed_reason}")
        return "\n".join(lines)


def _diff(old: Any, new: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += _diff(old.get(key), new.get(key), f"{path}.{key}" if path else str(key))
        return out
    return [] if old == new else [(path or "(value)", old, new)]


@dataclass
class ReplayReport(Generic[S]):
    decider: str
    events_folded: int = 0
    decisions_recorded: int = 0
    decisions_replayed: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    final_state: S | None = None

    @property
    def clean(self) -> bool:
        return not self.divergences

    def summary(self) -> str:
        verdict = "clean" if self.clean else f"{len(self.divergences)} divergence(s)"
        return (
            f"{self.decider}: folded {self.events_folded} events, {self.decisions_recorded} recorded decisions, "
            f"{self.decisions_replayed} replayed: {verdict}"
        )

    def details(self, limit: int = 8) -> str:
        """The summary and the first ``limit`` divergences described, for a failing test or a log line."""
        lines = [self.summary(), *(d.describe() for d in self.divergences[:limit])]
        if len(self.divergences) > limit:
            lines.append(f"... and {len(self.divergences) - limit} more")
        return "\n".join(lines)


def _comparable(event: Event) -> dict[str, Any]:
    wire = event.to_wire()
    return {key: wire[key] for key in ("type", "subject", "job_id", "causation_id", "correlation_id", "payload")}


class ReplayVerifier(Generic[S]):
    """``verify`` one event at a time, so a log of any length streams through in constant memory
    (only decisions not yet matched are held)."""

    def __init__(self, decider: Decider[S], *, max_event_bytes: int | None = None) -> None:
        self.decider = decider
        self.session = DeciderSession(decider, max_event_bytes=max_event_bytes)
        self.report: ReplayReport[S] = ReplayReport(decider.name)
        self._pending: dict[uuid.UUID, tuple[Event, Event, str]] = {}  # decision id -> (cause, replayed, reason)

    def observe(self, event: Event) -> None:
        report, decider = self.report, self.decider
        report.events_folded += 1
        if event.producer == decider.name and event.causation_id is not None:
            report.decisions_recorded += 1
            match = self._pending.pop(event.id, None)
            if match is None:
                report.divergences.append(
                    Divergence("unexpected", event.causation_id, "?", event.id, event.type, _comparable(event), None)
                )
            else:
                cause, replayed, reason = match
                if _comparable(replayed) != _comparable(event):
                    report.divergences.append(
                        Divergence(
                            "changed", cause.id, cause.type, event.id, event.type,
                            _comparable(event), _comparable(replayed), reason,
                        )
                    )
        result = self.session.observe(event)
        if result.decision is not None:
            for produced in result.emitted:
                report.decisions_replayed += 1
                self._pending[produced.id] = (event, produced, result.decision.reason)

    def finish(self) -> ReplayReport[S]:
        """Decisions the code made that the log never recorded are ``missing``."""
        for cause, replayed, reason in self._pending.values():
            self.report.divergences.append(
                Divergence("missing", cause.id, cause.type, replayed.id, replayed.type, None, _comparable(replayed), reason)
            )
        self._pending.clear()
        self.report.final_state = self.session.state
        return self.report


def verify(decider: Decider[S], events: Iterable[Event]) -> ReplayReport[S]:
    """Run ``decider`` over the recorded ``events`` and compare its decisions with the recorded ones."""
    verifier = ReplayVerifier(decider)
    for event in events:
        verifier.observe(event)
    return verifier.finish()

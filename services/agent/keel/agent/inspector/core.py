"""The pure inspector core: samples in, health state changes out.

``InspectorCore.step(state, observations, now) -> (state, events)`` is a pure function: time is an
argument, state is immutable, and the output is the list of ``NodeHealthChanged`` payloads for the
signals whose reported state *changed* (never one per sample). Hysteresis is per signal
``(component, check, key)``; the rules, in order:

1. A ``failed``, high-confidence, fatal sample (GPU lost, fatal XID, disk I/O error, machine check)
   fails the signal at once.
2. An ``immediate`` sample (the probe already applied a calibrated threshold: a rank hang, a full
   disk) is taken as is.
3. A ``failed`` sample marked ``fatal_if_persists`` that has been bad for ``persist_fatal_after``
   becomes failed, high-confidence and fatal (a NIC that stays down).
4. Soft occurrences within ``soft_repeat_window``: the first is ``degraded``/low, later ones
   ``degraded``/medium, the ``soft_repeat_count``-th ``failed``/medium. Old occurrences decay.

While a signal is bad its reported state only escalates. It recovers (``healthy``) once its samples
have been clear for ``recovery_hold`` (``fatal_recovery_hold`` after a fatal state). A signal that
is not sampled keeps its state: "no information" is not "clear".

Each event carries the reason in ``detail`` and evidence with the signal ``key``, the probe's
evidence, and ``node_status`` (the worst reported status of the node after this change), because
one event speaks for one check, not for the whole node.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from keel.events.types import NodeHealthChanged

from .observation import CONFIDENCE_RANK, STATUS_RANK, Confidence, Observation, Status
from .policy import InspectorPolicy

SignalKey = tuple[str, str, str]


@dataclass(frozen=True)
class Verdict:
    status: Status = "healthy"
    confidence: Confidence = "high"
    is_fatal: bool = False

    @property
    def severity(self) -> tuple[int, int, int]:
        return (STATUS_RANK[self.status], int(self.is_fatal), CONFIDENCE_RANK[self.confidence])


HEALTHY = Verdict()


@dataclass(frozen=True)
class SignalState:
    reported: Verdict = HEALTHY
    reported_detail: str = ""
    occurrences: tuple[datetime, ...] = ()
    """When soft occurrences happened, within the repeat window."""
    last_sample_bad: bool = False
    bad_since: datetime | None = None
    clear_since: datetime | None = None
    announced: bool = False


@dataclass(frozen=True)
class InspectorState:
    signals: dict[SignalKey, SignalState] = field(default_factory=dict)

    def node_status(self) -> Status:
        worst = max((s.reported.severity[0] for s in self.signals.values()), default=0)
        return next(name for name, rank in STATUS_RANK.items() if rank == worst)

    def reported(self, component: str, check: str, key: str) -> Verdict:
        return self.signals.get((component, check, key), SignalState()).reported


def _seconds(delta: timedelta) -> float:
    return round(delta.total_seconds(), 3)


class InspectorCore:
    """Hysteresis over probe samples for one node. Pure: same inputs, same outputs."""

    def __init__(self, node_id: str, policy: InspectorPolicy | None = None) -> None:
        self.node_id = node_id
        self.policy = policy or InspectorPolicy()

    def initial_state(self) -> InspectorState:
        return InspectorState()

    def step(
        self, state: InspectorState, observations: list[Observation], now: datetime
    ) -> tuple[InspectorState, list[NodeHealthChanged]]:
        if now.tzinfo is None:
            raise ValueError("now must be timezone-aware (UTC)")
        signals = dict(state.signals)
        changes: list[tuple[Observation, Verdict, str, dict[str, Any]]] = []
        for obs in observations:
            before = signals.get(obs.signal, SignalState())
            after, change = self._sample(before, obs, now)
            signals[obs.signal] = after
            if change is not None:
                changes.append((obs, *change))
        new_state = InspectorState(signals=signals)
        node_status = new_state.node_status()
        events = [
            NodeHealthChanged(
                node_id=self.node_id,
                status=verdict.status,
                component=obs.component,
                check=obs.check,
                confidence=verdict.confidence,
                is_fatal=verdict.is_fatal,
                detail=detail,
                evidence={"key": obs.key, **evidence, "node_status": node_status},
            )
            for obs, verdict, detail, evidence in changes
        ]
        return new_state, events

    # -- one sample of one signal -------------------------------------------------------------------

    def _sample(
        self, s: SignalState, obs: Observation, now: datetime
    ) -> tuple[SignalState, tuple[Verdict, str, dict[str, Any]] | None]:
        p = self.policy
        horizon = now - p.soft_repeat_window
        occurrences = tuple(t for t in s.occurrences if t > horizon)

        if obs.informational:
            if s.announced:
                return replace(s, occurrences=occurrences), None
            return replace(s, occurrences=occurrences, announced=True), (HEALTHY, obs.detail, dict(obs.evidence))

        if obs.status == "healthy":
            clear_since = s.clear_since if s.clear_since is not None else now
            s = replace(s, occurrences=occurrences, last_sample_bad=False, bad_since=None, clear_since=clear_since)
            if s.reported.status == "healthy":
                return s, None
            hold = p.fatal_recovery_hold if s.reported.is_fatal else p.recovery_hold
            clear_for = now - clear_since
            if clear_for < hold:
                return s, None
            detail = (
                f"{obs.check} {obs.key} recovered: clear for {_seconds(clear_for)}s (hold {_seconds(hold)}s); "
                f"was {s.reported.status}: {s.reported_detail}"
            )
            evidence = {**obs.evidence, "clear_for_s": _seconds(clear_for), "previous_status": s.reported.status}
            return replace(s, reported=HEALTHY, reported_detail=detail), (HEALTHY, detail, evidence)

        # a bad sample
        rising = not s.last_sample_bad
        new = obs.new_events if obs.new_events is not None else (1 if rising else 0)
        occurrences = occurrences + (now,) * max(new, 0)
        bad_since = s.bad_since if s.bad_since is not None else now
        s = replace(s, occurrences=occurrences, last_sample_bad=True, bad_since=bad_since, clear_since=None)
        count = len(occurrences)
        window_s = _seconds(p.soft_repeat_window)
        evidence = dict(obs.evidence)

        if obs.is_fatal_hardware:
            target = Verdict("failed", "high", True)
            detail = f"fatal {obs.component} signal: {obs.detail}"
        elif obs.immediate:
            target = Verdict(obs.status, obs.confidence, obs.is_fatal)
            detail = obs.detail
        elif obs.fatal_if_persists and obs.status == "failed" and now - bad_since >= p.persist_fatal_after:
            target = Verdict("failed", "high", True)
            detail = f"{obs.detail}; persisted for {_seconds(now - bad_since)}s (limit {_seconds(p.persist_fatal_after)}s)"
            evidence["bad_for_s"] = _seconds(now - bad_since)
        elif count >= p.soft_repeat_count:
            target = Verdict("failed", "medium", False)
            detail = f"{obs.detail}; occurrence {count} within {window_s}s (tolerated {p.soft_repeat_count - 1})"
            evidence.update(occurrences=count, window_s=window_s)
        else:
            confidence: Confidence = "low" if count <= 1 else "medium"
            target = Verdict("degraded", confidence, False)
            detail = f"{obs.detail}; occurrence {count} of {p.soft_repeat_count} within {window_s}s, tolerated"
            evidence.update(occurrences=count, window_s=window_s)

        # while bad, the reported state only escalates
        if s.reported.status != "healthy" and target.severity <= s.reported.severity:
            return s, None
        return replace(s, reported=target, reported_detail=obs.detail), (target, detail, evidence)

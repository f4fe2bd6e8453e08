"""The operations metrics of the whole control plane, derived from the event log (no I/O here).

``OpsMetrics`` folds recorded events, in log order, into Prometheus metrics; ``render()`` gives them in the
text exposition format, with the store's totals (``StoreTotals``) beside them. The same log gives the same
metrics whoever folds it, so a restarted exporter loses nothing: it folds the log again. Metric names follow
Prometheus' conventions (``_total`` counters, base units, ``_seconds``, ``_ratio``); ``METRICS`` lists every one,
and the Grafana dashboard in ``infra/grafana`` may use only these (a test checks). A training job is the
``training_job`` label, not ``job``: Prometheus sets ``job`` (and ``instance``) on every scraped sample itself,
and would rename a ``job`` label of ours to ``exported_job``.

ETTR and the incident phases are ``keel.rules.ettr.compute_ettr`` over each job's events, the same numbers as
``keel ettr``. Detection and recovery latencies are observed once per incident, when its resolution is folded.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from keel.events.envelope import Event
from keel.events.types import (
    CheckpointPersisted,
    CheckpointStepCommitted,
    IncidentOpened,
    IncidentResolved,
    NodeEvicted,
    RecorderLagReported,
    RestartDecided,
    StandbyPoolSized,
)
from keel.infra.metrics import Registry
from keel.rules.ettr import INPUT_TYPES, PHASES, compute_ettr

DECIDERS = frozenset({"controller", "analyzer", "checkpoint-broker", "hot-update"})
"""Producers whose events are decisions (``keel_decisions_total``)."""
LATENCY_BUCKETS_S = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
ETTR_WINDOW = timedelta(hours=1)

METRICS: dict[str, str] = {
    "keel_decisions_total": "counter",
    "keel_incidents_total": "counter",
    "keel_incidents_open": "gauge",
    "keel_incident_detection_seconds": "histogram",
    "keel_incident_recovery_seconds": "histogram",
    "keel_restarts_total": "counter",
    "keel_evicted_nodes_total": "counter",
    "keel_ettr_ratio": "gauge",
    "keel_ettr_window_ratio": "gauge",
    "keel_lost_seconds": "gauge",
    "keel_standby_ready": "gauge",
    "keel_standby_target": "gauge",
    "keel_checkpoint_step": "gauge",
    "keel_checkpoint_persisted_bytes": "gauge",
    "keel_events_recorded_total": "counter",
    "keel_events_dead_lettered_total": "counter",
    "keel_recorder_lag_events": "gauge",
    "keel_recorder_lag_seconds": "gauge",
}
"""Every metric ``render`` writes, with its type."""


@dataclass(frozen=True)
class StoreTotals:
    """What the store says of itself at a scrape: events recorded and dead letters."""

    events_recorded: int
    dead_lettered: int


@dataclass
class _Open:
    job: str
    kind: str
    opened_at: datetime


class OpsMetrics:
    """A fold of the event log into the operations metrics. ``apply`` each recorded event once, in log order."""

    def __init__(self) -> None:
        self.position = 0
        """The log position of the last event applied (0: none): where the next read starts."""
        self._decisions: dict[tuple[str, str], int] = defaultdict(int)
        self._restarts: dict[tuple[str, str], int] = defaultdict(int)
        self._evicted: dict[str, int] = defaultdict(int)
        self._incidents: dict[tuple[str, str, str, str], int] = defaultdict(int)
        self._open: dict[str, _Open] = {}
        self._recovery: list[tuple[str, str, float]] = []
        self._standby: dict[str, tuple[int, int]] = {}
        self._checkpoint_step: dict[tuple[str, str], int] = {}
        self._persisted_bytes: dict[str, int] = {}
        self._lag: tuple[int, float] | None = None
        self._ettr_inputs: dict[str, list[Event]] = defaultdict(list)
        self._last_at: dict[str, datetime] = {}

    def apply(self, event: Event, position: int | None = None) -> None:
        """Fold one event (``position``: its place in the log, remembered for the next read)."""
        if position is not None:
            self.position = max(self.position, position)
        job, kind, p = event.job_id, event.type, event.payload
        self._last_at[job] = max(self._last_at.get(job, event.occurred_at), event.occurred_at)
        if kind in INPUT_TYPES:
            self._ettr_inputs[job].append(event)
        if event.producer in DECIDERS:
            self._decisions[(event.producer, kind)] += 1
        if isinstance(p, IncidentOpened):
            self._open[str(event.id)] = _Open(job, p.kind, event.occurred_at)
        elif isinstance(p, IncidentResolved):
            opened = self._open.pop(p.incident_id, None)
            incident_kind = opened.kind if opened else "unknown"
            self._incidents[(job, incident_kind, str(p.rung), p.outcome)] += 1
            if opened is not None and p.outcome == "recovered":
                self._recovery.append((job, incident_kind, (event.occurred_at - opened.opened_at).total_seconds()))
        elif isinstance(p, RestartDecided):
            self._restarts[(job, str(p.rung))] += 1
        elif isinstance(p, NodeEvicted) and p.outcome == "evicted":
            self._evicted[job] += 1
        elif isinstance(p, StandbyPoolSized):
            self._standby[job] = (p.ready, p.target)
        elif isinstance(p, CheckpointStepCommitted):
            key = (job, str(p.tier))
            self._checkpoint_step[key] = max(self._checkpoint_step.get(key, -1), p.step)
        elif isinstance(p, CheckpointPersisted):
            self._persisted_bytes[job] = p.bytes
        elif isinstance(p, RecorderLagReported):
            self._lag = (p.pending, p.lag_s)

    def registry(self, totals: StoreTotals | None = None) -> Registry:
        """The metrics as of the events folded so far."""
        reg = Registry()
        decisions = reg.counter("keel_decisions_total", "Decision events, by decider and event type",
                                ("decider", "type"))
        for (decider, kind), n in sorted(self._decisions.items()):
            decisions.inc(n, decider=decider, type=kind)
        incidents = reg.counter("keel_incidents_total", "Incidents resolved, by kind, the rung that resolved them and "
                                "outcome", ("training_job", "kind", "rung", "outcome"))
        for (job, kind, rung, outcome), n in sorted(self._incidents.items()):
            incidents.inc(n, training_job=job, kind=kind, rung=rung, outcome=outcome)
        open_ = reg.gauge("keel_incidents_open", "Incidents open now", ("training_job",))
        for job in sorted({o.job for o in self._open.values()} | set(self._ettr_inputs)):
            open_.set(sum(1 for o in self._open.values() if o.job == job), training_job=job)
        recovery = reg.histogram("keel_incident_recovery_seconds", "From an incident opened to its resolution as "
                                 "recovered", ("training_job", "kind"), buckets=LATENCY_BUCKETS_S)
        for job, kind, seconds in self._recovery:
            recovery.observe(seconds, training_job=job, kind=kind)
        restarts = reg.counter("keel_restarts_total", "Restarts decided, by escalation-ladder rung", ("training_job", "rung"))
        for (job, rung), n in sorted(self._restarts.items()):
            restarts.inc(n, training_job=job, rung=rung)
        evicted = reg.counter("keel_evicted_nodes_total", "Nodes evicted (carried out by an actuator)", ("training_job",))
        for job, n in sorted(self._evicted.items()):
            evicted.inc(n, training_job=job)
        ready = reg.gauge("keel_standby_ready", "Warm standbys ready, as the controller last sized the pool", ("training_job",))
        target = reg.gauge("keel_standby_target", "The standby pool's target size", ("training_job",))
        for job, (r, t) in sorted(self._standby.items()):
            ready.set(r, training_job=job)
            target.set(t, training_job=job)
        step = reg.gauge("keel_checkpoint_step", "The newest step committed in each checkpoint tier", ("training_job", "tier"))
        for (job, tier), s in sorted(self._checkpoint_step.items()):
            step.set(s, training_job=job, tier=tier)
        persisted = reg.gauge("keel_checkpoint_persisted_bytes", "Bytes of the newest persistent checkpoint", ("training_job",))
        for job, b in sorted(self._persisted_bytes.items()):
            persisted.set(b, training_job=job)
        self._ettr(reg)
        if totals is not None:
            reg.counter("keel_events_recorded_total", "Events persisted to the store").inc(totals.events_recorded)
            reg.counter("keel_events_dead_lettered_total", "Events moved to the dead-letter table").inc(
                totals.dead_lettered)
        pending, lag_s = self._lag or (0, 0.0)
        reg.gauge("keel_recorder_lag_events", "Events in the stream not yet recorded, as the recorder last "
                  "reported (it reports on crossing its threshold)").set(pending)
        reg.gauge("keel_recorder_lag_seconds", "Age of the oldest event not yet recorded, as last reported").set(lag_s)
        return reg

    def _ettr(self, reg: Registry) -> None:
        ettr = reg.gauge("keel_ettr_ratio", "Effective training time ratio since the job's first rank started", ("training_job",))
        window = reg.gauge("keel_ettr_window_ratio", "ETTR over the last hour", ("training_job",))
        lost = reg.gauge("keel_lost_seconds", "Training time lost, by incident phase or running overhead",
                         ("training_job", "phase"))
        detection = reg.histogram("keel_incident_detection_seconds", "From a fault to its detection, per incident "
                                  "with a known fault time", ("training_job",), buckets=LATENCY_BUCKETS_S)
        for job in sorted(self._ettr_inputs):
            # Up to the job's newest event, as ``keel ettr`` (a job that ended is not charged the time since).
            report = compute_ettr(self._ettr_inputs[job], until=self._last_at[job])
            if report is None:
                continue
            ettr.set(report.ettr, training_job=job)
            window.set(report.window(ETTR_WINDOW).ettr, training_job=job)
            by_phase = report.lost_by_phase()
            for phase in PHASES:
                lost.set(by_phase.get(phase, timedelta(0)).total_seconds(), training_job=job, phase=phase)
            for kind, seconds in report.lost_by_overhead().items():
                lost.set(seconds.total_seconds(), training_job=job, phase=kind)
            for incident in report.incidents:
                if incident.recovered_at is not None and "detected" in incident.marks:
                    detection.observe(incident.phases(incident.recovered_at)["detection"].total_seconds(), training_job=job)

    def render(self, totals: StoreTotals | None = None) -> str:
        """The Prometheus text exposition (version 0.0.4)."""
        return self.registry(totals).render()

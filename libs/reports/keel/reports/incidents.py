"""Reports from the event log: incidents, timelines, ETTR, approvals and cordons, shared by ``keel`` (the CLI's
``keel ettr`` / ``keel incidents`` / ``keel timeline`` / ``keel approve`` ...) and ``keel-api``, so the two cannot
disagree. Torch-free, like everything the API image holds.

The module has two parts:

- **pure** (no I/O, no clock): folds over events (``summarize_incidents``, ``build_timeline``,
  ``match_controller_incidents``, ``find_open_request``, ``resolve_id``), event builders for the human
  inputs (``approval_answer``, ``cordon_event``; the caller passes the time) and formatters that turn
  those into text or JSON-ready dicts (``format_*``, ``*_json``);
- **adapters** (``load_*``): read the event store, nothing else (the CLI publishes the built events).

A controller incident is the ``IncidentOpened`` event: its id is the incident id, and every decision
about it, and every event agents emit in answer to those, carries that id as ``correlation_id``.
Its causes are the events named by ``IncidentOpened.evidence``.

Lookups that find nothing, or more than one thing, or a request already answered, raise
``LookupFailed`` (the CLI prints it and exits 1); unusable input raises ``BadInput`` (exit 2).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from keel.events.envelope import SUBJECT_RE, Event, payload_of
from keel.events.types import (
    ApprovalGiven,
    ApprovalRequested,
    IncidentOpened,
    IncidentResolved,
    JobStopDecided,
    NodeClockSkewed,
    NodeCordoned,
    NodeFenced,
)
from keel.events.units import format_duration as format_duration_spec
from keel.rules.ettr import INPUT_TYPES, OVERHEAD_KINDS, PHASES, EttrReport, EttrWindow, compute_ettr

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from keel.infra.store import EventStore, RecordedEvent

MIN_PREFIX = 6
"""The shortest id prefix accepted for an incident or an approval request."""
PRODUCER = "cli"
Outcome = Literal["open", "recovered", "stopped", "superseded"]

SUMMARY_TYPES = ("IncidentOpened", "IncidentResolved", "JobStopDecided", "RestartDecided", "NodeEvictionDecided",
                 "DiagnosticsRequested", "RollbackDecided", "ActionHeld", "StandbyPromotionRequested")
"""The event types ``summarize_incidents`` reads (a reader may fetch only these)."""
_IMPLIED_RUNG = {"DiagnosticsRequested": 2, "RollbackDecided": 4}
"""Decisions without a ``rung`` field that only one rung of the ladder takes."""


class LookupFailed(LookupError):
    """An id that names nothing, or several things, or a request that cannot be answered any more."""


class BadInput(ValueError):
    """What the user typed cannot be used (an id prefix too short, a missing reason)."""


# -- pure: durations, ids ------------------------------------------------------------------------


def format_duration(value: timedelta) -> str:
    """A duration for people, always with its unit: ``0.50 s``, ``14.0 s``, ``4 min 05 s``, ``2 h 03 min``,
    ``1 d 02 h`` (a negative one gets a ``-``)."""
    seconds = value.total_seconds()
    if seconds < 0:
        return "-" + format_duration(-value)
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(round(seconds))
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    if whole < 86400:
        return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
    return f"{whole // 86400} d {whole % 86400 // 3600:02d} h"


def format_offset(value: timedelta) -> str:
    """A timeline offset in seconds with milliseconds: ``+0.000 s``, ``+125.250 s``."""
    return f"{value.total_seconds():+.3f} s"


def short_id(value: uuid.UUID | str) -> str:
    return str(value)[:8]


def _stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _truncate(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def resolve_id(ref: str, ids: Iterable[uuid.UUID], what: str) -> uuid.UUID:
    """The one id in ``ids`` equal to ``ref`` or starting with it (at least ``MIN_PREFIX`` characters of
    the canonical ``8-4-4-4-12`` spelling, case-insensitive).

    Raises ``BadInput`` for a prefix that is too short or not hex, ``LookupFailed`` when no id or
    more than one matches (naming the candidates)."""
    text = ref.strip().lower()
    try:
        return _only(uuid.UUID(text), ids, text, what)
    except ValueError:
        pass
    if len(text) < MIN_PREFIX or any(c not in "0123456789abcdef-" for c in text):
        raise BadInput(f"{what} id {ref!r}: give the full id or a prefix of at least {MIN_PREFIX} hex characters")
    matches = sorted({i for i in ids if str(i).startswith(text)}, key=str)
    if not matches:
        raise LookupFailed(f"no {what} {ref}")
    if len(matches) > 1:
        shown = ", ".join(short_id(m) + str(m)[8:13] for m in matches[:5])
        raise LookupFailed(f"{what} id {ref!r} is ambiguous: {len(matches)} match ({shown}{', ...' if len(matches) > 5 else ''});"
                           " give more characters")
    return matches[0]


def _only(wanted: uuid.UUID, ids: Iterable[uuid.UUID], text: str, what: str) -> uuid.UUID:
    if wanted in set(ids):
        return wanted
    raise LookupFailed(f"no {what} {text}")


# -- pure: controller incidents --------------------------------------------------------------------


@dataclass
class IncidentSummary:
    """One controller incident as the log tells it so far."""

    id: uuid.UUID
    job_id: str
    opened_at: datetime
    kind: str
    node_id: str
    reason: str
    generation: int
    evidence: tuple[str, ...] = ()
    rung: int | None = None
    """The highest rung of the ladder a decision about it took (None: no decision yet)."""
    outcome: Outcome = "open"
    resolved_at: datetime | None = None
    resolution: str = ""
    """The ``IncidentResolved`` (or ``JobStopDecided``) reason."""
    measure: str = ""
    """How its recovery was judged (``IncidentResolved.measure``): ``step``, or ``process`` for a job
    without the SDK (coarser); "" while unresolved."""

    @property
    def time_to_resolution(self) -> timedelta | None:
        return None if self.resolved_at is None else self.resolved_at - self.opened_at

    def to_json(self) -> dict[str, Any]:
        ttr = self.time_to_resolution
        return {"id": str(self.id), "job_id": self.job_id, "opened_at": self.opened_at.isoformat(), "kind": self.kind,
                "node_id": self.node_id, "rung": self.rung, "outcome": self.outcome,
                "resolved_at": self.resolved_at.isoformat() if self.resolved_at else None,
                "time_to_resolution_s": None if ttr is None else ttr.total_seconds(), "reason": self.reason,
                "resolution": self.resolution, "measure": self.measure or None, "generation": self.generation,
                "evidence": list(self.evidence)}


def summarize_incidents(events: Iterable[Event]) -> list[IncidentSummary]:
    """Every controller incident in ``events`` (log order), in the order they were opened.

    An event belongs to an incident by its ``correlation_id`` (or, failing that, a payload
    ``incident_id``). The highest rung is the largest ``rung`` of its decisions (``DiagnosticsRequested``
    counts as rung 2, ``RollbackDecided`` as 4); the outcome is ``IncidentResolved.outcome``, or
    ``stopped`` from a ``JobStopDecided`` not yet followed by one, else ``open``."""
    incidents: dict[uuid.UUID, IncidentSummary] = {}
    for event in events:
        p = event.payload
        if isinstance(p, IncidentOpened):
            incidents.setdefault(event.id, IncidentSummary(
                id=event.id, job_id=event.job_id, opened_at=event.occurred_at, kind=p.kind, node_id=p.node_id,
                reason=p.reason, generation=p.generation, evidence=tuple(p.evidence)))
            continue
        incident_id = _incident_of(event)
        incident = None if incident_id is None else incidents.get(incident_id)
        if incident is None:
            continue
        rung = _IMPLIED_RUNG.get(event.type, getattr(p, "rung", None))
        if isinstance(rung, int):
            incident.rung = rung if incident.rung is None else max(incident.rung, rung)
        if isinstance(p, IncidentResolved):
            incident.outcome, incident.resolved_at, incident.resolution = p.outcome, event.occurred_at, p.reason
            incident.measure = p.measure
        elif isinstance(p, JobStopDecided) and incident.outcome == "open":
            incident.outcome, incident.resolved_at, incident.resolution = "stopped", event.occurred_at, p.reason
    return list(incidents.values())


def _incident_of(event: Event) -> uuid.UUID | None:
    if event.correlation_id is not None:
        return event.correlation_id
    incident_id = getattr(event.payload, "incident_id", None)
    try:
        return uuid.UUID(incident_id) if incident_id else None
    except ValueError:
        return None


def format_incidents(incidents: Sequence[IncidentSummary], *, reason_width: int = 60) -> str:
    """One line per incident under a header; a sentence when there is none."""
    if not incidents:
        return "keel: no incidents"
    lines = [f"{'ID':<8}  {'JOB':<12} {'OPENED_AT':<23}  {'KIND':<11} {'NODE':<10} {'RUNG':>4}  {'OUTCOME':<10} "
             f"{'RESOLVED_IN':>13}  REASON"]
    for i in incidents:
        ttr = i.time_to_resolution
        lines.append(f"{short_id(i.id):<8}  {i.job_id:<12} {_stamp(i.opened_at):<23}  {i.kind:<11} {i.node_id or '-':<10} "
                     f"{'-' if i.rung is None else i.rung:>4}  {i.outcome:<10} "
                     f"{'-' if ttr is None else format_duration(ttr):>13}  {_truncate(i.reason, reason_width)}")
    coarse = [short_id(i.id) for i in incidents if i.measure == "process"]
    if coarse:
        lines.append(f"process-level (no SDK, coarser: a hang is not seen): {', '.join(coarse)} resolved once every "
                     f"rank of the new generation ran for the settle interval, not on a reported step")
    return "\n".join(lines)


def incidents_json(incidents: Sequence[IncidentSummary]) -> dict[str, Any]:
    return {"incidents": [i.to_json() for i in incidents]}


CLOCK_TYPES = ("NodeClockSkewed",)


@dataclass(frozen=True)
class SkewedClock:
    """A node whose clock the controller last reported off its recorded clock (``NodeClockSkewed``)."""

    job_id: str
    node_id: str
    skew_s: float
    since: datetime
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "node_id": self.node_id, "skew_s": self.skew_s,
                "since": self.since.isoformat(), "reason": self.reason}


def skewed_clocks(events: Iterable[Event]) -> list[SkewedClock]:
    """Nodes whose latest ``NodeClockSkewed`` says their clock is off (not back within), by job and node."""
    latest: dict[tuple[str, str], Event] = {}
    for event in events:
        if isinstance(event.payload, NodeClockSkewed):
            latest[(event.job_id, event.payload.node_id)] = event
    return [SkewedClock(job, node, e.payload.skew_s, e.occurred_at, e.payload.reason)
            for (job, node), e in sorted(latest.items()) if isinstance(e.payload, NodeClockSkewed) and e.payload.skewed]


FENCE_TYPES = ("NodeFenced",)


def format_fences(events: Iterable[Event]) -> str:
    """A line per node the controller fenced out of its job (``NodeFenced``: a host back after its eviction,
    whose reports were ignored), its latest record; "" when none."""
    latest: dict[tuple[str, str], Event] = {}
    for event in events:
        if isinstance(event.payload, NodeFenced):
            latest[(event.job_id, event.payload.node_id)] = event
    if not latest:
        return ""
    lines = ["nodes fenced out of their job (evicted, then heard from again: what they sent was ignored):"]
    for (job, node), e in sorted(latest.items()):
        assert isinstance(e.payload, NodeFenced)
        p = e.payload
        lines.append(f"  {job:<12} {node:<10} left at generation {p.fenced_generation}, heard at generation "
                     f"{p.generation} ({p.input_type}), {_stamp(e.occurred_at)}, incident {short_id(str(e.correlation_id))}")
    return "\n".join(lines)


def format_skewed_clocks(clocks: Sequence[SkewedClock]) -> str:
    """A line per node whose clock is off (reported, never acted on); "" when none is."""
    if not clocks:
        return ""
    lines = ["clocks off the controller's recorded clock (reported, not acted on: liveness and expiry go by arrival):"]
    for c in clocks:
        way = "ahead" if c.skew_s > 0 else "behind"
        lines.append(f"  {c.job_id:<12} {c.node_id:<10} {abs(c.skew_s):.1f} s {way} (at least), since {_stamp(c.since)}")
    return "\n".join(lines)


# -- pure: the timeline of one incident ----------------------------------------------------------


@dataclass(frozen=True)
class TimelineEntry:
    position: int
    event: Event
    offset: timedelta
    """From the first entry's ``occurred_at``."""
    evidence: bool
    """Named by ``IncidentOpened.evidence`` (a cause), rather than carrying the incident's id."""

    @property
    def what(self) -> str:
        return describe(self.event)


@dataclass(frozen=True)
class Timeline:
    incident: IncidentSummary
    entries: tuple[TimelineEntry, ...]
    missing_evidence: tuple[str, ...] = ()
    """Evidence ids that are not in the log (not recorded yet, or from another store)."""


def describe(event: Event, *, width: int = 120) -> str:
    """The payload's ``reason``, else its ``detail``, else a compact ``key=value`` summary of it."""
    payload = event.payload.model_dump(mode="json")
    for key in ("reason", "detail"):
        text = payload.get(key)
        if isinstance(text, str) and text.strip():
            return " ".join(text.split())
    brief = ", ".join(f"{k}={_compact(v)}" for k, v in payload.items() if v not in ("", [], {}, None))
    return _truncate(brief, width)


def _compact(value: Any) -> str:
    if isinstance(value, list):
        if value and all(isinstance(v, (str, int, float, bool)) for v in value):
            return "[" + ",".join(str(v) for v in value) + "]"
        return f"[{len(value)} items]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_compact(v)}" for k, v in value.items()) + "}"
    return str(value)


def build_timeline(opened: tuple[int, Event], related: Iterable[tuple[int, Event]]) -> Timeline:
    """The incident opened by ``opened`` (``(position, IncidentOpened event)``) and its events in log
    order: ``related`` are the evidence events and every event carrying the incident's id as
    ``correlation_id``, as ``(position, event)`` in any order, duplicates allowed."""
    opened_event = opened[1]
    opened_payload = opened_event.payload
    if not isinstance(opened_payload, IncidentOpened):
        raise ValueError(f"event {opened_event.id} is a {opened_event.type}, not an IncidentOpened")
    evidence_ids = set(opened_payload.evidence)
    by_id: dict[uuid.UUID, tuple[int, Event]] = {opened_event.id: opened}
    for position, event in related:
        by_id.setdefault(event.id, (position, event))
    ordered = sorted(by_id.values(), key=lambda item: item[0])
    first = ordered[0][1].occurred_at
    entries = tuple(TimelineEntry(position, event, event.occurred_at - first,
                                  str(event.id) in evidence_ids and event.correlation_id != opened_event.id)
                    for position, event in ordered)
    summary = summarize_incidents([opened_event, *(e.event for e in entries
                                                   if not e.evidence and e.event.id != opened_event.id)])[0]
    present = {str(e.event.id) for e in entries}
    missing = tuple(i for i in opened_payload.evidence if i not in present)
    return Timeline(summary, entries, missing)


def format_timeline(timeline: Timeline) -> str:
    i = timeline.incident
    ttr = i.time_to_resolution
    status = i.outcome if ttr is None else f"{i.outcome} after {format_duration(ttr)}"
    lines = [f"incident {i.id} ({i.kind}{' on ' + i.node_id if i.node_id else ''}, job {i.job_id}): {status}, "
             f"highest rung {'-' if i.rung is None else i.rung}",
             f"opened {_stamp(i.opened_at)}: {i.reason}", "",
             f"{'OFFSET':>12}  {'TYPE':<26} {'PRODUCER':<18} {'SUBJECT':<16} REASON / DETAIL   (* cause, from the evidence)"]
    for e in timeline.entries:
        mark = "*" if e.evidence else " "
        lines.append(f"{format_offset(e.offset):>12} {mark}{e.event.type:<26} {e.event.producer:<18} "
                     f"{e.event.subject:<16} {e.what}")
    for missing in timeline.missing_evidence:
        lines.append(f"  (evidence {missing} is not in the log)")
    return "\n".join(lines)


def timeline_json(timeline: Timeline) -> dict[str, Any]:
    return {"incident": timeline.incident.to_json(),
            "events": [{"position": e.position, "offset_s": e.offset.total_seconds(), "evidence": e.evidence,
                        "what": e.what, **e.event.to_wire()} for e in timeline.entries],
            "missing_evidence": list(timeline.missing_evidence)}


# -- pure: ETTR with the controller's incidents ---------------------------------------------------


@dataclass(frozen=True)
class JobEttr:
    """One job's ETTR report, its window, and the controller incident behind each ETTR incident."""

    job_id: str
    report: EttrReport
    window: EttrWindow
    controller: tuple[IncidentSummary | None, ...] = field(default=())
    """Parallel to ``report.incidents``."""


def match_controller_incidents(report: EttrReport, incidents: Sequence[IncidentSummary]) -> tuple[IncidentSummary | None, ...]:
    """For each ETTR incident, the first controller incident opened at or after its start and before its
    end (its recovery; an unrecovered one runs to the end of the log, inclusive), or None."""
    ordered = sorted(incidents, key=lambda i: i.opened_at)
    out: list[IncidentSummary | None] = []
    for ettr_incident in report.incidents:
        end = ettr_incident.recovered_at
        out.append(next((c for c in ordered if ettr_incident.started_at <= c.opened_at
                         and (c.opened_at < end if end is not None else c.opened_at <= report.ended_at)), None))
    return tuple(out)


def job_ettr(job_id: str, events: Iterable[Event], window: timedelta, incidents: Sequence[IncidentSummary] = (),
             *, until: datetime | None = None) -> JobEttr | None:
    """``compute_ettr`` of one job's events, its last ``window`` and the matching controller incidents;
    None before the job's first rank started."""
    report = compute_ettr(events, until=until)
    if report is None:
        return None
    return JobEttr(job_id, report, report.window(window), match_controller_incidents(report, incidents))


OVERHEAD_LABELS = {"checkpoint": "checkpointing", "fail_slow": "slow steps"}
"""How ``keel ettr`` names each kind of overhead (time lost outside incidents)."""


def _pct(value: float) -> str:
    return f"{100 * value:.2f} %"


def format_ettr(job: JobEttr) -> str:
    """A summary table (cumulative next to the window), then one line per incident."""
    report, window = job.report, job.window
    label = f"last {format_duration_spec(window.length)}"
    phase_window = window.lost_by_phase
    rows = [
        ("ETTR", _pct(report.ettr), _pct(window.ettr)),
        ("wall time", format_duration(report.wall), format_duration(window.wall)),
        ("productive", format_duration(report.wall - report.lost), format_duration(window.wall - window.lost)),
        ("unproductive", format_duration(report.lost), format_duration(window.lost)),
        *((f"  {phase}", format_duration(report.lost_by_phase()[phase]), format_duration(phase_window[phase]))
          for phase in PHASES),
        # Lost outside incidents: the training thread blocked in checkpointing, slow steps before a conviction.
        *((f"  {OVERHEAD_LABELS[kind]}", format_duration(report.lost_by_overhead()[kind]),
           format_duration(window.lost_by_overhead[kind])) for kind in OVERHEAD_KINDS),
        ("incidents", str(len(report.incidents)), str(len(window.lost_by_incident))),
        ("generation changes", str(len(report.generations)), str(window.generation_changes)),
        ("restart requests", str(len(report.restart_requests)), str(window.restart_requests)),
    ]
    lines = [f"job {job.job_id}: {_stamp(report.started_at)} .. {_stamp(report.ended_at)}, generation {report.generation}",
             *([f"measured {report.note}"] if report.note else []),
             "", f"{'':<20} {'cumulative':>14} {label:>14}"]
    lines += [f"{name:<20} {a:>14} {b:>14}" for name, a, b in rows]
    if report.incidents:
        in_window = dict(window.lost_by_incident)
        lines += ["", f"{'#':>3}  {'STARTED_AT':<23}  {'LOST':>12} {'IN WINDOW':>12}  "
                      + " ".join(f"{p.upper():>12}" for p in PHASES) + f"  {'CONTROLLER':<20} CAUSE"]
        for index, (incident, controller) in enumerate(zip(report.incidents, job.controller or
                                                           (None,) * len(report.incidents), strict=True)):
            phases = incident.phases(report.ended_at)
            lost = format_duration(incident.lost(report.ended_at)) + ("" if incident.recovered_at else "+")
            windowed = format_duration(in_window[index]) if index in in_window else "-"
            ctl = f"{short_id(controller.id)} {controller.kind}" if controller else "-"
            lines.append(f"{index + 1:>3}  {_stamp(incident.started_at):<23}  {lost:>12} {windowed:>12}  "
                         + " ".join(f"{format_duration(phases[p]):>12}" for p in PHASES) + f"  {ctl:<20} {incident.cause}")
        if any(i.recovered_at is None for i in report.incidents):
            lines.append("(+: still open, charged up to the end of the log)")
    return "\n".join(lines)


def ettr_json(job: JobEttr) -> dict[str, Any]:
    cumulative = job.report.to_json()
    for entry, controller in zip(cumulative["incidents"], job.controller or (None,) * len(job.report.incidents),
                                 strict=True):
        entry["controller_incident"] = None if controller is None else {"id": str(controller.id),
                                                                        "kind": controller.kind}
    return {"job_id": job.job_id, "measure": job.report.measure, "note": job.report.note, "cumulative": cumulative,
            "window": job.window.to_json()}


# -- pure: human input ------------------------------------------------------------------------------


def find_open_request(ref: str, requests: Sequence[Event], answers: Sequence[Event], now: datetime) -> Event:
    """The ``ApprovalRequested`` event ``ref`` names (its id or a unique prefix), if still answerable.

    Raises ``LookupFailed`` when none or several match, when it was already answered (saying by whom
    and how), or when it expired before ``now``."""
    chosen = resolve_id(ref, [r.id for r in requests], "approval request")
    request = next(r for r in requests if r.id == chosen)
    asked = payload_of(request, ApprovalRequested)
    for answer in answers:
        given = payload_of(answer, ApprovalGiven)
        if given.request_id == str(chosen):
            verdict = "approved" if given.approved else "denied"
            raise LookupFailed(f"approval request {short_id(chosen)} ({asked.action}) was already {verdict} "
                               f"by {given.by} at {_stamp(answer.occurred_at)}")
    if asked.expires_at <= now:
        raise LookupFailed(f"approval request {short_id(chosen)} ({asked.action}) expired at "
                           f"{_stamp(asked.expires_at)}; the controller no longer waits for it")
    return request


def approval_answer(request: Event, *, approved: bool, by: str, comment: str, now: datetime,
                    event_id: uuid.UUID | None = None, producer: str = PRODUCER) -> Event:
    """The ``ApprovalGiven`` event answering ``request``: same job, the request's incident as its
    correlation, the request as its cause. ``producer``: ``cli``, or the chat-ops channel that carried it
    (``chatops-slack``, ``chatops-webhook``; the API's chat-ops routes)."""
    if not by.strip():
        raise BadInput("an approval needs a name: pass --by NAME")
    return Event.create(ApprovalGiven(request_id=str(request.id), approved=approved, by=by, comment=comment),
                        job_id=request.job_id, subject=f"job/{request.job_id}", producer=producer, occurred_at=now,
                        event_id=event_id, causation_id=request.id,
                        correlation_id=request.correlation_id or _incident_of(request))


def cordon_event(job_id: str, node_id: str, *, cordoned: bool, by: str, reason: str, now: datetime,
                 event_id: uuid.UUID | None = None, producer: str = PRODUCER) -> Event:
    """The ``NodeCordoned`` event of a human cordoning (or uncordoning) ``node_id`` of ``job_id``. ``producer``:
    ``cli``, or ``api`` (an operator token's)."""
    if not by.strip():
        raise BadInput("a cordon needs a name: pass --by NAME")
    if cordoned and not reason.strip():
        raise BadInput("a cordon needs a reason: pass --reason TEXT")
    if not SUBJECT_RE.match(f"node/{node_id}"):
        raise BadInput(f"not a node id: {node_id!r} (letters, digits and _ . : - only)")
    return Event.create(NodeCordoned(node_id=node_id, cordoned=cordoned, by=by, reason=reason), job_id=job_id,
                        subject=f"node/{node_id}", producer=producer, occurred_at=now, event_id=event_id)


def choose_job(node_id: str, jobs: Sequence[str]) -> str:
    """The one job ``node_id`` belongs to, or a ``LookupFailed`` that asks for ``--job``."""
    if len(jobs) == 1:
        return jobs[0]
    if not jobs:
        raise LookupFailed(f"node {node_id} has no events in the log: pass --job JOB")
    raise LookupFailed(f"node {node_id} belongs to jobs {', '.join(sorted(jobs))}: pass --job JOB")


# -- adapters: the event store and the bus ----------------------------------------------------------


async def load_job_spans(engine: AsyncEngine, job_id: str | None = None) -> list[tuple[str, datetime, datetime]]:
    """(job, first ``occurred_at``, last ``occurred_at``) of every job in the log (or of ``job_id``); Keel's own
    reports (job ``_keel``) are no training job."""
    import sqlalchemy as sa

    from keel.events.types import SYSTEM_JOB
    from keel.infra.store import events_table

    t = events_table.c
    query = sa.select(t.job_id, sa.func.min(t.occurred_at), sa.func.max(t.occurred_at)).group_by(t.job_id)
    if job_id is not None:
        query = query.where(t.job_id == job_id)
    else:
        query = query.where(t.job_id != SYSTEM_JOB)
    async with engine.connect() as conn:
        rows = (await conn.execute(query.order_by(t.job_id))).all()
    return [(row[0], row[1], row[2]) for row in rows]


async def load_incidents(store: EventStore, job_id: str | None = None) -> list[IncidentSummary]:
    events = [r.event async for r in store.read(job_id=job_id, types=SUMMARY_TYPES)]
    return summarize_incidents(events)


@dataclass(frozen=True)
class IncidentPage:
    """One page of a job's incidents, newest first (``load_incident_page``)."""

    incidents: list[IncidentSummary]
    total: int
    """Every incident the log holds (of the job), on every page."""
    next_before: int | None
    """Pass as ``before`` for the next (older) page; None on the last page."""

    def to_json(self) -> dict[str, Any]:
        return {**incidents_json(self.incidents), "total": self.total, "next_before": self.next_before}


async def load_incident_page(store: EventStore, job_id: str | None = None, *, limit: int = 100,
                             before: int | None = None, total: int | None = None) -> IncidentPage:
    """The newest ``limit`` incidents opened before log position ``before``, summarized as ``summarize_incidents``
    does, newest first. It reads only that page's incidents: their ``IncidentOpened`` walking the index backwards,
    and their decisions by correlation id (every decision of the controller carries its incident's; an
    ``IncidentResolved`` naming its incident only in its payload is found too). The cost of a page does not grow
    with the log, nor with the number of incidents before it. ``total``: the job's incident count when the caller
    knows it (it is counted otherwise)."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    opened = await store.read_newest("IncidentOpened", job_id=job_id, before_position=before,
                                     limit=limit + 1)
    more, opened = len(opened) > limit, opened[:limit]
    decisions = await store.read_correlated([r.event.id for r in opened],
                                            types=[t for t in SUMMARY_TYPES if t != "IncidentOpened"],
                                            by_payload_incident_id=["IncidentResolved"])
    in_order = sorted([*opened, *decisions], key=lambda r: r.position)
    incidents = summarize_incidents(r.event for r in in_order)
    incidents.reverse()
    if total is None:
        total = len(opened) if before is None and not more else await store.count_of(types=["IncidentOpened"],
                                                                                       job_id=job_id)
    return IncidentPage(incidents, total, opened[-1].position if more else None)


async def load_incidents_and_clocks(store: EventStore, job_id: str | None = None
                                    ) -> tuple[list[IncidentSummary], list[SkewedClock]]:
    incidents = await load_incidents(store, job_id)
    clocks = skewed_clocks([r.event async for r in store.read(job_id=job_id, types=CLOCK_TYPES)])
    return incidents, clocks


async def load_ettr(store: EventStore, job_id: str | None, window: timedelta) -> list[tuple[str, JobEttr | None]]:
    """One entry per job (or just ``job_id``; ``LookupFailed`` when it has no events)."""
    spans = await load_job_spans(store.engine, job_id)
    if job_id is not None and not spans:
        raise LookupFailed(f"no events for job {job_id} in the log")
    out: list[tuple[str, JobEttr | None]] = []
    for job, _, last in spans:
        events = [r.event async for r in store.read(job_id=job, types=sorted(INPUT_TYPES))]
        out.append((job, job_ettr(job, events, window, await load_incidents(store, job), until=last)))
    return out


async def load_timeline(store: EventStore, ref: str, job_id: str | None = None) -> Timeline:
    """The timeline of the incident ``ref`` names (id or unique prefix)."""
    head = await _incident_by_full_id(store, ref, job_id)
    if head is None:  # a prefix: among the incidents' ids
        opened = {r.event.id: r async for r in store.read(job_id=job_id, types=["IncidentOpened"])}
        chosen = resolve_id(ref, opened, "incident")
        head = opened[chosen]
    else:
        chosen = head.event.id
    related: list[tuple[int, Event]] = [(r.position, r.event) for r in await store.read_correlated([chosen])]
    evidence: list[uuid.UUID] = []
    for text in payload_of(head.event, IncidentOpened).evidence:
        try:
            evidence.append(uuid.UUID(text))
        except ValueError:
            continue
    related += [(r.position, r.event) for r in await store.get_many(evidence)]
    return build_timeline((head.position, head.event), related)


async def _incident_by_full_id(store: EventStore, ref: str, job_id: str | None) -> RecordedEvent | None:
    """The ``IncidentOpened`` that a whole id names, looked up by id (not by reading every incident), or None
    when ``ref`` is no whole id or names no incident (of ``job_id``): the caller then resolves it as a prefix."""
    try:
        event_id = uuid.UUID(ref)
    except ValueError:
        return None
    recorded = await store.get(event_id)
    if recorded is None or recorded.event.type != "IncidentOpened" or job_id not in (None, recorded.event.job_id):
        return None
    return recorded


async def load_open_request(store: EventStore, ref: str, now: datetime, job_id: str | None = None) -> Event:
    requests = [r.event async for r in store.read(job_id=job_id, types=["ApprovalRequested"])]
    answers = [r.event async for r in store.read(job_id=job_id, types=["ApprovalGiven"])]
    return find_open_request(ref, requests, answers, now)


async def load_node_jobs(engine: AsyncEngine, node_id: str) -> list[str]:
    """The jobs with events about ``node/<node_id>``."""
    import sqlalchemy as sa

    from keel.infra.store import events_table

    t = events_table.c
    query = sa.select(t.job_id).where(t.subject == f"node/{node_id}").distinct().order_by(t.job_id)
    async with engine.connect() as conn:
        return [row[0] for row in (await conn.execute(query)).all()]


async def load_fences(store: EventStore, job_id: str | None = None) -> list[Event]:
    return [r.event async for r in store.read(job_id=job_id, types=FENCE_TYPES)]


__all__ = [
    "BadInput",
    "FENCE_TYPES",
    "IncidentPage",
    "IncidentSummary",
    "JobEttr",
    "LookupFailed",
    "SUMMARY_TYPES",
    "SkewedClock",
    "Timeline",
    "TimelineEntry",
    "approval_answer",
    "build_timeline",
    "choose_job",
    "cordon_event",
    "describe",
    "ettr_json",
    "find_open_request",
    "format_duration",
    "format_ettr",
    "format_fences",
    "format_incidents",
    "format_offset",
    "format_skewed_clocks",
    "format_timeline",
    "incidents_json",
    "job_ettr",
    "load_ettr",
    "load_fences",
    "load_incident_page",
    "load_incidents",
    "load_incidents_and_clocks",
    "load_job_spans",
    "load_node_jobs",
    "load_open_request",
    "load_timeline",
    "match_controller_incidents",
    "resolve_id",
    "short_id",
    "skewed_clocks",
    "summarize_incidents",
    "timeline_json",
]

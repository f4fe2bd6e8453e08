"""``keel deploy`` and ``keel versions``: register code versions; show a job's history, current, stable, pending."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from keel.events.envelope import Event
from keel.events.types import (
    LAUNCH_VERSION,
    CodeRolloutRequested,
    CodeVersionApplied,
    CodeVersionRegistered,
    CodeVersionRejected,
    CodeVersionStable,
    RestartDecided,
    RollbackDecided,
)
from keel.hot_update.core import HotUpdateDecider, JobCode
from keel.hot_update.versions import VersionRejected, default_entry, snapshot, validate, version_id_of
from keel.infra.config import Settings

PRODUCER = "cli"
HISTORY_TYPES = [CodeVersionRegistered.event_name, CodeVersionRejected.event_name, CodeRolloutRequested.event_name,
                 RestartDecided.event_name, CodeVersionApplied.event_name, CodeVersionStable.event_name,
                 RollbackDecided.event_name, "IncidentOpened", "IncidentResolved", "NodeHeartbeat"]


def versions_dir(settings: Settings) -> Path:
    return settings.hot_update.versions_dir or settings.home / "versions"


def deploy_event(settings: Settings, job: str, source: str, *, entry: list[str] | None, mode: str,
                 deadline: timedelta | None, by: str, why: str, now: datetime) -> Event:
    """Snapshot and validate ``source``: a ``CodeVersionRegistered``, or a ``CodeVersionRejected`` saying why."""
    digest, chosen = "", list(entry or [])
    try:
        snap = snapshot(source, versions_dir(settings))
        digest = snap.digest
        chosen = chosen or default_entry(snap.path)
        checks = validate(snap.path, chosen, timeout=settings.hot_update.validate_timeout)
    except VersionRejected as exc:
        digest = digest or exc.digest
        subject = f"code/{version_id_of(digest)}" if digest else "code/rejected"
        return Event.create(CodeVersionRejected(source=source, digest=digest, entry=chosen, mode=mode, by=by,  # type: ignore[arg-type]
                                                why=why, reason=exc.reason),
                            job_id=job, subject=subject, producer=PRODUCER, occurred_at=now)
    lazy_deadline = (now + (deadline or settings.hot_update.default_deadline)) if mode == "lazy" else None
    payload = CodeVersionRegistered(version_id=snap.version_id, digest=snap.digest, source=source,
                                    source_kind=snap.source_kind, path=str(snap.path), entry=chosen,  # type: ignore[arg-type]
                                    mode=mode, deadline=lazy_deadline, by=by, why=why, checks=checks)  # type: ignore[arg-type]
    return Event.create(payload, job_id=job, subject=f"code/{snap.version_id}", producer=PRODUCER, occurred_at=now)


# -- keel versions ---------------------------------------------------------------------------------


def summarise(events: Iterable[Event]) -> dict[str, Any]:
    """A job's code versions from its log: hot-update's own fold (current, stable, pending, in flight)
    plus the history of every deploy, rejection, rollout, application and rollback."""
    decider = HotUpdateDecider()
    state = decider.initial_state()
    history: list[dict[str, Any]] = []
    job: JobCode | None = None
    applied: set[tuple[str, int]] = set()
    for event in events:
        state = decider.evolve(state, event)
        job = state.job(event.job_id)
        p, at = event.payload, event.occurred_at.isoformat()
        if isinstance(p, CodeVersionRegistered):
            history.append({"at": at, "what": "registered", "version": p.version_id, "by": p.by, "why": p.why,
                            "mode": p.mode, "deadline": p.deadline.isoformat() if p.deadline else None,
                            "source": p.source, "entry": " ".join(p.entry)})
        elif isinstance(p, CodeVersionRejected):
            history.append({"at": at, "what": "rejected", "version": version_id_of(p.digest) if p.digest else "",
                            "by": p.by, "why": p.why, "source": p.source, "reason": p.reason})
        elif isinstance(p, CodeRolloutRequested):
            history.append({"at": at, "what": f"rollout requested ({p.trigger})", "version": p.version_id,
                            "reason": p.reason})
        elif isinstance(p, RestartDecided) and p.code_changed:
            cause = p.reason.split(";", 1)[0][:140]
            history.append({"at": at, "what": "rolled back to" if p.rollback else "restart applies",
                            "version": p.code_version, "generation": p.generation, "rung": p.rung,
                            "reason": f"generation {p.generation}, {'planned' if p.rung == 0 else f'rung {p.rung}'}: {cause}"})
        elif isinstance(p, CodeVersionApplied) and (p.version_id, p.generation) not in applied:
            applied.add((p.version_id, p.generation))
            history.append({"at": at, "what": "running", "version": p.version_id, "generation": p.generation,
                            "warm": p.warm})
        elif isinstance(p, CodeVersionStable):
            history.append({"at": at, "what": "stable", "version": p.version_id, "reason": p.reason})
    job = job or JobCode()
    return {"current": job.current, "in_flight": job.in_flight or None, "pending": job.pending or None,
            "stable": job.stable[-1] if job.stable else None, "rolled_back": sorted(job.rolled_back),
            "versions": {vid: {"by": v.by, "why": v.why, "mode": v.mode, "source": v.source, "path": v.path,
                               "entry": v.entry} for vid, v in job.versions.items()},
            "history": history}


def format_versions(job_id: str, summary: dict[str, Any]) -> str:
    lines = [f"job {job_id}: running {summary['current']}"
             + (" (the job's launch command)" if summary["current"] == LAUNCH_VERSION else "")
             + f"; stable {summary['stable'] or '-'}; pending {summary['pending'] or '-'}"
             + (f"; in flight {summary['in_flight']}" if summary["in_flight"] else "")
             + (f"; rolled back {', '.join(summary['rolled_back'])}" if summary["rolled_back"] else "")]
    for item in summary["history"]:
        detail = {"registered": lambda i: f"{i['mode']} by {i['by']}" + (f": {i['why']}" if i["why"] else "")
                  + f" ({i['source']}, entry {i['entry']})",
                  "rejected": lambda i: f"by {i['by']}: {i['reason']} ({i['source']})",
                  "running": lambda i: f"generation {i['generation']}{'' if i['warm'] else ' (fresh interpreters)'}",
                  }.get(item["what"], lambda i: i.get("reason", ""))(item)
        lines.append(f"  {item['at'][:19]}  {item['what']:<28} {item['version'] or '-':<16} {detail}")
    if not summary["history"]:
        lines.append("  no version deployed: the job runs its launch command")
    return "\n".join(lines)

"""``keel deploy`` and ``keel versions``: register code versions; show a job's history, current, stable, pending.

    keel deploy PATH|REV --job J [--urgent|--lazy] [--deadline 24h] [--entry F | -m MOD] [--why W]
    keel versions --job J [--json]

``deploy_event`` snapshots and validates a version here, in the CLI's process, and the command publishes
the resulting ``CodeVersionRegistered`` (or ``CodeVersionRejected``, exit status 1) for hot-update to roll
out; ``summarise`` folds a job's log with hot-update's own decider.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from keel.cli.common import CliError, Subparsers, on_store, operator_identity, print_json, publish
from keel.events.envelope import Event, now_utc
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
from keel.events.units import parse_duration
from keel.hot_update.core import HotUpdateDecider, JobCode
from keel.hot_update.versions import VersionRejected, default_entry, snapshot, validate, version_id_of
from keel.infra.config import Settings

PRODUCER = "cli"
HISTORY_TYPES = [CodeVersionRegistered.event_name, CodeVersionRejected.event_name, CodeRolloutRequested.event_name,
                 RestartDecided.event_name, CodeVersionApplied.event_name, CodeVersionStable.event_name,
                 RollbackDecided.event_name, "IncidentOpened", "IncidentResolved", "NodeHeartbeat"]


def register(sub: Subparsers) -> None:
    deploy = sub.add_parser("deploy", help="register a code version for a running job (validated before rollout)")
    deploy.add_argument("source", help="a directory, a wheel (*.whl), or a git revision (REPO@REV, or REV of the "
                                       "repository here)")
    deploy.add_argument("--job", required=True)
    entry = deploy.add_mutually_exclusive_group()
    entry.add_argument("--entry", help="the script to run, relative to the version (default train.py)")
    entry.add_argument("--module", "-m", help="run this module of the version instead (python -m MODULE)")
    mode = deploy.add_mutually_exclusive_group()
    mode.add_argument("--urgent", action="store_true", help="restart the job onto it now")
    mode.add_argument("--lazy", action="store_true", help="apply it at the next restart of any cause (default)")
    deploy.add_argument("--deadline", help="a lazy version is forced this long after the deploy (default "
                                           "hot_update.default_deadline, 24h)")
    deploy.add_argument("--why", default="", help="what changed and why (shown by keel versions)")
    deploy.add_argument("--by", help="deprecated: who deploys is your signing identity (signing.operator, default your login name)")
    deploy.set_defaults(func=cmd_deploy)

    versions = sub.add_parser("versions", help="a job's code versions: history, current, stable, pending")
    versions.add_argument("--job", required=True)
    versions.add_argument("--json", action="store_true")
    versions.set_defaults(func=cmd_versions)


# -- keel deploy -----------------------------------------------------------------------------------


def cmd_deploy(args: argparse.Namespace, settings: Settings) -> int:
    entry = ["-m", args.module] if args.module else ([args.entry] if args.entry else None)
    try:
        deadline = parse_duration(args.deadline) if args.deadline else None
    except ValueError as exc:
        raise CliError(f"--deadline: {exc}") from None
    event = deploy_event(settings, args.job, args.source, entry=entry, mode="urgent" if args.urgent else "lazy",
                         deadline=deadline, by=operator_identity(settings, args.by), why=args.why, now=now_utc())
    publish(settings, event)
    p = event.payload
    if isinstance(p, CodeVersionRejected):
        print(f"keel: rejected {args.source}: {p.reason}; event {event.id}", file=sys.stderr)
        return 1
    assert isinstance(p, CodeVersionRegistered)  # deploy_event returns one of the two
    when = ("restart onto it now" if p.mode == "urgent" or p.deadline is None
            else f"at the next restart, at the latest {p.deadline.isoformat()}")
    print(f"keel: registered {p.version_id} ({p.source_kind} {p.source}, entry {' '.join(p.entry)}) for job {args.job}: "
          f"{when}; event {event.id}")
    return 0


def versions_dir(settings: Settings) -> Path:
    return settings.hot_update.resolved_versions_dir(settings.home)


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
        return Event.create(CodeVersionRejected(source=source, digest=digest, entry=chosen, mode=mode, by=by,
                                                why=why, reason=exc.reason),
                            job_id=job, subject=subject, producer=PRODUCER, occurred_at=now)
    lazy_deadline = (now + (deadline or settings.hot_update.default_deadline)) if mode == "lazy" else None
    payload = CodeVersionRegistered(version_id=snap.version_id, digest=snap.digest, source=source,
                                    source_kind=snap.source_kind, path=str(snap.path), entry=chosen,
                                    mode=mode, deadline=lazy_deadline, by=by, why=why, checks=checks)
    return Event.create(payload, job_id=job, subject=f"code/{snap.version_id}", producer=PRODUCER, occurred_at=now)


# -- keel versions ---------------------------------------------------------------------------------


def cmd_versions(args: argparse.Namespace, settings: Settings) -> int:
    async def load(store: Any) -> list[Any]:
        return [r.event async for r in store.read(job_id=args.job, types=HISTORY_TYPES)]

    summary = summarise(on_store(settings, load))
    if args.json:
        print_json({"job": args.job, **summary})
    else:
        print(format_versions(args.job, summary))
    return 0


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

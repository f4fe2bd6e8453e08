"""Human input: answer a held action, take a node out of service or put it back.

    keel approve | deny REQUEST_ID [--comment C] [--by NAME] [--job J]   answer an ApprovalRequested
    keel cordon NODE --reason R [--by NAME] [--job J]                  a human takes a node out
    keel uncordon NODE [--by NAME] [--job J]                           ... or puts it back

Each command looks up what it answers in the event store, builds one event with the pure builders of
``keel.reports.incidents`` (``approval_answer``, ``cordon_event``) and publishes it on the bus. An unknown,
ambiguous, already answered or expired request is exit status 1; unusable input is 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from keel.cli.common import CliError, Subparsers, on_store, operator_identity, publish
from keel.events.envelope import now_utc
from keel.infra.config import Settings
from keel.reports.incidents import (
    BadInput,
    approval_answer,
    choose_job,
    cordon_event,
    load_node_jobs,
    load_open_request,
    short_id,
)


def register(sub: Subparsers) -> None:
    for name, text in (("approve", "approve a held action (an ApprovalRequested)"),
                       ("deny", "deny a held action (an ApprovalRequested)")):
        answer = sub.add_parser(name, help=text)
        answer.add_argument("request_id", help="the ApprovalRequested event id or a prefix of 6+ characters")
        answer.add_argument("--comment", default="")
        answer.add_argument("--by", help="deprecated: who answers is your signing identity (signing.operator, default your login name)")
        answer.add_argument("--job", help="look the request up in this job only")
        answer.set_defaults(func=cmd_answer)

    for name, text in (("cordon", "take a node out of service: the controller never undoes it"),
                       ("uncordon", "put a cordoned node back into service")):
        cordon = sub.add_parser(name, help=text)
        cordon.add_argument("node")
        cordon.add_argument("--reason", required=name == "cordon", default="")
        cordon.add_argument("--by", help="deprecated: who cordons is your signing identity (signing.operator, default your login name)")
        cordon.add_argument("--job", help="the node's job (default: the one job the log has the node in)")
        cordon.set_defaults(func=cmd_cordon)


def cmd_answer(args: argparse.Namespace, settings: Settings) -> int:
    """``keel approve`` and ``keel deny``."""
    approved = args.command == "approve"
    by = operator_identity(settings, args.by)
    request = on_store(settings, lambda store: load_open_request(store, args.request_id, now_utc(), args.job))
    try:
        answer = approval_answer(request, approved=approved, by=by, comment=args.comment, now=now_utc())
    except BadInput as exc:
        raise CliError(str(exc)) from None
    publish(settings, answer)
    incident = short_id(request.correlation_id) if request.correlation_id else request.payload.incident_id[:8]
    print(f"keel: {'approved' if approved else 'denied'} request {short_id(request.id)} "
          f"({request.payload.action} for incident {incident}, job {request.job_id}) as {by}; event {answer.id}")
    return 0


def cmd_cordon(args: argparse.Namespace, settings: Settings) -> int:
    """``keel cordon`` and ``keel uncordon``."""
    cordoned = args.command == "cordon"
    by = operator_identity(settings, args.by)

    async def job_of(store: Any) -> str:
        jobs = await load_node_jobs(store.engine, args.node)
        if args.job is None:
            return choose_job(args.node, jobs)
        if args.job not in jobs:
            print(f"keel: warning: node {args.node} has no events in job {args.job} yet", file=sys.stderr)
        return str(args.job)

    job = on_store(settings, job_of)
    try:
        event = cordon_event(job, args.node, cordoned=cordoned, by=by, reason=args.reason or "", now=now_utc())
    except BadInput as exc:
        raise CliError(str(exc)) from None
    publish(settings, event)
    print(f"keel: {'cordoned' if cordoned else 'uncordoned'} {args.node} of job {job} as {by}; event {event.id}")
    return 0

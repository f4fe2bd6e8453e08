"""``keel ettr``, ``keel incidents``, ``keel timeline``: the reports of ``keel.reports.incidents`` from the log.

    keel ettr [--job J] [--window 1h] [--json]   cumulative and sliding-window ETTR, lost time by incident and phase
    keel incidents [--job J] [--json]            the controller's incidents, one line each
    keel timeline INCIDENT [--job J] [--json]    every event of one incident (id or a 6+ character prefix)

The human-input commands (approve, deny, cordon, uncordon) are ``keel.cli.approvals``, on the builders and
adapters of ``keel.reports.incidents``.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import TYPE_CHECKING

from keel.cli.common import CliError, Subparsers, on_store, print_json
from keel.events.units import parse_duration
from keel.reports.incidents import (
    ettr_json,
    format_ettr,
    format_fences,
    format_incidents,
    format_skewed_clocks,
    format_timeline,
    incidents_json,
    load_ettr,
    load_fences,
    load_incidents_and_clocks,
    load_timeline,
    timeline_json,
)

if TYPE_CHECKING:
    from keel.infra.config import Settings


def register(sub: Subparsers) -> None:
    ettr = sub.add_parser("ettr", help="ETTR, cumulative and over a sliding window, lost time by incident and phase")
    ettr.add_argument("--job", help="one job (default: every job in the log)")
    ettr.add_argument("--window", default="1h", help="the sliding window: the last DURATION of the log (default 1h)")
    ettr.add_argument("--json", action="store_true")
    ettr.set_defaults(func=cmd_ettr)

    incidents = sub.add_parser("incidents", help="the controller's incidents, one line each")
    incidents.add_argument("--job")
    incidents.add_argument("--json", action="store_true")
    incidents.set_defaults(func=cmd_incidents)

    timeline = sub.add_parser("timeline", help="every event of one incident, in log order")
    timeline.add_argument("incident", help="the incident id (the IncidentOpened event's) or a prefix of 6+ characters")
    timeline.add_argument("--job")
    timeline.add_argument("--json", action="store_true")
    timeline.set_defaults(func=cmd_timeline)


def cmd_ettr(args: argparse.Namespace, settings: Settings) -> int:
    try:
        window = parse_duration(args.window)
    except ValueError as exc:
        raise CliError(f"--window: {exc}") from None
    if window <= timedelta(0):
        raise CliError(f"--window must be longer than 0 s, got {args.window!r}")
    jobs = on_store(settings, lambda store: load_ettr(store, args.job, window))
    if args.json:
        print_json({"jobs": [ettr_json(job) if job else {"job_id": name, "cumulative": None, "window": None}
                             for name, job in jobs]})
        return 0
    if not jobs:
        print("keel: no events in the log")
        return 0
    blocks = [format_ettr(job) if job else f"job {name}: no rank has started yet: no ETTR" for name, job in jobs]
    print("\n\n".join(blocks))
    return 0


def cmd_incidents(args: argparse.Namespace, settings: Settings) -> int:
    incidents, clocks = on_store(settings, lambda store: load_incidents_and_clocks(store, args.job))
    fences = on_store(settings, lambda store: load_fences(store, args.job))
    if args.json:
        print_json({**incidents_json(incidents), "skewed_clocks": [c.to_json() for c in clocks],
                    "fenced": [{"job_id": e.job_id, **e.payload.model_dump(mode="json"),
                                "at": e.occurred_at.isoformat(), "incident": str(e.correlation_id)} for e in fences]})
    else:
        print(format_incidents(incidents))
        if clocks:
            print("\n" + format_skewed_clocks(clocks))
        if fences:
            print("\n" + format_fences(fences))
    return 0


def cmd_timeline(args: argparse.Namespace, settings: Settings) -> int:
    timeline = on_store(settings, lambda store: load_timeline(store, args.incident, args.job))
    if args.json:
        print_json(timeline_json(timeline))
    else:
        print(format_timeline(timeline))
    return 0


__all__ = ["cmd_ettr", "cmd_incidents", "cmd_timeline", "register"]

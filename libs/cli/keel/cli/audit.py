"""``keel audit``: the audit views over the event log (``keel.reports.audit``), filtered, as a table, JSON or CSV.

    keel audit evictions --since 7d                        which nodes were evicted in the last week, and why
    keel audit incidents --job J --kind hang --format csv  every hang of job J, for a spreadsheet
    keel audit actions --since 2026-12-01 --until 2026-12-02 --format json

Read as the ``auditor`` role.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from keel.cli.common import CliError, Subparsers, endpoints
from keel.reports.audit import (
    DEFAULT_LIMIT,
    FORMATS,
    VIEWS,
    AuditInputError,
    AuditQuery,
    load_rows,
    parse_moment,
    rows_csv,
    rows_json,
    rows_table,
)

if TYPE_CHECKING:
    from keel.infra.config import Settings


def register(sub: Subparsers) -> None:
    audit = sub.add_parser("audit", help="audit views of the log: incidents, decisions, evictions, rollbacks, "
                                         "node history, human actions")
    audit.add_argument("view", choices=sorted(VIEWS), help="what to list")
    audit.add_argument("--since", help="from: a duration back from now (7d, 12h) or an ISO 8601 date/time")
    audit.add_argument("--until", help="until (exclusive), as --since")
    audit.add_argument("--job")
    audit.add_argument("--node", help="one node (for incidents: its node, or one it evicted)")
    audit.add_argument("--kind", help="an incident's kind (crash, hang, ...), else the event type")
    audit.add_argument("--format", choices=FORMATS, default="table")
    audit.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help=f"at most this many rows (default "
                                                                        f"{DEFAULT_LIMIT}), oldest first")
    audit.set_defaults(func=cmd_audit)


def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    now = datetime.now(UTC)
    try:
        query = AuditQuery(view=args.view, job=args.job, node=args.node, kind=args.kind, limit=args.limit,
                           since=parse_moment(args.since, now, "--since") if args.since else None,
                           until=parse_moment(args.until, now, "--until") if args.until else None)
    except AuditInputError as exc:
        raise CliError(str(exc)) from None
    _, database_url = endpoints(settings)
    columns, rows = asyncio.run(load_rows(database_url, settings.db_schema, query))
    if len(rows) == query.limit:
        print(f"keel audit: the first {query.limit} rows (oldest first); narrow --since or raise --limit for the rest",
              file=sys.stderr)
    if args.format == "json":
        print(json.dumps(rows_json(args.view, rows), indent=2))
    elif args.format == "csv":
        print(rows_csv(rows, columns), end="")
    else:
        print(rows_table(args.view, rows))
    return 0


__all__ = ["cmd_audit", "register"]

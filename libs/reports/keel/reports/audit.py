"""The audit views over the event log, filtered, as a table, JSON or CSV: what ``keel audit`` prints and
``keel-api``'s ``/v1/audit`` serves (torch-free, like everything the API image holds).

    keel audit evictions --since 7d                        which nodes were evicted in the last week, and why
    keel audit incidents --job J --kind hang --format csv  every hang of job J, for a spreadsheet
    keel audit actions --since 2026-12-01 --until 2026-12-02 --format json

Views (migration 0005, ``docs/audit.md``): ``incidents``, ``decisions``, ``evictions``, ``rollbacks``, ``nodes``
(node history) and ``actions`` (human actions: approvals, cordons, deploys). ``--since`` / ``--until`` take a
duration back from now (``7d``, ``12h``) or an ISO 8601 date or time (UTC unless it says otherwise); ``--job``,
``--node`` and ``--kind`` (an incident's kind, else the event type) narrow it. Read as the ``auditor`` role.

Pure: ``AuditQuery`` (the view and filters, validated; ``sql()`` gives the statement and its bound parameters:
no value is ever put into the SQL text) and the formatters. The adapter (``load_rows``) runs it; the command
is ``keel.cli.audit``.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from keel.events.units import parse_duration


@dataclass(frozen=True)
class View:
    relation: str
    at: str
    """The column the time filters and the order go by."""
    kind: str | None
    """The column ``--kind`` matches, or None (no such filter)."""
    node: str | None
    """The column ``--node`` matches: a text column, or an array of node ids (``[]`` suffix)."""
    columns: tuple[str, ...]
    """The columns shown in a table (JSON and CSV have every column)."""


VIEWS: dict[str, View] = {
    "incidents": View("audit_incidents", "opened_at", "kind", "node_id",
                      ("incident_id", "job_id", "opened_at", "kind", "node_id", "outcome", "open_s", "rungs",
                       "evicted_nodes", "reason")),
    "decisions": View("audit_decisions", "decided_at", "type", "node_id",
                      ("decided_at", "job_id", "type", "rung", "node_id", "incident_id", "reason")),
    "evictions": View("audit_evictions", "decided_at", None, "node_id",
                      ("decided_at", "job_id", "node_id", "rung", "outcome", "actuator", "incident_id", "reason")),
    "rollbacks": View("audit_rollbacks", "decided_at", "type", None,
                      ("decided_at", "job_id", "type", "to_version", "incident_id", "reason")),
    "nodes": View("audit_node_history", "at", "type", "node_id", ("at", "job_id", "node_id", "type", "what")),
    "actions": View("audit_human_actions", "at", "type", None,
                    ("at", "job_id", "type", "by", "target", "approved", "action", "note")),
}
FORMATS = ("table", "json", "csv")
DEFAULT_LIMIT = 1000


class AuditInputError(ValueError):
    """A filter that cannot be used; the message says which and why."""


def parse_moment(text: str, now: datetime, flag: str) -> datetime:
    """``7d``-style durations count back from ``now``; anything else must be an ISO 8601 date or time (naive: UTC)."""
    try:
        back = parse_duration(text)
    except ValueError:
        pass
    else:
        if back < timedelta(0):
            raise AuditInputError(f"{flag}: a duration back from now must not be negative, got {text!r}")
        return now - back
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise AuditInputError(f"{flag}: {text!r} is neither a duration (7d, 12h, 30m) nor an ISO 8601 date or time "
                              f"(2026-12-01, 2026-12-01T08:00:00Z)") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass(frozen=True)
class AuditQuery:
    view: str
    since: datetime | None = None
    until: datetime | None = None
    job: str | None = None
    node: str | None = None
    kind: str | None = None
    limit: int = DEFAULT_LIMIT

    def __post_init__(self) -> None:
        if self.view not in VIEWS:
            raise AuditInputError(f"no audit view {self.view!r}: one of {', '.join(VIEWS)}")
        spec = VIEWS[self.view]
        if self.node is not None and spec.node is None:
            raise AuditInputError(f"--node does not apply to {self.view} (it has no node column)")
        if self.kind is not None and spec.kind is None:
            raise AuditInputError(f"--kind does not apply to {self.view}")
        if self.since is not None and self.until is not None and self.since > self.until:
            raise AuditInputError(f"--since ({self.since.isoformat()}) is after --until ({self.until.isoformat()})")
        if not 1 <= self.limit <= 1_000_000:
            raise AuditInputError(f"--limit must be between 1 and 1000000, got {self.limit}")

    def sql(self) -> tuple[str, dict[str, Any]]:
        """The statement (only identifiers from ``VIEWS`` in its text) and its bound parameters."""
        spec = VIEWS[self.view]
        where: list[str] = []
        params: dict[str, Any] = {"limit": self.limit}
        if self.since is not None:
            where.append(f"{spec.at} >= :since")
            params["since"] = self.since
        if self.until is not None:
            where.append(f"{spec.at} < :until")
            params["until"] = self.until
        if self.job is not None:
            where.append("job_id = :job")
            params["job"] = self.job
        if self.node is not None:
            assert spec.node is not None
            if self.view == "incidents":  # the incident's node, or one it evicted
                where.append("(node_id = :node OR :node = ANY(evicted_nodes))")
            else:
                where.append(f"{spec.node} = :node")
            params["node"] = self.node
        if self.kind is not None:
            where.append(f"{spec.kind} = :kind")
            params["kind"] = self.kind
        text = f"SELECT * FROM {spec.relation}"
        if where:
            text += " WHERE " + " AND ".join(where)
        return text + f" ORDER BY {spec.at} LIMIT :limit", params


def _cell(value: Any) -> Any:
    """A JSON-ready value: times as ISO 8601, ids as text, lists kept."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return [_cell(v) for v in value]
    if isinstance(value, (str, int, float, bool, dict)) or value is None:
        return value
    return str(value)


def rows_json(view: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"view": view, "rows": [{k: _cell(v) for k, v in row.items()} for row in rows]}


def rows_csv(rows: list[dict[str, Any]], columns: list[str]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_spreadsheet_safe(_text(row.get(c))) for c in columns])
    return out.getvalue()


def _spreadsheet_safe(text: str) -> str:
    """A cell a spreadsheet would run as a formula (a reason or comment someone typed) is quoted as text."""
    return "'" + text if text[:1] in ("=", "+", "-", "@") else text


def _text(value: Any) -> str:
    value = _cell(value)
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, (list, dict)):
        return json.dumps(value) if isinstance(value, dict) or any(isinstance(v, (dict, list)) for v in value) \
            else ",".join(str(v) for v in value)
    return str(value)


def rows_table(view: str, rows: list[dict[str, Any]], *, width: int = 70) -> str:
    columns = list(VIEWS[view].columns)
    if not rows:
        return f"keel audit {view}: nothing matches"
    cells = [[_text(row.get(c)) for c in columns] for row in rows]
    cells = [[c if len(c) <= width else c[:width - 1] + "…" for c in line] for line in cells]
    widths = [max(len(columns[i]), *(len(line[i]) for line in cells)) for i in range(len(columns))]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells]
    return "\n".join(lines)


async def load_rows(database_url: str, schema: str, query: AuditQuery) -> tuple[list[str], list[dict[str, Any]]]:
    """Run ``query`` (adapter): the columns and the rows."""
    import sqlalchemy as sa

    from keel.infra.store import create_engine

    engine = create_engine(database_url, schema)
    try:
        text, params = query.sql()
        async with engine.connect() as conn:
            result = await conn.execute(sa.text(text), params)
            columns = list(result.keys())
            return columns, [dict(zip(columns, row, strict=True)) for row in result.all()]
    finally:
        await engine.dispose()


__all__ = ["DEFAULT_LIMIT", "FORMATS", "AuditInputError", "AuditQuery", "VIEWS", "View", "load_rows", "parse_moment",
           "rows_csv", "rows_json", "rows_table"]

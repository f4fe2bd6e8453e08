"""``keel audit``'s pure part: filters are validated and bound as parameters, never spliced into the SQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from keel.reports.audit import VIEWS, AuditInputError, AuditQuery, parse_moment, rows_csv, rows_table

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def test_values_are_bound_parameters_and_only_known_identifiers_reach_the_sql() -> None:
    hostile = "n1'; DROP TABLE events; --"
    text, params = AuditQuery("evictions", job=hostile, node=hostile, since=NOW - timedelta(days=7)).sql()
    assert hostile not in text and "DROP" not in text
    assert text == ("SELECT * FROM audit_evictions WHERE decided_at >= :since AND job_id = :job AND node_id = :node "
                    "ORDER BY decided_at LIMIT :limit")
    assert params == {"since": NOW - timedelta(days=7), "job": hostile, "node": hostile, "limit": 1000}
    text, _ = AuditQuery("incidents", node="n3", kind="hang").sql()
    assert "(node_id = :node OR :node = ANY(evicted_nodes))" in text and "kind = :kind" in text
    assert {v.relation for v in VIEWS.values()} == {"audit_incidents", "audit_decisions", "audit_evictions",
                                                    "audit_rollbacks", "audit_node_history", "audit_human_actions"}


def test_moments_are_durations_back_or_iso_times_and_anything_else_is_refused() -> None:
    assert parse_moment("7d", NOW, "--since") == NOW - timedelta(days=7)
    assert parse_moment("2026-12-01", NOW, "--since") == datetime(2026, 12, 1, tzinfo=UTC)
    assert parse_moment("2026-12-01T08:00:00+01:00", NOW, "--until").utcoffset() == timedelta(hours=1)
    with pytest.raises(AuditInputError, match="neither a duration"):
        parse_moment("last tuesday", NOW, "--since")
    for kwargs, message in (({"view": "nope"}, "no audit view 'nope'"), ({"view": "rollbacks", "node": "n1"}, "--node"),
                            ({"view": "evictions", "kind": "x"}, "--kind"), ({"view": "nodes", "limit": 0}, "--limit"),
                            ({"view": "nodes", "since": NOW, "until": NOW - timedelta(1)}, "is after --until")):
        with pytest.raises(AuditInputError, match=message):
            AuditQuery(**kwargs)  # type: ignore[arg-type]


def test_table_and_csv_show_lists_times_and_missing_values_plainly() -> None:
    row = {"at": NOW, "job_id": "j", "node_id": "n3", "type": "NodeEvicted", "what": None}
    assert rows_table("nodes", [row]).splitlines()[1].split() == ["2026-12-06T12:00:00+00:00", "j", "n3", "NodeEvicted"]
    assert rows_table("nodes", []) == "keel audit nodes: nothing matches"
    assert rows_csv([{"rungs": [1, 4], "open_s": 12.0, "x": None}], ["rungs", "open_s", "x"]) == 'rungs,open_s,x\n"1,4",12.000,\n'
    formula = rows_csv([{"note": "=HYPERLINK(\"http://x\")", "by": "-1", "why": "fine"}], ["note", "by", "why"])
    assert formula.splitlines()[1] == '"\'=HYPERLINK(""http://x"")",\'-1,fine'

"""The audit views (migration 0005) and ``keel audit`` over a real store, on a log the real controller wrote: a
host cut off the network, evicted at rung 1 on a peer's report (the controller's own decisions, from its
decider), the actuator carrying the eviction out, a crash incident with diagnostics and a restart, a rollback,
and people approving and cordoning. Every SQL query in ``docs/audit.md`` runs here, as the auditor role."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

import tests.unit.test_controller_clock as clock
from keel.events.envelope import Event, now_utc
from keel.events.types import ApprovalRequested, NodeEvicted, RollbackDecided
from keel.infra.store import append_events, create_engine, event_row
from keel.reports.incidents import approval_answer, cordon_event
from tests.conftest import TEST_OPERATOR
from tests.incident_factories import incident_log
from tests.integration.test_crashes import service_env
from tests.unit.test_controller_peer_reports import address, on_hosts, report

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[2] / "docs" / "audit.md"


def audited_log(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Event], dict[str, Event]]:
    """The log: the controller's decider evicting a cut host (an hour ago), the actuator's answer, a crash incident
    (days ago, from the incident factory, job2), a rollback, an approval and a cordon."""
    now = now_utc()
    monkeypatch.setattr(clock, "T0", now - timedelta(hours=1))
    job = on_hosts()  # job1, four nodes on hosts, a tick a second
    report(job, "n0", address("n3"))
    job.run(4, silent=frozenset({"n3"}))
    [decision] = [e for e in job.log if e.type == "NodeEvictionDecided"]
    carried = Event.create(NodeEvicted(node_id="n3", decision_id=str(decision.id), actuator="local", outcome="evicted"),
                           job_id=decision.job_id, subject="node/n3", producer="actuator",
                           occurred_at=decision.occurred_at + timedelta(seconds=1), correlation_id=decision.correlation_id)
    crash = incident_log("job2")  # 2026-11-29: older than any --since below
    [opened] = [e for e in crash.events if e.type == "IncidentOpened"]
    rollback = Event.create(RollbackDecided(incident_id=str(opened.id), reason="rung 4: the crash follows version v7; "
                                            "roll back to v6", fingerprint="crash/x", to_version="v6",
                                            expires_at=opened.occurred_at + timedelta(minutes=5)),
                            job_id="job2", subject="job/job2", producer="controller",
                            occurred_at=opened.occurred_at + timedelta(seconds=2), correlation_id=opened.id)
    request = Event.create(ApprovalRequested(incident_id=str(decision.correlation_id), action="evict",
                                             reason="evict n3", expires_at=now + timedelta(minutes=10)),
                           job_id="job1", subject="job/job1", producer="controller", occurred_at=now - timedelta(minutes=30),
                           correlation_id=decision.correlation_id)
    approval = approval_answer(request, approved=True, by=TEST_OPERATOR, comment="n3 is gone, go ahead",
                               now=now - timedelta(minutes=29))
    cordon = cordon_event("job1", "n2", cordoned=True, by=TEST_OPERATOR, reason="flaky NIC, RMA ticket 4711",
                          now=now - timedelta(minutes=20))
    events = [*crash.events, rollback, *job.log, carried, request, approval, cordon]
    return events, {"decision": decision, "crash": opened, "approval": approval}


async def keel(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "keel.cli.main", *args], env=env,
                                   capture_output=True, text=True, timeout=60)


async def test_the_audit_views_answer_from_a_log_the_controller_wrote(keel_env, monkeypatch: pytest.MonkeyPatch) -> None:
    events, named = audited_log(monkeypatch)
    async with keel_env.engine.begin() as conn:
        await append_events(conn, [event_row(event, None) for event in events])
    env = service_env(keel_env.settings)
    decision = named["decision"]

    incidents = await keel(env, "audit", "incidents", "--format", "json")
    assert incidents.returncode == 0, incidents.stderr
    rows = {row["kind"]: row for row in json.loads(incidents.stdout)["rows"]}
    assert set(rows) == {"crash", "lost_node"}
    lost, crash = rows["lost_node"], rows["crash"]
    assert lost["incident_id"] == str(decision.correlation_id) and lost["node_id"] == "n3"
    assert lost["outcome"] == "open" and lost["rungs"] == [1] and lost["evicted_nodes"] == ["n3"]
    assert "peers cannot reach a silent node" in lost["reason"]
    assert crash["outcome"] == "recovered" and crash["open_s"] == pytest.approx(12.0) and crash["rungs"] == [2, 4]

    evictions = await keel(env, "audit", "evictions", "--since", "7d")
    assert evictions.returncode == 0, evictions.stderr
    header, line = evictions.stdout.splitlines()
    assert header.split()[:6] == ["DECIDED_AT", "JOB_ID", "NODE_ID", "RUNG", "OUTCOME", "ACTUATOR"]
    assert line.split()[1:6] == ["job1", "n3", "1", "evicted", "local"]
    assert (await keel(env, "audit", "evictions", "--until", "7d")).stdout.strip() == "keel audit evictions: nothing matches"

    actions = await keel(env, "audit", "actions", "--since", "2h", "--format", "csv")
    assert actions.returncode == 0, actions.stderr
    table = list(csv.DictReader(io.StringIO(actions.stdout)))
    assert [(r["type"], r["by"], r["approved"], r["action"], r["target"]) for r in table] == [
        ("ApprovalGiven", TEST_OPERATOR, "True", "evict", str(named["approval"].payload.request_id)),
        ("NodeCordoned", TEST_OPERATOR, "", "", "n2")]
    assert table[1]["note"] == "flaky NIC, RMA ticket 4711"

    history = json.loads((await keel(env, "audit", "nodes", "--node", "n3", "--format", "json")).stdout)["rows"]
    assert [r["type"] for r in history] == ["NodeRegistered", "NodeRegistered", "IncidentOpened", "NodeEvictionDecided",
                                           "NodeEvicted"]  # registered by the job, then with its host's address
    rollbacks = json.loads((await keel(env, "audit", "rollbacks", "--job", "job2", "--format", "json")).stdout)["rows"]
    assert [(r["to_version"], r["incident_id"]) for r in rollbacks] == [("v6", str(named["crash"].id))]
    hangs = json.loads((await keel(env, "audit", "incidents", "--kind", "hang", "--format", "json")).stdout)
    assert hangs["rows"] == []
    by_node = json.loads((await keel(env, "audit", "incidents", "--node", "n3", "--format", "json")).stdout)["rows"]
    assert [r["kind"] for r in by_node] == ["lost_node"]

    # What cannot be used is refused, naming it, with the usage exit status.
    for args, message in ((["rollbacks", "--node", "n1"], "--node does not apply to rollbacks"),
                          (["evictions", "--kind", "x"], "--kind does not apply to evictions"),
                          (["incidents", "--since", "last tuesday"], "neither a duration"),
                          (["incidents", "--since", "1h", "--until", "2h"], "is after --until"),
                          (["incidents", "--limit", "0"], "--limit must be between")):
        refused = await keel(env, "audit", *args)
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr)


def doc_queries() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", DOCS.read_text(), re.S)


async def test_every_query_in_the_audit_docs_runs_as_the_auditor_and_finds_its_rows(
        keel_env, monkeypatch: pytest.MonkeyPatch) -> None:
    events, named = audited_log(monkeypatch)
    async with keel_env.engine.begin() as conn:
        await append_events(conn, [event_row(event, None) for event in events])
    from keel.infra.config import resolve_endpoints

    _, auditor_url = resolve_endpoints(keel_env.settings, "auditor")
    engine = create_engine(auditor_url, keel_env.settings.db_schema)
    queries = doc_queries()
    assert len(queries) == 8
    try:
        async with engine.connect() as conn:
            results = [[dict(r._mapping) for r in (await conn.execute(sa.text(q))).all()] for q in queries]
            # The auditor reads the views, and cannot write the log.
            with pytest.raises(sa.exc.DBAPIError, match="permission denied"):
                await conn.execute(sa.text("DELETE FROM events"))
    finally:
        await engine.dispose()
    evicted, still_open, per_kind, past_restart, decisions, humans, offenders, rollbacks = results
    assert [(r["node_id"], r["outcome"]) for r in evicted] == [("n3", "evicted")]
    assert [r["kind"] for r in still_open] == ["lost_node"]
    assert {(r["job_id"], r["kind"], r["incidents"], r["recovered"]) for r in per_kind} == {
        ("job1", "lost_node", 1, 0), ("job2", "crash", 1, 1)}
    assert [r["kind"] for r in past_restart] == ["crash"]  # its rollback is rung 4
    assert [r["type"] for r in decisions][:2] == ["IncidentOpened", "NodeEvictionDecided"]
    assert decisions[1]["evidence"] and decisions[1]["rung"] == 1 and all(r["reason"] for r in decisions)
    assert {r["type"] for r in decisions} >= {"ActionHeld", "StandbyRefillRequested"}  # no standby: the restart waits
    assert [(r["type"], r["approved"]) for r in humans] == [("ApprovalGiven", True), ("NodeCordoned", None)]
    assert offenders[0]["node_id"] == "n3" and offenders[0]["evictions"] == 1
    assert [r["to_version"] for r in rollbacks] == ["v6"]

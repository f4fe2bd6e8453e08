"""`keel ettr`, `keel incidents`, `keel timeline` over a real store, and `keel approve` / `deny` /
`cordon` / `uncordon` publishing on a real bus (the recorder persists what they publish)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from datetime import timedelta

import pytest

from keel.events.envelope import Event, now_utc
from keel.events.types import ApprovalRequested, IncidentOpened, IncidentResolved, NodeRegistered
from keel.infra.store import append_events, event_row
from keel.reports.incidents import LookupFailed, load_ettr, load_incident_page, load_incidents, load_timeline
from keel.rules.ettr import compute_ettr
from tests.incident_factories import JOB, at, incident_log
from tests.integration.test_crashes import service_env

pytestmark = pytest.mark.integration


async def keel(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "keel.cli.main", *args], env=env, capture_output=True, text=True,
                              timeout=60)

    return await asyncio.to_thread(run)


async def append(keel_env, events: list[Event]) -> None:  # type: ignore[no-untyped-def]
    async with keel_env.engine.begin() as conn:
        await append_events(conn, [event_row(event, None) for event in events])


async def test_ettr_incidents_and_timeline_of_a_recorded_incident(keel_env) -> None:
    log = incident_log()
    await append(keel_env, log.events)
    env = service_env(keel_env.settings)
    short = str(log.incident_id)[:8]

    ettr = await keel(env, "ettr", "--job", JOB, "--window", "55s")
    assert ettr.returncode == 0, ettr.stderr
    lines = ettr.stdout.splitlines()
    assert lines[0].startswith("job job1: 2026-11-29 09:00:00.000 .. 2026-11-29 09:02:00.000")
    assert lines[3].split() == ["ETTR", "90.00", "%", "87.27", "%"]
    assert lines[6].split() == ["unproductive", "12.0", "s", "7.00", "s"]
    assert lines[8].split() == ["localisation", "0.10", "s", "0.00", "s"]
    assert lines[12].split()[:2] == ["checkpointing", "0.00"] and lines[13].split()[:3] == ["slow", "steps", "0.00"]
    assert lines[15].split() == ["generation", "changes", "1", "1"]
    assert lines[16].split() == ["restart", "requests", "1", "0"]
    [incident_line] = [line for line in lines if line.lstrip().startswith("1  2026")]
    assert f"{short} crash" in incident_line and incident_line.endswith("injected crash on n2")

    as_json = await keel(env, "ettr", "--json")  # every job, default window 1h
    assert as_json.returncode == 0, as_json.stderr
    [job] = json.loads(as_json.stdout)["jobs"]
    assert job["job_id"] == JOB and job["cumulative"]["ettr"] == pytest.approx(0.9)
    assert job["window"]["length_s"] == 3600 and job["window"]["lost_s"] == pytest.approx(12.0)
    assert job["cumulative"]["incidents"][0]["phases_s"]["failover"] == pytest.approx(5.0)
    assert job["cumulative"]["incidents"][0]["controller_incident"]["id"] == str(log.incident_id)

    incidents = await keel(env, "incidents")
    assert incidents.returncode == 0, incidents.stderr
    header, line = incidents.stdout.strip().splitlines()
    assert header.split()[0] == "ID"
    assert line.split()[:10] == [short, "job1", "2026-11-29", "09:01:00.500", "crash", "n2", "2", "recovered",
                                 "12.0", "s"]
    listed = json.loads((await keel(env, "incidents", "--json", "--job", JOB)).stdout)["incidents"]
    assert [(i["id"], i["outcome"], i["rung"]) for i in listed] == [(str(log.incident_id), "recovered", 2)]

    timeline = await keel(env, "timeline", short[:6])
    assert timeline.returncode == 0, timeline.stderr
    out = timeline.stdout.splitlines()
    assert out[0] == f"incident {log.incident_id} (crash on n2, job job1): recovered after 12.0 s, highest rung 2"
    body = [line.split()[:3] for line in out[4:]]
    assert body == [
        ["+0.000", "s", "*RankExited"], ["+0.100", "s", "IncidentOpened"], ["+0.100", "s", "DiagnosticsRequested"],
        ["+3.600", "s", "DiagnosticsCompleted"], ["+3.800", "s", "DiagnosticsCompleted"],
        ["+3.900", "s", "RestartDecided"], ["+3.900", "s", "RanksRestartRequested"],
        ["+3.900", "s", "RanksRestartRequested"], ["+12.100", "s", "IncidentResolved"]]
    assert out[9].endswith("every node passed diagnostics; restart in place as generation 1")
    full = json.loads((await keel(env, "timeline", str(log.incident_id), "--json")).stdout)
    assert [e["type"] for e in full["events"]][:2] == ["RankExited", "IncidentOpened"]

    unknown = await keel(env, "timeline", "abcdef12")
    assert unknown.returncode == 1 and "no incident abcdef12" in unknown.stderr
    short_prefix = await keel(env, "timeline", short[:4])
    assert short_prefix.returncode == 2 and "at least 6 hex characters" in short_prefix.stderr
    elsewhere = await keel(env, "timeline", short, "--job", "other")
    assert elsewhere.returncode == 1 and f"no incident {short}" in elsewhere.stderr
    no_job = await keel(env, "ettr", "--job", "other")
    assert no_job.returncode == 1 and "no events for job other" in no_job.stderr


async def test_an_ambiguous_prefix_names_both_incidents(keel_env) -> None:
    first = uuid.UUID("abcdef12-0000-4000-8000-000000000001")
    second = uuid.UUID("abcdef12-0000-4000-8000-000000000002")
    await append(keel_env, incident_log(incident_id=first).events + incident_log("job2", incident_id=second).events)
    env = service_env(keel_env.settings)
    ambiguous = await keel(env, "timeline", "abcdef12")
    assert ambiguous.returncode == 1
    assert "incident id 'abcdef12' is ambiguous: 2 match (abcdef12-0000, abcdef12-0000)" in ambiguous.stderr
    narrowed = await keel(env, "timeline", "abcdef12", "--job", "job2")
    assert narrowed.returncode == 0 and "job job2" in narrowed.stdout.splitlines()[0]
    both = await keel(env, "ettr")
    assert both.returncode == 0 and "job job1:" in both.stdout and "job job2:" in both.stdout


async def test_the_store_adapters_read_only_what_they_need_and_get_the_same_report(keel_env) -> None:
    log = incident_log()
    await append(keel_env, log.events)
    [(job, loaded)] = await load_ettr(keel_env.store, None, timedelta(hours=1))
    direct = compute_ettr(log.events)
    assert job == JOB and loaded is not None and direct is not None
    assert loaded.report == direct  # fetched by type, ended at the job's last event: the same report
    timeline = await load_timeline(keel_env.store, str(log.incident_id)[:6])
    assert [e.position for e in timeline.entries] == sorted(e.position for e in timeline.entries)
    with pytest.raises(LookupFailed):
        await load_timeline(keel_env.store, "ffffff")


async def test_a_page_of_incidents_reads_only_its_incidents_and_summarizes_them_as_the_whole_list(keel_env) -> None:
    logs = [incident_log(start_s=600.0 * i) for i in range(5)]
    events = [e for log in logs for e in log.events] + incident_log("job2", start_s=30.0).events
    # An incident resolved by an event naming it only in its payload (no correlation id): found all the same.
    bare = Event.create(IncidentOpened(kind="hang", node_id="n1", generation=9, reason="a hang"), job_id=JOB,
                        subject=f"job/{JOB}", producer="controller", occurred_at=at(5000.0))
    resolved = Event.create(IncidentResolved(incident_id=str(bare.id), outcome="recovered", rung=1, generation=10,
                                             reason="stepping again"), job_id=JOB, subject=f"job/{JOB}",
                            producer="controller", occurred_at=at(5010.0))
    await append(keel_env, [*events, bare, resolved])
    whole = await load_incidents(keel_env.store, JOB)
    assert len(whole) == 6 and whole[-1].outcome == "recovered"
    pages, before = [], None
    while True:
        page = await load_incident_page(keel_env.store, JOB, limit=4, before=before)
        assert page.total == 6
        pages.append(page.incidents)
        if page.next_before is None:
            break
        before = page.next_before
    assert [len(p) for p in pages] == [4, 2]
    assert [i for p in pages for i in p] == whole[::-1], "newest first, each summarized as in the whole list"
    assert (await load_incident_page(keel_env.store, "job2")).incidents == await load_incidents(keel_env.store, "job2")
    with pytest.raises(ValueError, match="limit must be at least 1"):
        await load_incident_page(keel_env.store, JOB, limit=0)


async def test_a_page_read_without_a_checkout_test_survives_its_pools_connections_ended_by_the_server(keel_env) -> None:
    """The API reads pages through a pool that does not test a connection on checkout (three round trips with
    asyncpg): after the server ended every connection of that pool (a restart, an idle timeout), a read drops
    each closed one it is handed and answers the same page on a new one; other reads keep their own engine."""
    from keel.infra.store import EventStore, create_engine

    await append(keel_env, [e for i in range(3) for e in incident_log(start_s=600.0 * i).events])
    settings = keel_env.settings
    reads = create_engine(settings.database_url, settings.db_schema, pool_size=3, pre_ping=False)
    store = EventStore(keel_env.engine, fetch_engine=reads)
    try:
        first = await load_incident_page(store, JOB, limit=2)
        async with reads.connect() as a, reads.connect() as b, reads.connect() as c:  # the pool's three connections
            pids = [(await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar_one() for conn in (a, b, c)]
        assert len(set(pids)) == 3
        async with keel_env.engine.connect() as admin:
            for pid in pids:
                assert (await admin.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")).scalar_one()
        await asyncio.sleep(0.2)
        again = await load_incident_page(store, JOB, limit=2)
        assert again == first and len(first.incidents) == 2
        async with reads.connect() as conn:
            assert (await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar_one() not in pids
        # Nothing to take: every connection the server closes at once, each time, is given up on, with the reason.
        store.stale_connections_dropped = 0
        async with reads.connect() as a, reads.connect() as b, reads.connect() as c:
            pids = [(await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar_one() for conn in (a, b, c)]
        async with keel_env.engine.connect() as admin:
            for pid in pids:
                await admin.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
        await asyncio.sleep(0.2)
        with pytest.raises(ConnectionError, match="closed by the server"):
            await load_incident_page(store, JOB, limit=2)
    finally:
        await reads.dispose()


async def test_the_store_keeps_parsed_events_by_their_stored_text_and_bounded(keel_env) -> None:
    """Listing reads keep their parsed events (the page and timelines read the same ones again): an event read
    again is the same object, and the bound holds (the least recently read is parsed again)."""
    from keel.infra.store import EventStore

    log = incident_log(start_s=0.0).events
    await append(keel_env, log)
    store = EventStore(keel_env.engine)
    store.parsed_kept = 3
    ids = [e.id for e in log[:5]]
    first = await store.get_many(ids)
    assert [r.event for r in first] == log[:5] and len(store._parsed) == 3
    again = await store.get_many(ids[-2:])
    assert all(a.event is b.event for a, b in zip(again, first[-2:], strict=True)), "kept, not parsed again"
    [oldest] = await store.get_many(ids[:1])  # dropped from the kept three: parsed again, equal
    assert oldest.event == first[0].event and oldest.event is not first[0].event


async def wait_for_type(keel_env, event_type: str, count: int, timeout_s: float = 20.0) -> list[Event]:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        found = [r.event async for r in keel_env.store.read(types=[event_type])]
        if len(found) >= count or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.05)


async def test_approve_and_deny_publish_an_answer_once(keel_env) -> None:
    await keel_env.start_recorder()
    incident = uuid.uuid4()
    now = now_utc()
    opened = Event.create(IncidentOpened(kind="hardware", node_id="n2", generation=0, reason="XID 79 on n2"),
                          job_id=JOB, subject="job/job1", producer="controller", occurred_at=now, event_id=incident,
                          correlation_id=incident)
    requests = [Event.create(ApprovalRequested(incident_id=str(incident), action=action, reason=f"{action} n2",
                                               expires_at=now + timedelta(minutes=10)),
                             job_id=JOB, subject="job/job1", producer="controller", occurred_at=now,
                             correlation_id=incident) for action in ("evict", "restart")]
    expired = Event.create(ApprovalRequested(incident_id=str(incident), action="rollback", reason="roll back",
                                             expires_at=now - timedelta(seconds=1)),
                           job_id=JOB, subject="job/job1", producer="controller", occurred_at=now - timedelta(minutes=5),
                           correlation_id=incident)
    for event in (opened, *requests, expired):
        await keel_env.bus.publish(event)
    assert await keel_env.wait_for_count(4) == 4
    env = {**service_env(keel_env.settings), "USER": "carol"}

    # Who answers is the identity whose key signs the answer, not a free-text name: --by naming anyone else
    # is refused; signing as alice takes alice's key (signing.operator).
    forged_by = await keel(env, "approve", str(requests[0].id)[:8], "--by", "alice")
    assert forged_by.returncode == 2 and "--by 'alice' is not your signing identity 'carol'" in forged_by.stderr
    approve = await keel({**env, "KEEL_SIGNING__OPERATOR": "alice"}, "approve", str(requests[0].id)[:8],
                         "--comment", "n2 is dead")
    assert approve.returncode == 0, approve.stderr
    assert approve.stdout.startswith(f"keel: approved request {str(requests[0].id)[:8]} (evict for incident "
                                     f"{str(incident)[:8]}, job job1) as alice")
    [given] = await wait_for_type(keel_env, "ApprovalGiven", 1)
    assert given.payload.model_dump() == {"request_id": str(requests[0].id), "approved": True, "by": "alice",
                                          "comment": "n2 is dead"}
    assert given.correlation_id == incident and given.causation_id == requests[0].id and given.producer == "cli"
    assert given.signed_by == "alice" and given.signature

    again = await keel(env, "deny", str(requests[0].id))
    assert again.returncode == 1 and "(evict) was already approved by alice" in again.stderr

    deny = await keel(env, "deny", str(requests[1].id))  # --by defaults to the login name
    assert deny.returncode == 0, deny.stderr
    answers = await wait_for_type(keel_env, "ApprovalGiven", 2)
    assert [(a.payload.approved, a.payload.by) for a in answers] == [(True, "alice"), (False, "carol")]
    assert [a.signed_by for a in answers] == ["alice", "carol"]

    late = await keel(env, "approve", str(expired.id))
    assert late.returncode == 1 and "(rollback) expired at" in late.stderr
    unknown = await keel(env, "approve", str(uuid.uuid4()))
    assert unknown.returncode == 1 and "no approval request" in unknown.stderr
    not_a_request = await keel(env, "approve", str(incident))  # an incident id is no request id
    assert not_a_request.returncode == 1
    await asyncio.sleep(0.3)
    assert len(await wait_for_type(keel_env, "ApprovalGiven", 3, timeout_s=0.5)) == 2  # the refusals published nothing

    # The answers belong to the incident's timeline.
    timeline = await keel(env, "timeline", str(incident))
    assert [line.split()[2] for line in timeline.stdout.splitlines()[4:]] == [
        "IncidentOpened", "ApprovalRequested", "ApprovalRequested", "ApprovalRequested", "ApprovalGiven", "ApprovalGiven"]


async def test_cordon_and_uncordon_publish_node_cordoned(keel_env) -> None:
    await keel_env.start_recorder()
    await keel_env.bus.publish(Event.create(NodeRegistered(node_id="n2", host="host-n2"), job_id=JOB,
                                            subject="node/n2", producer="agent", occurred_at=at(0)))
    assert await keel_env.wait_for_count(1) == 1
    env = {**service_env(keel_env.settings), "USER": "carol"}

    cordon = await keel(env, "cordon", "n2", "--reason", "flaky NIC, RMA ticket 4411")
    assert cordon.returncode == 0, cordon.stderr
    assert cordon.stdout.startswith("keel: cordoned n2 of job job1 as carol")
    uncordon = await keel({**env, "KEEL_SIGNING__OPERATOR": "dave"}, "uncordon", "n2", "--by", "dave", "--job", JOB)
    assert uncordon.returncode == 0, uncordon.stderr
    events = await wait_for_type(keel_env, "NodeCordoned", 2)
    assert [(e.job_id, e.subject, e.payload.cordoned, e.payload.by, e.payload.reason) for e in events] == [
        (JOB, "node/n2", True, "carol", "flaky NIC, RMA ticket 4411"), (JOB, "node/n2", False, "dave", "")]
    assert "--by is deprecated" in uncordon.stderr and [e.signed_by for e in events] == ["carol", "dave"]

    unknown = await keel(env, "cordon", "n9", "--reason", "x")
    assert unknown.returncode == 1 and "node n9 has no events in the log: pass --job" in unknown.stderr
    no_reason = await keel(env, "cordon", "n2")
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr

"""`keel dlq ls / show / redrive` against real NATS and PostgreSQL with the recorder running: poison messages
are dead-lettered, listed, shown, redriven after a code fix (an upcaster) or with a corrected body, each
redrive is recorded once, what cannot be redriven is refused with its reason, and nothing is lost."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from keel.cli.main import main
from keel.events.envelope import REGISTRY, now_utc
from keel.events.types import DeadLetterRedriven
from keel.infra.bus import HEADER_DLQ_REASON, HEADER_DLQ_STREAM_SEQ, HEADER_DLQ_SUBJECT
from keel.infra.dlq import DeadLetters, plan_redrive, redrive_record_id
from keel.infra.store import metadata
from tests.factories import health_event
from tests.integration.test_crashes import service_env
from tests.integration.test_incidents_cli import keel

pytestmark = pytest.mark.integration


async def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def stored(keel_env) -> list[Any]:  # type: ignore[no-untyped-def]
    events = metadata.tables["events"]
    async with keel_env.engine.connect() as conn:
        return list((await conn.execute(sa.select(events.c.event_id, events.c.type, events.c.schema_version))).all())


class InProcess:
    """``keel ARGS`` run in this process (the test's code, fixes included), its output read from capsys: the
    same ``main`` as the console script, without an interpreter start per call."""

    def __init__(self, capsys) -> None:  # type: ignore[no-untyped-def]
        self.capsys = capsys

    async def __call__(self, *args: str) -> subprocess.CompletedProcess:
        self.capsys.readouterr()
        status = await asyncio.to_thread(main, list(args))
        out = self.capsys.readouterr()
        return subprocess.CompletedProcess(["keel", *args], status, out.out, out.err)


def _lenient_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """The "code fix": a v1 NodeHealthChanged without its node is read as an unknown node's (the shipped
    upcaster raises KeyError on it)."""
    return {"node_id": payload.get("node_id", "unknown"), "status": "healthy" if payload.get("healthy") else "failed",
            "component": "unknown", "check": payload.get("check", "legacy"), "confidence": "medium",
            "is_fatal": False, "detail": payload.get("detail", ""), "evidence": {}}


async def test_dead_letters_listed_shown_and_redriven_once_nothing_lost(keel_env, capsys, monkeypatch,
                                                                        scratch_dir: Path) -> None:
    bus, settings = keel_env.bus, keel_env.settings
    prefix = settings.bus.subject_prefix
    subject = f"{prefix}.job1.node.n1.NodeHealthChanged"
    good_a, good_b = health_event("n1", detail="before"), health_event("n1", detail="after")
    template = json.loads(good_a.to_json())
    old_id, nul_id, wrong_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    old = {**template, "id": str(old_id), "schema_version": 1, "payload": {"healthy": False, "detail": "v1, no node"}}
    nul = {**template, "id": str(nul_id), "payload": {**template["payload"], "detail": "rank stderr \x00 kept"}}
    wrong = {**template, "id": str(wrong_id)}

    await keel_env.start_recorder()
    await bus.publish(good_a)
    await bus.publish_raw(subject, json.dumps(old).encode(), msg_id="p-old")
    await bus.publish_raw(subject, json.dumps(nul).encode(), msg_id="p-nul")
    await bus.publish_raw(f"{prefix}.otherjob.node.n1.NodeHealthChanged", json.dumps(wrong).encode(), msg_id="p-wrong")
    await bus.publish(good_b)

    async def three_dead() -> bool:
        return len(await keel_env.store.dead_letters()) == 3

    await wait_for(three_dead, "three dead letters")
    env = service_env(settings)
    for name, value in env.items():
        if name.startswith("KEEL_"):
            monkeypatch.setenv(name, value)
    run = InProcess(capsys)

    # ls: a table, JSON, and the filters.
    listed = await keel(env, "dlq", "ls")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:3] == ["ID", "WHEN", "AGE"] and len(lines) == 4
    assert "cannot be upcast" in lines[1] and "NUL" in lines[2] and "published on" in lines[3]
    as_json = await run("dlq", "ls", "--json")
    rows = json.loads(as_json.stdout)
    assert [r["job"] for r in rows] == ["job1", "job1", "otherjob"]
    assert {r["type"] for r in rows} == {"NodeHealthChanged"}
    assert [r["size"] for r in rows] == [len(json.dumps(m).encode()) for m in (old, nul, wrong)]
    old_dl, nul_dl, wrong_dl = (r["id"] for r in rows)
    only_other = json.loads((await run("dlq", "ls", "--json", "--job", "otherjob")).stdout)
    assert [r["id"] for r in only_other] == [wrong_dl]
    newest = json.loads((await run("dlq", "ls", "--json", "--limit", "1")).stdout)
    assert [r["id"] for r in newest] == [wrong_dl]
    none_yet = await run("dlq", "ls", "--since", "2199-01-01T00:00:00")
    assert none_yet.returncode == 0 and "no dead letters" in none_yet.stdout
    bad_since = await run("dlq", "ls", "--since", "yesterday")
    assert bad_since.returncode == 2 and "--since" in bad_since.stderr
    bad_job = await run("dlq", "ls", "--job", "a.b")
    assert bad_job.returncode == 2 and "not a job id" in bad_job.stderr

    # show: headers and body; --raw: the exact bytes.
    shown = await run("dlq", "show", str(nul_dl))
    assert shown.returncode == 0, shown.stderr
    assert f"subject:     {subject}" in shown.stdout and "NUL" in shown.stdout
    assert "Keel-Dlq-Stream-Seq" in shown.stdout and str(nul_id) in shown.stdout
    raw = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "keel.cli.main", "dlq", "show", str(nul_dl),
                                                   "--raw"], env=env, capture_output=True, timeout=60)
    assert raw.returncode == 0 and raw.stdout == json.dumps(nul).encode()
    missing = await run("dlq", "show", "999999")
    assert missing.returncode == 1 and "no dead letter 999999" in missing.stderr

    # Before the fix the old event is refused, with the reason, and stays.
    refused = await run("dlq", "redrive", str(old_dl))
    assert refused.returncode == 1 and "cannot be upcast" in refused.stderr, refused.stderr
    # A wrong subject is refused as it is.
    refused = await run("dlq", "redrive", str(wrong_dl), "--by", "alice")
    assert refused.returncode == 1 and "belongs on" in refused.stderr, refused.stderr
    # A corrected body that is still invalid is refused.
    still_bad = scratch_dir / "still-bad.json"
    still_bad.write_bytes(json.dumps(nul).encode())
    refused = await run("dlq", "redrive", str(nul_dl), "--body", str(still_bad))
    assert refused.returncode == 1 and "corrected body is still not a valid event" in refused.stderr

    # The corrected body: the NUL replaced.
    fixed = scratch_dir / "fixed.json"
    fixed.write_bytes(raw.stdout.replace(b"\\u0000", b"\\ufffd"))
    redriven = await run("dlq", "redrive", str(nul_dl), "--body", str(fixed), "--by", "bob")
    assert redriven.returncode == 0, redriven.stderr
    assert f"redrove {nul_dl} as bob: published NodeHealthChanged {nul_id}" in redriven.stdout

    # The code fix (here: a lenient upcaster in this process, the recorder's and the CLI's), then a
    # dry run that changes nothing, then the redrive of everything left: the wrong subject is refused.
    monkeypatch.setitem(REGISTRY._types["NodeHealthChanged"].upcasters, 1, _lenient_v1)
    dry = await run("dlq", "redrive", "--all", "--dry-run")
    assert dry.returncode == 1 and f"would redrive {old_dl}" in dry.stdout and f"refused {wrong_dl}" in dry.stderr, dry
    assert len(json.loads((await run("dlq", "ls", "--json")).stdout)) == 2
    done_all = await run("dlq", "redrive", "--all", "--by", "alice")
    assert done_all.returncode == 1 and f"redrove {old_dl} as alice" in done_all.stdout, done_all
    assert "1 of 2 dead letters refused" in done_all.stderr

    # Recorded once each: the two events and two DeadLetterRedriven; nothing lost, nothing doubled.
    async def six() -> bool:
        return len(await stored(keel_env)) == 6

    await wait_for(six, "the redriven events and their records")
    rows_now = await stored(keel_env)
    ids = [r.event_id for r in rows_now]
    assert len(ids) == len(set(ids))
    records = {redrive_record_id(settings.bus.dlq_stream, old_dl), redrive_record_id(settings.bus.dlq_stream, nul_dl)}
    assert set(ids) == {good_a.id, good_b.id, old_id, nul_id} | records
    assert {r.schema_version for r in rows_now if r.event_id == old_id} == {1}  # stored as sent, upcast on read
    upcast = await keel_env.store.get(old_id)
    assert upcast is not None and upcast.event.payload.node_id == "unknown"
    corrected = await keel_env.store.get(nul_id)
    assert corrected is not None and corrected.event.payload.detail == "rank stderr \ufffd kept"
    record = await keel_env.store.get(redrive_record_id(settings.bus.dlq_stream, nul_dl))
    assert record is not None and isinstance(record.event.payload, DeadLetterRedriven)
    p = record.event.payload
    assert (p.by, p.corrected, p.event_id, p.dlq_seq, record.event.job_id) == ("bob", True, str(nul_id), nul_dl, "job1")
    assert "NUL" in p.reason and p.original_subject == subject

    # What is left: the refused one; the table keeps all three originals.
    left = json.loads((await run("dlq", "ls", "--json")).stdout)
    assert [r["id"] for r in left] == [wrong_dl]
    assert len(await keel_env.store.dead_letters()) == 3
    gone = await run("dlq", "redrive", str(old_dl))
    assert gone.returncode == 1 and f"no dead letter {old_dl}" in gone.stderr

    # A redrive interrupted after its publish (before its record and the removal) finishes on a second
    # run, recording nothing twice.
    third = health_event("n1", detail="dead-lettered by a consumer's bug")
    await bus.publish_raw(f"{bus.dlq_prefix}.job1.node.n1.NodeHealthChanged", third.to_json(), msg_id="dl-third",
                          headers={HEADER_DLQ_REASON: "a consumer's bug", HEADER_DLQ_SUBJECT: subject,
                                   HEADER_DLQ_STREAM_SEQ: "0"})
    dead_letters = DeadLetters(bus)
    [interrupted] = [d for d in await dead_letters.list() if d.id != wrong_dl]
    plan = plan_redrive(interrupted, None, prefix=prefix, max_event_bytes=settings.bus.max_event_bytes)
    await bus.publish_raw(plan.subject, plan.body, msg_id=f"redrive-{settings.bus.dlq_stream}-{interrupted.id}")

    async def seven() -> bool:
        return len(await stored(keel_env)) == 7

    await wait_for(seven, "the interrupted redrive's event")

    async def logged(event_id: uuid.UUID):  # type: ignore[no-untyped-def]
        found = await keel_env.store.get(event_id)
        return None if found is None else found.event

    for _ in range(2):  # the second run finds nothing left to remove and records nothing new
        done = await dead_letters.redrive(plan, by="carol", now=now_utc(), logged=logged)
        assert "already in the log" in done

    async def eight() -> bool:
        return len(await stored(keel_env)) == 8

    await wait_for(eight, "the interrupted redrive's record")
    await asyncio.sleep(1.0)
    assert len(await stored(keel_env)) == 8
    assert await keel_env.store.get(redrive_record_id(settings.bus.dlq_stream, interrupted.id)) is not None
    assert [d.id for d in await dead_letters.list()] == [wrong_dl]

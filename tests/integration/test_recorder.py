"""The recorder against real NATS JetStream and PostgreSQL: exactly once, through duplicates,
redelivery, crashes and bad input."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import sqlalchemy as sa

from keel.events.envelope import Event
from keel.events.types import NodeEvicted
from keel.infra.bus import HEADER_DLQ_REASON, HEADER_DLQ_STREAM_SEQ, HEADER_DLQ_SUBJECT, fetch_batch
from keel.infra.config import RecorderSettings
from keel.infra.store import metadata
from tests.factories import T0, fleet_events, health_event

pytestmark = pytest.mark.integration


async def stored_ids(env) -> list[uuid.UUID]:
    async with env.engine.connect() as conn:
        rows = (await conn.execute(sa.select(metadata.tables["events"].c.event_id))).all()
    return [row.event_id for row in rows]


async def test_published_event_is_recorded_once_with_its_envelope(keel_env) -> None:
    event = health_event("n1", detail="memory pressure 40%")
    ack = await keel_env.bus.publish(event)
    await keel_env.start_recorder()
    assert await keel_env.wait_for_count(1) == 1
    [recorded] = [r async for r in keel_env.store.read()]
    assert recorded.event == event
    assert recorded.js_seq == ack.stream_seq
    assert recorded.position >= 1


async def test_duplicate_publishes_and_redelivery_still_record_once(keel_env) -> None:
    events = fleet_events(300)
    await keel_env.bus.publish_many(events)
    # Same ids again: JetStream's dedup window drops them.
    again = await keel_env.bus.publish_many(events[:50])
    assert all(result.duplicate for result in again)
    # Same events under other message ids (a publisher retry after the dedup window): they reach the
    # stream; the event-id key in Postgres drops them.
    for event in events[:20]:
        await keel_env.bus.publish_raw(keel_env.bus.subject_for(event), event.to_json(), msg_id=f"late-{event.id}")
    recorder = await keel_env.start_recorder()
    await keel_env.wait_for_count(300)
    while recorder.stats.last_js_seq < 320:
        await asyncio.sleep(0.05)
    assert recorder.stats.duplicates == 20
    await keel_env.shutdown()

    # Redelivery of everything: drop the consumer and the tracking row, record again from scratch.
    await keel_env.bus.js.delete_consumer(keel_env.settings.bus.stream, keel_env.settings.recorder.consumer)
    async with keel_env.engine.begin() as conn:
        await conn.execute(sa.delete(metadata.tables["tracking"]))
    keel_env.tasks.clear()
    keel_env.stops.clear()
    replayer = await keel_env.start_recorder()
    while replayer.stats.last_js_seq < 320:
        await asyncio.sleep(0.05)
    ids = await stored_ids(keel_env)
    assert len(ids) == len(set(ids)) == 300
    assert set(ids) == {e.id for e in events}
    assert replayer.stats.recorded == 0 and replayer.stats.duplicates == 320


async def test_positions_follow_stream_order(keel_env) -> None:
    events = fleet_events(500)
    await keel_env.bus.publish_many(events)
    await keel_env.start_recorder(RecorderSettings(batch_size=64))
    await keel_env.wait_for_count(500)
    recorded = [r async for r in keel_env.store.read(chunk=97)]
    assert [r.position for r in recorded] == sorted(r.position for r in recorded)
    assert [r.js_seq for r in recorded] == sorted(r.js_seq for r in recorded)
    assert await keel_env.store.tracking("recorder") == (recorded[-1].js_seq, recorded[-1].position)


async def test_events_table_is_append_only(keel_env) -> None:
    await keel_env.bus.publish(health_event("n1"))
    await keel_env.start_recorder()
    await keel_env.wait_for_count(1)
    events = metadata.tables["events"]
    for statement in (sa.update(events).values(producer="mallory"), sa.delete(events)):
        with pytest.raises(sa.exc.DBAPIError, match="append-only"):
            async with keel_env.engine.begin() as conn:
                await conn.execute(statement)
    assert await keel_env.store.count() == 1


async def test_projection_is_updated_with_the_events(keel_env) -> None:
    failed = health_event("n7", status="failed", fatal=True, confidence="high", component="gpu", detail="XID 79")
    evicted = Event.create(
        NodeEvicted(node_id="n7", decision_id=str(uuid.uuid4()), actuator="local", outcome="evicted"),
        job_id="job1", subject="node/n7", producer="actuator-local", occurred_at=T0,
    )
    await keel_env.bus.publish_many([health_event("n1", status="healthy"), failed, evicted])
    await keel_env.start_recorder()
    await keel_env.wait_for_count(3)
    async with keel_env.engine.connect() as conn:
        rows = {r.node_id: r for r in (await conn.execute(sa.select(metadata.tables["node_status"]))).all()}
    assert rows["n1"].health == "healthy" and not rows["n1"].evicted
    assert rows["n7"].health == "failed" and rows["n7"].evicted and "XID 79" in rows["n7"].detail
    assert rows["n7"].last_event_id == evicted.id


def bad_messages(good: Event) -> dict[str, bytes]:
    wire = good.to_wire()
    oversized = {**wire, "id": str(uuid.uuid4()), "payload": {**wire["payload"], "detail": "x" * (300 * 1024)}}
    return {
        "not valid JSON": b'{"type": "NodeHealthChanged", ',
        "unknown event type": json.dumps({**wire, "id": str(uuid.uuid4()), "type": "NodeMelted"}).encode(),
        "Field required": json.dumps({k: v for k, v in wire.items() if k != "producer"} | {"id": str(uuid.uuid4())}).encode(),
        "is_fatal": json.dumps({**wire, "id": str(uuid.uuid4()), "payload": {**wire["payload"], "is_fatal": "maybe"}}).encode(),
        "newer than this build knows": json.dumps({**wire, "id": str(uuid.uuid4()), "schema_version": 9}).encode(),
        "exceeds the 262144-byte event limit": json.dumps(oversized).encode(),
    }


async def test_bad_input_is_dead_lettered_with_reason_and_nothing_else_is_lost(keel_env) -> None:
    goods = fleet_events(40)
    subject = keel_env.bus.subject_for(goods[0])
    bad = bad_messages(goods[0])
    # Interleave: good, bad, good, bad, ...
    expected_reasons = {}
    for index, (reason, raw) in enumerate(bad.items()):
        await keel_env.bus.publish(goods[index])
        ack = await keel_env.bus.publish_raw(subject, raw, msg_id=f"bad-{index}")
        expected_reasons[ack.stream_seq] = (reason, raw)
    await keel_env.bus.publish_many(goods[len(bad):])
    recorder = await keel_env.start_recorder(RecorderSettings(batch_size=4))
    await keel_env.wait_for_count(len(goods))
    while recorder.stats.dead_lettered < len(bad):
        await asyncio.sleep(0.05)
    assert set(await stored_ids(keel_env)) == {e.id for e in goods}

    dead = {row["js_seq"]: row for row in await keel_env.store.dead_letters()}
    assert set(dead) == set(expected_reasons)
    for seq, (reason, raw) in expected_reasons.items():
        assert reason in dead[seq]["reason"], dead[seq]["reason"]
        assert bytes(dead[seq]["raw"]) == raw

    dlq = await keel_env.bus.js.pull_subscribe(f"{keel_env.bus.dlq_prefix}.>", durable="inspect", stream=keel_env.settings.bus.dlq_stream)
    msgs = await fetch_batch(dlq, 100, 2.0)
    assert len(msgs) == len(bad)
    for msg in msgs:
        seq = int(msg.headers[HEADER_DLQ_STREAM_SEQ])
        reason, raw = expected_reasons[seq]
        assert reason in msg.headers[HEADER_DLQ_REASON]
        assert msg.headers[HEADER_DLQ_SUBJECT] == subject
        assert msg.data == raw

    # The recorder keeps going after bad input.
    late = health_event("n-late")
    await keel_env.bus.publish(late)
    assert await keel_env.wait_for_count(len(goods) + 1) == len(goods) + 1


async def test_event_on_the_wrong_subject_is_dead_lettered(keel_env) -> None:
    event = health_event("n1")
    prefix = keel_env.settings.bus.subject_prefix
    # Another job's subject, another node's, and the subject without the aggregate id (before the id was a token).
    acks = []
    for index, wrong in enumerate((f"{prefix}.otherjob.node.n1.NodeHealthChanged", f"{prefix}.job1.node.n2.NodeHealthChanged",
                                   f"{prefix}.job1.node.NodeHealthChanged")):
        acks.append(await keel_env.bus.publish_raw(wrong, event.to_json(), msg_id=f"{event.id}-{index}"))
    recorder = await keel_env.start_recorder()
    while recorder.stats.dead_lettered < len(acks):
        await asyncio.sleep(0.05)
    rows = await keel_env.store.dead_letters()
    assert [row["js_seq"] for row in rows] == [ack.stream_seq for ack in acks]
    assert all("belongs on" in row["reason"] for row in rows), rows
    assert await keel_env.store.count() == 0


async def test_projection_does_not_go_back_in_time_on_late_events(keel_env) -> None:
    from datetime import timedelta

    newer = health_event("n9", status="failed", fatal=True, confidence="high", component="gpu", detail="new",
                         at=T0 + timedelta(seconds=10))
    older = health_event("n9", status="healthy", detail="old", at=T0)
    await keel_env.bus.publish(newer)
    await keel_env.start_recorder()
    await keel_env.wait_for_count(1)
    await keel_env.bus.publish(older)  # a late (redelivered or delayed) event from before
    await keel_env.wait_for_count(2)
    async with keel_env.engine.connect() as conn:
        row = (await conn.execute(sa.select(metadata.tables["node_status"]))).one()
    assert row.health == "failed" and row.last_event_id == newer.id


async def test_old_versions_are_stored_as_sent_and_upcast_on_read(keel_env) -> None:
    from pathlib import Path

    golden = json.loads((Path(__file__).resolve().parents[1] / "golden/NodeHealthChanged/v1.json").read_text())
    old = golden["envelope"]
    current = health_event("n1")
    subject = f"{keel_env.settings.bus.subject_prefix}.{old['job_id']}.node.n07.NodeHealthChanged"
    assert old["subject"] == "node/n07"
    await keel_env.bus.publish_raw(subject, json.dumps(old).encode(), msg_id=old["id"])
    await keel_env.bus.publish(current)
    await keel_env.start_recorder()
    await keel_env.wait_for_count(2)
    async with keel_env.engine.connect() as conn:
        versions = dict((await conn.execute(sa.select(metadata.tables["events"].c.event_id,
                                                      metadata.tables["events"].c.schema_version))).all())
    assert versions[uuid.UUID(old["id"])] == 1  # as sent
    [first, second] = [r.event async for r in keel_env.store.read()]  # one chunk, both versions
    assert first.schema_version == 2 and first.payload.status == "failed" and first.payload.confidence == "medium"
    assert second == current


async def test_a_decider_does_not_act_on_what_the_recorder_dead_letters(keel_env) -> None:
    """The controller consumes through the same loop as every service: an event on the wrong subject (here
    a fatal GPU fault that would evict n2) is terminated there, not decided on, so the log - which
    dead-letters it - and the decisions agree. The same event on its own subject is decided on."""
    from keel.controller.decider import ControllerDecider
    from keel.infra.runner import DeciderRunner
    from tests.integration.test_replay_cli import registrations

    runner = DeciderRunner(ControllerDecider(), keel_env.bus, keel_env.store, fetch_timeout_s=0.1)
    await runner.start()
    await keel_env.bus.publish_many(registrations())
    fault = health_event("n2", status="failed", fatal=True, confidence="high", component="gpu", detail="XID 79")
    prefix = keel_env.settings.bus.subject_prefix
    await keel_env.bus.publish_raw(f"{prefix}.job1.node.n3.NodeHealthChanged", fault.to_json(), msg_id=f"{fault.id}-wrong")
    for _ in range(100):
        if runner.stats.handled + runner.stats.malformed >= 21:
            break
        await runner.run_once()
    assert runner.stats.malformed == 1 and runner.stats.emitted == 0
    await keel_env.bus.publish(fault)
    for _ in range(100):
        if runner.stats.emitted:
            break
        await runner.run_once()
    assert runner.stats.emitted >= 1  # the eviction of n2 (and what goes with it)


def poison_messages() -> list[tuple[str, bytes]]:
    """Messages that once stopped the event log for good (issue: poison messages), each with the word
    its dead-letter reason must carry."""
    good = json.loads(health_event("n1").to_json())
    nul = {**good, "id": str(uuid.uuid4()), "payload": {**good["payload"], "detail": "rank stderr \x00 kept"}}
    nan = json.dumps({**good, "id": str(uuid.uuid4())}).replace('"evidence": {}', '"evidence": {"x": NaN}')
    deep = '{"a":' * 40_000 + "1" + "}" * 40_000
    future = {**good, "id": str(uuid.uuid4()), "occurred_at": "9999-12-31T23:59:59+00:00"}
    old = {**good, "id": str(uuid.uuid4()), "schema_version": 1, "payload": {"detail": "v1 without its node"}}
    return [("NUL", json.dumps(nul).encode()), ("non-finite", nan.encode()), ("nested deeper", deep.encode()),
            ("outside", json.dumps(future).encode()), ("cannot be upcast", json.dumps(old).encode())]


async def test_poison_messages_are_dead_lettered_and_nothing_stops(keel_env) -> None:
    from keel.controller.decider import ControllerDecider
    from keel.infra.runner import DeciderRunner

    prefix = keel_env.settings.bus.subject_prefix
    poisons = poison_messages()
    assert "NaN" in poisons[1][1].decode()
    acks = [await keel_env.bus.publish_raw(f"{prefix}.job1.node.n1.NodeHealthChanged", raw, msg_id=f"poison-{i}")
            for i, (_, raw) in enumerate(poisons)]
    after = health_event("n1", detail="the log goes on")
    await keel_env.bus.publish(after)
    recorder = await keel_env.start_recorder()
    runner = DeciderRunner(ControllerDecider(), keel_env.bus, keel_env.store, consumer="poison-controller",
                           fetch_timeout_s=0.1)
    await runner.start()
    for _ in range(100):
        if runner.stats.handled + runner.stats.malformed >= len(poisons) + 1:
            break
        await runner.run_once()
    assert (runner.stats.malformed, runner.stats.handled) == (len(poisons), 1)
    assert await keel_env.wait_for_count(1) == 1
    while recorder.stats.dead_lettered < len(poisons):
        await asyncio.sleep(0.05)
    rows = await keel_env.store.dead_letters()
    assert [row["js_seq"] for row in rows] == [ack.stream_seq for ack in acks]
    for (word, _), row in zip(poisons, rows):
        assert word in row["reason"], (word, row["reason"])
    [recorded] = [r.event async for r in keel_env.store.read()]
    assert recorded.id == after.id


async def test_a_message_just_under_the_payload_limit_is_dead_lettered_without_stopping_the_recorder(keel_env) -> None:
    """The dead letter's headers would push it past NATS's 1 MiB limit: its copy is cut to fit and says
    so, the dead_letters table keeps it whole, and the recorder goes on."""
    from keel.infra.bus import HEADER_DLQ_TRUNCATED, NATS_MAX_PAYLOAD_BYTES

    event = health_event("n1")
    subject = keel_env.bus.subject_for(event)
    raw = b"x" * (NATS_MAX_PAYLOAD_BYTES - 200)  # fits alone; with the reason headers it would not
    ack = await keel_env.bus.publish_raw(subject, raw, msg_id="near-the-limit")
    after = health_event("n2")
    await keel_env.bus.publish(after)
    recorder = await keel_env.start_recorder()
    assert await keel_env.wait_for_count(1) == 1
    while recorder.stats.dead_lettered < 1:
        await asyncio.sleep(0.05)
    [row] = await keel_env.store.dead_letters()
    assert row["js_seq"] == ack.stream_seq and bytes(row["raw"]) == raw and "event limit" in row["reason"]
    dlq = await keel_env.bus.js.pull_subscribe(f"{keel_env.bus.dlq_prefix}.>", durable="near-limit",
                                               stream=keel_env.settings.bus.dlq_stream)
    [copy] = await fetch_batch(dlq, 10, 2.0)
    assert copy.headers[HEADER_DLQ_TRUNCATED] == str(len(raw)) and raw.startswith(copy.data) and len(copy.data) < len(raw)
    [recorded] = [r.event async for r in keel_env.store.read()]
    assert recorded.id == after.id

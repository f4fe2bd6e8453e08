"""Envelope validation, the registry and upcasting of every golden fixture."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError

from keel.events.envelope import REGISTRY, Event, InvalidEvent, decode_event, decode_wire, payload_of
from keel.events.types import NodeHealthChanged, NodeRegistered

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
MAX = 256 * 1024


def golden_files() -> list[Path]:
    return sorted(GOLDEN.glob("*/v*.json"))


def valid_envelope(**changes) -> dict:
    envelope = json.loads((GOLDEN / "NodeHealthChanged" / "v2.json").read_text())["envelope"]
    envelope.update(changes)
    return envelope


def test_every_registered_type_has_a_golden_fixture_for_every_version() -> None:
    present = {(p.parent.name, int(p.stem[1:])) for p in golden_files()}
    for name in REGISTRY.names():
        for version in range(1, REGISTRY.current_version(name) + 1):
            assert (name, version) in present, f"missing tests/golden/{name}/v{version}.json"
    REGISTRY.check_complete()


@pytest.mark.parametrize("path", golden_files(), ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_golden_fixture_decodes_and_upcasts_to_the_current_version(path: Path) -> None:
    doc = json.loads(path.read_text())
    raw = json.dumps(doc["envelope"]).encode()
    as_sent, event = decode_wire(raw, max_bytes=MAX)
    if doc["envelope"]["schema_version"] == REGISTRY.current_version(doc["envelope"]["type"]):
        assert as_sent is None  # the event is exactly what was sent
        assert json.loads(event.to_json())["payload"] == json.loads(json.dumps(doc["envelope"]["payload"]))
    else:
        assert as_sent == doc["envelope"]  # kept as sent, for the store to upcast on read
    assert event.type == path.parent.name
    assert event.schema_version == REGISTRY.current_version(event.type)
    expected = doc.get("expected_current_payload", doc["envelope"]["payload"])
    assert event.payload.model_dump(mode="json") == json.loads(json.dumps(expected))
    # A decoded event re-encodes to the current version and decodes to an equal event.
    assert decode_event(event.to_json(), max_bytes=MAX) == event


def test_upcast_v1_health_is_never_a_fatal_rung1_signal() -> None:
    doc = json.loads((GOLDEN / "NodeHealthChanged" / "v1.json").read_text())
    event = decode_event(json.dumps(doc["envelope"]).encode(), max_bytes=MAX)
    assert isinstance(event.payload, NodeHealthChanged)
    assert event.payload.status == "failed" and not event.payload.is_fatal


@pytest.mark.parametrize(
    "raw, reason_part",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (json.dumps(valid_envelope(type="NodeMelted")).encode(), "unknown event type 'NodeMelted'"),
        (json.dumps({k: v for k, v in valid_envelope().items() if k != "job_id"}).encode(), "job_id: Field required"),
        (json.dumps(valid_envelope(schema_version=3)).encode(), "newer than this build knows"),
        (json.dumps(valid_envelope(schema_version="2")).encode(), "schema_version"),
        (json.dumps(valid_envelope(subject="n07")).encode(), "subject"),
        (json.dumps(valid_envelope(occurred_at="2026-11-29T07:00:00")).encode(), "occurred_at"),
        (json.dumps(valid_envelope(extra_field=1)).encode(), "extra_field: unknown field"),
        (json.dumps(valid_envelope(payload={"node_id": "n07"})).encode(), "status: Field required"),
        (json.dumps(valid_envelope(payload={**valid_envelope()["payload"], "is_fatal": "sometimes"})).encode(), "is_fatal"),
        (json.dumps(valid_envelope(id="not-a-uuid")).encode(), "id"),
        (json.dumps(valid_envelope(job_id="has space")).encode(), "job_id"),
    ],
)
def test_invalid_input_is_rejected_with_a_reason(raw: bytes, reason_part: str) -> None:
    with pytest.raises(InvalidEvent) as info:
        decode_event(raw, max_bytes=MAX)
    assert reason_part in info.value.reason


def test_oversized_message_is_rejected_before_parsing() -> None:
    raw = json.dumps(valid_envelope(payload={**valid_envelope()["payload"], "detail": "x" * MAX})).encode()
    with pytest.raises(InvalidEvent, match="exceeds the 262144-byte event limit"):
        decode_event(raw, max_bytes=MAX)


def test_create_sets_type_and_version_from_the_payload_and_normalises_time_to_utc() -> None:
    at = datetime(2026, 11, 29, 9, 0, tzinfo=timezone(timedelta(hours=2)))
    event = Event.create(
        NodeRegistered(node_id="n1", host="h1"), job_id="j", subject="node/n1", producer="agent", occurred_at=at
    )
    assert (event.type, event.schema_version) == ("NodeRegistered", 2)
    assert event.occurred_at == at and event.occurred_at.tzinfo == UTC
    with pytest.raises(ValueError, match="belong to 'node/...' subjects"):
        Event.create(NodeRegistered(node_id="n1", host="h1"), job_id="j", subject="job/j", producer="a", occurred_at=at)


def test_events_are_frozen() -> None:
    event = decode_event(json.dumps(valid_envelope()).encode(), max_bytes=MAX)
    with pytest.raises(ValidationError):
        event.job_id = "other"  # type: ignore[misc]
    assert isinstance(event.id, uuid.UUID)


def test_each_event_type_has_its_own_payload_class_so_isinstance_on_the_payload_tests_the_type() -> None:
    # Readers narrow ``event.payload`` with isinstance where they used to compare ``event.type``.
    models = [REGISTRY.model(name) for name in REGISTRY.names()]
    assert len(set(models)) == len(models)
    for name, model in zip(REGISTRY.names(), models, strict=True):
        assert model.__name__ == name and model.event_name == name


def test_payload_of_types_the_payload_and_rejects_an_event_of_another_type() -> None:
    event = Event.create(NodeRegistered(node_id="n1", host="h1"), job_id="j", subject="node/n1", producer="agent",
                         occurred_at=datetime(2026, 11, 29, 9, 0, tzinfo=UTC))
    assert payload_of(event, NodeRegistered) is event.payload
    with pytest.raises(TypeError, match="expected a NodeHealthChanged event, got NodeRegistered"):
        payload_of(event, NodeHealthChanged)

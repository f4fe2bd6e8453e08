"""Decoding takes any bytes and either returns an event or raises ``InvalidEvent`` with a reason: never
``RecursionError``, ``KeyError`` or an event PostgreSQL's jsonb would refuse (NUL, NaN, Infinity), and
never a timestamp a decider's arithmetic could overflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keel.events.envelope import MAX_JSON_DEPTH, InvalidEvent, decode_event, decode_wire

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
MAX = 256 * 1024


def envelope(version: int = 2) -> dict:
    return json.loads((GOLDEN / "NodeHealthChanged" / f"v{version}.json").read_text())["envelope"]


def wire(doc: object) -> bytes:
    return json.dumps(doc).encode()


def reason(raw: bytes) -> str:
    with pytest.raises(InvalidEvent) as caught:
        decode_event(raw, max_bytes=MAX)
    return caught.value.reason


def test_the_fixture_itself_decodes() -> None:
    assert decode_event(wire(envelope()), max_bytes=MAX).payload.node_id == "n07"  # type: ignore[attr-defined]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000, 40_000])  # 40,000 levels: 240 KB, under the limit
def test_deep_nesting_is_refused_not_a_recursion_error(depth: int) -> None:
    doc = envelope()
    nested: object = 1
    for _ in range(depth):
        nested = {"a": nested}
    doc["payload"]["evidence"] = {"deep": nested}
    raw = wire(doc) if depth < 500 else (b'{"a":' * depth + b"1" + b"}" * depth)
    text = reason(raw)
    assert "nested deeper" in text or "recursion" in text.lower(), text


def test_deep_arrays_are_refused() -> None:
    assert "nested deeper" in reason(b"[" * 100_000 + b"]" * 100_000)


def test_a_nul_in_any_string_is_refused_with_its_reason() -> None:
    doc = envelope()
    doc["payload"]["detail"] = "stderr said \x00\x00 and died"
    assert "NUL" in reason(wire(doc))
    doc = envelope()
    doc["payload"]["evidence"] = {"key\x00": 1}
    assert "NUL" in reason(wire(doc))


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(token: str) -> None:
    raw = wire(envelope()).replace(b'"gpu": 3', f'"gpu": {token}'.encode())
    assert token in raw.decode()
    assert "non-finite" in reason(raw)


def test_the_word_nan_inside_a_string_is_fine() -> None:
    doc = envelope()
    doc["payload"]["detail"] = "loss went NaN then Infinity"
    assert decode_event(wire(doc), max_bytes=MAX).payload.detail == "loss went NaN then Infinity"  # type: ignore[attr-defined]


@pytest.mark.parametrize("when", ["1970-01-01T00:00:00+00:00", "9999-12-31T23:59:59+00:00", "2200-01-01T00:00:00+00:00"])
def test_timestamps_outside_the_sane_range_are_refused(when: str) -> None:
    assert "outside" in reason(wire({**envelope(), "occurred_at": when}))


def test_a_payload_timestamp_outside_the_range_is_refused_too() -> None:
    doc = json.loads((GOLDEN / "TimerTicked" / "v1.json").read_text())["envelope"]
    assert decode_event(wire(doc), max_bytes=MAX)
    doc["payload"]["now"] = "9999-12-31T23:59:59+00:00"
    assert "outside" in reason(wire(doc))


def test_an_old_version_an_upcaster_cannot_take_is_invalid_not_a_key_error() -> None:
    old = envelope(version=1)
    del old["payload"]["node_id"]  # the v1 -> v2 upcaster reads it
    text = reason(wire(old))
    assert "cannot be upcast" in text and "KeyError" in text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_any_bytes_decode_or_raise_invalid_event(raw: bytes) -> None:
    try:
        decode_wire(raw, max_bytes=MAX)
    except InvalidEvent as exc:
        assert exc.reason


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["payload", "id", "occurred_at", "schema_version", "type", "subject", "job_id"]),
       value=json_values)
def test_any_json_in_any_envelope_field_decodes_or_raises_invalid_event(field: str, value: object) -> None:
    doc = envelope()
    doc[field] = value
    raw = json.dumps(doc, allow_nan=True).encode()
    try:
        event = decode_event(raw, max_bytes=MAX)
    except InvalidEvent as exc:
        assert exc.reason
        return
    # What decodes is storable: it serialises back to strict JSON without NUL.
    text = event.model_dump_json()
    json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} in a decoded event"))
    assert "\\u0000" not in text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=json_values, version=st.sampled_from([1, 2]))
def test_any_json_in_any_payload_field_of_any_version_decodes_or_raises_invalid_event(value: object, version: int) -> None:
    doc = envelope(version)
    for key in list(doc["payload"]):
        doc["payload"][key] = value
        raw = json.dumps(doc, allow_nan=True).encode()
        try:
            decode_event(raw, max_bytes=MAX)
        except InvalidEvent as exc:
            assert exc.reason


def _stacks_like(processes: int) -> bytes:
    """An envelope as wide as a node's stacks: thousands of objects, a few levels deep."""
    doc = envelope()
    doc["payload"]["evidence"] = {"processes": [{"pid": i, "threads": [{"frames": [f"f{j} (x.py:{j})" for j in range(30)]}
                                                                        for _ in range(4)]} for i in range(processes)]}
    return wire(doc)


def test_a_wide_shallow_message_skips_the_strict_parse() -> None:
    from keel.events.envelope import _suspect

    raw = _stacks_like(100)
    assert raw.count(b"{") + raw.count(b"[") > 10 * MAX_JSON_DEPTH  # what once sent it down the strict path
    assert not _suspect(raw)
    assert decode_event(raw, max_bytes=MAX).payload.evidence["processes"][99]["pid"] == 99  # type: ignore[attr-defined]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH // 2 - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 5_000])
def test_the_depth_test_never_passes_what_is_too_deep(depth: int) -> None:
    from keel.events.envelope import _shallow

    # Alternating kinds, the worst case for the pass count ({[]} goes in one pass), beside many siblings.
    opening = b"".join(b"[" if i % 2 else b'{"a":' for i in range(depth))
    closing = b"".join(b"]" if i % 2 else b"}" for i in reversed(range(depth)))
    raw = b"[" + b"[1]," * 200 + opening + b"1" + closing + b"]"
    # Shallow enough passes; near the limit it may answer "not shallow" (the strict parse then decides);
    # deeper than the limit it never passes.
    if depth + 1 <= MAX_JSON_DEPTH // 2:
        assert _shallow(raw)
    if depth + 1 > MAX_JSON_DEPTH:
        assert not _shallow(raw)
        assert "nested deeper" in reason(raw)


def test_brackets_in_strings_that_do_not_pair_take_the_strict_path() -> None:
    from keel.events.envelope import _suspect

    doc = envelope()
    doc["payload"]["evidence"] = {"lines": [["a ] b"]] * 100}  # more openers than the limit, and lone closers
    raw = wire(doc)
    assert _suspect(raw)  # cautious, not wrong: it still decodes
    assert decode_event(raw, max_bytes=MAX).payload.evidence["lines"][0] == ["a ] b"]  # type: ignore[attr-defined]

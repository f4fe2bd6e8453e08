"""The snapshot codec (``keel.kernel.snapshot``): every decider's state survives encode -> decode equal and
byte-identical; what it cannot carry is refused whole; bytes it did not write are refused, and it never
rebuilds a type from outside Keel."""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from keel.infra.config import Settings
from keel.kernel.decider import DeciderSession
from keel.kernel.snapshot import SnapshotCorrupt, SnapshotUnsupported, decode_state, encode_state
from tests.incident_factories import incident_log
from tests.integration.test_replay_cli import fault_sequence, registrations


def deciders():  # type: ignore[no-untyped-def]
    from keel.cli.replay import deciders_for

    return deciders_for(Settings())


@pytest.mark.parametrize("name", ["controller", "checkpoint-broker", "analyzer", "hot-update"])
def test_each_deciders_state_round_trips_equal_and_byte_identical(name: str) -> None:
    session = DeciderSession(deciders()[name])
    session.rebuild(registrations() + fault_sequence() + incident_log().events)
    data = encode_state(session.state)
    rebuilt = decode_state(data)
    assert rebuilt == session.state
    assert encode_state(rebuilt) == data


def test_the_values_states_hold_round_trip_with_their_types() -> None:
    value = {
        "tuple": (1, "a", None), "list": [1.5, True], "frozenset": frozenset({"b", "a"}), "set": {3, 1},
        ("tuple", 1): "a non-string key", "when": datetime(2026, 12, 2, 8, 0, 1, 5, tzinfo=UTC),
        "span": timedelta(days=1, seconds=2, microseconds=3), "id": uuid.UUID(int=7), "inf": float("inf"),
        "event": fault_sequence()[0], "payload": fault_sequence()[0].payload,
    }
    rebuilt = decode_state(encode_state(value))
    assert rebuilt == value
    assert type(rebuilt["tuple"]) is tuple and type(rebuilt["frozenset"]) is frozenset and type(rebuilt["set"]) is set


def test_sets_encode_the_same_whatever_their_iteration_order() -> None:
    names = [f"node-{i}" for i in range(50)]
    assert encode_state(frozenset(names)) == encode_state(frozenset(reversed(names)))


@dataclasses.dataclass(frozen=True)
class NotKeel:
    x: int = 1


@pytest.mark.parametrize("value", [NotKeel(), lambda: 1, datetime(2026, 1, 1), object()])
def test_what_a_snapshot_cannot_carry_is_refused(value: object) -> None:
    with pytest.raises(SnapshotUnsupported):
        encode_state({"state": value})


@pytest.mark.parametrize("data", [
    b"not json",
    json.dumps({"$dc": "os:system", "v": {}}).encode(),  # never import outside keel
    json.dumps({"$pm": "builtins:dict", "v": {}}).encode(),
    json.dumps({"$dc": "keel.controller.state:ControllerState", "v": {"jobs": {"$d": []}, "extra": 1}}).encode(),
    json.dumps({"$dc": "keel.controller.state:NoSuchThing", "v": {}}).encode(),
    json.dumps({"$zz": 1}).encode(),
])
def test_bytes_it_did_not_write_are_refused(data: bytes) -> None:
    with pytest.raises(SnapshotCorrupt):
        decode_state(data)


def test_the_fingerprint_changes_with_the_policy_and_not_between_processes() -> None:
    import subprocess
    import sys

    from keel.controller.decider import ControllerDecider
    from keel.controller.policy import ControllerPolicy
    from keel.infra.snapshots import decider_fingerprint

    here = decider_fingerprint(ControllerDecider(ControllerPolicy()))
    assert here != decider_fingerprint(ControllerDecider(ControllerPolicy(max_evictions=7)))
    there = subprocess.run([sys.executable, "-c", (
        "from keel.controller.decider import ControllerDecider; from keel.controller.policy import ControllerPolicy;"
        "from keel.infra.snapshots import decider_fingerprint; print(decider_fingerprint(ControllerDecider(ControllerPolicy())))")],
        capture_output=True, text=True, timeout=60, env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin"})
    assert there.returncode == 0, there.stderr
    assert there.stdout.strip() == here

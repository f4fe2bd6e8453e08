"""A decider's state as typed JSON: what a snapshot holds, so a cold start folds the newest snapshot plus
the tail of the log instead of the whole history.

Decider states are frozen dataclasses of plain values, tuples, (frozen)sets, mappings, datetimes,
durations, uuids, enums, events and pydantic payloads. ``encode_state`` writes such a value as JSON with a
tag for every type JSON has no word for; ``decode_state`` builds the same value back, equal to the
original. No pickle: only dataclasses, enums and pydantic models defined in ``keel.*`` modules are ever
rebuilt, field by field, and any other type (a callable, a socket) makes the state unsnapshottable
(``SnapshotUnsupported``), never a partial snapshot.

The encoding is deterministic (sets are written sorted by their encoding), so the same state always
gives the same bytes and digest: ``keel replay --verify`` folds the log to a snapshot's position and
compares.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import json
import math
import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel

from keel.events.envelope import Event, InvalidEvent, decode_event

ALLOWED_MODULE_PREFIX = "keel."
MAX_DEPTH = 200


class SnapshotUnsupported(TypeError):
    """The state holds a value a snapshot cannot carry faithfully."""


class SnapshotCorrupt(ValueError):
    """The bytes are not a snapshot this code can rebuild (another version's types, or damage)."""


def encode_state(state: Any) -> bytes:
    """``state`` as typed JSON bytes (deterministic); ``SnapshotUnsupported`` for what it cannot carry."""
    return json.dumps(_encode(state, 0), separators=(",", ":"), allow_nan=False).encode()


def decode_state(data: bytes) -> Any:
    """The value ``encode_state`` wrote; ``SnapshotCorrupt`` when it cannot be rebuilt."""
    try:
        return _decode(json.loads(data))
    except SnapshotCorrupt:
        raise
    except (InvalidEvent, ValueError, TypeError, KeyError, AttributeError, ImportError, IndexError) as exc:
        raise SnapshotCorrupt(f"{type(exc).__name__}: {exc}") from exc


def state_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _qualname(cls: type) -> str:
    module = cls.__module__
    if not module.startswith(ALLOWED_MODULE_PREFIX):
        raise SnapshotUnsupported(f"{module}.{cls.__qualname__} is not a Keel type")
    return f"{module}:{cls.__qualname__}"


def _resolve(name: str) -> type:
    module_name, _, qualname = name.partition(":")
    if not module_name.startswith(ALLOWED_MODULE_PREFIX):
        raise SnapshotCorrupt(f"refusing to rebuild {name}: not a Keel type")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    if not isinstance(target, type):
        raise SnapshotCorrupt(f"{name} is not a type")
    return target


def _encode(value: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise SnapshotUnsupported("the state nests too deeply")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return {"$e": _qualname(type(value)), "v": _encode(value.value, depth + 1)}
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$f": repr(value)}
    nested = depth + 1
    if isinstance(value, Event):
        return {"$ev": value.to_json().decode()}
    if isinstance(value, BaseModel):
        return {"$pm": _qualname(type(value)), "v": value.model_dump(mode="json")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"$dc": _qualname(type(value)),
                "v": {f.name: _encode(getattr(value, f.name), nested) for f in dataclasses.fields(value)}}
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise SnapshotUnsupported("a naive datetime in the state")
        return {"$dt": value.isoformat()}
    if isinstance(value, timedelta):
        return {"$td": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, uuid.UUID):
        return {"$u": str(value)}
    if isinstance(value, tuple):
        return {"$t": [_encode(item, nested) for item in value]}
    if isinstance(value, list):
        return [_encode(item, nested) for item in value]
    if isinstance(value, (set, frozenset)):
        items = sorted((_encode(item, nested) for item in value), key=lambda e: json.dumps(e, sort_keys=True))
        return {"$fs" if isinstance(value, frozenset) else "$s": items}
    if isinstance(value, Mapping):
        if type(value) is not dict and not isinstance(value, dict):
            raise SnapshotUnsupported(f"a mapping of type {type(value).__name__}")
        return {"$d": [[_encode(k, nested), _encode(v, nested)] for k, v in value.items()]}
    raise SnapshotUnsupported(f"a value of type {type(value).__module__}.{type(value).__qualname__}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "$t":
            return tuple(_decode(item) for item in body)
        if tag == "$fs":
            return frozenset(_decode(item) for item in body)
        if tag == "$s":
            return {_decode(item) for item in body}
        if tag == "$d":
            return {_decode(k): _decode(v) for k, v in body}
        if tag == "$dt":
            return datetime.fromisoformat(body)
        if tag == "$td":
            days, seconds, micros = body
            return timedelta(days=days, seconds=seconds, microseconds=micros)
        if tag == "$u":
            return uuid.UUID(body)
        if tag == "$f":
            return float(body)
        if tag == "$ev":
            raw = body.encode()
            return decode_event(raw, max_bytes=len(raw))
    if set(value) == {"$e", "v"}:
        return _resolve(value["$e"])(_decode(value["v"]))
    if set(value) == {"$pm", "v"}:
        cls = _resolve(value["$pm"])
        if not issubclass(cls, BaseModel):
            raise SnapshotCorrupt(f"{value['$pm']} is not a pydantic model")
        return cls.model_validate(value["v"])
    if set(value) == {"$dc", "v"}:
        cls = _resolve(value["$dc"])
        if not dataclasses.is_dataclass(cls):
            raise SnapshotCorrupt(f"{value['$dc']} is not a dataclass")
        names = {f.name for f in dataclasses.fields(cls)}
        fields = value["v"]
        if set(fields) != names:
            raise SnapshotCorrupt(f"{value['$dc']} has fields {sorted(names)}, the snapshot {sorted(fields)}")
        built = object.__new__(cls)
        for name, item in fields.items():
            object.__setattr__(built, name, _decode(item))
        return built
    raise SnapshotCorrupt(f"an object with keys {sorted(value)[:5]} is no tagged value")

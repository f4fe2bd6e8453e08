"""Deciders' snapshots on the event store: which snapshot a decider may start from, and how one is taken.

A snapshot is the decider's state after folding (evolve only, in log order) every event up to a log
position, taken only over events the decider's consumer has acknowledged, so everything at or before
it was fully decided. It is valid only for the code and policy that folded it: its *fingerprint* hashes
the decider's source (its package, the event types, the kernel and the shared rules) and its policy, so
an upgrade or a changed setting starts from the whole log once and writes a fresh snapshot.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from keel.infra.store import EventStore, RecordedEvent, Snapshot
from keel.kernel.decider import Decider, DeciderSession
from keel.kernel.snapshot import (
    SnapshotCorrupt,
    SnapshotUnsupported,
    decode_state,
    encode_state,
    state_digest,
)

log = logging.getLogger(__name__)

S = TypeVar("S")

SHARED_PACKAGES = ("keel.events", "keel.kernel", "keel.rules")
"""Packages every decider's fold depends on besides its own."""


def _package_sources(package: str) -> Iterable[tuple[str, bytes]]:
    module = importlib.import_module(package)
    for root in getattr(module, "__path__", []):
        for path in sorted(Path(root).rglob("*.py")):
            yield f"{package}/{path.relative_to(root)}", path.read_bytes()


def decider_fingerprint(decider: Decider[Any]) -> str:
    """The code and policy a snapshot of ``decider`` is valid for (hex SHA-256)."""
    digest = hashlib.sha256()
    own = type(decider).__module__.rsplit(".", 1)[0]
    for package in sorted({own, *SHARED_PACKAGES}):
        for name, source in _package_sources(package):
            digest.update(name.encode() + b"\0" + source + b"\0")
    try:
        policy = encode_state({k: v for k, v in sorted(vars(decider).items()) if not k.startswith("_")})
    except SnapshotUnsupported:
        policy = repr(sorted(vars(decider))).encode()  # unencodable policy: at least its shape
    digest.update(policy)
    return digest.hexdigest()


@dataclass
class LoadedSnapshot(Generic[S]):
    snapshot: Snapshot
    state: S


async def newest_snapshot(store: EventStore, decider: Decider[S], scope: str, fingerprint: str) -> LoadedSnapshot[S] | None:
    """The newest snapshot of ``decider`` this code can start from, decoded and checked against its
    digest; None when there is none (a corrupt one is skipped, with a warning, for the one before it)."""
    for snapshot in await store.snapshots(decider.name, scope, fingerprint=fingerprint):
        if state_digest(snapshot.state) != snapshot.digest:
            log.warning("%s: snapshot at position %d fails its digest; not used", decider.name, snapshot.position)
            continue
        try:
            return LoadedSnapshot(snapshot, decode_state(snapshot.state))
        except SnapshotCorrupt as exc:
            log.warning("%s: snapshot at position %d cannot be rebuilt (%s); not used", decider.name,
                        snapshot.position, exc)
    return None


def take_snapshot(session: DeciderSession[S], scope: str, fingerprint: str, through: RecordedEvent,
                  events_folded: int) -> Snapshot | None:
    """The snapshot of ``session``'s state, folded through ``through``; None when the state holds
    something a snapshot cannot carry (logged: that decider then always folds the whole log)."""
    try:
        data = encode_state(session.state)
    except SnapshotUnsupported as exc:
        log.warning("%s: state cannot be snapshotted (%s); cold starts fold the whole log", session.decider.name, exc)
        return None
    return Snapshot(decider=session.decider.name, scope=scope, position=through.position, js_seq=through.js_seq,
                    event_id=through.event.id, fingerprint=fingerprint, digest=state_digest(data),
                    events_folded=events_folded, state=data)


async def fold_snapshot(store: EventStore, decider: Decider[S], *, scope: str, job_id: str | None, fingerprint: str,
                        acknowledged_through: int, min_events: int, keep: int) -> Snapshot | None:
    """Fold the log from the newest snapshot through the last event the consumer acknowledged (stream
    sequence ``acknowledged_through``; the fold stops at the first event past it) and store a new snapshot
    if at least ``min_events`` were folded. Returns the snapshot stored, if any."""
    base = await newest_snapshot(store, decider, scope, fingerprint)
    session: DeciderSession[S] = DeciderSession(decider, base.state if base else None)
    folded = base.snapshot.events_folded if base else 0
    new = 0
    last: RecordedEvent | None = None
    async for recorded in store.read(job_id=job_id, after_position=base.snapshot.position if base else 0):
        if recorded.js_seq is not None and recorded.js_seq > acknowledged_through:
            break
        session.rebuild([recorded.event])
        new += 1
        last = recorded
    if last is None or new < min_events:
        return None
    snapshot = take_snapshot(session, scope, fingerprint, last, folded + new)
    if snapshot is not None:
        await store.save_snapshot(snapshot, keep=keep)
        log.info("%s: snapshot at position %d (%d events folded, %d new, %d bytes)", decider.name, last.position,
                 folded + new, new, len(snapshot.state))
    return snapshot

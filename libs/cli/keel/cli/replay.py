"""``keel replay [--job J] [--service S] [--verify]``: fold the recorded log through the current
deciders and diff the decisions they take now against the ones in the log.

Prints one summary per decider and every divergence; with ``--verify`` a divergence is exit status 1.
The deciders' stored snapshots (of this code and policy) are checked on the way: the log folded to a
snapshot's position must give exactly the state the snapshot holds, or that is a divergence too. So are
the events' signatures (``SignatureAudit``, against the keyring ``signing.keyring`` names): an event of a
type that must be signed (``keel.events.signing.REQUIRED_SIGNER``) that is unsigned, or whose signature
does not verify, is reported (``UNSIGNED`` / ``FORGED``) and, with ``--verify``, is exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
from typing import Any

from keel.cli.common import CliError, Subparsers, endpoints
from keel.infra.config import Settings


def register(sub: Subparsers) -> None:
    replay = sub.add_parser("replay", help="fold the log through the current deciders and diff the decisions")
    replay.add_argument("--job")
    replay.add_argument("--service", action="append",
                        help="the decider of this service only (repeat for several; default: every one). A service "
                             "that did not run decided nothing: verifying it would list what it would have decided")
    replay.add_argument("--verify", action="store_true",
                        help="exit 1 when any decision diverges or any event's signature is missing or does not verify")
    replay.set_defaults(func=cmd_replay)


def deciders_for(settings: Settings) -> dict[str, Any]:
    """Every service's decider, built from ``settings`` as the service builds it, by service name."""
    from keel.analyzer.main import decider_from_settings as analyzer_from_settings
    from keel.checkpoint_broker.main import decider_from_settings as broker_from_settings
    from keel.controller.main import decider_from_settings
    from keel.hot_update.main import decider_from_settings as hot_update_from_settings

    return {"controller": decider_from_settings(settings), "checkpoint-broker": broker_from_settings(settings),
            "analyzer": analyzer_from_settings(settings), "hot-update": hot_update_from_settings(settings)}


def cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    from keel.events.signing import KeyringError
    from keel.infra.signing import KeyringFile, keyring_path
    from keel.infra.store import EventStore, create_engine
    from keel.kernel.replay import ReplayVerifier

    _, database_url = endpoints(settings)
    deciders = deciders_for(settings)
    unknown = [name for name in args.service or () if name not in deciders]
    if unknown:
        raise CliError(f"no decider named {', '.join(map(repr, unknown))}; known: {', '.join(deciders)}")
    chosen = [deciders[name] for name in dict.fromkeys(args.service)] if args.service else list(deciders.values())
    try:
        audit = SignatureAudit(KeyringFile(keyring_path(settings)))
    except KeyringError as exc:
        raise CliError(f"signing keyring: {exc}") from None

    async def replay_all() -> tuple[list[Any], list[str]]:
        # One pass over the log feeds every decider, streaming: memory stays flat for any log size.
        engine = create_engine(database_url, settings.db_schema)
        store = EventStore(engine)
        verifiers = [ReplayVerifier(decider, max_event_bytes=settings.bus.max_event_bytes) for decider in chosen]
        checks = [await SnapshotCheck.load(store, decider, args.job or "*") for decider in chosen]
        gc.collect()
        gc.freeze()  # the long-lived heap is not rescanned by every collection during a long replay
        try:
            async for recorded in store.read(job_id=args.job):
                for verifier in verifiers:
                    verifier.observe(recorded.event)
                for check in checks:
                    check.observe(recorded)
                audit.observe(recorded)
            await audit.settle(store)
        finally:
            await engine.dispose()
        return [verifier.finish() for verifier in verifiers], [line for check in checks for line in check.finish()]

    diverged = False
    reports, snapshot_lines = asyncio.run(replay_all())
    for report in reports:
        print(report.summary())
        for divergence in report.divergences:
            print("  " + divergence.describe().replace("\n", "\n  "))
        diverged |= not report.clean
    for line in snapshot_lines:
        print(line)
        diverged |= line.startswith("DIVERGED")
    for line in audit.lines():
        print(line)
    diverged |= not audit.clean
    if args.verify and diverged:
        return 1
    return 0


class SnapshotCheck:
    """Folds the log (evolve only, as a cold start does) beside the replay and compares the state at each
    stored snapshot's position with the snapshot."""

    def __init__(self, decider: Any, snapshots: list[Any]) -> None:
        from keel.kernel.decider import DeciderSession

        self.decider = decider
        self.pending = sorted(snapshots, key=lambda s: s.position)
        self.session: Any = DeciderSession(decider) if self.pending else None
        self.lines: list[str] = []
        self.checked = 0

    @classmethod
    async def load(cls, store: Any, decider: Any, scope: str) -> SnapshotCheck:
        from keel.infra.snapshots import decider_fingerprint

        return cls(decider, await store.snapshots(decider.name, scope, fingerprint=decider_fingerprint(decider)))

    def observe(self, recorded: Any) -> None:
        if not self.pending:
            return
        from keel.kernel.snapshot import encode_state, state_digest

        self.session.rebuild([recorded.event])
        while self.pending and self.pending[0].position <= recorded.position:
            snapshot = self.pending.pop(0)
            self.checked += 1
            if snapshot.position != recorded.position:
                self.lines.append(f"DIVERGED {self.decider.name}: snapshot at position {snapshot.position} names no "
                                  "event of this log")
            elif state_digest(encode_state(self.session.state)) != snapshot.digest:
                self.lines.append(f"DIVERGED {self.decider.name}: the log folded to position {snapshot.position} "
                                  "does not give the state its snapshot holds")

    def finish(self) -> list[str]:
        for snapshot in self.pending:
            self.lines.append(f"DIVERGED {self.decider.name}: snapshot at position {snapshot.position} is past "
                              "the end of the log")
        if self.checked or self.lines:
            self.lines.insert(0, f"{self.decider.name}: {self.checked + len(self.pending)} snapshot(s) checked")
        return self.lines


class SignatureAudit:
    """Checks the signature of every event of the log that must be signed or carries a signature
    (``keel.events.signing.verify_event``), as the consumers that acted on it did."""

    def __init__(self, keyring: Any) -> None:
        self.keyring = keyring
        self.checked = 0
        self.refused: list[tuple[Any, str]] = []
        self._suspect: list[Any] = []

    def observe(self, recorded: Any) -> None:
        from keel.events.signing import REQUIRED_SIGNER, verify_event

        event = recorded.event
        if event.signature is None and event.type not in REQUIRED_SIGNER:
            return
        self.checked += 1
        verdict = verify_event(event, self.keyring)
        if not verdict.ok:
            if event.signature is not None:
                self._suspect.append(recorded)  # maybe an older schema version: checked as stored in settle
            else:
                self.refused.append((recorded, verdict.reason))

    async def settle(self, store: Any) -> None:
        """Check each signature that failed on the upcast event against the envelope as stored (what was signed
        when the event was sent at an older schema version)."""
        from keel.events.signing import verify_event

        for recorded in self._suspect:
            as_stored = await store.envelope_as_stored(recorded.event.id)
            verdict = verify_event(recorded.event, self.keyring, as_sent=as_stored)
            if not verdict.ok:
                self.refused.append((recorded, verdict.reason))
        self._suspect = []

    @property
    def clean(self) -> bool:
        return not self.refused

    def lines(self) -> list[str]:
        out = [f"signatures: {self.checked} event(s) that must be signed checked, {len(self.refused)} refused"]
        for recorded, reason in sorted(self.refused, key=lambda item: item[0].position):
            kind = "UNSIGNED" if recorded.event.signature is None else "FORGED"
            out.append(f"{kind} position {recorded.position}: {reason}")
        return out

"""The checkpoint broker's I/O: the decider loop and the persistent tier's manifests.

- Decisions: the shared ``DeciderRunner`` (cold start from the store, then the job's live events).
- Manifests: when the decider commits a step on the "disk" tier (every rank's shard reported stored), this
  adapter checks every shard file's size, writes ``<persist_root>/<job>/step-<s:09d>/manifest.json``
  last and atomically (``keel.checkpoint.disk``), reports ``CheckpointPersisted`` and applies retention
  (the newest ``retention`` manifests stay). A crash in between is repaired on the next start: the
  rebuilt state still lists the step as awaiting its manifest, and an existing manifest that matches
  is reused, so the event (a deterministic id) says what is on disk.
- Time: a restore plan that waits for inventories times out on the job clock's ``TimerTicked``
  (``keel.infra.clock``, hosted by the controller), so the timeout is an event the decider (and a replay) sees.

The adapter's own events carry producers other than the decider's name: they are facts, not
decisions, and the decider decides on them like any input (a measured save cost changes Young's K).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from keel.checkpoint import disk as ckpt_disk
from keel.checkpoint_broker.decider import CheckpointBrokerDecider
from keel.checkpoint_broker.state import BrokerPolicy, BrokerState, DiskCommit
from keel.events.envelope import Event, now_utc
from keel.events.types import CheckpointPersisted
from keel.infra.bus import Bus
from keel.infra.config import Settings
from keel.infra.runner import DeciderRunner
from keel.infra.store import EventStore
from keel.kernel.decider import decision_id

log = logging.getLogger(__name__)

PERSISTER = "checkpoint-persister"
MANIFEST_RETRY_S = 30.0
"""How long a shard file that is not visible yet (a shared filesystem's attribute cache) is looked for,
once per ``report_interval``, before the step is given up (it stays incomplete: never a checkpoint)."""


@dataclass
class BrokerStats:
    manifests_written: int = 0
    manifests_reused: int = 0
    manifest_failures: int = 0
    removed_dirs: int = 0


def decider_from_settings(settings: Settings) -> CheckpointBrokerDecider:
    return CheckpointBrokerDecider(BrokerPolicy.from_settings(settings.checkpoint,
                                                              max_event_bytes=int(settings.bus.max_event_bytes)))


class CheckpointBroker:
    """The running service: ``start()`` (cold start), then ``run(stop)`` or ``run_once()``."""

    def __init__(
        self,
        bus: Bus,
        store: EventStore | None,
        settings: Settings,
        *,
        job_id: str | None = None,
        fetch_timeout_s: float = 0.5,
        clock: Callable[[], datetime] = now_utc,
    ) -> None:
        self.decider = decider_from_settings(settings)
        self.runner: DeciderRunner[BrokerState] = DeciderRunner(
            self.decider, bus, store, consumer=self.decider.name, job_id=job_id, fetch_timeout_s=fetch_timeout_s,
            snapshots=settings.snapshots)
        self.bus = bus
        self.persist_root: Path = settings.checkpoint.resolved_persist_root(settings.home)
        self.retention = settings.checkpoint.retention
        # A shard file not visible yet is looked for again at most once per report interval.
        self.manifest_retry_interval_s = settings.checkpoint.report_interval.total_seconds()
        self.clock = clock
        self.stats = BrokerStats()
        self._manifest_done: set[tuple[str, int]] = set()
        self._manifest_failures: dict[tuple[str, int], tuple[datetime, datetime]] = {}  # first, last attempt

    @property
    def state(self) -> BrokerState:
        return self.runner.session.state

    async def start(self) -> None:
        await self.runner.start()
        await self.write_manifests()  # steps committed before a crash, still awaiting their manifest

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.run_once()

    async def run_once(self) -> int:
        handled = await self.runner.run_once()
        await self.write_manifests()
        return handled

    # -- the persistent tier ----------------------------------------------------------------------

    async def write_manifests(self) -> list[Event]:
        """Commit every disk-committed step that has no manifest yet; returns the events published."""
        published = []
        for job_id, job in sorted(self.state.jobs.items()):
            for commit in job.pending_manifests():
                key = (job_id, commit.step)
                if key in self._manifest_done:
                    continue
                now = self.clock()
                first, last = self._manifest_failures.get(key, (None, None))
                if last is not None and (now - last).total_seconds() < self.manifest_retry_interval_s:
                    continue
                try:
                    manifest, reused = await asyncio.to_thread(self._write_manifest, job_id, job.world_size, commit)
                except ckpt_disk.CheckpointError as exc:
                    self.stats.manifest_failures += 1
                    first = first or now
                    self._manifest_failures[key] = (first, now)
                    if (now - first).total_seconds() >= MANIFEST_RETRY_S:
                        self._manifest_done.add(key)  # the step stays incomplete: never a checkpoint
                        log.error("%s step %d: not persisted, giving up after %.0f s: %s", job_id, commit.step,
                                  MANIFEST_RETRY_S, exc)
                    else:
                        log.warning("%s step %d: manifest not written yet: %s", job_id, commit.step, exc)
                    continue
                # Retention first: whoever sees the event finds the disk as it describes (a crash in
                # between is harmless: the next start reuses the manifest and reports it).
                removed = await asyncio.to_thread(ckpt_disk.apply_retention, self.persist_root, job_id, self.retention)
                self.stats.removed_dirs += len(removed)
                event = self._persisted_event(job_id, commit, manifest)
                await self.bus.publish(event)
                self._manifest_done.add(key)
                published.append(event)
                if reused:
                    self.stats.manifests_reused += 1
                else:
                    self.stats.manifests_written += 1
                log.info("%s: step %d persisted (%s)%s", job_id, commit.step, manifest.path,
                         f"; retention removed {len(removed)} older step(s)" if removed else "")
        return published

    def _write_manifest(self, job_id: str, world_size: int, commit: DiskCommit) -> tuple[ckpt_disk.Manifest, bool]:
        """Write the manifest (``write_manifest`` checks every shard file's presence and size), or reuse
        one already there for exactly these shards (a restart after writing, before reporting)."""
        try:
            existing = ckpt_disk.read_manifest(self.persist_root, job_id, commit.step)
        except ckpt_disk.CheckpointError:
            existing = None
        wanted = {r: (s.bytes, s.digest) for r, s in commit.shards.items()}
        if existing is not None and {e.rank: (e.bytes, e.sha256) for e in existing.shards} == wanted:
            return existing, True
        shards = [commit.shards[r] for r in sorted(commit.shards)]
        return ckpt_disk.write_manifest(self.persist_root, job_id, commit.step, world_size, shards), False

    def _persisted_event(self, job_id: str, commit: DiskCommit, manifest: ckpt_disk.Manifest) -> Event:
        cause = uuid.UUID(commit.commit_id)
        payload = CheckpointPersisted(step=commit.step, path=str(manifest.path), manifest_digest=manifest.digest,
                                      bytes=manifest.bytes, save_cost_s=commit.save_cost_s)
        return Event.create(
            payload,
            event_id=decision_id(cause, PERSISTER, payload.event_name, str(commit.step)),
            job_id=job_id,
            subject=f"job/{job_id}",
            producer=PERSISTER,
            occurred_at=self.clock(),
            causation_id=cause,
            correlation_id=cause,
        )

"""What an actuator does with a command (pure): carry it out, or report why not.

Commands reach actuators as events: ``NodeEvictionDecided`` (take the node out of the job: cordon or
drain it, stop its processes) and ``StandbyRefillRequested`` (bring the warm-standby pool back to its
target). Every command carries ``expires_at``: one seen after it is reported ``expired`` and not carried
out, so a controller's cold start, a redelivery after an outage or a backlog never evicts a node on a
stale decision. ``observe_only`` evictions are reported ``skipped_observe_only``. A refill is
idempotent towards its target: standbys already provisioned for the job count against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Protocol

from keel.events.types import NodeEvictionDecided, StandbyRefillRequested


@dataclass(frozen=True)
class EvictOutcome:
    outcome: Literal["evicted", "expired", "failed", "skipped_observe_only"]
    detail: str


class Actuator(Protocol):
    """Where the machines are: a local cluster (``keel.actuator.local``), Slurm (``keel.actuator.slurm``: drain)
    or Kubernetes (``keel.actuator.kubernetes``: cordon, taint and label, delete the job's pods)."""

    name: str

    def evict(self, node_id: str, reason: str, incident: str = "") -> str:
        """Take ``node_id`` out of the job for good (its processes stopped); returns a detail line.
        ``incident``: the incident the eviction belongs to (the command's correlation id), recorded where
        the machines are when they can hold it. Raises ``ActuatorError`` when it cannot."""
        ...

    def standbys(self) -> list[str]:
        """The warm standbys this actuator runs for the job now (not yet promoted, not evicted)."""
        ...

    def mark_promoted(self, node_id: str) -> None:
        """Record that a standby was promoted into the job (it no longer counts towards the pool)."""
        ...

    def provision_standbys(self, count: int) -> list[str]:
        """Start ``count`` new warm standbys (asynchronously ready: each registers and self-checks
        itself); returns their node ids."""
        ...


class ActuatorError(RuntimeError):
    """The actuator could not carry out a command; the message says why (reported, never swallowed)."""


def eviction_outcome(command: NodeEvictionDecided, now: datetime) -> EvictOutcome | None:
    """``None``: carry the eviction out; else the outcome to report without touching the node."""
    if now > command.expires_at:
        return EvictOutcome("expired", f"command expired at {command.expires_at.isoformat()} (seen at "
                                       f"{now.isoformat()}); not executed")
    if command.observe_only:
        return EvictOutcome("skipped_observe_only", "observe mode: decided, not executed")
    return None


def refill_count(command: StandbyRefillRequested, now: datetime, standbys_now: int) -> tuple[int, str]:
    """How many standbys to start for a refill command, and why (0 when expired or already there)."""
    if now > command.expires_at:
        return 0, f"refill expired at {command.expires_at.isoformat()}; not executed"
    missing = max(0, command.target - standbys_now) if command.target else command.count
    count = min(command.count, missing) if command.target else command.count
    if count <= 0:
        return 0, f"{standbys_now} standby(s) already up for a target of {command.target}: nothing to start"
    return count, f"{standbys_now} standby(s) up, target {command.target}: starting {count}"

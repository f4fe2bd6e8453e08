"""The checkpoint broker's decider: pure decisions over the event log (no I/O, no clock, no randomness).

Four decisions per job, each with a reason (docs/checkpointing.md), each in its own module:

- **Placement** (``placement``): every rank's backup peer on a node that shares no parallel group with
  the rank's node -> ``CheckpointNodeBackupsAssigned``, one per node that runs the ranks concerned, on
  its subject.
- **Commits** (``restore.decide_commit``): the newest step every rank has a shard of in a tier ->
  ``CheckpointStepCommitted``.
- **Schedule** (``schedule``): the persistent tier's interval K from Young's formula and the backup
  interval -> ``CheckpointScheduleSet`` when either changes.
- **Restore** (``restore.decide_restore``): once every node's inventory for a generation arrived (or the
  wait timed out), where each rank restores from -> each node's part (``CheckpointNodeRestorePlanned``,
  on its subject), then the job-wide ``CheckpointRestorePlanned`` (a summary) and its fallbacks.

Every event stays within the bus's event limit at any job size (``parts``); the kernel's size check
at publish refuses, with a reason, anything that still would not.

The state and its fold are ``state``. The manifest of a disk-committed step is written by the adapter
(I/O); it reads ``JobState.pending_manifests`` and reports ``CheckpointPersisted``, which the fold takes
back in.
"""

from __future__ import annotations

from datetime import datetime

from keel.checkpoint_broker.placement import decide_placement
from keel.checkpoint_broker.restore import decide_commit, decide_restore
from keel.checkpoint_broker.schedule import decide_schedule
from keel.checkpoint_broker.state import (
    BrokerPolicy,
    BrokerState,
    JobState,
    fenced_report,
    fold,
    heartbeat_reports,
    received_at,
)
from keel.events.envelope import Event
from keel.events.types import (
    CheckpointBackupFailed,
    CheckpointInventoryReported,
    CheckpointPersisted,
    CheckpointRanksRegistered,
    CheckpointShardsStored,
    NodeEvicted,
    NodeEvictionDecided,
    NodeHeartbeat,
    RankExited,
    RankStarted,
    TimerTicked,
)
from keel.kernel.decider import Decision

INPUTS = frozenset({
    CheckpointRanksRegistered.event_name, CheckpointBackupFailed.event_name, CheckpointShardsStored.event_name,
    CheckpointInventoryReported.event_name, CheckpointPersisted.event_name, NodeHeartbeat.event_name,
    RankExited.event_name, RankStarted.event_name, NodeEvictionDecided.event_name, NodeEvicted.event_name,
    TimerTicked.event_name,
})
"""Event types ``decide`` has something to say about; all of them are in ``state.FOLDED`` too."""


def commit_held_back(job: JobState, tier: str, at: datetime, policy: BrokerPolicy) -> bool:
    """Whether a heartbeat-carried report of ``tier`` waits: its tier committed less than
    ``policy.commit_min_period`` ago (the disk tier never waits: its commit starts the manifest)."""
    last = job.committed_at.get(tier)
    return tier != "disk" and last is not None and at - last < policy.commit_min_period


class CheckpointBrokerDecider:
    """The checkpoint broker: placement, commits, schedule and restore plans, per job."""

    name = "checkpoint-broker"

    def __init__(self, policy: BrokerPolicy | None = None) -> None:
        self.policy = policy or BrokerPolicy()

    def initial_state(self) -> BrokerState:
        return BrokerState()

    def interested_in(self, event: Event) -> bool:
        return event.type in INPUTS

    def evolve(self, state: BrokerState, event: Event) -> BrokerState:
        return fold(state, event, self.policy)

    def decide(self, state: BrokerState, event: Event) -> Decision:
        """Every sub-decision ``event`` concerns, in a fixed order: their reasons joined, their proposals
        concatenated (one event can place backups and re-plan the schedule, say)."""
        job = state.job(event.job_id)
        p = event.payload
        parts: list[Decision] = []
        subject = f"job/{event.job_id}"
        fenced = fenced_report(job, p)
        if fenced:
            return Decision(reason=fenced)
        if isinstance(p, (CheckpointRanksRegistered, CheckpointBackupFailed, NodeEvictionDecided, NodeEvicted)):
            parts.append(decide_placement(job, p, subject, self.policy.part_budget_bytes))
        if isinstance(p, CheckpointShardsStored):
            parts.append(decide_commit(job, p, subject))
        if isinstance(p, NodeHeartbeat):
            # Its memory and peer holdings (v3): each tier as a shard report of its own, at most one
            # commit per tier and ``commit_min_period``.
            parts.extend(decide_commit(job, report, subject) for report in heartbeat_reports(p)
                         if not commit_held_back(job, report.tier, event.occurred_at, self.policy))
        if isinstance(p, (NodeHeartbeat, CheckpointPersisted, RankExited, NodeEvictionDecided)) or (
                isinstance(p, CheckpointShardsStored) and any(r.send_s > 0 for r in p.shards)):
            parts.append(decide_schedule(job, event, self.policy, subject))
        if isinstance(p, (CheckpointInventoryReported, RankStarted, TimerTicked)):
            parts.append(decide_restore(job, received_at(job, event), self.policy, subject))
        reasons = [part.reason for part in parts if part.reason]
        proposals = tuple(proposal for part in parts for proposal in part.proposals)
        return Decision(reason="; ".join(reasons) or f"{event.type}: nothing to decide", proposals=proposals)

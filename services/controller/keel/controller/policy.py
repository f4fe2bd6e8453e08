"""The controller's policy: every limit, timeout and switch the escalation ladder reads (pure data).

``ControllerPolicy`` is built from ``controller.*`` settings (``adapter.decider_from_settings``); the
ladder (``rules``), the action planning (``actions``) and the guardrail limits of a new job
(``state.new_job``) read it, and nothing else configures the controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

ALL_CHECKS: tuple[str, ...] = ("gpu_matmul", "intra_node_all_to_all", "inter_node_all_gather")
"""The stop-time diagnostics an agent runs when asked (rung 2), cheapest and most local first."""
ACTIONS = frozenset({"evict", "restart", "diagnose", "promote", "rollback", "stop"})
Action = Literal["evict", "restart", "diagnose", "promote", "rollback", "stop"]
"""An action kind a guardrail can hold back (``ActionHeld.action``) or a human must approve."""


@dataclass(frozen=True)
class ControllerPolicy:
    command_ttl: timedelta = timedelta(minutes=5)
    """Every command expires this long after the time it was decided at (a cold start never runs a stale one)."""
    observe_only: bool = False
    """Decide and record, execute nothing: every action becomes ``ActionHeld`` (guardrail ``observe_only``)."""
    diagnostics_timeout: timedelta = timedelta(seconds=60)
    stack_analysis: bool = True
    """Rung 3: a hang first gets its stacks captured and aggregated by the analyzer (while the ranks are
    still hung); only an inconclusive verdict goes on to rung 2's diagnostics."""
    stacks_timeout: timedelta = timedelta(seconds=10)
    """Agents answer a stack capture within this; the analyzer judges without the rest."""
    all_blocked_hang_after: timedelta = timedelta(seconds=5)
    """Every rank of the job inside a collective at once this long: a hang (``rules.all_blocked``); zero: off."""
    stacks_verdict_timeout: timedelta = timedelta(seconds=20)
    """No verdict from the analyzer this long after the capture was asked for: go on to rung 2."""
    sdc_replay: bool = True
    """Rung 5: a NaN or spike that diagnostics do not explain is replayed to locate the corrupting machine."""
    sdc_replay_timeout: timedelta = timedelta(seconds=60)
    """Nodes answer a replay round within this; no verdict 30 s after it: restart in place."""
    diagnostics_ack_timeout: timedelta = timedelta(seconds=2)
    """A round's node whose agent sent no heartbeat since the request for this long is lost (its agent
    answers a request with a heartbeat at once): a diagnostics round concludes without it, a stack capture
    round evicts it; either only when fewer than half the round are silent and the recorded clock has no
    gap since the request (``rules.round_lost_nodes``)."""
    peer_loss_silence: timedelta = timedelta(seconds=3)
    """A node its peers report unreachable (their ranks' connections to its address keep retransmitting)
    is lost once its agent has sent nothing for this long and nothing since the report
    (``rules.peer_reported_lost_nodes``): longer than the retransmissions take (about 1.4 s) plus a probe
    interval, so the silence began before the connections stuck."""
    diagnostics_checks: tuple[str, ...] = ALL_CHECKS
    node_silence_timeout: timedelta = timedelta(seconds=30)
    """A node of the job the controller has not heard from (any event of its agent, by arrival on the
    recorded clock) for this long is lost (rung 1)."""
    clock_skew_allowance: timedelta = timedelta(seconds=5)
    """How far a producer's timestamps may lie from the recorded clock before it is reported
    (``NodeClockSkewed``), and how much later than its interval a tick may come before the clock counts
    as interrupted (silence is then judged from the tick after the gap)."""
    recovery_timeout: timedelta = timedelta(minutes=10)
    """A restart that has not brought the job back to stepping this long after it was decided: the job
    stops and a human is paged (a recovery never waits for ever)."""
    process_settle_interval: timedelta = timedelta(seconds=5)
    """A job without the SDK (its heartbeats never show a rank reporting): the incident is resolved once
    every rank of the restarted generation has been running this long, by the recorded clock."""
    eviction_window: timedelta = timedelta(hours=1)
    max_evictions: int = 8
    max_eviction_fraction: float = 0.1
    restart_window: timedelta = timedelta(hours=1)
    restart_budget: int = 10
    max_same_failure: int = 3
    approval_required: frozenset[str] = frozenset()
    """Action kinds (evict, restart, diagnose, rollback) that wait for a human's ``keel approve``."""
    approval_ttl: timedelta = timedelta(minutes=30)
    standby_quantile: float = 0.99
    standby_replacement_window: timedelta = timedelta(hours=1)
    """How long a failed machine takes to come back: the binomial model's window."""
    standby_prior_rate_per_node_hour: float = 0.0012
    """Per-node failure rate assumed while the log is young (the paper's pools: 4 spares for 1,024)."""
    standby_prior_node_hours: float = 1000.0
    standby_min: int = 0
    """At least this many standbys, whatever the model says."""
    shrink_without_standby: bool = False
    """No ready standby for the nodes an incident evicts: go on with the nodes left, renumbered as fewer
    node ranks, each rank restoring the last step resharded from every old rank's shard (memory, peers),
    instead of waiting for the pool (``shrink.plan_shrink``). Off by default: the training script must be
    able to load onto another world size (``Checkpointer.restore`` of a sharded or replicated model)."""
    shrink_min_nodes: int = 1
    """A shrink never leaves fewer nodes than this: below it the job waits for a standby as before."""
    shrink_node_multiple: int = 1
    """A shrink keeps the node count a multiple of this (the nodes one pipeline or tensor-parallel group
    spans, whose width a restore cannot change); otherwise the job waits for a standby."""

    def __post_init__(self) -> None:
        unknown = set(self.approval_required) - ACTIONS
        if unknown:
            raise ValueError(f"approval_required: unknown action kind(s) {sorted(unknown)}; known: {sorted(ACTIONS)}")
        if self.shrink_min_nodes < 1 or self.shrink_node_multiple < 1:
            raise ValueError(f"shrink_min_nodes ({self.shrink_min_nodes}) and shrink_node_multiple "
                             f"({self.shrink_node_multiple}) must be at least 1")

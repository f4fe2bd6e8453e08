"""The controller as a kernel ``Decider``: the escalation ladder over the event log (pure: no I/O, no clock).

Thin by design: ``evolve`` is the fold (``state.evolve_job``), ``decide`` hands the event to its rule
(``rules``) with an ``ActionPlan`` (``actions``) and returns the decision the rule built. ``adapter``
runs it live (``DeciderRunner``); ``keel replay --verify`` runs it over a recorded log.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from keel.controller import rules
from keel.controller.actions import NAME, ActionPlan
from keel.controller.policy import ControllerPolicy
from keel.controller.state import ControllerState, evolve_job, fenced_report, new_job
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    ApprovalGiven,
    CodeRolloutRequested,
    DiagnosticsCompleted,
    FailSlowConvicted,
    MetricAnomalyDetected,
    NodeCordoned,
    NodeEvicted,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeRegistered,
    RankExited,
    RanksRestarted,
    SdcReplayAnalyzed,
    StacksAnalyzed,
    StandbyChecked,
    StandbyPromoted,
    TimerTicked,
)
from keel.kernel.decider import Decision

Rule = Callable[[ActionPlan, Any], None]
"""A rule of the ladder: ``rule(plan, payload)`` calls the plan's actions about one event's payload."""

_RULES: Mapping[type[EventPayload], Rule] = {
    NodeHealthChanged: rules.on_health,
    RankExited: rules.on_exit,
    DiagnosticsCompleted: rules.on_diagnostics,
    StacksAnalyzed: rules.on_stacks,
    FailSlowConvicted: rules.on_fail_slow,
    MetricAnomalyDetected: rules.on_metric_anomaly,
    SdcReplayAnalyzed: rules.on_sdc_verdict,
    CodeRolloutRequested: rules.on_rollout,
    TimerTicked: rules.on_tick,
    NodeHeartbeat: rules.on_heartbeat,
    ApprovalGiven: rules.on_approval,
    NodeCordoned: rules.on_cordon,
    RanksRestarted: rules.on_restart_report,
    # A change of the standby pool: registrations, self-checks, promotions, evictions done.
    NodeRegistered: rules.on_pool_change,
    StandbyChecked: rules.on_pool_change,
    StandbyPromoted: rules.on_pool_change,
    NodeEvicted: rules.on_pool_change,
}
"""Which rule decides on which event (the payload types have no subclasses: the exact type selects)."""

_DECIDES_ON = frozenset(payload.event_name for payload in _RULES)


class ControllerDecider:
    """The escalation ladder, per job. Every decision's reason names the rung and the evidence."""

    name = NAME

    def __init__(self, policy: ControllerPolicy | None = None) -> None:
        self.policy = policy or ControllerPolicy()

    def initial_state(self) -> ControllerState:
        return ControllerState()

    def interested_in(self, event: Event) -> bool:
        return event.type in _DECIDES_ON

    def evolve(self, state: ControllerState, event: Event) -> ControllerState:
        job = state.jobs.get(event.job_id) or new_job(self.policy)
        updated = evolve_job(job, event)
        return state if updated is job else state.with_job(event.job_id, updated)

    def needs_clock(self, state: ControllerState) -> list[str]:
        """Jobs whose rules depend on time now (a running job's silent nodes, a diagnostics deadline):
        the adapter records a ``TimerTicked`` for each, once per clock interval."""
        return sorted(job_id for job_id, job in state.jobs.items() if job.needs_clock)

    def decide(self, state: ControllerState, event: Event) -> Decision:
        plan = ActionPlan(self.policy, state.jobs.get(event.job_id) or new_job(self.policy), event)
        # The kernel only asks about ``_DECIDES_ON``; any other event re-checks the standby pool.
        fenced = fenced_report(plan.job, event)
        if fenced is not None:
            # A fenced node's report (its registration as a standby lifts the fence in the fold: not here).
            rules.on_fenced(plan, event, fenced)
            return plan.decision(f"{event.type}: from a fenced node")
        rule = _RULES.get(type(event.payload), rules.on_pool_change)
        rule(plan, event.payload)
        return plan.decision(f"{event.type}: nothing to decide")

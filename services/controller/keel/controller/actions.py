"""The controller's actions: how one decision is built, and the guardrails every action goes through.

``ActionPlan`` is one decision in the making. The ladder's rules (``rules``) call its actions:

- incidents: ``open_incident``, ``resolve``;
- rungs: ``evict_idle`` (rung 1, an idle standby), ``capture_stacks`` (rung 3), ``diagnose`` (rung 2),
  ``replay_sdc`` (rung 5), ``recover`` (evict, promote standbys, roll back, restart in place: every rung's
  way back), ``roll_out`` (a planned restart onto new code), ``size_pool`` (the standby pool);
- guardrails: ``hold`` and ``approval_needed``.

Guardrails: observe mode (decide and record, execute nothing: ``ActionHeld``), an eviction circuit
breaker (count and fraction of the job's nodes per window: past it, stop and page), the crash-loop
breaker and restart budget (rung 6), never undoing a human's cordon (a cordoned node is neither
diagnosed, restarted onto nor promoted), optional approval per action kind (``ApprovalRequested`` ->
``ApprovalGiven``), and an expiry on every command, so a cold start never executes a stale one (the
runner never re-decides history; agents and actuators check ``expires_at``).

Code versions: the controller stays the only one that restarts ranks. Every restart it decides carries
the newest pending version (a lazy version rides on the next restart of any cause), and every restart
and promotion command names the version its ranks run (``code_for``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Literal

from keel.controller.master import moved_rendezvous
from keel.controller.policy import Action, ControllerPolicy
from keel.controller.shrink import Shrink, plan_shrink
from keel.controller.standby import failure_probability, plan_standby_pool
from keel.controller.state import HeldPlan, JobView, evolve_job
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    ActionHeld,
    ApprovalRequested,
    DiagnosticsRequested,
    IncidentOpened,
    IncidentResolved,
    JobStopDecided,
    NodeEvictionDecided,
    Promotion,
    RanksRestartRequested,
    RestartDecided,
    RollbackDecided,
    SdcPhase,
    SdcReplayRequested,
    StacksRequested,
    StandbyPoolSized,
    StandbyPromotionRequested,
    StandbyRefillRequested,
    TimerTicked,
)
from keel.kernel.decider import Decision, Proposal, decision_id, materialise
from keel.rules.sdc import plan_phases
from keel.rules.sdc_replay import machine_units, sdc_phase

NAME = "controller"
"""The producer name of every controller decision; part of each decision's id, so it never changes."""
MIN_SDC_UNITS = 3
"""Fewer replay units (model replicas) than this leave no majority to tell the clean result apart."""


def ranks_text(ranks: Iterable[int]) -> str:
    """Ranks for a reason: sorted, comma-separated."""
    return ", ".join(map(str, sorted(ranks)))


class ActionPlan:
    """Builds one decision about one event: the ladder's rules call its actions, each action proposes
    events through ``emit``, and ``decision()`` hands them to the kernel.

    Every proposal is folded into ``job`` at once (with ``evolve_job``, the fold the log gets), so later
    steps of the same decision see what earlier ones changed (the incident just opened, a round number
    taken). That fold is a scratch copy: the kernel's ``DeciderSession`` folds the emitted events into
    the real state, as a cold start folds them from the log.
    """

    def __init__(self, policy: ControllerPolicy, job: JobView, event: Event) -> None:
        self.policy, self.job, self.event = policy, job, event
        self.proposals: list[Proposal] = []
        self.events: list[Event] = []
        """The proposals as events, as folded into ``job``: what ``materialise`` makes of ``decision()``."""
        self.reasons: list[str] = []
        self.subject = f"job/{event.job_id}"
        self.now = self.recorded_now(job, event)
        """The decision's time (``recorded_now``, fixed at the input): its expiries, deadlines and the
        ``occurred_at`` of every event it emits."""

    def note(self, reason: str) -> None:
        """Add ``reason`` to the decision's reason (once)."""
        if reason and reason not in self.reasons:
            self.reasons.append(reason)

    def emit(self, payload: EventPayload, subject: str | None = None, key: str = "", *,
             correlation_id: uuid.UUID | None = None) -> Event:
        """Propose ``payload`` (on the job's subject unless told) and fold it into ``job``. Its correlation
        id is ``correlation_id``, else the open incident's id, else the kernel's default (the cause's)."""
        incident = self.job.incident
        if correlation_id is None and incident is not None:
            correlation_id = uuid.UUID(incident.id)
        proposal = Proposal(payload, subject=subject or self.subject, key=key, correlation_id=correlation_id)
        [event] = materialise(NAME, self.event, Decision("", (proposal,), at=self.now))
        self.proposals.append(proposal)
        self.events.append(event)
        self.job = evolve_job(self.job, event)
        return event

    def decision(self, default: str) -> Decision:
        """The decision: every proposal, and the reasons noted (``default`` when none was)."""
        return Decision(reason="; ".join(self.reasons) or default, proposals=tuple(self.proposals), at=self.now)

    @staticmethod
    def recorded_now(job: JobView, event: Event) -> datetime:
        """The decision's time on the controller's recorded clock (docs/architecture.md, "Time"):

        - a tick: its ``now``;
        - on the recorded clock (v2 ticks), a job whose clock runs (``needs_clock``): the latest tick's
          ``now`` - the event arrived after it, and its producer's timestamp is not trusted: a clock
          10 minutes behind or ahead, or an event delivered late, moves no deadline and no expiry;
        - a job whose clock does not run (no ranks running): the producer's timestamp, never earlier
          than the latest tick (the clock may have stopped long ago: see docs/known-limits.md);
        - before any v2 tick of the job (a new job's first events; logs of v1 ticks): the producer's
          timestamp, as such logs were decided.
        """
        p = event.payload
        if isinstance(p, TimerTicked):
            return p.now
        if job.clock_at is None:
            return event.occurred_at
        if job.needs_clock:
            return job.clock_at
        return max(event.occurred_at, job.clock_at)

    @property
    def expires_at(self) -> datetime:
        """When a command decided now expires (``policy.command_ttl`` after the decision's recorded time,
        never after a producer's timestamp)."""
        return self.now + self.policy.command_ttl

    # incidents

    def open_incident(self, kind: str, node_id: str, fingerprint: str, reason: str, *,
                      ranks: list[int] | None = None) -> None:
        """Open an incident about this event, unless one is open (the signal then joins it)."""
        if self.job.incident is not None:
            return
        # An incident's id is the id of the event that opens it, and the correlation id of every event
        # about it, that one included: known before the event is built (``decision_id`` of this cause
        # and key), so the proposal is built once, with it.
        key = "incident"
        incident_id = decision_id(self.event.id, NAME, IncidentOpened.event_name, key)
        opened = self.emit(IncidentOpened(kind=kind, node_id=node_id,
                                          ranks=ranks or sorted(self.job.node(node_id).ranks),
                                          generation=self.job.generation, last_step=self.job.last_step,
                                          fingerprint=fingerprint, reason=reason, evidence=[str(self.event.id)]),
                           key=key, correlation_id=incident_id)
        assert opened.id == incident_id, "materialise no longer derives ids as decision_id(cause, name, type, key)"

    def resolve(self, outcome: str, reason: str, *, stop: bool = False, rung: int | None = None,
                measure: Literal["step", "process"] = "step") -> None:
        """Close the open incident with ``outcome``; ``stop``: stop the job and page a human too;
        ``measure``: how recovery was judged (``process``: a job without the SDK, on process liveness)."""
        incident = self.job.incident
        assert incident is not None
        self.note(reason)
        final_rung = rung if rung is not None else incident.rung
        # Keys name the incident: one decision may close one incident and open (and close) the next, and
        # two events of one type and key from one cause would share an id (the second deduplicated away).
        if stop:
            self.emit(JobStopDecided(incident_id=incident.id, rung=max(1, final_rung), reason=reason, page=True,
                                     evidence=list(incident.evidence)), key=f"stop/{incident.id}")
        self.emit(IncidentResolved(incident_id=incident.id, outcome=outcome, rung=final_rung,
                                   generation=self.job.generation, reason=reason, measure=measure),
                  key=f"resolved/{incident.id}")

    # guardrails

    def hold(self, action: Action, guardrail: str, reason: str, plan: HeldPlan) -> None:
        """Record that ``guardrail`` holds ``action`` back (``ActionHeld``); ``plan`` is what runs once it may."""
        incident = self.job.incident
        assert incident is not None
        self.note(reason)
        self.emit(ActionHeld(incident_id=incident.id, action=action, guardrail=guardrail, reason=reason,
                             rung=plan.rung, evict=sorted(plan.evict), rollback=plan.rollback),
                  key=f"held/{guardrail}/{incident.id}")

    def approval_needed(self, action: Action, plan: HeldPlan) -> bool:
        """Whether ``action`` waits for a human; if so, hold it and ask (``ApprovalRequested``)."""
        if action not in self.policy.approval_required:
            return False
        incident = self.job.incident
        assert incident is not None
        self.hold(action, "approval", f"{action} needs a human's approval: `keel approve` or `keel deny`", plan)
        self.emit(ApprovalRequested(incident_id=incident.id, action=action, reason=plan.reason,
                                    expires_at=self.now + self.policy.approval_ttl), key=f"approval/{action}")
        return True

    # rungs

    def evict_idle(self, node_id: str, reason: str) -> None:
        """Evict a node that runs none of the job's ranks (an idle standby): nothing to restart."""
        verdict = self.job.evictions.check(self.now, self.job.size)
        if not verdict.allowed:
            self.note(f"{reason}; held: {verdict.reason}")
            return
        self.note(reason)
        self.emit(NodeEvictionDecided(node_id=node_id, rung=1, reason=reason, evidence=[str(self.event.id)],
                                      expires_at=self.expires_at, observe_only=self.policy.observe_only),
                  subject=f"node/{node_id}")

    def capture_stacks(self, reason: str) -> None:
        """Rung 3: every active node captures its training processes' stacks; the analyzer judges."""
        nodes = [n.node_id for n in sorted(self.job.active, key=lambda n: min(n.ranks)) if not n.cordoned]
        round_ = self.job.stack_rounds
        self.note(reason)
        self.emit(StacksRequested(round=round_, nodes=nodes, timeout_s=self.policy.stacks_timeout.total_seconds(),
                                  expires_at=self.expires_at, reason=reason), key=f"stacks/{round_}")

    def diagnose(self, reason: str) -> None:
        """Rung 2: stop the ranks and run stop-time diagnostics on every active, uncordoned node."""
        # By rank, rank 0's node first: it hosts the round's rendezvous, at the job's master address.
        nodes = [n.node_id for n in sorted(self.job.active, key=lambda n: min(n.ranks)) if not n.cordoned]
        plan = HeldPlan(2, frozenset(), reason)
        if self.policy.observe_only:
            self.hold("diagnose", "observe_only", "observe mode: diagnostics decided, not run", plan)
            return
        if self.approval_needed("diagnose", plan):
            return
        round_ = self.job.diag_rounds
        self.note(reason)
        self.emit(DiagnosticsRequested(round=round_, nodes=nodes, checks=list(self.policy.diagnostics_checks),
                                       timeout_s=self.policy.diagnostics_timeout.total_seconds(),
                                       expires_at=self.expires_at, reason=reason), key=f"diagnostics/{round_}")

    def replay_sdc(self, reason: str, phases: list[SdcPhase] | None = None, reference: str = "") -> None:
        """Rung 5: restart every node's ranks in replay mode (the dual-phase plan, or ``phases``); the
        analyzer's verdict comes back as ``SdcReplayAnalyzed``. With fewer than ``MIN_SDC_UNITS`` replay
        units there is no majority to judge by: restart in place."""
        job = self.job
        active = [n for n in sorted(job.active, key=lambda n: min(n.ranks)) if not n.cordoned]
        rank_nodes = {r: n.node_id for n in active for r in n.ranks}
        units = machine_units(rank_nodes, {r: job.rank_links.get(r, frozenset({r})) for r in rank_nodes})
        if len(units) < MIN_SDC_UNITS or not job.rank_links:
            why = ("no checkpointed ranks to replay from" if not job.rank_links
                   else f"{len(units)} replay unit(s) ({', '.join(u.name for u in units) or 'none'}): the clean result "
                        f"is the one most groups agree on, which needs at least {MIN_SDC_UNITS} units")
            self.recover(5, frozenset(), f"{reason}; {why}: restart in place from before the anomaly")
            return
        if self.policy.observe_only:
            self.hold("diagnose", "observe_only", f"{reason}; observe mode: the replay is decided, not run",
                      HeldPlan(5, frozenset(), reason))
            return
        if phases is None:
            phases = [sdc_phase(p) for p in plan_phases([u.name for u in units])]
        round_ = job.sdc_rounds
        self.note(reason)
        self.emit(SdcReplayRequested(round=round_, generation=job.generation + 1, nodes=[n.node_id for n in active],
                                     units=units, phases=phases, anomaly_step=max(0, job.anomaly_step),
                                     reference=reference, timeout_s=self.policy.sdc_replay_timeout.total_seconds(),
                                     expires_at=self.expires_at,
                                     reason=f"{reason}: replay the step after the checkpoint below the anomaly "
                                            f"(step {job.anomaly_step}) on {len(units)} units in {len(phases)} "
                                            f"phase(s) ({', '.join(p.kind for p in phases)})"),
                  key=f"sdc/{round_}")

    def recover(self, rung: int, evict: frozenset[str], reason: str, *, rollback: bool = False,
                approved: bool = False) -> None:
        """Evict ``evict`` (ready standbys take over their ranks), roll back if asked, and restart every
        other node of the job in place as the next generation - within the guardrails."""
        job, policy = self.job, self.policy
        incident = job.incident
        assert incident is not None
        plan = HeldPlan(rung, evict, reason, rollback)
        to_evict = sorted(n for n in evict if not job.node(n).evicted and not job.node(n).eviction_pending)
        # The eviction circuit breaker: a flood of "bad node" verdicts is likelier a broken probe or switch.
        breaker = job.evictions
        for _node_id in to_evict:
            verdict = breaker.check(self.now, job.size)
            if not verdict.allowed:
                self.hold("evict", "eviction_breaker", verdict.reason, plan)
                self.resolve("stopped", verdict.reason, stop=True, rung=rung)
                return
            breaker = breaker.record(self.now)
        # The crash-loop breaker and the job-wide restart budget (rung 6); a planned restart is no failure.
        fingerprint = incident.fingerprint or f"{incident.kind}@{','.join(sorted(evict)) or 'none'}"
        verdict = job.crash_loop.check(self.now, fingerprint)
        if rung > 0 and not verdict.allowed:
            self.hold("restart", "restart_budget", verdict.reason, plan)
            self.resolve("stopped", f"rung 6: {verdict.reason}", stop=True, rung=6)
            return
        if policy.observe_only:
            for node_id in to_evict:
                self.emit(NodeEvictionDecided(node_id=node_id, rung=rung, reason=reason, evidence=list(incident.evidence),
                                              expires_at=self.expires_at, observe_only=True), subject=f"node/{node_id}")
            self.hold("rollback" if rollback else "restart", "observe_only", f"{reason}; observe mode: decided, "
                      f"not executed", plan)
            return
        action: Action = "rollback" if rollback else ("evict" if to_evict else "restart")
        if not approved and self.approval_needed(action, plan):
            return
        # Standbys for the ranks of the nodes that leave.
        leaving = [job.node(n) for n in sorted(evict) if job.node(n).ranks]
        standbys = job.ready_standbys
        for node_id in to_evict:
            self.emit(NodeEvictionDecided(node_id=node_id, rung=rung, reason=reason, evidence=list(incident.evidence),
                                          expires_at=self.expires_at), subject=f"node/{node_id}")
        if len(standbys) < len(leaving):
            need = len(leaving) - len(standbys)
            not_shrunk = ""
            if policy.shrink_without_standby:
                staying_nodes = [n for n in job.active if n.node_id not in evict]
                shrink = plan_shrink(staying_nodes, leaving, min_nodes=policy.shrink_min_nodes,
                                     node_multiple=policy.shrink_node_multiple)
                if isinstance(shrink, Shrink):
                    self._restart_shrunk(rung, to_evict, reason, rollback, shrink, need)
                    return
                not_shrunk = f"; no shrink: {shrink}"
            self.hold("promote", "no_standby", f"{reason}; no ready standby for {need} evicted node(s){not_shrunk}: "
                      f"the job waits for the pool to refill", plan)
            # ``target`` is the pool the actuator must bring up: the standbys ready now plus the shortfall
            # (a group eviction can need more than the pool's usual size).
            self.emit(StandbyRefillRequested(count=need, target=max(len(standbys) + need, job.pool_target or 0),
                                             reason=f"incident {incident.id[:8]} needs {need} ready standby(s) now",
                                             expires_at=self.expires_at), key="refill")
            return
        generation = self.job.generation + 1
        code_version, code_text = self.code_for(rollback)
        code = self.job.code_ref(code_version or self.job.code_current)
        promotions = [Promotion(standby_node_id=s.node_id, replaces_node_id=n.node_id, ranks=sorted(n.ranks))
                      for n, s in zip(leaving, standbys, strict=False)]
        staying = [n.node_id for n in self.job.active if n.node_id not in evict]
        moved = moved_rendezvous(promotions, self.job.nodes)
        master_addr = moved.address or self.job.master_addr  # once moved, every command carries it
        self.note(reason)
        text = (f"restart as generation {generation} on {len(staying) + len(promotions)} node(s)"
                + "".join(f"; {p.standby_node_id} takes over ranks {ranks_text(p.ranks)} of {p.replaces_node_id}"
                          for p in promotions)
                + (f"; {moved.reason}" if moved.address else "")
                + (f"; {code_text}" if code_text else "") + "; restore from memory and peers")
        self.note(text)
        self.emit(RestartDecided(incident_id=incident.id, rung=rung, generation=generation, evict=to_evict,
                                 promotions=promotions, restart_nodes=staying, rollback=rollback,
                                 fingerprint=fingerprint, reason=f"{reason}; {text}", code_version=code_version,
                                 code_changed=bool(code_version)), key=f"restart/{generation}")
        if rollback:
            self.emit(RollbackDecided(incident_id=incident.id, reason=f"{reason}; {code_text}",
                                      fingerprint=incident.fingerprint, to_version=code_version,
                                      evidence=list(incident.evidence), expires_at=self.expires_at), key="rollback")
        for promotion in promotions:
            node_rank = promotion.ranks[0] // max(1, len(promotion.ranks))
            self.emit(StandbyPromotionRequested(
                node_id=promotion.standby_node_id, replaces_node_id=promotion.replaces_node_id, node_rank=node_rank,
                ranks=promotion.ranks, generation=generation, expires_at=self.expires_at, code=code,
                master_addr=master_addr,
                reason=f"incident {incident.id[:8]}: take over ranks {ranks_text(promotion.ranks)} of "
                       f"{promotion.replaces_node_id}"), subject=f"node/{promotion.standby_node_id}")
        for node_id in staying:
            self.emit(RanksRestartRequested(node_id=node_id, generation=generation, expires_at=self.expires_at, code=code,
                                            master_addr=master_addr,
                                            reason=f"incident {incident.id[:8]}, rung {rung}: restart in place as "
                                                   f"generation {generation}"), subject=f"node/{node_id}")
        if promotions:
            self.size_pool()

    def _restart_shrunk(self, rung: int, evicted: list[str], reason: str, rollback: bool, shrink: Shrink,
                        need: int) -> None:
        """``recover``'s way when no standby is ready and the policy allows it: restart the nodes that stay
        as a smaller job (``shrink``), each told its new node rank and the new node count."""
        incident = self.job.incident
        assert incident is not None
        fingerprint = incident.fingerprint or f"{incident.kind}@{','.join(sorted(evicted)) or 'none'}"
        generation = self.job.generation + 1
        code_version, code_text = self.code_for(rollback)
        code = self.job.code_ref(code_version or self.job.code_current)
        # Node rank 0 hosts the ranks' rendezvous: when the node that ran global rank 0 leaves, it moves to
        # the new node rank 0 as it would to a standby taking that slice over.
        first = shrink.nodes[0]
        old_first = next((n.node_id for n in self.job.nodes.values() if 0 in n.ranks and n.node_id != first), "")
        moved = moved_rendezvous([Promotion(standby_node_id=first, replaces_node_id=old_first, ranks=[0])]
                                 if old_first else [], self.job.nodes)
        master_addr = moved.address or self.job.master_addr
        text = (f"no ready standby for {need} evicted node(s) and controller.shrink_without_standby is on: restart "
                f"as generation {generation}, {shrink.reason}"
                + (f"; {moved.reason}" if moved.address else "") + (f"; {code_text}" if code_text else ""))
        self.note(reason)
        self.note(text)
        self.emit(RestartDecided(incident_id=incident.id, rung=rung, generation=generation, evict=evicted,
                                 promotions=[], restart_nodes=list(shrink.nodes), rollback=rollback,
                                 fingerprint=fingerprint, reason=f"{reason}; {text}", code_version=code_version,
                                 code_changed=bool(code_version), world_size=shrink.world_size),
                  key=f"restart/{generation}")
        if rollback:
            self.emit(RollbackDecided(incident_id=incident.id, reason=f"{reason}; {code_text}",
                                      fingerprint=incident.fingerprint, to_version=code_version,
                                      evidence=list(incident.evidence), expires_at=self.expires_at), key="rollback")
        nnodes = len(shrink.nodes)
        for node_rank, node_id in enumerate(shrink.nodes):
            self.emit(RanksRestartRequested(
                node_id=node_id, generation=generation, expires_at=self.expires_at, code=code, master_addr=master_addr,
                nnodes=nnodes, node_rank=node_rank,
                reason=f"incident {incident.id[:8]}, rung {rung}: no ready standby: restart as node rank {node_rank} of "
                       f"{nnodes} (generation {generation}, {shrink.world_size} ranks), the checkpoint resharded"),
                subject=f"node/{node_id}")
        self.size_pool()

    def code_for(self, rollback: bool) -> tuple[str, str]:
        """The code version a restart switches to ("" : it keeps the code) and what to say about it."""
        job = self.job
        running = job.code_running
        if rollback:
            # The same failure twice in a row points at the code running now, even if it ran long enough to
            # be called stable (a bug at a step it had not reached yet): back to the stable version before it.
            earlier = [v for v in reversed(job.code_stables) if v != running and v not in job.code_rolled_back]
            if earlier:
                was = " (stable until now)" if running in job.code_stables else ""
                return earlier[0], f"roll the code back from {running}{was} to {earlier[0]}, the last stable version before it"
            if job.code_stables:
                return "", f"no stable version other than {running}: nothing to roll back to; the same code restarts"
            return "", "no code version is known to be stable yet: nothing to roll back to; the same code restarts"
        pending = job.code_pending
        if pending and pending not in job.code_rolled_back:
            return pending, f"the ranks start on code version {pending} (was {running})"
        return "", ""

    def roll_out(self, reason: str) -> None:
        """A planned restart onto the pending code version (an urgent deploy, a lazy one's deadline)."""
        version = self.job.code_pending
        why = f"code rollout: {reason}"
        self.open_incident("code_update", "", f"code_update/{version}", why)
        self.recover(0, frozenset(), why)

    def size_pool(self) -> None:
        """The standby pool's target from the binomial model; a refill when fewer are ready."""
        job, policy = self.job, self.policy
        nodes = len(job.active)
        if nodes == 0:
            return
        # Producers stamp their own events: one arriving out of order can predate the first one seen.
        hours = max(0.0, (self.now - job.first_seen_at).total_seconds() / 3600.0) if job.first_seen_at else 0.0
        p = failure_probability(job.node_failures, nodes * hours, policy.standby_replacement_window,
                                prior_rate_per_node_hour=policy.standby_prior_rate_per_node_hour,
                                prior_node_hours=policy.standby_prior_node_hours)
        model = plan_standby_pool(nodes, p, quantile=policy.standby_quantile)
        target = max(policy.standby_min, model.size)
        ready = len(job.ready_standbys) + sum(1 for n in job.nodes.values() if n.standby and n.checked is None
                                             and not n.evicted)
        if target != job.pool_target:
            reason = model.reason + (f"; raised to the configured minimum {policy.standby_min}"
                                     if policy.standby_min > model.size else "")
            self.note(f"standby pool: {reason}")
            self.emit(StandbyPoolSized(target=target, ready=ready, job_nodes=nodes, failure_probability=p,
                                       reason=reason), key="pool")
        expired = self.job.refill_asked_at is not None and self.now > self.job.refill_asked_at
        pending = 0 if expired else self.job.refills_pending  # an actuator that never delivered is asked again
        missing = target - ready - pending
        if missing > 0:
            self.emit(StandbyRefillRequested(count=missing, target=target,
                                             reason=f"{ready} standby(s) ready or checking and {pending} on their "
                                                    f"way, target {target}",
                                             expires_at=self.expires_at), key="refill/pool")

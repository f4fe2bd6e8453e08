"""Hot-update's decider (pure): when a registered code version rolls out, and when a version is stable.

Per job, folded from the log:

- ``CodeVersionRegistered`` (``keel deploy``) makes the version *pending*; a newer registration replaces an
  older pending one (the newest code wins; the older one is never applied). The deploying client's checks
  are not trusted: a registration whose digest, id, store folder or entry point is malformed
  (``keel.rules.code.registration_problem``) is answered with ``CodeVersionRejected`` and never pending.
  Every node re-hashes the stored version before it runs it (``keel.infra.code_store``).
- The controller is the only one that restarts ranks. Every restart it decides carries the pending version
  (``RestartDecided.code_version``, ``code_changed``): a lazy version rides on the next restart of any
  cause. Until the agents report it running (``CodeVersionApplied``) that version is *in flight*.
- An urgent version, or a lazy one whose ``deadline`` passed (time from the job clock's recorded
  ``TimerTicked``) with nothing to ride on, makes this decider ask for a restart now:
  ``CodeRolloutRequested``. At most one rollout is in flight per job: a request waits until the version
  in flight is applied.
- Stability: the version running (``launch``, the job's own command, until a version is applied) gets a
  window from its first heartbeat after it was applied; ``stable_steps`` steps or ``stable_time`` in that
  window with no incident it could have caused (a crash, a hang, a metric anomaly - not a machine's fault)
  make it stable (``CodeVersionStable``). An incident it could have caused restarts the window. The
  controller rolls back to the newest stable version at rung 4.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from keel.events.envelope import Event
from keel.events.types import (
    LAUNCH_VERSION,
    CodeRolloutRequested,
    CodeVersionApplied,
    CodeVersionRegistered,
    CodeVersionRejected,
    CodeVersionStable,
    IncidentOpened,
    IncidentResolved,
    NodeHeartbeat,
    RestartDecided,
    TimerTicked,
)
from keel.kernel.decider import Decision, Proposal
from keel.rules.code import registration_problem

NAME = "hot-update"

NOT_CODE_FAULTS = frozenset({"hardware", "lost_node", "fail_slow", "code_update"})
"""Incident kinds no code version can cause: they do not restart a version's stability window."""


@dataclass(frozen=True)
class HotUpdatePolicy:
    stable_steps: int = 500
    stable_time: timedelta = timedelta(minutes=30)


@dataclass(frozen=True)
class JobCode:
    versions: Mapping[str, CodeVersionRegistered] = field(default_factory=dict)
    pending: str = ""
    """The newest registered version no restart has carried yet."""
    requested: str = ""
    """A rollout asked of the controller and not yet decided."""
    in_flight: str = ""
    """A version a restart carries that no agent reported running yet."""
    current: str = LAUNCH_VERSION
    stable: tuple[str, ...] = ()
    """Versions found stable, oldest first."""
    rolled_back: frozenset[str] = frozenset()
    last_step: int = -1
    """The step in the newest heartbeat of a training node."""
    incident_open: bool = False
    window_step: int | None = None
    """The current version's step when its stability window opened (None: not open)."""
    window_at: datetime | None = None
    clock_at: datetime | None = None
    """The job clock's latest v2 tick: the recorded clock (``received_at``). None: producers' timestamps
    (before any v2 tick, and in logs of v1 ticks, as those were decided)."""

    def received_at(self, event: Event) -> datetime:
        """When ``event`` counts as having happened: a tick's ``now``, else the recorded clock (a heartbeat
        from a node whose clock is 10 minutes ahead does not make a version stable 10 minutes early)."""
        p = event.payload
        if isinstance(p, TimerTicked):
            return p.now
        return self.clock_at if self.clock_at is not None else event.occurred_at

    @property
    def pending_version(self) -> CodeVersionRegistered | None:
        return self.versions.get(self.pending) if self.pending else None


@dataclass(frozen=True)
class HotUpdateState:
    jobs: Mapping[str, JobCode] = field(default_factory=dict)

    def job(self, job_id: str) -> JobCode:
        return self.jobs.get(job_id, _EMPTY)


_EMPTY = JobCode()

_DECIDES_ON = frozenset({CodeVersionRegistered.event_name, TimerTicked.event_name, NodeHeartbeat.event_name,
                         CodeVersionApplied.event_name})


class HotUpdateDecider:
    name = NAME

    def __init__(self, policy: HotUpdatePolicy | None = None) -> None:
        self.policy = policy or HotUpdatePolicy()

    def initial_state(self) -> HotUpdateState:
        return HotUpdateState()

    def interested_in(self, event: Event) -> bool:
        return event.type in _DECIDES_ON

    # -- evolve ------------------------------------------------------------------------------------

    def evolve(self, state: HotUpdateState, event: Event) -> HotUpdateState:
        job = state.job(event.job_id)
        updated = self.evolve_job(job, event)
        return state if updated is job else HotUpdateState(jobs={**state.jobs, event.job_id: updated})

    def evolve_job(self, job: JobCode, event: Event) -> JobCode:  # noqa: C901 - one branch per event type
        p, at = event.payload, job.received_at(event)
        if isinstance(p, TimerTicked):
            clock_at = p.now if p.interval_s is not None else None
            return job if clock_at == job.clock_at else replace(job, clock_at=clock_at)
        if isinstance(p, CodeVersionRegistered):
            if registration_problem(p.version_id, p.digest, p.path, p.entry):
                return job  # rejected (decide says why): never pending, never rolled out
            return replace(job, versions={**job.versions, p.version_id: p}, pending=p.version_id)
        if isinstance(p, CodeRolloutRequested):
            return replace(job, requested=p.version_id)
        if isinstance(p, RestartDecided):
            if not p.code_changed:
                return job
            rolled_back = job.rolled_back | {job.current} if p.rollback else job.rolled_back
            return replace(job, in_flight=p.code_version, rolled_back=rolled_back,
                           pending="" if job.pending == p.code_version else job.pending,
                           requested="")  # whatever was asked for, the restart took the newest code
        if isinstance(p, CodeVersionApplied):
            if p.version_id == job.current and not job.in_flight:
                return job
            if job.in_flight and p.version_id != job.in_flight:
                return job  # an older generation's node reporting late
            return replace(job, current=p.version_id, in_flight="", window_step=None, window_at=None)
        if isinstance(p, IncidentOpened):
            if p.kind in NOT_CODE_FAULTS:
                return replace(job, incident_open=True)
            return replace(job, incident_open=True, window_step=None, window_at=None)
        if isinstance(p, IncidentResolved):
            return replace(job, incident_open=False)
        if isinstance(p, NodeHeartbeat):
            if p.standby:
                return job
            # The newest report, not the highest ever: steps recomputed after a restore are no new running time.
            job = replace(job, last_step=p.last_step)
            if job.window_step is None and not job.incident_open and not job.in_flight and p.last_step >= 0:
                job = replace(job, window_step=p.last_step, window_at=at)
            return job
        if isinstance(p, CodeVersionStable):
            return replace(job, stable=(*job.stable, p.version_id))
        return job

    # -- decide ------------------------------------------------------------------------------------

    def decide(self, state: HotUpdateState, event: Event) -> Decision:
        job, p = state.job(event.job_id), event.payload
        proposals: list[Proposal] = []
        reasons: list[str] = []
        subject = f"job/{event.job_id}"
        if isinstance(p, CodeVersionRegistered) and (problem := registration_problem(p.version_id, p.digest, p.path,
                                                                                     p.entry)):
            rejected = CodeVersionRejected(source=p.source, digest=p.digest, entry=list(p.entry), mode=p.mode, by=p.by,
                                           why=p.why, reason=f"hot-update refused the registration: {problem}")
            proposals.append(Proposal(rejected, subject=f"code/{p.version_id[:40]}", key="rejected"))
            reasons.append(rejected.reason)
        elif isinstance(p, CodeVersionRegistered):
            if p.mode == "lazy":
                due = f", forced at {p.deadline.isoformat()}" if p.deadline else ""
                reasons.append(f"{p.version_id} pending (lazy): it rides on the job's next restart{due}")
        elif isinstance(p, TimerTicked):
            pending = job.pending_version
            if (pending is not None and pending.mode == "lazy" and pending.deadline is not None
                    and p.now >= pending.deadline and not job.requested):
                reasons.append(f"lazy {pending.version_id}: its deadline {pending.deadline.isoformat()} passed with "
                               f"no restart to ride on")
        rollout = self._rollout(job, event)
        if rollout is not None:
            proposals.append(Proposal(rollout, subject=subject, key=f"rollout/{rollout.version_id}"))
            reasons.append(rollout.reason)
        stable = self._stable(job, event)
        if stable is not None:
            proposals.append(Proposal(stable, subject=subject, key=f"stable/{stable.version_id}"))
            reasons.append(stable.reason)
        return Decision(reason="; ".join(reasons) or f"{event.type}: nothing to decide", proposals=tuple(proposals))

    def _rollout(self, job: JobCode, event: Event) -> CodeRolloutRequested | None:
        """A rollout to ask for now: the pending version is urgent or past its deadline, none is asked for
        already, and none is in flight."""
        pending = job.pending_version
        if pending is None or job.requested or pending.version_id in job.rolled_back:
            return None
        now = job.received_at(event)
        if pending.mode == "urgent":
            trigger, why = "urgent", f"urgent deploy of {pending.version_id} by {pending.by}"
        elif pending.deadline is not None and now >= pending.deadline:
            trigger, why = "deadline", (f"lazy {pending.version_id} (deployed by {pending.by}) reached its deadline "
                                        f"{pending.deadline.isoformat()} with no restart to ride on")
        else:
            return None
        if job.in_flight:
            return None  # one rollout at a time: asked again once the one in flight is applied
        return CodeRolloutRequested(version_id=pending.version_id, trigger=trigger,
                                    reason=f"{why}{': ' + pending.why if pending.why else ''}; restart onto it now")

    def _stable(self, job: JobCode, event: Event) -> CodeVersionStable | None:
        if job.window_step is None or job.window_at is None or job.current in job.stable or job.in_flight \
                or job.incident_open:
            return None
        now = job.received_at(event)
        steps = max(0, job.last_step - job.window_step)
        ran = max(0.0, (now - job.window_at).total_seconds())
        policy = self.policy
        if steps >= policy.stable_steps:
            why = f"{steps} steps (>= {policy.stable_steps})"
        elif ran >= policy.stable_time.total_seconds():
            why = f"{ran:.0f} s (>= {policy.stable_time.total_seconds():g} s)"
        else:
            return None
        return CodeVersionStable(version_id=job.current, steps=steps, ran_s=ran,
                                 reason=f"{job.current} ran {why} since step {job.window_step} without an incident "
                                        f"it could have caused: stable (a rollback target)")

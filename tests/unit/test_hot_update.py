"""Hot-update's rollout policy and the controller carrying it out, pure: both deciders on one log.

``Stack`` is the controller test's ``Job`` with hot-update beside it: every input and every decision of
either decider is fed to the other, as the bus would, and time is only ever the events' (TimerTicked
from the controller's clock, the events' occurred_at).
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import timedelta

from keel.controller.decider import ControllerDecider
from keel.events.envelope import Event, EventPayload
from keel.events.types import LAUNCH_VERSION, CodeVersionApplied, CodeVersionRegistered
from keel.hot_update.core import HotUpdateDecider, HotUpdatePolicy
from keel.kernel.decider import DeciderSession
from keel.kernel.replay import verify
from keel.rules.code import version_id_of
from tests.unit.test_controller import Job, of, types

DIGESTS: dict[str, str] = {}
"""Version id -> digest of the versions the tests deploy (a registration names a real-looking digest)."""


def vid(name: str) -> str:
    digest = f"sha256:{hashlib.sha256(name.encode()).hexdigest()}"
    DIGESTS[version_id_of(digest)] = digest
    return version_id_of(digest)


V1, V2, V3, OLD, NEW, BAD, VA, VB, MIX, HOTFIX = (vid(name) for name in (
    "v1", "v2", "v3", "old", "new", "bad", "a", "b", "mix", "hotfix"))
POLICY = HotUpdatePolicy(stable_steps=50, stable_time=timedelta(minutes=10))
ERR = "KeyError: 'lm_head'"


class Stack(Job):
    def __init__(self, policy: HotUpdatePolicy = POLICY, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.hot = DeciderSession(HotUpdateDecider(policy))
        super().__init__(**kwargs)

    def feed(self, payload: EventPayload, subject: str, *, producer: str = "node-agent", dt: float = 0.1,
             correlation: uuid.UUID | None = None) -> list[Event]:
        emitted = super().feed(payload, subject, producer=producer, dt=dt, correlation=correlation)
        out = list(emitted)
        queue = [self.log[-len(emitted) - 1], *emitted]
        while queue:
            result = self.hot.observe(queue.pop(0))
            for decided in result.emitted:
                self.log.append(decided)
                out.append(decided)
                answer = self.session.observe(decided).emitted
                self.log.extend(answer)
                out.extend(answer)
                queue.extend(answer)
        return out

    def deploy(self, version: str, mode: str = "lazy", deadline_s: float | None = 3600.0) -> list[Event]:
        deadline = self.now + timedelta(seconds=deadline_s) if mode == "lazy" and deadline_s is not None else None
        digest = DIGESTS[version]
        return self.feed(CodeVersionRegistered(version_id=version, digest=digest, source=f"/src/{version}",
                                               source_kind="directory", path=f"/versions/{digest[7:]}", entry=["train.py"],
                                               mode=mode, deadline=deadline, by="ana", why="new data mix"),  # type: ignore[arg-type]
                         f"code/{version}", producer="cli")

    def applied(self, version: str, generation: int | None = None) -> list[Event]:
        out: list[Event] = []
        for node in self.nodes:
            out += self.feed(CodeVersionApplied(node_id=node, version_id=version, generation=generation or self.generation),
                             f"node/{node}", producer="agent")
        return out

    def later(self, seconds: float, step: int) -> list[Event]:
        """``seconds`` pass with the job stepping (heartbeats just before the tick: no node is silent)."""
        self.now += timedelta(seconds=seconds)
        return self.heartbeats(step=step) + self.tick(0)

    def code(self):  # type: ignore[no-untyped-def]
        return self.hot.state.job("job1")


def commands(events: list[Event]) -> list[Event]:
    return of(events, "RanksRestartRequested") + of(events, "StandbyPromotionRequested")


def test_a_lazy_version_waits_then_rides_on_the_next_failure_restart() -> None:
    stack = Stack()
    out = stack.deploy(V1)
    assert of(out, "CodeRolloutRequested") == [] and of(out, "RestartDecided") == []
    assert stack.session.state.job("job1").code_pending == V1
    first = stack.crash("n0", 1, classification="user_code", err=ERR)
    [restart] = of(first, "RestartDecided")
    assert restart.payload.code_version == V1 and restart.payload.code_changed and restart.payload.rung == 2
    assert f"start on code version {V1} (was launch)" in restart.payload.reason
    assert {(c.payload.code.version_id, c.payload.code.path, tuple(c.payload.code.entry)) for c in commands(first)} \
        == {(V1, f"/versions/{DIGESTS[V1][7:]}", ("train.py",))}
    assert stack.code().in_flight == V1 and stack.code().pending == ""
    stack.restart(first, restore_step=18, step=19)
    stack.applied(V1)
    assert stack.code().current == V1 and stack.code().in_flight == ""
    # The next failure keeps the code: its commands still name v1 (a promoted standby must run it too).
    stack.heartbeats(step=40)
    second = stack.health("n2")
    [restart] = of(second, "RestartDecided")
    assert restart.payload.code_version == "" and not restart.payload.code_changed
    assert {c.payload.code.version_id for c in commands(second)} == {V1}
    assert of(second, "StandbyPromotionRequested")


def test_an_urgent_version_is_a_planned_restart_now_that_is_no_failure() -> None:
    stack = Stack()
    out = stack.deploy(V2, mode="urgent")
    assert types(out)[:3] == ["CodeRolloutRequested", "IncidentOpened", "RestartDecided"], types(out)
    [request] = of(out, "CodeRolloutRequested")
    assert request.payload.trigger == "urgent" and request.producer == "hot-update"
    [opened] = of(out, "IncidentOpened")
    [restart] = of(out, "RestartDecided")
    assert opened.payload.kind == "code_update" and opened.payload.fingerprint == f"code_update/{V2}"
    assert restart.payload.rung == 0 and restart.payload.code_version == V2 and not restart.payload.rollback
    assert sorted(c.payload.node_id for c in of(out, "RanksRestartRequested")) == stack.nodes
    assert {c.payload.code.version_id for c in commands(out)} == {V2}
    assert not of(out, "DiagnosticsRequested") and not of(out, "NodeEvictionDecided")
    assert stack.session.state.job("job1").crash_loop.fingerprints == ()  # planned: not counted as a failure
    resolved = stack.restart(out, restore_step=20, step=21)
    [done] = of(resolved, "IncidentResolved")
    assert done.payload.outcome == "recovered" and done.payload.rung == 0 and f"moved from launch to {V2}" in done.payload.reason


def test_a_lazy_version_with_no_failure_is_forced_at_its_deadline_from_recorded_time() -> None:
    stack = Stack()
    stack.deploy(V3, deadline_s=24 * 3600)
    assert of(stack.later(12 * 3600, step=21), "CodeRolloutRequested") == []
    assert of(stack.later(12 * 3600 - 60, step=22), "RestartDecided") == []
    out = stack.later(61, step=23)
    [request] = of(out, "CodeRolloutRequested")
    assert request.payload.trigger == "deadline" and "reached its deadline" in request.payload.reason
    [restart] = of(out, "RestartDecided")
    assert restart.payload.code_version == V3 and restart.payload.rung == 0
    # Asked once: later ticks while it is in flight ask nothing more.
    assert of(stack.later(5, step=23), "CodeRolloutRequested") == []


def test_at_most_one_rollout_in_flight_the_next_waits_until_the_first_is_applied() -> None:
    stack = Stack()
    first = stack.deploy(VA, mode="urgent")
    assert of(first, "RestartDecided")[0].payload.code_version == VA
    out = stack.deploy(VB, mode="urgent")
    assert of(out, "CodeRolloutRequested") == [] and of(out, "RestartDecided") == []
    assert stack.code().pending == VB and stack.code().in_flight == VA
    # VA runs: VB is asked for now, and the controller rolls it out once a's incident is over.
    out = stack.applied(VA, generation=1)
    assert [r.payload.version_id for r in of(out, "CodeRolloutRequested")] == [VB]
    assert of(out, "RestartDecided") == []
    out = stack.restart(first, restore_step=20, step=21)
    assert types(out)[:3] == ["IncidentResolved", "IncidentOpened", "RestartDecided"], types(out)
    assert of(out, "RestartDecided")[0].payload.code_version == VB


def test_a_newer_lazy_version_supersedes_the_pending_one() -> None:
    stack = Stack()
    stack.deploy(OLD)
    stack.deploy(NEW)
    [restart] = of(stack.crash("n1", 2, classification="user_code", err=ERR), "RestartDecided")
    assert restart.payload.code_version == NEW
    assert stack.code().pending == "" and stack.session.state.job("job1").code_pending == ""


def test_a_version_becomes_stable_after_steps_without_an_incident_and_rung4_rolls_back_to_it() -> None:
    stack = Stack()
    stack.heartbeats(step=40)
    out = stack.heartbeats(step=75)  # the window opened at step 20
    [stable] = of(out, "CodeVersionStable")
    assert stable.payload.version_id == LAUNCH_VERSION and stable.payload.steps == 55
    assert stack.session.state.job("job1").code_stable == LAUNCH_VERSION
    # A bad version rides on a crash, then fails twice the same way with no progress: rung 4.
    stack.deploy(BAD)
    out = stack.crash("n3", 6)  # an infrastructure crash: rung 2 diagnostics, then the restart carries BAD
    [request] = of(out, "DiagnosticsRequested")
    for node in stack.nodes[:-1]:
        stack.diagnostics(node, request)
    out = stack.diagnostics(stack.nodes[-1], request)
    assert of(out, "RestartDecided")[0].payload.code_version == BAD
    stack.restart(out, restore_step=74, step=76)
    stack.applied(BAD)
    stack.heartbeats(step=80)
    first = stack.crash("n0", 1, classification="user_code", err=ERR)
    assert of(first, "RestartDecided")[0].payload.code_version == ""  # rung 2, the same code
    stack.restart(first, restore_step=80, step=81)
    second = stack.crash("n0", 1, classification="user_code", err=ERR)
    [rollback] = of(second, "RollbackDecided")
    [restart] = of(second, "RestartDecided")
    assert rollback.payload.to_version == LAUNCH_VERSION and f"from {BAD} to launch" in rollback.payload.reason
    assert restart.payload.rung == 4 and restart.payload.rollback and restart.payload.code_version == LAUNCH_VERSION
    assert {(c.payload.code.version_id, c.payload.code.path) for c in commands(second)} == {(LAUNCH_VERSION, "")}
    assert BAD not in stack.code().stable and stack.code().rolled_back == frozenset({BAD})
    out = stack.restart(second, restore_step=80, step=81)
    [resolved] = of(out, "IncidentResolved")
    assert f"rolled back from {BAD} to launch and that resolved it: the cause was the user's code" in resolved.payload.reason
    # Replays of the whole log decide exactly the same, for both deciders.
    for decider in (ControllerDecider(), HotUpdateDecider(POLICY)):
        report = verify(decider, stack.log)
        assert report.clean, [d.describe() for d in report.divergences]


def test_a_version_stable_before_its_bug_shows_is_rolled_back_to_the_stable_version_before_it() -> None:
    # A new data mix runs cleanly long enough to be called stable, then hits its bug at a later step: the
    # same failure twice points at it, so rung 4 goes back to the stable version before it (the demo's case).
    stack = Stack()
    stack.heartbeats(step=75)
    stack.deploy(MIX)
    out = stack.crash("n3", 6)
    [request] = of(out, "DiagnosticsRequested")
    for node in stack.nodes:
        out = stack.diagnostics(node, request)
    stack.restart(out, restore_step=74, step=76)
    stack.applied(MIX)
    stack.heartbeats(step=80)  # its stability window opens here
    [stable] = of(stack.heartbeats(step=140), "CodeVersionStable")
    assert stable.payload.version_id == MIX and stack.session.state.job("job1").code_stables == (LAUNCH_VERSION, MIX)
    first = stack.crash("n0", 1, classification="user_code", err=ERR)
    stack.restart(first, restore_step=140, step=141)
    second = stack.crash("n0", 1, classification="user_code", err=ERR)
    [rollback] = of(second, "RollbackDecided")
    assert rollback.payload.to_version == LAUNCH_VERSION, rollback.payload
    assert f"from {MIX} (stable until now) to launch" in rollback.payload.reason
    assert of(second, "RestartDecided")[0].payload.code_version == LAUNCH_VERSION


def test_stability_also_comes_with_time_and_an_incident_restarts_the_window() -> None:
    stack = Stack(policy=HotUpdatePolicy(stable_steps=10_000, stable_time=timedelta(minutes=10)))
    first = stack.crash("n0", 1, classification="user_code", err=ERR)
    assert of(stack.tick(9 * 60), "CodeVersionStable") == []  # the crash closed the window
    stack.restart(first, restore_step=18, step=19)
    stack.heartbeats(step=25)  # the window opens again here
    assert of(stack.later(9 * 60, step=26), "CodeVersionStable") == []
    [stable] = of(stack.later(61, step=27), "CodeVersionStable")
    assert stable.payload.version_id == LAUNCH_VERSION and stable.payload.ran_s >= 600


def test_with_no_stable_version_rung4_restarts_the_same_code() -> None:
    stack = Stack()
    first = stack.crash("n0", 1, classification="user_code", err=ERR)
    stack.restart(first, restore_step=18, step=19)
    second = stack.crash("n0", 1, classification="user_code", err=ERR)
    [rollback] = of(second, "RollbackDecided")
    assert rollback.payload.to_version == "" and "no code version is known to be stable" in rollback.payload.reason
    assert all(c.payload.code is None for c in commands(second))


def test_an_urgent_version_deployed_during_an_incident_rides_on_its_restart_without_a_second_one() -> None:
    stack = Stack()
    out = stack.crash("n1", 2)  # infrastructure: rung 2 diagnostics first
    [request] = of(out, "DiagnosticsRequested")
    out = stack.deploy(HOTFIX, mode="urgent")
    assert of(out, "CodeRolloutRequested") and of(out, "RestartDecided") == []
    for node in stack.nodes[:-1]:
        stack.diagnostics(node, request)
    out = stack.diagnostics(stack.nodes[-1], request)
    [restart] = of(out, "RestartDecided")
    assert restart.payload.rung == 2 and restart.payload.code_version == HOTFIX
    resolved = stack.restart(out, restore_step=18, step=19)
    assert types(resolved) == ["IncidentResolved"]  # the rollout it asked for is done: no second restart
    assert stack.session.state.job("job1").rollout_due == ""


def test_a_rolled_back_version_is_never_applied_again() -> None:
    stack = Stack()
    stack.heartbeats(step=80)  # launch is stable (window from step 20)
    stack.deploy(BAD)
    first = stack.crash("n0", 1, classification="user_code", err=ERR)
    assert of(first, "RestartDecided")[0].payload.code_version == BAD
    stack.restart(first, restore_step=79, step=80)
    second = stack.crash("n0", 1, classification="user_code", err=ERR)  # the same failure again: rung 4
    assert of(second, "RollbackDecided")[0].payload.to_version == LAUNCH_VERSION
    stack.restart(second, restore_step=79, step=81)
    stack.heartbeats(step=90)
    # The same content deployed again is the same version: refused at every later restart.
    out = stack.deploy(BAD, mode="urgent")
    assert of(out, "CodeRolloutRequested") == []
    later = stack.health("n2")
    assert of(later, "RestartDecided")[0].payload.code_version == ""
    assert {c.payload.code.version_id for c in commands(later)} == {LAUNCH_VERSION}


def test_a_registration_naming_code_outside_the_store_is_rejected_by_hot_update_and_never_carried() -> None:
    """The deploying client's checks are not trusted: a registration whose folder is not named by its digest,
    whose id is not its digest's or whose entry point leaves the version is answered with CodeVersionRejected
    by hot-update; neither decider makes it pending, so no restart ever carries it."""
    stack = Stack()
    digest = DIGESTS[V1]
    forged = [
        {"path": "/home/eve/payload"},
        {"entry": ["/bin/sh"]},
        {"entry": ["-m", "os;id"]},
        {"version_id": "v-stable"},
    ]
    for change in forged:
        fields = {"version_id": V1, "digest": digest, "source": "/src/x", "source_kind": "directory",
                  "path": f"/versions/{digest[7:]}", "entry": ["train.py"], "mode": "urgent", "by": "eve", **change}
        out = stack.feed(CodeVersionRegistered(**fields), "code/x", producer="cli")  # type: ignore[arg-type]
        [rejected] = of(out, "CodeVersionRejected")
        assert rejected.producer == "hot-update" and rejected.payload.by == "eve"
        assert rejected.payload.reason.startswith("hot-update refused the registration: ")
        assert not of(out, "CodeRolloutRequested") and not of(out, "RestartDecided")
        assert stack.code().pending == "" and stack.session.state.job("job1").code_pending == ""
    # A failure afterwards restarts the launch code: nothing forged rides on it.
    first = stack.crash("n0", 1, classification="user_code", err=ERR)
    [restart] = of(first, "RestartDecided")
    assert restart.payload.code_version == "" and not restart.payload.code_changed

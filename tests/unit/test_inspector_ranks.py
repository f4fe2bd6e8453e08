"""Rank hang detection with per-phase timeouts calibrated from observed step times (a hang is never declared
during setup, checkpoints or eval just because they are slow)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from keel.agent.inspector import InspectorCore, InspectorPolicy, RankProbe, RankView, phase_timeout, step_timeout
from keel.agent.inspector.ranks import LIVENESS_CHECKS, collective_timeout, normalise_phase, percentile

T0 = datetime(2026, 11, 29, 7, 0, tzinfo=UTC)
POLICY = InspectorPolicy()


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def view(phase: str, *, report: float, progress: float, step_times=(), step: int = 10, alive: bool = True) -> RankView:
    return RankView(rank=3, pid=4242, alive=alive, phase=phase, step=step, last_report_at=at(report),
                    last_progress_at=at(progress), step_times=tuple(step_times), started_at=T0)


def test_calibration() -> None:
    assert step_timeout([], POLICY)[0] == POLICY.setup_timeout            # first step gets the setup timeout
    assert step_timeout([20.0, 1.0], POLICY)[0] == POLICY.setup_timeout   # still warming up
    assert step_timeout([1.0] * 50, POLICY)[0] == timedelta(seconds=25)   # floor
    one_outlier = [12.0] * 99 + [15.0]  # nearest-rank p99 of 100 samples ignores the single worst one
    assert step_timeout(one_outlier, POLICY)[0] == timedelta(seconds=36)
    timeout, how = step_timeout([12.0] * 98 + [15.0] * 2, POLICY)
    assert timeout == timedelta(seconds=45) and "3 x p99" in how
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([5.0], 99) == 5.0
    # only the last calibration_window step times count
    assert step_timeout([100.0] * 10 + [1.0] * 100, POLICY)[0] == timedelta(seconds=25)


def test_phase_timeouts() -> None:
    assert phase_timeout(view("setup", report=0, progress=0), POLICY)[0] == timedelta(seconds=300)
    assert phase_timeout(view("checkpoint", report=0, progress=0), POLICY)[0] == timedelta(seconds=600)
    assert phase_timeout(view("PHASE_EVAL", report=0, progress=0), POLICY)[0] == timedelta(seconds=600)
    assert phase_timeout(view("done", report=0, progress=0), POLICY)[0] is None
    assert normalise_phase("PHASE_CHECKPOINT") == "checkpoint" and normalise_phase("weird") == "unspecified"


def test_no_false_hang_during_a_long_checkpoint_or_eval() -> None:
    probe, core = RankProbe(POLICY), InspectorCore("n1", POLICY)
    steps = [2.0] * 20
    state, emitted = core.initial_state(), []
    # steady steps, then an eval of 8 minutes and a checkpoint of 9 minutes with no reports at all
    for t in range(0, 40, 2):
        state, ev = core.step(state, probe.collect([view("step", report=t, progress=t, step_times=steps)], at(t)), at(t))
        emitted += ev
    for t in range(40, 520, 20):
        state, ev = core.step(state, probe.collect([view("eval", report=40, progress=40, step_times=steps)], at(t)), at(t))
        emitted += ev
    for t in range(520, 1060, 20):
        state, ev = core.step(state, probe.collect([view("checkpoint", report=520, progress=520, step_times=steps)], at(t)), at(t))
        emitted += ev
    assert emitted == []


def test_no_false_hang_on_a_slow_first_step() -> None:
    probe = RankProbe(POLICY)
    obs = probe.collect([view("step", report=0, progress=0, step_times=[], step=0)], at(240))
    assert all(o.status == "healthy" for o in obs)


def test_done_and_exited_ranks_never_hang() -> None:
    probe = RankProbe(POLICY)
    assert all(o.status == "healthy" for o in probe.collect([view("done", report=0, progress=0)], at(10_000)))
    assert all(o.status == "healthy" for o in probe.collect([view("step", report=0, progress=0, alive=False)], at(10_000)))


def test_real_stall_after_steady_steps_fails_with_evidence() -> None:
    probe, core = RankProbe(POLICY), InspectorCore("n1", POLICY)
    steps = [2.0] * 30  # 3 x p99 = 6 s < floor: timeout 25 s
    state, emitted = core.initial_state(), []
    for t in range(60, 100):  # reports keep coming (a background heartbeat), the step does not move
        state, ev = core.step(state, probe.collect([view("step", report=t, progress=60, step_times=steps)], at(t)), at(t))
        emitted += [(t, e) for e in ev]
    [(t, event)] = emitted
    assert t == 86 and event.component == "rank" and event.check == "no_progress"
    assert (event.status, event.confidence, event.is_fatal) == ("failed", "medium", False)
    assert {k: event.evidence[k] for k in ("rank", "phase", "silent_for_s", "timeout_s")} == {
        "rank": 3, "phase": "step", "silent_for_s": 26.0, "timeout_s": 25.0}


def test_heartbeat_lost_when_reports_stop() -> None:
    probe = RankProbe(POLICY)
    steps = [2.0] * 30
    obs = {o.check: o for o in probe.collect([view("step", report=0, progress=0, step_times=steps)], at(61))}
    assert obs["heartbeat_lost"].status == "failed" and obs["heartbeat_lost"].evidence["timeout_s"] == 60.0
    assert obs["no_progress"].status == "failed"
    obs = {o.check: o for o in probe.collect([view("step", report=0, progress=0, step_times=steps)], at(45))}
    assert obs["heartbeat_lost"].status == "healthy" and obs["no_progress"].status == "failed"


def test_stall_in_checkpoint_beyond_its_timeout_is_a_hang_and_recovers() -> None:
    probe, core = RankProbe(POLICY), InspectorCore("n1", POLICY)
    state, _ = core.step(core.initial_state(), probe.collect([view("checkpoint", report=0, progress=0)], at(599)), at(599))
    state, events = core.step(state, probe.collect([view("checkpoint", report=0, progress=0)], at(601)), at(601))
    assert [(e.check, e.status) for e in events] == [("heartbeat_lost", "failed"), ("no_progress", "failed")]
    # it comes back: healthy after the recovery hold
    state, events = core.step(state, probe.collect([view("step", report=602, progress=602, step_times=[2.0] * 5)], at(602)), at(602))
    assert events == []
    state, events = core.step(state, probe.collect([view("step", report=632, progress=632, step_times=[2.0] * 5)], at(632)), at(632))
    assert [(e.check, e.status) for e in events] == [("heartbeat_lost", "healthy"), ("no_progress", "healthy")]


# -- inside a collective (Session.waiting) and stopped processes ---------------------------------------

WAITS = [0.05] * 40 + [0.4] * 2  # the per-step longest waits of a steady job: p99 0.4 s


def in_collective(phase: str, *, entered: float, waits=WAITS, step: int = 10, stopped: float | None = None) -> RankView:
    return RankView(rank=3, pid=4242, alive=True, phase=phase, step=step, last_report_at=at(entered + 100),
                    last_progress_at=at(entered), step_times=(0.5,) * 40, started_at=T0, collective="dp_all_reduce",
                    collective_entered_at=at(entered), collective_waits=tuple(waits),
                    stopped_since=None if stopped is None else at(stopped))


def checks(view_: RankView, now: float) -> dict[str, object]:
    return {o.check: o for o in RankProbe(POLICY).collect([view_], at(now))}


def test_collective_timeout_is_five_times_the_p99_wait_with_a_five_second_floor() -> None:
    assert collective_timeout([], POLICY)[0] == POLICY.setup_timeout          # warm-up: the first steps compile
    assert collective_timeout([0.1, 0.2], POLICY)[0] == POLICY.setup_timeout
    assert collective_timeout(WAITS, POLICY) == (timedelta(seconds=5), "floor (p99 collective wait 0.4s)")
    timeout, how = collective_timeout([2.0] * 50, POLICY)
    assert timeout == timedelta(seconds=10) and how == "5 x p99 collective wait 2s"


def test_a_rank_stuck_inside_a_collective_hangs_after_the_collective_timeout_not_the_step_timeout() -> None:
    assert checks(in_collective("step", entered=0), 4.9)["collective_stuck"].status == "healthy"
    stuck = checks(in_collective("step", entered=0), 5.1)["collective_stuck"]
    assert (stuck.status, stuck.confidence, stuck.is_fatal, stuck.immediate) == ("failed", "medium", False, True)
    assert {k: stuck.evidence[k] for k in ("collective", "waited_s", "timeout_s", "rank")} == {
        "collective": "dp_all_reduce", "waited_s": 5.1, "timeout_s": 5.0, "rank": 3}
    assert "dp_all_reduce" in stuck.detail and "5.0s" in stuck.detail
    # the step timeout's floor (25 s) has not run out: no_progress is still healthy
    assert checks(in_collective("step", entered=0), 5.1)["no_progress"].status == "healthy"


def test_no_false_collective_hang_in_evals_checkpoints_first_steps_or_loader_stalls() -> None:
    # a 60 s eval and a 60 s checkpoint save that a rank waits for inside the phase
    assert checks(in_collective("eval", entered=0), 60)["collective_stuck"].status == "healthy"
    assert checks(in_collective("checkpoint", entered=0), 60)["collective_stuck"].status == "healthy"
    # a 90 s first step (compilation): no waits known yet, so the setup timeout applies
    assert checks(in_collective("step", entered=0, waits=[], step=-1), 90)["collective_stuck"].status == "healthy"
    # a 3 s data-loader stall on a peer: this rank waits 3 s in the all-reduce
    assert checks(in_collective("step", entered=0), 3.0)["collective_stuck"].status == "healthy"


def test_a_stopped_process_hangs_after_the_stopped_timeout() -> None:
    assert checks(in_collective("step", entered=0, stopped=1.0), 3.9)["process_stopped"].status == "healthy"
    stopped = checks(in_collective("step", entered=0, stopped=1.0), 4.0)["process_stopped"]
    assert stopped.status == "failed" and stopped.evidence["stopped_s"] == 3.0 and "SIGSTOP" in stopped.detail
    assert checks(in_collective("step", entered=0), 4.0)["process_stopped"].status == "healthy"


def test_an_exited_rank_clears_every_liveness_check() -> None:
    gone = RankView(rank=3, pid=4242, alive=False, phase="step", step=10, last_report_at=at(0), last_progress_at=at(0),
                    collective="dp_all_reduce", collective_entered_at=at(0), collective_waits=tuple(WAITS),
                    stopped_since=at(0))
    observed = RankProbe(POLICY).collect([gone], at(1000))
    assert {o.check for o in observed} == set(LIVENESS_CHECKS) and all(o.status == "healthy" for o in observed)

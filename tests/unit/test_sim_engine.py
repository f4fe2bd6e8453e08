"""keel.sim's engine drives the real controller: its decisions (rungs, evictions, promotions) come from the
decider, and the log it records replays clean through ``keel.kernel.replay.verify``."""

from __future__ import annotations

import json
import re
from collections import Counter

from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.kernel.replay import verify
from keel.sim.config import load_calibration
from keel.sim.engine import HEARTBEAT_EVERY_S, VARIANTS, KeelSim
from keel.sim.metrics import summarise
from keel.sim.trace import Failure, Trace

DAY_S = 86400.0


def _run(failures: tuple[Failure, ...], variant: str = "keel", nodes: int = 16,
         standby_min: int = 1) -> tuple[KeelSim, object]:
    # The binomial model gives a 16-machine job no standby: keep some, as bench/recovery.py does
    trace = Trace(nodes=nodes, horizon_s=DAY_S, failures=failures)
    sim = KeelSim(trace, load_calibration(), variant=VARIANTS[variant], seed=1, record=True,
                  policy=ControllerPolicy(standby_min=standby_min))
    return sim, sim.run()


def test_a_lost_gpu_is_evicted_at_rung_1_and_a_standby_takes_its_ranks() -> None:
    sim, result = _run((Failure(3600.0, "gpu_lost", "gpu_lost", (3,), repair_s=DAY_S),))
    types = Counter(e.type for e in sim.log)
    assert result.incidents_by_rung == {"rung1": 1}  # type: ignore[attr-defined]
    assert types["NodeEvictionDecided"] == 1 and types["StandbyPromotionRequested"] == 1
    assert sim.rank_of.get("n00003") is None and sim.node_of_rank[3].startswith("s")
    lost = summarise(result.losses, DAY_S)  # type: ignore[attr-defined]
    assert 0 < lost.lost_h < 0.05 and lost.lost_h_by_phase.keys() >= {"detection", "restart"}


def test_a_crash_in_user_code_restarts_in_place_and_a_bad_deploy_is_rolled_back_at_rung_4() -> None:
    sim, result = _run((Failure(3600.0, "user_code", "user_code", (2,)),
                        Failure(7200.0, "bad_deploy", "bad_deploy", ())))
    rungs = result.incidents_by_rung  # type: ignore[attr-defined]
    assert rungs.get("rung2", 0) >= 2 and rungs.get("rung4") == 1, rungs
    assert not any(e.type == "NodeEvictionDecided" for e in sim.log)


def test_a_hang_is_captured_and_its_pipeline_group_evicted_without_the_analyzer_diagnosed() -> None:
    # 96 machines: evicting a pipeline group of 8 stays within the eviction breaker's 10 %
    sim, result = _run((Failure(3600.0, "hang", "hang", (5,)),), nodes=96, standby_min=8)
    assert result.incidents_by_rung == {"rung3": 1}  # type: ignore[attr-defined]
    assert result.evicted_nodes == 8 and result.over_evicted_nodes == 7  # type: ignore[attr-defined]
    sim, result = _run((Failure(3600.0, "hang", "hang", (5,)),), variant="keel_no_analyzer", nodes=96, standby_min=8)
    types = Counter(e.type for e in sim.log)
    assert types["StacksRequested"] == 0 and types["DiagnosticsRequested"] >= 1


def test_without_memory_checkpoints_more_is_lost() -> None:
    failures = tuple(Failure(3600.0 * h + 1500, "gpu_lost", "gpu_lost", (h,), repair_s=DAY_S) for h in (1, 5, 9))
    _, keel = _run(failures)
    _, ablated = _run(failures, variant="keel_no_memory_ckpt")
    assert summarise(ablated.losses, DAY_S).lost_h > 3 * summarise(keel.losses, DAY_S).lost_h  # type: ignore[attr-defined]


def test_the_recorded_log_replays_to_the_same_decisions() -> None:
    sim, _ = _run((Failure(3600.0, "gpu_lost", "gpu_lost", (3,), repair_s=DAY_S),
                   Failure(9000.0, "nic_flap", "nic_flap", (4,)), Failure(20000.0, "hang", "hang", (9,))))
    report = verify(ControllerDecider(sim.policy), sim.log)
    assert report.decisions_recorded > 20 and report.clean, report.details()


class _EveryHeartbeat(KeelSim):
    """The simulator as it was: every machine of the job heartbeats every 25 s while the clock ticks."""

    next_every_s = 0.0

    def _heartbeat_round(self, job: object) -> None:
        if self.now_s >= self.next_every_s:
            self.next_every_s = self.now_s + HEARTBEAT_EVERY_S
            self._heartbeats()

    def _start_clock(self) -> None:
        if not self.ticking and not self.stopped:
            self.next_every_s = self.now_s
        super()._start_clock()


def _decisions(sim: KeelSim) -> list[tuple[str, str, str]]:
    """The controller's decisions, their ids and the ids they quote left out (the inputs' ids differ with how
    many inputs there were); a fenced node's heartbeat noted (``NodeFenced``) is the every-heartbeat run's own."""
    out = []
    for event in sim.log:
        if event.producer == "controller" and event.type != "NodeFenced":
            body = json.dumps(event.payload.model_dump(mode="json"), sort_keys=True)
            out.append((event.type, event.occurred_at.isoformat(), _HEX.sub("<id>", body)))
    return out


_HEX = re.compile(r"[0-9a-f]{8}(-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})?")


def test_heartbeats_fed_only_to_machines_unheard_for_25_s_give_the_decisions_every_heartbeat_gives() -> None:
    # A host that dies, a lost GPU, a hang captured, a NaN replayed, a crash: rounds with acknowledgements,
    # restarts, recoveries, each long enough for the 30 s silence rule to matter.
    failures = (Failure(3600.0, "host_crash", "host_lost", (3,), repair_s=DAY_S),
                Failure(9000.0, "gpu_lost", "gpu_lost", (4,), repair_s=DAY_S),
                Failure(20000.0, "hang", "hang", (9,), repair_s=DAY_S),
                Failure(30000.0, "sdc", "sdc", (12,), repair_s=DAY_S),
                Failure(40000.0, "user_code", "user_code", (20,)))
    # Without memory checkpoints a recovery restores for minutes: the silence rule judges every machine then.
    for variant in ("keel", "keel_no_memory_ckpt"):
        runs = []
        for cls in (_EveryHeartbeat, KeelSim):
            sim = cls(Trace(nodes=96, horizon_s=DAY_S, failures=failures), load_calibration(),
                      variant=VARIANTS[variant], seed=3, record=True, policy=ControllerPolicy(standby_min=8))
            runs.append((sim, sim.run()))
        (every, every_result), (fed, fed_result) = runs
        assert fed.events < every.events, (variant, fed.events, every.events)
        assert len(_decisions(every)) > 50 and _decisions(fed) == _decisions(every), variant
        assert every_result.losses == fed_result.losses, variant


def test_silent_data_corruption_is_located_by_the_replay_and_its_machine_evicted_with_the_clock_ticking() -> None:
    # The simulated agents register Keel's Checkpointer (the ranks' pipeline groups): rung 5 has replay units.
    sim, result = _run((Failure(3600.0, "sdc", "sdc", (13,), repair_s=DAY_S),), nodes=96, standby_min=8)
    types = Counter(e.type for e in sim.log)
    assert types["CheckpointRanksRegistered"] >= 96 and types["SdcReplayRequested"] == 1
    assert result.incidents_by_rung == {"rung5": 1} and result.job_stops == 0  # type: ignore[attr-defined]
    assert "n00013" not in sim.rank_of and result.evicted_nodes == 1  # type: ignore[attr-defined]
    # The clock ticked through the diagnostics round and the replay (their deadlines were live), not only
    # from the restart on.
    opened = next(e.occurred_at for e in sim.log if e.type == "IncidentOpened")
    restart = next(e.occurred_at for e in sim.log if e.type == "RestartDecided")
    ticks = [e.occurred_at for e in sim.log if e.type == "TimerTicked" and opened < e.occurred_at < restart]
    assert len(ticks) >= 10 and restart > opened
    lost = summarise(result.losses, DAY_S)  # type: ignore[attr-defined]
    assert lost.lost_h < 0.2 and "human" not in lost.lost_h_by_phase, lost


def test_a_fail_slow_machine_is_still_convicted_after_the_job_was_stopped_and_requeued() -> None:
    # A host crash the breaker cannot evict (max_evictions 0: the job stops, a human requeues it) while a
    # machine is slow: the analyzer convicts it in the requeued job, and its slowness ends there.
    trace = Trace(nodes=16, horizon_s=DAY_S, failures=(
        Failure(3600.0, "fail_slow", "fail_slow", (7,), slowdown=1.5, duration_s=12 * 3600.0),
        Failure(3601.0, "host_crash", "host_lost", (2,), repair_s=DAY_S)))
    sim = KeelSim(trace, load_calibration(), seed=1, policy=ControllerPolicy(standby_min=1, max_evictions=0))
    result = sim.run()
    assert result.job_stops >= 1
    slow = [loss for loss in result.losses if loss.phase == "slow"]
    assert slow and max(loss.end_s for loss in slow) < 3600.0 + 4 * 3600.0, slow

"""keel.sim's engine drives the real controller: its decisions (rungs, evictions, promotions) come from the
decider, and the log it records replays clean through ``keel.kernel.replay.verify``."""

from __future__ import annotations

import json
import re
from collections import Counter

from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.events.types import TimerTicked
from keel.kernel.replay import verify
from keel.sim.config import load_calibration
from keel.sim.engine import HEARTBEAT_EVERY_S, TICK_S, TIMED_STAGES, VARIANTS, KeelSim
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

    def _tick(self) -> None:
        if not self.ticking:
            return
        self.feed(TimerTicked(now=self.time(), interval_s=TICK_S), f"clock/{self.job_id}", "clock")
        if self.now_s >= self.next_every_s:
            self.next_every_s = self.now_s + HEARTBEAT_EVERY_S
            self._heartbeats()
        job = self.session.state.job(self.job_id)
        stage = job.incident.stage if job.incident is not None else None
        if stage not in TIMED_STAGES and self.pending_restart is None:
            self.ticking = False
            return
        self.at(self.now_s + TICK_S, self._tick)

    def _start_clock(self) -> None:
        if self.ticking or self.stopped:
            return
        self.ticking = True
        self.next_every_s = self.now_s
        self._tick()


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

"""keel.sim.run: every system of every run in worker processes gives what one process gives (the wall times
aside), and the sensitivity runs' systems are their own."""

from __future__ import annotations

from typing import Any

import pytest

from keel.sim.config import load_calibration, load_mix
from keel.sim.run import SYSTEMS, run_many


def _without_wall_times(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**run, "systems": {s: {k: v for k, v in summary.items() if k not in ("sim_wall_s", "sim_cpu_s")}
                                for s, summary in run["systems"].items()}} for run in runs]


def test_runs_spread_over_worker_processes_give_what_one_process_gives() -> None:
    mix, cal = load_mix(), load_calibration()
    plan = [(1, 1.0, SYSTEMS), (2, 1.0, SYSTEMS), (1, 4.0, ("keel", "oracle"))]
    alone = run_many(mix, cal, nodes=24, days=2.0, runs=plan, jobs=1)
    spread = run_many(mix, cal, nodes=24, days=2.0, runs=plan, jobs=2)
    assert _without_wall_times(spread) == _without_wall_times(alone)
    assert [list(r["systems"]) for r in alone] == [list(SYSTEMS), list(SYSTEMS), ["keel", "oracle"]]
    # Four times the failure rate is another trace: more failures than seed 1's own run.
    assert alone[2]["failures"] > alone[0]["failures"] and alone[0]["seed"] == alone[2]["seed"] == 1


def test_a_worker_that_fails_stops_the_run_and_says_which_system(monkeypatch: Any) -> None:
    import keel.sim.run as sim_run

    real = sim_run._task

    def failing(key: tuple[int, float, str]) -> str:
        if key[2] == "oracle":
            raise ValueError("boom")
        return real(key)

    monkeypatch.setattr(sim_run, "_task", failing)  # the forked children inherit it
    with pytest.raises(RuntimeError, match=r"simulating oracle \(seed 1, failure rates x1.0\) failed .*exit status 1"):
        run_many(load_mix(), load_calibration(), nodes=8, days=0.5, runs=[(1, 1.0, ("conventional", "oracle"))], jobs=2)

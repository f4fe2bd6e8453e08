"""keel.sim's arithmetic: traces, ETTR, the worst window, Young's interval, the baselines' cost models."""

from __future__ import annotations

import math

import pytest

from keel.sim.baselines import baseline_losses, young_interval_s
from keel.sim.config import load_calibration, load_mix
from keel.sim.metrics import Loss, summarise, worst_window_min
from keel.sim.trace import Failure, Trace, generate


def test_a_trace_is_reproducible_from_its_seed_and_scales_with_the_rate() -> None:
    mix = load_mix()
    a, b = generate(mix, nodes=1200, days=30, seed=3), generate(mix, nodes=1200, days=30, seed=3)
    assert a == b and a != generate(mix, nodes=1200, days=30, seed=4)
    # about 0.0048 failures per node-day x 36,000 node-days, plus bad deploys: ~170
    assert 120 < len(a.failures) < 240
    assert len(generate(mix.scaled(4), nodes=1200, days=30, seed=3).failures) > 3 * len(a.failures)
    assert all(0 <= n < 1200 for f in a.failures for n in f.nodes)


def test_a_correlated_failure_stays_in_its_fault_domain() -> None:
    mix = load_mix().scaled(20)
    trace = generate(mix, nodes=256, days=10, seed=1)
    multi = [f for f in trace.failures if len(f.nodes) > 1]
    assert multi, "no correlated failure drawn"
    assert all(len({n // mix.fault_domain_nodes for n in f.nodes}) == 1 for f in multi)


def test_ettr_counts_overlapping_stretches_once_and_a_slow_machine_in_part() -> None:
    horizon = 10 * 3600.0
    losses = [Loss(0, 1800, 1.0, "gpu_lost", "restart"), Loss(900, 2700, 1.0, "hang", "detection"),
              Loss(3600 * 5, 3600 * 6, 0.5, "fail_slow", "slow")]
    s = summarise(losses, horizon)
    assert s.lost_h == pytest.approx(0.75 + 0.5)
    assert s.ettr == pytest.approx(1 - 1.25 / 10)
    assert s.worst_window_min == pytest.approx(45.0)
    assert sum(s.lost_h_by_mechanism.values()) == pytest.approx(s.lost_h, abs=0.01)


def test_the_worst_window_slides() -> None:
    buckets = [0.0] * 120
    buckets[59] = buckets[60] = 60.0
    assert worst_window_min(buckets) == pytest.approx(2.0)
    buckets[0] = 60.0
    assert worst_window_min(buckets) == pytest.approx(2.0)


def test_young_interval() -> None:
    assert young_interval_s(60, 10800) == pytest.approx(math.sqrt(2 * 60 * 10800))
    with pytest.raises(ValueError):
        young_interval_s(0, 10)


def test_baselines_pay_the_hang_timeout_and_the_oracle_pays_only_the_restart() -> None:
    cal = load_calibration()
    trace = Trace(nodes=8, horizon_s=86400.0, failures=(Failure(3600.0, "hang", "hang", (1,)),))
    conventional = summarise(baseline_losses("conventional", trace, cal), trace.horizon_s)
    oracle = summarise(baseline_losses("oracle", trace, cal), trace.horizon_s)
    assert conventional.lost_h_by_phase["detection"] == pytest.approx(cal.baselines["hang_timeout_s"] / 3600, abs=0.02)
    assert "detection" not in oracle.lost_h_by_phase and oracle.lost_h < 0.02
    assert oracle.ettr > conventional.ettr
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline_losses("magic", trace, cal)

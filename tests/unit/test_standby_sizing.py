"""Warm-standby sizing against hand-computed binomial quantiles and the paper's pool sizes."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from keel.controller.standby import binomial_cdf, binomial_quantile, failure_probability, plan_standby_pool


def test_binomial_cdf_matches_hand_computed_values() -> None:
    # n = 4, p = 0.5: P(X <= 1) = (1 + 4) / 16, P(X <= 2) = 11 / 16.
    assert binomial_cdf(1, 4, 0.5) == pytest.approx(5 / 16)
    assert binomial_cdf(2, 4, 0.5) == pytest.approx(11 / 16)
    # n = 10, p = 0.1: P(X = 0) = 0.9^10.
    assert binomial_cdf(0, 10, 0.1) == pytest.approx(0.9**10)
    assert binomial_cdf(-1, 10, 0.1) == 0.0 and binomial_cdf(10, 10, 0.1) == 1.0


def test_quantile_is_the_smallest_k_reaching_it() -> None:
    # n = 4, p = 0.5: cumulative 1/16, 5/16, 11/16, 15/16, 1.
    assert binomial_quantile(4, 0.5, 0.5) == 2
    assert binomial_quantile(4, 0.5, 0.9) == 3
    assert binomial_quantile(4, 0.5, 0.99) == 4
    assert binomial_quantile(100, 0.0, 0.99) == 0
    for n, p in ((1024, 0.0012), (50, 0.03), (10_000, 0.0001)):
        k = binomial_quantile(n, p, 0.99)
        assert binomial_cdf(k, n, p) >= 0.99 > binomial_cdf(k - 1, n, p)


@pytest.mark.parametrize("p", [0.00117, 0.0012, 0.00125])
def test_the_papers_pools_follow_from_a_binomial_99th_percentile(p: float) -> None:
    # ByteRobust: 2, 2, 3 and 4 spares for 128, 256, 512 and 1,024 machines.
    assert [plan_standby_pool(n, p).size for n in (128, 256, 512, 1024)] == [2, 2, 3, 4]


def test_plan_states_its_numbers() -> None:
    plan = plan_standby_pool(1024, 0.0012)
    assert plan.size == 4 and plan.coverage >= 0.99
    assert "4 standby node(s)" in plan.reason and "1024 nodes" in plan.reason and "3 would cover only" in plan.reason


def test_failure_probability_blends_the_log_with_the_prior() -> None:
    window = timedelta(hours=2)
    # A young log: 0 failures in 10 node-hours, prior 0.001/node-hour worth 1,000 node-hours.
    young = failure_probability(0, 10, window, prior_rate_per_node_hour=0.001, prior_node_hours=1000)
    assert young == pytest.approx(-math.expm1(-(1.0 / 1010) * 2))
    # A long log with many failures outweighs the prior.
    measured = failure_probability(50, 100_000, window, prior_rate_per_node_hour=0.001, prior_node_hours=1000)
    assert measured == pytest.approx(-math.expm1(-(51.0 / 101_000) * 2))
    assert measured < young * 1.01


@pytest.mark.parametrize("args", [
    (-1, 10, timedelta(hours=1)), (0, -5, timedelta(hours=1)), (0, 10, timedelta(0)),
])
def test_bad_inputs_are_refused_clearly(args: tuple) -> None:
    with pytest.raises(ValueError):
        failure_probability(*args, prior_rate_per_node_hour=0.001, prior_node_hours=100)
    with pytest.raises(ValueError, match="unknown"):
        failure_probability(0, 0, timedelta(hours=1), prior_rate_per_node_hour=0.001, prior_node_hours=0)
    with pytest.raises(ValueError):
        binomial_quantile(10, 0.1, 1.0)
    with pytest.raises(ValueError):
        binomial_cdf(1, 10, 1.5)

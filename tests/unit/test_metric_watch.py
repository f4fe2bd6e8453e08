"""The agent's metric watch: the analyzer's checks on each rank's recent steps, each anomaly reported
once per rank, kind and metric per generation, with a JSON-safe value."""

from __future__ import annotations

import math

from keel.agent.metric_watch import MetricWatch
from keel.rules.metrics import MetricSample


def steps(n: int, *, start: int = 0, loss: float = 2.0, tokens: float = 1000.0) -> list[MetricSample]:
    return [MetricSample(step=s, loss=loss - 0.001 * s, grad_norm=1.0, tokens_per_s=tokens, rank=3)
            for s in range(start, start + n)]


def test_a_nan_loss_is_reported_once_with_the_step_it_appeared_at() -> None:
    watch = MetricWatch("n1")
    series = steps(30)
    assert watch.check(3, 0, series) == []
    series += [MetricSample(step=30, loss=math.nan, grad_norm=math.nan, tokens_per_s=1000.0, rank=3)]
    found = watch.check(3, 0, series)
    assert sorted((a.kind, a.metric, a.step, a.value, a.value_text) for a in found) == [
        ("non_finite", "grad_norm", 30, None, "nan"), ("non_finite", "loss", 30, None, "nan")]
    assert "last finite at step 29" in found[0].reason and found[0].node_id == "n1" and found[0].rank == 3
    event = found[0].model_dump_json()  # encodable: no NaN in the JSON
    assert "NaN" not in event
    series += [MetricSample(step=31, loss=math.nan, grad_norm=math.nan, rank=3)]
    assert watch.check(3, 0, series) == []  # reported already
    assert watch.check(3, 0, series) == []  # nothing new
    # The next generation is watched afresh.
    assert [a.metric for a in watch.check(3, 1, series)] == ["grad_norm", "loss"]


def test_a_loss_spike_is_reported_against_its_moving_median() -> None:
    watch = MetricWatch("n1")
    series = steps(40)
    watch.check(3, 0, series)
    series.append(MetricSample(step=40, loss=25.0, grad_norm=1.0, tokens_per_s=1000.0, rank=3))
    [spike] = watch.check(3, 0, series)
    assert (spike.kind, spike.metric, spike.step, spike.value) == ("spike", "loss", 40, 25.0)
    assert spike.baseline is not None and 1.9 < spike.baseline < 2.0


def test_a_throughput_decline_is_reported_once_a_window() -> None:
    watch = MetricWatch("n1")
    series = steps(200)
    assert watch.check(3, 0, series) == []
    series += steps(100, start=200, tokens=600.0)
    [decline] = watch.check(3, 0, series)
    assert (decline.kind, decline.metric) == ("decline", "tokens_per_s") and decline.value == 600.0
    series += steps(50, start=300, tokens=600.0)
    assert watch.check(3, 0, series) == []  # once per generation

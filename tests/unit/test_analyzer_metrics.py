"""Metric anomalies: non-finite values, spikes against a moving median, throughput decline."""

from __future__ import annotations

import math

import pytest

from keel.rules.metrics import (
    MetricSample,
    MetricSettings,
    detect,
    non_finite,
    spikes,
    throughput_decline,
)


def losses(values: list[float], rank: int | None = None, node: str | None = None, start: int = 0) -> list[MetricSample]:
    return [MetricSample(step=start + i, loss=v, rank=rank, node=node) for i, v in enumerate(values)]


def wiggle(n: int, base: float, amp: float = 0.05) -> list[float]:
    """A deterministic noisy plateau."""
    return [base + amp * math.sin(1.7 * i) for i in range(n)]


def test_first_nan_loss_is_reported_with_what_followed() -> None:
    samples = losses(wiggle(120, 2.0), rank=3, node="n1") + losses([math.nan] * 5, rank=3, node="n1", start=120)
    (a,) = non_finite(samples)
    assert (a.kind, a.metric, a.step, a.rank, a.node) == ("non_finite", "loss", 120, 3, "n1")
    assert math.isnan(a.value) and a.baseline is None
    assert "last finite at step 119" in a.reason and "4 more non-finite" in a.reason


def test_inf_grad_norm_and_nan_during_warmup_are_reported() -> None:
    samples = [MetricSample(step=0, loss=math.nan, rank=0), MetricSample(step=1, loss=5.0, grad_norm=math.inf, rank=0)]
    found = non_finite(samples)
    assert [(a.metric, a.step) for a in found] == [("loss", 0), ("grad_norm", 1)]
    assert "no finite value before it" in found[0].reason
    assert non_finite(losses(wiggle(50, 2.0))) == []


def test_earliest_first_across_ranks() -> None:
    samples = losses([1.0, 1.0, math.nan], rank=5) + losses([1.0, math.nan], rank=2)
    assert [(a.rank, a.step) for a in non_finite(samples)] == [(2, 1), (5, 2)]


def test_a_loss_spike_over_five_times_the_moving_median() -> None:
    values = wiggle(60, 2.0)
    values[40] = 11.0  # 5.5x
    values[50] = 9.0  # 4.5x: not a spike
    (a,) = spikes(losses(values, rank=1))
    assert (a.kind, a.step, a.rank, a.value) == ("spike", 40, 1, 11.0)
    assert a.baseline == pytest.approx(2.0, abs=0.05)
    assert "5.5x the median" in a.reason and "previous 20 values" in a.reason


def test_warmup_steps_are_ignored_and_a_baseline_needs_history() -> None:
    values = [50.0, 30.0, 10.0] + wiggle(40, 2.0)
    values[12] = 40.0  # after warm-up (10 steps) but only 2 values of history: not judged
    assert spikes(losses(values)) == []
    assert [a.step for a in spikes(losses(values), settings=MetricSettings(warmup_steps=0, min_history=1))] == [12]
    no_warmup = [a.step for a in spikes(losses([0.5] * 5 + [50.0] + [0.5] * 5), settings=MetricSettings(warmup_steps=0))]
    assert no_warmup == [5]


def test_window_and_factor_are_configurable_and_series_are_per_rank() -> None:
    values = wiggle(40, 1.0)
    values[30] = 3.5
    assert spikes(losses(values)) == []
    found = spikes(losses(values), settings=MetricSettings(spike_factor=3.0, spike_window=5))
    assert [(a.step, round(a.baseline or 0, 2)) for a in found] == [(30, round(sorted(values[25:30])[2], 2))]
    # a rank with a higher plateau does not make another rank's values spikes
    mixed = losses(wiggle(40, 1.0), rank=0) + losses(wiggle(40, 8.0), rank=1)
    assert spikes(mixed) == []


def test_grad_norm_spike() -> None:
    samples = [MetricSample(step=i, grad_norm=0.8 if i != 33 else 12.0) for i in range(50)]
    (a,) = spikes(samples, "grad_norm")
    assert a.metric == "grad_norm" and a.step == 33 and a.baseline == 0.8


def test_mfu_decline_against_the_jobs_own_best_window() -> None:
    mfu = wiggle(100, 0.50, 0.01) + wiggle(50, 0.35, 0.01)
    samples = [MetricSample(step=10 + i, mfu=v) for i, v in enumerate(mfu)]
    (a,) = throughput_decline(samples)
    assert (a.kind, a.metric, a.step, a.rank) == ("decline", "mfu", 159, None)
    assert a.value == pytest.approx(0.35, abs=0.01) and a.baseline == pytest.approx(0.50, abs=0.01)
    assert "70% of its best window" in a.reason and "the job" in a.reason
    mild = wiggle(100, 0.50, 0.01) + wiggle(50, 0.45, 0.01)
    assert throughput_decline([MetricSample(step=10 + i, mfu=v) for i, v in enumerate(mild)]) == []


def test_decline_needs_two_full_windows_and_works_on_tokens_per_second() -> None:
    short = [MetricSample(step=10 + i, tokens_per_s=1000.0 if i < 50 else 100.0) for i in range(99)]
    assert throughput_decline(short, "tokens_per_s") == []
    long = [MetricSample(step=10 + i, tokens_per_s=1000.0 if i < 50 else 100.0) for i in range(100)]
    (a,) = throughput_decline(long, "tokens_per_s")
    assert a.value == 100.0 and a.baseline == 1000.0
    small = MetricSettings(decline_window=10, decline_fraction=0.9)
    ten = [MetricSample(step=10 + i, tokens_per_s=1000.0 if i < 20 else 880.0) for i in range(30)]
    assert [a.value for a in throughput_decline(ten, "tokens_per_s", small)] == [880.0]


def test_detect_finds_each_kind_in_one_history() -> None:
    samples = []
    for i in range(160):
        loss = 2.0 + 0.05 * math.sin(i)
        if i == 70:
            loss = 15.0
        mfu = 0.5 if i < 110 else 0.3
        samples.append(MetricSample(step=i, loss=loss if i < 155 else math.nan, grad_norm=1.0, mfu=mfu))
    kinds = [(a.kind, a.metric, a.step) for a in detect(samples)]
    assert ("spike", "loss", 70) in kinds
    assert ("non_finite", "loss", 155) in kinds
    assert ("decline", "mfu", 159) in kinds
    assert len(kinds) == 3


def test_settings_are_validated() -> None:
    for bad in (dict(spike_factor=1.0), dict(spike_window=0), dict(min_history=30), dict(decline_fraction=1.0),
                dict(warmup_steps=-1)):
        with pytest.raises(ValueError):
            MetricSettings(**bad)  # type: ignore[arg-type]

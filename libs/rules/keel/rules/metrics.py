"""Metric anomalies: non-finite loss or gradient norm, spikes against a moving median, throughput decline.

Pure functions of the samples a job reports (``MetricSample``: a step's loss, global gradient norm,
MFU or tokens/s, and the rank / node when known), each anomaly with the reason it was raised:

- ``non_finite``: a NaN or infinite loss or gradient norm, at any step (warm-up included: a NaN is never
  normal). The first one of each series is reported, with how many followed.
- ``spikes``: a value more than ``spike_factor`` (default 5) x the median of the previous
  ``spike_window`` finite values of its series. Steps before ``warmup_steps`` are neither judged nor
  part of a baseline (losses fall steeply early on), and a baseline needs ``min_history`` values.
- ``throughput_decline``: MFU (or tokens/s) against the job's own history: the median of the last
  ``decline_window`` values below ``decline_fraction`` x the best median of the earlier full windows
  (non-overlapping, counted back from the end). A fleet-wide slowdown drags every rank down together,
  so this compares the job with itself, not ranks with each other.

A series is the samples of one (rank, node) pair, in the order given: the order they were logged (a
restarted job logs some steps again; their values simply follow). ``detect`` runs everything.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Metric = Literal["loss", "grad_norm", "mfu", "tokens_per_s"]
AnomalyKind = Literal["non_finite", "spike", "decline"]


@dataclass(frozen=True, slots=True)
class MetricSample:
    """One step's metrics from one rank (or the job: ``rank`` / ``node`` ``None``); absent ones ``None``."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    mfu: float | None = None
    tokens_per_s: float | None = None
    rank: int | None = None
    node: str | None = None

    def value(self, metric: Metric) -> float | None:
        return getattr(self, metric)


@dataclass(frozen=True, slots=True)
class Anomaly:
    """A metric anomaly: ``value`` at ``step`` against ``baseline`` (``None`` where there is none)."""

    kind: AnomalyKind
    metric: Metric
    step: int
    rank: int | None
    node: str | None
    value: float
    baseline: float | None
    reason: str


@dataclass(frozen=True, slots=True)
class MetricSettings:
    """Thresholds; module docstring for their meaning. Windows count samples, not seconds."""

    spike_factor: float = 5.0
    spike_window: int = 20
    warmup_steps: int = 10
    min_history: int = 5
    decline_window: int = 50
    decline_fraction: float = 0.8

    def __post_init__(self) -> None:
        if self.spike_factor <= 1:
            raise ValueError(f"spike_factor must be > 1, got {self.spike_factor}")
        if self.spike_window < 1 or not 1 <= self.min_history <= self.spike_window:
            raise ValueError("need spike_window >= 1 and 1 <= min_history <= spike_window")
        if self.decline_window < 1 or not 0 < self.decline_fraction < 1:
            raise ValueError("need decline_window >= 1 and 0 < decline_fraction < 1")
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")


def _series(samples: Iterable[MetricSample]) -> dict[tuple[int | None, str | None], list[MetricSample]]:
    out: dict[tuple[int | None, str | None], list[MetricSample]] = {}
    for s in samples:
        out.setdefault((s.rank, s.node), []).append(s)
    return out


def _who(rank: int | None, node: str | None) -> str:
    if rank is None and node is None:
        return "the job"
    if rank is None:
        return f"node {node}"
    return f"rank {rank}" + (f" on {node}" if node else "")


def _median_sorted(s: Sequence[float]) -> float:
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2


def non_finite(samples: Iterable[MetricSample], metrics: Sequence[Metric] = ("loss", "grad_norm")) -> list[Anomaly]:
    """The first NaN / infinite value of each metric in each series (sorted by step, then rank)."""
    out = []
    for (rank, node), series in _series(samples).items():
        for metric in metrics:
            bad = [i for i, s in enumerate(series) if (v := s.value(metric)) is not None and not math.isfinite(v)]
            if not bad:
                continue
            first = series[bad[0]]
            v = first.value(metric)
            assert v is not None
            last_ok = next((s.step for s in reversed(series[: bad[0]])
                            if (x := s.value(metric)) is not None and math.isfinite(x)), None)
            later = f"; {len(bad) - 1} more non-finite value(s) after it" if len(bad) > 1 else ""
            since = f" (last finite at step {last_ok})" if last_ok is not None else " (no finite value before it)"
            out.append(Anomaly("non_finite", metric, first.step, rank, node, v, None,
                               f"{metric} of {_who(rank, node)} is {v} at step {first.step}{since}{later}"))
    out.sort(key=lambda a: (a.step, -1 if a.rank is None else a.rank, a.metric))
    return out


def spikes(samples: Iterable[MetricSample], metric: Metric = "loss", settings: MetricSettings = MetricSettings()) -> list[Anomaly]:
    """Every value above ``spike_factor`` x the moving median of its series' previous values."""
    out = []
    w = settings.spike_window
    for (rank, node), series in _series(samples).items():
        window: deque[float] = deque()
        ordered: list[float] = []
        for s in series:
            v = s.value(metric)
            if v is None or not math.isfinite(v) or s.step < settings.warmup_steps:
                continue
            if len(window) >= settings.min_history:
                med = _median_sorted(ordered)
                if med > 0 and v > settings.spike_factor * med:
                    out.append(Anomaly("spike", metric, s.step, rank, node, v, med,
                                       f"{metric} of {_who(rank, node)} at step {s.step} is {v:.4g}, {v / med:.1f}x the "
                                       f"median {med:.4g} of its previous {len(window)} values (> {settings.spike_factor}x)"))
            window.append(v)
            bisect.insort(ordered, v)
            if len(window) > w:
                old = window.popleft()
                del ordered[bisect.bisect_left(ordered, old)]
    out.sort(key=lambda a: (a.step, -1 if a.rank is None else a.rank))
    return out


def throughput_decline(samples: Iterable[MetricSample], metric: Metric = "mfu",
                       settings: MetricSettings = MetricSettings()) -> list[Anomaly]:
    """At most one anomaly per series: its last window's median below ``decline_fraction`` x the best
    earlier window's median. Needs two full windows after warm-up; otherwise nothing."""
    out = []
    w = settings.decline_window
    for (rank, node), series in _series(samples).items():
        pts = [(s.step, v) for s in series
               if (v := s.value(metric)) is not None and math.isfinite(v) and s.step >= settings.warmup_steps]
        if len(pts) < 2 * w:
            continue
        values = [v for _, v in pts]
        last = _median_sorted(sorted(values[-w:]))
        earlier = [(_median_sorted(sorted(values[len(values) - (k + 1) * w: len(values) - k * w])), k)
                   for k in range(1, len(values) // w)]
        best, k = max(earlier)
        if best > 0 and last < settings.decline_fraction * best:
            start = pts[len(values) - (k + 1) * w][0]
            end = pts[len(values) - k * w - 1][0]
            out.append(Anomaly("decline", metric, pts[-1][0], rank, node, last, best,
                               f"{metric} of {_who(rank, node)}: median {last:.4g} over the last {w} values (to step "
                               f"{pts[-1][0]}) is {last / best:.0%} of its best window's {best:.4g} (steps {start}-{end}), "
                               f"below {settings.decline_fraction:.0%}"))
    out.sort(key=lambda a: (a.step, -1 if a.rank is None else a.rank))
    return out


def detect(samples: Sequence[MetricSample], settings: MetricSettings = MetricSettings()) -> list[Anomaly]:
    """All anomalies: non-finite loss / grad norm, loss and grad-norm spikes, MFU and tokens/s decline."""
    found = non_finite(samples)
    for spiky in ("loss", "grad_norm"):
        found += spikes(samples, spiky, settings)
    for rate in ("mfu", "tokens_per_s"):
        found += throughput_decline(samples, rate, settings)
    found.sort(key=lambda a: (a.step, -1 if a.rank is None else a.rank, a.kind, a.metric))
    return found

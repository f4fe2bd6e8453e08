"""ETTR and lost time from a system's unproductive stretches (pure).

A stretch is ``Loss(start_s, end_s, weight, mechanism, phase)``: the job made no progress (weight 1), or
progress at a fraction of its speed (a fail-slow machine: weight 1 - 1/slowdown), between two moments of the
simulated clock. Stretches may overlap (a second failure during a recovery): time is counted once, at the
largest weight, when the window and the ETTR are computed over the per-second timeline buckets.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

BUCKET_S = 60.0


@dataclass(frozen=True)
class Loss:
    start_s: float
    end_s: float
    weight: float
    mechanism: str
    """The failure kind that caused it (``failures.yaml``), or ``checkpoint`` / ``code_change``."""
    phase: str
    """detection, diagnosis, standby_wait, restart, recompute, slow, checkpoint, human."""


@dataclass(frozen=True)
class Summary:
    ettr: float
    worst_window_min: float
    lost_h: float
    lost_h_by_mechanism: dict[str, float]
    lost_h_by_phase: dict[str, float]
    ettr_daily: list[float]


def unproductive_buckets(losses: list[Loss], horizon_s: float, bucket_s: float = BUCKET_S) -> list[float]:
    """Unproductive seconds in each ``bucket_s`` bucket of [0, horizon): overlapping stretches count once per
    second, at the largest weight (approximated per bucket as the larger of the weighted sums, capped)."""
    count = max(1, int(-(-horizon_s // bucket_s)))
    full = [0.0] * count
    partial = [0.0] * count
    for loss in losses:
        start, end = max(0.0, loss.start_s), min(horizon_s, loss.end_s)
        if end <= start:
            continue
        target = full if loss.weight >= 1.0 else partial
        b = int(start // bucket_s)
        while b < count and b * bucket_s < end:
            lo, hi = max(start, b * bucket_s), min(end, (b + 1) * bucket_s)
            if hi > lo:
                target[b] += (hi - lo) * min(1.0, loss.weight)
            b += 1
    out = []
    for b in range(count):
        width = min(bucket_s, horizon_s - b * bucket_s)
        f = min(full[b], width)
        out.append(min(width, f + partial[b] * (width - f) / width if width > 0 else 0.0))
    return out


def worst_window_min(buckets: list[float], window_s: float = 3600.0, bucket_s: float = BUCKET_S) -> float:
    """The most unproductive minutes in any sliding window of ``window_s`` (bucket-aligned)."""
    width = max(1, int(round(window_s / bucket_s)))
    running = sum(buckets[:width])
    worst = running
    for i in range(width, len(buckets)):
        running += buckets[i] - buckets[i - width]
        worst = max(worst, running)
    return worst / 60.0


def summarise(losses: list[Loss], horizon_s: float) -> Summary:
    buckets = unproductive_buckets(losses, horizon_s)
    lost_s = sum(buckets)
    by_mechanism: dict[str, float] = defaultdict(float)
    by_phase: dict[str, float] = defaultdict(float)
    raw = sum(max(0.0, min(horizon_s, loss.end_s) - max(0.0, loss.start_s)) * loss.weight for loss in losses) or 1.0
    scale = lost_s / raw  # overlaps counted once: shares scaled to the timeline's total
    for loss in losses:
        seconds = max(0.0, min(horizon_s, loss.end_s) - max(0.0, loss.start_s)) * loss.weight * scale
        by_mechanism[loss.mechanism] += seconds / 3600.0
        by_phase[loss.phase] += seconds / 3600.0
    per_day = int(86400 / BUCKET_S)
    daily = [1.0 - sum(buckets[:i + per_day]) / ((i + per_day) * BUCKET_S) for i in range(0, len(buckets), per_day)]
    return Summary(ettr=1.0 - lost_s / horizon_s, worst_window_min=worst_window_min(buckets),
                   lost_h=lost_s / 3600.0,
                   lost_h_by_mechanism={k: round(v, 3) for k, v in sorted(by_mechanism.items())},
                   lost_h_by_phase={k: round(v, 3) for k, v in sorted(by_phase.items())},
                   ettr_daily=[round(x, 5) for x in daily])

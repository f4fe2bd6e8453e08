"""The node agent's watch on its ranks' per-step metrics: the analyzer's pure checks
(``keel.rules.metrics``: non-finite values, spikes over a moving median, throughput decline) run on
each local rank's recent steps as they arrive, and each new anomaly is reported once per rank, kind and
metric per generation (``MetricAnomalyDetected``).

Here, not in the analyzer, because only the agent sees every step: reports of every step stay on the
node; heartbeats carry summaries. The checks are the analyzer's, so a replay of the samples finds the
same anomalies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from keel.events.types import MetricAnomalyDetected
from keel.rules.metrics import Anomaly, MetricSample, MetricSettings, non_finite, spikes, throughput_decline


class MetricWatch:
    def __init__(self, node_id: str, settings: MetricSettings | None = None) -> None:
        self.node_id = node_id
        self.settings = settings if settings is not None else MetricSettings()
        self.reported: set[tuple[int, int, str, str]] = set()  # (generation, rank, kind, metric)
        self.checked: dict[tuple[int, int], int] = {}  # (generation, rank) -> newest step checked

    def check(self, rank: int, generation: int, samples: Iterable[MetricSample]) -> list[MetricAnomalyDetected]:
        """The anomalies new in ``samples`` (the rank's recent steps, oldest first) since the last check."""
        series = list(samples)
        if not series:
            return []
        newest = series[-1].step
        previous = self.checked.get((generation, rank), -1)
        if newest <= previous:
            return []
        self.checked[(generation, rank)] = newest
        # Cheap per step: the new samples and the spike window before them; the decline (a median over
        # whole windows) once per window.
        fresh = sum(1 for sample in series if sample.step > previous)
        recent = series[-(fresh + self.settings.spike_window):]
        found: list[Anomaly] = [*non_finite(recent), *spikes(recent, "loss", self.settings),
                                *spikes(recent, "grad_norm", self.settings)]
        if any(sample.step % self.settings.decline_window == 0 for sample in series[-fresh:]):
            found += throughput_decline(series, "tokens_per_s", self.settings)
        out = []
        for anomaly in sorted(found, key=lambda a: a.step):
            key = (generation, rank, anomaly.kind, anomaly.metric)
            if anomaly.step <= previous or key in self.reported:
                continue
            self.reported.add(key)
            finite = math.isfinite(anomaly.value)
            out.append(MetricAnomalyDetected(
                node_id=self.node_id, rank=rank, generation=generation, kind=anomaly.kind, metric=anomaly.metric,
                step=anomaly.step, value=anomaly.value if finite else None, value_text=repr(anomaly.value),
                baseline=anomaly.baseline if anomaly.baseline is not None and math.isfinite(anomaly.baseline) else None,
                reason=anomaly.reason))
        return out

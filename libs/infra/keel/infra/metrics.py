"""A small metrics registry in the Prometheus text format.

``keel metrics`` (``keel.infra.ops_metrics``) builds one from the event log and serves it. A process also keeps
its own figures in ``REGISTRY``: the recorder's below, read by tests and tools (``value``). No process serves its
own registry over HTTP yet (the recorder has no endpoint). Counters, gauges and histograms, with
optional labels; names follow the Grafana dashboard's (``infra/grafana``). Values are per process.

Metrics kept today:

- ``keel_events_recorded_total``, ``keel_events_dead_lettered_total`` (counters): the recorder's.
- ``keel_recorder_batch_seconds`` (histogram): one recorder transaction, retries included.
- ``keel_recorder_lag_seconds`` (gauge): now minus the arrival in the stream of the oldest message of the
  batch in hand (0 when nothing waits); ``keel_recorder_lag_events`` (gauge): messages in the stream not
  yet delivered to the recorder (JetStream's pending count).
- ``keel_stream_trimmed_total`` (counter): recorded messages the recorder purged from the full stream.
- ``keel_stream_full_refusals_total`` (counter): publishes a full stream refused (back-pressure).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

LabelValues = tuple[str, ...]


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labels = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {list(self.labels)}, got {sorted(labels)}")
        return tuple(str(labels[name]) for name in self.labels)

    def _label_text(self, key: LabelValues, extra: str = "") -> str:
        parts = [f'{name}="{_escape(value)}"' for name, value in zip(self.labels, key)]
        if extra:
            parts.append(extra)
        return "{" + ",".join(parts) + "}" if parts else ""

    def lines(self) -> list[str]:
        """The metric's sample lines; each kind (Counter, Gauge, Histogram) writes its own."""
        raise NotImplementedError(f"{type(self).__name__} is a base class: use Counter, Gauge or Histogram")


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[LabelValues, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up (got {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        if not self._values and not self.labels:
            return [f"{self.name} 0"]
        return [f"{self.name}{self._label_text(k)} {_number(v)}" for k, v in sorted(self._values.items())]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[LabelValues, float] = {}

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        if not self._values and not self.labels:
            return [f"{self.name} 0"]
        return [f"{self.name}{self._label_text(k)} {_number(v)}" for k, v in sorted(self._values.items())]


DEFAULT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] = DEFAULT_BUCKETS_S) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(buckets))
        self._counts: dict[LabelValues, list[int]] = {}
        self._sums: dict[LabelValues, float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
            for index, bound in enumerate(self.buckets):
                if value <= bound:
                    counts[index] += 1
            counts[-1] += 1
            self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        counts = self._counts.get(self._key(labels))
        return counts[-1] if counts else 0

    def lines(self) -> list[str]:
        out = []
        for key, counts in sorted(self._counts.items()):
            for bound, count in zip(self.buckets, counts):
                le = 'le="' + _number(bound) + '"'
                out.append(f"{self.name}_bucket{self._label_text(key, le)} {count}")
            inf = 'le="+Inf"'
            out.append(f"{self.name}_bucket{self._label_text(key, inf)} {counts[-1]}")
            out.append(f"{self.name}_sum{self._label_text(key)} {_number(self._sums[key])}")
            out.append(f"{self.name}_count{self._label_text(key)} {counts[-1]}")
        return out


class Registry:
    """Metrics by name; asking again for a name returns the metric already there (of the same kind)."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def _get(self, cls: type[_Metric], name: str, help_text: str, labels: Sequence[str], **kwargs: object) -> _Metric:
        with self._lock:
            existing = self._metrics.get(name)
            if existing is not None:
                if type(existing) is not cls or existing.labels != tuple(labels):
                    raise ValueError(f"metric {name} exists as a {existing.kind} with labels {list(existing.labels)}")
                return existing
            metric = cls(name, help_text, labels, **kwargs)
            self._metrics[name] = metric
            return metric

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        metric = self._get(Counter, name, help_text, labels)
        assert isinstance(metric, Counter)
        return metric

    def gauge(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Gauge:
        metric = self._get(Gauge, name, help_text, labels)
        assert isinstance(metric, Gauge)
        return metric

    def histogram(self, name: str, help_text: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_BUCKETS_S) -> Histogram:
        metric = self._get(Histogram, name, help_text, labels, buckets=buckets)
        assert isinstance(metric, Histogram)
        return metric

    def render(self) -> str:
        """Every metric in the Prometheus text exposition format (version 0.0.4)."""
        out = []
        for name in sorted(self._metrics):
            metric = self._metrics[name]
            out.append(f"# HELP {name} {metric.help}")
            out.append(f"# TYPE {name} {metric.kind}")
            out.extend(metric.lines())
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if value != int(value) else str(int(value))


REGISTRY = Registry()
"""The process's metrics."""

STREAM_FULL_REFUSALS = REGISTRY.counter("keel_stream_full_refusals_total",
                                        "Publishes a full events stream refused (back-pressure; retried, never dropped)")

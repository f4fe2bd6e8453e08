"""The analyzer's I/O: the shared decider loop (cold start from the store, then live events).

Time comes from the job clock's recorded ``TimerTicked`` events (keel.infra.clock: it ticks every running job), so the
analyzer keeps no clock of its own and a replay sees the same deadlines.
"""

from __future__ import annotations

from keel.analyzer.core import AnalyzerDecider, AnalyzerState
from keel.analyzer.failslow_rounds import FailSlowPolicy
from keel.infra.bus import Bus
from keel.infra.config import Settings
from keel.infra.service import RunnerService
from keel.infra.store import EventStore


def decider_from_settings(settings: Settings) -> AnalyzerDecider:
    a = settings.analyzer
    return AnalyzerDecider(FailSlowPolicy(interval=a.failslow_interval, rounds=a.failslow_rounds,
                                          min_flags=a.failslow_min_flags, ratio=a.failslow_ratio,
                                          warmup=a.failslow_warmup))


class Analyzer(RunnerService[AnalyzerState]):
    """The running service: ``start()`` (cold start), then ``run(stop)``."""

    def __init__(self, bus: Bus, store: EventStore | None, settings: Settings, *, fetch_timeout_s: float = 0.2) -> None:
        super().__init__(decider_from_settings(settings), bus, store, fetch_timeout_s=fetch_timeout_s,
                         snapshots=settings.snapshots)

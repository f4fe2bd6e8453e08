"""Failure traces: when each failure hits which machines, drawn from a ``FailureMix`` with a seed (pure).

Every system of one run sees the same trace. Failures of each kind arrive as a Poisson process (rate per
node-day times the job's machines, or per job-day); a correlated failure takes up to ``extra_nodes_max`` more
machines of the same fault domain (``fault_domain_nodes`` consecutive machines) at the same moment.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from keel.sim.config import FailureMix

DAY_S = 86400.0


@dataclass(frozen=True)
class Failure:
    at_s: float
    kind: str
    signal: str
    nodes: tuple[int, ...]
    """Machine indices (0 .. nodes-1): the first is where it starts; more for a correlated failure."""
    repair_s: float = 0.0
    slowdown: float = 1.0
    duration_s: float = 0.0


@dataclass(frozen=True)
class Trace:
    nodes: int
    horizon_s: float
    failures: tuple[Failure, ...]
    code_changes_s: tuple[float, ...] = ()
    """When a planned code change is shipped (a deliberate restart, or a lazy hot update)."""

    def count(self, kind: str) -> int:
        return sum(1 for f in self.failures if f.kind == kind)


def generate(mix: FailureMix, *, nodes: int, days: float, seed: int) -> Trace:
    """A trace for a job of ``nodes`` machines over ``days`` days."""
    if nodes < 1 or days <= 0:
        raise ValueError(f"a trace needs nodes >= 1 and days > 0, got {nodes} and {days}")
    rng = random.Random(seed)
    horizon_s = days * DAY_S
    failures: list[Failure] = []
    for kind in mix.kinds:
        rate_per_s = (kind.rate_per_node_day * nodes + kind.rate_per_job_day) / DAY_S
        if rate_per_s <= 0:
            continue
        t = rng.expovariate(rate_per_s)
        while t < horizon_s:
            first = rng.randrange(nodes)
            hit = [first]
            if kind.correlated is not None and rng.random() < kind.correlated.probability:
                domain = first // mix.fault_domain_nodes
                lo, hi = domain * mix.fault_domain_nodes, min(nodes, (domain + 1) * mix.fault_domain_nodes)
                others = [n for n in range(lo, hi) if n != first]
                hit += rng.sample(others, min(len(others), rng.randint(1, kind.correlated.extra_nodes_max)))
            failures.append(Failure(at_s=t, kind=kind.name, signal=kind.signal, nodes=tuple(hit),
                                    repair_s=kind.repair_h * 3600.0, slowdown=kind.slowdown,
                                    duration_s=kind.duration_h * 3600.0))
            t += rng.expovariate(rate_per_s)
    changes: list[float] = []
    if mix.code_changes_per_job_day > 0:
        t = rng.expovariate(mix.code_changes_per_job_day / DAY_S)
        while t < horizon_s:
            changes.append(t)
            t += rng.expovariate(mix.code_changes_per_job_day / DAY_S)
    failures.sort(key=lambda f: (f.at_s, f.kind, f.nodes))
    return Trace(nodes, horizon_s, tuple(failures), tuple(changes))

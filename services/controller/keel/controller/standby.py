"""Warm-standby pool sizing (pure): the 99th percentile of a binomial model of concurrent node failures.

Within one *replacement window* (the time it takes to get a failed machine back, or a new one in),
each of a job's N nodes fails independently with probability p; the number failed at once is then
Binomial(N, p), and a pool of k standbys covers the job with probability P(X <= k). The pool is the
smallest k reaching the target quantile (0.99 by default, as in ByteRobust).

p comes from the per-node failure rate measured in the event log, blended with a prior while the log
is young (``failure_probability``): rate = (failures + prior_rate * prior_node_hours) / (node_hours +
prior_node_hours), and p = 1 - exp(-rate * window).

The paper's pools - 2, 2, 3 and 4 standbys for 128, 256, 512 and 1,024 machines - all follow from
p between about 0.00117 and 0.00125 per window (the unit tests hold it to that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

__all__ = ["StandbyPlan", "binomial_cdf", "binomial_quantile", "failure_probability", "plan_standby_pool"]


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (stable for n in the tens of thousands)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"probability must be in [0, 1], got {p}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if k < 0:
        return 0.0
    if k >= n or p == 0.0:
        return 1.0
    if p == 1.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    total = 0.0
    for i in range(k + 1):
        log_term = math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        total += math.exp(log_term)
    return min(1.0, total)


def binomial_quantile(n: int, p: float, quantile: float) -> int:
    """The smallest k with P(X <= k) >= ``quantile`` for X ~ Binomial(n, p)."""
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    cumulative, k = 0.0, 0
    if p == 0.0 or n == 0:
        return 0
    if p == 1.0:
        return n
    log_p, log_q = math.log(p), math.log1p(-p)
    while k <= n:
        cumulative += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                               + k * log_p + (n - k) * log_q)
        if cumulative >= quantile - 1e-12:
            return k
        k += 1
    return n


def failure_probability(failures: int, node_hours: float, window: timedelta, *,
                        prior_rate_per_node_hour: float, prior_node_hours: float) -> float:
    """Per-node probability of failing within ``window``, from the log's failures over ``node_hours``
    of observed node time, blended with a prior worth ``prior_node_hours`` of observation."""
    if failures < 0 or node_hours < 0 or prior_node_hours < 0 or prior_rate_per_node_hour < 0:
        raise ValueError("failures, node hours and the prior must be >= 0")
    if window <= timedelta(0):
        raise ValueError(f"the replacement window must be > 0, got {window}")
    observed = node_hours + prior_node_hours
    if observed <= 0:
        raise ValueError("no observed node time and no prior: the failure rate is unknown")
    rate = (failures + prior_rate_per_node_hour * prior_node_hours) / observed
    return -math.expm1(-rate * window.total_seconds() / 3600.0)


@dataclass(frozen=True)
class StandbyPlan:
    size: int
    failure_probability: float
    coverage: float
    """P(at most ``size`` nodes fail within one window): what the pool covers."""
    reason: str


def plan_standby_pool(nodes: int, failure_probability_per_window: float, *, quantile: float = 0.99) -> StandbyPlan:
    """The pool for a job of ``nodes`` nodes, with the reason stating the model's numbers."""
    size = binomial_quantile(nodes, failure_probability_per_window, quantile)
    coverage = binomial_cdf(size, nodes, failure_probability_per_window)
    below = binomial_cdf(size - 1, nodes, failure_probability_per_window) if size > 0 else 0.0
    reason = (f"{size} standby node(s): P(at most {size} of {nodes} nodes fail within one replacement window) = "
              f"{coverage:.4f} >= {quantile} with p = {failure_probability_per_window:.6f} per node"
              + (f"; {size - 1} would cover only {below:.4f}" if size > 0 else ""))
    return StandbyPlan(size, failure_probability_per_window, coverage, reason)

"""The baselines: cost models, not code (pure). Each turns a failure of the trace into unproductive stretches.

- ``conventional``: timeout detection (a hang or a flapping link is only ended by the collective timeout),
  a full requeue through the scheduler, a restore from a persistent checkpoint taken every 30 min (so half
  the interval recomputed on average), a blocking save each time; fail-slow and SDC found by a human.
- ``torchelastic``: every worker restarted in place by the elastic agent (no scheduler), a lost machine
  replaced cold from the scheduler, a disk checkpoint at Young's interval sqrt(2 x save cost x MTBF).
- ``oracle``: zero detection, infinite warm standbys, the memory tier: only the restart, the restore and
  half a step remain. The upper bound.

Keel's figures never come from here: ``engine`` runs the real controller.
"""

from __future__ import annotations

import math
import random

from keel.sim.config import Calibration
from keel.sim.metrics import Loss
from keel.sim.trace import Failure, Trace

BASELINES = ("conventional", "torchelastic", "oracle")
HANGS = frozenset({"hang", "nic_flap"})
HARDWARE = frozenset({"gpu_lost", "xid", "host_lost"})
HUMAN_FOUND = frozenset({"sdc", "fail_slow"})


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval: sqrt(2 x save cost x mean time between failures)."""
    if save_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"Young's interval needs save_s > 0 and mtbf_s > 0, got {save_s} and {mtbf_s}")
    return math.sqrt(2.0 * save_s * mtbf_s)


def _phases(failure: Failure, mechanism: str, detect_s: float, fix_s: float, recompute_s: float,
            extra: tuple[str, float] | None = None) -> list[Loss]:
    t = failure.at_s
    out = [Loss(t, t + detect_s, 1.0, mechanism, "detection")]
    t += detect_s
    if extra is not None:
        out.append(Loss(t, t + extra[1], 1.0, mechanism, extra[0]))
        t += extra[1]
    out.append(Loss(t, t + fix_s, 1.0, mechanism, "restart"))
    out.append(Loss(t + fix_s, t + fix_s + recompute_s, 1.0, mechanism, "recompute"))
    return [loss for loss in out if loss.end_s > loss.start_s]


def baseline_losses(system: str, trace: Trace, cal: Calibration, *, seed: int = 0) -> list[Loss]:
    """The unproductive stretches ``system`` (one of ``BASELINES``) would have on ``trace``."""
    if system not in BASELINES:
        raise ValueError(f"unknown baseline {system!r}; known: {', '.join(BASELINES)}")
    rng = random.Random(seed * 104729 + len(system))
    b, job = cal.baselines, cal.job
    restart_s = cal.agent["restart"].mean_s
    persistent_s, memory_s = cal.agent["setup_restore_persistent"].mean_s, cal.agent["setup_restore_memory"].mean_s
    failures = [f for f in trace.failures if f.signal != "fail_slow" or f.slowdown > 1]
    mtbf_s = trace.horizon_s / max(1, len(failures))
    if system == "conventional":
        interval_s = b["conventional_persist_interval_s"]
    elif system == "torchelastic":
        interval_s = young_interval_s(job["persist_save_s"], mtbf_s)
    else:
        interval_s = 0.0
    losses: list[Loss] = []
    if interval_s > 0:
        losses.append(Loss(0.0, trace.horizon_s, job["persist_save_s"] / interval_s, "checkpoint", "checkpoint"))
    for f in failures:
        if system == "oracle":
            if f.signal == "fail_slow":
                continue
            losses += _phases(f, f.kind, 0.0, restart_s + memory_s, rng.uniform(0.0, job["step_time_s"]))
            continue
        recompute = rng.uniform(0.0, interval_s)
        if system == "conventional":
            fix = b["requeue_s"] + restart_s + persistent_s
            hang_timeout = b["hang_timeout_s"]
        else:
            fix = b["elastic_restart_s"] + persistent_s
            if f.signal in HARDWARE:
                fix += cal.actuator["cold_replacement"].mean_s  # no spare: the rendezvous waits for a machine
            hang_timeout = b["torchelastic_hang_timeout_s"]
        if f.signal == "fail_slow":
            found = min(f.duration_s, b["human_detection_s"])
            losses.append(Loss(f.at_s, f.at_s + found, 1.0 - 1.0 / f.slowdown, f.kind, "slow"))
            if found < f.duration_s:  # a human evicts it: one more restart
                losses += _phases(Failure(f.at_s + found, f.kind, f.signal, f.nodes), f.kind, 0.0, fix, recompute)
            continue
        if f.signal in HANGS:
            detect = hang_timeout
        elif f.signal == "sdc":
            detect = b["human_detection_s"]
        elif f.signal == "host_lost":
            detect = b["node_lost_detection_s"]
        else:
            detect = b["crash_detection_s"]
        extra = ("human", b["human_rollback_s"]) if f.signal == "bad_deploy" else None
        losses += _phases(f, f.kind, detect, fix, recompute, extra)
    for t in trace.code_changes_s:
        if system == "oracle":
            continue
        fix = (b["requeue_s"] + restart_s + persistent_s) if system == "conventional" else (b["elastic_restart_s"]
                                                                                            + persistent_s)
        losses.append(Loss(t, t + fix, 1.0, "code_change", "restart"))
    return losses

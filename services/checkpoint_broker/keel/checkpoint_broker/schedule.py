"""The checkpoint schedule: how often ranks back up to their peer (``backup_interval``) and how often
the job persists to disk (``young_interval``, Young's formula over the measured save cost, the MTBF
estimate ``mtbf_estimate`` and the step time).

The formulas are pure maths over plain values (seconds in, steps out). ``decide_schedule`` is the
decider's schedule decision: ``CheckpointScheduleSet`` when the persist interval K moves past the
hysteresis or the backup interval changes; ``announced_schedule`` is what ``CheckpointNodeBackupsAssigned``
carries of it. No I/O, no clock: the elapsed time is on the recorded clock (``state.received_at``).
"""

from __future__ import annotations

import math

from keel.checkpoint_broker.state import BrokerPolicy, JobState, ScheduleState, received_at
from keel.events.envelope import Event
from keel.events.types import CheckpointScheduleSet
from keel.kernel.decider import Decision, Proposal


def mtbf_estimate(elapsed_s: float, failures: int, prior_s: float) -> float:
    """Mean time between failures, in seconds: ``(elapsed + prior) / (failures + 1)``.

    The prior counts as one failure-free stretch of ``prior_s`` (a conjugate prior): with no failures
    yet the estimate is the prior plus the time observed, and the observed rate dominates as failures
    accumulate.
    """
    return (max(0.0, elapsed_s) + prior_s) / (failures + 1)


def backup_interval(send_s: float, step_time_s: float, max_duty: float, ceiling: int, min_period_s: float = 0.0) -> int:
    """Steps between backups so that one transfer of ``send_s`` seconds takes at most ``max_duty`` of the
    wall time and rounds are at least ``min_period_s`` apart: the smallest power of two >=
    max(send_s / (max_duty * step_time), min_period_s / step_time), at most ``ceiling``.

    Powers of two, so that a change (the step time jitters) moves every node to steps the old and the
    new interval share. The period floor lets a round commit (every copy landed and reported) before
    any rank reaches the next one, so a fast rank's store is rarely two rounds past a slow rank's copy
    (the store keeps two). 1 (every step) when no step time was measured yet."""
    if step_time_s <= 0:
        return 1
    raw = backup_steps_needed(send_s, step_time_s, max_duty, min_period_s)
    interval = 1
    while interval < raw and interval < ceiling:
        interval *= 2
    return min(interval, max(1, ceiling))


def backup_steps_needed(send_s: float, step_time_s: float, max_duty: float, min_period_s: float = 0.0) -> float:
    """The fewest steps between backups (unrounded) that keep the duty and the period floor."""
    return max(max(0.0, send_s) / (max_duty * step_time_s), max(0.0, min_period_s) / step_time_s)


BACKUP_INTERVAL_MARGIN = 0.25
"""A backup interval in force is kept while the steps needed stay within this margin of what it allows."""


def kept_backup_interval(current: int | None, wanted: int, needed: float, margin: float = BACKUP_INTERVAL_MARGIN) -> int:
    """The backup interval to announce: ``wanted`` (``backup_interval``), unless the one in force still
    fits within ``margin``: it goes coarser only when more than ``(1 + margin)`` times its steps are
    needed, finer only when half of it would fit with ``margin`` to spare. Step and transfer times
    jitter (by tens of percent on a busy host) and every change is an event every agent acts on; the
    duty limit is a target, not a hard bound."""
    if current is None or current <= 0 or wanted == current:
        return wanted
    if current / 2 * (1 - margin) < needed <= current * (1 + margin):
        return current
    return wanted


def young_interval(
    save_cost_s: float, mtbf_s: float, step_time_s: float, floor: int, ceiling: int
) -> tuple[int, float]:
    """Young's optimal checkpoint interval in steps: ``(clamp(round(K)), K)`` with
    ``K = sqrt(2 * save_cost * MTBF) / step_time`` (seconds in, steps out)."""
    if step_time_s <= 0:
        raise ValueError(f"step time must be > 0 s, got {step_time_s}")
    raw = math.sqrt(2.0 * max(0.0, save_cost_s) * mtbf_s) / step_time_s
    return min(ceiling, max(floor, round(raw))), raw


def announced_schedule(schedule: ScheduleState) -> dict[str, int]:
    """The schedule last announced, as ``CheckpointNodeBackupsAssigned`` carries it (nothing before one)."""
    if schedule.every_k is None:
        return {}
    return {"every_k_steps": schedule.every_k, "backup_every_k_steps": schedule.backup_every or 1}


# -- the decision ------------------------------------------------------------------------------------


def decide_schedule(job: JobState, event: Event, policy: BrokerPolicy, subject: str) -> Decision:
    """Set the persist interval K (Young) and the backup interval, or announce nothing (an empty reason)
    while neither changed enough. Before any step time is measured: persist at the floor, back up every step."""
    schedule = job.schedule
    if not schedule.step_times:
        if schedule.every_k is not None or not job.all_registered:
            return Decision("")
        # Young's K is in steps and needs the step time; until a heartbeat measured one, persist at
        # the floor (the most frequent setting: a short or fast job still gets a disk copy).
        k = policy.persist_every_floor
        reason = (f"no step time measured yet: persist every {k} steps (the floor) until Young's formula "
                  f"can be applied; backups every step until a transfer is measured")
        cost = (schedule.save_cost_s if schedule.save_cost_s is not None
                else policy.initial_save_cost.total_seconds())
        payload = CheckpointScheduleSet(every_k_steps=k, backup_every_k_steps=1, save_cost_s=cost,
                                        mtbf_s=policy.mtbf_prior.total_seconds(), step_time_s=0.0, reason=reason)
        return Decision(reason, (Proposal(payload, subject=subject, key="schedule/initial"),))
    # Synchronous training runs at its slowest node's pace.
    step_time = max(schedule.step_times.values())
    cost = schedule.save_cost_s if schedule.save_cost_s is not None else policy.initial_save_cost.total_seconds()
    now = received_at(job, event)
    started = schedule.started_at or now
    elapsed = (now - started).total_seconds()
    failures = len(schedule.failures)
    prior = policy.mtbf_prior.total_seconds()
    mtbf = mtbf_estimate(elapsed, failures, prior)
    k, raw = young_interval(cost, mtbf, step_time, policy.persist_every_floor, policy.persist_every_ceiling)
    current = schedule.every_k
    slowest_send = max(schedule.send_s.values(), default=0.0)
    backup_every = kept_backup_interval(
        schedule.backup_every,
        backup_interval(slowest_send, step_time, policy.backup_max_duty, policy.persist_every_ceiling,
                        policy.backup_min_period.total_seconds()),
        backup_steps_needed(slowest_send, step_time, policy.backup_max_duty, policy.backup_min_period.total_seconds()))
    if (current is not None and abs(k - current) < max(1.0, policy.schedule_hysteresis * current)
            and backup_every == (schedule.backup_every or 1)):
        return Decision("")
    coarser = backup_every > (schedule.backup_every or 1)
    if (current is not None and not coarser and schedule.announced_at is not None
            and event.occurred_at - schedule.announced_at < policy.schedule_min_period):
        return Decision("")  # an efficiency change: it waits for the period (the next heartbeat after it decides)
    cost_from = (f"EWMA of {schedule.measurements} measured persist(s)" if schedule.save_cost_s is not None
                 else "initial estimate, nothing persisted yet")
    reason = (f"Young: K = sqrt(2 x C {cost:.2f}s x MTBF {mtbf:.0f}s) / step time {step_time:.4f}s = {raw:.1f} "
              f"-> {k} steps (clamped to [{policy.persist_every_floor}, {policy.persist_every_ceiling}]); "
              f"C: {cost_from}; MTBF = (observed {elapsed:.0f}s + prior {prior:.0f}s) / ({failures} failure(s) + 1)"
              + (f"; was {current}" if current is not None else "")
              + f"; backups every {backup_every} step(s): slowest transfer {slowest_send:.3f}s within "
                f"{policy.backup_max_duty:.0%} of the step time, rounds at least "
                f"{policy.backup_min_period.total_seconds():g}s apart")
    payload = CheckpointScheduleSet(every_k_steps=k, backup_every_k_steps=backup_every, save_cost_s=cost,
                                    mtbf_s=mtbf, step_time_s=step_time, reason=reason)
    return Decision(reason, (Proposal(payload, subject=subject, key="schedule"),))

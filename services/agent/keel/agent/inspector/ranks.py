"""Rank liveness and progress, with per-phase timeouts calibrated from observed step times.

The agent keeps one ``RankView`` per local rank from the node-local channel (``RankReport``) and
hands them to ``RankProbe.collect(views, now)``. Four checks per rank (component ``rank``, key
``rank<N>``):

- ``heartbeat_lost``: no report at all for ``max(policy.heartbeat_timeout, phase timeout)``;
- ``no_progress``: neither the step nor the phase advanced for the phase timeout;
- ``collective_stuck``: inside one collective (``Session.waiting``) for longer than the collective
  timeout (``collective_timeout``: max(5 s, 5 × p99 of the rank's recent per-step longest waits), in the
  ``step`` phase after warm-up): the peer it waits for has stopped. Seconds, where ``no_progress`` waits
  for the step timeout's 25 s floor;
- ``process_stopped``: the process has been stopped (``T`` in ``/proc/<pid>/stat``: SIGSTOP) for
  ``stopped_timeout``: it will report nothing until it is continued.

Phase timeouts (``phase_timeout``): ``setup`` → ``setup_timeout``; ``step`` → ``setup_timeout`` until
``warmup_steps`` step times are known (the first step compiles and warms up), then
``max(step_timeout_floor, step_timeout_factor × p99(last calibration_window step times))``;
``checkpoint`` → ``checkpoint_timeout``; ``eval`` → ``eval_timeout``; ``done`` (and exited ranks) →
never a hang. Both checks are ``immediate`` (the timeout already is the hysteresis), ``failed`` with
medium confidence and not fatal: a hang is for the stack-aggregation rung, not rung 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from .observation import Observation, healthy
from .policy import InspectorPolicy

PHASES = ("setup", "step", "checkpoint", "eval", "done", "unspecified")
LIVENESS_CHECKS = ("heartbeat_lost", "no_progress", "collective_stuck", "process_stopped")
"""The checks that say a live rank hangs; an exited or finished rank clears them all."""


def normalise_phase(phase: object) -> str:
    """``"step"``, ``"PHASE_STEP"`` or the protobuf enum name all become ``"step"``."""
    text = str(phase).lower()
    text = text.removeprefix("phase_")
    return text if text in PHASES else "unspecified"


@dataclass(frozen=True)
class RankView:
    """What the agent knows about one local rank.

    ``last_progress_at``: when the step last advanced **or the phase last changed** (entering a
    checkpoint restarts the clock). ``step_times``: recent step durations in seconds, oldest first.
    ``started_at``: when the process started (the clock for a rank that has not reported yet).
    """

    rank: int
    pid: int
    alive: bool
    phase: str
    step: int
    last_report_at: datetime | None
    last_progress_at: datetime | None
    step_times: Sequence[float] = field(default_factory=tuple)
    started_at: datetime | None = None
    loss: float | None = None
    """The last reported loss; a non-finite one is reported (NaN/Inf usually means corruption)."""
    collective: str = ""
    """The collective the rank is inside now ('' when in none)."""
    collective_entered_at: datetime | None = None
    collective_waits: Sequence[float] = field(default_factory=tuple)
    """Per recent step, the longest single collective wait, oldest first (empty: the loop marks none)."""
    stopped_since: datetime | None = None
    """Since when the process has been seen stopped (state ``T``); None when it runs."""


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (no interpolation: with few samples p99 is the maximum)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def step_timeout(step_times: Sequence[float], policy: InspectorPolicy) -> tuple[timedelta, str]:
    """The calibrated step timeout and how it was found."""
    recent = [t for t in list(step_times)[-policy.calibration_window:] if t >= 0]
    if len(recent) < policy.warmup_steps:
        return policy.setup_timeout, f"warm-up ({len(recent)} of {policy.warmup_steps} step times known): setup timeout"
    p = percentile(recent, policy.step_timeout_percentile)
    calibrated = timedelta(seconds=policy.step_timeout_factor * p)
    if calibrated <= policy.step_timeout_floor:
        return policy.step_timeout_floor, f"floor (p{policy.step_timeout_percentile:g} step time {p:.3g}s)"
    return calibrated, f"{policy.step_timeout_factor:g} x p{policy.step_timeout_percentile:g} step time {p:.3g}s"


def collective_timeout(waits: Sequence[float], policy: InspectorPolicy) -> tuple[timedelta, str]:
    """How long a rank may wait inside one collective in the ``step`` phase, and how it was found. Until
    ``warmup_steps`` waits are known (the first steps compile and warm up) it is the setup timeout."""
    recent = [w for w in list(waits)[-policy.calibration_window:] if w >= 0]
    if len(recent) < policy.warmup_steps:
        return policy.setup_timeout, f"warm-up ({len(recent)} of {policy.warmup_steps} collective waits known): setup timeout"
    p = percentile(recent, policy.step_timeout_percentile)
    calibrated = timedelta(seconds=policy.collective_timeout_factor * p)
    basis = f"p{policy.step_timeout_percentile:g} collective wait {p:.3g}s"
    if calibrated <= policy.collective_timeout_floor:
        return policy.collective_timeout_floor, f"floor ({basis})"
    return calibrated, f"{policy.collective_timeout_factor:g} x {basis}"


def phase_timeout(view: RankView, policy: InspectorPolicy) -> tuple[timedelta | None, str]:
    """The timeout for the rank's current phase (``None``: cannot hang), with how it was found."""
    phase = normalise_phase(view.phase)
    if phase == "done":
        return None, "done"
    if phase == "checkpoint":
        return policy.checkpoint_timeout, "checkpoint timeout"
    if phase == "eval":
        return policy.eval_timeout, "eval timeout"
    if phase == "step":
        return step_timeout(view.step_times, policy)
    return policy.setup_timeout, f"{phase} timeout (setup)"


class RankProbe:
    name = "ranks"

    def __init__(self, policy: InspectorPolicy | None = None) -> None:
        self.policy = policy or InspectorPolicy()

    def collect(self, views: Sequence[RankView], now: datetime) -> list[Observation]:
        obs: list[Observation] = []
        for view in views:
            obs.extend(self._rank(view, now))
        return obs

    def _rank(self, view: RankView, now: datetime) -> list[Observation]:
        key = f"rank{view.rank}"
        phase = normalise_phase(view.phase)
        base = {"rank": view.rank, "pid": view.pid, "phase": phase, "step": view.step}
        if not view.alive:
            # An exit is RankExited's business (exit classification), not a hang.
            return [healthy("rank", check, key, "rank exited", **base) for check in LIVENESS_CHECKS]
        timeout, how = phase_timeout(view, self.policy)
        if timeout is None:
            return [healthy("rank", check, key, "done", **base) for check in LIVENESS_CHECKS]
        out = [self._loss(view, key, base)]
        hb_timeout = max(self.policy.heartbeat_timeout, timeout)
        out.append(self._check(view, now, "heartbeat_lost", view.last_report_at, hb_timeout,
                               f"max(heartbeat timeout, {how})", key, base, "no report from"))
        out.append(self._check(view, now, "no_progress", view.last_progress_at, timeout, how, key, base,
                               "no step or phase progress on"))
        out.append(self._collective(view, now, key, base))
        out.append(self._stopped(view, now, key, base))
        return out

    def _collective(self, view: RankView, now: datetime, key: str, base: dict[str, object]) -> Observation:
        if view.collective_entered_at is None or normalise_phase(view.phase) != "step":
            return healthy("rank", "collective_stuck", key, "not inside a collective of the step phase", **base)
        timeout, how = collective_timeout(view.collective_waits, self.policy)
        waited = now - view.collective_entered_at
        ev = {**base, "collective": view.collective, "waited_s": round(waited.total_seconds(), 3),
              "timeout_s": round(timeout.total_seconds(), 3), "timeout_basis": how}
        if waited > timeout:
            return Observation("rank", "collective_stuck", key, "failed", "medium", False,
                               f"rank {view.rank} has waited {ev['waited_s']}s inside {view.collective or 'a collective'} "
                               f"after step {view.step} (timeout {ev['timeout_s']}s: {how}): a peer it waits for "
                               f"has stopped", ev, immediate=True)
        return healthy("rank", "collective_stuck", key, **ev)

    def _stopped(self, view: RankView, now: datetime, key: str, base: dict[str, object]) -> Observation:
        if view.stopped_since is None:
            return healthy("rank", "process_stopped", key, "running", **base)
        stopped = now - view.stopped_since
        ev = {**base, "stopped_s": round(stopped.total_seconds(), 3),
              "timeout_s": round(self.policy.stopped_timeout.total_seconds(), 3)}
        if stopped >= self.policy.stopped_timeout:
            return Observation("rank", "process_stopped", key, "failed", "medium", False,
                               f"rank {view.rank} (pid {view.pid}) has been stopped (SIGSTOP) for {ev['stopped_s']}s "
                               f"in phase {ev['phase']} after step {view.step}", ev, immediate=True)
        return healthy("rank", "process_stopped", key, **ev)

    @staticmethod
    def _loss(view: RankView, key: str, base: dict[str, object]) -> Observation:
        if view.loss is not None and not math.isfinite(view.loss):
            return Observation("rank", "nonfinite_loss", key, "failed", "medium", False,
                               f"rank {view.rank} reported loss {view.loss} at step {view.step}",
                               {**base, "loss": str(view.loss)}, immediate=True)
        return healthy("rank", "nonfinite_loss", key, **base)

    def _check(self, view: RankView, now: datetime, check: str, since: datetime | None, timeout: timedelta,
               how: str, key: str, base: dict[str, object], what: str) -> Observation:
        reference = since or view.started_at
        if reference is None:
            return healthy("rank", check, key, "no reference time yet", **base)
        silent = now - reference
        ev = {**base, "silent_for_s": round(silent.total_seconds(), 3), "timeout_s": round(timeout.total_seconds(), 3),
              "timeout_basis": how}
        if silent > timeout:
            return Observation("rank", check, key, "failed", "medium", False,
                               f"{what} rank {view.rank} in phase {ev['phase']} for {ev['silent_for_s']}s "
                               f"(timeout {ev['timeout_s']}s: {how})", ev, immediate=True)
        return healthy("rank", check, key, **ev)

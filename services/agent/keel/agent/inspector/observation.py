"""What a probe saw in one sample: the input of the inspector core.

A probe returns ``Observation``s; the pure core (``core.py``) turns streams of them into
``NodeHealthChanged`` state changes. A probe reports a *sample*, not a verdict: the core applies
hysteresis (repetition windows, persistence, recovery hold) unless the observation says otherwise
(``immediate``, or a high-confidence fatal failure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["healthy", "degraded", "failed"]
Confidence = Literal["low", "medium", "high"]
Component = Literal["gpu", "host", "kernel", "nic", "disk", "rank", "unknown"]

STATUS_RANK: dict[Status, int] = {"healthy": 0, "degraded": 1, "failed": 2}
CONFIDENCE_RANK: dict[Confidence, int] = {"low": 0, "medium": 1, "high": 2}


@dataclass(frozen=True)
class Observation:
    """One sample of one check on one thing (``key``: ``"gpu3"``, ``"eth0"``, ``"mlx5_0/1"``, ``"rank5"``).

    ``(component, check, key)`` identifies a signal; the core keeps hysteresis per signal.

    - ``status``/``confidence``/``is_fatal``: the probe's reading of this sample alone. A ``failed``,
      ``high``-confidence, fatal sample (GPU lost, fatal XID, disk I/O error, MCE) transitions at once;
      anything else is a *soft* sample and must repeat or persist before it becomes ``failed``.
    - ``new_events``: for counter-like checks (link flaps, XIDs, OOM kills), how many new discrete
      occurrences this sample carries. ``None`` means a level signal: the core counts one occurrence
      per rising edge (a healthy sample followed by a bad one).
    - ``immediate``: the probe already applied its own calibrated threshold (a rank hang after its
      phase timeout, a full disk): the core takes the status as is, without repetition.
    - ``fatal_if_persists``: a ``failed`` soft sample that stays bad for ``policy.persist_fatal_after``
      becomes fatal with high confidence (a NIC or IB port that stays down).
    - ``informational``: not a health signal (``"no GPU on this node"``): emitted once as ``healthy``,
      never changes state.
    - healthy samples matter: they are what lets a signal recover after the hold time. A probe emits
      one for every check it could evaluate; a check it could not evaluate is left out and the probe
      reports a ``probe`` observation saying why (never a silent healthy).
    """

    component: Component
    check: str
    key: str
    status: Status = "healthy"
    confidence: Confidence = "high"
    is_fatal: bool = False
    detail: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    new_events: int | None = None
    immediate: bool = False
    fatal_if_persists: bool = False
    informational: bool = False

    @property
    def signal(self) -> tuple[str, str, str]:
        return (self.component, self.check, self.key)

    @property
    def is_fatal_hardware(self) -> bool:
        return self.status == "failed" and self.is_fatal and self.confidence == "high"


def healthy(component: Component, check: str, key: str, detail: str = "", /, **evidence: Any) -> Observation:
    # Positional-only: every keyword is evidence, whatever its name (a ``detail`` in it stays evidence).
    return Observation(component, check, key, "healthy", "high", False, detail, dict(evidence))


def fatal(component: Component, check: str, key: str, detail: str, *, event: bool = False, **evidence: Any) -> Observation:
    """A hardware-reported fatal fault: the core transitions at once, with high confidence.
    ``event``: a discrete occurrence (an XID) rather than a level that persists (a lost GPU, a full disk)."""
    return Observation(component, check, key, "failed", "high", True, detail, dict(evidence), new_events=1 if event else None)


def probe_failed(component: Component, probe: str, errors: list[str], **evidence: Any) -> Observation:
    """The probe could not read what it needs: a degraded signal that says why (never a silent healthy)."""
    detail = f"{probe} probe failed: " + "; ".join(errors)
    return Observation(component, "probe", probe, "degraded", "low", False, detail, {"errors": errors, **evidence})


def probe_ok(component: Component, probe: str) -> Observation:
    return healthy(component, "probe", probe)


def informational(component: Component, check: str, key: str, detail: str, **evidence: Any) -> Observation:
    return Observation(component, check, key, "healthy", "high", False, detail, dict(evidence), informational=True)


def finish(component: Component, probe: str, observations: list[Observation], errors: list[str]) -> list[Observation]:
    """Append the probe's own health: degraded with the reasons if anything failed to read, else healthy."""
    observations.append(probe_failed(component, probe, errors) if errors else probe_ok(component, probe))
    return observations

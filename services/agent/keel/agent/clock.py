"""The agent's time source, and its fault hook for a producer clock that is off.

Everything the agent stamps (every event's ``occurred_at``) and judges by its own clock (a command's
``expires_at``) reads ``NodeAgent.clock``, which ``keel run`` builds here.

Fault hook (tests, fault drills): ``KEEL_FAULT_CLOCK_OFFSET`` - a signed duration with a unit
(``"600s"``, ``"-10m"``, ``"+1.5h"``) - shifts that clock by that much, as a machine whose clock drifted
would be. The controller must then neither evict the node nor mis-date its commands (it judges by
arrival on its recorded clock) and reports the skew (``NodeClockSkewed``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta

from keel.events.envelope import now_utc
from keel.events.units import parse_duration

CLOCK_OFFSET_ENV = "KEEL_FAULT_CLOCK_OFFSET"
"""The fault hook's variable: the agent's clock runs this far ahead (or, negative, behind) of the host's."""
MAX_OFFSET = timedelta(days=365)


def clock_offset(environ: Mapping[str, str]) -> timedelta:
    """The offset ``KEEL_FAULT_CLOCK_OFFSET`` asks for (zero when unset). Raises ``ValueError`` with a
    reason on a value without a unit or beyond a year."""
    text = environ.get(CLOCK_OFFSET_ENV, "").strip()
    if not text:
        return timedelta(0)
    sign = -1 if text.startswith("-") else 1
    try:
        magnitude = parse_duration(text.lstrip("+-").strip())
    except ValueError as exc:
        raise ValueError(f"{CLOCK_OFFSET_ENV}={text!r}: {exc}") from None
    if magnitude > MAX_OFFSET:
        raise ValueError(f"{CLOCK_OFFSET_ENV}={text!r}: more than {MAX_OFFSET.days} days")
    return sign * magnitude


def agent_clock(environ: Mapping[str, str]) -> Callable[[], datetime]:
    """The agent's clock: the host's UTC time, shifted by the fault hook's offset if one is set."""
    offset = clock_offset(environ)
    if not offset:
        return now_utc
    return lambda: now_utc() + offset


def plausible_age_s(now: datetime, issued_at: datetime, within_s: float) -> float:
    """How long ago a command was issued (``issued_at``: the controller's recorded clock), by this agent's
    clock ``now``, when that is plausible: between 0 and ``within_s``. Anything else says more about the
    two clocks than about the command (a node whose clock is minutes off), so it counts as just issued:
    a skewed clock neither cuts a round's time to nothing nor stretches it."""
    age = (now - issued_at).total_seconds()
    return age if 0.0 <= age <= within_s else 0.0

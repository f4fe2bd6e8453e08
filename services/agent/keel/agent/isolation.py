"""Each piece of the agent's periodic work runs in isolation: an exception is logged, rate-limited, and
the loop goes on with the other pieces and the next tick.

The agent's loop does many independent things on every wake-up (fold the ranks' reports, report exits,
sample the probes, checkpoint duties, heartbeat, zygote upkeep). A bug or an unforeseen state in one of
them (a slot file a reader chokes on, a probe returning garbage) must not end the agent, and with it the
ranks it supervises, nor starve the others: the heartbeat in particular must go on, or the controller
takes a healthy node for lost. ``Pieces.run(name, fn)`` is the guard; ``should_log`` (pure) says when a
failure that keeps happening is worth another log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

LOG_EVERY_S = 60.0
"""A piece that keeps failing is logged once with its traceback, then at most once per this many seconds
(with the count of failures in between)."""


@dataclass
class PieceFailures:
    """What one piece's failures were so far."""

    total: int = 0
    since_logged: int = 0
    logged_at_s: float | None = None
    last_error: str = ""


def should_log(failures: PieceFailures, now_s: float, every_s: float = LOG_EVERY_S) -> bool:
    """Whether a new failure of a piece is logged (pure): the first one always, then once per ``every_s``."""
    return failures.logged_at_s is None or now_s - failures.logged_at_s >= every_s


class Pieces:
    """Runs the named pieces of periodic work, each guarded; ``failures`` counts per piece."""

    def __init__(self, owner: str, logger: logging.Logger, *, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.owner = owner
        self.log = logger
        self.every_s = every_s
        self.clock = clock
        self.failures: dict[str, PieceFailures] = {}

    def run(self, name: str, fn: Callable[..., T], *args: object, default: T | None = None,
            **kwargs: object) -> T | None:
        """``fn(*args, **kwargs)``; on an exception (not ``BaseException``: a cancel or an exit still ends the loop):
        log it, rate-limited, and return ``default``."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the guard's whole point
            self.failed(name, exc)
            return default

    def failed(self, name: str, exc: BaseException) -> None:
        failures = self.failures.setdefault(name, PieceFailures())
        failures.total += 1
        failures.since_logged += 1
        failures.last_error = f"{type(exc).__name__}: {exc}"[:500]
        now = self.clock()
        if should_log(failures, now, self.every_s):
            first = failures.logged_at_s is None
            self.log.error("%s: %s failed (%d time%s%s); going on with the rest", self.owner, name,
                           failures.since_logged, "" if failures.since_logged == 1 else "s",
                           "" if first else f" in the last {self.every_s:.0f} s", exc_info=exc if first else None)
            if not first:
                self.log.error("%s: %s: latest error: %s", self.owner, name, failures.last_error)
            failures.logged_at_s = now
            failures.since_logged = 0

    def total(self) -> int:
        return sum(f.total for f in self.failures.values())

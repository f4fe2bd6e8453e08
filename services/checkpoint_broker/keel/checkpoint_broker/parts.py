"""Per-node parts of the broker's large decisions: restore plans and backup assignments list every rank,
~200-250 B each, so one job-wide event passes the bus's event limit (``bus.max_event_bytes``, 256 KiB)
at about 1,000 ranks. Each node's share goes on that node's subject instead (its agent reads only its
own), split further into parts of at most ``PART_BUDGET_BYTES`` of entries when one node has more.

Pure and deterministic (entries keep their order; sizes are their JSON lengths), so a replay splits
the same way. An entry larger than the budget on its own gets a part of its own: the kernel's size
check at publish (``keel.kernel.decider.publishable``) refuses it with a clear error, never a crash loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from keel.events.envelope import EventPayload

E = TypeVar("E", bound=EventPayload)

PART_BUDGET_BYTES = 64 * 1024
"""The most entry bytes (JSON) in one part: a quarter of the default event limit, leaving room for the
envelope and the reason. With a smaller ``bus.max_event_bytes`` the broker's policy uses a quarter of
that instead (``BrokerPolicy.part_budget_bytes``)."""


def split(entries: Sequence[E], budget_bytes: int = PART_BUDGET_BYTES) -> list[list[E]]:
    """``entries`` in order, cut into consecutive parts of at most ``budget_bytes`` of JSON each (an
    entry over the budget alone in its part); no parts for no entries."""
    parts: list[list[E]] = []
    current: list[E] = []
    used = 0
    for entry in entries:
        size = len(entry.model_dump_json()) + 1  # the separating comma
        if current and used + size > budget_bytes:
            parts.append(current)
            current, used = [], 0
        current.append(entry)
        used += size
    if current:
        parts.append(current)
    return parts

"""Recorder core: pure projection logic and batch classification. No I/O here.

A projection turns newly recorded events into row upserts for a read model. The adapter applies them
in the same transaction as the events themselves, so a read model is never ahead of or behind the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from keel.events.envelope import Event
from keel.events.types import NodeEvicted, NodeHealthChanged


@dataclass(frozen=True)
class Upsert:
    """Set ``values`` on the row of ``table`` identified by ``key`` (insert it if missing)."""

    table: str
    key: tuple[tuple[str, Any], ...]
    values: tuple[tuple[str, Any], ...]
    only_if_newer: str | None = None
    """A column among ``values``: update an existing row only if this value is not older than the
    stored one (redelivered events arrive out of order; a read model must not go back in time)."""
    order: Any = None
    """That column's value, to merge several upserts of one batch in time order."""


class Projection(Protocol):
    name: str

    def project(self, events: list[Event]) -> list[Upsert]:
        """Row changes for these newly recorded events, in order; later upserts win."""
        ...


@dataclass
class NodeStatusProjection:
    """``node_status``: each node's latest health and whether it was evicted."""

    name: str = "node_status"

    def project(self, events: list[Event]) -> list[Upsert]:
        upserts = []
        for event in events:
            payload = event.payload
            key = (("job_id", event.job_id), ("node_id", getattr(payload, "node_id", "")))
            values: tuple[tuple[str, Any], ...]
            if isinstance(payload, NodeHealthChanged):
                values = (
                    ("health", payload.status),
                    ("detail", f"{payload.component}/{payload.check}: {payload.detail}".strip()),
                    ("last_event_id", event.id),
                    ("updated_at", event.occurred_at),
                )
            elif isinstance(payload, NodeEvicted) and payload.outcome == "evicted":
                values = (("evicted", True), ("last_event_id", event.id), ("updated_at", event.occurred_at))
            else:
                continue
            upserts.append(Upsert("node_status", key, values, only_if_newer="updated_at", order=event.occurred_at))
        return upserts


@dataclass
class BatchPlan:
    """How the adapter should treat one fetched batch."""

    accepted: list[tuple[int, dict[str, Any] | None, Event]] = field(default_factory=list)
    """(stream sequence, envelope as sent if it was an older version else None, event) for every valid
    message, in stream order."""
    rejected: list[tuple[int, str]] = field(default_factory=list)
    """(stream sequence, reason) for every message to dead-letter."""


DEFAULT_PROJECTIONS: tuple[Projection, ...] = (NodeStatusProjection(),)


def trim_point(*, first_seq: int, last_seq: int, messages: int, stored_bytes: int, max_bytes: int, max_msgs: int,
               recorded_floor: int, trim_at: float, trim_to: float) -> int | None:
    """Where to purge the events stream (every message below the returned sequence), or None.

    The stream discards new messages at its limit, so the recorder makes room: once it is ``trim_at`` full
    (of ``max_bytes`` or ``max_msgs``, whichever is fuller; a limit <= 0 is none), purge the oldest messages
    down to about ``trim_to`` of the limit, but never past ``recorded_floor``, the highest sequence below
    which the recorder has stored (acknowledged) every message: an unrecorded event is never purged."""
    fills = [stored_bytes / max_bytes] if max_bytes > 0 else []
    if max_msgs > 0:
        fills.append(messages / max_msgs)
    fill = max(fills, default=0.0)
    if messages <= 0 or fill < trim_at:
        return None
    keep = int(messages * trim_to / fill)
    below = min(last_seq + 1 - keep, recorded_floor + 1)
    return below if below > first_seq else None


@dataclass
class LagReporting:
    """Whether the recorder's lag was above its threshold at the last report, and when that was."""

    above: bool = False
    last_report_s: float | None = None


def lag_report_due(state: LagReporting, lag_s: float, now_s: float, *, threshold_s: float,
                   interval_s: float) -> tuple[LagReporting, bool]:
    """Report the lag when it crosses ``threshold_s`` (either way) and every ``interval_s`` while it stays
    above (``now_s``: a monotonic clock); (the new state, whether to report now)."""
    above = lag_s > threshold_s
    crossed = above != state.above
    periodic = above and (state.last_report_s is None or now_s - state.last_report_s >= interval_s)
    if crossed or periodic:
        return LagReporting(above, now_s), True
    return state, False

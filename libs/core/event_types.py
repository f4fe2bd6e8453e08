"""Every Keel event type, in one module, named in the past tense.

Adding a type: define a frozen payload model here, register it with ``@event_type``, add a golden
fixture under ``tests/golden/<Type>/v<N>.json`` and regenerate the catalogue (``keel events schema
--write``). Changing a payload's shape: bump its version, keep the old shape as a golden fixture and add
an ``@upcaster`` from the old version. Never change a released version in place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AwareDatetime, Field

from keel.core.events import EventPayload, event_type, upcaster

Confidence = Literal["low", "medium", "high"]
HealthStatus = Literal["healthy", "degraded", "failed"]


@event_type("JobRegistered", version=1, aggregate="job")
class JobRegistered(EventPayload):
    """A training job became known to Keel with its initial node set."""

    nodes: list[str] = Field(min_length=1)
    world_size: int = Field(ge=1)
    registered_by: str


@event_type("NodeRegistered", version=1, aggregate="node")
class NodeRegistered(EventPayload):
    """A node agent announced itself (an active node of the job, or an idle warm standby)."""

    node_id: str
    host: str
    standby: bool = False
    fault_domain: str = ""


@event_type("NodeHealthChanged", version=2, aggregate="node")
class NodeHealthChanged(EventPayload):
    """The inspector's verdict on one node changed (state changes only, never every sample).

    v1 carried a single ``healthy`` flag; v2 says which component and check, how sure it is, and
    whether the fault is fatal (a high-confidence fatal fault is rung 1 of the ladder).
    """

    node_id: str
    status: HealthStatus
    component: Literal["gpu", "host", "kernel", "nic", "disk", "rank", "unknown"]
    check: str
    confidence: Confidence
    is_fatal: bool
    detail: str = ""
    evidence: dict[str, Any] = Field(default_factory=dict)


@upcaster("NodeHealthChanged", from_version=1)
def _node_health_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 could not say what failed or how sure it was: treat "unhealthy" as a failed, medium-confidence,
    # non-fatal signal so an old event never triggers an immediate eviction on replay.
    healthy = bool(payload.get("healthy"))
    return {
        "node_id": payload["node_id"],
        "status": "healthy" if healthy else "failed",
        "component": "unknown",
        "check": payload.get("check", "legacy"),
        "confidence": "medium",
        "is_fatal": False,
        "detail": payload.get("detail", ""),
        "evidence": {},
    }


@event_type("TimerTicked", version=1, aggregate="clock")
class TimerTicked(EventPayload):
    """Time as an input: the clock service's tick, recorded so a replay sees the time the live run saw."""

    now: AwareDatetime


@event_type("NodeEvictionDecided", version=1, aggregate="node")
class NodeEvictionDecided(EventPayload):
    """The controller decided to evict a node. A command: executors ignore it after ``expires_at``."""

    node_id: str
    rung: int = Field(ge=1, le=6)
    reason: str
    evidence: list[str] = Field(default_factory=list)
    """Ids of the events that caused the decision."""
    expires_at: AwareDatetime
    observe_only: bool = False


@event_type("NodeEvicted", version=1, aggregate="node")
class NodeEvicted(EventPayload):
    """An actuator carried out an eviction (or reports why it could not)."""

    node_id: str
    decision_id: str
    actuator: str
    outcome: Literal["evicted", "expired", "failed", "skipped_observe_only"]
    detail: str = ""



# -- node agent, ranks and fault injection (node agent issue) ---------------------------------------

ExitClass = Literal["user_code", "infrastructure", "unknown", "stopped_by_agent", "success"]
FaultKind = Literal["crash", "hang", "slow", "nan", "gpu-lost", "xid", "nic-down", "oom", "disk-full"]


@event_type("NodeHeartbeat", version=1, aggregate="node")
class NodeHeartbeat(EventPayload):
    """Periodic liveness of a node agent and a summary of its ranks (not every sample)."""

    node_id: str
    standby: bool = False
    ranks_alive: int = Field(ge=0)
    ranks_expected: int = Field(ge=0)
    last_step: int = -1
    step_time_p50_s: float | None = None
    """Median step time over the last interval, across this node's ranks."""
    health: HealthStatus = "healthy"


@event_type("RankStarted", version=1, aggregate="rank")
class RankStarted(EventPayload):
    """The agent started one training process. ``generation`` counts in-place restarts of the job."""

    node_id: str
    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    pid: int
    generation: int = Field(ge=0)


@event_type("RankExited", version=1, aggregate="rank")
class RankExited(EventPayload):
    """A training process ended, with its exit status, the tail of its stderr and a classification."""

    node_id: str
    rank: int = Field(ge=0)
    pid: int
    generation: int = Field(ge=0)
    exit_code: int | None
    signal: str | None = None
    classification: ExitClass
    error_type: str = ""
    """The exception class or error marker found in stderr (``TypeError``, ``NCCL error``, ``OOM``...)."""
    stderr_tail: str = ""
    reason: str = ""
    """Why the classifier chose ``classification``."""


@event_type("RanksRestartRequested", version=1, aggregate="node")
class RanksRestartRequested(EventPayload):
    """A command: restart this node's ranks in place as ``generation``. Ignored after ``expires_at``."""

    node_id: str
    generation: int = Field(ge=1)
    reason: str
    expires_at: AwareDatetime


@event_type("RanksRestarted", version=1, aggregate="node")
class RanksRestarted(EventPayload):
    """The agent carried out (or refused) a restart command."""

    node_id: str
    command_id: str
    generation: int = Field(ge=0)
    outcome: Literal["restarted", "expired", "failed", "stale_generation"]
    detail: str = ""


@event_type("FaultInjected", version=1, aggregate="node")
class FaultInjected(EventPayload):
    """``keel inject`` broke something on purpose; detection latency is measured from this event."""

    kind: FaultKind
    node_id: str
    rank: int | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    injected_by: str = "keel inject"

"""Controller core: a pure Decider over the event log.

So far it implements rung 1 of the escalation ladder (ARCHITECTURE.md): a high-confidence, fatal
hardware signal evicts the node at once. The other rungs arrive with the controller issue. Every
decision carries a reason and the ids of the events that caused it; every eviction is a command with
an expiry, so a cold start never executes a stale one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta

from keel.core.decider import Decision, Proposal
from keel.core.event_types import NodeEvicted, NodeEvictionDecided, NodeHealthChanged, NodeRegistered
from keel.core.events import Event

HARDWARE_COMPONENTS = frozenset({"gpu", "nic", "disk", "kernel", "host"})


@dataclass(frozen=True)
class NodeView:
    node_id: str
    standby: bool = False
    eviction_pending: str | None = None
    """Id of an eviction decision not yet carried out."""
    evicted: bool = False


@dataclass(frozen=True)
class ControllerState:
    nodes: dict[str, NodeView] = field(default_factory=dict)

    def node(self, node_id: str) -> NodeView:
        return self.nodes.get(node_id, NodeView(node_id))

    def with_node(self, view: NodeView) -> ControllerState:
        return ControllerState(nodes={**self.nodes, view.node_id: view})


@dataclass(frozen=True)
class ControllerPolicy:
    command_ttl: timedelta = timedelta(minutes=5)
    observe_only: bool = False


class ControllerDecider:
    """Rung 1: evict a node on a high-confidence fatal hardware signal."""

    name = "controller"

    def __init__(self, policy: ControllerPolicy | None = None) -> None:
        self.policy = policy or ControllerPolicy()

    def initial_state(self) -> ControllerState:
        return ControllerState()

    def interested_in(self, event: Event) -> bool:
        return event.type == NodeHealthChanged.event_name

    def evolve(self, state: ControllerState, event: Event) -> ControllerState:
        # Health reports are the bulk of the log; rung 1 decides on the report itself, so they do not
        # change this state (copying the node map for each would cap replay speed).
        payload = event.payload
        if isinstance(payload, NodeRegistered):
            return state.with_node(replace(state.node(payload.node_id), standby=payload.standby))
        if isinstance(payload, NodeEvictionDecided):
            return state.with_node(replace(state.node(payload.node_id), eviction_pending=str(event.id)))
        if isinstance(payload, NodeEvicted):
            view = state.node(payload.node_id)
            done = payload.outcome == "evicted"
            return state.with_node(replace(view, eviction_pending=None, evicted=view.evicted or done))
        return state

    def decide(self, state: ControllerState, event: Event) -> Decision:
        payload = event.payload
        assert isinstance(payload, NodeHealthChanged)
        if payload.status != "failed":
            return Decision.nothing(f"{payload.node_id} is {payload.status}: nothing to do")
        node = state.node(payload.node_id)
        if node.evicted:
            return Decision.nothing(f"{payload.node_id} is already evicted")
        if node.eviction_pending:
            return Decision.nothing(f"{payload.node_id} already has eviction {node.eviction_pending} pending")
        if not (payload.is_fatal and payload.confidence == "high" and payload.component in HARDWARE_COMPONENTS):
            return Decision.nothing(
                f"{payload.node_id}: {payload.component}/{payload.check} failed with {payload.confidence} confidence, "
                f"fatal={payload.is_fatal}; not a rung-1 signal, left to the higher rungs"
            )
        reason = (
            f"rung 1: high-confidence fatal {payload.component} fault on {payload.node_id} "
            f"({payload.check}: {payload.detail or 'no detail'}); evict now rather than diagnose"
        )
        eviction = NodeEvictionDecided(
            node_id=payload.node_id,
            rung=1,
            reason=reason,
            evidence=[str(event.id)],
            expires_at=event.occurred_at + self.policy.command_ttl,
            observe_only=self.policy.observe_only,
        )
        return Decision(reason=reason, proposals=(Proposal(eviction, subject=f"node/{payload.node_id}"),))

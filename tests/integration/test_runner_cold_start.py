"""The decider runner's cold start with real NATS and PostgreSQL: an input the log holds but no decider
decided on (the service died in between) is decided once, and the echo of that decision is not folded a
second time."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import pytest

from keel.events.envelope import Event
from keel.events.types import NodeEvictionDecided, NodeHealthChanged
from keel.infra.runner import DeciderRunner
from keel.kernel.decider import Decision, Proposal
from tests.factories import health_event

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Counted:
    evictions_folded: int = 0


class EvictOnFailure:
    """Evicts every node reported failed; counts the evictions it folded (what a breaker would count)."""

    name = "evict-on-failure"

    def initial_state(self) -> Counted:
        return Counted()

    def interested_in(self, event: Event) -> bool:
        return isinstance(event.payload, NodeHealthChanged)

    def evolve(self, state: Counted, event: Event) -> Counted:
        if isinstance(event.payload, NodeEvictionDecided):
            return Counted(state.evictions_folded + 1)
        return state

    def decide(self, state: Counted, event: Event) -> Decision:
        p = event.payload
        assert isinstance(p, NodeHealthChanged)
        return Decision("evict", (Proposal(NodeEvictionDecided(node_id=p.node_id, rung=1, reason="failed",
                                                               expires_at=event.occurred_at + timedelta(minutes=5)),
                                           subject=f"node/{p.node_id}"),))


async def test_an_input_decided_while_catching_up_is_folded_once_with_its_echo(keel_env) -> None:
    fault = health_event("n1", status="failed", fatal=True, confidence="high", component="gpu")
    await keel_env.bus.publish(fault)
    await keel_env.start_recorder()
    assert await keel_env.wait_for_count(1) == 1  # in the log, never decided on

    runner = DeciderRunner(EvictOnFailure(), keel_env.bus, keel_env.store, fetch_timeout_s=0.1)
    await runner.start()
    for _ in range(50):  # the redelivered input, then the echo of the decision
        await runner.run_once()
        if runner.stats.handled >= 2:
            break
    assert runner.stats.emitted == 1
    assert runner.stats.handled == 2, runner.stats
    assert runner.session.state.evictions_folded == 1
    assert await keel_env.wait_for_count(2) == 2

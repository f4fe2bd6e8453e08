"""The decider runner's cold start with real NATS and PostgreSQL.

- An input the log holds but no decider decided on (the service died in between) is decided once, and
  the echo of that decision is not folded a second time.
- A decision published only in part before a crash has its missing events published after the restart,
  with the same ids, and nothing is folded or recorded twice.
- An input the consumer acknowledged is never decided again; a log that holds another decision than the
  one the decider takes now keeps the recorded one.
- The runner survives the events stream being deleted and created again, running or stopped.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta

import pytest

from keel.events.envelope import Event
from keel.events.types import NodeEvictionDecided, NodeHealthChanged
from keel.infra.runner import DeciderRunner
from keel.kernel.decider import Decision, Proposal, materialise
from keel.kernel.replay import verify
from tests.factories import health_event

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Counted:
    evictions_folded: int = 0


class EvictOnFailure:
    """Evicts every node reported failed (and, with ``spread``, that many neighbours, in one decision);
    counts the evictions it folded (what a breaker would count)."""

    name = "evict-on-failure"

    def __init__(self, spread: int = 1) -> None:
        self.spread = spread

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
        nodes = [p.node_id] + [f"{p.node_id}-peer{i}" for i in range(1, self.spread)]
        return Decision("evict", tuple(
            Proposal(NodeEvictionDecided(node_id=node, rung=1, reason="failed",
                                         expires_at=event.occurred_at + timedelta(minutes=5)), subject=f"node/{node}")
            for node in nodes))


async def drain(runner: DeciderRunner, rounds: int = 20) -> None:
    for _ in range(rounds):
        await runner.run_once()


async def recorded(keel_env) -> list[Event]:  # type: ignore[no-untyped-def]
    return [r.event async for r in keel_env.store.read()]


async def test_an_input_decided_while_catching_up_is_folded_once_with_its_echo(keel_env) -> None:
    fault = health_event("n1", status="failed", fatal=True, confidence="high", component="gpu")
    await keel_env.bus.publish(fault)
    await keel_env.start_recorder()
    assert await keel_env.wait_for_count(1) == 1  # in the log, never decided on

    runner = DeciderRunner(EvictOnFailure(), keel_env.bus, keel_env.store, fetch_timeout_s=0.1)
    await runner.start()
    assert runner.stats.caught_up == 1 and runner.stats.emitted == 1  # decided at cold start, in log order
    await drain(runner)  # the redelivered input (skipped) and the echo of the decision
    assert runner.stats.emitted == 1
    assert runner.stats.skipped_redelivered == 1, runner.stats
    assert runner.stats.handled == 1, runner.stats  # the echo, taken without being evolved again
    assert runner.session.state.evictions_folded == 1
    assert await keel_env.wait_for_count(2) == 2


async def test_a_decision_published_in_part_is_completed_after_a_restart(keel_env) -> None:
    decider = EvictOnFailure(spread=3)
    fault = health_event("n1", status="failed", fatal=True, confidence="high", component="gpu")
    decision = materialise(decider.name, fault, decider.decide(decider.initial_state(), fault))
    assert len(decision) == 3
    # The crash: the input and the first of the decision's three events reached the stream, no more.
    await keel_env.bus.publish(fault)
    await keel_env.bus.publish(decision[0])
    await keel_env.start_recorder()
    assert await keel_env.wait_for_count(2) == 2

    runner = DeciderRunner(decider, keel_env.bus, keel_env.store, fetch_timeout_s=0.1)
    await runner.start()
    assert runner.stats.emitted == 2  # only the two the log lacks
    await drain(runner)
    assert await keel_env.wait_for_count(4) == 4
    await asyncio.sleep(0.5)
    log = await recorded(keel_env)
    assert len(log) == 4 and len({e.id for e in log}) == 4
    assert sorted(str(e.id) for e in log[1:]) == sorted(str(e.id) for e in decision)  # the same ids
    assert runner.session.state.evictions_folded == 3  # each folded once: no breaker counts twice
    assert verify(EvictOnFailure(spread=3), log).clean


async def test_an_acknowledged_input_is_not_decided_again(keel_env) -> None:
    await keel_env.start_recorder()
    first = DeciderRunner(EvictOnFailure(spread=2), keel_env.bus, keel_env.store, fetch_timeout_s=0.1)
    await first.start()
    await keel_env.bus.publish(health_event("n1", status="failed", fatal=True, confidence="high", component="gpu"))
    await drain(first)
    assert first.stats.emitted == 2
    assert await keel_env.wait_for_count(3) == 3
    await first._events._sub.unsubscribe()  # type: ignore[union-attr]  # the service stops

    again = DeciderRunner(EvictOnFailure(spread=2), keel_env.bus, keel_env.store, fetch_timeout_s=0.1)
    await again.start()
    await drain(again, 5)
    assert again.stats.emitted == 0 and again.stats.caught_up == 0, again.stats
    assert again.session.state == first.session.state
    assert await keel_env.store.count() == 3


async def test_the_recorded_decision_stands_when_the_decider_would_now_decide_otherwise(keel_env) -> None:
    fault = health_event("n1", status="failed", fatal=True, confidence="high", component="gpu")
    old = EvictOnFailure(spread=1)
    await keel_env.bus.publish(fault)
    other = materialise(old.name, fault, Decision("evict elsewhere", (Proposal(
        NodeEvictionDecided(node_id="n9", rung=1, reason="old rule", expires_at=fault.occurred_at), subject="node/n9"),)))
    await keel_env.bus.publish(other[0])
    await keel_env.start_recorder()
    assert await keel_env.wait_for_count(2) == 2

    runner = DeciderRunner(EvictOnFailure(spread=2), keel_env.bus, keel_env.store, fetch_timeout_s=0.1)
    await runner.start()
    await drain(runner, 5)
    assert runner.stats.emitted == 0
    assert runner.session.state.evictions_folded == 1  # the recorded one, once
    assert await keel_env.store.count() == 2


async def test_the_runner_goes_on_when_the_stream_is_recreated_under_it(keel_env, monkeypatch) -> None:
    monkeypatch.setattr("keel.infra.consumer.RESET_CHECK_INTERVAL_S", 0.2)
    await keel_env.start_recorder()
    runner = DeciderRunner(EvictOnFailure(), keel_env.bus, keel_env.store, fetch_timeout_s=0.1)
    await runner.start()
    for node in ("n1", "n2", "n3"):
        await keel_env.bus.publish(health_event(node, status="failed", fatal=True, confidence="high", component="gpu"))
    await drain(runner)
    assert runner.stats.emitted == 3
    assert await keel_env.wait_for_count(6) == 6

    await keel_env.bus.js.delete_stream(keel_env.settings.bus.stream)
    await keel_env.bus.ensure_streams()  # a new stream: sequences start from 1 again
    await keel_env.bus.publish(health_event("n4", status="failed", fatal=True, confidence="high", component="gpu"))
    for _ in range(60):
        await runner.run_once()
        if runner.stats.emitted == 4:
            break
    assert runner.stats.emitted == 4, runner.stats  # the input on the new stream was decided, not skipped
    assert runner._events.stats.resets == 1  # type: ignore[union-attr]


async def test_a_cold_start_after_the_stream_was_recreated_decides_only_the_new_stream(keel_env) -> None:
    recorder = await keel_env.start_recorder()
    first = DeciderRunner(EvictOnFailure(), keel_env.bus, keel_env.store, fetch_timeout_s=0.1)
    await first.start()
    for node in ("n1", "n2", "n3"):
        await keel_env.bus.publish(health_event(node, status="failed", fatal=True, confidence="high", component="gpu"))
    await drain(first)
    assert await keel_env.wait_for_count(6) == 6
    await first._events._sub.unsubscribe()  # type: ignore[union-attr]  # the service stops

    # While it is down: the stream is recreated, and one new input arrives and is recorded.
    await keel_env.bus.js.delete_stream(keel_env.settings.bus.stream)
    await keel_env.bus.ensure_streams()
    assert recorder is not None
    await keel_env.bus.publish(health_event("n4", status="failed", fatal=True, confidence="high", component="gpu"))
    assert await keel_env.wait_for_count(7, timeout_s=60) == 7

    again = DeciderRunner(EvictOnFailure(), keel_env.bus, keel_env.store, fetch_timeout_s=0.1)
    await again.start()
    await drain(again)
    assert again.stats.emitted == 1, again.stats  # n4 only: n1..n3 were decided on the old stream
    assert again.session.state.evictions_folded == 4
    assert await keel_env.wait_for_count(8) == 8

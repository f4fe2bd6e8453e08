"""Forged commands on a real NATS server are dead-lettered with the reason and never carried out: a node
agent's command consumer and the actuator check every command's signature against the keyring before acting
(``keel.events.signing``), the recorder keeps none of them in the log, and ``keel replay --verify`` flags one
that reached the log another way. The genuine command published after each forged one is carried out, so
the consumer was running when the forgery was refused."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from keel.actuator.adapter import ActuatorService
from keel.actuator.local import LocalActuator
from keel.agent.consumer import CommandConsumer
from keel.events.envelope import Event, EventPayload, now_utc
from keel.events.signing import SigningKey, sign_event
from keel.events.types import NodeEvictionDecided, RanksRestartRequested
from keel.infra.bus import HEADER_DLQ_REASON, Bus
from keel.infra.outbox import Outbox
from keel.infra.signing import consumer_signing
from keel.infra.store import append_events, event_row
from tests.integration.test_agent_command_subjects import JOB, NODES, make_agent
from tests.integration.test_crashes import service_env
from tests.integration.test_replay_cli import keel

pytestmark = pytest.mark.integration

FORGER = SigningKey("controller", "controller", Ed25519PrivateKey.generate())
"""An attacker's key under the controller's name: not the key the keyring holds."""


def command(payload: EventPayload, subject: str, job: str = JOB) -> Event:
    return Event.create(payload, job_id=job, subject=subject, producer="controller", occurred_at=now_utc())


async def publish_unsigned(keel_env, event: Event) -> None:
    """What anyone who can reach NATS can do: publish the bytes of an unsigned command."""
    await keel_env.bus.publish_raw(keel_env.bus.subject_for(event), event.to_json(), msg_id=str(event.id))


async def dead_letter_reasons(bus: Bus, expected: int, timeout_s: float = 20.0) -> dict[str, str]:
    """Event id -> the reason of each dead letter on the DLQ stream (at least ``expected`` of them)."""
    sub = await bus.js.pull_subscribe(f"{bus.dlq_prefix}.>", stream=bus.settings.dlq_stream)
    reasons: dict[str, str] = {}
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while len(reasons) < expected and asyncio.get_running_loop().time() < deadline:
            try:
                msgs = await sub.fetch(10, timeout=1)
            except TimeoutError:
                continue
            for msg in msgs:
                reasons[json.loads(msg.data)["id"]] = (msg.headers or {})[HEADER_DLQ_REASON]
                await msg.ack()
    finally:
        await sub.unsubscribe()
    return reasons


async def test_a_forged_command_is_dead_lettered_and_not_handed_to_the_agent(keel_env, scratch_dir: Path) -> None:
    await keel_env.start_recorder()
    node = NODES[0]
    expires = now_utc() + timedelta(minutes=5)
    forged, unsigned, genuine = (
        command(RanksRestartRequested(node_id=node, generation=g, reason="test", expires_at=expires), f"node/{node}")
        for g in (1, 2, 3))
    await keel_env.bus.publish(sign_event(forged, FORGER))  # already signed: the harness bus keeps it as it is
    await publish_unsigned(keel_env, unsigned)
    await keel_env.bus.publish(genuine)  # signed by the controller's key, as the controller's bus signs it

    stop = asyncio.Event()
    received: list[Event] = []
    outbox = Outbox(keel_env.settings.nats_url, keel_env.settings.bus, name="test-signed",
                    signing=consumer_signing(keel_env.settings))
    agent = make_agent(scratch_dir, node, outbox)
    agent.handle_command = received.append  # type: ignore[method-assign]
    consumer = CommandConsumer(agent)
    tasks = [asyncio.create_task(outbox.run(stop)), asyncio.create_task(consumer.run(stop))]
    try:
        deadline = asyncio.get_running_loop().time() + 20
        while not received:
            assert asyncio.get_running_loop().time() < deadline, "the genuine command never reached the agent"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        assert [e.id for e in received] == [genuine.id]
        assert received[0].signed_by == "controller"
        assert consumer.events is not None and consumer.events.stats.refused == 2

        reasons = await dead_letter_reasons(keel_env.bus, 2)
        assert "bad signature" in reasons[str(forged.id)] and "RanksRestartRequested" in reasons[str(forged.id)]
        assert "unsigned: RanksRestartRequested" in reasons[str(unsigned.id)]
        # The recorder refused them too: the log holds only the genuine command; its dead letters say why.
        assert await keel_env.wait_for_count(1) == 1
        stored = [r.event async for r in keel_env.store.read(types=["RanksRestartRequested"])]
        assert [e.id for e in stored] == [genuine.id] and stored[0].signature == received[0].signature
        letters = await keel_env.store.dead_letters()
        assert sorted("bad signature" in d["reason"] for d in letters) == [False, True], letters
    finally:
        stop.set()
        for task in tasks:
            try:
                await asyncio.wait_for(task, 5)
            except Exception:  # noqa: BLE001 - teardown: the test has already reported
                task.cancel()
        await outbox.close()
        agent.channel.close()


async def test_a_forged_eviction_is_dead_lettered_and_not_carried_out(keel_env, scratch_dir: Path) -> None:
    job = "act"
    expires = now_utc() + timedelta(minutes=5)
    forged = command(NodeEvictionDecided(node_id="n00", rung=1, reason="forged", expires_at=expires), "node/n00", job)
    genuine = command(NodeEvictionDecided(node_id="n01", rung=1, reason="test", expires_at=expires), "node/n01", job)
    await keel_env.bus.publish(sign_event(forged, FORGER))
    await keel_env.bus.publish(genuine)
    service = ActuatorService(keel_env.bus, LocalActuator(scratch_dir / "no-cluster", grace_s=1))
    await service.start()
    deadline = asyncio.get_running_loop().time() + 20
    while not service.carried_out:
        assert asyncio.get_running_loop().time() < deadline, "the genuine eviction was never carried out"
        await service.run_once()
    # The genuine eviction was attempted (there is no cluster here: it fails); the forged one never was.
    assert len(service.carried_out) == 1 and service.carried_out[0].startswith("evict n01:"), service.carried_out
    reasons = await dead_letter_reasons(keel_env.bus, 1)
    assert "bad signature" in reasons[str(forged.id)]


async def test_replay_verify_flags_a_forged_command_that_reached_the_log(keel_env) -> None:
    """A command written to the store behind the recorder's back (or recorded by an older recorder)."""
    expires = now_utc() + timedelta(minutes=5)
    genuine = keel_env.bus.signing.sign(
        command(NodeEvictionDecided(node_id="n01", rung=1, reason="t", expires_at=expires), "node/n01"))
    forged = sign_event(command(NodeEvictionDecided(node_id="n02", rung=1, reason="t", expires_at=expires),
                                "node/n02"), FORGER)
    unsigned = command(NodeEvictionDecided(node_id="n03", rung=1, reason="t", expires_at=expires), "node/n03")
    async with keel_env.engine.begin() as conn:
        await append_events(conn, [event_row(e, None) for e in (genuine, forged, unsigned)])
    result = keel(service_env(keel_env.settings), "replay", "--verify", "--service", "controller")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "signatures: 3 event(s) that must be signed checked, 2 refused" in result.stdout
    assert "FORGED position 2: bad signature" in result.stdout
    assert "UNSIGNED position 3: unsigned: NodeEvictionDecided" in result.stdout

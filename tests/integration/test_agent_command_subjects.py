"""Node-addressed commands on a real NATS server: an agent's command consumer is filtered to its own node's
subjects, so the server delivers it its own ``RanksRestartRequested`` / ``StandbyPromotionRequested`` and
the job-wide requests, never another node's. Node ids are host names with dots (one encoded subject token
each, ``keel.infra.subjects``); the recorder stores their events, none dead-lettered."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from keel.agent.agent import NodeAgent
from keel.agent.consumer import CommandConsumer
from keel.agent.inspector_adapter import classify
from keel.agent.launch_spec import LaunchSpec
from keel.cluster.local import rendezvous_base_port, seed_overlay_root
from keel.events.envelope import Event, EventPayload, now_utc
from keel.events.types import (
    DiagnosticsRequested,
    NodeHeartbeat,
    RanksRestarted,
    RanksRestartRequested,
    StacksRequested,
    StandbyPromotionRequested,
)
from keel.infra.outbox import Outbox
from keel.infra.signing import consumer_signing

pytestmark = pytest.mark.integration

JOB = "job"
SLEEPER = ("-c", "import time; time.sleep(120)")
NODES = ("gpu01.dc1", "gpu02.dc1")


def make_agent(directory: Path, node_id: str, outbox: Outbox) -> NodeAgent:
    root = directory / node_id / "root"
    seed_overlay_root(root, gpus=1)
    spec = LaunchSpec(nnodes=2, nproc_per_node=1, node_rank=NODES.index(node_id), master_addr="127.0.0.1",
                      master_port=rendezvous_base_port(), command=SLEEPER, job_id=JOB, node_id=node_id,
                      agent_dir=directory / node_id, root=root, heartbeat_interval=timedelta(hours=1), ckpt_dir=None)
    return NodeAgent(spec, outbox=outbox, watcher=None, classify=classify(spec), supervised=True)


def command(payload: EventPayload, subject: str) -> Event:
    return Event.create(payload, job_id=JOB, subject=subject, producer="controller", occurred_at=now_utc())


async def test_an_agent_consumes_only_its_own_nodes_commands(keel_env, scratch_dir: Path) -> None:
    await keel_env.start_recorder()
    mine, other = NODES
    expires = now_utc() + timedelta(minutes=5)
    restart_mine = command(RanksRestartRequested(node_id=mine, generation=1, reason="test", expires_at=expires),
                           f"node/{mine}")
    restart_other = command(RanksRestartRequested(node_id=other, generation=1, reason="test", expires_at=expires),
                            f"node/{other}")
    promote_other = command(StandbyPromotionRequested(node_id=other, replaces_node_id="n09", node_rank=1, ranks=[1],
                                                      generation=1, reason="test", expires_at=expires), f"node/{other}")
    # Job-wide: one request for the nodes it names, delivered to every agent (only ``mine`` is named).
    diagnostics = command(DiagnosticsRequested(round=1, nodes=[mine], checks=["gpu_matmul"], timeout_s=30,
                                               reason="test", expires_at=expires), f"job/{JOB}")
    stacks = command(StacksRequested(round=0, nodes=[mine], timeout_s=10, reason="test", expires_at=expires),
                     f"job/{JOB}")
    # A node event that is no command: no agent consumes it.
    beat = Event.create(NodeHeartbeat(node_id=mine, standby=False, ranks_alive=1, ranks_expected=1, last_step=3),
                        job_id=JOB, subject=f"node/{mine}", producer="agent", occurred_at=now_utc())
    published = [restart_mine, restart_other, promote_other, diagnostics, stacks, beat]
    for event in published:
        await keel_env.bus.publish(event)

    stop = asyncio.Event()
    received: dict[str, list[Event]] = {node: [] for node in NODES}
    consumers: dict[str, CommandConsumer] = {}
    agents: list[NodeAgent] = []
    tasks: list[asyncio.Task] = []
    try:
        for node in NODES:
            outbox = Outbox(keel_env.settings.nats_url, keel_env.settings.bus, name=f"test-{node}",
                            signing=consumer_signing(keel_env.settings))
            agent = make_agent(scratch_dir, node, outbox)
            agents.append(agent)
            # Record what the consumer hands on, before the agent's own checks of whom a command is for.
            agent.handle_command = received[node].append  # type: ignore[method-assign]
            consumers[node] = CommandConsumer(agent)
            tasks += [asyncio.create_task(outbox.run(stop)), asyncio.create_task(consumers[node].run(stop))]
        expected = {mine: [restart_mine, diagnostics, stacks], other: [restart_other, promote_other, diagnostics, stacks]}
        deadline = asyncio.get_running_loop().time() + 20
        while any(len(received[n]) < len(expected[n]) for n in NODES):
            assert asyncio.get_running_loop().time() < deadline, received
            for task in tasks:
                assert not task.done() or task.exception() is None, task.exception()
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # nothing else comes
        for node in NODES:
            assert [e.id for e in received[node]] == [e.id for e in expected[node]], (node, received[node])
            # Filtered by the server: it delivered exactly these, nothing the agent had to drop.
            events = consumers[node].events
            assert events is not None and events.stats.handled == len(expected[node])
            info = await keel_env.bus.js.consumer_info(keel_env.settings.bus.stream, events.durable)
            assert info.delivered.consumer_seq == len(expected[node]) and info.num_pending == 0, info
            assert info.config.filter_subjects is not None
            assert any(f".node.{node.replace('.', '%2E')}.RanksRestartRequested" in s
                       for s in info.config.filter_subjects), info.config.filter_subjects

        # The recorder took every event, dotted node ids included (plus the heartbeats ``mine`` sent at once
        # to acknowledge the diagnostics and the stack capture requests; ``other`` was not asked), and
        # dead-lettered none.
        assert await keel_env.wait_for_count(len(published) + 2) == len(published) + 2
        assert await keel_env.store.dead_letters() == []
        stored = {r.event.id: r.event async for r in keel_env.store.read(job_id=JOB)}
        acks = [e for e in stored.values() if e.type == "NodeHeartbeat" and e.id != beat.id]
        assert [e.payload.node_id for e in acks] == [mine, mine], acks
        assert stored[restart_mine.id].subject == f"node/{mine}"
    finally:
        stop.set()
        for task in tasks:
            try:
                await asyncio.wait_for(task, 5)
            except Exception:  # noqa: BLE001 - teardown: the test has already reported
                task.cancel()
        for agent in agents:
            assert agent.outbox is not None
            await agent.outbox.close()
            agent.channel.close()


async def test_a_command_whose_handling_raises_does_not_end_the_agents_command_intake(keel_env, scratch_dir: Path) -> None:
    """Each message is isolated: the failing command is tried again at once (it succeeds the second time
    here) and the next command is still handled; the failure is counted."""
    node = NODES[0]
    expires = now_utc() + timedelta(minutes=5)
    first, second = (command(RanksRestartRequested(node_id=node, generation=g, reason="test", expires_at=expires),
                             f"node/{node}") for g in (1, 2))
    settings = keel_env.settings.bus.model_copy(update={"ack_wait": timedelta(seconds=1)})  # redeliver quickly
    stop = asyncio.Event()
    outbox = Outbox(keel_env.settings.nats_url, settings, name="test-supervised",
                    signing=consumer_signing(keel_env.settings))
    agent = make_agent(scratch_dir, node, outbox)
    handled: list[Event] = []
    raised: list[Event] = []

    def flaky(event: Event) -> None:
        if event.id == first.id and not raised:  # its first delivery only
            raised.append(event)
            raise RuntimeError("a bug in the restart handler")
        handled.append(event)

    agent.handle_command = flaky  # type: ignore[method-assign]
    consumer = CommandConsumer(agent)
    tasks = [asyncio.create_task(outbox.run(stop)), asyncio.create_task(consumer.run(stop))]
    try:
        await keel_env.bus.publish(first)
        await keel_env.bus.publish(second)
        deadline = asyncio.get_running_loop().time() + 30
        while {e.id for e in handled} != {first.id, second.id}:
            assert asyncio.get_running_loop().time() < deadline, (handled, consumer.failures)
            assert not tasks[1].done(), tasks[1]
            await asyncio.sleep(0.1)
        assert consumer.failures == 1
    finally:
        stop.set()
        for task in tasks:
            try:
                await asyncio.wait_for(task, 5)
            except Exception:  # noqa: BLE001 - teardown: the test has already reported
                task.cancel()


async def test_a_command_that_always_raises_is_answered_failed_and_holds_up_nothing(keel_env, scratch_dir: Path) -> None:
    """Given up after its attempts: answered (``RanksRestarted`` failed, with the error) and acknowledged;
    the command published right after it is handled at once, not after ``ack_wait`` (10 s) nor a back-off."""
    node = NODES[0]
    expires = now_utc() + timedelta(minutes=5)
    poison, after = (command(RanksRestartRequested(node_id=node, generation=g, reason="test", expires_at=expires),
                             f"node/{node}") for g in (1, 2))
    stop = asyncio.Event()
    outbox = Outbox(keel_env.settings.nats_url, keel_env.settings.bus, name="test-isolated",
                    signing=consumer_signing(keel_env.settings))
    agent = make_agent(scratch_dir, node, outbox)
    handled: list[Event] = []
    emitted: list[EventPayload] = []

    def broken(event: Event) -> None:
        if event.id == poison.id:
            raise RuntimeError("a bug in the restart handler")
        handled.append(event)

    agent.handle_command = broken  # type: ignore[method-assign]
    agent.emit = lambda payload, subject=None, causation=None: emitted.append(payload)  # type: ignore[method-assign]
    consumer = CommandConsumer(agent)
    tasks = [asyncio.create_task(outbox.run(stop)), asyncio.create_task(consumer.run(stop))]
    try:
        await outbox.connected.wait()
        await keel_env.bus.publish(poison)
        await keel_env.bus.publish(after)
        started = asyncio.get_running_loop().time()
        while not handled:
            assert asyncio.get_running_loop().time() - started < 5, (consumer.failures, consumer.restarts)
            await asyncio.sleep(0.05)
        assert [e.id for e in handled] == [after.id]
        assert (consumer.failures, consumer.given_up, consumer.restarts) == (2, 1, 0)
        answers = [p for p in emitted if isinstance(p, RanksRestarted)]
        assert len(answers) == 1 and answers[0].outcome == "failed" and answers[0].command_id == str(poison.id)
        assert "a bug in the restart handler" in answers[0].detail
        await asyncio.sleep(1.5)  # acknowledged: not delivered again
        assert consumer.failures == 2
    finally:
        stop.set()
        for task in tasks:
            try:
                await asyncio.wait_for(task, 5)
            except Exception:  # noqa: BLE001 - teardown: the test has already reported
                task.cancel()
        await outbox.close()
        agent.channel.close()

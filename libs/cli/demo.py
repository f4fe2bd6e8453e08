"""`keel demo` (behind `make demo`): the event backbone end to end, on real servers.

1. `keel up`: the embedded NATS (JetStream, sync_interval always) and PostgreSQL, migrations, and the
   recorder and controller services as background processes.
2. A 16-node job registers; its nodes report health changes; a burst of fleet telemetry goes through.
3. Faults: a fatal GPU XID (rung 1: the controller evicts), a medium-confidence NIC flap (no action),
   a disk failure; plus malformed messages, which are dead-lettered with a reason.
4. An executor for the controller's commands — the `local` actuator's stand-in until the node agent
   lands — checks each command's expiry and reports the eviction.
5. The recorded timeline (`keel events tail`), the node read model, the dead letters, and
   `keel replay --verify`, which re-runs every decision from the log and must find no divergence.
6. `keel down` (unless --keep).

Training processes, the inspector and the real actuators arrive with the next issues.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import sqlalchemy as sa

from keel.core.bus import Bus, fetch_batch
from keel.core.config import Settings
from keel.core.event_types import JobRegistered, NodeEvicted, NodeEvictionDecided, NodeHealthChanged, NodeRegistered
from keel.core.events import Event, InvalidEvent, decode_event, now_utc
from keel.core.store import EventStore, create_engine, metadata

JOB = "demo"
NODES = [f"n{index:02d}" for index in range(16)]


def _keel(config: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "keel.cli.main"]
    if config:
        command += ["--config", config]
    return subprocess.run([*command, *args], text=True, capture_output=True, check=check, timeout=120)


def _banner(text: str) -> None:
    print(f"\n== {text} " + "=" * max(0, 74 - len(text)), flush=True)


def _health(node: str, status: str, component: str, check: str, confidence: str, fatal: bool, detail: str) -> Event:
    return Event.create(
        NodeHealthChanged(node_id=node, status=status, component=component, check=check,  # type: ignore[arg-type]
                          confidence=confidence, is_fatal=fatal, detail=detail),  # type: ignore[arg-type]
        job_id=JOB, subject=f"node/{node}", producer="inspector", occurred_at=now_utc(),
    )


async def _execute_commands(bus: Bus, stop: asyncio.Event, executed: list[str]) -> None:
    """Carry out eviction commands that have not expired; report each outcome as an event."""
    sub = await bus.pull_consumer("demo-actuator", filter_subject=f"{bus.settings.subject_prefix}.{JOB}.node.NodeEvictionDecided")
    while not stop.is_set():
        for msg in await fetch_batch(sub, 16, 0.2):
            try:
                command = decode_event(msg.data, max_bytes=bus.settings.max_event_bytes)
            except InvalidEvent:
                await msg.term()
                continue
            payload = command.payload
            assert isinstance(payload, NodeEvictionDecided)
            seen_at = now_utc()
            if seen_at > payload.expires_at:
                outcome, detail = "expired", f"command expired at {payload.expires_at.isoformat()}; not executed"
            elif payload.observe_only:
                outcome, detail = "skipped_observe_only", "observe mode"
            else:
                outcome, detail = "evicted", "node drained from the job (demo actuator)"
            report = Event.create(
                NodeEvicted(node_id=payload.node_id, decision_id=str(command.id), actuator="local-demo",
                            outcome=outcome, detail=detail),  # type: ignore[arg-type]
                job_id=command.job_id, subject=command.subject, producer="actuator-local",
                occurred_at=seen_at, causation_id=command.id, correlation_id=command.correlation_id,
            )
            await bus.publish(report)
            executed.append(f"{payload.node_id}: {outcome}")
            await msg.ack()


async def _drive(settings: Settings, nats_url: str, database_url: str) -> dict[str, Any]:
    bus = await Bus.connect(nats_url, settings.bus, name="keel-demo")
    engine = create_engine(database_url, settings.db_schema)
    store = EventStore(engine)
    stop = asyncio.Event()
    executed: list[str] = []
    actuator = asyncio.create_task(_execute_commands(bus, stop, executed))
    try:
        start_position = await store.head_position()
        already = await store.count(JOB)  # a previous demo run on the same home
        _banner("a 16-node job registers")
        at = now_utc()
        await bus.publish(Event.create(JobRegistered(nodes=NODES, world_size=128, registered_by=os.environ.get("USER", "demo")),
                                       job_id=JOB, subject=f"job/{JOB}", producer="cli", occurred_at=at))
        await bus.publish_many([
            Event.create(NodeRegistered(node_id=node, host=f"host-{node}", fault_domain=f"rack-{i // 4}"),
                         job_id=JOB, subject=f"node/{node}", producer="agent", occurred_at=at)
            for i, node in enumerate(NODES)
        ])

        _banner("fleet telemetry: 5,000 health-state changes")
        burst = [
            _health(NODES[i % len(NODES)], "degraded" if i % 2 else "healthy", "host", "psi_memory", "low", False,
                    f"memory pressure sample {i}")
            for i in range(5000)
        ]
        t0 = time.perf_counter()
        await bus.publish_many(burst)
        print(f"published {len(burst)} events in {time.perf_counter() - t0:.2f} s (acknowledged by JetStream, on disk)")

        _banner("faults")
        faults = [
            _health("n03", "failed", "gpu", "xid", "high", True, "XID 79: GPU has fallen off the bus"),
            _health("n07", "failed", "nic", "link_flap", "medium", False, "eth2 link flapped twice in 5 min"),
            _health("n11", "failed", "disk", "smart", "high", True, "/var/lib/keel: I/O errors"),
        ]
        for fault in faults:
            await bus.publish(fault)
            print(f"injected  {fault.subject:<9} {fault.payload.component}/{fault.payload.check}: {fault.payload.detail}")
        subject = f"{settings.bus.subject_prefix}.{JOB}.node.NodeHealthChanged"
        await bus.publish_raw(subject, b'{"type": "NodeHealthChanged", "payload": ', msg_id=f"demo-bad-json-{time.time_ns()}")
        future = {**faults[0].to_wire(), "id": "6b3cfa8a-0000-4000-8000-000000000001", "schema_version": 7}
        await bus.publish_raw(subject, json.dumps(future).encode(), msg_id=f"demo-future-{time.time_ns()}")
        print("injected  2 malformed messages (truncated JSON, a schema_version from the future)")

        expected = 1 + len(NODES) + len(burst) + len(faults) + 2 * 2  # + 2 decisions and 2 actuator reports
        deadline = time.monotonic() + 60
        while await store.count(JOB) - already < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # anything recorded twice would arrive now
        recorded = await store.count(JOB) - already
        print(f"recorded  {recorded} of {expected} expected events in Postgres")
        async with engine.connect() as conn:
            nodes = (await conn.execute(
                sa.select(metadata.tables["node_status"]).where(metadata.tables["node_status"].c.job_id == JOB)
                .where(metadata.tables["node_status"].c.health != "healthy").order_by("node_id")
            )).all()
        dead = await store.dead_letters()
        timeline = [r async for r in store.read(job_id=JOB, after_position=start_position)
                    if r.event.type != "NodeHealthChanged" or r.event.payload.check != "psi_memory"]
        return {"recorded": recorded, "expected": expected, "nodes": nodes, "dead": dead[-2:], "executed": executed,
                "timeline": timeline}
    finally:
        stop.set()
        await actuator
        await bus.close()
        await engine.dispose()


def run_demo(settings: Settings, config: str | None = None, keep: bool = False) -> int:
    from keel.cli.main import endpoints

    _banner("keel up: embedded NATS JetStream + PostgreSQL, recorder and controller")
    up = _keel(config, "up", check=False)
    if up.returncode != 0:
        print(up.stderr, file=sys.stderr)
        return up.returncode
    nats_url, database_url = endpoints(settings)
    print(f"NATS {nats_url}   PostgreSQL {database_url}   home {settings.home}")
    print(_keel(config, "status").stdout)
    try:
        result = asyncio.run(_drive(settings, nats_url, database_url))

        _banner("incident timeline (fleet telemetry folded away)")
        for recorded in result["timeline"]:
            event = recorded.event
            payload = event.payload.model_dump(mode="json")
            what = payload.get("reason") or payload.get("detail") or payload.get("outcome") or ""
            if isinstance(event.payload, NodeEvicted):
                what = f"{event.payload.outcome}: {event.payload.detail}"
            if isinstance(event.payload, JobRegistered):
                what = f"{len(event.payload.nodes)} nodes, world size {event.payload.world_size}"
            if isinstance(event.payload, NodeRegistered):
                continue
            print(f"{event.occurred_at:%H:%M:%S.%f}"[:-3] + f"  {event.producer:<14} {event.type:<20} {event.subject:<9} {what}")
        _banner("node read model (projection, same transaction as the events)")
        for node in result["nodes"]:
            print(f"{node.node_id}: health={node.health:<8} evicted={str(node.evicted):<5} {node.detail}")
        _banner("dead letters")
        for dead in result["dead"]:
            print(f"stream seq {dead['js_seq']}: {dead['reason']}")
        _banner("keel replay --verify")
        replay = _keel(config, "replay", "--job", JOB, "--verify", check=False)
        print(replay.stdout.strip())
        ok = result["recorded"] == result["expected"] and replay.returncode == 0 and len(result["dead"]) == 2
        _banner("result")
        print(f"events recorded exactly once: {result['recorded']}/{result['expected']}; "
              f"evictions executed: {', '.join(result['executed']) or 'none'}; "
              f"replay: {'clean' if replay.returncode == 0 else 'DIVERGED'}")
        print("DEMO PASSED" if ok else "DEMO FAILED")
        return 0 if ok else 1
    finally:
        if not keep:
            _banner("keel down")
            print(_keel(config, "down", check=False).stdout.strip())


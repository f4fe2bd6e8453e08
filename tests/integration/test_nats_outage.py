"""NATS down for two minutes in the middle of a job, with real servers and processes.

The control plane (recorder, controller, checkpoint broker, analyzer, hot-update, actuator) runs under ``keel up``'s
supervisor; a local cluster of two node agents trains the example GPT (DP 2, every-step checkpoints with
peer backups). Once the job steps, the embedded nats-server is stopped, left down for
``KEEL_TEST_NATS_OUTAGE_S`` (120 s), and started again on the same port and store directory. Afterwards:

- every service rode the outage out (none exited and was restarted) and the job finished its steps;
- nothing acknowledged was lost: the agents' heartbeats from inside the outage (kept in their outboxes)
  are in the log, every message of the stream is in the store, none dead-lettered;
- no event id was recorded twice, and no decision was taken twice (same producer, type, cause and
  payload under another id);
- no node was evicted, no incident opened: the outage is not the nodes' silence;
- ``keel replay --verify`` finds every recorded decision again.

No false eviction needs the controller to judge silence on its recorded clock over unbroken runs of ticks
(the clock host's first tick after the outage starts a new run): the agents' buffered heartbeats reach it
only after that tick.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

from keel.cluster.local import cluster_down, cluster_up
from keel.events.envelope import Event, now_utc
from keel.infra.bus import Bus
from keel.infra.embedded import NatsServer, free_port
from keel.infra.store import EventStore, create_engine, run_migrations
from keel.infra.supervision import RestartPolicy
from keel.infra.supervisor import ServiceSpec, Supervisor
from tests.conftest import TEST_CREDENTIALS, Servers, isolated_settings
from tests.integration.test_crashes import service_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

OUTAGE_S = float(os.environ.get("KEEL_TEST_NATS_OUTAGE_S", "120"))
JOB = "outage"
NODES = 2
STEP_TIME_S = 0.1
# Long enough that the job is still stepping when NATS comes back, and goes on for a minute after.
STEPS = int((OUTAGE_S + 60) / STEP_TIME_S)
TRAIN = ["-m", "keel.workload.train", "--size", "tiny", "--steps", str(STEPS), "--min-step-time",
         f"{int(STEP_TIME_S * 1000)}ms"]
SERVICES = ("recorder", "controller", "checkpoint-broker", "analyzer", "hot-update", "actuator")
DECIDERS = {"controller", "checkpoint-broker", "analyzer", "hot-update"}


class Outage:
    def __init__(self, servers: Servers, scratch: Path) -> None:
        self.scratch = scratch
        self.nats = NatsServer(store_dir=scratch / "nats", port=free_port(), monitor_port=free_port(), sync_always=True,
                               credentials_dir=TEST_CREDENTIALS)
        self.nats.start()
        self.settings = isolated_settings(Servers(self.nats.url, servers.database_url, servers.role_urls, self.nats))
        self.directory = scratch / "cluster"
        self.knobs = {"KEEL_CONTROLLER__NODE_SILENCE_TIMEOUT": "20s", "KEEL_INSPECTOR__STEP_TIMEOUT_FLOOR": "60s",
                      "KEEL_CHECKPOINT__PERSIST_ROOT": str(scratch / "checkpoints")}
        self.env = {**service_env(self.settings), **self.knobs}
        specs = [ServiceSpec(name, [sys.executable, "-m", "keel.cli.main", "service", name,
                                    *(["--cluster-dir", str(self.directory)] if name == "actuator" else [])], self.env)
                 for name in SERVICES]
        self.supervisor = Supervisor(specs, scratch / "services", RestartPolicy(), nats_url=self.nats.url,
                                     bus_settings=self.settings.bus)
        self.stop = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.engine = create_engine(servers.database_url, self.settings.db_schema)
        self.store = EventStore(self.engine)

    async def start(self) -> None:
        await asyncio.to_thread(run_migrations, self.settings.database_urls.migrate or self.settings.database_url,
                                self.settings.db_schema)
        self.task = asyncio.create_task(self.supervisor.run(self.stop))
        deadline = time.monotonic() + 120
        while not all(s.state == "running" for s in self.supervisor.services.values()):
            assert time.monotonic() < deadline, {n: s.state for n, s in self.supervisor.services.items()}
            assert all(s.restarts == 0 for s in self.supervisor.services.values()), self.logs()
            await asyncio.sleep(0.2)
        env = {k: v for k, v in self.env.items() if k.startswith("KEEL_")}
        await asyncio.to_thread(cluster_up, self.settings, self.directory, nodes=NODES, standby=0, nproc_per_node=1,
                                job_id=JOB, command=TRAIN, nats_url=self.nats.url, extra_env=env,
                                heartbeat_interval="2s", persist_root=self.scratch / "checkpoints")

    async def shutdown(self) -> None:
        await asyncio.to_thread(cluster_down, self.directory)
        self.stop.set()
        if self.task is not None:
            await asyncio.wait_for(self.task, 60)
        await self.engine.dispose()
        await asyncio.to_thread(self.nats.stop)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted((self.scratch / "services").glob("*.log")))

    async def events(self, types: list[str] | None = None, job: str | None = JOB) -> list[Event]:
        return [r.event async for r in self.store.read(job_id=job, types=types)]

    async def wait_for(self, types: list[str], predicate, timeout_s: float, what: str) -> list[Event]:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [e for e in await self.events(types) if predicate(e)]
            if found:
                return found
            await asyncio.sleep(0.5)
        tail = [(e.type, str(getattr(e.payload, "reason", ""))[:120]) for e in await self.events()][-10:]
        raise AssertionError(f"no {what} within {timeout_s:g} s; the log ends with {tail}; see {self.scratch}")


@pytest.fixture
async def outage(servers: Servers, scratch_dir: Path) -> AsyncIterator[Outage]:
    running = Outage(servers, scratch_dir)
    try:
        yield running
    finally:
        await running.shutdown()


async def test_nats_down_for_two_minutes_during_a_job(outage: Outage) -> None:
    await outage.start()
    await outage.wait_for(["NodeHeartbeat"], lambda e: e.payload.last_step >= 5, 240, "the job stepping")
    pids = {name: svc.pid for name, svc in outage.supervisor.services.items()}

    # NATS goes away for OUTAGE_S, then comes back on the same port and store directory.
    await asyncio.to_thread(outage.nats.stop)
    down_at = now_utc()
    await asyncio.sleep(OUTAGE_S)
    up_at = now_utc()
    await asyncio.to_thread(outage.nats.start)

    exits = await outage.wait_for(["RankExited"], lambda e: True, 600, "the ranks' exits")
    deadline = time.monotonic() + 120
    while len(exits) < NODES and time.monotonic() < deadline:
        await asyncio.sleep(1)
        exits = await outage.events(["RankExited"])
    assert sorted((e.payload.rank, e.payload.classification, e.payload.exit_code) for e in exits) == \
        [(rank, "success", 0) for rank in range(NODES)], [e.payload for e in exits]
    last_lines = [line for line in (outage.directory / "nodes").glob("*/logs/rank0.g0.stdout")]
    assert any(f"step {STEPS - 1} " in p.read_text() for p in last_lines), "rank 0 did not log its last step"

    # Every service rode it out: same processes, no restart.
    services = outage.supervisor.services
    assert {name: (svc.state, svc.restarts) for name, svc in services.items()} == \
        {name: ("running", 0) for name in SERVICES}, outage.logs()
    assert {name: svc.pid for name, svc in services.items()} == pids

    # The log is complete: let the recorder catch up with the stream, then compare.
    bus = await Bus.connect(outage.nats.url, outage.settings.bus, name="outage-test")
    try:
        deadline = time.monotonic() + 60
        while True:
            in_stream = (await bus.js.stream_info(outage.settings.bus.stream)).state.messages
            stored = await outage.store.count()
            if stored >= in_stream or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    finally:
        await bus.close()
    async with outage.engine.connect() as conn:
        dead = (await conn.execute(text("SELECT count(*) FROM dead_letters"))).scalar_one()
        ids = (await conn.execute(text("SELECT count(*), count(DISTINCT event_id) FROM events"))).one()
    assert dead == 0
    assert ids[0] == ids[1] == stored
    # Every message JetStream acknowledged is stored once; none was stored in the stream twice (a publish
    # retried after the outage outside the dedup window would be: two stream messages, one row).
    assert stored == in_stream, (stored, in_stream)

    # The agents' heartbeats from inside the outage were kept and published afterwards.
    beats = await outage.events(["NodeHeartbeat"])
    during = Counter(e.payload.node_id for e in beats if down_at + timedelta(seconds=5) < e.occurred_at < up_at)
    assert len(during) == NODES and min(during.values()) >= OUTAGE_S / 2 / 4, during
    after = {e.payload.node_id for e in beats if e.occurred_at > up_at}
    assert len(after) == NODES

    everything = await outage.events(job=None)
    # Nobody was evicted, no incident opened.
    kinds = Counter(e.type for e in everything)
    assert not {k: kinds[k] for k in ("NodeEvictionDecided", "IncidentOpened", "RestartDecided", "JobStopDecided",
                                      "DecisionRefused") if kinds[k]}, kinds
    # Nothing decided twice: the same decision (producer, type, cause, payload) under two ids.
    decisions = Counter((e.producer, e.type, e.causation_id, e.payload.model_dump_json())
                        for e in everything if e.producer in DECIDERS and e.causation_id is not None)
    assert not [d for d, n in decisions.items() if n > 1]

    # Replay finds every decision again.
    await asyncio.to_thread(cluster_down, outage.directory)
    verified = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "keel.cli.main", "replay", "--job", JOB, "--verify"],
        env=outage.env, capture_output=True, text=True, timeout=300)
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-2000:]
    print(json.dumps({"outage_s": OUTAGE_S, "events": len(everything), "heartbeats_in_outage": dict(during),
                      "decisions": sum(decisions.values())}))

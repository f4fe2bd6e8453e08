"""How fast Keel moves events: bus → recorder → Postgres, and Postgres → decider (replay).

    python -m bench.bus [--quick] [--json PATH] [--window N]

One run starts its own servers (keel.infra.embedded, free ports, scratch dirs under /tmp): two NATS
servers — one with JetStream ``sync_interval: always`` (the embedded single-server default:
acknowledged means on disk) and one with the default sync interval (what a replicated R3 cluster runs,
where replication carries durability) — and one PostgreSQL. With ``KEEL_NATS_URL`` /
``KEEL_DATABASE_URL`` set, those servers are used instead (both "modes" then share the one NATS).
Every NATS client authenticates (``bench._servers``): the bench as the servers' admin, the recorder as
its own role.

Measured, all in the same run so that the ratios are fair on a noisy machine:

- ``raw_jetstream_eps`` (per mode): the ceiling of the bus alone, a real upper bound for Keel. Plain
  nats-py ``publish_async`` of random bytes of each event's encoded size (no Keel envelope, no
  signing, no ``Nats-Msg-Id``, so no duplicate check) into a file-storage stream configured like
  Keel's, while a pull consumer *in a separate process* (as the recorder is) fetches and acknowledges
  (explicit acks, every message, as the recorder does). No persistence. Tried with ``--window`` and
  wider windows of unacknowledged publishes (1,024, 4,096), each on a fresh stream; the ceiling is the
  best (``raw_jetstream_window``, every window's rate in ``raw_jetstream_eps_by_window``). Until this
  change the ceiling published Keel's own bytes with Keel's window, the same work as Keel's publisher,
  so the persisted/raw ratio could exceed 1 (1.15 in the 2026-11-29 run): noise, not a bound. Rate =
  messages / (first publish → the consumer has acknowledged the last).
- ``persisted_eps`` (per mode): Keel end to end. ``Bus.publish_many`` (same window) while the real
  recorder service (``python -m keel.cli.main service recorder``, a separate process as in
  production) records into Postgres. Rate = events / (first publish → the last is committed in
  Postgres, seen through the recorder's tracking row). The ratio to the raw ceiling is the target.
- ``raw_copy_rps``: the ceiling of the store alone: raw asyncpg ``copy_records_to_table`` into a table
  like ``events`` (same columns and indexes), one transaction per recorder-sized batch.
  ``sa_insert_rps``: the same rows through SQLAlchemy Core executemany ``INSERT … ON CONFLICT DO
  NOTHING``: the gap between the two is why the store's append path (and only it) uses raw asyncpg.
- ``p50_ms`` / ``p99_ms``: end-to-end latency at a fixed offered load of 1,000 events/s (one event a
  second from each node of a 1,200-node fleet), sync-always mode: ``Bus.publish`` per event, paced
  against a fixed schedule (10 events every 10 ms) so that a lagging publisher cannot hide latency.
  Latency = the moment the event became visible in Postgres minus its *scheduled* publish time.
- ``replay_eps``: events per second streamed from Postgres with ``EventStore.read`` (upcast and
  validated) and folded through the controller's decider (``DeciderSession.observe``: evolve and
  decide, the loop body of ``keel replay``), on ≥ 1M events in the full run. The log is realistic
  (``bench._replay_log``): jobs of 8 nodes x 8 ranks and two standbys played through the four deciders
  with the cluster answering their commands: registrations, rank starts, checkpoint registrations,
  the job clock, heartbeats, a crash (diagnostics round, restart) and a fatal XID (eviction, standby
  promotion, restart) per job, about 4,800 events each with their decisions. It replaced 1M
  alternating health events, on which the controller decided almost nothing.
  ``replay_verify_eps``: a second pass doing ``keel replay --verify``'s work (every decider's
  ``ReplayVerifier``); every recorded decision must be found again, or the run fails.

``--smoke`` runs every part at tiny sizes in seconds (a check that the benchmark works, for the tests).
Results carry their provenance (``bench._provenance``).

Exits 0 even when a target is missed (it is a benchmark); misses are printed as FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tests.factories builds the events
    sys.path.insert(0, str(REPO))

from bench._servers import Servers, scratch_dir  # noqa: E402

if TYPE_CHECKING:
    from keel.infra.config import BusSettings

MODES = ("sync_always", "sync_default")
OFFERED_EPS = 1000
TICK_S = 0.010

TARGETS = {
    "persisted_ratio": ("≥", 0.50),
    "persisted_eps.sync_default": ("≥", 5000.0),
    "p99_ms": ("≤", 50.0),
    "replay_eps": ("≥", 50_000.0),
}


@dataclass(frozen=True)
class Sizes:
    persisted: dict[str, int]
    latency_s: dict[str, float]
    store_rows: int
    replay: int


QUICK = Sizes(
    persisted={"sync_always": 4_000, "sync_default": 15_000},
    latency_s={"sync_always": 5.0, "sync_default": 2.0},
    store_rows=5_000,
    replay=60_000,
)
SMOKE = Sizes(
    persisted={"sync_always": 300, "sync_default": 1_000},
    latency_s={"sync_always": 2.0, "sync_default": 2.0},  # 1 s of warm-up, 1 s measured
    store_rows=1_000,
    replay=4_000,  # one job
)
FULL = Sizes(
    persisted={"sync_always": 20_000, "sync_default": 100_000},
    latency_s={"sync_always": 30.0, "sync_default": 10.0},
    store_rows=50_000,
    replay=1_000_000,
)


def log(message: str) -> None:
    print(message, flush=True)


# -- servers --------------------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds so far) for every process we can read."""
    tick = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return table


class CpuMeter:
    """CPU seconds used by process trees (a server and its children) between ``start`` and ``stop``:
    where the two cores go, per event."""

    def __init__(self, roots: dict[str, int | None]) -> None:
        self.roots = {name: pid for name, pid in roots.items() if pid}
        self.before: dict[str, float] = {}

    def _sample(self) -> dict[str, float]:
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        totals = {}
        for name, root in self.roots.items():
            total, stack = 0.0, [root]
            while stack:
                pid = stack.pop()
                total += table.get(pid, (0, 0.0))[1]
                if pid != os.getpid():  # this process: itself only (its children are measured apart)
                    stack.extend(children.get(pid, []))
            totals[name] = total
        return totals

    def start(self) -> None:
        self.before = self._sample()

    def stop(self, events: int) -> dict[str, float]:
        """Microseconds of CPU per event, per process tree."""
        after = self._sample()
        return {name: (after[name] - self.before.get(name, 0.0)) / events * 1e6 for name in after}


# -- per-measurement isolation --------------------------------------------------------------------


@dataclass
class Slice:
    """A fresh subject prefix, streams and Postgres schema for one measurement."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:10])

    @property
    def schema(self) -> str:
        return f"bench_{self.tag}"

    def bus_settings(self, servers: Servers) -> BusSettings:
        """The slice's prefix and streams, with the harness's identity on ``servers``."""
        return servers.bus_settings(subject_prefix=f"kb{self.tag}", stream=f"KB{self.tag}", dlq_stream=f"KB{self.tag}_DLQ")


async def pg_connect(database_url: str, schema: str = "public"):  # type: ignore[no-untyped-def]
    import asyncpg

    return await asyncpg.connect(database_url, server_settings={"search_path": schema})


async def drop_schema(database_url: str, schema: str) -> None:
    conn = await pg_connect(database_url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


# -- events ---------------------------------------------------------------------------------------


def make_events(count: int, job: str = "bench"):  # type: ignore[no-untyped-def]
    from tests.factories import fleet_events

    return fleet_events(count, job=job)


# -- raw JetStream ceiling ------------------------------------------------------------------------


def stream_config(name: str, subjects: str):  # type: ignore[no-untyped-def]
    """The events stream as ``Bus.ensure_streams`` configures it."""
    from nats.js import api

    from keel.infra.bus import NATS_MAX_PAYLOAD_BYTES
    from keel.infra.config import BusSettings

    s = BusSettings()
    return api.StreamConfig(
        name=name,
        subjects=[subjects],
        storage=api.StorageType.FILE,
        retention=api.RetentionPolicy.LIMITS,
        max_age=s.max_age.total_seconds(),
        max_bytes=s.max_bytes,
        max_msg_size=NATS_MAX_PAYLOAD_BYTES,
        duplicate_window=s.duplicate_window.total_seconds(),
        discard=api.DiscardPolicy.NEW,
    )


async def raw_consumer_main(url: str, stream: str, subjects: str, count: int, batch: int, fetch_timeout_s: float,
                            identity: str) -> None:
    """The raw ceiling's consumer (a child process): fetch and acknowledge, nothing else. It authenticates as
    the harness (``identity``: ``Servers.identity_json``), as every client of the servers must.

    It pulls with the same ``BatchPuller`` as Keel's services (nats-py's own ``fetch`` costs about
    three times the CPU per message), so the ceiling is the best this client stack does, not a
    strawman.
    """
    import nats
    from nats.js import api

    from bench._servers import identity_from_json
    from keel.infra.bus import BatchPuller, connect_credentials, fetch_batch
    from keel.infra.config import BusSettings

    nc = await nats.connect(url, pending_size=64 * 1024 * 1024,
                            **connect_credentials(identity_from_json(identity), url))
    js = nc.jetstream()
    config = api.ConsumerConfig(
        durable_name="raw",
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=BusSettings().ack_wait.total_seconds(),
        max_deliver=-1,
        filter_subject=subjects,
        max_ack_pending=20_000,
    )
    await js.add_consumer(stream, config)
    sub = BatchPuller(nc, stream, "raw")
    await sub.start()
    print("ready", flush=True)
    got = 0
    while got < count:
        msgs = await fetch_batch(sub, batch, fetch_timeout_s)
        got += len(msgs)
        for msg in msgs:
            await msg.ack()
    await nc.flush()
    print(f"done {time.time():.6f}", flush=True)
    await nc.close()


async def windowed_publish_async(js, messages: Sequence[tuple[str, bytes, dict[str, str] | None]], window: int) -> None:  # type: ignore[no-untyped-def]
    """nats-py ``publish_async`` with at most ``window`` unacknowledged; returns once all are acked."""
    slots = asyncio.Semaphore(window)
    futures = []
    for subject, data, headers in messages:
        await slots.acquire()
        future = await js.publish_async(subject, data, headers=headers)
        future.add_done_callback(lambda _f: slots.release())
        futures.append(future)
    await asyncio.gather(*futures)


def bare_messages(events: Sequence[Any], prefix: str) -> list[tuple[str, bytes, dict[str, str] | None]]:
    """The raw ceiling's messages: random bytes of each event's encoded size on one subject per node, with
    no Keel envelope and no ``Nats-Msg-Id`` (so JetStream skips the duplicate check Keel's publishes pay):
    what a bus carries when nothing above it does any work."""
    rng = random.Random(11)
    sizes = [len(e.to_json()) for e in events]
    return [(f"{prefix}.n{index % 1200:04d}", rng.randbytes(size), None) for index, size in enumerate(sizes)]


async def measure_raw_jetstream(servers: Servers, url: str, events: Sequence[Any], windows: Sequence[int], batch: int,
                                fetch_timeout_s: float, nats_pid: int | None = None) -> dict[str, Any]:
    """The bus's own ceiling: the best rate over ``windows`` (publishes in flight), each on a fresh stream."""
    by_window = {}
    for window in windows:
        by_window[window] = await measure_raw_window(servers, url, events, window, batch, fetch_timeout_s, nats_pid)
    best = max(by_window, key=lambda w: by_window[w]["eps"])
    return {**by_window[best], "window": best, "eps_by_window": {str(w): r["eps"] for w, r in by_window.items()}}


async def measure_raw_window(servers: Servers, url: str, events: Sequence[Any], window: int, batch: int,
                             fetch_timeout_s: float, nats_pid: int | None = None) -> dict[str, Any]:
    import nats

    piece = Slice()
    prefix, stream = f"rb{piece.tag}", f"RB{piece.tag}"
    messages = bare_messages(events, prefix)
    # The raw ceiling authenticates too (as the admin, publisher and consumer alike), so it pays the same
    # per-connection authentication as Keel's clients and the persisted/raw ratio stays like for like.
    nc = await nats.connect(url, pending_size=64 * 1024 * 1024, **servers.connect_options(url))
    consumer = None
    try:
        js = nc.jetstream(timeout=5)
        await js.add_stream(stream_config(stream, f"{prefix}.>"))
        consumer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.bus", "_raw_consumer", url, stream, f"{prefix}.>", str(len(messages)),
            str(batch), str(fetch_timeout_s), servers.identity_json(),
            cwd=REPO, stdout=asyncio.subprocess.PIPE,
        )
        assert consumer.stdout is not None
        line = await asyncio.wait_for(consumer.stdout.readline(), 60)
        if line.strip() != b"ready":
            raise RuntimeError(f"raw consumer did not start: {line!r}")
        meter = CpuMeter({"publisher": os.getpid(), "nats": nats_pid, "consumer": consumer.pid})
        meter.start()
        t0_wall, t0 = time.time(), time.perf_counter()
        await windowed_publish_async(js, messages, window)
        published_s = time.perf_counter() - t0
        line = await asyncio.wait_for(consumer.stdout.readline(), 300)
        if not line.startswith(b"done "):
            raise RuntimeError(f"raw consumer failed: {line!r}")
        elapsed = float(line.split()[1]) - t0_wall
        cpu = meter.stop(len(messages))
        await consumer.wait()
        return {"eps": len(messages) / elapsed, "publish_eps": len(messages) / published_s, "cpu_us": cpu}
    finally:
        if consumer is not None and consumer.returncode is None:
            consumer.kill()
            await consumer.wait()
        try:
            await nc.jetstream().delete_stream(stream)
        except Exception:  # noqa: BLE001
            pass
        await nc.close()


# -- Keel: publish → recorder → Postgres ----------------------------------------------------------


class RecorderProcess:
    """``keel service recorder`` in its own process, on one slice, as the recorder identity (from the
    servers' credentials folder, as ``keel up`` runs it)."""

    def __init__(self, servers: Servers, nats_url: str, piece: Slice, home: Path) -> None:
        bus = piece.bus_settings(servers)
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("KEEL_")},
            **servers.service_env,
            "KEEL_NATS_URL": nats_url,
            "KEEL_DATABASE_URL": servers.database_url,
            "KEEL_HOME": str(home),
            "KEEL_DB_SCHEMA": piece.schema,
            "KEEL_BUS__SUBJECT_PREFIX": bus.subject_prefix,
            "KEEL_BUS__STREAM": bus.stream,
            "KEEL_BUS__DLQ_STREAM": bus.dlq_stream,
        }
        for name, value in os.environ.items():  # recorder tuning passes through
            if name.startswith("KEEL_RECORDER__"):
                self.env[name] = value
        self.log_path = home / f"recorder-{piece.tag}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "keel.cli.main", "service", "recorder"],
                env=self.env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            )

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"recorder exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")

    async def wait_ready(self, bus: Any, timeout_s: float = 60.0) -> None:
        """Ready once its durable consumer exists (it connects and migrates first)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            try:
                await bus.js.consumer_info(bus.settings.stream, "recorder")
                return
            except Exception:  # noqa: BLE001 - not there yet
                if time.monotonic() > deadline:
                    raise RuntimeError(f"recorder not ready after {timeout_s} s:\n{self.log_path.read_text()[-3000:]}") from None
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class KeelSlice:
    """A slice with its schema migrated, its streams created, a connected Bus and a recorder process."""

    def __init__(self, servers: Servers, nats_url: str, home: Path) -> None:
        self.servers, self.nats_url, self.database_url, self.home = servers, nats_url, servers.database_url, home
        self.piece = Slice()
        self.bus: Any = None
        self.recorder: RecorderProcess | None = None

    async def __aenter__(self) -> KeelSlice:
        from keel.infra.bus import Bus
        from keel.infra.store import run_migrations

        await asyncio.to_thread(run_migrations, self.database_url, self.piece.schema)
        bus = self.piece.bus_settings(self.servers)
        self.servers.authorize(bus)  # the recorder's identity, on this slice's prefix and streams
        # Signed as the control plane signs (the lag bench publishes clock ticks and commits; events that need
        # no signature, the fleet's, are published as they are).
        self.bus = await Bus.connect(self.nats_url, bus, name="keel-bench", signing=self.servers.signing())
        return self

    async def start_recorder(self) -> None:
        self.recorder = RecorderProcess(self.servers, self.nats_url, self.piece, self.home)
        self.recorder.start()
        await self.recorder.wait_ready(self.bus)

    async def __aexit__(self, *exc: object) -> None:
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.stop)
        if self.bus is not None:
            for stream in (self.bus.settings.stream, self.bus.settings.dlq_stream):
                try:
                    await self.bus.js.delete_stream(stream)
                except Exception:  # noqa: BLE001
                    pass
            await self.bus.close()
        await drop_schema(self.database_url, self.piece.schema)


async def measure_persisted(servers: Servers, nats_url: str, home: Path, events: Sequence[Any], window: int,
                            pids: dict[str, int | None] | None = None, sign_all: bool = False) -> dict[str, Any]:
    """``sign_all``: the worst case of signed events: the publisher signs every event (in the timed part, as a
    producer signs at publish) and the recorder verifies every one (the fleet's events need no signature)."""
    count = len(events)
    key = None
    if sign_all:
        from keel.infra.signing import ensure_signing_identity

        assert servers.credentials_dir is not None
        # In the keyring the recorder checks against (the servers' credentials folder).
        key = ensure_signing_identity(servers.credentials_dir, "bench-signer", "controller")
    async with KeelSlice(servers, nats_url, home) as ks:
        await ks.start_recorder()
        conn = await pg_connect(servers.database_url, ks.piece.schema)
        try:
            assert ks.recorder is not None and ks.recorder.proc is not None
            meter = CpuMeter({"publisher": os.getpid(), **(pids or {}), "recorder": ks.recorder.proc.pid})
            meter.start()
            t0 = time.perf_counter()
            if key is not None:
                from keel.events.signing import sign_event

                events = [sign_event(event, key) for event in events]
            publish = asyncio.create_task(ks.bus.publish_many(events, max_in_flight=window))
            published_at: list[float] = []
            publish.add_done_callback(lambda _t: published_at.append(time.perf_counter()))
            # The recorder advances its tracking row in the same transaction as the events: once it
            # names the last stream sequence (a fresh stream numbers from 1), all are committed.
            while True:
                seq = await conn.fetchval("SELECT last_js_seq FROM tracking WHERE consumer = 'recorder'")
                if seq is not None and seq >= count:
                    elapsed = time.perf_counter() - t0
                    cpu = meter.stop(count)
                    break
                assert ks.recorder is not None
                ks.recorder.check()
                if publish.done() and publish.exception():
                    raise publish.exception()  # type: ignore[misc]
                await asyncio.sleep(0.005)
            await publish
            stored = await conn.fetchval("SELECT count(*) FROM events")
            if stored != count:
                raise RuntimeError(f"expected {count} events in Postgres, found {stored}")
        finally:
            await conn.close()
    return {"eps": count / elapsed, "publish_eps": count / (published_at[0] - t0), "cpu_us": cpu}


async def measure_latency(servers: Servers, nats_url: str, home: Path, duration_s: float,
                          warmup_s: float = 1.0) -> dict[str, float]:
    """End-to-end latency at ``OFFERED_EPS``, paced against a fixed schedule.

    Visibility is taken at commit, exactly: an ``AFTER INSERT … FOR EACH STATEMENT`` trigger (added to
    this benchmark's own schema only) calls ``pg_notify`` with the highest new position, and Postgres
    delivers a notification only when the inserting transaction commits. The time the notification is
    received here is the event's "visible" time (a slight over-estimate: it includes delivery to this
    process, which is also the publisher). A second connection then maps positions to event ids;
    that lookup is not part of the latency.
    """
    per_tick = round(OFFERED_EPS * TICK_S)
    ticks = round(duration_s / TICK_S)
    events = make_events(per_tick * ticks, job="latency")
    channel = f"keel_bench_{uuid.uuid4().hex[:8]}"
    async with KeelSlice(servers, nats_url, home) as ks:
        schema = ks.piece.schema
        conn = await pg_connect(servers.database_url, schema)
        listener = await pg_connect(servers.database_url, schema)
        try:
            await conn.execute(
                f"""
                CREATE FUNCTION "{schema}".bench_notify() RETURNS trigger LANGUAGE plpgsql AS $$
                DECLARE top bigint;
                BEGIN
                    SELECT max(position) INTO top FROM new_rows;
                    IF top IS NOT NULL THEN PERFORM pg_notify('{channel}', top::text); END IF;
                    RETURN NULL;
                END $$;
                CREATE TRIGGER bench_notify AFTER INSERT ON "{schema}".events REFERENCING NEW TABLE AS new_rows
                    FOR EACH STATEMENT EXECUTE FUNCTION "{schema}".bench_notify();
                """
            )
            commits: asyncio.Queue[tuple[float, int]] = asyncio.Queue()
            await listener.add_listener(channel, lambda *a: commits.put_nowait((time.perf_counter(), int(a[3]))))
            await ks.start_recorder()

            visible: dict[uuid.UUID, float] = {}

            async def map_positions() -> None:
                last = 0
                while True:
                    at, top = await commits.get()
                    rows = await conn.fetch(
                        "SELECT event_id FROM events WHERE position > $1 AND position <= $2", last, top
                    )
                    for row in rows:
                        visible.setdefault(row["event_id"], at)
                    last = max(last, top)

            mapper = asyncio.create_task(map_positions())
            acked: dict[uuid.UUID, float] = {}

            async def publish(event: Any) -> None:
                await ks.bus.publish(event)
                acked[event.id] = time.perf_counter()

            sent: dict[uuid.UUID, float] = {}
            publishes: list[asyncio.Task[Any]] = []
            start = time.perf_counter() + 0.05
            for tick in range(ticks):
                due = start + tick * TICK_S
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                for event in events[tick * per_tick : (tick + 1) * per_tick]:
                    sent[event.id] = due
                    publishes.append(asyncio.create_task(publish(event)))
            await asyncio.gather(*publishes)
            deadline = time.perf_counter() + 30
            while len(visible) < len(events) and time.perf_counter() < deadline:
                assert ks.recorder is not None
                ks.recorder.check()
                await asyncio.sleep(0.05)
            mapper.cancel()
            lost = len(events) - len(visible)
            measured = sorted(
                visible[eid] - due for eid, due in sent.items() if due >= start + warmup_s and eid in visible
            )
            if not measured:
                raise RuntimeError("no event became visible in Postgres")
            ack_latency = sorted(acked[eid] - due for eid, due in sent.items() if due >= start + warmup_s)
        finally:
            await listener.close()
            await conn.close()
    return {
        "p50_ms": percentile(measured, 50) * 1000,
        "p99_ms": percentile(measured, 99) * 1000,
        "max_ms": measured[-1] * 1000,
        "ack_p50_ms": percentile(ack_latency, 50) * 1000,
        "ack_p99_ms": percentile(ack_latency, 99) * 1000,
        "events": len(measured),
        "lost": lost,
        "offered_eps": OFFERED_EPS,
    }


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    index = max(0, min(len(sorted_values) - 1, -(-len(sorted_values) * pct // 100) - 1))
    return sorted_values[int(index)]


# -- the store alone: raw COPY vs SQLAlchemy executemany ------------------------------------------


def store_rows(events: Sequence[Any]) -> list[tuple[Any, ...]]:
    from keel.infra.store import event_row

    return [event_row(e, seq) for seq, e in enumerate(events, start=1)]


async def measure_store(database_url: str, events: Sequence[Any], batch: int) -> dict[str, float]:
    import sqlalchemy as sa
    from sqlalchemy.dialects.postgresql import insert

    from keel.infra.store import EVENT_COLUMNS, create_engine, events_table, run_migrations

    piece = Slice()
    rows = store_rows(events)
    await asyncio.to_thread(run_migrations, database_url, piece.schema)
    conn = await pg_connect(database_url, piece.schema)
    engine = create_engine(database_url, piece.schema)
    try:
        for name in ("copy_target", "sa_target"):
            await conn.execute(f"CREATE TABLE {name} (LIKE events INCLUDING ALL)")
        # Raw asyncpg binary COPY, one committed transaction per recorder-sized batch.
        t0 = time.perf_counter()
        for start in range(0, len(rows), batch):
            async with conn.transaction():
                await conn.copy_records_to_table("copy_target", records=rows[start : start + batch], columns=list(EVENT_COLUMNS))
        copy_s = time.perf_counter() - t0

        # SQLAlchemy Core executemany of the same rows (parameters prepared outside the timing).
        target = events_table.to_metadata(sa.MetaData(), name="sa_target")
        stmt = insert(target).on_conflict_do_nothing(index_elements=["event_id"])
        params = [dict(zip(EVENT_COLUMNS, (*row[:10], json.loads(row[10]), *row[11:]))) for row in rows]
        async with engine.connect() as warm:  # connect outside the timing, as the pool would be
            await warm.execute(sa.text("SELECT 1"))
        t0 = time.perf_counter()
        for start in range(0, len(params), batch):
            async with engine.begin() as sa_conn:
                await sa_conn.execute(stmt, params[start : start + batch])
        sa_s = time.perf_counter() - t0
        counts = [await conn.fetchval(f"SELECT count(*) FROM {name}") for name in ("copy_target", "sa_target")]
        if counts != [len(rows), len(rows)]:
            raise RuntimeError(f"store benchmark stored {counts}, expected {len(rows)} each")
    finally:
        await engine.dispose()
        await conn.close()
        await drop_schema(database_url, piece.schema)
    return {"raw_copy_rps": len(rows) / copy_s, "sa_insert_rps": len(rows) / sa_s}


# -- replay ---------------------------------------------------------------------------------------


async def seed_replay(conn: Any, count: int) -> dict[str, Any]:
    """At least ``count`` events of jobs played through the real deciders (``bench._replay_log``) straight
    into ``events`` (setup, not measured); what the log holds, by producer and type."""
    from collections import Counter
    from datetime import UTC, datetime

    from bench._replay_log import job_logs
    from keel.infra.store import EVENT_COLUMNS, event_row

    kinds: Counter[str] = Counter()
    seq = 0
    jobs = 0
    for log_ in job_logs(count, datetime(2026, 11, 1, tzinfo=UTC)):
        records = []
        for event in log_:
            seq += 1
            kinds[f"{event.producer}:{event.type}"] += 1
            records.append(event_row(event, seq))
        await conn.copy_records_to_table("events", records=records, columns=list(EVENT_COLUMNS))
        jobs += 1
    decisions = sum(n for k, n in kinds.items() if k.split(":")[0] in ("controller", "checkpoint-broker", "analyzer",
                                                                        "hot-update"))
    return {"events": seq, "jobs": jobs, "decisions": decisions, "by_kind": dict(sorted(kinds.items()))}


async def measure_replay(database_url: str, count: int) -> dict[str, Any]:
    """Two passes over the same log: the controller alone (``DeciderSession.observe``, as before, so the
    figure compares with earlier runs), then ``keel replay --verify``'s work, every decider's
    ``ReplayVerifier`` fed each event, which must find every recorded decision again."""
    from bench._replay_log import deciders
    from keel.controller.decider import ControllerDecider
    from keel.infra.store import EventStore, create_engine, run_migrations
    from keel.kernel.decider import DeciderSession
    from keel.kernel.replay import ReplayVerifier

    piece = Slice()
    await asyncio.to_thread(run_migrations, database_url, piece.schema)
    conn = await pg_connect(database_url, piece.schema)
    engine = create_engine(database_url, piece.schema)
    try:
        t0 = time.perf_counter()
        seeded = await seed_replay(conn, count)
        await conn.execute("VACUUM ANALYZE events")
        seed_s = time.perf_counter() - t0
        session = DeciderSession(ControllerDecider())
        folded = 0
        fold_s = 0.0
        gc.collect()
        gc.freeze()  # what `keel replay` does too: the long-lived heap is not rescanned by every collection
        t0 = time.perf_counter()
        async for recorded in EventStore(engine).read():
            f0 = time.perf_counter()
            session.observe(recorded.event)
            fold_s += time.perf_counter() - f0
            folded += 1
        elapsed = time.perf_counter() - t0
        if folded != seeded["events"]:
            raise RuntimeError(f"replay folded {folded} events, expected {seeded['events']}")
        verifiers = [ReplayVerifier(d) for d in deciders().values()]
        gc.collect()
        t0 = time.perf_counter()
        async for recorded in EventStore(engine).read():
            for verifier in verifiers:
                verifier.observe(recorded.event)
        reports = [v.finish() for v in verifiers]
        verify_s = time.perf_counter() - t0
        gc.unfreeze()
        dirty = [r.details() for r in reports if not r.clean]
        if dirty:  # a replay that does not find the log's decisions again measures nothing worth reporting
            raise RuntimeError("replay diverged:\n" + "\n".join(dirty))
    finally:
        await engine.dispose()
        await conn.close()
        await drop_schema(database_url, piece.schema)
    return {"eps": folded / elapsed, "read_s": elapsed - fold_s, "fold_s": fold_s, "seed_s": seed_s, "events": folded,
            "verify_eps": folded / verify_s, "verify_s": verify_s, "jobs": seeded["jobs"],
            "decisions_in_log": seeded["decisions"], "by_kind": seeded["by_kind"],
            "decisions_verified": {r.decider: r.decisions_recorded for r in reports}}


# -- the run --------------------------------------------------------------------------------------


def describe_cpu(cpu: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.0f}" for name, value in cpu.items()) + f" (total {sum(cpu.values()):.0f})"


def fmt(value: float) -> str:
    return f"{value:,.0f}"


def verdict(key: str, value: float) -> tuple[bool, str]:
    op, target = TARGETS[key]
    ok = value >= target if op == "≥" else value <= target
    return ok, f"[target {op} {target:g}] {'PASS' if ok else 'FAIL'}"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from keel.infra.config import RecorderSettings

    sizes = SMOKE if args.smoke else QUICK if args.quick else FULL
    recorder = RecorderSettings()
    batch, fetch_timeout_s = recorder.batch_size, recorder.fetch_timeout.total_seconds()
    results: dict[str, Any] = {
        "quick": args.quick,
        "smoke": args.smoke,
        "sign_all": args.sign_all,
        "window": args.window,
        "recorder_batch_size": batch,
        "recorder_fetch_timeout_ms": fetch_timeout_s * 1000,
        "raw_jetstream_eps": {},
        "raw_jetstream_publish_eps": {},
        "persisted_eps": {},
        "persisted_publish_eps": {},
        "persisted_ratio_by_mode": {},
        "persisted_events": dict(sizes.persisted),
    }
    servers = Servers(modes=tuple(MODES), log=log, prefix="keel-bench-")
    home = scratch_dir("keel-bench-home-")
    began = time.perf_counter()
    try:
        servers.start()
        log(f"servers up: NATS {servers.nats}, Postgres {servers.database_url.split('@')[-1]} "
            f"({time.perf_counter() - began:.1f} s); window {args.window}, recorder batch {batch}, "
            f"fetch timeout {fetch_timeout_s * 1000:.0f} ms")

        only = set(args.only.split(","))
        if "store" in only:
            await run_store(results, servers, sizes, batch)
        if "bus" in only:
            await run_bus(results, servers, sizes, home, args.window, batch, fetch_timeout_s, args.sign_all)
        if "latency" in only:
            await run_latency(results, servers, sizes, home)
        if "replay" in only:
            await run_replay(results, servers, sizes)
    finally:
        servers.stop()
        shutil.rmtree(home, ignore_errors=True)

    results["elapsed_s"] = time.perf_counter() - began
    summary = {}
    for key in TARGETS:
        value: Any = results
        for part in key.split("."):
            value = value.get(part, float("nan")) if isinstance(value, dict) else value
        ok, text = verdict(key, float(value))
        summary[key] = {"value": value, "target": TARGETS[key][1], "op": TARGETS[key][0], "pass": ok}
        log(f"  {'PASS' if ok else 'FAIL'}  {key} = {value:,.2f} {text.split(']')[0]}]")
    results["targets"] = summary
    results["all_pass"] = all(item["pass"] for item in summary.values())
    log(f"{'ALL TARGETS PASS' if results['all_pass'] else 'SOME TARGETS FAIL'} ({results['elapsed_s']:.0f} s)")
    return results


async def run_store(results: dict[str, Any], servers: Servers, sizes: Sizes, batch: int) -> None:
    store = await measure_store(servers.database_url, make_events(sizes.store_rows, job="store"), batch)
    results["raw_copy_rps"] = store["raw_copy_rps"]
    results["sa_insert_rps"] = store["sa_insert_rps"]
    log(f"raw asyncpg COPY:        {fmt(store['raw_copy_rps'])} rows/s  (batches of {batch}, {sizes.store_rows:,} rows)")
    log(f"SQLAlchemy executemany:  {fmt(store['sa_insert_rps'])} rows/s  "
        f"(COPY is {store['raw_copy_rps'] / store['sa_insert_rps']:.1f}× faster)")


def raw_windows(window: int, count: int) -> list[int]:
    """The windows the ceiling tries: Keel's own and wider ones, each at most the message count."""
    return sorted({min(w, count) for w in (window, 1024, 4096)})


async def run_bus(results: dict[str, Any], servers: Servers, sizes: Sizes, home: Path, window: int, batch: int,
                  fetch_timeout_s: float, sign_all: bool = False) -> None:
    for mode in MODES:
        events = make_events(sizes.persisted[mode], job=f"bus{mode.replace('_', '')}")
        raw = await measure_raw_jetstream(servers, servers.nats[mode], events, raw_windows(window, len(events)), batch,
                                          fetch_timeout_s, servers.pids.get(f"nats-{mode}"))
        keel = await measure_persisted(servers, servers.nats[mode], home, events, window,
                                       {"nats": servers.pids.get(f"nats-{mode}"), "postgres": servers.pids.get("postgres")},
                                       sign_all=sign_all)
        results.setdefault("cpu_us_per_event", {})[f"raw_{mode}"] = raw["cpu_us"]
        results["cpu_us_per_event"][f"persisted_{mode}"] = keel["cpu_us"]
        ratio = keel["eps"] / raw["eps"]
        results["raw_jetstream_eps"][mode] = raw["eps"]
        results["raw_jetstream_publish_eps"][mode] = raw["publish_eps"]
        results.setdefault("raw_jetstream_window", {})[mode] = raw["window"]
        results.setdefault("raw_jetstream_eps_by_window", {})[mode] = raw["eps_by_window"]
        results["persisted_eps"][mode] = keel["eps"]
        results["persisted_publish_eps"][mode] = keel["publish_eps"]
        results["persisted_ratio_by_mode"][mode] = ratio
        log(f"raw JetStream ({mode}): {fmt(raw['eps'])} eps consumed+acked, window {raw['window']} (by window: "
            f"{', '.join(f'{w}: {fmt(v)}' for w, v in raw['eps_by_window'].items())}; publisher alone "
            f"{fmt(raw['publish_eps'])} acked/s)")
        log(f"persisted ({mode}):     {fmt(keel['eps'])} eps = {ratio:.2f} × raw JetStream {fmt(raw['eps'])} eps  "
            f"{verdict('persisted_ratio', ratio)[1]}  (publisher acked {fmt(keel['publish_eps'])}/s)")
        log(f"    CPU µs/event: raw {describe_cpu(raw['cpu_us'])}; Keel {describe_cpu(keel['cpu_us'])}")
    results["persisted_ratio"] = min(results["persisted_ratio_by_mode"].values())
    log(f"persisted (sync_default) absolute: {fmt(results['persisted_eps']['sync_default'])} eps  "
        f"{verdict('persisted_eps.sync_default', results['persisted_eps']['sync_default'])[1]}")


async def run_latency(results: dict[str, Any], servers: Servers, sizes: Sizes, home: Path) -> None:
    for mode in MODES:
        lat = await measure_latency(servers, servers.nats[mode], home, sizes.latency_s[mode])
        suffix = "" if mode == "sync_always" else "_sync_default"
        results[f"p50_ms{suffix}"] = lat["p50_ms"]
        results[f"p99_ms{suffix}"] = lat["p99_ms"]
        results[f"max_ms{suffix}"] = lat["max_ms"]
        results[f"latency_events{suffix}"] = lat["events"]
        results[f"latency_lost{suffix}"] = lat["lost"]
        line = (f"latency ({mode}) at {OFFERED_EPS:,} events/s: p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, "
                f"max {lat['max_ms']:.1f} ms over {lat['events']:,} events (publish acked: p50 {lat['ack_p50_ms']:.1f} ms, "
                f"p99 {lat['ack_p99_ms']:.1f} ms)")
        if lat["lost"]:
            line += f"  ({lat['lost']} never became visible!)"
        if mode == "sync_always":
            line += f"  {verdict('p99_ms', lat['p99_ms'])[1]}"
        log(line)


async def run_replay(results: dict[str, Any], servers: Servers, sizes: Sizes) -> None:
    replay = await measure_replay(servers.database_url, sizes.replay)
    results["replay_eps"] = replay["eps"]
    results["replay_events"] = replay["events"]
    results["replay_read_s"] = replay["read_s"]
    results["replay_fold_s"] = replay["fold_s"]
    results["replay_verify_eps"] = replay["verify_eps"]
    results["replay_jobs"] = replay["jobs"]
    results["replay_decisions_in_log"] = replay["decisions_in_log"]
    results["replay_decisions_verified"] = replay["decisions_verified"]
    results["replay_log_by_kind"] = replay["by_kind"]
    log(f"replay: {fmt(replay['eps'])} events/s through the controller over {replay['events']:,} events of "
        f"{replay['jobs']} jobs, {replay['decisions_in_log']:,} of them decisions (read+decode {replay['read_s']:.1f} s, "
        f"fold {replay['fold_s']:.1f} s; seeding took {replay['seed_s']:.1f} s)  {verdict('replay_eps', replay['eps'])[1]}")
    log(f"replay --verify, all four deciders: {fmt(replay['verify_eps'])} events/s; decisions found again: "
        f"{', '.join(f'{k} {v:,}' for k, v in replay['decisions_verified'].items())}; no divergence")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_raw_consumer":  # internal: the raw ceiling's consumer process
        url, stream, subjects, count, batch, timeout_s, identity = argv[1:8]
        asyncio.run(raw_consumer_main(url, stream, subjects, int(count), int(batch), float(timeout_s), identity))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.bus", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller sizes; a few minutes")
    size.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: checks that the benchmark works")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--sign-all", action="store_true",
                        help="sign every published event and verify each in the recorder (the worst case of signing)")
    parser.add_argument("--window", type=int, default=256, help="unacknowledged publishes in flight (default 256)")
    parser.add_argument("--only", default="store,bus,latency,replay",
                        help="comma-separated parts to run, for iterating (default: all; targets of skipped parts FAIL)")
    args = parser.parse_args(argv)
    from bench._provenance import provenance

    results = {**provenance(argv, "bench.bus"), **asyncio.run(run(args))}
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

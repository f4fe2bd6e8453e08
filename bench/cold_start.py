"""The controller's cold start by the size of the history: time from starting the process to deciding.

For each history size N (events in the log before the restart):

1. Setup, not timed: N - T events of finished jobs (8 nodes x 8 ranks each, ~4,400 events: registrations,
   rank starts, a heartbeat per node every 5 s, one clock tick per second, a crash that the real
   controller decider diagnoses and restarts, then every rank exiting successfully; one job generated
   with the controller's own decisions in it, the others copies with their own ids) are copied into the
   event store; the last T = 10,000 events are a
   live 1,000-node job (registrations, rank starts, heartbeats), published through NATS and recorded by
   the real recorder process.
2. The controller process starts once on that log, untimed except for its time to ready (the full fold:
   ``full_fold_ready_s``); it writes a snapshot at its cold start, consumes the live job's events and
   acknowledges them; then it is stopped (SIGTERM).
3. Timed: a new controller process is spawned and, at the same moment, a fatal GPU fault on a node of the
   live job is published. ``cold_start_s`` is the time from the spawn to the controller's decision about
   that fault arriving at an observer: interpreter start, settings, migrations check, the newest snapshot
   loaded, the log after it folded, the consumer bound and the fault decided: the whole path a restarted
   controller takes before it acts again.

The history is in the store only (copied, ``js_seq`` empty, as if recorded from an earlier stream), so the
stream holds only the live job: that is the state a long-running deployment is in, where the stream keeps
days and the log keeps everything.

Authentication is on (``bench._servers``): the bench publishes as the servers' admin; the recorder and the
controller authenticate as their own roles.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

LIVE_NODES = 1000
TAIL_EVENTS = 10_000


def log(message: str) -> None:
    print(message, flush=True)


def finished_job_events(job: str, start: datetime) -> list[Any]:
    """One finished job's log, decisions included (the real controller decider decides as it goes)."""
    from keel.controller.decider import ControllerDecider
    from keel.events.envelope import Event
    from keel.events.types import (
        CheckResult,
        DiagnosticsCompleted,
        DiagnosticsRequested,
        NodeHeartbeat,
        NodeRegistered,
        RankExited,
        RanksRestartRequested,
        RankStarted,
        TimerTicked,
    )
    from keel.kernel.decider import DeciderSession

    nodes = [f"{job}-n{i}" for i in range(8)]
    session = DeciderSession(ControllerDecider())
    out: list[Event] = []
    generation = 0

    def emit(payload: Any, seconds: float, subject: str, producer: str = "node-agent") -> Event:
        event = Event.create(payload, job_id=job, subject=subject, producer=producer,
                             occurred_at=start + timedelta(seconds=seconds))
        feed(event, seconds)
        return event

    def feed(event: Event, seconds: float) -> None:
        out.append(event)
        for decision in session.observe(event).emitted:
            out.append(decision)
            session.observe(decision)
            answer(decision, seconds)

    def answer(decision: Event, seconds: float) -> None:
        nonlocal generation
        p = decision.payload
        if isinstance(p, DiagnosticsRequested):
            for node in p.nodes:
                emit(DiagnosticsCompleted(node_id=node, request_id=str(decision.id), round=p.round, passed=True,
                                          results=[CheckResult(check="intra_node_all_to_all", passed=True, duration_s=1.0)]),
                     seconds + 3, f"node/{node}")
        elif isinstance(p, RanksRestartRequested):
            generation = max(generation, p.generation)
            first_rank = nodes.index(p.node_id) * 8
            for rank in range(first_rank, first_rank + 8):
                emit(RankStarted(node_id=p.node_id, rank=rank, local_rank=rank % 8, world_size=64, pid=1000 + rank,
                                 generation=p.generation), seconds + 2, f"rank/{rank}")

    for node in nodes:
        emit(NodeRegistered(node_id=node, host=node), 0, f"node/{node}")
    for index, node in enumerate(nodes):
        for local in range(8):
            rank = index * 8 + local
            emit(RankStarted(node_id=node, rank=rank, local_rank=local, world_size=64, pid=100 + rank, generation=0),
                 1, f"rank/{rank}")
    duration_s, step = 1600, 0
    for second in range(2, duration_s):
        emit(TimerTicked(now=start + timedelta(seconds=second)), second, f"clock/{job}", producer="clock")
        if second % 5 == 0:
            step += 5
            for node in nodes:
                emit(NodeHeartbeat(node_id=node, ranks_alive=8, ranks_expected=8, last_step=step, step_time_p50_s=1.0),
                     second, f"node/{node}")
        if second == 600:
            emit(RankExited(node_id=nodes[1], rank=9, pid=109, generation=0, exit_code=None, signal="SIGSEGV",
                            classification="unknown", reason="killed by SIGSEGV"), second, "rank/9")
    for index, node in enumerate(nodes):
        for local in range(8):
            rank = index * 8 + local
            emit(RankExited(node_id=node, rank=rank, pid=100 + rank, generation=generation, exit_code=0,
                            classification="success", reason="exited 0"), duration_s, f"rank/{rank}")
    return out


def history_rows(count: int, start: datetime) -> list[tuple[Any, ...]]:
    """At least ``count`` events of finished jobs as store rows (``js_seq`` empty), cut to ``count``.

    One job is generated through the real decider; the others are copies of its rows with their own job
    id, node names, times and ids (every id, the ones payloads quote included, mapped to a fresh one per
    job, so causation and evidence still point within each job): a million events in seconds."""
    import re
    import uuid

    from keel.infra.store import event_row

    template = [event_row(event, None) for event in finished_job_events("done00000", start)]
    uuid_text = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    rows: list[tuple[Any, ...]] = []
    job = 0
    while len(rows) < count:
        name = f"done{job:05d}"
        shift = timedelta(hours=job)
        ids: dict[str, str] = {}

        def fresh(text: str, ids: dict[str, str] = ids) -> str:
            return ids.setdefault(text, str(uuid.uuid4()))

        def new_id(value: Any) -> Any:
            return None if value is None else uuid.UUID(fresh(str(value)))

        for (event_id, js_seq, type_, version, _job, subject, occurred_at, producer, causation, correlation,
             payload, _signed_by, _signature) in template:
            text = payload if isinstance(payload, str) else payload.decode()
            text = uuid_text.sub(lambda m: fresh(m.group(0)), text.replace("done00000", name))
            # Unsigned: the controller folds its log as recorded (signatures are checked when an event is
            # consumed live, not on a cold start), and a copy's signature would not match its new ids.
            rows.append((new_id(event_id), js_seq, type_, version, name, subject.replace("done00000", name),
                         occurred_at + shift, producer, new_id(causation), new_id(correlation),
                         text if isinstance(payload, str) else text.encode(), None, None))
        job += 1
    return rows[:count]


def live_job_events(job: str, end: datetime) -> list[Any]:
    """``TAIL_EVENTS`` events of a running 1,000-node job ending at ``end``: what the log holds after
    the controller's newest snapshot."""
    from keel.events.envelope import Event
    from keel.events.types import NodeHeartbeat, NodeRegistered, RankStarted

    nodes = [f"n{i:04d}" for i in range(LIVE_NODES)]
    rounds = (TAIL_EVENTS - 2 * LIVE_NODES) // LIVE_NODES
    begin = end - timedelta(seconds=5 * rounds + 2)
    events = [Event.create(NodeRegistered(node_id=n, host=n), job_id=job, subject=f"node/{n}", producer="node-agent",
                           occurred_at=begin) for n in nodes]
    events += [Event.create(RankStarted(node_id=n, rank=i, local_rank=0, world_size=LIVE_NODES, pid=100 + i,
                                        generation=0), job_id=job, subject=f"rank/{i}", producer="node-agent",
                            occurred_at=begin + timedelta(seconds=1)) for i, n in enumerate(nodes)]
    for r in range(rounds):
        at = begin + timedelta(seconds=2 + 5 * (r + 1))
        events += [Event.create(NodeHeartbeat(node_id=n, ranks_alive=1, ranks_expected=1, last_step=r, step_time_p50_s=1.0),
                                job_id=job, subject=f"node/{n}", producer="node-agent", occurred_at=min(at, end))
                   for n in nodes]
    return events


def service_env(settings: Any, home: Path, servers: Any) -> dict[str, str]:
    """The services' environment: ``settings``' servers and slice, each service's own identity from the
    servers' credentials folder (``Servers.service_env``)."""
    return {
        **os.environ,
        **servers.service_env,
        "KEEL_HOME": str(home),
        "KEEL_NATS_URL": settings.nats_url or "",
        "KEEL_DATABASE_URL": settings.database_url or "",
        "KEEL_DB_SCHEMA": settings.db_schema,
        "KEEL_BUS__SUBJECT_PREFIX": settings.bus.subject_prefix,
        "KEEL_BUS__STREAM": settings.bus.stream,
        "KEEL_BUS__DLQ_STREAM": settings.bus.dlq_stream,
    }


def spawn(name: str, env: dict[str, str], log_path: Path, ready: Path | None = None) -> subprocess.Popen:
    extra = {"KEEL_SERVICE_READY_FILE": str(ready)} if ready else {}
    with open(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "keel.cli.main", "service", name], env={**env, **extra},
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


async def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


async def measure_cold_start_once(servers: Any, scratch: Path, history: int) -> dict[str, float]:
    """One history size (events in the log before the timed restart): ``cold_start_s`` and its context."""
    import uuid

    import asyncpg

    from keel.events.envelope import Event, decode_event, now_utc
    from keel.events.types import NodeHealthChanged
    from keel.infra.bus import Bus, fetch_batch
    from keel.infra.store import EVENT_COLUMNS, EventStore, create_engine, run_migrations

    tag = uuid.uuid4().hex[:10]
    nats_url, database_url = servers.nats_url, servers.database_url
    settings = servers.settings(db_schema=f"cold_{tag}",
                                bus={"subject_prefix": f"kc{tag}", "stream": f"KC{tag}", "dlq_stream": f"KC{tag}_DLQ"})
    home = scratch / f"home-{tag}"
    home.mkdir(parents=True)
    env = service_env(settings, home, servers)
    servers.authorize(settings.bus)  # the recorder's and the controller's identities, on this slice
    await asyncio.to_thread(run_migrations, database_url, settings.db_schema)
    engine = create_engine(database_url, settings.db_schema)
    store = EventStore(engine)
    bus = await Bus.connect(nats_url, settings.bus, name="cold-start-bench", administer=True)
    processes: list[subprocess.Popen] = []
    try:
        t0 = time.perf_counter()
        rows = await asyncio.to_thread(history_rows, history - TAIL_EVENTS, now_utc() - timedelta(days=30))
        conn = await asyncpg.connect(database_url, server_settings={"search_path": settings.db_schema})
        try:
            for start in range(0, len(rows), 50_000):
                await conn.copy_records_to_table("events", records=rows[start:start + 50_000], columns=list(EVENT_COLUMNS))
            await conn.execute("VACUUM ANALYZE events")
        finally:
            await conn.close()
        setup_s = time.perf_counter() - t0
        jobs = len({row[4] for row in rows})
        del rows
        log(f"  history: {history - TAIL_EVENTS} events of {jobs} finished jobs in the store ({setup_s:.0f} s setup)")

        recorder = spawn("recorder", env, scratch / f"recorder-{tag}.log")
        processes.append(recorder)
        ready = home / "controller.ready"
        t0 = time.perf_counter()
        first = spawn("controller", env, scratch / f"controller-{tag}.log", ready)
        processes.append(first)

        async def is_ready() -> bool:
            if first.poll() is not None:
                raise RuntimeError(f"the controller exited {first.returncode}; see {scratch}/controller-{tag}.log")
            return ready.exists()

        await wait_for(is_ready, 900, "the first controller to fold the whole log")
        full_fold_ready_s = time.perf_counter() - t0
        snapshots = await store.snapshots("controller")
        log(f"  first start (full fold): ready in {full_fold_ready_s:.1f} s; snapshot "
            f"{'at position ' + str(snapshots[0].position) + f' ({len(snapshots[0].state):,} bytes of state)' if snapshots else 'none'}")

        live = "live"
        await bus.publish_many(live_job_events(live, now_utc()))

        async def all_recorded() -> bool:
            return await store.count() >= history

        await wait_for(all_recorded, 600, "the live job's events to be recorded")

        async def tail_acknowledged() -> bool:
            floor = await bus.consumer_ack_floor("controller")
            _, last = await bus.stream_bounds()
            return floor is not None and floor >= last

        await wait_for(tail_acknowledged, 600, "the controller to acknowledge the live job's events")
        stop(first)
        count_before = await store.count()

        observer = await bus.pull_consumer(f"observer{tag}", filter_subject=f"{settings.bus.subject_prefix}.{live}.>")
        while await fetch_batch(observer, 1024, 0.2):
            pass  # skip what is there: only the decision about the fault counts
        fault = Event.create(NodeHealthChanged(node_id="n0007", status="failed", component="gpu", check="xid",
                                               confidence="high", is_fatal=True, detail="XID 79"),
                             job_id=live, subject="node/n0007", producer="node-agent", occurred_at=now_utc())
        t0 = time.perf_counter()
        second = spawn("controller", env, scratch / f"controller-{tag}.log")
        processes.append(second)
        await bus.publish(fault)
        decided_at = None
        while decided_at is None:
            if time.perf_counter() - t0 > 300:
                raise RuntimeError("no decision about the fault within 300 s")
            if second.poll() is not None:
                raise RuntimeError(f"the controller exited {second.returncode}; see {scratch}/controller-{tag}.log")
            for msg in await fetch_batch(observer, 256, 0.05):
                event = decode_event(msg.data, max_bytes=settings.bus.max_event_bytes)
                await msg.ack()
                if event.producer == "controller" and event.causation_id == fault.id:
                    decided_at = time.perf_counter()
                    decision = event.type
                    break
        cold_start_s = decided_at - t0
        log(f"  restart: {decision} about the fault {cold_start_s:.2f} s after the process was spawned "
            f"(log of {count_before:,} events)")
        return {"cold_start_s": cold_start_s, "full_fold_ready_s": full_fold_ready_s, "events": count_before,
                "finished_jobs": jobs, "snapshot_bytes": len(snapshots[0].state) if snapshots else 0,
                "setup_s": setup_s}
    finally:
        for process in processes:
            stop(process)
        for stream in (settings.bus.stream, settings.bus.dlq_stream):
            try:
                await bus.js.delete_stream(stream)
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass
        await bus.close()
        await engine.dispose()
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(f'DROP SCHEMA "{settings.db_schema}" CASCADE')
        finally:
            await conn.close()


async def measure_cold_start(servers: Any, scratch: Path,
                             sizes: tuple[int, ...] = (100_000, 1_000_000)) -> dict[str, Any]:
    """``cold_start_s`` keyed by history size (as a string), ``cold_start_growth`` (largest / smallest),
    and the details of each size, on ``servers`` (``bench._servers.Servers``, started)."""
    details = {}
    for size in sizes:
        log(f"cold start, {size:,} events of history:")
        details[str(size)] = await measure_cold_start_once(servers, scratch, size)
    figures = {size: d["cold_start_s"] for size, d in details.items()}
    growth = figures[str(max(sizes))] / figures[str(min(sizes))]
    return {"cold_start_s": figures, "cold_start_growth": growth, "cold_start_detail": details}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench._servers import Servers

    parser = argparse.ArgumentParser(prog="python -m bench.cold_start", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: histories of 11,000 and 12,000 events (a check that it works)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes = "11000,12000"  # just over the live job's 10,000 events: 1,000 and 2,000 of history
    servers = Servers(log=log, prefix="keel-cold-")
    servers.start()
    try:
        assert servers.root is not None
        results = asyncio.run(measure_cold_start(servers, servers.root, tuple(int(s) for s in args.sizes.split(","))))
    finally:
        servers.stop()
    from bench._provenance import provenance

    results = {**provenance(list(sys.argv[1:] if argv is None else argv), "bench.cold_start"), "smoke": args.smoke,
               **results}
    print(json.dumps({k: v for k, v in results.items() if k != "cold_start_detail"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

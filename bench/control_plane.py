"""What the control plane costs a job in steady state: events recorded per node, and recorder lag at 1,000 nodes.

    python -m bench.control_plane [--quick] [--json PATH] [--only steady,lag,cold]

One run starts its own servers (``bench._servers``: embedded NATS with JetStream ``sync_interval:
always`` - acknowledged means on disk - and PostgreSQL, free ports, scratch dirs under /tmp). Keys
(``main`` gathers them into one dict; each is measured by its own ``measure_*`` function):

- ``steady_events_per_node_s``: events recorded per node per second for a job with no faults
  (``measure_steady_events``). ``keel up``'s services as processes (controller, checkpoint broker,
  analyzer, local actuator; the recorder in this process) and a real local cluster (``libs/cluster``:
  ``bench.recovery.KeelStack``, 4 nodes x 2 ranks of the example GPT paced to 100 ms a step, plus one
  warm standby), every agent with its checkpointing (memory ring, peer backups, persistent tier). Once
  the job steps and a settle period has passed (start-up excluded: registrations, the first schedule,
  backup placement; longer than the clock's 60 s busy window), every event recorded in PostgreSQL
  whose time falls in the measured period is counted, by type; the key is that count / nodes (every
  agent, the standby included) / seconds. The commits recorded in the period are reported beside (the
  coalesced reports must still commit steps). Two knobs keep a busy 2-core host from faking faults:
  fail-slow and the agents' throughput-decline check judge only gross slowdowns (``measure_steady_events``).
- ``recorder_lag_p99_s``: the recorder's lag p99 (``measure_recorder_lag``): simulated agents of a
  1,000-node job (8 ranks each) publish every event kind a stepping agent sends, at the rate it sends
  it (``steady_kinds``: derived from the agent's code and the settings' defaults, and printed), plus
  the per-job events of that job (clock ticks, commits, persists) for the measured period; the real
  recorder (a separate process, ``bench.bus.KeelSlice``) writes them to PostgreSQL. Lag = the moment
  the row is committed (an ``AFTER INSERT`` statement trigger's ``pg_notify``, delivered at commit)
  minus the event's scheduled publish time (so a publisher that falls behind cannot hide lag).
- ``cold_start_s``: the controller's time from process start to deciding, keyed by the size of the
  history (100,000 and 1,000,000 events, nearly all of finished jobs), and ``cold_start_growth`` (1M /
  100k): ``bench.cold_start`` says how (a snapshot written by an earlier start, the log after it folded,
  a fault published at the spawn decided).

Exits 0 even when a target is missed (it is a benchmark); misses are printed as FAIL. Results are
written with the commit, date, cores and command (``--json``; ``bench/results/`` keeps them).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._servers import Servers, scratch_dir  # noqa: E402

TARGETS = {
    "steady_events_per_node_s": ("≤", 0.3),
    "recorder_lag_p99_s": ("≤", 2.0),
    "cold_start_s.1000000": ("≤", 5.0),
    "cold_start_growth": ("≤", 1.5),
}
COLD_START_SIZES = (100_000, 1_000_000)
LAG_NODES = 1000
LAG_RANKS_PER_NODE = 8
LAG_JOB = "lag-1000"


@dataclass(frozen=True)
class Sizes:
    steady_settle_s: float
    steady_measure_s: float
    lag_measure_s: float


# The settle period outlasts the clock's busy window (``controller.clock_busy_window``, 60 s): start-up's
# registrations and placements are inputs that keep a job's clock at its busy rate for that long.
QUICK = Sizes(steady_settle_s=70.0, steady_measure_s=60.0, lag_measure_s=30.0)
FULL = Sizes(steady_settle_s=90.0, steady_measure_s=300.0, lag_measure_s=300.0)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def verdict(key: str, value: float) -> tuple[bool, str]:
    op, target = TARGETS[key]
    ok = value >= target if op == "≥" else value <= target
    return ok, f"[target {op} {target:g}] {'PASS' if ok else 'FAIL'}"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- steady_events_per_node_s -----------------------------------------------------------------------


async def measure_steady_events(servers: Servers, work: Path, settle_s: float, measure_s: float) -> dict[str, Any]:
    """Events recorded per node per second by a real local cluster with no faults (see the module doc)."""
    from bench import recovery

    mode = dataclasses.replace(recovery.QUICK, floor=None)  # production step-timeout floor: nothing fires
    stack = recovery.KeelStack(servers, work, mode)
    # Two cores shared by every rank, agent and service: compute and step times jitter far past the
    # fail-slow limits, and a false conviction is a fault (an eviction, a promotion). No fail-slow rounds
    # in the measured period (they record nothing unless they convict).
    stack.knobs["KEEL_ANALYZER__FAILSLOW_RATIO"] = "10"
    stack.knobs["KEEL_ANALYZER__FAILSLOW_INTERVAL"] = "1h"  # its step-time z-score convicts on jitter too
    # Likewise throughput: the agents' decline check (a rank's tokens/s under 80 % of its best window)
    # fires on every rank whenever another process takes the cores for a while. Only under 30 % here.
    stack.knobs["KEEL_ANALYZER__METRIC_DECLINE_FRACTION"] = "0.3"
    try:
        log(f"steady: starting the services and a local cluster of {recovery.NODES} x {recovery.NPROC} ranks "
            f"+ 1 standby")
        await stack.start()
        generation, step = await stack.steady(min_steps=5, timeout_s=300.0)
        log(f"steady: stepping (generation {generation}, step {step}); settling {settle_s:.0f} s")
        await asyncio.sleep(settle_s)
        t0 = datetime.now(UTC)
        await asyncio.sleep(measure_s)
        t1 = datetime.now(UTC)
        await asyncio.sleep(3.0)  # what was published in the period has been recorded
        window = [r.event for r in stack.log.events if t0 <= r.event.occurred_at < t1]
        nodes = recovery.NODES + 1  # every agent, the standby included
        seconds = (t1 - t0).total_seconds()
        by_type = Counter(e.type for e in window)
        incidents = [e for e in window if e.type == "IncidentOpened"]
        commits = Counter(e.payload.tier for e in window if e.type == "CheckpointStepCommitted")
        heartbeats = [e for e in window if e.type == "NodeHeartbeat"]
        carrying = sum(1 for e in heartbeats if e.payload.stored)
        node_scoped = sum(n for t, n in by_type.items() if t not in ("TimerTicked", "CheckpointStepCommitted",
                                                                       "CheckpointScheduleSet", "CheckpointPersisted",
                                                                       "CheckpointBackupAssigned"))
        for e in window:
            if e.type in ("MetricAnomalyDetected", "IncidentOpened", "FailSlowConvicted"):
                log(f"steady: {e.type} at {e.occurred_at:%H:%M:%S}: {getattr(e.payload, 'reason', '')[:200]}")
            if e.type == "CheckpointScheduleSet":
                log(f"steady: schedule at {e.occurred_at:%H:%M:%S}: K {e.payload.every_k_steps}, backups every "
                    f"{e.payload.backup_every_k_steps}: {e.payload.reason[:160]}")
        _, last = await stack.steady(min_steps=1, timeout_s=60.0)
        return {
            "load_avg_1m_after": os.getloadavg()[0],
            "events": len(window), "nodes": nodes, "seconds": seconds,
            "per_node_s": len(window) / nodes / seconds,
            "node_events_per_node_s": node_scoped / nodes / seconds,
            "by_type_per_s": {t: n / seconds for t, n in sorted(by_type.items())},
            "commits": dict(commits), "heartbeats_with_shards": carrying, "heartbeats": len(heartbeats),
            "incidents": len(incidents), "steps": last - step,
        }
    finally:
        await stack.stop()


# -- recorder_lag_p99_s ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """One kind of event a stepping job records, and how often."""

    name: str
    per: str  # "node" or "job"
    every_s: float
    why: str


def steady_kinds() -> list[Kind]:
    """What a stepping agent (and its job) records, from the agent's code and the settings' defaults.

    Agent (``keel.agent.agent.NodeAgent.tick`` / ``keel.agent.checkpointing``): a ``NodeHeartbeat``
    (carrying the memory and peer holdings) per report round, rounds every heartbeat interval to twice
    that (``report_round_steps``), a heartbeat at least every twice the interval: at most one per
    interval (the worst case is simulated); a disk ``CheckpointShardsStored`` per persisted step (Young's
    interval from the broker's priors). Everything else an agent sends (registrations, starts, exits,
    inventories, health changes, anomalies, rounds) answers a change, not time: none in steady state.
    Per job: a ``TimerTicked`` per quiet clock interval, a memory and a peer ``CheckpointStepCommitted``
    per report round, a disk commit and a ``CheckpointPersisted`` per persisted step.
    """
    from keel.agent.launch_spec import LaunchSpec
    from keel.infra.config import CheckpointSettings, ControllerSettings

    heartbeat = LaunchSpec.__dataclass_fields__["heartbeat_interval"].default.total_seconds()  # type: ignore[union-attr]
    ckpt, ctl = CheckpointSettings(), ControllerSettings()
    persist_s = math.sqrt(2 * ckpt.initial_save_cost.total_seconds() * ckpt.mtbf_prior.total_seconds())
    return [
        Kind("NodeHeartbeat", "node", heartbeat, "one per report round (every heartbeat interval to twice that)"),
        Kind("CheckpointShardsStored", "node", persist_s, "disk tier, one per persisted step (Young's interval)"),
        Kind("TimerTicked", "job", ctl.clock_quiet_interval.total_seconds(), "the job clock, quiet job"),
        Kind("CheckpointStepCommitted", "job", 10.0 / 2, "memory and peer commit, at most one per tier and 10 s "
             "(the broker's commit_min_period)"),
        Kind("CheckpointStepCommitted", "job", persist_s, "disk commit per persisted step"),
        Kind("CheckpointPersisted", "job", persist_s, "manifest per persisted step"),
    ]


def lag_events(kinds: list[Kind], nodes: int, ranks_per_node: int, duration_s: float,
               seed: int = 14) -> list[tuple[float, Any]]:
    """(scheduled offset s, event) for ``duration_s`` of a ``nodes``-node job: each node's periodic kinds
    at a random phase, payloads the size a real agent sends (heartbeats with every rank's holdings)."""
    from keel.events.envelope import Event
    from keel.events.types import (
        CLOCK_PRODUCER,
        CheckpointPersisted,
        CheckpointShardsStored,
        CheckpointStepCommitted,
        NodeHeartbeat,
        ShardRecord,
        TimerTicked,
    )

    rng = random.Random(seed)
    start = datetime.now(UTC)
    world = nodes * ranks_per_node
    schedule: list[tuple[float, Any]] = []

    def records(node: int, step: int, peer: bool) -> list[ShardRecord]:
        found = []
        for local in range(ranks_per_node):
            rank = node * ranks_per_node + local
            owner = f"n{(node + 1) % nodes:04d}" if peer else ""
            if peer:
                rank = ((node + 1) % nodes) * ranks_per_node + local
            # The newest report-round step per rank and tier (``NodeCheckpointing.holdings``).
            found.append(ShardRecord(rank=rank, step=step, bytes=2 << 30, digest=f"{rank:08x}{step:056x}",
                                     owner_node_id=owner, send_s=0.0 if peer else 0.84))
        return found

    for kind in kinds:
        producers = range(nodes) if kind.per == "node" else range(1)
        for node in producers:
            t = rng.uniform(0, kind.every_s)
            while t < duration_s:
                step = 1000 + int(t / 0.2)
                at = start + timedelta(seconds=t)
                node_id = f"n{node:04d}"
                if kind.name == "NodeHeartbeat":
                    payload: Any = NodeHeartbeat(
                        node_id=node_id, ranks_alive=ranks_per_node, ranks_expected=ranks_per_node, last_step=step,
                        step_time_p50_s=0.2, rank_compute_time_p50_s={node * ranks_per_node + i: 0.15
                                                                      for i in range(ranks_per_node)},
                        stored={"memory": records(node, step, False), "peer": records(node, step, True)})
                    event = Event.create(payload, job_id=LAG_JOB, subject=f"node/{node_id}", producer="agent",
                                         occurred_at=at)
                elif kind.name == "CheckpointShardsStored":
                    payload = CheckpointShardsStored(node_id=node_id, tier="disk", shards=[
                        ShardRecord(rank=node * ranks_per_node + i, step=step, bytes=2 << 30, digest=f"{i:064x}",
                                    write_s=3.2) for i in range(ranks_per_node)])
                    event = Event.create(payload, job_id=LAG_JOB, subject=f"node/{node_id}", producer="agent",
                                         occurred_at=at)
                elif kind.name == "TimerTicked":
                    event = Event.create(TimerTicked(now=at), job_id=LAG_JOB, subject=f"clock/{LAG_JOB}",
                                         producer=CLOCK_PRODUCER, occurred_at=at)
                elif kind.name == "CheckpointStepCommitted":
                    event = Event.create(CheckpointStepCommitted(tier="peer", step=step, ranks=world,
                                                                 bytes=world * (2 << 30)),
                                         job_id=LAG_JOB, subject=f"job/{LAG_JOB}", producer="checkpoint-broker",
                                         occurred_at=at)
                else:
                    event = Event.create(CheckpointPersisted(step=step, path=f"/ckpt/{LAG_JOB}/step-{step:09d}/manifest.json",
                                                             manifest_digest="0" * 64, bytes=world * (2 << 30),
                                                             save_cost_s=3.2),
                                         job_id=LAG_JOB, subject=f"job/{LAG_JOB}", producer="checkpoint-broker",
                                         occurred_at=at)
                schedule.append((t, event))
                t += kind.every_s
    schedule.sort(key=lambda item: item[0])
    return schedule


async def measure_recorder_lag(servers: Servers, home: Path, duration_s: float, nodes: int = LAG_NODES,
                               ranks_per_node: int = LAG_RANKS_PER_NODE) -> dict[str, Any]:
    """The recorder's lag while simulated agents of a ``nodes``-node job publish (see the module doc)."""
    from bench.bus import KeelSlice, pg_connect

    kinds = steady_kinds()
    for kind in kinds:
        count = nodes if kind.per == "node" else 1
        log(f"lag: {kind.name:<24} per {kind.per}: every {kind.every_s:7.1f} s -> {count / kind.every_s:8.2f} events/s"
            f"  ({kind.why})")
    schedule = lag_events(kinds, nodes, ranks_per_node, duration_s)
    log(f"lag: host load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    sizes = [len(e.to_json()) for _, e in schedule]
    offered = len(schedule) / duration_s
    log(f"lag: {len(schedule):,} events over {duration_s:.0f} s ({offered:.1f} events/s, heartbeat "
        f"{max(sizes) / 1024:.1f} KiB, mean event {sum(sizes) / len(sizes) / 1024:.1f} KiB)")
    channel = f"keel_bench_{uuid.uuid4().hex[:8]}"
    home.mkdir(parents=True, exist_ok=True)
    async with KeelSlice(servers, servers.nats_url, home) as ks:
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
                    rows = await conn.fetch("SELECT event_id FROM events WHERE position > $1 AND position <= $2",
                                            last, top)
                    for row in rows:
                        visible.setdefault(row["event_id"], at)
                    last = max(last, top)

            mapper = asyncio.create_task(map_positions())
            publishes: list[asyncio.Task[Any]] = []
            scheduled: dict[uuid.UUID, float] = {}
            start = time.perf_counter() + 0.1
            for offset, event in schedule:
                due = start + offset
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                scheduled[event.id] = due
                publishes.append(asyncio.create_task(ks.bus.publish(event)))
            await asyncio.gather(*publishes)
            deadline = time.perf_counter() + 60
            while len(visible) < len(schedule) and time.perf_counter() < deadline:
                assert ks.recorder is not None
                ks.recorder.check()
                await asyncio.sleep(0.05)
            mapper.cancel()
        finally:
            await conn.close()
            await listener.close()
    lags = [visible[i] - due for i, due in scheduled.items() if i in visible]
    buckets: dict[int, list[float]] = {}
    for i, due in scheduled.items():
        if i in visible:
            buckets.setdefault(int((due - start) // 5), []).append(visible[i] - due)
    by_5s = {f"{5 * k}-{5 * k + 5}s": round(percentile(v, 0.99), 3) for k, v in sorted(buckets.items())}
    log(f"lag: p99 by 5 s of the period: {by_5s}")
    return {"load_avg_1m_after": os.getloadavg()[0], "p99_s_by_5s": by_5s,"events": len(schedule), "offered_eps": offered, "lost": len(schedule) - len(lags),
            "p50_s": percentile(lags, 0.50), "p99_s": percentile(lags, 0.99), "max_s": max(lags, default=float("nan")),
            "kinds": [dataclasses.asdict(k) for k in kinds], "nodes": nodes, "ranks_per_node": ranks_per_node,
            "max_event_bytes": max(sizes)}


# -- the run ------------------------------------------------------------------------------------------


def provenance(argv: list[str], module: str = "bench.control_plane") -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip())
    return {"commit": commit + ("-dirty" if dirty else ""), "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "cores": os.cpu_count(), "cpu_model": cpu_model(), "command": " ".join([f"python -m {module}", *argv])}


def cpu_model() -> str | None:
    """The CPU's ``model name`` from ``/proc/cpuinfo`` (None where there is none): timings mean little without it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = QUICK if args.quick else FULL
    only = set(args.only.split(","))
    results: dict[str, Any] = {"quick": args.quick}
    servers = Servers(modes=("sync_always",), log=log, prefix="keel-bench-cp-")
    work = scratch_dir("keel-bench-cp-work-")
    began = time.perf_counter()
    try:
        servers.start()
        log(f"servers up: NATS {servers.nats_url} (sync_interval: always), Postgres "
            f"{servers.database_url.split('@')[-1]}")
        if "steady" in only:
            steady = await measure_steady_events(servers, work / "steady", sizes.steady_settle_s, sizes.steady_measure_s)
            results["steady_events_per_node_s"] = steady["per_node_s"]
            results["steady"] = steady
            rates = ", ".join(f"{t} {r:.3f}" for t, r in steady["by_type_per_s"].items())
            log(f"steady: {steady['events']} events from {steady['nodes']} nodes over {steady['seconds']:.0f} s: "
                f"{steady['per_node_s']:.3f} per node per second (node-scoped {steady['node_events_per_node_s']:.3f})"
                f"  {verdict('steady_events_per_node_s', steady['per_node_s'])[1]}")
            log(f"steady: per second by type: {rates}; commits {steady['commits']}; "
                f"{steady['heartbeats_with_shards']}/{steady['heartbeats']} heartbeats carried shards; "
                f"{steady['incidents']} incident(s); {steady['steps']} steps")
        if "lag" in only:
            lag = await measure_recorder_lag(servers, work / "lag", sizes.lag_measure_s)
            results["recorder_lag_p99_s"] = lag["p99_s"]
            results["recorder_lag"] = lag
            log(f"lag: p50 {lag['p50_s']:.3f} s, p99 {lag['p99_s']:.3f} s, max {lag['max_s']:.3f} s over "
                f"{lag['events']:,} events ({lag['lost']} never recorded)  {verdict('recorder_lag_p99_s', lag['p99_s'])[1]}")
        if "cold" in only:
            from bench.cold_start import measure_cold_start

            cold = await measure_cold_start(servers, work, COLD_START_SIZES)
            results.update(cold)
            log(f"cold start: {', '.join(f'{int(k):,} events {v:.2f} s' for k, v in cold['cold_start_s'].items())}; "
                f"growth {cold['cold_start_growth']:.2f}")
    finally:
        servers.stop()
        shutil.rmtree(work, ignore_errors=True)
    results["elapsed_s"] = time.perf_counter() - began
    summary = {}
    for key, (op, target) in TARGETS.items():
        head, _, sub = key.partition(".")
        value = float(results.get(head, {}).get(sub, float("nan")) if sub else results.get(key, float("nan")))
        ok, _ = verdict(key, value)
        summary[key] = {"value": value, "target": target, "op": op, "pass": ok}
        log(f"  {'PASS' if ok else 'FAIL'}  {key} = {value:.3f} [target {op} {target:g}]")
    results["targets"] = summary
    results["all_pass"] = all(item["pass"] for item in summary.values())
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter measured periods; under five minutes")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--only", default="steady,lag,cold", help="comma-separated parts to run (default: all)")
    args = parser.parse_args(argv)
    results = {**provenance(argv), **asyncio.run(run(args))}
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

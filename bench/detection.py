"""How fast Keel notices a fault: injection → health event recorded, per fault kind, vs the peers.

    python -m bench.detection [--quick] [--json PATH] [--keep]

One run starts its own servers (keel.infra.embedded: NATS JetStream + PostgreSQL on free ports, scratch
dirs under /tmp; ``KEEL_NATS_URL`` / ``KEEL_DATABASE_URL`` use external ones instead), an in-process
recorder into a fresh schema, with its own subject prefix and streams, the checkpoint broker as a process
(restarted ranks restore from its plan), and a local cluster
(``keel.cluster.local.cluster_up``): 4 nodes × 2 ranks, each node a separate agent with its own overlay
root, running ``bench._workload`` = the example GPT (``keel.workload.train --size tiny --pp 2``) with
periodic eval phases and checkpoint phases (the wrapper adds the checkpoint: ``torch.save`` of the
stage, padded to a fixed duration, then a barrier inside the phase). Authentication is on
(``bench._servers``): the bench is the servers' admin and signs the restart commands it sends as the
controller would; the agents and the broker authenticate as their own roles.

Detection time = the detecting event's ``occurred_at`` (the agent's clock, when it noticed) minus the
``FaultInjected`` event's ``occurred_at``, **both read back from the event log** (``EventStore.read``).
The bench injects with ``keel.cluster.local.apply_fault`` and publishes ``FaultInjected`` itself, stamped
just *before* the fault is applied (``keel.cluster.local.inject`` stamps it after connecting to NATS,
which understates detection by the connection time: measured once per run as ``inject_stamp_lag_s``).

What counts as detected, per kind:

- ``crash`` / ``oom_kernel`` / ``oom_python``: the first ``RankExited`` of the injected rank on the
  injected node with a failure classification. ``oom_kernel``: the rank runs under a memory cgroup limit and
  the kernel's OOM killer SIGKILLs it; the agent must name it ``OOM killed`` (from ``/dev/kmsg``), else the
  trial is dropped with why. ``oom_python``: the SDK raises ``MemoryError`` itself (an exception, the path
  only injected errors take). A trial whose rank died of something else (a peer's crash reached it first)
  is dropped.
- ``hang`` / ``hang_stopped``: the rank stops inside its next collective (alive / SIGSTOPped) and its
  peers block in the real gloo collective; detected by the first ``NodeHealthChanged`` rank check that says
  hang (``collective_stuck``, ``process_stopped``, ``no_progress``, ``heartbeat_lost``) on any node; which
  check, node and rank are reported.
- ``gpu-lost`` / ``xid``: ``NodeHealthChanged`` gpu ``gpu_lost`` / ``xid`` failed for that GPU.
- ``nic-down``: ``NodeHealthChanged`` nic ``link_down`` (``degraded`` counts) for that interface.
- ``disk-full``: ``NodeHealthChanged`` disk ``disk_full`` failed.

How trials run (``--quick`` in brackets):

- Hardware faults do not stop the job: rounds of one fault of each kind, each on a different node,
  injected together; after detection the overlay file is restored and the signal must report
  ``healthy`` again before that node/GPU/NIC is reused. To make that take seconds, not 10 minutes,
  the agents run with ``recovery_hold`` and ``fatal_recovery_hold`` of 2 s (only recovery; detection
  thresholds are untouched).
- Workload faults: rounds of one ``crash`` and one ``oom`` on two nodes, injected together, then one ``hang``
  alone on a third (rank alternating); after each, every node's ranks are restarted in place as a new
  generation (``RanksRestartRequested`` to each agent: far cheaper than a new cluster). One crash per round,
  not one per node: four ranks tearing down at once on two cores would slow each other's exit. The hang is
  detected by an agent (a rank stuck in a collective, stopped or silent) or by the controller (every rank of
  the job inside a collective at once for 5 s), whichever comes first; the bench runs no controller, so the
  controller's call is made by its own fold and predicate on the recorded log (``ControllerHangView``).
- Workload faults fire at a step boundary (the SDK reads the fault file in ``step_done``): the bench
  injects right after rank 0 finished step ``s`` (≥ 3 steps from an eval or checkpoint) with
  ``params.at_step = s + 2`` for all faults of the round (so that they fire at the same boundary), and
  the peers get the same. This delivery delay (~1–2 step times) is *included* in ``detect_s``;
  ``detect_after_fire_s`` reports the part after the fault fired (the rank's last stderr write).
- The inspector runs at its defaults in both modes (the collective timeout max(5 s, 5 × p99 wait), the
  step timeout's 25 s floor).
- False hangs: every rank hang-check failure outside a workload-fault window (from injection until the
  restarted ranks step again), while the workload does what a hang detector must not mistake for a hang:
  evals and checkpoint saves (60 s in the full run, 8 s quick) where rank 0 takes twice as long as the
  others and they wait for it in a barrier inside the phase; a first step that compiles (90 s on rank 0,
  half on the others, who wait in the first collective; 12 s quick), in every generation; and 3 s
  data-loader stalls on one rank in turn. Before the workload rounds the bench watches steady training
  until at least one eval and one checkpoint phase have run (and, in the full run, for at least 4 minutes).

Peers, in the same run, after the Keel cluster is down, on the same workload and the same injected
faults (see ``bench/_peers.py`` and ``peer_run``; ``--quick``: one crash trial each): plain ``torchrun``
(gloo), whose hang detection is the job's collective timeout (10 min; waited for in the full run, derived
in the quick one and reported under ``peer_detect_s_derived``), and resiliency-ext's ``ft_launcher`` with
rank heartbeats and run-time calculated timeouts. ``peer_detect_s`` holds measured values only. Neither
has probes for the simulated GPU/NIC/disk faults: null, with why.

Targets: crash and oom ≤ 2 s, GPU/NIC (and disk) ≤ 5 s, hang ≤ 10 s at the p95 with zero false hangs.
Exits 0 even when a target is missed (printed as FAIL).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import _peers  # noqa: E402
from bench._servers import Servers, scratch_dir, start_services, stop_services  # noqa: E402

HARDWARE = ("gpu-lost", "xid", "nic-down", "disk-full")
HANG_KINDS = ("hang", "hang_stopped")
OOM_KINDS = ("oom_kernel", "oom_python")
WORKLOAD = ("crash", *OOM_KINDS, *HANG_KINDS)
KINDS = (*WORKLOAD, *HARDWARE)
FAULT_KIND = {"oom_python": "oom"}
"""The SDK fault each bench kind injects, where the names differ (``oom``: a Python MemoryError)."""
TARGET_S = {"crash": 2.0, "oom_kernel": 2.0, "oom_python": 2.0, "hang": 10.0, "hang_stopped": 10.0,
            "gpu-lost": 5.0, "xid": 5.0, "nic-down": 5.0, "disk-full": 5.0}
HANG_CHECKS = ("no_progress", "heartbeat_lost", "collective_stuck", "process_stopped")
"""A rank's health checks that say it hangs (the controller's ``HANG_CHECKS``)."""
NODES, NPROC = 4, 2
JOB_ID = "detect"
RECOVERY_HOLD = "2s"
PG_TIMEOUT_S = 600.0
"""The job's collective timeout: ``keel.workload.train --pg-timeout``'s default (10 min, NCCL's default too)."""
AT_STEP_AHEAD = 2
"""Workload faults take ``params.at_step = last step + 2``: every rank has read its fault file by then."""


@dataclass(frozen=True)
class Mode:
    name: str
    hw_rounds: int
    """Rounds of one fault of each hardware kind (one trial per kind per round)."""
    workload_rounds: int
    """Rounds of one crash + one oom + one hang, on three different nodes (one trial per kind per round)."""
    peer_trials: int
    peer_kinds: tuple[str, ...]
    """Workload faults the peers get. ft_launcher's hang is measured in every mode but the smoke one: its
    calculated timeouts are a few times the longest step, eval or save interval; torchrun's is the job's
    10-minute collective timeout, waited for only where ``hang`` is listed."""
    floor: str | None
    eval_every: int
    eval_steps: int
    ckpt_every: int
    ckpt_seconds: float
    eval_seconds: float
    first_step_s: float
    loader_stall_every: int
    loader_stall_s: float
    min_steady_s: float
    """Steady observation (no workload fault) before the workload rounds, for false hangs; the bench also
    waits for at least one eval and one checkpoint phase in it."""


QUICK = Mode("quick", hw_rounds=3, workload_rounds=4, peer_trials=1, peer_kinds=("crash",), floor=None,
             eval_every=20, eval_steps=50, ckpt_every=30, ckpt_seconds=8.0, eval_seconds=8.0, first_step_s=12.0,
             loader_stall_every=15, loader_stall_s=3.0, min_steady_s=0.0)
SMOKE = Mode("smoke", hw_rounds=1, workload_rounds=1, peer_trials=0, peer_kinds=(), floor=None, eval_every=20,
             eval_steps=20, ckpt_every=30, ckpt_seconds=2.0, eval_seconds=2.0, first_step_s=0.0, loader_stall_every=0,
             loader_stall_s=0.0, min_steady_s=0.0)
"""``--smoke``: one round of each, no peers - that the bench still runs end to end (``make test`` runs it)."""
FULL = Mode("full", hw_rounds=10, workload_rounds=12, peer_trials=3, peer_kinds=("crash", "oom_python", "hang"),
            floor=None, eval_every=150, eval_steps=200, ckpt_every=200, ckpt_seconds=60.0, eval_seconds=60.0,
            first_step_s=90.0, loader_stall_every=25, loader_stall_s=3.0, min_steady_s=240.0)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (as the inspector computes it)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


# -- servers and the log -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Recorded:
    event: Any


class ControllerHangView:
    """The controller's own hang call (``keel.controller.rules.all_blocked``: every rank of the job inside a
    collective at once for ``controller.all_blocked_hang_after``), made on the recorded log as the controller
    folds it. The bench runs no controller (its recoveries would end the trials' faults its own way), so this
    folds each recorded event with the controller's own ``evolve`` and asks the same predicate after every
    heartbeat, with the default floor. A call is dated by the heartbeat that decided it (its recorded time),
    so the figure leaves out only the controller's own processing (milliseconds; its NATS delivery is the same
    as the recorder's)."""

    def __init__(self) -> None:
        from keel.controller.decider import ControllerDecider
        from keel.controller.policy import ControllerPolicy

        self.policy = ControllerPolicy(observe_only=True)
        self.decider = ControllerDecider(self.policy)
        self.state = self.decider.initial_state()
        self.blocked = False

    def observe(self, event: Any) -> Any | None:
        """A synthetic ``AllRanksBlocked`` event when ``event`` makes the job blocked (once per episode)."""
        from types import SimpleNamespace

        from keel.controller.rules import all_blocked

        self.state = self.decider.evolve(self.state, event)
        if event.type != "NodeHeartbeat":
            return None
        job = self.state.jobs.get(event.job_id)
        found = all_blocked(job, self.policy.all_blocked_hang_after) if job is not None else None
        was, self.blocked = self.blocked, found is not None
        if found is None or was:
            return None
        return SimpleNamespace(type="AllRanksBlocked", occurred_at=event.occurred_at, job_id=event.job_id,
                               payload=SimpleNamespace(node_id=found[0], reason=found[1]))


class EventLog:
    """The bench's slice of the bus and store, a recorder, and a tail of the recorded events (with the
    controller's hang calls on them: ``ControllerHangView``)."""

    def __init__(self, servers: Servers) -> None:
        tag = uuid.uuid4().hex[:10]
        # The bench's own connection is the servers' admin (it publishes what an operator or the controller
        # would, signed as they sign); the agents and services authenticate as themselves (``env``).
        self.settings = servers.settings(
            db_schema=f"bd_{tag}",
            bus={"subject_prefix": f"kd{tag}", "stream": f"KD{tag}", "dlq_stream": f"KD{tag}_DLQ", "max_bytes": "256MiB"},
        )
        self.servers = servers
        self.events: list[Any] = []  # RecordedEvent, in position order
        self.controller = ControllerHangView()
        self._cursor = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def env(self) -> dict[str, str]:
        b = self.settings.bus
        return {"KEEL_BUS__SUBJECT_PREFIX": b.subject_prefix, "KEEL_BUS__STREAM": b.stream,
                "KEEL_BUS__DLQ_STREAM": b.dlq_stream, "KEEL_BUS__MAX_BYTES": "256MiB",
                "KEEL_DB_SCHEMA": self.settings.db_schema, **self.servers.service_env}

    async def start(self) -> None:
        from keel.infra.bus import Bus
        from keel.infra.store import EventStore, create_engine, run_migrations
        from keel.recorder.adapter import Recorder

        await asyncio.to_thread(run_migrations, self.servers.database_url, self.settings.db_schema)
        self.servers.authorize(self.settings.bus)  # the agents' and services' identities, on this prefix
        self.bus = await Bus.connect(self.servers.nats_url, self.settings.bus, name="keel-bench-detection",
                                     signing=self.servers.signing())
        self.engine = create_engine(self.servers.database_url, self.settings.db_schema)
        self.store = EventStore(self.engine)
        self.recorder = Recorder(self.bus, self.engine, self.settings.recorder)
        await self.recorder.start()
        self._tasks = [asyncio.create_task(self.recorder.run(self._stop)), asyncio.create_task(self._tail())]

    async def _tail(self) -> None:
        while not self._stop.is_set():
            try:
                async for recorded in self.store.read(after_position=self._cursor):
                    self.events.append(recorded)
                    self._cursor = recorded.position
                    call = self.controller.observe(recorded.event)
                    if call is not None:
                        self.events.append(_Recorded(call))
            except Exception as exc:  # noqa: BLE001 - a transient read error must not end the bench
                log(f"warning: reading the log: {exc!r}")
            try:
                await asyncio.wait_for(self._stop.wait(), 0.1)
            except TimeoutError:
                pass

    async def wait(self, predicate: Callable[[Any], bool], timeout_s: float, since: int = 0) -> Any | None:
        """The first recorded event (from index ``since``) for which ``predicate(event)`` holds."""
        deadline = time.monotonic() + timeout_s
        index = since
        while True:
            while index < len(self.events):
                event = self.events[index].event
                index += 1
                if predicate(event):
                    return event
            if time.monotonic() > deadline:
                return None
            for task in self._tasks:
                if task.done() and task.exception():
                    raise task.exception()  # type: ignore[misc]
            await asyncio.sleep(0.05)

    def of_type(self, name: str) -> list[Any]:
        return [r.event for r in self.events if r.event.type == name]

    async def publish(self, payload: Any, subject: str, occurred_at: datetime | None = None, producer: str = "cli") -> Any:
        from keel.events.envelope import Event, now_utc

        event = Event.create(payload, job_id=JOB_ID, subject=subject, producer=producer,
                             occurred_at=occurred_at or now_utc())
        await self.bus.publish(event)
        return event

    async def close(self, drop: bool) -> None:
        self._stop.set()
        for task in self._tasks:
            try:
                await asyncio.wait_for(task, 10)
            except Exception:  # noqa: BLE001 - teardown
                task.cancel()
        if drop:
            for stream in (self.settings.bus.stream, self.settings.bus.dlq_stream):
                try:
                    await self.bus.js.delete_stream(stream)
                except Exception:  # noqa: BLE001 - best-effort cleanup on a shared server
                    pass
        await self.bus.close()
        if drop:
            from sqlalchemy import text

            async with self.engine.begin() as conn:
                await conn.execute(text(f'DROP SCHEMA "{self.settings.db_schema}" CASCADE'))
        await self.engine.dispose()


# -- the Keel cluster ----------------------------------------------------------------------------

STEP_RE = re.compile(r"^step (\d+) .*step_time_s ([0-9.]+)")
PHASE_RE = re.compile(r"^(eval|checkpoint step \d+) took_s ([0-9.]+)")


def workload_args(mode: Mode) -> tuple[list[str], list[str]]:
    """(``bench._workload`` wrapper args, ``keel.workload.train`` args)."""
    wrapper = ["--ckpt-every", str(mode.ckpt_every), "--ckpt-seconds", str(mode.ckpt_seconds),
               "--eval-seconds", str(mode.eval_seconds), "--first-step-seconds", str(mode.first_step_s),
               "--loader-stall-every", str(mode.loader_stall_every), "--loader-stall-seconds", str(mode.loader_stall_s)]
    train = ["--size", "tiny", "--pp", "2", "--steps", "1000000", "--eval-every", str(mode.eval_every),
             "--eval-steps", str(mode.eval_steps)]
    return wrapper, train


class Cluster:
    def __init__(self, log_: EventLog, mode: Mode, directory: Path) -> None:
        self.log = log_
        self.mode = mode
        self.directory = directory
        self.generation = 0
        self.state: dict[str, Any] = {}
        self.nodes: dict[str, Any] = {}
        self.windows: list[tuple[datetime, datetime | None]] = []
        """Workload-fault windows: injection → the restarted ranks step again (hangs there are expected)."""
        self.services: dict[str, Any] = {}
        self.work = directory.parent  # cluster_up empties ``directory``

    def up(self) -> None:
        from keel.cluster.local import cluster_nodes, cluster_up

        wrapper, train = workload_args(self.mode)
        persist_root = self.work / "checkpoints"
        env = {**self.log.env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "KEEL_HOME": str(self.work / "home"), "KEEL_NATS_URL": self.log.servers.nats_url,
               "KEEL_DATABASE_URL": self.log.servers.database_url, "KEEL_CHECKPOINT__PERSIST_ROOT": str(persist_root),
               "KEEL_INSPECTOR__RECOVERY_HOLD": RECOVERY_HOLD, "KEEL_INSPECTOR__FATAL_RECOVERY_HOLD": RECOVERY_HOLD}
        if self.mode.floor:
            env["KEEL_INSPECTOR__STEP_TIMEOUT_FLOOR"] = self.mode.floor
        # The agents checkpoint every step (cluster_up gives each a slot folder): restarted ranks restore from
        # the checkpoint broker's plan, so it runs as in any deployment (the controller does not: the bench
        # restarts the ranks itself).
        self.services = start_services({"checkpoint-broker": []}, env, self.work)
        self.log.servers.issue_agents(JOB_ID, [f"n{i:02d}" for i in range(NODES)])
        self.state = cluster_up(self.log.settings, self.directory, nodes=NODES, standby=0, nproc_per_node=NPROC,
                                job_id=JOB_ID, command=["-m", "bench._workload", *wrapper, "--", *train],
                                nats_url=self.log.servers.nats_url, extra_env=env, persist_root=persist_root,
                                fault_injection=True)
        self.nodes = cluster_nodes(self.state)

    def down(self) -> None:
        from keel.cluster.local import cluster_down

        try:
            cluster_down(self.directory)
        finally:
            stop_services(self.services)

    # rank 0's stdout (node n00) tells the bench where training is
    def rank0_log(self, generation: int | None = None) -> Path:
        gen = self.generation if generation is None else generation
        return self.nodes["n00"].agent_dir / "logs" / f"rank0.g{gen}.stdout"

    def last_step(self) -> tuple[int, float] | None:
        path = self.rank0_log()
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 4096))
                lines = f.read().decode(errors="replace").splitlines()
            mtime = path.stat().st_mtime
        except OSError:
            return None
        # the last *complete* line must be a step line: rank 0 is between two steps, not in a phase
        complete = lines[:-1] if lines and not lines[-1] else lines
        for line in reversed(complete[-1:]):
            match = STEP_RE.match(line)
            if match:
                return int(match.group(1)), mtime
        return None

    async def steady_point(self, min_step: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            last = self.last_step()
            if last is not None:
                step, mtime = last
                if step >= min_step and time.time() - mtime < 0.3 and _peers._far_from_phase(
                        step, self.mode.eval_every, self.mode.ckpt_every):
                    return step
            await asyncio.sleep(0.02)
        raise TimeoutError(f"generation {self.generation}: no steady training step within {timeout_s:.0f}s "
                           f"(see {self.rank0_log()} and {self.directory}/nodes/*/agent.log)")

    async def inject(self, kind: str, node: str, rank: int | None = None, params: dict[str, Any] | None = None) -> tuple[str, Any]:
        """Apply the fault and publish ``FaultInjected`` stamped before it was applied."""
        from keel.cluster.local import FaultSpec, apply_fault
        from keel.events.envelope import now_utc
        from keel.events.types import FaultInjected

        spec = FaultSpec(kind=kind, node=node, rank=rank, params=params or {})
        fault_id = str(uuid.uuid4())
        at = now_utc()
        detail = apply_fault(self.nodes[node], spec, fault_id)
        return fault_id, (FaultInjected(kind=kind, node_id=node, rank=rank,  # type: ignore[arg-type]
                                        params={**spec.params, "detail": detail, "fault_id": fault_id},
                                        injected_by="bench.detection"), at, node)

    async def publish_injections(self, injections: list[tuple[str, Any]]) -> None:
        for fault_id, (payload, at, node) in injections:
            from keel.events.envelope import Event

            event = Event.create(payload, event_id=uuid.UUID(fault_id), job_id=JOB_ID, subject=f"node/{node}",
                                 producer="cli", occurred_at=at)
            await self.log.bus.publish(event)

    async def injected_at(self, fault_id: str, timeout_s: float = 30.0) -> datetime:
        event = await self.log.wait(lambda e: e.type == "FaultInjected" and str(e.id) == fault_id, timeout_s)
        if event is None:
            raise RuntimeError(f"FaultInjected {fault_id} was not recorded within {timeout_s:.0f}s")
        return event.occurred_at

    async def restart(self, reason: str, timeout_s: float = 180.0) -> float:
        """Restart every node's ranks in place as the next generation; wait until they step again."""
        from keel.events.envelope import now_utc
        from keel.events.types import RanksRestartRequested

        t0 = time.monotonic()
        since = len(self.log.events)
        generation = self.generation + 1
        for node in self.nodes:
            await self.log.publish(RanksRestartRequested(node_id=node, generation=generation, reason=reason,
                                                         expires_at=now_utc() + timedelta(minutes=5)),
                                   subject=f"node/{node}", producer="bench")
        done: dict[str, str] = {}
        deadline = time.monotonic() + 60

        def restarted(e: Any) -> bool:
            return e.type == "RanksRestarted" and e.payload.generation == generation

        while len(done) < len(self.nodes) and time.monotonic() < deadline:
            event = await self.log.wait(lambda e: restarted(e) and e.payload.node_id not in done, 5, since)
            if event is not None:
                done[event.payload.node_id] = event.payload.outcome
        if len(done) < len(self.nodes) or any(o != "restarted" for o in done.values()):
            raise RuntimeError(f"restart to generation {generation}: {done} (expected every node 'restarted')")
        self.generation = generation
        # The ranks resume from their checkpoint, not from step 0: count five steps of this generation (the
        # inspector arms its step timeout only once it knows a few step times of the generation).
        first = await self.first_step(timeout_s)
        await self.steady_point(min_step=first + 5, timeout_s=timeout_s)
        return time.monotonic() - t0

    async def first_step(self, timeout_s: float) -> int:
        """The first step rank 0 of this generation completed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with open(self.rank0_log(), "rb") as f:
                    for line in f.read(1 << 20).decode(errors="replace").splitlines():
                        match = STEP_RE.match(line)
                        if match:
                            return int(match.group(1))
            except OSError:
                pass
            await asyncio.sleep(0.05)
        raise TimeoutError(f"generation {self.generation}: no training step within {timeout_s:.0f}s "
                           f"(see {self.rank0_log()} and {self.directory}/nodes/*/agent.log)")

    def fired_at(self, rank: int) -> float | None:
        """When the injected fault fired in ``rank`` (this generation): its stderr's last write (the
        ``keel injected …`` line, then the traceback of a crash or an oom; a hung rank writes no more)."""
        node = self.nodes[f"n{rank // NPROC:02d}"]
        try:
            return (node.agent_dir / "logs" / f"rank{rank}.g{self.generation}.stderr").stat().st_mtime
        except OSError:
            return None

    async def wait_phases(self, since_monotonic: float, min_s: float, timeout_s: float = 300.0) -> None:
        """Until ``min_s`` have passed and rank 0 finished at least one eval and one checkpoint phase."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.rank0_log().read_text(errors="replace")
            phases = [m.group(1) for m in map(PHASE_RE.match, text.splitlines()) if m]
            if (time.monotonic() - since_monotonic >= min_s and "eval" in phases
                    and any(p.startswith("checkpoint") for p in phases)):
                return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"no eval and checkpoint phase within {timeout_s:.0f}s: see {self.rank0_log()}")

    def training_stats(self) -> dict[str, Any]:
        """Step times (rank 0, every generation, the first 2 steps of each excluded: they compile and restore)
        and eval/checkpoint phases."""
        step_times: list[float] = []
        evals: list[float] = []
        ckpts: list[float] = []
        for path in sorted((self.nodes["n00"].agent_dir / "logs").glob("rank0.g*.stdout")):
            seen = 0
            for line in path.read_text(errors="replace").splitlines():
                match = STEP_RE.match(line)
                if match:
                    seen += 1
                    if seen > 2:
                        step_times.append(float(match.group(2)))
                    continue
                match = PHASE_RE.match(line)
                if match:
                    (evals if match.group(1) == "eval" else ckpts).append(float(match.group(2)))
        return {"step_times": step_times, "evals": evals, "ckpts": ckpts}


# -- trials --------------------------------------------------------------------------------------


def detector(kind: str, node: str, rank: int | None, key: str | None) -> Callable[[Any], bool]:
    def health(component: str, check: str, statuses: tuple[str, ...]) -> Callable[[Any], bool]:
        return lambda e: (e.type == "NodeHealthChanged" and e.payload.node_id == node and e.payload.component == component
                          and e.payload.check == check and e.payload.status in statuses
                          and (key is None or e.payload.evidence.get("key") == key))

    if kind in ("crash", *OOM_KINDS):
        return lambda e: (e.type == "RankExited" and e.payload.node_id == node and e.payload.rank == rank
                          and e.payload.classification not in ("success", "stopped_by_agent"))
    if kind in HANG_KINDS:  # an agent's rank check, or the controller seeing every rank blocked at once
        return lambda e: ((e.type == "NodeHealthChanged" and e.payload.component == "rank"
                           and e.payload.status == "failed" and e.payload.check in HANG_CHECKS)
                          or e.type == "AllRanksBlocked")
    return {
        "gpu-lost": health("gpu", "gpu_lost", ("failed",)),
        "xid": health("gpu", "xid", ("failed",)),
        "nic-down": health("nic", "link_down", ("degraded", "failed")),
        "disk-full": health("disk", "disk_full", ("failed",)),
    }[kind]


def recovered(kind: str, node: str, key: str) -> Callable[[Any], bool]:
    component, check = {"gpu-lost": ("gpu", "gpu_lost"), "xid": ("gpu", "xid"), "nic-down": ("nic", "link_down"),
                        "disk-full": ("disk", "disk_full")}[kind]
    return lambda e: (e.type == "NodeHealthChanged" and e.payload.node_id == node and e.payload.component == component
                      and e.payload.check == check and e.payload.status == "healthy"
                      and e.payload.evidence.get("key") == key)


def restore_overlay(node: Any, kind: str, target: str) -> None:
    """Undo a hardware fault in the node's overlay files (the repaired hardware)."""
    root = node.root
    if kind == "gpu-lost":
        path = root / "run/keel/nvml.json"
        snapshot = json.loads(path.read_text())
        for device in snapshot["devices"]:
            if f"gpu{device['index']}" == target:
                device["lost"], device["error"] = False, None
        tmp = path.with_name(f".{path.name}.bench.tmp")
        tmp.write_text(json.dumps(snapshot, indent=1))
        os.replace(tmp, path)
    elif kind == "nic-down":
        nic = root / "sys/class/net" / target
        changes = int((nic / "carrier_changes").read_text().strip() or 0)
        (nic / "operstate").write_text("up\n")
        (nic / "carrier").write_text("1\n")
        (nic / "carrier_changes").write_text(f"{changes + 1}\n")
    elif kind == "disk-full":
        (root / "run/keel/disk.json").unlink(missing_ok=True)
    # xid: an XID is an event; nothing to undo (the next sample shows no new XID)


@dataclass
class Trial:
    kind: str
    node: str
    rank: int | None
    detect_s: float | None
    detail: dict[str, Any] = field(default_factory=dict)


async def hardware_trials(cluster: Cluster, trials: int, results: list[Trial]) -> None:
    """Rounds of one fault of each hardware kind, each on a different node, injected together."""
    nodes = sorted(cluster.nodes)
    pending_recovery: dict[tuple[str, str, str], tuple[Callable[[Any], bool], int]] = {}
    rounds = trials
    for r in range(rounds):
        batch = []
        for k, kind in enumerate(HARDWARE):
            node = nodes[(r + k) % len(nodes)]
            gpu = (r // len(nodes)) % NPROC
            if kind in ("gpu-lost", "xid"):
                key, params = f"gpu{gpu}", {"gpu": gpu}
            elif kind == "nic-down":
                key, params = "eth0", {}
            else:
                key, params = "/", {}
            signal_id = (kind, node, key)
            if signal_id in pending_recovery:  # reuse only once it reported healthy again
                predicate, restored_at = pending_recovery.pop(signal_id)
                event = await cluster.log.wait(predicate, 30, restored_at)
                if event is None:
                    raise RuntimeError(f"{kind} {key} on {node} did not recover within 30 s; cannot reuse it")
            batch.append((kind, node, key, params))
        since = len(cluster.log.events)
        injections = [await cluster.inject(kind, node, params=params) for kind, node, _, params in batch]
        await cluster.publish_injections(injections)
        for (kind, node, key, _), (fault_id, _) in zip(batch, injections):
            start = await cluster.injected_at(fault_id)
            event = await cluster.log.wait(detector(kind, node, None, key), 60, since)
            if event is None:
                results.append(Trial(kind, node, None, None, {"error": "not detected within 60 s"}))
            else:
                results.append(Trial(kind, node, None, (event.occurred_at - start).total_seconds(),
                                     {"status": event.payload.status, "detail": event.payload.detail[:160]}))
            restored_at = len(cluster.log.events)
            restore_overlay(cluster.nodes[node], kind, key)
            pending_recovery[(kind, node, key)] = (recovered(kind, node, key), restored_at)
        log(f"  hardware round {r + 1}/{rounds}: " + ", ".join(
            f"{t.kind}@{t.node} {t.detect_s:.2f}s" if t.detect_s is not None else f"{t.kind}@{t.node} MISSED"
            for t in results[-len(batch):]))


async def workload_round(cluster: Cluster, round_no: int, last: bool, results: list[Trial],
                         oom_kernel_works: bool) -> None:
    """One crash and one oom, on two different nodes, injected together; a restart; then one hang, alone, on a
    third node; then a restart. The variants alternate by round: ``hang`` (the rank stops inside its next
    collective, alive) and ``hang_stopped`` (SIGSTOPped there); ``oom_kernel`` (the kernel OOM killer, under a
    cgroup limit) and ``oom_python`` (a MemoryError the SDK raises).

    A crash or an oom only surfaces when the rank's interpreter has exited. The hang is seen by whichever comes
    first: an agent finding a rank stuck in a collective (the peers block in the real one), stopped, or silent;
    or the controller finding every rank of the job inside a collective at once (``ControllerHangView``). The
    hang goes alone, as a hang happens: beside a crash, the crashed rank's peers would be blocked by the crash
    (which the controller handles as a crash first), not by the hang."""
    nodes = sorted(cluster.nodes)
    hang_kind = HANG_KINDS[round_no % 2]
    oom_kind = OOM_KINDS[round_no % 2] if oom_kernel_works else "oom_python"
    plans = []
    for offset, kinds in ((0, ("crash", oom_kind)), (2, (hang_kind,))):
        plan = []
        for extra, kind in enumerate(kinds):
            index = (round_no + offset + extra) % len(nodes)
            plan.append((kind, nodes[index], index * NPROC + (round_no // len(nodes) + offset + extra) % NPROC))
        plans.append(plan)
    for part, plan in enumerate(plans):
        await _inject_and_measure(cluster, plan, f"{round_no + 1}{'ab'[part]}", results)
        if last and part == len(plans) - 1:
            return
        restart_s = await cluster.restart(f"bench: after workload round {round_no + 1}{'ab'[part]}")
        cluster.windows[-1] = (cluster.windows[-1][0], _now())
        log(f"  restarted as generation {cluster.generation} in {restart_s:.1f}s")


async def _inject_and_measure(cluster: Cluster, plan: list[tuple[str, str, int]], label: str,
                              results: list[Trial]) -> None:
    """Inject ``plan`` (kind, node, rank) at one step boundary and measure when each fault is detected."""
    step = await cluster.steady_point(min_step=8, timeout_s=180)
    since = len(cluster.log.events)
    # The same step for all: without at_step, ranks a few ms apart read their fault files on either side of a
    # step boundary, and the first fault to fire kills the others' ranks before theirs does.
    params = {"at_step": step + AT_STEP_AHEAD}
    injections = [await cluster.inject(FAULT_KIND.get(kind, kind), node, rank=rank, params=params) for kind, node, rank in plan]
    await cluster.publish_injections(injections)
    cluster.windows.append((min(at for _, (_, at, _) in injections), None))
    line = []
    for (kind, node, rank), (fault_id, _) in zip(plan, injections):
        start = await cluster.injected_at(fault_id)
        timeout_s = 60.0 if kind not in HANG_KINDS else 180.0
        event = await cluster.log.wait(detector(kind, node, rank, None), timeout_s, since)
        if event is None:
            results.append(Trial(kind, node, rank, None, {"error": f"not detected within {timeout_s:.0f} s"}))
            line.append(f"{kind} {node}/r{rank} MISSED")
            continue
        p = event.payload
        fired = cluster.fired_at(rank)
        timing = {} if fired is None else {"fault_fired_after_s": round(fired - start.timestamp(), 3),
                                           "detect_after_fire_s": round(event.occurred_at.timestamp() - fired, 3)}
        if kind in HANG_KINDS and event.type == "AllRanksBlocked":
            results.append(Trial(kind, node, rank, (event.occurred_at - start).total_seconds(),
                                 {"detected_on": p.node_id, "check": "all_ranks_blocked (controller)",
                                  "detail": p.reason[:300], **timing}))
            line.append(f"{kind} {node}/r{rank} {results[-1].detect_s:.2f}s (every rank blocked, controller)")
            continue
        if kind in HANG_KINDS:
            ev = p.evidence
            results.append(Trial(kind, node, rank, (event.occurred_at - start).total_seconds(),
                                 {"detected_on": p.node_id, "detected_rank": ev.get("rank"), "check": p.check,
                                  "collective": ev.get("collective"), "phase": ev.get("phase"),
                                  "timeout_s": ev.get("timeout_s"), "timeout_basis": ev.get("timeout_basis"),
                                  "injected_rank_detected": ev.get("rank") == rank, **timing}))
            line.append(f"{kind} {node}/r{rank} {results[-1].detect_s:.2f}s ({p.check} on {p.node_id}/r{ev.get('rank')}, "
                        f"timeout {ev.get('timeout_s')}s)")
            continue
        marker = "keel injected crash" if kind == "crash" else "keel injected oom"
        detail = {"classification": p.classification, "error_type": p.error_type, "exit_code": p.exit_code,
                  "signal": p.signal, **timing}
        if kind == "oom_kernel" and p.error_type != "OOM killed":
            # not the kernel's kill (the cgroup could not be made, or the agent could not read the kernel log)
            results.append(Trial(kind, node, rank, None, {**detail, "dropped": f"not an OOM kill: {p.reason[:200]}"}))
            line.append(f"{kind} {node}/r{rank} dropped ({p.error_type or p.classification})")
            continue
        if marker not in p.stderr_tail and not (kind in OOM_KINDS and "keel injected oom" in p.stderr_tail.replace("\n", " ")):
            # the rank died of another cause (a peer's fault reached it first): not this injection's measurement
            results.append(Trial(kind, node, rank, None, {**detail, "dropped": "rank died of another cause first"}))
            line.append(f"{kind} {node}/r{rank} dropped")
            continue
        results.append(Trial(kind, node, rank, (event.occurred_at - start).total_seconds(), detail))
        line.append(f"{kind} {node}/r{rank} {results[-1].detect_s:.2f}s ({p.classification}/{p.error_type or '-'})")
    log(f"  round {label}: " + ", ".join(line))


def _now() -> datetime:
    from keel.events.envelope import now_utc

    return now_utc()


async def inject_stamp_lag(cluster: Cluster) -> float | None:
    """How late ``keel.cluster.local.inject`` stamps ``FaultInjected`` (it connects to NATS first).

    Injects XID 13 (an application error: ignored by the inspector, changes nothing) through it."""
    from keel.cluster.local import FaultSpec, inject

    since = len(cluster.log.events)
    before = _now()
    await asyncio.to_thread(inject, cluster.log.settings, cluster.directory,
                            [FaultSpec(kind="xid", node="n00", params={"gpu": 0, "xid": 13})], cluster.log.servers.nats_url)
    event = await cluster.log.wait(lambda e: e.type == "FaultInjected" and e.payload.params.get("xid") == 13, 30, since)
    return None if event is None else (event.occurred_at - before).total_seconds()


# -- the run -------------------------------------------------------------------------------------


async def keel_run(mode: Mode, servers: Servers, keep: bool) -> dict[str, Any]:
    event_log = EventLog(servers)
    await event_log.start()
    work = scratch_dir("keel-bench-detect-cluster-")
    cluster = Cluster(event_log, mode, work / "cluster")
    trials: list[Trial] = []
    out: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        await asyncio.to_thread(cluster.up)
        await cluster.steady_point(min_step=5, timeout_s=240)
        out["cluster_up_s"] = round(time.monotonic() - t0, 1)
        log(f"cluster up: {NODES} nodes x {NPROC} ranks training in {out['cluster_up_s']}s "
            f"(step timeout floor {mode.floor or 'default 25s'})")
        steady_since = time.monotonic()
        out["inject_stamp_lag_s"] = await inject_stamp_lag(cluster)
        log(f"keel.cluster.local.inject stamps FaultInjected {out['inject_stamp_lag_s']}s after it was called")
        log(f"hardware faults ({mode.hw_rounds} rounds: one of each kind per round, each on another node)")
        await hardware_trials(cluster, mode.hw_rounds, trials)
        await cluster.wait_phases(steady_since, mode.min_steady_s)
        out["steady_observed_s"] = round(time.monotonic() - steady_since, 1)
        log(f"steady training observed for {out['steady_observed_s']}s (eval and checkpoint phases included)")
        out["oom_kernel_works"], out["oom_kernel_note"] = oom_kernel_possible()
        log(f"kernel OOM kills: {out['oom_kernel_note']}")
        log(f"workload faults ({mode.workload_rounds} rounds: a crash and an oom together, then a hang alone, on three nodes)")
        for r in range(mode.workload_rounds):
            await workload_round(cluster, r, r == mode.workload_rounds - 1, trials, out["oom_kernel_works"])
        await asyncio.sleep(1.5)  # let the last reports arrive
        stats = cluster.training_stats()
        out["training"] = stats
        out["false_hangs"] = false_hangs(event_log, cluster.windows)
    finally:
        await asyncio.to_thread(cluster.down)
        await event_log.close(drop=not keep)
        if keep:
            log(f"kept cluster files under {work} and schema {event_log.settings.db_schema}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    out["trials"] = trials
    return out


def oom_kernel_possible() -> tuple[bool, str]:
    """Whether a rank can be put under a memory cgroup limit here (what the ``oom_kernel`` fault does) and
    the kernel log read (how the agent names the kill); the reason either way."""
    from keel.protocol.processes import memory_cgroup_path

    probe = memory_cgroup_path(f"keel-bench-probe-{os.getpid()}")
    try:
        os.makedirs(probe)
        os.rmdir(probe)
    except OSError as exc:
        return False, f"cannot make a memory cgroup ({exc}): the oom rows use the Python MemoryError only"
    try:
        with open("/dev/kmsg", "rb"):
            pass
    except OSError as exc:
        return False, f"cannot read /dev/kmsg ({exc}): the oom rows use the Python MemoryError only"
    return True, f"memory cgroups under {os.path.dirname(probe)} and /dev/kmsg readable"


def false_hangs(event_log: EventLog, windows: list[tuple[datetime, datetime | None]]) -> list[dict[str, Any]]:
    found = []
    for event in event_log.of_type("NodeHealthChanged"):
        p = event.payload
        if p.component != "rank" or p.status != "failed" or p.check not in HANG_CHECKS:
            continue
        at = event.occurred_at
        if any(start <= at and (end is None or at <= end) for start, end in windows):
            continue
        found.append({"node": p.node_id, "check": p.check, "phase": p.evidence.get("phase"),
                      "collective": p.evidence.get("collective"),
                      "at": at.isoformat(), "detail": p.detail[:200]})
    for event in event_log.of_type("AllRanksBlocked"):
        at = event.occurred_at
        if not any(start <= at and (end is None or at <= end) for start, end in windows):
            found.append({"node": event.payload.node_id, "check": "all_ranks_blocked", "at": at.isoformat(),
                          "detail": event.payload.reason[:200]})
    return found


def peer_run(mode: Mode, work: Path) -> dict[str, Any]:
    """The peers on the same workload and faults, each as its documentation tells a careful user to run it.

    - ``torchrun``: no hang detection of its own; a rank blocked in gloo fails when the job's collective
      timeout (``--pg-timeout``, 10 min: NCCL's default too) runs out, and torchrun notices that exit. The
      full run waits for it (one trial); the quick run derives it: the timeout plus the measured crash
      detection (what follows the timeout's exception), under ``peer_detect_s_derived``.
    - ``ft_launcher``: rank heartbeats after every step, with the timeouts calculated at run time from the
      observed intervals (``--ft-calc-timeouts``), as resiliency-ext's heartbeat example does; measured.
    - DLRover's hang detection needs its job master (a Kubernetes or Ray job); it does not run here.
    """
    wrapper, train = workload_args(mode)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for name in [n for n in env if n.startswith("KEEL_")]:  # no agent, no Keel servers: a plain run
        env.pop(name)
    pg_timeout = PG_TIMEOUT_S
    peers: dict[str, Any] = {}
    for name in ("torchrun", "ft_launcher"):
        result: dict[str, Any] = {"detect_s": {}, "derived_s": {}, "trials": {}, "notes": {}}
        peers[name] = result
        if name == "ft_launcher":
            ok, info = _peers.ft_available()
            if not ok:
                result["unavailable"] = f"nvidia-resiliency-ext cannot be imported: {info}"
                log(f"{name}: unavailable ({info})")
                result["detect_s"] = {k: None for k in KINDS}
                continue
            result["version"] = info
            result["defaults"] = _peers.ft_default_timeouts()
        extra = ["--ft-heartbeats", "--ft-calc-timeouts"] if name == "ft_launcher" else []
        argv = _peers.launcher_argv(name, train, [*wrapper, *extra])
        for kind in ("crash", "oom_python", "hang"):
            if kind not in mode.peer_kinds and not (name == "ft_launcher" and kind == "hang" and mode.peer_trials):
                result["detect_s"][kind] = None
                result["notes"][kind] = f"not run in the {mode.name} run"
                continue
            runs = []
            for i in range(mode.peer_trials if kind != "hang" else 1):
                rank = (2 * i + 1) % 8
                log(f"{name}: {kind} trial {i + 1} (rank {rank})")
                detect_timeout_s = pg_timeout + 180 if kind == "hang" else 60.0
                # ft_launcher calculates its timeouts at the first checkpoint after an eval: inject after it.
                first_calc = (mode.eval_every // mode.ckpt_every + 1) * mode.ckpt_every if mode.ckpt_every else 0
                min_step = first_calc + 5 if name == "ft_launcher" and kind == "hang" else 5
                try:
                    measured = _peers.measure_crash(name, argv, env, work, FAULT_KIND.get(kind, kind), rank,
                                                     mode.eval_every, mode.ckpt_every, AT_STEP_AHEAD,
                                                     start_timeout_s=150.0 + 2 * mode.first_step_s + 0.5 * min_step,
                                                     detect_timeout_s=detect_timeout_s, min_step=min_step)
                except Exception as exc:  # noqa: BLE001 - a peer failing to run is a result, not a crash
                    measured = {"detect_s": None, "error": f"{type(exc).__name__}: {exc}"}
                log(f"  {measured}")
                runs.append(measured)
            result["trials"][kind] = runs
            values = [r["detect_s"] for r in runs if r.get("detect_s") is not None]
            result["detect_s"][kind] = round(statistics.median(values), 3) if values else None
        if name == "torchrun":
            result["collective_timeout_s"] = pg_timeout
            result["gloo_default_timeout_s"] = _peers.gloo_default_timeout_s()
            if result["detect_s"].get("hang") is None and "hang" not in mode.peer_kinds:
                crash = result["detect_s"].get("crash")
                result["derived_s"]["hang"] = None if crash is None else round(pg_timeout + crash, 3)
                result["notes"]["hang"] = (f"derived, not waited for in the {mode.name} run: the job's collective timeout "
                                           f"({pg_timeout:.0f}s, keel.workload.train --pg-timeout) plus the measured crash "
                                           f"detection ({crash}s); the full run measures it")
            for kind in HARDWARE:
                result["detect_s"][kind] = None
                result["notes"][kind] = "not detected: torchrun has no health probes (a GPU/NIC/disk fault that does not kill a rank goes unnoticed)"
        else:
            for kind in HARDWARE:
                result["detect_s"][kind] = None
                result["notes"][kind] = ("not comparable: ft_launcher's node health checks read the real NVML / InfiniBand "
                                         "sysfs (disabled on this CPU machine: no NVML), not the simulated overlay files")
    peers["dlrover"] = {"unavailable": "DLRover's hang detection runs in its job master (dlrover-run under a Kubernetes "
                                       "or Ray ElasticJob); there is none here", "detect_s": {}, "derived_s": {}}
    return peers


def summarise(mode: Mode, keel: dict[str, Any], peers: dict[str, Any], wall_s: float) -> dict[str, Any]:
    trials: list[Trial] = keel["trials"]
    stats = keel["training"]
    p99 = pct(stats["step_times"], 99) or 0.0
    floor_s = float(mode.floor.rstrip("s")) if mode.floor else 25.0
    hang_timeouts = sorted({t.detail["timeout_s"] for t in trials if t.kind in HANG_KINDS and t.detail.get("timeout_s")})
    hang_detected_by: dict[str, int] = {}
    for t in trials:
        if t.kind in HANG_KINDS and t.detect_s is not None:
            check = str(t.detail.get("check"))
            hang_detected_by[check] = hang_detected_by.get(check, 0) + 1
    detect, p95, n, dropped, missed = {}, {}, {}, {}, {}
    for kind in KINDS:
        values = [t.detect_s for t in trials if t.kind == kind and t.detect_s is not None]
        detect[kind] = round(statistics.median(values), 3) if values else None
        p95[kind] = round(pct(values, 95), 3) if values else None  # type: ignore[arg-type]
        n[kind] = len(values)
        dropped[kind] = sum(1 for t in trials if t.kind == kind and "dropped" in t.detail)
        missed[kind] = sum(1 for t in trials if t.kind == kind and t.detect_s is None and "dropped" not in t.detail)
    after_fire = {}
    for kind in WORKLOAD:
        values = [t.detail["detect_after_fire_s"] for t in trials
                  if t.kind == kind and t.detect_s is not None and "detect_after_fire_s" in t.detail]
        after_fire[kind] = round(statistics.median(values), 3) if values else None
    targets = dict(TARGET_S)
    verdict = {}
    for kind in KINDS:
        ok = p95[kind] is not None and p95[kind] <= targets[kind] and missed[kind] == 0
        if kind in HANG_KINDS:
            ok = ok and not keel["false_hangs"]
        verdict[kind] = "PASS" if ok else ("n/a" if kind == "oom_kernel" and not keel.get("oom_kernel_works") else "FAIL")
    return {
        "mode": mode.name,
        "detect_s": detect,
        "detect_p95_s": p95,
        "false_hangs": len(keel["false_hangs"]),
        "peer_detect_s": {name: {k: v for k, v in peer["detect_s"].items() if v is not None}
                          for name, peer in peers.items()},
        "peer_detect_s_derived": {name: peer.get("derived_s", {}) for name, peer in peers.items()},
        "hang_timeouts_s": hang_timeouts,
        "hang_detected_by": hang_detected_by,
        "oom_kernel_works": keel.get("oom_kernel_works"),
        "oom_kernel_note": keel.get("oom_kernel_note"),
        "detect_after_fire_s": after_fire,
        "at_step_ahead": AT_STEP_AHEAD,
        "targets_s": targets,
        "verdict": verdict,
        "trials": n,
        "trials_dropped": dropped,
        "trials_missed": missed,
        "step_timeout_floor_s": floor_s,
        "step_time_p99_s": round(p99, 4),
        "steps_observed": len(stats["step_times"]),
        "eval_phases_s": [round(x, 2) for x in stats["evals"]],
        "checkpoint_phases_s": [round(x, 2) for x in stats["ckpts"]],
        "phases_longer_than_floor": {"eval": sum(1 for x in stats["evals"] if x > floor_s),
                                     "checkpoint": sum(1 for x in stats["ckpts"] if x > floor_s)},
        "false_hang_events": keel["false_hangs"],
        "inject_stamp_lag_s": keel.get("inject_stamp_lag_s"),
        "cluster_up_s": keel.get("cluster_up_s"),
        "steady_observed_s": keel.get("steady_observed_s"),
        "topology": {"keel": f"{NODES} nodes x {NPROC} ranks (local cluster, one agent per node)",
                     "peers": "one launcher, --standalone --nnodes 1 --nproc-per-node 8"},
        "recovery_hold": RECOVERY_HOLD,
        "first_step_s": mode.first_step_s,
        "loader_stall_s": mode.loader_stall_s,
        "loader_stall_every": mode.loader_stall_every,
        "peers": {name: {k: v for k, v in peer.items() if k not in ("detect_s", "derived_s")} for name, peer in peers.items()},
        "trial_details": [{"kind": t.kind, "node": t.node, "rank": t.rank, "detect_s": None if t.detect_s is None
                           else round(t.detect_s, 3), **t.detail} for t in trials],
        "wall_s": round(wall_s, 1),
    }


def fmt(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}s" if value < 100 else f"{value:.0f}s"


def print_table(result: dict[str, Any]) -> None:
    peers, derived = result["peer_detect_s"], result["peer_detect_s_derived"]
    print()
    print(f"detection latency, injection → health event recorded ({result['mode']} run, {NODES} nodes x {NPROC} ranks; "
          f"default inspector settings; hang timeouts used {result['hang_timeouts_s']}; p99 step {result['step_time_p99_s']:.3f}s)")
    header = (f"{'kind':<12} {'n':>3} {'keel median':>12} {'keel p95':>10} {'target':>9} {'(p95)':>5}  {'torchrun':>10} "
              f"{'ft_launcher':>11}")
    print(header)
    print("-" * len(header))

    def peer(name: str, kind: str) -> str:
        if kind in peers.get(name, {}):
            return fmt(peers[name][kind])
        value = derived.get(name, {}).get(kind)
        return "—" if value is None else f"{fmt(value)}*"

    for kind in KINDS:
        print(f"{kind:<12} {result['trials'][kind]:>3} {fmt(result['detect_s'][kind]):>12} {fmt(result['detect_p95_s'][kind]):>10} "
              f"{'≤ ' + fmt(result['targets_s'][kind]):>9} {result['verdict'][kind]:>5}  {peer('torchrun', kind):>10} "
              f"{peer('ft_launcher', kind):>11}")
    print("* derived, not measured (see the note below)")
    print(f"kernel OOM kills: {result['oom_kernel_note']}")
    fire = result["detect_after_fire_s"]
    print(f"workload faults fire at step last+{result['at_step_ahead']} (included above); median from the fault firing "
          f"(rank's last stderr write) to the event: " + ", ".join(f"{k} {fmt(v)}" for k, v in fire.items()))
    print(f"false hangs: {result['false_hangs']} (eval phases {len(result['eval_phases_s'])}, "
          f"{result['phases_longer_than_floor']['eval']} longer than the step timeout floor; checkpoint phases "
          f"{len(result['checkpoint_phases_s'])}, {result['phases_longer_than_floor']['checkpoint']} longer; a first step "
          f"of {result['first_step_s']:g}s per generation; {result['loader_stall_s']:g}s loader stalls every "
          f"{result['loader_stall_every']} steps)")
    for name, peer in result["peers"].items():
        if "unavailable" in peer:
            print(f"{name}: unavailable: {peer['unavailable']}")
            continue
        grouped: dict[str, list[str]] = {}
        for kind, note in peer.get("notes", {}).items():
            grouped.setdefault(note, []).append(kind)
        for note, kinds in grouped.items():
            print(f"{name} {'/'.join(kinds)}: {note}")
    for kind in KINDS:
        if result["trials_dropped"][kind] or result["trials_missed"][kind]:
            print(f"{kind}: {result['trials_dropped'][kind]} trial(s) dropped, {result['trials_missed'][kind]} missed")
    print(f"keel.cluster.local.inject stamps FaultInjected {fmt(result['inject_stamp_lag_s'])} after being called "
          f"(the bench stamps before applying the fault)")
    print(f"wall time {result['wall_s']:.0f}s")


def peers_only(mode: Mode, args: argparse.Namespace, argv: list[str]) -> int:
    """``--peers-only``: the peers' trials of ``mode`` alone, written with the run's provenance."""
    started = time.monotonic()
    log(f"detection benchmark ({mode.name}), peers only: {', '.join(mode.peer_kinds)}")
    work = scratch_dir("keel-bench-detect-peers-")
    try:
        peers = peer_run(mode, work)
    finally:
        if args.keep:
            log(f"kept peer logs under {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    from bench.control_plane import provenance

    result: dict[str, Any] = {
        "mode": mode.name,
        "peers_only": True,
        "peer_kinds": list(mode.peer_kinds),
        "peer_detect_s": {name: {k: v for k, v in peer["detect_s"].items() if v is not None} for name, peer in peers.items()},
        "peer_detect_s_derived": {name: peer.get("derived_s", {}) for name, peer in peers.items()},
        "peers": peers,
        "first_step_s": mode.first_step_s,
        "wall_s": round(time.monotonic() - started, 1),
        **provenance(argv, "bench.detection"),
    }
    for name, figures in result["peer_detect_s"].items():
        print(f"{name}: measured {figures or '-'}; derived {result['peer_detect_s_derived'][name] or '-'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.detection", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 hardware and 4 workload rounds, 1 peer crash trial, "
                        "shorter phases (a few minutes)")
    parser.add_argument("--smoke", action="store_true", help="one round of each kind, no peers (about a minute): "
                        "that the bench runs, not figures to publish")
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--keep", action="store_true", help="keep the cluster files and the schema for inspection")
    parser.add_argument("--no-peers", action="store_true", help="skip the torchrun / ft_launcher measurements")
    parser.add_argument("--peers-only", action="store_true",
                        help="only the peers (no Keel cluster): for their long waits, for example torchrun's 10-minute "
                        "hang, measured apart from Keel's rounds; the JSON holds the peers' figures alone")
    parser.add_argument("--peer-kinds", default=None,
                        help="comma-separated subset of crash,oom_python,hang for the peers (default: the mode's)")
    args = parser.parse_args(argv)
    mode = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.peer_kinds is not None:
        kinds = tuple(k.strip() for k in args.peer_kinds.split(",") if k.strip())
        unknown = sorted(set(kinds) - {"crash", "oom_python", "hang"})
        if unknown or not kinds:
            parser.error(f"--peer-kinds: unknown or empty {unknown or args.peer_kinds!r} (crash, oom_python, hang)")
        mode = replace(mode, peer_kinds=kinds, peer_trials=max(1, mode.peer_trials))
    if args.peers_only:
        if args.smoke or args.no_peers:
            parser.error("--peers-only runs the peers: not with --smoke or --no-peers")
        return peers_only(mode, args, list(argv if argv is not None else sys.argv[1:]))
    started = time.monotonic()
    servers = Servers(log=log, prefix="keel-bench-detect-")
    log(f"detection benchmark ({mode.name})")
    servers.start()
    try:
        keel = asyncio.run(keel_run(mode, servers, args.keep))
    finally:
        servers.stop()
    peers: dict[str, Any] = {}
    if not args.no_peers and not args.smoke:
        work = scratch_dir("keel-bench-detect-peers-")
        try:
            peers = peer_run(mode, work)
        finally:
            if args.keep:
                log(f"kept peer logs under {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
    result = summarise(mode, keel, peers, time.monotonic() - started)
    from bench.control_plane import provenance

    result.update(provenance(list(argv if argv is not None else sys.argv[1:]), "bench.detection"))
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

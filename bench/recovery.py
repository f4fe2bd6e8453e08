"""Time lost per incident: Keel's recovery against torchrun restarts and a full requeue, per fault kind.

    python -m bench.recovery [--quick | --smoke] [--json PATH] [--keep] [--systems keel,baselines]

One job, 4 nodes x 2 ranks of the example GPT (``keel.workload.train --size tiny --pp 2``: DP 4 x PP 2
over gloo, paced to ``--min-step-time 100ms`` so that the ranks leave the host CPUs to the launchers,
agents and services, as a GPU job does), and three fault kinds: a rank crash, a node lost (its agent or
launcher and both ranks SIGKILLed at once, its shared memory gone), a hang (a rank stops at a step
boundary; its peers block in their next collective).

**Time lost per incident** = from the fault until the job is back at the step it had reached when the
fault hit: detection + decision + restart + restore + recomputation. Every figure comes from rank 0's
output (each step line ends with ``t_unix``, the wall clock when the step was done):

- the step the fault hit (``s_f``): the last step the faulted generation completed; the fault time is
  that step line's ``t_unix`` (workload faults fire at that step boundary, ``params.at_step = s_f + 1``)
  or the moment of the SIGKILL (node lost);
- back: with the restored step at or past ``s_f``, the moment the restored job began its first step
  (that step line's ``t_unix`` minus its ``step_time_s``); else the ``t_unix`` of step ``s_f`` again.

Phases (``PHASES``): detection (the first failure signal: an agent's event for Keel, the launcher's
first line about the failed worker for torchrun), decision (Keel: until ``RestartDecided``, stop-time
diagnostics included), restart (until rank 0's ``main`` began: processes stopped and started,
interpreter, ``import torch``), setup and restore (process groups, model, restore: until the first
step began; rank 0's own restore time is ``restore_s``), recompute.

Systems, one after the other on the same machine (Keel first, then the baselines):

- **Keel**: ``keel up``'s services as processes (controller, checkpoint broker, analyzer, local
  actuator; the recorder in this process) against embedded NATS + PostgreSQL, and a local cluster
  (``cluster_up``) of 4 nodes + 1 warm standby, every agent forking ranks and rounds from its warm zygote.
  The controller decides (a crash: rung 2, stop-time diagnostics, restart in place; a lost node: the
  other ranks' exits, diagnostics naming the node that does not acknowledge, eviction and standby
  promotion; a hang: the inspector's step timeout, then rung 3: the analyzer aggregates every process's
  py-spy stack and names the hung rank's pipeline group, which is evicted for the standby); the ranks
  restore from memory (the promoted node from its peer copies). Production settings (``ControllerSettings`` defaults: 60 s
  diagnostics timeout, 30 s heartbeat silence; heartbeats every 5 s; the inspector's defaults: a rank
  stuck in a collective for max(5 s, 5 x p99 wait), the 25 s step-timeout floor), the same in every trial, except ``KEEL_CONTROLLER__STANDBY_MIN=1`` (the binomial model sizes
  the pool of a 4-node job to 0: keep one warm standby), ``KEEL_CONTROLLER__MAX_EVICTION_FRACTION=1.0``
  (the default 10 % allows a 4-node job one eviction an hour: the second lost node of the run would trip
  the breaker). Before each fault the bench waits
  until the previous incident is resolved and a heartbeat shows the job past it (else the controller
  would see the same failure twice in a row: rung 4), every node's zygote is ready, and, for a lost node
  or a hang, until a standby is ready.
  Keel keeps every step in memory, but a node's ranks that move (a lost node's, a hang's evicted group)
  restore from their peers' copies, which are restorable at checkpoint report rounds only (every
  ``report_round_steps``, 5 to 10 s of steps: the owner's digests ride its heartbeat), so its faults fire
  at stratified offsets within the report round, as the baselines' within their persistent interval:
  trial i of n, k_i = floor((i + 0.5) / n * R) steps after a round step (``--quick``: the middle of the
  round, the mean of a uniform fault time), at least 3 steps after the bench sees a steady step, on the
  flat and the netns cluster alike. ``keel ettr``'s own split (``compute_ettr`` on the job's
  events; heartbeat-grained) is reported beside.
- **torchrun** (``bench._torchrun_group``): one ``torchrun`` per simulated node (c10d rendezvous on
  127.0.0.1, ``--max-restarts``), restarting all workers on any failure; the ranks resume from a
  persistent checkpoint taken every N steps (``--persist-every``: each rank saves its whole state
  synchronously, fsynced). N comes from Young's formula ``sqrt(2 C MTBF) / step time`` with this run's
  save cost C, measured first (the job's first launch persists every 5 steps: the slowest rank's save,
  median over the persists after the first), and MTBF = 3 h. A lost node needs a replacement machine to
  re-form the 4-node rendezvous: the bench starts a fresh launcher for it the moment a surviving
  launcher reports the failure (a spare ready at once: generous to torchrun). A hang is only ended by
  the collective timeout (gloo ``--pg-timeout``: 10 min in the workload; NCCL's default is 10 min),
  which the bench does not wait for: once the hang has fired and the job stopped stepping it SIGKILLs
  the hung rank (standing in for the timeout), measures the restart, restore and recomputation from
  there and adds the timeout: lost = pg_timeout + (back - kill). The timeout is a constant, not a
  measured detection, so these figures are kept apart as derived (``lost_s_torchrun_derived``,
  ``lost_s_requeue_derived``, ``ratios_by_kind_derived``; a trial's ``lost_s_derived``) and out of the
  measured keys and minima; the hang's detection under the baselines is to be measured elsewhere.
- **requeue**: when the fault is detected (the same detection as torchrun's; a hang: the collective
  timeout, as above) the bench SIGKILLs every process and starts the job afresh (4 new launchers, new
  ranks, a new rendezvous), which restores from the persistent tier. No scheduler queue time is added
  (generous). The calibration launch is requeued the same way when N is known (``relaunch``: measured,
  reported, and the source of a ``--quick`` run's requeue figures).

The baselines' trials run on one job, each kind's torchrun trials then its requeue trials. Their faults
fall at times spread uniformly over the persistent checkpoint interval: trial i of n fires
k_i = floor((i + 0.5) / n * N) steps after a persisted step (stratified), so the mean recomputation is
that of a uniform fault time. Crash and hang trials take ranks 3, 5, 7, 1, ... in turn; lost nodes are
the nodes of those ranks (never rank 0's node, which hosts torchrun's rendezvous).

``--quick`` (under 5 minutes): one trial per kind for Keel; for the baselines only torchrun's crash and
lost node are run, as soon as possible, with the recomputation corrected to the mean of a uniform fault
time (((N - 1) / 2 - k) x the step time, added); the other figures are derived (``derive_baselines``:
after detection a requeue is the same whatever the fault, and a hang is a crash detected by the
timeout). The full run measures every figure.

``--smoke`` (under a minute; ``tests/integration/test_bench_smoke.py`` runs it): the quick run's code on a
2-node job (DP 2 x PP 2), one Keel crash trial and one torchrun crash trial, the calibration over 3 persists;
Keel's other kinds, torchrun's lost node and the single-node restarts (so the packing correction) are not
run, and the JSON's ``skipped`` says so, as it says which baseline figures are derived. A check that the
bench works end to end, not figures: its targets are not judged.

``--hosts netns`` runs Keel's trials on a job whose nodes are separate hosts (``keel.cluster.netns``: a
network namespace per node on one bridge; the control plane, NATS included, on the bridge's address), and
``--hosts flat,netns`` runs both against the same servers, one after the other, and reports the same keys
for each (``lost_s_keel_by_hosts``) and ``netns_vs_flat_node_lost``. On separate hosts a lost node is a
*link cut* (a partition: its processes keep running, unreachable), not a SIGKILL. With netns the analyzer's
fail-slow rounds are off on both clusters (``KEEL_ANALYZER__FAILSLOW_INTERVAL=1h``): on separate hosts they
convicted healthy nodes, the rendezvous master's included (docs/known-limits.md). Target: a lost node
costs at most 1.5x the flat cluster's (``NETNS_TARGET_RATIO``).

**Corrected for packing** (derived, beside the raw figures): the 4 nodes share this host's cores, so a
baseline's restart of 8 fresh interpreters (``import torch`` each) runs 4 nodes' work on the same CPUs,
where real nodes restart in parallel on their own; Keel's forks from warm zygotes are cheap either way.
``keel_single_node`` and ``baseline_single_node``: each system's restart of a 1-node job (2 ranks, DP 1 x PP 2) alone on the host,
one rank crash (Keel: the same stack, restart in place; torchrun: its own worker restart; requeue: every
process killed, a fresh launcher), its restart cost = restart + setup_and_restore phases. Then per
system and kind (``packing_correction``): corrected = raw - (packed restart - single-node restart), the
packed restart being that system's measured phases for that kind; torchrun's lost node takes the
slower of its own and a requeue's single-node restart (the replacement machine starts a launcher
afresh). Keys ``lost_s_corrected_for_packing``, ``ratio_vs_*_corrected_for_packing``,
``single_node_restart_s``, ``packed_restart_s``. The correction leaves the rendezvous and process groups
of 8 ranks against 2 in the packed figure's favour or against (a 1-node job connects 2 ranks, not 8).

``what_if_save_cost`` (a model of larger persistent save costs) was removed: it raised only the
baselines' cost (``summarise`` says why).

Targets: Keel loses >= 5x less time per incident than both baselines, for every kind (the ratios are
the minimum over the measured kinds: crash and lost node; the hang's are derived). A trial that does not
recover within its timeout is reported and makes the run exit 1 (the other systems still run; the JSON lists the failures and the scratch folder is kept).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import _torchrun_group as tg  # noqa: E402
from bench._servers import Servers, scratch_dir, start_services, stop_services  # noqa: E402

NODES, NPROC = 4, 2
WORLD = NODES * NPROC
KINDS = ("crash", "node-lost", "hang")
SYSTEMS = ("keel", "torchrun", "requeue")
MTBF_S = 3 * 3600.0
TARGET_RATIO = 5.0
JOB_ID = "recovery"
MIN_STEP_TIME = "100ms"
TRAIN = ["--size", "tiny", "--pp", "2", "--steps", "1000000", "--warmup-steps", "20", "--min-step-time", MIN_STEP_TIME]
PG_TIMEOUT_S = 600.0
"""keel.workload.train's --pg-timeout default (10m): what ends a hang under torchrun."""
AHEAD = 3
"""A workload fault fires at least this many steps after the bench wrote it: every rank has read it."""
CALIBRATION_EVERY = 5


@dataclass(frozen=True)
class Mode:
    name: str
    keel_trials: int
    baseline_trials: int
    floor: str | None
    """KEEL_INSPECTOR__STEP_TIMEOUT_FLOOR (None: the inspector's default, 25 s)."""
    diagnostics_timeout: str | None
    """KEEL_CONTROLLER__DIAGNOSTICS_TIMEOUT (None: the controller's default, 60 s)."""
    calibration_persists: int
    measured: dict[str, tuple[str, ...]]
    """The kinds each baseline runs; the others are derived (``derive_baselines``)."""
    stratified: bool
    """Faults at stratified offsets over the persistent interval (waiting for them); else as soon as
    possible, with the recomputation corrected to the mean of a uniform fault time (``--quick``)."""
    nodes: int = NODES
    """Training nodes of the job, Keel's and the baselines' alike (``NPROC`` ranks each)."""
    keel_kinds: tuple[str, ...] = KINDS
    """The kinds Keel's trials inject (``--smoke``: the crash only)."""
    single_node: bool = True
    """Measure each system's restart of a 1-node job alone, for the packing correction (not in ``--smoke``)."""


QUICK = Mode("quick", keel_trials=1, baseline_trials=1, floor=None, diagnostics_timeout=None, calibration_persists=5,
             measured={"torchrun": ("crash", "node-lost"), "requeue": ()}, stratified=False)
FULL = Mode("full", keel_trials=3, baseline_trials=3, floor=None, diagnostics_timeout=None, calibration_persists=12,
            measured={"torchrun": KINDS, "requeue": KINDS}, stratified=True)
SMOKE = Mode("smoke", keel_trials=1, baseline_trials=1, floor=None, diagnostics_timeout=None, calibration_persists=2,
             measured={"torchrun": ("crash",), "requeue": ()}, stratified=False, nodes=2, keel_kinds=("crash",),
             single_node=False)
"""``--smoke``: the quick run's code at the smallest job, for the test that keeps the bench from rotting
(``tests/integration/test_bench_smoke.py``): 2 nodes, one Keel crash and one torchrun crash, 3 persists to
calibrate; the other kinds and the single-node restarts are not run (the JSON's ``skipped`` says which)."""


class TrialFailed(RuntimeError):
    """A trial did not recover (or could not be set up); the message says what was seen and where."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def rank_for(i: int, world: int = WORLD) -> int:
    """The rank trial ``i`` faults: 3, 5, 7, 1, ... (never rank 0, whose node hosts torchrun's rendezvous);
    in a one-node job (``keel_single_node``, ``baseline_single_node``) rank 1."""
    return (2 * i + 3) % world


def fault_offset(i: int, n: int, every: int) -> int:
    """Steps after a persisted step at which trial ``i`` of ``n`` fires (stratified uniform)."""
    return min(every - 1, int((i + 0.5) / n * every))


def round_fault_step(current: int, offset: int, every: int) -> int:
    """The first step >= current + AHEAD that lies ``offset`` steps after a report round (steps s with
    s % every == 0, ``keel.agent.checkpointing.report_round_steps``)."""
    s = current + AHEAD
    while (s - offset) % every:
        s += 1
    return s


def fault_step(current: int, offset: int, every: int) -> int:
    """The first step >= current + AHEAD that lies ``offset`` steps after a persisted step (persists
    follow steps p with (p + 1) % every == 0)."""
    s = current + AHEAD
    while (s - (every - 1) - offset) % every:
        s += 1
    return s


# -- rank 0's step lines ---------------------------------------------------------------------------


@dataclass
class Back:
    """How a restarted generation got back: from its rank 0's lines."""

    restored: int = -1
    restored_from: str = ""
    main_at: float | None = None
    """When rank 0's ``main`` began (its interpreter started and imported torch before)."""
    setup_at: float | None = None
    """When rank 0 was done with its setup: process group, model, restore."""
    restore_s: float | None = None
    resumed_at: float | None = None
    back_at: float | None = None
    steps_seen: int = 0


def back_from(texts: list[str], s_f: int) -> Back:
    """Scan a restarted generation's rank 0 output (in order) for its restore and the step ``s_f``."""
    out = Back()
    for text in texts:
        match = tg.SETUP.match(text)
        if match:
            out.setup_at = float(match.group(3))
            out.main_at = out.setup_at - float(match.group(1))
            out.restore_s = float(match.group(2))
            continue
        match = tg.RESTORED.match(text)
        if match:
            out.restored, out.restored_from = int(match.group(1)), match.group(2)
            continue
        match = tg.STEP.match(text)
        if not match:
            continue
        step, step_s, at = int(match.group(1)), float(match.group(2)), float(match.group(3))
        out.steps_seen += 1
        if out.resumed_at is None:
            out.resumed_at = at - step_s
            if out.restored >= s_f:
                out.back_at = out.resumed_at
                return out
        if step >= s_f:
            out.back_at = at
            return out
    return out


def step_lines(texts: list[str]) -> list[tuple[int, float, float]]:
    """(step, step_time_s, t_unix) of every step line."""
    found = []
    for text in texts:
        match = tg.STEP.match(text)
        if match:
            found.append((int(match.group(1)), float(match.group(2)), float(match.group(3))))
    return found


# -- Keel -----------------------------------------------------------------------------------------


class RankLog:
    """Incremental reader of one rank log file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = ""
        self.lines: list[str] = []

    def poll(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return self.lines
        self.offset += len(data)
        text = self.partial + data.decode(errors="replace")
        parts = text.split("\n")
        self.partial = parts.pop()
        self.lines.extend(parts)
        return self.lines


class KeelStack:
    """The services as processes, the recorder in this process, one local cluster with a standby."""

    def __init__(self, servers: Servers, work: Path, mode: Mode, network: Any = None, nodes: int | None = None) -> None:
        from bench.detection import EventLog

        self.servers, self.work, self.mode = servers, work, mode
        self.nodes = mode.nodes if nodes is None else nodes
        """Training nodes: the mode's (``keel_single_node`` runs one: its restart alone on the host's cores)."""
        self.network = network
        """A host network (``keel.cluster.netns.NetworkPlan``): each node a host of its own; None: a flat cluster."""
        self.log = EventLog(servers)
        self.directory = work / "cluster"
        self.services: dict[str, subprocess.Popen] = {}
        self.knobs = {"KEEL_CONTROLLER__STANDBY_MIN": "1", "KEEL_CONTROLLER__MAX_EVICTION_FRACTION": "1.0",
                      "KEEL_CHECKPOINT__PERSIST_ROOT": str(work / "checkpoints")}
        if mode.floor:
            self.knobs["KEEL_INSPECTOR__STEP_TIMEOUT_FLOOR"] = mode.floor
        if mode.diagnostics_timeout:
            self.knobs["KEEL_CONTROLLER__DIAGNOSTICS_TIMEOUT"] = mode.diagnostics_timeout
        self.rank_logs: dict[Path, RankLog] = {}
        self.more_services: tuple[str, ...] = ()
        """Services started beside the ladder's (``bench.hot_update`` adds hot-update)."""

    @property
    def env(self) -> dict[str, str]:
        """The services' and agents' environment: each authenticates as its own role (``EventLog.env`` names the
        servers' credentials folder)."""
        return {**self.log.env, "KEEL_NATS_URL": self.servers.nats_url, "KEEL_DATABASE_URL": self.servers.database_url,
                "KEEL_HOME": str(self.work / "home"), **self.knobs,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

    async def start(self) -> None:
        from keel.cluster.local import cluster_up

        (self.work / "home").mkdir(parents=True, exist_ok=True)
        await self.log.start()
        services = {"controller": [], "checkpoint-broker": [], "analyzer": [],
                    "actuator": ["--cluster-dir", str(self.directory)], **{name: [] for name in self.more_services}}
        try:
            self.services = await asyncio.to_thread(start_services, services, self.env, self.work)
        except RuntimeError as exc:
            raise TrialFailed(str(exc)) from None
        self.servers.issue_agents(JOB_ID, [*(f"n{i:02d}" for i in range(self.nodes)), "s00"])
        await asyncio.to_thread(cluster_up, self.log.settings, self.directory, nodes=self.nodes, standby=1,
                                nproc_per_node=NPROC, job_id=JOB_ID, command=["-m", "keel.workload.train", *TRAIN],
                                nats_url=self.servers.nats_url, extra_env=self.env,
                                persist_root=self.work / "checkpoints", fault_injection=True, network=self.network)

    async def stop(self) -> None:
        from keel.cluster.local import cluster_down

        try:
            await asyncio.to_thread(cluster_down, self.directory)
        except Exception as exc:  # noqa: BLE001 - keep stopping the rest
            log(f"warning: cluster down: {exc!r}")
        await asyncio.to_thread(stop_services, self.services)
        # The event log beside the service logs (kept with --keep or on a failure; the servers are gone then).
        with open(self.work / "events.jsonl", "w") as out:
            for record in self.log.events:
                out.write(json.dumps(record.event.to_wire(), default=str) + "\n")
        await self.log.close(drop=True)

    # -- where training is --

    def rank_log(self, rank: int, generation: int) -> Path | None:
        found = sorted(self.directory.glob(f"nodes/*/logs/rank{rank}.g{generation}.stdout"),
                       key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None

    def generation(self) -> int:
        gens = [int(p.name.split(".g")[1].split(".")[0]) for p in self.directory.glob("nodes/*/logs/rank0.g*.stdout")]
        return max(gens, default=-1)

    def rank0_lines(self, generation: int) -> list[str]:
        path = self.rank_log(0, generation)
        if path is None:
            return []
        reader = self.rank_logs.setdefault(path, RankLog(path))
        return reader.poll()

    def node_of_rank(self, rank: int, generation: int) -> str:
        path = self.rank_log(rank, generation)
        if path is None:
            raise TrialFailed(f"no log of rank {rank} in generation {generation} under {self.directory}/nodes")
        return path.parent.parent.name

    def events(self, name: str, after: datetime | None = None) -> list[Any]:
        return [e for e in self.log.of_type(name) if after is None or e.occurred_at >= after]

    def report_round_steps(self, since: datetime | None = None) -> int | None:
        """Steps between two checkpoint report rounds of the job now (None: not known yet), as the agents
        reckon them (``keel.agent.checkpointing.report_round_steps``): from the broker's backup interval and
        the slowest training node's step time in its latest heartbeat, over the heartbeat interval (5 s,
        cluster_up's default). A lost node's ranks restore from their peers' copies of a round step."""
        from keel.agent.checkpointing import report_round_steps

        schedules = self.events("CheckpointScheduleSet")
        backup_every = schedules[-1].payload.backup_every_k_steps if schedules else 1
        latest: dict[str, float] = {}
        for e in self.events("NodeHeartbeat", since):
            if not e.payload.standby and e.payload.step_time_p50_s:
                latest[e.payload.node_id] = e.payload.step_time_p50_s
        if not latest and since is not None:
            return self.report_round_steps()
        rounds = [report_round_steps(backup_every, t, timedelta(seconds=5)) for t in latest.values()]
        known = [r for r in rounds if r is not None]
        return max(known) if known else None

    def open_incidents(self) -> list[Any]:
        resolved = {e.payload.incident_id for e in self.events("IncidentResolved")}
        return [e for e in self.events("IncidentOpened") if str(e.id) not in resolved]

    def progressed(self) -> bool:
        """A heartbeat of a training node came after the last incident was resolved: the controller has
        seen the job step past it (it clears its same-failure streak then; an injection before that would
        look like the same failure again, rung 4)."""
        recorded = self.log.events
        last = max((k for k, r in enumerate(recorded) if r.event.type == "IncidentResolved"), default=None)
        if last is None:
            return True
        resolved_at = recorded[last].event.occurred_at
        failed_at = max((r.event.payload.last_step for r in recorded[:last] if r.event.type == "IncidentOpened"), default=-1)
        return any(r.event.type == "NodeHeartbeat" and not r.event.payload.standby and r.event.payload.last_step > failed_at
                   and (r.event.occurred_at - resolved_at).total_seconds() > 0.5 for r in recorded[last + 1:])

    def ready_standbys(self) -> set[str]:
        from keel.cluster.local import load_cluster

        passed = {e.payload.node_id for e in self.events("StandbyChecked") if e.payload.passed}
        promoted = {e.payload.node_id for e in self.events("StandbyPromoted") if e.payload.outcome == "promoted"}
        evicted = {n["node_id"] for n in load_cluster(self.directory)["nodes"] if n.get("evicted")}
        return passed - promoted - evicted

    def warm_nodes(self) -> tuple[int, int]:
        """(nodes whose zygote is ready, nodes in service): each agent forks ranks and rounds from one
        zygote that imported torch once (a replacement node's agent starts its own)."""
        from keel.cluster.local import load_cluster

        nodes = [n["node_id"] for n in load_cluster(self.directory)["nodes"] if not n.get("evicted")]
        ready = sum(1 for n in nodes if (self.directory / "nodes" / n / "warm" / "zygote.ready").exists())
        return ready, len(nodes)

    async def steady(self, min_steps: int = 5, timeout_s: float = 240.0, standby: bool = False) -> tuple[int, int]:
        """Until no incident is open, rank 0 of the newest generation has done ``min_steps`` steps and is
        stepping now, every node's zygote is ready (and, with ``standby``, a standby is
        ready). Returns (generation, last step)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            gen = self.generation()
            steps = step_lines(self.rank0_lines(gen)) if gen >= 0 else []
            warm, nodes = self.warm_nodes()
            if (len(steps) >= min_steps and time.time() - steps[-1][2] < 1.0 and not self.open_incidents()
                    and self.progressed() and (not standby or self.ready_standbys()) and warm == nodes):
                return gen, steps[-1][0]
            await asyncio.sleep(0.05)
        raise TrialFailed(f"Keel: no steady training within {timeout_s:.0f}s (open incidents: "
                          f"{[e.payload.reason[:120] for e in self.open_incidents()]}; ready standbys: "
                          f"{sorted(self.ready_standbys())}; nodes with a ready zygote: "
                          f"{self.warm_nodes()}); {self.where()}")

    async def inject(self, spec: Any) -> None:
        """``keel inject``'s two steps, done here as ``bench.detection`` does: write the node's fault file
        and publish ``FaultInjected`` (stamped before the file is written) on the bench's own connection
        (``keel.cluster.local.inject`` connects to NATS per call). A promoted standby is a training node."""
        import dataclasses
        import uuid

        from keel.cluster.local import apply_fault, cluster_nodes, load_cluster
        from keel.events.envelope import Event, now_utc
        from keel.events.types import FaultInjected

        node = dataclasses.replace(cluster_nodes(load_cluster(self.directory))[spec.node], standby=False)
        fault_id = str(uuid.uuid4())
        at = now_utc()
        detail = apply_fault(node, spec, fault_id)
        event = Event.create(FaultInjected(kind=spec.kind, node_id=spec.node, rank=spec.rank,
                                           params={**spec.params, "detail": detail, "fault_id": fault_id},
                                           injected_by="bench.recovery"),
                             event_id=uuid.UUID(fault_id), job_id=JOB_ID, subject=f"node/{spec.node}", producer="cli",
                             occurred_at=at)
        await self.log.bus.publish(event)

    def where(self) -> str:
        return (f"logs: {self.work}/{{controller,checkpoint-broker,actuator}}.log, "
                f"{self.directory}/nodes/*/agent.log, {self.directory}/nodes/*/logs/")

    def tail(self, since: datetime) -> list[str]:
        out = []
        for recorded in self.log.events:
            e = recorded.event
            if e.occurred_at >= since and e.type not in ("NodeHeartbeat", "TimerTicked", "CheckpointInventoryReported",
                                                         "CheckpointShardsStored"):
                reason = getattr(e.payload, "reason", "") or getattr(e.payload, "detail", "")
                out.append(f"{e.occurred_at.strftime('%H:%M:%S.%f')[:-3]} {e.type} {e.subject} {str(reason)[:160]}")
        return out[-25:]


async def keel_trial(stack: KeelStack, kind: str, i: int, n: int, timeout_s: float) -> dict[str, Any]:
    from keel.cluster.local import FaultSpec, cut_link, kill_node

    steady_since = datetime.now(UTC)
    gen, current = await stack.steady(standby=kind in ("node-lost", "hang"))
    rank = rank_for(i, stack.nodes * NPROC)
    node = stack.node_of_rank(rank, gen)
    # A node's ranks that move (a lost node, a hang's evicted group) restore from their peers' copies of
    # a report round step, so where the fault falls within the round matters: trial i of n fires at a
    # stratified offset into the round (one trial: its middle, the mean of a uniform fault time), on the
    # flat and the netns cluster alike, as the baselines' faults within their persistent interval.
    every = stack.report_round_steps(steady_since)
    offset = fault_offset(i, n, every) if every else None
    target = round_fault_step(current, offset, every) if every and offset is not None else current + AHEAD
    since = datetime.now(UTC)
    trial: dict[str, Any] = {"kind": kind, "trial": i, "generation": gen, "rank": rank if kind != "node-lost" else None,
                             "node": node, "report_round_steps": every, "round_offset_steps": offset}
    if kind == "node-lost":
        while True:  # SIGKILL the node as soon as rank 0 finished the target step
            steps = step_lines(stack.rank0_lines(gen))
            if steps and steps[-1][0] >= target:
                break
            await asyncio.sleep(0.01)
        t_fault = time.time()
        # On separate hosts a lost node is a partition: its link cut, its processes left running.
        await asyncio.to_thread(cut_link if stack.network is not None else kill_node, stack.directory, node)
        trial["fault"] = "link cut" if stack.network is not None else "SIGKILL"
        trial["ranks"] = [r for r in range(stack.nodes * NPROC) if stack.rank_log(r, gen) and stack.node_of_rank(r, gen) == node]
    else:
        await stack.inject(FaultSpec(kind=kind, node=node, rank=rank, params={"at_step": target + 1}))
        t_fault = None
    # The faulted generation's last step, then the next generation getting back there.
    deadline = time.monotonic() + timeout_s
    back = Back()
    s_f = None
    new_gen = None
    while time.monotonic() < deadline:
        newest = stack.generation()
        if newest > gen:
            new_gen = newest
            old = step_lines(stack.rank0_lines(gen))
            if not old:
                raise TrialFailed(f"Keel {kind}: generation {gen} has no step lines")
            s_f = old[-1][0]
            if t_fault is None:
                t_fault = old[-1][2]
            back = back_from(stack.rank0_lines(new_gen), s_f)
            if back.back_at is not None:
                break
        await asyncio.sleep(0.05)
    if back.back_at is None or t_fault is None or s_f is None:
        raise TrialFailed(f"Keel {kind} trial {i}: not back at the fault's step within {timeout_s:.0f}s "
                          f"(newest generation {stack.generation()}, was {gen}); the log since the fault:\n  "
                          + "\n  ".join(stack.tail(since)) + f"\n{stack.where()}")
    await asyncio.sleep(0.5)  # the agents' last events land
    trial.update(keel_marks(stack, since, t_fault, back, gen, new_gen))
    trial.update({"s_f": s_f, "restored_step": back.restored, "restored_from": back.restored_from,
                  "lost_s": round(back.back_at - t_fault, 3), "new_generation": new_gen})
    return trial


def keel_marks(stack: KeelStack, since: datetime, t_fault: float, back: Back, gen: int, new_gen: int) -> dict[str, Any]:
    """The phase split from the controller's and agents' events, and the controller's incident."""
    def ts(e: Any) -> float:
        return e.occurred_at.timestamp()

    # The controller dates what it decides at its latest clock tick (up to a tick before it decided, even
    # before the fault), so its events are timed when the recorder stored them: an upper bound, within the
    # recorder's lag. Agents date their signals with their own clocks when they see them: those stand.
    stored = {r.event.id: r.recorded_at.timestamp() for r in stack.log.events
              if r.event.producer == "controller" and r.event.occurred_at >= since}

    def decided_at(e: Any) -> float:
        return max(ts(e), stored.get(e.id, ts(e)))

    opened = [e for e in stack.events("IncidentOpened", since)]
    incident = opened[0] if opened else None
    resolved = [e for e in stack.events("IncidentResolved", since)
                if incident is not None and e.payload.incident_id == str(incident.id)]
    detected = [e for e in stack.log.of_type("RankExited") if e.occurred_at >= since and e.payload.generation == gen
                and e.payload.classification in ("user_code", "infrastructure", "unknown")]
    detected += [e for e in stack.log.of_type("NodeHealthChanged") if e.occurred_at >= since
                 and e.payload.status == "failed"]
    first_signal = min((ts(e) for e in detected), default=None)
    if incident is not None:  # the controller's incident: detected by then at the latest
        first_signal = min(first_signal or decided_at(incident), decided_at(incident))
    diag = [e for e in stack.events("DiagnosticsRequested", since)]
    restart = [e for e in stack.events("RestartDecided", since) if e.payload.generation == new_gen]
    started = [e for e in stack.events("RankStarted", since) if e.payload.generation == new_gen]
    plan = [e for e in stack.events("CheckpointRestorePlanned", since) if e.payload.generation == new_gen]
    marks = {"fault": t_fault, "detected": first_signal, "decided": decided_at(restart[0]) if restart else None,
             "main": back.main_at, "resumed": back.resumed_at, "back": back.back_at}
    phases = _phases(marks, ("detection", "detected"), ("decision", "decided"), ("restart", "main"),
                     ("setup_and_restore", "resumed"), ("recompute", "back"))
    out: dict[str, Any] = {"phases_s": phases, "restore_s": back.restore_s}
    first_started = min((ts(e) for e in started), default=None)
    if first_started is not None and restart:
        out["ranks_started_after_decision_s"] = round(first_started - decided_at(restart[0]), 3)
    if diag:
        out["diagnostics_s"] = round((decided_at(restart[0]) if restart else back.back_at) - decided_at(diag[0]), 3)
    if incident is not None:
        p = incident.payload
        out["incident"] = {"kind": p.kind, "reason": p.reason[:300],
                           "rung": resolved[0].payload.rung if resolved else None,
                           "outcome": resolved[0].payload.outcome if resolved else None,
                           "resolved_after_s": round(decided_at(resolved[0]) - t_fault, 3) if resolved else None}
    if restart:
        r = restart[0].payload
        out["decision"] = {"rung": r.rung, "evict": r.evict, "promotions": [p.model_dump() for p in r.promotions],
                           "reason": r.reason[:300]}
    if plan:
        out["restore_plan"] = {"step": plan[0].payload.step, "tiers": sorted(t for t, n in plan[0].payload.tiers.items() if n),
                               "planned_after_decision_s": round(ts(plan[0]) - (marks["decided"] or ts(plan[0])), 3)}
    return out


def _phases(marks: dict[str, float | None], *spec: tuple[str, str]) -> dict[str, float | None]:
    """Contiguous phases from ``marks['fault']``: each ends at its mark (a missing or earlier-than-the-
    previous mark takes the previous bound, so the phases always add up to the lost time)."""
    out: dict[str, float | None] = {}
    previous = marks["fault"]
    assert previous is not None
    for name, mark in spec:
        at = marks.get(mark)
        at = previous if at is None or at < previous else at
        out[name] = round(at - previous, 3)
        previous = at
    return out


def keel_ettr(stack: KeelStack) -> dict[str, Any] | None:
    """``keel ettr``'s view of the run: lost time by incident and phase, from the job's events."""
    from keel.rules.ettr import compute_ettr

    events = [r.event for r in stack.log.events if r.event.job_id == JOB_ID]
    report = compute_ettr(events)
    if report is None:
        return None
    data = report.to_json()
    return {"ettr": data["ettr"], "lost_s": data["lost_s"], "lost_by_phase_s": data["lost_by_phase_s"],
            "overhead_s": data["overhead_s"],
            "incidents": [{"cause": i["cause"], "lost_s": round(i["lost_s"], 3), "recovered": i["recovered"],
                           "phases_s": {k: round(v, 3) for k, v in i["phases_s"].items()}} for i in data["incidents"]]}


async def keel_run(mode: Mode, servers: Servers, work: Path, failures: list[str], network: Any = None,
                   knobs: dict[str, str] | None = None) -> dict[str, Any]:
    stack = KeelStack(servers, work, mode, network)
    stack.knobs.update(knobs or {})
    trials: list[dict[str, Any]] = []
    out: dict[str, Any] = {"trials": trials, "settings": {**stack.knobs, "heartbeat_interval": "5s (cluster_up default)"},
                           "hosts": "netns" if network is not None else "flat"}
    try:
        t0 = time.monotonic()
        await stack.start()
        await stack.steady(min_steps=10, timeout_s=300, standby=True)
        out["up_s"] = round(time.monotonic() - t0, 1)
        log(f"keel ({out['hosts']}): {stack.nodes} nodes x {NPROC} ranks + 1 standby stepping after {out['up_s']}s")
        for kind in mode.keel_kinds:
            for i in range(mode.keel_trials):
                timeout_s = 300.0
                try:
                    trial = await keel_trial(stack, kind, i, mode.keel_trials, timeout_s)
                except TrialFailed as exc:
                    failures.append(str(exc))
                    log(f"FAILED: {exc}")
                    out["failed"] = True
                    return out
                trials.append(trial)
                log(f"  keel {kind} #{i + 1}: lost {trial['lost_s']:.2f}s (s_f {trial['s_f']}, restored "
                    f"{trial['restored_step']} via {trial.get('restore_plan', {}).get('tiers')}; phases "
                    f"{trial['phases_s']}; rung {trial.get('decision', {}).get('rung')})")
        out["ettr"] = keel_ettr(stack)
        steps = [s for g in range(stack.generation() + 1) for s in step_lines(stack.rank0_lines(g))[2:]]
        out["step_time_s"] = round(statistics.median(x[1] for x in steps), 4) if steps else None
    finally:
        await stack.stop()
    return out


# -- the baselines --------------------------------------------------------------------------------


@dataclass
class Chain:
    """The baselines' job: a sequence of launches of one torchrun group (torchrun's own restarts keep a
    launch going; a requeue ends it and starts the next), one persistent tier for all of them."""

    name: str
    work: Path
    persist_every: int
    max_restarts: int
    persist_dir: Path = field(default=Path())
    nodes: int = NODES
    """Simulated nodes, a launcher each (``baseline_single_node`` runs one)."""
    extra_args: tuple[str, ...] = ()
    """More workload arguments (``bench.hot_update``'s deploy by checkpoint: ``--save-on-sigterm``)."""
    fault_file: Path = field(init=False)
    group: tg.Group | None = None
    launches: int = 0

    def __post_init__(self) -> None:
        if self.persist_dir == Path():
            self.persist_dir = self.work / f"{self.name}-persist"
        self.fault_file = self.work / f"{self.name}-fault.json"

    def launch(self) -> tg.Group:
        self.launches += 1
        self.group = tg.Group(self.work, f"{self.name}{self.launches}", [*TRAIN, *self.extra_args], self.persist_every,
                              self.persist_dir, self.fault_file, self.max_restarts, self.nodes, NPROC)
        self.group.start()
        return self.group

    def where(self) -> str:
        return f"launcher logs: {', '.join(self.group.log_paths()) if self.group else '-'}"


def wait_steady(group: tg.Group, since: float, min_steps: int = 5, timeout_s: float = 240.0) -> int:
    """Until rank 0 has done ``min_steps`` steps since ``since`` and is stepping now; its last step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = group.lines(since)
        steps = step_lines([line.text for line in lines])
        if len(steps) >= min_steps and time.time() - steps[-1][2] < 1.0:
            return steps[-1][0]
        time.sleep(0.05)
    raise TrialFailed(f"no steady training within {timeout_s:.0f}s; last lines: "
                      + "\n  ".join(tg.summary(group.lines())["tail"]))


def wait_step(group: tg.Group, step: int, since: float, timeout_s: float) -> tuple[int, float]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = tg.last_step(group.lines(since))
        if last and last[0] >= step:
            return last[0], last[1]
        time.sleep(0.01)
    raise TrialFailed(f"rank 0 did not reach step {step} within {timeout_s:.0f}s")


def calibrate(work: Path, persists: int, nodes: int = NODES) -> tuple[dict[str, Any], Chain]:
    """The baselines' job (``nodes`` launchers) starts persisting every CALIBRATION_EVERY steps: the save cost
    C (the slowest rank's, median over the persists after the first) and the step time. The launch is left
    running: ``baseline_run`` requeues it with Young's interval."""
    chain = Chain("baseline", work, CALIBRATION_EVERY, 0, nodes=nodes)
    group = chain.launch()
    t0 = time.time()
    try:
        deadline = time.monotonic() + 120 + persists * CALIBRATION_EVERY * 1.0
        while time.monotonic() < deadline:
            texts = [line.text for line in group.lines(t0)]
            saves = [float(m.group(2)) for m in map(tg.PERSIST.match, texts) if m]
            if len(saves) >= persists + 1:
                break
            if group.exited():
                raise TrialFailed(f"calibration launch exited: {group.exited()}; {chain.where()}")
            time.sleep(0.2)
        else:
            raise TrialFailed(f"calibration: fewer than {persists} persists; {chain.where()}")
    except BaseException:
        group.kill_all()
        raise
    saves = saves[1:]  # the first save also creates the folders and warms the page cache
    steps = step_lines(texts)[3:]
    return ({"save_cost_s": statistics.median(saves), "save_cost_mean_s": statistics.mean(saves),
             "save_costs_s": [round(x, 4) for x in saves], "step_time_s": statistics.median(s[1] for s in steps),
             "steps": len(steps), "persist_every": CALIBRATION_EVERY}, chain)


def young(save_cost_s: float, step_time_s: float) -> tuple[int, float, float]:
    """Young's interval: (N steps, N raw, interval seconds) for ``MTBF_S``."""
    from keel.checkpoint_broker.schedule import young_interval

    n, raw = young_interval(save_cost_s, MTBF_S, step_time_s, 1, 10**9)
    return n, raw, math.sqrt(2 * save_cost_s * MTBF_S)


def baseline_trial(chain: Chain, system: str, kind: str, i: int, n: int, timeout_s: float, stratified: bool,
                   step_time_s: float) -> dict[str, Any]:
    """One fault on the running group: torchrun restarts its workers itself; a requeue stops every
    process at detection and launches the job afresh."""
    assert chain.group is not None
    group = chain.group
    every = chain.persist_every
    current = wait_steady(group, 0.0)
    if stratified:
        offset = fault_offset(i, n, every)
        # At least one persisted step before the fault: the restart restores from the persistent tier.
        target = fault_step(max(current, every - 1 + offset - AHEAD), offset, every)
    else:
        target = current + AHEAD
        offset = (target + 1) % every
    rank = rank_for(i, chain.nodes * NPROC)
    node = rank // NPROC
    mark = time.time()
    trial: dict[str, Any] = {"kind": kind, "trial": i, "rank": rank if kind != "node-lost" else None, "node": node,
                             "launch": chain.launches}
    kill_at = None
    if kind == "node-lost":
        wait_step(group, target, mark, timeout_s=every * 2.0 + 60)
        t_fault = time.time()
        group.kill_node(node)
    else:
        tg.write_fault(chain.fault_file, kind, rank, target + 1)
        t_fault = None
    # Detection: the first launcher line about a failed worker (a hang: the job stops stepping; the
    # collective timeout is not waited for).
    deadline = time.monotonic() + timeout_s
    detected = None
    while time.monotonic() < deadline:
        lines = group.lines(mark)
        if kind == "hang":
            fired = [line for line in lines if "keel injected hang" in line.text]
            last = tg.last_step(lines)
            if fired and last and time.time() - last[2] > 3.0:
                kill_at = time.time()
                trial["hung_pids"] = group.kill_rank(rank)
                break
        else:
            detected = tg.first_failure(lines, t_fault or mark)
            if detected is not None:
                break
        time.sleep(0.02)
    else:
        raise TrialFailed(f"{system} {kind} trial {i}: the fault was not detected within {timeout_s:.0f}s; "
                          f"{chain.where()}")
    chain.fault_file.unlink(missing_ok=True)  # the restarted ranks must not apply it again
    before = group.lines(mark)
    old_steps = step_lines([line.text for line in before if kill_at is None or line.at <= kill_at])
    if system == "requeue":
        stop_at = time.time()
        group.kill_all()
        trial["stop_s"] = round(time.time() - stop_at, 3)
        group = chain.launch()
    elif kind == "node-lost":
        group.start_node(node)  # the replacement machine, at once
    # Back: the next generation's rank 0 lines (after its setup line) reach the fault's step.
    restart_mark = kill_at or (detected.at if detected else mark)
    back = Back()
    while time.monotonic() < deadline:
        lines = group.lines(restart_mark - 0.5)
        setups = [k for k, line in enumerate(lines) if tg.SETUP.match(line.text) and line.at > restart_mark - 0.5]
        if setups:
            texts = [line.text for line in lines[setups[0]:]]
            s_f = _last_before(old_steps)
            back = back_from(texts, s_f[0])
            if back.back_at is not None:
                break
        if len([1 for node, code in group.exited() if code is not None]) >= len(group.launchers):
            raise TrialFailed(f"{system} {kind} trial {i}: every launcher exited {group.exited()}; {chain.where()}")
        time.sleep(0.05)
    if back.back_at is None:
        raise TrialFailed(f"{system} {kind} trial {i}: not back at the fault's step within {timeout_s:.0f}s; "
                          f"{chain.where()}")
    s_f, s_f_at = _last_before(old_steps)
    if t_fault is None:
        t_fault = s_f_at
    # The fault's actual offset: steps done since the step the restart restored (a persisted one).
    trial.update({"s_f": s_f, "restored_step": back.restored, "recomputed_steps": max(0, s_f - back.restored),
                  "planned_offset_steps": offset, "offset_steps": s_f - back.restored})
    marks = {"fault": t_fault, "detected": detected.at if detected else None, "main": back.main_at,
             "resumed": back.resumed_at, "back": back.back_at}
    trial["restore_s"] = back.restore_s
    if kind == "hang":
        # The collective timeout ends the hang PG_TIMEOUT_S after it fired; from then on, as measured.
        trial["measured_after_timeout_s"] = round(back.back_at - kill_at, 3)
        trial["phases_s"] = {"detection": PG_TIMEOUT_S, "decision": 0.0,
                             **_phases({**marks, "fault": kill_at}, ("restart", "main"),
                                       ("setup_and_restore", "resumed"), ("recompute", "back"))}
        # Not a measurement: the timeout is a constant added to what was measured, hence the key's name.
        trial["lost_s_derived"] = round(PG_TIMEOUT_S + back.back_at - kill_at, 3)
        trial["derived_phases"] = ["detection"]
        trial["note"] = (f"hang not waited for: the rank was SIGKILLed {kill_at - t_fault:.1f}s after it hung, "
                         f"standing in for the {PG_TIMEOUT_S:.0f}s collective timeout (a constant, added: derived)")
    else:
        phases = _phases(marks, ("detection", "detected"), ("restart", "main"), ("setup_and_restore", "resumed"),
                         ("recompute", "back"))
        trial["phases_s"] = {name: phases.get(name, 0.0) for name in PHASES}  # no decision: a launcher restarts at once
        trial["lost_s"] = round(back.back_at - t_fault, 3)
        if detected is not None:
            trial["detected_by"] = detected.text.strip()[-200:]
    if not stratified:
        # The recomputation of a fault at a uniform time over the interval: (N - 1) / 2 steps on average.
        k = s_f - back.restored
        correction = ((every - 1) / 2 - k) * step_time_s
        key = "lost_s_derived" if kind == "hang" else "lost_s"
        trial.update({"lost_measured_s": trial[key], "recompute_measured_s": trial["phases_s"]["recompute"],
                      "recompute_correction_s": round(correction, 3), key: round(trial[key] + correction, 3)})
        trial["phases_s"]["recompute"] = round(trial["phases_s"]["recompute"] + correction, 3)
    return trial


def _last_before(steps: list[tuple[int, float, float]]) -> tuple[int, float]:
    if not steps:
        raise TrialFailed("no step line before the fault")
    return steps[-1][0], steps[-1][2]


def relaunch(calibration: Chain, chain: Chain, timeout_s: float = 240.0) -> dict[str, Any]:
    """Stop the calibration launch and start the job again with Young's interval, from its persistent
    tier: a requeue's restart (everything stopped, 4 new launchers, new ranks, restore), measured from the
    stop until the new launch is back at the step the old one had reached."""
    assert calibration.group is not None
    old = calibration.group
    stop_at = time.time()
    s_last, _ = _last_before(step_lines([line.text for line in old.lines()]))
    old.kill_all()
    group = chain.launch()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        back = back_from([line.text for line in group.lines()], s_last)
        if back.back_at is not None:
            break
        time.sleep(0.05)
    else:
        raise TrialFailed(f"the requeued launch did not get back to step {s_last} within {timeout_s:.0f}s; {chain.where()}")
    marks = {"fault": stop_at, "main": back.main_at, "resumed": back.resumed_at, "back": back.back_at}
    return {"s_f": s_last, "restored_step": back.restored, "restore_s": back.restore_s,
            "phases_s": _phases(marks, ("restart", "main"), ("setup_and_restore", "resumed"), ("recompute", "back")),
            "lost_after_stop_s": round(back.back_at - stop_at, 3)}


def baseline_run(mode: Mode, work: Path, calibration: Chain, persist_every: int, step_time_s: float,
                 failures: list[str]) -> dict[str, dict[str, Any]]:
    """The torchrun and requeue trials, interleaved (trial i of each kind for torchrun, then for requeue)
    on one job, so that both meet the same machine load."""
    # A kind's trials at offsets k_0 < k_1 < ... back to back: the next fault is (k_1 - k_0) steps on, not N.
    planned = [(i, kind, system) for kind in KINDS for system in ("torchrun", "requeue")
               for i in range(mode.baseline_trials) if kind in mode.measured[system]]
    chain = Chain("baseline", work, persist_every, max_restarts=len(planned) + 3, persist_dir=calibration.persist_dir,
                  nodes=calibration.nodes)
    topology = (f"{chain.nodes} torchrun launchers x {NPROC} ranks (c10d rendezvous on 127.0.0.1, one launcher per "
                "simulated node)")
    runs: dict[str, dict[str, Any]] = {
        "torchrun": {"trials": [], "topology": topology, "max_restarts": chain.max_restarts},
        "requeue": {"trials": [], "topology": topology + f"; at detection every process is SIGKILLed and {chain.nodes} "
                    "new launchers start (new rendezvous)"},
    }
    try:
        try:
            runs["requeue"]["relaunch"] = relaunch(calibration, chain)
        except TrialFailed as exc:
            failures.append(f"requeue: {exc}")
            log(f"FAILED: requeue: {exc}")
            runs["requeue"]["failed"] = True
            return runs
        r = runs["requeue"]["relaunch"]
        log(f"baselines: the calibration launch requeued with persist every {persist_every}: back at step {r['s_f']} "
            f"{r['lost_after_stop_s']:.2f}s after the stop (" + ", ".join(f"{k} {v:.2f}" for k, v in r["phases_s"].items())
            + ")")
        wait_steady(chain.group, 0.0, min_steps=5)  # type: ignore[arg-type]
        for i, kind, system in planned:
            try:
                trial = baseline_trial(chain, system, kind, i, mode.baseline_trials, 240.0, mode.stratified, step_time_s)
            except TrialFailed as exc:
                failures.append(f"{system}: {exc}")
                log(f"FAILED: {system}: {exc}")
                runs[system]["failed"] = True
                return runs
            runs[system]["trials"].append(trial)
            corrected = (f"; measured {trial['lost_measured_s']:.2f}s, recompute corrected by "
                         f"{trial['recompute_correction_s']:+.2f}s to the interval's mean") if "lost_measured_s" in trial else ""
            log(f"  {system} {kind} #{i + 1}: lost {trial.get('lost_s', trial.get('lost_s_derived')):.2f}s (fault {trial['offset_steps']} steps after a "
                f"persist, s_f {trial['s_f']}, restored {trial['restored_step']}{corrected}; "
                + ", ".join(f"{k} {v:.2f}" for k, v in trial["phases_s"].items()) + ")")
    finally:
        if chain.group is not None:
            chain.group.kill_all()
    derive_baselines(runs, mode, persist_every, step_time_s)
    for run in runs.values():
        run["launches"] = chain.launches
    return runs


def derive_baselines(runs: dict[str, dict[str, Any]], mode: Mode, every: int, step_time_s: float) -> None:
    """The kinds a (quick) run did not measure. After detection a requeue's path (stop everything, launch
    afresh, restore, recompute) is the same whatever the fault; a hang is detected by the collective
    timeout. So a derived trial = the detection (torchrun's measured detection of that kind; a hang:
    PG_TIMEOUT_S) + the rest of that system's measured crash trials, or, for a requeue without one, the
    measured requeue of the calibration launch (restart, restore) and the mean recomputation of a uniform
    fault time ((N - 1) / 2 steps)."""
    for system, run in runs.items():
        trials = run["trials"]
        rests = [{k: v for k, v in t["phases_s"].items() if k != "detection"}
                 for t in trials if t["kind"] == "crash" and "derived_from" not in t]
        source = f"the {system} crash trial's restart, restore and recompute"
        if not rests and "relaunch" in run:
            phases = run["relaunch"]["phases_s"]
            rests = [{"decision": 0.0, "restart": phases["restart"], "setup_and_restore": phases["setup_and_restore"],
                      "recompute": round((every - 1) / 2 * step_time_s, 3)}]
            source = ("the measured requeue of the calibration launch (restart, restore) and the mean recomputation "
                      f"of a uniform fault time ((N - 1) / 2 = {(every - 1) / 2:g} steps)")
        for kind in KINDS:
            if kind in mode.measured[system] or not rests:
                continue
            if kind == "hang":
                detection, detected_by = PG_TIMEOUT_S, f"the {PG_TIMEOUT_S:.0f}s collective timeout"
            else:
                measured = [t for t in runs["torchrun"]["trials"] if t["kind"] == kind and "derived_from" not in t]
                if not measured:
                    continue
                detection = statistics.mean(t["phases_s"]["detection"] for t in measured)
                detected_by = f"torchrun's measured detection of a {kind}"
            for n, rest in enumerate(rests):
                phases = {"detection": round(detection, 3), **rest}
                trials.append({"kind": kind, "trial": n, "derived_from": source, "phases_s": phases,
                               # a hang's lost time holds the timeout constant: kept apart from the measured ones
                               ("lost_s_derived" if kind == "hang" else "lost_s"): round(sum(phases.values()), 3),
                               **({"derived_phases": ["detection"]} if kind == "hang" else {}),
                               "note": f"not run in the {mode.name} run: {detected_by} plus {source}"})


# -- the report -----------------------------------------------------------------------------------


def mean_by_kind(trials: list[dict[str, Any]], key: str = "lost_s") -> dict[str, float | None]:
    """The mean of ``key`` per kind over the trials that carry it (``lost_s_derived``: the baselines' hangs,
    whose collective timeout is a constant added to the measured rest)."""
    out: dict[str, float | None] = {}
    for kind in KINDS:
        values = [t[key] for t in trials if t["kind"] == kind and key in t]
        out[kind] = round(statistics.mean(values), 3) if values else None
    return out


PHASES = ("detection", "decision", "restart", "setup_and_restore", "recompute")
"""fault -> detected (the first failure signal: an event for Keel, the launcher's line for torchrun) ->
decided (Keel: ``RestartDecided``, after diagnostics) -> rank 0's ``main`` began (processes restarted,
interpreter and imports done) -> the restored job began its first step (rendezvous, process groups,
restore) -> back at the step the fault hit (recomputation)."""


def phase_means(trials: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        of_kind = [t["phases_s"] for t in trials if t["kind"] == kind and t.get("phases_s")]
        out[kind] = {name: round(statistics.mean(p.get(name, 0.0) for p in of_kind), 3) for name in PHASES} if of_kind else {}
    return out


RESTART_PHASES = ("restart", "setup_and_restore")
"""What packing 4 nodes onto the host's cores distorts: processes stopped and started, interpreters,
``import torch``, the rendezvous, process groups, model and restore (``PHASES``)."""


def restart_cost_s(phases: dict[str, float] | None) -> float | None:
    """A trial's (or a phase mean's) restart cost: its ``RESTART_PHASES`` added (None: not measured)."""
    if not phases or any(phases.get(name) is None for name in RESTART_PHASES):
        return None
    return round(sum(phases[name] for name in RESTART_PHASES), 3)


def single_node_reference_s(system: str, kind: str, single: dict[str, float | None]) -> float | None:
    """The restart cost of one node alone that stands for ``system``'s restart after a ``kind`` fault when
    every node restarts in parallel on its own CPUs. The slowest node sets the pace: torchrun's lost node
    is a fresh launcher on the replacement machine beside restarted workers on the others, so the slower
    of its in-place restart and a requeue's fresh start; every other restart is the system's own."""
    if system == "torchrun" and kind == "node-lost":
        known = [v for v in (single.get("torchrun"), single.get("requeue")) if v is not None]
        return max(known) if len(known) == 2 else None
    return single.get(system)


def packing_corrected_s(raw_s: float | None, packed_restart_s: float | None, single_restart_s: float | None) -> float | None:
    """Lost time corrected for packing, derived: raw - (packed restart - single-node restart). The packed
    restart is what the trial measured with every node's processes on the host's shared cores; the
    single-node one the same restart measured with one node alone (as on its own CPUs)."""
    if raw_s is None or packed_restart_s is None or single_restart_s is None:
        return None
    return round(raw_s - (packed_restart_s - single_restart_s), 3)


def lost_ratio(peer_s: float | None, keel_s: float | None) -> float | None:
    return round(peer_s / keel_s, 2) if peer_s and keel_s else None


def minimum_ratio(values: dict[str, float | None]) -> float | None:
    """The minimum over the kinds with a figure; None unless crash and node-lost (both measured for every
    system, the hang's baseline only derived) have one."""
    if values.get("crash") is None or values.get("node-lost") is None:
        return None
    return min(v for v in values.values() if v is not None)


def summarise(mode: Mode, calibration: dict[str, Any] | None, young_n: tuple[int, float, float] | None,
              runs: dict[str, dict[str, Any]], failures: list[str], wall_s: float,
              single: dict[str, Any] | None = None) -> dict[str, Any]:
    trials = {system: runs.get(system, {}).get("trials", []) for system in SYSTEMS}
    lost = {system: mean_by_kind(trials[system]) for system in SYSTEMS}
    # The baselines' hang: the 600 s collective timeout (a constant, not waited for) plus the measured rest.
    lost_derived = {system: mean_by_kind(trials[system], "lost_s_derived") for system in ("torchrun", "requeue")}
    phases = {system: phase_means(trials[system]) for system in SYSTEMS}
    ratios = {peer: {kind: lost_ratio(lost[peer][kind], lost["keel"][kind]) for kind in KINDS} for peer in ("torchrun", "requeue")}
    ratios_derived = {peer: {"hang": lost_ratio(lost_derived[peer]["hang"], lost["keel"]["hang"])} for peer in ("torchrun", "requeue")}
    result: dict[str, Any] = {
        "mode": mode.name,
        "mode_detail": {"nodes": mode.nodes, "keel_trials_per_kind": mode.keel_trials,
                        "baseline_trials_per_kind": mode.baseline_trials, "keel_kinds": list(mode.keel_kinds),
                        "baseline_kinds_measured": {k: list(v) for k, v in mode.measured.items()},
                        "stratified_fault_offsets": mode.stratified,
                        "step_timeout_floor": mode.floor or "25s (the inspector's default)"},
        "lost_s_keel": lost["keel"],
        "lost_s_torchrun": lost["torchrun"],
        "lost_s_requeue": lost["requeue"],
        "lost_s_torchrun_derived": {"hang": lost_derived["torchrun"]["hang"]},
        "lost_s_requeue_derived": {"hang": lost_derived["requeue"]["hang"]},
        "derived_note": (f"*_derived: a baseline's hang is ended by the {PG_TIMEOUT_S:.0f}s collective timeout, which is not "
                         "waited for: the constant is added to the measured restart, restore and recomputation after the "
                         "hung rank is killed. Not a measurement of detection; kept out of the measured keys and minima."),
        "ratio_vs_torchrun": minimum_ratio(ratios["torchrun"]),
        "ratio_vs_requeue": minimum_ratio(ratios["requeue"]),
        "ratios_by_kind": ratios,
        "ratios_by_kind_derived": ratios_derived,
        "target_ratio": TARGET_RATIO,
        "phases_s": phases,
        "trials": {system: {kind: sum(1 for t in trials[system] if t["kind"] == kind and "derived_from" not in t)
                            for kind in KINDS} for system in SYSTEMS},
        "mtbf_s": MTBF_S,
        "pg_timeout_s": PG_TIMEOUT_S,
        "topology": {"job": f"{mode.nodes} nodes x {NPROC} ranks, keel.workload.train {' '.join(TRAIN)}",
                     "keel": "local cluster: one agent per node + 1 warm standby; controller, checkpoint broker, "
                             "actuator as processes",
                     "baselines": f"{mode.nodes} torchrun launchers (one per simulated node, c10d rendezvous on "
                                  "127.0.0.1)"},
        "skipped": skipped_parts(mode, runs),
        "failures": failures,
        "wall_s": round(wall_s, 1),
    }
    # ``what_if_save_cost`` (ratios modelled for a persistent save cost of 1 / 10 / 60 s) is gone: it grew
    # only the baselines' recomputation. A larger save cost means a larger state or slower storage, and
    # then Keel's every-step memory snapshot, its peer backups and its restore grow too; modelling one
    # side only overstated the ratios. A larger state is for bench.checkpoint to measure, both sides.
    if single is not None:
        result.update(packing_correction(result, single))
    if calibration is not None and young_n is not None:
        result.update({"save_cost_s": round(calibration["save_cost_s"], 4), "step_time_s": round(calibration["step_time_s"], 4),
                       "persist_every_steps": young_n[0], "persist_every_raw": round(young_n[1], 2),
                       "persist_interval_s": round(young_n[2], 2), "calibration": calibration})
    for system, run in runs.items():
        result[f"{system}_run"] = {k: v for k, v in run.items()}
    return result


def skipped_parts(mode: Mode, runs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """What this run did not measure, and why: a system not run at all, a kind the mode leaves out (saying
    when ``derive_baselines`` derived a figure for it instead), the single-node restarts."""
    out: dict[str, str] = {}
    for system in SYSTEMS:
        run = runs.get(system)
        if run is None:
            out[system] = "not run (not in --systems, or its setup failed: see failures)"
            continue
        kinds = mode.keel_kinds if system == "keel" else mode.measured[system]
        for kind in KINDS:
            if kind in kinds:
                continue
            derived = any(t["kind"] == kind and "derived_from" in t for t in run.get("trials", []))
            out[f"{system} {kind}"] = (f"not run in the {mode.name} run"
                                       + ("; derived instead (see the trial's derived_from and note)" if derived else ""))
    if not mode.single_node:
        out["single_node"] = (f"one node's restart alone is not measured in the {mode.name} run: no packing "
                              "correction (lost_s_corrected_for_packing and its ratios absent)")
    return out


def packing_correction(result: dict[str, Any], single: dict[str, Any]) -> dict[str, Any]:
    """The figures corrected for packing (derived, beside the raw ones): each system's raw lost time less
    what its restart cost over the same restart of one node alone (``keel_single_node``,
    ``baseline_single_node``)."""
    alone = {system: single.get(system, {}).get("restart_s") for system in SYSTEMS}
    packed = {system: {kind: restart_cost_s(result["phases_s"][system].get(kind)) for kind in KINDS} for system in SYSTEMS}
    corrected: dict[str, dict[str, float | None]] = {}
    for system in SYSTEMS:
        raw = dict(result[f"lost_s_{system}"])
        if system != "keel":
            raw["hang"] = None  # the baselines' hang is derived: corrected below, apart
        corrected[system] = {kind: packing_corrected_s(raw[kind], packed[system][kind],
                                                       single_node_reference_s(system, kind, alone)) for kind in KINDS}
    corrected_derived = {peer: {"hang": packing_corrected_s(result[f"lost_s_{peer}_derived"]["hang"], packed[peer]["hang"],
                                                            single_node_reference_s(peer, "hang", alone))}
                         for peer in ("torchrun", "requeue")}
    ratios = {peer: {kind: lost_ratio(corrected[peer][kind], corrected["keel"][kind]) for kind in KINDS}
              for peer in ("torchrun", "requeue")}
    return {
        "single_node_restart_s": alone,
        "packed_restart_s": packed,
        "lost_s_corrected_for_packing": corrected,
        "lost_s_corrected_for_packing_derived": corrected_derived,
        "ratio_vs_torchrun_corrected_for_packing": minimum_ratio(ratios["torchrun"]),
        "ratio_vs_requeue_corrected_for_packing": minimum_ratio(ratios["requeue"]),
        "ratios_by_kind_corrected_for_packing": ratios,
        "single_node": single,
        "corrected_note": ("derived, not measured as such: corrected = raw - (packed restart - single-node restart), per "
                           "system and kind; restart = restart + setup_and_restore phases; the single-node restart is the "
                           "same system's restart of a 1-node job (2 ranks) alone on this host, standing for nodes that "
                           "restart in parallel on CPUs of their own"),
    }


def fmt(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}s" if value < 100 else f"{value:.0f}s"


def print_table(result: dict[str, Any]) -> None:
    print()
    if "save_cost_s" in result:
        print(f"persistent checkpoint: C = {result['save_cost_s'] * 1e3:.1f} ms (slowest rank's synchronous save, median), "
              f"step {result['step_time_s'] * 1e3:.0f} ms, MTBF {result['mtbf_s'] / 3600:g} h -> Young: every "
              f"N = {result['persist_every_steps']} steps ({result['persist_interval_s']:.1f} s)")
    print(f"time lost per incident, mean over trials ({result['mode']} run; fault -> back at the step it hit)")
    header = f"{'kind':<10} {'keel':>9} {'torchrun':>10} {'requeue':>10} {'vs torchrun':>12} {'vs requeue':>11}  trials k/t/r"
    print(header)
    print("-" * len(header))
    def row(kind: str, lost: dict[str, dict[str, float | None]], r: dict[str, dict[str, float | None]],
            suffix: str = "") -> str:
        def x(v: float | None) -> str:
            return f"{v}x" if v else "—"

        n = result["trials"]
        return (f"{kind + suffix:<10} {fmt(lost['keel'][kind]):>9} {fmt(lost['torchrun'][kind]):>10} "
                f"{fmt(lost['requeue'][kind]):>10} {x(r['torchrun'][kind]):>12} {x(r['requeue'][kind]):>11}  "
                f"{n['keel'][kind]}/{n['torchrun'][kind]}/{n['requeue'][kind]}")

    raw = {system: result[f"lost_s_{system}"] for system in SYSTEMS}
    for kind in KINDS:
        print(row(kind, raw, result["ratios_by_kind"]))
    derived_hang = {"keel": raw["keel"], **{p: result[f"lost_s_{p}_derived"] for p in ("torchrun", "requeue")}}
    print(row("hang", derived_hang, {**result["ratios_by_kind_derived"]}, "*") + "   (* derived: the baselines' "
          f"{PG_TIMEOUT_S:.0f}s collective timeout added, not measured)")
    if "lost_s_corrected_for_packing" in result:
        print("corrected for packing (derived: raw - (packed restart - one node's restart alone); one node's restart "
              "alone: " + ", ".join(f"{k} {fmt(v)}" for k, v in result["single_node_restart_s"].items()) + ")")
        corrected = result["lost_s_corrected_for_packing"]
        for kind in KINDS:
            print(row(kind, corrected, result["ratios_by_kind_corrected_for_packing"]))
        print(f"ratio (minimum over kinds) corrected for packing: vs torchrun "
              f"{result['ratio_vs_torchrun_corrected_for_packing']}x, vs requeue "
              f"{result['ratio_vs_requeue_corrected_for_packing']}x; baselines' hang corrected (derived): "
              + ", ".join(f"{p} {fmt(v['hang'])}" for p, v in result["lost_s_corrected_for_packing_derived"].items()))
    not_run = [k for k, why in result["skipped"].items() if "derived" not in why]
    if not_run:
        print(f"not run in this ({result['mode']}) run: {', '.join(not_run)}")
    derived = [f"{system} {kind}" for system in SYSTEMS for kind in KINDS
               if result["trials"][system][kind] == 0 and (result[f"lost_s_{system}"][kind] is not None
                                                           or result.get(f"lost_s_{system}_derived", {}).get(kind))]
    if derived:
        print(f"derived, not run in this ({result['mode']}) run: {', '.join(derived)} (see the trials' notes in the JSON)")
    for peer in ("torchrun", "requeue"):
        ratio = result[f"ratio_vs_{peer}"]
        verdict = "—" if ratio is None else ("met" if ratio >= TARGET_RATIO else "NOT MET")
        print(f"ratio vs {peer} (minimum over measured kinds): {ratio if ratio is not None else '—'}x; target >= "
              f"{TARGET_RATIO:g}x: {verdict}")
    for system in SYSTEMS:
        phases = result["phases_s"][system]
        if any(phases.values()):
            print(f"{system} phases (mean s): " + "; ".join(
                f"{kind} " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()) for kind, p in phases.items() if p))
    print(f"hangs under torchrun/requeue: the {PG_TIMEOUT_S:.0f}s collective timeout (gloo --pg-timeout of the workload; "
          f"NCCL's default is 600s) is not waited for: it is added to the measured restart, restore and recompute")
    if result["failures"]:
        print("FAILED trials:")
        for failure in result["failures"]:
            print(f"  {failure}")
    print(f"wall time {result['wall_s']:.0f}s")


NETNS_TARGET_RATIO = 1.5
"""A lost node on separate hosts (a link cut) may cost at most this much more than on the flat cluster."""


def keel_runs(mode: Mode, hosts: list[str], work: Path, failures: list[str]) -> dict[str, dict[str, Any]]:
    """Keel's trials on each cluster of ``hosts``, one after the other, against one set of servers. With
    ``netns`` the bench makes a host network first (``keel.cluster.netns``, removed at the end) and its NATS
    listens on the bridge's address, which the flat cluster (on this host) reaches as well."""
    from keel.cluster import netns

    network = None
    if "netns" in hosts:
        reason = netns.unavailable_reason()
        if reason:
            raise SystemExit(f"bench.recovery: --hosts netns: {reason}")
        netns.destroy_stale()
        network = netns.create(owner_pid=os.getpid())
        log(f"host network {network.tag}: bridge {network.bridge}, control plane on {network.gateway}")
    servers = Servers(log=log, prefix="keel-bench-recovery-servers-",
                      nats_host=network.gateway if network is not None else "127.0.0.1")
    out: dict[str, dict[str, Any]] = {}
    # On separate hosts the fail-slow rounds convicted healthy nodes, the rendezvous master's included, in
    # the first runs (docs/known-limits.md): that ends the job, and every later trial. Off on both clusters.
    knobs = {"KEEL_ANALYZER__FAILSLOW_INTERVAL": "1h"} if network is not None else {}
    try:
        servers.start()
        for name in hosts:
            out[name] = asyncio.run(keel_run(mode, servers, work / f"keel-{name}", failures,
                                             network if name == "netns" else None, knobs))
        if "flat" in hosts and mode.single_node:
            # One node's restart alone (no other node's processes on the cores), for the packing correction.
            try:
                out["single_node"] = asyncio.run(keel_single_node(mode, servers, work / "keel-single"))
                log(f"keel: one node's restart alone {out['single_node']['restart_s']}s "
                    f"(phases {out['single_node']['trial']['phases_s']})")
            except TrialFailed as exc:
                failures.append(f"keel single node: {exc}")
                log(f"FAILED: keel single node: {exc}")
    finally:
        servers.stop()
        if network is not None:
            netns.destroy(network)
    return out


def host_facts(argv: list[str], module: str) -> dict[str, Any]:
    """Provenance of a results file (``bench._provenance``: commit, date, cores, CPU model, versions, command)
    plus the load average now (the caller records it at the start as well: this machine is shared, and its
    other work distorts every time here)."""
    from bench._provenance import provenance

    return {**provenance(argv, module), "load_average_at_end": os.getloadavg()}


async def keel_single_node(mode: Mode, servers: Servers, work: Path) -> dict[str, Any]:
    """Keel's restart of one node alone: the same stack with a 1-node job (2 ranks, DP 1 x PP 2, + the
    warm standby), one rank crash, restart in place. Its restart phases stand for a node restarting on
    CPUs of its own (``packing_correction``)."""
    stack = KeelStack(servers, work, mode, nodes=1)
    try:
        await stack.start()
        await stack.steady(min_steps=10, timeout_s=300)
        trial = await keel_trial(stack, "crash", 0, 1, 300.0)
    finally:
        await stack.stop()
    return {"job": f"1 node x {NPROC} ranks", "trial": trial, "restart_s": restart_cost_s(trial["phases_s"])}


def baseline_single_node(work: Path, step_time_s: float) -> dict[str, dict[str, Any]]:
    """torchrun's and a requeue's restart of one node alone: a 1-node job (1 launcher, 2 ranks) persisting
    every CALIBRATION_EVERY steps, one rank crash restarted by torchrun, then one requeued (every
    process killed at detection, a fresh launcher). Nothing else of the bench runs meanwhile."""
    chain = Chain("single", work, CALIBRATION_EVERY, max_restarts=3, nodes=1)
    out: dict[str, dict[str, Any]] = {}
    try:
        wait_steady(chain.launch(), 0.0, min_steps=CALIBRATION_EVERY + 1)
        for system in ("torchrun", "requeue"):
            trial = baseline_trial(chain, system, "crash", 0, 1, 240.0, False, step_time_s)
            out[system] = {"job": f"1 node x {NPROC} ranks", "trial": trial, "restart_s": restart_cost_s(trial["phases_s"])}
    finally:
        if chain.group is not None:
            chain.group.kill_all()
    return out


def compare_hosts(flat: dict[str, Any], hosted: dict[str, Any]) -> dict[str, Any]:
    """The same keys for the job on separate hosts, and its lost node against the flat cluster's."""
    by_hosts = {"flat": mean_by_kind(flat.get("trials", [])), "netns": mean_by_kind(hosted.get("trials", []))}
    a, b = by_hosts["flat"]["node-lost"], by_hosts["netns"]["node-lost"]
    ratio = round(b / a, 2) if a and b else None
    phases = {"flat": phase_means(flat.get("trials", [])), "netns": phase_means(hosted.get("trials", []))}
    # Beside the target's ratio: the same without the recomputation, which depends on where the fault
    # fell within the report round (the same rule on both clusters) rather than on how it is detected.
    before = {name: sum(v for k, v in p.get("node-lost", {}).items() if k != "recompute") for name, p in phases.items()}
    return {"lost_s_keel_by_hosts": by_hosts,
            "phases_s_keel_by_hosts": phases,
            "netns_vs_flat_node_lost_without_recompute": (round(before["netns"] / before["flat"], 2)
                                                          if before["flat"] and before["netns"] else None),
            "lost_node_fault_by_hosts": {"flat": "agent and ranks SIGKILLed, shared memory wiped",
                                         "netns": "the host's link cut from the bridge (a partition; processes run on)"},
            "netns_vs_flat_node_lost": ratio, "netns_target_ratio": NETNS_TARGET_RATIO,
            "netns_target_met": ratio is not None and ratio <= NETNS_TARGET_RATIO}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="under 5 min: 1 Keel trial per kind; of the baselines only torchrun's crash and lost node, "
                           "their recomputation corrected to the interval's mean; the other baseline figures derived; "
                           "the inspector's default step-timeout floor (25 s), as in a full run")
    size.add_argument("--smoke", action="store_true",
                      help="under a minute: 2 nodes, one Keel crash and one torchrun crash, no single-node restarts "
                           "(so no packing correction); a check that the bench works, not figures")
    parser.add_argument("--trials", type=int, default=None,
                        help="Keel's trials per fault kind (default: 1 with --quick or --smoke, 3 without)")
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folders (logs, cluster) for inspection")
    parser.add_argument("--systems", default="keel,baselines", help="keel, baselines (torchrun and requeue) or both")
    parser.add_argument("--hosts", default="flat",
                        help="Keel's cluster: flat (every node on this host's loopback), netns (each node a host of its "
                             "own on a bridge, keel.cluster.netns; a lost node is a link cut; needs CAP_NET_ADMIN), or "
                             "flat,netns (both, one after the other, against the same servers)")
    args = parser.parse_args(argv)
    hosts = [h for h in args.hosts.split(",") if h]
    if not hosts or sorted(set(hosts) - {"flat", "netns"}):
        parser.error(f"--hosts takes flat, netns or flat,netns, got {args.hosts!r}")
    mode = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.trials is not None:
        if args.trials < 1:
            parser.error(f"--trials takes a positive count, got {args.trials}")
        mode = replace(mode, keel_trials=args.trials)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - {"keel", "baselines"})
    if unknown:
        parser.error(f"unknown systems {unknown}")
    started = time.monotonic()
    failures: list[str] = []
    runs: dict[str, dict[str, Any]] = {}
    work = scratch_dir("keel-bench-recovery-")
    log(f"recovery benchmark ({mode.name}); scratch {work}")
    calibration = young_n = None
    single: dict[str, Any] = {}
    load_at_start = os.getloadavg()
    try:
        if "keel" in systems:
            by_hosts = keel_runs(mode, hosts, work, failures)
            runs["keel"] = by_hosts["flat" if "flat" in by_hosts else "netns"]
            if "netns" in by_hosts and "flat" in by_hosts:
                runs["keel_netns"] = by_hosts["netns"]
            if "single_node" in by_hosts:
                single["keel"] = by_hosts["single_node"]
        if "baselines" in systems:
            try:
                calibration, cal_chain = calibrate(work, mode.calibration_persists, mode.nodes)
            except TrialFailed as exc:
                failures.append(f"calibration: {exc}")
                log(f"FAILED: calibration: {exc}")
            if calibration is not None:
                young_n = young(calibration["save_cost_s"], calibration["step_time_s"])
                log(f"calibration: save cost C = {calibration['save_cost_s'] * 1e3:.1f} ms (median of "
                    f"{len(calibration['save_costs_s'])}), step {calibration['step_time_s'] * 1e3:.0f} ms; "
                    f"Young with MTBF 3 h: N = {young_n[0]} steps ({young_n[2]:.1f} s)")
                runs.update(baseline_run(mode, work, cal_chain, young_n[0], calibration["step_time_s"], failures))
                if mode.single_node:
                    try:
                        single.update(baseline_single_node(work / "single", calibration["step_time_s"]))
                        log("baselines: one node's restart alone: " + ", ".join(
                            f"{k} {v['restart_s']}s" for k, v in single.items() if k != "keel"))
                    except TrialFailed as exc:
                        failures.append(f"baselines single node: {exc}")
                        log(f"FAILED: baselines single node: {exc}")
    finally:
        if args.keep or failures:
            log(f"kept the scratch folder {work} (logs)")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result = summarise(mode, calibration, young_n, runs, failures, time.monotonic() - started, single or None)
    if "keel" in runs:
        result["hosts"] = runs["keel"]["hosts"]
    if "keel_netns" in runs:
        result.update(compare_hosts(runs["keel"], runs["keel_netns"]))
    result["load_average_at_start"] = load_at_start
    result.update(host_facts(list(argv if argv is not None else sys.argv[1:]), "bench.recovery"))
    print_table(result)
    if "lost_s_keel_by_hosts" in result:
        print(f"keel node-lost, flat (SIGKILL) {fmt(result['lost_s_keel_by_hosts']['flat']['node-lost'])} vs netns "
              f"(link cut) {fmt(result['lost_s_keel_by_hosts']['netns']['node-lost'])}: "
              f"{result['netns_vs_flat_node_lost']}x; target <= {NETNS_TARGET_RATIO}x: "
              f"{'met' if result['netns_target_met'] else 'NOT MET'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    if failures:
        print(f"bench.recovery: {len(failures)} trial(s) did not recover (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

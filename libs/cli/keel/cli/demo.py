"""`keel demo` (behind `make demo`): a real training job on a local cluster, faults injected, recovered.

1. `keel up`: the embedded NATS (JetStream, sync_interval always) and PostgreSQL, migrations, and the
   recorder, controller, checkpoint broker, analyzer and local actuator as background services.
2. A fault-free reference run of the same job (the same 4 ranks under one `keel run`, no checkpoints).
3. A local cluster: 4 nodes x 1 rank of the example GPT (DP 2 x PP 2) plus a warm standby, every-step
   in-memory checkpoints with peer backups and the persistent tier on the broker's schedule.
4. The scripted faults, one per rung built so far, each waited for until the controller has resolved it:
   - rung 1: a fatal GPU XID on a node: evicted, the standby promoted into its rank, the rest restarted in
     place, restored from memory and the peer copy; the actuator refills the pool;
   - rung 2: a crash with no culprit: stop-time diagnostics on every node pass: restart in place;
   - rung 2: a NIC that flapped on one node, then a crash: diagnostics convict that node: evicted, the
     refilled standby promoted;
   - rung 3: a rank hangs inside its pipeline stage: every process's stack is captured with py-spy while
     it hangs, the analyzer finds the outliers and names their pipeline group (two nodes), which is
     evicted for standbys (the actuator provisions the second);
   - hot-update and rung 4: once the launch code is stable, `keel deploy --lazy` registers a new version of
     the training code (with a bug at step 330); nothing restarts for it: it rides on the rung-3 restart,
     in place. Its bug crashes the job, and again after the restart: rung 4 rolls back to the last stable
     version (the launch code), and training goes on from memory;
   - rung 5: a second job, 4 nodes x 1 rank (DP 4) plus a standby, one of whose "GPUs" silently flips a
     gradient bit: the NaN passes stop-time diagnostics, two replay phases locate the node, it is evicted
     and the standby takes its rank; the job resumes from before the corruption and runs to its end;
   - rung 6: a third small job whose bug survives every restart: a crash loop, stopped and paged;
   - with ``--sharding fsdp2|zero2|zero1``: a fourth job with sharded state (``keel.workload.fsdp``, 2 nodes x 1
     rank + a standby): a rank crashes (restored from memory), then a node's GPU fails (evicted, the standby
     restored from the peer copy of its shard); its losses must equal its own fault-free run's, bit for bit.
5. The incidents, each one's timeline, ETTR with lost time by phase, `keel replay --verify`, and the
   main job's final loss against the fault-free run's: they must be equal, bit for bit. The notifier sends
   every notification as a signed webhook to a receiver in this process: every incident of the main job
   must have been announced, every signature must verify.
6. `keel cluster down`, `keel down` (unless --keep).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keel.cli.common import Subparsers, endpoints
from keel.cluster.local import FaultSpec, cluster_dir, cluster_down, cluster_up, inject, load_cluster
from keel.events.envelope import Event, payload_of
from keel.events.types import (
    CheckpointRestorePlanned,
    CheckpointStepCommitted,
    CodeVersionApplied,
    CodeVersionStable,
    IncidentOpened,
    IncidentResolved,
    JobStopDecided,
    NodeHeartbeat,
    RankExited,
    RollbackDecided,
    SdcReplayAnalyzed,
    StacksAnalyzed,
    StandbyChecked,
)
from keel.infra.config import Settings
from keel.infra.dburl import redact

if TYPE_CHECKING:
    # Imported where the demo runs: every `keel` command imports this module to build its parser, and
    # the store (SQLAlchemy) is most of a second of start-up.
    from keel.infra.store import EventStore
    from keel.notifier.receiver import WebhookReceiver

# A job id of its own per run: the log keeps every earlier run's jobs (and their final state), and a
# rerun under a reused id would be decided on top of them.
_RUN = time.strftime("%Y%m%d-%H%M%S")
JOB = f"demo-{_RUN}"
LOOP_JOB = f"demo-loop-{_RUN}"
SDC_JOB = f"demo-sdc-{_RUN}"
SDC_STEPS = 90
SHARDED_JOB = f"demo-sharded-{_RUN}"
SHARDED_STEPS = 300


def sharded_command(sharding: str) -> list[str]:
    return ["-m", "keel.workload.fsdp", "--steps", str(SHARDED_STEPS), "--batch", "4", "--seed", "3",
            "--min-step-time", "100ms", "--sharding", sharding]
# Steps take 100 ms and a warm restart under a second, so the job runs ahead while the demo waits (for
# a refilled standby, say): faults are spaced by ~30 steps and the bug comes well after the last of them.
STEPS = 400
BUG_STEP = 330
TRAIN = ["-m", "keel.workload.train", "--size", "tiny", "--pp", "2", "--steps", str(STEPS), "--min-step-time", "100ms"]
# A version of the training code (``keel deploy``): the example workload with the version's change - a bug
# at one step - expressed as its own arguments, as a real change would be expressed in its code.
BAD_VERSION = """\
import runpy
import sys

sys.argv += ["--bug-at-step", "{bug}", "--bug-rank", "-1"]
runpy.run_module("keel.workload.train", run_name="__main__", alter_sys=True)
"""
STACK_ENV = {
    # Demo-sized knobs: a standby always kept ready, quick heartbeats, short diagnostics.
    "KEEL_CONTROLLER__STANDBY_MIN": "1",
    # Four evictions in an hour (an XID, a flapped NIC, a hung pipeline of two nodes) are all of this
    # 4-node job: the breaker's default 10 % would (rightly, for a real fleet) stop the second and page.
    "KEEL_CONTROLLER__MAX_EVICTION_FRACTION": "1.0",
    "KEEL_CONTROLLER__DIAGNOSTICS_TIMEOUT": "45s",
    "KEEL_CONTROLLER__NODE_SILENCE_TIMEOUT": "20s",
    "KEEL_CHECKPOINT__PERSIST_EVERY_FLOOR": "20",
    # A version is stable after 8 s without an incident it could have caused (production: 30 min).
    "KEEL_HOT_UPDATE__STABLE_TIME": "8s",
}
_STEP = re.compile(r"^step (\d+) loss \S+ .*loss_hex (\S+)", re.M)


def _keel(config: str | None, *args: str, env: dict[str, str] | None = None, check: bool = True,
          timeout: float = 180) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "keel.cli.main"]
    if config:
        command += ["--config", config]
    return subprocess.run([*command, *args], text=True, capture_output=True, check=check, timeout=timeout,
                          env=env)


def _banner(text: str) -> None:
    print(f"\n== {text} " + "=" * max(0, 74 - len(text)), flush=True)


def _say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')}  {text}", flush=True)


def _losses(directory: Path) -> dict[int, str]:
    """Step -> exact loss (float.hex) from every rank-0 log of the cluster, later generations winning."""
    files = sorted(directory.glob("nodes/*/logs/rank0.g*.stdout"),
                   key=lambda p: int(p.name.split(".g")[1].split(".")[0]))
    losses: dict[int, str] = {}
    for path in files:
        for step, value in _STEP.findall(path.read_text(errors="replace")):
            losses[int(step)] = value
    return losses


class Demo:
    def __init__(self, settings: Settings, store: EventStore, nats_url: str, directory: Path, scratch: Path) -> None:
        self.settings, self.store, self.nats_url, self.directory, self.scratch = settings, store, nats_url, directory, scratch

    async def events(self, job: str, types: list[str] | None = None) -> list[Event]:
        return [r.event async for r in self.store.read(job_id=job, types=types)]

    async def wait_for(self, job: str, types: list[str], predicate: Callable[[Event], bool], timeout_s: float,
                       what: str) -> Event:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in await self.events(job, types):
                if predicate(event):
                    return event
            await asyncio.sleep(0.3)
        raise DemoError(f"no {what} within {timeout_s:.0f} s")

    async def wait_step(self, step: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while max(_losses(self.directory), default=-1) < step:
            if time.monotonic() > deadline:
                raise DemoError(f"training did not reach step {step} within {timeout_s:.0f} s")
            await asyncio.sleep(0.3)

    def node_of_rank(self, rank: int, directory: Path | None = None) -> str:
        """The node running ``rank`` now (of the main cluster, or the one in ``directory``): the one with its
        newest generation's log (ranks move when a standby takes over a node's place)."""
        newest: dict[str, int] = {}
        for node in load_cluster(directory or self.directory)["nodes"]:
            if node.get("evicted"):
                continue
            generations = [int(p.name.split(".g")[1].split(".")[0])
                           for p in Path(node["agent_dir"]).glob(f"logs/rank{rank}.g*.stdout")]
            if generations:
                newest[node["node_id"]] = max(generations)
        if not newest:
            raise DemoError(f"no node runs rank {rank}")
        return max(newest, key=lambda n: newest[n])

    async def peer_backup(self, job: str, timeout_s: float = 120) -> int:
        """Wait for a peer-tier commit of the job's current generation (newer than its newest restore plan): the
        step a lost node's ranks can be restored from. Before it, a lost node means the persistent tier or a
        fresh start (the survivors' memory holds only their newest steps)."""
        plans = [payload_of(e, CheckpointRestorePlanned) for e in await self.events(job, ["CheckpointRestorePlanned"])]
        floor = max((p.step for p in plans), default=-1)
        commit = await self.wait_for(job, ["CheckpointStepCommitted"],
                                     lambda e: (c := payload_of(e, CheckpointStepCommitted)).tier == "peer"
                                     and c.step > floor, timeout_s, "a peer-tier commit of this generation")
        return payload_of(commit, CheckpointStepCommitted).step

    async def restored_from(self, job: str) -> tuple[int, list[str]]:
        """The newest restore plan's step and the tiers it reads (-1 and []: a fresh start)."""
        plans = [payload_of(e, CheckpointRestorePlanned) for e in await self.events(job, ["CheckpointRestorePlanned"])]
        if not plans:
            return -1, []
        newest = max(plans, key=lambda p: p.generation)
        return newest.step, sorted(tier for tier, ranks in newest.tiers.items() if ranks)

    async def incident_after(self, job: str, position_ids: set[str], timeout_s: float = 240) -> tuple[Event, Event]:
        """The first incident opened that is not in ``position_ids``, and its resolution."""
        opened = await self.wait_for(job, ["IncidentOpened"], lambda e: str(e.id) not in position_ids, 90,
                                     "incident opened by the controller")
        resolved = await self.wait_for(job, ["IncidentResolved"],
                                       lambda e: payload_of(e, IncidentResolved).incident_id == str(opened.id),
                                       timeout_s, f"resolution of incident {str(opened.id)[:8]}")
        return opened, resolved

    async def fault(self, job: str, label: str, faults: list[FaultSpec], *, directory: Path | None = None,
                    during: Callable[[], Any] | None = None) -> tuple[Event, Event]:
        seen = {str(e.id) for e in await self.events(job, ["IncidentOpened"])}
        for line in await asyncio.to_thread(inject, self.settings, directory or self.directory, faults, self.nats_url):
            _say(f"inject   {line}")
        if during is not None:
            await during()
        opened, resolved = await self.incident_after(job, seen)
        lost = (resolved.occurred_at - opened.occurred_at).total_seconds()
        resolution = payload_of(resolved, IncidentResolved)
        _say(f"{label}: incident {str(opened.id)[:8]} ({payload_of(opened, IncidentOpened).kind}) {resolution.outcome} "
             f"at rung {resolution.rung} after {lost:.1f} s - {resolution.reason}")
        return opened, resolved


class DemoError(RuntimeError):
    pass


def _reference_run(directory: Path, command: list[str] = TRAIN, ranks: int = 4) -> dict[int, str]:
    """The fault-free run: the same ranks under one `keel run` (no cluster, no checkpoints). Its
    per-step losses, exact."""
    env = {**os.environ, "KEEL_HOME": str(directory)}
    env.pop("KEEL_NATS_URL", None)
    result = subprocess.run(
        [sys.executable, "-m", "keel.cli.main", "run", "--standalone", "--nproc-per-node", str(ranks),
         "--keel-agent-dir", str(directory / "agent"), "--keel-no-checkpoint",
         *command], env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise DemoError(f"the reference run failed: {result.stderr[-2000:]}")
    losses: dict[int, str] = {}
    for path in (directory / "agent" / "logs").glob("rank0.g*.stdout"):
        losses.update({int(step): value for step, value in _STEP.findall(path.read_text())})
    return losses


async def _sharded_job(demo: Demo, settings: Settings, nats_url: str, env: dict[str, str], network: Any,
                       sharding: str) -> dict[str, Any]:
    """The ``--sharding`` job: a rank crash and a lost node, each restored with the job's sharded state."""
    _banner(f"sharded state ({sharding}): a fourth job, 2 nodes x 1 rank + a standby, `keel.workload.fsdp`")
    directory = demo.scratch / "sharded-cluster"
    command = sharded_command(sharding)
    reference = asyncio.create_task(asyncio.to_thread(_reference_run, demo.scratch / "sharded-reference", command, 2))
    cluster_up(settings, directory, nodes=2, standby=1, nproc_per_node=1, job_id=SHARDED_JOB, command=command,
               nats_url=nats_url, extra_env=env, heartbeat_interval="2s",
               persist_root=demo.scratch / "sharded-checkpoints", fault_injection=True, network=network)
    await demo.wait_for(SHARDED_JOB, ["StandbyChecked"], lambda e: payload_of(e, StandbyChecked).passed, 120,
                        "the standby's self-check")
    incidents = []
    faults: list[tuple[str, int, Callable[[], FaultSpec]]] = [
        ("rank 1 crashes: restored from its node's memory", 20,
         lambda: FaultSpec(kind="crash", node=demo.node_of_rank(1, directory), rank=1)),
        ("rank 0's GPU fails (XID 79): the node is evicted, the standby restores its shard from the peer copy", 60,
         lambda: FaultSpec(kind="xid", node=demo.node_of_rank(0, directory), params={"xid": 79}))]
    restores = []
    for label, at_step, fault in faults:
        def past(event: Event, step: int = at_step) -> bool:
            return payload_of(event, NodeHeartbeat).last_step >= step

        await demo.wait_for(SHARDED_JOB, ["NodeHeartbeat"], past, 180, f"step {at_step}")
        if fault().kind == "xid":
            _say(f"the peer tier holds step {await demo.peer_backup(SHARDED_JOB)} of every rank")
        _say(label)
        incidents.append(await demo.fault(SHARDED_JOB, f"sharded ({sharding})", [fault()], directory=directory))
        restores.append(await demo.restored_from(SHARDED_JOB))
        _say(f"restored after step {restores[-1][0]} from {', '.join(restores[-1][1]) or 'nothing: a fresh start'}")
    await demo.wait_for(SHARDED_JOB, ["RankExited"],
                        lambda e: (x := payload_of(e, RankExited)).classification == "success" and x.rank == 0,
                        300, "the end of the sharded job")
    losses = _losses(directory)
    cluster_down(directory)
    return {"incidents": incidents, "losses": losses, "reference": await reference, "restores": restores}


async def _drive(settings: Settings, nats_url: str, database_url: str, scratch: Path,
                 sharding: str | None = None) -> dict[str, Any]:
    from keel.cluster.local import home_network
    from keel.infra.store import EventStore, create_engine

    network = home_network(settings.home)  # `keel demo --hosts netns`: every node a host of its own

    engine = create_engine(database_url, settings.db_schema)
    store = EventStore(engine)
    directory = cluster_dir(settings)
    demo = Demo(settings, store, nats_url, directory, scratch)
    env = {k: v for k, v in os.environ.items() if k.startswith("KEEL_")} | STACK_ENV
    env["KEEL_NATS_URL"] = nats_url  # the agents read no database: no credentials for them
    env["KEEL_INSPECTOR__STEP_TIMEOUT_FLOOR"] = "60s"
    results: dict[str, Any] = {"incidents": []}
    try:
        _banner("a fault-free reference run of the same job (in the background)")
        reference = asyncio.create_task(asyncio.to_thread(_reference_run, scratch / "reference"))
        _banner("local cluster: 4 nodes x 1 rank (DP 2 x PP 2) + 1 warm standby, job 'demo'")
        cluster_up(settings, directory, nodes=4, standby=1, nproc_per_node=1, job_id=JOB,
                   command=TRAIN, nats_url=nats_url,
                   extra_env=env, heartbeat_interval="2s", persist_root=scratch / "checkpoints",
                   # the demo injects crashes and a hang: `keel cluster up --fault-injection`
                   fault_injection=True, network=network)
        await demo.wait_for(JOB, ["StandbyChecked"], lambda e: payload_of(e, StandbyChecked).passed, 120,
                            "a standby's passing self-check")
        await demo.wait_step(15)
        _say("training: step 15 reached")

        _banner("rung 1: a fatal GPU XID")
        node = demo.node_of_rank(1)
        results["incidents"].append(await demo.fault(JOB, "rung 1", [FaultSpec(kind="xid", node=node,
                                                                               params={"xid": 79})]))
        results["restores"] = {"rung 1": await demo.restored_from(JOB)}
        await demo.wait_for(JOB, ["StandbyChecked"],
                            lambda e: (c := payload_of(e, StandbyChecked)).passed and c.node_id != "s00", 120,
                            "the refilled standby's passing self-check")
        await demo.wait_step(120)

        _banner("rung 2: a crash that names no culprit: diagnostics pass")
        results["incidents"].append(await demo.fault(JOB, "rung 2", [FaultSpec(kind="crash", node=demo.node_of_rank(2),
                                                                               rank=2)]))
        await demo.wait_step(150)

        _banner("rung 2: a NIC flapped on one node, then a crash: diagnostics convict it")
        flaky = demo.node_of_rank(3)
        results["incidents"].append(await demo.fault(JOB, "rung 2", [
            FaultSpec(kind="nic-down", node=flaky, params={"flaps": 2}),
            FaultSpec(kind="crash", node=demo.node_of_rank(0), rank=0)]))
        await demo.wait_step(180)

        _banner(f"hot-update: keel deploy --lazy a new version of the training code (it has a bug at step {BUG_STEP})")
        stable = await demo.wait_for(JOB, ["CodeVersionStable"],
                                     lambda e: payload_of(e, CodeVersionStable).version_id == "launch", 120,
                                     "the launch code to become stable")
        _say(f"stable: {payload_of(stable, CodeVersionStable).reason}")
        version_dir = scratch / "version-new-data-mix"
        version_dir.mkdir(parents=True, exist_ok=True)
        (version_dir / "train.py").write_text(BAD_VERSION.format(bug=BUG_STEP))
        deployed = _keel(None, "deploy", str(version_dir), "--job", JOB, "--lazy",
                         "--why", "new data mix", env={**os.environ, **env}, check=False)
        if deployed.returncode != 0:
            raise DemoError(f"keel deploy failed: {deployed.stderr[-2000:]}")
        _say(deployed.stdout.strip().splitlines()[-1] if deployed.stdout.strip() else "deployed")
        _say("lazy: nothing restarts for it; the next restart of any cause applies it")

        # Rank 1's pipeline group holds rank 0: on separate hosts (--hosts netns) the ranks' rendezvous
        # (MASTER_ADDR) moves with it to the standby's host.
        _banner("rung 3: rank 1 hangs in its pipeline stage: stacks name its pipeline group")
        results["incidents"].append(await demo.fault(JOB, "rung 3", [FaultSpec(kind="hang", node=demo.node_of_rank(1),
                                                                               rank=1)]))
        results["restores"]["rung 3"] = await demo.restored_from(JOB)
        verdict = payload_of((await demo.events(JOB, ["StacksAnalyzed"]))[-1], StacksAnalyzed)
        _say(f"the analyzer: outliers rank(s) {verdict.outlier_ranks}, evict the {verdict.group_kind} group "
             f"{verdict.group_ranks} on {', '.join(verdict.group_nodes)}")
        await demo.wait_step(BUG_STEP - 5)

        applied = [payload_of(e, CodeVersionApplied) for e in await demo.events(JOB, ["CodeVersionApplied"])]
        _say(f"the rung-3 restart carried the new version: {len(applied)} node(s) run "
             f"{', '.join(sorted({a.version_id for a in applied})) or 'nothing new'}")

        _banner(f"rung 4: the new version's bug at step {BUG_STEP} crashes the job, and again after the restart")
        seen = {str(e.id) for e in await demo.events(JOB, ["IncidentOpened"])}
        first, first_done = await demo.incident_after(JOB, seen)
        first_resolution = payload_of(first_done, IncidentResolved)
        _say(f"first crash: incident {str(first.id)[:8]} {first_resolution.outcome} at rung {first_resolution.rung}")
        results["incidents"].append((first, first_done))
        second, second_done = await demo.incident_after(JOB, seen | {str(first.id)})
        second_resolution = payload_of(second_done, IncidentResolved)
        _say(f"second crash: incident {str(second.id)[:8]} {second_resolution.outcome} at rung {second_resolution.rung}"
             f" - {second_resolution.reason[:200]}")
        results["incidents"].append((second, second_done))
        rollback = payload_of((await demo.events(JOB, ["RollbackDecided"]))[-1], RollbackDecided)
        results["rollback"] = (rollback.to_version, [a.version_id for a in applied])

        _banner("the job runs to its last step")
        await demo.wait_for(JOB, ["RankExited"],
                            lambda e: (x := payload_of(e, RankExited)).classification == "success" and x.rank == 0,
                            300, "the end of training")
        results["losses"] = _losses(directory)
        cluster_down(directory)

        _banner("rung 5: a second job (DP 4 on 4 nodes + a standby); one node's GPU silently flips a gradient bit")
        sdc_dir = scratch / "sdc-cluster"
        cluster_up(settings, sdc_dir, nodes=4, standby=1, nproc_per_node=1, job_id=SDC_JOB,
                   command=["-m", "keel.workload.train", "--size", "tiny", "--steps", str(SDC_STEPS),
                            "--min-step-time", "100ms"],
                   nats_url=nats_url, extra_env=env, heartbeat_interval="2s", persist_root=scratch / "sdc-checkpoints",
                   fault_injection=True, network=network)
        await demo.wait_for(SDC_JOB, ["StandbyChecked"], lambda e: payload_of(e, StandbyChecked).passed, 120,
                            "the standby's self-check")
        await demo.wait_for(SDC_JOB, ["NodeHeartbeat"], lambda e: payload_of(e, NodeHeartbeat).last_step >= 20, 180,
                            "step 20")
        culprit = demo.node_of_rank(2, sdc_dir)
        results["sdc"] = await demo.fault(SDC_JOB, "rung 5", [FaultSpec(kind="sdc", node=culprit, params={"bit": 30})],
                                          directory=sdc_dir)
        located = payload_of((await demo.events(SDC_JOB, ["SdcReplayAnalyzed"]))[-1], SdcReplayAnalyzed)
        results["sdc_located"] = (culprit, located.nodes, located.kind, located.rounds)
        _say(f"the analyzer: {located.kind} {', '.join(located.nodes) or 'nothing'} in {located.rounds} replay "
             f"phase(s) (the bit flips on {culprit}): {located.reason[:160]}")
        await demo.wait_for(SDC_JOB, ["RankExited"], lambda e: payload_of(e, RankExited).classification == "success",
                            300, "the end of the second job")
        cluster_down(sdc_dir)

        _banner("rung 6: a third job whose bug survives every restart")
        loop_dir = scratch / "loop-cluster"
        loop_bug = scratch / "loop-bug"
        loop_bug.write_text("never fixed\n")
        cluster_up(settings, loop_dir, nodes=2, standby=0, nproc_per_node=1, job_id=LOOP_JOB,
                   command=["-m", "keel.workload.train", "--size", "tiny", "--steps", "60", "--min-step-time", "100ms",
                            "--bug-at-step", "8", "--bug-rank", "-1", "--bug-file", str(loop_bug)],
                   nats_url=nats_url, extra_env=env, heartbeat_interval="2s", persist_root=scratch / "loop-checkpoints",
                   network=network)
        stop = await demo.wait_for(LOOP_JOB, ["JobStopDecided"], lambda e: True, 300, "the crash-loop stop")
        stopped = payload_of(stop, JobStopDecided)
        _say(f"rung {stopped.rung}: {stopped.reason}")
        cluster_down(loop_dir)
        if sharding is not None:
            results["sharded"] = await _sharded_job(demo, settings, nats_url, env, network, sharding)
        results["reference"] = await reference
        return results
    finally:
        cluster_down(directory)
        await engine.dispose()


def register(sub: Subparsers) -> None:
    demo = sub.add_parser("demo", help="run the end-to-end demonstration")
    demo.add_argument("--keep", action="store_true", help="leave the stack running afterwards")
    demo.add_argument("--hosts", choices=("flat", "netns"), default="flat",
                      help="netns: every node a host of its own and NATS on three more (`keel up --hosts netns`; "
                           "needs root / CAP_NET_ADMIN); flat: one loopback (default)")
    demo.add_argument("--sharding", choices=("fsdp2", "zero2", "zero1"), default=None,
                      help="also run a job with sharded state (keel.workload.fsdp): FSDP2, ZeRO-2 or ZeRO-1 on gloo, "
                           "a rank crash and a lost node, resumed bitwise")
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    return run_demo(settings, config=args.config, keep=args.keep, hosts=args.hosts, sharding=args.sharding)


def _notifier_env(scratch: Path, inbox: WebhookReceiver) -> dict[str, str]:
    """The demo's notifier destination: the local inbox, every severity, its secret in a private file."""
    secret_file = scratch / "webhook.secret"
    secret_file.write_text(inbox.secret)
    secret_file.chmod(0o600)
    return {"KEEL_NOTIFIER__DESTINATIONS": json.dumps([{"name": "demo-inbox", "kind": "webhook", "url": inbox.url,
                                                        "secret_file": str(secret_file), "min_severity": "info"}])}


def _api_check(config: str | None, env: dict[str, str], driven: set[str]) -> tuple[bool, str]:
    """Ask the API ``keel up`` started for the main job's incidents, with the local operator token, as a user
    would (the URL and the token's file from ``keel status``): it must list every incident the demo drove."""
    import urllib.request

    status = json.loads(_keel(config, "status", env=env).stdout)
    api = status.get("api") or {}
    if not api.get("url"):
        return False, f"API: not running ({status.get('services', {}).get('api')})"
    token = Path(api["token_file"]).read_text().strip()
    request = urllib.request.Request(f"{api['url']}/v1/incidents?job={JOB}",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            served = {str(i["id"]) for i in json.loads(response.read())["incidents"]}
    except OSError as exc:
        return False, f"API: {api['url']} did not answer: {exc}"
    return driven <= served, (f"API: {api['url']}/v1/incidents?job={JOB} served {len(served)} incident(s), "
                              f"{len(driven & served)} of the {len(driven)} driven; the page: {api['url']}/?job={JOB} "
                              f"(its token is in {api['token_file']}; `make demo DEMO_ARGS=--keep` leaves the stack "
                              f"up to browse)")


def run_demo(settings: Settings, config: str | None = None, keep: bool = False, hosts: str = "flat",
             sharding: str | None = None) -> int:
    import base64
    import secrets

    from keel.notifier.receiver import WebhookReceiver

    inbox = WebhookReceiver("whsec_" + base64.b64encode(secrets.token_bytes(32)).decode())
    try:
        return _run_demo(settings, inbox, config=config, keep=keep, hosts=hosts, sharding=sharding)
    finally:
        inbox.close()


def _run_demo(settings: Settings, inbox: WebhookReceiver, config: str | None = None, keep: bool = False,
              hosts: str = "flat", sharding: str | None = None) -> int:
    notifier_home = settings.home / "demo-notifier"
    notifier_home.mkdir(parents=True, exist_ok=True)
    notifier_home.chmod(0o700)
    env = {**os.environ, **STACK_ENV, **_notifier_env(notifier_home, inbox),
           "KEEL_HOME": str(settings.home)}  # the children use this one's home
    _banner("keel up: embedded NATS JetStream + PostgreSQL; recorder, controller, checkpoint broker, analyzer, actuator")
    up = _keel(config, "up", "--hosts", hosts, env=env, check=False)
    if up.returncode != 0:
        print(up.stderr, file=sys.stderr)
        return up.returncode
    nats_url, database_url = endpoints(settings)
    print(f"NATS {nats_url}   PostgreSQL {redact(database_url)}   home {settings.home}")
    scratch = settings.home / "demo"
    subprocess.run(["rm", "-rf", str(scratch)], check=False)
    scratch.mkdir(parents=True, exist_ok=True)
    ok = False
    try:
        try:
            result = asyncio.run(_drive(settings, nats_url, database_url, scratch, sharding))
        except DemoError as exc:
            print(f"\nDEMO FAILED: {exc}", flush=True)
            return 1
        _banner("keel incidents")
        print(_keel(config, "incidents", "--job", JOB, env=env).stdout.rstrip())
        print(_keel(config, "incidents", "--job", SDC_JOB, env=env).stdout.rstrip())
        print(_keel(config, "incidents", "--job", LOOP_JOB, env=env).stdout.rstrip())
        for opened, _ in result["incidents"]:
            _banner(f"keel timeline {str(opened.id)[:8]}")
            print(_keel(config, "timeline", str(opened.id), "--job", JOB, env=env).stdout.rstrip())
        sdc_opened, sdc_resolved = result["sdc"]
        _banner(f"keel timeline {str(sdc_opened.id)[:8]} (rung 5, job {SDC_JOB})")
        print(_keel(config, "timeline", str(sdc_opened.id), "--job", SDC_JOB, env=env).stdout.rstrip())
        _banner(f"keel versions --job {JOB}")
        print(_keel(config, "versions", "--job", JOB, env=env).stdout.rstrip())
        _banner(f"keel ettr --job {JOB}")
        print(_keel(config, "ettr", "--job", JOB, env=env).stdout.rstrip())
        # This run's jobs: the log may also hold earlier runs', decided by an older build of the deciders.
        _banner(f"keel replay --verify --job {JOB} / {SDC_JOB} / {LOOP_JOB}")
        replays = [_keel(config, "replay", "--verify", "--job", job, env=env, check=False, timeout=600)
                   for job in (JOB, SDC_JOB, LOOP_JOB)]
        for run in replays:
            print(run.stdout.strip())
        replay = next((r for r in replays if r.returncode != 0), replays[0])
        losses, reference = result["losses"], result["reference"]
        last = STEPS - 1
        final, expected = losses.get(last, "none"), reference.get(last, "none")
        same = losses == reference and last in losses
        covered = sorted(losses) == list(range(STEPS))
        rungs = sorted({resolved.payload.rung for _, resolved in result["incidents"]})
        _banner("result")
        print(f"final loss (step {last}): {float.fromhex(final) if final != 'none' else final} with faults, "
              f"{float.fromhex(expected) if expected != 'none' else expected} fault-free: "
              f"{'bitwise the same' if final == expected else 'DIFFERENT'}; every step's loss equal to the "
              f"fault-free run's: {same} ({len(losses)} steps)")
        culprit, evicted, kind, phases = result["sdc_located"]
        sdc_ok = kind == "found" and evicted == [culprit] and sdc_resolved.payload.rung == 5
        rolled_to, applied = result["rollback"]
        rollback_ok = rolled_to == "launch" and bool(applied) and "launch" not in applied
        print(f"hot-update: the new version rode on the rung-3 restart ({len(applied)} node(s)); rung 4 rolled back "
              f"to {rolled_to!r}")
        print(f"rungs exercised in the main job: {rungs}; rung 5 in '{SDC_JOB}': {kind} {evicted} in {phases} replay "
              f"phase(s), the corrupting node was {culprit}; rung 6 in '{LOOP_JOB}'; "
              f"replay: {'clean' if replay.returncode == 0 else 'DIVERGED'}")
        ok = same and covered and replay.returncode == 0 and {1, 2, 3, 4} <= set(rungs) and sdc_ok and rollback_ok
        # Reported, not required: a node lost before the first peer backup of its generation, or a group whose
        # members hold each other's backups, resumes from the persistent tier or afresh (docs/demo.md).
        for rung, (step, tiers) in result["restores"].items():
            print(f"{rung}: the evicted nodes' ranks resumed after step {step} "
                  f"({', '.join(tiers) if step >= 0 else 'a fresh start: no step every rank holds survived'})")
        received = inbox.payloads()
        kinds: dict[str, int] = {}
        for message in received:
            kind = str(message["type"]).removeprefix("keel.")
            kinds[kind] = kinds.get(kind, 0) + 1
        announced = {m["data"]["incident_id"] for m in received if m["type"] == "keel.incident_opened"}
        told = {str(opened.id) for opened, _ in result["incidents"]} <= announced
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        print(f"notifier: {len(received)} signed webhooks to the local receiver ({counts}); every incident of the "
              f"main job announced: {told}; refused signatures: {inbox.bad_signatures}")
        ok = ok and told and inbox.bad_signatures == 0
        api_ok, api_line = _api_check(config, env, {str(opened.id) for opened, _ in result["incidents"]})
        print(api_line)
        ok = ok and api_ok
        if "sharded" in result:
            sharded = result["sharded"]
            sharded_same = (sharded["losses"] == sharded["reference"]
                            and sorted(sharded["losses"]) == list(range(SHARDED_STEPS)))
            # Equal losses alone would also follow a fresh start (the job is deterministic): each fault must
            # have been resumed from a checkpoint, the lost node's ranks from the peer tier.
            (crash_step, _), (lost_step, lost_tiers) = sharded["restores"]
            sharded_same = sharded_same and crash_step >= 0 and lost_step >= 0 and "peer" in lost_tiers
            outcomes = [f"{payload_of(r, IncidentResolved).outcome} at rung {payload_of(r, IncidentResolved).rung}"
                        for _, r in sharded["incidents"]]
            replayed = _keel(config, "replay", "--verify", "--job", SHARDED_JOB, env=env, check=False, timeout=600)
            print(f"sharded state ({sharding}) in '{SHARDED_JOB}': {'; '.join(outcomes)}; every step's loss equal to its "
                  f"fault-free run's: {sharded_same} ({len(sharded['losses'])} steps); replay: "
                  f"{'clean' if replayed.returncode == 0 else 'DIVERGED'}")
            ok = ok and sharded_same and replayed.returncode == 0
        print("DEMO PASSED" if ok else "DEMO FAILED")
        return 0 if ok else 1
    finally:
        if not keep:
            _banner("keel down")
            print(_keel(config, "down", env=env, check=False).stdout.strip())

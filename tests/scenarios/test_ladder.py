"""The escalation ladder end to end, with real processes: a local cluster training the example GPT, the
controller, checkpoint broker, analyzer and local actuator as services, faults injected with `keel inject`.

Each rung: injected fault -> detected -> the expected rung's decisions -> training resumes from memory
(or a peer copy) -> the incident resolved, its timeline complete (every decision and every agent's
answer carries the incident id) -> `keel replay --verify` clean.
"""

from __future__ import annotations

import asyncio
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from keel.checkpoint_broker.restore import joined_sources
from keel.cluster.local import FaultSpec, cluster_down, cluster_up, inject, load_cluster
from keel.cluster.netns import NetworkPlan
from keel.events.envelope import Event
from keel.rules.ettr import compute_ettr
from tests.integration.test_crashes import service_env, start_service_process
from tests.scenarios.test_cluster_faults import stop_process

pytestmark = pytest.mark.integration

TRAIN = ["-m", "keel.workload.train", "--size", "tiny", "--pp", "2", "--steps", "100000", "--min-step-time", "50ms"]


class Stack:
    """The control plane (controller, broker, actuator as processes; the session's recorder) and one cluster."""

    def __init__(self, keel_env, scratch: Path, job: str) -> None:  # type: ignore[no-untyped-def]
        self.env, self.scratch, self.job = keel_env, scratch, job
        self.settings = keel_env.settings
        self.directory = scratch / "cluster"
        self.services: list[subprocess.Popen] = []
        self.knobs: dict[str, str] = {}
        self.running: list[str] = []
        self._ready: list[Path] = []
        """The services started (``start``): a replay verifies their deciders."""
        self.network: NetworkPlan | None = None
        """A host network (``keel.cluster.netns``): each node a host of its own on it; None: a flat cluster."""

    def start(self, *, nodes: int, standby: int, command: list[str], extra: dict[str, str] | None = None,
              nproc_per_node: int = 1, more_services: tuple[str, ...] = ()) -> None:
        env = self.start_services(extra=extra, more_services=more_services,
                                  actuator=("actuator", ["--cluster-dir", str(self.directory)], {}))
        cluster_up(self.settings, self.directory, nodes=nodes, standby=standby, nproc_per_node=nproc_per_node,
                   job_id=self.job,
                   command=command, nats_url=self.settings.nats_url, extra_env=env, heartbeat_interval="2s",
                   persist_root=self.scratch / "checkpoints", fault_injection=True, network=self.network)

    def start_services(self, *, extra: dict[str, str] | None = None, more_services: tuple[str, ...] = (),
                       actuator: tuple[str, list[str], dict[str, str]] | None = None) -> dict[str, str]:
        """The controller, broker, analyzer (and ``actuator``: its name, arguments and environment; None: start
        it later with ``start_service``) as processes, each consuming live before this returns. Returns the
        ``KEEL_*`` environment the agents get."""
        self.knobs = knobs = {"KEEL_CONTROLLER__DIAGNOSTICS_TIMEOUT": "60s", "KEEL_CONTROLLER__NODE_SILENCE_TIMEOUT": "20s",
                 "KEEL_CONTROLLER__STANDBY_MIN": "1", "KEEL_INSPECTOR__STEP_TIMEOUT_FLOOR": "60s",
                 "KEEL_CHECKPOINT__PERSIST_ROOT": str(self.scratch / "checkpoints"), **(extra or {})}
        self.running = ["controller", "checkpoint-broker", "analyzer", *more_services]
        for name, args, env in (("controller", [], {}), ("checkpoint-broker", [], {}), ("analyzer", [], {}),
                                *([actuator] if actuator else []), *((name, [], {}) for name in more_services)):
            self.start_service(name, args, env, wait=False)
        # As `keel up` does: the job starts once every service consumes live (an input arriving during a
        # decider's cold start is decided on the state at the end of its fold: see docs/known-limits.md).
        self.wait_ready()
        return {k: v for k, v in service_env(self.settings).items() if k.startswith("KEEL_")} | knobs

    def start_service(self, name: str, args: list[str], env: dict[str, str], *, wait: bool = True) -> None:
        ready = self.scratch / f"{name}.ready"
        ready.unlink(missing_ok=True)  # a restarted service must announce itself again
        if ready not in self._ready:
            self._ready.append(ready)
        if name not in self.running:
            self.running.append(name)
        self.services.append(start_service_process(name, self.settings, self.scratch / f"{name}.log",
                                                   {**self.knobs, **env, "KEEL_SERVICE_READY_FILE": str(ready)}, args))
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while not all(path.exists() for path in self._ready):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.services):
                raise AssertionError(f"services not ready: {[p.name for p in self._ready if not p.exists()]}; see "
                                     f"{self.scratch}/*.log")
            time.sleep(0.1)

    def stop(self) -> None:
        """Idempotent: the cluster down, then every service."""
        cluster_down(self.directory)
        for process in self.services:
            if process.poll() is None:
                stop_process(process)

    async def events(self, types: list[str] | None = None) -> list[Event]:
        return [r.event async for r in self.env.store.read(job_id=self.job, types=types)]

    async def wait_for(self, types: list[str], predicate: Callable[[Event], bool], timeout_s: float, what: str) -> Event:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in await self.events(types):
                if predicate(event):
                    return event
            await asyncio.sleep(0.3)
        # Ticks and heartbeats drown everything else: the tail names only the events that tell a story.
        routine = {"TimerTicked", "NodeHeartbeat", "CheckpointStepCommitted", "CheckpointShardStored"}
        tail = [(e.type, getattr(e.payload, "node_id", ""), getattr(e.payload, "reason", "")[:160])
                for e in await self.events() if e.type not in routine][-16:]
        raise AssertionError(f"no {what} within {timeout_s}s; the log ends (routine events left out) with {tail}; "
                             f"see {self.scratch}/*.log")

    async def newest_peer_commit_before(self, plan: Event) -> int:
        """The newest step committed on the peer tier before ``plan`` (-1: none)."""
        newest = -1
        for event in await self.events(["CheckpointStepCommitted", "CheckpointRestorePlanned"]):
            if event.id == plan.id:
                return newest
            if event.type == "CheckpointStepCommitted" and event.payload.tier == "peer":
                newest = max(newest, event.payload.step)
        raise AssertionError(f"the plan {plan.id} is not in the log")

    async def stepping(self, step: int, timeout_s: float = 150) -> None:
        await self.wait_for(["NodeHeartbeat"], lambda e: e.payload.last_step >= step and not e.payload.standby,
                            timeout_s, f"a heartbeat past step {step}")

    def node_of_rank(self, rank: int) -> str:
        newest: dict[str, int] = {}
        for node in load_cluster(self.directory)["nodes"]:
            generations = [int(p.name.split(".g")[1].split(".")[0])
                           for p in Path(node["agent_dir"]).glob(f"logs/rank{rank}.g*.stdout")]
            if generations and not node.get("evicted"):
                newest[node["node_id"]] = max(generations)
        return max(newest, key=lambda n: newest[n])

    async def rank0_steps(self, generation: int, past: int, timeout_s: float = 60) -> dict[int, tuple[float, float]]:
        """Rank 0's ``step -> (loss, grad_norm)`` in ``generation`` (its own log), once it stepped past ``past``."""
        log_file = self.directory / "nodes" / self.node_of_rank(0) / "logs" / f"rank0.g{generation}.stdout"
        deadline = time.monotonic() + timeout_s
        steps: dict[int, tuple[float, float]] = {}
        while max(steps, default=-1) <= past:
            assert time.monotonic() < deadline, f"generation {generation} did not step past {past}: {sorted(steps)[-3:]}"
            await asyncio.sleep(0.5)
            text = log_file.read_text() if log_file.exists() else ""
            steps = {int(m[0]): (float(m[1]), float(m[2]))
                     for m in re.findall(r"^step (\d+) loss (\S+) grad_norm (\S+)", text, re.M)}
        return steps

    async def incident(self, faults: list[FaultSpec], timeout_s: float = 180) -> tuple[Event, Event, list[Event]]:
        """Inject ``faults``; the incident the controller opens, its resolution, and its events."""
        seen = {e.id for e in await self.events(["IncidentOpened"])}
        await asyncio.to_thread(inject, self.settings, self.directory, faults, self.settings.nats_url)
        opened = await self.wait_for(["IncidentOpened"], lambda e: e.id not in seen, 90, "an incident")
        resolved = await self.wait_for(["IncidentResolved"], lambda e: e.payload.incident_id == str(opened.id),
                                       timeout_s, f"the resolution of {opened.payload.reason[:80]}")
        await asyncio.sleep(1.0)  # the agents' last answers (RanksRestarted...) land
        correlated = [e for e in await self.events() if e.correlation_id == opened.id]
        return opened, resolved, correlated

    async def log_order_is_stream_order(self) -> list[tuple[int, int, str]]:
        """Rows whose store position order disagrees with their JetStream sequence order (should be none:
        the deciders consumed the stream in sequence order, and replay folds the store in position order)."""
        rows = [(r.position, r.js_seq, r.event.type) async for r in self.env.store.read(job_id=self.job)]
        return [(a, b, t) for (a, b, t), (_, b2, _) in zip(rows, rows[1:]) if b and b2 and b2 < b]

    async def stop_and_verify(self) -> None:
        """Stop everything (nothing decides any more: the log is complete), then `keel replay --verify`
        must find every recorded decision again."""
        await asyncio.to_thread(self.stop)
        await asyncio.sleep(1.0)
        verified = await asyncio.to_thread(self.replay_verify)
        assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-2000:]

    def replay_verify(self) -> subprocess.CompletedProcess:
        # With the services' settings: a replay under another policy shows what that policy would change.
        # Only the services this stack ran: one that did not run decided nothing (the hot-update decider would
        # call a code version stable after 500 steps, in a log that has no such decision).
        services = [arg for name in self.running for arg in ("--service", name) if name != "actuator"]
        return subprocess.run([sys.executable, "-m", "keel.cli.main", "replay", "--job", self.job, "--verify",
                               *services],
                              env={**service_env(self.settings), **self.knobs}, capture_output=True, text=True,
                              timeout=300)


@pytest.fixture
async def stack(keel_env, scratch_dir):  # type: ignore[no-untyped-def]
    await keel_env.start_recorder()
    running = Stack(keel_env, scratch_dir, "ladder")
    try:
        yield running
    finally:
        await asyncio.to_thread(running.stop)


def types_of(events: list[Event]) -> list[str]:
    return [e.type for e in events]


async def test_rung1_promotes_the_standby_and_rung2_diagnoses_then_restarts_in_place(stack: Stack) -> None:
    await asyncio.to_thread(stack.start, nodes=4, standby=1, command=TRAIN)
    await stack.wait_for(["StandbyChecked"], lambda e: e.payload.passed, 120, "the standby's self-check")
    await stack.stepping(10)
    # The premise of promoting from a peer copy: one exists whose digest its owner reported (restore plans
    # trust only the owning node's digests, which come with its heartbeats' report rounds; on a loaded
    # machine the first round can land after step 10).
    await stack.wait_for(["CheckpointStepCommitted"], lambda e: e.payload.tier == "peer" and e.payload.step >= 5,
                         90, "a peer-tier commit past step 5")

    # Rung 1: a fatal XID on the node of rank 1.
    victim = stack.node_of_rank(1)
    opened, resolved, timeline = await stack.incident([FaultSpec(kind="xid", node=victim, params={"xid": 79})])
    assert opened.payload.kind == "hardware" and opened.payload.node_id == victim
    assert resolved.payload.outcome == "recovered" and resolved.payload.rung == 1
    [restart] = [e for e in timeline if e.type == "RestartDecided"]
    [promotion] = restart.payload.promotions
    assert promotion.replaces_node_id == victim and promotion.ranks == [1]
    kinds = types_of(timeline)
    for expected in ("IncidentOpened", "NodeEvictionDecided", "RestartDecided", "StandbyPromotionRequested",
                     "RanksRestartRequested", "StandbyPromoted", "RanksRestarted", "NodeEvicted", "IncidentResolved"):
        assert expected in kinds, (expected, kinds)
    assert kinds.count("RanksRestarted") == 3
    plan = await stack.wait_for(["CheckpointRestorePlanned"], lambda e: e.payload.generation == restart.payload.generation,
                                30, "the restore plan")
    committed = await stack.newest_peer_commit_before(plan)
    # The promoted rank comes from its peer copy, at the newest peer-committed step or later; from disk
    # only when the persistent tier holds a newer step for every rank (the planner takes the newest).
    assert plan.payload.step >= max(5, committed), (committed, plan.payload)
    sources = joined_sources(plan.payload, [e.payload for e in await stack.events(["CheckpointNodeRestorePlanned"])])
    [promoted_source] = [s for s in sources if s.rank == 1]
    if promoted_source.tier == "disk":
        assert plan.payload.step > committed, (committed, plan.payload)
    else:
        assert promoted_source.tier == "peer", plan.payload
        assert {s.tier for s in sources} <= {"memory", "peer"}, plan.payload
    assert load_cluster(stack.directory)["nodes"][1]["evicted"] is True

    # Rung 2: a crash that names no culprit: diagnostics on every node pass; restart in place.
    await stack.stepping(plan.payload.step + 5)
    opened, resolved, timeline = await stack.incident([FaultSpec(kind="crash", node=stack.node_of_rank(2), rank=2)])
    assert opened.payload.kind == "crash" and resolved.payload.rung == 2 and resolved.payload.outcome == "recovered"
    [request] = [e for e in timeline if e.type == "DiagnosticsRequested"]
    results = [e for e in timeline if e.type == "DiagnosticsCompleted"]
    assert sorted(e.payload.node_id for e in results) == sorted(request.payload.nodes) and len(results) == 4
    assert all(e.payload.passed for e in results), [e.payload for e in results]
    [restart] = [e for e in timeline if e.type == "RestartDecided"]
    assert restart.payload.evict == [] and "passed on every node" in restart.payload.reason

    await stack.stop_and_verify()


async def test_rung2_evicts_the_node_whose_diagnostics_fail(stack: Stack) -> None:
    await asyncio.to_thread(stack.start, nodes=4, standby=1, command=TRAIN)
    await stack.wait_for(["StandbyChecked"], lambda e: e.payload.passed, 120, "the standby's self-check")
    await stack.stepping(10)
    flaky = stack.node_of_rank(3)
    opened, resolved, timeline = await stack.incident([FaultSpec(kind="nic-down", node=flaky, params={"flaps": 2}),
                                                       FaultSpec(kind="crash", node=stack.node_of_rank(0), rank=0)])
    assert resolved.payload.rung == 2 and resolved.payload.outcome == "recovered"
    [restart] = [e for e in timeline if e.type == "RestartDecided"]
    assert restart.payload.evict == [flaky], restart.payload.reason
    assert [p.replaces_node_id for p in restart.payload.promotions] == [flaky]
    failed = [e.payload for e in timeline if e.type == "DiagnosticsCompleted" and not e.payload.passed]
    assert any(p.node_id == flaky for p in failed), failed


@pytest.mark.parametrize("kind", ["hang", "hang_stopped"])
async def test_rung3_a_rank_hung_in_a_pipeline_stage_evicts_its_pipeline_group(stack: Stack, kind: str) -> None:
    """Rank 5 stops inside its next collective (``hang``: its training thread blocks there, alive;
    ``hang_stopped``: the whole process is SIGSTOPped there) and its peers block in the real gloo
    collectives waiting for it. At the default settings it is called a hang within seconds (an agent: a rank
    inside one collective for max(5 s, 5 x p99 wait), or a stopped process; the controller: every rank of the
    job inside a collective at once for 5 s), not at the 25 s step timeout."""
    # 4 nodes x 2 ranks, DP 4 x PP 2: each node holds one pipeline (ranks 2n, 2n+1).
    await asyncio.to_thread(stack.start, nodes=4, standby=1, command=TRAIN, nproc_per_node=2)
    await stack.wait_for(["StandbyChecked"], lambda e: e.payload.passed, 120, "the standby's self-check")
    await stack.stepping(10)
    victim = stack.node_of_rank(5)
    hung_at = time.monotonic()
    opened, resolved, timeline = await stack.incident([FaultSpec(kind=kind, node=victim, rank=5)])
    assert opened.payload.kind == "hang" and resolved.payload.rung == 3 and resolved.payload.outcome == "recovered"
    [injected] = [e for e in await stack.events(["FaultInjected"]) if e.payload.kind == kind]
    detect_s = (opened.occurred_at - injected.occurred_at).total_seconds()
    # An agent's rank check (a collective or a stopped process), or every rank blocked at once (the controller).
    assert any(why in opened.payload.reason for why in ("collective_stuck", "process_stopped",
                                                        "inside a collective at once")), opened.payload
    assert detect_s <= 10.0, f"detected {detect_s:.1f}s after the injection: {opened.payload.reason}"
    [request] = [e for e in timeline if e.type == "StacksRequested"]
    captured = [e for e in timeline if e.type == "StacksCaptured"]
    assert sorted({e.payload.node_id for e in captured}) == sorted(request.payload.nodes)
    [verdict] = [e for e in timeline if e.type == "StacksAnalyzed"]
    assert verdict.payload.conclusive and 5 in verdict.payload.outlier_ranks, verdict.payload
    assert verdict.payload.group_kind == "pp" and verdict.payload.group_ranks == [4, 5], verdict.payload
    assert verdict.payload.group_nodes == [victim]
    # The culprit's frames: inside the training step's collective (the SDK's waiting() around the gloo call)
    culprit = verdict.payload.outlier_stacks["5"]
    assert any(frame.startswith("Session._hang_in_collective (") for frame in culprit), "\n".join(culprit)
    assert any(frame.startswith(("_pipeline_forward (", "_sync_gradients (")) for frame in culprit), "\n".join(culprit)
    [restart] = [e for e in timeline if e.type == "RestartDecided"]
    assert restart.payload.rung == 3 and restart.payload.evict == [victim]
    assert "DiagnosticsRequested" not in types_of(timeline)  # the stacks named the culprit: no stop-time checks
    # Resolved means the restarted generation stepped past its restore point: resumed. (incident() waits
    # 1 s after the resolution for the agents' last answers.)
    assert time.monotonic() - hung_at < 60 + 1, "training must resume within 60 s of the hang"
    await stack.stop_and_verify()


async def test_rung3_a_node_30_percent_slower_is_convicted_within_five_rounds_and_evicted(stack: Stack) -> None:
    # 4 nodes x 1 rank, DP 4: every rank does the same work. One node's rank sleeps 30 % of each step.
    command = ["-m", "keel.workload.train", "--size", "tiny", "--steps", "100000", "--min-step-time", "50ms"]
    await asyncio.to_thread(stack.start, nodes=4, standby=1, command=command,
                            extra={"KEEL_ANALYZER__FAILSLOW_INTERVAL": "4s"})
    await stack.wait_for(["StandbyChecked"], lambda e: e.payload.passed, 120, "the standby's self-check")
    await stack.stepping(10)
    # The analyzer judges no step of the first 30 s of steps (analyzer.failslow_warmup): rank 0 computes 2.3x its
    # peers' time there on this machine, which once convicted a healthy n00. ETTR's baseline for the slow
    # steps skips them too: the job runs healthy past them first.
    await asyncio.sleep(30)
    victim = stack.node_of_rank(2)
    before = {e.id for e in await stack.events(["FailSlowConvicted"])}
    opened, resolved, timeline = await stack.incident([FaultSpec(kind="slow", node=victim, params={"fraction": 0.3})])
    verdicts = [e.payload for e in await stack.events(["FailSlowConvicted"]) if e.id not in before]
    assert opened.payload.kind == "fail_slow" and opened.payload.node_id == victim, \
        (opened.payload, [v.round_evidence for v in verdicts])
    assert resolved.payload.rung == 3 and resolved.payload.outcome == "recovered", resolved.payload
    [verdict] = [e for e in await stack.events(["FailSlowConvicted"]) if e.id not in before]
    [stack_fault] = await stack.events(["FaultInjected"])
    assert verdict.payload.group_nodes == [victim] and verdict.payload.group_ranks == [2], verdict.payload
    assert verdict.payload.rounds == 5 and verdict.payload.flags >= 2, verdict.payload
    # The evidence names the slow rank in the rounds that flagged it.
    assert sum("rank(s) 2 flagged" in line for line in verdict.payload.round_evidence) == verdict.payload.flags
    [restart] = [e for e in timeline if e.type == "RestartDecided"]
    assert restart.payload.rung == 3 and restart.payload.evict == [victim]
    assert [p.replaces_node_id for p in restart.payload.promotions] == [victim]
    # ETTR charges what the slow node cost before its conviction (its steps against the job's own before), the
    # eviction as an incident, and the time the training threads blocked in checkpointing (from the heartbeats).
    report = compute_ettr(await stack.events())
    assert report is not None
    [slow] = [o for o in report.overheads if o.kind == "fail_slow"]
    assert slow.lost > timedelta(0) and slow.started_at == stack_fault.occurred_at, slow
    assert [i.cause.split(":")[0] for i in report.incidents] == ["fail-slow eviction"], report.incidents
    assert report.lost_by_overhead()["checkpoint"] > timedelta(0)
    await stack.stop_and_verify()


async def test_a_nan_loss_is_detected_diagnosed_and_restored_from_before_it(stack: Stack) -> None:
    command = ["-m", "keel.workload.train", "--size", "tiny", "--steps", "100000", "--min-step-time", "50ms"]
    await asyncio.to_thread(stack.start, nodes=4, standby=0, command=command)
    await stack.stepping(15)
    opened, resolved, timeline = await stack.incident([FaultSpec(kind="nan", node=stack.node_of_rank(1))])
    assert opened.payload.kind == "metric_anomaly" and "non-finite" in opened.payload.reason, opened.payload
    first = min((e for e in await stack.events(["MetricAnomalyDetected"]) if e.payload.kind == "non_finite"),
                key=lambda e: e.payload.step)
    assert first.payload.generation == 0 and first.payload.value is None and first.payload.value_text == "nan"
    assert "DiagnosticsRequested" in types_of(timeline)
    # Diagnostics pass, so rung 5 replays the step: an injected NaN is the program's, not a machine's, and
    # the replay does not reproduce it (no group fails): restart in place, from before the NaN.
    [verdict] = [e for e in timeline if e.type == "SdcReplayAnalyzed"]
    assert verdict.payload.kind == "not_reproduced" and not verdict.payload.nodes, verdict.payload
    assert resolved.payload.outcome == "recovered" and resolved.payload.rung == 5, resolved.payload
    [restart] = [e for e in timeline if e.type == "RestartDecided"]
    assert restart.payload.evict == [] and "not reproduced" in restart.payload.reason
    plan = await stack.wait_for(["CheckpointRestorePlanned"], lambda e: e.payload.generation == restart.payload.generation,
                                30, "the restore plan")
    # The snapshot of the NaN step (and every later one) holds NaN weights: the plan takes one before it.
    assert 0 <= plan.payload.step < first.payload.step, (plan.payload, first.payload)
    assert f"steps from {first.payload.step} on excluded" in plan.payload.reason, plan.payload.reason
    # The restored generation trains on past the NaN step with finite losses (rank 0's own log).
    losses = {step: loss for step, (loss, _) in
              (await stack.rank0_steps(restart.payload.generation, first.payload.step + 10)).items()}
    assert min(losses) == plan.payload.step + 1 and all(math.isfinite(v) for v in losses.values()), losses
    assert not [e for e in await stack.events(["MetricAnomalyDetected"])
                if e.payload.generation >= restart.payload.generation and e.payload.kind == "non_finite"]
    await stack.stop_and_verify()


async def test_rung5_a_node_that_flips_a_gradient_bit_is_located_by_replay_and_evicted(stack: Stack) -> None:
    # 4 nodes x 1 rank, DP 4, and a standby. One node's "GPU" silently flips the exponent's top bit of one
    # gradient element on every step: the all-reduce spreads it, the gradient norm overflows.
    command = ["-m", "keel.workload.train", "--size", "tiny", "--steps", "100000", "--min-step-time", "50ms"]
    await asyncio.to_thread(stack.start, nodes=4, standby=1, command=command)
    await stack.wait_for(["StandbyChecked"], lambda e: e.payload.passed, 120, "the standby's self-check")
    await stack.stepping(15)
    culprit = stack.node_of_rank(2)
    opened, resolved, timeline = await stack.incident([FaultSpec(kind="sdc", node=culprit, params={"bit": 30})],
                                                      timeout_s=240)
    assert opened.payload.kind == "metric_anomaly", opened.payload
    first = min((e for e in await stack.events(["MetricAnomalyDetected"]) if e.payload.kind != "decline"),
                key=lambda e: e.payload.step)
    kinds = types_of(timeline)
    # Diagnostics do not see it (the simulated GPUs pass their matmul check): rung 5.
    diagnosed = [e for e in timeline if e.type == "DiagnosticsCompleted"]
    assert diagnosed and all(e.payload.passed for e in diagnosed), [e.payload.detail for e in diagnosed]
    assert kinds.index("DiagnosticsCompleted") < kinds.index("SdcReplayRequested") < kinds.index("SdcReplayAnalyzed")
    [request] = [e for e in timeline if e.type == "SdcReplayRequested"]
    assert [p.kind for p in request.payload.phases] == ["contiguous", "strided"] and len(request.payload.units) == 4
    answers = [e for e in timeline if e.type == "SdcReplayCompleted"]
    assert len(answers) == 4 and all(a.payload.ran for a in answers), [a.payload.detail for a in answers]
    [verdict] = [e for e in timeline if e.type == "SdcReplayAnalyzed"]
    assert verdict.payload.kind == "found" and verdict.payload.nodes == [culprit], verdict.payload
    assert verdict.payload.rounds == 2  # two replay phases, where a binary search over 4 needs 2 as well
    assert all(len(p.failed_groups) == 1 for p in verdict.payload.phases), verdict.payload.phases
    # Evicted at rung 5; the standby takes its rank; the job resumes from before the corruption.
    [restart] = [e for e in timeline if e.type == "RestartDecided"]
    assert restart.payload.rung == 5 and restart.payload.evict == [culprit], restart.payload
    assert [p.replaces_node_id for p in restart.payload.promotions] == [culprit]
    assert resolved.payload.outcome == "recovered" and resolved.payload.rung == 5, resolved.payload
    plans = [e for e in await stack.events(["CheckpointRestorePlanned"])
             if e.payload.generation in (request.payload.generation, restart.payload.generation)]
    assert len(plans) == 2 and all(0 <= p.payload.step < first.payload.step for p in plans), [p.payload for p in plans]
    # Training goes on past the corrupted step with finite gradient norms, without the bad node.
    norms = {step: norm for step, (_, norm) in
             (await stack.rank0_steps(restart.payload.generation, first.payload.step + 10)).items()}
    assert all(math.isfinite(v) for v in norms.values()), norms
    spent = (resolved.occurred_at - opened.occurred_at).total_seconds()
    print(f"rung 5: incident {spent:.1f} s (open to resolved); replay answers in "
          f"{max(a.payload.duration_s for a in answers):.1f} s; replay requested "
          f"{(request.occurred_at - opened.occurred_at).total_seconds():.1f} s after the incident opened")
    await stack.stop_and_verify()


async def test_rung4_rolls_back_the_repeated_failure_then_rung6_stops_the_crash_loop(stack: Stack) -> None:
    bug = stack.scratch / "bug"
    bug.write_text("present\n")
    command = ["-m", "keel.workload.train", "--size", "tiny", "--steps", "100000", "--min-step-time", "50ms",
               "--bug-at-step", "12", "--bug-rank", "-1", "--bug-file", str(bug)]
    await asyncio.to_thread(stack.start, nodes=2, standby=0, command=command)
    first = await stack.wait_for(["IncidentResolved"], lambda e: True, 180, "the first crash's recovery")
    assert first.payload.rung == 2
    opened = await stack.wait_for(["IncidentOpened"], lambda e: "rung 2" in e.payload.reason
                                  and "names the user's code" in e.payload.reason, 10, "the first incident")
    assert opened.payload.kind == "user_code" and "KeyError" in opened.payload.reason
    rollback = await stack.wait_for(["RollbackDecided"], lambda e: True, 180, "the rollback after the second crash")
    assert "2 times in a row" in rollback.payload.reason
    # No hot-update yet: the code stays as it is, the bug comes back, and the third time is a crash loop.
    stop = await stack.wait_for(["JobStopDecided"], lambda e: True, 180, "the crash-loop stop")
    assert stop.payload.rung == 6 and stop.payload.page and "crash loop" in stop.payload.reason
    restarts = len(await stack.events(["RestartDecided"]))
    await asyncio.sleep(3)
    assert len(await stack.events(["RestartDecided"])) == restarts == 2  # nothing restarts a stopped job
    assert await stack.log_order_is_stream_order() == []
    await stack.stop_and_verify()

"""The node agent's loop: supervise ranks, read rank reports, probe health, publish, obey commands.

Once per probe interval: fold the rank reports that arrived; report rank exits (classified); run the
health probes through the pure inspector core and publish its state changes; every heartbeat
interval publish a ``NodeHeartbeat``. The loop also wakes at once when a rank reports or a child exits.

Commands (``keel.agent.consumer`` takes them off the bus) are carried out by ``keel.agent.commands``:
restarts and promotions at once, diagnostics rounds, stack captures and SDC replays in the background,
polled from the loop. The handlers share the agent's state through ``commands.Node``.

A standby runs the local checks (GPU matmul, intra-node all-to-all) once when it starts and reports
``StandbyChecked``: only a passing standby counts for the pool.

Every piece of a tick runs isolated (``keel.agent.isolation``): one that raises is logged, rate-limited,
and the rest of the tick (the heartbeat included) and the next ticks go on; the ranks are never stopped
for it. The agent holds its folder's lock and records its state there (``keel.agent.rejoin``): an agent
restarted after its predecessor died stops what that one left running and, under the same job and node,
rejoins it with the node's memory tier intact.

Failure handling without a controller (``supervised=False``: ``keel run`` where no control plane is
configured, or with ``--keel-local-restarts``): like torchrun, a failed rank stops the node's other ranks,
then the agent restarts them locally while ``--max-restarts`` allows, else exits non-zero. Supervised
(the default wherever a control plane is configured), the agent reports and waits: the controller decides.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import shutil
import signal
import socket
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Protocol

from keel.agent import commands
from keel.agent.channel import RankChannel, RankState
from keel.agent.checkpointing import NodeCheckpointing
from keel.agent.commands import DiagnosticsRounds, SdcReplays, StackCaptures
from keel.agent.consumer import CommandConsumer
from keel.agent.diagnostics import DiagnosticsPolicy
from keel.agent.fencing import FENCE_FILE, FENCED_EXIT, Fence, fence_refusal, fence_verdict, read_fence
from keel.agent.host_addresses import host_addresses
from keel.agent.inspector.policy import InspectorPolicy
from keel.agent.inspector.ranks import normalise_phase
from keel.agent.isolation import Pieces
from keel.agent.launch_spec import LaunchSpec
from keel.agent.metric_watch import MetricWatch
from keel.agent.rejoin import (
    AgentLock,
    AgentState,
    ProcessRef,
    decide_rejoin,
    leftover_processes,
    read_state,
    remove_state,
    stop_processes,
    write_state,
)
from keel.agent.supervisor import RankExit, RankSupervisor, file_tail
from keel.checkpoint.slots import write_file_atomic
from keel.events.envelope import Event, EventPayload, now_utc
from keel.events.types import (
    CheckpointTier,
    CodeRef,
    CodeVersionApplied,
    NodeClockSkewed,
    NodeHeartbeat,
    NodeRegistered,
    RankCollective,
    RankExited,
    RankStarted,
    ShardRecord,
)
from keel.infra.code_store import CodeStoreError, VerifiedVersions
from keel.infra.outbox import Outbox
from keel.rules.code import entry_problem, registration_problem
from keel.rules.metrics import MetricSettings

log = logging.getLogger(__name__)


def printable(text: str) -> str:
    """A rank's output as an event may carry it: NUL (which stderr can hold, and which PostgreSQL's jsonb
    and Keel's decoder refuse) becomes U+FFFD, so the exit is still recorded."""
    return text.replace("\x00", "\ufffd")

PRODUCER = "agent"

STEPPING_PHASES = frozenset({"step", "checkpoint", "eval", "done"})
"""Rank phases past setup (restore included)."""
ZYGOTE_RESTART_AFTER_S = 60.0
"""Replace a dead zygote this long after a start even if the ranks never said they step (a program
without the SDK sends no reports)."""
REJOIN_CONNECT_WAIT_S = 5.0
"""A rejoining agent waits this long for NATS before it stops its predecessor's ranks (see ``_run``)."""
ZYGOTE_READY_WAIT_S = 60.0
"""At agent start, how long the first ranks wait for the zygote before starting as fresh processes."""


def zygote_restart_due(*, standby: bool, held: bool, failed: bool, round_running: bool, ranks_running: int,
                       ranks_stepping: bool, since_generation_start_s: float) -> bool:
    """Whether replacing a dead zygote now is harmless (pure). Its import takes seconds of CPU, so never
    while a round runs or ranks are held for one, nor after a failure while the controller decides (a
    round or a restart comes next), nor while the ranks of a start are still setting up and restoring
    (that is the recovery being timed), nor on a node whose ranks all ended (the job finishes): on an
    idle standby, once every rank steps, or ``ZYGOTE_RESTART_AFTER_S`` after the start."""
    if round_running or held or failed:
        return False
    if standby:
        return True
    if ranks_running == 0:
        return False
    return ranks_stepping or since_generation_start_s >= ZYGOTE_RESTART_AFTER_S


ALL_BLOCKED_AFTER = timedelta(seconds=5)
"""Once every rank of the node has been inside a collective this long (the controller's default floor for a
job-wide hang, ``controller.all_blocked_hang_after``), heartbeats go every ``ALL_BLOCKED_HEARTBEAT``, not at
the regular interval: the controller sees the whole job blocked together only from fresh heartbeats of every
node (a wait proves a rank was inside up to the moment it was reported, not after)."""
ALL_BLOCKED_HEARTBEAT = timedelta(seconds=1)
BLOCKING_PHASES = ("step", "eval")
"""The phases whose collective waits a heartbeat reports (``rank_collectives``)."""


class HealthWatcher(Protocol):
    """What the agent needs from the inspector: observations in, health state changes out."""

    def sample(self, now: datetime, channel: RankChannel, supervisor: RankSupervisor) -> list[EventPayload]: ...


@dataclass
class AgentResult:
    exit_code: int
    reason: str


def heartbeat_cadence(since_last: timedelta | None, interval: timedelta, *, round_done: bool,
                      rounds_flowing: bool) -> bool:
    """Whether a heartbeat goes now. It goes at once when a checkpoint report round completed (the
    heartbeat carries it: every node reports the same step, so the broker can commit it); otherwise once
    per ``interval`` - twice that while report rounds come (every ``interval`` to twice that, see
    ``keel.agent.checkpointing.report_round_steps``), so a stepping job sends one heartbeat per round,
    not two. ``since_last``: None before the first heartbeat."""
    if since_last is None or round_done:
        return True
    return since_last >= (2 * interval if rounds_flowing else interval)


class NodeAgent:
    """One node's agent: ``run(stop)`` until the ranks finish (or fail for good) or ``stop`` is set.
    ``tick()`` is one pass of the loop; ``handle_command(event)`` carries out a command."""

    def __init__(
        self,
        spec: LaunchSpec,
        *,
        outbox: Outbox | None,
        watcher: HealthWatcher | None,
        classify: Callable[..., tuple[str, str, str]],
        supervised: bool,
        checkpointing: NodeCheckpointing | None = None,
        clock: Callable[[], datetime] = now_utc,
        diagnostics_policy: DiagnosticsPolicy | None = None,
        metric_settings: MetricSettings | None = None,
        code_store: Path | None = None,
        lock: AgentLock | None = None,
    ) -> None:
        self.spec = spec
        self.outbox = outbox
        self.watcher = watcher
        self.classify = classify
        self.supervised = supervised
        self.clock = clock
        self.checkpointing = checkpointing
        # The folder is this user's own (``UntrustedPathError`` otherwise: the agent does not start) and one
        # agent per folder (``AgentDirBusy`` otherwise), before anything in it is touched: binding the
        # socket below would unbind a live agent's.
        self.lock = lock if lock is not None else AgentLock(spec.agent_dir)  # ``lock``: the launcher took it already
        self.previous = read_state(spec.agent_dir)
        """What the folder's previous agent recorded, if it died without ending (``keel.agent.rejoin``)."""
        self._recorded_state = ""
        self._recorded_fingerprint: tuple[object, ...] | None = None
        self.pieces = Pieces(spec.node_id, log)
        """Each piece of a tick runs guarded: an exception is logged (rate-limited), the rest goes on."""
        self.channel = RankChannel(spec.agent_dir / "agent.sock")
        self.metric_watch = MetricWatch(spec.node_id, metric_settings or MetricSettings())
        self.supervisor = RankSupervisor(spec, self.channel.path, spec.agent_dir / "fault.json", warm=spec.warm_ranks,
                                         clock=clock)
        # Ready files of a previous agent in this folder (killed with its node) name nothing alive.
        shutil.rmtree(spec.agent_dir / "warm", ignore_errors=True)
        self.generation_started_s = time.monotonic()
        self.generation = 0
        self.restarts_left = spec.max_restarts
        self.failed = False
        self.last_heartbeat_at: datetime | None = None
        self.clock_skew = timedelta(0)
        """How far this node's clock runs ahead of the controller's recorded clock, as the controller
        reported it (``NodeClockSkewed``): commands' expiries are judged on ``controller_time``."""
        self.last_round_heartbeat_s: float | None = None
        self.stepping_announced_generation = -1
        self.blocked_announced: frozenset[tuple[int, int]] = frozenset()
        """The (rank, collective sequence) whose all-blocked state a heartbeat already announced early."""
        """The generation whose first step a heartbeat has already announced (the moment the job resumed)."""
        """When a heartbeat last carried a completed report round (monotonic s)."""
        self.held = False
        """The ranks were stopped on command (diagnostics, a replay) and wait for the next one: not "finished"."""
        self._wake: Callable[[], None] = lambda: None
        """Wakes the loop from another thread (set by ``run``)."""
        self.code_versions = VerifiedVersions(code_store) if code_store is not None else None
        """The version store this node runs code versions from (``hot_update.versions_dir``; None: it runs
        none, only the launch command), and the versions verified here."""
        self.rounds = DiagnosticsRounds(self, diagnostics_policy or DiagnosticsPolicy())
        self.stacks = StackCaptures(self)
        self.replays = SdcReplays(self)
        self.started_at = clock()
        """When this agent started (its own clock): evictions decided before are about an earlier agent."""
        self.fence: Fence | None = None
        """Set once this node was fenced out of the job (``keel.agent.fencing``): the loop ends."""
        self._emitted: collections.deque[uuid.UUID] = collections.deque(maxlen=4096)
        self._emitted_ids: set[uuid.UUID] = set()
        """Ids of this agent's recent events: a ``NodeFenced`` caused by one of them is about this agent."""

    # -- events ----------------------------------------------------------------------------------

    def emit(self, payload: EventPayload, subject: str | None = None, causation: Event | None = None) -> None:
        event = Event.create(
            payload,
            job_id=self.spec.job_id,
            subject=subject or f"node/{self.spec.node_id}",
            producer=PRODUCER,
            occurred_at=self.clock(),
            causation_id=causation.id if causation else None,
            correlation_id=(causation.correlation_id or causation.id) if causation else None,
        )
        if self.fence is not None and not isinstance(payload, RankExited):
            log.debug("fenced: %s not sent", event.type)  # a fenced node reports nothing but its ranks' ends
            return
        if len(self._emitted) == self._emitted.maxlen:
            self._emitted_ids.discard(self._emitted[0])
        self._emitted.append(event.id)
        self._emitted_ids.add(event.id)
        if self.outbox is not None:
            self.outbox.put(event)
        log.debug("event %s %s", event.type, event.payload)

    # -- ranks -----------------------------------------------------------------------------------

    def start_ranks(self, generation: int, extra_env: dict[str, str] | None = None) -> None:
        if generation > 0:
            # An injected workload fault belongs to the generation it was injected into; a restarted
            # process must not apply it again.
            self.supervisor.fault_file.unlink(missing_ok=True)
        self.generation = generation
        self.generation_started_s = time.monotonic()
        self.held = False
        self.channel.forget_generation_before(generation)
        self.supervisor.extra_env = {**(self.checkpointing.rank_env(generation) if self.checkpointing is not None
                                        else {}), **(extra_env or {})}
        for process in self.supervisor.start_all(generation):
            self.emit(
                RankStarted(node_id=self.spec.node_id, rank=process.rank, local_rank=process.local_rank,
                            world_size=self.spec.world_size, pid=process.pid, generation=generation),
                subject=f"rank/{process.rank}",
            )
        code = self.supervisor.code
        if code is not None:
            warm = self.supervisor.last_start_warm
            command, cwd = self.supervisor.rank_command()
            self.emit(CodeVersionApplied(
                node_id=self.spec.node_id, version_id=code.version_id, generation=generation, path=code.path,
                warm=warm, detail=f"{self.spec.nproc_per_node} rank(s) {'forked from the zygote' if warm else 'as fresh interpreters'}"
                                  f" running {' '.join(command)[:300]}" + (f" in {cwd}" if cwd else "")))
        log.info("%s: started %d ranks, generation %d%s", self.spec.node_id, self.spec.nproc_per_node, generation,
                 f" on code version {code.version_id}" if code is not None else "")
        self.pieces.run("agent state", self.record_state)

    def use_code(self, code: CodeRef | None) -> str:
        """Switch the code the next ranks run (None: keep it). Returns why it cannot, or "".

        Called before any rank stops. A version runs only from this node's store, in the folder named by
        its digest, after the stored tree was re-hashed to that digest (once per version, again if anything
        in it changed), and only through a relative ``*.py`` file or ``-m module`` of the version; anything
        else is refused and the ranks keep running. The ranks run the verified folder, not the command's
        spelling of it."""
        if code is None:
            return ""
        if not code.path:
            self.supervisor.code = code  # the launch command: what this agent was started with
            return ""
        verified = self.verified_code(code)
        if isinstance(verified, str):
            log.error("%s: %s", self.spec.node_id, verified)
            return verified
        self.supervisor.code = verified
        return ""

    def verified_code(self, code: CodeRef) -> CodeRef | str:
        """``code`` with its verified folder as path, or why it may not run here (see ``use_code``)."""
        what = f"code version {code.version_id[:40]}"
        if self.code_versions is None:
            return f"{what}: {self.spec.node_id} has no version store configured (hot_update.versions_dir)"
        problem = registration_problem(code.version_id, code.digest, code.path, code.entry)
        if problem:
            return f"{what}: {problem}"
        try:
            version = self.code_versions.verify(code.digest, code.path)
        except (CodeStoreError, OSError) as exc:
            return f"{what} refused on {self.spec.node_id}: {exc}"
        problem = entry_problem(code.entry, version.files)
        if problem:
            return f"{what}: {problem}"
        return code.model_copy(update={"path": str(version.path)})

    def report_exit(self, exit_: RankExit) -> bool:
        """Publish a rank's exit; True when it is a failure."""
        if exit_.stopped_by_agent:
            classification, error_type, reason = "stopped_by_agent", "", "stopped by the agent (restart or shutdown)"
        elif exit_.reported_failure:
            # Killed by the agent after the rank reported an uncaught exception: classify the exception
            # (its traceback is in the stderr tail), not the SIGKILL.
            classification, error_type, reason = self.classify(1, None, exit_.stderr_tail)
            # The exception the rank named itself: if that alone says infrastructure (MemoryError,
            # an NCCL/gloo error...), trust it over a stderr tail that later output may have muddled.
            from_rank = self.classify(1, None, exit_.reported_failure)
            if (classification != "infrastructure" and from_rank[0] == "infrastructure") or (
                    classification == "unknown" and (from_rank[0] == "user_code" or (not error_type and from_rank[1]))):
                # The rank's own traceback (the SDK sends its tail) over a stderr tail that was cut short
                # or muddled by output after the traceback: an infrastructure error it names wins, and so
                # does a frame in the user's code, or any named exception, when the captured stderr told
                # nothing.
                classification, error_type, reason = from_rank
            named = (exit_.reported_failure.strip().splitlines() or ["?"])[-1][:300]
            reason = f"{reason} (the rank reported {named!r}; the agent ended its shutdown)"
        else:
            classification, error_type, reason = self.classify(exit_.exit_code, exit_.signal, exit_.stderr_tail,
                                                               oom_killed=exit_.oom_killed)
        tail = exit_.stderr_tail
        if "Traceback (most recent call last)" in exit_.reported_failure:
            # The rank's own traceback goes last: whoever reads the tail (the controller's failure
            # fingerprint: the innermost frame) sees the exception it died of, whatever stderr held.
            reported = exit_.reported_failure[-3000:]
            tail = f"{tail[-(3900 - len(reported)):]}\n[the traceback the rank reported]\n{reported}"
        self.emit(
            RankExited(node_id=self.spec.node_id, rank=exit_.rank, pid=exit_.pid, generation=exit_.generation,
                       exit_code=exit_.exit_code, signal=exit_.signal, classification=classification,
                       error_type=error_type, stderr_tail=printable(tail[-4000:]), reason=printable(reason)),
            subject=f"rank/{exit_.rank}",
        )
        log.info("%s: rank %d exited (%s, code %s, signal %s): %s", self.spec.node_id, exit_.rank, classification,
                 exit_.exit_code, exit_.signal, reason)
        return classification not in ("success", "stopped_by_agent")

    def stop_ranks(self) -> None:
        """Stop every rank now and report their exits (``stopped_by_agent``)."""
        self.supervisor.stop_all()
        for exit_ in self.supervisor.poll():
            self.report_exit(exit_)

    # -- commands ----------------------------------------------------------------------------------

    def controller_time(self) -> datetime:
        """The controller's recorded clock as this node can tell it: its own clock less the skew the
        controller reported. Commands carry expiries on that clock; a node whose clock is 10 minutes off
        neither refuses fresh commands as expired nor runs stale ones."""
        return self.clock() - self.clock_skew

    def note_clock_skew(self, report: Event) -> None:
        """The controller's ``NodeClockSkewed`` about this node: judge expiries net of it from now on."""
        p = report.payload
        if not isinstance(p, NodeClockSkewed) or p.node_id != self.spec.node_id:
            return
        self.clock_skew = timedelta(seconds=p.skew_s) if p.skewed else timedelta(0)
        log.warning("%s: the controller reports this node's clock %s: %s", self.spec.node_id,
                    "off its recorded clock" if p.skewed else "back within the allowance", p.reason)

    def handle_command(self, command: Event) -> None:
        """Carry out a command addressed to this node (others are ignored): ``commands.handle_command``."""
        if self.fence is not None:
            log.info("%s: fenced; %s not carried out", self.spec.node_id, command.type)
            return
        commands.handle_command(self, command)

    # -- fencing -----------------------------------------------------------------------------------

    def check_fence(self, event: Event) -> bool:
        """Act on what ``event`` says about this node's membership (``keel.agent.fencing``): fenced, stop the
        ranks and leave; left behind, stop the stale ranks and wait. True when it fenced this node."""
        if self.fence is not None:
            return True
        verdict = fence_verdict(event, node_id=self.spec.node_id, standby=self.spec.standby, generation=self.generation,
                                ranks_running=bool(self.supervisor.alive()),
                                started_at=self.started_at - self.clock_skew,
                                ours=event.causation_id is not None and event.causation_id in self._emitted_ids)
        if verdict is None:
            return False
        log.error("%s: %s", self.spec.node_id, verdict.reason)
        self.rounds.cancel()
        self.replays.finish(force=True)
        self.stop_ranks()
        if not verdict.fenced:
            self.held = True  # the ranks wait for the controller's next command; the job is not finished
            return False
        self.fence = Fence(job_id=self.spec.job_id, node_id=self.spec.node_id, generation=self.generation,
                           decision_id=str(event.id), reason=verdict.reason[:2000])
        try:
            write_file_atomic(self.spec.agent_dir / FENCE_FILE, self.fence.to_json().encode(), fsync=True, mode=0o600)
        except OSError as exc:
            log.error("%s: cannot record the fence in %s: %s", self.spec.node_id, self.spec.agent_dir, exc)
        self.wake()
        return True

    def wake(self) -> None:
        """Wake the loop (from any thread): background work ended."""
        self._wake()

    # -- the zygote ----------------------------------------------------------------------------------

    def keep_zygote(self) -> None:
        """Replace a dead zygote when that no longer competes with a start (``zygote_restart_due``)."""
        if not self.supervisor.zygote_needed():
            return
        ours = [s for s in self.channel.ranks.values() if s.generation == self.generation]
        stepping = len(ours) >= len(self.supervisor.ranks) and all(s.phase in STEPPING_PHASES for s in ours)
        if zygote_restart_due(standby=self.spec.standby, held=self.held, failed=self.failed,
                              round_running=self.rounds.running, ranks_running=len(self.supervisor.alive()),
                              ranks_stepping=stepping,
                              since_generation_start_s=time.monotonic() - self.generation_started_s):
            log.warning("%s: the zygote is gone; starting a new one", self.spec.node_id)
            self.supervisor.start_zygote()

    async def wait_zygote_ready(self, timeout_s: float = ZYGOTE_READY_WAIT_S) -> None:
        zygote = self.supervisor.zygote
        deadline = time.monotonic() + timeout_s
        while zygote is not None and zygote.alive() and not zygote.ready() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if zygote is not None and not zygote.ready():
            log.warning("%s: the zygote is not ready after %.0f s; starting fresh processes", self.spec.node_id,
                        timeout_s)

    # -- the loop ---------------------------------------------------------------------------------

    def step_time_p50_s(self) -> float | None:
        """The median step time over the ranks' last 20 steps (None: no step yet)."""
        step_times = [t for s in self.channel.ranks.values() for t in list(s.step_times_s)[-20:]]
        return statistics.median(step_times) if step_times else None

    def heartbeat_due(self, now: datetime, monotonic_s: float) -> bool:
        """Whether the heartbeat goes now (``heartbeat_cadence``): a report round completed, or the
        heartbeat interval passed (twice that while report rounds carry the heartbeats)."""
        round_done = False
        if self.checkpointing is not None and not self.spec.standby:
            ranks = {r: s for r, s in self.channel.ranks.items() if s.generation == self.generation}
            period = max(self.spec.heartbeat_interval, self.checkpointing.report_interval)
            try:
                round_done = self.checkpointing.report_due(
                    monotonic_s, {r: s.checkpoint_step for r, s in ranks.items()}, self.step_time_p50_s(), period)
            except Exception as exc:  # noqa: BLE001 - the heartbeat's liveness never depends on the checkpoint store
                log.warning("%s: checking the checkpoint report round failed: %r", self.spec.node_id, exc)
        since = None if self.last_heartbeat_at is None else now - self.last_heartbeat_at
        rounds_flowing = (self.last_round_heartbeat_s is not None
                          and monotonic_s - self.last_round_heartbeat_s <= 2 * self.spec.heartbeat_interval.total_seconds())
        due = heartbeat_cadence(since, self.spec.heartbeat_interval, round_done=round_done,
                                rounds_flowing=rounds_flowing)
        if due and round_done:
            self.last_round_heartbeat_s = monotonic_s
        if self.stepping_announced_generation != self.generation and any(
                s.generation == self.generation and s.step >= 0 for s in self.channel.ranks.values()):
            # The first step of a generation goes out at once: it is when the job resumed after a restart,
            # which ETTR and the incident timeline date by the heartbeat that shows it.
            self.stepping_announced_generation = self.generation
            due = True
        blocked = self.all_blocked(now)
        if blocked and (blocked != self.blocked_announced or since is None or since >= ALL_BLOCKED_HEARTBEAT):
            # Every rank of this node has waited in a collective for the floor: the controller decides whether
            # the whole job is blocked, and needs this node's part now, and fresh.
            due = True
        self.blocked_announced = blocked
        return due

    def rank_collectives(self, now: datetime) -> dict[int, RankCollective]:
        """The ranks of this generation in the step or eval phase, past their warm-up, inside a collective now.

        Eval counts too: a rank hung inside an eval's collective blocks its peers there just as in a step, and
        the eval timeout (600 s) is far too generous to find it. Every rank inside a collective at once means
        nobody computes for the others in either phase; the per-rank ``collective_stuck`` check stays with the
        step phase, whose waits calibrate it."""
        alive = {process.rank for process in self.supervisor.alive()}
        warmup = InspectorPolicy().warmup_steps  # the first steps compile and connect: their waits say nothing
        return {rank: RankCollective(collective=s.collective or "collective",
                                     waited_s=round(max((now - s.collective_entered_at).total_seconds(), 0.0), 3))
                for rank, s in sorted(self.channel.ranks.items())
                if rank in alive and s.generation == self.generation and normalise_phase(s.phase) in BLOCKING_PHASES
                and s.collective_entered_at is not None and len(s.collective_waits_s) >= warmup}

    def all_blocked(self, now: datetime) -> frozenset[tuple[int, int]]:
        """(rank, collective sequence) of every rank of the node when all of them have been inside a collective
        for ``ALL_BLOCKED_AFTER``; empty otherwise (or on a standby)."""
        if self.spec.standby:
            return frozenset()
        inside = self.rank_collectives(now)
        if len(inside) < self.spec.nproc_per_node or any(c.waited_s < ALL_BLOCKED_AFTER.total_seconds()
                                                         for c in inside.values()):
            return frozenset()
        return frozenset((rank, self.channel.ranks[rank].collective_seq) for rank in inside)

    def _holdings(self) -> dict[CheckpointTier, list[ShardRecord]]:
        """What the heartbeat carries of the checkpoint tiers; nothing when reading them fails (the
        heartbeat is the node's liveness: it goes without them)."""
        if self.checkpointing is None:
            return {}
        try:
            return self.checkpointing.holdings()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("%s: reading the checkpoint holdings failed: %r", self.spec.node_id, exc)
            return {}

    def heartbeat(self, now: datetime) -> None:
        # Per rank (one slow GPU among eight must not vanish in a node-wide median), ranks of this
        # generation stepping now: the heartbeat says which generation its samples are of (fail-slow
        # compares ranks within one), so a rank's last state from before a restart is not one of them.
        compute = {rank: round(statistics.median(list(s.compute_times_s)[-20:]), 6)
                   for rank, s in self.channel.ranks.items()
                   if s.compute_times_s and s.phase == "step" and s.generation == self.generation}
        self.emit(
            NodeHeartbeat(
                node_id=self.spec.node_id,
                standby=self.spec.standby,
                ranks_alive=len(self.supervisor.alive()),
                ranks_expected=0 if self.spec.standby else self.spec.nproc_per_node,
                last_step=max((s.step for s in self.channel.ranks.values()), default=-1),
                step_time_p50_s=self.step_time_p50_s(),
                rank_compute_time_p50_s=compute,
                stored=self._holdings(),
                generation=self.generation,
                # Ranks of this generation that ever reported through the SDK: 0 with ranks alive is a
                # program without it (so far), which the controller and ETTR judge on process liveness.
                ranks_reporting=sum(1 for s in self.channel.ranks.values() if s.generation == self.generation),
                # The slowest rank's running total: a synchronous job waits for it (ETTR charges it).
                checkpoint_blocking_s=max((s.checkpoint_blocking_s for s in self.channel.ranks.values()
                                           if s.generation == self.generation and s.checkpoint_blocking_s > 0),
                                          default=None),
                rank_collectives={} if self.spec.standby else self.rank_collectives(now),
            )
        )
        self.last_heartbeat_at = now

    def tick(self, probe: bool = True) -> AgentResult | None:
        """One pass of the loop; an ``AgentResult`` when the agent should stop. ``probe``: also sample
        the health probes (once per probe interval; exits and reports are handled on every wake-up).

        Every piece runs guarded (``self.pieces``, ``keel.agent.isolation``): one that raises is logged
        (rate-limited) and the others still run, the heartbeat included; the ranks are never touched
        because of it."""
        now = self.clock()
        if self.fence is not None:
            return AgentResult(FENCED_EXIT, f"fenced out of job {self.spec.job_id}: {self.fence.reason}")
        run = self.pieces.run
        zygote = self.supervisor.zygote
        if zygote is not None:
            run("zygote drain", zygote.drain)  # what woke the loop (a child started or exited)
        run("rank reports", self.channel.drain, now, self.generation, self.supervisor.rank_pids())
        for rank, state in list(self.channel.ranks.items()):
            run("metric watch", self._watch_rank, rank, state)
        # A replay's ranks end by design: their exits answer the replay, they are not the job's.
        polled: list[RankExit] = run("rank exits", self.supervisor.poll) or []
        exits = run("sdc replay exits", self.replays.take_exits, polled, default=polled) or []
        failures = [e for e in exits if self._report_exit_guarded(e)]
        run("diagnostics rounds", self.rounds.poll)
        run("stack captures", self.stacks.poll)
        if failures and not self.failed:
            self.failed = True
            if not self.supervised:
                outcome = run("local restart", self._restart_locally, failures)
                if outcome is not None:
                    return outcome
        if probe and self.watcher is not None:
            run("health probes", self._sample_health, now)
        if self.checkpointing is not None:
            run("checkpointing", self._checkpointing_tick)
        if self.heartbeat_due(now, time.monotonic()):
            run("heartbeat", self.heartbeat, now)
        if probe:
            run("zygote upkeep", self.keep_zygote)
        run("agent state", self.record_state)
        if not self.spec.standby and not self.supervisor.ranks and not self.failed and not self.held:
            return AgentResult(0, "every rank finished successfully")
        return None

    def _watch_rank(self, rank: int, state: RankState) -> None:
        for anomaly in self.metric_watch.check(rank, state.generation, state.metric_samples):
            log.warning("%s: %s", self.spec.node_id, anomaly.reason)
            self.emit(anomaly)
        if state.phase == "failed" and self.supervisor.kill_failed(rank, state.error):
            log.info("%s: rank %d reported %s; ending it now", self.spec.node_id, rank,
                     (state.error.strip().splitlines() or ["?"])[-1])

    def _report_exit_guarded(self, exit_: RankExit) -> bool:
        """``report_exit``, guarded: if reporting raises, the exit still counts as what its status says."""
        reported = self.pieces.run("exit report", self.report_exit, exit_)
        if reported is None:
            return not exit_.stopped_by_agent and exit_.exit_code != 0
        return reported

    def _restart_locally(self, failures: list[RankExit]) -> AgentResult | None:
        """torchrun semantics (unsupervised): the job is broken; stop the rest and restart or give up."""
        self.supervisor.stop_all()
        for exit_ in self.supervisor.poll():
            self._report_exit_guarded(exit_)
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self.start_ranks(self.generation + 1)
            if self.checkpointing is not None:
                self.checkpointing.prepare_restart(self.generation)
            self.failed = False
            return None
        return AgentResult(1, f"rank {failures[0].rank} failed and no restarts are left")

    def _sample_health(self, now: datetime) -> None:
        assert self.watcher is not None
        for payload in self.watcher.sample(now, self.channel, self.supervisor):
            self.emit(payload)

    def _checkpointing_tick(self) -> None:
        assert self.checkpointing is not None
        ranks = {r: s for r, s in self.channel.ranks.items() if s.generation == self.generation}
        self.checkpointing.tick(time.monotonic(), {r: s.groups for r, s in ranks.items()},
                                {r: s.checkpoint_step for r, s in ranks.items()})

    # -- a restarted agent ------------------------------------------------------------------------------

    def current_state(self) -> AgentState:
        """What this agent records for a successor (``keel.agent.rejoin``)."""
        me = ProcessRef.of(os.getpid()) or ProcessRef(os.getpid(), 0)
        ranks = {rank: ref for rank, process in self.supervisor.ranks.items()
                 if (ref := ProcessRef.of(process.pid)) is not None}
        zygote = self.supervisor.zygote
        code = self.supervisor.code
        return AgentState(job_id=self.spec.job_id, node_id=self.spec.node_id, agent=me, generation=self.generation,
                          standby=self.spec.standby, node_rank=self.spec.node_rank, ranks=ranks,
                          zygote=ProcessRef.of(zygote.pid) if zygote is not None and zygote.alive() else None,
                          code=code.model_dump(mode="json") if code is not None else None, held=self.held,
                          failed=self.failed)

    def record_state(self) -> None:
        """Write ``<agent_dir>/agent.json`` when what it says changed. Runs on every wake-up: a cheap
        fingerprint first, the ``/proc`` reads only when it moved."""
        zygote, code = self.supervisor.zygote, self.supervisor.code
        fingerprint = (self.generation, self.spec.node_rank, self.spec.standby, self.held, self.failed,
                       tuple((rank, p.pid) for rank, p in self.supervisor.ranks.items()),
                       zygote.pid if zygote is not None and zygote.popen.returncode is None else None,
                       code.version_id if code is not None else None)
        if fingerprint == self._recorded_fingerprint:
            return
        state = self.current_state()
        text = state.to_json()
        if text != self._recorded_state:
            write_state(self.spec.agent_dir, state)
            self._recorded_state = text
        self._recorded_fingerprint = fingerprint

    def find_leftovers(self) -> list[int]:
        """What a previous agent of this folder left running (ranks, their workers, its zygote, a diagnostics
        round). Call before this agent starts any process of its own (they carry the same socket)."""
        previous = self.previous
        recorded = [] if previous is None else [*previous.ranks.values(),
                                                *([previous.zygote] if previous.zygote else [])]
        return leftover_processes(self.channel.path, recorded)

    async def stop_leftovers(self, pids: list[int]) -> list[int]:
        """Stop ``find_leftovers``' processes: no orphan survives, no old rank writes a slot again. Returns
        the pids stopped."""
        if not pids:
            return []
        log.warning("%s: the previous agent of %s left %d process(es) running (%s); stopping them",
                    self.spec.node_id, self.spec.agent_dir, len(pids), ", ".join(map(str, pids)))
        survivors = await asyncio.to_thread(stop_processes, pids)
        if survivors:
            log.error("%s: process(es) %s of the previous agent did not end after SIGKILL", self.spec.node_id,
                      ", ".join(map(str, survivors)))
        return pids

    def take_over_from(self, previous: AgentState) -> None:
        """Take over the job the previous agent died in (see ``keel.agent.rejoin``): its generation, slice and
        code version, its memory tier kept. Its ranks are reported by ``report_previous_ranks``."""
        spec = self.spec
        if previous.node_rank != spec.node_rank:  # a promoted standby's slice
            self.spec = dataclasses.replace(spec, node_rank=previous.node_rank, standby=False)
            self.supervisor.spec = self.spec
            if self.checkpointing is not None:
                self.checkpointing.take_over([self.spec.global_rank(i) for i in range(self.spec.nproc_per_node)])
        if previous.code is not None:
            try:
                code = CodeRef.model_validate(previous.code)
            except ValueError as exc:
                log.warning("%s: the previous agent's code version is unreadable (%s); running the launch "
                            "command", spec.node_id, exc)
            else:
                # The state file is the agent folder's, not the store's: its version is verified again.
                problem = self.use_code(code)
                if problem:
                    log.warning("%s: the previous agent's code version is refused (%s); running the launch "
                                "command", spec.node_id, problem)
        self.generation = previous.generation
        self.supervisor.generation = previous.generation
        if self.checkpointing is not None:
            self.checkpointing.rejoin(previous.generation)
        self.held = previous.held
        self.failed = bool(previous.ranks) or previous.failed

    def report_previous_ranks(self, previous: AgentState, stopped: list[int], why: str) -> None:
        """The previous agent's ranks ended (stopped by this agent, or already gone): report them as an
        infrastructure failure of their generation, so the job restarts from the memory tier."""
        spec = self.spec
        ended = sorted(previous.ranks)
        for rank in ended:
            ref = previous.ranks[rank]
            how = "stopped by this agent" if ref.pid in stopped else "already gone, exit status unknown"
            stderr = file_tail(self.supervisor.logs_dir / f"rank{rank}.g{previous.generation}.stderr", 40)
            self.emit(RankExited(
                node_id=self.spec.node_id, rank=rank, pid=ref.pid, generation=previous.generation, exit_code=None,
                signal="SIGTERM" if ref.pid in stopped else None, classification="infrastructure",
                error_type="AgentRestarted", stderr_tail=printable(stderr[-4000:]),
                reason=f"the node's agent died (pid {previous.agent.pid}) and was restarted; the rank it ran "
                       f"({how}) is restarted from the node's memory tier"), subject=f"rank/{rank}")
        log.warning("%s: %s; %d rank(s) of generation %d ended, memory tier kept (%s)", spec.node_id, why,
                    len(ended), previous.generation, "held for the next command" if self.held else
                    "waiting for the controller's restart" if self.supervised else "restarting them locally")
        if not self.supervised and self.failed:
            # Without a controller: restart from the memory tier now (a local plan), using no --max-restarts.
            self.start_ranks(previous.generation + 1)
            if self.checkpointing is not None:
                self.checkpointing.prepare_restart(self.generation)
            self.failed = False

    async def run(self, stop: asyncio.Event) -> AgentResult:
        try:
            return await self._run(stop)
        finally:
            self.lock.release()

    async def _run(self, stop: asyncio.Event) -> AgentResult:
        fence = read_fence(self.spec.agent_dir)
        refused = fence_refusal(fence, job_id=self.spec.job_id, node_id=self.spec.node_id, standby=self.spec.standby)
        if refused:
            await self.stop_leftovers(self.find_leftovers())
            self.pieces.run("shutdown", remove_state, self.spec.agent_dir)
            log.error("%s: %s", self.spec.node_id, refused)
            return AgentResult(FENCED_EXIT, refused)
        if fence is not None and self.spec.standby:
            log.warning("%s: offered back as a standby after it was fenced (%s); the controller decides",
                        self.spec.node_id, fence.reason)
            (self.spec.agent_dir / FENCE_FILE).unlink(missing_ok=True)
        decision = decide_rejoin(self.previous, job_id=self.spec.job_id, node_id=self.spec.node_id,
                                 standby=self.spec.standby)
        leftovers = self.find_leftovers()
        consumer: asyncio.Task[None] | None = None
        if decision.mode == "rejoin" and decision.previous is not None:
            previous = decision.previous
            self.take_over_from(previous)
            self.emit(NodeRegistered(node_id=self.spec.node_id, host=socket.gethostname(), standby=False,
                                     fault_domain=self.spec.fault_domain, addresses=host_addresses()))
            if self.outbox is not None:
                # Reachable before the old ranks are stopped: their end fails the job's other ranks, and the
                # controller's diagnostics round that follows wants this node's acknowledgement within seconds.
                consumer = asyncio.create_task(CommandConsumer(self).run(stop))
                try:
                    await asyncio.wait_for(self.outbox.connected.wait(), REJOIN_CONNECT_WAIT_S)
                except TimeoutError:
                    log.warning("%s: not connected to NATS after %.0f s; rejoining anyway", self.spec.node_id,
                                REJOIN_CONNECT_WAIT_S)
                self.pieces.run("heartbeat", self.heartbeat, self.clock())
            stopped = await self.stop_leftovers(leftovers)
            if self.spec.warm_ranks:
                self.supervisor.start_zygote()  # not waited for: the restart command comes after a round
                if not self.supervised:
                    await self.wait_zygote_ready()
            self.report_previous_ranks(previous, stopped, decision.reason)
        else:
            await self.stop_leftovers(leftovers)
            if self.previous is not None:
                log.info("%s: %s", self.spec.node_id, decision.reason)
            self.emit(NodeRegistered(node_id=self.spec.node_id, host=socket.gethostname(),
                                     standby=self.spec.standby, fault_domain=self.spec.fault_domain,
                                     addresses=host_addresses()))
            if self.spec.warm_ranks:
                # One import for the node's ranks, rounds and promotions from now on (forks take ms).
                self.supervisor.start_zygote()
                await self.wait_zygote_ready()
            if not self.spec.standby:
                if self.checkpointing is not None:
                    self.checkpointing.start_fresh()
                self.start_ranks(0)
            else:
                self.rounds.start_self_check()
        self.pieces.run("agent state", self.record_state)
        if consumer is None and self.outbox is not None:
            consumer = asyncio.create_task(CommandConsumer(self).run(stop))
        result = AgentResult(143, "stopped")
        # Wake at once when a rank reports or a child exits, not only once per probe interval: a
        # crash is then seen within milliseconds of the process ending.
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        loop.add_reader(self.channel.sock.fileno(), wake.set)
        loop.add_signal_handler(signal.SIGCHLD, wake.set)
        def wake_loop() -> None:
            loop.call_soon_threadsafe(wake.set)

        self._wake = wake_loop
        if self.checkpointing is not None:
            self.checkpointing.wake = self._wake
        interval_s = self.spec.probe_interval.total_seconds()
        next_probe_at = loop.time()
        zygote_fd: int | None = None  # forked ranks are the zygote's children: it reports their exits
        try:
            while not stop.is_set():
                zygote = self.supervisor.zygote
                fd = zygote.fileno() if zygote is not None and zygote.alive() else None
                if fd != zygote_fd:
                    if zygote_fd is not None:
                        loop.remove_reader(zygote_fd)
                    if fd is not None:
                        loop.add_reader(fd, wake.set)
                    zygote_fd = fd
                probe = loop.time() >= next_probe_at
                if probe:
                    next_probe_at = loop.time() + interval_s
                wake.clear()
                try:
                    outcome = self.tick(probe=probe)
                except Exception as exc:  # noqa: BLE001 - tick guards its pieces; this is the last resort
                    self.pieces.failed("tick", exc)
                    outcome = None
                if outcome is not None:
                    result = outcome
                    break
                waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
                await asyncio.wait(waiters, timeout=max(0.0, next_probe_at - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                for waiter in waiters:
                    waiter.cancel()
        finally:
            # Each step guarded: one that raises must not leave the ranks running without an agent.
            run = self.pieces.run
            run("shutdown", loop.remove_reader, self.channel.sock.fileno())
            if zygote_fd is not None:
                run("shutdown", loop.remove_reader, zygote_fd)
            run("shutdown", loop.remove_signal_handler, signal.SIGCHLD)
            run("shutdown", self.rounds.cancel)
            run("shutdown", self.supervisor.stop_all)
            run("shutdown", self.supervisor.close_zygote)
            run("shutdown", self.stacks.close)
            last_exits: list[RankExit] = run("shutdown", self.supervisor.poll) or []
            for exit_ in last_exits:
                self._report_exit_guarded(exit_)
            run("shutdown", self.supervisor.close_output)
            if self.fence is None:
                run("shutdown", self.heartbeat, self.clock())
            if consumer is not None:
                consumer.cancel()
            run("shutdown", self.channel.close)
            if self.checkpointing is not None:
                run("shutdown", self.checkpointing.close, job_finished=result.exit_code == 0 and not self.spec.standby)
            # Ended by itself (finished, failed for good, told to stop, its ranks stopped): the next agent in
            # this folder is a new launch. Only an agent that dies leaves its state behind (a rejoin).
            run("shutdown", remove_state, self.spec.agent_dir)
        return result


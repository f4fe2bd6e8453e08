"""The node agent's loop: supervise ranks, read rank reports, probe health, publish, obey commands.

Once per probe interval: fold the rank reports that arrived; report rank exits (classified); run the
health probes through the pure inspector core and publish its state changes; every heartbeat
interval publish a ``NodeHeartbeat``. Commands addressed to this node are executed only if they have
not expired:

- ``RanksRestartRequested``: restart the ranks in place as a newer generation.
- ``DiagnosticsRequested`` (rung 2), when this node is one of its ``nodes`` and not a standby: stop the
  ranks (their exits are reported, ``stopped_by_agent``), run the round in the background
  (``keel.agent.diagnostics``; the loop keeps beating and obeying), and emit ``DiagnosticsCompleted``
  when it ends or overruns ``timeout_s``. The node then waits, ranks stopped, for the next command.
- ``SdcReplayRequested`` (rung 5), when this node is one of its ``nodes``: stop the ranks and start them
  as the request's generation in replay mode (``$KEEL_SDC_REPLAY``, ``keel.protocol.replay``): they restore
  the broker's plan, replay the step per phase and exit; their exits are the replay's, not the job's (no
  ``RankExited``). ``SdcReplayCompleted`` carries their group results; ranks still running at the
  request's ``timeout_s`` are stopped and reported as not answering. The node then waits, as after a
  diagnostics round.
- ``StandbyPromotionRequested`` to this standby: take ``node_rank``'s slice and start it as
  ``generation``, restoring from the peer copies (``StandbyPromoted``).

A standby runs the local checks (GPU matmul, intra-node all-to-all) once when it starts and reports
``StandbyChecked``: only a passing standby counts for the pool.

Failure handling without a controller (``supervised=False``, plain ``keel run``): like torchrun,
a failed rank stops the node's other ranks, then the agent restarts them locally while
``--max-restarts`` allows, else exits non-zero. Supervised (a local cluster, a real deployment),
the agent reports and waits: the controller decides.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import shutil
import signal
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

from keel.agent.channel import RankChannel
from keel.agent.checkpointing import BROKER_EVENT_TYPES, NodeCheckpointing
from keel.agent.diagnostics import (
    LOCAL_CHECKS,
    DiagnosticsPolicy,
    NodeReport,
    RoundProcess,
    RoundRequest,
    failed_report,
    nic_baseline,
    round_port,
)
from keel.agent.launch_spec import LaunchSpec
from keel.agent.metric_watch import MetricWatch
from keel.agent.stack_capture import NodeCapture, capture_ranks, split_parts
from keel.agent.supervisor import RankExit, RankSupervisor
from keel.events.envelope import Event, EventPayload, InvalidEvent, decode_event, now_utc
from keel.events.types import (
    CodeRef,
    CodeVersionApplied,
    DiagnosticsCompleted,
    DiagnosticsRequested,
    MissingProcess,
    NodeHeartbeat,
    NodeRegistered,
    RankExited,
    RanksRestarted,
    RanksRestartRequested,
    RankStarted,
    RankTopology,
    SdcGroupResult,
    SdcReplayCompleted,
    SdcReplayRequested,
    StacksCaptured,
    StacksRequested,
    StandbyChecked,
    StandbyPromoted,
    StandbyPromotionRequested,
)
from keel.infra.bus import fetch_batch
from keel.infra.outbox import Outbox
from keel.infra.subjects import encode_token, subject_filter
from keel.protocol.replay import REPLAY_ENV, result_path
from keel.rules.metrics import MetricSettings

log = logging.getLogger(__name__)

PRODUCER = "agent"

NODE_COMMANDS = (RanksRestartRequested, StandbyPromotionRequested)
"""Commands addressed to one node (``node/<id>``): an agent's consumer takes only its own node's."""
JOB_COMMANDS = (DiagnosticsRequested, StacksRequested, SdcReplayRequested)
"""Commands to several nodes at once (their ``nodes`` list): one job-wide event each, since the round that
answers it is keyed on that one request id; every agent takes them and sees whether it is named."""
COMMAND_TYPES = frozenset(c.event_name for c in (*NODE_COMMANDS, *JOB_COMMANDS))


def command_subjects(prefix: str, job_id: str, node_id: str, *, checkpointing: bool) -> list[str]:
    """The subjects a node agent consumes: its own node's commands, the job-wide ones, and (``checkpointing``)
    the checkpoint broker's job-wide events (``keel.infra.subjects``)."""
    subjects = [subject_filter(prefix, job_id, c.aggregate, node_id, c.event_name) for c in NODE_COMMANDS]
    subjects += [subject_filter(prefix, job_id, c.aggregate, None, c.event_name) for c in JOB_COMMANDS]
    if checkpointing:
        subjects += [subject_filter(prefix, job_id, "job", None, name) for name in BROKER_EVENT_TYPES]
    return subjects


STEPPING_PHASES = frozenset({"step", "checkpoint", "eval", "done"})
"""Rank phases past setup (restore included)."""
ZYGOTE_RESTART_AFTER_S = 60.0
"""Replace a dead zygote this long after a start even if the ranks never said they step (a program
without the SDK sends no reports)."""
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


class PromotionError(ValueError):
    """A promotion command this node cannot carry out as given; the message says why."""


def promoted_spec(spec: LaunchSpec, node_rank: int, ranks: list[int]) -> LaunchSpec:
    """The launch spec of a standby taking over ``node_rank``'s slice (pure). The command's ``ranks``
    must be exactly that slice for this job's ``nproc_per_node``; raises ``PromotionError`` otherwise."""
    if not 0 <= node_rank < spec.nnodes:
        raise PromotionError(f"node rank {node_rank} is outside 0..{spec.nnodes - 1}")
    promoted = dataclasses.replace(spec, node_rank=node_rank, standby=False)
    expected = [promoted.global_rank(i) for i in range(spec.nproc_per_node)]
    if sorted(ranks) != expected:
        raise PromotionError(f"ranks {sorted(ranks)} are not node rank {node_rank}'s slice {expected} "
                             f"({spec.nproc_per_node} per node)")
    return promoted


@dataclass
class ActiveRound:
    """A diagnostics round (or a standby's self-check) running in the background."""

    process: RoundProcess
    command: Event | None
    """The ``DiagnosticsRequested`` it answers; None for a standby's self-check."""


@dataclass
class ActiveReplay:
    """A rung-5 replay running on this node: its command, folder and deadline, and the ranks that ended."""

    command: Event
    directory: Path
    generation: int
    ranks: list[int]
    started_s: float
    deadline_s: float
    exits: dict[int, RankExit] = field(default_factory=dict)


def replay_spec_json(request: SdcReplayRequested, result_dir: Path) -> str:
    """The ``$KEEL_SDC_REPLAY`` file for ``request``: its phases with each group's units as global ranks."""
    ranks = {u.name: u.ranks for u in request.units}
    phases = [{"index": ph.index, "kind": ph.kind,
               "groups": [sorted(r for name in group for r in ranks.get(name, [])) for group in ph.groups]}
              for ph in request.phases]
    return json.dumps({"round": request.round, "anomaly_step": request.anomaly_step, "phases": phases,
                       "result_dir": str(result_dir)})


def replay_answer(request: SdcReplayRequested, node_id: str, request_id: str, ranks: list[int],
                  exits: dict[int, RankExit], result_dir: Path, duration_s: float) -> SdcReplayCompleted:
    """This node's ``SdcReplayCompleted`` from its ranks' exits and result files: ``ran`` only when every
    local rank wrote a readable answer (a rank that crashes after writing it still answered); otherwise
    ``detail`` says which did not, and why."""
    results: list[SdcGroupResult] = []
    restored: list[int] = []
    problems: list[str] = []
    details: list[str] = []
    for rank in ranks:
        exit_ = exits.get(rank)
        path = result_path(result_dir, rank)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            for r in data["results"]:
                results.append(SdcGroupResult(rank=rank, phase=r["phase"], group=r["group"], consistent=r["consistent"],
                                              digest=r.get("digest", ""), detail=r.get("detail", "")))
            restored.append(int(data["restored_step"]))
            if data.get("detail"):
                details.append(str(data["detail"]))
        except FileNotFoundError:
            if exit_ is None:
                problems.append(f"rank {rank} did not finish in time (the round's timeout is {request.timeout_s:g} s)")
            else:
                how = f"exit code {exit_.exit_code}" if exit_.signal is None else exit_.signal
                last = (exit_.reported_failure or exit_.stderr_tail).strip().splitlines()[-1:] or ["no output"]
                problems.append(f"rank {rank} ended ({how}) without an answer: {last[0][:300]}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"rank {rank} wrote an unreadable answer ({type(exc).__name__}: {exc})")
    ran = not problems
    return SdcReplayCompleted(node_id=node_id, request_id=request_id, round=request.round, ran=ran,
                              restored_step=min(restored) if restored else -1, results=results if ran else [],
                              detail="; ".join(problems) if problems else (details[0] if details else ""),
                              duration_s=round(duration_s, 3))


class HealthWatcher(Protocol):
    """What the agent needs from the inspector: observations in, health state changes out."""

    def sample(self, now: datetime, channel: RankChannel, supervisor: RankSupervisor) -> list[EventPayload]: ...


@dataclass
class AgentResult:
    exit_code: int
    reason: str


class NodeAgent:
    def __init__(
        self,
        spec: LaunchSpec,
        *,
        outbox: Outbox | None,
        watcher: HealthWatcher | None,
        classify: Callable[[int | None, str | None, str], tuple[str, str, str]],
        supervised: bool,
        checkpointing: NodeCheckpointing | None = None,
        clock: Callable[[], datetime] = now_utc,
        diagnostics_policy: DiagnosticsPolicy | None = None,
        metric_settings: MetricSettings | None = None,
    ) -> None:
        self.spec = spec
        self.outbox = outbox
        self.watcher = watcher
        self.classify = classify
        self.supervised = supervised
        self.clock = clock
        self.checkpointing = checkpointing
        spec.agent_dir.mkdir(parents=True, exist_ok=True)
        self.channel = RankChannel(spec.agent_dir / "agent.sock")
        self.metric_watch = MetricWatch(spec.node_id, metric_settings or MetricSettings())
        self.supervisor = RankSupervisor(spec, self.channel.path, spec.agent_dir / "fault.json", warm=spec.warm_ranks)
        # Ready files of a previous agent in this folder (killed with its node) name nothing alive.
        shutil.rmtree(spec.agent_dir / "warm", ignore_errors=True)
        self.generation_started_s = time.monotonic()
        self.generation = 0
        self.restarts_left = spec.max_restarts
        self.failed = False
        self.last_heartbeat_at: datetime | None = None
        self.diagnostics_policy = diagnostics_policy or DiagnosticsPolicy()
        self.active_round: ActiveRound | None = None
        self.rounds_seen: set[int] = set()
        self.held = False
        """The ranks were stopped on command (diagnostics) and wait for the next one: not "finished"."""
        self.stack_rounds_seen: set[int] = set()
        self.replay: ActiveReplay | None = None
        self.replay_rounds_seen: set[int] = set()
        self.stack_captures: list[tuple[Event, concurrent.futures.Future[NodeCapture]]] = []
        """Captures running in the background (py-spy takes ~0.1-0.5 s a process), with their request."""
        self._capture_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._wake: Callable[[], None] = lambda: None
        """Wakes the loop from another thread (set by ``run``)."""
        self.nic_baseline = nic_baseline(spec.root)
        """Link change counters when this node was last vetted (simulated nodes only; judges flaps)."""

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

    def use_code(self, code: CodeRef | None) -> str:
        """Switch the code the next ranks run (None: keep it). Returns why it cannot, or ""."""
        if code is None:
            return ""
        if code.path and not Path(code.path).is_dir():
            return f"code version {code.version_id}: {code.path} is not a directory on {self.spec.node_id}"
        self.supervisor.code = code
        return ""

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
            reported = self.classify(1, None, exit_.reported_failure)
            if (classification != "infrastructure" and reported[0] == "infrastructure") or (
                    classification == "unknown" and (reported[0] == "user_code" or (not error_type and reported[1]))):
                # The rank's own traceback (the SDK sends its tail) over a stderr tail that was cut short
                # or muddled by output after the traceback: an infrastructure error it names wins, and so
                # does a frame in the user's code, or any named exception, when the captured stderr told
                # nothing.
                classification, error_type, reason = reported
            named = (exit_.reported_failure.strip().splitlines() or ["?"])[-1][:300]
            reason = f"{reason} (the rank reported {named!r}; the agent ended its shutdown)"
        else:
            classification, error_type, reason = self.classify(exit_.exit_code, exit_.signal, exit_.stderr_tail)
        tail = exit_.stderr_tail
        if "Traceback (most recent call last)" in exit_.reported_failure:
            # The rank's own traceback goes last: whoever reads the tail (the controller's failure
            # fingerprint: the innermost frame) sees the exception it died of, whatever stderr held.
            reported = exit_.reported_failure[-3000:]
            tail = f"{tail[-(3900 - len(reported)):]}\n[the traceback the rank reported]\n{reported}"
        self.emit(
            RankExited(node_id=self.spec.node_id, rank=exit_.rank, pid=exit_.pid, generation=exit_.generation,
                       exit_code=exit_.exit_code, signal=exit_.signal, classification=classification,  # type: ignore[arg-type]
                       error_type=error_type, stderr_tail=tail[-4000:], reason=reason),
            subject=f"rank/{exit_.rank}",
        )
        log.info("%s: rank %d exited (%s, code %s, signal %s): %s", self.spec.node_id, exit_.rank, classification,
                 exit_.exit_code, exit_.signal, reason)
        return classification not in ("success", "stopped_by_agent")

    # -- commands ----------------------------------------------------------------------------------

    def handle_command(self, command: Event) -> None:
        """Carry out a command addressed to this node (others are ignored). Called from the loop."""
        payload = command.payload
        if isinstance(payload, DiagnosticsRequested):
            self.handle_diagnostics(command)
        elif isinstance(payload, StandbyPromotionRequested):
            self.handle_promotion(command)
        elif isinstance(payload, RanksRestartRequested) and payload.node_id == self.spec.node_id:
            self.handle_restart(command)
        elif isinstance(payload, StacksRequested):
            self.handle_stacks(command)
        elif isinstance(payload, SdcReplayRequested):
            self.handle_replay(command)

    def stop_ranks(self) -> None:
        self.supervisor.stop_all()
        for exit_ in self.supervisor.poll():
            self.report_exit(exit_)

    def handle_restart(self, command: Event) -> None:
        payload = command.payload
        assert isinstance(payload, RanksRestartRequested)
        now = self.clock()
        if now > payload.expires_at:
            outcome, detail = "expired", f"command expired at {payload.expires_at.isoformat()}; not executed"
        elif payload.generation <= self.generation:
            outcome, detail = "stale_generation", f"already at generation {self.generation}"
        elif problem := self.use_code(payload.code):
            outcome, detail = "failed", f"{problem}; the ranks keep running"
        else:
            if self.active_round is not None:
                log.warning("%s: a restart command arrived while diagnostics ran; ending the round unreported",
                            self.spec.node_id)
                self.cancel_round()
            self.finish_replay(force=True)
            self.stop_ranks()
            if self.spec.standby:
                # A standby told to run its slice (a replacement started with `keel cluster`'s start_node)
                # is a worker from now on: it takes part in diagnostics and exits when its ranks finish.
                self.spec = dataclasses.replace(self.spec, standby=False)
                self.supervisor.spec = self.spec
                self.cancel_round()
            # Start the new processes first: the inventory (hashing every slot) overlaps their start-up,
            # and they wait for the restore plan it leads to.
            self.start_ranks(payload.generation)
            if self.checkpointing is not None:
                self.checkpointing.prepare_restart(payload.generation)
            self.failed = False
            outcome, detail = "restarted", f"restarted {self.spec.nproc_per_node} ranks in place: {payload.reason}"
        self.emit(
            RanksRestarted(node_id=self.spec.node_id, command_id=str(command.id), generation=self.generation,
                           outcome=outcome, detail=detail),  # type: ignore[arg-type]
            causation=command,
        )

    # -- diagnostics and standbys ---------------------------------------------------------------

    def handle_diagnostics(self, command: Event) -> None:
        """Rung 2: stop the ranks and run this node's side of the round in the background."""
        payload = command.payload
        assert isinstance(payload, DiagnosticsRequested)
        node = self.spec.node_id
        if self.spec.standby or node not in payload.nodes:
            log.debug("%s: diagnostics round %d is not for this node", node, payload.round)
            return
        if self.clock() > payload.expires_at:
            log.warning("%s: diagnostics round %d expired at %s; not run (the ranks keep running)", node,
                        payload.round, payload.expires_at.isoformat())
            return
        if payload.round in self.rounds_seen:
            log.info("%s: diagnostics round %d was run already (a redelivered command); ignored", node, payload.round)
            return
        self.finish_replay(force=True)  # a replay still running ends, answered with what it has
        if self.active_round is not None:
            log.warning("%s: diagnostics round %d supersedes the round still running; ending that one unreported",
                        node, payload.round)
            self.cancel_round()
        self.rounds_seen.add(payload.round)
        # The controller concludes the round at its decision time + timeout_s. Answer by three quarters of
        # that (stopping the ranks counts against it): peers that name a node which never joined must be
        # heard before the controller's own deadline; the last quarter covers transport and clock skew.
        deadline = max(time.time() + 5.0, command.occurred_at.timestamp() + 0.75 * payload.timeout_s)
        self.stop_ranks()
        self.held = True
        request = RoundRequest(
            round=payload.round, node_id=node, nodes=payload.nodes, checks=payload.checks,
            nproc_per_node=self.spec.nproc_per_node, master_addr=self.spec.master_addr,
            master_port=round_port(self.spec.master_port, payload.round), deadline_unix_s=deadline,
            root=str(self.spec.root), nic_baseline=self.nic_baseline, policy=self.diagnostics_policy)
        self.launch_round(request, f"round-{payload.round}", command)
        log.info("%s: diagnostics round %d started (%s; %.0fs): %s", node, payload.round, ", ".join(payload.checks),
                 payload.timeout_s, payload.reason)

    def handle_replay(self, command: Event) -> None:
        """Rung 5: restart this node's ranks in replay mode (see the module docstring)."""
        payload = command.payload
        assert isinstance(payload, SdcReplayRequested)
        node = self.spec.node_id
        if self.spec.standby or node not in payload.nodes or payload.round in self.replay_rounds_seen:
            return
        self.replay_rounds_seen.add(payload.round)
        if self.clock() > payload.expires_at or payload.generation <= self.generation:
            why = (f"command expired at {payload.expires_at.isoformat()}" if self.clock() > payload.expires_at
                   else f"already at generation {self.generation}")
            log.warning("%s: replay round %d not run: %s", node, payload.round, why)
            self.emit(SdcReplayCompleted(node_id=node, request_id=str(command.id), round=payload.round, ran=False,
                                         detail=f"not run: {why}"), causation=command)
            return
        self.cancel_round()
        self.finish_replay(force=True)
        self.stop_ranks()
        directory = self.spec.agent_dir / "sdc" / f"round-{payload.round}"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        spec_path = directory / "replay.json"
        spec_path.write_text(replay_spec_json(payload, directory), encoding="utf-8")
        self.start_ranks(payload.generation, extra_env={REPLAY_ENV: str(spec_path)})
        if self.checkpointing is not None:
            self.checkpointing.prepare_restart(payload.generation)
        # The analyzer judges at the request's time + timeout_s: answer by three quarters of that (stopping
        # the old ranks counts against it), so ranks that are merely slow are heard, not counted missing.
        now_s = time.monotonic()
        left_s = max(5.0, command.occurred_at.timestamp() + 0.75 * payload.timeout_s - time.time())
        self.replay = ActiveReplay(command, directory, payload.generation, sorted(self.supervisor.ranks), now_s,
                                   now_s + left_s)
        log.info("%s: replay round %d started as generation %d (%d phase(s)): %s", node, payload.round,
                 payload.generation, len(payload.phases), payload.reason)

    def finish_replay(self, force: bool = False) -> None:
        """Answer the running replay once every local rank ended (or at its deadline, or ``force``)."""
        replay = self.replay
        if replay is None:
            return
        if len(replay.exits) < len(replay.ranks) and not force and time.monotonic() < replay.deadline_s:
            return
        if len(replay.exits) < len(replay.ranks):
            self.supervisor.stop_all()
            for exit_ in self.supervisor.poll():
                if exit_.generation == replay.generation:
                    replay.exits.setdefault(exit_.rank, dataclasses.replace(exit_, exit_code=None, signal="deadline"))
        self.replay = None
        payload = replay.command.payload
        assert isinstance(payload, SdcReplayRequested)
        answer = replay_answer(payload, self.spec.node_id, str(replay.command.id), replay.ranks,
                               {r: e for r, e in replay.exits.items() if e.signal != "deadline"}, replay.directory,
                               time.monotonic() - replay.started_s)
        self.emit(answer, causation=replay.command)
        self.held = True  # the ranks are done; the node waits for the controller's next command
        log.info("%s: replay round %d %s in %.1fs: %s", self.spec.node_id, payload.round,
                 "answered" if answer.ran else "FAILED", answer.duration_s, answer.detail)

    def start_self_check(self) -> None:
        """A standby's local checks, once at start (reported as ``StandbyChecked``)."""
        policy = self.diagnostics_policy
        request = RoundRequest(round=0, node_id=self.spec.node_id, nodes=[self.spec.node_id], checks=list(LOCAL_CHECKS),
                               nproc_per_node=self.spec.nproc_per_node, deadline_unix_s=time.time()
                               + policy.standby_check_timeout_s, root=str(self.spec.root), policy=policy)
        self.launch_round(request, "self-check", None)

    def launch_round(self, request: RoundRequest, name: str, command: Event | None) -> None:
        directory = self.spec.agent_dir / "diagnostics" / name
        try:
            process = RoundProcess(request, directory, zygote=self.supervisor.zygote)
        except OSError as exc:
            log.error("%s: cannot start diagnostics %s: %s", self.spec.node_id, name, exc)
            self.finish_round(failed_report(request, f"the diagnostics could not start: {exc}"), command)
            return
        self.active_round = ActiveRound(process, command)

    def cancel_round(self) -> None:
        if self.active_round is not None:
            self.active_round.process.kill()
            self.active_round = None

    def poll_round(self) -> None:
        """Report the background round once it ended (or overran: then it is killed)."""
        active = self.active_round
        if active is None:
            return
        report = active.process.poll()
        if report is None:
            return
        self.active_round = None
        self.finish_round(report, active.command)

    def finish_round(self, report: NodeReport, command: Event | None) -> None:
        node = self.spec.node_id
        if command is None:
            self.emit(StandbyChecked(node_id=node, passed=report.passed, results=report.results, detail=report.detail))
            log.info("%s: standby self-check %s: %s", node, "passed" if report.passed else "FAILED", report.detail)
            return
        payload = command.payload
        assert isinstance(payload, DiagnosticsRequested)
        self.emit(DiagnosticsCompleted(node_id=node, request_id=str(command.id), round=payload.round,
                                       passed=report.passed, results=report.results, suspects=report.suspects,
                                       detail=report.detail), causation=command)
        # The next round judges flaps from here: a link that flapped before this round was reported now.
        self.nic_baseline = nic_baseline(self.spec.root)
        log.info("%s: diagnostics round %d %s in %.1fs: %s", node, payload.round,
                 "passed" if report.passed else "FAILED", report.duration_s, report.detail)

    def handle_promotion(self, command: Event) -> None:
        """Take over a slice of ranks as a promoted standby (``StandbyPromoted`` says how it went)."""
        payload = command.payload
        assert isinstance(payload, StandbyPromotionRequested)
        if payload.node_id != self.spec.node_id:
            return
        if self.clock() > payload.expires_at:
            outcome, detail = "expired", f"command expired at {payload.expires_at.isoformat()}; not executed"
        elif not self.spec.standby:
            outcome, detail = "not_standby", f"{self.spec.node_id} is not a standby (it runs node rank {self.spec.node_rank})"
        else:
            try:
                spec = promoted_spec(self.spec, payload.node_rank, payload.ranks)
                problem = self.use_code(payload.code)
            except PromotionError as exc:
                spec, problem = self.spec, str(exc)
            if problem:
                outcome, detail = "failed", problem
            else:
                if self.active_round is not None:
                    log.info("%s: promoted while its self-check ran; ending the check unreported", spec.node_id)
                    self.cancel_round()
                self.spec = spec
                self.supervisor.spec = spec
                if self.checkpointing is not None:
                    self.checkpointing.take_over([spec.global_rank(i) for i in range(spec.nproc_per_node)])
                self.start_ranks(payload.generation)
                if self.checkpointing is not None:
                    # The inventory names the ranks taken over: the broker plans their restore from peers.
                    self.checkpointing.prepare_restart(payload.generation)
                self.failed = False
                outcome = "promoted"
                detail = (f"took over node rank {spec.node_rank} (ranks {payload.ranks}) of {payload.replaces_node_id} "
                          f"as generation {payload.generation}: {payload.reason}")
        self.emit(StandbyPromoted(node_id=self.spec.node_id, command_id=str(command.id),
                                  replaces_node_id=payload.replaces_node_id, generation=self.generation,
                                  outcome=outcome, detail=detail),  # type: ignore[arg-type]
                  causation=command)
        log.info("%s: promotion %s: %s", self.spec.node_id, outcome, detail)

    # -- stacks (rung 3) ---------------------------------------------------------------------------

    def handle_stacks(self, command: Event) -> None:
        """Capture the stacks of every process of this node's ranks in the background; never stops them."""
        payload = command.payload
        assert isinstance(payload, StacksRequested)
        node = self.spec.node_id
        if node not in payload.nodes or self.spec.standby:
            return
        if self.clock() > payload.expires_at:
            log.warning("%s: stack capture round %d expired at %s; not run", node, payload.round,
                        payload.expires_at.isoformat())
            return
        if payload.round in self.stack_rounds_seen:
            log.info("%s: stack capture round %d was run already (a redelivered command); ignored", node, payload.round)
            return
        self.stack_rounds_seen.add(payload.round)
        rank_pids: dict[int, int | None] = {self.spec.global_rank(i): None for i in range(self.spec.nproc_per_node)}
        for process in self.supervisor.alive():
            rank_pids[process.rank] = process.pid
        if self._capture_pool is None:
            self._capture_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stacks")
        future = self._capture_pool.submit(capture_ranks, rank_pids, native=payload.native,
                                           timeout_s=max(1.0, 0.8 * payload.timeout_s))
        self.stack_captures.append((command, future))
        future.add_done_callback(lambda _: self._wake())
        log.info("%s: capturing the stacks of ranks %s (round %d): %s", node, sorted(rank_pids), payload.round,
                 payload.reason)

    def poll_stacks(self) -> None:
        for command, future in [c for c in self.stack_captures if c[1].done()]:
            self.stack_captures.remove((command, future))
            payload = command.payload
            assert isinstance(payload, StacksRequested)
            try:
                capture = future.result()
            except Exception as exc:  # noqa: BLE001 - reported as missing evidence, never as healthy
                capture = NodeCapture([], [MissingProcess(rank=self.spec.global_rank(i), reason=f"the capture failed: "
                                                          f"{exc!r}") for i in range(self.spec.nproc_per_node)], 0.0)
            ranks = []
            for rank, state in sorted(self.channel.ranks.items()):
                if state.generation == self.generation and state.groups:
                    ranks.append(RankTopology(rank=rank, tp=state.groups.get("tp", [rank]),
                                              pp=state.groups.get("pp", [rank]), dp=state.groups.get("dp", [rank])))
            budget = (self.outbox.bus.settings.max_event_bytes if self.outbox is not None and self.outbox.bus
                      else 256 * 1024) // 2
            parts = split_parts(capture.processes, budget)
            for index, processes in enumerate(parts):
                self.emit(StacksCaptured(node_id=self.spec.node_id, request_id=str(command.id), round=payload.round,
                                         processes=processes, ranks=ranks if index == 0 else [],
                                         missing=capture.missing if index == 0 else [], part=index, parts=len(parts),
                                         duration_s=round(capture.duration_s, 3)), causation=command)
            log.info("%s: stacks of round %d: %d processes in %.2fs, %d missing", self.spec.node_id, payload.round,
                     len(capture.processes), capture.duration_s, len(capture.missing))

    # -- the zygote ----------------------------------------------------------------------------------

    def keep_zygote(self) -> None:
        """Replace a dead zygote when that no longer competes with a start (``zygote_restart_due``)."""
        if not self.supervisor.zygote_needed():
            return
        ours = [s for s in self.channel.ranks.values() if s.generation == self.generation]
        stepping = len(ours) >= len(self.supervisor.ranks) and all(s.phase in STEPPING_PHASES for s in ours)
        if zygote_restart_due(standby=self.spec.standby, held=self.held, failed=self.failed,
                              round_running=self.active_round is not None, ranks_running=len(self.supervisor.alive()),
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

    # -- the command consumer ------------------------------------------------------------------------

    async def consume_commands(self, stop: asyncio.Event) -> None:
        assert self.outbox is not None
        await self.outbox.connected.wait()
        bus = self.outbox.bus
        assert bus is not None
        subjects = command_subjects(bus.settings.subject_prefix, self.spec.job_id, self.spec.node_id,
                                    checkpointing=self.checkpointing is not None)
        # "node": named apart from the consumers of before node-addressed subjects, whose filters match
        # nothing any more (an existing consumer is never reconfigured: Bus.pull_consumer keeps it).
        sub = await bus.pull_consumer(f"agent-{self.spec.job_id}-{encode_token(self.spec.node_id)}-node-{len(subjects)}",
                                      filter_subjects=subjects)
        while not stop.is_set():
            for msg in await fetch_batch(sub, 16, 0.5):
                try:
                    command = decode_event(msg.data, max_bytes=bus.settings.max_event_bytes)
                except InvalidEvent as exc:
                    log.warning("ignoring malformed command: %s", exc.reason)
                    await msg.term()
                    continue
                if command.type in COMMAND_TYPES:
                    if (isinstance(command.payload, DiagnosticsRequested) and not self.spec.standby
                            and self.spec.node_id in command.payload.nodes):
                        # Acknowledge at once, before stopping the ranks (which may take their grace
                        # time): the controller takes a node that sends nothing after a request as lost.
                        self.heartbeat(self.clock())
                        await self.outbox.flush(1.0)
                    self.handle_command(command)
                elif self.checkpointing is not None:
                    self.checkpointing.handle_event(command)
                await msg.ack()

    # -- the loop ---------------------------------------------------------------------------------

    def heartbeat(self, now: datetime) -> None:
        step_times = [t for s in self.channel.ranks.values() for t in list(s.step_times_s)[-20:]]
        # Per rank (one slow GPU among eight must not vanish in a node-wide median), ranks stepping now.
        compute = {rank: round(statistics.median(list(s.compute_times_s)[-20:]), 6)
                   for rank, s in self.channel.ranks.items() if s.compute_times_s and s.phase == "step"}
        self.emit(
            NodeHeartbeat(
                node_id=self.spec.node_id,
                standby=self.spec.standby,
                ranks_alive=len(self.supervisor.alive()),
                ranks_expected=0 if self.spec.standby else self.spec.nproc_per_node,
                last_step=max((s.step for s in self.channel.ranks.values()), default=-1),
                step_time_p50_s=statistics.median(step_times) if step_times else None,
                rank_compute_time_p50_s=compute,
            )
        )
        self.last_heartbeat_at = now

    def tick(self, probe: bool = True) -> AgentResult | None:
        """One pass of the loop; an ``AgentResult`` when the agent should stop. ``probe``: also sample
        the health probes (once per probe interval; exits and reports are handled on every wake-up)."""
        now = self.clock()
        if self.supervisor.zygote is not None:
            self.supervisor.zygote.drain()  # what woke the loop (a child started or exited)
        self.channel.drain(now, self.generation)
        for rank, state in self.channel.ranks.items():
            for anomaly in self.metric_watch.check(rank, state.generation, state.metric_samples):
                log.warning("%s: %s", self.spec.node_id, anomaly.reason)
                self.emit(anomaly)
            if state.phase == "failed" and self.supervisor.kill_failed(rank, state.error):
                log.info("%s: rank %d reported %s; ending it now", self.spec.node_id, rank,
                         (state.error.strip().splitlines() or ["?"])[-1])
        exits = self.supervisor.poll()
        if self.replay is not None:
            # A replay's ranks end by design: their exits answer the replay, they are not the job's.
            for exit_ in exits:
                if exit_.generation == self.replay.generation:
                    self.replay.exits[exit_.rank] = exit_
            exits = [e for e in exits if e.generation != self.replay.generation]
            self.finish_replay()
        failures = [e for e in exits if self.report_exit(e)]
        self.poll_round()
        self.poll_stacks()
        if failures and not self.failed:
            self.failed = True
            if not self.supervised:
                # torchrun semantics: the job is broken; stop the rest and restart or give up.
                self.supervisor.stop_all()
                for exit_ in self.supervisor.poll():
                    self.report_exit(exit_)
                if self.restarts_left > 0:
                    self.restarts_left -= 1
                    self.start_ranks(self.generation + 1)
                    if self.checkpointing is not None:
                        self.checkpointing.prepare_restart(self.generation)
                    self.failed = False
                else:
                    return AgentResult(1, f"rank {failures[0].rank} failed and no restarts are left")
        if probe and self.watcher is not None:
            for payload in self.watcher.sample(now, self.channel, self.supervisor):
                self.emit(payload)
        if self.checkpointing is not None:
            ranks = {r: s for r, s in self.channel.ranks.items() if s.generation == self.generation}
            self.checkpointing.tick(time.monotonic(), {r: s.groups for r, s in ranks.items()},
                                    {r: s.checkpoint_step for r, s in ranks.items()})
        if self.last_heartbeat_at is None or now - self.last_heartbeat_at >= self.spec.heartbeat_interval:
            self.heartbeat(now)
        if probe:
            self.keep_zygote()
        if not self.spec.standby and not self.supervisor.ranks and not self.failed and not self.held:
            return AgentResult(0, "every rank finished successfully")
        return None

    async def run(self, stop: asyncio.Event) -> AgentResult:
        self.emit(NodeRegistered(node_id=self.spec.node_id, host=socket.gethostname(), standby=self.spec.standby,
                                 fault_domain=self.spec.fault_domain))
        if self.spec.warm_ranks:
            # One import for the node's ranks, rounds and promotions from now on (forks take ms).
            self.supervisor.start_zygote()
            await self.wait_zygote_ready()
        if not self.spec.standby:
            if self.checkpointing is not None:
                self.checkpointing.start_fresh()
            self.start_ranks(0)
        else:
            self.start_self_check()
        commands = asyncio.create_task(self.consume_commands(stop)) if self.outbox is not None else None
        result = AgentResult(143, "stopped")
        # Wake at once when a rank reports or a child exits, not only once per probe interval: a
        # crash is then seen within milliseconds of the process ending.
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        loop.add_reader(self.channel.sock.fileno(), wake.set)
        loop.add_signal_handler(signal.SIGCHLD, wake.set)
        self._wake = lambda: loop.call_soon_threadsafe(wake.set)
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
                outcome = self.tick(probe=probe)
                if outcome is not None:
                    result = outcome
                    break
                waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
                await asyncio.wait(waiters, timeout=max(0.0, next_probe_at - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                for waiter in waiters:
                    waiter.cancel()
        finally:
            loop.remove_reader(self.channel.sock.fileno())
            if zygote_fd is not None:
                loop.remove_reader(zygote_fd)
            loop.remove_signal_handler(signal.SIGCHLD)
            self.cancel_round()
            self.supervisor.stop_all()
            self.supervisor.close_zygote()
            if self._capture_pool is not None:
                self._capture_pool.shutdown(wait=False, cancel_futures=True)
            for exit_ in self.supervisor.poll():
                self.report_exit(exit_)
            self.heartbeat(self.clock())
            if commands is not None:
                commands.cancel()
            self.channel.close()
            if self.checkpointing is not None:
                self.checkpointing.close(job_finished=result.exit_code == 0 and not self.spec.standby)
        return result


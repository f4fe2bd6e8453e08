"""What a node agent does on the control plane's commands; the loop (``keel.agent.agent``) calls in here.

``handle_command`` dispatches a command to its handler. Each handler is given the agent as a ``Node``
(the state and actions it shares with the loop: the spec, the generation, starting and stopping ranks,
emitting) and keeps its own state:

- ``RanksRestartRequested`` (``handle_restart``): restart the ranks in place as a newer generation.
- ``StandbyPromotionRequested`` to this standby (``handle_promotion``): take ``node_rank``'s slice and
  start it as ``generation``, restoring from the peer copies (``StandbyPromoted``).
- ``DiagnosticsRequested`` (rung 2, ``DiagnosticsRounds``), when this node is one of its ``nodes`` and not
  a standby: stop the ranks (their exits are reported, ``stopped_by_agent``), run the round in the
  background (``keel.agent.diagnostics``; the loop keeps beating and obeying), and emit
  ``DiagnosticsCompleted`` when it ends or overruns ``timeout_s``. The node then waits, ranks stopped, for
  the next command. A standby's self-check at start (``StandbyChecked``) runs the same way.
- ``StacksRequested`` (rung 3, ``StackCaptures``): capture every rank process's stacks in the background;
  the ranks keep running.
- ``SdcReplayRequested`` (rung 5, ``SdcReplays``), when this node is one of its ``nodes``: stop the ranks
  and start them as the request's generation in replay mode (``$KEEL_SDC_REPLAY``, ``keel.protocol.replay``):
  they restore the broker's plan, replay the step per phase and exit; their exits are the replay's, not the
  job's (no ``RankExited``). ``SdcReplayCompleted`` carries their group results; ranks still running at the
  request's ``timeout_s`` are stopped and reported as not answering. The node then waits, as after a
  diagnostics round.

A command is carried out only if it has not expired; a redelivered one (the same round, an older
generation) is not carried out again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

from keel.agent.channel import RankChannel
from keel.agent.checkpointing import NodeCheckpointing
from keel.agent.clock import plausible_age_s
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
from keel.agent.stack_capture import NodeCapture, capture_ranks, split_parts
from keel.agent.supervisor import RankExit, RankSupervisor
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CodeRef,
    DiagnosticsCompleted,
    DiagnosticsRequested,
    MissingProcess,
    RanksRestarted,
    RanksRestartRequested,
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
from keel.infra.outbox import Outbox
from keel.protocol.replay import REPLAY_ENV, result_path

log = logging.getLogger(__name__)


class Node(Protocol):
    """What the command handlers share with the agent's loop (``NodeAgent`` is one)."""

    spec: LaunchSpec
    generation: int
    failed: bool
    held: bool
    """The ranks were stopped on command (diagnostics, a replay) and wait for the next one: not "finished"."""
    clock: Callable[[], datetime]
    supervisor: RankSupervisor
    channel: RankChannel
    checkpointing: NodeCheckpointing | None
    outbox: Outbox | None
    rounds: DiagnosticsRounds
    replays: SdcReplays
    stacks: StackCaptures

    def emit(self, payload: EventPayload, subject: str | None = None, causation: Event | None = None) -> None: ...

    def controller_time(self) -> datetime:
        """The controller's recorded clock as the node can tell it: what commands' expiries are judged on."""
        ...

    def start_ranks(self, generation: int, extra_env: dict[str, str] | None = None) -> None: ...

    def stop_ranks(self) -> None: ...

    def use_code(self, code: CodeRef | None) -> str: ...

    def wake(self) -> None: ...


def handle_command(node: Node, command: Event) -> None:
    """Carry out a command addressed to this node (others are ignored). Called from the loop."""
    payload = command.payload
    if isinstance(payload, DiagnosticsRequested):
        node.rounds.handle(command)
    elif isinstance(payload, StandbyPromotionRequested):
        handle_promotion(node, command)
    elif isinstance(payload, RanksRestartRequested) and payload.node_id == node.spec.node_id:
        handle_restart(node, command)
    elif isinstance(payload, StacksRequested):
        node.stacks.handle(command)
    elif isinstance(payload, SdcReplayRequested):
        node.replays.handle(command)


# -- restarts and promotions -------------------------------------------------------------------------


def handle_restart(node: Node, command: Event) -> None:
    """Restart the ranks in place as the command's generation (``RanksRestarted`` says how it went)."""
    payload = command.payload
    assert isinstance(payload, RanksRestartRequested)
    now = node.controller_time()
    if now > payload.expires_at:
        outcome, detail = "expired", f"command expired at {payload.expires_at.isoformat()}; not executed"
    elif payload.generation <= node.generation:
        outcome, detail = "stale_generation", f"already at generation {node.generation}"
    elif problem := node.use_code(payload.code):
        outcome, detail = "failed", f"{problem}; the ranks keep running"
    elif payload.nnodes and (problem := reshape_problem(node.spec, payload.node_rank, payload.nnodes)):
        outcome, detail = "failed", f"{problem}; the ranks keep running"
    else:
        if node.rounds.running:
            log.warning("%s: a restart command arrived while diagnostics ran; ending the round unreported",
                        node.spec.node_id)
            node.rounds.cancel()
        node.replays.finish(force=True)
        node.stop_ranks()
        follow_rendezvous(node, payload.master_addr)
        if node.spec.standby:
            # A standby told to run its slice (a replacement started with `keel cluster`'s start_node)
            # is a worker from now on: it takes part in diagnostics and exits when its ranks finish.
            node.spec = dataclasses.replace(node.spec, standby=False)
            node.supervisor.spec = node.spec
            node.rounds.cancel()
        if payload.nnodes and (payload.nnodes, payload.node_rank) != (node.spec.nnodes, node.spec.node_rank):
            # The job shrank: this node runs another slice of a smaller world from now on; its ranks restore
            # every saved rank's shard resharded (the broker's plan names them all).
            log.info("%s: the job shrinks: node rank %d of %d becomes node rank %d of %d", node.spec.node_id,
                     node.spec.node_rank, node.spec.nnodes, payload.node_rank, payload.nnodes)
            node.spec = dataclasses.replace(node.spec, node_rank=payload.node_rank, nnodes=payload.nnodes)
            node.supervisor.spec = node.spec
            if node.checkpointing is not None:
                node.checkpointing.reshape([node.spec.global_rank(i) for i in range(node.spec.nproc_per_node)],
                                           node.spec.world_size)
        # Start the new processes first: the inventory (hashing every slot) overlaps their start-up,
        # and they wait for the restore plan it leads to.
        node.start_ranks(payload.generation)
        if node.checkpointing is not None:
            node.checkpointing.prepare_restart(payload.generation)
        node.failed = False
        outcome, detail = "restarted", f"restarted {node.spec.nproc_per_node} ranks in place: {payload.reason}"
    node.emit(
        RanksRestarted(node_id=node.spec.node_id, command_id=str(command.id), generation=node.generation,
                       outcome=outcome, detail=detail),
        causation=command,
    )


def reshape_problem(spec: LaunchSpec, node_rank: int, nnodes: int) -> str:
    """Why this node cannot become node rank ``node_rank`` of ``nnodes`` ("" : it can). A job only shrinks
    (the shard store admits the ranks of the size it started with), and a standby has no slice to move."""
    if spec.standby:
        return f"{spec.node_id} is a standby: a shrink restarts the job's own nodes only"
    if not 0 <= node_rank < nnodes:
        return f"node rank {node_rank} is outside 0..{nnodes - 1}"
    if nnodes > spec.nnodes:
        return f"the job cannot grow from {spec.nnodes} to {nnodes} nodes by a restart command"
    return ""


def follow_rendezvous(node: Node, master_addr: str) -> None:
    """The ranks' rendezvous moved with node rank 0 to ``master_addr`` (a restart command's; "": it did
    not): this node's ranks use it from the generation about to start on, and so do its later ones."""
    if master_addr and master_addr != node.spec.master_addr:
        log.info("%s: the ranks' rendezvous moves from %s to %s (node rank 0 moved)", node.spec.node_id,
                 node.spec.master_addr, master_addr)
        node.spec = dataclasses.replace(node.spec, master_addr=master_addr)
        node.supervisor.spec = node.spec


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


def handle_promotion(node: Node, command: Event) -> None:
    """Take over a slice of ranks as a promoted standby (``StandbyPromoted`` says how it went)."""
    payload = command.payload
    assert isinstance(payload, StandbyPromotionRequested)
    if payload.node_id != node.spec.node_id:
        return
    if node.controller_time() > payload.expires_at:
        outcome, detail = "expired", f"command expired at {payload.expires_at.isoformat()}; not executed"
    elif not node.spec.standby:
        outcome, detail = "not_standby", f"{node.spec.node_id} is not a standby (it runs node rank {node.spec.node_rank})"
    else:
        try:
            spec = promoted_spec(node.spec, payload.node_rank, payload.ranks)
            problem = node.use_code(payload.code)
        except PromotionError as exc:
            spec, problem = node.spec, str(exc)
        if problem:
            outcome, detail = "failed", problem
        else:
            if node.rounds.running:
                log.info("%s: promoted while its self-check ran; ending the check unreported", spec.node_id)
                node.rounds.cancel()
            node.spec = spec
            node.supervisor.spec = spec
            follow_rendezvous(node, payload.master_addr)
            spec = node.spec
            if node.checkpointing is not None:
                node.checkpointing.take_over([spec.global_rank(i) for i in range(spec.nproc_per_node)])
            node.start_ranks(payload.generation)
            if node.checkpointing is not None:
                # The inventory names the ranks taken over: the broker plans their restore from peers.
                node.checkpointing.prepare_restart(payload.generation)
            node.failed = False
            outcome = "promoted"
            detail = (f"took over node rank {spec.node_rank} (ranks {payload.ranks}) of {payload.replaces_node_id} "
                      f"as generation {payload.generation}: {payload.reason}")
    node.emit(StandbyPromoted(node_id=node.spec.node_id, command_id=str(command.id),
                              replaces_node_id=payload.replaces_node_id, generation=node.generation,
                              outcome=outcome, detail=detail),
              causation=command)
    log.info("%s: promotion %s: %s", node.spec.node_id, outcome, detail)


# -- diagnostics (rung 2) and a standby's self-check -------------------------------------------------


@dataclass
class ActiveRound:
    """A diagnostics round (or a standby's self-check) running in the background."""

    process: RoundProcess
    command: Event | None
    """The ``DiagnosticsRequested`` it answers; None for a standby's self-check."""


class DiagnosticsRounds:
    """This node's side of the diagnostics rounds: at most one runs at a time, in its own process."""

    def __init__(self, node: Node, policy: DiagnosticsPolicy) -> None:
        self.node = node
        self.policy = policy
        self.active: ActiveRound | None = None
        self.seen: set[int] = set()
        """Rounds run already: a redelivered request is not run again."""
        self.nic_baseline = nic_baseline(node.spec.root)
        """Link change counters when this node was last vetted (simulated nodes only; judges flaps)."""

    @property
    def running(self) -> bool:
        return self.active is not None

    def handle(self, command: Event) -> None:
        """Rung 2: stop the ranks and run this node's side of the round in the background."""
        payload = command.payload
        assert isinstance(payload, DiagnosticsRequested)
        spec = self.node.spec
        if spec.standby or spec.node_id not in payload.nodes:
            log.debug("%s: diagnostics round %d is not for this node", spec.node_id, payload.round)
            return
        if self.node.controller_time() > payload.expires_at:
            log.warning("%s: diagnostics round %d expired at %s; not run (the ranks keep running)", spec.node_id,
                        payload.round, payload.expires_at.isoformat())
            return
        if payload.round in self.seen:
            log.info("%s: diagnostics round %d was run already (a redelivered command); ignored", spec.node_id,
                     payload.round)
            return
        self.node.replays.finish(force=True)  # a replay still running ends, answered with what it has
        if self.active is not None:
            log.warning("%s: diagnostics round %d supersedes the round still running; ending that one unreported",
                        spec.node_id, payload.round)
            self.cancel()
        self.seen.add(payload.round)
        # The controller concludes the round at its decision time + timeout_s. Answer by three quarters of
        # that (stopping the ranks counts against it): peers that name a node which never joined must be
        # heard before the controller's own deadline; the last quarter covers transport. The time already
        # gone is judged on this node's clock only when plausible (a clock minutes off is not a late command).
        answer_s = 0.75 * payload.timeout_s
        gone_s = plausible_age_s(self.node.controller_time(), command.occurred_at, answer_s)
        deadline = time.time() + max(5.0, answer_s - gone_s)
        self.node.stop_ranks()
        self.node.held = True
        request = RoundRequest(
            round=payload.round, node_id=spec.node_id, nodes=payload.nodes, checks=payload.checks,
            nproc_per_node=spec.nproc_per_node, master_addr=spec.master_addr,
            master_port=round_port(spec.master_port, payload.round), deadline_unix_s=deadline,
            root=str(spec.root), nic_baseline=self.nic_baseline, policy=self.policy)
        self.launch(request, f"round-{payload.round}", command)
        log.info("%s: diagnostics round %d started (%s; %.0fs): %s", spec.node_id, payload.round,
                 ", ".join(payload.checks), payload.timeout_s, payload.reason)

    def start_self_check(self) -> None:
        """A standby's local checks, once at start (reported as ``StandbyChecked``)."""
        spec = self.node.spec
        request = RoundRequest(round=0, node_id=spec.node_id, nodes=[spec.node_id], checks=list(LOCAL_CHECKS),
                               nproc_per_node=spec.nproc_per_node, deadline_unix_s=time.time()
                               + self.policy.standby_check_timeout_s, root=str(spec.root), policy=self.policy)
        self.launch(request, "self-check", None)

    def launch(self, request: RoundRequest, name: str, command: Event | None) -> None:
        directory = self.node.spec.agent_dir / "diagnostics" / name
        try:
            process = RoundProcess(request, directory, zygote=self.node.supervisor.zygote)
        except OSError as exc:
            log.error("%s: cannot start diagnostics %s: %s", self.node.spec.node_id, name, exc)
            self.finish(failed_report(request, f"the diagnostics could not start: {exc}"), command)
            return
        self.active = ActiveRound(process, command)

    def cancel(self) -> None:
        """End the running round (if any) unreported."""
        if self.active is not None:
            self.active.process.kill()
            self.active = None

    def poll(self) -> None:
        """Report the background round once it ended (or overran: then it is killed). Called every tick."""
        active = self.active
        if active is None:
            return
        report = active.process.poll()
        if report is None:
            return
        self.active = None
        self.finish(report, active.command)

    def finish(self, report: NodeReport, command: Event | None) -> None:
        node = self.node.spec.node_id
        if command is None:
            self.node.emit(StandbyChecked(node_id=node, passed=report.passed, results=report.results,
                                          detail=report.detail))
            log.info("%s: standby self-check %s: %s", node, "passed" if report.passed else "FAILED", report.detail)
            return
        payload = command.payload
        assert isinstance(payload, DiagnosticsRequested)
        self.node.emit(DiagnosticsCompleted(node_id=node, request_id=str(command.id), round=payload.round,
                                            passed=report.passed, results=report.results, suspects=report.suspects,
                                            detail=report.detail), causation=command)
        # The next round judges flaps from here: a link that flapped before this round was reported now.
        self.nic_baseline = nic_baseline(self.node.spec.root)
        log.info("%s: diagnostics round %d %s in %.1fs: %s", node, payload.round,
                 "passed" if report.passed else "FAILED", report.duration_s, report.detail)


# -- stacks (rung 3) --------------------------------------------------------------------------------


class StackCaptures:
    """Stack captures of this node's rank processes, run in a background thread (py-spy takes ~0.1-0.5 s a
    process); the loop reports each once it is done (``poll``)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.seen: set[int] = set()
        """Rounds captured already: a redelivered request is not run again."""
        self.running: list[tuple[Event, concurrent.futures.Future[NodeCapture]]] = []
        """Captures running in the background, with their request."""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def handle(self, command: Event) -> None:
        """Capture the stacks of every process of this node's ranks in the background; never stops them."""
        payload = command.payload
        assert isinstance(payload, StacksRequested)
        spec = self.node.spec
        node = spec.node_id
        if node not in payload.nodes or spec.standby:
            return
        if self.node.controller_time() > payload.expires_at:
            log.warning("%s: stack capture round %d expired at %s; not run", node, payload.round,
                        payload.expires_at.isoformat())
            return
        if payload.round in self.seen:
            log.info("%s: stack capture round %d was run already (a redelivered command); ignored", node, payload.round)
            return
        self.seen.add(payload.round)
        rank_pids: dict[int, int | None] = {spec.global_rank(i): None for i in range(spec.nproc_per_node)}
        for process in self.node.supervisor.alive():
            rank_pids[process.rank] = process.pid
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stacks")
        future = self._pool.submit(capture_ranks, rank_pids, native=payload.native,
                                   timeout_s=max(1.0, 0.8 * payload.timeout_s))
        self.running.append((command, future))
        future.add_done_callback(lambda _: self.node.wake())
        log.info("%s: capturing the stacks of ranks %s (round %d): %s", node, sorted(rank_pids), payload.round,
                 payload.reason)

    def poll(self) -> None:
        """Report the captures that are done (``StacksCaptured``, in parts that fit an event). Called every tick."""
        spec = self.node.spec
        for command, future in [c for c in self.running if c[1].done()]:
            self.running.remove((command, future))
            payload = command.payload
            assert isinstance(payload, StacksRequested)
            try:
                capture = future.result()
            except Exception as exc:  # noqa: BLE001 - reported as missing evidence, never as healthy
                capture = NodeCapture([], [MissingProcess(rank=spec.global_rank(i), reason=f"the capture failed: "
                                                          f"{exc!r}") for i in range(spec.nproc_per_node)], 0.0)
            ranks = []
            for rank, state in sorted(self.node.channel.ranks.items()):
                if state.generation == self.node.generation and state.groups:
                    ranks.append(RankTopology(rank=rank, tp=state.groups.get("tp", [rank]),
                                              pp=state.groups.get("pp", [rank]), dp=state.groups.get("dp", [rank])))
            outbox = self.node.outbox
            budget = (outbox.bus.settings.max_event_bytes if outbox is not None and outbox.bus
                      else 256 * 1024) // 2
            parts = split_parts(capture.processes, budget)
            for index, processes in enumerate(parts):
                self.node.emit(StacksCaptured(node_id=spec.node_id, request_id=str(command.id), round=payload.round,
                                              processes=processes, ranks=ranks if index == 0 else [],
                                              missing=capture.missing if index == 0 else [], part=index,
                                              parts=len(parts), duration_s=round(capture.duration_s, 3)),
                               causation=command)
            log.info("%s: stacks of round %d: %d processes in %.2fs, %d missing", spec.node_id, payload.round,
                     len(capture.processes), capture.duration_s, len(capture.missing))

    def close(self) -> None:
        """Abandon the captures still running (the agent stops)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


# -- SDC replays (rung 5) -----------------------------------------------------------------------------


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


class SdcReplays:
    """The rung-5 replay on this node: at most one at a time, answered once its ranks ended."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.active: ActiveReplay | None = None
        self.seen: set[int] = set()
        """Rounds seen already (run or refused): a redelivered request is not answered again."""

    def handle(self, command: Event) -> None:
        """Rung 5: restart this node's ranks in replay mode (see the module docstring)."""
        payload = command.payload
        assert isinstance(payload, SdcReplayRequested)
        node = self.node
        node_id = node.spec.node_id
        if node.spec.standby or node_id not in payload.nodes or payload.round in self.seen:
            return
        self.seen.add(payload.round)
        if node.controller_time() > payload.expires_at or payload.generation <= node.generation:
            why = (f"command expired at {payload.expires_at.isoformat()}" if node.controller_time() > payload.expires_at
                   else f"already at generation {node.generation}")
            log.warning("%s: replay round %d not run: %s", node_id, payload.round, why)
            node.emit(SdcReplayCompleted(node_id=node_id, request_id=str(command.id), round=payload.round, ran=False,
                                         detail=f"not run: {why}"), causation=command)
            return
        node.rounds.cancel()
        self.finish(force=True)
        node.stop_ranks()
        directory = node.spec.agent_dir / "sdc" / f"round-{payload.round}"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        spec_path = directory / "replay.json"
        spec_path.write_text(replay_spec_json(payload, directory), encoding="utf-8")
        node.start_ranks(payload.generation, extra_env={REPLAY_ENV: str(spec_path)})
        if node.checkpointing is not None:
            node.checkpointing.prepare_restart(payload.generation)
        # The analyzer judges at the request's time + timeout_s: answer by three quarters of that (stopping
        # the old ranks counts against it), so ranks that are merely slow are heard, not counted missing.
        now_s = time.monotonic()
        answer_s = 0.75 * payload.timeout_s
        left_s = max(5.0, answer_s - plausible_age_s(node.controller_time(), command.occurred_at, answer_s))
        self.active = ActiveReplay(command, directory, payload.generation, sorted(node.supervisor.ranks), now_s,
                                   now_s + left_s)
        log.info("%s: replay round %d started as generation %d (%d phase(s)): %s", node_id, payload.round,
                 payload.generation, len(payload.phases), payload.reason)

    def take_exits(self, exits: list[RankExit]) -> list[RankExit]:
        """The exits that are the job's: a running replay's ranks end by design, so their exits answer the
        replay (answered here once complete), they are not reported. Called every tick."""
        replay = self.active
        if replay is None:
            return exits
        for exit_ in exits:
            if exit_.generation == replay.generation:
                replay.exits[exit_.rank] = exit_
        self.finish()
        return [e for e in exits if e.generation != replay.generation]

    def finish(self, force: bool = False) -> None:
        """Answer the running replay once every local rank ended (or at its deadline, or ``force``)."""
        replay = self.active
        if replay is None:
            return
        if len(replay.exits) < len(replay.ranks) and not force and time.monotonic() < replay.deadline_s:
            return
        node = self.node
        if len(replay.exits) < len(replay.ranks):
            node.supervisor.stop_all()
            for exit_ in node.supervisor.poll():
                if exit_.generation == replay.generation:
                    replay.exits.setdefault(exit_.rank, dataclasses.replace(exit_, exit_code=None, signal="deadline"))
        self.active = None
        payload = replay.command.payload
        assert isinstance(payload, SdcReplayRequested)
        answer = replay_answer(payload, node.spec.node_id, str(replay.command.id), replay.ranks,
                               {r: e for r, e in replay.exits.items() if e.signal != "deadline"}, replay.directory,
                               time.monotonic() - replay.started_s)
        node.emit(answer, causation=replay.command)
        node.held = True  # the ranks are done; the node waits for the controller's next command
        log.info("%s: replay round %d %s in %.1fs: %s", node.spec.node_id, payload.round,
                 "answered" if answer.ran else "FAILED", answer.duration_s, answer.detail)

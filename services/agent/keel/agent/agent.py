"""The node agent's loop: supervise ranks, read rank reports, probe health, publish, obey commands.

Once per probe interval: fold the rank reports that arrived; report rank exits (classified); run the
health probes through the pure inspector core and publish its state changes; every heartbeat
interval publish a ``NodeHeartbeat``. The loop also wakes at once when a rank reports or a child exits.

Commands (``keel.agent.consumer`` takes them off the bus) are carried out by ``keel.agent.commands``:
restarts and promotions at once, diagnostics rounds, stack captures and SDC replays in the background,
polled from the loop. The handlers share the agent's state through ``commands.Node``.

A standby runs the local checks (GPU matmul, intra-node all-to-all) once when it starts and reports
``StandbyChecked``: only a passing standby counts for the pool.

Failure handling without a controller (``supervised=False``, plain ``keel run``): like torchrun,
a failed rank stops the node's other ranks, then the agent restarts them locally while
``--max-restarts`` allows, else exits non-zero. Supervised (a local cluster, a real deployment),
the agent reports and waits: the controller decides.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Protocol

from keel.agent import commands
from keel.agent.channel import RankChannel
from keel.agent.checkpointing import NodeCheckpointing
from keel.agent.commands import DiagnosticsRounds, SdcReplays, StackCaptures
from keel.agent.consumer import CommandConsumer
from keel.agent.diagnostics import DiagnosticsPolicy
from keel.agent.launch_spec import LaunchSpec
from keel.agent.metric_watch import MetricWatch
from keel.agent.supervisor import RankExit, RankSupervisor
from keel.events.envelope import Event, EventPayload, now_utc
from keel.events.types import (
    CodeRef,
    CodeVersionApplied,
    NodeHeartbeat,
    NodeRegistered,
    RankExited,
    RankStarted,
)
from keel.infra.outbox import Outbox
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
        self.last_round_heartbeat_s: float | None = None
        """When a heartbeat last carried a completed report round (monotonic s)."""
        self.held = False
        """The ranks were stopped on command (diagnostics, a replay) and wait for the next one: not "finished"."""
        self._wake: Callable[[], None] = lambda: None
        """Wakes the loop from another thread (set by ``run``)."""
        self.rounds = DiagnosticsRounds(self, diagnostics_policy or DiagnosticsPolicy())
        self.stacks = StackCaptures(self)
        self.replays = SdcReplays(self)

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
            classification, error_type, reason = self.classify(exit_.exit_code, exit_.signal, exit_.stderr_tail)
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

    def handle_command(self, command: Event) -> None:
        """Carry out a command addressed to this node (others are ignored): ``commands.handle_command``."""
        commands.handle_command(self, command)

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
            round_done = self.checkpointing.report_due(monotonic_s, {r: s.checkpoint_step for r, s in ranks.items()},
                                                       self.step_time_p50_s(), period)
        since = None if self.last_heartbeat_at is None else now - self.last_heartbeat_at
        rounds_flowing = (self.last_round_heartbeat_s is not None
                          and monotonic_s - self.last_round_heartbeat_s <= 2 * self.spec.heartbeat_interval.total_seconds())
        due = heartbeat_cadence(since, self.spec.heartbeat_interval, round_done=round_done,
                                rounds_flowing=rounds_flowing)
        if due and round_done:
            self.last_round_heartbeat_s = monotonic_s
        return due

    def heartbeat(self, now: datetime) -> None:
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
                step_time_p50_s=self.step_time_p50_s(),
                rank_compute_time_p50_s=compute,
                stored=self.checkpointing.holdings() if self.checkpointing is not None else {},
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
        # A replay's ranks end by design: their exits answer the replay, they are not the job's.
        exits = self.replays.take_exits(self.supervisor.poll())
        failures = [e for e in exits if self.report_exit(e)]
        self.rounds.poll()
        self.stacks.poll()
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
        if self.heartbeat_due(now, time.monotonic()):
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
            self.rounds.start_self_check()
        consumer = asyncio.create_task(CommandConsumer(self).run(stop)) if self.outbox is not None else None
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
            self.rounds.cancel()
            self.supervisor.stop_all()
            self.supervisor.close_zygote()
            self.stacks.close()
            for exit_ in self.supervisor.poll():
                self.report_exit(exit_)
            self.heartbeat(self.clock())
            if consumer is not None:
                consumer.cancel()
            self.channel.close()
            if self.checkpointing is not None:
                self.checkpointing.close(job_finished=result.exit_code == 0 and not self.spec.standby)
        return result


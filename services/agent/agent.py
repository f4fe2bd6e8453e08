"""The node agent's loop: supervise ranks, read rank reports, probe health, publish, obey commands.

Once per probe interval: fold the rank reports that arrived; report rank exits (classified); run the
health probes through the pure inspector core and publish its state changes; every heartbeat
interval publish a ``NodeHeartbeat``. Commands addressed to this node (``RanksRestartRequested``)
are executed only if they have not expired and are for a newer generation.

Failure handling without a controller (``supervised=False``, plain ``keel run``): like torchrun,
a failed rank stops the node's other ranks, then the agent restarts them locally while
``--max-restarts`` allows, else exits non-zero. Supervised (a local cluster, a real deployment),
the agent reports and waits: the controller decides.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from keel.agent.channel import RankChannel
from keel.agent.checkpointing import BROKER_EVENT_TYPES, NodeCheckpointing
from keel.agent.launch_spec import LaunchSpec
from keel.agent.supervisor import RankExit, RankSupervisor
from keel.core.bus import fetch_batch
from keel.core.event_types import (
    NodeHeartbeat,
    NodeRegistered,
    RankExited,
    RanksRestarted,
    RanksRestartRequested,
    RankStarted,
)
from keel.core.events import Event, EventPayload, InvalidEvent, decode_event, now_utc
from keel.core.outbox import Outbox

log = logging.getLogger(__name__)

PRODUCER = "agent"


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
        self.supervisor = RankSupervisor(spec, self.channel.path, spec.agent_dir / "fault.json")
        self.generation = 0
        self.restarts_left = spec.max_restarts
        self.failed = False
        self.last_heartbeat_at: datetime | None = None

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

    def start_ranks(self, generation: int) -> None:
        if generation > 0:
            # An injected workload fault belongs to the generation it was injected into; a restarted
            # process must not apply it again.
            self.supervisor.fault_file.unlink(missing_ok=True)
        self.generation = generation
        self.channel.forget_generation_before(generation)
        if self.checkpointing is not None:
            self.supervisor.extra_env = self.checkpointing.rank_env(generation)
        for process in self.supervisor.start_all(generation):
            self.emit(
                RankStarted(node_id=self.spec.node_id, rank=process.rank, local_rank=process.local_rank,
                            world_size=self.spec.world_size, pid=process.pid, generation=generation),
                subject=f"rank/{process.rank}",
            )
        log.info("%s: started %d ranks, generation %d", self.spec.node_id, self.spec.nproc_per_node, generation)

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
            if classification != "infrastructure" and reported[0] == "infrastructure":
                classification, error_type, reason = reported
            reason = f"{reason} (the rank reported {exit_.reported_failure!r}; the agent ended its shutdown)"
        else:
            classification, error_type, reason = self.classify(exit_.exit_code, exit_.signal, exit_.stderr_tail)
        self.emit(
            RankExited(node_id=self.spec.node_id, rank=exit_.rank, pid=exit_.pid, generation=exit_.generation,
                       exit_code=exit_.exit_code, signal=exit_.signal, classification=classification,  # type: ignore[arg-type]
                       error_type=error_type, stderr_tail=exit_.stderr_tail[-4000:], reason=reason),
            subject=f"rank/{exit_.rank}",
        )
        log.info("%s: rank %d exited (%s, code %s, signal %s): %s", self.spec.node_id, exit_.rank, classification,
                 exit_.exit_code, exit_.signal, reason)
        return classification not in ("success", "stopped_by_agent")

    # -- commands ----------------------------------------------------------------------------------

    def handle_command(self, command: Event) -> None:
        payload = command.payload
        if not isinstance(payload, RanksRestartRequested) or payload.node_id != self.spec.node_id:
            return
        now = self.clock()
        if now > payload.expires_at:
            outcome, detail = "expired", f"command expired at {payload.expires_at.isoformat()}; not executed"
        elif payload.generation <= self.generation:
            outcome, detail = "stale_generation", f"already at generation {self.generation}"
        else:
            self.supervisor.stop_all()
            for exit_ in self.supervisor.poll():
                self.report_exit(exit_)
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

    async def consume_commands(self, stop: asyncio.Event) -> None:
        assert self.outbox is not None
        await self.outbox.connected.wait()
        bus = self.outbox.bus
        assert bus is not None
        prefix = f"{bus.settings.subject_prefix}.{self.spec.job_id}"
        subjects = [f"{prefix}.node.RanksRestartRequested"]
        if self.checkpointing is not None:
            subjects += [f"{prefix}.job.{name}" for name in BROKER_EVENT_TYPES]
        sub = await bus.pull_consumer(f"agent-{self.spec.job_id}-{self.spec.node_id}-{len(subjects)}",
                                      filter_subjects=subjects)
        while not stop.is_set():
            for msg in await fetch_batch(sub, 16, 0.5):
                try:
                    command = decode_event(msg.data, max_bytes=bus.settings.max_event_bytes)
                except InvalidEvent as exc:
                    log.warning("ignoring malformed command: %s", exc.reason)
                    await msg.term()
                    continue
                if command.type == "RanksRestartRequested":
                    self.handle_command(command)
                elif self.checkpointing is not None:
                    self.checkpointing.handle_event(command)
                await msg.ack()

    # -- the loop ---------------------------------------------------------------------------------

    def heartbeat(self, now: datetime) -> None:
        step_times = [t for s in self.channel.ranks.values() for t in list(s.step_times_s)[-20:]]
        self.emit(
            NodeHeartbeat(
                node_id=self.spec.node_id,
                standby=self.spec.standby,
                ranks_alive=len(self.supervisor.alive()),
                ranks_expected=0 if self.spec.standby else self.spec.nproc_per_node,
                last_step=max((s.step for s in self.channel.ranks.values()), default=-1),
                step_time_p50_s=statistics.median(step_times) if step_times else None,
            )
        )
        self.last_heartbeat_at = now

    def tick(self, probe: bool = True) -> AgentResult | None:
        """One pass of the loop; an ``AgentResult`` when the agent should stop. ``probe``: also sample
        the health probes (once per probe interval; exits and reports are handled on every wake-up)."""
        now = self.clock()
        self.channel.drain(now, self.generation)
        for rank, state in self.channel.ranks.items():
            if state.phase == "failed" and self.supervisor.kill_failed(rank, state.error):
                log.info("%s: rank %d reported %s; ending it now", self.spec.node_id, rank, state.error)
        exits = self.supervisor.poll()
        failures = [e for e in exits if self.report_exit(e)]
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
        if not self.spec.standby and not self.supervisor.ranks and not self.failed:
            return AgentResult(0, "every rank finished successfully")
        return None

    async def run(self, stop: asyncio.Event) -> AgentResult:
        self.emit(NodeRegistered(node_id=self.spec.node_id, host=socket.gethostname(), standby=self.spec.standby,
                                 fault_domain=self.spec.fault_domain))
        if not self.spec.standby:
            if self.checkpointing is not None:
                self.checkpointing.start_fresh()
            self.start_ranks(0)
        commands = asyncio.create_task(self.consume_commands(stop)) if self.outbox is not None else None
        result = AgentResult(143, "stopped")
        # Wake at once when a rank reports or a child exits, not only once per probe interval: a
        # crash is then seen within milliseconds of the process ending.
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        loop.add_reader(self.channel.sock.fileno(), wake.set)
        loop.add_signal_handler(signal.SIGCHLD, wake.set)
        if self.checkpointing is not None:
            self.checkpointing.wake = lambda: loop.call_soon_threadsafe(wake.set)
        interval_s = self.spec.probe_interval.total_seconds()
        next_probe_at = loop.time()
        try:
            while not stop.is_set():
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
            loop.remove_signal_handler(signal.SIGCHLD)
            self.supervisor.stop_all()
            for exit_ in self.supervisor.poll():
                self.report_exit(exit_)
            self.heartbeat(self.clock())
            if commands is not None:
                commands.cancel()
            self.channel.close()
            if self.checkpointing is not None:
                self.checkpointing.close(job_finished=result.exit_code == 0 and not self.spec.standby)
        return result


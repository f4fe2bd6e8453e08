"""The node agent's command consumer: a durable JetStream consumer, on the shared consumer loop
(``keel.infra.consumer.EventConsumer``), that hands the agent its commands and the checkpoint broker's
events.

What it subscribes to (``command_subjects``; subjects ``<prefix>.<job>.<kind>.<aggregate id>.<type>``,
``keel.infra.subjects``):

- the commands addressed to this node, ``node.<this node>.RanksRestartRequested`` and
  ``node.<this node>.StandbyPromotionRequested``: the server routes them, so an agent never receives
  (nor decodes) another node's;
- the multi-node requests, ``DiagnosticsRequested``, ``StacksRequested`` and ``SdcReplayRequested``, job
  wide: each names its ``nodes`` in one event, since the round that answers it is keyed on that one
  request id (the controller and the analyzer collect the answers by it); every agent takes them and sees
  whether it is named;
- the controller's reports about this node's clock, ``node.<this node>.NodeClockSkewed``: the agent then
  judges commands' expiries on the controller's recorded clock (``NodeAgent.controller_time``);
- the controller's eviction of this node and its ``NodeFenced`` (``node.<this node>.NodeEvictionDecided`` and
  ``.NodeFenced``): the agent stops its ranks and leaves (``keel.agent.fencing``), as it does on a restore
  plan for a generation newer than its ranks' (they are left behind);
- with checkpointing on, the checkpoint broker's job-wide events (``BROKER_EVENT_TYPES``) and its parts
  addressed to this node (``BROKER_NODE_EVENT_TYPES``: the node's backup assignments and its part of a
  restore plan).

A message is acknowledged once the agent has carried it out (commands act at once; long work, a round or
a replay, runs in the background and answers with its own event).

Each message is handled in isolation (``handle``): one whose handling raises is tried once more at once (a
passing condition), then given up: logged (rate-limited), counted, answered where the command has an answer
(``RanksRestarted`` / ``StandbyPromoted`` with outcome ``failed`` and the error) and acknowledged. Raising
out of the handler instead would leave the rest of the fetched batch unacknowledged until ``ack_wait``
(10 s), past the controller's acknowledgement deadline for a diagnostics round, and put the consumer into
its back-off; a redelivery would fail the same way. What still ends the consumer's loop (the bus) is
supervised: logged and resumed after a back-off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Protocol

from keel.agent.checkpointing import BROKER_EVENT_TYPES, BROKER_NODE_EVENT_TYPES, NodeCheckpointing
from keel.agent.isolation import Pieces
from keel.agent.launch_spec import LaunchSpec
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    DiagnosticsRequested,
    NodeClockSkewed,
    NodeEvictionDecided,
    NodeFenced,
    RanksRestarted,
    RanksRestartRequested,
    SdcReplayRequested,
    StacksRequested,
    StandbyPromoted,
    StandbyPromotionRequested,
)
from keel.infra.consumer import EventConsumer
from keel.infra.nats_auth import agent_durable
from keel.infra.outbox import Outbox
from keel.infra.subjects import subject_filter

log = logging.getLogger(__name__)

NODE_COMMANDS = (RanksRestartRequested, StandbyPromotionRequested)
"""Commands addressed to one node (envelope subject ``node/<id>``): an agent takes only its own node's."""
JOB_COMMANDS = (DiagnosticsRequested, StacksRequested, SdcReplayRequested)
"""Requests to several nodes at once (their ``nodes`` list): one job-wide event each (the module docstring
says why), taken by every agent."""
COMMAND_TYPES = frozenset(c.event_name for c in (*NODE_COMMANDS, *JOB_COMMANDS))
NODE_REPORTS = (NodeClockSkewed, NodeEvictionDecided, NodeFenced)
"""The controller's reports about one node that its agent acts on (not commands: nothing to answer): its
clock's skew, and its eviction and fence (``keel.agent.fencing``: the node leaves the job)."""


def command_subjects(prefix: str, job_id: str, node_id: str, *, checkpointing: bool) -> list[str]:
    """The subjects node ``node_id``'s agent consumes: its own node's commands, the job-wide requests, and
    (``checkpointing``) the checkpoint broker's job-wide events and its parts for this node."""
    subjects = [subject_filter(prefix, job_id, c.aggregate, node_id, c.event_name) for c in NODE_COMMANDS]
    subjects += [subject_filter(prefix, job_id, c.aggregate, None, c.event_name) for c in JOB_COMMANDS]
    subjects += [subject_filter(prefix, job_id, r.aggregate, node_id, r.event_name) for r in NODE_REPORTS]
    if checkpointing:
        subjects += [subject_filter(prefix, job_id, "job", None, name) for name in BROKER_EVENT_TYPES]
        subjects += [subject_filter(prefix, job_id, "node", node_id, name) for name in BROKER_NODE_EVENT_TYPES]
    return subjects


def durable_name(job_id: str, node_id: str, *, checkpointing: bool) -> str:
    """The agent's durable consumer: exactly the name its NATS identity may create and read
    (``keel.infra.nats_auth.agent_durable``); a checkpointing agent's is named apart (its filters differ, and
    an existing consumer is kept as it is, never reconfigured: ``Bus.pull_consumer``)."""
    return agent_durable(job_id, node_id, checkpointing=checkpointing)


class CommandTarget(Protocol):
    """What the consumer needs of the agent (``NodeAgent`` is one)."""

    spec: LaunchSpec
    outbox: Outbox | None
    checkpointing: NodeCheckpointing | None
    clock: Callable[[], datetime]

    def heartbeat(self, now: datetime) -> None: ...

    def handle_command(self, command: Event) -> None: ...

    def note_clock_skew(self, report: Event) -> None: ...

    def check_fence(self, event: Event) -> bool: ...

    def emit(self, payload: EventPayload, subject: str | None = None, causation: Event | None = None) -> None: ...


HANDLE_ATTEMPTS = 2
"""How often a message whose handling raises is tried (at once) before it is given up (``handle``)."""
SUPERVISOR_BACKOFF_INITIAL_S = 0.5
SUPERVISOR_BACKOFF_MAX_S = 30.0


class CommandConsumer:
    """Feeds ``agent`` its commands until stopped; ``run`` waits for the agent's outbox to connect."""

    def __init__(self, agent: CommandTarget) -> None:
        self.agent = agent
        self.events: EventConsumer | None = None
        """The consumer, once connected."""
        self.failures = 0
        """How often handling a message raised (each attempt counts)."""
        self.given_up = 0
        """Messages given up after ``HANDLE_ATTEMPTS`` failed attempts (acknowledged, answered ``failed``)."""
        self.restarts = 0
        """How often the consumer's loop itself failed and resumed after a back-off."""
        self.pieces = Pieces(f"{agent.spec.node_id} command consumer", log)

    async def run(self, stop: asyncio.Event) -> None:
        agent = self.agent
        assert agent.outbox is not None
        await agent.outbox.connected.wait()
        bus = agent.outbox.bus
        assert bus is not None
        spec = agent.spec
        subjects = command_subjects(bus.settings.subject_prefix, spec.job_id, spec.node_id,
                                    checkpointing=agent.checkpointing is not None)
        self.events = EventConsumer(bus, durable_name(spec.job_id, spec.node_id, checkpointing=agent.checkpointing is not None),
                                    subjects,
                                    inactive_threshold=bus.settings.node_consumer_inactive)
        # Supervised: a command whose handling raises (a bug, a node in a state nobody foresaw) must not
        # end the agent's command intake for good while its ranks run on. It is logged, left
        # unacknowledged (JetStream redelivers it, at most bus.max_deliver times), and consuming resumes
        # after a back-off; every other command goes on being handled.
        backoff_s = SUPERVISOR_BACKOFF_INITIAL_S
        while not stop.is_set():
            try:
                await self.events.run(self.handle, stop)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the supervisor's whole point
                self.restarts += 1
                log.exception("%s: the command consumer failed (%d so far); resuming in %.1f s",
                              spec.node_id, self.restarts, backoff_s)
                try:
                    await asyncio.wait_for(stop.wait(), backoff_s)
                except TimeoutError:
                    pass
                backoff_s = min(backoff_s * 2, SUPERVISOR_BACKOFF_MAX_S)
            else:
                backoff_s = SUPERVISOR_BACKOFF_INITIAL_S

    async def handle(self, event: Event, _seq: int) -> None:
        """One message, isolated (see the module docstring): never raises an ``Exception``."""
        for attempt in range(1, HANDLE_ATTEMPTS + 1):
            try:
                await self._handle(event)
                return
            except Exception as exc:  # noqa: BLE001 - one message must not hold up the others
                self.failures += 1
                self.pieces.failed(f"handling {event.type}", exc)
                if attempt == HANDLE_ATTEMPTS:
                    self.given_up += 1
                    self._answer_failed(event, exc)

    def _answer_failed(self, event: Event, exc: Exception) -> None:
        """A command given up still gets its answer, so whoever waits for it is not left waiting."""
        payload, node_id = event.payload, self.agent.spec.node_id
        detail = f"handling the command raised {type(exc).__name__}: {exc}"[:1000]
        answer: EventPayload | None = None
        if isinstance(payload, RanksRestartRequested) and payload.node_id == node_id:
            answer = RanksRestarted(node_id=node_id, command_id=str(event.id), generation=payload.generation,
                                    outcome="failed", detail=detail)
        elif isinstance(payload, StandbyPromotionRequested) and payload.node_id == node_id:
            answer = StandbyPromoted(node_id=node_id, command_id=str(event.id),
                                     replaces_node_id=payload.replaces_node_id, generation=payload.generation,
                                     outcome="failed", detail=detail)
        if answer is not None:
            self.pieces.run("answering a failed command", self.agent.emit, answer, causation=event)

    async def _handle(self, event: Event) -> None:
        agent = self.agent
        if agent.check_fence(event):
            return  # fenced (now or before): nothing more is carried out
        if event.type in COMMAND_TYPES:
            if (isinstance(event.payload, (DiagnosticsRequested, StacksRequested)) and not agent.spec.standby
                    and agent.spec.node_id in event.payload.nodes):
                # Acknowledge at once, before stopping the ranks (which may take their grace time) or
                # capturing stacks: the controller takes a node that sends nothing after a request as lost.
                agent.heartbeat(agent.clock())
                assert agent.outbox is not None
                await agent.outbox.flush(1.0)
            agent.handle_command(event)
        elif isinstance(event.payload, NodeClockSkewed):
            agent.note_clock_skew(event)
        elif agent.checkpointing is not None:
            agent.checkpointing.handle_event(event)

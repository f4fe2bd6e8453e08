"""Fencing: a node the job went on without never takes part in it again as the member it was.

A host whose link was cut, or that froze, is evicted by the controller after ``node_silence_timeout``; a
standby takes its ranks and the job restarts as the next generation. When the host comes back, its old
agent and ranks resume where they stopped. They must not rejoin. The agent learns it was left, from what
its command consumer takes off the bus, in stream order:

- ``NodeEvictionDecided`` about its node (not observe-only): the controller evicted it (fenced);
- ``NodeFenced`` about its node: the controller heard it report after the eviction and ignored it (fenced);
- ``CheckpointRestorePlanned`` for a generation newer than its own while it runs ranks as a worker: every
  member of that generation got its restart or promotion command before the plan (stream order), so its
  ranks are of a generation the job left (left behind: they are stopped, the agent waits for commands).

Fenced, the agent stops its ranks, records ``fenced.json`` in its folder and exits (``FENCED_EXIT``); it
sends no heartbeat and no checkpoint report any more. A ``keel run`` started again in that folder for the
same job and node refuses to start as a worker (``fence_refusal``); started with ``--keel-standby`` it
offers the host back as a standby, as any new standby: the controller's fold lifts the fence on that
registration, and the host joins the pool once its self-check passes.

An eviction decided before this agent started is about an earlier agent of the node (a restarted
``keel run`` resumes the durable consumer where its predecessor left it) and does not fence it; a
``NodeFenced`` caused by one of this agent's own reports always does. Pure: the agent does the I/O.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from keel.events.envelope import Event
from keel.events.types import CheckpointRestorePlanned, NodeEvictionDecided, NodeFenced

FENCED_EXIT = 3
"""``keel run``'s exit status when its node was fenced out of the job (a supervisor should not restart it
as a worker: ``RestartPreventExitStatus=3``)."""
FENCE_FILE = "fenced.json"
UNREADABLE = "?"


@dataclass(frozen=True)
class Fence:
    """Why this node is out of the job: recorded in ``<agent dir>/fenced.json`` (0600)."""

    job_id: str
    node_id: str
    generation: int
    """The generation this node's ranks ran when it was fenced."""
    decision_id: str
    """The event that fenced it (the eviction decision or the controller's ``NodeFenced``)."""
    reason: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Fence:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return cls(job_id=str(data["job_id"]), node_id=str(data["node_id"]), generation=int(data["generation"]),
                   decision_id=str(data["decision_id"]), reason=str(data["reason"]))


@dataclass(frozen=True)
class Verdict:
    """What an event means for this node: ``fenced`` (stop and leave) or ``left_behind`` (stop the ranks,
    wait); ``reason`` says why."""

    fenced: bool
    reason: str


def fence_verdict(event: Event, *, node_id: str, standby: bool, generation: int, ranks_running: bool,
                  started_at: datetime, ours: bool) -> Verdict | None:
    """What ``event`` means for this agent (None: nothing). ``started_at``: when this agent started, on the
    controller's recorded clock as the node can tell it; ``ours``: the event was caused by one of this
    agent's own reports (its ``causation_id``)."""
    p = event.payload
    if isinstance(p, NodeEvictionDecided):
        if p.node_id != node_id or p.observe_only or event.occurred_at < started_at:
            return None
        return Verdict(True, f"the controller evicted {node_id} at rung {p.rung} (decision {event.id}): {p.reason}")
    if isinstance(p, NodeFenced):
        if p.node_id != node_id or not (ours or event.occurred_at >= started_at):
            return None
        return Verdict(True, f"the controller fenced {node_id} out of the job (decision {p.evicted_by}; "
                             f"the job is at generation {p.generation}): {p.reason}")
    if isinstance(p, CheckpointRestorePlanned):
        if standby or not ranks_running or p.generation <= generation:
            return None
        return Verdict(False, f"the job restarted as generation {p.generation} without {node_id} (its ranks run "
                              f"generation {generation}): they are stale; stopped, waiting for a command")
    return None


def fence_refusal(fence: Fence | None, *, job_id: str, node_id: str, standby: bool) -> str:
    """Why a ``keel run`` must not start as a worker where ``fence`` was recorded ("" : it may start)."""
    if fence is None or standby:
        return ""
    if fence.job_id != UNREADABLE and (fence.job_id != job_id or fence.node_id != node_id):
        return ""
    return (f"{node_id} was fenced out of job {job_id} at generation {fence.generation} ({fence.reason}); it does "
            f"not rejoin as a worker. Start it with --keel-standby to offer it back as a standby (the controller "
            f"decides), or remove {FENCE_FILE} from its agent folder once the job is over")


def read_fence(agent_dir: Path) -> Fence | None:
    """The fence recorded in ``agent_dir`` (None: none). An unreadable file is a fence of unknown job and
    node: a worker is refused for every job until a human looks."""
    path = agent_dir / FENCE_FILE
    try:
        return Fence.from_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Fence(job_id=UNREADABLE, node_id=UNREADABLE, generation=-1, decision_id="", reason=f"unreadable {path}: {exc}")

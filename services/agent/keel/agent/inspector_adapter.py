"""Wires the inspector (pure core + probes) and the exit classifier into the agent's loop."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from keel.agent.channel import RankChannel
from keel.agent.inspector import (
    InspectorCore,
    InspectorPolicy,
    PeerReachProbe,
    RankProbe,
    RankView,
    classify_exit,
    default_probes,
)
from keel.agent.launch_spec import LaunchSpec
from keel.agent.supervisor import RankSupervisor
from keel.events.envelope import EventPayload


class InspectorWatcher:
    """Samples every probe plus the ranks' reports, folds them through the core, returns changes."""

    def __init__(self, spec: LaunchSpec, policy: InspectorPolicy | None = None) -> None:
        self.policy = policy or InspectorPolicy()
        self.probes = default_probes(spec.root, self.policy)
        self.rank_probe = RankProbe(self.policy)
        self.peer_probe = PeerReachProbe(Path("/proc"), self.policy)
        self.core = InspectorCore(spec.node_id, self.policy)
        self.state = self.core.initial_state()
        self.stopped_since: dict[int, datetime] = {}
        """pid → when it was first seen stopped (state ``T``), for the ranks stopped now."""

    def _stopped_since(self, pid: int, alive: bool, now: datetime) -> datetime | None:
        if alive and process_state(pid) == "T":
            return self.stopped_since.setdefault(pid, now)
        self.stopped_since.pop(pid, None)
        return None

    def rank_views(self, channel: RankChannel, supervisor: RankSupervisor, now: datetime | None = None) -> list[RankView]:
        views = []
        for process in supervisor.ranks.values():
            state = channel.ranks.get(process.rank)
            # Only what this process reported counts (a restarted rank's old reports are another pid's).
            reported = state if state is not None and state.pid == process.pid else None
            alive = process.popen.poll() is None
            views.append(
                RankView(
                    rank=process.rank,
                    pid=process.pid,
                    alive=alive,
                    phase=reported.phase if reported is not None else "setup",
                    step=reported.step if reported is not None else -1,
                    last_report_at=reported.last_report_at if reported is not None else None,
                    last_progress_at=reported.last_progress_at if reported is not None else None,
                    step_times=list(reported.step_times_s) if reported is not None else [],
                    started_at=process.started_at_utc,
                    loss=reported.loss if reported is not None else None,
                    collective=reported.collective if reported is not None else "",
                    collective_entered_at=reported.collective_entered_at if reported is not None else None,
                    collective_waits=list(reported.collective_waits_s) if reported is not None else [],
                    stopped_since=self._stopped_since(process.pid, alive, now) if now is not None else None,
                )
            )
        return views

    def sample(self, now: datetime, channel: RankChannel, supervisor: RankSupervisor) -> list[EventPayload]:
        observations = [o for probe in self.probes for o in probe.collect()]
        views = self.rank_views(channel, supervisor, now)
        observations += self.rank_probe.collect(views, now)
        # The ranks' own connections (gloo's, the rendezvous store's): a peer host that stopped answering.
        observations += self.peer_probe.collect([v.pid for v in views if v.alive])
        self.state, changes = self.core.step(self.state, observations, now)
        return list(changes)


def process_state(pid: int, proc: Path = Path("/proc")) -> str:
    """The one-letter state of ``pid`` (``R``, ``S``, ``D``, ``T`` stopped, ``Z``...); '' when unreadable."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return ""
    # The command name (field 2) is in parentheses and may itself contain ") ": the state follows the last one.
    _, _, rest = stat.rpartition(") ")
    return rest[:1]


def build_watcher(spec: LaunchSpec, policy_config: dict[str, Any] | None = None) -> InspectorWatcher:
    """Standbys run the node probes too: they must pass a self-check before they count.

    ``policy_config``: ``InspectorPolicy`` fields as text with units (``settings.inspector``, i.e.
    ``KEEL_INSPECTOR__STEP_TIMEOUT_FLOOR=25s``); raises ``ValueError`` naming a bad key or value.
    """
    config = {"probe_interval": spec.probe_interval, **(policy_config or {})}
    return InspectorWatcher(spec, InspectorPolicy.from_config(config))


def user_code_paths(command: tuple[str, ...]) -> tuple[str, ...]:
    """Where the user's own code lives: the directory of the script, or of the ``-m`` module's file."""
    if command[:1] == ("-m",) and len(command) > 1:
        try:
            spec = importlib.util.find_spec(command[1])
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin and spec.origin not in ("built-in", "frozen"):
            return (str(Path(spec.origin).resolve().parent),)
        return ()
    if command and command[0].endswith(".py"):
        return (str(Path(command[0]).resolve().parent),)
    return ()


def classify(spec: LaunchSpec) -> Callable[..., tuple[str, str, str]]:
    """The exit classifier bound to the user's code: frames under its directory count as user code.
    Called as ``(exit_code, signal, stderr_tail, oom_killed=False)``."""
    user_paths = user_code_paths(spec.command)

    def run(exit_code: int | None, signal: str | None, stderr_tail: str, oom_killed: bool = False) -> tuple[str, str, str]:
        return classify_exit(exit_code, signal, stderr_tail, user_paths, oom_killed=oom_killed)

    return run

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

    def rank_views(self, channel: RankChannel, supervisor: RankSupervisor) -> list[RankView]:
        views = []
        for process in supervisor.ranks.values():
            state = channel.ranks.get(process.rank)
            # Only what this process reported counts (a restarted rank's old reports are another pid's).
            reported = state if state is not None and state.pid == process.pid else None
            views.append(
                RankView(
                    rank=process.rank,
                    pid=process.pid,
                    alive=process.popen.poll() is None,
                    phase=reported.phase if reported is not None else "setup",
                    step=reported.step if reported is not None else -1,
                    last_report_at=reported.last_report_at if reported is not None else None,
                    last_progress_at=reported.last_progress_at if reported is not None else None,
                    step_times=list(reported.step_times_s) if reported is not None else [],
                    started_at=process.started_at_utc,
                    loss=reported.loss if reported is not None else None,
                )
            )
        return views

    def sample(self, now: datetime, channel: RankChannel, supervisor: RankSupervisor) -> list[EventPayload]:
        observations = [o for probe in self.probes for o in probe.collect()]
        views = self.rank_views(channel, supervisor)
        observations += self.rank_probe.collect(views, now)
        # The ranks' own connections (gloo's, the rendezvous store's): a peer host that stopped answering.
        observations += self.peer_probe.collect([v.pid for v in views if v.alive])
        self.state, changes = self.core.step(self.state, observations, now)
        return list(changes)


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


def classify(spec: LaunchSpec) -> Callable[[int | None, str | None, str], tuple[str, str, str]]:
    """The exit classifier bound to the user's code: frames under its directory count as user code."""
    user_paths = user_code_paths(spec.command)

    def run(exit_code: int | None, signal: str | None, stderr_tail: str) -> tuple[str, str, str]:
        return classify_exit(exit_code, signal, stderr_tail, user_paths)

    return run

"""From a capture round's events to the aggregation's inputs, and from its verdict to ``StacksAnalyzed``.

Pure. The agents ship each process's threads with frames as ``function (file:line)``, outermost first
(``keel.agent.stack_capture``); they become ``keel.rules.stacks`` objects again here. The topology is
the ranks' own parallel groups (``StacksCaptured.ranks``) placed on the node that reported them, plus
what the rest of the log says (``rank_nodes``: the newest ``RankStarted`` of each rank); a rank nobody
reported is placed from its peers' groups (each rank's PP and DP group lists its members), else alone.
Ranks of nodes that sent nothing by the deadline are missing evidence, never healthy.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

from keel.analyzer.aggregate import Topology, aggregate, format_ranks
from keel.events.types import CapturedProcess, StacksCaptured
from keel.rules.stacks import Frame, MissingEvidence, ProcessStacks, ThreadStack

_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>.*):(?P<line>\d+)\)$")


@lru_cache(maxsize=1 << 16)
def frame_of(text: str) -> Frame:
    """A shipped frame (``function (file:line)``) as a ``Frame``.

    Memoised: a round repeats the same few thousand frame texts across every rank, and ``Frame`` is
    immutable, so ranks share one object per text. Parsing each anew allocated a ``Frame`` per frame of
    every process (384,000 for 8,192 ranks) while the round's decoded events filled the heap, and the
    collector's full passes over that heap made it the analyzer's slowest step (14 of 19 s there).
    """
    match = _FRAME.match(text)
    if match is None:
        return Frame(name=text, filename="?", short_filename="?", line=0)
    return Frame(name=match["name"], filename=match["file"], short_filename=match["file"], line=int(match["line"]))


def process_of(captured: CapturedProcess) -> ProcessStacks:
    threads = tuple(ThreadStack(pid=captured.pid, thread_id=i, os_thread_id=t.os_thread_id, thread_name=t.name or None,
                                active=t.active, owns_gil=False, frames=tuple(frame_of(f) for f in reversed(t.frames)))
                    for i, t in enumerate(captured.threads))
    return ProcessStacks(pid=captured.pid, role=captured.role, threads=threads, rank=captured.rank,
                         parent_pid=captured.parent_pid)


def topology_of(captures: Iterable[StacksCaptured], rank_nodes: Mapping[int, str], world_size: int) -> Topology:
    """Every rank 0..world_size-1 placed (see the module docstring)."""
    groups: dict[int, dict[str, tuple[int, ...]]] = {}
    nodes: dict[int, str] = dict(rank_nodes)
    for capture in captures:
        for entry in capture.ranks:
            groups[entry.rank] = {"tp": tuple(entry.tp or [entry.rank]), "pp": tuple(entry.pp or [entry.rank]),
                                  "dp": tuple(entry.dp or [entry.rank])}
            nodes[entry.rank] = capture.node_id
    world = max([world_size, *(r + 1 for r in nodes), *(r + 1 for r in groups)])
    mapping: dict[int, dict[str, Any]] = {}
    for rank in range(world):
        known = groups.get(rank)
        if known is None:
            known = {}
            for kind in ("tp", "pp", "dp"):
                peer = next((g[kind] for g in groups.values() if rank in g[kind]), (rank,))
                known[kind] = peer
        mapping[rank] = {"node": nodes.get(rank, f"unknown-node-of-rank-{rank}"), **known}
    return Topology.from_mapping(mapping)


def judge(captures: list[StacksCaptured], *, silent_nodes: Iterable[str] = (), rank_nodes: Mapping[int, str],
          world_size: int) -> dict[str, Any]:
    """The ``StacksAnalyzed`` fields (all but ``request_id`` and ``round``) for one round."""
    silent = sorted(set(silent_nodes))
    topology = topology_of(captures, rank_nodes, world_size)
    processes = [process_of(p) for c in captures for p in c.processes]
    seen_main = {p.rank for p in processes if p.role == "rank"}
    missing = [MissingEvidence(m.rank, m.role, m.pid, f"{c.node_id}: {m.reason}")
               for c in captures for m in c.missing if not (m.role == "rank" and m.rank in seen_main)
               and 0 <= m.rank < topology.world_size]
    reported_missing = {m.rank for m in missing if m.role == "rank"}
    for node in silent:
        for rank in topology.node_ranks.get(node, ()):
            if rank not in seen_main and rank not in reported_missing:
                missing.append(MissingEvidence(rank, "rank", None, f"{node} sent no stacks by the round's deadline"))
    processes = [p for p in processes if p.rank is not None and 0 <= p.rank < topology.world_size]
    try:
        verdict = aggregate(processes, topology, missing)
    except ValueError as exc:  # inconsistent evidence (two main processes for one rank...): say so, evict nothing
        return {"conclusive": False, "reason": f"the captured evidence is inconsistent: {exc}",
                "missing": [_describe(m) for m in missing]}
    reason = "; ".join(verdict.reasons) or "no reason given"
    if verdict.outlier_ranks and not verdict.actionable:
        reason += f" (suspects: rank(s) {format_ranks(verdict.outlier_ranks)})"
    return {
        "conclusive": verdict.actionable,
        "outlier_ranks": list(verdict.outlier_ranks),
        "outlier_nodes": list(verdict.outlier_nodes),
        "group_kind": verdict.group_kind if verdict.actionable else "none",
        "group_ranks": list(verdict.group_ranks) if verdict.actionable else [],
        "group_nodes": [n for n in verdict.group_nodes if not n.startswith("unknown-node-of-rank-")]
        if verdict.actionable else [],
        "dominant_stack": list(verdict.dominant_stack),
        "outlier_stacks": {str(r): list(frames) for r, frames in sorted(verdict.outlier_stacks.items())},
        "missing": [_describe(m) for m in verdict.missing],
        "reason": reason[:4000],
    }


def _describe(m: MissingEvidence) -> str:
    what = "" if m.role == "rank" else f" ({m.role})"
    pid = f" (pid {m.pid})" if m.pid is not None else ""
    return f"rank {m.rank}{what}{pid}: {m.reason}"

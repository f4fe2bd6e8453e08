"""Rung 5 on the training side: the replay a node agent asks of its ranks, and how they answer.

When the controller suspects silent data corruption, the agents restart the ranks with
``$KEEL_SDC_REPLAY`` naming a JSON file (written by ``keel.agent``)::

    {"round": 0, "anomaly_step": 22,
     "phases": [{"index": 1, "kind": "contiguous", "groups": [[0, 1], [2, 3]]}, ...],   # global ranks
     "result_dir": "/.../sdc/round-0"}

A training program that supports replays (``keel.workload.train`` does) restores its checkpoint as usual
(the broker plans a step below the anomaly), then for each phase replays the next step: every replica on
the *same* recorded batch (replica 0's), its own gradients corrupted by the hardware or not
(``Session.corrupt``), and inside each group of the phase the ranks holding the same model shard
all-gather their gradients and compare them bitwise. Each rank writes its answer with ``write_result``
and exits 0 without training on. A program that ignores the variable simply trains: the agent ends it
at the round's timeout and the round is judged without it (its groups count as failed, never clean).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["REPLAY_ENV", "ReplayPhase", "ReplaySpec", "ReplaySpecError", "replay_spec", "result_path", "write_result"]

REPLAY_ENV = "KEEL_SDC_REPLAY"


class ReplaySpecError(ValueError):
    """The replay file is missing or malformed: the replay cannot run (the rank exits non-zero, saying why)."""


@dataclass(frozen=True)
class ReplayPhase:
    index: int
    kind: str
    groups: tuple[tuple[int, ...], ...]
    """Each group's global ranks."""

    def group_of(self, rank: int) -> int | None:
        return next((i for i, g in enumerate(self.groups) if rank in g), None)


@dataclass(frozen=True)
class ReplaySpec:
    round: int
    anomaly_step: int
    phases: tuple[ReplayPhase, ...]
    result_dir: Path


def parse_spec(data: Any) -> ReplaySpec:
    """Validate a replay file's JSON; ``ReplaySpecError`` names the problem."""
    try:
        phases = tuple(ReplayPhase(int(p["index"]), str(p.get("kind", "")),
                                   tuple(tuple(int(r) for r in g) for g in p["groups"])) for p in data["phases"])
        spec = ReplaySpec(int(data["round"]), int(data.get("anomaly_step", -1)), phases, Path(data["result_dir"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ReplaySpecError(f"malformed replay file: {type(exc).__name__}: {exc}") from None
    if not phases or any(not p.groups or any(not g for g in p.groups) for p in phases):
        raise ReplaySpecError("malformed replay file: a phase without groups, or an empty group")
    return spec


def replay_spec(env: Mapping[str, str] | None = None) -> ReplaySpec | None:
    """The replay this process is asked to run, or ``None`` for ordinary training."""
    env = os.environ if env is None else env
    path = env.get(REPLAY_ENV)
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ReplaySpecError(f"replay file {path}: {exc}") from None
    return parse_spec(data)


def result_path(result_dir: Path, rank: int) -> Path:
    return result_dir / f"rank{rank}.json"


def write_result(spec: ReplaySpec, rank: int, restored_step: int, results: list[dict[str, Any]], detail: str = "") -> Path:
    """This rank's answer, written atomically: ``results`` is one dict per phase it took part in
    (``phase``, ``group``, ``consistent``, ``digest``, ``detail``)."""
    spec.result_dir.mkdir(parents=True, exist_ok=True)
    target = result_path(spec.result_dir, rank)
    body = json.dumps({"rank": rank, "round": spec.round, "restored_step": restored_step, "results": results,
                       "detail": detail})
    fd, tmp = tempfile.mkstemp(dir=spec.result_dir, prefix=f".rank{rank}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(body)
    os.replace(tmp, target)
    return target

"""Capture the stacks of a node's training processes with py-spy (adapter: /proc and subprocesses).

For rung 3 the analyzer needs the stack of every process of every rank: the rank itself and its
children (dataloader workers, checkpoint helpers), found through ``/proc/<pid>/task/*/children``. Each
is dumped with ``py-spy dump --json --nonblocking`` (``--native`` on request), in parallel, so capture
never stops training (non-blocking reads may be torn, which is why rounds repeat). The dump is parsed
and a child's role guessed with ``keel.rules.stacks``; frames are shipped as ``function (file:line)``,
outermost first; interpreting them (normalising, grouping) is the analyzer's.

Nothing is silently left out: a rank without a process, a process that vanished before or during its
dump, a py-spy failure or timeout each becomes a ``MissingProcess`` with its reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from keel.events.types import CapturedProcess, CapturedThread, MissingProcess
from keel.rules.stacks import StackParseError, ThreadStack, classify_role, parse_threads

PY_SPY_TIMEOUT_S = 10.0
MAX_PROCESSES_PER_RANK = 64
"""A rank with more descendants than this is cut there (the cut is reported as missing evidence)."""


class CaptureError(RuntimeError):
    """py-spy could not dump a process; the message says why."""


def py_spy_path() -> str:
    """py-spy next to this interpreter (the venv's), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    found = shutil.which("py-spy")
    if found is None:
        raise CaptureError("py-spy is not installed (pip install py-spy)")
    return found


def children_of(pid: int, proc: Path = Path("/proc")) -> list[int]:
    children: list[int] = []
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return sorted(set(children))


def process_tree(root: int, proc: Path = Path("/proc"), limit: int = MAX_PROCESSES_PER_RANK) -> list[tuple[int, int | None]]:
    """``(pid, parent pid)`` of ``root`` and its descendants, breadth first, at most ``limit``."""
    tree: list[tuple[int, int | None]] = [(root, None)]
    frontier = [root]
    while frontier and len(tree) < limit:
        parent = frontier.pop(0)
        for child in children_of(parent, proc):
            if len(tree) >= limit:
                break
            tree.append((child, parent))
            frontier.append(child)
    return tree


def captured_threads(threads: list[ThreadStack]) -> list[CapturedThread]:
    """py-spy's threads as event records: frames as ``function (file:line)``, outermost first."""
    return [CapturedThread(name=t.thread_name or "", os_thread_id=t.os_thread_id, active=t.active,
                           frames=[f"{f.name} ({f.short_filename}:{f.line})" for f in t.outermost_first])
            for t in threads]


def dump(pid: int, *, native: bool = False, timeout_s: float = PY_SPY_TIMEOUT_S, py_spy: str | None = None) -> list[dict]:
    """``py-spy dump --json --nonblocking`` of one process. Raises ``CaptureError``."""
    argv = [py_spy or py_spy_path(), "dump", "--pid", str(pid), "--json", "--nonblocking"]
    if native:
        argv.append("--native")
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise CaptureError(f"py-spy did not finish within {timeout_s:g} s") from None
    except OSError as exc:
        raise CaptureError(f"py-spy could not run: {exc}") from None
    if done.returncode != 0:
        message = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise CaptureError(f"py-spy failed: {message[:300]}")
    try:
        threads = json.loads(done.stdout)
    except ValueError as exc:
        raise CaptureError(f"py-spy wrote no valid JSON: {exc}") from None
    if not isinstance(threads, list):
        raise CaptureError("py-spy's JSON is not a list of threads")
    return threads


@dataclass(frozen=True)
class NodeCapture:
    processes: list[CapturedProcess]
    missing: list[MissingProcess]
    duration_s: float


def capture_ranks(rank_pids: Mapping[int, int | None], *, native: bool = False,
                  timeout_s: float = PY_SPY_TIMEOUT_S, proc: Path = Path("/proc")) -> NodeCapture:
    """Dump every process of every rank (``rank -> pid``; None: the rank has no process now)."""
    started = time.monotonic()
    missing: list[MissingProcess] = []
    targets: list[tuple[int, int, int | None]] = []  # (rank, pid, parent pid)
    for rank, pid in sorted(rank_pids.items()):
        if pid is None:
            missing.append(MissingProcess(rank=rank, reason="no process on this node"))
            continue
        tree = process_tree(pid, proc)
        if len(tree) >= MAX_PROCESSES_PER_RANK:
            missing.append(MissingProcess(rank=rank, pid=pid, role="other", reason=f"more than {MAX_PROCESSES_PER_RANK} "
                                          f"processes: only the first were dumped"))
        targets += [(rank, child, parent) for child, parent in tree]

    def lost(rank: int, pid: int, parent: int | None, reason: str) -> MissingProcess:
        return MissingProcess(rank=rank, pid=pid, role="rank" if parent is None else "other", reason=reason)

    try:
        py_spy = py_spy_path()
    except CaptureError as exc:
        return NodeCapture([], missing + [lost(rank, pid, parent, str(exc)) for rank, pid, parent in targets],
                           time.monotonic() - started)

    def one(target: tuple[int, int, int | None]) -> CapturedProcess | MissingProcess:
        rank, pid, parent = target
        if not os.path.exists(proc / str(pid)):
            return lost(rank, pid, parent, "the process vanished before its dump")
        try:
            threads = parse_threads(dump(pid, native=native, timeout_s=timeout_s, py_spy=py_spy))
        except (CaptureError, StackParseError) as exc:
            gone = "" if os.path.exists(proc / str(pid)) else " (the process vanished)"
            return lost(rank, pid, parent, f"{exc}{gone}")
        return CapturedProcess(pid=pid, parent_pid=parent, rank=rank,
                               role="rank" if parent is None else classify_role(threads), threads=captured_threads(threads))

    processes: list[CapturedProcess] = []
    if targets:
        with ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
            for result in pool.map(one, targets):
                if isinstance(result, MissingProcess):
                    missing.append(result)
                else:
                    processes.append(result)
    return NodeCapture(processes, missing, time.monotonic() - started)


def split_parts(processes: list[CapturedProcess], max_bytes: int) -> list[list[CapturedProcess]]:
    """Split the processes into parts whose JSON stays under ``max_bytes`` (a process too large on its own
    keeps only its innermost frames per thread, marked, never dropped)."""
    parts: list[list[CapturedProcess]] = [[]]
    size = 0
    for process in processes:
        encoded = len(process.model_dump_json())
        if encoded > max_bytes:
            keep = 64
            while encoded > max_bytes and keep > 1:
                process = process.model_copy(update={"threads": [
                    t.model_copy(update={"frames": ["[... outer frames cut to fit the event]", *t.frames[-keep:]]})
                    for t in process.threads]})
                encoded = len(process.model_dump_json())
                keep //= 2
        if parts[-1] and size + encoded > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append(process)
        size += encoded
    return parts

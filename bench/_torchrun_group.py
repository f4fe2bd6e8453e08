"""The recovery benchmark's baselines: one plain ``torchrun`` per simulated node, as a 4-node job runs.

``Group`` starts 4 launchers (``torchrun --nnodes 4 --nproc-per-node 2 --rdzv-backend c10d``, the
rendezvous on 127.0.0.1 hosted by node 0's launcher: ``--rdzv-conf is_host=true`` there, ``false``
elsewhere), each running 2 ranks of ``keel.workload.train`` with a torchrun-style persistent checkpoint
(``--persist-every N --persist-dir D``: every rank saves its whole state synchronously every N steps,
and a (re)started run resumes from the newest step every rank saved). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(see docs/architecture.md, "The node agent": restarts reuse stale rendezvous keys otherwise). No ``KEEL_*`` variable reaches the
ranks except ``KEEL_FAULT_FILE``: the SDK reads injected workload faults from it without an agent.

Every output line of every launcher (its own and its workers', which inherit its stdout) is
timestamped on arrival (``bench._peers.Launcher``). The processes of one simulated node carry an
environment marker, so that a lost node can be SIGKILLed whole (launcher and workers: torchrun starts
each worker in its own session) and a hung rank found by its ``RANK``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._peers import AGENT_FAILURE, Launcher

MARKER = "KEEL_BENCH_RECOVERY_PROC"
STEP = re.compile(r"^step (\d+) .*step_time_s ([0-9.]+) .*t_unix ([0-9.]+)")
SETUP = re.compile(r"^keel\.workload: size .* setup_s ([0-9.]+) restore_s ([0-9.]+) t_unix ([0-9.]+)")
RESTORED = re.compile(r"^keel\.workload: restored step (\d+) from (.*)")
PERSIST = re.compile(r"^persist step (\d+) save_s ([0-9.]+)")
SAVED = re.compile(r"^keel\.workload: saved step (\d+) on SIGTERM t_unix ([0-9.]+)")
"""``--save-on-sigterm``: rank 0's line once every rank persisted the step the job stopped at."""


@dataclass
class Line:
    at: float
    """Arrival time (``time.time()``) at the bench."""
    node: int
    text: str


@dataclass
class Group:
    work: Path
    tag: str
    train: list[str]
    persist_every: int
    persist_dir: Path
    fault_file: Path
    max_restarts: int
    nodes: int = 4
    nproc: int = 2
    port: int = 0
    launchers: list[tuple[int, Launcher]] = field(default_factory=list)
    """(node index, launcher), in start order; a replaced node has several."""

    def __post_init__(self) -> None:
        from keel.infra.embedded import free_port

        self.port = self.port or free_port()
        self.rdzv_id = f"{self.tag}-{uuid.uuid4().hex[:6]}"

    def argv(self, node: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes),
                "--nproc-per-node", str(self.nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.rdzv_id,
                "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", "--local-addr", "127.0.0.1",
                "--max-restarts", str(self.max_restarts), "-m", "keel.workload.train", *self.train,
                "--persist-every", str(self.persist_every), "--persist-dir", str(self.persist_dir)]

    def env(self, node: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KEEL_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        repo = str(Path(__file__).resolve().parents[1])
        env.update({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "KEEL_FAULT_FILE": str(self.fault_file),
                    "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
                    MARKER: self.marker(node), "PYTHONUNBUFFERED": "1"})
        return env

    def marker(self, node: int) -> str:
        return f"{self.rdzv_id}/n{node}"

    def start(self) -> None:
        self.persist_dir.mkdir(parents=True, exist_ok=True)
        for node in range(self.nodes):
            self.start_node(node)
            if node == 0:
                time.sleep(0.5)  # the rendezvous host binds its port first

    def start_node(self, node: int) -> Launcher:
        """Start node ``node``'s launcher (again, after it was lost: a replacement machine)."""
        count = sum(1 for n, _ in self.launchers if n == node)
        launcher = Launcher(self.argv(node), self.env(node), self.work / f"{self.rdzv_id}-n{node}.{count}.log")
        launcher.start()
        self.launchers.append((node, launcher))
        return launcher

    def pids(self, node: int | None = None, rank: int | None = None) -> list[int]:
        """Processes of this group (of one node; of one rank), found by their environment marker."""
        markers = [self.marker(n).encode() for n in ([node] if node is not None else range(self.nodes))]
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                environ = (proc / "environ").read_bytes()
            except OSError:
                continue
            entries = environ.split(b"\0")
            if not any(f"{MARKER}=".encode() + m in entries for m in markers):
                continue
            if rank is not None and f"RANK={rank}".encode() not in entries:
                continue
            found.append(int(proc.name))
        return found

    def kill_node(self, node: int) -> None:
        """Lose node ``node`` as a machine is lost: SIGKILL its launcher and its workers at once."""
        for pid in self.pids(node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_rank(self, rank: int) -> list[int]:
        pids = self.pids(rank=rank)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def kill_all(self) -> None:
        """Stop everything now (what cancelling the job does, without the grace period)."""
        for _ in range(3):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        for _, launcher in self.launchers:
            if launcher.process is not None:
                try:
                    launcher.process.wait(timeout=5)
                except Exception:  # noqa: BLE001 - already gone or unkillable: nothing more to do
                    pass

    def terminate(self) -> None:
        """Ask the job to stop as a scheduler's cancel or preemption does: SIGTERM to every launcher, which
        forwards it to its workers and waits for them (torchrun's own 30 s grace, then SIGKILL)."""
        for _, launcher in self.launchers:
            if launcher.process is not None and launcher.process.poll() is None:
                launcher.process.send_signal(signal.SIGTERM)

    def lines(self, since: float = 0.0) -> list[Line]:
        merged = [Line(at, node, text) for node, launcher in self.launchers for at, text in launcher.snapshot()
                  if at >= since]
        merged.sort(key=lambda line: line.at)
        return merged

    def exited(self) -> list[tuple[int, int | None]]:
        return [(node, launcher.process.returncode) for node, launcher in self.launchers
                if launcher.process is not None and launcher.process.poll() is not None]

    def log_paths(self) -> list[str]:
        return [str(launcher.log_path) for _, launcher in self.launchers]


def write_fault(path: Path, kind: str, rank: int, at_step: int) -> str:
    fault_id = str(uuid.uuid4())
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"id": fault_id, "kind": kind, "rank": rank, "params": {"at_step": at_step}}))
    os.replace(tmp, path)
    return fault_id


def last_step(lines: list[Line]) -> tuple[int, float, float] | None:
    """The newest step line: (step, its t_unix, its arrival time)."""
    for line in reversed(lines):
        match = STEP.match(line.text)
        if match:
            return int(match.group(1)), float(match.group(3)), line.at
    return None


def first_failure(lines: list[Line], since: float) -> Line | None:
    """The first line a launcher (not a worker) writes once it noticed a failed worker."""
    for line in lines:
        if line.at >= since and AGENT_FAILURE.search(line.text):
            return line
    return None


def summary(lines: list[Line]) -> dict[str, Any]:
    return {"lines": len(lines), "tail": [f"{line.at:.3f} n{line.node} {line.text}"[:300] for line in lines[-15:]]}

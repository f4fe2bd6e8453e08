"""Start, watch, stop and restart one node's rank processes (adapter: processes and pipes only).

Every rank runs in its own process group, so stopping a rank also stops its dataloader workers and
other children. With ``warm`` on, the supervisor keeps the node's zygote (``keel.agent.warm``: torch
imported once) and forks ranks from it, so a restart skips the interpreter start and ``import torch``;
a forked rank's stderr goes straight to its log file, whose end is the exit's tail. Without a ready
zygote, ranks start as fresh interpreters. A rank's stderr is kept as a bounded tail (for exit
classification) and written in full to ``<agent_dir>/logs/``. Restarts in place use a new *generation*: a new rendezvous port, so no
stale store keys survive (see ``LaunchSpec.master_port_for``).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from keel.agent.launch_spec import LaunchSpec
from keel.agent.warm import CODE_DIR_ENV, ForkedProcess, Zygote, ZygoteError
from keel.events.types import CodeRef

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 40


CONTROL_PLANE_ENV = ("KEEL_NATS_URL", "KEEL_DATABASE_URL", "KEEL_CREDENTIALS_DIR", "KEEL_HOME", "KEEL_CONFIG")
"""The agent's own environment that training code must not inherit: where the control plane's servers and
credentials are. A rank talks to its agent over the node-local channel only."""


def without_control_plane_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the control plane's servers, credentials and settings (every ``KEEL_BUS__*``,
    ``KEEL_POSTGRES__*`` and ``KEEL_NATS__*`` too): what a rank's environment starts from."""
    return {key: value for key, value in environ.items()
            if key not in CONTROL_PLANE_ENV and not key.startswith(("KEEL_BUS__", "KEEL_POSTGRES__", "KEEL_NATS__"))}


@dataclass
class RankProcess:
    rank: int
    local_rank: int
    generation: int
    popen: subprocess.Popen | ForkedProcess
    started_at_s: float
    started_at_utc: datetime
    stderr_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))
    stopping: bool = False
    """Set when the agent itself stops the rank: its exit is not a failure."""
    reported_failure: str = ""
    """The uncaught exception the rank reported before the agent killed it (see ``kill_failed``)."""
    reader: threading.Thread | None = None
    stderr_path: Path | None = None
    """Where a forked rank's stderr goes (no pipe): the tail is read from the end of that file."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail_text(self) -> str:
        if self.reader is None and self.stderr_path is not None:
            return file_tail(self.stderr_path, STDERR_TAIL_LINES)
        return "".join(self.stderr_tail)


def file_tail(path: Path, lines: int, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a log file ('' when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return ""
    return "".join(data.decode(errors="replace").splitlines(keepends=True)[-lines:])


@dataclass(frozen=True)
class RankExit:
    rank: int
    local_rank: int
    pid: int
    generation: int
    exit_code: int | None
    signal: str | None
    stderr_tail: str
    stopped_by_agent: bool
    reported_failure: str = ""


def _pump_stderr(stream: IO[bytes], tail: collections.deque[str], log_path: Path) -> None:
    with open(log_path, "ab") as log_file:
        for line in iter(stream.readline, b""):
            log_file.write(line)
            log_file.flush()
            tail.append(line.decode(errors="replace"))
    stream.close()


class RankSupervisor:
    """Owns the rank processes of one node. Not thread-safe: call from the agent's loop only."""

    def __init__(self, spec: LaunchSpec, socket_path: Path, fault_file: Path, python: str = sys.executable,
                 *, warm: bool = False, clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.spec = spec
        self.clock = clock
        """The agent's clock (``keel.agent.clock``): a rank's start is dated on the clock its reports are judged by."""
        self.warm = warm
        self.zygote: Zygote | None = None
        self.cold_starts = 0
        """Ranks started as fresh interpreters (no ready zygote), counted for the tests and the logs."""
        self.socket_path = socket_path
        self.fault_file = fault_file
        self.python = python
        self.ranks: dict[int, RankProcess] = {}
        self.generation = 0
        self.extra_env: dict[str, str] = {}
        """Added to every rank's environment (the checkpoint folder and restore plan of a generation)."""
        self.code: CodeRef | None = None
        """The code version the ranks run (hot-update); None or a version without a path: the launch command."""
        self.last_start_warm = True
        """Whether the latest ``start_all`` forked every rank from the zygote."""
        self.logs_dir = spec.agent_dir / "logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)

    def rank_env(self, local_rank: int, generation: int) -> dict[str, str]:
        spec = self.spec
        env = without_control_plane_credentials(os.environ)
        env.update(
            RANK=str(spec.global_rank(local_rank)),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=str(spec.world_size),
            LOCAL_WORLD_SIZE=str(spec.nproc_per_node),
            GROUP_RANK=str(spec.node_rank),
            NODE_RANK=str(spec.node_rank),
            ROLE_RANK=str(spec.global_rank(local_rank)),
            ROLE_WORLD_SIZE=str(spec.world_size),
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(spec.master_port_for(generation)),
            TORCHELASTIC_RESTART_COUNT=str(generation),
            KEEL_JOB_ID=spec.job_id,
            KEEL_NODE_ID=spec.node_id,
            KEEL_AGENT_SOCKET=str(self.socket_path),
            KEEL_GENERATION=str(generation),
            PYTHONUNBUFFERED="1",
        )
        # Files that make a rank fail on purpose are read only where fault injection is on for the node
        # (``--keel-fault-injection``): otherwise the variables are not passed, not even from the agent's
        # own environment.
        env.pop("KEEL_FAULT_FILE", None)
        env.pop("KEEL_SIMULATED_SDC_FILE", None)
        if spec.fault_injection:
            env["KEEL_FAULT_FILE"] = str(self.fault_file)
            if spec.root != Path("/"):
                # A local cluster's simulated node: its simulated silent data corruption (``keel inject
                # sdc``) is read by the ranks themselves (``keel.sdk.Session.corrupt``).
                env["KEEL_SIMULATED_SDC_FILE"] = str(spec.root / "run/keel/sdc.json")
        env.update(self.extra_env)
        env.setdefault("OMP_NUM_THREADS", "1")
        code = self.code
        if code is not None:
            env["KEEL_CODE_VERSION"] = code.version_id
            if code.path:
                env[CODE_DIR_ENV] = code.path
                # A rank (root, on a real node) must not write bytecode into the read-only store: a stored
                # version holds nothing its digest leaves out, or the next check refuses it.
                env["PYTHONDONTWRITEBYTECODE"] = "1"
                env["PYTHONPATH"] = os.pathsep.join(filter(None, (code.path, env.get("PYTHONPATH", ""))))
        return env

    def rank_command(self) -> tuple[tuple[str, ...], str | None]:
        """The rank's argv after the interpreter and its working directory (None: the agent's own).

        A code version replaces the launch command's program (``train.py`` or ``-m pkg.mod``) by its entry
        point, resolved inside the version's directory, keeps the launch's arguments, and runs in the
        version's directory, so nothing of the old code's directory can shadow it."""
        code, command = self.code, self.spec.command
        if code is None or not code.path:
            return command, None
        arguments = command[2:] if command[:1] == ("-m",) else command[1:]
        entry = list(code.entry) or list(command[: len(command) - len(arguments)])
        if entry[0] != "-m":
            entry[0] = str(Path(code.path) / entry[0])
        return (*entry, *arguments), code.path

    def shadowed_by_code(self) -> list[str]:
        """Modules the zygote imported that the code version ships too: a forked rank would run the
        zygote's copies, so such a version starts its ranks as fresh interpreters."""
        code = self.code
        if code is None or not code.path or self.zygote is None:
            return []
        imported = self.zygote.imported()
        if not imported:
            return ["<unknown: the zygote did not list its modules>"]
        return sorted(top_level_names(Path(code.path)) & imported)

    def start_all(self, generation: int) -> list[RankProcess]:
        """Start every local rank as ``generation``. The previous generation must be stopped first."""
        if any(p.popen.poll() is None for p in self.ranks.values()):
            raise RuntimeError("start_all while ranks of the previous generation still run; stop_all first")
        self.generation = generation
        self.ranks = {}
        command, cwd = self.rank_command()
        shadowed = self.shadowed_by_code()
        if shadowed:
            log.warning("code version %s ships %s, which the zygote imported: starting fresh interpreters",
                        self.code.version_id if self.code else "?", ", ".join(shadowed))
        self.last_start_warm = True
        for local_rank in range(self.spec.nproc_per_node):
            rank = self.spec.global_rank(local_rank)
            stdout_path = self.logs_dir / f"rank{rank}.g{generation}.stdout"
            stderr_path = self.logs_dir / f"rank{rank}.g{generation}.stderr"
            env = self.rank_env(local_rank, generation)
            forked = None if shadowed else self._fork(f"rank{rank}.g{generation}", env, stdout_path, stderr_path,
                                                      command, cwd)
            if forked is not None:
                self.ranks[rank] = RankProcess(rank, local_rank, generation, forked, time.monotonic(),
                                               self.clock(), stderr_path=stderr_path)
                continue
            self.cold_starts += 1
            self.last_start_warm = False
            with open(stdout_path, "ab") as stdout:
                popen = subprocess.Popen(
                    [self.python, *command],
                    env=env,
                    cwd=cwd,
                    stdout=stdout,
                    stderr=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            process = RankProcess(rank, local_rank, generation, popen, time.monotonic(), self.clock())
            assert popen.stderr is not None
            process.reader = threading.Thread(
                target=_pump_stderr, args=(popen.stderr, process.stderr_tail, stderr_path),
                name=f"rank{rank}-stderr", daemon=True,
            )
            process.reader.start()
            self.ranks[rank] = process
        return list(self.ranks.values())

    # -- the zygote -------------------------------------------------------------------------------

    def _fork(self, identity: str, env: dict[str, str], stdout: Path, stderr: Path, command: tuple[str, ...],
              cwd: str | None) -> ForkedProcess | None:
        if self.zygote is None or not self.zygote.ready():
            return None
        try:
            return self.zygote.launch(identity, command, env, stdout, stderr, cwd=cwd)
        except ZygoteError as exc:
            log.warning("%s: %s; starting a fresh interpreter", identity, exc)
            return None

    def zygote_needed(self) -> bool:
        """Warm starts are on and there is no live zygote."""
        return self.warm and (self.zygote is None or not self.zygote.alive())

    def start_zygote(self, extra_env: dict[str, str] | None = None) -> None:
        """Start (or replace a dead) zygote with the node's rank environment. Errors are logged."""
        if self.zygote is not None:
            self.zygote.close()
        # Without the code version's variables: the zygote must hold no version's directory on its path
        # (a later version's ranks would import what it lacks from there).
        code, self.code = self.code, None
        try:
            env = {**self.rank_env(0, self.generation + 1), **(extra_env or {})}
        finally:
            self.code = code
        try:
            self.zygote = Zygote.start(env, self.spec.agent_dir / "warm" / "zygote.ready",
                                       stderr_log=self.logs_dir / "zygote.stderr", python=self.python)
        except OSError as exc:
            log.error("cannot start the zygote: %s", exc)
            self.zygote = None

    def close_zygote(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None

    def poll(self) -> list[RankExit]:
        """Ranks that exited since the last call (each reported once)."""
        exits = []
        for rank, process in list(self.ranks.items()):
            code = process.popen.poll()
            if code is None:
                continue
            if process.reader is not None:
                process.reader.join(timeout=2)  # the tail is complete once the pipe is drained
            del self.ranks[rank]
            exits.append(
                RankExit(
                    rank=rank,
                    local_rank=process.local_rank,
                    pid=process.pid,
                    generation=process.generation,
                    exit_code=code if code >= 0 else None,
                    signal=signal.Signals(-code).name if code < 0 else None,
                    stderr_tail=process.tail_text(),
                    stopped_by_agent=process.stopping and not process.reported_failure,
                    reported_failure=process.reported_failure,
                )
            )
        return exits

    def kill_failed(self, rank: int, error: str) -> bool:
        """SIGKILL a rank that reported an uncaught exception: its traceback is already on stderr, and
        a dying torch process can spend seconds shutting its process groups down. True if killed."""
        process = self.ranks.get(rank)
        if process is None or process.reported_failure or process.popen.poll() is not None:
            return False
        process.reported_failure = error or "uncaught exception"
        self._signal_group(process, signal.SIGKILL)
        return True

    def rank_pids(self) -> dict[int, int]:
        """pid -> global rank of the rank processes started and not yet reported ended (``poll``): the
        only senders the node-local channel takes reports from."""
        return {process.pid: rank for rank, process in self.ranks.items()}

    def alive(self) -> list[RankProcess]:
        return [p for p in self.ranks.values() if p.popen.poll() is None]

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every rank's process group, then SIGKILL what is left after ``grace_s``."""
        for process in self.ranks.values():
            process.stopping = True
            self._signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        for process in self.alive():
            self._signal_group(process, signal.SIGKILL)
        for process in self.ranks.values():
            try:
                process.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("rank %d (pid %d) did not die after SIGKILL", process.rank, process.pid)

    @staticmethod
    def _signal_group(process: RankProcess, sig: signal.Signals) -> None:
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def top_level_names(directory: Path) -> set[str]:
    """The importable top-level names a directory provides (modules, packages, extension modules)."""
    names: set[str] = set()
    try:
        entries = list(directory.iterdir())
    except OSError:
        return names
    for entry in entries:
        if entry.is_dir():
            if entry.name.isidentifier():
                names.add(entry.name)
        elif entry.suffix in (".py", ".pyc", ".so", ".pyd"):
            names.add(entry.name.split(".", 1)[0])
    return names

"""Start, watch, stop and restart one node's rank processes (adapter: processes and pipes only).

Every rank runs in its own process group, so stopping a rank also stops its dataloader workers and
other children. With ``warm`` on, the supervisor keeps the node's zygote (``keel.agent.warm``: torch
imported once) and forks ranks from it, so a restart skips the interpreter start and ``import torch``;
a forked rank's stderr goes straight to its log file, whose end is the exit's tail. Without a ready
zygote, ranks start as fresh interpreters. A rank's stderr is kept as a bounded tail (for exit
classification) and written in full to a file: torchrun's ``stdout.log``/``stderr.log`` where
``--redirects``/``--tee`` say so, else ``<agent_dir>/logs/rank<R>.g<G>.stdout|stderr``, whose lines
reach the agent's console as torchrun's would (``keel.agent.rank_output``). The environment is
torchrun's (``rank_env``). Restarts in place use a new *generation*: a new rendezvous port, so no
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
from keel.agent.oom_kills import KernelOomLog
from keel.agent.rank_output import ConsoleTail, RankOutputPlan, make_run_dir, plan_outputs, prepare_attempt
from keel.agent.warm import CODE_DIR_ENV, ForkedProcess, Zygote, ZygoteError
from keel.events.types import CodeRef
from keel.protocol.processes import injected_oom_cgroup_name, memory_cgroup_path

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
    """Where the rank's stderr goes (a forked rank's tail is read from the end of that file)."""
    stdout_path: Path | None = None

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


def remove_injected_oom_cgroup(rank: int, pid: int) -> None:
    """Remove the memory cgroup an injected ``oom_kernel`` fault made for a rank that is gone (a cgroup
    directory outlives its processes; an empty one is removed with rmdir). Nothing there: nothing done."""
    try:
        os.rmdir(memory_cgroup_path(injected_oom_cgroup_name(rank, pid), pid=str(os.getpid())))
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove rank %d's injected-OOM memory cgroup: %s", rank, exc)


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
    oom_killed: bool = False
    """The kernel's OOM killer sent the SIGKILL (its log names the pid: ``keel.agent.oom_kills``)."""


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
        self.oom_log = KernelOomLog()
        """Opened now, from its end: an OOM kill of one of this agent's ranks is logged after this."""
        self.generation = 0
        self.extra_env: dict[str, str] = {}
        """Added to every rank's environment (the checkpoint folder and restore plan of a generation)."""
        self.code: CodeRef | None = None
        """The code version the ranks run (hot-update); None or a version without a path: the launch command."""
        self.last_start_warm = True
        """Whether the latest ``start_all`` forked every rank from the zygote."""
        self.logs_dir = spec.agent_dir / "logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.run_log_dir: Path | None = None
        """torchrun's run folder, ``<--log-dir or logs_dir>/<run id>_<random>/`` (made at the first start)."""
        self.console = ConsoleTail(interval_s=min(0.1, spec.monitor_interval.total_seconds()))
        self.console_out: IO[bytes] | None = getattr(sys.stdout, "buffer", None)
        self.console_err: IO[bytes] | None = getattr(sys.stderr, "buffer", None)
        """Where the ranks' console lines go: the agent's own stdout and stderr (None: nowhere)."""
        self._filtered: dict[str, IO[bytes]] = {}

    def rank_env(self, local_rank: int, generation: int, error_file: str | None = None) -> dict[str, str]:
        """torchrun's worker environment (``docs/torchrun.md``): the agent's own, less the control plane's
        credentials, plus torchrun's variables and Keel's ``KEEL_*``. ``error_file``: the rank's
        ``TORCHELASTIC_ERROR_FILE`` (None: the path it will have, without creating anything)."""
        spec = self.spec
        env = without_control_plane_credentials(os.environ)
        rank = spec.global_rank(local_rank)
        if error_file is None:
            attempt = self.attempt_dir(generation)
            error_file = "" if attempt is None else str(attempt / str(local_rank) / "error.json")
        env.update(
            RANK=str(rank),
            GROUP_RANK=str(spec.node_rank),
            ROLE_RANK=str(rank),
            ROLE_NAME=spec.role,
            LOCAL_WORLD_SIZE=str(spec.nproc_per_node),
            WORLD_SIZE=str(spec.world_size),
            GROUP_WORLD_SIZE=str(spec.nnodes),
            ROLE_WORLD_SIZE=str(spec.world_size),
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(spec.master_port_for(generation)),
            TORCHELASTIC_RESTART_COUNT=str(generation),
            TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
            TORCHELASTIC_RUN_ID=spec.run_id,
            # The ranks' TCPStore is hosted by rank 0, not by the agent: "False" makes init_process_group
            # start it there (torchrun's agent hosts it and says "True").
            TORCHELASTIC_USE_AGENT_STORE=str(False),
            TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            TORCHELASTIC_SIGNALS_TO_HANDLE=",".join(spec.signals_to_handle),
            TORCHELASTIC_ERROR_FILE=error_file,
            KEEL_JOB_ID=spec.job_id,
            KEEL_NODE_ID=spec.node_id,
            KEEL_AGENT_SOCKET=str(self.socket_path),
            KEEL_GENERATION=str(generation),
        )
        if spec.virtual_local_rank:
            env["LOCAL_RANK"] = "0"
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            devices = [d.strip() for d in visible.split(",")] if visible is not None else None
            if devices is not None and local_rank >= len(devices):
                raise ValueError(f"local rank {local_rank} has no device in CUDA_VISIBLE_DEVICES={visible}")
            env["CUDA_VISIBLE_DEVICES"] = devices[local_rank] if devices is not None else str(local_rank)
        else:
            env["LOCAL_RANK"] = str(local_rank)
        # torchrun sets OMP_NUM_THREADS=1 (with a warning, ``keel.cli.agent_cmd``) for several ranks per
        # node when the launcher's environment does not set it.
        if spec.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"
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
        plans = self.output_plans(generation)
        for local_rank, plan in enumerate(plans):
            rank = self.spec.global_rank(local_rank)
            stdout_path, stderr_path = plan.stdout.path, plan.stderr.path
            env = self.rank_env(local_rank, generation, plan.error_file)
            self._show(plan)
            forked = None if shadowed or self.spec.no_python else self._fork(
                f"rank{rank}.g{generation}", env, stdout_path, stderr_path, command, cwd)
            if forked is not None:
                self.ranks[rank] = RankProcess(rank, local_rank, generation, forked, time.monotonic(),
                                               self.clock(), stderr_path=stderr_path, stdout_path=stdout_path)
                continue
            self.cold_starts += 1
            self.last_start_warm = False
            # ``-u`` as torchrun: unbuffered output, so the console and the files see lines as they come.
            argv = list(command) if self.spec.no_python else [self.python, "-u", *command]
            with open(stdout_path, "ab") as stdout:
                popen = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    stdout=stdout,
                    stderr=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            process = RankProcess(rank, local_rank, generation, popen, time.monotonic(), self.clock(),
                                  stderr_path=stderr_path, stdout_path=stdout_path)
            assert popen.stderr is not None
            process.reader = threading.Thread(
                target=_pump_stderr, args=(popen.stderr, process.stderr_tail, stderr_path),
                name=f"rank{rank}-stderr", daemon=True,
            )
            process.reader.start()
            self.ranks[rank] = process
        return list(self.ranks.values())

    # -- the ranks' output --------------------------------------------------------------------------

    def attempt_dir(self, generation: int) -> Path | None:
        """torchrun's ``<run dir>/attempt_<generation>`` (None: ``--log-dir /dev/null``)."""
        if self.spec.log_dir is not None and str(self.spec.log_dir) == os.devnull:
            return None
        if self.run_log_dir is None:
            self.run_log_dir = make_run_dir(self.spec.log_dir or self.logs_dir, self.spec.run_id)
            log.info("%s: rank log folder %s", self.spec.node_id, self.run_log_dir)
        return self.run_log_dir / f"attempt_{generation}"

    def output_plans(self, generation: int) -> list[RankOutputPlan]:
        """Where each local rank's streams go this generation; the folders made, Keel's names linked."""
        spec = self.spec
        attempt = self.attempt_dir(generation)
        if attempt is not None:
            prepare_attempt(attempt, spec.nproc_per_node)
        plans = plan_outputs(nproc=spec.nproc_per_node, global_ranks=[spec.global_rank(i) for i in range(spec.nproc_per_node)],
                             generation=generation, role=spec.role, redirects=spec.redirects, tee=spec.tee,
                             local_ranks_filter=spec.local_ranks_filter, attempt_dir=attempt, keel_logs=self.logs_dir,
                             prefix_template=spec.log_line_prefix_template)
        for local_rank, plan in enumerate(plans):
            for stream, name in ((plan.stdout, "stdout"), (plan.stderr, "stderr")):
                if stream.torchrun_file:
                    # Keel's own name for the stream (what the inspector and a rejoining agent read).
                    link = self.logs_dir / f"rank{spec.global_rank(local_rank)}.g{generation}.{name}"
                    link.unlink(missing_ok=True)
                    link.symlink_to(stream.path.absolute())
        self._close_filtered()
        if attempt is not None:
            for needles, name in ((spec.duplicate_stdout_filters, "stdout"), (spec.duplicate_stderr_filters, "stderr")):
                if needles:  # torchrun's --duplicate-*-filters: tee'd lines with a word go here too
                    self._filtered[name] = open(attempt / f"filtered_{name}.log", "wb")  # noqa: SIM115
        return plans

    def _close_filtered(self) -> None:
        for handle in self._filtered.values():
            handle.close()
        self._filtered = {}

    def _show(self, plan: RankOutputPlan) -> None:
        """Follow the rank's streams that torchrun would show on the console (from their current end:
        Keel's own files are appended to)."""
        spec = self.spec
        for stream, console, name, needles in (
                (plan.stdout, self.console_out, "stdout", spec.duplicate_stdout_filters),
                (plan.stderr, self.console_err, "stderr", spec.duplicate_stderr_filters)):
            if stream.console is not None and console is not None:
                filtered = self._filtered.get(name) if stream.torchrun_file else None
                self.console.follow(stream.path, console, stream.console, filtered, needles)

    def close_output(self) -> None:
        """Copy what is left of every rank's output to the console; close the filtered files."""
        self.console.close()
        self._close_filtered()

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
            self.console.finish([p for p in (process.stdout_path, process.stderr_path) if p is not None])
            del self.ranks[rank]
            oom_killed = (code == -signal.SIGKILL and not process.stopping and not process.reported_failure
                          and bool(self.oom_log.was_oom_killed(process.pid)))
            if code == -signal.SIGKILL:
                remove_injected_oom_cgroup(rank, process.pid)
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
                    oom_killed=oom_killed,
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

    def stop_all(self, grace_s: float | None = None) -> None:
        """SIGTERM every rank's process group, then SIGKILL what is left after ``grace_s`` (default: the
        launch's ``--shutdown-timeout``)."""
        if grace_s is None:
            grace_s = self.spec.shutdown_timeout.total_seconds()
        for process in self.ranks.values():
            process.stopping = True
            self._signal_group(process, signal.SIGTERM)
            # A stopped rank (SIGSTOP: a frozen process, a debugger) handles SIGTERM only once continued.
            self._signal_group(process, signal.SIGCONT)
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

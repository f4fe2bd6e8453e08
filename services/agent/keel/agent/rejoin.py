"""An agent restarted under a running job rejoins it: the agent folder's lock, its state file, and what
a new agent does about what its predecessor left behind.

The semantics (``docs/architecture.md``, "An agent restarted under a running job"):

- One agent per agent folder: the agent holds an exclusive ``flock`` on ``<agent_dir>/agent.lock`` for
  its whole life. A second agent on the same folder fails at once with ``AgentDirBusy`` (it would unbind
  the first one's socket and take its ranks for orphans). The kernel drops the lock when the holder dies,
  however it dies.
- While it runs, the agent keeps ``<agent_dir>/agent.json`` (``AgentState``) up to date: the job, the
  node, the generation its ranks run, the slice (node rank) and code version they run, and each rank's
  and the zygote's pid with its start time (so a recycled pid is never taken for one of them). An agent
  that ends by itself (its ranks finished or failed for good, or it was told to stop: SIGTERM/SIGINT stops
  its ranks first) removes the file: the next agent in the folder is a new launch, as before.
- An agent that finds the file was preceded by an agent that died without ending (SIGKILL, OOM killer,
  a crash). It stops whatever its predecessor left running (``leftover_processes``: the recorded pids
  still alive, plus any process whose environment names this folder's agent socket: ranks, their
  workers, the zygote, a diagnostics round; SIGTERM to each process group, SIGKILL after a grace), so no
  orphan is left and no old rank writes a slot again. For the same job and node (``decide_rejoin``, pure)
  it then *rejoins*: it keeps the node's memory tier (slots, sent copies, the backups held for peers: no
  ``start_fresh``), takes the recorded generation, slice and code version, registers again as the same
  node, and reports the predecessor's ranks as ended (``RankExited``, ``infrastructure``,
  ``AgentRestarted``) at that generation. Supervised, that is an ordinary failure to the controller: the
  job is restarted as the next generation, and the broker plans the restore from the inventories, this
  node's memory tier included. Unsupervised (plain ``keel run``), the agent restarts its ranks itself
  from its memory tier (a local plan), without using up a ``--max-restarts``.

Adopting the running ranks instead was rejected: they are not the new agent's children (no exit status,
no stderr pipe: a cold-started rank's stderr went to the dead agent), their reports since the death are
lost, and the backups and persists of those steps were never made. A restart from the memory tier costs
the steps since the newest slot (one or two) and a restart's start-up, and leaves nothing unknown.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from keel.checkpoint.owned import ensure_owned_dir
from keel.checkpoint.slots import write_file_atomic

log = logging.getLogger(__name__)

STATE_FILE = "agent.json"
LOCK_FILE = "agent.lock"
STATE_VERSION = 1
STOP_GRACE_S = 5.0
"""How long a predecessor's processes get between SIGTERM and SIGKILL."""
KILL_WAIT_S = 10.0
"""How long after SIGKILL the new agent waits for them to be gone before it gives up (and says so)."""


class AgentDirBusy(RuntimeError):
    """Another live agent holds this agent folder."""


AGENT_DIR_HINT = "or start the agent with another folder (--keel-agent-dir)"


class AgentLock:
    """The exclusive lock on an agent folder (``flock``: released by the kernel when the holder dies).

    Takes the folder first (``ensure_owned_dir``): created 0700, or an existing one accepted only if it is
    this user's own and nobody else can write it; otherwise ``UntrustedPathError`` names the folder, its
    owner and the fix, and the agent does not start. The default folder, ``/tmp/keel-agent-<node>``, is a
    predictable name anyone on the host could create first; the socket, the fault file and the restore
    plans the ranks trust all live in it."""

    def __init__(self, agent_dir: Path) -> None:
        self.path = Path(agent_dir) / LOCK_FILE
        ensure_owned_dir(Path(agent_dir), AGENT_DIR_HINT)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            raise AgentDirBusy(f"another agent{f' (pid {holder})' if holder else ''} is running in {agent_dir}: "
                               f"one agent per agent folder (--keel-agent-dir)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None


# -- processes --------------------------------------------------------------------------------------


def process_start(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22), None when there
    is no such live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class ProcessRef:
    pid: int
    start: int
    """``process_start(pid)`` when it was recorded: a different value means the pid was recycled."""

    def alive(self) -> bool:
        return process_start(self.pid) == self.start

    @classmethod
    def of(cls, pid: int) -> ProcessRef | None:
        start = process_start(pid)
        return None if start is None else cls(pid, start)


def processes_of_socket(socket_path: Path) -> list[int]:
    """Live processes whose environment names ``socket_path`` as their agent socket (``KEEL_AGENT_SOCKET``,
    set for every rank, diagnostics process and the zygote an agent starts, and inherited by their own
    children), this process excluded."""
    marker = f"\0KEEL_AGENT_SOCKET={socket_path}\0".encode()
    found = []
    me = os.getpid()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == me:
            continue
        try:
            if marker in b"\0" + (proc / "environ").read_bytes() + b"\0" and process_start(int(proc.name)) is not None:
                found.append(int(proc.name))
        except OSError:
            continue
    return sorted(found)


def leftover_processes(socket_path: Path, recorded: Iterable[ProcessRef]) -> list[int]:
    """What a dead agent left running: its recorded processes still alive (same start time) and every live
    process that names its socket."""
    return sorted({r.pid for r in recorded if r.alive()} | set(processes_of_socket(socket_path)))


def stop_processes(pids: list[int], grace_s: float = STOP_GRACE_S, kill_wait_s: float = KILL_WAIT_S) -> list[int]:
    """SIGTERM each process's group (never this process's own), SIGKILL what is left after ``grace_s``;
    returns the pids still alive after ``kill_wait_s`` more (empty: all gone). They are not this process's
    children: their new parent reaps them, a zombie counts as gone."""
    refs = [r for r in (ProcessRef.of(pid) for pid in pids) if r is not None]
    own_group = os.getpgrp()

    def signal_all(sig: signal.Signals) -> None:
        for ref in refs:
            if not ref.alive():
                continue
            try:
                group = os.getpgid(ref.pid)
                if group != own_group:
                    os.killpg(group, sig)
                else:
                    os.kill(ref.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def wait(timeout_s: float) -> list[ProcessRef]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = [r for r in refs if r.alive()]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.02)

    signal_all(signal.SIGTERM)
    if wait(grace_s):
        signal_all(signal.SIGKILL)
    return [r.pid for r in wait(kill_wait_s)]


# -- the state file ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentState:
    """What an agent records in ``<agent_dir>/agent.json`` while it runs."""

    job_id: str
    node_id: str
    agent: ProcessRef
    generation: int
    standby: bool
    node_rank: int
    ranks: dict[int, ProcessRef] = field(default_factory=dict)
    """The ranks running now (global rank -> process); empty while none runs (held, failed, standby)."""
    zygote: ProcessRef | None = None
    code: dict[str, Any] | None = None
    """The code version the ranks run (``CodeRef`` as JSON), None: the launch command."""
    held: bool = False
    failed: bool = False

    def to_json(self) -> str:
        return json.dumps({
            "version": STATE_VERSION, "job_id": self.job_id, "node_id": self.node_id,
            "agent": [self.agent.pid, self.agent.start], "generation": self.generation, "standby": self.standby,
            "node_rank": self.node_rank, "ranks": {str(r): [p.pid, p.start] for r, p in sorted(self.ranks.items())},
            "zygote": None if self.zygote is None else [self.zygote.pid, self.zygote.start], "code": self.code,
            "held": self.held, "failed": self.failed,
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> AgentState:
        """Parse a state file; ``ValueError`` saying what is wrong with it."""
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict) or raw.get("version") != STATE_VERSION:
                raise ValueError(f"not a version-{STATE_VERSION} agent state")

            def ref(value: Any) -> ProcessRef:
                pid, start = value
                if not (isinstance(pid, int) and isinstance(start, int) and pid > 0 and start >= 0):
                    raise ValueError(f"bad process reference {value!r}")
                return ProcessRef(pid, start)

            generation, node_rank = raw["generation"], raw["node_rank"]
            if not (isinstance(generation, int) and generation >= 0 and isinstance(node_rank, int) and node_rank >= 0):
                raise ValueError("generation and node_rank must be non-negative integers")
            code = raw.get("code")
            if code is not None and not isinstance(code, dict):
                raise ValueError("code must be an object or null")
            return cls(job_id=str(raw["job_id"]), node_id=str(raw["node_id"]), agent=ref(raw["agent"]),
                       generation=generation, standby=bool(raw["standby"]), node_rank=node_rank,
                       ranks={int(r): ref(p) for r, p in dict(raw["ranks"]).items()},
                       zygote=None if raw.get("zygote") is None else ref(raw["zygote"]), code=code,
                       held=bool(raw.get("held", False)), failed=bool(raw.get("failed", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"unreadable agent state: {exc}") from exc


def state_path(agent_dir: Path) -> Path:
    return Path(agent_dir) / STATE_FILE


def read_state(agent_dir: Path) -> AgentState | None:
    """The state a previous agent left in the folder: None when there is none, or it cannot be read
    (logged: the new agent then starts as a new launch)."""
    path = state_path(agent_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s: %s; starting as a new launch", path, exc)
        return None
    try:
        return AgentState.from_json(text)
    except ValueError as exc:
        log.warning("%s: %s; starting as a new launch", path, exc)
        return None


def write_state(agent_dir: Path, state: AgentState) -> None:
    write_file_atomic(state_path(agent_dir), state.to_json().encode(), fsync=False)


def remove_state(agent_dir: Path) -> None:
    state_path(agent_dir).unlink(missing_ok=True)


# -- the decision -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rejoin:
    """What a new agent does about its folder's previous agent (``decide_rejoin``)."""

    mode: Literal["fresh", "rejoin"]
    reason: str
    previous: AgentState | None = None


def decide_rejoin(previous: AgentState | None, *, job_id: str, node_id: str, standby: bool) -> Rejoin:
    """Rejoin the job the previous agent ran (pure): only when one died without ending (its state file is
    still there), for the same job and node, with ranks (running, held or failed) rather than as an idle
    standby, and the new agent is not started as a standby (``--keel-standby``: a replacement machine, which
    joins the pool). Otherwise a new launch."""
    if previous is None:
        return Rejoin("fresh", "no previous agent's state in the folder: a new launch")
    if standby:
        return Rejoin("fresh", f"started as a standby: a new machine for the pool, whatever the previous agent "
                               f"(pid {previous.agent.pid}) ran", previous)
    if (previous.job_id, previous.node_id) != (job_id, node_id):
        return Rejoin("fresh", f"the previous agent (pid {previous.agent.pid}) ran job {previous.job_id!r} as node "
                               f"{previous.node_id!r}, not job {job_id!r} as {node_id!r}: a new launch", previous)
    if previous.standby:
        return Rejoin("fresh", f"the previous agent (pid {previous.agent.pid}) was an idle standby: nothing to "
                               f"resume; starting as one again", previous)
    return Rejoin("rejoin", f"the previous agent (pid {previous.agent.pid}) died with generation "
                            f"{previous.generation} of job {job_id!r} on this node: rejoining it", previous)

"""The warm zygote: one Python process per node that imported torch once and forks ranks and rounds.

Starting a rank costs an interpreter and ``import torch`` (plus ``torch._dynamo``, which the first
optimizer constructed imports: 1.4 s on its own), 2-4 s of CPU each, and a node's ranks all restart at
once. The agent keeps one zygote instead (``python -m keel.agent.warm``): it imports the preload modules
(``KEEL_WARM_PRELOAD``, comma-separated; default ``DEFAULT_PRELOAD``), touches its ready file and
serves launches from its stdin, one JSON line each::

    {"op": "launch", "id": "rank3.g2",
     "argv": ["-m", "keel.workload.train", "--steps", "100"],   # what follows "python" on a command line
     "env": {...},                                              # the complete environment of the process
     "cwd": "/path" | null,
     "stdout": "/path/of/the/stdout/log", "stderr": "/path/of/the/stderr/log"}

For each it forks a child that becomes that program: a new session (its own process group), the
environment replaced, stdout and stderr redirected to the files, stdin ``/dev/null``, ``sys.argv`` set,
Python's and numpy's global random generators reseeded from the OS (as a fresh interpreter's are), and
the script or module run as ``__main__`` with ``runpy``, exactly as ``python ARGV...`` would, exit code
included. A fork takes milliseconds and shares the imported modules copy-on-write, so the zygote is
never used up and costs one import per node, once. It answers on stdout, one JSON line each:
``{"event": "started", "id", "pid"}``, ``{"event": "rejected", "id", "reason"}`` (a bad launch line),
``{"event": "exited", "pid", "returncode"}`` (negative: killed by that signal), as ``subprocess`` does.
On end of input (its agent is gone) it exits; children keep running, like ranks whose agent died.

What differs from a fresh interpreter, by construction: variables read when the interpreter or a
preloaded library starts (``PYTHON*`` including the hash seed, ``OMP_NUM_THREADS``, ``LD_PRELOAD``,
CUDA's allocator settings) come from the zygote's environment (the node's rank environment), not the
launch's. Nothing initialises CUDA before a child does, so each child gets its own CUDA context, as a
fresh process would. A job that needs fresh interpreters runs with ``--keel-no-warm-ranks``.

Parent side: ``Zygote`` (start, ready, launch -> ``ForkedProcess``) and ``ForkedProcess``, which has the
part of ``subprocess.Popen``'s interface the supervisor uses (``pid``, ``poll``, ``wait``,
``returncode``), fed by the zygote's exit reports.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import random
import runpy
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from keel.protocol.processes import ZYGOTE_NAME

log = logging.getLogger(__name__)

DEFAULT_PRELOAD = "torch,torch.distributed,torch.optim,torch._dynamo,numpy,keel.sdk"
# ZYGOTE_NAME (keel.protocol.processes): the zygote's process name (``/proc/<pid>/comm``, what ``ps`` and
# ``top`` show); its children take the interpreter's name back, so tools that count a node's ranks can
# tell them apart.


def set_process_name(name: str) -> None:
    """``prctl(PR_SET_NAME)`` (Linux; at most 15 bytes); silently nothing elsewhere."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
PRELOAD_ENV = "KEEL_WARM_PRELOAD"
READY_ENV = "KEEL_WARM_READY_FILE"
MODULES_SUFFIX = ".modules"
CODE_DIR_ENV = "KEEL_CODE_DIR"
"""A code version's directory (hot-update): on ``sys.path`` right after the program's own directory, as
``PYTHONPATH`` puts it in a fresh interpreter (which a forked child, started long before, never reads)."""


class LaunchMessageError(ValueError):
    """A launch line that cannot be carried out; the message says why."""


def parse_launch(line: str) -> dict:
    """Validate one launch line (pure). Raises ``LaunchMessageError``."""
    try:
        message = json.loads(line)
    except json.JSONDecodeError as exc:
        raise LaunchMessageError(f"the launch line is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise LaunchMessageError("the launch line must be a JSON object")
    if message.get("op", "launch") != "launch":
        raise LaunchMessageError(f"unknown op {message.get('op')!r} (the zygote knows 'launch')")
    argv, env = message.get("argv"), message.get("env")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise LaunchMessageError("'argv' must be a non-empty list of strings")
    if argv[0] == "-m" and len(argv) < 2:
        raise LaunchMessageError("'argv' is ['-m'] without a module")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise LaunchMessageError("'env' must be an object of strings")
    for key in ("stdout", "stderr"):
        if not isinstance(message.get(key), str):
            raise LaunchMessageError(f"'{key}' must be a path")
    if message.get("cwd") is not None and not isinstance(message["cwd"], str):
        raise LaunchMessageError("'cwd' must be a path or null")
    return message


# -- the zygote process ---------------------------------------------------------------------------------


def _redirect(fd: int, path: str) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _become(message: dict) -> None:
    """In a forked child (already leading its own session): turn this process into the launch's program
    and run it."""
    set_process_name(Path(sys.executable).name)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    _redirect(1, message["stdout"])
    _redirect(2, message["stderr"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(message["env"])
    if message.get("cwd"):
        os.chdir(message["cwd"])
    # A fresh interpreter seeds these from the OS; forked children would otherwise all share the zygote's.
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    argv = message["argv"]
    code_dir = os.environ.get(CODE_DIR_ENV)
    if code_dir:
        sys.path.insert(0, code_dir)
        sys.dont_write_bytecode = True  # forked from the zygote: $PYTHONDONTWRITEBYTECODE is read at start only
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy replaces argv[0] with the module's file
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


def _child(message: dict) -> None:
    """The forked child's whole life: never returns into the zygote's loop."""
    code = 0
    try:
        try:
            _become(message)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, then exit 1
            sys.excepthook(*sys.exc_info())
            code = 1
        # What a normal interpreter exit does: join non-daemon threads, then run the atexit handlers.
        try:
            import threading

            threading._shutdown()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001
            pass
        try:
            import atexit

            atexit._run_exitfuncs()
        except Exception:  # noqa: BLE001
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
    finally:
        os._exit(code)


def _say(payload: dict) -> None:
    os.write(1, (json.dumps(payload) + "\n").encode())


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"event": "exited", "pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def main() -> None:
    """Entry point of the zygote (``python -m keel.agent.warm``)."""
    started = time.monotonic()
    set_process_name(ZYGOTE_NAME)
    for name in filter(None, (m.strip() for m in os.environ.get(PRELOAD_ENV, DEFAULT_PRELOAD).split(","))):
        try:
            importlib.import_module(name)
        except Exception as exc:  # a preload is an optimisation: the program imports what it needs itself
            print(f"keel zygote: preloading {name} failed: {exc!r}", file=sys.stderr, flush=True)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through the wakeup fd
    ready = os.environ.get(READY_ENV)
    if ready:
        # What the zygote imported (top-level names): a code version shipping a module of one of these
        # names would run the zygote's stale copy in a forked child, so such a launch starts fresh.
        modules = sorted({name.split(".", 1)[0] for name in list(sys.modules)})
        Path(f"{ready}{MODULES_SUFFIX}").write_text(json.dumps(modules))
        Path(ready).write_text(f"{time.monotonic() - started:.3f}\n")
    buffer = b""
    while True:
        readable, _, _ = select.select([0, wake_read], [], [], 1.0)
        if wake_read in readable:
            os.read(wake_read, 4096)
        _reap()
        if 0 not in readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break  # the agent is gone
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if not line.strip():
                continue
            identity = None
            try:
                message = parse_launch(line.decode(errors="replace"))
                identity = message.get("id")
                for key in ("stdout", "stderr"):
                    os.close(os.open(message[key], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
                if message.get("cwd") and not os.path.isdir(message["cwd"]):
                    raise LaunchMessageError(f"cwd {message['cwd']!r} is not a directory")
            except (LaunchMessageError, OSError) as exc:
                if identity is None:
                    try:
                        identity = json.loads(line).get("id")
                    except (ValueError, AttributeError):
                        identity = None
                reason = str(exc) if isinstance(exc, LaunchMessageError) else f"cannot set up the launch: {exc}"
                print(f"keel zygote: {reason}", file=sys.stderr, flush=True)
                _say({"event": "rejected", "id": identity, "reason": reason})
                continue
            # "started" is said only once the child leads its own session: the agent may signal its
            # process group (pgid = pid) at once, and before setsid() there is no such group.
            in_session_read, in_session_write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(wake_read)
                os.close(wake_write)
                os.close(in_session_read)
                signal.set_wakeup_fd(-1)
                os.setsid()
                os.write(in_session_write, b"1")
                os.close(in_session_write)
                _child(message)
            os.close(in_session_write)
            select.select([in_session_read], [], [], 5.0)
            os.close(in_session_read)
            _say({"event": "started", "id": identity, "pid": pid})
    _reap()


# -- the agent's side -------------------------------------------------------------------------------------


def kill_group(process: subprocess.Popen | ForkedProcess, what: str) -> None:
    """SIGKILL ``process``'s process group (it leads its own session) and reap it; idempotent."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            log.error("%s %d did not die after SIGKILL", what, process.pid)


class ZygoteError(RuntimeError):
    """The zygote could not launch (gone, not ready in time, or it rejected the launch)."""


class ForkedProcess:
    """A child of the zygote, with the ``subprocess.Popen`` methods the supervisor uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.drain()
            if self.returncode is None and not self.zygote.alive():
                # Its zygote is gone and can no longer report: judge from /proc.
                self.zygote.drain()
                if self.returncode is None and not _pid_alive(self.pid):
                    log.warning("forked process %d ended after its zygote died; exit status unknown", self.pid)
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


class Zygote:
    """A started zygote (parent side). Not thread-safe: use from the agent's loop."""

    def __init__(self, popen: subprocess.Popen, ready_file: Path) -> None:
        self.popen = popen
        self.ready_file = ready_file
        self.children: dict[int, ForkedProcess] = {}
        self._buffer = b""
        self._answers: list[dict] = []
        self._early_exits: dict[int, int] = {}
        assert popen.stdout is not None
        os.set_blocking(popen.stdout.fileno(), False)

    @classmethod
    def start(cls, env: Mapping[str, str], ready_file: Path, stderr_log: Path, *, python: str = sys.executable,
              preload: str | None = None) -> Zygote:
        ready_file.parent.mkdir(parents=True, exist_ok=True)
        ready_file.unlink(missing_ok=True)
        environment = dict(env)
        environment[READY_ENV] = str(ready_file)
        if preload is not None:
            environment[PRELOAD_ENV] = preload
        with open(stderr_log, "ab") as log_file:
            # ``-u``: the children's stdout and stderr are unbuffered, as torchrun's ``python -u`` ranks' are.
            popen = subprocess.Popen([python, "-u", "-m", "keel.agent.warm"], env=environment, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log_file, start_new_session=True)
        return cls(popen, ready_file)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def fileno(self) -> int:
        """Readable when the zygote reports (a child started or exited): for the agent's loop to wake."""
        assert self.popen.stdout is not None
        return self.popen.stdout.fileno()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def ready(self) -> bool:
        """Preloading finished: launches fork at once."""
        return self.alive() and self.ready_file.exists()

    def imported(self) -> frozenset[str]:
        """Top-level names of the modules the zygote had imported when it became ready (empty: unknown)."""
        try:
            return frozenset(json.loads(Path(f"{self.ready_file}{MODULES_SUFFIX}").read_text()))
        except (OSError, ValueError):
            return frozenset()

    def drain(self) -> None:
        """Read what the zygote reported so far (never blocks); exits go to their ``ForkedProcess``."""
        assert self.popen.stdout is not None
        while not self.popen.stdout.closed:
            try:
                chunk = os.read(self.popen.stdout.fileno(), 65536)
            except BlockingIOError:
                break
            except OSError:
                break
            if not chunk:
                break
            self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            try:
                report = json.loads(line)
            except ValueError:
                log.warning("zygote %d wrote a line that is not JSON: %r", self.pid, line[:200])
                continue
            if report.get("event") == "exited":
                child = self.children.pop(int(report["pid"]), None)
                if child is not None:
                    child.returncode = int(report["returncode"])
                else:  # a child that exited before its launch's answer was read: kept for launch()
                    self._early_exits[int(report["pid"])] = int(report["returncode"])
            else:
                self._answers.append(report)

    def launch(self, identity: str, argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path,
               cwd: str | None = None, timeout_s: float = 5.0) -> ForkedProcess:
        """Fork a child running ``python ARGV``. Raises ``ZygoteError`` (gone, not ready, rejected)."""
        if not self.ready():
            raise ZygoteError("the zygote is not ready" if self.alive() else
                              f"the zygote exited with {self.popen.returncode}")
        message = {"op": "launch", "id": identity, "argv": list(argv), "env": dict(env), "cwd": cwd,
                   "stdout": str(stdout), "stderr": str(stderr)}
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write((json.dumps(message) + "\n").encode())
            self.popen.stdin.flush()
        except OSError as exc:
            raise ZygoteError(f"cannot reach the zygote: {exc}") from None
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain()
            for answer in self._answers:
                if answer.get("id") == identity:
                    self._answers.remove(answer)
                    if answer.get("event") == "started":
                        child = ForkedProcess(self, int(answer["pid"]))
                        child.returncode = self._early_exits.pop(child.pid, None)
                        if child.returncode is None:
                            self.children[child.pid] = child
                        return child
                    raise ZygoteError(f"the zygote rejected the launch: {answer.get('reason')}")
            if not self.alive():
                raise ZygoteError(f"the zygote exited with {self.popen.returncode} during a launch")
            if time.monotonic() > deadline:
                raise ZygoteError(f"the zygote did not answer a launch within {timeout_s:g} s")
            select.select([self.fileno()], [], [], 0.05)

    def close(self) -> None:
        """End the zygote (not its children: ranks outlive it as they outlive their agent); idempotent."""
        kill_group(self.popen, "zygote")
        self.drain()
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except OSError:
                    pass
        self.ready_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

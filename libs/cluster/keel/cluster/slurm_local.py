"""A real Slurm cluster on this machine, for tests and demos: ``munged``, ``slurmctld`` and one ``slurmd`` per
node name, from Debian's packages (``slurmctld``, ``slurmd``, ``munge``), all started here and stopped by
``SlurmCluster.stop``.

Every node name is a ``slurmd`` of its own on this host (each on its own port; Slurm runs several on one
host when told each one's name with ``-N``), so evictions, drains, allocations and ``srun`` steps are
Slurm's own. Everything lives in one scratch folder: the munge key and socket, ``slurm.conf``, the
controller's state, the daemons' spools and logs. Nothing listens beyond 127.0.0.1 ports picked free.
Needs root (``slurmd`` launches job steps as their user); ``SlurmUnavailable`` says what is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("scontrol", "sinfo", "squeue", "sbatch", "srun")
PACKAGES = "slurmctld slurmd slurm-client munge"


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; the message says why and what would fix it."""


class SlurmError(RuntimeError):
    """A Slurm daemon did not start or the cluster did not come up; the message holds its log's tail."""


def missing_programs() -> list[str]:
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None
            and not Path("/usr/sbin", name).exists()]


def check_available() -> None:
    """Raise ``SlurmUnavailable`` unless root and every program is installed."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("a local Slurm cluster needs root (slurmd runs job steps as their users)")
    missing = missing_programs()
    if missing:
        raise SlurmUnavailable(f"not installed: {', '.join(missing)} (Debian: apt-get install {PACKAGES}; "
                               "`make test` installs them when run as root)")


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SlurmCluster:
    """A running local Slurm cluster. ``env()`` is what Slurm's commands need to talk to it."""

    base: Path
    conf: Path
    nodes: list[str]
    partition: str
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), **(extra or {})}

    def run(self, *argv: str, timeout_s: float = 30.0, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster (``env``: the whole environment, which ``sbatch`` hands
        the job's tasks; default ours plus ``SLURM_CONF``)."""
        environ = self.env() if env is None else {**env, "SLURM_CONF": str(self.conf)}
        done = subprocess.run(list(argv), env=environ, capture_output=True, text=True, timeout=timeout_s, check=False)
        if check and done.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
        return done

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.base / "log" / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no log at {path})"

    def states(self) -> dict[str, str]:
        """Node name -> Slurm's short state (``idle``, ``alloc``, ``drain``, ``down*``, ...)."""
        text = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
        return dict(line.split(None, 1) for line in text.splitlines() if line.strip())

    def stop(self) -> None:
        """Cancel every job and wait for its steps to end (slurmd kills their tasks; a step whose slurmd
        is gone would be left running), stop every daemon (slurmd first), then remove the scratch folder."""
        if self.processes.get("slurmctld") is not None and self.processes["slurmctld"].poll() is None:
            try:
                self.run("scancel", "--user", str(os.geteuid()), check=False, timeout_s=10)
                deadline = time.monotonic() + 30
                while self.run("squeue", "-h", check=False, timeout_s=10).stdout.strip() and time.monotonic() < deadline:
                    time.sleep(0.2)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for name in sorted(self.processes, key=lambda n: (not n.startswith("slurmd"), n != "slurmctld")):
            process = self.processes[name]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        shutil.rmtree(self.base, ignore_errors=True)


def write_conf(base: Path, nodes: list[str], *, partition: str, cpus_per_node: int, ctld_port: int,
               node_ports: dict[str, int]) -> Path:
    """``slurm.conf`` of a one-host cluster whose every node is its own ``slurmd``."""
    run, log = base / "run", base / "log"
    lines = [
        "ClusterName=keel",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "AuthType=auth/munge",
        f"AuthInfo=socket={run / 'munge.sock'}",
        "CredType=cred/munge",
        f"StateSaveLocation={base / 'state'}",
        f"SlurmdSpoolDir={base / 'spool'}/%n",
        f"SlurmctldPidFile={run / 'slurmctld.pid'}",
        f"SlurmdPidFile={run}/slurmd-%n.pid",
        "SlurmUser=root",
        "SlurmdUser=root",
        # No cgroups here: processes are tracked by their parent pids, tasks are not bound.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/builtin",
        "ReturnToService=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SlurmdTimeout=30",
        "KillWait=5",
        f"SlurmctldLogFile={log / 'slurmctld.log'}",
        f"SlurmdLogFile={log}/slurmd-%n.log",
    ]
    lines += [f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_ports[name]} "
              f"CPUs={cpus_per_node} State=UNKNOWN" for name in nodes]
    lines.append(f"PartitionName={partition} Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
    conf = base / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def start_cluster(nodes: list[str], *, partition: str = "keel", cpus_per_node: int = 1,
                  timeout_s: float = 60.0, base: Path | None = None) -> SlurmCluster:
    """Start munged, slurmctld and one slurmd per name in ``nodes``; return once every node is idle.
    Raises ``SlurmUnavailable`` (not root, not installed) or ``SlurmError`` (a daemon failed; its log's tail)."""
    check_available()
    if not nodes or len(set(nodes)) != len(nodes):
        raise ValueError(f"node names must be distinct and at least one: {nodes}")
    # Short: the munge socket's path must fit a Unix socket address (108 bytes).
    base = Path(tempfile.mkdtemp(prefix="keel-slurm-", dir="/tmp")) if base is None else base
    for sub in ("run", "log", "state", "spool", "munge"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o755)  # munged wants every folder on its socket's path searchable by all
    os.chmod(base / "run", 0o755)
    os.chmod(base / "munge", 0o700)
    key = base / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o600)
    conf = write_conf(base, nodes, partition=partition, cpus_per_node=cpus_per_node, ctld_port=_free_port(),
                      node_ports={name: _free_port() for name in nodes})
    cluster = SlurmCluster(base=base, conf=conf, nodes=list(nodes), partition=partition)
    env = cluster.env()

    def spawn(name: str, argv: list[str]) -> None:
        out = open(base / "log" / f"{name}.out", "wb")  # noqa: SIM115 - the daemon writes it until stopped
        cluster.processes[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                   start_new_session=True)
        out.close()

    try:
        spawn("munged", [_program("munged"), "-F", f"--key-file={key}", f"--socket={base / 'run' / 'munge.sock'}",
                         f"--pid-file={base / 'run' / 'munged.pid'}", f"--log-file={base / 'log' / 'munged.log'}",
                         f"--seed-file={base / 'munge' / 'seed'}"])
        _wait(lambda: (base / "run" / "munge.sock").exists(), timeout_s, cluster, "munged", "munged.out")
        spawn("slurmctld", [_program("slurmctld"), "-D", "-i", "-f", str(conf)])
        _wait(lambda: cluster.run("scontrol", "ping", check=False).returncode == 0
              and "UP" in cluster.run("scontrol", "ping", check=False).stdout, timeout_s, cluster, "slurmctld", "slurmctld.log")
        for name in nodes:
            spawn(f"slurmd-{name}", [_program("slurmd"), "-D", "-N", name, "-f", str(conf)])
        _wait(lambda: all(state == "idle" for state in cluster.states().values()) and len(cluster.states()) == len(nodes),
              timeout_s, cluster, "slurmd", f"slurmd-{nodes[0]}.log")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait(ready: Callable[[], bool], timeout_s: float, cluster: SlurmCluster, what: str, log_name: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ready():
                return
        except (SlurmError, subprocess.TimeoutExpired, OSError):
            pass
        for name, process in cluster.processes.items():
            if process.poll() is not None:
                raise SlurmError(f"{name} exited with {process.returncode}:\n{cluster.log_tail(log_name.rsplit('.', 1)[0])}"
                                 f"\n{_read(cluster.base / 'log' / f'{name}.out')}")
        if time.monotonic() > deadline:
            raise SlurmError(f"{what} not ready within {timeout_s:g} s:\n{cluster.log_tail(log_name.rsplit('.', 1)[0])}")
        time.sleep(0.2)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-2000:]
    except OSError:
        return ""

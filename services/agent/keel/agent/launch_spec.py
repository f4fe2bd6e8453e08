"""``keel run`` arguments: torch 2.13's torchrun flags, plus Keel's own namespaced ``--keel-*`` flags.

Parsing into a frozen ``LaunchSpec``; the supervisor acts on it. Every torchrun flag is accepted with its
spellings (dashes and underscores), its default and its ``PET_<DEST>`` environment default, as torchrun
reads them; docs/torchrun.md lists the flags and where Keel deliberately differs.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import signal
import socket
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from keel.agent.rank_output import StdSpecError, parse_std
from keel.agent.rendezvous import (
    C10D,
    DEFAULT_C10D_PORT,
    STATIC,
    UNSUPPORTED_BACKENDS,
    RendezvousConf,
    RendezvousConfigError,
    parse_endpoint,
    parse_nnodes,
    parse_rdzv_conf,
)
from keel.events.units import parse_duration
from keel.rules.slurm import slurm_step

log = logging.getLogger(__name__)


class LaunchError(ValueError):
    """The launch arguments are wrong; the message says which and why."""


@dataclass(frozen=True)
class LaunchSpec:
    nnodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    command: tuple[str, ...]
    """The rank command after the interpreter: ``("train.py", "--x")`` or ``("-m", "pkg.mod", ...)``."""
    job_id: str = "job"
    node_id: str = field(default_factory=socket.gethostname)
    fault_domain: str = ""
    standby: bool = False
    max_restarts: int = 0
    """Local restarts of failed ranks by the agent itself (torchrun semantics); Keel's controller
    normally decides restarts, so the default is 0."""
    agent_dir: Path = Path("/tmp/keel-agent")
    root: Path = Path("/")
    """Root the probes read (an overlay root for simulated nodes of a local cluster)."""
    heartbeat_interval: timedelta = timedelta(seconds=5)
    probe_interval: timedelta = timedelta(seconds=1)
    ckpt_dir: Path | None = None
    """The node's shared-memory slot folder (``$KEEL_CKPT_DIR`` of its ranks); None: no checkpointing."""
    store_address: str = "127.0.0.1:0"
    """``HOST:PORT`` the node's shard store (gRPC, mTLS) binds; port 0 picks a free one. Empty (a
    multi-node job given none): the ``checkpoint.store_address`` setting, else the interface that
    reaches the rendezvous master (``keel.cli.agent_cmd``); never every interface unless asked for."""
    store_advertise: str = ""
    """The host peers dial to reach the shard store (default: the bound host, or this host's name)."""
    tls_cert: Path | None = None
    """The node's shard-store certificate (PEM, of the job's CA: ``keel.infra.shard_ca``), with ``tls_key``
    and ``tls_ca``. None: the agent issues its own from the job's CA in the credentials folder."""
    tls_key: Path | None = None
    tls_ca: Path | None = None
    persist_root: Path | None = None
    """The persistent tier's root (a local or shared filesystem); None: no persistent tier."""
    fault_injection: bool = False
    """Let ``keel inject`` make ranks fail on purpose (tests, demos): the ranks get ``KEEL_FAULT_FILE``
    (``<agent_dir>/fault.json``) and, on a simulated node, ``KEEL_SIMULATED_SDC_FILE``, and read them.
    Off (the default), neither is passed and no rank reads a fault file."""
    warm_ranks: bool = True
    """Fork ranks, promotions and diagnostics rounds from the node's zygote (``keel.agent.warm``: torch
    imported once); ``--keel-no-warm-ranks`` starts every process as a fresh interpreter."""
    # torchrun's flags (docs/torchrun.md); the rendezvous ones are keel.agent.rendezvous's.
    rendezvous: bool = False
    """``--rdzv-backend c10d``: ``node_rank``, ``nnodes`` and ``master_*`` are placeholders (the endpoint)
    until ``with_rendezvous`` fills them in from the rendezvous of the job's first start."""
    rdzv_backend: str = STATIC
    rdzv_id: str = "none"
    rdzv_endpoint: str = ""
    min_nodes: int = 1
    max_nodes: int = 1
    """``--nnodes MIN:MAX`` (static: ``nnodes`` is MAX, as under torchrun's static backend)."""
    rdzv_conf: RendezvousConf = field(default_factory=RendezvousConf)
    run_id: str = "none"
    """``TORCHELASTIC_RUN_ID``: ``--rdzv-id``; a fresh uuid for a local rendezvous (``--standalone``, or
    one node without a master port), as torchrun does."""
    role: str = "default"
    no_python: bool = False
    """``command`` is a program run as it is (``--no-python``), not a script for the interpreter."""
    run_path: bool = False
    monitor_interval: timedelta = timedelta(seconds=0.1)
    start_method: str = "spawn"
    event_log_handler: str = "null"
    log_dir: Path | None = None
    """``--log-dir``: the base of torchrun's log layout (None: ``<agent_dir>/logs``)."""
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset[int] | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    log_line_prefix_template: str | None = None
    """``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` (``${role_name}``, ``${rank}``, ``${local_rank}``)."""
    local_addr: str | None = None
    logs_specs: str | None = None
    numa_binding: str | None = None
    signals_to_handle: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    shutdown_timeout: timedelta = timedelta(seconds=5)
    """SIGTERM to SIGKILL when the agent stops ranks (``--shutdown-timeout``)."""
    virtual_local_rank: bool = False
    # Keel's own
    local_restarts: bool = False
    """``--keel-local-restarts``: handle failures here like torchrun (``--max-restarts``) and leave the control
    plane out (no events, no commands), even where one is configured."""
    agent_dir_default: bool = False
    """No ``--keel-agent-dir``: the launcher may take the next free folder of the default's series."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def with_free_master_port(self) -> LaunchSpec:
        """A spec whose ``master_port`` 0 (``--standalone`` without a port) is replaced by a free base port
        below the kernel's ephemeral range, so two standalone jobs on one host never share a port."""
        if self.master_port:
            return self
        from dataclasses import replace

        from keel.infra.embedded import rendezvous_base_port

        return replace(self, master_port=rendezvous_base_port())

    def with_rendezvous(self, node_rank: int, nnodes: int, master_addr: str, master_port: int) -> LaunchSpec:
        """The spec once the rendezvous placed this node (its rank, the admitted count, rank 0's store)."""
        from dataclasses import replace

        if not 0 <= node_rank < nnodes:
            raise LaunchError(f"node rank {node_rank} is outside 0..{nnodes - 1}")
        return replace(self, node_rank=node_rank, nnodes=nnodes, master_addr=master_addr, master_port=master_port,
                       rendezvous=False)

    def with_agent_dir(self, agent_dir: Path) -> LaunchSpec:
        """The spec in another agent folder; a slot folder derived from the old one follows it."""
        from dataclasses import replace

        ckpt_dir = self.ckpt_dir
        if ckpt_dir is not None and ckpt_dir == default_ckpt_dir(self.agent_dir):
            ckpt_dir = default_ckpt_dir(agent_dir)
        return replace(self, agent_dir=agent_dir, ckpt_dir=ckpt_dir)

    def master_port_for(self, generation: int) -> int:
        """Each restart generation rendezvous on its own port, so no stale store keys survive a restart
        and no rank of an older generation reaches the new one's store (rank 0 hosts it; torchrun's agent
        store fences attempts with key prefixes instead). A deliberate difference: docs/torchrun.md."""
        return self.master_port + generation


TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
START_METHODS = ("spawn", "fork", "forkserver")
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")
"""torch 2.13's registered event log handlers (``torch.distributed.elastic.events.handlers``)."""
KEEL_SHUTDOWN_TIMEOUT = timedelta(seconds=5)
"""How long ranks get between SIGTERM and SIGKILL when neither ``--shutdown-timeout`` nor
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` says (torchrun: 30 s; Keel's restarts are timed, see docs/torchrun.md)."""


def default_agent_dir(node_id: str, job_id: str) -> Path:
    """``$TMPDIR/keel-agent-<node>-<job>`` (``/tmp`` by default); a second agent of the same node and job
    on the host takes ``-2``, ``-3``... (``keel.cli.agent_cmd.claim_agent_dir``)."""
    return Path(tempfile.gettempdir()) / re.sub(r"[^A-Za-z0-9._-]", "_", f"keel-agent-{node_id}-{job_id}")


def default_ckpt_dir(agent_dir: Path) -> Path:
    """One shared-memory folder per agent directory, so two agents on one host never share slots."""
    return Path("/dev/shm") / f"keel-{hashlib.sha256(str(agent_dir.resolve()).encode()).hexdigest()[:12]}"


class LaunchHelp(Exception):
    """``--help`` was asked for: the help is printed, the launcher exits 0 (as torchrun does)."""


def _comma_separated(value: str) -> list[str]:
    """torchrun's list syntax for ``--duplicate-*-filters``: comma-separated, ``,,`` escapes a comma."""
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """torch 2.13's torchrun parser, flag for flag (names, both spellings, defaults, ``PET_<DEST>``
    environment defaults), plus Keel's ``--keel-*`` flags."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="keel run",
        description="Launch and supervise one node's ranks (torchrun-compatible: docs/torchrun.md).",
    )

    def add(*names: str, pet: bool = True, flag: bool = False, **kwargs: Any) -> None:
        spellings: list[str] = []
        for name in names:
            spellings.append(name)
            if name.startswith("--") and "-" in name[2:]:
                spellings.append("--" + name[2:].replace("-", "_"))
        dest = next(n for n in names if n.startswith("--"))[2:].replace("-", "_")
        variable = f"PET_{dest.upper()}"
        if flag:  # torchrun's check_env: PET_<DEST>=<integer>, non-zero means on
            value = environ.get(variable, "0") if pet else "0"
            try:
                on = bool(int(value))
            except ValueError:
                raise LaunchError(f"{variable} must be an integer (0 or 1), got {value!r}") from None
            parser.add_argument(*spellings, dest=dest, action="store_true", default=on, **kwargs)
            return
        if pet and variable in environ:  # torchrun's env action: the variable replaces the default
            kwargs["default"] = environ[variable]
        parser.add_argument(*spellings, dest=dest, **kwargs)

    # torchrun's own flags, in its order.
    add("--nnodes", default=None, help="N or MIN:MAX (default 1; in a Slurm step, the step's node count)")
    add("--nproc-per-node", default="1", help="workers per node: an integer, or auto, cpu, gpu, xpu")
    add("--rdzv-backend", default=STATIC, help="static (--node-rank, --master-addr/--master-port) or c10d (node ranks "
        "from a rendezvous at --rdzv-endpoint, at the job's first start)")
    add("--rdzv-endpoint", default="", help="HOST[:PORT]: static, the ranks' master (like --master-addr/--master-port); "
        "c10d, the rendezvous store (default port 29400)")
    add("--rdzv-id", default="none", help="the run id; also Keel's job id when --keel-job-id is absent")
    add("--rdzv-conf", default="", help="key=value,... : join_timeout, last_call_timeout, close_timeout, read_timeout "
        "(seconds, or with a unit), is_host")
    add("--standalone", flag=True, help="single node, a local rendezvous on a free port")
    add("--max-restarts", type=int, default=0, help="local restarts of the node's ranks before failing")
    add("--monitor-interval", type=float, default=0.1, help="seconds between looks at the ranks' state")
    add("--start-method", default="spawn", choices=START_METHODS,
        help="accepted; Keel forks ranks from its zygote or starts fresh interpreters (docs/torchrun.md)")
    add("--event-log-handler", default="null", help="torchrun's event log handler (Keel's events go to NATS)")
    add("--role", default="default", help="the workers' role (ROLE_NAME, the [<role><local rank>]: prefix)")
    add("-m", "--module", flag=True, help="run the script as a module (python -m)")
    add("--no-python", flag=True, help="run the script as a program, not with python")
    add("--run-path", flag=True, help="run the script with runpy.run_path (Keel's forked ranks always do)")
    add("--log-dir", default=None, help="base folder of the ranks' log files (<dir>/<run id>_*/attempt_<n>/<local rank>/)")
    add("-r", "--redirects", default="0", help="redirect std streams to log files: 0-3 or LOCAL_RANK:0-3,...")
    add("-t", "--tee", default="0", help="tee std streams to log files and the console (format of --redirects)")
    add("--local-ranks-filter", default="", help="show only these local ranks' output on the console (0,1,...)")
    add("--duplicate-stdout-filters", type=_comma_separated, default=[],
        help="copy tee'd stdout lines containing one of these (comma-separated) to filtered_stdout.log")
    add("--duplicate-stderr-filters", type=_comma_separated, default=[],
        help="copy tee'd stderr lines containing one of these (comma-separated) to filtered_stderr.log")
    add("--node-rank", type=int, default=None, help="this node's rank (static rendezvous; default 0; ignored by c10d, "
        "whose rendezvous assigns it)")
    add("--master-addr", default=None, help="the ranks' master (default 127.0.0.1; in a Slurm step, its first node)")
    add("--master-port", type=int, default=None, help="default 29500; single node without one: a free port")
    add("--local-addr", default=None, help="this node's address for peers (default: found from the rendezvous)")
    add("--logs-specs", pet=False, default=None, help="a torchrun.logs_specs entry point (checked; Keel keeps its layout)")
    add("--numa-binding", pet=False, default=None, choices=NUMA_MODES, help="accepted; not applied by Keel")
    add("--signals-to-handle", default=TORCHRUN_SIGNALS, help="signals that stop the agent and its ranks")
    add("--shutdown-timeout", type=int, default=None,
        help="seconds between SIGTERM and SIGKILL when ranks stop (default TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 5)")
    add("--virtual-local-rank", flag=True, help="LOCAL_RANK=0 and one CUDA_VISIBLE_DEVICES entry per rank")
    # Keel's own flags: no PET_* defaults.
    add("--keel-job-id", pet=False, default="")
    add("--keel-node-id", pet=False, default="")
    add("--keel-fault-domain", pet=False, default="")
    add("--keel-standby", pet=False, flag=True, help="an idle warm standby: no ranks until promoted")
    add("--keel-agent-dir", pet=False, default="")
    add("--keel-root", pet=False, default="/", help="root the health probes read (overlay root of a simulated node)")
    add("--keel-heartbeat-interval", pet=False, default="5s")
    add("--keel-probe-interval", pet=False, default="1s")
    add("--keel-ckpt-dir", pet=False, default="", help="shared-memory folder for the ranks' snapshots "
        "(default /dev/shm/keel-<hash of the agent dir>)")
    add("--keel-no-checkpoint", pet=False, flag=True, help="no in-memory checkpoints, no shard store")
    add("--keel-store-address", pet=False, default="", help="HOST:PORT the shard store binds (default 127.0.0.1:0 "
        "on one node; on several, the checkpoint.store_address setting, else the interface that reaches --master-addr)")
    add("--keel-store-advertise", pet=False, default="", help="host peers use to reach the shard store")
    add("--keel-tls-cert", pet=False, default="", help="the node's shard-store certificate (PEM) from the job's CA; "
        "with --keel-tls-key and --keel-tls-ca (default: issued from <credentials>/shard-ca/<job>/)")
    add("--keel-tls-key", pet=False, default="", help="the private key of --keel-tls-cert (a 0600 file)")
    add("--keel-tls-ca", pet=False, default="", help="the job's shard-store CA certificate (PEM)")
    add("--keel-persist-root", pet=False, default="", help="persistent checkpoint tier (a local or shared path)")
    add("--keel-fault-injection", pet=False, flag=True, help="let `keel inject` put workload faults into the "
        "ranks (they read <agent dir>/fault.json); for tests and demos, off by default")
    add("--keel-no-warm-ranks", pet=False, flag=True, help="start every rank and diagnostics process as a fresh "
        "interpreter (default: fork them from the node's zygote, which imported torch once)")
    add("--keel-local-restarts", pet=False, flag=True, help="handle rank failures here like torchrun (restarts up "
        "to --max-restarts) and leave the control plane out, even where one is configured (default: supervised by "
        "it when there is one)")
    parser.add_argument("script", nargs="?", help="the training script (or module with -m, program with --no-python)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def visible_gpus(environ: Mapping[str, str], root: Path = Path("/")) -> int:
    """How many CUDA devices a rank would see (what ``torch.cuda.device_count()`` says, without importing
    torch): the NVIDIA driver's GPUs (``/proc/driver/nvidia/gpus``), narrowed by ``CUDA_VISIBLE_DEVICES``
    (its entries up to the first invalid one, as CUDA reads it)."""
    try:
        physical = len([p for p in (root / "proc/driver/nvidia/gpus").iterdir() if p.is_dir()])
    except OSError:
        physical = 0
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or physical == 0:
        return physical
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) < physical or entry.startswith(("GPU-", "MIG-")):
            count += 1
        else:
            break
    return min(count, physical)


def resolve_nproc_per_node(text: str, environ: Mapping[str, str], root: Path = Path("/")) -> int:
    """torchrun's ``--nproc-per-node``: an integer, ``cpu`` (the CPUs this process may run on), ``gpu``
    (the visible CUDA devices; an error without one), ``auto`` (the GPUs, else the CPUs), ``xpu``."""
    try:
        value = int(text)
    except ValueError:
        pass
    else:
        if value < 1:
            raise LaunchError(f"--nproc-per-node must be >= 1, got {value}")
        return value
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if text == "cpu":
        return cpus
    if text in ("gpu", "auto"):
        gpus = visible_gpus(environ, root)
        if gpus:
            return gpus
        if text == "gpu":
            raise LaunchError("--nproc-per-node gpu: CUDA is not available (no visible NVIDIA GPU)")
        return cpus
    if text == "xpu":
        raise LaunchError("--nproc-per-node xpu: Keel does not support Intel XPUs; give the number of ranks")
    raise LaunchError(f"--nproc-per-node must be an integer or auto, cpu, gpu, xpu; got {text!r}")


def parse_local_ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    try:
        ranks = frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise LaunchError(f"--local-ranks-filter must be comma-separated integers (e.g. 0,1,2), got {text!r}") from None
    return ranks


def parse_signals(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    for name in names:
        if not name.startswith("SIG") or not hasattr(signal, name) or name in ("SIGKILL", "SIGSTOP"):
            raise LaunchError(f"--signals-to-handle: {name!r} is not a signal the agent can handle (e.g. SIGTERM,SIGUSR1)")
    return names


def check_logs_specs(name: str | None) -> None:
    """torchrun loads ``--logs-specs`` from the ``torchrun.logs_specs`` entry points; an unknown name is an error."""
    if name is None:
        return
    from importlib import metadata

    if not metadata.entry_points(group="torchrun.logs_specs").select(name=name):
        raise LaunchError(f"--logs-specs {name!r}: no entry point torchrun.logs_specs[{name}] is installed")


def parse_launch_args(argv: list[str], environ: Mapping[str, str] | None = None,
                      root: Path = Path("/")) -> LaunchSpec:
    """Parse ``keel run`` arguments (with torchrun's ``PET_*`` defaults from ``environ``, default
    ``os.environ``). Raises ``LaunchError`` with a clear message, ``LaunchHelp`` after printing ``--help``."""
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the help or the usage message
        if exc.code == 0:
            raise LaunchHelp() from None
        raise LaunchError(f"invalid arguments for keel run: {' '.join(argv)}") from None
    try:
        step = slurm_step(environ)
    except ValueError as exc:
        raise LaunchError(f"this looks like a Slurm step, but its variables do not fit: {exc}") from None
    nnodes_text = args.nnodes if args.nnodes is not None else (str(len(step.nodes)) if step else "1:1")
    try:
        min_nodes, max_nodes = parse_nnodes(nnodes_text)
        rdzv_conf = parse_rdzv_conf(args.rdzv_conf)
    except RendezvousConfigError as exc:
        raise LaunchError(str(exc)) from None
    backend = args.rdzv_backend.strip().lower()
    if backend in UNSUPPORTED_BACKENDS:
        raise LaunchError(f"--rdzv-backend {args.rdzv_backend}: Keel rendezvous with static or c10d (a TCP store "
                          f"at --rdzv-endpoint, no etcd server needed)")
    if backend not in (STATIC, C10D):
        raise LaunchError(f"--rdzv-backend must be static or c10d, got {args.rdzv_backend!r}")
    rendezvous = backend == C10D and not args.standalone
    if rendezvous and args.node_rank is not None:
        log.warning("--node-rank is ignored with --rdzv-backend c10d: the rendezvous assigns node ranks (as torchrun)")
    standby = args.keel_standby
    if step is not None and args.node_rank is None and not rendezvous:
        # srun runs one task per node: SLURM_NODEID is the node rank torchrun users pass by hand. Nodes of the
        # step past --nnodes are the job's warm standbys (an allocation larger than the job, on purpose).
        if step.node_index >= max_nodes:
            if not standby:
                log.info("keel run: Slurm node %s (index %d) is past --nnodes %d: it starts as a warm standby",
                         step.node_name, step.node_index, max_nodes)
            standby = True
        node_rank = 0 if standby else step.node_index
    else:
        node_rank = 0 if rendezvous or args.node_rank is None else args.node_rank
    nnodes = 1 if rendezvous else max_nodes
    nproc_per_node = resolve_nproc_per_node(args.nproc_per_node, environ, root)
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not args.monitor_interval > 0:
        raise LaunchError(f"--monitor-interval must be > 0 seconds, got {args.monitor_interval}")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} is outside 0..{nnodes - 1}")
    if args.event_log_handler not in EVENT_LOG_HANDLERS:
        raise LaunchError(f"--event-log-handler must be one of {', '.join(EVENT_LOG_HANDLERS)}; got {args.event_log_handler!r}")
    for flag, text in (("--redirects", args.redirects), ("--tee", args.tee)):
        try:
            parse_std(text)
        except StdSpecError as exc:
            raise LaunchError(f"{flag}: {exc}") from None
    local_ranks_filter = parse_local_ranks_filter(args.local_ranks_filter)
    if args.log_dir and Path(args.log_dir).is_file():
        raise LaunchError(f"--log-dir {args.log_dir} is a file, not a folder")
    check_logs_specs(args.logs_specs)
    signals = parse_signals(args.signals_to_handle)
    shutdown_text = args.shutdown_timeout if args.shutdown_timeout is not None else environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    try:
        shutdown = KEEL_SHUTDOWN_TIMEOUT if shutdown_text is None else timedelta(seconds=int(shutdown_text))
    except ValueError:
        raise LaunchError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be whole seconds, got {shutdown_text!r}") from None
    if shutdown < timedelta(0):
        raise LaunchError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_text}")
    if args.no_python and args.module and not args.run_path:
        raise LaunchError("--no-python and -m/--module do not go together (a module needs python)")
    master_addr = args.master_addr if args.master_addr is not None else (step.head if step else "127.0.0.1")
    master_port = 29500 if args.master_port is None else args.master_port
    run_id = args.rdzv_id
    if args.rdzv_endpoint or rendezvous:
        try:
            master_addr, master_port = parse_endpoint(args.rdzv_endpoint or (step.head if step else "localhost"),
                                                      DEFAULT_C10D_PORT if rendezvous else master_port)
        except RendezvousConfigError as exc:
            raise LaunchError(str(exc)) from None
    if args.standalone:
        if max_nodes != 1:
            raise LaunchError("--standalone launches a single node; drop --nnodes or --standalone")
    local_rendezvous = args.standalone or (backend == STATIC and not args.rdzv_endpoint
                                           and args.master_port is None and max_nodes == 1)
    if local_rendezvous:
        # torchrun's c10d rendezvous on localhost:0 with a fresh run id: the launcher picks a free port
        # (``LaunchSpec.with_free_master_port``).
        master_addr, run_id = "127.0.0.1", str(uuid.uuid4())
        if args.master_port is None and not args.rdzv_endpoint:
            master_port = 0
    if not args.script and not standby:
        raise LaunchError("no training script given (keel run [options] script.py [args] or -m module [args])")
    command: tuple[str, ...] = ()
    if args.script:
        command = (("-m", args.script, *args.script_args) if args.module and not args.run_path
                   else (args.script, *args.script_args))
    node_id = args.keel_node_id or (step.node_name if step else socket.gethostname())
    try:
        heartbeat = parse_duration(args.keel_heartbeat_interval)
        probe = parse_duration(args.keel_probe_interval)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    job_id = (args.keel_job_id or (args.rdzv_id if args.rdzv_id != "none" else "")
              or (f"slurm-{step.job_id}" if step else "") or "job")
    agent_dir = Path(args.keel_agent_dir) if args.keel_agent_dir else default_agent_dir(node_id, job_id)
    ckpt_dir = None if args.keel_no_checkpoint else Path(args.keel_ckpt_dir or default_ckpt_dir(agent_dir))
    store_address = args.keel_store_address or ("127.0.0.1:0" if max_nodes == 1 else "")
    host, _, port = store_address.rpartition(":")
    if store_address and (not host or not port.isdigit()):
        raise LaunchError(f"--keel-store-address must be HOST:PORT, got {store_address!r}")
    tls = [args.keel_tls_cert, args.keel_tls_key, args.keel_tls_ca]
    if any(tls) and not all(tls):
        missing = [flag for flag, value in zip(("--keel-tls-cert", "--keel-tls-key", "--keel-tls-ca"), tls, strict=True)
                   if not value]
        raise LaunchError(f"the shard store's TLS files go together: {', '.join(missing)} missing (give all three, "
                          f"or none to issue the node a certificate from <credentials>/shard-ca/{job_id}/)")
    return LaunchSpec(
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        command=command,
        job_id=job_id,
        node_id=node_id,
        fault_domain=args.keel_fault_domain,
        standby=standby,
        max_restarts=args.max_restarts,
        agent_dir=agent_dir,
        root=Path(args.keel_root),
        heartbeat_interval=heartbeat,
        probe_interval=probe,
        ckpt_dir=ckpt_dir,
        store_address=store_address,
        store_advertise=args.keel_store_advertise,
        tls_cert=Path(args.keel_tls_cert) if args.keel_tls_cert else None,
        tls_key=Path(args.keel_tls_key) if args.keel_tls_key else None,
        tls_ca=Path(args.keel_tls_ca) if args.keel_tls_ca else None,
        persist_root=Path(args.keel_persist_root) if args.keel_persist_root else None,
        warm_ranks=not args.keel_no_warm_ranks,
        fault_injection=args.keel_fault_injection,
        rendezvous=rendezvous,
        rdzv_backend=backend,
        rdzv_id=args.rdzv_id or "none",
        rdzv_endpoint=args.rdzv_endpoint,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        rdzv_conf=rdzv_conf,
        run_id=run_id,
        role=args.role,
        no_python=args.no_python and not args.run_path,
        run_path=args.run_path,
        monitor_interval=timedelta(seconds=args.monitor_interval),
        start_method=args.start_method,
        event_log_handler=args.event_log_handler,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        redirects=args.redirects,
        tee=args.tee,
        local_ranks_filter=local_ranks_filter,
        duplicate_stdout_filters=tuple(args.duplicate_stdout_filters),
        duplicate_stderr_filters=tuple(args.duplicate_stderr_filters),
        log_line_prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None,
        local_addr=args.local_addr,
        logs_specs=args.logs_specs,
        numa_binding=args.numa_binding,
        signals_to_handle=signals,
        shutdown_timeout=shutdown,
        virtual_local_rank=args.virtual_local_rank,
        local_restarts=args.keel_local_restarts,
        agent_dir_default=not args.keel_agent_dir,
    )

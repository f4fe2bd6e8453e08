"""``keel run`` arguments: torchrun's, plus Keel's own namespaced ``--keel-*`` flags.

Pure parsing into a frozen ``LaunchSpec``; the supervisor acts on it. torchrun spellings with dashes
and underscores are both accepted (``--nproc-per-node`` / ``--nproc_per_node``), like torchrun.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from keel.events.units import parse_duration


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

    def master_port_for(self, generation: int) -> int:
        """Each restart generation rendezvous on its own port, so no stale store keys survive a restart
        (torchrun reuses its TCPStore and fails 'Gloo connectFullMesh' half the time after a kill)."""
        return self.master_port + generation


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keel run",
        description="Launch and supervise one node's ranks (torchrun-compatible).",
        allow_abbrev=False,
    )

    def add(*names: str, **kwargs) -> None:
        spellings = []
        for name in names:
            spellings.append(name)
            if "-" in name[2:]:
                spellings.append("--" + name[2:].replace("-", "_"))
        parser.add_argument(*spellings, **kwargs)

    add("--nnodes", type=str, default="1", help="N or MIN:MAX (Keel uses MAX; elasticity comes from the controller)")
    add("--nproc-per-node", type=_positive, default=1)
    add("--node-rank", type=int, default=0)
    add("--master-addr", default="127.0.0.1")
    add("--master-port", type=int, default=None, help="default 29500; with --standalone, a free port")
    add("--max-restarts", type=int, default=0)
    add("--standalone", action="store_true", help="single node, localhost rendezvous")
    add("--rdzv-backend", default="static", help="accepted for compatibility; Keel uses a static rendezvous")
    add("--rdzv-endpoint", default="", help="HOST:PORT, the same as --master-addr/--master-port")
    add("--rdzv-id", default="", help="accepted for compatibility; used as the job id if --keel-job-id is absent")
    add("--keel-job-id", default="")
    add("--keel-node-id", default="")
    add("--keel-fault-domain", default="")
    add("--keel-standby", action="store_true", help="an idle warm standby: no ranks until promoted")
    add("--keel-agent-dir", default="")
    add("--keel-root", default="/", help="root the health probes read (overlay root of a simulated node)")
    add("--keel-heartbeat-interval", default="5s")
    add("--keel-probe-interval", default="1s")
    add("--keel-ckpt-dir", default="", help="shared-memory folder for the ranks' snapshots "
        "(default /dev/shm/keel-<hash of the agent dir>)")
    add("--keel-no-checkpoint", action="store_true", help="no in-memory checkpoints, no shard store")
    add("--keel-store-address", default="", help="HOST:PORT the shard store binds (default 127.0.0.1:0 on one "
        "node; on several, the checkpoint.store_address setting, else the interface that reaches --master-addr)")
    add("--keel-store-advertise", default="", help="host peers use to reach the shard store")
    add("--keel-tls-cert", default="", help="the node's shard-store certificate (PEM) from the job's CA; with "
        "--keel-tls-key and --keel-tls-ca (default: issued from <credentials>/shard-ca/<job>/)")
    add("--keel-tls-key", default="", help="the private key of --keel-tls-cert (a 0600 file)")
    add("--keel-tls-ca", default="", help="the job's shard-store CA certificate (PEM)")
    add("--keel-persist-root", default="", help="persistent checkpoint tier (a local or shared path)")
    add("--keel-fault-injection", action="store_true", help="let `keel inject` put workload faults into the "
        "ranks (they read <agent dir>/fault.json); for tests and demos, off by default")
    add("--keel-no-warm-ranks", action="store_true", help="start every rank and diagnostics process as a fresh "
        "interpreter (default: fork them from the node's zygote, which imported torch once)")
    parser.add_argument("-m", "--module", dest="module", action="store_true", help="run the script as a module")
    parser.add_argument("script", nargs="?")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def parse_launch_args(argv: list[str]) -> LaunchSpec:
    """Parse ``keel run`` arguments. Raises ``LaunchError`` with a clear message."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage message
        raise LaunchError(f"invalid arguments for keel run: {' '.join(argv)}") from exc
    nnodes_text = args.nnodes.split(":")[-1]
    try:
        nnodes = int(nnodes_text)
    except ValueError:
        raise LaunchError(f"--nnodes must be N or MIN:MAX, got {args.nnodes!r}") from None
    if nnodes < 1:
        raise LaunchError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= args.node_rank < nnodes:
        raise LaunchError(f"--node-rank {args.node_rank} is outside 0..{nnodes - 1}")
    master_addr = args.master_addr
    master_port = 29500 if args.master_port is None else args.master_port
    if args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise LaunchError(f"--rdzv-endpoint must be HOST:PORT, got {args.rdzv_endpoint!r}")
        master_addr, master_port = host, int(port)
    if args.standalone:
        if nnodes != 1:
            raise LaunchError("--standalone launches a single node; drop --nnodes or --standalone")
        master_addr = "127.0.0.1"
        if args.master_port is None and not args.rdzv_endpoint:
            master_port = 0  # like torchrun's localhost:0: the launcher picks a free port (`LaunchSpec.with_free_master_port`)
    if not args.script and not args.keel_standby:
        raise LaunchError("no training script given (keel run [options] script.py [args] or -m module [args])")
    command: tuple[str, ...] = ()
    if args.script:
        command = ("-m", args.script, *args.script_args) if args.module else (args.script, *args.script_args)
    node_id = args.keel_node_id or socket.gethostname()
    try:
        heartbeat = parse_duration(args.keel_heartbeat_interval)
        probe = parse_duration(args.keel_probe_interval)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    job_id = args.keel_job_id or args.rdzv_id or "job"
    agent_dir = Path(args.keel_agent_dir or f"/tmp/keel-agent-{node_id}")
    # One shared-memory folder per agent directory, so two agents on one host never share slots.
    default_ckpt_dir = Path("/dev/shm") / f"keel-{hashlib.sha256(str(agent_dir.resolve()).encode()).hexdigest()[:12]}"
    ckpt_dir = None if args.keel_no_checkpoint else Path(args.keel_ckpt_dir or default_ckpt_dir)
    store_address = args.keel_store_address or ("127.0.0.1:0" if nnodes == 1 else "")
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
        nproc_per_node=args.nproc_per_node,
        node_rank=args.node_rank,
        master_addr=master_addr,
        master_port=master_port,
        command=command,
        job_id=job_id,
        node_id=node_id,
        fault_domain=args.keel_fault_domain,
        standby=args.keel_standby,
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
    )

"""`keel run`: the node agent as a torchrun-compatible launcher.

    keel run [torchrun flags] [--keel-* flags] [-m module | script.py] [args]

The launcher parses its own arguments (``keel.agent.launch_spec``): ``keel.cli.main.main`` hands it
everything after ``run`` untouched, so ``keel run --help`` is the launcher's help.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

from keel.cli.common import Subparsers, nats_url_or_none
from keel.infra.config import BusSettings, Settings, credentials_path

if TYPE_CHECKING:  # imported where used: `keel` commands other than `keel run` never load the agent
    from keel.agent.checkpointing import NodeCheckpointing
    from keel.agent.launch_spec import LaunchSpec
    from keel.agent.rejoin import AgentLock
    from keel.agent.shard_store import TlsMaterial

log = logging.getLogger(__name__)


def register(sub: Subparsers) -> None:
    # No help of its own and a REMAINDER: the words after `run` are the launcher's (main() puts them in
    # launch_args before argparse could read torchrun's dashed flags as keel's).
    run = sub.add_parser("run", help="launch and supervise one node's ranks (torchrun-compatible)", add_help=False)
    run.add_argument("launch_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    return run_agent(args.launch_args, settings, nats_url_or_none(settings))


def agent_bus_settings(settings: Settings, job_id: str, node_id: str) -> BusSettings:
    """The agent's NATS identity and the CA it verifies the server with: ``bus.credentials`` when given; else
    this (job, node)'s identity where the credentials folder holds it (a node's bundle from ``keel-credentials
    issue-agent``, with the server's CA beside it); else, where this user holds the credentials of a local Keel
    (``keel up``), that identity, issued if new; else none (a server without authorization)."""
    from keel.infra.nats_auth import NatsAuthError, NatsAuthority, agent_identity_name, bus_settings_for
    from keel.infra.secrets import InsecurePathError

    bus = bus_settings_for(settings, agent_identity_name(job_id, node_id))
    if bus.credentials is not None:
        return bus
    authority = NatsAuthority(credentials_path(settings))
    try:
        if authority.local_server() is None:
            return bus
        path = authority.ensure_agent(job_id, node_id)
    except (OSError, NatsAuthError, InsecurePathError) as exc:
        log.error("keel run: cannot issue this node's NATS identity from %s: %s", authority.folder, exc)
        return bus
    return bus.model_copy(update={"credentials": path})


def run_agent(argv: list[str], settings: Settings, nats_url: str | None) -> int:
    from keel.agent.agent import NodeAgent
    from keel.agent.inspector_adapter import build_watcher, classify
    from keel.agent.launch_spec import LaunchError, LaunchHelp, parse_launch_args
    from keel.events.signing import KeyringError
    from keel.infra.outbox import Outbox
    from keel.infra.signing import consumer_signing

    try:
        spec = parse_launch_args(argv).with_free_master_port()
    except LaunchHelp:
        return 0
    except LaunchError as exc:
        print(f"keel run: {exc}", file=sys.stderr)
        return 2
    warn_torchrun_differences(spec)
    if spec.local_restarts:
        nats_url = None  # torchrun's behaviour, even where a control plane is configured
    # Supervised by the control plane wherever one is configured (KEEL_NATS_URL, nats_url, `keel up`): the
    # controller decides restarts for every node together. Without one, torchrun's local restarts.
    supervised = nats_url is not None
    # The agent signs nothing; it checks its commands against the control plane's keyring (signing.keyring).
    try:
        signing = consumer_signing(settings)
    except (KeyringError, OSError) as exc:
        print(f"keel run: signing keyring: {exc}", file=sys.stderr)
        return 2
    outbox = Outbox(nats_url, agent_bus_settings(settings, spec.job_id, spec.node_id),
                    name=f"keel-agent-{spec.node_id}", signing=signing) if nats_url else None
    if outbox is None:
        log.warning("keel run: %s: failures handled here (restarts up to --max-restarts), nothing reported",
                    "--keel-local-restarts" if spec.local_restarts else "no control plane configured (KEEL_NATS_URL or "
                    "`keel up`)")
    try:
        watcher = build_watcher(spec, settings.inspector)
    except (TypeError, ValueError) as exc:
        print(f"keel run: inspector settings: {exc}", file=sys.stderr)
        return 2
    from pydantic import ValidationError

    from keel.agent.diagnostics import DiagnosticsPolicy

    try:
        diagnostics_policy = DiagnosticsPolicy.model_validate(settings.diagnostics)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        print(f"keel run: diagnostics settings: {problems}", file=sys.stderr)
        return 2
    import os

    from keel.agent.clock import agent_clock

    try:
        clock = agent_clock(os.environ)
    except ValueError as exc:
        print(f"keel run: {exc}", file=sys.stderr)
        return 2
    from keel.agent.rejoin import AgentDirBusy
    from keel.checkpoint.owned import UntrustedPathError

    checkpointing = None
    lock: AgentLock | None = None
    try:
        spec, lock = claim_agent_dir(spec)
        placed = place_node(spec)
        if isinstance(placed, str):
            lock.release()
            print(f"keel run: {placed}", file=sys.stderr)
            return 2
        spec = placed
        if spec.ckpt_dir is not None:
            try:
                checkpointing = build_checkpointing(spec, settings, supervised=supervised)
            except UntrustedPathError:
                raise
            except (OSError, ValueError) as exc:  # the TLS files, the CA folder, the bind address
                lock.release()
                print(f"keel run: shard store: {exc}", file=sys.stderr)
                return 2
        agent = NodeAgent(spec, outbox=outbox, watcher=watcher, classify=classify(spec), supervised=supervised,
                          checkpointing=checkpointing, diagnostics_policy=diagnostics_policy, clock=clock,
                          metric_settings=settings.analyzer.metric_settings(),
                          code_store=settings.hot_update.resolved_versions_dir(settings.home), lock=lock)
    except (AgentDirBusy, UntrustedPathError) as exc:
        if checkpointing is not None:
            checkpointing.close(job_finished=False)
        if lock is not None:
            lock.release()
        print(f"keel run: {'refusing to start: ' if isinstance(exc, UntrustedPathError) else ''}{exc}", file=sys.stderr)
        return 2
    if checkpointing is not None:
        checkpointing.emit = agent.emit

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # torchrun's --signals-to-handle (SIGTERM and SIGINT always): the agent stops its ranks and exits.
        for name in dict.fromkeys(("SIGTERM", "SIGINT", *spec.signals_to_handle)):
            loop.add_signal_handler(getattr(signal, name), stop.set)
        outbox_stop = asyncio.Event()
        publisher = asyncio.create_task(outbox.run(outbox_stop)) if outbox else None
        result = await agent.run(stop)
        if outbox is not None and publisher is not None:
            if outbox.connected.is_set():
                await outbox.flush(timeout_s=10)
            outbox_stop.set()
            await publisher
            await outbox.close()
        log.info("keel run: %s", result.reason)
        return result.exit_code

    try:
        return asyncio.run(main())
    finally:
        # Ended by itself (not killed): the next agent in this folder is a new launch and rendezvous again.
        from keel.agent.rendezvous_store import remove_record

        remove_record(spec.agent_dir)


def warn_torchrun_differences(spec: LaunchSpec) -> None:
    """Say what torchrun would have said, and where a flag means less under Keel (docs/torchrun.md)."""
    import os

    if spec.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        log.warning("\n*****************************************\nSetting OMP_NUM_THREADS environment variable for "
                    "each process to be 1 in default, to avoid your system being overloaded, please further tune "
                    "the variable for optimal performance in your application as needed. \n"
                    "*****************************************")
    if spec.numa_binding is not None:
        log.warning("keel run: --numa-binding %s is accepted but not applied (docs/torchrun.md)", spec.numa_binding)
    if spec.logs_specs is not None:
        log.warning("keel run: --logs-specs %s is accepted; Keel writes torchrun's default log layout "
                    "(docs/torchrun.md)", spec.logs_specs)


def claim_agent_dir(spec: LaunchSpec) -> tuple[LaunchSpec, AgentLock]:
    """Lock the agent folder. A given ``--keel-agent-dir`` held by a live agent is refused (``AgentDirBusy``);
    the default one (``$TMPDIR/keel-agent-<node>-<job>``) is followed by ``-2``, ``-3``... until a free one,
    so two ``keel run``s on one host never share a folder (nor the slot folder derived from it). An agent
    restarted after its predecessor died takes the first free one: its predecessor's, if that came first."""
    from keel.agent.rejoin import AgentDirBusy, AgentLock

    if not spec.agent_dir_default:
        return spec, AgentLock(spec.agent_dir)
    base = spec.agent_dir
    for number in range(1, 65):
        candidate = spec.with_agent_dir(base if number == 1 else base.with_name(f"{base.name}-{number}"))
        try:
            return candidate, AgentLock(candidate.agent_dir)
        except AgentDirBusy:
            continue
    raise AgentDirBusy(f"64 agents of node {spec.node_id}, job {spec.job_id} run on this host in {base}[-N]: give "
                       f"--keel-agent-dir")


def place_node(spec: LaunchSpec) -> LaunchSpec | str:
    """The spec with this node's rank: as given (static), or from the c10d rendezvous of the job's first
    start (``keel.agent.rendezvous_store``). An agent restarted under the running job (``agent.json`` says
    rejoin) takes the rank its predecessor recorded instead. Returns why not, as text, when it fails."""
    if not spec.rendezvous:
        return spec
    from keel.agent.launch_spec import LaunchError
    from keel.agent.rejoin import decide_rejoin, read_state
    from keel.agent.rendezvous_store import RendezvousFailed, read_record, rendezvous, write_record

    record = read_record(spec.agent_dir)
    decision = decide_rejoin(read_state(spec.agent_dir), job_id=spec.job_id, node_id=spec.node_id,
                             standby=spec.standby)
    if record is not None and record.rdzv_id == spec.rdzv_id and decision.mode == "rejoin":
        log.info("%s: rejoining with the recorded rendezvous outcome (node rank %d of %d)", spec.node_id,
                 record.node_rank, record.nnodes)
    else:
        try:
            record = rendezvous(rdzv_id=spec.rdzv_id, node_id=spec.node_id, host=spec.master_addr,
                                port=spec.master_port, min_nodes=spec.min_nodes, max_nodes=spec.max_nodes,
                                conf=spec.rdzv_conf, standby=spec.standby)
        except (RendezvousFailed, OSError) as exc:
            return f"rendezvous {spec.rdzv_id} at {spec.master_addr}:{spec.master_port}: {exc}"
        write_record(spec.agent_dir, record)
    try:
        return spec.with_rendezvous(record.node_rank, record.nnodes, record.master_addr, record.master_port)
    except LaunchError as exc:
        return str(exc)



def store_bind_address(spec: LaunchSpec, settings: Settings) -> str:
    """Where the shard store listens: ``--keel-store-address``, else ``checkpoint.store_address``, else the
    interface that reaches the rendezvous master (port 0). Never every interface unless one of those says so."""
    if spec.store_address:
        return spec.store_address
    if settings.checkpoint.store_address:
        return settings.checkpoint.store_address
    from keel.agent.rendezvous_store import interface_toward

    host = interface_toward(spec.master_addr, spec.master_port)
    return f"[{host}]:0" if ":" in host else f"{host}:0"


def store_tls(spec: LaunchSpec, settings: Settings, hosts: tuple[str, ...]) -> TlsMaterial:
    """The node's shard-store certificate: the ``--keel-tls-*`` files, else one issued now from the job's CA
    in the credentials folder (``<credentials>/shard-ca/<job>/``, created on first use)."""
    from keel.agent.shard_store import TlsMaterial
    from keel.infra.config import credentials_path
    from keel.infra.shard_ca import NodeCredentials

    if spec.tls_cert is not None and spec.tls_key is not None and spec.tls_ca is not None:
        return TlsMaterial.load(NodeCredentials(cert=spec.tls_cert, key=spec.tls_key, ca=spec.tls_ca))
    return TlsMaterial.issue(credentials_path(settings), spec.job_id, spec.node_id, hosts)


def build_checkpointing(spec: LaunchSpec, settings: Settings, *, supervised: bool) -> NodeCheckpointing:
    """The node's checkpoint duties: its shard store (gRPC over mTLS, on ``store_bind_address``, with
    ``store_tls``'s certificate and the ``checkpoint.store_*`` limits) and the persistent tier
    (``--keel-persist-root``, else the configured ``checkpoint.persist_root``, if any)."""
    from keel.agent.checkpointing import GrpcTransport, NodeCheckpointing
    from keel.agent.shard_access import StoreLimits

    assert spec.ckpt_dir is not None
    bind = store_bind_address(spec, settings)
    hosts = tuple(h for h in (bind.rpartition(":")[0].strip("[]"), spec.store_advertise) if h and h not in ("0.0.0.0", "::"))
    tls = store_tls(spec, settings, hosts)
    ckpt = settings.checkpoint
    limits = StoreLimits(max_shard_bytes=ckpt.store_max_shard_bytes, peer_quota_bytes=ckpt.store_peer_quota,
                         total_quota_bytes=ckpt.store_total_quota, max_streams=ckpt.store_max_streams,
                         max_streams_per_peer=ckpt.store_max_streams_per_peer)
    transport = GrpcTransport(spec.job_id, spec.node_id, spec.ckpt_dir, bind=bind, tls=tls, world_size=spec.world_size,
                              advertise=spec.store_advertise, limits=limits)
    persist_root = spec.persist_root or settings.checkpoint.resolved_persist_root(settings.home)
    log.info("%s: shard store on %s, slots in %s, persistent tier %s", spec.node_id, transport.address,
             spec.ckpt_dir, persist_root)
    return NodeCheckpointing(
        job_id=spec.job_id, node_id=spec.node_id,
        local_ranks=[spec.global_rank(i) for i in range(spec.nproc_per_node)], world_size=spec.world_size,
        node_dir=spec.ckpt_dir, agent_dir=spec.agent_dir, emit=lambda *a, **k: None, transport=transport,
        persist_root=persist_root, report_interval=settings.checkpoint.report_interval, supervised=supervised,
    )

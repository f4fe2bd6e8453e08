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
from keel.infra.config import Settings

if TYPE_CHECKING:  # imported where used: `keel` commands other than `keel run` never load the agent
    from keel.agent.checkpointing import NodeCheckpointing
    from keel.agent.launch_spec import LaunchSpec

log = logging.getLogger(__name__)


def register(sub: Subparsers) -> None:
    # No help of its own and a REMAINDER: the words after `run` are the launcher's (main() puts them in
    # launch_args before argparse could read torchrun's dashed flags as keel's).
    run = sub.add_parser("run", help="launch and supervise one node's ranks (torchrun-compatible)", add_help=False)
    run.add_argument("launch_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    return run_agent(args.launch_args, settings, nats_url_or_none(settings))


def run_agent(argv: list[str], settings: Settings, nats_url: str | None) -> int:
    from keel.agent.agent import NodeAgent
    from keel.agent.inspector_adapter import build_watcher, classify
    from keel.agent.launch_spec import LaunchError, parse_launch_args
    from keel.events.signing import KeyringError
    from keel.infra.outbox import Outbox
    from keel.infra.signing import consumer_signing

    supervised = "--keel-supervised" in argv
    argv = [a for a in argv if a != "--keel-supervised"]
    try:
        spec = parse_launch_args(argv)
    except LaunchError as exc:
        print(f"keel run: {exc}", file=sys.stderr)
        return 2
    # The agent signs nothing; it checks its commands against the control plane's keyring (signing.keyring).
    try:
        signing = consumer_signing(settings)
    except (KeyringError, OSError) as exc:
        print(f"keel run: signing keyring: {exc}", file=sys.stderr)
        return 2
    outbox = Outbox(nats_url, settings.bus, name=f"keel-agent-{spec.node_id}", signing=signing) if nats_url else None
    if outbox is None:
        log.warning("keel run: no NATS configured (KEEL_NATS_URL or `keel up`): supervising without reporting")
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
    checkpointing = None
    if spec.ckpt_dir is not None:
        checkpointing = build_checkpointing(spec, settings, supervised=supervised)
    from keel.agent.rejoin import AgentDirBusy

    try:
        agent = NodeAgent(spec, outbox=outbox, watcher=watcher, classify=classify(spec), supervised=supervised,
                          checkpointing=checkpointing, diagnostics_policy=diagnostics_policy, clock=clock,
                          metric_settings=settings.analyzer.metric_settings())
    except AgentDirBusy as exc:
        if checkpointing is not None:
            checkpointing.close(job_finished=False)
        print(f"keel run: {exc}", file=sys.stderr)
        return 2
    if checkpointing is not None:
        checkpointing.emit = agent.emit

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
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

    return asyncio.run(main())


def build_checkpointing(spec: LaunchSpec, settings: Settings, *, supervised: bool) -> NodeCheckpointing:
    """The node's checkpoint duties: its shard store (gRPC, on ``--keel-store-address``) and the
    persistent tier (``--keel-persist-root``, else the configured ``checkpoint.persist_root``, if any)."""
    from keel.agent.checkpointing import GrpcTransport, NodeCheckpointing

    assert spec.ckpt_dir is not None
    transport = GrpcTransport(spec.job_id, spec.node_id, spec.ckpt_dir, bind=spec.store_address,
                              advertise=spec.store_advertise)
    persist_root = spec.persist_root or settings.checkpoint.resolved_persist_root(settings.home)
    log.info("%s: shard store on %s, slots in %s, persistent tier %s", spec.node_id, transport.address,
             spec.ckpt_dir, persist_root)
    return NodeCheckpointing(
        job_id=spec.job_id, node_id=spec.node_id,
        local_ranks=[spec.global_rank(i) for i in range(spec.nproc_per_node)], world_size=spec.world_size,
        node_dir=spec.ckpt_dir, agent_dir=spec.agent_dir, emit=lambda *a, **k: None, transport=transport,
        persist_root=persist_root, report_interval=settings.checkpoint.report_interval, supervised=supervised,
    )

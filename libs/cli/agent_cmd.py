"""`keel run`: the node agent as a torchrun-compatible launcher."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from keel.core.config import Settings

log = logging.getLogger(__name__)


def run_agent(argv: list[str], settings: Settings, nats_url: str | None) -> int:
    from keel.agent.agent import NodeAgent
    from keel.agent.inspector_adapter import build_watcher, classify
    from keel.agent.launch_spec import LaunchError, parse_launch_args
    from keel.core.outbox import Outbox

    supervised = "--keel-supervised" in argv
    argv = [a for a in argv if a != "--keel-supervised"]
    try:
        spec = parse_launch_args(argv)
    except LaunchError as exc:
        print(f"keel run: {exc}", file=sys.stderr)
        return 2
    outbox = Outbox(nats_url, settings.bus, name=f"keel-agent-{spec.node_id}") if nats_url else None
    if outbox is None:
        log.warning("keel run: no NATS configured (KEEL_NATS_URL or `keel up`): supervising without reporting")
    try:
        watcher = build_watcher(spec, settings.inspector)
    except (TypeError, ValueError) as exc:
        print(f"keel run: inspector settings: {exc}", file=sys.stderr)
        return 2
    agent = NodeAgent(spec, outbox=outbox, watcher=watcher, classify=classify(spec), supervised=supervised)

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

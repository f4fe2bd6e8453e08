"""``keel replay [--job J] [--service S] [--verify]``: fold the recorded log through the current
deciders and diff the decisions they take now against the ones in the log.

Prints one summary per decider and every divergence; with ``--verify`` a divergence is exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
from typing import Any

from keel.cli.common import CliError, Subparsers, endpoints
from keel.infra.config import Settings


def register(sub: Subparsers) -> None:
    replay = sub.add_parser("replay", help="fold the log through the current deciders and diff the decisions")
    replay.add_argument("--job")
    replay.add_argument("--service")
    replay.add_argument("--verify", action="store_true", help="exit 1 when any decision diverges")
    replay.set_defaults(func=cmd_replay)


def deciders_for(settings: Settings) -> dict[str, Any]:
    """Every service's decider, built from ``settings`` as the service builds it, by service name."""
    from keel.analyzer.main import decider_from_settings as analyzer_from_settings
    from keel.checkpoint_broker.main import decider_from_settings as broker_from_settings
    from keel.controller.main import decider_from_settings
    from keel.hot_update.main import decider_from_settings as hot_update_from_settings

    return {"controller": decider_from_settings(settings), "checkpoint-broker": broker_from_settings(settings),
            "analyzer": analyzer_from_settings(settings), "hot-update": hot_update_from_settings(settings)}


def cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    from keel.infra.store import EventStore, create_engine
    from keel.kernel.replay import ReplayVerifier

    _, database_url = endpoints(settings)
    deciders = deciders_for(settings)
    if args.service and args.service not in deciders:
        raise CliError(f"no decider named {args.service!r}; known: {', '.join(deciders)}")
    chosen = [deciders[args.service]] if args.service else list(deciders.values())

    async def replay_all() -> list[Any]:
        # One pass over the log feeds every decider, streaming: memory stays flat for any log size.
        engine = create_engine(database_url, settings.db_schema)
        verifiers = [ReplayVerifier(decider, max_event_bytes=settings.bus.max_event_bytes) for decider in chosen]
        gc.collect()
        gc.freeze()  # the long-lived heap is not rescanned by every collection during a long replay
        try:
            async for recorded in EventStore(engine).read(job_id=args.job):
                for verifier in verifiers:
                    verifier.observe(recorded.event)
        finally:
            await engine.dispose()
        return [verifier.finish() for verifier in verifiers]

    diverged = False
    for report in asyncio.run(replay_all()):
        print(report.summary())
        for divergence in report.divergences:
            print("  " + divergence.describe().replace("\n", "\n  "))
        diverged |= not report.clean
    if args.verify and diverged:
        return 1
    return 0

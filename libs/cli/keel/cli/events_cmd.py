"""``keel events``: read the event log, and the event catalogue.

    keel events tail [--job J] [-n N] [--follow]    the latest N events (20), one line each; --follow
                                                    polls for more every 0.5 s until interrupted
    keel events show ID                             one event in full (JSON, with its log position)
    keel events schema [--write | --check]          the JSON Schema catalogue of every event type:
                                                    print it, write it, or exit 1 if the file is stale

(Named ``events_cmd`` so that it does not read as the ``keel.events`` distribution.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import Any

from keel.cli.common import CliError, Subparsers, endpoints
from keel.infra.config import Settings


def register(sub: Subparsers) -> None:
    events = sub.add_parser("events", help="read the event log")
    events_sub = events.add_subparsers(dest="events_command", required=True)
    tail = events_sub.add_parser("tail", help="the latest events")
    tail.add_argument("--job")
    tail.add_argument("-n", type=int, default=20)
    tail.add_argument("-f", "--follow", action="store_true")
    tail.set_defaults(func=cmd_events)
    show = events_sub.add_parser("show", help="one event in full")
    show.add_argument("id")
    show.set_defaults(func=cmd_events)
    schema = events_sub.add_parser("schema", help="the JSON Schema catalogue of every event type")
    group = schema.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true")
    group.add_argument("--check", action="store_true")
    schema.set_defaults(func=cmd_schema)


def _format_event(position: int, event: Any) -> str:
    payload = event.payload.model_dump(mode="json")
    brief = ", ".join(f"{k}={v}" for k, v in payload.items() if v not in ("", [], {}, None))
    if len(brief) > 140:
        brief = brief[:137] + "..."
    stamp = event.occurred_at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    return f"{position:>8} {stamp} {event.job_id:<10} {event.subject:<16} {event.type:<22} {event.producer:<12} {brief}"


def cmd_events(args: argparse.Namespace, settings: Settings) -> int:
    """``keel events tail`` and ``keel events show``."""
    from keel.infra.store import EventStore, create_engine

    _, database_url = endpoints(settings)

    async def main() -> int:
        engine = create_engine(database_url, settings.db_schema)
        store = EventStore(engine)
        try:
            if args.events_command == "show":
                try:
                    event_id = uuid.UUID(args.id)
                except ValueError:
                    raise CliError(f"not an event id: {args.id!r}") from None
                recorded = await store.get(event_id)
                if recorded is None:
                    raise CliError(f"no event {args.id} in the log")
                print(json.dumps({"position": recorded.position, "js_seq": recorded.js_seq,
                                  "recorded_at": recorded.recorded_at.isoformat(), **recorded.event.to_wire()}, indent=2))
                return 0
            head = await store.head_position()
            after = max(0, head - args.n) if args.job is None else 0
            recent = [r async for r in store.read(job_id=args.job, after_position=after)][-args.n :]
            for recorded in recent:
                print(_format_event(recorded.position, recorded.event))
            position = recent[-1].position if recent else head
            while args.follow:
                await asyncio.sleep(0.5)
                async for recorded in store.read(job_id=args.job, after_position=position):
                    print(_format_event(recorded.position, recorded.event), flush=True)
                    position = recorded.position
            return 0
        finally:
            await engine.dispose()

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 0


def cmd_schema(args: argparse.Namespace, settings: Settings) -> int:
    from keel.events.catalogue import CATALOGUE_PATH, build_catalogue, render

    text = render(build_catalogue())
    if args.write:
        CATALOGUE_PATH.write_text(text)
        print(f"keel: wrote {CATALOGUE_PATH}")
        return 0
    if args.check:
        if not CATALOGUE_PATH.exists() or CATALOGUE_PATH.read_text() != text:
            print(f"keel: {CATALOGUE_PATH} is out of date; run `keel events schema --write`", file=sys.stderr)
            return 1
        print("keel: event catalogue is up to date")
        return 0
    print(text, end="")
    return 0

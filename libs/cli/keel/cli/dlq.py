"""``keel dlq``: the dead-letter stream (``keel.infra.dlq``).

    keel dlq ls [--job J] [--since 1h|ISO] [--limit N] [--json]   the dead letters, oldest first (the newest N)
    keel dlq show ID [--raw]                                     one in full: headers and body (--raw: the
                                                                 body's bytes alone, to fix and redrive)
    keel dlq redrive ID|--all [--body FILE] [--job J] [--dry-run] [--by NAME]
                                                                 re-publish on the subject its event belongs
                                                                 on, record DeadLetterRedriven, remove it

Exit status: 0 done; 1 an unknown dead letter, or one or more refused (each with its reason); 2 usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from keel.cli.common import CliError, Subparsers, endpoints, login_name, print_json
from keel.infra.config import Settings
from keel.infra.nats_auth import ADMIN, OPERATOR, bus_settings_for


def register(sub: Subparsers) -> None:
    dlq = sub.add_parser("dlq", help="the dead-letter stream: list, show, redrive")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True)
    ls = dlq_sub.add_parser("ls", help="the dead letters, oldest first")
    ls.add_argument("--job", help="only this job's (the job token of the original subject)")
    ls.add_argument("--since", help="only those dead-lettered since: a duration back from now (1h) or an ISO time")
    ls.add_argument("--limit", type=int, default=50, help="the newest N (default 50)")
    ls.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    ls.set_defaults(func=cmd_dlq)
    show = dlq_sub.add_parser("show", help="one dead letter: headers and body")
    show.add_argument("id", help="the dead letter's id (its sequence in the dead-letter stream)")
    show.add_argument("--raw", action="store_true", help="write the body's bytes alone to stdout")
    show.set_defaults(func=cmd_dlq)
    redrive = dlq_sub.add_parser("redrive", help="re-publish fixed dead letters on their subjects")
    which = redrive.add_mutually_exclusive_group(required=True)
    which.add_argument("id", nargs="?", help="the dead letter's id")
    which.add_argument("--all", action="store_true", help="every dead letter (of --job)")
    redrive.add_argument("--body", help="a corrected body to publish instead of the dead-lettered bytes (one id)")
    redrive.add_argument("--job", help="with --all: only this job's")
    redrive.add_argument("--dry-run", action="store_true", help="say what would be redriven or refused; change nothing")
    redrive.add_argument("--by", help="who redrives (default: your login name)")
    redrive.set_defaults(func=cmd_dlq)


def parse_since(text: str, now: datetime) -> datetime:
    """``--since``: a duration back from ``now`` (``30m``) or an ISO 8601 time (UTC when it has no zone)."""
    from datetime import UTC

    from keel.events.units import parse_duration

    try:
        return now - parse_duration(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"--since: {text!r} is neither a duration (30m, 2h, 1d) nor an ISO time") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _dlq_id(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise CliError(f"not a dead letter id: {text!r} (ids are the numbers `keel dlq ls` shows)")
    return int(text)


def _age(at: datetime, now: datetime) -> str:
    seconds = max(0.0, (now - at).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def format_table(rows: list[Any], now: datetime) -> list[str]:
    """The ``keel dlq ls`` table: one line per dead letter (a size with ``*``: the copy was cut)."""
    width = max([len("SUBJECT"), *(len(d.subject) for d in rows)])
    lines = [f"{'ID':>6}  {'WHEN':<19} {'AGE':>8}  {'JOB':<12} {'TYPE':<24} {'SIZE':>8}  {'SUBJECT':<{width}}  REASON"]
    for d in rows:
        reason = d.reason if len(d.reason) <= 160 else d.reason[:157] + "..."
        size = f"{d.size}{'*' if d.truncated else ''}"
        lines.append(f"{d.id:>6}  {d.at.strftime('%Y-%m-%d %H:%M:%S'):<19} {_age(d.at, now):>8}  {d.job[:12]:<12} "
                     f"{d.type[:24]:<24} {size:>8}  {d.subject:<{width}}  {reason}")
    return lines


def _body_text(data: bytes) -> str:
    """A body for people: indented JSON when it is (strict) JSON, else the text with odd bytes escaped."""
    from keel.events.envelope import InvalidEvent, _strict_json

    try:
        return json.dumps(_strict_json(data), indent=2)
    except InvalidEvent:
        return data.decode("utf-8", errors="backslashreplace")


def cmd_dlq(args: argparse.Namespace, settings: Settings) -> int:
    """``keel dlq ls``, ``show`` and ``redrive``."""
    from keel.events.envelope import now_utc
    from keel.infra.bus import Bus
    from keel.infra.dlq import DeadLetters, RedriveRefused, plan_redrive

    nats_url, _ = endpoints(settings, None)
    now = now_utc()
    since = parse_since(args.since, now) if getattr(args, "since", None) else None
    if args.dlq_command == "ls" and args.limit < 1:
        raise CliError("--limit must be at least 1")
    if getattr(args, "job", None):
        from keel.events.envelope import JOB_ID_RE

        if not JOB_ID_RE.match(args.job):
            raise CliError(f"--job: {args.job!r} is not a job id (1 to 64 letters, digits, '_' or '-')")
    if args.dlq_command == "redrive":
        if args.body and args.all:
            raise CliError("--body corrects one dead letter: give its id, not --all")
        if args.job and not args.all:
            raise CliError("--job selects dead letters for --all")
    body = None
    if getattr(args, "body", None):
        try:
            body = Path(args.body).read_bytes()
        except OSError as exc:
            raise CliError(f"--body: cannot read {args.body}: {exc.strerror or exc}") from None

    async def main() -> int:
        try:
            # Redriving republishes events of any type: only the admin identity may; listing needs none.
            identity = ADMIN if args.dlq_command == "redrive" else OPERATOR
            bus = await asyncio.wait_for(Bus.connect(nats_url, bus_settings_for(settings, identity), name="keel-dlq"),
                                         timeout=10)
        except TimeoutError:
            raise CliError(f"NATS at {nats_url} did not answer within 10 s") from None
        try:
            dead_letters = DeadLetters(bus)
            if args.dlq_command == "ls":
                rows = await dead_letters.list(job=args.job, since=since, limit=args.limit)
                if args.json:
                    print_json([d.summary() for d in rows])
                elif not rows:
                    print("keel: no dead letters" + (f" of job {args.job}" if args.job else "")
                          + (f" since {since.isoformat()}" if since else ""))
                else:
                    print("\n".join(format_table(rows, now)))
                return 0
            if args.dlq_command == "show":
                seq = _dlq_id(args.id)
                found = await dead_letters.get(seq)
                if found is None:
                    raise CliError(f"no dead letter {seq} in {dead_letters.stream} (never was, or redriven)", exit_code=1)
                if args.raw:
                    sys.stdout.buffer.write(found.data)
                    sys.stdout.flush()
                    return 0
                print(f"id:          {found.id}")
                print(f"when:        {found.at.isoformat()}")
                print(f"subject:     {found.subject}")
                print(f"reason:      {found.reason}")
                print(f"stream seq:  {found.stream_seq}")
                print(f"size:        {found.size} bytes" + (f" (this copy is cut to {len(found.data)})" if found.truncated else ""))
                for name, value in sorted(found.headers.items()):
                    print(f"header:      {name}: {value}")
                print()
                print(_body_text(found.data))
                return 0
            # redrive
            if args.all:
                chosen = await dead_letters.list(job=args.job)
                if not chosen:
                    print("keel: no dead letters to redrive")
                    return 0
            else:
                seq = _dlq_id(args.id)
                one = await dead_letters.get(seq)
                if one is None:
                    raise CliError(f"no dead letter {seq} in {dead_letters.stream} (never was, or redriven)", exit_code=1)
                chosen = [one]
            by = args.by or login_name()
            refused = 0
            logged = await _log_reader(settings)
            try:
                for dead_letter in chosen:
                    try:
                        plan = plan_redrive(dead_letter, body, prefix=settings.bus.subject_prefix,
                                            max_event_bytes=settings.bus.max_event_bytes)
                        if args.dry_run:
                            held = await logged.get(plan.event.id)
                            if held is not None and held != plan.event:
                                raise RedriveRefused(f"the log already holds event {plan.event.id} with another body")
                            print(f"keel: would redrive {dead_letter.id}: {plan.event.type} {plan.event.id} on "
                                  f"{plan.subject}" + (" (corrected body)" if plan.corrected else ""))
                            continue
                        done = await dead_letters.redrive(plan, by=by, now=now_utc(), logged=logged.get)
                        print(f"keel: redrove {dead_letter.id} as {by}: {done}")
                    except RedriveRefused as exc:
                        refused += 1
                        print(f"keel: refused {dead_letter.id}: {exc}", file=sys.stderr)
            finally:
                await logged.close()
            if refused:
                print(f"keel: {refused} of {len(chosen)} dead letters refused; they stay in {dead_letters.stream}",
                      file=sys.stderr)
            return 1 if refused else 0
        finally:
            await bus.close()

    return asyncio.run(main())


class _LogReader:
    """Reads one event from the log by id (for the one-id-one-body check)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    async def get(self, event_id: Any) -> Any:
        recorded = await self.store.get(event_id)
        return None if recorded is None else recorded.event

    async def close(self) -> None:
        await self.store.engine.dispose()


async def _log_reader(settings: Settings) -> _LogReader:
    from keel.infra.store import EventStore, create_engine

    _, database_url = endpoints(settings)
    return _LogReader(EventStore(create_engine(database_url, settings.db_schema)))


__all__ = ["cmd_dlq", "format_table", "parse_since", "register"]

"""``keel checkpoints ls [--root PATH] [--job J] [--json]``: the persistent checkpoint tier, committed and
incomplete checkpoints (``keel.checkpoint.disk``), read from disk: no running stack needed.

The root defaults to ``checkpoint.persist_root`` (``<home>/checkpoints``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from keel.cli.common import CliError, Subparsers
from keel.infra.config import Settings


def register(sub: Subparsers) -> None:
    checkpoints = sub.add_parser("checkpoints", help="the persistent checkpoint tier")
    checkpoints_sub = checkpoints.add_subparsers(dest="checkpoints_command", required=True)
    checkpoints_ls = checkpoints_sub.add_parser("ls", help="committed and incomplete checkpoints")
    checkpoints_ls.add_argument("--root", help="persistent tier root (default: checkpoint.persist_root, <home>/checkpoints)")
    checkpoints_ls.add_argument("--job")
    checkpoints_ls.add_argument("--json", action="store_true")
    checkpoints_ls.set_defaults(func=cmd_checkpoints)


def cmd_checkpoints(args: argparse.Namespace, settings: Settings) -> int:
    from keel.checkpoint.disk import list_checkpoints

    root = Path(args.root).expanduser() if args.root else settings.checkpoint.resolved_persist_root(settings.home)
    try:
        infos = list_checkpoints(root, args.job)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps({"root": str(root), "checkpoints": [info.to_json() for info in infos]}, indent=2))
        return 0
    if not infos:
        print(f"keel: no checkpoints under {root}" + (f" for job {args.job}" if args.job else ""))
        return 0
    print(f"{'JOB':<16} {'STEP':>9} {'RANKS':>5} {'BYTES':>14} {'CREATED_AT':<29} STATUS")
    for info in infos:
        status = info.status if not info.detail or info.detail == "no manifest" else f"{info.status} ({info.detail})"
        print(f"{info.job:<16} {info.step:>9} {info.ranks:>5} {info.bytes:>14} {info.created_at:<29} {status}")
    return 0

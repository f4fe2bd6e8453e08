"""``keel``: the command line. This module assembles the parser from the command modules, reads the
global flags and the settings, runs the chosen command and turns its errors into exit statuses.

Each command group lives in its own module, which adds its subcommands in ``register(sub)`` (parser and
handlers together, so a new command or flag touches one module):

    keel.cli.runtime       up, down, status, migrate, service   the embedded servers and the services
    keel.cli.replay        replay [--verify]                    refold the log through today's deciders
    keel.cli.events_cmd    events tail | show | schema          the event log and the event catalogue
    keel.cli.dlq           dlq ls | show | redrive              the dead-letter stream
    keel.cli.agent_cmd     run                                  one node's agent, a torchrun-compatible launcher
    keel.cli.cluster_cmd   cluster up | down | status, inject   a local multi-node cluster, and faults
    keel.cli.checkpoints   checkpoints ls                       the persistent checkpoint tier
    keel.cli.incidents     ettr, incidents, timeline            reports from the log
    keel.cli.approvals     approve, deny, cordon, uncordon      human input, published as events
    keel.cli.audit         audit VIEW                           the audit views: incidents, evictions, actions...
    keel.cli.metrics_cmd   metrics                              Prometheus metrics from the log (print, file, serve)
    keel.cli.sim_cmd       sim                                  ETTR on a simulated fleet (no servers needed)
    keel.cli.versions      deploy, versions                     code versions for hot-update
    keel.cli.demo          demo                                 the end-to-end demonstration behind `make demo`

``keel.cli.common`` holds what they share (``CliError``, the settings, the endpoints). A command module
imports heavy dependencies (the store, the bus, the services) inside its handlers: building the parser
imports every command module, and `keel --help` or a `keel service` start should not pay for the rest.

Global flags (``--config``, ``--home``, ``--nats-url``, ``--database-url``) are the top layer of the
settings (defaults < YAML < KEEL_* environment < flags).

Exit status: 0 done; 1 a check or a lookup failed (``replay --verify`` diverged; an incident or an
approval request that is unknown, ambiguous, already answered or expired); 2 a usage, configuration or
runtime error.
"""

from __future__ import annotations

import argparse
import logging
import sys

from keel.cli import (
    agent_cmd,
    approvals,
    audit,
    checkpoints,
    cluster_cmd,
    credentials_cmd,
    demo,
    dlq,
    events_cmd,
    incidents,
    metrics_cmd,
    replay,
    runtime,
    sim_cmd,
    versions,
)
from keel.cli.common import CliError, settings_from_args
from keel.infra.config import ConfigError

COMMAND_MODULES = (runtime, credentials_cmd, replay, events_cmd, dlq, agent_cmd, cluster_cmd, checkpoints, incidents, audit,
                   metrics_cmd, sim_cmd, approvals, versions, demo)
"""Every command module, in the order ``keel --help`` lists their commands."""


def build_parser() -> argparse.ArgumentParser:
    """The ``keel`` parser: the global flags, then every command module's subcommands; each sets ``func``."""
    parser = argparse.ArgumentParser(prog="keel", description="Keel: keep large training jobs productive.")
    parser.add_argument("--config", help="YAML settings file (also KEEL_CONFIG)")
    parser.add_argument("--home", help="runtime directory for the embedded servers (default ~/.keel, KEEL_HOME)")
    parser.add_argument("--nats-url", help="use this NATS server instead of the embedded one (KEEL_NATS_URL)")
    parser.add_argument("--database-url", help="use this PostgreSQL instead of the embedded one (KEEL_DATABASE_URL)")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


_GLOBAL_FLAGS_WITH_VALUE = {"--config", "--home", "--nats-url", "--database-url"}


def _command_index(argv: list[str]) -> int | None:
    """Position of the subcommand: the first word that is not a global flag or its value."""
    index = 0
    while index < len(argv):
        word = argv[index]
        if word in _GLOBAL_FLAGS_WITH_VALUE:
            index += 2
        elif word.startswith("-"):
            index += 1
        else:
            return index
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one ``keel`` command (``argv``, default ``sys.argv[1:]``) and return its exit status."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    launch_args: list[str] | None = None
    index = _command_index(argv)
    if index is not None and argv[index] == "run":
        # Everything after `run` belongs to the launcher (torchrun flags start with dashes, which
        # argparse would otherwise try to read as keel's own).
        argv, launch_args = argv[: index + 1], argv[index + 1 :]
    args = parser.parse_args(argv)
    if launch_args is not None:
        args.launch_args = launch_args
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("nats").setLevel(logging.WARNING)
    try:
        settings = settings_from_args(args)
        return int(args.func(args, settings))
    except CliError as exc:
        print(f"keel: {exc}", file=sys.stderr)
        return exc.exit_code
    except ConfigError as exc:
        print(f"keel: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        # The embedded runtime's errors (port in use, data dir locked) are meant for people.
        if type(exc).__module__ == "keel.infra.embedded":
            print(f"keel: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())

"""docker-compose.yml cannot be started here (no Docker engine), so it is checked statically."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from keel.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_runs_real_keel_commands_against_its_servers() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"nats", "postgres", "recorder", "controller", "migrate"} <= set(services)
    parser = build_parser()
    for name in ("recorder", "controller", "migrate"):
        service = services[name]
        command = service["command"]
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        if argv and argv[0] == "keel":
            argv = argv[1:]
        args = parser.parse_args(argv)  # raises SystemExit on a command keel does not have
        assert args.command in {"service", "migrate"}
        environment = service.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        assert environment["KEEL_NATS_URL"] == "nats://nats:4222", name
        assert environment["KEEL_DATABASE_URL"].startswith("postgresql://"), name
    assert "-js" in str(services["nats"].get("command", "")) or "jetstream" in (ROOT / "infra/nats/nats.conf").read_text()


def test_layout_of_the_design_card() -> None:
    for path in ("docker-compose.yml", "services", "proto", "libs", "migrations", "tests", "infra", "Makefile",
                 "README.md", "bench", ".ci/run", "proto/events.schema.json", "migrations/env.py"):
        assert (ROOT / path).exists(), path

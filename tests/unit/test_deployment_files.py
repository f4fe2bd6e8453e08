"""docker-compose.yml cannot be started here (no Docker engine), so it is checked statically."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _console_scripts() -> dict[str, Path]:
    """Every console script a distribution declares, with the distribution folder that declares it."""
    scripts: dict[str, Path] = {}
    for pyproject in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml"),
                      ROOT / "migrations/pyproject.toml"]:
        data = tomllib.loads(pyproject.read_text())
        for name in data["project"].get("scripts", {}):
            scripts[name] = pyproject.parent
    return scripts


def _dockerfile_installs() -> set[Path]:
    text = (ROOT / "Dockerfile").read_text()
    return {(ROOT / folder).resolve() for folder in re.findall(r"\./((?:libs|services)/\w+|migrations)\b", text)}


def test_compose_file_runs_real_keel_commands_against_its_servers() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"nats", "postgres", "migrate", "recorder", "controller", "checkpoint-broker", "analyzer",
            "hot-update"} <= set(services)
    scripts = _console_scripts()
    installed = _dockerfile_installs()
    for name in ("migrate", "recorder", "controller", "checkpoint-broker", "analyzer", "hot-update"):
        service = services[name]
        command = service["command"]
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        # The command is a console script of a distribution the image installs.
        assert argv[0] in scripts, (name, argv)
        assert scripts[argv[0]].resolve() in installed, (name, scripts[argv[0]])
        environment = service.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        assert environment["KEEL_NATS_URL"] == "nats://nats:4222", name
        assert environment["KEEL_DATABASE_URL"].startswith("postgresql://"), name
    assert "-js" in str(services["nats"].get("command", "")) or "jetstream" in (ROOT / "infra/nats/nats.conf").read_text()


def test_the_image_installs_no_torch_distribution() -> None:
    for folder in _dockerfile_installs():
        deps = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["dependencies"]
        assert not [d for d in deps if d.startswith(("torch", "numpy", "keel-sdk", "keel-agent", "keel-workload"))], folder


def test_layout_of_the_design_card() -> None:
    for path in ("docker-compose.yml", "services", "proto", "libs", "migrations", "tests", "infra", "Makefile",
                 "README.md", "bench", ".ci/run", "libs/events/keel/events/schema.json", "migrations/keel/migrations/env.py"):
        assert (ROOT / path).exists(), path


def test_compose_has_no_default_database_password_and_each_container_its_role() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    postgres = services["postgres"]["environment"]
    assert "POSTGRES_PASSWORD" not in postgres and postgres["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_superuser"
    expected = {"migrate": "migrate", "recorder": "recorder", "controller": "decider", "checkpoint-broker": "decider",
                "analyzer": "decider", "hot-update": "decider"}
    for name, role in expected.items():
        environment = services[name]["environment"]
        url = environment["KEEL_DATABASE_URL"]
        assert url.startswith(f"postgresql://keel_{role}@"), (name, url)  # a user, no password
        assert environment["KEEL_DATABASE_PASSWORD_FILE"] == f"/run/secrets/postgres_{role}", name
        assert services[name]["secrets"] == [f"postgres_{role}"], name  # its own password only
    for secret in compose["secrets"].values():
        assert secret["file"].startswith("./.secrets/postgres/")
    assert ".secrets/" in (ROOT / ".gitignore").read_text().split()

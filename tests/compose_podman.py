"""docker-compose.yml brought up with podman, for the tests: this machine has podman (Debian's, with runc) but no
Docker engine, and Debian's podman-compose (1.0.3) ignores ``depends_on`` conditions, which Keel's compose file
relies on (the one-shot credentials and migrate steps must finish first; NATS and PostgreSQL must be healthy).

``ComposeProject`` reads the compose file and does what Docker Compose does for the parts Keel's file uses:

- ``${VAR}``, ``${VAR:-default}`` and ``$$`` in values, from the environment it is given; YAML anchors and ``<<``;
- one bridge network per project, each container reachable by its service name; ``network_mode: none``;
- named volumes (``<project>_<name>``; an empty one takes the owner and mode of the image folder it is first
  mounted on, as Docker's does), bind mounts relative to the file's folder, ``:ro``;
- file ``secrets`` mounted read-only at ``/run/secrets/<name>``;
- ``environment``, ``command``, ``ports``, ``restart``, ``stop_grace_period``;
- ``depends_on`` with ``service_started``, ``service_healthy`` (the ``healthcheck`` run with ``podman exec`` at
  its interval, after its start period, up to its retries: podman 4.3 schedules health checks with systemd
  timers, which a container host without systemd does not run) and ``service_completed_successfully``.

It does not build (``build:`` is ignored: ``infra/images/build.sh`` builds the images first) and knows nothing
beyond this list: an unknown key of a service is an error, so a compose file that grows a feature this runner
does not honour fails here instead of being half-applied.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KNOWN_SERVICE_KEYS = {"build", "image", "command", "environment", "secrets", "volumes", "ports", "depends_on",
                      "healthcheck", "restart", "stop_grace_period", "network_mode"}
_VARIABLE = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\})")


class ComposeError(RuntimeError):
    """The compose file asks for something this runner does not do, or a service did not come up."""


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable substitution over every string of ``value``: ``${VAR}``, ``${VAR:-default}`` (the
    default also when VAR is empty), ``${VAR-default}`` (only when unset) and ``$$`` for a literal ``$``."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        whole, name, default = match.group(0), match.group(1), match.group(2)
        if whole == "$$":
            return "$"
        current = env.get(name)
        if default is None:
            return current or ""
        if ":-" in whole:
            return current if current else default
        return current if current is not None else default

    return _VARIABLE.sub(substitute, value)


def duration_s(text: str | int | float | None, default: float) -> float:
    """A compose duration (``5s``, ``1m30s``, ``500ms``) in seconds."""
    if text is None:
        return default
    if isinstance(text, (int, float)):
        return float(text)
    total, units = 0.0, {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ComposeError(f"{text!r} is not a compose duration")
    for number, unit in parts:
        total += float(number) * units[unit]
    return total


@dataclass
class ComposeProject:
    """One project of ``compose_file`` on podman (``podman`` run with ``env``: CONTAINERS_CONF and the like)."""

    compose_file: Path
    project: str
    variables: Mapping[str, str]
    podman_env: Mapping[str, str] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        raw = yaml.safe_load(Path(self.compose_file).read_text())
        self.spec: dict[str, Any] = interpolate(raw, self.variables)
        self.folder = Path(self.compose_file).resolve().parent
        for name, service in self.spec["services"].items():
            unknown = set(service) - KNOWN_SERVICE_KEYS
            if unknown:
                raise ComposeError(f"service {name}: {sorted(unknown)} not honoured by this runner")

    # ----------------------------------------------------------------------------------------- podman

    def podman(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s,
                                env={**os.environ, **self.podman_env})
        if check and result.returncode != 0:
            raise ComposeError(f"podman {shlex.join(args)} exited {result.returncode}: {result.stderr.strip()[-2000:]}")
        return result

    def container(self, service: str) -> str:
        return f"{self.project}-{service}"

    @property
    def network(self) -> str:
        return f"{self.project}_default"

    def volume(self, name: str) -> str:
        return f"{self.project}_{name}"

    def volume_path(self, name: str) -> Path:
        """Where the named volume's files lie on this host (a root host reads them as they are)."""
        return Path(self.podman("volume", "inspect", "--format", "{{.Mountpoint}}", self.volume(name)).stdout.strip())

    # ----------------------------------------------------------------------------------------- up and down

    def order(self) -> list[str]:
        """Services in an order where every dependency comes before its dependents (a cycle is an error)."""
        services = self.spec["services"]
        done: list[str] = []
        visiting: set[str] = set()

        def visit(name: str) -> None:
            if name in done:
                return
            if name in visiting:
                raise ComposeError(f"depends_on cycle through {name}")
            visiting.add(name)
            for dependency in self._depends_on(name):
                if dependency not in services:
                    raise ComposeError(f"{name} depends on {dependency}, which is no service")
                visit(dependency)
            visiting.discard(name)
            done.append(name)

        for name in services:
            visit(name)
        return done

    def _depends_on(self, name: str) -> dict[str, str]:
        depends = self.spec["services"][name].get("depends_on") or {}
        if isinstance(depends, list):
            return {dependency: "service_started" for dependency in depends}
        return {dependency: (options or {}).get("condition", "service_started") for dependency, options in depends.items()}

    def up(self, timeout_s: float = 180) -> None:
        """Create the network and volumes, then start every service once its dependencies meet their conditions."""
        if self.podman("network", "exists", self.network, check=False).returncode != 0:
            self.podman("network", "create", self.network)
        for name in self.spec.get("volumes") or {}:
            if self.podman("volume", "exists", self.volume(name), check=False).returncode != 0:
                self.podman("volume", "create", self.volume(name))
        deadline = time.monotonic() + timeout_s
        for name in self.order():
            for dependency, condition in self._depends_on(name).items():
                self.wait(dependency, condition, deadline)
            self.start(name)

    def start(self, name: str) -> None:
        service = self.spec["services"][name]
        args = ["run", "-d", "--name", self.container(name)]
        if service.get("network_mode") == "none":
            args += ["--network", "none"]
        elif "network_mode" in service:
            raise ComposeError(f"{name}: network_mode {service['network_mode']!r} not honoured by this runner")
        else:
            args += ["--network", self.network, "--network-alias", name]
        environment = service.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        for key, value in environment.items():
            args += ["-e", f"{key}={'' if value is None else value}"]
        for secret in service.get("secrets") or []:
            source = self.spec["secrets"][secret]["file"]
            path = (self.folder / source).resolve()
            if not path.is_file():
                raise ComposeError(f"{name}: secret {secret} has no file {path}")
            args += ["-v", f"{path}:/run/secrets/{secret}:ro"]
        for volume in service.get("volumes") or []:
            source, target, *options = volume.split(":")
            if source.startswith((".", "/")):
                source = str((self.folder / source).resolve())
            elif source in (self.spec.get("volumes") or {}):
                source = self.volume(source)
            else:
                raise ComposeError(f"{name}: volume {source} is not declared")
            args += ["-v", ":".join([source, target, *options])]
        for port in service.get("ports") or []:
            args += ["-p", str(port)]
        restart = service.get("restart", "no")
        if restart != "no":
            args += ["--restart", restart]
        if "stop_grace_period" in service:
            args += ["--stop-timeout", str(int(duration_s(service["stop_grace_period"], 10)))]
        args.append(service["image"])
        command = service.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        args += [str(part) for part in command or []]
        self.podman(*args)
        self.started.append(name)

    def wait(self, name: str, condition: str, deadline: float) -> None:
        container = self.container(name)
        if condition == "service_completed_successfully":
            remaining = max(1.0, deadline - time.monotonic())
            code = self.podman("wait", container, timeout_s=remaining).stdout.strip()
            if code != "0":
                raise ComposeError(f"{name} exited {code}:\n{self.logs(name)}")
            return
        if condition not in ("service_started", "service_healthy"):
            raise ComposeError(f"depends_on condition {condition!r} not honoured by this runner")
        check = self.spec["services"][name].get("healthcheck") if condition == "service_healthy" else None
        if condition == "service_healthy" and not check:
            raise ComposeError(f"{name} has no healthcheck to be healthy by")
        interval = duration_s(check.get("interval"), 30) if check else 0.2
        started_at = time.monotonic()
        start_period = duration_s(check.get("start_period"), 0) if check else 0
        failures = 0
        while True:
            state = self.podman("inspect", "--format", "{{.State.Status}}", container).stdout.strip()
            if state in ("exited", "stopped", "dead"):
                raise ComposeError(f"{name} is {state}:\n{self.logs(name)}")
            if state == "running":
                if check is None:
                    return
                if self.healthy(name, check):
                    return
                if time.monotonic() - started_at > start_period:
                    failures += 1
                    if failures >= int(check.get("retries", 3)):
                        raise ComposeError(f"{name} unhealthy after {failures} checks:\n{self.logs(name)}")
            if time.monotonic() > deadline:
                raise ComposeError(f"{name} not {condition.removeprefix('service_')} in time:\n{self.logs(name)}")
            time.sleep(interval)

    def healthy(self, name: str, check: Mapping[str, Any]) -> bool:
        test = check["test"]
        if isinstance(test, str):
            argv = ["sh", "-c", test]
        elif test[0] == "CMD":
            argv = list(test[1:])
        elif test[0] == "CMD-SHELL":
            argv = ["sh", "-c", test[1]]
        else:
            raise ComposeError(f"{name}: healthcheck test {test!r} not honoured by this runner")
        try:
            return self.podman("exec", self.container(name), *argv, check=False,
                               timeout_s=duration_s(check.get("timeout"), 30)).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def logs(self, name: str, tail: int = 60) -> str:
        result = self.podman("logs", "--tail", str(tail), self.container(name), check=False)
        return (result.stdout + result.stderr)[-6000:]

    def down(self, *, volumes: bool = True) -> None:
        """Remove every container of the project (started here or not), then its network and, with ``volumes``,
        every volume named for the project. Nothing raises half-way: what cannot be removed is left."""
        names = self.podman("ps", "-a", "--format", "{{.Names}}", check=False).stdout.split()
        mine = [n for n in names if n.startswith(f"{self.project}-")]
        if mine:
            self.podman("rm", "-f", "-t", "5", *mine, check=False, timeout_s=180)
        self.podman("network", "rm", "-f", self.network, check=False)
        if volumes:  # the file's, and any other made for the project (``volume(name)``), as a node's
            listed = self.podman("volume", "ls", "--format", "{{.Name}}", check=False).stdout.split()
            for name in listed:
                if name.startswith(f"{self.project}_"):
                    self.podman("volume", "rm", "-f", name, check=False)

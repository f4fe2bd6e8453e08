"""docker-compose.yml and the Dockerfile checked statically, as Compose reads the file with no variable set (the
compose scenario, tests/scenarios/test_compose.py, also builds the images and brings the file up with podman);
so is the Terraform module (no providers offline). The NATS configuration compose ships is also run by a real
server: tests/integration/test_compose_nats_config.py."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any, cast

import yaml

from tests.compose_podman import interpolate

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


def _distributions() -> dict[str, Path]:
    """Every Keel distribution's name, with its folder."""
    return {tomllib.loads(p.read_text())["project"]["name"]: p.parent.resolve()
            for p in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml"),
                      ROOT / "migrations/pyproject.toml"]}


def _dockerfile_installs(dockerfile: Path = ROOT / "Dockerfile") -> set[Path]:
    """The folders of the Keel distributions a Dockerfile's pip installs by name, and of every Keel
    distribution they depend on (pip installs those too, from the same wheelhouse)."""
    text = dockerfile.read_text()
    [install] = re.findall(r"pip install (?:[^\n]*\\\n)*[^\n]*", text)
    folders = _distributions()
    wanted = set(re.findall(r"\b(keel-[a-z-]+[a-z])\b", install))
    assert wanted and wanted <= set(folders), wanted
    seen: set[str] = set()
    while wanted:
        name = wanted.pop()
        seen.add(name)
        deps = tomllib.loads((folders[name] / "pyproject.toml").read_text())["project"]["dependencies"]
        wanted |= {match.group(0) for d in deps if (match := re.match(r"keel-[a-z-]+[a-z]", d))} - seen
    return {folders[name] for name in seen}


def _compose() -> dict[str, Any]:
    """docker-compose.yml as Compose reads it with no variable set: every ``${VAR:-default}`` its default."""
    return cast(dict[str, Any], interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), {}))


def test_compose_file_runs_real_keel_commands_against_its_servers() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"nats", "postgres", "migrate", "recorder", "controller", "checkpoint-broker", "analyzer",
            "hot-update"} <= set(services)
    scripts = _console_scripts()
    installed = _dockerfile_installs()
    for name in ("migrate", "recorder", "controller", "checkpoint-broker", "actuator", "analyzer", "hot-update", "notifier"):
        service = services[name]
        command = service["command"]
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        # The command is a console script of a distribution the image installs.
        assert argv[0] in scripts, (name, argv)
        assert scripts[argv[0]].resolve() in installed, (name, scripts[argv[0]])
        environment = service.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        assert environment["KEEL_NATS_URL"] == "tls://nats:4222", name
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
    compose = _compose()
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


KEEL_CONTAINERS = ("migrate", "recorder", "controller", "checkpoint-broker", "actuator", "analyzer", "hot-update",
                   "notifier")


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """``{target path: named volume}`` of a service's ``source:target[:mode]`` volumes."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        mounts[target] = source
    return mounts


def _credentials_exports(compose: dict[str, Any]) -> tuple[dict[str, str], str]:
    """The credentials step's ``{bundle: volume it is exported into}`` and the NATS server's volume."""
    step = compose["services"]["credentials"]
    assert step["command"][:2] == ["keel-credentials", "init"]
    mounts = _mounts(step)
    exports, server = {}, None
    for argument in step["command"][2:]:
        if argument.startswith("--export="):
            name, folder = argument.removeprefix("--export=").split("=", 1)
            exports[name] = mounts[folder]
        elif argument.startswith("--export-server="):
            server = mounts[argument.removeprefix("--export-server=")]
    assert server is not None
    return exports, server


def test_compose_nats_requires_tls_and_only_keel_identities() -> None:
    from keel.infra.provision import SERVER_FILES

    compose = _compose()
    nats = compose["services"]["nats"]
    assert nats["command"] == ["-c", "/etc/nats/nats.conf"]
    mounts = _mounts(nats)
    assert mounts["/etc/nats/nats.conf"] == "./infra/nats/nats.conf"
    _, server_volume = _credentials_exports(compose)
    assert mounts["/etc/nats/keel"] == server_volume and "/etc/nats/keel:ro" in " ".join(nats["volumes"])
    assert nats["depends_on"]["credentials"]["condition"] == "service_completed_successfully"
    conf = (ROOT / "infra/nats/nats.conf").read_text()
    lines = [line.split("#")[0].strip() for line in conf.splitlines()]
    # The include is relative to the including file: /etc/nats/keel/authorization.conf, from the server's volume.
    assert 'include "keel/authorization.conf"' in lines and SERVER_FILES[0] == "authorization.conf"
    tls = conf[conf.index("\ntls {"):]
    tls = tls[:tls.index("}")]
    assert 'cert_file: "/etc/nats/keel/cert.pem"' in tls and 'key_file: "/etc/nats/keel/key.pem"' in tls
    assert "allow_non_tls" not in conf and "no_auth_user" not in conf and "password" not in conf
    # The healthcheck keeps using the plain-HTTP monitoring port, inside the container.
    assert "http://127.0.0.1:8222/healthz" in " ".join(nats["healthcheck"]["test"]) and "http_port: 8222" in lines


def test_every_keel_container_reaches_nats_over_tls_as_its_own_identity_only() -> None:
    from keel.infra.provision import BUNDLES

    compose = _compose()
    services = compose["services"]
    exports, server_volume = _credentials_exports(compose)
    step = services["credentials"]
    assert {"--tls-host=nats", "--tls-host=127.0.0.1"} <= set(step["command"])  # in-network and host names
    assert step.get("network_mode") == "none" and step["restart"] == "no"
    master = _mounts(step)[step["environment"]["KEEL_CREDENTIALS_DIR"]]
    seen: set[str] = set()
    for name in KEEL_CONTAINERS:
        service = services[name]
        environment = service["environment"]
        assert environment["KEEL_NATS_URL"].startswith("tls://"), name
        folder = environment["KEEL_CREDENTIALS_DIR"]
        volume = _mounts(service)[folder]
        # Its own bundle, exported by the credentials step before it starts, and no other credentials volume.
        assert exports[name] == volume, (name, volume)
        assert BUNDLES[name].nats_identity == ("admin" if name == "migrate" else name)
        assert service["depends_on"]["credentials"]["condition"] == "service_completed_successfully", name
        assert master not in _mounts(service).values() and server_volume not in _mounts(service).values(), name
        seen.add(volume)
    assert len(seen) == len(KEEL_CONTAINERS)  # no two containers share credentials
    # The master (it holds the CA's key) is mounted by the credentials step only.
    assert [n for n, s in services.items() if master in _mounts(s).values()] == ["credentials"]
    assert services["migrate"]["depends_on"]["nats"]["condition"] == "service_healthy"  # it sets up the streams


def test_the_image_owns_every_credentials_mount_point_so_its_volumes_are_private_to_uid_10001() -> None:
    compose = _compose()
    dockerfile = (ROOT / "Dockerfile").read_text()
    match = re.search(r"install -d -m 0700 -o 10001 -g 0 ([^&]+)", dockerfile)
    assert match, "the Dockerfile creates the credentials mount points 0700, owned by uid 10001"
    private = set(match.group(1).replace("\\", " ").split())
    assert "USER 10001" in dockerfile
    for name in ("credentials", "api", *KEEL_CONTAINERS):
        service = compose["services"][name]
        assert "user" not in service, name  # the image's uid, the one the mount points belong to
        for target, source in _mounts(service).items():
            if source.startswith(("credentials-", "keel-credentials", "nats-credentials")):
                assert target in private, (name, target)


def test_compose_has_no_default_password_anywhere() -> None:
    compose = _compose()
    text = (ROOT / "docker-compose.yml").read_text()
    assert not re.search(r"://[^/@\s]+:[^/@\s]+@", text), "a URL with a password in it"
    for name, service in compose["services"].items():
        environment = service.get("environment", {})
        for key, value in environment.items():
            if key == "KEEL_API__TOKENS":
                # Each token's name, scope and SHA-256 only (keel-api --new-token): no token, and none by default.
                assert value == "[]", (name, key, value)
                continue
            if key == "KEEL_API__CHATOPS__SLACK_SIGNING_SECRET_FILE":
                assert value == "", (name, key, value)  # off by default; a file in the API's credentials volume
                continue
            if re.search(r"PASSWORD|PASS$|SECRET|TOKEN", key):
                assert key.endswith("_FILE") and str(value).startswith("/run/secrets/"), (name, key, value)
    for secret in compose["secrets"].values():
        assert "environment" not in secret and secret["file"].startswith("./.secrets/")


def test_the_api_gets_its_bundle_from_the_credentials_step_with_the_same_api_settings() -> None:
    """Operator tokens and chat-ops publish on NATS as ``chatops`` and sign with keys the API loads at start (else
    it exits 2): the credentials step exports the API's bundle, made from the API's own settings, into the volume
    the API mounts as its credentials folder, and the API reaches NATS over TLS."""
    compose = _compose()
    services = compose["services"]
    exports, server_volume = _credentials_exports(compose)
    step, api = services["credentials"], services["api"]
    master = _mounts(step)[step["environment"]["KEEL_CREDENTIALS_DIR"]]
    environment = api["environment"]
    assert environment["KEEL_NATS_URL"] == "tls://nats:4222"
    assert _mounts(api) == {environment["KEEL_CREDENTIALS_DIR"]: exports["api"]}  # its bundle, nothing else
    assert exports["api"] not in (master, server_volume) and exports["api"] in compose["volumes"]
    assert [n for n, s in services.items() if exports["api"] in _mounts(s).values()] == ["credentials", "api"]
    assert api["depends_on"]["credentials"]["condition"] == "service_completed_successfully"
    assert api["depends_on"]["nats"]["condition"] == "service_healthy"
    # The bundle is made from exactly the settings the API runs with.
    api_settings = {k: v for k, v in environment.items() if k.startswith("KEEL_API__")
                    and k not in ("KEEL_API__LISTEN_HOST", "KEEL_API__LISTEN_PORT")}
    assert {"KEEL_API__TOKENS", "KEEL_API__CHATOPS__SLACK_SIGNING_SECRET_FILE",
            "KEEL_API__CHATOPS__CALLBACKS"} <= set(api_settings)
    assert {k: v for k, v in step["environment"].items() if k.startswith("KEEL_API__")} == api_settings
    # As the file ships, a read-only API: its bundle holds no NATS identity and no key.
    from keel.infra.config import load_settings
    from keel.infra.provision import Bundle, api_bundle

    assert api_bundle(load_settings(environ={k: str(v) for k, v in environment.items()
                                             if k.startswith("KEEL_API__")})) == Bundle(None)
    # With an operator token the same settings give the chatops identity and the token's key.
    tokens = '[{"name": "alice", "scope": "operator", "sha256": "' + "ab" * 32 + '"}]'
    with_token = load_settings(environ={**{k: str(v) for k, v in api_settings.items()}, "KEEL_API__TOKENS": tokens})
    assert api_bundle(with_token) == Bundle("chatops", None, ("alice",))
    # The image creates the export's mount point, owned by uid 10001 (see the test above).
    assert "/var/lib/keel/export/api" in (ROOT / "Dockerfile").read_text()

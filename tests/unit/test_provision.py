"""keel.infra.provision: a deployment's credentials made once, each consumer handed only its own part."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from keel.infra.config import load_settings
from keel.infra.nats_auth import bus_settings_for, load_identity
from keel.infra.provision import (
    BUNDLES,
    Bundle,
    ProvisionError,
    agent_bundle,
    bundle_files,
    export_bundle,
    install_tree,
    main,
)
from keel.infra.signing import KEYRING_FILE, service_signing, signing_dir


@pytest.fixture
def master(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A master made as the compose credentials step makes it (``keel-credentials init --tls-host ...``)."""
    folder = tmp_path / "master"
    monkeypatch.setenv("KEEL_CREDENTIALS_DIR", str(folder))
    assert main(["init", "--tls-host=nats", "--tls-host=127.0.0.1"]) == 0
    monkeypatch.delenv("KEEL_CREDENTIALS_DIR")
    return folder


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != ".lock")


def test_every_service_bundle_holds_its_identity_key_keyring_and_ca_and_nothing_else(tmp_path: Path) -> None:
    assert bundle_files(tmp_path, BUNDLES["controller"]) == {
        "nats/controller.json": tmp_path / "nats/controller.json",
        "nats/shard-ca/tls/ca.pem": tmp_path / "nats/shard-ca/tls/ca.pem",
        "signing/controller.key": tmp_path / "signing/controller.key",
        "signing/keyring.json": tmp_path / "signing/keyring.json",
    }
    assert BUNDLES["migrate"] == Bundle("admin")  # it administers the streams and signs nothing
    assert list(bundle_files(tmp_path, agent_bundle("j", "n0"))) == [
        "nats/agent.j.n0.json", "nats/shard-ca/tls/ca.pem", "signing/keyring.json"]


def test_a_service_started_on_its_bundle_finds_its_identity_ca_and_key_and_creates_nothing(master: Path,
                                                                                          tmp_path: Path) -> None:
    bundle = tmp_path / "recorder"
    assert export_bundle(master, BUNDLES["recorder"], bundle) == [
        "nats/recorder.json", "nats/shard-ca/tls/ca.pem", "signing/keyring.json", "signing/recorder.key"]
    for path in [bundle, *bundle.rglob("*")]:
        assert path.stat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path
    settings = load_settings(environ={"KEEL_CREDENTIALS_DIR": str(bundle)})
    bus = bus_settings_for(settings, "recorder")
    assert bus.credentials == bundle / "nats/recorder.json" and bus.tls_ca == bundle / "nats/shard-ca/tls/ca.pem"
    assert load_identity(bus.credentials) == load_identity(master / "nats/recorder.json")
    keyring_before = (bundle / "signing" / KEYRING_FILE).read_bytes()
    signing = service_signing(settings, "recorder", "recorder")  # what the service does at start
    assert signing.keys[0].public.public_text() == service_signing(
        load_settings(environ={"KEEL_CREDENTIALS_DIR": str(master)}), "recorder", "recorder").keys[0].public.public_text()
    assert (bundle / "signing" / KEYRING_FILE).read_bytes() == keyring_before
    assert _tree(bundle) == ["nats/recorder.json", "nats/shard-ca/tls/ca.pem", "signing/keyring.json",
                             "signing/recorder.key"]


def test_exporting_from_an_empty_master_names_the_command_to_run(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError, match=r"recorder\.json does not exist: run `keel-credentials init --tls-host"):
        export_bundle(tmp_path / "empty", BUNDLES["recorder"], tmp_path / "out")


def test_an_unknown_bundle_is_refused_before_anything_is_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KEEL_CREDENTIALS_DIR", str(tmp_path / "master"))
    assert main(["init", f"--export=supervisr={tmp_path / 'x'}"]) == 1
    assert "no bundle named 'supervisr'; one of migrate, recorder" in capsys.readouterr().err
    assert not (tmp_path / "master").exists() and not (tmp_path / "x").exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["init", "--export=recorder"])
    assert exit_info.value.code == 2
    assert "--export takes NAME=FOLDER" in capsys.readouterr().err


def test_init_is_idempotent_and_the_server_export_renders_every_identity(master: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    password = load_identity(master / "nats/controller.json").password
    monkeypatch.setenv("KEEL_CREDENTIALS_DIR", str(master))
    capsys.readouterr()
    assert main(["init", "--tls-host=nats", f"--export-server={tmp_path / 'server'}"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert password not in json.dumps(summary)  # paths and names, never a secret
    assert load_identity(master / "nats/controller.json").password == password  # kept
    assert sorted(os.listdir(tmp_path / "server")) == ["authorization.conf", "cert.pem", "key.pem"]
    authorization = (tmp_path / "server/authorization.conf").read_text()
    assert authorization.startswith("# generated by keel.infra.nats_auth") and password in authorization
    assert "keel.*.node.*.NodeEvictionDecided" in authorization  # the controller's exact-scope permissions


def test_an_agent_is_issued_with_its_bundle_and_the_server_learns_it(master: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_CREDENTIALS_DIR", str(master))
    assert main(["issue-agent", "--job", "j", "--node", "n0", f"--export={tmp_path / 'agent'}",
                 f"--export-server={tmp_path / 'server'}"]) == 0
    assert _tree(tmp_path / "agent") == ["nats/agent.j.n0.json", "nats/shard-ca/tls/ca.pem", "signing/keyring.json"]
    user = load_identity(tmp_path / "agent/nats/agent.j.n0.json").user
    assert f'"user": "{user}"' in (tmp_path / "server/authorization.conf").read_text()


def test_an_agent_bundle_can_carry_its_shard_store_certificate(master: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from cryptography import x509

    monkeypatch.setenv("KEEL_CREDENTIALS_DIR", str(master))
    assert main(["issue-agent", "--job", "j", "--node", "n0", f"--export={tmp_path / 'agent'}",
                 "--store-host=node-0", "--store-host=10.0.0.7"]) == 0
    assert _tree(tmp_path / "agent") == ["nats/agent.j.n0.json", "nats/shard-ca/tls/ca.pem", "signing/keyring.json",
                                         "store/ca.pem", "store/cert.pem", "store/key.pem"]
    cert = x509.load_pem_x509_certificate((tmp_path / "agent/store/cert.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((tmp_path / "agent/store/ca.pem").read_bytes())
    assert cert.issuer == ca.subject
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "node-0" in names.get_values_for_type(x509.DNSName)
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert (tmp_path / "agent/store/key.pem").stat().st_mode & 0o777 == 0o600
    capsys.readouterr()
    # A certificate with nowhere to go is refused before anything is issued.
    assert main(["issue-agent", "--job", "j", "--node", "n1", "--store-host=node-1"]) == 1
    assert "--export" in capsys.readouterr().err
    assert (master / "nats/agent.j.n0.json").exists() and not (master / "nats/agent.j.n1.json").exists()


def test_an_agent_started_on_its_bundle_uses_its_identity_and_the_servers_ca(master: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # What a node container of the compose deployment holds: only its bundle, no local Keel. Before, `keel run`
    # ignored the bundle's identity and CA there and its TLS handshake with NATS failed.
    from keel.cli.agent_cmd import agent_bus_settings

    monkeypatch.setenv("KEEL_CREDENTIALS_DIR", str(master))
    assert main(["issue-agent", "--job", "j", "--node", "n0", f"--export={tmp_path / 'agent'}"]) == 0
    monkeypatch.delenv("KEEL_CREDENTIALS_DIR")
    bus = agent_bus_settings(load_settings(environ={"KEEL_CREDENTIALS_DIR": str(tmp_path / "agent")}), "j", "n0")
    assert bus.credentials == tmp_path / "agent/nats/agent.j.n0.json"
    assert bus.tls_ca == tmp_path / "agent/nats/shard-ca/tls/ca.pem"
    # Another node's bundle is not this node's identity: no identity, and no server to issue one from.
    other = agent_bus_settings(load_settings(environ={"KEEL_CREDENTIALS_DIR": str(tmp_path / "agent")}), "j", "n1")
    assert other.credentials is None and other.tls_ca == tmp_path / "agent/nats/shard-ca/tls/ca.pem"


def test_install_copies_a_secret_volume_into_a_private_folder_of_this_user(tmp_path: Path) -> None:
    # A Kubernetes Secret volume: the files in a timestamped folder, reached through ..data and symbolic links,
    # readable by the group (defaultMode 0440), not private, so read_secret would refuse them where they are.
    volume = tmp_path / "volume"
    data = volume / "..2026_01_01_00_00_00.1"
    (data / "nats").mkdir(parents=True)
    (data / "nats/recorder.json").write_text("{}")
    (data / "nats/recorder.json").chmod(0o440)
    (volume / "..data").symlink_to(data.name)
    (volume / "nats").symlink_to("..data/nats")
    dest = tmp_path / "run" / "credentials"
    assert install_tree(volume, dest) == ["nats/recorder.json"]
    assert (dest / "nats/recorder.json").read_text() == "{}"
    assert [p.stat().st_mode & 0o777 for p in (dest, dest / "nats", dest / "nats/recorder.json")] == [0o700, 0o700,
                                                                                                       0o600]
    empty = tmp_path / "empty-volume"
    empty.mkdir()
    with pytest.raises(ProvisionError, match="holds no files: is the credentials Secret mounted there"):
        install_tree(empty, tmp_path / "other")
    with pytest.raises(ProvisionError, match="is not a folder: mount the credentials Secret there"):
        install_tree(tmp_path / "absent", tmp_path / "other")


def test_signing_keys_stay_in_their_own_bundles(master: Path, tmp_path: Path) -> None:
    for name in ("controller", "analyzer"):
        export_bundle(master, BUNDLES[name], tmp_path / name)
    assert [p.name for p in signing_dir(tmp_path / "controller").glob("*.key")] == ["controller.key"]
    assert not (tmp_path / "controller/nats/analyzer.json").exists()
    assert not list((tmp_path / "controller").rglob("ca.key"))  # the CA's key never leaves the master


def test_the_api_bundle_holds_what_its_settings_need_and_a_read_only_api_gets_no_nats_identity(
        master: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What the compose credentials step exports as ``api`` (docker-compose.yml): with operator tokens, the
    chatops NATS identity and each token's operator key (which the API loads at start); with chat-ops, the chatops
    signing key too; read-only, neither."""
    from keel.api.main import operator_keys, tokens_of
    from keel.infra.provision import api_bundle

    digest = "ab" * 32
    tokens = json.dumps([{"name": "oncall", "scope": "read", "sha256": digest},
                         {"name": "alice", "scope": "operator", "sha256": digest},
                         {"name": "pager", "scope": "operator", "sha256": digest, "identity": "bob"}])
    monkeypatch.setenv("KEEL_CREDENTIALS_DIR", str(master))
    read_only = load_settings(environ={"KEEL_API__TOKENS": tokens[:tokens.index("},") + 1] + "]"})
    assert api_bundle(read_only) == Bundle(None)
    assert list(bundle_files(master, api_bundle(read_only))) == ["nats/shard-ca/tls/ca.pem", "signing/keyring.json"]

    # An operator token whose identity has no key in the master: refused, naming how to create it.
    monkeypatch.setenv("KEEL_API__TOKENS", tokens)
    assert main(["init", f"--export=api={tmp_path / 'refused'}"]) == 1
    assert "acts as 'alice'" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    for operator in ("alice", "bob"):
        assert main(["init", f"--operator={operator}"]) == 0
    assert main(["init", f"--export=api={tmp_path / 'api'}"]) == 0
    assert _tree(tmp_path / "api") == ["nats/chatops.json", "nats/shard-ca/tls/ca.pem", "signing/alice.key",
                                       "signing/bob.key", "signing/keyring.json"]
    api = load_settings(environ={"KEEL_CREDENTIALS_DIR": str(tmp_path / "api"), "KEEL_API__TOKENS": tokens})
    assert sorted(operator_keys(api, tokens_of(api))) == ["alice", "bob"]  # what keel-api checks at start
    assert bus_settings_for(api, "chatops").credentials == tmp_path / "api/nats/chatops.json"

    # Chat-ops adds its own signing key.
    monkeypatch.setenv("KEEL_API__CHATOPS__SLACK_SIGNING_SECRET_FILE", "/var/lib/keel/credentials/chatops/slack.secret")
    assert main(["init", f"--export=api={tmp_path / 'chatops'}"]) == 0
    assert "signing/chatops.key" in _tree(tmp_path / "chatops")


def test_an_operator_token_named_after_a_service_never_exports_that_services_key(
        master: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A hand-written api.tokens entry acting as ``controller`` (a service's identity, whose key signs restarts and
    evictions) is refused before anything is written: the API's bundle takes operators' keys only."""
    tokens = json.dumps([{"name": "pager", "scope": "operator", "sha256": "ab" * 32, "identity": "controller"}])
    monkeypatch.setenv("KEEL_CREDENTIALS_DIR", str(master))
    monkeypatch.setenv("KEEL_API__TOKENS", tokens)
    assert (master / "signing" / "controller.key").exists()  # the key is there to be copied, and is not
    assert main(["init", f"--export=api={tmp_path / 'api'}"]) == 1
    err = capsys.readouterr().err
    assert "'controller'" in err and "controller role's identity, not an operator's" in err, err
    assert not (tmp_path / "api").exists()

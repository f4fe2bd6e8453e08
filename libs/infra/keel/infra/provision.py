"""Provisioning a deployment's credentials (docker compose, Kubernetes): create them once in one folder, then
hand each consumer only its own part.

``init_credentials`` creates what ``keel credentials init`` creates: the standard NATS identities, the control
plane's and one operator's signing keys, optionally the NATS server's TLS certificate (``--tls-host``) and its
authorization file. Everything lives in one credentials folder (``keel.infra.config.credentials_path``), the
*master*; it also holds the CA's private key, so it stays with whoever provisions.

A consumer (a service, the migrate step, an operator, one node's agent) gets a *bundle*: a credentials folder
of the same layout holding only

    nats/<its identity>.json            its NATS identity (what ``nats_auth.bus_settings_for`` looks for)
    nats/shard-ca/tls/ca.pem            the CA of the NATS server's certificate (``nats_auth.server_tls_ca``)
    signing/<its name>.key              its signing key, when it signs (``signing.service_signing``)
    signing/keyring.json                the public keyring it checks signatures against

The HTTP API's bundle (``api_bundle``, exported as ``api``) depends on its settings: the ``chatops`` NATS identity
when it acts (chat-ops configured or an operator token in ``api.tokens``), the chat-ops signing key when chat-ops
is configured, and the signing key of every operator token's identity; a read-only API's holds the CA and the
keyring only.

so a service started with ``KEEL_CREDENTIALS_DIR`` pointing at its bundle finds everything where it looks,
and a compromised container holds no other role's secret (``bundle_files`` says what goes in; ``BUNDLES``
names them). ``export_server`` writes what the NATS server needs: ``authorization.conf`` (every identity of
the master, permissions for the given scopes), ``cert.pem`` and ``key.pem``.

``install_tree`` copies a bundle the platform mounted (a Kubernetes Secret volume: files owned by root,
reached through symbolic links, which ``read_secret`` rightly refuses) into a private folder of this user.

Every folder written is 0700 and every file 0600 (``keel.infra.secrets``). The console script
``keel-credentials`` (``main``) exposes this in the control-plane image, which has no ``keel`` command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from keel.events.signing import KeyringError, parse_keyring
from keel.infra.api_auth import OPERATOR as OPERATOR_SCOPE
from keel.infra.config import ConfigError, Settings, credentials_path, load_settings
from keel.infra.nats_auth import (
    ADMIN,
    AUDITOR,
    CHATOPS,
    OPERATOR,
    NatsAuthError,
    NatsAuthority,
    NatsScope,
    agent_identity_name,
    ensure_server_tls,
    identity_dir,
    identity_file,
    render_authorization,
    server_tls_ca,
)
from keel.infra.secrets import InsecurePathError, ensure_private_dir, read_secret, write_secret
from keel.infra.shard_ca import ShardCaError, issue_node_certificate
from keel.infra.signing import CONTROL_PLANE, KEYRING_FILE, ensure_control_plane_keys, signing_dir

__all__ = [
    "BUNDLES",
    "Bundle",
    "ProvisionError",
    "agent_bundle",
    "api_bundle",
    "bundle_files",
    "export_bundle",
    "export_server",
    "export_store_certificate",
    "init_credentials",
    "install_tree",
    "main",
    "scope_of",
    "server_tls_files",
]

SERVER_FILES = ("authorization.conf", "cert.pem", "key.pem")
"""What ``export_server`` writes: the NATS configuration includes the first and names the others in ``tls {}``."""


class ProvisionError(RuntimeError):
    """A bundle or server folder cannot be written from this master; the message says what to run first."""


@dataclass(frozen=True)
class Bundle:
    """One consumer's part of the master: its NATS identity (None: it connects to no NATS) and, when it signs
    events, its signing identity, plus ``operator_keys``: the operator identities whose keys it signs with for
    others (the API's operator tokens)."""

    nats_identity: str | None
    signing_identity: str | None = None
    operator_keys: tuple[str, ...] = ()


BUNDLES: dict[str, Bundle] = {
    "migrate": Bundle(ADMIN),  # keel-migrate administers the streams; it signs nothing
    **{name: Bundle(name, name) for name in CONTROL_PLANE},  # each service: identity and key named after it
    "auditor": Bundle(AUDITOR),
    "chatops": Bundle(CHATOPS, CHATOPS),  # the API: signs chat-ops answers (ApprovalGiven); may publish ApprovalGiven and NodeCordoned
}
"""The bundles by name, besides ``operator`` (``operator_bundle``), ``api`` (``api_bundle``) and agents
(``agent_bundle``)."""

EXTRA_BUNDLES = ("operator", "api")
"""Bundle names ``--export`` takes besides ``BUNDLES``."""


def operator_bundle(operator: str) -> Bundle:
    return Bundle(OPERATOR, operator)


def agent_bundle(job_id: str, node_id: str) -> Bundle:
    """An agent signs nothing: its identity, the CA and the keyring (to check the commands it acts on)."""
    return Bundle(agent_identity_name(job_id, node_id))


def operator_signers(settings: Settings) -> tuple[str, ...]:
    """The signing identities of the operator tokens in ``api.tokens`` (each one's ``identity``, else its name)."""
    return tuple(sorted({t.identity or t.name for t in settings.api.tokens if t.scope == OPERATOR_SCOPE}))


def api_bundle(settings: Settings) -> Bundle:
    """The HTTP API's part for ``settings``: NATS as ``api.chatops.signing_identity`` only when it acts (chat-ops
    configured, or an operator token), that identity's signing key only with chat-ops (an operator token's
    actions are signed by its operator's key), and every operator token's key. A read-only API gets the CA and
    the keyring only."""
    chat = settings.api.chatops
    signers = operator_signers(settings)
    acts = chat.enabled or bool(signers)
    return Bundle(chat.signing_identity if acts else None, chat.signing_identity if chat.enabled else None, signers)


def bundle_named(name: str, operator: str, settings: Settings | None = None) -> Bundle:
    if name == "operator":
        return operator_bundle(operator)
    if name == "api":
        if settings is None:
            raise ProvisionError("the api bundle is made from the API's settings (api.tokens, api.chatops)")
        return api_bundle(settings)
    try:
        return BUNDLES[name]
    except KeyError:
        raise ProvisionError(f"no bundle named {name!r}; one of {', '.join([*BUNDLES, *EXTRA_BUNDLES])}") from None


def bundle_files(credentials_dir: Path, bundle: Bundle) -> dict[str, Path]:
    """``{path inside the bundle: file in the master}`` (pure; the files may not exist yet)."""
    credentials_dir = Path(credentials_dir)
    files = {
        "nats/shard-ca/tls/ca.pem": server_tls_ca(credentials_dir),
        f"signing/{KEYRING_FILE}": signing_dir(credentials_dir) / KEYRING_FILE,
    }
    if bundle.nats_identity is not None:
        files[f"nats/{bundle.nats_identity}.json"] = identity_file(credentials_dir, bundle.nats_identity)
    for signer in (bundle.signing_identity, *bundle.operator_keys):
        if signer is not None:
            files[f"signing/{signer}.key"] = signing_dir(credentials_dir) / f"{signer}.key"
    return {relative: files[relative] for relative in sorted(files)}


def server_tls_files(credentials_dir: Path) -> tuple[Path, Path]:
    """``(certificate, key)`` the NATS server serves with (issued by ``ensure_server_tls``)."""
    folder = identity_dir(Path(credentials_dir)) / "shard-ca" / "tls" / "nodes" / "nats-server"
    return folder / "cert.pem", folder / "key.pem"


def scope_of(settings: Settings) -> NatsScope:
    """The subject prefix and stream names these settings' permissions are rendered for."""
    return NatsScope(settings.bus.subject_prefix, settings.bus.stream, settings.bus.dlq_stream)


def _private_path(root: Path, relative: str) -> Path:
    """``root / relative`` with ``root`` and every folder below it on the way private (0700, created as needed;
    ``Path.mkdir(parents=True)`` would make the intermediate ones 0755)."""
    folder = ensure_private_dir(root)
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or ".." in parts:
        raise ProvisionError(f"{relative!r} is not a path inside a credentials folder")
    for part in parts[:-1]:
        folder = ensure_private_dir(folder / part)
    return folder / parts[-1]


def _copy(files: dict[str, Path], dest: Path, hint: str, hints: dict[str, str] | None = None) -> list[str]:
    for relative, source in files.items():  # all there, or nothing written
        if not source.exists() and not source.is_symlink():
            raise ProvisionError(f"{source} does not exist: {(hints or {}).get(relative, hint)}")
    for relative, source in files.items():
        try:
            data = read_secret(source)
        except FileNotFoundError:
            raise ProvisionError(f"{source} does not exist: {(hints or {}).get(relative, hint)}") from None
        write_secret(_private_path(dest, relative), data)
    return list(files)


def export_bundle(credentials_dir: Path, bundle: Bundle, dest: Path) -> list[str]:
    """Write ``bundle``'s files from the master into the credentials folder ``dest`` (created private, or an
    existing private one; files there that are not part of the bundle are left alone). Returns the paths
    written, relative to ``dest``. ``ProvisionError`` names a missing file and the command that creates it."""
    hint = ("run `keel-credentials init --tls-host HOST` (or `keel credentials init --tls-host HOST`) first; an "
            "agent's identity comes from `issue-agent`")
    hints = {f"signing/{signer}.key": f"an operator token acts as {signer!r} (api.tokens), whose key is not in the "
                                      f"master: create it with `keel-credentials init --operator {signer}` (or "
                                      f"`keel-api --new-token NAME --scope operator --identity {signer}`) with this "
                                      "credentials folder, or set the token's identity to an operator that has a key"
             for signer in bundle.operator_keys}
    _check_operator_keys(Path(credentials_dir), bundle.operator_keys)
    return _copy(bundle_files(credentials_dir, bundle), Path(dest), hint, hints)


def _check_operator_keys(credentials_dir: Path, signers: Sequence[str]) -> None:
    """Every key a bundle takes as an operator's is an operator's in the master's keyring: a token named after a
    service (``controller``, ``actuator``) must not copy that service's private key into the API's bundle."""
    if not signers:
        return
    ring_file = signing_dir(credentials_dir) / KEYRING_FILE
    try:
        ring = parse_keyring(ring_file.read_bytes(), source=str(ring_file))
    except FileNotFoundError:
        raise ProvisionError(f"{ring_file} does not exist: run `keel-credentials init` first") from None
    except KeyringError as exc:
        raise ProvisionError(str(exc)) from None
    for signer in signers:
        entry = ring.get(signer)
        if entry is not None and entry.role != "operator":
            raise ProvisionError(f"an operator token acts as {signer!r} (api.tokens), which is the {entry.role} role's "
                                 "identity, not an operator's: its private key stays out of the API's bundle; give the "
                                 "token an operator identity (`identity:`)")


STORE_FILES = ("store/cert.pem", "store/key.pem", "store/ca.pem")
"""Where ``export_store_certificate`` puts a node's shard-store certificate, key and job CA inside its bundle."""


def export_store_certificate(credentials_dir: Path, job_id: str, node_id: str, hosts: Sequence[str],
                             dest: Path) -> list[str]:
    """Issue ``node_id`` of ``job_id`` a fresh shard-store certificate for ``hosts`` (the job's CA, created if
    absent: ``keel.infra.shard_ca``) and write it, its key and the CA into the bundle ``dest`` (``STORE_FILES``)."""
    if not hosts:
        raise ProvisionError("a shard-store certificate needs the addresses the store is reached at (--store-host)")
    credentials = issue_node_certificate(Path(credentials_dir), job_id, node_id, hosts=tuple(hosts))
    return _copy(dict(zip(STORE_FILES, (credentials.cert, credentials.key, credentials.ca), strict=True)), Path(dest),
                 "the job's CA could not be created")


def export_server(credentials_dir: Path, dest: Path, scopes: Sequence[NatsScope]) -> list[str]:
    """Write the NATS server's ``authorization.conf`` (every identity in the master, permissions for
    ``scopes``), ``cert.pem`` and ``key.pem`` into ``dest`` (a private folder). The server reads them as
    whoever it runs as: root in the official image, or this user."""
    cert, key = server_tls_files(credentials_dir)
    written = _copy({"cert.pem": cert, "key.pem": key}, Path(dest),
                    "issue the NATS server's certificate with `init --tls-host HOST` first")
    identities = NatsAuthority(Path(credentials_dir)).identities()
    if not identities:
        raise ProvisionError(f"no NATS identities in {identity_dir(Path(credentials_dir))}: run `init` first")
    write_secret(_private_path(Path(dest), "authorization.conf"), render_authorization(identities, scopes).encode())
    return ["authorization.conf", *written]


def install_tree(source: Path, dest: Path) -> list[str]:
    """Copy every regular file under ``source`` into the private credentials folder ``dest`` (same relative
    paths; 0700 folders, 0600 files owned by this user). Symbolic links are followed and entries whose name
    starts with ``..`` are skipped: a Kubernetes Secret volume keeps its files in ``..data/`` behind links.
    Returns the paths written. This is the one place a secret is read without ``read_secret``'s ownership
    check: the platform, not this user, owns the mounted copy."""
    source, dest = Path(source), Path(dest)
    if not source.is_dir():
        raise ProvisionError(f"{source} is not a folder: mount the credentials Secret there")
    written: list[str] = []

    def walk(folder: Path, prefix: str) -> None:
        for entry in sorted(folder.iterdir()):
            if entry.name.startswith(".."):
                continue
            relative = f"{prefix}{entry.name}"
            if entry.is_dir():
                walk(entry, f"{relative}/")
            elif entry.is_file():
                write_secret(_private_path(dest, relative), entry.read_bytes())
                written.append(relative)

    walk(source, "")
    if not written:
        raise ProvisionError(f"{source} holds no files: is the credentials Secret mounted there?")
    return written


def init_credentials(settings: Settings, *, operator: str, tls_hosts: Sequence[str] = (),
                     auth_file: Path | None = None) -> dict[str, object]:
    """The standard identities and signing keys in ``settings``' credentials folder (kept when they exist),
    the NATS server's certificate for ``tls_hosts`` (issued anew each time) and, with ``auth_file``, its
    authorization for these settings' scope. Returns what was done (paths, no secrets)."""
    folder = credentials_path(settings)
    authority = NatsAuthority(folder)
    authority.ensure_standard()
    ensure_control_plane_keys(settings, operator)
    result: dict[str, object] = {"credentials_dir": str(folder),
                                 "identities": sorted(i.name for i in authority.identities()), "operator": operator}
    if tls_hosts:
        cert, key, ca = ensure_server_tls(folder, tls_hosts)
        result["nats_tls"] = {"cert_file": str(cert), "key_file": str(key), "ca_file": str(ca)}
    if auth_file is not None:
        write_secret(Path(auth_file), render_authorization(authority.identities(), [scope_of(settings)]).encode(),
                     private_parent=False)
        result["auth_file"] = str(auth_file)
    return result


# ---------------------------------------------------------------------------------------------- the script


def _export_arg(value: str) -> tuple[str, Path]:
    name, sep, folder = value.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"--export takes NAME=FOLDER (e.g. recorder=/var/lib/keel/export/recorder), "
                                         f"not {value!r}")
    return name, Path(folder)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keel-credentials",
        description="Create a deployment's NATS identities, signing keys and NATS TLS certificate in the credentials "
                    "folder (KEEL_CREDENTIALS_DIR), and hand each consumer its own part (docs/security.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="create what is missing (idempotent), then export")
    init.add_argument("--tls-host", action="append", default=[],
                      help="a name or address clients reach the NATS server by (repeat); issues its certificate")
    init.add_argument("--operator", help="the operator's signing identity (default: signing.operator, else "
                                         "'operator')")
    init.add_argument("--auth-file", type=Path, help="write the NATS server's authorization here too")
    init.add_argument("--export", action="append", type=_export_arg, default=[], metavar="NAME=FOLDER",
                      help=f"write bundle NAME into FOLDER (repeat); NAME: {', '.join([*BUNDLES, *EXTRA_BUNDLES])} "
                           "(api: from the API's settings, api.tokens and api.chatops)")
    init.add_argument("--export-server", type=Path, metavar="FOLDER",
                      help="write the NATS server's authorization.conf, cert.pem and key.pem into FOLDER")
    agent = sub.add_parser("issue-agent", help="one node's agent identity for one job, and its bundle")
    agent.add_argument("--job", required=True)
    agent.add_argument("--node", required=True)
    agent.add_argument("--export", type=Path, metavar="FOLDER", help="write the agent's bundle into FOLDER")
    agent.add_argument("--store-host", action="append", default=[], metavar="HOST",
                       help="an address the node's shard store is reached at (repeat): issues the node's shard-store "
                            "certificate from the job's CA into the bundle's store/ (cert.pem, key.pem, ca.pem), "
                            "for `keel run --keel-tls-cert/--keel-tls-key/--keel-tls-ca`")
    agent.add_argument("--export-server", type=Path, metavar="FOLDER",
                       help="rewrite the NATS server's files in FOLDER (then have the server reload: SIGHUP)")
    install = sub.add_parser("install", help="copy a mounted bundle into a private folder of this user")
    install.add_argument("--from", dest="source", type=Path, required=True)
    install.add_argument("--to", dest="dest", type=Path, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``keel-credentials``: exit 0 done (a JSON summary on stdout, never a secret); 1 a folder, file or
    identity that cannot be used (the reason on stderr); 2 usage or settings."""
    args = _parser().parse_args(argv)
    if args.command == "install":  # needs no settings: an init container has none
        try:
            result: dict[str, object] = {"installed": install_tree(args.source, args.dest), "into": str(args.dest)}
        except (ProvisionError, InsecurePathError, OSError) as exc:
            print(f"keel-credentials: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"keel-credentials: {exc}", file=sys.stderr)
        return 2
    master = credentials_path(settings)
    try:
        if args.command == "init":
            operator = args.operator or settings.signing.operator or "operator"
            bundles = [(bundle_named(name, operator, settings), folder) for name, folder in args.export]  # before any change
            result = init_credentials(settings, operator=operator, tls_hosts=args.tls_host, auth_file=args.auth_file)
            exported: dict[str, list[str]] = {}
            for bundle, folder in bundles:
                exported[str(folder)] = export_bundle(master, bundle, folder)
            if args.export_server is not None:
                exported[str(args.export_server)] = export_server(master, args.export_server, [scope_of(settings)])
            result["exported"] = exported
        else:
            if args.store_host and args.export is None:  # before anything is issued
                raise ProvisionError("--store-host writes into the agent's bundle: give --export FOLDER too")
            path = NatsAuthority(master).ensure_agent(args.job, args.node)
            result = {"identity_file": str(path)}
            if args.export is not None:
                result["exported"] = export_bundle(master, agent_bundle(args.job, args.node), args.export)
            if args.store_host:
                result["exported"] = [*result["exported"],  # type: ignore[misc]
                                      *export_store_certificate(master, args.job, args.node, args.store_host, args.export)]
            if args.export_server is not None:
                result["server"] = export_server(master, args.export_server, [scope_of(settings)])
    except (ProvisionError, NatsAuthError, ShardCaError, InsecurePathError, OSError, ValueError) as exc:
        print(f"keel-credentials: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0

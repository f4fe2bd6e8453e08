"""``keel credentials``: the identities Keel's servers accept (docs/security.md).

    keel credentials init [--tls-host HOST ...] [--auth-file PATH]
        the standard NATS identities (admin, each service, operator, auditor), the control plane's signing
        keys and the operator's, and the NATS server's authorization file for these settings' subject prefix
        and streams; with --tls-host, a TLS certificate for the NATS server reachable as those hosts (and
        the CA clients verify it with). What the compose file's init step and a Terraform deployment run.
    keel credentials issue-agent --job J --node N [--auth-file PATH]
        node N's agent identity for job J (a local server is reloaded); hand the printed file to that
        node's agent as KEEL_BUS__CREDENTIALS.
    keel credentials ls [--json]
        the identities: name, role, node, job and a fingerprint of the password (never the password).

Exit status: 0 done; 1 an identity or folder that cannot be used (the reason is printed); 2 usage.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from keel.cli.common import CliError, Subparsers, login_name, print_json
from keel.infra.config import Settings, credentials_path


def register(sub: Subparsers) -> None:
    credentials = sub.add_parser("credentials", help="NATS identities, signing keys, the NATS server's TLS")
    credentials_sub = credentials.add_subparsers(dest="credentials_command", required=True)
    init = credentials_sub.add_parser("init", help="create the standard identities and keys (idempotent)")
    init.add_argument("--tls-host", action="append", default=[], help="the NATS server's host name or address "
                      "(repeat); issues its TLS certificate")
    init.add_argument("--auth-file", help="write the NATS server's authorization here too")
    init.set_defaults(func=cmd_credentials)
    agent = credentials_sub.add_parser("issue-agent", help="one node's agent identity for one job")
    agent.add_argument("--job", required=True)
    agent.add_argument("--node", required=True)
    agent.add_argument("--auth-file", help="write the NATS server's authorization here too")
    agent.set_defaults(func=cmd_credentials)
    ls = credentials_sub.add_parser("ls", help="the identities (no secrets)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_credentials)


def cmd_credentials(args: argparse.Namespace, settings: Settings) -> int:
    from keel.events.signing import KeyringError
    from keel.infra.nats_auth import NatsAuthError, NatsAuthority, fingerprint, render_authorization
    from keel.infra.provision import ProvisionError, init_credentials, scope_of
    from keel.infra.secrets import InsecurePathError, write_secret

    folder = credentials_path(settings)
    authority = NatsAuthority(folder)
    result: dict[str, object] = {"credentials_dir": str(folder)}
    try:
        if args.credentials_command == "ls":
            rows = [{"name": i.name, "role": i.role, "node": i.node, "job": i.job, "fingerprint": fingerprint(i)}
                    for i in authority.identities()]
            if args.json:
                print_json(rows)
            else:
                for row in rows:
                    print(f"{row['name']:40} {row['role']:18} {row['node'] or '-':12} {row['job'] or '-':16} "
                          f"{row['fingerprint']}")
            return 0
        if args.credentials_command == "init":
            from keel.infra.signing import operator_name

            result = init_credentials(settings, operator=operator_name(settings, login_name()),
                                      tls_hosts=args.tls_host, auth_file=Path(args.auth_file) if args.auth_file else None)
        else:
            result["identity_file"] = str(authority.ensure_agent(args.job, args.node))
            if args.auth_file:
                path = Path(args.auth_file)
                write_secret(path, render_authorization(authority.identities(), [scope_of(settings)]).encode(),
                             private_parent=False)
                result["auth_file"] = str(path)
    except (NatsAuthError, ProvisionError, InsecurePathError, KeyringError, OSError) as exc:
        raise CliError(f"credentials: {exc}") from None
    print_json(result)
    return 0

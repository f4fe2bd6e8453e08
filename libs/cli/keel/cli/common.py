"""What the ``keel`` command modules share: the user-facing error (``CliError``), the settings the
global flags select, the endpoints of the stack, and the one-shot round trips to the event store and
the bus that the reporting and human-input commands make.

Every command module imports this one while the parser is built, so it imports nothing heavy at module
level: the store and the bus are imported inside the functions that use them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeAlias

from keel.infra.config import ConfigError, Settings, load_settings, resolve_endpoints
from keel.infra.dbroles import AUDITOR

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What ``ArgumentParser.add_subparsers`` returns (argparse has no public name for it). Each command
module's ``register(sub)`` adds its commands to one, each with ``func`` set to a handler
``(args, settings) -> exit status``."""


class CliError(RuntimeError):
    """A user-facing failure: printed without a traceback, exit status ``exit_code`` (2 by default)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# -- settings and endpoints ----------------------------------------------------------------------


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings with the global flags (``--config``, ``--home``, ``--nats-url``, ``--database-url``)
    as the top layer."""
    overrides: dict[str, Any] = {
        "home": args.home,
        "nats_url": args.nats_url,
        "database_url": args.database_url,
    }
    return load_settings(Path(args.config) if args.config else None, overrides=overrides)


def endpoints(settings: Settings, role: str | None = AUDITOR) -> tuple[str, str]:
    """(NATS URL, database URL): external servers when configured, else the running embedded ones. The database
    URL carries ``role``'s credentials (by default the read-only auditor's: every reporting command only reads;
    ``None``: no credentials, for a caller that needs only NATS)."""
    try:
        return resolve_endpoints(settings, role)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def nats_url_or_none(settings: Settings) -> str | None:
    """The NATS URL if there is one (configured, or the embedded server running), else None: the agents
    then supervise without reporting."""
    if settings.nats_url:
        return settings.nats_url
    try:
        return endpoints(settings, None)[0]
    except CliError:
        return None


# -- one-shot round trips to the store and the bus ---------------------------------------------------


def on_store(settings: Settings, use: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``use(store)`` against the event store; lookup and usage errors become ``CliError``."""
    from keel.infra.store import EventStore, create_engine
    from keel.reports.incidents import BadInput, LookupFailed

    _, database_url = endpoints(settings)

    async def main() -> Any:
        engine = create_engine(database_url, settings.db_schema)
        try:
            return await use(EventStore(engine))
        finally:
            await engine.dispose()

    try:
        return asyncio.run(main())
    except LookupFailed as exc:
        raise CliError(str(exc), exit_code=1) from None
    except BadInput as exc:
        raise CliError(str(exc)) from None


def operator_identity(settings: Settings, by: str | None = None) -> str:
    """Who the CLI acts as: the signing identity of operator events (``signing.operator``, else the login
    name), which is also their ``by``. ``by`` (the deprecated ``--by``) may only repeat it: a name the key
    does not prove is refused, with how to act as another identity."""
    from keel.infra.signing import operator_name

    identity = operator_name(settings, login_name())
    if by is not None:
        if by != identity:
            raise CliError(f"--by {by!r} is not your signing identity {identity!r}: operator events carry the identity "
                           "whose key signs them. Drop --by, or sign as another identity you hold the key of with "
                           "KEEL_SIGNING__OPERATOR=NAME (setting signing.operator)")
        print("keel: warning: --by is deprecated (operator events carry your signing identity); drop it",
              file=sys.stderr)
    return identity


def publish(settings: Settings, event: Any) -> None:
    """Publish one event on the bus, signed with the operator's key when its type needs it (created on first
    use, ``keel.infra.signing.operator_signing``); a NATS that does not answer within 10 s is a ``CliError``."""
    from keel.events.signing import KeyringError
    from keel.infra.bus import Bus
    from keel.infra.nats_auth import OPERATOR, bus_settings_for
    from keel.infra.secrets import InsecurePathError
    from keel.infra.signing import operator_signing

    nats_url, _ = endpoints(settings, None)
    try:
        signing = operator_signing(settings, login_name())
    except (KeyringError, InsecurePathError) as exc:
        raise CliError(f"cannot sign as an operator: {exc}") from None

    async def main() -> None:
        bus = await asyncio.wait_for(Bus.connect(nats_url, bus_settings_for(settings, OPERATOR), name="keel-cli",
                                                 signing=signing),
                                     timeout=10)
        try:
            await bus.publish(event)
        finally:
            await bus.close()

    try:
        asyncio.run(main())
    except TimeoutError:
        raise CliError(f"NATS at {nats_url} did not answer within 10 s; nothing was published") from None


def login_name() -> str:
    """Who runs the command (the default of every ``--by``)."""
    import getpass

    try:
        return os.environ.get("USER") or getpass.getuser()
    except (OSError, KeyError):
        raise CliError("cannot tell who you are: pass --by NAME") from None


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))

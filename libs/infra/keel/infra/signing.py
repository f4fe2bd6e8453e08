"""Signing keys and the keyring on disk, and what a bus signs and checks (``Signing``).

Layout (the ``signing/`` sub-folder of the credentials folder, ``keel.infra.config.credentials_path``):

- ``<credentials>/signing/<identity>.key``: an identity's ed25519 private key (PKCS#8 PEM), 0600;
- ``<credentials>/signing/keyring.json``: every identity's role and public key (``keel.events.signing``
  ``parse_keyring``). Consumers read the keyring ``signing.keyring`` names (default this one): a host that
  runs only agents gets a copy of the control plane's, which holds no secret.

``ensure_signing_identity`` creates an identity's key when it has none and enters it in the keyring, under
a lock on the folder, the keyring rewritten atomically: ``keel up``, the local cluster and each service's
start call it, so a fresh machine needs no step of its own. A key file whose public key differs from the
keyring's entry replaces that entry (the key was rotated: delete the ``.key`` file and restart the service,
see docs/security.md). Ranks get no keys.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from keel.events.envelope import Event
from keel.events.signing import (
    REQUIRED_SIGNER,
    ROLES,
    KeyringError,
    PublicIdentity,
    SigningKey,
    Verdict,
    keyring_json,
    parse_keyring,
    sign_if_required,
    verify_event,
)
from keel.infra.config import Settings, credentials_path
from keel.infra.secrets import ensure_private_dir, read_secret, write_secret

log = logging.getLogger(__name__)

SIGNING_SUBDIR = "signing"
KEYRING_FILE = "keyring.json"
IDENTITY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")


def signing_dir(credentials_dir: Path) -> Path:
    return Path(credentials_dir) / SIGNING_SUBDIR


def keyring_path(settings: Settings) -> Path:
    """The keyring consumers check against: ``signing.keyring``, else ``<credentials>/signing/keyring.json``."""
    return (settings.signing.keyring or signing_dir(credentials_path(settings)) / KEYRING_FILE).expanduser()


def _check_identity(name: str, role: str) -> None:
    if not IDENTITY_RE.match(name):
        raise KeyringError(f"signing identity {name!r} is not a valid name (letters, digits, _ . @ -, at most 64, "
                           "starting with a letter or digit)")
    if role not in ROLES:
        raise KeyringError(f"signing role {role!r} is unknown; roles are {', '.join(ROLES)}")


def _read_keyring(path: Path) -> dict[str, PublicIdentity]:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return {}
    return parse_keyring(text, source=str(path))


def _load_private(path: Path) -> Ed25519PrivateKey:
    data = read_secret(path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except ValueError as exc:
        raise KeyringError(f"signing key {path} is not a PEM private key ({exc}); delete it to create a new one "
                           "(docs/security.md: key rotation)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyringError(f"signing key {path} is a {type(key).__name__}, not an ed25519 key; delete it to create "
                           "a new one")
    return key


class _FolderLock:
    """An exclusive lock on ``<folder>/.lock`` (``flock``): one process at a time rewrites the keyring."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def ensure_signing_identity(credentials_dir: Path, name: str, role: str, *, node: str | None = None) -> SigningKey:
    """Identity ``name``'s signing key, created (0600) and entered in the keyring (role ``role``) when missing.

    Raises ``KeyringError`` for an invalid name or role, or when the keyring holds ``name`` with another role
    (one identity, one role: pick another name); ``InsecurePathError`` for a credentials folder that is not
    private."""
    _check_identity(name, role)
    ensure_private_dir(Path(credentials_dir))
    folder = ensure_private_dir(signing_dir(credentials_dir))
    key_file = folder / f"{name}.key"
    ring_file = folder / KEYRING_FILE
    with _FolderLock(folder):
        entries = _read_keyring(ring_file)
        known = entries.get(name)
        if known is not None and known.role != role:
            raise KeyringError(f"identity {name!r} is in the keyring {ring_file} with role {known.role}, not {role}: "
                               "one identity has one role (use another name, or remove the entry and its key)")
        if key_file.exists():
            private = _load_private(key_file)
        else:
            private = Ed25519PrivateKey.generate()
            write_secret(key_file, private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
            log.info("created signing key %s (%s)", key_file, role)
        key = SigningKey(name, role, private)
        public = PublicIdentity(name, role, private.public_key(), node)
        if known is None or known.public_text() != public.public_text() or known.node != node:
            if known is not None and known.public_text() != public.public_text():
                log.warning("identity %s: its key %s differs from the keyring's entry; the keyring now holds the new "
                            "public key (a rotation: copy the keyring to every host again)", name, key_file)
            entries[name] = public
            write_secret(ring_file, keyring_json(entries))
    return key


def load_signing_key(credentials_dir: Path, name: str) -> SigningKey:
    """Identity ``name``'s existing key and its role from the keyring (``KeyringError`` / ``FileNotFoundError``
    saying what is missing and how to create it)."""
    folder = signing_dir(credentials_dir)
    entry = _read_keyring(folder / KEYRING_FILE).get(name)
    if entry is None:
        raise KeyringError(f"identity {name!r} is not in the keyring {folder / KEYRING_FILE}: run `keel up` (it creates "
                           "the keys of the control plane and of your operator identity)")
    private = _load_private(folder / f"{name}.key")
    if entry.public_text() != SigningKey(name, entry.role, private).public.public_text():
        raise KeyringError(f"the key {folder / (name + '.key')} does not match the keyring's public key of {name!r}")
    return SigningKey(name, entry.role, private)


class KeyringFile(Mapping[str, PublicIdentity]):
    """The keyring in ``path``, read at once and read again when the file changed (its inode, mtime and size:
    every write is a rename, so a new inode). A lookup of an identity it lacks costs one ``stat``: a key
    added after this process started (a new operator) is known at its first event, without a restart. A
    known name's rotated key is read when an event fails to verify against the old one (``refresh``, from
    ``Signing.check``). No time-based rate limit: one once skipped the re-read for a second after the last
    one, and an operator's first signed event in that second was refused and dead-lettered. A missing file
    is an empty keyring (every signed event is refused, with the path in the reason); an invalid one raises
    ``KeyringError`` at first, and later is logged once per version of the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._entries: dict[str, PublicIdentity] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._reload(force=True)

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _reload(self, *, force: bool = False) -> None:
        stamp = self._file_stamp()
        if not force and stamp == self._stamp:
            return
        try:
            entries = _read_keyring(self.path)
        except KeyringError:
            if force:
                raise
            log.exception("keyring %s: could not read it again; keeping the %d identities read before", self.path,
                          len(self._entries))
            self._stamp = stamp  # this version of the file is broken: not read (nor logged) again until it changes
            return
        self._entries, self._stamp = entries, stamp

    def refresh(self) -> bool:
        """Read the file again if it changed since it was read; True when it did (the entries may differ)."""
        with self._lock:
            before = self._stamp
            self._reload()
            return self._stamp != before

    def __getitem__(self, name: str) -> PublicIdentity:
        entry = self._entries.get(name)
        if entry is None:
            with self._lock:
                self._reload()
            entry = self._entries.get(name)
            if entry is None:
                raise KeyError(name)
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(dict(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class Signing:
    """What one bus connection signs and checks against: ``keys`` sign the events whose types their roles
    must sign (a service has its own one; a test harness that plays several producers may hold several), and
    ``keyring`` is what consumers check signatures against. ``keyring`` None: there is no keyring, so every
    event that needs a signature is refused (secure by default), saying so."""

    keys: tuple[SigningKey, ...] = ()
    keyring: Mapping[str, PublicIdentity] | None = None
    _by_role: dict[str, SigningKey] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key in self.keys:
            self._by_role.setdefault(key.role, key)

    def sign(self, event: Event) -> Event:
        """``event``, signed when its type needs a signature by a role one of ``keys`` has (and it has none)."""
        if not self.keys or event.signature is not None:
            return event
        roles = REQUIRED_SIGNER.get(event.type)
        if roles is None:
            return event
        for role in roles:
            key = self._by_role.get(role)
            if key is not None:
                return sign_if_required(event, key)
        return event

    def check(self, event: Event, as_sent: dict[str, Any] | None = None) -> Verdict:
        """May ``event`` be acted on (``keel.events.signing.verify_event`` against ``keyring``)?"""
        if event.signature is None and event.type not in REQUIRED_SIGNER:
            return _NO_SIGNATURE_NEEDED
        if self.keyring is None:
            return Verdict(False, f"{event.type} {event.id} needs a signature, and this consumer has no keyring to "
                                  "check it against (refusing to act on it)")
        verdict = verify_event(event, self.keyring, as_sent=as_sent)
        if not verdict.ok and isinstance(self.keyring, KeyringFile):
            # A known name whose key was rotated since the file was read: read it again (when it changed)
            # and check once more, before refusing.
            if self.keyring.refresh():
                verdict = verify_event(event, self.keyring, as_sent=as_sent)
                if verdict.ok:
                    return verdict
            return Verdict(False, f"{verdict.reason} [keyring {self.keyring.path}]")
        return verdict


_NO_SIGNATURE_NEEDED = Verdict(True, "needs no signature")

NO_SIGNING = Signing()
"""No keys and no keyring: signs nothing and refuses every event that needs a signature."""


def service_signing(settings: Settings, name: str, role: str) -> Signing:
    """A service's signing: its own key (created on first start, ``ensure_signing_identity``) and the keyring."""
    key = ensure_signing_identity(credentials_path(settings), name, role)
    return Signing(keys=(key,), keyring=KeyringFile(keyring_path(settings)))


CONTROL_PLANE = ("recorder", "controller", "checkpoint-broker", "actuator", "analyzer", "hot-update", "notifier")
"""The services of ``keel up``: each one's identity and role are its name."""


def ensure_control_plane_keys(settings: Settings, operator: str) -> list[SigningKey]:
    """Every control-plane service's key, the API's chat-ops key (``api.chatops.signing_identity``, role chatops)
    and operator ``operator``'s, created when missing (``keel up``, ``keel credentials init``): the keyring knows
    them all before any of them signs."""
    credentials = credentials_path(settings)
    keys = [ensure_signing_identity(credentials, name, name) for name in CONTROL_PLANE]
    keys.append(ensure_signing_identity(credentials, settings.api.chatops.signing_identity, "chatops"))
    return [*keys, ensure_signing_identity(credentials, operator, "operator")]


def consumer_signing(settings: Settings) -> Signing:
    """What a process that signs nothing (a node agent) checks against: the keyring of ``settings``."""
    return Signing(keyring=KeyringFile(keyring_path(settings)))


def operator_name(settings: Settings, login: str) -> str:
    """The CLI's operator identity: ``signing.operator``, else the login name ``login``."""
    return settings.signing.operator or login


def operator_signing(settings: Settings, login: str) -> Signing:
    """The CLI's signing: the operator's key (created on first use, as ``keel up`` does) and the keyring."""
    key = ensure_signing_identity(credentials_path(settings), operator_name(settings, login), "operator")
    return Signing(keys=(key,), keyring=KeyringFile(keyring_path(settings)))

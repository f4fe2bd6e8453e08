"""The code version store (I/O): ``<root>/<sha256 hex>/`` directories, written once, read-only after.

Contracts:

- ``tree_digest(root)``: SHA-256 over every regular file's relative path, executable bit (the owner's
  ``x``), size and bytes, sorted by path (``__pycache__``, ``.git`` and similar folders and ``*.pyc``
  left out). A symbolic link, a device, a FIFO or a socket in the tree raises ``CodeStoreError`` naming it:
  a version holds regular files only, so nothing in it can point elsewhere.
- ``copy_tree(source, target)``: the same files, copied without following any link (refused as above).
- ``ensure_store(root)``: creates the root 0755, or accepts an existing one that is a real folder owned by
  this user and writable by nobody else; otherwise ``CodeStoreError`` says what is wrong and how to fix it.
- ``publish(staging, store)``: makes the staged tree read-only (files 0444, or 0555 when executable;
  folders 0555) and renames it, in one step, to ``<store>/<hex>``; a version already there is kept (after
  its digest is checked: one that does not hash to its name is moved aside as ``.tampered-<hex>-*``).
- ``verify_version(store, digest, path)``: the version ``path`` names, checked as a node must before it runs
  it: ``path`` resolves to ``<store>/<hex of digest>``, a real folder (not a link); the tree holds only
  regular files and folders, none writable (nothing else: no ``__pycache__``, no ``*.pyc`` a rank would load
  instead of the source); and it hashes to ``digest``. Returns the stored folder and its files, or raises
  ``CodeStoreError`` with the reason. ``VerifiedVersions`` caches the result per folder and re-hashes
  only when any entry's inode, mode, size, mtime or ctime changed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from keel.rules.code import digest_hex

IGNORED_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn", ".mypy_cache", ".pytest_cache"})
"""Folders a source tree may hold that are not part of a version (never copied, never hashed)."""

_WRITABLE = 0o222
_OTHERS_WRITABLE = 0o022


class CodeStoreError(Exception):
    """A tree, a store or a stored version that cannot be used as given; the message names the path and why."""


def _ignored(name: str, is_dir: bool) -> bool:
    return name in IGNORED_DIRS if is_dir else name.endswith(".pyc")


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def walk(root: Path, *, skip_ignored: bool = True) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under ``root`` (relative POSIX path, ``lstat``), sorted, never following a link.
    Raises ``CodeStoreError`` on anything but regular files and folders (links, devices, FIFOs, sockets)."""
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        raise CodeStoreError(f"{root}: cannot list it ({exc.strerror})") from None
    for name in names:
        path = root / name
        st = os.lstat(path)
        is_dir = stat.S_ISDIR(st.st_mode)
        if skip_ignored and _ignored(name, is_dir):
            continue
        if is_dir:
            yield name, st
            yield from ((f"{name}/{rel}", sub) for rel, sub in walk(path, skip_ignored=skip_ignored))
        elif stat.S_ISREG(st.st_mode):
            yield name, st
        else:
            raise CodeStoreError(f"{path} is {_kind(st.st_mode)}: a code version holds regular files and folders "
                                 f"only (copy the target in, or remove it)")


def _read(path: Path) -> Iterator[bytes]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as handle:
        yield from iter(lambda: handle.read(1 << 20), b"")


def tree_digest(root: Path) -> str:
    """The version digest of the tree at ``root`` (see the module's contract)."""
    h = hashlib.sha256()
    for rel, st in sorted((rel, st) for rel, st in walk(root) if not stat.S_ISDIR(st.st_mode)):
        h.update(f"{rel}\0{int(bool(st.st_mode & stat.S_IXUSR))}\0{st.st_size}\0".encode())
        for chunk in _read(root / rel):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


def copy_tree(source: Path, target: Path) -> None:
    """Copy ``source``'s version files into ``target`` (which exists), following no link."""
    for rel, st in walk(source):
        if stat.S_ISDIR(st.st_mode):
            (target / rel).mkdir()
            continue
        fd = os.open(target / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            for chunk in _read(source / rel):
                out.write(chunk)
        os.chmod(target / rel, 0o700 if st.st_mode & stat.S_IXUSR else 0o600)


def ensure_store(root: Path) -> Path:
    """Create the store root (0755, parents as needed) or check the existing one; returns it resolved."""
    root = Path(root).expanduser()
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    real = Path(os.path.realpath(root))
    st = os.lstat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise CodeStoreError(f"version store {root} is not a folder")
    if st.st_uid != os.geteuid():
        raise CodeStoreError(f"version store {root} is owned by uid {st.st_uid}, not by this user (uid "
                             f"{os.geteuid()}): deploy as its owner, or set hot_update.versions_dir to a store "
                             f"of your own")
    _check_not_others_writable(real, st, "version store")
    return real


def _check_not_others_writable(path: Path, st: os.stat_result, what: str) -> None:
    mode = stat.S_IMODE(st.st_mode)
    if mode & _OTHERS_WRITABLE:
        raise CodeStoreError(f"{what} {path} has mode {mode:04o}: writable by others, so anyone could change "
                             f"the code nodes run (chmod go-w {path})")


def _make_read_only(root: Path) -> None:
    for rel, st in walk(root, skip_ignored=False):
        if stat.S_ISDIR(st.st_mode):
            continue
        os.chmod(root / rel, 0o555 if st.st_mode & stat.S_IXUSR else 0o444)
    for rel, st in sorted(walk(root, skip_ignored=False), reverse=True):  # folders last, deepest first
        if stat.S_ISDIR(st.st_mode):
            os.chmod(root / rel, 0o555)
    os.chmod(root, 0o555)


def remove_tree(path: Path) -> None:
    """Remove a (possibly read-only) tree this user owns; a missing one is fine."""
    if not os.path.lexists(path):
        return
    for directory, _dirs, _files in os.walk(path):
        os.chmod(directory, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def staging_dir(store: Path) -> Path:
    """A private folder in the store to stage a version in (``publish`` moves it into place)."""
    return Path(tempfile.mkdtemp(prefix=".staging-", dir=store))


def publish(staging: Path, store: Path) -> tuple[str, Path]:
    """Move the staged tree into the store under its digest (see the module's contract): (digest, folder)."""
    digest = tree_digest(staging)
    final = store / digest_hex(digest)
    # Nothing a rank could load that the digest leaves out (a wheel's or a commit's __pycache__, *.pyc).
    ignored = [rel for rel, st in walk(staging, skip_ignored=False)
               if _ignored(rel.rpartition("/")[2], stat.S_ISDIR(st.st_mode))]
    for rel in ignored:
        if os.path.isdir(staging / rel):
            remove_tree(staging / rel)
        elif os.path.lexists(staging / rel):
            (staging / rel).unlink()
    if os.path.lexists(final):
        try:
            verify_tree(final, digest)
            return digest, final
        except CodeStoreError:
            aside = store / f".tampered-{final.name}-{time.time_ns()}"
            os.rename(final, aside)
    _make_read_only(staging)
    try:
        os.rename(staging, final)
    except OSError:
        if not os.path.lexists(final):  # not a concurrent publish of the same content
            raise
        verify_tree(final, digest)
    return digest, final


@dataclass(frozen=True)
class StoredVersion:
    path: Path
    digest: str
    files: frozenset[str]
    fingerprint: tuple[tuple[object, ...], ...] = field(repr=False)


def _fingerprint(root: Path) -> tuple[list[tuple[str, os.stat_result]], tuple[tuple[object, ...], ...]]:
    entries = list(walk(root, skip_ignored=False))
    st = os.lstat(root)
    prints = [("", st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)]
    prints += [(rel, s.st_ino, s.st_mode, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for rel, s in entries]
    return entries, tuple(prints)


def verify_tree(folder: Path, digest: str) -> StoredVersion:
    """Check a stored version folder (a real folder, read-only, regular files only, nothing ignored, hashing
    to ``digest``); ``CodeStoreError`` with the reason otherwise."""
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise CodeStoreError(f"{folder} is not a version folder (a real folder, not a link)")
    entries, fingerprint = _fingerprint(folder)
    for rel, s in [("", st), *entries]:
        name = rel.rpartition("/")[2]
        if rel and _ignored(name, stat.S_ISDIR(s.st_mode)):
            raise CodeStoreError(f"{folder / rel} is not part of the version (stored versions hold no "
                                 f"{name if stat.S_ISDIR(s.st_mode) else '*.pyc'}: a rank could load it instead "
                                 f"of the source)")
        if stat.S_IMODE(s.st_mode) & _WRITABLE:
            raise CodeStoreError(f"{folder / rel if rel else folder} has mode {stat.S_IMODE(s.st_mode):04o}: "
                                 f"stored versions are read-only, so it may have been changed")
    found = tree_digest(folder)
    if found != digest:
        raise CodeStoreError(f"{folder} hashes to {found}, not to its digest {digest}: the stored version was "
                             f"changed after it was published")
    files = frozenset(rel for rel, s in entries if not stat.S_ISDIR(s.st_mode))
    return StoredVersion(folder, digest, files, fingerprint)


def verify_version(store: Path, digest: str, path: str) -> StoredVersion:
    """The stored version ``path`` names, checked (see the module's contract); ``store``: the store root as
    configured here (resolved)."""
    try:
        hexpart = digest_hex(digest)
    except ValueError as exc:
        raise CodeStoreError(str(exc)) from None
    real_store = Path(os.path.realpath(store))
    try:
        st = os.lstat(real_store)
    except FileNotFoundError:
        raise CodeStoreError(f"the version store {store} does not exist on this node (hot_update.versions_dir "
                             f"must name a folder every node sees)") from None
    _check_not_others_writable(real_store, st, "version store")
    expected = real_store / hexpart
    if not _names(store, path, expected):
        raise CodeStoreError(f"{path or '(no path)'} is not {expected}: a node runs only a version of its store "
                             f"({store}), in the folder named by the version's digest")
    if not os.path.lexists(expected):
        raise CodeStoreError(f"{expected} does not exist: the version is not in this node's store")
    return verify_tree(expected, digest)


def _names(store: Path, path: str, expected: Path) -> bool:
    """Whether ``path`` names the store folder ``expected`` (spelled under the configured or the resolved
    root, or leading there through links outside the store). A link at ``expected`` itself is caught by
    ``verify_tree``."""
    if not path:
        return False
    given = Path(os.path.abspath(path))
    return (given in (Path(os.path.abspath(store)) / expected.name, expected)
            or Path(os.path.realpath(path)) == expected)


class VerifiedVersions:
    """Versions verified on this node, so a version is re-hashed once per node, not once per restart: a
    cached one is re-hashed only when any entry's inode, mode, size, mtime or ctime changed."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self._verified: dict[tuple[Path, str], StoredVersion] = {}
        self.hashed = 0
        """How many times a tree was hashed (for the tests and the logs)."""

    def verify(self, digest: str, path: str) -> StoredVersion:
        """``verify_version``, cached; raises ``CodeStoreError``."""
        expected = Path(os.path.realpath(self.store)) / digest.removeprefix("sha256:")
        cached = self._verified.get((expected, digest))
        if cached is not None and _names(self.store, path, expected):
            try:
                if _fingerprint(expected)[1] == cached.fingerprint:
                    return cached
            except (OSError, CodeStoreError):
                pass
        self._verified.pop((expected, digest), None)
        self.hashed += 1
        version = verify_version(self.store, digest, path)
        self._verified[(expected, digest)] = version
        return version

"""Files that hold secrets: private folders (0700) and secret files (0600), owned by this user.

Contracts:

- ``ensure_private_dir(path)`` creates ``path`` (and missing parents) with mode 0700, or accepts an
  existing one only if it is a real folder (not a symbolic link) owned by this process's effective user.
  One that others may read but not write is made 0700 (logged); one others may write, or another user's,
  raises ``InsecurePathError`` naming the folder, what is wrong and how to fix it, and is left as it is.
- ``write_secret(path, data)`` writes atomically (a temporary file in the same folder, fsynced, renamed
  over ``path``) with mode 0600; the folder must pass ``ensure_private_dir``.
- ``read_secret(path)`` refuses a symbolic link, a file owned by someone else or one readable by group or
  others (``InsecurePathError``), and a missing file (``FileNotFoundError`` with the path).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


class InsecurePathError(PermissionError):
    """A folder or file meant to hold secrets is not private to this user; the message says why and how to fix."""


def _check_private(path: Path, st: os.stat_result, kind: str, allowed_mode: int) -> None:
    uid = os.geteuid()
    if st.st_uid != uid:
        raise InsecurePathError(f"{kind} {path} is owned by uid {st.st_uid}, not by this user (uid {uid}): refusing "
                                f"to trust it; remove it, or chown it to uid {uid}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & ~allowed_mode:
        raise InsecurePathError(f"{kind} {path} has mode {mode:04o}; secrets need {allowed_mode:04o} at most "
                                f"(chmod {allowed_mode:o} {path})")


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` 0700 (parents as needed) or check that the existing one is private; returns it."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise InsecurePathError(f"folder {path} is a symbolic link: refusing to keep secrets behind it")
    if not stat.S_ISDIR(st.st_mode):
        raise InsecurePathError(f"{path} is not a folder")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == os.geteuid() and mode & 0o077 and not mode & 0o022:
        # Ours, and others could only read it (a folder made before, or by `mkdir -p`): nobody else could
        # have put anything in it, so it is made private rather than refused.
        os.chmod(path, 0o700)
        log.warning("folder %s had mode %04o: made it 0700 (it holds secrets)", path, mode)
        st = os.lstat(path)
    _check_private(path, st, "folder", 0o700)
    return path


def write_secret(path: Path, data: bytes, *, private_parent: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically with mode 0600, in a private folder (``private_parent=False``: a
    folder that others may list but not write, such as a server's configuration folder); returns ``path``."""
    path = Path(path)
    if private_parent:
        ensure_private_dir(path.parent)
    else:
        st = os.lstat(path.parent)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
            raise InsecurePathError(f"folder {path.parent} is writable by others or not this user's: refusing to "
                                    f"keep the secret {path.name} there")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_secret(path: Path) -> bytes:
    """The bytes of secret file ``path``, after checking it is a private regular file of this user."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(f"secret file {path} does not exist") from None
    except OSError:
        if os.path.islink(path):
            raise InsecurePathError(f"secret file {path} is a symbolic link: refusing to follow it") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise InsecurePathError(f"secret file {path} is not a regular file")
        _check_private(path, st, "secret file", 0o600)
        return handle.read()

"""Files the node agent and its ranks share under predictable paths, trusted only when this user owns them.

The agent folder (``/tmp/keel-agent-<node>`` by default: its socket, the fault file, the restore plans)
and the slot folder (``/dev/shm/keel-<hash>``) live in world-writable places, where another local user
can create a path first: a folder of theirs, or a symbolic link to a file of ours. Contracts:

- ``ensure_owned_dir(path, hint)`` creates ``path`` with mode 0700 (missing parents with the default
  mode), or accepts an existing one only if it is a real folder (not a symbolic link) owned by this
  process's effective user and writable by nobody else; group or world *read* access on such a folder is
  taken away (chmod 0700: a folder of ours that nobody else could write into holds nothing planted).
  Anything else raises ``UntrustedPathError`` naming the path, its owner, what is wrong and how to fix it
  (``hint``: the caller's way out, e.g. another folder flag); nothing is changed then.
- ``open_owned(path, flags)`` opens without following a symbolic link (``O_NOFOLLOW | O_CLOEXEC``) and
  returns the descriptor only if it is a regular file owned by this user and writable by nobody else;
  otherwise it is closed and ``UntrustedPathError`` says why. ``FileNotFoundError`` passes through.
  With ``O_CREAT`` the file is created ``O_EXCL`` with ``mode`` (0600 unless told), so an existing path is
  never taken for a new file: the caller opens the existing one first and creates only when it is absent.
- ``read_owned_text(path)``: the text of such a file.

Root sees every file; the checks are the same for it (a root agent trusts only root's files).
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from pathlib import Path

__all__ = ["UntrustedPathError", "ensure_owned_dir", "open_owned", "read_owned_text", "user_name"]

_FOREIGN_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UntrustedPathError(PermissionError):
    """A shared node-local path is not this user's own (another owner, a symbolic link, writable by others)."""


def user_name(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` when the user has no name here."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _problem(path: Path, st: os.stat_result, kind: str, fix: str) -> str:
    """Why ``st`` (of ``path``, a ``kind``) cannot be trusted ('' when it can)."""
    me = os.geteuid()
    if st.st_uid != me:
        return (f"{kind} {path} is owned by {user_name(st.st_uid)}, not by this user, {user_name(me)}: someone else "
                f"created it, so nothing in it can be trusted. Remove it (as its owner or root) {fix}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & _FOREIGN_WRITE:
        return (f"{kind} {path} is writable by group or others (mode {mode:04o}), so anyone could have changed it: "
                f"`chmod go-w {path}` if you trust what is in it, or remove it, {fix}")
    return ""


def ensure_owned_dir(path: Path, hint: str = "and start again") -> Path:
    """Create ``path`` 0700, or check (and tighten) the existing folder; returns ``path``. See the module."""
    path = Path(path)
    if not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedPathError(f"folder {path} is a symbolic link (to {os.readlink(path)!r}), owned by "
                                 f"{user_name(st.st_uid)}: refusing to follow it. Remove the link {hint}")
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPathError(f"{path} is not a folder (owned by {user_name(st.st_uid)}). Remove it {hint}")
    problem = _problem(path, st, "folder", hint)
    if problem:
        raise UntrustedPathError(problem)
    if created or stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)  # a new folder under a lax umask too: no other user reads or reaches into it
    return path


def open_owned(path: Path | str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of ``path``, a regular file of this user that nobody else can write (see the module)."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    if flags & os.O_CREAT:
        flags |= os.O_EXCL
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedPathError(f"{path} is a symbolic link: refusing to follow it. Remove it and start "
                                     "again") from None
        raise
    try:
        st = os.fstat(fd)
        problem = "" if stat.S_ISREG(st.st_mode) else f"{path} is not a regular file. Remove it and start again"
        problem = problem or _problem(Path(path), st, "file", "and start again")
        if problem:
            raise UntrustedPathError(problem)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_owned_text(path: Path | str) -> str:
    """The UTF-8 text of ``path`` after ``open_owned``'s checks."""
    with os.fdopen(open_owned(path), encoding="utf-8") as handle:
        return handle.read()

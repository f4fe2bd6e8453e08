"""What a code version may look like (pure): its digest, its id, its place in the store, its entry point.

A version is named by its content: ``digest`` is ``sha256:`` and 64 lowercase hex digits, its directory in
the version store is the 64 hex digits, its id ``v-`` and the first 12. The entry point is the program a
rank runs inside the version: a relative ``*.py`` path inside it (no ``..``, no absolute path) or
``-m dotted.module`` of the version. These checks are shared by the hot-update service (a registration
that fails one is rejected) and the node agent (a restart naming such a version is refused before any rank
stops); the agent also re-hashes the stored tree (``keel.infra.code_store``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from pathlib import PurePosixPath

DIGEST_PREFIX = "sha256:"
_HEX = re.compile(r"[0-9a-f]{64}")


def digest_hex(digest: str) -> str:
    """The 64 hex digits of ``digest`` (``sha256:<hex>``); raises ``ValueError`` saying what is wrong."""
    hexpart = digest.removeprefix(DIGEST_PREFIX)
    if not digest.startswith(DIGEST_PREFIX) or not _HEX.fullmatch(hexpart):
        raise ValueError(f"digest {digest[:80]!r} is not sha256: followed by 64 lowercase hex digits")
    return hexpart


def version_id_of(digest: str) -> str:
    """``v-`` and the first 12 hex digits of the digest: the version's short, content-derived name."""
    return f"v-{digest.removeprefix(DIGEST_PREFIX)[:12]}"


def module_files(module: str) -> tuple[str, ...]:
    """The files inside a version that ``python -m module`` could run, in the order Python looks."""
    base = module.replace(".", "/")
    return f"{base}.py", f"{base}/__main__.py"


def entry_problem(entry: Sequence[str], files: Collection[str] | None = None) -> str:
    """Why ``entry`` may not be run, or "" when it may. ``files``: the version's files (relative POSIX
    paths); when given, the script or module must be one of them (nothing outside the version runs)."""
    if not entry:
        return "entry point: none given (a version names its program: a script path or -m MODULE)"
    if entry[0] == "-m":
        if len(entry) != 2 or not all(part.isidentifier() for part in entry[1].split(".")):
            return f"entry point: {' '.join(entry)[:200]!r} must be -m followed by one dotted module name"
        if files is not None and not any(name in files for name in module_files(entry[1])):
            return (f"entry point: -m {entry[1]} is not a module of the version (neither "
                    f"{' nor '.join(module_files(entry[1]))} is in it)")
        return ""
    script = entry[0]
    path = PurePosixPath(script)
    if (len(entry) != 1 or not script.endswith(".py") or path.is_absolute() or script.startswith(("-", "~"))
            or "\\" in script or any(part in ("", ".", "..") for part in script.split("/"))):
        return (f"entry point: {' '.join(entry)[:200]!r} must be one relative path to a *.py file inside the "
                f"version (no '..', no absolute path) or -m MODULE")
    if files is not None and script not in files:
        return f"entry point: {script} is not a file in the version"
    return ""


def registration_problem(version_id: str, digest: str, path: str, entry: Sequence[str]) -> str:
    """Why a registered version (its id, digest, stored path and entry point, as an event names them) is not
    one the store could hold, or "". Pure: whether the tree on disk hashes to ``digest`` is the agent's check."""
    try:
        hexpart = digest_hex(digest)
    except ValueError as exc:
        return f"store: {exc}"
    if version_id != version_id_of(digest):
        return f"store: version id {version_id[:80]!r} is not {version_id_of(digest)}, the one its digest names"
    if PurePosixPath(path).name != hexpart:
        return f"store: {path[:300]!r} is not a version store directory named by the digest ({hexpart})"
    return entry_problem(entry)

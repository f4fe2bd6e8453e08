"""The version store (I/O): snapshot code into ``<store>/<sha256>/``, validate it, describe it as an event.

A version is content-addressed: its digest is the SHA-256 over every file's relative path, executable bit
and bytes (sorted; ``__pycache__``, ``*.pyc`` and ``.git`` left out; ``keel.infra.code_store``), so the same
code deployed twice is the same version. A version holds regular files and folders only: a symbolic link,
a device or a FIFO anywhere in the source is refused with its path (a link to a secret is never copied into
the store). Published versions are read-only (files 0444/0555, folders 0555) in a store root writable by
its owner alone. Sources:

- a directory: copied as it is (without following links inside it);
- a wheel (``*.whl``): unpacked (a wheel is a zip whose root holds the top-level packages);
- a git revision (``REPO@REV``, or ``REV`` of the repository in the current directory): resolved to a
  commit with ``git rev-parse --verify --end-of-options`` (a revision starting with ``-`` is refused), then
  ``git archive`` of that commit.

Validation runs before anything is registered, in a fresh interpreter whose working directory and first
``sys.path`` entry is the version (as a rank would run it): the entry point must be a relative ``*.py``
file of the version or ``-m module`` of the version (``keel.rules.code.entry_problem``), its source must
compile, and every module it imports at module level must import. The entry point itself is not run (a
training script may start training when imported). A version failing any check is rejected with the
check's output and never reaches a rank. These checks are the deploying client's; the hot-update service
checks a registration's form again and every node re-hashes the stored version before it runs it.
"""

from __future__ import annotations

import io
import os
import re
import stat
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from keel.infra.code_store import (
    IGNORED_DIRS,
    CodeStoreError,
    copy_tree,
    ensure_store,
    publish,
    remove_tree,
    staging_dir,
    tree_digest,
    walk,
)
from keel.rules.code import entry_problem, version_id_of

__all__ = ["IGNORED_DIRS", "Snapshot", "VersionRejected", "default_entry", "snapshot", "tree_digest", "validate",
           "version_id_of"]

_COMMIT = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")


class VersionRejected(Exception):
    """The deploy cannot become a version: ``reason`` says which check failed."""

    def __init__(self, reason: str, *, digest: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.digest = digest


@dataclass(frozen=True)
class Snapshot:
    digest: str
    path: Path
    source: str
    source_kind: str

    @property
    def version_id(self) -> str:
        return version_id_of(self.digest)


def snapshot(source: str, store: Path, *, cwd: Path | None = None) -> Snapshot:
    """Copy ``source`` into the store (once per content, read-only) and return where it lies."""
    try:
        root = ensure_store(store)
    except (CodeStoreError, OSError) as exc:
        raise VersionRejected(f"store: {exc}") from None
    staging = staging_dir(root)
    try:
        kind = _stage(source, staging, cwd or Path.cwd())
        if not any(staging.iterdir()):
            raise VersionRejected(f"exists: {source} holds no files")
        digest, final = publish(staging, root)
        return Snapshot(digest=digest, path=final, source=source, source_kind=kind)
    except CodeStoreError as exc:
        raise VersionRejected(f"exists: {source}: {exc}") from None
    finally:
        remove_tree(staging)


def _stage(source: str, staging: Path, cwd: Path) -> str:
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = cwd / path
    if path.is_dir():  # the source itself may be a link the user named; links inside it are refused
        copy_tree(Path(os.path.realpath(path)), staging)
        return "directory"
    if path.is_file() and path.suffix == ".whl":
        try:
            with zipfile.ZipFile(path) as wheel:
                for info in wheel.infolist():
                    name = Path(info.filename)
                    if name.is_absolute() or ".." in name.parts:
                        raise VersionRejected(f"exists: wheel {source} has an unsafe member {info.filename!r}")
                wheel.extractall(staging)
        except zipfile.BadZipFile as exc:
            raise VersionRejected(f"exists: {source} is not a wheel ({exc})") from None
        return "wheel"
    if path.exists():
        raise VersionRejected(f"exists: {source} is neither a directory nor a wheel (*.whl)")
    repo, _, rev = source.rpartition("@") if "@" in source else (str(cwd), "", source)
    if not rev or rev.startswith("-"):
        raise VersionRejected(f"exists: git revision {rev!r} of {source} is not a revision (a revision never "
                              f"starts with '-' and is not empty)")
    repo_path = Path(repo).expanduser()
    if not repo_path.is_absolute():
        repo_path = cwd / repo_path
    commit = _git(source, repo_path, ["rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"])
    sha = commit.decode(errors="replace").strip()
    if not _COMMIT.fullmatch(sha):
        raise VersionRejected(f"exists: {source}: git named {sha[:80]!r} for {rev!r}, not a commit")
    archive = _git(source, repo_path, ["archive", "--format=tar", sha])
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(staging, filter="data")
    return "git"


def _git(source: str, repo: Path, arguments: list[str]) -> bytes:
    try:
        result = subprocess.run(["git", "-C", str(repo), *arguments], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VersionRejected(f"exists: {source}: git {arguments[0]} failed ({exc})") from None
    if result.returncode != 0:
        why = result.stderr.decode(errors="replace").strip()[-300:] or f"git {arguments[0]} found no such commit"
        raise VersionRejected(f"exists: {source} is not a directory, a wheel or a git revision ({why})")
    return result.stdout


# What runs in the validating interpreter: resolve the entry point inside the version, compile it, and
# import every module it imports at module level (absolute, or relative to its package).
_CHECK = r'''
import ast, importlib, importlib.util, os, sys
root, kind, target = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, root)
package = None
if kind == "module":
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError) as exc:
        spec, why = None, repr(exc)
    else:
        why = "not found"
    if spec is not None and spec.submodule_search_locations is not None:
        package = target
        spec = importlib.util.find_spec(target + ".__main__")
        why = "a package without __main__"
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        print(f"entry point: -m {target} does not resolve in the version ({why})", file=sys.stderr)
        sys.exit(3)
    path = spec.origin
    package = package or (target.rpartition(".")[0] or None)
else:
    path = os.path.join(root, target)
    if not os.path.isfile(path):
        print(f"entry point: {target} is not a file in the version", file=sys.stderr)
        sys.exit(3)
source = open(path, "rb").read()
try:
    tree = ast.parse(source, path)
    compile(tree, path, "exec")
except SyntaxError as exc:
    print(f"imports: {target} does not compile: {exc}", file=sys.stderr)
    sys.exit(4)
names = []
def visit(nodes):
    for node in nodes:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if not package:
                    continue
                base = importlib.util.resolve_name("." * node.level + base, package)
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []) or []:
                    visit(getattr(child, "body", None) if isinstance(child, ast.ExceptHandler) else [child])
visit(tree.body)
failed = []
for name in dict.fromkeys(n for n in names if n):
    parent, _, attribute = name.rpartition(".")
    try:
        if parent and parent in sys.modules and hasattr(sys.modules[parent], attribute):
            continue  # "from module import name": a name defined in the module, not a submodule
        importlib.import_module(name)
    except BaseException as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
if failed:
    print("imports: " + "; ".join(failed), file=sys.stderr)
    sys.exit(5)
print(f"imports: {len(names)} module(s) imported")
'''


def validate(path: Path, entry: list[str], *, python: str = sys.executable,
             timeout: timedelta = timedelta(seconds=120)) -> list[str]:
    """Check a snapshot; the checks passed, in order. Raises ``VersionRejected`` with the failing check."""
    try:
        files = frozenset(rel for rel, st in walk(path) if not stat.S_ISDIR(st.st_mode))
    except CodeStoreError as exc:
        raise VersionRejected(f"exists: {exc}") from None
    problem = entry_problem(entry, files)
    if problem:
        raise VersionRejected(problem if entry else f"{problem}; the version has no train.py")
    kind, target = ("module", entry[1]) if entry[0] == "-m" else ("script", entry[0])
    # No bytecode written next to the sources: a stored version holds nothing its digest leaves out.
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(path), os.environ.get("PYTHONPATH", ""))))}
    try:
        result = subprocess.run([python, "-c", _CHECK, str(path), kind, target], cwd=path, env=env,
                                capture_output=True, text=True, timeout=timeout.total_seconds())
    except subprocess.TimeoutExpired:
        raise VersionRejected(f"imports: validating {' '.join(entry)} took over {timeout.total_seconds():g} s") from None
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        raise VersionRejected(lines[-1][-1000:] if lines else f"validation exited with {result.returncode}")
    return ["exists", f"entry point {' '.join(entry)} resolves", result.stdout.strip() or "imports"]


def default_entry(path: Path) -> list[str]:
    return ["train.py"] if (path / "train.py").is_file() else []

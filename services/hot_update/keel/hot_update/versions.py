"""The version store (I/O): snapshot code into ``<store>/<sha256>/``, validate it, describe it as an event.

A version is content-addressed: its digest is the SHA-256 over every file's relative path, executable bit
and bytes (sorted; ``__pycache__``, ``*.pyc`` and ``.git`` left out), so the same code deployed twice is
the same version. Sources:

- a directory: copied as it is;
- a wheel (``*.whl``): unpacked (a wheel is a zip whose root holds the top-level packages);
- a git revision (``REPO@REV``, or ``REV`` of the repository in the current directory): ``git archive``.

Validation runs before anything is registered, in a fresh interpreter whose working directory and first
``sys.path`` entry is the version (as a rank would run it): the entry point must resolve (a script inside
the version, or ``-m module`` importable from it), its source must compile, and every module it imports at
module level must import. The entry point itself is not run (a training script may start training when
imported). A version failing any check is rejected with the check's output and never reaches a rank.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

IGNORED_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn", ".mypy_cache", ".pytest_cache"})


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


def version_id_of(digest: str) -> str:
    return f"v-{digest.removeprefix('sha256:')[:12]}"


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(_files(root)):
        rel = path.relative_to(root).as_posix()
        executable = os.access(path, os.X_OK)
        h.update(f"{rel}\0{int(executable)}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                h.update(chunk)
    return f"sha256:{h.hexdigest()}"


def _files(root: Path) -> list[Path]:
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in IGNORED_DIRS)
        for name in files:
            if not name.endswith(".pyc"):
                path = Path(directory) / name
                if path.is_file():
                    found.append(path)
    return found


def snapshot(source: str, store: Path, *, cwd: Path | None = None) -> Snapshot:
    """Copy ``source`` into the store (once per content) and return where it lies."""
    store.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=store))
    try:
        kind = _stage(source, staging, cwd or Path.cwd())
        if not any(staging.iterdir()):
            raise VersionRejected(f"exists: {source} holds no files")
        digest = tree_digest(staging)
        final = store / digest.removeprefix("sha256:")
        if not final.exists():
            for path in [staging, *staging.rglob("*")]:  # read-only to the job: a version never changes
                if path.is_dir():
                    path.chmod(0o755)
                elif path.is_file():
                    path.chmod(0o755 if os.access(path, os.X_OK) else 0o644)
            try:
                staging.rename(final)
            except OSError:
                if not final.exists():  # not a concurrent deploy of the same content
                    raise
        return Snapshot(digest=digest, path=final, source=source, source_kind=kind)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _stage(source: str, staging: Path, cwd: Path) -> str:
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = cwd / path
    if path.is_dir():
        for file in _files(path):
            target = staging / file.relative_to(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, target)
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
    repo_path = Path(repo).expanduser()
    if not repo_path.is_absolute():
        repo_path = cwd / repo_path
    try:
        archive = subprocess.run(["git", "-C", str(repo_path), "archive", "--format=tar", f"{rev}^{{commit}}"],
                                 capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VersionRejected(f"exists: {source}: git archive failed ({exc})") from None
    if archive.returncode != 0:
        raise VersionRejected(f"exists: {source} is not a directory, a wheel or a git revision "
                              f"({archive.stderr.decode(errors='replace').strip()[-300:]})")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(staging, filter="data")
    return "git"


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
    if not entry:
        raise VersionRejected("entry point: none given and the version has no train.py")
    if entry[0] == "-m":
        if len(entry) != 2 or not entry[1]:
            raise VersionRejected(f"entry point: {' '.join(entry)!r} must be -m MODULE")
        kind, target = "module", entry[1]
    else:
        if len(entry) != 1 or Path(entry[0]).is_absolute() or ".." in Path(entry[0]).parts:
            raise VersionRejected(f"entry point: {entry[0]!r} must be a script path inside the version")
        kind, target = "script", entry[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(path), os.environ.get("PYTHONPATH", ""))))}
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

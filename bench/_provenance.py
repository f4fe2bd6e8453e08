"""Where a benchmark's figures came from: the code, the machine and the command, recorded with them.

A figure without these cannot be checked: ``commit`` (``-dirty`` when tracked files differ from it, so a
figure taken on uncommitted code says so), ``date`` (UTC), ``cores`` and ``cpu_model`` (the first
``model name`` of ``/proc/cpuinfo``: two runs on different CPUs are not comparable), the ``python`` and
``torch`` versions, and ``command``: the exact command line, to run it again.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's ``model name`` ("unknown" where /proc/cpuinfo has none, e.g. some ARM kernels)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def provenance(argv: list[str], module: str) -> dict[str, Any]:
    """The provenance fields of a results file; ``argv`` the arguments after ``python -m module``."""
    commit = _git("rev-parse", "HEAD") or "unknown"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "commit": commit + ("-dirty" if dirty else ""),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "command": shlex.join(["python", "-m", module, *argv]),
    }

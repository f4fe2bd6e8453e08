"""Every reference in the code and the docs points at something that exists.

Scanned: the repository's ``.py`` and ``.md`` files (not the virtual environment, build outputs or
caches). Checked:

- repo-relative paths under ``docs/``, ``libs/``, ``services/``, ``bench/``, ``tests/``, ``infra/``,
  ``proto/`` and ``migrations/`` (``libs/infra/keel/infra/config.py``, ``docs/events.md``). A path with a
  placeholder segment (``services/<name>/``, ``tests/golden/{name}/v{version}.json``) needs the part
  before the placeholder to exist; a glob (``tests/unit/test_analyzer_*.py``) must match something.
  Only what benchmarks write (``bench/results/``, ignored by git) may be absent;
- Markdown links (``[text](target#anchor)``) in ``.md`` files, resolved from the linking file, anchors
  included (GitHub's heading slugs);
- module references in backticks (```keel.agent.warm```, ``keel.actuator.core.Actuator``): the package
  must exist, then each further name must be a module or a name the module defines;
- root documents named bare (``ARCHITECTURE.md``, ``CONVENTIONS.md``): they must exist at the root or
  beside the file that names them;
- nothing names the workspace outside the repository (its sibling folder of design notes, the
  workspace's absolute paths).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SKIPPED_DIRS = {".git", ".venv", "venv", "build", "dist", "node_modules", "__pycache__", ".pytest_cache",
                 ".mypy_cache", ".ruff_cache"}

# A repo-relative path: a known top-level folder, then path characters (placeholders and globs
# included), ending on a name character, a closing placeholder or a slash. The look-behind keeps
# `keel/infra/config.py` inside `libs/infra/keel/infra/config.py`, or `events/s`, from matching alone.
_PATH = re.compile(r"(?<![\w./<>{}*$-])(?:docs|libs|services|bench|tests|infra|proto|migrations)/"
                   r"[\w./<>{}*-]*[\w>}*/]")
_PLACEHOLDER = re.compile(r"[<{]")
_GENERATED = ("bench/results/",)
"""Written by the benchmarks (`make bench*`) and ignored by git: named by the docs, absent from a checkout."""

_LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")
_MODULE = re.compile(r"`{1,2}(keel(?:\.[A-Za-z_]\w*)+)(?:\(\))?`{1,2}")
_ROOT_DOC = re.compile(r"(?<![\w./-])([A-Z][A-Z0-9_-]*\.md)\b")

KNOWN_STALE: dict[str, set[str]] = {}
"""Files allowed to cite a missing document while a change is in flight (none now)."""


@cache
def _all_files() -> tuple[Path, ...]:
    found = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.endswith(".egg-info"))
        found += [Path(folder) / name for name in sorted(names)]
    return tuple(found)


def _files(*suffixes: str) -> Iterator[Path]:
    """The repository's files with these suffixes, except this test's own (its examples are stale on purpose)."""
    this = Path(__file__).resolve()
    return (path for path in _all_files() if path.suffix in suffixes and path != this)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _path_problem(reference: str) -> str | None:
    """Why ``reference`` (a repo-relative path as written) points at nothing, or None."""
    if reference.startswith(_GENERATED):
        return None
    placeholder = _PLACEHOLDER.search(reference)
    if placeholder:
        prefix = reference[: placeholder.start()].rpartition("/")[0]
        return None if (ROOT / prefix).is_dir() else f"{reference}: no folder {prefix}/"
    if "*" in reference:
        return None if any(ROOT.glob(reference.rstrip("/"))) else f"{reference}: the glob matches nothing"
    return None if (ROOT / reference.rstrip("/")).exists() else f"{reference}: no such file or folder"


def test_repo_relative_paths_exist() -> None:
    problems = []
    for path in _files(".py", ".md"):
        for line_number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in _PATH.finditer(line):
                problem = _path_problem(match.group(0).rstrip("."))
                if problem:
                    problems.append(f"{_rel(path)}:{line_number}: {problem}")
    assert not problems, "stale paths:\n" + "\n".join(problems)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]{2,}|`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def _anchors(page: Path) -> frozenset[str]:
    anchors, seen = set(), dict[str, int]()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            slug = _slug(line.lstrip("#"))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(anchors)


def _link_problem(page: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    file_part, _, anchor = target.partition("#")
    linked = (page.parent / file_part).resolve() if file_part else page
    if not linked.exists():
        return f"{target}: no such file"
    if ROOT not in linked.parents and linked != ROOT:
        return f"{target}: outside the repository"
    if anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
        return f"{target}: no heading #{anchor} in {_rel(linked)}"
    return None


def test_markdown_links_resolve() -> None:
    problems = []
    for page in _files(".md"):
        in_code = False
        for line_number, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_code = not in_code
                continue
            if in_code:
                continue
            for match in _LINK.finditer(line):
                problem = _link_problem(page, match.group(1))
                if problem:
                    problems.append(f"{_rel(page)}:{line_number}: {problem}")
    assert not problems, "broken links:\n" + "\n".join(problems)


@cache
def _packages() -> dict[str, Path]:
    """``keel.<x>`` -> its folder, for every distribution (``libs/*``, ``services/*``, ``migrations``)."""
    folders = [*ROOT.glob("libs/*/keel/*"), *ROOT.glob("services/*/keel/*"), *ROOT.glob("migrations/keel/*")]
    return {folder.name: folder for folder in folders if (folder / "__init__.py").exists()}


def _defines(source: Path, name: str) -> bool:
    text = source.read_text()
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*(?:from\s+\S+\s+)?"
                     rf"import\s[^\n]*\b{name}\b|^\s*\"{name}\"", text, re.M) is not None


def _module_problem(reference: str) -> str | None:
    parts = reference.split(".")
    folder = _packages().get(parts[1])
    if folder is None:
        return f"{reference}: no package keel.{parts[1]}"
    node, index = folder, 2
    while index < len(parts):
        if (node / parts[index] / "__init__.py").exists():
            node = node / parts[index]
        elif (node / f"{parts[index]}.py").exists():
            node = node / f"{parts[index]}.py"
        else:
            break
        index += 1
        if node.suffix == ".py":
            break
    if index == len(parts):
        return None
    if re.fullmatch(r"v\d+", parts[index]):  # a protobuf package (keel.agent.v1.RankReport), not a module
        return None
    source = node / "__init__.py" if node.is_dir() else node
    if _defines(source, parts[index]):
        return None
    return f"{reference}: {_rel(source)} has no {parts[index]}"


def test_module_references_resolve() -> None:
    problems = []
    for path in _files(".py", ".md"):
        for line_number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in _MODULE.finditer(line):
                problem = _module_problem(match.group(1))
                if problem:
                    problems.append(f"{_rel(path)}:{line_number}: {problem}")
    assert not problems, "stale module references:\n" + "\n".join(problems)


def test_bare_document_names_exist() -> None:
    problems = []
    for path in _files(".py", ".md"):
        known = KNOWN_STALE.get(_rel(path), set())
        for line_number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in _ROOT_DOC.finditer(line):
                name = match.group(1)
                if name in known or (ROOT / name).exists() or (path.parent / name).exists():
                    continue
                problems.append(f"{_rel(path)}:{line_number}: {name}: not at the repository root")
    assert not problems, "missing documents:\n" + "\n".join(problems)


# The workspace's sibling folder of design notes, spelled in parts so this file does not name it itself.
_SIBLING = "sha" + "red"
_OUTSIDE = re.compile(rf"\.\./{_SIBLING}\b|(?<![\w.-]){_SIBLING}/(?:seeds|hooks)\b|/work/(?:{_SIBLING}|main)\b")


def test_nothing_outside_the_repository_is_named() -> None:
    """The project stands alone: no reference to the workspace it was built in (its sibling folder of
    design notes, the workspace's absolute paths)."""
    problems = [f"{_rel(path)}:{number}: {match.group(0)}"
                for path in _files(".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".ini")
                for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
                for match in _OUTSIDE.finditer(line)]
    assert not problems, "references outside the repository:\n" + "\n".join(problems)


@pytest.mark.parametrize("reference", ["libs/core/keel/core/bus.py", "docs/nothing.md", "services/agent/nope/",
                                       "tests/unit/test_nothing_*.py", "libs/nope/<name>/x.py"])
def test_a_stale_path_is_reported(reference: str) -> None:
    assert _path_problem(reference) is not None


@pytest.mark.parametrize("reference", ["libs/infra/keel/infra/config.py", "services/<name>/", "docs/",
                                       "tests/golden/{name}/v{version}.json", "tests/unit/test_*.py",
                                       "bench/results/bus.json"])
def test_a_live_path_is_accepted(reference: str) -> None:
    assert _path_problem(reference) is None


def test_stale_module_references_are_reported() -> None:
    assert _module_problem("keel.core.bus") is not None
    assert _module_problem("keel.agent.nothing_here") is not None
    assert _module_problem("keel.actuator.core.NoSuchActuator") is not None
    assert _module_problem("keel.actuator.core.Actuator") is None
    assert _module_problem("keel.agent.warm") is None
    assert _module_problem("keel.agent.inspector.policy") is None


def test_a_broken_link_or_anchor_is_reported() -> None:
    page = ROOT / "docs" / "architecture.md"
    assert _link_problem(page, "events.md#the-envelope") is None
    assert _link_problem(page, "events.md#no-such-heading") is not None
    assert _link_problem(page, "nothing.md") is not None
    assert _link_problem(page, f"../../{_SIBLING}/ARCHITECTURE.md") is not None

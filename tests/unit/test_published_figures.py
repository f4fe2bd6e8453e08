"""Every figure the README and docs/benchmarks.md publish comes from a committed result file.

A table of figures is preceded by a marker naming its file, ``<!-- results: bench/results/NAME.json -->``
(several files: comma-separated; ``PATH@COMMIT`` names a file as an earlier commit holds it, for a run
quoted beside the latest). The test fails when a table in docs/benchmarks.md has no marker, when the
file is missing or lacks its provenance (commit, date, cores, CPU model, command), or when a number in the
table (any cell but the first, which names the row) is not a value of the file as printed: rounded to the
digits shown, as a percentage, in milliseconds or in minutes (targets, after ≤ or ≥, are goals and exempt). The README's headline rows name their file in the last
column; the same holds for them."""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*results:\s*(.+?)\s*-->")
NUMBER = re.compile(r"(?<![\w.`/-])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(?![\w`])")
PROVENANCE = ("commit", "date", "cores", "command")


def tables(text: str) -> Iterator[tuple[int, list[str], list[str]]]:
    """(line number, the result files its marker names or [], the table's rows) for each markdown table."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|"):
            start = i
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(lines[i])
                i += 1
            files: list[str] = []
            for back in range(start - 1, max(-1, start - 4), -1):  # the marker sits just above, blank lines allowed
                if match := MARKER.search(lines[back]):
                    files = [f.strip() for f in match.group(1).split(",")]
                    break
                if lines[back].strip():
                    break
            yield start + 1, files, rows
        else:
            i += 1


def leaves(value: Any) -> Iterator[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        if math.isfinite(value):
            yield float(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            if re.fullmatch(r"\d+(\.\d+)?", str(key)):  # a figure keyed by a size or a window: the key is one too
                yield float(key)
            yield from leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from leaves(item)


def shown_as(value: float, text: str) -> bool:
    """Whether ``value`` printed with the digits of ``text`` (a number as published) reads ``text``."""
    shown = float(text.replace(",", ""))
    digits = len(text.split(".")[1]) if "." in text else 0
    tolerance = 0.5 * 10 ** -digits + 1e-9
    return any(abs(abs(candidate) - shown) <= tolerance for candidate in (value, value * 100, value * 1000, value / 60))


def numbers(row: str) -> list[str]:
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    found = []
    for cell in cells[1:]:
        cell = re.sub(r"`[^`]*`", "", cell)  # code (commands, file names) is not a figure
        cell = re.sub(r"[≤≥<>]=?\s*[\d.,]+", "", cell)  # a target is a goal, not a measurement
        found += NUMBER.findall(cell)
    return found


def check(rows: list[str], files: list[str], where: str) -> list[str]:
    values: list[float] = []
    problems = []
    for name in files:
        path, _, commit = name.partition("@")
        if commit:
            shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True, text=True)
            if shown.returncode != 0:
                problems.append(f"{where}: {name}: no such file at that commit ({shown.stderr.strip()[:100]})")
                continue
            data = json.loads(shown.stdout)
        elif not (REPO / path).is_file():
            problems.append(f"{where}: {name} does not exist")
            continue
        else:
            data = json.loads((REPO / path).read_text())
        stamped = data.get("provenance", data)  # some benches nest it
        missing = [key for key in PROVENANCE if not stamped.get(key)]
        if missing:
            problems.append(f"{where}: {name} lacks its provenance {missing}")
        values += list(leaves(data))
    if problems:
        return problems
    for row in rows[2:]:  # the header and the separator name no figures
        for text in numbers(row):
            if not any(shown_as(v, text) for v in values):
                problems.append(f"{where}: {text} in {row.strip()[:100]!r} is in none of {files}")
    return problems


def test_every_benchmarks_table_names_its_result_file_and_matches_it() -> None:
    text = (REPO / "docs/benchmarks.md").read_text()
    problems = []
    for line, files, rows in tables(text):
        if not any(numbers(row) for row in rows[2:]):
            continue  # a table of commands or names, no figures
        if not files:
            problems.append(f"docs/benchmarks.md:{line}: a table of figures without a <!-- results: ... --> marker")
            continue
        problems += check(rows, files, f"docs/benchmarks.md:{line}")
    assert not problems, "\n".join(problems)


def test_the_readme_headline_rows_match_their_result_files() -> None:
    text = (REPO / "README.md").read_text()
    headline = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    problems = []
    for _, _, rows in tables(headline):
        for row in rows[2:]:
            files = re.findall(r"`(bench/results/[^`]+\.json)`", row.split("|")[-2])
            if not files:
                problems.append(f"README headline row without a result file: {row.strip()[:100]!r}")
                continue
            problems += check(["", "", "|".join(row.split("|")[:-2]) + "|"], files, f"README:{row.strip()[:40]!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("value", "text", "ok"), [
    (0.0812, "0.08", True), (0.0812, "0.09", False), (1474.0, "1,474", True), (0.957, "95.7", True),
    (12.0, "12", True), (12.6, "12", False), (600.0, "10", True),
])
def test_a_number_matches_only_as_printed(value: float, text: str, ok: bool) -> None:
    assert shown_as(value, text) is ok

"""docs/cli.md has a section for every `keel` command and subcommand, read from `keel --help` itself
(through the console script's entry point, ``keel.cli.main:main``, so the test does not depend on how
the CLI's modules are laid out)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from keel.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cli.md"


def _subcommands(capsys: pytest.CaptureFixture[str], *words: str) -> list[str]:
    """The subcommands `keel WORDS --help` lists (`{a,b,c} ...` in its usage), none for a leaf command."""
    with pytest.raises(SystemExit):
        main([*words, "--help"])
    usage = capsys.readouterr().out.split("\n\n", 1)[0]
    match = re.search(r"\{([\w,-]+)\}\s+\.\.\.", usage)
    return match.group(1).split(",") if match else []


def test_every_command_has_a_section(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    headings = set(re.findall(r"^#{2,4} (keel [\w -]+?)\s*$", PAGE.read_text(), re.M))
    commands = _subcommands(capsys)
    assert "run" in commands and "inject" in commands and "service" in commands
    missing = []
    for command in commands:
        # `keel run` hands everything after it to the launcher: its help is the agent's (no subcommands).
        nested = [] if command == "run" else _subcommands(capsys, command)
        names = [f"keel {command} {sub}" for sub in nested] or [f"keel {command}"]
        missing += [name for name in names if name not in headings]
    assert not missing, f"docs/cli.md has no section for: {', '.join(missing)}"

"""docs/configuration.md is generated from the settings models (``keel.infra.config_docs``): it must be
what the generator produces now, and every setting must be documented."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from keel.infra.config import Settings
from keel.infra.config_docs import main, render

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"


def test_checked_in_configuration_page_is_up_to_date() -> None:
    assert PAGE.read_text() == render(), "docs/configuration.md is stale: run `make config-docs`"


def test_every_section_and_field_is_on_the_page_with_its_environment_variable() -> None:
    text = render()

    def section(name: str, model: type[BaseModel]) -> None:
        assert model.__doc__, f"settings section {model.__name__} has no docstring"
        assert f"## `{name}`" in text
        for field, field_info in model.model_fields.items():
            assert field_info.description, f"{name}.{field} has no description"
            inner = field_info.annotation
            if isinstance(inner, type) and issubclass(inner, BaseModel):  # a section in a section: its own table
                section(f"{name}.{field}", inner)
                continue
            assert f"| `{name}.{field}` |" in text
            assert "`KEEL_" + "__".join(f"{name}.{field}".upper().split(".")) + "`" in text

    for name, info in Settings.model_fields.items():
        model = info.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            section(name, model)
        else:
            assert info.description, f"Settings.{name} has no description"
            assert f"| `{name}` |" in text
    assert "`KEEL_ACTUATOR__SLURM__STANDBY_COMMAND`" in text


def test_defaults_carry_their_units() -> None:
    text = render()
    assert "| `bus.max_age` | duration | `7d` |" in text
    assert "| `bus.max_event_bytes` | size | `256KiB` |" in text
    assert "| `checkpoint.backup_min_period` | duration | `500ms` |" in text
    assert "| `home` | path | see description | `KEEL_HOME` |" in text


def test_check_mode_fails_on_a_hand_edited_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "configuration.md"
    assert main(["--write", str(page)]) == 0
    assert main(["--check", str(page)]) == 0
    page.write_text(page.read_text().replace("`7d`", "`3d`"))
    assert main(["--check", str(page)]) == 1
    assert "make config-docs" in capsys.readouterr().err

from __future__ import annotations

from keel.events.catalogue import CATALOGUE_PATH, build_catalogue, render
from keel.events.envelope import REGISTRY


def test_checked_in_catalogue_is_up_to_date() -> None:
    assert CATALOGUE_PATH.read_text() == render(build_catalogue()), "run `keel events schema --write`"


def test_catalogue_lists_every_type_with_its_current_version() -> None:
    catalogue = build_catalogue()
    assert sorted(catalogue["types"]) == REGISTRY.names()
    health = catalogue["types"]["NodeHealthChanged"]
    assert health["current_version"] == 2 and health["older_versions"] == [1]
    assert health["schema"]["properties"]["schema_version"] == {"const": 2}
    assert "is_fatal" in health["schema"]["properties"]["payload"]["properties"]

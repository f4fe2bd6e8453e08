"""The compose runner the compose scenario brings docker-compose.yml up with (``tests/compose_podman.py``):
its reading of the file, checked without podman."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compose_podman import ComposeError, ComposeProject, duration_s, interpolate

REPO = Path(__file__).resolve().parents[2]


def test_variables_are_substituted_as_compose_does() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET}/${UNSET}/$${SET}", env) == "x//${SET}"
    assert interpolate("${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} ${SET:-d}", env) == "d d  x"
    assert interpolate({"a": ["${SET}", 3]}, env) == {"a": ["x", 3]}


def test_durations() -> None:
    assert duration_s("1m30s", 0) == 90 and duration_s("500ms", 0) == 0.5 and duration_s(None, 7) == 7
    with pytest.raises(ComposeError):
        duration_s("5 seconds", 0)


def test_keels_compose_file_starts_every_dependency_before_its_dependents() -> None:
    project = ComposeProject(REPO / "docker-compose.yml", "p", {"KEEL_IMAGE": "img"})
    order = project.order()
    for name in order:
        for dependency in project._depends_on(name):
            assert order.index(dependency) < order.index(name), (dependency, name)
    # Every service `keel up` starts is in the file, from the image the variable names.
    assert {"recorder", "controller", "checkpoint-broker", "actuator", "analyzer", "hot-update"} <= set(order)
    assert project.spec["services"]["actuator"]["image"] == "img"
    assert project._depends_on("migrate") == {"credentials": "service_completed_successfully",
                                              "nats": "service_healthy", "postgres": "service_healthy"}


def test_a_key_the_runner_does_not_honour_fails_instead_of_being_ignored(tmp_path: Path) -> None:
    compose = tmp_path / "compose.yml"
    compose.write_text("services:\n  a:\n    image: x\n    cap_add: [SYS_PTRACE]\n")
    with pytest.raises(ComposeError, match="cap_add"):
        ComposeProject(compose, "p", {})
    compose.write_text("services:\n  a:\n    image: x\n    depends_on: [b]\n  b:\n    image: x\n    depends_on: [a]\n")
    with pytest.raises(ComposeError, match="cycle"):
        ComposeProject(compose, "p", {}).order()

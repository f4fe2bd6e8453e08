"""``keel deploy``'s snapshot and validation with real files, git and interpreters: a version that does not
exist, does not import or has no entry point is rejected (an event saying why) and never registered."""

from __future__ import annotations

import subprocess
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keel.cli.versions import deploy_event, summarise
from keel.events.types import CodeVersionRegistered, CodeVersionRejected
from keel.hot_update.versions import VersionRejected, snapshot, tree_digest, validate
from keel.infra.config import Settings

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home")


def deploy(settings: Settings, source: str | Path, entry: list[str] | None = None, mode: str = "lazy"):  # type: ignore[no-untyped-def]
    return deploy_event(settings, "job1", str(source), entry=entry, mode=mode, deadline=None, by="ana", why="test",
                        now=NOW)


def test_a_directory_is_snapshotted_content_addressed_validated_and_registered(settings: Settings, tmp_path: Path) -> None:
    src = write(tmp_path / "src", {"train.py": "import json\nimport helpers\nprint('hi')\n",
                                   "helpers.py": "VALUE = 1\n", "__pycache__/x.pyc": "junk"})
    event = deploy(settings, src)
    p = event.payload
    assert isinstance(p, CodeVersionRegistered), p
    assert p.entry == ["train.py"] and p.source_kind == "directory" and p.mode == "lazy"
    assert p.deadline == NOW + timedelta(hours=24)  # the default deadline
    assert Path(p.path).parent == settings.home / "versions" and Path(p.path).name == p.digest.removeprefix("sha256:")
    assert sorted(f.name for f in Path(p.path).iterdir()) == ["helpers.py", "train.py"]
    assert p.version_id == f"v-{p.digest.removeprefix('sha256:')[:12]}" and event.subject == f"code/{p.version_id}"
    assert any("imports" in c for c in p.checks)
    # The same content is the same version; a one-byte change is another.
    assert deploy(settings, src).payload.digest == p.digest
    (src / "helpers.py").write_text("VALUE = 2\n")
    assert deploy(settings, src).payload.digest != p.digest
    # The snapshot does not follow later edits of the source.
    assert (Path(p.path) / "helpers.py").read_text() == "VALUE = 1\n"
    assert tree_digest(Path(p.path)) == p.digest


@pytest.mark.parametrize("files, entry, reason", [
    ({"train.py": "import no_such_module_k7\n"}, None, "imports: no_such_module_k7: ModuleNotFoundError"),
    ({"train.py": "def broken(:\n"}, None, "does not compile"),
    ({"model.py": "X = 1\n"}, None, "entry point: none given"),
    ({"model.py": "X = 1\n"}, ["run.py"], "entry point: run.py is not a file in the version"),
    ({"model.py": "X = 1\n"}, ["-m", "trainer"], "entry point: -m trainer is not a module of the version"),
    ({"pkg/__init__.py": ""}, ["-m", "pkg"], "neither pkg.py nor pkg/__main__.py"),
    ({"pkg/__init__.py": "", "pkg/__main__.py": "from . import missing_k7\n"}, ["-m", "pkg"], "pkg.missing_k7"),
    ({"train.py": "import json\ntry:\n    import gone_k7\nexcept ImportError:\n    raise\n"}, None, "gone_k7"),
])
def test_a_version_that_does_not_import_or_has_no_entry_point_is_rejected(
        settings: Settings, tmp_path: Path, files: dict[str, str], entry: list[str] | None, reason: str) -> None:
    event = deploy(settings, write(tmp_path / "src", files), entry=entry)
    assert isinstance(event.payload, CodeVersionRejected), event.payload
    assert reason in event.payload.reason, event.payload.reason
    assert event.payload.by == "ana" and event.payload.digest  # it existed: the digest says what was refused


def test_a_source_that_does_not_exist_is_rejected(settings: Settings, tmp_path: Path) -> None:
    event = deploy(settings, tmp_path / "nowhere")
    assert isinstance(event.payload, CodeVersionRejected)
    assert event.payload.reason.startswith("exists:") and "not a directory, a wheel or a git revision" in event.payload.reason
    assert event.subject == "code/rejected"
    not_a_wheel = tmp_path / "notes.txt"
    not_a_wheel.write_text("x")
    assert "neither a directory nor a wheel" in deploy(settings, not_a_wheel).payload.reason


def test_a_git_revision_and_a_wheel_are_versions_too(settings: Settings, tmp_path: Path) -> None:
    repo = write(tmp_path / "repo", {"train.py": "import os\n"})
    git = ["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "v1"], check=True)
    event = deploy(settings, f"{repo}@HEAD")
    assert isinstance(event.payload, CodeVersionRegistered) and event.payload.source_kind == "git", event.payload
    assert (Path(event.payload.path) / "train.py").read_text() == "import os\n"
    assert isinstance(deploy(settings, f"{repo}@no-such-rev").payload, CodeVersionRejected)

    wheel = tmp_path / "trainer-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("trainer/__init__.py", "")
        zf.writestr("trainer/__main__.py", "import json\n")
    event = deploy(settings, wheel, entry=["-m", "trainer"])
    assert isinstance(event.payload, CodeVersionRegistered) and event.payload.source_kind == "wheel", event.payload


def test_validation_refuses_entries_outside_the_version(tmp_path: Path) -> None:
    root = write(tmp_path / "v", {"train.py": ""})
    for entry in (["/etc/passwd"], ["../train.py"], ["-m"]):
        with pytest.raises(VersionRejected, match="entry point"):
            validate(root, entry)


def test_keel_versions_summarises_registrations_and_rejections(settings: Settings, tmp_path: Path) -> None:
    good = deploy(settings, write(tmp_path / "good", {"train.py": "import json\n"}), mode="urgent")
    bad = deploy(settings, write(tmp_path / "bad", {"train.py": "import nope_k7\n"}))
    summary = summarise([good, bad])
    assert summary["pending"] == good.payload.version_id and summary["current"] == "launch"
    assert [h["what"] for h in summary["history"]] == ["registered", "rejected"]
    assert summary["versions"][good.payload.version_id]["by"] == "ana"
    assert snapshot(str(tmp_path / "good"), settings.home / "versions").digest == good.payload.digest

"""The code version store with real files: what may enter it (no links, devices or FIFOs; a git revision is
never an option), how it is published (read-only, named by the digest), and the pure checks the hot-update
service and the agents share."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

from keel.cli.versions import deploy_event
from keel.events.types import CodeVersionRegistered, CodeVersionRejected
from keel.hot_update.versions import VersionRejected, snapshot
from keel.infra.code_store import CodeStoreError, VerifiedVersions, tree_digest, verify_version
from keel.infra.config import Settings
from keel.rules.code import entry_problem, registration_problem, version_id_of
from tests.unit.test_hot_update_versions import NOW, write


def deploy(settings: Settings, source: str | Path) -> CodeVersionRegistered | CodeVersionRejected:
    event = deploy_event(settings, "job1", str(source), entry=None, mode="lazy", deadline=None, by="ana", why="",
                         now=NOW)
    assert isinstance(event.payload, CodeVersionRegistered | CodeVersionRejected)
    return event.payload


def old_digest(root: Path) -> str:
    """The digest as versions were named before the store refused links (regular trees hash the same)."""
    h = hashlib.sha256()
    files = sorted(Path(d) / f for d, _, names in os.walk(root) for f in names)
    for path in files:
        h.update(f"{path.relative_to(root).as_posix()}\0{int(os.access(path, os.X_OK))}\0{path.stat().st_size}\0"
                 .encode())
        h.update(path.read_bytes())
    return f"sha256:{h.hexdigest()}"


def test_a_published_version_is_read_only_named_by_its_unchanged_digest(tmp_path: Path) -> None:
    src = write(tmp_path / "src", {"train.py": "print(1)\n", "pkg/mod.py": "X = 1\n", "run.sh": "#!/bin/sh\n"})
    (src / "run.sh").chmod(0o755)
    snap = snapshot(str(src), tmp_path / "store")
    assert snap.digest == old_digest(src) == tree_digest(snap.path)  # the same names as before
    assert snap.path.name == snap.digest.removeprefix("sha256:")
    modes = {p.relative_to(snap.path).as_posix(): stat.S_IMODE(p.lstat().st_mode) for p in snap.path.rglob("*")}
    assert modes == {"train.py": 0o444, "pkg": 0o555, "pkg/mod.py": 0o444, "run.sh": 0o555}
    assert stat.S_IMODE(snap.path.stat().st_mode) == 0o555
    assert stat.S_IMODE((tmp_path / "store").stat().st_mode) & 0o022 == 0
    assert verify_version(tmp_path / "store", snap.digest, str(snap.path)).files == {"train.py", "pkg/mod.py",
                                                                                       "run.sh"}


def test_links_devices_and_fifos_never_enter_the_store(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    secret = write(tmp_path, {"secret.key": "hunter2\n"}) / "secret.key"
    linked = write(tmp_path / "linked", {"train.py": "import json\n"})
    (linked / "config.key").symlink_to(secret)
    rejected = deploy(settings, linked)
    assert isinstance(rejected, CodeVersionRejected)
    assert f"{linked / 'config.key'} is a symbolic link" in rejected.reason and "regular files" in rejected.reason
    store = settings.home / "versions"
    assert not any("hunter2" in p.read_text() for p in store.rglob("*") if p.is_file())
    fifo = write(tmp_path / "fifo", {"train.py": "import json\n"})
    os.mkfifo(fifo / "pipe")
    assert "pipe is a FIFO" in deploy(settings, fifo).reason  # type: ignore[union-attr]
    # The folder the user names may itself be a link; what it holds may not.
    (tmp_path / "current").symlink_to(write(tmp_path / "real", {"train.py": "import json\n"}))
    assert isinstance(deploy(settings, tmp_path / "current"), CodeVersionRegistered)
    assert not list(store.glob(".staging-*"))  # nothing half-copied is left behind


def test_a_git_revision_is_never_an_option(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    repo = write(tmp_path / "repo", {"train.py": "import os\n"})
    git = ["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "v1"], check=True)
    out = tmp_path / "written-by-git"
    for rev in (f"--output={out}", "-o", "--remote=/tmp/x"):
        payload = deploy(settings, f"{repo}@{rev}")
        assert isinstance(payload, CodeVersionRejected) and "never starts with '-'" in payload.reason, payload
    assert not out.exists()
    # --end-of-options: a revision is only ever a revision, even one git could read otherwise.
    assert isinstance(deploy(settings, f"{repo}@HEAD"), CodeVersionRegistered)
    assert isinstance(deploy(settings, f"{repo}@no-such-rev"), CodeVersionRejected)


def test_a_store_writable_by_others_is_refused_and_a_tampered_version_is_replaced(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o755)
    store.chmod(0o777)
    with pytest.raises(VersionRejected, match=r"mode 0777: writable by others.*chmod go-w"):
        snapshot(str(write(tmp_path / "src", {"train.py": "x = 1\n"})), store)
    store.chmod(0o755)
    snap = snapshot(str(tmp_path / "src"), store)
    script = snap.path / "train.py"
    script.chmod(0o644)
    script.write_text("x = 2\n")
    with pytest.raises(CodeStoreError, match="stored versions are read-only"):
        verify_version(store, snap.digest, str(snap.path))
    again = snapshot(str(tmp_path / "src"), store)  # the same content deployed again: a clean copy
    assert again.path == snap.path and (again.path / "train.py").read_text() == "x = 1\n"
    assert [p.name.startswith(f".tampered-{snap.path.name}") for p in store.iterdir() if p != snap.path] == [True]


def test_the_verified_cache_rehashes_only_what_changed(tmp_path: Path) -> None:
    snap = snapshot(str(write(tmp_path / "src", {"train.py": "x = 1\n"})), tmp_path / "store")
    cache = VerifiedVersions(tmp_path / "store")
    for _ in range(3):
        cache.verify(snap.digest, str(snap.path))
    assert cache.hashed == 1
    os.utime(snap.path / "train.py", ns=(0, 0))  # same bytes, another mtime: checked again (and still fine)
    cache.verify(snap.digest, str(snap.path))
    assert cache.hashed == 2
    with pytest.raises(CodeStoreError, match="is not .*a node runs only a version of its store"):
        cache.verify(snap.digest, str(tmp_path / "src"))


HEX = "ab" * 32


@pytest.mark.parametrize("entry, problem", [
    (["train.py"], ""), (["bin/train.py"], ""), (["-m", "pkg.train"], ""),
    ([], "none given"), (["/abs/train.py"], "relative path"), (["../train.py"], "no '..'"),
    (["a/./b.py"], "relative path"), (["train.sh"], "*.py"), (["-c", "print(1)"], "relative path"),
    (["train.py", "--lr"], "one relative path"), (["-m", "os;rm"], "one dotted module name"),
    (["-m"], "-m followed by one"), (["-m", "a..b"], "dotted module name"), (["--x.py"], "relative path"),
])
def test_entry_points(entry: list[str], problem: str) -> None:
    found = entry_problem(entry)
    assert (problem in found) if problem else found == "", found


def test_entry_points_must_be_in_the_version_and_registrations_must_name_their_store_folder() -> None:
    files = {"train.py", "pkg/__init__.py", "pkg/train.py", "tool/__main__.py"}
    assert entry_problem(["-m", "pkg.train"], files) == entry_problem(["-m", "tool"], files) == ""
    assert "-m os is not a module of the version" in entry_problem(["-m", "os"], files)
    assert "run.py is not a file in the version" in entry_problem(["run.py"], files)
    digest = f"sha256:{HEX}"
    good = (version_id_of(digest), digest, f"/keel/versions/{HEX}", ["train.py"])
    assert registration_problem(*good) == ""
    assert "not a version store directory named by the digest" in registration_problem(
        good[0], digest, "/home/eve/payload", ["train.py"])
    assert f"is not {version_id_of(digest)}" in registration_problem("v-stable", digest, good[2], ["train.py"])
    assert "64 lowercase hex digits" in registration_problem(good[0], "sha256:abc", good[2], ["train.py"])
    assert "relative path" in registration_problem(good[0], digest, good[2], ["/bin/sh"])

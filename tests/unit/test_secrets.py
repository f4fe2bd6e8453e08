"""Secret files and private folders: created private, and anything not private is refused with the reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from keel.infra.secrets import InsecurePathError, ensure_private_dir, read_secret, write_secret


def test_written_secret_is_0600_in_a_0700_folder(tmp_path: Path) -> None:
    secret = write_secret(tmp_path / "creds" / "a.key", b"s3cret")
    assert (secret.stat().st_mode & 0o777) == 0o600
    assert (secret.parent.stat().st_mode & 0o777) == 0o700
    assert read_secret(secret) == b"s3cret"


def test_group_readable_secret_is_refused(tmp_path: Path) -> None:
    secret = write_secret(tmp_path / "creds" / "a.key", b"x")
    secret.chmod(0o640)
    with pytest.raises(InsecurePathError, match="mode 0640"):
        read_secret(secret)


def test_symlinked_secret_is_refused(tmp_path: Path) -> None:
    target = write_secret(tmp_path / "creds" / "a.key", b"x")
    link = tmp_path / "creds" / "b.key"
    link.symlink_to(target)
    with pytest.raises(InsecurePathError, match="symbolic link"):
        read_secret(link)


def test_world_open_folder_is_refused_and_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / "open"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.raises(InsecurePathError, match="mode 0777"):
        ensure_private_dir(folder)
    assert (folder.stat().st_mode & 0o777) == 0o777


def test_own_folder_only_others_could_read_is_made_private(tmp_path: Path) -> None:
    folder = tmp_path / "readable"
    folder.mkdir()
    folder.chmod(0o755)
    ensure_private_dir(folder)
    assert (folder.stat().st_mode & 0o777) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_folder_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)
    with pytest.raises(InsecurePathError, match="owned by uid 65534"):
        ensure_private_dir(folder)

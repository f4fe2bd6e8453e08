"""The persistent checkpoint tier (keel.checkpoint.disk) and `keel checkpoints ls`: real files only."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.checkpoint.disk import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    PersistError,
    ShardEntry,
    apply_retention,
    latest_committed,
    list_checkpoints,
    load_shard,
    manifest_path,
    read_manifest,
    shard_file,
    step_dir,
    write_manifest,
    write_shard,
)
from keel.cli.main import main as keel_main
from keel.events.types import ShardRecord

JOB = "job-a"


def payload(step: int, rank: int, size: int = 4096) -> bytes:
    return bytes([(step * 31 + rank * 7 + i) % 251 for i in range(256)]) * (size // 256) + b"x" * (size % 256)


def commit(root: Path, step: int, world_size: int = 2, size: int = 4096, job: str = JOB) -> None:
    entries = []
    for rank in range(world_size):
        written = write_shard(root, job, step, rank, payload(step, rank, size))
        entries.append(ShardEntry(rank=rank, bytes=written.bytes, sha256=written.sha256))
    write_manifest(root, job, step, world_size, entries)


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".") and ".tmp-" in p.name]


def test_write_commit_load_round_trip(tmp_path: Path) -> None:
    path, digest, size, seconds = write_shard(tmp_path, JOB, 7, 0, payload(7, 0))
    assert path == shard_file(tmp_path, JOB, 7, 0) == tmp_path / JOB / "step-000000007" / "rank-00000.shard"
    assert size == 4096 and seconds >= 0 and len(digest) == 64
    second = write_shard(tmp_path, JOB, 7, 1, payload(7, 1))
    # ShardRecord items from CheckpointShardsStored are accepted as they are (digest, not sha256).
    manifest = write_manifest(tmp_path, JOB, 7, 2, [
        ShardRecord(rank=1, step=7, bytes=second.bytes, digest=second.sha256),
        ShardEntry(rank=0, bytes=size, sha256=digest),
    ])
    assert manifest.path == manifest_path(tmp_path, JOB, 7)
    document = json.loads(manifest.path.read_text())
    assert document["job"] == JOB and document["step"] == 7 and document["world_size"] == 2
    assert [s["rank"] for s in document["shards"]] == [0, 1]
    assert document["shards"][0] == {"rank": 0, "file": "rank-00000.shard", "bytes": 4096, "sha256": digest}
    assert read_manifest(tmp_path, JOB, 7).digest == manifest.digest
    assert load_shard(tmp_path, JOB, 7, 1) == payload(7, 1)
    assert latest_committed(tmp_path, JOB).step == 7
    assert not temp_files(tmp_path)


def test_manifest_refused_when_a_shard_is_missing_or_of_the_wrong_size(tmp_path: Path) -> None:
    written = write_shard(tmp_path, JOB, 3, 0, payload(3, 0))
    entry0 = ShardEntry(rank=0, bytes=written.bytes, sha256=written.sha256)
    with pytest.raises(CheckpointError, match="do not cover ranks"):
        write_manifest(tmp_path, JOB, 3, 2, [entry0])
    with pytest.raises(CheckpointError, match="rank-00001.shard: shard of rank 1 is missing"):
        write_manifest(tmp_path, JOB, 3, 2, [entry0, ShardEntry(rank=1, bytes=10, sha256="0" * 64)])
    write_shard(tmp_path, JOB, 3, 1, payload(3, 1))
    with pytest.raises(CheckpointError, match="is 4096 bytes, expected 10"):
        write_manifest(tmp_path, JOB, 3, 2, [entry0, ShardEntry(rank=1, bytes=10, sha256="0" * 64)])
    assert not manifest_path(tmp_path, JOB, 3).exists()
    with pytest.raises(CheckpointNotFound):
        load_shard(tmp_path, JOB, 3, 0)


def test_directory_without_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    commit(tmp_path, 10)
    write_shard(tmp_path, JOB, 20, 0, payload(20, 0))  # a save in progress: one of two shards
    listed = {(c.step, c.status): c for c in list_checkpoints(tmp_path)}
    assert set(listed) == {(10, "committed"), (20, "incomplete")}
    assert listed[(10, "committed")].ranks == 2 and listed[(10, "committed")].bytes == 8192
    assert listed[(20, "incomplete")].ranks == 1 and listed[(20, "incomplete")].world_size is None
    assert latest_committed(tmp_path, JOB).step == 10
    with pytest.raises(CheckpointNotFound):
        read_manifest(tmp_path, JOB, 20)
    # An unreadable manifest does not make a checkpoint either.
    manifest_path(tmp_path, JOB, 20).write_text("{not json")
    incomplete = [c for c in list_checkpoints(tmp_path, JOB) if c.step == 20][0]
    assert incomplete.status == "incomplete" and "unreadable manifest" in incomplete.detail
    assert latest_committed(tmp_path, JOB).step == 10


def test_corrupt_and_truncated_shards_are_refused(tmp_path: Path) -> None:
    commit(tmp_path, 5)
    path = shard_file(tmp_path, JOB, 5, 1)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="SHA-256 mismatch"):
        load_shard(tmp_path, JOB, 5, 1)
    assert load_shard(tmp_path, JOB, 5, 1, verify=False) == bytes(data)  # size still right
    path.write_bytes(bytes(data[:1000]))
    with pytest.raises(CheckpointCorrupt, match="truncated \\(1000 of 4096 bytes\\)"):
        load_shard(tmp_path, JOB, 5, 1, verify=False)
    path.unlink()
    with pytest.raises(CheckpointCorrupt, match="missing"):
        load_shard(tmp_path, JOB, 5, 1)
    assert load_shard(tmp_path, JOB, 5, 0) == payload(5, 0)
    with pytest.raises(CheckpointNotFound, match="no shard for rank 9"):
        load_shard(tmp_path, JOB, 5, 9)
    with pytest.raises(CheckpointNotFound):
        load_shard(tmp_path, JOB, 6, 0)


def test_retention_keeps_the_newest_committed_and_in_progress_saves(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        commit(tmp_path, step)
    write_shard(tmp_path, JOB, 25, 0, payload(25, 0))  # abandoned save, older than the newest commit
    write_shard(tmp_path, JOB, 50, 0, payload(50, 0))  # save in progress
    commit(tmp_path, 10, job="job-b")
    removed = apply_retention(tmp_path, JOB, keep=2)
    assert sorted(p.name for p in removed) == ["step-000000010", "step-000000020", "step-000000025"]
    assert [(c.step, c.status) for c in list_checkpoints(tmp_path, JOB)] == [
        (30, "committed"), (40, "committed"), (50, "incomplete")]
    assert [c.job for c in list_checkpoints(tmp_path)] == [JOB, JOB, JOB, "job-b"]  # other jobs untouched
    assert load_shard(tmp_path, JOB, 30, 1) == payload(30, 1)
    assert apply_retention(tmp_path, JOB, keep=2) == []
    with pytest.raises(ValueError):
        apply_retention(tmp_path, JOB, keep=0)


def test_rewriting_a_shard_of_a_committed_step_is_detected(tmp_path: Path) -> None:
    commit(tmp_path, 8)
    write_shard(tmp_path, JOB, 8, 0, payload(99, 0))  # a re-run writes different bytes under step 8
    with pytest.raises(CheckpointCorrupt):
        load_shard(tmp_path, JOB, 8, 0)


# -- disk full ------------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (we run as root); skipped where mounting is refused (the EFBIG test below
    then still covers the failure path through a real OS error)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_disk_full_on_a_shard_keeps_the_last_committed_checkpoint(small_fs: Path) -> None:
    """A real ENOSPC from a 2 MiB tmpfs while writing a shard, then while writing the manifest."""
    commit(small_fs, 1, size=256 * 1024)
    write_shard(small_fs, JOB, 2, 0, payload(2, 0, 700 * 1024))
    with pytest.raises(PersistError) as caught:
        write_shard(small_fs, JOB, 2, 1, payload(2, 1, 1200 * 1024))
    assert caught.value.errno == errno.ENOSPC
    assert caught.value.path == shard_file(small_fs, JOB, 2, 1)
    assert "rank-00001.shard" in str(caught.value) and "ENOSPC" in str(caught.value)
    assert not temp_files(small_fs)
    assert not shard_file(small_fs, JOB, 2, 1).exists()
    assert load_shard(small_fs, JOB, 1, 0) == payload(1, 0, 256 * 1024)
    assert [(c.step, c.status) for c in list_checkpoints(small_fs, JOB)] == [(1, "committed"), (2, "incomplete")]

    # Shards of step 2 all written, then the disk fills up before the manifest.
    shutil.rmtree(step_dir(small_fs, JOB, 2))
    entries = []
    for rank in range(2):
        written = write_shard(small_fs, JOB, 2, rank, payload(2, rank, 256 * 1024))
        entries.append(ShardEntry(rank=rank, bytes=written.bytes, sha256=written.sha256))
    filler = small_fs / "filler"
    with open(filler, "wb", buffering=0) as f:
        with pytest.raises(OSError) as full:
            while True:
                f.write(b"\0" * 4096)
    assert full.value.errno == errno.ENOSPC
    with pytest.raises(PersistError) as caught:
        write_manifest(small_fs, JOB, 2, 2, entries)
    assert caught.value.errno == errno.ENOSPC and caught.value.path == manifest_path(small_fs, JOB, 2)
    assert not temp_files(small_fs)
    assert latest_committed(small_fs, JOB).step == 1
    assert load_shard(small_fs, JOB, 1, 1) == payload(1, 1, 256 * 1024)
    filler.unlink()
    write_manifest(small_fs, JOB, 2, 2, entries)
    assert latest_committed(small_fs, JOB).step == 2


def test_file_size_limit_failure_keeps_the_last_committed_checkpoint(tmp_path: Path) -> None:
    """A real EFBIG (``RLIMIT_FSIZE`` in a child process: Python ignores SIGXFSZ, so the write fails
    with an OSError) through the same path as ENOSPC; runs where mounting a tmpfs is refused too."""
    commit(tmp_path, 1, size=64 * 1024)
    script = textwrap.dedent(f"""
        import resource, sys
        from pathlib import Path
        from keel.checkpoint.disk import PersistError, write_shard
        resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, 100 * 1024))
        try:
            write_shard(Path({str(tmp_path)!r}), {JOB!r}, 2, 0, b"y" * (300 * 1024))
        except PersistError as exc:
            print(exc.errno, exc.path)
            sys.exit(0)
        sys.exit("no PersistError")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    code, path = result.stdout.split()
    assert int(code) == errno.EFBIG and Path(path) == shard_file(tmp_path, JOB, 2, 0)
    assert not temp_files(tmp_path)
    assert load_shard(tmp_path, JOB, 1, 0) == payload(1, 0, 64 * 1024)
    assert latest_committed(tmp_path, JOB).step == 1


# -- keel checkpoints ls ---------------------------------------------------------------------------


def test_checkpoints_ls(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_HOME", str(tmp_path / "home"))
    root = tmp_path / "ckpt"
    commit(root, 100, world_size=3, size=1024)
    write_shard(root, JOB, 200, 2, payload(200, 2, 512))
    commit(root, 7, world_size=1, size=256, job="other")

    assert keel_main(["checkpoints", "ls", "--root", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["JOB", "STEP", "RANKS", "BYTES", "CREATED_AT", "STATUS"]
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[1], r[2], r[3], r[-1]) for r in rows] == [
        (JOB, "100", "3", "3072", "committed"),
        (JOB, "200", "1", "512", "incomplete"),
        ("other", "7", "1", "256", "committed"),
    ]

    assert keel_main(["checkpoints", "ls", "--root", str(root), "--job", JOB, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["status"], c["world_size"]) for c in document["checkpoints"]] == [
        (100, "committed", 3), (200, "incomplete", None)]

    # Without --root: the configured persistent tier (<home>/checkpoints by default).
    assert keel_main(["checkpoints", "ls"]) == 0
    assert f"no checkpoints under {tmp_path / 'home' / 'checkpoints'}" in capsys.readouterr().out
    monkeypatch.setenv("KEEL_CHECKPOINT__PERSIST_ROOT", str(root))
    assert keel_main(["checkpoints", "ls", "--job", "other"]) == 0
    assert "other" in capsys.readouterr().out

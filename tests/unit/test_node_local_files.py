"""Node-local paths under predictable names (the agent folder, the slot folder, the files ranks trust): only
this user's own are used, no symbolic link is followed, and the fault file is read only where fault injection
is on. Real files, real ownership (root, as in CI, hands a folder to ``nobody``)."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from keel.agent.launch_spec import LaunchSpec, parse_launch_args
from keel.agent.rejoin import AgentLock
from keel.agent.supervisor import RankSupervisor
from keel.checkpoint import slots as ckpt_slots
from keel.checkpoint.owned import UntrustedPathError, ensure_owned_dir, open_owned, read_owned_text
from keel.sdk.faults import FaultFileWatcher

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root can hand a path to another user (CI runs as root)")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_folder_is_private_and_an_own_folder_is_kept_and_tightened(tmp_path: Path) -> None:
    fresh = ensure_owned_dir(tmp_path / "a" / "agent")
    assert fresh.is_dir() and mode(fresh) == 0o700
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    (old / "logs").mkdir()
    ensure_owned_dir(old)  # left by an earlier run of this user: nobody else could write into it
    assert mode(old) == 0o700 and (old / "logs").is_dir()


@as_root
def test_a_folder_someone_else_created_is_refused_with_its_owner_and_the_fix(tmp_path: Path) -> None:
    planted = tmp_path / "keel-agent-n00"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(UntrustedPathError) as caught:
        AgentLock(planted)
    message = str(caught.value)
    assert str(planted) in message and f"uid {NOBODY}" in message and "--keel-agent-dir" in message, message
    assert "Remove it" in message
    assert list(planted.iterdir()) == [] and os.lstat(planted).st_uid == NOBODY  # nothing written, nothing changed


def test_a_symbolic_link_or_a_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "agent"
    link.symlink_to(target)
    with pytest.raises(UntrustedPathError, match="is a symbolic link .*refusing to follow it"):
        ensure_owned_dir(link, "or start the agent with another folder (--keel-agent-dir)")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UntrustedPathError, match=r"writable by group or others \(mode 0777\).*chmod go-w"):
        ensure_owned_dir(shared)
    assert mode(shared) == 0o777  # refused: left as it was


def test_open_owned_refuses_links_and_files_others_can_write(tmp_path: Path) -> None:
    mine = tmp_path / "plan.json"
    mine.write_text('{"step": 3}')
    assert read_owned_text(mine) == '{"step": 3}'
    link = tmp_path / "link.json"
    link.symlink_to(mine)
    with pytest.raises(UntrustedPathError, match="symbolic link"):
        read_owned_text(link)
    mine.chmod(0o666)
    with pytest.raises(UntrustedPathError, match="writable by group or others"):
        read_owned_text(mine)
    with pytest.raises(FileExistsError):  # creating never takes an existing path
        open_owned(mine, os.O_RDWR | os.O_CREAT)


def test_a_slot_file_is_created_0600_and_never_opened_through_a_link(tmp_path: Path) -> None:
    node_dir = tmp_path / "slots"
    writer = ckpt_slots.SlotWriter(ckpt_slots.slot_path(node_dir, 0, 0), 64)
    writer.begin(1, 0)
    writer.complete(1, 0, ckpt_slots.sha256_hex(b""), 0)
    writer.close()
    assert mode(ckpt_slots.slot_path(node_dir, 0, 0)) == 0o600
    assert ckpt_slots.read_header(ckpt_slots.slot_path(node_dir, 0, 0)).step == 1
    victim = tmp_path / "victim"  # a file of this user that a planted link points at
    victim.write_bytes(b"precious")
    ckpt_slots.slot_path(node_dir, 0, 1).symlink_to(victim)
    with pytest.raises(ckpt_slots.SlotError, match="symbolic link"):
        ckpt_slots.SlotWriter(ckpt_slots.slot_path(node_dir, 0, 1), 64)
    with pytest.raises(ckpt_slots.SlotError, match="symbolic link"):
        ckpt_slots.read_header(ckpt_slots.slot_path(node_dir, 0, 1))
    assert victim.read_bytes() == b"precious"  # neither truncated nor mapped


@as_root
def test_a_slot_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = ckpt_slots.slot_path(tmp_path, 2, 0)
    writer = ckpt_slots.SlotWriter(path, 16)
    writer.close()
    os.chown(path, NOBODY, NOBODY)
    for open_it in (lambda: ckpt_slots.read_header(path), lambda: ckpt_slots.read_payload(path),
                    lambda: ckpt_slots.SlotWriter(path, 16)):
        with pytest.raises(ckpt_slots.SlotError, match=f"owned by .*uid {NOBODY}"):
            open_it()


def test_a_fault_file_that_is_a_link_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    real = tmp_path / "real.json"
    real.write_text(json.dumps({"id": "c1", "kind": "crash", "rank": None}))
    link = tmp_path / "fault.json"
    link.symlink_to(real)
    watcher = FaultFileWatcher(str(link), rank=0, generation=0)
    with caplog.at_level(logging.ERROR, logger="keel.sdk"):
        assert watcher.poll() is None
    assert any("symbolic link" in r.getMessage() for r in caplog.records)
    link.unlink()
    real.rename(link)
    fault = watcher.poll()
    assert fault is not None and fault.id == "c1"  # the same fault in a real file is applied


def _spec(tmp_path: Path, **overrides: object) -> LaunchSpec:
    base: dict[str, object] = dict(nnodes=1, nproc_per_node=1, node_rank=0, master_addr="127.0.0.1", master_port=29500,
                                   command=("train.py",), agent_dir=tmp_path / "agent", root=tmp_path / "root")
    base.update(overrides)
    return LaunchSpec(**base)  # type: ignore[arg-type]


def test_ranks_get_the_fault_files_only_with_fault_injection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Even a fault file in the agent's own environment is not passed on unless fault injection is on.
    monkeypatch.setenv("KEEL_FAULT_FILE", str(tmp_path / "inherited.json"))
    monkeypatch.setenv("KEEL_SIMULATED_SDC_FILE", str(tmp_path / "inherited-sdc.json"))
    fault_file = tmp_path / "agent" / "fault.json"
    off = RankSupervisor(_spec(tmp_path), tmp_path / "agent" / "agent.sock", fault_file).rank_env(0, 0)
    assert "KEEL_FAULT_FILE" not in off and "KEEL_SIMULATED_SDC_FILE" not in off
    on = RankSupervisor(_spec(tmp_path, fault_injection=True), tmp_path / "agent" / "agent.sock",
                        fault_file).rank_env(0, 0)
    assert on["KEEL_FAULT_FILE"] == str(fault_file)
    assert on["KEEL_SIMULATED_SDC_FILE"] == str(tmp_path / "root" / "run/keel/sdc.json")
    assert not parse_launch_args(["train.py"]).fault_injection
    assert parse_launch_args(["--keel-fault-injection", "train.py"]).fault_injection

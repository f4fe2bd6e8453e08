"""The node-local channel: a bad report from a rank is counted and dropped; a datagram from anything that is
not the rank it claims to be (the kernel names the sender) is ignored."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from keel.agent.channel import RankChannel, Sender, sender_problem
from keel.protocol import node_local_pb2

NOW = datetime(2026, 12, 2, 7, 0, tzinfo=UTC)
ME = {os.getpid(): 3}
"""This test process plays rank 3 (the supervisor's pid -> rank map)."""


def report(**fields: object) -> bytes:
    base: dict[str, object] = {"job_id": "j", "node_id": "n0", "rank": 3, "local_rank": 1, "pid": os.getpid(), "generation": 1,
                               "seq": 1, "sent_at_unix_s": 1.7e9, "phase": node_local_pb2.PHASE_STEP, "step": 5,
                               "step_time_s": 0.2}
    base.update(fields)
    return node_local_pb2.RankReport(**base).SerializeToString()  # type: ignore[arg-type]


@pytest.fixture
def channel(tmp_path: Path):  # type: ignore[no-untyped-def]
    channel = RankChannel(tmp_path / "ranks.sock")
    yield channel
    channel.close()


def send(channel: RankChannel, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, str(channel.path))


@pytest.mark.parametrize("bad", [
    {"rank": -1}, {"local_rank": -5}, {"rank": 1 << 30}, {"pid": 0}, {"step": -7}, {"checkpoint_step": -3},
    {"step_time_s": float("nan")}, {"sent_at_unix_s": float("inf")}, {"compute_time_s": -1.0},
    {"collective_wait_s": float("nan")}, {"collective_wait_max_s": -0.5}, {"checkpoint_blocking_s": -0.1},
    {"checkpoint_blocking_s": float("inf")},
    {"rank": -1, "pid": 0},
])
def test_a_report_out_of_range_is_dropped_and_counted(channel: RankChannel, bad: dict) -> None:  # type: ignore[type-arg]
    send(channel, report(**bad))
    send(channel, b"\xff\x00 not a protobuf")
    send(channel, report(seq=1))
    assert channel.drain(NOW, 1, ME) == 3
    assert channel.malformed == 2 and channel.rejected == 0
    assert sorted(channel.ranks) == [3]


def test_a_nan_loss_is_a_report_not_a_fault_of_the_channel(channel: RankChannel) -> None:
    # A NaN loss is what the metric-anomaly rules are there to see: the channel passes it on.
    send(channel, report(loss=float("nan")))
    assert channel.drain(NOW, 1, ME) == 1
    assert channel.malformed == 0 and list(channel.ranks) == [3]


def test_a_rank_speaks_only_for_itself() -> None:
    ranks = {100: 3, 101: 4}
    mine = node_local_pb2.RankReport(rank=3, pid=100)
    assert sender_problem(mine, Sender(100, 0, 0), ranks) == ""
    assert "not a rank process" in sender_problem(mine, Sender(555, 1000, 1000), ranks)
    assert "sent a report for rank 3" in sender_problem(mine, Sender(101, 0, 0), ranks)
    assert "naming pid 101" in sender_problem(node_local_pb2.RankReport(rank=3, pid=101), Sender(100, 0, 0), ranks)
    assert "no sender credentials" in sender_problem(mine, None, ranks)


def test_a_report_from_a_process_that_is_not_a_rank_is_ignored(channel: RankChannel,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    # A real process of the same user, not one of the agent's ranks, claims rank 3's failure three times, and
    # once with this process's pid (rank 3's) in the report: the kernel says who sent it.
    forged = report(phase=node_local_pb2.PHASE_FAILED, error="forged", seq=9)
    script = ("import socket, sys\n"
              "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
              "for _ in range(3): s.sendto(bytes.fromhex(sys.argv[2]), sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", script, str(channel.path), forged.hex()], check=True, timeout=60)
    assert channel.drain(NOW, 1, ME) == 3
    assert channel.rejected == 3 and channel.ranks == {}
    assert len([r for r in caplog.records if "is not a rank process of this agent" in r.getMessage()]) == 1
    # The rank itself is heard (the check can fail): its own report of rank 4 is not, its report of 3 is.
    send(channel, report(rank=4, seq=1))
    send(channel, report(phase=node_local_pb2.PHASE_FAILED, error="boom", seq=2))
    assert channel.drain(NOW, 1, ME) == 2
    assert channel.rejected == 4 and list(channel.ranks) == [3] and channel.ranks[3].phase == "failed"


def test_the_socket_is_out_of_reach_of_other_users(tmp_path: Path) -> None:
    folder = tmp_path / "agent"
    folder.mkdir(mode=0o700)
    channel = RankChannel(folder / "agent.sock")
    try:
        assert stat.S_IMODE(os.stat(channel.path).st_mode) == 0o600
        if os.geteuid() == 0:  # as root (CI), a real process of another user tries to send
            script = ("import os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
                      "try:\n    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'x', sys.argv[1])\n"
                      "except PermissionError:\n    sys.exit(3)\n")
            done = subprocess.run([sys.executable, "-c", script, str(channel.path)], timeout=60)
            assert done.returncode == 3
            assert channel.drain(NOW, 1, ME) == 0
    finally:
        channel.close()


def test_a_rank_inside_a_collective_is_dated_from_its_first_report_there(channel: RankChannel) -> None:
    from datetime import timedelta

    send(channel, report(seq=1, collective_seq=7, collective="dp_all_reduce", collective_wait_s=0.5))
    channel.drain(NOW, 1, ME)
    send(channel, report(seq=2, collective_seq=7, collective="dp_all_reduce", collective_wait_s=1.7))
    channel.drain(NOW + timedelta(seconds=1), 1, ME)
    state = channel.ranks[3]
    assert (state.collective, state.collective_entered_at) == ("dp_all_reduce", NOW - timedelta(seconds=0.5))
    send(channel, report(seq=3, collective_seq=9, collective="world_all_reduce", collective_wait_s=0.25))
    channel.drain(NOW + timedelta(seconds=2), 1, ME)
    assert (state.collective, state.collective_entered_at) == ("world_all_reduce", NOW + timedelta(seconds=1.75))
    send(channel, report(seq=4, step=6, collective_seq=9, collective_wait_max_s=0.3))
    channel.drain(NOW + timedelta(seconds=3), 1, ME)
    assert (state.collective, state.collective_entered_at) == ("", None) and list(state.collective_waits_s) == [0.3]


def test_the_checkpoint_blocking_total_only_grows(channel: RankChannel) -> None:
    # A running total: a lower value in a newer report (never sent by the SDK: a corrupted or forged one) does
    # not take back what the rank already said. (A late datagram is dropped earlier, by its sequence number.)
    for seq, total in ((1, 0.25), (2, 0.75), (3, 0.5)):
        send(channel, report(seq=seq, checkpoint_blocking_s=total))
        channel.drain(NOW, 1, ME)
    assert channel.ranks[3].checkpoint_blocking_s == 0.75


def test_a_ranks_shard_group_is_passed_through_to_its_checkpoint_registration(channel: RankChannel,
                                                                              tmp_path: Path) -> None:
    # What the SDK sends (Checkpointer.groups as JSON) reaches CheckpointRanksRegistered as the rank's groups,
    # its shard group included; an SDK that sends none (before shard groups) registers none.
    from keel.agent.checkpointing import NodeCheckpointing
    from keel.events.types import CheckpointRanksRegistered

    send(channel, report(checkpoint_groups_json='{"dp": [1, 3], "pp": [3], "shard": [2, 3], "tp": [3]}'))
    channel.drain(NOW, 1, ME)
    assert channel.ranks[3].groups == {"dp": [1, 3], "pp": [3], "tp": [3], "shard": [2, 3], "shard_is_dp": False}
    emitted: list[object] = []
    ckpt = NodeCheckpointing(job_id="j", node_id="n0", local_ranks=[3], world_size=4, node_dir=tmp_path / "shm",
                             agent_dir=tmp_path / "agent", emit=lambda payload, *a, **k: emitted.append(payload),
                             transport=None, persist_root=None)
    ckpt.tick(0.0, {3: channel.ranks[3].groups}, {})
    [registered] = [p for p in emitted if isinstance(p, CheckpointRanksRegistered)]
    assert [(g.rank, g.dp, g.shard) for g in registered.ranks] == [(3, [1, 3], [2, 3])]
    older = RankChannel(tmp_path / "older.sock")
    try:
        send(older, report(checkpoint_groups_json='{"dp": [1, 3], "pp": [3], "tp": [3]}'))
        older.drain(NOW, 1, ME)
        assert older.ranks[3].groups == {"dp": [1, 3], "pp": [3], "tp": [3], "shard": [], "shard_is_dp": False}
    finally:
        older.close()


def test_a_shard_group_equal_to_the_dp_group_travels_once_and_a_world_sized_registration_fits(
        channel: RankChannel, tmp_path: Path) -> None:
    # FSDP2 on a 1-D mesh: the shard group is the DP group, often the whole world. The SDK sends it as "dp" and
    # the registration carries shard_is_dp, not a second copy: a 4,096-rank job's node of 8 ranks (each with the
    # whole world as its DP group) stays within the event size limit, as it did before shard groups.
    from keel.agent.checkpointing import NodeCheckpointing
    from keel.checkpoint_broker.state import RankSite
    from keel.events.types import CheckpointRanksRegistered, RankGroups
    from keel.infra.config import BusSettings
    from keel.sdk.session import groups_on_the_wire

    world = list(range(4096))
    wire = groups_on_the_wire({"dp": world, "pp": [3], "tp": [3], "shard": world})
    assert wire["shard"] == "dp"
    assert groups_on_the_wire({"dp": [1, 3], "pp": [3], "tp": [3], "shard": [3]})["shard"] == [3]
    send(channel, report(checkpoint_groups_json=json.dumps(wire)))
    channel.drain(NOW, 1, ME)
    groups = channel.ranks[3].groups
    assert groups is not None and groups["shard"] == [] and groups["shard_is_dp"] is True
    emitted: list[object] = []
    ckpt = NodeCheckpointing(job_id="j", node_id="n0", local_ranks=[3], world_size=4096, node_dir=tmp_path / "shm",
                             agent_dir=tmp_path / "agent", emit=lambda payload, *a, **k: emitted.append(payload),
                             transport=None, persist_root=None)
    ckpt.tick(0.0, {3: groups}, {})
    [registered] = [p for p in emitted if isinstance(p, CheckpointRanksRegistered)]
    assert RankSite.from_groups(registered.ranks[0], "n0").shard == tuple(world)  # the broker sees the DP group
    node = CheckpointRanksRegistered(node_id="n0", generation=0, world_size=4096, store_address="10.0.0.1:7301",
                                     ranks=[RankGroups(rank=r, dp=world, pp=[r], tp=[r], shard_is_dp=True)
                                            for r in range(8)])
    assert len(node.model_dump_json()) < BusSettings().max_event_bytes
    with pytest.raises(ValueError, match="leave shard empty"):
        RankGroups(rank=0, dp=[0, 1], shard=[0, 1], shard_is_dp=True)

"""The node-local channel takes datagrams from anything on the node: a bad one is counted and dropped."""

from __future__ import annotations

import socket
from datetime import UTC, datetime
from pathlib import Path

import pytest

from keel.agent.channel import RankChannel
from keel.protocol import node_local_pb2

NOW = datetime(2026, 12, 2, 7, 0, tzinfo=UTC)


def report(**fields: object) -> bytes:
    base: dict[str, object] = {"job_id": "j", "node_id": "n0", "rank": 3, "local_rank": 1, "pid": 4242, "generation": 1,
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
])
def test_a_report_out_of_range_is_dropped_and_counted(channel: RankChannel, bad: dict) -> None:  # type: ignore[type-arg]
    send(channel, report(**bad))
    send(channel, b"\xff\x00 not a protobuf")
    send(channel, report(rank=2, seq=1))
    assert channel.drain(NOW, generation=1) == 3
    assert channel.malformed == 2
    assert sorted(channel.ranks) == [2]


def test_a_nan_loss_is_a_report_not_a_fault_of_the_channel(channel: RankChannel) -> None:
    # A NaN loss is what the metric-anomaly rules are there to see: the channel passes it on.
    send(channel, report(loss=float("nan")))
    assert channel.drain(NOW, generation=1) == 1
    assert channel.malformed == 0 and list(channel.ranks) == [3]

"""Who may do what to a shard store (``keel.agent.shard_access``): pure decisions with their reasons."""

from __future__ import annotations

import pytest

from keel.agent.shard_access import StoreLimits, StreamLoad, admit_stream, authorize_put, authorize_read

SENDERS = {0: "n1", 1: "n1", 2: "n2"}


def put(peer: str, rank: int, owner: str | None = None, world_size: int = 4):  # type: ignore[no-untyped-def]
    return authorize_put(peer, rank, peer if owner is None else owner, store_node="n0", world_size=world_size,
                         senders=SENDERS)


def test_a_backup_is_accepted_only_from_the_node_assigned_to_send_it_as_its_own() -> None:
    assert put("n1", 0) is None and put("n2", 2) is None
    other = put("n2", 0)
    assert other is not None and other.code == "PERMISSION_DENIED"
    assert "rank 0's backups on 'n0' come from 'n1', not from 'n2'" in other.reason
    spoofed = put("n2", 0, owner="n1")  # claims to carry n1's shard
    assert spoofed is not None and spoofed.code == "PERMISSION_DENIED" and "claiming to be node 'n1'" in spoofed.reason
    unknown = put("n1", 3)
    assert unknown is not None and unknown.code == "PERMISSION_DENIED" and "no node is assigned to back up rank 3" in unknown.reason


@pytest.mark.parametrize("rank", [-1, 4, 10**6])
def test_ranks_outside_the_world_are_refused_for_writing_and_reading(rank: int) -> None:
    refused = put("n1", rank)
    assert refused is not None and refused.code == "INVALID_ARGUMENT" and "outside this job's ranks 0..3" in refused.reason
    read = authorize_read("n5", rank, world_size=4)
    assert read is not None and read.code == "INVALID_ARGUMENT"
    assert authorize_read("n5", 3, world_size=4) is None and authorize_read("n5", None, world_size=4) is None


def test_stream_limits_and_quotas_name_the_setting_that_refuses() -> None:
    limits = StoreLimits(max_shard_bytes=100, peer_quota_bytes=150, total_quota_bytes=200, max_streams=3,
                         max_streams_per_peer=2)
    assert admit_stream("n1", 100, StreamLoad(streams=2, peer_streams=1, peer_bytes=50, total_bytes=100), limits) is None
    cases = {
        "store_max_streams": StreamLoad(streams=3),
        "store_max_streams_per_peer": StreamLoad(streams=2, peer_streams=2),
        "store_peer_quota": StreamLoad(peer_bytes=51, total_bytes=51),
        "store_total_quota": StreamLoad(peer_bytes=0, total_bytes=101),
    }
    for setting, load in cases.items():
        refused = admit_stream("n1", 100, load, limits)
        assert refused is not None and refused.code == "RESOURCE_EXHAUSTED" and setting in refused.reason, setting
    too_big = admit_stream("n1", 101, StreamLoad(), limits)
    assert too_big is not None and "store_max_shard_bytes" in too_big.reason
    # A read declares nothing: only the stream limits apply to it.
    assert admit_stream("n1", 0, StreamLoad(peer_bytes=10**9, total_bytes=10**9), limits) is None


def test_limits_below_one_are_refused_with_the_name() -> None:
    with pytest.raises(ValueError, match="max_streams must be at least 1"):
        StoreLimits(max_streams=0)

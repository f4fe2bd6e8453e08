"""The c10d rendezvous's pure decisions (keel.agent.rendezvous) and how `keel run` parses its flags."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from keel.agent.launch_spec import LaunchError, parse_launch_args
from keel.agent.rendezvous import (
    Member,
    RendezvousConf,
    RendezvousConfigError,
    Round,
    admit,
    duplicate_node_ids,
    judge,
    leave,
    node_ranks,
    parse_endpoint,
    parse_nnodes,
    parse_rdzv_conf,
    settle,
    worker_port_clear,
)
from keel.agent.rendezvous_store import RendezvousResult, workers_base_port

CONF = RendezvousConf(last_call_timeout=timedelta(seconds=2), join_timeout=timedelta(seconds=10))


def join_all(members: list[Member], *, low: int, high: int, now: float = 100.0) -> Round:
    state = Round()
    for member in members:
        admission = admit(state, member, min_nodes=low, max_nodes=high, now=now, conf=CONF)
        assert not admission.refused, admission.refused
        state = admission.round
    return state


def test_ranks_are_the_members_sorted_by_node_id_whatever_the_join_order() -> None:
    a, b, c = Member("node-a", "t3"), Member("node-b", "t1"), Member("node-c", "t2")
    first = node_ranks(join_all([c, a, b], low=3, high=3))
    second = node_ranks(join_all([b, c, a], low=3, high=3))
    assert first == second == {"t3": 0, "t1": 1, "t2": 2}
    # Two agents with one node id (one host, default ids): told apart by their tokens, and reported.
    twins = join_all([Member("host", "z"), Member("host", "y")], low=2, high=2)
    assert node_ranks(twins) == {"y": 0, "z": 1} and duplicate_node_ids(twins) == ["host"]


def test_min_max_waits_for_min_then_a_last_call_then_closes() -> None:
    a, b, c, d = (Member(f"n{i}", f"t{i}") for i in range(4))
    state = join_all([a], low=2, high=3)
    assert state.last_call_ends_at is None and not state.closed  # below MIN: no last call yet
    state = admit(state, b, min_nodes=2, max_nodes=3, now=100.0, conf=CONF).round
    assert state.last_call_ends_at == 102.0 and not state.closed  # MIN reached: last call of 2 s
    assert settle(state, min_nodes=2, now=101.9) == state
    assert judge(state, "t0", min_nodes=2, max_nodes=3, joined_at=100.0, now=101.0, conf=CONF).waiting
    closed = settle(state, min_nodes=2, now=102.0)
    assert closed.closed and len(closed.members) == 2
    verdict = judge(closed, "t1", min_nodes=2, max_nodes=3, joined_at=100.0, now=102.0, conf=CONF)
    assert (verdict.node_rank, verdict.nnodes) == (1, 2)
    late = admit(closed, c, min_nodes=2, max_nodes=3, now=103.0, conf=CONF)
    assert late.round == closed and "already closed with 2 node(s)" in late.refused and "--keel-standby" in late.refused
    # MAX closes the round at once, before the last call ends.
    full = join_all([a, b, c], low=2, high=3)
    assert full.closed and len(full.members) == 3
    assert "already closed with 3" in admit(full, d, min_nodes=2, max_nodes=3, now=100.0, conf=CONF).refused


def test_one_to_two_nodes_with_one_node_starts_after_the_last_call() -> None:
    alone = join_all([Member("solo", "t")], low=1, high=2)
    assert not alone.closed and alone.last_call_ends_at == 102.0
    verdict = judge(settle(alone, min_nodes=1, now=102.5), "t", min_nodes=1, max_nodes=2, joined_at=100.0, now=102.5,
                    conf=CONF)
    assert (verdict.node_rank, verdict.nnodes) == (0, 1)


def test_a_join_that_times_out_fails_and_leaves_the_round() -> None:
    a, b = Member("n0", "t0"), Member("n1", "t1")
    state = join_all([a], low=2, high=2)
    verdict = judge(state, "t0", min_nodes=2, max_nodes=2, joined_at=100.0, now=110.0, conf=CONF)
    assert "only 1 of the 2 node(s) needed" in verdict.failed and "join_timeout 10s" in verdict.failed
    assert "n0" in verdict.failed
    assert leave(state, "t0", min_nodes=2).members == ()
    # A member leaving an open round below MIN turns the last call off; a closed round is left as is.
    pair = join_all([a, b], low=2, high=3)
    assert leave(pair, "t1", min_nodes=2).last_call_ends_at is None
    assert leave(settle(pair, min_nodes=2, now=200.0), "t1", min_nodes=2).members == pair.members


def test_the_round_round_trips_through_json() -> None:
    state = join_all([Member("n0", "t0"), Member("n1", "t1")], low=2, high=3)
    assert Round.from_json(state.to_json()) == state
    result = RendezvousResult("J", 1, 2, "10.0.0.1", 12345)
    assert RendezvousResult.from_json(result.to_json()) == result
    with pytest.raises(ValueError, match="inconsistent"):
        RendezvousResult.from_json(RendezvousResult("J", 2, 2, "h", 1).to_json())


def test_rdzv_conf_takes_torchs_keys_seconds_or_units_and_refuses_the_rest() -> None:
    assert parse_rdzv_conf("") == RendezvousConf()
    default = RendezvousConf()
    assert (default.join_timeout, default.last_call_timeout, default.close_timeout) == (
        timedelta(seconds=600), timedelta(seconds=30), timedelta(seconds=30))
    conf = parse_rdzv_conf("join_timeout=20, last_call_timeout=500ms,close_timeout=3s,is_host=false,timeout=900")
    assert conf == RendezvousConf(join_timeout=timedelta(seconds=20), last_call_timeout=timedelta(milliseconds=500),
                                  close_timeout=timedelta(seconds=3), is_host=False)
    for bad, message in [("join_timeout", "key=value"), ("join_timeout=", "key=value"), ("=3", "key=value"),
                         ("join_timeout=soon", "not a duration"), ("last_call_timeout=0", "must be positive"),
                         ("close_timeout=-5", "must be positive"), ("is_host=maybe", "true or false"),
                         ("store_type=file", "TCP store only"), ("join_timout=5", "unknown key 'join_timout'"),
                         ("join_timeout=1,join_timeout=2", "twice")]:
        with pytest.raises(RendezvousConfigError, match=message):
            parse_rdzv_conf(bad)


def test_nnodes_and_endpoint_parsing() -> None:
    assert parse_nnodes("4") == (4, 4) and parse_nnodes("1:2") == (1, 2)
    for bad in ("0", "3:2", "a", "1:2:3", "-1:2", ""):
        with pytest.raises(RendezvousConfigError):
            parse_nnodes(bad)
    assert parse_endpoint("host", 29400) == ("host", 29400)
    assert parse_endpoint("10.0.0.1:1234", 29400) == ("10.0.0.1", 1234)
    assert parse_endpoint("[::1]:99", 29400) == ("::1", 99)
    for bad in ("host:port", ":12", "h:70000", "[::1]x"):
        with pytest.raises(RendezvousConfigError):
            parse_endpoint(bad, 29400)


def test_the_ranks_ports_keep_clear_of_the_rendezvous_port() -> None:
    assert worker_port_clear(20000, 29400) and worker_port_clear(29401, 29400)
    assert not worker_port_clear(29000, 29400) and not worker_port_clear(29400, 29400)
    picks = iter([29000, 28900, 12000])
    assert workers_base_port(29400, lambda: next(picks)) == 12000


def test_keel_run_c10d_without_node_rank_defers_the_rank_to_the_rendezvous() -> None:
    spec = parse_launch_args(["--nnodes", "2:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400",
                              "--rdzv-id", "J", "--rdzv-conf", "last_call_timeout=1", "train.py"])
    assert spec.rendezvous and (spec.min_nodes, spec.max_nodes) == (2, 4) and spec.rdzv_id == "J"
    assert (spec.master_addr, spec.master_port) == ("head", 29400) and spec.job_id == "J"
    assert spec.rdzv_conf.last_call_timeout == timedelta(seconds=1)
    placed = spec.with_rendezvous(3, 4, "10.0.0.7", 12000)
    assert not placed.rendezvous and placed.global_rank(0) == 3 and placed.world_size == 4
    assert placed.master_port_for(2) == 12002
    with pytest.raises(LaunchError, match="outside"):
        spec.with_rendezvous(4, 4, "h", 1)
    # torchrun ignores --node-rank for c10d; the endpoint's port defaults to 29400.
    ignored = parse_launch_args(["--nnodes", "2", "--rdzv-backend", "c10d", "--node-rank", "1", "--rdzv-endpoint", "h",
                                 "train.py"])
    assert ignored.rendezvous and ignored.master_port == 29400
    # Static keeps --node-rank and takes MAX, as torchrun's static backend.
    static = parse_launch_args(["--nnodes", "1:3", "--node-rank", "2", "--master-addr", "h", "train.py"])
    assert not static.rendezvous and static.nnodes == 3 and static.node_rank == 2 and static.master_port == 29500


def test_keel_run_refuses_bad_rendezvous_flags_clearly() -> None:
    for argv, message in [
        (["--rdzv-backend", "etcd", "t.py"], "no etcd server needed"),
        (["--rdzv-backend", "zookeeper", "t.py"], "static or c10d"),
        (["--nnodes", "3:2", "t.py"], "0 < MIN <= MAX"),
        (["--rdzv-backend", "c10d", "--rdzv-conf", "bogus=1", "t.py"], "unknown key 'bogus'"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:x", "t.py"], "HOST"),
        (["--nnodes", "2", "--node-rank", "2", "t.py"], "outside 0..1"),
    ]:
        with pytest.raises(LaunchError, match=message):
            parse_launch_args(argv)


def test_default_agent_folders_are_per_node_and_job_and_the_slot_folder_follows_them() -> None:
    one = parse_launch_args(["--keel-node-id", "n0", "--rdzv-id", "a", "t.py"])
    two = parse_launch_args(["--keel-node-id", "n0", "--rdzv-id", "b/c", "t.py"])
    assert one.agent_dir_default and one.agent_dir.name == "keel-agent-n0-a" and two.agent_dir.name == "keel-agent-n0-b_c"
    moved = one.with_agent_dir(one.agent_dir.with_name("keel-agent-n0-a-2"))
    assert moved.ckpt_dir is not None and one.ckpt_dir is not None and moved.ckpt_dir != one.ckpt_dir
    given = parse_launch_args(["--keel-agent-dir", "/x/agent", "--keel-ckpt-dir", "/dev/shm/mine", "t.py"])
    assert not given.agent_dir_default
    assert given.with_agent_dir(Path("/y")).ckpt_dir == Path("/dev/shm/mine")  # a given slot folder stays
    assert parse_launch_args(["--keel-local-restarts", "t.py"]).local_restarts


def test_a_second_agent_takes_the_next_default_folder_and_a_given_busy_one_is_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    from keel.agent.rejoin import AgentDirBusy
    from keel.cli.agent_cmd import claim_agent_dir

    spec = parse_launch_args(["--keel-node-id", "n0", "t.py"]).with_agent_dir(tmp_path / "keel-agent-n0-job")
    assert spec.agent_dir_default
    first, lock1 = claim_agent_dir(spec)
    second, lock2 = claim_agent_dir(spec)
    try:
        assert first.agent_dir == tmp_path / "keel-agent-n0-job" and second.agent_dir == tmp_path / "keel-agent-n0-job-2"
        assert first.ckpt_dir != second.ckpt_dir  # nor one slot folder
        given = replace(spec, agent_dir_default=False)
        with pytest.raises(AgentDirBusy, match="one agent per agent folder"):
            claim_agent_dir(given)
    finally:
        lock1.release()
        lock2.release()
    third, lock3 = claim_agent_dir(spec)  # released: the first of the series again (a restarted agent rejoins it)
    lock3.release()
    assert third.agent_dir == first.agent_dir

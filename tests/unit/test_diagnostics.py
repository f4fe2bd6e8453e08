"""Stop-time diagnostics: the pure verdicts, the report merge, the simulated hardware of a local-cluster
node, and the promotion spec - no processes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from keel.agent.commands import PromotionError, promoted_spec, reshape_problem
from keel.agent.diagnostics import (
    DiagnosticsPolicy,
    LinkState,
    Mismatch,
    RequestError,
    RoundRequest,
    WorkerReport,
    all_gather_elements,
    bandwidth_gbps,
    compare_chunk,
    evaluate_all_gather,
    evaluate_all_to_all,
    evaluate_matmul,
    expected_chunk,
    gpu_faults,
    gpus_of,
    link_faults,
    load_request,
    matmul_error,
    merge_reports,
    missing_ranks_verdict,
    nic_baseline,
    read_links,
    round_port,
    simulated_gpus,
    timed_iterations,
)
from keel.agent.inspector.gpu import NvmlSnapshot
from keel.agent.launch_spec import LaunchSpec
from keel.cluster.local import FaultSpec, NodeInfo, apply_fault, seed_overlay_root
from keel.events.types import CheckResult

ALL = ["gpu_matmul", "intra_node_all_to_all", "inter_node_all_gather"]


def request(node: str = "n00", nodes: tuple[str, ...] = ("n00", "n01", "n02"), nproc: int = 2,
            **policy: object) -> RoundRequest:
    return RoundRequest(round=3, node_id=node, nodes=list(nodes), checks=ALL, nproc_per_node=nproc,
                        master_port=round_port(29500, 3), deadline_unix_s=0.0,
                        policy=DiagnosticsPolicy(**policy))  # type: ignore[arg-type]


# -- layout and formats ---------------------------------------------------------------------------------


def test_rounds_rendezvous_on_their_own_port_and_ranks_follow_the_command_order() -> None:
    assert round_port(29500, 0) == 30000 and round_port(29500, 7) == 30007
    r = request("n01", nproc=2)
    assert (r.node_index, r.world_size, r.global_rank(0), r.global_rank(1)) == (1, 6, 2, 3)
    assert [r.node_of_rank(k) for k in range(6)] == ["n00", "n00", "n01", "n01", "n02", "n02"]


def test_a_request_must_name_this_node_and_a_port(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not in the round's nodes"):
        RoundRequest(round=0, node_id="n09", nodes=["n00"], checks=ALL, nproc_per_node=1, master_port=1,
                     deadline_unix_s=0)
    with pytest.raises(ValueError, match="needs the round's master_port"):
        RoundRequest(round=0, node_id="n00", nodes=["n00"], checks=["inter_node_all_gather"], nproc_per_node=1,
                     deadline_unix_s=0)
    # A local-only round (a standby's self-check) needs no port.
    RoundRequest(round=0, node_id="n00", nodes=["n00"], checks=["gpu_matmul"], nproc_per_node=1, deadline_unix_s=0)
    bad = tmp_path / "request.json"
    bad.write_text(json.dumps({"round": 0, "node_id": "n00", "nodes": ["n00"], "checks": ["memtest"],
                               "nproc_per_node": 1, "deadline_unix_s": 0}))
    with pytest.raises(RequestError, match="checks"):
        load_request(bad)
    good = tmp_path / "good.json"
    good.write_text(request().model_dump_json())
    assert load_request(good) == request()


def test_the_all_gather_chunk_shrinks_with_the_world_to_bound_memory() -> None:
    policy = DiagnosticsPolicy()
    assert all_gather_elements(policy, 4) == 1 << 18  # 4 MiB gathered
    assert all_gather_elements(policy, 1024) == 1 << 16  # 256 MiB / (1024 ranks x 4 bytes)
    assert all_gather_elements(policy, 4096) == 1 << 14
    assert all_gather_elements(DiagnosticsPolicy(all_gather_max_bytes=4), 10**6) == 1


def test_the_all_gather_is_timed_several_times_only_when_a_bandwidth_floor_judges_it() -> None:
    assert timed_iterations(DiagnosticsPolicy()) == 1
    assert timed_iterations(DiagnosticsPolicy(min_bandwidth_gbps=10.0)) == 3
    assert timed_iterations(DiagnosticsPolicy(min_bandwidth_gbps=10.0, all_gather_iterations=5)) == 5


def test_every_gpu_of_the_node_is_tested_by_exactly_one_local_process() -> None:
    assert [gpus_of(lr, 2, 8) for lr in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [gpus_of(lr, 4, 2) for lr in range(4)] == [[0], [1], [], []]
    assert gpus_of(0, 1, 0) == []


# -- verdicts -------------------------------------------------------------------------------------------


def test_bandwidth_is_in_gigabits_per_second() -> None:
    assert bandwidth_gbps(125_000_000, 1.0) == pytest.approx(1.0)
    assert bandwidth_gbps(0, 1.0) is None and bandwidth_gbps(10, 0.0) is None


def test_matmul_within_tolerance_passes_and_wrong_or_nan_results_fail() -> None:
    policy = DiagnosticsPolicy()
    assert evaluate_matmul("gpu0", 3e-7, policy).passed
    wrong = evaluate_matmul("gpu3", 0.5, policy)
    assert not wrong.passed and "gpu3" in wrong.detail and "exceeds" in wrong.detail
    assert not evaluate_matmul("gpu0", math.inf, policy).passed
    assert not evaluate_matmul("gpu0", math.nan, policy).passed
    assert not evaluate_matmul("gpu0", 3e-7, DiagnosticsPolicy(matmul_rtol=1e-8)).passed


def test_matmul_error_of_a_float32_product_is_small_and_one_flipped_element_is_caught() -> None:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(128, 128, generator=generator)
    b = torch.randn(128, 128, generator=generator)
    c = a @ b
    assert matmul_error(torch, a.double(), b.double(), c) < DiagnosticsPolicy().matmul_rtol
    corrupted = c.clone()
    corrupted[5, 7] += 1.0  # a silent corruption of one element
    assert matmul_error(torch, a.double(), b.double(), corrupted) > DiagnosticsPolicy().matmul_rtol
    corrupted[0, 0] = float("nan")
    assert matmul_error(torch, a.double(), b.double(), corrupted) == math.inf


def test_chunks_are_distinct_per_sender_exact_in_float32_and_compared_element_wise() -> None:
    one, two = expected_chunk(torch, 1, 1000), expected_chunk(torch, 2, 1000)
    assert not torch.equal(one, two)
    assert torch.equal(one, expected_chunk(torch, 1, 1000))
    assert float(one.max()) < 2**24 and torch.equal(one, one.double().round().float())
    assert compare_chunk(torch, one.clone(), one) is None
    bad = one.clone()
    bad[10] += 3
    bad[20] = float("nan")
    mismatch = compare_chunk(torch, bad, one)
    assert mismatch is not None and (mismatch.elements, mismatch.of) == (2, 1000) and mismatch.max_abs_diff == math.inf


def test_all_gather_verdict_names_the_senders_of_wrong_data() -> None:
    r = request(nproc=2)
    result, suspects = evaluate_all_gather(r, {}, 6 * 2**20, 0.01, 0.5)
    assert result.passed and result.bandwidth_gbps == pytest.approx(6 * 2**20 * 8 / 0.01 / 1e9)
    assert "6 processes on 3 node(s)" in result.detail and suspects == []
    result, suspects = evaluate_all_gather(r, {4: Mismatch(3, 100, 7.0), 5: Mismatch(1, 100, 1.0)}, 1, 1.0, 0.5)
    assert not result.passed and suspects == ["n02"]
    assert "rank 4 (n02): 3 of 100 elements differ" in result.detail


def test_bandwidth_floor_is_off_by_default_and_fails_a_slow_world_without_naming_anyone() -> None:
    slow = 125_000  # bytes in one second: 0.001 Gbit/s
    assert evaluate_all_gather(request(), {}, slow, 1.0, 1.0)[0].passed
    result, suspects = evaluate_all_gather(request(min_bandwidth_gbps=10), {}, slow, 1.0, 1.0)
    assert not result.passed and suspects == [] and "below the floor of 10 Gbit/s" in result.detail
    assert evaluate_all_gather(request(min_bandwidth_gbps=0.0005), {}, slow, 1.0, 1.0)[0].passed


def test_peers_that_never_joined_are_named_by_node() -> None:
    result, suspects = missing_ranks_verdict(request(nproc=2), [2, 3], 30.0, 30.2)
    assert not result.passed and suspects == ["n01"]
    assert "rank(s) 2, 3 of node(s) n01 never joined" in result.detail and "30s" in result.detail


def test_all_to_all_verdict() -> None:
    assert evaluate_all_to_all({}, 4, 0.1).passed
    result = evaluate_all_to_all({2: Mismatch(5, 64, 2.0)}, 4, 0.1)
    assert not result.passed and "from local rank 2: 5 of 64" in result.detail


# -- merging the local processes' reports ----------------------------------------------------------------


def passed(check: str, **extra: object) -> CheckResult:
    return CheckResult(check=check, passed=True, **extra)  # type: ignore[arg-type]


def test_merge_passes_when_every_process_passed_and_keeps_the_slowest_bandwidth() -> None:
    r = request(nproc=2)
    reports = {
        lr: WorkerReport(local_rank=lr, finished=True, results=[
            CheckResult(check="gpu_matmul", passed=False, skipped=True, detail="no GPU"),
            passed("intra_node_all_to_all", duration_s=0.1),
            passed("inter_node_all_gather", bandwidth_gbps=5.0 + lr, duration_s=0.2 + lr)])
        for lr in range(2)
    }
    node = merge_reports(r, reports, {0: 0, 1: 0}, 1.5)
    assert node.passed and node.suspects == []
    by_check = {c.check: c for c in node.results}
    assert by_check["gpu_matmul"].skipped and not by_check["gpu_matmul"].passed
    assert by_check["inter_node_all_gather"].bandwidth_gbps == 5.0
    assert by_check["inter_node_all_gather"].duration_s == 1.2
    assert "gpu_matmul skipped (no GPU)" in node.detail


def test_merge_fails_a_check_that_one_process_failed_or_never_finished() -> None:
    r = request(nproc=3)
    reports = {
        0: WorkerReport(local_rank=0, finished=True, suspects=["n02"], results=[
            passed("gpu_matmul"), passed("intra_node_all_to_all"),
            CheckResult(check="inter_node_all_gather", passed=False, detail="n02 never joined")]),
        1: WorkerReport(local_rank=1, running="gpu_matmul"),  # hung in the GPU check, killed
        2: None,  # crashed before writing anything
    }
    node = merge_reports(r, reports, {0: 0, 1: None, 2: -9}, 20.0)
    assert not node.passed and node.suspects == ["n02"]
    by_check = {c.check: c for c in node.results}
    assert not any(c.passed for c in node.results)
    assert "local process 1 was still running at the deadline (killed) during gpu_matmul" in by_check["gpu_matmul"].detail
    assert "local process 2 died of signal SIGKILL" in by_check["gpu_matmul"].detail
    assert "n02 never joined" in by_check["inter_node_all_gather"].detail
    assert node.detail.startswith("gpu_matmul failed:")


# -- the simulated hardware of a local-cluster node -----------------------------------------------------


@pytest.fixture
def node(tmp_path: Path) -> NodeInfo:
    root = tmp_path / "n01" / "root"
    seed_overlay_root(root, gpus=2)
    return NodeInfo("n01", standby=False, agent_dir=tmp_path / "n01", root=root, pid=0)


def test_a_seeded_node_has_healthy_links_and_gpus(node: NodeInfo) -> None:
    baseline = nic_baseline(node.root)
    assert baseline == {"eth0": 0}
    assert link_faults(read_links(node.root), baseline) == []
    assert simulated_gpus(node.root) == (2, {})
    assert nic_baseline(Path("/")) is None  # nothing is simulated on a real machine


def test_a_link_down_or_flapping_since_the_baseline_keeps_the_node_out(node: NodeInfo) -> None:
    baseline = nic_baseline(node.root)
    apply_fault(node, FaultSpec(kind="nic-down", node="n01", params={"flaps": 2}), "f1")
    links = read_links(node.root)
    assert links["eth0"].up  # a flap leaves the link up
    assert link_faults(links, baseline) == ["eth0 flapped 2x (carrier_changes 0 -> 4)"]
    assert link_faults(links, nic_baseline(node.root)) == []  # a new baseline forgives the old flaps
    apply_fault(node, FaultSpec(kind="nic-down", node="n01"), "f2")
    assert link_faults(read_links(node.root), baseline) == ["eth0 is down (operstate down, carrier 0)"]


def test_every_link_is_judged_down_or_gone_and_flaps_count_from_the_baseline() -> None:
    links = {"eth0": LinkState("eth0", "up", 1, 40), "ib0": LinkState("ib0", "lowerlayerdown", 0, 3)}
    assert link_faults(links, None) == ["ib0 is down (operstate lowerlayerdown, carrier 0)"]
    # One carrier change (a link that went down, or came up) is not a flap; a link the baseline knew is
    # gone; a link down since before the baseline is still down.
    assert link_faults(links, {"eth0": 39, "eth1": 0}) == ["eth1 is gone", "ib0 is down (operstate lowerlayerdown, carrier 0)"]
    assert link_faults(links, {"eth0": 38}) == ["eth0 flapped 1x (carrier_changes 38 -> 40)",
                                                "ib0 is down (operstate lowerlayerdown, carrier 0)"]


def test_lost_and_xid_gpus_fail_the_matmul_naming_the_gpu(node: NodeInfo) -> None:
    apply_fault(node, FaultSpec(kind="gpu-lost", node="n01", params={"gpu": 1}), "f1")
    assert simulated_gpus(node.root)[1] == {1: "gpu1 is lost (GPU is lost)"}
    apply_fault(node, FaultSpec(kind="xid", node="n01", params={"gpu": 0, "xid": 79}), "f2")
    assert simulated_gpus(node.root)[1][0] == "gpu0 had XID 79 (GPU has fallen off the bus)"


def test_only_fatal_xids_and_uncorrectable_memory_count() -> None:
    snapshot = NvmlSnapshot.from_json({"device_count": 4, "devices": [
        {"index": 0, "xids": [{"seq": 1, "xid": 13}]},  # an application error: ignored
        {"index": 1, "ecc": {"volatile_dbe": 2}},
        {"index": 2, "remapped_rows": {"failure": True}},
    ]})
    assert gpu_faults(snapshot) == {1: "gpu1 has 2 uncorrectable ECC error(s)", 2: "gpu2: row remapping failed",
                                    3: "gpu3 is missing (NVML sees 4 device(s))"}


# -- promotion --------------------------------------------------------------------------------------------


def test_a_promoted_standby_takes_exactly_the_slice_of_its_new_node_rank() -> None:
    standby = LaunchSpec(nnodes=4, nproc_per_node=2, node_rank=3, master_addr="h", master_port=1,
                         command=("-m", "x"), node_id="s00", standby=True)
    spec = promoted_spec(standby, 1, [3, 2])
    assert (spec.node_rank, spec.standby, spec.node_id, spec.global_rank(0)) == (1, False, "s00", 2)
    assert standby.standby and standby.node_rank == 3  # the old spec is untouched (frozen)
    with pytest.raises(PromotionError, match=r"not node rank 1's slice \[2, 3\]"):
        promoted_spec(standby, 1, [2])
    with pytest.raises(PromotionError, match="outside 0..3"):
        promoted_spec(standby, 4, [8, 9])


def test_a_shrink_moves_a_worker_to_a_lower_node_rank_of_fewer_nodes_only() -> None:
    worker = LaunchSpec(nnodes=4, nproc_per_node=2, node_rank=3, master_addr="h", master_port=1,
                        command=("-m", "x"), node_id="n03")
    assert reshape_problem(worker, 2, 3) == ""
    assert "outside 0..2" in reshape_problem(worker, 3, 3)
    assert "cannot grow from 4 to 5 nodes" in reshape_problem(worker, 1, 5)
    standby = LaunchSpec(nnodes=4, nproc_per_node=2, node_rank=0, master_addr="h", master_port=1,
                         command=("-m", "x"), node_id="s00", standby=True)
    assert "is a standby" in reshape_problem(standby, 0, 3)

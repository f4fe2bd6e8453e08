"""Stop-time diagnostics rounds with real processes (no agent, no NATS): each node's side runs as
``python -m keel.agent.diagnostics`` through the agent's ``RoundProcess``, its local processes forked
and joined into real gloo worlds on this machine. Simulated nodes read their overlay roots, seeded and
faulted exactly as ``keel cluster`` / ``keel inject`` do."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from keel.agent.diagnostics import CHECKS, LOCAL_CHECKS, NodeReport, RoundProcess, RoundRequest, nic_baseline
from keel.cluster.local import FaultSpec, NodeInfo, apply_fault, rendezvous_base_port, seed_overlay_root

pytestmark = pytest.mark.integration


def make_nodes(directory: Path, names: list[str], gpus: int) -> dict[str, NodeInfo]:
    nodes = {}
    for name in names:
        root = directory / name / "root"
        seed_overlay_root(root, gpus=gpus)
        nodes[name] = NodeInfo(name, standby=False, agent_dir=directory / name, root=root, pid=0)
    return nodes


def run_round(directory: Path, nodes: dict[str, NodeInfo], *, nproc: int, timeout_s: float,
              faults: list[FaultSpec] = (), checks: tuple[str, ...] = CHECKS,  # type: ignore[assignment]
              order: list[str] | None = None) -> tuple[dict[str, NodeReport], float]:
    """Every node's side of one round at once; faults are applied after the baselines are taken (as
    the agent takes them when it starts). Returns the reports and the round's wall time."""
    baselines = {name: nic_baseline(node.root) for name, node in nodes.items()}
    for fault in faults:
        apply_fault(nodes[fault.node], fault, "test")
    port = rendezvous_base_port()
    started = time.monotonic()
    deadline = time.time() + timeout_s
    processes = {
        name: RoundProcess(RoundRequest(round=0, node_id=name, nodes=order or list(nodes), checks=list(checks),
                                        nproc_per_node=nproc, master_port=port, deadline_unix_s=deadline,
                                        root=str(node.root), nic_baseline=baselines[name]),
                           directory / name / "diagnostics")
        for name, node in nodes.items()
    }
    reports: dict[str, NodeReport] = {}
    while len(reports) < len(processes):
        assert time.monotonic() - started < timeout_s + 15, "RoundProcess.poll never gave a report"
        for name, process in processes.items():
            if name not in reports and (report := process.poll()) is not None:
                reports[name] = report
        time.sleep(0.05)
    return reports, time.monotonic() - started


def results(report: NodeReport) -> dict[str, tuple[bool, bool, str]]:
    return {r.check: (r.passed, r.skipped, r.detail) for r in report.results}


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_round_on_healthy_nodes_passes(tmp_path: Path, nproc: int) -> None:
    nodes = make_nodes(tmp_path, ["n00", "n01"], gpus=nproc)
    reports, wall_s = run_round(tmp_path, nodes, nproc=nproc, timeout_s=60)
    print(f"diagnostics round, 2 nodes x {nproc}: {wall_s:.2f}s wall")
    for name, report in reports.items():
        assert report.passed and report.suspects == [], (name, report)
        by_check = results(report)
        assert by_check["intra_node_all_to_all"][:2] == (True, False)
        assert by_check["inter_node_all_gather"][:2] == (True, False)
        assert f"{2 * nproc} processes on 2 node(s)" in by_check["inter_node_all_gather"][2]
        gather = next(r for r in report.results if r.check == "inter_node_all_gather")
        assert gather.bandwidth_gbps is not None and gather.bandwidth_gbps > 0
        # No CUDA here: the GPU self-test is skipped, neither passed nor failed (simulated GPUs healthy).
        assert by_check["gpu_matmul"][:2] == (False, True) and "no GPU" in by_check["gpu_matmul"][2]
    assert wall_s < 30


def test_a_node_whose_nic_is_down_fails_and_its_peer_names_it(tmp_path: Path) -> None:
    nodes = make_nodes(tmp_path, ["n00", "n01"], gpus=1)
    reports, wall_s = run_round(tmp_path, nodes, nproc=1, timeout_s=10, faults=[FaultSpec(kind="nic-down", node="n01")])
    down, peer = reports["n01"], reports["n00"]
    assert not down.passed and down.suspects == ["n01"]
    passed, _, detail = results(down)["inter_node_all_gather"]
    assert not passed and "eth0 is down" in detail and "do not join" in detail
    assert results(down)["intra_node_all_to_all"][0]  # the node's own processes still exchange data
    assert not peer.passed and peer.suspects == ["n01"]
    passed, _, detail = results(peer)["inter_node_all_gather"]
    assert not passed and "rank(s) 1 of node(s) n01 never joined" in detail
    assert wall_s < 10 + 3, "the round overran its deadline"


def test_a_flapping_rendezvous_host_is_named_by_the_nodes_that_could_not_reach_it(tmp_path: Path) -> None:
    nodes = make_nodes(tmp_path, ["n00", "n01", "n02"], gpus=1)
    # 30 s: three node processes import torch at once (seconds each on a loaded 2-core machine) before
    # the clients can even try the host; the check is about who is named, not how fast.
    reports, _ = run_round(tmp_path, nodes, nproc=1, timeout_s=30,
                           faults=[FaultSpec(kind="nic-down", node="n00", params={"flaps": 1})])
    assert "eth0 flapped 1x" in results(reports["n00"])["inter_node_all_gather"][2]
    for name in ("n01", "n02"):
        assert not reports[name].passed and reports[name].suspects == ["n00"], reports[name]
        assert "hosted by n00" in results(reports[name])["inter_node_all_gather"][2]


def test_a_node_with_a_lost_gpu_fails_its_local_self_check_naming_the_gpu(tmp_path: Path) -> None:
    nodes = make_nodes(tmp_path, ["s00"], gpus=2)
    reports, _ = run_round(tmp_path, nodes, nproc=2, timeout_s=30, checks=LOCAL_CHECKS,
                           faults=[FaultSpec(kind="gpu-lost", node="s00", params={"gpu": 1})])
    report = reports["s00"]
    assert not report.passed
    passed, skipped, detail = results(report)["gpu_matmul"]
    assert not passed and not skipped and "gpu1 is lost" in detail and "gpu0" not in detail
    assert results(report)["intra_node_all_to_all"][0]
    assert [r.check for r in report.results] == list(LOCAL_CHECKS)


def test_a_node_that_never_starts_is_named_when_the_deadline_passes(tmp_path: Path) -> None:
    nodes = make_nodes(tmp_path, ["n00"], gpus=1)
    # 12 s: the round's worker imports torch before its checks (over 5 s on 2 loaded cores), and the
    # inter-node check must still be waiting for n07 when the deadline comes.
    reports, wall_s = run_round(tmp_path, nodes, nproc=1, timeout_s=12, order=["n00", "n07"])
    report = reports["n00"]
    assert not report.passed and report.suspects == ["n07"], report
    assert "never joined" in results(report)["inter_node_all_gather"][2]
    assert wall_s < 12 + 3

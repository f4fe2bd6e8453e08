"""Fault injection on a simulated node's files, read back by the real probes (no processes needed)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keel.agent.inspector import InspectorCore, default_probes
from keel.cluster.local import ClusterError, FaultSpec, NodeInfo, apply_fault, inject, load_scenario, seed_overlay_root
from keel.infra.config import Settings

T0 = datetime(2026, 11, 29, 7, 0, tzinfo=UTC)


@pytest.fixture
def node(tmp_path: Path) -> NodeInfo:
    root = tmp_path / "n00" / "root"
    seed_overlay_root(root, gpus=2)
    return NodeInfo("n00", standby=False, agent_dir=tmp_path / "n00", root=root, pid=0)


def failed_checks(root: Path, steps: int = 1) -> dict[tuple[str, str], str]:
    probes = default_probes(root)
    core = InspectorCore("n00")
    state = core.initial_state()
    seen: dict[tuple[str, str], str] = {}
    for step in range(steps):
        state, events = core.step(state, [o for p in probes for o in p.collect()], T0 + timedelta(seconds=step))
        for event in events:
            seen[(event.component, event.check)] = event.status
    return {k: v for k, v in seen.items() if v != "healthy"}


def test_a_seeded_node_is_healthy(node: NodeInfo) -> None:
    assert failed_checks(node.root) == {}


@pytest.mark.parametrize(
    "fault, component",
    [
        (FaultSpec(kind="gpu-lost", node="n00", params={"gpu": 1}), "gpu"),
        (FaultSpec(kind="xid", node="n00", params={"xid": 79}), "gpu"),
        (FaultSpec(kind="disk-full", node="n00"), "disk"),
    ],
)
def test_hardware_faults_are_seen_by_the_probes(node: NodeInfo, fault: FaultSpec, component: str) -> None:
    probes = default_probes(node.root)
    core = InspectorCore("n00")
    state, _ = core.step(core.initial_state(), [o for p in probes for o in p.collect()], T0)
    apply_fault(node, fault, "f1")
    state, events = core.step(state, [o for p in probes for o in p.collect()], T0 + timedelta(seconds=1))
    [event] = [e for e in events if e.status != "healthy"]
    assert (event.component, event.status, event.confidence, event.is_fatal) == (component, "failed", "high", True)


def test_nic_down_after_the_first_sample_is_degraded_then_fatal_if_it_persists(node: NodeInfo) -> None:
    probes = default_probes(node.root)
    core = InspectorCore("n00")
    state, _ = core.step(core.initial_state(), [o for p in probes for o in p.collect()], T0)
    apply_fault(node, FaultSpec(kind="nic-down", node="n00"), "f1")
    statuses = []
    for second in range(1, 40):
        state, events = core.step(state, [o for p in probes for o in p.collect()], T0 + timedelta(seconds=second))
        statuses += [(second, e.status, e.is_fatal) for e in events if e.component == "nic"]
    assert statuses[0][1] == "degraded" and statuses[0][0] == 1
    assert statuses[-1][1:] == ("failed", True) and statuses[-1][0] >= 30


def test_workload_faults_go_to_the_fault_file_and_not_to_standbys(node: NodeInfo, tmp_path: Path) -> None:
    apply_fault(node, FaultSpec(kind="hang", node="n00", rank=3, params={"at_step": 7}), "f2")
    assert json.loads(node.fault_file.read_text()) == {"id": "f2", "kind": "hang", "rank": 3, "params": {"at_step": 7}}
    standby = NodeInfo("s00", standby=True, agent_dir=tmp_path / "s00", root=node.root, pid=0)
    with pytest.raises(ClusterError, match="standby"):
        apply_fault(standby, FaultSpec(kind="crash", node="s00"), "f3")
    with pytest.raises(ClusterError, match="no GPU 7"):
        apply_fault(node, FaultSpec(kind="gpu-lost", node="n00", params={"gpu": 7}), "f4")


def test_a_scenario_runs_its_faults_in_order_at_their_offsets(node: NodeInfo, tmp_path: Path) -> None:
    directory = tmp_path / "cluster"
    directory.mkdir()
    state = {"job_id": "j", "fault_injection": True, "nodes": [
        {"node_id": "n00", "standby": False, "agent_dir": str(node.agent_dir), "root": str(node.root), "pid": 0}]}
    (directory / "cluster.json").write_text(json.dumps(state))
    scenario = tmp_path / "s.yaml"
    scenario.write_text("faults:\n  - {at: 600ms, kind: nic-down, node: n00}\n  - {at: 0s, kind: slow, node: n00, "
                        "params: {fraction: 0.5}}\n")
    faults = load_scenario(scenario).faults
    start = time.monotonic()
    done = inject(Settings(), directory, faults, nats_url=None)
    assert time.monotonic() - start >= 0.6
    assert done[0].startswith("slow") and "eth0" in done[1]
    assert json.loads(node.fault_file.read_text())["kind"] == "slow"
    assert (node.root / "sys/class/net/eth0/operstate").read_text().strip() == "down"
    # A cluster started without fault injection: its ranks read no fault file, so `inject` refuses what they
    # would apply (workload faults and sdc) and says how to turn it on; hardware faults still go.
    node.fault_file.unlink()
    (directory / "cluster.json").write_text(json.dumps({**state, "fault_injection": False}))
    for kind in ("crash", "sdc"):
        with pytest.raises(ClusterError, match=f"runs without fault injection.*{kind}.*keel cluster up --fault-injection"):
            inject(Settings(), directory, [FaultSpec(kind=kind, node="n00")], nats_url=None)  # type: ignore[arg-type]
    assert not node.fault_file.exists() and not (node.root / "run/keel/sdc.json").exists()
    assert inject(Settings(), directory, [FaultSpec(kind="disk-full", node="n00")], nats_url=None)


def test_scenario_errors_name_the_file_and_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("faults:\n  - {kind: teleport, node: n00}\n")
    with pytest.raises(ClusterError, match=r"bad.yaml: faults.0.kind"):
        load_scenario(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("faults: []\n")
    with pytest.raises(ClusterError, match="faults"):
        load_scenario(empty)


def test_sdc_is_silent_to_the_probes_and_flips_the_bit_the_ranks_read(node: NodeInfo) -> None:
    import torch

    from keel.sdk.faults import SimulatedCorruption

    probes = default_probes(node.root)
    core = InspectorCore("n00")
    state, _ = core.step(core.initial_state(), [o for p in probes for o in p.collect()], T0)
    detail = apply_fault(node, FaultSpec(kind="sdc", node="n00", rank=2, params={"bit": 30, "index": 1}), "f5")
    assert "silently" in detail
    state, events = core.step(state, [o for p in probes for o in p.collect()], T0 + timedelta(seconds=1))
    assert [e for e in events if e.status != "healthy"] == []  # nothing for the inspector to see
    path = str(node.root / "run/keel/sdc.json")
    grads = torch.full((3,), 1e-3)
    assert SimulatedCorruption(path, rank=2).apply(grads) and grads[1] > 1e30 and grads[0] == grads[2]
    untouched = torch.full((3,), 1e-3)
    assert not SimulatedCorruption(path, rank=1).apply(untouched) and bool((untouched == 1e-3).all())
    with pytest.raises(ClusterError, match="bit in 0..31"):
        apply_fault(node, FaultSpec(kind="sdc", node="n00", params={"bit": 40}), "f6")

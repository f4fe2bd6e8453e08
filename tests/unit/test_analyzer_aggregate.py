"""Rung 3 stack aggregation on real py-spy dumps (tests/fixtures/stacks): the real 4-rank jobs as
captured, and 16-rank DP 4 x PP 2 x TP 2 jobs built by replicating the real dumps with planted faults."""

from __future__ import annotations

import dataclasses
import time

import pytest

from keel.analyzer.aggregate import (
    AggregationSettings,
    Placement,
    Topology,
    aggregate,
    covering_group,
    format_ranks,
)
from keel.rules.stacks import Frame, MissingEvidence, ProcessStacks, process_from_pyspy
from keel.workload.train import topology as workload_topology
from tests.fixtures.stacks.scenarios import (
    FIXTURES,
    HEALTHY,
    HUNG,
    STUCK_LOADER,
    manifest,
    real_processes,
    replicate,
    threads,
)

# DP 4 x PP 2 x TP 2, two ranks per node: a node holds one TP group; rank = (dp * 2 + pp) * 2 + tp
GRID16 = Topology.grid(dp=4, pp=2, tp=2, ranks_per_node=2)


def vanished(rank: int, role: str = "rank") -> MissingEvidence:
    """Missing evidence from what py-spy really printed for a vanished process."""
    info = manifest()["errors"]["vanished"]
    ev = process_from_pyspy(rank, role, info["pid"], info["returncode"],  # type: ignore[arg-type]
                            (FIXTURES / info["stdout_file"]).read_text(), (FIXTURES / info["file"]).read_text())
    assert isinstance(ev, MissingEvidence)
    return ev


# ------------------------------------------------------------------------------------ real 4-rank jobs


def test_real_hang_one_rank_stuck_while_the_others_wait_in_all_reduce() -> None:
    topo = Topology.from_workload(workload_topology(4, 1), nodes=[f"n{r}" for r in range(4)])
    v = aggregate(real_processes("hang"), topo)
    assert v.kind == "outliers" and v.actionable
    assert v.outlier_ranks == (3,) and v.outlier_nodes == ("n3",)
    assert v.outlier_roles == {3: ("rank",)}
    assert v.dominant_stack[-1].startswith("all_reduce (torch/distributed/distributed_c10d.py:")
    assert v.outlier_stacks[3][-1].startswith("pipeline_stage_forward (make_fixtures.py:")
    assert v.group_kind == "tp" and v.group_ranks == (3,) and v.group_nodes == ("n3",)
    assert v.healthy_ranks == (0, 1, 2) and v.missing == ()
    assert any("rank 3 is an outlier" in r and "pipeline_stage_forward" in r for r in v.reasons)


def test_real_dataloader_worker_stuck() -> None:
    topo = Topology.from_workload(workload_topology(4, 1), nodes=["n0", "n0", "n1", "n1"])
    v = aggregate(real_processes("dataloader"), topo)
    assert v.outlier_ranks == (3,)
    assert v.outlier_roles == {3: ("rank", "dataloader")}
    worker_clusters = [c for c in v.clusters if c.role == "dataloader"]
    assert [(len(c.ranks), c.healthy) for c in worker_clusters] == [(3, True), (1, False)]
    assert "StepDataset.__getitem__" in worker_clusters[1].signature[-1]
    assert any("a dataloader process differs" in r for r in v.reasons)
    # TP group [3] and node n1 = [2, 3] both cover it; the TP group is smaller
    assert v.group_kind == "tp" and v.group_nodes == ("n1",)


def test_real_pipeline_hang_evicts_the_pipeline_group() -> None:
    # DP 2 x PP 2: rank 1 stuck, its pipeline peer rank 0 waits in recv, ranks 2 and 3 in all_reduce
    topo = Topology.from_workload(workload_topology(4, 2), nodes=[f"n{r}" for r in range(4)])
    v = aggregate(real_processes("pipeline"), topo)
    assert v.kind == "outliers"
    assert v.outlier_ranks == (0, 1)
    assert v.outlier_stacks[0][-1].startswith("recv (torch/distributed/distributed_c10d.py:")
    assert v.outlier_stacks[1][-1].startswith("pipeline_stage_backward")
    assert v.group_kind == "pp" and v.group_ranks == (0, 1) and v.group_nodes == ("n0", "n1")


# ---------------------------------------------------------------------- 16 ranks from replicated dumps


def test_a_hung_rank_among_sixteen() -> None:
    v = aggregate(replicate(GRID16, {5: HUNG}), GRID16)
    assert v.kind == "outliers" and v.outlier_ranks == (5,)
    # TP group [4, 5] is node-2: the same size; TP comes first
    assert v.group_kind == "tp" and v.group_ranks == (4, 5) and v.group_nodes == ("node-2",)
    assert 5 not in v.healthy_ranks and len(v.healthy_ranks) == 15
    assert v.reasons[0].startswith("1 outlier rank(s) [5] on node(s) node-2: evict tp group")
    assert any("deliberate over-eviction: 1 rank(s)" in r for r in v.reasons)


def test_a_rank_stuck_in_its_dataloader_among_sixteen() -> None:
    v = aggregate(replicate(GRID16, {9: STUCK_LOADER}), GRID16)
    assert v.outlier_ranks == (9,) and v.outlier_roles == {9: ("rank", "dataloader")}
    assert v.group_kind == "tp" and v.group_ranks == (8, 9)


def test_only_the_dataloader_worker_differs() -> None:
    # the main process looks like everyone's; only its worker is stuck: seen through the child
    procs = replicate(GRID16)
    procs = [dataclasses.replace(p, threads=threads(*STUCK_LOADER, "dataloader"))
             if p.rank == 12 and p.role == "dataloader" else p for p in procs]
    v = aggregate(procs, GRID16)
    assert v.kind == "outliers" and v.outlier_ranks == (12,)
    assert v.outlier_roles == {12: ("dataloader",)}
    assert "StepDataset.__getitem__" in v.outlier_stacks[12][-1]
    assert len([c for c in v.clusters if c.role == "rank"]) == 1  # the main processes all agree


@pytest.mark.parametrize(
    ("bad", "kind", "ranks", "nodes"),
    [
        ((5, 7), "pp", (5, 7), ("node-2", "node-3")),  # same pipeline, other TP groups and nodes
        ((4, 5), "tp", (4, 5), ("node-2",)),  # one TP group (= node)
        # same DP group [1, 5, 9, 13] (4 nodes), but their two TP groups need only 2 nodes
        ((5, 13), "groups", (4, 5, 12, 13), ("node-2", "node-6")),
        ((0, 15), "groups", (0, 1, 14, 15), ("node-0", "node-7")),  # nothing in common
    ],
)
def test_two_bad_ranks_get_the_smallest_covering_group(bad: tuple[int, int], kind: str, ranks: tuple[int, ...],
                                                       nodes: tuple[str, ...]) -> None:
    v = aggregate(replicate(GRID16, dict.fromkeys(bad, HUNG)), GRID16)
    assert v.kind == "outliers" and v.outlier_ranks == bad
    assert (v.group_kind, v.group_ranks, v.group_nodes) == (kind, ranks, nodes)


def test_a_covering_group_over_the_job_fraction_is_the_job() -> None:
    choice = covering_group((5, 7), GRID16, job_fraction=0.1)
    assert choice.kind == "job" and choice.ranks == tuple(range(16)) and len(choice.nodes) == 8
    assert any("the whole job" in r for r in choice.reasons)
    assert covering_group((), GRID16).kind == "none"
    with pytest.raises(ValueError, match="not in the topology"):
        covering_group((16,), GRID16)


def test_covering_prefers_a_single_group_over_a_union_of_equal_cost() -> None:
    # ranks 4 and 6: PP group [4, 6] spans node-2 and node-3; the union of their TP groups too, with 4 ranks
    choice = covering_group((4, 6), GRID16)
    assert choice.kind == "pp" and choice.ranks == (4, 6)


# ------------------------------------------------------------------------------------- inconclusive


def test_all_ranks_identical_is_inconclusive() -> None:
    v = aggregate(replicate(GRID16), GRID16)
    assert v.kind == "inconclusive" and not v.actionable
    assert v.outlier_ranks == () and v.group_kind == "none" and v.group_ranks == ()
    assert "all 16 observed main processes show the same stack" in v.reasons[0]
    assert len(v.healthy_ranks) == 16


def test_two_clusters_of_equal_size_are_inconclusive() -> None:
    v = aggregate(replicate(GRID16, dict.fromkeys(range(8), HUNG)), GRID16)
    assert v.kind == "inconclusive" and v.group_kind == "none"
    assert "2 clusters of equal size 8: no majority" in v.reasons[0]


# -------------------------------------------------------------------------------- missing evidence


def test_a_vanished_rank_is_reported_missing_never_healthy() -> None:
    procs = replicate(GRID16, {5: HUNG}, skip=frozenset({3}))
    v = aggregate(procs, GRID16, missing=[vanished(3)])
    assert v.kind == "outliers" and v.outlier_ranks == (5,)  # 1 outlier + 1 unseen cannot beat 14
    assert v.missing_ranks == (3,) and [m.rank for m in v.missing] == [3]
    assert 3 not in v.healthy_ranks and 3 not in v.outlier_ranks and len(v.healthy_ranks) == 14
    assert any("[3] could not be seen" in r and "Failed to get process executable name" in r for r in v.reasons)


def test_missing_evidence_that_could_change_the_majority_is_inconclusive() -> None:
    # the real 4-rank hang with rank 2's py-spy failing: 2 healthy, 1 outlier, 1 unseen
    procs = [p for p in real_processes("hang") if p.rank != 2]
    v = aggregate(procs, Topology.grid(dp=4, pp=1), missing=[vanished(2)])
    assert v.kind == "inconclusive" and v.group_kind == "none" and not v.actionable
    assert "the missing evidence could change the majority" in v.reasons[0]
    assert v.outlier_ranks == (3,)  # still named, as a suspect
    assert v.missing_ranks == (2,) and 2 not in v.healthy_ranks


def test_ranks_with_no_evidence_at_all_are_missing() -> None:
    v = aggregate(replicate(GRID16, {5: HUNG}, skip=frozenset({10, 11})), GRID16)
    assert v.missing_ranks == (10, 11)
    assert [m.reason for m in v.missing] == ["no stack evidence received"] * 2
    assert v.outlier_ranks == (5,) and not {10, 11} & set(v.healthy_ranks)


def test_identical_stacks_with_an_unseen_rank_point_at_it() -> None:
    v = aggregate(replicate(GRID16, skip=frozenset({6})), GRID16, missing=[vanished(6)])
    assert v.kind == "inconclusive" and v.missing_ranks == (6,)
    assert "the unseen rank(s) [6] may hold the fault" in v.reasons[0]
    assert 6 not in v.healthy_ranks


def test_a_missing_child_is_listed_but_the_rank_is_seen() -> None:
    procs = [p for p in replicate(GRID16, {5: HUNG}) if not (p.rank == 4 and p.role == "dataloader")]
    v = aggregate(procs, GRID16, missing=[vanished(4, "dataloader")])
    assert v.missing_ranks == () and [(m.rank, m.role) for m in v.missing] == [(4, "dataloader")]
    assert v.outlier_ranks == (5,) and 4 in v.healthy_ranks
    assert any("child process(es) of rank(s) [4] could not be seen" in r for r in v.reasons)


def test_no_evidence_at_all() -> None:
    v = aggregate([], GRID16, missing=[vanished(r) for r in range(16)])
    assert v.kind == "inconclusive" and v.missing_ranks == tuple(range(16)) and v.healthy_ranks == ()
    assert "no rank's main process could be seen" in v.reasons[0]


# ------------------------------------------------------------------------------ input and settings


def test_inconsistent_input_is_refused() -> None:
    procs = replicate(GRID16)
    with pytest.raises(ValueError, match="two main processes"):
        aggregate([*procs, procs[0]], GRID16)
    with pytest.raises(ValueError, match="not a rank of this 16-rank job"):
        aggregate([dataclasses.replace(procs[0], rank=16)], GRID16)
    with pytest.raises(ValueError, match="both captured and reported missing"):
        aggregate(procs, GRID16, missing=[vanished(0)])
    with pytest.raises(ValueError, match="healthy_fraction"):
        AggregationSettings(healthy_fraction=1.0)


def test_line_numbers_can_be_ignored() -> None:
    # rank 2 runs the same functions, one line further on in its outermost frame
    procs = replicate(GRID16, children=False)
    main = procs[2].threads
    moved = []
    for t in main:
        if t.is_main:
            outer = t.frames[-1]
            t = dataclasses.replace(t, frames=(*t.frames[:-1], Frame(outer.name, outer.filename, outer.short_filename,
                                                                     outer.line + 1, outer.module, outer.is_entry)))
        moved.append(t)
    procs[2] = dataclasses.replace(procs[2], threads=tuple(moved))
    assert aggregate(procs, GRID16).outlier_ranks == (2,)
    assert aggregate(procs, GRID16, settings=AggregationSettings(keep_lines=False)).kind == "inconclusive"


def test_topology_from_the_workloads_shape() -> None:
    topo = Topology.from_workload(workload_topology(8, 2), nodes=[f"n{r // 2}" for r in range(8)])
    assert topo.placements[5] == Placement(node="n2", tp=(5,), pp=(4, 5), dp=(1, 3, 5, 7))
    assert topo.node_ranks["n2"] == (4, 5)
    # Topology.grid with tp=1 is exactly the workload's layout
    grid = Topology.grid(dp=4, pp=2, ranks_per_node=2, node_prefix="n")
    assert all(grid.placements[r] == topo.placements[r] for r in range(8))
    mapped = Topology.from_mapping({r: {"node": p.node, "pp": list(p.pp), "dp": list(p.dp)}
                                    for r, p in topo.placements.items()})
    assert mapped.placements == topo.placements


def test_topology_is_validated() -> None:
    with pytest.raises(ValueError, match="not a member of its own pp group"):
        Topology.from_mapping({0: {"node": "a", "pp": [1], "dp": [0]}, 1: {"node": "a", "pp": [1], "dp": [1]}})
    with pytest.raises(ValueError, match="cover ranks 0..1"):
        Topology.from_mapping({0: {"node": "a", "pp": [0], "dp": [0]}, 2: {"node": "a", "pp": [2], "dp": [2]}})
    with pytest.raises(ValueError, match="outside the world"):
        Topology.from_mapping({0: {"node": "a", "pp": [0, 5], "dp": [0]}})
    g = Topology.grid(dp=4, pp=2, tp=2, ranks_per_node=2)
    assert g.groups_of(5) == {"tp": (4, 5), "pp": (5, 7), "dp": (1, 5, 9, 13), "node": (4, 5)}


def test_format_ranks() -> None:
    assert format_ranks([7, 0, 1, 2, 3, 9]) == "[0-3, 7, 9]"
    assert format_ranks(range(0, 40, 2), limit=3) == "[0, 2, 4, ... (20 ranks)]"


def test_sixteen_thousand_ranks_within_two_seconds() -> None:
    topo = Topology.grid(dp=1024, pp=8, tp=2, ranks_per_node=8)
    procs = replicate(topo, {8195: HUNG, 8197: HUNG})
    started = time.perf_counter()
    v = aggregate(procs, topo)
    elapsed = time.perf_counter() - started
    assert v.outlier_ranks == (8195, 8197)
    assert v.group_kind == "node" and v.group_nodes == ("node-1024",)
    assert len(v.healthy_ranks) == 16_382
    assert elapsed <= 2.0, f"aggregating 16,384 ranks took {elapsed:.2f}s"


def test_healthy_source_is_really_waiting_in_a_collective() -> None:
    # guards the fixtures: the replicated "healthy" dump is a rank blocked in all_reduce
    procs = [ProcessStacks(pid=1, role="rank", threads=threads(*HEALTHY), rank=0)]
    v = aggregate(procs, Topology.grid(dp=1, pp=1))
    assert v.dominant_stack[-1].startswith("all_reduce")

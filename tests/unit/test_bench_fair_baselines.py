"""The arithmetic behind issue 17's fair baselines: bench/hot_update.py's deploy by checkpoint and requeue
(its phases add up to the time to new code) and bench/recovery.py's figures corrected for packing 4 nodes
onto the host's cores (raw - (packed restart - one node's restart alone)), with the baselines' hang,
which holds the 600 s collective timeout as a constant, kept out of the measured keys."""

from __future__ import annotations

from typing import Any

import pytest

from bench.hot_update import checkpointed_requeue_phases
from bench.recovery import (
    FULL,
    PG_TIMEOUT_S,
    minimum_ratio,
    packing_corrected_s,
    restart_cost_s,
    single_node_reference_s,
    summarise,
)


def test_a_checkpointed_requeue_splits_into_phases_that_add_up_to_the_time_to_new_code() -> None:
    phases = checkpointed_requeue_phases(order_at=100.0, saved_at=100.2, gone_at=101.5, main_at=110.0,
                                         resumed_at=113.0, back_at=113.0)
    assert phases == {"save": 0.2, "stop": 1.3, "restart": 8.5, "setup_and_restore": 3.0, "recompute": 0.0}
    assert sum(phases.values()) == pytest.approx(13.0)


def test_a_missing_mark_moves_its_time_into_the_next_phase_and_the_total_is_kept() -> None:
    phases = checkpointed_requeue_phases(order_at=100.0, saved_at=None, gone_at=101.0, main_at=None,
                                         resumed_at=108.0, back_at=109.5)
    assert phases == {"save": 0.0, "stop": 1.0, "restart": 0.0, "setup_and_restore": 7.0, "recompute": 1.5}
    assert sum(v or 0.0 for v in phases.values()) == pytest.approx(9.5)


def test_the_restart_cost_is_restart_plus_setup_and_restore() -> None:
    assert restart_cost_s({"detection": 2.0, "restart": 9.1, "setup_and_restore": 5.6, "recompute": 8.9}) == 14.7
    assert restart_cost_s({"detection": 2.0}) is None
    assert restart_cost_s(None) is None


def test_the_correction_removes_only_what_packing_added_to_the_restart() -> None:
    # 25.3 s lost, 14.7 s of it restarting packed; 4.0 s alone: 10.7 s were the packing's.
    assert packing_corrected_s(25.3, 14.7, 4.0) == pytest.approx(14.6)
    # A single-node restart slower than the packed one (noise) raises the figure: not clamped.
    assert packing_corrected_s(1.2, 0.7, 0.9) == pytest.approx(1.4)
    assert packing_corrected_s(None, 14.7, 4.0) is None
    assert packing_corrected_s(25.3, 14.7, None) is None


def test_each_restart_is_corrected_by_its_own_systems_single_node_restart() -> None:
    alone: dict[str, float | None] = {"keel": 0.6, "torchrun": 4.0, "requeue": 5.5}
    assert single_node_reference_s("keel", "node-lost", alone) == 0.6
    assert single_node_reference_s("torchrun", "crash", alone) == 4.0
    assert single_node_reference_s("requeue", "hang", alone) == 5.5
    # torchrun's lost node: the replacement's fresh launcher beside restarted workers: the slower one.
    assert single_node_reference_s("torchrun", "node-lost", alone) == 5.5
    assert single_node_reference_s("torchrun", "node-lost", {"torchrun": 4.0, "requeue": None}) is None


def test_the_minimum_ratio_needs_crash_and_lost_node() -> None:
    assert minimum_ratio({"crash": 20.9, "node-lost": 8.6, "hang": None}) == 8.6
    assert minimum_ratio({"crash": 20.9, "node-lost": None, "hang": 23.3}) is None


def _trial(kind: str, lost_s: float, restart: float, setup: float, derived: bool = False) -> dict[str, Any]:
    return {"kind": kind, ("lost_s_derived" if derived else "lost_s"): lost_s,
            "phases_s": {"detection": PG_TIMEOUT_S if derived else 1.0, "decision": 0.0, "restart": restart,
                         "setup_and_restore": setup, "recompute": 1.0}}


def test_the_summary_keeps_the_baselines_hang_apart_and_corrects_every_system() -> None:
    runs = {
        "keel": {"trials": [_trial("crash", 2.0, 0.3, 0.5), _trial("node-lost", 4.0, 0.4, 0.6),
                            _trial("hang", 10.0, 0.4, 0.6)]},
        "torchrun": {"trials": [_trial("crash", 20.0, 9.0, 5.0), _trial("node-lost", 30.0, 15.0, 5.0),
                                _trial("hang", PG_TIMEOUT_S + 16.0, 9.0, 5.0, derived=True)]},
        "requeue": {"trials": [_trial("crash", 22.0, 10.0, 5.0), _trial("node-lost", 24.0, 10.0, 5.0),
                               _trial("hang", PG_TIMEOUT_S + 17.0, 10.0, 5.0, derived=True)]},
    }
    single = {"keel": {"restart_s": 0.6}, "torchrun": {"restart_s": 4.0}, "requeue": {"restart_s": 6.0}}
    result = summarise(FULL, None, None, runs, [], 1.0, single)

    assert result["lost_s_torchrun"]["hang"] is None  # the constant is not a measurement
    assert result["lost_s_torchrun_derived"] == {"hang": PG_TIMEOUT_S + 16.0}
    assert result["ratios_by_kind"]["torchrun"] == {"crash": 10.0, "node-lost": 7.5, "hang": None}
    assert result["ratio_vs_torchrun"] == 7.5
    assert "what_if_save_cost" not in result

    corrected = result["lost_s_corrected_for_packing"]
    assert corrected["keel"] == {"crash": pytest.approx(1.8), "node-lost": pytest.approx(3.6), "hang": pytest.approx(9.6)}
    assert corrected["torchrun"]["crash"] == pytest.approx(20.0 - (14.0 - 4.0))
    assert corrected["torchrun"]["node-lost"] == pytest.approx(30.0 - (20.0 - 6.0))  # the slower single restart
    assert corrected["requeue"]["crash"] == pytest.approx(22.0 - (15.0 - 6.0))
    assert corrected["torchrun"]["hang"] is None
    assert result["lost_s_corrected_for_packing_derived"]["torchrun"]["hang"] == pytest.approx(PG_TIMEOUT_S + 16.0 - 10.0)
    assert result["ratios_by_kind_corrected_for_packing"]["torchrun"]["crash"] == round(10.0 / 1.8, 2)
    assert result["ratio_vs_requeue_corrected_for_packing"] == round(min(13.0 / 1.8, 15.0 / 3.6), 2)

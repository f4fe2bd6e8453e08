"""Every benchmark's ``--smoke`` run, in a subprocess as a user runs it, so none rots between full runs.

Each starts its own real servers (NATS, PostgreSQL, from the embedded wheels) and real processes, at
tiny sizes; the assertions are on the keys the docs and results files rely on and on their sanity (a
rate is a positive number, a verdict is right, the provenance is there), not on targets, which tiny
sizes on a shared machine cannot meet. A case is (module, the keys it must write, a check of the figures).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PROVENANCE = ("commit", "date", "cores", "cpu_model", "python", "torch", "command")


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def analyzer_sane(r: dict[str, Any]) -> None:
    assert [row["ranks"] for row in r["whole_path_by_ranks"]] == [128, 512]
    for row in r["whole_path_by_ranks"]:
        assert row["correct"], row["verdict"]  # the culprits found, through the whole path
        assert all(positive(row[k]) for k in ("decode_s", "judge_s", "total_s", "parse_s", "wire_mb"))
        assert row["total_s"] >= row["decode_s"] + row["judge_s"]
    assert r["replays_by_machines"] == {"24": 2} and r["sdc_all_correct"] == {"24": True}
    assert positive(r["capture_s_node"]) and r["capture_processes"] == 4


def bus_sane(r: dict[str, Any]) -> None:
    for mode in ("sync_always", "sync_default"):
        assert positive(r["raw_jetstream_eps"][mode]) and positive(r["persisted_eps"][mode])
        assert r["raw_jetstream_window"][mode] in (256, 300, 1000)  # the best of the windows tried, each <= the count
    assert positive(r["raw_copy_rps"]) and positive(r["sa_insert_rps"])
    assert positive(r["p99_ms"]) and r["latency_lost"] == 0
    assert r["replay_events"] >= 4000 and positive(r["replay_eps"]) and positive(r["replay_verify_eps"])
    # The realistic log: the deciders decided, and the replay found every decision again (else it raises).
    assert r["replay_decisions_verified"]["controller"] >= 10
    assert r["replay_decisions_verified"]["checkpoint-broker"] >= 10
    assert r["replay_log_by_kind"]["controller:IncidentOpened"] == 2


def control_plane_sane(r: dict[str, Any]) -> None:
    assert positive(r["recorder_lag_p99_s"]) and r["recorder_lag_p99_s"] < 60
    assert r["recorder_lag"]["lost"] == 0 and r["recorder_lag"]["events"] > 100


def cold_start_sane(r: dict[str, Any]) -> None:
    assert set(r["cold_start_s"]) == {"11000", "12000"}
    assert all(positive(v) and v < 120 for v in r["cold_start_s"].values())
    assert positive(r["cold_start_growth"])


def adds_up(trial: dict[str, Any]) -> bool:
    """A trial's phases, each positive or zero, add up to its lost time (rounding apart)."""
    phases = trial["phases_s"].values()
    return all(v is not None and v >= 0 for v in phases) and abs(sum(phases) - trial["lost_s"]) < 0.01


def recovery_sane(r: dict[str, Any]) -> None:
    assert r["mode"] == "smoke" and r["mode_detail"]["nodes"] == 2 and r["failures"] == []
    # One Keel crash and one torchrun crash, measured; nothing else run (a requeue only derived).
    none = {"crash": 0, "node-lost": 0, "hang": 0}
    assert r["trials"] == {"keel": {**none, "crash": 1}, "torchrun": {**none, "crash": 1}, "requeue": none}
    assert {"keel node-lost", "keel hang", "torchrun node-lost", "single_node"} <= set(r["skipped"])
    assert positive(r["lost_s_keel"]["crash"]) and positive(r["lost_s_torchrun"]["crash"])
    assert positive(r["ratios_by_kind"]["torchrun"]["crash"])
    # Keel's crash recovered: the controller's incident resolved as recovered, a new generation back at the
    # fault's step, restored from a step at most the fault's.
    (keel,) = r["keel_run"]["trials"]
    assert keel["incident"]["outcome"] == "recovered" and keel["new_generation"] > keel["generation"]
    assert 0 <= keel["restored_step"] <= keel["s_f"] and adds_up(keel)
    (torchrun,) = [t for t in r["torchrun_run"]["trials"] if "derived_from" not in t]  # the hang is derived
    assert torchrun["kind"] == "crash" and 0 <= torchrun["restored_step"] <= torchrun["s_f"]
    assert positive(torchrun["lost_measured_s"]) and positive(torchrun["phases_s"]["detection"])
    assert positive(r["save_cost_s"]) and r["persist_every_steps"] >= 1
    assert positive(r["requeue_run"]["relaunch"]["lost_after_stop_s"])


def hot_update_sane(r: dict[str, Any]) -> None:
    assert r["mode"] == "smoke" and r["failures"] == []
    (inplace,) = r["inplace"]["trials"]
    (requeue,) = r["requeue"]["trials"]
    assert r["requeue"]["sigkill_trials"] == [] and "requeue_sigkill" in r["skipped"]
    assert positive(r["inplace_s"]) and positive(r["requeue_s"]) and positive(r["ratio"])
    assert r["requeue_sigkill_s"] is None and r["ratio_sigkill"] is None and r["met"] is None
    # In place: the new version applied, the job back at the deploy's step from a restore.
    assert inplace["version"] and inplace["restored_step"] >= 0 and adds_up(inplace)
    # Checkpointed: the step saved at SIGTERM is the step restored, so nothing to recompute.
    assert requeue["restored_step"] == requeue["saved_step"] >= requeue["s_d"] and adds_up(requeue)
    assert requeue["phases_s"]["recompute"] == 0.0


def ops_sane(r: dict[str, Any]) -> None:
    assert r["mode"] == "smoke" and r["failures"] == [], r["failures"]
    assert r["notify_received"] == r["notify_count"] == 10 and 0 < r["notify_p50_s"] <= r["notify_p99_s"] <= 2
    # The receiver refused during the outage, the notifier retried, and every incident arrived in the end.
    assert r["outage_refusals"] >= 1 and r["outage_deliveries_retried"] >= 1 and r["notify_lost"] == 0
    # The API answered every request of the load process (a non-200 fails the run) on every route: the first page of
    # incidents, older pages (read from the store) and timelines; the figure is the worst of the three.
    assert r["api_log_events"] == 3000 and r["api_incidents"] == 20 and r["api_requests"] > 10
    assert 0 < r["api_list_p50_ms"] <= r["api_list_p99_ms"] and 0 < r["api_timeline_p50_ms"] <= r["api_timeline_p99_ms"]
    assert 0 < r["api_list_older_p50_ms"] <= r["api_list_older_p99_ms"]
    assert r["api_p99_ms"] == max(r["api_list_p99_ms"], r["api_list_older_p99_ms"], r["api_timeline_p99_ms"])
    # And again with no parsed events kept (``api.parsed_events_kept: 0``): every route answered there too.
    assert r["api_unkept_requests_per_s"] > 0 and 0 < r["api_unkept_list_older_p50_ms"] <= r["api_unkept_list_older_p99_ms"]
    assert r["api_unkept_timeline_p99_ms"] > 0


CASES: list[tuple[list[str], tuple[str, ...], Callable[[dict[str, Any]], None]]] = [
    (["-m", "bench.analyzer"], ("whole_path_by_ranks", "whole_path_s_16k", "targets"), analyzer_sane),
    (["bench/bus.py"], ("raw_jetstream_eps", "persisted_eps", "replay_eps", "targets"), bus_sane),
    (["-m", "bench.control_plane"], ("recorder_lag_p99_s", "targets"), control_plane_sane),
    (["-m", "bench.cold_start"], ("cold_start_s", "cold_start_growth"), cold_start_sane),
    (["-m", "bench.recovery"], ("lost_s_keel", "lost_s_torchrun", "lost_s_requeue", "ratios_by_kind", "phases_s",
                                "trials", "keel_run", "torchrun_run", "skipped", "load_average_at_start",
                                "load_average_at_end", "save_cost_s", "persist_every_steps"), recovery_sane),
    (["-m", "bench.hot_update"], ("inplace_s", "requeue_s", "ratio", "requeue_sigkill_s", "ratio_sigkill", "inplace",
                                  "requeue", "skipped", "load_average_at_start", "load_average_at_end"),
     hot_update_sane),
    (["-m", "bench.ops"], ("notify_p50_s", "notify_p99_s", "notify_lost", "outage_drain_s", "api_p99_ms"), ops_sane),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("command", "keys", "sane"), CASES, ids=[c[0][-1] for c in CASES])
def test_a_benchmark_smoke_run_writes_sane_figures(tmp_path: Path, command: list[str], keys: tuple[str, ...],
                                                    sane: Callable[[dict[str, Any]], None]) -> None:
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, *command, "--smoke", "--json", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=230, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads(out.read_text())
    missing = [k for k in (*PROVENANCE, *keys) if k not in result]
    assert not missing, f"missing keys {missing}"
    assert "--smoke" in result["command"] and result["cores"] >= 1
    sane(result)

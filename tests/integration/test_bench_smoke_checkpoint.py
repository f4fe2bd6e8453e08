"""``python -m bench.checkpoint --smoke`` end to end, so the checkpoint benchmark cannot rot between its full
runs: real worker processes, the real Checkpointer, the node agent's own checkpoint code (``NodeCheckpointing``
over ``GrpcTransport``) for the gRPC backup and the persistent tier, every restore tier timed with its
verification. Tiny sizes: it checks the bench works and its figures
are sane (positive, restores bitwise right), not the figures themselves."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_checkpoint_bench_smoke_runs_and_reports_verified_restores(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "-m", "bench.checkpoint", "--smoke", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fig = json.loads(out.read_text())

    prov = fig["provenance"]
    assert prov["command"].startswith("python -m bench.checkpoint --smoke") and prov["cores"] >= 1
    assert len(prov["commit"]) >= 40 and prov["date"] and "cpu_model" in prov
    assert fig["config"]["mode"] == "smoke" and fig["failed"] == {}

    # Every tier of Keel restored, each time bitwise right, its verification inside the time.
    for key in ("restore_s_memory", "restore_s_peer", "restore_s_disk", "restore_s_torch_load"):
        assert isinstance(fig[key], float) and fig[key] > 0, key
    assert fig["restore_verified"]["keel_memory"] is True
    assert fig["restore_verified"]["keel_peer"] is True
    assert fig["restore_verified"]["keel_disk"] is True
    assert fig["restore_verified"]["torch_load"] is True
    assert all(len(runs) == fig["config"]["restore_repeats"] for runs in fig["restore_s_runs"].values())
    assert fig["restore_s_memory_agent_verified"] > 0 and fig["restore_verify_s_memory_agent"] > 0

    keel = fig["variants"]["keel"]
    assert keel["steps_per_s"] > 0 and keel["blocking_ms_mean"] > 0 and keel["host_bytes_per_rank"] > 0
    assert fig["keel_agent"]["sends"] >= 1 and fig["keel_agent"]["persists"]  # the agent's duties ran
    assert fig["keel_agent"]["agent_code"].startswith("keel.agent.checkpointing.NodeCheckpointing")
    assert not fig["keel_agent"]["send_errors"]
    assert fig["agent_sync_ms_keel"] is not None and fig["agent_sync_ms_keel"] >= 0  # timed in the block

    # The FSDP2 variant (two ranks, Keel and DCP async_save on the same sharded state): measured, restores bitwise.
    assert fig["blocking_ms_keel_fsdp"] > 0 and fig["blocking_ms_dcp_async_fsdp"] > 0
    assert fig["blocking_ratio_vs_dcp_async_fsdp"] == fig["blocking_ms_dcp_async_fsdp"] / fig["blocking_ms_keel_fsdp"]
    assert fig["restore_s_keel_fsdp"] > 0 and fig["restore_s_dcp_fsdp"] > 0
    assert fig["restore_fsdp_bitwise_keel"] is True and fig["restore_fsdp_bitwise_dcp"] is True
    assert fig["restore_reshard_bitwise_keel"] is True and fig["restore_reshard_bitwise_dcp"] is True
    assert fig["restore_s_reshard"] > 0 and fig["restore_s_dcp_reshard"] > 0
    assert fig["blocking_ms_keel_fsdp_median"] > 0 and len(fig["fsdp_measured_by_rank"]["keel_blocking_s"]) == 2

    if importlib.util.find_spec("dlrover") is None:
        assert "dlrover" in fig["skipped"] and "DLRover is not installed" in proc.stdout
    else:
        assert fig["restore_s_dlrover_memory"] > 0 and fig["restore_verified"]["dlrover_memory"] is True

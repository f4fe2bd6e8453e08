"""The detection benchmark's smoke mode runs end to end on the code as it is (so the benchmark cannot rot
between full runs): one round of every fault kind on a real local cluster, each detected, no false hang."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_detection_bench_smoke_run_detects_every_kind_it_injects(tmp_path: Path) -> None:
    out = tmp_path / "detection.json"
    run = subprocess.run([sys.executable, "-m", "bench.detection", "--smoke", "--json", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "smoke" and result["false_hangs"] == 0, result["false_hang_events"]
    injected = ["crash", "hang", "gpu-lost", "xid", "nic-down", "disk-full",
                "oom_kernel" if result["oom_kernel_works"] else "oom_python"]
    for kind in injected:
        assert result["trials"][kind] == 1 and result["trials_missed"][kind] == 0, (kind, result["trial_details"])
        assert 0 < result["detect_s"][kind] <= result["targets_s"][kind], (kind, result["detect_s"], result["trial_details"])
    assert result["peer_detect_s"] == {} and result["cores"] and result["commit"] and "bench.detection --smoke" in result["command"]

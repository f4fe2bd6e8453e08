"""bench/fleet.py's smoke mode (seconds): every key the issue names, sane figures, the baselines below Keel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_fleet_benchmark_smoke_run_writes_sane_figures(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    done = subprocess.run([sys.executable, "-m", "bench.fleet", "--smoke", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    r = json.loads(out.read_text())
    for key in ("commit", "date", "cores", "cpu_model", "command", "ettr", "worst_window_min", "lost_h_by_mechanism",
                "sim_wall_s", "gpus", "seeds", "sensitivity", "per_seed"):
        assert key in r, key
    assert "--smoke" in r["command"] and r["gpus"] == 32 * 8
    systems = {"keel", "keel_no_standby", "keel_no_analyzer", "keel_no_memory_ckpt", "keel_no_hot_update",
               "conventional", "torchelastic", "oracle"}
    assert set(r["ettr"]) == systems and all(0 < v <= 1 for v in r["ettr"].values())
    assert r["ettr"]["oracle"] >= r["ettr"]["keel"] > r["ettr"]["conventional"]
    assert set(r["sensitivity"]) == {"x0.5", "x2", "x4"}

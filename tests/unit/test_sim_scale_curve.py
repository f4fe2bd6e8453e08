"""bench/fleet.py --scale-curve: Keel and the baselines at each machine count, with what simulating Keel cost,
written to its own results file."""

from __future__ import annotations

import json
from pathlib import Path

from bench.fleet import main


def test_the_scale_curve_writes_one_point_per_machine_count(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    assert main(["--scale-curve", "16,48", "--days", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "scale_curve" and r["days"] == 2.0 and "commit" in r and "cores" in r
    assert [p["gpus"] for p in r["points"]] == [128, 384]
    for point in r["points"]:
        assert set(point["ettr"]) == {"keel", "conventional", "torchelastic", "oracle"}
        assert point["ettr"]["oracle"] >= point["ettr"]["keel"] > 0 and point["keel_events"] > 0
        assert point["keel_us_per_event"] > 0
    # Three times the machines: more failures and more events for Keel's controller.
    assert r["points"][1]["keel_events"] > r["points"][0]["keel_events"]

"""The checked-in protobuf code matches proto/ and round-trips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from keel.protocol import node_local_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iproto/keel/agent/v1", f"--python_out={tmp_path}",
         "proto/keel/agent/v1/node_local.proto"],
        cwd=ROOT, check=True,
    )
    assert (tmp_path / "node_local_pb2.py").read_text() == (ROOT / "libs/protocol/keel/protocol/node_local_pb2.py").read_text(), \
        "run `make proto`"


def test_rank_report_round_trip() -> None:
    report = node_local_pb2.RankReport(job_id="j", node_id="n1", rank=3, phase=node_local_pb2.PHASE_EVAL, step=41,
                                       step_time_s=0.25, loss=2.5, generation=2)
    decoded = node_local_pb2.RankReport.FromString(report.SerializeToString())
    assert decoded == report and decoded.phase == node_local_pb2.PHASE_EVAL

"""The analyzer's decider on real py-spy dumps: a round is judged once every node answered (or at its
deadline, with the silent node's ranks as missing evidence), the verdict carries the incident id, and
a round is never judged twice."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from keel.agent.stack_capture import captured_threads
from keel.analyzer.core import AnalyzerDecider
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CLOCK_PRODUCER,
    CapturedProcess,
    MissingProcess,
    RankStarted,
    RankTopology,
    StacksCaptured,
    StacksRequested,
    TimerTicked,
)
from keel.kernel.decider import DeciderSession
from keel.rules.stacks import classify_role, parse_pyspy_json

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stacks"
T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
NODE_OF = {0: "n0", 1: "n0", 2: "n1", 3: "n1"}  # 2 nodes x 2 ranks; PP 2: pipelines {0, 1} and {2, 3}


def dumps(scenario: str) -> dict[int, list[CapturedProcess]]:
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    out: dict[int, list[CapturedProcess]] = {}
    for entry in manifest["dumps"]:
        if entry["scenario"] != scenario or entry["native"]:
            continue
        threads = parse_pyspy_json((FIXTURES / entry["file"]).read_text())
        role = "rank" if entry["parent_pid"] is None else classify_role(threads)
        out.setdefault(entry["rank"], []).append(CapturedProcess(pid=entry["pid"], parent_pid=entry["parent_pid"],
                                                                 rank=entry["rank"], role=role,
                                                                 threads=captured_threads(threads)))
    return out


class Round:
    def __init__(self) -> None:
        self.session = DeciderSession(AnalyzerDecider())
        self.now = T0
        self.count = 0
        for rank, node in NODE_OF.items():
            self.feed(RankStarted(node_id=node, rank=rank, local_rank=rank % 2, world_size=4, pid=10 + rank,
                                  generation=0), f"rank/{rank}")
        self.incident = uuid.uuid4()
        self.request = self.feed_event(StacksRequested(round=0, nodes=["n0", "n1"], timeout_s=10, reason="rung 3",
                                                       expires_at=T0 + timedelta(minutes=5)), "job/j",
                                       producer="controller", correlation=self.incident)

    def feed_event(self, payload: EventPayload, subject: str, *, producer: str = "node-agent", dt: float = 0.1,
                   correlation: uuid.UUID | None = None) -> Event:
        self.now += timedelta(seconds=dt)
        self.count += 1
        event = Event.create(payload, job_id="j", subject=subject, producer=producer, occurred_at=self.now,
                             correlation_id=correlation, event_id=uuid.uuid5(uuid.NAMESPACE_OID, f"a-{self.count}"))
        self.result = self.session.observe(event)
        return event

    def feed(self, payload: EventPayload, subject: str, **kw: object) -> list[Event]:
        self.feed_event(payload, subject, **kw)  # type: ignore[arg-type]
        return self.result.emitted

    def capture(self, node: str, scenario: str, *, drop_rank: int | None = None) -> list[Event]:
        ranks = [r for r, n in NODE_OF.items() if n == node]
        processes = [p for r in ranks if r != drop_rank for p in dumps(scenario)[r]]
        missing = [MissingProcess(rank=drop_rank, pid=99, reason="py-spy failed: process vanished")] \
            if drop_rank in ranks else []
        topo = [RankTopology(rank=r, tp=[r], pp=[r - r % 2, r - r % 2 + 1], dp=[r % 2, r % 2 + 2]) for r in ranks]
        return self.feed(StacksCaptured(node_id=node, request_id=str(self.request.id), round=0, processes=processes,
                                        ranks=topo, missing=missing), f"node/{node}",
                         correlation=self.incident)


def test_a_rank_hung_in_a_pipeline_stage_is_found_and_its_pipeline_named() -> None:
    job = Round()
    assert job.capture("n0", "pipeline") == [] and "waiting for n1" in job.result.decision.reason
    [verdict] = job.capture("n1", "pipeline")
    v = verdict.payload
    assert v.conclusive and 1 in v.outlier_ranks and v.group_kind == "pp", v
    assert v.group_ranks == [0, 1] and v.group_nodes == ["n0"], v
    assert verdict.correlation_id == job.incident and v.request_id == str(job.request.id)
    assert v.outlier_stacks and v.dominant_stack
    # Judged once: a late duplicate part and the deadline change nothing.
    assert job.capture("n1", "pipeline") == []
    assert job.feed(TimerTicked(now=T0 + timedelta(seconds=30)), "clock/j", producer=CLOCK_PRODUCER) == []


def test_a_silent_node_is_missing_evidence_at_the_deadline_never_healthy() -> None:
    job = Round()
    job.capture("n0", "hang", drop_rank=1)
    assert job.feed(TimerTicked(now=T0 + timedelta(seconds=5)), "clock/j", producer=CLOCK_PRODUCER) == []
    [verdict] = job.feed(TimerTicked(now=T0 + timedelta(seconds=11)), "clock/j", producer=CLOCK_PRODUCER)
    v = verdict.payload
    assert any(m.startswith("rank 2: n1 sent no stacks") for m in v.missing), v.missing
    assert any(m.startswith("rank 1 (pid 99): n0: py-spy failed") for m in v.missing), v.missing
    assert not v.conclusive, v  # three of four ranks unseen: nothing to evict on this evidence
    assert verdict.correlation_id == job.incident


def test_shipped_frames_parse_once_per_text_and_keep_their_parts() -> None:
    # The analyzer parses every frame of every process of a round; equal texts (most of a big job's)
    # must give one shared, immutable Frame, and each text its own parts.
    from keel.analyzer.rung3 import frame_of, process_of
    from keel.events.types import CapturedProcess, CapturedThread

    text = "all_reduce (torch/distributed/distributed_c10d.py:2806)"
    a, b = (process_of(CapturedProcess(pid=pid, rank=rank, threads=[CapturedThread(os_thread_id=pid, frames=[text])]))
            for pid, rank in ((10, 0), (11, 1)))
    assert a.threads[0].frames[0] is b.threads[0].frames[0]
    assert frame_of(text).name == "all_reduce" and frame_of(text).line == 2806
    assert frame_of(text).short_filename == "torch/distributed/distributed_c10d.py"
    assert frame_of("odd frame (no line)").line == 0
    assert frame_of("f (/tmp/tmpab12/g.py:7)").short_filename == "/tmp/tmpab12/g.py"


def test_a_big_round_names_the_first_nodes_it_waits_for_and_counts_the_rest() -> None:
    from keel.analyzer.core import _listed

    assert _listed(["n2", "n0", "n1"]) == "n0, n1, n2"
    many = [f"n{i:04d}" for i in range(8192)]
    text = _listed(set(many))
    assert text.startswith("n0000, n0001") and text.endswith("n0007 and 8184 more")

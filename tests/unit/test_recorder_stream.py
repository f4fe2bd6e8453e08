"""The recorder's pure decisions about the stream (when and where to purge what it stored, when to report its
lag), the dead-letter redrive decision, and the metrics registry's text format."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest

from keel.infra.dlq import DeadLetter, RedriveRefused, plan_redrive, redrive_record, redrive_record_id
from keel.infra.metrics import Registry
from keel.recorder.core import LagReporting, lag_report_due, trim_point
from tests.factories import health_event


def trim(**changes: int | float) -> int | None:
    args: dict = dict(first_seq=1, last_seq=1000, messages=1000, stored_bytes=900, max_bytes=1000, max_msgs=-1,
                      recorded_floor=1000, trim_at=0.8, trim_to=0.5)
    args.update(changes)
    return trim_point(**args)


def test_below_the_threshold_nothing_is_purged() -> None:
    assert trim(stored_bytes=799) is None
    assert trim(messages=0, stored_bytes=0) is None


def test_a_full_stream_is_purged_down_to_the_target_of_what_is_recorded() -> None:
    # 90 % full, target 50 %: keep 1000 * 0.5 / 0.9 = 555 messages, purge below 1001 - 555.
    assert trim() == 446


def test_never_past_what_the_recorder_has_stored() -> None:
    assert trim(recorded_floor=100) == 101
    assert trim(recorded_floor=0) is None  # nothing recorded: a full stream pushes back, nothing is lost


def test_the_message_limit_counts_too() -> None:
    assert trim(stored_bytes=10, max_bytes=-1, max_msgs=1000, messages=1000) == 501
    assert trim(stored_bytes=10, max_bytes=-1, max_msgs=-1) is None


def test_lag_is_reported_on_crossing_and_periodically_while_above() -> None:
    state = LagReporting()
    state, due = lag_report_due(state, 0.5, 0.0, threshold_s=10, interval_s=60)
    assert not due  # below from the start: nothing to say
    state, due = lag_report_due(state, 11, 1.0, threshold_s=10, interval_s=60)
    assert due and state.above
    state, due = lag_report_due(state, 30, 30.0, threshold_s=10, interval_s=60)
    assert not due
    state, due = lag_report_due(state, 40, 61.0, threshold_s=10, interval_s=60)
    assert due and state.above
    state, due = lag_report_due(state, 2, 62.0, threshold_s=10, interval_s=60)
    assert due and not state.above
    state, due = lag_report_due(state, 1, 200.0, threshold_s=10, interval_s=60)
    assert not due


def dead_letter(data: bytes, subject: str, **changes: object) -> DeadLetter:
    fields: dict = dict(id=7, dlq_subject="keel_dlq.x", subject=subject, reason="bad", stream_seq=3,
                        at=datetime(2026, 12, 2, tzinfo=UTC), data=data, size=len(data), truncated=False)
    fields.update(changes)
    return DeadLetter(**fields)


def test_redrive_plans_and_refusals() -> None:
    event = health_event("n1")
    subject = "keel.job1.node.n1.NodeHealthChanged"
    plan = plan_redrive(dead_letter(event.to_json(), subject), None, prefix="keel", max_event_bytes=262144)
    assert plan.event == event and plan.subject == subject and not plan.corrected
    with pytest.raises(RedriveRefused, match="belongs on"):
        plan_redrive(dead_letter(event.to_json(), "keel.job2.node.n1.NodeHealthChanged"), None, prefix="keel",
                     max_event_bytes=262144)
    # A corrected body may move it, deliberately.
    moved = plan_redrive(dead_letter(b"{}", "keel.job2.node.n1.NodeHealthChanged"), event.to_json(), prefix="keel",
                         max_event_bytes=262144)
    assert moved.subject == subject and moved.corrected
    with pytest.raises(RedriveRefused, match="cut copy"):
        plan_redrive(dead_letter(event.to_json()[:10], subject, truncated=True, size=2_000_000), None, prefix="keel",
                     max_event_bytes=262144)
    with pytest.raises(RedriveRefused, match="still not a valid event: not valid JSON"):
        plan_redrive(dead_letter(b"{", subject), None, prefix="keel", max_event_bytes=262144)
    record = redrive_record(plan, dlq_stream="KEEL_DLQ", by="alice", now=datetime(2026, 12, 2, tzinfo=UTC))
    assert record.id == redrive_record_id("KEEL_DLQ", 7) != redrive_record_id("KEEL_DLQ", 8)
    assert record.job_id == "job1" and record.causation_id == event.id
    assert json.loads(record.to_json())["payload"]["by"] == "alice"
    assert isinstance(record.id, uuid.UUID)


def test_metrics_render_in_the_prometheus_text_format() -> None:
    registry = Registry()
    counter = registry.counter("keel_things_total", "Things", ["kind"])
    counter.inc(kind='a"b')
    counter.inc(2, kind='a"b')
    assert registry.counter("keel_things_total", "Things", ["kind"]) is counter
    with pytest.raises(ValueError):
        registry.gauge("keel_things_total", "Things")
    with pytest.raises(ValueError):
        counter.inc(-1, kind="x")
    registry.gauge("keel_lag_seconds", "Lag")
    registry.histogram("keel_batch_seconds", "Batch", buckets=(0.1, 1.0)).observe(0.5)
    assert registry.render().splitlines() == [
        "# HELP keel_batch_seconds Batch", "# TYPE keel_batch_seconds histogram",
        'keel_batch_seconds_bucket{le="0.1"} 0', 'keel_batch_seconds_bucket{le="1"} 1',
        'keel_batch_seconds_bucket{le="+Inf"} 1', "keel_batch_seconds_sum 0.5", "keel_batch_seconds_count 1",
        "# HELP keel_lag_seconds Lag", "# TYPE keel_lag_seconds gauge", "keel_lag_seconds 0",
        "# HELP keel_things_total Things", "# TYPE keel_things_total counter", 'keel_things_total{kind="a\\"b"} 3',
    ]


def test_keels_own_reports_start_no_job_clock() -> None:
    """A RecorderLagReported (job ``_keel``) is an input like any other to the controller, but no job's: the
    job clock must not tick ``_keel`` for ``controller.clock_linger`` after each report."""
    from keel.controller.adapter import Controller
    from keel.events.envelope import Event
    from keel.events.types import SYSTEM_JOB, RecorderLagReported
    from keel.infra.config import Settings
    from tests.factories import T0

    class NoBus:
        """Choosing the jobs to tick publishes nothing."""

    controller = Controller(NoBus(), None, Settings(), clock=lambda: T0)  # type: ignore[arg-type]
    report = Event.create(RecorderLagReported(consumer="recorder", lag_s=12.0, pending=5, threshold_s=10.0, above=True),
                          job_id=SYSTEM_JOB, subject="recorder/recorder", producer="recorder", occurred_at=T0)
    controller._note_input(report)
    controller._note_input(health_event("n1"))
    assert controller.jobs_to_tick() == ["job1"]

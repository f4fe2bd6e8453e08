"""The operations metrics folded from the log (``keel.infra.ops_metrics``), the ``/metrics`` responder of
``keel metrics --serve``, and the Grafana dashboard against the metrics that exist."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

from keel.cli.metrics_cmd import respond
from keel.events.envelope import Event
from keel.events.types import IncidentOpened, NodeEvicted, StandbyPoolSized
from keel.infra.ops_metrics import METRICS, OpsMetrics, StoreTotals
from tests.incident_factories import incident_log

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "keel-dashboard.json"
TOKEN = "s3cret-token-of-32-characters!!!"


def samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, from an exposition (comments left out)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_an_incident_log_gives_its_ettr_phases_latencies_and_decisions() -> None:
    log = incident_log("job1")  # by hand: ETTR 90 %, detection 0.4 s, opened to resolved 12 s (docstring there)
    metrics = OpsMetrics()
    for position, event in enumerate(log.events, 1):
        metrics.apply(event, position)
    assert metrics.position == len(log.events)
    got = samples(metrics.render(StoreTotals(events_recorded=len(log.events), dead_lettered=2)))
    assert abs(got['keel_ettr_ratio{training_job="job1"}'] - 0.9) < 1e-9
    assert abs(got['keel_lost_seconds{training_job="job1",phase="detection"}'] - 0.4) < 1e-6
    assert abs(got['keel_lost_seconds{training_job="job1",phase="recompute"}'] - 4.0) < 1e-6
    assert got['keel_incidents_total{training_job="job1",kind="crash",rung="2",outcome="recovered"}'] == 1
    assert got['keel_incidents_open{training_job="job1"}'] == 0
    assert got['keel_restarts_total{training_job="job1",rung="2"}'] == 1
    assert got['keel_incident_recovery_seconds_count{training_job="job1",kind="crash"}'] == 1
    assert abs(got['keel_incident_recovery_seconds_sum{training_job="job1",kind="crash"}'] - 12.0) < 1e-6
    assert got['keel_incident_recovery_seconds_bucket{training_job="job1",kind="crash",le="10"}'] == 0
    assert got['keel_incident_recovery_seconds_bucket{training_job="job1",kind="crash",le="20"}'] == 1
    assert abs(got['keel_incident_detection_seconds_sum{training_job="job1"}'] - 0.4) < 1e-6
    assert got['keel_decisions_total{decider="controller",type="RanksRestartRequested"}'] == 2
    assert not any(k.startswith('keel_decisions_total{decider="agent"') for k in got)  # reports are no decisions
    assert got["keel_events_recorded_total"] == len(log.events) and got["keel_events_dead_lettered_total"] == 2


def test_open_incidents_evictions_and_the_standby_pool() -> None:
    log = incident_log("job1")
    opened = next(e for e in log.events if e.type == "IncidentOpened")
    later = opened.occurred_at + timedelta(minutes=5)
    extra = [
        Event.create(IncidentOpened(kind="hang", node_id="n2", generation=1, reason="no progress"), job_id="job1",
                     subject="job/job1", producer="controller", occurred_at=later),
        Event.create(NodeEvicted(node_id="n2", decision_id="d", actuator="local", outcome="evicted"), job_id="job1",
                     subject="node/n2", producer="actuator", occurred_at=later),
        Event.create(NodeEvicted(node_id="n3", decision_id="d", actuator="local", outcome="failed"), job_id="job1",
                     subject="node/n3", producer="actuator", occurred_at=later),
        Event.create(StandbyPoolSized(target=2, ready=1, job_nodes=4, failure_probability=0.1, reason="r"),
                     job_id="job1", subject="job/job1", producer="controller", occurred_at=later),
    ]
    metrics = OpsMetrics()
    for event in [*log.events, *extra]:
        metrics.apply(event)
    got = samples(metrics.render())
    assert got['keel_incidents_open{training_job="job1"}'] == 1
    assert got['keel_evicted_nodes_total{training_job="job1"}'] == 1  # the failed eviction is not counted
    assert got['keel_standby_ready{training_job="job1"}'] == 1 and got['keel_standby_target{training_job="job1"}'] == 2
    assert "keel_events_recorded_total" not in got  # without the store's totals, not made up


def test_every_metric_listed_is_rendered_with_its_type() -> None:
    metrics = OpsMetrics()
    for event in incident_log("job1").events:
        metrics.apply(event)
    text = metrics.render(StoreTotals(events_recorded=1, dead_lettered=0))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert types == METRICS


def dashboard_metric_names() -> set[str]:
    """Every metric name the dashboard's queries use (identifiers starting ``keel_``, histogram suffixes cut)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "expr" in t]
    assert exprs, "the dashboard has no queries"
    names = {name for expr in exprs for name in re.findall(r"\b(keel_[a-z0-9_]+)", expr)}
    return {re.sub(r"_(bucket|sum|count)$", "", n) if re.sub(r"_(bucket|sum|count)$", "", n) in
            _histograms() else n for n in names}


def _histograms() -> set[str]:
    from keel.infra.metrics import REGISTRY

    recorder = {name for name, metric in REGISTRY._metrics.items() if metric.kind == "histogram"}  # noqa: SLF001
    return recorder | {name for name, kind in METRICS.items() if kind == "histogram"}


def test_every_dashboard_query_names_a_metric_that_exists() -> None:
    import keel.recorder.adapter  # noqa: F401 - registers the recorder's own metrics
    from keel.infra.metrics import REGISTRY

    exported = set(METRICS) | set(REGISTRY._metrics)  # noqa: SLF001
    missing = dashboard_metric_names() - exported
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"


def test_the_responder_serves_metrics_only_with_the_bearer_token() -> None:
    body = "keel_incidents_open 0\n"
    ok = respond(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode(), TOKEN, body)
    assert ok.startswith(b"HTTP/1.1 200 OK\r\n") and ok.endswith(body.encode())
    assert b"Content-Type: text/plain; version=0.0.4; charset=utf-8" in ok
    head = respond(f"HEAD /metrics HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode(), TOKEN, body)
    assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")
    for request, status in [
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"401"),
        (b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer wrong\r\n\r\n", b"401"),
        (f"GET /metrics HTTP/1.1\r\nAuthorization: Basic {TOKEN}\r\n\r\n".encode(), b"401"),
        (f"GET /other HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode(), b"404"),
        (f"POST /metrics HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode(), b"405"),
        (b"\x16\x03\x01 garbage\r\n\r\n", b"400"),
    ]:
        answer = respond(request, TOKEN, body)
        assert answer.startswith(b"HTTP/1.1 " + status), (request, answer[:60])
        assert body.encode() not in answer

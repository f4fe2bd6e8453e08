"""The HTTP API (``keel-api``), really started, over a real store holding a log the real controller wrote (the
audit test's): it answers exactly what the CLI's reports answer, refuses callers without a known token, refuses
unusable parameters with the reason, pages the log, and survives schemathesis fuzzing its own OpenAPI spec."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from keel.events.envelope import Event, now_utc
from keel.events.types import IncidentOpened, IncidentResolved
from keel.infra.api_auth import READ, new_token
from keel.infra.embedded import free_port
from keel.infra.service import READY_FILE_ENV
from keel.infra.store import append_events, event_row
from tests.integration.test_agent_rejoin import stop_process
from tests.integration.test_audit import audited_log, keel
from tests.integration.test_crashes import service_env

pytestmark = pytest.mark.integration

TOKEN, ENTRY = new_token("oncall", READ, bytes(range(7, 39)))


def get(base: str, path: str, token: str | None = TOKEN) -> tuple[int, dict[str, Any], dict[str, str]]:
    request = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def start_api(keel_env, scratch: Path, *, without_nats: bool = False,  # type: ignore[no-untyped-def]
              extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**service_env(keel_env.settings), "KEEL_API__LISTEN_PORT": str(port),
           "KEEL_API__TOKENS": json.dumps([{"name": ENTRY.name, "scope": ENTRY.scope, "sha256": ENTRY.sha256}]),
           **(extra_env or {})}
    if without_nats:
        env.pop("KEEL_NATS_URL", None)
    log = open(scratch / "api.log", "ab")  # noqa: SIM115 - the child holds it
    process = subprocess.Popen([sys.executable, "-m", "keel.api.main"], env=env, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, (scratch / "api.log").read_text()
        try:
            if get(base, "/healthz", None)[0] == 200:
                return process, base
        except OSError:
            pass
        time.sleep(0.2)
    stop_process(process)
    raise AssertionError(f"keel-api did not answer within 60 s: {(scratch / 'api.log').read_text()}")


async def test_the_api_answers_what_the_cli_answers_and_refuses_what_it_cannot_use(
        keel_env, scratch_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events, named = audited_log(monkeypatch)
    async with keel_env.engine.begin() as conn:
        await append_events(conn, [event_row(event, None) for event in events])
    env = service_env(keel_env.settings)
    process, base = await asyncio.to_thread(start_api, keel_env, scratch_dir)
    try:
        # The same answers as the CLI's JSON, from the same functions.
        status, incidents, _ = await asyncio.to_thread(get, base, "/v1/incidents")
        cli = json.loads((await keel(env, "incidents", "--json")).stdout)
        assert len(cli["incidents"]) == 2
        assert status == 200 and incidents == {"incidents": cli["incidents"][::-1], "total": 2, "next_before": None}
        # A page at a time, newest first: the pages together are the whole list, each incident summarized alike.
        status, first, _ = await asyncio.to_thread(get, base, "/v1/incidents?limit=1")
        assert status == 200 and first["incidents"] == cli["incidents"][-1:] and first["total"] == 2
        assert isinstance(first["next_before"], int)
        status, second, _ = await asyncio.to_thread(get, base, f"/v1/incidents?limit=1&before={first['next_before']}")
        assert status == 200 and second == {"incidents": cli["incidents"][:1], "total": 2, "next_before": None}
        status, refused, _ = await asyncio.to_thread(get, base, "/v1/incidents?before=0")
        assert status == 422 and "before" in json.dumps(refused)
        # A page is kept while the log holds nothing newer of what it summarizes: an incident opened now, then its
        # resolution, show at the next request (the kept page is not served past them).
        newer = Event.create(IncidentOpened(kind="hang", node_id="n1", generation=7, reason="a later hang"),
                             job_id="job2", subject="job/job2", producer="controller", occurred_at=now_utc())
        async with keel_env.engine.begin() as conn:
            await append_events(conn, [event_row(newer, None)])
        status, again, _ = await asyncio.to_thread(get, base, "/v1/incidents")
        assert again["total"] == 3 and again["incidents"][0]["id"] == str(newer.id)
        assert again["incidents"][0]["outcome"] == "open" and again["incidents"][1:] == incidents["incidents"]
        closed = Event.create(IncidentResolved(incident_id=str(newer.id), outcome="recovered", rung=1, generation=8,
                                               reason="stepping"), job_id="job2", subject="job/job2",
                              producer="controller", occurred_at=now_utc(), correlation_id=newer.id)
        async with keel_env.engine.begin() as conn:
            await append_events(conn, [event_row(closed, None)])
        status, last, _ = await asyncio.to_thread(get, base, "/v1/incidents?job=job2")
        assert last["incidents"][0]["outcome"] == "recovered"
        status, last, _ = await asyncio.to_thread(get, base, "/v1/incidents")
        assert last["incidents"][0]["outcome"] == "recovered"
        crash = str(named["crash"].id)
        status, timeline, _ = await asyncio.to_thread(get, base, f"/v1/incidents/{crash[:8]}/timeline")
        assert status == 200 and timeline == json.loads((await keel(env, "timeline", crash, "--json")).stdout)
        assert "IncidentOpened" in [e["type"] for e in timeline["events"]] and len(timeline["events"]) > 3
        status, ettr, _ = await asyncio.to_thread(get, base, "/v1/jobs/job2/ettr?window=30m")
        cli_ettr = json.loads((await keel(env, "ettr", "--job", "job2", "--window", "30m", "--json")).stdout)
        assert status == 200 and [ettr] == cli_ettr["jobs"]
        status, jobs, _ = await asyncio.to_thread(get, base, "/v1/jobs")
        assert status == 200 and [j["job_id"] for j in jobs["jobs"]] == ["job1", "job2"]
        status, evictions, _ = await asyncio.to_thread(get, base, "/v1/audit/evictions?last=7d")
        assert status == 200 and [(r["job_id"], r["node_id"], r["rung"]) for r in evictions["rows"]] == [("job1", "n3", 1)]
        assert evictions["truncated"] is False
        status, older, _ = await asyncio.to_thread(get, base, "/v1/audit/evictions?until=2026-12-01T00:00:00")
        assert status == 200 and older["rows"] == []
        status, crashes, _ = await asyncio.to_thread(get, base, "/v1/audit/incidents?kind=crash&job=job2")
        assert status == 200 and [r["incident_id"] for r in crashes["rows"]] == [str(named["crash"].id)]

        # The log, paged by position: every event once, in order.
        seen: list[dict[str, Any]] = []
        after = 0
        while True:
            status, page, _ = await asyncio.to_thread(get, base, f"/v1/events?job=job1&after={after}&limit=7")
            assert status == 200 and len(page["events"]) <= 7
            seen += page["events"]
            if page["next_after"] is None:
                break
            after = page["next_after"]
        assert [e["position"] for e in seen] == sorted({e["position"] for e in seen})
        assert len(seen) == sum(1 for e in events if e.job_id == "job1") and len(seen) > 7
        status, typed, _ = await asyncio.to_thread(get, base, "/v1/events?type=NodeEvicted&type=NodeCordoned")
        assert status == 200 and sorted(e["type"] for e in typed["events"]) == ["NodeCordoned", "NodeEvicted"]

        # Refusals, each with its reason.
        refusals = [("/v1/incidents", None, 401, "send a token"),
                    ("/v1/incidents", "keel_not-a-token", 401, "not one of this API's"),
                    ("/v1/audit/secrets", TOKEN, 404, "Not Found"),
                    ("/v1/audit/incidents?since=last%20tuesday", TOKEN, 422, "since"),
                    ("/v1/audit/incidents?last=0s", TOKEN, 422, "last"),
                    ("/v1/incidents/ffffffffff/timeline", TOKEN, 404, "no incident ffffffffff"),
                    ("/v1/incidents/0/timeline", TOKEN, 422, "ref"),
                    ("/v1/jobs/nojob/ettr", TOKEN, 404, "no events for job nojob"),
                    ("/v1/jobs/job2/ettr?window=5", TOKEN, 422, "window"),
                    ("/v1/events?type=NoSuchEvent", TOKEN, 422, "NoSuchEvent"),
                    ("/v1/events?limit=0", TOKEN, 422, "limit")]
        for path, token, code, reason in refusals:
            status, body, headers = await asyncio.to_thread(get, base, path, token)
            assert status == code and reason in json.dumps(body), (path, status, body)
            if code == 401:
                assert headers.get("www-authenticate") == "Bearer" or headers.get("WWW-Authenticate") == "Bearer"
        status, spec, _ = await asyncio.to_thread(get, base, "/openapi.json", None)
        assert status == 200 and spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
        assert "/v1/incidents/{ref}/timeline" in spec["paths"] and "/v1/audit/evictions" in spec["paths"]
        # Each audit view's route offers only the filters it has: evictions have no kind, rollbacks no node.
        names = {path: {p["name"] for p in spec["paths"][path]["get"].get("parameters", [])} for path in spec["paths"]
                 if "get" in spec["paths"][path]}
        assert "kind" not in names["/v1/audit/evictions"] and "node" not in names["/v1/audit/rollbacks"]
        assert {"since", "until", "last", "job", "node", "kind", "limit"} <= names["/v1/audit/incidents"]
        # The operator actions are in the spec (and refuse a read token: test_api_actions.py).
        assert {"/v1/approvals/{request_id}", "/v1/nodes/{node_id}/cordon"} <= set(spec["paths"])
    finally:
        stop_process(process)
    assert process.returncode == 0, (scratch_dir / "api.log").read_text()


async def test_schemathesis_finds_no_server_error_and_no_answer_outside_the_spec(
        keel_env, scratch_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events, _ = audited_log(monkeypatch)
    async with keel_env.engine.begin() as conn:
        await append_events(conn, [event_row(event, None) for event in events])
    process, base = await asyncio.to_thread(start_api, keel_env, scratch_dir)
    try:
        tried = await asyncio.to_thread(fuzz_every_operation, base)
    finally:
        stop_process(process)
    assert len(tried) == 17 and min(n for label, n in tried.items() if label != "GET /healthz") >= 5, tried


def fuzz_every_operation(base: str) -> dict[str, int]:
    """schemathesis's default checks on every operation of the served spec, 25 examples each, as a read token."""
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 17, [op.label for op in operations]
    tried: dict[str, int] = {}
    for operation in operations:
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def fuzz(case) -> None:  # type: ignore[no-untyped-def]
            tried[case.operation.label] = tried.get(case.operation.label, 0) + 1
            case.call_and_validate(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"})

        fuzz()
    return tried


def workers_of(process: subprocess.Popen) -> list[int]:
    """The pids of the API's worker processes (its children)."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    return [int(pid) for pid in children]


def wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # ended, not reaped yet
            return True
        time.sleep(0.1)
    return False


async def test_two_processes_serve_the_port_and_the_api_stops_whole_when_either_ends(keel_env, scratch_dir: Path) -> None:
    # Two processes by default here (api.workers 0, two CPUs): both answer; SIGTERM stops both. It needs the store
    # only: no NATS URL is given.
    # As a supervisor runs it: the URL it serves on is written beside its ready file, and withdrawn when it stops.
    ready = scratch_dir / "services" / "api.ready"
    ready.parent.mkdir(parents=True, exist_ok=True)
    process, base = await asyncio.to_thread(partial(start_api, without_nats=True,
                                                    extra_env={READY_FILE_ENV: str(ready)}), keel_env, scratch_dir)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert (scratch_dir / "services" / "api.url").read_text().strip() == base
        [worker] = workers_of(process)
        assert all(get(base, "/v1/jobs")[0] == 200 for _ in range(20))
        # Answers go out at once on a kept-alive connection (TCP_NODELAY on the shared socket's connections): without
        # it each waited for the client's delayed ACK, 40 ms, whatever the load.
        conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=30)
        took = []
        for _ in range(21):
            began = time.monotonic()
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            took.append(time.monotonic() - began)
        conn.close()
        # The lower quartile: with the stall every answer takes 40 ms or more, and a busy machine (a CI run beside
        # other work) slows some answers, not the fastest quarter.
        assert sorted(took)[5] < 0.025, (f"lower quartile of /healthz {1000 * sorted(took)[5]:.0f} ms on a kept-alive "
                                         f"connection: {sorted(round(1000 * t) for t in took)} ms")
        process.terminate()
        assert await asyncio.to_thread(process.wait, 30) == 0
        assert wait_gone(worker), "the worker was stopped with the API"
        assert not (scratch_dir / "services" / "api.url").exists(), "a stopped API leaves no URL behind"
    finally:
        stop_process(process)
    # A worker killed: the API stops with status 1 (its supervisor then restarts it whole), naming what happened.
    process, base = await asyncio.to_thread(start_api, keel_env, scratch_dir)
    try:
        [worker] = workers_of(process)
        os.kill(worker, signal.SIGKILL)
        assert await asyncio.to_thread(process.wait, 30) == 1
        assert f"api worker {worker} ended" in (scratch_dir / "api.log").read_text()
    finally:
        stop_process(process)
    # The API's own process killed: its worker does not go on serving the port alone.
    process, base = await asyncio.to_thread(start_api, keel_env, scratch_dir)
    try:
        [worker] = workers_of(process)
        process.kill()
        process.wait(10)
        assert await asyncio.to_thread(wait_gone, worker), "the worker outlived the API's process"
    finally:
        stop_process(process)

"""``keel metrics`` against a real store: printed once, written for node_exporter's textfile collector, and served
to a real Prometheus (Debian's ``prometheus``) that scrapes it with the bearer token; events recorded later reach
the endpoint; a request without the token gets nothing."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from keel.infra.embedded import free_port
from keel.infra.store import append_events, event_row
from tests.incident_factories import incident_log
from tests.integration.test_agent_rejoin import stop_process
from tests.integration.test_crashes import service_env

pytestmark = pytest.mark.integration

TOKEN = "metrics-token-for-the-test-0123456789"


def get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def until(check, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = await asyncio.to_thread(check)
            if last:
                return last
        except (OSError, ValueError) as exc:
            last = exc
        await asyncio.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout_s}s (last: {last!r})")


async def test_metrics_are_printed_written_and_served_to_a_real_prometheus(keel_env, scratch_dir: Path) -> None:
    async with keel_env.engine.begin() as conn:
        await append_events(conn, [event_row(e, None) for e in incident_log("job1").events])
    env = service_env(keel_env.settings)

    printed = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "keel.cli.main", "metrics"], env=env,
                                      capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert 'keel_ettr_ratio{training_job="job1"} 0.9' in printed.stdout
    assert 'keel_incidents_total{training_job="job1",kind="crash",rung="2",outcome="recovered"} 1' in printed.stdout

    textfile = scratch_dir / "textfile" / "keel.prom"
    written = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "keel.cli.main", "metrics", "--textfile",
                                                       str(textfile)], env=env, capture_output=True, text=True, timeout=60)
    assert written.returncode == 0 and textfile.read_text() == printed.stdout, written.stderr
    assert [p.name for p in textfile.parent.iterdir()] == ["keel.prom"]  # no temporary file left

    refused = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "keel.cli.main", "metrics", "--serve",
                                                       "127.0.0.1:9"], env={**env, "KEEL_METRICS_TOKEN": ""},
                                      capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "needs a bearer token" in refused.stderr, refused.stderr

    token_file = scratch_dir / "metrics.token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    log = scratch_dir / "metrics.log"
    with open(log, "wb") as out:
        exporter = subprocess.Popen([sys.executable, "-m", "keel.cli.main", "metrics", "--serve", f"127.0.0.1:{port}",
                                     "--token-file", str(token_file), "--interval", "500ms"], env=env, stdout=out,
                                    stderr=subprocess.STDOUT)
    prometheus = None
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        await until(lambda: get(url, TOKEN)[0] == 200, 60, "metrics endpoint")
        assert get(url)[0] == 401 and get(url, "not-the-token")[0] == 401
        status, body = get(url, TOKEN)
        assert status == 200 and 'keel_ettr_ratio{training_job="job1"} 0.9' in body

        # Events recorded after the start reach the endpoint.
        async with keel_env.engine.begin() as conn:
            await append_events(conn, [event_row(e, None) for e in incident_log("job2").events])
        await until(lambda: 'keel_ettr_ratio{training_job="job2"} 0.9' in get(url, TOKEN)[1], 15, "job2's ETTR")

        binary = shutil.which("prometheus")
        assert binary, "Debian's prometheus is not installed: `make system-deps` installs it"
        prom_port = free_port()
        config = scratch_dir / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "keel", "authorization": {"type": "Bearer",
                                                                      "credentials_file": str(token_file)},
                                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}]}))
        with open(scratch_dir / "prometheus.log", "wb") as out:
            prometheus = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={scratch_dir / 'tsdb'}",
                                           f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=out,
                                          stderr=subprocess.STDOUT)

        def query(expr: str) -> list[dict]:  # type: ignore[type-arg]
            q = urllib.parse.urlencode({"query": expr})
            status, body = get(f"http://127.0.0.1:{prom_port}/api/v1/query?{q}")
            return json.loads(body)["data"]["result"] if status == 200 else []

        up = await until(lambda: query('up{job="keel"} == 1'), 60, "a successful scrape by Prometheus")
        assert up[0]["metric"]["instance"] == f"127.0.0.1:{port}"
        ettr = await until(lambda: query("keel_ettr_ratio"), 30, "keel_ettr_ratio in Prometheus")
        assert {r["metric"]["training_job"]: float(r["value"][1]) for r in ettr} == {"job1": 0.9, "job2": 0.9}
        assert all(r["metric"]["job"] == "keel" for r in ettr)  # Prometheus' own label, not renamed ours
        p95 = await until(lambda: query('histogram_quantile(0.95, sum by (le) (keel_incident_recovery_seconds_bucket))'),
                          30, "the recovery histogram in Prometheus")
        assert 10 < float(p95[0]["value"][1]) <= 20  # both incidents took 12 s: the (10, 20] bucket
    finally:
        for process in (prometheus, exporter):
            if process is not None:
                stop_process(process)
    assert "serving /metrics on 127.0.0.1" in log.read_text()

"""The API's web page in a real headless Chromium (Debian's ``chromium-headless-shell``), against a real keel-api over
a real store holding a log the real controller wrote (the audit test's): what it shows is what the API answers
(the incidents, one incident's timeline with the controller's reasons, the ETTR curves, the nodes), a page
without a token or with a wrong one asks for one, and a value that looks like markup stays text. Screenshots
are saved beside the test's scratch folder (and under ``$KEEL_TEST_ARTIFACTS`` when set)."""

from __future__ import annotations

import asyncio
import html
import os
import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest

from keel.events.envelope import Event
from keel.events.types import IncidentOpened
from keel.infra.store import append_events, event_row
from tests.integration.test_agent_rejoin import stop_process
from tests.integration.test_api import TOKEN, get, start_api
from tests.integration.test_audit import audited_log

pytestmark = pytest.mark.integration

BROWSERS = ("chromium-headless-shell", "chromium")


def browser() -> str:
    """Debian's headless Chromium (``make system-deps`` installs ``chromium-headless-shell``)."""
    for name in BROWSERS:
        found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
        if found:
            return found
    raise AssertionError(f"none of {', '.join(BROWSERS)} is installed: `make system-deps` (as root) installs "
                         "chromium-headless-shell from Debian")


def render(url: str, scratch: Path, screenshot: Path | None = None) -> str:
    """The page's DOM once its script has run (virtual time: network loads finish first), as Chromium has it."""
    profile = scratch / "chromium-profile"
    common = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
              f"--user-data-dir={profile}", "--virtual-time-budget=15000", "--window-size=1280,2200"]
    if screenshot is not None:
        shot = subprocess.run([*common, f"--screenshot={screenshot}", url], capture_output=True, text=True,
                              timeout=120)
        assert shot.returncode == 0 and screenshot.exists(), shot.stderr[-2000:]
        artifacts = os.environ.get("KEEL_TEST_ARTIFACTS")
        if artifacts:
            Path(artifacts).mkdir(parents=True, exist_ok=True)
            shutil.copy(screenshot, Path(artifacts) / screenshot.name)
    dumped = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    return dumped.stdout


def rows(dom: str, section: str) -> list[list[str]]:
    """The text of each cell of each body row of the table in ``<section id=SECTION>``."""
    block = re.search(rf'<section id="{section}"[^>]*>(.*?)</section>', dom, re.S)
    assert block, f"no section {section} in the page"
    body = re.search(r"<tbody>(.*?)</tbody>", block.group(1), re.S)
    found = re.findall(r"<tr[^>]*>(.*?)</tr>", body.group(1), re.S) if body else []
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
            for r in found]


def state(dom: str) -> str:
    match = re.search(r'<body[^>]*data-state="([^"]+)"', dom)
    assert match, dom[:2000]
    return match.group(1)


async def test_the_page_shows_what_the_api_answers_and_asks_for_a_token_it_lacks(
        keel_env, scratch_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events, named = audited_log(monkeypatch)
    crash = named["crash"]
    # An incident whose reason is markup: the page must show it as text, never run it.
    markup = Event.create(IncidentOpened(kind="crash", node_id="n9", generation=3,
                                         reason='<img src=x onerror="document.title=1">rank exited'),
                          job_id="job2", subject="job/job2", producer="controller",
                          occurred_at=crash.occurred_at + timedelta(minutes=1))
    async with keel_env.engine.begin() as conn:
        await append_events(conn, [event_row(event, None) for event in [*events, markup]])
    process, base = await asyncio.to_thread(start_api, keel_env, scratch_dir)
    try:
        page = await asyncio.to_thread(get_page, base)
        assert page.startswith("<!doctype html>")
        _, incidents, _ = await asyncio.to_thread(get, base, "/v1/incidents?job=job2")
        _, timeline, _ = await asyncio.to_thread(get, base, f"/v1/incidents/{crash.id}/timeline")
        _, ettr, _ = await asyncio.to_thread(get, base, "/v1/jobs/job2/ettr")
        _, nodes, _ = await asyncio.to_thread(get, base, "/v1/nodes?job=job2")

        url = f"{base}/?job=job2&incident={crash.id}#token={TOKEN}"
        dom = await asyncio.to_thread(render, url, scratch_dir, scratch_dir / "keel-page-job2.png")
        assert state(dom) == "ready", dom[-3000:]
        shown = rows(dom, "incidents")
        # Newest first (as the API pages them), each with its kind and reason, exactly the API's incidents.
        assert [r[1] for r in shown] == [i["kind"] for i in incidents["incidents"]]
        assert [r[6] for r in shown] == [i["reason"] for i in incidents["incidents"]]
        assert '<img src=x onerror="document.title=1">rank exited' in [r[6] for r in shown]
        assert "<img" not in re.sub(r"&lt;img", "", dom.split('id="incidents"')[1].split("</section>")[0]) \
            and "<title>Keel</title>" in dom
        # The linked incident's timeline: every event with what it was and why (the rollback's reason too).
        lines = rows(dom, "timeline")
        assert [r[1] for r in lines] == [e["type"] for e in timeline["events"]]
        assert [r[2] for r in lines] == [e["what"] for e in timeline["events"]]
        assert any("roll back to v6" in r[2] for r in lines), lines
        # ETTR: the API's cumulative figure, and both curves drawn from its series.
        assert f"{100 * ettr['cumulative']['ettr']:.2f} %" in dom
        for series in ("cumulative", "window"):
            curve = re.search(rf'<polyline points="([^"]+)" class="{series}"', dom)
            assert curve and len(curve.group(1).split()) == 240, series
        lost = rows(dom, "ettr")
        assert {r[0] for r in lost} >= {f"incidents: {p}" for p in ettr["cumulative"]["lost_by_phase_s"]}
        assert len(rows(dom, "nodes")) == len(nodes["nodes"])
        assert TOKEN not in dom  # taken out of the address bar once read

        screenshot = (scratch_dir / "keel-page-job2.png").read_bytes()
        assert screenshot[:8] == b"\x89PNG\r\n\x1a\n" and len(screenshot) > 20_000

        # No token: it asks for one. A wrong one: it says the API refused it, and shows nothing.
        dom = await asyncio.to_thread(render, f"{base}/?job=job2", scratch_dir)
        assert state(dom) == "login" and "job2" not in dom.split("<main")[1]
        dom = await asyncio.to_thread(render, f"{base}/#token=keel_wrong", scratch_dir,
                                      scratch_dir / "keel-page-refused.png")
        assert state(dom) == "login" and "The API refused the token" in dom and "not one of this API" in dom
    finally:
        stop_process(process)
    assert process.returncode == 0, (scratch_dir / "api.log").read_text()


def get_page(base: str) -> str:
    """``/`` as a browser gets it, with the headers that keep the page to its own origin."""
    import urllib.request

    with urllib.request.urlopen(base + "/", timeout=30) as response:
        policy = response.headers["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy, policy
        assert response.headers["Content-Type"].startswith("text/html")
        return str(response.read().decode())

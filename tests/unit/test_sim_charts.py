"""``keel.sim.charts``: the SVG charts of a fleet run (valid XML, one polyline per system, days and ETTR values
where they belong, escaped labels, the same text twice), the lost-time bars, and the adapter's fallbacks when no
browser converts them (the SVGs stay, the reason goes to stderr); ``bench.fleet --charts-from`` draws a results
file without simulating."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from keel.sim import charts
from keel.sim.charts import TARGET_ETTR, ettr_svg, lost_time_svg, nice_step, write_charts

NS = {"s": "http://www.w3.org/2000/svg"}
REPO = Path(__file__).resolve().parents[2]
NASTY = 'a<b>&"c\''


def system(daily: list[float], phases: dict[str, float] | None = None,
           mechanisms: dict[str, float] | None = None) -> dict[str, Any]:
    phases = phases or {"restart": 1.0}
    return {"ettr": daily[-1], "worst_window_min": 1.0, "lost_h": sum(phases.values()), "ettr_daily": daily,
            "lost_h_by_phase": phases, "lost_h_by_mechanism": mechanisms or {"gpu_lost": sum(phases.values())}}


def tiny() -> dict[str, Any]:
    """Four days, three systems (one with a name that is markup)."""
    return {"seed": 7, "nodes": 4, "days": 4.0, "gpus": 32, "systems": {
        "keel": system([0.9, 0.95, 1.0, TARGET_ETTR], {"detection": 0.5, "standby_wait": 2.0, "human": 1.5},
                       {"hang": 3.0, "xid": 1.0}),
        "oracle": system([1.0, 1.0, 1.0, 1.0], {"restart": 0.25}),
        NASTY: system([0.92, 0.94, 0.96, 0.98], {"checkpoint": 6.0, "restart": 2.0})}}


def points(poly: ET.Element) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in (p.split(",") for p in poly.attrib["points"].split())]


def test_ettr_chart_has_one_polyline_per_system_with_days_and_values_where_they_belong() -> None:
    svg = ettr_svg(tiny())
    root = ET.fromstring(svg)  # valid XML
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    polys = root.findall(".//s:polyline", NS)
    assert [p.attrib["data-system"] for p in polys] == ["keel", "oracle", NASTY]
    keel = points(polys[0])
    assert len(keel) == 4
    xs = [x for x, _ in keel]
    assert xs == sorted(xs) and len(set(xs)) == 4
    steps = {round(b - a, 2) for a, b in zip(xs, xs[1:])}
    assert len(steps) == 1  # one day apart
    # The x ticks: day 0 at the axis, day 4 at the last point (day d's figure is the ETTR at its end).
    x_ticks = {t.text: float(t.attrib["x"]) for t in root.findall(".//s:g[@class='x-ticks']/s:text", NS)}
    assert x_ticks["4"] == pytest.approx(xs[-1]) and x_ticks["1"] == pytest.approx(xs[0])
    assert x_ticks["0"] == pytest.approx(xs[0] - (xs[1] - xs[0]))
    # ETTR maps linearly, higher up the chart for higher values: 0.95 halfway between 0.9 and 1.0.
    y09, y095, y1, y_target = (y for _, y in keel)
    assert y1 < y095 < y09
    assert y095 == pytest.approx((y09 + y1) / 2, abs=0.01)
    target = root.find(".//s:line[@class='target']", NS)
    assert target is not None and "stroke-dasharray" in target.attrib
    assert float(target.attrib["y1"]) == pytest.approx(y_target, abs=0.01) == float(target.attrib["y2"])
    assert y_target == pytest.approx(y09 + (y1 - y09) * (TARGET_ETTR - 0.9) / 0.1, abs=0.01)
    # Each y tick's label sits at its value (the text 4 px below the line's centre).
    y_ticks = {t.attrib["data-value"]: float(t.attrib["y"]) - 4 for t in root.findall(".//s:g[@class='y-ticks']/s:text", NS)}
    assert y_ticks["1.00"] == pytest.approx(y1, abs=0.01) and y_ticks["0.90"] == pytest.approx(y09, abs=0.01)
    # The oracle's flat 1.0 is a flat line at the top.
    assert {y for _, y in points(polys[1])} == {y1}
    legend = [t.text for t in root.findall(".//s:g[@class='legend']/s:text", NS)]
    assert legend == ["keel 0.9850", "oracle 1.0000", f"{NASTY} 0.9800", "target 0.985"]


def test_labels_are_escaped_and_the_output_is_the_same_text_every_time() -> None:
    result = tiny()
    result["commit"] = "<script>alert(1)</script>"
    for render in (ettr_svg, lost_time_svg):
        svg = render(result)
        assert "<script" not in svg and "a<b>" not in svg
        assert 'a&lt;b&gt;&amp;&quot;c&#39;' in svg
        root = ET.fromstring(svg)
        texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
        assert any(NASTY in t for t in texts) and any("commit <script" in t for t in texts)  # shown as text
        assert render(json.loads(json.dumps(result))) == svg


def test_several_seeds_are_averaged_day_by_day() -> None:
    one, two = tiny(), tiny()
    two["seed"] = 8
    two["systems"]["keel"]["ettr_daily"] = [1.0, 1.0, 1.0, 1.0]
    two["systems"]["keel"]["lost_h_by_phase"] = {"detection": 1.5}
    bench = {"gpus": 32, "days": 4.0, "seeds": [7, 8], "per_seed": [one, two]}
    assert charts.ettr_series(bench)["keel"] == pytest.approx([0.95, 0.975, 1.0, (TARGET_ETTR + 1) / 2])
    assert charts.lost_by(bench, "lost_h_by_phase")["keel"] == pytest.approx(
        {"detection": 1.0, "human": 0.75, "standby_wait": 1.0})
    assert "mean over seeds 7, 8" in ettr_svg(bench)


def test_lost_time_chart_has_keels_phases_and_mechanisms_and_every_system_stacked() -> None:
    root = ET.fromstring(lost_time_svg(tiny()))
    panels = root.findall(".//s:g[@class='bars']", NS)
    assert len(panels) == 2
    by_phase = {r.attrib["data-label"]: float(r.attrib["data-hours"]) for r in panels[0].findall("s:rect", NS)}
    assert list(by_phase) == ["detection", "standby_wait", "human"]  # a recovery's order
    assert by_phase == {"detection": 0.5, "standby_wait": 2.0, "human": 1.5}
    widths = {r.attrib["data-label"]: float(r.attrib["width"]) for r in panels[0].findall("s:rect", NS)}
    assert widths["standby_wait"] == pytest.approx(4 * widths["detection"], abs=0.02)
    mechanisms = [r.attrib["data-label"] for r in panels[1].findall("s:rect", NS)]
    assert mechanisms == ["hang", "xid"]  # largest first
    stacks = root.findall(".//s:g[@class='stacks']/s:g", NS)
    assert [g.attrib["data-system"] for g in stacks] == ["keel", "oracle", NASTY]
    totals = {g.attrib["data-system"]: sum(float(r.attrib["width"]) for r in g.findall("s:rect", NS))
              for g in stacks}
    assert totals[NASTY] == pytest.approx(2 * totals["keel"], abs=0.05)  # 8 h against 4 h
    assert totals["oracle"] == pytest.approx(totals["keel"] / 16, abs=0.05)


def test_the_committed_results_draw_every_system() -> None:
    result = json.loads((REPO / "bench/results/fleet.json").read_text())
    root = ET.fromstring(ettr_svg(result))
    assert {p.attrib["data-system"] for p in root.findall(".//s:polyline", NS)} == set(result["ettr"])
    for poly in root.findall(".//s:polyline", NS):
        xs = [x for x, _ in points(poly)]
        assert xs == sorted(xs) and len(xs) == int(result["days"])
    ET.fromstring(lost_time_svg(result))


def test_empty_results_are_refused() -> None:
    with pytest.raises(ValueError, match="no systems"):
        ettr_svg({"days": 1, "systems": {}})


def test_nice_steps() -> None:
    assert nice_step(90, 10) == 10 and nice_step(30, 10) == 5 and nice_step(0.25, 8) == pytest.approx(0.05)
    assert nice_step(4, 10) == 0.5 and nice_step(0.1, 8) == pytest.approx(0.02)


def test_without_a_browser_the_svgs_are_written_and_stderr_says_so(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(charts, "find_browser", lambda: None)
    err = io.StringIO()
    written = write_charts(tiny(), tmp_path / "out", stderr=err)
    assert [p.name for p in written] == ["ettr.svg", "lost_time.svg"]
    assert all(ET.parse(p).getroot() is not None for p in written)
    assert "no headless Chromium" in err.getvalue() and "SVGs only" in err.getvalue()


def test_a_browser_that_fails_leaves_the_svgs_and_says_why(tmp_path: Path) -> None:
    err = io.StringIO()
    written = write_charts(tiny(), tmp_path, browser="/bin/false", stderr=err)
    assert [p.name for p in written] == ["ettr.svg", "lost_time.svg"]
    assert "ettr.svg not converted to PNG" in err.getvalue() and "exit 1" in err.getvalue()


def test_bench_fleet_draws_a_results_file_without_simulating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from bench import fleet

    monkeypatch.setattr(charts, "find_browser", lambda: None)
    monkeypatch.setattr(fleet, "run_many", lambda *a, **k: pytest.fail("--charts-from simulated"))
    results = tmp_path / "fleet.json"
    results.write_text(json.dumps({"gpus": 32, "days": 4.0, "seeds": [7], "per_seed": [tiny()]}))
    assert fleet.main(["--charts-from", str(results), "--charts", str(tmp_path / "charts")]) == 0
    assert sorted(p.name for p in (tmp_path / "charts").iterdir()) == ["ettr.svg", "lost_time.svg"]
    assert "charts: " in capsys.readouterr().out
    assert fleet.main(["--charts-from", str(tmp_path / "missing.json"), "--charts", str(tmp_path / "x")]) == 2
    with pytest.raises(SystemExit):
        fleet.main(["--charts-from", str(results)])  # no --charts


def test_keel_sim_draws_its_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    from keel.cli.main import main

    monkeypatch.setattr(charts, "find_browser", lambda: None)
    assert main(["sim", "--nodes", "8", "--days", "2", "--systems", "conventional,oracle",
                 "--charts", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "ettr.svg" in out.out and "no headless Chromium" in out.err
    root = ET.parse(tmp_path / "ettr.svg").getroot()
    assert [p.attrib["data-system"] for p in root.findall(".//s:polyline", NS)] == ["conventional", "oracle"]
    lost = ET.parse(tmp_path / "lost_time.svg").getroot()  # no Keel in the run: the first system's bars
    assert "conventional: lost hours by phase" in "".join(lost.itertext())

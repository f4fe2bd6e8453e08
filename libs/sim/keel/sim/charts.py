"""Charts of a fleet run as SVG text, and their PNGs through a headless Chromium when one is installed.

``ettr_svg`` and ``lost_time_svg`` are pure: from a run's JSON-ready results (what ``keel.sim.run.run_many`` returns
for one run, what ``keel sim --json`` writes, or ``bench.fleet``'s results file with its ``per_seed`` runs) they
return an SVG document, the same text for the same results (no clock, no randomness, fixed number formats), with
every label escaped. With several seeds a series is the mean over them, as ``bench.fleet``'s ``ettr`` is.

- ``ettr_svg``: cumulative ETTR at the end of each simulated day, one polyline per system on one chart, the
  target (0.985) dashed, a legend with each system's final figure.
- ``lost_time_svg``: Keel's lost hours as horizontal bars by phase and by mechanism, then every system's lost hours
  stacked by phase.

``write_charts`` (I/O) writes ``ettr.svg`` and ``lost_time.svg`` into a folder and converts each to PNG with
Debian's headless Chromium (``chromium-headless-shell``, which ``make system-deps`` installs, or ``chromium``)
when it is there; without one it writes the SVGs only and says so on stderr: a missing browser never fails a run.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO
from xml.sax.saxutils import escape

TARGET_ETTR = 0.985
BROWSERS = ("chromium-headless-shell", "chromium")

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
SYSTEM_COLORS = {"keel": "#1f77b4", "keel_no_standby": "#9467bd", "keel_no_analyzer": "#8c564b",
                 "keel_no_memory_ckpt": "#e377c2", "keel_no_hot_update": "#17becf", "conventional": "#d62728",
                 "torchelastic": "#ff7f0e", "oracle": "#2ca02c"}
PHASES = ("detection", "diagnosis", "standby_wait", "restart", "recompute", "slow", "checkpoint", "human")
PHASE_COLORS = {"detection": "#4e79a7", "diagnosis": "#76b7b2", "standby_wait": "#f28e2b", "restart": "#e15759",
                "recompute": "#edc948", "slow": "#b07aa1", "checkpoint": "#9c755f", "human": "#59a14f"}
FONT = 'font-family="DejaVu Sans, Arial, Helvetica, sans-serif"'


def _esc(text: object) -> str:
    """Text or an attribute's value, escaped (``&``, ``<``, ``>`` and both quotes)."""
    return escape(str(text), {'"': "&quot;", "'": "&#39;"})


def _num(x: float) -> str:
    """A coordinate: two decimals, no trailing zeros (the same text for the same value on every platform)."""
    text = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _color(name: str, index: int, known: dict[str, str]) -> str:
    return known.get(name, PALETTE[index % len(PALETTE)])


def nice_step(span: float, max_ticks: int) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k that cuts ``span`` into at most ``max_ticks`` intervals."""
    if span <= 0:
        return 1.0
    raw = span / max(1, max_ticks)
    power = 10.0 ** math.floor(math.log10(raw))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * power >= raw * (1 - 1e-9):
            return m * power
    return 10.0 * power


def _ticks(lo: float, hi: float, step: float) -> list[float]:
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [round(i * step, 10) for i in range(first, last + 1)]


def _tick_label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if abs(step / 10 ** -decimals - round(step / 10 ** -decimals)) > 1e-6:
        decimals += 1  # 2.5 x 10^k
    return f"{value:.{decimals}f}"


def _runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs a result holds: ``bench.fleet``'s ``per_seed``, or the result itself (one run)."""
    runs = result.get("per_seed") or [result]
    if not all(isinstance(r.get("systems"), dict) and r["systems"] for r in runs):
        raise ValueError("no systems in the results: expected a run (with 'systems') or bench.fleet's results "
                         "(with 'per_seed')")
    return list(runs)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def ettr_series(result: dict[str, Any]) -> dict[str, list[float]]:
    """Each system's cumulative ETTR at the end of each simulated day (``ettr_daily``), the mean over the runs'
    seeds, in the results' order of systems."""
    runs = _runs(result)
    out: dict[str, list[float]] = {}
    for system in runs[0]["systems"]:
        series = [r["systems"][system]["ettr_daily"] for r in runs if system in r["systems"]]
        days = min(len(s) for s in series)
        out[system] = [_mean([s[d] for s in series]) for d in range(days)]
    return out


def lost_by(result: dict[str, Any], key: str) -> dict[str, dict[str, float]]:
    """Each system's lost hours by ``key`` (``lost_h_by_phase`` or ``lost_h_by_mechanism``), the mean over the
    runs' seeds (a name a seed lacks counts 0 there)."""
    runs = _runs(result)
    out: dict[str, dict[str, float]] = {}
    for system in runs[0]["systems"]:
        per_run = [r["systems"][system].get(key, {}) for r in runs if system in r["systems"]]
        names = sorted({n for p in per_run for n in p})
        out[system] = {n: _mean([float(p.get(n, 0.0)) for p in per_run]) for n in names}
    return out


def _subtitle(result: dict[str, Any]) -> str:
    parts = []
    if "gpus" in result:
        parts.append(f"{int(result['gpus']):,} GPUs")
    elif "nodes" in result:
        parts.append(f"{int(result['nodes']):,} machines")
    if "days" in result:
        parts.append(f"{float(result['days']):g} days")
    seeds = result.get("seeds") or ([result["seed"]] if "seed" in result else [])
    if seeds:
        label = "seed" if len(seeds) == 1 else "mean over seeds"
        parts.append(f"{label} {', '.join(str(s) for s in seeds)}")
    if result.get("commit"):
        parts.append(f"commit {str(result['commit'])[:7]}")
    return ", ".join(parts)


def _open(width: int, height: int, title: str, subtitle: str) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" {FONT} font-size="12">',
            f"<title>{_esc(title)}</title>",
            f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
            f'<text x="{width / 2:g}" y="22" text-anchor="middle" font-size="16" font-weight="bold">'
            f"{_esc(title)}</text>",
            f'<text x="{width / 2:g}" y="40" text-anchor="middle" fill="#555555">{_esc(subtitle)}</text>']


def ettr_svg(result: dict[str, Any], *, target: float = TARGET_ETTR, title: str = "Cumulative ETTR over the run",
             width: int = 960, height: int = 540) -> str:
    """Every system's cumulative ETTR by simulated day on one chart (SVG text): one ``polyline`` per system (its
    ``data-system`` names it), the target as a dashed line, a legend with each system's last figure."""
    series = ettr_series(result)
    days = max(len(s) for s in series.values())
    horizon = float(result.get("days") or _runs(result)[0].get("days") or days)
    values = [v for s in series.values() for v in s] + [target]
    left, right, top, bottom = 70.0, width - 250.0, 60.0, height - 60.0
    y_step = nice_step(max(values) - min(values), 8)
    y_lo = max(0.0, math.floor(min(values) / y_step + 1e-9) * y_step)
    y_hi = max(y_lo + y_step, math.ceil(max(values) / y_step - 1e-9) * y_step)
    x_step = max(1.0, nice_step(horizon, 10)) if horizon >= 2 else nice_step(horizon, 10)

    def x_of(day: float) -> float:
        return left + (right - left) * day / horizon

    def y_of(value: float) -> float:
        return bottom - (bottom - top) * (value - y_lo) / (y_hi - y_lo)

    out = _open(width, height, title, _subtitle(result))
    out.append('<g class="grid" stroke="#e5e5e5" stroke-width="1">')
    for v in _ticks(y_lo, y_hi, y_step):
        out.append(f'<line x1="{_num(left)}" y1="{_num(y_of(v))}" x2="{_num(right)}" y2="{_num(y_of(v))}"/>')
    out.append("</g>")
    out.append('<g class="axes" stroke="#333333" stroke-width="1">'
               f'<line x1="{_num(left)}" y1="{_num(bottom)}" x2="{_num(right)}" y2="{_num(bottom)}"/>'
               f'<line x1="{_num(left)}" y1="{_num(top)}" x2="{_num(left)}" y2="{_num(bottom)}"/></g>')
    out.append('<g class="y-ticks" text-anchor="end">')
    for v in _ticks(y_lo, y_hi, y_step):
        out.append(f'<line x1="{_num(left - 5)}" y1="{_num(y_of(v))}" x2="{_num(left)}" y2="{_num(y_of(v))}" '
                   f'stroke="#333333"/><text x="{_num(left - 8)}" y="{_num(y_of(v) + 4)}" '
                   f'data-value="{_esc(_tick_label(v, y_step))}">{_esc(_tick_label(v, y_step))}</text>')
    out.append("</g>")
    out.append('<g class="x-ticks" text-anchor="middle">')
    for d in _ticks(0.0, horizon, x_step):
        out.append(f'<line x1="{_num(x_of(d))}" y1="{_num(bottom)}" x2="{_num(x_of(d))}" y2="{_num(bottom + 5)}" '
                   f'stroke="#333333"/><text x="{_num(x_of(d))}" y="{_num(bottom + 18)}">'
                   f"{_esc(_tick_label(d, x_step))}</text>")
    out.append("</g>")
    out.append(f'<text x="{_num((left + right) / 2)}" y="{_num(height - 18)}" text-anchor="middle">'
               "simulated day</text>")
    out.append(f'<text x="18" y="{_num((top + bottom) / 2)}" text-anchor="middle" '
               f'transform="rotate(-90 18 {_num((top + bottom) / 2)})">cumulative ETTR</text>')
    ty = y_of(target)
    out.append(f'<line class="target" x1="{_num(left)}" y1="{_num(ty)}" x2="{_num(right)}" y2="{_num(ty)}" '
               f'stroke="#000000" stroke-width="1.5" stroke-dasharray="6 4" data-value="{_esc(target)}"/>')
    out.append('<g class="series" fill="none" stroke-width="2" stroke-linejoin="round">')
    for i, (system, points) in enumerate(series.items()):
        # Day d's figure is the ETTR at its end: at x = d + 1 (the last day may be a part of one).
        coords = " ".join(f"{_num(x_of(min(horizon, d + 1.0)))},{_num(y_of(v))}" for d, v in enumerate(points))
        out.append(f'<polyline data-system="{_esc(system)}" stroke="{_color(system, i, SYSTEM_COLORS)}" '
                   f'points="{coords}"/>')
    out.append("</g>")
    out.append('<g class="legend">')
    lx = right + 20
    for i, (system, points) in enumerate(series.items()):
        ly = top + 6 + 22 * i
        out.append(f'<line x1="{_num(lx)}" y1="{_num(ly)}" x2="{_num(lx + 24)}" y2="{_num(ly)}" '
                   f'stroke="{_color(system, i, SYSTEM_COLORS)}" stroke-width="3"/>'
                   f'<text x="{_num(lx + 30)}" y="{_num(ly + 4)}">{_esc(f"{system} {points[-1]:.4f}")}</text>')
    ly = top + 6 + 22 * len(series) + 8
    out.append(f'<line x1="{_num(lx)}" y1="{_num(ly)}" x2="{_num(lx + 24)}" y2="{_num(ly)}" stroke="#000000" '
               f'stroke-width="1.5" stroke-dasharray="6 4"/>'
               f'<text x="{_num(lx + 30)}" y="{_num(ly + 4)}">{_esc(f"target {target:g}")}</text>')
    out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _order(names: list[str]) -> list[str]:
    """Phases in the order a recovery goes through them, then any other name alphabetically."""
    return [p for p in PHASES if p in names] + sorted(n for n in names if n not in PHASES)


def _hbars(out: list[str], *, heading: str, bars: list[tuple[str, float, str]], top: float, width: int,
           label_w: float = 170.0) -> float:
    """A panel of horizontal bars (label, hours, colour), each with its figure; returns where the panel ends."""
    left, right, row = label_w, width - 90.0, 22.0
    out.append(f'<text x="20" y="{_num(top)}" font-size="14" font-weight="bold">{_esc(heading)}</text>')
    scale = max([h for _, h, _ in bars] + [1e-9])
    y = top + 14
    out.append(f'<g class="bars" data-panel="{_esc(heading)}">')
    for label, hours, color in bars:
        w = (right - left) * hours / scale
        out.append(f'<text x="{_num(left - 8)}" y="{_num(y + 13)}" text-anchor="end">{_esc(label)}</text>'
                   f'<rect x="{_num(left)}" y="{_num(y)}" width="{_num(w)}" height="{_num(row - 6)}" '
                   f'fill="{color}" data-label="{_esc(label)}" data-hours="{hours:.3f}"/>'
                   f'<text x="{_num(left + w + 6)}" y="{_num(y + 13)}">{_esc(f"{hours:.2f} h")}</text>')
        y += row
    out.append("</g>")
    return y


def lost_time_svg(result: dict[str, Any], *, system: str | None = None, title: str = "Lost time",
                  width: int = 960) -> str:
    """``system``'s lost hours (default Keel's, else the first system's) as horizontal bars by phase and by
    mechanism, then every system's lost hours stacked by phase, one bar each (SVG text)."""
    by_phase = lost_by(result, "lost_h_by_phase")
    by_mechanism = lost_by(result, "lost_h_by_mechanism")
    if system is None:
        system = "keel" if "keel" in by_phase else next(iter(by_phase))
    if system not in by_phase:
        raise ValueError(f"no system {system!r} in the results: {', '.join(by_phase)}")
    phases = _order(sorted({p for v in by_phase.values() for p in v}))
    phase_color = {p: _color(p, i, PHASE_COLORS) for i, p in enumerate(phases)}
    mine = by_phase[system]
    mechanisms = sorted(by_mechanism[system].items(), key=lambda kv: (-kv[1], kv[0]))
    systems = list(by_phase)
    height = int(60 + 40 + 22 * len(mine) + 40 + 22 * len(mechanisms) + 40 + 22 * len(systems) + 70)
    out = _open(width, height, title, _subtitle(result))
    y = _hbars(out, heading=f"{system}: lost hours by phase ({sum(mine.values()):.2f} h in all)",
               bars=[(p, mine[p], phase_color[p]) for p in _order(list(mine))], top=80.0, width=width)
    y = _hbars(out, heading=f"{system}: lost hours by mechanism (the failure kind)",
               bars=[(m, h, "#1f77b4") for m, h in mechanisms], top=y + 30, width=width)
    top = y + 30
    out.append(f'<text x="20" y="{_num(top)}" font-size="14" font-weight="bold">'
               f"{_esc('every system: lost hours stacked by phase')}</text>")
    left, right, row = 170.0, width - 90.0, 22.0
    totals = {s: sum(v.values()) for s, v in by_phase.items()}
    scale = max(list(totals.values()) + [1e-9])
    y = top + 14
    out.append('<g class="stacks">')
    for s in systems:
        x = left
        out.append(f'<g data-system="{_esc(s)}"><text x="{_num(left - 8)}" y="{_num(y + 13)}" text-anchor="end">'
                   f"{_esc(s)}</text>")
        for p in _order(list(by_phase[s])):
            w = (right - left) * by_phase[s][p] / scale
            out.append(f'<rect x="{_num(x)}" y="{_num(y)}" width="{_num(w)}" height="{_num(row - 6)}" '
                       f'fill="{phase_color[p]}" data-phase="{_esc(p)}" data-hours="{by_phase[s][p]:.3f}"/>')
            x += w
        out.append(f'<text x="{_num(x + 6)}" y="{_num(y + 13)}">{_esc(f"{totals[s]:.1f} h")}</text></g>')
        y += row
    out.append("</g>")
    out.append('<g class="legend">')
    lx, ly = left, y + 16
    for p in phases:
        out.append(f'<rect x="{_num(lx)}" y="{_num(ly - 10)}" width="12" height="12" fill="{phase_color[p]}"/>'
                   f'<text x="{_num(lx + 16)}" y="{_num(ly)}">{_esc(p)}</text>')
        lx += 16 + 8 * len(p) + 22
        if lx > width - 120:
            lx, ly = left, ly + 20
    out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


CHARTS: dict[str, Callable[[dict[str, Any]], str]] = {"ettr": ettr_svg, "lost_time": lost_time_svg}
"""The charts ``write_charts`` writes, by file name."""


def find_browser() -> str | None:
    """Debian's headless Chromium (``chromium-headless-shell``, else ``chromium``) on PATH or in /usr/bin."""
    for name in BROWSERS:
        found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
        if found:
            return found
    return None


def svg_size(svg: str) -> tuple[int, int]:
    import xml.etree.ElementTree as ET

    root = ET.fromstring(svg)
    return int(float(root.attrib["width"])), int(float(root.attrib["height"]))


def svg_to_png(svg_path: Path, png_path: Path, *, browser: str, timeout_s: float = 120.0) -> None:
    """``svg_path`` rendered by ``browser`` (a headless Chromium) at its own size into ``png_path``; raises
    RuntimeError with the browser's last words when it wrote none."""
    width, height = svg_size(svg_path.read_text())
    with tempfile.TemporaryDirectory(prefix="keel-chart-") as profile:
        done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                               "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}",
                               f"--window-size={width},{height}", f"--screenshot={png_path.resolve()}",
                               svg_path.resolve().as_uri()],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0 or not png_path.exists() or png_path.stat().st_size == 0:
        raise RuntimeError(f"{browser} did not render {svg_path} (exit {done.returncode}): {done.stderr[-1500:]}")


def write_charts(result: dict[str, Any], directory: Path, *, png: bool = True, browser: str | None = None,
                 stderr: TextIO | None = None) -> list[Path]:
    """``ettr.svg`` and ``lost_time.svg`` (and, with a headless Chromium, their PNGs) in ``directory``; returns the
    files written. Without a browser, or when it fails, the SVGs stay and the reason goes to ``stderr``."""
    err = stderr if stderr is not None else sys.stderr
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, render in CHARTS.items():
        path = directory / f"{name}.svg"
        path.write_text(render(result))
        written.append(path)
    if not png:
        return written
    browser = browser or find_browser()
    if browser is None:
        print(f"charts: no headless Chromium ({' or '.join(BROWSERS)}) found: wrote the SVGs only "
              "(`make system-deps` installs chromium-headless-shell)", file=err)
        return written
    for svg in list(written):
        target = svg.with_suffix(".png")
        try:
            svg_to_png(svg, target, browser=browser)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            print(f"charts: {svg.name} not converted to PNG: {exc}", file=err)
            continue
        written.append(target)
    return written

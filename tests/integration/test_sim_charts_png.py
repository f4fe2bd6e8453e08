"""``keel.sim.charts``' PNGs, with the real headless Chromium (Debian's ``chromium-headless-shell``, which
``make system-deps`` installs): a small SVG converted to a PNG of its own size whose pixels show what the SVG
drew, and ``bench.fleet --charts-from`` drawing the committed quick run's results, PNGs included. A missing
browser fails here with the reason: it is not skipped."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib
from pathlib import Path

from keel.sim.charts import BROWSERS, find_browser, svg_size, svg_to_png

REPO = Path(__file__).resolve().parents[2]
SIGNATURE = b"\x89PNG\r\n\x1a\n"


def browser() -> str:
    found = find_browser()
    assert found, (f"none of {', '.join(BROWSERS)} is installed: `make system-deps` (as root) installs "
                   "chromium-headless-shell from Debian")
    return found


def decode_png(data: bytes) -> tuple[int, int, list[list[tuple[int, ...]]]]:
    """Width, height and RGB(A) pixel rows of an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes)."""
    assert data[:8] == SIGNATURE, data[:8]
    pos, chunks, idat = 8, {}, b""
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IDAT":
            idat += body
        else:
            chunks[kind] = body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append([tuple(line[x * bpp:x * bpp + 3]) for x in range(width)])
        prev = line
    return width, height, rows


def test_a_small_svg_becomes_a_png_of_its_size_showing_what_it_drew(tmp_path: Path) -> None:
    svg = tmp_path / "small.svg"
    svg.write_text('<svg xmlns="http://www.w3.org/2000/svg" width="120" height="80" viewBox="0 0 120 80">'
                   '<rect width="120" height="80" fill="#ffffff"/><rect x="10" y="10" width="40" height="30" '
                   'fill="#ff0000"/><text x="60" y="70" font-size="12">a &amp; b</text></svg>')
    png = tmp_path / "small.png"
    svg_to_png(svg, png, browser=browser())
    data = png.read_bytes()
    assert data[:8] == SIGNATURE and png.stat().st_size > 0
    width, height, rows = decode_png(data)
    assert (width, height) == (120, 80)
    assert rows[25][30] == (255, 0, 0)  # inside the red rectangle
    assert rows[5][100] == (255, 255, 255)  # the white background


def test_bench_fleet_draws_the_committed_results_as_svgs_and_pngs(tmp_path: Path) -> None:
    browser()
    out = tmp_path / "charts"
    done = subprocess.run([sys.executable, "-m", "bench.fleet", "--charts-from", "bench/results/fleet_quick.json",
                           "--charts", str(out)], cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert sorted(p.name for p in out.iterdir()) == ["ettr.png", "ettr.svg", "lost_time.png", "lost_time.svg"]
    assert "not converted" not in done.stderr and "no headless Chromium" not in done.stderr
    for name in ("ettr", "lost_time"):
        width, height, rows = decode_png((out / f"{name}.png").read_bytes())
        assert (width, height) == svg_size((out / f"{name}.svg").read_text())
        assert len({px for row in rows[::10] for px in row[::10]}) > 5  # not a blank page

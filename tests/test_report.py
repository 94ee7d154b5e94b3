"""`batchembed report`: a self-contained HTML page, checked in a real headless browser."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import make_job, write_parquet

from batchembed.run import run_job

BIN = os.path.join(os.path.dirname(sys.executable), "batchembed")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_report_page_renders_its_three_charts(tmp_path, engine):
    texts = [f"report row {i} " + "about rivers and lanterns " * (i % 9 + 1) for i in range(120)]
    write_parquet(tmp_path / "in.parquet", {"id": list(range(120)), "text": texts})
    run_job(make_job(tmp_path / "in.parquet", tmp_path / "out", embedding={"dimensions": [384, 64]}),
            engine=engine, show_progress=False)
    page = tmp_path / "report.html"
    r = subprocess.run([BIN, "report", str(tmp_path / "out"), "-o", str(page), "--sample-rows", "100"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    html = page.read_text()
    assert not re.search(r'(src|href)="(https?:)?//', html)  # self-contained: nothing fetched
    # the table: recall at the full width is 1, and every stored dimension is marked
    assert "<td>384</td><td>1.000</td>" in html and html.count("stored</td>") == 2
    if CHROMIUM is None:
        if os.environ.get("BATCHEMBED_REQUIRE_BROWSER"):
            pytest.fail("chromium is not installed (apt-get install chromium)")
        pytest.skip("chromium is not installed")
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*args, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    for chart in ("token-lengths", "throughput", "matryoshka"):
        assert f'<svg id="{chart}"' in dom, chart
    token_svg = dom[dom.index('<svg id="token-lengths"'):]
    assert token_svg[:token_svg.index("</svg>")].count('class="bar"') == 32
    assert dom.count("<polyline") == 2  # throughput over time, recall by dimension
    shot = tmp_path / "shot.png"
    subprocess.run([*args, "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one

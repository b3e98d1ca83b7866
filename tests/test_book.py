"""The built book: every chapter executes (quick mode) and every page renders offline.

One quick-mode build (``DEJAVU_QUICK=1``, ``-W --keep-going``) checks that each chapter in
``_toc.yml`` executes and the book builds with no warning. Then headless Chromium opens each page
with the network closed and checks that every plotly figure drew its SVG, every ipywidget
rendered its saved state, that no page asked for anything outside the book, and that every file
a page asked for of the book was there. Screenshots are kept in ``_build/screenshots/`` for people
to look at.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]
OUT = ROOT / "_build" / "quick"  # the quick build, beside the full one
SHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def toc_pages() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = [toc["root"]]
    for part in toc.get("parts", []):
        pages += [c["file"] for c in part.get("chapters", [])]
    return pages


PAGES = toc_pages()


@pytest.fixture(scope="module")
def html() -> Path:
    """Build the book in quick mode once; fail with each failing chapter's traceback."""
    subprocess.run(["make", "-s", "_static/vendor/require.js"], cwd=ROOT, check=True)
    shutil.rmtree(OUT, ignore_errors=True)
    jb = Path(sys.executable).with_name("jupyter-book")
    proc = subprocess.run(
        [str(jb), "build", str(ROOT), "--path-output", str(OUT), "-W", "--keep-going"],
        cwd=ROOT,
        # as `make book` runs it: no TRITON_INTERPRET (make test sets it for the kernel tests),
        # so on a CPU the chapters' engines run the kernels' PyTorch references
        env={
            **{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
            "DEJAVU_QUICK": "1",
        },
        capture_output=True,
        text=True,
    )
    site = OUT / "_build" / "html"
    if proc.returncode != 0:
        logs = "\n".join(p.read_text()[-3000:] for p in site.glob("reports/**/*.err.log"))
        warnings = [
            ln
            for ln in proc.stdout.splitlines() + proc.stderr.splitlines()
            if "WARNING" in ln or "ERROR" in ln
        ]
        pytest.fail("jupyter-book build failed:\n" + "\n".join(warnings[-20:]) + "\n" + logs)
    return site


def test_book_builds_with_no_warnings(html):
    for page in PAGES:
        assert (html / f"{page}.html").exists(), page


@pytest.fixture(scope="module")
def browser(html):
    if CHROMIUM is None:
        pytest.skip(
            "Chromium is not installed (apt-get install chromium): rendered pages were not checked"
        )
    from playwright.sync_api import sync_playwright

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(html))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield b, f"http://127.0.0.1:{server.server_address[1]}"
        b.close()
    server.shutdown()


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_offline(browser, page):
    b, base = browser
    tab = b.new_page(viewport={"width": 1200, "height": 900})
    outside = []
    tab.on(
        "request",
        lambda r: (
            None if r.url.startswith((base, "data:", "blob:", "about:")) else outside.append(r.url)
        ),
    )
    missing = []  # the book's own files the page asked for and did not get (a font, a script)
    tab.on("response", lambda r: missing.append(r.url) if r.status >= 400 else None)
    tab.on("requestfailed", lambda r: missing.append(r.url) if r.url.startswith(base) else None)
    tab.goto(f"{base}/{page}.html", wait_until="networkidle")
    tab.wait_for_timeout(500)
    SHOTS.mkdir(parents=True, exist_ok=True)
    # full-page JPEG shots (PNG took twice as long on a busy 2-core machine). Chromium cannot
    # capture a page much taller than 16k pixels: a longer chapter is shot to there. A
    # reference page far longer than any chapter (the API page: 500k pixels, where any
    # full-page capture took 13-25 s) is shot as the reader first sees it, one screen
    height = tab.evaluate("() => document.documentElement.scrollHeight")
    full = height <= 40000
    clip = {"x": 0, "y": 0, "width": 1200, "height": 16000} if full and height > 16000 else None
    tab.screenshot(
        path=str(SHOTS / f"{page.replace('/', '__')}.jpg"), full_page=full, clip=clip,
        type="jpeg", quality=80, timeout=180_000,
    )  # fmt: skip
    figures = tab.locator(".plotly-graph-div")
    drawn = [figures.nth(i).locator(".main-svg").count() > 0 for i in range(figures.count())]
    views = tab.evaluate("""() => [...document.querySelectorAll(
        'script[type="application/vnd.jupyter.widget-view+json"]')].map(
        s => s.parentElement.querySelector('.lm-Widget') !== null)""")
    errors = tab.locator(".output.traceback, .cell_output .output.error").count()
    tab.close()
    assert not outside, f"{page} requested URLs outside the book: {sorted(set(outside))}"
    assert not missing, f"{page} asked for files the book does not have: {sorted(set(missing))}"
    assert all(drawn), f"{page}: {drawn.count(False)} of {len(drawn)} plotly figures drew no SVG"
    assert all(views), f"{page}: {views.count(False)} of {len(views)} widgets did not render"
    assert errors == 0, f"{page} shows {errors} error outputs"

"""The built HTML book, checked in a real browser (headless Chromium from Debian, driven by Playwright).

For every page in _toc.yml: it loads, its mathematics is typeset by the local MathJax, no raw TeX is
left in the text a reader sees, every image loads, the console shows no error, no request fails or
leaves the machine, and every link to a page of the book resolves (anchors included).

Run with `make test-browser` (it builds the book first) or, after `make book`,
`.venv/bin/python -m pytest tests -m browser`. Needs Debian's Chromium (`apt-get install chromium`);
Playwright's own browser download is never used. Set CHROMIUM to use another Chromium binary.
"""
from __future__ import annotations

import functools
import html.parser
import json
import http.client
import http.server
import os
import re
import shutil
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
from book_toc import ROOT, toc_documents

pytestmark = pytest.mark.browser

BUILD = ROOT / "_build" / "html"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
]
PAGE_TIMEOUT_MS = 60_000  # a 2-core CI machine, MathJax typesetting a long chapter

PAGES = toc_documents()


def source_math(page: str) -> bool:
    """Whether the source of a page has math: markdown prose (code removed) or text/latex outputs."""
    md, ipynb = ROOT / f"{page}.md", ROOT / f"{page}.ipynb"
    if ipynb.exists():
        nb = json.loads(ipynb.read_text("utf8"))
        chunks = []
        for cell in nb["cells"]:
            if cell["cell_type"] == "markdown":
                chunks.append("".join(cell["source"]))
            for out in cell.get("outputs", []):
                if "text/latex" in out.get("data", {}):
                    return True
        text = "\n".join(chunks)
    elif md.exists():
        text = md.read_text("utf8")
    else:
        return False
    text = re.sub(r"^[ \t]*(`{3,}|~{3,})(?!\{math\}).*?^[ \t]*\1", "", text, flags=re.M | re.S)  # code fences
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return bool(re.search(r"\$|\\\(|\\\[|\{math\}|\\begin\{", text))


# --------------------------------------------------------------------------------------------
# Fixtures: the built site, a local HTTP server, the browser
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def site() -> Path:
    if not (BUILD / "index.html").is_file():
        pytest.fail(f"{BUILD} has no built book: run `make book` first", pytrace=False)
    return BUILD


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - signature of the base class
        pass


@pytest.fixture(scope="session")
def base_url(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # port 0: a free port
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="book-http", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def _chromium_path() -> str | None:
    """$CHROMIUM if set, else Debian's /usr/bin/chromium, else `chromium` on PATH."""
    candidates = [os.environ["CHROMIUM"]] if os.environ.get("CHROMIUM") else ["/usr/bin/chromium"]
    for candidate in candidates:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None if os.environ.get("CHROMIUM") else shutil.which("chromium")


@pytest.fixture(scope="session")
def browser():
    executable = _chromium_path()
    if executable is None:
        pytest.skip(
            "Chromium not found (looked for $CHROMIUM, /usr/bin/chromium, chromium on PATH): "
            "install it with `sudo apt-get install chromium`"
        )
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the playwright package is missing: `make setup` installs it"
    )
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, args=CHROMIUM_ARGS, headless=True
        )
        yield browser
        browser.close()


# --------------------------------------------------------------------------------------------
# Link checking against the local server (shared cache across pages)
# --------------------------------------------------------------------------------------------


class _IdCollector(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value and (name == "id" or (name == "name" and tag == "a")):
                self.ids.add(value)


@functools.lru_cache(maxsize=None)
def _fetch(url: str) -> tuple[int, str, frozenset[str]]:
    """(HTTP status, content type, ids in the document) of a URL on the local server."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", parts.path or "/")
        resp = conn.getresponse()
        body = resp.read()
        ctype = resp.getheader("Content-Type", "")
    finally:
        conn.close()
    ids: frozenset[str] = frozenset()
    if resp.status == 200 and ctype.startswith("text/html"):
        collector = _IdCollector()
        collector.feed(body.decode("utf8", errors="replace"))
        ids = frozenset(collector.ids)
    return resp.status, ctype, ids


# --------------------------------------------------------------------------------------------
# In-page JavaScript
# --------------------------------------------------------------------------------------------

# Resolves once MathJax has typeset the page; "absent" when the page does not load MathJax.
JS_MATHJAX_DONE = """
async () => {
  const mj = window.MathJax;
  if (!mj || !mj.startup || !mj.startup.promise) return "absent";
  await mj.startup.promise;
  return "done";
}
"""

JS_MATH_STATE = """
() => {
  const sphinxMath = Array.from(document.querySelectorAll(".math"));
  const untypeset = sphinxMath
    .filter(el => !el.querySelector("mjx-container"))
    .map(el => el.textContent.trim().slice(0, 120));
  return {
    sphinxMath: sphinxMath.length,
    containers: document.querySelectorAll("mjx-container").length,
    errors: Array.from(document.querySelectorAll("mjx-merror"))
      .map(el => (el.getAttribute("data-mjx-error") || el.textContent).slice(0, 200)),
    untypeset: untypeset,
  };
}
"""

# The text a reader sees, without code: code cells, outputs shown as text, literalinclude blocks
# and inline code legitimately contain TeX-like strings. Typeset math is excluded too.
JS_VISIBLE_PROSE = """
() => {
  const style = document.createElement("style");
  style.textContent = `pre, code, kbd, samp, .highlight, div[class*="highlight-"], .cell_input,
    .cell_output .output.text_plain, .cell_output .output.stream, .cell_output .output.traceback,
    mjx-container, mjx-assistive-mml, script, style, noscript { display: none !important; }`;
  document.head.appendChild(style);
  const text = document.querySelector("main") ? document.querySelector("main").innerText
                                               : document.body.innerText;
  style.remove();
  return text;
}
"""

# Waits for every image (lazy ones included) and returns those that did not load.
JS_BROKEN_IMAGES = """
async () => {
  const imgs = Array.from(document.images);
  for (const img of imgs) { if (img.loading === "lazy") img.loading = "eager"; }
  await Promise.all(imgs.map(img => img.decode().catch(() => null)));
  return imgs.filter(img => !(img.complete && img.naturalWidth > 0))
             .map(img => img.currentSrc || img.src || img.outerHTML.slice(0, 120));
}
"""

JS_LINKS = "() => Array.from(document.querySelectorAll('a[href]')).map(a => a.href)"

# TeX that survived into the prose: display delimiters, \( \) \[ \], environments, the commands a
# derivation uses, and single-dollar spans whose content looks like TeX (^, _, braces, backslash).
RAW_TEX = re.compile(
    r"\$\$"
    r"|\\[()\[\]]"
    r"|\\(?:begin|end)\{"
    r"|\\(?:frac|dfrac|tfrac|sqrt|sum|prod|int|mathrm|mathbf|mathbb|mathcal|operatorname|text"
    r"|left|right|cdot|times|odot|top|ell|exp|log|max|min|partial|nabla|alpha|beta|lambda|infty"
    r"|le|ge|leq|geq|ne|approx|in|quad|qquad|label|eqref|tag)(?![A-Za-z])"
    r"|\$[^$\n]{0,80}[\\^_{}][^$\n]{0,80}\$"
)


def _page_url(base_url: str, page: str) -> str:
    return urllib.parse.urljoin(base_url, f"{page}.html")


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=[Path(p).name for p in PAGES])
def test_page(page, site, base_url, browser):
    if not (site / f"{page}.html").is_file():
        pytest.fail(f"{page}.html is missing from {site}: the build is stale, run `make book`",
                    pytrace=False)

    local_prefix = base_url.rstrip("/")
    problems: list[str] = []  # everything wrong with the page, reported together
    console_errors: list[str] = []
    page_errors: list[str] = []
    failed_requests: list[str] = []
    bad_responses: list[str] = []
    remote_requests: list[str] = []
    # Requests in flight, tracked here rather than with Playwright's "networkidle" (which the
    # Playwright docs discourage, and which timed out at random on a loaded 2-core machine).
    inflight: dict[object, str] = {}

    context = browser.new_context(service_workers="block")

    def keep_local(route):
        url = route.request.url
        if url.startswith(local_prefix) or url.startswith(("data:", "blob:", "about:")):
            route.continue_()
        else:
            remote_requests.append(url)
            route.abort("blockedbyclient")

    def on_console(msg):
        if msg.type == "error":
            where = msg.location or {}
            console_errors.append(f"{msg.text} ({where.get('url', '')}:{where.get('lineNumber', '')})")

    def on_request_failed(req):
        inflight.pop(req, None)
        if req.url.startswith(local_prefix):
            failed_requests.append(f"{req.url}: {req.failure}")

    def on_response(resp):
        if resp.status >= 400:
            bad_responses.append(f"HTTP {resp.status} {resp.url}")

    context.route("**/*", keep_local)
    tab = context.new_page()
    tab.set_default_timeout(PAGE_TIMEOUT_MS)
    tab.on("console", on_console)
    tab.on("pageerror", lambda exc: page_errors.append(str(exc)))
    tab.on("request", lambda req: inflight.__setitem__(req, req.url))
    tab.on("requestfinished", lambda req: inflight.pop(req, None))
    tab.on("requestfailed", on_request_failed)
    tab.on("response", on_response)

    def settle():
        """Wait until no request has been in flight for 300 ms."""
        deadline = time.monotonic() + PAGE_TIMEOUT_MS / 1000
        quiet_since = None
        while time.monotonic() < deadline:
            if inflight:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= 0.3:
                return
            tab.wait_for_timeout(50)
        problems.append(f"requests still pending after {PAGE_TIMEOUT_MS} ms: {sorted(inflight.values())[:10]}")

    try:
        url = _page_url(base_url, page)
        response = tab.goto(url, wait_until="load")
        if response is None or response.status != 200:
            pytest.fail(f"{url}: HTTP {response and response.status}", pytrace=False)

        # MathJax: every Sphinx math node typeset, no MathJax error.
        mathjax = tab.evaluate(JS_MATHJAX_DONE)
        math = tab.evaluate(JS_MATH_STATE)
        if math["sphinxMath"]:
            if mathjax != "done":
                problems.append("the page has math but MathJax did not load")
            elif math["containers"] == 0:
                problems.append("MathJax typeset nothing")
            if math["untypeset"]:
                problems.append(f"math left untypeset: {math['untypeset'][:5]}")
        elif source_math(page):
            problems.append("the source has math, but the page has no math element")
        if math["errors"]:
            problems.append(f"MathJax errors: {math['errors'][:5]}")

        # No TeX left in the prose.
        prose = tab.evaluate(JS_VISIBLE_PROSE)
        leftovers = sorted({m.group(0) for m in RAW_TEX.finditer(prose)})
        if leftovers:
            lines = [line.strip()[:160] for line in prose.splitlines() if RAW_TEX.search(line)][:5]
            problems.append(f"raw TeX in the visible text {leftovers[:10]}, in lines {lines}")

        broken = tab.evaluate(JS_BROKEN_IMAGES)
        if broken:
            problems.append(f"images that did not load: {broken}")

        tab.evaluate("() => document.fonts.ready.then(() => true)")  # MathJax's web fonts
        settle()
        links = tab.evaluate(JS_LINKS)
    finally:
        context.close()

    for label, found in [
        ("requests that would leave the machine (blocked)", remote_requests),
        ("failed requests", failed_requests),
        ("HTTP errors", bad_responses),
        ("uncaught JavaScript errors", page_errors),
        ("console errors", console_errors),
    ]:
        if found:
            problems.append(f"{label}: {found[:10]}")

    # Internal links: the target answers 200 and, for #anchor, has an element with that id.
    for href in sorted(set(links)):
        if not href.startswith(local_prefix):
            continue  # external (arxiv, doi) or mailto: not followed
        target, _, fragment = href.partition("#")
        status, ctype, ids = _fetch(target)
        if status != 200:
            problems.append(f"broken link {href}: HTTP {status}")
        elif fragment and ctype.startswith("text/html"):
            anchor = urllib.parse.unquote(fragment)
            if anchor not in ids:
                problems.append(f"broken link {href}: no element with id {anchor!r}")

    if problems:
        pytest.fail(f"{page}.html:\n  " + "\n  ".join(problems), pytrace=False)


def test_index_redirects_to_intro(site, base_url, browser):
    context = browser.new_context(service_workers="block")
    try:
        tab = context.new_page()
        tab.goto(base_url + "index.html", wait_until="load")
        tab.wait_for_url(re.compile(re.escape(PAGES[0]) + r"\.html"), timeout=PAGE_TIMEOUT_MS)
        assert tab.title().strip(), "the landing page has no title"
    finally:
        context.close()


def test_no_remote_assets(site):
    """No page loads a script, stylesheet, font or image from the network (MathJax is local)."""
    remote = re.compile(
        r"<(?:script|img|iframe|source)\b[^>]*\bsrc\s*=\s*[\"']?(?:https?:)?//[^\s\"'>]*"
        r"|<link\b[^>]*\bhref\s*=\s*[\"']?(?:https?:)?//[^>]*>"
        r"|@import\s+(?:url\()?[\"']?(?:https?:)?//[^\s\"')]*",
        re.IGNORECASE,
    )
    offenders = []
    for path in sorted(site.rglob("*.html")):
        text = path.read_text("utf8", errors="replace")
        for m in remote.finditer(text):
            tag = m.group(0)
            if tag.lower().startswith("<link") and re.search(r"rel\s*=\s*[\"']?canonical", tag):
                continue  # a canonical URL is metadata, not a request
            offenders.append(f"{path.relative_to(site)}: {tag[:160]}")
    assert not offenders, "remote assets in the built HTML:\n  " + "\n  ".join(offenders[:20])
    mathjax = site / "_static" / "mathjax" / "tex-chtml.js"
    assert mathjax.is_file(), f"{mathjax} is missing: sphinx-mathjax-offline did not copy MathJax"

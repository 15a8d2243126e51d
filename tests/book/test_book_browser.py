"""The built HTML book, checked in a real browser (headless Chromium from Debian, driven by Playwright).

For every page in _toc.yml: it loads, its mathematics is typeset by the local MathJax, no raw TeX is
left in the text a reader sees, every image loads, the console shows no error, no request fails or
leaves the machine, and every link to a page of the book resolves (anchors included).

Then, as a reader of the course sees it:

* **Nothing scrolls sideways at 1280 px** (`test_no_horizontal_overflow`, a 1280 x 800 window, every
  page, with every collapsed cell opened): no code block (`div.highlight pre`), cell output, display
  equation (`div.math`, `mjx-container[display]`) or table is wider than the box it sits in, no other
  element sticks out of the text column, and the page itself does not scroll horizontally. Tables
  get no exception: the theme wraps each table in a scroll container (`.pst-scrollable-table-container`),
  which is for phones; at 1280 px a table whose right-hand columns sit behind a scroll bar hides them
  just as a code block does, so the container counts as overflowing. `_static/course.css` makes
  code and text outputs wrap; display equations and tables that are too wide must be broken up in
  the chapter (MathJax 3 does not break lines).
* **Exercise solutions stay hidden** (`test_exercise_solutions_hidden`, pages with an "Exercises"
  section): the section holds at least one solution cell tagged `hide-cell` and none tagged
  `hide-input` (that tag hides the code but shows its output, the answer); every `hide-cell` cell of
  the page starts collapsed, its code and its output invisible, and clicking its toggle shows both.
* **Step-throughs step** (`test_stepthrough`, pages with a `div.fa-stepthrough`: a matplotlib
  `to_jshtml` player, see `fa_lib.animate`): clicking "Next frame" changes the frame on screen (the
  `src` of the player's `img`) and moves the slider to frame 1, and "Previous frame" brings the first
  frame back. `test_stepthrough_check_sees_a_frame_change` runs the same check on a player made here,
  and on one whose button does nothing, so that the check is known to work before a chapter has one.

And, for a reader on a phone or a laptop, and for the course as a whole:

* **Pages are not too long** (`test_words_per_page`): the rendered text of each page's article
  (prose, code and outputs) is at most MAX_WORDS words.
* **No page scrolls sideways at 390 px or at 1280 px** (`test_no_sideways_scroll`, every page):
  `document.scrollingElement.scrollWidth <= clientWidth`. Long display equations scroll inside their
  own box instead (`_static/course.css`), long inline code breaks.
* **Step-through frames are legible** (`test_stepthrough_text_size`): at 1280 px, the smallest text of
  every player's frames (recorded by `fa_lib.animate` on its `img` as `data-min-text-px`, in pixels
  of the PNG) is shown at least MIN_FRAME_TEXT_PX pixels high once the frame is scaled to the column.
* **Every chapter offers its notebook** (`test_chapter_offers_its_notebook`): the download button of
  each notebook page links the `.ipynb`, and the file is in the built site.
* **The exercises** (sources of the notebooks): every solution cell is tagged `hide-cell`
  (`test_solution_cells_are_hide_cell`), the chapters use at least MIN_CHECKERS distinct
  `exercises.check_*` checkers (`test_enough_exercise_checkers`), and chapter 9 shows the teaching
  kernel, a `literalinclude` of `fa_lib/teaching.py` rendered on its page (`test_teaching_kernel_shown`).

The page list is `_toc.yml`'s (tests/book_toc.py), so a new page or section is checked as soon as it
is listed there.

Run with `make test-browser` (it builds the book first) or, after `make book`,
`.venv/bin/python -m pytest tests -m browser`. The site is `_build/html`; set BOOK_HTML to check a book
built elsewhere (`jupyter-book build . --path-output DIR` writes it to `DIR/_build/html`). Needs
Debian's Chromium (`apt-get install chromium`); Playwright's own browser download is never used. Set
CHROMIUM to use another Chromium binary.
"""
from __future__ import annotations

import contextlib
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
import yaml
from book_toc import ROOT, toc_documents

pytestmark = pytest.mark.browser

# The built site: _build/html, or $BOOK_HTML (a book built with --path-output elsewhere).
BUILD = Path(os.environ["BOOK_HTML"]) if os.environ.get("BOOK_HTML") else ROOT / "_build" / "html"
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
        pytest.fail(f"{BUILD} has no built book: run `make book` first (or set BOOK_HTML to a built "
                    f"book's _build/html)", pytrace=False)
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


# --------------------------------------------------------------------------------------------
# The course as a reader sees it: width at 1280 px, hidden solutions, step-throughs
# --------------------------------------------------------------------------------------------

WIDE = {"width": 1280, "height": 800}  # the width at which nothing may scroll sideways


@contextlib.contextmanager
def _reader_tab(browser, url: str, viewport: dict = WIDE, *, settle: bool = True):
    """A tab on `url`, loaded (with `settle`: its MathJax typeset, its images decoded, its fonts in, so
    that every size is final); network requests blocked.

    Yields (tab, errors): `errors` collects uncaught JavaScript errors while the tab is open.
    """
    context = browser.new_context(service_workers="block", viewport=viewport)
    parts = urllib.parse.urlsplit(url)
    local = f"{parts.scheme}://{parts.netloc}/" if parts.scheme in ("http", "https") else None
    errors: list[str] = []

    def keep_local(route):
        req_url = route.request.url
        if (local and req_url.startswith(local)) or req_url.startswith(("data:", "blob:", "about:")):
            route.continue_()
        else:
            route.abort("blockedbyclient")

    try:
        context.route("**/*", keep_local)
        tab = context.new_page()
        tab.set_default_timeout(PAGE_TIMEOUT_MS)
        tab.on("pageerror", lambda exc: errors.append(str(exc)))
        if url != "about:blank":
            response = tab.goto(url, wait_until="load")
            if response is None or response.status != 200:
                pytest.fail(f"{url}: HTTP {response and response.status}", pytrace=False)
        if settle and url != "about:blank":
            tab.evaluate(JS_MATHJAX_DONE)
            tab.evaluate(JS_BROKEN_IMAGES)  # images decoded: their size is final
            tab.evaluate("() => document.fonts.ready.then(() => true)")
        yield tab, errors
    finally:
        context.close()


def _built_page(site: Path, page: str) -> None:
    if not (site / f"{page}.html").is_file():
        pytest.fail(f"{page}.html is missing from {site}: the build is stale, run `make book`",
                    pytrace=False)


# Every block of the article that is wider than its box: code, outputs, display math, tables (and
# the theme's scroll container around them); then any other element that sticks out of the text
# column; then the page itself. Collapsed content (<details>: hidden cells, dropdowns) is opened
# first, since a reader opens it. Each finding names the element, its section and its first words.
JS_OVERFLOW = """
() => {
  const article = document.querySelector("article.bd-article") || document.querySelector("main");
  for (const d of article.querySelectorAll("details")) d.open = true;
  const describe = el => {
    const cls = (el.getAttribute("class") || "").trim().split(/\\s+/).filter(Boolean).slice(0, 3);
    const section = el.closest("section[id]");
    const text = (el.textContent || "").replace(/\\s+/g, " ").trim().slice(0, 90);
    return `${el.tagName.toLowerCase()}${cls.length ? "." + cls.join(".") : ""}`
      + `${section ? " in #" + section.id : ""}: "${text}"`;
  };
  const KINDS = [
    ["code block", "div.highlight pre"],
    ["cell output", "div.cell_output, div.cell_output > div.output"],
    ["display math", "div.math, mjx-container[display='true']"],
    ["table", "table, .pst-scrollable-table-container, .table-wrapper"],
  ];
  const found = [];
  const seen = new Set();
  for (const [kind, selector] of KINDS) {
    for (const el of article.querySelectorAll(selector)) {
      if (el.scrollWidth > el.clientWidth + 1 && !seen.has(el)) {
        seen.add(el);
        found.push(`${kind} ${el.scrollWidth}px wide in ${el.clientWidth}px: ${describe(el)}`);
      }
    }
  }
  // Anything else past the right edge of the text column (overflow that does not scroll: a long
  // inline equation, a wide image, a table outside the theme's container). Elements inside a box
  // that clips or scrolls are that box's business (reported above when it is one of the blocks), and
  // only the outermost offender counts (a table, not each of its cells).
  const box = article.getBoundingClientRect();
  const right = box.right - parseFloat(getComputedStyle(article).paddingRight) + 1;
  const clipped = el => {
    for (let a = el.parentElement; a && a !== article; a = a.parentElement) {
      if (getComputedStyle(a).overflowX !== "visible") return true;
    }
    return false;
  };
  const sticking = Array.from(article.querySelectorAll("*")).filter(el => {
    if (el.closest("mjx-assistive-mml")) return false;  // MathJax's screen-reader copy, clipped
    const r = el.getBoundingClientRect();
    return r.width > 0 && r.right > right && !clipped(el);
  });
  for (const el of sticking) {
    if (sticking.some(other => other !== el && other.contains(el))) continue;
    if (Array.from(seen).some(block => block.contains(el) || el.contains(block))) continue;
    const r = el.getBoundingClientRect();
    found.push(`sticks out of the text column by ${Math.round(r.right - right)}px: ${describe(el)}`);
  }
  const doc = document.documentElement;
  if (doc.scrollWidth > doc.clientWidth + 1) {
    found.push(`the page scrolls horizontally: ${doc.scrollWidth}px wide in a ${doc.clientWidth}px window`);
  }
  return found;
}
"""


@pytest.mark.parametrize("page", PAGES, ids=[Path(p).name for p in PAGES])
def test_no_horizontal_overflow(page, site, base_url, browser):
    _built_page(site, page)
    with _reader_tab(browser, _page_url(base_url, page)) as (tab, _):
        found = tab.evaluate(JS_OVERFLOW)
    if found:
        shown = found[:25] + ([f"... and {len(found) - 25} more"] if len(found) > 25 else [])
        pytest.fail(f"{page}.html at {WIDE['width']} x {WIDE['height']}: {len(found)} element(s) wider "
                    f"than their box\n  " + "\n  ".join(shown), pytrace=False)


CODE_COLUMNS = 88  # the longest line a notebook cell may have

JS_CODE_COLUMNS = """
() => {
  const pre = document.querySelector("article div.cell_input div.highlight pre");
  if (!pre) return null;
  const probe = document.createElement("span");
  probe.style.whiteSpace = "nowrap";
  probe.style.display = "inline-block";
  probe.textContent = "x".repeat(100);
  pre.appendChild(probe);
  const charWidth = probe.getBoundingClientRect().width / 100;
  probe.remove();
  const style = getComputedStyle(pre);
  const inner = pre.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  return Math.floor(inner / charWidth);
}
"""


def test_code_lines_of_88_characters_fit(site, base_url, browser):
    """At 1280 px a code cell shows a whole line of CODE_COLUMNS characters (_static/course.css sets
    the code font for that): a line that obeys the limit never wraps."""
    page = next(p for p in PAGES if re.match(r"\d+_", Path(p).name))  # the first chapter
    _built_page(site, page)
    with _reader_tab(browser, _page_url(base_url, page)) as (tab, _):
        columns = tab.evaluate(JS_CODE_COLUMNS)
    assert columns is not None, f"{page}.html has no code cell to measure"
    assert columns >= CODE_COLUMNS, (
        f"a code cell of {page}.html at {WIDE['width']} px shows {columns} characters per line, "
        f"fewer than {CODE_COLUMNS}")


# Marks the exercise sections of a page: an <h2> "Exercises", "Exercise" or "Exercise (...)", after
# its section number ("1.7. ") and without its "#" link.
JS_MARK_EXERCISES = """
() => {
  const sections = Array.from(document.querySelectorAll("article section")).filter(sec => {
    const h = sec.querySelector(":scope > h2");
    if (!h) return false;
    const title = h.cloneNode(true);
    title.querySelectorAll(".section-number, .headerlink").forEach(el => el.remove());
    return /^Exercises?\\b/.test(title.textContent.trim());
  });
  sections.forEach(sec => sec.setAttribute("data-test-exercises", ""));
  return sections.length;
}
"""


@pytest.mark.parametrize("page", PAGES, ids=[Path(p).name for p in PAGES])
def test_exercise_solutions_hidden(page, site, base_url, browser):
    _built_page(site, page)
    problems: list[str] = []
    with _reader_tab(browser, _page_url(base_url, page), settle=False) as (tab, errors):
        if tab.evaluate(JS_MARK_EXERCISES) == 0:
            pytest.skip(f"{page} has no Exercises section")
        exercises = tab.locator("section[data-test-exercises]")
        if exercises.locator("div.cell.tag_hide-cell").count() == 0:
            problems.append("the exercises have no solution cell tagged hide-cell")
        leaking = exercises.locator("div.cell.tag_hide-input")
        for n in range(leaking.count()):
            first = " ".join(leaking.nth(n).locator(".cell_input").text_content().split())[:90]
            problems.append(f"a cell of the exercises is tagged hide-input, which shows its "
                            f"output (the answer); tag a solution hide-cell: {first!r}")

        cells = tab.locator("div.cell.tag_hide-cell")
        for n in range(cells.count()):
            cell = cells.nth(n)
            name = f"hide-cell cell {n + 1} of {cells.count()}"
            parts = [("code", cell.locator(".cell_input"))]
            parts += [(f"output {k + 1}", cell.locator(".cell_output").nth(k))
                      for k in range(cell.locator(".cell_output").count())]
            toggle = cell.locator("details > summary")
            if toggle.count() != 1:
                problems.append(f"{name} has no toggle (details > summary)")
                continue
            shown = [label for label, part in parts if part.is_visible()]
            if shown:
                problems.append(f"{name}: visible before it is opened: {', '.join(shown)}")
            toggle.click()
            tab.wait_for_timeout(100)
            hidden = [label for label, part in parts if not part.is_visible()]
            if hidden:
                problems.append(f"{name}: still hidden after clicking its toggle: {', '.join(hidden)}")
        if errors:
            problems.append(f"uncaught JavaScript errors: {errors[:5]}")
    if problems:
        pytest.fail(f"{page}.html:\n  " + "\n  ".join(problems), pytrace=False)


STEPTHROUGH = "div.fa-stepthrough"
JS_FRAME = """
el => {
  const img = el.querySelector("img[id^='_anim_img']");
  const slider = el.querySelector("input.anim-slider");
  return {src: img ? img.getAttribute("src") || "" : null, slider: slider ? slider.value : null};
}
"""


def _check_stepthroughs(tab) -> tuple[int, list[str]]:
    """Click through every step-through player of the tab; (players found, problems)."""
    players = tab.locator(STEPTHROUGH)
    problems = []
    for n in range(players.count()):
        player = players.nth(n)
        name = f"step-through {n + 1}"
        declared = player.get_attribute("data-frames")
        if declared is not None and int(declared) < 2:
            problems.append(f"{name} declares {declared} frame(s): nothing to step through")
            continue
        next_button = player.locator('button[title="Next frame"]')
        previous_button = player.locator('button[title="Previous frame"]')
        if player.locator("img[id^='_anim_img']").count() != 1 or next_button.count() != 1:
            problems.append(f"{name} is not a to_jshtml player (one img#_anim_img..., one "
                            f"'Next frame' button)")
            continue
        if not player.is_visible():
            problems.append(f"{name} is not visible on the page (inside a collapsed cell?)")
            continue
        handle = player.element_handle()
        try:  # the player sets its first frame from a setTimeout(0) after the page is parsed
            tab.wait_for_function(f"el => ({JS_FRAME})(el).src", arg=handle, timeout=5000)
        except Exception:  # noqa: BLE001 - Playwright's TimeoutError; reported in words
            problems.append(f"{name} shows no frame (its img has no src)")
            continue
        first = player.evaluate(JS_FRAME)
        next_button.click()
        try:
            tab.wait_for_function(f"([el, src]) => ({JS_FRAME})(el).src !== src",
                                  arg=[handle, first["src"]], timeout=5000)
        except Exception:  # noqa: BLE001
            problems.append(f"{name}: clicking 'Next frame' does not change the frame shown")
            continue
        second = player.evaluate(JS_FRAME)
        if first["slider"] is not None and (first["slider"], second["slider"]) != ("0", "1"):
            problems.append(f"{name}: the slider went from {first['slider']} to {second['slider']} "
                            f"on 'Next frame', not from 0 to 1")
        if previous_button.count() == 1:
            previous_button.click()
            tab.wait_for_timeout(100)
            if player.evaluate(JS_FRAME)["src"] != first["src"]:
                problems.append(f"{name}: 'Previous frame' does not bring the first frame back")
    return players.count(), problems


def _skip_without_stepthrough(site: Path, page: str) -> None:
    """Skip, before a browser tab is opened, a page whose HTML holds no step-through player."""
    if 'class="fa-stepthrough' not in (site / f"{page}.html").read_text("utf8"):
        pytest.skip(f"{page} has no step-through ({STEPTHROUGH})")


@pytest.mark.parametrize("page", PAGES, ids=[Path(p).name for p in PAGES])
def test_stepthrough(page, site, base_url, browser):
    _built_page(site, page)
    _skip_without_stepthrough(site, page)
    with _reader_tab(browser, _page_url(base_url, page), settle=False) as (tab, errors):
        if tab.locator(STEPTHROUGH).count() == 0:
            pytest.skip(f"{page} has no step-through ({STEPTHROUGH})")
        found, problems = _check_stepthroughs(tab)
    if errors:
        problems.append(f"uncaught JavaScript errors: {errors[:5]}")
    assert found > 0
    if problems:
        pytest.fail(f"{page}.html:\n  " + "\n  ".join(problems), pytrace=False)


def _player_page(broken: bool) -> str:
    """A page with one matplotlib to_jshtml player of three frames, in a div.fa-stepthrough."""
    pytest.importorskip("matplotlib", reason="matplotlib (fa_lib's book extra) makes the test player")
    from matplotlib.animation import FuncAnimation
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1), dpi=20)
    ax = fig.add_subplot()

    def draw(i):
        ax.clear()
        ax.bar([0], [i + 1])
        ax.set_ylim(0, 3)
        return []

    html = FuncAnimation(fig, draw, frames=3, init_func=lambda: [], blit=False).to_jshtml()
    html = re.sub(r"<link\b[^>]*>", "", html)  # matplotlib's Font Awesome link (a CDN)
    if broken:
        html = re.sub(r'(title="Next frame"[^>]*onclick=")[^"]*"', r'\1"', html)
    return f'<html><body><div class="{STEPTHROUGH[4:]}" data-frames="3">{html}</div></body></html>'


@pytest.mark.parametrize("broken", [False, True], ids=["working", "dead-button"])
def test_stepthrough_check_sees_a_frame_change(broken, browser):
    page = _player_page(broken)
    with _reader_tab(browser, "about:blank") as (tab, errors):
        tab.set_content(page, wait_until="load")
        found, problems = _check_stepthroughs(tab)
    assert found == 1
    assert not errors, errors
    if broken:
        assert problems == ["step-through 1: clicking 'Next frame' does not change the frame shown"]
    else:
        assert problems == []


# --------------------------------------------------------------------------------------------
# Static checks of the built HTML
# --------------------------------------------------------------------------------------------


def test_book_stylesheet_on_every_page(site):
    """_static/course.css (code that wraps) is copied and linked from every page of the book."""
    assert (site / "_static" / "course.css").is_file(), "_static/course.css was not copied into the build"
    link = re.compile(r'<link[^>]*href="[^"]*_static/course\.css')
    missing = [p for p in PAGES
               if (site / f"{p}.html").is_file() and not link.search((site / f"{p}.html").read_text("utf8"))]
    assert not missing, f"pages that do not link _static/course.css: {missing}"


def _expected_chapter_numbers() -> dict[str, int | None]:
    """Each chapter of _toc.yml (a top-level entry of a part) and its number: the chapters of the
    parts marked `numbered` count 1, 2, ... straight through (use_multitoc_numbering); the others
    (notation, the appendix, the bibliography) have none."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text("utf8"))
    numbers: dict[str, int | None] = {}
    n = 0
    for part in toc.get("parts", []):
        for chapter in part.get("chapters", []):
            if part.get("numbered"):
                n += 1
            numbers[Path(chapter["file"]).name] = n if part.get("numbered") else None
    return numbers


def test_chapter_numbers(site):
    """The sidebar numbers the chapters of the numbered parts 1, 2, ... in the order of _toc.yml,
    and leaves the other pages (introduction, notation, appendix, bibliography) unnumbered."""
    nav = re.findall(r'<li class="toctree-l1[^"]*"><a class="[^"]*" href="([^"#]*)">\s*([^<]*?)\s*</a>',
                     (site / f"{PAGES[0]}.html").read_text("utf8"))
    assert nav, "no table of contents found in the sidebar of the first page"
    expected_numbers = _expected_chapter_numbers()
    problems = []
    for href, label in nav:
        number = expected_numbers.get(Path(href).stem)
        expected = f"{number}. " if number else None
        if expected and not label.startswith(expected):
            problems.append(f"{href}: {label!r} should start with {expected!r}")
        if not expected and re.match(r"\d+\.", label):
            problems.append(f"{href}: {label!r} is numbered, but it is not a chapter of a numbered part")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------
# A reader on a phone or a laptop: page length, sideways scrolling, legible step-throughs
# --------------------------------------------------------------------------------------------

MAX_WORDS = 9_000  # rendered words per page: prose, code and outputs
NARROW = {"width": 390, "height": 844}  # a phone
JS_WORDS = """
() => {
  const article = document.querySelector("article.bd-article") || document.querySelector("main");
  return (article.innerText.match(/\\S+/g) || []).length;
}
"""


@pytest.mark.parametrize("page", PAGES, ids=[Path(p).name for p in PAGES])
def test_words_per_page(page, site, base_url, browser):
    _built_page(site, page)
    with _reader_tab(browser, _page_url(base_url, page), settle=False) as (tab, _):
        words = tab.evaluate(JS_WORDS)
    assert words <= MAX_WORDS, (
        f"{page}.html shows {words:,} words (its article, prose, code and outputs), more than "
        f"{MAX_WORDS:,}: split it into sections (pages listed under it in _toc.yml)")


JS_SIDEWAYS = """
() => {
  const doc = document.scrollingElement;
  const wide = [];
  if (doc.scrollWidth > doc.clientWidth) {
    const article = document.querySelector("article.bd-article") || document.body;
    for (const el of article.querySelectorAll("*")) {
      const r = el.getBoundingClientRect();
      if (r.width > 0 && r.right > doc.clientWidth + 1
          && !(el.parentElement && el.parentElement.getBoundingClientRect().right > doc.clientWidth + 1)) {
        wide.push(`${el.tagName.toLowerCase()}.${(el.getAttribute("class") || "").split(" ")[0]}`
                  + ` (right edge ${Math.round(r.right)}px): "${(el.textContent || "").trim().slice(0, 70)}"`);
      }
    }
  }
  return {scroll: doc.scrollWidth, client: doc.clientWidth, wide: wide.slice(0, 8)};
}
"""


@pytest.mark.parametrize("width", [NARROW["width"], WIDE["width"]], ids=["390px", "1280px"])
@pytest.mark.parametrize("page", PAGES, ids=[Path(p).name for p in PAGES])
def test_no_sideways_scroll(page, width, site, base_url, browser):
    _built_page(site, page)
    viewport = NARROW if width == NARROW["width"] else WIDE
    with _reader_tab(browser, _page_url(base_url, page), viewport) as (tab, _):
        found = tab.evaluate(JS_SIDEWAYS)
    assert found["scroll"] <= found["client"], (
        f"{page}.html scrolls sideways at {width} px: {found['scroll']} px wide in {found['client']} "
        f"px; elements past the right edge:\n  " + "\n  ".join(found["wide"]))


MIN_FRAME_TEXT_PX = 10
JS_FRAME_TEXT = """
() => Array.from(document.querySelectorAll("div.fa-stepthrough img[id^='_anim_img']")).map(img => ({
  recorded: img.getAttribute("data-min-text-px"),
  shown: img.clientWidth, natural: img.naturalWidth,
}))
"""


@pytest.mark.parametrize("page", PAGES, ids=[Path(p).name for p in PAGES])
def test_stepthrough_text_size(page, site, base_url, browser):
    _built_page(site, page)
    _skip_without_stepthrough(site, page)
    with _reader_tab(browser, _page_url(base_url, page)) as (tab, _):
        if tab.locator(STEPTHROUGH).count() == 0:
            pytest.skip(f"{page} has no step-through ({STEPTHROUGH})")
        tab.wait_for_function("() => Array.from(document.querySelectorAll("
                              "\"div.fa-stepthrough img[id^='_anim_img']\")).every(i => i.naturalWidth > 0)")
        players = tab.evaluate(JS_FRAME_TEXT)
    problems = []
    for n, player in enumerate(players, 1):
        if player["recorded"] is None:
            problems.append(f"step-through {n} does not record its smallest text (data-min-text-px): "
                            f"re-run the notebook with the current fa_lib.animate")
            continue
        shown = float(player["recorded"]) * player["shown"] / player["natural"]
        if shown < MIN_FRAME_TEXT_PX:
            problems.append(f"step-through {n}: its smallest text is {shown:.1f} px high at "
                            f"{WIDE['width']} px ({player['recorded']} px in a {player['natural']} px "
                            f"frame shown {player['shown']} px wide); use larger fonts or a narrower "
                            f"figure (at least {MIN_FRAME_TEXT_PX} px)")
    assert not problems, f"{page}.html:\n  " + "\n  ".join(problems)


# --------------------------------------------------------------------------------------------
# Run it from the page: every notebook can be downloaded
# --------------------------------------------------------------------------------------------

NOTEBOOK_PAGES = [p for p in PAGES if (ROOT / f"{p}.ipynb").is_file()]


@pytest.mark.parametrize("page", NOTEBOOK_PAGES, ids=[Path(p).name for p in NOTEBOOK_PAGES])
def test_chapter_offers_its_notebook(page, site):
    _built_page(site, page)
    text = (site / f"{page}.html").read_text("utf8")
    links = re.findall(r'<a href="([^"]+)"[^>]*\n?\s*class="[^"]*btn-download-source-button', text)
    assert links, f"{page}.html has no download button for its source (html.use_download_button)"
    href = links[0]
    assert href.endswith(f"{Path(page).name}.ipynb"), f"{page}.html: the download button links {href}"
    target = ((site / page).parent / href).resolve()
    assert target.is_file(), f"{page}.html: the download button links {href}, which is not in the site"


# --------------------------------------------------------------------------------------------
# The exercises across the chapters (sources)
# --------------------------------------------------------------------------------------------

MIN_CHECKERS = 14  # distinct fa_lib.exercises checkers the chapters use
SOLUTION = re.compile(r"^\s*#\s*(One solution|Solution)\b", re.I)


def _notebook_cells():
    for page in NOTEBOOK_PAGES:
        for i, cell in enumerate(json.loads((ROOT / f"{page}.ipynb").read_text("utf8"))["cells"]):
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            yield page, i, cell, src


def test_solution_cells_are_hide_cell():
    """A solution cell (its first line: "# One solution ..." or "# Solution ...") is tagged hide-cell,
    which hides its code and its output until the reader opens it."""
    wrong = [f"{page}.ipynb cell {i}: tags {cell.get('metadata', {}).get('tags', [])}"
             for page, i, cell, src in _notebook_cells()
             if cell["cell_type"] == "code" and SOLUTION.match(src)
             and "hide-cell" not in cell.get("metadata", {}).get("tags", [])]
    assert not wrong, "solution cells not tagged hide-cell (their output would show):\n  " + "\n  ".join(wrong)


def test_enough_exercise_checkers():
    used = sorted({m for _, _, cell, src in _notebook_cells() if cell["cell_type"] == "code"
                   for m in re.findall(r"\bexercises\.(check_\w+)", src)})
    assert len(used) >= MIN_CHECKERS, (
        f"the chapters use {len(used)} distinct exercises.check_* checkers ({', '.join(used)}); "
        f"the course needs at least {MIN_CHECKERS}")


def test_teaching_kernel_shown(site):
    """Chapter 9 shows the teaching kernel: a literalinclude of fa_lib/teaching.py, rendered."""
    page = next((p for p in NOTEBOOK_PAGES if Path(p).name.startswith("09_")), None)
    assert page is not None, "_toc.yml lists no chapter 9 notebook (book/09_...)"
    sources = [src for p, _, cell, src in _notebook_cells() if p == page and cell["cell_type"] == "markdown"]
    includes = [m for src in sources
                for m in re.findall(r"\{literalinclude\}\s+(\S*fa_lib/teaching\.py)", src)]
    assert includes, f"{page}.ipynb has no literalinclude of fa_lib/teaching.py"
    teaching = ROOT / "fa_lib" / "teaching.py"
    assert teaching.is_file(), "fa_lib/teaching.py does not exist"
    _built_page(site, page)
    html_text = (site / f"{page}.html").read_text("utf8")
    names = re.findall(r"^def (\w+)", teaching.read_text("utf8"), re.M)
    assert any(f'<span class="nf">{name}</span>' in html_text for name in names), (
        f"{page}.html shows none of the functions of fa_lib/teaching.py ({names})")

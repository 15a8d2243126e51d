"""Fast checks of the book's sources, no browser and no build: the mistakes a chapter author is most
likely to make, each with a message that says what to fix.

* every notebook in book/ is listed in _toc.yml, and every entry of _toc.yml exists;
* every notebook is committed executed (top to bottom, in one fresh kernel) and has no error output;
* every chapter opens with a label and a title, and labels are unique;
* every `{literalinclude}` file exists and every `:pyobject:` in it is defined there;
* every `{cite}` key is in book/references.bib (the bibliography _config.yml names), and every
  entry of it is cited somewhere;
* book/sanitize.cfg is valid for nbval;
* the quick-start code of book/intro.md runs.
"""
from __future__ import annotations

import ast
import configparser
import importlib.util
import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml
from book_toc import ROOT, toc_documents

BOOK = ROOT / "book"
MAX_NOTEBOOK_BYTES = 3_000_000  # committed outputs stay small: no huge images, no data dumps


def notebooks() -> list[Path]:
    return sorted(BOOK.glob("*.ipynb"))


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf8"))


def source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def markdown_texts() -> list[tuple[str, str]]:
    """(where, text) for book/*.md and every markdown cell of every notebook."""
    texts = [(p.relative_to(ROOT).as_posix(), p.read_text("utf8")) for p in sorted(BOOK.glob("*.md"))]
    for nb_path in notebooks():
        for i, cell in enumerate(load(nb_path)["cells"]):
            if cell["cell_type"] == "markdown":
                texts.append((f"{nb_path.relative_to(ROOT).as_posix()} cell {i}", source(cell)))
    return texts


NOTEBOOK_IDS = [p.stem for p in notebooks()]


# --------------------------------------------------------------------------------------------
# Table of contents
# --------------------------------------------------------------------------------------------


def test_every_toc_entry_exists():
    missing = [f for f in toc_documents() if not any((ROOT / f"{f}{s}").is_file() for s in (".ipynb", ".md"))]
    assert not missing, f"_toc.yml lists files that do not exist (neither .ipynb nor .md): {missing}"


def test_every_notebook_is_in_the_toc():
    listed = set(toc_documents())
    unlisted = [p.relative_to(ROOT).as_posix() for p in notebooks()
                if p.relative_to(ROOT).with_suffix("").as_posix() not in listed]
    assert not unlisted, (
        f"notebooks in book/ that _toc.yml does not list (the build skips them): {unlisted}")


# --------------------------------------------------------------------------------------------
# Notebooks: executed, clean, labelled
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", notebooks(), ids=NOTEBOOK_IDS)
def test_notebook_is_committed_executed(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)  # includes cell ids (nbformat 4.5)
    name = path.relative_to(ROOT).as_posix()

    kernel = nb.metadata.get("kernelspec", {})
    assert kernel.get("name") == "python3", f"{name}: kernelspec name is {kernel.get('name')!r}, not 'python3'"

    counts = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        assert cell.execution_count is not None, (
            f"{name}: code cell {i} was never executed; commit the notebook executed: "
            f".venv/bin/python tools/execute_notebooks.py {name}")
        counts.append(cell.execution_count)
        for out in cell.outputs:
            assert out.output_type != "error", (
                f"{name}: code cell {i} has an error output: {out.get('ename')}: {out.get('evalue')}")
            if out.output_type == "stream" and out.name == "stderr":
                assert "Traceback (most recent call last)" not in out.text, (
                    f"{name}: code cell {i} printed a traceback to stderr")
    assert counts == list(range(1, len(counts) + 1)), (
        f"{name}: execution counts {counts} are not 1, 2, 3, ...: the notebook was not run top to bottom "
        f"in a fresh kernel; re-run it with tools/execute_notebooks.py")
    size = path.stat().st_size
    assert size <= MAX_NOTEBOOK_BYTES, f"{name}: {size / 1e6:.1f} MB of committed outputs is too much"


LABEL = re.compile(r"^\(([A-Za-z0-9_-]+)\)=\s*$")


def test_chapters_open_with_a_unique_label_and_a_title():
    seen: dict[str, str] = {}
    problems = []
    for path in notebooks():
        cells = load(path)["cells"]
        first = cells[0] if cells else {"cell_type": "none", "source": ""}
        lines = source(first).strip().splitlines()
        m = LABEL.match(lines[0]) if lines else None
        name = path.relative_to(ROOT).as_posix()
        if first["cell_type"] != "markdown" or m is None:
            problems.append(f"{name}: the first cell must be markdown starting with a label like (ch-name)=")
            continue
        if len(lines) < 2 or not lines[1].startswith("# "):
            problems.append(f"{name}: the label must be followed by the title line '# Title'")
        if m.group(1) in seen:
            problems.append(f"{name}: label {m.group(1)!r} is already used by {seen[m.group(1)]}")
        seen[m.group(1)] = name
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------
# Included library code
# --------------------------------------------------------------------------------------------

LITERALINCLUDE = re.compile(
    r"^[ \t]*(?:`{3,}|~{3,}|:{3,})\{literalinclude\}[ \t]+(?P<path>\S+)[ \t]*\n(?P<opts>(?:[ \t]*:[\w-]+:.*\n?)*)",
    re.M,
)


def _defined_names(tree: ast.Module) -> set[str]:
    """Top-level functions/classes/assignments and Class.method names, as :pyobject: accepts them."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(f"{node.name}.{sub.name}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_literalincludes_point_at_existing_code():
    problems = []
    found = 0
    for where, text in markdown_texts():
        doc_dir = ROOT / Path(where.split(" ")[0]).parent
        for m in LITERALINCLUDE.finditer(text):
            found += 1
            rel = m.group("path")
            target = (ROOT / rel.lstrip("/")) if rel.startswith("/") else (doc_dir / rel)
            if not target.is_file():
                problems.append(f"{where}: literalinclude {rel}: no such file")
                continue
            opts = dict(re.findall(r":([\w-]+):[ \t]*(.*)", m.group("opts")))
            obj = opts.get("pyobject", "").strip()
            if obj and obj not in _defined_names(ast.parse(target.read_text("utf8"))):
                problems.append(f"{where}: :pyobject: {obj} is not defined at the top level of {rel}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------
# Citations
# --------------------------------------------------------------------------------------------

CITE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]+)`")
BIB_KEY = re.compile(r"^@\w+\{\s*([^,\s]+)\s*,", re.M)
# Package data (benchmarks.data), so that chapter 12, which reads it, runs wherever fa_lib is installed.
BIB = ROOT / "book" / "references.bib"


def test_citations_match_the_bibliography():
    config = yaml.safe_load((ROOT / "_config.yml").read_text("utf8"))
    assert [ROOT / f for f in config["bibtex_bibfiles"]] == [BIB], "_config.yml must name book/references.bib"
    bib_keys = set(BIB_KEY.findall(BIB.read_text("utf8")))
    cited: dict[str, str] = {}
    for where, text in markdown_texts():
        for group in CITE.findall(text):
            for key in group.split(","):
                cited.setdefault(key.strip(), where)
    unknown = {k: w for k, w in cited.items() if k not in bib_keys}
    assert not unknown, f"cited keys missing from book/references.bib: {unknown}"
    uncited = sorted(bib_keys - set(cited))
    assert not uncited, f"entries of book/references.bib that nothing cites: {uncited}"


# --------------------------------------------------------------------------------------------
# nbval sanitisation and the configuration
# --------------------------------------------------------------------------------------------


def test_sanitize_cfg_is_valid_for_nbval():
    parser = configparser.ConfigParser()  # nbval reads it the same way
    parser.read(BOOK / "sanitize.cfg", encoding="utf8")
    assert parser.sections(), "book/sanitize.cfg has no section"
    for section in parser.sections():
        assert set(parser[section]) == {"regex", "replace"}, f"[{section}] needs exactly regex: and replace:"
        re.compile(parser[section]["regex"])


def test_book_config_is_offline_and_does_not_execute():
    config = yaml.safe_load((ROOT / "_config.yml").read_text("utf8"))
    assert config["execute"]["execute_notebooks"] == "off"
    assert config["only_build_toc_files"] is True
    for bib in config["bibtex_bibfiles"]:
        assert (ROOT / bib).is_file(), f"bibtex file {bib} is missing"
    extensions = config["sphinx"]["config"]["extensions"]
    assert "sphinx-mathjax-offline" in extensions, "MathJax must be served locally"
    assert "sphinx_thebe" not in extensions, "thebe loads its script from unpkg.com"
    assert not config.get("launch_buttons", {}).get("thebe")


# --------------------------------------------------------------------------------------------
# The intro's quick start runs as printed
# --------------------------------------------------------------------------------------------


def _intro_python_blocks() -> list[str]:
    text = (BOOK / "intro.md").read_text("utf8")
    return [textwrap.dedent(b) for b in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)]


def test_intro_quick_start_numpy():
    blocks = [b for b in _intro_python_blocks() if "import torch" not in b]
    assert blocks, "book/intro.md has no NumPy quick-start block"
    for block in blocks:
        exec(compile(block, "book/intro.md (NumPy quick start)", "exec"), {})


def test_intro_quick_start_torch():
    # Only look for Triton: importing it before fa_lib would stop fa_lib from selecting the CPU
    # interpreter on a machine without CUDA.
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        pytest.skip("torch and triton are needed for the PyTorch quick start")
    blocks = [b for b in _intro_python_blocks() if "import torch" in b]
    assert blocks, "book/intro.md has no PyTorch quick-start block"
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, "book/intro.md (PyTorch quick start)", "exec"), namespace)
        q, o, lse = namespace["q"], namespace["o"], namespace["lse"]
        assert q.grad is not None and o.shape == q.shape and lse.shape == q.shape[:-1]


HIDDEN_INPUT = {"remove-input", "hide-input", "hide-cell", "remove-cell"}
MAX_VISIBLE_ASSERTS = 100  # in the whole book: checks belong in hidden cells, where nbval still runs them


def test_bookkeeping_asserts_are_out_of_sight():
    """A reader sees the numbers; nbval sees the checks. Count the assert lines of code cells shown by default."""
    per_page = {}
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        cells = json.loads(path.read_text("utf8"))["cells"]
        per_page[path.name] = sum(
            line.lstrip().startswith("assert")
            for c in cells
            if c["cell_type"] == "code" and not HIDDEN_INPUT & set(c.get("metadata", {}).get("tags", []))
            for line in "".join(c["source"]).splitlines())
    total = sum(per_page.values())
    assert total <= MAX_VISIBLE_ASSERTS, (
        f"{total} visible assert lines in the book (more than {MAX_VISIBLE_ASSERTS}): move bookkeeping checks into "
        f"cells tagged remove-input; by page: {dict(sorted(per_page.items(), key=lambda kv: -kv[1])[:6])}")

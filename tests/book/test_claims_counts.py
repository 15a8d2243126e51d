"""The appendix's summary page (12_claims_checked) counts the verdicts that the three seed pages file: its
table must agree with the records those pages store (nbval checks that the stored records are what the
pages compute today)."""
import ast
import collections
import json
import pathlib
import re

BOOK = pathlib.Path(__file__).resolve().parents[2] / "book"
SEEDS = {"000": "12a_seed000", "002": "12b_seed002", "003": "12c_seed003"}
ROW = re.compile(r"^\| (\d{3})\.\d+ \| .* \| ([a-z ]+) \| [^|]*\|$")


def filed(page):
    """{verdict: count} over the records table that a seed page displays (the last one it shows)."""
    tables = []
    for cell in json.loads((BOOK / f"{page}.ipynb").read_text())["cells"]:
        for out in cell.get("outputs", []):
            md = "".join(out.get("data", {}).get("text/markdown", ""))
            rows = [m.groups() for m in map(ROW.match, md.splitlines()) if m]
            if rows:
                tables.append(rows)
    assert tables, f"{page} displays no records table"
    return collections.Counter(verdict for _, verdict in tables[-1])


def summarised():
    """{seed: {verdict: count}} as 12_claims_checked writes them, the verdict names resolved."""
    cells = json.loads((BOOK / "12_claims_checked.ipynb").read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    source = next(s for s in sources if "counts = {" in s)
    names = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) and all(
                isinstance(e, ast.Constant) for e in node.value.elts):
            names.update(zip((t.id for t in node.targets[0].elts), (e.value for e in node.value.elts)))
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "counts":
            return {seed: {names[k.id]: v.value for k, v in zip(row.keys, row.values)}
                    for seed, row in zip((k.value for k in node.value.keys), node.value.values)}
    raise AssertionError("12_claims_checked has no `counts = {...}`")


def test_the_summary_counts_what_the_seed_pages_file():
    table = summarised()
    assert sorted(table) == sorted(SEEDS)
    for seed, page in SEEDS.items():
        want = {verdict: n for verdict, n in table[seed].items() if n}
        assert dict(filed(page)) == want, (seed, dict(filed(page)), want)

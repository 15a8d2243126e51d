"""fa_lib's imports run one way: no module imports, directly or through others, a module that imports it back.

Every import counts, at module level or inside a function (a deferred import is still a dependency: the circle
only moves to run time). The layers, top to bottom: the public functions (ops, decode, interface, integrations,
context_parallel) -> checks and plans -> launch -> kernels, with fa_lib.options (the kernel options) below them all.
Benchmarks sit above all of it: nothing in fa_lib
imports them, and the optional extras (sympy, matplotlib, transformers) are not imported by `import fa_lib`.
"""
import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fa_lib"


def _module_name(path, package):
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package=PACKAGE):
    """{module: set of fa_lib modules it imports anywhere in its source}; the package itself left out as a target
    (`from . import x` names the submodule x, not the package)."""
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    root = package.name
    graph = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t not in files and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in files and t != name and t != root:
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from . import a\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_fa_lib_has_no_import_cycle():
    graph = import_graph()
    assert "fa_lib.ops" in graph and "fa_lib.kernels" in graph["fa_lib.ops"]  # the walk sees real imports
    assert cycles(graph) == [], "import circles in fa_lib: " + "; ".join(" <-> ".join(c) for c in cycles(graph))


def test_the_lower_layers_import_nothing_above_them():
    graph = import_graph()
    assert graph["fa_lib.options"] == set()  # the kernel options: read by every layer, above none
    assert graph["fa_lib.kernels"] <= {"fa_lib._interpreter"}
    assert graph["fa_lib.launch"] <= {"fa_lib.kernels", "fa_lib.options"}
    assert graph["fa_lib.reference"] == set()


def test_fa_lib_imports_no_benchmark_and_no_optional_extra():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] == "benchmarks" for n in names), f"{path.name} imports benchmarks"
    code = ("import sys, fa_lib; bad = {'sympy', 'matplotlib', 'transformers', 'benchmarks'} & set(sys.modules); "
            "assert not bad, bad; print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "ok", run.stdout + run.stderr


def test_the_lazy_submodules_are_attributes_of_fa_lib_and_load_on_first_use():
    """``fa_lib.teaching``, ``fa_lib.exercises`` (the README names them) and the other lazy submodules are found as
    attributes after a bare ``import fa_lib``, which does not import them itself."""
    lazy = ("teaching", "exercises", "context_parallel", "decode", "interface", "plan")
    code = ("import sys, fa_lib; lazy = %r; early = [n for n in lazy if 'fa_lib.' + n in sys.modules]; "
            "assert not early, early; mods = [getattr(fa_lib, n) for n in lazy]; "
            "assert [m.__name__ for m in mods] == ['fa_lib.' + n for n in lazy]; "
            "assert callable(fa_lib.exercises.check_ring_lse) and callable(fa_lib.teaching.teaching_forward); "
            "print('ok')" % (lazy,))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "ok", run.stdout + run.stderr

"""The wheel holds the library alone; chapters run from any folder of a clone.

``pip install fa_lib`` gets ``fa_lib`` and nothing else: no measurement file, no benchmark code (both stay in
the repository's ``benchmarks/``). The chapters that plot GPU measurements read them through
``benchmarks.data``, which a clone has on its path (the Makefile's venv adds the repository root). The main
test builds the wheel, unpacks it (a non-editable install: no book/, tests/ or Makefile next to the package),
and executes those chapters in an empty temporary folder with the unpacked fa_lib first on the kernel's path
and the repository's ``benchmarks`` beside it. A static check keeps every chapter from reading files
relative to the working directory or to ``fa_lib.__file__``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
from book_toc import ROOT
from nbclient import NotebookClient

BOOK = ROOT / "book"
WHEEL_LIMIT = 300 * 1024  # bytes: the library's source, compressed


def code_cells(path: Path):
    for cell in json.loads(path.read_text("utf8"))["cells"]:
        if cell["cell_type"] == "code":
            src = cell["source"]
            yield "".join(src) if isinstance(src, list) else src


# The chapters that read the measurements in benchmarks/ (each must run from an empty folder, as downloaded)
DATA_CHAPTERS = tuple(sorted(p.name for p in BOOK.glob("*.ipynb")
                             if any("benchmarks" in src for src in code_cells(p))))


@pytest.fixture(scope="module")
def installed_fa_lib(tmp_path_factory) -> Path:
    """fa_lib as a non-editable install would lay it out: built into a wheel, unpacked alone."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):  # build from a copy: no build/ left in the repository
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "fa_lib", src / "fa_lib", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(src)], check=True, cwd=out)
    wheel = next(out.glob("fa_lib-*.whl"))
    site = out / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def test_the_wheel_holds_the_library_alone(installed_fa_lib):
    wheel = next(installed_fa_lib.parent.glob("fa_lib-*.whl"))
    assert wheel.stat().st_size <= WHEEL_LIMIT, f"the wheel is {wheel.stat().st_size} bytes"
    files = [p.relative_to(installed_fa_lib) for p in installed_fa_lib.rglob("*") if p.is_file()]
    top = {p.parts[0] for p in files}
    assert {t for t in top if not t.endswith(".dist-info")} == {"fa_lib"}, top
    data = [p for p in files if p.suffix in (".json", ".bib", ".csv", ".npz")]
    assert not data, f"measurement or data files in the wheel: {data}"


@pytest.mark.parametrize("chapter", DATA_CHAPTERS)
def test_data_chapter_runs_in_an_empty_folder(chapter, installed_fa_lib, tmp_path):
    nb_path = tmp_path / chapter
    shutil.copy(BOOK / chapter, nb_path)  # the notebook alone, as a reader downloads it
    nb = nbformat.read(nb_path, as_version=4)
    # the unpacked wheel before the editable install, and the clone's benchmarks/ (its data)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(installed_fa_lib), str(ROOT)]))
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    assert sorted(p.name for p in tmp_path.iterdir()) == [chapter], "a chapter wrote files into the folder"


def test_unpacked_wheel_is_the_fa_lib_the_kernel_imports(installed_fa_lib, tmp_path):
    # The check above is only meaningful if PYTHONPATH wins over the editable install of the venv.
    env = dict(os.environ, PYTHONPATH=str(installed_fa_lib))
    out = subprocess.run([sys.executable, "-c", "import fa_lib; print(fa_lib.__file__)"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out).is_relative_to(installed_fa_lib)


# A chapter must not reach for files next to it, next to the repository, or next to fa_lib's source.
CWD_DEPENDENT = re.compile(r"""\bopen\(|\bPath\(|__file__|os\.chdir|os\.getcwd|np\.load(txt)?\(|["'](\.\./|book/|data/|tests/)""")


@pytest.mark.parametrize("path", sorted(BOOK.glob("[0-9]*.ipynb")), ids=lambda p: p.name)
def test_chapter_reads_no_files_relative_to_where_it_runs(path):
    hits = [line.strip() for src in code_cells(path) for line in src.splitlines() if CWD_DEPENDENT.search(line)]
    assert not hits, f"{path.name} reads files by a path (use benchmarks.data for the measurements): {hits}"


def test_chapter_10_names_real_gpu_tests():
    # Chapter 10 names the GPU tests and `make gpu-test`; they live in the repository, not in the package,
    # so the chapter cannot check them wherever it runs. This test does.
    prose = "".join("".join(c["source"]) for c in json.loads((BOOK / "10_triton_backward.ipynb").read_text("utf8"))
                    ["cells"] if c["cell_type"] == "markdown")
    named = set(re.findall(r"`(test_\w+_gpu)`", prose))
    gpu_tests = (ROOT / "tests" / "library" / "test_kernels_gpu.py").read_text("utf8")
    defined = set(re.findall(r"^def (test_\w+)\(", gpu_tests, re.M))
    assert named and named <= defined, f"chapter 10 names GPU tests that do not exist: {sorted(named - defined)}"
    assert "FA_LIB_GPU_REPORT" in prose and "FA_LIB_GPU_REPORT" in gpu_tests
    makefile = (ROOT / "Makefile").read_text("utf8")
    target = makefile.split("\ngpu-test:", 1)[1].split("\n\n", 1)[0]
    assert "make gpu-test" in prose and "pytest tests/library -m gpu" in target

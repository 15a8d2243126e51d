"""Compatibility matrix for fa_lib's kernel and reference tests (``make test-compat``).

Each session makes a fresh virtual environment, installs *this checkout* with a plain, non-editable
``pip install .`` together with one set of pinned versions, and runs ``tests/library/test_kernels.py`` and
``tests/library/test_reference.py`` (the Triton kernels under the CPU interpreter, the NumPy reference;
``compat-newest`` also ``tests/library/test_ops.py``, the torch integration).
Installing ``.`` in the same pip call as the pins makes pip check them against the ranges that
pyproject.toml declares: a pin outside a declared range fails the install, not just the tests.

* ``compat-oldest``: the lower bounds, Triton 3.6.0 (the GPU machine's) with NumPy 2.0.0.
* ``compat-pinned``: requirements.txt's Triton 3.6.0 with NumPy 2.3.5, the newest NumPy that the
  Triton 3.6 interpreter works with (NumPy 2.4 breaks it: triton issue 9171, fixed in Triton 3.7).
  Not in the default run (``make test-unit`` already tests these pins, from the source tree; CI's
  20-minute budget); run it with ``nox -s compat-pinned``.
* ``compat-newest``: the upper bounds, the newest Triton on the registry (3.9.0) with the newest
  NumPy (2.4.6).

torch is 2.13.0 in every session: it is the newest CPU build this machine and CI can install
without several GB of CUDA wheels (``torch==2.13.0`` resolves to the local ``2.13.0+cpu`` wheel).

The tests run from a copy of the test files in the session's tmp folder, so ``import fa_lib`` finds
the installed package and never the source tree (pyproject's ``pythonpath = ["."]`` would put the
repository root first); each session prints and checks ``fa_lib.__file__`` before testing.

    .venv/bin/nox                      # compat-oldest and compat-newest (what ``make test-compat`` runs)
    .venv/bin/nox -s compat-newest -- -x -k reference   # extra arguments go to pytest
"""
import pathlib
import re
import shutil

import nox

ROOT = pathlib.Path(__file__).resolve().parent

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["compat-oldest", "compat-newest"]
nox.options.reuse_venv = "no"  # always a fresh environment: the point is a clean resolve

# The newest CPU build of torch this machine and CI can install without GBs of CUDA wheels.
TORCH = "torch==2.13.0"

MATRIX = {
    "oldest": ["triton==3.6.0", "numpy==2.0.0"],
    "pinned": ["triton==3.6.0", "numpy==2.3.5"],
    "newest": ["triton==3.9.0", "numpy==2.4.6"],
}

TEST_FILES = ["library/test_kernels.py", "library/test_reference.py", "kernel_cases.py", "conftest.py", "sm90.py"]
# With the newest releases also the torch integration (torch.compile, autograd, the interpreter switch):
# `make test-unit` runs it against requirements.txt's Triton 3.6.0, nothing else against Triton 3.9.
NEWEST_EXTRA_TESTS = ["library/test_ops.py"]

CHECK_INSTALLED = """
import importlib.metadata as md, os, sys
import fa_lib
where = os.path.realpath(fa_lib.__file__)
print("fa_lib from", where)
assert where.startswith(os.path.realpath(sys.prefix) + os.sep), "fa_lib is not the installed copy"
assert "sympy" not in sys.modules, "import fa_lib must not import sympy"
fa_lib.flash_attention  # the torch/Triton half imports
print(", ".join(f"{p} {md.version(p)}" for p in ("torch", "triton", "numpy")))
"""


def _requirement(name):
    """The exact pin of ``name`` in requirements.txt, so the test tools match ``make test-unit``."""
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if re.match(rf"{re.escape(name)}\s*==", line):
            return line.split("#")[0].strip()
    raise ValueError(f"{name} is not pinned in requirements.txt")


def _compat(session, pins, extra_tests=()):
    # setuptools builds in ./build and never prunes it: a module deleted from fa_lib/ would still ship.
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    # --no-compile: byte-compiling all of torch and Triton at install time took 63 of pip's 95 s here;
    # the tests compile only what they import.
    session.install("--no-compile", ".", TORCH, *pins, _requirement("pytest"), _requirement("hypothesis"),
                    _requirement("pytest-xdist"), _requirement("execnet"))
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    work = pathlib.Path(session.create_tmp())
    tests = work / "tests"
    shutil.rmtree(tests, ignore_errors=True)
    tests.mkdir()
    for name in (*TEST_FILES, *extra_tests):
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "tests" / name, tests / name)
    shutil.copy2(ROOT / "pyproject.toml", work / "pyproject.toml")  # pytest's settings (markers, warnings)
    session.chdir(work)
    session.run("python", "-c", CHECK_INSTALLED)
    # Two workers, as in `make test-unit` (CI has 2 cores).
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "tests", *session.posargs)


@nox.session(name="compat-oldest")
def compat_oldest(session):
    """Triton 3.6.0 and NumPy 2.0.0 (the lower bounds in pyproject.toml), torch 2.13.0 (CPU)."""
    _compat(session, MATRIX["oldest"])


@nox.session(name="compat-pinned")
def compat_pinned(session):
    """Triton 3.6.0 (the GPU machine's), NumPy 2.3.5, torch 2.13.0 (CPU)."""
    _compat(session, MATRIX["pinned"])


@nox.session(name="compat-newest")
def compat_newest(session):
    """Triton 3.9.0 and NumPy 2.4.6 (the newest on the registry), torch 2.13.0 (CPU)."""
    _compat(session, MATRIX["newest"], NEWEST_EXTRA_TESTS)

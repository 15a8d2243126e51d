"""Shared by every test: the helpers' folder on the path, and the order the suite runs in.

The tests are grouped by what they test: ``library/`` (fa_lib), ``book/`` (the chapters, the built pages, the
README) and ``benchmarks/`` (the benchmark and probe code, and the measurements the book reads). The helpers
they share (``kernel_cases``, ``sm90``, ``book_toc``, ``cp_worker``) sit here, beside this file.

``FA_LIB_TEST_ORDER`` runs the collected tests in another order: ``reverse``, or ``random:<seed>``. The suite
must pass in any order (a test that leaves state behind for the next one in the same process is a defect);
``make test`` runs the unit tests once in file order and once reversed.
"""
import os
import random
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def pytest_collection_modifyitems(config, items):
    order = os.environ.get("FA_LIB_TEST_ORDER", "")
    if order == "reverse":
        items.reverse()
    elif order.startswith("random:") and order[7:].isdigit():
        random.Random(int(order[7:])).shuffle(items)
    elif order:
        raise pytest.UsageError(f"FA_LIB_TEST_ORDER must be 'reverse' or 'random:<seed>', got {order!r}")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository's root folder."""
    return TESTS.parent


@pytest.fixture
def kernel_opts():
    """``options(hopper_forward="always", ...)`` sets fa_lib's kernel options (`fa_lib.kernel_options`) for the rest
    of the test; they are put back when it ends."""
    import contextlib

    import fa_lib

    with contextlib.ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(fa_lib.kernel_options(**overrides))

"""benchmarks/probes/probe_paged_prefill.py on a machine without a GPU: its points, pools and bit checks at tiny sizes under the
interpreter (a stand-in timer), so that a run on the H200 measures what it says."""
import sys

import pytest
import torch

from book_toc import ROOT
from fa_lib import kernels

from benchmarks.probes import probe_paged_prefill


@pytest.mark.skipif(not kernels.INTERPRET, reason="the tiny shapes are for the interpreter")
def test_the_probe_checks_the_bits_and_counts_the_work():
    calls = []

    def timer(fn):
        calls.append(fn())
        return 2.0

    rows = probe_paged_prefill.measure([(2, 5, 20), (1, 3, 7)], [4, 16], timer, heads=(4, 2), d=16,
                                       dtype=torch.float16, device="cpu")
    assert len(rows) == 2 and len(calls) == 6
    for r in rows:
        assert set(r["ms"]) == {"unpaged", "paged4", "paged16"} and r["same_bits"] == {4: True, 16: True}
    # 2 sequences x 4 heads; new query i of 5 over 20 keys sees 16 + i keys: 16 + 17 + 18 + 19 + 20 = 90
    assert rows[0]["tflops"]["unpaged"] == pytest.approx(4 * 16 * 2 * 4 * 90 / 2e-3 / 1e12)

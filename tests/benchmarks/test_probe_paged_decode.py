"""benchmarks/probes/probe_paged_decode.py on a machine without a GPU: its variants, pools and bit checks at tiny sizes under the
interpreter (a stand-in timer), so that a run on the H200 measures what it says."""
import sys

import pytest
import torch

from book_toc import ROOT
from fa_lib import decode, kernels

from benchmarks.probes import probe_paged_decode


@pytest.mark.skipif(not kernels.INTERPRET, reason="the tiny shapes are for the interpreter")
def test_the_probe_times_every_variant_and_checks_the_bits(monkeypatch):
    monkeypatch.setattr(probe_paged_decode, "CONFIGS", ((32, 4, 2),))
    seen = []

    def graph_ms(fn):
        seen.append(decode._config(16, 4))  # the blocks the timed calls are planned with
        fn()
        return 2.0

    rows = probe_paged_decode.measure([(2, 40, 1)], [8, 16], 1, heads=(4, 1), d=16, layers_max=2,
                                      dtype=torch.float16, device="cpu", graph_ms=graph_ms, copy=1.0, sms=4)
    (row,) = rows
    assert set(row["us"]) == {"unpaged", "paged8", "paged8_inorder", "paged16", "paged16_inorder",
                              "paged8_cfg32-4-2", "unpaged_cfg32-4-2"}
    assert all(row["same_bits"].values()) and len(row["same_bits"]) == 4
    assert row["layers"] == 2 and row["us"]["unpaged"] == pytest.approx(1e3)  # 2 ms for a graph of two calls
    # K and V of 2 sequences, 1 cache head, 40 keys, d = 16, fp16, plus q read and o written
    assert row["bytes"] == 2 * 2 * 40 * 16 * 2 + 2 * 2 * 4 * 16 * 2
    assert row["fraction"]["unpaged"] == pytest.approx(row["bytes"] / 1e-3 / 1e12)
    assert sum(cfg[1:] == (32, 4, 2) for cfg in seen) == 2 and decode._config(16, 4)[1:] != (32, 4, 2)

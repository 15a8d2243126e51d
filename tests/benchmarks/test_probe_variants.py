"""benchmarks/probes/probe_variants.py edits kernels.py's source as text: every variant must still apply to today's
kernels (a changed anchor raises, naming it) and give valid Python; an unknown name is refused."""
import ast
import sys

import pytest
from book_toc import ROOT

from benchmarks.probes import probe_variants

VARIANTS = ["spec", "dkdv_nospec", "dq_threeloops", "dq_oneloop", "dq_nounmasked", "dkdv_oneloop",
            "dkdv_threeloops", "dkdv_hole_all", "fwd_oneloop"]


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_applies_to_todays_kernels(name):
    src = probe_variants.edits(name)
    assert src != probe_variants.SRC
    ast.parse(src)


def test_the_undo_variants_restore_the_earlier_forms():
    three = probe_variants.edits("dq_threeloops")
    assert three.count("_attn_bwd_dq_inner(dq,") == probe_variants.SRC.count("_attn_bwd_dq_inner(dq,") + 1
    one = probe_variants.edits("dq_oneloop")
    assert one.count("_attn_bwd_dq_inner(dq,") == probe_variants.SRC.count("_attn_bwd_dq_inner(dq,") - 1
    three = probe_variants.edits("dkdv_threeloops")  # the holed branch compiled out, the dense one always
    assert "        if False:\n" in three and "        if True:\n" in three and "if LOCAL or VARLEN:" not in three
    one = probe_variants.edits("dkdv_oneloop")
    assert "ATOMIC_DQ, True)" not in one  # no holed loop left: one masked loop over the band
    assert "m_full if (LOCAL or VARLEN) else m_lfull" in one  # and no unmasked middle under a window
    assert "m_lo, m_hi, 0, 0," in one
    assert ", True)\n" not in probe_variants.edits("dq_oneloop").split("def _attn_bwd_dq(")[1]
    nospec = probe_variants.edits("dkdv_nospec")
    assert probe_variants.SPEC + "\ndef _attn_bwd_dkdv(" in nospec
    assert probe_variants.edits("base@dq=128,64,8,3") == probe_variants.SRC


def test_unknown_variant_and_stale_anchor_are_named(monkeypatch):
    with pytest.raises(ValueError, match="unknown variant 'bogus'"):
        probe_variants.edits("bogus")
    monkeypatch.setattr(probe_variants, "SRC", "nothing here")
    with pytest.raises(ValueError, match="no longer holds"):
        probe_variants.edits("dq_threeloops")

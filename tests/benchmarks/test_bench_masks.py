"""The masks benchmark (``python -m benchmarks.bench --masks``, issue 13) on CPU.

The helpers (pair counting, document masks from ``cu_seqlens``, the points, the PyTorch reference, the
JSON layout) are checked against ``fa_lib.reference`` with no kernel; FlexAttention (eager, forward
only on CPU) and SDPA run through the same pipeline as on the GPU; the whole ``--masks --smoke`` run,
fa_lib included, runs under the Triton interpreter once ``fa_lib.flash_attention_varlen`` exists.
"""
import json
import math

import numpy as np
import pytest
import torch

import fa_lib
from benchmarks import bench
from fa_lib import reference

WINDOW_CASES = [  # (nq, nk, window, causal)
    (1, 1, (-1, -1), True), (17, 17, (-1, -1), True), (17, 17, (4, 0), True), (17, 17, (4, -1), True),
    (17, 17, (0, 0), False), (17, 17, (3, 5), False), (17, 17, (-1, 2), False), (5, 13, (2, -1), True),
    (13, 5, (-1, -1), True), (13, 5, (1, 1), False), (40, 40, (100, 0), True), (40, 40, (-1, -1), False),
]


@pytest.mark.parametrize("nq, nk, window, causal", WINDOW_CASES)
def test_window_pairs_counts_the_reference_mask(nq, nk, window, causal):
    vis = reference.window_visible(nq, nk, window, causal)
    assert bench.window_pairs(nq, nk, window, causal) == int(vis.sum())
    for valid in (0, 1, nk // 2, nk, nk + 3):  # a key padding mask's valid prefix
        assert bench.window_pairs(nq, nk, window, causal, nk_valid=valid) == int(vis[:, :valid].sum())


def test_window_pairs_at_benchmark_sizes():
    n, w = 16384, 1024
    assert bench.window_pairs(n, n, (-1, -1), True) == n * (n + 1) // 2
    assert bench.window_pairs(n, n, (w, 0), True) == sum(min(i, w) + 1 for i in range(n))
    assert bench.window_pairs(n, n, (-1, -1), False, nk_valid=1000) == n * 1000


def test_document_lengths_are_ragged_deterministic_and_sum_to_n():
    for n in (64, 4096, 16384):
        lens = bench.document_lengths(n, seed=3)
        assert sum(lens) == n and min(lens) >= 1
        assert lens == bench.document_lengths(n, seed=3)
    lens = [x for s in range(8) for x in bench.document_lengths(4096, seed=s)]
    assert min(lens) < 256 and max(lens) > 1024  # short and long documents


def test_packed_documents_give_valid_cu_seqlens_and_whole_packs():
    lens, cu = bench.packed_documents(4, 256, seed=1)
    reference.check_cu_seqlens("cu_seqlens", np.array(cu, dtype=np.int32), 4 * 256)
    assert cu[0] == 0 and cu[-1] == 1024 and np.all(np.diff(cu) == lens)
    assert {256, 512, 768} <= set(cu)  # every pack ends at a document boundary


def _document_mask_by_loops(cu, n, causal, window):
    total = cu[-1]
    full = np.zeros((total, total), dtype=bool)
    for a, b in zip(cu[:-1], cu[1:]):
        full[a:b, a:b] = reference.window_visible(b - a, b - a, window, causal)
    return np.stack([full[p:p + n, p:p + n] for p in range(0, total, n)])


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (True, (5, 0)), (False, (-1, -1)), (False, (3, 2))])
def test_document_mask_from_cu_seqlens(causal, window):
    lens, cu = bench.packed_documents(3, 48, seed=2, min_len=4)
    mask = bench.document_mask(cu, 48, causal, window)
    assert mask.shape == (3, 48, 48) and mask.dtype == torch.bool
    np.testing.assert_array_equal(mask.numpy(), _document_mask_by_loops(cu, 48, causal, window))
    assert int(mask.sum()) == sum(bench.window_pairs(x, x, window, causal) for x in lens)
    ids = bench.document_ids(cu)
    assert ids.tolist() == [d for d, x in enumerate(lens) for _ in range(x)]


def test_document_mask_handles_empty_documents_and_refuses_crossing_packs():
    cu = [0, 0, 3, 3, 8, 8]  # zero-length documents, one pack of 8
    mask = bench.document_mask(cu, 8)
    np.testing.assert_array_equal(mask[0].numpy(), _document_mask_by_loops(cu, 8, True, (-1, -1))[0])
    with pytest.raises(ValueError, match="crosses a pack boundary"):
        bench.document_mask([0, 5, 8], 4)
    with pytest.raises(ValueError, match="multiple"):
        bench.document_mask([0, 5, 7], 4)


def test_mask_points_default_grid():
    pts = bench.mask_points()
    labels = {(p["label"], p["n"]) for p in pts}
    for n in (4096, 8192, 16384):
        for label in ("varlen", "window1024", "softcap50", "padding"):
            assert (label, n) in labels
    assert ("window4096", 4096) not in labels  # as wide as the sequence: plain causal
    assert {("window4096", 8192), ("window4096", 16384), ("varlen-gqa32/8", 8192)} <= labels
    for p in pts:
        assert p["b"] * p["n"] == bench.TOKENS and p["d"] == 128 and p["dtype"] == "bf16"
        assert (p["hq"], p["hkv"]) == ((32, 8) if "gqa" in p["label"] else (16, 16))
        assert 0 < p["density"] <= 1
        if p["mask"] == "varlen":
            assert p["cu_seqlens"][-1] == bench.TOKENS and p["max_seqlen"] == max(p["doc_lens"])
        if p["mask"] == "padding":
            assert len(p["valid_lens"]) == p["b"] and all(0 < x < p["n"] for x in p["valid_lens"])
    json.dumps(pts)  # every point is plain JSON


def test_visible_pairs_equal_the_dense_masks():
    for p in bench.mask_points([32, 64], windows=[8, 40], tokens=128, h=2, d=16, gqa=(4, 2), softcap=1.0):
        mask = bench.dense_mask(p).expand(p["b"], 1, p["n"], p["n"])
        assert int(mask.sum()) == p["visible_pairs"], p["label"]
        assert bench.mask_flops(p, "fwd") == 4 * p["hq"] * p["d"] * p["visible_pairs"]
        assert bench.mask_flops(p, "bwd") == int(2.5 * bench.mask_flops(p, "fwd"))


def _inputs(b, hq, hkv, n, d, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=gen, dtype=dtype) for h in (hq, hkv, hkv, hq)]


@pytest.mark.parametrize("softcap", [0.0, 0.7])
def test_masked_reference_matches_the_numpy_reference(softcap):
    q, k, v, do = _inputs(2, 4, 2, 23, 8, seed=1)
    vis = torch.from_numpy(reference.window_visible(23, 23, (5, 0), True))
    vis = vis & (torch.arange(23) != 7)  # and a hole, for a general mask
    vis[3] = False  # a row that sees no key
    out = bench.masked_reference(q, k, v, do, vis, softcap=softcap)
    kk, vv = k.repeat_interleave(2, 1).numpy(), v.repeat_interleave(2, 1).numpy()
    o, _ = reference.naive_attention(q.numpy(), kk, vv, mask=vis.numpy(), softcap=softcap)
    dq, dk, dv = reference.naive_attention_backward(q.numpy(), kk, vv, do.numpy(), mask=vis.numpy(), softcap=softcap)
    np.testing.assert_allclose(out["o"].numpy(), o, atol=1e-12)
    np.testing.assert_allclose(out["dq"].numpy(), dq, atol=1e-12)
    np.testing.assert_allclose(out["dk"].numpy(), dk.reshape(2, 2, 2, 23, 8).sum(2), atol=1e-12)
    np.testing.assert_allclose(out["dv"].numpy(), dv.reshape(2, 2, 2, 23, 8).sum(2), atol=1e-12)
    assert not out["o"][:, :, 3].any()


def test_document_mask_reference_matches_varlen_reference():
    """The benchmark's varlen oracle (dense packs + document mask) is fa_lib.reference.varlen_attention."""
    b, n, hq, hkv, d = 2, 40, 4, 2, 8
    lens, cu = bench.packed_documents(b, n, seed=5, min_len=3)
    q, k, v, do = _inputs(b, hq, hkv, n, d, seed=2)
    vis = bench.document_mask(cu, n, True, (6, 0))[:, None]
    out = bench.masked_reference(q, k, v, do, vis, softcap=0.5)
    packed = [x.transpose(1, 2).reshape(b * n, x.shape[1], d).numpy() for x in (q, k, v, do)]
    cu32 = np.array(cu, dtype=np.int32)
    o, _, dq, dk, dv = reference.varlen_attention(*packed[:3], cu32, cu32, causal=True, window=(6, 0), softcap=0.5,
                                                  do=packed[3])
    for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        got = out[name].transpose(1, 2).reshape(b * n, -1, d).numpy()
        np.testing.assert_allclose(got, x, atol=1e-10, err_msg=name)


def _small_points():
    return bench.mask_points([32], windows=[4, 12], tokens=64, h=2, d=16, gqa=(4, 2), softcap=1.0, dtype="fp32")


@pytest.mark.parametrize("provider", ["flex", "sdpa"])
def test_flex_and_sdpa_providers_express_each_mask(provider):
    """FlexAttention's mask_mod/score_mod and SDPA's boolean masks agree with the reference on every
    kind of point (forward, CPU; FlexAttention has no CPU backward)."""
    for p in _small_points():
        b, n = p["b"], p["n"]
        gen = torch.Generator().manual_seed(0)
        base = [torch.randn(b * n, h, p["d"], generator=gen) for h in (p["hq"], p["hkv"], p["hkv"])]
        try:
            layout, make = bench.mask_provider(provider, p, "cpu", compiled=False)
        except bench._Skip as e:
            assert provider == "sdpa" and p["softcap"] and str(e).startswith("n/a")
            continue
        q, k, v = (bench._to_layout(x, layout, b, n).contiguous() for x in base)
        with torch.no_grad():
            o = bench._from_layout(make(q, k, v)(), layout, b, n)
        qd, kd, vd = (bench._to_layout(x, "bhnd", b, n).double() for x in base)
        gold = bench.masked_reference(qd, kd, vd, torch.zeros_like(qd), bench.dense_mask(p), softcap=p["softcap"])
        torch.testing.assert_close(o.double(), gold["o"], atol=2e-5, rtol=0, msg=p["label"])


def test_layouts_round_trip():
    x = torch.randn(3 * 5, 4, 2)
    for layout in ("packed", "bhnd", "flex_packed"):
        y = bench._to_layout(x, layout, 3, 5)
        torch.testing.assert_close(bench._from_layout(y.contiguous(), layout, 3, 5),
                                   x.view(3, 5, 4, 2).transpose(1, 2))


def test_target_and_summary():
    p = dict(mask="window", label="window1024", n=4096)
    assert bench.mask_target(p, {"fwd": 1.2, "bwd": 1.0}) == {"applies": True, "met": True}
    assert bench.mask_target(p, {"fwd": 1.2, "bwd": 0.9}) == {"applies": True, "met": False}
    assert bench.mask_target(p, {"fwd": None, "bwd": 1.1}) == {"applies": True, "met": None}
    assert bench.mask_target({**p, "n": 2048}, {"fwd": 0.5, "bwd": 0.5})["applies"] is False
    assert bench.mask_target({**p, "mask": "padding"}, {"fwd": 0.5, "bwd": 0.5})["applies"] is False
    pts = [dict(label="a", n=4096, target={"applies": True, "met": True}, ratio={"fwd": 1.1, "bwd": 1.2},
                check={"ok": True}),
           dict(label="b", n=8192, target={"applies": True, "met": False}, ratio={"fwd": 0.9, "bwd": None}),
           dict(label="c", n=8192, target={"applies": False, "met": None}, ratio={"fwd": 0.5, "bwd": 0.5})]
    s = bench.mask_summary(pts)
    assert s["target_points"] == 2 and s["target_met"] == 1 and s["target_all_met"] is False
    assert s["target_missed"] == ["b N=8192 fwd 0.90 bwd -"] and (s["checks"], s["checks_ok"]) == (1, 1)


def _check_json(path, providers, with_fa_lib):
    data = json.loads(path.read_text())
    assert data["part"] == "masks-smoke" and data["smoke"] is True and data["environment"]["device"]
    assert data["target"]["kinds"] == ["varlen", "window", "softcap"] and data["target"]["min_n"] == 4096
    labels = [p["label"] for p in data["points"]]
    assert labels == ["varlen", "window4", "window12", "softcap1", "padding", "varlen-gqa4/2"]
    for p in data["points"]:
        rows = {r["provider"]: r for r in p["rows"]}
        assert list(rows) == providers
        assert p["target"] == {"applies": False, "met": None}  # N < 4096
        for prov, r in rows.items():
            assert "error" not in r, (p["label"], prov, r)
            if prov == "sdpa" and p["mask"] == "softcap":
                assert r["skipped"].startswith("n/a")
                continue
            assert r["fwd_ms"] > 0 and r["fwd_tflops"] > 0
            assert (r["bwd_ms"] > 0) if prov != "flex" else r["bwd_error"].startswith("n/a")
        if with_fa_lib:
            c = p["check"]
            assert c["ok"] is True, c
            assert set(c["max_abs_err"]) == {"torch_same_dtype", "fa_lib", "flex"}
            assert set(c["max_abs_err"]["fa_lib"]) == {"o", "dq", "dk", "dv"}
            assert c["max_abs_err"]["flex"]["o"] < 1e-4 and c["max_abs_diff_fa_lib_flex"]["o"] < 1e-4
            assert math.isfinite(p["ratio"]["fwd"]) and p["ratio"]["bwd"] is None  # no CPU flex backward
        else:
            assert "check" not in p and p["ratio"] == {"fwd": None, "bwd": None, "fwd_bwd": None}
    assert data["summary"]["target_points"] == 0 and data["wall_s"] > 0


def test_smoke_pipeline_without_fa_lib(tmp_path, capsys):
    """FlexAttention and SDPA through the whole --masks pipeline (JSON, table), no kernel needed."""
    bench.main(["--masks", "--smoke", "--masks-dtype", "fp32", "--masks-providers", "flex", "sdpa",
                "--out-dir", str(tmp_path)])
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and files[0].name.startswith("masks-smoke-")  # never the measurements' name
    _check_json(files[0], ["flex", "sdpa"], with_fa_lib=False)
    out = capsys.readouterr().out
    assert "fa/flex" in out and "varlen-gqa4/2" in out and "wrote" in out


def _has_fa_lib_masks():
    try:
        return hasattr(fa_lib, "flash_attention_varlen")
    except Exception:
        return False


def test_smoke_pipeline_with_fa_lib(tmp_path):
    """The whole --masks run on tiny shapes, fa_lib under the Triton interpreter, checked by the flash-attn
    rule against the float64 reference on every mask."""
    if not _has_fa_lib_masks():
        pytest.skip("fa_lib.flash_attention_varlen does not exist yet (issue 13's kernel API)")
    bench.main(["--masks", "--smoke", "--masks-dtype", "fp32", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("*.json")
    _check_json(path, ["fa_lib", "flex", "sdpa"], with_fa_lib=True)

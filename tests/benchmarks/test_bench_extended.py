"""The extended sweep's points and FLOP count (`python -m benchmarks.bench --extended`), checked on CPU."""
import argparse
import collections
import os
import subprocess

import pytest

import benchmarks.data
from benchmarks import bench


def test_extended_points_cover_the_sweep():
    pts = list(bench.extended_points())
    kinds = collections.Counter(p["kind"] for p in pts)
    # 4 head dims x 2 dtypes x 2 masks x (6 lengths for square and GQA, one prefill, one small batch)
    assert kinds == {"square": 96, "gqa": 96, "prefill": 16, "small": 16}
    assert {p["d"] for p in pts} == {64, 96, 128, 256} and {p["dtype"] for p in pts} == {"bf16", "fp16"}
    assert all(p["hq"] == 4 * p["hkv"] for p in pts if p["kind"] == "gqa")
    assert all(p["hq"] % 4 == 0 for p in pts)
    assert {(p["nq"], p["nk"]) for p in pts if p["kind"] == "prefill"} == {(512, 8192)}
    assert {(p["b"], p["nq"]) for p in pts if p["kind"] == "small"} == {(64, 256)}
    assert len({bench.ext_key(p) for p in pts}) == len(pts)  # --ext-resume tells every point apart


def test_bottom_right_causal_pairs():
    # query i of Nq sees keys 0 .. i + Nk - Nq: a prefill of 512 queries against 8192 keys
    assert bench.visible_pairs_causal(512, 8192, True) == 512 * (8192 - 512) + 512 * 513 // 2
    assert bench.visible_pairs_causal(4, 4, True) == 10 and bench.visible_pairs_causal(4, 4, False) == 16
    assert bench.visible_pairs_causal(8, 2, True) == 3  # more queries than keys: the first six see none
    p = dict(b=2, hq=16, d=128, nq=512, nk=8192, causal=True)
    assert bench.ext_flops(p, "bwd") == int(2.5 * bench.ext_flops(p, "fwd"))
    with pytest.raises(ValueError, match='mode must be "fwd" or "bwd"'):
        bench.ext_flops(p, "fwd_bwd")


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown kind 'decode'"):
        list(bench.extended_points(kinds=("decode",)))



def test_the_sweep_as_it_stands_puts_each_part_in_place():
    first = benchmarks.data.load_json("extended-nvidia-h200.json")
    now = bench.extended_sweep()
    assert [bench.ext_key(p) for p in now["points"]] == [bench.ext_key(p) for p in first["points"]]
    latest = {}  # key -> (file, point) of the last part that measured it
    for name in bench.EXT_PARTS:
        for p in benchmarks.data.load_json(name)["points"]:
            latest[bench.ext_key(p)] = (name, p)
    for old, new in zip(first["points"], now["points"]):
        key = bench.ext_key(old)
        if key in latest:  # the last part's point, marked, with its own rows
            name, p = latest[key]
            assert new == dict(p, part=name)
        else:  # every other point untouched
            assert new == old
    assert len(latest) == 216 and now["parts"] == list(bench.EXT_PARTS)
    assert [sum(name == n for name, _ in latest.values()) for n in bench.EXT_PARTS] == [0, 40, 8, 8, 0, 0, 32, 0, 0, 48, 0, 32, 0, 48]
    assert bench.extended_sweep(parts=())["points"] == first["points"]


def test_a_part_with_a_point_the_sweep_lacks_is_refused(monkeypatch):
    real = benchmarks.data.load_json

    def load(name):
        if name == "fake-part.json":
            return {"points": [dict(kind="square", dtype="bf16", d=80, causal=False, b=16, hq=24, hkv=24,
                                    nq=1024, nk=1024)]}
        return real(name)

    monkeypatch.setattr(benchmarks.data, "load_json", load)
    with pytest.raises(ValueError, match="fake-part.json: point .* is not in extended-nvidia-h200.json"):
        bench.extended_sweep(parts=("fake-part.json",))


@pytest.mark.parametrize("parts", ["extended-d96-nvidia-h200.json", [1], None])
def test_parts_must_be_file_names(parts):
    with pytest.raises(TypeError, match="parts must be a sequence of data file names"):
        bench.extended_sweep(parts=parts)


def test_decode_subset_flags():
    # no --dec-* flag: the whole decoding benchmark (84 points); a subset's flags: its nine points
    none = argparse.Namespace(dec_batches=None, dec_hkv=None, dec_nk=None)
    assert bench._decode_subset(none) == {} and len(list(bench.decode_points())) == 84
    subset = argparse.Namespace(dec_batches=[1], dec_hkv=[8], dec_nk=[16384, 65536, 131072])
    pts = list(bench.decode_points(**bench._decode_subset(subset)))
    assert len(pts) == 9 and {(p["b"], p["hq"], p["hkv"]) for p in pts} == {(1, 32, 8)}
    assert bench._decode_subset(argparse.Namespace()) == {}  # a Namespace without the flags


def test_decode_fn_with_a_workspace(monkeypatch):
    """--dec-workspace: fa_lib's timed call passes a workspace of its own, gives the same bits, and leaves it zero."""
    import torch

    import fa_lib.decode

    made, passed = [], []
    real_workspace, real_call = fa_lib.decode.workspace, fa_lib.flash_attention_with_kvcache
    monkeypatch.setattr(fa_lib.decode, "workspace", lambda q: made.append(real_workspace(q)) or made[-1])
    monkeypatch.setattr(fa_lib, "flash_attention_with_kvcache",
                        lambda *a, **kw: passed.append(kw["workspace"]) or real_call(*a, **kw))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 16, generator=gen).to(torch.float16)
    kc, vc = (torch.randn(1, 2, 64, 16, generator=gen).to(torch.float16) for _ in "kv")
    lens = torch.tensor([50], dtype=torch.int32)
    plain = bench._decode_fn("fa_lib", q, kc, vc, lens)
    with_ws = bench._decode_fn("fa_lib", q, kc, vc, lens, workspace=True)
    with torch.no_grad():
        assert torch.equal(plain(), with_ws()) and torch.equal(with_ws(), plain())
    assert len(made) == 1 and passed == [None, made[0], made[0], None]
    assert made[0].shape == (4,) and made[0].dtype == torch.int32 and not made[0].any()


def test_decode_fn_over_a_paged_copy_gives_the_same_bits():
    """--dec-page-sizes P: the provider fa_lib_pagedP reads a shuffled paged copy of the cache through a block
    table, and answers with the contiguous call's bits."""
    import torch

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 1, 16, generator=gen).to(torch.float16)
    kc, vc = (torch.randn(2, 2, 70, 16, generator=gen).to(torch.float16) for _ in "kv")
    lens = torch.tensor([70, 33], dtype=torch.int32)
    with torch.no_grad():
        want = bench._decode_fn("fa_lib", q, kc, vc, lens)()
        for page in (16, 24):
            assert torch.equal(bench._decode_fn(f"{bench.PAGED_PROVIDER}{page}", q, kc, vc, lens, workspace=True)(),
                               want)


@pytest.mark.parametrize("flags", [["--dec-workspace"], ["--dec-batches", "1"], ["--dec-no-ragged", "--extended"],
                                   ["--dec-page-sizes", "16"]])
def test_decode_flags_without_decode_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        bench.main(flags)
    err = capsys.readouterr().err
    assert "add --decode" in err and flags[0] in err


def _piece(dtype, commit="abc", device="NVIDIA H200"):
    points = [dict(p, rows=[]) for p in bench.extended_points(dtypes=(dtype,))]
    return {"part": "extended", "environment": {"commit": commit, "device": device}, "ceilings": {"copy_TBps": 4.0},
            "points": points[::-1]}


def test_pieces_of_one_commit_join_into_the_sweep_in_order():
    joined = bench.join_sweeps([_piece("fp16"), _piece("bf16")])
    assert [bench.ext_key(p) for p in joined["points"]] == [bench.ext_key(p) for p in bench.extended_points()]
    assert len(joined["points"]) == 224 and [c["points"] for c in joined["calls"]] == [112, 112]


@pytest.mark.parametrize("pieces, match", [
    (lambda: [_piece("bf16"), _piece("fp16", commit="def")], "share one commit"),
    (lambda: [_piece("bf16"), _piece("fp16", device="NVIDIA H100 80GB HBM3")], "share one device"),
    (lambda: [_piece("bf16", commit=None)], "share one commit"),
    (lambda: [_piece("bf16"), _piece("bf16")], "appears in more than one piece"),
    (lambda: [], "at least one piece")])
def test_pieces_that_are_not_one_sweep_are_refused(pieces, match):
    with pytest.raises(ValueError, match=match):
        bench.join_sweeps(pieces())


def test_join_from_the_command_line(tmp_path):
    import json

    names = []
    for dtype in ("bf16", "fp16"):
        names.append(str(tmp_path / f"{dtype}.json"))
        with open(names[-1], "w") as f:
            json.dump(_piece(dtype), f)
    bench.main(["--ext-join", *names, "--out-dir", str(tmp_path / "out")])
    with open(tmp_path / "out" / "extended-nvidia-h200.json") as f:
        assert len(json.load(f)["points"]) == 224


@pytest.mark.parametrize("env, stage, message", [
    ({}, "bf16", "set FA_LIB_COMMIT"),
    ({"FA_LIB_COMMIT": "abc"}, "bf16", "set OUT"),
    ({"FA_LIB_COMMIT": "abc", "OUT": "."}, "bf32", "unknown stage 'bf32': expected bf16, fp16 or rest"),
])
def test_one_sweep_script_names_what_is_missing(env, stage, message, tmp_path):
    """benchmarks/one_sweep.sh refuses to measure without the commit to record, the output folder or a known
    stage, before it runs anything."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "one_sweep.sh")
    base = {k: v for k, v in os.environ.items() if k not in ("FA_LIB_COMMIT", "OUT")}
    if "OUT" in env:
        env = dict(env, OUT=str(tmp_path))
    done = subprocess.run(["bash", script, stage], env={**base, **env}, capture_output=True, text=True)
    assert done.returncode != 0 and message in done.stderr, done.stderr

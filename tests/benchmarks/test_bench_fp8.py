"""The FP8 benchmark (``python -m benchmarks.bench_fp8``) on CPU: its points and FLOP convention, its arguments, its
quantizer, its correctness check on a small problem (fa_lib's kernel under the interpreter), and that without CUDA
it stops at once, saying why."""
import pytest
import torch

from benchmarks import bench_fp8


def test_points_and_flops():
    pts = list(bench_fp8.points())
    assert len(pts) == 12 and all(p["b"] * p["n"] == 16384 and p["d"] == 128 for p in pts)
    assert {(p["hq"], p["hkv"]) for p in pts} == {(16, 16), (32, 8)}
    full = dict(b=4, hq=16, hkv=16, n=4096, d=128, causal=False)
    assert bench_fp8.point_flops(full) == 4 * 4 * 16 * 128 * 4096 * 4096
    # bottom-right causal: n (n + 1) / 2 visible pairs
    assert bench_fp8.point_flops(dict(full, causal=True)) == 4 * 4 * 16 * 128 * 4096 * 4097 // 2


def test_arguments():
    args = bench_fp8.parse_args(["--out-dir", "x", "--lengths", "4096", "--config", "128,64,8,2"])
    assert args.out_dir == "x" and args.lengths == [4096] and args.config == (128, 64, 8, 2)
    with pytest.raises(SystemExit):
        bench_fp8.parse_args(["--config", "128,64"])


def test_without_cuda_it_stops_at_once(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench_fp8.main(["--out-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_quantize_per_head_and_the_check():
    from fa_lib.fp8 import flash_attention_fp8

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 40, 32, generator=gen) * s for h, s in ((4, 3.0), (2, 3.0), (2, 1.0)))
    (q8, qd), (k8, kd), (v8, vd) = (bench_fp8.quantize_per_head(x, 2) for x in (q, k, v))
    assert qd.shape == (2, 2) and qd.dtype == torch.float32 and q8.dtype == torch.float8_e4m3fn
    assert q8.float().abs().amax() == 448.0
    dq = q8.float() * qd.repeat_interleave(2, dim=1)[:, :, None, None]
    assert ((dq - q).abs() <= 2.0 ** -4 * q.abs() + 2.0 ** -9 * qd.max()).all()
    o8 = flash_attention_fp8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    check = bench_fp8.check_point(o8, q8, k8, v8, (qd, kd, vd), causal=True, chunk=16)
    assert check["ok"] and check["heads_checked"] == 2 and 0 < check["max_err_over_bound"] <= 1


def test_one_point_end_to_end_on_cpu():
    """`bench_point`'s pipeline at a tiny shape: fa_lib's FP8 and bf16 kernels under the interpreter, a stand-in
    timer, cuDNN refused on CPU and recorded as null, the check within the bound, a record that JSON writes."""
    import json

    p = dict(b=1, hq=4, hkv=2, n=40, d=32, causal=True)
    r = bench_fp8.bench_point(p, warmup=1, rep=1, device="cpu", timer=lambda fn, warmup, rep: (fn(), 2.0)[1])
    assert r["ms"]["cudnn_bf16"] is None and r["tflops"]["cudnn_bf16"] is None and "cudnn_error" in r
    assert r["flops"] == 4 * 4 * 32 * (40 * 41 // 2) and r["ratio_fp8_over_bf16"] == 1.0
    assert r["check"]["ok"] and r["check"]["heads_checked"] == 2
    json.dumps(r)
    assert "bound ok" in bench_fp8._line(r)

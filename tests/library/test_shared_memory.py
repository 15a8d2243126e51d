"""Blocks that fit the device's shared memory (`fa_lib.kernels.fit`): the H200's tables unchanged on sm_90, smaller
blocks where a GPU has less, and the fitted blocks compiled ahead of time for such a GPU (no GPU needed)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fa_lib import dispatch, kernels

ROOT = Path(__file__).resolve().parents[2]
SM90, SM80, SM86 = kernels.SHARED_MEMORY[(9, 0)], kernels.SHARED_MEMORY[(8, 0)], kernels.SHARED_MEMORY[(8, 6)]


def _table_rows():
    for kernel, table in kernels.DEFAULT_TABLE.items():
        for (elt_bytes, head_dim), rows in table.items():
            for _, _, config in rows:
                yield kernel, elt_bytes, head_dim, config
    for (kernel, elt_bytes, head_dim), (_, small) in kernels.SMALL_GRID.items():
        yield kernel, elt_bytes, head_dim, small


def test_every_row_of_the_h200_tables_fits_the_h200():
    """The rule changes no 16-bit launch on the GPU the tables were measured on."""
    for kernel, elt_bytes, head_dim, config in _table_rows():
        assert kernels.fit(kernel, config, head_dim, elt_bytes, SM90) == config, (kernel, head_dim, config)
    for d in (32, 64, 128, 256):
        for rows in (1, 4, 16, 64):
            for waves in (0.0, 1.5, 5.0):
                config = dispatch._config(d, rows, waves=waves, n_keys=16384, interpret=False)
                assert config == dispatch._config(d, rows, waves=waves, n_keys=16384, interpret=False,
                                                  shared_memory=SM90)


@pytest.mark.parametrize("limit", [SM80, SM86])
def test_fitted_blocks_are_within_the_limit_and_no_larger_than_asked(limit):
    for kernel, elt_bytes, head_dim, config in _table_rows():
        for elt in (elt_bytes, 4):
            fitted = kernels.fit(kernel, config, head_dim, elt, limit)
            assert kernels.shared_memory(kernel, fitted, head_dim, elt) <= limit
            assert all(f <= c for f, c in zip(fitted, config)) and min(fitted[:2]) >= 16
            if kernels.shared_memory(kernel, config, head_dim, elt) <= limit:
                assert fitted == config
    # decoding keeps its packed query rows while key blocks and stages can still be cut
    assert kernels.fit("decode", (64, 64, 4, 3), 256, 2, limit, keep_rows=True)[0] == 64
    last_resort = kernels.fit("decode", (64, 64, 4, 3), 256, 4, limit, keep_rows=True)
    assert kernels.shared_memory("decode", last_resort, 256, 4) <= limit
    assert last_resort[1:] == (16, 4, 1) or last_resort[0] == 64


def test_no_limit_is_the_table():
    assert kernels.fit("fwd", (128, 128, 8, 3), 128, 2, None) == (128, 128, 8, 3)
    assert kernels.fit("fwd", (128, 128, 8, 3), 128, 2, SM86) == (64, 64, 4, 3)


@pytest.mark.skipif(not kernels.INTERPRET, reason="the interpreter's own limit")
def test_the_interpreter_has_no_limit():
    import torch

    assert kernels.device_shared_memory(torch.device("cuda", 0)) is None


# Compiled for a target in a child process: fa_lib's kernels must be compiled kernels there, not interpreted ones.
_COMPILE = r"""
import json, os, sys
sys.path[:0] = [os.path.join(sys.argv[1], "tests"), sys.argv[1]]
import decisions, sm90
from fa_lib import launch
from triton.backends.compiler import GPUTarget
from torch._subclasses.fake_tensor import unset_fake_temporarily
import torch

cc, problems = int(sys.argv[2]), json.loads(sys.argv[3])

class Target(sm90.SM90Target):
    def get_current_target(self):
        return GPUTarget("cuda", cc, 32)

compiled = []

def compile_it(kernel, grid, args, kwargs):
    from triton.runtime import driver
    before = driver._active
    driver.set_active(Target())
    try:
        with unset_fake_temporarily():
            real = [torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        c = kernel.warmup(*real, grid=grid, **kwargs)
        compiled.append([kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__,
                         [kwargs.get(k) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")], c.metadata.shared])
    finally:
        driver._active = before

with decisions.simulated_gpu((cc // 10, cc % 10), 108, 40 << 20) as rec:
    launch.launch = compile_it
    decisions._current[0] = rec
    for p in problems:
        decisions.decide(p)
print(json.dumps(compiled))
"""


def _compiled(cc, problems):
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(ROOT), str(cc), json.dumps(problems)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _dense(d, dtype="bf16", causal=False, n=4096):
    return dict(kind="dense", b=1, hq=2, hkv=2, nq=n, nk=n, d=d, dtype=dtype, causal=causal, deterministic=True)


def _decode(d, nq, dtype="bf16"):
    return dict(kind="decode", b=8, hq=32, hkv=8, nq=nq, nk=16384, d=d, dtype=dtype, causal=True)


def test_fitted_blocks_compile_within_a_99_kib_gpu():
    """sm_86 (an RTX 3090; sm_89 has the same 99 KiB): the H200's blocks at d = 128 and 256 would need up to 168 KiB
    (the forward's 128 x 128 tiles at d = 128: 160 KiB); the fitted ones compile within the card's limit."""
    launches = _compiled(86, [_dense(128), _dense(256, causal=True), _decode(128, 1), _decode(256, 16)])
    kernels_seen = {name for name, _, _ in launches}
    assert {"_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_decode_split"} <= kernels_seen
    for name, config, shared in launches:
        assert shared <= SM86, (name, config, shared)


def test_float32_decoding_blocks_compile_within_the_h200():
    """A float32 KV cache at d = 256 on sm_90: the 16-bit decoding blocks would need 336 KiB; the fitted ones fit."""
    launches = _compiled(90, [_decode(256, 16, "fp32"), _decode(256, 1, "fp32")])
    assert any(name == "_decode_split" for name, _, _ in launches)
    for name, config, shared in launches:
        assert shared <= SM90, (name, config, shared)

"""A prefill over a paged KV cache: fa_lib.flash_attention_varlen(..., block_table=) and flash_attn_varlen_func's
block_table (vLLM's chunked prefill and prefix caching), and its NumPy mirror, reference.varlen_attention.

Under the interpreter in CI: the paged call gives the bits of the same keys laid end to end (the unpaged varlen
call), for pages of any size, GQA, windows and soft caps; by the flash-attn 2x rule against float64 attention;
a prompt prefilled in chunks over its own pages gives the one-shot prefill's rows. Marked `gpu`: the same at
prefill sizes on a CUDA device.
"""
import os

import numpy as np
import pytest
import torch

import fa_lib
from fa_lib import decode, kernels, reference
from fa_lib.testing import assert_flash_rule, attention_ref
from kernel_cases import BF16, F16, F32

DEVICE = "cpu" if kernels.INTERPRET else "cuda"
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
gpu = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (run `make gpu-test` on a GPU)")]


def _cu(lengths, device=DEVICE):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device=device)


def _case(lq, lk, hq, hkv, d, page, dtype, seed, spare=3, device=DEVICE):
    """Packed queries, a pool of pages (num_pages, page, H_kv, d) holding each sequence's keys in a shuffled
    order (`decode.page_packed`, then `spare` pages no sequence lists, filled with 9s), the block table, and the
    same keys laid end to end (total_k, H_kv, d), as the unpaged varlen call takes them."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q = mk(sum(lq), hq, d)
    k, v = mk(sum(lk), hkv, d), mk(sum(lk), hkv, d)
    w = max([-(-n // page) for n in lk] + [1])
    order = torch.randperm(len(lk) * w, generator=g)
    (k_pool, table), (v_pool, _) = (decode.page_packed(t, _cu(lk, device), page, order) for t in (k, v))
    k_pool, v_pool = (torch.cat((pool, torch.full((spare,) + pool.shape[1:], 9.0, dtype=dtype, device=device)))
                      for pool in (k_pool, v_pool))
    return q, k, v, k_pool, v_pool, table


def test_page_packed_lays_each_sequences_keys_in_its_pages():
    keys = torch.arange(2 * 11 * 1 * 2, dtype=torch.float32).view(22, 1, 2)[:13]  # 13 keys: sequences of 9 and 4
    pool, table = decode.page_packed(keys, _cu([9, 4], "cpu"), 4, order=[5, 0, 2, 1, 3, 4])
    assert table.tolist() == [[5, 0, 2], [1, 3, 4]] and pool.shape == (6, 4, 1, 2)
    assert torch.equal(pool[[5, 0, 2]].reshape(12, 1, 2)[:9], keys[:9])
    assert torch.equal(pool[[1, 3, 4]].reshape(12, 1, 2)[:4], keys[9:]) and not pool[[3, 4]].any()
    assert torch.equal(pool[2, 1:], torch.zeros(3, 1, 2))  # past the last key of its sequence: zeros
    for bad, match in ((dict(page_size=0), "page_size must be a positive int"),
                       (dict(order=[0, 1, 2, 3, 4, 4]), r"order must be a permutation of range\(B \* W\)"),
                       (dict(keys=keys[0]), "keys must be a 3-D torch.Tensor")):
        kwargs = dict(keys=keys, cu_seqlens_k=_cu([9, 4], "cpu"), page_size=4) | bad
        with pytest.raises(ValueError, match=match):
            decode.page_packed(**kwargs)


CASES = [  # id, query lengths, key lengths, (H_q, H_kv, d), page, dtype, masks
    ("causal-prefix-cached", [3, 0, 7, 1], [10, 4, 7, 23], (4, 2, 32), 5, F16, dict(causal=True)),
    ("pages-of-one", [2, 5], [9, 5], (2, 1, 16), 1, F32, dict(causal=True)),
    ("whole-blocks", [20, 1, 16], [40, 33, 16], (2, 2, 16), 16, BF16, dict(causal=True)),
    ("pages-across-blocks", [4, 9], [50, 9], (4, 1, 16), 24, F16, dict()),
    ("window-softcap", [6, 12], [30, 12], (2, 1, 32), 8, F32, dict(causal=True, window=(7, 0), softcap=15.0)),
    ("no-keys-and-empty", [3, 2, 0], [0, 6, 0], (2, 2, 16), 4, F16, dict(causal=False)),
]


@pytest.mark.parametrize("lq, lk, heads, page, dtype, masks", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_a_paged_prefill_gives_the_bits_of_its_keys_laid_end_to_end(lq, lk, heads, page, dtype, masks):
    hq, hkv, d = heads
    q, k, v, k_pool, v_pool, table = _case(lq, lk, hq, hkv, d, page, dtype, seed=sum(lq) + 7 * page)
    cu_q, cu_k = _cu(lq), _cu(lk)
    o, lse = fa_lib.flash_attention_varlen(q, k_pool, v_pool, cu_q, cu_k, max(lq), max(lk), return_lse=True,
                                           block_table=table, **masks)
    want, want_lse = fa_lib.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True, **masks)
    assert torch.equal(o, want) and torch.equal(lse, want_lse)
    # by the flash rule against attention in float64 (and in the input dtype), one sequence at a time
    gold, base = {}, {}
    for name, upcast, into in (("gold", True, gold), ("base", False, base)):
        os_, ls_ = [], []
        for b in range(len(lq)):
            qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None]
            kb, vb = (t[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None] for t in (k, v))
            if qb.shape[2] and kb.shape[2]:
                ob, lb = attention_ref(qb, kb, vb, upcast=upcast, **masks)
            else:  # no query, or no key: o = 0, LSE = -inf
                ob = torch.zeros(qb.shape, dtype=torch.float64 if upcast else dtype, device=DEVICE)
                lb = torch.full(qb.shape[:3], float("-inf"), dtype=torch.float64 if upcast else torch.float32,
                                device=DEVICE)
            os_.append(ob[0].transpose(0, 1))
            ls_.append(lb[0])
        into.update(o=torch.cat(os_), lse=torch.cat(ls_, dim=1))
    assert_flash_rule(dict(o=o, lse=lse), gold, base, names=("o", "lse"))
    # the NumPy mirror reads the same pool through the same table
    ro, rl = reference.varlen_attention(q.double().cpu().numpy(), k_pool.double().cpu().numpy(),
                                        v_pool.double().cpu().numpy(), cu_q.cpu().numpy(), cu_k.cpu().numpy(),
                                        block_table=table.cpu().numpy(), **masks)
    np.testing.assert_allclose(ro, gold["o"].cpu().numpy(), atol=1e-12)
    np.testing.assert_array_equal(np.isinf(rl), torch.isinf(gold["lse"]).cpu().numpy())


def test_a_head_dim_of_96_takes_one_tile_over_pages():
    """A head dim the unpaged kernel splits into two column tiles (64 + 32) runs as one padded tile of 128 over
    pages: not the same bits, but within float32 rounding of them."""
    q, k, v, k_pool, v_pool, table = _case([5, 9], [12, 30], 2, 1, 96, 8, F32, seed=96)
    args = (_cu([5, 9]), _cu([12, 30]), 9, 30)
    got = fa_lib.flash_attention_varlen(q, k_pool, v_pool, *args, causal=True, block_table=table)
    want = fa_lib.flash_attention_varlen(q, k, v, *args, causal=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_over_pages_gives_the_one_shot_prefill():
    """vLLM's chunked prefill: a prompt of 37 tokens prefilled in chunks of 16, 16 and 5 over its own pages, each
    chunk's queries attending (causal, bottom-right) to every key cached so far, gives the rows of prefilling
    the whole prompt at once; a second sequence prefills at the same time in the same calls."""
    n, page, d = 37, 8, 16
    q, k, v, k_pool, v_pool, table = _case([n, 20], [n, 20], 4, 2, d, page, F32, seed=37)
    one_shot = fa_lib.flash_attention_varlen(q, k, v, _cu([n, 20]), _cu([n, 20]), n, n, causal=True)
    got, done = [], [0, 0]
    for chunk in ((16, 10), (16, 10), (5, 0)):
        starts = [done[0], n + done[1]]
        q_chunk = torch.cat([q[s:s + c] for s, c in zip(starts, chunk)])
        done = [done[0] + chunk[0], done[1] + chunk[1]]
        o = fa_lib.flash_attention_varlen(q_chunk, k_pool, v_pool, _cu(list(chunk)), _cu(done), max(chunk),
                                          max(done), causal=True, block_table=table)
        got.append((o[:chunk[0]], o[chunk[0]:]))
    first = torch.cat([g[0] for g in got])
    second = torch.cat([g[1] for g in got])
    torch.testing.assert_close(first, one_shot[:n], rtol=0, atol=2e-6)
    torch.testing.assert_close(second, one_shot[n:], rtol=0, atol=2e-6)


def test_flash_attn_varlen_func_takes_a_block_table():
    q, k, v, k_pool, v_pool, table = _case([3, 6], [11, 6], 2, 1, 16, 4, F16, seed=4)
    args = (_cu([3, 6]), _cu([11, 6]), 6, 11)
    got = fa_lib.flash_attn_varlen_func(q, k_pool, v_pool, *args, causal=True, window_size=(5, 0), softcap=9.0,
                                        block_table=table)
    assert torch.equal(got, fa_lib.flash_attention_varlen(q, k, v, *args, causal=True, window=(5, 0), softcap=9.0))


@pytest.mark.parametrize("change, error, match", [
    (dict(grad=True), ValueError, r"over a paged cache \(block_table\) is forward only"),
    (dict(table_dtype=torch.int64), TypeError, "block_table must be a torch.int32 tensor"),
    (dict(table_shape=(3, 4)), ValueError, r"block_table must have shape \(batch, pages per sequence\) = \(2, W\)"),
    (dict(entry=(1, 1, 9)), ValueError, r"sequence 1 has 6 keys \(cu_seqlens_k\): block_table\[1\] must list "
                                         r"cdiv\(6, page_size = 4\) = 2 pages in \[0, num_pages = 7\)"),
    (dict(lk=[11, 17]), ValueError, r"sequence 1 has 17 keys .* within its 3 entries"),
    (dict(k_dim=3), ValueError, r"with a block_table, k must be a pool of pages \(num_pages, page_size, heads, "
                                r"head_dim\)"),
    (dict(v_shape=True), ValueError, "v must have the shape of k"),
    (dict(table_list=True), TypeError, "block_table must be a torch.Tensor"),
    (dict(cu_k_end=True), TypeError, "cu_seqlens_k must have dtype torch.int32"),
])
def test_bad_paged_prefill_input_is_named(change, error, match):
    # two sequences of 11 and 6 keys in pages of 4: 3 and 2 pages; the pool has 3 * 2 + 1 = 7 pages
    q, k, v, k_pool, v_pool, table = _case([3, 6], [11, 6], 2, 1, 16, 4, F16, seed=5, spare=1)
    lk = change.get("lk", [11, 6])
    cu_k = _cu(lk).long() if change.get("cu_k_end") else _cu(lk)
    if "table_dtype" in change:
        table = table.to(change["table_dtype"])
    if "table_shape" in change:
        table = torch.zeros(change["table_shape"], dtype=torch.int32, device=DEVICE)
    if "entry" in change:
        b, w, p = change["entry"]
        table[b, w] = p
    if change.get("table_list"):
        table = table.tolist()
    if change.get("k_dim"):
        k_pool = k
    if change.get("v_shape"):
        v_pool = v_pool[:, :2]
    if change.get("grad"):
        q = q.clone().requires_grad_()
    with pytest.raises(error, match=match):
        fa_lib.flash_attention_varlen(q, k_pool, v_pool, _cu([3, 6]), cu_k, 6, max(lk), block_table=table)


def test_the_numpy_mirror_names_a_bad_paged_input():
    q, k_pool = np.zeros((5, 2, 8)), np.zeros((4, 2, 1, 8))
    cu_q, cu_k = np.array([0, 2, 5], np.int32), np.array([0, 3, 9], np.int32)
    with pytest.raises(ValueError, match=r"sequence 1 has 6 keys: block_table\[1\] must list ceil\(6 / 2\) pages"):
        reference.varlen_attention(q, k_pool, k_pool, cu_q, cu_k, block_table=np.array([[0, 1, 2], [3, 5, 1]]))
    with pytest.raises(ValueError, match="forward only"):
        reference.varlen_attention(q, k_pool, k_pool, cu_q, cu_k, block_table=np.array([[0, 1], [2, 3]]), do=q)


def test_torch_compile_fullgraph_and_the_operators_fake():
    """Under torch.compile(fullgraph=True) the paged prefill is one operator, fa_lib::flash_attn_varlen_paged_fwd,
    with the eager call's bits; the host check is skipped there, so a page index outside the pool is clamped into
    it (as the kernel clamps), never read outside it."""
    q, k, v, k_pool, v_pool, table = _case([3, 6], [11, 6], 2, 1, 16, 4, F16, seed=6, spare=0)
    cu_q, cu_k = _cu([3, 6]), _cu([11, 6])

    def prefill(q, kp, vp, t):
        return fa_lib.flash_attention_varlen(q, kp, vp, cu_q, cu_k, 6, 11, causal=True, block_table=t)

    want = prefill(q, k_pool, v_pool, table)
    torch._dynamo.reset()
    compiled = torch.compile(prefill, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k_pool, v_pool, table), want)
    bad = table.clone()
    bad[0, 0] = 99  # past the pool's 6 pages: read as the last one
    clamped = table.clone()
    clamped[0, 0] = k_pool.shape[0] - 1
    assert torch.equal(compiled(q, k_pool, v_pool, bad), prefill(q, k_pool, v_pool, clamped))
    torch.library.opcheck(torch.ops.fa_lib.flash_attn_varlen_paged_fwd.default,
                          (q, k_pool, v_pool, cu_q, cu_k, 6, 11, True, 0.25, -1, -1, 0.0, table),
                          test_utils=("test_schema", "test_faketensor"))


_COMPILE = """
import json, sys
import torch
sys.path[:0] = sys.argv[1:2]
from sm90 import compiling_for_sm90
from fa_lib import kernels

out = {}
for page in (0, 256, 16):
    q = torch.empty(1, 32, 8192, 128, dtype=torch.bfloat16)
    kv = torch.empty(1, 8, 8192, 128, dtype=torch.bfloat16) if not page else \\
        torch.empty(64, page, 8, 128, dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.empty(1, 32, 8192)
    cu = torch.empty(5, dtype=torch.int32)
    table = torch.empty(4, 64, dtype=torch.int32)
    paged = dict(Table=table, stride_tz=64, N_PAGES=64, PAGE=page) if page else {}
    with compiling_for_sm90():
        k = kernels._attn_fwd.warmup(
            q, kv, kv, 0.1, lse, q, q, q, cu, cu, 1.0, *q.stride(), *kv.stride(), *kv.stride(), *q.stride(), 0,
            0, 8192, 32, 4, 4096, 4096, 0, 0, 128, 4096, 4096, 4, HEAD_DIM=128, CAUSAL=True, LOCAL=False, SOFTCAP=0,
            HAS_KPM=False, VARLEN=True, MASK_D=False, HEAD_DIM2=0, EMULATE_BF16=False, PRECISION="tf32",
            ADDR="i64", BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, grid=(1,), **paged)
    out[str(page)] = dict(copies=k.asm["ttgir"].count("async_copy_global_to_local"), shared=k.metadata.shared)
print(json.dumps(out))
"""


def test_the_paged_forward_compiles_for_sm90_with_the_unpaged_pipeline():
    """The varlen forward over pages, compiled ahead of time for the H200 on this CPU machine (bf16, d = 128,
    causal, the H200's 128 x 64 blocks): its K and V loads are pipelined as the unpaged ones (the same
    shared-memory buffers and asynchronous copies), pages of whole blocks (256) or not (16)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", _COMPILE, str(root / "tests")], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="0"), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["0"]["copies"] >= 2 and got["256"] == got["0"] and got["16"] == got["0"], got


@pytest.mark.parametrize("dtype, page", [pytest.param(d, p, marks=gpu) for d in (F16, BF16) for p in (256, 16)])
def test_gpu_paged_prefill_at_prefill_sizes(dtype, page):
    """Chunked prefill at serving sizes: chunks of 1 to 2048 queries over 0 to 8k cached keys, 32/8 heads, d = 128:
    the bits of the unpaged varlen call on the same keys."""
    lq, lk = [2048, 1, 512, 0, 1000], [8192, 4000, 512, 77, 3000]
    q, k, v, k_pool, v_pool, table = _case(lq, lk, 32, 8, 128, page, dtype, seed=page)
    args = (_cu(lq), _cu(lk), max(lq), max(lk))
    for masks in (dict(causal=True), dict(causal=True, window=(1023, 0), softcap=30.0)):
        got = fa_lib.flash_attention_varlen(q, k_pool, v_pool, *args, block_table=table, **masks)
        want = fa_lib.flash_attention_varlen(q, k, v, *args, **masks)
        assert torch.equal(got, want)

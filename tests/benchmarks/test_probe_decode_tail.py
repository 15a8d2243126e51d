"""benchmarks/probes/probe_decode_tail.py and benchmarks/probes/probe_decode_ws.py on a machine without a GPU: the variant strings parse as
their data files record them, and their kernels still compile for sm_90 with Triton's own ptxas for each kind of
variant timed (the merge protocols, TMA descriptors, the L2 prefetches; the warp-specialised Gluon kernel), so that a
new run on the H200 measures what the committed files describe."""
import json
import os
import subprocess
import sys

from book_toc import ROOT

import benchmarks.data

from benchmarks.probes import probe_decode_tail


def test_variant_strings_parse_as_the_data_files_record_them():
    for part in ("probe-decode-tail", "probe-decode-prefetch", "probe-decode-warps", "probe-decode-shapes"):
        data = benchmarks.data.load_json(f"{part}-nvidia-h200.json")
        assert "probe_decode_tail" in data["command"].split()[1] and data["note"]
        for point in data["points"]:
            assert point["variants"] and set(point["best_us"]) >= set(point["variants"]) - set(point["errors"])
            for name, cfg in point["variants"].items():
                spec = name + "=" + ",".join(str(cfg.get(f, 0)) for f in probe_decode_tail.FIELDS)
                assert probe_decode_tail.parse(spec) == (name, {f: cfg.get(f, 0) for f in probe_decode_tail.FIELDS})
    assert probe_decode_tail.parse("x=16,128,4,3,1,0,0,0,1,2,4")[1]["ahead"] == 4
    assert probe_decode_tail.rows_c(4, 16) == 4 and probe_decode_tail.rows_c(64, 16) == 4
    assert probe_decode_tail.rows_c(64, 128) == 1


# Compiled in a child process with TRITON_INTERPRET=0: in this one fa_lib may have switched Triton to its interpreter,
# and the probe's kernels would then be interpreted functions.
_COMPILE = """
import json, sys
import torch
sys.path[:0] = sys.argv[1:3]
from benchmarks.probes import probe_decode_tail as P
from sm90 import compiling_for_sm90

out = {}
for spec, nq in json.loads(sys.argv[3]):
    name, cfg = P.parse(spec)
    h_kv, group, n_k, s = 8, 4, 16384, cfg["splits"]
    q = torch.empty(1, h_kv * group, nq, 128, dtype=torch.bfloat16)
    cache = torch.empty(1, h_kv, n_k, 128, dtype=torch.bfloat16)
    part = torch.empty(s, h_kv * group, nq, 128)
    with compiling_for_sm90():
        k = P._dec.warmup(q, cache, cache, torch.empty(1, dtype=torch.int32), part, part[..., 0], q,
                          torch.empty(h_kv, dtype=torch.int32), n_k, 0.1, s, grid=(1,),
                          **P.constexprs(cfg, h_kv, group, nq))
    out[spec] = dict(ptx=k.asm["ptx"], shared=k.metadata.shared)
print(json.dumps(out))
"""

CASES = [("base=16,128,4,3,1,0,1,0,1", 1, "atom.global.gpu.acq_rel.add"),
         ("merger=16,128,4,3,2,0,1,0,1", 1, "ld.global.gpu.acquire"),
         ("desc=16,128,2,3,1,0,0,1,1", 4, "cp.async.bulk.tensor"),
         ("pre2ahead2=16,128,4,3,4,0,0,0,1,2,2", 1, "cp.async.bulk.prefetch.L2.global")]


def test_each_kind_of_variant_compiles_for_sm90_without_a_gpu():
    env = dict(os.environ, TRITON_INTERPRET="0")
    cases = json.dumps([c[:2] for c in CASES])
    run = subprocess.run([sys.executable, "-c", _COMPILE, str(ROOT), str(ROOT / "tests"), cases],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = json.loads(run.stdout.strip().splitlines()[-1])
    for spec, _, ptx_has in CASES:
        ptx, cfg = compiled[spec]["ptx"], probe_decode_tail.parse(spec)[1]
        assert ptx_has in ptx and compiled[spec]["shared"] <= 227 * 1024, spec
        assert ("griddepcontrol.wait" in ptx) == bool(cfg["pdl"]), spec
    # the prefetches of the first blocks come before the wait for the previous kernel, the loop's after it
    ptx = compiled[CASES[3][0]]["ptx"]
    assert ptx.count("prefetch.L2.global") == 6 and ptx.index("prefetch.L2") < ptx.index("griddepcontrol.wait")


_COMPILE_WS = """
import json, sys
import torch
sys.path[:0] = sys.argv[1:3]
import fa_lib.ops  # noqa: F401  (fa_lib watches its settings' modules: the Gluon kernel must still compile)
from benchmarks.probes import probe_decode_ws as W
from fa_lib import kernels_hopper as kh
from sm90 import compiling_for_sm90

out = {}
for spec in sys.argv[3:]:
    c = W.parse(spec)
    q = torch.empty(1, 32, 1, 128, dtype=torch.bfloat16)
    cache = torch.empty(1, 8, 16384, 128, dtype=torch.bfloat16)
    part = torch.empty(2 * c["splits"], 32, 1, 128)
    q_desc = kh._desc(q.view(1, 1, 32, 128), *kh._block(q.dtype, W.ROWS_M, 128))
    kv_desc = kh._desc(cache, *kh._block(cache.dtype, c["block_n"], 128))
    with compiling_for_sm90():
        k = W._dec_ws.warmup(q_desc, kv_desc, kv_desc, part, part[..., 0], torch.empty(1, dtype=torch.int32), 0.1,
                             c["splits"], 32, ROWS=4, BLOCK_N=c["block_n"], HEAD_DIM=128, STAGES=c["stages"],
                             CONSUMER_REGS=kh.CONSUMER_REGS, num_warps=kh.NUM_WARPS, maxnreg=kh.MAX_REGS, grid=(1,))
    out[spec] = dict(ptx=k.asm["ptx"], shared=k.metadata.shared)
print(json.dumps(out))
"""


def test_the_warp_specialised_probe_compiles_for_sm90_without_a_gpu():
    data = benchmarks.data.load_json("probe-decode-ws-nvidia-h200.json")
    assert "probe_decode_ws" in data["command"].split()[1] and data["note"]
    specs = sorted({n for p in data["points"] for n in p["best_us"] if n.startswith("ws:")})
    assert specs == ["ws:16,32,6", "ws:16,64,2", "ws:16,64,3", "ws:8,64,3"]
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", _COMPILE_WS, str(ROOT), str(ROOT / "tests"), *specs],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = json.loads(run.stdout.strip().splitlines()[-1])
    for spec in specs:
        ptx = compiled[spec]["ptx"]
        # a load warp's TMA copies, the consumers' asynchronous wgmma, the partitions' register budgets
        assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx and "setmaxnreg" in ptx, spec
        assert compiled[spec]["shared"] <= 227 * 1024, spec

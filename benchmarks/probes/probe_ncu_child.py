"""Child of an ncu probe: warm up fa_lib's backward at a causal and a windowed point, then run one backward of
each between cudaProfilerStart/Stop (ncu --profile-from-start off profiles only those)."""
import sys
from pathlib import Path

import torch  # noqa: E402

import fa_lib  # noqa: E402

for causal, window in ((True, (-1, -1)), (True, (4096, 0))):
    q, k, v, do = (torch.randn(2, 16, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = fa_lib.flash_attention(q, k, v, causal=causal, window=window)
    for _ in range(3):
        o.backward(do, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    o.backward(do, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()

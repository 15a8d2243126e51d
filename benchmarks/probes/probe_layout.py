"""On a CUDA machine: fa_lib's backward with inputs laid out (B, H, N, D) contiguous against the same values
as views of a (B, N, H, D) storage (the layout of most models), and the strides of o and of the gradients.

    python3 -m benchmarks.probes.probe_layout
"""
import sys
from pathlib import Path

import torch  # noqa: E402

import fa_lib  # noqa: E402
from benchmarks.bench import _median_ms  # noqa: E402

b, h, n, d = 2, 16, 8192, 128
for layout in ("bhnd", "bnhd"):
    shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    if layout == "bnhd":
        q, k, v, do = (x.transpose(1, 2) for x in (q, k, v, do))
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = fa_lib.flash_attention(q, k, v, causal=True, window=(1024, 0))
    ms = _median_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v])
    o.backward(do, retain_graph=True)
    print(f"{layout}: backward {ms:.3f} ms; o.stride()={o.stride()} q.grad.stride()={q.grad.stride()} "
          f"q.stride()={q.stride()}", flush=True)
